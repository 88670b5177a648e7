#!/usr/bin/env python3
"""Run capgraph's native code under a sanitizer: AddressSanitizer, ThreadSanitizer or UBSan.

Every native artifact capgraph compiles at run time -- the C++ host build library (the native
build, the host node, the fill pool), the C++ CPU mask library and hostfunc's lane library (the
CPU stand-in's native calls) -- is rebuilt with ``-fsanitize=<name> -g`` into caches of its own,
then the tests that drive that code run with the sanitizer's runtime loaded into Python. At the
end the reports are grouped by their SUMMARY line and printed; the exit code is non-zero when a
test failed or any report was written.

    python tools/sanitize.py address
    python tools/sanitize.py thread -- tests/test_host_node.py -k gil
    python tools/sanitize.py undefined --out /tmp/ub

How it is wired (why each part is there):

- **Compilers**: ``$CC`` and ``$CXX`` are small Python scripts under ``OUT/bin`` that drop
  ``LD_PRELOAD`` and run ``gcc`` / ``g++`` with the sanitizer's flags. The sanitizer runtime is
  preloaded into the test process and so into every child it starts; the compiler must not run
  under it (``/bin/sh`` crashes under a preloaded TSan runtime), and a test that compiles into a
  fresh cache must still be able to.
- **Caches**: ``CAPGRAPH_CACHE_DIR`` and ``HOSTFUNC_CACHE_DIR`` point under ``OUT``, so the
  sanitized builds never mix with the normal ones; the three artifacts are built before the tests
  start (without the runtime loaded), so the first test does not pay the compile.
- **Runtimes**: Python itself is not built with a sanitizer, so ASan's and TSan's runtimes are
  preloaded (ASan's with ``libstdc++``: its ``__cxa_throw`` interceptor needs the real one at
  start-up, and the C++ library throws through tvm-ffi). UBSan's runtime is linked into each
  library and needs no preload.
- **Reports**: each process writes to ``OUT/logs/<name>.<pid>``. ASan runs with leak detection
  off (CPython and torch keep their allocations to the end, by design); TSan reads the
  suppressions in ``OUT/tsan.supp``: only the thread-leak report for hostfunc lanes whose stream
  was closed but never released when the interpreter exited (a lane's finaliser does not run at
  exit, so its ended thread is not joined: the process is ending, nothing is lost). TSan also
  ignores what its interceptors see from libraries that are not instrumented
  (``ignore_noninstrumented_modules``: xgrammar's and torch's memcpy calls from two Python
  threads synchronise through the GIL, which TSan cannot see).
- **Left out** (:data:`DESELECT`, default selection only): the tests that run nvcc and NVRTC
  under a preloaded runtime, and under TSan the two tests that fork while threads run.

Races and memory errors inside xgrammar, tvm-ffi, torch and CPython themselves are out of view:
those libraries are not rebuilt, so only what capgraph and hostfunc compile is checked.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The test files that run capgraph's and hostfunc's native code (the default selection).
NATIVE_TESTS = (
    "tests/test_host_node.py", "tests/test_pipelined_steps.py", "tests/test_fill_pool.py",
    "tests/test_native_build.py", "tests/test_hostfunc_native.py",
    "tests/test_handover_native.py", "tests/test_build_core.py", "tests/test_draft_trees.py",
    "tests/test_grammar_drafts.py", "tests/test_hostile_input.py", "tests/test_hostfunc_cpu.py",
    "tests/test_capturable.py", "tests/test_ops.py", "tests/test_kernel_compile.py",
)

#: Tests left out under a sanitizer, and why. nvcc and NVRTC are NVIDIA's binaries: under a
#: preloaded runtime nvcc crashes and NVRTC cannot load its builtins library (nothing of
#: capgraph's runs in them). TSan cannot follow a fork taken while threads run ("dup thread
#: with used id" in the child), which is what the fork tests do on purpose.
_COMPILER_TESTS = ("tests/test_kernel_compile.py::test_nvcc_compiles_for_sm90",
                   "tests/test_kernel_compile.py::test_nvrtc_compiles_and_caches")
DESELECT = {
    "address": _COMPILER_TESTS,
    "thread": (*_COMPILER_TESTS, "tests/test_fill_pool.py::test_forked_child_starts_its_own_pool",
               "tests/test_native_build.py::test_forked_child_starts_its_own_build_thread"),
    "undefined": (),
}

_FLAGS = {"address": "-fsanitize=address", "thread": "-fsanitize=thread",
          "undefined": "-fsanitize=undefined"}
_OPTIONS_VAR = {"address": "ASAN_OPTIONS", "thread": "TSAN_OPTIONS", "undefined": "UBSAN_OPTIONS"}
_RUNTIME = {"address": ("libasan.so", "libstdc++.so.6"), "thread": ("libtsan.so",),
            "undefined": ()}
_SUMMARY = re.compile(r"^SUMMARY: (\w+Sanitizer: .*)$")
_UB_ERROR = re.compile(r"^(\S+: runtime error: .*)$")
_TSAN_SUPPRESSIONS = """\
# hostfunc lanes closed at interpreter exit and never released: their ended thread is not
# joined because the process is ending (hostfunc/lane.py: the finaliser does not run at exit).
thread:hf_lane_create
"""


def _write_compiler(path: Path, compiler: str, flags: str) -> None:
    """A compiler wrapper: the sanitizer's flags added, the preloaded runtime dropped."""
    path.write_text(
        f"#!{sys.executable}\n"
        "import os, sys\n"
        "os.environ.pop('LD_PRELOAD', None)\n"
        f"args = [{compiler!r}, *{flags.split()!r}, '-g', '-fno-omit-frame-pointer', *sys.argv[1:]]\n"
        f"os.execvp({compiler!r}, args)\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def _runtime_paths(sanitizer: str) -> list[str]:
    paths = []
    for name in _RUNTIME[sanitizer]:
        out = subprocess.run(["gcc", f"-print-file-name={name}"], capture_output=True, text=True)
        path = out.stdout.strip()
        if out.returncode != 0 or not os.path.isabs(path) or not os.path.exists(path):
            raise SystemExit(f"sanitize: gcc does not know where {name} is (got {path!r}); "
                             f"install gcc's {sanitizer} sanitizer runtime")
        paths.append(path)
    return paths


def environment(sanitizer: str, out: Path) -> dict[str, str]:
    """The environment the sanitized builds and tests run in (without the preload)."""
    bin_dir = out / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    _write_compiler(bin_dir / "cc", "gcc", _FLAGS[sanitizer])
    _write_compiler(bin_dir / "cxx", "g++", _FLAGS[sanitizer])
    logs = out / "logs"
    logs.mkdir(exist_ok=True)
    options = [f"log_path={logs / sanitizer}"]
    if sanitizer == "address":
        options += ["detect_leaks=0"]
    elif sanitizer == "undefined":
        options += ["print_stacktrace=1"]
    elif sanitizer == "thread":
        supp = out / "tsan.supp"
        supp.write_text(_TSAN_SUPPRESSIONS)
        options += ["halt_on_error=0", "report_signal_unsafe=0", f"suppressions={supp}",
                    "ignore_noninstrumented_modules=1"]
    env = dict(os.environ)
    env.update({"CC": str(bin_dir / "cc"), "CXX": str(bin_dir / "cxx"),
                "CAPGRAPH_CACHE_DIR": str(out / "capgraph-cache"),
                "HOSTFUNC_CACHE_DIR": str(out / "hostfunc-cache"),
                _OPTIONS_VAR[sanitizer]: ":".join(options),
                "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT),
                                                             env.get("PYTHONPATH")]))})
    env.pop("LD_PRELOAD", None)
    return env


_PREBUILD = """
from capgraph import jit
from capgraph.build import library
from capgraph.ops import cpu_mask
from hostfunc import lane
jit.build(library._library_spec())
jit.build(jit.cxx_library(cpu_mask._LIBRARY, cpu_mask._SOURCES))
lane._build(lane._compiler())  # built, not loaded: an instrumented library needs its runtime
"""


def reports(logs: Path) -> collections.Counter[str]:
    """How many reports of each kind the log files in ``logs`` hold: ASan's and TSan's by their
    SUMMARY line, UBSan's by its "runtime error" line; a file with neither (a sanitizer's
    own failure, say) counts once by its first line."""
    found: collections.Counter[str] = collections.Counter()
    for path in sorted(logs.iterdir()):
        text = path.read_text(errors="replace")
        before = sum(found.values())
        for line in text.splitlines():
            m = _SUMMARY.match(line) or _UB_ERROR.match(line)
            if m:
                found[m.group(1)] += 1
        if sum(found.values()) == before and text.strip():
            found[f"{path.name}: {text.strip().splitlines()[0][:200]}"] += 1
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Arguments after -- go to pytest (default: the native test files).")
    parser.add_argument("sanitizer", choices=sorted(_FLAGS))
    parser.add_argument("--out", type=Path, default=None,
                        help="builds, caches and logs (default: /tmp/capgraph-sanitize/NAME)")
    args, pytest_args = parser.parse_known_args(argv)
    if pytest_args and pytest_args[0] == "--":
        pytest_args = pytest_args[1:]
    for tool in ("gcc", "g++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"sanitize: {tool} is not on PATH")
    out = (args.out or Path("/tmp/capgraph-sanitize") / args.sanitizer).resolve()
    if (out / "logs").exists():
        shutil.rmtree(out / "logs")
    env = environment(args.sanitizer, out)

    start = time.perf_counter()
    print(f"sanitize: building capgraph's and hostfunc's native code with "
          f"{_FLAGS[args.sanitizer]} into {out}", flush=True)
    built = subprocess.run([sys.executable, "-c", _PREBUILD], env=env, cwd=ROOT)
    if built.returncode != 0:
        print("sanitize: the sanitized build failed (above)", file=sys.stderr)
        return 2
    print(f"sanitize: built in {time.perf_counter() - start:.0f} s", flush=True)

    run_env = dict(env)
    preload = _runtime_paths(args.sanitizer)
    if preload:
        run_env["LD_PRELOAD"] = " ".join(preload)
    selection = pytest_args or [*NATIVE_TESTS,
                                *(f"--deselect={t}" for t in DESELECT[args.sanitizer])]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *selection]
    print("sanitize: " + (f"LD_PRELOAD='{run_env['LD_PRELOAD']}' " if preload else "")
          + " ".join(cmd), flush=True)
    start = time.perf_counter()
    tests = subprocess.run(cmd, env=run_env, cwd=ROOT)
    elapsed = time.perf_counter() - start

    found = reports(out / "logs")
    print(f"\nsanitize ({args.sanitizer}): pytest exit {tests.returncode} in {elapsed:.0f} s; "
          f"{sum(found.values())} report(s) in {out / 'logs'}")
    for summary, count in found.most_common():
        print(f"  {count:4d}  {summary}")
    return 1 if tests.returncode != 0 or found else 0


if __name__ == "__main__":
    sys.exit(main())
