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
        stA_big = cute.recast_tensor(sA_big[None, None, 0], cutlass.Int32)
        stA_small = cute.recast_tensor(sA_small[None, None, 0], cutlass.Int32)
        stB_big = cute.recast_tensor(sB_big[None, None, 0], cutlass.Int32)
        stB_small = cute.recast_tensor(sB_small[None, None, 0], cutlass.Int32)
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
]
