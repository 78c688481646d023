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

`tf32x3_wgmma_gemm` (`Tf32x3WgmmaGemm`: TMA of the raw FP32 operand tiles, K- or MN-major, into a
staging ring; the producer warpgroup splits each staged tile into its big / small tiles in wgmma's
swizzled K-major layout, a second ring; two consumer warpgroups run the wgmmas) computes gemm_tf32x3's
"partial" epilogue P[s, m, n] under the same chunk contract. `ROLE_GEMMS`: the variants the launcher runs
on sm_90a for T >= its WGMMA_MIN_ROWS (fc2, fc2_dgrad and the T-deep fc2_wgrad). Swizzled smem is written
as Int32 bit patterns through pointers that keep the byte swizzle (`_bits_view`) or at offsets checked
against the layouts at build time (`_transpose_plan`).
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

from h3cute.kernels.gemm_tf32x3 import K_CHUNK, TF32_BIG_MASK, add_rn, tf32_small
from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream, make_fake_compact_tensor

WGMMA_M = 64  # rows of one warpgroup MMA
PROBE_TILE_N = 128
PROBE_THREADS = 128  # one warpgroup


@dataclass(frozen=True)
class MmaTF32Op(MmaOp):
    """wgmma m64nNk8 with TF32 A and B from shared memory (both K-major) and an FP32 accumulator."""

    descriptive_name = "warpgroup TF32 MMA Operation (h3cute)"

    def __init__(self, n: int) -> None:
        super().__init__(cutlass.TFloat32, cutlass.TFloat32, cutlass.Float32, (WGMMA_M, n, K_CHUNK),
                         OperandSource.SMEM, OperandMajorMode.K, OperandMajorMode.K)

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
def _bits_tensor(ptr, layout: cute.ComposedLayout):
    """A swizzled, stage-stacked smem buffer as Int32 (row, k, stage), keeping the swizzle on the pointer."""
    return cute.make_tensor(cute.recast_ptr(ptr, layout.inner, dtype=cutlass.Int32), layout.outer)


@cute.jit
def _bits_view(ptr, layout: cute.ComposedLayout):
    """Stage 0 of `_bits_tensor`."""
    return _bits_tensor(ptr, layout)[None, None, 0]


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
            x = mX_bits[row0 + r, k0 + k]
            big = x & TF32_BIG_MASK
            small = tf32_small(x, big)
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


# --- the 3xTF32 GEMM: TMA of the raw operands, split in shared memory, warp-specialized wgmma ------


@dataclass(frozen=True)
class WgmmaTile:
    """CTA tile of `Tf32x3WgmmaGemm`: 128 rows (two consumer warpgroups of 64), bn columns, bk-deep k tiles
    (bk * 4 bytes = the K-major swizzle row: 32 -> 128 B, 16 -> 64 B); `stages` ring slots of the raw FP32
    A and B tiles (TMA -> converters), `mma_stages` ring slots of their big / small tiles (converters -> wgmma)."""

    bn: int = 128
    bk: int = 32
    stages: int = 3
    mma_stages: int = 2

    def __post_init__(self):
        if self.bn != 128:
            raise ValueError(f"{self}: bn must be 128 (the converters' 32-row blocks: four per warp and k block)")
        if self.bk not in (16, 32):
            raise ValueError(f"{self}: bk must be 16 or 32")
        if self.stages < 2 or self.mma_stages < 2 or self.smem_bytes > GEMM_SMEM_BYTES:
            raise ValueError(f"{self}: {self.stages} raw + {self.mma_stages} big/small slots "
                             f"({self.smem_bytes} B) do not fit {GEMM_SMEM_BYTES} B")

    @property
    def raw_bytes(self) -> int:
        return (GEMM_BM + self.bn) * self.bk * 4  # the raw A and B tiles of one k tile

    @property
    def smem_bytes(self) -> int:
        return self.stages * self.raw_bytes + self.mma_stages * 2 * self.raw_bytes  # big and small of A and B

    def astuple(self) -> tuple:
        return (self.bn, self.bk, self.stages, self.mma_stages)


GEMM_BM = 128
# The H200's 227 KB per CTA, less 1 KB for the mbarriers and the padding to the tiles' 1 KB alignment.
GEMM_SMEM_BYTES = 226 * 1024
CONVERT_BLOCK = 32  # rows (and k, up to bk) of the converters' transposing blocks: one row per lane


def _raw_smem_layout(rows: int, tile_k: int, stages: int, mn_major: bool, is_a: bool):
    """Raw FP32 staging tiles (rows, tile_k): wgmma's K-major layout (then the split is position-wise), or
    for an MN-major operand its MN-major swizzled layout (128-byte rows along MN, what TMA can write)."""
    if not mn_major:
        return tf32_smem_layout(rows, tile_k, stages, is_a=is_a)
    if is_a:
        return sm90.make_smem_layout_a(LayoutEnum.COL_MAJOR, (rows, 8, tile_k), cutlass.Float32, stages)
    return sm90.make_smem_layout_b(LayoutEnum.COL_MAJOR, (8, rows, tile_k), cutlass.Float32, stages)


@cute.jit
def _split_slot_flat(raw_ptr, big_ptr, small_ptr, slot_elems: cutlass.Constexpr, raw_slot, mma_slot, tidx):
    """Big / small of one K-major raw tile: the same swizzled layout on both sides, so element i of the raw
    slot goes to element i of the big and small slots; thread t takes 16-byte vectors t, t + 128, ...
    (each quarter-warp covers 128 contiguous bytes: no bank conflicts)."""
    vectors = cute.make_layout((4, 1 << 24), stride=(1, 4))  # a flat view over the buffer, 16-byte columns
    raw = cute.make_tensor(cute.recast_ptr(raw_ptr, dtype=cutlass.Int32), vectors)
    big = cute.make_tensor(cute.recast_ptr(big_ptr, dtype=cutlass.Int32), vectors)
    small = cute.make_tensor(cute.recast_ptr(small_ptr, dtype=cutlass.Int32), vectors)
    vecs = slot_elems // 4
    raw_base, mma_base = raw_slot * vecs, mma_slot * vecs
    for i in cutlass.range_constexpr(vecs // CONVERTER_THREADS):
        v = i * CONVERTER_THREADS + tidx
        x = raw[None, raw_base + v].load()
        hi = x & TF32_BIG_MASK
        lo = cute.make_rmem_tensor(cute.make_layout(4), cutlass.Int32)
        for j in cutlass.range_constexpr(4):
            lo[j] = tf32_small(x[j], hi[j])
        big[None, mma_base + v].store(hi)
        small[None, mma_base + v].store(lo.load())


def _element_offset(layout: cute.ComposedLayout, m: int, k: int) -> int:
    """Stage-0 element offset of (m, k) in a swizzled TF32/FP32 smem layout (its swizzle acts on byte addresses;
    stage bases are multiples of 1 KB, so the swizzle of a stage is that of stage 0). Trace-time ints."""
    sw = layout.inner
    x = 4 * cute.crd2idx((m, k, 0), layout.outer)
    mask = ((1 << sw.num_bits) - 1) << (sw.num_base + sw.num_shift)
    return (x ^ ((x & mask) >> sw.num_shift)) // 4


@dataclass(frozen=True)
class _TransposePlan:
    """Static addressing of `_split_slot_transposing` for one operand (element offsets within a slot). Warp w
    converts the rows 32 w .. 32 w + 31 (`rows` = 32 x the converter warps), k block by k block (kb = min(bk,
    32) deep); lane l takes row 32 w + l and at step r of k block j the column kb j + ((l >> shift) ^ r) % kb,
    at raw offset raw_k_block[j] + w raw_warp + (raw_lane(l) ^ raw_step[r]), raw_lane(l) the XOR of
    raw_lane_bits[i] over the set bits i of l; the big / small offset likewise (mma_*)."""

    kb: int
    raw: tuple  # (k_block, warp, lane_bits, step)
    mma: tuple


def _transpose_plan(raw_layout: cute.ComposedLayout, mma_layout: cute.ComposedLayout, rows: int,
                    depth: int) -> _TransposePlan:
    """The first diagonal (column ((lane >> shift) ^ r) % kb at step r, shift 0..3) whose accesses hit 32
    distinct banks per warp on both sides (bk 32: shift 0; the 64-byte K-major rows of bk 16 need shift 1);
    checks for every element that the decomposition gives both layouts' own offsets."""
    kb = min(depth, CONVERT_BLOCK)
    warps = CONVERTER_THREADS // 32
    if rows != CONVERT_BLOCK * warps or depth % kb:
        raise ValueError(f"transposing split: {rows} x {depth} tiles are not {warps} warps' 32-row blocks")
    for shift in range(4):
        parts = [_diagonal(layout, kb, depth, warps, shift) for layout in (raw_layout, mma_layout)]
        if all(part is not None for part in parts):
            return _TransposePlan(kb, *parts)
    raise ValueError(f"transposing split: no conflict-free diagonal for {raw_layout} -> {mma_layout}")


def _diagonal(layout: cute.ComposedLayout, kb: int, depth: int, warps: int, shift: int):
    """(k_block, warp, lane_bits, step) of `_TransposePlan` for one layout, or None on a bank conflict; raises
    where the XOR decomposition misses the layout's offset."""
    def off(m, k):
        return _element_offset(layout, m, k)

    k_block = tuple(off(0, kb * j) for j in range(depth // kb))
    warp = off(CONVERT_BLOCK, 0) - off(0, 0)
    lane_bits = tuple(off(1 << b, ((1 << b) >> shift) % kb) - off(0, 0) for b in range(5))
    step = tuple(off(0, r) - off(0, 0) for r in range(kb))
    conflict_free = True
    for j in range(depth // kb):
        for w in range(warps):
            for r in range(kb):
                banks = set()
                for lane in range(32):
                    lane_part = 0
                    for b in range(5):
                        if lane >> b & 1:
                            lane_part ^= lane_bits[b]
                    got = k_block[j] + w * warp + (lane_part ^ step[r])
                    if got != off(CONVERT_BLOCK * w + lane, kb * j + ((lane >> shift) ^ r) % kb):
                        raise ValueError(f"transposing split: the XOR addressing misses {layout} at k block {j}, "
                                         f"warp {w}, lane {lane}, step {r}")
                    banks.add(got % 32)
                conflict_free &= len(banks) == 32
    return (k_block, warp, lane_bits, step) if conflict_free else None


@cute.jit
def _lane_offset(lane, bits: cutlass.Constexpr):
    """XOR of bits[i] over the set bits i of lane (a GF(2)-linear map, checked by `_transpose_plan`)."""
    acc = cutlass.Int32(0)
    for b in cutlass.range_constexpr(5):
        acc = acc ^ (((lane >> b) & 1) * bits[b])
    return acc


@cute.jit
def _split_slot_transposing(raw_ptr, big_ptr, small_ptr, plan: cutlass.Constexpr, raw_slot_elems: cutlass.Constexpr,
                            raw_slot, mma_slot, raw_lane, mma_lane, warp):
    """Big / small (K-major) of one MN-major raw tile, element by element along `_transpose_plan`'s diagonals:
    with the raw tile's MN-major 128-byte swizzle (16-byte unit m / 4 XOR k % 8) and the K-major 128- or
    64-byte one (unit k / 4 XOR m % 8, or (m / 2) % 4), a warp's 32 loads and its 32 stores each hit 32
    banks (checked at build time). raw_lane / mma_lane: this lane's `_lane_offset`s, computed once."""
    flat = cute.make_layout(1 << 24)
    raw = cute.make_tensor(cute.recast_ptr(raw_ptr, dtype=cutlass.Int32), flat)
    big = cute.make_tensor(cute.recast_ptr(big_ptr, dtype=cutlass.Int32), flat)
    small = cute.make_tensor(cute.recast_ptr(small_ptr, dtype=cutlass.Int32), flat)
    raw_k_block, raw_warp, _, raw_step = plan.raw
    mma_k_block, mma_warp, _, mma_step = plan.mma
    raw_row = raw_slot * raw_slot_elems + warp * raw_warp
    mma_row = mma_slot * raw_slot_elems + warp * mma_warp
    for j in cutlass.range_constexpr(len(raw_k_block)):
        for r in cutlass.range_constexpr(plan.kb):
            x = raw[raw_row + raw_k_block[j] + (raw_lane ^ raw_step[r])]
            hi = x & TF32_BIG_MASK
            e = mma_row + mma_k_block[j] + (mma_lane ^ mma_step[r])
            big[e] = hi
            small[e] = tf32_small(x, hi)


CONVERTER_THREADS = 128  # the producer warpgroup; its warp 0 also issues the TMA loads


class Tf32x3WgmmaGemm:
    """P[s, m, n] = slice s of sum_k A[m, k] B[n, k] under the MLP's 3xTF32 chunk contract, with TF32 wgmma.

    A (M, K) and B (N, K) are the raw FP32 operands, each K-major or MN-major (`a_mn`, `b_mn`: a (rows, K) view
    with strides (1, rows) of a row-major (K, rows) tensor, e.g. grad^T of grad). Grid (N / bn, ceil(M / 128),
    splits); CTA (n, m, s) owns one output tile of slice s. 384 threads:

    - Warpgroup 0 (the producer, `CONVERTER_THREADS`): one elected thread of warp 0 keeps the TMA loads of the
      raw A and B k tiles `stages - 1` tiles ahead in the raw ring (PipelineTmaAsync; TMA zero-fills rows
      past M and k past K, the T-deep K tail). All 128 threads then turn each raw k tile into its big / small
      tiles in wgmma's swizzled K-major layout (big = x & 0xffffe000, small = `tf32_small(x, big)`: the bits
      tf32_split wrote and the mma.sync kernel forms in registers), in the operand ring (PipelineAsync);
      each thread fences its generic-proxy stores for the async proxy (wgmma) before it arrives. The raw slot
      is released once converted, the big / small slot when the consumers are done with it.
      K-major raw tiles are staged in the K-major swizzled layout itself, so the split is position-wise
      (16-byte vectors); MN-major ones in the MN-major 128-byte swizzle, read and written element by element
      along a diagonal that keeps both sides free of bank conflicts (`_split_slot_transposing`).
    - Warpgroups 1 and 2 (the consumers) take 64 rows each: per k8 chunk j, into chunk tile j % 2,
      wgmma(small_a, big_b) with scale-d = 0, then wgmma(big_a, small_b) and wgmma(big_a, big_b) accumulating;
      commit; wait_group(1) (chunk j - 1 is done) and add chunk j - 1 to acc with add.rn.f32; the k tile's last
      chunk is added after wait_group(0), and the slot released, before the next slot is awaited (a wgmma in
      flight across an mbarrier spin makes ptxas serialize every wgmma: adaln_gemm `_ieee_mainloop`). The
      epilogue stores acc to P rows < M straight from registers.
    Per element: the mma.sync kernel's chunk order over the same operand bits, so its bits (tests).
    Launched with PDL: every thread waits (griddepcontrol.wait) before the first load.
    """

    # setmaxnreg: the CTA launches at 168 registers per thread (384 threads, one CTA per SM); the producer
    # gives up 168 - 80 per thread, the consumers take 208 (128 x 80 + 256 x 208 <= 384 x 168). The consumers
    # hold acc + 2 chunk tiles (3 bn / 2 registers); ptxas 13.0 spilled the fc2_wgrad converters (64
    # transposed elements per k tile) at 56 and 64 registers, none at 80.
    _PRODUCER_REGS = 80
    _CONSUMER_REGS = 208
    _THREADS = 384

    def __init__(self, tile: WgmmaTile, splits: int, a_mn: bool, b_mn: bool):
        self.tile = tile
        self.splits = splits
        self.a_mn = a_mn
        self.b_mn = b_mn

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mP: cute.Tensor, stream):
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        rA_layout = _raw_smem_layout(GEMM_BM, t.bk, t.stages, self.a_mn, is_a=True)
        rB_layout = _raw_smem_layout(t.bn, t.bk, t.stages, self.b_mn, is_a=False)
        sA_layout = tf32_smem_layout(GEMM_BM, t.bk, t.mma_stages, is_a=True)
        sB_layout = tf32_smem_layout(t.bn, t.bk, t.mma_stages, is_a=False)
        # FP32 descriptors: TMA copies the raw bits (a TF32 descriptor may round them on the way).
        tma_a, tma_mA = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mA,
                                                    cute.slice_(rA_layout, (None, None, 0)), (GEMM_BM, t.bk))
        tma_b, tma_mB = cpasync.make_tiled_tma_atom(cpasync.CopyBulkTensorTileG2SOp(), mB,
                                                    cute.slice_(rB_layout, (None, None, 0)), (t.bn, t.bk))
        tiled_mma = make_tf32_tiled_mma(t.bn, GEMM_BM // WGMMA_M)
        grid = (cute.size(mB, mode=[0]) // t.bn, cute.ceil_div(cute.size(mA, mode=[0]), GEMM_BM), self.splits)
        self.kernel(mA, mP, tma_a, tma_mA, tma_b, tma_mB, rA_layout, rB_layout, sA_layout, sB_layout,
                    tiled_mma).launch(
            grid=grid, block=[self._THREADS, 1, 1], stream=stream, use_pdl=True,
            # setmaxnreg redistributes the registers ptxas gives the CTA: ask for one CTA's full share.
            max_number_threads=[self._THREADS, 1, 1], min_blocks_per_mp=1)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mP: cute.Tensor, tma_a: cute.CopyAtom, tma_mA: cute.Tensor,
               tma_b: cute.CopyAtom, tma_mB: cute.Tensor, rA_layout: cute.ComposedLayout,
               rB_layout: cute.ComposedLayout, sA_layout: cute.ComposedLayout, sB_layout: cute.ComposedLayout,
               tiled_mma: cute.TiledMma):
        from cutlass import pipeline
        from cutlass.cute.nvgpu import cpasync

        t = self.tile
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        n_tile, m_tile, split = cute.arch.block_idx()
        if warp_idx == 0:
            cpasync.prefetch_descriptor(tma_a)
            cpasync.prefetch_descriptor(tma_b)

        ra_size, rb_size = cute.cosize(rA_layout), cute.cosize(rB_layout)
        a_size, b_size = cute.cosize(sA_layout), cute.cosize(sB_layout)

        @cute.struct
        class SharedStorage:
            raw_barriers: cute.struct.MemRange[cutlass.Int64, 2 * t.stages]
            mma_barriers: cute.struct.MemRange[cutlass.Int64, 2 * t.mma_stages]
            a_raw: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, ra_size], 1024]
            b_raw: cute.struct.Align[cute.struct.MemRange[cutlass.Float32, rb_size], 1024]
            a_big: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, a_size], 1024]
            a_small: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, a_size], 1024]
            b_big: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, b_size], 1024]
            b_small: cute.struct.Align[cute.struct.MemRange[cutlass.TFloat32, b_size], 1024]

        storage = cutlass.utils.SmemAllocator().allocate(SharedStorage)
        rA = storage.a_raw.get_tensor(rA_layout.outer, swizzle=rA_layout.inner)
        rB = storage.b_raw.get_tensor(rB_layout.outer, swizzle=rB_layout.inner)

        raw_ring = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.raw_barriers.data_ptr(),
            num_stages=t.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERTER_THREADS // 32),
            tx_count=t.raw_bytes,
            cta_layout_vmnk=cute.make_layout((1, 1, 1, 1)),
            defer_sync=True,
        )
        mma_ring = pipeline.PipelineAsync.create(
            barrier_storage=storage.mma_barriers.data_ptr(),
            num_stages=t.mma_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, CONVERTER_THREADS),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self._THREADS - CONVERTER_THREADS),
        )

        k_tile_count = cute.ceil_div(cute.size(mA, mode=[1]), t.bk * self.splits)
        k_tile_first = split * k_tile_count
        loads = []
        for atom, tma_m, raw, rows, tile in ((tma_a, tma_mA, rA, GEMM_BM, m_tile), (tma_b, tma_mB, rB, t.bn, n_tile)):
            g = cute.local_tile(tma_m, (rows, t.bk), (tile, None))
            s_part, g_part = cpasync.tma_partition(atom, 0, cute.make_layout(1), cute.group_modes(raw, 0, 2),
                                                   cute.group_modes(g, 0, 2))
            loads.append((atom, s_part, g_part))

        # PDL: the operands may be the previous kernel's output.
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        if warp_idx < 4:
            cute.arch.setmaxregister_decrease(self._PRODUCER_REGS)
            for k_tile in cutlass.range_constexpr(t.stages - 1):
                if warp_idx == 0:
                    self._load(raw_ring, loads, k_tile, k_tile_first, k_tile_count)
            lane, warp = tidx % 32, tidx // 32
            splits = []  # per operand: (raw, big, small, plan or None, this lane's raw / big-small offsets)
            for raw_mem, big_mem, small_mem, raw_layout, mma_layout, rows, mn_major in (
                    (storage.a_raw, storage.a_big, storage.a_small, rA_layout, sA_layout, GEMM_BM, self.a_mn),
                    (storage.b_raw, storage.b_big, storage.b_small, rB_layout, sB_layout, t.bn, self.b_mn)):
                plan = _transpose_plan(raw_layout, mma_layout, rows, t.bk) if mn_major else None
                lanes = (_lane_offset(lane, plan.raw[2]), _lane_offset(lane, plan.mma[2])) if mn_major else (0, 0)
                splits.append((raw_mem.data_ptr(), big_mem.data_ptr(), small_mem.data_ptr(), plan, rows * t.bk,
                               lanes))
            converted = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, t.stages)
            filled = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, t.mma_stages)
            for k_tile in range(k_tile_count):
                if warp_idx == 0:
                    self._load(raw_ring, loads, k_tile + t.stages - 1, k_tile_first, k_tile_count)
                raw_ring.consumer_wait(converted)
                mma_ring.producer_acquire(filled)
                for raw_ptr, big_ptr, small_ptr, plan, slot_elems, lanes in splits:
                    if cutlass.const_expr(plan is None):
                        _split_slot_flat(raw_ptr, big_ptr, small_ptr, slot_elems, converted.index, filled.index, tidx)
                    else:
                        _split_slot_transposing(raw_ptr, big_ptr, small_ptr, plan, slot_elems, converted.index,
                                                filled.index, lanes[0], lanes[1], warp)
                # The big / small stores (generic proxy) must be visible to wgmma (async proxy); the raw reads
                # are ordered before the next TMA write of the slot.
                cute.arch.fence_proxy("async.shared", space="cta")
                cute.arch.sync_warp()
                raw_ring.consumer_release(converted)  # lane 0 of each warp, after the whole warp's reads
                mma_ring.producer_commit(filled)
                converted.advance()
                filled.advance()
        else:
            cute.arch.setmaxregister_increase(self._CONSUMER_REGS)
            ctidx = tidx - CONVERTER_THREADS
            sA_big = storage.a_big.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sA_small = storage.a_small.get_tensor(sA_layout.outer, swizzle=sA_layout.inner)
            sB_big = storage.b_big.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
            sB_small = storage.b_small.get_tensor(sB_layout.outer, swizzle=sB_layout.inner)
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
            self._mainloop(tiled_mma, acc, frags, mma_ring, k_tile_count)
            rows = cute.size(mOut, mode=[0])
            for i in cutlass.range_constexpr(cute.size(acc)):
                if cute.elem_less(tCcC[i][0], rows):
                    tCgC[i] = acc[i]

    @cute.jit
    def _load(self, raw_ring, loads, k_tile, k_tile_first, k_tile_count):
        """Warp 0: TMA of k tile `k_tile` (if any) into its raw slot; the slot's state from the tile number."""
        from cutlass import pipeline

        if k_tile < k_tile_count:
            produce = pipeline.PipelineState(self.tile.stages, k_tile, k_tile % self.tile.stages,
                                             ((k_tile // self.tile.stages) % 2) ^ 1)
            raw_ring.producer_acquire(produce)
            full = raw_ring.producer_get_barrier(produce)
            for atom, s_part, g_part in loads:
                cute.copy(atom, g_part[None, k_tile_first + k_tile], s_part[None, produce.index], tma_bar_ptr=full)

    @cute.jit
    def _mainloop(self, tiled_mma, acc, frags, ring, k_tile_count):
        from cutlass import pipeline

        a_big, a_small, b_big, b_small = frags
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.tile.mma_stages)
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


# --- builds ----------------------------------------------------------------------------------------

# Tiles to measure (identical bits by contract), (bn, bk, raw stages, big/small stages): 32 KB raw + 64 KB
# big/small per bk-32 k tile (three raw slots keep two TMA loads in flight while one is split), 16 + 32 KB
# per bk-16 k tile.
GEMM_TILES = ((128, 32, 3, 2), (128, 32, 2, 2), (128, 16, 6, 3), (128, 16, 4, 4))
LAUNCH_TILE = (128, 32, 3, 2)  # the launcher's tile for every role
# role -> (K, slices, A MN-major, B MN-major) of the MLP GEMMs the launcher runs on wgmma
# (kernels/timestep_mlp.ROLES: same K and slice count as the mma.sync role, so the same chunk contract and
# bits). K None: T-deep (symbolic), one slice; TMA zero-fills the last k tile past T (zero chunks add +0).
ROLE_GEMMS = {
    "fc2": (5376, 6, False, False),  # h (T, 5376) x w2 (2688, 5376)
    "fc2_dgrad": (2688, 3, False, True),  # grad (T, 2688) x w2^T: w2 (2688, 5376) read MN-major
    "fc2_wgrad": (None, 1, True, True),  # grad^T x h^T: grad (T, 2688) and h (T, 5376) read MN-major
}


def build_gemm(arch: str, *, role: str, tile: tuple):
    """P (splits, M, N) = 3xTF32 slices of A B^T for a `ROLE_GEMMS` role, called (A, B, P) with the raw FP32
    operands: A (M, K), B (N, K), each contiguous K-major, or, MN-major, the (rows, K) view with strides
    (1, rows) of a contiguous (K, rows) tensor (launch.timestep_mlp.transposed). M symbolic, N a multiple of
    bn; K static (a multiple of splits * bk) or T-deep."""
    assert arch == "sm_90a", "wgmma is sm_90a only"
    k, splits, a_mn, b_mn = ROLE_GEMMS[role]
    wtile = WgmmaTile(*tile)
    if k is None:
        k = cute.sym_int()
    elif k % (splits * wtile.bk):
        raise ValueError(f"K = {k} does not split into {splits} slices of whole {wtile.bk}-deep tiles")
    # M = T for a K-major A; an MN-major A's M is its row stride, which TMA needs 16-byte aligned
    m_dim = cute.sym_int(divisibility=4) if a_mn else cute.sym_int()
    n_dim = cute.sym_int(divisibility=wtile.bn)
    gemm = Tf32x3WgmmaGemm(wtile, splits, a_mn, b_mn)
    return compile_for(arch, gemm, _operand((m_dim, k), a_mn), _operand((n_dim, k), b_mn),
                       _compact((splits, m_dim, n_dim)), env_stream())


def gemm_variants() -> list:
    """fc2 in every measured tile (the perf script times them); the other roles in the launcher's tile."""
    variants = [dict(role="fc2", tile=t) for t in GEMM_TILES]
    variants += [dict(role=role, tile=LAUNCH_TILE) for role in ROLE_GEMMS if role != "fc2"]
    return variants


def _operand(shape, mn_major: bool):
    """(rows, K) FP32: K-major (contiguous), or MN-major (strides (1, rows))."""
    if not mn_major:
        return _compact(shape)
    return make_fake_compact_tensor(cutlass.Float32, shape, stride_order=(0, 1), assumed_align=16)


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
        name="tf32x3_wgmma_gemm",
        build=build_gemm,
        variants=lambda arch: gemm_variants(),
        ptx_markers=("wgmma.mma_async.sync.aligned.m64n", ".tf32.tf32", "add.rn.f32", "cp.async.bulk.tensor",
                     "mbarrier.try_wait", "setmaxnreg", "griddepcontrol.wait", "fence.proxy.async.shared::cta"),
        ptx_forbidden=("atom.", "\tred."),
        archs=("sm_90a",),
    ),
]
