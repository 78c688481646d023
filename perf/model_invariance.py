"""The proof that `h3cute.patch(transformer, scope="model")` makes MiniMax-H3's whole forward and backward
batch-invariant (issue 26), on diffusers' model at H3's widths (2 blocks, 56 heads x 128, FFN 14336, text 5120).

Five proofs, each in the child process of its variant (vLLM's cuBLASLt settings, `h3cute.invariant.ENVIRONMENT`,
are process-wide and read when CUDA starts, so every child starts with them):

1. batch    B = 8 samples (different video, audio and text inputs, one packed layout, T = 3). Each sample's video
            and audio outputs, computed alone (B = 1, no_grad), inside the batch (B = 8, no_grad), and in
            micro-batches of 1, 2, 4 and 1 samples in shuffled order with grad and gradient checkpointing on;
            and its input gradients (video, audio, text inputs; a fixed upstream gradient per sample), computed
            alone with grad and in those micro-batches: bitwise equal.
2. timesteps  the batch's outputs with a fourth timestep that no row uses: bitwise equal to T = 3.
3. gradients  every parameter's gradient of the batch's fwd+bwd, run twice: bitwise equal.
4. controls   proof 1 for the unpatched model and for the conditioning-only patch: each must fail; the report
            says where (which sample, output or gradient, how many elements differ).
5. accuracy   the patched model's outputs (samples 0 and 1) against the same model in FP64: relative L2 error no
            more than ACCURACY_SLACK times the unpatched BF16 model's own (both reported).

Run: `bash perf/device_run.sh python3 perf/model_invariance.py` (FlashAttention-4 needs the DSL: see
docs/DEVICE.md). Writes $H3CUTE_OUT/model_invariance.json (else ./) and prints a summary; the exit status is
non-zero when a proof fails. `--quick` runs the tiny model on this machine with torch's SDPA standing in for
FlashAttention-4: a smoke run of the harness, not a measurement.
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


# ---- one variant, in this process ---------------------------------------------------------------------------

def _sample(inputs: dict, idx: list[int]) -> dict:
    return {k: (v[idx] if k in INPUTS else v) for k, v in inputs.items()}


def _upstream(outputs_like: dict, sample: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(1000 + sample)
    return {k: torch.randn(v.shape[1:], generator=g, device=device, dtype=v.dtype) for k, v in outputs_like.items()}


def _forward(model, inputs) -> dict:
    out = model(**inputs)
    return {"sample": out.sample, "audio_sample": out.audio_sample}


def _fwd_bwd(model, inputs, samples: list[int], ups: dict) -> tuple[dict, dict]:
    """Outputs and input gradients of `samples` computed together (grad on)."""
    leaves = {k: (v[samples].detach().clone().requires_grad_(True) if k in INPUTS else v) for k, v in inputs.items()}
    out = _forward(model, leaves)
    loss_terms = [(out[k] * torch.stack([ups[s][k] for s in samples])).sum() for k in OUTPUTS]
    torch.autograd.backward(loss_terms)
    return ({k: v.detach() for k, v in out.items()}, {k: leaves[k].grad for k in INPUTS})


def _diff(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements that differ (a NaN never equals, so a NaN output always counts)."""
    return int((a.reshape(-1) != b.reshape(-1)).sum())


def batch_proof(model, inputs, device) -> dict:
    """Proof 1 (see the module docstring): {"invariant", "checked", "differ": [where, ...]}."""
    model.zero_grad(set_to_none=True)
    n = inputs["hidden_states"].shape[0]
    with torch.no_grad():
        together = _forward(model, inputs)
        alone = [_forward(model, _sample(inputs, [i])) for i in range(n)]
    ups = {i: _upstream(together, i, device) for i in range(n)}
    alone_grad = [_fwd_bwd(model, inputs, [i], ups) for i in range(n)]
    model.zero_grad(set_to_none=True)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(5)).tolist()
    micro, start = {}, 0
    model.enable_gradient_checkpointing()
    try:
        for size in MICRO_BATCHES:
            group = order[start:start + size]
            start += size
            out, grads = _fwd_bwd(model, inputs, group, ups)
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
            "micro_batches": list(MICRO_BATCHES)}


def timestep_proof(model, inputs) -> dict:
    """Proof 2: an unused fourth timestep changes no output bit."""
    more = dict(inputs)
    more["timestep"] = torch.cat([inputs["timestep"], inputs["timestep"].new_tensor([0.999])])
    with torch.no_grad():
        a, b = _forward(model, inputs), _forward(model, more)
    differ = {k: _diff(a[k], b[k]) for k in OUTPUTS}
    return {"invariant": not any(differ.values()), "differ": differ}


def gradient_proof(model, inputs, device) -> dict:
    """Proof 3: the batch's parameter gradients, two runs, bitwise."""
    n = inputs["hidden_states"].shape[0]
    with torch.no_grad():
        like = _forward(model, _sample(inputs, [0]))
    ups = {i: _upstream(like, i, device) for i in range(n)}
    runs = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        _fwd_bwd(model, inputs, list(range(n)), ups)
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


def run_variant(variant: str, quick: bool) -> dict:
    import h3cute
    from h3cute.bench.model import H3_TWO_BLOCKS, TINY, build_model, packed_inputs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    size = replace(TINY, layers=1) if quick else H3_TWO_BLOCKS
    layout = dict(video=40, text=9, audio=11) if quick else LAYOUT
    batch = BATCH
    model = build_model(size, device=device, seed=0)
    inputs = packed_inputs(size, **layout, timesteps=TIMESTEPS, batch=batch, device=device, seed=1)
    rep = {"variant": variant, "environment": {k: os.environ.get(k) for k in invariant.ENVIRONMENT},
           "layout": {**layout, "batch": batch, "timesteps": TIMESTEPS}}
    if quick:
        _sdpa_for_fa4()
    if variant == "model":
        reference = fp64_reference(model, inputs)
        rep["accuracy_unpatched"] = accuracy_errors(model, inputs, reference)
    patch = None if variant == "unpatched" else h3cute.patch(model, scope="model" if variant == "model"
                                                             else "conditioning")
    if patch is not None:
        rep["patch_report"] = patch.report()
    rep["batch"] = batch_proof(model, inputs, device)
    if variant == "model":
        rep["timesteps"] = timestep_proof(model, inputs)
        rep["gradients"] = gradient_proof(model, inputs, device)
        rep["accuracy_patched"] = accuracy_errors(model, inputs, reference)
    return rep


def _sdpa_for_fa4() -> None:
    """--quick: torch's SDPA on (B, S, heads, head_dim) in place of FlashAttention-4, which this machine lacks."""
    import torch.nn.functional as F

    def attention(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)
    invariant.attention = attention
    invariant.fa4_problem = lambda: None


# ---- the run --------------------------------------------------------------------------------------------------

def verdict(report: dict) -> dict:
    """Each proof's pass / fail from the children's reports."""
    runs = {r["variant"]: r for r in report["runs"]}
    m = runs["model"]
    acc = {k: m["accuracy_patched"][k] <= ACCURACY_SLACK * m["accuracy_unpatched"][k] for k in OUTPUTS}
    return {"1_batch": m["batch"]["invariant"], "2_timesteps": m["timesteps"]["invariant"],
            "3_gradients": m["gradients"]["deterministic"],
            "4_controls_fail": not runs["unpatched"]["batch"]["invariant"]
            and not runs["conditioning"]["batch"]["invariant"],
            "5_accuracy": all(acc.values())}


def summary(report: dict) -> str:
    lines = [f"# scope='model' invariance ({report['model']}, layout {report['runs'][0]['layout']})", "",
             "| proof | holds |", "| --- | --- |"]
    lines += [f"| {k} | {'yes' if v else '**no**'} |" for k, v in report["verdict"].items()]
    runs = {r["variant"]: r for r in report["runs"]}
    for v in ("unpatched", "conditioning"):
        where = runs[v]["batch"]["differ"][:6]
        lines.append(f"\n{v}: proof 1 " + ("holds" if not where else "fails at " + "; ".join(
            f"sample {w['sample']} {w['what']} ({w['elements']} of {w['of']} elements)" for w in where)))
    m = runs["model"]
    lines.append("\naccuracy (relative L2 error against FP64, samples 0 and 1): " + ", ".join(
        f"{k} patched {m['accuracy_patched'][k]:.3e} / unpatched {m['accuracy_unpatched'][k]:.3e}" for k in OUTPUTS))
    if m["gradients"]["differ"]:
        lines.append("parameter gradients that differ between two runs: " + ", ".join(m["gradients"]["differ"][:10]))
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model on this machine, SDPA for FA4 (a smoke run)")
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    if args.variant:
        json.dump(run_variant(args.variant, args.quick), sys.stdout)
        return 0
    env = {**os.environ, **invariant.ENVIRONMENT}
    runs = []
    for variant in VARIANTS:
        print(f"[{variant}]", file=sys.stderr, flush=True)
        cmd = [sys.executable, __file__, "--variant", variant] + (["--quick"] if args.quick else [])
        runs.append(child_json(cmd, env, f"variant {variant}"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"kind": "h3_model_invariance", "environment": environment(device, {}), "h3cute": h3cute_commit(),
              "quick": args.quick, "model": "tiny, 1 block" if args.quick else "H3 widths, 2 blocks",
              "accuracy_slack": ACCURACY_SLACK, "runs": runs}
    report["verdict"] = verdict(report)
    out = args.out or Path(os.environ.get("H3CUTE_OUT", ".")) / "model_invariance.json"
    out.write_text(json.dumps(report, indent=1))
    sys.stdout.write(summary(report))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if all(report["verdict"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
