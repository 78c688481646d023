"""`h3::linear` (+ `_backward`): the batch-invariant FP32 linear of MiniMax-H3's input and output heads
(`proj_in`, `audio_proj_in`, `proj_out`, `audio_proj_out`; weight shapes `widths.LINEAR_SHAPES`).

y = x weight^T + bias, FP32 in and out, x (..., K) with any leading dims and strides. On CUDA every row of y and
of dx is a function of that row of x (of grad), the weight and the static widths alone, never of the row count or
the other rows (kernels/linear.py); dweight and dbias are bitwise repeatable run to run. Other weight shapes are
refused (the kernels are compiled for these widths).

CPU impls: torch's FP32 `F.linear` and FP32 matmuls / `sum(0)` (deterministic on CPU); they are the reference the
CPU tests hold to FP64, not bit-equal to the CUDA kernels (3xTF32 chunk sums) and not row-invariant by
construction.
"""
import torch
import torch.nn.functional as F

from h3cute.ops import validate
from h3cute.ops._library import Op, declare, resolve_launch

_LINEAR = resolve_launch("linear")


def _linear_backward_cpu(grad, x, weight, x_grad=True):
    n, k = weight.shape
    g, rows = grad.reshape(-1, n), x.reshape(-1, k)
    dx = (g @ weight).view(x.shape) if x_grad else x.new_empty((0, k))
    return dx, g.t() @ rows, g.sum(0)


def _linear_backward_fake(grad, x, weight, x_grad=True):
    n, k = weight.shape
    return (x.new_empty(x.shape if x_grad else (0, k)), weight.new_empty((n, k)), weight.new_empty((n,)))


def _linear_setup_context(ctx, inputs, output):
    x, weight, bias = inputs
    ctx.has_bias = bias is not None
    ctx.save_for_backward(x, weight)


def _linear_backward(ctx, grad):
    x, weight = ctx.saved_tensors
    x_grad = ctx.needs_input_grad[0]
    dx, dweight, dbias = torch.ops.h3.linear_backward(grad, x, weight, x_grad)
    return dx if x_grad else None, dweight, dbias if ctx.has_bias else None


LINEAR = declare(Op(
    "linear(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor",
    check=validate.check_linear,
    cpu=F.linear,
    cuda=lambda x, weight, bias=None: _LINEAR.forward(x, weight, bias),
    fake=lambda x, weight, bias=None: x.new_empty((*x.shape[:-1], weight.shape[0])),
    rows="x",
    backward_op=Op(
        "linear_backward(Tensor grad, Tensor x, Tensor weight, bool x_grad=True) "
        "-> (Tensor dx, Tensor dweight, Tensor dbias)",
        check=lambda grad, x, weight, x_grad=True: validate.check_linear(x, weight, grad=grad),
        cpu=_linear_backward_cpu,
        cuda=lambda *args: _LINEAR.backward(*args),
        fake=_linear_backward_fake,
        rows="x",
    ),
    setup_context=_linear_setup_context,
    backward=_linear_backward,
))

_linear_cuda = LINEAR.cuda_impl
_linear_backward_cuda = LINEAR.backward_op.cuda_impl
