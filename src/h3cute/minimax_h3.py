"""`h3cute.patch`: diffusers' MiniMax-H3 transformer with its conditioning path on `torch.ops.h3`.

`patch(transformer)` switches one `MiniMaxH3Transformer3DModel` (diffusers 0.42.1,
`models/transformers/transformer_minimax_h3.py`) and returns a `Patch` (`unpatch()`, `report()`);
`apply_to_minimax_h3()` switches the classes, so that a model built afterwards (`from_pretrained`) is patched
before its first forward computes anything; `undo_minimax_h3()` switches them back and unpatches those models.

The call sites (`Patch.report()` lists each one, replaced or left to diffusers):

| module | what diffusers computes there | h3 op |
| --- | --- | --- |
| `time_proj` | `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` | `timestep_sinusoid` |
| `time_embedder` | `TimestepEmbedding`: linear_1, SiLU, linear_2 (FP32) | `timestep_mlp` |
| `transformer_blocks.i.adaln_proj` | `linear(silu(temb).bf16)`, viewed (3T, 6H), six chunks | `adaln_projection` |
| `transformer_blocks.i` | `norm1(x) * (1 + scale_msa[idx]) + shift_msa[idx]` | `norm_modulate` |
| `transformer_blocks.i` | `h = x + gate_msa[idx] * attn`; `norm2(h)`, mlp modulation | `gate_residual_norm_modulate` |
| `transformer_blocks.i` | `h + gate_mlp[idx] * ff` | `gate_residual` |
| `norm_out` | `MiniMaxH3AdaLayerNormOut` | `final_adaln_out` |

The six chunks stay row-strided views of the projection's (3T, 6H) table and are indexed inside the ops (no
gather pass); the rope, the input projections, the token refiner, every block's attention and feed-forward and
the output heads are not conditioning ops and stay diffusers'.

`patch(transformer, scope="model")` puts the rest of the forward on h3 ops too (`h3cute.ops.model`), so that
nothing is left for torch.compile to regenerate: the FP32 heads (proj_in, audio_proj_in, proj_out,
audio_proj_out) switch to `torch.ops.h3.linear` the same way, the BF16 linears to `h3::dense`, the remaining
RMSNorms (the token refiner's) to `h3::rms_norm`, every SwiGLU to `h3::swiglu` after its projection,
the rope to `h3::rotary_table`; every `MiniMaxH3Attention`'s processor becomes `h3cute.invariant.AttnProcessor`
(`h3::qk_norm_rotary` with the q/k norms' weights, `h3::attention` on FlashAttention-4; `unpatch()` puts the
previous processor back). Each site is
reported with the kernels inside its op. A missing requirement (vLLM's cuBLASLt environment, FlashAttention-4)
is one refusal per reason, naming every site it concerns.

How a module is switched. Its class becomes a subclass of its own class, made once per class, with the same
`__name__` (diffusers' `_no_split_modules` / `_repeated_blocks` match names) and a `forward` of the same
signature (diffusers' context-parallel hooks read it to find `adaln_indices` / `timestep_indices`). Parameters,
buffers, submodules, their names and the state_dict are untouched, so checkpoints load and save as before,
gradient checkpointing wraps the block call as before, and torch hooks on the module still run. The patched
`forward` takes the h3 path only while its instance is *armed* and otherwise runs the base class's `forward`:
a wrapper that captured the bound `forward` after the patch (diffusers' context-parallel, cache or offload
hooks, accelerate) keeps calling it, and `unpatch()` disarms the instance, so such wrappers go back to diffusers
with the rest. `unpatch()` also puts back the original class where the class is still the patched one (FSDP2's
`fully_shard` may have subclassed it since: then the instance is only disarmed).

Where the rows are validated. The model's `forward` builds `adaln_indices = timestep_indices * 3 + token_tags`
inline and hands it to every block; under context parallelism each block's hook splits its own copy first. A
hook on the first block would see `adaln_indices` only, not `timestep_indices`, `token_tags` and T, and
replacing the model's `forward` would replace all of diffusers' forward. So a forward pre-hook on the model (a
torch hook: no module, parameter or signature changes) calls `h3cute.adaln_indices(timestep_indices,
token_tags, len(timestep))` once per forward, before any compute and before any split: every row's timestep
index is then below T and its tag in {0, 1, 2}, so the model's `adaln_indices` address the (3T, ...) block
tables and `timestep_indices` the (T, ...) final table, and the block and `norm_out` ops run with
`check_indices=False`.

Rows. Hidden states are (B, S, 5376) with B a replication axis: they flatten to (B*S, 5376) (a view;
`reshape` copies only a non-contiguous input such as a context-parallel shard of B > 1) and the per-row indices
repeat B times. Under CUDA autocast `nn.RMSNorm` runs in FP32, so the token refiner's final norm hands the
block stack FP32 rows (diffusers' residual stream then stays FP32); the patched block and `norm_out` cast such
rows to BF16, the checkpoint's residual dtype, which is what the ops serve. The ops themselves are not
autocast: each computes in its own dtypes under autocast and torch.compile alike.

Refused (a `PatchError` naming the module and the reason, before anything changes; `strict=False` leaves the
module to diffusers and `report()` says why): widths other than hidden 5376, time embedding 2688, sinusoid 256;
a `time_proj` other than `Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)`; a `TimestepEmbedding`
with `cond_proj`, `post_act` or an activation other than SiLU; dtypes other than the checkpoint's (time embedder
FP32, AdaLN projections and norm weights BF16); a replaced linear that is not a plain `nn.Linear` (LoRA / PEFT
adapters: the op would use the base weight and drop the adapter's delta); hooks on a submodule the patched
module no longer calls (they would not run); a module whose `forward` was wrapped before the patch (the wrapper
would bypass it: patch first, then enable context parallelism, caches or offloading).

Not fused across blocks: fusing block i's MLP gate with block i+1's norm1 would make block i compute with
block i+1's norm weight and table, and the boundary between two blocks is where gradient checkpointing,
context-parallel and cache hooks and FSDP units cut the model.
"""

import functools
import weakref
from dataclasses import dataclass
from types import SimpleNamespace

import torch
from torch import nn

from h3cute import invariant
from h3cute.invariant import rms_norm_eps
from h3cute.ops.adaln import adaln_indices
from h3cute.widths import (BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FP32_HEADS, FREQ, HIDDEN, MLP_HIDDEN,
                           TEMB)

BF16, F32 = torch.bfloat16, torch.float32
_ARMED = "_h3cute_armed"
_WIDTHS = f"h3cute serves hidden {HIDDEN}, time embedding {TEMB}, sinusoid {FREQ}"
_NOT_CONDITIONING = ("rope, proj_in, audio_proj_in, context_embedder, token_refiner, every block's attn and ff, "
                     "proj_out, audio_proj_out")


class PatchError(ValueError):
    """A module `h3cute.patch` cannot serve with its ops; the message names each module and why."""


@dataclass(frozen=True)
class CallSite:
    """One place where the model computes something the patch makes invariant: `op` is the h3 op that computes
    it; `mechanism` (scope="model" sites) names the kernels inside that op (cuBLASLt under vLLM's settings,
    FlashAttention-4, torch's row-wise kernels). `left` is None when the site is served, else why it is not."""
    module: str
    computes: str
    op: str | None
    left: str | None = None
    mechanism: str | None = None


# ---- the patched forwards ------------------------------------------------------------------------------

def _rows(t: torch.Tensor) -> torch.Tensor:
    """(..., H) hidden states as (rows, H) BF16: a view of a contiguous input; FP32 rows under BF16 autocast are
    cast (see the module docstring)."""
    x = t.reshape(-1, HIDDEN)
    if x.dtype != BF16:
        device = x.device.type
        if torch.is_autocast_enabled(device) and torch.get_autocast_dtype(device) == BF16:
            x = x.to(BF16)
    return x


def _row_index(index: torch.Tensor, rows: int) -> torch.Tensor:
    """The per-row index of (B*S, H) rows from the (S,) one: B is a replication axis, so it repeats B times."""
    n = index.shape[0]
    if rows == n:
        return index
    if n == 0 or rows % n:
        raise ValueError(f"h3cute: {rows} rows of hidden states for {n} per-row indices; the batch axis of "
                         f"(B, S, {HIDDEN}) hidden states repeats the S indexed rows")
    return index.repeat(rows // n)


def _base_forward(self):
    """diffusers' forward of this module: its class is the patched one, a subclass of it (FSDP2), or after
    `unpatch()` the base itself (a wrapper that captured the patched forward still calls it)."""
    cls = type(self)
    return getattr(cls, "_h3cute_base", cls).forward


def _time_proj_forward(self, timesteps: torch.Tensor) -> torch.Tensor:
    if not getattr(self, _ARMED, False):
        return _base_forward(self)(self, timesteps)
    return torch.ops.h3.timestep_sinusoid(timesteps)


def _time_embedder_forward(self, sample, condition=None) -> torch.Tensor:
    if not getattr(self, _ARMED, False) or condition is not None:  # a condition needs cond_proj, refused
        return _base_forward(self)(self, sample, condition)
    l1, l2 = self.linear_1, self.linear_2
    return torch.ops.h3.timestep_mlp(sample, l1.weight, l1.bias, l2.weight, l2.bias)


def _block_forward(
    self,
    hidden_states: torch.Tensor,
    temb: torch.Tensor,
    adaln_indices: torch.Tensor,
    rotary_emb: tuple[torch.Tensor, torch.Tensor],
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    if not getattr(self, _ARMED, False):
        return _base_forward(self)(self, hidden_states, temb, adaln_indices, rotary_emb, attention_mask)
    shape = hidden_states.shape
    x = _rows(hidden_states)
    idx = _row_index(adaln_indices, x.shape[0])
    proj = self.adaln_proj.linear
    table = torch.ops.h3.adaln_projection(temb, proj.weight, proj.bias).view(-1, BLOCK_TABLE)
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = table.chunk(6, dim=-1)
    normed = torch.ops.h3.norm_modulate(x, self.norm1.weight, shift_msa, scale_msa, idx, rms_norm_eps(self.norm1),
                                        False)
    attn_output = self.attn(normed.view(shape), rotary_emb, attention_mask)
    h, normed = torch.ops.h3.gate_residual_norm_modulate(x, _rows(attn_output), gate_msa, self.norm2.weight,
                                                         shift_mlp, scale_mlp, idx, rms_norm_eps(self.norm2), False)
    ff_output = self.ff(normed.view(shape))
    return torch.ops.h3.gate_residual(h, _rows(ff_output), gate_mlp, idx, False).view(shape)


def _norm_out_forward(self, hidden_states: torch.Tensor, temb: torch.Tensor,
                      timestep_indices: torch.Tensor) -> torch.Tensor:
    if not getattr(self, _ARMED, False):
        return _base_forward(self)(self, hidden_states, temb, timestep_indices)
    x = _rows(hidden_states)
    ti = _row_index(timestep_indices, x.shape[0])
    out = torch.ops.h3.final_adaln_out(x, self.norm.weight, temb, self.linear.weight, self.linear.bias, ti,
                                       rms_norm_eps(self.norm), False)
    return out.view(hidden_states.shape)


def _linear_forward(self, input: torch.Tensor) -> torch.Tensor:
    """scope="model": an FP32 head on torch.ops.h3.linear (cuBLAS's FP32 GEMMs are not row-invariant), a BF16
    linear on torch.ops.h3.dense (cuBLASLt under vLLM's settings, opaque to torch.compile)."""
    armed = getattr(self, _ARMED, False)
    if not armed:
        return _base_forward(self)(self, input)
    if armed == "dense":
        return torch.ops.h3.dense(input, self.weight, self.bias)
    return torch.ops.h3.linear(input, self.weight, self.bias)


def _rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """scope="model": an nn.RMSNorm outside the conditioning path (q/k norms, the token refiner's) on
    torch.ops.h3.rms_norm."""
    if not getattr(self, _ARMED, False):
        return _base_forward(self)(self, hidden_states)
    return torch.ops.h3.rms_norm(hidden_states, self.weight, rms_norm_eps(self))


def _swiglu_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """scope="model": diffusers' SwiGLU, its projection (an armed BF16 linear) then torch.ops.h3.swiglu."""
    if not getattr(self, _ARMED, False):
        return _base_forward(self)(self, hidden_states)
    return torch.ops.h3.swiglu(self.proj(hidden_states))


def _rope_forward(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scope="model": MiniMaxH3RotaryPosEmbed's (cos, sin) from torch.ops.h3.rotary_table."""
    if not getattr(self, _ARMED, False):
        return _base_forward(self)(self, position_ids)
    return torch.ops.h3.rotary_table(position_ids, self.inv_freq)


# ---- the patched classes -------------------------------------------------------------------------------

_PATCHED: dict[type, type] = {}  # base class -> its patched subclass
_CLASS_NAMES = ("Timesteps", "TimestepEmbedding", "MiniMaxH3TransformerBlock", "MiniMaxH3AdaLayerNormOut")


@functools.cache
def _diffusers() -> SimpleNamespace:
    """diffusers' classes (imported on first use: `import h3cute` does not import diffusers)."""
    from diffusers.models import activations, embeddings
    from diffusers.models.transformers import transformer_minimax_h3 as module

    def base(cls):
        return cls.__dict__.get("_h3cute_base", cls)
    return SimpleNamespace(
        module=module, Model=module.MiniMaxH3Transformer3DModel, Modulation=module.MiniMaxH3AdaLayerNormModulation,
        Attention=module.MiniMaxH3Attention, AttnProcessor=module.MiniMaxH3AttnProcessor,
        Timesteps=embeddings.Timesteps, TimestepEmbedding=embeddings.TimestepEmbedding,
        SwiGLU=activations.SwiGLU, RotaryPosEmbed=module.MiniMaxH3RotaryPosEmbed,
        Block=base(module.MiniMaxH3TransformerBlock), NormOut=base(module.MiniMaxH3AdaLayerNormOut),
    )


def _kinds() -> dict[str, tuple[type, object]]:
    """kind -> (diffusers class, patched forward)."""
    d = _diffusers()
    return {"time_proj": (d.Timesteps, _time_proj_forward),
            "time_embedder": (d.TimestepEmbedding, _time_embedder_forward),
            "block": (d.Block, _block_forward), "norm_out": (d.NormOut, _norm_out_forward)}


def _patched_class(cls: type, forward) -> type:
    if "_h3cute_base" in cls.__dict__:
        return cls
    patched = _PATCHED.get(cls)
    if patched is None:
        patched = type(cls.__name__, (cls,), {
            "forward": forward, "_h3cute_base": cls, _ARMED: False, "__doc__": cls.__doc__,
            # pickle finds the four diffusers classes' subclasses here by name (module __getattr__ below)
            "__module__": __name__, "__qualname__": cls.__qualname__ if cls.__name__ in _CLASS_NAMES
            else f"patched_{cls.__qualname__}",
        })
        _PATCHED[cls] = patched
    return patched


def __getattr__(name: str):
    if name in _CLASS_NAMES:
        for cls, forward in _kinds().values():
            if cls.__name__ == name:
                return _patched_class(cls, forward)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ---- guards --------------------------------------------------------------------------------------------

def _bypassed(path: str, m: nn.Module) -> list[tuple[str, str]]:
    """A submodule the patched module reads parameters from without calling it: its hooks would not run."""
    if m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks \
            or "forward" in m.__dict__:
        return [(path, "has hooks or a wrapped forward that would not run: the patched module reads its "
                       "parameters without calling it")]
    return []


def _module_problems(name: str, m: nn.Module, cls: type, forward) -> list[tuple[str, str]]:
    if not isinstance(m, cls):
        return [(name, f"is a {type(m).__qualname__}, not diffusers' {cls.__name__}")]
    if type(m).forward not in (cls.forward, forward):
        return [(name, f"its class {type(m).__qualname__} overrides {cls.__name__}.forward")]
    if "forward" in m.__dict__ and type(m).forward is not forward:  # (a wrapper of the patched forward is fine)
        by = ("diffusers hooks" if hasattr(m, "_diffusers_hook") else "an accelerate hook" if hasattr(m, "_hf_hook")
              else "an instance attribute")
        return [(name, f"its forward is already wrapped ({by}), and the wrapper would bypass the patch: call "
                       "h3cute.patch before enabling context parallelism, caches, offloading or device-map hooks")]
    return []


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _linear_problems(path: str, lin, shape: tuple[int, int], dtype, dtype_why: str) -> list[tuple[str, str]]:
    if hasattr(lin, "base_layer") or hasattr(lin, "lora_A"):
        return [(path, "carries a LoRA / PEFT adapter (base_layer, lora_A): the op would compute with the base "
                       "weight and drop the adapter's delta; fuse or merge the adapter into the weight, or unload it")]
    if type(lin) is not nn.Linear:
        return [(path, f"is a {type(lin).__qualname__}, not a plain torch.nn.Linear (the op reads weight and bias)")]
    out = []
    if tuple(lin.weight.shape) != shape:
        out.append((path, f"weight has shape {tuple(lin.weight.shape)}, not {shape}: {_WIDTHS}"))
    if lin.bias is None:
        out.append((path, "has no bias (the op adds one)"))
    dtypes = {lin.weight.dtype} | ({lin.bias.dtype} if lin.bias is not None else set())
    if dtypes != {dtype}:
        got = "/".join(sorted(_dtype_name(d) for d in dtypes))
        out.append((path, f"is {got}; the checkpoint keeps it {_dtype_name(dtype)} ({dtype_why})"))
    return out + _bypassed(path, lin)


def _norm_problems(path: str, norm) -> list[tuple[str, str]]:
    if not isinstance(norm, nn.RMSNorm) or type(norm).forward is not nn.RMSNorm.forward:
        return [(path, f"is a {type(norm).__qualname__}, not torch.nn.RMSNorm")]
    if norm.weight is None:
        return [(path, "has no weight (elementwise_affine=False); the op scales by one")]
    if tuple(norm.weight.shape) != (HIDDEN,):
        return [(path, f"normalizes {tuple(norm.weight.shape)} rows: {_WIDTHS}")]
    out = []
    if norm.weight.dtype != BF16:
        out.append((path, f"weight is {_dtype_name(norm.weight.dtype)}; the checkpoint's norm weights are bfloat16"))
    return out + _bypassed(path, norm)


def _time_proj_problems(name, m) -> list[tuple[str, str]]:
    if (m.num_channels, m.flip_sin_to_cos, m.downscale_freq_shift, m.scale) != (FREQ, True, 0, 1):
        return [(name, f"is Timesteps({m.num_channels}, flip_sin_to_cos={m.flip_sin_to_cos}, "
                       f"downscale_freq_shift={m.downscale_freq_shift}, scale={m.scale}); h3cute computes "
                       f"Timesteps({FREQ}, flip_sin_to_cos=True, downscale_freq_shift=0)")]
    return []


def _time_embedder_problems(name, m) -> list[tuple[str, str]]:
    out = []
    if m.cond_proj is not None:
        out.append((f"{name}.cond_proj", "a TimestepEmbedding with cond_proj takes a condition input; "
                                         "timestep_mlp has none"))
    if m.post_act is not None:
        out.append((f"{name}.post_act", "a TimestepEmbedding with post_act applies an activation after "
                                        "linear_2; timestep_mlp does not"))
    if type(m.act) is not nn.SiLU:
        out.append((f"{name}.act", f"is {type(m.act).__name__}; timestep_mlp applies SiLU"))
    else:
        out += _bypassed(f"{name}.act", m.act)
    why = "_keep_in_fp32_modules: the time embedder is FP32"
    out += _linear_problems(f"{name}.linear_1", m.linear_1, (MLP_HIDDEN, FREQ), F32, why)
    out += _linear_problems(f"{name}.linear_2", m.linear_2, (TEMB, MLP_HIDDEN), F32, why)
    return out


def _block_problems(name, m) -> list[tuple[str, str]]:
    d = _diffusers()
    proj = m.adaln_proj
    path = f"{name}.adaln_proj"
    if not isinstance(proj, d.Modulation) or type(proj).forward is not d.Modulation.forward:
        out = [(path, f"is a {type(proj).__qualname__}, not diffusers' MiniMaxH3AdaLayerNormModulation")]
    else:
        out = _bypassed(path, proj) + _linear_problems(f"{path}.linear", proj.linear, (BLOCK_PROJECTION, TEMB), BF16,
                                                       "the AdaLN projections are BF16")
    return out + _norm_problems(f"{name}.norm1", m.norm1) + _norm_problems(f"{name}.norm2", m.norm2)


def _norm_out_problems(name, m) -> list[tuple[str, str]]:
    return _norm_problems(f"{name}.norm", m.norm) + _linear_problems(
        f"{name}.linear", m.linear, (FINAL_PROJECTION, TEMB), BF16, "the AdaLN projections are BF16")


_PROBLEMS = {"time_proj": _time_proj_problems, "time_embedder": _time_embedder_problems, "block": _block_problems,
             "norm_out": _norm_out_problems}


def _sites(kind: str, name: str, left: str | None = None) -> list[CallSite]:
    if kind == "time_proj":
        rows = [(name, f"Timesteps({FREQ}, flip_sin_to_cos=True, downscale_freq_shift=0)", "timestep_sinusoid")]
    elif kind == "time_embedder":
        rows = [(name, "TimestepEmbedding: linear_1, SiLU, linear_2 (FP32)", "timestep_mlp")]
    elif kind == "block":
        rows = [(f"{name}.adaln_proj", f"linear(silu(temb).bf16) -> six (3T, {HIDDEN}) chunks", "adaln_projection"),
                (name, "norm1(x) * (1 + scale_msa[idx]) + shift_msa[idx]", "norm_modulate"),
                (name, "h = x + gate_msa[idx] * attn; norm2(h) * (1 + scale_mlp[idx]) + shift_mlp[idx]",
                 "gate_residual_norm_modulate"),
                (name, "h + gate_mlp[idx] * ff", "gate_residual")]
    else:
        rows = [(name, "MiniMaxH3AdaLayerNormOut: shift, scale = linear(silu(temb).bf16); "
                       "norm(x) * (1 + scale[ti]) + shift[ti]", "final_adaln_out")]
    return [CallSite(m, what, op, left) for m, what, op in rows]


def _targets(model) -> list[tuple[str, nn.Module, str]]:
    return [("time_proj", model.time_proj, "time_proj"), ("time_embedder", model.time_embedder, "time_embedder"),
            *((f"transformer_blocks.{i}", b, "block") for i, b in enumerate(model.transformer_blocks)),
            ("norm_out", model.norm_out, "norm_out")]


# ---- scope="model": the rest of the forward --------------------------------------------------------------

SCOPES = ("conditioning", "model")
_BLAS = "cuBLASLt without split-K under vLLM's settings"
_FA4 = "FlashAttention-4's forward and deterministic backward"
_ROWWISE = "torch's row-wise kernels"
_ELEMENTWISE = "torch's elementwise kernels"
_H3_ELEMENTWISE = "h3cute's elementwise kernels (eager torch's bits)"
_H3_ROWWISE = "h3cute's row kernels (eager torch's forward bits)"


def _conditioning_modules(model) -> set[int]:
    """ids of the linears and norms the conditioning ops take over (h3 ops read their weights)."""
    mods = [model.time_embedder.linear_1, model.time_embedder.linear_2, model.norm_out.linear, model.norm_out.norm]
    mods += [m for b in model.transformer_blocks for m in (b.adaln_proj.linear, b.norm1, b.norm2)]
    return {id(m) for m in mods}


def _head_problems(name, m) -> list[tuple[str, str]]:
    return _linear_problems(name, m, FP32_HEADS[name], F32, "_keep_in_fp32_modules: the heads are FP32") \
        if m.bias is not None else [(name, "has no bias; the checkpoint's heads have one")]


def _attention_problems(name, m) -> list[tuple[str, str]]:
    d = _diffusers()
    if type(m).forward is not d.Attention.forward:
        return [(name, f"its class {type(m).__qualname__} overrides MiniMaxH3Attention.forward")]
    proc = m.processor
    if not isinstance(proc, invariant.AttnProcessor) and type(proc) is not d.AttnProcessor:
        return [(name, f"runs the attention processor {type(proc).__qualname__}, not diffusers' "
                       "MiniMaxH3AttnProcessor (the patch would replace it)")]
    return []


def _model_plan(model) -> list:
    """[(name, module, kind, problems)] for the model scope's sites beyond the conditioning path (see
    h3cute.ops.model: each computes with an op torch.compile cannot see into)."""
    d = _diffusers()
    taken = _conditioning_modules(model)
    plan = []
    env = invariant.environment_problems()
    fa4 = invariant.fa4_problem()
    # the q/k norms of the attentions that get rotary angles (the transformer blocks'; the token refiner's get none)
    qk_norms = {id(getattr(b.attn, n, None)) for b in getattr(model, "transformer_blocks", ())
                for n in ("norm_q", "norm_k")}
    for name, m in model.named_modules():
        if isinstance(m, d.Attention):
            plan.append((name, m, "attention", [(name, fa4)] if fa4 else _attention_problems(name, m)))
        elif name in FP32_HEADS:
            plan.append((name, m, "head", _head_problems(name, m)))
        elif isinstance(m, nn.Linear) and id(m) not in taken:
            if m.weight.dtype != BF16:
                probs = [(name, f"is {_dtype_name(m.weight.dtype)}; scope='model' serves the checkpoint's BF16 "
                                "linears (and its FP32 heads with h3.linear)")]
            elif env:
                probs = [(name, "the environment lacks vLLM's cuBLASLt settings (" + "; ".join(env) + "): call "
                                "h3cute.invariant.set_environment() before CUDA initializes, or export them")]
            else:
                probs = _module_problems(name, m, nn.Linear, _linear_forward)
            plan.append((name, m, "linear", probs))
        elif isinstance(m, nn.RMSNorm) and id(m) not in taken:
            probs = _module_problems(name, m, nn.RMSNorm, _rms_norm_forward)
            if not probs and m.weight is None:
                probs = [(name, "has no weight (elementwise_affine=False); h3::rms_norm scales by one")]
            elif not probs and m.weight.dtype != BF16:
                probs = [(name, f"weight is {_dtype_name(m.weight.dtype)}; the checkpoint's norm weights are "
                                "bfloat16 (h3::rms_norm computes BF16 rows)")]
            plan.append((name, m, "qk_norm" if id(m) in qk_norms else "rms_norm", probs))
        elif isinstance(m, d.SwiGLU):
            probs = _module_problems(name, m, d.SwiGLU, _swiglu_forward) or _bypassed(
                f"{name}.activation", m.activation)
            if not probs and type(m.activation) is not nn.SiLU:
                probs = [(f"{name}.activation", f"is {type(m.activation).__name__}; h3::swiglu applies SiLU")]
            plan.append((name, m, "swiglu", probs))
        elif isinstance(m, d.RotaryPosEmbed):
            plan.append((name, m, "rope", _module_problems(name, m, d.RotaryPosEmbed, _rope_forward)))
    return plan


# kind -> (h3 op, what diffusers computes there, what keeps it invariant, the patched forward or None)
_MODEL_KINDS = {
    "attention": ("attention", "softmax attention over each sample's packed sequence; each head's q/k norm and "
                               "rotary embedding as h3::qk_norm_rotary", _FA4, None),
    "head": ("linear", "linear {i} -> {o} (FP32)", "h3cute's row-invariant FP32 GEMM", _linear_forward),
    "linear": ("dense", "linear {i} -> {o} (BF16)", _BLAS, _linear_forward),
    "rms_norm": ("rms_norm", "rms_norm over {shape}", _ROWWISE, _rms_norm_forward),
    "qk_norm": ("qk_norm_rotary", "rms_norm over {shape} of each head, then the rotary embedding, in the attention "
                                  "processor", _H3_ROWWISE, _rms_norm_forward),
    "swiglu": ("swiglu", "SwiGLU: proj, then a * silu(g)", _H3_ELEMENTWISE, _swiglu_forward),
    "rope": ("rotary_table", "rotary angles (cos, sin) of the (t, h, w) positions", _ELEMENTWISE, _rope_forward),
}


def _model_sites(kind: str, name: str, m, left: str | None = None) -> CallSite:
    op, what, mechanism, _ = _MODEL_KINDS[kind]
    if kind in ("head", "linear"):
        what = what.format(i=m.in_features, o=m.out_features)
    elif kind in ("rms_norm", "qk_norm"):
        what = what.format(shape=tuple(m.normalized_shape))
    return CallSite(name, what, op, left, mechanism)


# ---- row validation, once per forward --------------------------------------------------------------------

_ROW_ARGS = ((3, "timestep"), (4, "timestep_indices"), (5, "token_tags"))  # in MiniMaxH3Transformer3DModel.forward


def _check_rows(model, args, kwargs):
    """Forward pre-hook of a patched model: validates the packed rows (see the module docstring). On CUDA the
    check raises later (h3cute.launch.checks), so a bad row's timestep index becomes -1 here: the model's own
    `ti * 3 + tag` is then negative too and every h3 op writes NaN for that row instead of reading another row's
    parameters."""
    t, ti, tags = (kwargs[n] if n in kwargs else args[i] if i < len(args) else None for i, n in _ROW_ARGS)
    if t is None or ti is None or tags is None:
        return None  # diffusers' forward names the missing argument
    if t.dim() != 1:
        raise ValueError(f"h3cute: timestep must be the (T,) distinct timesteps, got shape {tuple(t.shape)}")
    idx = adaln_indices(ti, tags, t.shape[0])  # on CPU a bad row raises here
    if not ti.is_cuda:
        return None
    safe = torch.where(idx >= 0, ti, -1)
    position, name = _ROW_ARGS[1]
    if name in kwargs:
        return args, {**kwargs, name: safe}
    return (*args[:position], safe, *args[position + 1:]), kwargs


# ---- Patch ---------------------------------------------------------------------------------------------

class Patch:
    """What `h3cute.patch` changed on one model: `sites`, `unpatch()`, `report()`; a context manager too."""

    def __init__(self, model, sites, changed, hook, strict, *, scope="conditioning", processors=(), blas=False):
        self._model = weakref.ref(model)
        self.sites: tuple[CallSite, ...] = tuple(sites)
        self._changed = changed  # [(module, class it had before the patch, or None when already patched)]
        self._hook = hook
        self._processors = list(processors)  # [(attention module, its processor before the patch)]
        self._blas = blas  # holds h3cute.invariant's process-wide BLAS settings
        self.strict = strict
        self.scope = scope
        self.active = True

    @property
    def replaced(self) -> tuple[CallSite, ...]:
        """The sites an h3 op computes."""
        return tuple(s for s in self.sites if s.left is None and s.op is not None)

    @property
    def left(self) -> tuple[CallSite, ...]:
        return tuple(s for s in self.sites if s.left is not None)

    def unpatch(self) -> None:
        """Puts the model back exactly as it was before `patch` (a second call does nothing)."""
        if not self.active:
            return
        for m, before in self._changed:
            m.__dict__.pop(_ARMED, None)
            if before is not None and type(m) is _PATCHED.get(before):
                m.__class__ = before
        for m, processor in self._processors:
            if isinstance(m.processor, invariant.AttnProcessor):
                m.set_processor(processor)
        if self._blas:
            invariant.release_blas_settings()
        if self.scope == "model":
            invariant.release_compile_settings()
        if self._hook is not None:
            self._hook.remove()
        model = self._model()
        if model is not None:
            if _PATCHES.get(model) is self:
                del _PATCHES[model]
            first = _FIRST_FORWARD.pop(model, None)
            if first is not None:
                first.remove()
        self.active = False

    def report(self) -> str:
        model = self._model()
        title = type(model).__name__ if model is not None else "model"
        lines = [f"h3cute.patch of {title} (scope={self.scope!r}, {'active' if self.active else 'unpatched'}, "
                 f"strict={self.strict}): {len(self.replaced)} call sites on torch.ops.h3, "
                 f"{len(self.left)} left to diffusers"]
        width = max(len(s.module) for s in self.sites)
        for s in self.sites:
            state = "left" if s.left is not None else "replaced"
            by = f"h3::{s.op}" + (f" ({s.mechanism})" if s.mechanism else "")
            lines.append(f"  {state:<8}  {s.module:<{width}}  {s.computes}  ->  {by}")
            if s.left is not None:
                lines.append(f"  {'':<8}  {'':<{width}}  left to diffusers: {s.left}")
        if self._hook is not None:
            lines.append("  rows: validated once per forward by h3cute.adaln_indices(timestep_indices, token_tags, T) "
                         "in a forward pre-hook of the model; the block and norm_out ops run with check_indices=False")
        if self.scope == "conditioning":
            lines.append(f"  not conditioning ops, diffusers' own: {_NOT_CONDITIONING}")
        else:
            lines.append("  between the ops only views, index copies, dtype casts and single BF16 adds remain: "
                         "torch.compile (any mode, CUDA graphs included) gives the eager bits")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"<h3cute.Patch scope={self.scope!r} {len(self.replaced)} replaced, {len(self.left)} left, "
                f"active={self.active}>")

    def __enter__(self) -> "Patch":
        return self

    def __exit__(self, *exc) -> None:
        self.unpatch()


_PATCHES: "weakref.WeakKeyDictionary[nn.Module, Patch]" = weakref.WeakKeyDictionary()


def patch(transformer, *, strict: bool = True, scope: str = "conditioning") -> Patch:
    """Computes `transformer`'s conditioning path (time_proj, time_embedder, every MiniMaxH3TransformerBlock's
    AdaLN projection, norm/modulates and gated residuals, norm_out) with `torch.ops.h3` (see the module
    docstring). A model that is already patched with this scope returns its Patch unchanged.

    scope: "conditioning" (the h3 ops' sites only) or "model": every computation of the forward and backward on
    an h3 op, batch-invariant and the same bits eager and under torch.compile: the conditioning path as above plus
    the FP32 heads on `h3::linear`, attention on `h3::attention` (FlashAttention-4, deterministic backward), the
    BF16 linears on `h3::dense` (cuBLASLt under vLLM's settings, process-wide: `h3cute.invariant`), the remaining
    norms, the rotary embedding and the SwiGLU activation on their h3 ops (`h3cute.ops.model`).

    strict: a module h3cute cannot serve raises PatchError (each module and reason) before anything changes;
    with strict=False such a module stays diffusers' and `report()` says why.
    """
    d = _diffusers()
    if scope not in SCOPES:
        raise ValueError(f"h3cute.patch: scope must be one of {SCOPES}, got {scope!r}")
    if not isinstance(transformer, d.Model):
        raise TypeError(f"h3cute.patch: expected diffusers' MiniMaxH3Transformer3DModel, got "
                        f"{type(transformer).__qualname__}")
    existing = _PATCHES.get(transformer)
    if existing is not None:
        if existing.scope != scope:
            raise PatchError(f"h3cute.patch: the model is already patched with scope={existing.scope!r}; call its "
                             f"Patch's unpatch() before patching with scope={scope!r}")
        return existing
    kinds = _kinds()
    plan = []
    for name, m, kind in _targets(transformer):
        cls, forward = kinds[kind]
        problems = _module_problems(name, m, cls, forward) or _PROBLEMS[kind](name, m)
        plan.append((name, m, kind, problems))
    model_plan = _model_plan(transformer) if scope == "model" else []
    problems = [f"{path}: {why}" for *_, probs in plan for path, why in probs]
    by_reason: dict[str, list[str]] = {}
    for *_, probs in model_plan:  # a missing mechanism is one reason for many sites: one line per reason
        for path, why in probs:
            by_reason.setdefault(why, []).append(path)
    problems += [f"{', '.join(paths)}: {why}" for why, paths in by_reason.items()]
    if strict and problems:
        raise PatchError(f"h3cute.patch(scope={scope!r}) refused (nothing was changed; strict=False leaves these "
                         "modules to diffusers):\n  " + "\n  ".join(problems))
    sites, changed = [], []
    for name, m, kind, probs in plan:
        if probs:
            sites += _sites(kind, name, left="; ".join(f"{path}: {why}" for path, why in probs))
            continue
        sites += _sites(kind, name)
        _switch(m, kinds[kind][1], changed)
    processors = []
    for name, m, kind, probs in model_plan:
        left = "; ".join(why for _, why in probs) or None
        sites.append(_model_sites(kind, name, m, left))
        if left is not None:
            continue
        if kind == "attention":
            if not isinstance(m.processor, invariant.AttnProcessor):
                processors.append((m, m.processor))
                m.set_processor(invariant.AttnProcessor())
        else:
            _switch(m, _MODEL_KINDS[kind][3], changed, armed="dense" if kind == "linear" else True)
    rows_indexed = any(kind in ("block", "norm_out") and not probs for _, _, kind, probs in plan)
    hook = (transformer.register_forward_pre_hook(_check_rows, with_kwargs=True, prepend=True)
            if rows_indexed else None)
    blas = scope == "model" and any(kind == "linear" and not probs for _, _, kind, probs in model_plan)
    if blas:
        invariant.hold_blas_settings()
    if scope == "model":
        invariant.hold_compile_settings()
    result = Patch(transformer, sites, changed, hook, strict, scope=scope, processors=processors, blas=blas)
    _PATCHES[transformer] = result
    return result


def _switch(m: nn.Module, forward, changed: list, armed=True) -> None:
    """Arms m, switching its class to the patched subclass unless a patched forward is already in its MRO (a
    class built under apply_to_minimax_h3, or FSDP2's subclass of one patched earlier: a patched class over it
    would call the patched forward as its base's)."""
    before = None
    if getattr(type(m), "_h3cute_base", None) is None:
        before = type(m)
        m.__class__ = _patched_class(before, forward)
    m.__dict__[_ARMED] = armed  # True, or which op a class with several serves ("dense": a BF16 linear)
    changed.append((m, before))


# ---- the class-level switch ----------------------------------------------------------------------------

_CLASS_LEVEL: dict = {}  # while apply_to_minimax_h3 is in force: what it replaced
_BUILT: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models built meanwhile
_FIRST_FORWARD: "weakref.WeakKeyDictionary[nn.Module, object]" = weakref.WeakKeyDictionary()


@torch.compiler.disable  # patches modules: runs eagerly, once, ahead of what torch.compile traces
def _patch_at_first_forward(model, args, kwargs, *, strict, scope):
    result = patch(model, strict=strict, scope=scope)  # raises (every forward, until fixed) when a guard refuses
    handle = _FIRST_FORWARD.pop(model, None)
    if handle is not None:
        handle.remove()
    if result.active and result._hook is not None:
        return _check_rows(model, args, kwargs)  # this forward's rows: the Patch's own hook runs from the next one on
    return None


def apply_to_minimax_h3(*, strict: bool = True, scope: str = "conditioning") -> None:
    """Switches diffusers' MiniMax-H3 classes: a MiniMaxH3Transformer3DModel built from now on (`from_pretrained`
    included) is built with the patched block, time-step and norm_out classes (unarmed), and `patch(model,
    strict=strict, scope=scope)` runs in a forward pre-hook before its first forward computes anything, when the loaded
    weights' dtypes are final. Only the names in diffusers' transformer_minimax_h3 module change, so other diffusers
    models keep their Timesteps / TimestepEmbedding. A second call does nothing; `undo_minimax_h3` reverts."""
    if _CLASS_LEVEL:
        return
    if scope not in SCOPES:
        raise ValueError(f"h3cute.apply_to_minimax_h3: scope must be one of {SCOPES}, got {scope!r}")
    d = _diffusers()
    saved = {name: getattr(d.module, name) for name in _CLASS_NAMES}
    init = d.Model.__dict__["__init__"]

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _BUILT.add(self)
        _FIRST_FORWARD[self] = self.register_forward_pre_hook(
            functools.partial(_patch_at_first_forward, strict=strict, scope=scope), with_kwargs=True, prepend=True)

    for cls, forward in _kinds().values():
        setattr(d.module, cls.__name__, _patched_class(cls, forward))
    d.Model.__init__ = __init__
    _CLASS_LEVEL.update(saved=saved, init=init)


def undo_minimax_h3() -> None:
    """Reverts `apply_to_minimax_h3`: diffusers' classes are back, and every model built while it was in force is
    unpatched and put back to diffusers' classes. Does nothing when it is not in force."""
    if not _CLASS_LEVEL:
        return
    d = _diffusers()
    for name, cls in _CLASS_LEVEL["saved"].items():
        setattr(d.module, name, cls)
    d.Model.__init__ = _CLASS_LEVEL["init"]
    for model in list(_BUILT):
        handle = _FIRST_FORWARD.pop(model, None)
        if handle is not None:
            handle.remove()
        result = _PATCHES.get(model)
        if result is not None:
            result.unpatch()
        for m in model.modules():
            if getattr(type(m), "_h3cute_base", None) is not None:
                m.__dict__.pop(_ARMED, None)
                if type(m) is _PATCHED.get(m._h3cute_base):  # else a later subclass (FSDP2): disarmed only
                    m.__class__ = m._h3cute_base
    _BUILT.clear()
    _CLASS_LEVEL.clear()
