"""capgraph.jit: one place that keys, builds, caches and loads every compiled artifact."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from capgraph import jit
from capgraph.errors import NativeBuildError


def _spec(folder: Path, calls: list, name: str = "thing") -> jit.JitSpec:
    """A spec whose build concatenates its sources (and counts the builds)."""

    def build(sources: list[Path], out: Path) -> None:
        calls.append([s.name for s in sources])
        out.write_bytes(b"".join(s.read_bytes() for s in sources))

    return jit.JitSpec(name=name, sources=("a.txt",), headers=("b.h",), build=build,
                       identity=("tool 1.0",), folder="things", suffix=".bin",
                       source_dir=folder)


def test_cache_key_follows_sources_headers_and_identity(tmp_path):
    """The key changes when a source, a header or the identity changes, and only then."""
    (tmp_path / "a.txt").write_text("one")
    (tmp_path / "b.h").write_text("header")
    spec = _spec(tmp_path, [])
    key = jit.cache_key(spec)
    assert jit.cache_key(_spec(tmp_path, [])) == key
    (tmp_path / "a.txt").write_text("two")
    changed_source = jit.cache_key(spec)
    (tmp_path / "b.h").write_text("header 2")
    changed_header = jit.cache_key(spec)
    changed_identity = jit.cache_key(
        jit.JitSpec(**{**spec.__dict__, "identity": ("tool 1.1",)}))
    assert len({key, changed_source, changed_header, changed_identity}) == 4


def test_second_build_reads_the_cache(tmp_path, monkeypatch):
    """The first build writes $CAPGRAPH_CACHE_DIR/<folder>/<name>-<key><suffix> (and leaves no
    partial file); a second build returns that path without building."""
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "a.txt").write_text("payload")
    (tmp_path / "b.h").write_text("")
    calls: list = []
    spec = _spec(tmp_path, calls)
    path = jit.build(spec)
    assert path == tmp_path / "cache" / "things" / f"thing-{jit.cache_key(spec)}.bin"
    assert path.read_bytes() == b"payload" and calls == [["a.txt"]]
    assert jit.build(_spec(tmp_path, calls)) == path and len(calls) == 1
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name, path.name + ".lock"]


def test_unwritable_cache_is_a_named_error(tmp_path, monkeypatch):
    """A cache folder that cannot be created raises JitCacheError carrying the spec."""
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.h").write_text("")
    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path / "file"))
    spec = _spec(tmp_path, [])
    with pytest.raises(jit.JitCacheError, match="cannot write the cache") as info:
        jit.build(spec)
    assert info.value.spec is spec and isinstance(info.value, NativeBuildError)


def test_missing_source_is_named(tmp_path):
    """A spec whose source does not exist fails with NativeBuildError naming the file."""
    with pytest.raises(NativeBuildError, match="a.txt"):
        jit.cache_key(_spec(tmp_path, []))


def test_csrc_holds_every_source_the_specs_name():
    """The source lookup finds the sources of every artifact in one folder."""
    folder = jit.csrc_dir()
    for name in ("builder.cc", "python_entry.cc", "host_build.h", "cpu_mask.cc",
                 "logits_bitmask.cu"):
        assert (folder / name).is_file(), name
    assert jit.csrc_path("cpu_mask.cc") == folder / "cpu_mask.cc"


needs_cxx = pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler (c++)")


@needs_cxx
def test_cxx_library_builds_loads_and_reports_compile_errors(tmp_path, monkeypatch):
    """A C++ library spec compiles its sources (a header included, two objects linked) into a
    tvm-ffi module; a broken source gives NativeBuildError naming the file, with the
    compiler's own message; a second build of the good spec reads the cache."""
    pytest.importorskip("tvm_ffi")
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "twice.h").write_text("#include <cstdint>\nint64_t Twice(int64_t x);\n")
    (src / "twice.cc").write_text('#include "twice.h"\nint64_t Twice(int64_t x) { return 2 * x; }\n')
    (src / "entry.cc").write_text(textwrap.dedent("""
        #include <tvm/ffi/function.h>
        #include "twice.h"
        namespace { int64_t TwicePlusOne(int64_t x) { return Twice(x) + 1; } }
        TVM_FFI_DLL_EXPORT_TYPED_FUNC(twice_plus_one, TwicePlusOne);
    """))
    spec = jit.cxx_library("probe", ("twice.cc", "entry.cc"), headers=("twice.h",),
                           source_dir=src)
    path = jit.build(spec)
    assert path.name.startswith("probe-") and path.suffix == ".so"
    assert jit.load_tvm_ffi_module(path).twice_plus_one(20) == 41
    assert jit.load_python_extension(path, "probe") is None  # no PyInit_probe

    monkeypatch.setattr(jit, "_compile_and_link", lambda *a: pytest.fail("built again"))
    assert jit.build(jit.cxx_library("probe", ("twice.cc", "entry.cc"), headers=("twice.h",),
                                     source_dir=src)) == path
    monkeypatch.undo()
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path / "cache"))

    (src / "entry.cc").write_text("int broken( {\n")
    with pytest.raises(NativeBuildError, match=r"(?s)compiling entry\.cc failed \(exit \d+\).*"
                                               r"entry\.cc:1") as info:
        jit.build(jit.cxx_library("probe", ("twice.cc", "entry.cc"), headers=("twice.h",),
                                  source_dir=src))
    assert "error" in str(info.value) and str(info.value).count("failed") == 1  # entry.cc only


def test_missing_compiler_is_named(monkeypatch):
    """$CXX naming no program fails before anything is built, naming it."""
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    with pytest.raises(NativeBuildError, match="no C\\+\\+ compiler.*no-such-compiler-xyz"):
        jit.cxx_library("probe", ("x.cc",))


def test_cpu_mask_is_not_built_when_native_build_is_off(tmp_path):
    """CAPGRAPH_NATIVE_BUILD=off: cpu_apply() is None and nothing is compiled (a fresh process,
    a fresh cache)."""
    env = {**os.environ, "CAPGRAPH_NATIVE_BUILD": "off", "CAPGRAPH_CACHE_DIR": str(tmp_path)}
    code = "from capgraph.ops.cpu_mask import cpu_apply; assert cpu_apply() is None; print('ok')"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr
    assert not list(tmp_path.iterdir())
