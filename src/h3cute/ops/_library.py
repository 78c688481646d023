"""The `h3` op namespace, the op declaration (`Op`, `declare`) and the lookup of each op's CUDA launch module.

Each op is one `Op`: its schema, its checks, the bodies of its CPU, CUDA and fake impls, its BF16 arguments, its
row argument and its autograd (the backward op, declared inside it, with `setup_context` and `backward`).
`declare` registers all of it; the checks run once in front of every impl, so an impl body sees checked inputs.

`torch.library.Library("h3", "DEF")` plus `impl` costs about half the host time per call of
`@torch.library.custom_op`, so every op is defined through this one Library object.

Autograd: `register_autograd` installs one Python kernel at the Autograd key, like
`torch.library.register_autograd` but without its per-call schema walk (`fill_defaults` rebuilds the
schema's argument list per argument: tens of us per call) and pytree/dataclass work. Without a gradient
to record it redispatches below autograd; with one it applies a plain `autograd.Function`.

C++ CUDA impls and autograd kernels (`h3cute.native`): ops the C++ layer implements get no Python CUDA impl
(or autograd kernel) here; `install_native` registers the C++ ones once every op is defined. The C++ impl
hands any input off its fast path to the Python CUDA impl, so errors and rare cases keep one implementation.

Autocast: every op has a kernel at AutocastCPU and AutocastCUDA (`torch.autocast`); without autocast the
dispatcher never reaches those keys, so they cost nothing then. The kernel runs the op with autocast off, so the
CPU references' F.linear and matmuls keep the dtypes the op defines instead of autocast's. The op's dtypes win over
autocast's: an FP32 op (timestep_sinusoid, timestep_mlp and its backward) returns FP32, a BF16 op BF16, also under
`autocast(dtype=torch.float16)`. Inputs: an FP32 or FP16 tensor passed where the schema requires BF16 (each
op's `bf16` argument names) is cast to BF16, autocast's lower-precision policy, so modules holding FP32 weights
run the BF16 ops under autocast as they run F.linear; as autocast does, FP64 is never cast. A BF16 or FP16 tensor
where the op requires FP32 (the MLP's inputs, `temb`) is not cast up: autocast never produces one when the h3 ops
are used end to end (timestep_sinusoid and timestep_mlp stay FP32), and the bits an upcast cannot restore are
the H3 defects those checks exist to catch (a time embedder cast down, temb cast before the SiLU); it raises the
dtype error it raises outside autocast. The casts are recorded by autograd, so gradients reach the FP32 originals.

Forward-mode AD (`torch.func.jvp`, `torch.autograd.forward_ad`) is refused with an error naming the op: the ops
define reverse-mode derivatives only, and a dual input would otherwise leave with a zero (or, where the CPU
reference propagates it, a device-dependent) tangent. The check reads one module global per call unless a dual
level is open.

Launch modules (`h3cute.launch.<op>`) are resolved once, at import. An op whose module is absent gets a
stand-in whose `forward`/`backward` raise `NotImplementedError`: the CUDA path never falls back to a
library call that is not batch-invariant.
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import _C
from torch.autograd import forward_ad

from h3cute import native
from h3cute.launch import checks

LIB = torch.library.Library("h3", "DEF")
NATIVE_OPS = native.native_ops()
NATIVE_AUTOGRAD_OPS = native.native_autograd_ops()


@dataclass(frozen=True, eq=False)
class Op:
    """One `h3` op, declared once; `declare` registers everything below from it.

    `schema`: the op's `torch.library` schema. `check(*args)`: the attribute checks (`h3cute.ops.validate`), run
    before each impl with the op's arguments. `cpu`, `cuda`, `fake`: the impls' bodies, given checked arguments
    (`cpu` the reference and any value checks, `cuda` the launch, `fake` the outputs' shapes). `bf16`: the
    tensor arguments the op takes in BF16, which its autocast kernels cast (the others are FP32 or int64).
    `rows`: the argument whose first dimension is the row count, for ops whose outputs with no rows need no
    kernel: then the CUDA impl returns the fake impl's outputs zero-filled (a reduction over no rows is zero)
    without a launch. Autograd: `backward_op` (declared with this op), `setup_context(ctx, inputs, output)` and
    `backward(ctx, *grads)` as `register_autograd` takes them, `forward_op` the op autograd runs instead
    (declared with this op; see `register_autograd`).
    """

    schema: str
    check: Callable
    cpu: Callable
    cuda: Callable
    fake: Callable
    bf16: tuple[str, ...] = ()
    rows: str | None = None
    backward_op: Op | None = None
    setup_context: Callable | None = None
    backward: Callable | None = None
    forward_op: Op | None = None

    @property
    def name(self) -> str:
        return self.schema.split("(", 1)[0]

    @cached_property
    def cpu_impl(self):
        """The CPU impl: `check`, then `cpu`."""
        return _checked(self, self.cpu)

    @cached_property
    def cuda_impl(self):
        """The Python CUDA impl: `check`, the no-row case, then `cuda`. The C++ layer calls it (by its module
        name, `_<op>_cuda`) for every input off its fast path."""
        return _checked(self, self.cuda, rows=self.rows)

    @cached_property
    def fake_impl(self):
        """The fake (meta) impl: `check`, then `fake`."""
        return _checked(self, self.fake)


def _checked(op: Op, body, rows: str | None = None, pending: bool = False):
    """`body` behind `op.check` (and, with `pending`, h3cute.launch.checks' pending errors first); with `rows`,
    an input with no rows returns `op.fake`'s outputs zero-filled instead of calling `body`."""
    check, fake = op.check, op.fake
    row = _argument_names(op.schema).index(rows) if rows is not None else -1

    def impl(*args):
        if pending:
            checks.raise_pending()
        check(*args)
        if row >= 0 and args[row].shape[0] == 0:
            return _zeroed(fake(*args))
        return body(*args)

    impl.__name__ = f"{op.name}_{getattr(body, '__name__', 'impl')}"
    return impl


def _argument_names(schema: str) -> list[str]:
    """The argument names of a schema string, by torch's own schema parser (before the op is defined)."""
    return [a.name for a in _C.parse_schema(schema).arguments]


def _zeroed(out):
    if isinstance(out, torch.Tensor):
        return out.zero_()
    return type(out)(t.zero_() for t in out)


DECLARED: dict[str, Op] = {}  # every declared op (backward and autograd-forward ops included), by name


def declare(op: Op) -> Op:
    """Defines `h3::<op.name>` from its declaration, then its `forward_op` and `backward_op`, then its
    autograd: the CPU impl, the CUDA impl (the C++ one where `h3cute.native` has it; a Python one first raises
    any bad input an earlier call's kernels recorded, h3cute.launch.checks, as the C++ impls do), the fake
    (meta) impl, the autocast kernels and, with `backward`, the autograd kernel (the C++ one where
    `h3cute.native` has it). Returns `op`."""
    name = op.name
    if op.rows is not None and op.rows not in _argument_names(op.schema):
        raise ValueError(f"h3::{name}: rows names {op.rows!r}, not an argument of the op")
    if (op.backward is None) != (op.setup_context is None):
        raise ValueError(f"h3::{name}: an autograd declaration needs both backward and setup_context")
    LIB.define(op.schema)
    DECLARED[name] = op
    LIB.impl(name, op.cpu_impl, "CPU")
    if name not in NATIVE_OPS:
        LIB.impl(name, _checked(op, op.cuda, rows=op.rows, pending=True), "CUDA")
    torch.library.register_fake(f"h3::{name}", op.fake_impl, lib=LIB)
    _register_autocast(name, op.bf16)
    for linked in (op.forward_op, op.backward_op):
        if linked is not None:
            declare(linked)
    if op.backward is not None:
        register_autograd(name, op.backward, op.setup_context, op.forward_op.name if op.forward_op else None)
    return op


_AUTOCAST_KEYS = _C.DispatchKeySet(_C.DispatchKey.AutocastCPU) | _C.DispatchKeySet(_C.DispatchKey.AutocastCUDA)
_CAST_TO_BF16 = (torch.float32, torch.float16)  # autocast's eligible dtypes (never FP64) other than BF16
_BF16_ARGUMENTS: dict[str, tuple[str, ...]] = {}  # op -> the arguments its autocast kernel casts


def autocast_bf16(name: str) -> tuple[str, ...]:
    """The arguments of `h3::<name>` that its autocast kernel casts to BF16."""
    return _BF16_ARGUMENTS[name]


def _to_bf16(a):
    if a.__class__ is list:  # Tensor[]
        return [_to_bf16(t) for t in a]
    return a.to(torch.bfloat16) if a is not None and a.dtype in _CAST_TO_BF16 else a


def _register_autocast(name: str, bf16: tuple[str, ...]) -> None:
    """The op's AutocastCPU / AutocastCUDA kernel (see the module docstring): casts the `bf16` arguments,
    then runs the op with autocast off."""
    op = getattr(torch.ops.h3, name).default
    arguments = [a.name for a in op._schema.arguments]
    unknown = set(bf16) - set(arguments)
    if unknown:
        raise ValueError(f"h3::{name}: bf16 names {sorted(unknown)}, not arguments of the op")
    positions = [i for i, a in enumerate(arguments) if a in bf16]
    _BF16_ARGUMENTS[name] = tuple(bf16)

    def autocast_kernel(*args, **kwargs):
        with _C._ExcludeDispatchKeyGuard(_AUTOCAST_KEYS):
            if positions:
                args = list(args)
                for i in positions:
                    if i < len(args):
                        args[i] = _to_bf16(args[i])
            return op(*args, **kwargs)

    LIB.impl(name, autocast_kernel, "AutocastCPU")
    LIB.impl(name, autocast_kernel, "AutocastCUDA")


def install_native() -> None:
    """Registers the C++ CUDA impls (call after every op is defined); no-op without the C++ layer."""
    if NATIVE_OPS:
        native.install(native.load())


def refuse_forward_ad(op: str, args) -> None:
    """Raises if any tensor in `args` carries a forward-mode tangent (call only while a dual level is open:
    `forward_ad._current_level >= 0`; torch.func.jvp opens one too)."""
    for a in args:
        if isinstance(a, torch.Tensor) and forward_ad.unpack_dual(a).tangent is not None:
            raise RuntimeError(
                f"h3::{op}: forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) is not supported; the op "
                "defines reverse-mode gradients only (torch.autograd.grad, torch.func.vjp)"
            )


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
        if forward_ad._current_level >= 0:
            refuse_forward_ad(name, args)
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
