"""What xgrammar's JSON-schema converter logs while it compiles, captured and passed on.

xgrammar 0.2.9 reports the constraints it drops (``multipleOf is not supported for
type:number; ignoring multipleOf``, ``Support for allOf with multiple options is still
ongoing``, ...) only as warnings its C++ logger writes to file descriptor 2; no Python API
returns them. :func:`converter_warnings` points descriptor 2 at a temporary file for the length
of one compile and hands the converter's warnings to the caller, which treats each as a
constraint not enforced.

Why this is safe in a threaded process:

- Descriptor 2 is process-wide, so one lock serialises every capture: two compiles never
  capture at once, and a capture never sees another's warnings (other JSON-schema compiles
  wait for the lock; nothing else logs from ``json_schema_converter.cc``).
- Whatever else the process writes to descriptor 2 during the window (other threads, Python's
  ``sys.stderr``) lands in the same file and is written back to the real descriptor 2, in
  order, when the window closes: it is delayed by one compile, never lost. Only lines of the
  converter's own ``Warning:`` format are read as warnings, so another thread's output cannot
  refuse a schema.
- A file, not a pipe: the compile can log any amount without blocking on a reader.
- Descriptor 2 is restored in a ``finally``, also when the compile raises; where descriptor 2
  was closed it is closed again.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["converter_warnings"]

_LOCK = threading.Lock()
# "[19:02:11] /project/cpp/json_schema_converter.cc:1094: Warning: multipleOf is not ..."
_WARNING = re.compile(r"json_schema_converter\.cc:\d+: Warning: (.*)")


def _flush_python_stderr() -> None:
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # replaced, closed or absent
        pass


@contextmanager
def converter_warnings() -> Iterator[list[str]]:
    """Capture descriptor 2 around the ``with`` body; the yielded list holds, once the body
    has left, the text of every warning xgrammar's JSON-schema converter logged in it.

    The captured text is written back to descriptor 2 unchanged. Holds a process-wide lock for
    the body's duration, so keep the body to the one compile call.
    """
    warnings: list[str] = []
    with _LOCK, tempfile.TemporaryFile() as sink:
        _flush_python_stderr()
        try:
            saved: int | None = os.dup(2)
        except OSError:  # descriptor 2 closed: capture all the same, close it again after
            saved = None
        os.dup2(sink.fileno(), 2)
        try:
            yield warnings
        finally:
            _flush_python_stderr()
            if saved is None:
                os.close(2)
            else:
                os.dup2(saved, 2)
                os.close(saved)
            sink.seek(0)
            data = sink.read()
            if data and saved is not None:
                _write_all(2, data)
            text = data.decode("utf-8", errors="replace")
            warnings.extend(m.group(1).strip() for m in _WARNING.finditer(text))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError:  # the real stderr went away: the warnings are still returned
            return
        view = view[written:]
