"""Device script: run chosen h3cute (and peer) launches once inside a CUDA profiler range, for Nsight
Compute to time each kernel alone (no launch gaps, no host time).

    ncu --profile-from-start off --clock-control none --csv --metrics gpu__time_duration.sum \
        python3 perf/ncu_launches.py mlp_fwd:1 proj_wgrad:64:tma_wgrad_persist ...

Cases (each warmed up outside the range first, so loading and first-touch costs stay out):
  mlp_fwd:T, mlp_fwd_bwd:T        torch.ops.h3.timestep_mlp forward / forward + backward
  mlp_fwd:T:CONFIG, mlp_bwd:T:CONFIG   launch.timestep_mlp.forward / backward with a named MlpConfig
  proj_fwd:T, proj_bwd:T          launch.adaln_projection.forward / backward (N = 96768)
  proj_wgrad:T:CONFIG             the dW GEMM alone with one config (wgmma family on sm_90a)
  proj_dgrad:T:CONFIG             the d_temb GEMM alone with one config (wgmma family on sm_90a)
  peer_proj_fwd:T                 the cuBLAS replay's forward (silu, BF16 cast, F.linear)
  peer_proj_bwd:T                 the cuBLAS replay's backward (torch autograd of that forward)
  peer_mlp_fwd:T                  the cuBLAS FP32 replay of timestep_mlp's forward (TF32 off)
Each profiled range is bracketed by an NVTX push/pop named after the case.
"""
from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from h3cute import runtime
from h3cute.launch import adaln_projection as P
from h3cute.launch import timestep_mlp as M
from h3cute.widths import BLOCK_PROJECTION, FREQ, MLP_HIDDEN, TEMB

D, N = TEMB, BLOCK_PROJECTION


def _mlp(rows, dev, g):
    x = torch.randn(rows, FREQ, generator=g, device=dev)
    w1 = torch.randn(MLP_HIDDEN, FREQ, generator=g, device=dev) * FREQ ** -0.5
    b1 = torch.randn(MLP_HIDDEN, generator=g, device=dev) * 0.02
    w2 = torch.randn(TEMB, MLP_HIDDEN, generator=g, device=dev) * MLP_HIDDEN ** -0.5
    b2 = torch.randn(TEMB, generator=g, device=dev) * 0.02
    return x, w1, b1, w2, b2


def _case(spec: str, dev):
    kind, rows, *rest = spec.split(":")
    rows = int(rows)
    g = torch.Generator(device=dev).manual_seed(rows)
    if kind in ("mlp_fwd", "mlp_fwd_bwd", "peer_mlp_fwd", "mlp_bwd"):
        x, w1, b1, w2, b2 = _mlp(rows, dev, g)
        if rest:
            config = getattr(M, rest[0])
            if kind == "mlp_fwd":
                return lambda: M.forward(x, w1, b1, w2, b2, config=config)
            grad = torch.randn(rows, TEMB, generator=g, device=dev)
            return lambda: M.backward(grad, x, w1, b1, w2, config=config)
        if kind == "peer_mlp_fwd":
            return lambda: F.linear(F.silu(F.linear(x, w1, b1)), w2, b2)
        if kind == "mlp_fwd":
            return lambda: torch.ops.h3.timestep_mlp(x, w1, b1, w2, b2)
        leaves = [t.requires_grad_(True) for t in (x, w1, b1, w2, b2)]
        return lambda: torch.ops.h3.timestep_mlp(*leaves).sum().backward()
    temb = torch.randn(rows, D, generator=g, device=dev)
    w = (torch.randn(N, D, generator=g, device=dev) * D ** -0.5).bfloat16()
    b = (torch.randn(N, generator=g, device=dev) * 0.02).bfloat16()
    grad = torch.randn(rows, N, generator=g, device=dev).bfloat16()
    if kind == "proj_fwd":
        return lambda: P.forward(temb, w, b)
    if kind == "proj_bwd":
        return lambda: P.backward(grad, temb, w)
    if kind == "peer_proj_fwd":
        return lambda: F.linear(F.silu(temb).bfloat16(), w, b)
    if kind == "peer_proj_bwd":
        leaves = [t.detach().requires_grad_(True) for t in (temb, w, b)]
        out = F.linear(F.silu(leaves[0]).bfloat16(), leaves[1], leaves[2])
        return lambda: torch.autograd.grad(out, leaves, grad, retain_graph=True)
    if kind == "proj_dgrad":
        (config,) = rest
        wgmma = runtime.arch_of(dev) == "sm_90a"
        partial = torch.empty(P.DGRAD_SPLITS, rows, D, device=dev)
        fn = runtime.kernel("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", dev, out_features=N,
                            config=config)
        return lambda: fn(grad, w, partial)
    if kind == "proj_wgrad":
        (config,) = rest
        act = P.silu_bf16(temb)
        dw, db = torch.empty_like(w), torch.empty_like(b)
        wgmma = runtime.arch_of(dev) == "sm_90a"
        fn = runtime.kernel("adaln_proj_wgrad_wgmma" if wgmma else "adaln_proj_wgrad", dev, out_features=N,
                            config=config, **(dict(wgmma=True) if wgmma else {}))
        return lambda: fn(grad, act, dw, db)
    raise SystemExit(f"ncu_launches: unknown case {spec!r}")


def main(argv) -> int:
    if not torch.cuda.is_available():
        print("ncu_launches: needs a CUDA device", file=sys.stderr)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda", 0)
    cases = [(spec, _case(spec, dev)) for spec in argv]
    for _, fn in cases:      # warm-up: loading, autotuning, allocator
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for spec, fn in cases:
        torch.cuda.nvtx.range_push(spec)
        fn()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
    torch.cuda.cudart().cudaProfilerStop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
