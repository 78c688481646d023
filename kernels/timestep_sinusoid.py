"""timestep_sinusoid: the (T, 256) FP32 sinusoidal timestep embedding, bitwise equal to diffusers on CUDA.

diffusers `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` runs, in FP32 CUDA kernels:
    e_k = (fp32(-ln 10000) * k) * (1/128)        k = 0..127 (torch divides by a CPU scalar as a multiply
                                                 by its reciprocal; 1/128 is exact either way)
    f_k = expf(e_k)                              libdevice __nv_expf, no fast math
    a   = t * f_k                                one FP32 rounding
    out = [cosf(a) | sinf(a)]                    libdevice __nv_cosf / __nv_sinf, no fast math

This kernel replays that sequence op for op inside one launch: the same FP32 constant, the same IEEE
roundings (`mul.rn`, which ptxas may not contract into an FMA), and `cute.math.exp/sin/cos` with
fastmath off, which lower to the libdevice precise paths, the same bitcode nvcc inlines for torch's
`::exp`/`::sin`/`::cos` (3-term Cody-Waite reduction below |a| = 105615, Payne-Hanek above, no
`sin.approx`/`cos.approx`; expf's only approximation is ex2.approx on a reduced argument), with
__CUDA_FTZ off so subnormal t behave as in torch. The frequency table is recomputed per thread (4 expf): no host
table, no extra argument, nothing that could drift from what torch's exp computes on the same GPU.

Layout: one warp per row; lane j owns k = 4j..4j+3, so the cos half and the sin half of a row are each
written by one warp as 32 coalesced 16-byte stores. A CTA holds ROWS_PER_CTA warps; the grid is
ceil(T / ROWS_PER_CTA). T is symbolic (one compiled kernel for every T >= 1; the launcher skips T = 0).
Every row depends on its own t only, so the output is batch-invariant by construction.

Range check (the `check_range` variant, the op's default on CUDA): every lane tests 0 <= t <= 1 (false for
NaN); a bad row is written as NaN and lane 0 records it in the call's check slot (kernels/rowwise.py
`record_bad_row`, h3cute/launch/checks.py), which the host raises as a ValueError at its next h3 call. The
check costs no host sync and no extra launch, and the CUDA context stays usable.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute
import numpy as np
from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_tensor

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream
from h3cute.widths import FREQ, FREQ_HALF, MAX_PERIOD

from .rowwise import record_bad_row

HALF = FREQ_HALF
LANES = 32
VEC = HALF // LANES  # 4 FP32 = one 16-byte store per half per lane
# Python's float(-ln 10000) rounded to FP32, as torch's CUDA mul casts the CPU scalar to the op math type.
NEG_LN_MAX_PERIOD_F32 = float(np.float32(-math.log(MAX_PERIOD)))  # -9.21034049987793 (0xC1135D8E)
INV_HALF = 1.0 / HALF  # 2^-7, exact
ROWS_PER_CTA = 8  # warps per CTA, one row each; fixed (never a function of T)


@cute.jit
def _mul_rn(a: cutlass.Float32, b: cutlass.Float32) -> cutlass.Float32:
    """One IEEE round-to-nearest FP32 product, as torch's separate mul kernels round before storing.

    `mul.rn` in PTX is never contracted into an FMA by LLVM or ptxas; a plain `mul.f32` may be.
    """
    return cute.arch.inline_ptx(
        "mul.rn.f32 {$w0}, {$r0}, {$r1};",
        write_only_types=[cutlass.Float32],
        read_only_args=[cutlass.Float32(a), cutlass.Float32(b)],
    )


@cute.kernel
def _sinusoid_kernel(mT: cute.Tensor, mOut: cute.Tensor, err_rows: cutlass.Int64, err_host: cutlass.Int64,
                     check_range: cutlass.Constexpr[bool]):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    lane = tidx % LANES
    # 64-bit row: row * 256 overflows int32 from T = 2^23 on.
    row = cutlass.Int64(bidx * ROWS_PER_CTA + tidx // LANES)
    if row < mT.shape[0]:
        t = mT[row]
        rCos = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        rSin = cute.make_rmem_tensor((VEC,), cutlass.Float32)
        for i in cutlass.range_constexpr(VEC):
            k = cutlass.Float32(lane * VEC + i)
            exponent = _mul_rn(_mul_rn(k, NEG_LN_MAX_PERIOD_F32), INV_HALF)
            freq = cute.math.exp(exponent, fastmath=False)
            angle = _mul_rn(t, freq)
            rCos[i] = cute.math.cos(angle, fastmath=False)
            rSin[i] = cute.math.sin(angle, fastmath=False)
        if cutlass.const_expr(check_range):
            # NaN fails both comparisons, so it is caught too.
            if not ((t >= cutlass.Float32(0.0)) & (t <= cutlass.Float32(1.0))):
                if lane == 0:
                    record_bad_row(err_rows, err_host, row, 1)
                rCos.fill(float("nan"))
                rSin.fill(float("nan"))
        # (VEC, 2 * LANES) view of the row: column block j is out[row, VEC*j : VEC*(j+1)].
        gRow = cute.zipped_divide(mOut[row, None], (VEC,))
        cute.autovec_copy(rCos, gRow[(None, lane)])
        cute.autovec_copy(rSin, gRow[(None, LANES + lane)])


@cute.jit
def _sinusoid_launch(mT: cute.Tensor, mOut: cute.Tensor, err_rows: cutlass.Int64, err_host: cutlass.Int64, stream,
                     check_range: cutlass.Constexpr[bool]):
    grid = (mT.shape[0] + ROWS_PER_CTA - 1) // ROWS_PER_CTA  # T >= 1: the launcher skips T = 0
    _sinusoid_kernel(mT, mOut, err_rows, err_host, check_range).launch(
        grid=(grid, 1, 1), block=(ROWS_PER_CTA * LANES, 1, 1), stream=stream)


def build(arch: str, *, width: int, check_range: bool):
    if width != FREQ:
        raise ValueError(f"timestep_sinusoid is built for width {FREQ}, got {width}")
    num_rows = cute.sym_int()
    # t may be any 1-D FP32 view (stride symbolic); the output is a fresh compact (T, 256) tensor.
    mT = make_fake_tensor(cutlass.Float32, (num_rows,), (cute.sym_int(),), assumed_align=4)
    mOut = make_fake_compact_tensor(cutlass.Float32, (num_rows, width), stride_order=(1, 0), assumed_align=16)
    return compile_for(arch, _sinusoid_launch, mT, mOut, cutlass.Int64(0), cutlass.Int64(0), env_stream(), check_range)


SPECS = [
    KernelSpec(
        name="timestep_sinusoid",
        build=build,
        variants=lambda arch: [dict(width=FREQ, check_range=c) for c in (True, False)],
        # mul.rn: the explicitly rounded products (k*c, *2^-7, t*f); 0f32A57060: the low word of log2(e) in __nv_expf's
        # reduction; 0f47CE4780 (105615): __nv_sinf/__nv_cosf's switch from the 3-term Cody-Waite
        # reduction to Payne-Hanek; st.global.v: the 16-byte stores (v4.b32, or v2.b64 where sm_100a merges the
        # checked variant's NaN rows into them).
        ptx_markers=("mul.rn.f32", "0f32A57060", "0f47CE4780", "st.global.v"),
        # The precise path's only approximate instruction is ex2.approx.ftz inside __nv_expf (on a reduced
        # argument); no hardware sin/cos, and no flush-to-zero arithmetic anywhere else.
        ptx_forbidden=("sin.approx", "cos.approx", "rn.ftz.f32", "mul.ftz.f32", "add.ftz.f32"),
    )
]
