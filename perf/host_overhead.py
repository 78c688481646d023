"""Host overhead of every `torch.ops.h3` op, layer by layer, on the device (prebuilt bundle, never compiles).

Run: `bash perf/device_run.sh python3 perf/host_overhead.py` (H3CUTE_GPU_TESTS=skip to skip the tests).
Per op (T = 3 for the timestep-row ops, S = 4097 for the row ops, check flags False), each layer is one
whole call from Python timed with CUDA events, median of 200 samples after 50 warm-ups:

  t+1        a bare `t + 1` on the op's first input (the floor of one torch launch from Python)
  kernel     the compiled kernel call(s) of the forward via h3cute.runtime.kernel, outputs preallocated
  launch     h3cute.launch.<op>.forward (allocation + kernel lookups + launches)
  op_nograd  torch.ops.h3.<op> under torch.no_grad() (+ dispatcher, validation, autograd kernel)
  op_grad    the op with requires_grad leaves, forward only (+ autograd.Function, saved tensors)
  fwd_bwd    fresh leaves (detach().requires_grad_()), forward, backward(ones): the bench harness's call
  graph_fwd  the op_nograd call replayed in a CUDA graph: device time only

Also: host us of a tvm_ffi `testing.nop` call with 0 and 6 CUDA tensors (the argument conversion alone),
and whether torch.Tensor has the C DLPack exchange API (tvm_ffi's fast tensor path).
Prints a table and writes JSON to the path argument, else $H3CUTE_OUT/host_overhead.json, else stdout only.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference, runtime
from h3cute.launch import (adaln_projection, adaln_row_gather, final_adaln_out, gate_residual, norm_modulate,
                           timestep_mlp, timestep_sinusoid)

WARMUP, SAMPLES = 50, 200
T_ROWS, S_ROWS = 3, 4097
LAYERS = ("t+1", "kernel", "launch", "op_nograd", "op_grad", "fwd_bwd", "graph_fwd")


def median_us(fn) -> float:
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(SAMPLES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_us(fn) -> float | None:
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return median_us(g.replay)
    except Exception as e:  # a capture failure is recorded, never fatal
        print(f"  graph capture failed: {e}", file=sys.stderr)
        return None


def raw_kernels(op: str, a: tuple, dev):
    """The forward's compiled kernel calls on preallocated outputs (None where the op has no single path)."""
    f32, bf16 = torch.float32, torch.bfloat16
    if op == "timestep_sinusoid":
        (t,) = a
        out = torch.empty((t.shape[0], 256), dtype=f32, device=dev)
        fn = runtime.kernel("timestep_sinusoid", dev, width=256, check_range=False)
        return lambda: fn(t, out)
    if op == "timestep_mlp":
        x, w1, b1, w2, b2 = a
        cfg = timestep_mlp.pick_config(x.shape[0])
        h = torch.empty((x.shape[0], 5376), dtype=f32, device=dev)
        part = torch.empty((timestep_mlp.SPLITS["fc2"], x.shape[0], 2688), dtype=f32, device=dev)
        out = torch.empty((x.shape[0], 2688), dtype=f32, device=dev)
        fc1 = timestep_mlp._gemm(dev, "fc1", cfg.fc1)
        fc2 = timestep_mlp._gemm(dev, "fc2", cfg.fc2)
        fold = timestep_mlp._fold(dev, "fc2", "bias")

        def run():
            fc1(x, w1, b1, h)  # the forward's fc1 writes h only
            fc2(h, w2, part)
            fold(part, b2, out)
        return run
    if op == "norm_modulate":
        x, w, shift, scale, idx = a
        out = torch.empty_like(x)
        fn = runtime.kernel("norm_modulate_fwd", dev, width=x.shape[1])
        return lambda: fn(x, w, shift, scale, idx, out, 1e-5)
    if op == "gate_residual":
        res, y, gate, idx = a
        out = torch.empty_like(y)
        fn = runtime.kernel("gate_residual_fwd", dev, width=y.shape[1])
        return lambda: fn(res, y, gate, idx, out)
    if op == "adaln_row_gather":
        table, idx = a
        outs = [torch.empty((idx.shape[0], 5376), dtype=bf16, device=dev) for _ in range(6)]
        fn = runtime.kernel("adaln_row_gather_fwd", dev, width=5376)
        return lambda: fn(table, idx, *outs)
    return None  # adaln_projection / final_adaln_out: several kernels with config choice; see `launch`


LAUNCH = {"timestep_sinusoid": lambda t: timestep_sinusoid.forward(t, False),
          "timestep_mlp": timestep_mlp.forward, "adaln_projection": adaln_projection.forward,
          "final_adaln_out": final_adaln_out.forward, "adaln_row_gather": adaln_row_gather.forward,
          "norm_modulate": norm_modulate.forward, "gate_residual": gate_residual.forward}
FLAGS = {"timestep_sinusoid": (False,), "timestep_mlp": (), "adaln_projection": (),
         "final_adaln_out": (1e-5, False), "adaln_row_gather": (False,), "norm_modulate": (1e-5, False),
         "gate_residual": (False,)}


def _flat(out):
    return list(out) if isinstance(out, (list, tuple)) else [out]


def measure(op: str, dev) -> dict:
    rows = T_ROWS if op in ("timestep_sinusoid", "timestep_mlp", "adaln_projection") else S_ROWS
    a = tuple(x.to(dev) for x in reference.example_inputs(op, rows, num_timesteps=3, seed=1))
    h3op, flags = getattr(torch.ops.h3, op), FLAGS[op]
    first = a[0]
    res = {"rows": rows}
    res["t+1"] = median_us(lambda: first + 1)
    raw = raw_kernels(op, a, dev)
    res["kernel"] = median_us(raw) if raw else None
    res["launch"] = median_us(lambda: LAUNCH[op](*a))

    def nograd():
        with torch.no_grad():
            h3op(*a, *flags)
    res["op_nograd"] = median_us(nograd)
    if op == "timestep_sinusoid":  # forward only
        res["op_grad"] = res["fwd_bwd"] = None
    else:
        leaves = [x.detach().requires_grad_() if x.is_floating_point() else x for x in a]
        res["op_grad"] = median_us(lambda: h3op(*leaves, *flags))
        ones = [torch.ones_like(o) for o in _flat(h3op(*a, *flags))]

        def fwd_bwd():
            fresh = [x.detach().requires_grad_() if x.is_floating_point() else x for x in a]
            torch.autograd.backward(_flat(h3op(*fresh, *flags)), ones)
        res["fwd_bwd"] = median_us(fwd_bwd)
    res["graph_fwd"] = graph_us(lambda: h3op(*a, *flags))
    return res


def ffi_conversion_us(dev) -> dict:
    """Host us per tvm_ffi call of `testing.nop` (no kernel): the cost of converting torch tensors."""
    import tvm_ffi

    nop = tvm_ffi.get_global_func("testing.nop")
    ts = [torch.empty(16, device=dev) for _ in range(6)]
    out = {}
    for label, args in (("none", ()), ("6_cuda_tensors", ts), ("6_cuda_tensors_float", (*ts, 1e-5))):
        for _ in range(1000):
            nop(*args)
        t0 = time.perf_counter()
        for _ in range(10000):
            nop(*args)
        out[label] = (time.perf_counter() - t0) / 10000 * 1e6
    return out


def main() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    t0 = time.perf_counter()
    results = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
               "dlpack_c_exchange_api": hasattr(torch.Tensor, "__dlpack_c_exchange_api__"),
               "warmup": WARMUP, "samples": SAMPLES, "ops": {}}
    results["tvm_ffi_nop_host_us"] = ffi_conversion_us(dev)
    print("tvm_ffi testing.nop host us:", {k: round(v, 2) for k, v in results["tvm_ffi_nop_host_us"].items()})
    print(f"{'op':18s}" + "".join(f"{k:>11s}" for k in LAYERS) + "   (median us)")
    for op in reference.OPS:
        try:
            r = measure(op, dev)
        except Exception as e:  # one op failing must not lose the others
            r = {"error": f"{type(e).__name__}: {e}"}
            print(f"{op:18s} ERROR {r['error']}")
        else:
            print(f"{op:18s}" + "".join(f"{r[k]:11.1f}" if r[k] is not None else f"{'-':>11s}" for k in LAYERS))
        results["ops"][op] = r
    results["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"wall {results['wall_s']} s; torch C DLPack exchange API: {results['dlpack_c_exchange_api']}")
    path = sys.argv[1] if len(sys.argv) > 1 else (
        os.path.join(os.environ["H3CUTE_OUT"], "host_overhead.json") if os.environ.get("H3CUTE_OUT") else None)
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)
        print("wrote", path)


if __name__ == "__main__":
    main()
