"""The bundle builds the picks: every kernel a launcher can request is a variant of its spec (CPU).

`KernelSpec.variants` is what `python -m h3cute build` prebuilds (the configs the row-count pickers can return);
`KernelSpec.candidates` adds the configs `h3cute-bench sweep` ranks against them, compiled on demand. A pick missing
from the variants would fail on a device that runs the bundle without the CuTe DSL, so the launchers' kernel
requests are recorded here (runtime.kernel replaced, no GPU) over every row range of their launch plans, on sm_90a
GPUs of 114, 132 and 148 SMs (an H100 PCIe, an H200, a B200-sized one) and on sm_100a, and each must be a variant.
"""
import pytest

pytest.importorskip("cutlass", reason="the kernel specs import the CuTe DSL (the device runs prebuilt kernels only)",
                    exc_type=ImportError)

from h3cute import runtime
from h3cute.kernels._adaln_configs import ADALN_GEMM_CONFIGS, candidates, picks
from h3cute.launch import adaln_projection, checks, final_adaln_out, norm_modulate, timestep_mlp
from h3cute.launch import plan as P
from h3cute.runtime.sources import kernels_package
from h3cute.runtime.spec import canonical_static
from h3cute.widths import BLOCK_PROJECTION, FINAL_PROJECTION

SPECS = kernels_package().all_specs()
SMS = (114, 132, 148)


def _keys(statics) -> set:
    return {canonical_static(s) for s in statics}


class _Recorder:
    """Stands in for runtime.kernel: records (name, static) and returns a handle-shaped dummy."""

    def __init__(self):
        self.calls = set()

    def __call__(self, name, device, **static):
        self.calls.add((name, canonical_static(static)))
        return self

    def __chandle__(self):
        return 0


def _plan_sources() -> list:
    """(launcher module, phase, C++ plan key) of the launch plans whose kernels change with the row count: the
    projections' and the time MLP's over T, final_adaln_out's parts (its projection over T, its norm rows for every
    table size T: each fused cap, the unfused kernels of every reduction cap and the windowed ones)."""
    F = final_adaln_out
    sources = []
    for phase in ("forward", "backward"):
        sources += [(adaln_projection, phase, (BLOCK_PROJECTION,)), (timestep_mlp, phase, ()),
                    (F, phase, (F.PROJECTION,))]
    sources += [(F, "forward", (F.ROWS, check)) for check in (0, 1)]
    sources += [(F, "backward", (F.ROWS, t)) for t in range(1, 2 * norm_modulate.MAX_TABLE_ROWS + 2)]
    return sources


def _requests(monkeypatch, arch: str, sms: int) -> set:
    """Every (kernel, canonical static) of the launch plans the launchers walk (and the C++ layer fetches) on an
    `arch` GPU of `sms` SMs: each plan of `_plan_sources`, walking its row ranges (lo..hi) from 1 to the last,
    fetching the plan at both ends of each."""
    rec = _Recorder()
    monkeypatch.setattr(runtime, "kernel", rec)
    monkeypatch.setattr(P, "_cache", {})  # plans resolve their kernels through the recorder
    monkeypatch.setattr(runtime, "arch_of", lambda device: arch)
    monkeypatch.setattr(runtime, "sm_count", lambda device: sms)
    monkeypatch.setattr(checks, "slot_addresses", lambda *args: (0, 0))  # device memory
    for launcher, phase, key in _plan_sources():
        rows = 1
        while rows <= runtime.MAX_ROWS:
            lo, hi = launcher.native_plan(0, phase, key, rows)[:2]
            assert lo <= rows <= hi, (launcher.__name__, phase, key, rows, lo, hi)
            if hi < runtime.MAX_ROWS:
                launcher.native_plan(0, phase, key, hi)
            rows = hi + 1
    return rec.calls


@pytest.mark.parametrize("arch, sms", [("sm_90a", s) for s in SMS] + [("sm_100a", 148)])
def test_every_kernel_a_launcher_requests_is_a_bundle_variant(monkeypatch, arch, sms):
    requests = _requests(monkeypatch, arch, sms)
    names = {name for name, _ in requests}
    family = {"adaln_proj_fwd_wgmma", "adaln_proj_wgrad_fold", "tf32x3_wgmma_weight_gemm"} if arch == "sm_90a" else \
        {"adaln_proj_fwd", "adaln_proj_dgrad", "adaln_proj_wgrad"}
    rows = {"norm_modulate_fwd", "norm_modulate_bwd_fused", "norm_modulate_bwd_rows", "norm_modulate_bwd_params",
            "rowwise_fold"}
    assert family | rows | {"timestep_mlp_gemm", "adaln_silu_cast"} <= names, names
    assert any(name == "norm_modulate_bwd_params" and dict(static).get("windowed") for name, static in requests), \
        "the windowed reduction of tables beyond 48 rows"
    missing = sorted((name, static) for name, static in requests
                     if arch not in SPECS[name].archs or static not in _keys(SPECS[name].variants(arch)))
    assert not missing, f"launcher requests that no bundle variant of {arch} serves: {missing}"


@pytest.mark.parametrize("sms", SMS)
def test_every_pick_of_every_table_is_a_bundle_variant(sms):
    """`pick` over T = 1 .. past the d_temb model's last row, both families and every role (the dW picks with fold
    warps too): each config is a variant of its kernel, for both projection widths."""
    kernels = {("fwd", "warp"): "adaln_proj_fwd", ("dgrad", "warp"): "adaln_proj_dgrad",
               ("wgrad", "warp"): "adaln_proj_wgrad", ("fwd", "wgmma"): "adaln_proj_fwd_wgmma",
               ("dgrad", "wgmma"): "adaln_proj_dgrad_wgmma", ("wgrad", "wgmma"): "adaln_proj_wgrad_wgmma"}
    widths = (BLOCK_PROJECTION, FINAL_PROJECTION)
    for (role, family), name in kernels.items():
        wgmma = family == "wgmma"
        chosen = {adaln_projection.pick(role, t, wgmma, sms) for t in range(1, adaln_projection.DGRAD_MODEL_ROWS + 2)}
        assert chosen <= set(picks(role, family)), (role, family, chosen - set(picks(role, family)))
        extra = dict(wgmma=True) if (role, wgmma) == ("wgrad", True) else {}
        built = _keys(SPECS[name].variants("sm_90a"))
        for config in chosen:
            assert all(canonical_static(dict(out_features=n, config=config, **extra)) in built for n in widths), \
                (name, config)
            if adaln_projection.wgrad_folds(config, wgmma):
                fold = _keys(SPECS["adaln_proj_wgrad_fold"].variants("sm_90a"))
                assert all(canonical_static(dict(out_features=n, config=config)) in fold for n in widths), config
    chosen = {timestep_mlp.pick_config(t) for t in range(1, 5000)}
    built = _keys(SPECS["timestep_mlp_gemm"].variants("sm_90a"))
    for config in chosen:
        for role, field in (("fc1", "fc1"), ("fc1_zh", "fc1"), ("fc2", "fc2"), ("fc2_dgrad", "fc2_dgrad"),
                            ("fc1_dgrad", "fc1_dgrad"), ("fc2_wgrad", "fc2_wgrad"), ("fc1_wgrad", "fc1_wgrad")):
            assert canonical_static(dict(role=role, tile=getattr(config, field).astuple())) in built, (role, config)


def test_the_round_pick_returns_both_its_configs_over_the_modelled_gpus():
    """The d_temb pick beyond T = 384 models the GPU: the configs it returns depend on the SM count, and `picks`
    holds both of them whatever it returns on the H200."""
    rounds = adaln_projection.DGRAD_ROUNDS
    seen = {rounds(t, sms) for sms in SMS for t in range(385, adaln_projection.DGRAD_MODEL_ROWS + 1)}
    assert seen == set(rounds.choices) and set(rounds.choices) <= set(picks("dgrad", "wgmma"))


def test_candidates_are_a_superset_of_the_picks():
    """Every spec's candidates hold its variants; the AdaLN GEMMs' and the time MLP GEMM's hold more (configs only a
    sweep runs), exactly the config registry's, so `ptx-digest` still digests every config."""
    for name, spec in SPECS.items():
        for arch in spec.archs:
            variants, cands = _keys(spec.variants(arch)), _keys(spec.candidates(arch))
            assert variants and variants <= cands, (name, arch, variants - cands)
            assert _keys(spec.statics(arch)) == variants and _keys(spec.statics(arch, candidates=True)) == cands
    from h3cute.kernels import adaln_gemm

    for role, family, name in (("fwd", "wgmma", "adaln_proj_fwd_wgmma"), ("dgrad", "wgmma", "adaln_proj_dgrad_wgmma"),
                               ("wgrad", "wgmma", "adaln_proj_wgrad_wgmma"), ("fwd", "warp", "adaln_proj_fwd"),
                               ("dgrad", "warp", "adaln_proj_dgrad")):
        spec = SPECS[name]
        configs = {s["config"] for s in spec.candidates("sm_90a")}
        assert configs == set(candidates(role, family)) > {s["config"] for s in spec.variants("sm_90a")}, name
        assert len(spec.candidates("sm_90a")) == len(adaln_gemm.OUT_FEATURES) * len(configs), name
    assert set(candidates("fwd", "wgmma")) | set(candidates("fwd", "warp")) == {
        n for n, c in ADALN_GEMM_CONFIGS.items() if "fwd" in c.roles}
    mlp = SPECS["timestep_mlp_gemm"]
    assert _keys(mlp.variants("sm_90a")) < _keys(mlp.candidates("sm_90a"))
    tiles = {(s["role"], s["tile"]) for s in mlp.candidates("sm_90a")}
    for config in timestep_mlp.CONFIGS:  # what `h3cute-bench sweep --op timestep_mlp` runs
        assert (("fc2", config.fc2.astuple()) in tiles and ("fc1", config.fc1.astuple()) in tiles
                and ("fc2_wgrad", config.fc2_wgrad.astuple()) in tiles), config
    sweep = adaln_projection.sweep_configs(None)  # the sm_90a family's forward configs
    assert set(sweep) <= {s["config"] for s in SPECS["adaln_proj_fwd_wgmma"].candidates("sm_90a")}
