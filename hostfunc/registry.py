"""The process-wide registry of enqueued callbacks, keyed by integer.

A driver (or the CPU stand-in) hands a host callback one pointer-sized value, so each enqueued
call is stored here as an :class:`Entry` under an integer key, and the key is what travels through
the driver. Both backends share the one registry, so that ``live_entries()`` counts everything.

Threads: :meth:`Registry.run` and :meth:`Registry.defer_release` are called from callback threads
(driver threads, HostStream workers); everything that drops an entry's last reference —
:meth:`Registry.collect` — runs on the thread that launches or drains, because dropping a CUDA
tensor may call into CUDA, which a host callback or a user-object destructor must not do.
"""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import HostFuncError

__all__ = ["Entry", "Registry", "REGISTRY", "callable_name"]


def callable_name(fn: Callable[..., Any]) -> str:
    """The name a callback is reported under: its qualified name, else its repr."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    return str(name) if name else repr(fn)


@dataclass(slots=True)
class Entry:
    """One enqueued call: the function, the arguments bound at launch, and its lifetime rule.

    ``one_shot`` entries (eager launches) are released after they run; the others (captured
    launches) live until whoever owns them (a graph) hands their key back.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    name: str
    one_shot: bool


class Registry:
    """Integer keys to entries, a queue of keys to release, and the errors not yet reported."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, Entry] = {}
        self._keys = itertools.count(1)          # 0 would reach a callback as NULL
        self._to_release: deque[int] = deque()   # appended from any thread, drained by collect()
        self._errors: list[HostFuncError] = []

    def add(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
            *, one_shot: bool) -> int:
        """Store a call and return its key (never 0)."""
        entry = Entry(fn, args, kwargs, callable_name(fn), one_shot)
        with self._lock:
            key = next(self._keys)
            self._entries[key] = entry
        return key

    def run(self, key: int) -> None:
        """Run the call stored under ``key``; never raises (a failure is kept for the next drain).

        Called on callback threads with the GIL held. The registry lock is not held while the
        callback runs, so a callback may launch further callbacks.
        """
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            self.record_error(f"<entry {key}>", LookupError(
                f"no live hostfunc entry under key {key}: it was released before it ran"))
            return
        try:
            self.call(entry.fn, entry.args, entry.kwargs, entry.name)
        finally:
            # Only a one-shot entry goes back here; a graph's entries go back with the graph.
            if entry.one_shot:
                self.defer_release(key)

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
             name: str | None = None,
             reraise: tuple[type[BaseException], ...] = ()) -> None:
        """Run ``fn(*args, **kwargs)`` as a callback; raises only what ``reraise`` names (a
        failure is kept for the next drain under ``name``, default :func:`callable_name`)."""
        try:
            fn(*args, **kwargs)
        except reraise:
            raise
        except BaseException as exc:  # noqa: BLE001 — a callback must never let one escape
            if exc.__traceback__ is not None and exc.__traceback__.tb_next is not None:
                exc = exc.with_traceback(exc.__traceback__.tb_next)  # start at the callback
            owner = args[0] if args and getattr(type(args[0]), "__hostfunc_owner__", False) \
                else None
            self.record_error(name or callable_name(fn), exc, owner)

    def defer_release(self, key: int) -> None:
        """Queue ``key`` for release by the next :meth:`collect`; safe from any thread."""
        self._to_release.append(key)

    def collect(self) -> int:
        """Release every queued key on the calling thread; return how many entries went."""
        released = 0
        if not self._to_release:  # (every launch and drain comes here)
            return released
        while True:
            try:
                key = self._to_release.popleft()
            except IndexError:
                return released
            with self._lock:
                entry = self._entries.pop(key, None)
            if entry is not None:
                released += 1
            del entry  # the callback's arguments are dropped here, outside the lock

    def release(self, key: int) -> None:
        """Release ``key`` now (a launch that failed before anything could run it)."""
        with self._lock:
            entry = self._entries.pop(key, None)
        del entry

    def live(self) -> int:
        """Number of entries still held, after releasing what is queued for release."""
        self.collect()
        with self._lock:
            return len(self._entries)

    def record_error(self, fn_name: str, exc: BaseException, owner: object = None) -> None:
        """Keep a callback's exception for the next drain; safe from any thread."""
        error = HostFuncError(fn_name, exc, owner)
        with self._lock:
            self._errors.append(error)

    def raise_pending(self, owner: object = None) -> None:
        """Raise the oldest kept callback error (the others ride along in ``later_errors``);
        with ``owner``, only those of that owner or of none (another owner's stay kept)."""
        if not self._errors:  # (every check comes here; an error appended meanwhile waits)
            return
        with self._lock:
            if owner is None:
                errors, self._errors = self._errors, []
            else:
                errors = [e for e in self._errors if e.owner is None or e.owner is owner]
                self._errors = [e for e in self._errors
                                if not (e.owner is None or e.owner is owner)]
        if errors:
            first = errors[0]
            first.later_errors = tuple(errors[1:])
            raise first

    def pending_errors(self) -> int:
        """Number of callback errors kept and not yet raised."""
        with self._lock:
            return len(self._errors)


# The one registry of the process: the CUDA trampoline is process-wide (a C function pointer
# cannot carry a Python object), so the table it indexes is too.
REGISTRY = Registry()
