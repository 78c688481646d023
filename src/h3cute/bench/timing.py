"""Timing shared by the harness (`h3cute.bench.checks`, `sweep`) and the perf scripts.

`timer(device, warmup, samples)` measures the seed reports' way: each sample is one whole call from Python
between two CUDA events, calls back to back with no sync between samples (when the host is slower than
the GPU this is the host time of a call), the median in µs; on a CPU-only machine, wall time.
`device_timer` times the device alone: before each sample a spin kernel holds the GPU while the host queues
start event, call, end event, so the host's launch cost stays out of the interval (a small graph's replay
costs the host more than the GPU: timed the first way, its time is the host's). `graph_time` replays one call
captured in a CUDA graph (`capture`) under `device_timer`.
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


SPIN_CYCLES = 200_000  # ~100 us at H200 clocks: longer than the host takes to queue one graph replay


def device_timer(device, warmup: int, samples: int) -> Callable[[Callable[[], object]], float]:
    """Median device µs of fn: per sample `torch.cuda._sleep` spins while the host queues start event, fn, end
    event, then one sync. The spin is doubled (and the samples retaken) whenever the host took longer to queue
    a sample than the spin lasts, so a figure is never the host's. On a CPU-only machine, wall time."""
    device = torch.device(device)
    if device.type != "cuda":
        return timer(device, warmup, samples)

    def measure(fn) -> float:
        cycles = SPIN_CYCLES
        while True:
            spin_us = _spin_us(cycles, device)
            times, host_us = [], []
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            for i in range(warmup + samples):
                t0 = time.perf_counter()  # the spin starts once queued: its own launch counts against it
                torch.cuda._sleep(cycles)
                start.record()
                fn()
                end.record()
                host_us.append((time.perf_counter() - t0) * 1e6)
                end.synchronize()
                if i >= warmup:
                    times.append(start.elapsed_time(end) * 1e3)
            if max(host_us[warmup:]) < spin_us:
                return statistics.median(times)
            if cycles >= 64 * SPIN_CYCLES:
                raise RuntimeError(f"device_timer: the host took {max(host_us[warmup:]):.0f} us to queue one sample, "
                                   f"longer than a {spin_us:.0f} us spin")
            cycles *= 2
    return measure


def _spin_us(cycles: int, device) -> float:
    """Device µs of one `torch.cuda._sleep(cycles)` (its rate is the SM clock's)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(device):
        torch.cuda._sleep(cycles)  # warm
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
    return start.elapsed_time(end) * 1e3


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


def graph_time(fn, device, warmup: int, samples: int) -> tuple[float | None, str | None]:
    """Median device time of one captured call's replay (`device_timer`), or (None, reason)."""
    device = torch.device(device)
    if device.type != "cuda":
        return None, "CUDA graphs need a CUDA device"
    try:
        return device_timer(device, warmup, samples)(capture(fn, device).replay), None
    except Exception as e:
        reason = f"not capturable: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        try:   # a failed capture may leave an error pending on the stream; surface it here, not later
            torch.cuda.synchronize(device)
        except Exception as late:
            reason += f" (then {type(late).__name__}: {late})"
        return None, reason
