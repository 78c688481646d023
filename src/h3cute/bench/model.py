"""MiniMax-H3 models and packed inputs for the model benchmark (`h3cute-bench model`) and the patch tests.

`build_model(size, device, seed)` is diffusers' `MiniMaxH3Transformer3DModel` at H3's conditioning widths
(hidden 5376, time embedding 2688, sinusoid 256, time-MLP hidden 5376) with `size`'s heads, FFN and text
widths and layer counts, random weights (2-D weights `randn * fan_in^-0.5`, biases `randn * 0.02`, norm weights
`1 + 0.1 * randn`, from one generator seeded `seed` on `device`; a 2-D weight of 2^24 or more elements is the
product of two random rank-32 factors, its entries distributed as N(0, 1) before the scale, because drawing the
520 MB AdaLN projections element by element takes seconds per block on a CPU), in the checkpoint's mixed precision
(`_keep_in_fp32_modules` FP32, everything else BF16). `packed_inputs` packs video, text and audio rows into one
interleaved sequence with T timesteps and a batch of B replicas, as the model's forward takes them.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from h3cute.widths import ATTENTION_HEAD_DIM, ATTENTION_HEADS, FFN, TEXT


@dataclass(frozen=True)
class ModelSize:
    heads: int
    head_dim: int
    ffn: int
    text_dim: int
    layers: int = 2
    refiner_layers: int = 1
    in_channels: int = 24
    audio_channels: int = 32
    patch: tuple[int, int, int] = (1, 2, 2)
    rope_freq_dim: int = 16

    @property
    def video_patch_dim(self) -> int:
        return self.in_channels * self.patch[0] * self.patch[1] * self.patch[2]


# H3's real attention, FFN and text widths, 2 blocks (the benchmark's model).
H3_TWO_BLOCKS = ModelSize(heads=ATTENTION_HEADS, head_dim=ATTENTION_HEAD_DIM, ffn=FFN, text_dim=TEXT)
# The conditioning widths are H3's (the ops serve no other); attention, FFN and text as small as the model allows:
# one head of 128 (the rope rotates 6 * rope_freq_dim = 96 of its channels), a 64-wide SwiGLU, 64 text channels.
TINY = ModelSize(heads=1, head_dim=128, ffn=64, text_dim=64)


_LOW_RANK_FROM, _RANK = 1 << 24, 32


def build_model(size: ModelSize = TINY, device="cpu", seed: int = 0):
    """A random-weight MiniMaxH3Transformer3DModel (see the module docstring), in eval mode like from_pretrained."""
    from diffusers.models.transformers.transformer_minimax_h3 import (MiniMaxH3RotaryPosEmbed,
                                                                      MiniMaxH3Transformer3DModel)

    with torch.device("meta"):
        model = MiniMaxH3Transformer3DModel(
            num_attention_heads=size.heads, attention_head_dim=size.head_dim, num_layers=size.layers,
            num_refiner_layers=size.refiner_layers, ffn_dim=size.ffn, in_channels=size.in_channels,
            audio_in_channels=size.audio_channels, patch_size=size.patch, text_dim=size.text_dim,
            rope_freq_dim=size.rope_freq_dim,
        )
    model.to_empty(device=device)
    keep = model._keep_in_fp32_modules
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            dtype = torch.float32 if any(k in name for k in keep) else torch.bfloat16
            if p.dim() == 2:
                scale = p.shape[1] ** -0.5
                if p.numel() >= _LOW_RANK_FROM:
                    a = torch.randn(p.shape[0], _RANK, generator=g, device=device) * (scale * _RANK ** -0.5)
                    x = a @ torch.randn(_RANK, p.shape[1], generator=g, device=device)
                else:
                    x = torch.randn(p.shape, generator=g, device=device) * scale
            else:
                x = torch.randn(p.shape, generator=g, device=device)
                x = x * 0.02 if name.endswith("bias") else 1 + 0.1 * x  # biases; norm weights
            p.data = x.to(dtype)
        # the rope's inv_freq is a computed, non-persistent buffer: to_empty left it uninitialised
        model.rope.inv_freq.copy_(MiniMaxH3RotaryPosEmbed(size.rope_freq_dim, model.config.rope_theta).inv_freq)
    return model.eval()


def packed_inputs(size: ModelSize, video: int, text: int, audio: int, *, timesteps: int = 3, batch: int = 1,
                  device="cpu", seed: int = 0) -> dict:
    """`MiniMaxH3Transformer3DModel.forward` keyword arguments: S = video + text + audio rows scattered over one
    sequence (a seeded permutation), every row's timestep index drawn from [0, T) with each of the T used,
    distinct timesteps in [0, 1), B replicas of the video / audio / text inputs (FP32; the model casts them)."""
    g = torch.Generator().manual_seed(seed)
    rows = video + text + audio
    perm = torch.randperm(rows, generator=g)
    text_indices = perm[:text].sort().values
    video_indices = perm[text:text + video].sort().values
    audio_indices = perm[text + video:].sort().values
    tags = torch.zeros(rows, dtype=torch.int64)
    tags[text_indices], tags[audio_indices] = 1, 2
    ti = torch.randint(0, timesteps, (rows,), generator=g)
    ti[perm[:timesteps]] = torch.arange(min(timesteps, rows))[: min(timesteps, rows)]
    timestep = (torch.arange(timesteps) + torch.rand(timesteps, generator=g)) / timesteps  # distinct, in [0, 1)
    cpu = {
        "hidden_states": torch.randn(batch, video, size.video_patch_dim, generator=g),
        "audio_hidden_states": torch.randn(batch, audio, size.audio_channels, generator=g),
        "encoder_hidden_states": torch.randn(batch, text, size.text_dim, generator=g),
        "timestep": timestep,
        "timestep_indices": ti,
        "token_tags": tags,
        "position_ids": torch.randint(0, 32, (rows, 3), generator=g),
        "video_indices": video_indices,
        "audio_indices": audio_indices,
        "text_indices": text_indices,
    }
    return {k: v.to(device) for k, v in cpu.items()}
