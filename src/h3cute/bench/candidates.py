"""Candidate implementations of an H3 op and the modes they run under.

A candidate is a callable taking the op's tensor arguments in schema order. The harness compares:

- `h3cute`: `torch.ops.h3.<op>` (checks that sync the host off, as a hot loop would call it; in-kernel checks stay on);
- `diffusers`: the op-for-op replay `h3cute.reference.<op>_replay` (GEMM ops: `diffusers[<mode>]`);
- `diffusers_module`: the real diffusers module where `import diffusers` works and an adapter exists;
- `torch_bare_op` (timestep_sinusoid only): `t + 1`, the one-launch floor of any op call;
- `h3cute_two_ops` (gate_residual_norm_modulate only): `h3::gate_residual` then `h3::norm_modulate`, the pair
  the fused op replaces;
- the peers a user would pick instead (`h3cute.bench.peers`): `torch.compile` of the replay, vllm-omni's
  MiniMax-H3 Triton kernels, liger's and quack's RMSNorm; a peer that cannot run here is recorded with why.

Modes are process-global settings, so each runs in its own subprocess whose environment is set before CUDA
starts (`MODES` holds those variables); `apply_mode` sets the rest in the child. `plain` and `vllm` are cuBLAS
modes (vLLM's batch-invariant mode: cuBLASLt without split-K); the Triton modes (`TRITON_MODES`, for
problems with `triton_modes`) turn on SGLang's or Megatron's batch-invariant aten overrides, and only the replay
runs under them. TF32 is off in torch everywhere; the Triton modes' FP32 `tl.dot` is TF32 unless
`TRITON_F32_DEFAULT=ieee` (the `_ieee` modes), as those libraries ship it.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

from h3cute import invariant
from h3cute.bench.problems import Problem
from h3cute.widths import FREQ, HIDDEN, MLP_HIDDEN, NORM_EPS, TEMB


@dataclass
class Candidate:
    name: str
    source: str
    fn: Callable | None = None
    has_backward: bool = True
    unavailable: str | None = None
    comparable: bool = True   # its output is the op's output (false for the bare-launch floor)
    notes: str | None = None  # what the report should say about it (numerics, scope)
    details: Callable[[], dict] | None = None   # more report fields, read after each phase (compile logs)


CUBLAS_MODES: dict[str, dict[str, str]] = {
    "plain": {},
    # vLLM's batch-invariant mode: cuBLASLt without split-K (no workspace to split into).
    "vllm": dict(invariant.ENVIRONMENT),
}

# SGLang's and Megatron's batch-invariant modes (h3cute.bench.peers turns them on); TRITON_F32_DEFAULT=ieee
# makes their FP32 tl.dot exact FP32 instead of Triton's TF32 default.
TRITON_MODES: dict[str, dict[str, str]] = {
    "sglang": {},
    "sglang_ieee": {"TRITON_F32_DEFAULT": "ieee"},
    "megatron_triton": {},
    "megatron_triton_ieee": {"TRITON_F32_DEFAULT": "ieee"},
}
MODES: dict[str, dict[str, str]] = {**CUBLAS_MODES, **TRITON_MODES}
MODE_OWNED_ENV = ("TRITON_F32_DEFAULT",)   # cleared in every mode's process unless the mode sets it


def modes_for(problem: Problem) -> list[str]:
    if not problem.gemm:
        return ["plain"]
    return list(CUBLAS_MODES) + (list(TRITON_MODES) if problem.triton_modes else [])


def mode_unavailable(mode: str) -> str | None:
    """Why `mode` is not run on this machine, decided before starting its process (None: run it)."""
    if mode == "plain":
        return None
    if mode in CUBLAS_MODES:
        return None if torch.cuda.is_available() else "a cuBLAS mode: without a CUDA device it changes nothing"
    from h3cute.bench.peers import triton_mode_unavailable
    return triton_mode_unavailable(mode)


def apply_mode(mode: str) -> str | None:
    """Switch this process into `mode` (its environment variables were set before it started); returns why the
    mode cannot run here, or None."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    if mode == "vllm":  # its torch switches, for the whole process
        invariant.hold_blas_settings()
    if mode in CUBLAS_MODES:
        return None
    from h3cute.bench import peers
    try:
        peers.enable_triton_mode(mode)
    except peers.PeerUnavailable as e:
        return str(e)
    return None


@contextlib.contextmanager
def modes_off():
    """The global modes off for the FP64 reference (default BLAS, no Triton overrides), then restored."""
    from h3cute.bench.peers import triton_mode_suspended
    saved = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
    if saved is not None:
        torch.backends.cuda.preferred_blas_library("cublas")
    try:
        with triton_mode_suspended():
            yield
    finally:
        if saved is not None:
            torch.backends.cuda.preferred_blas_library(saved)


def _h3cute(problem: Problem) -> Candidate:
    kw = problem.h3_kwargs
    flags = ", ".join(f"{k}={v}" for k, v in kw.items())
    source = f"torch.ops.h3.{problem.op}" + (f" ({flags})" if flags else "")
    if problem.narrowed:
        return Candidate("h3cute", source, unavailable=f"the op takes the checkpoint's widths only; this problem is "
                         f"{problem.narrowed}")
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
        return h, torch.ops.h3.norm_modulate(h, weight, shift, scale, adaln_indices, NORM_EPS, False)
    return Candidate("h3cute_two_ops", source, call)


def _replay(problem: Problem, name: str, mode: str) -> Candidate:
    source = problem.diffusers_source + (f" [{mode}]" if problem.gemm else "")
    if mode not in CUBLAS_MODES:
        from h3cute.bench.peers import TRITON_MODE_SOURCES
        source = f"{problem.diffusers_source} under {TRITON_MODE_SOURCES[mode]} [{mode}]"
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
        module = Timesteps(FREQ, flip_sin_to_cos=True, downscale_freq_shift=0)
        return Candidate(name, f"diffusers {version} Timesteps({FREQ}, True, 0)", module, has_backward=False)
    if problem.op == "timestep_mlp":
        from diffusers.models.embeddings import TimestepEmbedding
        from torch.func import functional_call
        module = TimestepEmbedding(FREQ, MLP_HIDDEN, out_dim=TEMB).to("meta")

        def call(x, w1, b1, w2, b2):
            params = {"linear_1.weight": w1, "linear_1.bias": b1, "linear_2.weight": w2, "linear_2.bias": b2}
            return functional_call(module, params, (x,))
        return Candidate(name, f"diffusers {version} TimestepEmbedding({FREQ}, {MLP_HIDDEN}, out_dim={TEMB})", call)
    if problem.op == "final_adaln_out":
        from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3AdaLayerNormOut
        from torch.func import functional_call
        module = MiniMaxH3AdaLayerNormOut(HIDDEN, TEMB, eps=NORM_EPS).to("meta", torch.bfloat16)

        def call(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices):
            params = {"norm.weight": norm_weight, "linear.weight": proj_weight, "linear.bias": proj_bias}
            return functional_call(module, params, (x, temb, timestep_indices))
        return Candidate(name, f"diffusers {version} MiniMaxH3AdaLayerNormOut({HIDDEN}, {TEMB}, {NORM_EPS})", call)
    # The projection module returns the six (3T, H) chunks, not the op's (T, 18H) table: gluing them back
    # would time a copy the op does not make.
    return Candidate(name, f"diffusers {version}",
                     unavailable="no module adapter for this op (the diffusers replay mirrors it op for op)")


def candidates_for(problem: Problem, mode: str, plan=None, device=None) -> list[Candidate]:
    """Everything the harness compares for one op under one mode: h3cute and the peers in plain only, the
    replay alone in the Triton modes. `plan` and `device` decide the peers' set-up (defaults: the seeds'
    plan, this machine's device)."""
    from h3cute.bench import checks, peers
    plan = plan or checks.FULL
    device = torch.device(device) if device is not None else (
        torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"))
    suffix = f"[{mode}]" if problem.gemm else ""
    if mode not in CUBLAS_MODES:
        return [_replay(problem, "diffusers" + suffix, mode)]
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
        out.extend(peers.peer_candidates(problem, plan, device))
    return out
