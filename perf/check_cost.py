"""What a checked h3 call costs against an unchecked one, per call, on the device.

Run: `bash perf/device_run.sh python3 perf/check_cost.py` (H3CUTE_GPU_TESTS=skip to skip the tests).
Every op that checks values on CUDA (the index ops at S = 4097 and 32768 rows, T = 3; timestep_sinusoid and
adaln_indices), called through `torch.ops.h3` as users call it, three ways in one run:
  checked    the default (`check_indices=True` / `check_range=True`): the kernel checks and records
             (h3cute.launch.checks), no host sync
  unchecked  `check_indices=False` / `check_range=False`
  host_sync  the unchecked call after a host-side check of the same values (`validate.check_indices`,
             aminmax + a device-to-host read): what a synchronising check costs, for reference
Each figure is the median CUDA-event time of one whole call from Python, calls back to back (the harness's
`fwd_us`: the host's time when the host is the slower side). Writes JSON to the path argument, else
$H3CUTE_OUT/check_cost.json, else ./check_cost.json; a table goes to stdout.
"""
from __future__ import annotations

import sys

import torch

import h3cute
from h3cute import reference
from h3cute.bench import timing
from h3cute.bench.report import h3cute_commit, write_device_json
from h3cute.ops import validate
from h3cute.widths import BLOCK_TABLE, FINAL_PROJECTION, NORM_EPS, TEMB

WARMUP, SAMPLES = 50, 500
median_us = timing.timer("cuda", WARMUP, SAMPLES)


def _cases(rows: int):
    x, w, shift, scale, idx = (t.cuda() for t in reference.example_inputs("norm_modulate", rows, num_timesteps=3))
    y = torch.randn_like(x)
    table = torch.randn(9, BLOCK_TABLE, device="cuda").to(torch.bfloat16)
    temb = torch.randn(3, TEMB, device="cuda")
    pw = (torch.randn(FINAL_PROJECTION, TEMB, device="cuda") * 0.02).to(torch.bfloat16)
    pb = torch.zeros(FINAL_PROJECTION, device="cuda").to(torch.bfloat16)
    ti, tags = idx // 3, idx % 3

    def host(values, bound):
        return lambda: validate.check_indices("check_cost", "idx", values, bound, "")

    ops = torch.ops.h3
    yield "norm_modulate", lambda c: ops.norm_modulate(x, w, shift, scale, idx, NORM_EPS, c), host(idx, 9)
    yield "gate_residual", lambda c: ops.gate_residual(x, y, shift, idx, c), host(idx, 9)
    yield "adaln_row_gather", lambda c: ops.adaln_row_gather(table, idx, c), host(idx, 9)
    yield "final_adaln_out", lambda c: ops.final_adaln_out(x, w, temb, pw, pb, ti, NORM_EPS, c), host(ti, 3)
    if hasattr(ops, "gate_residual_norm_modulate"):
        yield ("gate_residual_norm_modulate",
               lambda c: ops.gate_residual_norm_modulate(x, y, shift, w, shift, scale, idx, NORM_EPS, c), host(idx, 9))
    if rows == 4097:
        t = torch.rand(3, device="cuda")
        yield "timestep_sinusoid", lambda c: ops.timestep_sinusoid(t, c), lambda: validate.check_timestep_values(t)
        yield "adaln_indices", lambda c: h3cute.adaln_indices(ti, tags, 3), lambda: (host(ti, 3)(), host(tags, 3)())


def main() -> None:
    rows_out = []
    print(f"{'op':30} {'S':>6} {'checked':>9} {'unchecked':>9} {'ratio':>6} {'host_sync':>9}")
    for rows in (4097, 32768):
        for name, call, host_check in _cases(rows):
            checked = median_us(lambda: call(True))
            unchecked = median_us(lambda: call(False)) if name != "adaln_indices" else None
            synced = median_us(lambda: (host_check(), call(False)))
            h3cute.check_errors()  # every call above was valid: nothing may have been recorded
            ratio = checked / unchecked if unchecked else None
            rows_out.append(dict(op=name, rows=rows, checked_us=checked, unchecked_us=unchecked, ratio=ratio,
                                 host_sync_us=synced))
            print(f"{name:30} {rows:>6} {checked:9.2f} {unchecked or float('nan'):9.2f} "
                  f"{ratio or float('nan'):6.3f} {synced:9.2f}")
    record = dict(kind="h3_check_cost", gpu=torch.cuda.get_device_name(), torch=torch.__version__, **h3cute_commit(),
                  warmup=WARMUP, samples=SAMPLES, timer="median CUDA-event time per call, calls back to back",
                  native=bool(h3cute.native.load()), results=rows_out)
    path = write_device_json(record, "check_cost.json", sys.argv[1] if len(sys.argv) > 1 else None)
    print("wrote", path)


if __name__ == "__main__":
    main()
