"""perf/call_site_invariance.py's checks (the probe that measures, per call site of the MiniMax-H3 model, which
mechanism makes it batch-invariant): each check passes an invariant computation and fails a non-invariant one, and
the CPU smoke run produces a report whose negative control failed."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "call_site_invariance.py"


@pytest.fixture(scope="module")
def probe():
    spec = importlib.util.spec_from_file_location("call_site_invariance", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rows_check_passes_a_rowwise_op_and_catches_a_row_count_dependent_one(probe):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(40, 32, generator=g, dtype=torch.float64)
    up = torch.randn(40, 32, generator=g, dtype=torch.float64)
    # elementwise: a CPU BLAS GEMM is itself not row-count invariant (its GEMV path at one row)
    honest = probe.rows_check(lambda t: torch.tanh(t) * 3, x, up, (1, 7, 9, 33))
    assert honest == {"row_counts": 4, "failures": [], "invariant": True}

    def leaky(t):  # rows depend on how many share the call
        return torch.tanh(t) * 3 + 1e-3 * (t.shape[0] > 8)
    caught = probe.rows_check(leaky, x, up, (1, 7, 9, 33))
    assert not caught["invariant"] and [f["rows"] for f in caught["failures"]] == [1, 7]
    assert probe.negative_control(torch.device("cpu"), (1, 9))["invariant"] is False


def test_repeat_check_catches_a_nondeterministic_gradient(probe):
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 8, dtype=torch.float64)
    up = torch.randn(4, 8, dtype=torch.float64)
    assert probe.repeat_check(lambda t: t @ w.T, [x], up, [w])["deterministic"]

    class Noisy(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad + 1e-9 * torch.rand_like(grad)  # an atomics-like varying order
    r = probe.repeat_check(lambda t: Noisy.apply(t @ w.T), [x], up, [w])
    assert not r["deterministic"] and r["differ"] == 1


def test_cpu_smoke_run_reports_every_site_group(tmp_path):
    out = tmp_path / "csi.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    (run,) = report["runs"]
    assert run["mechanism"] == "plain" and run["negative_control"]["invariant"] is False
    sites = {s for e in run["groups"] for s in e["sites"]}
    assert {"proj_out", "audio_proj_out", "context_embedder", "transformer_blocks.0.attn.to_q",
            "transformer_blocks.1.ff.net.2"} <= sites
    assert not any(s.startswith("time_embedder") or ".adaln_proj" in s for s in sites)  # h3cute's sites
    assert "| plain | linear | proj_out |" in done.stdout


def test_cpu_smoke_run_keeps_only_the_kinds_asked_for(tmp_path):
    out = tmp_path / "csi.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--kinds", "rms_norm", "--out", str(out)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    kinds = {e["kind"] for e in report["runs"][0]["groups"]}
    assert kinds == {"rms_norm"} and report["kinds"] == "rms_norm"
    bad = subprocess.run([sys.executable, str(SCRIPT), "--mechanisms", "plain,fast"], capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode != 0 and "unknown mechanism(s) ['fast']" in bad.stderr


def test_measure_compares_sample_zero_alone_with_inside_the_batch(probe):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 16, 8, generator=g, dtype=torch.float64) for _ in range(3))
    qb, kb, vb = (torch.cat([t, torch.randn(3, 4, 16, 8, generator=g, dtype=torch.float64)]) for t in (q, k, v))
    up = torch.randn(4, 4, 16, 8, generator=g, dtype=torch.float64)

    def attend(a, b, c):  # per-sample softmax attention: sample 0 does not see its neighbours
        return torch.softmax(a @ b.transpose(-1, -2), -1) @ c
    e = probe._measure(attend, q, k, v, qb, kb, vb, up, torch.device("cpu"))
    assert e["batch_invariance"]["invariant"] and e["repeat"]["deterministic"] and e["fwd_us"] > 0

    def leaky(a, b, c):  # sample 0's output depends on the batch's mean
        return attend(a, b, c) + 1e-6 * a.mean()
    e = probe._measure(leaky, q, k, v, qb, kb, vb, up, torch.device("cpu"))
    assert not e["batch_invariance"]["invariant"] and e["batch_invariance"]["fwd_differ"]
