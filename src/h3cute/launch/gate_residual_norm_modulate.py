"""Host side of `h3::gate_residual_norm_modulate` on CUDA: a block's attention-half gated residual and the MLP
half's norm of the same rows in one pass.

forward: one launch of `gate_residual_norm_modulate_fwd` (kernels/norm_modulate.py): h = residual + gate[idx] * y
(gate_residual's bits) and out = rms_norm(h, w) * (1 + scale[idx]) + shift[idx] (norm_modulate's bits of h), the
row read once and written once: 4 passes over (S, H) against the two ops' 5.
backward: the two ops' backward kernels, with autograd's sum of h's two gradients in between: norm_modulate's
(dx of h, dweight, dshift, dscale), dh = bf16(grad_h + dx) (what autograd's accumulation computes in the two-op
chain), gate_residual's (dy, dgate); d residual = dh. So every gradient is bitwise the two ops'.

The forward's launch is a launch plan (h3cute.launch.plan): `build` writes it, `forward` checks and prepares the
inputs and walks it, and the C++ layer walks the same plan (`native_plan`). Row ranges: S = 0 (no launch) and
S >= 1. The backward has no launch sequence of its own: it runs the two ops' plans.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h3cute.launch import gate_residual, norm_modulate
from h3cute.launch import plan as P
from h3cute.launch.plan import M, Buffer, Kernel, Output, Phase, Scalar, view
from h3cute.widths import NORM_EPS

OP = "gate_residual_norm_modulate"
# The forward's row layout (kernels/norm_modulate.py ROW_VECS: 8 BF16 per access and 64 threads per row, or 4 and
# 128): the same bits; perf/row_kernels.py times both (ops gate_residual_norm_modulate@8, @4).
FORWARD_VEC = 4
INPUTS = ("residual", "y", "gate", "weight", "shift", "scale", "adaln_indices", "eps")


@dataclass(frozen=True)
class ForwardKey:
    width: int
    check_indices: bool  # False: a bad index writes the discard check slot
    vec: int = FORWARD_VEC  # the kernel's row layout (perf/row_kernels.py times the others)


KEYS = {Phase.FORWARD: ForwardKey}


def build(phase: Phase, device, key, rows: int) -> P.Plan:
    """The launch plan of h3::gate_residual_norm_modulate's forward for `rows` rows (the inputs of INPUTS)."""
    if phase is not Phase.FORWARD:
        raise ValueError(f"h3::{OP}: the backward runs norm_modulate's and gate_residual's plans")
    buffers = (Buffer("h", torch.bfloat16, (M, key.width)), Buffer("out", torch.bfloat16, (M, key.width)))
    return P.checked_launch(OP, phase, key, device, rows, INPUTS, buffers,
                            Kernel.of(f"{OP}_fwd", width=key.width, vec=key.vec),
                            (*(view(name) for name in INPUTS[:-1]), view("h"), view("out"), Scalar("eps")),
                            (Output(view("h")), Output(view("out"))), (OP, "adaln_indices", key.check_indices))


def forward(residual, y, gate, weight, shift, scale, adaln_indices, eps=NORM_EPS, check_indices=True, vec=FORWARD_VEC):
    """(h, out), both (S, H) BF16; a bad index writes NaN rows and, with `check_indices`, is recorded in the op's
    check slot (h3cute.launch.checks). `vec`: the kernel's row layout (FORWARD_VEC)."""
    width = y.shape[-1]
    gate_residual.check_residual_rows(OP, residual, y, width)
    norm_modulate._check_vector(OP, "weight", weight, width)
    gate, shift, scale = (norm_modulate.table_view(OP, name, t, width)
                          for name, t in (("gate", gate), ("shift", shift), ("scale", scale)))
    idx = norm_modulate.index_vector(OP, adaln_indices, y.shape[0])
    key = ForwardKey(width, bool(check_indices), vec)
    inputs = (residual, y, gate, weight, shift, scale, idx, float(eps))
    return P.run(build, Phase.FORWARD, key, inputs, y.shape[0], y.shape[:-1], y.device)


def backward(grad_h, grad_out, y, gate, h, weight, scale, adaln_indices, eps, table_rows):
    """(d_residual, dy, dgate, dweight, dshift, dscale), all BF16; `grad_h` None when h's gradient is zero."""
    if scale.shape[0] != table_rows:
        raise ValueError(f"h3::{OP}_backward: scale has {scale.shape[0]} rows, table_rows = {table_rows}")
    dx, dweight, dshift, dscale = norm_modulate.backward_rows(grad_out, h, weight, scale, adaln_indices, eps,
                                                              op=f"{OP}_backward")
    dh = dx if grad_h is None else grad_h + dx
    dy, dgate = gate_residual.backward(dh, y, gate, adaln_indices)
    return dh, dy, dgate, dweight, dshift, dscale


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impl (h3cute.native): the encoded forward plan of key (width, check_indices) serving `rows`."""
    return P.native_plan(build, KEYS, device, phase, key, rows)
