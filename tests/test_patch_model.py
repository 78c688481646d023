"""h3cute.patch(transformer, scope="model") on a CPU: what it switches, what it refuses, what it restores, and that
its attention processor computes diffusers' processor (FlashAttention-4 replaced by SDPA here: the CPU has no
FA4). The proof on the GPU: tests/test_patch_model_gpu.py."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import h3cute
from h3cute import invariant
from h3cute.bench.model import TINY, build_model

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "model_invariance.py"


def _sdpa(q, k, v):  # (B, S, heads, head_dim), as FA4 takes them
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


@pytest.fixture
def fa4_stand_in(monkeypatch):
    monkeypatch.setattr(invariant, "attention", _sdpa)
    monkeypatch.setattr(invariant, "fa4_problem", lambda: None)


@pytest.fixture
def blas_environment(monkeypatch):
    for k, v in invariant.ENVIRONMENT.items():
        monkeypatch.setenv(k, v)


@pytest.fixture(scope="module")
def model():
    return build_model(TINY, seed=0)


def test_scope_is_checked(model):
    with pytest.raises(ValueError, match="scope must be one of"):
        h3cute.patch(model, scope="everything")
    with h3cute.patch(model):
        with pytest.raises(h3cute.PatchError, match="already patched with scope='conditioning'"):
            h3cute.patch(model, scope="model")


def test_missing_mechanisms_refuse_before_any_change(model, monkeypatch):
    for k in invariant.ENVIRONMENT:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(invariant, "fa4_problem", lambda: "FlashAttention-4 is not importable (test)")
    classes = {n: type(m) for n, m in model.named_modules()}
    processors = {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}
    with pytest.raises(h3cute.PatchError) as err:
        h3cute.patch(model, scope="model")
    text = str(err.value)
    assert "CUBLASLT_WORKSPACE_SIZE=None, not '1'" in text and "h3cute.invariant.set_environment()" in text
    assert "transformer_blocks.0.attn, transformer_blocks.1.attn" in text and "FlashAttention-4" in text
    assert text.count("FlashAttention-4 is not importable") == 1  # one line per reason, naming every site
    assert {n: type(m) for n, m in model.named_modules()} == classes
    assert {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")} == processors
    with h3cute.patch(model, scope="model", strict=False) as p:  # the heads are served, the rest left and said so
        assert {s.module for s in p.replaced} >= {"proj_in", "audio_proj_in", "proj_out", "audio_proj_out"}
        left = {s.module for s in p.left}
        assert {"transformer_blocks.0.attn", "context_embedder", "transformer_blocks.1.ff.net.2"} <= left
        assert not invariant._HOLDS[0]  # no BF16 linear served: the BLAS switches are not held


def test_model_scope_switches_every_site_and_unpatch_restores_them(model, fa4_stand_in, blas_environment):
    d = torch.backends.cuda.matmul
    before = d.allow_bf16_reduced_precision_reduction
    d.allow_bf16_reduced_precision_reduction = True
    classes = {n: type(m) for n, m in model.named_modules()}
    processors = {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")}
    try:
        with h3cute.patch(model, scope="model") as p:
            assert not p.left and p.scope == "model"
            ops = {s.module: s.op for s in p.replaced}
            assert all(ops[h] == "linear" for h in ("proj_in", "audio_proj_in", "proj_out", "audio_proj_out"))
            kept = {s.module: s.mechanism for s in p.by_mechanism}
            assert kept["transformer_blocks.0.attn"].startswith("FlashAttention-4")
            assert kept["transformer_blocks.0.ff.net.2"].startswith("cuBLASLt")
            assert "token_refiner.refiner_blocks.0.attn.norm_q" in kept and "context_embedder" in kept
            # the conditioning ops' linears and norms are h3 sites, not mechanism sites
            assert not {"norm_out.linear", "transformer_blocks.0.norm1", "time_embedder.linear_1"} & set(kept)
            assert isinstance(model.transformer_blocks[1].attn.processor, invariant.AttnProcessor)
            assert isinstance(model.token_refiner.refiner_blocks[0].attn.processor, invariant.AttnProcessor)
            assert d.allow_bf16_reduced_precision_reduction is False
            assert "0 left to diffusers" in p.report() and "invariant by a mechanism" in p.report()
        assert d.allow_bf16_reduced_precision_reduction is True
        assert {n: type(m) for n, m in model.named_modules()} == classes
        assert {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")} == processors
    finally:
        d.allow_bf16_reduced_precision_reduction = before


def test_attention_processor_computes_diffusers_processor(model, fa4_stand_in):
    """With SDPA standing in for FA4, the processor gives the bits of diffusers' own (same SDPA underneath):
    projections, q/k norms, rotary embedding and output projection are diffusers' computation."""
    from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb
    attn = model.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 33, 5376, generator=g).to(torch.bfloat16)
    cos, sin = (torch.randn(33, 128, generator=g) for _ in range(2))
    with torch.no_grad():
        want = attn.processor(attn, x, (cos, sin))
        got = invariant.AttnProcessor(_apply_rotary_emb)(attn, x, (cos, sin))
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="takes no attention_mask"):
        invariant.AttnProcessor(_apply_rotary_emb)(attn, x, (cos, sin), attention_mask=torch.ones(1))
    with pytest.raises(TypeError, match="FlashAttention-4 takes BF16 or FP16"):
        invariant.AttnProcessor(_apply_rotary_emb)(attn.float(), x.float(), (cos, sin))
    attn.to(torch.bfloat16)


def test_set_environment_before_cuda_and_refused_after(monkeypatch):
    for k in invariant.ENVIRONMENT:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(invariant.MechanismUnavailable, match="CUDA is already initialized"):
        invariant.set_environment()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    invariant.set_environment()
    assert not invariant.environment_problems()


def test_model_bench_refuses_the_model_variant_without_the_environment(tmp_path, monkeypatch):
    from dataclasses import replace

    from h3cute.bench import model_bench
    for k in invariant.ENVIRONMENT:
        monkeypatch.delenv(k, raising=False)
    plan = replace(model_bench.QUICK, variants=("model",))
    with pytest.raises(SystemExit, match="needs vLLM's cuBLASLt settings"):
        model_bench.run(plan, tmp_path / "m.json", device="cpu")


def test_the_proofs_harness_runs_end_to_end_on_a_cpu(tmp_path):
    """perf/model_invariance.py --quick: the tiny model, SDPA for FA4. A smoke run of the harness (the proofs hold
    on a CPU too, and the negative controls fail there as well: CPU GEMMs are not row-count invariant either)."""
    out = tmp_path / "mi.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], capture_output=True, text=True,
                          timeout=900)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["verdict"]) == {"1_batch", "2_timesteps", "3_gradients", "4_controls_fail", "5_accuracy"}
    model_run = next(r for r in report["runs"] if r["variant"] == "model")
    assert model_run["batch"]["checked"] == 8 * 9 and model_run["gradients"]["parameters"] > 0
    assert "| 1_batch |" in done.stdout


def test_apply_to_minimax_h3_with_the_model_scope(fa4_stand_in, blas_environment):
    """Models built under apply_to_minimax_h3(scope="model") are patched with that scope at their first forward
    (heads on h3::linear, attention on the processor), and undo_minimax_h3 puts everything back."""
    from h3cute import minimax_h3
    from h3cute.bench.model import packed_inputs
    with pytest.raises(ValueError, match="scope must be one of"):
        h3cute.apply_to_minimax_h3(scope="all")
    h3cute.apply_to_minimax_h3(scope="model")
    try:
        m = build_model(TINY, seed=3)
        with torch.no_grad():
            m(**packed_inputs(TINY, video=20, text=5, audio=6, seed=2))
        p = minimax_h3._PATCHES[m]
        assert p.scope == "model" and not p.left
        assert isinstance(m.transformer_blocks[0].attn.processor, invariant.AttnProcessor)
        assert getattr(m.proj_out, "_h3cute_armed", False)
    finally:
        h3cute.undo_minimax_h3()
    assert not p.active and not isinstance(m.transformer_blocks[0].attn.processor, invariant.AttnProcessor)
    assert all(type(x).__module__.startswith(("diffusers", "torch")) for x in m.modules())
