"""Experiment (device): what the side work of `adaln_proj_wgrad_fold` costs dW at T = 2048, and how the producer
warpgroup's split changes it. Needs `fold_warp_split.patch` applied to 8eff857 (it adds the static build
arguments `producer_regs`, `side`, `fold_warps` and `only` and builds only these variants), then:

    git apply perf/experiments/fold_warp_split.patch
    python -m h3cute build --arch sm_90a --out .prebuilt --kernel adaln_proj_wgrad_fold --kernel adaln_silu_cast
    # device: bash perf/device_run.sh python3 perf/experiments/fold_warp_split.py   (H3CUTE_GPU_TESTS=skip)

Variants (producer registers, side work, fold warps, only): (88, on, 1) is the product's kernel (warp 1 folds
d_temb, warps 2 and 3 sum db's blocks from the stages); (88, off, 1) and (40, off, 1) run the same dW with no side
work; (56, on, 1) gives the consumers 224 registers; (88, on, 2) has warps 1 and 2 fold and warp 3 sum db by 128-row
halves; only "fold" / "db" runs one of the two side jobs (the other's outputs are left unwritten). Prints whether the
variants with all side work give the product's bits (dW, db, d_temb, db blocks) at several (N, T), then per-launch
times at N = 96768, T = 2048: 3 rounds of 20-launch bursts and two 0.7 s sustained runs."""
import statistics
import time

import torch

from h3cute import runtime
from h3cute.launch import adaln_projection as L
from h3cute.widths import BLOCK_PROJECTION, FINAL_PROJECTION, TEMB as D

VARIANTS = [(88, True, 1, ""), (88, False, 1, ""), (56, True, 1, ""), (40, False, 1, ""), (88, True, 2, ""),
            (88, True, 1, "fold"), (88, True, 1, "db")]


def _bits(t):
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _timed(fn, n):
    """Device us per launch of n launches of fn back to back (CUDA events)."""
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(True), torch.cuda.Event(True)
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / n * 1e3


def _burst(fn, n=20):
    for _ in range(3):
        fn()
    return _timed(fn, n)


def _sustained(fn, seconds=0.7):
    """Launches for `seconds` (to the power limit), then as many again timed."""
    torch.cuda.synchronize()
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        fn()
        n += 1
    return _timed(fn, n)


SIZES = ((BLOCK_PROJECTION, 2048), (BLOCK_PROJECTION, 1100), (BLOCK_PROJECTION, 450), (FINAL_PROJECTION, 2048),
         (BLOCK_PROJECTION, 2000))  # (N, T)


def inputs(n_out, rows, dev):
    """grad (an all -0.0 column), act = bf16(silu(temb)), FP32 partials and temb, seeded by T."""
    g = torch.Generator(device=dev).manual_seed(rows)
    grad = torch.randn(rows, n_out, generator=g, device=dev).bfloat16()
    grad[:, 5] = -0.0
    temb = torch.randn(rows, D, generator=g, device=dev)
    return grad, L.silu_bf16(temb), torch.randn(L.DGRAD_SPLITS, rows, D, generator=g, device=dev), temb


def poisoned_outputs(n_out, rows, dev):
    """dW, db, d_temb and the db blocks, NaN-filled."""
    nan = float("nan")
    return (torch.full((n_out, D), nan, dtype=torch.bfloat16, device=dev),
            torch.full((n_out,), nan, dtype=torch.bfloat16, device=dev), torch.full((rows, D), nan, device=dev),
            torch.full((L.dbias_blocks(rows), n_out), nan, device=dev))


def main():
    dev = torch.device("cuda", 0)
    for n_out, rows in SIZES:
        grad, act, partial, temb = inputs(n_out, rows, dev)
        fns = {v: runtime.kernel("adaln_proj_wgrad_fold", dev, out_features=n_out, config="tma_wgrad_persist_m256",
                                 producer_regs=v[0], side=v[1], fold_warps=v[2], only=v[3]) for v in VARIANTS}
        outs = {}
        for v in (v for v in VARIANTS if v[1] and not v[3]):
            o = poisoned_outputs(n_out, rows, dev)
            fns[v](grad, act, o[0], o[1], partial, temb, o[2], o[3])
            outs[v] = o
        torch.cuda.synchronize()
        base = outs[VARIANTS[0]]
        for v, o in outs.items():
            same = all(torch.equal(_bits(a), _bits(b)) for a, b in zip(o, base))
            nan_left = any(x.isnan().any().item() for x in o)
            print(f"N={n_out} T={rows} {v}: the product's bits {same}, NaN left {nan_left}")
        if (n_out, rows) != (BLOCK_PROJECTION, 2048):
            continue
        args = (grad, act, *base[:2], partial, temb, *base[2:])
        times = {v: [_burst(lambda: fns[v](*args)) for _ in range(3)] for v in VARIANTS}
        for v, ts in times.items():
            print("burst", v, round(statistics.median(ts), 1), [round(t, 1) for t in ts])
        for _ in range(2):
            for v in VARIANTS:
                print("sustained", v, round(_sustained(lambda: fns[v](*args)), 1))


if __name__ == "__main__":
    main()
