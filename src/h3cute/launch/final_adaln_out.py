"""Host side of `h3::final_adaln_out` on CUDA: the final AdaLN projection, then RMSNorm + modulation.

Forward: `proj = adaln_projection.forward(temb, W, b)` gives the (T, 10752) BF16 table (the same
GEMM and numeric contract as the block projection, N = 10752); its halves are row-strided (T, 5376)
views, shift first, that `norm_modulate.forward_rows` indexes by `timestep_indices` (no copy).
Backward: the norm backward gives dx, d_norm_weight and the per-timestep table gradient [d_shift | d_scale]
(deterministic fixed-order sums over the S rows, BF16, folded straight into the (T, 10752) layout of the
table), the projection's upstream gradient; `adaln_projection.backward` gives d_temb, dW, db. The autograd
path keeps the forward's projection (`forward_with_table`, op `h3::final_adaln_out_fwd`) for the backward's
scale half; the backward op computes it again when not given it.

The launches are the two ops' launch plans (h3cute.launch.plan), walked by the launchers above and by the C++ impls,
which compose them as the launchers do: the projection's plan over M = T, then the norm rows' over M = S with the
table's halves (or its scale half and the table gradient) passed as row-strided views (`part_plan`, `native_plan`).
"""
from __future__ import annotations

from h3cute.launch import adaln_projection, norm_modulate
from h3cute.launch import plan as P
from h3cute.launch.plan import Phase
from h3cute.widths import FINAL_PROJECTION, HIDDEN, NORM_EPS

OP = "final_adaln_out"

# The parts of the op's launch plans, the first field of the C++ layer's keys: the op walks two other ops' plans, each
# over its own row count.
PROJECTION = 0  # adaln_projection's plans, N = 10752, M = T: key (PROJECTION,)
ROWS = 1  # norm_modulate's plans, M = S: key (ROWS, check_indices) forward, (ROWS, T) backward


def part_plan(phase: Phase, key: tuple) -> tuple:
    """(builder, typed key) of the plans of part `key[0]` of the op's `phase`, `key` as the C++ layer passes it (ints):
    the projection's (the launcher's adaln_projection.forward / backward of the (10752, 2688) weight), or the norm
    rows' (the launcher's norm_modulate.forward_rows with the op's check slot, final_adaln_out / timestep_indices;
    backward_rows of a T-row table with the table gradient in the projection's layout)."""
    part, *fields = key
    if part == PROJECTION and not fields:
        return adaln_projection.build, adaln_projection.KEYS[phase](FINAL_PROJECTION)
    if part == ROWS and len(fields) == 1:
        if phase is Phase.FORWARD:
            return norm_modulate.build, norm_modulate.ForwardKey(HIDDEN, bool(fields[0]), OP, "timestep_indices")
        return norm_modulate.build, norm_modulate.BackwardKey(HIDDEN, fields[0], table_grad=True)
    raise ValueError(f"final_adaln_out: no plan part of key {key}")


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impls (h3cute.native): the encoded plan of (phase, key) serving `rows` (`part_plan`'s keys; rows
    is T for the projection, S for the norm rows)."""
    phase = Phase(phase)
    build, typed = part_plan(phase, tuple(key))
    return P.native_encoded(build, phase, device, typed, rows)


def forward_with_table(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps=NORM_EPS,
                       check_indices=True):
    """(out, table): the forward's output and its (T, 10752) BF16 projection (shift | scale), which the
    backward takes instead of computing it again. A bad timestep index writes a NaN row and, with
    `check_indices`, is recorded in the op's check slot (h3cute.launch.checks)."""
    table = adaln_projection.forward(temb, proj_weight, proj_bias)
    out = norm_modulate.forward_rows(x, norm_weight, table[:, :HIDDEN], table[:, HIDDEN:], timestep_indices, eps,
                                     op=OP, argument="timestep_indices", check=check_indices)
    return out, table


def forward(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps=NORM_EPS, check_indices=True):
    """(S, 5376) BF16 x -> rms_norm(x, nw) * (1 + scale[ti]) + shift[ti], BF16 (forward_with_table)."""
    return forward_with_table(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps, check_indices)[0]


def backward(grad, x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps, table=None):
    """-> (dx, d_norm_weight, d_temb FP32, d_proj_weight BF16, d_proj_bias BF16). `table`: the forward's
    projection (forward_with_table); without it the projection is computed again."""
    if table is None:
        table = adaln_projection.forward(temb, proj_weight, proj_bias)
    dx, dnorm_weight, dproj = norm_modulate.backward_rows(
        grad, x, norm_weight, table[:, HIDDEN:], timestep_indices, eps, op="final_adaln_out_backward", table_grad=True
    )  # dproj (T, 10752) BF16: [dshift | dscale] per timestep, like the table
    dtemb, dproj_weight, dproj_bias = adaln_projection.backward(dproj, temb, proj_weight)
    return dx, dnorm_weight, dtemb, dproj_weight, dproj_bias
