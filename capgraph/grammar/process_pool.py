"""xgrammar compiles in worker processes that can be killed (``compile_isolation="process"``).

A compile thread of :class:`~capgraph.grammar.base.GrammarMatcherFactory` hands the guide to
an idle worker process and blocks until the worker sends back the compiled grammar as
``CompiledGrammar.serialize_json()`` text, or the error it raised. Workers are started with
the ``spawn`` context (never forked from a process that holds threads and locks), lazily, at
most ``workers`` of them for the compiles requests wait for and as many more for background
compiles (:func:`~capgraph.grammar.compile_pool.in_background_job`: a hand-over's xgrammar
compile), so a compile a request waits for never waits for a worker a background compile holds;
each builds its own
:class:`~capgraph.grammar.xgrammar_backend.XGrammarMatcherFactory` once and compiles with its
``_compile`` (keyword policy, converter warnings, repairs and limits all apply). A compile that
nobody waits for any more (:meth:`ProcessCompilePool.stop`) is killed: SIGTERM, then SIGKILL
after :data:`KILL_GRACE_S`; its worker is replaced on demand. A compile stopped before it
reached a worker (waiting for one, or for its worker to start) never runs; a worker started
for it finishes starting and serves the next compile, so a compile timeout shorter than a
worker's start (a few seconds: spawn, import, vocabulary) still lets later compiles through.
Each worker runs under ``RLIMIT_AS`` = its size once started + ``memory_limit_bytes``; a
compile over it fails with :class:`~capgraph.errors.CompileResourceError`; and at nice
:data:`WORKER_NICE` (a background compile's worker at
:data:`~capgraph.grammar.compile_pool.BACKGROUND_NICE`), so that its compile takes CPU time
only where the decode loop leaves some.

Guides :func:`~capgraph.grammar.compile_cost.why_not_cheap` calls cheap compile in the
decoder's process instead (:meth:`ProcessCompilePool.compiles_here`): a worker's round trip
(serialize, pipe, deserialize) costs them about as much as their compile.

A worker serializes a compiled grammar only where its estimated text
(:func:`~capgraph.grammar.disk_cache.serialized_bytes_estimate`) fits
:data:`~capgraph.grammar.disk_cache.MAX_SERIALIZED_BYTES`: xgrammar writes the whole FSM once per
rule, so a small guide of many rules that compiles in milliseconds would take GB and minutes to
send. Such a guide is compiled again in the decoder's process where the worker compiled it
within :data:`COMPILE_HERE_SHARE` of ``compile_timeout_s`` (:class:`CompileHere`); otherwise its
request fails with :class:`~capgraph.errors.CompileResourceError`.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Callable

from .. import errors
from ..errors import CompileResourceError, CompileTimeoutError, GrammarCompileError
from ..params import GuidedDecodingConfig, GuidedDecodingParams
from .compile_cost import why_not_cheap
from .compile_pool import BACKGROUND_NICE, in_background_job
from .disk_cache import MAX_SERIALIZED_BYTES, serialized_bytes_estimate

__all__ = ["ProcessCompilePool", "ProcessPoolStats", "CompileHere", "KILL_GRACE_S",
           "START_TIMEOUT_S", "WORKER_NICE", "COMPILE_HERE_SHARE"]

#: Seconds a stopped worker gets between SIGTERM and SIGKILL.
KILL_GRACE_S = 0.2
#: Seconds a new worker may take to import xgrammar and build its factory.
START_TIMEOUT_S = 120.0
#: How much a worker lowers its CPU priority (its nice value, Linux and macOS): below the
#: decode loop's threads, which keep the default 0, so a contended core goes to them first.
#: On an idle machine it costs a compile nothing (``python -m capgraph.grammar.compile_cost``).
WORKER_NICE = 10
#: A grammar too large to send back (see the module docstring) is compiled again in the
#: decoder's process where its compile in the worker took at most this share of
#: ``compile_timeout_s``.
COMPILE_HERE_SHARE = 0.25
_BACKEND = "xgrammar"
#: Errors a worker may send back by name (anything else arrives as GrammarCompileError).
_ERRORS = {cls.__name__: cls for cls in (GrammarCompileError, errors.UnsupportedGuideError,
                                         CompileTimeoutError, CompileResourceError)}


class CompileHere(Exception):
    """Raised by :meth:`ProcessCompilePool.compile`: the worker compiled the guide quickly but
    its serialized form would be too large to send (module docstring); compile it in this
    process instead. Not a request's error: the factory catches it."""

    def __init__(self, compile_s: float, estimate: int) -> None:
        super().__init__(f"compiled in {compile_s:.3f} s; its serialization would take about "
                         f"{estimate} bytes")
        self.compile_s = compile_s
        self.estimate = estimate


def _address_space_bytes() -> int | None:
    """This process's virtual size (Linux ``/proc``), or None where it cannot be read."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


def _limit_memory(limit_bytes: int) -> None:
    """``RLIMIT_AS`` = the address space held now + ``limit_bytes`` (just ``limit_bytes``
    where the current size cannot be read)."""
    import resource
    held = _address_space_bytes() or 0
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    soft = held + limit_bytes
    if hard != resource.RLIM_INFINITY:
        soft = min(soft, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _is_memory_error(e: BaseException) -> bool:
    seen: BaseException | None = e
    while seen is not None:
        if isinstance(seen, MemoryError) or "bad_alloc" in str(seen):
            return True
        seen = seen.__cause__
    return False


def _lower_priority(nice: int, target: int | None) -> int | None:
    """Give every thread of this process the nice value ``target`` where it has a lower one
    (None: this thread's + ``nice``, at most 19); returns ``target``. Linux keeps a nice value
    per thread (a new thread inherits its creator's), so every thread the spawn start and the
    imports made is reniced; where ``/proc`` is absent ``os.nice`` sets the process's."""
    if nice <= 0:
        return None
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except (OSError, ValueError):
        if target is None:
            try:
                os.nice(nice)
            except (OSError, AttributeError):
                pass
        return target
    if target is None:
        target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    for tid in tids:
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < target:
                os.setpriority(os.PRIO_PROCESS, tid, target)
        except OSError:  # (a thread that ended meanwhile)
            pass
    return target


def _worker_main(conn: Connection, config: GuidedDecodingConfig, memory_limit: int,
                 nice: int) -> None:
    """A worker's life: lower its priority, build the factory, then answer one compile
    request after another until the parent closes its end (or sends None)."""
    target = _lower_priority(nice, None)
    from .xgrammar_backend import XGrammarMatcherFactory
    factory = XGrammarMatcherFactory(config)
    _lower_priority(nice, target)  # (threads the factory started)
    if memory_limit:
        _limit_memory(memory_limit)
    conn.send(("ready", os.getpid()))
    while True:
        try:
            params = conn.recv()
        except (EOFError, OSError):
            return
        if params is None:
            return
        start = time.perf_counter()
        try:
            compiled, nbytes = factory._compile(params)
            compiled_at = time.perf_counter()
            estimate = serialized_bytes_estimate(nbytes, str(compiled.grammar).count("::="))
            if estimate > MAX_SERIALIZED_BYTES:
                reply: tuple = ("too_large", compiled_at - start, estimate)
            else:
                text = compiled.serialize_json()
                reply = ("ok", text, nbytes, compiled_at - start,
                         time.perf_counter() - compiled_at)
            del compiled
        except BaseException as e:  # noqa: BLE001 - sent to the parent by name and fields
            if _is_memory_error(e):
                reply = ("memory", f"{type(e).__name__}: {e}")
            elif isinstance(e, GrammarCompileError):
                reply = ("error", type(e).__name__, e.detail, e.guide_type, e.backend)
            else:
                reply = ("error", "GrammarCompileError", f"{type(e).__name__}: {e}",
                         params.guide_type.name, _BACKEND)
        conn.send(reply)


@dataclass(slots=True)
class ProcessPoolStats:
    """Counters of a :class:`ProcessCompilePool` (for monitoring, tests and benchmarks)."""

    spawned: int = 0  #: worker processes started
    compiled_here: int = 0  #: guides estimated cheap, compiled in the decoder's process
    too_large: int = 0  #: compiled grammars a worker did not send back (too large to serialize)
    killed: int = 0  #: workers stopped because nobody waited for their compile any more
    not_started: int = 0  #: compiles stopped before they reached a worker (never run)
    died: int = 0  #: workers that died while compiling (memory limit, crash)
    compile_s: list[float] = field(default_factory=list)  #: in-worker compile, per guide
    serialize_s: list[float] = field(default_factory=list)  #: in-worker serialize_json
    deserialize_s: list[float] = field(default_factory=list)  #: in the decoder's process

    def _add(self, name: str, seconds: float) -> None:
        values = getattr(self, name)
        if len(values) < 100_000:
            values.append(seconds)


class _Worker:
    __slots__ = ("process", "conn", "key", "stopped", "generation", "background")

    def __init__(self, process: Any, conn: Connection, generation: int,
                 background: bool) -> None:
        self.process = process
        self.conn = conn
        self.key: Any = None  # the guide it compiles now (None: idle)
        self.stopped = False
        self.generation = generation  # the pool's close count when it started
        self.background = background  # it serves background compiles only


class _Waiting:
    """A compile without a worker yet: waiting for one to be free, or for its own to start."""

    __slots__ = ("key", "stopped")

    def __init__(self, key: Any) -> None:
        self.key = key
        self.stopped = False  # nobody waits for it any more: it will not run


class ProcessCompilePool:
    """At most ``workers`` spawned processes compiling xgrammar guides, one guide at a time,
    and ``workers`` more for background compiles (module docstring).

    Args:
        config: the decoder's config; workers get a copy with the disk cache, the memory
            cache and process isolation off (it must pickle: a Hugging Face tokenizer does).
        workers: the most processes alive at once of each kind (``compile_threads``).
        memory_limit_bytes: address space a worker may add once started; 0: no limit.
        nice: how much each worker lowers its CPU priority (default :data:`WORKER_NICE`); a
            background compile's worker, at least :data:`BACKGROUND_NICE`.
        wanted: ``wanted(key)``: whether a request still waits for the compile of ``key``,
            asked once :meth:`stop` can find the compile and before it waits for a worker;
            where it says False, the compile never runs. Called without this pool's lock
            held; None: always wanted.
    """

    def __init__(self, config: GuidedDecodingConfig, workers: int,
                 memory_limit_bytes: int, nice: int = WORKER_NICE,
                 wanted: Callable[[Any], bool] | None = None) -> None:
        self.workers = workers
        self.memory_limit_bytes = memory_limit_bytes
        self.nice = nice
        self._wanted = wanted
        self.stats = ProcessPoolStats()
        # (replace() validates every field again: a config without stop tokens holds [],
        # which validation refuses; None, what it was given, means the same there)
        self._config = dataclasses.replace(config, compile_isolation="thread",
                                           compile_disk_cache_bytes=0, compile_cache_bytes=0,
                                           stop_token_ids=config.stop_token_ids or None)
        self._context = multiprocessing.get_context("spawn")
        self._cv = threading.Condition()
        self._idle: dict[bool, list[_Worker]] = {False: [], True: []}  # by kind (background)
        self._busy: list[_Worker] = []
        self._waiting: list[_Waiting] = []  # compiles in compile() without a worker yet
        self._starting = {False: 0, True: 0}  # slots reserved by workers being started
        self._closed_generation = 0  # close() calls so far: older workers retire when idle

    @property
    def pids(self) -> list[int]:
        """Process ids of the workers in service (not one being killed, which its compile
        thread reaps when it sees the pipe close)."""
        with self._cv:
            return [w.process.pid for w in (*self._idle[False], *self._idle[True], *self._busy)
                    if not w.stopped]

    def pid_compiling(self, key: Any) -> int | None:
        """The pid of the worker compiling ``key`` now, or None."""
        with self._cv:
            for w in self._busy:
                if w.key == key:
                    return w.process.pid
        return None

    def compiles_here(self, params: GuidedDecodingParams) -> bool:
        """Whether ``params`` is cheap enough to compile in the decoder's process
        (:func:`~capgraph.grammar.compile_cost.why_not_cheap`) rather than in a worker;
        counted in :attr:`ProcessPoolStats.compiled_here`."""
        if why_not_cheap(params, self._config) is not None:
            return False
        with self._cv:
            self.stats.compiled_here += 1
        return True

    def compile(self, key: Any, params: GuidedDecodingParams) -> tuple[str, int, float]:
        """Compile ``params`` in a worker (blocks, on a compile thread): ``(serialized
        grammar, nbytes, compile seconds)``, or raises the compile's GrammarCompileError,
        :class:`CompileResourceError` where the worker went over its memory limit or died,
        :class:`CompileTimeoutError` where :meth:`stop` killed it or stopped it before it
        reached a worker; :class:`CompileHere` where the grammar is too large to send back
        and compiled within :data:`COMPILE_HERE_SHARE` of the timeout, CompileResourceError
        where it is too large and slower. ``key`` names the compile for :meth:`stop`."""
        worker = self._acquire(key, params)
        try:
            worker.conn.send(params)
            reply = worker.conn.recv()
        except BaseException as e:
            self._discard(worker)
            if not isinstance(e, (EOFError, OSError)):
                raise  # (the worker's pipe state is unknown: it is not reused)
            if worker.stopped:
                raise CompileTimeoutError("compile killed: every request waiting for it "
                                          "timed out", guide_type=params.guide_type.name,
                                          backend=_BACKEND) from None
            with self._cv:
                self.stats.died += 1
            raise CompileResourceError(
                self._death_text(worker.process.exitcode), guide_type=params.guide_type.name,
                backend=_BACKEND) from None
        kind = reply[0]
        if kind == "memory":  # (its C++ state after the failed allocation is not trusted)
            self._discard(worker)
        else:
            self._release(worker)
        if kind == "ok":
            _, text, nbytes, compile_s, serialize_s = reply
            with self._cv:
                self.stats._add("compile_s", compile_s)
                self.stats._add("serialize_s", serialize_s)
            return text, nbytes, compile_s
        if kind == "too_large":
            _, compile_s, estimate = reply
            with self._cv:
                self.stats._add("compile_s", compile_s)
                self.stats.too_large += 1
            if compile_s <= COMPILE_HERE_SHARE * self._config.compile_timeout_s:
                raise CompileHere(compile_s, estimate)
            raise CompileResourceError(
                f"the compiled grammar would serialize to about {estimate} bytes (over "
                f"{MAX_SERIALIZED_BYTES}) to come back from its worker, and it took "
                f"{compile_s:.1f} s to compile there, too long to compile again in the "
                "decoder's process", guide_type=params.guide_type.name, backend=_BACKEND)
        if kind == "memory":
            raise CompileResourceError(
                f"the compile went over the worker's memory limit of {self._limit_text()} "
                f"(GuidedDecodingConfig.compile_memory_limit_bytes): {reply[1]}",
                guide_type=params.guide_type.name, backend=_BACKEND)
        _, name, detail, guide_type, backend = reply
        raise _ERRORS.get(name, GrammarCompileError)(detail, guide_type=guide_type,
                                                     backend=backend)

    def stop(self, key: Any) -> bool:
        """Nobody waits for the compile of ``key`` any more: kill the worker compiling it (its
        compile thread reaps it and its slot goes to the next compile), or, where it has no
        worker yet, make sure it never runs. Does not block. Returns whether one was found."""
        found = False
        with self._cv:
            for w in self._busy:
                if w.key == key and not w.stopped:
                    w.stopped = True
                    self.stats.killed += 1
                    w.process.terminate()
                    found = True
            for waiting in self._waiting:
                if waiting.key == key and not waiting.stopped:
                    waiting.stopped = True
                    found = True
            if found:
                self._cv.notify_all()
        return found

    def record_deserialize(self, seconds: float) -> None:
        """Add the time spent turning a worker's compiled grammar back into an object here."""
        with self._cv:
            self.stats._add("deserialize_s", seconds)

    def close(self) -> None:
        """Stop the idle workers; a busy one stops when its compile ends. A later compile
        starts new ones (the pool stays usable, as the factory does)."""
        with self._cv:
            self._closed_generation += 1
            idle = [*self._idle[False], *self._idle[True]]
            for kind in self._idle.values():
                kind.clear()
        for w in idle:
            try:
                w.conn.send(None)
            except OSError:
                pass
            self._reap(w)

    # -- internals ------------------------------------------------------------------------
    def _limit_text(self) -> str:
        if not self.memory_limit_bytes:
            return "none"
        return f"{self.memory_limit_bytes / (1 << 20):g} MiB"

    def _acquire(self, key: Any, params: GuidedDecodingParams) -> _Worker:
        """An idle worker, or a new one, of the calling compile's kind (background or not)
        for the compile of ``key``; raises :class:`CompileTimeoutError` where :meth:`stop`
        stopped it first."""
        background = in_background_job()
        idle = self._idle[background]
        waiting = _Waiting(key)
        with self._cv:
            self._waiting.append(waiting)
        # (its waiters may have given up before stop() could find it)
        gave_up = self._wanted is not None and not self._wanted(key)
        with self._cv:
            waiting.stopped = waiting.stopped or gave_up
            while not waiting.stopped and not idle and self._alive(background) >= self.workers:
                self._cv.wait()
            if waiting.stopped or idle:
                self._waiting.remove(waiting)
                if waiting.stopped:
                    self.stats.not_started += 1
                    raise self._not_started(params)
                return self._assign(idle.pop(), key)
            self._starting[background] += 1
        try:
            worker = self._start(background)
        except BaseException:
            with self._cv:
                self._starting[background] -= 1
                self._waiting.remove(waiting)
                self._cv.notify_all()
            raise
        with self._cv:  # (one step from waiting to busy: stop() always finds the compile)
            self._starting[background] -= 1
            self._waiting.remove(waiting)
            if not waiting.stopped:
                return self._assign(worker, key)
            # stopped while its worker started: the worker serves the next compile instead
            self.stats.not_started += 1
            keep = worker.generation == self._closed_generation
            if keep:
                idle.append(worker)
            self._cv.notify_all()
        if not keep:
            self._reap(worker)
        raise self._not_started(params)

    def _alive(self, background: bool) -> int:
        """Workers of one kind alive or starting (under the lock)."""
        busy = sum(1 for w in self._busy if w.background is background)
        return busy + len(self._idle[background]) + self._starting[background]

    def _assign(self, worker: _Worker, key: Any) -> _Worker:
        worker.key = key  # (under the lock)
        self._busy.append(worker)
        return worker

    @staticmethod
    def _not_started(params: GuidedDecodingParams) -> CompileTimeoutError:
        return CompileTimeoutError("compile not started: every request waiting for it timed "
                                   "out before a compile worker was free",
                                   guide_type=params.guide_type.name, backend=_BACKEND)

    def _start(self, background: bool) -> _Worker:
        parent, child = self._context.Pipe()
        nice = max(self.nice, BACKGROUND_NICE) if background else self.nice
        process = self._context.Process(
            target=_worker_main,
            args=(child, self._config, self.memory_limit_bytes, nice),
            name="capgraph-compile-worker", daemon=True)
        process.start()
        child.close()
        worker = _Worker(process, parent, self._closed_generation, background)
        try:
            if not parent.poll(START_TIMEOUT_S):
                raise TimeoutError(f"not ready after {START_TIMEOUT_S:g} s")
            parent.recv()
        except (EOFError, OSError, TimeoutError) as e:
            self._reap(worker)
            raise GrammarCompileError(
                f"a compile worker process did not start ({type(e).__name__}: {e}; exit "
                f"code {process.exitcode})", backend=_BACKEND) from None
        with self._cv:
            self.stats.spawned += 1
        return worker

    def _release(self, worker: _Worker) -> None:
        with self._cv:
            self._busy.remove(worker)
            worker.key = None
            if worker.stopped or worker.generation != self._closed_generation:
                # killed just after its result came in, or the pool was closed meanwhile
                self._cv.notify_all()
            else:
                self._idle[worker.background].append(worker)
                self._cv.notify_all()
                return
        self._reap(worker)

    def _death_text(self, exitcode: int | None) -> str:
        """Why a worker that died while compiling did: a crash (a signal other than
        SIGKILL: the backend faulted on this guide), or its memory (SIGKILL, what the
        kernel's out-of-memory killer sends, or an exit under the address-space limit)."""
        if exitcode is not None and exitcode < 0 and -exitcode != signal.SIGKILL:
            try:
                name = signal.Signals(-exitcode).name
            except ValueError:
                name = f"signal {-exitcode}"
            return (f"the compile worker crashed ({name}) while compiling this guide: the "
                    "backend faults on it; the worker is replaced and other guides compile "
                    "as before")
        return (f"the compile worker died (exit code {exitcode}) under a memory limit of "
                f"{self._limit_text()} (GuidedDecodingConfig.compile_memory_limit_bytes)")

    def _discard(self, worker: _Worker) -> None:
        with self._cv:
            if worker in self._busy:
                self._busy.remove(worker)
            self._cv.notify_all()
        self._reap(worker)

    @staticmethod
    def _reap(worker: _Worker) -> None:
        """SIGTERM, SIGKILL after the grace, and wait for the process to be gone."""
        process = worker.process
        if process.is_alive():
            process.terminate()
            process.join(KILL_GRACE_S)
            if process.is_alive():
                process.kill()
        process.join()
        worker.conn.close()
