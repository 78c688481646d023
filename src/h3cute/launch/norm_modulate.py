"""Host side of `h3::norm_modulate` on CUDA, and the row-kernel plumbing shared by the AdaLN row ops.

forward: one launch of `norm_modulate_fwd` (kernels/norm_modulate.py): out = rms_norm(x, w, eps) *
(1 + scale[idx]) + shift[idx], bitwise the diffusers replay. backward, tables of <= 24 rows:
`norm_modulate_bwd_fused` (one pass over grad and x: dx and the FP32 partials of dweight, dshift, dscale
per fixed row group, 7-CTA clusters) and one `rowwise_fold` launch into one buffer whose views are the three
parameter gradients; larger tables (any number of rows):
`norm_modulate_bwd_rows` (dx, bitwise the fused kernel's, and a per-row FP32 rstd workspace),
`norm_modulate_bwd_params` (the partials; windowed beyond 48 table rows, see `reduction_layout`) and the
folds. No host sync anywhere.

The launches are launch plans (h3cute.launch.plan): `build` writes them, `forward_rows` / `backward_rows` check and
prepare the inputs and walk them, and the C++ layer walks the same plans (`native_plan`). Row ranges: S = 0 (no
launch; the backward's parameter gradients zero-filled) and S >= 1.

`forward_rows` / `backward_rows` take any row index vector and row-strided tables (read in place when
their rows are 16-byte aligned, else copied compact first), so `final_adaln_out` reuses them with timestep_indices and
the two halves of its (T, 2H) projection: `forward_rows(x, w, proj[:, :H], proj[:, H:], ti, eps)` (its key names
its check slot, `ForwardKey.op` / `argument`), and the backward with `table_grad` (`BackwardKey.table_grad`).

Determinism of the table/parameter gradients: ROW_GROUPS is fixed per arch (never read from the device),
so the same inputs give the same bits on every GPU of one arch, whatever the stream or timing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h3cute import runtime
from h3cute.launch import plan as P
from h3cute.launch.plan import M, Buffer, Fill, Kernel, Launch, Layout, Output, Phase, Scalar, strided, view
from h3cute.widths import NORM_EPS

OP = "norm_modulate"
INPUTS = {Phase.FORWARD: ("x", "weight", "shift", "scale", "adaln_indices", "eps"),
          Phase.BACKWARD: ("grad", "x", "weight", "scale", "adaln_indices", "eps")}

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


def reduction(name: str, width: int, cap: int, windows: int) -> Kernel:
    """The plan kernel of column reduction `name` for a layout of reduction_layout (its windowed variant when the
    table has more than one window)."""
    return Kernel.of(name, width=width, cap=cap, **(dict(windowed=True) if windows > 1 else {}))


def fold_step(partials: P.View, out: P.View) -> Launch:
    """`rowwise_fold`: out (N,) BF16 = the in-order sum over the P rows of `partials` (P, N) FP32, rounded once."""
    return Launch(Kernel.of("rowwise_fold"), (partials, out))


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


@dataclass(frozen=True)
class RowKey:
    """The static key of a row op's forward (h3::gate_residual's, h3::adaln_row_gather's)."""
    width: int  # H
    check_indices: bool  # False: a bad index writes the discard check slot


@dataclass(frozen=True)
class TableKey:
    """The static key of a row op's backward reduction over a table of `table_rows` rows."""
    width: int
    table_rows: int


@dataclass(frozen=True)
class ForwardKey:
    width: int
    check_indices: bool  # False: a bad index writes the discard check slot
    op: str = OP  # the check slot (op, argument) a bad index is recorded in (final_adaln_out's rows: its own)
    argument: str = "adaln_indices"


@dataclass(frozen=True)
class BackwardKey:
    width: int
    table_rows: int
    table_grad: bool = False  # the table gradient as one (R, 2H) [dshift | dscale] per row (final_adaln_out's)


KEYS = {Phase.FORWARD: ForwardKey, Phase.BACKWARD: BackwardKey}


def build(phase: Phase, device, key, rows: int) -> P.Plan:
    """The launch plan of h3::norm_modulate's `phase` for `rows` rows (the inputs of INPUTS[phase])."""
    width = key.width
    if phase is Phase.FORWARD:
        return P.checked_launch(
            OP, phase, key, device, rows, INPUTS[phase], (Buffer("out", torch.bfloat16, (M, width)),),
            Kernel.of("norm_modulate_fwd", width=width),
            (*(view(name) for name in INPUTS[phase][:-1]), view("out"), Scalar("eps")), (Output(view("out")),),
            (key.op, key.argument, key.check_indices))
    lo, hi = P.any_rows(rows)
    table_rows = key.table_rows
    stride = (1 + 2 * table_rows) * width  # one BF16 buffer, one fold: [dweight | the table rows' gradients]
    buffers = [Buffer("dx", torch.bfloat16, (M, width)), Buffer("grads", torch.bfloat16, (stride,))]
    # the outputs are views of `grads` (per element the same sums as a fold per output): [dweight | dshift rows |
    # dscale rows], or with table_grad [dweight | (dshift row r | dscale row r) for each r]
    if key.table_grad:
        tables = (Output(strided("grads", (table_rows, 2 * width), (2 * width, 1), width)),)
    else:
        tables = tuple(Output(strided("grads", (table_rows, width), (width, 1), width + i * table_rows * width))
                       for i in (0, 1))
    outputs = (Output(view("dx")), Output(view("grads", 0, width)), *tables)
    if rows == 0:
        return P.Plan(OP, phase, key, lo, hi, INPUTS[phase], tuple(buffers), (Fill(view("grads"), 0.0),), outputs)
    cap, windows, groups = reduction_layout(table_rows, device)
    fused = windows == 1 and cap in FUSED_CAPS and width % (FUSED_VEC * 32 * FUSED_CLUSTER) == 0
    if fused:
        groups = FUSED_ROW_GROUPS[runtime.arch_of(device)][cap]
    # Partials per group in the layout of `grads`; every element written by the kernel. Windowed, dweight has a
    # partial per (window, group): its own buffer and fold.
    buffers.append(Buffer("partials", torch.float32, (groups, stride)))
    part_w = strided("partials", (groups, width), (stride, 1))
    if windows > 1:
        buffers.append(Buffer("part_w", torch.float32, (windows * groups, width)))
        part_w = view("part_w")
    row_step, scale_at = (2 * width, 2 * width) if key.table_grad else (width, (1 + table_rows) * width)
    part_shift = strided("partials", (groups, table_rows, width), (stride, row_step, 1), width)
    part_scale = strided("partials", (groups, table_rows, width), (stride, row_step, 1), scale_at)
    operands = (view("grad"), view("x"), view("weight"), view("scale"), view("adaln_indices"))
    if fused:
        steps = [Launch(Kernel.of("norm_modulate_bwd_fused", width=width, cap=cap, step=FUSED_STEP),
                        (*operands, view("dx"), part_w, part_shift, part_scale, Scalar("eps")))]
    else:
        buffers.append(Buffer("rstd", torch.float32, (M,)))
        steps = [Launch(Kernel.of("norm_modulate_bwd_rows", width=width),
                        (*operands, view("dx"), view("rstd"), Scalar("eps"))),
                 Launch(reduction("norm_modulate_bwd_params", width, cap, windows),
                        (*operands, view("rstd"), part_w, part_shift, part_scale))]
    if windows > 1:
        steps += [fold_step(view("part_w", layout=Layout.MATRIX), view("grads", 0, width, Layout.FLAT)),
                  fold_step(strided("partials", (groups, stride - width), (stride, 1), width),
                            view("grads", width, stride, Layout.FLAT))]
    else:
        steps.append(fold_step(view("partials", layout=Layout.MATRIX), view("grads", layout=Layout.FLAT)))
    return P.Plan(OP, phase, key, lo, hi, INPUTS[phase], tuple(buffers), tuple(steps), outputs)


def forward(x, weight, shift, scale, adaln_indices, eps=NORM_EPS, check_indices=True):
    """(S, 5376) BF16 `rms_norm(x, weight, eps) * (1 + scale[idx]) + shift[idx]`; a bad index writes a NaN row
    and, with `check_indices`, is recorded in the op's check slot (h3cute.launch.checks)."""
    return forward_rows(x, weight, shift, scale, adaln_indices, eps, check=check_indices)


def forward_rows(x, weight, shift, scale, idx, eps, op: str = OP, argument: str = "adaln_indices",
                 check: bool = True):
    width = x.shape[-1]
    check_rows(op, "x", x, width)
    _check_vector(op, "weight", weight, width)
    shift = table_view(op, "shift", shift, width)
    scale = table_view(op, "scale", scale, width)
    idx = index_vector(op, idx, x.shape[0])
    key = ForwardKey(width, bool(check), op, argument)
    inputs = (x, weight, shift, scale, idx, float(eps))
    return P.run(build, Phase.FORWARD, key, inputs, x.shape[0], x.shape[:-1], x.device)[0]


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
    key = BackwardKey(width, scale.shape[0], bool(table_grad))
    inputs = (grad, x, weight, scale, idx, float(eps))
    return P.run(build, Phase.BACKWARD, key, inputs, x.shape[0], x.shape[:-1], x.device)


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impls (h3cute.native): the encoded plan of (phase, key (width, check_indices) or (width, table
    rows)) serving `rows`."""
    return P.native_plan(build, KEYS, device, phase, key, rows)
