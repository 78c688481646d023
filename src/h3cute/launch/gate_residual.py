"""Host side of `h3::gate_residual` on CUDA: `gate_residual_fwd`, and `gate_residual_bwd` + `rowwise_fold`.

forward: one launch, out = residual + gate[idx] * y with torch's two BF16 roundings (bitwise the replay).
backward: one pass over the rows writes dy = bf16(grad * gate[idx]) and FP32 partials of
dgate[r] = sum grad * y per fixed row group (h3cute.launch.norm_modulate.reduction_layout: ROW_GROUPS; windows
beyond 48 table rows); the fold sums the groups in order. d residual is grad itself (the op layer returns it).
No host sync.

The launches are launch plans (h3cute.launch.plan): `build` writes them, `forward` / `backward` check and prepare
the inputs and walk them, and the C++ layer walks the same plans (`native_plan`). Row ranges: S = 0 (no launch)
and S >= 1.
"""
from __future__ import annotations


import torch

from h3cute.launch import plan as P
from h3cute.launch.plan import M, Buffer, Fill, Kernel, Launch, Layout, Output, Phase, view

from .norm_modulate import (RowKey, TableKey, check_rows, fold_step, index_vector, reduction, reduction_layout,
                            table_view)

OP = "gate_residual"
INPUTS = {"forward": ("residual", "y", "gate", "adaln_indices"), "backward": ("grad", "y", "gate", "adaln_indices")}


ForwardKey, BackwardKey = RowKey, TableKey
KEYS = {Phase.FORWARD: ForwardKey, Phase.BACKWARD: BackwardKey}


def build(phase: Phase, device, key, rows: int) -> P.Plan:
    """The launch plan of h3::gate_residual's `phase` for `rows` rows (the inputs of INPUTS[phase])."""
    width = key.width
    if phase is Phase.FORWARD:
        return P.checked_launch(
            OP, phase, key, device, rows, INPUTS[phase.value], (Buffer("out", torch.bfloat16, (M, width)),),
            Kernel.of("gate_residual_fwd", width=width), (*(view(name) for name in INPUTS["forward"]), view("out")),
            (Output(view("out")),), (OP, "adaln_indices", key.check_indices))
    lo, hi = P.any_rows(rows)
    buffers = [Buffer("dy", torch.bfloat16, (M, width)), Buffer("dgate", torch.bfloat16, (key.table_rows, width))]
    if rows == 0:
        steps = (Fill(view("dgate"), 0.0),)
    else:
        cap, windows, groups = reduction_layout(key.table_rows, device)
        buffers.append(Buffer("partials", torch.float32, (groups, key.table_rows, width)))
        steps = (Launch(reduction("gate_residual_bwd", width, cap, windows),
                        (view("grad"), view("y"), view("gate"), view("adaln_indices"), view("dy"), view("partials"))),
                 # dgate (contiguous BF16) = the in-order sum over the row groups, rounded once
                 fold_step(view("partials", layout=Layout.MATRIX), view("dgate", layout=Layout.FLAT)))
    return P.Plan(OP, phase, key, lo, hi, INPUTS[phase.value], tuple(buffers), steps,
                  (Output(view("dy")), Output(view("dgate"))))


def check_residual_rows(op: str, residual, y, width: int) -> None:
    """residual and y: contiguous (S, width) BF16 rows of one shape (the gated residual's operands)."""
    check_rows(op, "residual", residual, width)
    check_rows(op, "y", y, width)
    if residual.shape != y.shape:
        raise ValueError(f"h3::{op}: residual {tuple(residual.shape)} and y {tuple(y.shape)} differ")


def forward(residual, y, gate, adaln_indices, check_indices=True):
    """(S, H) BF16 `residual + gate[idx] * y`; a bad index writes a NaN row and, with `check_indices`, is recorded
    in the op's check slot (h3cute.launch.checks)."""
    width = y.shape[-1]
    check_residual_rows(OP, residual, y, width)
    gate = table_view(OP, "gate", gate, width)
    idx = index_vector(OP, adaln_indices, y.shape[0])
    key = ForwardKey(width, bool(check_indices))
    return P.run(build, Phase.FORWARD, key, (residual, y, gate, idx), y.shape[0], y.shape[:-1], y.device)[0]


def backward(grad, y, gate, adaln_indices):
    """(dy, dgate): dy (S, H) BF16 per row; dgate (R, H) BF16 reduced over rows deterministically."""
    op = "gate_residual_backward"
    width = y.shape[-1]
    check_rows(op, "grad", grad, width)
    check_rows(op, "y", y, width)
    gate = table_view(op, "gate", gate, width)
    idx = index_vector(op, adaln_indices, y.shape[0])
    key = BackwardKey(width, gate.shape[0])
    return P.run(build, Phase.BACKWARD, key, (grad, y, gate, idx), y.shape[0], y.shape[:-1], y.device)


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impls (h3cute.native): the encoded plan of (phase, key (width, check_indices or table rows))
    serving `rows`."""
    return P.native_plan(build, KEYS, device, phase, key, rows)
