"""Shared pieces of the H3 row kernels (norm_modulate, gate_residual, adaln_row_gather) and their fold kernel.

Row kernels: one CTA per row of width H (H % 8 == 0); thread u owns the 16-byte vectors u, u + n, u + 2n,
... of the row (n threads, 8 BF16 per vector), so every load and store is a coalesced 16-byte access and
the row stays in registers between its reduction and its output. The copy-like kernels (gate_residual,
adaln_row_gather) use ROW_THREADS = 256; norm_modulate uses NORM_THREADS = 64 (below). Row offsets are
formed in Int64 (`row * H`), so S * H may exceed 2^31.

`torch_sumsq` reproduces, bit for bit, the FP32 sum of squares of torch's fused CUDA rms_norm
(aten/src/ATen/native/cuda/layer_norm_kernel.cu, `vectorized_layer_norm_kernel<..., rms_norm=true>`,
torch 2.8-2.11, taken for BF16 rows with H % 4 == 0 and 16-byte alignment): a (32, 4) block
(num_threads() = 4 warps), thread t accumulating `fma(x, x, acc)` over its 4-element chunks t, t + 128,
t + 256, ... in order, then a shfl_down tree over lanes (16, 8, 4, 2, 1) and a tree over the 4 warps
(2, 1). Chunks 2v and 2v + 1 are the halves of our vector v and 128 chunks are 64 vectors, so with
NORM_THREADS = 64 our thread u carries exactly torch threads 2u (low halves) and 2u + 1 (high halves)
as two partials over vectors u, u + 64, ...; xor-butterflies 8, 4, 2, 1 inside each half-warp replay
torch's lane offsets 16..2 (FP32 addition is commutative, so which lane of a pair adds is immaterial),
lo + hi replays offset 1, and the 4 warp sums in shared memory replay the cross-warp tree. The result
depends only on H. tests/test_norm_modulate.py checks this mapping against a model of torch's loop.

Cross-row reductions (parameter / table gradients) never use atomics: a fixed grid of
(H / COL_TILE column tiles) x (row groups P, fixed per arch by the launcher) one-warp CTAs; CTA (c, p)
walks its contiguous row range [p * ceil(S/P), ...) in row order, each lane owning 8 columns, adding
into FP32 accumulators that only it touches (registers for per-column sums, shared memory
[table_rows_cap, COL_TILE] for per-table-row sums, indexed by the row's idx), and writes one FP32
partial per (p, table row, column). `rowwise_fold` then sums the P partials of each element in order
p = 0..P-1 and rounds once to BF16. Results depend on (S, P, idx), never on timing.

Tables of more than MAX_TABLE_ROWS rows (T > 16 timesteps) do not fit one CTA's shared memory: the windowed
variant of each reduction kernel splits the table into windows of MAX_TABLE_ROWS rows, block y = window *
P + group. CTA (c, window, p) walks the rows of group p 32 at a time: each lane reads one row's idx, a warp
ballot marks the rows whose idx falls in the CTA's window (`window_chunk`), and only those are loaded and
added, in row order, a batch of them in flight at once (`next_owned` takes the lowest marked row); the CTA
then writes the partials of its window's table rows, and per-column sums (norm_modulate's dweight) one
partial per (window, group). The launcher picks P for such tables so that P x R stays within the plain
kernels' P x MAX_TABLE_ROWS partial rows (launch/norm_modulate.reduction_layout). Sums stay FP32 in row
order per group, folded in group order: deterministic, a fixed function of (inputs, S, R).

Indices are never trusted for addressing: a row whose idx lies outside [0, R) reads table row 0 and
writes NaN outputs (forward, dx, dy) and adds nothing to any table gradient.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_tensor
from cutlass.cutlass_dsl import dsl_user_op

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream

VEC = 8  # BF16 per 16-byte vector
ROW_THREADS = 256  # threads per row CTA of the copy-like kernels
NORM_THREADS = 64  # threads per row CTA of norm_modulate: torch's 128-thread rms_norm block, 2 per thread
TORCH_WARPS = 2 * NORM_THREADS // 32  # warps of torch's rms_norm block (4)
COL_TILE = 32 * VEC  # columns per reduction CTA: one warp, 8 columns per lane
TABLE_ROWS_CAPS = (12, 24, 48)  # compiled table-row capacities of the reduction kernels
MAX_TABLE_ROWS = TABLE_ROWS_CAPS[-1]
FOLD_THREADS = 128
UNROLL = 8  # rows whose loads a reduction step issues before accumulating (memory-level parallelism)


def table_rows_cap(table_rows: int) -> int:
    for cap in TABLE_ROWS_CAPS:
        if table_rows <= cap:
            return cap
    raise ValueError(f"table has {table_rows} rows; the row kernels support at most {MAX_TABLE_ROWS}")


def row_slots(width: int, threads: int) -> int:
    """Vectors per thread in a row CTA of `threads` (the last slot is partial unless threads divides H / 8)."""
    if width % VEC:
        raise ValueError(f"row width {width} is not a multiple of {VEC}")
    return -(-(width // VEC) // threads)


# ---- device helpers ------------------------------------------------------------------------------------

@cute.jit
def vec_view(t: cute.Tensor, offset, width: int = VEC):
    """The `width` (default 8) elements of `t` at flat element offset `offset` as a 16-byte aligned tensor."""
    ptr = cute.make_ptr(t.element_type, (t.iterator + offset).toint(), cute.AddressSpace.gmem, assumed_align=16)
    return cute.make_tensor(ptr, cute.make_layout(width))


@cute.jit
def load_f32(t: cute.Tensor, offset):
    return vec_view(t, offset).load().to(Float32)


@cute.jit
def smem_vec(sT: cute.Tensor, offset):
    """8 FP32 of shared memory at element offset `offset` (a multiple of 8): two 16-byte accesses."""
    ptr = cute.make_ptr(Float32, (sT.iterator + offset).toint(), cute.AddressSpace.smem, assumed_align=32)
    return cute.make_tensor(ptr, cute.make_layout(VEC))


@cute.jit
def store_bf16(t: cute.Tensor, offset, value):
    vec_view(t, offset).store(value.to(BFloat16))


@cute.jit
def round_bf16(value):
    """Round an FP32 vector to BF16 and widen it back: one torch BF16 op's result."""
    return value.to(BFloat16).to(Float32)


@cute.jit
def _torch_warp_fold(sRed: cute.Tensor):
    """The sum of torch's TORCH_WARPS warp sums in sRed, folded as torch's block reduction does (halves: 2, 1)."""
    w = [sRed[y] for y in range(TORCH_WARPS)]
    for _ in cutlass.range_constexpr(TORCH_WARPS.bit_length() - 1):
        half = len(w) // 2
        w = [w[y] + w[y + half] for y in range(half)]
    return w[0]


@cute.jit
def torch_sumsq(xs, sRed: cute.Tensor, tidx):
    """Sum of squares of a row held as `xs` (this thread's BF16 8-vectors u, u + 64, ...; absent ones zero)
    in torch's fused rms_norm order, for a NORM_THREADS CTA. `sRed`: TORCH_WARPS FP32 of shared memory.
    Every thread returns the same value."""
    lo = Float32(0.0)
    hi = Float32(0.0)
    for k in cutlass.range_constexpr(len(xs)):
        x = xs[k].to(Float32)
        for i in cutlass.range_constexpr(VEC // 2):
            lo = cute.math.fma(x[i], x[i], lo)
        for i in cutlass.range_constexpr(VEC // 2, VEC):
            hi = cute.math.fma(x[i], x[i], hi)
    for off in cutlass.range_constexpr(4):
        lo = lo + cute.arch.shuffle_sync_bfly(lo, 8 >> off)
        hi = hi + cute.arch.shuffle_sync_bfly(hi, 8 >> off)
    if tidx % 16 == 0:
        sRed[tidx // 16] = lo + hi  # torch warp 2w (our lane 0) and 2w + 1 (our lane 16)
    cute.arch.sync_threads()
    return _torch_warp_fold(sRed)


@cute.jit
def torch_sumsq_v4(xs, sRed: cute.Tensor, tidx):
    """torch_sumsq for a 128-thread CTA holding BF16 4-vectors t, t + 128, ...: thread t is torch thread t (its
    4-element chunks in order), the xor butterfly 16..1 gives lane 0 torch's shfl_down tree and the 4 warps fold
    as torch's do. Every thread returns the same value."""
    acc = Float32(0.0)
    for k in cutlass.range_constexpr(len(xs)):
        x = xs[k].to(Float32)
        for i in cutlass.range_constexpr(4):
            acc = cute.math.fma(x[i], x[i], acc)
    for off in cutlass.range_constexpr(5):
        acc = acc + cute.arch.shuffle_sync_bfly(acc, 16 >> off)
    if tidx % 32 == 0:
        sRed[tidx // 32] = acc
    cute.arch.sync_threads()
    return _torch_warp_fold(sRed)


@cute.jit
def block_sum(value: Float32, sRed: cute.Tensor, tidx, warps: cutlass.Constexpr):
    """Sum of one FP32 per thread over a CTA of `warps` warps in a fixed order (xor butterfly, warps in order)."""
    for off in cutlass.range_constexpr(5):
        value = value + cute.arch.shuffle_sync_bfly(value, 16 >> off)
    if tidx % 32 == 0:
        sRed[tidx // 32] = value
    cute.arch.sync_threads()
    total = sRed[0]
    for wi in cutlass.range_constexpr(1, warps):
        total = total + sRed[wi]
    return total


@dsl_user_op
def record_bad_row(err_rows: Int64, err_host: Int64, row, bound, *, loc=None, ip=None):
    """Records bad input at `row` in a check slot (h3cute/launch/checks.py): red.global.min of the row into the
    device word `err_rows` (the first bad row) and plain stores of row + 1 and `bound` into the host-mapped words
    at `err_host`. An error path: the one atomic here orders nothing the kernel computes."""
    llvm.inline_asm(
        res=None,
        operands_=[Int64(err_rows).ir_value(loc=loc, ip=ip), Int64(err_host).ir_value(loc=loc, ip=ip),
                   Int64(row).ir_value(loc=loc, ip=ip), Int64(bound).ir_value(loc=loc, ip=ip)],
        asm_string="{ .reg .s64 next; red.global.min.s64 [$0], $2; add.s64 next, $2, 1; "
                   "st.volatile.global.s64 [$1], next; st.volatile.global.s64 [$1+8], $3; }",
        constraints="l,l,l,l,~{memory}",
        has_side_effects=True,
        asm_dialect=llvm.AsmDialect.AD_ATT,
        loc=loc,
        ip=ip,
    )


@cute.jit
def checked_row(mIdx: cute.Tensor, row, table_rows, tidx, err_rows: Int64, err_host: Int64):
    """guarded_row of `row`'s index, thread 0 recording a bad one in the call's check slot (check_row)."""
    idx = Int64(mIdx[row])
    if tidx == 0:
        check_row(idx, table_rows, row, err_rows, err_host)
    return guarded_row(idx, table_rows)


@cute.jit
def check_row(r, table_rows, row, err_rows: Int64, err_host: Int64):
    """Records table row `r` of `row` in its check slot when it lies outside [0, R) (one thread per row calls it;
    guarded_row makes the row NaN)."""
    if (r < 0) | (r >= table_rows):
        record_bad_row(err_rows, err_host, row, table_rows)


@cute.jit
def guarded_row(r, table_rows):
    """(row to read, factor): an index outside [0, R) (possible with check_indices=False) reads row 0 and
    gets factor NaN, which the caller multiplies into that row's outputs; otherwise factor 1.0 (exact)."""
    valid = (r >= 0) & (r < table_rows)
    return cutlass.select_(valid, r, Int64(0)), cutlass.select_(valid, Float32(1.0), Float32(float("nan")))


@cute.jit
def window_pick(r, table_rows, base, cap: cutlass.Constexpr):
    """(row in the window, inside): table row `r` relative to a windowed reduction CTA's window [base, base +
    cap), and whether it is a valid row (in [0, R)) of that window."""
    local = r - base
    return Int32(local), (r >= 0) & (r < table_rows) & (local >= 0) & (local < cap)


@cute.jit
def window_chunk(mIdx, chunk, end, table_rows, base, cap: cutlass.Constexpr, lane, owns_bad: cutlass.Constexpr):
    """The rows of [chunk, min(chunk + 32, end)) that a windowed reduction CTA (one warp, window [base, base +
    cap)) takes: lane l reads row chunk + l's idx. Returns (ballot mask of the rows taken, this lane's row in the
    window, whether this lane's row lies in the window). `owns_bad`: window 0 also takes the rows whose idx is
    outside [0, R) (their per-row outputs are NaN; they add nothing)."""
    row = chunk + lane
    r = Int64(-1)
    if row < end:
        r = Int64(mIdx[row])
    local, inside = window_pick(r, table_rows, base, cap)
    take = inside & (row < end)
    if cutlass.const_expr(owns_bad):
        take = take | ((base == 0) & (row < end) & ((r < 0) | (r >= table_rows)))
    return cute.arch.vote_ballot_sync(take), local, inside


@cute.jit
def next_owned(mask):
    """(any, lane, rest) of a ballot mask: whether a row is left, the lane of the lowest one (its row is chunk +
    lane) and the mask without it. Taking rows lowest first keeps them in row order."""
    low = mask & (Int32(0) - mask)
    return mask != 0, cute.arch.popc(low - 1), mask ^ low


@cute.jit
def take_owned(mask, rows: cutlass.Constexpr):
    """The next `rows` rows of a ballot mask, lowest first (next_owned): [(any, lane)] and the mask left."""
    taken = []
    for _ in cutlass.range_constexpr(rows):
        has, src, mask = next_owned(mask)
        taken.append((has, src))
    return taken, mask


@cute.jit
def reduction_block(block_y, num_groups, cap: cutlass.Constexpr, windowed: cutlass.Constexpr):
    """(window's first table row, row group) of a reduction CTA: block y = window * P + group when windowed,
    else (0, block y)."""
    if cutlass.const_expr(windowed):
        window = block_y // num_groups
        return Int64(window) * cap, block_y - window * num_groups
    return Int64(0), block_y


@cute.jit
def row_range(num_rows, group, num_groups):
    """Rows [begin, end) of reduction row group `group` out of `num_groups` (contiguous, ceil-sized; the
    trailing groups of a short batch are empty, begin == end, never reaching into another group's rows)."""
    per_group = (num_rows + num_groups - 1) // num_groups
    begin = cutlass.min(Int32(group) * per_group, num_rows)
    end = cutlass.min(begin + per_group, num_rows)
    return begin, end


# ---- fake tensors for compiling (row count and table rows symbolic) ---------------------------------------

def fake_rows(num_rows, width, dtype=BFloat16):
    """(S, width) contiguous rows."""
    return make_fake_tensor(dtype, (num_rows, width), (width, 1), assumed_align=16)


def fake_table(width, table_rows=None):
    """(R, width) BF16 table with any 16-byte aligned row stride (e.g. a half of a (T, 2H) tensor)."""
    rows = cute.sym_int() if table_rows is None else table_rows
    return make_fake_tensor(BFloat16, (rows, width), (cute.sym_int(divisibility=VEC), 1), assumed_align=16)


def fake_vector(width, dtype=BFloat16):
    return make_fake_tensor(dtype, (width,), (1,), assumed_align=16)


def fake_indices(num_rows):
    return make_fake_tensor(Int64, (num_rows,), (1,), assumed_align=8)


def fake_partials(num_groups, table_rows, width):
    """(P, R, width) FP32 partials: any 16-byte aligned group and table-row strides (views of one buffer)."""
    return make_fake_tensor(Float32, (num_groups, table_rows, width),
                            (cute.sym_int(divisibility=4), cute.sym_int(divisibility=4), 1), assumed_align=16)


# ---- the fold: out[j] = bf16(sum_p partials[p, j]) -------------------------------------------------------

@cute.jit
def _fold_step(mPart: cute.Tensor, acc: cute.Tensor, first, col, groups: cutlass.Constexpr):
    """Adds partials [first, first + groups) in order, their loads all issued before the first add."""
    parts = [vec_view(mPart, Int64(first + i) * mPart.stride[0] + col).load() for i in range(groups)]
    for i in cutlass.range_constexpr(groups):
        acc.store(acc.load() + parts[i])


@cute.kernel
def _fold_kernel(mPart: cute.Tensor, mOut: cute.Tensor):
    tidx, _, _ = cute.arch.thread_idx()
    bidx, _, _ = cute.arch.block_idx()
    v = bidx * FOLD_THREADS + tidx
    num_vecs = mOut.shape[0] // VEC
    if v < num_vecs:
        col = Int64(v) * VEC
        acc = cute.make_rmem_tensor((VEC,), Float32)
        acc.fill(0.0)
        groups = mPart.shape[0]
        batched = groups // UNROLL * UNROLL
        for first in cutlass.range(0, batched, UNROLL):
            _fold_step(mPart, acc, first, col, UNROLL)
        for first in cutlass.range(batched, groups):
            _fold_step(mPart, acc, first, col, 1)
        store_bf16(mOut, col, acc.load())


@cute.jit
def _fold_launch(mPart: cute.Tensor, mOut: cute.Tensor, stream):
    num_vecs = mOut.shape[0] // VEC
    _fold_kernel(mPart, mOut).launch(
        grid=((num_vecs + FOLD_THREADS - 1) // FOLD_THREADS, 1, 1), block=(FOLD_THREADS, 1, 1), stream=stream
    )


def build_fold(arch: str):
    num_groups, width = cute.sym_int(), cute.sym_int(divisibility=VEC)
    # partials: (P, N) FP32, any 16-byte aligned row stride; out: (N,) BF16 contiguous.
    mPart = make_fake_tensor(Float32, (num_groups, width), (cute.sym_int(divisibility=4), 1), assumed_align=16)
    mOut = make_fake_tensor(BFloat16, (width,), (1,), assumed_align=16)
    return compile_for(arch, _fold_launch, mPart, mOut, env_stream())


SPECS = [
    KernelSpec(
        name="rowwise_fold",
        build=build_fold,
        variants=lambda arch: [dict()],
        ptx_markers=("ld.global.v", "st.global.v4.b32"),  # FP32 partials: v4.b32 or v2.b64 (16 bytes)
        ptx_forbidden=("atom.", "red.global", "red.shared"),
    )
]
