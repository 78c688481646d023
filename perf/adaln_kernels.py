"""Device script: time every kernel launch of `adaln_projection` forward and backward, one at a time.

Runs against the prebuilt bundle (never compiles):
    bash perf/device_run.sh python3 perf/adaln_kernels.py [T ...] [--family wgmma] [--rounds 3] [--out-features N]
For T in (1, 4, 64, 256, 2048) and each MMA family (warp mma.sync; wgmma on sm_90a), each launch of
`h3cute.launch.adaln_projection.forward` / `backward` (N = 96768, or the final AdaLN's 10752 with `--out-features`:
the same grids at a ninth of the K work per d_temb unit) is replayed on preallocated buffers
and timed alone with CUDA events: median of 20 samples after 5 warm-ups, with achieved GB/s (bytes
the launch must move at least) and TFLOP/s. The GEMMs are timed for the family's `config_for_rows`
choice and for every other config of the family (rows marked `alt`), so `config_for_rows` can be
retuned from this. The whole forward / backward are timed too (`op`). A kernel missing from the bundle
is recorded as missing. `--rounds R` times the whole step list R times over, round-robin, and reports each
launch's median of the R round medians with their range: one kernel's time on the lent H200 moved by up to ~10%
between runs, so a pick should rest on a margin wider than the range. Prints a table; writes
`$H3CUTE_OUT/adaln_kernels.json`. The steps are the launcher's launch plans' (`adaln_projection.build`), each bound to
buffers allocated once (`plan.bind`).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from h3cute import runtime
from h3cute.bench import timing
from h3cute.bench.report import write_device_json
from h3cute.launch import adaln_projection as L
from h3cute.launch import plan as P
from h3cute.launch.plan import Phase
from h3cute.widths import BLOCK_PROJECTION, FINAL_PROJECTION, TEMB

SIZES = (1, 4, 64, 256, 2048)
WARMUP, SAMPLES = 5, 20
D, N = TEMB, BLOCK_PROJECTION
BF16, F32 = 2, 4


_median_us = timing.timer("cuda", WARMUP, SAMPLES)


def _kernel(name, dev, **static):
    try:
        return runtime.kernel(name, dev, **static)
    except Exception as exc:  # not in this bundle (older build, other arch): recorded, not fatal
        return exc


def _cost(step: str, rows: int) -> tuple[int, int]:
    """(bytes the launch must move at least, FLOPs) of a step at T rows."""
    w_bytes, gemm_flops = N * D * BF16, 2 * rows * N * D
    fold_bytes = (L.DGRAD_SPLITS + 2) * rows * D * F32
    wgrad_bytes = rows * (N + D) * BF16 + w_bytes
    return {"silu_cast": (rows * D * (F32 + BF16), 0),
            "proj_fwd": (w_bytes + rows * D * BF16 + N * BF16 + rows * N * BF16, gemm_flops),
            "proj_dgrad": (w_bytes + rows * N * BF16 + L.DGRAD_SPLITS * rows * D * F32, gemm_flops),
            "dtemb_fold": (fold_bytes + rows * D * BF16, 0),
            "proj_wgrad": (wgrad_bytes, gemm_flops),
            "proj_wgrad_fold": (wgrad_bytes + fold_bytes, gemm_flops),
            "bias_grad": (rows * N * BF16 + 2 * L.dbias_blocks(rows) * N * F32 + N * BF16, 0)}[step]


def _steps(rows: int, family: str, buf: dict, dev):
    """(phase, step, config or "", kind, bytes, flops, launch, args) for one T and one family: the launches of the
    projection's launch plans (`adaln_projection.build` with the family's picks) bound to buffers allocated once
    (kind "step"), each GEMM's other configs of the family on the same arguments, and the kernels the plans leave
    out at this T (kind "alt")."""
    wgmma = family == "wgmma"
    sms = runtime.sm_count(dev)  # the picks that model rounds of CTAs read the device's SMs, as the op does
    # The family's picks, given as configs: the device's own family runs these plans as the op does.
    keys = {Phase.FORWARD: L.ForwardKey(N, L.config_for_rows(rows, wgmma, sms)),
            Phase.BACKWARD: L.BackwardKey(N, L.dgrad_config_for_rows(rows, wgmma, sms))}
    inputs = {Phase.FORWARD: (buf["temb"], buf["w"], buf["b"]), Phase.BACKWARD: (buf["grad"], buf["temb"], buf["w"])}
    roles = {"proj_fwd": "fwd", "proj_dgrad": "dgrad", "proj_wgrad": "wgrad", "proj_wgrad_fold": "wgrad_fold"}
    steps, env = [], {}
    for phase, key in keys.items():
        plan = L.build(phase, dev, key, rows)
        bound_env, bound = P.bind(plan, inputs[phase], rows, dev)
        env.update(bound_env)
        tag = "fwd" if phase is Phase.FORWARD else "bwd"
        for step, args in bound:
            static = dict(step.kernel.static)
            name = step.kernel.name.removeprefix("adaln_").removesuffix("_wgmma")
            chosen, kernel = static.get("config", ""), _kernel(step.kernel.name, dev, **static)
            steps.append((tag, name, chosen, "step", *_cost(name, rows), kernel, args))
            for c in L.candidates(roles[name], family) if name in roles else ():
                if c != chosen:
                    steps.append((tag, name, c, "alt", *_cost(name, rows),
                                  _kernel(step.kernel.name, dev, **{**static, "config": c}), args))
    # The kernels the backward's plan leaves out at this T, timed for comparison on its buffers: d_temb's fold and
    # the plain dW where the dW kernel's fold warps do the fold, the fold-warp dW where it does not, adaln_bias_grad
    # where dW writes db.
    ran = {s[1] for s in steps if s[3] == "step"}
    temb, grad, partial, dtemb, act, dw, db = (env[k] for k in ("temb", "grad", "partial", "dtemb", "act", "dweight",
                                                                "dbias"))
    blocks = env.get("dbias_blocks", env.get("dbias_partial"))
    if blocks is None:
        blocks = torch.empty(L.dbias_blocks(rows), N, device=dev)
    left_out = []
    if "dtemb_fold" not in ran:
        left_out.append(("dtemb_fold", "", "adaln_dtemb_fold", dict(width=D), (partial, temb, dtemb, act)))
    if "proj_wgrad" not in ran:
        for c in L.candidates("wgrad", family):
            static = dict(out_features=N, wgmma=True, config=c) if wgmma else dict(out_features=N, config=c)
            left_out.append(("proj_wgrad", c, "adaln_proj_wgrad" + ("_wgmma" if wgmma else ""), static,
                             (grad, act, dw, db)))
    if wgmma and "proj_wgrad_fold" not in ran:
        for c in L.candidates("wgrad_fold", "wgmma"):
            left_out.append(("proj_wgrad_fold", c, "adaln_proj_wgrad_fold", dict(out_features=N, config=c),
                             (grad, act, dw, db, partial, temb, dtemb, blocks)))
    if "bias_grad" not in ran:
        left_out.append(("bias_grad", "", "adaln_bias_grad", dict(out_features=N), (grad, blocks, db)))
    for name, config, kernel, static, args in left_out:
        steps.append(("bwd", name, config, "alt", *_cost(name, rows), _kernel(kernel, dev, **static), args))
    return steps


def _time_rounds(steps, measure, rounds: int) -> list:
    """One record per step: `measure` (a timer: callable -> us) of each launch in `rounds` passes over the whole
    list, so a slow spell of the GPU hits every config alike; `us` is the median of the passes, `us_min` /
    `us_max` their range. A step whose kernel is missing (an exception in place of the function) is recorded so."""
    times = [[] for _ in steps]
    for _ in range(rounds):
        for i, (*_, fn, args) in enumerate(steps):
            if not isinstance(fn, Exception):
                times[i].append(measure(lambda: fn(*args)))
    records = []
    for (phase, step, config, kind, nbytes, flops, fn, _), ts in zip(steps, times):
        rec = {"phase": phase, "step": step, "config": config, "kind": kind}
        if isinstance(fn, Exception):
            rec["missing"] = f"{type(fn).__name__}: {fn}"[:200]
        else:
            us = statistics.median(ts)
            rec.update(us=us, us_min=min(ts), us_max=max(ts), rounds=len(ts), gbps=nbytes / us * 1e-3,
                       tflops=flops / us * 1e-6)
        records.append(rec)
    return records


def _args(argv):
    parser = argparse.ArgumentParser(prog="adaln_kernels", description=__doc__.split("\n")[0])
    parser.add_argument("sizes", nargs="*", type=int, help=f"T values (default {' '.join(map(str, SIZES))})")
    parser.add_argument("--family", choices=("warp", "wgmma"), action="append",
                        help="time only this MMA family (repeatable; default every family the device runs)")
    parser.add_argument("--rounds", type=int, default=1, help="passes over the step list (median and range)")
    parser.add_argument("--out-features", type=int, choices=(BLOCK_PROJECTION, FINAL_PROJECTION),
                        default=BLOCK_PROJECTION,
                        help="N: the block table (default) or the final AdaLN's")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    return args


def _buffers(rows: int, dev):
    """The ops' inputs at T rows (the plans' buffers are allocated by `_steps`)."""
    g = torch.Generator(device=dev).manual_seed(rows)
    return {
        "w": (torch.randn(N, D, generator=g, device=dev) * D ** -0.5).bfloat16(),
        "b": (torch.randn(N, generator=g, device=dev) * 0.02).bfloat16(),
        "temb": torch.randn(rows, D, generator=g, device=dev),
        "grad": torch.randn(rows, N, generator=g, device=dev).bfloat16(),
    }


def main(argv) -> int:
    global N
    args = _args(argv)
    N = args.out_features
    if not torch.cuda.is_available():
        print("adaln_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    t0 = time.time()
    families = ["warp"] + (["wgmma"] if runtime.arch_of(dev) == "sm_90a" else [])
    families = [f for f in families if not args.family or f in args.family]
    default_family = L.SM90_FAMILY if runtime.arch_of(dev) == "sm_90a" else "warp"
    report = {"gpu": torch.cuda.get_device_name(dev), "arch": runtime.arch_of(dev), "samples": SAMPLES,
              "warmup": WARMUP, "rounds": args.rounds, "out_features": N, "sm90_family": L.SM90_FAMILY,
              "sizes": {}}
    for rows in args.sizes or SIZES:
        buf = _buffers(rows, dev)
        report["sizes"][str(rows)] = per_family = {}
        for family in families:
            records = _time_rounds(_steps(rows, family, buf, dev), _median_us, args.rounds)
            config = L.config_for_rows(rows, family == "wgmma", runtime.sm_count(dev))
            # The device's own family runs as the op does (config=None: per-GEMM configs); the other
            # family only through an explicit config (the forward's, for its dgrad too).
            op_config = None if family == default_family else config
            ops = {}
            try:
                ops["fwd"] = _median_us(lambda: L.forward(buf["temb"], buf["w"], buf["b"], config=op_config))
                ops["bwd"] = _median_us(lambda: L.backward(buf["grad"], buf["temb"], buf["w"], config=op_config))
                wgrad = L.wgrad_config_for_rows(rows, family == "wgmma", runtime.sm_count(dev))
                if op_config is None and L.wgrad_folds(wgrad, family == "wgmma"):
                    ops["bwd_without_fold_warps"] = _median_us(
                        lambda: L.backward(buf["grad"], buf["temb"], buf["w"], fold_warps=False))
            except Exception as exc:  # a missing kernel: the steps above say which
                ops["error"] = f"{type(exc).__name__}: {exc}"[:200]
            for phase in ("fwd", "bwd"):
                ops[phase + "_sum_of_steps"] = sum(r.get("us", 0.0) for r in records
                                                   if r["phase"] == phase and r["kind"] == "step")
            per_family[family] = {"config": config, "steps": records, "op_us": ops}
            print(f"\nT = {rows}  {family} ({config})")
            for r in records:
                name = f"{r['phase']} {r['step']}" + (f" [{r['config']}]" if r["config"] else "")
                if "missing" in r:
                    print(f"  {r['kind']:<4} {name:<34} missing")
                else:
                    spread = f" ({r['us_min']:.1f}-{r['us_max']:.1f})" if r["rounds"] > 1 else ""
                    print(f"  {r['kind']:<4} {name:<34} {r['us']:9.1f} us{spread} {r['gbps']:7.0f} GB/s "
                          f"{r['tflops']:6.1f} TFLOP/s")
            print("  op   " + "  ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in ops.items()))
        buf = None  # frees this size's buffers (the timed lambdas refer to the name) before the next size's
        torch.cuda.empty_cache()
    # The fastest config of each GEMM per T and family: what config_for_rows / wgrad_config_for_rows
    # should pick (every config of a family gives the same bits).
    report["fastest"] = fastest = {}
    for rows, per_family in report["sizes"].items():
        for family, rec in per_family.items():
            for phase, step in {(r["phase"], r["step"]) for r in rec["steps"] if r["config"] and "us" in r}:
                timed = [r for r in rec["steps"] if (r["phase"], r["step"]) == (phase, step) and "us" in r]
                best = min(timed, key=lambda r: r["us"])
                chosen = next((r for r in timed if r["kind"] == "step"), best)
                fastest[f"T={rows} {family} {phase} {step}"] = {"fastest": best["config"], "us": best["us"],
                                                               "chosen": chosen["config"], "chosen_us": chosen["us"]}
    print("\nfastest config per GEMM (chosen -> fastest):")
    for key, v in fastest.items():
        print(f"  {key:<32} {v['chosen']} {v['chosen_us']:.1f} -> {v['fastest']} {v['us']:.1f} us")
    report["wall_s"] = time.time() - t0
    print(f"\nadaln_kernels: {report['wall_s']:.1f} s -> {write_device_json(report, 'adaln_kernels.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
