"""The proof on the GPU that `h3cute.patch(transformer, scope="model")` makes MiniMax-H3's whole forward and backward
batch-invariant, eager and under torch.compile (default, max-autotune-no-cudagraphs, and reduce-overhead: the rollout
under CUDA graphs against training compiled), with the rollout's no-grad graph giving the training graphs' bits
(perf/model_invariance.py runs the proofs, each (variant, mode) in a process started with vLLM's cuBLASLt settings;
these tests read its report)."""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "model_invariance.py"
MODES = ("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs")
pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    if importlib.util.find_spec("flash_attn") is None:
        pytest.skip("FlashAttention-4 (flash-attn-4) is not importable: scope='model' attends with it")
    out = Path(os.environ.get("H3CUTE_OUT", tmp_path_factory.mktemp("model_invariance"))) / "model_invariance.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--modes", ",".join(MODES), "--out", str(out)],
                          capture_output=True, text=True, timeout=3000)
    sys.stderr.write(done.stdout + done.stderr[-4000:])
    assert out.exists(), f"model_invariance.py wrote no report (exit {done.returncode}): {done.stderr[-2000:]}"
    return json.loads(out.read_text())


def _run(report, variant, mode="eager"):
    runs = {(r["variant"], r["mode"]): r for r in report["runs"]}
    assert (variant, mode) in runs, f"no {variant} run in mode {mode}: failed {report.get('failed')}"
    return runs[(variant, mode)]


def test_every_run_ran_at_h3_widths_on_cuda_and_the_model_scope_traced_whole(report):
    """A model-scope child compiles with fullgraph=True: a graph break would have failed it."""
    assert torch.cuda.is_available() and not report["quick"]
    assert not report.get("failed"), report.get("failed")
    m = _run(report, "model")
    assert m["layout"]["batch"] == 8 and m["layout"]["timesteps"] == 3
    assert "scope='model'" in m["patch_report"] and " 0 left to diffusers" in m["patch_report"]
    for mode in MODES:
        assert _run(report, "model", mode)["batch"]["checked"] == 8 * 9  # 3 x 2 outputs, 3 input gradients a sample


@pytest.mark.parametrize("mode", MODES)
def test_1_a_sample_is_bitwise_the_same_alone_in_a_batch_and_in_micro_batches_rollout_and_training(report, mode):
    b = _run(report, "model", mode)["batch"]
    assert b["invariant"], b["differ"][:10]


@pytest.mark.parametrize("mode", MODES)
def test_2_an_unused_fourth_timestep_changes_no_output_bit(report, mode):
    t = _run(report, "model", mode)["timesteps"]
    assert t["invariant"], t["differ"]


@pytest.mark.parametrize("mode", MODES)
def test_3_parameter_gradients_are_deterministic(report, mode):
    g = _run(report, "model", mode)["gradients"]
    assert g["parameters"] > 0 and g["deterministic"], (g["differ"][:10], g["without_gradient"][:10])


@pytest.mark.parametrize("variant, mode", [("unpatched", "eager"), ("conditioning", "eager"),
                                           ("unpatched", "default")])
def test_4_the_controls_fail_proof_1(report, variant, mode):
    b = _run(report, variant, mode)["batch"]
    assert not b["invariant"] and b["differ"], f"{variant} ({mode}): the negative control passed proof 1"


def test_5_outputs_stay_within_the_unpatched_models_error_against_fp64(report):
    m = _run(report, "model")
    for k, err in m["accuracy_patched"].items():
        base = m["accuracy_unpatched"][k]
        assert 0 < err <= report["accuracy_slack"] * base, f"{k}: patched {err:.3e}, unpatched {base:.3e}"


@pytest.mark.parametrize("mode", MODES[1:])
def test_6_compiled_bits_are_the_eager_bits(report, mode):
    """Every computation is an h3 op and Inductor keeps eager's roundings between them: a rollout compiled and a
    training step eager (or the reverse) agree bitwise, outputs and input gradients."""
    e = _run(report, "model", mode)["vs_eager"]
    assert e["checked"] == 8 * 5 and e["equal"], e["differ"][:10]
