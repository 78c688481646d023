"""Host side of `h3::final_adaln_out` on CUDA: the final AdaLN projection, then RMSNorm + modulation.

Forward: `proj = adaln_projection.forward(temb, W, b)` gives the (T, 10752) BF16 table (the same
GEMM and numeric contract as the block projection, N = 10752); its halves are row-strided (T, 5376)
views, shift first, that `norm_modulate.forward_rows` indexes by `timestep_indices` (no copy).
Backward: the norm backward gives dx, d_norm_weight and the per-timestep table gradients
d_shift, d_scale (deterministic fixed-order sums over the S rows, BF16); their concatenation is the
projection's upstream gradient, and `adaln_projection.backward` gives d_temb, dW, db. The projection
is recomputed in the backward (its scale half is needed; T x 10752 is cheap next to the S rows).
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.launch import adaln_projection, norm_modulate

HIDDEN = 5376
PROJECTION = 2 * HIDDEN
# adaln_projection.config_for_rows's T ranges (both families)
T_BOUNDS = (16, 64, runtime.MAX_ROWS)


def _shift_scale(temb, proj_weight, proj_bias):
    proj = adaln_projection.forward(temb, proj_weight, proj_bias)
    return proj[:, :HIDDEN], proj[:, HIDDEN:]


def kernel_handles(device: int, variant: int, num_rows: int) -> tuple[int, int, list[int]]:
    """For the C++ forward impl (h3cute.native): the T range sharing one projection config, and the C
    handles of `adaln_silu_cast`, the projection GEMM of that config and `norm_modulate_fwd`."""
    dev = torch.device("cuda", device)
    lo = 0
    for hi in T_BOUNDS:
        if num_rows <= hi:
            break
        lo = hi + 1
    wgmma = adaln_projection._uses_wgmma(dev, None)
    config = adaln_projection.config_for_rows(num_rows, wgmma)
    assert all(adaln_projection.config_for_rows(n, wgmma) == config for n in (max(lo, 1), hi)), "T_BOUNDS is stale"
    fns = [runtime.kernel("adaln_silu_cast", dev, width=adaln_projection.TEMB_WIDTH),
           runtime.kernel("adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd", dev, out_features=PROJECTION,
                          config=config),
           runtime.kernel("norm_modulate_fwd", dev, width=HIDDEN)]
    return lo, hi, [fn.__chandle__() for fn in fns]


def forward(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps=1e-5, check_indices=True):
    """(S, 5376) BF16 x -> rms_norm(x, nw) * (1 + scale[ti]) + shift[ti], BF16; indices already checked."""
    shift, scale = _shift_scale(temb, proj_weight, proj_bias)
    return norm_modulate.forward_rows(x, norm_weight, shift, scale, timestep_indices, eps, op="final_adaln_out")


def backward(grad, x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps):
    """-> (dx, d_norm_weight, d_temb FP32, d_proj_weight BF16, d_proj_bias BF16)."""
    _, scale = _shift_scale(temb, proj_weight, proj_bias)
    dx, dnorm_weight, dshift, dscale = norm_modulate.backward_rows(
        grad, x, norm_weight, scale, timestep_indices, eps, op="final_adaln_out_backward"
    )
    dproj = torch.cat([dshift, dscale], dim=1)  # (T, 10752) BF16, shift first like the table
    dtemb, dproj_weight, dproj_bias = adaln_projection.backward(dproj, temb, proj_weight)
    return dx, dnorm_weight, dtemb, dproj_weight, dproj_bias
