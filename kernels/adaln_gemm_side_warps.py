"""What the persistent AdaLN GEMM's idle producer warps do (`TmaWgmmaPersistentGemm`'s `side_warps`), as strategies:
warp 0 of the producer warpgroup issues the TMA loads; warps 1 .. 3 run a `SideWarps`. Each strategy says how many
of its warps read (and release) every ring stage, the register split it needs, what it checks of the kernel's
config, and runs its warps (`run`). `SIDE_WARPS` maps a config's `side_warps` field to its strategy.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from h3cute.widths import TEMB

from .adaln_elementwise import dtemb_scale
from .adaln_gemm_base import DBIAS_CHAIN_ROWS, DBIAS_ROW_BLOCK, DGRAD_SPLITS
from .rowwise import vec_view


class SideWarps:
    """No side work: warps 1 .. 3 idle (the config's `side_warps` "none")."""

    name = "none"
    warps = 0  # producer warps besides the TMA warp that run `run`
    dbias_warps = 0  # of them, those that read and release every ring stage (counted by its empty barriers)
    registers = None  # (producer, consumer) registers per thread, where the kernel's default split does not fit

    def check(self, gemm) -> None:
        """Static checks of the kernel's tile and epilogue against what the side warps assume."""


NO_SIDE_WARPS = SideWarps()


class DbiasWarps(SideWarps):
    """db summed by producer warps 1 and 2 at every T (the config's `side_warps` "dbias"): they walk the producer's
    tiles, wait for every stage and release it after reading (the ring's empty barriers count them), and in the
    first N tile's tiles sum each A stage as it lands (`_sum_dbias`); nothing re-reads grad. The ring cannot run
    ahead of them, so they must keep pace with the tensor core: eight independent FP32 chains per lane and 16-byte
    loads. Against the separate adaln_bias_grad: ahead at small T, behind at T = 2048
    (`launch.adaln_projection.wgrad_config_for_rows`)."""

    name = "dbias"
    warps = 2
    dbias_warps = 2  # producer warps 1 and 2: 64 rows each
    # The db warps' eight chains, totals and loads in flight spill below 72 registers (ptxas -v); the consumers keep
    # within 208 (the pingpong tile's 128 accumulators per thread included): 128 x 72 + 256 x 208 = 62464.
    registers = (72, 208)

    def check(self, gemm) -> None:
        tile = gemm.tile
        # A stage is one DBIAS_ROW_BLOCK block of T (the K tail's partial block first) and holds 64 rows per db warp:
        # a warp's 32 lanes are 8 groups of 8 rows (one 16-byte load) x the block's 4 chains of 16 k.
        assert gemm.dbias_rows and tile.bk == DBIAS_ROW_BLOCK and tile.bm == 64 * self.dbias_warps, tile
        assert DBIAS_ROW_BLOCK // DBIAS_CHAIN_ROWS == 4 and DBIAS_CHAIN_ROWS == 16  # _DBIAS_K16_STRIDE per chain

    @cute.jit
    def run(self, gemm, ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx, side):
        if warp_idx <= self.dbias_warps:
            self._sum_dbias(gemm, ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx)

    @cute.jit
    def _sum_dbias(self, gemm, ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx):
        """db by producer warps 1 and 2, in the db order (DBIAS_ROW_BLOCK): they walk the producer's tiles and wait
        for every stage (grad^T: 128 rows x one 64-row block of T, the K tail's zero fill first, which leaves a sum
        from +0 unchanged), and release it after reading. In the first N tile's tiles warp w takes rows
        64w .. 64w + 63 (`_stage_dbias_block`), adds each block sum to its totals and stores its 8 db values after
        the tile's last stage."""
        from cutlass import pipeline

        t = gemm.tile
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


class FoldWarps(SideWarps):
    """The rest of the backward in the dW kernel's idle producer warps while the consumers run the MMAs (the config's
    `side_warps` "fold", the `wgrad_fold` role: `adaln_proj_wgrad_fold`). Warp 1 folds d_temb (`adaln_dtemb_fold`'s
    sums and expression) from the FP32 partials in global memory: it never touches the stage ring, so it cannot
    hold the tensor core back; it is memory-bound and dW (at large T) is not, so launches and their ramps go away.
    Warps 2 and 3 sum db from the stages: they wait for every stage and release it (the ring's empty barriers count
    them); each db block of T is a k tile of dW, so the tiles of N tile j sum the blocks b = j, j + tiles_n, ... of
    their 256 grad^T rows as the stage lands (`_stage_dbias_block`) into dbias_blocks[b], and
    `fold_dbias_blocks` folds the blocks after the kernel: `adaln_bias_grad`'s sums in its order, with no second
    read of grad. The side operands arrive as `side` = (partial (splits, T, D), temb (T, D), dtemb (T, D),
    dbias_blocks (blocks, N) FP32); the dW operand a = bf16(silu(temb)) must already exist (adaln_silu_cast,
    launched first). d_temb work is split over the grid's fold lanes (`persistent_ctas` x 32) by 4-column vectors
    in a grid-stride walk; which lane computes an element never changes its sums."""

    name = "fold"
    fold_warps = 1  # producer warp 1 (warp 0 issues the TMA loads)
    dbias_warps = 2  # producer warps 2 and 3: 128 rows of the 256-row stage each
    warps = fold_warps + dbias_warps
    # The fold warp's loads in flight (12 partial vectors) and the db warps' sums want ~80 registers; the consumers
    # keep within 208 (the 256-row tile's 128 accumulators per thread included; ptxas -v): 128 x 88 + 256 x 208 =
    # 64512.
    registers = (88, 208)

    def check(self, gemm) -> None:
        tile = gemm.tile
        assert not gemm.dbias_rows and gemm.c_n_major, gemm  # db comes from the db warps at every T
        assert tile.bk == DBIAS_ROW_BLOCK and tile.bm % (64 * self.dbias_warps) == 0, tile

    @cute.jit
    def run(self, gemm, ring, storage, sA_layout, mBias, cta, num_tiles, tiles_n, k_tile_count, warp_idx, side):
        if warp_idx <= self.fold_warps:
            self._fold_warps(gemm, side, cta, warp_idx)
        else:
            self._sum_dbias_blocks(gemm, ring, storage, sA_layout, side[3], cta, num_tiles, tiles_n, k_tile_count,
                                   warp_idx - 1 - self.fold_warps)

    @cute.jit
    def _sum_dbias_blocks(self, gemm, ring, storage, sA_layout, blocks, cta, num_tiles, tiles_n, k_tile_count,
                          warp):
        """db warp `warp` (0, 1): rows 128 warp .. + 127 of each stage, 64 rows (8 per lane) at a time. A tile of N
        tile j sums its k tiles b with b % tiles_n == j (k tile b is db block b: the K tail's partial block first,
        as `_k_tiles` places it) into blocks[b, its rows]; every (block, row) is written by exactly one tile."""
        from cutlass import pipeline

        t = gemm.tile
        _check_dbias_offsets(sA_layout, t.bm, t.bk)
        lane = cute.arch.lane_idx()
        rows_per_warp = t.bm // self.dbias_warps
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
    def _fold_warps(self, gemm, side, cta, warp_idx):
        """d_temb[t, d] = (partial[0, t, d] + ... + partial[11, t, d], from +0 in split order) * silu'(temb[t, d])
        (`dtemb_scale`, the fold kernel's expression: the same bits)."""
        partial, temb, dtemb = side[:3]
        rows = cute.size(temb, mode=[0])
        lanes = gemm.tile.persistent_ctas * 32 * self.fold_warps
        me = cta * (32 * self.fold_warps) + (warp_idx - 1) * 32 + cute.arch.lane_idx()
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
                d_act[j] = dtemb_scale(d_act[j], x[j])
            vec_view(dtemb, at, _FOLD_COLS).store(d_act.load())


_FOLD_COLS = 4  # d_temb columns per fold-warp vector: one 16-byte FP32 load per partial


@cute.jit
def _ld_stream(t: cute.Tensor, offset, width: int):
    """`width` consecutive elements of `t` at element offset `offset` (16-byte aligned) as a TensorSSA, loaded with
    ld.global.cs (evict-first in L1 and L2: a stream read once, which should not push the GEMM's operands out)."""
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


SIDE_WARPS = {s.name: s for s in (NO_SIDE_WARPS, DbiasWarps(), FoldWarps())}  # by AdalnGemmConfig.side_warps
