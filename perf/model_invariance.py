"""The proof that `h3cute.patch(transformer, scope="model")` makes MiniMax-H3's whole forward and backward
batch-invariant, eager and compiled, on diffusers' model at H3's widths (2 blocks, 56 heads x 128, FFN 14336,
text 5120).

The proofs, each run in the child process of its (variant, mode) (vLLM's cuBLASLt settings,
`h3cute.invariant.ENVIRONMENT`, are process-wide and read when CUDA starts, so every child starts with them).
A mode is `eager` or a `torch.compile` mode (`default`, `max-autotune-no-cudagraphs`, or `reduce-overhead`: the
rollout under CUDA graphs, the training steps compiled in the default mode); compiled, the model-scope model is
compiled with `fullgraph=True` (a graph break fails the run) and every call below is a compiled module's, so the
no-grad calls run the rollout graph and the grad calls the training graphs:

1. batch    B = 8 samples (different video, audio and text inputs, one packed layout, T = 3). Each sample's video
            and audio outputs, computed alone (B = 1, no_grad: the rollout), inside the batch (B = 8, no_grad), and
            in micro-batches of 1, 2, 4 and 1 samples in shuffled order with grad and gradient checkpointing on
            (training); and its input gradients (video, audio, text inputs; a fixed upstream gradient per sample),
            computed alone with grad and in those micro-batches: bitwise equal. So the rollout is the training
            forward, across the graphs torch.compile makes for them.
2. timesteps  the batch's outputs with a fourth timestep that no row uses: bitwise equal to T = 3.
3. gradients  every parameter's gradient of the batch's fwd+bwd, run twice: bitwise equal.
4. controls   proof 1 for the unpatched model (eager and compiled) and for the conditioning-only patch: each must
            fail; the report says where (which sample, output or gradient, how many elements differ).
5. accuracy   the patched model's outputs (samples 0 and 1) against the same model in FP64: relative L2 error no
            more than ACCURACY_SLACK times the unpatched BF16 model's own (both reported; eager).
6. eager    (compiled modes) each sample's outputs alone and its input gradients: the compiled bits against the
            same model's eager bits, recorded (`vs_eager`): whether a rollout compiled and a training step eager (or
            the reverse) agree.

Run: `bash perf/device_run.sh python3 perf/model_invariance.py [--modes eager,default,...]` (FlashAttention-4
needs the DSL: see docs/DEVICE.md). Writes $H3CUTE_OUT/model_invariance.json (else ./) after every child and prints
a summary; the exit status is non-zero when a proof fails or a child fails. `--quick` runs the tiny model on this
machine (the attention op's FP32 CPU reference stands in for FlashAttention-4): a smoke run of the harness, not a
measurement.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch

from h3cute import invariant
from h3cute.bench.report import child_json, environment, h3cute_commit

LAYOUT = dict(video=600, text=77, audio=130)  # S = 807: no row count a multiple of a tile
BATCH, TIMESTEPS = 8, 3
MICRO_BATCHES = (1, 2, 4, 1)
ACCURACY_SLACK = 1.1
INPUTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")
OUTPUTS = ("sample", "audio_sample")
VARIANTS = ("model", "conditioning", "unpatched")
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune-no-cudagraphs")
MODES = ("eager",) + COMPILE_MODES
# (variant, mode) children besides the model scope's: the controls eager, and the unpatched model compiled
CONTROLS = (("conditioning", "eager"), ("unpatched", "eager"), ("unpatched", "default"))


# ---- one variant, in this process ---------------------------------------------------------------------------

def _sample(inputs: dict, idx: list[int]) -> dict:
    return {k: (v[idx] if k in INPUTS else v) for k, v in inputs.items()}


def _upstream(outputs_like: dict, sample: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(1000 + sample)
    return {k: torch.randn(v.shape[1:], generator=g, device=device, dtype=v.dtype) for k, v in outputs_like.items()}


def _forward(fn, inputs) -> dict:
    """`fn`'s outputs, copied: a CUDA-graph replay (reduce-overhead) reuses its output memory at the next one."""
    if getattr(fn, "_h3_compiled", False):
        torch.compiler.cudagraph_mark_step_begin()
    out = fn(**inputs)
    return {"sample": out.sample.clone(), "audio_sample": out.audio_sample.clone()}


def _fwd_bwd(fn, inputs, samples: list[int], ups: dict) -> tuple[dict, dict]:
    """Outputs and input gradients of `samples` computed together (grad on)."""
    leaves = {k: (v[samples].detach().clone().requires_grad_(True) if k in INPUTS else v) for k, v in inputs.items()}
    if getattr(fn, "_h3_compiled", False):
        torch.compiler.cudagraph_mark_step_begin()
    out = fn(**leaves)
    out = {"sample": out.sample, "audio_sample": out.audio_sample}
    loss_terms = [(out[k] * torch.stack([ups[s][k] for s in samples])).sum() for k in OUTPUTS]
    torch.autograd.backward(loss_terms)
    return ({k: v.detach().clone() for k, v in out.items()}, {k: leaves[k].grad.clone() for k in INPUTS})


def _diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements that differ (a NaN never equals, so a NaN output always counts)."""
    return int((a.reshape(-1) != b.reshape(-1)).sum())


def batch_proof(model, fn, train, inputs, device) -> dict:
    """Proof 1 (see the module docstring) of the rollout `fn` (no-grad calls) and the training `train` (grad calls):
    the model or its compiled modules. {"invariant", "checked", "differ": [where, ...]}, and the samples' outputs
    and input gradients alone (`_alone`, for proof 6)."""
    model.zero_grad(set_to_none=True)
    n = inputs["hidden_states"].shape[0]
    with torch.no_grad():
        together = _forward(fn, inputs)
        alone = [_forward(fn, _sample(inputs, [i])) for i in range(n)]
    ups = {i: _upstream(together, i, device) for i in range(n)}
    alone_grad = [_fwd_bwd(train, inputs, [i], ups) for i in range(n)]
    model.zero_grad(set_to_none=True)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    micro, start = {}, 0
    model.enable_gradient_checkpointing()
    try:
        for size in MICRO_BATCHES:
            group = order[start:start + size]
            start += size
            out, grads = _fwd_bwd(train, inputs, group, ups)
            for j, s in enumerate(group):
                micro[s] = ({k: v[j] for k, v in out.items()}, {k: v[j] for k, v in grads.items()})
    finally:
        model.disable_gradient_checkpointing()
        model.zero_grad(set_to_none=True)
    differ, checked = [], 0
    for i in range(n):
        ref = {k: v[0] for k, v in alone[i].items()}
        pairs = [(f"{k} inside B={n} (no_grad)", together[k][i], ref[k]) for k in OUTPUTS]
        pairs += [(f"{k} alone with grad", alone_grad[i][0][k][0], ref[k]) for k in OUTPUTS]
        pairs += [(f"{k} in micro-batches (checkpointing)", micro[i][0][k], ref[k]) for k in OUTPUTS]
        pairs += [(f"d {k} in micro-batches (checkpointing)", micro[i][1][k], alone_grad[i][1][k][0]) for k in INPUTS]
        for what, a, b in pairs:
            checked += 1
            d = _diff(a, b)
            if d:
                differ.append({"sample": i, "what": what, "elements": d, "of": a.numel()})
    return {"invariant": not differ, "checked": checked, "differ": differ, "micro_batch_order": order,
            "micro_batches": list(MICRO_BATCHES), "_alone": (alone, alone_grad, ups)}


def eager_proof(model, inputs, alone, alone_grad, ups) -> dict:
    """Proof 6: the compiled run's per-sample outputs (no_grad) and input gradients against the model's eager ones."""
    differ, checked = [], 0
    for i in range(len(alone)):
        with torch.no_grad():
            ref = _forward(model, _sample(inputs, [i]))
        _, grads = _fwd_bwd(model, inputs, [i], ups)
        pairs = [(k, alone[i][k], ref[k]) for k in OUTPUTS]
        pairs += [(f"d {k}", alone_grad[i][1][k], grads[k]) for k in INPUTS]
        for what, a, b in pairs:
            checked += 1
            d = _diff(a, b)
            if d:
                differ.append({"sample": i, "what": what, "elements": d, "of": a.numel()})
    model.zero_grad(set_to_none=True)
    return {"equal": not differ, "checked": checked, "differ": differ}


def timestep_proof(fn, inputs) -> dict:
    """Proof 2: an unused fourth timestep changes no output bit."""
    more = dict(inputs)
    more["timestep"] = torch.cat([inputs["timestep"], inputs["timestep"].new_tensor([0.999])])
    with torch.no_grad():
        a, b = _forward(fn, inputs), _forward(fn, more)
    differ = {k: _diff(a[k], b[k]) for k in OUTPUTS}
    return {"invariant": not any(differ.values()), "differ": differ}


def gradient_proof(model, fn, inputs, device) -> dict:
    """Proof 3: the batch's parameter gradients, two runs, bitwise."""
    n = inputs["hidden_states"].shape[0]
    with torch.no_grad():
        like = _forward(fn, _sample(inputs, [0]))
    ups = {i: _upstream(like, i, device) for i in range(n)}
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _fwd_bwd(fn, inputs, list(range(n)), ups)
        runs.append({name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    differ = sorted(name for name in runs[0] if not torch.equal(runs[0][name], runs[1][name]))
    missing = sorted(name for name, p in model.named_parameters() if name not in runs[0])
    return {"deterministic": not differ and not missing, "parameters": len(runs[0]), "differ": differ,
            "without_gradient": missing}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).norm() / ref.norm())


def accuracy_errors(model, inputs, reference: dict) -> dict:
    with torch.no_grad():
        out = _forward(model, _sample(inputs, [0, 1]))
    return {k: _rel(out[k], reference[k]) for k in OUTPUTS}


def fp64_reference(model, inputs) -> dict:
    import copy
    model64 = copy.deepcopy(model).double()
    with torch.no_grad():
        out = _forward(model64, {k: (v.double() if v.is_floating_point() else v)
                                 for k, v in _sample(inputs, [0, 1]).items()})
    del model64
    return out


def run_variant(variant: str, quick: bool, mode: str = "eager") -> dict:
    import time

    import h3cute
    from h3cute.bench.model import H3_TWO_BLOCKS, TINY, build_model, packed_inputs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = replace(TINY, layers=1) if quick else H3_TWO_BLOCKS
    layout = dict(video=40, text=9, audio=11) if quick else LAYOUT
    batch = BATCH
    model = build_model(size, device=device, seed=0)
    inputs = packed_inputs(size, **layout, timesteps=TIMESTEPS, batch=batch, device=device, seed=1)
    rep = {"variant": variant, "mode": mode, "environment": {k: os.environ.get(k) for k in invariant.ENVIRONMENT},
           "layout": {**layout, "batch": batch, "timesteps": TIMESTEPS}}
    if quick:
        invariant.fa4_problem = lambda: None  # the attention op's CPU reference serves a CPU model
    accuracy = variant == "model" and mode == "eager"
    if accuracy:
        reference = fp64_reference(model, inputs)
        rep["accuracy_unpatched"] = accuracy_errors(model, inputs, reference)
    patch = None if variant == "unpatched" else h3cute.patch(model, scope="model" if variant == "model"
                                                             else "conditioning")
    if patch is not None:
        rep["patch_report"] = patch.report()
    fn = train = model  # the rollout's (no-grad) callable and the training steps'
    if mode != "eager":
        for name in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 64))
        # the model scope must trace whole (a graph break fails the run); diffusers' own model may break
        fn = train = torch.compile(model, mode=mode, fullgraph=variant == "model")
        if mode == "reduce-overhead":  # CUDA graphs serve the rollout; training steps run the default mode's graphs
            train = torch.compile(model, fullgraph=variant == "model")
        fn._h3_compiled = train._h3_compiled = True
    started = time.perf_counter()
    rep["batch"] = batch_proof(model, fn, train, inputs, device)
    alone = rep["batch"].pop("_alone")
    if variant == "model":
        rep["timesteps"] = timestep_proof(fn, inputs)
        rep["gradients"] = gradient_proof(model, train, inputs, device)
        if mode != "eager":
            rep["vs_eager"] = eager_proof(model, inputs, *alone)
    if accuracy:
        rep["accuracy_patched"] = accuracy_errors(model, inputs, reference)
    rep["seconds"] = round(time.perf_counter() - started, 1)
    return rep


# ---- the run --------------------------------------------------------------------------------------------------

def _runs(report: dict) -> dict:
    return {(r["variant"], r.get("mode", "eager")): r for r in report["runs"]}


def verdict(report: dict) -> dict:
    """Each proof's pass / fail from the children's reports (proof 6 is recorded, not a verdict)."""
    runs = _runs(report)
    models = [r for (v, _), r in runs.items() if v == "model"]
    eager = runs[("model", "eager")]
    acc = {k: eager["accuracy_patched"][k] <= ACCURACY_SLACK * eager["accuracy_unpatched"][k] for k in OUTPUTS}
    controls = [runs[c] for c in CONTROLS if c in runs]
    return {"1_batch": all(m["batch"]["invariant"] for m in models),
            "2_timesteps": all(m["timesteps"]["invariant"] for m in models),
            "3_gradients": all(m["gradients"]["deterministic"] for m in models),
            "4_controls_fail": bool(controls) and not any(c["batch"]["invariant"] for c in controls),
            "5_accuracy": all(acc.values())}


def _yes(run: dict, key: str, field: str) -> str:
    return "–" if key not in run else "yes" if run[key][field] else "**no**"


def summary(report: dict) -> str:
    runs = _runs(report)
    env, commit = report.get("environment", {}), report.get("h3cute")
    commit = commit.get("commit") if isinstance(commit, dict) else commit
    lines = [f"# scope='model' invariance ({report['model']}, layout {report['runs'][0]['layout']})", "",
             f"{env.get('gpu', 'no GPU')}, torch {env.get('torch')}, h3cute {commit}, modes "
             f"{', '.join(report.get('modes', ()))}.", "", "| proof | holds |", "| --- | --- |"]
    lines += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in report["verdict"].items()]
    lines += ["", "| variant | mode | 1 batch, rollout = training | 2 timesteps | 3 gradients | 6 bits = eager's | s |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    for (v, mode), r in runs.items():
        lines.append(f"| {v} | {mode} | {_yes(r, 'batch', 'invariant')} | {_yes(r, 'timesteps', 'invariant')} | "
                     f"{_yes(r, 'gradients', 'deterministic')} | {_yes(r, 'vs_eager', 'equal')} | "
                     f"{r.get('seconds', '–')} |")
    for f in report.get("failed", []):
        lines.append(f"\n{f['variant']} ({f['mode']}) failed: {f['error'][-300:]}")
    for key in CONTROLS:
        if key not in runs:
            continue
        where = runs[key]["batch"]["differ"][:6]
        lines.append(f"\n{key[0]} ({key[1]}): proof 1 " + ("holds" if not where else "fails at " + "; ".join(
            f"sample {w['sample']} {w['what']} ({w['elements']} of {w['of']} elements)" for w in where)))
    m = runs[("model", "eager")]
    lines.append("\naccuracy (relative L2 error against FP64, samples 0 and 1): " + ", ".join(
        f"{k} patched {m['accuracy_patched'][k]:.3e} / unpatched {m['accuracy_unpatched'][k]:.3e}" for k in OUTPUTS))
    for (v, mode), r in runs.items():
        if v == "model" and r["gradients"]["differ"]:
            lines.append(f"{mode}: parameter gradients that differ between two runs: "
                         + ", ".join(r["gradients"]["differ"][:10]))
        if v == "model" and r.get("vs_eager", {}).get("differ"):
            where = r["vs_eager"]["differ"][:6]
            lines.append(f"{mode}: differs from eager at " + "; ".join(
                f"sample {w['sample']} {w['what']} ({w['elements']} of {w['of']})" for w in where))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="the tiny model on this machine, the CPU attention reference for FA4 (a smoke run)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"the model scope's modes, comma-separated, from {', '.join(MODES)} (eager always runs)")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--mode", choices=MODES, default="eager", help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.variant:
        json.dump(run_variant(args.variant, args.quick, args.mode), sys.stdout)
        return 0
    modes = ["eager"] + [m for m in args.modes.split(",") if m and m != "eager"]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown mode(s) {unknown}; choose from {', '.join(MODES)}")
    children = [("model", m) for m in modes] + [c for c in CONTROLS if c[1] in modes]
    env = {**os.environ, **invariant.ENVIRONMENT}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"kind": "h3_model_invariance", "environment": environment(device, {}), "h3cute": h3cute_commit(),
              "quick": args.quick, "model": "tiny, 1 block" if args.quick else "H3 widths, 2 blocks",
              "accuracy_slack": ACCURACY_SLACK, "modes": modes, "runs": []}
    out = args.out or Path(os.environ.get("H3CUTE_OUT", ".")) / "model_invariance.json"
    for variant, mode in children:
        print(f"[{variant} {mode}]", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--variant", variant, "--mode", mode] + (["--quick"] if args.quick else [])
        try:
            report["runs"].append(child_json(cmd, env, f"variant {variant} {mode}"))
        except (Exception, SystemExit) as e:  # e.g. a graph break under fullgraph=True: recorded, and a failure
            report.setdefault("failed", []).append({"variant": variant, "mode": mode, "error": str(e)[-3000:]})
        out.write_text(json.dumps(report, indent=1))
    ran = ("model", "eager") in _runs(report)
    report["verdict"] = verdict(report) if ran else {}
    report["verdict"]["0_every_run_ran"] = not report.get("failed")
    out.write_text(json.dumps(report, indent=1))
    sys.stdout.write(summary(report) if ran else json.dumps(report.get("failed")) + "\n")
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all(report["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
