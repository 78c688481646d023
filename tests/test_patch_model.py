"""h3cute.patch(transformer, scope="model") on a CPU: what it switches, what it refuses, what it restores, that its
attention processor computes diffusers' processor, and that torch.compile(fullgraph=True) traces both scopes and
gives the patched model's eager bits, forward and backward (h3::attention runs its FP32 reference on a CPU: the CPU
has no FlashAttention-4). The proof on the GPU: tests/test_patch_model_gpu.py."""
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import h3cute
from bitwise import assert_same_bits
from h3cute import invariant
from h3cute.bench.model import TINY, build_model

SCRIPT = Path(__file__).resolve().parents[1] / "perf" / "model_invariance.py"


@pytest.fixture
def fa4_stand_in(monkeypatch):
    """The patch asks for FlashAttention-4, which a CPU lacks; h3::attention's CPU impl is its FP32 reference."""
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
        assert not invariant._BLAS.count  # no BF16 linear served: the BLAS switches are not held


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
            assert ops["transformer_blocks.0.attn"] == "attention" and ops["transformer_blocks.0.ff.net.2"] == "dense"
            assert ops["token_refiner.refiner_blocks.0.attn.norm_q"] == "rms_norm"  # the refiner has no angles
            assert ops["transformer_blocks.1.attn.norm_k"] == "qk_norm_rotary"
            assert ops["context_embedder"] == "dense"
            assert ops["transformer_blocks.1.ff.net.0"] == "swiglu" and ops["rope"] == "rotary_table"
            assert ops["token_refiner.final_norm"] == "rms_norm"
            within = {s.module: s.mechanism for s in p.replaced if s.mechanism}
            assert within["transformer_blocks.0.attn"].startswith("FlashAttention-4")
            assert within["transformer_blocks.0.ff.net.2"].startswith("cuBLASLt")
            # the conditioning ops' linears and norms are served by the conditioning ops, not switched themselves
            assert not {"norm_out.linear", "transformer_blocks.0.norm1", "time_embedder.linear_1"} & set(ops)
            assert isinstance(model.transformer_blocks[1].attn.processor, invariant.AttnProcessor)
            assert isinstance(model.token_refiner.refiner_blocks[0].attn.processor, invariant.AttnProcessor)
            assert d.allow_bf16_reduced_precision_reduction is False
            assert torch._inductor.config.emulate_precision_casts is True
            assert "0 left to diffusers" in p.report() and "h3::dense (cuBLASLt" in p.report()
        assert d.allow_bf16_reduced_precision_reduction is True
        assert torch._inductor.config.emulate_precision_casts is False
        assert {n: type(m) for n, m in model.named_modules()} == classes
        assert {n: m.processor for n, m in model.named_modules() if hasattr(m, "processor")} == processors
    finally:
        d.allow_bf16_reduced_precision_reduction = before


def test_attention_processor_computes_diffusers_processor(model, monkeypatch):
    """With diffusers' attention dispatch computing h3::attention, diffusers' processor gives the bits of h3cute's:
    projections, q/k norms, rotary embedding and output projection are diffusers' computation on the h3 ops."""
    from diffusers.models.transformers import transformer_minimax_h3 as module
    monkeypatch.setattr(module, "dispatch_attention_fn", lambda q, k, v, **kw: torch.ops.h3.attention(q, k, v))
    attn = model.transformer_blocks[0].attn
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 33, 5376, generator=g).to(torch.bfloat16)
    cos, sin = (torch.randn(33, 96, generator=g) for _ in range(2))
    with torch.no_grad():
        want = attn.processor(attn, x, (cos, sin))
        got = invariant.AttnProcessor()(attn, x, (cos, sin))
    assert_same_bits(got, want, "h3cute's attention processor against diffusers'")
    with pytest.raises(ValueError, match="takes no attention_mask"):
        invariant.AttnProcessor()(attn, x, (cos, sin), attention_mask=torch.ones(1))
    with pytest.raises(TypeError, match="h3::attention takes BF16"):
        invariant.AttnProcessor()(attn.float(), x.float(), (cos, sin))
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
    """perf/model_invariance.py --quick --modes eager: the tiny model, h3::attention's CPU reference for FA4. A smoke
    run of the harness, not a proof: on a CPU the ops are torch's CPU kernels, whose GEMMs are not row-count
    invariant, so proof 1 and proof 2 need not hold here; the report must still be whole and the controls fail."""
    out = tmp_path / "mi.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--modes", "eager", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert out.exists(), done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["verdict"]) == {"0_every_run_ran", "1_batch", "2_timesteps", "3_gradients", "4_controls_fail",
                                      "5_accuracy"}
    assert report["verdict"]["0_every_run_ran"] and report["verdict"]["4_controls_fail"]
    assert report["verdict"]["3_gradients"] and report["verdict"]["5_accuracy"]
    runs = {(r["variant"], r["mode"]) for r in report["runs"]}
    assert runs == {("model", "eager"), ("conditioning", "eager"), ("unpatched", "eager")}
    model_run = next(r for r in report["runs"] if r["variant"] == "model")
    assert model_run["batch"]["checked"] == 8 * 9 and model_run["gradients"]["parameters"] > 0
    assert "| 1_batch |" in done.stdout and "| model | eager |" in done.stdout


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


def _fwd_bwd(fn, inputs):
    leaves = {k: (v.detach().clone().requires_grad_(True) if k in INPUTS else v) for k, v in inputs.items()}
    out = fn(**leaves)
    (out.sample.float().square().sum() + out.audio_sample.float().sum()).backward()
    return [out.sample.detach(), out.audio_sample.detach()] + [leaves[k].grad for k in INPUTS]


INPUTS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states")


@pytest.mark.parametrize("scope", ["conditioning", "model"])
def test_compiled_fullgraph_gives_the_patched_models_eager_bits(scope, fa4_stand_in, blas_environment):
    """torch.compile(fullgraph=True) traces the patched model whole (no graph break), and Inductor's forward and
    backward give the eager bits of the same patched model: outputs and input gradients (model scope; the
    conditioning scope leaves diffusers' own ops to Inductor, so only its tracing is checked)."""
    from h3cute.bench.model import packed_inputs
    size = replace(TINY, layers=2)
    m = build_model(size, seed=4)
    inputs = packed_inputs(size, video=20, text=5, audio=6, timesteps=2, batch=2, seed=5)
    with h3cute.patch(m, scope=scope):
        torch._dynamo.reset()
        compiled = torch.compile(m, fullgraph=True, backend="inductor" if scope == "model" else "aot_eager")
        got = _fwd_bwd(compiled, inputs)
        with torch.no_grad():
            rollout = compiled(**inputs)
        if scope == "model":
            want = _fwd_bwd(m, inputs)
            for i, (a, b) in enumerate(zip(got, want)):
                assert_same_bits(a, b, f"compiled against eager, output / input gradient {i}")
            assert_same_bits(rollout.sample, want[0], "the compiled no-grad forward against the training forward")
    torch._dynamo.reset()


@pytest.mark.gpu
def test_the_conditioning_scope_traces_whole_on_cuda():
    """torch.compile(fullgraph=True, Inductor) of the conditioning-patched model on CUDA: no graph break, forward and
    backward finite (the model scope's compiled runs are perf/model_invariance.py's, in processes with vLLM's
    settings)."""
    from h3cute.bench.model import packed_inputs
    size = replace(TINY, layers=2)
    m = build_model(size, device="cuda", seed=4)
    inputs = packed_inputs(size, video=20, text=5, audio=6, timesteps=2, batch=2, device="cuda", seed=5)
    with h3cute.patch(m):
        torch._dynamo.reset()
        got = _fwd_bwd(torch.compile(m, fullgraph=True), inputs)
    assert all(bool(t.isfinite().all()) for t in got)
    torch._dynamo.reset()
