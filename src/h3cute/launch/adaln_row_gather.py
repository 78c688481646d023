"""Host side of `h3::adaln_row_gather` on CUDA: `adaln_row_gather_fwd`, and `adaln_row_gather_bwd` (all six
chunks in one launch) + one `rowwise_fold`.

forward: one launch (grid S x 6) copies the six (S, 5376) chunks table[idx, c*H:(c+1)*H] into six fresh
tensors: bitwise `index_select`. backward: d_table[r] = sum over rows with idx = r of the six grads,
FP32 partials per fixed row group (h3cute.launch.norm_modulate.reduction_layout) written into columns
[c*H, (c+1)*H) of one (P, R, 6H) buffer by one launch, then folded in group order, rounded once.
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.launch import checks
from h3cute.widths import BLOCK_CHUNKS

from .norm_modulate import (check_rows, fold, index_vector, reduction_kernel, reduction_layout, row_op_kernel_handles,
                            table_view)


def kernel_handles(device: int, variant: int, num_rows: int):
    """For the C++ impls (h3cute.native): `adaln_row_gather_fwd`; `adaln_row_gather_bwd` + `rowwise_fold`."""
    return row_op_kernel_handles(device, variant, "adaln_row_gather_backward", "adaln_row_gather_fwd",
                                 "adaln_row_gather_bwd")


def forward(table, adaln_indices, check_indices=True):
    """Six (S, H) BF16 tensors out_c = table[idx, c*H:(c+1)*H]; a bad index writes NaN rows and, with
    `check_indices`, is recorded in the op's check slot (h3cute.launch.checks)."""
    op = "adaln_row_gather"
    width = table.shape[-1] // BLOCK_CHUNKS
    table = table_view(op, "table", table, BLOCK_CHUNKS * width)
    idx = index_vector(op, adaln_indices, adaln_indices.shape[0])
    outs = [torch.empty((idx.shape[0], width), dtype=table.dtype, device=table.device) for _ in range(BLOCK_CHUNKS)]
    if idx.shape[0]:
        runtime.kernel("adaln_row_gather_fwd", table.device, width=width)(
            table, idx, *outs, *checks.slot_addresses(table.device, op, "adaln_indices", check_indices))
    return outs


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
    device = grads[0].device
    d_table = torch.empty((table_rows, BLOCK_CHUNKS * width), dtype=torch.bfloat16, device=device)
    if num_rows == 0 or table_rows == 0:
        return d_table.zero_()
    cap, windows, groups = reduction_layout(table_rows, device)
    partials = torch.empty((groups, table_rows, BLOCK_CHUNKS * width), dtype=torch.float32, device=device)
    reduction_kernel("adaln_row_gather_bwd", device, width, cap, windows)(*grads, idx, partials)
    return fold(partials, d_table)
