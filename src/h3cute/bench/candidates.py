"""Candidate implementations of an H3 op and the cuBLAS modes they run under.

A candidate is a callable taking the op's tensor arguments in schema order. The harness compares:

- `h3cute`: `torch.ops.h3.<op>` (checks that sync the host off, as a hot loop would call it; in-kernel checks stay on);
- `diffusers`: the op-for-op replay `h3cute.reference.<op>_replay` (GEMM ops: `diffusers[<mode>]`);
- `diffusers_module`: the real diffusers module where `import diffusers` works and an adapter exists;
- `torch_bare_op` (timestep_sinusoid only): `t + 1`, the one-launch floor of any op call;
- `h3cute_two_ops` (gate_residual_norm_modulate only): `h3::gate_residual` then `h3::norm_modulate`, the pair
  the fused op replaces;
- peers (sglang, vllm, liger, transformer_engine, megatron): looked up without importing them; the
  harness has no H3 adapter for them yet, so an installed peer is recorded as unavailable with that
  reason and a missing one as not installed.

Modes are process-global cuBLAS settings, so each runs in its own subprocess whose environment is set
before CUDA starts (`MODES` holds those variables); `apply_mode` sets the matching torch switches in the
child. TF32 is off in every mode.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from h3cute.bench.problems import Problem

MODES: dict[str, dict[str, str]] = {
    "plain": {},
    # vLLM's batch-invariant mode: cuBLASLt without split-K (no workspace to split into).
    "vllm": {"CUBLAS_WORKSPACE_CONFIG": ":16:8", "CUBLASLT_WORKSPACE_SIZE": "1"},
}

# peer name -> (import name, distribution name)
PEERS = {
    "sglang": ("sglang", "sglang"),
    "vllm": ("vllm", "vllm"),
    "liger": ("liger_kernel", "liger-kernel"),
    "transformer_engine": ("transformer_engine", "transformer_engine"),
    "megatron": ("megatron.core", "megatron-core"),
}


@dataclass
class Candidate:
    name: str
    source: str
    fn: Callable | None = None
    has_backward: bool = True
    unavailable: str | None = None
    comparable: bool = True   # its output is the op's output (false for the bare-launch floor)


def modes_for(problem: Problem) -> list[str]:
    return list(MODES) if problem.gemm else ["plain"]


def apply_mode(mode: str) -> None:
    """Torch-side switches of a mode; its environment variables were set before the process started."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if mode == "vllm":
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
        if torch.cuda.is_available():
            torch.backends.cuda.preferred_blas_library("cublaslt")


class default_blas:
    """Switch the global BLAS preference back to the default for the FP64 reference, then restore it."""

    def __enter__(self):
        self.saved = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
        if self.saved is not None:
            torch.backends.cuda.preferred_blas_library("cublas")
        return self

    def __exit__(self, *exc):
        if self.saved is not None:
            torch.backends.cuda.preferred_blas_library(self.saved)


def _h3cute(problem: Problem) -> Candidate:
    kw = problem.h3_kwargs
    flags = ", ".join(f"{k}={v}" for k, v in kw.items())
    source = f"torch.ops.h3.{problem.op}" + (f" ({flags})" if flags else "")
    try:
        import h3cute  # noqa: F401  (registers torch.ops.h3)
        op = getattr(torch.ops.h3, problem.op)
    except Exception as e:  # the op layer is someone else's room; report, never crash the run
        return Candidate("h3cute", source, unavailable=f"{type(e).__name__}: {e}")
    return Candidate("h3cute", source, lambda *a: op(*a, **kw), has_backward=problem.has_backward)


def _h3cute_two_ops(problem: Problem) -> Candidate:
    source = "torch.ops.h3.gate_residual then torch.ops.h3.norm_modulate (check_indices=False)"

    def call(residual, y, gate, weight, shift, scale, adaln_indices):
        h = torch.ops.h3.gate_residual(residual, y, gate, adaln_indices, False)
        return h, torch.ops.h3.norm_modulate(h, weight, shift, scale, adaln_indices, 1e-5, False)
    return Candidate("h3cute_two_ops", source, call)


def _replay(problem: Problem, name: str, mode: str) -> Candidate:
    source = problem.diffusers_source + (f" [{mode}]" if problem.gemm else "")
    try:
        from h3cute import reference
        fn = getattr(reference, f"{problem.op}_replay")
    except Exception as e:
        return Candidate(name, source, unavailable=f"{type(e).__name__}: {e}")
    return Candidate(name, source, fn, has_backward=problem.has_backward)


def _diffusers_module(problem: Problem, name: str) -> Candidate:
    if importlib.util.find_spec("diffusers") is None:
        return Candidate(name, "diffusers modules", unavailable="diffusers is not installed")
    try:
        return _diffusers_adapter(problem, name, importlib.metadata.version("diffusers"))
    except Exception as e:  # an installed but broken diffusers is a finding, not a crash
        return Candidate(name, "diffusers modules", unavailable=f"{type(e).__name__}: {e}")


def _diffusers_adapter(problem: Problem, name: str, version: str) -> Candidate:
    if problem.op == "timestep_sinusoid":
        from diffusers.models.embeddings import Timesteps
        module = Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)
        return Candidate(name, f"diffusers {version} Timesteps(256, True, 0)", module, has_backward=False)
    if problem.op == "timestep_mlp":
        from diffusers.models.embeddings import TimestepEmbedding
        from torch.func import functional_call
        module = TimestepEmbedding(256, 5376, out_dim=2688).to("meta")

        def call(x, w1, b1, w2, b2):
            params = {"linear_1.weight": w1, "linear_1.bias": b1, "linear_2.weight": w2, "linear_2.bias": b2}
            return functional_call(module, params, (x,))
        return Candidate(name, f"diffusers {version} TimestepEmbedding(256, 5376, out_dim=2688)", call)
    if problem.op == "final_adaln_out":
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormOut
        from torch.func import functional_call
        module = MiniMaxH3AdaLayerNormOut(5376, 2688, eps=1e-5).to("meta", torch.bfloat16)

        def call(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices):
            params = {"norm.weight": norm_weight, "linear.weight": proj_weight, "linear.bias": proj_bias}
            return functional_call(module, params, (x, temb, timestep_indices))
        return Candidate(name, f"diffusers {version} MiniMaxH3AdaLayerNormOut(5376, 2688, 1e-5)", call)
    # The projection module returns the six (3T, H) chunks, not the op's (T, 18H) table: gluing them back
    # would time a copy the op does not make.
    return Candidate(name, f"diffusers {version}",
                     unavailable="no module adapter for this op (the diffusers replay mirrors it op for op)")


def _peer(peer: str) -> Candidate:
    module, dist = PEERS[peer]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:   # a parent package is missing
        found = False
    if not found:
        return Candidate(peer, peer, unavailable=f"{dist} is not installed")
    version = importlib.metadata.version(dist) if _has_dist(dist) else "unknown version"
    return Candidate(peer, f"{peer} {version}",
                     unavailable=f"{dist} {version} is installed but h3cute.bench has no adapter for this op")


def _has_dist(dist: str) -> bool:
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def candidates_for(problem: Problem, mode: str) -> list[Candidate]:
    """Everything the harness compares for one op under one mode (h3cute and peers in plain only)."""
    suffix = f"[{mode}]" if problem.gemm else ""
    out = []
    if mode == "plain":
        out.append(_h3cute(problem))
    out.append(_replay(problem, "diffusers" + suffix, mode))
    out.append(_diffusers_module(problem, "diffusers_module" + suffix))
    if mode == "plain":
        if problem.op == "timestep_sinusoid":
            out.append(Candidate("torch_bare_op", "t + 1 (one elementwise launch: the floor of any op call)",
                                 lambda t: t + 1, has_backward=False, comparable=False))
        if problem.op == "gate_residual_norm_modulate":
            out.append(_h3cute_two_ops(problem))
        out.extend(_peer(p) for p in PEERS)
    return out
