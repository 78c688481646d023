"""adaln_row_gather: the six (S, H) modulation rows out_c[s] = table[idx[s], c*H:(c+1)*H] of one block.

Forward (`adaln_row_gather_fwd`): grid (S, 6), one 256-thread CTA per (row, chunk) copying H BF16 with
16-byte loads and stores; the CTA's chunk picks one of the six output tensors (a uniform branch). A
pure copy: bitwise equal to `index_select`, and every row depends only on its own idx.

Backward (`adaln_row_gather_bwd`): d_table[r, c*H + j] = sum over rows with idx = r of grad_c[s, j].
One launch for all six chunks, grid (H / 256 column tiles, P row groups, 6 chunks) of one-warp CTAs in the
column-reduction layout of kernels/rowwise.py (the chunk picks its grad tensor, a uniform branch): FP32 per
(row group, table row, column) in shared memory, written into columns [c*H, (c+1)*H) of a (P, R, 6H)
partial buffer; `rowwise_fold` sums the P groups in order and rounds once to BF16. No atomics, no sort.
Bytes in flight: a CTA reads one 512-byte row slice per row (no second operand as in gate_residual), so it
issues GATHER_UNROLL = 16 rows at once, and the six chunks share one grid (about 16 resident warps per SM at
cap 12 instead of the 7 CTAs per SM one chunk's grid gives). Tables beyond MAX_TABLE_ROWS rows take the
windowed variant (kernels/rowwise.py): a CTA loads and adds only the rows whose idx lies in its window.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream
from h3cute.widths import BLOCK_CHUNKS, HIDDEN

from .rowwise import (COL_TILE, MAX_TABLE_ROWS, ROW_THREADS, TABLE_ROWS_CAPS, VEC, check_row, fake_indices,
                      fake_partials, fake_rows, fake_table, load_f32, reduction_block, row_range, row_slots, smem_vec,
                      store_bf16, take_owned, vec_view, window_chunk)

GATHER_UNROLL = 16  # rows whose grad loads a backward step issues before accumulating


@cute.kernel
def _forward_kernel(mTable: cute.Tensor, mIdx: cute.Tensor, mOut0: cute.Tensor, mOut1: cute.Tensor,
                    mOut2: cute.Tensor, mOut3: cute.Tensor, mOut4: cute.Tensor, mOut5: cute.Tensor,
                    err_rows: Int64, err_host: Int64, width: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    row, chunk, _ = cute.arch.block_idx()
    num_vecs = width // VEC
    base = Int64(row) * width
    r = Int64(mIdx[row])
    if (tidx == 0) & (chunk == 0):
        check_row(r, mTable.shape[0], row, err_rows, err_host)
    valid = (r >= 0) & (r < mTable.shape[0])
    outs = (mOut0, mOut1, mOut2, mOut3, mOut4, mOut5)
    for c in cutlass.range_constexpr(BLOCK_CHUNKS):
        if chunk == c:
            for k in cutlass.range_constexpr(row_slots(width, ROW_THREADS)):
                vi = tidx + k * ROW_THREADS
                if vi < num_vecs:
                    col = vi * VEC
                    if valid:
                        src = r * mTable.stride[0] + c * width + col
                        vec_view(outs[c], base + col).store(vec_view(mTable, src).load())
                    else:
                        store_bf16(outs[c], base + col, cute.full((VEC,), float("nan"), Float32))


@cute.jit
def _forward_launch(mTable, mIdx, mOut0, mOut1, mOut2, mOut3, mOut4, mOut5, err_rows: Int64, err_host: Int64, stream,
                    width: cutlass.Constexpr):
    _forward_kernel(mTable, mIdx, mOut0, mOut1, mOut2, mOut3, mOut4, mOut5, err_rows, err_host, width).launch(
        grid=(mIdx.shape[0], BLOCK_CHUNKS, 1), block=(ROW_THREADS, 1, 1), stream=stream
    )


@cute.jit
def _backward_step(mG, mIdx, sAcc, table_rows, first, col, lane, rows: cutlass.Constexpr, width: cutlass.Constexpr):
    """Rows [first, first + rows): all loads issued first, then the accumulations in row order."""
    picks = [Int32(mIdx[first + i]) for i in range(rows)]
    gs = [load_f32(mG, Int64(first + i) * width + col) for i in range(rows)]
    for i in cutlass.range_constexpr(rows):
        if (picks[i] >= 0) & (picks[i] < table_rows):  # rows with an out-of-range index add nothing
            acc = smem_vec(sAcc, picks[i] * COL_TILE + lane * VEC)
            acc.store(acc.load() + gs[i])


@cute.jit
def _backward_rows_windowed(mG, mIdx, sAcc, table_rows, base, chunk, end, col, lane, width: cutlass.Constexpr,
                            cap: cutlass.Constexpr):
    """Rows [chunk, chunk + 32) for the CTA of window [base, base + cap): the rows whose idx lies in the window
    (window_chunk) are loaded GATHER_UNROLL at a time and added in row order."""
    mask, local, _ = window_chunk(mIdx, chunk, end, table_rows, base, cap, lane, False)
    for _ in cutlass.range_constexpr(32 // GATHER_UNROLL):
        taken, mask = take_owned(mask, GATHER_UNROLL)
        locs = [cute.arch.shuffle_sync(local, src) for _, src in taken]
        gs = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(GATHER_UNROLL)]
        for i in cutlass.range_constexpr(GATHER_UNROLL):
            if taken[i][0]:
                gs[i].store(load_f32(mG, Int64(chunk + taken[i][1]) * width + col))
        for i in cutlass.range_constexpr(GATHER_UNROLL):
            if taken[i][0]:
                acc = smem_vec(sAcc, locs[i] * COL_TILE + lane * VEC)
                acc.store(acc.load() + gs[i].load())


@cute.jit
def _backward_chunk(mG, mIdx, mPart, sAcc, group, col, lane, chunk_col, width: cutlass.Constexpr):
    """One chunk's rows of this group into sAcc, then its partials at columns chunk_col + col of mPart."""
    table_rows = mPart.shape[1]
    begin, end = row_range(mG.shape[0], group, mPart.shape[0])
    batched_end = begin + (end - begin) // GATHER_UNROLL * GATHER_UNROLL
    for first in cutlass.range(begin, batched_end, GATHER_UNROLL):
        _backward_step(mG, mIdx, sAcc, table_rows, first, col, lane, GATHER_UNROLL, width)
    for first in cutlass.range(batched_end, end):
        _backward_step(mG, mIdx, sAcc, table_rows, first, col, lane, 1, width)
    for r in cutlass.range(table_rows):
        vec_view(mPart, Int64(group) * mPart.stride[0] + Int64(r) * mPart.stride[1] + chunk_col + col).store(
            smem_vec(sAcc, r * COL_TILE + lane * VEC).load())


@cute.jit
def _backward_chunk_windowed(mG, mIdx, mPart, sAcc, base, group, col, lane, chunk_col, width: cutlass.Constexpr,
                             cap: cutlass.Constexpr):
    """_backward_chunk for the CTA of window [base, base + cap): the partials of that window's table rows."""
    table_rows = mPart.shape[1]
    begin, end = row_range(mG.shape[0], group, mPart.shape[0])
    for chunk in cutlass.range(begin, end, 32):
        _backward_rows_windowed(mG, mIdx, sAcc, table_rows, base, chunk, end, col, lane, width, cap)
    for r in cutlass.range(cutlass.min(Int64(cap), table_rows - base)):
        vec_view(mPart, Int64(group) * mPart.stride[0] + (base + r) * mPart.stride[1] + chunk_col + col).store(
            smem_vec(sAcc, Int32(r) * COL_TILE + lane * VEC).load())


@cute.kernel
def _backward_kernel(mG0: cute.Tensor, mG1: cute.Tensor, mG2: cute.Tensor, mG3: cute.Tensor, mG4: cute.Tensor,
                     mG5: cute.Tensor, mIdx: cute.Tensor, mPart: cute.Tensor, width: cutlass.Constexpr,
                     cap: cutlass.Constexpr, windowed: cutlass.Constexpr):
    lane, _, _ = cute.arch.thread_idx()
    tile, block_y, chunk = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sAcc = smem.allocate_tensor(Float32, cute.make_layout(cap * COL_TILE), byte_alignment=32)
    col = tile * COL_TILE + lane * VEC
    zero = cute.full((VEC,), 0.0, Float32)
    for r in cutlass.range(cap):
        smem_vec(sAcc, r * COL_TILE + lane * VEC).store(zero)
    grads = (mG0, mG1, mG2, mG3, mG4, mG5)
    if cutlass.const_expr(windowed):
        base, group = reduction_block(block_y, mPart.shape[0], cap, True)
        for c in cutlass.range_constexpr(BLOCK_CHUNKS):
            if chunk == c:
                _backward_chunk_windowed(grads[c], mIdx, mPart, sAcc, base, group, col, lane, c * width, width, cap)
    else:
        for c in cutlass.range_constexpr(BLOCK_CHUNKS):
            if chunk == c:
                _backward_chunk(grads[c], mIdx, mPart, sAcc, block_y, col, lane, c * width, width)


@cute.jit
def _backward_launch(mG0, mG1, mG2, mG3, mG4, mG5, mIdx, mPart, stream, width: cutlass.Constexpr,
                     cap: cutlass.Constexpr, windowed: cutlass.Constexpr):
    blocks_y = mPart.shape[0]
    if cutlass.const_expr(windowed):
        blocks_y = (mPart.shape[1] + cap - 1) // cap * mPart.shape[0]
    _backward_kernel(mG0, mG1, mG2, mG3, mG4, mG5, mIdx, mPart, width, cap, windowed).launch(
        grid=(width // COL_TILE, blocks_y, BLOCK_CHUNKS), block=(32, 1, 1), stream=stream
    )


def _check_width(width):
    if width % COL_TILE:
        raise ValueError(f"adaln_row_gather kernels need a chunk width divisible by {COL_TILE}, got {width}")


def build_forward(arch: str, *, width: int):
    _check_width(width)
    s = cute.sym_int()
    outs = [fake_rows(s, width) for _ in range(BLOCK_CHUNKS)]
    return compile_for(arch, _forward_launch, fake_table(BLOCK_CHUNKS * width), fake_indices(s), *outs, Int64(0),
                       Int64(0), env_stream(), width)


def build_backward(arch: str, *, width: int, cap: int, windowed: bool = False):
    _check_width(width)
    s, groups, table_rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    grads = [fake_rows(s, width) for _ in range(BLOCK_CHUNKS)]
    return compile_for(arch, _backward_launch, *grads, fake_indices(s),
                       fake_partials(groups, table_rows, BLOCK_CHUNKS * width), env_stream(), width, cap, windowed)


SPECS = [
    KernelSpec(
        name="adaln_row_gather_fwd",
        build=build_forward,
        variants=lambda arch: [dict(width=HIDDEN)],
        ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "red.global.min.s64"),
        ptx_forbidden=("atom.", "red.global.add", "red.shared"),
    ),
    KernelSpec(
        name="adaln_row_gather_bwd",
        build=build_backward,
        variants=lambda arch: [dict(width=HIDDEN, cap=cap) for cap in TABLE_ROWS_CAPS]
        + [dict(width=HIDDEN, cap=MAX_TABLE_ROWS, windowed=True)],
        ptx_markers=("ld.global.v4.b32", "ld.shared.v", "st.shared.v"),  # v4.b32 (sm_90a) or v2.b64 (sm_100a)
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
]
