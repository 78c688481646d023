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

The launches are launch plans (h3cute.launch.plan): `build` writes them, `forward` / `backward` walk them, and
the C++ layer walks the same plans (`native_plan`). The intermediates are carved from one allocation and the
backward's five gradients from another (host time at small T). Row ranges: T = 0 (no launch), then the config
picks' T ranges (T_BOUNDS), cut on sm_90a at the forward's fc2 tiles (WEIGHT_SMALL_TILES) and WGMMA_MIN_ROWS.

Config choice may look at T (it changes only speed): every config in CONFIGS (kernels/_tiles.py, with the pick table
T_BOUNDS; the bundle builds the tiles of the picked configs, the others compile on demand) gives the same bits,
because the summation order is fixed by K and the slice count (kernels/timestep_mlp.py). The op
layer validates shapes/dtypes/devices; here inputs are contiguous FP32 on one CUDA device, T >= 0.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from h3cute import runtime
from h3cute.kernels._tiles import (CONFIGS, LARGE_T, LARGE_T_S5, MID_T, SMALL_T, SMALL_T_K64,  # noqa: F401
                                   T_BOUNDS, WIDE_T, GemmConfig, MlpConfig)
from h3cute.kernels import _tiles
from h3cute.launch import plan as P
from h3cute.launch.plan import M, Buffer, Fill, Kernel, Launch, Layout, Output, Phase, view
from h3cute.widths import FREQ, MLP_HIDDEN, TEMB

OP = "timestep_mlp"
INPUTS = {Phase.FORWARD: ("x", "w1", "b1", "w2", "b2"), Phase.BACKWARD: ("grad", "x", "w1", "b1", "w2")}
F32 = torch.float32

# K-slice counts of the split GEMMs: K // 896 (kernels/timestep_mlp.py: k_splits; a CPU test pins it).
SPLITS = {"fc2": MLP_HIDDEN // 896, "fc2_dgrad": TEMB // 896, "fc1_dgrad": MLP_HIDDEN // 896}


# sm_90a from this many rows: the fc2-sized GEMMs and fc1 on TF32 wgmma (speed only: same bits). From T = 256 the
# wgmma path is faster forward and backward on the H200; at T = 128 its backward only ties the mma.sync path's
# (per-launch times: perf/mlp_kernels.py).
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



@dataclass(frozen=True)
class Key:
    """The launcher's overrides (speed only: the same bits); the C++ layer runs the defaults."""
    config: MlpConfig | None = None  # None: pick_config's for T
    wgmma: bool | None = None  # None: the device's path (forward_weight_tile / uses_wgmma)


KEYS = {Phase.FORWARD: Key, Phase.BACKWARD: Key}


def pick_config(num_rows: int) -> MlpConfig:
    """Speed only: 16-row tiles while the weights stream (memory-bound), bigger tiles as T grows."""
    return _bucket(num_rows)[2]


def _bucket(num_rows: int) -> tuple[int, int, MlpConfig]:
    lo, hi = runtime.row_range([bound for bound, _ in T_BOUNDS], num_rows)
    return lo, hi, dict(T_BOUNDS)[hi]


# ---- `h3cute-bench sweep`'s configs: CONFIGS by name, and configs written on its command line ----------------

CONFIG_NAMES = {name: value for name, value in vars(_tiles).items() if isinstance(value, MlpConfig)}  # CONFIGS'
_TILE_FIELDS = tuple(f.name for f in dataclasses.fields(GemmConfig))
_ROLES = tuple(f.name for f in dataclasses.fields(MlpConfig))


def parse_config(text: str) -> MlpConfig:
    """A config named in CONFIG_NAMES, or written as `NAME:field=value,...`: field overrides of the named config's
    GEMM tiles, `ROLE.FIELD=N` for one role's tile (`MID_T:fc2.stages=5`) or `FIELD=N` for every role's
    (`SMALL_T:tile_k=64`); GemmConfig checks the tiles. Every config gives the same bits."""
    base, _, overrides = text.partition(":")
    if base not in CONFIG_NAMES:
        raise ValueError(f"timestep_mlp config {base!r} is not a named config; one of {list(CONFIG_NAMES)}")
    config = CONFIG_NAMES[base]
    if not overrides:
        return config
    tiles = {role: {} for role in _ROLES}
    for item in overrides.split(","):
        key, eq, value = item.partition("=")
        role, dot, field = key.rpartition(".")
        roles = (role,) if dot else _ROLES
        if not eq or field not in _TILE_FIELDS or (dot and role not in _ROLES):
            raise ValueError(f"timestep_mlp config {text!r}: {item!r} is not [ROLE.]FIELD=N with a role of {_ROLES} "
                             f"and a field of {_TILE_FIELDS}")
        try:
            number = int(value)
        except ValueError:
            raise ValueError(f"timestep_mlp config {text!r}: {field} takes an integer, not {value!r}") from None
        for r in roles:
            tiles[r][field] = number
    try:
        return MlpConfig(**{r: dataclasses.replace(getattr(config, r), **tiles[r]) for r in _ROLES})
    except ValueError as e:
        raise ValueError(f"timestep_mlp config {text!r}: {e}") from None


def sweep_picks(device) -> tuple[str, ...]:
    """The configs the T picks ship (T_BOUNDS), by name in T order: what `h3cute-bench sweep` checks a command-line
    config against."""
    names = {id(config): name for name, config in CONFIG_NAMES.items()}
    return tuple(dict.fromkeys(names[id(config)] for _, config in T_BOUNDS))


def sweep_config(text: str, device) -> tuple[str, MlpConfig]:
    """(name, config) of a config written on `h3cute-bench sweep`'s command line (`parse_config`); its tiles
    compile on demand."""
    return text, parse_config(text)


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


def _row_range(device, rows: int, config: MlpConfig | None) -> tuple[int, int]:
    """The rows sharing every launch choice with `rows`: the config's T range (all rows given a config) and, on
    sm_90a, the forward's fc2 tile range and the wgmma path's."""
    if rows == 0:
        return 0, 0
    lo, hi = (1, runtime.MAX_ROWS) if config else _bucket(rows)[:2]
    if runtime.arch_of(device) == "sm_90a":
        bounds = [bound for bound, _ in WEIGHT_SMALL_TILES] + [WGMMA_MIN_ROWS - 1, runtime.MAX_ROWS]
        sm90_lo, sm90_hi = runtime.row_range(bounds, rows)
        lo, hi = max(lo, sm90_lo), min(hi, sm90_hi)
    return max(lo, 1), hi


def _gemm(role: str, tile: GemmConfig) -> Kernel:
    return Kernel.of("timestep_mlp_gemm", role=role, tile=tile.astuple())


def _fold(role: str, mode: str) -> Kernel:
    return Kernel.of("timestep_mlp_fold", role=role, mode=mode)


def _colsum(cols: int, fold_dz: bool) -> Kernel:
    return Kernel.of("timestep_mlp_colsum", cols=cols, fold_dz=fold_dz)


def _split(transpose: bool = False) -> Kernel:
    return Kernel.of("tf32_split", transpose=transpose)


def _wgmma_gemm(role: str) -> Kernel:
    k, splits = WGMMA_ROLES[role]
    return Kernel.of("tf32x3_wgmma_gemm", k=k, splits=splits, tile=WGMMA_TILE)


def _weight_gemm(role: str, tile: tuple = WEIGHT_TILE) -> Kernel:
    return Kernel.of("tf32x3_wgmma_weight_gemm", role=role, tile=tile)


def _scratch(name: str, *shape) -> Buffer:
    return Buffer(name, F32, shape, arena="scratch")


def build(phase: Phase, device, key: Key, rows: int) -> P.Plan:
    """The launch plan of h3::timestep_mlp's `phase` for `rows` rows (T): inputs x, w1, b1, w2, b2 forward; grad, x,
    w1, b1, w2 backward. The intermediates are carved from one allocation ("scratch"), the backward's five
    gradients from another ("grads": they outlive the intermediates)."""
    lo, hi = _row_range(device, rows, key.config)
    cfg = key.config or pick_config(max(rows, 1))
    if phase is Phase.FORWARD:
        buffers, steps = [Buffer("out", F32, (M, TEMB))], []
        if key.wgmma is None:
            tile = forward_weight_tile(device, rows)
        else:
            tile = (forward_weight_tile(device, rows) or WEIGHT_TILE) if key.wgmma else None
        partials = _scratch("partials", SPLITS["fc2"], M, TEMB)
        if rows == 0:
            pass
        elif tile is None:  # h only: the forward never reads z
            buffers += [_scratch("h", M, MLP_HIDDEN), partials]
            steps += [Launch(_gemm("fc1", cfg.fc1), (view("x"), view("w1"), view("b1"), view("h"))),
                      Launch(_gemm("fc2", cfg.fc2), (view("h"), view("w2"), view("partials")))]
        else:  # fc1 writes h's big / small TF32 operand arrays, fc2 splits w2 in registers
            h_pair = (view("h_big"), view("h_small"))
            if tile == WEIGHT_TILE:  # large T: fc1 on wgmma too (w1 in registers, x split first)
                buffers += [_scratch("x_big", M, FREQ), _scratch("x_small", M, FREQ)]
                steps += [Launch(_split(), (view("x"), view("x_big"), view("x_small"))),
                          Launch(_weight_gemm("fc1_split", WEIGHT_FC1_TILE),
                                 (view("w1"), view("x_big"), view("x_small"), view("b1"), *h_pair))]
            else:
                steps.append(Launch(_gemm("fc1_split", cfg.fc1), (view("x"), view("w1"), view("b1"), *h_pair)))
            buffers += [_scratch("h_big", M, MLP_HIDDEN), _scratch("h_small", M, MLP_HIDDEN), partials]
            steps.append(Launch(_weight_gemm("fc2", tile), (view("w2"), *h_pair, view("partials"))))
        if rows:
            steps.append(Launch(_fold("fc2", "bias"), (view("partials"), view("b2"), view("out"))))
        return P.Plan(OP, phase, key, lo, hi, INPUTS[phase], tuple(buffers), tuple(steps), (Output(view("out")),))

    # the five gradients, in the op's return order; the weight-gradient GEMMs write a (1, N, K) batch
    grads = [Buffer("dx", F32, (M, FREQ), "grads"), Buffer("dw1", F32, (1, MLP_HIDDEN, FREQ), "grads"),
             Buffer("db1", F32, (MLP_HIDDEN,), "grads"), Buffer("dw2", F32, (1, TEMB, MLP_HIDDEN), "grads"),
             Buffer("db2", F32, (TEMB,), "grads")]
    outputs = (Output(view("dx")), Output(view("dw1", layout=Layout.ITEM0)), Output(view("db1")),
               Output(view("dw2", layout=Layout.ITEM0)), Output(view("db2")))
    if rows == 0:
        steps = tuple(Fill(view(name), 0.0) for name in ("dw1", "db1", "dw2", "db2"))
        return P.Plan(OP, phase, key, lo, hi, INPUTS[phase], tuple(grads), steps, outputs)
    wgmma = uses_wgmma(device, rows) if key.wgmma is None else key.wgmma
    zh = (view("z"), view("h"))
    buffers, steps = [], []
    if wgmma:  # fc1_zh with w1 split in registers (x split first); fc2_dgrad with W = w2^T read as w2 in place
        buffers += [_scratch("x_big", M, FREQ), _scratch("x_small", M, FREQ)]
        steps += [Launch(_split(), (view("x"), view("x_big"), view("x_small"))),
                  Launch(_weight_gemm("fc1_zh", WEIGHT_FC1_TILE),
                         (view("w1"), view("x_big"), view("x_small"), view("b1"), *zh))]
    else:
        steps.append(Launch(_gemm("fc1_zh", cfg.fc1), (view("x"), view("w1"), view("b1"), *zh)))
    buffers += [_scratch("z", M, MLP_HIDDEN), _scratch("h", M, MLP_HIDDEN)]
    if wgmma:
        buffers += [_scratch("g_big", M, TEMB), _scratch("g_small", M, TEMB)]
        steps += [Launch(_split(), (view("grad"), view("g_big"), view("g_small"))),
                  Launch(_weight_gemm("fc2_dgrad"), (view("w2", layout=Layout.T), view("g_big"), view("g_small"),
                                                     view("dh_partials")))]
    else:  # w2 read N-major in place
        steps.append(Launch(_gemm("fc2_dgrad", cfg.fc2_dgrad),
                            (view("grad"), view("w2", layout=Layout.T), view("dh_partials"))))
    buffers += [_scratch("dh_partials", SPLITS["fc2_dgrad"], M, MLP_HIDDEN), _scratch("dz", M, MLP_HIDDEN),
                _scratch("dx_partials", SPLITS["fc1_dgrad"], M, FREQ)]
    steps += [
        # dz = fold(dh partials) * silu'(z), and db1 = column sums of dz, in one pass
        Launch(_colsum(MLP_HIDDEN, True), (view("dh_partials"), view("z"), view("dz"), view("db1"))),
        Launch(_gemm("fc1_dgrad", cfg.fc1_dgrad), (view("dz"), view("w1", layout=Layout.T), view("dx_partials"))),
        # the "sum" fold's (1,) aux operand is never read
        Launch(_fold("fc1_dgrad", "sum"), (view("dx_partials"), view("dx", layout=Layout.FIRST), view("dx")))]
    if wgmma:
        # A = grad^T (2688, T), B = h^T (5376, T), K = T zero-padded: a chunk of zeros adds +-0, and acc is
        # never -0 (it starts at +0; an RN sum is -0 only when both terms are), so it leaves every bit alone,
        # however many such chunks the padding (here to 32, in the mma.sync kernel to its tile_k) adds.
        depth = P.rows_up(WGMMA_K_PAD)
        buffers += [_scratch("gt_big", TEMB, depth), _scratch("gt_small", TEMB, depth),
                    _scratch("ht_big", MLP_HIDDEN, depth), _scratch("ht_small", MLP_HIDDEN, depth)]
        steps += [Launch(_split(True), (view("grad"), view("gt_big"), view("gt_small"))),
                  Launch(_split(True), (view("h"), view("ht_big"), view("ht_small"))),
                  Launch(_wgmma_gemm("fc2_wgrad"), (view("gt_big"), view("gt_small"), view("ht_big"),
                                                    view("ht_small"), view("dw2")))]
    else:
        steps.append(Launch(_gemm("fc2_wgrad", cfg.fc2_wgrad),
                            (view("grad", layout=Layout.T), view("h", layout=Layout.T), view("dw2"))))
    steps += [Launch(_gemm("fc1_wgrad", cfg.fc1_wgrad),
                     (view("dz", layout=Layout.T), view("x", layout=Layout.T), view("dw1"))),
              Launch(_colsum(TEMB, False), (view("grad"), view("grad"), view("grad"), view("db2")))]
    return P.Plan(OP, phase, key, lo, hi, INPUTS[phase], (*buffers, *grads), tuple(steps), outputs)


def forward(x, w1, b1, w2, b2, config: MlpConfig | None = None, wgmma: bool | None = None) -> torch.Tensor:
    """temb = silu(x w1^T + b1) w2^T + b2: x (T, 256), w1 (5376, 256), w2 (2688, 5376) -> (T, 2688).
    wgmma: fc2 on the TF32 wgmma weight GEMM (sm_90a only) or not; None: `forward_weight_tile`. Same bits."""
    key = Key(config, None if wgmma is None else bool(wgmma))
    return P.run(build, Phase.FORWARD, key, (x, w1, b1, w2, b2), x.shape[0], x.shape[:-1], x.device)[0]


def transposed(a: torch.Tensor) -> torch.Tensor:
    """The (N, T) view with strides (1, N) of a contiguous (T, N) tensor, the layout the MN-major
    kernels are compiled for (as_strided: a size-1 dim of a contiguous tensor may carry any stride)."""
    return a.as_strided((a.shape[1], a.shape[0]), (1, a.shape[1]))


def backward(grad, x, w1, b1, w2, config: MlpConfig | None = None, wgmma: bool | None = None):
    """(dx, dw1, db1, dw2, db2) of temb = timestep_mlp(x, w1, b1, w2, b2) for upstream `grad` (T, 2688).
    wgmma: fc2_dgrad and fc2_wgrad on TF32 wgmma (sm_90a only); None: `uses_wgmma`. Same bits either way."""
    key = Key(config, None if wgmma is None else bool(wgmma))
    return P.run(build, Phase.BACKWARD, key, (grad, x, w1, b1, w2), x.shape[0], x.shape[:-1], x.device)


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impls (h3cute.native): the encoded plan of `phase` serving `rows` (key (): the default picks)."""
    return P.native_plan(build, KEYS, device, phase, key, rows)
