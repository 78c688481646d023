"""h3::linear, the batch-invariant FP32 linear of MiniMax-H3's four FP32 heads (docs/linear.md).

CPU: the roles' tiles and slice counts are the built variants and fit the GEMM's constraints, every variant compiles
with three tf32 mma per k8 step, every fold with its IEEE adds in slice order; the backward's launch sequence and the
row order of the wgrad's partials (recorded kernels); schemas, checks and their messages, fake (meta) shapes, the
CPU impl and its autograd against FP64, opcheck. GPU (`-m gpu`): bitwise row invariance of y and dx (probe rows
inside batches of every size), with a negative control (cuBLAS FP32 fails the same check), accuracy against FP64
within the 3xTF32 contract, repeatable dweight / dbias (M = 4097: chunks and a tail; M = 8192: chunks, no tail),
poisoned (NaN-filled) output memory fully overwritten, a NaN row staying in its row, no rows.
"""
import pytest
import torch
import torch.nn.functional as F

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference as R
from h3cute import runtime
from h3cute.kernels import _linear_configs as C
from h3cute.kernels._tiles import GemmConfig
from h3cute.widths import AUDIO_CHANNELS, HIDDEN, LINEAR_SHAPES, VIDEO_PATCH

import numerics
from bitwise import assert_same_bits, same_bits

ops = torch.ops.h3
HEADS = {"proj_in": (HIDDEN, VIDEO_PATCH), "audio_proj_in": (HIDDEN, AUDIO_CHANNELS),
         "proj_out": (VIDEO_PATCH, HIDDEN), "audio_proj_out": (AUDIO_CHANNELS, HIDDEN)}
IDS = list(HEADS)
FWD_TOL, GRAD_TOL = 2e-6, 1e-5  # the 3xTF32 contract (docs/linear.md), the timestep MLP's


def _params(shape, seed=0, device="cpu"):
    n, k = shape
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn((n, k), generator=g, device=device) * k ** -0.5
    b = torch.randn((n,), generator=g, device=device) * 0.02
    return w, b


def _randn(shape, seed, device="cpu"):
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device)


# ---- CPU: configs <-> kernels ------------------------------------------------------------------------------


def test_widths_are_the_diffusers_heads():
    assert VIDEO_PATCH == 24 * 1 * 2 * 2 and AUDIO_CHANNELS == 32
    assert set(LINEAR_SHAPES) == set(HEADS.values())


def test_every_role_has_a_static_tile_that_fits_the_gemm():
    assert set(C.TILES) == {(r, n, k) for r in C.ROLES for n, k in LINEAR_SHAPES}
    for (role, n, k), tile in C.TILES.items():
        cfg = GemmConfig(*tile)  # its own checks
        rows, width, depth = C.gemm_dims(role, n, k)
        assert width % cfg.tile_n == 0, (role, n, k)
        assert rows is None or rows % cfg.tile_m == 0, (role, n, k)  # MN-major A: rows not predicated
        assert depth is None or depth % (C.splits(role, n, k) * cfg.tile_k) == 0, (role, n, k)
        for mn_major, tile_rows in ((role == "wgrad", cfg.tile_m), (role != "fwd", cfg.tile_n)):
            if mn_major:  # GemmTF32x3's MN-major copy: whole 32-row atoms, whole k-row passes
                vec = tile_rows // 4
                assert tile_rows % 32 == 0 and cfg.threads % vec == 0 and cfg.tile_k % (cfg.threads // vec) == 0


def test_slice_counts_are_pinned():
    """The forward sums in one slice (its fused bias epilogue); the dgrad's count depends on the widths alone (dx
    row-invariant); every wgrad chunks its rows."""
    assert C.SPLITS == {("dgrad", 5376, 96): 3, ("dgrad", 5376, 32): 4, ("wgrad", 5376, 96): 8,
                        ("wgrad", 5376, 32): 8, ("wgrad", 96, 5376): 8, ("wgrad", 32, 5376): 8}
    assert all(C.splits("fwd", n, k) == 1 for n, k in LINEAR_SHAPES)


@pytest.mark.parametrize("rows, want", [(1, (0, 1)), (255, (0, 255)), (256, (256, 0)), (257, (256, 1)),
                                        (4097, (4096, 1)), (32768, (32768, 0)), (131071, (130816, 255))])
def test_wgrad_rows_split_into_whole_chunks_and_a_tail(rows, want):
    for n, k in LINEAR_SHAPES:  # 8 chunks of whole 32-deep k tiles
        assert C.wgrad_rows(n, k, rows) == want


def test_launcher_asks_for_exactly_the_built_variants():
    pytest.importorskip("cutlass", reason="the kernel module imports the CuTe DSL", exc_type=ImportError)
    from h3cute.kernels import linear as K

    gemm, fold = K.SPECS
    assert (gemm.name, fold.name) == ("linear_gemm", "linear_fold")
    for arch in ("sm_90a", "sm_100a"):
        built = {tuple(v.items()) for v in gemm.variants(arch)}
        asked = {tuple(C.gemm_static(g, n, k).items()) for g in C.GEMMS for n, k in LINEAR_SHAPES}
        assert built == asked
        folds = {(v["splits"], v["width"]) for v in fold.variants(arch)}
        assert folds == {(3, 96), (4, 32), (9, 96), (9, 32), (9, 5376)}


class _Recorder:
    """Stands in for runtime.kernel on CPU: records every launch (kernel, static args, rows of grad / x it reads,
    partial slots it writes) and does its arithmetic in FP64: a GEMM writes each slice's sum of its K' chunk, the
    fold adds the partials in slice order (what the kernels compute, up to rounding)."""

    def __init__(self, grad):
        self.grad, self.launches = grad, []

    def __call__(self, name, device, **static):
        def run(*args):
            if name == "linear_fold":
                parts, _, out = args
                self.launches.append((name, static["splits"], static["width"]))
                acc = parts[0].double()
                for s in range(1, parts.shape[0]):
                    acc = acc + parts[s].double()
                out.copy_(acc)
                return
            a, b, p = args
            s, depth = static["splits"], a.shape[1]
            first = None
            if static["role"].startswith("wgrad"):  # a = grad[rows].t(): which rows
                first = a.storage_offset() // self.grad.shape[1]
                slot = p.storage_offset() // (p.shape[1] * p.shape[2])
                self.launches.append((static["role"], s, first, first + depth, slot))
            else:
                self.launches.append((static["role"], s))
            for i in range(s):
                cols = slice(i * depth // s, (i + 1) * depth // s)
                p[i].copy_(a[:, cols].double() @ b[:, cols].double().t())
        return run


@pytest.mark.parametrize("head", IDS)
@pytest.mark.parametrize("m", [1, 255, 256, 257, 4097])
def test_backward_launch_sequence_and_row_order(head, m, monkeypatch):
    """The launcher's backward on CPU with recorded kernels: dgrad in its width's slices, then its fold; the wgrad's
    whole chunks (partials 0..7, rows in increasing order), the tail (partial 8) or a zeroed partial 8, one fold of 9,
    or the one-slice tail GEMM alone under one chunk per slice; the result is the FP64 grads within FP32 rounding."""
    from h3cute.launch import linear as L

    w, _ = _params(HEADS[head], 30)
    n, k = w.shape
    x, grad = _randn((m, k), 31), _randn((m, n), 32)
    rec = _Recorder(grad)
    monkeypatch.setattr(runtime, "kernel", rec)  # the plans resolve their kernels through it
    dx, dw, db = L.backward(grad, x, w)
    ds = C.splits("dgrad", n, k)
    want = [("dgrad", ds)] + ([("linear_fold", ds, k)] if ds > 1 else [])
    bulk = m // 256 * 256
    if bulk:
        want += [("wgrad", 8, 0, bulk, 0)] + ([("wgrad_tail", 1, bulk, m, 8)] if m > bulk else [])
        want += [("linear_fold", 9, k)]
    else:
        want += [("wgrad_tail", 1, 0, m, 0)]
    assert rec.launches == want
    assert numerics.rel_err(dx, grad.double() @ w.double()) < 2e-6
    assert numerics.rel_err(dw, grad.double().t() @ x.double()) < 2e-6
    assert same_bits(db, grad.sum(0))


def _mma_per_k_tile(tile):
    tm, tn, tk, _, wm, wn = tile
    return (tm // (16 * wm)) * (tn // (8 * wn)) * (tk // 8) * 3


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_every_variant_compiles_with_three_tf32_mma_per_step(arch):
    pytest.importorskip("cutlass", reason="compiling needs the CuTe DSL", exc_type=ImportError)
    from compiled_ptx import ptx_of
    from h3cute.kernels import linear as K

    spec, fold = K.SPECS
    for static in fold.variants(arch):  # the partials added one by one in slice order: splits - 1 IEEE adds
        ptx = "\n".join(ptx_of(fold, arch, static))
        assert all(m in ptx for m in fold.ptx_markers) and not any(f in ptx for f in fold.ptx_forbidden), static
        assert ptx.count("add.f32 ") == static["splits"] - 1 and "fma." not in ptx, static
    for static in spec.variants(arch):
        ptx = "\n".join(ptx_of(spec, arch, static))
        assert f".target {arch}" in ptx
        assert all(m in ptx for m in spec.ptx_markers) and not any(f in ptx for f in spec.ptx_forbidden), static
        tile = static["tile"]
        n_mma = ptx.count("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32")
        assert n_mma == _mma_per_k_tile(tile), (static, n_mma)
        # one IEEE add per accumulator register per k8 chunk; the forward adds the bias once more per register
        acc_regs = tile[0] * tile[1] // (32 * tile[4] * tile[5])
        bias_adds = acc_regs if static["role"] == "fwd" else 0
        assert ptx.count("add.rn.f32 ") == 4 * n_mma // 3 + bias_adds, static
        assert ".local" not in ptx, static


# ---- CPU: the op ---------------------------------------------------------------------------------------------


def test_schemas():
    assert str(ops.linear.default._schema) == "h3::linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor"
    assert str(ops.linear_backward.default._schema) == (
        "h3::linear_backward(Tensor grad, Tensor x, Tensor weight, bool x_grad=True) "
        "-> (Tensor dx, Tensor dweight, Tensor dbias)")


SERVED = r"\(5376, 96\), \(5376, 32\), \(96, 5376\), \(32, 5376\) only"


@pytest.mark.parametrize("args, err, match", [
    (lambda x, w, b: (x, torch.zeros(100, 96), None), ValueError,
     r"h3::linear: weight has shape \(100, 96\); the op serves the MiniMax-H3 FP32 heads' "
     rf"\(out_features, in_features\) {SERVED}"),
    (lambda x, w, b: (x, w.t().contiguous(), None), ValueError, r"h3::linear: x must have shape \(\.\.\., 5376\)"),
    (lambda x, w, b: (x.bfloat16(), w, b), TypeError, r"h3::linear: x must be float32, got bfloat16"),
    (lambda x, w, b: (x, w.bfloat16(), b), TypeError, r"h3::linear: weight must be float32, got bfloat16"),
    (lambda x, w, b: (x, w, b.double()), TypeError, r"h3::linear: bias must be float32, got float64"),
    (lambda x, w, b: (x, w, b[:7]), ValueError, r"h3::linear: bias must have shape \(5376,\), got \(7,\)"),
    (lambda x, w, b: (x, w, b.view(1, -1)), ValueError, r"h3::linear: bias must have shape \(5376,\)"),
    (lambda x, w, b: (x[:, :50], w, b), ValueError, r"h3::linear: x must have shape \(\.\.\., 96\), got \(3, 50\)"),
    (lambda x, w, b: (x, w[:, :48].contiguous(), b), ValueError, r"h3::linear: weight has shape \(5376, 48\)"),
    (lambda x, w, b: (x, w.t().contiguous().t(), b), ValueError, r"h3::linear: weight must be contiguous"),
    (lambda x, w, b: (x, w[0], b), ValueError, r"h3::linear: weight must have shape \(N, K\), got \(96,\)"),
    (lambda x, w, b: (x.to("meta"), w, b), ValueError, r"h3::linear: weight is on cpu, expected meta"),
    (lambda x, w, b: (x, w, b.to("meta")), ValueError, r"h3::linear: bias is on meta, expected cpu"),
    (lambda x, w, b: (None, w, b), TypeError, r"h3::linear: x is None"),
    (lambda x, w, b: (x, None, b), TypeError, r"h3::linear: weight is None"),
])
def test_linear_rejects(args, err, match):
    w, b = _params(HEADS["proj_in"])
    with pytest.raises(err, match=match):
        ops.linear(*args(torch.zeros(3, VIDEO_PATCH), w, b))


def test_linear_backward_rejects():
    w, _ = _params(HEADS["proj_out"])
    x = torch.zeros(2, 3, HIDDEN)
    with pytest.raises(ValueError, match=r"h3::linear_backward: grad has leading shape \(6,\), x has \(2, 3\)"):
        ops.linear_backward(torch.zeros(6, VIDEO_PATCH), x, w)
    with pytest.raises(ValueError, match=r"h3::linear_backward: grad must have shape \(\.\.\., 96\), got \(2, 3, 5\)"):
        ops.linear_backward(torch.zeros(2, 3, 5), x, w)
    with pytest.raises(TypeError, match=r"h3::linear_backward: grad must be float32, got bfloat16"):
        ops.linear_backward(torch.zeros(2, 3, VIDEO_PATCH, dtype=torch.bfloat16), x, w)


@pytest.mark.parametrize("lead", [(), (0,), (5,), (2, 3), (2, 0, 4)])
def test_meta_and_fake_shapes(lead):
    from torch._subclasses.fake_tensor import FakeTensorMode

    n, k = HEADS["proj_out"]
    for mode in ("meta", "fake"):
        if mode == "meta":
            x, w, b = (torch.empty(*shape, device="meta") for shape in ((*lead, k), (n, k), (n,)))
            grad = torch.empty(*lead, n, device="meta")
            y, (dx, dw, db), (dx0, _, _) = (ops.linear(x, w, b), ops.linear_backward(grad, x, w),
                                            ops.linear_backward(grad, x, w, False))
        else:
            with FakeTensorMode():
                x, w, b, grad = torch.empty(*lead, k), torch.empty(n, k), torch.empty(n), torch.empty(*lead, n)
                y, (dx, dw, db), (dx0, _, _) = (ops.linear(x, w, b), ops.linear_backward(grad, x, w),
                                                ops.linear_backward(grad, x, w, False))
        assert y.shape == (*lead, n) and y.dtype == torch.float32
        assert dx.shape == x.shape and dw.shape == (n, k) and db.shape == (n,) and dx0.shape == (0, k)


@pytest.mark.parametrize("head", IDS)
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_forward_is_fp32_linear_within_fp32_of_fp64(head, bias):
    """The CPU impl is torch's FP32 F.linear (bitwise), within FP32 accumulation of the FP64 golden."""
    w, b = _params(HEADS[head], 1)
    b = b if bias else None
    x = _randn((2, 3, w.shape[1]), 2)
    y = ops.linear(x, w, b)
    assert_same_bits(y, F.linear(x, w, b), head)
    ref = R.linear_fp64(x, w, b)
    terms = x.double().abs() @ w.double().abs().t() + (b.double().abs() if bias else 0)
    numerics.assert_within(y, ref, numerics.FP32_SLACK * terms, head)


@pytest.mark.parametrize("head", IDS)
@pytest.mark.parametrize("x_grad", [True, False])
@pytest.mark.parametrize("bias", [True, False])
def test_cpu_autograd_against_fp64(head, x_grad, bias):
    w, b = _params(HEADS[head], 3)
    x = _randn((2, 5, w.shape[1]), 4)
    grad = _randn((2, 5, w.shape[0]), 5)
    leaves = [x.clone().requires_grad_(x_grad), w.clone().requires_grad_(),
              b.clone().requires_grad_() if bias else None]
    ops.linear(*leaves).backward(grad)
    l64 = [t.double().requires_grad_() for t in (x, w, b)]
    R.linear_fp64(*l64[:2], l64[2] if bias else None).backward(grad.double())
    assert (leaves[0].grad is not None) == x_grad
    if bias:
        assert numerics.rel_err(leaves[2].grad, l64[2].grad) < 2e-6
    for leaf, ref in zip(leaves[:2], l64[:2]):
        if leaf.grad is not None:
            assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == torch.float32
            assert numerics.rel_err(leaf.grad, ref.grad) < 2e-6
    dx, dw, db = ops.linear_backward(grad, x, w, x_grad)
    assert dx.shape == (x.shape if x_grad else (0, w.shape[1]))
    assert same_bits(dw, leaves[1].grad) and dw.shape == w.shape and db.shape == (w.shape[0],)


def test_empty_rows():
    w, b = _params(HEADS["audio_proj_in"])
    x = torch.zeros(0, AUDIO_CHANNELS, requires_grad=True)
    wl, bl = w.clone().requires_grad_(), b.clone().requires_grad_()
    y = ops.linear(x, wl, bl)
    assert y.shape == (0, HIDDEN)
    y.sum().backward()
    assert x.grad.shape == x.shape and not wl.grad.any() and not bl.grad.any()


@pytest.mark.parametrize("head", ["proj_in", "audio_proj_out"])
def test_opcheck(head):
    w, b = _params(HEADS[head], 6)
    x = _randn((3, w.shape[1]), 7)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    torch.library.opcheck(ops.linear.default, (x.requires_grad_(), w.requires_grad_(), b.requires_grad_()),
                          test_utils=utils)
    torch.library.opcheck(ops.linear.default, (x.detach(), w.detach(), None), test_utils=utils)
    grad = _randn((3, w.shape[0]), 8)
    torch.library.opcheck(ops.linear_backward.default, (grad, x.detach(), w.detach()), test_utils=utils[:3])


def test_torch_compile_traces_forward_and_backward():
    torch._dynamo.reset()
    w, b = _params(HEADS["proj_in"], 9)
    compiled = torch.compile(lambda *a: ops.linear(*a), fullgraph=True, backend="aot_eager")
    x = _randn((4, VIDEO_PATCH), 10)
    leaves = [t.clone().requires_grad_() for t in (x, w, b)]
    out = compiled(*leaves)
    assert same_bits(out, ops.linear(x, w, b))
    out.sum().backward()
    assert all(t.grad is not None for t in leaves)


# ---- GPU -------------------------------------------------------------------------------------------------------

# Batch sizes straddling the tiles' row edges (16 ... 128) and the report sizes.
SWEEP = (1, 2, 7, 8, 9, 63, 64, 65, 127, 128, 129, 1023, 1024, 1025, 4097, 32768)


def _invariance_failures(fwd, dgrad, w, b, seed):
    """[(M, position, what)] where a probe row's y or dx inside a batch of M rows differs from the row alone.
    fwd(x, w, b) -> y, dgrad(grad, w) -> dx."""
    n, k = w.shape
    probes = _randn((3, k), seed, "cuda")
    probe_grads = _randn((3, n), seed + 1, "cuda")
    alone = [fwd(probes[i:i + 1], w, b) for i in range(3)]
    alone_dx = [dgrad(probe_grads[i:i + 1], w) for i in range(3)]
    failures = []
    for m in SWEEP:
        x = _randn((m, k), 1000 + m, "cuda")
        grad = _randn((m, n), 2000 + m, "cuda")
        positions = sorted({0, m // 2, m - 1})
        for i, pos in enumerate(positions):
            x[pos], grad[pos] = probes[i], probe_grads[i]
        y, dx = fwd(x, w, b), dgrad(grad, w)
        for i, pos in enumerate(positions):
            if not same_bits(y[pos:pos + 1], alone[i]):
                failures.append((m, pos, "y"))
            if not same_bits(dx[pos:pos + 1], alone_dx[i]):
                failures.append((m, pos, "dx"))
    return failures


def _h3_dgrad(grad, w):
    x = torch.zeros((grad.shape[0], w.shape[1]), device=grad.device)  # dx does not read x
    return ops.linear_backward(grad, x, w)[0]


@pytest.mark.gpu
@pytest.mark.parametrize("head", IDS)
def test_rows_are_invariant_to_the_batch(head):
    w, b = _params(HEADS[head], 11, "cuda")
    assert _invariance_failures(ops.linear, _h3_dgrad, w, b, 12) == []


@pytest.mark.gpu
def test_negative_control_cublas_fp32_is_not_row_invariant():
    """The same check on torch's FP32 linear (cuBLAS, TF32 off) and its dx (grad @ w) fails for some head: if it
    ever passed, the check would be suspect."""
    assert not torch.backends.cuda.matmul.allow_tf32
    failures = {head: _invariance_failures(F.linear, lambda g, w: g @ w, *_params(HEADS[head], 11, "cuda"), 12)
                for head in IDS}
    assert any(failures.values()), failures


def _fp64_all(x, w, b, grad):
    l64 = [t.double().requires_grad_() for t in (x, w, b)]
    y = R.linear_fp64(*l64)
    y.backward(grad.double())
    return y.detach(), [t.grad for t in l64]


@pytest.mark.gpu
@pytest.mark.parametrize("head", IDS)
@pytest.mark.parametrize("m", [1, 129, 4097, 8192])
def test_accuracy_against_fp64_within_the_3xtf32_contract(head, m):
    """max |err| / max |ref| of y, dx, dweight, dbias against FP64 within the 3xTF32 contract the timestep MLP
    holds (docs/linear.md: 2e-6 for y and dx, 1e-5 for the row-reduced dweight and dbias), cuBLAS FP32's own error
    (F.linear and its autograd, TF32 off) in the message. 3xTF32 is a few times cuBLAS's FP32 error (each product
    drops small x small, 2^-22 of the term, and the tensor core's chunk sums truncate), three orders under TF32's."""
    w, b = _params(HEADS[head], 13, "cuda")
    x = _randn((m, w.shape[1]), 14, "cuda")
    grad = _randn((m, w.shape[0]), 15, "cuda")
    ref_y, ref_grads = _fp64_all(x, w, b, grad)
    theirs = [t.clone().requires_grad_() for t in (x, w, b)]
    their_y = F.linear(*theirs)
    their_y.backward(grad)
    ours = [t.clone().requires_grad_() for t in (x, w, b)]
    our_y = ops.linear(*ours)
    our_y.backward(grad)
    pairs = [("y", our_y.detach(), their_y.detach(), ref_y)] + [
        (name, o.grad, t.grad, r) for name, o, t, r in zip(("dx", "dweight", "dbias"), ours, theirs, ref_grads)]
    for name, got, cublas, ref in pairs:
        ours_err, cublas_err = numerics.rel_err(got, ref), numerics.rel_err(cublas, ref)
        bar = FWD_TOL if name in ("y", "dx") else GRAD_TOL
        assert ours_err <= bar, (head, m, name, ours_err, cublas_err)


@pytest.mark.gpu
@pytest.mark.parametrize("head", IDS)
@pytest.mark.parametrize("m", [4097, 8192])  # the wgrad's chunks and tail; chunks alone (a zeroed last partial)
def test_parameter_gradients_are_repeatable(head, m):
    from poison import poison_allocator

    w, b = _params(HEADS[head], 16, "cuda")
    x = _randn((m, w.shape[1]), 17, "cuda")
    grad = _randn((m, w.shape[0]), 18, "cuda")
    first = ops.linear_backward(grad, x, w)
    poison_allocator()
    second = ops.linear_backward(grad, x, w)
    for name, a, c in zip(("dx", "dweight", "dbias"), first, second):
        assert_same_bits(a, c, f"{head} {name}")


@pytest.mark.gpu
@pytest.mark.parametrize("head", IDS)
@pytest.mark.parametrize("m", [1, 129, 4097, 8192])
def test_poisoned_outputs_are_overwritten(head, m):
    """Every output allocated over NaN-filled memory (poison_allocator) is finite for finite inputs."""
    from poison import poison_allocator

    w, b = _params(HEADS[head], 19, "cuda")
    x = _randn((m, w.shape[1]), 20, "cuda")
    grad = _randn((m, w.shape[0]), 21, "cuda")
    poison_allocator()
    outs = [ops.linear(x, w, b), ops.linear(x, w), *ops.linear_backward(grad, x, w)]
    for i, out in enumerate(outs):
        assert torch.isfinite(out).all(), (head, m, i)


@pytest.mark.gpu
@pytest.mark.parametrize("head", IDS)
def test_a_nan_row_stays_in_its_row(head):
    w, b = _params(HEADS[head], 22, "cuda")
    x = _randn((300, w.shape[1]), 23, "cuda")
    grad = _randn((300, w.shape[0]), 24, "cuda")
    clean_y, clean_dx = ops.linear(x, w, b), _h3_dgrad(grad, w)
    x[77, 5] = float("nan")
    grad[77, 3] = float("nan")
    y, dx = ops.linear(x, w, b), _h3_dgrad(grad, w)
    assert y[77].isnan().all() and dx[77].isnan().all()
    others = torch.arange(300, device="cuda") != 77
    assert same_bits(y[others], clean_y[others]) and same_bits(dx[others], clean_dx[others])


@pytest.mark.gpu
def test_empty_rows_on_cuda():
    w, b = _params(HEADS["proj_out"], 25, "cuda")
    for lead in ((0,), (3, 0)):
        x = torch.zeros(*lead, HIDDEN, device="cuda")
        assert ops.linear(x, w, b).shape == (*lead, VIDEO_PATCH)
        dx, dw, db = ops.linear_backward(torch.zeros(*lead, VIDEO_PATCH, device="cuda"), x, w)
        assert dx.shape == x.shape and not dw.any() and not db.any() and dw.shape == w.shape


@pytest.mark.gpu
@pytest.mark.parametrize("head", IDS)
def test_layouts_bias_none_and_autograd(head):
    """Leading dims and a non-contiguous x give the 2-D contiguous call's bits; bias=None is the -0.0-bias call,
    i.e. the bare K sum; autograd gives linear_backward's bits and skips dx where x needs none."""
    w, b = _params(HEADS[head], 26, "cuda")
    n, k = w.shape
    x = _randn((2, 50, k), 27, "cuda")
    flat = ops.linear(x.reshape(100, k), w, b)
    assert same_bits(ops.linear(x, w, b), flat.view(2, 50, n))
    strided = torch.empty((100, 2 * k), device="cuda")[:, ::2]
    strided.copy_(x.reshape(100, k))
    assert same_bits(ops.linear(strided, w, b), flat)
    assert same_bits(ops.linear(x, w), ops.linear(x, w, torch.full_like(b, -0.0)))
    assert numerics.rel_err(ops.linear(x, w), R.linear_fp64(x, w)) <= 2e-6
    grad = _randn((2, 50, n), 28, "cuda")
    for x_grad in (True, False):
        leaves = [x.clone().requires_grad_(x_grad), w.clone().requires_grad_(), b.clone().requires_grad_()]
        ops.linear(*leaves).backward(grad)
        dx, dw, db = ops.linear_backward(grad, x, w, x_grad)
        assert same_bits(leaves[1].grad, dw) and same_bits(leaves[2].grad, db)
        assert (leaves[0].grad is not None) == x_grad
        if x_grad:
            assert same_bits(leaves[0].grad, dx)
        else:
            assert dx.shape == (0, k)
