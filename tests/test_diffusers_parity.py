"""The `h3cute.reference` replays, and the CPU path of torch.ops.h3, equal the real diffusers 0.42.1 modules
bitwise on CPU.

Built from diffusers' own classes (`Timesteps`, `TimestepEmbedding`, `MiniMaxH3AdaLayerNormModulation`,
`MiniMaxH3AdaLayerNormOut`, `MiniMaxH3TransformerBlock`) at the H3 widths with random weights; the block's
attention and feed-forward are replaced by recorders that return fixed tensors, so its real `forward`
exercises the norm/modulate/gate-residual code while the test sees every intermediate.

CI installs diffusers==0.42.1 and sets CI (or H3CUTE_REQUIRE_DIFFUSERS=1): there, and on every CUDA machine, a
missing or different diffusers fails; only a CPU machine outside CI skips these tests without it.
"""
import importlib.util
import os

import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference as R
from h3cute.widths import BLOCK_TABLE, FREQ, HIDDEN as H, MLP_HIDDEN, MODALITIES, NORM_EPS, TEMB as D

from bitwise import same_bits

DIFFUSERS = "0.42.1"
if importlib.util.find_spec("diffusers") is None:
    if os.environ.get("CI") or os.environ.get("H3CUTE_REQUIRE_DIFFUSERS") or torch.cuda.is_available():
        pytest.fail(f"diffusers=={DIFFUSERS} is required in CI and on CUDA machines for the parity tests",
                    pytrace=False)
    pytest.skip(f"diffusers=={DIFFUSERS} not installed", allow_module_level=True)

import diffusers  # noqa: E402
from diffusers.models.embeddings import TimestepEmbedding, Timesteps  # noqa: E402
from diffusers.models.transformers import transformer_minimax_h3 as h3  # noqa: E402

BF16 = torch.bfloat16
T, S = 3, 11


def test_diffusers_version():
    assert diffusers.__version__ == DIFFUSERS


def _fill(module, seed):
    """Random weights (fan-in scaled) for every parameter of a module built on the meta device."""
    module.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            fan_in = p.shape[-1] if p.dim() == 2 else 50
            p.copy_(torch.randn(p.shape, generator=g) * fan_in**-0.5)
    return module


def _rows(seed=0):
    ti, tags = R.row_layout(S, T, seed)
    return ti, ti * MODALITIES + tags


@pytest.mark.parametrize("dtype", [torch.float32, BF16, torch.float64])
def test_timesteps(dtype):
    t = torch.rand(17, generator=torch.Generator().manual_seed(1)).to(dtype)
    t[0], t[1] = 0.0, 1.0
    expected = Timesteps(FREQ, flip_sin_to_cos=True, downscale_freq_shift=0)(t)
    assert same_bits(R.timestep_sinusoid_replay(t), expected)
    assert same_bits(torch.ops.h3.timestep_sinusoid(t), expected)


def test_timestep_embedding():
    with torch.device("meta"):
        m = TimestepEmbedding(in_channels=FREQ, time_embed_dim=MLP_HIDDEN, out_dim=D)
    m = _fill(m, 2)
    x = torch.randn(T, FREQ)
    args = (x, m.linear_1.weight, m.linear_1.bias, m.linear_2.weight, m.linear_2.bias)
    with torch.no_grad():
        expected = m(x)
        assert same_bits(R.timestep_mlp_replay(*args), expected)
        assert same_bits(torch.ops.h3.timestep_mlp(*args), expected)


def test_adaln_modulation_projection():
    with torch.device("meta"):
        m = h3.MiniMaxH3AdaLayerNormModulation(time_embed_dim=D, hidden_size=H)
    m = _fill(m, 3).to(BF16)
    temb = torch.randn(T, D)
    w, b = m.linear.weight, m.linear.bias
    with torch.no_grad():
        expected = m(temb)
        got = R.adaln_modulation_replay(temb, w, b)
        table = torch.ops.h3.adaln_projection(temb, w, b).view(MODALITIES * T, BLOCK_TABLE)
    assert len(expected) == len(got) == 6
    for e, g, c in zip(expected, got, table.chunk(6, dim=-1)):
        assert same_bits(g, e) and same_bits(c, e)


def test_adaln_norm_out():
    with torch.device("meta"):
        m = h3.MiniMaxH3AdaLayerNormOut(hidden_size=H, time_embed_dim=D, eps=NORM_EPS)
    m = _fill(m, 4).to(BF16)
    ti, _ = _rows(4)
    x = (torch.randn(S, H) * 2).to(BF16)
    temb = torch.randn(T, D)
    args = (x, m.norm.weight, temb, m.linear.weight, m.linear.bias, ti)
    with torch.no_grad():
        expected = m(x, temb, ti)
        assert same_bits(R.final_adaln_out_replay(*args), expected)
        assert same_bits(torch.ops.h3.final_adaln_out(*args), expected)


class _Recorder(torch.nn.Module):
    """Stands in for the block's attention / feed-forward: records its input, returns a fixed tensor."""

    def __init__(self, out):
        super().__init__()
        self.out, self.seen = out, None

    def forward(self, hidden_states, *args):
        self.seen = hidden_states
        return self.out


def test_transformer_block_modulation_and_gated_residuals():
    with torch.device("meta"):
        block = h3.MiniMaxH3TransformerBlock(
            hidden_size=H, num_attention_heads=2, attention_head_dim=64, ffn_dim=64, time_embed_dim=D,
            norm_eps=NORM_EPS, qk_norm_eps=1e-5,
        )
    block = _fill(block, 5).to(BF16)
    g = torch.Generator().manual_seed(5)
    y_attn, y_ff = (torch.randn(S, H, generator=g).to(BF16) for _ in range(2))
    block.attn, block.ff = _Recorder(y_attn), _Recorder(y_ff)
    _, idx = _rows(5)
    x = (torch.randn(S, H, generator=g) * 2).to(BF16)
    temb = torch.randn(T, D, generator=g)
    with torch.no_grad():
        out = block(x, temb, idx, rotary_emb=None)

    w, b = block.adaln_proj.linear.weight, block.adaln_proj.linear.bias
    shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = R.adaln_modulation_replay(temb, w, b)
    n1 = R.norm_modulate_replay(x, block.norm1.weight, shift_msa, scale_msa, idx)
    h1 = R.gate_residual_replay(x, y_attn, gate_msa, idx)
    n2 = R.norm_modulate_replay(h1, block.norm2.weight, shift_mlp, scale_mlp, idx)
    h2 = R.gate_residual_replay(h1, y_ff, gate_mlp, idx)
    assert same_bits(n1, block.attn.seen) and same_bits(n2, block.ff.seen) and same_bits(h2, out)

    # The same through torch.ops.h3, with the chunks as row-strided views of the (3T, 6H) table.
    with torch.no_grad():
        table = torch.ops.h3.adaln_projection(temb, w, b).view(MODALITIES * T, BLOCK_TABLE)
        c = table.chunk(6, dim=-1)
        assert same_bits(torch.ops.h3.norm_modulate(x, block.norm1.weight, c[0], c[1], idx), n1)
        assert same_bits(torch.ops.h3.gate_residual(x, y_attn, c[2], idx), h1)
        assert same_bits(torch.ops.h3.norm_modulate(h1, block.norm2.weight, c[3], c[4], idx), n2)
        assert same_bits(torch.ops.h3.gate_residual(h1, y_ff, c[5], idx), out)
        gathered = torch.ops.h3.adaln_row_gather(table, idx)
        for k, chunk in enumerate(c):
            assert same_bits(gathered[k], chunk.index_select(0, idx))
