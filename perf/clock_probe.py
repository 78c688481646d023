"""Device script: the SM clock and board power each projection GEMM runs at, ours beside cuBLAS's.

    bash perf/device_run.sh python3 perf/clock_probe.py [T] [--seconds S] [--match TEXT ...]

Why: under Nsight Compute (clocks left as they are) our T = 2048 GEMMs took about as many cycles as cuBLAS's
but ran at a lower SM clock (d_temb 2.57 M cycles at 1.54 GHz against cuBLAS's dgrad 2.54 M at 1.64). A GEMM
that holds the H200 at its power limit gets the clock that power allows, so a kernel's time is its cycles over
that clock. This runs each launch back to back for `--seconds` (default 2) while `nvidia-smi` samples the SM
clock, power and active clock-event reasons every 50 ms, and reports per launch: the time per launch (CUDA
events over the sustained stretch), the median clock and power of the samples taken in it (the first 20% of
the stretch dropped: the clock settles), and cycles per launch (time x clock). Launches: our forward, d_temb
and dW GEMMs (each family config timed at this T by perf/adaln_kernels.py that is in the bundle, the pick
first), what follows d_temb in the backward both ways (adaln_dtemb_fold + dW + adaln_bias_grad, or adaln_silu_cast +
the dW kernel with fold warps, each sequence as one launch), cuBLAS's three GEMMs of the replay (F.linear with
bias; grad @ W; grad^T @ act), same shapes, BF16, and the whole fwd+bwd both ways as the prior-art report calls it
(`torch.ops.h3.adaln_projection` against the replay's linear(silu(temb)), autograd, fresh leaves, all-ones upstream,
the report's inputs). `--match` keeps the launches whose name contains TEXT.
Writes `$H3CUTE_OUT/clock_probe.json`.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

from h3cute import runtime
from h3cute.bench.report import write_device_json

sys.path.insert(0, __file__.rsplit("/", 1)[0])
import adaln_kernels as K  # noqa: E402  (the per-launch script's buffers and kernel handles)
import eager_gap  # noqa: E402  (the whole op's fwd+bwd as the report calls it)

QUERY = "clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active"
SETTLE = 0.2  # fraction of each stretch dropped before the samples count


def _query() -> str:
    """QUERY, or with the reasons field under its pre-535 driver name where this nvidia-smi lacks the new one."""
    ok = subprocess.run(["nvidia-smi", f"--query-gpu={QUERY}", "--format=csv,noheader"], capture_output=True).returncode
    return QUERY if ok == 0 else QUERY.replace("clocks_event_reasons", "clocks_throttle_reasons")


def _sampler(query: str):
    return subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "50"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def parse_samples(text: str) -> list:
    """(MHz, W, C, reasons) per line of `--format=csv,noheader,nounits` output; lines that are not four fields
    with three numbers ("[N/A]", a truncated last line) are dropped."""
    rows = []
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        try:
            if len(parts) == 4:
                rows.append((float(parts[0]), float(parts[1]), float(parts[2]), parts[3]))
        except ValueError:
            continue
    return rows


def _samples(proc) -> list:
    proc.terminate()
    out, err = proc.communicate(timeout=10)
    rows = parse_samples(out)
    if not rows and err:
        raise RuntimeError(f"nvidia-smi: {err.strip()[:200]}")
    return rows


def _sustain(fn, seconds: float, query: str) -> dict:
    """fn back to back for `seconds`: launches per second by CUDA events after the settling part, and the
    nvidia-smi samples of that part."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    batch = max(1, int(0.05 / max(time.perf_counter() - t0, 1e-6)))  # ~50 ms of launches between host checks
    proc = _sampler(query)
    start = time.perf_counter()
    while time.perf_counter() - start < SETTLE * seconds:
        for _ in range(batch):
            fn()
        torch.cuda.synchronize()
    first, last = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    count = 0
    first.record()
    while time.perf_counter() - start < seconds:
        for _ in range(batch):
            fn()
        count += batch
        torch.cuda.synchronize()
    last.record()
    last.synchronize()
    total = time.perf_counter() - start
    rows = _samples(proc)
    kept = rows[int(len(rows) * SETTLE):] or rows
    us = first.elapsed_time(last) * 1e3 / count
    mhz = statistics.median(r[0] for r in kept) if kept else None
    reasons = sorted({r[3] for r in kept})
    return {"us": us, "launches": count, "sm_mhz": mhz,
            "power_w": statistics.median(r[1] for r in kept) if kept else None,
            "temp_c": max(r[2] for r in kept) if kept else None, "event_reasons": reasons,
            "mcycles": us * mhz * 1e-6 if mhz else None, "samples": len(kept), "wall_s": total}


def main(argv) -> int:
    parser = argparse.ArgumentParser(prog="clock_probe", description=__doc__.split("\n")[0])
    parser.add_argument("rows", nargs="?", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--match", action="append", metavar="TEXT",
                        help="only the launches whose name contains TEXT (repeatable; default every launch)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("clock_probe: needs a CUDA device", file=sys.stderr)
        return 2
    query = _query()
    dev = torch.device("cuda", 0)
    rows = args.rows
    buf = K._buffers(rows, dev)
    every = K._steps(rows, "wgmma", buf, dev)
    steps = [s for s in every if s[1] in ("proj_fwd", "proj_dgrad", "proj_wgrad", "proj_wgrad_fold")]
    # Every GEMM config at large T would take minutes: the TMA ones (the picks among them).
    steps = [s for s in steps if s[2].startswith("tma_") and not isinstance(s[6], Exception)]
    grad, w, b, act = buf["grad"], buf["w"], buf["b"], buf["act"]
    act.copy_(buf["temb"].bfloat16())
    launches = [(f"h3cute {phase} {step} [{config}]" + (" (pick)" if kind == "step" else ""),
                 (lambda fn=fn, a=a: fn(*a))) for phase, step, config, kind, _, _, fn, a in steps]
    # What follows the d_temb GEMM in the backward, both ways, for each fold-warp tile: the d_temb fold, dW and
    # adaln_bias_grad as three launches, or adaln_silu_cast and the dW kernel with fold warps.
    one = {(s[1], s[2]): s for s in every if not isinstance(s[6], Exception)}
    for c in K.L.candidates("wgrad_fold", "wgmma"):
        parts = {"separate": [one.get(k) for k in (("dtemb_fold", ""), ("proj_wgrad", c), ("bias_grad", ""))],
                 "fold warps": [one.get(k) for k in (("silu_cast", ""), ("proj_wgrad_fold", c))]}
        for how, seq in parts.items():
            if all(seq):
                launches.append((f"h3cute bwd after d_temb, {how} [{c}]",
                                 lambda seq=seq: [fn(*a) for *_, fn, a in seq]))
    launches += [
        ("cuBLAS fwd F.linear(act, W, b)", lambda: F.linear(act, w, b)),
        ("cuBLAS bwd grad @ W (d_a)", lambda: torch.matmul(grad, w)),
        ("cuBLAS bwd grad^T @ act (dW)", lambda: torch.matmul(grad.t(), act)),
    ]
    # The whole op as the report's fwd+bwd calls it, on the report's inputs (its accuracy seed).
    calls = eager_gap.report_calls(rows, dev)
    launches += [("h3cute op fwd+bwd (autograd, report inputs)", calls["h3cute"]),
                 ("cuBLAS replay fwd+bwd (autograd, report inputs)", calls["cuBLAS replay"])]
    if args.match:
        launches = [(name, fn) for name, fn in launches if any(m in name for m in args.match)]
    report = {"gpu": torch.cuda.get_device_name(dev), "arch": runtime.arch_of(dev), "rows": rows,
              "seconds": args.seconds, "query": query, "launches": {}}
    idle = _sampler(query)
    time.sleep(0.5)
    report["idle"] = [list(r) for r in _samples(idle)]
    print(f"T = {rows}: {'launch':<58} {'us':>8} {'MHz':>6} {'W':>6} {'Mcycles':>8}  reasons")
    for name, fn in launches:
        r = _sustain(fn, args.seconds, query)
        report["launches"][name] = r
        print(f"  {name:<58} {r['us']:8.1f} {r['sm_mhz'] or 0:6.0f} {r['power_w'] or 0:6.0f} "
              f"{r['mcycles'] or 0:8.3f}  {' '.join(r['event_reasons'])}")
    print(f"clock_probe -> {write_device_json(report, 'clock_probe.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
