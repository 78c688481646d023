"""Host side of `h3::final_adaln_out` on CUDA: the final AdaLN projection, then RMSNorm + modulation.

Forward: `proj = adaln_projection.forward(temb, W, b)` gives the (T, 10752) BF16 table (the same
GEMM and numeric contract as the block projection, N = 10752); its halves are row-strided (T, 5376)
views, shift first, that `norm_modulate.forward_rows` indexes by `timestep_indices` (no copy).
Backward: the norm backward gives dx, d_norm_weight and the per-timestep table gradient [d_shift | d_scale]
(deterministic fixed-order sums over the S rows, BF16, folded straight into the (T, 10752) layout of the
table), the projection's upstream gradient; `adaln_projection.backward` gives d_temb, dW, db. The autograd
path keeps the forward's projection (`forward_with_table`, op `h3::final_adaln_out_fwd`) for the backward's
scale half; the backward op computes it again when not given it.
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.launch import adaln_projection, norm_modulate
from h3cute.widths import FINAL_PROJECTION, HIDDEN, NORM_EPS, TEMB

OP = "final_adaln_out"


def t_bounds(sms: int = adaln_projection.H200_SMS) -> tuple:
    """Where some launch choice of the C++ impls changes with T on a GPU of `sms` SMs: the projection configs
    (adaln_projection.t_bounds) and the fused norm backward's table caps (12, 24)."""
    return tuple(sorted({12, 24, *adaln_projection.t_bounds(sms)}))


T_BOUNDS = t_bounds()  # the H200's


def _choices(dev, rows: int, backward: bool) -> tuple:
    wgmma = adaln_projection._uses_wgmma(dev, None)
    sms = runtime.sm_count(dev)
    fwd = adaln_projection.config_for_rows(rows, wgmma, sms)
    if not backward:
        return wgmma, fwd
    return (wgmma, fwd, adaln_projection.dgrad_config_for_rows(rows, wgmma, sms),
            adaln_projection.wgrad_config_for_rows(rows, wgmma, sms), norm_modulate.table_rows_cap(rows))


def kernel_handles(device: int, backward: int, num_rows: int):
    """For the C++ impls (h3cute.native): the T range sharing every launch choice, and the C handles of the
    forward's kernels (`adaln_silu_cast`, the projection GEMM, `norm_modulate_fwd`; with its check_constants) or,
    for T <= 24, the
    backward's (silu_cast, projection, `norm_modulate_bwd_fused`, `rowwise_fold`, the d_temb GEMM,
    `adaln_dtemb_fold`, the dW GEMM; db fused into it) with the fused norm's row-group count."""
    dev = torch.device("cuda", device)
    lo, hi = runtime.row_range(t_bounds(runtime.sm_count(dev)), num_rows)
    choices = _choices(dev, num_rows, bool(backward))
    assert _choices(dev, max(lo, 1), bool(backward)) == choices == _choices(dev, hi, bool(backward)), "stale T_BOUNDS"
    wgmma, fwd = choices[:2]
    head = [runtime.kernel("adaln_silu_cast", dev, width=TEMB),
            runtime.kernel("adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd", dev, out_features=FINAL_PROJECTION,
                           config=fwd)]
    if not backward:
        fns = head + [runtime.kernel("norm_modulate_fwd", dev, width=HIDDEN)]
        return lo, hi, [fn.__chandle__() for fn in fns], norm_modulate.check_constants(dev, OP, "timestep_indices")
    _, _, dgrad, wgrad, cap = choices
    if cap not in norm_modulate.FUSED_CAPS or num_rows > adaln_projection.FUSED_DBIAS_ROWS:
        raise ValueError(f"final_adaln_out: the C++ backward takes T <= 24, got {num_rows}")
    fns = head + [
        runtime.kernel("norm_modulate_bwd_fused", dev, width=HIDDEN, cap=cap, step=norm_modulate.FUSED_STEP),
        runtime.kernel("rowwise_fold", dev),
        runtime.kernel("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", dev, out_features=FINAL_PROJECTION,
                       config=dgrad),
        runtime.kernel("adaln_dtemb_fold", dev, width=TEMB),
        runtime.kernel("adaln_proj_wgrad_wgmma", dev, out_features=FINAL_PROJECTION, wgmma=True, config=wgrad) if wgmma
        else runtime.kernel("adaln_proj_wgrad", dev, out_features=FINAL_PROJECTION, config=wgrad),
    ]
    groups = norm_modulate.FUSED_ROW_GROUPS[runtime.arch_of(dev)][cap]
    return lo, hi, [fn.__chandle__() for fn in fns], [groups]


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
