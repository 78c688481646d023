"""gate_residual: out = residual + gate[idx] * y, BF16, forward and deterministic backward.

Forward (`gate_residual_fwd`): one 256-thread CTA per row, 16-byte loads of residual, y and the gate row
of idx[row] (a row-strided table view), one 16-byte store. Torch evaluates `gate[idx] * y` as a BF16
tensor (FP32 product rounded once) and then `residual + that` (FP32 sum rounded once); the kernel does
exactly these two roundings, so the output is bitwise the replay's, and each row depends only on itself.

Backward (`gate_residual_bwd`), one pass over the rows in the column-reduction layout of
kernels/rowwise.py: dy = bf16(grad * gate[idx]) (bitwise torch autograd's BF16 mul) is stored per row,
and dgate[r] = sum over rows with idx = r of grad * y is accumulated in FP32 per (row group, table row,
column) in shared memory, written as partials and finished by `rowwise_fold`. d residual is grad itself.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream

from .rowwise import (COL_TILE, ROW_THREADS, TABLE_ROWS_CAPS, UNROLL, VEC, fake_indices, fake_partials, fake_rows,
                      fake_table, guarded_row, load_f32, round_bf16, row_range, row_slots, smem_vec, store_bf16, vec_view)

HIDDEN = 5376


@cute.kernel
def _forward_kernel(mRes: cute.Tensor, mY: cute.Tensor, mGate: cute.Tensor, mIdx: cute.Tensor, mOut: cute.Tensor,
                    width: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    row, _, _ = cute.arch.block_idx()
    num_vecs = width // VEC
    base = Int64(row) * width
    r, poison = guarded_row(Int64(mIdx[row]), mGate.shape[0])
    gate_base = r * mGate.stride[0]
    for k in cutlass.range_constexpr(row_slots(width, ROW_THREADS)):
        vi = tidx + k * ROW_THREADS
        if vi < num_vecs:
            col = vi * VEC
            gated = round_bf16(load_f32(mGate, gate_base + col) * load_f32(mY, base + col))
            store_bf16(mOut, base + col, (load_f32(mRes, base + col) + gated) * poison)


@cute.jit
def _forward_launch(mRes, mY, mGate, mIdx, mOut, stream, width: cutlass.Constexpr):
    _forward_kernel(mRes, mY, mGate, mIdx, mOut, width).launch(
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


@cute.kernel
def _backward_kernel(mG: cute.Tensor, mY: cute.Tensor, mGate: cute.Tensor, mIdx: cute.Tensor, mDy: cute.Tensor,
                     mPartGate: cute.Tensor, width: cutlass.Constexpr, cap: cutlass.Constexpr):
    lane, _, _ = cute.arch.thread_idx()
    tile, group, _ = cute.arch.block_idx()
    smem = cutlass.memory.SmemAllocator()
    sGate = smem.allocate_tensor(Float32, cute.make_layout(cap * COL_TILE), byte_alignment=32)
    col = tile * COL_TILE + lane * VEC
    zero = cute.full((VEC,), 0.0, Float32)
    for r in cutlass.range(cap):
        smem_vec(sGate, r * COL_TILE + lane * VEC).store(zero)
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
def _backward_launch(mG, mY, mGate, mIdx, mDy, mPartGate, stream, width: cutlass.Constexpr, cap: cutlass.Constexpr):
    _backward_kernel(mG, mY, mGate, mIdx, mDy, mPartGate, width, cap).launch(
        grid=(width // COL_TILE, mPartGate.shape[0], 1), block=(32, 1, 1), stream=stream
    )


def _check_width(width):
    if width % COL_TILE:
        raise ValueError(f"gate_residual kernels need a width divisible by {COL_TILE}, got {width}")


def build_forward(arch: str, *, width: int):
    _check_width(width)
    s = cute.sym_int()
    return compile_for(arch, _forward_launch, fake_rows(s, width), fake_rows(s, width), fake_table(width),
                       fake_indices(s), fake_rows(s, width), env_stream(), width)


def build_backward(arch: str, *, width: int, cap: int):
    _check_width(width)
    s, groups, table_rows = cute.sym_int(), cute.sym_int(), cute.sym_int()
    return compile_for(arch, _backward_launch, fake_rows(s, width), fake_rows(s, width),
                       fake_table(width, table_rows), fake_indices(s), fake_rows(s, width),
                       fake_partials(groups, table_rows, width), env_stream(), width, cap)


SPECS = [
    KernelSpec(
        name="gate_residual_fwd",
        build=build_forward,
        variants=lambda arch: [dict(width=HIDDEN)],
        # LLVM narrows bf16(fp32(gate) * fp32(y)) to a native mul.bf16x2: the same rounding (FP32 holds the
        # exact product of two BF16).
        ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "mul.bf16x2", "cvt.rn.bf16x2.f32"),
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
    KernelSpec(
        name="gate_residual_bwd",
        build=build_backward,
        variants=lambda arch: [dict(width=HIDDEN, cap=cap) for cap in TABLE_ROWS_CAPS],
        ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "ld.shared.v", "st.shared.v"),  # 16-byte smem: v4.b32 or v2.b64
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    ),
]
