"""Experiment (device): `adaln_proj_wgrad_fold`'s db passes spread over four N tiles per stage (tried at 7e864b7,
reverted after this experiment) against a4f5c14's assignment, the product's (every pass of block b in the tile of
N tile b % 21, two passes per db warp). Needs `dbias_spread.patch` applied to 7e864b7 (a static `spread` build
argument; both variants in the bundle, 7e864b7's as the default):

    git apply perf/experiments/dbias_spread.patch
    python -m h3cute build --arch sm_90a --out .prebuilt
    # device: bash perf/device_run.sh python3 perf/experiments/dbias_spread.py

Prints whether both give the same bits (dW, db, d_temb, db blocks) at several (N, T), then per-launch times at
N = 96768, T = 2048: 3 rounds of 20-launch bursts and two 0.7 s sustained runs of each."""
import runpy
import statistics
from pathlib import Path

import torch

from h3cute import runtime
from h3cute.widths import BLOCK_PROJECTION

_shared = runpy.run_path(str(Path(__file__).with_name("fold_warp_split.py")), run_name="imported")
VARIANTS = {"spread": {}, "a4f5c14": dict(spread=False)}


def main():
    dev = torch.device("cuda", 0)
    for n_out, rows in _shared["SIZES"]:
        grad, act, partial, temb = _shared["inputs"](n_out, rows, dev)
        fns = {v: runtime.kernel("adaln_proj_wgrad_fold", dev, out_features=n_out, config="tma_wgrad_persist_m256",
                                 **x) for v, x in VARIANTS.items()}
        outs = {}
        for v, fn in fns.items():
            o = _shared["poisoned_outputs"](n_out, rows, dev)
            fn(grad, act, o[0], o[1], partial, temb, o[2], o[3])
            outs[v] = o
        torch.cuda.synchronize()
        same = all(torch.equal(_shared["_bits"](a), _shared["_bits"](b)) for a, b in zip(*outs.values()))
        left = any(x.isnan().any().item() for o in outs.values() for x in o)
        print(f"N={n_out} T={rows}: the same bits {same}, NaN left {left}")
        if (n_out, rows) != (BLOCK_PROJECTION, 2048):
            continue
        args = (grad, act, *outs["spread"][:2], partial, temb, *outs["spread"][2:])
        times = {v: [_shared["_burst"](lambda: fn(*args)) for _ in range(3)] for v, fn in fns.items()}
        for v, ts in times.items():
            print("burst", v, round(statistics.median(ts), 1), [round(t, 1) for t in ts])
        for _ in range(2):
            for v, fn in fns.items():
                print("sustained", v, round(_shared["_sustained"](lambda: fn(*args)), 1))


if __name__ == "__main__":
    main()
