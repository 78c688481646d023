"""The AdaLN GEMMs on a cp.async ring: the warp MMA kernel (`WarpMmaGemm`, mainloop `mma_sync`: sm_90a and
sm_100a) and the cp.async wgmma kernels (`CpAsyncWgmmaGemm`, mainloop `cp_async_wgmma`, sm_90a; with C stored by
TMA, `CpAsyncWgmmaTmaStoreGemm`). They share the loads (`CpAsyncRing`): a multistage 16-byte cp.async global ->
shared ring with M/N predicates, the dW K tail as a partial first k tile, and the C tile in A's stages; each runs
its own mainloop over it.
"""
from __future__ import annotations

import math

import cutlass
import cutlass.cute as cute

from ._adaln_configs import GemmTile
from .adaln_gemm_base import COPY_BITS, DGRAD_K_BLOCK, AdalnGemm, WgmmaGemm, bf16_c_stmatrix, block_mmas, wgmma_k_block

_MMA_SHAPE = (16, 8, 16)


class CpAsyncRing:
    """The cp.async operand ring of `WarpMmaGemm` and the `CpAsyncWgmmaGemm` kernels: 16-byte cp.async copies whose
    thread order follows each operand's contiguous mode, the K tail as the first (partial) k tile, the prologue that
    fills stages - 1 stages, and the shared memory (A and B stages; a BF16 C tile in A's stages where it fits).
    Loads only: the mainloops that consume the stages are the kernels' own."""

    def __init__(self, tile: GemmTile, **kw):
        tile.check()  # the cp.async copies' thread tiling
        super().__init__(tile, **kw)

    def _gmem_copy(self, k_major: bool, mn: int):
        """16-byte cp.async tiled copy whose thread order follows the contiguous mode."""
        atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            cutlass.BFloat16,
            num_bits_per_copy=COPY_BITS,
        )
        vec = COPY_BITS // 16
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


class WarpMmaGemm(CpAsyncRing, AdalnGemm):
    """C = epilogue(A B^T) with the warp-level `mma.sync.m16n8k16` BF16 MMA and FP32 accumulators (mainloop
    `mma_sync`; runs unchanged on sm_90a and sm_100a): the cp.async ring, ldmatrix (transposed for MN-major
    operands) into registers double-buffered by k16 block. `ieee_steps`: every k16 MMA into a zeroed step sum,
    added to acc with an IEEE add (else the MMAs chain through acc)."""

    _ENTRY_STEM = "h3cutekernelsadaln_gemm_WarpMmaGemm_object_at_"

    def _smem_layout(self, k_major: bool, mn: int):
        """Stage-stacked smem layout in 8-row (or 8-column) atoms; XOR swizzle kills ldmatrix bank conflicts."""
        bk = self.tile.bk
        major_size = min(bk if k_major else mn, 64)  # elements along the contiguous mode, <= 128 B
        swizzle = cute.make_swizzle(min(int(math.log2(major_size * 16 // COPY_BITS)), 3), 4, 3)
        if k_major:
            atom = cute.make_layout((8, major_size), stride=(major_size, 1))
        else:
            atom = cute.make_layout((major_size, 8), stride=(1, major_size))
        layout = cute.tile_to_shape(atom, (mn, bk, self.tile.stages), (0, 1, 2))
        return layout, swizzle

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


class CpAsyncWgmmaGemm(CpAsyncRing, WgmmaGemm):
    """The GEMM with the sm_90a warpgroup MMA on the cp.async ring (mainloop `cp_async_wgmma`).

    Same loads (16-byte cp.async into wgmma's swizzled layouts), same K walk (k16 steps in ascending
    order into one FP32 accumulator per element), same epilogue as `WarpMmaGemm`; warps_m / 4 warpgroups tile M in
    64-row slabs. Each k tile: cp.async wait -> proxy fence -> barrier -> wgmma on that stage ->
    wait for the wgmma before its stage is refilled. `ieee_steps` (d_temb): per DGRAD_K_BLOCK block of K,
    `wgmma_k_block` into a zeroed block tile, wait, IEEE adds into acc.
    """

    _ENTRY_STEM = "h3cutekernelsadaln_gemm_WgmmaGemm_object_at_"

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
        # ieee_steps: every DGRAD_K_BLOCK of K goes into a fresh block tile (`wgmma_k_block`), added with IEEE adds.
        if cutlass.const_expr(self.ieee_steps):
            mmas = block_mmas(tiled_mma)
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
                    wgmma_k_block(mmas, step, tCrA, tCrB, smem_read, k_group)
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


class CpAsyncWgmmaTmaStoreGemm(CpAsyncWgmmaGemm):
    """`CpAsyncWgmmaGemm`'s dW GEMM (BF16 C, N-major) with C stored by TMA: the same cp.async ring and k16 walk (the
    same bits), then BF16 fragments -> `stmatrix` into a 128B-swizzled (bm, bn) C tile in A's stages (free once
    every warpgroup's wgmmas are done) -> `fence.proxy.async` -> barrier -> one thread issues the bulk tensor
    store (`cp.async.bulk.tensor` shared -> global) and, after db (`dbias_rows`, `_store_dbias`), waits
    `cp.async.bulk.wait_group.read 0` (shared memory must outlive the store's reads) before the CTA exits.
    Why: at small T dW's 520 MB of writes are the cost, and the padded-tile epilogue's scalar st.shared, then
    ld.shared.v4 and st.global.v4 per thread fill the shared-memory instruction queue (the kernel stalls on MIO
    throttle well short of DRAM bandwidth); stmatrix.x4 moves 8 values per instruction and the store is one TMA.
    Needs whole tiles (the dW shapes: N_out % bm == 0, D % bn == 0; the build asserts it)."""

    _ENTRY_STEM = "h3cutekernelsadaln_gemm_WgmmaTmaStoreGemm_object_at_"

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
