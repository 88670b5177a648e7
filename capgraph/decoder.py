"""GuidedDecoder: one guided step, eagerly — build masks on the host, copy, apply to logits.

Per step the engine calls :meth:`GuidedDecoder.add_batch` with request snapshots and then
:meth:`GuidedDecoder.execute` with the logits (one row per layout row, see
:mod:`capgraph.requests`). With speculative decoding it also calls
:meth:`~GuidedDecoder.rollback_rejected_tokens` after verification and
:meth:`~GuidedDecoder.rollback_draft_tokens` after a drafting loop.

Failures are per request: ``execute`` returns ``[(request_id, message)]`` and the failing
request's rows are left unmasked; the other rows are masked exactly as without it.

The host work of a step (create matchers, advance them, fill rows) is a strategy
(:mod:`capgraph.build`), chosen at construction; the decoder checks and admits requests,
runs the strategy, interprets its outcomes (:meth:`GuidedDecoder._interpret`), copies and
applies the masks, and rolls back.
"""

from __future__ import annotations

import numbers
import threading
import time
from concurrent.futures import wait as wait_futures
from threading import get_ident
from functools import update_wrapper
from typing import Any, Callable, Collection, NoReturn, Sequence, TypeVar, cast

import numpy as np
import torch

from ._nvtx import nvtx_range
from .admission import Admission
from .bitmask import bitmask_dtype, token_mask_dtype, vocab_shard
from .build import HostBuild, HostBuildChoice, Outcome, SlotState, Status
from .build.slots import SlotMatchers
from .build import make_host_build
from .errors import (BudgetExceededError, ConfigError, DeadEndError, DecoderClosedError,
                     LayoutError, QueueEpochError, RequestError)
from .grammar.utf8 import RING
from .grammar import (CompileHandle, ForcedTokenEncoder, GrammarMatcher, GrammarMatcherFactory,
                      create_matcher_factory)
from .ops import logits_bitmask
from .ops.argmax import argmax_out, argmax_scratch, full_vocabulary, masked_argmax
from .ops.cpu_mask import cpu_apply
from .ops.op import _FLOAT_DTYPES, _cuda_kernel
from .params import GuidedDecodingConfig
from .requests import GuidedRequest, GuidedRequests, as_int
from .streams import CudaStepStreams, StepStreams
from .tensor_checks import LogitsChecks

__all__ = ["GuidedDecoder", "FailedRequest", "MAX_DRAFT_TOKENS"]

#: The largest ``max_num_draft_tokens``: a step rolls back at most its drafts and one token
#: more, which an xgrammar matcher's UTF-8 guard must still hold (capgraph.grammar.utf8.RING).
MAX_DRAFT_TOKENS = RING - 2

FailedRequest = tuple[int, str]  # (request_id, message)


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _open_only(method: _Method) -> _Method:
    """A step method refused with ``DecoderClosedError`` (naming it, before it reads or
    changes anything) once ``close()`` has begun; while it runs its thread is listed in
    ``_in_step``, so that ``close()`` waits for it. The thread is listed before ``_closed``
    is read: close() sets ``_closed`` first, then waits for the list (both under the GIL)."""
    name = method.__name__

    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        me = get_ident()
        self._in_step.append(me)
        try:
            if self._closed:
                self._refuse_closed(name)
            return method(self, *args, **kwargs)
        finally:
            self._in_step.remove(me)
    update_wrapper(guarded, method)
    del guarded.__wrapped__  # type: ignore[attr-defined]  # (__wrapped__ marks NVTX ranges)
    return cast(_Method, guarded)


#: The config fields that decide what a factory's matchers allow: a shared factory must agree
#: with the decoder's config on each (the others: how compiles run, how the decoder builds).
FACTORY_MASK_FIELDS = ("tokenizer", "encoded_vocab", "tokenizer_vocab_size",
                       "vocab_size_padded", "stop_token_ids", "backend", "json_whitespace",
                       "json_max_whitespace", "json_unenforced_keywords",
                       "max_repetition_count")


def _check_factory_config(config: GuidedDecodingConfig, theirs: GuidedDecodingConfig) -> None:
    """Refuse a shared factory whose config reads guides or tokens otherwise than
    ``config`` (the masks would be another vocabulary's, or another policy's)."""
    if theirs is config:
        return
    for name in FACTORY_MASK_FIELDS:
        mine, other = getattr(config, name), getattr(theirs, name)
        same = _same_tokenizer(mine, other) if name == "tokenizer" else mine == other
        if not same:
            shown = (lambda v: f"<{type(v).__name__} at {id(v):#x}>") if name == "tokenizer" \
                else (lambda v: repr(v) if len(repr(v)) < 80 else repr(v)[:77] + "...")
            raise ConfigError(
                f"factory's config differs from the decoder's config in {name} "
                f"({shown(other)} vs {shown(mine)}): its masks would not be this config's; "
                "build the decoder from factory.config, or pass no factory")


def _same_tokenizer(mine: Any, other: Any) -> bool:
    """The same tokenizer object, or one with the same vocabulary (a copy, an unpickled one)."""
    if mine is other:
        return True
    if mine is None or other is None:
        return False
    try:
        return len(mine) == len(other) and mine.get_vocab() == other.get_vocab()
    except Exception:  # noqa: BLE001 - what cannot be compared is not the same
        return False


class GuidedDecoder:
    """Advances one grammar matcher per sequence slot and masks logits in place.

    Args:
        config: grammar backend, vocabulary, stop tokens, compile cache and timeout.
        max_num_sequences: number of sequence slots (the largest batch).
        max_num_draft_tokens: the largest draft length (0 without speculative decoding), at
            most :data:`MAX_DRAFT_TOKENS` (1014).
        vocab_size_padded: width of full logits rows; defaults to ``config.vocab_size_padded``
            and must equal it.
        device: where logits live. On CUDA, masks are copied on a side stream ordered by two
            events, and the constructor loads the mask kernel (compiled through NVRTC on the
            machine's first use, then read from the disk cache) so that no step compiles; on
            CPU the device buffers are the host buffers (no copy).
        rank: this process's rank inside the tensor-parallel group (not the global rank),
            used when the logits are a vocab shard.
        factory: an existing matcher factory to share (its config must match); built from
            ``config`` otherwise.
        host_build: the host build strategy (:mod:`capgraph.build`): ``"auto"`` (default:
            the C++ build where it builds, following ``config.native_build``), ``"python"``,
            ``"native-loop"``, ``"native"``, or a callable ``(slots, factory, budget_ms) ->
            HostBuild``. The strategies give the same results.

    Buffers are allocated once: the bitmask ``[max_num_sequences * (max_num_draft_tokens + 1),
    ceil(V / 32)]`` int32 and a per-row int32 ``token_mask``, each with a host twin (pinned
    where CUDA exists).

    Protected interface (for subclasses, as :class:`~capgraph.CapturableGuidedDecoder` uses
    it): :meth:`_add_batch`, :meth:`_build`, :meth:`_finish_build`, :meth:`_drop_slots`,
    :meth:`_rollback_rejected_tokens`, :meth:`_rollback_draft_tokens`,
    :meth:`_init_disagg_gen_requests`, :meth:`_fail_batch`, :meth:`_record_failed`,
    :meth:`_clear_token_mask`, :meth:`_check_logits`, :meth:`_require_batch`; the attributes
    ``slots`` (:class:`~capgraph.build.SlotState`), ``host_build`` (the strategy) and, on
    CUDA, ``_streams`` (the side stream and events, :mod:`capgraph.streams`, which a subclass
    may replace).
    """

    bitmask_dtype = bitmask_dtype
    token_mask_dtype = token_mask_dtype

    def __init__(self, config: GuidedDecodingConfig, max_num_sequences: int,
                 max_num_draft_tokens: int = 0, vocab_size_padded: int | None = None,
                 device: torch.device | str = "cpu", rank: int = 0,
                 factory: GrammarMatcherFactory | None = None,
                 host_build: HostBuildChoice = "auto") -> None:
        if not isinstance(config, GuidedDecodingConfig):
            raise ConfigError(f"config must be a GuidedDecodingConfig, got {type(config).__name__}")
        _constructor_int("max_num_sequences", max_num_sequences, 1)
        _constructor_int("max_num_draft_tokens", max_num_draft_tokens, 0)
        if max_num_draft_tokens > MAX_DRAFT_TOKENS:
            raise ConfigError(f"max_num_draft_tokens={max_num_draft_tokens} exceeds "
                              f"{MAX_DRAFT_TOKENS}: a rollback of a step's drafts would go past "
                              "the history an xgrammar matcher's UTF-8 guard keeps "
                              "(capgraph.grammar.utf8.RING)")
        V = config.vocab_size_padded if vocab_size_padded is None else vocab_size_padded
        if type(V) is not int or V != config.vocab_size_padded:
            raise ConfigError(f"vocab_size_padded={V!r} differs from the config's "
                              f"vocab_size_padded={config.vocab_size_padded}")
        _constructor_int("rank", rank, 0)
        if factory is not None and not isinstance(factory, GrammarMatcherFactory):
            raise ConfigError(f"factory must be a GrammarMatcherFactory or None, got "
                              f"{type(factory).__name__}")
        if factory is not None:
            _check_factory_config(config, factory.config)
        self.config = config
        self.max_num_sequences = max_num_sequences
        self.max_num_draft_tokens = max_num_draft_tokens
        self.vocab_size_padded: int = V
        self.rank = rank
        self.device = checked_device(device)
        self._owns_factory = factory is None  # a shared factory is closed by its owner
        self.grammar_matcher_factory = factory or create_matcher_factory(config)
        self.backend = self.grammar_matcher_factory.backend_name

        #: matchers, counters and host buffers, per slot (capgraph.build.SlotState)
        self.slots = slots = SlotState(
            max_num_sequences, max_num_draft_tokens, V, config.tokenizer_vocab_size,
            config.stop_token_ids or (), self.grammar_matcher_factory.likely_allowed_token_ids())
        self.is_draft_terminated = slots.is_draft_terminated
        slots.create_matcher = self._create_matcher
        self.bitmask_size = slots.words
        self.bitmask_host, self.token_mask_host = slots.bitmask, slots.token_mask
        if self.device.type == "cpu":
            self.bitmask, self.token_mask = self.bitmask_host, self.token_mask_host
        else:
            self.bitmask = torch.zeros_like(self.bitmask_host, device=self.device)
            self.token_mask = torch.zeros_like(self.token_mask_host, device=self.device)
            # the side stream and its two events (capgraph.streams), shared by both decoders
            self._streams: StepStreams = CudaStepStreams(self.device)
            self.stream = self._streams.stream
            self.token_event = self._streams.token_event
            self.bitmask_event = self._streams.bitmask_event
            # what a first step must not do inside a graph capture: compile or load the mask
            # kernel (once per machine, then cached on disk)
            with torch.cuda.device(self.device):
                _cuda_kernel()
        self._admission = Admission(max_num_sequences, V, max_num_draft_tokens)
        self._tensors = LogitsChecks(self.device, V, slots.words, rank,
                                     self.bitmask_host.shape[0])
        self.requests: GuidedRequests | None = None
        self._batch_built = False  # the eager execute/build of the latest add_batch has run
        self._pending_compiles: dict[int, CompileHandle] = {}
        self._failed: list[FailedRequest] = []
        # the latest batch and the failures of its requests whose slot was released before
        # it was built (recorded when it is built: release)
        self._released: tuple[GuidedRequests, list[FailedRequest]] | None = None
        self._failed_lock = threading.Lock()  # callbacks record failures from other threads
        #: close() was called: every step method refuses (DecoderClosedError)
        self._closed = False
        # the idents of the threads inside a step method (close() waits for the others'): a
        # list, as append and remove are atomic under the GIL and cost less than a lock
        self._in_step: list[int] = []
        self._close_lock = threading.Lock()  # (two close() calls at once: one does the work)
        self._masked_rows = False  # the last build set some token_mask entry
        self._forced_encoder: ForcedTokenEncoder | None = None
        #: the host build strategy (capgraph.build), chosen once
        self.host_build: HostBuild = make_host_build(
            host_build, slots, self.grammar_matcher_factory,
            float(config.host_step_budget_ms or 0.0), config.native_build)
        self._inflight: GuidedRequests | None = None  # the batch host_build.begin() took
        # _finish_build's callers wait for one another: a release callback and the step's
        # apply may both finish one build (the second must not apply a mask still being built)
        self._finish_lock = threading.RLock()
        self._finishing = 0  # (counted up before _inflight is taken, down once it is done)
        # the batch of a drafting loop (its draft batch; for the capturable decoder's native
        # loops, the loop's target batch: the same slots) whose advances no rollback of draft
        # tokens has undone yet: the next target build or rollback of rejected tokens undoes
        # them first
        self._open_draft: GuidedRequests | None = None
        # per slot a draft step of the open loop built, the request it held there: a loop's
        # batches need not hold the same slots (a drafter stops), and its end undoes them all
        self._draft_slots: dict[int, GuidedRequest] = {}
        # the slots whose latest target build advanced draft tokens that no rollback of
        # rejected tokens has settled yet: the next target build settles them first
        self._rollback_due: set[int] = set()
        self._pending_target: GuidedRequests | None = None  # the latest target add_batch's
        # the target ids the latest draft execute's d2t reaches (bitmask words), or None
        self._draft_reach: Any = None
        # the one-pass C++ CPU mask, called without the custom op's dispatch (see apply_bitmask)
        self._cpu_apply = cpu_apply() if self.device.type == "cpu" else None
        # the masked argmax kernel's scratch (execute_argmax), zero between its launches
        self._argmax_scratch = argmax_scratch(self.bitmask.shape[0], self.device) \
            if self.device.type == "cuda" else None

    # -- properties --------------------------------------------------------------------------
    @property
    def native_build(self) -> bool:
        """Whether this decoder's build runs the C++ loop (:mod:`capgraph.build.native`)."""
        return self.host_build.name in ("native", "native-loop")

    @property
    def num_advanced_tokens(self) -> list[int]:
        """Per slot, the tokens its matcher accepted in the slot's last build (what a
        rollback of rejected drafts can undo)."""
        return self.slots.num_advanced_tokens

    @property
    def num_guided_tokens(self) -> list[int]:
        """Per slot, the logits rows its last build masked."""
        return self.slots.num_guided_tokens

    @property
    def num_advanced_draft_tokens(self) -> list[int]:
        """Per slot, the draft tokens its matcher accepted over the current drafting loop
        (rolled back when the loop ends)."""
        return self.slots.num_advanced_draft_tokens

    @property
    def grammar_matchers(self) -> SlotMatchers:
        """The matcher of each slot (None: none); assign ``grammar_matchers[slot]`` to replace
        one (the native build's handles follow)."""
        return self.slots.matchers

    @property
    def num_active_matchers(self) -> int:
        """Slots that currently hold a matcher."""
        return sum(m is not None for m in self.grammar_matchers)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the decoder's buffers, host and device."""
        host = self.slots.nbytes()
        device = 0 if self.device.type == "cpu" else self.bitmask.nbytes + self.token_mask.nbytes
        if self._argmax_scratch is not None:
            device += self._argmax_scratch.nbytes
        return {"host": host, "device": device, "rows": self.bitmask_host.shape[0]}

    # -- per-step API ------------------------------------------------------------------------
    @nvtx_range("GuidedDecoder.add_batch")
    @_open_only
    def add_batch(self, requests: Sequence[GuidedRequest],
                  runtime_draft_len: int | None = None) -> None:
        """Take this step's request snapshots (batch order = row order). The requests are
        checked here and read again by the build: change a request before its ``add_batch``,
        not between it and the build.

        Every request is checked before any matcher moves: here its fields' types, its slot
        and the slot's guide (:mod:`capgraph.admission`); the token values where the build
        reads them. A request with a bad field (a float, bool or string where an integer
        belongs, a string where a list of tokens belongs, ...), a generation request whose
        slot has no matcher for it (no context request created one, or the slot was
        released) or one carrying another guide than the one its slot's matcher was created
        for fails alone with a :class:`RequestError` naming the field and the value: its rows
        stay unmasked (an unguided stand-in takes them), a matcher it owned is dropped, and
        the failure is returned by the next ``execute`` (``take_failed_requests``). Integers
        may be NumPy integers or 0-d tensors, ``draft_tokens`` a tuple, 1-D tensor or array
        (converted). Compilation of every newly seen guide starts here, on the factory's
        thread pool, so that ``build`` usually finds it finished.

        Raises:
            LayoutError: ``requests`` is not a sequence of requests, more requests than
                ``max_num_sequences``, a request whose ``is_draft`` or
                ``is_context_init_state`` is not a bool (its rows are unknown), or a
                ``runtime_draft_len`` that is not an integer in ``[0, max_num_draft_tokens]``.
                Nothing is changed then.
            DecoderClosedError: the decoder was closed; nothing is read or changed.
        """
        batch = self._add_batch(requests, runtime_draft_len, False)
        if batch.dropped_slots:
            self._drop_slots(batch)

    @nvtx_range("GuidedDecoder.execute")
    @_open_only
    def execute(self, logits: torch.Tensor, d2t: torch.Tensor | None = None
                ) -> list[FailedRequest]:
        """Build this step's masks and apply them to ``logits`` in place.

        Args:
            logits: ``[rows, W]`` with one row per layout row; ``W`` is the full padded
                vocabulary, or a vocab shard of width ``V / tp_size`` (rank = ``self.rank``),
                or, with ``d2t``, (a shard of) a pruned draft vocabulary.
            d2t: optional int32 ``[V_draft]`` table: draft id ``g`` is target id ``g + d2t[g]``.

        Returns:
            ``[(request_id, message)]`` for every request that failed since the last call
            (add_batch, this build, rollbacks, disaggregated inits). Their rows are left
            unmasked.

        Raises:
            TensorArgError: bad logits or d2t (rows, width, dtype, device, non-contiguous
                columns, overlapping rows, d2t targets outside the vocabulary), before any
                matcher moves: call again with proper tensors.
            QueueEpochError: this batch was already built; call add_batch first.
            DecoderClosedError: the decoder was closed; ``logits`` are left untouched.
        """
        requests = self._require_batch()
        self._check_logits(logits, d2t, requests.num_bitmask_tokens)
        self._draft_reach = None if d2t is None else self._tensors.reach(d2t)
        self._step("execute", requests, lambda n: self.apply_bitmask(logits, d2t, n))
        return self.take_failed_requests()

    @nvtx_range("GuidedDecoder.execute_argmax")
    @_open_only
    def execute_argmax(self, logits: torch.Tensor, out: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, list[FailedRequest]]:
        """Build this step's masks and take each row's greedy token under them, the logits
        left as given: :meth:`execute` then ``argmax`` in one pass.

        Each token is ``torch.argmax`` of the row masked as :meth:`execute` masks it (rows past
        the layout's rows, unguided rows and a failed request's rows unmasked), ties to the
        lowest column (:func:`capgraph.ops.masked_argmax`). On CUDA one kernel reads each
        row's bitmask and the logits of its allowed tokens only, where ``execute`` followed by
        ``argmax`` reads every logit twice and writes the masked ones: use it where the step
        samples greedily and nothing else reads the masked logits. On CPU it masks a copy.

        Args:
            logits: ``[rows, vocab_size_padded]``, one row per layout row, the full vocabulary
                (a tensor-parallel shard's argmax needs the other shards': mask with
                :meth:`execute` there).
            out: int64 ``[rows]`` on the logits' device, or None for a new tensor.

        Returns:
            ``(out, failed)``: the tokens, and the failures as :meth:`execute` returns them.

        Raises:
            TensorArgError: bad logits (as for :meth:`execute`), logits that are not the full
                vocabulary, or a bad ``out``, before any matcher moves.
            QueueEpochError: this batch was already built; call add_batch first.
            DecoderClosedError: the decoder was closed.
        """
        requests = self._require_batch()
        self._check_logits(logits, None, requests.num_bitmask_tokens)
        full_vocabulary(logits, self.vocab_size_padded, "execute_argmax")
        tokens = argmax_out(out, logits, "execute_argmax")
        self._draft_reach = None  # (full-vocabulary rows)
        self._step("execute_argmax", requests, lambda n: self.argmax_bitmask(logits, tokens, n),
                   lambda: torch.argmax(logits, dim=-1, out=tokens))
        return tokens, self.take_failed_requests()

    def _step(self, name: str, requests: GuidedRequests, apply: Callable[[int], object],
              unmasked: Callable[[], object] | None = None) -> None:
        """execute's and execute_argmax's step after their checks: build ``requests``, then
        ``apply(rows)`` the bitmask (on CPU only where the build masked a row; else
        ``unmasked()``, if given); the build's failures are recorded."""
        self._take_unbuilt_batch(name)
        if requests.disagg_pending:  # (init_disagg_gen_requests was not called)
            self._init_disagg_gen_requests(requests)
        if self.device.type == "cuda":
            # the previous step's copy may still read the pinned buffer we are about to fill
            self.bitmask_event.synchronize()
        failed = self._build(requests)
        n = requests.num_bitmask_tokens
        if self.device.type == "cuda":
            with torch.cuda.stream(self.stream):
                self.stream.wait_event(self.token_event)
                self.copy_bitmask(n)
                self.bitmask_event.record(self.stream)
            torch.cuda.current_stream(self.device).wait_event(self.bitmask_event)
            apply(n)
            self.token_event.record()
        elif self._masked_rows:  # on CPU a step that masks nothing costs nothing more
            apply(n)
        elif unmasked is not None:
            unmasked()
        self._record_failed(failed)

    def take_failed_requests(self) -> list[FailedRequest]:
        """Failures recorded since the last call, then forgets them."""
        self._await_build()
        with self._failed_lock:
            failed, self._failed = self._failed, []
        return failed

    @_open_only
    def build(self) -> list[FailedRequest]:
        """Host work only: advance matchers and fill the host bitmask for the latest batch.

        Raises:
            QueueEpochError: this batch was already built (by ``build`` or ``execute``).
            DecoderClosedError: the decoder was closed.
        """
        requests = self._require_batch()
        self._take_unbuilt_batch("build")
        if requests.disagg_pending:  # (init_disagg_gen_requests was not called)
            self._init_disagg_gen_requests(requests)
        self._draft_reach = None  # (the caller applies the rows: no d2t known here)
        return self._build(requests)

    @nvtx_range("GuidedDecoder.copy_bitmask")
    def copy_bitmask(self, num_rows: int) -> None:
        """Copy the first ``num_rows`` host rows to the device (async from pinned memory)."""
        if self.bitmask is self.bitmask_host:
            return
        self.bitmask[:num_rows].copy_(self.bitmask_host[:num_rows], non_blocking=True)
        self.token_mask[:num_rows].copy_(self.token_mask_host[:num_rows], non_blocking=True)

    @nvtx_range("GuidedDecoder.argmax_bitmask")
    def argmax_bitmask(self, logits: torch.Tensor, out: torch.Tensor, num_rows: int) -> None:
        """``out`` = the argmax of each row of ``logits`` (``[rows, vocab_size_padded]``),
        ``logits[:num_rows]`` masked from the device bitmask as :meth:`apply_bitmask` masks
        them; the logits are not written (:func:`capgraph.ops.masked_argmax`)."""
        self._await_build()
        scratch = self._argmax_scratch
        if scratch is not None and scratch.shape[1] < logits.shape[0]:
            scratch = None  # (a direct call for more rows than the decoder's: the op's own)
        masked_argmax(logits, self.bitmask, self.token_mask, mask_rows=num_rows, out=out,
                      scratch=scratch)

    @nvtx_range("GuidedDecoder.apply_bitmask")
    def apply_bitmask(self, logits: torch.Tensor, d2t: torch.Tensor | None,
                      num_rows: int) -> None:
        """Mask ``logits[:num_rows]`` in place from the device bitmask (shard-aware).

        Bitmask rows stay whole, in target-vocabulary coordinates. A tensor-parallel shard of
        width ``W = full / tp_size`` (``full``: ``vocab_size_padded``, or ``len(d2t)``) reads
        them from its first column ``rank * W``: a target id without d2t, a draft id with d2t,
        whose target id ``g + d2t[g]`` the op looks up in the full table. Never the reference
        design's word slice plus d2t slice, which reads draft ids against a sliced target row.

        On CPU the common case (full-width rows without d2t) calls the op's own C++ pass
        directly: the custom op's dispatch and three slices cost 8 us a step, more than the
        pass itself at batch 1.
        """
        self._await_build()
        fast = self._cpu_apply
        if (fast is not None and d2t is None and logits.shape[0] == num_rows
                and logits.shape[1] == self.vocab_size_padded and logits.dtype in _FLOAT_DTYPES
                and logits.is_cpu and logits.stride(1) == 1
                and num_rows <= self.bitmask_host.shape[0]):
            fast(logits, self.bitmask, self.token_mask, 0)
            return
        width = logits.shape[1]
        full = self.vocab_size_padded if d2t is None else d2t.shape[0]
        tp_size = full // width
        col_offset = 0
        if tp_size > 1:
            # execute checked full % width == 0 and rank < tp_size; nothing needs the word
            # count ceil(V/32) to divide by tp_size: col_offset may fall inside a word.
            # With d2t col_offset is in draft coordinates (the op reads the full table).
            col_offset = (vocab_shard(full, tp_size, self.rank).col_offset if d2t is None
                          else self.rank * width)
        logits_bitmask(logits[:num_rows], self.bitmask[:num_rows],
                       self.token_mask[:num_rows], d2t, col_offset=col_offset)

    def check_d2t(self, d2t: torch.Tensor) -> None:
        """Check that every draft id ``g`` of ``d2t`` maps to a target id ``g + d2t[g]`` in
        ``[0, vocab_size_padded)``; ``execute`` calls it on the table it is given, before any
        matcher moves.

        On CPU the values are read on every step (about 8 us for 32000 ids, 42 us for 151936
        on a 2-core host). On CUDA reading them synchronises, so a table is read the first
        time the decoder sees it and remembered by tensor object, ``_version``, data pointer
        and length: pass the same tensor object each step (a new one, even at the same
        address, is read again); an in-place change through torch bumps ``_version`` and is
        read again. Inside a CUDA graph capture an unseen table is not read (a sync would
        break the capture): run one step outside the capture first, as warm-up does, or call
        this before capturing; a replay runs no Python check. What no check sees (a write
        that torch does not count, or a captured table changed before a replay) is still
        memory-safe: a column whose target lies outside the bitmask row is masked, never read
        past the row; call this after such a write to get the named error.

        Raises:
            TensorArgError: a target id is out of range (names the draft id and its target).
        """
        self._tensors.check_d2t(d2t)

    # -- speculative decoding ----------------------------------------------------------------
    @nvtx_range("GuidedDecoder.rollback_rejected_tokens")
    @_open_only
    def rollback_rejected_tokens(self) -> None:
        """Undo the matcher advances the target rejected in verification.

        Call after verification and before the next drafting loop's first build, with the
        requests of the latest ``add_batch`` carrying ``num_accepted_draft_tokens``. A count
        past what the matcher advanced is clamped where a draft stop token stopped it
        (verification may accept past it); anywhere else no masked row let verification
        accept the rest (drafts not given, past the runtime draft length, or refused by the
        grammar), and the request fails with a ``RequestError`` naming both numbers. A target
        build of a batch whose slots this was not called for after a step with drafts rolls
        them back first, as this call would. Failures go to the next ``execute`` /
        ``take_failed_requests``.

        A request whose drafts were a tree in the previous build carries
        ``accepted_draft_node`` instead (the deepest accepted node, -1 for none; it may be
        left None when no draft was accepted): its matcher, back at the root after the
        build, is fed the path from the root to that node, so it stands where a chain of
        the accepted drafts would (cut after a stop token; a path through a token the
        grammar refuses fails the request by name).

        Raises:
            DecoderClosedError: the decoder was closed.
        """
        self._rollback_rejected_tokens(self._require_batch())

    @nvtx_range("GuidedDecoder.rollback_draft_tokens")
    @_open_only
    def rollback_draft_tokens(self) -> None:
        """Undo every advance made by a drafting loop (call after it, before the target build).

        A loop left without it is undone by the next target build (``execute`` / ``build`` of
        a batch that is not a draft step) or ``rollback_rejected_tokens``, before they read
        the matchers: no target row is masked after a draft prefix, and no slot whose
        drafting stopped is left unguided.

        Raises:
            DecoderClosedError: the decoder was closed.
        """
        self._rollback_draft_tokens(self._require_batch())

    @nvtx_range("GuidedDecoder.init_disagg_gen_requests")
    @_open_only
    def init_disagg_gen_requests(self) -> None:
        """Create matchers for requests whose prefill ran elsewhere (first generation step).

        Call before the drafting loop and the forward of that step; ``execute`` and ``build``
        create those this was not called for (a second call creates nothing).

        Raises:
            DecoderClosedError: the decoder was closed.
        """
        self._init_disagg_gen_requests(self._require_batch())

    @_open_only
    def release(self, seq_slot: int) -> None:
        """Forget the matcher and counters of a slot whose request has finished.

        A guided request of the latest batch on that slot that no step has built yet (a
        release between ``add_batch`` and ``execute``) fails with a
        :class:`~capgraph.errors.RequestError` when that batch's step runs (a batch replaced
        by the next ``add_batch`` fails nothing): its step has no matcher for it, and its rows
        take no mask.

        Raises:
            RequestError: ``seq_slot`` is outside ``[0, max_num_sequences)``.
            DecoderClosedError: the decoder was closed.
        """
        slot = self._release_slot(seq_slot)
        self._fail_unbuilt_on(slot)
        self._release_now(slot)

    def _fail_unbuilt_on(self, slot: int) -> None:
        """Each guided request on ``slot`` of the latest batch, where no step has built it,
        replaced by an unguided stand-in with its rows, to fail when that batch is built
        (:meth:`_take_unbuilt_batch`): the slot was released."""
        batch = self.requests
        if batch is None or self._batch_built:
            return
        if self._released is None or self._released[0] is not batch:
            self._released = (batch, [])
        self._released[1].extend(_stand_ins_on(batch.requests, slot, ""))

    def _release_slot(self, seq_slot: object) -> int:
        """Free ``seq_slot`` for admission (the next ``add_batch`` may place a new request
        there) and return it as a slot index; RequestError naming it where it is none."""
        slot = as_int(seq_slot)
        if slot is None or not self.slots.slot_ok(slot):
            raise RequestError(f"release: seq_slot {seq_slot!r} is not a slot index in [0, "
                               f"max_num_sequences={self.max_num_sequences})", seq_slot=slot)
        self._admission.slot_guides[slot] = self._admission.slot_owners[slot] = None
        return slot

    def _release_now(self, slot: int) -> None:
        """The slot's matcher, counters and pending compile forgotten (after a build in
        flight has ended)."""
        self._finish_build()
        self.slots.reset(slot)
        self._draft_slots.pop(slot, None)
        self._rollback_due.discard(slot)
        self._forget_compile(slot)

    @_open_only
    def forced_tokens(self, seq_slot: int, max_tokens: int) -> list[int]:
        """The tokens the grammar of ``seq_slot`` forces next, at most ``max_tokens``: the
        tokenizer's own encoding of the text every continuation starts with
        (:class:`~capgraph.grammar.forced.ForcedTokenEncoder`), read from the slot's matcher
        as the latest build left it (after that step's accept: its new token and the drafts
        it advanced), so the first of them is what the token sampled from that state must be
        where the model follows the tokenizer's encoding, and the rest are drafts for the
        next step once it is. The matcher is unchanged; empty for a slot without a matcher or
        where nothing is forced. Meant as drafts: verification keeps the output exact
        whatever they are. Host-side and synchronous (waits for a build in flight); with the
        capturable decoder call it only once the step's callbacks have run.

        Raises:
            RequestError: ``seq_slot`` is outside ``[0, max_num_sequences)``.
            ConfigError: the config has no tokenizer to encode forced text with.
            DecoderClosedError: the decoder was closed.
        """
        return self._forced_tokens_batch([seq_slot], max_tokens)[0]

    @_open_only
    def forced_tokens_batch(self, seq_slots: Sequence[int], max_tokens: int
                            ) -> list[list[int]]:
        """:meth:`forced_tokens` for each of ``seq_slots`` (checked and synchronised once:
        what a drafter calls per step)."""
        return self._forced_tokens_batch(seq_slots, max_tokens)

    def _forced_tokens_batch(self, seq_slots: Sequence[int], max_tokens: int
                             ) -> list[list[int]]:
        if type(max_tokens) is not int or max_tokens < 0:
            raise ConfigError(f"forced_tokens: max_tokens={max_tokens!r} must be an int >= 0")
        if isinstance(seq_slots, (str, bytes)) or not hasattr(seq_slots, "__iter__"):
            raise RequestError(f"forced_tokens_batch: seq_slots must be a sequence of slot "
                               f"indices, got {type(seq_slots).__name__} {seq_slots!r:.40}")
        try:
            given_slots = list(seq_slots)  # (once: a generator is read once)
        except Exception as e:
            raise RequestError(f"forced_tokens_batch: seq_slots could not be read as a "
                               f"sequence of slot indices ({type(e).__name__}: {e})") from None
        slots = [as_int(s) for s in given_slots]
        for given, slot in zip(given_slots, slots):
            if slot is None or not self.slots.slot_ok(slot):
                raise RequestError(f"forced_tokens: seq_slot {given!r} is not a slot index in "
                                   f"[0, max_num_sequences={self.max_num_sequences})",
                                   seq_slot=slot)
        self._finish_build()
        matchers, encoder = self.grammar_matchers, self.forced_encoder
        limit = max_tokens * encoder.max_bytes_per_token
        out: list[list[int]] = []
        for slot in slots:
            matcher = matchers[slot]  # type: ignore[index]
            forced = matcher.forced_bytes(limit) if matcher is not None else b""
            out.append(encoder.encode(forced, max_tokens) if forced else [])
        return out

    @property
    def forced_encoder(self) -> ForcedTokenEncoder:
        """What :meth:`forced_tokens` encodes forced text with (built on first use from the
        config's tokenizer; assign one to change its options)."""
        if self._forced_encoder is None:
            self._forced_encoder = ForcedTokenEncoder(self.config.tokenizer)
        return self._forced_encoder

    @forced_encoder.setter
    def forced_encoder(self, encoder: ForcedTokenEncoder) -> None:
        self._forced_encoder = encoder

    def close(self) -> None:
        """Release what the decoder owns: the compile pool of a factory it built itself
        (a factory passed in stays open for its other users), the host build's threads (and,
        on the capturable decoder, its side stream's worker, after the work queued on it), and
        the compiles it started that no step took: each is waited for until
        ``compile_timeout_s`` from its start, then given up, so that none is left inside the
        backend when the interpreter exits (which aborts the process).

        The decoder is done for then: every step method (``add_batch``, ``execute``,
        ``build``, the rollbacks, ``init_disagg_gen_requests``, ``release``,
        ``forced_tokens``; on the capturable decoder also ``prepare``, ``add_draft_batch``,
        ``execute_draft_batch``, ``rollback_rejected_batch``, ``discard_queued_batches``)
        raises :class:`~capgraph.errors.DecoderClosedError` before it reads or changes
        anything: no matcher moves, nothing is queued, no compile starts.
        ``take_failed_requests`` still returns the failures recorded before. Closing again, or
        closing a decoder that never ran a step, is allowed and does nothing more. A step
        method running on another thread when close() is called is waited for (GIL
        released), then the decoder closes; one called after close() has begun is refused.
        """
        with self._close_lock:
            if self._closed:
                return
            # first (a close() that raises still leaves the decoder closed): from here on a
            # step method is refused, and those already inside one are in _in_step
            # (:func:`_open_only`)
            self._closed = True
            self._wait_for_steps()
            self._close()

    def _wait_for_steps(self) -> None:
        """Wait (GIL released) until no other thread is inside a step method."""
        me = get_ident()
        while any(ident != me for ident in list(self._in_step)):
            time.sleep(0.001)

    def _close(self) -> None:
        """close()'s work, run once, no step method running (a subclass extends it)."""
        self._finish_build()
        self.host_build.close()
        self._end_pending_compiles()
        if self._owns_factory:
            self.grammar_matcher_factory.close()

    def _end_pending_compiles(self) -> None:
        """Wait for the compiles this decoder started that no build took (an ``add_batch``
        without its step), each until the deadline its request would have waited for it
        (``compile_timeout_s`` from its start); give up those still running then. A compile
        left running on its thread when the interpreter exits aborts the process: xgrammar's
        bindings cannot take the GIL back during finalization and end in std::terminate
        ("terminate called without an active exception")."""
        handles, self._pending_compiles = list(self._pending_compiles.values()), {}
        timeout = self.config.compile_timeout_s
        for handle in handles:
            if not handle.done():
                left = handle.started + timeout - time.monotonic()
                wait_futures([handle.future], timeout=max(0.0, left))
            if not handle.done():
                handle.give_up()  # (stopped where the backend can stop it)

    def _refuse_closed(self, method: str) -> NoReturn:
        raise DecoderClosedError(
            f"{type(self).__name__}.{method}: the decoder is closed (close() was called); "
            "nothing was read or changed: build a new decoder to decode again")

    # -- the build ---------------------------------------------------------------------------
    @nvtx_range("GuidedDecoder.build")
    def _build(self, requests: GuidedRequests, asynchronous: bool = False,
               clear_rows: int | None = None) -> list[FailedRequest]:
        """One step's host work: the strategy (:attr:`host_build`) creates the matchers that
        are due, advances each guided request by its new token and draft tokens and fills its
        rows (see :mod:`capgraph.build.python` for the loop); then every outcome other than
        plain success is interpreted here (:meth:`_interpret`).

        ``asynchronous`` (the capturable decoder's CPU host step): where the strategy can run
        the grammar work on a thread of its own (:meth:`HostBuild.begin`), this returns at
        once; :meth:`_finish_build` ends it, and everything that reads the matchers, counters
        or masks calls that first. Its failures are recorded then.
        ``clear_rows``: token-mask rows zeroed first (default: the batch layout's rows).
        """
        self._await_build()
        self._end_open_draft(requests)
        if requests.is_draft_step:
            self._open_draft = requests
            for req in requests.valid_requests():
                if req.is_draft and self.slots.slot_ok(req.seq_slot):
                    self._draft_slots[req.seq_slot] = req  # type: ignore[index]
            if self._rollback_due:
                self._settle_before_drafts(requests)
        elif self.max_num_draft_tokens > 0:
            self._pending_target = None
            self._settle_drafts(requests)
        clear = requests.num_bitmask_tokens if clear_rows is None else clear_rows
        # (the trees of the slots built now are no longer current; another slot's stays its
        # own while its request sits out this step)
        self.slots.forget_trees(requests.requests)
        if asynchronous and self.host_build.begin(requests, clear):
            self._inflight = requests
            self._masked_rows = True  # (until the join says: the token mask decides)
            return []
        self._masked_rows = False  # (a build that raises masks nothing)
        outcomes, self._masked_rows = self.host_build.run(requests, clear)
        self._unguide_unreachable(requests)
        return self._interpret(requests, outcomes) if outcomes else []

    def _unguide_unreachable(self, requests: GuidedRequests) -> None:
        """After a build whose logits are in a pruned draft vocabulary (``d2t``: a draft step,
        or any batch its caller masks through a draft table): a masked row whose allowed
        tokens include none the draft vocabulary reaches is left unmasked (a dead end in
        draft coordinates: masking it would leave no column, and a softmax of it NaN), as the
        dead-end guard leaves a row that allows nothing."""
        reach = self._draft_reach
        if reach is None:
            return
        marks, rows = self.slots.token_mask_np, self.slots.bitmask_np
        masked = np.flatnonzero(marks[:requests.num_bitmask_tokens])
        if masked.size:
            dead = ~(rows[masked, :reach.shape[0]] & reach).any(axis=1)
            marks[masked[dead]] = 0

    def _settle_drafts(self, requests: GuidedRequests) -> None:
        """Before a target build: the slots of ``requests`` whose last build advanced drafts
        and whose rejected ones no ``rollback_rejected_tokens`` rolled back are rolled back
        now, by what these requests say was accepted (as that call would: a step left
        without it must not mask from a state the text never reached); then the slots this
        build advances drafts on are due."""
        due = self._rollback_due
        if due:
            slots = {r.seq_slot for r in requests.valid_requests() if r.seq_slot in due}
            if slots:
                self._rollback_rejected_tokens(requests, only=slots)  # type: ignore[arg-type]
        if requests.max_num_draft_tokens > 0:  # (else this step advances no draft)
            for req in requests.valid_requests():
                if not req.is_draft and req.draft_tokens and self.slots.slot_ok(req.seq_slot):
                    due.add(req.seq_slot)  # type: ignore[arg-type]

    def _settle_before_drafts(self, requests: GuidedRequests) -> None:
        """Before a draft step's build: the due slots (:meth:`_settle_drafts`) it drafts on
        are rolled back by the target batch added before the loop, as
        ``rollback_rejected_tokens`` would have been called before it; with no such batch
        they are no longer due (a draft build starts the slot's counts anew, so a later
        target build could not read what to roll back). A target request beside the drafts
        settles its slot by its own count, as at a target build."""
        due = self._rollback_due
        beside = {r.seq_slot for r in requests.valid_requests()
                  if not r.is_draft and r.seq_slot in due}
        if beside:  # (target requests beside the drafts: by their own counts)
            self._rollback_rejected_tokens(requests, only=beside)  # type: ignore[arg-type]
        slots = {r.seq_slot for r in requests.valid_requests()
                 if r.is_draft and r.seq_slot in due}
        if not slots:
            return
        target = self._pending_target
        if target is not None:
            self._rollback_rejected_tokens(target, only=slots)  # type: ignore[arg-type]
        due.difference_update(slots)  # type: ignore[arg-type]

    def _finish_build(self) -> None:
        """Wait for the build ``_build(asynchronous=True)`` started and record its failures;
        a no-op when none is in flight. A caller on another thread meanwhile waits until it
        is done."""
        with self._finish_lock:
            self._finishing += 1
            try:
                requests, self._inflight = self._inflight, None
                if requests is None:
                    return
                try:
                    result = self.host_build.finish()
                except BaseException:
                    self._clear_token_mask()  # as a build that raises: this step masks nothing
                    raise
                outcomes, self._masked_rows = result
                self._unguide_unreachable(requests)
                self._record_failed(self._interpret(requests, outcomes))
            finally:
                self._finishing -= 1

    def _await_build(self) -> None:
        """:meth:`_finish_build` where a build is in flight or another thread is finishing
        one (read in that order: ``_finishing`` is counted before ``_inflight`` is taken)."""
        if self._inflight is not None or self._finishing:
            self._finish_build()

    def _interpret(self, requests: GuidedRequests, outcomes: Sequence[Outcome],
                   unmask: bool = True, others: Collection[int] = ()) -> list[FailedRequest]:
        """What each outcome of a build means for its request (the one place for it, whichever
        strategy ran): a refused new token or a dead first row stops a draft step's guidance
        and fails a target request; a fault or a budget overrun fails the request. A failed
        request's matcher is dropped (:meth:`_fail`) and its rows of the step are left
        unmasked, those a strategy filled before the failure too (``unmask`` False: the
        strategy unmasked them itself, and the token mask may hold a later step by now).
        ``others``: batch indices whose slot another request holds by now (a step read after
        a later step reused the slot): they fail without touching the slot."""
        failed: list[FailedRequest] = []
        offsets, end = requests.offsets, requests.num_bitmask_tokens
        for index, status, detail in outcomes:
            req = requests.requests[index]
            slot = req.seq_slot
            drop = index not in others
            if status in (Status.REJECTED, Status.DEAD_END) and req.is_draft:
                if drop:
                    self.is_draft_terminated[slot] = True  # type: ignore[index]
                continue
            if unmask:
                stop = offsets[index + 1] if index + 1 < len(offsets) else end
                self.slots.token_mask_np[offsets[index]:stop] = 0
            if status == Status.REJECTED:
                failed.append(self._fail(req, RequestError(
                    f"new_token {req.new_token} is not allowed by the grammar",
                    request_id=req.request_id, seq_slot=slot), drop))
            elif status == Status.DEAD_END:
                failed.append(self._fail(req, DeadEndError(
                    f"request {req.request_id} at slot {slot} reached a grammar state "
                    "with no valid token"), drop))
            elif status == Status.OVER_BUDGET:
                failed.append(self._fail(req, BudgetExceededError(
                    request_id=req.request_id, seq_slot=slot, elapsed_ms=float(cast(float, detail)),
                    budget_ms=self.host_build.budget_ms), drop))
            else:  # FAULT, REFUSED: the message is the detail
                failed.append(self._fail_message(req, str(detail),
                                                 drop and status == Status.FAULT))
        return failed

    def _create_matcher(self, req: GuidedRequest) -> GrammarMatcher:
        params = req.guided_decoding_params
        handle = self._pending_compiles.pop(req.seq_slot, None)  # type: ignore[arg-type]
        if handle is None or handle.params != params:
            if handle is not None and not handle.done():
                handle.give_up()  # (started for another guide: nobody waits for it now)
            handle = self.grammar_matcher_factory.compile_async(params)  # type: ignore[arg-type]
        compiled = handle.result(self.config.compile_timeout_s, backend=self.backend,
                                 request_id=req.request_id)
        return self.grammar_matcher_factory.create_from_compiled(compiled)

    # -- protected interface -----------------------------------------------------------------
    def _add_batch(self, requests: Sequence[GuidedRequest], runtime_draft_len: int | None,
                   tokens_elsewhere: bool) -> GuidedRequests:
        """add_batch's work, except that ``batch.dropped_slots`` are left to the caller (the
        capturable decoder drops them when a callback fetches the batch).
        ``tokens_elsewhere``: the tokens come from a tensor, not the requests
        (see :func:`~capgraph.requests.checked_request`)."""
        draft_len = self.max_num_draft_tokens if runtime_draft_len is None else \
            self._checked_draft_len(runtime_draft_len)
        if type(requests) is not list and (isinstance(requests, (str, bytes))
                                           or not hasattr(requests, "__len__")):
            raise LayoutError(f"requests must be a sequence of GuidedRequest, got "
                              f"{type(requests).__name__}")
        if len(requests) > self.max_num_sequences:
            raise LayoutError(f"{len(requests)} requests exceed max_num_sequences="
                              f"{self.max_num_sequences}")
        reqs = list(requests)
        start = self.host_build.admit(reqs, self._admission.slot_guides,
                                      self._admission.slot_owners)
        if start == len(reqs):  # every request is the common one
            self.requests = batch = GuidedRequests(reqs, draft_len)
        else:
            reqs, dropped, fresh, failed = self._admission.admit(reqs, tokens_elsewhere, start)
            self._record_failed(failed)
            pending = any(r.is_generation_only_first_iteration is True and not r.is_draft
                          for r in fresh)
            self.requests = batch = GuidedRequests(reqs, draft_len, dropped, pending)
            if fresh:
                self._start_compiles(fresh)
        self._batch_built = False
        if not batch.is_draft_step:  # (a drafting loop may run before its build: see
            self._pending_target = batch  # _settle_before_drafts)
        return batch

    def _checked_draft_len(self, runtime_draft_len: object) -> int:
        value = runtime_draft_len if type(runtime_draft_len) is int else as_int(runtime_draft_len)
        if value is None:
            raise LayoutError(f"runtime_draft_len={runtime_draft_len!r} is not an integer")
        if not 0 <= value <= self.max_num_draft_tokens:
            raise LayoutError(f"runtime_draft_len={value} is outside "
                              f"[0, max_num_draft_tokens={self.max_num_draft_tokens}]")
        return value

    def _start_compiles(self, requests: list[GuidedRequest]) -> None:
        """Start compiling the guides of the requests that create a matcher (context,
        disaggregated first step): admission hands over the only candidates."""
        for req in requests:
            if not (req.is_context_init_state or req.is_generation_only_first_iteration):
                continue  # the common case: a request already generating
            params, slot = req.guided_decoding_params, req.seq_slot
            if params is None or req.is_draft or not self.slots.slot_ok(slot):
                continue
            handle = self._pending_compiles.get(slot)
            if handle is None or handle.params != params:
                self._forget_compile(slot)
                self._pending_compiles[slot] = self.grammar_matcher_factory.compile_async(params)

    def _forget_compile(self, slot: int) -> None:
        """Forget the compile started for ``slot``'s request; one still running stops being
        waited for (a compile no request waits for is not kept, and is stopped where the
        backend can stop it)."""
        handle = self._pending_compiles.pop(slot, None)
        if handle is not None and not handle.done():
            handle.give_up()

    def _drop_slots(self, batch: GuidedRequests) -> None:
        """Drop the matchers of ``batch.dropped_slots`` (their requests failed admission),
        after a build still in flight has ended."""
        self._finish_build()
        for slot in batch.dropped_slots:
            self.grammar_matchers[slot] = None
            self._forget_compile(slot)

    def _end_open_draft(self, requests: GuidedRequests | None = None) -> None:
        """End a drafting loop left without its ``rollback_draft_tokens`` (its draft advances
        rolled back, its slots guided again) before anything reads the matchers for a step
        that is not one of its drafts: ``requests``, that step's batch (None: a rollback of
        rejected tokens, which ends it too). A draft step goes on with the loop, but for the
        slots of the target requests it holds beside its drafts, whose loop ends. Nothing if
        no loop is open."""
        open_draft = self._open_draft
        if open_draft is None:
            return
        if requests is None or not requests.is_draft_step:
            self._rollback_draft_tokens(open_draft)
            return
        targets = {r.seq_slot for r in requests.valid_requests() if not r.is_draft}
        if targets:
            self._rollback_draft_tokens(open_draft, targets)

    def _rollback_rejected_tokens(self, requests: GuidedRequests,
                                  only: Collection[int] | None = None) -> None:
        """Roll each slot of ``requests`` (``only``: of these slots) back to its last build's
        new token and accepted drafts (``num_accepted_draft_tokens``, or the tree path to
        ``accepted_draft_node``); a second call for the same build rolls back nothing.
        ``only`` is a build's own settling (:meth:`_settle_drafts`), which has waited for
        the build in flight and ended an open drafting loop already."""
        if only is None:
            self._finish_build()
            self._end_open_draft()
        if self.max_num_draft_tokens <= 0:
            return
        handled: set[int] = set()
        for req in requests.valid_requests():
            slot = req.seq_slot
            if not self.slots.slot_ok(slot) or slot in handled \
                    or (only is not None and slot not in only):
                continue  # (a later request on a slot is the one the build refused: not its)
            handled.add(slot)  # type: ignore[arg-type]
            if req.is_context_init_state or req.is_generation_only_first_iteration:
                if req.require_matcher_init() or req.is_generation_only_first_iteration:
                    self._rollback_due.discard(slot)  # type: ignore[arg-type]  # (a new one)
                continue  # a new request drafted nothing: the slot's advances were another's
            self._rollback_due.discard(slot)  # type: ignore[arg-type]
            if self.slots.num_advanced_tokens[slot] <= 0:  # type: ignore[index]
                continue
            tree = self.slots.current_tree(slot)
            if tree is not None:
                self._keep_tree_path(req, slot, *tree)
                continue
            advanced = self.slots.num_advanced_tokens[slot]  # type: ignore[index]
            n = req.num_accepted_draft_tokens
            accepted = 0 if n is None else as_int(n)
            matcher = self.grammar_matchers[slot]  # type: ignore[index]
            if accepted is None or accepted < 0 or matcher is None:
                self._record_failed([self._fail(req, RequestError(
                    f"cannot roll back: num_accepted_draft_tokens="
                    f"{req.num_accepted_draft_tokens!r}, num_advanced_tokens={advanced}",
                    request_id=req.request_id, seq_slot=slot))])
                continue
            keep = 1 + accepted
            if keep > advanced:
                if not matcher.is_terminated():
                    self._record_failed([self._fail(req, RequestError(
                        f"num_accepted_draft_tokens={accepted}, but the last step advanced "
                        f"its matcher by {advanced - 1} draft token(s): the others were not "
                        "given, past the runtime draft length, or refused by the grammar, so "
                        "no masked row let verification accept them",
                        request_id=req.request_id, seq_slot=slot))])
                    continue
                keep = advanced  # (verification can accept past a draft stop token)
            try:
                matcher.rollback(advanced - keep)
            except Exception as e:
                self._record_failed([self._fail(req, e)])
                continue
            self.slots.num_advanced_tokens[slot] = keep  # type: ignore[index]  # a second call rolls back nothing

    def _keep_tree_path(self, req: GuidedRequest, slot: int, tokens: list[int] | None,
                        parents: list[int]) -> None:
        """After a build that traversed a draft tree (its matcher back at the root), feed the
        matcher the path from the root to ``req.accepted_draft_node``. The path is clamped
        where the grammar stops it (a refused token, a terminating stop token), as a chain's
        accepted count is clamped to its advances. ``tokens`` None: a path was kept already
        (a second call keeps nothing more)."""
        if tokens is None:
            return
        node = getattr(req, "accepted_draft_node", None)  # (an object without tree fields)
        accepted = req.num_accepted_draft_tokens
        index = as_int(node) if node is not None else (-1 if accepted in (None, 0) else None)
        if index is None or not -1 <= index < len(tokens):
            self._record_failed([self._fail(req, RequestError(
                f"cannot keep the accepted path of the draft tree ({len(tokens)} nodes with "
                f"rows): accepted_draft_node={node!r}, num_accepted_draft_tokens={accepted!r} "
                "(a tree needs the index of its deepest accepted node, -1 for none)",
                request_id=req.request_id, seq_slot=slot))])
            return
        path = []
        at = index
        while at >= 0:
            path.append(tokens[at])
            at = parents[at]
        # (a count of 0 is also GuidedRequest.generation's default: only a count given
        # otherwise can contradict the node)
        count = as_int(accepted) if accepted is not None else None
        if node is not None and count != 0 and accepted is not None and count != len(path):
            self._record_failed([self._fail(req, RequestError(
                f"accepted_draft_node={node!r} lies at depth {len(path)} of the draft tree "
                f"but num_accepted_draft_tokens={accepted!r}: the two must name the same "
                "accepted path", request_id=req.request_id, seq_slot=slot))])
            return
        matcher = self.grammar_matchers[slot]
        kept = 0
        try:
            if matcher is not None:
                stops = self.slots.stop_ids
                for depth, token in enumerate(reversed(path), 1):
                    if not matcher.accept_token(token):
                        raise RequestError(
                            f"accepted_draft_node={node!r}: the token {token} at depth {depth} "
                            "of its path is refused by the grammar, so no masked row let "
                            "verification accept it", request_id=req.request_id,
                            seq_slot=slot)
                    kept += 1
                    if token in stops and matcher.is_terminated():
                        break
        except Exception as e:
            self._record_failed([self._fail(req, e)])
            return
        self.slots.num_advanced_tokens[slot] += kept
        self.slots.record_tree(slot, None, parents)

    def _rollback_draft_tokens(self, requests: GuidedRequests,
                               slots: Collection[int | None] | None = None) -> None:
        """Roll back the draft advances of the drafting loop's slots (every slot a draft step
        of it built, and ``requests``' slots) and guide them again, ending the loop
        (``slots``: only these, and the loop stays open for the rest)."""
        self._finish_build()
        if slots is None:
            self._open_draft = None
        if self.max_num_draft_tokens <= 0:
            return
        owners = self._draft_slots
        for req in requests.valid_requests():
            if self.slots.slot_ok(req.seq_slot):
                owners.setdefault(req.seq_slot, req)  # type: ignore[arg-type]
        for slot in [s for s in owners if slots is None or s in slots]:
            req = owners.pop(slot)
            n = self.slots.num_advanced_draft_tokens[slot]
            matcher = self.grammar_matchers[slot]
            if n > 0 and matcher is not None:
                try:
                    matcher.rollback(n)
                except Exception as e:
                    self._record_failed([self._fail(req, e)])
            self.slots.num_advanced_draft_tokens[slot] = 0
            self.is_draft_terminated[slot] = False

    def _init_disagg_gen_requests(self, requests: GuidedRequests) -> None:
        self._finish_build()
        if not requests.disagg_pending:
            return  # none in the batch, or created already (a second call creates nothing)
        requests.disagg_pending = False
        for req in requests.valid_requests():
            if req.is_generation_only_first_iteration and not req.is_draft:
                try:
                    if not self.slots.slot_ok(req.seq_slot):
                        raise RequestError(f"seq_slot {req.seq_slot!r} is outside [0, "
                                           f"max_num_sequences={self.max_num_sequences})",
                                           request_id=req.request_id, seq_slot=req.seq_slot)
                    self.slots.reset(req.seq_slot)  # type: ignore[arg-type]  # (a new request)
                    self.grammar_matchers[req.seq_slot] = self._create_matcher(req)  # type: ignore[index]
                except Exception as e:
                    self._record_failed([self._fail(req, e)])

    def _fail(self, req: GuidedRequest, error: BaseException, drop: bool = True
              ) -> FailedRequest:
        """Record a request's failure; its matcher is dropped so later steps leave it unmasked."""
        return self._fail_message(req, f"{type(error).__name__}: {error}", drop)

    def _fail_message(self, req: GuidedRequest, message: str, drop: bool = True
                      ) -> FailedRequest:
        """``drop``: the slot is left as a dead end leaves it, matcher dropped and advance
        count zeroed, so that no later rollback reports this failure a second time (False
        where the slot belongs to another request of the batch)."""
        if drop and self.slots.slot_ok(req.seq_slot):
            self.grammar_matchers[req.seq_slot] = None  # type: ignore[index]
            self.slots.num_advanced_tokens[req.seq_slot] = 0  # type: ignore[index]
        return _request_id(req), message

    def _fail_batch(self, batch: GuidedRequests, message: str) -> list[int]:
        """Fail every guided request of ``batch`` with ``message`` (matchers dropped); their
        ids."""
        failed = [self._fail_message(r, message) for r in batch.valid_requests()]
        self._record_failed(failed)
        return [i for i, _ in failed]

    def _record_failed(self, failed: list[FailedRequest]) -> None:
        if failed:
            with self._failed_lock:
                self._failed.extend(failed)

    def _clear_token_mask(self) -> None:
        """Zero every token-mask row on the host: the step masks nothing."""
        self.slots.token_mask_np[:] = 0

    def _take_unbuilt_batch(self, caller: str) -> None:
        """A batch is built at most once: a second build would feed every token again."""
        if self._batch_built:
            raise QueueEpochError(f"{caller}: the batch of the latest add_batch was already "
                                  "built; call add_batch for the next step first")
        self._batch_built = True
        released, self._released = self._released, None
        if released is not None and released[0] is self.requests:
            self._record_failed(released[1])

    def _require_batch(self) -> GuidedRequests:
        if self.requests is None:
            raise LayoutError("no batch: call add_batch() first")
        return self.requests

    def _check_logits(self, logits: torch.Tensor, d2t: torch.Tensor | None,
                      rows: int | None, min_rows: int | None = None) -> None:
        """Refuse bad logits / d2t before the build advances any matcher. ``rows``: the exact
        row count; None: at least ``min_rows`` (default: the batch layout's rows)."""
        if rows is None and min_rows is None:
            min_rows = self._require_batch().num_bitmask_tokens
        self._tensors.check(logits, d2t, rows, min_rows or 0)


def checked_device(device: object) -> torch.device:
    """``device`` as a torch device where a decoder (and the reference loop) can run: the CPU
    or a CUDA device this machine has (an integer is a CUDA index); anything else is a
    ``ConfigError`` naming it."""
    spec = device
    if isinstance(device, numbers.Integral) and not isinstance(device, bool):
        spec = f"cuda:{int(device)}"  # (torch reads an index as the accelerator's)
    try:
        dev = torch.device(spec)  # type: ignore[call-overload]
    except (RuntimeError, TypeError, ValueError):  # (torch's message lists its overloads)
        raise ConfigError(f"device={device!r} is not a torch device: expected 'cpu', 'cuda' "
                          "or 'cuda:N' (or a torch.device)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"device={device!r}: expected a CPU or CUDA device ('cpu', "
                          "'cuda' or 'cuda:N')")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={device!r} requested but no CUDA device is available")
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            raise ConfigError(f"device={device!r}: this machine has {count} CUDA device(s)")
    return dev


def _stand_ins_on(requests: list, slot: int, when: str) -> list[FailedRequest]:
    """Each guided request on ``slot`` in ``requests`` replaced (in place) by an unguided
    stand-in with its rows; the failure of each: its slot was released ``when`` (after
    add_batch queued it), so its step has no matcher for it."""
    failed = []
    for i, req in enumerate(requests):
        if req.guided_decoding_params is not None and req.seq_slot == slot:
            rid = _request_id(req)
            requests[i] = GuidedRequest.stand_in(req.request_id,
                                                 bool(req.is_context_init_state),
                                                 bool(req.is_draft))
            failed.append((rid, f"RequestError: seq_slot {slot} was released after add_batch "
                                f"queued request {rid}{when}: its step has no matcher for it"))
    return failed


def _constructor_int(name: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")


def _request_id(req: GuidedRequest) -> int:
    """The id reported for a request: its ``request_id``, or -1 when it has none."""
    return req.request_id if req.request_id is not None else -1

