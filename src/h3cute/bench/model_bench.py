"""`h3cute-bench model`: diffusers' MiniMax-H3 model with `h3cute.patch` against the same model unpatched.

One model (`bench.model.build_model`, H3's real widths and 2 blocks by default) is timed unpatched and patched
(`Patch.unpatch()` restores it exactly between the two), eager and under `torch.compile` (one compiled module for
both: the patch is part of its guards), for every sequence length S and batch B asked for, forward (`no_grad`,
as a rollout runs it) and forward+backward (fixed upstream gradients on the video and audio outputs, as a training
step runs it). A configuration's time is the median of samples from `timing.timer` (CUDA events around each call;
wall time on a CPU) after warm-up calls (the first compiled call compiles); the number of samples fits a few
seconds of calls.

The conditioning path's share (eager only: Inductor fuses the conditioning ops with their neighbours, so a
compiled model has no boundary to time them at) comes from events at its call sites' module boundaries, one
instrumented call after the timed ones: forward, time_proj + time_embedder + norm_out + per block (block - attn
- ff), each the interval between the events recorded at the module's entry and exit; backward, the same sites
between the tensor hooks of the module's output gradient (its backward starts) and its input gradient (its
backward is done; time_embedder: linear_1.weight's accumulated gradient). Sites' intervals may nest (the
autograd engine can run time_embedder's backward inside block 0's), so the conditioning time is the length of a
union: the sites' intervals, less the attn and ff intervals. The share divides it by the same call's whole
interval.

A run writes its JSON after every configuration; `--resume` skips the configurations its JSON already holds,
and `--budget-s` stops starting new ones past that many seconds, so a run that must fit a fixed device call
continues where the last one stopped. JSON, markdown and a PNG (matplotlib, optional) go to `--out`'s stem.
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

from h3cute import invariant
from h3cute.bench import report, timing
from h3cute.bench.model import H3_TWO_BLOCKS, TINY, ModelSize, build_model, packed_inputs

KIND = "h3_model_bench"
# unpatched: diffusers; patched: h3cute.patch (scope="conditioning"); model: h3cute.patch(scope="model"), whose BF16
# linears need vLLM's cuBLASLt settings in the process environment (h3cute.invariant), so it runs in a process of
# its own: `--variants model --resume` on the report of a run without them.
VARIANTS = ("unpatched", "patched", "model")
# eager; compile: torch.compile(backend); cudagraphs: torch.compile(mode="reduce-overhead"), the rollout's forward only
MODES = ("eager", "compile", "cudagraphs")


@dataclass(frozen=True)
class Plan:
    size: ModelSize = H3_TWO_BLOCKS
    sizes: tuple[int, ...] = (4097, 32768)        # S, packed rows per replica
    batches: tuple[int, ...] = (1, 4)             # B
    modes: tuple[str, ...] = ("eager", "compile")
    phases: tuple[str, ...] = ("fwd", "fwd_bwd")
    timesteps: int = 3
    backend: str = "inductor"
    warmup: int = 1                               # compiled configurations get one more (the compiling call)
    min_samples: int = 3
    max_samples: int = 20
    target_s: float = 2.0                         # seconds of timed calls per configuration and variant
    share: bool = True
    variants: tuple[str, ...] = ("unpatched", "patched")


# Smoke scale on a CPU (CI): one block, a 48-row sequence, B = 2, aot_eager instead of Inductor; not a measurement.
QUICK = Plan(size=replace(TINY, layers=1), sizes=(48,), batches=(2,), backend="aot_eager", warmup=0, min_samples=1,
             max_samples=1, target_s=0.0)


def layout(rows: int) -> dict:
    """Video, text and audio rows of a packed sequence of `rows`: 1/16 text, 1/8 audio (at least 8 each)."""
    text = max(8, rows // 16)
    audio = max(8, rows // 8)
    return {"video": rows - text - audio, "text": text, "audio": audio}


# ---- conditioning-path events ----------------------------------------------------------------------------

class SiteTimer:
    """Events at the conditioning call sites' module boundaries (see the module docstring); `active` gates them."""

    def __init__(self, model, device):
        self.device, self.active, self.marks, self.handles = device, False, [], []
        self._site(model.time_proj, "time_proj")
        self._site(model.time_embedder, "time_embedder", end_param=model.time_embedder.linear_1.weight)
        for i, block in enumerate(model.transformer_blocks):
            self._site(block, f"block{i}")
            self._site(block.attn, f"block{i}.attn")
            self._site(block.ff, f"block{i}.ff")
        self._site(model.norm_out, "norm_out")

    def mark(self, key):
        if not self.active:
            return
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append((key, event))
        else:
            self.marks.append((key, time.perf_counter()))

    def _site(self, module, name, end_param=None):
        def pre(mod, args):
            self.mark(("fwd", name, "start"))

        def post(mod, args, out):
            self.mark(("fwd", name, "end"))
            if self.active and torch.is_tensor(out) and out.requires_grad:
                out.register_hook(lambda g: self.mark(("bwd", name, "start")))
                x = next((a for a in args if torch.is_tensor(a) and a.requires_grad), None)
                if x is not None:
                    x.register_hook(lambda g: self.mark(("bwd", name, "end")))

        self.handles += [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]
        if end_param is not None:
            self.handles.append(end_param.register_post_accumulate_grad_hook(
                lambda p: self.mark(("bwd", name, "end"))))

    def intervals_ms(self) -> dict:
        """{(phase, site): (start, end)} in ms from the first mark, of the marks since the last call (first start
        to last end of each site)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if not self.marks:
            return {}
        origin = self.marks[0][1]

        def ms(stamp):
            return origin.elapsed_time(stamp) if self.device.type == "cuda" else (stamp - origin) * 1e3

        first, last = {}, {}
        for (phase, site, edge), stamp in self.marks:
            if edge == "start":
                first.setdefault((phase, site), ms(stamp))
            else:
                last[(phase, site)] = ms(stamp)
        self.marks = []
        return {key: (start, last[key]) for key, start in first.items() if key in last}

    def close(self):
        for h in self.handles:
            h.remove()


def _union(intervals) -> list[tuple[float, float]]:
    """Disjoint, sorted intervals covering the same instants as `intervals`."""
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def conditioning_ms(iv: dict, phase: str, blocks: int) -> float | None:
    """The conditioning path's ms of one call from SiteTimer intervals: the length of the union of its sites'
    intervals less the union of the blocks' attn and ff intervals (None when a boundary is missing)."""
    sites = ["time_embedder", "norm_out"] + (["time_proj"] if phase == "fwd" else [])
    sites += [f"block{i}" for i in range(blocks)]
    inner = [f"block{i}.{part}" for i in range(blocks) for part in ("attn", "ff")]
    try:
        keep = _union(iv[(phase, s)] for s in sites)
        drop = _union(iv[(phase, s)] for s in inner)
    except KeyError:
        return None
    total = 0.0
    for start, end in keep:
        total += end - start
        for d0, d1 in drop:
            total -= max(0.0, min(end, d1) - max(start, d0))
    return total


# ---- one configuration ---------------------------------------------------------------------------------

def _call(fn, inputs, phase, upstream, cudagraphs=False):
    if cudagraphs:  # a new step for CUDA-graph trees: the previous replay's outputs are no longer read
        torch.compiler.cudagraph_mark_step_begin()
    if phase == "fwd":
        with torch.no_grad():
            fn(**inputs)
        return
    out = fn(**inputs)
    torch.autograd.backward([out.sample, out.audio_sample], upstream)


def measure(model, fn, inputs, phase, plan: Plan, device, compiled: bool, cudagraphs: bool = False) -> dict:
    """One variant of one configuration: the median time, and (eager, `plan.share`) the conditioning share."""
    share = plan.share and not compiled
    upstream = None
    if phase == "fwd_bwd":  # the outputs have the video / audio inputs' shapes, FP32 (proj_out is an FP32 module)
        g = torch.Generator(device=device).manual_seed(9)
        upstream = [torch.randn(inputs[k].shape, generator=g, device=device)
                    for k in ("hidden_states", "audio_hidden_states")]

    def call():
        if phase == "fwd_bwd":
            model.zero_grad(set_to_none=True)
        _call(fn, inputs, phase, upstream, cudagraphs)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(plan.warmup + (1 if compiled else 0) + (1 if cudagraphs else 0)):  # + the recording call
        call()
    entry = {}
    if plan.max_samples > 1 or not share:
        first_ms = timing.timer(device, 0, 1)(call) / 1e3  # also the per-call estimate
        samples = min(plan.max_samples, max(plan.min_samples, int(plan.target_s * 1e3 / max(first_ms, 1e-3))))
        ms = timing.timer(device, 0, samples)(call) / 1e3 if samples > 1 else first_ms
        entry = {"ms": ms, "samples": samples, "first_ms": first_ms}
    if device.type == "cuda":
        entry["max_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2 ** 30
    if share:  # hooks only for this call: the timed calls above ran without them
        model.zero_grad(set_to_none=True)
        timer = SiteTimer(model, device)
        timer.active = True
        try:
            timer.mark(("all", "model", "start"))
            call()
            timer.mark(("all", "model", "end"))
            sites = timer.intervals_ms()
        finally:
            timer.close()
        whole = sites[("all", "model")][1] - sites[("all", "model")][0]
        if "ms" not in entry:  # a one-sample smoke run: the instrumented call is the sample
            entry.update(ms=whole, samples=1, first_ms=whole)
        blocks = len(model.transformer_blocks)
        cond = {"fwd": conditioning_ms(sites, "fwd", blocks)}
        if phase == "fwd_bwd":
            cond["bwd"] = conditioning_ms(sites, "bwd", blocks)
        total = None if any(v is None for v in cond.values()) else sum(cond.values())
        entry.update(conditioning_ms=total, conditioning_fwd_ms=cond["fwd"], conditioning_bwd_ms=cond.get("bwd"),
                     instrumented_ms=whole, share=None if total is None else total / whole)
    entry["warmup_and_timing_s"] = time.perf_counter() - t0
    model.zero_grad(set_to_none=True)
    return entry


# ---- the run -------------------------------------------------------------------------------------------

def _key(r) -> tuple:
    return r["mode"], r["S"], r["B"], r["phase"]


def _measured(entry: dict, variant: str) -> bool:
    """A variant of a configuration that needs no new run: timed."""
    return "ms" in entry.get(variant, {})


def _configs(plan: Plan) -> list[tuple]:
    """(mode, S, B, phase) in order; the CUDA-graph mode times the forward (the rollout) only."""
    return [(mode, s, b, phase) for mode in plan.modes for s in plan.sizes for b in plan.batches
            for phase in plan.phases if not (mode == "cudagraphs" and phase != "fwd")]


def run(plan: Plan, out: Path, device=None, resume: bool = False, budget_s: float | None = None, log=print,
        progress=None) -> dict:
    """Runs the plan (see the module docstring), writing `out` (JSON) after every configuration and the markdown
    and PNG at the end; returns the report."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    started = time.perf_counter()
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:  # compiled graphs survive between resumed runs
        from h3cute.runtime.cache import cache_dir
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir() / "inductor")
    import h3cute

    out = Path(out)
    rep = _load(out) if resume and out.exists() else None
    if rep is not None and rep.get("plan", {}).get("size") != json.loads(json.dumps(asdict(plan.size))):
        raise SystemExit(f"--resume: {out} was made with another model size; use another --out")
    if rep is None:
        rep = {"kind": KIND, "environment": report.environment(device, {}), "plan": _plan_json(plan),
               "results": [], "complete": False}
    if "model" in plan.variants:
        if invariant.environment_problems():
            raise SystemExit("--variants model needs vLLM's cuBLASLt settings in the environment before CUDA starts: "
                             + " ".join(f"{k}={v}" for k, v in invariant.ENVIRONMENT.items()) + " (they are "
                             "process-wide: measure the other variants in a process without them, then add this one "
                             "with --resume)")
    entries = {_key(r): r for r in rep["results"]}
    done = {k for k, r in entries.items() if all(_measured(r, v) for v in plan.variants)}
    todo = [c for c in _configs(plan) if c not in done]
    if not todo:
        rep["complete"] = True
        log("every configuration is in " + ", ".join(str(p) for p in write_outputs(rep, out)))
        return rep

    log(f"building the model ({plan.size.layers} block(s), {plan.size.heads} heads x {plan.size.head_dim}, "
        f"FFN {plan.size.ffn}, text {plan.size.text_dim}) on {device}")
    model = build_model(plan.size, device=device, seed=0)
    rep["model"] = {**asdict(plan.size), "parameters": sum(p.numel() for p in model.parameters())}
    if "patched" in plan.variants:
        with h3cute.patch(model) as p:
            rep["patch_report"] = p.report()
    if "model" in plan.variants:
        with h3cute.patch(model, scope="model") as p:
            rep["model_patch_report"] = p.report()
    compiled = {"eager": model}
    if set(plan.modes) - {"eager"}:
        # one compiled module per mode serves every variant, phase and shape: room for all their graphs
        for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                     "accumulated_recompile_limit"):
            if hasattr(torch._dynamo.config, name):
                setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))
    if "compile" in plan.modes:
        compiled["compile"] = torch.compile(model, backend=plan.backend, dynamic=False)
    if "cudagraphs" in plan.modes:
        compiled["cudagraphs"] = torch.compile(model, backend=plan.backend, mode="reduce-overhead", dynamic=False)
    task = progress.add_task("model", total=len(todo) * len(plan.variants)) if progress else None
    blas_env = {k: os.environ.get(k) for k in invariant.ENVIRONMENT}
    inputs_cache = {}
    for mode, s, b, phase in todo:
        if budget_s is not None and time.perf_counter() - started > budget_s:
            log(f"budget of {budget_s:.0f} s spent: stopping before {mode} S={s} B={b} {phase} "
                "(run again with --resume)")
            break
        if (s, b) not in inputs_cache:
            inputs_cache.clear()
            inputs_cache[(s, b)] = packed_inputs(plan.size, **layout(s), timesteps=plan.timesteps, batch=b,
                                                 device=device, seed=1)
        inputs = inputs_cache[(s, b)]
        entry = entries.get((mode, s, b, phase)) or {"mode": mode, "S": s, "B": b, "phase": phase}
        for variant in plan.variants:
            if _measured(entry, variant):
                continue
            log(f"{mode} S={s} B={b} {phase}: {variant}")
            patch = None if variant == "unpatched" else h3cute.patch(
                model, scope="model" if variant == "model" else "conditioning")
            try:
                entry[variant] = measure(model, compiled[mode], inputs, phase, plan, device, mode != "eager",
                                         cudagraphs=mode == "cudagraphs")
                entry[variant]["blas_environment"] = blas_env
            except Exception as e:  # e.g. out of memory at one size: record it, keep going
                entry[variant] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
                log(f"  {entry[variant]['error']}")
            finally:
                if patch is not None:
                    patch.unpatch()
                model.zero_grad(set_to_none=True)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            if task is not None:
                progress.advance(task)
        u, p, m = (entry.get(v, {}).get("ms") for v in VARIANTS)
        entry["speedup"] = u / p if u and p else None
        entry["model_cost"] = m / u - 1 if u and m else None
        if u and p:
            log(f"  {u:.2f} ms unpatched, {p:.2f} ms patched: {u / p:.3f}x")
        if u and m:
            log(f"  {u:.2f} ms unpatched, {m:.2f} ms scope='model': {m / u - 1:+.1%}")
        entries[(mode, s, b, phase)] = entry
        rep["results"] = list(entries.values())
        _save(rep, out)
    order = {c: i for i, c in enumerate(_configs(plan))}
    rep["results"].sort(key=lambda r: order.get(_key(r), len(order)))
    done = {_key(r) for r in rep["results"] if all(_measured(r, v) for v in plan.variants)}
    rep["complete"] = all(c in done for c in _configs(plan))
    written = write_outputs(rep, out)
    log("wrote " + ", ".join(str(p) for p in written) + ("" if rep["complete"] else " (incomplete: --resume)"))
    return rep


def _plan_json(plan: Plan) -> dict:
    d = asdict(plan)
    d["size"] = asdict(plan.size)
    return d


def _load(path: Path) -> dict:
    rep = json.loads(Path(path).read_text())
    if rep.get("kind") != KIND:
        raise SystemExit(f"{path}: not an {KIND} report")
    return rep


def _save(rep: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(rep, indent=1))
    tmp.replace(out)


# ---- outputs -------------------------------------------------------------------------------------------

def _fmt(v, spec=".2f"):
    return "–" if v is None else format(v, spec)


def markdown(rep: dict) -> str:
    env, m = rep["environment"], rep.get("model", {})
    h3 = env.get("h3cute") or {}
    lines = [
        f"# MiniMax-H3 model: h3cute.patch against diffusers{'' if rep.get('complete') else ' (incomplete)'}",
        "",
        f"GPU {env.get('gpu')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, diffusers "
        f"{(env.get('libraries') or {}).get('diffusers')}, h3cute {h3.get('commit')}"
        f"{' (dirty)' if h3.get('tree_dirty') else ''}, timer {env.get('timer')}.",
        f"Model: {m.get('layers')} block(s), {m.get('refiner_layers')} refiner layer(s), {m.get('heads')} heads x "
        f"{m.get('head_dim')}, FFN {m.get('ffn')}, text {m.get('text_dim')}, {m.get('parameters', 0) / 1e9:.2f} B "
        f"parameters; T = {rep['plan']['timesteps']}; compile backend {rep['plan']['backend']}.",
        "",
        "Times: median ms per call. Conditioning: the conditioning path's ms (time_proj, time_embedder, per block "
        "everything but attn and ff, norm_out) and its share of the same instrumented call (eager only).",
        "",
        "| mode | S | B | phase | diffusers ms | h3cute ms | speedup | conditioning ms diffusers / h3cute "
        "| share diffusers / h3cute | max GiB diffusers / h3cute |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rep["results"]:
        u, p = r.get("unpatched", {}), r.get("patched", {})
        if not p:
            continue
        if "error" in u or "error" in p or "ms" not in u:
            lines.append(f"| {r['mode']} | {r['S']} | {r['B']} | {r['phase']} | {u.get('error', _fmt(u.get('ms')))} "
                         f"| {p.get('error', _fmt(p.get('ms')))} | – | – | – | – |")
            continue
        share = (f"{_fmt(u.get('share'), '.1%')} / {_fmt(p.get('share'), '.1%')}"
                 if "share" in u else "–")
        cond = (f"{_fmt(u.get('conditioning_ms'))} / {_fmt(p.get('conditioning_ms'))}"
                if "conditioning_ms" in u else "–")
        mem = (f"{_fmt(u.get('max_memory_gib'), '.1f')} / {_fmt(p.get('max_memory_gib'), '.1f')}"
               if "max_memory_gib" in u else "–")
        lines.append(f"| {r['mode']} | {r['S']} | {r['B']} | {r['phase']} | {_fmt(u['ms'])} | {_fmt(p['ms'])} | "
                     f"{_fmt(r.get('speedup'), '.3f')}x | {cond} | {share} | {mem} |")
    measured = [r for r in rep["results"] if r.get("speedup") is not None]
    if measured:
        faster = all(r["speedup"] > 1 for r in measured)
        lines += ["", f"Bar (the patched model faster than diffusers' at every measured configuration): "
                      f"{'met' if faster else 'not met'}; speedups {min(r['speedup'] for r in measured):.3f}x to "
                      f"{max(r['speedup'] for r in measured):.3f}x over {len(measured)} configurations."]
    scoped = [r for r in rep["results"] if "ms" in r.get("model", {}) and "ms" in r.get("unpatched", {})]
    if scoped:
        lines += ["", "## scope='model': the whole forward batch-invariant", "",
                  "h3cute.patch(model, scope='model') against the unpatched model (diffusers' attention dispatch, "
                  "plain cuBLAS) in the same mode: eager, torch.compile (`compile`) and torch.compile with CUDA "
                  "graphs (`cudagraphs`, mode='reduce-overhead', the forward); the scope='model' process runs with "
                  "vLLM's cuBLASLt settings. Cost: scope='model' ms / diffusers ms - 1 (negative: faster). Bars: "
                  "eager no more than +3%; compiled no more than +1%.", "",
                  "| mode | S | B | phase | diffusers ms | scope='model' ms | cost "
                  "| max GiB diffusers / scope='model' |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in scoped:
            u, m = r["unpatched"], r["model"]
            mem = (f"{_fmt(u.get('max_memory_gib'), '.1f')} / {_fmt(m.get('max_memory_gib'), '.1f')}"
                   if "max_memory_gib" in u else "–")
            lines.append(f"| {r['mode']} | {r['S']} | {r['B']} | {r['phase']} | {_fmt(u['ms'])} | {_fmt(m['ms'])} | "
                         f"{r['model_cost']:+.1%} | {mem} |")
        for mode, bar in (("eager", 0.03), ("compile", 0.01), ("cudagraphs", 0.01)):
            rows = [r for r in scoped if r["mode"] == mode]
            if not rows:
                continue
            worst = max(r["model_cost"] for r in rows)
            lines += ["", f"Bar, {mode} (scope='model' no more than {bar:.0%} slower than the unpatched model at "
                          f"every measured configuration): {'met' if worst <= bar else 'not met'}; costs "
                          f"{min(r['model_cost'] for r in rows):+.1%} to {worst:+.1%} over {len(rows)} "
                          "configurations."]
    if rep.get("patch_report"):
        lines += ["", "```", rep["patch_report"], "```"]
    if rep.get("model_patch_report"):
        lines += ["", "```", rep["model_patch_report"], "```"]
    return "\n".join(lines) + "\n"


def write_plot(rep: dict, path: Path) -> Path | None:
    """Speedup (diffusers ms / h3cute ms) per configuration, one panel per mode and phase, the bar at 1."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    panels = [(mode, phase) for mode in rep["plan"]["modes"] for phase in rep["plan"]["phases"]
              if not (mode == "cudagraphs" and phase != "fwd")]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 4), squeeze=False)
    for ax, (mode, phase) in zip(axes[0], panels):
        rows = [r for r in rep["results"] if r["mode"] == mode and r["phase"] == phase]
        xs = list(range(len(rows)))
        speedups = [r.get("speedup") or 0.0 for r in rows]
        ax.bar(xs, speedups, 0.6, color=["tab:green" if v > 1 else "tab:red" for v in speedups])
        ax.axhline(1.0, color="k", linestyle="--", linewidth=1)
        for x, r in zip(xs, rows):
            u, p = r.get("unpatched", {}).get("ms"), r.get("patched", {}).get("ms")
            label = f"{u:.1f} / {p:.1f} ms" if u and p else "error"
            ax.text(x, (r.get("speedup") or 0.0) + 0.01, label, ha="center", va="bottom", fontsize=7)
        ax.set_xticks(xs, [f"S={r['S']}\nB={r['B']}" for r in rows], fontsize=8)
        ax.set_ylabel("speedup: diffusers ms / h3cute ms")
        ax.set_ylim(0, max([1.2, *speedups]) * 1.15)
        ax.set_title(f"{mode}, {phase}")
    layers = rep.get("model", {}).get("layers")
    fig.suptitle(f"MiniMax-H3 ({layers} block{'s' if layers != 1 else ''}): h3cute.patch against diffusers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_outputs(rep: dict, out: Path) -> list[Path]:
    out = Path(out)
    _save(rep, out)
    md = out.with_suffix(".md")
    md.write_text(markdown(rep))
    png = write_plot(rep, out.with_suffix(".png"))
    return [out, md] + ([png] if png else [])


def plan_from_args(args) -> Plan:
    plan = QUICK if args.quick else Plan()
    fields = {}
    if args.sizes:
        fields["sizes"] = tuple(args.sizes)
    if args.batches:
        fields["batches"] = tuple(args.batches)
    if args.modes:
        fields["modes"] = tuple(args.modes)
    if args.phases:
        fields["phases"] = tuple(args.phases)
    if args.backend:
        fields["backend"] = args.backend
    if args.no_share:
        fields["share"] = False
    if getattr(args, "variants", None):
        fields["variants"] = tuple(args.variants)
    return replace(plan, **fields)

