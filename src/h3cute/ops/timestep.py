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
from h3cute.ops._library import Op, declare, refuse_forward_ad, resolve_launch
from h3cute.ops.validate import F32
from h3cute.widths import FREQ, TEMB

_SINUSOID = resolve_launch("timestep_sinusoid")
_MLP = resolve_launch("timestep_mlp")


# ---- timestep_sinusoid -----------------------------------------------------------------------------

_NO_GRAD = (
    "h3::timestep_sinusoid has no backward: H3 timesteps are inputs, not parameters; "
    "pass t.detach() (the timestep MLP after it is differentiable)"
)


def _check_sinusoid(t, check_range=True):
    validate.check_timestep_sinusoid(t)
    if t.requires_grad and torch.is_grad_enabled():
        raise RuntimeError(_NO_GRAD)
    if forward_ad._current_level >= 0:  # a tangent on t: refused as a gradient is
        refuse_forward_ad("timestep_sinusoid", (t,))


def _sinusoid_cpu(t, check_range=True):
    if check_range:
        validate.check_timestep_values(t)
    return reference.timestep_sinusoid_replay(t)


def _sinusoid_launch(t, check_range=True):
    # The range check runs inside the kernel (a NaN row and a check-slot record, no host sync).
    return _SINUSOID.forward(t if t.dtype == F32 else t.float(), check_range)


SINUSOID = declare(Op(
    "timestep_sinusoid(Tensor t, bool check_range=True) -> Tensor",
    check=_check_sinusoid,
    cpu=_sinusoid_cpu,
    cuda=_sinusoid_launch,
    fake=lambda t, check_range=True: t.new_empty((t.shape[0], FREQ), dtype=F32),
    rows="t",
))


# ---- timestep_mlp ------------------------------------------------------------------------------------

def _mlp_backward_cpu(grad, x, w1, b1, w2):
    h = F.linear(x, w1, b1)
    sig = torch.sigmoid(h)
    dw2 = grad.t() @ (h * sig)
    db2 = grad.sum(0)
    dh = (grad @ w2) * (sig * (1 + h * (1 - sig)))  # silu'(h) = s (1 + h (1 - s))
    return dh @ w1, dh.t() @ x, dh.sum(0), dw2, db2


def _mlp_setup_context(ctx, inputs, output):
    x, w1, b1, w2, _ = inputs
    ctx.save_for_backward(x, w1, b1, w2)


def _mlp_backward(ctx, grad):
    x, w1, b1, w2 = ctx.saved_tensors
    return torch.ops.h3.timestep_mlp_backward(grad.contiguous(), x, w1, b1, w2)


MLP = declare(Op(
    "timestep_mlp(Tensor x, Tensor w1, Tensor b1, Tensor w2, Tensor b2) -> Tensor",
    check=validate.check_timestep_mlp,
    cpu=reference.timestep_mlp_replay,
    cuda=lambda *args: _MLP.forward(*args),
    fake=lambda x, w1, b1, w2, b2: x.new_empty((x.shape[0], TEMB)),
    rows="x",
    backward_op=Op(
        "timestep_mlp_backward(Tensor grad, Tensor x, Tensor w1, Tensor b1, Tensor w2) "
        "-> (Tensor dx, Tensor dw1, Tensor db1, Tensor dw2, Tensor db2)",
        check=lambda grad, x, w1, b1, w2: validate.check_timestep_mlp(x, w1, b1, w2, grad=grad),
        cpu=_mlp_backward_cpu,
        cuda=lambda *args: _MLP.backward(*args),
        fake=lambda grad, x, w1, b1, w2: (torch.empty_like(x), torch.empty_like(w1), torch.empty_like(b1),
                                          torch.empty_like(w2), w2.new_empty((TEMB,))),
        rows="x",
    ),
    setup_context=_mlp_setup_context,
    backward=_mlp_backward,
))

# The Python CUDA impls, by the names h3_native.cpp calls for inputs off its fast path.
_sinusoid_cuda = SINUSOID.cuda_impl
_mlp_cuda = MLP.cuda_impl
_mlp_backward_cuda = MLP.backward_op.cuda_impl
