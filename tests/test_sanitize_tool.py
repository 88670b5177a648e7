"""tools/sanitize.py, the sanitizer runs of capgraph's native code: how it wires the compilers
and reads the reports (the runs themselves take minutes; docs/RELIABILITY.md has their
results and commands)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import load_tool

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sanitize():
    return load_tool("sanitize")


def test_reports_are_counted_by_kind(sanitize, tmp_path):
    """ASan's and TSan's reports by their SUMMARY line, UBSan's by its runtime-error line, a
    file with neither (a sanitizer's own failure) once by its first line; an empty file is
    nothing."""
    (tmp_path / "address.101").write_text(
        "==101==ERROR: AddressSanitizer: heap-buffer-overflow on address 0x60\n"
        "    #0 0x7f in hf_copy_bytes lane.c:254\n"
        "SUMMARY: AddressSanitizer: heap-buffer-overflow lane.c:254 in hf_copy_bytes\n")
    (tmp_path / "thread.102").write_text(
        "WARNING: ThreadSanitizer: data race (pid=102)\n"
        "SUMMARY: ThreadSanitizer: data race builder.cc:181 in capgraph::FillPool::Work\n"
        "==================\n"
        "SUMMARY: ThreadSanitizer: data race builder.cc:181 in capgraph::FillPool::Work\n")
    (tmp_path / "undefined.103").write_text(
        "lane.c:255:59: runtime error: shift exponent 40 is too large for 32-bit type 'int'\n"
        "    #0 0x7f in hf_copy_bytes lane.c:255\n")
    (tmp_path / "thread.104").write_text("==104==ThreadSanitizer: dup thread with used id 0x7f\n")
    (tmp_path / "address.105").write_text("")
    found = sanitize.reports(tmp_path)
    assert found == {
        "AddressSanitizer: heap-buffer-overflow lane.c:254 in hf_copy_bytes": 1,
        "ThreadSanitizer: data race builder.cc:181 in capgraph::FillPool::Work": 2,
        "lane.c:255:59: runtime error: shift exponent 40 is too large for 32-bit type 'int'": 1,
        "thread.104: ==104==ThreadSanitizer: dup thread with used id 0x7f": 1,
    }


@pytest.mark.parametrize("name", ["address", "thread", "undefined"])
def test_compilers_get_the_flags_and_not_the_preloaded_runtime(sanitize, tmp_path, name):
    """The environment points $CC and $CXX at wrappers that add the sanitizer's flags and drop
    LD_PRELOAD (a compiler, or /bin/sh, must not run under the test process's preloaded
    runtime), the two caches at folders of the run's own, and the sanitizer's options at the
    run's log folder (TSan's at its suppressions too)."""
    env = sanitize.environment(name, tmp_path)
    assert env["CAPGRAPH_CACHE_DIR"] == str(tmp_path / "capgraph-cache")
    assert env["HOSTFUNC_CACHE_DIR"] == str(tmp_path / "hostfunc-cache")
    assert "LD_PRELOAD" not in env
    options = env[sanitize._OPTIONS_VAR[name]]
    assert f"log_path={tmp_path / 'logs' / name}" in options
    assert ("suppressions=" in options) == (name == "thread")
    # the wrapper, pointed at a fake compiler that reports what it was given
    fake = tmp_path / "fake-cc"
    seen = tmp_path / "seen.txt"
    fake.write_text(f"#!{sys.executable}\nimport os, sys\n"
                    f"open({str(seen)!r}, 'w').write(repr((sys.argv[1:], "
                    f"os.environ.get('LD_PRELOAD'))))\n")
    fake.chmod(0o755)
    wrapper = tmp_path / "wrapped-cc"
    sanitize._write_compiler(wrapper, str(fake), sanitize._FLAGS[name])
    run = subprocess.run([str(wrapper), "-c", "x.c"], env={**os.environ,
                                                           "LD_PRELOAD": "libnothing.so"},
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    args, preload = ast.literal_eval(seen.read_text())
    assert preload is None
    assert args == [*sanitize._FLAGS[name].split(), "-g", "-fno-omit-frame-pointer", "-c", "x.c"]
    for tool in ("cc", "cxx"):
        assert os.access(tmp_path / "bin" / tool, os.X_OK)
        assert Path(env["CC" if tool == "cc" else "CXX"]) == tmp_path / "bin" / tool


def test_default_selection_runs_and_leaves_out_what_it_says(sanitize):
    """Every default test file exists, and every test left out under a sanitizer is one of
    them, named by a real test function."""
    for f in sanitize.NATIVE_TESTS:
        assert (ROOT / f).is_file(), f
    for name, tests in sanitize.DESELECT.items():
        for t in tests:
            path, func = t.split("::")
            assert path in sanitize.NATIVE_TESTS, (name, t)
            assert f"def {func}(" in (ROOT / path).read_text(), (name, t)
