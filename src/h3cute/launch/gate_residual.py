"""Host side of `h3::gate_residual` on CUDA: `gate_residual_fwd`, and `gate_residual_bwd` + `rowwise_fold`.

forward: one launch, out = residual + gate[idx] * y with torch's two BF16 roundings (bitwise the replay).
backward: one pass over the rows writes dy = bf16(grad * gate[idx]) and FP32 partials of
dgate[r] = sum grad * y per fixed row group (h3cute.launch.norm_modulate.reduction_layout: ROW_GROUPS; windows
beyond 48 table rows); the fold sums the groups in order. d residual is grad itself (the op layer returns it).
No host sync.
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.launch import checks

from .norm_modulate import (check_rows, fold, index_vector, reduction_kernel, reduction_layout, row_op_kernel_handles,
                            table_view)


def kernel_handles(device: int, variant: int, num_rows: int):
    """For the C++ impls (h3cute.native): `gate_residual_fwd`; `gate_residual_bwd` + `rowwise_fold`."""
    return row_op_kernel_handles(device, variant, "gate_residual_backward", "gate_residual_fwd", "gate_residual_bwd")


def check_residual_rows(op: str, residual, y, width: int) -> None:
    """residual and y: contiguous (S, width) BF16 rows of one shape (the gated residual's operands)."""
    check_rows(op, "residual", residual, width)
    check_rows(op, "y", y, width)
    if residual.shape != y.shape:
        raise ValueError(f"h3::{op}: residual {tuple(residual.shape)} and y {tuple(y.shape)} differ")


def forward(residual, y, gate, adaln_indices, check_indices=True):
    """(S, H) BF16 `residual + gate[idx] * y`; a bad index writes a NaN row and, with `check_indices`, is recorded
    in the op's check slot (h3cute.launch.checks)."""
    op = "gate_residual"
    width = y.shape[-1]
    check_residual_rows(op, residual, y, width)
    gate = table_view(op, "gate", gate, width)
    idx = index_vector(op, adaln_indices, y.shape[0])
    out = torch.empty_like(y)
    if y.shape[0]:
        runtime.kernel("gate_residual_fwd", y.device, width=width)(
            residual, y, gate, idx, out, *checks.slot_addresses(y.device, op, "adaln_indices", check_indices))
    return out


def backward(grad, y, gate, adaln_indices):
    """(dy, dgate): dy (S, H) BF16 per row; dgate (R, H) BF16 reduced over rows deterministically."""
    op = "gate_residual_backward"
    width = y.shape[-1]
    check_rows(op, "grad", grad, width)
    check_rows(op, "y", y, width)
    gate = table_view(op, "gate", gate, width)
    idx = index_vector(op, adaln_indices, y.shape[0])
    table_rows = gate.shape[0]
    device = y.device
    dy = torch.empty_like(y)
    dgate = torch.empty((table_rows, width), dtype=torch.bfloat16, device=device)
    if y.shape[0] == 0:
        return dy, dgate.zero_()
    cap, windows, groups = reduction_layout(table_rows, device)
    partials = torch.empty((groups, table_rows, width), dtype=torch.float32, device=device)
    reduction_kernel("gate_residual_bwd", device, width, cap, windows)(grad, y, gate, idx, dy, partials)
    return dy, fold(partials, dgate)
