"""h3cute.patch on CPU (the ops run their reference impls): a 2-block MiniMaxH3Transformer3DModel at H3's
widths with one head, a 64-wide FFN and 64 text channels. The patched model equals diffusers bitwise, every call
site goes through torch.ops.h3 (a dispatch mode sees the op calls), rows are validated once per forward before
any compute, every guard refuses with the module and the reason, unpatch restores exactly, patching twice
changes nothing, the class-level switch and its undo, gradient checkpointing, torch.compile, diffusers hooks.
"""
import dataclasses
import importlib.util
import inspect
import os
import pickle

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

if importlib.util.find_spec("diffusers") is None:
    if os.environ.get("CI") or os.environ.get("H3CUTE_REQUIRE_DIFFUSERS"):
        pytest.fail("diffusers==0.42.1 is required in CI for the patch tests", pytrace=False)
    pytest.skip("diffusers not installed", allow_module_level=True)

from diffusers.hooks import HookRegistry, ModelHook  # noqa: E402
from diffusers.hooks.context_parallel import ModuleForwardMetadata  # noqa: E402
from diffusers.models.embeddings import TimestepEmbedding, Timesteps  # noqa: E402
from diffusers.models.transformers import transformer_minimax_h3 as mh3  # noqa: E402

import h3cute  # noqa: E402
from h3cute import minimax_h3  # noqa: E402
from h3cute.bench.model import TINY, build_model, packed_inputs  # noqa: E402
from h3cute.widths import BLOCK_PROJECTION, FINAL_PROJECTION, FREQ, HIDDEN as H, MLP_HIDDEN, MODALITIES, NORM_EPS, TEMB

BF16 = torch.bfloat16
BLOCK_OPS = ["adaln_projection", "norm_modulate", "gate_residual_norm_modulate", "gate_residual"]
ALL_OPS = ["adaln_indices", "timestep_sinusoid", "timestep_mlp", *BLOCK_OPS, *BLOCK_OPS, "final_adaln_out"]
ONE_BLOCK = dataclasses.replace(TINY, layers=1)


@pytest.fixture(scope="module")
def model():
    m = build_model(TINY, seed=0)
    yield m
    assert not minimax_h3._PATCHES.get(m), "a test left the shared model patched"


@pytest.fixture(scope="module")
def inputs():
    return packed_inputs(TINY, video=9, text=5, audio=4, timesteps=3, batch=2, seed=1)


@pytest.fixture(scope="module")
def reference(model, inputs):
    """The unpatched model's outputs and its state, taken before any test patches it."""
    with torch.no_grad():
        out = model(**inputs)
    return out.sample, out.audio_sample


class H3Calls(TorchDispatchMode):
    """Records every torch.ops.h3 call (op name, arguments) made under it."""

    def __init__(self):
        super().__init__()
        self.calls, self.outs = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "h3":
            self.calls.append((func._opname, args))
            self.outs.append(list(out) if isinstance(out, (tuple, list)) else [out])
        return out

    @property
    def names(self):
        return [name for name, _ in self.calls]


def run(model, inputs, **extra):
    with torch.no_grad():
        out = model(**inputs, **extra)
    return out.sample, out.audio_sample


def snapshot(model):
    """Everything the patch may touch: classes, instance dicts' keys, hooks, parameters and buffers by identity."""
    return {
        "classes": [(n, type(m)) for n, m in model.named_modules()],
        "dict_keys": [(n, sorted(m.__dict__)) for n, m in model.named_modules()],
        "hooks": [(n, list(m._forward_pre_hooks), list(m._forward_hooks)) for n, m in model.named_modules()],
        "state": [(k, v.data_ptr(), v.dtype, tuple(v.shape)) for k, v in model.state_dict().items()],
        "params": [(n, id(p)) for n, p in model.named_parameters()],
        "buffers": [(n, id(b)) for n, b in model.named_buffers()],
    }


@pytest.fixture
def patched(model):
    p = h3cute.patch(model)
    yield p
    p.unpatch()


# ---- the patched model ---------------------------------------------------------------------------------

def test_patched_forward_is_bitwise_diffusers_and_every_site_runs_an_h3_op(model, inputs, reference, patched):
    with H3Calls() as mode:
        out = run(model, inputs)
    assert torch.equal(out[0], reference[0]) and torch.equal(out[1], reference[1])
    assert mode.names == ALL_OPS
    for name, args in mode.calls:  # rows validated once per forward: no per-call index check
        if name in ("norm_modulate", "gate_residual_norm_modulate", "gate_residual", "final_adaln_out"):
            assert args[-1] is False, name
    # (B, S, H) hidden states run as (B * S, H) rows with the S indices repeated B times
    norm_args = dict(mode.calls)["norm_modulate"]
    s = inputs["timestep_indices"].shape[0]
    assert norm_args[0].shape == (2 * s, H)
    idx = inputs["timestep_indices"] * MODALITIES + inputs["token_tags"]
    assert torch.equal(norm_args[4], idx.repeat(2))
    with H3Calls() as mode:
        assert patched.unpatch() is None
        run(model, inputs)
    assert mode.names == []


def test_rows_are_validated_once_per_forward_before_any_compute(model, inputs, patched, monkeypatch):
    seen = []
    monkeypatch.setattr(minimax_h3, "adaln_indices",
                        lambda ti, tags, t: seen.append((ti, tags, t)) or h3cute.adaln_indices(ti, tags, t))
    run(model, inputs)
    assert len(seen) == 1 and seen[0][2] == 3 and seen[0][0] is inputs["timestep_indices"]
    ran = []
    handle = model.rope.register_forward_pre_hook(lambda *a: ran.append(1))  # the first module forward calls
    try:
        for key, bad, match in (("timestep_indices", 3, r"timestep_indices\[7\] = 3 is outside \[0, 3\)"),
                                ("token_tags", 3, r"token_tags\[7\] = 3 is outside \[0, 3\)")):
            wrong = inputs[key].clone()
            wrong[7] = bad
            with H3Calls() as mode, pytest.raises(IndexError, match=rf"h3::adaln_indices: {match}"):
                run(model, {**inputs, key: wrong})
            assert mode.names == [] and ran == []
    finally:
        handle.remove()
    positional = [inputs[k] for k in ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep",
                                      "timestep_indices", "token_tags", "position_ids", "video_indices",
                                      "audio_indices", "text_indices")]
    with torch.no_grad():
        model(*positional)
    assert len(seen) == 4 and seen[-1][0] is inputs["timestep_indices"]


@pytest.fixture(scope="module")
def one_block():
    """A 1-block model for the fwd+bwd tests (the CPU backward of a 520 MB projection takes seconds)."""
    return build_model(ONE_BLOCK, seed=2)


def _grads(model, inputs, call=None):
    model.zero_grad(set_to_none=True)
    out = (model if call is None else call)(**inputs)
    ups = [torch.randn(o.shape, generator=torch.Generator().manual_seed(k))
           for k, o in enumerate((out.sample, out.audio_sample))]
    torch.autograd.backward([out.sample, out.audio_sample], ups)
    grads = {n: p.grad for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


H3_PARAMS = ("time_embedder.", "transformer_blocks.0.adaln_proj.", "transformer_blocks.0.norm1.",
             "transformer_blocks.0.norm2.", "norm_out.")


def test_training_step_against_diffusers_and_with_gradient_checkpointing(one_block, inputs):
    """The ops' CPU backward rounds once where diffusers' BF16 autograd rounds per op, so the gradients agree to
    BF16 accuracy, not bitwise; gradient checkpointing (the block's forward runs again in the backward) gives the
    patched gradients bitwise."""
    want = _grads(one_block, inputs)
    one_block.train()
    try:
        with h3cute.patch(one_block):
            got = _grads(one_block, inputs)
            one_block.enable_gradient_checkpointing()
            with H3Calls() as mode:
                checkpointed = _grads(one_block, inputs)
    finally:
        one_block.disable_gradient_checkpointing()
        one_block.eval()
    assert mode.names.count("norm_modulate") == 2 and "gate_residual_norm_modulate_backward" in mode.names
    owned = [n for n in got if n.startswith(H3_PARAMS)]
    assert len(owned) == 4 + 4 + 3 and got.keys() == want.keys() == checkpointed.keys()
    for n in got:
        assert got[n] is not None and got[n].dtype == want[n].dtype and not got[n].isnan().any(), n
        assert torch.equal(got[n], checkpointed[n]), n
        err = float((got[n].double() - want[n].double()).abs().max() / want[n].double().abs().max())
        assert err < 3e-2, (n, err)


def test_torch_compile(one_block, inputs):
    """torch.compile(transformer) traces the patched forwards (the ops' fake impls and autograd) and gives the
    eager patched model's outputs and gradients."""
    torch._dynamo.reset()
    try:
        with h3cute.patch(one_block):
            eager = run(one_block, inputs)
            eager_grads = _grads(one_block, inputs)
            compiled = torch.compile(one_block, backend="aot_eager")
            with H3Calls() as mode:
                out = run(compiled, inputs)
            got_grads = _grads(one_block, inputs, compiled)
    finally:
        torch._dynamo.reset()
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    assert "adaln_projection" in mode.names
    for n in eager_grads:
        assert torch.equal(got_grads[n], eager_grads[n]), n


# ---- structure -----------------------------------------------------------------------------------------

def test_structure_is_unchanged_and_unpatch_restores_exactly(model, inputs, reference):
    before = snapshot(model)
    names = [n for n, _ in model.named_modules()]
    signatures = {n: inspect.signature(type(m).forward) for n, m in model.named_modules()}
    p = h3cute.patch(model)
    during = snapshot(model)
    assert during["state"] == before["state"] and during["params"] == before["params"]
    assert during["buffers"] == before["buffers"] and [n for n, _ in model.named_modules()] == names
    assert {n: inspect.signature(type(m).forward) for n, m in model.named_modules()} == signatures
    changed = {n for (n, c), (_, c0) in zip(during["classes"], before["classes"]) if c is not c0}
    assert changed == {"time_proj", "time_embedder", "transformer_blocks.0", "transformer_blocks.1", "norm_out"}
    for n in changed:
        m = model.get_submodule(n)
        assert type(m).__name__ == dict(before["classes"])[n].__name__ and isinstance(m, dict(before["classes"])[n])
    assert len(model._forward_pre_hooks) == 1  # the row validation
    assert h3cute.patch(model) is p and snapshot(model) == during  # patching twice changes nothing
    p.unpatch()
    p.unpatch()
    assert snapshot(model) == before
    assert torch.equal(run(model, inputs)[0], reference[0])
    assert h3cute.patch(model) is not p  # a fresh patch after unpatch
    minimax_h3._PATCHES[model].unpatch()
    assert snapshot(model) == before


def test_report_lists_every_site_replaced_and_left(model):
    with h3cute.patch(model) as p:
        text = p.report()
        assert len(p.sites) == len(p.replaced) == 11 and p.left == ()
        assert text.count("replaced") == 11 and "0 left to diffusers" in text
        for op in ("timestep_sinusoid", "timestep_mlp", "adaln_projection", "norm_modulate",
                   "gate_residual_norm_modulate", "gate_residual", "final_adaln_out"):
            assert f"h3::{op}" in text
        assert "transformer_blocks.1.adaln_proj" in text and "check_indices=False" in text
        assert "every block's attn and ff" in text
    assert "unpatched" in p.report()


def test_diffusers_hooks_registered_after_the_patch_wrap_it_and_follow_unpatch(model, inputs, reference):
    """Context-parallel style hooks (diffusers' HookRegistry) registered after patching see the patched forward's
    signature and call it; after unpatch the same hooks run diffusers' forward."""
    class PassThrough(ModelHook):
        calls = 0

        def pre_forward(self, module, *args, **kwargs):
            PassThrough.calls += 1
            return args, kwargs

    block = model.transformer_blocks[1]
    p = h3cute.patch(model)
    HookRegistry.check_if_exists_or_initialize(block).register_hook(PassThrough(), "pass")
    try:
        meta = ModuleForwardMetadata(_cls=type(block))
        args = ("hidden", "temb", "indices", "rope")
        assert meta._get_parameter_from_args_kwargs("adaln_indices", args)[0] == "indices"
        with H3Calls() as mode:
            out = run(model, inputs)
        assert mode.names == ALL_OPS and PassThrough.calls == 1 and torch.equal(out[0], reference[0])
        p.unpatch()
        with H3Calls() as mode:
            out = run(model, inputs)
        assert mode.names == [] and PassThrough.calls == 2 and torch.equal(out[0], reference[0])
    finally:
        p.unpatch()
        HookRegistry.check_if_exists_or_initialize(block).remove_hook("pass")
        del block._diffusers_hook
    # diffusers puts back the forward it captured, the patched one bound to the block: disarmed, it runs diffusers
    with H3Calls() as mode:
        assert torch.equal(run(model, inputs)[0], reference[0])
    assert mode.names == []
    del block.__dict__["forward"]


def test_patched_modules_pickle_by_name(model):
    with h3cute.patch(model):
        again = pickle.loads(pickle.dumps(model.time_proj))
        assert type(again) is type(model.time_proj) and again._h3cute_armed
        assert torch.equal(again(torch.tensor([0.25])), torch.ops.h3.timestep_sinusoid(torch.tensor([0.25])))


def test_under_autocast_every_op_call_gives_its_eager_bits(model, inputs, patched):
    """CPU autocast (the GPU test does CUDA's): the patched model runs, and every h3 call, replayed eagerly
    without autocast on the arguments it received, gives the bits it gave."""
    with H3Calls() as mode, torch.autocast("cpu", dtype=BF16):
        run(model, inputs)
    assert mode.names == ALL_OPS
    replay = H3Calls()
    with replay:
        for name, args in mode.calls:
            getattr(torch.ops.h3, name)(*args)
    assert len(replay.outs) == len(mode.outs)
    for name, a, b in zip(mode.names, mode.outs, replay.outs):
        assert all(torch.equal(u, v) and u.dtype == v.dtype for u, v in zip(a, b)), name


def test_autocast_fp32_rows_are_cast_to_bf16():
    x = torch.randn(2, 3, H)
    assert minimax_h3._rows(x).dtype == torch.float32  # no autocast: the op will name the dtype
    with torch.autocast("cpu", dtype=BF16):
        r = minimax_h3._rows(x)
    assert r.shape == (6, H) and r.dtype == BF16 and torch.equal(r, x.reshape(6, H).to(BF16))
    y = torch.randn(2, 3, H).to(BF16)
    assert minimax_h3._rows(y).data_ptr() == y.data_ptr()  # a view, no pass
    with pytest.raises(ValueError, match="the batch axis of"):
        minimax_h3._row_index(torch.arange(4), 6)
    assert torch.equal(minimax_h3._row_index(torch.arange(3), 6), torch.tensor([0, 1, 2, 0, 1, 2]))


def test_refuses_what_is_not_a_minimax_h3_model():
    with pytest.raises(TypeError, match="expected diffusers' MiniMaxH3Transformer3DModel, got Linear"):
        h3cute.patch(nn.Linear(2, 2))


# ---- guards --------------------------------------------------------------------------------------------

class FakeLora(nn.Module):
    """The attributes of a PEFT LoRA layer wrapping a linear (peft is not a test dependency)."""

    def __init__(self, base):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.ModuleDict({"default": nn.Linear(base.in_features, 4, bias=False)})
        self.lora_B = nn.ModuleDict({"default": nn.Linear(4, base.out_features, bias=False)})


def _meta(module, dtype=None):
    module = module.to("meta")
    return module.to(dtype) if dtype is not None else module


def _with_hook(m):
    m.register_forward_hook(lambda *a: None)
    return m


def _wrapped(m):
    HookRegistry.check_if_exists_or_initialize(m).register_hook(ModelHook(), "x")
    return m


GUARDS = [  # (module path, replacement builder(model), message)
    ("time_proj", lambda m: Timesteps(FREQ, flip_sin_to_cos=False, downscale_freq_shift=0),
     rf"time_proj: is Timesteps\({FREQ}, flip_sin_to_cos=False, downscale_freq_shift=0, scale=1\); h3cute computes"),
    ("time_proj", lambda m: Timesteps(128, flip_sin_to_cos=True, downscale_freq_shift=0),
     r"time_proj: is Timesteps\(128,"),
    ("time_proj", lambda m: Timesteps(FREQ, flip_sin_to_cos=True, downscale_freq_shift=1),
     rf"time_proj: is Timesteps\({FREQ}, flip_sin_to_cos=True, downscale_freq_shift=1"),
    ("time_proj", lambda m: nn.Identity(), r"time_proj: is a Identity, not diffusers' Timesteps"),
    ("time_embedder", lambda m: _meta(TimestepEmbedding(FREQ, MLP_HIDDEN, out_dim=TEMB, cond_proj_dim=16)),
     r"time_embedder.cond_proj: a TimestepEmbedding with cond_proj"),
    ("time_embedder", lambda m: _meta(TimestepEmbedding(FREQ, MLP_HIDDEN, out_dim=TEMB, post_act_fn="silu")),
     r"time_embedder.post_act: a TimestepEmbedding with post_act"),
    ("time_embedder", lambda m: _meta(TimestepEmbedding(FREQ, MLP_HIDDEN, out_dim=TEMB, act_fn="gelu")),
     r"time_embedder.act: is GELU; timestep_mlp applies SiLU"),
    ("time_embedder", lambda m: _meta(TimestepEmbedding(FREQ, MLP_HIDDEN, out_dim=TEMB), BF16),
     r"time_embedder.linear_1: is bfloat16; the checkpoint keeps it float32"),
    ("time_embedder", lambda m: _meta(TimestepEmbedding(FREQ, MLP_HIDDEN, out_dim=1024)),
     rf"time_embedder.linear_2: weight has shape \(1024, {MLP_HIDDEN}\), not \({TEMB}, {MLP_HIDDEN}\): h3cute serves "
     rf"hidden {H}, time embedding {TEMB}, sinusoid {FREQ}"),
    ("time_embedder", lambda m: _meta(TimestepEmbedding(128, MLP_HIDDEN, out_dim=TEMB)),
     rf"time_embedder.linear_1: weight has shape \({MLP_HIDDEN}, 128\)"),
    ("time_embedder.linear_2", lambda m: FakeLora(_meta(nn.Linear(H, TEMB))),
     r"time_embedder.linear_2: carries a LoRA / PEFT adapter \(base_layer, lora_A\): the op would compute with the "
     r"base weight and drop the adapter's delta"),
    ("transformer_blocks.0.adaln_proj", lambda m: _meta(mh3.MiniMaxH3AdaLayerNormModulation(TEMB, 4096), BF16),
     rf"transformer_blocks.0.adaln_proj.linear: weight has shape \(73728, {TEMB}\), not "
     rf"\({BLOCK_PROJECTION}, {TEMB}\)"),
    ("transformer_blocks.0.adaln_proj.linear", lambda m: _meta(nn.Linear(TEMB, BLOCK_PROJECTION)),
     r"transformer_blocks.0.adaln_proj.linear: is float32; the checkpoint keeps it bfloat16 \(the AdaLN projections"),
    ("transformer_blocks.1.adaln_proj.linear", lambda m: FakeLora(m.transformer_blocks[1].adaln_proj.linear),
     r"transformer_blocks.1.adaln_proj.linear: carries a LoRA / PEFT adapter"),
    ("transformer_blocks.1.adaln_proj.linear", lambda m: _meta(nn.Linear(TEMB, BLOCK_PROJECTION, bias=False), BF16),
     r"transformer_blocks.1.adaln_proj.linear: has no bias"),
    ("transformer_blocks.0.norm1", lambda m: _meta(nn.RMSNorm(4096, eps=NORM_EPS), BF16),
     rf"transformer_blocks.0.norm1: normalizes \(4096,\) rows: h3cute serves hidden {H}"),
    ("transformer_blocks.1.norm2", lambda m: _meta(nn.RMSNorm(H, eps=NORM_EPS)),
     r"transformer_blocks.1.norm2: weight is float32; the checkpoint's norm weights are bfloat16"),
    ("transformer_blocks.1.norm2", lambda m: nn.RMSNorm(H, eps=NORM_EPS, elementwise_affine=False),
     r"transformer_blocks.1.norm2: has no weight"),
    ("transformer_blocks.0.norm1", lambda m: _meta(nn.LayerNorm(H), BF16),
     r"transformer_blocks.0.norm1: is a LayerNorm, not torch.nn.RMSNorm"),
    ("transformer_blocks.0.norm1", lambda m: _with_hook(_meta(nn.RMSNorm(H, eps=NORM_EPS), BF16)),
     r"transformer_blocks.0.norm1: has hooks or a wrapped forward that would not run"),
    ("transformer_blocks.1", lambda m: _wrapped(m.transformer_blocks[1]),
     r"transformer_blocks.1: its forward is already wrapped \(diffusers hooks\), and the wrapper would bypass the "
     r"patch: call h3cute.patch before enabling context parallelism"),
    ("norm_out.linear", lambda m: _meta(nn.Linear(TEMB, FINAL_PROJECTION)),
     r"norm_out.linear: is float32; the checkpoint keeps it bfloat16"),
    ("norm_out.norm", lambda m: _meta(nn.RMSNorm(H, eps=NORM_EPS), torch.float16),
     r"norm_out.norm: weight is float16"),
]


def _site_of(path):
    parts = path.split(".")
    return ".".join(parts[:2]) if parts[0] == "transformer_blocks" else parts[0]


def _replace(model, path, builder, monkeypatch):
    parent, _, leaf = path.rpartition(".")
    owner = model.get_submodule(parent) if parent else model
    new = builder(model)
    if new is not owner._modules[leaf]:
        monkeypatch.setitem(owner._modules, leaf, new)


@pytest.mark.parametrize("path, builder, match", GUARDS, ids=[f"{g[0]}-{i}" for i, g in enumerate(GUARDS)])
def test_guard_refuses_before_any_change_and_strict_false_leaves_the_module(model, monkeypatch, path, builder,
                                                                           match):
    _replace(model, path, builder, monkeypatch)
    try:
        before = snapshot(model)
        with pytest.raises(h3cute.PatchError, match=match) as err:
            h3cute.patch(model)
        assert "nothing was changed; strict=False leaves these modules to diffusers" in str(err.value)
        assert snapshot(model) == before and model not in minimax_h3._PATCHES
        with h3cute.patch(model, strict=False) as p:
            site = _site_of(path)
            left = {s.module for s in p.left}
            assert site in left or f"{site}.adaln_proj" in left, left
            assert all(s.left is not None and (s.module.startswith(site)) for s in p.left)
            assert len(p.replaced) == 11 - len(p.left)
            assert "left to diffusers:" in p.report() and len(p.left) in (1, 4)
            m = model.get_submodule(site)
            assert not getattr(m, "_h3cute_armed", False)
            others = [s.module for s in p.replaced]
            assert all(model.get_submodule(_site_of(o))._h3cute_armed for o in others)
        assert snapshot(model) == before
    finally:
        block = model.transformer_blocks[1]
        if hasattr(block, "_diffusers_hook"):
            block._diffusers_hook.remove_hook("x")
            del block._diffusers_hook
            del block.__dict__["forward"]  # diffusers leaves the forward it captured as an instance attribute


def test_strict_false_computes_a_left_module_with_diffusers(model, inputs, monkeypatch):
    monkeypatch.setitem(model._modules, "time_proj", Timesteps(FREQ, flip_sin_to_cos=False, downscale_freq_shift=0))
    want = run(model, inputs)
    with h3cute.patch(model, strict=False) as p:
        assert [s.module for s in p.left] == ["time_proj"]
        with H3Calls() as mode:
            got = run(model, inputs)
    assert mode.names == [op for op in ALL_OPS if op != "timestep_sinusoid"]
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_all_guards_are_reported_at_once(model, monkeypatch):
    monkeypatch.setitem(model._modules, "time_proj", Timesteps(128, flip_sin_to_cos=True, downscale_freq_shift=0))
    monkeypatch.setitem(model.norm_out._modules, "linear", _meta(nn.Linear(TEMB, FINAL_PROJECTION)))
    with pytest.raises(h3cute.PatchError) as err:
        h3cute.patch(model)
    msg = str(err.value)
    assert "\n  time_proj: is Timesteps(128" in msg and "\n  norm_out.linear: is float32" in msg


# ---- the class-level switch ----------------------------------------------------------------------------

def test_apply_to_minimax_h3_patches_models_built_later_and_undo_restores(inputs):
    names = {n: getattr(mh3, n) for n in minimax_h3._CLASS_NAMES}
    init = mh3.MiniMaxH3Transformer3DModel.__init__
    h3cute.apply_to_minimax_h3()
    try:
        h3cute.apply_to_minimax_h3()  # a second call does nothing
        assert mh3.MiniMaxH3Transformer3DModel.__init__ is not init
        assert all(getattr(mh3, n) is not c and issubclass(getattr(mh3, n), c) for n, c in names.items())
        m = build_model(ONE_BLOCK, seed=4)
        assert type(m.transformer_blocks[0]).__name__ == "MiniMaxH3TransformerBlock"
        assert not m.transformer_blocks[0]._h3cute_armed and m not in minimax_h3._PATCHES  # until its forward
        # hooks that wrap a block between construction and the first forward (context parallelism, accelerate)
        # wrap the patched forward: the first forward still arms it
        HookRegistry.check_if_exists_or_initialize(m.transformer_blocks[0]).register_hook(ModelHook(), "x")
        with H3Calls() as mode:
            got = run(m, inputs)
        assert mode.names == ALL_OPS[:7] + ["final_adaln_out"]
        p = minimax_h3._PATCHES[m]
        assert p.active and len(p.replaced) == 7 and len(m._forward_pre_hooks) == 1
        assert h3cute.patch(m) is p
        with H3Calls() as mode:
            run(m, inputs)
        assert mode.names == ALL_OPS[:7] + ["final_adaln_out"]
        # a guard that fails refuses at every forward, before any compute
        bad = build_model(ONE_BLOCK, seed=4)
        bad.time_embedder.to(BF16)
        for _ in range(2):
            with H3Calls() as mode, pytest.raises(h3cute.PatchError, match=r"time_embedder.linear_1: is bfloat16"):
                run(bad, inputs)
            assert mode.names == []
    finally:
        h3cute.undo_minimax_h3()
    h3cute.undo_minimax_h3()  # a second call does nothing
    assert mh3.MiniMaxH3Transformer3DModel.__init__ is init
    assert all(getattr(mh3, n) is c for n, c in names.items())
    assert all(type(x).__module__.startswith(("diffusers", "torch")) for x in m.modules())
    m.transformer_blocks[0]._diffusers_hook.remove_hook("x")
    assert not p.active and not m._forward_pre_hooks and not any("_h3cute_armed" in x.__dict__ for x in m.modules())
    with H3Calls() as mode:
        plain = run(m, inputs)
    assert mode.names == []
    assert torch.equal(plain[0], got[0]) and torch.equal(plain[1], got[1])
    assert type(build_model(ONE_BLOCK, seed=5).transformer_blocks[0]) is mh3.MiniMaxH3TransformerBlock


def test_apply_to_minimax_h3_reaches_from_config():
    h3cute.apply_to_minimax_h3(strict=False)
    try:
        with torch.device("meta"):
            m = mh3.MiniMaxH3Transformer3DModel.from_config(
                {"num_layers": 1, "num_refiner_layers": 1, "num_attention_heads": 1, "ffn_dim": 64, "text_dim": 64})
        assert isinstance(m.transformer_blocks[0], mh3.MiniMaxH3TransformerBlock)
        assert type(m.norm_out).__module__ == "h3cute.minimax_h3" and m.config.num_layers == 1
        assert len(m._forward_pre_hooks) == 1
    finally:
        h3cute.undo_minimax_h3()
    assert not m._forward_pre_hooks and type(m.norm_out) is mh3.MiniMaxH3AdaLayerNormOut
