"""Host side of `h3::adaln_projection` on CUDA: `table = linear(silu(temb).bf16, W, b)` and its backward.

Kernels (kernels/adaln_gemm.py): `adaln_silu_cast` makes the GEMM operand a = bf16(silu(temb));
`adaln_proj_fwd` computes out^T = W a^T + b with mma.sync m16n8k16 (W rows are the MMA's M, T its N).
The backward: `adaln_proj_dgrad` (grad @ W as `DGRAD_SPLITS` fixed-chunk FP32 partials) +
`adaln_dtemb_fold` (sum in split order, times silu'(temb), FP32: the BF16 cast passes the gradient
through unrounded; it also recomputes a, with silu_cast's bits, for the next kernel);
`adaln_proj_wgrad` (dW = grad^T a, K = T, BF16 out; also db where `wgrad_writes_dbias`: the dW kernels
with db warps (`DB_WARP_WGRAD_CONFIGS`) at every T, the others for T <= `FUSED_DBIAS_ROWS`); `adaln_bias_grad`
otherwise (db = sum_t grad: FP32 sums of `DBIAS_ROW_BLOCK`-row blocks, each of four row chains, folded in block
order, BF16 out; the dW kernels use the same order, so the same bits). Beyond T = 384 on the wgmma family
(`wgrad_folds`) the dW kernel `adaln_proj_wgrad_fold` also does the d_temb fold and db's block sums in its idle
producer warps (db's blocks from the dW stages, folded by a second launch of the same compiled function: the same
sums, the same bits), after `adaln_silu_cast` makes its operand. No atomics: every result is bitwise repeatable.

The tile config is picked from T (`config_for_rows`) purely for speed: every config runs the same
k16 MMA sequence per output element, so the bits do not depend on it (tests check this). Used with
out_features 96768 (this op) and 10752 (final_adaln_out's projection). No host syncs.

Two MMA families: `CONFIGS` (warp mma.sync, sm_90a and sm_100a) and `WGMMA_CONFIGS` (sm_90a
warpgroup MMA, `*_wgmma` kernels). Their bits may differ, so a device uses one family for every T:
`SM90_FAMILY` says which on sm_90a. An explicit `config` picks its family (tests, timing). The wgmma
family's `TMA_*` configs run the same kernels with a TMA + mbarrier warp-specialized mainloop (same bits).
"""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.widths import BLOCK_PROJECTION, TEMB

DGRAD_SPLITS = 12  # must equal kernels/adaln_gemm.DGRAD_SPLITS (a CPU test checks)
PERSISTENT_CTAS = 132  # kernels/adaln_gemm.PERSISTENT_CTAS: the H200's SMs, one d_temb unit each (a CPU test checks)
DBIAS_ROW_BLOCK = 64  # kernels/adaln_gemm.DBIAS_ROW_BLOCK: db sums T in blocks of this many rows,
DBIAS_CHAIN_ROWS = 16  # each of four chains of this many rows (kernels/adaln_gemm.DBIAS_CHAIN_ROWS)
FUSED_DBIAS_ROWS = 64  # kernels/adaln_gemm.FUSED_DBIAS_ROWS: up to this T every dW kernel writes db
# Names of kernels/adaln_gemm.CONFIGS and .WGMMA_CONFIGS (a CPU test checks they agree).
CONFIGS = ("skinny", "skinny_m32", "skinny_m128", "mid", "wide", "wide_k32", "wide_8warps")
WGMMA_CONFIGS = ("wg_skinny", "wg_mid", "wg_wide", "wg_wide_s4")
# The wgmma family's TMA + mbarrier warp-specialized mainloop (kernels/adaln_gemm.TMA_CONFIGS, same kernels,
# same bits): forward and d_temb configs (the d_temb GEMM has no 256-wide tile: its block tiles' registers),
# and dW tiles. tma_wide_n256_mc2: tma_wide_n256 in 2-CTA clusters sharing the activation tile (TMA multicast);
# tma_wide_a_mc2 / tma_wide_n256_a_mc2: tma_wide / tma_wide_n256 in 2-CTA clusters sharing the weight tile;
# tma_wgrad_mc2: tma_wgrad sharing a^T;
# tma_persist_m256: the forward on the persistent 256-row kernel of the dW; tma_wide_n256_tail (d_temb only):
# tma_wide_n256 whose thin last round of CTAs runs as 128-wide halves; tma_wide_n256_a_mc2_tail: the same in
# tma_wide_n256_a_mc2's clusters.
TMA_CONFIGS = ("tma_mid", "tma_wide", "tma_wide_n256", "tma_wide_n256_mc2", "tma_wide_a_mc2", "tma_wide_n256_a_mc2",
               "tma_wide_n192", "tma_persist_m256")
TMA_DGRAD_CONFIGS = ("tma_mid", "tma_wide", "tma_wide_n256", "tma_wide_a_mc2", "tma_wide_n256_a_mc2", "tma_wide_n192",
                     "tma_wide_n256_tail", "tma_wide_n256_a_mc2_tail")
# dW tiles of each family (kernels/adaln_gemm.WGRAD_CONFIGS, .WGRAD_WGMMA_CONFIGS): within a family
# the same bits, picked from T for speed.
WGRAD_CONFIGS = ("wgrad", "wgrad_n64")
# The `*_tstore` tiles store C by TMA (kernels/adaln_gemm.WGRAD_TMA_STORE): same bits, timed as alternatives.
WGRAD_WGMMA_CONFIGS = ("wg_wgrad", "wg_wgrad_n64", "wg_wgrad_n64_1wg", "wg_wgrad_n64_1wg_tstore", "wg_wgrad_n64_tstore",
                       "wg_wgrad_tstore")
# The persistent dW kernel (TMA stores from double-buffered C tiles) is in the same tuple: same bits.
TMA_WGRAD_CONFIGS = ("tma_wgrad", "tma_wgrad_k32", "tma_wgrad_mc2", "tma_wgrad_persist", "tma_wgrad_persist_n64",
                     "tma_wgrad_persist_pingpong", "tma_wgrad_persist_m256", "tma_wgrad_persist_db",
                     "tma_wgrad_persist_pingpong_db")
# Persistent dW kernels whose producer warps also sum db, at every T (kernels/adaln_gemm.WGRAD_DB_WARPS; a CPU test
# checks).
DB_WARP_WGRAD_CONFIGS = ("tma_wgrad_persist_db", "tma_wgrad_persist_pingpong_db")
# Persistent dW tiles that also run as `adaln_proj_wgrad_fold`, the kernel whose idle producer warps fold d_temb from
# the partials and sum db while the consumers run dW (kernels/adaln_gemm.FOLD_WARP_WGRAD_CONFIGS; a CPU test checks).
FOLD_WARP_WGRAD_CONFIGS = ("tma_wgrad_persist_m256",)
# The family sm_90a devices use. The wgmma family passed the GPU suite on an H200 (commit 2b6f15b)
# and was as fast or faster at every T measured (1, 4, 64, 256, 2048); sm_100a uses the warp family.
SM90_FAMILY = "wgmma"


def config_for_rows(rows: int, wgmma: bool = False) -> str:
    """The fastest projection config of a family for T rows; the choice never changes the bits. wgmma, from the
    H200 per-launch timings (perf/adaln_kernels.py; perf/results/h200/README.md maps the files): T <= 64 the
    cp.async tiles (wg_mid 134.6 us at T = 64 vs tma_mid 136.3, 0baae16), then the TMA mainloop: tma_wide to
    T = 128, one 192-row tile to 192 (1a113a8: tma_wide_n192 166.6 us at T = 192 vs tma_wide_n256_mc2 205.2;
    ef9eb22: tma_wide 278.2), then the 256-wide tile in 2-CTA clusters sharing the activation tile by TMA
    multicast (ef9eb22: 399.3 vs tma_wide 451.6 us at T = 512, 1512.9 vs 1725.8 at 2048) except where its T
    padding costs more than it gains: T in (256, 384] (tma_wide 347.1 vs 396.4 at T = 384). Beyond T = 384 the
    persistent 256-row kernel (tma_persist_m256: its stores overlap the next tile's loads and MMAs): 447.3 / 813.3
    / 1583.0 us at T = 512 / 1024 / 2048 against tma_wide_n256_mc2's 455.3 / 895.7 / 1711.5 (31d6ae1, 3 rounds),
    513.7 / 647.3 against 659.6 / 708.1 at T = 640 / 768 (93d851f), and at the H200's power limit
    (perf/clock_probe.py, each launch sustained) 1604.0 against 1693.9 and cuBLAS's F.linear 1612.3 at T = 2048.
    At T = 512 tma_wide ran faster in three runs (430.8 / 438.4 / 413.9 us against 455.9 at 6799442 and 436.0 at
    2550b3e, 3 rounds): T in (384, 512] runs tma_wide."""
    if wgmma:
        if rows <= 64:
            return "wg_skinny" if rows <= 16 else "wg_mid"
        if rows <= 128 or 256 < rows <= 512:
            return "tma_wide"
        if rows > 512:
            return "tma_persist_m256"
        return "tma_wide_n192" if rows <= 192 else "tma_wide_n256_mc2"
    if rows <= 16:
        return "skinny"
    if rows <= 64:
        return "mid"
    return "wide"


def dgrad_round_columns(rows: int, tile_rows: int, tail_halves: bool) -> float:
    """A d_temb tile's cost model beyond T = 384: the rounds of 132 SMs its units take (ceil(T / tile_rows) T tiles x
    21 W^T tiles x DGRAD_SPLITS, one unit per SM; with `tail_halves` a last round at most half full counts half) times
    the T rows per unit. tma_wide_n256_tail and tma_wide_n192 both run the one-block-tile mainloop at the same cost
    per unit column on the H200 (T = 2048, 2550b3e: 1777.6 us for 15.5 rounds of 256, 1820.4 for 21 rounds of 192,
    0.45 us per column each)."""
    units = -(-rows // tile_rows) * (TEMB // 128) * DGRAD_SPLITS
    rest = units % PERSISTENT_CTAS
    rounds = units // PERSISTENT_CTAS + (0.5 if tail_halves and 2 * rest <= PERSISTENT_CTAS else 1) * (rest > 0)
    return rounds * tile_rows


# T ranges beyond 384 (to DGRAD_MODEL_ROWS) where `dgrad_round_columns` puts tma_wide_n192 more than 5% under
# tma_wide_n256_tail (a CPU test recomputes them). Measured at T = 1300: 1234.8 / 1254.5 us against 1339.2 / 1330.0
# (c37807d / 368d96c).
DGRAD_N192_RANGES = ((513, 576), (769, 960), (1025, 1152), (1281, 1344), (2049, 2112), (2817, 2880))
DGRAD_MODEL_ROWS = 8192


def dgrad_config_for_rows(rows: int, wgmma: bool = False) -> str:
    """The d_temb GEMM's config for T rows (same bits whatever the config). wgmma, from the H200 per-launch
    timings: wg_skinny while W streams (T <= 16), then the TMA mainloop (T = 64: tma_mid 128.4 us vs wg_mid
    135.2, 0baae16), tma_wide to T = 128 (ef9eb22: 137.9 us at T = 96 and 128), then the widest tile T fills,
    run on one block tile with the warpgroups taking turns: one 192-row tile to T = 192 (0f2dc29: tma_wide_n192
    163.1 us at T = 192 vs tma_mid 217.5), 256-row tiles beyond (9dd67c6: tma_wide_n256 220.4 vs tma_wide
    245.1 us at T = 256, 429.4 vs 477.4 at 512, 1921.8 vs 1957.3 at 2048) except for T in (256, 384], where
    tma_wide's 128-row tiles pad less (ef9eb22: 363.3 us at T = 384). At T = 256 tma_wide was behind once (9dd67c6,
    above) and ahead in both runs of 45d5512 / 14feb80 (3 rounds each): 237.0 / 230.2 us against tma_wide_n256's
    244.7 / 242.3, and took (192, 384] until the 256-wide tile was timed at the power limit (perf/clock_probe.py,
    1f92079, T = 256, each launch 1.5 s back to back): tma_wide_n256_tail 253.8 us, tma_wide_n256 255.6, tma_wide
    277.6 (cuBLAS's d_a 232.0; in bursts the same run had 238.1 / 222.4 / 231.8). (192, 256] now runs the 256-wide
    tile; (256, 384] keeps tma_wide (T = 384 sustained 400.0 us). A tma_wide whose warpgroups take turns on one
    block tile (the 256-wide tile's mainloop) was slower both ways (1f92079: 279.0 / 406.4 us sustained, 250.2 / 361.2
    in bursts at T = 256 / 384) and was dropped. The 2-CTA clusters sharing the W tile (tma_wide_a_mc2) won and lost by
    turns between runs (T = 256: 226.0 vs tma_wide 234.1 at ef9eb22, 302.7 vs 240.7 at 1a113a8, 233.8 / 230.4 vs
    237.0 / 230.2 at 45d5512 / 14feb80): not picked. Beyond 384 the 256-wide tile runs as tma_wide_n256_tail: the
    same CTAs where the grid's last round is more than half full (T <= 1280), else that round's units as 128-wide
    halves (T = 2048: 15 rounds of 132 whole units, then 72 halves in place of 36 whole units), except in
    `DGRAD_N192_RANGES`, where tma_wide_n192's 192-row T tiles fill the rounds better (`dgrad_round_columns`)."""
    if wgmma:
        if rows <= 16:
            return "wg_skinny"
        if rows <= 64:
            return "tma_mid"
        if rows <= 128 or 256 < rows <= 384:
            return "tma_wide"
        if rows <= 192 or any(lo <= rows <= hi for lo, hi in DGRAD_N192_RANGES):
            return "tma_wide_n192"
        return "tma_wide_n256_tail"
    if rows <= 16:
        return "skinny"
    if rows <= 64:
        return "mid"
    return "wide" if rows <= 256 else "wide_8warps"


def wgrad_config_for_rows(rows: int, wgmma: bool = False) -> str:
    """A family's dW tile for T rows: at T <= 64 writing dW is the cost, beyond it the MMAs. wgmma, from the
    H200 per-launch timings (perf/adaln_kernels.py): at T <= 64 one warpgroup over 128 x 64 with C stored by
    TMA (wg_wgrad_n64_1wg_tstore 117.3 / 121.4 / 177.5 us at T = 1 / 4 / 64 against wg_wgrad_n64_1wg's 159.4 /
    161.5 / 201.4, a0a2b50). Beyond 64 the persistent TMA kernels. To T = 384 the one whose warpgroups take whole
    tiles in turn, with db summed by its producer warps (tma_wgrad_persist_pingpong_db; 3 rounds at 439f961: 151.6 /
    157.6 / 200.6 / 236.0 / 324.7 us at T = 96 / 128 / 192 / 256 / 384 against 154.6 / 169.7 / 206.8 / 263.4 /
    365.8 for the cooperative kernel with db warps; at 4d31524 245.1 against 237.1 at T = 256): the kernels without
    them ran 152.3 / 159.7 / 196.4 / 232.6 us at T = 96 / 128 / 192 / 256 (45d5512 / 14feb80), 353.3 at 384
    (ef9eb22), plus adaln_bias_grad's 17-41 us. Beyond 384 no db warps (they cost more there than the launch they
    save: 1787.2 / 1950.4 us for tma_wgrad_persist_pingpong_db at 439f961 / 4d31524, 1935.1 / 1815.5 for
    tma_wgrad_persist_db, against 1629.6 + 103-131 for tma_wgrad_persist + adaln_bias_grad at T = 2048), and the
    256-row cooperative tile: at the H200's power limit, where a GEMM this size runs (perf/clock_probe.py, aa21e99,
    each launch sustained 2 s) 1598.0 us at T = 2048 against tma_wgrad_persist's 1657.4, the pingpong's 1692.9 and
    cuBLAS's 1630.4, and 826.6 against 856.9 at T = 1024 (f9f7194); in short bursts (perf/adaln_kernels.py, 31e16e7)
    831.1 / 1640.1 us at T = 1024 / 2048 against 844.6 / 1635.8 (the pingpong 782.2 / 1616.7). Its one C buffer
    and 256-row epilogue weigh more at shorter K: 447.4 / 682.1 us at T = 512 / 768 against tma_wgrad_persist's
    410.2 / 576.1 (f9f7194, bursts). Until 525afe0 the pingpong kernel (no db warps) ran T in (384, 768]: 412.9 /
    492.3 / 571.8 us at T = 512 / 640 / 768 against tma_wgrad_persist's 467.6 / 553.5 / 656.3 (31d6ae1, 93d851f).
    At T = 2048 the three swap places between bursts and sustained runs (31d6ae1: bursts 1616.4 / 1561.8 / 1650.8
    for the pingpong / cooperative / 256-row kernels, sustained 1682.8 / 1637.8 / 1589.8): the 256-row kernel, the
    leader under sustained load. Since 525afe0 that tile runs from T = 385 with the d_temb fold and db in its
    producer warps (`wgrad_folds`): with them it was ahead of the pingpong tile with them at T = 448 / 512 / 768
    (422.4 / 497.8 / 679.8 us against 434.2 / 512.4 / 722.3; 606.6 against 604.9 at 640; bursts, cdefae7 and
    525afe0), and with silu_cast ahead of the pingpong tile + adaln_dtemb_fold + adaln_bias_grad at 448 / 512 / 768
    (437 / 512 / 691 against 454 / 539 / 703 us), behind at 640 (618 against 590)."""
    if wgmma:
        if rows <= 64:
            return "wg_wgrad_n64_1wg_tstore"
        if rows <= 384:
            return "tma_wgrad_persist_pingpong_db"
        return "tma_wgrad_persist_m256"
    return "wgrad_n64" if rows <= 64 else "wgrad"


def wgrad_folds(config: str, wgmma: bool) -> bool:
    """Whether the backward runs the dW GEMM of `config` as `adaln_proj_wgrad_fold`: its fold warps then write d_temb
    and db (the bits of adaln_dtemb_fold and adaln_bias_grad), so neither launches, and adaln_silu_cast makes the
    dW operand first. The wgmma family's dW pick beyond T = 384, where dW is MMA-bound and the two memory-bound
    launches cost ~210 us at T = 2048. Sustained (perf/clock_probe.py), silu_cast + dW with fold warps against
    adaln_dtemb_fold + dW + adaln_bias_grad: 1707.4 / 1722.3 against 1754.7 / 1775.5 us at T = 2048 (525afe0 /
    a2c0780), 891.8 against 939.1 at 1024 (a2c0780)."""
    return wgmma and config in FOLD_WARP_WGRAD_CONFIGS


def wgrad_writes_dbias(config: str, rows: int) -> bool:
    """Whether the dW GEMM of `config` writes db at T rows (else `adaln_bias_grad` runs after it; the same bits):
    the kernels with db warps sum each stage of db's tiles as it lands, at every T; the others re-read grad for it
    after their main loop, worth it only while T is small."""
    return config in DB_WARP_WGRAD_CONFIGS or rows <= FUSED_DBIAS_ROWS


def dbias_blocks(rows: int) -> int:
    """`adaln_bias_grad`'s partial rows for T rows: one per DBIAS_ROW_BLOCK block (the kernel reads the count off
    its partial tensor; the C++ layer computes it the same way)."""
    return -(-rows // DBIAS_ROW_BLOCK)


def _uses_wgmma(device, config: str | None) -> bool:
    if config is not None:
        return config in WGMMA_CONFIGS or config in TMA_CONFIGS or config in TMA_DGRAD_CONFIGS
    return SM90_FAMILY == "wgmma" and runtime.arch_of(device) == "sm_90a"


# Where a launch choice of the C++ impls (h3cute.native) changes with T: the forward's config (16, 64, 128, 192,
# 256, 512), the d_temb config (16, 64, 128, 192, 384 and the ends of DGRAD_N192_RANGES), the dW tile (64, 384),
# whether it writes db (64, 384) and whether its fold warps run (384).
T_BOUNDS = tuple(sorted({16, 64, 128, 192, 256, 384, 512, runtime.MAX_ROWS}
                        | {b for lo, hi in DGRAD_N192_RANGES for b in (lo - 1, hi)}))


def _choices(device, rows: int, backward: bool) -> tuple:
    wgmma = _uses_wgmma(device, None)
    if not backward:
        return wgmma, config_for_rows(rows, wgmma)
    wgrad = wgrad_config_for_rows(rows, wgmma)
    return wgmma, dgrad_config_for_rows(rows, wgmma), wgrad, not wgrad_writes_dbias(wgrad, rows)


FOLD_WARPS_LAUNCH = -1  # kernel_handles' launch constant for the fold-warp backward (h3cute.native.constants)


def kernel_handles(device: int, backward: int, num_rows: int):
    """For the C++ impls (h3cute.native), N = 96768: the T range sharing every launch choice and the C handles
    of `forward`'s kernels (`adaln_silu_cast`, the projection GEMM) or `backward`'s (the d_temb GEMM,
    `adaln_dtemb_fold`, the dW GEMM, then `adaln_bias_grad` where the dW GEMM does not write db; where the dW GEMM's
    fold warps fold d_temb and sum db (`wgrad_folds`): `adaln_silu_cast`, the d_temb GEMM, `adaln_proj_wgrad_fold`)
    with one launch constant: db's row block (DBIAS_ROW_BLOCK) where adaln_bias_grad runs, 0 where the dW GEMM writes
    db, FOLD_WARPS_LAUNCH where its fold warps do both."""
    dev = torch.device("cuda", device)
    lo, hi = runtime.row_range(T_BOUNDS, num_rows)
    choices = _choices(dev, num_rows, bool(backward))
    assert _choices(dev, max(lo, 1), bool(backward)) == choices == _choices(dev, hi, bool(backward)), "stale T_BOUNDS"
    n = BLOCK_PROJECTION
    if not backward:
        wgmma, config = choices
        proj = "adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd"
        fns = [runtime.kernel("adaln_silu_cast", dev, width=TEMB),
               runtime.kernel(proj, dev, out_features=n, config=config)]
        return lo, hi, [fn.__chandle__() for fn in fns]
    wgmma, dgrad, wgrad, unfused_dbias = choices
    if wgrad_folds(wgrad, wgmma):
        fns = [runtime.kernel("adaln_silu_cast", dev, width=TEMB),
               runtime.kernel("adaln_proj_dgrad_wgmma", dev, out_features=n, config=dgrad),
               runtime.kernel("adaln_proj_wgrad_fold", dev, out_features=n, config=wgrad)]
        return lo, hi, [fn.__chandle__() for fn in fns], [FOLD_WARPS_LAUNCH]
    fns = [runtime.kernel("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", dev, out_features=n, config=dgrad),
           runtime.kernel("adaln_dtemb_fold", dev, width=TEMB),
           runtime.kernel("adaln_proj_wgrad_wgmma", dev, out_features=n, wgmma=True, config=wgrad) if wgmma
           else runtime.kernel("adaln_proj_wgrad", dev, out_features=n, config=wgrad)]
    if unfused_dbias:
        fns.append(runtime.kernel("adaln_bias_grad", dev, out_features=n))
    return lo, hi, [fn.__chandle__() for fn in fns], [DBIAS_ROW_BLOCK if unfused_dbias else 0]


def dense16(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 16-byte aligned start (the kernels' 16-byte vector and TMA accesses), copied
    if it is not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def silu_bf16(temb: torch.Tensor) -> torch.Tensor:
    """(T, 2688) FP32 -> bf16(silu(temb)), SiLU in FP32 (the GEMM's activation operand)."""
    temb = dense16(temb)
    act = torch.empty(temb.shape, dtype=torch.bfloat16, device=temb.device)
    runtime.kernel("adaln_silu_cast", temb.device, width=TEMB)(temb, act)
    return act


def forward(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, config: str | None = None) -> torch.Tensor:
    """(T, 2688) FP32 temb, (N, 2688) BF16 weight, (N,) BF16 bias -> (T, N) BF16, N in {96768, 10752}."""
    if config is not None and config not in CONFIGS + WGMMA_CONFIGS + TMA_CONFIGS:
        raise ValueError(f"adaln_projection forward: config {config!r} has no forward GEMM; one of "
                         f"{CONFIGS + WGMMA_CONFIGS + TMA_CONFIGS}")
    rows, out_features = temb.shape[0], weight.shape[0]
    out = torch.empty((rows, out_features), dtype=torch.bfloat16, device=temb.device)
    if rows == 0:  # a zero-sized grid is not a valid launch
        return out
    act = silu_bf16(temb)
    wgmma = _uses_wgmma(temb.device, config)
    fn = runtime.kernel("adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd", temb.device,
                        out_features=out_features, config=config or config_for_rows(rows, wgmma))
    fn(act, dense16(weight), dense16(bias), out)
    return out


def backward(grad: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, config: str | None = None,
             fold_warps: bool | None = None):
    """(T, N) BF16 grad -> (dtemb (T, 2688) FP32, dweight (N, 2688) BF16, dbias (N,) BF16). `config`, if
    given, is the d_temb GEMM's (dW's tile is picked from T). `fold_warps` (default `wgrad_folds`) runs the dW
    tile as `adaln_proj_wgrad_fold` or not (the same bits either way; tests and timing)."""
    if config is not None and config not in CONFIGS + WGMMA_CONFIGS + TMA_DGRAD_CONFIGS:
        raise ValueError(f"adaln_projection backward: config {config!r} has no d_temb GEMM; one of "
                         f"{CONFIGS + WGMMA_CONFIGS + TMA_DGRAD_CONFIGS}")
    rows, out_features = temb.shape[0], weight.shape[0]
    device = temb.device
    if rows == 0:
        return temb.new_empty((0, TEMB)), torch.zeros_like(weight), weight.new_zeros((out_features,))
    grad, temb, weight = dense16(grad), dense16(temb), dense16(weight)
    wgmma = _uses_wgmma(device, config)
    wgrad_config = wgrad_config_for_rows(rows, wgmma)
    folds = wgrad_folds(wgrad_config, wgmma) if fold_warps is None else fold_warps
    if folds and not wgrad_folds(wgrad_config, wgmma):
        raise ValueError(f"adaln_projection backward: the dW tile {wgrad_config!r} at T = {rows} has no fold warps")
    act = silu_bf16(temb) if folds else torch.empty((rows, TEMB), dtype=torch.bfloat16, device=device)
    partial = torch.empty((DGRAD_SPLITS, rows, TEMB), dtype=torch.float32, device=device)
    runtime.kernel("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", device, out_features=out_features,
                   config=config or dgrad_config_for_rows(rows, wgmma))(grad, weight, partial)
    dtemb = torch.empty((rows, TEMB), dtype=torch.float32, device=device)
    dweight = torch.empty_like(weight)
    dbias = torch.empty((out_features,), dtype=torch.bfloat16, device=device)
    if folds:
        blocks = torch.empty((dbias_blocks(rows), out_features), dtype=torch.float32, device=device)
        runtime.kernel("adaln_proj_wgrad_fold", device, out_features=out_features, config=wgrad_config)(
            grad, act, dweight, dbias, partial, temb, dtemb, blocks)
        return dtemb, dweight, dbias
    runtime.kernel("adaln_dtemb_fold", device, width=TEMB)(partial, temb, dtemb, act)  # act = bf16(silu(temb))
    if wgmma:
        wgrad = runtime.kernel("adaln_proj_wgrad_wgmma", device, out_features=out_features, wgmma=True,
                               config=wgrad_config)
    else:
        wgrad = runtime.kernel("adaln_proj_wgrad", device, out_features=out_features, config=wgrad_config)
    wgrad(grad, act, dweight, dbias)
    if not wgrad_writes_dbias(wgrad_config, rows):
        bias_partial = torch.empty((dbias_blocks(rows), out_features), dtype=torch.float32, device=device)
        runtime.kernel("adaln_bias_grad", device, out_features=out_features)(grad, bias_partial, dbias)
    return dtemb, dweight, dbias
