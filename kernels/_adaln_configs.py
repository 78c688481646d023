"""The AdaLN projection GEMM's configs as data, shared by kernels/adaln_gemm.py and its launcher without the DSL (a
`_` module of `h3cute.kernels`: no kernels, no cutlass, no torch). `AdalnGemmConfig` is one frozen dataclass whose
fields say what a config is (tile, mainloop, C store, schedule, side warps, cluster, tail handling, the GEMMs it is
built for); `ADALN_GEMM_CONFIGS` holds every named config and `PICKS` the row-count pick tables, one per GEMM role.
kernels/adaln_gemm.py builds a kernel from a config (`kernel_class` picks the class from its fields) and prebuilds
the `picks` (what the tables can return; `candidates` adds the rest of a role's configs, compiled on demand);
launch/adaln_projection.py picks configs by T from the tables; `h3cute-bench sweep` ranks them. Bits never depend on
the config within a family (docs/adaln_projection.md), so a config is a speed choice only.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from h3cute.runtime.spec import SM_COUNT
from h3cute.widths import TEMB

# The persistent kernels' grid, compiled in: one CTA per H200 SM. On a GPU with more SMs the kernel stays correct and
# leaves some idle; the tile order, hence the bits, never depends on it. The pickers' cost models read the device's
# SM count instead (launch/adaln_projection.py).
PERSISTENT_CTAS = SM_COUNT["sm_90a"]

MAINLOOPS = ("mma_sync", "cp_async_wgmma", "tma_wgmma")  # warp mma.sync; wgmma fed by a cp.async ring or by TMA
STORES = ("smem", "tma")  # C staged in shared memory then vector stores by the threads; or bulk-stored by TMA
SCHEDULES = ("grid", "persistent", "pingpong")  # one CTA per tile; PERSISTENT_CTAS CTAs walking the tiles; the same
# with each consumer warpgroup taking whole tiles in turn
SIDE_WARPS = ("none", "dbias", "fold")  # the persistent kernels' idle producer warps: nothing; sum db at every T;
# fold d_temb from the d_temb GEMM's partials and sum db's blocks (`adaln_proj_wgrad_fold`)
ROLES = ("fwd", "dgrad", "wgrad", "wgrad_fold")  # the GEMMs a config is built for (kernel adaln_proj_<role>)


@dataclass(frozen=True)
class GemmTile:
    """What a kernel compiles from a config: CTA tile (bm x bn x bk), warp grid (warps_m x warps_n) and pipeline
    depth; `ctas_per_sm` > 0 asks ptxas for that many resident CTAs (.maxntid + .minnctapersm: a register cap);
    `persistent_ctas` > 0: a persistent grid of that many CTAs walking the output tiles (`TmaWgmmaPersistentGemm`);
    `cluster_m` > 1: clusters of that many M tiles (grid y) of one N tile that share B by TMA multicast;
    `cluster_n` > 1: clusters of that many N tiles (grid x) of one M tile that share A (`TmaWgmmaGemm`; one of the
    two at most)."""

    bm: int
    bn: int
    bk: int
    warps_m: int
    warps_n: int
    stages: int
    ctas_per_sm: int = 0
    persistent_ctas: int = 0
    cluster_m: int = 1
    cluster_n: int = 1
    pingpong: bool = False  # persistent dW: each consumer warpgroup takes whole tiles, in turn
    tail_halves: bool = False  # d_temb's 256-wide tile: a thin last round runs as 128-wide halves (`tail_units`)

    @property
    def mma_warpgroups(self) -> int:
        """Warpgroups stacked along M in one tiled MMA: one per 64 rows, or one for the whole tile (pingpong)."""
        return 1 if self.pingpong else self.warps_m // 4

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def launch_bounds(self) -> dict:
        """Extra launch arguments: the occupancy request (with the largest smem carveout) if any."""
        if not self.ctas_per_sm:
            return {}
        return dict(max_number_threads=[self.threads, 1, 1], min_blocks_per_mp=self.ctas_per_sm,
                    preferred_smem_carveout=100)

    def check(self) -> None:
        # The tiled MMA is (16 warps_m) x (16 warps_n) x 16 (two n8 atoms per warp so ldmatrix.x4
        # feeds B); the CTA tile must be a whole number of those, and each gmem copy pass must fit.
        assert self.bm % (16 * self.warps_m) == 0 and self.bn % (16 * self.warps_n) == 0, self
        assert self.bk % 16 == 0 and self.stages >= 3, self
        assert self.threads % (self.bk // 8) == 0 and self.threads // (self.bk // 8) <= min(self.bm, self.bn), self
        assert all(self.threads % (mn // 8) == 0 and self.threads // (mn // 8) <= self.bk
                   for mn in (self.bm, self.bn)), self


@dataclass(frozen=True)
class AdalnGemmConfig:
    """One AdaLN projection GEMM config. `name` is short and unique; the other fields are the whole config."""

    name: str
    bm: int
    bn: int
    bk: int
    warps_m: int  # warpgroup MMAs: 4 per warpgroup (warps_n = 1)
    warps_n: int
    stages: int
    mainloop: str  # MAINLOOPS
    roles: tuple  # ROLES it is built for, e.g. ("fwd", "dgrad")
    store: str = "smem"  # STORES
    schedule: str = "grid"  # SCHEDULES
    side_warps: str = "none"  # SIDE_WARPS (fold: only in the `wgrad_fold` role's kernel, `for_role`)
    cluster_m: int = 1
    cluster_n: int = 1
    tail_halves: bool = False  # d_temb only: a thin last round of CTAs runs as 128-wide halves
    ctas_per_sm: int = 0  # > 0: a register cap for that many resident CTAs

    def __post_init__(self):
        for field, allowed in (("mainloop", MAINLOOPS), ("store", STORES), ("schedule", SCHEDULES),
                               ("side_warps", SIDE_WARPS)):
            if getattr(self, field) not in allowed:
                raise ValueError(f"AdalnGemmConfig {self.name!r}: {field} = {getattr(self, field)!r}, not one of "
                                 f"{allowed}")
        if not self.roles or set(self.roles) - set(ROLES):
            raise ValueError(f"AdalnGemmConfig {self.name!r}: roles = {self.roles!r}, a non-empty subset of {ROLES}")

    @property
    def family(self) -> str:
        """"warp" (mma.sync, every arch) or "wgmma" (sm_90a): each family has its own numeric contract."""
        return "warp" if self.mainloop == "mma_sync" else "wgmma"

    @property
    def tile(self) -> GemmTile:
        """The compile-time tile the kernel classes read."""
        return GemmTile(bm=self.bm, bn=self.bn, bk=self.bk, warps_m=self.warps_m, warps_n=self.warps_n,
                        stages=self.stages, ctas_per_sm=self.ctas_per_sm,
                        persistent_ctas=PERSISTENT_CTAS if self.schedule != "grid" else 0,
                        cluster_m=self.cluster_m, cluster_n=self.cluster_n, pingpong=self.schedule == "pingpong",
                        tail_halves=self.tail_halves)

    def for_role(self, role: str) -> AdalnGemmConfig:
        """The config as the `role` GEMM's kernel builds it: `wgrad_fold` runs the dW tile with fold side warps."""
        if role not in self.roles:
            raise ValueError(f"AdalnGemmConfig {self.name!r} is not built for {role!r} (roles {self.roles})")
        return dataclasses.replace(self, side_warps="fold") if role == "wgrad_fold" else self


def _configs(*configs: AdalnGemmConfig) -> dict:
    named = {c.name: c for c in configs}
    assert len(named) == len(configs), "config names must be unique"
    return named


_FD = ("fwd", "dgrad")
_W = ("wgrad",)
_WARP = dict(mainloop="mma_sync")
_CPW = dict(mainloop="cp_async_wgmma")
_TMA = dict(mainloop="tma_wgmma")
_PERSIST = dict(mainloop="tma_wgmma", store="tma", schedule="persistent")

# Every config by name; launch/adaln_projection.py picks from them by T. Comments: why a config exists.
ADALN_GEMM_CONFIGS = _configs(
    # ---- the warp family (mma.sync, cp.async ring): sm_90a and sm_100a
    # T <= 16: memory-bound, streams W; small M tiles keep all SMs busy to the end.
    AdalnGemmConfig("skinny", 64, 16, 64, 4, 1, 5, roles=_FD, **_WARP),
    AdalnGemmConfig("skinny_m32", 32, 16, 64, 2, 1, 6, roles=_FD, **_WARP),
    AdalnGemmConfig("skinny_m128", 128, 16, 64, 4, 1, 4, roles=_FD, **_WARP),
    AdalnGemmConfig("mid", 128, 64, 64, 2, 2, 4, roles=_FD, **_WARP),
    AdalnGemmConfig("wide", 128, 128, 64, 2, 2, 3, roles=_FD, **_WARP),
    # Large-T alternatives (CUTLASS's usual Ampere shapes) to measure against "wide".
    AdalnGemmConfig("wide_k32", 128, 128, 32, 2, 2, 4, roles=_FD, **_WARP),
    AdalnGemmConfig("wide_8warps", 128, 256, 32, 2, 4, 3, roles=_FD, **_WARP),
    # dW (K = T, usually tiny: a short bk wastes little on the zero-padded K tail). T > 64: the big tile.
    AdalnGemmConfig("wgrad", 128, 128, 32, 2, 2, 4, roles=_W, **_WARP),
    # T <= 64: writing dW (520 MB) is the whole cost, so resident CTAs (dW bytes in flight) matter: 36 KB of smem
    # (the C tile reuses A's stages) would allow 6 per SM, registers allow 3 (ptxas: 140); the cap at 4 per SM costs
    # ptxas 12 bytes of spill (sm_90a). 5 would spill 260 bytes.
    AdalnGemmConfig("wgrad_n64", 128, 64, 32, 2, 2, 3, roles=_W, ctas_per_sm=4, **_WARP),
    # ---- the wgmma family (sm_90a), cp.async ring: warps_m = 4 x warpgroups
    AdalnGemmConfig("wg_skinny", 64, 16, 64, 4, 1, 5, roles=_FD, **_CPW),
    AdalnGemmConfig("wg_mid", 128, 64, 64, 4, 1, 4, roles=_FD, **_CPW),
    # 3 stages (96 KB) let 2 CTAs share an SM, hiding each other's per-k-tile barrier; 4 to compare.
    AdalnGemmConfig("wg_wide", 128, 128, 64, 8, 1, 3, roles=_FD, **_CPW),
    AdalnGemmConfig("wg_wide_s4", 128, 128, 64, 8, 1, 4, roles=_FD, **_CPW),
    # dW: wg_wgrad_n64 needs 64 registers (4 CTAs per SM; a cap at 5 does not assemble).
    AdalnGemmConfig("wg_wgrad", 128, 128, 32, 8, 1, 4, roles=_W, **_CPW),
    AdalnGemmConfig("wg_wgrad_n64", 128, 64, 32, 8, 1, 3, roles=_W, **_CPW),
    # One warpgroup over both 64-row slabs: 96 registers x 128 threads, 5 CTAs per SM without spills (a cap at 6
    # spills 1 KB), 25% more dW bytes in flight than wg_wgrad_n64 if its epilogue keeps up.
    AdalnGemmConfig("wg_wgrad_n64_1wg", 128, 64, 32, 4, 1, 3, roles=_W, ctas_per_sm=5, **_CPW),
    # The same tiles with C stored by TMA (`CpAsyncWgmmaTmaStoreGemm`): stmatrix + one bulk store in place of scalar
    # st.shared + ld.shared.v4 + st.global.v4, the shared-memory instruction queue (MIO) that throttles the 1wg
    # kernel at T = 64. ptxas: 96 / 64 / 94 registers, no spills; the 1wg tile capped at 6 CTAs per SM spills 1 KB
    # and serializes its wgmmas (C7512).
    AdalnGemmConfig("wg_wgrad_n64_1wg_tstore", 128, 64, 32, 4, 1, 3, roles=_W, ctas_per_sm=5, store="tma", **_CPW),
    AdalnGemmConfig("wg_wgrad_n64_tstore", 128, 64, 32, 8, 1, 3, roles=_W, store="tma", **_CPW),
    AdalnGemmConfig("wg_wgrad_tstore", 128, 128, 32, 8, 1, 4, roles=_W, store="tma", **_CPW),
    # ---- the wgmma family, TMA + mbarrier warp-specialized mainloop (`TmaWgmmaGemm`): same k16 walk, so the same
    # bits as the cp.async ring. Two consumer warpgroups of 64 rows (warps_m = 8) and enough stages to fill shared
    # memory: one CTA per SM, which the register split assumes. d_temb keeps acc and two block tiles up to bn = 128,
    # one block tile up to 192, and at 256 two accumulators of 128-wide halves (`TmaWgmmaGemm._ieee_serial_mainloop`);
    # clusters along M do not tile d_temb's M = 2688 (21 tiles of 128).
    AdalnGemmConfig("tma_mid", 128, 64, 64, 8, 1, 6, roles=_FD, **_TMA),  # 144 KB
    AdalnGemmConfig("tma_wide", 128, 128, 64, 8, 1, 5, roles=_FD, **_TMA),  # 160 KB
    AdalnGemmConfig("tma_wide_n256", 128, 256, 64, 8, 1, 4, roles=_FD, **_TMA),  # 192 KB
    # tma_wide_n256 in clusters of 2 W tiles of one T tile: each CTA loads half of the a tile (B) into both (TMA
    # multicast), halving B's L2 reads. Forward only.
    AdalnGemmConfig("tma_wide_n256_mc2", 128, 256, 64, 8, 1, 4, roles=("fwd",), cluster_m=2, **_TMA),  # 192 KB
    # tma_wide in clusters of 2 T tiles of one A tile (d_temb: a W^T tile of one K split; forward: a W tile), each
    # CTA loading half of it into both: a stage's L2 reads drop from 32 to 24 KB per CTA.
    AdalnGemmConfig("tma_wide_a_mc2", 128, 128, 64, 8, 1, 5, roles=_FD, cluster_n=2, **_TMA),  # 160 KB
    AdalnGemmConfig("tma_wide_n256_a_mc2", 128, 256, 64, 8, 1, 4, roles=_FD, cluster_n=2, **_TMA),  # 192 KB
    # 192 T rows per tile: 20% fewer operand bytes per MMA than 128 x 128; d_temb runs it with one block tile.
    AdalnGemmConfig("tma_wide_n192", 128, 192, 64, 8, 1, 5, roles=_FD, **_TMA),  # 200 KB
    # Forward only, large T: the persistent 256-row kernel of the dW, 256 W rows x 128 T rows per tile, C (the table,
    # M-major) stored by TMA from one buffer while the next tile's stages land.
    AdalnGemmConfig("tma_persist_m256", 256, 128, 64, 8, 1, 3, roles=("fwd",), **_PERSIST),  # 144 + 64 KB
    # d_temb only: tma_wide_n256 whose grid's last round, where at most half full, runs as twice as many 128-wide
    # halves (`tail_units`); and the same in tma_wide_n256_a_mc2's clusters (two whole units of one W^T tile, or the
    # two halves of one unit).
    AdalnGemmConfig("tma_wide_n256_tail", 128, 256, 64, 8, 1, 4, roles=("dgrad",), tail_halves=True, **_TMA),
    AdalnGemmConfig("tma_wide_n256_a_mc2_tail", 128, 256, 64, 8, 1, 4, roles=("dgrad",), cluster_n=2,
                    tail_halves=True, **_TMA),  # 192 KB
    # dW on TMA.
    AdalnGemmConfig("tma_wgrad", 128, 128, 64, 8, 1, 5, roles=_W, **_TMA),  # 160 KB
    # bk 32: half the zero-padded K tail at mid T (T = 256: 8 k tiles).
    AdalnGemmConfig("tma_wgrad_k32", 128, 128, 32, 8, 1, 8, roles=_W, **_TMA),  # 128 KB
    # tma_wgrad in clusters of 2 dW row tiles sharing the a^T tile (B) by TMA multicast.
    AdalnGemmConfig("tma_wgrad_mc2", 128, 128, 64, 8, 1, 5, roles=_W, cluster_m=2, **_TMA),  # 160 KB
    # Persistent (T <= 256, where writing dW's 520 MB is the cost): + two C buffers for the TMA stores.
    AdalnGemmConfig("tma_wgrad_persist", 128, 128, 64, 8, 1, 4, roles=_W, **_PERSIST),  # 128 + 64 KB
    AdalnGemmConfig("tma_wgrad_persist_n64", 128, 64, 64, 8, 1, 6, roles=_W, **_PERSIST),  # 144 + 32 KB
    # Each consumer warpgroup computes whole 128 x 128 tiles in turn (128 accumulator registers per thread), one C
    # buffer each: a warpgroup's epilogue runs while the other's wgmmas do.
    AdalnGemmConfig("tma_wgrad_persist_pingpong", 128, 128, 64, 8, 1, 4, roles=_W, **{**_PERSIST,
                                                                                     "schedule": "pingpong"}),
    # Large T, where the MMAs are the cost: 256 dW rows per tile (each warpgroup two 64-row slabs, 128 accumulator
    # registers per thread), 25% fewer operand bytes per MMA than 128 x 128 and half the epilogues per flop; one C
    # buffer (a tile's MMAs take far longer than its store's read of the buffer). Also built with fold side warps
    # (`adaln_proj_wgrad_fold`); a pingpong tile with fold warps is not built (it was never measurably ahead).
    AdalnGemmConfig("tma_wgrad_persist_m256", 256, 128, 64, 8, 1, 3, roles=("wgrad", "wgrad_fold"),
                    **_PERSIST),  # 144 + 64 KB
    # The persistent dW tiles whose producer warps also sum db at every T (side warps `DbiasWarps`).
    AdalnGemmConfig("tma_wgrad_persist_db", 128, 128, 64, 8, 1, 4, roles=_W, side_warps="dbias", **_PERSIST),
    AdalnGemmConfig("tma_wgrad_persist_pingpong_db", 128, 128, 64, 8, 1, 4, roles=_W, side_warps="dbias",
                    **{**_PERSIST, "schedule": "pingpong"}),
)


def candidates(role: str, family: str) -> tuple:
    """The names of a family's configs built for `role`, in `ADALN_GEMM_CONFIGS` order: everything `h3cute-bench
    sweep` may rank (the bundle builds only the `picks`; the others compile on demand)."""
    return tuple(n for n, c in ADALN_GEMM_CONFIGS.items() if role in c.roles and c.family == family)


# ---- the row-count picks: launch/adaln_projection.py runs them, the bundle builds every config they can return

# d_temb = grad @ W reduces over N_out; it is split into this many fixed, equal K chunks so that the whole GPU streams
# W even at T = 1. Never depends on T (batch invariance of d_temb). The kernels and the launcher read it here.
DGRAD_SPLITS = 12
# db = sum_t grad[t] in one order for every T and every dW config: T's rows in DBIAS_ROW_BLOCK-row blocks aligned
# to its end (block 0 holds the first T % 64 rows, or 64); in a block, four chains of DBIAS_CHAIN_ROWS rows (chain c:
# the block's rows 16c .. 16c + 15, cut at row 0), each summed in ascending rows from +0 in FP32, added
# ((c0 + c1) + c2) + c3; the block sums added in block order from +0. The blocks are the bk = 64 dW tiles' k tiles
# (shifted back by the K tail, `_k_tiles`), so the persistent dW kernel sums each stage as it lands (`_sum_dbias`);
# four short chains keep its adds from waiting on each other.
DBIAS_ROW_BLOCK = 64
DBIAS_CHAIN_ROWS = 16
# Up to this T the dW kernels write db (one block: `_store_dbias`), those with db warps (side_warps "dbias") at every T;
# otherwise the launch runs adaln_bias_grad (the same order, so the same bits).
FUSED_DBIAS_ROWS = 64
assert FUSED_DBIAS_ROWS <= DBIAS_ROW_BLOCK  # _store_dbias sums one block
H200_SMS = SM_COUNT["sm_90a"]  # the pickers' SM count where no device is given (the shipped tables' GPU)


@dataclass(frozen=True)
class RoundsPick:
    """A pick that models the GPU: a grid of one-CTA-per-SM units runs in rounds of the device's SMs. `narrow` where
    its rows times rounds (`dgrad_round_columns`) are under `margin` x `wide`'s, up to T = `max_rows`; else `wide`."""

    wide: str
    narrow: str
    margin: float
    max_rows: int

    def __call__(self, rows: int, sms: int) -> str:
        return self.narrow if any(lo <= rows <= hi for lo, hi in self.ranges(sms)) else self.wide

    def ranges(self, sms: int) -> tuple:
        """The T ranges (lo, hi) where `narrow` is picked on a GPU of `sms` SMs (from T = 1)."""
        return _narrow_ranges(self, sms)

    @property
    def choices(self) -> tuple:
        """The names it can return: which one at a T depends on the SM count."""
        return self.wide, self.narrow

    def columns(self, name: str, rows: int, sms: int) -> float:
        config = ADALN_GEMM_CONFIGS[name]
        return dgrad_round_columns(rows, config.bn, config.tail_halves, sms)


@functools.cache
def _narrow_ranges(pick: RoundsPick, sms: int) -> tuple:
    wins = [t for t in range(1, pick.max_rows + 1)
            if pick.columns(pick.narrow, t, sms) < pick.margin * pick.columns(pick.wide, t, sms)]
    ranges = []
    for t in wins:
        if ranges and ranges[-1][1] == t - 1:
            ranges[-1][1] = t
        else:
            ranges.append([t, t])
    return tuple(tuple(r) for r in ranges)


def dgrad_round_columns(rows: int, tile_rows: int, tail_halves: bool, sms: int = H200_SMS) -> float:
    """A d_temb tile's cost model: the rounds of `sms` SMs its units take (ceil(T / tile_rows) T tiles x 21 W^T tiles x
    DGRAD_SPLITS, one unit per SM; with `tail_halves` a last round at most half full counts half) times the T rows per
    unit. tma_wide_n256_tail and tma_wide_n192 run the one-block-tile mainloop at the same cost per unit column on
    the H200. (The tail kernel splits a round by its compiled PERSISTENT_CTAS; on the H200 that is the SM count.)"""
    units = -(-rows // tile_rows) * (TEMB // 128) * DGRAD_SPLITS
    rest = units % sms
    rounds = units // sms + (0.5 if tail_halves and 2 * rest <= sms else 1) * (rest > 0)
    return rounds * tile_rows


# Beyond T = 384 (to DGRAD_MODEL_ROWS) d_temb takes tma_wide_n192 where `dgrad_round_columns` puts it more than 5%
# under tma_wide_n256_tail, whose 256-row T tiles otherwise fill the rounds best.
DGRAD_MODEL_ROWS = 8192
DGRAD_ROUNDS = RoundsPick(wide="tma_wide_n256_tail", narrow="tma_wide_n192", margin=0.95, max_rows=DGRAD_MODEL_ROWS)

# The pick tables: per GEMM role and family, ((up to T, pick), ...) in ascending T, the last bound None (every larger
# T). A pick is a config name of ADALN_GEMM_CONFIGS or a `RoundsPick`. Speed only: within a family every config
# gives the same bits. The wgmma family's entries, from the H200's per-launch timings (perf/adaln_kernels.py,
# sustained at the power limit where they disagree with bursts: perf/clock_probe.py):
PICKS = {
    "fwd": {
        "wgmma": (
            (16, "wg_skinny"),  # W streams: small tiles keep every SM busy
            (64, "wg_mid"),  # the cp.async ring still beats TMA's deeper ring here
            (128, "tma_wide"),
            (192, "tma_wide_n192"),  # one 192-row tile: fewer operand bytes per MMA
            (256, "tma_wide_n256_mc2"),  # 2-CTA clusters share the activation tile (TMA multicast)
            (512, "tma_wide"),  # 128-row T tiles: less padding of T than 256-row ones, and faster to 512
            (None, "tma_persist_m256"),  # persistent: its stores overlap the next tile's loads and MMAs
        ),
        "warp": ((16, "skinny"), (64, "mid"), (None, "wide")),
    },
    "dgrad": {
        "wgmma": (
            (16, "wg_skinny"),
            (64, "tma_mid"),
            (128, "tma_wide"),
            (192, "tma_wide_n192"),  # the widest tile T fills, run on one block tile with the warpgroups in turn
            (256, "tma_wide_n256_tail"),
            (384, "tma_wide"),  # 128-row tiles pad T less
            (None, DGRAD_ROUNDS),
        ),
        "warp": ((16, "skinny"), (64, "mid"), (256, "wide"), (None, "wide_8warps")),
    },
    "wgrad": {
        "wgmma": (
            (64, "wg_wgrad_n64_1wg_tstore"),  # writing dW is the cost: more CTAs' stores in flight, C stored by TMA
            (384, "tma_wgrad_persist_pingpong_db"),  # a warpgroup's epilogue runs under the other's wgmmas; db warps
            (None, "tma_wgrad_persist_m256"),  # MMA-bound: 256-row tiles; with fold warps (`wgrad_folds`)
        ),
        "warp": ((64, "wgrad_n64"), (None, "wgrad")),
    },
}


def pick(role: str, rows: int, wgmma: bool = False, sms: int = H200_SMS) -> str:
    """The config name the `role` GEMM runs at T rows on a GPU of `sms` SMs (`PICKS`)."""
    for bound, choice in PICKS[role]["wgmma" if wgmma else "warp"]:
        if bound is None or rows <= bound:
            return choice if isinstance(choice, str) else choice(rows, sms)
    raise AssertionError(f"PICKS[{role!r}] has no last entry for every T")


def picks(role: str, family: str) -> tuple:
    """The names of every config the `role` GEMM's pick table of a family can return, at any T and SM count, in
    table order (the bundle's variants; `candidates` holds the rest). `wgrad_fold`: the dW picks built for it."""
    table = PICKS["wgrad" if role == "wgrad_fold" else role][family]
    names = (n for _, choice in table for n in ((choice,) if isinstance(choice, str) else choice.choices))
    return tuple(n for n in dict.fromkeys(names) if role in ADALN_GEMM_CONFIGS[n].roles)


def parse_config(text: str, registry: dict = ADALN_GEMM_CONFIGS) -> AdalnGemmConfig:
    """A config named `name` or written as `name:field=value,...`, field overrides of a named config (the new
    config's name is the text itself). Values parse as the field's type (int, bool, str; roles as `fwd+dgrad`)."""
    base, _, overrides = text.partition(":")
    if base not in registry:
        raise ValueError(f"config {base!r} is not a named config; one of {sorted(registry)}")
    config = registry[base]
    if not overrides:
        return config
    fields = {f.name: f for f in dataclasses.fields(AdalnGemmConfig)}
    changes = {"name": text}
    for item in overrides.split(","):
        key, eq, value = item.partition("=")
        if not eq or key not in fields or key == "name":
            raise ValueError(f"config {text!r}: {item!r} is not field=value with a field of "
                             f"{sorted(set(fields) - {'name'})}")
        current = getattr(config, key)
        if isinstance(current, bool):
            if value not in ("0", "1", "true", "false", "True", "False"):
                raise ValueError(f"config {text!r}: {key} takes true or false, not {value!r}")
            changes[key] = value in ("1", "true", "True")
        elif isinstance(current, int):
            try:
                changes[key] = int(value)
            except ValueError:
                raise ValueError(f"config {text!r}: {key} takes an integer, not {value!r}") from None
        elif isinstance(current, tuple):
            changes[key] = tuple(value.split("+"))
        else:
            changes[key] = value
    return dataclasses.replace(config, **changes)
