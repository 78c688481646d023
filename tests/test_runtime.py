"""CPU tests of h3cute.runtime: arch mapping, keys, disk cache, concurrency, prebuilt bundles.

Kernels here are a tiny `y = x + addend` compiled for real with the CuTe DSL (no GPU needed to
compile, export, link or load); GPU execution of the runtime path is covered in test_runtime_gpu.
"""

import dataclasses
import json
import multiprocessing as mp
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import h3cute.runtime as rt
from h3cute.runtime import bundle, cache, loader, sources
from h3cute.runtime.spec import KernelSpec, canonical_static, static_key, symbol_name

SRC = Path(__file__).resolve().parents[1] / "src"


def _build_add(arch: str, *, addend: float, threads: int = 128):
    import cutlass
    import cutlass.cute as cute

    from h3cute.runtime.dsl import compile_for, env_stream, make_fake_compact_tensor

    @cute.kernel
    def add_kernel(mX: cute.Tensor, mY: cute.Tensor, n: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        i = bidx * threads + tidx
        if i < n:
            mY[i] = mX[i] + cutlass.Float32(addend)

    @cute.jit
    def add(mX: cute.Tensor, mY: cute.Tensor, stream):
        n = cute.size(mX, mode=[0])
        add_kernel(mX, mY, n).launch(grid=[(n + threads - 1) // threads, 1, 1], block=[threads, 1, 1], stream=stream)

    rows = cute.sym_int()
    x = make_fake_compact_tensor(cutlass.Float32, (rows,))
    y = make_fake_compact_tensor(cutlass.Float32, (rows,))
    return compile_for(arch, add, x, y, env_stream())


ADD = KernelSpec(
    name="test_add",
    build=_build_add,
    variants=lambda arch: [dict(addend=1.0), dict(addend=2.0, threads=64), dict(threads=64, addend=2.0)],
    candidates=lambda arch: [dict(addend=3.0), dict(addend=1.0), dict(addend=2.0, threads=64)],  # + one sweep config
    ptx_markers=("add.f32",),
)


# --- arch mapping and keys -------------------------------------------------------------------------

@pytest.mark.parametrize("capability, arch", [((9, 0), "sm_90a"), ((10, 0), "sm_100a"), ((10, 3), "sm_100a")])
def test_arch_of_supported(monkeypatch, capability, arch):
    import torch

    device = f"fake:{capability}"
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability)
    assert rt.arch_of(device) == arch
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: pytest.fail("not memoized"))
    assert rt.arch_of(device) == arch
    rt._arch_of_device.pop(device)


@pytest.mark.parametrize("capability", [(8, 0), (8, 9), (9, 1), (12, 0)])
def test_arch_of_unsupported_names_gpu_and_archs(monkeypatch, capability):
    import torch

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d: capability)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d: "NVIDIA Fake GPU")
    with pytest.raises(RuntimeError) as err:
        rt.arch_of("fake:unsupported")
    msg = str(err.value)
    assert "NVIDIA Fake GPU" in msg and f"{capability[0]}.{capability[1]}" in msg
    assert "sm_90a" in msg and "sm_100a" in msg


def test_sm_count():
    assert rt.SM_COUNT == {"sm_90a": 132, "sm_100a": 148}


@dataclasses.dataclass(frozen=True)
class _Tile:
    m: int = 64
    n: int = 128
    swizzle: bool = True


def test_canonical_static_keys():
    assert canonical_static(dict(a=1, b="x")) == canonical_static(dict(b="x", a=1))
    assert canonical_static(dict(tile=_Tile())) == canonical_static(dict(tile=_Tile(64, 128, True)))
    assert canonical_static(dict(tile=_Tile())) != canonical_static(dict(tile=_Tile(n=64)))
    assert canonical_static(dict(w=[1, 2])) == canonical_static(dict(w=(1, 2)))
    assert canonical_static(dict(a=1)) != canonical_static(dict(a=1.5))
    hash(canonical_static(dict(tile=_Tile(), w=[1, 2])))
    with pytest.raises(TypeError):
        canonical_static(dict(t=object()))
    canon = canonical_static(dict(tile=_Tile(), eps=1e-5))
    assert json.loads(static_key(canon)) == json.loads(json.dumps(canon))


def test_spec_candidates_default_to_its_variants_and_statics_are_distinct():
    plain = KernelSpec(name="plain", build=None, variants=ADD.variants)
    assert plain.candidates is plain.variants
    assert plain.statics("sm_90a") == plain.statics("sm_90a", candidates=True) == [dict(addend=1.0),
                                                                                     dict(addend=2.0, threads=64)]
    # the picks first, in listing order, then the candidates not among them
    assert ADD.statics("sm_90a", candidates=True) == [dict(addend=1.0), dict(addend=2.0, threads=64), dict(addend=3.0)]


def test_symbol_names_are_c_identifiers_and_distinct():
    canon = canonical_static(dict(width=256))
    sym = symbol_name("timestep-sinusoid.v2", "sm_90a", canon, "f" * 64)
    assert sym.isidentifier() and sym.startswith("h3_timestep_sinusoid_v2_")
    others = {
        symbol_name("timestep-sinusoid.v2", "sm_100a", canon, "f" * 64),
        symbol_name("timestep-sinusoid.v2", "sm_90a", canonical_static(dict(width=128)), "f" * 64),
        symbol_name("timestep-sinusoid.v2", "sm_90a", canon, "e" * 64),
    }
    assert sym not in others and len(others) == 3


def test_kernel_is_memoized_per_call_site(monkeypatch):
    calls = []
    monkeypatch.setattr(rt, "_resolve", lambda name, arch, static, canon: calls.append(static) or object())
    monkeypatch.setattr(rt, "_by_call", {})
    monkeypatch.setattr(rt, "_by_arch", {})
    monkeypatch.setitem(rt._arch_of_device, "fake:memo", "sm_90a")
    a = rt.kernel("k", "fake:memo", width=256, tile=_Tile())
    assert rt.kernel("k", "fake:memo", width=256, tile=_Tile()) is a
    assert rt.kernel("k", "fake:memo", tile=_Tile(), width=256) is a  # new call-site key, same variant
    assert rt.kernel_for_arch("k", "sm_90a", width=256, tile=_Tile()) is a
    assert rt.kernel("k", "fake:memo", width=128, tile=_Tile()) is not a
    assert rt.kernel("k", "fake:memo", widths=[1, 2]) is rt.kernel("k", "fake:memo", widths=(1, 2))
    assert len(calls) == 3
    with pytest.raises(ValueError, match="sm_80"):
        rt.kernel_for_arch("k", "sm_80")


# --- spec discovery --------------------------------------------------------------------------------

def _load_kernels_package_over(folder: Path, name: str):
    """kernels/__init__.py loaded as package `name` whose modules live in `folder`."""
    import importlib.util

    init = sources.kernels_dir() / "__init__.py"
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


_SPEC_MODULE = """
from h3cute.runtime import KernelSpec
SPECS = [KernelSpec(name={name!r}, build=None, variants=lambda arch: [])]
"""


def test_spec_discovery_and_unique_names(tmp_path):
    ok = tmp_path / "ok"
    ok.mkdir()
    (ok / "alpha.py").write_text(_SPEC_MODULE.format(name="alpha"))
    (ok / "beta.py").write_text(_SPEC_MODULE.format(name="beta"))
    (ok / "helpers.py").write_text("X = 1\n")  # a module without SPECS is fine
    pkg = _load_kernels_package_over(ok, "h3_test_kernels_ok")
    assert sorted(pkg.all_specs()) == ["alpha", "beta"]
    assert pkg.module_of("beta") == "h3_test_kernels_ok.beta"
    assert pkg.get_spec("alpha").name == "alpha"
    with pytest.raises(KeyError, match="alpha"):
        pkg.get_spec("gamma")

    dup = tmp_path / "dup"
    dup.mkdir()
    (dup / "one.py").write_text(_SPEC_MODULE.format(name="same"))
    (dup / "two.py").write_text(_SPEC_MODULE.format(name="same"))
    pkg = _load_kernels_package_over(dup, "h3_test_kernels_dup")
    with pytest.raises(ValueError, match="'same' is defined twice"):
        pkg.all_specs()


def test_real_kernel_specs_have_unique_names():
    specs = sources.kernels_package().all_specs()  # raises on a duplicate name or a broken module
    assert all(name == spec.name for name, spec in specs.items())


def test_fingerprint_and_cache_key_change_with_every_kernel_source(tmp_path, monkeypatch, request):
    """On a copy of kernels/, runtime/dsl.py and widths.py: the copy hashes like the tree; one edited byte in a kernel
    module, an edit of a helper module without kernels, a new file, an edited dsl.py or an edited widths.py (the
    kernels compile with both) each give a new source fingerprint and a new disk-cache key (compiled code is never
    served for other sources); bytecode caches do not count. A new DSL version gives a new key too."""
    import shutil

    request.addfinalizer(sources.source_fingerprint.cache_clear)  # the tree's own fingerprint after this test
    real = sources.source_fingerprint()
    kernels, runtime_dir = tmp_path / "kernels", tmp_path / "runtime"
    shutil.copytree(sources.kernels_dir(), kernels, ignore=shutil.ignore_patterns("__pycache__"))
    runtime_dir.mkdir()
    shutil.copy(Path(rt.__file__).with_name("dsl.py"), runtime_dir / "dsl.py")
    shutil.copy(Path(rt.__file__).parents[1] / "widths.py", tmp_path / "widths.py")
    monkeypatch.setattr(sources, "kernels_dir", lambda: kernels)
    monkeypatch.setattr(sources, "_RUNTIME_DIR", runtime_dir)
    canon = canonical_static(dict(width=256))

    def fingerprint_and_key():
        sources.source_fingerprint.cache_clear()
        return sources.source_fingerprint(), cache.entry_key("timestep_sinusoid", "sm_90a", canon)

    first = fingerprint_and_key()
    assert first[0] == real and len(real) == 64
    seen = {first}
    edits = [
        lambda: (kernels / "timestep_sinusoid.py").write_text((kernels / "timestep_sinusoid.py").read_text() + " "),
        lambda: (kernels / "_tiles.py").write_text((kernels / "_tiles.py").read_text() + "# a comment\n"),
        lambda: (kernels / "new_family.py").write_text("SPECS = []\n"),
        lambda: (runtime_dir / "dsl.py").write_text((runtime_dir / "dsl.py").read_text() + "\n"),
        lambda: (tmp_path / "widths.py").write_text((tmp_path / "widths.py").read_text().replace("5376", "5120", 1)),
    ]
    for i, edit in enumerate(edits):
        edit()
        now = fingerprint_and_key()
        assert now[0] not in {f for f, _ in seen} and now[1] not in {k for _, k in seen}, i
        seen.add(now)
    (kernels / "__pycache__").mkdir()
    (kernels / "__pycache__" / "timestep_sinusoid.cpython-312.pyc").write_bytes(b"bytecode")
    assert fingerprint_and_key() == now
    monkeypatch.setattr(cache, "dsl_version", lambda: "0.0.0-other")
    assert fingerprint_and_key()[1] != now[1]


# --- disk cache ------------------------------------------------------------------------------------

def _counting(spec: KernelSpec, builds: list) -> KernelSpec:
    def build(arch, **static):
        builds.append((arch, static))
        return spec.build(arch, **static)

    return dataclasses.replace(spec, build=build)


def _entry(arch: str, static: dict) -> tuple[Path, Path]:
    key = cache.entry_key(ADD.name, arch, canonical_static(static))
    return cache.cache_dir() / f"{key}.so", cache.cache_dir() / f"{key}.json"


@pytest.fixture
def cache_root(tmp_path, monkeypatch):
    monkeypatch.setenv("H3CUTE_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _pin_fingerprint(fingerprint: str) -> None:
    """Use the parent's source fingerprint: kernels/ may be edited while the suite runs (shared tree)."""
    sources.source_fingerprint = lambda: fingerprint


def _build_in_worker(cache_dir: str, fingerprint: str, arch: str, statics: list, barrier=None) -> tuple[int, list]:
    """Spawned worker: load_or_build each static set; returns (compiles it ran, symbols served)."""
    os.environ["H3CUTE_CACHE_DIR"] = cache_dir
    _pin_fingerprint(fingerprint)
    builds: list = []
    if barrier is not None:
        barrier.wait()
    symbols = []
    for static in statics:
        fn = cache.load_or_build(ADD.name, arch, static, lambda: _counting(ADD, builds))
        assert type(fn).__name__ == "Function"
        symbols.append(json.loads(_entry(arch, static)[1].read_text())["symbol"])
    return len(builds), symbols


def _in_fresh_process(cache_dir: Path, arch: str, statics: list, workers: int = 1) -> list:
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers) as pool:
        barrier = ctx.Manager().Barrier(workers) if workers > 1 else None
        args = (str(cache_dir), sources.source_fingerprint(), arch, statics, barrier)
        return pool.starmap(_build_in_worker, [args] * workers)


def test_cache_miss_then_hit(cache_root):
    import tvm_ffi

    builds: list = []
    static = dict(addend=1.0)
    fn = cache.load_or_build(ADD.name, "sm_90a", static, lambda: _counting(ADD, builds))
    assert isinstance(fn, tvm_ffi.Function) and len(builds) == 1
    so, sidecar = _entry("sm_90a", static)
    meta = json.loads(sidecar.read_text())
    assert meta["sha256"] == loader.sha256_file(so)
    assert (meta["name"], meta["arch"], meta["static"]) == (ADD.name, "sm_90a", static_key(canonical_static(static)))
    assert meta["fingerprint"] == sources.source_fingerprint() and meta["dsl_version"] == sources.dsl_version()
    cache.load_or_build(ADD.name, "sm_90a", static, lambda: pytest.fail("cache hit must not need the spec"))
    cache.load_or_build(ADD.name, "sm_90a", dict(addend=2.0), lambda: _counting(ADD, builds))
    assert len(builds) == 2
    assert len(list(cache_root.glob("*.so"))) == 2 and not list(cache_root.glob("*.tmp"))


_DAMAGES = ["truncate_library", "flip_library_byte", "garbage_sidecar", "drop_library"]
_DAMAGE_STATIC = {d: dict(addend=10.0 + i, threads=32) for i, d in enumerate(_DAMAGES)}


@pytest.fixture(scope="module")
def built_elsewhere(tmp_path_factory):
    """A cache filled by another process (so this one has never loaded its libraries)."""
    root = tmp_path_factory.mktemp("cache")
    [(compiles, _)] = _in_fresh_process(root, "sm_90a", list(_DAMAGE_STATIC.values()))
    assert compiles == len(_DAMAGES)
    return root


def test_cache_hit_in_fresh_process_compiles_nothing(built_elsewhere):
    [(compiles, symbols)] = _in_fresh_process(built_elsewhere, "sm_90a", list(_DAMAGE_STATIC.values()))
    assert compiles == 0 and len(set(symbols)) == len(_DAMAGES)


@pytest.mark.parametrize("damage", _DAMAGES)
def test_corrupt_entry_is_removed_and_rebuilt(built_elsewhere, monkeypatch, damage):
    monkeypatch.setenv("H3CUTE_CACHE_DIR", str(built_elsewhere))
    static = _DAMAGE_STATIC[damage]
    so, sidecar = _entry("sm_90a", static)
    good = so.read_bytes()
    if damage == "truncate_library":
        so.write_bytes(good[: len(good) // 3])
    elif damage == "flip_library_byte":
        so.write_bytes(good[:100] + bytes([good[100] ^ 0xFF]) + good[101:])
    elif damage == "garbage_sidecar":
        sidecar.write_text("{not json")
    else:
        so.unlink()
    builds: list = []
    fn = cache.load_or_build(ADD.name, "sm_90a", static, lambda: _counting(ADD, builds))
    assert type(fn).__name__ == "Function" and len(builds) == 1
    assert json.loads(sidecar.read_text())["sha256"] == loader.sha256_file(so)


def test_two_processes_compiling_one_key_both_succeed(cache_root):
    static = dict(addend=5.0)
    results = _in_fresh_process(cache_root, "sm_100a", [static], workers=2)
    assert sorted(n for n, _ in results) == [0, 1]  # the file lock made the second one wait, then hit
    assert results[0][1] == results[1][1]
    so, sidecar = _entry("sm_100a", static)
    assert json.loads(sidecar.read_text())["sha256"] == loader.sha256_file(so)
    assert not list(cache_root.glob(".*.tmp"))


# --- prebuilt bundles ------------------------------------------------------------------------------

_BLOCK_CUTLASS = textwrap.dedent("""
    import sys
    class _NoCuteDSL:
        def find_spec(self, name, path=None, target=None):
            if name == "cutlass" or name.startswith("cutlass."):
                raise ImportError("the CuTe DSL is blocked in this test: " + name)
    sys.meta_path.insert(0, _NoCuteDSL())
""")


def _run_python(code: str, env: dict, block_cutlass: bool = False) -> subprocess.CompletedProcess:
    full_env = {**os.environ, **env, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    prelude = (_BLOCK_CUTLASS if block_cutlass else "") + textwrap.dedent(f"""
        import h3cute.runtime.sources
        h3cute.runtime.sources.source_fingerprint = lambda: {sources.source_fingerprint()!r}
    """)
    result = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=full_env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, f"subprocess failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_importing_runtime_does_not_import_cutlass():
    _run_python("""
        import sys, h3cute.runtime, h3cute.kernels
        assert "cutlass" not in sys.modules, "importing h3cute.runtime imported cutlass"
    """, {})


@pytest.fixture(scope="module")
def add_bundle(tmp_path_factory):
    out = tmp_path_factory.mktemp("bundle")
    manifest = bundle.build_bundle(out, ["sm_90a", "sm_100a"], [ADD], {ADD.name: __name__}, log=lambda *a: None)
    return out, manifest


def test_bundle_layout_and_manifest(add_bundle):
    out, manifest = add_bundle
    on_disk = json.loads((out / bundle.MANIFEST).read_text())
    assert on_disk == manifest
    assert manifest["fingerprint"] == sources.source_fingerprint() and manifest["dsl_version"] == sources.dsl_version()
    # three variants listed, two distinct (the last two differ in argument order only); the candidate left out
    per_arch = {a: sorted(e["static"] for e in manifest["entries"] if e["arch"] == a) for a in ("sm_90a", "sm_100a")}
    assert per_arch["sm_90a"] == per_arch["sm_100a"] and len(per_arch["sm_90a"]) == 2
    assert per_arch["sm_90a"] == sorted(static_key(canonical_static(s)) for s in ADD.statics("sm_90a"))
    assert len({e["symbol"] for e in manifest["entries"]}) == 4
    for arch in ("sm_90a", "sm_100a"):
        lib = out / bundle.library_name(arch)
        assert manifest["libraries"][arch]["sha256"] == loader.sha256_file(lib)


def test_bundle_serves_kernels_without_cutlass(add_bundle):
    out, _ = add_bundle
    _run_python("""
        import sys
        import tvm_ffi
        import h3cute.runtime as rt
        fns = {(arch, static): rt.kernel_for_arch("test_add", arch, **dict(static))
               for arch in ("sm_90a", "sm_100a")
               for static in ((("addend", 1.0),), (("addend", 2.0), ("threads", 64)))}
        assert all(isinstance(f, tvm_ffi.Function) for f in fns.values()), fns
        assert len(set(map(id, fns.values()))) == 4
        want = fns[("sm_90a", (("addend", 2.0), ("threads", 64)))]
        assert rt.kernel_for_arch("test_add", "sm_90a", threads=64, addend=2.0) is want
        try:  # a sweep candidate the bundle does not hold, and no DSL to compile it
            rt.kernel_for_arch("test_add", "sm_90a", addend=3.0)
        except LookupError as e:
            assert "not installed" in str(e) and "addend" in str(e) and "build --candidates" in str(e), e
        else:
            raise AssertionError("a variant missing from the bundle was served")
        assert not [m for m in sys.modules if m == "cutlass" or m.startswith("cutlass.")]
    """, {"H3CUTE_PREBUILT": str(out), "H3CUTE_CACHE_DIR": str(out / "no-cache")}, block_cutlass=True)
    assert not (out / "no-cache").exists()


def test_bundle_from_other_sources_is_refused(add_bundle, tmp_path):
    out, manifest = add_bundle
    stale = tmp_path / "stale"
    stale.mkdir()
    for arch in ("sm_90a", "sm_100a"):
        (stale / bundle.library_name(arch)).write_bytes((out / bundle.library_name(arch)).read_bytes())
    (stale / bundle.MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "0" * 64}))
    with pytest.raises(bundle.BundleMismatchError, match="built from kernel sources 000000000000"):
        bundle.open_bundle(stale)
    result = _run_python("""
        import h3cute.runtime as rt
        from h3cute.runtime.bundle import BundleMismatchError
        try:
            rt.kernel_for_arch("test_add", "sm_90a", addend=1.0)
        except BundleMismatchError as e:
            print("REFUSED:", e)
        else:
            raise AssertionError("a bundle built from other sources was served")
    """, {"H3CUTE_PREBUILT": str(stale)}, block_cutlass=True)
    assert "REFUSED:" in result.stdout and "rebuild it" in result.stdout


def test_stale_bundle_falls_back_to_compiling_where_the_dsl_is(add_bundle, tmp_path, cache_root, monkeypatch, caplog):
    out, manifest = add_bundle
    stale = tmp_path / "stale"
    stale.mkdir()
    (stale / bundle.MANIFEST).write_text(json.dumps({**manifest, "fingerprint": "0" * 64}))
    monkeypatch.setenv("H3CUTE_PREBUILT", str(stale))
    monkeypatch.setattr(sources.kernels_package(), "get_spec", lambda name: ADD)
    with caplog.at_level("WARNING", logger="h3cute.runtime"):
        fn = rt._resolve(ADD.name, "sm_90a", dict(addend=6.0), canonical_static(dict(addend=6.0)))
    assert type(fn).__name__ == "Function"
    assert "compiling with the CuTe DSL instead" in caplog.text and "000000000000" in caplog.text
    assert _entry("sm_90a", dict(addend=6.0))[0].is_file()  # served from the disk cache, not the bundle


def test_bundle_with_corrupt_library_is_not_loaded(add_bundle, tmp_path):
    out, manifest = add_bundle
    bad = tmp_path / "bad"
    bad.mkdir()
    lib = (out / bundle.library_name("sm_90a")).read_bytes()
    (bad / bundle.library_name("sm_90a")).write_bytes(lib[: len(lib) // 2])
    (bad / bundle.MANIFEST).write_text(json.dumps(manifest))
    result = _run_python("""
        import h3cute.runtime as rt
        from h3cute.runtime.loader import CorruptLibraryError
        try:
            rt.kernel_for_arch("test_add", "sm_90a", addend=1.0)
        except CorruptLibraryError as e:
            print("REFUSED:", e)
    """, {"H3CUTE_PREBUILT": str(bad)}, block_cutlass=True)
    assert "REFUSED:" in result.stdout and "sha256" in result.stdout


def test_build_cli_rejects_unknown_kernel(tmp_path):
    with pytest.raises(SystemExit):
        bundle.main(["--arch", "sm_90a", "--out", str(tmp_path), "--kernel", "no_such_kernel"])
    assert not (tmp_path / bundle.MANIFEST).exists()


def test_build_cli_writes_a_bundle_for_named_kernels(tmp_path, monkeypatch):
    monkeypatch.setattr(sources.kernels_package(), "all_specs", lambda: {ADD.name: ADD})
    monkeypatch.setattr(sources.kernels_package(), "module_of", lambda name: __name__)
    assert bundle.main(["--arch", "sm_100a", "--out", str(tmp_path), "--kernel", ADD.name]) == 0
    manifest = json.loads((tmp_path / bundle.MANIFEST).read_text())
    assert {e["arch"] for e in manifest["entries"]} == {"sm_100a"} and len(manifest["entries"]) == 2
    assert (tmp_path / bundle.library_name("sm_100a")).is_file()
    # --candidates: every sweep candidate too (the picks first, each distinct variant once)
    everything = tmp_path / "candidates"
    assert bundle.main(["--arch", "sm_100a", "--out", str(everything), "--kernel", ADD.name, "--candidates"]) == 0
    manifest = json.loads((everything / bundle.MANIFEST).read_text())
    assert [e["static"] for e in manifest["entries"]] == [static_key(canonical_static(s)) for s in (
        dict(addend=1.0), dict(addend=2.0, threads=64), dict(addend=3.0))]


# --- on the GPU ------------------------------------------------------------------------------------
# The device has no CuTe DSL: there the tiny kernel comes from a bundle built here beforehand with
#   python tests/test_runtime.py DIR        (perf/device_run.sh passes .prebuilt/runtime_test)
# and named by H3CUTE_TEST_BUNDLE; where the DSL is installed it is compiled into the disk cache.

def _gpu_add(arch: str, static: dict):
    test_bundle = os.environ.get("H3CUTE_TEST_BUNDLE")
    if test_bundle:
        fn = bundle.open_bundle(test_bundle).function(ADD.name, arch, canonical_static(static))
        assert fn is not None, f"{test_bundle} lacks {ADD.name} {arch} {static}"
        return fn
    if not sources.dsl_available():
        pytest.fail("no CuTe DSL here and H3CUTE_TEST_BUNDLE is unset: build the runtime's test bundle "
                    "(python tests/test_runtime.py DIR, see perf/device_run.sh)")
    return cache.load_or_build(ADD.name, arch, static, lambda: ADD)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 127, 128, 129, 100_003])
@pytest.mark.parametrize("static", [dict(addend=1.0), dict(addend=2.0, threads=64)], ids=["plus1", "plus2_t64"])
def test_runtime_kernel_runs_on_gpu(rows, static):
    import torch

    device = torch.device("cuda", torch.cuda.current_device())
    arch = rt.arch_of(device)
    fn = _gpu_add(arch, static)
    g = torch.Generator(device=device).manual_seed(rows)
    x = torch.randn(rows, device=device, generator=g)
    y = torch.full_like(x, float("nan"))
    fn(x, y)
    torch.cuda.synchronize()
    assert torch.equal(y, x + static["addend"])

    # the kernel runs on torch's current stream, and is capturable in a CUDA graph
    side = torch.cuda.Stream()
    x_new = torch.randn(rows, device=device, generator=g)
    y.fill_(float("nan"))
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # a launch on another stream would run now, on the old x
        x.copy_(x_new)
        fn(x, y)
        ok = torch.equal(y, x_new + static["addend"])
    assert ok
    graph = torch.cuda.CUDAGraph()
    y.fill_(float("nan"))
    with torch.cuda.graph(graph):
        fn(x, y)
    x.copy_(torch.randn(rows, device=device, generator=g))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x + static["addend"])


if __name__ == "__main__":
    # python tests/test_runtime.py DIR: bundle the tiny kernel for the device's GPU tests
    bundle.build_bundle(Path(sys.argv[1]), ["sm_90a", "sm_100a"], [ADD], {ADD.name: "tests.test_runtime"})


def test_row_range_cuts_at_the_bounds():
    bounds = (12, 16, rt.MAX_ROWS)
    assert rt.row_range(bounds, 0) == (0, 12) and rt.row_range(bounds, 12) == (0, 12)
    assert rt.row_range(bounds, 13) == (13, 16) and rt.row_range(bounds, 17) == (17, rt.MAX_ROWS)
    with pytest.raises(ValueError):
        rt.row_range((12, 16), 17)
