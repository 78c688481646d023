"""h3cute: batch-invariant CuTe DSL kernels for MiniMax-H3's conditioning ops, bound as `torch.ops.h3.*`.

`import h3cute` registers the `h3` namespace (forward and backward ops); `h3cute.adaln_indices` builds
the per-row block-table index `ti * 3 + tag` with validation; `h3cute.check_errors()` waits for the GPU
and raises any bad input the kernels recorded (CUDA checks never sync the host: h3cute.launch.checks);
`h3cute.patch(transformer)` computes diffusers' MiniMaxH3Transformer3DModel's conditioning path with those ops
(`apply_to_minimax_h3()` for models built later).
"""
import h3cute.runtime  # noqa: F401  (first: maps h3cute.kernels to this package's kernels, runtime/sources.py)
from h3cute.launch.checks import check_errors
from h3cute.ops import adaln as _adaln, timestep as _timestep  # noqa: F401  (registers torch.ops.h3)
from h3cute.ops.adaln import adaln_indices
from h3cute.minimax_h3 import CallSite, Patch, PatchError, apply_to_minimax_h3, patch, undo_minimax_h3

__all__ = ["adaln_indices", "check_errors", "patch", "Patch", "PatchError", "CallSite", "apply_to_minimax_h3",
           "undo_minimax_h3"]
__version__ = "0.1.0"
