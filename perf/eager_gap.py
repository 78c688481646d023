"""Why an op's eager fwd+bwd takes longer than its captured graph: adaln_projection, h3cute beside the cuBLAS replay.

Run: `bash perf/device_run.sh python3 perf/eager_gap.py [T ...]` (default T = 256 2048). The prior-art report times
fwd+bwd two ways (`h3cute.bench.checks`): `fwd_bwd_us`, calls back to back between CUDA events (the allocator and
the host in the loop), and `fwd_bwd_kernel_us`, one captured call replayed (`timing.graph_time`). For each T and
candidate, the harness's own fwd+bwd (fresh leaves, all-ones upstream gradient, the report's inputs):

  eager_us / graph_us   the two figures as the report takes them
  host_us               the host's time to queue one call (no sync), median: beyond eager_us the host is the bound
  allocator             per call, from `torch.cuda.memory_stats` over the timed loop: device mallocs and frees
                        (cudaMalloc / cudaFree, each a device sync), alloc retries (a cache flush), and the bytes
                        in use at the call's peak
  runtime_calls         per call, CUDA runtime / driver API calls that torch.profiler saw, by name (syncs and
                        allocations among them)

Writes $H3CUTE_OUT/eager_gap.json (or ./eager_gap.json).
"""
from __future__ import annotations

import collections
import statistics
import sys
import time

import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference
from h3cute.bench import problems, timing
from h3cute.bench.checks import ACCURACY_SEED
from h3cute.bench.report import write_device_json

WARMUP, SAMPLES = 5, 30
DEV = torch.device("cuda")


def report_calls(rows: int, dev) -> dict:
    """Candidate -> one fwd+bwd of adaln_projection as the prior-art report's harness runs it (`h3cute.bench.checks`:
    its accuracy inputs, fresh leaves, an all-ones upstream gradient): `torch.ops.h3.adaln_projection` and the
    diffusers replay (`reference.adaln_projection_replay`). Shared with perf/clock_probe.py."""
    inputs = problems.PROBLEMS["adaln_projection"].draw(rows, ACCURACY_SEED, dev)
    ones = torch.ones((rows, inputs["weight"].shape[0]), dtype=torch.bfloat16, device=dev)

    def fwd_bwd(fn):
        def call():
            leaves = [inputs[a].detach().requires_grad_(True) for a in ("temb", "weight", "bias")]
            torch.autograd.backward([fn(*leaves)], [ones])
        return call
    return {"h3cute": fwd_bwd(torch.ops.h3.adaln_projection),
            "cuBLAS replay": fwd_bwd(reference.adaln_projection_replay)}


def _allocator(call, n: int) -> dict:
    keys = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_stats()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    out = {k: (after.get(k, 0) - before.get(k, 0)) / n for k in keys}
    out["peak_gb"] = after.get("allocated_bytes.all.peak", 0) / 1e9
    return out


def _runtime_calls(call, n: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            call()
        torch.cuda.synchronize()
    counts = collections.Counter()
    for ev in prof.events():
        name = ev.name
        if name.startswith(("cuda", "cu")) and not name.startswith("cutlass"):
            counts[name] += 1
    return {k: v / n for k, v in sorted(counts.items())}


def _host_us(call, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def main(argv) -> int:
    sizes = [int(a) for a in argv] or [256, 2048]
    report = {"gpu": torch.cuda.get_device_name(DEV), "sizes": {}}
    eager = timing.timer(DEV, WARMUP, SAMPLES)
    for rows in sizes:
        entry = {}
        for name, call in report_calls(rows, DEV).items():
            graph, why = timing.graph_time(call, DEV, WARMUP, SAMPLES)
            entry[name] = {"eager_us": eager(call), "graph_us": graph if why is None else why,
                           "host_us": _host_us(call, 10), "allocator": _allocator(call, 10),
                           "runtime_calls": _runtime_calls(call, 3)}
            e = entry[name]
            print(f"T = {rows:5d} {name:<14} eager {e['eager_us']:8.1f} us  graph {graph or 0:8.1f}  host "
                  f"{e['host_us']:7.1f}  allocator {e['allocator']}")
            print(f"      runtime calls per call: {e['runtime_calls']}")
        report["sizes"][str(rows)] = entry
        torch.cuda.empty_cache()
    print(f"eager_gap -> {write_device_json(report, 'eager_gap.json')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
