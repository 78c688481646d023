"""`h3::timestep_sinusoid` and `h3::timestep_mlp` (+ `_backward`): the FP32 timestep embedder of H3.

timestep_sinusoid: (T,) t in [0, 1] -> (T, 256) FP32 `[cos(t f_k) | sin(t f_k)]`, f_k = 10000^(-k/128).
BF16/FP16/FP64 t is widened to FP32 first, exactly as diffusers' `timesteps[:, None].float()` does. The op
has no backward: H3 timesteps are data, not parameters, so asking for a gradient (or passing a dual `t` of
torch.autograd.forward_ad) through it is an error (raised at the forward, where the mistake is made). The impls
raise it themselves (t.requires_grad under grad mode, and t's tangent, are visible below autograd): the op has
no autograd kernel, whose Python call would cost every call (so torch.func.jvp, whose tangent the impls never
see, gets a zero tangent).

timestep_mlp: `linear(silu(linear(x, w1, b1)), w2, b2)`, all FP32, x (T, 256) -> (T, 2688). The CPU
backward recomputes the hidden activation and works in FP32 throughout; CPU matmuls and sums are
deterministic, so the weight and bias gradients are bitwise repeatable.
"""
import torch
import torch.nn.functional as F
from torch.autograd import forward_ad

from h3cute import reference
from h3cute.ops import validate
from h3cute.ops._library import define, refuse_forward_ad, register_autograd, resolve_launch
from h3cute.ops.validate import F32
from h3cute.widths import FREQ, TEMB

_SINUSOID = resolve_launch("timestep_sinusoid")
_MLP = resolve_launch("timestep_mlp")


# ---- timestep_sinusoid -----------------------------------------------------------------------------

_NO_GRAD = (
    "h3::timestep_sinusoid has no backward: H3 timesteps are inputs, not parameters; "
    "pass t.detach() (the timestep MLP after it is differentiable)"
)


def _check_sinusoid(t):
    validate.check_timestep_sinusoid(t)
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(_NO_GRAD)
    if forward_ad._current_level >= 0:  # a tangent on t: refused as a gradient is
        refuse_forward_ad("timestep_sinusoid", (t,))


def _sinusoid_cpu(t, check_range=True):
    _check_sinusoid(t)
    if check_range:
        validate.check_timestep_values(t)
    return reference.timestep_sinusoid_replay(t)


def _sinusoid_cuda(t, check_range=True):
    _check_sinusoid(t)
    if t.dtype != F32:
        t = t.float()
    # The range check runs inside the kernel (a NaN row and a check-slot record, no host sync).
    if t.shape[0] == 0:
        return t.new_empty((0, FREQ))
    return _SINUSOID.forward(t, check_range)


def _sinusoid_fake(t, check_range=True):
    _check_sinusoid(t)
    return t.new_empty((t.shape[0], FREQ), dtype=F32)


define("timestep_sinusoid(Tensor t, bool check_range=True) -> Tensor", _sinusoid_cpu, _sinusoid_cuda, _sinusoid_fake)


# ---- timestep_mlp ------------------------------------------------------------------------------------

def _mlp_cpu(x, w1, b1, w2, b2):
    validate.check_timestep_mlp(x, w1, b1, w2, b2)
    return reference.timestep_mlp_replay(x, w1, b1, w2, b2)


def _mlp_cuda(x, w1, b1, w2, b2):
    validate.check_timestep_mlp(x, w1, b1, w2, b2)
    if x.shape[0] == 0:
        return x.new_empty((0, TEMB))
    return _MLP.forward(x, w1, b1, w2, b2)


def _mlp_fake(x, w1, b1, w2, b2):
    validate.check_timestep_mlp(x, w1, b1, w2, b2)
    return x.new_empty((x.shape[0], TEMB))


def _mlp_backward_cpu(grad, x, w1, b1, w2):
    validate.check_timestep_mlp(x, w1, b1, w2, grad=grad)
    h = F.linear(x, w1, b1)
    sig = torch.sigmoid(h)
    dw2 = grad.t() @ (h * sig)
    db2 = grad.sum(0)
    dh = (grad @ w2) * (sig * (1 + h * (1 - sig)))  # silu'(h) = s (1 + h (1 - s))
    return dh @ w1, dh.t() @ x, dh.sum(0), dw2, db2


def _mlp_backward_cuda(grad, x, w1, b1, w2):
    validate.check_timestep_mlp(x, w1, b1, w2, grad=grad)
    if x.shape[0] == 0:
        return x.new_empty((0, FREQ)), torch.zeros_like(w1), torch.zeros_like(b1), torch.zeros_like(w2), \
            w2.new_zeros((TEMB,))
    return _MLP.backward(grad, x, w1, b1, w2)


def _mlp_backward_fake(grad, x, w1, b1, w2):
    validate.check_timestep_mlp(x, w1, b1, w2, grad=grad)
    return torch.empty_like(x), torch.empty_like(w1), torch.empty_like(b1), torch.empty_like(w2), \
        w2.new_empty((TEMB,))


def _mlp_setup_context(ctx, inputs, output):
    x, w1, b1, w2, _ = inputs
    ctx.save_for_backward(x, w1, b1, w2)


def _mlp_backward(ctx, grad):
    x, w1, b1, w2 = ctx.saved_tensors
    return torch.ops.h3.timestep_mlp_backward(grad.contiguous(), x, w1, b1, w2)


define("timestep_mlp(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> Tensor", _mlp_cpu, _mlp_cuda, _mlp_fake)
define(
    "timestep_mlp_backward(Tensor grad, Tensor x, Tensor w1, Tensor b1, Tensor w2) "
    "-> (Tensor dx, Tensor dw1, Tensor db1, Tensor dw2, Tensor db2)",
    _mlp_backward_cpu,
    _mlp_backward_cuda,
    _mlp_backward_fake,
)
register_autograd("timestep_mlp", _mlp_backward, _mlp_setup_context)
