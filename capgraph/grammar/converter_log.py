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

- Descriptor 2 is process-wide: while any conversion runs, it points at one shared temporary
  file, and each conversion reads the part of it written during its own run (its window).
  Conversions run at once, never waiting for each other (a conversion that takes seconds,
  a 500-deep schema, delays no other guide). xgrammar writes a warning synchronously, in the
  converting thread, before the conversion returns, so a conversion's own warnings always lie
  in its window; a window without converter warnings is exact, and so is one no other
  conversion overlapped.
- A window with warnings that another conversion overlapped cannot say whose they are:
  :func:`captured` converts the guide again (conversions are deterministic), up to
  :data:`SHARED_TRIES` times, and where each try was again overlapped and saw warnings, once
  more alone: that try waits for the conversions running to end and holds new ones back until
  it ends. Only a guide converted while some other conversion logs warnings can wait so (and
  then at most until its request's own compile deadline, for the request).
- A compile logs the warnings of its grammar's patterns a second time (the automaton is built
  again), so a compile that goes ahead although its conversion logged some
  (``json_unenforced_keywords="ignore"``) joins the capture as a conversion whose window is not
  read (:func:`exclusive`): a conversion it overlaps treats warnings in its window as not its
  own to decide.
- Whatever else the process writes to descriptor 2 while a capture is open (other threads,
  Python's ``sys.stderr``) lands in the same file and is written back to the real descriptor
  2, in order, whenever a conversion ends: delayed, never lost. Only lines of the converters'
  own ``Warning:`` format are read as warnings, so another thread's output cannot refuse a
  guide.
- A file, not a pipe: a conversion can log any amount without blocking on a reader.
- Descriptor 2 is restored when the last conversion leaves (in a ``finally``, also when a
  conversion raises); where descriptor 2 was closed it is closed again.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator, TypeVar

T = TypeVar("T")

__all__ = ["converter_warnings", "captured", "exclusive", "CONVERTER_SOURCES", "SHARED_TRIES"]

#: Conversions of one guide that run alongside others before it is converted alone.
SHARED_TRIES = 2
#: The xgrammar source files whose warnings each report a constraint dropped or changed.
CONVERTER_SOURCES = ("json_schema_converter.cc", "regex_converter.cc", "fsm_builder.cc",
                     "structural_tag.cc", "lark_converter.cc")
# "[19:02:11] /project/cpp/json_schema_converter.cc:1094: Warning: multipleOf is not ..."
_WARNING = re.compile(r"(?:^|/)(?:%s):\d+: Warning: (.*)"
                      % "|".join(re.escape(f) for f in CONVERTER_SOURCES), re.MULTILINE)


class Warnings(list):  # type: ignore[type-arg]
    """The warnings read in one conversion's window (a list of str); ``ambiguous``: they may
    be another overlapping conversion's (read once the window closed)."""

    ambiguous = False


class _Window:
    __slots__ = ("start", "overlapped")

    def __init__(self, start: int) -> None:
        self.start = start
        self.overlapped = False


class _Capture:
    """The shared redirect of descriptor 2 and who is inside it."""

    def __init__(self) -> None:
        self.cond = threading.Condition(threading.Lock())
        self.windows: list[_Window] = []
        self.alone_pending = 0  # conversions waiting to run alone: new ones wait for them
        self.alone = False  # one runs alone
        self.sink: Any = None
        self.saved: int | None = None
        self.flushed = 0  # how much of the sink is written back to descriptor 2

    def enter(self, alone: bool) -> _Window:
        with self.cond:
            if alone:
                self.alone_pending += 1
                try:
                    self.cond.wait_for(lambda: not self.windows and not self.alone)
                finally:
                    self.alone_pending -= 1
                self.alone = True
            else:
                self.cond.wait_for(lambda: not self.alone_pending and not self.alone)
            _flush_python_stderr()
            if not self.windows:
                self.sink = tempfile.TemporaryFile()
                self.flushed = 0
                try:
                    self.saved = os.dup(2)
                except OSError:  # descriptor 2 closed: capture all the same, close it after
                    self.saved = None
                os.dup2(self.sink.fileno(), 2)
            window = _Window(os.fstat(self.sink.fileno()).st_size)
            if self.windows:
                window.overlapped = True
                for other in self.windows:
                    other.overlapped = True
            self.windows.append(window)
            return window

    def leave(self, window: _Window, alone: bool) -> bytes:
        """Close ``window``; the text written to descriptor 2 in it."""
        with self.cond:
            try:
                _flush_python_stderr()
                fd = self.sink.fileno()
                end = os.fstat(fd).st_size
                data = os.pread(fd, end - window.start, window.start) if end > window.start \
                    else b""
                if self.flushed < end and self.saved is not None:
                    _write_all(self.saved, os.pread(fd, end - self.flushed, self.flushed))
                self.flushed = end
            finally:
                self.windows.remove(window)
                if alone:
                    self.alone = False
                if not self.windows:
                    self._restore()
                self.cond.notify_all()
            return data

    def _restore(self) -> None:
        try:
            if self.saved is None:
                os.close(2)
            else:
                os.dup2(self.saved, 2)
                os.close(self.saved)
        finally:
            self.saved = None
            sink, self.sink = self.sink, None
            if sink is not None:
                sink.close()


_CAPTURE = _Capture()


def _flush_python_stderr() -> None:
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):  # replaced, closed or absent
        pass


@contextmanager
def converter_warnings(alone: bool = False) -> Iterator[Warnings]:
    """Capture descriptor 2 around the ``with`` body; the yielded list holds, once the body
    has left, the text of every warning xgrammar's converters (:data:`CONVERTER_SOURCES`)
    logged in it, each once, in order, and its ``ambiguous`` flag says whether another
    conversion ran alongside (the warnings may then be that one's: :func:`captured` retries).

    The captured text is written back to descriptor 2 unchanged. Other conversions capture at
    the same time; ``alone``: wait until none runs and hold new ones back for the body (only
    for a conversion whose shared tries were all ambiguous). Keep the body to the conversion
    (never a grammar compile).
    """
    warnings = Warnings()
    window = _CAPTURE.enter(alone)
    try:
        yield warnings
    finally:
        data = _CAPTURE.leave(window, alone)
        text = data.decode("utf-8", errors="replace")
        found = (m.group(1).strip() for m in _WARNING.finditer(text))
        warnings.extend(dict.fromkeys(found))  # (fsm_builder logs a pattern twice)
        warnings.ambiguous = bool(warnings) and window.overlapped


def captured(convert: Callable[[], T]) -> tuple[T, list[str]]:
    """``convert()`` (a conversion, never a compile) and the converter warnings it logged:
    converted alongside others, again where warnings seen could be another conversion's
    (:data:`SHARED_TRIES` tries), then alone."""
    for _ in range(SHARED_TRIES):
        with converter_warnings() as warned:
            result = convert()
        if not warned.ambiguous:
            return result, list(warned)
    with converter_warnings(alone=True) as warned:
        result = convert()
    return result, list(warned)


@contextmanager
def exclusive() -> Iterator[None]:
    """Join the capture around the ``with`` body without reading it: for a compile whose
    grammar logs converter warnings again (one that goes ahead in spite of them), so that a
    conversion alongside takes warnings in its window as possibly not its own."""
    window = _CAPTURE.enter(False)
    try:
        yield
    finally:
        _CAPTURE.leave(window, False)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        try:
            written = os.write(fd, view)
        except OSError:  # the real stderr went away: the warnings are still returned
            return
        view = view[written:]
