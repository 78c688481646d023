"""Pure-PyTorch references for the H3 conditioning ops: FP64 goldens and diffusers op-for-op replays.

`*_replay` reproduces diffusers 0.42.1 exactly: the same ops, in the same order, in the inputs' own
dtypes (`Timesteps(256, flip_sin_to_cos=True, downscale_freq_shift=0)` = `get_timestep_embedding`,
`TimestepEmbedding`, `MiniMaxH3AdaLayerNormModulation`, `MiniMaxH3AdaLayerNormOut`, and the
`index_select` modulation and gated residual of `MiniMaxH3TransformerBlock`). They are the CPU impls
of `torch.ops.h3.*`; tests/test_diffusers_parity.py checks them bitwise against the real modules.

`*_fp64` is the same math carried out entirely in FP64 (inputs widened, no intermediate rounding, the
BF16 cast of `silu(temb)` included since it defines the op's input), returning FP64: the golden that
accuracy is measured against. Differentiable, so FP64 gradients come from torch.autograd.
"""
import math

import torch
import torch.nn.functional as F

from h3cute.widths import (BLOCK_CHUNKS, BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FREQ, FREQ_HALF, HIDDEN,
                           MAX_PERIOD, MLP_HIDDEN, MODALITIES, NORM_EPS, TEMB)


# ---- diffusers op-for-op replays -------------------------------------------------------------------

def timestep_sinusoid_replay(t: torch.Tensor) -> torch.Tensor:
    """`get_timestep_embedding(t, 256, flip_sin_to_cos=True, downscale_freq_shift=0)`: (T,) -> (T, 256) FP32."""
    exponent = -math.log(MAX_PERIOD) * torch.arange(start=0, end=FREQ_HALF, dtype=torch.float32, device=t.device)
    exponent = exponent / FREQ_HALF  # half_dim - downscale_freq_shift; diffusers' `scale * emb` with scale 1 is exact
    emb = torch.exp(exponent)
    emb = t[:, None].float() * emb[None, :]
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    return torch.cat([emb[:, FREQ_HALF:], emb[:, :FREQ_HALF]], dim=-1)


def timestep_mlp_replay(x, w1, b1, w2, b2):
    """`TimestepEmbedding(256, 5376, out_dim=2688)`: linear_1 -> SiLU -> linear_2, FP32."""
    return F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)


def adaln_projection_replay(temb, weight, bias):
    """`MiniMaxH3AdaLayerNormModulation.linear(silu(temb).to(bf16))`: (T, 2688) FP32 -> (T, 96768) BF16."""
    return F.linear(F.silu(temb).to(weight.dtype), weight, bias)


def adaln_modulation_replay(temb, weight, bias):
    """`MiniMaxH3AdaLayerNormModulation.forward`: the six (3T, 5376) chunks, shift_msa .. gate_mlp."""
    return adaln_projection_replay(temb, weight, bias).view(-1, BLOCK_TABLE).chunk(BLOCK_CHUNKS, dim=-1)


def adaln_row_gather_replay(table, adaln_indices):
    """The six `chunk.index_select(0, adaln_indices)` of a block: (3T, 6*5376) -> six (S, 5376)."""
    return [c.index_select(0, adaln_indices) for c in table.chunk(BLOCK_CHUNKS, dim=-1)]


def modulation_replay(normed, shift, scale, adaln_indices):
    """The block's modulation of a normed tensor: `normed * (1.0 + scale[idx]) + shift[idx]`, BF16."""
    return normed * (1.0 + scale.index_select(0, adaln_indices)) + shift.index_select(0, adaln_indices)


def norm_modulate_replay(x, weight, shift, scale, adaln_indices, eps=NORM_EPS):
    """`norm(x) * (1.0 + scale.index_select(0, idx)) + shift.index_select(0, idx)` with `nn.RMSNorm`, BF16."""
    return modulation_replay(F.rms_norm(x, (x.shape[-1],), weight, eps), shift, scale, adaln_indices)


def gate_residual_replay(residual, y, gate, adaln_indices):
    """`residual + gate.index_select(0, idx) * y`, BF16."""
    return residual + gate.index_select(0, adaln_indices) * y


def gate_residual_norm_modulate_replay(residual, y, gate, weight, shift, scale, adaln_indices, eps=NORM_EPS):
    """A block's attention-half gated residual followed by its MLP-half norm/modulate of the same rows:
    `h = gate_residual_replay(...)`, `out = norm_modulate_replay(h, ...)`; returns (h, out), BF16."""
    h = gate_residual_replay(residual, y, gate, adaln_indices)
    return h, norm_modulate_replay(h, weight, shift, scale, adaln_indices, eps)


def final_projection_table(temb, proj_weight, proj_bias):
    """`MiniMaxH3AdaLayerNormOut`'s (T, 10752) projection: shift | scale."""
    return F.linear(F.silu(temb).to(proj_weight.dtype), proj_weight, proj_bias)


def final_projection_replay(temb, proj_weight, proj_bias):
    """`MiniMaxH3AdaLayerNormOut`'s (shift, scale), each a (T, 5376) view of the (T, 10752) projection."""
    return final_projection_table(temb, proj_weight, proj_bias).chunk(2, dim=-1)


def final_adaln_out_replay(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps=NORM_EPS):
    """`MiniMaxH3AdaLayerNormOut.forward`: RMSNorm then per-row shift/scale from the timestep's row, BF16."""
    shift, scale = final_projection_replay(temb, proj_weight, proj_bias)
    return norm_modulate_replay(x, norm_weight, shift, scale, timestep_indices, eps)


# ---- FP64 goldens ------------------------------------------------------------------------------------

def _f64(*ts):
    return [t.to(torch.float64) for t in ts]


def _rms_norm_fp64(x, weight, eps):
    return x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * weight


def _silu_bf16_fp64(temb):
    # The op is defined on silu(temb) rounded to BF16; everything after that is exact FP64. The rounding
    # is applied straight-through so that the FP64 gradient of temb is not itself rounded to BF16.
    s = F.silu(temb.to(torch.float64))
    return s + (s.to(torch.bfloat16).to(torch.float64) - s).detach()


def timestep_sinusoid_fp64(t):
    (t,) = _f64(t)
    k = torch.arange(FREQ_HALF, dtype=torch.float64, device=t.device)
    a = t[:, None] * torch.exp(-math.log(MAX_PERIOD) * k / FREQ_HALF)[None, :]
    return torch.cat([torch.cos(a), torch.sin(a)], dim=-1)


def timestep_mlp_fp64(x, w1, b1, w2, b2):
    x, w1, b1, w2, b2 = _f64(x, w1, b1, w2, b2)
    return F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)


def adaln_projection_fp64(temb, weight, bias):
    weight, bias = _f64(weight, bias)
    return F.linear(_silu_bf16_fp64(temb), weight, bias)


def adaln_row_gather_fp64(table, adaln_indices):
    (table,) = _f64(table)
    return [c.index_select(0, adaln_indices) for c in table.chunk(BLOCK_CHUNKS, dim=-1)]


def norm_modulate_fp64(x, weight, shift, scale, adaln_indices, eps=NORM_EPS):
    x, weight, shift, scale = _f64(x, weight, shift, scale)
    return _rms_norm_fp64(x, weight, eps) * (1 + scale[adaln_indices]) + shift[adaln_indices]


def gate_residual_fp64(residual, y, gate, adaln_indices):
    residual, y, gate = _f64(residual, y, gate)
    return residual + gate[adaln_indices] * y


def gate_residual_norm_modulate_fp64(residual, y, gate, weight, shift, scale, adaln_indices, eps=NORM_EPS):
    # `out` is defined on h as the op returns it, rounded to BF16 (the bits the two-op chain and diffusers
    # normalize); the rounding is straight-through, as autograd sees it, so h's FP64 gradient is grad_h + dx.
    h = gate_residual_fp64(residual, y, gate, adaln_indices)
    h_bf16 = h + (h.to(torch.bfloat16).to(torch.float64) - h).detach()
    return h, norm_modulate_fp64(h_bf16, weight, shift, scale, adaln_indices, eps)


def final_adaln_out_fp64(x, norm_weight, temb, proj_weight, proj_bias, timestep_indices, eps=NORM_EPS):
    shift, scale = adaln_projection_fp64(temb, proj_weight, proj_bias).chunk(2, dim=-1)
    return norm_modulate_fp64(x, norm_weight, shift, scale, timestep_indices, eps)


def linear_fp64(x, weight, bias=None):
    """h3::linear in FP64: x (..., K) weight (N, K)^T + bias (N,)."""
    y = x.double() @ weight.double().t()
    return y if bias is None else y + bias.double()


# ---- example inputs (the seed reports' recipe) -------------------------------------------------------

OPS = ("timestep_sinusoid", "timestep_mlp", "adaln_projection", "final_adaln_out", "adaln_row_gather",
       "norm_modulate", "gate_residual", "gate_residual_norm_modulate")


def row_layout(rows: int, num_timesteps: int, seed: int = 0):
    """(timestep_indices, token_tags), int64 on CPU: tags then indices drawn uniformly from one seeded CPU
    generator, the first three tags forced to 0, 1, 2 (rows interleaved, not blocked)."""
    g = torch.Generator().manual_seed(seed)
    tags = torch.randint(0, MODALITIES, (rows,), generator=g)
    tags[: min(rows, MODALITIES)] = torch.arange(min(rows, MODALITIES))
    ti = torch.randint(0, max(num_timesteps, 1), (rows,), generator=g)
    return ti, tags


def example_inputs(op: str, rows: int, *, num_timesteps: int = 3, device="cpu", seed: int = 0):
    """Positional arguments of `torch.ops.h3.<op>` (tensors only, defaults left out) at the H3 widths.

    `rows` is T for the timestep-row ops (timestep_sinusoid, timestep_mlp, adaln_projection) and S for the
    others. Weights are scaled by fan-in^-0.5, biases by 0.02, S-op activations are `randn * 2` in BF16,
    norm weights `0.5 + rand`. Note adaln_projection's weight alone is 520 MB.
    """
    g = torch.Generator(device=device).manual_seed(seed * 1000 + 17)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)

    bf16 = torch.bfloat16
    T = num_timesteps
    if op == "timestep_sinusoid":
        return (torch.rand(rows, generator=g, device=device),)
    if op == "timestep_mlp":
        return (randn(rows, FREQ), randn(MLP_HIDDEN, FREQ, scale=FREQ**-0.5), randn(MLP_HIDDEN, scale=0.02),
                randn(TEMB, MLP_HIDDEN, scale=MLP_HIDDEN**-0.5), randn(TEMB, scale=0.02))
    if op == "adaln_projection":
        return (randn(rows, TEMB), randn(BLOCK_PROJECTION, TEMB, scale=TEMB**-0.5, dtype=bf16),
                randn(BLOCK_PROJECTION, scale=0.02, dtype=bf16))
    ti, tags = row_layout(rows, T, seed)
    ti, idx = ti.to(device), (ti * MODALITIES + tags).to(device)
    x = randn(rows, HIDDEN, scale=2.0, dtype=bf16)
    if op == "final_adaln_out":
        norm_weight = (0.5 + torch.rand(HIDDEN, generator=g, device=device)).to(bf16)
        return (x, norm_weight, randn(T, TEMB), randn(FINAL_PROJECTION, TEMB, scale=TEMB**-0.5, dtype=bf16),
                randn(FINAL_PROJECTION, scale=0.02, dtype=bf16), ti)
    if op == "adaln_row_gather":
        return (randn(MODALITIES * T, BLOCK_TABLE, scale=0.5, dtype=bf16), idx)
    if op == "norm_modulate":
        norm_weight = (0.5 + torch.rand(HIDDEN, generator=g, device=device)).to(bf16)
        return (x, norm_weight, randn(MODALITIES * T, HIDDEN, scale=0.5, dtype=bf16),
                randn(MODALITIES * T, HIDDEN, scale=0.5, dtype=bf16), idx)
    if op == "gate_residual":
        return (x, randn(rows, HIDDEN, dtype=bf16), randn(MODALITIES * T, HIDDEN, scale=0.5, dtype=bf16), idx)
    if op == "gate_residual_norm_modulate":
        y, gate = randn(rows, HIDDEN, dtype=bf16), randn(MODALITIES * T, HIDDEN, scale=0.5, dtype=bf16)
        norm_weight = (0.5 + torch.rand(HIDDEN, generator=g, device=device)).to(bf16)
        return (x, y, gate, norm_weight, randn(MODALITIES * T, HIDDEN, scale=0.5, dtype=bf16),
                randn(MODALITIES * T, HIDDEN, scale=0.5, dtype=bf16), idx)
    raise ValueError(f"unknown h3 op {op!r}; expected one of {OPS}")


FP64 = {
    "timestep_sinusoid": timestep_sinusoid_fp64,
    "timestep_mlp": timestep_mlp_fp64,
    "adaln_projection": adaln_projection_fp64,
    "final_adaln_out": final_adaln_out_fp64,
    "adaln_row_gather": adaln_row_gather_fp64,
    "norm_modulate": norm_modulate_fp64,
    "gate_residual": gate_residual_fp64,
    "gate_residual_norm_modulate": gate_residual_norm_modulate_fp64,
}
REPLAY = {
    "timestep_sinusoid": timestep_sinusoid_replay,
    "timestep_mlp": timestep_mlp_replay,
    "adaln_projection": adaln_projection_replay,
    "final_adaln_out": final_adaln_out_replay,
    "adaln_row_gather": adaln_row_gather_replay,
    "norm_modulate": norm_modulate_replay,
    "gate_residual": gate_residual_replay,
    "gate_residual_norm_modulate": gate_residual_norm_modulate_replay,
}
