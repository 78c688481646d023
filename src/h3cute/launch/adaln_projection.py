"""Host side of `h3::adaln_projection` on CUDA: `table = linear(silu(temb).bf16, W, b)` and its backward.

Kernels (kernels/adaln_gemm*.py, kernels/adaln_elementwise.py): `adaln_silu_cast` makes the GEMM operand
a = bf16(silu(temb)); `adaln_proj_fwd` computes out^T = W a^T + b with mma.sync m16n8k16 (W rows are the MMA's M,
T its N).
The backward: `adaln_proj_dgrad` (grad @ W as `DGRAD_SPLITS` fixed-chunk FP32 partials) +
`adaln_dtemb_fold` (sum in split order, times silu'(temb), FP32: the BF16 cast passes the gradient
through unrounded; it also recomputes a, with silu_cast's bits, for the next kernel);
`adaln_proj_wgrad` (dW = grad^T a, K = T, BF16 out; also db where `wgrad_writes_dbias`: the dW kernels
with db warps (side_warps "dbias") at every T, the others for T <= `FUSED_DBIAS_ROWS`); `adaln_bias_grad`
otherwise (db = sum_t grad: FP32 sums of `DBIAS_ROW_BLOCK`-row blocks, each of four row chains, folded in block
order, BF16 out; the dW kernels use the same order, so the same bits). Beyond T = 384 on the wgmma family
(`wgrad_folds`) the dW kernel `adaln_proj_wgrad_fold` also does the d_temb fold and db's block sums in its idle
producer warps (db's blocks from the dW stages, folded by a second launch of the same compiled function: the same
sums, the same bits), after `adaln_silu_cast` makes its operand. No atomics: every result is bitwise repeatable.

Each GEMM's config is picked from T by its role's table in `PICKS` (kernels/_adaln_configs.py) purely for speed: every
config of a family runs the same k16 MMA sequence per output element, so the bits do not depend on it (tests check
this); a pick that models the GPU (`RoundsPick`) reads the device's SM count. Used with out_features 96768 (this op)
and 10752 (final_adaln_out's projection). No host syncs.

Two MMA families: "warp" (mma.sync, sm_90a and sm_100a) and "wgmma" (sm_90a warpgroup MMA, `*_wgmma` kernels; the
cp.async and the TMA mainloops, the same bits). The families' bits may differ, so a device uses one family for every
T: `SM90_FAMILY` says which on sm_90a. An explicit `config` picks its family (tests, timing, `h3cute-bench sweep`);
`candidates(role, family)` names a family's configs for a role; the bundle holds its `picks(role, family)`, the
others compile on demand.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from h3cute import runtime
from h3cute.kernels._adaln_configs import (ADALN_GEMM_CONFIGS, DBIAS_CHAIN_ROWS, DBIAS_ROW_BLOCK,  # noqa: F401
                                          DGRAD_MODEL_ROWS, DGRAD_ROUNDS, DGRAD_SPLITS, FUSED_DBIAS_ROWS, H200_SMS,
                                          PICKS, RoundsPick, candidates, dgrad_round_columns, parse_config, pick)
from h3cute.launch import plan as P
from h3cute.launch.plan import M, Buffer, Fill, Kernel, Launch, Output, Phase, view
from h3cute.widths import TEMB

OP = "adaln_projection"
F32, BF16 = torch.float32, torch.bfloat16

# The family sm_90a devices use: the wgmma family passed the GPU suite on an H200 and was as fast or faster at every
# T measured; sm_100a uses the warp family.
SM90_FAMILY = "wgmma"


def config_for_rows(rows: int, wgmma: bool = False, sms: int = H200_SMS) -> str:
    """The forward GEMM's config for T rows (`PICKS["fwd"]`)."""
    return pick("fwd", rows, wgmma, sms)


def dgrad_config_for_rows(rows: int, wgmma: bool = False, sms: int = H200_SMS) -> str:
    """The d_temb GEMM's config for T rows (`PICKS["dgrad"]`)."""
    return pick("dgrad", rows, wgmma, sms)


def wgrad_config_for_rows(rows: int, wgmma: bool = False, sms: int = H200_SMS) -> str:
    """The dW GEMM's config for T rows (`PICKS["wgrad"]`)."""
    return pick("wgrad", rows, wgmma, sms)


def wgrad_folds(config: str, wgmma: bool) -> bool:
    """Whether the backward runs the dW GEMM of `config` as `adaln_proj_wgrad_fold`: its fold warps then write d_temb
    and db (the bits of adaln_dtemb_fold and adaln_bias_grad), so neither launches, and adaln_silu_cast makes the
    dW operand first. The wgmma family's dW pick beyond T = 384, where dW is MMA-bound and the two memory-bound
    launches cost more than silu_cast."""
    return wgmma and "wgrad_fold" in ADALN_GEMM_CONFIGS[config].roles


def wgrad_writes_dbias(config: str, rows: int) -> bool:
    """Whether the dW GEMM of `config` writes db at T rows (else `adaln_bias_grad` runs after it; the same bits):
    the kernels with db warps sum each stage of db's tiles as it lands, at every T; the others re-read grad for it
    after their main loop, worth it only while T is small."""
    return ADALN_GEMM_CONFIGS[config].side_warps == "dbias" or rows <= FUSED_DBIAS_ROWS


# adaln_bias_grad's (and the fold-warp dW's) partial rows for T rows: one per DBIAS_ROW_BLOCK block (the kernel reads
# the count off its partial tensor)
DBIAS_BLOCKS = P.row_blocks(DBIAS_ROW_BLOCK)


def dbias_blocks(rows: int) -> int:
    """db's FP32 partial rows at T rows (DBIAS_BLOCKS)."""
    return DBIAS_BLOCKS(rows)


def _uses_wgmma(device, config: str | None) -> bool:
    if config is not None:
        return parse_config(config).family == "wgmma"
    return SM90_FAMILY == "wgmma" and runtime.arch_of(device) == "sm_90a"


@functools.cache
def t_bounds(sms: int = H200_SMS) -> tuple:
    """Where a launch choice changes with T on a GPU of `sms` SMs (the plans' row ranges): every pick table's bounds
    (the configs, whether dW writes db or folds), the ends of the `RoundsPick` ranges, and FUSED_DBIAS_ROWS."""
    bounds = {FUSED_DBIAS_ROWS, runtime.MAX_ROWS}
    for table in PICKS.values():
        for entries in table.values():
            bounds |= {b for b, _ in entries if b is not None}
            for lo_bound, (bound, choice) in zip((0,) + tuple(b for b, _ in entries), entries):
                if isinstance(choice, RoundsPick):
                    bounds |= {b for lo, hi in choice.ranges(sms) for b in (lo - 1, hi)
                               if lo_bound < b < (bound or runtime.MAX_ROWS)}
    return tuple(sorted(bounds))


T_BOUNDS = t_bounds()  # the H200's


@dataclass(frozen=True)
class ForwardKey:
    out_features: int
    config: str | None = None  # None: PICKS["fwd"]'s for T


@dataclass(frozen=True)
class BackwardKey:
    out_features: int
    config: str | None = None  # the d_temb GEMM's; None: PICKS["dgrad"]'s for T
    fold_warps: bool | None = None  # None: wgrad_folds


KEYS = {Phase.FORWARD: ForwardKey, Phase.BACKWARD: BackwardKey}


def _row_range(device, rows: int) -> tuple[int, int]:
    if rows == 0:
        return 0, 0
    lo, hi = runtime.row_range(t_bounds(runtime.sm_count(device)), rows)
    return max(lo, 1), hi


def _silu_cast() -> Kernel:
    return Kernel.of("adaln_silu_cast", width=TEMB)


def build(phase: Phase, device, key, rows: int) -> P.Plan:
    """The launch plan of h3::adaln_projection's `phase` for T = `rows` and N = key.out_features (96768, or
    final_adaln_out's 10752): inputs temb, weight, bias forward; grad, temb, weight backward (dense, 16-byte
    aligned)."""
    n = key.out_features
    lo, hi = _row_range(device, rows)
    wgmma, sms = _uses_wgmma(device, key.config), runtime.sm_count(device)
    if phase is Phase.FORWARD:
        inputs, buffers, steps = ("temb", "weight", "bias"), [Buffer("out", BF16, (M, n))], []
        if rows:  # a zero-sized grid is not a valid launch
            config = key.config or config_for_rows(rows, wgmma, sms)
            proj = Kernel.of("adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd", out_features=n, config=config)
            buffers.append(Buffer("act", BF16, (M, TEMB)))  # bf16(silu(temb)), the GEMM's operand
            steps = [Launch(_silu_cast(), (view("temb"), view("act"))),
                     Launch(proj, (view("act"), view("weight"), view("bias"), view("out")))]
        return P.Plan(OP, phase, key, lo, hi, inputs, tuple(buffers), tuple(steps), (Output(view("out")),))
    inputs = ("grad", "temb", "weight")
    outputs = (Output(view("dtemb")), Output(view("dweight")), Output(view("dbias")))
    grads = [Buffer("dtemb", F32, (M, TEMB)), Buffer("dweight", BF16, (n, TEMB)), Buffer("dbias", BF16, (n,))]
    if rows == 0:
        return P.Plan(OP, phase, key, lo, hi, inputs, tuple(grads), (Fill(view("dweight"), 0.0),
                                                                     Fill(view("dbias"), 0.0)), outputs)
    wgrad_config = wgrad_config_for_rows(rows, wgmma, sms)
    folds = wgrad_folds(wgrad_config, wgmma) if key.fold_warps is None else key.fold_warps
    if folds and not wgrad_folds(wgrad_config, wgmma):
        raise ValueError(f"adaln_projection backward: the dW tile {wgrad_config!r} at T = {rows} has no fold warps")
    dgrad = Kernel.of("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", out_features=n,
                      config=key.config or dgrad_config_for_rows(rows, wgmma, sms))
    buffers = [Buffer("partial", F32, (DGRAD_SPLITS, M, TEMB)), grads[0], Buffer("act", BF16, (M, TEMB)),
               *grads[1:]]
    blocks = (DBIAS_BLOCKS, n)  # db's FP32 partials
    if folds:  # the dW kernel's fold warps fold d_temb and sum db's blocks; silu_cast makes its operand first
        buffers.append(Buffer("dbias_blocks", F32, blocks))
        steps = [Launch(_silu_cast(), (view("temb"), view("act"))),
                 Launch(dgrad, (view("grad"), view("weight"), view("partial"))),
                 Launch(Kernel.of("adaln_proj_wgrad_fold", out_features=n, config=wgrad_config),
                        (view("grad"), view("act"), view("dweight"), view("dbias"), view("partial"), view("temb"),
                         view("dtemb"), view("dbias_blocks")))]
        return P.Plan(OP, phase, key, lo, hi, inputs, tuple(buffers), tuple(steps), outputs)
    if wgmma:
        wgrad = Kernel.of("adaln_proj_wgrad_wgmma", out_features=n, wgmma=True, config=wgrad_config)
    else:
        wgrad = Kernel.of("adaln_proj_wgrad", out_features=n, config=wgrad_config)
    steps = [Launch(dgrad, (view("grad"), view("weight"), view("partial"))),
             # d_temb = the partials' in-order fold times silu'(temb); act = bf16(silu(temb)) for dW
             Launch(Kernel.of("adaln_dtemb_fold", width=TEMB), (view("partial"), view("temb"), view("dtemb"),
                                                               view("act"))),
             Launch(wgrad, (view("grad"), view("act"), view("dweight"), view("dbias")))]
    if not wgrad_writes_dbias(wgrad_config, rows):
        buffers.append(Buffer("dbias_partial", F32, blocks))
        steps.append(Launch(Kernel.of("adaln_bias_grad", out_features=n),
                            (view("grad"), view("dbias_partial"), view("dbias"))))
    return P.Plan(OP, phase, key, lo, hi, inputs, tuple(buffers), tuple(steps), outputs)


def dense16(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 16-byte aligned start (the kernels' 16-byte vector and TMA accesses), copied
    if it is not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def silu_bf16(temb: torch.Tensor) -> torch.Tensor:
    """(T, 2688) FP32 -> bf16(silu(temb)), SiLU in FP32: the GEMM's activation operand alone, as the plans' first
    step makes it (tests and the ncu probe feed it to single kernels)."""
    temb = dense16(temb)
    act = torch.empty(temb.shape, dtype=BF16, device=temb.device)
    runtime.kernel("adaln_silu_cast", temb.device, width=TEMB)(temb, act)
    return act


def _sweep_family(device) -> str:
    cuda = device is not None and torch.device(device).type == "cuda"
    wgmma = _uses_wgmma(torch.device(device), None) if cuda else SM90_FAMILY == "wgmma"
    return "wgmma" if wgmma else "warp"


def sweep_picks(device) -> tuple:
    """The forward configs `device`'s family ships as picks (`PICKS["fwd"]`), in T order: what `h3cute-bench sweep`
    checks a command-line config against."""
    return tuple(dict.fromkeys(c for _, c in PICKS["fwd"][_sweep_family(device)]))


def sweep_configs(device) -> dict:
    """`h3cute-bench sweep`'s configs: the forward candidates of the family `device` runs (the sm_90a family where
    no CUDA device is given), by name, the shipped picks first; `forward(config=name)` runs each."""
    family = _sweep_family(device)
    return {name: name for name in sweep_picks(device) + candidates("fwd", family)}


def sweep_config(text: str, device) -> tuple:
    """(name, config) of a config written on `h3cute-bench sweep`'s command line: a name or field overrides of one
    (`tma_wide:stages=4`, `parse_config`), with a forward GEMM in `device`'s family; compiled on demand."""
    config = parse_config(text)
    if "fwd" not in config.roles or config.family != _sweep_family(device):
        raise ValueError(f"adaln_projection: config {text!r} is no forward config of the {_sweep_family(device)} "
                         f"family (roles {config.roles}, family {config.family})")
    return text, text


def _check_config(fn: str, role: str, config: str | None) -> None:
    """An explicit config: a name, or `name:field=value,...` (`parse_config`), built for the `role` GEMM."""
    if config is None:
        return
    gemm = {"fwd": "forward", "dgrad": "d_temb"}[role]
    try:
        parsed = parse_config(config)
    except ValueError as e:
        raise ValueError(f"adaln_projection {fn}: {e}") from None
    if role not in parsed.roles:
        names = candidates(role, "warp") + candidates(role, "wgmma")
        raise ValueError(f"adaln_projection {fn}: config {config!r} has no {gemm} GEMM; one of {names}")


def forward(temb: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, config: str | None = None) -> torch.Tensor:
    """(T, 2688) FP32 temb, (N, 2688) BF16 weight, (N,) BF16 bias -> (T, N) BF16, N in {96768, 10752}."""
    _check_config("forward", "fwd", config)
    key = ForwardKey(weight.shape[0], config)
    inputs = (dense16(temb), dense16(weight), dense16(bias))
    return P.run(build, Phase.FORWARD, key, inputs, temb.shape[0], temb.shape[:-1], temb.device)[0]


def backward(grad: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, config: str | None = None,
             fold_warps: bool | None = None):
    """(T, N) BF16 grad -> (dtemb (T, 2688) FP32, dweight (N, 2688) BF16, dbias (N,) BF16). `config`, if
    given, is the d_temb GEMM's (dW's tile is picked from T). `fold_warps` (default `wgrad_folds`) runs the dW
    tile as `adaln_proj_wgrad_fold` or not (the same bits either way; tests and timing)."""
    _check_config("backward", "dgrad", config)
    key = BackwardKey(weight.shape[0], config, fold_warps)
    inputs = (dense16(grad), dense16(temb), dense16(weight))
    return P.run(build, Phase.BACKWARD, key, inputs, temb.shape[0], temb.shape[:-1], temb.device)


def native_plan(device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For the C++ impls (h3cute.native): the encoded plan of (phase, key (N,): the default picks) serving `rows`."""
    return P.native_plan(build, KEYS, device, phase, key, rows)
