"""The shared base of the AdaLN projection GEMM family (kernels/adaln_gemm.py): the contract constants, what every
kernel of the family does the same way (problem geometry, the output tiles and their epilogue, db in the first N
tile's CTAs at small T, the entry name), and what every wgmma kernel sets up the same way (the tiled MMA, the operand
layouts, stmatrix into a TMA-stored C tile, d_temb's k blocks). No mainloop lives here: each sibling class runs its
own (kernels/adaln_gemm_cp_async.py, kernels/adaln_gemm_tma.py, kernels/adaln_gemm_persistent.py).

C = epilogue(A B^T) with A (M, K) and B (N, K): `a_k_major` / `b_k_major` say which of each operand's modes is
contiguous. `epilogue` is "bias_bf16" (C = bf16(acc + bias[m])), "f32" (C = acc) or "bf16" (C = bf16(acc)).
`ieee_steps` (d_temb): the tensor core's truncating accumulation never spans more than one step (a k16 MMA on the
warp MMA, a DGRAD_K_BLOCK block of K on wgmma); the steps are added to acc with IEEE FP32 adds in ascending K.
`k_splits` > 1 makes grid z walk fixed, equal chunks of the K tiles (C then has a split mode). `c_n_major` says
which of C's modes is contiguous. `dbias_rows`: the dW GEMM's bias gradient rides along: when K = T <=
FUSED_DBIAS_ROWS, the CTAs of the first N tile also write mBias[m] = bf16(sum_k A[m, k]) (`_store_dbias`); else
mBias is untouched (a persistent kernel with db warps writes it at every T: kernels/adaln_gemm_side_warps.py).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from h3cute.runtime.dsl import make_fake_compact_tensor
from h3cute.widths import BLOCK_PROJECTION, FINAL_PROJECTION

# the contract constants the launcher shares: d_temb's fixed K chunks, db's row blocks and chains, where dW writes db
from ._adaln_configs import (DBIAS_CHAIN_ROWS, DBIAS_ROW_BLOCK, DGRAD_SPLITS, FUSED_DBIAS_ROWS,  # noqa: F401
                             GemmTile)

OUT_FEATURES = (BLOCK_PROJECTION, FINAL_PROJECTION)  # the block table per call, the final AdaLN's shift | scale
# d_temb on the wgmma family: within a split, every DGRAD_K_BLOCK-deep block of K is summed from zero by the
# tensor core (4 chained k16 wgmmas) and added to the FP32 accumulator with IEEE adds in ascending block order.
# A contract constant (bits depend on it), not a config field: every wgmma config's bk is a multiple of it.
DGRAD_K_BLOCK = 64
COPY_BITS = 128  # every cp.async and C vector copy moves 16 bytes
NO_ATOMICS = ("atom.", "\tred.")  # deterministic: no atomics anywhere


def fake_tensor(dtype, shape, stride_order=None):
    """A compile-time stand-in for a 16-byte aligned, contiguous torch tensor argument."""
    return make_fake_compact_tensor(dtype, shape, stride_order=stride_order, assumed_align=16)


class AdalnGemm:
    """What every kernel of the family shares: its problem (tile, operand majors, epilogue, K splits, d_temb's IEEE
    steps, C's major mode, db at small T), its output tiles and their epilogue (FP32 straight from registers, or
    BF16 staged through shared memory and stored as 16-byte vectors along C's contiguous mode: the MMA fragment's
    own 2-byte stores would scatter every warp store over 8 rows, and dW and the T = 2048 table are 520 / 396 MB),
    the (N tiles, M tiles, K splits) grid, and the entry name.

    The entry name: the CuTe DSL names a kernel method's PTX entry after the method and `str(self)`. Each concrete
    class sets `_ENTRY_STEM`, the stem its kernels are named with (the family's historical names), so where a class
    lives or what it is called never changes a variant's PTX (`python -m h3cute ptx-digest`)."""

    n_halves = 1  # the C tile's N halves: 2 only for d_temb on the 256-wide TMA tile (`TmaWgmmaGemm`)
    _ENTRY_STEM = ""

    def __init__(self, tile: GemmTile, a_k_major: bool, b_k_major: bool, epilogue: str, k_splits: int = 1,
                 ieee_steps: bool = False, c_n_major: bool = False, dbias_rows: bool = False):
        assert epilogue in ("bias_bf16", "f32", "bf16"), epilogue
        self.dbias_rows = dbias_rows
        self.ieee_steps = ieee_steps
        self.c_n_major = c_n_major
        self.tile = tile
        self.a_k_major = a_k_major
        self.b_k_major = b_k_major
        self.epilogue = epilogue
        self.k_splits = k_splits
        self.cta_tiler = (tile.bm, tile.bn, tile.bk)

    def __str__(self) -> str:
        assert self._entry_stem, type(self)
        return self._entry_stem

    @property
    def _entry_stem(self) -> str:
        return self._ENTRY_STEM

    def _c_staging_layout(self):
        """(bm, bn) BF16 smem tile, contiguous along C's contiguous mode, padded by 16 bytes per line so
        the fragment writes (8 lines x 4 threads per warp store) hit distinct banks."""
        t = self.tile
        if self.c_n_major:
            return cute.make_layout((t.bm, t.bn), stride=(t.bn + 8, 1))
        return cute.make_layout((t.bm, t.bn), stride=(1, t.bm + 8))

    def _c_copy(self):
        """16-byte smem->gmem tiled copy of the C tile, thread order along C's contiguous mode."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=COPY_BITS)
        vec = COPY_BITS // 16
        t = self.tile
        if self.c_n_major:
            along = t.bn // vec
            assert t.threads % along == 0 and t.bm % (t.threads // along) == 0, t
            thr = cute.make_layout((t.threads // along, along), stride=(along, 1))
            val = cute.make_layout((1, vec))
        else:
            along = t.bm // vec
            assert t.threads % along == 0 and t.bn % (t.threads // along) == 0, t
            thr = cute.make_layout((along, t.threads // along), stride=(1, along))
            val = cute.make_layout((vec, 1))
        return cute.make_tiled_copy_tv(atom, thr, val)

    def _epilogue_barrier(self):
        """Barrier of the threads that run the epilogue: here every thread of the CTA."""
        cute.arch.sync_threads()

    @cute.jit
    def _store_c_bf16(self, acc: cute.Tensor, thr_mma, tidx, sC: cute.Tensor, gC: cute.Tensor, cC: cute.Tensor,
                      c_shape, mBias: cute.Tensor):
        """BF16 epilogue: fragments (+ bias in FP32, one rounding) -> padded smem -> 16-byte stores,
        one bounds check per vector (vectors run along M or N, whose extents are multiples of 8)."""
        tCsC = thr_mma.partition_C(sC)
        tCcC = thr_mma.partition_C(cC)
        self._epilogue_barrier()  # every warp is done reading the A/B stages the C tile may reuse
        for i in cutlass.range(cute.size(acc), unroll_full=True):
            if cutlass.const_expr(self.epilogue == "bias_bf16"):
                tCsC[i] = (acc[i] + mBias[tCcC[i][0]].to(cutlass.Float32)).to(cutlass.BFloat16)
            else:
                tCsC[i] = acc[i].to(cutlass.BFloat16)
        self._epilogue_barrier()
        c_copy = self._c_copy()
        thr_c = c_copy.get_slice(tidx)
        tSsC = thr_c.partition_S(sC)
        tSgC = thr_c.partition_D(gC)
        tScC = thr_c.partition_D(cC)
        tSrC = cute.make_rmem_tensor_like(tSsC)
        cute.autovec_copy(tSsC, tSrC)
        for m in cutlass.range_constexpr(cute.size(tSgC, mode=[1])):
            for n in cutlass.range_constexpr(cute.size(tSgC, mode=[2])):
                if cute.elem_less(tScC[None, m, n][0], c_shape):
                    cute.copy(c_copy, tSrC[None, m, n], tSgC[None, m, n])

    @cute.jit
    def _store_dbias(self, mA: cute.Tensor, mDbias: cute.Tensor, n_tile, m_tile, tidx):
        """db[m] = bf16(sum_t grad^T[m, t]) by one thread per row m of the first N tile's CTAs when T <=
        FUSED_DBIAS_ROWS: one DBIAS_ROW_BLOCK block in the db order (four chains of 16 rows aligned to T's end, each
        from +0, added in order; the block sum added to +0 changes nothing, as a sum from +0 is never -0).
        Each chain's loads go out before its adds (rows before 0 read as +0, which leaves the sum unchanged)."""
        rows = cute.size(mA, mode=[1])
        m = m_tile * self.tile.bm + tidx
        if n_tile == 0 and rows <= FUSED_DBIAS_ROWS and tidx < self.tile.bm and m < cute.size(mA, mode=[0]):
            vals = cute.make_rmem_tensor(cute.make_layout(DBIAS_CHAIN_ROWS), cutlass.Float32)
            block = cutlass.Float32(0.0)
            for c in cutlass.range_constexpr(DBIAS_ROW_BLOCK // DBIAS_CHAIN_ROWS):
                first = rows - DBIAS_ROW_BLOCK + c * DBIAS_CHAIN_ROWS
                for i in cutlass.range_constexpr(DBIAS_CHAIN_ROWS):
                    vals[i] = cutlass.Float32(0.0)
                    if first + i >= 0:
                        vals[i] = mA[m, first + i].to(cutlass.Float32)
                chain = cutlass.Float32(0.0)
                for i in cutlass.range_constexpr(DBIAS_CHAIN_ROWS):
                    chain = chain + vals[i]
                block = chain if c == 0 else block + chain
            mDbias[m] = block.to(cutlass.BFloat16)

    def _c_tiles(self, mC: cute.Tensor, thr_mma, m_tile, n_tile, split, n_half=0):
        """This CTA's output tile (of its K split's slice; with `n_halves` = 2 its half `n_half`), its
        coordinates, and their MMA partitions."""
        t = self.tile
        gC_full = mC
        if cutlass.const_expr(self.k_splits > 1):
            gC_full = mC[None, None, split]
        tile_n, n = t.bn // self.n_halves, n_tile * self.n_halves + n_half
        gC = cute.local_tile(gC_full, (t.bm, tile_n), (m_tile, n))
        cC = cute.local_tile(cute.make_identity_tensor(gC_full.shape), (t.bm, tile_n), (m_tile, n))
        tCgC = thr_mma.partition_C(gC)
        tCcC = thr_mma.partition_C(cC)
        return gC_full, gC, cC, tCgC, tCcC

    @cute.jit
    def _epilogue(self, acc, thr_mma, tidx, storage, tCgC, tCcC, gC, cC, gC_full, mA, mBias, n_tile, m_tile):
        if cutlass.const_expr(self.epilogue == "f32"):
            # FP32 partials straight from registers, element by element, bounds-checked on M and N.
            for i in cutlass.range(cute.size(acc), unroll_full=True):
                if cute.elem_less(tCcC[i], gC_full.shape):
                    tCgC[i] = acc[i]
        else:
            self._store_c_bf16(acc, thr_mma, tidx, self._c_tile(storage), gC, cC, gC_full.shape, mBias)
        if cutlass.const_expr(self.dbias_rows):
            self._store_dbias(mA, mBias, n_tile, m_tile, tidx)

    def _grid(self, mA: cute.Tensor, mB: cute.Tensor):
        """(N tiles, M tiles, K splits): grid x walks N fastest, so CTAs resident together share their A
        (weight-sized) tile in L2."""
        t = self.tile
        return (cute.ceil_div(cute.size(mB, mode=[0]), t.bn), cute.ceil_div(cute.size(mA, mode=[0]), t.bm),
                self.k_splits)


class WgmmaGemm(AdalnGemm):
    """What every wgmma kernel (sm_90a) sets up the same way: the BF16 wgmma m64 x N x k16 with FP32 accumulators
    (operands read from shared memory), warps_m / 4 warpgroups stacked along M in 64-row slabs, and the operands'
    swizzled shared-memory stage layouts. No mainloop: `CpAsyncWgmmaGemm`, `TmaWgmmaGemm` and
    `TmaWgmmaPersistentGemm` each run their own, all with the same k16 walk (so the same bits)."""

    @property
    def _mma_n(self) -> int:
        """The wgmma's N: the CTA tile's, except where d_temb runs a 256-wide tile as two halves."""
        return self.tile.bn // self.n_halves

    def _wgmma_tiled_mma(self):
        """BF16 wgmma m64 x bn x k16, FP32 accumulators, warps_m / 4 warpgroups stacked along M."""
        from cutlass.cute.nvgpu import OperandMajorMode
        from cutlass.utils import hopper_helpers as sm90

        return sm90.make_trivial_tiled_mma(
            cutlass.BFloat16,
            cutlass.BFloat16,
            OperandMajorMode.K if self.a_k_major else OperandMajorMode.MN,
            OperandMajorMode.K if self.b_k_major else OperandMajorMode.MN,
            cutlass.Float32,
            (self.tile.mma_warpgroups, 1, 1),
            tiler_mn=(64, self._mma_n),
        )

    def _wgmma_smem_layout(self, k_major: bool, mn: int, is_a: bool):
        from cutlass.utils import LayoutEnum
        from cutlass.utils import hopper_helpers as sm90

        layout = LayoutEnum.ROW_MAJOR if k_major else LayoutEnum.COL_MAJOR
        t = self.tile
        if is_a:
            return sm90.make_smem_layout_a(layout, (mn, t.bn, t.bk), cutlass.BFloat16, t.stages)
        return sm90.make_smem_layout_b(layout, (t.bm, mn, t.bk), cutlass.BFloat16, t.stages)


def r2s_source_order(tiled_mma, r2s, tile_mn) -> list:
    """For each source register i of the stmatrix copy `r2s`, the index of the accumulator element (of
    `tiled_mma`'s C partition) at the same (m, n) of the tile, from thread 0's static coordinates (the tests
    check every thread). `r2s.retile(acc)` assumes the two orders agree; they do for one 64-row wgmma tile per
    warpgroup, not when one warpgroup repeats along M (the 128-row, one-warpgroup dW tile: 3 of 4 values
    would land in the wrong columns)."""
    full = cute.make_identity_tensor(tile_mn)
    acc = tiled_mma.get_slice(0).partition_C(full)
    src = r2s.get_slice(0).partition_S(full)
    where = {tuple(acc[j]): j for j in range(cute.size(acc))}
    return [where[tuple(src[i])] for i in range(cute.size(src))]


def bf16_c_stmatrix(tiled_mma, tile_mn, sC: cute.Tensor, tidx, n_major: bool = True):
    """The stmatrix copy of `tiled_mma`'s FP32 accumulator, as BF16, into the swizzled C buffers `sC` (bm, bn,
    buffers; N-major, or M-major with the transposing stmatrix) that a TMA store reads: (copy, this thread's sC
    partition, its BF16 source registers, and `r2s_source_order`: the accumulator index each register takes).
    Shared by the cp.async TMA-store dW and the persistent kernels."""
    from cutlass.utils import LayoutEnum
    from cutlass.utils import hopper_helpers as sm90

    layout = LayoutEnum.ROW_MAJOR if n_major else LayoutEnum.COL_MAJOR
    st_atom = sm90.get_smem_store_op(layout, cutlass.BFloat16, cutlass.Float32)
    r2s = cute.make_tiled_copy_S(st_atom, cute.make_tiled_copy_C_atom(st_atom, tiled_mma))
    thr_r2s = r2s.get_slice(tidx)
    rC = cute.make_rmem_tensor(cute.shape(thr_r2s.partition_S(sC))[:3], cutlass.BFloat16)
    return r2s, thr_r2s.partition_D(sC), rC, r2s_source_order(tiled_mma, r2s, tile_mn)


def mma_copy(tiled_mma):
    """A copy of a tiled MMA whose fields can be set without touching the original's."""
    from cutlass.base_dsl.utils.mlir_value_tree import extract_mlir_values, new_from_mlir_values

    return new_from_mlir_values(tiled_mma, extract_mlir_values(tiled_mma))


def block_mmas(tiled_mma):
    """(first, chained): two copies of the wgmma with ACCUMULATE fixed once, off (scale-d = 0) and on. Setting one
    MMA's field per k16 inside the main loop instead would rebind its value inside the loop body."""
    first = mma_copy(tiled_mma)
    first.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    return first, tiled_mma


def wgmma_k_block(mmas, block, tCrA, tCrB, stage, k_group):
    """d_temb's tensor-core block: the k16 wgmmas of the DGRAD_K_BLOCK-deep K group `k_group` of a k tile into
    `block`, the first from zero (`block_mmas`' first, scale-d = 0), the next chained through the tensor core's
    accumulation; fenced (whatever read `block` before is done) and committed as one group."""
    steps = DGRAD_K_BLOCK // 16
    cute.nvgpu.warpgroup.fence()
    for k in range(steps):
        k_block = k_group * steps + k
        cute.gemm(mmas[min(k, 1)], block, tCrA[None, None, k_block, stage], tCrB[None, None, k_block, stage], block)
    cute.nvgpu.warpgroup.commit_group()
