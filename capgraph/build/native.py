"""The native host builds: the same loop as :mod:`capgraph.build.python`, in C++.

Two strategies, both for the xgrammar backend (or the auto one, which hands requests over to
xgrammar) with ``fill_threads=1``:

- :class:`NativeLoopBuild` (``"native-loop"``): :func:`~capgraph.build.python.select` in
  Python, then the advance-and-fill loop of every selected request in one C++ call
  (``csrc/builder.cc``), which calls xgrammar's own FFI methods with no Python in between.
- :class:`NativeBuild` (``"native"``): the library's CPython entry reads a steady-state batch
  of request objects (every guided request a target request generating, with plain values;
  each field read by its name in :data:`~capgraph.requests.NATIVE_RECORD_FIELDS`) and runs
  the whole step in one call, the GIL released while xgrammar works; it can also run that work on a
  thread of its own (:meth:`NativeBuild.begin`). Any other batch takes the native loop.

Neither builds draft trees: the CPython entry declines a batch holding a request with
``draft_parents`` (and its admission test leaves such a request to Python's), and the native
loop builds the chains of that batch while the tree requests take
:meth:`~capgraph.build.python.PythonBuild._fill_tree`.

Both fill a step of ``POOL_MIN_REQUESTS`` requests or more on several threads
(``GuidedDecodingConfig.native_fill_threads``; :meth:`NativeBuilder.set_fill_threads`), with
the same results as one thread.

Both report per request a status code (:class:`~capgraph.build.base.Status`) and counts;
a matcher that terminated in C++ re-reads its state here (``XGrammarMatcher.sync_state``).
A matcher that forwards to an ``XGrammarMatcher`` once settled (a request handed over from
llguidance, :class:`~capgraph.build.slots.Delegating`) is run through its delegate's FFI
object from then on, and re-reads its state through its own ``sync_state``; until then the
batch holding it fills in Python.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Collection, Iterable, Sequence

from ..errors import ConfigError
from ..grammar import GrammarMatcherFactory
from ..requests import GuidedRequests
from .library import (POOL_MIN_REQUESTS, STATUS_OVER_BUDGET, TERMINATED, FastPath,
                      NativeBuildError, NativeBuilder, automatic_fill_threads, matcher_methods,
                      matcher_rollback)
from .base import PLAIN, Outcome, Status, StepResult
from .python import Active, PythonBuild, fault
from .slots import SlotState

__all__ = ["NativeBuild", "NativeLoopBuild", "make_native_build", "xgrammar_factory"]


def xgrammar_factory(factory: GrammarMatcherFactory) -> Any:
    """The xgrammar factory inside ``factory`` (itself, the xgrammar side of a fallback
    factory, or the one a hand-over factory hands requests over to), or None."""
    from ..grammar.fallback import FallbackMatcherFactory
    from ..grammar.handover import HandOverMatcherFactory
    from ..grammar.xgrammar_backend import XGrammarMatcherFactory

    if isinstance(factory, XGrammarMatcherFactory):
        return factory
    if isinstance(factory, FallbackMatcherFactory):
        for side in (factory.primary, factory.secondary):
            if isinstance(side, XGrammarMatcherFactory):
                return side
    if isinstance(factory, HandOverMatcherFactory) and \
            isinstance(factory.xgrammar, XGrammarMatcherFactory):
        return factory.xgrammar
    return None


class NativeLoopBuild(PythonBuild):
    """Python selection, then the C++ loop for every selected request whose matcher is a plain
    ``XGrammarMatcher`` or forwards to one (a batch holding any other matcher fills in
    Python).

    Args:
        slots, factory, budget_ms: as for :class:`~capgraph.build.python.PythonBuild`.
        builder: the C++ loop bound to ``slots``' host buffers (:func:`make_native_build`).
    """

    name = "native-loop"

    def __init__(self, slots: SlotState, factory: GrammarMatcherFactory, budget_ms: float,
                 builder: NativeBuilder) -> None:
        super().__init__(slots, factory, budget_ms)
        self.builder = builder
        self._xgrammar = xgrammar_factory(factory)
        builder.set_budget_ms(self.budget_ms)

    def close(self) -> None:
        super().close()
        self.builder.close()  # (the fill threads)

    def _fill(self, act: Active, outcomes: list[Outcome], draft_len: int) -> None:
        handles = self._xgrammar.native_handles(act.matchers)
        if handles is None:  # some matcher must run its own methods
            super()._fill(act, outcomes, draft_len)
            return
        tokens = act.tokens
        if None in tokens:  # matchers created this step fill without advancing
            tokens = [-1 if t is None else t for t in tokens]
        if draft_len:
            num_drafts = [len(d) for d in act.drafts]
            flat = [t for d in act.drafts for t in d]
        else:
            num_drafts = flat = []
        # the token mask was cleared by run(): the step clears no rows
        unusual = self.builder.step(handles, tokens, act.offsets, num_drafts, flat,
                                    draft_len, 0)
        out = self.builder.out[:len(handles)].tolist()
        state = self.slots
        advanced, guided = state.num_advanced_tokens, state.num_guided_tokens
        for slot, (_, a, g) in zip(act.slots, out):
            advanced[slot] += a
            if g:
                guided[slot] += g
                self._masked = True
        if unusual:
            errors = iter(self.builder.errors())
            self._statuses(((act.index[k], act.slots[k], status,
                             next(errors) if status & ~TERMINATED in _WITH_MESSAGE else None)
                            for k, (status, _, _) in enumerate(out) if status), outcomes)

    def _statuses(self, reported: Iterable[tuple[int, int, int, str | None]],
                  outcomes: list[Outcome], others: Collection[int] = ()) -> None:
        """Outcomes of the C++ statuses ``(batch index, slot, status, message)``: a terminated
        matcher re-reads its state (inside the per-request isolation); the other statuses
        are :class:`Status` codes (an over-budget message holds the milliseconds measured).
        ``others``: batch indices whose slot another request holds by now (a native node's
        step read late): their slot's matcher and counters are left alone."""
        matchers = self.slots.matchers
        for i, slot, status, message in reported:
            if status & TERMINATED:
                status &= ~TERMINATED
                if i not in others:
                    try:
                        matchers[slot].sync_state()  # type: ignore[union-attr]
                    except Exception as e:
                        outcomes.append(fault(i, e))
                        continue
            if status == STATUS_OVER_BUDGET:
                if i not in others:
                    self.slots.num_advanced_tokens[slot] = self.slots.num_guided_tokens[slot] = 0
                outcomes.append((i, Status.OVER_BUDGET, float(message or "nan")))
            elif status == Status.FAULT:
                outcomes.append((i, Status.FAULT, message or "native build fault"))
            elif status:
                outcomes.append((i, Status(status), None))


# the C++ statuses that come with an errors() entry: a fault's message, the ms over budget
_WITH_MESSAGE = (Status.FAULT, STATUS_OVER_BUDGET)


class NativeBuild(NativeLoopBuild):
    """The whole steady-state step in one call of the C++ library's CPython entry
    (:class:`~capgraph.build.library.FastPath`); any other batch takes the native loop.

    :meth:`begin` hands the step's xgrammar work to the entry's own thread, which never takes
    the GIL and runs at the lowest priority, and returns at once; :meth:`finish` waits for it.
    """

    name = "native"
    asynchronous = True

    def __init__(self, slots: SlotState, factory: GrammarMatcherFactory, budget_ms: float,
                 builder: NativeBuilder, entry: FastPath, rollback: Any = None) -> None:
        super().__init__(slots, factory, budget_ms, builder)
        self.entry = entry
        #: xgrammar's matcher rollback as a tvm-ffi Function (what the native host node's
        #: rollback calls), or None where this xgrammar has none
        self.rollback = rollback
        self._inflight: Any = None  # the batch begin() took
        # HostBuild.admit: the entry's test bound to its state (add_batch runs no Python frame
        # for it)
        self.admit = functools.partial(entry.admit, entry.state)  # type: ignore[method-assign]

    def run(self, requests: GuidedRequests, clear_rows: int) -> StepResult:
        entry = self.entry
        result = entry.step(entry.state, requests.requests, requests.offsets,
                            requests.max_num_draft_tokens, clear_rows)
        if result is None:  # not the steady state: nothing was touched
            return super().run(requests, clear_rows)
        if result[1] is None:  # (every request plainly OK: no further call)
            return PLAIN[result[0]]
        return self._entry_result(requests.requests, result)

    def begin(self, requests: GuidedRequests, clear_rows: int) -> bool:
        entry = self.entry
        if entry.begin(entry.state, requests.requests, requests.offsets,
                       requests.max_num_draft_tokens, clear_rows):
            self._inflight = requests.requests
            return True
        return False

    @property
    def in_flight(self) -> bool:
        return self._inflight is not None

    def finish(self) -> StepResult:
        requests, self._inflight = self._inflight, None
        if requests is None:
            return super().finish()
        return self._entry_result(requests, self.entry.end(self.entry.state))

    def close(self) -> None:
        try:
            if self._inflight is not None:
                self.finish()  # (its outcomes go unread: close() is the strategy's end)
        finally:
            try:
                self.entry.close(self.entry.state)
            finally:
                super().close()

    def _entry_result(self, requests: Sequence, result: tuple) -> StepResult:
        masked, unusual = result
        if unusual is None:
            return PLAIN[masked]
        outcomes: list[Outcome] = []
        self._statuses(((i, requests[i].seq_slot, status, message)
                        for i, status, message in unusual), outcomes)
        return StepResult(outcomes, masked)


def native_handle_of(matcher_type: type) -> Callable[[Any], int | bool | None]:
    """What the CPython entry runs for a matcher (:class:`~capgraph.build.slots.SlotMatchers`
    keeps it per slot): None for no matcher, the address of the FFI object of an exact
    ``matcher_type`` instance (``ffi_address``) or of a settled
    :class:`~capgraph.build.slots.Delegating` matcher's delegate of that type, False for any
    other matcher (a subclass or wrapper must run its own methods) or one without an FFI
    object."""

    def handle_of(matcher: Any) -> int | bool | None:
        if matcher is None:
            return None
        if type(matcher) is not matcher_type:
            matcher = getattr(matcher, "delegate", None)
            if type(matcher) is not matcher_type:
                return False
        return getattr(matcher, "ffi_address", 0) or False

    return handle_of


def make_native_build(slots: SlotState, factory: GrammarMatcherFactory, budget_ms: float = 0.0,
                      *, entry: bool = True, methods: Sequence[Any] | None = None
                      ) -> NativeLoopBuild:
    """A native strategy for ``slots``: :class:`NativeBuild` where the library has its CPython
    entry and ``entry`` is True, else :class:`NativeLoopBuild`.

    ``methods``: the ``(accept_token, fill_next_token_bitmask, is_terminated)`` callables the
    C++ loop calls (default: xgrammar's own FFI methods); tests hand in wrapped ones.

    Raises:
        ConfigError: the factory has no xgrammar side (:func:`xgrammar_factory`) or its
            ``fill_threads`` is not 1.
        NativeBuildError: the library cannot be built or refuses the buffers.
    """
    xgr_factory = xgrammar_factory(factory)
    if xgr_factory is None or factory.config.fill_threads != 1:
        raise ConfigError(f"the native host build needs the xgrammar backend with "
                          f"fill_threads=1 (backend={factory.backend_name!r}, "
                          f"fill_threads={factory.config.fill_threads})")
    if methods is None:
        methods = matcher_methods(xgr_factory.ffi_matcher_type())
    builder = NativeBuilder(methods, slots.bitmask, slots.token_mask, slots.max_num_sequences,
                            sorted(slots.stop_ids), slots.full_words, slots.tail_mask,
                            slots.tail)
    tables = getattr(xgr_factory, "utf8", None)
    if tables is not None:  # (the matchers' UTF-8 guards: capgraph.grammar.utf8)
        builder.set_utf8(tables)
    threads = factory.config.native_fill_threads or automatic_fill_threads()
    builder.set_fill_threads(threads, POOL_MIN_REQUESTS)
    fast = None
    if entry:
        slots.matchers.track(native_handle_of(xgr_factory.matcher_type()))
        fast = builder.bind_fast(slots.matchers.handles, slots.is_draft_terminated,
                                 slots.num_advanced_tokens, slots.num_guided_tokens,
                                 slots.vocab_size_padded, slots.max_num_draft_tokens)
    if fast is None:
        return NativeLoopBuild(slots, factory, budget_ms, builder)
    try:
        rollback = matcher_rollback(xgr_factory.ffi_matcher_type())
    except NativeBuildError:
        rollback = None  # (the host node then declines: capgraph.capturable)
    return NativeBuild(slots, factory, budget_ms, builder, fast, rollback)

