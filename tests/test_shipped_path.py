"""The shipped path on CUDA: every op called through `torch.ops.h3` exactly as users call it (default arguments:
`check_indices=True`, `check_range=True`), forward and backward through its autograd kernel (the C++ layer's
where it is built), captured in a CUDA graph and compiled by Inductor.

- CUDA graph: fwd+bwd captured once (after warm-up on a side stream, torch's whole-network recipe), then, for
  two new sets of inputs copied into the static inputs, every output and gradient of the graph filled with
  NaN and the graph replayed: bitwise the eager call on the same inputs.
- torch.compile(fullgraph=True) on CUDA (Inductor): the compiled forward and the backward AOTAutograd derives
  from the op's autograd formula, on allocator pools poisoned before each call, twice on new inputs: bitwise
  the eager call.

H3 widths, small row counts (T = 3 timesteps; S = 33 rows over 3 timesteps for the row ops)."""
import pytest
import torch

import h3cute  # noqa: F401  (registers torch.ops.h3)
from h3cute import reference as R

from bitwise import assert_same_bits
from poison import poison_allocator
from test_ops_gpu import DIFFERENTIABLE, T_OPS, cuda_inputs, flat, run, upstream

pytestmark = pytest.mark.gpu

ROWS = 33  # S for the row ops (T for the timestep ops: 3)


def _rows(op):
    return 3 if op in T_OPS else ROWS


def _inputs(op, seed):
    """Positional arguments (tensors only: every default left as users leave it) and upstream gradients."""
    args = cuda_inputs(op, _rows(op), seed=seed)
    ups = upstream(flat(getattr(torch.ops.h3, op)(*args)), seed=seed + 100) if DIFFERENTIABLE(op) else None
    return args, ups


def _assert_results(got, want, what):
    (outs, grads), (want_outs, want_grads) = got, want
    assert len(outs) == len(want_outs), what
    for k, (o, w) in enumerate(zip(outs, want_outs)):
        assert_same_bits(o, w, f"{what}: output {k}")
    for k, (g, w) in enumerate(zip(grads or (), want_grads or ())):
        assert (g is None) == (w is None), (what, k)
        if g is not None:
            assert_same_bits(g, w, f"{what}: gradient of argument {k}")


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    sa, sb = a.untyped_storage(), b.untyped_storage()
    return sa.data_ptr() < sb.data_ptr() + sb.nbytes() and sb.data_ptr() < sa.data_ptr() + sa.nbytes()


@pytest.mark.parametrize("op", R.OPS)
def test_cuda_graph_replays_fwd_bwd_with_the_eager_bits(op):
    args, ups = _inputs(op, seed=1)
    differentiable = ups is not None
    leaves = [a.detach().clone().requires_grad_(differentiable and a.is_floating_point()) for a in args]
    static_ups = [u.clone() for u in ups] if differentiable else None
    fn = getattr(torch.ops.h3, op)

    def step():
        outs = flat(fn(*leaves))
        if differentiable:
            torch.autograd.backward(outs, static_ups)
        return outs

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: kernels loaded, the C++ tables filled, outside capture
        for _ in range(2):
            for leaf in leaves:
                leaf.grad = None
            step()
    torch.cuda.current_stream().wait_stream(side)
    for leaf in leaves:
        leaf.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [o.detach() for o in step()]
    grads = [leaf.grad for leaf in leaves]
    inputs = [*leaves, *(static_ups or ())]
    results = [t for t in (*outs, *grads) if t is not None]
    for seed in (2, 3):
        new_args, new_ups = _inputs(op, seed)
        with torch.no_grad():
            for leaf, a in zip(leaves, new_args):
                leaf.copy_(a)
            for u, new in zip(static_ups or (), new_ups or ()):
                u.copy_(new)
            for t in results:  # an element the graph does not write stays NaN
                if not any(_overlaps(t, i) for i in inputs):  # (a gradient that is an input, e.g. d residual)
                    t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_results((outs, grads), run(op, new_args, new_ups), f"{op} graph replay, inputs {seed}")


@pytest.mark.parametrize("op", R.OPS)
def test_torch_compile_inductor_gives_the_eager_bits(op):
    torch._dynamo.reset()
    fn = getattr(torch.ops.h3, op)
    compiled = torch.compile(lambda *a: fn(*a), fullgraph=True, backend="inductor")
    for seed in (4, 5):
        args, ups = _inputs(op, seed)
        poison_allocator()
        got = run(op, args, ups, fn=compiled)
        _assert_results(got, run(op, args, ups), f"{op} under torch.compile (inductor), inputs {seed}")
