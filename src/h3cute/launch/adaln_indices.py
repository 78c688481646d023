"""Host side of `h3::adaln_indices` on CUDA: one launch of `adaln_indices` (kernels/adaln_indices.py), which
writes idx = ti * 3 + tag (-1 for a bad row) and records bad rows in the check slots of `timestep_indices` and
`token_tags` (h3cute.launch.checks). No host sync."""
from __future__ import annotations

import torch

from h3cute import runtime
from h3cute.launch import checks

OP = "adaln_indices"


def forward(timestep_indices: torch.Tensor, token_tags: torch.Tensor, num_timesteps: int) -> torch.Tensor:
    ti, tags = timestep_indices.contiguous(), token_tags.contiguous()
    out = torch.empty_like(ti)
    if ti.shape[0]:
        device = ti.device
        runtime.kernel(OP, device)(ti, tags, out, int(num_timesteps),
                                   *checks.slot_addresses(device, OP, "timestep_indices"),
                                   *checks.slot_addresses(device, OP, "token_tags"))
    return out
