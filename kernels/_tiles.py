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
    # warps_k > 1: that many groups of warps_m x warps_n warps share each k tile, group g taking its k8 chunks
    # g, g + warps_k, ...; the chunk sums meet in shared memory and group 0 adds them in k order (the same adds
    # as one group: the bits do not change). For tiles whose warps would otherwise run long serial chunk chains.
    warps_k: int = 1

    def __post_init__(self):
        if self.tile_m % (16 * self.warps_m) or self.tile_n % (8 * self.warps_n):
            raise ValueError(f"{self}: tile_m must divide by 16*warps_m and tile_n by 8*warps_n")
        if self.tile_k not in (32, 64):
            raise ValueError(f"{self}: tile_k must be 32 or 64 (128-byte swizzle rows)")
        if self.stages < 3:
            raise ValueError(f"{self}: the cp.async ring needs at least 3 stages")
        if self.warps_k < 1 or (self.tile_k // 8) % self.warps_k:
            raise ValueError(f"{self}: warps_k must divide the {self.tile_k // 8} k8 chunks of a k tile")
        rows_per_pass = self.mma_threads // (self.tile_k // 4)
        if self.tile_m % rows_per_pass or self.tile_n % rows_per_pass:
            raise ValueError(f"{self}: each cp.async pass covers {rows_per_pass} rows; tiles must divide by it")

    @property
    def mma_threads(self) -> int:
        """One group of warps_m x warps_n warps: the MMA tiling, and the threads that issue the cp.async copies."""
        return 32 * self.warps_m * self.warps_n

    @property
    def threads(self) -> int:
        return self.mma_threads * self.warps_k

    def astuple(self) -> tuple:
        """The fields in order (no deep copy: this runs on the launch path)."""
        return (self.tile_m, self.tile_n, self.tile_k, self.stages, self.warps_m, self.warps_n, self.warps_k)
