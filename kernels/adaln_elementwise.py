"""The AdaLN projection's elementwise kernels: the GEMM operand a = bf16(silu(temb)), d_temb's fold of the d_temb
GEMM's FP32 partials, and db = sum_t grad[t] in the db order.

| kernel | does |
| --- | --- |
| adaln_silu_cast | act = bf16(silu(temb)), torch's x / (1 + exp(-x)) with one IEEE division |
| adaln_dtemb_fold | d_temb = (the `DGRAD_SPLITS` partials summed in split order) * silu'(temb); act again |
| adaln_bias_grad | db = bf16(sum_t grad[t]): FP32 sums of `DBIAS_ROW_BLOCK`-row blocks, folded in block order |

`dtemb_scale` and `fold_dbias_blocks` are shared with the persistent dW kernel's side warps
(kernels/adaln_gemm_side_warps.py, `adaln_proj_wgrad_fold`), so its d_temb and db have these kernels' bits.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream
from h3cute.widths import TEMB

from .adaln_gemm_base import DBIAS_CHAIN_ROWS, DBIAS_ROW_BLOCK, DGRAD_SPLITS, NO_ATOMICS, OUT_FEATURES, fake_tensor
from .rowwise import vec_view

_EW_THREADS = 128


@cute.jit
def _sigmoid(x):
    # libdevice expf (fastmath off), as torch's CUDA SiLU uses; d_temb is held to 1e-5 relative error.
    return cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(-x, fastmath=False))


@cute.jit
def _silu(x):
    # torch's form, x / (1 + exp(-x)), one IEEE division.
    return x / (cutlass.Float32(1.0) + cute.math.exp(-x, fastmath=False))


@cute.jit
def dtemb_scale(d_act, x):
    """d_temb from d_act = d(loss)/d(silu(temb)) (FP32, the BF16 cast passes it through): d_act * silu'(x)."""
    sig = _sigmoid(x)
    return d_act * (sig + x * sig * (cutlass.Float32(1.0) - sig))


_SILU_COLS = 8  # columns per thread: two 16-byte FP32 loads, one 16-byte BF16 store
_SILU_ROW_VECTORS = TEMB // _SILU_COLS  # 336


@cute.kernel
def _silu_cast_kernel(temb: cute.Tensor, act: cute.Tensor):
    # One thread per 8 columns of the flattened (T, 2688) tensors (rows are 8-aligned): one column per thread
    # would run 43008 CTAs of 128 at T = 2048.
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    v = bidx * _EW_THREADS + tidx
    if v < cute.size(temb, mode=[0]) * _SILU_ROW_VECTORS:
        x = vec_view(temb, cutlass.Int64(v) * _SILU_COLS).load()
        vec_view(act, cutlass.Int64(v) * _SILU_COLS).store(_silu(x).to(cutlass.BFloat16))


def _build_silu_cast(arch: str, *, width: int):
    assert width == TEMB and width % _SILU_COLS == 0

    @cute.jit
    def adaln_silu_cast(temb: cute.Tensor, act: cute.Tensor, stream):
        """act = bf16(silu(temb)), SiLU in FP32 then one rounding (the GEMM's A operand). temb and act
        contiguous and 16-byte aligned (the launchers make sure)."""
        grid = (cute.ceil_div(cute.size(temb, mode=[0]) * _SILU_ROW_VECTORS, _EW_THREADS), 1, 1)
        _silu_cast_kernel(temb, act).launch(grid=grid, block=[_EW_THREADS, 1, 1], stream=stream)

    rows = cute.sym_int()
    return compile_for(
        arch,
        adaln_silu_cast,
        fake_tensor(cutlass.Float32, (rows, width), (1, 0)),
        fake_tensor(cutlass.BFloat16, (rows, width), (1, 0)),
        env_stream(),
    )


@cute.kernel
def _dtemb_fold_kernel(partial: cute.Tensor, temb: cute.Tensor, dtemb: cute.Tensor, act: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    col_block, row, _ = cute.arch.block_idx()
    col = col_block * _EW_THREADS + tidx
    if col < TEMB:
        d_act = cutlass.Float32(0.0)
        for s in cutlass.range_constexpr(DGRAD_SPLITS):  # fixed split order
            d_act = d_act + partial[s, row, col]
        x = temb[row, col]
        dtemb[row, col] = dtemb_scale(d_act, x)
        act[row, col] = _silu(x).to(cutlass.BFloat16)  # adaln_silu_cast's expression: the same bits


def _build_dtemb_fold(arch: str, *, width: int):
    assert width == TEMB

    @cute.jit
    def adaln_dtemb_fold(partial: cute.Tensor, temb: cute.Tensor, dtemb: cute.Tensor, act: cute.Tensor, stream):
        """dtemb = (sum over splits of the FP32 d_act partials, in split order) * silu'(temb), and the dW
        GEMM's operand act = bf16(silu(temb)) while temb is in registers (no second silu_cast launch)."""
        grid = (cute.ceil_div(width, _EW_THREADS), cute.size(temb, mode=[0]), 1)
        _dtemb_fold_kernel(partial, temb, dtemb, act).launch(grid=grid, block=[_EW_THREADS, 1, 1], stream=stream)

    rows = cute.sym_int()
    return compile_for(
        arch,
        adaln_dtemb_fold,
        fake_tensor(cutlass.Float32, (DGRAD_SPLITS, rows, width), (2, 1, 0)),
        fake_tensor(cutlass.Float32, (rows, width), (1, 0)),
        fake_tensor(cutlass.Float32, (rows, width), (1, 0)),
        fake_tensor(cutlass.BFloat16, (rows, width), (1, 0)),
        env_stream(),
    )


_BIAS_COLS_PER_THREAD = 8  # one 16-byte BF16 vector per row: enough bytes in flight at T = 2048


@cute.kernel
def _bias_grad_partial_kernel(grad: cute.Tensor, partial: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, block, _ = cute.arch.block_idx()
    col0 = (bidx * _EW_THREADS + tidx) * _BIAS_COLS_PER_THREAD
    if col0 < cute.size(partial, mode=[1]):
        # Block b of nb holds rows [T - 64 (nb - b), T - 64 (nb - 1 - b)), block 0 cut at row 0; its chains are
        # summed side by side (four independent chains of loads and adds), then added in order.
        first = cute.size(grad, mode=[0]) - DBIAS_ROW_BLOCK * (cute.size(partial, mode=[0]) - block)
        vec_view(partial, cutlass.Int64(block) * partial.stride[0] + col0).store(
            _dbias_block_sum(grad, first, col0))


@cute.jit
def _dbias_block_sum(grad: cute.Tensor, first, col0):
    """db's sum of the DBIAS_ROW_BLOCK rows of grad from `first` (rows before 0 skipped), 8 columns from col0: four
    chains of DBIAS_CHAIN_ROWS rows, each from +0 in ascending rows, summed side by side (independent loads and
    adds), added in chain order."""
    chains = [cute.make_rmem_tensor(cute.make_layout(_BIAS_COLS_PER_THREAD), cutlass.Float32)
              for _ in range(DBIAS_ROW_BLOCK // DBIAS_CHAIN_ROWS)]
    for acc in chains:
        acc.fill(0.0)
    for i in cutlass.range(DBIAS_CHAIN_ROWS, unroll=2):  # ascending rows in every chain
        for c, acc in enumerate(chains):
            r = first + c * DBIAS_CHAIN_ROWS + i
            if r >= 0:
                acc.store(acc.load()
                          + vec_view(grad, cutlass.Int64(r) * grad.stride[0] + col0).load().to(cutlass.Float32))
    total = chains[0].load()
    for acc in chains[1:]:
        total = total + acc.load()
    return total


@cute.kernel
def _bias_grad_fold_kernel(partial: cute.Tensor, dbias: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    col = bidx * _EW_THREADS + tidx
    if col < cute.size(dbias):
        acc = cutlass.Float32(0.0)
        for b in range(cute.size(partial, mode=[0])):  # block order
            acc = acc + partial[b, col]
        dbias[col] = acc.to(cutlass.BFloat16)


@cute.jit
def fold_dbias_blocks(partial: cute.Tensor, dbias: cute.Tensor, out_features: cutlass.Constexpr, stream):
    """dbias = bf16 of the FP32 block sums `partial` (blocks, N) added from +0 in block order: adaln_bias_grad's
    second launch, and the one after the fold-warp dW kernel, whose db warps write the block sums."""
    _bias_grad_fold_kernel(partial, dbias).launch(grid=(cute.ceil_div(out_features, _EW_THREADS), 1, 1),
                                                  block=[_EW_THREADS, 1, 1], stream=stream)


def _build_bias_grad(arch: str, *, out_features: int):
    assert out_features % _BIAS_COLS_PER_THREAD == 0

    @cute.jit
    def adaln_bias_grad(grad: cute.Tensor, partial: cute.Tensor, dbias: cute.Tensor, stream):
        """dbias = bf16(sum_t grad[t]) in the db order (DBIAS_ROW_BLOCK): FP32 block sums (partial, one row per
        block: launch.adaln_projection.dbias_blocks(T)), folded in block order."""
        grid = (cute.ceil_div(out_features, _EW_THREADS * _BIAS_COLS_PER_THREAD), cute.size(partial, mode=[0]), 1)
        _bias_grad_partial_kernel(grad, partial).launch(grid=grid, block=[_EW_THREADS, 1, 1], stream=stream)
        fold_dbias_blocks(partial, dbias, out_features, stream)

    rows, blocks = cute.sym_int(), cute.sym_int()
    return compile_for(
        arch,
        adaln_bias_grad,
        fake_tensor(cutlass.BFloat16, (rows, out_features), (1, 0)),
        fake_tensor(cutlass.Float32, (blocks, out_features), (1, 0)),
        fake_tensor(cutlass.BFloat16, (out_features,)),
        env_stream(),
    )


SPECS = [
    KernelSpec(
        name="adaln_silu_cast",
        build=_build_silu_cast,
        variants=lambda arch: [dict(width=TEMB)],
        ptx_markers=("cvt.rn.bf16x2.f32", "ld.global.v4", "st.global.v4", "div.rn.f32"),
        ptx_forbidden=NO_ATOMICS,
    ),
    KernelSpec(
        name="adaln_dtemb_fold",
        build=_build_dtemb_fold,
        variants=lambda arch: [dict(width=TEMB)],
        ptx_forbidden=NO_ATOMICS,
    ),
    KernelSpec(
        name="adaln_bias_grad",
        build=_build_bias_grad,
        variants=lambda arch: [dict(out_features=n) for n in OUT_FEATURES],
        ptx_forbidden=NO_ATOMICS,
    ),
]
