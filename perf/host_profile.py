"""Where the host time of an h3 call goes, on the device, timed the way the bench harness times it.

Run: `bash perf/device_run.sh python3 perf/host_profile.py` (H3CUTE_GPU_TESTS=skip to skip the tests).
Each row is the median CUDA-event time of one whole call from Python, calls back to back (no sync between
samples, as `h3cute.bench.checks` measures `fwd_us`): when the host is slower than the GPU this is the host
time of the call. Rows, cheapest first, so neighbouring differences are the cost of one layer:

  floors     an empty Python call (the event pair alone), `t + 1`, `torch.ops.aten.add`, `torch.empty`, a no-op
             Python-impl op, a trivial autograd round trip (`x * 2` forward and backward through the engine)
  per op     raw kernel call(s), launcher, the op's CUDA impl called directly, `torch.ops.h3.<op>`, and
             for differentiable ops the backward launcher, the backward op, and the harness's fwd+bwd
  cprofile   the Python functions that take the host time of each op's fwd+bwd (top 25 by own time)

Writes JSON to the path argument, else $H3CUTE_OUT/host_profile.json, else ./host_profile.json.
"""
from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys

import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import runtime
from h3cute.bench import problems, timing
from h3cute.bench.report import write_device_json
from h3cute.launch import checks, norm_modulate, timestep_mlp, timestep_sinusoid
from h3cute.ops import adaln, timestep
from h3cute.widths import FREQ, HIDDEN, NORM_EPS, TEMB

WARMUP, SAMPLES = 30, 300
DEV = torch.device("cuda")


median_us = timing.timer("cuda", WARMUP, SAMPLES)


def graph_us(fn) -> float | None:
    us, why = timing.graph_time(fn, "cuda", WARMUP, SAMPLES)
    if why:
        print(f"  graph capture failed: {why}", file=sys.stderr)
    return us


def cprofile_top(fn, calls: int = 200, top: int = 25) -> str:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    return buf.getvalue()


_LIB = torch.library.Library("h3prof", "DEF")
_LIB.define("noop(Tensor t) -> Tensor")
_LIB.impl("noop", lambda t: t, "CUDA")


def floors() -> dict:
    t = torch.rand(3, device=DEV)
    x = torch.randn(4097, HIDDEN, device=DEV, dtype=torch.bfloat16)
    ones = torch.ones_like(x)

    def autograd_round_trip():
        leaf = x.detach().requires_grad_(True)
        torch.autograd.backward(leaf * 2, ones)

    return {
        "empty_call": median_us(lambda: None),
        "t+1": median_us(lambda: t + 1),
        "aten.add": median_us(lambda: torch.ops.aten.add.Tensor(t, 1)),
        "torch.empty(3,256)": median_us(lambda: torch.empty((3, 256), device=DEV)),
        "python_op_noop": median_us(lambda: torch.ops.h3prof.noop(t)),
        "autograd_x*2_S4097": median_us(autograd_round_trip),
    }


def sinusoid() -> dict:
    t = torch.rand(3, device=DEV)
    out = torch.empty((3, FREQ), device=DEV)
    fn = runtime.kernel("timestep_sinusoid", DEV, width=FREQ, check_range=True)
    slots = checks.slot_addresses(DEV.index or 0, "timestep_sinusoid", "t")  # the device's error words
    op = torch.ops.h3.timestep_sinusoid
    return {
        "kernel": median_us(lambda: fn(t, out, *slots)),
        "launch": median_us(lambda: timestep_sinusoid.forward(t, True)),
        "impl": median_us(lambda: timestep._sinusoid_cuda(t)),
        "op": median_us(lambda: op(t)),
        "op.default": median_us(lambda: op.default(t)),
        "op_no_range_check": median_us(lambda: op(t, False)),
        "t+1_again": median_us(lambda: t + 1),
    }


def _fwd_bwd(fn, inputs: dict, args, grads):
    def run():
        leaves = {a: inputs[a].detach().requires_grad_(True) for a in grads}
        out = fn(*[leaves.get(a, inputs[a]) for a in args])
        torch.autograd.backward(out, torch.ones_like(out))
    return run


def mlp() -> tuple[dict, str]:
    p = problems.PROBLEMS["timestep_mlp"]
    a = p.draw(1, 0, DEV)
    x, w1, b1, w2, b2 = (a[n] for n in p.args)
    grad = torch.ones((1, TEMB), device=DEV)
    op = torch.ops.h3.timestep_mlp
    run = _fwd_bwd(op, a, p.args, p.row_grads + p.param_grads)
    res = {
        "launch_fwd": median_us(lambda: timestep_mlp.forward(x, w1, b1, w2, b2)),
        "op_fwd": median_us(lambda: op(x, w1, b1, w2, b2)),
        "launch_bwd": median_us(lambda: timestep_mlp.backward(grad, x, w1, b1, w2)),
        "op_bwd": median_us(lambda: torch.ops.h3.timestep_mlp_backward(grad, x, w1, b1, w2)),
        "fwd_bwd": median_us(run),
        "graph_fwd_bwd": graph_us(run),
    }
    return res, cprofile_top(run)


def norm_mod() -> tuple[dict, str]:
    p = problems.PROBLEMS["norm_modulate"]
    a = p.draw(4097, 0, DEV)
    x, w, shift, scale, idx = (a[n] for n in p.args)
    grad = torch.ones_like(x)

    def op(*args):
        return torch.ops.h3.norm_modulate(*args, check_indices=False)
    run = _fwd_bwd(op, a, p.args, p.row_grads + p.param_grads)
    res = {
        "launch_fwd": median_us(lambda: norm_modulate.forward(x, w, shift, scale, idx, NORM_EPS, False)),
        "impl_fwd": median_us(lambda: adaln._norm_modulate_cuda(x, w, shift, scale, idx, NORM_EPS, False)),
        "op_fwd": median_us(lambda: op(x, w, shift, scale, idx)),
        "launch_bwd": median_us(lambda: norm_modulate.backward(grad, x, w, scale, idx, NORM_EPS, 9)),
        "op_bwd": median_us(lambda: torch.ops.h3.norm_modulate_backward(grad, x, w, scale, idx, NORM_EPS, 9)),
        "fwd_bwd": median_us(run),
        "graph_fwd_bwd": graph_us(run),
    }
    return res, cprofile_top(run)


def main() -> None:
    from h3cute import native
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "native_ops": sorted(native.native_ops()),
              "floors": floors(), "timestep_sinusoid": sinusoid()}
    report["timestep_mlp_T1"], prof_mlp = mlp()
    report["norm_modulate_S4097"], prof_nm = norm_mod()
    print(json.dumps(report, indent=1))
    print("==== cProfile timestep_mlp fwd+bwd (T=1), 200 calls\n" + prof_mlp)
    print("==== cProfile norm_modulate fwd+bwd (S=4097), 200 calls\n" + prof_nm)
    report["cprofile"] = {"timestep_mlp_T1": prof_mlp, "norm_modulate_S4097": prof_nm}
    print(f"wrote {write_device_json(report, 'host_profile.json', sys.argv[1] if len(sys.argv) > 1 else None)}")


if __name__ == "__main__":
    main()
