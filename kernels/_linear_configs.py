"""h3::linear's GEMM roles and tile configs as data, shared by kernels/linear.py and launch/linear.py without the DSL
(a `_` module of `h3cute.kernels`: no kernels, no cutlass, no torch).

A linear with weight (N, K) = (out_features, in_features), x flattened to M rows, runs three 3xTF32 GEMMs of
`GemmTF32x3` (C[m', n'] = sum_k' A[m', k'] B[n', k']), named by role:

| role | C (M', N') | A | B | K' | epilogue |
| --- | --- | --- | --- | --- | --- |
| fwd | y (M, N) | x (M, K) | weight (N, K) | K | bias: acc + bias[n] |
| dgrad | dx (M, K) | grad (M, N) | weight.t() (K, N), read N-major in place | N | partial (SPLITS slices), folded |
| wgrad | dweight (N, K) | grad.t() (N, M), M-major | x.t() (K, M), N-major | M in chunks | partial, folded |

The forward sums its whole K in one slice; the dgrad sums K' = N in a slice count fixed by the widths (`SPLITS`),
folded in slice order, so y[m] and dx[m] are functions of row m of x (of grad), the weight and the static widths
only. The wgrad splits its M rows (`wgrad_rows`): a "wgrad" launch sums SPLITS equal chunks of the first `bulk` rows
(a multiple of SPLITS * tile_k, no tail), a "wgrad_tail" launch (one slice, zero-filled k tail) the remaining rows
into one more partial, and the fold adds the partials in increasing row order: a pure function of M, deterministic.

One tile per (role, N, K), never a function of M (every tile gives the same bits; the choice is speed only). The
reasoning per role is in docs/linear.md: wide outputs (N' = 5376, K' <= 96, bound by writing C) take 64-row tiles
that several CTAs per SM hold at once; the 5376-deep narrow GEMMs (N' = 96 or 32) take 32-48-row tiles whose N'
spans the whole output row (so A is read once) and give ~130 CTAs from M = 4096, times the dgrad's slices; the
M-deep weight gradients take tiles giving 168-252 output tiles, times their row chunks.
"""
from __future__ import annotations

ROLES = ("fwd", "dgrad", "wgrad")  # the GEMMs of a linear
GEMMS = ROLES + ("wgrad_tail",)  # the compiled GEMM kinds: the wgrad's rows past its chunks take one more

# (tile_m, tile_n, tile_k, stages, warps_m, warps_n): GemmConfig's fields. The wide outputs (N' = 5376, K' = 96 or
# 32) take tiles that several CTAs per SM hold at once, so that one's C stores overlap another's loads and mma
# (ptxas: 144-155 registers x 128 threads, 3 per SM; 86-128 x 256 threads, 2 per SM; the 128 x 128 tile's 139-231
# registers x 256 threads left one).
_WIDE_96 = (64, 64, 32, 3, 2, 2)
_WIDE_32 = (64, 128, 32, 3, 2, 4)
_NARROW = (32, 32, 32, 4, 1, 4)
# (role, out_features, in_features) -> tile. Keys: every role of every served weight shape (a CPU test pins it).
TILES = {
    ("fwd", 5376, 96): _WIDE_96,  # proj_in: C (M, 5376), K = 96
    ("fwd", 5376, 32): _WIDE_32,  # audio_proj_in: C (M, 5376), K = 32
    ("fwd", 96, 5376): (32, 96, 32, 4, 1, 4),  # proj_out: C (M, 96), K = 5376; warp tile 32 x 24 (6 atoms)
    ("fwd", 32, 5376): _NARROW,  # audio_proj_out: C (M, 32), K = 5376
    ("dgrad", 5376, 96): (48, 96, 32, 4, 3, 2),  # proj_in: dx (M, 96), K' = 5376; 192 threads (N-major 96-row B)
    ("dgrad", 5376, 32): _NARROW,  # audio_proj_in: dx (M, 32), K' = 5376
    ("dgrad", 96, 5376): _WIDE_96,  # proj_out: dx (M, 5376), K' = 96
    ("dgrad", 32, 5376): _WIDE_32,  # audio_proj_out: dx (M, 5376), K' = 32
    ("wgrad", 5376, 96): (64, 32, 32, 4, 2, 2),  # proj_in: dW (5376, 96): 252 CTAs
    ("wgrad", 5376, 32): _NARROW,  # audio_proj_in: dW (5376, 32): 168 CTAs
    ("wgrad", 96, 5376): (32, 64, 32, 4, 2, 2),  # proj_out: dW (96, 5376): 252 CTAs
    ("wgrad", 32, 5376): _NARROW,  # audio_proj_out: dW (32, 5376): 168 CTAs
}


# (role, out_features, in_features) -> K' slices, 1 where absent. dgrad of the in-heads (K' = 5376 = 168 x 32):
# a count from the width alone keeps dx row-invariant and multiplies the ~M / tile_m CTAs (3 x 56 and 4 x 42 k
# tiles): at M = 4097, 86 x 3 = 258 CTAs of the 48-row tile (154 registers x 192 threads: 2 per SM) and 129 x 4 = 516
# of the 32-row one (105 x 128: 4 per SM), one wave each on 132 SMs. wgrad: the M rows in that many chunks, so the
# fixed 168-252 output tiles become 1344-2016 CTAs, several waves, so the last one's idle SMs cost little.
SPLITS = {
    ("dgrad", 5376, 96): 3,
    ("dgrad", 5376, 32): 4,
    **{("wgrad", n, k): 8 for n, k in ((5376, 96), (5376, 32), (96, 5376), (32, 5376))},
}


# The forwards whose C goes out through shared memory as 16-byte row vectors (GemmTF32x3's `staged_c`): the wide
# outputs (N' = 5376 FP32 per row from K <= 96), bound by writing C rather than by the mma.
STAGED_C = frozenset({("fwd", 5376, 96), ("fwd", 5376, 32)})


def splits(role: str, out_features: int, in_features: int) -> int:
    return SPLITS.get((role, out_features, in_features), 1)


def gemm_static(gemm: str, out_features: int, in_features: int) -> dict:
    """The `linear_gemm` variant (static args) of a GEMM kind for a weight (out_features, in_features)."""
    role = "wgrad" if gemm == "wgrad_tail" else gemm
    return dict(role=gemm, out_features=out_features, in_features=in_features,
                tile=TILES[role, out_features, in_features],
                splits=1 if gemm == "wgrad_tail" else splits(role, out_features, in_features),
                staged_c=(gemm, out_features, in_features) in STAGED_C)


def gemm_variants() -> list:
    """Every `linear_gemm` variant the launcher can ask for."""
    gemms = [(role, n, k) for role, n, k in TILES] + [("wgrad_tail", n, k) for role, n, k in TILES if role == "wgrad"]
    return [gemm_static(*g) for g in gemms]


def fold_variants() -> list:
    """Every `linear_fold` variant (splits, width): the split dgrads' and the wgrads' (chunks + the tail's)."""
    return sorted({(s + (role == "wgrad"), k) for (role, n, k), s in SPLITS.items()})


def wgrad_rows(out_features: int, in_features: int, rows: int) -> tuple:
    """(bulk, tail) rows of a weight gradient over `rows` rows: bulk, the largest multiple of SPLITS * tile_k, is
    summed in SPLITS equal chunks; the tail (< SPLITS * tile_k rows) by the one-slice k-tail GEMM."""
    step = wgrad_step(out_features, in_features)
    bulk = rows // step * step
    return bulk, rows - bulk


def wgrad_step(out_features: int, in_features: int) -> int:
    """The weight gradient's bulk rows are a multiple of this: one tile_k deep k tile per chunk."""
    return splits("wgrad", out_features, in_features) * TILES["wgrad", out_features, in_features][2]


def gemm_dims(role: str, out_features: int, in_features: int) -> tuple:
    """(M' or None for the row count, N', K' or None for the row count) of a role's GEMM."""
    n, k = out_features, in_features
    role = "wgrad" if role == "wgrad_tail" else role
    return {"fwd": (None, n, k), "dgrad": (None, k, n), "wgrad": (n, k, None)}[role]
