"""Timelines of one small-T timestep_mlp fwd+bwd, h3cute beside the cuBLAS replay, from torch.profiler.

Run: `bash perf/device_run.sh python3 perf/host_trace.py [T ...]` (default T = 1). For each T and candidate:

  eager   the harness's fwd+bwd (fresh leaves, backward with all-ones upstream), 20 profiled calls after 20
          warm-up calls; per call the host time, and for the median call its host events in order (runtime /
          driver API calls, ATen ops, annotations: offset from the call's start and duration, µs) and its
          kernels (device start offset, duration, gap to the previous kernel)
  graph   one captured fwd+bwd replayed 20 times; the median replay's kernels with their gaps (h3cute's captured
          twice in a row, each with its gradients' addresses)

Then h3cute alone, each one graph: the harness's graphed fwd+bwd with a random upstream gradient, the op's
forward then its backward op (no autograd) with an all-ones and with a random upstream, the same through the
Python launcher, the harness's graph captured once more (last), and the backward op alone (where a kernel's
time changes with what ran, or was captured, before it); and
  floor   the forward's floor as torch kernels: w1.sum() + w2.sum(), one sum over both weights (63.3 MB), one over
          ten copies of them (633 MB: the read rate past the ramp), and a graph of one tiny kernel (what a
          replay costs the device beyond its kernels)

Every graph is also timed as the harness times `*_kernel_us` (`timing.device_timer`: device time of a replay) and
with its replays queued back to back between CUDA events (host-bound for a small graph).

What it answers: where the host time of a host-bound call goes (which calls, how long each launch takes),
and where a graph's device time goes between kernels. Writes $H3CUTE_OUT/host_trace_T<T>.txt (or ./).
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile

import torch
from torch.profiler import ProfilerActivity, profile, record_function

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference
from h3cute.bench import problems, timing
from h3cute.launch import timestep_mlp as M
from h3cute.widths import TEMB

DEV = torch.device("cuda")
WARMUP, CALLS = 20, 20
HOST_CATS = ("cuda_runtime", "cuda_driver", "cpu_op", "user_annotation")


def _trace(fn, label: str) -> list[dict]:
    """Chrome-trace events of CALLS calls of fn, each inside a `label#i` annotation."""
    for _ in range(WARMUP):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(CALLS):
            with record_function(f"{label}#{i}"):
                fn()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    os.unlink(path)
    return [e for e in events if e.get("ph") == "X"]


def _calls(events: list[dict], label: str) -> list[dict]:
    """The `label#i` annotations (one per call), in time order."""
    return sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith(label + "#")),
                  key=lambda e: e["ts"])


def _kernels_between(events, t0, t1, by_correlation=None):
    """Kernels in start order: those launched by the given correlation ids, else those starting in [t0, t1)."""
    ks = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if by_correlation is not None:
        return [k for k in ks if k.get("args", {}).get("correlation") in by_correlation]
    return [k for k in ks if t0 <= k["ts"] < t1]


def _kernel_lines(kernels) -> list[str]:
    if not kernels:
        return ["    (no kernels recorded)"]
    t0 = kernels[0]["ts"]
    lines, prev_end = [], None
    for k in kernels:
        gap = "" if prev_end is None else f"{k['ts'] - prev_end:8.2f}"
        lines.append(f"    {k['ts'] - t0:8.2f} {k['dur']:8.2f} {gap:>8}  {k['name'][:90]}")
        prev_end = k["ts"] + k["dur"]
    span = kernels[-1]["ts"] + kernels[-1]["dur"] - t0
    busy = sum(k["dur"] for k in kernels)
    lines.append(f"    span {span:.2f} us, kernels {busy:.2f} us, gaps {span - busy:.2f} us, {len(kernels)} kernels")
    return lines


def eager(fn, label: str) -> list[str]:
    events = _trace(fn, label)
    calls = _calls(events, label)
    durs = [c["dur"] for c in calls]
    med = sorted(calls, key=lambda c: c["dur"])[len(calls) // 2]
    t0, t1 = med["ts"], med["ts"] + med["dur"]
    host = sorted((e for e in events if e.get("cat") in HOST_CATS and t0 <= e["ts"] < t1 and e is not med),
                  key=lambda e: e["ts"])
    corr = {e.get("args", {}).get("correlation") for e in host if e.get("cat") in ("cuda_runtime", "cuda_driver")}
    corr.discard(None)
    out = [f"  eager {label}: host time per call median {statistics.median(durs):.2f} us "
           f"(min {min(durs):.2f}, max {max(durs):.2f})",
           "    host events of the median call: offset, duration, tid, category, name"]
    for e in host:
        out.append(f"    {e['ts'] - t0:8.2f} {e['dur']:8.2f} {e.get('tid')!s:>8} {e['cat']:<15} {e['name'][:80]}")
    api = {}
    for e in host:
        if e["cat"] in ("cuda_runtime", "cuda_driver"):
            n, s = api.get(e["name"], (0, 0.0))
            api[e["name"]] = (n + 1, s + e["dur"])
    out.append("    runtime / driver calls of that call: name, count, total us")
    for name, (n, s) in sorted(api.items(), key=lambda kv: -kv[1][1]):
        out.append(f"      {name:<40} {n:4d} {s:9.2f}")
    out.append("    its kernels: device offset, duration, gap")
    out.extend(_kernel_lines(_kernels_between(events, t0, t1, corr)))
    return out


def graph(fn, label: str) -> list[str]:
    g = timing.capture(fn, DEV)
    harness_us = timing.device_timer("cuda", WARMUP, 100)(g.replay)
    queued_us = timing.timer("cuda", WARMUP, 100)(g.replay)  # replays queued back to back: host-bound when small
    events = _trace(g.replay, label)
    ks = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    n = len(ks) // CALLS if CALLS else 0
    if n == 0:
        return [f"  graph {label}: no kernels recorded"]
    replays = [ks[i * n:(i + 1) * n] for i in range(CALLS)]
    spans = [r[-1]["ts"] + r[-1]["dur"] - r[0]["ts"] for r in replays]
    med = sorted(range(CALLS), key=lambda i: spans[i])[CALLS // 2]
    return ([f"  graph {label}: replay {harness_us:.2f} us (harness: device_timer), {queued_us:.2f} back to back, "
             f"first-to-last kernel span median "
             f"{statistics.median(spans):.2f} us (min {min(spans):.2f}), {n} kernels per replay; median replay: "
             "offset, duration, gap"]
            + _kernel_lines(replays[med]))


def _upstream_ones(t: int) -> torch.Tensor:
    return torch.ones((t, TEMB), device=DEV)


def side_by_side(p, inputs: dict, t: int) -> list[str]:
    """h3cute and the cuBLAS replay: eager fwd+bwd and fwd timelines, and the harness's fwd+bwd graph."""
    grads = p.row_grads + p.param_grads
    lines = []
    for name, fn in {"h3cute": torch.ops.h3.timestep_mlp, "cublas": reference.timestep_mlp_replay}.items():
        ones = _upstream_ones(t)

        def fwd_bwd(fn=fn):  # the harness's eager fwd+bwd: fresh leaves every call
            leaves = {a: inputs[a].detach().requires_grad_(True) for a in grads}
            torch.autograd.backward(fn(*[leaves.get(a, inputs[a]) for a in p.args]), ones)
        static = {a: inputs[a].detach().requires_grad_(True) for a in grads}

        def graphed(fn=fn, seen=None):  # the harness's graphed fwd+bwd
            out = torch.autograd.grad(fn(*[static.get(a, inputs[a]) for a in p.args]), list(static.values()), ones)
            if seen is not None:
                seen[:] = out
        lines += eager(fwd_bwd, f"{name}_fwd_bwd") + eager(lambda fn=fn: fn(*[inputs[a] for a in p.args]),
                                                             f"{name}_fwd")
        if name != "h3cute":
            lines += graph(graphed, f"{name}_graph_fwd_bwd")
            continue
        # Captured twice in a row: here the harness's graph runs fc1_dgrad ~2x slower than the same call captured
        # after the cuBLAS replay's graph below (both captures at 14feb80); the gradients' addresses (offset in a
        # 2 MiB page) say where each capture's pool put them.
        for label in ("h3cute_graph_fwd_bwd", "h3cute_graph_fwd_bwd_captured_again"):
            seen = []
            lines += graph(lambda seen=seen: graphed(seen=seen), label)
            lines.append("    gradient addresses mod 2 MiB: " + ", ".join(
                f"{a}={g.data_ptr() % (1 << 21):#x}" for a, g in zip(static, seen)))
    return lines


def h3cute_graphs(p, inputs: dict, t: int) -> list[str]:
    """h3cute's fwd+bwd captured in other ways (what changes a kernel's time in the harness's graph), then the
    forward's floor as torch reductions."""
    grads = p.row_grads + p.param_grads
    x, w1, b1, w2, b2 = (inputs[a] for a in p.args)
    randn, ones, ones_again = torch.randn((t, TEMB), device=DEV), _upstream_ones(t), _upstream_ones(t)
    static = {a: inputs[a].detach().requires_grad_(True) for a in grads}

    def autograd(upstream):  # the harness's graphed fwd+bwd with a given upstream gradient
        out = torch.ops.h3.timestep_mlp(*[static.get(a, inputs[a]) for a in p.args])
        torch.autograd.grad(out, list(static.values()), upstream)

    def op_pair(upstream):  # the op's forward, then its backward op, no autograd
        torch.ops.h3.timestep_mlp(x, w1, b1, w2, b2)
        torch.ops.h3.timestep_mlp_backward(upstream, x, w1, b1, w2)

    def launcher_pair():  # the same through the Python launcher
        M.forward(x, w1, b1, w2, b2)
        M.backward(randn, x, w1, b1, w2)
    weights = torch.cat([w1.flatten(), w2.flatten()])
    weights_x10 = weights.repeat(10)  # 633 MB: the read rate once the ramp is amortized
    tiny = torch.zeros(1, device=DEV)
    return (graph(lambda: autograd(randn), "autograd_fwd_bwd_randn_grad")
            + graph(lambda: op_pair(ones), "op_fwd_then_bwd_ones_grad")
            + graph(lambda: op_pair(randn), "op_fwd_then_bwd")
            + graph(launcher_pair, "launcher_fwd_then_bwd")
            # the harness's graph once more, captured last (same function, a new private memory pool)
            + graph(lambda: autograd(ones_again), "autograd_fwd_bwd_ones_grad_captured_last")
            + graph(lambda: torch.ops.h3.timestep_mlp_backward(randn, x, w1, b1, w2), "op_bwd")
            # the floor the forward's device-time bar is set from: one read of both weights
            + graph(lambda: (w1.sum(), w2.sum()), "floor_w1_sum_w2_sum")
            + graph(lambda: weights.sum(), "floor_one_sum_of_both_weights")
            + graph(lambda: weights_x10.sum(), "read_rate_sum_of_10x_the_weights")
            # what a replay costs the device beyond its kernels (launch of the graph, first kernel's start)
            + graph(lambda: tiny.add_(1), "graph_overhead_one_tiny_kernel"))


def main() -> None:
    p = problems.PROBLEMS["timestep_mlp"]
    torch.backends.cuda.matmul.allow_tf32 = False
    for t in [int(a) for a in sys.argv[1:]] or [1]:
        inputs = p.draw(t, 0, DEV)
        lines = [f"timestep_mlp T = {t}, {torch.cuda.get_device_name()}, torch {torch.__version__}"]
        lines += side_by_side(p, inputs, t) + h3cute_graphs(p, inputs, t)
        text = "\n".join(lines)
        print(text)
        path = os.path.join(os.environ.get("H3CUTE_OUT", "."), f"host_trace_T{t}.txt")
        with open(path, "w") as f:
            f.write(text + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
