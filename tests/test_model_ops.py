"""The model scope's ops (h3cute.ops.model): what each computes, its gradients, its errors, and that torch.compile
(fullgraph, Inductor) gives their eager bits, forward and backward; on a CPU here, on CUDA where one is present
(`gpu`: the same checks at H3's widths, plus each row alone against inside a batch, bitwise)."""
import pytest
import torch
import torch.nn.functional as F

import h3cute  # noqa: F401  (registers torch.ops.h3)
from bitwise import assert_same_bits
from h3cute.widths import ATTENTION_HEAD_DIM, FFN, HIDDEN

ops = torch.ops.h3
BF16 = torch.bfloat16


def _rotary_reference(x, cos, sin):
    from diffusers.models.transformers.transformer_minimax_h3 import _apply_rotary_emb
    return _apply_rotary_emb(x, cos, sin)


def _rope_reference(position_ids, rope_freq_dim=16):
    from diffusers.models.transformers.transformer_minimax_h3 import MiniMaxH3RotaryPosEmbed
    rope = MiniMaxH3RotaryPosEmbed(rope_freq_dim).to(position_ids.device)
    return rope(position_ids), rope.inv_freq


def _swiglu_reference(x):
    a, g = x.chunk(2, dim=-1)
    return a * F.silu(g)


def _cases(device, rows=37, batch=2, g=None):
    """(name, op, reference, inputs, differentiable input indices) of each eager-kernel op at H3's widths (the
    rotary and rms_norm over (batch, rows, heads, head_dim) rows, the SwiGLU over the FFN's halves)."""
    g = g or torch.Generator(device=device).manual_seed(0)

    def randn(*shape, dtype=BF16, scale=1.0):
        return (torch.randn(shape, generator=g, device=device) * scale).to(dtype)

    positions = torch.stack([torch.randint(0, 64, (rows,), generator=g, device=device) for _ in range(3)], -1)
    (cos, sin), inv_freq = _rope_reference(positions)
    heads = 3
    return [
        ("rms_norm_head", lambda x, w: ops.rms_norm(x, w, 1e-5),
         lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-5),
         [randn(batch, rows, heads, ATTENTION_HEAD_DIM), 1 + randn(ATTENTION_HEAD_DIM, scale=0.1)], (0, 1)),
        ("rms_norm_hidden", lambda x, w: ops.rms_norm(x, w, 1e-5),
         lambda x, w: F.rms_norm(x, (x.shape[-1],), w, 1e-5),
         [randn(batch, rows, HIDDEN), 1 + randn(HIDDEN, scale=0.1)], (0, 1)),
        ("rotary", lambda x: ops.rotary(x, cos, sin), lambda x: _rotary_reference(x, cos, sin),
         [randn(batch, rows, heads, ATTENTION_HEAD_DIM)], (0,)),
        ("qk_norm_rotary", lambda x, w: ops.qk_norm_rotary(x, w, cos, sin, 1e-5),
         lambda x, w: _rotary_reference(F.rms_norm(x, (x.shape[-1],), w, 1e-5), cos, sin),
         [randn(batch, rows, heads, ATTENTION_HEAD_DIM), 1 + randn(ATTENTION_HEAD_DIM, scale=0.1)], (0, 1)),
        ("swiglu", ops.swiglu, _swiglu_reference, [randn(batch, rows, 2 * 96)], (0,)),
        ("swiglu_ffn", ops.swiglu, _swiglu_reference, [randn(batch, rows, 2 * FFN, scale=3.0)], (0,)),
        ("dense", lambda x, w, b: ops.dense(x, w, b), F.linear,
         [randn(batch, rows, 64), randn(96, 64, scale=0.125), randn(96, scale=0.02)], (0, 1, 2)),
        ("rotary_table", lambda p: ops.rotary_table(p, inv_freq), lambda p: _rope_reference(p)[0], [positions], ()),
    ]


def _grads(fn, inputs, diff, upstream_seed=1):
    """fn's outputs and the gradients of the `diff` inputs for a fixed upstream gradient."""
    leaves = [t.detach().clone().requires_grad_(i in diff) for i, t in enumerate(inputs)]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    if not diff:
        return [o.detach() for o in outs], []
    g = torch.Generator(device=outs[0].device).manual_seed(upstream_seed)
    up = [torch.randn(o.shape, generator=g, device=o.device).to(o.dtype) for o in outs]
    grads = torch.autograd.grad(outs, [leaves[i] for i in diff], up)
    return [o.detach() for o in outs], list(grads)


def _check_eager_and_compiled(device):
    for name, op, reference, inputs, diff in _cases(device):
        out, grads = _grads(op, inputs, diff)
        ref_out, ref_grads = _grads(reference, inputs, diff)
        for i, (a, b) in enumerate(zip(out + grads, ref_out + ref_grads)):
            if name == "dense" and i > 0:  # dense's backward is two GEMMs and a sum, not F.linear's autograd
                torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
            elif name == "qk_norm_rotary" and i > 0 and device == "cuda":  # the kernel's own backward
                _closer_to_fp64_than_eager(a, b, reference, inputs, diff, i - 1, name)
            else:
                assert_same_bits(a, b, f"{name}: output / gradient {i} against diffusers' eager expression")
        compiled = torch.compile(op, fullgraph=True, dynamic=False)
        c_out, c_grads = _grads(compiled, inputs, diff)
        for i, (a, b) in enumerate(zip(c_out + c_grads, out + grads)):
            assert_same_bits(a, b, f"{name}: compiled against eager, output / gradient {i}")


def _closer_to_fp64_than_eager(got, eager, reference, inputs, diff, which, name):
    """A gradient that is not eager autograd's bits: within twice eager's own distance of the FP64 gradient, never
    NaN."""
    _, exact = _grads(reference, [t.double() for t in inputs], diff)
    exact = exact[which]
    err, eager_err = ((t.double() - exact).abs().max().item() for t in (got, eager))
    assert err == err and err <= 2 * eager_err + 1e-6 * exact.abs().max().item(), (
        f"{name}: gradient {which} is {err:.3g} from FP64, eager autograd's {eager_err:.3g}")


def test_each_op_is_its_eager_expression_and_compiles_to_the_same_bits():
    _check_eager_and_compiled("cpu")


@pytest.mark.gpu
def test_each_op_is_its_eager_expression_and_compiles_to_the_same_bits_on_cuda():
    _check_eager_and_compiled("cuda")


@pytest.mark.gpu
def test_each_row_alone_is_bitwise_the_row_inside_a_batch_on_cuda():
    """B-invariance of the eager-kernel ops at H3's widths: sample 0's outputs and input gradients alone (B = 1)
    equal its slice of a batch of 5. (dense's rows rest on vLLM's cuBLASLt environment, which this process may lack:
    the model proofs run it in processes started with it.)"""
    for name, op, _, inputs, diff in _cases("cuda", rows=301, batch=5):
        if name in ("dense", "rotary_table"):
            continue
        alone = [t[:1] if i == 0 else t for i, t in enumerate(inputs)]
        out_b, grads_b = _grads(op, inputs, (0,) if 0 in diff else ())
        out_1, grads_1 = _grads(op, alone, (0,) if 0 in diff else ())
        assert_same_bits(out_1[0][0], out_b[0][0], f"{name}: output of sample 0 alone vs in B=5")
        if grads_1:  # the same upstream seed gives B=1 its own draw: compare the gradient of a sample-wise map
            g = torch.Generator(device="cuda").manual_seed(7)
            up = torch.randn(out_b[0].shape, generator=g, device="cuda").to(out_b[0].dtype)
            x_b = inputs[0].detach().clone().requires_grad_(True)
            x_1 = inputs[0][:1].detach().clone().requires_grad_(True)
            rest = inputs[1:]
            (d_b,) = torch.autograd.grad(op(x_b, *rest), x_b, up)
            (d_1,) = torch.autograd.grad(op(x_1, *rest), x_1, up[:1])
            assert_same_bits(d_1[0], d_b[0], f"{name}: input gradient of sample 0 alone vs in B=5")


@pytest.mark.gpu
def test_fused_kernels_write_every_element_at_h3_sizes_on_cuda():
    """h3cute's kernels behind qk_norm_rotary and swiglu, at a model's size (S = 4097, 56 heads; the FFN's
    14336 halves) with outputs carved from NaN-poisoned memory: forward bitwise eager torch's expression (swiglu's
    backward too, over inputs out to exp's overflow), qk_norm_rotary's backward finite and the same bits at every
    call (its weight gradient a fixed-order sum)."""
    from poison import poison_allocator
    g = torch.Generator(device="cuda").manual_seed(11)
    rows, heads = 4097, 56
    positions = torch.stack([torch.randint(0, 4097, (rows,), generator=g, device="cuda") for _ in range(3)], -1)
    (cos, sin), _ = _rope_reference(positions)
    x = (torch.randn(1, rows, heads, ATTENTION_HEAD_DIM, generator=g, device="cuda") * 4).to(BF16)
    w = (1 + 0.1 * torch.randn(ATTENTION_HEAD_DIM, generator=g, device="cuda")).to(BF16)
    up = torch.randn(x.shape, generator=g, device="cuda").to(BF16)
    poison_allocator()
    out = ops.qk_norm_rotary(x, w, cos, sin, 1e-6)
    assert_same_bits(out, _rotary_reference(F.rms_norm(x, (128,), w, 1e-6), cos, sin), "qk_norm_rotary forward")
    poison_allocator()
    first = ops.qk_norm_rotary_backward(up, x, w, cos, sin, 1e-6)
    poison_allocator()
    again = ops.qk_norm_rotary_backward(up, x, w, cos, sin, 1e-6)
    for a, b, what in zip(first, again, ("dx", "dweight")):
        assert a.isfinite().all(), f"qk_norm_rotary backward: {what} has non-finite elements"
        assert_same_bits(a, b, f"qk_norm_rotary backward: {what} of two calls")

    v = torch.randn(rows, 2 * FFN, generator=g, device="cuda") * 3
    v[:, FFN::97] = torch.linspace(-1e4, 1e4, v[:, FFN::97].shape[1], device="cuda")  # exp(-g) overflows / vanishes
    v = v.to(BF16)
    grad = torch.randn(rows, FFN, generator=g, device="cuda").to(BF16)
    poison_allocator()
    assert_same_bits(ops.swiglu(v), _swiglu_reference(v), "swiglu forward at the FFN's width")
    poison_allocator()
    leaf = v.clone().requires_grad_(True)
    (eager,) = torch.autograd.grad(_swiglu_reference(leaf), leaf, grad)
    poison_allocator()
    assert_same_bits(ops.swiglu_backward(grad, v), eager, "swiglu backward at the FFN's width")


def test_attention_reference_and_its_gradients_on_a_cpu():
    """On a CPU h3::attention is the FP32 reference: softmax(q k^T / sqrt(d)) v per sample and head, its gradients
    autograd's; against FP64."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 19, 3, 128, generator=g).to(BF16) for _ in range(3))

    def f64(q, k, v):
        q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
        return ((q @ k.transpose(-1, -2) / 128 ** 0.5).softmax(-1) @ v).transpose(1, 2)

    out, grads = _grads(ops.attention, [q, k, v], (0, 1, 2))
    ref, ref_grads = _grads(f64, [q.double(), k.double(), v.double()], (0, 1, 2))
    torch.testing.assert_close(out[0].double(), ref[0], rtol=1e-2, atol=1e-2)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a.double(), b, rtol=2e-2, atol=2e-2)
    out_lse, lse = ops.attention_with_lse(q, k, v)
    assert_same_bits(out_lse, out[0], "attention_with_lse's output is attention's")
    assert lse.shape == (2, 3, 19) and lse.dtype == torch.float32


def test_bad_inputs_name_the_op_and_the_argument():
    """Shapes the ops cannot serve (tests/test_hardening.py holds dtypes, None and devices for every op)."""
    x = torch.randn(2, 5, 3, 128).to(BF16)
    with pytest.raises(TypeError, match=r"h3::attention: q must be bfloat16, got float32"):
        ops.attention(x.float(), x.float(), x.float())
    with pytest.raises(ValueError, match=r"h3::attention: q has shape \(5, 3, 128\); it must have 4 dimensions"):
        ops.attention(x[0], x[0], x[0])
    with pytest.raises(ValueError, match=r"h3::attention: k has shape \(2, 4, 3, 128\); it must be q's"):
        ops.attention(x, x[:, :4], x)
    with pytest.raises(ValueError, match=r"h3::rms_norm: x has shape .*its last dimension must be weight's width"):
        ops.rms_norm(x, torch.ones(64, dtype=BF16), 1e-5)
    with pytest.raises(TypeError, match=r"h3::rms_norm: weight must be bfloat16, got float32"):
        ops.rms_norm(x, torch.ones(128), 1e-5)
    with pytest.raises(ValueError, match=r"h3::rms_norm: eps must be > 0, got nan"):
        ops.rms_norm(x, torch.ones(128, dtype=BF16), float("nan"))
    with pytest.raises(ValueError, match=r"h3::dense: x has shape .*in_features"):
        ops.dense(x, torch.ones(4, 64, dtype=BF16))
    with pytest.raises(ValueError, match=r"h3::swiglu: x has shape \(2, 5, 3, 127\)"):
        ops.swiglu(torch.ones(2, 5, 3, 127, dtype=BF16))
    with pytest.raises(ValueError, match=r"h3::rotary: cos \(4, 96\) and sin \(4, 96\) must both be \(rows = 5"):
        ops.rotary(x, torch.ones(4, 96), torch.ones(4, 96))
    with pytest.raises(TypeError, match=r"h3::rotary_table: position_ids must be int64 or int32, got float32"):
        ops.rotary_table(torch.ones(5, 3), torch.ones(16))
    with pytest.raises(RuntimeError, match=r"h3::rotary: gradients reach the rotated rows only"):
        cos = torch.ones(5, 96, requires_grad=True)
        ops.rotary(x, cos, torch.ones(5, 96)).sum().backward()


def test_under_autocast_the_ops_keep_bf16_as_every_h3_op_keeps_its_dtypes():
    """FP32 rows reach the BF16 ops cast down (autocast's lower-precision policy), and each runs with autocast off:
    rms_norm stays BF16 (torch's F.rms_norm would run FP32 under CUDA autocast), dense is F.linear of BF16."""
    x, w = torch.randn(4, 128), torch.ones(128)
    with torch.autocast("cpu", dtype=BF16):
        got = ops.rms_norm(x, w, 1e-5)
        dense = ops.dense(x, torch.ones(8, 128))
    assert got.dtype == dense.dtype == BF16
    assert_same_bits(got, F.rms_norm(x.to(BF16), (128,), w.to(BF16), 1e-5), "rms_norm under autocast")
    assert_same_bits(dense, F.linear(x.to(BF16), torch.ones(8, 128, dtype=BF16)), "dense under autocast")
