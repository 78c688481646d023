"""TF32 warpgroup MMA (sm_90a `wgmma.mma_async ... .tf32`) for the timestep MLP's 3xTF32 contract.

The CuTe DSL 4.8.1 exposes wgmma for F16/BF16, F8 and I8 only. `MmaTF32Op` builds the TF32 atom the
same way `MmaF16BF16Op` builds its own (`MmaAtomSM90Type` with TFloat32 operands, k = 8): not a public
API of the DSL. TF32 wgmma reads both operands from shared memory, K-major only.

The question this module answers first is whether wgmma gives the bits of the mma.sync kernel
(kernels/gemm_tf32x3.py) under the MLP's numeric contract (docs/timestep_mlp.md): per output element,
from +0, each k8 chunk is three tensor-core products into a fresh chunk sum, in the order
small_a*big_b, big_a*small_b, big_a*big_b, then acc = add.rn.f32(acc, chunk), with
big = x & 0xffffe000 and small = `tf32_small(x, big)`.

`tf32_wgmma_probe` (one warpgroup, a 64 x PROBE_TILE_N tile per CTA, no pipelining): A (64, K) and
B (N, K) FP32, K-major, K a multiple of tile_k; every thread loads elements of the k tile, splits them
into big / small and stores the four operand tiles in wgmma's swizzled K-major layout; then per k8
chunk three m64nNk8 wgmmas (the first with scale-d = 0, or, with `zero_c`, into a zeroed chunk as the
mma.sync kernel does) and one IEEE add per accumulator register. `mask_small` stores small with its
low 13 bits cleared (tells whether wgmma, like mma.sync, reads only the top 19 bits of an operand).
Output C (64, N) FP32: the one-slice partial of gemm_tf32x3 for the same K.

`tf32_split` writes the big and small operand arrays (FP32 bit patterns, K-major; or from X^T through a
32 x 32 shared-memory transpose with a zero-padded K, for the backward's N- and M-major operands), and
`tf32x3_wgmma_gemm` (`Tf32x3WgmmaGemm`: TMA + mbarrier ring, a producer warpgroup, two consumer
warpgroups) computes gemm_tf32x3's "partial" epilogue P[s, m, n] from them under the same chunk
contract. `ROLE_GEMMS`: the variants the launcher runs on sm_90a for T >= its WGMMA_MIN_ROWS (fc2, fc2_dgrad
and the T-deep fc2_wgrad, whose K is the split's zero-padded T). The staging swizzle
is a byte-address XOR on the shared-memory pointer: stores of bit patterns go through a pointer that
keeps it (`_bits_view`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
from cutlass._mlir import ir
from cutlass._mlir.dialects import cute_nvgpu as _cute_nvgpu_ir
from cutlass.cute.atom import make_atom
from cutlass.cute.core import _pack_shape
from cutlass.cute.nvgpu import OperandMajorMode
from cutlass.cute.nvgpu.warpgroup import OperandSource
from cutlass.cute.nvgpu.warpgroup.mma import MmaOp, MmaTraits
from cutlass.utils import LayoutEnum
from cutlass.utils import hopper_helpers as sm90

from h3cute.kernels.adaln_gemm_tma import produce_k_tiles
from h3cute.kernels.gemm_tf32x3 import K_CHUNK, TF32_BIG_MASK, add_rn, f32_bits, fc1_outputs, tf32_pair
from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream, make_fake_compact_tensor
from h3cute.widths import FREQ, MLP_HIDDEN, TEMB

WGMMA_M = 64  # rows of one warpgroup MMA
PROBE_TILE_N = 128
PROBE_THREADS = 128  # one warpgroup


@dataclass(frozen=True)
class MmaTF32Op(MmaOp):
    """wgmma m64nNk8 with TF32 operands and an FP32 accumulator: B from shared memory, A from shared memory
    (`a_src` SMEM; both K-major there) or from registers (RMEM: the threads load it, from any layout)."""

    descriptive_name = "warpgroup TF32 MMA Operation (h3cute)"

    def __init__(self, n: int, a_src: OperandSource = OperandSource.SMEM) -> None:
        super().__init__(cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32, (WGMMA_M, n, K_CHUNK),
                         a_src, OperandMajorMode.K, OperandMajorMode.K)

    def _make_trait(self, *, loc: Optional[ir.Location] = None, ip: Optional[ir.InsertionPoint] = None,
                    **kwargs) -> "MmaTF32Trait":
        shape_mnk = _pack_shape(self.shape_mnk, loc=loc, ip=ip)
        ty = _cute_nvgpu_ir.MmaAtomSM90Type.get(
            shape_mnk.type.attribute,
            self.a_major_mode._to_ir(),
            self.b_major_mode._to_ir(),
            self.a_dtype.mlir_type,
            self.b_dtype.mlir_type,
            self.acc_dtype.mlir_type,
            self.a_src._to_ir(),
        )
        return MmaTF32Trait(make_atom(ty, [cutlass.Boolean(False).ir_value(loc=loc, ip=ip)], loc=loc, ip=ip))


class MmaTF32Trait(MmaTraits):
    pass


def make_tf32_tiled_mma(tile_n: int, warpgroups_m: int = 1) -> cute.TiledMma:
    """warpgroups_m warpgroups stacked along M, each one m64 x tile_n x k8 wgmma per call."""
    return cute.make_tiled_mma(MmaTF32Op(tile_n), cute.make_layout((warpgroups_m, 1, 1)))


def tf32_smem_layout(rows: int, tile_k: int, stages: int, *, is_a: bool):
    """Stage-stacked K-major shared layout for TF32 operand tiles (rows, tile_k), wgmma's swizzle atom
    for a tile_k * 4-byte row (tile_k 32: 128-byte swizzle; 8: 32-byte)."""
    if is_a:
        return sm90.make_smem_layout_a(LayoutEnum.ROW_MAJOR, (rows, 8, tile_k), cutlass.TFloat32, stages)
    return sm90.make_smem_layout_b(LayoutEnum.ROW_MAJOR, (8, rows, tile_k), cutlass.TFloat32, stages)


@cute.jit
def _bits_view(ptr, layout: cute.ComposedLayout):
    """Stage 0 of a swizzled TF32 smem buffer as Int32, keeping the swizzle on the pointer."""
    return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=cutlass.Int32), layout.outer)[None, None, 0]


# --- the probe ------------------------------------------------------------------------------------


class WgmmaTF32Probe:
    """C (64, N) = the one-slice 3xTF32 partial of A (64, K) B (N, K)^T, through TF32 wgmma."""

    def __init__(self, tile_k: int, zero_c: bool, mask_small: bool):
        assert tile_k in (8, 32), tile_k
        self.tile_k = tile_k
        self.zero_c = zero_c
        self.mask_small = mask_small

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, stream):
        sA_layout = tf32_smem_layout(WGMMA_M, self.tile_k, 1, is_a=True)
        sB_layout = tf32_smem_layout(PROBE_TILE_N, self.tile_k, 1, is_a=False)
        tiled_mma = make_tf32_tiled_mma(PROBE_TILE_N)
        self.kernel(mA, mB, mC, sA_layout, sB_layout, tiled_mma).launch(
            grid=[cute.size(mB, mode=[0]) // PROBE_TILE_N, 1, 1], block=[PROBE_THREADS, 1, 1], stream=stream)

    @cute.jit
    def _stage(self, mX_bits: cute.Tensor, sBig: cute.Tensor, sSmall: cute.Tensor, row0, k0, tidx):
        """Split one (rows, tile_k) tile of X into its big and small TF32 operand tiles in smem."""
        rows = cute.size(sBig, mode=[0])
        for i in cutlass.range_constexpr((rows * self.tile_k) // PROBE_THREADS):
            e = i * PROBE_THREADS + tidx
            r = e // self.tile_k
            k = e - r * self.tile_k
            big, small = tf32_pair(mX_bits[row0 + r, k0 + k])
            if cutlass.const_expr(self.mask_small):
                small = small & TF32_BIG_MASK
            sBig[r, k] = big
            sSmall[r, k] = small

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
        tidx, _, _ = cute.arch.thread_idx()
        n_tile, _, _ = cute.arch.block_idx()
        depth = cute.size(mA, mode=[1])

        @cute.struct
        class SharedStorage:
            a_big: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, cute.cosize(sA_layout)], 1024]
            a_small: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, cute.cosize(sA_layout)], 1024]
            b_big: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, cute.cosize(sB_layout)], 1024]
            b_small: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, cute.cosize(sB_layout)], 1024]

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        # wgmma wants the swizzle on the pointer (an affine layout); the staging stores see Int32 bits.
        sA_big = storage.a_big.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sA_small = storage.a_small.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB_big = storage.b_big.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sB_small = storage.b_small.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        # The staging stores write Int32 bit patterns through the same swizzle (recast_tensor would drop
        # the pointer's swizzle: the swizzle is a byte-address one, S<3,4,3> for 128 B rows).
        stA_big = _bits_view(storage.a_big.data_ptr(), sA_layout)
        stA_small = _bits_view(storage.a_small.data_ptr(), sA_layout)
        stB_big = _bits_view(storage.b_big.data_ptr(), sB_layout)
        stB_small = _bits_view(storage.b_small.data_ptr(), sB_layout)
        mA_bits = cute.recast_tensor(mA, cutlass.Int32)
        mB_bits = cute.recast_tensor(mB, cutlass.Int32)

        thr_mma = tiled_mma.get_slice(tidx)
        tCrA_big = tiled_mma.make_fragment_A(thr_mma.partition_A(sA_big))
        tCrA_small = tiled_mma.make_fragment_A(thr_mma.partition_A(sA_small))
        tCrB_big = tiled_mma.make_fragment_B(thr_mma.partition_B(sB_big))
        tCrB_small = tiled_mma.make_fragment_B(thr_mma.partition_B(sB_small))
        gC = cute.local_tile(mC, (WGMMA_M, PROBE_TILE_N), (0, n_tile))
        tCgC = thr_mma.partition_C(gC)
        acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
        chunk = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
        acc.fill(0.0)

        for k_tile in range(depth // self.tile_k):
            k0 = k_tile * self.tile_k
            self._stage(mA_bits, stA_big, stA_small, 0, k0, tidx)
            self._stage(mB_bits, stB_big, stB_small, n_tile * PROBE_TILE_N, k0, tidx)
            # The generic-proxy smem stores must be visible to wgmma (async proxy) before it reads them.
            cute.arch.fence_proxy("async.shared", space="cta")
            cute.arch.sync_threads()
            for kb in cutlass.range_constexpr(self.tile_k // K_CHUNK):
                if cutlass.const_expr(self.zero_c):
                    chunk.fill(0.0)
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                else:
                    tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                cute.nvgpu.warpgroup.fence()
                cute.gemm(tiled_mma, chunk, tCrA_small[None, None, kb, 0], tCrB_big[None, None, kb, 0], chunk)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.gemm(tiled_mma, chunk, tCrA_big[None, None, kb, 0], tCrB_small[None, None, kb, 0], chunk)
                cute.gemm(tiled_mma, chunk, tCrA_big[None, None, kb, 0], tCrB_big[None, None, kb, 0], chunk)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(0)
                for i in cutlass.range_constexpr(cute.size(acc)):
                    acc[i] = add_rn(acc[i], chunk[i])
            cute.arch.sync_threads()  # every wgmma has read the tiles before they are restaged

        for i in cutlass.range_constexpr(cute.size(acc)):
            tCgC[i] = acc[i]


# --- the 3xTF32 GEMM: TMA + mbarrier ring, warp-specialized --------------------------------------


def _stage_ring(barriers, stages: int, stage_bytes: int, consumer_threads: int):
    """The stage ring of the TMA GEMMs here: per stage a full mbarrier expecting `stage_bytes`, an empty one
    taking one arrive per consumer warp."""
    from cutlass import pipeline

    return pipeline.PipelineTmaAsync.create(
        barrier_storage=barriers.data_ptr(),
        num_stages=stages,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumer_threads // 32),
        tx_count=stage_bytes,
        cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
    )


def _tile_loads(bk: int, operands) -> list:
    """`produce_k_tiles` loads: (atom, smem stages, gmem k tiles) for each (atom, TMA tensor, smem, rows, tile
    index) in `operands`, over its (rows, bk) tiles along K."""
    from cutlass.cute.nvgpu import cpasync

    loads = []
    for atom, tma_m, smem, rows, tile in operands:
        g = cute.local_tile(tma_m, (rows, bk), (tile, None))
        s_part, g_part = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(smem, 0, 2),
                                               cute.group_modes(g, 0, 2))
        loads.append((atom, s_part, g_part))
    return loads


@dataclass(frozen=True)
class WgmmaTile:
    """CTA tile of `Tf32x3WgmmaGemm`: 128 rows (two consumer warpgroups of 64), bn columns, bk-deep k tiles
    (bk * 4 bytes = the swizzle row: 32 -> 128 B, 16 -> 64 B), `stages` ring slots of four operand tiles."""

    bn: int = 128
    bk: int = 32
    stages: int = 3

    def __post_init__(self):
        if self.bn % 16 or not 16 <= self.bn <= 128:
            raise ValueError(f"{self}: bn in 16..128, a multiple of 16 (two chunk tiles + acc in registers)")
        if self.bk not in (16, 32):
            raise ValueError(f"{self}: bk must be 16 or 32")
        if self.stages < 2 or self.stage_bytes * self.stages > GEMM_SMEM_BYTES:
            raise ValueError(f"{self}: {self.stages} stages of {self.stage_bytes} B do not fit")

    @property
    def stage_bytes(self) -> int:
        return 2 * (GEMM_BM + self.bn) * self.bk * 4  # big and small of A and B

    def astuple(self) -> tuple:
        return (self.bn, self.bk, self.stages)


GEMM_BM = 128
GEMM_SMEM_BYTES = 220 * 1024  # of the H200's 227 KB per CTA: the rest holds the mbarriers


class Tf32x3WgmmaGemm:
    """P[s, m, n] = slice s of sum_k A[m, k] B[n, k] under the MLP's 3xTF32 chunk contract, with TF32 wgmma.

    Operands come pre-split (`tf32_split`): A_big, A_small (M, K), B_big, B_small (N, K), FP32 bit patterns,
    K-major. Grid (N / bn, ceil(M / 128), splits); CTA (n, m, s) owns one output tile of slice s.
    Warpgroup 0 produces: one thread issues the four TMA tile loads of each k tile into a `stages`-deep
    ring (PipelineTmaAsync: full / empty mbarrier per slot); TMA zero-fills rows past M. Warpgroups 1 and 2
    consume 64 rows each: per k8 chunk j, into chunk tile j % 2, wgmma(small_a, big_b) with scale-d = 0,
    then wgmma(big_a, small_b) and wgmma(big_a, big_b) accumulating; commit; wait_group(1) (chunk j - 1
    is done) and add chunk j - 1 to acc with add.rn.f32; the k tile's last chunk is added after
    wait_group(0), and the slot released, before the next slot is awaited (a wgmma in flight across an
    mbarrier spin makes ptxas serialize every wgmma: adaln_gemm_tma `TmaWgmmaGemm._ieee_mainloop`). The epilogue stores
    acc to P rows < M straight from registers. Per element: the mma.sync kernel's chunk order, so its bits
    if the tensor cores agree (tf32_wgmma_probe).
    Launched with PDL: every thread waits (griddepcontrol.wait) before the first load.
    """

    _PRODUCER_REGS = 40
    _CONSUMER_REGS = 232  # 128 x 40 + 256 x 232 <= 65536; acc + 2 chunk tiles = 3 bn / 2 per thread
    _THREADS = 384

    def __init__(self, tile: WgmmaTile, splits: int):
        self.tile = tile
        self.splits = splits

    @cute.jit
    def __call__(self, mA_big: cute.Tensor, mA_small: cute.Tensor, mB_big: cute.Tensor, mB_small: cute.Tensor,
                 mP: cute.Tensor, stream):
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        sA_layout = tf32_smem_layout(GEMM_BM, t.bk, t.stages, is_a=True)
        sB_layout = tf32_smem_layout(t.bn, t.bk, t.stages, is_a=False)
        # The TMA descriptors take the operands as FP32 (raw bits): a TF32 descriptor would round the pre-split
        # patterns (small carries its own round-half-away in the low 13 bits, which the mma ignores) once more.
        tmas = []
        for mX, layout, rows in ((mA_big, sA_layout, GEMM_BM), (mA_small, sA_layout, GEMM_BM),
                                 (mB_big, sB_layout, t.bn), (mB_small, sB_layout, t.bn)):
            tmas.append(cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mX,
                cute.slice_(layout, (None, None, 0)), (rows, t.bk)))
        tiled_mma = make_tf32_tiled_mma(t.bn, GEMM_BM // WGMMA_M)
        grid = (cute.size(mB_big, mode=[0]) // t.bn, cute.ceil_div(cute.size(mA_big, mode=[0]), GEMM_BM), self.splits)
        self.kernel(mA_big, mP, tmas[0][0], tmas[0][1], tmas[1][0], tmas[1][1], tmas[2][0], tmas[2][1], tmas[3][0],
                    tmas[3][1], sA_layout, sB_layout, tiled_mma).launch(
            grid=grid, block=[self._THREADS, 1, 1], stream=stream, use_pdl=True,
            # setmaxnreg redistributes the registers ptxas gives the CTA: ask for one CTA's full share.
            max_number_threads=[self._THREADS, 1, 1], min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mP: cute.Tensor, tma_ab: cute.CopyAtom, tma_mAb: cute.Tensor,
               tma_as: cute.CopyAtom, tma_mAs: cute.Tensor, tma_bb: cute.CopyAtom, tma_mBb: cute.Tensor,
               tma_bs: cute.CopyAtom, tma_mBs: cute.Tensor, sA_layout: cute.ComposedLayout,
               sB_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_tile, m_tile, split = cute.arch.block_idx()
        if warp_idx == 0:
            for atom in (tma_ab, tma_as, tma_bb, tma_bs):
                cpasync.prefetch_descriptor(atom)

        a_size, b_size = cute.cosize(sA_layout), cute.cosize(sB_layout)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, 2 * t.stages]
            a_big: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, a_size], 1024]
            a_small: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, a_size], 1024]
            b_big: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, b_size], 1024]
            b_small: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, b_size], 1024]

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sA_big = storage.a_big.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sA_small = storage.a_small.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
        sB_big = storage.b_big.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
        sB_small = storage.b_small.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)

        ring = _stage_ring(storage.barriers, t.stages, t.stage_bytes, self._THREADS - 128)
        k_tile_count = cute.size(mA, mode=[1]) // (t.bk * self.splits)
        k_tile_first = split * k_tile_count
        loads = _tile_loads(t.bk, ((tma_ab, tma_mAb, sA_big, GEMM_BM, m_tile),
                                   (tma_as, tma_mAs, sA_small, GEMM_BM, m_tile),
                                   (tma_bb, tma_mBb, sB_big, t.bn, n_tile),
                                   (tma_bs, tma_mBs, sB_small, t.bn, n_tile)))

        # PDL: the operands may be the previous kernel's output (the split).
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self._PRODUCER_REGS)
            if warp_idx == 0:
                produce_k_tiles(ring, t.stages, loads, k_tile_first, k_tile_count)
        else:
            cute.arch.setmaxregister_increase(self._CONSUMER_REGS)
            ctidx = tidx - 128
            thr_mma = tiled_mma.get_slice(ctidx)
            frags = (tiled_mma.make_fragment_A(thr_mma.partition_A(sA_big)),
                     tiled_mma.make_fragment_A(thr_mma.partition_A(sA_small)),
                     tiled_mma.make_fragment_B(thr_mma.partition_B(sB_big)),
                     tiled_mma.make_fragment_B(thr_mma.partition_B(sB_small)))
            mOut = mP[split, None, None]
            gC = cute.local_tile(mOut, (GEMM_BM, t.bn), (m_tile, n_tile))
            cC = cute.local_tile(cute.make_identity_tensor(mOut.shape), (GEMM_BM, t.bn), (m_tile, n_tile))
            tCgC = thr_mma.partition_C(gC)
            tCcC = thr_mma.partition_C(cC)
            acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
            acc.fill(0.0)
            self._mainloop(tiled_mma, acc, frags, ring, k_tile_count)
            rows = cute.size(mOut, mode=[0])
            for i in cutlass.range_constexpr(cute.size(acc)):
                if cute.elem_less(tCcC[i][0], rows):
                    tCgC[i] = acc[i]

    @cute.jit
    def _mainloop(self, tiled_mma, acc, frags, ring, k_tile_count):
        from cutlass import pipeline

        a_big, a_small, b_big, b_small = frags
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        chunks = (cute.make_rmem_tensor(acc.shape, cutlass.Float32), cute.make_rmem_tensor(acc.shape, cutlass.Float32))
        num_chunks = self.tile.bk // K_CHUNK
        for _ in range(k_tile_count):
            ring.consumer_wait(read)
            s = read.index
            for kb in cutlass.range_constexpr(num_chunks):
                chunk = chunks[kb % 2]
                cute.nvgpu.warpgroup.fence()  # the adds that read this chunk tile two chunks ago are done
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                cute.gemm(tiled_mma, chunk, a_small[None, None, kb, s], b_big[None, None, kb, s], chunk)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.gemm(tiled_mma, chunk, a_big[None, None, kb, s], b_small[None, None, kb, s], chunk)
                cute.gemm(tiled_mma, chunk, a_big[None, None, kb, s], b_big[None, None, kb, s], chunk)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)
                if cutlass.const_expr(kb > 0):
                    _add_rn_tile(acc, chunks[(kb - 1) % 2])
            cute.nvgpu.warpgroup.wait_group(0)
            _add_rn_tile(acc, chunks[(num_chunks - 1) % 2])
            ring.consumer_release(read)
            read.advance()


@cute.jit
def _add_rn_tile(acc: cute.Tensor, chunk: cute.Tensor):
    for i in cutlass.range_constexpr(cute.size(acc)):
        acc[i] = add_rn(acc[i], chunk[i])


# --- the 3xTF32 GEMM with the weight split in registers -------------------------------------------

# role -> (K, slices, W K-major, epilogue): the GEMMs whose weight operand is read as it is (F = the weight's rows
# along M: 2688 for fc2, 5376 for the others)
WEIGHT_GEMMS = {
    "fc2": (MLP_HIDDEN, 6, True, "partial"),  # W = w2 (2688, 5376), X = h (T, 5376): P (6, T, 2688)
    "fc2_dgrad": (TEMB, 3, False, "partial"),  # W = w2^T (5376, 2688), w2 read in place, X = grad: P (3, T, 5376)
    "fc1_split": (FREQ, 1, True, "bias_silu_split"),  # W = w1 (5376, 256), X = x: h's big, small (T, 5376)
    "fc1_zh": (FREQ, 1, True, "bias_silu"),  # the backward's recompute: z, h (T, 5376)
}
WEIGHT_FEATURES = {"fc2": TEMB, "fc2_dgrad": MLP_HIDDEN, "fc1_split": MLP_HIDDEN, "fc1_zh": MLP_HIDDEN}


@dataclass(frozen=True)
class WeightTile:
    """CTA tile of `Tf32x3WeightGemm`: 128 weight rows (two consumer warpgroups of 64) x bn activation rows,
    bk-deep k tiles, `stages` ring slots of one raw weight tile and the activation's big and small tiles."""

    bn: int = 128
    bk: int = 32
    stages: int = 4

    def __post_init__(self):
        if self.bn % 8 or not 8 <= self.bn <= 128:
            raise ValueError(f"{self}: bn in 8..128, a multiple of 8 (two chunk tiles + acc in registers)")
        if self.bk != 32:
            raise ValueError(f"{self}: bk must be 32 (the 128-byte swizzle row of the K-major operands)")
        if self.stages < 2 or self.stage_bytes * self.stages > GEMM_SMEM_BYTES:
            raise ValueError(f"{self}: {self.stages} stages of {self.stage_bytes} B do not fit")

    @property
    def stage_bytes(self) -> int:
        return (GEMM_BM + 2 * self.bn) * self.bk * 4  # raw W, big and small X

    def astuple(self) -> tuple:
        return (self.bn, self.bk, self.stages)


class Tf32x3WeightGemm:
    """P[s, t, f] = slice s of sum_k W[f, k] X[t, k] under the MLP's 3xTF32 chunk contract, the weight read as
    it is (no split arrays of it): fc2 and fc2_dgrad (w2), fc1 with its bias + SiLU epilogues (w1).

    The weight is the wgmma's A operand, from registers: TMA brings raw FP32 W tiles (128 x bk; K-major for
    fc2 and fc1, M-major for fc2_dgrad's w2^T) into the ring next to the activation's pre-split big / small
    tiles (h's pair from fc1_split, `tf32_split` of grad or x; K-major, the B operand); each consumer thread
    loads its four W values of a k8 chunk and splits them as `tf32_split` does (big = x & mask, small =
    tf32_small(x, big)). Per chunk:
    wgmma(big_w, small_x) with scale-d = 0, wgmma(small_w, big_x), wgmma(big_w, big_x): the products, k
    positions and order of `Tf32x3WgmmaGemm`'s small_x*big_w, big_x*small_w, big_x*big_w, with the
    operands' roles swapped (the output is D^T: weight rows along M); then acc = add.rn(acc, chunk) as
    there. So the same bits if the tensor core's k8 sum does not depend on which operand a product's
    factors came from (the GPU tests compare the whole op with the mma.sync path).
    The A registers of chunk j are reused by chunk j + 2, after wait_group(1) has retired chunk j; chunk
    j + 1's loads and splits run while chunk j's wgmmas do.
    Grid (ceil(T / bn), F / 128, splits): CTAs launched together share one W tile and differ in their T tile.
    The epilogue stores D^T: P[s, t, f] (or fc1's two outputs) for t < T, straight from registers (eight
    consecutive f per store group). Launched with PDL: X is the previous kernel's output, so every thread
    waits (griddepcontrol.wait) before X is loaded or anything is stored; the producer issues the W tiles of
    the first `stages` k tiles before its wait (`_produce_weight_first`).
    """

    _PRODUCER_REGS = 40
    _CONSUMER_REGS = 232
    _THREADS = 384

    def __init__(self, tile: WeightTile, splits: int, w_k_major: bool, epilogue: str = "partial"):
        if epilogue != "partial" and splits != 1:
            raise ValueError("the fc1 epilogues need the whole K in one CTA (splits=1)")
        self.tile = tile
        self.splits = splits
        self.w_k_major = w_k_major
        self.epilogue = epilogue

    @cute.jit
    def __call__(self, mW: cute.Tensor, mX_big: cute.Tensor, mX_small: cute.Tensor, mP: cute.Tensor,
                 mBias: cute.Tensor, mH: cute.Tensor, stream):
        """mP: P (splits, T, F) for "partial"; for "bias_silu" z (T, F) and mH = h, for "bias_silu_split"
        h's big and small operand arrays (mP, mH); mBias (F,) read by both (unused by "partial")."""
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        w_major = LayoutEnum.ROW_MAJOR if cutlass.const_expr(self.w_k_major) else LayoutEnum.COL_MAJOR
        sW_layout = sm90.make_smem_layout_a(w_major, (GEMM_BM, 8, t.bk), cutlass.Float32, t.stages)
        sX_layout = tf32_smem_layout(t.bn, t.bk, t.stages, is_a=False)
        tmas = []
        for mT, layout, rows in ((mW, sW_layout, GEMM_BM), (mX_big, sX_layout, t.bn), (mX_small, sX_layout, t.bn)):
            tmas.append(cpasync.make_tiled_tma_atom(
                cpasync.CopyBulkTensorTileG2SOp(), mT, cute.slice_(layout, (None, None, 0)), (rows, t.bk)))
        tiled_mma = cute.make_tiled_mma(MmaTF32Op(t.bn, OperandSource.RMEM),
                                      cute.make_layout((GEMM_BM // WGMMA_M, 1, 1)))
        grid = (cute.ceil_div(cute.size(mX_big, mode=[0]), t.bn), cute.size(mW, mode=[0]) // GEMM_BM, self.splits)
        self.kernel(mW, mP, mBias, mH, tmas[0][0], tmas[0][1], tmas[1][0], tmas[1][1], tmas[2][0], tmas[2][1],
                    sW_layout, sX_layout, tiled_mma).launch(
            grid=grid, block=[self._THREADS, 1, 1], stream=stream, use_pdl=True,
            max_number_threads=[self._THREADS, 1, 1], min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mW: cute.Tensor, mP: cute.Tensor, mBias: cute.Tensor, mH: cute.Tensor,
               tma_w: cute.CopyAtom, tma_mW: cute.Tensor,
               tma_xb: cute.CopyAtom, tma_mXb: cute.Tensor, tma_xs: cute.CopyAtom, tma_mXs: cute.Tensor,
               sW_layout: cute.ComposedLayout, sX_layout: cute.ComposedLayout, tiled_mma: cute.TiledMma):
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        t_tile, f_tile, split = cute.arch.block_idx()
        if warp_idx == 0:
            for atom in (tma_w, tma_xb, tma_xs):
                cpasync.prefetch_descriptor(atom)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, 2 * t.stages]
            w: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, cute.cosize(sW_layout)], 1024]
            x_big: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, cute.cosize(sX_layout)], 1024]
            x_small: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, cute.cosize(sX_layout)], 1024]

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        sW = storage.w.get_tensor(sW_layout.outer, swizzle=sW_layout.inner)
        sX_big = storage.x_big.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)
        sX_small = storage.x_small.get_tensor(sX_layout.outer, swizzle=sX_layout.inner)

        ring = _stage_ring(storage.barriers, t.stages, t.stage_bytes, self._THREADS - 128)
        k_tile_count = cute.size(mW, mode=[1]) // (t.bk * self.splits)
        loads = _tile_loads(t.bk, ((tma_w, tma_mW, sW, GEMM_BM, f_tile), (tma_xb, tma_mXb, sX_big, t.bn, t_tile),
                                   (tma_xs, tma_mXs, sX_small, t.bn, t_tile)))

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self._PRODUCER_REGS)
            if warp_idx == 0:
                _produce_weight_first(ring, t.stages, loads, split * k_tile_count, k_tile_count)
            else:
                cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
        else:
            # PDL: X is the previous kernel's output, and P may still be read by an earlier one
            cute.arch.griddepcontrol_wait()
            cute.arch.griddepcontrol_launch_dependents()
            cute.arch.setmaxregister_increase(self._CONSUMER_REGS)
            thr_mma = tiled_mma.get_slice(tidx - 128)
            tCsW = thr_mma.partition_A(sW)  # this thread's W elements: ((2, 2), 1, k8 chunks, stages)
            x_frags = (tiled_mma.make_fragment_B(thr_mma.partition_B(sX_big)),
                       tiled_mma.make_fragment_B(thr_mma.partition_B(sX_small)))
            # D^T: weight rows f along M, activation rows t along N, over P[s] (T, F) (or z / h) seen as (F, T)
            if cutlass.const_expr(self.epilogue == "partial"):
                mOut = mP[split, None, None]
            else:
                mOut = mP
                mH_t = cute.make_tensor(mH.iterator, cute.select(mH.layout, mode=[1, 0]))
            mOut_t = cute.make_tensor(mOut.iterator, cute.select(mOut.layout, mode=[1, 0]))
            gC = cute.local_tile(mOut_t, (GEMM_BM, t.bn), (f_tile, t_tile))
            cC = cute.local_tile(cute.make_identity_tensor(mOut_t.shape), (GEMM_BM, t.bn), (f_tile, t_tile))
            tCgC = thr_mma.partition_C(gC)
            tCcC = thr_mma.partition_C(cC)
            acc = cute.make_rmem_tensor(tCgC.shape, cutlass.Float32)
            acc.fill(0.0)
            self._mainloop(tiled_mma, acc, tCsW, x_frags, ring, k_tile_count)
            cols = cute.size(mOut_t, mode=[1])
            for i in cutlass.range_constexpr(cute.size(acc)):
                coord = tCcC[i]
                if cute.elem_less(coord[1], cols):
                    if cutlass.const_expr(self.epilogue == "partial"):
                        tCgC[i] = acc[i]
                    else:  # gemm_tf32x3's fc1 epilogues
                        tCgC[i], mH_t[coord] = fc1_outputs(acc[i], mBias[coord[0]], self.epilogue)

    @cute.jit
    def _mainloop(self, tiled_mma, acc, tCsW, x_frags, ring, k_tile_count):
        from cutlass import pipeline

        x_big, x_small = x_frags
        w_shape = tCsW[None, None, 0, 0].shape
        # two chunks' (big, small) W registers: chunk j fills pair j % 2
        w_regs = tuple(tuple(cute.make_rmem_tensor(w_shape, cutlass.TFloat32) for _ in range(2)) for _ in range(2))
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.stages)
        chunks = (cute.make_rmem_tensor(acc.shape, cutlass.Float32), cute.make_rmem_tensor(acc.shape, cutlass.Float32))
        num_chunks = self.tile.bk // K_CHUNK
        for _ in range(k_tile_count):
            ring.consumer_wait(read)
            s = read.index
            _split_w_chunk(tCsW[None, None, 0, s], w_regs[0])
            for kb in cutlass.range_constexpr(num_chunks):
                w_big, w_small = w_regs[kb % 2]
                chunk = chunks[kb % 2]
                cute.nvgpu.warpgroup.fence()  # the W registers and the chunk tile are written before the wgmmas
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, False)
                cute.gemm(tiled_mma, chunk, w_big, x_small[None, None, kb, s], chunk)
                tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
                cute.gemm(tiled_mma, chunk, w_small, x_big[None, None, kb, s], chunk)
                cute.gemm(tiled_mma, chunk, w_big, x_big[None, None, kb, s], chunk)
                cute.nvgpu.warpgroup.commit_group()
                cute.nvgpu.warpgroup.wait_group(1)  # chunk kb - 1 is done: its chunk tile and W registers are free
                if cutlass.const_expr(kb > 0):
                    _add_rn_tile(acc, chunks[(kb - 1) % 2])
                if cutlass.const_expr(kb + 1 < num_chunks):
                    _split_w_chunk(tCsW[None, None, kb + 1, s], w_regs[(kb + 1) % 2])
            cute.nvgpu.warpgroup.wait_group(0)
            _add_rn_tile(acc, chunks[(num_chunks - 1) % 2])
            ring.consumer_release(read)
            read.advance()


@cute.jit
def _produce_weight_first(ring, stages: cutlass.Constexpr, loads, k_tile_first, k_tile_count: cutlass.Constexpr):
    """`produce_k_tiles` for (W, X_big, X_small) loads, with the W tiles of the first `stages` k tiles issued
    before griddepcontrol.wait: w2 is never written by the kernel launched right before (the split of h or
    grad), so its first stages stream while that kernel and the launch gap run. Each stage's full barrier
    expects W and X bytes alike, so a stage completes only once its X tiles, loaded after the wait, land."""
    from cutlass import pipeline

    ahead = min(stages, k_tile_count)
    produce = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, stages)
    w_load, x_loads = loads[0], loads[1:]
    for i in cutlass.range_constexpr(ahead):
        ring.producer_acquire(produce)
        cute.copy(w_load[0], w_load[2][None, k_tile_first + i], w_load[1][None, produce.index],
                  tma_bar_ptr=ring.producer_get_barrier(produce))
        produce.advance()
    cute.arch.griddepcontrol_wait()
    for i in cutlass.range_constexpr(ahead):  # stage i holds k tile i: the ring has not wrapped yet
        full = ring.sync_object_full.get_barrier(i)
        for load in x_loads:
            cute.copy(load[0], load[2][None, k_tile_first + i], load[1][None, i], tma_bar_ptr=full)
    for k_tile in range(ahead, k_tile_count):
        ring.producer_acquire(produce)
        full = ring.producer_get_barrier(produce)
        for load in loads:
            cute.copy(load[0], load[2][None, k_tile_first + k_tile], load[1][None, produce.index], tma_bar_ptr=full)
        ring.producer_commit(produce)
        produce.advance()
    ring.producer_tail(produce)


@cute.jit
def _split_w_chunk(w_smem: cute.Tensor, regs):
    """Load this thread's W values of one k8 chunk from shared memory into (big, small) A registers."""
    big = cute.recast_tensor(regs[0], cutlass.Int32)
    small = cute.recast_tensor(regs[1], cutlass.Int32)
    for i in cutlass.range_constexpr(cute.size(w_smem)):
        big[i], small[i] = tf32_pair(f32_bits(w_smem[i]))


# --- the big / small split ------------------------------------------------------------------------

SPLIT_THREADS = 256
TRANSPOSE_TILE = 32


@cute.jit
def _vec4(t: cute.Tensor, offset):
    """The 4 elements of `t` at flat element offset `offset` (a multiple of 4) as Int32 bits, 16-byte aligned."""
    ptr = cute.make_ptr(cutlass.Int32, (t.iterator + offset).toint(), cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout(4))


@cute.kernel
def _split_kernel(mX: cute.Tensor, mBig: cute.Tensor, mSmall: cute.Tensor):
    """Contiguous X (R, K): thread i splits the 16-byte vector i (R * K % 4 == 0, R * K < 2^31)."""
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
    v = (bidx * SPLIT_THREADS + tidx) * 4
    if v < cute.size(mX):
        x = _vec4(mX, v).load()
        big = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Int32)
        small = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Int32)
        for i in cutlass.range_constexpr(4):
            big[i], small[i] = tf32_pair(x[i])
        _vec4(mBig, v).store(big.load())
        _vec4(mSmall, v).store(small.load())


@cute.kernel
def _split_transpose_kernel(mXt: cute.Tensor, mBig: cute.Tensor, mSmall: cute.Tensor):
    """X^T given as contiguous (K, R); out (R, K_out), K_out >= K, columns past K zero. A 32 x 32 tile
    through shared memory (33-word rows: no bank conflicts), loads coalesced along R, stores along K."""
    tx, ty, _ = cute.arch.thread_idx()
    bid_r, bid_k, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_wait()
    cute.arch.griddepcontrol_launch_dependents()
    smem = cutlass.utils.SmemAllocator()
    tile = smem.allocate_tensor(cutlass.Int32, cute.make_layout((TRANSPOSE_TILE, TRANSPOSE_TILE + 1),
                                                                stride=(TRANSPOSE_TILE + 1, 1)), byte_alignment=16)
    mXt_bits = cute.recast_tensor(mXt, cutlass.Int32)
    depth, rows = cute.size(mXt, mode=[0]), cute.size(mXt, mode=[1])
    r0, k0 = bid_r * TRANSPOSE_TILE, bid_k * TRANSPOSE_TILE
    for i in cutlass.range_constexpr(TRANSPOSE_TILE // 8):
        k = k0 + ty + 8 * i
        x = cutlass.Int32(0)  # +0: columns past K add nothing
        if k < depth and r0 + tx < rows:
            x = mXt_bits[k, r0 + tx]
        tile[ty + 8 * i, tx] = x
    cute.arch.sync_threads()
    mBig_bits = cute.recast_tensor(mBig, cutlass.Int32)
    mSmall_bits = cute.recast_tensor(mSmall, cutlass.Int32)
    for i in cutlass.range_constexpr(TRANSPOSE_TILE // 8):
        r = r0 + ty + 8 * i
        if r < rows:
            big, small = tf32_pair(tile[tx, ty + 8 * i])
            mBig_bits[r, k0 + tx] = big
            mSmall_bits[r, k0 + tx] = small


@cute.jit
def _split_launch(mX: cute.Tensor, mBig: cute.Tensor, mSmall: cute.Tensor, stream, transpose: cutlass.Constexpr):
    if cutlass.const_expr(transpose):
        grid = (cute.ceil_div(cute.size(mBig, mode=[0]), TRANSPOSE_TILE), cute.size(mBig, mode=[1]) // TRANSPOSE_TILE,
                1)
        _split_transpose_kernel(mX, mBig, mSmall).launch(grid=grid, block=(TRANSPOSE_TILE, 8, 1), stream=stream,
                                                          use_pdl=True)
    else:
        vectors = cute.size(mX) // 4
        _split_kernel(mX, mBig, mSmall).launch(grid=(cute.ceil_div(vectors, SPLIT_THREADS), 1, 1),
                                               block=(SPLIT_THREADS, 1, 1), stream=stream, use_pdl=True)


def build_split(arch: str, *, transpose: bool):
    """big, small (R, K_out) of X. transpose=False: called (X (R, K), big, small), K_out = K, K % 4 == 0.
    transpose=True: called (X^T (K, R) contiguous, big, small), K_out a multiple of 32 >= K, zero past K
    (a T-deep operand padded to whole k tiles: zero chunks add +0, as the mma.sync kernel's K tail)."""
    rows, depth, depth_out = cute.sym_int(), cute.sym_int(), cute.sym_int()
    x = _compact((depth, rows)) if transpose else _compact((rows, depth))
    out_depth = depth_out if transpose else depth
    return compile_for(arch, _split_launch, x, _compact((rows, out_depth)), _compact((rows, out_depth)),
                       env_stream(), transpose)


# --- builds ----------------------------------------------------------------------------------------

# Tiles to measure (identical bits by contract): 64 KB stages x 3, or 32 KB (bk 16, 64-byte swizzle) x 6.
GEMM_TILES = ((128, 32, 3), (128, 16, 6), (64, 32, 4))
LAUNCH_TILE = (128, 32, 3)  # the launcher's tile for every role (fastest fc2 tile on the H200)
# role -> (K, slices) of the MLP GEMMs the launcher runs on wgmma (kernels/timestep_mlp.ROLES: same K and
# slice count as the mma.sync role, so the same chunk contract and bits). K None: T-deep, the operands
# zero-padded by the transposing split to a multiple of TRANSPOSE_TILE.
ROLE_GEMMS = {
    "fc2": (MLP_HIDDEN, 6),  # h (T, 5376) x w2 (2688, 5376)
    "fc2_dgrad": (TEMB, 3),  # grad (T, 2688) x w2^T (5376, 2688): transposing split of w2
    "fc2_wgrad": (None, 1),  # grad^T (2688, T) x h^T (5376, T): transposing splits, K tail zero
}


def build_gemm(arch: str, *, k: Optional[int], splits: int, tile: tuple):
    """P (splits, M, N) = 3xTF32 slices of A B^T, called (A_big, A_small (M, k), B_big, B_small (N, k), P);
    M and N symbolic (N % bn == 0). k static, a multiple of splits * bk; or None: symbolic (T-deep), one
    slice, a multiple of TRANSPOSE_TILE at run time (the transposing split's zero-padded K)."""
    assert arch == "sm_90a", "wgmma is sm_90a only"
    wtile = WgmmaTile(*tile)
    if k is None:
        if splits != 1 or TRANSPOSE_TILE % wtile.bk:
            raise ValueError("a T-deep GEMM is one slice of whole bk tiles of the padded K")
        k = cute.sym_int(divisibility=TRANSPOSE_TILE)
    elif k % (splits * wtile.bk):
        raise ValueError(f"K = {k} does not split into {splits} slices of whole {wtile.bk}-deep tiles")
    m_dim, n_dim = cute.sym_int(), cute.sym_int()
    gemm = Tf32x3WgmmaGemm(wtile, splits)
    a, b = _compact((m_dim, k)), _compact((n_dim, k))
    return compile_for(arch, gemm, a, _compact((m_dim, k)), b, _compact((n_dim, k)),
                       _compact((splits, m_dim, n_dim)), env_stream())


def build_weight_gemm(arch: str, *, role: str, tile: tuple):
    """`Tf32x3WeightGemm` for `role` in WEIGHT_GEMMS, called (W, X_big, X_small (T, K), outputs...): W is w2
    (2688, 5376) for fc2, the (5376, 2688) view of w2 with strides (1, 5376) for fc2_dgrad, w1 (5376, 256) for
    fc1; outputs P (splits, T, F) for fc2 / fc2_dgrad, (b1, h_big, h_small) for fc1_split, (b1, z, h) for fc1_zh."""
    assert arch == "sm_90a", "wgmma is sm_90a only"
    k, splits, w_k_major, epilogue = WEIGHT_GEMMS[role]
    wtile = WeightTile(*tile)
    if k % (splits * wtile.bk):
        raise ValueError(f"K = {k} does not split into {splits} slices of whole {wtile.bk}-deep tiles")
    features = WEIGHT_FEATURES[role]
    rows = cute.sym_int()
    w = _compact((features, k)) if w_k_major else make_fake_compact_tensor(
        cutlass.Float32, (features, k), stride_order=(0, 1), assumed_align=16)
    gemm = Tf32x3WeightGemm(wtile, splits, w_k_major, epilogue)
    x = (_compact((rows, k)), _compact((rows, k)))
    if epilogue == "partial":
        return compile_for(arch, _weight_partial, gemm, w, *x, _compact((splits, rows, features)), env_stream())
    return compile_for(arch, _weight_bias_silu, gemm, w, *x, _compact((features,)), _compact((rows, features)),
                       _compact((rows, features)), env_stream())


@cute.jit
def _weight_partial(gemm: cutlass.Constexpr, mW, mX_big, mX_small, mP, stream):
    gemm(mW, mX_big, mX_small, mP, mP, mP, stream)  # mP stands in for the unused bias and second output


@cute.jit
def _weight_bias_silu(gemm: cutlass.Constexpr, mW, mX_big, mX_small, mBias, mOut, mH, stream):
    gemm(mW, mX_big, mX_small, mOut, mBias, mH, stream)


WEIGHT_TILE = (128, 32, 4)  # the launcher's tile for fc2 and fc2_dgrad from WGMMA_MIN_ROWS
WEIGHT_FC1_TILE = (64, 32, 4)  # fc1 (K = 256, 8 k tiles): 64-row T tiles, twice the CTAs (168 at T = 256)
# Small T (one T tile of 8 or 16 rows, 126 CTAs): deep rings of 18-20 KB stages, the weight streams.
WEIGHT_SMALL_TILES = ((16, 32, 10), (8, 32, 12))


def gemm_variants() -> list:
    """fc2 in every measured tile (the perf script times them); the other roles in the launcher's tile."""
    fc2_k, fc2_splits = ROLE_GEMMS["fc2"]
    variants = [dict(k=fc2_k, splits=fc2_splits, tile=t) for t in GEMM_TILES]
    for role, (k, splits) in ROLE_GEMMS.items():
        if role != "fc2":
            variants.append(dict(k=k, splits=splits, tile=LAUNCH_TILE))
    return variants


def _compact(shape):
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(cutlass.Float32, shape, stride_order=order, assumed_align=16)


def build_probe(arch: str, *, tile_k: int, zero_c: bool = False, mask_small: bool = False):
    """Called (A (64, K), B (N, K), C (64, N)); K a multiple of tile_k, N of PROBE_TILE_N."""
    assert arch == "sm_90a", "wgmma is sm_90a only"
    k_dim, n_dim = cute.sym_int(), cute.sym_int()
    probe = WgmmaTF32Probe(tile_k, zero_c, mask_small)
    return compile_for(arch, probe, _compact((WGMMA_M, k_dim)), _compact((n_dim, k_dim)),
                       _compact((WGMMA_M, n_dim)), env_stream())


PROBE_VARIANTS = (
    dict(tile_k=8),  # the contract as asked: scale-d = 0 starts each chunk; 32-byte swizzle
    dict(tile_k=32),  # the same with the GEMM's 128-byte swizzle and four chunks per staged tile
    dict(tile_k=32, zero_c=True),  # each chunk from a zeroed C, as mma.sync does
    dict(tile_k=32, mask_small=True),  # small with its low 13 bits cleared
)

SPECS = [
    KernelSpec(
        name="tf32_wgmma_probe",
        build=build_probe,
        variants=lambda arch: [dict(v) for v in PROBE_VARIANTS],
        ptx_markers=("wgmma.mma_async.sync.aligned.m64n128k8.f32.tf32.tf32", "add.rn.f32", "wgmma.wait_group"),
        ptx_forbidden=("atom.", "\tred."),
        archs=("sm_90a",),
    ),
    KernelSpec(
        name="tf32_split",
        build=build_split,
        variants=lambda arch: [dict(transpose=False), dict(transpose=True)],
        ptx_markers=("db, 4096;", "griddepcontrol.wait"),
        ptx_forbidden=("atom.", "\tred."),
        archs=("sm_90a",),
    ),
    KernelSpec(
        name="tf32x3_wgmma_weight_gemm",
        build=build_weight_gemm,
        variants=lambda arch: [dict(role=r, tile=t) for t in (WEIGHT_TILE,) + WEIGHT_SMALL_TILES
                               for r in ("fc2", "fc2_dgrad")] + [dict(role=r, tile=WEIGHT_FC1_TILE)
                                                                for r in ("fc1_split", "fc1_zh")],
        ptx_markers=("wgmma.mma_async.sync.aligned.m64n", ".tf32.tf32", "add.rn.f32", "cp.async.bulk.tensor",
                     "mbarrier.try_wait", "setmaxnreg", "griddepcontrol.wait"),
        ptx_forbidden=("atom.", "\tred."),
        archs=("sm_90a",),
    ),
    KernelSpec(
        name="tf32x3_wgmma_gemm",
        build=build_gemm,
        variants=lambda arch: gemm_variants(),
        ptx_markers=("wgmma.mma_async.sync.aligned.m64n", ".tf32.tf32", "add.rn.f32", "cp.async.bulk.tensor",
                     "mbarrier.try_wait", "setmaxnreg", "griddepcontrol.wait"),
        ptx_forbidden=("atom.", "\tred."),
        archs=("sm_90a",),
    ),
]
