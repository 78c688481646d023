"""Tile configs shared by the CuTe DSL kernels and their host launchers, without the DSL.

Modules of `h3cute.kernels` whose name starts with `_` hold no kernels (the spec index skips them) and
never import cutlass, so `h3cute.launch` may import them on machines that only load prebuilt kernels.
"""
from __future__ import annotations

from dataclasses import dataclass


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
