"""What xgrammar's converters log while a guide is converted, captured and passed on.

xgrammar 0.2.9 reports the constraints it drops or changes only as warnings its C++ logger
writes to file descriptor 2; no Python API returns them. They come from the JSON-schema
converter (``multipleOf is not supported for type:number; ignoring multipleOf``, ``Support for
allOf with multiple options is still ongoing``, ...), from the two regex readers (the one that
turns a REGEX guide or a structural tag's ``regex`` into a grammar, ``regex_converter.cc``:
``'$' should be at the end of the regex, but found in the middle. It is ignored.``, ``Escape
sequence '\\A' is not recognized. The character itself will be matched``; the one that builds
the automaton of a schema ``pattern`` or an EBNF ``Regex(...)``, ``fsm_builder.cc``: ``Anchor
'$' in the middle of regex is ignored``, ``Lookahead assertion is not supported and is ignored
in regex``, ``Escape sequence \\A is not recognized in regex; matching the character
literally``, ``Excluded patterns are ignored when back edges are not added.``), from the
structural-tag converter (``Repeat max is too large, will be set as not limited``) and from its
Lark converter (``Ignoring max_chars on rule ...``). Each of them means a constraint of the
guide is dropped or changed; xgrammar's other warnings (matcher, tokenizer, environment) are
not read. :func:`converter_warnings` points descriptor 2 at a temporary file for the length of
one conversion and hands those warnings to the caller, which treats each as a constraint not
enforced.

Why this is safe in a threaded process:

- Descriptor 2 is process-wide, so one lock serialises every capture: two conversions never
  capture at once, and a capture never sees another's warnings. capgraph converts guides only
  inside a capture; a compile logs the warnings of its grammar's patterns a second time (the
  automaton is built again), so a compile that goes ahead although its conversion logged some
  (``json_unenforced_keywords="ignore"``) holds the same lock (:func:`exclusive`).
- Whatever else the process writes to descriptor 2 during the window (other threads, Python's
  ``sys.stderr``) lands in the same file and is written back to the real descriptor 2, in
  order, when the window closes: it is delayed by one conversion, never lost. Only lines of
  the converters' own ``Warning:`` format are read as warnings, so another thread's output
  cannot refuse a guide.
- A file, not a pipe: the conversion can log any amount without blocking on a reader.
- Descriptor 2 is restored in a ``finally``, also when the conversion raises; where
  descriptor 2 was closed it is closed again.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Iterator

__all__ = ["converter_warnings", "exclusive", "CONVERTER_SOURCES"]

_LOCK = threading.Lock()
#: The xgrammar source files whose warnings each report a constraint dropped or changed.
CONVERTER_SOURCES = ("json_schema_converter.cc", "regex_converter.cc", "fsm_builder.cc",
                     "structural_tag.cc", "lark_converter.cc")
# "[19:02:11] /project/cpp/json_schema_converter.cc:1094: Warning: multipleOf is not ..."
_WARNING = re.compile(r"(?:^|/)(?:%s):\d+: Warning: (.*)"
                      % "|".join(re.escape(f) for f in CONVERTER_SOURCES), re.MULTILINE)


def _flush_python_stderr() -> None:
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # replaced, closed or absent
        pass


@contextmanager
def converter_warnings() -> Iterator[list[str]]:
    """Capture descriptor 2 around the ``with`` body; the yielded list holds, once the body
    has left, the text of every warning xgrammar's converters (:data:`CONVERTER_SOURCES`)
    logged in it, each once, in order.

    The captured text is written back to descriptor 2 unchanged. Holds a process-wide lock for
    the body's duration, so keep the body to the conversion (never a grammar compile).
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
            found = (m.group(1).strip() for m in _WARNING.finditer(text))
            warnings.extend(dict.fromkeys(found))  # (fsm_builder logs a pattern twice)


@contextmanager
def exclusive() -> Iterator[None]:
    """Hold the capture lock around the ``with`` body without capturing: for a compile whose
    grammar logs converter warnings again (one that goes ahead in spite of them), so that no
    capture in another thread reads them as its own."""
    with _LOCK:
        yield


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError:  # the real stderr went away: the warnings are still returned
            return
        view = view[written:]
