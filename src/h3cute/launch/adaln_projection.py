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

import torch

from h3cute import runtime
from h3cute.kernels._adaln_configs import (ADALN_GEMM_CONFIGS, DBIAS_CHAIN_ROWS, DBIAS_ROW_BLOCK,  # noqa: F401
                                          DGRAD_MODEL_ROWS, DGRAD_ROUNDS, DGRAD_SPLITS, FUSED_DBIAS_ROWS, H200_SMS,
                                          PICKS, RoundsPick, candidates, dgrad_round_columns, parse_config, pick)
from h3cute.widths import BLOCK_PROJECTION, TEMB

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


def dbias_blocks(rows: int) -> int:
    """`adaln_bias_grad`'s partial rows for T rows: one per DBIAS_ROW_BLOCK block (the kernel reads the count off
    its partial tensor; the C++ layer computes it the same way)."""
    return -(-rows // DBIAS_ROW_BLOCK)


def _uses_wgmma(device, config: str | None) -> bool:
    if config is not None:
        return parse_config(config).family == "wgmma"
    return SM90_FAMILY == "wgmma" and runtime.arch_of(device) == "sm_90a"


@functools.cache
def t_bounds(sms: int = H200_SMS) -> tuple:
    """Where a launch choice of the C++ impls (h3cute.native) changes with T on a GPU of `sms` SMs: every pick
    table's bounds (the configs, whether dW writes db or folds), the ends of the `RoundsPick` ranges, and
    FUSED_DBIAS_ROWS."""
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


def _choices(device, rows: int, backward: bool) -> tuple:
    wgmma = _uses_wgmma(device, None)
    sms = runtime.sm_count(device)
    if not backward:
        return wgmma, config_for_rows(rows, wgmma, sms)
    wgrad = wgrad_config_for_rows(rows, wgmma, sms)
    return wgmma, dgrad_config_for_rows(rows, wgmma, sms), wgrad, not wgrad_writes_dbias(wgrad, rows)


FOLD_WARPS_LAUNCH = -1  # kernel_handles' launch constant for the fold-warp backward (h3cute.native.constants)


def kernel_handles(device: int, backward: int, num_rows: int):
    """For the C++ impls (h3cute.native), N = 96768: the T range sharing every launch choice and the C handles
    of `forward`'s kernels (`adaln_silu_cast`, the projection GEMM) or `backward`'s (the d_temb GEMM,
    `adaln_dtemb_fold`, the dW GEMM, then `adaln_bias_grad` where the dW GEMM does not write db; where the dW GEMM's
    fold warps fold d_temb and sum db (`wgrad_folds`): `adaln_silu_cast`, the d_temb GEMM, `adaln_proj_wgrad_fold`)
    with one launch constant: db's row block (DBIAS_ROW_BLOCK) where adaln_bias_grad runs, 0 where the dW GEMM writes
    db, FOLD_WARPS_LAUNCH where its fold warps do both."""
    dev = torch.device("cuda", device)
    lo, hi = runtime.row_range(t_bounds(runtime.sm_count(dev)), num_rows)
    choices = _choices(dev, num_rows, bool(backward))
    assert _choices(dev, max(lo, 1), bool(backward)) == choices == _choices(dev, hi, bool(backward)), "stale T_BOUNDS"
    n = BLOCK_PROJECTION
    if not backward:
        wgmma, config = choices
        proj = "adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd"
        fns = [runtime.kernel("adaln_silu_cast", dev, width=TEMB),
               runtime.kernel(proj, dev, out_features=n, config=config)]
        return lo, hi, [fn.__chandle__() for fn in fns]
    wgmma, dgrad, wgrad, unfused_dbias = choices
    if wgrad_folds(wgrad, wgmma):
        fns = [runtime.kernel("adaln_silu_cast", dev, width=TEMB),
               runtime.kernel("adaln_proj_dgrad_wgmma", dev, out_features=n, config=dgrad),
               runtime.kernel("adaln_proj_wgrad_fold", dev, out_features=n, config=wgrad)]
        return lo, hi, [fn.__chandle__() for fn in fns], [FOLD_WARPS_LAUNCH]
    fns = [runtime.kernel("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", dev, out_features=n, config=dgrad),
           runtime.kernel("adaln_dtemb_fold", dev, width=TEMB),
           runtime.kernel("adaln_proj_wgrad_wgmma", dev, out_features=n, wgmma=True, config=wgrad) if wgmma
           else runtime.kernel("adaln_proj_wgrad", dev, out_features=n, config=wgrad)]
    if unfused_dbias:
        fns.append(runtime.kernel("adaln_bias_grad", dev, out_features=n))
    return lo, hi, [fn.__chandle__() for fn in fns], [DBIAS_ROW_BLOCK if unfused_dbias else 0]


def dense16(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous with a 16-byte aligned start (the kernels' 16-byte vector and TMA accesses), copied
    if it is not."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def silu_bf16(temb: torch.Tensor) -> torch.Tensor:
    """(T, 2688) FP32 -> bf16(silu(temb)), SiLU in FP32 (the GEMM's activation operand)."""
    temb = dense16(temb)
    act = torch.empty(temb.shape, dtype=torch.bfloat16, device=temb.device)
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
    rows, out_features = temb.shape[0], weight.shape[0]
    out = torch.empty((rows, out_features), dtype=torch.bfloat16, device=temb.device)
    if rows == 0:  # a zero-sized grid is not a valid launch
        return out
    act = silu_bf16(temb)
    wgmma = _uses_wgmma(temb.device, config)
    fn = runtime.kernel("adaln_proj_fwd_wgmma" if wgmma else "adaln_proj_fwd", temb.device,
                        out_features=out_features,
                        config=config or config_for_rows(rows, wgmma, runtime.sm_count(temb.device)))
    fn(act, dense16(weight), dense16(bias), out)
    return out


def backward(grad: torch.Tensor, temb: torch.Tensor, weight: torch.Tensor, config: str | None = None,
             fold_warps: bool | None = None):
    """(T, N) BF16 grad -> (dtemb (T, 2688) FP32, dweight (N, 2688) BF16, dbias (N,) BF16). `config`, if
    given, is the d_temb GEMM's (dW's tile is picked from T). `fold_warps` (default `wgrad_folds`) runs the dW
    tile as `adaln_proj_wgrad_fold` or not (the same bits either way; tests and timing)."""
    _check_config("backward", "dgrad", config)
    rows, out_features = temb.shape[0], weight.shape[0]
    device = temb.device
    if rows == 0:
        return temb.new_empty((0, TEMB)), torch.zeros_like(weight), weight.new_zeros((out_features,))
    grad, temb, weight = dense16(grad), dense16(temb), dense16(weight)
    wgmma = _uses_wgmma(device, config)
    sms = runtime.sm_count(device)
    wgrad_config = wgrad_config_for_rows(rows, wgmma, sms)
    folds = wgrad_folds(wgrad_config, wgmma) if fold_warps is None else fold_warps
    if folds and not wgrad_folds(wgrad_config, wgmma):
        raise ValueError(f"adaln_projection backward: the dW tile {wgrad_config!r} at T = {rows} has no fold warps")
    act = silu_bf16(temb) if folds else torch.empty((rows, TEMB), dtype=torch.bfloat16, device=device)
    partial = torch.empty((DGRAD_SPLITS, rows, TEMB), dtype=torch.float32, device=device)
    runtime.kernel("adaln_proj_dgrad_wgmma" if wgmma else "adaln_proj_dgrad", device, out_features=out_features,
                   config=config or dgrad_config_for_rows(rows, wgmma, sms))(grad, weight, partial)
    dtemb = torch.empty((rows, TEMB), dtype=torch.float32, device=device)
    dweight = torch.empty_like(weight)
    dbias = torch.empty((out_features,), dtype=torch.bfloat16, device=device)
    if folds:
        blocks = torch.empty((dbias_blocks(rows), out_features), dtype=torch.float32, device=device)
        runtime.kernel("adaln_proj_wgrad_fold", device, out_features=out_features, config=wgrad_config)(
            grad, act, dweight, dbias, partial, temb, dtemb, blocks)
        return dtemb, dweight, dbias
    runtime.kernel("adaln_dtemb_fold", device, width=TEMB)(partial, temb, dtemb, act)  # act = bf16(silu(temb))
    if wgmma:
        wgrad = runtime.kernel("adaln_proj_wgrad_wgmma", device, out_features=out_features, wgmma=True,
                               config=wgrad_config)
    else:
        wgrad = runtime.kernel("adaln_proj_wgrad", device, out_features=out_features, config=wgrad_config)
    wgrad(grad, act, dweight, dbias)
    if not wgrad_writes_dbias(wgrad_config, rows):
        bias_partial = torch.empty((dbias_blocks(rows), out_features), dtype=torch.float32, device=device)
        runtime.kernel("adaln_bias_grad", device, out_features=out_features)(grad, bias_partial, dbias)
    return dtemb, dweight, dbias
