"""Which of the MiniMax-H3 model's own call sites are batch-invariant, under which mechanism, and at what cost.

The conditioning path is h3cute's (`h3cute.patch`); the rest of the forward is diffusers': every `nn.Linear`
(attention projections, the SwiGLU FFN, the refiner, proj_in, context_embedder, the FP32 output heads), every
RMSNorm module the patch leaves alone (the attention's q/k norms), and attention (`F.scaled_dot_product_attention`).
This script captures each call site's inputs in one forward of the patched model (B = 1), groups sites that run
the same computation (a linear's in/out features, dtype, bias and row count; attention's shape), and for each
group checks, bitwise, what the seed reports' method checks for the ops:

  rows       (linears, norms) 8 probe rows computed inside batches of every row count in ROW_COUNTS against the
             same rows inside the whole captured input: the forward, and dX under a fixed upstream gradient
  batch      (attention) sample 0 alone (B = 1) against inside a batch of 4 different samples: forward and dq/dk/dv
  repeat     the parameter gradients (linears: dW, db; norms: dweight) or attention's dq/dk/dv, computed twice:
             bitwise equal or not
  time       the median forward and fwd+bwd µs of the whole captured input (CUDA events)

under each mechanism of MECHANISMS, each in its own process (cuBLAS reads its workspace variables when CUDA
starts): `plain` (torch's defaults), `vllm` (vLLM's batch-invariant cuBLASLt settings, as the prior-art harness's
vllm mode sets them), `deterministic` (`torch.use_deterministic_algorithms(True)` with its cuBLAS workspace),
and attention once per SDPA backend (flash, efficient, cudnn, math) and with FlashAttention-4's deterministic
kernels (`fa4`, where flash-attn-4 is importable) in every mechanism. A negative control (a
linear whose output depends on its row count) must fail the rows check, or the run stops.

Run: `bash perf/device_run.sh python3 perf/call_site_invariance.py [--rows S] [--mechanisms plain,vllm]
[--kinds attention]` (H3CUTE_GPU_TESTS=skip; FA4 needs the DSL staged by perf/stage_dsl.sh); `--quick`
on a CPU (the tiny model, two row counts, plain only: a smoke run, not a measurement). Writes
$H3CUTE_OUT/call_site_invariance.json (else ./) and prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from h3cute import invariant
from h3cute.bench.report import child_json, environment, h3cute_commit

MECHANISMS = {
    "plain": {},
    "vllm": invariant.ENVIRONMENT,
    "deterministic": {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"},
}
ROW_COUNTS = (1, 2, 3, 7, 8, 9, 13, 16, 63, 64, 65, 127, 128, 129, 1023, 1024, 1025, 4097)
QUICK_ROW_COUNTS = (1, 9)
SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
PROBES = 8


# ---- checks on one computation (pure functions of callables: also what the CPU test drives) ------------------

def probe_rows(total: int, count: int = PROBES) -> torch.Tensor:
    """`count` rows spread over [0, total): 0, total - 1 and evenly between."""
    return torch.linspace(0, total - 1, count).round().long().unique()


def rows_check(fn, x: torch.Tensor, upstream: torch.Tensor, row_counts, grad: bool = True) -> dict:
    """fn(x) -> y row-wise (row r of y from row r of x, as a batch-invariant op must be). The probe rows computed
    inside a batch of n rows (the probes first, then other rows of x; the first n probes when n < probes) against
    the same rows inside all of x: forward and (grad) dX under `upstream`'s rows, bitwise."""
    total = x.shape[0]
    probes = probe_rows(total)
    ref_y, ref_dx = _rowwise(fn, x, upstream, grad)
    others = torch.tensor([r for r in range(total) if r not in set(probes.tolist())], dtype=torch.long)
    failures, checked = [], 0
    for n in row_counts:
        if n > total:
            continue
        take = probes[:n] if n <= len(probes) else torch.cat([probes, others[: n - len(probes)]])
        y, dx = _rowwise(fn, x[take], upstream[take], grad)
        k = min(n, len(probes))
        fwd_ok = torch.equal(y[:k], ref_y[probes[:k]])
        bwd_ok = (not grad) or torch.equal(dx[:k], ref_dx[probes[:k]])
        checked += 1
        if not (fwd_ok and bwd_ok):
            failures.append({"rows": n, "fwd_differ": not fwd_ok, "dx_differ": not bwd_ok})
    return {"row_counts": checked, "failures": failures, "invariant": not failures}


def _rowwise(fn, x, upstream, grad):
    if not grad:
        with torch.no_grad():
            return fn(x), None
    xl = x.detach().clone().requires_grad_(True)
    y = fn(xl)
    (dx,) = torch.autograd.grad(y, xl, upstream)
    return y.detach(), dx


def repeat_check(fn, inputs: list[torch.Tensor], upstream, params: list[torch.Tensor]) -> dict:
    """The gradients of `params` (and of the inputs that require grad) from two identical fwd+bwd calls."""
    def grads():
        leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]
        out = fn(*leaves)
        wrt = [t for t in leaves if t.requires_grad] + list(params)
        return torch.autograd.grad(out, wrt, upstream)
    a, b = grads(), grads()
    same = [torch.equal(u, v) for u, v in zip(a, b)]
    return {"gradients": len(same), "differ": same.count(False), "deterministic": all(same)}


def median_us(fn, device, warmup=3, samples=10) -> float:
    """The harness's timer (h3cute.bench.timing): median CUDA-event µs per call, wall time on a CPU."""
    from h3cute.bench import timing
    return timing.timer(device, warmup, samples)(fn)


# ---- the model's call sites ------------------------------------------------------------------------------

def capture_sites(model, inputs) -> dict:
    """{group key: {"kind", "sites": [names], "module" or "args"...}} from one no-grad forward: the first input of
    every nn.Linear and RMSNorm call, and every SDPA call's (q, k, v, attn_mask, is_causal, scale)."""
    groups, handles = {}, []

    def on_module(name):
        def hook(mod, args, out):
            x = args[0].detach()
            rows = x.numel() // x.shape[-1]  # the whole input's row count: a GEMM's kernel choice depends on it
            if isinstance(mod, torch.nn.Linear):
                key = ("linear", mod.in_features, mod.out_features, str(mod.weight.dtype), mod.bias is not None, rows)
            else:
                key = ("rms_norm", tuple(mod.normalized_shape), str(x.dtype), mod.weight is not None, rows)
            g = groups.setdefault(key, {"kind": key[0], "sites": [], "module": mod, "x": x.reshape(-1, x.shape[-1])})
            if name not in g["sites"]:
                g["sites"].append(name)
        return hook

    for name, mod in model.named_modules():
        if isinstance(mod, (torch.nn.Linear, torch.nn.RMSNorm)):
            handles.append(mod.register_forward_hook(on_module(name)))
    real_sdpa = F.scaled_dot_product_attention
    calls = []

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):  # torch's names
        q, k, v = query, key, value
        group = ("attention", tuple(q.shape), tuple(k.shape), str(q.dtype), attn_mask is not None, is_causal)
        g = groups.setdefault(group, {"kind": "attention", "sites": [], "args": (q.detach(), k.detach(), v.detach(),
                                    None if attn_mask is None else attn_mask.detach(), is_causal, scale, kw)})
        g["sites"].append(f"sdpa call {len(calls)}")
        calls.append(group)
        return real_sdpa(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale, **kw)

    F.scaled_dot_product_attention = sdpa
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        F.scaled_dot_product_attention = real_sdpa
        for h in handles:
            h.remove()
    return groups


def _module_entry(g, device, row_counts) -> dict:
    mod, x = g["module"], g["x"]
    gen = torch.Generator(device=device).manual_seed(9)
    out_dim = mod.out_features if isinstance(mod, torch.nn.Linear) else x.shape[-1]
    upstream = torch.randn(x.shape[0], out_dim, generator=gen, device=device).to(x.dtype)
    params = [p for p in mod.parameters()]
    entry = {"kind": g["kind"], "sites": g["sites"], "rows": x.shape[0],
             "shape": f"{tuple(x.shape)} -> {out_dim}, {mod.weight.dtype}"}
    entry["row_invariance"] = rows_check(mod, x, upstream, row_counts)
    entry["repeat"] = repeat_check(mod, [x], upstream, params)
    entry["fwd_us"] = median_us(lambda: mod(x), device)

    def fwd_bwd():
        y = mod(x)
        torch.autograd.grad(y, params, upstream)
    entry["fwd_bwd_us"] = median_us(fwd_bwd, device)
    return entry


def _attention_entries(g, device) -> dict:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q, k, v, mask, causal, scale, kw = g["args"]
    out = {}
    gen = torch.Generator(device=device).manual_seed(9)
    batch = 4
    # four different samples: the captured one first, then noise of the same scale
    qb, kb, vb = (torch.cat([t] + [torch.randn(t.shape, generator=gen, device=device).to(t.dtype) * t.float().std()
                                   .to(t.dtype) for _ in range(batch - 1)]) for t in (q, k, v))
    upstream = torch.randn(qb.shape[:-1] + (v.shape[-1],), generator=gen, device=device).to(q.dtype)

    def attend(a, b, c):
        m = None if mask is None else mask.expand(a.shape[0], *mask.shape[1:])
        return F.scaled_dot_product_attention(a, b, c, attn_mask=m, is_causal=causal, scale=scale, **kw)

    for backend in SDPA_BACKENDS + ("fa4",):
        e = {"kind": "attention", "sites": g["sites"], "shape": f"q {tuple(q.shape)}, k {tuple(k.shape)}, {q.dtype}"}
        if backend == "fa4":  # torch.ops.h3.attention: what scope="model" runs
            extra = any(v not in (None, False) for v in kw.values())
            if mask is not None or causal or scale is not None or extra:
                out[backend] = {**e, "unavailable": "FA4 is run here as scope='model' runs it: no mask, not causal, "
                                                    "the default scale"}
                continue
            problem = invariant.fa4_problem()
            if problem:
                out[backend] = {**e, "unavailable": problem[:200]}
                continue
        try:
            if backend == "fa4":  # the same measurements on (B, S, H, D) copies, made outside the timings
                bshd = (t.transpose(1, 2).contiguous() for t in (q, k, v, qb, kb, vb, upstream))
                e = {**e, **_measure(torch.ops.h3.attention, *bshd, device)}
                out[backend] = e
                continue
            with sdpa_kernel([getattr(SDPBackend, {"flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                                                   "cudnn": "CUDNN_ATTENTION", "math": "MATH"}[backend])]):
                e = {**e, **_measure(attend, q, k, v, qb, kb, vb, upstream, device)}
        except RuntimeError as err:  # the backend does not serve this shape / dtype / machine
            e = {**e, "unavailable": str(err).splitlines()[0][:200]}
        out[backend] = e
    return out


def _measure(attend, q, k, v, qb, kb, vb, upstream, device) -> dict:
    """Sample 0 alone against inside the batch (qb, kb, vb), repeatability of the batch's gradients, and the
    median forward and fwd+bwd µs of sample 0 alone."""
    alone = _grads(attend, (q, k, v), upstream[:1])
    inside = _grads(attend, (qb, kb, vb), upstream)
    bi = {"fwd_differ": not torch.equal(alone[0], inside[0][:1]),
          "grads_differ": [not torch.equal(a, b[:1]) for a, b in zip(alone[1:], inside[1:])]}
    bi["invariant"] = not (bi["fwd_differ"] or any(bi["grads_differ"]))
    e = {"batch_invariance": bi,
         "repeat": repeat_check(attend, [t.detach().requires_grad_(True) for t in (qb, kb, vb)], upstream, []),
         "fwd_us": median_us(lambda: attend(q, k, v), device)}
    ql, kl, vl = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    e["fwd_bwd_us"] = median_us(lambda: torch.autograd.grad(attend(ql, kl, vl), (ql, kl, vl), upstream[:1]), device)
    return e


def _grads(fn, inputs, upstream):
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    y = fn(*leaves)
    return (y.detach(), *torch.autograd.grad(y, leaves, upstream))


def negative_control(device, row_counts) -> dict:
    """A linear whose rows depend on the row count (a split-K-like reordering past 8 rows): must be caught."""
    gen = torch.Generator(device=device).manual_seed(3)
    w = torch.randn(64, 256, generator=gen, device=device).to(torch.bfloat16)
    x = torch.randn(max(row_counts) + 16, 256, generator=gen, device=device).to(torch.bfloat16)

    def leaky(t):
        if t.shape[0] > 8:  # a split-K reduction: the two halves of K rounded apart, then summed
            halves = [(t[:, h].float() @ w[:, h].float().T).to(t.dtype) for h in (slice(0, 128), slice(128, 256))]
            return halves[0] + halves[1]
        return (t.float() @ w.float().T).to(t.dtype)
    up = torch.randn(x.shape[0], 64, generator=gen, device=device).to(torch.bfloat16)
    return rows_check(leaky, x, up, row_counts, grad=False)


# ---- one mechanism, in this process --------------------------------------------------------------------

def run_mechanism(mechanism: str, quick: bool, rows: int = 4097, kinds: tuple[str, ...] | None = None) -> dict:
    import h3cute
    from h3cute.bench.candidates import apply_mode
    from h3cute.bench.model import H3_TWO_BLOCKS, TINY, build_model, packed_inputs

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    apply_mode("vllm" if mechanism == "vllm" else "plain")
    if mechanism == "deterministic":
        torch.use_deterministic_algorithms(True)
    row_counts = QUICK_ROW_COUNTS if quick else ROW_COUNTS
    control = negative_control(device, row_counts)
    if control["invariant"]:
        raise SystemExit("negative control passed the rows check: the check cannot fail, stopping")
    size = TINY if quick else H3_TWO_BLOCKS
    rows = 48 if quick else rows
    model = build_model(size, device=device, seed=0)
    h3cute.patch(model)
    text, audio = max(8, rows // 16), max(8, rows // 8)
    inputs = packed_inputs(size, video=rows - text - audio, text=text, audio=audio, device=device, seed=1)
    groups = capture_sites(model, inputs)
    out = {"mechanism": mechanism, "environment": {k: os.environ.get(k) for k in MECHANISMS[mechanism]},
           "negative_control": control, "groups": []}
    for key, g in groups.items():
        if kinds and g["kind"] not in kinds:
            continue
        print(f"[{mechanism}] {key}", file=sys.stderr, flush=True)
        if g["kind"] == "attention":
            if device.type != "cuda":
                continue  # the SDPA backends are CUDA's
            for backend, e in _attention_entries(g, device).items():
                out["groups"].append({**e, "backend": backend})
        else:
            out["groups"].append(_module_entry(g, device, row_counts))
    return out


# ---- the run -------------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    lines = ["| mechanism | kind | sites | shape | rows invariant | batch invariant | repeatable | fwd µs "
             "| fwd+bwd µs |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for run in report["runs"]:
        for e in run["groups"]:
            sites = ", ".join(e["sites"][:3]) + (f" (+{len(e['sites']) - 3})" if len(e["sites"]) > 3 else "")
            kind = e["kind"] + (f" ({e['backend']})" if "backend" in e else "")
            if "unavailable" in e:
                lines.append(f"| {run['mechanism']} | {kind} | {sites} | {e['shape']} | unavailable: "
                             f"{e['unavailable']} | | | | |")
                continue
            ri = e.get("row_invariance")
            rows = "–" if ri is None else ("yes" if ri["invariant"] else
                                           "**no** (from " + str(min(f["rows"] for f in ri["failures"])) + " rows)")
            bi = e.get("batch_invariance")
            batch = "–" if bi is None else ("yes" if bi["invariant"] else "**no**")
            rep = "yes" if e["repeat"]["deterministic"] else f"**no** ({e['repeat']['differ']} differ)"
            lines.append(f"| {run['mechanism']} | {kind} | {sites} | {e['shape']} | {rows} | {batch} | {rep} | "
                         f"{e['fwd_us']:.1f} | {e['fwd_bwd_us']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the tiny model on this machine, plain only (a smoke run)")
    ap.add_argument("--mechanism", choices=tuple(MECHANISMS), help=argparse.SUPPRESS)  # the child process
    ap.add_argument("--out", type=Path)
    ap.add_argument("--rows", type=int, default=4097, help="packed rows S of the captured forward (default 4097)")
    ap.add_argument("--mechanisms", default=",".join(MECHANISMS),
                    help=f"comma-separated subset of {', '.join(MECHANISMS)} (default all)")
    ap.add_argument("--kinds", help="comma-separated call-site kinds to measure (linear, rms_norm, attention; "
                                    "default all)")
    args = ap.parse_args(argv)
    if args.mechanism:
        kinds = tuple(args.kinds.split(",")) if args.kinds else None
        json.dump(run_mechanism(args.mechanism, args.quick, args.rows, kinds), sys.stdout)
        return 0
    mechanisms = ("plain",) if args.quick else tuple(args.mechanisms.split(","))
    unknown = [m for m in mechanisms if m not in MECHANISMS]
    if unknown:
        ap.error(f"unknown mechanism(s) {unknown}: choose from {', '.join(MECHANISMS)}")
    runs = []
    for m in mechanisms:
        env = {k: v for k, v in os.environ.items() if k not in invariant.ENVIRONMENT}
        env.update(MECHANISMS[m])
        cmd = [sys.executable, __file__, "--mechanism", m, "--rows", str(args.rows)]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--kinds", args.kinds] if args.kinds else []
        runs.append(child_json(cmd, env, f"mechanism {m}"))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    report = {"kind": "h3_call_site_invariance", "environment": environment(device, {}), "h3cute": h3cute_commit(),
              "quick": args.quick, "rows": 48 if args.quick else args.rows, "kinds": args.kinds, "runs": runs}
    out = args.out or Path(os.environ.get("H3CUTE_OUT", ".")) / "call_site_invariance.json"
    out.write_text(json.dumps(report, indent=1))
    sys.stdout.write(markdown(report))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
