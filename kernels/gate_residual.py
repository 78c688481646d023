"""gate_residual: out = residual + gate[idx] * y, BF16, forward and deterministic backward.

Forward (`gate_residual_fwd`): one 256-thread CTA per row, 16-byte loads of residual, y and the gate row
of idx[row] (a row-strided table view), one 16-byte store. Torch evaluates `gate[idx] * y` as a BF16
tensor (FP32 product rounded once) and then `residual + that` (FP32 sum rounded once); the kernel does
exactly these two roundings, so the output is bitwise the replay's, and each row depends only on itself.

Backward (`gate_residual_bwd`), one pass over the rows in the column-reduction layout of
kernels/rowwise.py: dy = bf16(grad * gate[idx]) (bitwise torch autograd's BF16 mul) is stored per row,
and dgate[r] = sum over rows with idx = r of grad * y is accumulated in FP32 per (row group, table row,
column) in shared memory, written as partials and finished by `rowwise_fold`. d residual is grad itself.
Tables beyond MAX_TABLE_ROWS rows take the windowed variant (kernels/rowwise.py): a row is loaded, its dy
stored and its product added by the CTA of its idx's window (rows with a bad idx by window 0, dy NaN).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream
from h3cute.widths import HIDDEN

from .rowwise import (COL_TILE, MAX_TABLE_ROWS, ROW_THREADS, TABLE_ROWS_CAPS, UNROLL, VEC, checked_row,
                      fake_indices, fake_partials, fake_rows, fake_table, guarded_row, load_f32, reduction_block,
                      round_bf16, row_range, row_slots, smem_vec, store_bf16, take_owned, vec_view, window_chunk)



@cute.kernel
def _forward_kernel(mRes: cute.Tensor, mY: cute.Tensor, mGate: cute.Tensor, mIdx: cute.Tensor, mOut: cute.Tensor,
                    err_rows: Int64, err_host: Int64, width: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    num_vecs = width // VEC
    base = Int64(row) * width
    r, poison = checked_row(mIdx, row, mGate.shape[0], tidx, err_rows, err_host)
    gate_base = r * mGate.stride[0]
    for k in cutlass.range_constexpr(row_slots(width, ROW_THREADS)):
        vi = tidx + k * ROW_THREADS
        if vi < num_vecs:
            col = vi * VEC
            gated = round_bf16(load_f32(mGate, gate_base + col) * load_f32(mY, base + col))
            store_bf16(mOut, base + col, (load_f32(mRes, base + col) + gated) * poison)


@cute.jit
def _forward_launch(mRes, mY, mGate, mIdx, mOut, err_rows: Int64, err_host: Int64, stream, width: cutlass.Constexpr):
    _forward_kernel(mRes, mY, mGate, mIdx, mOut, err_rows, err_host, width).launch(
        grid=(mY.shape[0], 1, 1), block=(ROW_THREADS, 1, 1), stream=stream
    )


@cute.jit
def _backward_step(mG, mY, mGate, mIdx, mDy, sGate, first, col, lane, rows: cutlass.Constexpr,
                   width: cutlass.Constexpr):
    """Rows [first, first + rows): all loads issued first, then dy stores and accumulations in row order."""
    picks = [guarded_row(Int64(mIdx[first + i]), mGate.shape[0]) for i in range(rows)]
    offs = [Int64(first + i) * width + col for i in range(rows)]
    gs = [load_f32(mG, offs[i]) for i in range(rows)]
    ys = [load_f32(mY, offs[i]) for i in range(rows)]
    gates = [load_f32(mGate, picks[i][0] * mGate.stride[0] + col) for i in range(rows)]
    for i in cutlass.range_constexpr(rows):
        store_bf16(mDy, offs[i], gs[i] * gates[i] * picks[i][1])
        if picks[i][1] == 1.0:  # rows with an out-of-range index add nothing
            acc = smem_vec(sGate, Int32(picks[i][0]) * COL_TILE + lane * VEC)
            acc.store(acc.load() + gs[i] * ys[i])


@cute.jit
def _backward_chunk_windowed(mG, mY, mGate, mIdx, mDy, sGate, base, chunk, end, col, lane,
                             width: cutlass.Constexpr, cap: cutlass.Constexpr):
    """Rows [chunk, chunk + 32) for the CTA of window [base, base + cap): the rows it takes (window_chunk; a bad
    idx in window 0) are loaded UNROLL at a time, get their dy and, inside the window, add their products."""
    table_rows = mGate.shape[0]
    mask, local, inside = window_chunk(mIdx, chunk, end, table_rows, base, cap, lane, True)
    for _ in cutlass.range_constexpr(32 // UNROLL):
        taken, mask = take_owned(mask, UNROLL)
        locs = [cute.arch.shuffle_sync(local, src) for _, src in taken]
        ins = [cute.arch.shuffle_sync(Int32(inside), src) != 0 for _, src in taken]
        offs = [Int64(chunk + src) * width + col for _, src in taken]
        gs = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(UNROLL)]
        ys = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(UNROLL)]
        gates = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(UNROLL)]
        for i in cutlass.range_constexpr(UNROLL):
            if taken[i][0]:
                gate_row = cutlass.select_(ins[i], base + locs[i], Int64(0))  # a bad idx reads row 0
                gs[i].store(load_f32(mG, offs[i]))
                ys[i].store(load_f32(mY, offs[i]))
                gates[i].store(load_f32(mGate, gate_row * mGate.stride[0] + col))
        for i in cutlass.range_constexpr(UNROLL):
            if taken[i][0]:
                poison = cutlass.select_(ins[i], Float32(1.0), Float32(float("nan")))
                store_bf16(mDy, offs[i], gs[i].load() * gates[i].load() * poison)
                if ins[i]:
                    acc = smem_vec(sGate, locs[i] * COL_TILE + lane * VEC)
                    acc.store(acc.load() + gs[i].load() * ys[i].load())


@cute.kernel
def _backward_kernel(mG: cute.Tensor, mY: cute.Tensor, mGate: cute.Tensor, mIdx: cute.Tensor, mDy: cute.Tensor,
                     mPartGate: cute.Tensor, width: cutlass.Constexpr, cap: cutlass.Constexpr,
                     windowed: cutlass.Constexpr):
    lane, _, _ = cute.arch.thread_idx()
    tile, block_y, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sGate = smem.allocate_tensor(Float32, cute.make_layout(cap * COL_TILE), byte_alignment=32)
    col = tile * COL_TILE + lane * VEC
    zero = cute.full((VEC,), 0.0, Float32)
    for r in cutlass.range(cap):
        smem_vec(sGate, r * COL_TILE + lane * VEC).store(zero)
    if cutlass.const_expr(windowed):
        base, group = reduction_block(block_y, mPartGate.shape[0], cap, True)
        begin, end = row_range(mY.shape[0], group, mPartGate.shape[0])
        for chunk in cutlass.range(begin, end, 32):
            _backward_chunk_windowed(mG, mY, mGate, mIdx, mDy, sGate, base, chunk, end, col, lane, width, cap)
        for r in cutlass.range(cutlass.min(Int64(cap), mGate.shape[0] - base)):
            vec_view(mPartGate, Int64(group) * mPartGate.stride[0] + (base + r) * mPartGate.stride[1] + col).store(
                smem_vec(sGate, Int32(r) * COL_TILE + lane * VEC).load())
    else:
        group = block_y
        begin, end = row_range(mY.shape[0], group, mPartGate.shape[0])
        batched_end = begin + (end - begin) // UNROLL * UNROLL
        for first in cutlass.range(begin, batched_end, UNROLL):
            _backward_step(mG, mY, mGate, mIdx, mDy, sGate, first, col, lane, UNROLL, width)
        for first in cutlass.range(batched_end, end):
            _backward_step(mG, mY, mGate, mIdx, mDy, sGate, first, col, lane, 1, width)
        for r in cutlass.range(mGate.shape[0]):
            vec_view(mPartGate, Int64(group) * mPartGate.stride[0] + Int64(r) * mPartGate.stride[1] + col).store(
                smem_vec(sGate, r * COL_TILE + lane * VEC).load())


@cute.jit
def _backward_launch(mG, mY, mGate, mIdx, mDy, mPartGate, stream, width: cutlass.Constexpr, cap: cutlass.Constexpr,
                     windowed: cutlass.Constexpr):
    blocks_y = mPartGate.shape[0]
    if cutlass.const_expr(windowed):
        blocks_y = (mGate.shape[0] + cap - 1) // cap * mPartGate.shape[0]
    _backward_kernel(mG, mY, mGate, mIdx, mDy, mPartGate, width, cap, windowed).launch(
        grid=(width // COL_TILE, blocks_y, 1), block=(32, 1, 1), stream=stream
    )


def _check_width(width):
    if width % COL_TILE:
        raise ValueError(f"gate_residual kernels need a width divisible by {COL_TILE}, got {width}")


def build_forward(arch: str, *, width: int):
    _check_width(width)
    s = cute.sym_int()
    return compile_for(arch, _forward_launch, fake_rows(s, width), fake_rows(s, width), fake_table(width),
                       fake_indices(s), fake_rows(s, width), Int64(0), Int64(0), env_stream(), width)


def build_backward(arch: str, *, width: int, cap: int, windowed: bool = False):
    _check_width(width)
    s, groups, table_rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    return compile_for(arch, _backward_launch, fake_rows(s, width), fake_rows(s, width),
                       fake_table(width, table_rows), fake_indices(s), fake_rows(s, width),
                       fake_partials(groups, table_rows, width), env_stream(), width, cap, windowed)


SPECS = [
    KernelSpec(
        name="gate_residual_fwd",
        build=build_forward,
        variants=lambda arch: [dict(width=HIDDEN)],
        # LLVM narrows bf16(fp32(gate) * fp32(y)) to a native mul.bf16x2: the same rounding (FP32 holds the
        # exact product of two BF16).
        ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "mul.bf16x2", "cvt.rn.bf16x2.f32", "red.global.min.s64"),
        ptx_forbidden=("atom.", "red.global.add", "red.shared"),
    ),
    KernelSpec(
        name="gate_residual_bwd",
        build=build_backward,
        variants=lambda arch: [dict(width=HIDDEN, cap=cap) for cap in TABLE_ROWS_CAPS]
        + [dict(width=HIDDEN, cap=MAX_TABLE_ROWS, windowed=True)],
        # 16-byte shared memory accesses: v4.b32 or v2.b64
        ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "ld.shared.v", "st.shared.v"),
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
]
