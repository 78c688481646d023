"""Host side of `h3::timestep_mlp` (+ backward) on CUDA: allocate, pick a tile config, launch.

Forward (3 launches): fc1 GEMM with bias + SiLU fused (h), fc2 GEMM into 6 fixed K-slice partials,
fold (slice order, + b2). Backward (recomputes z, h with the forward's fc1 kernel: GEMM1 is 1/21 of
the FLOPs, and the public op returns only temb): dh partials = grad w2 (3 slices), fold * silu'(z) ->
dz (and db1 = column sums of dz, same kernel); dx partials = dz w1 (6 slices), fold; dW2 = grad^T h
and dW1 = dz^T x as T-deep GEMMs; db2 = column sums of grad. No copies: the dgrad GEMMs read w2, w1
and the weight-gradient GEMMs read grad, h, dz, x in place, through their `transposed` views
(8 launches, all PDL).

Launch order is part of the kernels' PDL contract (kernels/timestep_mlp.py, PREFETCH_B_ROLES): fc2,
fc2_dgrad and fc1_dgrad prefetch their weight before waiting on the previous kernel, so the kernel
launched right before each must not write that weight (fc1 / fc1_zh / the dz kernel do not).

Large T on sm_90a (T >= WGMMA_MIN_ROWS): fc2, fc2_dgrad and fc2_wgrad run on the TF32 warpgroup MMA
(kernels/wgmma_tf32.py). fc2 and fc2_dgrad read w2 as it is (`tf32x3_wgmma_weight_gemm`: the weight is the
register operand, split per k8 chunk in registers) against the pre-split activation (`tf32_split` of h or
grad); fc2_wgrad splits grad^T and h^T through the transposing split (the T-deep K zero-padded to a multiple
of 32) into `tf32x3_wgmma_gemm`. Both write the partial layout the mma.sync GEMM writes, under the same
chunk contract (same K slices, same k8 chunks, same IEEE adds), into the same folds: the same bits at
every T (GPU tests compare the whole op). fc1 and fc1_zh take the weight GEMM too (w1 in registers, x split
first, the bias + SiLU epilogues); fc1_dgrad and fc1_wgrad stay on mma.sync.

Config choice may look at T (it changes only speed): every config in CONFIGS (kernels/_tiles.py, with the pick table
T_BOUNDS; the bundle builds the tiles of the picked configs, the others compile on demand) gives the same bits,
because the summation order is fixed by K and the slice count (kernels/timestep_mlp.py). The op
layer validates shapes/dtypes/devices; here inputs are contiguous FP32 on one CUDA device, T >= 1.
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.kernels._tiles import (CONFIGS, LARGE_T, LARGE_T_S5, MID_T, SMALL_T, SMALL_T_K64,  # noqa: F401
                                   T_BOUNDS, WIDE_T, GemmConfig, MlpConfig)
from h3cute.widths import FREQ, MLP_HIDDEN, TEMB

# K-slice counts of the split GEMMs: K // 896 (kernels/timestep_mlp.py: k_splits; a CPU test pins it).
SPLITS = {"fc2": MLP_HIDDEN // 896, "fc2_dgrad": TEMB // 896, "fc1_dgrad": MLP_HIDDEN // 896}


# sm_90a from this many rows: the fc2-sized GEMMs and fc1 on TF32 wgmma (speed only: same bits). From T = 256 the
# wgmma path is faster forward and backward on the H200; at T = 128 its backward only ties the mma.sync path's
# (per-launch times: perf/mlp_kernels.py). The C++ layer runs the same sequences (no Python on the way).
WGMMA_MIN_ROWS = 256
WGMMA_TILE = (128, 32, 3)  # wgmma_tf32.LAUNCH_TILE (bn, bk, stages): every role's variant is built in it
WGMMA_K_PAD = 32  # wgmma_tf32.TRANSPOSE_TILE: the T-deep K is zero-padded to a multiple of it
WGMMA_ROLES = {"fc2": (MLP_HIDDEN, SPLITS["fc2"]), "fc2_dgrad": (TEMB, SPLITS["fc2_dgrad"]),
               "fc2_wgrad": (None, 1)}  # wgmma_tf32.ROLE_GEMMS: (K, slices); None = T-deep
# wgmma_tf32.WEIGHT_GEMMS, (K, slices, W K-major, epilogue): the GEMMs that read their weight as it is and split
# it in registers; fc2 and fc2_dgrad (w2) into partials, fc1 (w1) into h's operand pair or z and h
WEIGHT_ROLES = {"fc2": (MLP_HIDDEN, SPLITS["fc2"], True, "partial"),
                "fc2_dgrad": (TEMB, SPLITS["fc2_dgrad"], False, "partial"),
                "fc1_split": (FREQ, 1, True, "bias_silu_split"),
                "fc1_zh": (FREQ, 1, True, "bias_silu")}
WEIGHT_TILE = (128, 32, 4)  # wgmma_tf32.WEIGHT_TILE (bn, bk, stages)
WEIGHT_FC1_TILE = (64, 32, 4)  # wgmma_tf32.WEIGHT_FC1_TILE
# sm_90a forward at T <= WEIGHT_SMALL_ROWS: fc2 on the weight-in-registers GEMM with one T tile of 8 or 16 rows
# (wgmma_tf32.WEIGHT_SMALL_TILES: deep rings, w2 streams); its first stages load before the PDL wait.
WEIGHT_SMALL_TILES = ((8, (8, 32, 12)), (16, (16, 32, 10)))  # (up to T, tile)
WEIGHT_SMALL_ROWS = WEIGHT_SMALL_TILES[-1][0]



def pick_config(num_rows: int) -> MlpConfig:
    """Speed only: 16-row tiles while the weights stream (memory-bound), bigger tiles as T grows."""
    return _bucket(num_rows)[2]


def _bucket(num_rows: int) -> tuple[int, int, MlpConfig]:
    lo, hi = runtime.row_range([bound for bound, _ in T_BOUNDS], num_rows)
    return lo, hi, dict(T_BOUNDS)[hi]


def uses_wgmma(device, num_rows: int) -> bool:
    """The launcher's default path: the TF32-wgmma GEMMs on sm_90a from WGMMA_MIN_ROWS rows."""
    return num_rows >= WGMMA_MIN_ROWS and runtime.arch_of(device) == "sm_90a"


def forward_weight_tile(device, num_rows: int) -> tuple | None:
    """The forward's fc2 tile on the weight-in-registers GEMM (fc1 then writes h's TF32 operand pair), or
    None for the mma.sync fc2: sm_90a at T <= WEIGHT_SMALL_ROWS (one small T tile) and from WGMMA_MIN_ROWS."""
    if runtime.arch_of(device) != "sm_90a":
        return None
    if num_rows >= WGMMA_MIN_ROWS:
        return WEIGHT_TILE
    return next((tile for rows, tile in WEIGHT_SMALL_TILES if num_rows <= rows), None)


def kernel_handles(device: int, backward: int, num_rows: int) -> tuple[int, int, list[int], list[int]]:
    """For the C++ impls (h3cute.native): the T range sharing every launch choice for `num_rows`, the C
    handles of its kernels in launch order (runtime keeps them alive), and [flag]. Forward: flag 0 (fc1, fc2,
    fold); flag 1 (`forward_weight_tile` below WGMMA_MIN_ROWS): fc1_split on mma.sync, the weight fc2, fold;
    flag 2 (`uses_wgmma`): split (of x), the weight fc1_split, the weight fc2, fold. Backward: flag 0, the
    mma.sync sequence (fc1_zh, fc2_dgrad, colsum_dz, fc1_dgrad, fold_dx, fc2_wgrad, fc1_wgrad, colsum_db2);
    flag 1 (`uses_wgmma`), the wgmma one (split, of x and of grad; weight fc1_zh, weight fc2_dgrad,
    colsum_dz, fc1_dgrad, fold_dx, transposing split, wgmma fc2_wgrad, fc1_wgrad, colsum_db2)."""
    lo, hi, cfg = _bucket(num_rows)
    dev = torch.device("cuda", device)
    wgmma = uses_wgmma(dev, num_rows)
    if runtime.arch_of(dev) == "sm_90a":  # the forward's fc2 tile and the wgmma path change at these bounds too
        bounds = [rows for rows, _ in WEIGHT_SMALL_TILES] + [WGMMA_MIN_ROWS - 1, runtime.MAX_ROWS]
        sm90_lo, sm90_hi = runtime.row_range(bounds, num_rows)
        lo, hi = max(lo, sm90_lo), min(hi, sm90_hi)
    split = runtime.kernel("tf32_split", dev, transpose=False) if wgmma else None
    if not backward:
        tile = forward_weight_tile(dev, num_rows)
        if tile is None:
            fns = [_gemm(dev, "fc1", cfg.fc1), _gemm(dev, "fc2", cfg.fc2)]
        elif wgmma:
            fns = [split, _weight_gemm(dev, "fc1_split", WEIGHT_FC1_TILE), _weight_gemm(dev, "fc2", tile)]
        else:
            fns = [_gemm(dev, "fc1_split", cfg.fc1), _weight_gemm(dev, "fc2", tile)]
        flag = 0 if tile is None else 2 if wgmma else 1
        return lo, hi, [fn.__chandle__() for fn in fns + [_fold(dev, "fc2", "bias")]], [flag]
    if wgmma:
        fns = [split, _weight_gemm(dev, "fc1_zh", WEIGHT_FC1_TILE), _weight_gemm(dev, "fc2_dgrad")]
    else:
        fns = [_gemm(dev, "fc1_zh", cfg.fc1), _gemm(dev, "fc2_dgrad", cfg.fc2_dgrad)]
    fns += [runtime.kernel("timestep_mlp_colsum", dev, cols=MLP_HIDDEN, fold_dz=True),
            _gemm(dev, "fc1_dgrad", cfg.fc1_dgrad), _fold(dev, "fc1_dgrad", "sum")]
    fns += [runtime.kernel("tf32_split", dev, transpose=True), _wgmma_gemm(dev, "fc2_wgrad")] if wgmma else \
        [_gemm(dev, "fc2_wgrad", cfg.fc2_wgrad)]
    fns += [_gemm(dev, "fc1_wgrad", cfg.fc1_wgrad), runtime.kernel("timestep_mlp_colsum", dev, cols=TEMB,
                                                                  fold_dz=False)]
    return lo, hi, [fn.__chandle__() for fn in fns], [int(wgmma)]


def _gemm(device, role: str, tile: GemmConfig):
    return runtime.kernel("timestep_mlp_gemm", device, role=role, tile=tile.astuple())


def _fold(device, role: str, mode: str):
    return runtime.kernel("timestep_mlp_fold", device, role=role, mode=mode)


def _wgmma_gemm(device, role: str):
    k, splits = WGMMA_ROLES[role]
    return runtime.kernel("tf32x3_wgmma_gemm", device, k=k, splits=splits, tile=WGMMA_TILE)


def _weight_gemm(device, role: str, tile: tuple = WEIGHT_TILE):
    return runtime.kernel("tf32x3_wgmma_weight_gemm", device, role=role, tile=tile)


def _split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The big / small TF32 operand arrays of a contiguous K-major (R, K) operand."""
    big, small = torch.empty_like(x), torch.empty_like(x)
    runtime.kernel("tf32_split", x.device, transpose=False)(x, big, small)
    return big, small


def _split_transposed(xt: torch.Tensor, depth_out: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Big / small (R, depth_out) arrays of X = xt^T for a contiguous (K, R) xt, zero past K."""
    shape = (xt.shape[1], depth_out)
    big, small = xt.new_empty(shape), xt.new_empty(shape)
    runtime.kernel("tf32_split", xt.device, transpose=True)(xt, big, small)
    return big, small


def _fc1(x, w1, b1, tile: GemmConfig, wgmma: bool = False):
    """Backward's recompute: z (for silu') and h (for dW2); wgmma: on the weight GEMM (x split first)."""
    num_rows = x.shape[0]
    z = torch.empty((num_rows, MLP_HIDDEN), dtype=torch.float32, device=x.device)
    h = torch.empty_like(z)
    if wgmma:
        _weight_gemm(x.device, "fc1_zh", WEIGHT_FC1_TILE)(w1, *_split(x), b1, z, h)
    else:
        _gemm(x.device, "fc1_zh", tile)(x, w1, b1, z, h)
    return z, h


def forward(x, w1, b1, w2, b2, config: MlpConfig | None = None, wgmma: bool | None = None) -> torch.Tensor:
    """temb = silu(x w1^T + b1) w2^T + b2: x (T, 256), w1 (5376, 256), w2 (2688, 5376) -> (T, 2688).
    wgmma: fc2 on the TF32 wgmma weight GEMM (sm_90a only) or not; None: `forward_weight_tile`. Same bits."""
    num_rows = x.shape[0]
    dev = x.device
    out = torch.empty((num_rows, TEMB), dtype=torch.float32, device=dev)
    if num_rows == 0:
        return out
    cfg = config or pick_config(num_rows)
    partials = torch.empty((SPLITS["fc2"], num_rows, TEMB), dtype=torch.float32, device=dev)
    if wgmma is None:
        tile = forward_weight_tile(dev, num_rows)
    else:
        tile = (forward_weight_tile(dev, num_rows) or WEIGHT_TILE) if wgmma else None
    if tile is not None:  # fc1 writes h's big / small TF32 operand arrays, fc2 splits w2 in registers
        h_big, h_small = (torch.empty((num_rows, MLP_HIDDEN), dtype=torch.float32, device=dev) for _ in range(2))
        if tile == WEIGHT_TILE:  # large T: fc1 on wgmma too (w1 in registers, x split first)
            _weight_gemm(dev, "fc1_split", WEIGHT_FC1_TILE)(w1, *_split(x), b1, h_big, h_small)
        else:
            _gemm(dev, "fc1_split", cfg.fc1)(x, w1, b1, h_big, h_small)
        _weight_gemm(dev, "fc2", tile)(w2, h_big, h_small, partials)
    else:
        h = torch.empty((num_rows, MLP_HIDDEN), dtype=torch.float32, device=dev)
        _gemm(dev, "fc1", cfg.fc1)(x, w1, b1, h)  # h only: the forward never reads z
        _gemm(dev, "fc2", cfg.fc2)(h, w2, partials)
    _fold(dev, "fc2", "bias")(partials, b2, out)
    return out


def transposed(a: torch.Tensor) -> torch.Tensor:
    """The (N, T) view with strides (1, N) of a contiguous (T, N) tensor, the layout the MN-major
    kernels are compiled for (as_strided: a size-1 dim of a contiguous tensor may carry any stride)."""
    return a.as_strided((a.shape[1], a.shape[0]), (1, a.shape[1]))


def backward(grad, x, w1, b1, w2, config: MlpConfig | None = None, wgmma: bool | None = None):
    """(dx, dw1, db1, dw2, db2) of temb = timestep_mlp(x, w1, b1, w2, b2) for upstream `grad` (T, 2688).
    wgmma: fc2_dgrad and fc2_wgrad on TF32 wgmma (sm_90a only); None: `uses_wgmma`. Same bits either way."""
    num_rows = x.shape[0]
    dev = x.device
    f32 = dict(dtype=torch.float32, device=dev)
    if num_rows == 0:
        return (torch.empty((0, FREQ), **f32), torch.zeros_like(w1), torch.zeros_like(b1),
                torch.zeros_like(w2), torch.zeros((TEMB,), **f32))
    cfg = config or pick_config(num_rows)
    use_wgmma = uses_wgmma(dev, num_rows) if wgmma is None else wgmma
    z, h = _fc1(x, w1, b1, cfg.fc1, use_wgmma)

    dh_partials = torch.empty((SPLITS["fc2_dgrad"], num_rows, MLP_HIDDEN), **f32)
    if use_wgmma:  # W = w2^T (5376, 2688), read as w2 in place (M-major weight tiles)
        _weight_gemm(dev, "fc2_dgrad")(transposed(w2), *_split(grad), dh_partials)
    else:
        _gemm(dev, "fc2_dgrad", cfg.fc2_dgrad)(grad, transposed(w2), dh_partials)  # w2 read N-major in place
    dz = torch.empty((num_rows, MLP_HIDDEN), **f32)
    db1 = torch.empty((MLP_HIDDEN,), **f32)
    # dz = fold(dh partials) * silu'(z), and db1 = column sums of dz, in one pass
    runtime.kernel("timestep_mlp_colsum", dev, cols=MLP_HIDDEN, fold_dz=True)(dh_partials, z, dz, db1)

    dx_partials = torch.empty((SPLITS["fc1_dgrad"], num_rows, FREQ), **f32)
    _gemm(dev, "fc1_dgrad", cfg.fc1_dgrad)(dz, transposed(w1), dx_partials)
    dx = torch.empty((num_rows, FREQ), **f32)
    _fold(dev, "fc1_dgrad", "sum")(dx_partials, dx.new_empty((1,)), dx)

    dw2 = torch.empty((1, TEMB, MLP_HIDDEN), **f32)
    if use_wgmma:
        # A = grad^T (2688, T), B = h^T (5376, T), K = T zero-padded: a chunk of zeros adds +-0, and acc is
        # never -0 (it starts at +0; an RN sum is -0 only when both terms are), so it leaves every bit alone,
        # however many such chunks the padding (here to 32, in the mma.sync kernel to its tile_k) adds.
        depth = -(-num_rows // WGMMA_K_PAD) * WGMMA_K_PAD
        _wgmma_gemm(dev, "fc2_wgrad")(*_split_transposed(grad, depth), *_split_transposed(h, depth), dw2)
    else:
        _gemm(dev, "fc2_wgrad", cfg.fc2_wgrad)(transposed(grad), transposed(h), dw2)
    dw1 = torch.empty((1, MLP_HIDDEN, FREQ), **f32)
    _gemm(dev, "fc1_wgrad", cfg.fc1_wgrad)(transposed(dz), transposed(x), dw1)

    db2 = torch.empty((TEMB,), **f32)
    runtime.kernel("timestep_mlp_colsum", dev, cols=TEMB, fold_dz=False)(grad, grad, grad, db2)
    return dx, dw1[0], db1, dw2[0], db2
