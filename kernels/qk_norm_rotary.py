"""qk_norm_rotary: the attention's q / k RMSNorm over each head and the rotary embedding in one pass
(h3::qk_norm_rotary), and its backward. x is (B, S, heads, head_dim) BF16 rows, head_dim = 128; cos / sin
(S, rotary_dim) FP32.

Forward (`qk_norm_rotary_fwd`) computes eager diffusers' bits, `_apply_rotary_emb(norm_q(x), cos, sin)`:
    ss   = sum x^2 in torch's fused rms_norm order for a 128-wide row (below), FP32
    rstd = rsqrt.approx(ss / 128 + eps)                  (as kernels/norm_modulate.py: torch's rms_norm)
    y    = bf16(w * (rstd * x))                           (torch: gamma * (rstd * x), one rounding)
    out  = bf16(bf16(y c) + bf16(r s)) on the leading rotary_dim channels, y on the rest,
with c = bf16(cos), s = bf16(sin) (diffusers casts the angles to the rows' dtype) and r the rotate_half partner
(-y[i + rd/2] in the first half, y[i - rd/2] in the second): three BF16 ops as torch does them, the products rounded
once, the sum in FP32 then rounded (an opaque add.rn.f32: LLVM would narrow it to add.bf16x2, other bits on sm_90).

Layout: a 128-thread CTA holds ROWS_PER_CTA = 16 heads of one token, LANES = 8 threads per head; lane u owns the
16-byte vectors u and u + 8 of its head. torch's rms_norm block reduces a 128-wide row over its first warp alone:
lane t holds the 4-element chunk t, fma-accumulated in order, and a shfl_down tree (16, 8, 4, 2, 1) sums the 32
lanes (the other warps add exact zeros). Chunk t is a half of vector t / 2, so offset 16 pairs our vectors u and
u + 8 (added inside a thread), offsets 8, 4, 2 are our xor-butterflies 4, 2, 1 over the 8 lanes, and offset 1 adds
the low and high halves: the same additions on the same values, so the same bits, for any row count. The rotation
reads its partner vector from a shared-memory copy of the normalised head.

Backward (`qk_norm_rotary_bwd`): the transpose of the rotation with the forward's roundings
(gy = bf16(bf16(g c) + [bf16(g s)[i + rd/2], -bf16(g s)[i - rd/2]]), the same as h3::rotary_backward), then the
RMSNorm's: dxhat = gy w, dx = bf16((dxhat - xhat mean(dxhat xhat)) rstd) with xhat = x rstd (rstd recomputed in the
forward's order), and the weight's FP32 partials sum_rows gy xhat. The dx of a row depends on that row alone. The
weight gradient never uses atomics: one CTA per partial row (a grid the launcher fixes per arch) walks a contiguous
token range in order, each thread adding its 16 columns over its heads in order; the CTA's 16 head slots fold in
slot order into the CTA's FP32 partial row, and `rowwise_fold` sums the partials in CTA order: a fixed function of
(inputs, rows).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import BFloat16, Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cute.runtime import make_fake_tensor
from cutlass.cutlass_dsl import T, dsl_user_op

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream
from h3cute.widths import ATTENTION_HEAD_DIM, ROTARY_DIM

from .rowwise import VEC, load_f32, round_bf16, smem_vec, store_bf16, vec_view

HEAD_DIM = ATTENTION_HEAD_DIM  # the one head width the kernels serve (torch's sum order above is written for it)
LANES = 8  # threads per head row
SLOTS = HEAD_DIM // VEC // LANES  # vectors per thread (2)
ROWS_PER_CTA = 16  # heads per CTA
THREADS = LANES * ROWS_PER_CTA


@cute.jit
def _head_vectors(mT: cute.Tensor, base, lane, valid):
    """This lane's SLOTS vectors (u, u + 8) of the head at element `base`, FP32 (zeros where not `valid`)."""
    vals = []
    for k in cutlass.range_constexpr(SLOTS):
        frag = cute.make_rmem_tensor((VEC,), Float32)
        frag.fill(0.0)
        if valid:
            frag.store(load_f32(mT, base + (lane + k * LANES) * VEC))
        vals.append(frag.load())
    return vals


@cute.jit
def _rstd(xs, eps: Float32):
    """rsqrt(sum x^2 / 128 + eps) of the head whose vectors (lane, lane + 8) this lane holds, in torch's order."""
    lo = Float32(0.0)
    hi = Float32(0.0)
    for k in cutlass.range_constexpr(SLOTS):  # torch lanes 2u, 2u + 1 (offset 16: + lanes 2u + 16, 2u + 17)
        plo = Float32(0.0)
        phi = Float32(0.0)
        for i in cutlass.range_constexpr(VEC // 2):
            plo = cute.math.fma(xs[k][i], xs[k][i], plo)
        for i in cutlass.range_constexpr(VEC // 2, VEC):
            phi = cute.math.fma(xs[k][i], xs[k][i], phi)
        if cutlass.const_expr(k == 0):
            lo, hi = plo, phi
        else:
            lo, hi = lo + plo, hi + phi
    for off in cutlass.range_constexpr(3):  # torch's offsets 8, 4, 2
        lo = lo + cute.arch.shuffle_sync_bfly(lo, 4 >> off)
        hi = hi + cute.arch.shuffle_sync_bfly(hi, 4 >> off)
    return cute.math.rsqrt((lo + hi) / Float32(HEAD_DIM) + eps, approx=True)


@dsl_user_op
def _add_rn(a, b, *, loc=None, ip=None) -> Float32:
    """a + b in FP32 (add.rn.f32), opaque to LLVM: torch adds two BF16 tensors in FP32 and rounds the sum to BF16;
    LLVM would narrow that to add.bf16x2, which rounds differently on sm_90 (measured on an H100)."""
    return Float32(llvm.inline_asm(T.f32(), [Float32(a).ir_value(loc=loc, ip=ip), Float32(b).ir_value(loc=loc, ip=ip)],
                                   "add.rn.f32 $0, $1, $2;", "=f,f,f", has_side_effects=False,
                                   asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def _sum_f32(a, b):
    """The FP32 sums of two 8-vectors, element by element (_add_rn)."""
    out = cute.make_rmem_tensor((VEC,), Float32)
    for i in cutlass.range_constexpr(VEC):
        out[i] = _add_rn(a[i], b[i])
    return out.load()


@cute.jit
def _angles(mAng: cute.Tensor, pos, v):
    """bf16(angle) of rotary channels [8 v, 8 v + 8) at position `pos`, widened back to FP32."""
    return round_bf16(load_f32(mAng, Int64(pos) * ROTARY_DIM + v * VEC))


@cute.jit
def _partner(sRow: cute.Tensor, v):
    """(partner vector of rotary vector v in this head's shared copy, its sign): rotate_half."""
    half = ROTARY_DIM // 2 // VEC
    other = cutlass.select_(v < half, v + half, v - half)
    sign = cutlass.select_(v < half, Float32(-1.0), Float32(1.0))
    return smem_vec(sRow, other * VEC).load(), sign


@cute.kernel
def _forward_kernel(mX: cute.Tensor, mW: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor, mOut: cute.Tensor,
                    eps: Float32, heads: Int32, seq: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    token, group, _ = cute.arch.block_idx()
    slot, lane = tidx // LANES, tidx % LANES
    head = group * ROWS_PER_CTA + slot
    valid = head < heads
    base = (Int64(token) * heads + head) * HEAD_DIM
    pos = token % seq
    smem = cutlass.memory.SmemAllocator()
    sY = smem.allocate_tensor(Float32, cute.make_layout(ROWS_PER_CTA * HEAD_DIM), byte_alignment=32)
    sRow = cute.make_tensor(sY.iterator + slot * HEAD_DIM, cute.make_layout(HEAD_DIM))

    xs = _head_vectors(mX, base, lane, valid)
    rstd = _rstd(xs, eps)
    ys = []
    for k in cutlass.range_constexpr(SLOTS):
        v = lane + k * LANES
        y = round_bf16(load_f32(mW, v * VEC) * (xs[k] * rstd))
        smem_vec(sRow, v * VEC).store(y)
        ys.append(y)
    cute.arch.sync_threads()
    if valid:
        for k in cutlass.range_constexpr(SLOTS):
            v = lane + k * LANES
            if v < ROTARY_DIM // VEC:
                r, sign = _partner(sRow, v)
                c = _angles(mCos, pos, v)
                s = _angles(mSin, pos, v)
                store_bf16(mOut, base + v * VEC, _sum_f32(round_bf16(ys[k] * c), round_bf16(r * s) * sign))
            else:
                store_bf16(mOut, base + v * VEC, ys[k])


@cute.jit
def _forward_launch(mX: cute.Tensor, mW: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor, mOut: cute.Tensor,
                    eps: Float32, heads: Int32, seq: Int32, stream):
    tokens = mX.shape[0] // heads
    _forward_kernel(mX, mW, mCos, mSin, mOut, eps, heads, seq).launch(
        grid=(tokens, (heads + ROWS_PER_CTA - 1) // ROWS_PER_CTA, 1), block=(THREADS, 1, 1), stream=stream)


@cute.kernel
def _backward_kernel(mG: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                     mDx: cute.Tensor, mPart: cute.Tensor, eps: Float32, heads: Int32, seq: Int32):
    tidx, _, _ = cute.arch.thread_idx()
    cta, _, _ = cute.arch.block_idx()
    slot, lane = tidx // LANES, tidx % LANES
    smem = cutlass.memory.SmemAllocator()
    sGs = smem.allocate_tensor(Float32, cute.make_layout(ROWS_PER_CTA * HEAD_DIM), byte_alignment=32)
    sRow = cute.make_tensor(sGs.iterator + slot * HEAD_DIM, cute.make_layout(HEAD_DIM))
    ws = [load_f32(mW, (lane + k * LANES) * VEC) for k in range(SLOTS)]
    acc = [cute.make_rmem_tensor((VEC,), Float32) for _ in range(SLOTS)]
    for k in cutlass.range_constexpr(SLOTS):
        acc[k].fill(0.0)

    # this CTA's contiguous token range; its 16 slots walk the range's (token, head) rows in order
    tokens = mX.shape[0] // heads
    per_cta = (tokens + mPart.shape[0] - 1) // mPart.shape[0]
    begin = cutlass.min(Int32(cta) * per_cta, tokens)
    end = cutlass.min(begin + per_cta, tokens)
    head_groups = (heads + ROWS_PER_CTA - 1) // ROWS_PER_CTA
    for step in cutlass.range((end - begin) * head_groups):
        token = begin + step // head_groups
        head = step % head_groups * ROWS_PER_CTA + slot
        valid = head < heads
        base = (Int64(token) * heads + head) * HEAD_DIM
        pos = token % seq
        gs = _head_vectors(mG, base, lane, valid)
        xs = _head_vectors(mX, base, lane, valid)
        rstd = _rstd(xs, eps)
        # rotary transpose: gy = bf16(bf16(g c) + partner's bf16(g s) x sign)
        gcs = []
        for k in cutlass.range_constexpr(SLOTS):
            v = lane + k * LANES
            gc = gs[k]
            if v < ROTARY_DIM // VEC:
                gc = round_bf16(gs[k] * _angles(mCos, pos, v))
                smem_vec(sRow, v * VEC).store(round_bf16(gs[k] * _angles(mSin, pos, v)))
            gcs.append(gc)
        cute.arch.sync_threads()
        gys = []
        for k in cutlass.range_constexpr(SLOTS):
            v = lane + k * LANES
            gy = gcs[k]
            if v < ROTARY_DIM // VEC:
                r, sign = _partner(sRow, v)
                gy = round_bf16(_sum_f32(gcs[k], r * -sign))  # rotate_half's transpose flips the partner's sign
            gys.append(gy)
        cute.arch.sync_threads()  # the next row's products reuse sRow
        # RMSNorm backward
        dot = Float32(0.0)
        for k in cutlass.range_constexpr(SLOTS):
            dxhat = gys[k] * ws[k]
            for i in cutlass.range_constexpr(VEC):
                dot = cute.math.fma(dxhat[i], xs[k][i], dot)
        for off in cutlass.range_constexpr(3):
            dot = dot + cute.arch.shuffle_sync_bfly(dot, 4 >> off)
        mean_dot = rstd * dot / Float32(HEAD_DIM)  # mean(dxhat * xhat)
        for k in cutlass.range_constexpr(SLOTS):
            v = lane + k * LANES
            xhat = xs[k] * rstd
            dxhat = gys[k] * ws[k]
            dx = cute.make_rmem_tensor((VEC,), Float32)
            for i in cutlass.range_constexpr(VEC):
                dx[i] = cute.math.fma(xhat[i], -mean_dot, dxhat[i]) * rstd
            if valid:
                store_bf16(mDx, base + v * VEC, dx.load())
                acc[k].store(acc[k].load() + gys[k] * xhat)

    # the CTA's partial: slot 0 + slot 1 + ... + slot 15, in order, through shared memory
    for k in cutlass.range_constexpr(SLOTS):
        smem_vec(sGs, slot * HEAD_DIM + (lane + k * LANES) * VEC).store(acc[k].load())
    cute.arch.sync_threads()
    if tidx < HEAD_DIM // VEC:
        total = smem_vec(sGs, tidx * VEC).load()
        for s in cutlass.range_constexpr(1, ROWS_PER_CTA):
            total = total + smem_vec(sGs, s * HEAD_DIM + tidx * VEC).load()
        vec_view(mPart, Int64(cta) * mPart.stride[0] + tidx * VEC).store(total)


@cute.jit
def _backward_launch(mG: cute.Tensor, mX: cute.Tensor, mW: cute.Tensor, mCos: cute.Tensor, mSin: cute.Tensor,
                     mDx: cute.Tensor, mPart: cute.Tensor, eps: Float32, heads: Int32, seq: Int32, stream):
    _backward_kernel(mG, mX, mW, mCos, mSin, mDx, mPart, eps, heads, seq).launch(
        grid=(mPart.shape[0], 1, 1), block=(THREADS, 1, 1), stream=stream)


def _fake_heads():
    """(B S heads, 128) BF16 rows, contiguous."""
    return make_fake_tensor(BFloat16, (cute.sym_int(), HEAD_DIM), (HEAD_DIM, 1), assumed_align=16)


def _fake_angles():
    return make_fake_tensor(Float32, (cute.sym_int(), ROTARY_DIM), (ROTARY_DIM, 1), assumed_align=16)


def _fake_weight():
    return make_fake_tensor(BFloat16, (HEAD_DIM,), (1,), assumed_align=16)


def build_forward(arch: str):
    return compile_for(arch, _forward_launch, _fake_heads(), _fake_weight(), _fake_angles(), _fake_angles(),
                       _fake_heads(), Float32(1e-6), Int32(1), Int32(1), env_stream())


def build_backward(arch: str):
    partials = make_fake_tensor(Float32, (cute.sym_int(), HEAD_DIM), (HEAD_DIM, 1), assumed_align=16)
    return compile_for(arch, _backward_launch, _fake_heads(), _fake_heads(), _fake_weight(), _fake_angles(),
                       _fake_angles(), _fake_heads(), partials, Float32(1e-6), Int32(1), Int32(1), env_stream())


SPECS = [
    KernelSpec(name="qk_norm_rotary_fwd", build=build_forward, variants=lambda arch: [dict()],
               # rsqrt.approx is torch's rsqrtf; the rotation's products narrow to mul.bf16x2 (exact, one rounding)
               ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "rsqrt.approx.f32", "shfl.sync.bfly", "add.rn.f32"),
               ptx_forbidden=("atom.", "red.global", "red.shared", "add.bf16x2")),
    KernelSpec(name="qk_norm_rotary_bwd", build=build_backward, variants=lambda arch: [dict()],
               ptx_markers=("ld.global.v4.b32", "st.global.v4.b32", "rsqrt.approx.f32", "shfl.sync.bfly", "add.rn.f32"),
               ptx_forbidden=("atom.", "red.global", "red.shared", "add.bf16x2")),
]
