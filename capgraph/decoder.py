"""GuidedDecoder: one guided step, eagerly — build masks on the host, copy, apply to logits.

Per step the engine calls :meth:`GuidedDecoder.add_batch` with request snapshots and then
:meth:`GuidedDecoder.execute` with the logits (one row per layout row, see
:mod:`capgraph.requests`). With speculative decoding it also calls
:meth:`~GuidedDecoder.rollback_rejected_tokens` after verification and
:meth:`~GuidedDecoder.rollback_draft_tokens` after a drafting loop.

Failures are per request: ``execute`` returns ``[(request_id, message)]`` and the failing
request's rows are left unmasked; the other rows are masked exactly as without it.
"""

from __future__ import annotations

import functools
import threading
import warnings
from time import perf_counter
from typing import Callable, Sequence, TypeGuard, cast

import numpy as np
import torch

from ._nvtx import nvtx_range
from .bitmask import (allocate_host_bitmask, allocate_host_token_mask, bitmask_dtype,
                      split_last_word,
                      token_mask_dtype, vocab_shard, words_per_row)
from .errors import (BudgetExceededError, ConfigError, DeadEndError, LayoutError,
                     QueueEpochError, RequestError, TensorArgError)
from .grammar import CompileHandle, GrammarMatcher, GrammarMatcherFactory, create_matcher_factory
from .grammar.native import (STATUS_DEAD_END, STATUS_FAULT, STATUS_OVER_BUDGET,
                             STATUS_REJECTED, TERMINATED, FastPath, NativeBuilder,
                             NativeBuildError, cpu_apply)
from .ops import logits_bitmask
from .ops.op import _FLOAT_DTYPES, _cuda_kernel
from .params import GuidedDecodingConfig, GuidedDecodingParams
from .requests import GuidedRequest, GuidedRequests, as_int, checked_request
from .streams import CudaStepStreams, StepStreams

__all__ = ["GuidedDecoder", "FailedRequest"]

FailedRequest = tuple[int, str]  # (request_id, message)


class GuidedDecoder:
    """Advances one grammar matcher per sequence slot and masks logits in place.

    Args:
        config: grammar backend, vocabulary, stop tokens, compile cache and timeout.
        max_num_sequences: number of sequence slots (the largest batch).
        max_num_draft_tokens: the largest draft length (0 without speculative decoding).
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

    Buffers are allocated once: the bitmask ``[max_num_sequences * (max_num_draft_tokens + 1),
    ceil(V / 32)]`` int32 and a per-row int32 ``token_mask``, each with a host twin (pinned
    where CUDA exists).
    """

    bitmask_dtype = bitmask_dtype
    token_mask_dtype = token_mask_dtype
    #: batches of at most this many guided requests fill row by row, not in rounds
    #: (:meth:`_fill_sequential`; measured break-even on 2 cores, Tekken)
    sequential_fill_max: int = 2

    def __init__(self, config: GuidedDecodingConfig, max_num_sequences: int,
                 max_num_draft_tokens: int = 0, vocab_size_padded: int | None = None,
                 device: torch.device | str = "cpu", rank: int = 0,
                 factory: GrammarMatcherFactory | None = None) -> None:
        if not isinstance(config, GuidedDecodingConfig):
            raise ConfigError(f"config must be a GuidedDecodingConfig, got {type(config).__name__}")
        _constructor_int("max_num_sequences", max_num_sequences, 1)
        _constructor_int("max_num_draft_tokens", max_num_draft_tokens, 0)
        V = config.vocab_size_padded if vocab_size_padded is None else vocab_size_padded
        if type(V) is not int or V != config.vocab_size_padded:
            raise ConfigError(f"vocab_size_padded={V!r} differs from the config's "
                              f"vocab_size_padded={config.vocab_size_padded}")
        _constructor_int("rank", rank, 0)
        if factory is not None and not isinstance(factory, GrammarMatcherFactory):
            raise ConfigError(f"factory must be a GrammarMatcherFactory or None, got "
                              f"{type(factory).__name__}")
        self.config = config
        self.max_num_sequences = max_num_sequences
        self.max_num_draft_tokens = max_num_draft_tokens
        self.vocab_size_padded: int = V
        self.rank = rank
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise ConfigError(f"device={device!r} is not a torch device ({e})") from None
        self._on_cpu = self.device.type == "cpu"
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError(f"device={self.device} requested but no CUDA device is available")
        self._owns_factory = factory is None  # a shared factory is closed by its owner
        self.grammar_matcher_factory = factory or create_matcher_factory(config)
        self.backend = self.grammar_matcher_factory.backend_name

        rows = max_num_sequences * (max_num_draft_tokens + 1)
        self.bitmask_size = words_per_row(V)
        self.bitmask_host = allocate_host_bitmask(rows, V)
        self.token_mask_host = allocate_host_token_mask(rows)
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

        # Per-slot bookkeeping (plain lists: read and written per request on the host).
        self.grammar_matchers: list[GrammarMatcher | None] = [None] * max_num_sequences
        self.num_advanced_tokens = [0] * max_num_sequences  # accepted in the last build
        self.num_guided_tokens = [0] * max_num_sequences  # rows masked in the last build
        self.num_advanced_draft_tokens = [0] * max_num_sequences  # over a drafting loop
        self.is_draft_terminated = [False] * max_num_sequences
        # the guide each slot's matcher is (being) created for, host side in add_batch order
        # (the matchers themselves may be created later, by a callback): a generation request
        # must carry it (add_batch, _admit)
        self._slot_guides: list[GuidedDecodingParams | None] = [None] * max_num_sequences
        self.requests: GuidedRequests | None = None
        self._batch_built = False  # the eager execute/build of the latest add_batch has run
        # d2t tables whose values were checked: (data_ptr, _version, length, device)
        self._d2t_checked: list[tuple] = []
        self._pending_compiles: dict[int, CompileHandle] = {}
        self._failed: list[FailedRequest] = []
        self._failed_lock = threading.Lock()  # callbacks record failures from other threads
        tokenizer_vocab = config.tokenizer_vocab_size
        self._tail = (tokenizer_vocab // 32, tokenizer_vocab % 32) if tokenizer_vocab < V else None
        # NumPy views of the host buffers: the per-step host bookkeeping touches a few rows, and
        # NumPy's small-array calls cost ~1 us where torch's intra-op thread pool can cost ms
        # while the batch fill's threads hold the cores.
        self._bitmask_np = self.bitmask_host.numpy()
        self._token_mask_np = self.token_mask_host.numpy()
        # the same split as bitmask.row_has_valid_token: only bits below V count
        self._full_words, tail_mask = split_last_word(V)
        self._tail_word_mask = np.int32(tail_mask) if tail_mask else None
        self._zero_words = bytes(4 * self._full_words)
        # the dead-end guard's first look: the 16-word window holding most likely-allowed ids
        self._probe = _probe_window(self.grammar_matcher_factory.likely_allowed_token_ids(),
                                    self._full_words)
        self._stop_ids = frozenset(config.stop_token_ids or ())
        self._masked_rows = False  # the last build set some token_mask entry
        # the every-step loop in C++ where it builds (GuidedDecodingConfig.native_build)
        self._native: NativeBuilder | None = self._load_native(tail_mask)
        # one request's host-step budget in seconds (0.0: none), and whether the next Python
        # build times each request alone (a batched stage went over it: see _build_python)
        self._budget_ms = float(config.host_step_budget_ms or 0.0)
        self._budget_s = self._budget_ms / 1e3
        self._budget_probe = False
        if self._native is not None:
            self._native.set_budget_ms(self._budget_ms)
        # its CPython entry, which reads a steady-state batch itself
        self._fast: FastPath | None = self._bind_fast()
        # its copy of _admit's inline test, bound to its state: (requests, slot guides) -> count
        self._fast_admit: Callable[[list, list], int] | None = None if self._fast is None \
            else functools.partial(self._fast.admit, self._fast.state)
        # a build the CPython entry runs on its own thread (_build(asynchronous)): its batch
        self._inflight: tuple[GuidedRequests, FastPath] | None = None
        # the one-pass C++ CPU mask, called without the custom op's dispatch (see apply_bitmask)
        self._cpu_apply = cpu_apply() if self.device.type == "cpu" else None

    def _load_native(self, tail_mask: int) -> NativeBuilder | None:
        mode = self.config.native_build
        if mode == "off":
            return None
        try:
            builder = self.grammar_matcher_factory.native_builder(
                self.bitmask_host, self.token_mask_host, self.max_num_sequences,
                self._full_words, tail_mask, self._tail)
        except NativeBuildError as e:
            if mode == "on":
                raise
            _warn_native_unavailable(str(e))
            return None
        if builder is None and mode == "on":
            raise ConfigError(f"GuidedDecodingConfig.native_build='on' needs the xgrammar "
                              f"backend with fill_threads=1 (backend={self.backend!r}, "
                              f"fill_threads={self.config.fill_threads})")
        return builder

    def _bind_fast(self) -> FastPath | None:
        matcher_type = self.grammar_matcher_factory.native_matcher_type()
        if self._native is None or matcher_type is None:
            return None
        return self._native.bind_fast(self.grammar_matchers, self.is_draft_terminated,
                                      self.num_advanced_tokens, self.num_guided_tokens,
                                      matcher_type, self.vocab_size_padded,
                                      self.max_num_draft_tokens)

    # -- properties --------------------------------------------------------------------------
    @property
    def native_build(self) -> bool:
        """Whether this decoder's build runs the C++ loop (:mod:`capgraph.grammar.native`)."""
        return self._native is not None

    @property
    def num_active_matchers(self) -> int:
        """Slots that currently hold a matcher."""
        return sum(m is not None for m in self.grammar_matchers)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the decoder's buffers, host and device."""
        host = self.bitmask_host.nbytes + self.token_mask_host.nbytes
        device = 0 if self.device.type == "cpu" else self.bitmask.nbytes + self.token_mask.nbytes
        return {"host": host, "device": device, "rows": self.bitmask_host.shape[0]}

    # -- per-step API ------------------------------------------------------------------------
    @nvtx_range("GuidedDecoder.add_batch")
    def add_batch(self, requests: Sequence[GuidedRequest],
                  runtime_draft_len: int | None = None) -> None:
        """Take this step's request snapshots (batch order = row order).

        Every request is checked before any matcher moves: here its fields' types, its slot
        and the slot's guide (:meth:`_admit`); the token values where the build reads them.
        A request with a bad field (a float, bool or string where an integer belongs, a
        string where a list of tokens belongs, ...), a generation request whose slot has no
        matcher for it (no context request created one, or the slot was released) or one
        carrying another guide than the one its slot's matcher was created for fails alone
        with a :class:`RequestError` naming the field and the value: its rows stay unmasked
        (an unguided stand-in takes them), a matcher it owned is dropped, and the failure is
        returned by the next ``execute`` (``take_failed_requests``). Integers may be NumPy
        integers or 0-d tensors, ``draft_tokens`` a tuple, 1-D tensor or array (converted).
        Compilation of every newly seen guide starts here, on the factory's thread pool, so
        that ``build`` usually finds it finished.

        Raises:
            LayoutError: ``requests`` is not a sequence of requests, more requests than
                ``max_num_sequences``, a request whose ``is_draft`` or
                ``is_context_init_state`` is not a bool (its rows are unknown), or a
                ``runtime_draft_len`` that is not an integer in ``[0, max_num_draft_tokens]``.
                Nothing is changed then.
        """
        batch = self._add_batch(requests, runtime_draft_len, False)
        if batch.dropped_slots:
            self._drop_slots(batch)

    def _add_batch(self, requests: Sequence[GuidedRequest], runtime_draft_len: int | None,
                   tokens_elsewhere: bool) -> GuidedRequests:
        """add_batch's work, except that ``batch.dropped_slots`` are left to the caller (the
        capturable decoder drops them when a callback fetches the batch)."""
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
        admit = self._fast_admit  # the inline test of _admit in C++: all the common request?
        start = 0 if admit is None else admit(reqs, self._slot_guides)
        if start == len(reqs):
            self.requests = batch = GuidedRequests(reqs, draft_len)
        else:
            reqs, dropped, fresh = self._admit(reqs, tokens_elsewhere, start)
            self.requests = batch = GuidedRequests(reqs, draft_len, dropped)
            if fresh:
                self._start_compiles(fresh)
        self._batch_built = False
        return batch

    def _checked_draft_len(self, runtime_draft_len: object) -> int:
        if runtime_draft_len is None:
            return self.max_num_draft_tokens
        if type(runtime_draft_len) is not int:
            value = as_int(runtime_draft_len)
            if value is None:
                raise LayoutError(f"runtime_draft_len={runtime_draft_len!r} is not an integer")
            runtime_draft_len = value
        if not 0 <= runtime_draft_len <= self.max_num_draft_tokens:  # type: ignore[operator]
            raise LayoutError(f"runtime_draft_len={runtime_draft_len} is outside "
                              f"[0, max_num_draft_tokens={self.max_num_draft_tokens}]")
        return runtime_draft_len  # type: ignore[return-value]

    def _admit(self, requests: list, tokens_elsewhere: bool, start: int = 0
               ) -> tuple[list, list[int], list[GuidedRequest]]:
        """Check every request of a batch before any matcher sees it; returns the requests
        to build (a failed one replaced by an unguided stand-in with the same rows), the
        slots whose matcher the failures drop, and the checked requests that are not the
        common one (the only ones that can start a compile). Failures are recorded here.

        The common request (generating, target or draft, exact types, the slot's own guide)
        passes the inline test; every other one takes :func:`checked_request` and the slot's
        guide check (:meth:`_check_guide`). ``tokens_elsewhere``: see ``checked_request``.
        ``start``: the requests before it passed the same test in C++ (``FastPath.admit``).
        """
        nseq, V, maxd, guides = (self.max_num_sequences, self.vocab_size_padded,
                                 self.max_num_draft_tokens, self._slot_guides)
        # (no request is read past this loop before the build: a failure here changes nothing)
        updates: list[tuple[int, GuidedDecodingParams]] = []
        dropped: list[int] = []
        failed: list[FailedRequest] = []
        fresh: list[GuidedRequest] = []
        for i in range(start, len(requests)):
            req = requests[i]
            try:  # (an attribute that raises: checked_request names it)
                params = req.guided_decoding_params
                if params is None:
                    if type(req.is_draft) is bool and type(req.is_context_init_state) is bool:
                        continue
                elif (req.is_generation_in_progress_state is True and type(req.is_draft) is bool
                        and req.is_context_init_state is False
                        and req.is_generation_only_first_iteration is False
                        and type(slot := req.seq_slot) is int and 0 <= slot < nseq
                        and guides[slot] is params and type(req.request_id) is int
                        and ((d := req.draft_tokens) is None or type(d) is list)):
                    # (the values this step reads per token, new_token and each draft token,
                    # are checked where they are read, before the request's matcher moves:
                    # by the C++ build, which takes only ints in the vocabulary, and else by
                    # the Python build, as for the capturable decoder's token tensor;
                    # num_accepted_draft_tokens by rollback_rejected_tokens)
                    continue
            except Exception:
                pass
            try:
                checked = checked_request(req, i, num_slots=nseq, vocab_size=V,
                                          max_num_draft_tokens=maxd,
                                          tokens_elsewhere=tokens_elsewhere)
                if checked.guided_decoding_params is not None:
                    self._check_guide(checked, updates)
            except RequestError as e:
                self._refuse(requests, i, e, updates, dropped, failed)
                continue
            requests[i] = checked
            fresh.append(checked)
        for slot, params in updates:
            guides[slot] = params
        self._record_failed(failed)
        return requests, dropped, fresh

    def _check_guide(self, req: GuidedRequest,
                     updates: list[tuple[int, GuidedDecodingParams]]) -> None:
        """A request that creates its slot's matcher records its guide (in ``updates``); one
        that advances it must carry that guide (the same object, or an equal one)."""
        slot = cast(int, req.seq_slot)  # (both checked by checked_request)
        params = cast(GuidedDecodingParams, req.guided_decoding_params)
        if not req.is_draft and (req.is_generation_only_first_iteration
                                 or (req.is_context_init_state and req.is_last_context_chunk)):
            updates.append((slot, params))
            return
        if not req.require_matcher_advance():
            return
        held = self._slot_guides[slot]
        if held is params:
            return
        if held is None:
            raise RequestError(f"seq_slot {slot} has no matcher for this request: no context "
                               "request (or disaggregated first generation step) created "
                               "one, or the slot was released", request_id=req.request_id,
                               seq_slot=slot)
        if held != params:
            raise RequestError(f"guided_decoding_params ({_guide_text(params)}) differ from "
                               f"the guide slot {slot}'s matcher was created for "
                               f"({_guide_text(held)}); a new guide needs a context request",
                               request_id=req.request_id, seq_slot=slot)
        updates.append((slot, params))  # equal: later steps match by identity

    def _refuse(self, requests: list, i: int, error: RequestError,
                updates: list[tuple[int, GuidedDecodingParams]], dropped: list[int],
                failed: list[FailedRequest]) -> None:
        """Replace ``requests[i]`` by an unguided stand-in with its rows and record ``error``.
        The slot's matcher is dropped when it was this request's (its slot, its guide, no
        other request of the batch on that slot) or when this request was to replace it."""
        req = requests[i]
        is_draft, is_context = bool(req.is_draft), bool(req.is_context_init_state)
        rid = as_int(req.request_id)
        requests[i] = GuidedRequest(None, rid, None, None, is_context, False, not is_context,
                                    False, None, is_draft, None, None)
        failed.append((-1 if rid is None else rid, f"{type(error).__name__}: {error}"))
        slot, params = as_int(req.seq_slot), req.guided_decoding_params
        if slot is None or not 0 <= slot < self.max_num_sequences or \
                not isinstance(params, GuidedDecodingParams) or \
                any(as_int(_field(r, "seq_slot")) == slot for k, r in enumerate(requests)
                    if k != i):
            return
        held = self._slot_guides[slot]
        creates = not is_draft and (req.is_generation_only_first_iteration is True
                                    or (is_context and req.is_last_context_chunk is True))
        if creates or held is params or (held is not None and held == params):
            dropped.append(slot)
            if creates:
                updates.append((slot, params))

    def _drop_slots(self, batch: GuidedRequests) -> None:
        """Drop the matchers of ``batch.dropped_slots`` (their requests failed at add_batch),
        after a build still in flight has ended."""
        if self._inflight is not None:
            self._finish_build()
        for slot in batch.dropped_slots:
            self.grammar_matchers[slot] = None
            self._pending_compiles.pop(slot, None)

    def _start_compiles(self, requests: list[GuidedRequest]) -> None:
        """Start compiling the guides of the requests that create a matcher (context,
        disaggregated first step): :meth:`_admit` hands over the only candidates."""
        for req in requests:
            if not (req.is_context_init_state or req.is_generation_only_first_iteration):
                continue  # the common case: a request already generating
            params, slot = req.guided_decoding_params, req.seq_slot
            if params is None or req.is_draft or not self._slot_ok(slot):
                continue
            handle = self._pending_compiles.get(slot)
            if handle is None or handle.params != params:
                self._pending_compiles[slot] = \
                    self.grammar_matcher_factory.compile_async(params)  # type: ignore[arg-type]

    @nvtx_range("GuidedDecoder.execute")
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
        """
        requests = self._require_batch()
        self._check_logits(logits, d2t, requests.num_bitmask_tokens)
        self._take_unbuilt_batch("execute")
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
            self.apply_bitmask(logits, d2t, n)
            self.token_event.record()
        elif self._masked_rows:  # on CPU a step that masks nothing costs nothing more
            self.apply_bitmask(logits, d2t, n)
        self._record_failed(failed)
        return self.take_failed_requests()

    def take_failed_requests(self) -> list[FailedRequest]:
        """Failures recorded since the last call, then forgets them."""
        if self._inflight is not None:
            self._finish_build()
        with self._failed_lock:
            failed, self._failed = self._failed, []
        return failed

    def _record_failed(self, failed: list[FailedRequest]) -> None:
        if failed:
            with self._failed_lock:
                self._failed.extend(failed)

    def build(self) -> list[FailedRequest]:
        """Host work only: advance matchers and fill the host bitmask for the latest batch.

        Raises:
            QueueEpochError: this batch was already built (by ``build`` or ``execute``).
        """
        requests = self._require_batch()
        self._take_unbuilt_batch("build")
        return self._build(requests)

    def _take_unbuilt_batch(self, caller: str) -> None:
        """A batch is built at most once: a second build would feed every token again."""
        if self._batch_built:
            raise QueueEpochError(f"{caller}: the batch of the latest add_batch was already "
                                  "built; call add_batch for the next step first")
        self._batch_built = True

    @nvtx_range("GuidedDecoder.copy_bitmask")
    def copy_bitmask(self, num_rows: int) -> None:
        """Copy the first ``num_rows`` host rows to the device (async from pinned memory)."""
        if self.bitmask is self.bitmask_host:
            return
        self.bitmask[:num_rows].copy_(self.bitmask_host[:num_rows], non_blocking=True)
        self.token_mask[:num_rows].copy_(self.token_mask_host[:num_rows], non_blocking=True)

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
        if self._inflight is not None:
            self._finish_build()
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
            if self.bitmask_size % tp_size:
                raise LayoutError(
                    f"bitmask words per row ({self.bitmask_size} = "
                    f"ceil({self.vocab_size_padded}/32)) is not divisible by tp_size ({tp_size})")
            # not vocab_shard(len(d2t), ...) with d2t: it would demand that the DRAFT vocabulary
            # fill whole bitmask words per shard, which nothing here reads
            col_offset = (vocab_shard(full, tp_size, self.rank).col_offset if d2t is None
                          else self.rank * width)
        logits_bitmask(logits[:num_rows], self.bitmask[:num_rows],
                       self.token_mask[:num_rows], d2t, col_offset=col_offset)

    # -- speculative decoding ----------------------------------------------------------------
    @nvtx_range("GuidedDecoder.rollback_rejected_tokens")
    def rollback_rejected_tokens(self) -> None:
        """Undo the matcher advances the target rejected in verification.

        Call after verification and before the next drafting loop's first build, with the
        requests of the latest ``add_batch`` carrying ``num_accepted_draft_tokens``. The
        accepted count is clamped to what the matcher actually advanced (a draft EOS stops
        the matcher while verification may accept past it). Failures go to the next
        ``execute`` / ``take_failed_requests``.
        """
        self._rollback_rejected_tokens(self._require_batch())

    def _rollback_rejected_tokens(self, requests: GuidedRequests) -> None:
        if self._inflight is not None:
            self._finish_build()
        if self.max_num_draft_tokens <= 0:
            return
        for req in requests.valid_requests():
            slot = req.seq_slot
            if not self._slot_ok(slot) or self.num_advanced_tokens[slot] <= 0:
                continue
            advanced = self.num_advanced_tokens[slot]
            n = req.num_accepted_draft_tokens
            accepted = 0 if n is None else as_int(n)
            matcher = self.grammar_matchers[slot]
            if accepted is None or accepted < 0 or matcher is None:
                self._record_failed([self._fail(req, RequestError(
                    f"cannot roll back: num_accepted_draft_tokens="
                    f"{req.num_accepted_draft_tokens!r}, num_advanced_tokens={advanced}",
                    request_id=req.request_id, seq_slot=slot))])
                continue
            keep = min(1 + accepted, advanced)
            try:
                matcher.rollback(advanced - keep)
            except Exception as e:
                self._record_failed([self._fail(req, e)])
                continue
            self.num_advanced_tokens[slot] = keep  # a second call rolls back nothing

    @nvtx_range("GuidedDecoder.rollback_draft_tokens")
    def rollback_draft_tokens(self) -> None:
        """Undo every advance made by a drafting loop (call after it, before the target build)."""
        self._rollback_draft_tokens(self._require_batch())

    def _rollback_draft_tokens(self, requests: GuidedRequests) -> None:
        if self._inflight is not None:
            self._finish_build()
        if self.max_num_draft_tokens <= 0:
            return
        for req in requests.valid_requests():
            slot = req.seq_slot
            if not self._slot_ok(slot):
                continue
            n = self.num_advanced_draft_tokens[slot]
            matcher = self.grammar_matchers[slot]
            if n > 0 and matcher is not None:
                try:
                    matcher.rollback(n)
                except Exception as e:
                    self._record_failed([self._fail(req, e)])
            self.num_advanced_draft_tokens[slot] = 0
            self.is_draft_terminated[slot] = False

    @nvtx_range("GuidedDecoder.init_disagg_gen_requests")
    def init_disagg_gen_requests(self) -> None:
        """Create matchers for requests whose prefill ran elsewhere (first generation step).

        Call before the drafting loop and the forward of that step.
        """
        self._init_disagg_gen_requests(self._require_batch())

    def _init_disagg_gen_requests(self, requests: GuidedRequests) -> None:
        if self._inflight is not None:
            self._finish_build()
        for req in requests.valid_requests():
            if req.is_generation_only_first_iteration and not req.is_draft:
                try:
                    self._check_slot(req)
                    self.grammar_matchers[req.seq_slot] = self._create_matcher(req)  # type: ignore[index]
                except Exception as e:
                    self._record_failed([self._fail(req, e)])

    def release(self, seq_slot: int) -> None:
        """Forget the matcher and counters of a slot whose request has finished.

        Raises:
            RequestError: ``seq_slot`` is outside ``[0, max_num_sequences)``.
        """
        slot = as_int(seq_slot)
        if slot is None or not self._slot_ok(slot):
            raise RequestError(f"release: seq_slot {seq_slot!r} is not a slot index in [0, "
                               f"max_num_sequences={self.max_num_sequences})", seq_slot=slot)
        seq_slot = slot
        if self._inflight is not None:
            self._finish_build()
        self.grammar_matchers[seq_slot] = None
        self._slot_guides[seq_slot] = None
        self._pending_compiles.pop(seq_slot, None)
        self.num_advanced_tokens[seq_slot] = self.num_guided_tokens[seq_slot] = 0
        self.num_advanced_draft_tokens[seq_slot] = 0
        self.is_draft_terminated[seq_slot] = False

    def close(self) -> None:
        """Release what the decoder owns: the compile pool of a factory it built itself
        (a factory passed in stays open for its other users) and the C++ build's thread."""
        if self._inflight is not None:
            self._finish_build()
        if self._fast is not None:
            self._fast.close(self._fast.state)
        if self._owns_factory:
            self.grammar_matcher_factory.close()

    # -- build -------------------------------------------------------------------------------
    @nvtx_range("GuidedDecoder.build")
    def _build(self, requests: GuidedRequests, asynchronous: bool = False,
               clear_rows: int | None = None) -> list[FailedRequest]:
        """Init and advance every guided request's matcher, fill its rows, guard dead ends.

        This runs on every decode step, so it is written for the common request (a target
        request generating, with a valid slot and token). With the C++ build's CPython entry
        (:meth:`NativeBuilder.bind_fast`), a batch of only such requests (unguided ones
        aside) is read and built in C++ in one call, the GIL released while xgrammar works;
        any other batch, or a decoder without that entry, runs the loop below, where the
        common request is checked inline and everything else takes :meth:`_prepare`. The
        work is kept in columns (:class:`_Active`) so that each stage is one batched backend
        call plus a few C-level list operations, and requests are dropped from the columns
        only when something unusual happens to them.

        ``asynchronous`` (the capturable decoder's CPU host step): where the CPython entry
        takes the batch, its xgrammar work runs on the entry's own thread, which never takes
        the GIL, and this returns at once; :meth:`_finish_build` ends it, and everything that
        reads the matchers, counters or masks calls that first (the mask application, the
        rollbacks, ``take_failed_requests``, the next build). Its failures are recorded then.
        ``clear_rows``: token-mask rows zeroed first (default: the batch layout's rows).
        """
        if self._inflight is not None:
            self._finish_build()
        clear = requests.num_bitmask_tokens if clear_rows is None else clear_rows
        fast = self._fast
        if fast is not None:  # the whole step in C++ when every guided request is plain
            args = (fast.state, requests.requests, requests.offsets,
                    requests.max_num_draft_tokens, clear)
            if asynchronous:
                if fast.begin(*args):
                    self._inflight = (requests, fast)
                    self._masked_rows = True  # (until the join says: the token mask decides)
                    return []
            else:
                result = fast.step(*args)
                if result is not None:
                    return self._fast_outcome(requests, result)
        self._token_mask_np[:clear] = 0  # first: a build that fails part-way masks nothing
        failed: list[FailedRequest] = []
        self._masked_rows = False
        reqs: list[GuidedRequest] = []
        slots: list[int] = []
        matchers: list[GrammarMatcher] = []
        offsets: list[int] = []
        drafts: list[Sequence[int]] = []
        tokens: list[int | None] = []
        act = _Active(reqs, slots, matchers, offsets, drafts, tokens)
        seen: set[int] = set()
        draft_slots: list[int] = []
        nseq, V, draft_len = self.max_num_sequences, self.vocab_size_padded, \
            requests.max_num_draft_tokens
        grammar_matchers, advanced, guided = (self.grammar_matchers, self.num_advanced_tokens,
                                              self.num_guided_tokens)
        draft_terminated = self.is_draft_terminated
        add_req, add_slot, add_matcher, add_offset, add_drafts, add_token = (
            reqs.append, slots.append, matchers.append, offsets.append, drafts.append,
            tokens.append)
        for req, offset in zip(requests.requests, requests.offsets):
            if req.guided_decoding_params is None:
                continue
            slot, token = req.seq_slot, req.new_token
            if (req.is_generation_in_progress_state and not req.is_draft
                    and not req.is_context_init_state and type(slot) is int
                    and 0 <= slot < nseq and slot not in seen
                    and type(token) is int and 0 <= token < V):
                seen.add(slot)
                advanced[slot] = guided[slot] = 0
                req_drafts = req.draft_tokens
                if req_drafts:
                    try:
                        req_drafts = self._checked_drafts(req, draft_len)
                    except Exception as e:
                        failed.append(self._fail(req, e))
                        continue
                matcher = grammar_matchers[slot]
                try:  # (every matcher call sits inside the per-request isolation)
                    if matcher is None or matcher.is_terminated() or draft_terminated[slot]:
                        continue
                except Exception as e:
                    failed.append(self._fail(req, e))
                    continue
                add_req(req)
                add_slot(slot)
                add_matcher(matcher)
                add_offset(offset)
                add_drafts(req_drafts or ())
                add_token(token)
                continue
            duplicate = slot in seen  # then the slot's matcher belongs to another request
            try:
                entry = self._prepare(req, offset, draft_len, seen)
            except Exception as e:
                failed.append(self._fail(req, e, drop=not duplicate))
                continue
            if req.is_draft:
                draft_slots.append(slot)  # type: ignore[arg-type]
            if entry is not None:
                for column, value in zip(act.columns, entry):
                    column.append(value)
        native = self._native
        handles = None if native is None or not reqs else \
            self.grammar_matcher_factory.native_handles(matchers)
        if handles is not None:
            self._build_native(native, handles, act, failed, draft_len)  # type: ignore[arg-type]
        elif reqs:
            self._build_python(act, failed, draft_len)
        for slot in draft_slots:
            self.num_advanced_draft_tokens[slot] += advanced[slot]
        return failed

    def _fast_outcome(self, requests: GuidedRequests, result: tuple) -> list[FailedRequest]:
        """The failures (and counters, flags) of a step the CPython entry ran."""
        self._masked_rows, unusual = result
        if unusual is None:
            return []
        failed: list[FailedRequest] = []
        for i, status, message in unusual:
            req = requests.requests[i]
            self._native_outcome(req, req.seq_slot, req.new_token, status, message, failed)
        return failed

    def _finish_build(self) -> None:
        """Wait for the build ``_build(asynchronous=True)`` started (GIL released) and record
        its failures; a no-op when none is in flight."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return
        requests, fast = inflight
        try:
            failed = self._fast_outcome(requests, fast.end(fast.state))
        except BaseException:
            self._token_mask_np[:] = 0  # as a build that raises: this step masks nothing
            raise
        self._record_failed(failed)

    def _prepare(self, req: GuidedRequest, offset: int, draft_len: int, seen: set[int]
                 ) -> tuple | None:
        """Validate one request and create its matcher if due; None if it has nothing to do,
        else its :class:`_Active` row ``(req, slot, matcher, offset, drafts, new token or
        None)``."""
        slot = self._check_slot(req)
        if slot in seen:
            raise RequestError(f"seq_slot {slot} appears twice in one batch",
                               request_id=req.request_id, seq_slot=slot)
        seen.add(slot)
        self.num_advanced_tokens[slot] = 0
        self.num_guided_tokens[slot] = 0
        init, advance = req.require_matcher_init(), req.require_matcher_advance()
        if not (init or advance):
            return None
        drafts = self._checked_drafts(req, draft_len)
        if init:
            self.grammar_matchers[slot] = None
            self.grammar_matchers[slot] = self._create_matcher(req)
        matcher = self.grammar_matchers[slot]
        if matcher is None or matcher.is_terminated():
            return None
        if not advance:
            return (req, slot, matcher, offset, drafts, None)
        # Skipped, not failed: the drafting loop stopped guiding this slot.
        if self.is_draft_terminated[slot]:
            return None
        return (req, slot, matcher, offset, drafts,
                self._checked_token(req, req.new_token, "new_token"))

    def _accept(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list | None:
        """One batched accept; None when every token was accepted and none was a stop token
        (the common case, checked with C-level list operations), else the per-matcher results.
        A matcher terminates only by accepting a stop token (see ``GrammarMatcher``)."""
        results = self.grammar_matcher_factory.batch_accept(matchers, tokens)
        if results.count(True) == len(results) and self._stop_ids.isdisjoint(tokens):
            return None
        return results

    def _accept_new_tokens(self, act: "_Active", failed: list[FailedRequest]) -> "_Active":
        """Feed each request its new token (one batched call); the requests left to fill."""
        reqs, slots, matchers, _, _, tokens = act.columns
        advanced = self.num_advanced_tokens
        if None in tokens:  # matchers created this step fill without advancing
            idx = [k for k, t in enumerate(tokens) if t is not None]
            if not idx:
                return act
            adv = _Active.select(act, idx)
        else:
            idx, adv = None, act
        results = self._accept(adv.matchers, cast("list[int]", adv.tokens))  # no None left
        if results is None:
            for slot in adv.slots:
                advanced[slot] += 1
            return act
        keep = [k for k, t in enumerate(tokens) if t is None]
        stops = self._stop_ids
        for j, ok in enumerate(results):
            k = j if idx is None else idx[j]
            req, slot = reqs[k], slots[k]
            if ok is True:
                advanced[slot] += 1
                try:
                    if tokens[k] not in stops or not matchers[k].is_terminated():
                        keep.append(k)
                except Exception as e:
                    failed.append(self._fail(req, e))
            elif isinstance(ok, BaseException):
                failed.append(self._fail(req, ok))
            else:
                self._new_token_rejected(req, slot, tokens[k], failed)
        keep.sort()
        return _Active.select(act, keep)

    def _build_python(self, act: "_Active", failed: list[FailedRequest], draft_len: int
                      ) -> None:
        """The Python build of the requests in ``act``: request by request
        (:meth:`_fill_sequential`) for a small batch, else in batched rounds
        (:meth:`_fill_rounds`).

        The host-step budget (``GuidedDecodingConfig.host_step_budget_ms``): request by
        request, each request's accept and fills are timed and a request over the budget fails
        at once. A batched call cannot be timed per request, so the rounds time each batched
        call instead (a few clock reads per step, whatever the batch size), and when one took
        longer than the budget, the next build of this decoder runs request by request, timed,
        which fails the culprit there; a batch that was merely large goes back to rounds after
        that one step. So a pathological request slows at most two steps (the batched one that
        revealed it and the timed one that names it), and the common step pays no per-request
        clock reads.
        """
        if self._budget_probe or len(act.reqs) <= self.sequential_fill_max:
            self._budget_probe = False
            self._fill_sequential(act, failed, draft_len)
        else:
            self._fill_rounds(act, failed, draft_len)

    def _over_budget(self, req: GuidedRequest, slot: int, rows: range, elapsed_s: float,
                     failed: list[FailedRequest]) -> None:
        """``req`` went over the host-step budget: its ``rows`` of this step are unmasked, its
        counts zeroed (its advances are never rolled back: the matcher is dropped) and it
        fails alone."""
        self._token_mask_np[rows.start:rows.stop] = 0
        self.num_advanced_tokens[slot] = self.num_guided_tokens[slot] = 0
        failed.append(self._fail(req, BudgetExceededError(
            request_id=req.request_id, seq_slot=slot, elapsed_ms=elapsed_s * 1e3,
            budget_ms=self._budget_ms)))

    def _fill_rounds(self, act: "_Active", failed: list[FailedRequest], draft_len: int
                     ) -> None:
        """Feed every request its new token with one batch call; then round i fills row
        ``offset + i`` of every still-guided request with one batch call, checks dead ends for
        all of them at once, then feeds each its i-th draft token (at most ``draft_len``
        rounds after the first). With a budget, each batched call is timed
        (:meth:`_build_python`)."""
        budget = self._budget_s
        start = perf_counter() if budget else 0.0
        act = self._accept_new_tokens(act, failed)
        if budget and perf_counter() - start > budget:
            self._budget_probe = True
        bitmask = self.bitmask_host
        factory = self.grammar_matcher_factory
        guided, advanced = self.num_guided_tokens, self.num_advanced_tokens
        token_mask = self._token_mask_np
        i = 0
        while act.reqs:
            rows = act.offsets if i == 0 else [o + i for o in act.offsets]
            if budget:
                start = perf_counter()
            try:
                factory.batch_fill(act.matchers, bitmask, rows)
                if budget and perf_counter() - start > budget:
                    self._budget_probe = True  # the next build times each request alone
            except Exception:  # find the culprit(s): fill one by one
                keep = self._fill_each(act, rows, failed)
                act, rows = _Active.select(act, keep), [rows[k] for k in keep]
                if not rows:
                    return
            if self._tail is not None:
                self._clear_tail(rows)
            dead = self._dead_rows(rows)
            if dead:
                keep = self._drop_dead(act, dead, i, failed)
                act, rows = _Active.select(act, keep), [rows[k] for k in keep]
            for slot in act.slots:
                guided[slot] += 1
            if len(rows) == 1:
                token_mask[rows[0]] = 1
            elif rows:
                token_mask[rows] = 1
            if rows:
                self._masked_rows = True
            if i >= draft_len:  # no request has a draft token left
                return
            # feed each request its i-th draft token; the ones that took it go on
            drafts = act.drafts
            idx = [k for k, d in enumerate(drafts) if len(d) > i]
            if not idx:
                return
            nxt = act if len(idx) == len(drafts) else _Active.select(act, idx)
            tokens = [d[i] for d in nxt.drafts]
            if budget:
                start = perf_counter()
            results = self._accept(nxt.matchers, tokens)
            if budget and perf_counter() - start > budget:
                self._budget_probe = True
            if results is not None:
                keep = []
                for k, ok in enumerate(results):
                    if ok is True:
                        advanced[nxt.slots[k]] += 1
                        try:
                            if tokens[k] not in self._stop_ids or \
                                    not nxt.matchers[k].is_terminated():
                                keep.append(k)
                        except Exception as e:
                            failed.append(self._fail(nxt.reqs[k], e))
                    elif isinstance(ok, BaseException):
                        failed.append(self._fail(nxt.reqs[k], ok))
                    # False: the draft left the grammar; its later positions stay unguided
                nxt = _Active.select(nxt, keep)
            else:
                for slot in nxt.slots:
                    advanced[slot] += 1
            act = nxt
            i += 1

    def _fill_sequential(self, act: "_Active", failed: list[FailedRequest],
                         draft_len: int) -> None:
        """The work of :meth:`_fill_rounds`, request by request: for a batch of one or two the
        rounds' per-round list building costs more than their batched calls save (measured:
        Tekken, batch 1, 4 drafts: 24 us per step in rounds). Same rows, masks, counters and
        failures (in request order rather than round order). With a budget, each request's
        accept and fills are timed, the clock read after each filled row (the C++ loop reads
        it once per request: its step is a few microseconds), and a request over it stops and
        fails (:meth:`_over_budget`)."""
        bitmask, token_mask, stops = self.bitmask_host, self._token_mask_np, self._stop_ids
        guided, advanced = self.num_guided_tokens, self.num_advanced_tokens
        budget = self._budget_s
        for req, slot, matcher, offset, drafts, token in zip(
                act.reqs, act.slots, act.matchers, act.offsets, act.drafts, act.tokens):
            start = perf_counter() if budget else 0.0
            if token is not None:  # None: a matcher created this step fills without advancing
                try:
                    if not matcher.accept_token(token):
                        self._new_token_rejected(req, slot, token, failed)
                        continue
                    advanced[slot] += 1
                    if token in stops and matcher.is_terminated():
                        continue
                except Exception as e:
                    failed.append(self._fail(req, e))
                    continue
            i = 0
            while True:
                row = offset + i
                try:
                    matcher.fill_next_token_bitmask(bitmask, row)
                except Exception as e:
                    failed.append(self._fail(req, e))
                    break
                if self._tail is not None:
                    self._clear_tail([row])
                if self._dead_rows([row]):
                    self._dead_end(req, slot, i, failed)
                    break
                guided[slot] += 1
                token_mask[row] = 1
                self._masked_rows = True
                if budget and (elapsed := perf_counter() - start) > budget:
                    self._over_budget(req, slot, range(offset, row + 1), elapsed, failed)
                    break
                if i >= draft_len or i >= len(drafts):
                    break
                token = drafts[i]
                try:
                    if not matcher.accept_token(token):
                        break  # the draft left the grammar; its later positions stay unguided
                except Exception as e:
                    failed.append(self._fail(req, e))
                    break
                advanced[slot] += 1
                try:
                    if token in stops and matcher.is_terminated():
                        break
                except Exception as e:
                    failed.append(self._fail(req, e))
                    break
                i += 1

    def _build_native(self, native: NativeBuilder, handles: list, act: "_Active",
                      failed: list[FailedRequest], draft_len: int) -> None:
        """The work of :meth:`_accept_new_tokens` + :meth:`_fill_sequential` in one C++ call
        (``csrc/host_build.cc``): same rows, masks, counters and failures (in request order).
        The token mask is already cleared (``_build``), so the step clears no rows."""
        tokens = act.tokens
        if None in tokens:  # matchers created this step fill without advancing
            tokens = [-1 if t is None else t for t in tokens]
        if draft_len:
            drafts = act.drafts
            num_drafts = [len(d) for d in drafts]
            flat = [t for d in drafts for t in d]
        else:
            num_drafts = flat = []
        unusual = native.step(handles, tokens, act.offsets, num_drafts, flat, draft_len, 0)
        out = native.out[:len(handles)].tolist()
        advanced, guided = self.num_advanced_tokens, self.num_guided_tokens
        masked = False
        for slot, (_, a, g) in zip(act.slots, out):
            advanced[slot] += a
            if g:
                guided[slot] += g
                masked = True
        if masked:
            self._masked_rows = True
        if not unusual:
            return
        errors = iter(native.errors())
        for k, (status, _, _) in enumerate(out):
            if status:
                self._native_outcome(act.reqs[k], act.slots[k], act.tokens[k], status,
                                     next(errors) if status & ~TERMINATED in _WITH_MESSAGE
                                     else None, failed)

    def _native_outcome(self, req: GuidedRequest, slot: int, token: int | None, status: int,
                        message: str | None, failed: list[FailedRequest]) -> None:
        """What a C++ step's status other than plain OK means for ``req`` (its counters are
        already written): a terminated matcher re-reads its state; a refused token, a dead
        end, a fault (``message``) or an overrun of the host-step budget (``message``: the
        milliseconds measured; its rows are already unmasked) is handled as the Python build
        handles it."""
        if status & TERMINATED:
            try:  # (inside the per-request isolation, as every matcher call)
                self.grammar_matchers[slot].sync_state()  # type: ignore[union-attr]
            except Exception as e:
                failed.append(self._fail(req, e))
                return
        status &= ~TERMINATED
        if status == STATUS_REJECTED:
            self._new_token_rejected(req, slot, token, failed)
        elif status == STATUS_DEAD_END:
            self._dead_end(req, slot, 0, failed)
        elif status == STATUS_FAULT:
            failed.append(self._fail_message(req, message or "native build fault"))
        elif status == STATUS_OVER_BUDGET:
            self._over_budget(req, slot, range(0), float(message or "nan") / 1e3, failed)

    def _new_token_rejected(self, req: GuidedRequest, slot: int, token: int | None,
                            failed: list[FailedRequest]) -> None:
        """The grammar refused ``req``'s new token: a draft step stops guiding its draft; a
        target request fails (its matcher is dropped)."""
        if req.is_draft:
            self.is_draft_terminated[slot] = True
        else:
            failed.append(self._fail(req, RequestError(
                f"new_token {token} is not allowed by the grammar",
                request_id=req.request_id, seq_slot=slot)))

    def _drop_dead(self, act: "_Active", dead: list[int], i: int,
                   failed: list[FailedRequest]) -> list[int]:
        """Handle the requests whose row ``i`` allows no token: a target request's golden row
        fails the request; a draft-step row stops guiding that draft; a dead draft position
        is left unconstrained (the verification rejects it). Returns the positions kept."""
        for k in dead:
            self._dead_end(act.reqs[k], act.slots[k], i, failed)
        gone = set(dead)
        return [k for k in range(len(act.reqs)) if k not in gone]

    def _dead_end(self, req: GuidedRequest, slot: int, i: int,
                  failed: list[FailedRequest]) -> None:
        """Row ``i`` of ``req`` allows no token (see :meth:`_drop_dead`)."""
        if i == 0 and not req.is_draft:
            # the golden token's advance is never verified: exclude it from rollback
            self.num_advanced_tokens[slot] = 0
            failed.append(self._fail(req, DeadEndError(
                f"request {req.request_id} at slot {slot} reached a grammar state "
                "with no valid token")))
        elif i == 0:
            self.is_draft_terminated[slot] = True

    def _fill_each(self, act: "_Active", rows: list[int], failed: list[FailedRequest]
                   ) -> list[int]:
        """Fill row by row after a batch fill raised; the positions that filled."""
        keep = []
        for k, (matcher, row) in enumerate(zip(act.matchers, rows)):
            try:
                matcher.fill_next_token_bitmask(self.bitmask_host, row)
            except Exception as e:
                failed.append(self._fail(act.reqs[k], e))
                continue
            keep.append(k)
        return keep

    def _dead_rows(self, rows: list[int]) -> list[int]:
        """Dead-end guard: positions in ``rows`` whose row allows no token below
        ``vocab_size_padded`` (usually none).

        Up to 8 rows: one bytes comparison per row (a memcmp, ~0.4 us at V = 131072) beats
        NumPy's call costs. Many rows: first a look at the few words that hold most
        of the factory's likely-allowed ids (single-byte tokens, set in almost every state),
        then a full scan of only the rows where none of them is set.
        """
        bm, full, zero, tail = (self._bitmask_np, self._full_words, self._zero_words,
                                self._tail_word_mask)
        n = len(rows)
        if n == 1:
            r = rows[0]
            if bm[r, :full].tobytes() != zero or (tail is not None and bm[r, full] & tail):
                return []
            return [0]
        candidates: Sequence[int] = range(n)
        if n > 8 and self._probe is not None:
            lo, hi = self._probe
            r0, step = rows[0], rows[1] - rows[0]
            if step > 0 and rows[-1] == r0 + step * (n - 1) and \
                    rows == list(range(r0, rows[-1] + 1, step)):
                window = bm[r0:rows[-1] + 1:step, lo:hi]  # a view: the common layout
            else:
                window = bm[np.asarray(rows), lo:hi]
            hit = window.any(axis=1)
            if hit.all():
                return []
            candidates = np.flatnonzero(~hit).tolist()
        return [k for k in candidates if bm[rows[k], :full].tobytes() == zero
                and (tail is None or not bm[rows[k], full] & tail)]

    def _clear_tail(self, rows: list[int]) -> None:
        """Clear bits of ids >= the tokenizer's vocabulary (padding ids are never allowed)."""
        if self._tail is None:
            return
        word, bits = self._tail
        bm = self._bitmask_np
        if bits:
            bm[rows, word] &= np.int32((1 << bits) - 1)
            word += 1
        if word < self.bitmask_size:
            bm[np.asarray(rows)[:, None], np.arange(word, self.bitmask_size)] = 0

    # -- helpers -----------------------------------------------------------------------------
    def _create_matcher(self, req: GuidedRequest) -> GrammarMatcher:
        params = req.guided_decoding_params
        handle = self._pending_compiles.pop(req.seq_slot, None)  # type: ignore[arg-type]
        if handle is None or handle.params != params:
            handle = self.grammar_matcher_factory.compile_async(params)  # type: ignore[arg-type]
        compiled = handle.result(self.config.compile_timeout_s, backend=self.backend,
                                 request_id=req.request_id)
        return self.grammar_matcher_factory.create_from_compiled(compiled)

    def _checked_token(self, req: GuidedRequest, token: object, what: str) -> int:
        """``token`` as an int in the vocabulary (never a truncated float or a bool); the
        capturable decoder's token tensor and add_batch's fast path leave this to the build."""
        value = as_int(token)
        if value is None or not 0 <= value < self.vocab_size_padded:
            raise RequestError(f"{what} {token!r} is "
                               + ("not an integer token id" if value is None else
                                  f"outside the vocabulary [0, {self.vocab_size_padded})"),
                               request_id=req.request_id, seq_slot=req.seq_slot)
        return value

    def _checked_drafts(self, req: GuidedRequest, draft_len: int) -> list[int]:
        drafts = req.draft_tokens
        if not drafts or req.is_draft:
            return []
        if len(drafts) > self.max_num_draft_tokens:
            raise RequestError(f"{len(drafts)} draft tokens exceed max_num_draft_tokens="
                               f"{self.max_num_draft_tokens}", request_id=req.request_id,
                               seq_slot=req.seq_slot)
        # only this step's runtime draft length has rows reserved
        return [self._checked_token(req, t, "draft token") for t in drafts[:draft_len]]

    def _slot_ok(self, slot: int | None) -> TypeGuard[int]:
        return slot is not None and 0 <= slot < self.max_num_sequences

    def _check_slot(self, req: GuidedRequest) -> int:
        if not self._slot_ok(req.seq_slot):
            raise RequestError(f"seq_slot {req.seq_slot!r} is outside [0, max_num_sequences="
                               f"{self.max_num_sequences})", request_id=req.request_id,
                               seq_slot=req.seq_slot)
        return req.seq_slot  # type: ignore[return-value]

    def _fail(self, req: GuidedRequest, error: BaseException, drop: bool = True
              ) -> FailedRequest:
        """Record a request's failure; its matcher is dropped so later steps leave it unmasked."""
        return self._fail_message(req, f"{type(error).__name__}: {error}", drop)

    def _fail_message(self, req: GuidedRequest, message: str, drop: bool = True
                      ) -> FailedRequest:
        """``drop``: the slot is left as a dead end leaves it, matcher dropped and advance
        count zeroed, so that no later rollback reports this failure a second time (False
        where the slot belongs to another request of the batch)."""
        if drop and self._slot_ok(req.seq_slot):
            self.grammar_matchers[req.seq_slot] = None  # type: ignore[index]
            self.num_advanced_tokens[req.seq_slot] = 0  # type: ignore[index]
        return _request_id(req), message

    def _require_batch(self) -> GuidedRequests:
        if self.requests is None:
            raise LayoutError("no batch: call add_batch() first")
        return self.requests

    def _check_logits(self, logits: torch.Tensor, d2t: torch.Tensor | None,
                      rows: int | None, min_rows: int | None = None) -> None:
        """Refuse bad logits / d2t before the build advances any matcher. ``rows``: the exact
        row count; None: at least ``min_rows`` (default: the batch layout's rows)."""
        # (every step runs this: each tensor attribute read below is a call into torch)
        if not isinstance(logits, torch.Tensor) or len(shape := logits.shape) != 2:
            raise TensorArgError(f"logits must be a 2-D tensor, got "
                                 f"{getattr(logits, 'shape', type(logits))}")
        if self._on_cpu:
            misplaced = not logits.is_cpu
        else:
            device = logits.device
            misplaced = device != self.device and not (
                device.type == "cuda" and self.device.index is None)
        if misplaced:
            raise TensorArgError(f"logits are on {logits.device}, the decoder on {self.device}")
        if rows is None:  # capturable: static rows, at least the layout's (padding allowed)
            rows = self._require_batch().num_bitmask_tokens if min_rows is None else min_rows
            if shape[0] < rows:
                raise TensorArgError(f"logits have {shape[0]} rows, fewer than the "
                                     f"batch layout's {rows}")
            if shape[0] > self.bitmask_host.shape[0]:
                raise TensorArgError(f"logits have {shape[0]} rows, more than the decoder's "
                                     f"{self.bitmask_host.shape[0]} (max_num_sequences * "
                                     "(max_num_draft_tokens + 1))")
        elif shape[0] != rows:
            raise TensorArgError(f"logits have {shape[0]} rows, the batch layout has "
                                 f"{rows} (1 per context request, 1 + draft length per "
                                 "generation request)")
        if logits.dtype not in _FLOAT_DTYPES:
            raise TensorArgError(f"logits must be float32, float16 or bfloat16, got "
                                 f"{logits.dtype}")
        width = shape[1]
        if width > 1 and logits.stride(1) != 1:
            raise TensorArgError(f"logits columns must be contiguous (stride(1) == 1), got "
                                 f"strides {tuple(logits.stride())}: pass .contiguous() logits")
        if shape[0] > 1 and logits.stride(0) < width:
            raise TensorArgError(f"logits rows overlap (stride(0)={logits.stride(0)} < width "
                                 f"{width}, e.g. an expand()ed tensor): each row is masked "
                                 "for its own request, so rows need memory of their own")
        if d2t is not None:
            if not isinstance(d2t, torch.Tensor) or d2t.dim() != 1:
                raise TensorArgError(f"d2t must be a 1-D tensor, got shape "
                                     f"{tuple(getattr(d2t, 'shape', ()))}")
            if d2t.dtype != torch.int32:
                raise TensorArgError(f"d2t must be int32, got {d2t.dtype}")
            if d2t.device != logits.device:
                raise TensorArgError(f"d2t is on {d2t.device}, logits on {logits.device}")
            self.check_d2t(d2t)
        # (all of this is checked before the build advances any matcher: a retry after the
        # error must find the matchers where they were)
        full = self.vocab_size_padded if d2t is None else d2t.shape[0]
        if width == 0 or full % width:
            what = "vocab_size_padded" if d2t is None else "len(d2t)"
            raise TensorArgError(f"logits width {width} is not the full vocabulary nor a "
                                 f"tensor-parallel shard of it ({what}={full})")
        tp_size = full // width
        if tp_size > 1:  # a shard: checked here, before the build advances any matcher
            if self.rank >= tp_size:
                raise TensorArgError(f"rank {self.rank} is outside the {tp_size} shards "
                                     f"implied by logits width {width}")
            if self.bitmask_size % tp_size:
                raise LayoutError(
                    f"bitmask words per row ({self.bitmask_size} = "
                    f"ceil({self.vocab_size_padded}/32)) is not divisible by tp_size ({tp_size})")

    def check_d2t(self, d2t: torch.Tensor) -> None:
        """Check that every draft id ``g`` of ``d2t`` maps to a target id ``g + d2t[g]`` in
        ``[0, vocab_size_padded)``; ``execute`` calls it on the table it is given.

        The check reads the values (a host sync on CUDA), so a table is checked once and
        remembered by (data_ptr, ``_version``, length, device): an in-place change through
        torch bumps ``_version`` and the table is checked again. Inside a CUDA graph capture an
        unchecked table is not read (a sync there would break the capture): run one step
        outside the capture first, as warm-up does, or call this before capturing. A replay
        runs no Python check: after changing a captured table in place, call this again.

        Raises:
            TensorArgError: a target id is out of range (names the draft id and its target).
        """
        key = (d2t.data_ptr(), d2t._version, d2t.shape[0], d2t.device)
        if key in self._d2t_checked:
            return
        if d2t.is_cuda and torch.cuda.is_current_stream_capturing():
            return  # (see check_d2t)
        targets = d2t.to(torch.int64) + torch.arange(d2t.shape[0], device=d2t.device)
        bad = (targets < 0) | (targets >= self.vocab_size_padded)
        if bool(bad.any()):
            g = int(bad.nonzero()[0, 0])
            raise TensorArgError(f"d2t maps draft id {g} to target id {int(targets[g])} "
                                 f"(= {g} + d2t[{g}]), outside [0, vocab_size_padded="
                                 f"{self.vocab_size_padded})")
        self._d2t_checked = [key, *self._d2t_checked[:7]]


_native_warned = False


def _warn_native_unavailable(reason: str) -> None:
    """Say once per process that the Python build runs instead of the C++ one."""
    global _native_warned
    if not _native_warned:
        _native_warned = True
        warnings.warn(f"capgraph: the C++ host build is unavailable, the Python build runs "
                      f"instead (same results, slower per step at small batch; set "
                      f"GuidedDecodingConfig.native_build='off' or CAPGRAPH_NATIVE_BUILD=off "
                      f"to silence this): {reason}", RuntimeWarning, stacklevel=3)


def _constructor_int(name: str, value: object, minimum: int) -> None:
    if type(value) is not int or value < minimum:
        raise ConfigError(f"{name}={value!r} must be an int >= {minimum}")


def _field(request: object, name: str) -> object:
    """``request.<name>``, or None where reading it fails."""
    try:
        return getattr(request, name)
    except Exception:
        return None


def _guide_text(params: GuidedDecodingParams) -> str:
    guide = params.guide if len(params.guide) <= 40 else params.guide[:37] + "..."
    return f"{params.guide_type.name} {guide!r}"


def _request_id(req: GuidedRequest) -> int:
    """The id reported for a request: its ``request_id``, or -1 when it has none."""
    return req.request_id if req.request_id is not None else -1


def _probe_window(token_ids: Sequence[int], full_words: int, width: int = 16
                  ) -> tuple[int, int] | None:
    """The ``[lo, hi)`` run of at most ``width`` bitmask words (below ``full_words``) that
    holds the most of ``token_ids``; None if none of them lies there."""
    words = sorted({t // 32 for t in token_ids if 0 <= t // 32 < full_words})
    if not words:
        return None
    best, best_lo, j = 0, words[0], 0
    for k, lo in enumerate(words):  # two pointers over the sorted words
        while j < len(words) and words[j] < lo + width:
            j += 1
        if j - k > best:
            best, best_lo = j - k, lo
    return best_lo, min(best_lo + width, full_words)


# the C++ statuses that come with an errors() entry: a fault's message, the ms over budget
_WITH_MESSAGE = (STATUS_FAULT, STATUS_OVER_BUDGET)


class _Active:
    """The requests still being guided in a build, as parallel columns (one row each):
    ``reqs``, ``slots``, ``matchers``, ``offsets`` (first bitmask row), ``drafts``, ``tokens``
    (the new token, or None for a matcher created this step)."""

    __slots__ = ("reqs", "slots", "matchers", "offsets", "drafts", "tokens")

    def __init__(self, reqs: list[GuidedRequest], slots: list[int],
                 matchers: list[GrammarMatcher], offsets: list[int],
                 drafts: list[Sequence[int]], tokens: list[int | None]) -> None:
        self.reqs, self.slots, self.matchers = reqs, slots, matchers
        self.offsets, self.drafts, self.tokens = offsets, drafts, tokens

    @property
    def columns(self) -> tuple[list, list, list, list, list, list]:
        return self.reqs, self.slots, self.matchers, self.offsets, self.drafts, self.tokens

    @staticmethod
    def select(act: "_Active", idx: Sequence[int]) -> "_Active":
        """The rows ``idx`` of ``act``, in that order."""
        return _Active(*([column[k] for k in idx] for column in act.columns))
