"""The op table of the prior-art harness: how each H3 op's inputs are drawn and judged.

A `Problem` draws a *pool* of `n` rows for one seed (`draw(n, seed, device)`); every batch the checks
run is a row selection of that pool (`take_rows`): per-row inputs are indexed, shared inputs (weights,
tables, timestep embeddings of the S-ops) stay the same tensors. Inputs follow the seed reports
(H3_OPS.md, "How the seed reports judge an op"):

- every random tensor is `randn`/`rand` from its own generator seeded `seed * 1000 + salt` on the
  device the tensors live on; T-op weights are scaled by fan_in^-0.5, biases by 0.02;
- S-op hidden states are `randn * 2` in BF16, norm weights `0.5 + rand`, T = 3 timesteps;
- the row layout (token tags, then timestep indices) comes from one CPU generator seeded `seed`;
  the first three tags are forced to 0, 1, 2 so every modality is present; `adaln_indices = ti*3+tag`.

Names of gradients in reports follow the seeds (`x, w1, b1, w2, b2`; `x, nw, temb, w, b`).

`at_smoke_scale` is the problem a CPU-only machine runs: the same widths, except where `smoke_draw` draws a
narrower problem (adaln_projection's 520 MB weight costs seconds per BF16 call on a CPU); `narrowed` then says
so, and the h3cute candidate, whose ops take the checkpoint's widths only, sits that op out.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from h3cute.widths import BLOCK_PROJECTION, BLOCK_TABLE, FINAL_PROJECTION, FREQ, HIDDEN, MLP_HIDDEN, MODALITIES, TEMB

T_S_OPS = 3       # distinct timesteps drawn for the S-ops

T_OP_ACCURACY_SIZES = (1, 3, 4, 64, 256, 2048)
S_OP_ACCURACY_SIZES = (4097, 32768)


@dataclass(frozen=True)
class Problem:
    """One op as the harness sees it.

    `args` are the op's tensor arguments in schema order (non-tensor schema arguments keep their
    defaults). `row_args` are indexed by row (dim 0) when a batch is cut from the pool; every output
    is row-indexed the same way. `row_grads` / `param_grads` are the inputs whose gradients are per
    row (compared bitwise per row) or reduced over rows (compared for repeatability).
    """
    op: str
    args: tuple[str, ...]
    row_args: tuple[str, ...]
    row_grads: tuple[str, ...]
    param_grads: tuple[str, ...]
    draw: Callable[[int, int, torch.device], dict]
    accuracy_sizes: tuple[int, ...]
    full_batch: int
    sub_batch_sizes: tuple[int, ...]
    grad_names: dict = field(default_factory=dict)
    out_dtype: torch.dtype = torch.float32  # of every output: the accuracy upstream gradient is drawn in it
    gemm: bool = False                      # run under the cuBLAS modes
    triton_modes: bool = False              # and under SGLang's / Megatron's Triton batch-invariant modes
    h3_kwargs: dict = field(default_factory=dict)   # host-syncing check flags off in timed loops
    diffusers_source: str = ""
    fwd_flops: Callable[[int], tuple[int, str]] | None = None   # (flops, "bf16" | "fp32")
    smoke_draw: Callable[[int, int, torch.device], dict] | None = None   # a narrower draw for the CPU smoke
    narrowed: str | None = None             # set by at_smoke_scale: how this problem differs from the op's

    @property
    def has_backward(self) -> bool:
        return bool(self.row_grads or self.param_grads)

    def grad_name(self, arg: str) -> str:
        return self.grad_names.get(arg, arg)


def at_smoke_scale(problem: Problem) -> Problem:
    """The problem as the CPU smoke runs it: `smoke_draw` in place of `draw`, where the op has one."""
    if problem.smoke_draw is None:
        return problem
    shapes = {k: tuple(v.shape) for k, v in problem.smoke_draw(1, 0, torch.device("cpu")).items()
              if k not in problem.row_args}
    return replace(problem, draw=problem.smoke_draw, narrowed=(
        f"drawn narrower at CPU smoke scale ({', '.join(f'{k} {v}' for k, v in shapes.items())}): "
        "not the op's widths"))


def take_rows(problem: Problem, inputs: dict, rows: torch.Tensor) -> dict:
    """The batch made of pool rows `rows` (a 1-D int64 tensor; repeats allowed), in that order."""
    out = dict(inputs)
    for name in problem.row_args:
        out[name] = inputs[name].index_select(0, rows.to(inputs[name].device))
    return out


def _gen(seed: int, salt: int, device: torch.device) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed * 1000 + salt)
    return g


def randn(shape, seed, salt, device, scale=1.0, dtype=torch.float32):
    x = torch.randn(shape, generator=_gen(seed, salt, device), device=device, dtype=torch.float32)
    return (x * scale).to(dtype)


def rand(shape, seed, salt, device):
    return torch.rand(shape, generator=_gen(seed, salt, device), device=device, dtype=torch.float32)


def row_layout(n: int, seed: int, num_timesteps: int = T_S_OPS):
    """(token_tags, timestep_indices) of n interleaved rows, from one CPU generator."""
    g = torch.Generator().manual_seed(seed)
    tags = torch.randint(0, MODALITIES, (n,), generator=g, dtype=torch.int64)
    ti = torch.randint(0, num_timesteps, (n,), generator=g, dtype=torch.int64)
    tags[: min(MODALITIES, n)] = torch.arange(MODALITIES)[: min(MODALITIES, n)]
    return tags, ti


def _adaln_indices(n, seed, device):
    tags, ti = row_layout(n, seed)
    return (ti * MODALITIES + tags).to(device)


# ---- the ops -------------------------------------------------------------------------------------

def _draw_sinusoid(n, seed, device):
    return {"t": rand((n,), seed, 0, device)}


def _draw_mlp(n, seed, device):
    return {
        "x": randn((n, FREQ), seed, 0, device),
        "w1": randn((MLP_HIDDEN, FREQ), seed, 1, device, FREQ ** -0.5),
        "b1": randn((MLP_HIDDEN,), seed, 2, device, 0.02),
        "w2": randn((TEMB, MLP_HIDDEN), seed, 3, device, MLP_HIDDEN ** -0.5),
        "b2": randn((TEMB,), seed, 4, device, 0.02),
    }


def _draw_final_out(n, seed, device):
    bf = torch.bfloat16
    tags, ti = row_layout(n, seed)
    return {
        "x": randn((n, HIDDEN), seed, 0, device, 2.0, bf),
        "norm_weight": (0.5 + rand((HIDDEN,), seed, 1, device)).to(bf),
        "temb": randn((T_S_OPS, TEMB), seed, 2, device),
        "proj_weight": randn((FINAL_PROJECTION, TEMB), seed, 3, device, TEMB ** -0.5, bf),
        "proj_bias": randn((FINAL_PROJECTION,), seed, 4, device, 0.02, bf),
        "timestep_indices": ti.to(device),
    }


def _draw_projection(n, seed, device, width=BLOCK_PROJECTION):
    bf = torch.bfloat16
    return {
        "temb": randn((n, TEMB), seed, 0, device),
        "weight": randn((width, TEMB), seed, 1, device, TEMB ** -0.5, bf),
        "bias": randn((width,), seed, 2, device, 0.02, bf),
    }


def _draw_projection_smoke(n, seed, device):
    return _draw_projection(n, seed, device, width=BLOCK_PROJECTION // 16)   # 33 MB instead of 520 MB


def _draw_gather(n, seed, device):
    return {
        "table": randn((MODALITIES * T_S_OPS, BLOCK_TABLE), seed, 0, device, 1.0, torch.bfloat16),
        "adaln_indices": _adaln_indices(n, seed, device),
    }


def _draw_norm_modulate(n, seed, device):
    bf = torch.bfloat16
    return {
        "x": randn((n, HIDDEN), seed, 0, device, 2.0, bf),
        "weight": (0.5 + rand((HIDDEN,), seed, 1, device)).to(bf),
        "shift": randn((MODALITIES * T_S_OPS, HIDDEN), seed, 2, device, 1.0, bf),
        "scale": randn((MODALITIES * T_S_OPS, HIDDEN), seed, 3, device, 1.0, bf),
        "adaln_indices": _adaln_indices(n, seed, device),
    }


def _draw_gate_residual(n, seed, device):
    bf = torch.bfloat16
    return {
        "residual": randn((n, HIDDEN), seed, 0, device, 2.0, bf),
        "y": randn((n, HIDDEN), seed, 1, device, 2.0, bf),
        "gate": randn((MODALITIES * T_S_OPS, HIDDEN), seed, 2, device, 1.0, bf),
        "adaln_indices": _adaln_indices(n, seed, device),
    }


def _draw_gate_residual_norm_modulate(n, seed, device):
    """gate_residual's draw (the same residual, y, gate and rows), then the norm's weight and tables."""
    bf = torch.bfloat16
    gated = _draw_gate_residual(n, seed, device)
    idx = gated.pop("adaln_indices")  # last, in schema order
    return {
        **gated,
        "weight": (0.5 + rand((HIDDEN,), seed, 3, device)).to(bf),
        "shift": randn((MODALITIES * T_S_OPS, HIDDEN), seed, 4, device, 1.0, bf),
        "scale": randn((MODALITIES * T_S_OPS, HIDDEN), seed, 5, device, 1.0, bf),
        "adaln_indices": idx,
    }


_T_FULL, _T_SUBS = 4096, (1, 7, 1024, 2048)
_S_FULL, _S_SUBS = 131072, (1, 7, 4097, 32768, 65536)

PROBLEMS: dict[str, Problem] = {p.op: p for p in (
    Problem(
        op="timestep_sinusoid", args=("t",), row_args=("t",), row_grads=(), param_grads=(),
        draw=_draw_sinusoid, accuracy_sizes=T_OP_ACCURACY_SIZES,
        full_batch=8192, sub_batch_sizes=(1, 7, 2048, 4097),
        h3_kwargs={},  # the default call: its range check runs inside the kernel, no host sync
        diffusers_source="diffusers get_timestep_embedding (op-for-op replay)",
    ),
    Problem(
        op="timestep_mlp", args=("x", "w1", "b1", "w2", "b2"), row_args=("x",), row_grads=("x",),
        param_grads=("w1", "b1", "w2", "b2"), draw=_draw_mlp, accuracy_sizes=T_OP_ACCURACY_SIZES,
        full_batch=_T_FULL, sub_batch_sizes=_T_SUBS, gemm=True, triton_modes=True,
        diffusers_source="diffusers TimestepEmbedding, FP32 F.linear",
        fwd_flops=lambda n: (2 * n * (FREQ * MLP_HIDDEN + MLP_HIDDEN * TEMB), "fp32"),
    ),
    Problem(
        op="final_adaln_out", out_dtype=torch.bfloat16,
        args=("x", "norm_weight", "temb", "proj_weight", "proj_bias", "timestep_indices"),
        row_args=("x", "timestep_indices"), row_grads=("x",),
        param_grads=("norm_weight", "temb", "proj_weight", "proj_bias"),
        grad_names={"norm_weight": "nw", "proj_weight": "w", "proj_bias": "b"},
        draw=_draw_final_out, accuracy_sizes=S_OP_ACCURACY_SIZES,
        full_batch=_S_FULL, sub_batch_sizes=_S_SUBS, gemm=True,
        h3_kwargs={"check_indices": False},
        diffusers_source="diffusers MiniMaxH3AdaLayerNormOut (op-for-op replay)",
        fwd_flops=lambda n: (2 * T_S_OPS * TEMB * FINAL_PROJECTION, "bf16"),
    ),
    Problem(
        op="adaln_projection", out_dtype=torch.bfloat16, args=("temb", "weight", "bias"),
        row_args=("temb",),
        row_grads=("temb",), param_grads=("weight", "bias"),
        grad_names={"weight": "w", "bias": "b"},
        draw=_draw_projection, accuracy_sizes=T_OP_ACCURACY_SIZES,
        full_batch=_T_FULL, sub_batch_sizes=_T_SUBS, gemm=True, triton_modes=True,
        smoke_draw=_draw_projection_smoke,
        diffusers_source="diffusers MiniMaxH3AdaLayerNormModulation projection (op-for-op replay)",
        fwd_flops=lambda n: (2 * n * TEMB * BLOCK_PROJECTION, "bf16"),
    ),
    Problem(
        op="adaln_row_gather", out_dtype=torch.bfloat16, args=("table", "adaln_indices"),
        row_args=("adaln_indices",),
        row_grads=(), param_grads=("table",), draw=_draw_gather,
        accuracy_sizes=S_OP_ACCURACY_SIZES, full_batch=_S_FULL, sub_batch_sizes=_S_SUBS,
        h3_kwargs={"check_indices": False},
        diffusers_source="diffusers MiniMaxH3 index_select modulation (op-for-op replay)",
    ),
    Problem(
        op="norm_modulate", out_dtype=torch.bfloat16,
        args=("x", "weight", "shift", "scale", "adaln_indices"),
        row_args=("x", "adaln_indices"), row_grads=("x",), param_grads=("weight", "shift", "scale"),
        grad_names={"weight": "w"},
        draw=_draw_norm_modulate, accuracy_sizes=S_OP_ACCURACY_SIZES,
        full_batch=_S_FULL, sub_batch_sizes=_S_SUBS, h3_kwargs={"check_indices": False},
        diffusers_source="diffusers RMSNorm + modulation (op-for-op replay)",
    ),
    Problem(
        op="gate_residual", out_dtype=torch.bfloat16,
        args=("residual", "y", "gate", "adaln_indices"),
        row_args=("residual", "y", "adaln_indices"), row_grads=("residual", "y"),
        param_grads=("gate",), draw=_draw_gate_residual,
        accuracy_sizes=S_OP_ACCURACY_SIZES, full_batch=_S_FULL, sub_batch_sizes=_S_SUBS,
        h3_kwargs={"check_indices": False},
        diffusers_source="diffusers gated residual (op-for-op replay)",
    ),
    Problem(
        op="gate_residual_norm_modulate", out_dtype=torch.bfloat16,
        args=("residual", "y", "gate", "weight", "shift", "scale", "adaln_indices"),
        row_args=("residual", "y", "adaln_indices"), row_grads=("residual", "y"),
        param_grads=("gate", "weight", "shift", "scale"), grad_names={"weight": "w"},
        draw=_draw_gate_residual_norm_modulate, accuracy_sizes=S_OP_ACCURACY_SIZES, full_batch=_S_FULL,
        sub_batch_sizes=_S_SUBS, h3_kwargs={"check_indices": False},
        diffusers_source="diffusers gated residual, then RMSNorm + modulation of its rows (op-for-op replay)",
    ),
)}

OPS = tuple(PROBLEMS)
