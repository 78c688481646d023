"""Device time of the fused norm backward (`norm_modulate_bwd_fused`) over its bundled build variants (rows per
exchange step) and launch row-group counts (clusters), on one set of inputs. A device script for the prebuilt
bundle: `bash perf/device_run.sh python3 perf/norm_backward_sweep.py [--groups 28,30,32] [--table-rows 3]`.

Each variant runs on the same grad, x, weight, scale, idx (norm_modulate's inputs, T = 3 -> 9 table rows, or
--table-rows); device time per launch as perf/row_kernels.py measures it (spin, events, median of 50). Bits:
dx must be identical for every variant (it depends on the row only), and the folded dweight / dshift / dscale
identical for every variant of one row-group count; sha256 prefixes of both make runs comparable.
JSON to $H3CUTE_OUT/norm_backward_sweep.json.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from row_kernels import H, _bits, copy_bandwidth, time_launch  # noqa: E402

from h3cute import runtime  # noqa: E402
from h3cute.bench.report import write_device_json  # noqa: E402
from h3cute.launch import norm_modulate  # noqa: E402
from h3cute.widths import NORM_EPS


def run_variant(inputs, step, groups):
    grad, x, w, scale, idx = inputs
    table_rows = scale.shape[0]
    cap = norm_modulate.table_rows_cap(table_rows)
    fn = runtime.kernel("norm_modulate_bwd_fused", x.device, width=H, cap=cap, step=step)
    dx = torch.full_like(x, float("nan"))
    partials = torch.full((groups, (1 + 2 * table_rows) * H), float("nan"), device=x.device)
    part_w = partials[:, :H]
    part_shift = partials[:, H:(1 + table_rows) * H].view(groups, table_rows, H)
    part_scale = partials[:, (1 + table_rows) * H:].view(groups, table_rows, H)
    args = (grad, x, w, scale, idx, dx, part_w, part_shift, part_scale, NORM_EPS)
    fn(*args)
    folded = [norm_modulate.fold(p, torch.empty(p.shape[1:], dtype=torch.bfloat16, device=x.device))
              for p in (part_w, part_shift, part_scale)]
    return time_launch(fn, args), dx, folded


def _sha(tensors) -> str:
    return hashlib.sha256(b"".join(t.cpu().numpy().tobytes() for t in tensors)).hexdigest()[:16]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="4097,32768")
    p.add_argument("--table-rows", type=int, default=9)
    p.add_argument("--steps", default=",".join(str(s) for s in norm_modulate.FUSED_STEPS_BUNDLED))
    p.add_argument("--groups", default="28,30,32")
    a = p.parse_args(argv)
    variants = [(int(s), int(g)) for s in a.steps.split(",") for g in a.groups.split(",")]
    copy_gbs = copy_bandwidth()
    report = dict(gpu=torch.cuda.get_device_name(), copy_gb_s=round(copy_gbs, 1), table_rows=a.table_rows,
                  results={})
    print(f"copy bandwidth {copy_gbs:.0f} GB/s; table rows {a.table_rows}")
    for rows in (int(s) for s in a.sizes.split(",")):
        gen = torch.Generator(device="cuda").manual_seed(rows)
        bf = torch.bfloat16
        x = (torch.randn(rows, H, generator=gen, device="cuda") * 2).to(bf)
        grad = torch.randn(rows, H, generator=gen, device="cuda").to(bf)
        w = (0.5 + torch.rand(H, generator=gen, device="cuda")).to(bf)
        scale = (torch.randn(a.table_rows, H, generator=gen, device="cuda") * 0.1).to(bf)
        idx = torch.randint(0, a.table_rows, (rows,), generator=gen, device="cuda")
        nbytes = 3 * x.numel() * x.element_size()  # grad, x in; dx out
        first_dx, folded_of, entries = None, {}, []
        for step, groups in variants:
            entry = dict(step=step, groups=groups)
            try:
                us, dx, folded = run_variant((grad, x, w, scale, idx), step, groups)
            except Exception as e:  # not bundled: recorded
                entry["error"] = f"{type(e).__name__}: {e}"
                entries.append(entry)
                print(f"{rows:7} {entry}")
                continue
            dx_bits, fold_bits = _bits([dx]), _bits(folded)
            first_dx = dx_bits if first_dx is None else first_dx
            ref = folded_of.setdefault(groups, fold_bits)
            entry.update(us=round(us, 1), of_copy=round(nbytes / us / 1e3 / copy_gbs, 3),
                         dx_same_bits=all(torch.equal(u, v) for u, v in zip(first_dx, dx_bits)),
                         params_same_bits=all(torch.equal(u, v) for u, v in zip(ref, fold_bits)),
                         dx_finite=bool(torch.isfinite(dx).all()), dx_sha=_sha(dx_bits), params_sha=_sha(fold_bits))
            entries.append(entry)
            print(f"{rows:7} step {step:2} groups {groups:3}: {us:8.1f} us {entry['of_copy']:.2f} of copy  "
                  f"dx bits {'=' if entry['dx_same_bits'] else 'DIFFER'}  params bits "
                  f"{'=' if entry['params_same_bits'] else 'DIFFER'}{'' if entry['dx_finite'] else '  NON-FINITE dx'}"
                  f"  dx {entry['dx_sha']} params {entry['params_sha']}")
        report["results"][str(rows)] = entries
    print(f"wrote {write_device_json(report, 'norm_backward_sweep.json')}")


if __name__ == "__main__":
    main()
