"""The BF16 AdaLN projection GEMM family: forward, both backward GEMMs and their small helpers.

The projection is `table = silu(temb).bf16 @ W^T + b` with W (N_out, D = 2688) BF16, N_out = 96768
(block AdaLN) or 10752 (final AdaLN). Every GEMM here is one kernel, `_WarpMmaGemm`: a multistage
cp.async (16-byte) global->shared pipeline, ldmatrix (transposed for MN-major operands) into
registers, and the warp-level `mma.sync.m16n8k16` BF16 MMA with FP32 accumulators, which runs
unchanged on sm_90a and sm_100a. C = A B^T with A (M, K) and B (N, K):

| kernel | M | N | K | A | B | C |
| --- | --- | --- | --- | --- | --- | --- |
| adaln_proj_fwd | N_out | T | D | W (K-major) | a (K-major) | out^T + bias, BF16 |
| adaln_proj_dgrad | D | T | N_out in `DGRAD_SPLITS` fixed chunks | W^T (M-major) | grad (K-major) | FP32 partials |
| adaln_proj_wgrad | N_out | D | T | grad^T (M-major) | a (N-major) | dW, BF16 |

Numeric contract (what makes the forward and d_temb batch-invariant): every output element is
one FP32 accumulator fed by k16 MMA steps in ascending K order, the same for every T and every
tile config (configs vary only the M/N tiles, the warp arrangement and the pipeline depth; bK
only groups k16 steps per shared-memory stage). Rows beyond T are zero-filled in shared memory and
never stored. The forward epilogue adds the bias in FP32 and rounds to BF16 once (cuBLAS's bias
epilogue). d_temb (FP32 out, held to 1e-5) must not inherit the tensor core's truncating
accumulation over a long chain (see docs/timestep_mlp.md: the error grows with the chain), so the
dgrad runs `ieee_steps`: the warp family's each k16 MMA, the wgmma family's each DGRAD_K_BLOCK = 64-deep block
of K (4 k16 wgmmas chained by the tensor core from zero) starts from zero and is added to the running sum with
IEEE FP32 adds in ascending K; the `DGRAD_SPLITS` FP32 partials are then summed in split order
(`adaln_dtemb_fold`). Its order depends on N_out only. dW and db are reductions over T: deterministic (fixed order, no
atomics), not batch-invariant by nature.

On sm_90a the wgmma family has two mainloops with the same k16 order and epilogue, so the same bits:
`_WgmmaGemm` (the cp.async ring above, mainloop `cp_async_wgmma`) and `_TmaWgmmaGemm` (TMA loads into an mbarrier
ring, a producer warpgroup and two consumer warpgroups, mainloop `tma_wgmma`), plus, for dW,
`_TmaWgmmaPersistentGemm` (the TMA mainloop in a fixed grid of `PERSISTENT_CTAS` CTAs that walk the output
tiles, C stored by TMA from two shared-memory buffers; `tma_wgrad_persist*`, and `*_pingpong`, whose consumer
warpgroups take whole tiles in turn; `_TmaWgmmaPersistentFoldGemm`, `adaln_proj_wgrad_fold`, whose idle producer
warps fold d_temb and sum db from global memory meanwhile). The forward's `tma_wide_n256_mc2` runs `_TmaWgmmaGemm`
in 2-CTA clusters that share the activation tile by TMA multicast (`GemmTile.cluster_m`; `cluster_n` shares A along
grid x); d_temb
runs its 192- and 256-wide tiles on one block tile, the warpgroups taking turns (`_ieee_serial_mainloop`), and the
256-wide tile's thin last round of CTAs as 128-wide halves (`GemmTile.tail_halves`, `tail_units`). All the same bits.
The configs are data (`AdalnGemmConfig`, by name in `ADALN_GEMM_CONFIGS`, kernels/_adaln_configs.py; a variant's
`config` is a name or field overrides of one, `parse_config`); `kernel_class` maps a config's fields to its class.

Constraints: K-major operands need K % 8 == 0 (the copy vector runs along K); MN-major operand
extents are multiples of 8; all pointers 16-byte aligned and all tensors contiguous.
"""
from __future__ import annotations

import math
import cutlass
import cutlass.cute as cute

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream, make_fake_compact_tensor
from h3cute.widths import BLOCK_PROJECTION, FINAL_PROJECTION, TEMB  # TEMB: D, K of the forward GEMM

from ._adaln_configs import PERSISTENT_CTAS, AdalnGemmConfig, GemmTile, candidates, parse_config, picks
from .rowwise import vec_view

OUT_FEATURES = (BLOCK_PROJECTION, FINAL_PROJECTION)  # the block table per call, the final AdaLN's shift | scale
# d_temb = grad @ W reduces over N_out; it is split into this many fixed, equal K chunks so that
# the whole GPU streams W even at T = 1. Never depends on T (batch invariance of d_temb).
DGRAD_SPLITS = 12
# d_temb on the wgmma family: within a split, every DGRAD_K_BLOCK-deep block of K is summed from zero by the
# tensor core (4 chained k16 wgmmas) and added to the FP32 accumulator with IEEE adds in ascending block order.
# A contract constant (bits depend on it), not a config field: every wgmma config's bk is a multiple of it.
DGRAD_K_BLOCK = 64
# db = sum_t grad[t] in one order for every T and every dW config: T's rows in DBIAS_ROW_BLOCK-row blocks aligned
# to its end (block 0 holds the first T % 64 rows, or 64); in a block, four chains of DBIAS_CHAIN_ROWS rows (chain c:
# the block's rows 16c .. 16c + 15, cut at row 0), each summed in ascending rows from +0 in FP32, added
# ((c0 + c1) + c2) + c3; the block sums added in block order from +0. The blocks are the bk = 64 dW tiles' k tiles
# (shifted back by the K tail, `_k_tiles`), so the persistent dW kernel sums each stage as it lands (`_sum_dbias`);
# four short chains keep its adds from waiting on each other.
DBIAS_ROW_BLOCK = 64
DBIAS_CHAIN_ROWS = 16
# Up to this T the dW kernels write db (one block: `_store_dbias`), those with db warps (side_warps "dbias") at every T;
# otherwise the launch runs adaln_bias_grad (the same order, so the same bits).
FUSED_DBIAS_ROWS = 64
assert FUSED_DBIAS_ROWS <= DBIAS_ROW_BLOCK  # _store_dbias sums one block
_MMA_SHAPE = (16, 8, 16)
_COPY_BITS = 128


# d_temb's ieee_steps keeps acc and two block tiles (3 x bn / 2 FP32 registers
# per consumer thread) up to bn = 128, acc and one block tile (2 x bn / 2) up to 192, and at 256 two accumulators of
# 128-wide halves and one block tile of a half (3 x 64) (`_TmaWgmmaGemm._ieee_mainloop` / `_ieee_serial_mainloop`).
_IEEE_PIPELINED_MAX_BN = 128
_IEEE_MAX_BN = 256


def c_buffers(tile: GemmTile) -> int:
    """The persistent cooperative kernels' C buffers: two at 128 rows (a store reads one while the next tile's go to
    the other), one at 256 (two would not fit beside the stages). The pingpong kernel has one per warpgroup."""
    return 2 if tile.bm == 128 else 1


def tail_units(units, ctas: int = PERSISTENT_CTAS, select=lambda cond, a, b: a if cond else b):
    """How many of a `tail_halves` grid's `units` (one CTA per SM each) run whole: all but the last round's where
    that round is at most half full (its units then run as two 128-wide halves each, after the whole ones). The
    kernel's launch calls it on device values (`select` = cutlass.select_); the bits never depend on it."""
    rest = units % ctas
    return select(2 * rest <= ctas, units - rest, units)


def dgrad_n_halves(tile: GemmTile) -> int:
    """How many N halves d_temb's TMA kernel runs a tile as: 2 for the 256-wide tile (wgmma N = 128), else 1."""
    return 2 if tile.bn > 192 else 1


class _WarpMmaGemm:
    """C = epilogue(A B^T): cp.async pipeline + ldmatrix + mma.sync m16n8k16, FP32 accumulators.

    a_k_major / b_k_major say which of each operand's modes is contiguous. `epilogue` is
    "bias_bf16" (C = bf16(acc + bias[m])), "f32" (C = acc) or "bf16" (C = bf16(acc)).
    `ieee_steps`: every k16 MMA into a zeroed step sum, added to acc with an IEEE add (else the
    MMAs chain through acc); the wgmma subclasses do it per DGRAD_K_BLOCK block of K instead.
    `k_splits` > 1 makes grid z walk fixed, equal chunks of the K tiles (C then has a split mode).
    BF16 epilogues are staged through shared memory and stored as 16-byte vectors along C's contiguous
    mode (`c_n_major` says which): the MMA fragment's own 2-byte stores would scatter every warp store
    over 8 rows (dW and the T = 2048 table are 520 / 396 MB).
    `dbias_rows`: the dW GEMM's bias gradient rides along: when K = T <= FUSED_DBIAS_ROWS, the CTAs of
    the first N tile also write mBias[m] = bf16(sum_k A[m, k]) (`_store_dbias`); else mBias is untouched
    (the persistent kernel with db warps writes it at every T: `_TmaWgmmaPersistentDbGemm._sum_dbias`).
    """

    n_halves = 1  # the C tile's N halves: 2 only for d_temb on the 256-wide TMA tile (`_TmaWgmmaGemm`)

    def __init__(self, tile: GemmTile, a_k_major: bool, b_k_major: bool, epilogue: str, k_splits: int = 1,
                 ieee_steps: bool = False, c_n_major: bool = False, dbias_rows: bool = False):
        tile.check()
        self.dbias_rows = dbias_rows
        self.ieee_steps = ieee_steps
        self.c_n_major = c_n_major
        self.tile = tile
        self.a_k_major = a_k_major
        self.b_k_major = b_k_major
        self.epilogue = epilogue
        self.k_splits = k_splits
        self.cta_tiler = (tile.bm, tile.bn, tile.bk)

    # ----------------------------------------------------------------------------------- host
    def _smem_layout(self, k_major: bool, mn: int):
        """Stage-stacked smem layout in 8-row (or 8-column) atoms; XOR swizzle kills ldmatrix bank conflicts."""
        bk = self.tile.bk
        major_size = min(bk if k_major else mn, 64)  # elements along the contiguous mode, <= 128 B
        swizzle = cute.make_swizzle(min(int(math.log2(major_size * 16 // _COPY_BITS)), 3), 4, 3)
        if k_major:
            atom = cute.make_layout((8, major_size), stride=(major_size, 1))
        else:
            atom = cute.make_layout((major_size, 8), stride=(1, major_size))
        layout = cute.tile_to_shape(atom, (mn, bk, self.tile.stages), (0, 1, 2))
        return layout, swizzle

    def _gmem_copy(self, k_major: bool, mn: int):
        """16-byte cp.async tiled copy whose thread order follows the contiguous mode."""
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            cutlass.BFloat16,
            num_bits_per_copy=_COPY_BITS,
        )
        vec = _COPY_BITS // 16
        threads = self.tile.threads
        if k_major:
            along_k = self.tile.bk // vec
            thr = cute.make_layout((threads // along_k, along_k), stride=(along_k, 1))
            val = cute.make_layout((1, vec))
        else:
            along_mn = mn // vec
            thr = cute.make_layout((along_mn, threads // along_mn), stride=(1, along_mn))
            val = cute.make_layout((vec, 1))
        return cute.make_tiled_copy_tv(atom, thr, val)

    def _c_staging_layout(self):
        """(bm, bn) BF16 smem tile, contiguous along C's contiguous mode, padded by 16 bytes per line so
        the fragment writes (8 lines x 4 threads per warp store) hit distinct banks."""
        t = self.tile
        if self.c_n_major:
            return cute.make_layout((t.bm, t.bn), stride=(t.bn + 8, 1))
        return cute.make_layout((t.bm, t.bn), stride=(1, t.bm + 8))

    def _c_copy(self):
        """16-byte smem->gmem tiled copy of the C tile, thread order along C's contiguous mode."""
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.BFloat16, num_bits_per_copy=_COPY_BITS)
        vec = _COPY_BITS // 16
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

    def _allocate_smem(self, sA_layout, sB_layout, align: int):
        """A and B stages; a BF16 epilogue's C tile reuses A's stages when it fits, else gets its own."""
        a_size, b_size = cute.cosize(sA_layout), cute.cosize(sB_layout)
        c_size = cute.cosize(self._c_staging_layout()) if self.epilogue != "f32" else 0

        fields = {
            "a": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, a_size], align],
            "b": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, b_size], align],
        }
        self.c_in_a = c_size <= a_size
        if not self.c_in_a:
            fields["c"] = cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, c_size], 16]
        # Built from a dict: the annotations hold computed sizes (this module's annotations are strings).
        shared = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return cutlass.memory.SmemAllocator().allocate(shared)

    def _c_tile(self, storage):
        return (storage.a if self.c_in_a else storage.c).get_tensor(self._c_staging_layout())

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

    # ---- shared by the warp-MMA and wgmma kernels: operand tiles, cp.async prologue, output tiles, epilogue

    def _k_tiles(self, mA: cute.Tensor, mB: cute.Tensor, m_tile, n_tile, split):
        """(bm, bk, k_tiles) / (bn, bk, k_tiles) views of A and B, their coordinate tensors, and this
        CTA's k-tile range. The K tail (dW only: K = T) is handled by shifting the tiles back so the
        *first* tile is the partial one; its out-of-range K columns have negative coordinates and are
        never loaded (smem stays zero there)."""
        t = self.tile
        gA = cute.local_tile(mA, (t.bm, t.bk), (m_tile, None))
        gB = cute.local_tile(mB, (t.bn, t.bk), (n_tile, None))
        residual_k = cute.size(mA, mode=[1]) - cutlass.Int32(t.bk) * cute.size(gA, mode=[2])
        gA = cute.domain_offset((0, residual_k, 0), gA)
        gB = cute.domain_offset((0, residual_k, 0), gB)
        gA = cute.make_tensor(gA.iterator.align(16), gA.layout)
        gB = cute.make_tensor(gB.iterator.align(16), gB.layout)
        cA = cute.domain_offset((0, residual_k, 0),
                                cute.local_tile(cute.make_identity_tensor(mA.shape), (t.bm, t.bk), (m_tile, None)))
        cB = cute.domain_offset((0, residual_k, 0),
                                cute.local_tile(cute.make_identity_tensor(mB.shape), (t.bn, t.bk), (n_tile, None)))

        k_tile_count = cute.size(gA, mode=[2])
        k_tile_first = cutlass.Int32(0)
        if cutlass.const_expr(self.k_splits > 1):
            # Fixed, equal chunks: the launch asserts K tiles divide evenly (no K tail with splits).
            k_tile_count = k_tile_count // self.k_splits
            k_tile_first = split * k_tile_count
        return gA, gB, cA, cB, k_tile_count, k_tile_first

    @cute.jit
    def _prologue(self, tidx, mA: cute.Tensor, mB: cute.Tensor, gA, gB, cA, cB, sA, sB, copy_A, copy_B,
                  k_tile_first, k_tile_count):
        """Partitions the gmem -> smem copies, zeroes smem, and issues the first stages - 1 k tiles
        (one cp.async group each). Returns the partitions, the M/N predicates and the next k tile."""
        t = self.tile
        thr_copy_A = copy_A.get_slice(tidx)
        thr_copy_B = copy_B.get_slice(tidx)
        tAgA = thr_copy_A.partition_S(gA)
        tAsA = thr_copy_A.partition_D(sA)
        tBgB = thr_copy_B.partition_S(gB)
        tBsB = thr_copy_B.partition_D(sB)
        tAcA = thr_copy_A.partition_S(cA)
        tBcB = thr_copy_B.partition_S(cB)

        # M/N bound predicates, one per copy vector (MN extents of MN-major operands are
        # multiples of 8, so a vector is either all in or all out); K bounds are checked per copy.
        tApA = cute.make_rmem_tensor(
            cute.make_layout(
                (tAgA.shape[0][1], cute.size(tAgA, mode=[1]), cute.size(tAgA, mode=[2])),
                stride=(cute.size(tAgA, mode=[1]), 1, 0),
            ),
            cutlass.Boolean,
        )
        tBpB = cute.make_rmem_tensor(
            cute.make_layout(
                (tBgB.shape[0][1], cute.size(tBgB, mode=[1]), cute.size(tBgB, mode=[2])),
                stride=(cute.size(tBgB, mode=[1]), 1, 0),
            ),
            cutlass.Boolean,
        )
        for v in range(tApA.shape[0]):
            for m in range(tApA.shape[1]):
                tApA[v, m, 0] = cute.elem_less(tAcA[(0, v), m, 0, 0][0], mA.shape[0])
        for v in range(tBpB.shape[0]):
            for n in range(tBpB.shape[1]):
                tBpB[v, n, 0] = cute.elem_less(tBcB[(0, v), n, 0, 0][0], mB.shape[0])

        self._zero_stages(mA, tAsA, tBsB)
        cute.arch.sync_threads()

        num_stages = t.stages
        k_tile_index = k_tile_first
        # First tile: per-K-column bound check (only the dW GEMM ever has a partial tile).
        for k in range(tApA.shape[2]):
            if cute.elem_less(cutlass.Int32(-1), tAcA[0, 0, k, k_tile_index][1]):
                cute.copy(copy_A, tAgA[None, None, k, k_tile_index], tAsA[None, None, k, 0], pred=tApA[None, None, k])
        for k in range(tBpB.shape[2]):
            if cute.elem_less(cutlass.Int32(-1), tBcB[0, 0, k, k_tile_index][1]):
                cute.copy(copy_B, tBgB[None, None, k, k_tile_index], tBsB[None, None, k, 0], pred=tBpB[None, None, k])
        k_tile_index = k_tile_index + 1
        cute.arch.cp_async_commit_group()
        for k_tile in range(1, num_stages - 1):
            if k_tile == k_tile_count:
                tApA.fill(0)
                tBpB.fill(0)
            cute.copy(copy_A, tAgA[None, None, None, k_tile_index], tAsA[None, None, None, k_tile], pred=tApA)
            cute.copy(copy_B, tBgB[None, None, None, k_tile_index], tBsB[None, None, None, k_tile], pred=tBpB)
            k_tile_index = k_tile_index + 1
            cute.arch.cp_async_commit_group()
        return tAgA, tAsA, tBgB, tBsB, tApA, tBpB, k_tile_index

    def _zero_stages(self, mA: cute.Tensor, tAsA: cute.Tensor, tBsB: cute.Tensor):
        """Zero smem once: rows past T and the K tail are never loaded and must read as 0."""
        tAsA.fill(0)
        tBsB.fill(0)

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

    @cute.jit
    def launch(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mBias: cute.Tensor, stream):
        t = self.tile
        sA_layout, sA_swizzle = self._smem_layout(self.a_k_major, t.bm)
        sB_layout, sB_swizzle = self._smem_layout(self.b_k_major, t.bn)
        copy_A = self._gmem_copy(self.a_k_major, t.bm)
        copy_B = self._gmem_copy(self.b_k_major, t.bn)
        mma_op = cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, _MMA_SHAPE)
        tiled_mma = cute.make_tiled_mma(
            mma_op,
            cute.make_layout((t.warps_m, t.warps_n, 1)),
            permutation_mnk=(16 * t.warps_m, 16 * t.warps_n, 16),
        )
        grid = self._grid(mA, mB)
        self.kernel(mA, mB, mC, mBias, sA_layout, sA_swizzle, sB_layout, sB_swizzle, copy_A, copy_B, tiled_mma).launch(
            grid=grid, block=[t.threads, 1, 1], stream=stream, **t.launch_bounds()
        )

    # --------------------------------------------------------------------------------- device
    @cute.kernel
    def kernel(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor,
        sA_layout: cute.Layout,
        sA_swizzle: cute.Swizzle,
        sB_layout: cute.Layout,
        sB_swizzle: cute.Swizzle,
        copy_A: cute.TiledCopy,
        copy_B: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
    ):
        t = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        n_tile, m_tile, split = cute.arch.block_idx()

        gA, gB, cA, cB, k_tile_count, k_tile_first = self._k_tiles(mA, mB, m_tile, n_tile, split)

        storage = self._allocate_smem(sA_layout, sB_layout, 16)
        sA = storage.a.get_tensor(sA_layout, swizzle=sA_swizzle)
        sB = storage.b.get_tensor(sB_layout, swizzle=sB_swizzle)

        tAgA, tAsA, tBgB, tBsB, tApA, tBpB, k_tile_index = self._prologue(
            tidx, mA, mB, gA, gB, cA, cB, sA, sB, copy_A, copy_B, k_tile_first, k_tile_count)
        num_stages = t.stages

        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
        gC_full, gC, cC, tCgC, tCcC = self._c_tiles(mC, thr_mma, m_tile, n_tile, split)
        acc = tiled_mma.make_fragment_C(tCgC)
        acc.fill(0.0)
        # ieee_steps: one m16n8k16 atom issued on single (m, n) fragments, into a zeroed step sum.
        mma_atom = cute.make_mma_atom(cute.nvgpu.warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, _MMA_SHAPE))
        step = cute.make_fragment_like(acc[None, 0, 0])
        step_mn = cute.append_ones(step, 3)  # the (V, 1, 1) shape gemm dispatches on

        # ldmatrix (.trans for MN-major smem) into the MMA's register layout.
        s2r_A = cute.make_tiled_copy_A(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(not self.a_k_major, 4), cutlass.BFloat16), tiled_mma
        )
        s2r_B = cute.make_tiled_copy_B(
            cute.make_copy_atom(cute.nvgpu.warp.LdMatrix8x8x16bOp(not self.b_k_major, 4), cutlass.BFloat16), tiled_mma
        )
        thr_s2r_A = s2r_A.get_slice(tidx)
        thr_s2r_B = s2r_B.get_slice(tidx)
        tCsA_view = thr_s2r_A.partition_S(sA)
        tCrA_view = thr_s2r_A.retile(tCrA)
        tCsB_view = thr_s2r_B.partition_S(sB)
        tCrB_view = thr_s2r_B.retile(tCrB)

        smem_read = 0
        smem_write = num_stages - 1
        tCsA_p = tCsA_view[None, None, None, smem_read]
        tCsB_p = tCsB_view[None, None, None, smem_read]
        num_k_block = cute.size(tCrA, mode=[2])
        cute.arch.cp_async_wait_group(num_stages - 2)
        cute.arch.sync_threads()
        cute.copy(s2r_A, tCsA_p[None, None, 0], tCrA_view[None, None, 0])
        cute.copy(s2r_B, tCsB_p[None, None, 0], tCrB_view[None, None, 0])

        # Main loop: smem holds stages-1 tiles in flight; registers double-buffer k16 blocks.
        # The MMAs consume k16 blocks strictly in ascending K order into one accumulator.
        for k_tile in range(k_tile_count):
            for k_block in cutlass.range(num_k_block, unroll_full=True):
                if k_block == num_k_block - 1:
                    tCsA_p = tCsA_view[None, None, None, smem_read]
                    tCsB_p = tCsB_view[None, None, None, smem_read]
                    cute.arch.cp_async_wait_group(num_stages - 2)
                    cute.arch.sync_threads()
                k_next = (k_block + 1) % num_k_block
                cute.copy(s2r_A, tCsA_p[None, None, k_next], tCrA_view[None, None, k_next])
                cute.copy(s2r_B, tCsB_p[None, None, k_next], tCrB_view[None, None, k_next])
                if k_block == 0:
                    if k_tile + num_stages - 1 < k_tile_count:
                        cute.copy(copy_A, tAgA[None, None, None, k_tile_index], tAsA[None, None, None, smem_write],
                                  pred=tApA)
                        cute.copy(copy_B, tBgB[None, None, None, k_tile_index], tBsB[None, None, None, smem_write],
                                  pred=tBpB)
                    k_tile_index = k_tile_index + 1
                    cute.arch.cp_async_commit_group()
                    smem_write = smem_read
                    smem_read = smem_read + 1
                    if smem_read == num_stages:
                        smem_read = 0
                if cutlass.const_expr(self.ieee_steps):
                    # Each k16 MMA starts from zero, its result is added with an IEEE FP32 add: the
                    # tensor core's truncating accumulation never spans more than 16 products.
                    for m in cutlass.range_constexpr(cute.size(acc, mode=[1])):
                        for n in cutlass.range_constexpr(cute.size(acc, mode=[2])):
                            step.fill(0.0)
                            a_m = cute.append_ones(tCrA[None, m, k_block], 3)
                            b_n = cute.append_ones(tCrB[None, n, k_block], 3)
                            cute.gemm(mma_atom, step_mn, a_m, b_n, step_mn)
                            acc_mn = acc[None, m, n]
                            for v in cutlass.range_constexpr(cute.size(step)):
                                acc_mn[v] = acc_mn[v] + step[v]
                else:
                    cute.gemm(tiled_mma, acc, tCrA[None, None, k_block], tCrB[None, None, k_block], acc)
        cute.arch.cp_async_wait_group(0)
        self._epilogue(acc, thr_mma, tidx, storage, tCgC, tCcC, gC, cC, gC_full, mA, mBias, n_tile, m_tile)


class _WgmmaGemm(_WarpMmaGemm):
    """The same GEMM with the sm_90a warpgroup MMA (wgmma m64nNk16, operands read from shared memory).

    Same loads (16-byte cp.async into wgmma's swizzled layouts), same K walk (k16 steps in ascending
    order into one FP32 accumulator per element), same epilogue; warps_m / 4 warpgroups tile M in
    64-row slabs. Each k tile: cp.async wait -> proxy fence -> barrier -> wgmma on that stage ->
    wait for the wgmma before its stage is refilled. `ieee_steps` (d_temb): per DGRAD_K_BLOCK block of K,
    `_wgmma_k_block` into a zeroed block tile, wait, IEEE adds into acc.
    """

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

    @cute.jit
    def launch(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mBias: cute.Tensor, stream):
        t = self.tile
        sA_layout = self._wgmma_smem_layout(self.a_k_major, t.bm, True)
        sB_layout = self._wgmma_smem_layout(self.b_k_major, t.bn, False)
        copy_A = self._gmem_copy(self.a_k_major, t.bm)
        copy_B = self._gmem_copy(self.b_k_major, t.bn)
        tiled_mma = self._wgmma_tiled_mma()
        grid = self._grid(mA, mB)
        self.wgmma_kernel(mA, mB, mC, mBias, sA_layout, sB_layout, copy_A, copy_B, tiled_mma).launch(
            grid=grid, block=[t.threads, 1, 1], stream=stream, **t.launch_bounds()
        )

    @cute.kernel
    def wgmma_kernel(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        copy_A: cute.TiledCopy,
        copy_B: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        n_tile, m_tile, split = cute.arch.block_idx()
        k_tiles = self._k_tiles(mA, mB, m_tile, n_tile, split)
        storage = self._allocate_smem(sA_layout, sB_layout, 1024)
        acc, thr_mma, tCgC, tCcC, gC, cC, gC_full = self._cp_async_mainloop(
            tidx, mA, mB, mC, k_tiles, storage, sA_layout, sB_layout, copy_A, copy_B, tiled_mma, n_tile, m_tile, split)
        self._epilogue(acc, thr_mma, tidx, storage, tCgC, tCcC, gC, cC, gC_full, mA, mBias, n_tile, m_tile)

    @cute.jit
    def _cp_async_mainloop(self, tidx, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, k_tiles, storage,
                           sA_layout, sB_layout, copy_A, copy_B, tiled_mma, n_tile, m_tile, split):
        """The cp.async ring and the wgmma k walk of this CTA's tile (`k_tiles`: `_k_tiles`' views and range):
        acc and the C tiles for an epilogue."""
        t = self.tile
        gA, gB, cA, cB, k_tile_count, k_tile_first = k_tiles
        sA = storage.a.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.b.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)

        tAgA, tAsA, tBgB, tBsB, tApA, tBpB, k_tile_index = self._prologue(
            tidx, mA, mB, gA, gB, cA, cB, sA, sB, copy_A, copy_B, k_tile_first, k_tile_count)
        num_stages = t.stages

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        gC_full, gC, cC, tCgC, tCcC = self._c_tiles(mC, thr_mma, m_tile, n_tile, split)
        acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
        acc.fill(0.0)
        # Chained: accumulate from the first step on (acc is zero), every k16 step the same operation.
        # ieee_steps: every DGRAD_K_BLOCK of K goes into a fresh block tile (`_wgmma_k_block`), added with IEEE adds.
        if cutlass.const_expr(self.ieee_steps):
            mmas = _block_mmas(tiled_mma)
        else:
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        step = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
        num_k_block = cute.size(tCrA, mode=[2])

        smem_read = 0
        smem_write = num_stages - 1
        for k_tile in range(k_tile_count):
            # Tile k_tile has landed (own copies), is visible to the async proxy, and every
            # warpgroup has finished reading the stage that is refilled next.
            cute.arch.cp_async_wait_group(num_stages - 2)
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            if k_tile + num_stages - 1 < k_tile_count:
                cute.copy(copy_A, tAgA[None, None, None, k_tile_index], tAsA[None, None, None, smem_write], pred=tApA)
                cute.copy(copy_B, tBgB[None, None, None, k_tile_index], tBsB[None, None, None, smem_write], pred=tBpB)
            k_tile_index = k_tile_index + 1
            cute.arch.cp_async_commit_group()
            if cutlass.const_expr(self.ieee_steps):
                for k_group in cutlass.range_constexpr(t.bk // DGRAD_K_BLOCK):
                    _wgmma_k_block(mmas, step, tCrA, tCrB, smem_read, k_group)
                    cute.nvgpu.warpgroup.wait_group(0)
                    for i in cutlass.range_constexpr(cute.size(acc)):
                        acc[i] = acc[i] + step[i]
            else:
                cute.nvgpu.warpgroup.fence()
                for k_block in cutlass.range(num_k_block, unroll_full=True):
                    cute.gemm(tiled_mma, acc, tCrA[None, None, k_block, smem_read],
                              tCrB[None, None, k_block, smem_read], acc)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
            smem_write = smem_read
            smem_read = smem_read + 1
            if smem_read == num_stages:
                smem_read = 0
        cute.arch.cp_async_wait_group(0)
        return acc, thr_mma, tCgC, tCcC, gC, cC, gC_full


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
    Shared by the TMA-store dW and the persistent kernels."""
    from cutlass.utils import LayoutEnum
    from cutlass.utils import hopper_helpers as sm90

    layout = LayoutEnum.ROW_MAJOR if n_major else LayoutEnum.COL_MAJOR
    st_atom = sm90.get_smem_store_op(layout, cutlass.BFloat16, cutlass.Float32)
    r2s = cute.make_tiled_copy_S(st_atom, cute.make_tiled_copy_C_atom(st_atom, tiled_mma))
    thr_r2s = r2s.get_slice(tidx)
    rC = cute.make_rmem_tensor(cute.shape(thr_r2s.partition_S(sC))[:3], cutlass.BFloat16)
    return r2s, thr_r2s.partition_D(sC), rC, r2s_source_order(tiled_mma, r2s, tile_mn)


class _WgmmaTmaStoreGemm(_WgmmaGemm):
    """`_WgmmaGemm`'s dW GEMM (BF16 C, N-major) with C stored by TMA: the same cp.async ring and k16 walk (the
    same bits), then BF16 fragments -> `stmatrix` into a 128B-swizzled (bm, bn) C tile in A's stages (free once
    every warpgroup's wgmmas are done) -> `fence.proxy.async` -> barrier -> one thread issues the bulk tensor
    store (`cp.async.bulk.tensor` shared -> global) and, after db (`dbias_rows`, `_store_dbias`), waits
    `cp.async.bulk.wait_group.read 0` (shared memory must outlive the store's reads) before the CTA exits.
    Why: at small T dW's 520 MB of writes are the cost, and the padded-tile epilogue's scalar st.shared, then
    ld.shared.v4 and st.global.v4 per thread fill the shared-memory instruction queue (ncu at T = 64: MIO
    throttle, 52% of DRAM bandwidth); stmatrix.x4 moves 8 values per instruction and the store is one TMA.
    Needs whole tiles (the dW shapes: N_out % bm == 0, D % bn == 0; the build asserts it)."""

    def __init__(self, tile: GemmTile, **kw):
        super().__init__(tile, **kw)
        assert self.c_n_major and self.epilogue == "bf16" and self.k_splits == 1 and not self.ieee_steps, kw

    @cute.jit
    def _zero_stages(self, mA: cute.Tensor, tAsA: cute.Tensor, tBsB: cute.Tensor):
        """Whole M and N tiles: only the K tail (K = T) is never loaded, in the first k tile (stage 0, see
        `_k_tiles`); the other stages are either fully loaded or never read. So zero stage 0 when T % bk != 0,
        not all stages (18 of the 1wg kernel's 16-byte st.shared per thread)."""
        if cute.size(mA, mode=[1]) % self.tile.bk != 0:
            tAsA[None, None, None, 0].fill(0)
            tBsB[None, None, None, 0].fill(0)

    def _c_layout(self):
        from cutlass.utils import LayoutEnum
        from cutlass.utils import hopper_helpers as sm90

        return sm90.make_smem_layout_epi(cutlass.BFloat16, LayoutEnum.ROW_MAJOR, (self.tile.bm, self.tile.bn), 1)

    def _allocate_smem(self, sA_layout, sB_layout, align: int):
        """A and B stages (1024-aligned for the swizzles); the C tile reuses A's stages."""
        a_size, b_size = cute.cosize(sA_layout), cute.cosize(sB_layout)
        assert cute.cosize(self._c_layout()) <= a_size, (self.tile, a_size)
        fields = {
            "a": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, a_size], align],
            "b": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, b_size], align],
        }
        shared = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return cutlass.memory.SmemAllocator().allocate(shared)

    @cute.jit
    def launch(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mBias: cute.Tensor, stream):
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        sA_layout = self._wgmma_smem_layout(self.a_k_major, t.bm, True)
        sB_layout = self._wgmma_smem_layout(self.b_k_major, t.bn, False)
        sC_layout = self._c_layout()
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(sC_layout, (None, None, 0)), (t.bm, t.bn))
        copy_A = self._gmem_copy(self.a_k_major, t.bm)
        copy_B = self._gmem_copy(self.b_k_major, t.bn)
        tiled_mma = self._wgmma_tiled_mma()
        grid = self._grid(mA, mB)
        self.tma_store_kernel(mA, mB, mC, mBias, tma_c, tma_mC, sA_layout, sB_layout, sC_layout, copy_A, copy_B,
                              tiled_mma).launch(grid=grid, block=[t.threads, 1, 1], stream=stream, **t.launch_bounds())

    @cute.kernel
    def tma_store_kernel(
        self,
        mA: cute.Tensor,
        mB: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor,
        tma_c: cute.CopyAtom,
        tma_mC: cute.Tensor,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sC_layout: cute.ComposedLayout,
        copy_A: cute.TiledCopy,
        copy_B: cute.TiledCopy,
        tiled_mma: cute.TiledMma,
    ):
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_tile, m_tile, split = cute.arch.block_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_c)
        k_tiles = self._k_tiles(mA, mB, m_tile, n_tile, split)
        storage = self._allocate_smem(sA_layout, sB_layout, 1024)
        acc, _, _, _, _, _, _ = self._cp_async_mainloop(
            tidx, mA, mB, mC, k_tiles, storage, sA_layout, sB_layout, copy_A, copy_B, tiled_mma, n_tile, m_tile, split)

        sC = storage.a.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)  # (bm, bn, 1)
        r2s, tRS_sC, tRS_rC, order = bf16_c_stmatrix(tiled_mma, (t.bm, t.bn), sC, tidx)
        for i in cutlass.range_constexpr(len(order)):
            tRS_rC[i] = acc[order[i]].to(cutlass.BFloat16)
        self._epilogue_barrier()  # every warpgroup's wgmmas are done reading A's stages, which C reuses
        cute.copy(r2s, tRS_rC, tRS_sC[None, None, None, 0])
        cute.arch.fence_proxy("async.shared", space="cta")  # the writes are visible to the TMA unit
        self._epilogue_barrier()
        gC = cute.local_tile(tma_mC, (t.bm, t.bn), (m_tile, n_tile))
        tCsC, tCgC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                           cute.group_modes(gC, 0, 2))
        if tidx == 0:
            cute.copy(tma_c, tCsC[None, 0], tCgC)
            cute.arch.cp_async_bulk_commit_group()
        if cutlass.const_expr(self.dbias_rows):
            self._store_dbias(mA, mBias, n_tile, m_tile, tidx)
        if tidx == 0:  # shared memory must outlive the store's reads
            cute.arch.cp_async_bulk_wait_group(0, read=True)


@cute.jit
def produce_k_tiles(ring, stages: cutlass.Constexpr, loads, k_tile_first, k_tile_count,
                    stage_bytes: cutlass.Constexpr = 0):
    """A TMA mainloop's producer thread: k tiles k_tile_first.. of every (atom, smem partition, gmem partition
    [, multicast mask]) in `loads` into the `ring` (PipelineTmaAsync) stage by stage, each stage completing on
    its full mbarrier (a multicast load on the same-placed mbarrier of every CTA in its mask); then the tail that
    waits for the consumers' last releases (in a cluster also the peers' releases, so no CTA exits while a peer
    may still signal its barriers). `stage_bytes` > 0: the stages carry that many bytes, not the ring's full
    count (d_temb's half units). Shared with kernels/wgmma_tf32.py."""
    from cutlass import pipeline

    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    for k_tile in range(k_tile_count):
        if cutlass.const_expr(stage_bytes):
            ring.sync_object_empty.wait(produce.index, produce.phase)
            ring.sync_object_full.arrive_and_expect_tx(produce.index, stage_bytes)
        else:
            ring.producer_acquire(produce)
        full = ring.producer_get_barrier(produce)
        for load in loads:
            cute.copy(load[0], load[2][None, k_tile_first + k_tile], load[1][None, produce.index], tma_bar_ptr=full,
                      **_multicast(load))
        ring.producer_commit(produce)
        produce.advance()
    ring.producer_tail(produce)


def _multicast(load) -> dict:
    """The copy arguments of a `produce_k_tiles` load: its multicast mask, where it has one."""
    return dict(mcast_mask=load[3]) if len(load) == 4 else {}


def _ieee_unit(tile: GemmTile, split_k_tiles: int) -> int:
    """k tiles per drained unit of `_TmaWgmmaGemm._ieee_mainloop` (whole units per K split): at least two
    DGRAD_K_BLOCK blocks, three where the split allows (N = 96768: 126 k tiles), which drains a third less often;
    ptxas 13.0 serializes the wgmmas (C7511) at 6 and 7."""
    if tile.bk != DGRAD_K_BLOCK:
        return 1
    return 3 if split_k_tiles % 3 == 0 else 2


def _stage_bytes(layout) -> int:
    """Bytes of one stage of a BF16 operand's (rows, k, stages) shared-memory ring."""
    return cute.size_in_bytes(cutlass.BFloat16, cute.slice_(layout, (None, None, 0)))


def _mma_copy(tiled_mma):
    """A copy of a tiled MMA whose fields can be set without touching the original's."""
    from cutlass.base_dsl.utils.mlir_value_tree import extract_mlir_values, new_from_mlir_values

    return new_from_mlir_values(tiled_mma, extract_mlir_values(tiled_mma))


def _block_mmas(tiled_mma):
    """(first, chained): two copies of the wgmma with ACCUMULATE fixed once, off (scale-d = 0) and on. Setting one
    MMA's field per k16 inside the main loop instead would rebind its value inside the loop body."""
    first = _mma_copy(tiled_mma)
    first.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
    return first, tiled_mma


def _wgmma_k_block(mmas, block, tCrA, tCrB, stage, k_group):
    """d_temb's tensor-core block: the k16 wgmmas of the DGRAD_K_BLOCK-deep K group `k_group` of a k tile into
    `block`, the first from zero (`_block_mmas`' first, scale-d = 0), the next chained through the tensor core's
    accumulation; fenced (whatever read `block` before is done) and committed as one group."""
    steps = DGRAD_K_BLOCK // 16
    cute.nvgpu.warpgroup.fence()
    for k in range(steps):
        k_block = k_group * steps + k
        cute.gemm(mmas[min(k, 1)], block, tCrA[None, None, k_block, stage], tCrB[None, None, k_block, stage], block)
    cute.nvgpu.warpgroup.commit_group()


class _TmaWgmmaGemm(_WgmmaGemm):
    """The wgmma GEMM with a TMA + mbarrier, warp-specialized mainloop (sm_90a).

    Warpgroup 0 is the producer: one warp issues TMA tile loads (`cp.async.bulk.tensor`) into a ring of
    `stages` shared-memory stages, each guarded by a full and an empty mbarrier (`PipelineTmaAsync`).
    Warpgroups 1.. consume: wait for a stage, issue its k16 wgmmas, keep that batch in flight while
    waiting for the previous one (`wait_group(1)`), then release the previous stage to the producer.
    TMA zero-fills what lies outside the tensor (rows past T, the dW K tail), so there are no predicates
    and no shared-memory zeroing. The dW K tail keeps `_WarpMmaGemm._k_tiles`' placement: the k tiles
    are shifted back so the first one is partial (negative K coordinates, zero-filled by TMA) and the
    k16 steps start at T - 16 j, as in the cp.async kernel: the same k16 groups of products in the same
    order, so the same bits (zero products added to +0 change nothing).
    `ieee_steps` (d_temb): each DGRAD_K_BLOCK block of K goes from zero into block tile b % 2 (4 chained k16
    wgmmas), added to acc with IEEE FP32 adds in ascending b, the cp.async kernel's sums; the adds of block b - 1
    run while block b's wgmmas do, except at the end of each unit of 2 or 3 k tiles (`_ieee_mainloop` says why).
    The epilogue is `_WarpMmaGemm`'s, run by the consumer threads (a named barrier replaces the CTA
    barrier); the BF16 C tile reuses the A/B stages once every wgmma is done and every load has landed.
    Registers: the producer warpgroup drops to `_PRODUCER_REGS`, the consumers rise to
    `_CONSUMER_REGS` (64512 of the SM's 65536 with one CTA per SM, which the configs' smem ensures).
    Clusters: with `tile.cluster_m` = 2 the grid's y pairs (two M tiles of one N tile: the forward's W tiles of
    one T tile) run as one cluster; CTA r of the cluster loads rows [r bn / 2, (r + 1) bn / 2) of each B stage
    into both CTAs (TMA multicast) and its own A, so a full barrier still expects A + B bytes, and every consumer
    warp releases each stage to both CTAs (`_tma_ring`). `tile.cluster_n` = 2 is the same along grid x with A
    shared (d_temb: two T tiles of one W^T tile and K split); grid x is rounded up to whole clusters, the extra
    CTA's B rows lie past T (TMA zero-fills them) and its C is never stored. The bytes, their zero fill and the
    k16 walk are the same, so are the bits.
    Tail halves (d_temb, `tile.tail_halves`): a one-line grid of units whose thin last round runs as two CTAs per
    unit, each one 128-wide half (`_tail_grid`, `_tail_unit`; docs/adaln_projection.md, "d_temb's last round").
    """

    _PRODUCER_WARPGROUPS = 1
    _PRODUCER_REGS = 40  # a TMA-issuing warp needs a few dozen; 40 is what CUTLASS's Hopper kernels use
    _CONSUMER_REGS = 232  # 128 x 40 + 256 x 232 = 64512 <= 65536: acc 64 x bn/2 threads + dgrad's steps
    _EPILOGUE_BARRIER_ID = 1  # named barrier 0 is the CTA barrier
    _TURN_BARRIER_IDS = (2, 3)  # `_ieee_serial_mainloop`: warpgroup 0 waits on 2, warpgroup 1 on 3
    _ORDER_BARRIER_IDS = (4, 5)  # the pingpong dW's mainloop turns: warpgroup 0 waits on 4, warpgroup 1 on 5

    def __init__(self, tile: GemmTile, **kw):
        # TMA has no thread-copy layouts to check (GemmTile.check is the cp.async tiling); the epilogue's
        # C copy asserts its own tiling. Two consumer warpgroups: the register split above.
        assert tile.warps_m == 8 and tile.warps_n == 1 and tile.bk % 32 == 0 and not tile.ctas_per_sm, tile
        assert tile.bn % 16 == 0 and tile.bn <= 256 and tile.bm in (128, 256), tile
        # 256 rows: two 64-row slabs per warpgroup, stored only by the persistent cooperative kernel's epilogue.
        assert tile.bm == 128 or (tile.persistent_ctas and not tile.pingpong and not kw.get("ieee_steps")), tile
        assert not kw.get("ieee_steps") or tile.bn <= _IEEE_MAX_BN, tile
        self.dbias_rows = kw.pop("dbias_rows", False)
        self.ieee_steps = kw.pop("ieee_steps", False)
        self.n_halves = dgrad_n_halves(tile) if self.ieee_steps else 1
        self.c_n_major = kw.pop("c_n_major", False)
        self.k_splits = kw.pop("k_splits", 1)
        self.a_k_major = kw.pop("a_k_major")
        self.b_k_major = kw.pop("b_k_major")
        self.epilogue = kw.pop("epilogue")
        assert not kw, kw
        # A cluster shares B along M or A along N, not both (the ring's release counts assume one line of CTAs).
        assert tile.cluster_m in (1, 2) and tile.cluster_n in (1, 2) and tile.cluster_size <= 2, tile
        self.tile = tile
        self.cta_tiler = (tile.bm, tile.bn, tile.bk)

    @property
    def _cta_threads(self) -> int:
        return self.tile.threads + 128 * self._PRODUCER_WARPGROUPS

    @property
    def _stage_readers(self) -> int:
        """Warps of one CTA that release each ring stage."""
        return 4 * self.tile.mma_warpgroups

    def _tma_ring(self, storage, sA_layout, sB_layout):
        """The stage ring of the TMA mainloops: a full mbarrier per stage expecting one A and one B tile of
        bytes, an empty one taking one arrive per consumer warp (lane 0 signals). In a cluster (`cluster_m` or
        `cluster_n` > 1) every CTA's B (or A) stage is filled by all of the cluster's CTAs, so each consumer warp
        releases a stage to every CTA of the cluster (lane r signals CTA r) and an empty barrier takes one arrive
        per warp of each CTA; `create` then syncs the cluster after the barrier init (no remote arrive before it)."""
        from cutlass import pipeline

        t = self.tile
        return pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.barriers.data_ptr(),
            num_stages=self.tile.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            # Every consumer warp (4 per warpgroup) releases each stage, or (pingpong) those of the one warpgroup that
            # read it, and the persistent dW's db warps.
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, t.cluster_size * self._stage_readers),
            tx_count=_stage_bytes(sA_layout) + _stage_bytes(sB_layout),
            cta_layout_vmnk=cute.make_layout((1, t.cluster_m, t.cluster_n, 1)),
        )

    @staticmethod
    def _tma_partitions(tma_a, tma_b, sA, sB, gA, gB, b_rank=0, b_ctas=1, a_rank=0, a_ctas=1):
        """(smem, gmem) TMA partitions of the A and B stage rings and their k-tiled global views; with B (A)
        multicast over `b_ctas` (`a_ctas`) CTAs, CTA `b_rank`'s (`a_rank`'s) slice: the rows it loads into all."""
        from cutlass.cute.nvgpu import cpasync

        tAsA, tAgA = cpasync.tma_partition(tma_a, a_rank, cute.make_layout(a_ctas), cute.group_modes(sA, 0, 2),
                                           cute.group_modes(gA, 0, 2))
        tBsB, tBgB = cpasync.tma_partition(tma_b, b_rank, cute.make_layout(b_ctas), cute.group_modes(sB, 0, 2),
                                           cute.group_modes(gB, 0, 2))
        return tAsA, tAgA, tBsB, tBgB

    def _tma_loads(self, mA: cute.Tensor, mB: cute.Tensor, sA_layout, sB_layout):
        """TMA load atoms (and their coordinate tensors) for one (bm, bk) A tile and one (bn, bk) B tile; in a
        cluster B's atom (`cluster_m` > 1) or A's (`cluster_n` > 1) multicasts a 1 / cluster-size slice of its tile."""
        from cutlass.cute.nvgpu import cpasync

        t = self.tile

        def atom(m, layout, tile, ctas):
            if ctas == 1:
                return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), m, layout, tile)
            return cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SMulticastOp(), m, layout, tile,
                                               num_multicast=ctas)

        tma_a, tma_mA = atom(mA, cute.slice_(sA_layout, (None, None, 0)), (t.bm, t.bk), t.cluster_n)
        tma_b, tma_mB = atom(mB, cute.slice_(sB_layout, (None, None, 0)), (t.bn, t.bk), t.cluster_m)
        return tma_a, tma_mA, tma_b, tma_mB

    def _epilogue_barrier(self):
        cute.arch.barrier(barrier_id=self._EPILOGUE_BARRIER_ID, number_of_threads=self.tile.threads)

    def _allocate_smem(self, sA_layout, sB_layout, align: int):
        """The mbarrier pair per stage, then A and B stages in one range (B right after A) that the BF16
        C tile reuses after the main loop."""
        a_size, b_size = cute.cosize(sA_layout), cute.cosize(sB_layout)
        assert (a_size * 2) % align == 0, "B's stages must start aligned"
        c_size = cute.cosize(self._c_staging_layout()) if self.epilogue != "f32" else 0
        assert c_size <= a_size + b_size, (c_size, a_size, b_size)
        self.c_in_a = True
        fields = {
            "barriers": cute.struct.MemRange[cutlass.Int64, 2 * self.tile.stages],
            "ab": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, a_size + b_size], align],
        }
        shared = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return cutlass.memory.SmemAllocator().allocate(shared)

    def _c_tile(self, storage):
        return storage.ab.get_tensor(self._c_staging_layout())

    @cute.jit
    def launch(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mBias: cute.Tensor, stream):
        t = self.tile
        sA_layout = self._wgmma_smem_layout(self.a_k_major, t.bm, True)
        sB_layout = self._wgmma_smem_layout(self.b_k_major, t.bn, False)
        tma_a, tma_mA, tma_b, tma_mB = self._tma_loads(mA, mB, sA_layout, sB_layout)
        tiled_mma = self._wgmma_tiled_mma()
        grid = self._grid(mA, mB)
        # Clusters along grid y (M tiles: the builder asserts whole clusters) or grid x (N tiles: rounded up).
        cluster = {} if t.cluster_size == 1 else dict(cluster=[t.cluster_n, t.cluster_m, 1])
        if cutlass.const_expr(t.cluster_n > 1):
            grid = (cute.ceil_div(grid[0], t.cluster_n) * t.cluster_n, grid[1], grid[2])
        tail = ()
        if cutlass.const_expr(t.tail_halves):
            grid, tail = self._tail_grid(mB, grid)
        self.tma_kernel(mA, mC, mBias, tma_a, tma_mA, tma_b, tma_mB, sA_layout, sB_layout, tiled_mma, tail).launch(
            grid=grid, block=[self._cta_threads, 1, 1], stream=stream,
            # setmaxnreg redistributes the registers ptxas gives the CTA: ask for one CTA's full share.
            max_number_threads=[self._cta_threads, 1, 1], min_blocks_per_mp=1, **cluster,
        )

    def _tail_grid(self, mB: cute.Tensor, grid):
        """`tail_halves`: the grid as one line of units (N tiles fastest, then M tiles, then K splits), the whole
        units first (`tail_units`' count, here from T on device), then two CTAs per unit of a thin last round; and
        the kernel's `tail` argument: (whole units, the TMA atom and tensor of a 128-row B half). With `cluster_n`
        = 2 the N tiles are already rounded up to whole clusters, so both counts are even: a cluster holds two
        whole units of one A tile (the second maybe past T) or the two halves of one unit."""
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        assert self.n_halves == 2 and t.cluster_m == 1 and PERSISTENT_CTAS % t.cluster_n == 0, t
        units = grid[0] * grid[1] * grid[2]
        whole = tail_units(units, select=cutlass.select_)
        sB_half = self._wgmma_smem_layout(self.b_k_major, t.bn // 2, False)
        tma_b_half, tma_mB_half = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), mB, cute.slice_(sB_half, (None, None, 0)), (t.bn // 2, t.bk))
        return (2 * units - whole, 1, 1), (whole, tma_b_half, tma_mB_half)

    def _tail_unit(self, mC: cute.Tensor, whole, block):
        """(N tile, M tile, K split, half) of CTA `block` of a `tail_halves` grid (`_tail_grid`); half -1 for a
        whole unit, else the 128-wide half of unit whole + (block - whole) // 2 that it computes."""
        t = self.tile
        past = block - whole
        in_tail = block >= whole
        unit = cutlass.select_(in_tail, whole + past // 2, block)
        half = cutlass.select_(in_tail, past % 2, -1)
        tiles_n = cute.ceil_div(cute.ceil_div(cute.size(mC, mode=[1]), t.bn), t.cluster_n) * t.cluster_n
        tiles_m = cute.ceil_div(cute.size(mC, mode=[0]), t.bm)
        return unit % tiles_n, (unit // tiles_n) % tiles_m, unit // (tiles_n * tiles_m), half

    @cute.kernel
    def tma_kernel(
        self,
        mA: cute.Tensor,
        mC: cute.Tensor,
        mBias: cute.Tensor,
        tma_a: cute.CopyAtom,
        tma_mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        tma_mB: cute.Tensor,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        tail,
    ):
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_tile, m_tile, split = cute.arch.block_idx()
        half = -1
        if cutlass.const_expr(t.tail_halves):
            n_tile, m_tile, split, half = self._tail_unit(mC, tail[0], n_tile)
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            if cutlass.const_expr(t.tail_halves):
                cpasync.prefetch_descriptor(tail[1])

        storage = self._allocate_smem(sA_layout, sB_layout, 1024)
        a_size = cute.cosize(sA_layout)
        ab = storage.ab.data_ptr()
        sA = cute.make_tensor(cute.recast_ptr(ab, sA_layout.inner), sA_layout.outer)
        sB = cute.make_tensor(cute.recast_ptr(ab + a_size, sB_layout.inner), sB_layout.outer)

        ring = self._tma_ring(storage, sA_layout, sB_layout)

        # k tiles as in _WarpMmaGemm._k_tiles: shifted back by the K tail so the first tile is the
        # partial one (negative K coordinates: TMA zero-fills them).
        gA = cute.local_tile(tma_mA, (t.bm, t.bk), (m_tile, None))
        gB = cute.local_tile(tma_mB, (t.bn, t.bk), (n_tile, None))
        residual_k = cute.size(mA, mode=[1]) - cutlass.Int32(t.bk) * cute.size(gA, mode=[2])
        gA = cute.domain_offset((0, residual_k, 0), gA)
        gB = cute.domain_offset((0, residual_k, 0), gB)
        k_tile_count = cute.size(gA, mode=[2])
        k_tile_first = cutlass.Int32(0)
        if cutlass.const_expr(self.k_splits > 1):
            k_tile_count = k_tile_count // self.k_splits
            k_tile_first = split * k_tile_count
        if cutlass.const_expr(t.cluster_size == 1):
            tAsA, tAgA, tBsB, tBgB = self._tma_partitions(tma_a, tma_b, sA, sB, gA, gB)
            loads = ((tma_a, tAsA, tAgA), (tma_b, tBsB, tBgB))
        else:
            # The cluster's CTAs are M tiles of one N tile (grid y) or N tiles of one M tile (grid x): rank r loads
            # its slice of the shared operand into all of them.
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            everyone = cutlass.Int16((1 << t.cluster_size) - 1)
            if cutlass.const_expr(t.cluster_m > 1):
                tAsA, tAgA, tBsB, tBgB = self._tma_partitions(tma_a, tma_b, sA, sB, gA, gB, rank, t.cluster_m)
                loads = ((tma_a, tAsA, tAgA), (tma_b, tBsB, tBgB, everyone))
            else:
                tAsA, tAgA, tBsB, tBgB = self._tma_partitions(tma_a, tma_b, sA, sB, gA, gB, a_rank=rank,
                                                              a_ctas=t.cluster_n)
                loads = ((tma_a, tAsA, tAgA, everyone), (tma_b, tBsB, tBgB))

        if warp_idx < 4 * self._PRODUCER_WARPGROUPS:
            cute.arch.setmaxregister_decrease(self._PRODUCER_REGS)
            if warp_idx == 0:
                if cutlass.const_expr(t.tail_halves):
                    if half < 0:
                        produce_k_tiles(ring, t.stages, loads, k_tile_first, k_tile_count)
                    else:
                        # A half unit: the A tile and the 128 B rows of its half, at the head of each B stage.
                        sB_half = cute.local_tile(sB, (t.bn // 2, t.bk, t.stages), (0, 0, 0))
                        gB_half = cute.domain_offset((0, residual_k, 0), cute.local_tile(
                            tail[2], (t.bn // 2, t.bk), (2 * n_tile + half, None)))
                        _, _, tBsB_half, tBgB_half = self._tma_partitions(tma_a, tail[1], sA, sB_half, gA, gB_half)
                        produce_k_tiles(ring, t.stages, (loads[0], (tail[1], tBsB_half, tBgB_half)),
                                        k_tile_first, k_tile_count,
                                        _stage_bytes(sA_layout) + _stage_bytes(sB_layout) // 2)
                else:
                    produce_k_tiles(ring, t.stages, loads, k_tile_first, k_tile_count)
        else:
            cute.arch.setmaxregister_increase(self._CONSUMER_REGS)
            ctidx = tidx - 128 * self._PRODUCER_WARPGROUPS
            thr_mma = tiled_mma.get_slice(ctidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            # A half unit's C is its half (the first half of a whole unit's otherwise).
            gC_full, gC, cC, tCgC, tCcC = self._c_tiles(mC, thr_mma, m_tile, n_tile, split,
                                                        cutlass.max(half, 0) if t.tail_halves else 0)
            acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
            acc.fill(0.0)
            if cutlass.const_expr(self.n_halves == 2):
                # d_temb on a 256-wide tile: two 128-wide halves of B, each with its own accumulator and C tile.
                tCrB1 = tiled_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(sB, (t.bn // 2, t.bk, t.stages),
                                                                                      (1, 0, 0))))
                tCrB0 = tiled_mma.make_fragment_B(thr_mma.partition_B(cute.local_tile(sB, (t.bn // 2, t.bk, t.stages),
                                                                                      (0, 0, 0))))
                if cutlass.const_expr(t.tail_halves):
                    # Each branch sets the MMA's accumulate field on its own copy (a value rebound inside a branch
                    # must not be used after it).
                    whole_mma, half_mma = _mma_copy(tiled_mma), _mma_copy(tiled_mma)
                    if half < 0:
                        self._both_halves(acc, tCrA, tCrB0, tCrB1, whole_mma, thr_mma, ring, k_tile_count, ctidx,
                                          storage, mC, gC_full, mA, mBias, n_tile, m_tile, split)
                    else:
                        # A half unit: its B half sits at the head of each stage (the producer's half loads).
                        self._ieee_serial_mainloop(half_mma, (acc,), tCrA, (tCrB0,), ring, k_tile_count)
                else:
                    self._both_halves(acc, tCrA, tCrB0, tCrB1, tiled_mma, thr_mma, ring, k_tile_count, ctidx,
                                      storage, mC, gC_full, mA, mBias, n_tile, m_tile, split)
            elif cutlass.const_expr(self.ieee_steps and t.bn > _IEEE_PIPELINED_MAX_BN):
                self._ieee_serial_mainloop(tiled_mma, (acc,), tCrA, (tCrB,), ring, k_tile_count)
            elif cutlass.const_expr(self.ieee_steps):
                self._ieee_mainloop(tiled_mma, acc, tCrA, tCrB, ring, k_tile_count)
            else:
                self._chained_mainloop(tiled_mma, acc, tCrA, tCrB, ring, k_tile_count)
            self._epilogue(acc, thr_mma, ctidx, storage, tCgC, tCcC, gC, cC, gC_full, mA, mBias, n_tile, m_tile)
        if cutlass.const_expr(t.cluster_size > 1):
            # No CTA leaves while its peer may still write its shared memory or arrive on its barriers (the
            # producer's tail already waits for the peer's releases; this also covers every other thread).
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()

    @cute.jit
    def _both_halves(self, acc, tCrA, tCrB0, tCrB1, tiled_mma, thr_mma, ring, k_tile_count, ctidx, storage, mC,
                     gC_full, mA, mBias, n_tile, m_tile, split):
        """A whole 256-wide d_temb unit: both halves block by block (half 0 into `acc`, stored by the caller), then
        half 1's epilogue."""
        _, gC1, cC1, tCgC1, tCcC1 = self._c_tiles(mC, thr_mma, m_tile, n_tile, split, 1)
        acc1 = cute.make_rmem_tensor(tCgC1.shape, cutlass.Float32)
        acc1.fill(0.0)
        self._ieee_serial_mainloop(tiled_mma, (acc, acc1), tCrA, (tCrB0, tCrB1), ring, k_tile_count)
        self._epilogue(acc1, thr_mma, ctidx, storage, tCgC1, tCcC1, gC1, cC1, gC_full, mA, mBias, n_tile, m_tile)

    @cute.jit
    def _chained_mainloop(self, tiled_mma, acc, tCrA, tCrB, ring, k_tile_count):
        """acc += A B^T over the k tiles, k16 wgmmas chained through acc (ACCUMULATE from the first on:
        acc is zero); each tile's batch stays in flight while the next stage is awaited and issued."""
        from cutlass import pipeline

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        ring.consumer_wait(read)
        self._chained_tile(tiled_mma, acc, tCrA, tCrB, read.index)
        read.advance()
        for _ in range(1, k_tile_count):
            ring.consumer_wait(read)
            self._chained_tile(tiled_mma, acc, tCrA, tCrB, read.index)
            # The previous tile's batch is done: its stage goes back to the producer.
            cute.nvgpu.warpgroup.wait_group(1)
            ring.consumer_release(release)
            release.advance()
            read.advance()
        cute.nvgpu.warpgroup.wait_group(0)
        ring.consumer_release(release)

    @staticmethod
    def _chained_tile(tiled_mma, acc, tCrA, tCrB, stage):
        cute.nvgpu.warpgroup.fence()  # as CUTLASS does per k tile (else ptxas injects it: C7519)
        for k_block in range(cute.size(tCrA, mode=[2])):
            cute.gemm(tiled_mma, acc, tCrA[None, None, k_block, stage], tCrB[None, None, k_block, stage], acc)
        cute.nvgpu.warpgroup.commit_group()

    @cute.jit
    def _ieee_mainloop(self, tiled_mma, acc, tCrA, tCrB, ring, k_tile_count):
        """acc = (((0 + s_0) + s_1) + ...) with s_b the DGRAD_K_BLOCK-deep block b of K summed from zero by the
        tensor core (`_wgmma_k_block`) into block tile b % 2, in units of `_ieee_unit` k tiles (two blocks or
        more): within a unit, block b - 1 is added (IEEE FP32) while the wgmmas of block b run, and a k tile's
        stage is released once its last block is added; the unit's last block is added after wait_group(0).
        A unit must end drained: a wgmma still in flight across the k-tile loop's back edge makes ptxas
        serialize every wgmma of the kernel (C7514: it no longer proves the added block tile retired), while
        the mbarrier wait inside a unit is fine (ptxas -v, CUDA 13.0). Units of 7 k tiles: C7511."""
        from cutlass import pipeline

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        blocks = (cute.make_rmem_tensor(acc.shape, cutlass.Float32), cute.make_rmem_tensor(acc.shape, cutlass.Float32))
        mmas = _block_mmas(tiled_mma)
        per_tile = self.tile.bk // DGRAD_K_BLOCK
        unit = self.ieee_unit
        for _ in range(k_tile_count // unit):
            for kt in cutlass.range_constexpr(unit):
                ring.consumer_wait(read)
                for g in cutlass.range_constexpr(per_tile):
                    b = kt * per_tile + g
                    _wgmma_k_block(mmas, blocks[b % 2], tCrA, tCrB, read.index, g)
                    if cutlass.const_expr(b > 0):
                        cute.nvgpu.warpgroup.wait_group(1)
                        self._add(acc, blocks[(b + 1) % 2])
                        if cutlass.const_expr(g == 0):
                            ring.consumer_release(release)
                            release.advance()
                read.advance()
            cute.nvgpu.warpgroup.wait_group(0)
            self._add(acc, blocks[(unit * per_tile - 1) % 2])
            ring.consumer_release(release)
            release.advance()

    @cute.jit
    def _ieee_serial_mainloop(self, tiled_mma, accs, tCrA, tCrBs, ring, k_tile_count):
        """`_ieee_mainloop`'s sums (block b from zero by the tensor core, added to acc with IEEE FP32 adds in
        ascending b) with one block tile, for tiles too wide for two next to acc: each block's wgmmas are drained
        (wait_group(0)) before its adds, and a k tile's stage is released after its last block. A 256-wide tile
        runs as two 128-wide halves (`accs`, `tCrBs`: one accumulator and B fragment each), block by block, the
        halves in turn through the one block tile. The two consumer warpgroups (64 rows each) take turns issuing
        (two named barriers, warpgroup 0 first): the tensor core runs one warpgroup's block while the other adds
        its own, instead of both adding at once."""
        from cutlass import pipeline

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        block = cute.make_rmem_tensor(accs[0].shape, cutlass.Float32)
        mmas = _block_mmas(tiled_mma)
        tidx, _, _ = cute.arch.thread_idx()
        wg = cute.arch.make_warp_uniform(tidx // 128 - self._PRODUCER_WARPGROUPS)
        mine, theirs = self._TURN_BARRIER_IDS[0] + wg, self._TURN_BARRIER_IDS[1] - wg
        turn = dict(number_of_threads=self.tile.threads)
        blocks_per_tile = self.tile.bk // DGRAD_K_BLOCK
        if wg == 1:
            cute.arch.barrier_arrive(barrier_id=theirs, **turn)  # warpgroup 0 issues first
        for k_tile in range(k_tile_count):
            ring.consumer_wait(read)
            for g in cutlass.range_constexpr(blocks_per_tile):
                for h in cutlass.range_constexpr(len(accs)):
                    cute.arch.barrier(barrier_id=mine, **turn)
                    _wgmma_k_block(mmas, block, tCrA, tCrBs[h], read.index, g)
                    # Every wait on a turn is matched by one arrive: warpgroup 1 skips its last.
                    if wg == 0 or k_tile < k_tile_count - 1 or g < blocks_per_tile - 1 or h < len(accs) - 1:
                        cute.arch.barrier_arrive(barrier_id=theirs, **turn)
                    cute.nvgpu.warpgroup.wait_group(0)
                    self._add(accs[h], block)
            ring.consumer_release(read)
            read.advance()

    @staticmethod
    def _add(acc, step):
        for i in range(cute.size(acc)):
            acc[i] = acc[i] + step[i]


class _TmaWgmmaPersistentGemm(_TmaWgmmaGemm):
    """The dW GEMM (C = A B^T, BF16 C N-major) or the forward (`bias_bf16`: C = out^T M-major, + bias per M row in
    FP32 and one rounding, as `_store_c_bf16`) as a persistent `_TmaWgmmaGemm`: `tile.persistent_ctas` CTAs,
    CTA c computes output tiles i = c, c + G, c + 2G, ... (N fastest: i -> (i // tiles_n, i % tiles_n); the CTAs
    resident together share an A tile: a block of grad^T, or of W), a fixed static schedule. The producer warp
    streams every tile's A (grad^T, or W) and B (a^T, or a) k tiles through one ring, running ahead into the next
    tile while the consumers finish the current one. Per tile the consumers run the chained k16 walk from a zero
    accumulator (`_chained_mainloop`'s, the K tail placed as in `_k_tiles`: the same bits as every wgmma config of
    the GEMM), then store C through shared memory: BF16 fragments -> C buffer (tile count % `c_buffers`; stmatrix
    into the swizzled layout TMA reads) -> one TMA store (`cp.async.bulk.tensor` shared -> global) issued by one
    thread, which waits only before a buffer is reused (`cp.async.bulk.wait_group.read c_buffers - 1`: the store
    that last read it is done reading). So the stores of tile i overlap the loads and MMAs of tile i + 1. 256-row
    tiles: each warpgroup's wgmma repeats along M (two 64-row slabs), one C buffer. db (`dbias_rows`): the tiles of
    the first N tile write it with
    `_store_dbias` for T <= FUSED_DBIAS_ROWS (the same order and bits); `_TmaWgmmaPersistentDbGemm` sums it at
    every T in producer warps."""

    _DBIAS_WARPS = 0  # producer warps that sum db (`_TmaWgmmaPersistentDbGemm`)

    def __init__(self, tile: GemmTile, **kw):
        super().__init__(tile, **kw)
        assert tile.persistent_ctas > 0 and tile.cluster_size == 1, tile
        # dW: N-major C, no bias; the forward: M-major C (out^T), bias per row, the cooperative consumers only.
        assert (self.c_n_major and self.epilogue == "bf16") or \
            (not self.c_n_major and self.epilogue == "bias_bf16" and not tile.pingpong), (tile, kw)
        assert self.k_splits == 1 and not self.ieee_steps, kw

    @property
    def _stage_readers(self) -> int:
        return super()._stage_readers + self._DBIAS_WARPS

    @property
    def _c_buffers(self) -> int:
        return c_buffers(self.tile)

    def _c_layout(self):
        from cutlass.utils import LayoutEnum
        from cutlass.utils import hopper_helpers as sm90

        t = self.tile
        layout = LayoutEnum.ROW_MAJOR if self.c_n_major else LayoutEnum.COL_MAJOR
        return sm90.make_smem_layout_epi(cutlass.BFloat16, layout, (t.bm, t.bn), self._c_buffers)

    def _allocate_smem(self, sA_layout, sB_layout, align: int):
        """The mbarrier pair per stage, the A and B stages, and the C buffers (their own: TMA reads them while
        the next tile's loads land in the stages)."""
        a_size, b_size = cute.cosize(sA_layout), cute.cosize(sB_layout)
        fields = {
            "barriers": cute.struct.MemRange[cutlass.Int64, 2 * self.tile.stages],
            "a": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, a_size], align],
            "b": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, b_size], align],
            "c": cute.struct.Align[cute.struct.MemRange[cutlass.BFloat16, cute.cosize(self._c_layout())], align],
        }
        shared = cute.struct(type("SharedStorage", (), {"__annotations__": fields}))
        return cutlass.memory.SmemAllocator().allocate(shared)

    @cute.jit
    def launch(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mBias: cute.Tensor, stream, side=()):
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        sA_layout = self._wgmma_smem_layout(self.a_k_major, t.bm, True)
        sB_layout = self._wgmma_smem_layout(self.b_k_major, t.bn, False)
        sC_layout = self._c_layout()
        tma_a, tma_mA, tma_b, tma_mB = self._tma_loads(mA, mB, sA_layout, sB_layout)
        tma_c, tma_mC = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), mC, cute.slice_(sC_layout, (None, None, 0)), (t.bm, t.bn))
        tiled_mma = self._wgmma_tiled_mma()
        self.persistent_kernel(mA, mBias, tma_a, tma_mA, tma_b, tma_mB, tma_c, tma_mC, sA_layout, sB_layout,
                               sC_layout, tiled_mma, side).launch(
            grid=(t.persistent_ctas, 1, 1), block=[self._cta_threads, 1, 1], stream=stream,
            max_number_threads=[self._cta_threads, 1, 1], min_blocks_per_mp=1,
        )

    @cute.kernel
    def persistent_kernel(
        self,
        mA: cute.Tensor,
        mBias: cute.Tensor,
        tma_a: cute.CopyAtom,
        tma_mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        tma_mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        tma_mC: cute.Tensor,
        sA_layout: cute.ComposedLayout,
        sB_layout: cute.ComposedLayout,
        sC_layout: cute.ComposedLayout,
        tiled_mma: cute.TiledMma,
        side,
    ):
        from cutlass import pipeline
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        cta, _, _ = cute.arch.block_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)
            cpasync.prefetch_descriptor(tma_c)

        storage = self._allocate_smem(sA_layout, sB_layout, 1024)
        sA = storage.a.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB = storage.b.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sC = storage.c.get_tensor(sC_layout.outer, swizzle=sC_layout.inner)

        ring = self._tma_ring(storage, sA_layout, sB_layout)

        # (bm, bk, tiles_m, k_tiles) / (bn, bk, tiles_n, k_tiles), k tiles shifted back by the K tail as in
        # _WarpMmaGemm._k_tiles (the first one partial, negative K coordinates zero-filled by TMA).
        gA = cute.local_tile(tma_mA, (t.bm, t.bk), (None, None))
        gB = cute.local_tile(tma_mB, (t.bn, t.bk), (None, None))
        residual_k = cute.size(mA, mode=[1]) - cutlass.Int32(t.bk) * cute.size(gA, mode=[3])
        gA = cute.domain_offset((0, residual_k, 0, 0), gA)
        gB = cute.domain_offset((0, residual_k, 0, 0), gB)
        k_tile_count = cute.size(gA, mode=[3])
        tiles_n = cute.size(gB, mode=[2])
        num_tiles = cute.size(gA, mode=[2]) * tiles_n
        tAsA, tAgA, tBsB, tBgB = self._tma_partitions(tma_a, tma_b, sA, sB, gA, gB)
        gC = cute.local_tile(tma_mC, (t.bm, t.bn), (None, None))  # (bm, bn, tiles_m, tiles_n)
        tCsC, tCgC = cpasync.tma_partition(tma_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
                                           cute.group_modes(gC, 0, 2))

        if warp_idx < 4 * self._PRODUCER_WARPGROUPS:
            cute.arch.setmaxregister_decrease(self._PRODUCER_REGS)
            if warp_idx == 0:
                produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.stages)
                for tile in range(cta, num_tiles, t.persistent_ctas):
                    m_tile = tile // tiles_n
                    n_tile = tile - m_tile * tiles_n
                    for k_tile in range(k_tile_count):
                        ring.producer_acquire(produce)
                        full = ring.producer_get_barrier(produce)
                        cute.copy(tma_a, tAgA[None, m_tile, k_tile], tAsA[None, produce.index], tma_bar_ptr=full)
                        cute.copy(tma_b, tBgB[None, n_tile, k_tile], tBsB[None, produce.index], tma_bar_ptr=full)
                        ring.producer_commit(produce)
                        produce.advance()
                ring.producer_tail(produce)
            elif cutlass.const_expr(self._DBIAS_WARPS > 0 or len(side) > 0):
                self._side_warps(ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx,
                                 side)
        elif cutlass.const_expr(t.pingpong):
            cute.arch.setmaxregister_increase(self._CONSUMER_REGS)
            self._consume_pingpong(tidx - 128 * self._PRODUCER_WARPGROUPS, cta, num_tiles, tiles_n, k_tile_count,
                                   ring, tiled_mma, sA, sB, sC, tma_c, tCsC, tCgC, mA, mBias)
        else:
            cute.arch.setmaxregister_increase(self._CONSUMER_REGS)
            ctidx = tidx - 128 * self._PRODUCER_WARPGROUPS
            thr_mma = tiled_mma.get_slice(ctidx)
            tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
            tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
            acc = cute.make_rmem_tensor(thr_mma.partition_C(sC[None, None, 0]).shape, cutlass.Float32)
            tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
            # Fragments -> swizzled C buffer with stmatrix (the layout the TMA store reads), each register from the
            # accumulator element of its own (m, n) (the identity for 128 rows; 256 rows repeat each warpgroup's
            # wgmma along M).
            r2s, tRS_sC, tRS_rC, order = bf16_c_stmatrix(tiled_mma, (t.bm, t.bn), sC, ctidx, self.c_n_major)
            bias = self.epilogue == "bias_bf16"
            tRS_acc = r2s.retile(acc) if order == list(range(len(order))) and not bias else None
            if cutlass.const_expr(bias):
                # The bias of each accumulator element's row: a thread's rows are its first element's plus offsets
                # that are the same for every thread (read off thread 0), so one load per distinct row.
                coords0 = tiled_mma.get_slice(0).partition_C(cute.make_identity_tensor((t.bm, t.bn)))
                rows0 = [coords0[j][0] for j in range(cute.size(coords0))]
                distinct = sorted(set(rows0))
                first_of = [rows0.index(r) for r in distinct]  # an accumulator element of each distinct row
                group = [distinct.index(r) for r in rows0]  # element j's row among them
                tCcC = thr_mma.partition_C(cute.make_identity_tensor((t.bm, t.bn)))
                bias_rows = cute.make_rmem_tensor(cute.make_layout(len(distinct)), cutlass.Float32)

            # The tile walk is written out here and in `_consume_pingpong`, not called: a PipelineState advanced inside
            # a dynamic loop of a called @cute.jit function does not come back to the caller (tried: the PTX then
            # released stage 0 after each walk).
            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            buffer = cutlass.Int32(0)
            for tile in range(cta, num_tiles, t.persistent_ctas):
                m_tile = tile // tiles_n
                n_tile = tile - m_tile * tiles_n
                acc.fill(0.0)
                ring.consumer_wait(read)
                self._chained_tile(tiled_mma, acc, tCrA, tCrB, read.index)
                read.advance()
                for _ in range(1, k_tile_count):
                    ring.consumer_wait(read)
                    self._chained_tile(tiled_mma, acc, tCrA, tCrB, read.index)
                    cute.nvgpu.warpgroup.wait_group(1)
                    ring.consumer_release(release)
                    release.advance()
                    read.advance()
                cute.nvgpu.warpgroup.wait_group(0)
                ring.consumer_release(release)
                release.advance()

                if cutlass.const_expr(bias):
                    for g in cutlass.range_constexpr(len(distinct)):
                        bias_rows[g] = mBias[m_tile * t.bm + tCcC[first_of[g]][0]].to(cutlass.Float32)
                if ctidx == 0:  # the store that last read this buffer (`_c_buffers` tiles ago) is done reading it
                    cute.arch.cp_async_bulk_wait_group(self._c_buffers - 1, read=True)
                self._epilogue_barrier()
                if cutlass.const_expr(tRS_acc is not None):
                    for i in cutlass.range(cute.size(tRS_rC), unroll_full=True):
                        tRS_rC[i] = tRS_acc[i].to(cutlass.BFloat16)
                else:
                    for i in cutlass.range_constexpr(cute.size(tRS_rC)):
                        value = acc[order[i]]
                        if cutlass.const_expr(bias):
                            value = value + bias_rows[group[order[i]]]
                        tRS_rC[i] = value.to(cutlass.BFloat16)
                cute.copy(r2s, tRS_rC, tRS_sC[None, None, None, buffer])
                cute.arch.fence_proxy("async.shared", space="cta")  # the writes are visible to the TMA unit
                self._epilogue_barrier()
                if ctidx == 0:
                    cute.copy(tma_c, tCsC[None, buffer], tCgC[None, m_tile, n_tile])
                    cute.arch.cp_async_bulk_commit_group()
                if cutlass.const_expr(self.dbias_rows and self._DBIAS_WARPS == 0):
                    self._store_dbias(mA, mBias, n_tile, m_tile, ctidx)
                buffer = (buffer + 1) % self._c_buffers
            if ctidx == 0:  # shared memory must outlive the last stores' reads
                cute.arch.cp_async_bulk_wait_group(0, read=True)


    @cute.jit
    def _consume_pingpong(self, ctidx, cta, num_tiles, tiles_n, k_tile_count, ring, tiled_mma, sA, sB, sC, tma_c,
                          tCsC, tCgC, mA, mBias):
        """The consumers of `tile.pingpong`: warpgroup w computes this CTA's tiles w, w + 2, ... (the same chained
        k16 walk from zero, one warpgroup over all 128 rows) and stores each through its own C buffer w (stmatrix
        in `r2s_source_order`, fence, the warpgroup's named barrier, one TMA store), skipping the other
        warpgroup's k tiles in the ring; its next tile's wgmmas wait only for its own previous store to have
        read the buffer, so one warpgroup's epilogue overlaps the other's mainloop. The mainloops take turns (two
        more named barriers): tile j's waits on the ring start once tile j - 1's have all passed, so no warpgroup
        ever waits on a stage two phases ahead (an mbarrier's parity cannot tell those apart)."""
        from cutlass import pipeline

        t = self.tile
        wg = cute.arch.make_warp_uniform(ctidx // 128)
        wtidx = ctidx - wg * 128
        thr_mma = tiled_mma.get_slice(wtidx)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(sC[None, None, 0]).shape, cutlass.Float32)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        r2s, tRS_sC, tRS_rC, order = bf16_c_stmatrix(tiled_mma, (t.bm, t.bn), sC, wtidx)
        barrier = dict(barrier_id=self._TURN_BARRIER_IDS[0] + wg, number_of_threads=128)
        my_turn = dict(barrier_id=self._ORDER_BARRIER_IDS[0] + wg, number_of_threads=256)
        their_turn = dict(barrier_id=self._ORDER_BARRIER_IDS[1] - wg, number_of_threads=256)

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        if wg == 1:  # warpgroup 0's first tile comes first in the ring
            for _ in range(k_tile_count):
                read.advance()
                release.advance()
        for tile in range(cta + wg * t.persistent_ctas, num_tiles, 2 * t.persistent_ctas):
            m_tile = tile // tiles_n
            n_tile = tile - m_tile * tiles_n
            acc.fill(0.0)
            if tile != cta:  # after the previous tile's mainloop (the other warpgroup's) has passed its waits
                cute.arch.barrier(**my_turn)
            ring.consumer_wait(read)
            self._chained_tile(tiled_mma, acc, tCrA, tCrB, read.index)
            read.advance()
            for _ in range(1, k_tile_count):
                ring.consumer_wait(read)
                self._chained_tile(tiled_mma, acc, tCrA, tCrB, read.index)
                cute.nvgpu.warpgroup.wait_group(1)
                ring.consumer_release(release)
                release.advance()
                read.advance()
            if tile + t.persistent_ctas < num_tiles:  # the next tile's mainloop may wait on the ring now
                cute.arch.barrier_arrive(**their_turn)
            cute.nvgpu.warpgroup.wait_group(0)
            ring.consumer_release(release)
            release.advance()
            for _ in range(k_tile_count):  # the other warpgroup's tile
                read.advance()
                release.advance()

            if wtidx == 0:  # this warpgroup's previous store is done reading its buffer
                cute.arch.cp_async_bulk_wait_group(0, read=True)
            cute.arch.barrier(**barrier)
            for i in cutlass.range_constexpr(cute.size(tRS_rC)):
                tRS_rC[i] = acc[order[i]].to(cutlass.BFloat16)
            cute.copy(r2s, tRS_rC, tRS_sC[None, None, None, wg])
            cute.arch.fence_proxy("async.shared", space="cta")  # the writes are visible to the TMA unit
            cute.arch.barrier(**barrier)
            if wtidx == 0:
                cute.copy(tma_c, tCsC[None, wg], tCgC[None, m_tile, n_tile])
                cute.arch.cp_async_bulk_commit_group()
            if cutlass.const_expr(self.dbias_rows and self._DBIAS_WARPS == 0):
                self._store_dbias(mA, mBias, n_tile, m_tile, wtidx)
        if wtidx == 0:  # shared memory must outlive the last stores' reads
            cute.arch.cp_async_bulk_wait_group(0, read=True)


class _TmaWgmmaPersistentDbGemm(_TmaWgmmaPersistentGemm):
    """`_TmaWgmmaPersistentGemm` whose producer warpgroup also sums db, at every T: warps 1 and 2 walk the producer's
    tiles, wait for every stage and release it after reading (the ring's empty barriers count them), and in the
    first N tile's tiles sum each A stage as it lands (`_sum_dbias`); nothing re-reads grad. The ring cannot run
    ahead of them, so they must keep pace with the tensor core: eight independent FP32 chains per lane and 16-byte
    loads. Against the separate adaln_bias_grad: ahead at T <= 384, behind at 2048
    (`launch.adaln_projection.wgrad_config_for_rows`)."""

    _DBIAS_WARPS = 2  # producer warps 1 and 2: 64 rows each
    # The db warps' eight chains, totals and loads in flight spill below 72 registers (ptxas -v); the consumers keep
    # within 208 (the pingpong tile's 128 accumulators per thread included).
    _PRODUCER_REGS = 72
    _CONSUMER_REGS = 208  # 128 x 72 + 256 x 208 = 62464

    def __init__(self, tile: GemmTile, **kw):
        super().__init__(tile, **kw)
        # A stage is one DBIAS_ROW_BLOCK block of T (the K tail's partial block first) and holds 64 rows per db warp:
        # a warp's 32 lanes are 8 groups of 8 rows (one 16-byte load) x the block's 4 chains of 16 k.
        assert self.dbias_rows and tile.bk == DBIAS_ROW_BLOCK and tile.bm == 64 * self._DBIAS_WARPS, tile
        assert DBIAS_ROW_BLOCK // DBIAS_CHAIN_ROWS == 4 and DBIAS_CHAIN_ROWS == 16  # _DBIAS_K16_STRIDE per chain

    @cute.jit
    def _side_warps(self, ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx, side):
        if warp_idx <= self._DBIAS_WARPS:
            self._sum_dbias(ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx)

    @cute.jit
    def _sum_dbias(self, ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx):
        """db by producer warps 1 and 2, in the db order (DBIAS_ROW_BLOCK): they walk the producer's tiles and wait
        for every stage (grad^T: 128 rows x one 64-row block of T, the K tail's zero fill first, which leaves a sum
        from +0 unchanged), and release it after reading. In the first N tile's tiles warp w takes rows
        64w .. 64w + 63 (`_stage_dbias_block`), adds each block sum to its totals and stores its 8 db values after
        the tile's last stage."""
        from cutlass import pipeline

        t = self.tile
        _check_dbias_offsets(sA_layout, t.bm, t.bk)
        lane = cute.arch.lane_idx()
        row = (warp_idx - 1) * 64 + (lane % 8) * 8
        row_part = _dbias_row_part(sA_layout, row)
        stage_size = cute.cosize(sA_layout.outer) // t.stages
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        totals = cute.make_rmem_tensor(cute.make_layout(_DBIAS_LANE_ROWS), cutlass.Float32)
        for tile in range(cta, num_tiles, t.persistent_ctas):
            m_tile = tile // tiles_n
            n_tile = tile - m_tile * tiles_n
            totals.fill(0.0)
            for _ in range(k_tile_count):
                ring.consumer_wait(read)
                if n_tile == 0:
                    totals.store(totals.load() + _stage_dbias_block(sA_layout, storage.a.data_ptr(),
                                                                    read.index * stage_size, row_part))
                ring.consumer_release(read)
                read.advance()
            if n_tile == 0 and lane < 8:
                vec_view(mBias, m_tile * t.bm + row).store(totals.load().to(cutlass.BFloat16))


_DBIAS_LANE_ROWS = 8  # db rows of grad^T per stage-reading lane: one 16-byte load of BF16 per k


def _dbias_row_part(sA_layout, row) -> list:
    """`_stage_dbias_block`'s per-row offsets: for k = 0 .. 7, the element offset of (row, k) in a dW A stage less that
    of (0, k) (the swizzle moves a row's 16-byte chunk by k % 8; `_check_dbias_offsets`). Computed once per db warp,
    outside the stage loop."""
    return [_smem_offset(sA_layout, (row, k, 0)) - _smem_offset(sA_layout, (0, k, 0)) for k in range(8)]


@cute.jit
def _stage_dbias_block(sA_layout, base, stage_at, row_part):
    """One db block sum (DBIAS_ROW_BLOCK rows of T, the order of `_dbias_block_sum`) of 8 grad^T rows from a dW A
    stage (grad^T: M-major, 128B swizzle; the K tail's zero fill first, which leaves a sum from +0 unchanged), by a
    whole warp: lane l sums the rows at `row_part` (its row's offsets for k % 8, 8 lanes per row group) over the
    block's chain l // 8 (its 16 k), eight independent FP32 chains from +0; lanes l + 8, l + 16, l + 24 pass their
    chain sums down to lane l, which returns them added in chain order (valid in lanes 0 .. 7). The stage layout
    keeps 8 rows in one 16-byte chunk and splits each (row, k) offset into a per-row part that depends on k % 8, a
    static part of k % 16 and a stride per 16 k (`_check_dbias_offsets`, at compile time)."""
    rows = _DBIAS_LANE_ROWS
    chain_at = stage_at + cute.arch.lane_idx() // 8 * _DBIAS_K16_STRIDE
    sums = cute.make_rmem_tensor(cute.make_layout(rows), cutlass.Float32)
    sums.fill(0.0)
    for k in cutlass.range_constexpr(DBIAS_CHAIN_ROWS):
        at = chain_at + row_part[k % 8] + _smem_offset(sA_layout, (0, k, 0))
        ptr = cute.make_ptr(cutlass.BFloat16, (base + at).toint(), cute.AddressSpace.smem, assumed_align=16)
        sums.store(sums.load() + cute.make_tensor(ptr, cute.make_layout(rows)).load().to(cutlass.Float32))
    block = sums.load()
    for c in cutlass.range_constexpr(1, DBIAS_ROW_BLOCK // DBIAS_CHAIN_ROWS):
        later = cute.make_rmem_tensor(cute.make_layout(rows), cutlass.Float32)
        for j in cutlass.range_constexpr(rows):
            later[j] = cute.arch.shuffle_sync_down(sums[j], 8 * c)
        block = block + later.load()
    return block


class _TmaWgmmaPersistentFoldGemm(_TmaWgmmaPersistentGemm):
    """`_TmaWgmmaPersistentGemm` (dW) whose idle producer warps run the rest of the backward while the consumers run
    the MMAs. Warp 1 folds d_temb (`adaln_dtemb_fold`'s sums and expression) from the FP32 partials in global memory:
    it never touches the stage ring, so it cannot hold the tensor core back; it is memory-bound and dW (at T > 384)
    is not, so launches and their ramps go away. Warps 2 and 3 sum db from the stages: they wait for every stage and
    release it (the ring's empty barriers count them); each db block of T is a k tile of dW, so the tiles of N tile j
    sum the blocks b = j, j + tiles_n, ... of their 256 grad^T rows as the stage lands (`_stage_dbias_block`) into
    dbias_blocks[b], and `_bias_grad_fold_kernel` folds the blocks after the kernel: `adaln_bias_grad`'s sums in its
    order, with no second read of grad. The side operands arrive as `side` = (partial (splits, T, D), temb (T, D),
    dtemb (T, D), dbias_blocks (blocks, N) FP32); the dW operand a = bf16(silu(temb)) must already exist
    (adaln_silu_cast, launched first). d_temb work is split over the grid's fold lanes (`persistent_ctas` x 32) by
    4-column vectors in a grid-stride walk; which lane computes an element never changes its sums."""

    _FOLD_WARPS = 1  # producer warp 1 (warp 0 issues the TMA loads)
    _DBIAS_WARPS = 2  # producer warps 2 and 3: 128 rows of the 256-row stage each
    # The fold warp's loads in flight (12 partial vectors) and the db warps' sums want ~80 registers; the consumers
    # keep within 208 (the 256-row tile's 128 accumulators per thread included; ptxas -v).
    _PRODUCER_REGS = 88
    _CONSUMER_REGS = 208  # 128 x 88 + 256 x 208 = 64512

    def __init__(self, tile: GemmTile, **kw):
        super().__init__(tile, **kw)
        assert not self.dbias_rows and self.c_n_major, kw  # db comes from the db warps at every T
        assert tile.bk == DBIAS_ROW_BLOCK and tile.bm % (64 * self._DBIAS_WARPS) == 0, tile

    @cute.jit
    def _side_warps(self, ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx, side):
        if warp_idx <= self._FOLD_WARPS:
            self._fold_warps(side, cta, warp_idx)
        else:
            self._sum_dbias_blocks(ring, storage, sA_layout, side[3], cta, num_tiles, tiles_n, k_tile_count,
                                   warp_idx - 1 - self._FOLD_WARPS)

    @cute.jit
    def _sum_dbias_blocks(self, ring, storage, sA_layout, blocks, cta, num_tiles, tiles_n, k_tile_count, warp):
        """db warp `warp` (0, 1): rows 128 warp .. + 127 of each stage, 64 rows (8 per lane) at a time. A tile of N
        tile j sums its k tiles b with b % tiles_n == j (k tile b is db block b: the K tail's partial block first,
        as `_k_tiles` places it) into blocks[b, its rows]; every (block, row) is written by exactly one tile."""
        from cutlass import pipeline

        t = self.tile
        _check_dbias_offsets(sA_layout, t.bm, t.bk)
        lane = cute.arch.lane_idx()
        rows_per_warp = t.bm // self._DBIAS_WARPS
        row = warp * rows_per_warp + (lane % 8) * 8
        row_parts = [_dbias_row_part(sA_layout, row + 64 * p) for p in range(rows_per_warp // 64)]
        stage_size = cute.cosize(sA_layout.outer) // t.stages
        n_out = cute.size(blocks, mode=[1])
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
        for tile in range(cta, num_tiles, t.persistent_ctas):
            m_tile = tile // tiles_n
            n_tile = tile - m_tile * tiles_n
            for k_tile in range(k_tile_count):
                ring.consumer_wait(read)
                if k_tile % tiles_n == n_tile:
                    for p, row_part in enumerate(row_parts):
                        block = _stage_dbias_block(sA_layout, storage.a.data_ptr(), read.index * stage_size, row_part)
                        if lane < 8:
                            vec_view(blocks, cutlass.Int64(k_tile) * n_out + m_tile * t.bm + row + 64 * p,
                                     _DBIAS_LANE_ROWS).store(block)
                ring.consumer_release(read)
                read.advance()

    @cute.jit
    def _fold_warps(self, side, cta, warp_idx):
        """d_temb[t, d] = (partial[0, t, d] + ... + partial[11, t, d], from +0 in split order) * silu'(temb[t, d])
        (`_dtemb_scale`, the fold kernel's expression: the same bits)."""
        partial, temb, dtemb = side[:3]
        rows = cute.size(temb, mode=[0])
        lanes = self.tile.persistent_ctas * 32 * self._FOLD_WARPS
        me = cta * (32 * self._FOLD_WARPS) + (warp_idx - 1) * 32 + cute.arch.lane_idx()
        plane = cutlass.Int64(rows) * TEMB
        d_act = cute.make_rmem_tensor(cute.make_layout(_FOLD_COLS), cutlass.Float32)
        x = cute.make_rmem_tensor(cute.make_layout(_FOLD_COLS), cutlass.Float32)
        for v in range(me, rows * (TEMB // _FOLD_COLS), lanes):
            at = cutlass.Int64(v) * _FOLD_COLS
            d_act.fill(0.0)
            for s in cutlass.range_constexpr(DGRAD_SPLITS):  # fixed split order
                d_act.store(d_act.load() + _ld_stream(partial, s * plane + at, _FOLD_COLS))
            x.store(_ld_stream(temb, at, _FOLD_COLS))
            for j in cutlass.range_constexpr(_FOLD_COLS):
                d_act[j] = _dtemb_scale(d_act[j], x[j])
            vec_view(dtemb, at, _FOLD_COLS).store(d_act.load())


_FOLD_COLS = 4  # d_temb columns per fold-warp vector: one 16-byte FP32 load per partial


@cute.jit
def _ld_stream(t: cute.Tensor, offset, width: int):
    """`width` consecutive elements of `t` at element offset `offset` (16-byte aligned) as a TensorSSA, loaded with
    ld.global.cs (evict-first in L1 and L2: a stream read once, which should not push the GEMM's operands out).
    Measured at a2c0780 (perf/clock_probe.py, sustained, T = 2048): 1722.3 us for silu_cast + the 256-row dW with
    fold warps against 1762.3 with plain loads and 1777.2 with cs loads 4 in flight per thread."""
    from cutlass._mlir import ir

    ptr = vec_view(t, offset, width).iterator
    vec = cute.arch.load(ptr, ir.VectorType.get([width], t.element_type.mlir_type), cop="cs")
    return cute.TensorSSA(vec, (width,), t.element_type)


_DBIAS_K16_STRIDE = 1024  # elements between k and k + 16 in the dW A stage (M-major, 128B swizzle)


def _smem_offset(layout, coord):
    """The element offset of `coord` in a swizzled shared-memory layout of BF16 (`ComposedLayout`: swizzle o outer)
    as the swizzled pointer places it: CuTe applies the swizzle to the byte address (the stage ring starts
    1024-aligned, so to the byte offset), not to the element offset."""
    sw = layout.inner
    b = layout.outer(coord) * 2
    yy = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)
    return (b ^ ((b & yy) >> sw.num_shift)) >> 1


def _check_dbias_offsets(sA_layout, bm: int, bk: int) -> None:
    """`_sum_dbias`' address split, asserted on the A stage layout at compile time: rows 8j .. 8j + 7 contiguous, and
    offset(r, k) = offset(r, k % 8) - offset(0, k % 8) + offset(0, k % 16) + (k // 16) _DBIAS_K16_STRIDE."""
    def at(r, k):
        return _smem_offset(sA_layout, (r, k, 0))

    bad = [(r, k) for r in range(bm) for k in range(bk)
           if at(r, k) != at(r, k % 8) - at(0, k % 8) + at(0, k % 16) + k // 16 * _DBIAS_K16_STRIDE
           or at(r, k) != at(r - r % 8, k) + r % 8]
    assert not bad, ("the A stage layout breaks _sum_dbias' address split at (row, k)", bad[:4])


# ------------------------------------------------------------------------------ the projection
def _fake(dtype, shape, stride_order=None):
    return make_fake_compact_tensor(dtype, shape, stride_order=stride_order, assumed_align=16)


def kernel_class(config: AdalnGemmConfig) -> type:
    """The GEMM class that runs `config` (as `config.for_role(role)` gives it), from its fields: the mainloop, then
    the C store (cp.async ring), or the schedule and side warps (TMA mainloop)."""
    if config.mainloop == "mma_sync":
        assert config.store == "smem" and config.schedule == "grid" and config.cluster_m == config.cluster_n == 1, \
            config
        return _WarpMmaGemm
    if config.mainloop == "cp_async_wgmma":
        assert config.schedule == "grid" and config.cluster_m == config.cluster_n == 1, config
        return _WgmmaTmaStoreGemm if config.store == "tma" else _WgmmaGemm
    if config.schedule == "grid":
        assert config.store == "smem" and config.side_warps == "none", config
        return _TmaWgmmaGemm
    assert config.store == "tma" and not config.tail_halves, config
    return {"none": _TmaWgmmaPersistentGemm, "dbias": _TmaWgmmaPersistentDbGemm,
            "fold": _TmaWgmmaPersistentFoldGemm}[config.side_warps]


def _gemm(arch: str, name: str, role: str, **kw):
    """The `role` GEMM of the config `name` (a name, or `name:field=value,...`: `parse_config`), built by its
    `kernel_class`."""
    config = parse_config(name).for_role(role)
    assert arch == "sm_90a" or config.family == "warp", f"{name} is a wgmma (sm_90a) config"
    return kernel_class(config)(config.tile, **kw)


def _build_fwd(arch: str, *, out_features: int, config: str):
    gemm = _gemm(arch, config, "fwd", a_k_major=True, b_k_major=True, epilogue="bias_bf16")
    # A cluster of M tiles needs whole clusters along grid y (N_out / 128 = 756 and 84: even).
    assert out_features % (gemm.tile.bm * gemm.tile.cluster_m) == 0, (out_features, config)

    @cute.jit
    def adaln_proj_fwd(act: cute.Tensor, weight: cute.Tensor, bias: cute.Tensor, out: cute.Tensor, stream):
        # out (T, N_out) seen as C (N_out, T): M-major, so the weight rows are the MMA's M.
        out_t = cute.make_tensor(out.iterator, cute.select(out.layout, mode=[1, 0]))
        gemm.launch(weight, act, out_t, bias, stream)

    rows = cute.sym_int()
    return compile_for(
        arch,
        adaln_proj_fwd,
        _fake(cutlass.BFloat16, (rows, TEMB), (1, 0)),
        _fake(cutlass.BFloat16, (out_features, TEMB), (1, 0)),
        _fake(cutlass.BFloat16, (out_features,)),
        _fake(cutlass.BFloat16, (rows, out_features), (1, 0)),
        env_stream(),
    )


def _build_dgrad(arch: str, *, out_features: int, config: str):
    # d_temb is held to 1e-5: IEEE running sums over k16 MMA steps (warp family) or DGRAD_K_BLOCK blocks (wgmma).
    gemm = _gemm(arch, config, "dgrad", a_k_major=False, b_k_major=True, epilogue="f32", k_splits=DGRAD_SPLITS,
                 ieee_steps=True)
    bk = gemm.tile.bk
    assert out_features % (DGRAD_SPLITS * bk) == 0, (out_features, gemm.tile)
    if isinstance(gemm, _WgmmaGemm):
        assert bk % DGRAD_K_BLOCK == 0, gemm.tile
        gemm.ieee_unit = _ieee_unit(gemm.tile, out_features // (DGRAD_SPLITS * bk))
        assert (out_features // (DGRAD_SPLITS * bk)) % gemm.ieee_unit == 0, gemm.tile  # whole units per split

    @cute.jit
    def adaln_proj_dgrad(grad: cute.Tensor, weight: cute.Tensor, partial: cute.Tensor, stream):
        # A = W^T (D, N_out), M-major; C = partial (splits, T, D) seen as (D, T, splits).
        weight_t = cute.make_tensor(weight.iterator, cute.select(weight.layout, mode=[1, 0]))
        partial_t = cute.make_tensor(partial.iterator, cute.select(partial.layout, mode=[2, 1, 0]))
        gemm.launch(weight_t, grad, partial_t, grad, stream)

    rows = cute.sym_int()
    return compile_for(
        arch,
        adaln_proj_dgrad,
        _fake(cutlass.BFloat16, (rows, out_features), (1, 0)),
        _fake(cutlass.BFloat16, (out_features, TEMB), (1, 0)),
        _fake(cutlass.Float32, (DGRAD_SPLITS, rows, TEMB), (2, 1, 0)),
        env_stream(),
    )


def _build_wgrad(arch: str, *, out_features: int, wgmma: bool = False, config: str = "wgrad"):
    # `wgmma` names the variant's family (the spec's variant key); the config says it too.
    assert wgmma == (parse_config(config).family == "wgmma"), (config, wgmma)
    gemm = _gemm(arch, config, "wgrad", a_k_major=False, b_k_major=False, epilogue="bf16", c_n_major=True,
                 dbias_rows=True)
    tile = gemm.tile
    # The TMA-stored C tile has no bounds checks of its own (TMA clips, but the tiles must be whole); a cluster of M
    # tiles needs whole clusters along grid y.
    assert type(gemm) is not _WgmmaTmaStoreGemm or (out_features % tile.bm == 0 and TEMB % tile.bn == 0), config
    assert out_features % (tile.bm * tile.cluster_m) == 0, (out_features, config)

    @cute.jit
    def adaln_proj_wgrad(grad: cute.Tensor, act: cute.Tensor, dweight: cute.Tensor, dbias: cute.Tensor, stream):
        """dW[n, d] = sum_t grad[t, n] act[t, d]: A = grad^T (N_out, T), B = act^T (D, T), both MN-major;
        for T <= FUSED_DBIAS_ROWS also dbias (adaln_bias_grad's bits), else dbias is not touched."""
        gemm.launch(*_transposed(grad, act), dweight, dbias, stream)

    rows = cute.sym_int()
    return compile_for(arch, adaln_proj_wgrad, *_wgrad_fakes(rows, out_features), env_stream())


def _transposed(grad: cute.Tensor, act: cute.Tensor):
    """The dW GEMM's operands as views: A = grad^T (N_out, T), B = act^T (D, T), both MN-major."""
    return (cute.make_tensor(grad.iterator, cute.select(grad.layout, mode=[1, 0])),
            cute.make_tensor(act.iterator, cute.select(act.layout, mode=[1, 0])))


def _wgrad_fakes(rows, out_features: int) -> tuple:
    """grad (T, N_out), act (T, D), dweight (N_out, D), dbias (N_out,): the dW kernels' first four arguments."""
    return (_fake(cutlass.BFloat16, (rows, out_features), (1, 0)), _fake(cutlass.BFloat16, (rows, TEMB), (1, 0)),
            _fake(cutlass.BFloat16, (out_features, TEMB), (1, 0)), _fake(cutlass.BFloat16, (out_features,)))


def _build_wgrad_fold(arch: str, *, out_features: int, config: str):
    gemm = _gemm(arch, config, "wgrad_fold", a_k_major=False, b_k_major=False, epilogue="bf16", c_n_major=True,
                 dbias_rows=False)
    assert out_features % gemm.tile.bm == 0, (out_features, config)

    @cute.jit
    def adaln_proj_wgrad_fold(grad: cute.Tensor, act: cute.Tensor, dweight: cute.Tensor, dbias: cute.Tensor,
                              partial: cute.Tensor, temb: cute.Tensor, dtemb: cute.Tensor, dbias_blocks: cute.Tensor,
                              stream):
        """adaln_proj_wgrad's dW (A = grad^T, B = act^T) while the producer warpgroup's idle warps fold d_temb from
        the d_temb GEMM's partials (adaln_dtemb_fold's bits) and sum db's blocks from the stages into dbias_blocks
        (launch.adaln_projection.dbias_blocks(T), N), folded in block order by a second launch (adaln_bias_grad's
        bits)."""
        gemm.launch(*_transposed(grad, act), dweight, dbias, stream, side=(partial, temb, dtemb, dbias_blocks))
        _bias_grad_fold_kernel(dbias_blocks, dbias).launch(
            grid=(cute.ceil_div(out_features, _EW_THREADS), 1, 1), block=[_EW_THREADS, 1, 1], stream=stream)

    rows, blocks = cute.sym_int(), cute.sym_int()
    return compile_for(
        arch,
        adaln_proj_wgrad_fold,
        *_wgrad_fakes(rows, out_features),
        _fake(cutlass.Float32, (DGRAD_SPLITS, rows, TEMB), (2, 1, 0)),
        _fake(cutlass.Float32, (rows, TEMB), (1, 0)),
        _fake(cutlass.Float32, (rows, TEMB), (1, 0)),
        _fake(cutlass.Float32, (blocks, out_features), (1, 0)),
        env_stream(),
    )


# ---------------------------------------------------------------------------- elementwise helpers
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
def _dtemb_scale(d_act, x):
    """d_temb from d_act = d(loss)/d(silu(temb)) (FP32, the BF16 cast passes it through): d_act * silu'(x)."""
    sig = _sigmoid(x)
    return d_act * (sig + x * sig * (cutlass.Float32(1.0) - sig))


_SILU_COLS = 8  # columns per thread: two 16-byte FP32 loads, one 16-byte BF16 store
_SILU_ROW_VECTORS = TEMB // _SILU_COLS  # 336


@cute.kernel
def _silu_cast_kernel(temb: cute.Tensor, act: cute.Tensor):
    # One thread per 8 columns of the flattened (T, 2688) tensors (rows are 8-aligned): at T = 2048 the
    # one-column-per-thread version ran 43008 CTAs of 128 and took 28 us for 33 MB (H200, ncu).
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
        _fake(cutlass.Float32, (rows, width), (1, 0)),
        _fake(cutlass.BFloat16, (rows, width), (1, 0)),
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
        dtemb[row, col] = _dtemb_scale(d_act, x)
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
        _fake(cutlass.Float32, (DGRAD_SPLITS, rows, width), (2, 1, 0)),
        _fake(cutlass.Float32, (rows, width), (1, 0)),
        _fake(cutlass.Float32, (rows, width), (1, 0)),
        _fake(cutlass.BFloat16, (rows, width), (1, 0)),
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


def _build_bias_grad(arch: str, *, out_features: int):
    assert out_features % _BIAS_COLS_PER_THREAD == 0

    @cute.jit
    def adaln_bias_grad(grad: cute.Tensor, partial: cute.Tensor, dbias: cute.Tensor, stream):
        """dbias = bf16(sum_t grad[t]) in the db order (DBIAS_ROW_BLOCK): FP32 block sums (partial, one row per
        block: launch.adaln_projection.dbias_blocks(T)), folded in block order."""
        grid = (cute.ceil_div(out_features, _EW_THREADS * _BIAS_COLS_PER_THREAD), cute.size(partial, mode=[0]), 1)
        _bias_grad_partial_kernel(grad, partial).launch(grid=grid, block=[_EW_THREADS, 1, 1], stream=stream)
        fold_grid = (cute.ceil_div(out_features, _EW_THREADS), 1, 1)
        _bias_grad_fold_kernel(partial, dbias).launch(grid=fold_grid, block=[_EW_THREADS, 1, 1], stream=stream)

    rows, blocks = cute.sym_int(), cute.sym_int()
    return compile_for(
        arch,
        adaln_bias_grad,
        _fake(cutlass.BFloat16, (rows, out_features), (1, 0)),
        _fake(cutlass.Float32, (blocks, out_features), (1, 0)),
        _fake(cutlass.BFloat16, (out_features,)),
        env_stream(),
    )


_MMA_MARKERS = ("mma.sync.aligned.m16n8k16", ".bf16", "cp.async", "ldmatrix")
# Both mainloops of the wgmma family (cp.async.cg ring, TMA `cp.async.bulk.tensor` ring); each one's own
# instructions are checked per config in tests/test_adaln_projection.py.
_WGMMA_MARKERS = ("wgmma.mma_async.sync.aligned.m64n", "k16.f32.bf16.bf16", "cp.async.")
_NO_ATOMICS = ("atom.", "\tred.")  # deterministic: no atomics anywhere

_LDMATRIX_T = ("ldmatrix.sync.aligned.m8n8.x4.trans",)  # the MN-major operand of the backward GEMMs


def _gemm_spec(role: str, build, family: str, markers=(), **static) -> KernelSpec:
    """The `role` GEMM of a family (`adaln_proj_<role>`): the warp family for every arch, the wgmma family
    (`adaln_proj_<role>_wgmma`) for sm_90a; one variant per out_features and config built for the role."""
    kind = dict(name=f"adaln_proj_{role}_wgmma", ptx_markers=_WGMMA_MARKERS, ptx_forbidden=_NO_ATOMICS + ("mma.sync",),
                archs=("sm_90a",)) if family == "wgmma" else dict(name=f"adaln_proj_{role}",
                                                                 ptx_markers=_MMA_MARKERS + markers,
                                                                 ptx_forbidden=_NO_ATOMICS)
    return KernelSpec(build=build, variants=lambda arch: [dict(out_features=n, config=c, **static)
                                                          for n in OUT_FEATURES for c in picks(role, family)],
                      candidates=lambda arch: [dict(out_features=n, config=c, **static)
                                               for n in OUT_FEATURES for c in candidates(role, family)],
                      **kind)


SPECS = [
    _gemm_spec("fwd", _build_fwd, "warp"),
    _gemm_spec("dgrad", _build_dgrad, "warp", markers=_LDMATRIX_T),
    _gemm_spec("wgrad", _build_wgrad, "warp", markers=_LDMATRIX_T),
    _gemm_spec("fwd", _build_fwd, "wgmma"),
    _gemm_spec("dgrad", _build_dgrad, "wgmma"),
    _gemm_spec("wgrad", _build_wgrad, "wgmma", wgmma=True),
    KernelSpec(
        name="adaln_proj_wgrad_fold",
        build=_build_wgrad_fold,
        variants=lambda arch: [dict(out_features=n, config=c) for n in OUT_FEATURES
                               for c in picks("wgrad_fold", "wgmma")],
        candidates=lambda arch: [dict(out_features=n, config=c) for n in OUT_FEATURES
                                 for c in candidates("wgrad_fold", "wgmma")],
        ptx_markers=_WGMMA_MARKERS + ("cp.async.bulk.tensor", "ld.global.cs.v4"),
        ptx_forbidden=_NO_ATOMICS + ("mma.sync",),
        archs=("sm_90a",),
    ),
    KernelSpec(
        name="adaln_silu_cast",
        build=_build_silu_cast,
        variants=lambda arch: [dict(width=TEMB)],
        ptx_markers=("cvt.rn.bf16x2.f32", "ld.global.v4", "st.global.v4", "div.rn.f32"),
        ptx_forbidden=_NO_ATOMICS,
    ),
    KernelSpec(
        name="adaln_dtemb_fold",
        build=_build_dtemb_fold,
        variants=lambda arch: [dict(width=TEMB)],
        ptx_forbidden=_NO_ATOMICS,
    ),
    KernelSpec(
        name="adaln_bias_grad",
        build=_build_bias_grad,
        variants=lambda arch: [dict(out_features=n) for n in OUT_FEATURES],
        ptx_forbidden=_NO_ATOMICS,
    ),
]
