"""Per-launch device time and achieved bandwidth of the row ops' kernels (norm_modulate, gate_residual,
adaln_row_gather, gate_residual_norm_modulate), forward and backward, at S = 4097, 32768, 131072. A device script: it
runs on the prebuilt bundle (`bash perf/device_run.sh python3 perf/row_kernels.py`) and never compiles.

How: each op is called once through its launch module (h3cute.launch.*) with `h3cute.runtime.kernel`
wrapped so that every kernel launch it makes is recorded (name, static args, the tensors it got). Each
recorded launch is then replayed alone under `h3cute.bench.timing.device_timer` (a `torch.cuda._sleep` spin
keeps the GPU busy while the host queues start event, launch, end event, so the interval is device time
only); median of 50 after 10 warm-ups. Bytes a launch must move = the sum of its tensor arguments' sizes (each read or
written once in full; tables and weights count once although every CTA reads its rows). A device-to-
device copy of 1 GiB measured in the same run gives the copy bandwidth the GB/s compare against.

JSON to $H3CUTE_OUT/row_kernels.json (default: the current directory); a table on stdout.
Options: --sizes 4097,32768,131072  --table-rows 9  --ops norm_modulate,gate_residual,adaln_row_gather,...
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from h3cute import runtime
from h3cute.bench import timing
from h3cute.bench.report import write_device_json
from h3cute.launch import adaln_row_gather, gate_residual, gate_residual_norm_modulate, norm_modulate
from h3cute.widths import BLOCK_CHUNKS, BLOCK_TABLE, HIDDEN as H, NORM_EPS

WARMUP, SAMPLES = 10, 50


class Recorder:
    """Wraps runtime.kernel: the launches an op makes are run and recorded in order."""

    def __init__(self):
        self.launches = []
        self._kernel = runtime.kernel

    def __enter__(self):
        def kernel(name, device, **static):
            fn = self._kernel(name, device, **static)

            def launch(*args):
                self.launches.append((name, static, fn, args))
                return fn(*args)

            return launch

        runtime.kernel = kernel
        return self

    def __exit__(self, *exc):
        runtime.kernel = self._kernel


def tensor_bytes(args) -> int:
    return sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))


def _bits(args) -> list:
    """Byte copies of tensors (a NaN-safe bitwise comparison; perf/norm_backward_sweep.py)."""
    return [a.detach().contiguous().view(-1).view(torch.uint8).clone() for a in args if isinstance(a, torch.Tensor)]


def time_launch(fn, args) -> float:
    """Median device microseconds of one launch of fn(*args) (`timing.device_timer`)."""
    return timing.device_timer("cuda", WARMUP, SAMPLES)(lambda: fn(*args))


def copy_bandwidth() -> float:
    """GB/s of a 1 GiB device-to-device copy (read + write counted)."""
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = time_launch(dst.copy_, (src,))
    return 2 * src.numel() * src.element_size() / us / 1e3


def _inputs(op, rows, table_rows, gen):
    def randn(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(torch.bfloat16)

    idx = torch.randint(0, table_rows, (rows,), generator=gen, device="cuda")
    if op == "norm_modulate":
        x, grad = randn(rows, H, scale=2.0), randn(rows, H)
        w = (0.5 + torch.rand(H, generator=gen, device="cuda")).to(torch.bfloat16)
        shift, scale = randn(table_rows, H, scale=0.1), randn(table_rows, H, scale=0.1)
        return (lambda: norm_modulate.forward(x, w, shift, scale, idx, NORM_EPS),
                lambda: norm_modulate.backward(grad, x, w, scale, idx, NORM_EPS, table_rows))
    if op == "gate_residual":
        res, y, grad, gate = randn(rows, H), randn(rows, H), randn(rows, H), randn(table_rows, H, scale=0.1)
        return (lambda: gate_residual.forward(res, y, gate, idx),
                lambda: gate_residual.backward(grad, y, gate, idx))
    if op == "adaln_row_gather":
        table = randn(table_rows, BLOCK_TABLE)
        grads = [randn(rows, H) for _ in range(BLOCK_CHUNKS)]
        return (lambda: adaln_row_gather.forward(table, idx),
                lambda: adaln_row_gather.backward(grads, idx, table_rows))
    if op.startswith("gate_residual_norm_modulate"):  # "...@4" / "...@8": that forward row layout
        vec = int(op.split("@")[1]) if "@" in op else gate_residual_norm_modulate.FORWARD_VEC
        res, y, grad_h, grad_out = randn(rows, H), randn(rows, H), randn(rows, H), randn(rows, H)
        w = (0.5 + torch.rand(H, generator=gen, device="cuda")).to(torch.bfloat16)
        gate, shift, scale = (randn(table_rows, H, scale=0.1) for _ in range(3))
        h, _ = gate_residual_norm_modulate.forward(res, y, gate, w, shift, scale, idx, NORM_EPS, vec=vec)
        return (lambda: gate_residual_norm_modulate.forward(res, y, gate, w, shift, scale, idx, NORM_EPS, vec=vec),
                lambda: gate_residual_norm_modulate.backward(grad_h, grad_out, y, gate, h, w, scale, idx, NORM_EPS,
                                                             table_rows))
    raise ValueError(op)


def measure(op, rows, table_rows, copy_gbs):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    fwd, bwd = _inputs(op, rows, table_rows, gen)
    result = {}
    for direction, call in (("fwd", fwd), ("bwd", bwd)):
        with Recorder() as rec:
            keep = call()  # the outputs stay alive while their launches are replayed
        torch.cuda.synchronize()
        if not rec.launches:
            raise RuntimeError(f"{op} {direction}: no launch went through h3cute.runtime.kernel (cached elsewhere?)")
        launches = []
        for name, static, fn, args in rec.launches:
            us = time_launch(fn, args)
            nbytes = tensor_bytes(args)
            gbs = nbytes / us / 1e3
            launches.append(dict(kernel=name, static=static, us=round(us, 2), bytes=nbytes, gb_s=round(gbs, 1),
                                 of_copy=round(gbs / copy_gbs, 3)))
        total_us = sum(launch["us"] for launch in launches)
        total_bytes = sum(launch["bytes"] for launch in launches)
        result[direction] = dict(launches=launches, total_us=round(total_us, 2), total_bytes=total_bytes,
                                 floor_us_at_copy_bw=round(total_bytes / copy_gbs / 1e3, 2))
        del keep, rec
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4097,32768,131072")
    p.add_argument("--table-rows", type=int, default=9)
    p.add_argument("--ops", default="norm_modulate,gate_residual,adaln_row_gather,gate_residual_norm_modulate@8,"
                                    "gate_residual_norm_modulate@4")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("perf/row_kernels.py needs a CUDA device")
    t0 = time.time()
    copy_gbs = copy_bandwidth()
    report = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, arch=runtime.arch_of(0),
                  table_rows=a.table_rows, copy_gb_s=round(copy_gbs, 1), timer="cuda_event after _sleep spin",
                  warmup=WARMUP, samples=SAMPLES, results={})
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; table rows {a.table_rows}")
    print(f"{'op':18} {'S':>7} {'dir':3} {'kernel':28} {'us':>9} {'MB':>9} {'GB/s':>7} {'of copy':>7}")
    for op in a.ops.split(","):
        report["results"][op] = {}
        for rows in (int(s) for s in a.sizes.split(",")):
            try:
                res = measure(op, rows, a.table_rows, copy_gbs)
            except Exception as e:  # one failing op/size is recorded, the rest still run
                res = dict(error=f"{type(e).__name__}: {e}")
                print(f"{op:18} {rows:7} error {res['error']}")
            report["results"][op][str(rows)] = res
            for direction in ("fwd", "bwd"):
                if direction not in res:
                    continue
                for launch in res[direction]["launches"]:
                    label = launch["kernel"]
                    print(f"{op:18} {rows:7} {direction:3} {label:28} {launch['us']:9.1f} {launch['bytes'] / 1e6:9.1f} "
                          f"{launch['gb_s']:7.0f} {launch['of_copy']:7.2f}")
                r = res[direction]
                print(f"{op:18} {rows:7} {direction:3} {'= total':28} {r['total_us']:9.1f} "
                      f"{r['total_bytes'] / 1e6:9.1f}   floor {r['floor_us_at_copy_bw']:.1f} us")
            torch.cuda.empty_cache()
    report["wall_s"] = round(time.time() - t0, 1)
    print(f"wrote {write_device_json(report, 'row_kernels.json')} in {report['wall_s']} s")


if __name__ == "__main__":
    main()
