"""Device script: time every launch of `timestep_mlp` forward and backward, one at a time.

Runs against the prebuilt bundle (never compiles):
    bash perf/device_run.sh python3 perf/mlp_kernels.py
For each T of SIZES, each step of the launcher's launch plans (`h3cute.launch.timestep_mlp.build`: the GEMMs, splits,
folds and bias column sums) is bound to buffers allocated once (`plan.bind`) and timed alone with CUDA events: median
of 50 samples after 10 warm-ups. The whole forward and backward
are also timed as one CUDA-graph replay (`graph`), which shows what launch overlap (PDL) buys over
the sum of the isolated steps (`sum`), and so is every config of `CONFIGS` (the tile ranking per T).
Phases: fwd / bwd, the mma.sync path (forced with wgmma=False); fwd_default, the launcher's own forward
(on sm_90a the weight-in-registers fc2 at T <= 16 and from L.WGMMA_MIN_ROWS); on sm_90a from WGMMA_TIMED_FROM
rows bwd_wgmma, the TF32-wgmma backward step by step and as a graph, and presplit, the former pre-split
fc2_dgrad (transposing split of w2, both operands from shared memory) for comparison; and on sm_90a, at every
T, the fc2 GEMMs per tile, pre-split (with the splits of h and w2) and with w2 split in registers.
Prints a table; writes `$H3CUTE_OUT/mlp_kernels.json`.
"""
from __future__ import annotations

import functools
import sys
import time

import torch

from h3cute import runtime
from h3cute.bench import timing
from h3cute.bench.report import write_device_json
from h3cute.bench.sweep import config_name
from h3cute.launch import plan as P
from h3cute.launch import timestep_mlp as L
from h3cute.launch.plan import Phase
from h3cute.widths import FREQ as F1, MLP_HIDDEN as HIDDEN, TEMB as D

SIZES = (1, 4, 64, 128, 256, 512, 2048)
# sm_90a: the wgmma path is timed from here, below and above WGMMA_MIN_ROWS (the threshold's evidence)
WGMMA_TIMED_FROM = 64
# Targets (issue): fwd kernel time <= 18.8 us at T <= 4 (1.25x the 15 us weight-read floor), fwd faster
# than cuBLAS FP32 everywhere and 2x at T = 2048; fwd+bwd 1.5x faster than cuBLAS (H200 this morning).
CUBLAS_US = {1: (58, 299), 4: (61, 341), 64: (169, 433), 256: (272, 705), 2048: (1773, 4694)}  # fwd, fwd+bwd
# (T = 512: no cuBLAS baseline measured; no target printed)
WARMUP, SAMPLES = 10, 50
# kernels/wgmma_tf32.GEMM_TILES (bn, bk, stages), copied: this script never imports the DSL (a CPU test
# keeps the two equal).
WGMMA_FC2_TILES = ((128, 32, 3), (128, 16, 6), (64, 32, 4))
WEIGHT_TILES = ((128, 32, 4), (16, 32, 10), (8, 32, 12))  # wgmma_tf32.WEIGHT_TILE + WEIGHT_SMALL_TILES


_median_us = timing.timer("cuda", WARMUP, SAMPLES)


def _graph_us(fn) -> float:
    fn()  # resolve every kernel before capture
    us, why = timing.graph_time(fn, "cuda", WARMUP, SAMPLES)
    if why:
        raise RuntimeError(why)
    return us


def _label(step) -> str:
    """A plan step's short name: its kernel and the static args that tell the launches apart."""
    if isinstance(step, P.Fill):
        return f"fill {step.target}"
    static = dict(step.kernel.static)
    if step.kernel.name == "tf32_split":  # which operand it splits
        return ("split^T " if static["transpose"] else "split ") + step.args[0].of
    name = step.kernel.name.removeprefix("timestep_mlp_").removeprefix("tf32x3_")
    shown = [str(static["role"])] if "role" in static else []
    shown += [f"{k}={v}" for k, v in static.items() if k in ("mode", "cols")]
    if name.startswith("wgmma_weight") and static.get("tile") != L.WEIGHT_FC1_TILE:
        shown.append(str(static["tile"]))
    return " ".join([name, *shown])


def _plan_steps(phase: str, plan_phase, key, inputs, num_rows: int, dev) -> list:
    """(phase, step name, zero-argument launch) for each step of the launcher's plan, on buffers allocated once."""
    plan, fns = P.plan_for(L.build, plan_phase, dev, key, num_rows)
    fn = dict(zip(plan.kernels(), fns))
    _, bound = P.bind(plan, inputs, num_rows, dev)
    return [(phase, _label(step), functools.partial(fn[step.kernel], *args) if isinstance(step, P.Launch)
             else functools.partial(args[0].fill_, step.value)) for step, args in bound]


def _steps(num_rows: int, dev):
    """(phase, step name, zero-argument launch) in launcher order (the launcher's plans, each step bound to buffers
    allocated once), the whole forward / backward per phase, and the config sweep's calls."""
    g = torch.Generator(device=dev).manual_seed(num_rows)
    x = torch.randn(num_rows, F1, generator=g, device=dev)
    grad = torch.randn(num_rows, D, generator=g, device=dev)
    w1 = torch.randn(HIDDEN, F1, generator=g, device=dev) * F1 ** -0.5
    b1 = torch.randn(HIDDEN, generator=g, device=dev) * 0.02
    w2 = torch.randn(D, HIDDEN, generator=g, device=dev) * HIDDEN ** -0.5
    b2 = torch.randn(D, generator=g, device=dev) * 0.02
    f32 = dict(dtype=torch.float32, device=dev)
    fwd_in, bwd_in = (x, w1, b1, w2, b2), (grad, x, w1, b1, w2)
    mma_sync = L.Key(wgmma=False)
    steps = (_plan_steps("fwd", Phase.FORWARD, mma_sync, fwd_in, num_rows, dev)
             + _plan_steps("bwd", Phase.BACKWARD, mma_sync, bwd_in, num_rows, dev))
    whole = {
        "fwd": lambda: L.forward(x, w1, b1, w2, b2, wgmma=False),
        "bwd": lambda: L.backward(grad, x, w1, b1, w2, wgmma=False),
        "fwd_default": lambda: L.forward(x, w1, b1, w2, b2),  # the launcher's own choice at this T
    }
    if L.forward_weight_tile(dev, num_rows) is not None:  # the default forward differs: fc2 on the weight GEMM
        steps += _plan_steps("fwd_default", Phase.FORWARD, L.Key(), fwd_in, num_rows, dev)
    configurable = {
        "fwd": lambda c: L.forward(x, w1, b1, w2, b2, config=c, wgmma=False),
        "bwd": lambda c: L.backward(grad, x, w1, b1, w2, config=c, wgmma=False),
    }
    if L.uses_wgmma(dev, num_rows) or (num_rows >= WGMMA_TIMED_FROM and L.uses_wgmma(dev, L.WGMMA_MIN_ROWS)):
        steps += _plan_steps("bwd_wgmma", Phase.BACKWARD, L.Key(wgmma=True), bwd_in, num_rows, dev)
        # the pre-split form of fc2_dgrad (transposing split of w2, then both operands from shared memory), timed
        # beside the launcher's steps for comparison (phase "presplit": not in the graphs; fc2's pre-split form is
        # timed per tile by _wgmma_fc2)
        split, split_t = (runtime.kernel("tf32_split", dev, transpose=t) for t in (False, True))
        k, splits = L.WGMMA_ROLES["fc2_dgrad"]
        presplit = runtime.kernel("tf32x3_wgmma_gemm", dev, k=k, splits=splits, tile=L.WGMMA_TILE)
        g2 = (torch.empty_like(grad), torch.empty_like(grad))
        split(grad, *g2)
        w2t_2 = tuple(torch.empty(HIDDEN, D, **f32) for _ in range(2))
        p_dh = torch.empty(L.SPLITS["fc2_dgrad"], num_rows, HIDDEN, **f32)
        steps += [
            ("presplit", "split w2^T", lambda: split_t(w2, *w2t_2)),
            ("presplit", "wgmma fc2_dgrad partials (pre-split)", lambda: presplit(*g2, *w2t_2, p_dh)),
        ]
        whole["bwd_wgmma"] = lambda: L.backward(grad, x, w1, b1, w2, wgmma=True)
    return steps, whole, configurable


def _wgmma_fc2(num_rows: int, dev) -> dict:
    """sm_90a: the TF32-wgmma fc2 (split h, split w2, GEMM per tile in wgmma_tf32.GEMM_TILES), timed alone."""
    f32 = dict(dtype=torch.float32, device=dev)
    h, w2 = torch.randn(num_rows, HIDDEN, **f32), torch.randn(D, HIDDEN, **f32) * HIDDEN ** -0.5
    h_parts, w2_parts = (torch.empty_like(h), torch.empty_like(h)), (torch.empty_like(w2), torch.empty_like(w2))
    p_fc2 = torch.empty(L.SPLITS["fc2"], num_rows, D, **f32)
    split = runtime.kernel("tf32_split", dev, transpose=False)
    out = {"split h": _safe(_median_us, lambda: split(h, *h_parts)),
           "split w2": _safe(_median_us, lambda: split(w2, *w2_parts))}
    for tile in WGMMA_FC2_TILES:
        gemm = runtime.kernel("tf32x3_wgmma_gemm", dev, k=HIDDEN, splits=L.SPLITS["fc2"], tile=tile)
        out[f"gemm {tile}"] = _safe(_median_us, lambda g=gemm: g(*h_parts, *w2_parts, p_fc2))
    # w2 split in registers, every built tile; fc2_dgrad alike (W = w2^T in place, X = grad split)
    grad = torch.randn(num_rows, D, **f32)
    g_parts = (torch.empty_like(grad), torch.empty_like(grad))
    split(grad, *g_parts)
    p_dh = torch.empty(L.SPLITS["fc2_dgrad"], num_rows, HIDDEN, **f32)
    for tile in WEIGHT_TILES:
        fc2 = runtime.kernel("tf32x3_wgmma_weight_gemm", dev, role="fc2", tile=tile)
        dgrad = runtime.kernel("tf32x3_wgmma_weight_gemm", dev, role="fc2_dgrad", tile=tile)
        out[f"weight fc2 {tile}"] = _safe(_median_us, lambda g=fc2: g(w2, *h_parts, p_fc2))
        out[f"weight fc2_dgrad {tile}"] = _safe(_median_us, lambda g=dgrad: g(L.transposed(w2), *g_parts, p_dh))
    return out


def _warm_up(dev, seconds: float = 1.0):
    """Keep the GPU busy for a while before the first timing, so that T = 1 (timed first) does not run on
    clocks still ramping up from idle."""
    a = torch.randn(4096, 4096, device=dev)
    end = time.time() + seconds
    while time.time() < end:
        for _ in range(20):
            a = (a @ a).tanh_()
        torch.cuda.synchronize(dev)


def _safe(timer, fn):
    """A timing in us, or the error as a string (one failing step must not hide the others)."""
    try:
        return timer(fn)
    except Exception as e:  # noqa: BLE001  (recorded in the report)
        torch.cuda.synchronize()
        return f"{type(e).__name__}: {e}"[:300]


def _fmt(us) -> str:
    return f"{us:9.1f} us" if isinstance(us, float) else f"FAILED {us}"


def _config_name(cfg) -> str:
    """SMALL_T / WIDE_T / ... : the launcher's module-level name of a config."""
    return config_name(L, cfg)


def main() -> int:
    if not torch.cuda.is_available():
        print("mlp_kernels: needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", 0)
    _warm_up(dev)
    t0 = time.time()
    report = {"gpu": torch.cuda.get_device_name(dev), "samples": SAMPLES, "warmup": WARMUP, "sizes": {}}
    for num_rows in SIZES:
        steps, whole, configurable = _steps(num_rows, dev)
        cfg = L.pick_config(num_rows)
        rows = [{"phase": phase, "step": name, "us": _safe(_median_us, fn)} for phase, name, fn in steps]
        totals = {}
        for phase, fn in whole.items():
            timed = [r["us"] for r in rows if r["phase"] == phase and isinstance(r["us"], float)]
            totals[phase] = {"sum_us": float(sum(timed)), "graph_us": _safe(_graph_us, fn)}
        sweep = {name: {phase: _safe(_graph_us, lambda fn=fn, c=c: fn(c)) for phase, fn in configurable.items()}
                 for name, c in ((_config_name(c), c) for c in L.CONFIGS)}
        report["sizes"][str(num_rows)] = {"config": repr(cfg), "steps": rows, "totals": totals,
                                          "config_sweep_graph_us": sweep}
        print(f"\nT = {num_rows}  {_config_name(cfg)}")
        for r in rows:
            print(f"  {r['phase']:<11}  {r['step']:<36} {_fmt(r['us'])}")
        if torch.cuda.get_device_capability(dev)[0] == 9:
            wgmma = _safe(lambda fn: fn(), lambda: _wgmma_fc2(num_rows, dev))
            report["sizes"][str(num_rows)]["wgmma_fc2_us"] = wgmma
            for name, us in (wgmma.items() if isinstance(wgmma, dict) else [("all", wgmma)]):
                print(f"  fwd  wgmma fc2 {name:<20} {_fmt(us)}")
        for phase, t in totals.items():
            print(f"  {phase:<11}  {'sum / graph':<36} {_fmt(t['sum_us'])} / {_fmt(t['graph_us'])}")
        for name, t in sweep.items():
            print(f"  config {name:<18} graph fwd {_fmt(t['fwd'])}  bwd {_fmt(t['bwd'])}")
        path = "_wgmma" if L.uses_wgmma(dev, num_rows) else ""  # the launcher's default backward at this T
        fwd, bwd = totals["fwd_default"]["graph_us"], totals["bwd" + path]["graph_us"]
        if num_rows in CUBLAS_US and isinstance(fwd, float) and isinstance(bwd, float):
            fwd_target = min(CUBLAS_US[num_rows][0] / (2 if num_rows == 2048 else 1), 18.8 if num_rows <= 4 else 1e9)
            both_target = CUBLAS_US[num_rows][1] / 1.5
            report["sizes"][str(num_rows)]["targets_us"] = {"fwd": fwd_target, "fwd_bwd": both_target}
            print(f"  target (default fwd, {'wgmma' if path else 'mma.sync'} bwd) fwd {fwd:.1f} / {fwd_target:.1f} us"
                  f" {'ok' if fwd <= fwd_target else 'MISS'};"
                  f" fwd+bwd {fwd + bwd:.1f} / {both_target:.1f} us {'ok' if fwd + bwd <= both_target else 'MISS'}")
        del steps, whole, configurable
        torch.cuda.empty_cache()
    report["wall_s"] = time.time() - t0
    print(f"\nmlp_kernels: {report['wall_s']:.1f} s -> {write_device_json(report, 'mlp_kernels.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
