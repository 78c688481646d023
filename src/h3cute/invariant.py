"""The mechanisms `h3cute.patch(transformer, scope="model")` uses for the call sites that are not h3 ops.

Each was measured per call site on the H200 (perf/call_site_invariance.py: a row computed alone against inside
larger row counts, a sample alone against inside a batch, gradients computed twice) and is proven end to end by
tests/test_patch_model_gpu.py:

- BF16 linears (attention projections, the SwiGLU feed-forward, the token refiner, context_embedder): cuBLASLt
  without split-K, as vLLM's batch-invariant mode sets it. Two environment variables, read when CUDA's BLAS
  handles are made, so they are process-wide and must be set before the process's first CUDA GEMM
  (`set_environment()` does that, or refuses once CUDA is initialized), and three torch switches, also
  process-wide, which `blas_settings()` holds while a model-scope patch is active.
- Attention: FlashAttention-4 (`flash-attn-4`, CuTe DSL kernels) with `deterministic=True`, set as the attention
  processor of each patched `MiniMaxH3Attention` only. Its forward tiles a sample's rows the same way at every
  batch size (no split of the key dimension), and its deterministic backward accumulates dQ in a fixed order.
- RMSNorm (the attention's q/k norms, the refiner's norms), the rotary embedding and the model's elementwise and
  indexing ops: torch's own kernels are row-wise, nothing to change.

The FP32 heads (proj_in, audio_proj_in, proj_out, audio_proj_out) are invariant under none of cuBLAS's settings:
they run `torch.ops.h3.linear`.
"""
from __future__ import annotations

import contextlib
import os

import torch

# vLLM's batch-invariant cuBLASLt settings (no split-K workspace): variable -> value
ENVIRONMENT = {"CUBLASLT_WORKSPACE_SIZE": "1", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}
FA4_DISTRIBUTION = "flash-attn-4"


class MechanismUnavailable(RuntimeError):
    """A mechanism of the model scope cannot be used in this process; the message says why and what to do."""


def environment_problems() -> list[str]:
    """What the process environment lacks for the BF16 linears' mechanism (empty when it is set)."""
    return [f"{k}={os.environ.get(k)!r}, not {v!r}" for k, v in ENVIRONMENT.items() if os.environ.get(k) != v]


def set_environment() -> None:
    """Sets the BF16 linears' cuBLASLt settings in this process's environment. They are read when torch makes its
    CUDA BLAS handles, so this must run before CUDA is initialized (at the top of the program, or exported by the
    launcher); once CUDA is initialized it only accepts an environment that already holds them."""
    if not environment_problems():
        return
    if torch.cuda.is_initialized():
        raise MechanismUnavailable(
            "h3cute.invariant.set_environment: CUDA is already initialized, so cuBLAS would not read "
            + ", ".join(f"{k}={v}" for k, v in ENVIRONMENT.items())
            + "; call it before anything touches CUDA, or export them before the process starts")
    os.environ.update(ENVIRONMENT)


_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")
_HOLDS = [0, None]  # active model-scope patches, the settings saved when the first one began


def _current():
    m = torch.backends.cuda.matmul
    blas = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
    return {f: getattr(m, f) for f in _FLAGS}, blas


def _apply(flags: dict, blas) -> None:
    for f, v in flags.items():
        setattr(torch.backends.cuda.matmul, f, v)
    if blas is not None:
        torch.backends.cuda.preferred_blas_library(blas)


def hold_blas_settings() -> None:
    """The torch switches of vLLM's mode (no reduced-precision reductions, cuBLASLt preferred), process-wide while
    at least one model-scope patch is active; `release_blas_settings` restores what was there before."""
    if _HOLDS[0] == 0:
        _HOLDS[1] = _current()
    _HOLDS[0] += 1
    _apply({f: False for f in _FLAGS}, "cublaslt" if torch.cuda.is_available() else None)


def release_blas_settings() -> None:
    if _HOLDS[0] == 0:
        return
    _HOLDS[0] -= 1
    if _HOLDS[0] == 0:
        _apply(*_HOLDS[1])
        _HOLDS[1] = None


@contextlib.contextmanager
def blas_settings():
    """`hold_blas_settings()` for the duration of a block."""
    hold_blas_settings()
    try:
        yield
    finally:
        release_blas_settings()


# ---- attention -----------------------------------------------------------------------------------------

def fa4_problem() -> str | None:
    """Why FlashAttention-4 cannot serve here, or None."""
    try:
        from flash_attn.cute import flash_attn_func  # noqa: F401
    except ImportError as e:
        return (f"FlashAttention-4 is not importable ({e}); install {FA4_DISTRIBUTION} (pip install "
                f"'h3cute[model]'), whose kernels are CuTe DSL like h3cute's")
    return None


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Softmax attention of (B, S, heads, head_dim) BF16 / FP16 rows, no mask, 1/sqrt(head_dim) scale: FA4's
    forward and its deterministic backward."""
    from flash_attn.cute import flash_attn_func
    out = flash_attn_func(query, key, value, causal=False, deterministic=True)
    return out[0] if isinstance(out, tuple) else out  # (out, lse) in some releases


class AttnProcessor:
    """MiniMaxH3AttnProcessor's computation (q/k/v projections, q/k RMSNorm, rotary embedding, attention, output
    projection) with `attention` above in place of diffusers' dispatch."""

    def __init__(self, apply_rotary_emb):
        self._rotary = apply_rotary_emb

    def __call__(self, attn, hidden_states: torch.Tensor, rotary_emb=None, attention_mask=None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("h3cute.patch(scope='model'): MiniMax-H3 attends over one packed sequence without a "
                             "mask; this attention processor takes no attention_mask")
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        query = attn.norm_q(query.unflatten(-1, (attn.heads, -1)))
        key = attn.norm_k(key.unflatten(-1, (attn.heads, -1)))
        value = value.unflatten(-1, (attn.heads, -1))
        if rotary_emb is not None:
            query, key = self._rotary(query, *rotary_emb), self._rotary(key, *rotary_emb)
        if query.dtype not in (torch.bfloat16, torch.float16):
            raise TypeError(f"h3cute.patch(scope='model'): attention rows are {query.dtype}; FlashAttention-4 "
                            "takes BF16 or FP16 (run the model in BF16, the checkpoint's dtype)")
        out = attention(query.contiguous(), key.contiguous(), value.contiguous())
        hidden_states = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))
