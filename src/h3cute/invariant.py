"""The kernels `h3cute.patch(transformer, scope="model")` relies on beyond h3cute's own, and what they need.

Under the model scope every computation is an h3 op (`h3cute.ops.model`), and these are the kernels inside the
ops that are not h3cute's:

- `h3::dense` (the BF16 linears: attention projections, the SwiGLU feed-forward, the token refiner,
  context_embedder): cuBLASLt without split-K, as vLLM's batch-invariant mode sets it. Two environment variables,
  read when CUDA's BLAS handles are made, so they are process-wide and must be set before the process's first CUDA
  GEMM (`set_environment()` does that, or refuses once CUDA is initialized), and three torch switches, also
  process-wide, which `blas_settings()` holds while a model-scope patch is active.
- `h3::attention`: FlashAttention-4 (`flash-attn-4`, CuTe DSL kernels). Its forward tiles a sample's rows the same
  way at every batch size (no split of the key dimension), and its deterministic backward accumulates dQ in a fixed
  order.
- `h3::rms_norm` (outside attention), `h3::rotary_table`: torch's own row-wise and elementwise kernels.
  `h3::qk_norm_rotary` and `h3::swiglu` run h3cute's CuTe DSL kernels (eager torch's bits, one pass each).

`perf/call_site_invariance.py` measured each per call site; tests/test_patch_model_gpu.py proves the whole model.
`AttnProcessor` is the attention processor the patch sets on every `MiniMaxH3Attention`.
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


class _Held:
    """A process-wide setting held while at least one model-scope patch is active: the first hold saves what was
    there, every hold applies the held value, the last release puts the saved one back."""

    def __init__(self, read, write, held):
        self._read, self._write, self._held = read, write, held
        self.count, self._saved = 0, None

    def hold(self) -> None:
        if self.count == 0:
            self._saved = self._read()
        self.count += 1
        self._write(self._held())

    def release(self) -> None:
        if self.count == 0:
            return
        self.count -= 1
        if self.count == 0:
            self._write(self._saved)
            self._saved = None


_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


def _current():
    m = torch.backends.cuda.matmul
    blas = torch.backends.cuda.preferred_blas_library() if torch.cuda.is_available() else None
    return {f: getattr(m, f) for f in _FLAGS}, blas


def _apply(settings) -> None:
    flags, blas = settings
    for f, v in flags.items():
        setattr(torch.backends.cuda.matmul, f, v)
    if blas is not None:
        torch.backends.cuda.preferred_blas_library(blas)


# the torch switches of vLLM's mode: no reduced-precision reductions, cuBLASLt preferred
_BLAS = _Held(_current, _apply, lambda: ({f: False for f in _FLAGS}, "cublaslt" if torch.cuda.is_available() else None))


def hold_blas_settings() -> None:
    """The torch switches of vLLM's mode (no reduced-precision reductions, cuBLASLt preferred), process-wide while
    at least one model-scope patch is active; `release_blas_settings` restores what was there before."""
    _BLAS.hold()


def release_blas_settings() -> None:
    _BLAS.release()


def _inductor_config():
    from torch._inductor import config
    return config


# Inductor's emulation of eager's roundings: between the model scope's ops a compiled graph keeps only views, copies,
# casts and adds, and the adds that matter are the backward's sums of a BF16 tensor's gradients where it fans out
# (the q/k/v projections' input: three of them). Eager rounds each partial sum to BF16; Inductor, fusing the sum into
# one kernel, would otherwise add in FP32 and round once. Held like the BLAS switches, while a model-scope patch is
# active; read when torch.compile compiles (the first call of a compiled model), and part of Inductor's cache key.
_COMPILE = _Held(lambda: _inductor_config().emulate_precision_casts,
                 lambda v: setattr(_inductor_config(), "emulate_precision_casts", v), lambda: True)


def hold_compile_settings() -> None:
    """`torch._inductor.config.emulate_precision_casts = True`, process-wide while at least one model-scope patch
    is active; `release_compile_settings` restores what was there before."""
    _COMPILE.hold()


def release_compile_settings() -> None:
    _COMPILE.release()


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


def rms_norm_eps(norm: torch.nn.RMSNorm) -> float:
    """An nn.RMSNorm's eps: its own, else what F.rms_norm uses for BF16 rows."""
    return norm.eps if norm.eps is not None else torch.finfo(torch.bfloat16).eps


class AttnProcessor:
    """MiniMaxH3AttnProcessor's computation on h3 ops: the q/k/v projections (the modules, on h3::dense), each head's
    q/k norm and rotary embedding (h3::qk_norm_rotary with the norm modules' weights; without rotary angles the norm
    modules, on h3::rms_norm), h3::attention, the output projection (h3::dense)."""

    def __call__(self, attn, hidden_states: torch.Tensor, rotary_emb=None, attention_mask=None) -> torch.Tensor:
        if attention_mask is not None:
            raise ValueError("h3cute.patch(scope='model'): MiniMax-H3 attends over one packed sequence without a "
                             "mask; this attention processor takes no attention_mask")
        if attn.fused_projections:
            query, key, value = attn.to_qkv(hidden_states).chunk(3, dim=-1)
        else:
            query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if query.dtype != torch.bfloat16:
            raise TypeError(f"h3cute.patch(scope='model'): attention rows are {query.dtype}; h3::attention takes "
                            "BF16 (run the model in BF16, the checkpoint's dtype)")
        query, key, value = (t.unflatten(-1, (attn.heads, -1)) for t in (query, key, value))
        if rotary_emb is not None:  # each head's norm and rotation in one pass
            query = torch.ops.h3.qk_norm_rotary(query, attn.norm_q.weight, *rotary_emb, rms_norm_eps(attn.norm_q))
            key = torch.ops.h3.qk_norm_rotary(key, attn.norm_k.weight, *rotary_emb, rms_norm_eps(attn.norm_k))
        else:
            query, key = attn.norm_q(query), attn.norm_k(key)
        out = torch.ops.h3.attention(query.contiguous(), key.contiguous(), value.contiguous())
        hidden_states = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](hidden_states))
