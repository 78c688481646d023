"""The persistent TMA wgmma GEMM of the AdaLN family (mainloop `tma_wgmma`, schedule "persistent", C stored by TMA):
a fixed grid of `tile.persistent_ctas` CTAs walking the output tiles, its consumers cooperative (both warpgroups on
each tile) or pingpong (the warpgroups take whole tiles in turn), and whatever its idle producer warps do as a
`SideWarps` strategy (kernels/adaln_gemm_side_warps.py).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ._adaln_configs import GemmTile
from .adaln_gemm_base import bf16_c_stmatrix
from .adaln_gemm_side_warps import NO_SIDE_WARPS, SideWarps
from .adaln_gemm_tma import TmaWarpSpecialized, chained_mainloop


def c_buffers(tile: GemmTile) -> int:
    """The persistent cooperative kernels' C buffers: two at 128 rows (a store reads one while the next tile's go to
    the other), one at 256 (two would not fit beside the stages). The pingpong kernel has one per warpgroup."""
    return 2 if tile.bm == 128 else 1


class TmaWgmmaPersistentGemm(TmaWarpSpecialized):
    """The dW GEMM (C = A B^T, BF16 C N-major) or the forward (`bias_bf16`: C = out^T M-major, + bias per M row in
    FP32 and one rounding, as `_store_c_bf16`) on the TMA ring, persistent: `tile.persistent_ctas` CTAs,
    CTA c computes output tiles i = c, c + G, c + 2G, ... (N fastest: i -> (i // tiles_n, i % tiles_n); the CTAs
    resident together share an A tile: a block of grad^T, or of W), a fixed static schedule. The producer warp
    streams every tile's A (grad^T, or W) and B (a^T, or a) k tiles through one ring, running ahead into the next
    tile while the consumers finish the current one. Per tile the consumers run the chained k16 walk from a zero
    accumulator (`chained_mainloop`, the K tail placed as in `_k_tiles`: the same bits as every wgmma config of
    the GEMM), then store C through shared memory: BF16 fragments -> C buffer (tile count % `c_buffers`; stmatrix
    into the swizzled layout TMA reads) -> one TMA store (`cp.async.bulk.tensor` shared -> global) issued by one
    thread, which waits only before a buffer is reused (`cp.async.bulk.wait_group.read c_buffers - 1`: the store
    that last read it is done reading). So the stores of tile i overlap the loads and MMAs of tile i + 1. 256-row
    tiles: each warpgroup's wgmma repeats along M (two 64-row slabs), one C buffer. db (`dbias_rows`): the tiles of
    the first N tile write it with `_store_dbias` for T <= FUSED_DBIAS_ROWS (the same order and bits), unless side
    warps sum it (`side_warps`: a `SideWarps` strategy, which may also set the register split)."""

    # The entry names of the variants by side warps (`AdalnGemm.__str__`).
    _ENTRY_STEMS = {"none": "h3cutekernelsadaln_gemm_TmaWgmmaPersistentGemm_object_at_",
                    "dbias": "h3cutekernelsadaln_gemm_TmaWgmmaPersistentDbGemm_object_at_",
                    "fold": "h3cutekernelsadaln_gemm_TmaWgmmaPersistentFoldGemm_object_at_"}

    def __init__(self, tile: GemmTile, side_warps: SideWarps = NO_SIDE_WARPS, **kw):
        super().__init__(tile, **kw)
        self.side_warps = side_warps
        if side_warps.registers is not None:
            self._PRODUCER_REGS, self._CONSUMER_REGS = side_warps.registers
        assert tile.persistent_ctas > 0 and tile.cluster_size == 1, tile
        # dW: N-major C, no bias; the forward: M-major C (out^T), bias per row, the cooperative consumers only.
        assert (self.c_n_major and self.epilogue == "bf16") or \
            (not self.c_n_major and self.epilogue == "bias_bf16" and not tile.pingpong), (tile, kw)
        assert self.k_splits == 1 and not self.ieee_steps, kw
        side_warps.check(self)

    @property
    def _entry_stem(self) -> str:
        return self._ENTRY_STEMS[self.side_warps.name]

    @property
    def _stage_readers(self) -> int:
        return super()._stage_readers + self.side_warps.dbias_warps

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
        # CpAsyncRing._k_tiles (the first one partial, negative K coordinates zero-filled by TMA).
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
            elif cutlass.const_expr(self.side_warps.warps > 0):
                self.side_warps.run(self, ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count,
                                    warp_idx, side)
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

            read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            buffer = cutlass.Int32(0)
            for tile in range(cta, num_tiles, t.persistent_ctas):
                m_tile = tile // tiles_n
                n_tile = tile - m_tile * tiles_n
                acc.fill(0.0)
                after = chained_mainloop(tiled_mma, acc, tCrA, tCrB, ring, k_tile_count, read, release)
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
                if cutlass.const_expr(self.dbias_rows and self.side_warps.dbias_warps == 0):
                    self._store_dbias(mA, mBias, n_tile, m_tile, ctidx)
                buffer = (buffer + 1) % self._c_buffers
                # The states are rebound last, so the tile loop carries its values in the order the PTX digest pins
                # (buffer, then the states).
                read, release = after
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
            # Once this tile's last batch is issued, the next tile's mainloop may wait on the ring.
            read, release = chained_mainloop(tiled_mma, acc, tCrA, tCrB, ring, k_tile_count, read, release,
                                             handoff=(tile, t.persistent_ctas, num_tiles, their_turn))
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
            if cutlass.const_expr(self.dbias_rows and self.side_warps.dbias_warps == 0):
                self._store_dbias(mA, mBias, n_tile, m_tile, wtidx)
        if wtidx == 0:  # shared memory must outlive the last stores' reads
            cute.arch.cp_async_bulk_wait_group(0, read=True)
