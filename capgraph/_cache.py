"""capgraph's on-disk cache: where it lives, and publishing a file there once across processes.

The converted tokenizers and the artifacts that :mod:`capgraph.jit` builds (NVRTC kernel
binaries, C++ libraries) all live under ``$CAPGRAPH_CACHE_DIR`` (default
``~/.cache/capgraph``), one folder each.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

__all__ = ["cache_dir", "publish_once"]


def cache_dir(sub: str) -> Path:
    """``$CAPGRAPH_CACHE_DIR/<sub>`` (default ``~/.cache/capgraph/<sub>``); not created."""
    base = os.environ.get("CAPGRAPH_CACHE_DIR") or "~/.cache/capgraph"
    return Path(base).expanduser() / sub


def publish_once(path: Path, produce: Callable[[Path], None], timeout_s: float) -> bool:
    """Make the file ``path`` exist, built at most once across processes.

    Unless it exists: under the file lock ``<path>.lock``, and unless another process made it
    meanwhile, ``produce(partial)`` writes a file next to it, which then replaces ``path``
    atomically. Returns True when this call produced it.

    Raises:
        OSError: the folder cannot be created or written.
        filelock.Timeout: another process held the lock for ``timeout_s`` seconds.
    """
    import filelock

    if path.is_file():
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(f"{path}.lock", timeout=timeout_s):
        if path.is_file():
            return False
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        try:
            produce(partial)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
    return True
