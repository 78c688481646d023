"""norm_modulate: out = rms_norm(x, w, eps) * (1 + scale[idx]) + shift[idx], BF16, forward and backward.

Forward (`norm_modulate_fwd`): one 64-thread CTA per row (kernels/rowwise.py, NORM_THREADS): each thread
issues its 10-11 16-byte loads of the row at once and keeps them in registers (BF16); the shift/scale rows of idx[row] are gathered in the kernel
(tables may be row-strided views, e.g. halves of the final layer's (T, 2H) projection); out is written
once. Numerics replay the diffusers composition `F.rms_norm(x, (H,), w, eps) * (1 + scale[idx]) +
shift[idx]` on CUDA op for op:
    ss   = sum x^2 in torch's fused rms_norm order (rowwise.torch_sumsq), FP32
    rstd = rsqrt.approx(ss / H + eps)             (div.rn; CUDA rsqrtf is rsqrt.approx.f32)
    n    = bf16(w * (rstd * x))                   (torch: gamma * (rstd * x), one rounding)
    a    = bf16(1 + scale);  m = bf16(n * a);  out = bf16(m + shift)
so the output is bitwise the replay's wherever torch takes its vectorized fused path (BF16, H % 4 == 0,
16-byte aligned rows). Each row depends only on itself, w and its table rows: batch-invariant.

Backward, FP32 math as the CPU reference (h3cute.ops.adaln._modulate_backward_fp32), no rounding of
1 + scale or of xhat * w:
  `norm_modulate_bwd_rows`: one CTA per row: recomputes rstd exactly as the forward, dn = g * (1 + sc),
      dxhat = dn * w, c = sum(dxhat * xhat) / H (fixed order, rowwise.block_sum),
      dx = rstd * (dxhat - xhat * c); stores dx (BF16) and rstd (FP32 workspace for the next kernel).
  `norm_modulate_bwd_params`: the deterministic column reduction (rowwise.py) producing FP32 partials of
      dweight = sum dn * xhat, dshift[r] = sum g, dscale[r] = sum g * (xhat * w) per row group;
      `rowwise_fold` finishes them. No atomics.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass.cute.runtime import make_fake_tensor

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream

from .rowwise import (COL_TILE, NORM_THREADS, TABLE_ROWS_CAPS, TORCH_WARPS, UNROLL, VEC, block_sum, fake_indices,
                      fake_partials, fake_rows, fake_table, fake_vector, guarded_row, load_f32, round_bf16, row_range,
                      row_slots, smem_vec, store_bf16, torch_sumsq, vec_view)

HIDDEN = 5376


@cute.jit
def load_row(mT: cute.Tensor, base, tidx, width: cutlass.Constexpr):
    """This thread's BF16 8-vectors u, u + 64, ... of a row (an absent vector of the last slot reads as zeros)."""
    num_vecs = width // VEC
    vals = []
    for k in cutlass.range_constexpr(row_slots(width, NORM_THREADS)):
        col = (tidx + k * NORM_THREADS) * VEC
        if cutlass.const_expr((k + 1) * NORM_THREADS <= num_vecs):
            vals.append(vec_view(mT, base + col).load())
        else:
            frag = cute.make_rmem_tensor((VEC,), BFloat16)
            frag.fill(0.0)
            if tidx < num_vecs - k * NORM_THREADS:
                frag.store(vec_view(mT, base + col).load())
            vals.append(frag.load())
    return vals


@cute.jit
def row_rstd(xs, sRed: cute.Tensor, tidx, eps: Float32, width: cutlass.Constexpr):
    ss = torch_sumsq(xs, sRed, tidx)
    return cute.math.rsqrt(ss / Float32(width) + eps, approx=True)


# ---- forward ---------------------------------------------------------------------------------------------

@cute.kernel
def _forward_kernel(mX: cute.Tensor, mW: cute.Tensor, mShift: cute.Tensor, mScale: cute.Tensor,
                    mIdx: cute.Tensor, mOut: cute.Tensor, eps: Float32, width: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sRed = smem.allocate_tensor(Float32, cute.make_layout(TORCH_WARPS), byte_alignment=16)
    num_vecs = width // VEC
    base = Int64(row) * width
    r, poison = guarded_row(Int64(mIdx[row]), mScale.shape[0])
    xs = load_row(mX, base, tidx, width)
    rstd = row_rstd(xs, sRed, tidx, eps, width)
    shift_base = r * mShift.stride[0]
    scale_base = r * mScale.stride[0]
    for k in cutlass.range_constexpr(len(xs)):
        vi = tidx + k * NORM_THREADS
        if vi < num_vecs:
            col = vi * VEC
            normed = round_bf16(load_f32(mW, col) * (xs[k].to(Float32) * rstd))
            gain = round_bf16(load_f32(mScale, scale_base + col) + 1.0)
            store_bf16(mOut, base + col, (round_bf16(normed * gain) + load_f32(mShift, shift_base + col)) * poison)


@cute.jit
def _forward_launch(mX, mW, mShift, mScale, mIdx, mOut, eps: Float32, stream, width: cutlass.Constexpr):
    _forward_kernel(mX, mW, mShift, mScale, mIdx, mOut, eps, width).launch(
        grid=(mX.shape[0], 1, 1), block=(NORM_THREADS, 1, 1), stream=stream
    )


# ---- backward: dx (row-local) ----------------------------------------------------------------------------

@cute.jit
def _dxhat_xhat(g, x, mW, mScale, scale_base, col, rstd):
    """dxhat = g * (1 + scale) * w and xhat = x * rstd of one 8-vector, FP32."""
    dxhat = g.to(Float32) * (load_f32(mScale, scale_base + col) + 1.0) * load_f32(mW, col)
    return dxhat, x.to(Float32) * rstd


@cute.kernel
def _bwd_rows_kernel(mG: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mScale: cute.Tensor, mIdx: cute.Tensor,
                     mDx: cute.Tensor, mRstd: cute.Tensor, eps: Float32, width: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sRed = smem.allocate_tensor(Float32, cute.make_layout(TORCH_WARPS), byte_alignment=16)
    sDot = smem.allocate_tensor(Float32, cute.make_layout(NORM_THREADS // 32), byte_alignment=16)
    num_vecs = width // VEC
    base = Int64(row) * width
    r, poison = guarded_row(Int64(mIdx[row]), mScale.shape[0])
    scale_base = r * mScale.stride[0]
    xs = load_row(mX, base, tidx, width)
    gs = load_row(mG, base, tidx, width)
    rstd = row_rstd(xs, sRed, tidx, eps, width)
    # sum(dxhat * xhat) over this thread's vectors in slot order, then over the CTA in a fixed order;
    # dxhat and xhat are recomputed for the output (w and scale rows are L1 hits) to keep registers low.
    dot = Float32(0.0)
    for k in cutlass.range_constexpr(len(xs)):
        vi = tidx + k * NORM_THREADS
        if cutlass.const_expr((k + 1) * NORM_THREADS <= num_vecs):
            dxhat, xhat = _dxhat_xhat(gs[k], xs[k], mW, mScale, scale_base, vi * VEC, rstd)
            for i in cutlass.range_constexpr(VEC):
                dot = cute.math.fma(dxhat[i], xhat[i], dot)
        else:
            if vi < num_vecs:
                dxhat, xhat = _dxhat_xhat(gs[k], xs[k], mW, mScale, scale_base, vi * VEC, rstd)
                for i in cutlass.range_constexpr(VEC):
                    dot = cute.math.fma(dxhat[i], xhat[i], dot)
    mean_dot = block_sum(dot, sDot, tidx, NORM_THREADS // 32) / Float32(width)
    for k in cutlass.range_constexpr(len(xs)):
        vi = tidx + k * NORM_THREADS
        if vi < num_vecs:
            dxhat, xhat = _dxhat_xhat(gs[k], xs[k], mW, mScale, scale_base, vi * VEC, rstd)
            store_bf16(mDx, base + vi * VEC, (dxhat - xhat * mean_dot) * rstd * poison)
    if tidx == 0:
        mRstd[row] = rstd


@cute.jit
def _bwd_rows_launch(mG, mX, mW, mScale, mIdx, mDx, mRstd, eps: Float32, stream, width: cutlass.Constexpr):
    _bwd_rows_kernel(mG, mX, mW, mScale, mIdx, mDx, mRstd, eps, width).launch(
        grid=(mX.shape[0], 1, 1), block=(NORM_THREADS, 1, 1), stream=stream
    )


# ---- backward: dweight, dshift, dscale partials (column reduction) ----------------------------------------

@cute.jit
def _params_step(mG, mX, mScale, mIdx, mRstd, w, accW, sShift, sScale, first, col, lane,
                 rows: cutlass.Constexpr, width: cutlass.Constexpr):
    """Rows [first, first + rows): every load is issued before the first accumulation (memory-level
    parallelism); the accumulations then run in row order."""
    table_rows = mScale.shape[0]
    picks = [guarded_row(Int64(mIdx[first + i]), table_rows) for i in range(rows)]
    offs = [Int64(first + i) * width + col for i in range(rows)]
    gs = [load_f32(mG, offs[i]) for i in range(rows)]
    xs = [load_f32(mX, offs[i]) for i in range(rows)]
    scales = [load_f32(mScale, picks[i][0] * mScale.stride[0] + col) for i in range(rows)]
    rstds = [mRstd[first + i] for i in range(rows)]
    for i in cutlass.range_constexpr(rows):
        if picks[i][1] == 1.0:  # rows with an out-of-range index add nothing
            xhat = xs[i] * rstds[i]
            accW.store(accW.load() + gs[i] * (scales[i] + 1.0) * xhat)
            acc_off = Int32(picks[i][0]) * COL_TILE + lane * VEC
            aShift = smem_vec(sShift, acc_off)
            aShift.store(aShift.load() + gs[i])
            aScale = smem_vec(sScale, acc_off)
            aScale.store(aScale.load() + gs[i] * (xhat * w))


@cute.kernel
def _bwd_params_kernel(mG: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mScale: cute.Tensor,
                       mIdx: cute.Tensor, mRstd: cute.Tensor, mPartW: cute.Tensor, mPartShift: cute.Tensor,
                       mPartScale: cute.Tensor, width: cutlass.Constexpr, cap: cutlass.Constexpr):
    lane, _, _ = cute.arch.thread_idx()
    tile, group, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sShift = smem.allocate_tensor(Float32, cute.make_layout(cap * COL_TILE), byte_alignment=32)
    sScale = smem.allocate_tensor(Float32, cute.make_layout(cap * COL_TILE), byte_alignment=32)
    col = tile * COL_TILE + lane * VEC
    zero = cute.full((VEC,), 0.0, Float32)
    for r in cutlass.range(cap):
        smem_vec(sShift, r * COL_TILE + lane * VEC).store(zero)
        smem_vec(sScale, r * COL_TILE + lane * VEC).store(zero)
    w = load_f32(mW, col)
    accW = cute.make_rmem_tensor((VEC,), Float32)
    accW.fill(0.0)
    begin, end = row_range(mX.shape[0], group, mPartW.shape[0])
    batched_end = begin + (end - begin) // UNROLL * UNROLL
    for first in cutlass.range(begin, batched_end, UNROLL):
        _params_step(mG, mX, mScale, mIdx, mRstd, w, accW, sShift, sScale, first, col, lane, UNROLL, width)
    for first in cutlass.range(batched_end, end):
        _params_step(mG, mX, mScale, mIdx, mRstd, w, accW, sShift, sScale, first, col, lane, 1, width)
    vec_view(mPartW, Int64(group) * mPartW.stride[0] + col).store(accW.load())
    for r in cutlass.range(mScale.shape[0]):
        src = r * COL_TILE + lane * VEC
        vec_view(mPartShift, Int64(group) * mPartShift.stride[0] + Int64(r) * mPartShift.stride[1] + col).store(
            smem_vec(sShift, src).load())
        vec_view(mPartScale, Int64(group) * mPartScale.stride[0] + Int64(r) * mPartScale.stride[1] + col).store(
            smem_vec(sScale, src).load())


@cute.jit
def _bwd_params_launch(mG, mX, mW, mScale, mIdx, mRstd, mPartW, mPartShift, mPartScale, stream,
                       width: cutlass.Constexpr, cap: cutlass.Constexpr):
    _bwd_params_kernel(mG, mX, mW, mScale, mIdx, mRstd, mPartW, mPartShift, mPartScale, width, cap).launch(
        grid=(width // COL_TILE, mPartW.shape[0], 1), block=(32, 1, 1), stream=stream
    )


# ---- fake tensors and specs ------------------------------------------------------------------------------

def _check_width(width):
    if width % COL_TILE:
        raise ValueError(f"norm_modulate kernels need a width divisible by {COL_TILE}, got {width}")


def build_forward(arch: str, *, width: int):
    _check_width(width)
    s = cute.sym_int()
    return compile_for(arch, _forward_launch, fake_rows(s, width), fake_vector(width), fake_table(width),
                       fake_table(width), fake_indices(s), fake_rows(s, width), Float32(1e-5), env_stream(), width)


def build_backward_rows(arch: str, *, width: int):
    _check_width(width)
    s = cute.sym_int()
    return compile_for(arch, _bwd_rows_launch, fake_rows(s, width), fake_rows(s, width), fake_vector(width),
                       fake_table(width), fake_indices(s), fake_rows(s, width), fake_vector(s, Float32),
                       Float32(1e-5), env_stream(), width)


def build_backward_params(arch: str, *, width: int, cap: int):
    _check_width(width)
    s, groups, table_rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    part_w = make_fake_tensor(Float32, (groups, width), (cute.sym_int(divisibility=4), 1), assumed_align=16)
    return compile_for(arch, _bwd_params_launch, fake_rows(s, width), fake_rows(s, width), fake_vector(width),
                       fake_table(width, table_rows), fake_indices(s), fake_vector(s, Float32), part_w,
                       fake_partials(groups, table_rows, width), fake_partials(groups, table_rows, width),
                       env_stream(), width, cap)


SPECS = [
    KernelSpec(
        name="norm_modulate_fwd",
        build=build_forward,
        variants=lambda arch: [dict(width=HIDDEN)],
        # v4 loads/stores: 16-byte vectors; rsqrt.approx + div.rn: torch's rstd; cvt.rn.bf16x2: the roundings.
        ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "rsqrt.approx.f32", "div.rn.f32", "cvt.rn.bf16x2.f32",
                     "shfl.sync.bfly"),
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
    KernelSpec(
        name="norm_modulate_bwd_rows",
        build=build_backward_rows,
        variants=lambda arch: [dict(width=HIDDEN)],
        ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "rsqrt.approx.f32", "shfl.sync.bfly"),
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
    KernelSpec(
        name="norm_modulate_bwd_params",
        build=build_backward_params,
        variants=lambda arch: [dict(width=HIDDEN, cap=cap) for cap in TABLE_ROWS_CAPS],
        ptx_markers=("ld.global.v4.b32", "ld.shared.v", "st.shared.v"),  # v4.b32 (sm_90a) or v2.b64 (sm_100a)
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
]
