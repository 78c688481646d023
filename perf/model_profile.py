"""Where a compiled MiniMax-H3 forward spends its GPU time: diffusers' model unpatched against
`h3cute.patch(scope="model")`, both under torch.compile (Inductor, default mode), kernels grouped by what they
compute.

Each variant runs in a child process (scope="model" needs vLLM's cuBLASLt settings before CUDA starts): the model at
H3's widths (2 blocks), one packed sequence of S rows, B = 1, the no-grad forward (the rollout) or fwd+bwd; after
warm-up, torch.profiler records `--calls` calls and every CUDA kernel's device time is summed by name and by group
(GEMM, attention, h3cute's CuTe DSL kernels, Inductor's Triton kernels, torch's eager kernels, copies).

Run: `bash perf/device_run.sh python3 perf/model_profile.py [--rows 4097] [--phase fwd]` (FlashAttention-4 needs
the DSL: docs/DEVICE.md). Writes $H3CUTE_OUT/model_profile.{json,md} (else ./).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import torch

from h3cute import invariant
from h3cute.bench.report import child_json, environment, h3cute_commit

VARIANTS = ("unpatched", "model")
# (group, regex on the kernel name), first match wins
GROUPS = (
    ("attention", r"flash|fmha|attn|cudnn"),
    ("gemm", r"gemm|cutlass.*(sm90|sm80)|nvjet|xmma|cublas|sm90_"),
    ("triton (Inductor)", r"^triton_"),
    ("h3cute (CuTe DSL)", r"^kernel_|h3|cute"),
    ("copy / fill", r"copy|fill|memset|memcpy|CatArray|index"),
    ("torch elementwise / reduction", r"elementwise|reduce|vectorized|Reduce|norm|rms"),
)


def group_of(name: str) -> str:
    for group, pattern in GROUPS:
        if re.search(pattern, name, flags=re.I):
            return group
    return "other"


def run_variant(variant: str, rows: int, phase: str, calls: int) -> dict:
    import h3cute
    from h3cute.bench.model import H3_TWO_BLOCKS, build_model, packed_inputs
    from h3cute.bench.model_bench import layout

    device = torch.device("cuda")
    model = build_model(H3_TWO_BLOCKS, device=device, seed=0)
    inputs = packed_inputs(H3_TWO_BLOCKS, **layout(rows), timesteps=3, batch=1, device=device, seed=1)
    if variant == "model":
        h3cute.patch(model, scope="model")
    fn = torch.compile(model, dynamic=False)
    upstream = None
    if phase == "fwd_bwd":
        g = torch.Generator(device=device).manual_seed(9)
        upstream = [torch.randn(inputs[k].shape, generator=g, device=device)
                    for k in ("hidden_states", "audio_hidden_states")]

    def call():
        if phase == "fwd":
            with torch.no_grad():
                fn(**inputs)
            return
        model.zero_grad(set_to_none=True)
        out = fn(**inputs)
        torch.autograd.backward([out.sample, out.audio_sample], upstream)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            call()
        torch.cuda.synchronize()
    kernels: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels.setdefault(e.name, [0.0, 0])
            k[0] += getattr(e, "device_time_total", None) or e.cuda_time_total
            k[1] += 1
    per_call = {n: {"us": t / calls, "launches": c // calls, "group": group_of(n)} for n, (t, c) in kernels.items()}
    groups: dict[str, float] = {}
    for k in per_call.values():
        groups[k["group"]] = groups.get(k["group"], 0.0) + k["us"]
    return {"variant": variant, "rows": rows, "phase": phase, "calls": calls,
            "total_us": sum(k["us"] for k in per_call.values()), "groups_us": groups,
            "kernels": dict(sorted(per_call.items(), key=lambda kv: -kv[1]["us"]))}


def markdown(report: dict) -> str:
    runs = {r["variant"]: r for r in report["runs"]}
    lines = [f"# Compiled MiniMax-H3 forward: GPU time by kernel group ({report['environment'].get('gpu')})", "",
             f"H3 widths, 2 blocks, S = {report['rows']}, B = 1, {report['phase']}, torch.compile default; "
             "µs of kernel time per call (torch.profiler), not wall time.", "",
             "| group | " + " | ".join(runs) + " |", "| --- |" + " --- |" * len(runs)]
    groups = sorted({g for r in runs.values() for g in r["groups_us"]})
    for g in groups:
        lines.append(f"| {g} | " + " | ".join(f"{r['groups_us'].get(g, 0.0):.0f}" for r in runs.values()) + " |")
    lines.append("| **all kernels** | " + " | ".join(f"**{r['total_us']:.0f}**" for r in runs.values()) + " |")
    for v, r in runs.items():
        lines += ["", f"## {v}: the 25 largest kernels", "", "| kernel | group | launches | µs |",
                  "| --- | --- | --- | --- |"]
        for name, k in list(r["kernels"].items())[:25]:
            lines.append(f"| `{name[:90]}` | {k['group']} | {k['launches']} | {k['us']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=4097)
    ap.add_argument("--phase", choices=("fwd", "fwd_bwd"), default="fwd")
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.variant:
        json.dump(run_variant(args.variant, args.rows, args.phase, args.calls), sys.stdout)
        return 0
    runs = []
    for variant in VARIANTS:
        env = {**os.environ, **(invariant.ENVIRONMENT if variant == "model" else {})}
        cmd = [sys.executable, __file__, "--variant", variant, "--rows", str(args.rows), "--phase", args.phase,
               "--calls", str(args.calls)]
        runs.append(child_json(cmd, env, f"variant {variant}"))
    report = {"kind": "h3_model_profile", "environment": environment(torch.device("cuda"), {}),
              "h3cute": h3cute_commit(), "rows": args.rows, "phase": args.phase, "runs": runs}
    out = args.out or Path(os.environ.get("H3CUTE_OUT", ".")) / "model_profile.json"
    out.write_text(json.dumps(report, indent=1))
    out.with_suffix(".md").write_text(markdown(report))
    sys.stdout.write(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
