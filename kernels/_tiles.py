"""Tile configs shared by the CuTe DSL kernels and their host launchers, without the DSL.

Modules of `h3cute.kernels` whose name starts with `_` hold no kernels (the spec index skips them) and
never import cutlass, so `h3cute.launch` may import them on machines that only load prebuilt kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

from h3cute.runtime import MAX_ROWS


@dataclass(frozen=True)
class GemmConfig:
    """CTA tile and pipeline shape of the 3xTF32 GEMM (kernels/gemm_tf32x3.py). Never changes the bits of
    the result, only the speed. Kernels take it as the tuple `astuple()` (a static argument)."""

    tile_m: int
    tile_n: int
    tile_k: int = 32
    stages: int = 4
    warps_m: int = 1
    warps_n: int = 4

    def __post_init__(self):
        if self.tile_m % (16 * self.warps_m) or self.tile_n % (8 * self.warps_n):
            raise ValueError(f"{self}: tile_m must divide by 16*warps_m and tile_n by 8*warps_n")
        if self.tile_k not in (32, 64):
            raise ValueError(f"{self}: tile_k must be 32 or 64 (128-byte swizzle rows)")
        if self.stages < 3:
            raise ValueError(f"{self}: the cp.async ring needs at least 3 stages")
        threads = 32 * self.warps_m * self.warps_n
        rows_per_pass = threads // (self.tile_k // 4)
        if self.tile_m % rows_per_pass or self.tile_n % rows_per_pass:
            raise ValueError(f"{self}: each cp.async pass covers {rows_per_pass} rows; tiles must divide by it")

    @property
    def threads(self) -> int:
        return 32 * self.warps_m * self.warps_n

    def astuple(self) -> tuple:
        """The fields in order (no deep copy: this runs on the launch path)."""
        return (self.tile_m, self.tile_n, self.tile_k, self.stages, self.warps_m, self.warps_n)


# ---- the time MLP's configs (launch/timestep_mlp.py; kernels/timestep_mlp.py builds their tiles)

@dataclass(frozen=True)
class MlpConfig:
    """One tile per GEMM role (every choice gives the same bits)."""

    fc1: GemmConfig
    fc2: GemmConfig
    fc2_dgrad: GemmConfig
    fc1_dgrad: GemmConfig
    fc2_wgrad: GemmConfig
    fc1_wgrad: GemmConfig


_SMALL = GemmConfig(16, 64, 32, 6, 1, 4)  # deep ring: small T streams the weights
_WIDE = GemmConfig(32, 128, 64, 3, 2, 4)  # 64-deep k tiles: also checks tile_k leaves the bits alone
_MID = GemmConfig(64, 64, 32, 4, 2, 2)
_LARGE = GemmConfig(128, 128, 32, 3, 2, 4)
_SMALL_NARROW = GemmConfig(16, 32, 32, 6, 1, 4)  # fc1 (168 CTAs on 132 SMs), fc1_dgrad (N = 256)
# The T-deep dW2 GEMM at T <= 64 (one or two k-tiles) is bound by writing 57.8 MB: the 64 x 64
# tile (158 registers, 3 CTAs per SM) keeps more CTAs' loads and stores in flight than the
# 128 x 128 one (235 registers x 256 threads: one CTA per SM), which wins once K = T is deep.
_WGRAD_SHALLOW = dict(fc2_wgrad=_MID, fc1_wgrad=_MID)
_WGRAD_DEEP = dict(fc2_wgrad=_LARGE, fc1_wgrad=_MID)
SMALL_T = MlpConfig(fc1=_SMALL_NARROW, fc2=_SMALL, fc2_dgrad=_SMALL, fc1_dgrad=_SMALL_NARROW, **_WGRAD_SHALLOW)
# Sweep candidate for small T (not picked yet): 64-deep k tiles, i.e. 256-byte runs per weight row
# and tile (DRAM page locality) and 1.6x the weight bytes in flight per CTA (5 stages, 100 KB smem).
SMALL_T_K64 = MlpConfig(fc1=GemmConfig(16, 32, 64, 6, 1, 4), fc2=GemmConfig(16, 64, 64, 5, 1, 4),
                        fc2_dgrad=GemmConfig(16, 64, 64, 5, 1, 4), fc1_dgrad=GemmConfig(16, 32, 64, 6, 1, 4),
                        **_WGRAD_SHALLOW)
WIDE_T = MlpConfig(fc1=_WIDE, fc2=_WIDE, fc2_dgrad=_WIDE, fc1_dgrad=_WIDE, **_WGRAD_SHALLOW)
MID_T = MlpConfig(fc1=_MID, fc2=_MID, fc2_dgrad=_MID, fc1_dgrad=_MID, **_WGRAD_DEEP)
LARGE_T = MlpConfig(fc1=_LARGE, fc2=_LARGE, fc2_dgrad=_LARGE, fc1_dgrad=_LARGE, **_WGRAD_DEEP)
# Sweep candidate for large T (not picked yet): the 128 x 128 tile runs one CTA per SM (235
# registers x 256 threads), so shared memory is free for a 5-deep ring (160 KB) instead of 3.
_LARGE_S5 = GemmConfig(128, 128, 32, 5, 2, 4)
LARGE_T_S5 = MlpConfig(fc1=_LARGE_S5, fc2=_LARGE_S5, fc2_dgrad=_LARGE_S5, fc1_dgrad=_LARGE_S5,
                       fc2_wgrad=_LARGE_S5, fc1_wgrad=_MID)
CONFIGS = (SMALL_T, WIDE_T, MID_T, LARGE_T, SMALL_T_K64, LARGE_T_S5)  # pick_config's choices + sweep candidates


# pick_config's T ranges: up to each bound, its config.
T_BOUNDS = ((16, SMALL_T), (64, WIDE_T), (256, MID_T), (MAX_ROWS, LARGE_T))
# The GEMM roles by the MlpConfig field whose tile they run: fc1_zh (the backward's recompute) and fc1_split (the
# forward's fc1 writing fc2's TF32 operand pair) take fc1's.
GEMM_ROLES = {"fc1": "fc1", "fc1_zh": "fc1", "fc1_split": "fc1", "fc2": "fc2", "fc2_dgrad": "fc2_dgrad",
              "fc1_dgrad": "fc1_dgrad", "fc2_wgrad": "fc2_wgrad", "fc1_wgrad": "fc1_wgrad"}


def role_tiles(configs) -> dict:
    """{GEMM role: the distinct tiles (`astuple`) `configs` give it, in config order}."""
    configs = tuple(configs)
    return {role: tuple(dict.fromkeys(getattr(c, field).astuple() for c in configs))
            for role, field in GEMM_ROLES.items()}
