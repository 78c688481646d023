"""The AdaLN GEMMs' TMA + mbarrier warp-specialized mainloop (sm_90a): the ring and register split that the grid and
the persistent kernels share (`TmaWarpSpecialized`), the consumers' chained k16 mainloop (`chained_mainloop`,
written once for every TMA kernel), the producer (`produce_k_tiles`, shared with kernels/wgmma_tf32.py), and the
grid kernel `TmaWgmmaGemm` (mainloop `tma_wgmma`, schedule "grid") with d_temb's IEEE mainloops and tail halves.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from ._adaln_configs import PERSISTENT_CTAS, GemmTile
from .adaln_gemm_base import DGRAD_K_BLOCK, WgmmaGemm, block_mmas, mma_copy, wgmma_k_block

# d_temb's ieee_steps keeps acc and two block tiles (3 x bn / 2 FP32 registers
# per consumer thread) up to bn = 128, acc and one block tile (2 x bn / 2) up to 192, and at 256 two accumulators of
# 128-wide halves and one block tile of a half (3 x 64) (`TmaWgmmaGemm._ieee_mainloop` / `_ieee_serial_mainloop`).
_IEEE_PIPELINED_MAX_BN = 128
_IEEE_MAX_BN = 256


def tail_units(units, ctas: int = PERSISTENT_CTAS, select=lambda cond, a, b: a if cond else b):
    """How many of a `tail_halves` grid's `units` (one CTA per SM each) run whole: all but the last round's where
    that round is at most half full (its units then run as two 128-wide halves each, after the whole ones). The
    kernel's launch calls it on device values (`select` = cutlass.select_); the bits never depend on it."""
    rest = units % ctas
    return select(2 * rest <= ctas, units - rest, units)


def dgrad_n_halves(tile: GemmTile) -> int:
    """How many N halves d_temb's TMA kernel runs a tile as: 2 for the 256-wide tile (wgmma N = 128), else 1."""
    return 2 if tile.bn > 192 else 1


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


def ieee_unit(tile: GemmTile, split_k_tiles: int) -> int:
    """k tiles per drained unit of `TmaWgmmaGemm._ieee_mainloop` (whole units per K split): at least two
    DGRAD_K_BLOCK blocks, three where the split allows (N = 96768: 126 k tiles), which drains a third less often;
    ptxas 13.0 serializes the wgmmas (C7511) at 6 and 7."""
    if tile.bk != DGRAD_K_BLOCK:
        return 1
    return 3 if split_k_tiles % 3 == 0 else 2


def _stage_bytes(layout) -> int:
    """Bytes of one stage of a BF16 operand's (rows, k, stages) shared-memory ring."""
    return cute.size_in_bytes(cutlass.BFloat16, cute.slice_(layout, (None, None, 0)))


class TmaWarpSpecialized(WgmmaGemm):
    """The TMA + mbarrier, warp-specialized pipeline of the TMA wgmma kernels (no mainloop of its own: the grid and
    the persistent kernels each walk their tiles with `chained_mainloop`).

    Warpgroup 0 is the producer: one warp issues TMA tile loads (`cp.async.bulk.tensor`) into a ring of
    `stages` shared-memory stages, each guarded by a full and an empty mbarrier (`PipelineTmaAsync`).
    Warpgroups 1.. consume. TMA zero-fills what lies outside the tensor (rows past T, the dW K tail), so there are
    no predicates and no shared-memory zeroing. The dW K tail keeps the cp.async kernels' placement
    (`CpAsyncRing._k_tiles`): the k tiles are shifted back so the first one is partial (negative K coordinates,
    zero-filled by TMA) and the k16 steps start at T - 16 j: the same k16 groups of products in the same order, so
    the same bits (zero products added to +0 change nothing). The epilogue's barrier is a named barrier of the
    consumer threads.
    Registers: the producer warpgroup drops to `_PRODUCER_REGS`, the consumers rise to
    `_CONSUMER_REGS` (64512 of the SM's 65536 with one CTA per SM, which the configs' smem ensures).
    Clusters: with `tile.cluster_m` = 2 the grid's y pairs (two M tiles of one N tile: the forward's W tiles of
    one T tile) run as one cluster; CTA r of the cluster loads rows [r bn / 2, (r + 1) bn / 2) of each B stage
    into both CTAs (TMA multicast) and its own A, so a full barrier still expects A + B bytes, and every consumer
    warp releases each stage to both CTAs (`_tma_ring`). `tile.cluster_n` = 2 is the same along grid x with A
    shared.
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
        # A cluster shares B along M or A along N, not both (the ring's release counts assume one line of CTAs).
        assert tile.cluster_m in (1, 2) and tile.cluster_n in (1, 2) and tile.cluster_size <= 2, tile
        super().__init__(tile, **kw)

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


def chained_tile(tiled_mma, acc, tCrA, tCrB, stage):
    """One k tile's k16 wgmmas from ring stage `stage`, chained through acc, committed as one group."""
    cute.nvgpu.warpgroup.fence()  # as CUTLASS does per k tile (else ptxas injects it: C7519)
    for k_block in range(cute.size(tCrA, mode=[2])):
        cute.gemm(tiled_mma, acc, tCrA[None, None, k_block, stage], tCrB[None, None, k_block, stage], acc)
    cute.nvgpu.warpgroup.commit_group()


@cute.jit
def chained_mainloop(tiled_mma, acc, tCrA, tCrB, ring, k_tile_count, read, release, handoff=None):
    """The TMA consumers' mainloop: acc += A B^T over the next `k_tile_count` stages of `ring`, k16 wgmmas chained
    through acc (the caller sets ACCUMULATE on `tiled_mma`: acc starts at zero); each tile's batch stays in flight
    while the next stage is awaited and issued, then the previous tile's stage goes back to the producer. Returns
    the consumer states (read, release) advanced past these k tiles, and the caller rebinds its own to them: a
    state advanced in a called function's dynamic loop is a new value, not an update of the caller's object.
    `handoff` = (tile, tile step, tile count, named barrier): once the last batch is issued, before it drains,
    arrive on the barrier if tile + tile step < tile count (the pingpong consumers: the other warpgroup's next
    tile may start waiting on the ring)."""
    ring.consumer_wait(read)
    chained_tile(tiled_mma, acc, tCrA, tCrB, read.index)
    read.advance()
    for _ in range(1, k_tile_count):
        ring.consumer_wait(read)
        chained_tile(tiled_mma, acc, tCrA, tCrB, read.index)
        # The previous tile's batch is done: its stage goes back to the producer.
        cute.nvgpu.warpgroup.wait_group(1)
        ring.consumer_release(release)
        release.advance()
        read.advance()
    if cutlass.const_expr(handoff is not None):
        if handoff[0] + handoff[1] < handoff[2]:
            cute.arch.barrier_arrive(**handoff[3])
    cute.nvgpu.warpgroup.wait_group(0)
    ring.consumer_release(release)
    release.advance()
    return read, release


class TmaWgmmaGemm(TmaWarpSpecialized):
    """The TMA wgmma GEMM on a grid of output tiles (mainloop `tma_wgmma`, schedule "grid"): one CTA per tile (per
    tile and K split for d_temb), its consumers run `chained_mainloop` and `AdalnGemm`'s epilogue; the BF16 C tile
    reuses the A/B stages once every wgmma is done and every load has landed.
    `ieee_steps` (d_temb): each DGRAD_K_BLOCK block of K goes from zero into block tile b % 2 (4 chained k16
    wgmmas), added to acc with IEEE FP32 adds in ascending b, the cp.async kernel's sums; the adds of block b - 1
    run while block b's wgmmas do, except at the end of each unit of 2 or 3 k tiles (`_ieee_mainloop` says why).
    With `cluster_n` = 2 grid x is rounded up to whole clusters, the extra CTA's B rows lie past T (TMA zero-fills
    them) and its C is never stored. The bytes, their zero fill and the k16 walk are the same, so are the bits.
    Tail halves (d_temb, `tile.tail_halves`): a one-line grid of units whose thin last round runs as two CTAs per
    unit, each one 128-wide half (`_tail_grid`, `_tail_unit`; docs/adaln_projection.md, "d_temb's last round").
    """

    _ENTRY_STEM = "h3cutekernelsadaln_gemm_TmaWgmmaGemm_object_at_"

    def __init__(self, tile: GemmTile, **kw):
        super().__init__(tile, **kw)
        assert not self.ieee_steps or tile.bn <= _IEEE_MAX_BN, tile
        self.n_halves = dgrad_n_halves(tile) if self.ieee_steps else 1

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
        from cutlass import pipeline
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

        # k tiles as in CpAsyncRing._k_tiles: shifted back by the K tail so the first tile is the
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
                    whole_mma, half_mma = mma_copy(tiled_mma), mma_copy(tiled_mma)
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
                read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
                release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                chained_mainloop(tiled_mma, acc, tCrA, tCrB, ring, k_tile_count, read, release)
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
    def _ieee_mainloop(self, tiled_mma, acc, tCrA, tCrB, ring, k_tile_count):
        """acc = (((0 + s_0) + s_1) + ...) with s_b the DGRAD_K_BLOCK-deep block b of K summed from zero by the
        tensor core (`wgmma_k_block`) into block tile b % 2, in units of `ieee_unit` k tiles (two blocks or
        more): within a unit, block b - 1 is added (IEEE FP32) while the wgmmas of block b run, and a k tile's
        stage is released once its last block is added; the unit's last block is added after wait_group(0).
        A unit must end drained: a wgmma still in flight across the k-tile loop's back edge makes ptxas
        serialize every wgmma of the kernel (C7514: it no longer proves the added block tile retired), while
        the mbarrier wait inside a unit is fine (ptxas -v, CUDA 13.0). Units of 7 k tiles: C7511."""
        from cutlass import pipeline

        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        blocks = (cute.make_rmem_tensor(acc.shape, cutlass.Float32), cute.make_rmem_tensor(acc.shape, cutlass.Float32))
        mmas = block_mmas(tiled_mma)
        per_tile = self.tile.bk // DGRAD_K_BLOCK
        unit = self.ieee_unit
        for _ in range(k_tile_count // unit):
            for kt in cutlass.range_constexpr(unit):
                ring.consumer_wait(read)
                for g in cutlass.range_constexpr(per_tile):
                    b = kt * per_tile + g
                    wgmma_k_block(mmas, blocks[b % 2], tCrA, tCrB, read.index, g)
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
        mmas = block_mmas(tiled_mma)
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
                    wgmma_k_block(mmas, block, tCrA, tCrBs[h], read.index, g)
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
