"""The grammar-engine contract: a rollback-able matcher and the factory that compiles guides.

A :class:`GrammarMatcher` is the per-sequence state machine (four methods). A
:class:`GrammarMatcherFactory` compiles guides (cached in memory and on disk, each bounded in
bytes, on a thread pool so compilation stays off the decode path) and creates matchers from
compiled guides.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import CompileQueueFullError, CompileTimeoutError, GrammarCompileError
from ..params import GuidedDecodingConfig, GuidedDecodingParams
from .._cache import cache_dir
from .cache import ByteLRUCache
from .compile_pool import BACKGROUND_NICE, CompilePool
from .disk_cache import FORMAT_VERSION, DiskCompileCache, Lookup, config_key, entry_key

__all__ = ["GrammarMatcher", "GrammarMatcherFactory", "CompiledGuide", "CompileHandle",
           "CompileStats", "whole_utf8_prefix"]

_log = logging.getLogger(__name__)
#: Keys a factory remembers as loading slower than they compile (not written again).
_MAX_SLOWER_KEYS = 10_000


class GrammarMatcher(ABC):
    """A grammar state machine that advances token by token and can roll back.

    The state only moves forward through :meth:`accept_token` and backward through
    :meth:`rollback`; filling a bitmask never changes it.
    """

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one token. Returns False (state unchanged) if the grammar rejects it."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a stop token counts as one)."""

    @abstractmethod
    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Write the tokens allowed next into row ``index`` of a CPU int32 bitmask (1 = allowed)."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the matcher has accepted a stop token; a terminated matcher masks nothing."""

    def forced_bytes(self, max_bytes: int) -> bytes:
        """At most ``max_bytes`` bytes that every continuation of the current state starts
        with (the text the grammar forces next), cut to whole UTF-8 characters; the state is
        unchanged. Empty where nothing is forced, the matcher is terminated, or the backend
        cannot tell (this default)."""
        return b""


def whole_utf8_prefix(data: bytes, max_bytes: int) -> bytes:
    """The longest prefix of ``data[:max_bytes]`` made of whole UTF-8 characters; empty
    where ``data`` starts inside a character (after a token that split one)."""
    if max_bytes <= 0 or not data or 0x80 <= data[0] < 0xC0:
        return b""
    cut = data[:max_bytes]
    # a character cut short at the end: back up to its lead byte and drop it
    i = len(cut) - 1
    while i > 0 and 0x80 <= cut[i] < 0xC0:
        i -= 1
    lead = cut[i]
    width = 1 if lead < 0x80 else 2 if lead < 0xE0 else 3 if lead < 0xF0 else 4
    return cut if i + width <= len(cut) else cut[:i]


@dataclass(frozen=True, slots=True)
class CompiledGuide:
    """A guide compiled by a backend, ready to create matchers from (shareable, immutable).

    ``backend`` names the engine that serves the guide; ``fallback_reason`` says why it is not
    the configured one (``json_unenforced_keywords="fallback"``), None where it is.
    """

    params: GuidedDecodingParams
    backend: str
    payload: Any  # xgrammar.CompiledGrammar, or llguidance's grammar text
    nbytes: int
    compile_s: float
    fallback_reason: str | None = None


@dataclass(slots=True)
class CompileStats:
    """Counters of a factory's compile cache (read them for monitoring and tests)."""

    compiled: int = 0  #: compiles actually run
    cache_hits: int = 0  #: requests served from the cache
    inflight_hits: int = 0  #: requests that joined a compile already running
    failures: int = 0  #: compiles that raised
    disk_hits: int = 0  #: guides loaded from the disk cache instead of compiled
    disk_misses: int = 0  #: guides looked up on disk and not found there
    disk_writes: int = 0  #: compiled guides written to the disk cache
    disk_rejected: int = 0  #: disk entries found damaged or unusable (deleted, recompiled)
    compile_s_total: float = 0.0
    compile_s: list[float] = field(default_factory=list)  #: per compile, bounded list

    def record(self, seconds: float) -> None:
        """Count one finished compile of ``seconds``."""
        self.compiled += 1
        self.compile_s_total += seconds
        if len(self.compile_s) < 100_000:
            self.compile_s.append(seconds)


class CompileHandle:
    """A compile in flight (or done): wait on it with a deadline relative to its start."""

    __slots__ = ("future", "started", "params", "_on_timeout", "_gave_up")

    def __init__(self, future: "Future[CompiledGuide]", params: GuidedDecodingParams,
                 on_timeout: Callable[[Future], None] | None = None) -> None:
        self.future = future
        self.started = time.monotonic()
        self.params = params
        self._on_timeout = on_timeout
        self._gave_up = False

    def done(self) -> bool:
        """True once the compile has finished (with a result or an error)."""
        return self.future.done()

    def give_up(self) -> None:
        """This handle's waiter stops waiting: counted once per handle; a compile no request
        waits for any more is stopped where the backend can stop it."""
        if self._on_timeout is not None and not self._gave_up:
            self._gave_up = True
            self._on_timeout(self.future)

    def result(self, timeout_s: float, *, backend: str, request_id: int | None = None
               ) -> CompiledGuide:
        """The compiled guide; waits at most until ``started + timeout_s``.

        Raises :class:`CompileTimeoutError` past the deadline and the compile's own
        :class:`GrammarCompileError` (with ``request_id`` filled in) if it failed.
        """
        remaining = self.started + timeout_s - time.monotonic()
        try:
            return self.future.result(timeout=max(remaining, 0.0))
        except FutureTimeout:
            self.give_up()
            raise CompileTimeoutError(
                f"compile did not finish within {timeout_s:g} s",
                guide_type=self.params.guide_type.name, backend=backend,
                request_id=request_id) from None
        except GrammarCompileError as e:
            if request_id is not None and e.request_id is None:
                raise type(e)(e.detail, guide_type=e.guide_type, backend=e.backend,
                              request_id=request_id) from e
            raise


class _Compile:
    """One compile in flight: its future, and how many of its waiters are still waiting."""

    __slots__ = ("future", "waiters", "timed_out")

    def __init__(self) -> None:
        self.future: Future[CompiledGuide] | None = None
        self.waiters = 0  # handles given out for it
        self.timed_out = 0  # of those, the ones whose wait timed out

    @property
    def wanted(self) -> bool:
        """Whether a request still waits for it (or none ever waited with a deadline)."""
        return self.waiters == 0 or self.timed_out < self.waiters


class GrammarMatcherFactory(ABC):
    """Compiles guides and creates matchers; one per decoder (TensorRT-LLM's name).

    A guide is looked up in a byte-bounded LRU cache in memory by ``(guide_type, guide)``,
    then, on the compile thread, in the disk cache (:mod:`capgraph.grammar.disk_cache`, for
    backends that can serialize their grammars: :attr:`disk_cacheable`), and compiled only
    where neither has it. Compiles run off the caller's thread (:meth:`compile_async`, at most
    ``compile_threads`` at once; see :mod:`capgraph.grammar.compile_pool`). Concurrent requests
    for the same guide share one compile; a compile whose waiter timed out gives its slot to
    the next one, and is written to disk only if a request still waits for it when it ends.
    """

    backend_name: str = "?"
    #: Whether this backend's compiled guides go to the disk cache (it implements
    #: :meth:`_disk_identity`, :meth:`_serialize`, :meth:`_deserialize` and
    #: :meth:`_serialized_bytes_estimate`).
    disk_cacheable: bool = False

    def __init__(self, config: GuidedDecodingConfig) -> None:
        self.config = config
        self.cache: ByteLRUCache[tuple[str, str], CompiledGuide] = ByteLRUCache(
            config.compile_cache_bytes)
        self.stats = CompileStats()
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, str], _Compile] = {}
        self._pool = CompilePool(config.compile_threads, exit_wait_s=config.compile_timeout_s)
        self._likely_allowed: tuple[int, ...] | None = None
        #: the on-disk cache of compiled guides (None: off, or a backend that cannot serialize)
        self.disk_cache: DiskCompileCache | None = None
        if self.disk_cacheable and config.compile_disk_cache_bytes > 0:
            self.disk_cache = DiskCompileCache(cache_dir("grammars"),
                                               config.compile_disk_cache_bytes)
        self._disk_prefix: list[str] | None = None  # the key parts every guide shares
        self._disk_slower: set[str] = set()  # keys that load slower than they compile

    # -- backend hooks -----------------------------------------------------------------------
    @abstractmethod
    def _compile(self, params: GuidedDecodingParams) -> tuple[Any, int]:
        """Compile synchronously; return ``(payload, nbytes)`` or raise GrammarCompileError."""

    @abstractmethod
    def create_from_compiled(self, compiled: CompiledGuide) -> GrammarMatcher:
        """A fresh matcher at the start of the grammar."""

    def _served_by(self, payload: Any) -> tuple[Any, str, str | None]:
        """``(payload, backend, fallback_reason)`` of what :meth:`_compile` returned; a factory
        that routes guides to several engines says here which one took this guide."""
        return payload, self.backend_name, None

    def _disk_identity(self) -> list[str]:
        """Disk-cache hook: what every compiled guide of this factory depends on besides the
        guide and :data:`~capgraph.grammar.disk_cache.KEY_FIELDS`: the backend's version, a
        digest of the vocabulary as the backend sees it and of the code that compiles
        (:func:`~capgraph.grammar.disk_cache.source_digest`). Called once, on a compile
        thread."""
        raise NotImplementedError

    def _serialize(self, compiled: CompiledGuide) -> str:
        """Disk-cache hook: ``compiled.payload`` as text (called on the writer thread)."""
        raise NotImplementedError

    def _deserialize(self, params: GuidedDecodingParams, text: str) -> tuple[Any, int]:
        """Disk-cache hook: ``(payload, nbytes)`` from what :meth:`_serialize` wrote."""
        raise NotImplementedError

    def _serialized_bytes_estimate(self, compiled: CompiledGuide) -> int | None:
        """Disk-cache hook: an upper estimate of ``len(self._serialize(compiled))``, found
        without serializing (called on the writer thread; the guide is serialized only where
        it fits :meth:`~capgraph.grammar.disk_cache.DiskCompileCache.text_budget`). None: no
        estimate, and the guide is not written (a serialization nothing bounds never starts).
        """
        return None

    # -- public API -------------------------------------------------------------------------
    def create(self, params: GuidedDecodingParams) -> GrammarMatcher:
        """Compile (or reuse) the guide and return a fresh matcher."""
        return self.create_from_compiled(self.compile(params))

    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        """Compile and wait (no timeout), through the cache; concurrent callers for the same
        guide share one compile."""
        return self.compile_async(params).future.result()

    def compile_async(self, params: GuidedDecodingParams, *,
                      background: bool = False) -> CompileHandle:
        """Start compiling on the factory's thread pool; returns at once.

        A cached guide comes back as an already-completed handle; a guide already being
        compiled joins that compile. ``background``: no request waits for this compile right
        now (a hand-over's xgrammar compile), so it runs at the lowest CPU priority
        (:data:`~capgraph.grammar.compile_pool.BACKGROUND_NICE`); a compile started in the
        background stays there when a later request joins it.
        """
        key = (params.guide_type.value, params.guide)
        with self._lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.stats.cache_hits += 1
                done: Future[CompiledGuide] = Future()
                done.set_result(hit)
                return CompileHandle(done, params)
            job = self._inflight.get(key)
            started = job is None
            if job is not None:
                self.stats.inflight_hits += 1
            else:
                job = _Compile()
                try:
                    job.future = self._pool.submit(
                        lambda: self._compile_and_store(key, params, job),
                        nice=BACKGROUND_NICE if background else 0)
                except CompileQueueFullError as e:
                    refused: Future[CompiledGuide] = Future()
                    refused.set_exception(CompileQueueFullError(
                        e.detail, guide_type=params.guide_type.name,
                        backend=self.backend_name))
                    return CompileHandle(refused, params)
                self._inflight[key] = job
            job.waiters += 1
            future = job.future
        assert future is not None
        if started:  # (outside the lock: a compile already done calls back at once)
            future.add_done_callback(lambda f: self._forget(key, job))
        return CompileHandle(future, params, lambda f: self._timed_out(key, job, f))

    def _timed_out(self, key: tuple[str, str], job: _Compile, future: Future) -> None:
        """A waiter of ``job`` gave up: count it and free the compile's slot; where no request
        waits for it any more, stop the compile if the backend can (:meth:`_stop_compile`)."""
        with self._lock:
            job.timed_out += 1
            if not job.wanted and self._stop_compile(key) and self._inflight.get(key) is job:
                del self._inflight[key]  # (a later request for it starts afresh)
        self._pool.abandon(future)

    def _stop_compile(self, key: tuple[str, str]) -> bool:
        """Backend hook: kill the running compile of ``key``, which no request waits for any
        more (called under the factory's lock: must not block). Returns whether it did; the
        default cannot (a compile on a thread runs to its end)."""
        return False

    def _still_wanted(self, key: tuple[str, str]) -> bool:
        """Whether a request still waits for the compile of ``key`` in flight (True where none
        is in flight). A backend that can stop compiles asks this once it can be stopped and
        before the costly work, so a compile whose waiters all gave up before
        :meth:`_stop_compile` could find it never starts (must not be called under a lock
        :meth:`_stop_compile` takes)."""
        with self._lock:
            job = self._inflight.get(key)
            return job is None or job.wanted

    def _forget(self, key: tuple[str, str], job: _Compile) -> None:
        with self._lock:  # done (stored, failed or cancelled): later requests start afresh
            if self._inflight.get(key) is job:
                del self._inflight[key]

    def likely_allowed_token_ids(self) -> Sequence[int]:
        """Token ids that most grammar states allow: the stop tokens, and for backends that
        know the vocabulary's bytes, every single-byte token.

        The decoder's dead-end guard looks at the bitmask words holding these ids first and
        scans a whole row only when none of them is set, so the answer affects speed only.
        Computed once per factory.
        """
        if self._likely_allowed is None:
            self._likely_allowed = tuple(sorted(set(self._likely_allowed_ids())))
        return self._likely_allowed

    def _likely_allowed_ids(self) -> Sequence[int]:
        """Backend hook for :meth:`likely_allowed_token_ids` (default: the stop tokens)."""
        return list(self.config.stop_token_ids or ())

    def batch_fill(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                   indices: Sequence[int]) -> None:
        """Fill ``bitmask[indices[i]]`` from ``matchers[i]`` for every i.

        Backends override this with a multi-threaded fill that releases the GIL.
        """
        for matcher, index in zip(matchers, indices):
            matcher.fill_next_token_bitmask(bitmask, index)

    def batch_accept(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]
                     ) -> list[bool | Exception]:
        """``matchers[i].accept_token(tokens[i])`` for every i, each called exactly once.

        Returns one result per matcher: its bool, or the exception it raised (one failing
        matcher neither stops the others nor gets retried). Backends may batch the calls.
        """
        results: list[bool | Exception] = []
        for m, t in zip(matchers, tokens):
            try:
                results.append(bool(m.accept_token(t)))
            except Exception as e:
                results.append(e)
        return results

    def close(self) -> None:
        """Cancel the compiles still waiting for a slot (they fail with GrammarCompileError);
        running compiles finish in the background. The factory stays usable."""
        self._pool.close()

    # -- internals --------------------------------------------------------------------------
    def _limits_backend(self, params: GuidedDecodingParams) -> str:
        """The backend whose syntax :func:`check_guide_limits` reads ``params`` in (a
        composite factory names the backend that will compile it)."""
        return self.backend_name

    def _compile_and_store(self, key: tuple[str, str], params: GuidedDecodingParams,
                           job: _Compile | None = None) -> CompiledGuide:
        start = time.perf_counter()
        disk_key = None
        with self._lock:
            if job is not None and not job.wanted:  # every waiter gave up while it queued
                raise CompileTimeoutError(
                    "compile not started: every request waiting for it had given up",
                    guide_type=params.guide_type.name, backend=self.backend_name)
        try:
            # bounded before any backend sees the guide (every factory comes through here;
            # imported here so that `python -m capgraph.grammar.guide_limits` runs the module
            # that no import of the package has loaded first)
            from .guide_limits import check_guide_limits
            check_guide_limits(params, self._limits_backend(params),
                               self.config.max_repetition_count)
            disk_key = self._disk_key(params)
            if disk_key is not None:
                loaded = self._load_from_disk(disk_key, params, start)
                if loaded is not None:
                    with self._lock:
                        self.cache.put(key, loaded, loaded.nbytes)
                    return loaded
            payload, nbytes = self._compile(params)
        except Exception as e:
            with self._lock:
                self.stats.failures += 1
            if isinstance(e, GrammarCompileError):
                raise
            # any other backend failure becomes a named error carrying the context
            raise GrammarCompileError(f"{type(e).__name__}: {e}",
                                      guide_type=params.guide_type.name,
                                      backend=self.backend_name) from e
        seconds = time.perf_counter() - start
        payload, backend, reason = self._served_by(payload)
        compiled = CompiledGuide(params, backend, payload, nbytes, seconds, reason)
        with self._lock:
            self.stats.record(seconds)
            # a compile every waiter of which timed out is not kept, in memory or on disk: its
            # requests failed (a request that joins it before it ends asks for it again)
            wanted = job is None or job.wanted
            if wanted:
                # cached before the future completes: a new request finds it in one place or
                # the other, never in neither
                self.cache.put(key, compiled, nbytes)
            to_disk = wanted and disk_key is not None and disk_key not in self._disk_slower
        disk = self.disk_cache
        if to_disk and disk is not None and disk_key is not None:
            disk.store_later(
                disk_key, seconds,
                lambda: (self._serialize(compiled),
                         {"backend": compiled.backend, "compile_s": seconds,
                          "fallback_reason": compiled.fallback_reason}),
                self._written, estimate=lambda: self._serialized_bytes_estimate(compiled))
        return compiled

    # -- disk cache ---------------------------------------------------------------------------
    def _disk_key_prefix(self) -> list[str] | None:
        """The disk-key parts every guide of this factory shares, computed once (a backend
        calls it at the end of its constructor, so no request pays for it); None where the
        disk cache is off, or the identity failed (logged, and the disk cache turned off)."""
        if self.disk_cache is None or self._disk_prefix is not None:
            return self._disk_prefix
        from .. import __version__
        try:
            prefix = [f"format={FORMAT_VERSION}", f"capgraph={__version__}",
                      f"config={config_key(self.config)}", *self._disk_identity()]
        except Exception as e:  # noqa: BLE001 - the disk cache never fails a request
            _log.warning("capgraph: compiled grammars are not cached on disk: the %s "
                         "factory's identity failed (%s: %s)", self.backend_name,
                         type(e).__name__, e)
            self.disk_cache = None
            return None
        self._disk_prefix = prefix
        return prefix

    def _disk_key(self, params: GuidedDecodingParams) -> str | None:
        """The disk-cache key of ``params`` under this factory (None: no disk cache)."""
        prefix = self._disk_key_prefix()
        if prefix is None:
            return None
        return entry_key([*prefix, params.guide_type.value, params.guide])

    def _load_from_disk(self, disk_key: str, params: GuidedDecodingParams, start: float
                        ) -> CompiledGuide | None:
        """The guide from the disk cache, or None (a miss, or a damaged entry, deleted)."""
        disk = self.disk_cache
        if disk is None:
            return None
        found, entry = disk.load(disk_key)
        if entry is not None:
            try:
                backend = entry.record["backend"]
                if backend != self.backend_name:  # (only a hand-made entry says otherwise)
                    raise ValueError(f"the entry names the backend {backend!r}")
                payload, nbytes = self._deserialize(params, entry.text)
                reason = entry.record.get("fallback_reason")
                compile_s = float(entry.record.get("compile_s", math.inf))
            except Exception as e:  # noqa: BLE001 - a backend that refuses the entry
                disk.reject(disk_key, f"{type(e).__name__}: {e}")
                found = Lookup.REJECTED
            else:
                load_s = time.perf_counter() - start
                if load_s > compile_s:  # served, but compiling is faster: not kept
                    disk.reject(disk_key, f"loaded in {load_s * 1e3:.1f} ms, compiled in "
                                          f"{compile_s * 1e3:.1f} ms")
                    with self._lock:
                        if len(self._disk_slower) >= _MAX_SLOWER_KEYS:
                            self._disk_slower.clear()
                        self._disk_slower.add(disk_key)
                with self._lock:
                    self.stats.disk_hits += 1
                return CompiledGuide(params, backend, payload, nbytes, load_s, reason)
        with self._lock:
            if found is Lookup.REJECTED:
                self.stats.disk_rejected += 1
            else:
                self.stats.disk_misses += 1
        return None

    def _written(self, written: bool) -> None:
        if written:
            with self._lock:
                self.stats.disk_writes += 1

    def __del__(self) -> None:  # best effort; pools also die with the interpreter
        try:
            self._close_collected()
        except Exception:
            pass

    def _close_collected(self) -> None:
        """What closes when the factory is collected: :meth:`close` (a factory built over
        other factories closes only its own pool: each of those closes itself when collected,
        and one shared with other users is not closed under them)."""
        self.close()
