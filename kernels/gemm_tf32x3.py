"""3xTF32 GEMM on mma.sync tensor cores: C[m, n] = sum_k A[m, k] * B[n, k], FP32-class accuracy.

Algorithm. A (M, K) and B (N, K) are FP32, both K-major and contiguous. Each CTA owns a
(tile_m, tile_n) output tile and one fixed K slice (split s of `splits`), streams
(tile_m|tile_n, tile_k) tiles through a `stages`-deep cp.async ring in swizzled shared memory,
and for every k-block of 8 splits each operand element x into big = x with the low 13 mantissa
bits cleared and small = tf32_rna(x - big) (the mma reads TF32 from the top 19 bits of a register,
so both are exact operands; the rounding is an integer add of 2^12, see `tf32_small`). Per
(m16, n8) atom and k-block, three `mma.sync.m16n8k8.tf32`,
smallest terms first (small_a*big_b, big_a*small_b, big_a*big_b), accumulate into a zeroed chunk
sum, which is then added to the running FP32 sum with an IEEE `add.rn.f32`.

Why the chunk. The tensor core adds into its accumulator by aligning to the largest term and
truncating (round toward zero, no guard bits on some parts): chaining every k-block into one
accumulator gives a bias that grows with the chain (~K/8 * 3 truncations of |C|; on the H200 fc1
missed 2e-6 at K = 256). Restarting from zero every K_CHUNK = 8 limits the truncation to each
chunk's small sum, whose sign varies, and the long sum is IEEE round-to-nearest.

Numeric contract (what makes it batch-invariant). The value of C[m, n] is a function of row m of
A, row n of B, K and `splits` only: inside its K slice, starting from +0, every element adds the
K_CHUNK-deep 3xTF32 chunk sums in increasing k with FP32 round-to-nearest; nothing depends on M,
the tile shape, the stage count or where row m sits in its tile (an mma output element only sees
its own A row). Different configs therefore give identical bits; `splits` is chosen by the caller
from K alone; K_CHUNK is a contract constant, not a config field.

Epilogues (static): "partial" stores the raw slice sums to P[s, m, n] for a fixed-order fold
(kernels/timestep_mlp.py); "bias_silu" stores z = acc + bias[n] and h = silu(z) = z / (1 + exp(-z)),
"bias_silu_h" only h (the forward never reads z); "bias" stores C = acc + bias[n], one IEEE add.rn after the
whole K sum (kernels/linear.py) (fused, so splits must be 1). Stores: each accumulator element straight to
global memory, or with `staged_c` ("bias" only) through a padded shared tile that reuses the B stages, then as
16-byte row vectors (the wide, K-shallow outputs are bound by writing C: whole 128-byte lines per warp store
instead of the mma fragment's 16-byte pieces). The values stored are the same either way.

Launch: programmatic dependent launch (PDL); the kernel waits (griddepcontrol.wait) before touching
anything the previous kernel may write, and with `prefetch_b` streams its first B (weight) tiles
before that wait, overlapping the previous kernel's tail and the launch gap.

Constraints: N % tile_n == 0, K % (splits * tile_k) == 0, tile_k 32 or 64 (the swizzle atom is
8 rows of 32 FP32 = 128 B), 16-byte aligned rows; M is arbitrary (rows predicated).
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import dsl_user_op

from h3cute.kernels._tiles import GemmConfig

EPILOGUES = ("partial", "bias", "bias_silu", "bias_silu_h", "bias_silu_split")


C_VEC = 4  # FP32 per staged C store: 16 bytes
C_PAD = 8  # floats of padding per staged C row: an 8-byte fragment store's 16 lanes (4 rows) hit distinct banks
K_CHUNK = 8  # k per tensor-core chunk sum: one m16n8k8 step (part of the numeric contract)
MAX_INTERLEAVED = 8  # chunk chains in flight per warp (register budget; speed only)
TF32_BIG_MASK = -8192  # 0xffffe000: sign, exponent and the 10 TF32 mantissa bits


@dsl_user_op
def tf32_small(x: cutlass.Int32, big: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Int32:
    """TF32 operand bits of tf32_rna(x - big) for FP32 patterns x and big = x & TF32_BIG_MASK.

    x - big is exact. The mma reads a TF32 operand from the top 19 bits of its register, so adding
    2^12 to the pattern of x - big is round-half-away at bit 13: what cvt.rna.tf32.f32 compiles to
    on sm_90a and sm_100a (ptxas emits that add, no mask), minus the inf/NaN guard around it, which
    only matters for a non-finite x, whose x - big is NaN and stays NaN."""
    return cutlass.Int32(
        llvm.inline_asm(
            cutlass.Int32.mlir_type,
            [cutlass.Int32(x).ir_value(loc=loc, ip=ip), cutlass.Int32(big).ir_value(loc=loc, ip=ip)],
            "{ .reg .f32 xf, bf, df; .reg .b32 db; mov.b32 xf, $1; mov.b32 bf, $2; sub.rn.f32 df, xf, bf; "
            "mov.b32 db, df; add.s32 $0, db, 4096; }",
            "=r,r,r",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


@dsl_user_op
def f32_bits(x: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Int32:
    """The bit pattern of an FP32 value."""
    return cutlass.Int32(llvm.inline_asm(
        cutlass.Int32.mlir_type, [cutlass.Float32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=r,f",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@dsl_user_op
def bits_f32(x: cutlass.Int32, *, loc=None, ip=None) -> cutlass.Float32:
    """The FP32 value of a bit pattern (stored as it is: a TF32 operand array holds raw patterns)."""
    return cutlass.Float32(llvm.inline_asm(
        cutlass.Float32.mlir_type, [cutlass.Int32(x).ir_value(loc=loc, ip=ip)], "mov.b32 $0, $1;", "=f,r",
        has_side_effects=False, is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT, loc=loc, ip=ip))


@cute.jit
def tf32_pair(x: cutlass.Int32):
    """(big, small) TF32 operand bit patterns of the FP32 bits x: big = x & TF32_BIG_MASK, small =
    tf32_small(x, big); what every split of an operand here computes (kernels, epilogues, the split arrays)."""
    big = x & TF32_BIG_MASK
    return big, tf32_small(x, big)


@cute.jit
def fc1_outputs(v: cutlass.Float32, bias: cutlass.Float32, epilogue: cutlass.Constexpr):
    """The two values fc1's epilogues store for an accumulator element v (z = v + b1, h = silu(z)):
    "bias_silu" (z, h); "bias_silu_split" h's TF32 operand pair (big, small) for the wgmma fc2, with
    tf32_split's formulas, as FP32 patterns; "bias_silu_h" (h, h). Shared by the mma.sync GEMM and the
    weight-in-registers wgmma GEMM, whose fc1 must give the same bits."""
    z = v + bias
    h = z / (cutlass.Float32(1.0) + cute.math.exp(-z))
    first, second = h, h
    if cutlass.const_expr(epilogue == "bias_silu"):
        first = z
    if cutlass.const_expr(epilogue == "bias_silu_split"):
        big, small = tf32_pair(f32_bits(h))
        first, second = bits_f32(big), bits_f32(small)
    return first, second


@dsl_user_op
def add_rn(a: cutlass.Float32, b: cutlass.Float32, *, loc=None, ip=None) -> cutlass.Float32:
    """IEEE a + b rounded to nearest; an explicit-rounding PTX add is never fused into an FMA."""
    return cutlass.Float32(
        llvm.inline_asm(
            cutlass.Float32.mlir_type,
            [cutlass.Float32(a).ir_value(loc=loc, ip=ip), cutlass.Float32(b).ir_value(loc=loc, ip=ip)],
            "add.rn.f32 $0, $1, $2;",
            "=f,f,f",
            has_side_effects=False,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
            loc=loc,
            ip=ip,
        )
    )


@cute.jit
def _copy_k_rows(tiled_copy: cute.TiledCopy, src: cute.Tensor, dst: cute.Tensor, coords: cute.Tensor,
                 pred: cute.Tensor, depth: cutlass.Int32, k_tail: cutlass.Constexpr):
    """cp.async one tile; with k_tail, only the copy vectors whose k row is < depth, and the others
    are zeroed in shared memory (each thread owns its vectors; the ring's barrier publishes both)."""
    if cutlass.const_expr(k_tail):
        for i in cutlass.range_constexpr(cute.size(pred, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(pred, mode=[1])):
                pred[i, j] = cute.elem_less(coords[0, i, j][1], depth)
        for i in cutlass.range_constexpr(cute.size(pred, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(pred, mode=[1])):
                if pred[i, j]:
                    cute.copy(tiled_copy, src[None, i, j], dst[None, i, j])
                else:
                    dst[None, i, j].fill(0)
    else:
        cute.copy(tiled_copy, src, dst)


def _atom_groups(m_atoms: int, n_atoms: int) -> list:
    """(m, n) atoms whose chunk chains are interleaved: the whole warp tile when it has at most
    MAX_INTERLEAVED atoms (4 live chunk registers each), else one n column at a time."""
    if m_atoms * n_atoms <= MAX_INTERLEAVED:
        return [[(m, n) for n in range(n_atoms) for m in range(m_atoms)]]
    return [[(m, n) for m in range(m_atoms)] for n in range(n_atoms)]


_PASSES = ((1, 2), (0, 3), (0, 2))  # indices into (a_big, a_small, b_big, b_small)


def _interleaves_k(m_atoms: int, n_atoms: int, k_blocks: int) -> bool:
    """Whether a k tile's chunk chains interleave across its k-blocks too: for warp tiles of one or two
    atoms (the small-T tiles), where one k-block's chains alone left the mma latency exposed (Nsight
    Compute on the H200 at T = 1: fc1 and fc2 warps issuing every ~4 cycles, stalled on fixed-latency
    dependencies, fc2 reading w2 at 2.8 TB/s)."""
    return m_atoms * n_atoms * k_blocks <= MAX_INTERLEAVED


class GemmTF32x3:
    """One compiled GEMM: static config, epilogue, split count; M (and K when symbolic) at run time."""

    def __init__(self, config: GemmConfig, epilogue: str, splits: int, *, prefetch_b: bool = False,
                 a_m_major: bool = False, b_n_major: bool = False, k_tail: bool = False, staged_c: bool = False):
        if epilogue not in EPILOGUES:
            raise ValueError(f"unknown epilogue {epilogue!r}; one of {EPILOGUES}")
        if epilogue != "partial" and splits != 1:
            raise ValueError("fused epilogues need the whole K in one CTA (splits=1)")
        for mn_major, rows in ((a_m_major, config.tile_m), (b_n_major, config.tile_n)):
            vec_threads = rows // 4  # threads across one k row of the tile, 16 B each
            if mn_major and (rows % 32 or config.threads % vec_threads
                             or config.tile_k % (config.threads // vec_threads)):
                raise ValueError(f"{config}: an MN-major copy needs tile rows % 32 == 0 and whole k-row passes")
        if k_tail and (splits != 1 or not (a_m_major and b_n_major)):
            raise ValueError("the K tail (zero-filled k rows) is built for one-slice MN-major GEMMs")
        if staged_c and (epilogue != "bias" or config.threads % (config.tile_n // C_VEC)
                         or config.tile_m % (config.threads // (config.tile_n // C_VEC))
                         or config.tile_m * (config.tile_n + C_PAD) > config.tile_n * config.tile_k * config.stages):
            raise ValueError(f"{config}: the staged C store is built for the bias epilogue, whole row passes of "
                             f"{C_VEC}-float vectors and a C tile that fits in the B stages")
        self.config = config
        self.epilogue = epilogue
        self.staged_c = staged_c
        self.splits = splits
        self.prefetch_b = prefetch_b
        self.a_m_major = a_m_major
        self.b_n_major = b_n_major
        self.k_tail = k_tail

    @cute.jit
    def __call__(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mBias: cute.Tensor,
                 mH: cute.Tensor, stream):
        """mA (M, K), mB (N, K); mC is P (splits, M, N) for "partial", C (M, N) for "bias", z (M, N) for
        "bias_silu", h (M, N) for "bias_silu_h", h's big TF32 operand array for "bias_silu_split"; mBias (N,) is
        read by the bias epilogues, mH (M, N) written by "bias_silu" (h) and "bias_silu_split" (h's small operand
        array)."""
        cfg = self.config
        threads = cfg.threads
        g2s_atom = cute.make_copy_atom(
            cute.nvgpu.cpasync.CopyG2SOp(cache_mode=cute.nvgpu.LoadCacheMode.GLOBAL),
            cutlass.Int32,
            num_bits_per_copy=128,
        )
        sA_layout, swizzle_a, tiled_copy_a = self._staging(cfg.tile_m, self.a_m_major, g2s_atom)
        sB_layout, swizzle_b, tiled_copy_b = self._staging(cfg.tile_n, self.b_n_major, g2s_atom)

        tiled_mma = cute.make_tiled_mma(
            cute.nvgpu.warp.MmaTF32Op((16, 8, 8)),
            cute.make_layout((cfg.warps_m, cfg.warps_n, 1)),
            permutation_mnk=(cfg.warps_m * 16, cfg.warps_n * 8, 8),
        )
        m_tiles = (cute.size(mA, mode=[0]) + cfg.tile_m - 1) // cfg.tile_m
        n_tiles = cute.size(mB, mode=[0]) // cfg.tile_n
        self.kernel(mA, mB, mC, mBias, mH, sA_layout, sB_layout, swizzle_a, swizzle_b, tiled_copy_a, tiled_copy_b,
                    tiled_mma).launch(
            grid=[m_tiles, n_tiles, self.splits],
            block=[threads, 1, 1],
            stream=stream,
            use_pdl=True,
        )

    def _staging(self, rows: int, mn_major: bool, g2s_atom):
        """Shared layout, byte swizzle and cp.async tiling of one operand's (rows, tile_k) tiles."""
        cfg = self.config
        threads = cfg.threads
        if mn_major:
            # Stored MN-major (e.g. W^T read in place): 1 KB atoms of 8 k rows x 32 m|n (128 B per
            # k row). A warp's fragment read is 8 m|n x 4 k: XOR-ing the 32-byte group (byte bits
            # 5-6) with k mod 4 (byte bits 7-8) spreads it over 32 banks; 16-byte runs stay whole.
            atom = cute.make_layout((32, 8), stride=(1, 32))
            swizzle = cute.make_swizzle(2, 5, 2)
            vec_threads = rows // 4
            thr_layout = cute.make_layout((vec_threads, threads // vec_threads), stride=(1, vec_threads))
            val_layout = cute.make_layout((4, 1))
        else:
            # K-major: 16-byte chunks of a 128-byte row XOR-ed with the row index mod 8: the mma
            # fragment reads (8 rows x 4 k per warp) hit 32 distinct banks, cp.async writes stay 16 B.
            atom = cute.make_layout((8, 32), stride=(32, 1))
            swizzle = cute.make_swizzle(3, 4, 3)
            chunks_per_row = cfg.tile_k // 4
            thr_layout = cute.make_layout((threads // chunks_per_row, chunks_per_row), stride=(chunks_per_row, 1))
            val_layout = cute.make_layout((1, 4))
        layout = cute.tile_to_shape(atom, (rows, cfg.tile_k, cfg.stages), (0, 1, 2))
        return layout, swizzle, cute.make_tiled_copy_tv(g2s_atom, thr_layout, val_layout)

    @cute.jit
    def _load_split_k_block(self, s2r_A, s2r_B, tXsA, tXrA, tXsB, tXrB, tCrA, tCrB, read_slot,
                            kb: cutlass.Constexpr, a_big, a_small, b_big, b_small):
        """k-block kb's A and B fragments from shared memory, each register split into its TF32 big and small
        parts (`tf32_pair`)."""
        cute.copy(s2r_A, tXsA[None, None, kb, read_slot], tXrA[None, None, kb])
        cute.copy(s2r_B, tXsB[None, None, kb, read_slot], tXrB[None, None, kb])
        for i in cutlass.range_constexpr(cute.size(a_big)):
            a_big[i], a_small[i] = tf32_pair(tCrA[None, None, kb][i])
        for i in cutlass.range_constexpr(cute.size(b_big)):
            b_big[i], b_small[i] = tf32_pair(tCrB[None, None, kb][i])

    @cute.jit
    def _k_tile_interleaved(self, s2r_A, s2r_B, tXsA, tXrA, tXsB, tXrB, tCrA, tCrB, read_slot, mma_atom, acc,
                            k_splits, k_chunks):
        """One k tile of a small warp tile (`_interleaves_k`): every k-block's fragments loaded and split
        first, then each of the three products issued for every (k-block, atom) chain in turn, then the
        chunk sums added to acc in ascending k. The same chunk sums and the same order of IEEE adds as the
        k-block by k-block loop (the contract), with up to MAX_INTERLEAVED mma chains in flight."""
        k_blocks = cute.size(tCrA, mode=[2])
        m_atoms, n_atoms = cute.size(acc, mode=[1]), cute.size(acc, mode=[2])
        atoms = [(m, n) for n in range(n_atoms) for m in range(m_atoms)]
        for kb in cutlass.range_constexpr(k_blocks):
            self._load_split_k_block(s2r_A, s2r_B, tXsA, tXrA, tXsB, tXrB, tCrA, tCrB, read_slot, kb, *k_splits[kb])
        for kb in cutlass.range_constexpr(k_blocks):
            for j in cutlass.range_constexpr(len(atoms)):
                k_chunks[kb][j].fill(0.0)
        # (a operand, b operand) per pass, smallest products first: small_a*big_b, big_a*small_b, big_a*big_b.
        for p in cutlass.range_constexpr(len(_PASSES)):
            a_sel, b_sel = _PASSES[p]
            for kb in cutlass.range_constexpr(k_blocks):
                for j in cutlass.range_constexpr(len(atoms)):
                    m, n = atoms[j]
                    cute.gemm(mma_atom, k_chunks[kb][j], cute.append_ones(k_splits[kb][a_sel][None, m], 3),
                              cute.append_ones(k_splits[kb][b_sel][None, n], 3), k_chunks[kb][j])
        for kb in cutlass.range_constexpr(k_blocks):
            for j in cutlass.range_constexpr(len(atoms)):
                m, n = atoms[j]
                acc_mn = acc[None, m, n]
                for i in cutlass.range_constexpr(cute.size(acc_mn)):
                    acc_mn[i] = add_rn(acc_mn[i], k_chunks[kb][j][i])

    @cute.jit
    def _k_block(self, s2r_A, s2r_B, tXsA, tXrA, tXsB, tXrB, tCrA, tCrB, read_slot, kb: cutlass.Constexpr, a_big,
                 a_small, b_big, b_small, mma_atom, acc, atom_groups, chunks, chunks_mn):
        """k-block kb of the k tile in `read_slot`: its fragments loaded and split, then per (m16, n8) atom the k8
        chunk's three products, smallest first, into a zeroed chunk sum (the tensor core's truncating adds see
        only this chunk), then one IEEE round-to-nearest add into the running sum. The order is the contract.
        Issued pass by pass across a group of atoms: each chunk's three mma are a dependent chain, and
        interleaving the group's chains hides the mma latency that the atom-by-atom order left exposed (ptxas
        padded it with no-ops). Every value and its order of accumulation stay the same."""
        self._load_split_k_block(s2r_A, s2r_B, tXsA, tXrA, tXsB, tXrB, tCrA, tCrB, read_slot, kb,
                                 a_big, a_small, b_big, b_small)
        operands = (a_big, a_small, b_big, b_small)
        for g in cutlass.range_constexpr(len(atom_groups)):
            group = atom_groups[g]
            for j in cutlass.range_constexpr(len(group)):
                chunks[j].fill(0.0)
            for p in cutlass.range_constexpr(len(_PASSES)):
                a_sel, b_sel = _PASSES[p]
                for j in cutlass.range_constexpr(len(group)):
                    m, n = group[j]
                    cute.gemm(mma_atom, chunks_mn[j], cute.append_ones(operands[a_sel][None, m], 3),
                              cute.append_ones(operands[b_sel][None, n], 3), chunks_mn[j])
            for j in cutlass.range_constexpr(len(group)):
                m, n = group[j]
                acc_mn = acc[None, m, n]
                for i in cutlass.range_constexpr(cute.size(chunks[j])):
                    acc_mn[i] = add_rn(acc_mn[i], chunks[j][i])

    @cute.jit
    def _load_a(self, tiled_copy: cute.TiledCopy, tAgA: cute.Tensor, tAsA: cute.Tensor, tAcA: cute.Tensor,
                tApA: cute.Tensor, k_tile, slot, depth):
        """One A tile into ring slot `slot`: K-major rows predicated on M, or MN-major (K tail)."""
        if cutlass.const_expr(self.a_m_major):
            _copy_k_rows(tiled_copy, tAgA[None, None, None, k_tile], tAsA[None, None, None, slot],
                         tAcA[None, None, None, k_tile], tApA, depth, self.k_tail)
        else:
            cute.copy(tiled_copy, tAgA[None, None, None, k_tile], tAsA[None, None, None, slot], pred=tApA)

    @cute.jit
    def _load_b(self, tiled_copy: cute.TiledCopy, tBgB: cute.Tensor, tBsB: cute.Tensor, tBcB: cute.Tensor,
                tBpB: cute.Tensor, k_tile, slot, depth):
        _copy_k_rows(tiled_copy, tBgB[None, None, None, k_tile], tBsB[None, None, None, slot],
                     tBcB[None, None, None, k_tile], tBpB, depth, self.k_tail)

    @cute.kernel
    def kernel(self, mA: cute.Tensor, mB: cute.Tensor, mC: cute.Tensor, mBias: cute.Tensor, mH: cute.Tensor,
               sA_layout: cute.Layout, sB_layout: cute.Layout, swizzle_a: cute.Swizzle, swizzle_b: cute.Swizzle,
               tiled_copy_a: cute.TiledCopy, tiled_copy_b: cute.TiledCopy, tiled_mma: cute.TiledMma):
        cfg = self.config
        tidx, _, _ = cute.arch.thread_idx()
        bid_m, bid_n, bid_s = cute.arch.block_idx()
        rows_a = cute.size(mA, mode=[0])
        depth = cute.size(mA, mode=[1])
        if cutlass.const_expr(self.k_tail):
            k_tiles_per_split = (depth + cfg.tile_k - 1) // cfg.tile_k
        else:
            k_tiles_per_split = depth // (cfg.tile_k * self.splits)
        k_tile_first = bid_s * k_tiles_per_split

        if cutlass.const_expr(self.epilogue == "partial"):
            mOut = mC[bid_s, None, None]
        else:
            mOut = mC

        # The mma takes TF32 operands as 32-bit registers: move FP32 bit patterns as Int32.
        mA_bits = cute.recast_tensor(mA, cutlass.Int32)
        mB_bits = cute.recast_tensor(mB, cutlass.Int32)
        gA = cute.local_tile(mA_bits, (cfg.tile_m, cfg.tile_k), (bid_m, None))  # (BM, BK, k_tiles)
        gB = cute.local_tile(mB_bits, (cfg.tile_n, cfg.tile_k), (bid_n, None))  # (BN, BK, k_tiles)
        cA = cute.local_tile(cute.make_identity_tensor(mA.shape), (cfg.tile_m, cfg.tile_k), (bid_m, None))
        cB = cute.local_tile(cute.make_identity_tensor(mB.shape), (cfg.tile_n, cfg.tile_k), (bid_n, None))
        gC = cute.local_tile(mOut, (cfg.tile_m, cfg.tile_n), (bid_m, bid_n))
        cC = cute.local_tile(cute.make_identity_tensor(mOut.shape), (cfg.tile_m, cfg.tile_n), (bid_m, bid_n))

        @cute.struct
        class SharedStorage:
            a: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, cute.cosize(sA_layout)], 128]
            b: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, cute.cosize(sB_layout)], 128]

        smem = cutlass.utils.SmemAllocator()
        storage = smem.allocate(SharedStorage)
        sA = storage.a.get_tensor(sA_layout, swizzle=swizzle_a)
        sB = storage.b.get_tensor(sB_layout, swizzle=swizzle_b)

        thr_g2s_a = tiled_copy_a.get_slice(tidx)
        thr_g2s_b = tiled_copy_b.get_slice(tidx)
        tAgA = thr_g2s_a.partition_S(gA)  # (CPY, CPY_M, CPY_K, k_tiles)
        tAsA = thr_g2s_a.partition_D(sA)  # (CPY, CPY_M, CPY_K, stages)
        tBgB = thr_g2s_b.partition_S(gB)
        tBsB = thr_g2s_b.partition_D(sB)
        tAcA = thr_g2s_a.partition_S(cA)
        tBcB = thr_g2s_b.partition_S(cB)

        if cutlass.const_expr(self.a_m_major):
            # MN-major A (M a multiple of tile_m): the predicate is the K tail's, per copy vector.
            tApA = cute.make_rmem_tensor(
                cute.make_layout((cute.size(tAgA, mode=[1]), cute.size(tAgA, mode=[2]))), cutlass.Boolean)
        else:
            # Rows of A past M are never loaded (their smem stays zero); they only feed accumulator
            # rows that the epilogue does not store.
            tApA = cute.make_rmem_tensor(
                cute.make_layout(
                    (tAgA.shape[0][1], cute.size(tAgA, mode=[1]), cute.size(tAgA, mode=[2])),
                    stride=(cute.size(tAgA, mode=[1]), 1, 0),
                ),
                cutlass.Boolean,
            )
            for rest_v in cutlass.range_constexpr(tApA.shape[0]):
                for m in cutlass.range_constexpr(tApA.shape[1]):
                    tApA[rest_v, m, 0] = cute.elem_less(tAcA[(0, rest_v), m, 0, 0][0], rows_a)
        # K tail: per copy vector (one k row), whether that row is inside K.
        tBpB = cute.make_rmem_tensor(cute.make_layout((cute.size(tBgB, mode=[1]), cute.size(tBgB, mode=[2]))),
                                     cutlass.Boolean)

        tAsA.fill(0)
        cute.arch.sync_threads()

        # Launched with programmatic dependent launch (PDL): this grid may start while the previous
        # kernel on the stream still runs. Nothing that kernel writes is touched before
        # griddepcontrol.wait; with prefetch_b the weight tiles of the prologue (B, which the caller
        # guarantees the previous kernel does not write) are already in flight by then. Dependents
        # are released only after our own wait, so everything before us has completed when they
        # start their own prefetch.
        if cutlass.const_expr(self.prefetch_b):
            for stage in cutlass.range_constexpr(cfg.stages - 1):
                if stage < k_tiles_per_split:
                    self._load_b(tiled_copy_b, tBgB, tBsB, tBcB, tBpB, k_tile_first + stage, stage, depth)
        cute.arch.griddepcontrol_wait()
        cute.arch.griddepcontrol_launch_dependents()

        # Prologue: fill stages - 1 slots of the ring (with prefetch_b, the first commit group also
        # holds every prefetched B tile: waiting on it waits for them all, which is only early).
        for stage in cutlass.range_constexpr(cfg.stages - 1):
            if stage < k_tiles_per_split:
                self._load_a(tiled_copy_a, tAgA, tAsA, tAcA, tApA, k_tile_first + stage, stage, depth)
                if cutlass.const_expr(not self.prefetch_b):
                    self._load_b(tiled_copy_b, tBgB, tBsB, tBcB, tBpB, k_tile_first + stage, stage, depth)
            cute.arch.cp_async_commit_group()

        thr_mma = tiled_mma.get_slice(tidx)
        tCsA = thr_mma.partition_A(sA)
        tCsB = thr_mma.partition_B(sB)
        tCgC = thr_mma.partition_C(gC)
        tCcC = thr_mma.partition_C(cC)
        tCrA = tiled_mma.make_fragment_A(tCsA[None, None, None, 0])
        tCrB = tiled_mma.make_fragment_B(tCsB[None, None, None, 0])
        acc = tiled_mma.make_fragment_C(tCgC)
        acc.fill(0.0)

        s2r_atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Int32, num_bits_per_copy=32)
        s2r_A = cute.make_tiled_copy_A(s2r_atom, tiled_mma)
        s2r_B = cute.make_tiled_copy_B(s2r_atom, tiled_mma)
        thr_s2r_A = s2r_A.get_slice(tidx)
        thr_s2r_B = s2r_B.get_slice(tidx)
        tXsA = thr_s2r_A.partition_S(sA)
        tXrA = thr_s2r_A.retile(tCrA)
        tXsB = thr_s2r_B.partition_S(sB)
        tXrB = thr_s2r_B.retile(tCrB)

        a_big = cute.make_fragment_like(tCrA[None, None, 0])
        a_small = cute.make_fragment_like(tCrA[None, None, 0])
        b_big = cute.make_fragment_like(tCrB[None, None, 0])
        b_small = cute.make_fragment_like(tCrB[None, None, 0])
        # One warp-level m16n8k8 atom: gemm on single (m, n) fragments issues exactly one mma.
        mma_atom = cute.make_mma_atom(cute.nvgpu.warp.MmaTF32Op((16, 8, K_CHUNK)))
        atom_groups = _atom_groups(cute.size(acc, mode=[1]), cute.size(acc, mode=[2]))
        chunks = [cute.make_fragment_like(acc[None, 0, 0]) for _ in atom_groups[0]]
        chunks_mn = [cute.append_ones(c, 3) for c in chunks]  # the (V, 1, 1) shape gemm dispatches on
        k_blocks = cute.size(tCrA, mode=[2])
        interleave_k = _interleaves_k(cute.size(acc, mode=[1]), cute.size(acc, mode=[2]), k_blocks)
        # The interleaved path's registers: per k-block big/small fragments, per (k-block, atom) a chunk sum.
        k_splits_big = [[cute.make_fragment_like(f) for f in (a_big, a_small, b_big, b_small)]
                        for _ in range(k_blocks if interleave_k else 0)]
        k_chunks = [[cute.append_ones(cute.make_fragment_like(acc[None, 0, 0]), 3) for _ in atom_groups[0]]
                    for _ in range(k_blocks if interleave_k else 0)]

        read_slot = 0
        write_slot = cfg.stages - 1
        for k_tile in range(k_tiles_per_split):
            cute.arch.cp_async_wait_group(cfg.stages - 2)
            cute.arch.sync_threads()
            # Refill the slot consumed in the previous iteration (all threads are past it).
            next_tile = k_tile + cfg.stages - 1
            if next_tile < k_tiles_per_split:
                self._load_a(tiled_copy_a, tAgA, tAsA, tAcA, tApA, k_tile_first + next_tile, write_slot, depth)
                self._load_b(tiled_copy_b, tBgB, tBsB, tBcB, tBpB, k_tile_first + next_tile, write_slot, depth)
            cute.arch.cp_async_commit_group()

            if cutlass.const_expr(interleave_k):
                self._k_tile_interleaved(s2r_A, s2r_B, tXsA, tXrA, tXsB, tXrB, tCrA, tCrB, read_slot, mma_atom,
                                         acc, k_splits_big, k_chunks)
            for kb in cutlass.range_constexpr(0 if interleave_k else k_blocks):
                # One k-block's fragments at a time: with the chunk sums live, whole-tile
                # fragments push the 128 x 128 tile past 255 registers.
                # With the K tail, a k-block wholly past K = T is zeros in both operands (zero-filled above): its
                # chunk sum is +-0, and acc + (+-0) == acc bit for bit (acc starts at +0 and an IEEE sum is -0 only
                # when both terms are -0), so it is skipped: at T = 1 three of a k tile's four k-blocks.
                live = (k_tile * cfg.tile_k + kb * K_CHUNK < depth) if cutlass.const_expr(self.k_tail) else True
                if live:
                    self._k_block(s2r_A, s2r_B, tXsA, tXrA, tXsB, tXrB, tCrA, tCrB, read_slot, kb, a_big,
                                  a_small, b_big, b_small, mma_atom, acc, atom_groups, chunks, chunks_mn)

            write_slot = read_slot
            read_slot = read_slot + 1
            if read_slot == cfg.stages:
                read_slot = 0

        cute.arch.cp_async_wait_group(0)

        rows_c = cute.size(mOut, mode=[0])
        if cutlass.const_expr(self.staged_c):
            self._store_staged(acc, thr_mma, tidx, storage, gC, cC, rows_c, mBias, bid_n)
        else:
            for i in cutlass.range_constexpr(cute.size(acc)):
                coord = tCcC[i]
                if cute.elem_less(coord[0], rows_c):
                    v = acc[i]
                    if cutlass.const_expr(self.epilogue == "partial"):
                        tCgC[i] = v
                    elif cutlass.const_expr(self.epilogue == "bias"):
                        tCgC[i] = add_rn(v, mBias[coord[1]])
                    else:
                        first, second = fc1_outputs(v, mBias[coord[1]], self.epilogue)
                        tCgC[i] = first
                        if cutlass.const_expr(self.epilogue != "bias_silu_h"):
                            mH[coord] = second

    @cute.jit
    def _store_staged(self, acc: cute.Tensor, thr_mma, tidx, storage, gC: cute.Tensor, cC: cute.Tensor, rows_c,
                      mBias: cute.Tensor, bid_n):
        """"bias" epilogue through shared memory: fragments -> padded (tile_m, tile_n + C_PAD) FP32 tile over the B
        stages -> C_VEC-float row vectors + bias[n] (one add.rn each) -> 16-byte global stores, one row check per
        vector."""
        cfg = self.config
        sC_layout = cute.make_layout((cfg.tile_m, cfg.tile_n), stride=(cfg.tile_n + C_PAD, 1))
        sC = cute.recast_tensor(storage.b.get_tensor(sC_layout), cutlass.Float32)
        cute.arch.sync_threads()  # every warp is done reading the B stages the C tile reuses
        tCsC = thr_mma.partition_C(sC)
        for i in cutlass.range_constexpr(cute.size(acc)):
            tCsC[i] = acc[i]
        cute.arch.sync_threads()
        along = cfg.tile_n // C_VEC
        c_copy = cute.make_tiled_copy_tv(
            cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), cutlass.Float32, num_bits_per_copy=32 * C_VEC),
            cute.make_layout((cfg.threads // along, along), stride=(along, 1)), cute.make_layout((1, C_VEC)))
        thr_c = c_copy.get_slice(tidx)
        tSsC = thr_c.partition_S(sC)
        tSgC = thr_c.partition_D(gC)
        tScC = thr_c.partition_D(cC)
        # bias[n] broadcast over the tile's rows: each thread's columns are the same in every row pass.
        gBias = cute.make_tensor(cute.local_tile(mBias, (cfg.tile_n,), (bid_n,)).iterator,
                                 cute.make_layout((cfg.tile_m, cfg.tile_n), stride=(0, 1)))
        tSgBias = thr_c.partition_S(gBias)
        bias = cute.make_rmem_tensor_like(tSgBias[None, 0, 0])
        cute.autovec_copy(tSgBias[None, 0, 0], bias)
        tSrC = cute.make_rmem_tensor_like(tSsC)
        cute.autovec_copy(tSsC, tSrC)
        for m in cutlass.range_constexpr(cute.size(tSgC, mode=[1])):
            for v in cutlass.range_constexpr(C_VEC):
                tSrC[v, m, 0] = add_rn(tSrC[v, m, 0], bias[v])
            if tScC[None, m, 0][0][0] < rows_c:
                cute.copy(c_copy, tSrC[None, m, 0], tSgC[None, m, 0])
