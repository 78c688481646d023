"""swiglu: out = a * silu(g) of rows x = [a | g] (R, 2F) BF16 (diffusers' SwiGLU after its projection), and its
backward. The model scope's FFN activation (h3::swiglu), one pass over the rows each way.

Forward (`swiglu_fwd`): each thread one 16-byte vector of a row's F outputs, from one vector of a and one of g,
with eager torch's two roundings: s = bf16(g / (1 + exp(-g))) (torch's silu kernel: FP32, CUDA's expf, an
IEEE division), out = bf16(a * s) (torch's BF16 mul).
Backward (`swiglu_bwd`): eager autograd's graph of that expression, its roundings included:
da = bf16(grad * s) (mul's backward against the saved BF16 silu), dy = bf16(grad * a), and torch's silu_backward
kernel dg = bf16(dy * sig * (1 + g (1 - sig))), sig = 1 / (1 + exp(-g)).
Every element depends on its own inputs only: no reduction, nothing depends on the row count.

Rows may be strided (a view of a larger tensor) with a 16-byte aligned row stride; F % 8 == 0. Grid: (rows, column
blocks of COLUMN_THREADS vectors), so the row count is bounded only by grid.x (2^31 - 1).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int64
from cutlass.cute.runtime import make_fake_tensor

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream

from .rowwise import VEC, load_f32, round_bf16, store_bf16

COLUMN_THREADS = 128  # vectors (of 8 BF16 outputs) per CTA


@cute.jit
def _silu(g):
    """torch's silu of an FP32 vector, rounded to BF16 and widened back."""
    return round_bf16(g / (1.0 + cute.math.exp(-g)))


@cute.jit
def _row_column():
    """(row, first output column) of this thread's 8-vector: one CTA per (row, block of COLUMN_THREADS vectors)."""
    tidx, _, _ = cute.arch.thread_idx()
    row, block, _ = cute.arch.block_idx()
    return row, (block * COLUMN_THREADS + tidx) * VEC


@cute.kernel
def _forward_kernel(mX: cute.Tensor, mOut: cute.Tensor):
    width = mOut.shape[1]
    row, col = _row_column()
    if col < width:
        x_base = Int64(row) * mX.stride[0]
        a = load_f32(mX, x_base + col)
        s = _silu(load_f32(mX, x_base + width + col))
        store_bf16(mOut, Int64(row) * mOut.stride[0] + col, a * s)


@cute.kernel
def _backward_kernel(mGrad: cute.Tensor, mX: cute.Tensor, mDx: cute.Tensor):
    width = mGrad.shape[1]
    row, col = _row_column()
    if col < width:
        x_base = Int64(row) * mX.stride[0]
        dx_base = Int64(row) * mDx.stride[0]
        grad = load_f32(mGrad, Int64(row) * mGrad.stride[0] + col)
        a = load_f32(mX, x_base + col)
        g = load_f32(mX, x_base + width + col)
        sig = 1.0 / (1.0 + cute.math.exp(-g))
        s = _silu(g)
        dy = round_bf16(grad * a)
        store_bf16(mDx, dx_base + col, grad * s)
        # nvcc contracts torch's `1 + x * (1 - sig)` into one fma
        gain = cute.make_rmem_tensor((VEC,), Float32)
        one_minus = 1.0 - sig
        for i in cutlass.range_constexpr(VEC):
            gain[i] = cute.math.fma(g[i], one_minus[i], Float32(1.0))
        store_bf16(mDx, dx_base + width + col, dy * sig * gain.load())


def _grid(rows, width):
    return (rows, (width // VEC + COLUMN_THREADS - 1) // COLUMN_THREADS, 1)


@cute.jit
def _forward_launch(mX: cute.Tensor, mOut: cute.Tensor, stream):
    _forward_kernel(mX, mOut).launch(grid=_grid(mOut.shape[0], mOut.shape[1]), block=(COLUMN_THREADS, 1, 1),
                                     stream=stream)


@cute.jit
def _backward_launch(mGrad: cute.Tensor, mX: cute.Tensor, mDx: cute.Tensor, stream):
    _backward_kernel(mGrad, mX, mDx).launch(grid=_grid(mGrad.shape[0], mGrad.shape[1]),
                                            block=(COLUMN_THREADS, 1, 1), stream=stream)


def _fake_rows(rows, width):
    """(rows, width) BF16, any 16-byte aligned row stride, width a multiple of 8."""
    return make_fake_tensor(BFloat16, (rows, width), (cute.sym_int(divisibility=VEC), 1), assumed_align=16)


def build_forward(arch: str):
    rows, width = cute.sym_int(), cute.sym_int(divisibility=VEC)
    return compile_for(arch, _forward_launch, _fake_rows(rows, cute.sym_int(divisibility=VEC)),
                       _fake_rows(rows, width), env_stream())


def build_backward(arch: str):
    rows, width = cute.sym_int(), cute.sym_int(divisibility=VEC)
    x, dx = (_fake_rows(rows, cute.sym_int(divisibility=VEC)) for _ in range(2))
    return compile_for(arch, _backward_launch, _fake_rows(rows, width), x, dx, env_stream())


_ELEMENTWISE_PTX = ("ld.global.v4.b32", "st.global.v4.b32", "div.rn.f32", "ex2.approx")

SPECS = [
    KernelSpec(name="swiglu_fwd", build=build_forward, variants=lambda arch: [dict()],
               ptx_markers=_ELEMENTWISE_PTX, ptx_forbidden=("atom.", "red.global", "div.approx", "div.full")),
    KernelSpec(name="swiglu_bwd", build=build_backward, variants=lambda arch: [dict()],
               ptx_markers=_ELEMENTWISE_PTX + ("fma.rn.f32",),
               ptx_forbidden=("atom.", "red.global", "div.approx", "div.full")),
]
