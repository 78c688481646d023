"""The BF16 AdaLN projection GEMM family: forward, both backward GEMMs and their small helpers.

The projection is `table = silu(temb).bf16 @ W^T + b` with W (N_out, D = 2688) BF16, N_out = 96768
(block AdaLN) or 10752 (final AdaLN). Each GEMM is one kernel, C = A B^T with A (M, K) and B (N, K):

| kernel | M | N | K | A | B | C |
| --- | --- | --- | --- | --- | --- | --- |
| adaln_proj_fwd | N_out | T | D | W (K-major) | a (K-major) | out^T + bias, BF16 |
| adaln_proj_dgrad | D | T | N_out in `DGRAD_SPLITS` fixed chunks | W^T (M-major) | grad (K-major) | FP32 partials |
| adaln_proj_wgrad | N_out | D | T | grad^T (M-major) | a (N-major) | dW, BF16 |

Numeric contract (what makes the forward and d_temb batch-invariant): every output element is
one FP32 accumulator fed by k16 MMA steps in ascending K order, the same for every T and every
tile config (configs vary only the M/N tiles, the warp arrangement and the pipeline depth; bK
only groups k16 steps per shared-memory stage). Rows beyond T are zero-filled in shared memory and
never stored. The forward epilogue adds the bias in FP32 and rounds to BF16 once (cuBLAS's bias
epilogue). d_temb (FP32 out, held to 1e-5) must not inherit the tensor core's truncating
accumulation over a long chain (see docs/timestep_mlp.md: the error grows with the chain), so the
dgrad runs `ieee_steps`: the warp family's each k16 MMA, the wgmma family's each DGRAD_K_BLOCK = 64-deep block
of K (4 k16 wgmmas chained by the tensor core from zero) starts from zero and is added to the running sum with
IEEE FP32 adds in ascending K; the `DGRAD_SPLITS` FP32 partials are then summed in split order
(`adaln_dtemb_fold`). Its order depends on N_out only. dW and db are reductions over T: deterministic (fixed order, no
atomics), not batch-invariant by nature.

The family, organised as CUTLASS's and quack's GEMMs are: a small shared base and one sibling class per mainloop,
picked by `kernel_class(config)` from the config's fields (kernels/_adaln_configs.py holds the configs as data).

| module | classes | mainloop |
| --- | --- | --- |
| adaln_gemm_base | `AdalnGemm` (geometry, epilogue, entry names), `WgmmaGemm` (wgmma setup) | none |
| adaln_gemm_cp_async | `WarpMmaGemm` (sm_90a, sm_100a) | `mma_sync` |
| adaln_gemm_cp_async | `CpAsyncWgmmaGemm`, `CpAsyncWgmmaTmaStoreGemm` (C stored by TMA) | `cp_async_wgmma` |
| adaln_gemm_tma | `TmaWarpSpecialized` (ring, register split), `TmaWgmmaGemm` (grid) | `tma_wgmma` |
| adaln_gemm_persistent | `TmaWgmmaPersistentGemm` (cooperative or pingpong consumers) | `tma_wgmma`, persistent |
| adaln_gemm_side_warps | `SideWarps` strategies of the persistent kernel's idle producer warps: db, d_temb fold | - |

The wgmma family (sm_90a) has the same k16 order and epilogue in every mainloop, so the same bits. The forward's
`tma_wide_n256_mc2` runs `TmaWgmmaGemm` in 2-CTA clusters that share the activation tile by TMA multicast
(`GemmTile.cluster_m`; `cluster_n` shares A along grid x); d_temb runs its 192- and 256-wide tiles on one block
tile, the warpgroups taking turns, and the 256-wide tile's thin last round of CTAs as 128-wide halves
(`GemmTile.tail_halves`, `tail_units`). `adaln_proj_wgrad_fold` is the persistent dW whose idle producer warps fold
d_temb and sum db meanwhile (`FoldWarps`). A variant's `config` is a config name or field overrides of one
(`parse_config`). The elementwise kernels (silu_cast, the d_temb fold, db) are kernels/adaln_elementwise.py.

Constraints: K-major operands need K % 8 == 0 (the copy vector runs along K); MN-major operand
extents are multiples of 8; all pointers 16-byte aligned and all tensors contiguous.
"""
from __future__ import annotations

import cutlass
import cutlass.cute as cute

from h3cute.runtime import KernelSpec
from h3cute.runtime.dsl import compile_for, env_stream
from h3cute.widths import TEMB  # D, K of the forward GEMM

from ._adaln_configs import PERSISTENT_CTAS, AdalnGemmConfig, candidates, parse_config, picks  # noqa: F401
from .adaln_elementwise import fold_dbias_blocks
from .adaln_gemm_base import (  # noqa: F401  (the family's contract constants, read by tests and launchers)
    DBIAS_CHAIN_ROWS, DBIAS_ROW_BLOCK, DGRAD_K_BLOCK, DGRAD_SPLITS, FUSED_DBIAS_ROWS, NO_ATOMICS, OUT_FEATURES,
    AdalnGemm, WgmmaGemm, fake_tensor, r2s_source_order)
from .adaln_gemm_cp_async import CpAsyncWgmmaGemm, CpAsyncWgmmaTmaStoreGemm, WarpMmaGemm
from .adaln_gemm_persistent import TmaWgmmaPersistentGemm, c_buffers  # noqa: F401
from .adaln_gemm_side_warps import SIDE_WARPS
from .adaln_gemm_tma import (  # noqa: F401
    _IEEE_PIPELINED_MAX_BN, TmaWgmmaGemm, dgrad_n_halves, ieee_unit, produce_k_tiles, tail_units)


def kernel_class(config: AdalnGemmConfig) -> type:
    """The GEMM class that runs `config` (as `config.for_role(role)` gives it), from its fields: the mainloop, then
    the C store (cp.async ring) or the schedule (TMA mainloop). The persistent kernel takes its side warps as a
    strategy (`SIDE_WARPS[config.side_warps]`, `_gemm`)."""
    if config.mainloop == "mma_sync":
        assert config.store == "smem" and config.schedule == "grid" and config.cluster_m == config.cluster_n == 1, \
            config
        return WarpMmaGemm
    if config.mainloop == "cp_async_wgmma":
        assert config.schedule == "grid" and config.cluster_m == config.cluster_n == 1, config
        return CpAsyncWgmmaTmaStoreGemm if config.store == "tma" else CpAsyncWgmmaGemm
    if config.schedule == "grid":
        assert config.store == "smem" and config.side_warps == "none", config
        return TmaWgmmaGemm
    assert config.store == "tma" and not config.tail_halves, config
    return TmaWgmmaPersistentGemm


def _gemm(arch: str, name: str, role: str, **kw):
    """The `role` GEMM of the config `name` (a name, or `name:field=value,...`: `parse_config`), built by its
    `kernel_class`, with its side warps where it has any."""
    config = parse_config(name).for_role(role)
    assert arch == "sm_90a" or config.family == "warp", f"{name} is a wgmma (sm_90a) config"
    if config.side_warps != "none":
        kw["side_warps"] = SIDE_WARPS[config.side_warps]
    return kernel_class(config)(config.tile, **kw)


def _build_fwd(arch: str, *, out_features: int, config: str):
    gemm = _gemm(arch, config, "fwd", a_k_major=True, b_k_major=True, epilogue="bias_bf16")
    # A cluster of M tiles needs whole clusters along grid y (N_out / 128 = 756 and 84: even).
    assert out_features % (gemm.tile.bm * gemm.tile.cluster_m) == 0, (out_features, config)

    @cute.jit
    def adaln_proj_fwd(act: cute.Tensor, weight: cute.Tensor, bias: cute.Tensor, out: cute.Tensor, stream):
        # out (T, N_out) seen as C (N_out, T): M-major, so the weight rows are the MMA's M.
        out_t = cute.make_tensor(out.iterator, cute.select(out.layout, mode=[1, 0]))
        gemm.launch(weight, act, out_t, bias, stream)

    rows = cute.sym_int()
    return compile_for(
        arch,
        adaln_proj_fwd,
        fake_tensor(cutlass.BFloat16, (rows, TEMB), (1, 0)),
        fake_tensor(cutlass.BFloat16, (out_features, TEMB), (1, 0)),
        fake_tensor(cutlass.BFloat16, (out_features,)),
        fake_tensor(cutlass.BFloat16, (rows, out_features), (1, 0)),
        env_stream(),
    )


def _build_dgrad(arch: str, *, out_features: int, config: str):
    # d_temb is held to 1e-5: IEEE running sums over k16 MMA steps (warp family) or DGRAD_K_BLOCK blocks (wgmma).
    gemm = _gemm(arch, config, "dgrad", a_k_major=False, b_k_major=True, epilogue="f32", k_splits=DGRAD_SPLITS,
                 ieee_steps=True)
    bk = gemm.tile.bk
    assert out_features % (DGRAD_SPLITS * bk) == 0, (out_features, gemm.tile)
    if isinstance(gemm, WgmmaGemm):
        assert bk % DGRAD_K_BLOCK == 0, gemm.tile
        gemm.ieee_unit = ieee_unit(gemm.tile, out_features // (DGRAD_SPLITS * bk))
        assert (out_features // (DGRAD_SPLITS * bk)) % gemm.ieee_unit == 0, gemm.tile  # whole units per split

    @cute.jit
    def adaln_proj_dgrad(grad: cute.Tensor, weight: cute.Tensor, partial: cute.Tensor, stream):
        # A = W^T (D, N_out), M-major; C = partial (splits, T, D) seen as (D, T, splits).
        weight_t = cute.make_tensor(weight.iterator, cute.select(weight.layout, mode=[1, 0]))
        partial_t = cute.make_tensor(partial.iterator, cute.select(partial.layout, mode=[2, 1, 0]))
        gemm.launch(weight_t, grad, partial_t, grad, stream)

    rows = cute.sym_int()
    return compile_for(
        arch,
        adaln_proj_dgrad,
        fake_tensor(cutlass.BFloat16, (rows, out_features), (1, 0)),
        fake_tensor(cutlass.BFloat16, (out_features, TEMB), (1, 0)),
        fake_tensor(cutlass.Float32, (DGRAD_SPLITS, rows, TEMB), (2, 1, 0)),
        env_stream(),
    )


def _build_wgrad(arch: str, *, out_features: int, wgmma: bool = False, config: str = "wgrad"):
    # `wgmma` names the variant's family (the spec's variant key); the config says it too.
    assert wgmma == (parse_config(config).family == "wgmma"), (config, wgmma)
    gemm = _gemm(arch, config, "wgrad", a_k_major=False, b_k_major=False, epilogue="bf16", c_n_major=True,
                 dbias_rows=True)
    tile = gemm.tile
    # The TMA-stored C tile has no bounds checks of its own (TMA clips, but the tiles must be whole); a cluster of M
    # tiles needs whole clusters along grid y.
    assert type(gemm) is not CpAsyncWgmmaTmaStoreGemm or (out_features % tile.bm == 0 and TEMB % tile.bn == 0), config
    assert out_features % (tile.bm * tile.cluster_m) == 0, (out_features, config)

    @cute.jit
    def adaln_proj_wgrad(grad: cute.Tensor, act: cute.Tensor, dweight: cute.Tensor, dbias: cute.Tensor, stream):
        """dW[n, d] = sum_t grad[t, n] act[t, d]: A = grad^T (N_out, T), B = act^T (D, T), both MN-major;
        for T <= FUSED_DBIAS_ROWS also dbias (adaln_bias_grad's bits), else dbias is not touched."""
        gemm.launch(*_transposed(grad, act), dweight, dbias, stream)

    rows = cute.sym_int()
    return compile_for(arch, adaln_proj_wgrad, *_wgrad_fakes(rows, out_features), env_stream())


def _transposed(grad: cute.Tensor, act: cute.Tensor):
    """The dW GEMM's operands as views: A = grad^T (N_out, T), B = act^T (D, T), both MN-major."""
    return (cute.make_tensor(grad.iterator, cute.select(grad.layout, mode=[1, 0])),
            cute.make_tensor(act.iterator, cute.select(act.layout, mode=[1, 0])))


def _wgrad_fakes(rows, out_features: int) -> tuple:
    """grad (T, N_out), act (T, D), dweight (N_out, D), dbias (N_out,): the dW kernels' first four arguments."""
    return (fake_tensor(cutlass.BFloat16, (rows, out_features), (1, 0)),
            fake_tensor(cutlass.BFloat16, (rows, TEMB), (1, 0)),
            fake_tensor(cutlass.BFloat16, (out_features, TEMB), (1, 0)),
            fake_tensor(cutlass.BFloat16, (out_features,)))


def _build_wgrad_fold(arch: str, *, out_features: int, config: str):
    gemm = _gemm(arch, config, "wgrad_fold", a_k_major=False, b_k_major=False, epilogue="bf16", c_n_major=True,
                 dbias_rows=False)
    assert out_features % gemm.tile.bm == 0, (out_features, config)

    @cute.jit
    def adaln_proj_wgrad_fold(grad: cute.Tensor, act: cute.Tensor, dweight: cute.Tensor, dbias: cute.Tensor,
                              partial: cute.Tensor, temb: cute.Tensor, dtemb: cute.Tensor, dbias_blocks: cute.Tensor,
                              stream):
        """adaln_proj_wgrad's dW (A = grad^T, B = act^T) while the producer warpgroup's idle warps fold d_temb from
        the d_temb GEMM's partials (adaln_dtemb_fold's bits) and sum db's blocks from the stages into dbias_blocks
        (launch.adaln_projection.dbias_blocks(T), N), folded in block order by a second launch (adaln_bias_grad's
        bits)."""
        gemm.launch(*_transposed(grad, act), dweight, dbias, stream, side=(partial, temb, dtemb, dbias_blocks))
        fold_dbias_blocks(dbias_blocks, dbias, out_features, stream)

    rows, blocks = cute.sym_int(), cute.sym_int()
    return compile_for(
        arch,
        adaln_proj_wgrad_fold,
        *_wgrad_fakes(rows, out_features),
        fake_tensor(cutlass.Float32, (DGRAD_SPLITS, rows, TEMB), (2, 1, 0)),
        fake_tensor(cutlass.Float32, (rows, TEMB), (1, 0)),
        fake_tensor(cutlass.Float32, (rows, TEMB), (1, 0)),
        fake_tensor(cutlass.Float32, (blocks, out_features), (1, 0)),
        env_stream(),
    )


_MMA_MARKERS = ("mma.sync.aligned.m16n8k16", ".bf16", "cp.async", "ldmatrix")
# Both mainloops of the wgmma family (cp.async.cg ring, TMA `cp.async.bulk.tensor` ring); each one's own
# instructions are checked per config in tests/test_adaln_projection.py.
_WGMMA_MARKERS = ("wgmma.mma_async.sync.aligned.m64n", "k16.f32.bf16.bf16", "cp.async.")

_LDMATRIX_T = ("ldmatrix.sync.aligned.m8n8.x4.trans",)  # the MN-major operand of the backward GEMMs


def _gemm_spec(role: str, build, family: str, markers=(), **static) -> KernelSpec:
    """The `role` GEMM of a family (`adaln_proj_<role>`): the warp family for every arch, the wgmma family
    (`adaln_proj_<role>_wgmma`) for sm_90a; per out_features, the role's picked configs as variants, all its configs as
    candidates."""
    kind = dict(name=f"adaln_proj_{role}_wgmma", ptx_markers=_WGMMA_MARKERS, ptx_forbidden=NO_ATOMICS + ("mma.sync",),
                archs=("sm_90a",)) if family == "wgmma" else dict(name=f"adaln_proj_{role}",
                                                                 ptx_markers=_MMA_MARKERS + markers,
                                                                 ptx_forbidden=NO_ATOMICS)
    return KernelSpec(build=build, variants=lambda arch: [dict(out_features=n, config=c, **static)
                                                          for n in OUT_FEATURES for c in picks(role, family)],
                      candidates=lambda arch: [dict(out_features=n, config=c, **static)
                                               for n in OUT_FEATURES for c in candidates(role, family)],
                      **kind)


SPECS = [
    _gemm_spec("fwd", _build_fwd, "warp"),
    _gemm_spec("dgrad", _build_dgrad, "warp", markers=_LDMATRIX_T),
    _gemm_spec("wgrad", _build_wgrad, "warp", markers=_LDMATRIX_T),
    _gemm_spec("fwd", _build_fwd, "wgmma"),
    _gemm_spec("dgrad", _build_dgrad, "wgmma"),
    _gemm_spec("wgrad", _build_wgrad, "wgmma", wgmma=True),
    KernelSpec(
        name="adaln_proj_wgrad_fold",
        build=_build_wgrad_fold,
        variants=lambda arch: [dict(out_features=n, config=c) for n in OUT_FEATURES
                               for c in picks("wgrad_fold", "wgmma")],
        candidates=lambda arch: [dict(out_features=n, config=c) for n in OUT_FEATURES
                                 for c in candidates("wgrad_fold", "wgmma")],
        ptx_markers=_WGMMA_MARKERS + ("cp.async.bulk.tensor", "ld.global.cs.v4"),
        ptx_forbidden=NO_ATOMICS + ("mma.sync",),
        archs=("sm_90a",),
    ),
]
