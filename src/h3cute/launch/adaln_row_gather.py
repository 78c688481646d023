"""Host side of `h3::adaln_row_gather` on CUDA: `adaln_row_gather_fwd`, and `adaln_row_gather_bwd` (all six
chunks in one launch) + one `rowwise_fold`.

forward: one launch (grid S x 6) copies the six (S, 5376) chunks table[idx, c*H:(c+1)*H] into six fresh
tensors: bitwise `index_select`. backward: d_table[r] = sum over rows with idx = r of the six grads,
FP32 partials per fixed row group (h3cute.launch.norm_modulate.reduction_layout) written into columns
[c*H, (c+1)*H) of one (P, R, 6H) buffer by one launch, then folded in group order, rounded once.

The launches are launch plans (h3cute.launch.plan): `build` writes them, `forward` / `backward` check and prepare
the inputs and walk them, and the C++ layer walks the same plans (`native_plan`). Row ranges: S = 0 (no launch;
the backward's d_table zero-filled, as it is for a table of no rows) and S >= 1.
"""
from __future__ import annotations


import torch

from h3cute.launch import plan as P
from h3cute.launch.plan import M, Buffer, Fill, Kernel, Launch, Layout, Output, Phase, view
from h3cute.widths import BLOCK_CHUNKS

from .norm_modulate import (RowKey, TableKey, check_rows, fold_step, index_vector, reduction, reduction_layout,
                            table_view)

OP = "adaln_row_gather"
OUTS = tuple(f"out{c}" for c in range(BLOCK_CHUNKS))
GRADS = tuple(f"grad{c}" for c in range(BLOCK_CHUNKS))
INPUTS = {Phase.FORWARD: ("table", "adaln_indices"), Phase.BACKWARD: (*GRADS, "adaln_indices")}


ForwardKey, BackwardKey = RowKey, TableKey
KEYS = {Phase.FORWARD: ForwardKey, Phase.BACKWARD: BackwardKey}


def build(phase: Phase, device, key, rows: int) -> P.Plan:
    """The launch plan of h3::adaln_row_gather's `phase` for `rows` rows (indices; the inputs of INPUTS[phase])."""
    width = key.width
    if phase is Phase.FORWARD:
        return P.checked_launch(
            OP, phase, key, device, rows, INPUTS[phase], tuple(Buffer(o, torch.bfloat16, (M, width)) for o in OUTS),
            Kernel.of("adaln_row_gather_fwd", width=width),
            (view("table"), view("adaln_indices"), *(view(o) for o in OUTS)),
            tuple(Output(view(o)) for o in OUTS), (OP, "adaln_indices", key.check_indices))
    lo, hi = P.any_rows(rows)
    table_rows = key.table_rows
    buffers = [Buffer("d_table", torch.bfloat16, (table_rows, BLOCK_CHUNKS * width))]
    if rows == 0 or table_rows == 0:
        steps = (Fill(view("d_table"), 0.0),)
    else:
        cap, windows, groups = reduction_layout(table_rows, device)
        buffers.append(Buffer("partials", torch.float32, (groups, table_rows, BLOCK_CHUNKS * width)))
        steps = (Launch(reduction("adaln_row_gather_bwd", width, cap, windows),
                        (*(view(g) for g in GRADS), view("adaln_indices"), view("partials"))),
                 fold_step(view("partials", layout=Layout.MATRIX), view("d_table", layout=Layout.FLAT)))
    return P.Plan(OP, phase, key, lo, hi, INPUTS[phase], tuple(buffers), steps, (Output(view("d_table")),))


def forward(table, adaln_indices, check_indices=True):
    """Six (S, H) BF16 tensors out_c = table[idx, c*H:(c+1)*H]; a bad index writes NaN rows and, with
    `check_indices`, is recorded in the op's check slot (h3cute.launch.checks)."""
    width = table.shape[-1] // BLOCK_CHUNKS
    table = table_view(OP, "table", table, BLOCK_CHUNKS * width)
    idx = index_vector(OP, adaln_indices, adaln_indices.shape[0])
    key = ForwardKey(width, bool(check_indices))
    return list(P.run(build, Phase.FORWARD, key, (table, idx), idx.shape[0], idx.shape, table.device))


def backward(grads, adaln_indices, table_rows):
    """(table_rows, 6H) BF16: the six grads summed into their table rows (deterministic, FP32 sums)."""
    op = "adaln_row_gather_backward"
    if len(grads) != BLOCK_CHUNKS:
        raise ValueError(f"h3::{op}: expected {BLOCK_CHUNKS} grads, got {len(grads)}")
    width = grads[0].shape[-1]
    for c, g in enumerate(grads):
        check_rows(op, f"grads[{c}]", g, width)
    num_rows = grads[0].shape[0]
    idx = index_vector(op, adaln_indices, num_rows)
    key = BackwardKey(width, table_rows)
    return P.run(build, Phase.BACKWARD, key, (*grads, idx), num_rows, idx.shape, grads[0].device)[0]


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impls (h3cute.native): the encoded plan of (phase, key (width, check_indices or table rows))
    serving `rows`."""
    return P.native_plan(build, KEYS, device, phase, key, rows)
