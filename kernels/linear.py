"""h3::linear kernels: y = x weight^T + bias in FP32 on the 3xTF32 mma.sync GEMM, and its dx and dweight.

Every GEMM is `GemmTF32x3` (kernels/gemm_tf32x3.py) in one K slice, under its numeric contract (8-deep 3xTF32
tensor-core chunk sums added in increasing k with IEEE round-to-nearest); the roles, their operands and their
tiles are in kernels/_linear_configs.py. The forward adds the bias with one add.rn after the whole K sum
(the "bias" epilogue; a bias of -0.0, the IEEE additive identity, serves `bias=None` with the same kernel). dx and
dweight store the sum ("partial" epilogue, one slice). dgrad reads the weight N-major in place (weight.t());
wgrad reads grad and x M-/N-major in place (their .t() views) with the k rows past M zero-filled in shared memory.
The row count M is symbolic in every kernel; every tile is static per (role, N, K).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from h3cute.kernels._linear_configs import TILES, gemm_dims
from h3cute.kernels.gemm_tf32x3 import GemmConfig, GemmTF32x3
from h3cute.kernels.timestep_mlp import _compact, _gemm_partial, _mn_major
from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream


@cute.jit
def _gemm_bias(gemm: cutlass.Constexpr, mA: cute.Tensor, mB: cute.Tensor, mBias: cute.Tensor, mC: cute.Tensor,
               stream):
    gemm(mA, mB, mC, mBias, mC, stream)  # mC stands in for the unused second output


def build_gemm(arch: str, *, role: str, out_features: int, in_features: int, tile: tuple):
    """One GEMM of `role` for a weight (out_features, in_features); tile = GemmConfig's fields in order."""
    if (role, out_features, in_features) not in TILES:
        raise ValueError(f"linear: no {role} GEMM for weight ({out_features}, {in_features})")
    rows, n, k = gemm_dims(role, out_features, in_features)
    config = GemmConfig(*tile)
    if n % config.tile_n or (rows is not None and rows % config.tile_m) or (k is not None and k % config.tile_k):
        raise ValueError(f"linear {role}: tile {config} does not divide M'={rows}, N'={n}, K'={k}")
    wgrad = role == "wgrad"
    gemm = GemmTF32x3(config, "bias" if role == "fwd" else "partial", 1, a_m_major=wgrad,
                      b_n_major=role != "fwd", k_tail=wgrad)
    m_dim = cute.sym_int() if rows is None else rows
    k_dim = cute.sym_int() if k is None else k
    mA = _mn_major((m_dim, k_dim)) if wgrad else _compact((m_dim, k_dim))
    mB = _compact((n, k_dim)) if role == "fwd" else _mn_major((n, k_dim))
    if role == "fwd":
        return compile_for(arch, _gemm_bias, gemm, mA, mB, _compact((n,)), _compact((m_dim, n)), env_stream())
    return compile_for(arch, _gemm_partial, gemm, mA, mB, _compact((1, m_dim, n)), env_stream())


SPECS = [
    KernelSpec(
        name="linear_gemm",
        build=build_gemm,
        variants=lambda arch: [dict(role=role, out_features=n, in_features=k, tile=tile)
                               for (role, n, k), tile in TILES.items()],
        ptx_markers=("mma.sync.aligned.m16n8k8", ".tf32", "db, 4096;", "add.rn.f32", "cp.async", "griddepcontrol.wait"),
        ptx_forbidden=("atom.", "\tred."),  # no atomics, no reductions to memory
    ),
]
