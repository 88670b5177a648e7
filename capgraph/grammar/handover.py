"""Fast start: a request starts on llguidance and is handed over to xgrammar once it compiled.

With ``GuidedDecodingConfig(backend="auto")``, :func:`~capgraph.grammar.create_matcher_factory`
returns a :class:`HandOverMatcherFactory` over an xgrammar and an llguidance factory.
llguidance compiles a guide in about a millisecond; xgrammar may take seconds, but fills a
mask several times faster once compiled. So:

- A regex or JSON-schema guide that xgrammar has not compiled yet (its memory cache; a disk
  entry loads in the background like a compile) is compiled by llguidance, and the compile
  handle completes as soon as llguidance has it; xgrammar's compile starts then, in the
  background: on compile slots (and, with ``compile_isolation="process"``, worker processes)
  of its own, so no compile a request waits for queues behind it
  (:mod:`capgraph.grammar.compile_pool`), and its C++ part at the lowest CPU priority (so it
  takes no CPU time from llguidance's compiles and first masks, or from the decode loop).
  Its matcher is a :class:`HandOverMatcher`.
- Every other guide goes to xgrammar alone: one xgrammar already compiled, a JSON guide
  (xgrammar's builtin grammar compiles at once), and the guide types whose text the two
  backends read differently or llguidance does not take (an EBNF guide is GBNF to xgrammar and
  Lark to llguidance; structural tags are xgrammar's).
- A JSON schema one backend refuses (its keyword policy,
  :mod:`capgraph.grammar.schema_policy`, or its compile error) is served by the other one
  alone, and refused only when both refuse it: there is no hand-over between backends that do
  not both enforce the schema.
- A regex is refused (the compile fails) where either backend refuses it as unsupported: the
  ECMA-262 syntax check (:func:`~capgraph.grammar.semantics.ecma_regex`) both run, and
  xgrammar's regex conversion, which runs once llguidance has compiled it, before the handle
  completes; only a compile that fails or times out later leaves a regex on llguidance.

The hand-over (:meth:`HandOverMatcher.serving`) happens at the start of a mask fill once the
xgrammar compile has landed: a fresh xgrammar matcher is fed every token the llguidance matcher
holds (committed tokens and draft tokens not rolled back yet alike), so it is in the same state
and any later rollback, of drafts accepted before or after the switch, rolls it back. A fill
reads the state without changing it and the replayed matcher holds the same tokens, so any fill
is a safe point, inside a draft walk too. If xgrammar refuses a token of
the replay, fails to compile the guide, or has not compiled it within ``compile_timeout_s``
(the compile is then given up, and stopped where the backend can), the request stays on
llguidance to its end; :attr:`HandOverMatcher.handover_failed_reason` says why.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from ..errors import TRANSIENT_COMPILE_ERRORS, GrammarCompileError, UnsupportedGuideError
from ..params import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from .base import CompiledGuide, CompileHandle, GrammarMatcher, GrammarMatcherFactory
from .fallback import _finding

__all__ = ["HandOverMatcher", "HandOverMatcherFactory", "HandOverGuide", "HANDOVER_GUIDES",
           "BACKEND"]

_log = logging.getLogger(__name__)

#: The backend name of a compiled guide whose requests start on llguidance and may be handed
#: over to xgrammar (``CompiledGuide.backend``), and of the factory.
BACKEND = "auto"
#: Guide types both backends read the same (docs/CONFORMANCE.md, capgraph.grammar.semantics).
HANDOVER_GUIDES = frozenset({GuideType.REGEX, GuideType.JSON_SCHEMA})


@dataclass(frozen=True, slots=True)
class HandOverGuide:
    """The payload of a guide served by a hand-over: llguidance's compiled guide, and the
    xgrammar compile still running (the handle the compile's request holds on it; the first
    matcher made from the guide takes it over, each later one joins the compile with a
    handle of its own: :meth:`handle`)."""

    llguidance: CompiledGuide
    xgrammar: CompileHandle
    # held once the first matcher took :attr:`xgrammar` (acquired, never released)
    _taken: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False,
                                               compare=False)

    def handle(self, join: Callable[[], CompileHandle]) -> CompileHandle:
        """A handle on the xgrammar compile for one more matcher: :attr:`xgrammar` the first
        time; later, the same one where the compile is over, else a new one from ``join``
        (the factory's ``compile_async``, which joins the compile in flight). Each matcher
        gives its own up when its request ends, so the compile is stopped only when no
        request waits for it (one handle shared by several requests would be given up by
        the first to end, for all of them)."""
        if self._taken.acquire(blocking=False) or self.xgrammar.done():
            return self.xgrammar
        return join()


class HandOverMatcher(GrammarMatcher):
    """An llguidance matcher until the xgrammar compile lands, then an xgrammar matcher fed
    the same tokens.

    Attributes:
        served_by: the backend whose matcher serves the request now (``"llguidance"`` or
            ``"xgrammar"``).
        handover_failed_reason: why the request stays on llguidance to its end (xgrammar
            refused a token of the replay, failed or timed out compiling), else None.
        handover_position: the number of tokens the xgrammar matcher was fed at the switch
            (None before it).

    Once it is settled (handed over, or staying on llguidance) it is a pure forwarder:
    :attr:`delegate` names the backend matcher every call goes to, so native code may drive
    that matcher directly; :meth:`on_delegate` tells a watcher when it settles.
    """

    __slots__ = ("_current", "_history", "_pending", "_xgrammar", "_timeout_s", "served_by",
                 "handover_failed_reason", "handover_position", "_abandon", "_watcher")

    def __init__(self, llguidance_matcher: GrammarMatcher, pending: CompileHandle,
                 xgrammar_factory: GrammarMatcherFactory, timeout_s: float) -> None:
        self._current = llguidance_matcher
        self._history: list[int] | None = []  # tokens the llguidance matcher holds now
        self._pending: CompileHandle | None = pending
        self._xgrammar = xgrammar_factory
        self._timeout_s = timeout_s
        self.served_by = "llguidance"
        self.handover_failed_reason: str | None = None
        self.handover_position: int | None = None
        # a request that ends (its matcher dropped) before the compile lands stops waiting
        # for it, so a compile nobody needs is stopped where the backend can stop it
        _start_give_ups()
        self._abandon = weakref.finalize(self, _abandon_pending, pending)
        self._watcher: Callable[[GrammarMatcher], None] | None = None

    @property
    def current(self) -> GrammarMatcher:
        """The backend matcher serving now (without looking for a hand-over)."""
        return self._current

    @property
    def delegate(self) -> GrammarMatcher | None:
        """The backend matcher this one forwards every call to, unchanged, once settled
        (xgrammar's after the hand-over, llguidance's once it stays there); None while a
        hand-over may still come (its fills look for it and its accepts are recorded)."""
        return self._current if self._pending is None else None

    def on_delegate(self, callback: Callable[[GrammarMatcher], None] | None) -> None:
        """Call ``callback(self)`` when :attr:`delegate` is set (once, at the fill that hands
        over or gives up); replaces an earlier callback, None removes it. The matcher keeps
        a reference to it (a callback that holds this matcher makes a reference cycle)."""
        self._watcher = callback

    def accept_token(self, token_id: int) -> bool:
        ok = self._current.accept_token(token_id)
        if ok and self._history is not None:
            self._history.append(token_id)
        return ok

    def rollback(self, num_tokens: int) -> None:
        self._current.rollback(num_tokens)  # (its error for a bad count; history unchanged)
        history = self._history
        if history is not None and num_tokens:
            del history[max(0, len(history) - num_tokens):]

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.serving().fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self._current.is_terminated()

    def forced_bytes(self, max_bytes: int) -> bytes:
        return self._current.forced_bytes(max_bytes)

    def sync_state(self) -> None:
        """Re-read the serving matcher's state after native code advanced it directly (the
        native host build, through :attr:`delegate`); a matcher without cached state has
        nothing to re-read."""
        sync = getattr(self._current, "sync_state", None)
        if sync is not None:
            sync()

    def serving(self) -> GrammarMatcher:
        """The matcher that fills this request's mask now: hands over to xgrammar first where
        its compile has landed (or gives up on it, past the compile timeout)."""
        pending = self._pending
        if pending is not None:
            if pending.done():
                self._hand_over(pending)
            elif time.monotonic() - pending.started > self._timeout_s:
                pending.give_up()
                self._stay(f"xgrammar did not compile the guide within {self._timeout_s:g} s")
        return self._current

    def _hand_over(self, pending: CompileHandle) -> None:
        error = pending.future.exception()
        if error is not None:
            self._stay(f"xgrammar did not compile the guide: {type(error).__name__}: {error}")
            return
        history = self._history or []
        try:
            matcher = self._xgrammar.create_from_compiled(pending.future.result())
            for k, token in enumerate(history):
                if not matcher.accept_token(token):
                    self._stay(f"xgrammar refused token {token} at position {k} of the "
                               f"{len(history)} tokens replayed")
                    return
        except Exception as e:  # noqa: BLE001 - a failed replay keeps the request on llguidance
            self._stay(f"replaying {len(history)} tokens into xgrammar failed: "
                       f"{type(e).__name__}: {e}")
            return
        self._current = matcher
        self.served_by = "xgrammar"
        self.handover_position = len(history)
        self._pending = None
        self._history = None
        self._abandon.detach()
        self._settled()

    def _stay(self, reason: str) -> None:
        self._abandon()  # (gives up a compile still running; nothing once it landed)
        self._pending = None
        self._history = None
        self.handover_failed_reason = reason
        _log.info("capgraph: request stays on llguidance: %s", reason)
        self._settled()

    def _settled(self) -> None:
        """Tell the watcher (:meth:`on_delegate`) that :attr:`delegate` is set now."""
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            watcher(self)


# Compiles whose request ended before they landed (its matcher collected). The finalizer that
# finds them runs wherever the garbage collector does: on a thread that holds the factory's
# lock, or one another thread waits for while holding it (``Thread.start`` in a compile's
# submit), so giving up there (which takes that lock) could deadlock the server. It only
# queues the handle (``SimpleQueue.put`` is safe in a finalizer); a daemon thread gives
# them up.
_GIVE_UPS: "queue.SimpleQueue[CompileHandle]" = queue.SimpleQueue()
_GIVE_UP_THREAD: list[threading.Thread] = []
_GIVE_UP_START = threading.Lock()


def _start_give_ups() -> None:
    """Start the thread that gives up queued compiles, once per process."""
    with _GIVE_UP_START:
        if not _GIVE_UP_THREAD or not _GIVE_UP_THREAD[0].is_alive():
            thread = threading.Thread(target=_give_ups, name="capgraph-give-ups", daemon=True)
            thread.start()
            _GIVE_UP_THREAD[:] = [thread]


def _give_ups() -> None:
    while True:
        handle = _GIVE_UPS.get()
        try:
            if not handle.done():
                handle.give_up()
        except Exception:  # noqa: BLE001 - one failed give-up must not stop the others
            _log.exception("capgraph: giving up an abandoned xgrammar compile failed")


def give_ups_pending() -> int:
    """How many abandoned compiles wait to be given up (for tests and diagnostics)."""
    return _GIVE_UPS.qsize()


def _abandon_pending(handle: CompileHandle) -> None:
    """A matcher's finalizer: queue its compile handle for :func:`_give_ups` (only that:
    see :data:`_GIVE_UPS`)."""
    _GIVE_UPS.put(handle)


class HandOverMatcherFactory(GrammarMatcherFactory):
    """Routes guides between an xgrammar and an llguidance factory (module docstring).

    Args:
        config: the ``backend="auto"`` config (its ``compile_timeout_s`` bounds how long a
            request waits for xgrammar before it stays on llguidance).
        xgrammar, llguidance: the two backends' factories, over the same tokenizer and stop
            token; both must refuse unenforced keywords.
    """

    backend_name = BACKEND

    def __init__(self, config: GuidedDecodingConfig, xgrammar: GrammarMatcherFactory,
                 llguidance: GrammarMatcherFactory) -> None:
        super().__init__(config)
        for f in (xgrammar, llguidance):
            if f.config.json_unenforced_keywords == "ignore":
                raise ValueError(f"the {f.backend_name} factory ignores unenforced keywords; "
                                 "a hand-over needs both to refuse them")
        self.xgrammar = xgrammar
        self.llguidance = llguidance
        self._by_backend = {xgrammar.backend_name: xgrammar,
                            llguidance.backend_name: llguidance}
        from .xgrammar_backend import XGrammarMatcher, refuse_unsupported_regex
        self._xgrammar_matcher = XGrammarMatcher
        self._refuse_regex = refuse_unsupported_regex

    # -- compile routing ----------------------------------------------------------------------
    def _compile(self, params: GuidedDecodingParams) -> tuple[Any, int]:  # pragma: no cover
        raise AssertionError("HandOverMatcherFactory compiles through its two backends")

    def xgrammar_ready(self, params: GuidedDecodingParams) -> bool:
        """Whether xgrammar has ``params``' guide compiled in its memory cache. (A disk entry
        does not count: it may be damaged or slow to load; the request starts on llguidance
        and hands over when xgrammar's load lands, which for a good entry is soon.)"""
        x = self.xgrammar
        with x._lock:
            return x.cache.get((params.guide_type.value, params.guide)) is not None

    def _start_xgrammar(self, params: GuidedDecodingParams) -> CompileHandle:
        """Start xgrammar's compile of ``params`` in the background (its own compile slots,
        lowest CPU priority: the request is served by llguidance meanwhile); a hook tests
        hold back."""
        return self.xgrammar.compile_async(params, background=True)

    def compile_async(self, params: GuidedDecodingParams, *,
                      background: bool = False) -> CompileHandle:
        """The compile of ``params``' guide; returns at once. The handle completes with
        llguidance's compile for a guide handed over later, else with xgrammar's (which runs
        in the background where a hand-over serves the request meanwhile, or where
        ``background`` asks for it)."""
        if params.guide_type not in HANDOVER_GUIDES or self.xgrammar_ready(params):
            return self.xgrammar.compile_async(params, background=background)
        # llguidance first, alone: xgrammar's compile (and the Python work of its conversion)
        # starts once llguidance has the guide, so it takes nothing from the time to first mask
        lhandle = self.llguidance.compile_async(params)
        handles = [lhandle]
        abandoned = threading.Event()  # the request gave up before llguidance landed
        out: Future[CompiledGuide] = Future()

        def xgrammar_alone(xf: Future, refused: BaseException) -> None:
            error = xf.exception()
            if error is None:
                reason = ("llguidance refused it: "
                          f"{_finding(refused) if isinstance(refused, GrammarCompileError) else refused}")
                _settle(out, result=dataclasses.replace(xf.result(), fallback_reason=reason))
            else:
                _settle(out, error=_both_refused(refused, error, params))

        def llguidance_done(lf: Future) -> None:
            if abandoned.is_set():  # nobody waits: start no xgrammar compile
                return
            refused = lf.exception()
            if refused is not None:  # xgrammar alone (a request waits for it), or neither
                xhandle = self.xgrammar.compile_async(params)
                handles.append(xhandle)
                xhandle.future.add_done_callback(lambda xf: xgrammar_alone(xf, refused))
                return
            if params.guide_type is GuideType.REGEX:
                # a regex xgrammar refuses as unsupported fails here, not on llguidance alone
                # (a compile that fails or times out later still leaves it there)
                try:
                    self._refuse_regex(params.guide)
                except UnsupportedGuideError as e:
                    _settle(out, error=e)
                    return
            xhandle = self._start_xgrammar(params)
            handles.append(xhandle)
            compiled = lf.result()
            _settle(out, result=CompiledGuide(params, BACKEND, HandOverGuide(compiled, xhandle),
                                              compiled.nbytes, compiled.compile_s))

        lhandle.future.add_done_callback(llguidance_done)

        def gave_up(_: Future) -> None:
            abandoned.set()
            for handle in list(handles):
                handle.give_up()

        return CompileHandle(out, params, gave_up)

    def create_from_compiled(self, compiled: CompiledGuide) -> GrammarMatcher:
        if compiled.backend == BACKEND:
            guide: HandOverGuide = compiled.payload
            return HandOverMatcher(
                self.llguidance.create_from_compiled(guide.llguidance),
                guide.handle(lambda: self._start_xgrammar(compiled.params)), self.xgrammar,
                self.config.compile_timeout_s)
        return self._by_backend[compiled.backend].create_from_compiled(compiled)

    # -- per-step calls -----------------------------------------------------------------------
    def batch_fill(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                   indices: Sequence[int]) -> None:
        """xgrammar's matchers (plain, and those handed over) in one xgrammar batch call; the
        others row by row."""
        xgr_type = self._xgrammar_matcher
        xs: list[GrammarMatcher] = []
        xrows: list[int] = []
        for m, i in zip(matchers, indices):
            if type(m) is HandOverMatcher:
                m = m.serving()
            if type(m) is xgr_type:
                xs.append(m)
                xrows.append(i)
            else:
                m.fill_next_token_bitmask(bitmask, i)
        if xs:
            self.xgrammar.batch_fill(xs, bitmask, xrows)

    def batch_accept(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]
                     ) -> list[bool | Exception]:
        # xgrammar's loop takes any matcher (others through their own accept_token)
        return self.xgrammar.batch_accept(matchers, tokens)

    def _likely_allowed_ids(self) -> Sequence[int]:
        return [*self.xgrammar.likely_allowed_token_ids(),
                *self.llguidance.likely_allowed_token_ids()]

    def close(self) -> None:
        super().close()
        self.xgrammar.close()
        self.llguidance.close()

    def _close_collected(self) -> None:
        GrammarMatcherFactory.close(self)  # (its own pool only)


def _settle(out: Future, *, result: Any = None, error: BaseException | None = None) -> None:
    """Complete ``out`` unless it already is (cancelled by its waiter)."""
    if not out.set_running_or_notify_cancel():
        return
    if error is not None:
        out.set_exception(error)
    else:
        out.set_result(result)


def _both_refused(first: BaseException, second: BaseException,
                  params: GuidedDecodingParams) -> GrammarCompileError:
    """The error of a guide neither backend takes (llguidance's refusal ``first``, xgrammar's
    ``second``)."""
    both_unsupported = isinstance(first, UnsupportedGuideError) and \
        isinstance(second, UnsupportedGuideError)
    # a failure that says nothing about the guide (xgrammar's queue was full, its worker
    # died) keeps its class: a later compile may succeed, so no cache may keep this one
    transient = [type(e) for e in (second, first) if isinstance(e, TRANSIENT_COMPILE_ERRORS)]
    error = transient[0] if transient else \
        UnsupportedGuideError if both_unsupported else GrammarCompileError

    def finding(e: BaseException) -> str:
        return _finding(e) if isinstance(e, GrammarCompileError) else f"{type(e).__name__}: {e}"

    return error(f"neither backend takes this guide: llguidance: {finding(first)} | "
                 f"xgrammar: {finding(second)}", guide_type=params.guide_type.name,
                 backend=BACKEND)
