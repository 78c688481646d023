"""h3::linear kernels: y = x weight^T + bias in FP32 on the 3xTF32 mma.sync GEMM, and its dx and dweight.

Every GEMM is `GemmTF32x3` (kernels/gemm_tf32x3.py) under its numeric contract (8-deep 3xTF32 tensor-core chunk
sums added in increasing k with IEEE round-to-nearest); the roles, their operands, tiles and slice counts are in
kernels/_linear_configs.py. The forward sums its whole K in one slice and adds the bias with one add.rn after it
(the "bias" epilogue; a bias of -0.0, the IEEE additive identity, serves `bias=None` with the same kernel). dx and
dweight store slice sums ("partial" epilogue) that `linear_fold` adds in slice order. dgrad reads the weight N-major
in place (weight.t()); wgrad and wgrad_tail read grad and x M-/N-major in place (their .t() views), wgrad_tail with
the k rows past its depth zero-filled in shared memory. The row count M is symbolic in every kernel; every tile and
slice count is static per (role, N, K).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from h3cute.kernels._linear_configs import GEMMS, fold_variants, gemm_dims, gemm_variants
from h3cute.kernels.gemm_tf32x3 import GemmConfig, GemmTF32x3
from h3cute.kernels.timestep_mlp import _compact, _fold_launch, _gemm_partial, _mn_major
from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream


@cute.jit
def _gemm_bias(gemm: cutlass.Constexpr, mA: cute.Tensor, mB: cute.Tensor, mBias: cute.Tensor, mC: cute.Tensor,
               stream):
    gemm(mA, mB, mC, mBias, mC, stream)  # mC stands in for the unused second output


def build_gemm(arch: str, *, role: str, out_features: int, in_features: int, tile: tuple, splits: int,
               staged_c: bool = False):
    """One GEMM of kind `role` (_linear_configs.GEMMS) for a weight (out_features, in_features) in `splits` K'
    slices; tile = GemmConfig's fields in order; `staged_c`: C stored through shared memory (STAGED_C)."""
    if role not in GEMMS:
        raise ValueError(f"linear: unknown GEMM {role!r}; one of {GEMMS}")
    rows, n, k = gemm_dims(role, out_features, in_features)
    config = GemmConfig(*tile)
    if n % config.tile_n or (rows is not None and rows % config.tile_m) or (
            k is not None and k % (splits * config.tile_k)):
        raise ValueError(f"linear {role}: tile {config} x {splits} slices does not divide M'={rows}, N'={n}, K'={k}")
    wgrad = role.startswith("wgrad")
    gemm = GemmTF32x3(config, "bias" if role == "fwd" else "partial", splits, a_m_major=wgrad,
                      b_n_major=role != "fwd", k_tail=role == "wgrad_tail", staged_c=staged_c)
    m_dim = cute.sym_int() if rows is None else rows
    k_dim = cute.sym_int() if k is None else k
    mA = _mn_major((m_dim, k_dim)) if wgrad else _compact((m_dim, k_dim))
    mB = _compact((n, k_dim)) if role == "fwd" else _mn_major((n, k_dim))
    if role == "fwd":
        return compile_for(arch, _gemm_bias, gemm, mA, mB, _compact((n,)), _compact((m_dim, n)), env_stream())
    return compile_for(arch, _gemm_partial, gemm, mA, mB, _compact((splits, m_dim, n)), env_stream())


def build_fold(arch: str, *, splits: int, width: int):
    """out (rows, width) = P[0] + P[1] + ... + P[splits - 1] for partials P (splits, rows, width), added in that
    order (the timestep MLP's fold kernel, "sum" mode; called (P, any (1,) tensor, out))."""
    if (splits, width) not in fold_variants():
        raise ValueError(f"linear: no fold of {splits} partials of width {width}")
    rows = cute.sym_int()
    return compile_for(arch, _fold_launch, _compact((splits, rows, width)), _compact((1,)), _compact((rows, width)),
                       env_stream(), splits, width, "sum")


SPECS = [
    KernelSpec(
        name="linear_gemm",
        build=build_gemm,
        variants=lambda arch: gemm_variants(),
        ptx_markers=("mma.sync.aligned.m16n8k8", ".tf32", "db, 4096;", "add.rn.f32", "cp.async", "griddepcontrol.wait"),
        ptx_forbidden=("atom.", "\tred."),  # no atomics, no reductions to memory
    ),
    KernelSpec(
        name="linear_fold",
        build=build_fold,
        variants=lambda arch: [dict(splits=s, width=w) for s, w in fold_variants()],
        ptx_markers=("griddepcontrol.wait",),
        ptx_forbidden=("atom.", "\tred."),  # no atomics, no reductions to memory
    ),
]
