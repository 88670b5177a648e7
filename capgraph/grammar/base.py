"""The grammar-engine contract: a rollback-able matcher and the factory that compiles guides.

A :class:`GrammarMatcher` is the per-sequence state machine (four methods). A
:class:`GrammarMatcherFactory` compiles guides (cached, bounded in bytes, optionally on a thread
pool so compilation stays off the decode path) and creates matchers from compiled guides.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..errors import CompileTimeoutError, GrammarCompileError
from ..params import GuidedDecodingConfig, GuidedDecodingParams
from .cache import ByteLRUCache
from .compile_pool import CompilePool
from .guide_limits import check_guide_limits

__all__ = ["GrammarMatcher", "GrammarMatcherFactory", "CompiledGuide", "CompileHandle",
           "CompileStats"]


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
    compile_s_total: float = 0.0
    compile_s: list[float] = field(default_factory=list)  #: per compile, bounded list

    def record(self, seconds: float) -> None:
        self.compiled += 1
        self.compile_s_total += seconds
        if len(self.compile_s) < 100_000:
            self.compile_s.append(seconds)


class CompileHandle:
    """A compile in flight (or done): wait on it with a deadline relative to its start."""

    __slots__ = ("future", "started", "params", "_on_timeout")

    def __init__(self, future: "Future[CompiledGuide]", params: GuidedDecodingParams,
                 on_timeout: Callable[[Future], None] | None = None) -> None:
        self.future = future
        self.started = time.monotonic()
        self.params = params
        self._on_timeout = on_timeout

    def done(self) -> bool:
        return self.future.done()

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
            if self._on_timeout is not None:  # free its slot for the compiles queued behind
                self._on_timeout(self.future)
            raise CompileTimeoutError(
                f"compile did not finish within {timeout_s:g} s",
                guide_type=self.params.guide_type.name, backend=backend,
                request_id=request_id) from None
        except GrammarCompileError as e:
            if request_id is not None and e.request_id is None:
                raise type(e)(e.detail, guide_type=e.guide_type, backend=e.backend,
                              request_id=request_id) from e
            raise


class GrammarMatcherFactory(ABC):
    """Compiles guides and creates matchers; one per decoder (TensorRT-LLM's name).

    Compilation is cached by ``(guide_type, guide)`` in a byte-bounded LRU cache and runs off
    the caller's thread (:meth:`compile_async`, at most ``compile_threads`` at once; see
    :mod:`capgraph.grammar.compile_pool`). Concurrent requests for the same guide share one
    compile; a compile whose waiter timed out gives its slot to the next one.
    """

    backend_name: str = "?"

    def __init__(self, config: GuidedDecodingConfig) -> None:
        self.config = config
        self.cache: ByteLRUCache[tuple[str, str], CompiledGuide] = ByteLRUCache(
            config.compile_cache_bytes)
        self.stats = CompileStats()
        self._lock = threading.Lock()
        self._inflight: dict[tuple[str, str], Future[CompiledGuide]] = {}
        self._pool = CompilePool(config.compile_threads)
        self._likely_allowed: tuple[int, ...] | None = None

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

    # -- public API -------------------------------------------------------------------------
    def create(self, params: GuidedDecodingParams) -> GrammarMatcher:
        """Compile (or reuse) the guide and return a fresh matcher."""
        return self.create_from_compiled(self.compile(params))

    def compile(self, params: GuidedDecodingParams) -> CompiledGuide:
        """Compile and wait (no timeout), through the cache; concurrent callers for the same
        guide share one compile."""
        return self.compile_async(params).future.result()

    def compile_async(self, params: GuidedDecodingParams) -> CompileHandle:
        """Start compiling on the factory's thread pool; returns at once.

        A cached guide comes back as an already-completed handle; a guide already being
        compiled joins that compile.
        """
        key = (params.guide_type.value, params.guide)
        with self._lock:
            hit = self.cache.get(key)
            if hit is not None:
                self.stats.cache_hits += 1
                done: Future[CompiledGuide] = Future()
                done.set_result(hit)
                return CompileHandle(done, params)
            running = self._inflight.get(key)
            if running is not None:
                self.stats.inflight_hits += 1
                return CompileHandle(running, params, self._pool.abandon)
            future = self._pool.submit(lambda: self._compile_and_store(key, params))
            self._inflight[key] = future
        future.add_done_callback(lambda f: self._forget(key, f))
        return CompileHandle(future, params, self._pool.abandon)

    def _forget(self, key: tuple[str, str], future: Future) -> None:
        with self._lock:  # done (stored, failed or cancelled): later requests start afresh
            if self._inflight.get(key) is future:
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

    def _compile_and_store(self, key: tuple[str, str], params: GuidedDecodingParams
                           ) -> CompiledGuide:
        start = time.perf_counter()
        try:
            # bounded before any backend sees the guide (every factory comes through here)
            check_guide_limits(params, self._limits_backend(params),
                               self.config.max_repetition_count)
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
            # cached before the future completes: a new request finds it in one place or the
            # other, never in neither
            self.stats.record(seconds)
            self.cache.put(key, compiled, nbytes)
        return compiled

    def __del__(self) -> None:  # best effort; pools also die with the interpreter
        try:
            self.close()
        except Exception:
            pass
