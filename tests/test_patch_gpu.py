"""The end-to-end proofs of issue 24 on the GPU: diffusers' MiniMaxH3Transformer3DModel at H3's widths with 2 blocks
and 1 refiner layer (one head of 128, a 64-wide FFN, 64 text channels), random weights in the checkpoint's mixed
precision, a packed layout of 600 video, 77 text and 130 audio rows, T = 3, B = 2.

Module hooks record what every conditioning call site receives and returns (`Boundaries`: time_proj,
time_embedder, each block and its attn / ff, norm_out; in diffusers' model also each block's adaln_proj and
norm2, which the patched block no longer calls), and a dispatch mode records every torch.ops.h3 call.

1. Parity: the h3 op of each site, on the inputs diffusers' site received, gives diffusers' bits where the op's
   contract is bitwise (sinusoid, norm/modulate, gated residuals, final modulate) and is within its FP64 bar where
   it is not (the MLP, the projections); in the patched model every site is an h3 op whose outputs are its inputs'.
2. T-invariance: a fourth, unused timestep leaves the patched model's video and audio outputs bitwise unchanged
   (diffusers' model, the negative control, is reported, not asserted).
3. Training step: with torch's deterministic algorithms (and CUBLAS_WORKSPACE_CONFIG, in a child process) two
   fwd+bwd give bitwise-equal gradients for every parameter; without them every h3-backed parameter gradient is
   the backward op of its captured upstream gradient, bit for bit, and replays the same.
4. Autocast and torch.compile: under `torch.autocast("cuda", torch.bfloat16)` and under `torch.compile(model)`
   every site's outputs are, bitwise, the eager op (no autocast) on the inputs the site received.
"""
import json
import os
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import h3cute
from h3cute import reference as R
from h3cute.bench.model import TINY, build_model, packed_inputs
from h3cute.bench.report import write_device_json
from h3cute.widths import BLOCK_CHUNKS, BLOCK_TABLE, HIDDEN as H

from bitwise import assert_same_bits, same_bits

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
LAYOUT = dict(video=600, text=77, audio=130, timesteps=3, batch=2)
BLOCK_OPS = ["adaln_projection", "norm_modulate", "gate_residual_norm_modulate", "gate_residual"]
SITE_OPS = ["timestep_sinusoid", "timestep_mlp", *BLOCK_OPS, *BLOCK_OPS, "final_adaln_out"]
BACKWARD_OPS = Counter({"timestep_mlp_backward": 1, "adaln_projection_backward": 2, "norm_modulate_backward": 2,
                        "gate_residual_norm_modulate_backward": 2, "gate_residual_backward": 2,
                        "final_adaln_out_backward": 1})


def backward_ops() -> Counter:
    """BACKWARD_OPS as dispatched: the fused op's C++ autograd runs its backward as the two-op chain's backward ops
    (norm_modulate_backward, then gate_residual_backward), the Python one as the fused backward op."""
    from h3cute import native
    if "gate_residual_norm_modulate" not in native.native_autograd_ops():
        return BACKWARD_OPS
    fused = BACKWARD_OPS["gate_residual_norm_modulate_backward"]
    return BACKWARD_OPS - Counter({"gate_residual_norm_modulate_backward": fused}) + Counter(
        {"norm_modulate_backward": fused, "gate_residual_backward": fused})
H3_PARAMS = {"time_embedder.linear_1.weight", "time_embedder.linear_1.bias", "time_embedder.linear_2.weight",
             "time_embedder.linear_2.bias", "norm_out.norm.weight", "norm_out.linear.weight", "norm_out.linear.bias",
             *(f"transformer_blocks.{i}.{p}" for i in range(2)
               for p in ("adaln_proj.linear.weight", "adaln_proj.linear.bias", "norm1.weight", "norm2.weight"))}
# (output index, index of the parameter argument) of each backward op; "bias_of": the bias of that weight argument
PARAM_GRADS = {
    "timestep_mlp_backward": [(1, 2), (2, 3), (3, 4), (4, "bias_of", 4)],
    "adaln_projection_backward": [(1, 2), (2, "bias_of", 2)],
    "norm_modulate_backward": [(1, 2)],
    "gate_residual_norm_modulate_backward": [(3, 5)],
    "final_adaln_out_backward": [(1, 2), (3, 4), (4, 5)],
}


@pytest.fixture(scope="module")
def model():
    m = build_model(TINY, device="cuda", seed=0)
    yield m
    assert not h3cute.minimax_h3._PATCHES.get(m), "a test left the shared model patched"


@pytest.fixture(scope="module")
def inputs():
    return packed_inputs(TINY, device="cuda", seed=1, **LAYOUT)


def _op_name(func) -> str:
    name = func._opname
    return name[: -len("_fwd")] if name.endswith("_fwd") else name  # final_adaln_out's autograd forward


class H3Calls(TorchDispatchMode):
    """Every torch.ops.h3 call under it (forward and backward): name, argument data pointers, cloned arguments and
    outputs."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.namespace == "h3":
            ptrs = [a.data_ptr() if torch.is_tensor(a) else None for a in args]
            clone = [a.clone() if torch.is_tensor(a) else a for a in args]
            outs = [o.clone() for o in (out if isinstance(out, (tuple, list)) else [out])]
            self.calls.append((_op_name(func), func, ptrs, clone, outs))
        return out

    @property
    def names(self):
        return [c[0] for c in self.calls]


class Boundaries:
    """Forward hooks on the modules around every conditioning call site: `v["<site>.in"]` the tensor arguments it
    received, `v["<site>.out"]` what it returned."""

    def __init__(self, model):
        self.v, self.handles = {}, []
        self._add(model.time_proj, "time_proj")
        self._add(model.time_embedder, "time_embedder")
        for i, b in enumerate(model.transformer_blocks):
            for m, name in ((b, f"b{i}"), (b.attn, f"b{i}.attn"), (b.ff, f"b{i}.ff"),
                            (b.adaln_proj, f"b{i}.adaln_proj"), (b.norm2, f"b{i}.norm2")):
                self._add(m, name)
        self._add(model.norm_out, "norm_out")

    def _add(self, module, name):
        def pre(mod, args, kwargs):
            self.v[f"{name}.in"] = tuple(a for a in args if torch.is_tensor(a))

        def post(mod, args, kwargs, out):
            self.v[f"{name}.out"] = out

        self.handles += [module.register_forward_pre_hook(pre, with_kwargs=True),
                         module.register_forward_hook(post, with_kwargs=True)]

    def __enter__(self):
        return self.v

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()


def _rel_err(out, ref) -> float:
    ref = ref.double()
    assert torch.isfinite(out).all()
    return float((out.double() - ref).abs().max() / ref.abs().max())


def _rows(t):
    """What the patched modules hand the ops: (B*S, H) BF16 rows (FP32 rows under autocast are cast)."""
    return t.reshape(-1, H).to(BF16)


def _repeat(index, rows):
    return index.repeat(rows // index.shape[0])


def _outputs(model, inputs, **kw):
    with torch.no_grad():
        out = model(**{**inputs, **kw})
    return out.sample, out.audio_sample


def replay_sites(model, v, what):
    """Each h3 call site's op, eager and without autocast, on the inputs the site received equals, bitwise, what
    the site returned."""
    ops = torch.ops.h3
    assert_same_bits(ops.timestep_sinusoid(v["time_proj.in"][0]), v["time_proj.out"], f"{what}: timestep_sinusoid")
    te = model.time_embedder
    mlp = ops.timestep_mlp(v["time_embedder.in"][0], te.linear_1.weight, te.linear_1.bias, te.linear_2.weight,
                           te.linear_2.bias)
    assert_same_bits(mlp, v["time_embedder.out"], f"{what}: timestep_mlp")
    for i, blk in enumerate(model.transformer_blocks):
        x_in, temb, idx = v[f"b{i}.in"]
        x = _rows(x_in)
        ridx = _repeat(idx, x.shape[0])
        proj = blk.adaln_proj.linear
        c = ops.adaln_projection(temb, proj.weight, proj.bias).view(-1, BLOCK_TABLE).chunk(BLOCK_CHUNKS, dim=-1)
        n1 = ops.norm_modulate(x, blk.norm1.weight, c[0], c[1], ridx, blk.norm1.eps)
        assert_same_bits(n1, v[f"b{i}.attn.in"][0].reshape(-1, H), f"{what}: block {i} norm_modulate")
        h, n2 = ops.gate_residual_norm_modulate(x, _rows(v[f"b{i}.attn.out"]), c[2], blk.norm2.weight, c[3], c[4],
                                                ridx, blk.norm2.eps)
        assert_same_bits(n2, v[f"b{i}.ff.in"][0].reshape(-1, H), f"{what}: block {i} gate_residual_norm_modulate")
        out = ops.gate_residual(h, _rows(v[f"b{i}.ff.out"]), c[5], ridx)
        assert_same_bits(out, v[f"b{i}.out"].reshape(-1, H), f"{what}: block {i} gate_residual")
    x_in, temb, ti = v["norm_out.in"]
    x, no = _rows(x_in), model.norm_out
    fo = ops.final_adaln_out(x, no.norm.weight, temb, no.linear.weight, no.linear.bias, _repeat(ti, x.shape[0]),
                             no.norm.eps)
    assert_same_bits(fo, v["norm_out.out"].reshape(-1, H), f"{what}: final_adaln_out")


# ---- 1. parity -----------------------------------------------------------------------------------------

def test_parity_with_diffusers_at_every_call_site(model, inputs):
    with Boundaries(model) as u:
        ref = _outputs(model, inputs)
    with h3cute.patch(model), Boundaries(model) as v, H3Calls() as calls:
        out = _outputs(model, inputs)
    assert [n for n in calls.names if n in SITE_OPS] == SITE_OPS  # (another h3 op may validate the rows)
    assert not any(k.startswith(("b0.adaln_proj", "b0.norm2")) for k in v)  # the patched block calls neither
    replay_sites(model, v, "patched model")
    ops = torch.ops.h3

    # bitwise sites, on the inputs diffusers' sites received (its own table chunks included)
    t = u["time_proj.in"][0]
    assert_same_bits(ops.timestep_sinusoid(t), u["time_proj.out"], "timestep_sinusoid vs diffusers")
    for i, blk in enumerate(model.transformer_blocks):
        x_in, temb, idx = u[f"b{i}.in"]
        x = x_in.reshape(-1, H)
        ridx = _repeat(idx, x.shape[0])
        c = u[f"b{i}.adaln_proj.out"]  # diffusers' six (3T, H) chunks, row-strided views of its projection
        assert len(c) == BLOCK_CHUNKS and c[0].stride(0) == BLOCK_TABLE
        n1 = ops.norm_modulate(x, blk.norm1.weight, c[0], c[1], ridx, blk.norm1.eps)
        assert_same_bits(n1, u[f"b{i}.attn.in"][0].reshape(-1, H), f"block {i} norm_modulate vs diffusers")
        h, n2 = ops.gate_residual_norm_modulate(x, u[f"b{i}.attn.out"].reshape(-1, H), c[2], blk.norm2.weight,
                                                c[3], c[4], ridx, blk.norm2.eps)
        assert_same_bits(h, u[f"b{i}.norm2.in"][0].reshape(-1, H), f"block {i} gated residual (h) vs diffusers")
        assert_same_bits(n2, u[f"b{i}.ff.in"][0].reshape(-1, H), f"block {i} norm2 modulate vs diffusers")
        o = ops.gate_residual(h, u[f"b{i}.ff.out"].reshape(-1, H), c[5], ridx)
        assert_same_bits(o, u[f"b{i}.out"].reshape(-1, H), f"block {i} gate_residual vs diffusers")
        # the projection: within its bar against FP64, on diffusers' temb
        proj = blk.adaln_proj.linear
        table = ops.adaln_projection(temb, proj.weight, proj.bias)
        assert _rel_err(table, R.adaln_projection_fp64(temb, proj.weight, proj.bias)) <= 1e-2
        assert _rel_err(table.view(-1, BLOCK_TABLE), torch.cat(c, dim=-1)) <= 1e-2

    # the MLP within its FP64 bar
    te = model.time_embedder
    args = (u["time_embedder.in"][0], te.linear_1.weight, te.linear_1.bias, te.linear_2.weight, te.linear_2.bias)
    assert _rel_err(ops.timestep_mlp(*args), R.timestep_mlp_fp64(*args)) <= 1e-5
    assert _rel_err(ops.timestep_mlp(*args), u["time_embedder.out"]) <= 1e-5

    # norm_out: the projection within its bar, the modulate bitwise the replay given the op's own table
    x_in, temb, ti = u["norm_out.in"]
    x, no = x_in.reshape(-1, H), model.norm_out
    ti = _repeat(ti, x.shape[0])
    fargs = (x, no.norm.weight, temb, no.linear.weight, no.linear.bias, ti)
    fo, table = ops.final_adaln_out_fwd(*fargs, no.norm.eps)
    assert _rel_err(fo, R.final_adaln_out_fp64(*fargs, no.norm.eps)) <= 1e-2
    shift, scale = table.chunk(2, dim=-1)
    assert_same_bits(fo, R.norm_modulate_replay(x, no.norm.weight, shift, scale, ti, no.norm.eps),
                     "final_adaln_out modulate vs the replay on its table")
    assert _rel_err(fo, u["norm_out.out"].reshape(-1, H)) <= 2e-2

    # the whole model tracks diffusers' to BF16 accuracy
    assert _rel_err(out[0], ref[0]) <= 5e-2 and _rel_err(out[1], ref[1]) <= 5e-2


# ---- 2. T-invariance -----------------------------------------------------------------------------------

def test_an_unused_timestep_changes_no_output_bit(model, inputs):
    four = torch.cat([inputs["timestep"], torch.tensor([0.4375], device="cuda")])
    with h3cute.patch(model):
        base = _outputs(model, inputs)
        again = _outputs(model, inputs)
        more = _outputs(model, inputs, timestep=four)
    assert same_bits(base, again), "the patched model is not repeatable"
    assert_same_bits(more[0], base[0], "video output with a fourth, unused timestep")
    assert_same_bits(more[1], base[1], "audio output with a fourth, unused timestep")
    # negative control: diffusers' model, the same check (reported, not asserted)
    plain, plain_more = _outputs(model, inputs), _outputs(model, inputs, timestep=four)
    control = {
        "patched_holds": True,
        "unpatched_holds": same_bits(plain, plain_more),
        "unpatched_video_elements_differ": int((plain[0] != plain_more[0]).sum()),
        "unpatched_audio_elements_differ": int((plain[1] != plain_more[1]).sum()),
        "layout": LAYOUT,
    }
    if os.environ.get("H3CUTE_OUT"):
        write_device_json(control, "patch_t_invariance.json")
    warnings.warn(f"T-invariance negative control (diffusers' model, 3 vs 4 timesteps): {json.dumps(control)}")


# ---- 3. a training step --------------------------------------------------------------------------------

DETERMINISTIC_STEP = r"""
import json
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import h3cute
from h3cute.bench.model import TINY, build_model, packed_inputs

torch.use_deterministic_algorithms(True)
model = build_model(TINY, device="cuda", seed=0).train()
inputs = packed_inputs(TINY, device="cuda", seed=1, **LAYOUT)
h3cute.patch(model)


def bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def step():
    model.zero_grad(set_to_none=True)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # the SDPA backend whose backward is deterministic
        out = model(**inputs)
        g = torch.Generator(device="cuda").manual_seed(9)
        ups = [torch.randn(o.shape, generator=g, device="cuda") for o in (out.sample, out.audio_sample)]
        torch.autograd.backward([out.sample, out.audio_sample], ups)
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


a, b = step(), step()
print(json.dumps({"params": len(a), "missing": sorted(n for n in a if a[n] is None),
                  "differ": sorted(n for n in a if a[n] is not None and not torch.equal(bits(a[n]), bits(b[n])))}))
"""


def test_training_step_is_bitwise_repeatable_with_deterministic_algorithms(model):
    """A child process: CUBLAS_WORKSPACE_CONFIG must be set before cuBLAS starts."""
    import h3cute as pkg

    root = str(Path(pkg.__file__).resolve().parent.parent)
    env = {**os.environ, "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
           "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    code = f"LAYOUT = {LAYOUT!r}\n" + DETERMINISTIC_STEP
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["missing"] == [] and result["differ"] == [], result
    assert result["params"] == len(list(model.parameters()))


def test_h3_parameter_gradients_are_their_backward_ops_of_the_captured_upstream(model, inputs):
    """Deterministic algorithms off: every h3-backed parameter's gradient is, bitwise, the output of its backward
    op on the upstream gradient captured in this step, and replaying the captured call gives it again."""
    assert not torch.are_deterministic_algorithms_enabled()
    model.train()
    try:
        with h3cute.patch(model):
            model.zero_grad(set_to_none=True)
            with H3Calls() as calls:
                out = model(**inputs)
                g = torch.Generator(device="cuda").manual_seed(9)
                ups = [torch.randn(o.shape, generator=g, device="cuda") for o in (out.sample, out.audio_sample)]
                torch.autograd.backward([out.sample, out.audio_sample], ups)
            grads = {n: p.grad for n, p in model.named_parameters()}
            model.zero_grad(set_to_none=True)
    finally:
        model.eval()
    names = {p.data_ptr(): n for n, p in model.named_parameters()}
    backward = [c for c in calls.calls if c[0].endswith("_backward")]
    assert Counter(c[0] for c in backward) == backward_ops()
    covered = set()
    for name, func, ptrs, args, outs in backward:
        again = func(*args)
        assert same_bits(list(again) if isinstance(again, (tuple, list)) else [again], outs), f"{name} replay"
        for out_index, *arg in PARAM_GRADS.get(name, ()):
            param = names[ptrs[arg[-1]]]
            if arg[0] == "bias_of":
                param = param.removesuffix(".weight") + ".bias"
            assert_same_bits(grads[param], outs[out_index], f"{param}.grad vs {name} output {out_index}")
            covered.add(param)
    assert covered == H3_PARAMS


# ---- 4. autocast and torch.compile ----------------------------------------------------------------------

def test_under_autocast_every_site_gives_the_eager_op_bits(model, inputs):
    with h3cute.patch(model), Boundaries(model) as v:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = _outputs(model, inputs)
    assert all(torch.isfinite(o).all() for o in out)
    replay_sites(model, v, "autocast")


def test_under_torch_compile_every_site_gives_the_eager_op_bits(model, inputs):
    torch._dynamo.reset()
    try:
        with h3cute.patch(model), Boundaries(model) as v:
            compiled = torch.compile(model)
            _outputs(compiled, inputs)  # compiles
            v.clear()
            out = _outputs(compiled, inputs)
            assert all(torch.isfinite(o).all() for o in out)
            replay_sites(model, v, "torch.compile")
            # a compiled training step runs through the ops' autograd
            model.zero_grad(set_to_none=True)
            res = compiled(**inputs)
            (res.sample.square().mean() + res.audio_sample.square().mean()).backward()
            for name in H3_PARAMS:
                grad = model.get_parameter(name).grad
                assert grad is not None and torch.isfinite(grad).all(), name
            model.zero_grad(set_to_none=True)
    finally:
        torch._dynamo.reset()
