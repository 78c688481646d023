"""Host side of `h3::norm_modulate` on CUDA, and the row-kernel plumbing shared by the AdaLN row ops.

forward: one launch of `norm_modulate_fwd` (kernels/norm_modulate.py): out = rms_norm(x, w, eps) *
(1 + scale[idx]) + shift[idx], bitwise the diffusers replay. backward, tables of <= 24 rows:
`norm_modulate_bwd_fused` (one pass over grad and x: dx and the FP32 partials of dweight, dshift, dscale
per fixed row group, 7-CTA clusters) and one `rowwise_fold` launch into one buffer whose views are the three
parameter gradients; larger tables (any number of rows):
`norm_modulate_bwd_rows` (dx, bitwise the fused kernel's, and a per-row FP32 rstd workspace),
`norm_modulate_bwd_params` (the partials; windowed beyond 48 table rows, see `reduction_layout`) and the
folds. No host sync anywhere.

`forward_rows` / `backward_rows` take any row index vector and row-strided tables (read in place when
their rows are 16-byte aligned, else copied compact first), so `final_adaln_out` reuses them with timestep_indices and
the two halves of its (T, 2H) projection: `forward_rows(x, w, proj[:, :H], proj[:, H:], ti, eps)`.

Determinism of the table/parameter gradients: ROW_GROUPS is fixed per arch (never read from the device),
so the same inputs give the same bits on every GPU of one arch, whatever the stream or timing.
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.launch import checks
from h3cute.widths import HIDDEN, NORM_EPS

COL_TILE = 256  # kernels/rowwise.py COL_TILE: the widths must be multiples of it
TABLE_ROWS_CAPS = (12, 24, 48)  # kernels/rowwise.py TABLE_ROWS_CAPS
MAX_TABLE_ROWS = TABLE_ROWS_CAPS[-1]  # table rows one reduction CTA holds; larger tables take windows of this many
# Row groups of the column reductions: (H / 256) x P one-warp CTAs, about 7 per SM.
ROW_GROUPS = {"sm_90a": 44, "sm_100a": 49}
# The fused backward (kernels/norm_modulate.py FUSED_CAPS, CLUSTER, FUSED_VEC, FUSED_STEPS): row groups = clusters of
# 7 CTAs, no more than are resident at once. A cluster lives inside one GPC (8 GPCs of 14-20 SMs on H200 and
# B200): cap 12 runs 2 CTAs per SM (94 KB of shared memory each), >= 4 clusters per GPC; cap 24 runs 1
# (187 KB), 2 clusters per GPC.
FUSED_CAPS = (12, 24)
FUSED_STEP = 8
FUSED_STEPS_BUNDLED = (8,)  # kernels/norm_modulate.py FUSED_STEPS: what perf/norm_backward_sweep.py can time
FUSED_CLUSTER = 7
FUSED_VEC = 4  # columns per thread of a fused CTA (192 threads per 768-column slice)
FUSED_ROW_GROUPS = {"sm_90a": {12: 32, 24: 16}, "sm_100a": {12: 36, 24: 16}}


def table_rows_cap(table_rows: int) -> int:
    """The compiled table-row capacity of the reduction kernels for a table of `table_rows` rows (MAX_TABLE_ROWS
    for every larger table: its windows)."""
    return next((cap for cap in TABLE_ROWS_CAPS if table_rows <= cap), MAX_TABLE_ROWS)


def row_groups(device: torch.device) -> int:
    return ROW_GROUPS[runtime.arch_of(device)]


def reduction_layout(table_rows: int, device: torch.device) -> tuple[int, int, int]:
    """(cap, windows, row groups) of the column reductions for a table of `table_rows` rows.

    Up to MAX_TABLE_ROWS rows: the plain kernels of the smallest cap that holds the table, one window,
    ROW_GROUPS groups. Beyond: the windowed kernels (cap MAX_TABLE_ROWS, ceil(R / MAX_TABLE_ROWS) windows), with
    as many row groups as keep P x R within ROW_GROUPS x MAX_TABLE_ROWS partial rows (at least one): the FP32
    partials stay within the plain kernels' largest, and the grid (column tiles x windows x groups) about the
    same size. A function of (R, arch) only, like ROW_GROUPS: the sums stay deterministic."""
    groups = row_groups(device)
    if table_rows <= MAX_TABLE_ROWS:
        return table_rows_cap(table_rows), 1, groups
    return MAX_TABLE_ROWS, -(-table_rows // MAX_TABLE_ROWS), max(1, groups * MAX_TABLE_ROWS // table_rows)


def reduction_kernel(name: str, device: torch.device, width: int, cap: int, windows: int):
    """The compiled column-reduction kernel `name` for a layout of reduction_layout (its windowed variant when
    the table has more than one window)."""
    if windows > 1:
        return runtime.kernel(name, device, width=width, cap=cap, windowed=True)
    return runtime.kernel(name, device, width=width, cap=cap)


def fold(partials: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """out (contiguous BF16) = the in-order sum over dim 0 of `partials` (P, *out.shape) FP32, rounded once."""
    runtime.kernel("rowwise_fold", out.device)(partials.reshape(partials.shape[0], -1), out.view(-1))
    return out


def check_rows(op: str, name: str, t: torch.Tensor, width: int) -> None:
    if t.dim() != 2 or t.shape[1] != width or t.dtype != torch.bfloat16 or not t.is_contiguous():
        raise ValueError(f"h3::{op}: {name} must be a contiguous (S, {width}) BF16 tensor, got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if t.data_ptr() % 16:
        raise ValueError(f"h3::{op}: {name} must be 16-byte aligned")


def table_view(op: str, name: str, t: torch.Tensor, width: int) -> torch.Tensor:
    """A (R, width) BF16 table the kernels can read with 16-byte row loads: `t` itself when its rows are
    16-byte aligned (any row stride that is a multiple of 8), else a compact copy (tables are tiny)."""
    if t.dim() != 2 or t.shape[1] != width or t.dtype != torch.bfloat16:
        raise ValueError(f"h3::{op}: {name} must be a (R, {width}) BF16 table, got {tuple(t.shape)} {t.dtype}")
    if t.stride(1) != 1 or t.stride(0) % 8 or t.data_ptr() % 16:
        return t.clone(memory_format=torch.contiguous_format)
    return t


def index_vector(op: str, idx: torch.Tensor, num_rows: int) -> torch.Tensor:
    if idx.dim() != 1 or idx.shape[0] != num_rows or idx.dtype != torch.int64:
        raise ValueError(f"h3::{op}: indices must be ({num_rows},) int64, got {tuple(idx.shape)} {idx.dtype}")
    return idx.contiguous()


def _check_vector(op: str, name: str, t: torch.Tensor, width: int) -> None:
    if t.shape != (width,) or t.dtype != torch.bfloat16 or not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"h3::{op}: {name} must be a contiguous 16-byte aligned ({width},) BF16 tensor")


def kernel_handles(device: int, variant: int, num_rows: int):
    """For the C++ impls (h3cute.native), every row count: variant 0, the forward's `norm_modulate_fwd` with its
    check_constants;
    variant R (table rows, fused caps only), the backward's `norm_modulate_bwd_fused` and `rowwise_fold`
    with its row-group count."""
    dev = torch.device("cuda", device)
    if variant == 0:
        return (0, runtime.MAX_ROWS, [runtime.kernel("norm_modulate_fwd", dev, width=HIDDEN).__chandle__()],
                check_constants(dev, "norm_modulate"))
    cap = table_rows_cap(variant)
    if variant > cap or cap not in FUSED_CAPS:
        raise ValueError(f"norm_modulate: no fused backward for {variant} table rows")
    fns = [runtime.kernel("norm_modulate_bwd_fused", dev, width=HIDDEN, cap=cap, step=FUSED_STEP),
           runtime.kernel("rowwise_fold", dev)]
    return 0, runtime.MAX_ROWS, [fn.__chandle__() for fn in fns], [FUSED_ROW_GROUPS[runtime.arch_of(dev)][cap]]


def check_constants(device: torch.device, op: str, argument: str = "adaln_indices") -> list[int]:
    """Launch constants of a checking forward for the C++ impls: the check slot addresses of (op, argument) and
    of the discard slot (h3cute.launch.checks), the kernel's last two arguments when checked and unchecked."""
    return [*checks.slot_addresses(device, op, argument), *checks.slot_addresses(device, op, argument, False)]


def row_op_kernel_handles(device: int, variant: int, op: str, forward_kernel: str, backward_kernel: str):
    """kernel_handles of a row op with a one-kernel forward and a backward of `backward_kernel` (by table cap)
    plus `rowwise_fold` over ROW_GROUPS: variant 0, [forward] and its check_constants; variant R (table rows, at
    most MAX_TABLE_ROWS: the C++ impls hand larger tables to Python), [backward, fold] and [row groups]. Every row
    count shares the answer."""
    dev = torch.device("cuda", device)
    if variant == 0:
        return (0, runtime.MAX_ROWS, [runtime.kernel(forward_kernel, dev, width=HIDDEN).__chandle__()],
                check_constants(dev, op.removesuffix("_backward")))
    cap, windows, groups = reduction_layout(variant, dev)
    if windows > 1:
        raise ValueError(f"h3::{op}: the C++ backward takes at most {MAX_TABLE_ROWS} table rows, got {variant}")
    fns = [runtime.kernel(backward_kernel, dev, width=HIDDEN, cap=cap), runtime.kernel("rowwise_fold", dev)]
    return 0, runtime.MAX_ROWS, [fn.__chandle__() for fn in fns], [groups]


def forward(x, weight, shift, scale, adaln_indices, eps=NORM_EPS, check_indices=True):
    """(S, 5376) BF16 `rms_norm(x, weight, eps) * (1 + scale[idx]) + shift[idx]`; a bad index writes a NaN row
    and, with `check_indices`, is recorded in the op's check slot (h3cute.launch.checks)."""
    return forward_rows(x, weight, shift, scale, adaln_indices, eps, check=check_indices)


def forward_rows(x, weight, shift, scale, idx, eps, op: str = "norm_modulate", argument: str = "adaln_indices",
                 check: bool = True):
    width = x.shape[-1]
    check_rows(op, "x", x, width)
    _check_vector(op, "weight", weight, width)
    shift = table_view(op, "shift", shift, width)
    scale = table_view(op, "scale", scale, width)
    idx = index_vector(op, idx, x.shape[0])
    out = torch.empty_like(x)
    if x.shape[0]:
        runtime.kernel("norm_modulate_fwd", x.device, width=width)(
            x, weight, shift, scale, idx, out, float(eps), *checks.slot_addresses(x.device, op, argument, check))
    return out


def backward(grad, x, weight, scale, adaln_indices, eps, table_rows):
    """(dx, dweight, dshift, dscale), all BF16; the last three reduced over rows deterministically."""
    if scale.shape[0] != table_rows:
        raise ValueError(f"h3::norm_modulate_backward: scale has {scale.shape[0]} rows, table_rows = {table_rows}")
    return backward_rows(grad, x, weight, scale, adaln_indices, eps)


def backward_rows(grad, x, weight, scale, idx, eps, op: str = "norm_modulate_backward", table_grad: bool = False):
    """(dx, dweight, dshift, dscale), all BF16, the last three reduced over rows deterministically; with
    `table_grad`, (dx, dweight, dtable) where dtable (R, 2H) = [dshift | dscale] per table row (final_adaln_out's
    projection gradient), the partials laid out so that one fold writes it. The parameter gradients are views of
    one buffer that one fold writes (per element the same sums as a fold per output)."""
    width = x.shape[-1]
    check_rows(op, "x", x, width)
    check_rows(op, "grad", grad, width)
    _check_vector(op, "weight", weight, width)
    scale = table_view(op, "scale", scale, width)
    idx = index_vector(op, idx, x.shape[0])
    table_rows = scale.shape[0]
    num_rows, device = x.shape[0], x.device
    cap, windows, groups = reduction_layout(table_rows, device)
    dx = torch.empty_like(x)
    # One BF16 buffer, one fold: [dweight | dshift rows | dscale rows], or with table_grad [dweight | (dshift row r |
    # dscale row r) for each r]; the outputs are views of it (per element the same sums as a fold per output).
    grads = torch.empty((1 + 2 * table_rows) * width, dtype=torch.bfloat16, device=device)
    dweight, rows = grads[:width], grads[width:]
    if table_grad:
        outputs = (dx, dweight, rows.view(table_rows, 2 * width))
    else:
        outputs = (dx, dweight, rows[:table_rows * width].view(table_rows, width),
                   rows[table_rows * width:].view(table_rows, width))
    if num_rows == 0:
        grads.zero_()
        return outputs
    fused = windows == 1 and cap in FUSED_CAPS and width % (FUSED_VEC * 32 * FUSED_CLUSTER) == 0
    if fused:
        groups = FUSED_ROW_GROUPS[runtime.arch_of(device)][cap]
    # Partials per group in the layout of `grads`; every element written by the kernel. Windowed, dweight has a
    # partial per (window, group): its own buffer and fold.
    partials = torch.empty((groups, (1 + 2 * table_rows) * width), dtype=torch.float32, device=device)
    part_w = partials[:, :width]
    if windows > 1:
        part_w = torch.empty((windows * groups, width), dtype=torch.float32, device=device)
    if table_grad:
        part_rows = partials[:, width:].view(groups, table_rows, 2 * width)
        part_shift, part_scale = part_rows[:, :, :width], part_rows[:, :, width:]
    else:
        part_shift = partials[:, width:(1 + table_rows) * width].view(groups, table_rows, width)
        part_scale = partials[:, (1 + table_rows) * width:].view(groups, table_rows, width)
    if fused:
        runtime.kernel("norm_modulate_bwd_fused", device, width=width, cap=cap, step=FUSED_STEP)(
            grad, x, weight, scale, idx, dx, part_w, part_shift, part_scale, float(eps))
    else:
        rstd = torch.empty(num_rows, dtype=torch.float32, device=device)
        runtime.kernel("norm_modulate_bwd_rows", device, width=width)(grad, x, weight, scale, idx, dx, rstd,
                                                                      float(eps))
        reduction_kernel("norm_modulate_bwd_params", device, width, cap, windows)(
            grad, x, weight, scale, idx, rstd, part_w, part_shift, part_scale)
    if windows > 1:
        fold(part_w, dweight)
        fold(partials[:, width:], rows)
    else:
        fold(partials, grads)
    return outputs
