"""capgraph's compiled artifacts: where their sources are, how they are keyed, built, cached and loaded.

Every artifact compiled at run time -- the C++ host build library, the C++ CPU mask library,
the NVRTC mask kernel -- is a :class:`JitSpec`: a name, the ``csrc/`` files it is made from,
what else decides its bytes (compiler identity, flags, versions) and how to build it.
:func:`build` returns the artifact's path in the on-disk cache, building it there first where
it is missing:

- **sources**: ``capgraph/csrc`` in an installed wheel, else the source tree's ``csrc/``
  (:func:`csrc_dir`);
- **key**: a hash of the spec's name, every source and header it names, and its identity
  (:func:`cache_key`); the file is ``$CAPGRAPH_CACHE_DIR/<folder>/<name>-<key><suffix>``;
- **publish once**: built next to its final name under a file lock and moved into place, so
  concurrent processes build it once and never read a partial file
  (:func:`capgraph._cache.publish_once`);
- **build**: the spec's own callable; :func:`cxx_library` makes the spec of a shared library
  compiled with the machine's C++ compiler (``$CXX``, else ``c++``) against tvm-ffi's headers
  (xgrammar's FFI layer), one object per source in parallel, then linked;
- **load**: :func:`load_tvm_ffi_module` and :func:`load_python_extension`.

Nothing here runs at import; callers build on first use and keep what they loaded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sysconfig
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

from ._cache import cache_dir, publish_once
from .errors import NativeBuildError

__all__ = ["JitSpec", "JitCacheError", "build", "cache_key", "artifact_path", "csrc_dir",
           "unavailable_reason",
           "csrc_path", "cxx_library", "load_tvm_ffi_module", "load_python_extension"]

#: How long a compile, or a wait for another process's compile, may take.
LOCK_TIMEOUT_S = 300.0
_CXX_FLAGS = ("-std=c++17", "-O3", "-fPIC", "-fvisibility=hidden")
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class JitSpec:
    """One compiled artifact.

    Args:
        name: the artifact's name, the stem of its cache file (``host_build``).
        sources: the files it is built from, by name inside ``source_dir``, in order.
        build: ``build(sources, out)`` writes the artifact to the file ``out`` from the
            sources' paths; raises :class:`NativeBuildError` (or the tool's own error).
        headers: files the sources include: part of the key, not built on their own.
        identity: everything else that decides the artifact's bytes (compiler and its
            version, flags, library versions, target architecture), as text.
        folder: the cache folder, ``$CAPGRAPH_CACHE_DIR/<folder>``.
        suffix: the cache file's suffix (``.so``, ``.cubin``).
        source_dir: where the sources are; None: :func:`csrc_dir`.
    """

    name: str
    sources: tuple[str, ...]
    build: Callable[[list[Path], Path], None]
    headers: tuple[str, ...] = ()
    identity: tuple[str, ...] = ()
    folder: str = "native"
    suffix: str = ".so"
    source_dir: Path | None = None

    def path_of(self, file: str) -> Path:
        """The path of one of its sources or headers."""
        return (self.source_dir if self.source_dir is not None else csrc_dir()) / file


class JitCacheError(NativeBuildError):
    """The artifact's cache folder cannot be created, written or locked; ``spec`` is the
    artifact and ``path`` the file it would have been."""

    def __init__(self, message: str, *, spec: JitSpec, path: Path) -> None:
        super().__init__(message)
        self.spec = spec
        self.path = path


def csrc_dir() -> Path:
    """The folder of capgraph's C++ and CUDA sources: ``capgraph/csrc`` in an installed wheel
    (package data), else the source tree's ``csrc/`` next to the package."""
    package = Path(__file__).resolve().parent
    for folder in (package / "csrc", package.parent / "csrc"):
        if folder.is_dir():
            return folder
    raise NativeBuildError(f"capgraph's sources are missing: neither {package / 'csrc'} nor "
                           f"{package.parent / 'csrc'} exists")


def csrc_path(file: str) -> Path:
    """One file of :func:`csrc_dir`."""
    return csrc_dir() / file


def cache_key(spec: JitSpec) -> str:
    """The hash that names the artifact's cache file: its name, the bytes of every source and
    header (with their names) and its identity."""
    digest = hashlib.sha256(spec.name.encode())
    for file in (*spec.sources, *spec.headers):
        path = spec.path_of(file)
        try:
            data = path.read_bytes()
        except OSError as e:
            raise NativeBuildError(f"{spec.name}: cannot read its source {path}: {e}") from e
        digest.update(b"\0" + file.encode() + b"\0" + data)
    for item in spec.identity:
        digest.update(b"\0" + item.encode())
    return digest.hexdigest()[:24]


def artifact_path(spec: JitSpec) -> Path:
    """Where the artifact lives in the cache (it may not exist yet)."""
    return cache_dir(spec.folder) / f"{spec.name}-{cache_key(spec)}{spec.suffix}"


def build(spec: JitSpec) -> Path:
    """The artifact's path in the cache, built into it first where it is missing (once across
    processes, under a file lock).

    Raises:
        NativeBuildError: a source is missing or the build failed (the message names the file
            and shows the compiler's output).
        JitCacheError: the cache folder cannot be written or locked.
    """
    import filelock

    path = artifact_path(spec)

    def build_into(partial: Path) -> None:
        _log.info("building %s (once per machine) into %s", spec.name, path.parent)
        spec.build([spec.path_of(s) for s in spec.sources], partial)

    try:
        publish_once(path, build_into, LOCK_TIMEOUT_S)
    except (OSError, filelock.Timeout) as e:
        raise JitCacheError(f"cannot write the cache {path.parent} for {spec.name}: {e}",
                            spec=spec, path=path) from e
    return path


# -- C++ shared libraries against tvm-ffi ----------------------------------------------------

def cxx_compiler() -> list[str]:
    """The C++ compiler's command: ``$CXX``, else ``c++``."""
    cxx = shlex.split(os.environ.get("CXX") or "c++")
    if not cxx or shutil.which(cxx[0]) is None:
        raise NativeBuildError(f"no C++ compiler: {' '.join(cxx) or '$CXX'!r} is not on PATH "
                               "(install g++ or set CXX)")
    return cxx


def _compiler_version(cxx: list[str]) -> str:
    try:
        out = subprocess.run([*cxx, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise NativeBuildError(f"{' '.join(cxx)} --version failed: {e}") from e
    return out.stdout.splitlines()[0] if out.stdout else ""


def _tvm_ffi_paths() -> tuple[list[str], str]:
    """tvm-ffi's include folders and its shared library."""
    try:
        import tvm_ffi.libinfo as libinfo
    except ImportError as e:
        raise NativeBuildError(f"tvm-ffi (installed with xgrammar) is missing: {e}") from e
    return [libinfo.find_include_path(), libinfo.find_dlpack_include_path()], \
        libinfo.find_libtvm_ffi()


def _failure(what: str, cmd: Sequence[str], returncode: int, stdout: str, stderr: str) -> str:
    """``what`` failed: the command and the last lines of the tool's own output."""
    tail = "\n".join((stderr or stdout).strip().splitlines()[-15:])
    return f"{what} failed (exit {returncode}): {' '.join(cmd)}\n{tail}"


def _compile_and_link(name: str, cxx: list[str], cflags: Sequence[str],
                      ldflags: Sequence[str], sources: list[Path], out: Path) -> None:
    """Each source to an object (all at once, one process each), then the shared library
    ``name`` into ``out``."""
    with tempfile.TemporaryDirectory(prefix="capgraph-jit-") as tmp:
        objects = [Path(tmp) / f"{i}-{s.stem}.o" for i, s in enumerate(sources)]
        jobs = []
        try:
            for source, obj in zip(sources, objects):
                cmd = [*cxx, *cflags, "-c", str(source), "-o", str(obj)]
                jobs.append((source, cmd, subprocess.Popen(
                    cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
        except OSError as e:
            for _, _, proc in jobs:
                proc.kill()
                proc.communicate()
            raise NativeBuildError(f"compiling {sources[len(jobs)].name} failed: {e}") from e
        failures = []
        for source, cmd, proc in jobs:
            try:
                stdout, stderr = proc.communicate(timeout=LOCK_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                stdout, stderr = proc.communicate()
                failures.append(f"compiling {source.name} failed: timed out after "
                                f"{LOCK_TIMEOUT_S:.0f} s")
                continue
            if proc.returncode:
                failures.append(_failure(f"compiling {source.name}", cmd, proc.returncode,
                                         stdout, stderr))
        if failures:
            raise NativeBuildError("\n".join(failures))
        cmd = [*cxx, "-shared", *map(str, objects), "-o", str(out), *ldflags]
        try:
            link = subprocess.run(cmd, capture_output=True, text=True, timeout=LOCK_TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise NativeBuildError(f"linking {name} failed: {e}") from e
        if link.returncode:
            raise NativeBuildError(_failure(f"linking {name}", cmd, link.returncode,
                                            link.stdout, link.stderr))


def cxx_library(name: str, sources: Sequence[str], *, headers: Sequence[str] = (),
                cflags: Sequence[str] = (), source_dir: Path | None = None) -> JitSpec:
    """The spec of a shared library built from ``sources`` with the machine's C++ compiler
    (C++17, ``-O3``, hidden visibility, plus ``cflags``) against tvm-ffi's headers, linked to
    libtvm_ffi. Its identity holds the compiler's command and version, the flags, tvm-ffi's
    version and library, and Python's extension suffix. Reads the compiler's version (a
    subprocess); raises :class:`NativeBuildError` where there is no compiler or no tvm-ffi."""
    cxx = cxx_compiler()
    includes, lib = _tvm_ffi_paths()
    import tvm_ffi  # (importable: _tvm_ffi_paths found it)

    libdir = os.path.dirname(lib)
    all_cflags = (*_CXX_FLAGS, *cflags, *(f"-I{p}" for p in includes))
    ldflags = (f"-L{libdir}", "-ltvm_ffi", f"-Wl,-rpath,{libdir}")
    identity = (" ".join(cxx), _compiler_version(cxx), " ".join(all_cflags), " ".join(ldflags),
                str(getattr(tvm_ffi, "__version__", "?")), lib,
                str(sysconfig.get_config_var("EXT_SUFFIX")))

    def build_library(paths: list[Path], out: Path) -> None:
        _compile_and_link(name, cxx, all_cflags, ldflags, paths, out)

    return JitSpec(name=name, sources=tuple(sources), build=build_library,
                   headers=tuple(headers), identity=identity, source_dir=source_dir)


# -- loading ---------------------------------------------------------------------------------

def load_tvm_ffi_module(path: Path) -> Any:
    """The library at ``path`` as a tvm-ffi module (its exported functions as attributes)."""
    try:
        import tvm_ffi
    except ImportError as e:
        raise NativeBuildError(f"tvm-ffi (installed with xgrammar) is missing: {e}") from e
    try:
        return tvm_ffi.load_module(str(path))
    except Exception as e:
        raise NativeBuildError(f"loading {path} failed: {type(e).__name__}: {e}") from e


def load_python_extension(path: Path, module_name: str) -> Any:
    """The library at ``path`` as the CPython extension module ``module_name``, or None where
    it has no ``PyInit_<module_name>`` (built without Python's headers)."""
    import importlib.machinery
    import importlib.util

    loader = importlib.machinery.ExtensionFileLoader(module_name, str(path))
    spec = importlib.util.spec_from_file_location(module_name, str(path), loader=loader)
    if spec is None:  # pragma: no cover - the file exists
        return None
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as e:  # no PyInit_: compiled without Python's headers
        _log.debug("no CPython entry in %s: %s", path, e)
        return None
    return module


def unavailable_reason(load: Callable[[], Any]) -> str | None:
    """None if ``load()`` (an artifact's loader, building it if needed) succeeds, else the
    :class:`NativeBuildError` message saying why it does not."""
    try:
        load()
    except NativeBuildError as e:
        return str(e)
    return None
