"""The `h3` op namespace and the lookup of each op's CUDA launch module.

`torch.library.Library("h3", "DEF")` plus `impl` costs about 8 us per call on the H200 against about 16 us
for `@torch.library.custom_op`, so every op is defined through this one Library object.

Autograd: `register_autograd` installs one Python kernel at the Autograd key, like
`torch.library.register_autograd` but without its per-call schema walk (`fill_defaults` rebuilds the
schema's argument list per argument: tens of us per call) and pytree/dataclass work. Without a gradient
to record it redispatches below autograd; with one it applies a plain `autograd.Function`.

C++ CUDA impls and autograd kernels (`h3cute.native`): ops the C++ layer implements get no Python CUDA impl
(or autograd kernel) here; `install_native` registers the C++ ones once every op is defined. The C++ impl
hands any input off its fast path to the Python CUDA impl, so errors and rare cases keep one implementation.

Launch modules (`h3cute.launch.<op>`) are resolved once, at import. An op whose module is absent gets a
stand-in whose `forward`/`backward` raise `NotImplementedError`: the CUDA path never falls back to a
library call that is not batch-invariant.
"""
import importlib

import torch
from torch import _C

from h3cute import native

LIB = torch.library.Library("h3", "DEF")
NATIVE_OPS = native.native_ops()
NATIVE_AUTOGRAD_OPS = native.native_autograd_ops()


def define(schema: str, cpu, cuda, fake) -> str:
    """Defines `h3::<schema>` with its CPU and CUDA impls (the CUDA one in C++ where `h3cute.native` has
    it) and its fake (meta) impl; returns the qualified name `h3::<op>`."""
    name = schema.split("(", 1)[0]
    LIB.define(schema)
    LIB.impl(name, _without_autocast(cpu), "CPU")
    if name not in NATIVE_OPS:
        LIB.impl(name, cuda, "CUDA")
    torch.library.register_fake(f"h3::{name}", fake, lib=LIB)
    return f"h3::{name}"


def _without_autocast(cpu):
    """The ops compute in their own dtypes under autocast (no autocast kernel: the dispatcher passes them
    through). The CUDA impls launch kernels; the CPU impls are torch ops, which CPU autocast would otherwise
    recast (the replay's FP32 F.linear to BF16)."""
    def impl(*args):
        with torch.autocast("cpu", enabled=False):
            return cpu(*args)
    impl.__name__ = cpu.__name__
    return impl


def install_native() -> None:
    """Registers the C++ CUDA impls (call after every op is defined); no-op without the C++ layer."""
    if NATIVE_OPS:
        native.load().install()


def register_autograd(name: str, backward, setup_context, forward_op: str | None = None) -> None:
    """Autograd for `h3::<name>`: `setup_context(ctx, inputs, output)` sees every argument (defaults filled
    in); `backward(ctx, *grads)` returns one gradient per argument (trailing Nones may be dropped or
    extra). A `Tensor[]` output travels through autograd as a tuple; `backward` then gets the grads as one
    list, as `torch.library.register_autograd` gives them. `forward_op`: an h3 op with the same arguments
    run instead, whose first output is this op's and whose others are kept for the backward (setup_context
    gets them all).
    """
    if name in NATIVE_AUTOGRAD_OPS:  # the same logic in C++ (h3cute/native/h3_native.cpp)
        return
    op = getattr(torch.ops.h3, name).default
    run = getattr(torch.ops.h3, forward_op).default if forward_op else op
    defaults = tuple(a.default_value for a in op._schema.arguments)
    returns_list = str(op._schema.returns[0].type) == "List[Tensor]"

    def forward(ctx, *args):
        with _C._AutoDispatchBelowAutograd():
            out = run(*args)
        setup_context(ctx, args + defaults[len(args):], out)
        if forward_op:
            out = out[0]
        return tuple(out) if returns_list else out

    grads_fn = (lambda ctx, *grads: backward(ctx, list(grads))) if returns_list else backward
    fn = type(f"H3Autograd_{name}", (torch.autograd.Function,),
              {"forward": staticmethod(forward), "backward": staticmethod(grads_fn)})
    # Function.apply minus its functorch bookkeeping (a pytree walk per call), used when no functorch
    # transform is active; under one, the full `fn.apply`.
    apply_plain = super(torch.autograd.Function, fn).apply

    def autograd_kernel(*args):
        if _C.is_grad_enabled() and _C._any_requires_grad(*args):
            out = fn.apply(*args) if _C._are_functorch_transforms_active() else apply_plain(*args)
            return list(out) if returns_list else out
        with _C._AutoDispatchBelowAutograd():
            return op(*args)

    LIB.impl(name, autograd_kernel, "Autograd")


class MissingLaunch:
    """Stands in for `h3cute.launch.<op>` while that module is not written yet."""

    def __init__(self, op: str):
        self.op = op

    def _raise(self, *args, **kwargs):
        raise NotImplementedError(
            f"h3::{self.op}: the CUDA kernel is not built yet (module h3cute.launch.{self.op} is missing); "
            "run on CPU tensors for the PyTorch reference path"
        )

    forward = backward = forward_with_table = _raise


def resolve_launch(op: str):
    """Returns `h3cute.launch.<op>`, or a `MissingLaunch` if that module does not exist.

    An import error *inside* an existing launch module propagates: it is a bug, not a missing kernel.
    """
    module = f"h3cute.launch.{op}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        if err.name != module:
            raise
        return MissingLaunch(op)
