"""Timing shared by the harness (`h3cute.bench.checks`, `sweep`) and the perf scripts.

`timer(device, warmup, samples)` measures the seed reports' way: each sample is one whole call from Python
between two CUDA events, calls back to back with no sync between samples (when the host is slower than
the GPU this is the host time of a call), the median in µs; on a CPU-only machine, wall time.
`graph_time` replays one call captured in a CUDA graph (`capture`): device time only.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def timer(device, warmup: int, samples: int) -> Callable[[Callable[[], object]], float]:
    device = torch.device(device)

    def measure(fn) -> float:
        for _ in range(warmup):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(samples)]
            for start, end in ev:
                start.record()
                fn()
                end.record()
            torch.cuda.synchronize(device)
            times = [s.elapsed_time(e) * 1e3 for s, e in ev]
        else:
            times = []
            for _ in range(samples):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e6)
        return statistics.median(times)
    return measure


def capture(fn, device) -> torch.cuda.CUDAGraph:
    """One call of fn captured in a CUDA graph, after three warm-up calls on a side stream."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def graph_time(fn, measure, device) -> tuple[float | None, str | None]:
    """Median replay time of one captured call, or (None, reason)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, "CUDA graphs need a CUDA device"
    try:
        return measure(capture(fn, device).replay), None
    except Exception as e:
        reason = f"not capturable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        try:   # a failed capture may leave an error pending on the stream; surface it here, not later
            torch.cuda.synchronize(device)
        except Exception as late:
            reason += f" (then {type(late).__name__}: {late})"
        return None, reason
