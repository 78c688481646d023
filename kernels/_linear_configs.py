"""h3::linear's GEMM roles and tile configs as data, shared by kernels/linear.py and launch/linear.py without the DSL
(a `_` module of `h3cute.kernels`: no kernels, no cutlass, no torch).

A linear with weight (N, K) = (out_features, in_features), x flattened to M rows, runs three 3xTF32 GEMMs of
`GemmTF32x3` (C[m', n'] = sum_k' A[m', k'] B[n', k']), named by role:

| role | C (M', N') | A | B | K' | epilogue |
| --- | --- | --- | --- | --- | --- |
| fwd | y (M, N) | x (M, K) | weight (N, K) | K | bias: acc + bias[n] |
| dgrad | dx (M, K) | grad (M, N) | weight.t() (K, N), read N-major in place | N | store (one slice) |
| wgrad | dweight (N, K) | grad.t() (N, M), M-major | x.t() (K, M), N-major | M, tail zero-filled | store (one slice) |

Every GEMM sums its whole K' in one slice (splits = 1), so y[m] and dx[m] are functions of row m of x (of grad), the
weight and the static widths only, and dweight is one CTA per output tile summing the rows in increasing order.

One tile per (role, N, K), never a function of M (every tile gives the same bits; the choice is speed only). The
reasoning per role is in docs/linear.md: wide outputs (N' = 5376, K' <= 96, bound by writing C) take the MLP's
128 x 128 tile; the 5376-deep narrow GEMMs (N' = 96 or 32) take 32-48-row tiles whose N' spans the whole output row
(so A is read once) and give ~130 CTAs from M = 4096; the M-deep weight gradients take tiles giving 168-252 CTAs.
"""
from __future__ import annotations

ROLES = ("fwd", "dgrad", "wgrad")

_WIDE = (128, 128, 32, 3, 2, 4)  # (tile_m, tile_n, tile_k, stages, warps_m, warps_n): GemmConfig's fields
_NARROW = (32, 32, 32, 4, 1, 4)
# (role, out_features, in_features) -> tile. Keys: every role of every served weight shape (a CPU test pins it).
TILES = {
    ("fwd", 5376, 96): _WIDE,  # proj_in: C (M, 5376), K = 96
    ("fwd", 5376, 32): _WIDE,  # audio_proj_in: C (M, 5376), K = 32
    ("fwd", 96, 5376): (32, 96, 32, 4, 1, 4),  # proj_out: C (M, 96), K = 5376; warp tile 32 x 24 (6 atoms)
    ("fwd", 32, 5376): _NARROW,  # audio_proj_out: C (M, 32), K = 5376
    ("dgrad", 5376, 96): (48, 96, 32, 4, 3, 2),  # proj_in: dx (M, 96), K' = 5376; 192 threads (N-major 96-row B)
    ("dgrad", 5376, 32): _NARROW,  # audio_proj_in: dx (M, 32), K' = 5376
    ("dgrad", 96, 5376): _WIDE,  # proj_out: dx (M, 5376), K' = 96
    ("dgrad", 32, 5376): _WIDE,  # audio_proj_out: dx (M, 5376), K' = 32
    ("wgrad", 5376, 96): (64, 32, 32, 4, 2, 2),  # proj_in: dW (5376, 96): 252 CTAs
    ("wgrad", 5376, 32): _NARROW,  # audio_proj_in: dW (5376, 32): 168 CTAs
    ("wgrad", 96, 5376): (32, 64, 32, 4, 2, 2),  # proj_out: dW (96, 5376): 252 CTAs
    ("wgrad", 32, 5376): _NARROW,  # audio_proj_out: dW (32, 5376): 168 CTAs
}


def gemm_dims(role: str, out_features: int, in_features: int) -> tuple:
    """(M' or None for the row count, N', K' or None for the row count) of a role's GEMM."""
    n, k = out_features, in_features
    return {"fwd": (None, n, k), "dgrad": (None, k, n), "wgrad": (n, k, None)}[role]
