"""Issue 26's proof on the H200: `h3cute.patch(transformer, scope="model")` makes MiniMax-H3's whole forward and
backward batch-invariant (perf/model_invariance.py runs the five proofs, each variant in a process started with
vLLM's cuBLASLt settings; these tests read its report)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "model_invariance.py"
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("FlashAttention-4 (flash-attn-4) is not importable: scope='model' attends with it")
    out = Path(os.environ.get("H3CUTE_OUT", tmp_path_factory.mktemp("model_invariance"))) / "model_invariance.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], capture_output=True, text=True,
                          timeout=1500)
    sys.stderr.write(done.stdout + done.stderr[-4000:])
    assert out.exists(), f"model_invariance.py wrote no report (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(out.read_text())


def _run(report, variant):
    return next(r for r in report["runs"] if r["variant"] == variant)


def test_the_report_ran_the_model_scope_at_h3_widths_on_cuda(report):
    assert torch.cuda.is_available() and not report["quick"]
    m = _run(report, "model")
    assert m["layout"]["batch"] == 8 and m["layout"]["timesteps"] == 3
    assert "scope='model'" in m["patch_report"] and " 0 left to diffusers" in m["patch_report"]
    assert m["batch"]["checked"] == 8 * 9  # per sample: 3 x 2 outputs and 3 input gradients


def test_1_a_sample_is_bitwise_the_same_alone_in_a_batch_and_in_micro_batches(report):
    b = _run(report, "model")["batch"]
    assert b["invariant"], b["differ"][:10]


def test_2_an_unused_fourth_timestep_changes_no_output_bit(report):
    t = _run(report, "model")["timesteps"]
    assert t["invariant"], t["differ"]


def test_3_parameter_gradients_are_deterministic(report):
    g = _run(report, "model")["gradients"]
    assert g["parameters"] > 0 and g["deterministic"], (g["differ"][:10], g["without_gradient"][:10])


def test_4_the_unpatched_model_and_the_conditioning_patch_fail_proof_1(report):
    for variant in ("unpatched", "conditioning"):
        b = _run(report, variant)["batch"]
        assert not b["invariant"] and b["differ"], f"{variant}: the negative control passed proof 1"


def test_5_outputs_stay_within_the_unpatched_models_error_against_fp64(report):
    m = _run(report, "model")
    for k, err in m["accuracy_patched"].items():
        base = m["accuracy_unpatched"][k]
        assert 0 < err <= report["accuracy_slack"] * base, f"{k}: patched {err:.3e}, unpatched {base:.3e}"
