"""Launch plans: an op's launch sequence as data, written once in Python and walked by the Python launcher and by
the C++ layer alike.

A `Plan` holds, for one (op, phase, device, static key, row range), everything a launch needs beyond the op's
inputs: the buffers to allocate (dtype, shape; the buffers of one `arena` are carved from one allocation), the
steps in order (a kernel launch with its arguments, or a fill) and how the op's outputs are made from the buffers
and inputs. Every size and offset is a `Dim`, a function of the op's row count M of the form

    per_row * M + whole * (M // step * step) + const

(with `up`, M // step rounded up; with `count`, the whole steps counted, not times `step`), which covers what the
ops on plans need: row-proportional buffers (`M`), constants, a split of M into a bulk that is a multiple of `step`
(`M // step * step`) and its tail (`M - M // step * step`), M rounded up to a multiple of `step` (a K = M
zero-padded to whole k tiles) and the number of `step`-row blocks (one partial per block). A kernel argument is a
`View` of an input or buffer (optionally its dim-0 range [start, stop), then one `Layout`: as it is, transposed,
flattened, ..., or `Strided`: explicit sizes, strides and offset, e.g. a column block of partials), a `Scalar`
input passed by value (e.g. eps) or a plain int (e.g. a check slot's address). A step may be guarded by a `Cond`
on a `Dim`.

`walk` runs a plan with torch tensors (the Python launchers); `encode` flattens it into the nested int tuples that
`h3_native.cpp` decodes once into its typed `Plan` struct and walks with the same semantics (`describe_plan` and
`describe_walk` there return what it decoded and what it would launch, for the CPU tests). `plan_for` caches plans
per (op, phase, device, key) and row range, with the compiled kernels resolved once.
"""
from __future__ import annotations

import dataclasses
import enum
import functools
import threading
from dataclasses import dataclass
from typing import Callable, Union

import torch

from h3cute import runtime
from h3cute.launch import checks


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass(frozen=True)
class Dim:
    """per_row * M + whole * (M // step * step) + const, for the op's row count M; with `up`, M's steps rounded up
    ((M + step - 1) // step); with `count`, the whole term counts the steps (whole * (M // step))."""
    const: int = 0
    per_row: int = 0
    whole: int = 0
    step: int = 1
    up: bool = False
    count: bool = False

    def __call__(self, rows: int) -> int:
        steps = (rows + self.step - 1 if self.up else rows) // self.step
        return self.per_row * rows + self.whole * (steps if self.count else steps * self.step) + self.const

    def __add__(self, other: Dim | int) -> Dim:
        other = dim(other)
        if self.whole and other.whole and self._steps() != other._steps():
            raise ValueError(f"plan: {self} + {other} mixes row steps")
        outer = self if self.whole else other
        return Dim(self.const + other.const, self.per_row + other.per_row, self.whole + other.whole,
                   outer.step, outer.up, outer.count)

    def __neg__(self) -> Dim:
        return Dim(-self.const, -self.per_row, -self.whole, self.step, self.up, self.count)

    def _steps(self) -> tuple:
        return self.step, self.up, self.count

    def __sub__(self, other: Dim | int) -> Dim:
        return self + -dim(other)

    def __str__(self) -> str:
        terms = []
        steps = f"ceil(M/{self.step})" if self.up else f"M//{self.step}"
        steps += "" if self.count else f"*{self.step}"
        for coef, name in ((self.per_row, "M"), (self.whole, steps)):
            if coef:
                terms.append((coef, name if abs(coef) == 1 else f"{abs(coef)}*{name}"))
        if self.const or not terms:
            terms.append((self.const, str(abs(self.const))))
        text = ("-" if terms[0][0] < 0 else "") + terms[0][1]
        for coef, name in terms[1:]:
            text += (" - " if coef < 0 else " + ") + name
        return text


def dim(value: Dim | int) -> Dim:
    return value if isinstance(value, Dim) else Dim(const=int(value))


M = Dim(per_row=1)  # the op's row count


def any_rows(rows: int) -> tuple[int, int]:
    """The row range [lo, hi] serving `rows` of a plan that is the same at every row count from 1: [0, 0] for no
    rows (no launch), else [1, MAX_ROWS]."""
    return (0, 0) if rows == 0 else (1, runtime.MAX_ROWS)


def checked_launch(op: str, phase: Phase, key, device, rows: int, inputs: tuple, buffers: tuple, kernel: Kernel,
                   args: tuple, outputs: tuple, check: tuple[str, str, bool]) -> Plan:
    """The plan of a forward that is one launch over its rows at any row count (`any_rows`), none at zero rows (a
    zero-sized grid is not a valid launch); the kernel's last arguments are the addresses of the check slot
    `check` = (op, argument, checked) names (h3cute.launch.checks.slot_addresses), asked only when it launches."""
    lo, hi = any_rows(rows)
    steps = (Launch(kernel, (*args, *checks.slot_addresses(device, *check))),) if rows else ()
    return Plan(op, phase, key, lo, hi, inputs, buffers, steps, outputs)


def whole_rows(step: int) -> Dim:
    """M // step * step: the rows in whole steps."""
    return Dim(whole=1, step=step)


def rows_up(step: int) -> Dim:
    """(M + step - 1) // step * step: M rounded up to whole steps."""
    return Dim(whole=1, step=step, up=True)


def row_blocks(step: int) -> Dim:
    """(M + step - 1) // step: the step-row blocks of M rows, the last one partial."""
    return Dim(whole=1, step=step, up=True, count=True)


class Layout(str, enum.Enum):
    """How a (possibly row-ranged) tensor is handed to a kernel."""
    AS_IS = ""
    T = "t"  # a dense (R, C) as (C, R) with strides (1, C): the MN-major operand layout
    FLAT = "flat"  # a dense tensor as one (numel,) vector
    MATRIX = "matrix"  # a dense (D0, ...) as (D0, numel / D0)
    FIRST = "first"  # its first element as a (1,) vector (an operand the kernel never reads)
    ITEM0 = "[0]"  # dim 0's first entry (a (1, R, C) batch as its (R, C) matrix)
    STRIDED = "strided"  # the View's `strided` geometry over the source's memory (torch's as_strided)


@dataclass(frozen=True)
class Strided:
    """A view by explicit geometry: `sizes` and `strides` (elements) from element `offset` of the (row-ranged)
    source's start, as torch's as_strided; for the views a layout does not name (a column block of a buffer, a
    flat buffer's rows as a matrix)."""
    sizes: tuple[Dim, ...]
    strides: tuple[Dim, ...]
    offset: Dim = Dim()

    def __post_init__(self):
        if len(self.sizes) != len(self.strides) or len(self.sizes) > 3:
            raise ValueError(f"plan: a strided view of sizes {self.sizes} and strides {self.strides}")
        for name in ("sizes", "strides"):
            object.__setattr__(self, name, tuple(dim(d) for d in getattr(self, name)))
        object.__setattr__(self, "offset", dim(self.offset))

    def __str__(self) -> str:
        return (f"<({', '.join(map(str, self.sizes))}) : ({', '.join(map(str, self.strides))})"
                + (f" @ {self.offset}>" if self.offset != Dim() else ">"))


@dataclass(frozen=True)
class View:
    """A kernel's view of an input or buffer `of`: rows [start, stop) of dim 0 when `rows` is given, then `layout`
    (with Layout.STRIDED, the geometry `strided`)."""
    of: str
    rows: tuple[Dim, Dim] | None = None
    layout: Layout = Layout.AS_IS
    strided: Strided | None = None

    def __post_init__(self):
        if (self.layout is Layout.STRIDED) != (self.strided is not None):
            raise ValueError(f"plan: view of {self.of}: a Strided geometry goes with Layout.STRIDED, and only there")

    def __str__(self) -> str:
        text = self.of
        if self.rows is not None:
            text += f"[{self.rows[0]}:{self.rows[1]}]"
        if self.layout is Layout.ITEM0:
            return text + "[0]"
        if self.layout is Layout.STRIDED:
            return text + str(self.strided)
        return text + (f".{self.layout.value}" if self.layout.value else "")


def view(of: str, start: Dim | int | None = None, stop: Dim | int | None = None, layout: Layout = Layout.AS_IS) -> View:
    return View(of, None if start is None else (dim(start), dim(stop)), layout)


def strided(of: str, sizes: tuple, strides: tuple, offset: Dim | int = 0) -> View:
    """`of`'s memory as (sizes, strides) from element `offset` (Dims or ints)."""
    return View(of, None, Layout.STRIDED, Strided(tuple(sizes), tuple(strides), dim(offset)))


@dataclass(frozen=True)
class Scalar:
    """A float input of the op (e.g. eps) passed to a kernel by value (an FP32 scalar argument)."""
    of: str

    def __str__(self) -> str:
        return self.of


@dataclass(frozen=True)
class Cond:
    """Holds where `dim(M)` is non-zero (`nonzero`) or zero (not `nonzero`)."""
    dim: Dim
    nonzero: bool = True

    def __call__(self, rows: int) -> bool:
        return (self.dim(rows) != 0) == self.nonzero

    def __str__(self) -> str:
        return f"if {self.dim} {'!=' if self.nonzero else '=='} 0"


@dataclass(frozen=True)
class Kernel:
    """A compiled kernel: its registered name and static arguments (runtime.kernel's)."""
    name: str
    static: tuple = ()

    @staticmethod
    def of(name: str, **static) -> Kernel:
        return Kernel(name, tuple(static.items()))

    def __str__(self) -> str:
        return self.name + ("(" + ", ".join(f"{k}={v}" for k, v in self.static) + ")" if self.static else "")


Arg = Union[View, Scalar, int]


@dataclass(frozen=True)
class Launch:
    kernel: Kernel
    args: tuple[Arg, ...]
    when: Cond | None = None


@dataclass(frozen=True)
class Fill:
    target: View
    value: float
    when: Cond | None = None


Step = Union[Launch, Fill]


@dataclass(frozen=True)
class Buffer:
    """A buffer the walk allocates: on its own, or with `arena`, carved with the other buffers of that arena (one
    dtype) from one allocation, in declaration order, each region starting 16-byte aligned (the kernels' vector
    accesses): one allocation per arena is host time saved at small M."""
    name: str
    dtype: torch.dtype
    shape: tuple[Dim, ...]  # ints are taken as constant Dims
    arena: str = ""

    def __post_init__(self):
        object.__setattr__(self, "shape", tuple(dim(d) for d in self.shape))


@dataclass(frozen=True)
class ColumnSum:
    """torch's sum over dim 0 of `of` (a fixed reduction order for a given shape: bitwise repeatable)."""
    of: View


@dataclass(frozen=True)
class Output:
    """An output of the op: a view of a buffer or input, or a column sum; with `lead`, viewed as the op's leading
    row dims (its row input's shape but the last) followed by its own last dim."""
    source: View | ColumnSum
    lead: bool = False


@dataclass(frozen=True)
class Plan:
    op: str
    phase: Phase
    key: object  # the op's static key (a frozen dataclass of the op's launch module)
    lo: int  # the row range [lo, hi] the plan serves
    hi: int
    inputs: tuple[str, ...]  # the tensors `walk` takes, in order
    buffers: tuple[Buffer, ...]
    steps: tuple[Step, ...]
    outputs: tuple[Output, ...]

    def __post_init__(self):
        dtypes = {}
        for b in self.buffers:
            if b.arena and dtypes.setdefault(b.arena, b.dtype) != b.dtype:
                raise ValueError(f"plan of {self.op}: arena {b.arena!r} mixes dtypes")

    def arenas(self) -> tuple[str, ...]:
        """The arenas of the buffers, in order of first use."""
        return self._arenas

    @functools.cached_property
    def _layouts(self) -> dict:
        """rows -> the buffers' geometry at that row count (`_layout`): a plan serves a row range, and a workload
        calls it at a few row counts."""
        return {}

    @functools.cached_property
    def _arenas(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(b.arena for b in self.buffers if b.arena))

    def kernels(self) -> tuple[Kernel, ...]:
        """The plan's kernels, each once, in first-launch order."""
        return self._kernels

    @functools.cached_property
    def _kernels(self) -> tuple[Kernel, ...]:
        return tuple(dict.fromkeys(s.kernel for s in self.steps if isinstance(s, Launch)))

    @functools.cached_property
    def _program(self) -> tuple:
        """The walk's per-call work, worked out once per plan (a plan is built once per row range): for each step
        (step, kernel index or -1 for a fill, argument getters: a fill's target), and for each output (getter,
        column sum, lead)."""
        index = {k: i for i, k in enumerate(self.kernels())}
        steps = tuple((s, index[s.kernel], tuple(_getter(a) for a in s.args)) if isinstance(s, Launch)
                      else (s, -1, (_getter(s.target),)) for s in self.steps)
        outputs = tuple((_getter(o.source.of), True, o.lead) if isinstance(o.source, ColumnSum)
                        else (_getter(o.source), False, o.lead) for o in self.outputs)
        return steps, outputs

    def __str__(self) -> str:
        hi = "MAX" if self.hi == runtime.MAX_ROWS else self.hi
        lines = [f"{self.op} {self.phase.value} {self.key} rows [{self.lo}, {hi}]",
                 f"  inputs: {', '.join(self.inputs)}"]
        for b in self.buffers:
            arena = f" in {b.arena}" if b.arena else ""
            lines.append(f"  buffer {b.name}: {_DTYPE_NAMES[b.dtype]} ({', '.join(str(d) for d in b.shape)}){arena}")
        for s in self.steps:
            guard = f"  {s.when}" if s.when else ""
            if isinstance(s, Launch):
                args = ", ".join(hex(a) if isinstance(a, int) else str(a) for a in s.args)
                lines.append(f"  {s.kernel}({args}){guard}")
            else:
                lines.append(f"  fill {s.target} = {s.value}{guard}")
        for o in self.outputs:
            src = f"sum0({o.source.of})" if isinstance(o.source, ColumnSum) else str(o.source)
            lines.append(f"  -> {src}{' as rows' if o.lead else ''}")
        return "\n".join(lines)


_DTYPE_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int64: "i64"}
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.int64: 2}  # h3_native.cpp plan_dtype
LAYOUT_CODES = {layout: i for i, layout in enumerate(Layout)}  # h3_native.cpp Layout, in this order


# ---- the Python walker ------------------------------------------------------------------------------------


def _view(env: dict, v: View, rows: int) -> torch.Tensor:
    t = env[v.of]
    if v.rows is not None:
        t = t[v.rows[0](rows):v.rows[1](rows)]
    if v.layout is Layout.T:  # as_strided keeps t's storage offset
        return t.as_strided((t.shape[1], t.shape[0]), (1, t.shape[1]))
    if v.layout is Layout.FLAT:
        return t.view(-1)
    if v.layout is Layout.MATRIX:
        return t.reshape(t.shape[0], -1)
    if v.layout is Layout.FIRST:
        return t.view(-1)[:1]
    if v.layout is Layout.ITEM0:
        return t[0]
    if v.layout is Layout.STRIDED:
        g = v.strided
        return t.as_strided(tuple(d(rows) for d in g.sizes), tuple(d(rows) for d in g.strides),
                            t.storage_offset() + g.offset(rows))
    return t


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def carve(plan: Plan, rows: int) -> tuple[dict, list]:
    """Where each carved buffer lies for `rows` rows: ({buffer name: (arena index, element offset)}, [elements per
    arena]); regions in declaration order, each start rounded up to 16 bytes (h3_native.cpp's walk: the same)."""
    arenas = {name: i for i, name in enumerate(plan.arenas())}
    totals, regions = [0] * len(arenas), {}
    for b in plan.buffers:
        if b.arena:
            i, align = arenas[b.arena], 16 // b.dtype.itemsize
            start = -(-totals[i] // align) * align
            regions[b.name] = (i, start)
            totals[i] = start + _numel(d(rows) for d in b.shape)
    return regions, totals


def allocate(plan: Plan, rows: int, device, given: dict | None = None) -> dict:
    """{buffer name: tensor} of `plan`'s buffers for `rows` rows: each on its own, or a region of its arena's one
    allocation (made at the arena's first buffer); those named in `given` are the caller's tensors, taken as they
    are (e.g. a test's guarded output)."""
    totals, buffers = _layout(plan, rows)
    arenas, env = [None] * len(totals), {}
    for name, dtype, shape, arena, start, strides in buffers:
        if given and name in given:
            env[name] = given[name]
        elif arena < 0:
            env[name] = torch.empty(shape, dtype=dtype, device=device)
        else:
            if arenas[arena] is None:
                arenas[arena] = torch.empty((totals[arena],), dtype=dtype, device=device)
            env[name] = arenas[arena].as_strided(shape, strides, start)  # its region, contiguous
    return env


def _contiguous_strides(shape: tuple) -> tuple:
    """torch's strides of a contiguous tensor of `shape` (a size 0 counts as 1)."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


_LAYOUTS_KEPT = 64  # row counts whose geometry a plan keeps (`_layout`)


def _per_rows(cache: dict, rows: int, compute: Callable[[int], tuple]) -> tuple:
    """compute(rows), kept in `cache` for up to _LAYOUTS_KEPT row counts (then the cache starts again)."""
    value = cache.get(rows)
    if value is None:
        if len(cache) >= _LAYOUTS_KEPT:
            cache.clear()
        value = cache[rows] = compute(rows)
    return value


def _layout(plan: Plan, rows: int) -> tuple:
    """([elements per arena], [(name, dtype, shape, arena index or -1, element offset, contiguous strides)] per
    buffer) of `plan` at `rows` rows (`carve`'s regions), worked out once per row count."""
    def compute(rows):
        regions, totals = carve(plan, rows)
        buffers = []
        for b in plan.buffers:
            shape = tuple(d(rows) for d in b.shape)
            arena, start = regions.get(b.name, (-1, 0))
            buffers.append((b.name, b.dtype, shape, arena, start, _contiguous_strides(shape)))
        return tuple(totals), tuple(buffers)
    return _per_rows(plan._layouts, rows, compute)


def _getter(a: Arg) -> Callable[[dict, int], object]:
    """(env, rows) -> the argument `a` resolves to (a view of an input or buffer, a Scalar's float, an int), the
    common cases decided once."""
    if isinstance(a, View):
        if a.rows is None and a.layout is Layout.AS_IS:
            return lambda env, rows: env[a.of]
        if a.rows is None and a.layout is Layout.STRIDED:  # its geometry worked out once per row count
            g, geometry = a.strided, {}

            def compute(rows):
                return tuple(d(rows) for d in g.sizes), tuple(d(rows) for d in g.strides), g.offset(rows)

            def strided_view(env, rows):
                t = env[a.of]
                sizes, strides, offset = _per_rows(geometry, rows, compute)
                return t.as_strided(sizes, strides, t.storage_offset() + offset)
            return strided_view
        return lambda env, rows: _view(env, a, rows)
    if isinstance(a, Scalar):
        return lambda env, rows: float(env[a.of])
    return lambda env, rows: a


def _bound(plan: Plan, env: dict, rows: int):
    """(step, kernel index or -1 for a fill, its arguments on `env`'s tensors: a launch's kernel arguments, a fill's
    target) for each step of `plan` that runs at `rows` rows, in order (each resolved when the previous one has
    run)."""
    for step, kernel, getters in plan._program[0]:
        if step.when is None or step.when(rows):
            yield step, kernel, [get(env, rows) for get in getters]


def walk(plan: Plan, fns: tuple, inputs, rows: int, lead: tuple, device, given: dict | None = None) -> tuple:
    """Runs `plan` on `inputs` (the tensors, and floats for Scalar arguments, of plan.inputs, in order) for `rows`
    rows with its compiled kernels `fns` (plan.kernels()'s): allocates the buffers (`given`: see `allocate`), runs
    the steps in order, returns the outputs (`lead`: the row input's leading dims, for outputs made as rows)."""
    env = dict(zip(plan.inputs, inputs, strict=True))
    env.update(allocate(plan, rows, device, given))
    for step, kernel, args in _bound(plan, env, rows):
        if kernel >= 0:
            fns[kernel](*args)
        else:
            args[0].fill_(step.value)
    outputs = []
    for get, column_sum, with_lead in plan._program[1]:
        t = get(env, rows).sum(0) if column_sum else get(env, rows)
        outputs.append(t.view(*lead, t.shape[-1]) if with_lead else t)
    return tuple(outputs)


def bind(plan: Plan, inputs, rows: int, device) -> tuple[dict, list[tuple[Step, tuple]]]:
    """({name: tensor} of `plan`'s inputs and of its buffers, allocated once; [(step, its arguments)] for the steps
    that run at `rows` rows, in order): for the perf scripts, which time a plan's launches one at a time."""
    env = dict(zip(plan.inputs, inputs, strict=True))
    env.update(allocate(plan, rows, device))
    return env, [(step, tuple(args)) for step, _, args in _bound(plan, env, rows)]


# ---- the cache: one plan per (op, phase, device, key, row range) ---------------------------------------------

Builder = Callable[[Phase, object, object, int], Plan]  # (phase, device, key, rows) -> the plan serving rows
_cache: dict = {}
_lock = threading.Lock()


def plan_for(build: Builder, phase: Phase, device, key, rows: int) -> tuple[Plan, tuple]:
    """(plan, compiled kernels) serving `rows` for (build's op, phase, device, key), built and resolved once."""
    slot = (build, phase, str(device), key)
    for entry in _cache.get(slot, ()):
        if entry[0].lo <= rows <= entry[0].hi:
            return entry
    plan = build(phase, device, key, rows)
    if not plan.lo <= rows <= plan.hi:
        raise AssertionError(f"plan of {plan.op} {phase.value} serves [{plan.lo}, {plan.hi}], not {rows} rows")
    entry = (plan, tuple(runtime.kernel(k.name, device, **dict(k.static)) for k in plan.kernels()))
    with _lock:
        _cache[slot] = (*_cache.get(slot, ()), entry)
    return entry


def run(build: Builder, phase: Phase, key, inputs, rows: int, lead: tuple, device, given: dict | None = None) -> tuple:
    """The plan of (build, phase, device, key) for `rows`, walked on `inputs` (`given`: walk's)."""
    plan, fns = plan_for(build, phase, device, key, rows)
    return walk(plan, fns, inputs, rows, lead, device, given)


# ---- the encoding h3_native.cpp decodes ---------------------------------------------------------------------


def _dim(d: Dim) -> tuple:
    return (d.const, d.per_row, d.whole, d.step, int(d.up), int(d.count))


def _cond(c: Cond | None) -> tuple:
    return (0, 0, _dim(Dim())) if c is None else (1, int(c.nonzero), _dim(c.dim))


def encode(plan: Plan, handles: list[int]) -> tuple:
    """The plan as nested tuples of ints (and fills' floats), h3_native.cpp's wire format:

    (lo, hi, inputs, handles, buffers, steps, outputs) with
      buffer (dtype code, (dim, ...), arena index in order of first use or -1: its own allocation);
      dim (const, per_row, whole, step, up, count); cond (has, nonzero, dim);
      step (0 launch | 1 fill, kernel index, fill value, cond, (arg, ...));
      arg (0, value) an int, or (1, source, has_rows, start dim, stop dim, layout code) a view, source indexing the
      inputs then the buffers, with Layout.STRIDED one more field ((size dim, ...), (stride dim, ...), offset dim),
      or (2, input) a Scalar, passed by value;
      output (0 view | 1 column sum, lead, arg)."""
    sources = {name: i for i, name in enumerate((*plan.inputs, *(b.name for b in plan.buffers)))}
    index = {k: i for i, k in enumerate(plan.kernels())}

    def arg(a):
        if isinstance(a, Scalar):
            return (2, plan.inputs.index(a.of))
        if not isinstance(a, View):
            return (0, int(a))
        start, stop = a.rows if a.rows is not None else (Dim(), Dim())
        encoded = (1, sources[a.of], int(a.rows is not None), _dim(start), _dim(stop), LAYOUT_CODES[a.layout])
        if a.strided is None:
            return encoded
        g = a.strided
        return (*encoded, (tuple(_dim(d) for d in g.sizes), tuple(_dim(d) for d in g.strides), _dim(g.offset)))

    steps = []
    for s in plan.steps:
        if isinstance(s, Launch):
            steps.append((0, index[s.kernel], 0.0, _cond(s.when), tuple(arg(a) for a in s.args)))
        else:
            steps.append((1, -1, float(s.value), _cond(s.when), (arg(s.target),)))
    outputs = tuple((int(isinstance(o.source, ColumnSum)), int(o.lead),
                     arg(o.source.of if isinstance(o.source, ColumnSum) else o.source)) for o in plan.outputs)
    arenas = {name: i for i, name in enumerate(plan.arenas())}
    return (plan.lo, plan.hi, len(plan.inputs), tuple(int(h) for h in handles),
            tuple((DTYPE_CODES[b.dtype], tuple(_dim(d) for d in b.shape), arenas.get(b.arena, -1))
                  for b in plan.buffers),
            tuple(steps), outputs)


def native_plan(build: Builder, keys: dict, device: int, phase: str, key: tuple, rows: int) -> tuple:
    """For h3_native.cpp's plan tables: the encoded plan serving `rows` for (phase, the op's key type of that phase
    in `keys` made from the ints `key`: its leading fields, the others keep their defaults), with its kernels' C
    handles (the Python runtime keeps the kernels alive)."""
    phase = Phase(phase)
    kind = keys[phase]  # C++ passes ints: the key's bool fields become bools again
    fields = dataclasses.fields(kind)
    if len(key) > len(fields):
        raise ValueError(f"plan: {kind.__name__} has {len(fields)} fields, given {len(key)}")
    key = kind(*(bool(v) if f.type == "bool" else v for f, v in zip(fields, key)))
    return native_encoded(build, phase, device, key, rows)


def native_encoded(build: Builder, phase: Phase, device: int, key, rows: int) -> tuple:
    """The encoded plan of (build, phase, CUDA device `device`, typed `key`) serving `rows`, with its kernels' C
    handles: native_plan's answer, for a module that makes the typed key itself (an op walking other ops' plans)."""
    plan, fns = plan_for(build, phase, torch.device("cuda", device), key, rows)
    return encode(plan, [fn.__chandle__() for fn in fns])
