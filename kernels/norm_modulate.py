"""norm_modulate: out = rms_norm(x, w, eps) * (1 + scale[idx]) + shift[idx], BF16, forward and backward.

Forward (`norm_modulate_fwd`; `gate_residual_norm_modulate_fwd` first forms the row h = residual + gate[idx] * y
with gate_residual's roundings, stores it and normalizes it from registers): one 64-thread CTA per row
(kernels/rowwise.py, NORM_THREADS): each thread issues its 10-11 16-byte loads of the row at once and keeps them in
registers (BF16); the shift/scale rows of idx[row] are gathered in the kernel (tables may be row-strided views, e.g.
halves of the final layer's (T, 2H) projection); out is written once. Numerics replay the diffusers composition
`F.rms_norm(x, (H,), w, eps) * (1 + scale[idx]) + shift[idx]` on CUDA op for op:
    ss   = sum x^2 in torch's fused rms_norm order (rowwise.torch_sumsq), FP32
    rstd = rsqrt.approx(ss / H + eps)             (div.rn; CUDA rsqrtf is rsqrt.approx.f32)
    n    = bf16(w * (rstd * x))                   (torch: gamma * (rstd * x), one rounding)
    a    = bf16(1 + scale);  m = bf16(n * a);  out = bf16(m + shift)
so the output is bitwise the replay's wherever torch takes its vectorized fused path (BF16, H % 4 == 0,
16-byte aligned rows). Each row depends only on itself, w and its table rows: batch-invariant.

Backward, FP32 math as the CPU reference (h3cute.ops.adaln._modulate_backward_fp32), no rounding of
1 + scale or of xhat * w; dn = g * (1 + sc), dxhat = dn * w, dx = rstd * (dxhat - xhat * mean(dxhat * xhat)),
dweight = sum dn * xhat, dshift[r] = sum g, dscale[r] = sum g * (xhat * w), per fixed row group as FP32
partials that `rowwise_fold` finishes. No atomics.
  `norm_modulate_bwd_fused` (tables of <= 24 rows): one pass over (grad, x). A 7-CTA cluster per row group,
      CTA k owning columns [k * H/7, (k+1) * H/7) (192 threads of 4 columns), that slice of the table
      accumulators in shared memory and of 1 + scale (FP32). Rows go in steps of 8: each CTA reduces its
      slice's per-row sums of x^2 and dxhat * x and pushes them with st.async to every CTA of the cluster
      (double-buffered slots, one mbarrier per buffer, no cluster barrier per step); each CTA sums the 7
      partials in rank order, rstd = rsqrt.approx(ss / H + eps) (this order, not torch's forward order), and
      finishes dx = fma(xhat, -mean, dxhat) * rstd and the accumulations of its slice. Software-pipelined:
      step s + 1's rows load into registers (s + 2's into L2) while step s waits for its exchange and
      finishes (H200, S = 32768: 0.55 of copy bandwidth against 0.47 for one cluster barrier per 16-row step;
      perf/norm_backward_sweep.py). dshift/dscale: each run of consecutive rows with one table row is summed in
      registers and added to shared memory when the table row changes (docs/row_kernels.md).
  `norm_modulate_bwd_rows` + `norm_modulate_bwd_params` (more than 24 table rows): a row kernel (dx, an FP32 rstd
      workspace) and the column reduction of kernels/rowwise.py re-reading grad, x (its windowed variant beyond
      48 table rows). The row kernel sums each row in the fused kernel's order (the same columns per thread, the
      same butterfly, warps then ranks in order) and finishes dx with the same formulas: a row's dx is bitwise
      the same on both paths, so it never depends on the table's row count (tests/test_table_rows.py).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm, vector
from cutlass.cute.runtime import make_fake_tensor
from cutlass.cutlass_dsl import T, dsl_user_op

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream
from h3cute.widths import HIDDEN, NORM_EPS

from .rowwise import (COL_TILE, MAX_TABLE_ROWS, NORM_THREADS, TABLE_ROWS_CAPS, TORCH_WARPS, UNROLL, VEC,
                      checked_row, fake_indices, fake_partials, fake_rows, fake_table, fake_vector, guarded_row,
                      load_f32, reduction_block, round_bf16, row_range, smem_vec, take_owned, torch_sumsq,
                      torch_sumsq_v4, vec_view, window_chunk)

CLUSTER = 7  # CTAs of a fused-backward cluster: column slices of H / 7 = 768
# BF16 per thread of the fused backward (one 8-byte vector): 192 threads per 768-column slice, 12 warps per SM
# at 2 CTAs per SM. With 16-byte vectors (96 threads) the SM had 6 warps, too few to hide the latency of the
# per-step compute (H200, one cluster barrier per step: 0.46 of copy bandwidth).
FUSED_VEC = 4
# Rows per exchange step of the fused backward. Two steps' rows are in registers at once (the pipeline), under
# the 168-register cap of 2 CTAs of 192 threads per SM: 8 rows take ~151 (ptxas, sm_90a); 16 spill and run
# slower.
FUSED_STEPS = (8,)
FUSED_CAPS = (12, 24)  # table-row capacities the fused backward holds in shared memory; 48 takes rows + params
FUSED_CTAS_PER_SM = {12: 2, 24: 1}  # by shared memory: 109, 217 KiB per CTA
PICK_SLOTS = 3  # steps whose table picks are staged at once (the fused backward's pipeline: s, s + 1, s + 2)


@dsl_user_op
def store_cluster_async_f32(smem_ptr: cute.Pointer, mbar_ptr: cute.Pointer, peer, value, *, loc=None, ip=None):
    """st.async: `value` into CTA `peer`'s copy of `smem_ptr`, completing 4 bytes of the transaction on that
    CTA's copy of the mbarrier `mbar_ptr` (no fence, no cluster barrier: the peer's mbarrier wait orders it)."""
    llvm.inline_asm(
        res=None,
        operands_=[Int32(smem_ptr.toint()).ir_value(loc=loc, ip=ip), Int32(mbar_ptr.toint()).ir_value(loc=loc, ip=ip),
                   Int32(peer).ir_value(loc=loc, ip=ip), Float32(value).ir_value(loc=loc, ip=ip)],
        asm_string="{ .reg .b32 ra, rb; mapa.shared::cluster.u32 ra, $0, $2; mapa.shared::cluster.u32 rb, $1, $2; "
                   "st.async.shared::cluster.mbarrier::complete_tx::bytes.f32 [ra], $3, [rb]; }",
        constraints="r,r,r,f,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def prefetch_l2(gmem_ptr: cute.Pointer, num_bytes: int, *, loc=None, ip=None):
    """cp.async.bulk.prefetch.L2: bring `num_bytes` (a multiple of 16, 16-byte aligned) at `gmem_ptr` into L2;
    no registers, no shared memory, no completion to wait for."""
    llvm.inline_asm(
        res=None,
        operands_=[Int64(gmem_ptr.toint()).ir_value(loc=loc, ip=ip), Int32(num_bytes).ir_value(loc=loc, ip=ip)],
        asm_string="cp.async.bulk.prefetch.L2.global [$0], $1;",
        constraints="l,r,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@dsl_user_op
def opaque_vec(v: cute.TensorSSA, *, loc=None, ip=None) -> cute.TensorSSA:
    """`v` (BF16, an even count) passed through empty asm movs: its later conversions cannot be merged (CSE) with
    those before the cluster barrier, so only the raw bytes of a row stay live across it, not their FP32."""
    words = v.bitcast(Int32)
    count = cute.size(v.shape) // 2
    moved = [llvm.inline_asm(res=T.i32(), operands_=[Int32(words[k]).ir_value(loc=loc, ip=ip)],
                             asm_string="mov.b32 $0, $1;", constraints="=r,r", has_side_effects=False,
                             asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip) for k in range(count)]
    packed = vector.from_elements(ir.VectorType.get([count], T.i32()), moved, loc=loc, ip=ip)
    return cute.TensorSSA(packed, (count,), Int32).bitcast(BFloat16)


@cute.jit
def fused_vec(t: cute.Tensor, offset, space: cutlass.Constexpr):
    """FUSED_VEC elements of `t` (gmem or smem, any dtype) at element offset `offset` (a multiple of FUSED_VEC):
    one aligned access (8 bytes of BF16, 16 bytes of FP32)."""
    align = FUSED_VEC * t.element_type.width // 8
    ptr = cute.make_ptr(t.element_type, (t.iterator + offset).toint(), space, assumed_align=align)
    return cute.make_tensor(ptr, cute.make_layout(FUSED_VEC))


# Row layouts of the forward kernels: `vec` BF16 per access, 512 / vec threads per row, so that either way a
# sweep of the CTA covers torch's 128 threads x 4 elements. vec 8: thread u holds torch threads 2u, 2u + 1
# (rowwise.torch_sumsq); vec 4: thread t is torch thread t (rowwise.torch_sumsq_v4). Same bits.
ROW_VECS = (8, 4)


def row_threads(vec: int) -> int:
    return 4 * 128 // vec


@cute.jit
def row_vec(t: cute.Tensor, offset, vec: cutlass.Constexpr):
    """`vec` elements of `t` at element offset `offset` (a multiple of vec): one aligned access."""
    if cutlass.const_expr(vec == VEC):
        return vec_view(t, offset)
    return fused_vec(t, offset, cute.AddressSpace.gmem)


@cute.jit
def load_row(mT: cute.Tensor, base, tidx, width: cutlass.Constexpr, vec: cutlass.Constexpr = VEC):
    """This thread's BF16 vec-vectors u, u + 512 / vec, ... of a row (an absent vector of the last slot reads as
    zeros)."""
    threads = row_threads(vec)
    num_vecs = width // vec
    vals = []
    for k in cutlass.range_constexpr(-(-num_vecs // threads)):
        col = (tidx + k * threads) * vec
        if cutlass.const_expr((k + 1) * threads <= num_vecs):
            vals.append(row_vec(mT, base + col, vec).load())
        else:
            frag = cute.make_rmem_tensor((vec,), BFloat16)
            frag.fill(0.0)
            if tidx < num_vecs - k * threads:
                frag.store(row_vec(mT, base + col, vec).load())
            vals.append(frag.load())
    return vals


@cute.jit
def row_rstd(xs, sRed: cute.Tensor, tidx, eps: Float32, width: cutlass.Constexpr, vec: cutlass.Constexpr = VEC):
    if cutlass.const_expr(vec == VEC):
        ss = torch_sumsq(xs, sRed, tidx)
    else:
        ss = torch_sumsq_v4(xs, sRed, tidx)
    return cute.math.rsqrt(ss / Float32(width) + eps, approx=True)


# ---- forward ---------------------------------------------------------------------------------------------

@cute.kernel
def _forward_kernel(mX: cute.Tensor, mW: cute.Tensor, mShift: cute.Tensor, mScale: cute.Tensor,
                    mIdx: cute.Tensor, mOut: cute.Tensor, eps: Float32, err_rows: Int64, err_host: Int64,
                    width: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sRed = smem.allocate_tensor(Float32, cute.make_layout(TORCH_WARPS), byte_alignment=16)
    base = Int64(row) * width
    r, poison = checked_row(mIdx, row, mScale.shape[0], tidx, err_rows, err_host)
    xs = load_row(mX, base, tidx, width)
    rstd = row_rstd(xs, sRed, tidx, eps, width)
    _modulate_row(xs, rstd, mW, mShift, mScale, mOut, r, poison, base, tidx, width)


@cute.jit
def _modulate_row(xs, rstd, mW, mShift, mScale, mOut, r, poison, base, tidx, width: cutlass.Constexpr,
                  vec: cutlass.Constexpr = VEC):
    """out = bf16(bf16(bf16(w * (rstd * x)) * bf16(1 + scale[r])) + shift[r]) * poison of this thread's vectors."""
    threads = row_threads(vec)
    num_vecs = width // vec
    shift_base = r * mShift.stride[0]
    scale_base = r * mScale.stride[0]
    for k in cutlass.range_constexpr(len(xs)):
        vi = tidx + k * threads
        if vi < num_vecs:
            col = vi * vec
            normed = round_bf16(_row_f32(mW, col, vec) * (xs[k].to(Float32) * rstd))
            gain = round_bf16(_row_f32(mScale, scale_base + col, vec) + 1.0)
            _store_row_vec(mOut, base + col, (round_bf16(normed * gain) + _row_f32(mShift, shift_base + col, vec))
                           * poison, vec)


@cute.jit
def _row_f32(t: cute.Tensor, offset, vec: cutlass.Constexpr):
    return row_vec(t, offset, vec).load().to(Float32)


@cute.jit
def _store_row_vec(t: cute.Tensor, offset, value, vec: cutlass.Constexpr):
    row_vec(t, offset, vec).store(value.to(BFloat16))


@cute.jit
def _gated_residual(res, y, mGate, offset, poison, vec: cutlass.Constexpr):
    """h = bf16((res + bf16(gate * y)) * poison) of one BF16 vec-vector: gate_residual's two roundings."""
    gated = round_bf16(_row_f32(mGate, offset, vec) * y.to(Float32))
    return ((res.to(Float32) + gated) * poison).to(BFloat16)


@cute.kernel
def _gated_forward_kernel(mRes: cute.Tensor, mY: cute.Tensor, mGate: cute.Tensor, mW: cute.Tensor,
                          mShift: cute.Tensor, mScale: cute.Tensor, mIdx: cute.Tensor, mH: cute.Tensor,
                          mOut: cute.Tensor, eps: Float32, err_rows: Int64, err_host: Int64,
                          width: cutlass.Constexpr, vec: cutlass.Constexpr):
    """gate_residual then norm_modulate of the same row: h = residual + gate[idx] * y is stored and kept in
    registers (BF16) for the norm, so the row is read once (residual, y) and written once (h, out). `vec`: the
    row layout (ROW_VECS), the same bits either way."""
    threads = row_threads(vec)
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sRed = smem.allocate_tensor(Float32, cute.make_layout(TORCH_WARPS), byte_alignment=16)
    num_vecs = width // vec
    base = Int64(row) * width
    r, poison = checked_row(mIdx, row, mScale.shape[0], tidx, err_rows, err_host)
    gate_base = r * mGate.stride[0]
    res = load_row(mRes, base, tidx, width, vec)
    ys = load_row(mY, base, tidx, width, vec)
    hs = []
    for k in cutlass.range_constexpr(len(res)):
        col = (tidx + k * threads) * vec
        if cutlass.const_expr((k + 1) * threads <= num_vecs):
            h = _gated_residual(res[k], ys[k], mGate, gate_base + col, poison, vec)
            row_vec(mH, base + col, vec).store(h)
            hs.append(h)
        else:  # the partial last slot: absent vectors stay zero, as load_row reads them
            frag = cute.make_rmem_tensor((vec,), BFloat16)
            frag.fill(0.0)
            if tidx < num_vecs - k * threads:
                frag.store(_gated_residual(res[k], ys[k], mGate, gate_base + col, poison, vec))
                row_vec(mH, base + col, vec).store(frag.load())
            hs.append(frag.load())
    rstd = row_rstd(hs, sRed, tidx, eps, width, vec)
    _modulate_row(hs, rstd, mW, mShift, mScale, mOut, r, poison, base, tidx, width, vec)


@cute.jit
def _gated_forward_launch(mRes, mY, mGate, mW, mShift, mScale, mIdx, mH, mOut, eps: Float32, err_rows: Int64,
                          err_host: Int64, stream, width: cutlass.Constexpr, vec: cutlass.Constexpr):
    _gated_forward_kernel(mRes, mY, mGate, mW, mShift, mScale, mIdx, mH, mOut, eps, err_rows, err_host, width,
                          vec).launch(grid=(mY.shape[0], 1, 1), block=(row_threads(vec), 1, 1), stream=stream)


@cute.jit
def _forward_launch(mX, mW, mShift, mScale, mIdx, mOut, eps: Float32, err_rows: Int64, err_host: Int64, stream,
                    width: cutlass.Constexpr):
    _forward_kernel(mX, mW, mShift, mScale, mIdx, mOut, eps, err_rows, err_host, width).launch(
        grid=(mX.shape[0], 1, 1), block=(NORM_THREADS, 1, 1), stream=stream
    )


# ---- backward: dx (row-local) ----------------------------------------------------------------------------

@cute.kernel
def _bwd_rows_kernel(mG: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mScale: cute.Tensor, mIdx: cute.Tensor,
                     mDx: cute.Tensor, mRstd: cute.Tensor, eps: Float32, width: cutlass.Constexpr):
    """dx of one row, bitwise the fused backward's: a CTA of fused_threads(width) threads, thread j holding
    columns [k * slice + 4j, k * slice + 4j + 4) of every cluster rank k (the columns fused CTA k's thread j
    holds). Per rank it sums x^2 and dxhat * x over its 4 columns in order, the xor butterfly sums each over the
    warp and the warps are added in order: rank k's two sums, as fused CTA k pushes them; the ranks are then
    added in order, and rstd, mean(dxhat * xhat) and dx follow _fused_complete's formulas. The row's rstd goes to
    the workspace of `norm_modulate_bwd_params`."""
    threads = fused_threads(width)
    slice_width = threads * FUSED_VEC
    warps = threads // 32
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    lane = tidx % 32
    smem = cutlass.memory.SmemAllocator()
    sWarp = smem.allocate_tensor(Float32, cute.make_layout(2 * CLUSTER * warps), byte_alignment=16)
    base = Int64(row) * width
    r, poison = guarded_row(Int64(mIdx[row]), mScale.shape[0])
    scale_base = r * mScale.stride[0]
    cols = [k * slice_width + tidx * FUSED_VEC for k in range(CLUSTER)]
    gs = [fused_vec(mG, base + cols[k], cute.AddressSpace.gmem).load() for k in range(CLUSTER)]
    xs = [fused_vec(mX, base + cols[k], cute.AddressSpace.gmem).load() for k in range(CLUSTER)]
    gains = [fused_vec(mScale, scale_base + cols[k], cute.AddressSpace.gmem).load().to(Float32) + 1.0
             for k in range(CLUSTER)]
    ws = [fused_vec(mW, cols[k], cute.AddressSpace.gmem).load().to(Float32) for k in range(CLUSTER)]
    sums = []
    for k in cutlass.range_constexpr(CLUSTER):
        sums.extend(_vector_sums(xs[k], gs[k].to(Float32) * gains[k] * ws[k]))
    for off in cutlass.range_constexpr(5):
        sums = [v + cute.arch.shuffle_sync_bfly(v, 16 >> off) for v in sums]
    if lane == 0:
        for j in cutlass.range_constexpr(2 * CLUSTER):
            sWarp[j * warps + tidx // 32] = sums[j]
    cute.arch.sync_threads()
    ss = Float32(0.0)
    dot = Float32(0.0)
    for k in cutlass.range_constexpr(CLUSTER):
        rank_ss = sWarp[2 * k * warps]
        rank_dot = sWarp[(2 * k + 1) * warps]
        for wi in cutlass.range_constexpr(1, warps):
            rank_ss = rank_ss + sWarp[2 * k * warps + wi]
            rank_dot = rank_dot + sWarp[(2 * k + 1) * warps + wi]
        ss = ss + rank_ss
        dot = dot + rank_dot
    rstd = cute.math.rsqrt(ss / Float32(width) + eps, approx=True)
    mean_dot = rstd * dot / Float32(width)  # mean(dxhat * xhat)
    for k in cutlass.range_constexpr(CLUSTER):
        dxhat = gs[k].to(Float32) * gains[k] * ws[k]
        xhat = xs[k].to(Float32) * rstd
        dx = cute.make_rmem_tensor((FUSED_VEC,), Float32)
        for e in cutlass.range_constexpr(FUSED_VEC):  # the poison is 1.0 (exact) or NaN
            dx[e] = cute.math.fma(xhat[e], -mean_dot, dxhat[e]) * (rstd * poison)
        fused_vec(mDx, base + cols[k], cute.AddressSpace.gmem).store(dx.load().to(BFloat16))
    if tidx == 0:
        mRstd[row] = rstd


@cute.jit
def _bwd_rows_launch(mG, mX, mW, mScale, mIdx, mDx, mRstd, eps: Float32, stream, width: cutlass.Constexpr):
    _bwd_rows_kernel(mG, mX, mW, mScale, mIdx, mDx, mRstd, eps, width).launch(
        grid=(mX.shape[0], 1, 1), block=(fused_threads(width), 1, 1), stream=stream
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


@cute.jit
def _params_chunk_windowed(mG, mX, mScale, mIdx, mRstd, w, accW, sShift, sScale, base, chunk, end, col, lane,
                           width: cutlass.Constexpr, cap: cutlass.Constexpr):
    """Rows [chunk, chunk + 32) for the CTA of window [base, base + cap): the rows whose idx lies in the window
    (window_chunk) are loaded UNROLL at a time and added in row order."""
    mask, local, _ = window_chunk(mIdx, chunk, end, mScale.shape[0], base, cap, lane, False)
    for _ in cutlass.range_constexpr(32 // UNROLL):
        taken, mask = take_owned(mask, UNROLL)
        locs = [cute.arch.shuffle_sync(local, src) for _, src in taken]
        offs = [Int64(chunk + src) * width + col for _, src in taken]
        gs = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(UNROLL)]
        xs = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(UNROLL)]
        scales = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(UNROLL)]
        rstds = cute.make_rmem_tensor((UNROLL,), Float32)
        for i in cutlass.range_constexpr(UNROLL):
            if taken[i][0]:
                gs[i].store(load_f32(mG, offs[i]))
                xs[i].store(load_f32(mX, offs[i]))
                scales[i].store(load_f32(mScale, (base + locs[i]) * mScale.stride[0] + col))
                rstds[i] = mRstd[chunk + taken[i][1]]
        for i in cutlass.range_constexpr(UNROLL):
            if taken[i][0]:
                g = gs[i].load()
                xhat = xs[i].load() * rstds[i]
                accW.store(accW.load() + g * (scales[i].load() + 1.0) * xhat)
                acc_off = locs[i] * COL_TILE + lane * VEC
                aShift = smem_vec(sShift, acc_off)
                aShift.store(aShift.load() + g)
                aScale = smem_vec(sScale, acc_off)
                aScale.store(aScale.load() + g * (xhat * w))


@cute.kernel
def _bwd_params_kernel(mG: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mScale: cute.Tensor,
                       mIdx: cute.Tensor, mRstd: cute.Tensor, mPartW: cute.Tensor, mPartShift: cute.Tensor,
                       mPartScale: cute.Tensor, width: cutlass.Constexpr, cap: cutlass.Constexpr,
                       windowed: cutlass.Constexpr):
    lane, _, _ = cute.arch.thread_idx()
    tile, block_y, _ = cute.arch.block_idx()
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
    if cutlass.const_expr(windowed):
        # dweight: one partial per (window, group) in mPartW's rows, block y's; the table rows per group.
        base, group = reduction_block(block_y, mPartShift.shape[0], cap, True)
        begin, end = row_range(mX.shape[0], group, mPartShift.shape[0])
        for chunk in cutlass.range(begin, end, 32):
            _params_chunk_windowed(mG, mX, mScale, mIdx, mRstd, w, accW, sShift, sScale, base, chunk, end, col, lane,
                                   width, cap)
        vec_view(mPartW, Int64(block_y) * mPartW.stride[0] + col).store(accW.load())
        for r in cutlass.range(cutlass.min(Int64(cap), mScale.shape[0] - base)):
            src = Int32(r) * COL_TILE + lane * VEC
            vec_view(mPartShift, Int64(group) * mPartShift.stride[0] + (base + r) * mPartShift.stride[1] + col).store(
                smem_vec(sShift, src).load())
            vec_view(mPartScale, Int64(group) * mPartScale.stride[0] + (base + r) * mPartScale.stride[1] + col).store(
                smem_vec(sScale, src).load())
    else:
        group = block_y
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
                       width: cutlass.Constexpr, cap: cutlass.Constexpr, windowed: cutlass.Constexpr):
    # windowed: mPartW has one row per (window, group), so its rows count the blocks
    _bwd_params_kernel(mG, mX, mW, mScale, mIdx, mRstd, mPartW, mPartShift, mPartScale, width, cap, windowed).launch(
        grid=(width // COL_TILE, mPartW.shape[0], 1), block=(32, 1, 1), stream=stream
    )


# ---- backward, fused: dx and the parameter partials in one pass over (grad, x) ------------------------------

def fused_threads(width: int) -> int:
    """Threads of a fused-backward CTA: one FUSED_VEC-column vector each of its width / CLUSTER column slice."""
    return width // (FUSED_VEC * CLUSTER)


@cute.jit
def _fused_terms(g, sGain: cute.Tensor, tab_off, w):
    """dn = g * (1 + scale) and dxhat = dn * w of one vector, FP32 (1 + scale from the staged FP32 gain rows)."""
    dn = g.to(Float32) * fused_vec(sGain, tab_off, cute.AddressSpace.smem).load()
    return dn, dn * w


@cute.jit
def _vector_sums(x_bf16, dxhat):
    """(sum x^2, sum dxhat * x) of one FUSED_VEC vector, elements in order: the first step of a row's two sums on
    both backward paths (the fused kernel's push and bwd_rows), hence one function."""
    x = x_bf16.to(Float32)
    ss = Float32(0.0)
    dot = Float32(0.0)
    for e in cutlass.range_constexpr(FUSED_VEC):
        ss = cute.math.fma(x[e], x[e], ss)
        dot = cute.math.fma(dxhat[e], x[e], dot)
    return ss, dot


@cute.jit
def _flush_run(sShift: cute.Tensor, sScale: cute.Tensor, run: cute.Tensor, runShift: cute.Tensor,
               runScale: cute.Tensor):
    """Add the run's sums to its table row's shared accumulators (this thread's columns) and clear them."""
    aShift = fused_vec(sShift, run[0], cute.AddressSpace.smem)
    aShift.store(aShift.load() + runShift.load())
    aScale = fused_vec(sScale, run[0], cute.AddressSpace.smem)
    aScale.store(aScale.load() + runScale.load())
    runShift.fill(0.0)
    runScale.fill(0.0)


@cute.jit
def _fused_picks(mIdx, table_rows, first, tidx, rows: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Per row of [first, first + rows): its table row's offset in the staged slices (this thread's columns)
    and the poison factor (guarded_row)."""
    picks = [guarded_row(Int64(mIdx[first + i]), table_rows) for i in range(rows)]
    return [Int32(p[0]) * (threads * FUSED_VEC) + tidx * FUSED_VEC for p in picks], [p[1] for p in picks]


@cute.jit
def _load_pick(mIdx, first, tidx, step_rows: cutlass.Constexpr):
    """Thread t's load of row first + t % step_rows's index (in range: `first` is a full step's first row), issued
    early so that its latency passes while the thread works; _store_pick uses it after."""
    return Int64(mIdx[first + tidx % step_rows])


@cute.jit
def _store_pick(sPick: cute.Tensor, r, table_rows, slot, tidx, step_rows: cutlass.Constexpr):
    """Threads t < step_rows stage their row's table row (-1: out of range) in slot (slot, t): a step's push and
    finish read the picks from shared memory instead of every thread reading idx twice."""
    if tidx < step_rows:
        sPick[slot * step_rows + tidx] = cutlass.select_((r >= 0) & (r < table_rows), Int32(r), Int32(-1))


@cute.jit
def _staged_picks(sPick: cute.Tensor, slot, tidx, step_rows: cutlass.Constexpr, threads: cutlass.Constexpr):
    """_fused_picks of the step staged in `slot`: the same offsets and poison factors (guarded_row)."""
    tab = []
    poison = []
    for i in cutlass.range_constexpr(step_rows):
        r = sPick[slot * step_rows + i]
        tab.append(cutlass.max(r, Int32(0)) * (threads * FUSED_VEC) + tidx * FUSED_VEC)
        poison.append(cutlass.select_(r >= 0, Float32(1.0), Float32(float("nan"))))
    return tab, poison


@cute.jit
def _load_step(mG, mX, gBuf, xBuf, base, rows: cutlass.Constexpr, width: cutlass.Constexpr):
    """This thread's grad and x vectors of `rows` rows from element offset `base` on into register buffers."""
    for i in cutlass.range_constexpr(rows):
        gBuf[i].store(fused_vec(mG, base + i * width, cute.AddressSpace.gmem).load())
        xBuf[i].store(fused_vec(mX, base + i * width, cute.AddressSpace.gmem).load())


@cute.jit
def _prefetch_step(mG, mX, first, rank, tidx, step_rows: cutlass.Constexpr, width: cutlass.Constexpr,
                   threads: cutlass.Constexpr):
    """Rows [first, first + step_rows) of this CTA's slice of grad and x into L2 (one row per thread of the
    first 2 * step_rows); rows past the batch are skipped."""
    slice_width = threads * FUSED_VEC
    ahead = first + tidx % step_rows
    if (tidx < 2 * step_rows) & (ahead < mX.shape[0]):
        offset = Int64(ahead) * width + rank * slice_width
        if tidx < step_rows:
            prefetch_l2(mG.iterator + offset, slice_width * 2)
        else:
            prefetch_l2(mX.iterator + offset, slice_width * 2)


@cute.jit
def _exchange_bytes(step, full_steps, step_rows: cutlass.Constexpr):
    """Bytes a CTA receives in the exchange of step `step`: two FP32 sums per row from each CTA of the cluster
    (full steps have step_rows rows, the tail steps one)."""
    return Int32(CLUSTER * 2 * 4) * cutlass.select_(step < full_steps, Int32(step_rows), Int32(1))


@cute.jit
def _fused_push(gs, xs, tab, sTab, w, sWarp, sPub, sBar, step, rank, tidx,
                rows: cutlass.Constexpr, step_rows: cutlass.Constexpr, threads: cutlass.Constexpr):
    """Rows [first, first + rows): this slice's two per-row sums (sum x^2, sum dxhat * x), reduced in the CTA in
    a fixed order (vector elements in order, the xor butterfly, warps in order) and pushed with st.async into
    slot (step % 2, rank) of every CTA's exchange buffer, each push completing bytes on that CTA's mbarrier.
    `tab`: the rows' table offsets (_fused_picks)."""
    warps = threads // 32
    parts = []
    for i in cutlass.range_constexpr(rows):
        parts.extend(_vector_sums(xs[i], _fused_terms(gs[i], sTab, tab[i], w)[1]))
    # Warp sums: the xor butterfly (offsets 16..1) as a reduce-scatter. Each stage a lane keeps half of its
    # values (the upper half where its offset bit is set) and adds the partner's copy of that half: the same
    # pairwise sums as the all-reduce, bitwise, in 31 shuffles for 32 values instead of 160.
    assert (2 * rows) & (2 * rows - 1) == 0 and 2 * rows <= 32, "row sums per warp: a power of two <= 32"
    lane = tidx % 32
    vals = parts
    for off in cutlass.range_constexpr(5):
        bit = 16 >> off
        half = len(vals) // 2
        if cutlass.const_expr(half == 0):
            vals = [vals[0] + cute.arch.shuffle_sync_bfly(vals[0], bit)]
        else:
            upper = (lane & bit) != 0
            keep = [Float32(cutlass.select_(upper, vals[half + k], vals[k])) for k in range(half)]
            send = [Float32(cutlass.select_(upper, vals[k], vals[half + k])) for k in range(half)]
            vals = [keep[k] + cute.arch.shuffle_sync_bfly(send[k], bit) for k in range(half)]
    spread = 32 // (2 * rows)  # lane l holds the warp sum of value l // spread
    if lane % spread == 0:
        sWarp[(lane // spread) * warps + tidx // 32] = vals[0]
    cute.arch.sync_threads()
    if tidx < 2 * rows:
        total = sWarp[tidx * warps]
        for wi in cutlass.range_constexpr(1, warps):
            total = total + sWarp[tidx * warps + wi]
        buf = step % 2
        slot = (buf * CLUSTER + rank) * (2 * step_rows) + tidx
        for peer in cutlass.range_constexpr(CLUSTER):
            store_cluster_async_f32(sPub.iterator + slot, sBar.iterator + buf, peer, total)


@cute.jit
def _fused_complete(gs, xs, tab, poison, mDx, sTab, sShift, sScale, sPub, sBar, w, accW, run, runShift, runScale,
                    first, step, steps, full_steps, tidx, col, eps: Float32, rows: cutlass.Constexpr,
                    step_rows: cutlass.Constexpr, width: cutlass.Constexpr):
    """Rows [first, first + rows) once step `step`'s exchange is complete (every warp waits on the buffer's
    mbarrier itself, so no CTA barrier; thread 0 re-arms it for step + 2): lane i of every warp sums row i's
    CLUSTER partials in rank order into rstd and mean(dxhat * xhat) and the warp's lanes take them by shuffle;
    then dx and the accumulations in row order. `tab`, `poison`: the rows' _fused_picks.
    Re-arming while other warps still wait is safe: the next phase completes only with step + 2's pushes, which
    every peer sends after this CTA's step + 1 push, which follows this step's reads by all warps (its barrier)."""
    buf = step % 2
    lane = tidx % 32
    cute.arch.mbarrier_wait(sBar.iterator + buf, (step // 2) % 2)
    if (tidx == 0) & (step + 2 < steps):
        cute.arch.mbarrier_arrive_and_expect_tx(sBar.iterator + buf, _exchange_bytes(step + 2, full_steps, step_rows))
    row = cutlass.min(lane, Int32(rows - 1))
    ss = Float32(0.0)
    dot = Float32(0.0)
    for peer in cutlass.range_constexpr(CLUSTER):
        at = (buf * CLUSTER + peer) * (2 * step_rows) + 2 * row
        ss = ss + sPub[at]
        dot = dot + sPub[at + 1]
    lane_rstd = cute.math.rsqrt(ss / Float32(width) + eps, approx=True)
    lane_mean = lane_rstd * dot / Float32(width)  # mean(dxhat * xhat)
    base = Int64(first) * width + col
    for i in cutlass.range_constexpr(rows):
        rstd = cute.arch.shuffle_sync(lane_rstd, i)
        mean_dot = cute.arch.shuffle_sync(lane_mean, i)
        g = opaque_vec(gs[i])
        dn, dxhat = _fused_terms(g, sTab, tab[i], w)
        xhat = opaque_vec(xs[i]).to(Float32) * rstd
        dx = cute.make_rmem_tensor((FUSED_VEC,), Float32)
        for e in cutlass.range_constexpr(FUSED_VEC):  # the poison is 1.0 (exact) or NaN
            dx[e] = cute.math.fma(xhat[e], -mean_dot, dxhat[e]) * (rstd * poison[i])
        fused_vec(mDx, base + i * width, cute.AddressSpace.gmem).store(dx.load().to(BFloat16))
        if poison[i] == 1.0:  # rows with an out-of-range index add nothing
            accW.store(accW.load() + dn * xhat)
            if tab[i] != run[0]:
                _flush_run(sShift, sScale, run, runShift, runScale)
                run[0] = tab[i]
            runShift.store(runShift.load() + g.to(Float32))
            runScale.store(runScale.load() + g.to(Float32) * (xhat * w))


@cute.kernel
def _bwd_fused_kernel(mG: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mScale: cute.Tensor, mIdx: cute.Tensor,
                      mDx: cute.Tensor, mPartW: cute.Tensor, mPartShift: cute.Tensor, mPartScale: cute.Tensor,
                      eps: Float32, width: cutlass.Constexpr, cap: cutlass.Constexpr, step_rows: cutlass.Constexpr):
    threads = fused_threads(width)
    slice_width = threads * FUSED_VEC
    tidx, _, _ = cute.arch.thread_idx()
    _, group, _ = cute.arch.block_idx()
    rank = cute.arch.block_idx_in_cluster()
    smem = cutlass.memory.SmemAllocator()
    sShift = smem.allocate_tensor(Float32, cute.make_layout(cap * slice_width), byte_alignment=32)
    sScale = smem.allocate_tensor(Float32, cute.make_layout(cap * slice_width), byte_alignment=32)
    # 1 + scale of this slice's table rows, FP32 (converted once here, not per row and use)
    sTab = smem.allocate_tensor(Float32, cute.make_layout(cap * slice_width), byte_alignment=16)
    sPub = smem.allocate_tensor(Float32, cute.make_layout(2 * CLUSTER * 2 * step_rows), byte_alignment=16)
    sWarp = smem.allocate_tensor(Float32, cute.make_layout(2 * step_rows * (threads // 32)), byte_alignment=16)
    sPick = smem.allocate_tensor(Int32, cute.make_layout(PICK_SLOTS * step_rows), byte_alignment=16)
    sBar = smem.allocate_tensor(Int64, cute.make_layout(2), byte_alignment=8)  # one mbarrier per exchange buffer
    col = rank * slice_width + tidx * FUSED_VEC
    own = tidx * FUSED_VEC
    table_rows = mScale.shape[0]
    zero = cute.full((FUSED_VEC,), 0.0, Float32)
    for r in cutlass.range(cap):
        fused_vec(sShift, r * slice_width + own, cute.AddressSpace.smem).store(zero)
        fused_vec(sScale, r * slice_width + own, cute.AddressSpace.smem).store(zero)
    for r in cutlass.range(table_rows):
        scale_row = fused_vec(mScale, r * mScale.stride[0] + col, cute.AddressSpace.gmem).load()
        fused_vec(sTab, r * slice_width + own, cute.AddressSpace.smem).store(scale_row.to(Float32) + 1.0)
    w = fused_vec(mW, col, cute.AddressSpace.gmem).load().to(Float32)
    accW = cute.make_rmem_tensor((FUSED_VEC,), Float32)
    accW.fill(0.0)
    # the current run of rows with one table row (its slice offset in run[0]; row 0 and zeros to begin with)
    run = cute.make_rmem_tensor((1,), Int32)
    run[0] = own
    runShift = cute.make_rmem_tensor((FUSED_VEC,), Float32)
    runShift.fill(0.0)
    runScale = cute.make_rmem_tensor((FUSED_VEC,), Float32)
    runScale.fill(0.0)

    begin, end = row_range(mX.shape[0], group, mPartW.shape[0])
    full_steps = (end - begin) // step_rows
    batched_end = begin + full_steps * step_rows
    steps = full_steps + (end - batched_end)  # the last rows are steps of one row
    if tidx == 0:
        cute.arch.mbarrier_init(sBar.iterator, 1)
        cute.arch.mbarrier_init(sBar.iterator + 1, 1)
    cute.arch.mbarrier_init_fence()
    if tidx == 0:
        for b in cutlass.range_constexpr(2):
            if b < steps:
                cute.arch.mbarrier_arrive_and_expect_tx(sBar.iterator + b, _exchange_bytes(b, full_steps, step_rows))
    # every CTA's mbarriers exist before any peer pushes to them
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()
    # Software pipeline: while step s waits for its exchange and finishes, step s + 1's rows are loading into
    # registers (and step s + 2's into L2); step s + 1's sums are pushed right after. A CTA pushes step s + 2
    # into a buffer only after every CTA pushed step s + 1, which each did after reading step s from it.
    cur_g = [cute.make_rmem_tensor((FUSED_VEC,), BFloat16) for _ in range(step_rows)]
    cur_x = [cute.make_rmem_tensor((FUSED_VEC,), BFloat16) for _ in range(step_rows)]
    nxt_g = [cute.make_rmem_tensor((FUSED_VEC,), BFloat16) for _ in range(step_rows)]
    nxt_x = [cute.make_rmem_tensor((FUSED_VEC,), BFloat16) for _ in range(step_rows)]
    # Step s's table picks sit in slot s % PICK_SLOTS of sPick, stored during step s - 2 (after its finish, before
    # step s - 1's push barrier, which orders them for every reader) into the slot step s - 3 used (read at the
    # latest in step s - 3's finish, which step s - 2's push barrier follows).
    last_first = batched_end - step_rows
    if full_steps > 0:
        _load_step(mG, mX, cur_g, cur_x, Int64(begin) * width + col, step_rows, width)
        for s0 in cutlass.range_constexpr(2):
            first0 = cutlass.min(begin + s0 * step_rows, last_first)
            _store_pick(sPick, _load_pick(mIdx, first0, tidx, step_rows), table_rows, s0, tidx, step_rows)
        cute.arch.sync_threads()
        tab, _ = _staged_picks(sPick, 0, tidx, step_rows, threads)
        _fused_push([t.load() for t in cur_g], [t.load() for t in cur_x], tab, sTab, w, sWarp, sPub, sBar, Int32(0),
                    rank, tidx, step_rows, step_rows, threads)
    for step in cutlass.range(full_steps):
        first = begin + step * step_rows
        ahead = cutlass.min(first + step_rows, last_first)  # the last step reloads itself (not used)
        _load_step(mG, mX, nxt_g, nxt_x, Int64(ahead) * width + col, step_rows, width)
        pick = _load_pick(mIdx, cutlass.min(first + 2 * step_rows, last_first), tidx, step_rows)
        _prefetch_step(mG, mX, ahead + step_rows, rank, tidx, step_rows, width, threads)
        tab, poison = _staged_picks(sPick, step % PICK_SLOTS, tidx, step_rows, threads)
        _fused_complete([t.load() for t in cur_g], [t.load() for t in cur_x], tab, poison, mDx, sTab, sShift, sScale,
                        sPub, sBar, w, accW, run, runShift, runScale, first, step, steps, full_steps, tidx, col, eps,
                        step_rows, step_rows, width)
        _store_pick(sPick, pick, table_rows, (step + 2) % PICK_SLOTS, tidx, step_rows)
        if step + 1 < full_steps:
            tab, _ = _staged_picks(sPick, (step + 1) % PICK_SLOTS, tidx, step_rows, threads)
            _fused_push([t.load() for t in nxt_g], [t.load() for t in nxt_x], tab, sTab, w, sWarp, sPub, sBar,
                        step + 1, rank, tidx, step_rows, step_rows, threads)
        for i in cutlass.range_constexpr(step_rows):
            cur_g[i].store(nxt_g[i].load())
            cur_x[i].store(nxt_x[i].load())
    for first in cutlass.range(batched_end, end):
        step = full_steps + first - batched_end
        gs = [fused_vec(mG, Int64(first) * width + col, cute.AddressSpace.gmem).load()]
        xs = [fused_vec(mX, Int64(first) * width + col, cute.AddressSpace.gmem).load()]
        tab, poison = _fused_picks(mIdx, table_rows, first, tidx, 1, threads)
        _fused_push(gs, xs, tab, sTab, w, sWarp, sPub, sBar, step, rank, tidx, 1, step_rows, threads)
        _fused_complete(gs, xs, tab, poison, mDx, sTab, sShift, sScale, sPub, sBar, w, accW, run, runShift, runScale,
                        first, step, steps, full_steps, tidx, col, eps, 1, step_rows, width)

    _flush_run(sShift, sScale, run, runShift, runScale)
    fused_vec(mPartW, Int64(group) * mPartW.stride[0] + col, cute.AddressSpace.gmem).store(accW.load())
    for r in cutlass.range(table_rows):
        src = r * slice_width + own
        part = Int64(group) * mPartShift.stride[0] + Int64(r) * mPartShift.stride[1] + col
        fused_vec(mPartShift, part, cute.AddressSpace.gmem).store(fused_vec(sShift, src, cute.AddressSpace.smem).load())
        part = Int64(group) * mPartScale.stride[0] + Int64(r) * mPartScale.stride[1] + col
        fused_vec(mPartScale, part, cute.AddressSpace.gmem).store(fused_vec(sScale, src, cute.AddressSpace.smem).load())
    # no CTA exits while a peer may still push into its shared memory
    cute.arch.cluster_arrive()
    cute.arch.cluster_wait()


@cute.jit
def _bwd_fused_launch(mG, mX, mW, mScale, mIdx, mDx, mPartW, mPartShift, mPartScale, eps: Float32, stream,
                      width: cutlass.Constexpr, cap: cutlass.Constexpr, step_rows: cutlass.Constexpr):
    _bwd_fused_kernel(mG, mX, mW, mScale, mIdx, mDx, mPartW, mPartShift, mPartScale, eps, width, cap,
                      step_rows).launch(
        grid=(CLUSTER, mPartW.shape[0], 1), block=(fused_threads(width), 1, 1), cluster=(CLUSTER, 1, 1),
        # ptxas keeps the registers for 2 CTAs per SM at cap 12 (.maxntid + .minnctapersm); carveout at max
        max_number_threads=(fused_threads(width), 1, 1), min_blocks_per_mp=FUSED_CTAS_PER_SM[cap],
        preferred_smem_carveout=100,
        stream=stream
    )


# ---- fake tensors and specs ------------------------------------------------------------------------------

def _check_width(width):
    if width % COL_TILE:
        raise ValueError(f"norm_modulate kernels need a width divisible by {COL_TILE}, got {width}")


def build_forward(arch: str, *, width: int):
    _check_width(width)
    s = cute.sym_int()
    return compile_for(arch, _forward_launch, fake_rows(s, width), fake_vector(width), fake_table(width),
                       fake_table(width), fake_indices(s), fake_rows(s, width), Float32(NORM_EPS), Int64(0), Int64(0),
                       env_stream(), width)


def build_gated_forward(arch: str, *, width: int, vec: int):
    _check_width(width)
    if vec not in ROW_VECS:
        raise ValueError(f"gate_residual_norm_modulate_fwd: vec {vec} is not a row layout {ROW_VECS}")
    s = cute.sym_int()
    return compile_for(arch, _gated_forward_launch, fake_rows(s, width), fake_rows(s, width), fake_table(width),
                       fake_vector(width), fake_table(width), fake_table(width), fake_indices(s), fake_rows(s, width),
                       fake_rows(s, width), Float32(NORM_EPS), Int64(0), Int64(0), env_stream(), width, vec)


def build_backward_rows(arch: str, *, width: int):
    _check_width(width)
    s = cute.sym_int()
    return compile_for(arch, _bwd_rows_launch, fake_rows(s, width), fake_rows(s, width), fake_vector(width),
                       fake_table(width), fake_indices(s), fake_rows(s, width), fake_vector(s, Float32),
                       Float32(NORM_EPS), env_stream(), width)


def build_backward_params(arch: str, *, width: int, cap: int, windowed: bool = False):
    _check_width(width)
    s, groups, table_rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    # windowed: dweight's partials have windows x groups rows
    part_w = make_fake_tensor(Float32, (cute.sym_int() if windowed else groups, width),
                              (cute.sym_int(divisibility=4), 1), assumed_align=16)
    return compile_for(arch, _bwd_params_launch, fake_rows(s, width), fake_rows(s, width), fake_vector(width),
                       fake_table(width, table_rows), fake_indices(s), fake_vector(s, Float32), part_w,
                       fake_partials(groups, table_rows, width), fake_partials(groups, table_rows, width),
                       env_stream(), width, cap, windowed)


def build_backward_fused(arch: str, *, width: int, cap: int, step: int):
    if width % (FUSED_VEC * CLUSTER * 32):
        raise ValueError(f"the fused norm_modulate backward needs a width divisible by {FUSED_VEC * CLUSTER * 32}")
    s, groups, table_rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    part_w = make_fake_tensor(Float32, (groups, width), (cute.sym_int(divisibility=4), 1), assumed_align=16)
    return compile_for(arch, _bwd_fused_launch, fake_rows(s, width), fake_rows(s, width), fake_vector(width),
                       fake_table(width, table_rows), fake_indices(s), fake_rows(s, width), part_w,
                       fake_partials(groups, table_rows, width), fake_partials(groups, table_rows, width),
                       Float32(NORM_EPS), env_stream(), width, cap, step)


SPECS = [
    KernelSpec(
        name="norm_modulate_fwd",
        build=build_forward,
        variants=lambda arch: [dict(width=HIDDEN)],
        # v4 loads/stores: 16-byte vectors; rsqrt.approx + div.rn: torch's rstd; cvt.rn.bf16x2: the roundings.
        ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "rsqrt.approx.f32", "div.rn.f32", "cvt.rn.bf16x2.f32",
                     "shfl.sync.bfly", "red.global.min.s64"),
        ptx_forbidden=("atom.", "red.global.add", "red.shared"),
    ),
    KernelSpec(
        name="gate_residual_norm_modulate_fwd",
        build=build_gated_forward,
        variants=lambda arch: [dict(width=HIDDEN, vec=vec) for vec in ROW_VECS],
        # gate_residual's and norm_modulate's forward markers: both sets of roundings in one kernel; vector
        # accesses of 16 (vec 8) or 8 bytes (vec 4)
        ptx_markers=("ld.global.v", "st.global.v", "rsqrt.approx.f32", "div.rn.f32", "cvt.rn.bf16x2.f32",
                     "mul.bf16x2", "shfl.sync.bfly", "red.global.min.s64"),
        ptx_forbidden=("atom.", "red.global.add", "red.shared"),
    ),
    KernelSpec(
        name="norm_modulate_bwd_rows",
        build=build_backward_rows,
        variants=lambda arch: [dict(width=HIDDEN)],
        ptx_markers=("ld.global.v4.b16", "st.global.v2.b32", "rsqrt.approx.f32", "shfl.sync.bfly"),  # 8-byte vectors
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
    KernelSpec(
        name="norm_modulate_bwd_params",
        build=build_backward_params,
        variants=lambda arch: [dict(width=HIDDEN, cap=cap) for cap in TABLE_ROWS_CAPS if cap not in FUSED_CAPS]
        + [dict(width=HIDDEN, cap=MAX_TABLE_ROWS, windowed=True)],
        ptx_markers=("ld.global.v4.b32", "ld.shared.v", "st.shared.v"),  # v4.b32 (sm_90a) or v2.b64 (sm_100a)
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
    KernelSpec(
        name="norm_modulate_bwd_fused",
        build=build_backward_fused,
        variants=lambda arch: [dict(width=HIDDEN, cap=cap, step=step) for cap in FUSED_CAPS for step in FUSED_STEPS],
        # v2.b32: the 8-byte row vectors; st.async + mbarrier: the row sums' exchange; barrier.cluster: start and
        # end; rsqrt.approx: the forward's rstd formula
        ptx_markers=("ld.global.v2.b32", "st.global.v2.b32", "st.async.shared::cluster.mbarrier::complete_tx",
                     "mbarrier.try_wait", "barrier.cluster.arrive", "barrier.cluster.wait", "rsqrt.approx.f32",
                     "cp.async.bulk.prefetch.L2"),
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
]
