"""Compiles off the decode path: one thread per compile, at most ``slots`` compiling at once,
and beside them at most ``background_slots`` background compiles.

A plain thread pool starves when a compile times out: the C++ compile cannot be cancelled, so
its worker stays busy and every compile queued behind it times out too. Here a compile whose
waiter gave up (:meth:`CompilePool.abandon`) gives its slot back at once and finishes in the
background (its result is kept only if a request asks for it again meanwhile: see
``GrammarMatcherFactory``); at most ``max_abandoned`` such compiles run
past their slot, so hostile guides cannot pile up threads without bound (past that, an
abandoned compile keeps its slot until it ends).

A compile submitted with a ``nice`` value > 0 is a background compile (nobody waits for it
right now: a hand-over's xgrammar compile, :mod:`capgraph.grammar.handover`). It takes one of
the ``background_slots``, never one of the ``slots``, so a compile a request waits for never
queues behind background ones; and it runs its heavy, GIL-free part at that lower CPU priority
(:func:`run_lowered`: Linux, a thread's own nice value, which the backend's compile threads
started from it inherit), so it cannot take CPU time from the decode loop or from a compile a
request waits for. Its Python part (keyword checks, conversion) stays at normal priority: a
starved thread must never hold the GIL, or a lock, that a request's thread waits for.

Threads: at most ``slots + background_slots + max_abandoned`` compiles run at once (a matcher
factory's pool: ``2 * compile_threads`` plus the abandoned ones), each on its own thread plus
the backend's compile threads it starts; with ``max_waiting`` set, at most that many of each
kind wait for a slot.

At interpreter exit, compiles that have not started are cancelled and those still running are
waited for, up to the longest ``exit_wait_s`` of the pools (``compile_timeout_s``): a compile
left inside xgrammar's C++ code when the interpreter finalizes cannot take the GIL back and
aborts the process ("terminate called without an active exception", exit status 134).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from ..errors import CompileQueueFullError, GrammarCompileError

__all__ = ["CompilePool", "BACKGROUND_NICE", "run_lowered", "in_background_job"]

logger = logging.getLogger("capgraph")

T = TypeVar("T")

#: The nice value of a background compile (:meth:`CompilePool.submit`): the lowest priority.
BACKGROUND_NICE = 19


class CompilePool:
    """Runs compile jobs on threads of their own, ``slots`` at a time, and background jobs
    ``background_slots`` at a time beside them.

    Args:
        slots: compiles that may run at once (``GuidedDecodingConfig.compile_threads``).
        max_abandoned: abandoned compiles allowed to run beyond the slots.
        max_waiting: compiles of each kind (background or not) allowed to wait for a slot;
            past it :meth:`submit` raises :class:`~capgraph.errors.CompileQueueFullError`
            (None: no bound).
        exit_wait_s: at interpreter exit, how long this pool's running compiles are waited
            for (the factory passes ``compile_timeout_s``).
        background_slots: background compiles (submitted with ``nice`` > 0) that may run at
            once, apart from ``slots`` (None: as many as ``slots``).
    """

    def __init__(self, slots: int, max_abandoned: int | None = None,
                 max_waiting: int | None = None, exit_wait_s: float = 30.0,
                 background_slots: int | None = None) -> None:
        self.slots = slots
        self.background_slots = slots if background_slots is None else background_slots
        self.exit_wait_s = exit_wait_s
        self.max_abandoned = 4 * slots if max_abandoned is None else max_abandoned
        self.max_waiting = max_waiting
        self._cv = threading.Condition()
        # per kind (background: True): jobs without a slot yet, futures holding one
        self._waiting = {False: 0, True: 0}
        self._holding: dict[bool, set[Future]] = {False: set(), True: set()}
        self._abandoned: set[Future] = set()  # running past their slot
        self._generation = 0  # bumped by close(): waiting jobs of older generations cancel
        _POOLS.add(self)

    @property
    def running(self) -> int:
        """Compiles holding a slot now (background ones included)."""
        with self._cv:
            return len(self._holding[False]) + len(self._holding[True])

    @property
    def running_background(self) -> int:
        """Background compiles holding a background slot now."""
        with self._cv:
            return len(self._holding[True])

    @property
    def abandoned(self) -> int:
        """Compiles still running after their waiter gave up."""
        with self._cv:
            return len(self._abandoned)

    def submit(self, job: Callable[[], object], name: str = "capgraph-compile", *,
               nice: int = 0) -> Future:
        """Run ``job`` on a new daemon thread once a slot is free; its result or exception
        completes the returned future. Raises CompileQueueFullError past ``max_waiting``.

        ``nice`` > 0 makes it a background compile: it waits for one of the
        ``background_slots`` (never one of ``slots``), and its :func:`run_lowered` part runs
        at a CPU priority lowered by as much (where the platform lets a thread do so;
        elsewhere at normal priority)."""
        future: Future = Future()
        background = nice > 0
        with self._cv:
            waiting = self._waiting[background]
            if self.max_waiting is not None and waiting >= self.max_waiting:
                kind, slots = (("background ", self.background_slots) if background
                               else ("", self.slots))
                raise CompileQueueFullError(
                    f"{waiting} {kind}compiles already wait for one of {slots} {kind}compile "
                    "slots; retry later")
            self._waiting[background] += 1
            generation = self._generation
        threading.Thread(target=self._run, args=(job, future, generation, nice), name=name,
                         daemon=True).start()
        return future

    def abandon(self, future: Future) -> None:
        """The waiter of ``future`` gave up: give its slot to the next compile (bounded)."""
        with self._cv:
            holding = next((h for h in self._holding.values() if future in h), None)
            if holding is not None and len(self._abandoned) < self.max_abandoned:
                holding.discard(future)
                self._abandoned.add(future)
                self._cv.notify_all()  # (the waiters of both kinds share the condition)

    def close(self) -> None:
        """Cancel the compiles still waiting for a slot (their futures fail with a
        GrammarCompileError); running compiles finish. The pool stays usable."""
        with self._cv:
            self._generation += 1
            self._cv.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until no compile of this pool runs (abandoned ones included), at most
        ``timeout`` seconds (None: no bound); returns whether none runs. Compiles waiting for
        a slot are not waited for (:meth:`close` cancels them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cv:
            while self._holding[False] or self._holding[True] or self._abandoned:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
            return True

    def _run(self, job: Callable[[], object], future: Future, generation: int,
             nice: int) -> None:
        _job.nice = nice  # (what run_lowered() reads on this thread)
        background = nice > 0
        holding = self._holding[background]
        slots = self.background_slots if background else self.slots
        with self._cv:
            while len(holding) >= slots and generation == self._generation:
                self._cv.wait()
            self._waiting[background] -= 1
            if generation != self._generation:
                future.set_exception(GrammarCompileError(
                    "compile cancelled: the matcher factory was closed before it started"))
                return
            holding.add(future)
        try:
            result = job()
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            future.set_exception(e)
        else:
            future.set_result(result)
        finally:
            with self._cv:
                holding.discard(future)
                self._abandoned.discard(future)
                self._cv.notify_all()  # (a slot's waiter and wait_idle())


_POOLS: "weakref.WeakSet[CompilePool]" = weakref.WeakSet()


@atexit.register
def _end_compiles_at_exit() -> None:
    """Cancel the compiles that have not started and wait for the running ones (up to the
    longest ``exit_wait_s``), so that none is inside the backend when the interpreter
    finalizes (that aborts the process)."""
    pools = list(_POOLS)
    for pool in pools:
        pool.close()
    running = sum(pool.running + pool.abandoned for pool in pools)
    if not running:
        return
    wait_s = max(pool.exit_wait_s for pool in pools)
    logger.warning("capgraph: waiting up to %.0f s for %d grammar compile(s) still running "
                   "(a compile cannot be stopped, and one left running when the interpreter "
                   "exits aborts the process)", wait_s, running)
    deadline = time.monotonic() + wait_s
    for pool in pools:
        pool.wait_idle(max(0.0, deadline - time.monotonic()))
    left = sum(pool.running + pool.abandoned for pool in pools)
    if left:
        logger.warning("capgraph: %d grammar compile(s) still running after %.0f s; the "
                       "exit may abort (compile_isolation=\"process\" runs compiles in "
                       "processes that exit can stop)", left, wait_s)


_job = threading.local()  # .nice: the priority the compile job on this thread asked for


def in_background_job() -> bool:
    """Whether the calling thread runs a background compile job (submitted with ``nice`` > 0):
    what lets a worker pool under it keep workers of its own for them."""
    return getattr(_job, "nice", 0) > 0


def run_lowered(fn: Callable[[], T]) -> T:
    """``fn()`` at the lower priority the calling compile job was submitted with: on a thread
    of its own that lowers its nice value first (this thread waits for it, holding no GIL);
    called here, as is, for any other job or thread. For the GIL-free part of a compile
    (xgrammar's C++ compile), which also starts the backend's own compile threads from it."""
    nice = getattr(_job, "nice", 0)
    if nice <= 0:
        return fn()
    box: dict[str, Any] = {}

    def lowered() -> None:
        lower_thread_priority(nice)
        try:
            box["result"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised on the job's thread
            box["error"] = e

    thread = threading.Thread(target=lowered, name="capgraph-compile-background", daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]


def lower_thread_priority(nice: int) -> bool:
    """Raise the calling thread's nice value by ``nice`` (Linux, where a thread's nice value is
    its own; a thread cannot lower it again without privileges, so call this only on a thread
    that does nothing else afterwards). Returns whether it did."""
    get_id = getattr(threading, "get_native_id", None)
    if get_id is None or not hasattr(os, "setpriority") or not os.path.isdir("/proc/self/task"):
        return False
    try:
        tid = get_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
    except OSError:
        return False
    return True
