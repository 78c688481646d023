"""Device script: h3::linear against torch's FP32 linear (cuBLAS, TF32 off) on MiniMax-H3's four FP32 heads.

Runs against the prebuilt bundle (never compiles):
    bash perf/device_run.sh python3 perf/linear_bench.py
For each head (proj_in 96 -> 5376, audio_proj_in 32 -> 5376, proj_out 5376 -> 96, audio_proj_out 5376 -> 32, all
with bias) at M = 4097, 32768, 131072 rows, median µs over 30 samples after 5 warm-ups (h3cute.bench.timing) of:
fwd (the op under no_grad), fwd_bwd (forward + backward through autograd, x, weight and bias needing gradients),
fwd_bwd_frozen_x (x needs none: no dx GEMM, as for proj_in's latent input), for `h3` (torch.ops.h3.linear) and
`cublas` (torch.nn.functional.linear), in the same run. `ratio` = cublas µs / h3 µs of the eager calls back to back
(issue 26's bar: >= 0.9 at M >= 4096, fwd and fwd_bwd); `device_ratio` the same of the GPU's own time
(`timing.device_timer`: a host-bound call shows there as faster than in `ratio`). Prints a table; writes
`$H3CUTE_OUT/linear_bench.json`.
"""
from __future__ import annotations

import sys
import time

import torch
import torch.nn.functional as F

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute.bench import timing
from h3cute.bench.report import write_device_json
from h3cute.widths import FP32_HEADS

HEADS = FP32_HEADS  # (out, in) features by head
ROWS = (4097, 32768, 131072)
BAR = 0.9
WARMUP, SAMPLES = 5, 30
IMPLS = {"h3": lambda x, w, b: torch.ops.h3.linear(x, w, b), "cublas": F.linear}

_median_us = timing.timer("cuda", WARMUP, SAMPLES)
_device_us = timing.device_timer("cuda", WARMUP, SAMPLES)  # the GPU's own time: a spin holds it while the host queues


def _phases(fn, x, w, b, grad):
    """phase -> zero-argument call."""
    def fwd():
        with torch.no_grad():
            fn(x, w, b)

    def fwd_bwd(x_leaf):
        def call():
            fn(x_leaf, w, b).backward(grad)
            x_leaf.grad = w.grad = b.grad = None
        return call

    return {"fwd": fwd, "fwd_bwd": fwd_bwd(x.detach().requires_grad_()), "fwd_bwd_frozen_x": fwd_bwd(x.detach())}


def main() -> int:
    torch.backends.cuda.matmul.allow_tf32 = False  # cuBLAS in true FP32 (the comparison the bar is set on)
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.device("cuda")
    t0 = time.time()
    report = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "warmup": WARMUP,
              "samples": SAMPLES, "bar": BAR, "heads": {}}
    misses = []
    for head, (n, k) in HEADS.items():
        g = torch.Generator(device=dev).manual_seed(n + k)
        w = (torch.randn((n, k), generator=g, device=dev) * k ** -0.5).requires_grad_()
        b = (torch.randn((n,), generator=g, device=dev) * 0.02).requires_grad_()
        report["heads"][head] = {"out_features": n, "in_features": k, "rows": {}}
        for m in ROWS:
            x = torch.randn((m, k), generator=g, device=dev)
            grad = torch.randn((m, n), generator=g, device=dev)
            row = {}
            for impl, fn in IMPLS.items():
                for phase, call in _phases(fn, x, w, b, grad).items():
                    row.setdefault(phase, {})[impl] = _median_us(call)
                    row[phase][f"{impl}_device"] = _device_us(call)
            for phase, t in row.items():
                t["ratio"] = t["cublas"] / t["h3"]
                t["device_ratio"] = t["cublas_device"] / t["h3_device"]
                ok = t["ratio"] >= BAR
                if not ok and phase != "fwd_bwd_frozen_x":
                    misses.append((head, m, phase))
                print(f"{head:<15} M={m:<7} {phase:<17} h3 {t['h3']:10.1f} us  cublas {t['cublas']:10.1f} us  "
                      f"ratio {t['ratio']:.3f} {'ok' if ok else 'MISS'}  device: h3 {t['h3_device']:10.1f} us  "
                      f"cublas {t['cublas_device']:10.1f} us  ratio {t['device_ratio']:.3f}")
            report["heads"][head]["rows"][str(m)] = row
            del x, grad
            torch.cuda.empty_cache()
    report["misses"] = [list(m) for m in misses]
    report["wall_s"] = time.time() - t0
    print(f"\nlinear_bench: {len(misses)} misses of the {BAR}x bar; {report['wall_s']:.1f} s -> "
          f"{write_device_json(report, 'linear_bench.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
