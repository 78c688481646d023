"""`h3cute-bench model` on CPU: the --quick smoke run end to end (JSON, markdown, PNG), --resume, --budget-s, and
the conditioning-share arithmetic. The measurement itself runs on the H200 (perf/results/h200/model.*)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from h3cute.bench import model_bench
from h3cute.widths import ATTENTION_HEADS, ATTENTION_HEAD_DIM, FFN, TEXT

ROOT = Path(__file__).resolve().parents[1]


def _cli(*args, timeout=900):
    import os

    import h3cute

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(Path(h3cute.__file__).resolve().parent.parent), os.environ.get("PYTHONPATH")]))}
    return subprocess.run([sys.executable, "-m", "h3cute.bench", "model", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def test_quick_run_resume_and_budget(tmp_path):
    out = tmp_path / "model.json"
    proc = _cli("--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr[-4000:]
    rep = json.loads(out.read_text())
    assert rep["kind"] == "h3_model_bench" and rep["complete"] is True
    assert [(r["mode"], r["phase"]) for r in rep["results"]] == [
        ("eager", "fwd"), ("eager", "fwd_bwd"), ("compile", "fwd"), ("compile", "fwd_bwd")]
    for r in rep["results"]:
        assert (r["S"], r["B"]) == (48, 2)
        for v in ("unpatched", "patched"):
            assert r[v]["ms"] > 0, (r, v)
            if r["mode"] == "eager":
                assert 0 < r[v]["share"] <= 1 and r[v]["conditioning_fwd_ms"] > 0
                assert (r[v]["conditioning_bwd_ms"] is not None) == (r["phase"] == "fwd_bwd")
        assert r["speedup"] == pytest.approx(r["unpatched"]["ms"] / r["patched"]["ms"])
    assert "h3::gate_residual_norm_modulate" in rep["patch_report"]
    md = out.with_suffix(".md").read_text()
    assert md.count("| eager | 48 | 2 |") == 2 and "| compile | 48 | 2 | fwd_bwd |" in md
    assert "| mode | S | B | phase |" in proc.stdout
    pytest.importorskip("matplotlib")
    assert out.with_suffix(".png").stat().st_size > 0
    # --resume with everything done measures nothing; --budget-s 0 starts no configuration
    again = _cli("--quick", "--out", str(out), "--resume", timeout=300)
    assert again.returncode == 0 and json.loads(out.read_text())["results"] == rep["results"]
    cut = tmp_path / "cut.json"
    stopped = _cli("--quick", "--out", str(cut), "--budget-s", "0", timeout=300)
    assert stopped.returncode == 3 and json.loads(cut.read_text())["complete"] is False


def _laid_out(durations: dict) -> dict:
    """Intervals of the given lengths laid end to end per phase, each block's attn and ff inside it."""
    iv, at = {}, {"fwd": 0.0, "bwd": 0.0}
    for (phase, site), ms in durations.items():
        if site.endswith((".attn", ".ff")):
            continue
        iv[(phase, site)] = (at[phase], at[phase] + ms)
        inner = iv[(phase, site)][0] + 0.5
        for part in ("attn", "ff"):
            if (phase, f"{site}.{part}") in durations:
                span = durations[(phase, f"{site}.{part}")]
                iv[(phase, f"{site}.{part}")] = (inner, inner + span)
                inner += span
        at[phase] += ms
    return iv


def test_conditioning_share_arithmetic():
    d = {("fwd", "time_proj"): 1.0, ("fwd", "time_embedder"): 2.0, ("fwd", "norm_out"): 3.0,
         ("fwd", "block0"): 10.0, ("fwd", "block0.attn"): 4.0, ("fwd", "block0.ff"): 5.0,
         ("bwd", "time_embedder"): 1.5, ("bwd", "norm_out"): 2.5, ("bwd", "block0"): 20.0,
         ("bwd", "block0.attn"): 9.0, ("bwd", "block0.ff"): 8.0}
    iv = _laid_out(d)
    assert model_bench.conditioning_ms(iv, "fwd", 1) == 1 + 2 + 3 + (10 - 4 - 5)
    assert model_bench.conditioning_ms(iv, "bwd", 1) == 1.5 + 2.5 + (20 - 9 - 8)
    assert model_bench.conditioning_ms(iv, "fwd", 2) is None  # block1's boundaries missing


def test_conditioning_counts_nested_sites_once():
    # as the autograd engine may order them: time_embedder's backward inside block 0's, after its attn and ff
    iv = {("bwd", "norm_out"): (0.0, 30.0), ("bwd", "block0"): (30.0, 400.0), ("bwd", "block0.ff"): (31.0, 33.0),
          ("bwd", "block0.attn"): (37.0, 43.0), ("bwd", "time_embedder"): (370.0, 390.0)}
    got = model_bench.conditioning_ms(iv, "bwd", 1)
    assert got == 30 + 370 - 2 - 6  # a sum of the site lengths would count time_embedder's 20 ms twice
    assert got <= 400.0
    assert model_bench._union([(5, 6), (0, 2), (1, 3), (3, 4)]) == [(0, 4), (5, 6)]


def test_layout_and_plan():
    assert model_bench.layout(4097) == {"video": 4097 - 256 - 512, "text": 256, "audio": 512}
    assert sum(model_bench.layout(32768).values()) == 32768
    full = model_bench.Plan()
    assert (full.sizes, full.batches, full.modes, full.phases) == ((4097, 32768), (1, 4), ("eager", "compile"),
                                                                     ("fwd", "fwd_bwd"))
    assert (full.size.heads, full.size.head_dim, full.size.ffn, full.size.text_dim, full.size.layers) == (
        ATTENTION_HEADS, ATTENTION_HEAD_DIM, FFN, TEXT, 2)
