"""Host side of `h3::gate_residual_norm_modulate` on CUDA: a block's attention-half gated residual and the MLP
half's norm of the same rows in one pass.

forward: one launch of `gate_residual_norm_modulate_fwd` (kernels/norm_modulate.py): h = residual + gate[idx] * y
(gate_residual's bits) and out = rms_norm(h, w) * (1 + scale[idx]) + shift[idx] (norm_modulate's bits of h), the
row read once and written once: 4 passes over (S, H) against the two ops' 5.
backward: the two ops' backward kernels, with autograd's sum of h's two gradients in between: norm_modulate's
(dx of h, dweight, dshift, dscale), dh = bf16(grad_h + dx) (what autograd's accumulation computes in the two-op
chain), gate_residual's (dy, dgate); d residual = dh. So every gradient is bitwise the two ops'.
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.launch import checks, gate_residual, norm_modulate
from h3cute.widths import HIDDEN, NORM_EPS

OP = "gate_residual_norm_modulate"
# The forward's row layout (kernels/norm_modulate.py ROW_VECS: 8 BF16 per access and 64 threads per row, or 4 and
# 128): the same bits; perf/row_kernels.py times both (ops gate_residual_norm_modulate@8, @4).
FORWARD_VEC = 4


def kernel_handles(device: int, variant: int, num_rows: int):
    """For the C++ impl (h3cute.native), every row count: the forward's kernel and its check constants."""
    dev = torch.device("cuda", device)
    fwd = runtime.kernel(f"{OP}_fwd", dev, width=HIDDEN, vec=FORWARD_VEC)
    return 0, runtime.MAX_ROWS, [fwd.__chandle__()], norm_modulate.check_constants(dev, OP)


def forward(residual, y, gate, weight, shift, scale, adaln_indices, eps=NORM_EPS, check_indices=True, vec=FORWARD_VEC):
    """(h, out), both (S, H) BF16; a bad index writes NaN rows and, with `check_indices`, is recorded in the op's
    check slot (h3cute.launch.checks). `vec`: the kernel's row layout (FORWARD_VEC)."""
    width = y.shape[-1]
    gate_residual.check_residual_rows(OP, residual, y, width)
    norm_modulate._check_vector(OP, "weight", weight, width)
    gate, shift, scale = (norm_modulate.table_view(OP, name, t, width)
                          for name, t in (("gate", gate), ("shift", shift), ("scale", scale)))
    idx = norm_modulate.index_vector(OP, adaln_indices, y.shape[0])
    h, out = torch.empty_like(y), torch.empty_like(y)
    if y.shape[0]:
        runtime.kernel(f"{OP}_fwd", y.device, width=width, vec=vec)(
            residual, y, gate, weight, shift, scale, idx, h, out, float(eps),
            *checks.slot_addresses(y.device, OP, "adaln_indices", check_indices))
    return h, out


def backward(grad_h, grad_out, y, gate, h, weight, scale, adaln_indices, eps, table_rows):
    """(d_residual, dy, dgate, dweight, dshift, dscale), all BF16; `grad_h` None when h's gradient is zero."""
    if scale.shape[0] != table_rows:
        raise ValueError(f"h3::{OP}_backward: scale has {scale.shape[0]} rows, table_rows = {table_rows}")
    dx, dweight, dshift, dscale = norm_modulate.backward_rows(grad_out, h, weight, scale, adaln_indices, eps,
                                                              op=f"{OP}_backward")
    dh = dx if grad_h is None else grad_h + dx
    dy, dgate = gate_residual.backward(dh, y, gate, adaln_indices)
    return dh, dy, dgate, dweight, dshift, dscale
