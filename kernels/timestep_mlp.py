"""timestep_mlp kernels: temb = linear(silu(linear(x, w1, b1)), w2, b2) in FP32, forward and backward.

Every GEMM is `GemmTF32x3` (kernels/gemm_tf32x3.py: 3xTF32 on mma.sync, C = A B^T; operands
K-major, or read MN-major in place from the transposed views named below). The roles, with T the
row count (symbolic in every compiled kernel):

| role | C | A (M, K) | B (N, K) | K | epilogue |
| --- | --- | --- | --- | --- | --- |
| fc1 | h = silu(z) (T, 5376) | x (T, 256) | w1 | 256 | bias + SiLU, fused |
| fc1_zh | z and h (backward recompute) | x | w1 | 256 | bias + SiLU, fused |
| fc2 | temb partials (6, T, 2688) | h | w2 | 5376 | partial, folded + b2 |
| fc2_dgrad | dh partials (3, T, 5376) | grad | w2^T (w2 read N-major) | 2688 | partial, folded * silu'(z) (+ db1) |
| fc1_dgrad | dx partials (6, T, 256) | dz | w1^T (w1 read N-major) | 5376 | partial, folded |
| fc2_wgrad | dW2 (2688, 5376) | grad.t() (M-major) | h.t() (N-major) | T, tail zero-filled | store |
| fc1_wgrad | dW1 (5376, 256) | dz.t() (M-major) | x.t() (N-major) | T, tail zero-filled | store |

Split-K is part of the numeric contract: K is cut into K_SLICE = 896-long slices (one slice when K
is not a multiple of it), each summed from +0 in increasing k as IEEE FP32 adds of 8-deep 3xTF32
tensor-core chunk sums (gemm_tf32x3.K_CHUNK), and `timestep_mlp_fold` adds the
slice partials in slice order, then the bias (the dz mode of `timestep_mlp_colsum` multiplies by
silu'(z) instead, and sums the dz rows into db1 on the way). The slice count depends on
K only, never on T or on the tile config, so forward outputs and dx are batch-invariant and every
config gives the same bits. The weight-gradient GEMMs reduce over T in one slice (the k rows past T
of the last tile are zeroed in shared memory: they add +0); db1/db2 are `timestep_mlp_colsum` of
grad / dz: row group g of 32 sums rows g, g+32, ... in order, then the 32 group sums are added
in group order. Deterministic for a given T, no atomics.

SiLU: h = z / (1 + exp(-z)); silu'(z) = s (1 + z (1 - s)) with s = 1 / (1 + exp(-z)); exp is the
precise expf (range reduction + ex2), division IEEE.

Every kernel is launched with programmatic dependent launch and waits (griddepcontrol.wait) before
it reads or writes anything the previous kernel may touch; fc2 and the dgrad GEMMs stream their
first weight tiles before the wait (PREFETCH_B_ROLES), overlapping the previous kernel and the gap.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from h3cute.kernels._tiles import CONFIGS, T_BOUNDS, role_tiles
from h3cute.kernels.gemm_tf32x3 import GemmConfig, GemmTF32x3
from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream, make_fake_compact_tensor
from h3cute.widths import FREQ, MLP_HIDDEN, TEMB  # fc1: FREQ -> MLP_HIDDEN, fc2: MLP_HIDDEN -> TEMB

K_SLICE = 896
FOLD_THREADS = 256
COLSUM_GROUPS = 32  # row groups (warps) per bias-gradient CTA: part of db's summation order

# role -> (rows M or None for T, N, K or None for padded T, epilogue)
ROLES = {
    "fc1": (None, MLP_HIDDEN, FREQ, "bias_silu_h"),  # forward: h only
    "fc1_zh": (None, MLP_HIDDEN, FREQ, "bias_silu"),  # backward recompute: z and h
    "fc1_split": (None, MLP_HIDDEN, FREQ, "bias_silu_split"),  # forward into the wgmma fc2: h's big, small
    "fc2": (None, TEMB, MLP_HIDDEN, "partial"),
    "fc2_dgrad": (None, MLP_HIDDEN, TEMB, "partial"),
    "fc1_dgrad": (None, FREQ, MLP_HIDDEN, "partial"),
    "fc2_wgrad": (TEMB, MLP_HIDDEN, None, "partial"),
    "fc1_wgrad": (MLP_HIDDEN, FREQ, None, "partial"),
}
FOLD_MODES = ("bias", "sum")
# Roles whose B operand (a weight) the immediately preceding kernel of the launcher never writes:
# their first B tiles are streamed before the PDL wait (fc2 and fc2_dgrad follow fc1, which writes
# z / h; fc1_dgrad follows the dz kernel, which writes dz and db1).
PREFETCH_B_ROLES = ("fc2", "fc2_dgrad", "fc1_dgrad")
# Roles whose B is W^T read in place: the kernel takes W.t() (an (N, K) view with strides (1, N))
# and stages it N-major in shared memory; no transposed copy of w1 / w2 is ever made.
B_N_MAJOR_ROLES = ("fc2_dgrad", "fc1_dgrad", "fc2_wgrad", "fc1_wgrad")
# The T-deep weight gradients read both operands in place as (rows, T) views of the (T, rows)
# activations (grad.t(), h.t(); dz.t(), x.t()) and zero-fill the k rows past T in shared memory.
WGRAD_ROLES = ("fc2_wgrad", "fc1_wgrad")


def k_splits(k: int | None) -> int:
    """Number of fixed K slices of a GEMM of depth k (None: the T-deep weight gradients, one slice)."""
    if k is None or k % K_SLICE:
        return 1
    return k // K_SLICE


def role_splits(role: str) -> int:
    return k_splits(ROLES[role][2])


# --- GEMMs -------------------------------------------------------------------------------------


@cute.jit
def _gemm_partial(gemm: cutlass.Constexpr, mA: cute.Tensor, mB: cute.Tensor, mP: cute.Tensor, stream):
    gemm(mA, mB, mP, mP, mP, stream)  # no bias, no second output: mP stands in, never read


@cute.jit
def _gemm_bias_silu_h(gemm: cutlass.Constexpr, mA: cute.Tensor, mB: cute.Tensor, mBias: cute.Tensor,
                      mH: cute.Tensor, stream):
    gemm(mA, mB, mH, mBias, mH, stream)  # mH stands in for the unused second output


@cute.jit
def _gemm_bias_silu(gemm: cutlass.Constexpr, mA: cute.Tensor, mB: cute.Tensor, mBias: cute.Tensor,
                    mZ: cute.Tensor, mH: cute.Tensor, stream):
    gemm(mA, mB, mZ, mBias, mH, stream)


def _mn_major(shape):
    """(rows, K) view with strides (1, rows): the transpose of a row-major (K, rows) tensor."""
    return make_fake_compact_tensor(cutlass.Float32, shape, stride_order=(0, 1), assumed_align=16)


def _compact(shape):
    order = tuple(range(len(shape) - 1, -1, -1))
    return make_fake_compact_tensor(cutlass.Float32, shape, stride_order=order, assumed_align=16)


def build_gemm(arch: str, *, role: str, tile: tuple):
    """tile = the GemmConfig fields in order (tile_m, tile_n, tile_k, stages, warps_m, warps_n)."""
    rows, n, k, epilogue = ROLES[role]
    config = GemmConfig(*tile)
    splits = k_splits(k)
    m_dim = cute.sym_int() if rows is None else rows
    k_dim = cute.sym_int() if k is None else k  # None: T, any value (the k tail is zero-filled)
    if k is not None and k % (splits * config.tile_k):
        raise ValueError(f"{role}: K={k} does not split into {splits} slices of whole {config.tile_k}-deep tiles")
    if n % config.tile_n or (rows is not None and rows % config.tile_m):
        raise ValueError(f"{role}: tile {config} does not divide N={n} / M={rows}")
    wgrad = role in WGRAD_ROLES
    gemm = GemmTF32x3(config, epilogue, splits, prefetch_b=role in PREFETCH_B_ROLES, a_m_major=wgrad,
                      b_n_major=role in B_N_MAJOR_ROLES, k_tail=wgrad)
    mA = _mn_major((m_dim, k_dim)) if wgrad else _compact((m_dim, k_dim))
    mB = _mn_major((n, k_dim)) if role in B_N_MAJOR_ROLES else _compact((n, k_dim))
    if epilogue == "partial":
        return compile_for(arch, _gemm_partial, gemm, mA, mB, _compact((splits, m_dim, n)), env_stream())
    if epilogue == "bias_silu_h":
        return compile_for(arch, _gemm_bias_silu_h, gemm, mA, mB, _compact((n,)), _compact((m_dim, n)),
                           env_stream())
    return compile_for(arch, _gemm_bias_silu, gemm, mA, mB, _compact((n,)), _compact((m_dim, n)),
                       _compact((m_dim, n)), env_stream())


# --- fold: out = (P[0] + P[1] + ... + P[S-1]) (+ bias[n] | * silu'(z)) -------------------------


@cute.kernel
def _fold_kernel(mP: cute.Tensor, mAux: cute.Tensor, mOut: cute.Tensor, splits: cutlass.Constexpr,
                 width: cutlass.Constexpr, mode: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_wait()  # PDL: the partials are the previous kernel's output
    cute.arch.griddepcontrol_launch_dependents()
    i = bidx * FOLD_THREADS + tidx
    if i < mOut.shape[0] * width:
        m = i // width
        c = i - m * width
        acc = mP[0, m, c]
        for s in cutlass.range_constexpr(1, splits):
            acc = acc + mP[s, m, c]
        if cutlass.const_expr(mode == "bias"):
            acc = acc + mAux[c]
        mOut[m, c] = acc


@cute.jit
def _fold_launch(mP: cute.Tensor, mAux: cute.Tensor, mOut: cute.Tensor, stream, splits: cutlass.Constexpr,
                 width: cutlass.Constexpr, mode: cutlass.Constexpr):
    total = mOut.shape[0] * width
    _fold_kernel(mP, mAux, mOut, splits, width, mode).launch(
        grid=((total + FOLD_THREADS - 1) // FOLD_THREADS, 1, 1), block=(FOLD_THREADS, 1, 1), stream=stream,
        use_pdl=True,
    )


def build_fold(arch: str, *, role: str, mode: str):
    """Fold the split-K partials of `role`: "bias" (aux = bias (N,)) or "sum" (aux unused)."""
    if mode not in FOLD_MODES:
        raise ValueError(f"unknown fold mode {mode!r}; one of {FOLD_MODES}")
    rows, n, k, _ = ROLES[role]
    splits = k_splits(k)
    m_dim = cute.sym_int()
    aux = {"bias": (n,), "sum": (1,)}[mode]
    return compile_for(arch, _fold_launch, _compact((splits, m_dim, n)), _compact(aux), _compact((m_dim, n)),
                       env_stream(), splits, n, mode)


# --- colsum: db[n] = sum_t A[t, n] (bias gradients over T rows, in a fixed order) --------------


@cute.jit
def _dz(mP: cute.Tensor, mZ: cute.Tensor, t, col):
    """dz = (dh slice partials added in slice order) * silu'(z), silu'(z) = s (1 + z (1 - s))."""
    acc = mP[0, t, col]
    for s in cutlass.range_constexpr(1, cute.size(mP, mode=[0])):
        acc = acc + mP[s, t, col]
    z = mZ[t, col]
    sig = cutlass.Float32(1.0) / (cutlass.Float32(1.0) + cute.math.exp(-z))
    return acc * (sig * (cutlass.Float32(1.0) + z * (cutlass.Float32(1.0) - sig)))


@cute.kernel
def _colsum_kernel(mA: cute.Tensor, mZ: cute.Tensor, mDz: cute.Tensor, mOut: cute.Tensor,
                   fold_dz: cutlass.Constexpr):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    cute.arch.griddepcontrol_wait()  # PDL: the rows may be the previous kernel's output
    cute.arch.griddepcontrol_launch_dependents()
    lane = tidx % 32
    group = tidx // 32
    col = bidx * 32 + lane
    smem = cutlass.utils.SmemAllocator()
    sPart = smem.allocate_tensor(cutlass.Float32, cute.make_layout((COLSUM_GROUPS, 32), stride=(32, 1)),
                                 byte_alignment=16)
    # Row group g (one warp) sums rows g, g + G, g + 2G, ... of its 32 columns in increasing order
    # (a warp reads 128 contiguous bytes per row; unrolled so several rows' loads are in flight);
    # then one thread adds the G partials in group order. fold_dz: the rows are dz, made here from
    # fc2_dgrad's partials and z and stored on the way (db1 without a second pass over dz).
    acc = cutlass.Float32(0.0)
    for t in cutlass.range(group, mZ.shape[0], COLSUM_GROUPS, unroll=4):
        if cutlass.const_expr(fold_dz):
            v = _dz(mA, mZ, t, col)
            mDz[t, col] = v
            acc = acc + v
        else:
            acc = acc + mA[t, col]
    sPart[group, lane] = acc
    cute.arch.sync_threads()
    if group == 0:
        total = sPart[0, lane]
        for g in cutlass.range_constexpr(1, COLSUM_GROUPS):
            total = total + sPart[g, lane]
        mOut[col] = total


@cute.jit
def _colsum_launch(mA: cute.Tensor, mZ: cute.Tensor, mDz: cute.Tensor, mOut: cute.Tensor, stream,
                   fold_dz: cutlass.Constexpr):
    _colsum_kernel(mA, mZ, mDz, mOut, fold_dz).launch(
        grid=(mOut.shape[0] // 32, 1, 1), block=(32 * COLSUM_GROUPS, 1, 1), stream=stream, use_pdl=True,
    )


def build_colsum(arch: str, *, cols: int, fold_dz: bool):
    """db (cols,) = column sums of a (T, cols) tensor A, called (A, A, A, db); or with fold_dz, of
    dz = fold(fc2_dgrad partials) * silu'(z), called (partials (3, T, cols), z, dz out, db1)."""
    if cols % 32:
        raise ValueError(f"colsum needs a multiple of 32 columns, got {cols}")
    rows = cute.sym_int()
    first = _compact((role_splits("fc2_dgrad"), rows, cols)) if fold_dz else _compact((rows, cols))
    return compile_for(arch, _colsum_launch, first, _compact((rows, cols)), _compact((rows, cols)),
                       _compact((cols,)), env_stream(), fold_dz)


# --- what the launcher may ask for --------------------------------------------------------------

# Per role, the tiles of the launcher's configs (kernels/_tiles.py; all of them give identical bits): those of the
# configs its pick table T_BOUNDS returns are the bundle's variants, every config's are the sweep's candidates.
# Tuple order = GemmConfig fields.
PICKED_TILES = role_tiles(config for _, config in T_BOUNDS)
GEMM_TILES = role_tiles(CONFIGS)
FOLDS = (("fc2", "bias"), ("fc1_dgrad", "sum"))  # fc2_dgrad's partials: the colsum kernel's dz mode


SPECS = [
    KernelSpec(
        name="timestep_mlp_gemm",
        build=build_gemm,
        variants=lambda arch: [dict(role=r, tile=t) for r, tiles in PICKED_TILES.items() for t in tiles],
        candidates=lambda arch: [dict(role=r, tile=t) for r, tiles in GEMM_TILES.items() for t in tiles],
        ptx_markers=("mma.sync.aligned.m16n8k8", ".tf32", "db, 4096;", "add.rn.f32", "cp.async", "griddepcontrol.wait"),
        ptx_forbidden=("atom.", "\tred."),  # no atomics, no reductions to memory
    ),
    KernelSpec(
        name="timestep_mlp_fold",
        build=build_fold,
        variants=lambda arch: [dict(role=r, mode=m) for r, m in FOLDS],
        ptx_forbidden=("atom.", "\tred."),  # no atomics, no reductions to memory
    ),
    KernelSpec(
        name="timestep_mlp_colsum",
        build=build_colsum,
        variants=lambda arch: [dict(cols=TEMB, fold_dz=False), dict(cols=MLP_HIDDEN, fold_dz=True)],
        ptx_markers=("bar.sync",),
        ptx_forbidden=("atom.", "\tred."),  # no atomics, no reductions to memory
    ),
]
