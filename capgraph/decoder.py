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

import threading
from typing import Sequence

import numpy as np
import torch

from ._nvtx import nvtx_range
from .bitmask import (allocate_host_bitmask, allocate_host_token_mask, bitmask_dtype,
                      split_last_word,
                      token_mask_dtype, vocab_shard, words_per_row)
from .errors import (ConfigError, DeadEndError, LayoutError, RequestError, TensorArgError)
from .grammar import CompileHandle, GrammarMatcher, GrammarMatcherFactory, create_matcher_factory
from .ops import logits_bitmask
from .params import GuidedDecodingConfig
from .requests import GuidedRequest, GuidedRequests
from .streams import CudaStepStreams

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
            events; on CPU the device buffers are the host buffers (no copy).
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

    def __init__(self, config: GuidedDecodingConfig, max_num_sequences: int,
                 max_num_draft_tokens: int = 0, vocab_size_padded: int | None = None,
                 device: torch.device | str = "cpu", rank: int = 0,
                 factory: GrammarMatcherFactory | None = None) -> None:
        if not isinstance(max_num_sequences, int) or max_num_sequences < 1:
            raise ConfigError(f"max_num_sequences must be an int >= 1, got {max_num_sequences!r}")
        if not isinstance(max_num_draft_tokens, int) or max_num_draft_tokens < 0:
            raise ConfigError(
                f"max_num_draft_tokens must be an int >= 0, got {max_num_draft_tokens!r}")
        V = config.vocab_size_padded if vocab_size_padded is None else vocab_size_padded
        if V != config.vocab_size_padded:
            raise ConfigError(f"vocab_size_padded={V} differs from the config's "
                              f"vocab_size_padded={config.vocab_size_padded}")
        if rank < 0:
            raise ConfigError(f"rank must be >= 0, got {rank}")
        self.config = config
        self.max_num_sequences = max_num_sequences
        self.max_num_draft_tokens = max_num_draft_tokens
        self.vocab_size_padded: int = V  # type: ignore[assignment]
        self.rank = rank
        self.device = torch.device(device)
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
            self._streams = CudaStepStreams(self.device)
            self.stream = self._streams.stream
            self.token_event = self._streams.token_event
            self.bitmask_event = self._streams.bitmask_event

        # Per-slot bookkeeping (plain lists: read and written per request on the host).
        self.grammar_matchers: list[GrammarMatcher | None] = [None] * max_num_sequences
        self.num_advanced_tokens = [0] * max_num_sequences  # accepted in the last build
        self.num_guided_tokens = [0] * max_num_sequences  # rows masked in the last build
        self.num_advanced_draft_tokens = [0] * max_num_sequences  # over a drafting loop
        self.is_draft_terminated = [False] * max_num_sequences
        self.requests: GuidedRequests | None = None
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
        self._stop_ids = frozenset(config.stop_token_ids or ())

    # -- properties --------------------------------------------------------------------------
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

        Compilation of every newly seen guide starts here, on the factory's thread pool, so
        that ``build`` usually finds it finished.

        Raises:
            LayoutError: more requests than ``max_num_sequences`` or a draft length outside
                ``[0, max_num_draft_tokens]`` (batch-level mistakes; per-request problems are
                reported by ``execute`` instead).
        """
        draft_len = self.max_num_draft_tokens if runtime_draft_len is None else runtime_draft_len
        if not 0 <= draft_len <= self.max_num_draft_tokens:
            raise LayoutError(f"runtime_draft_len={draft_len} is outside "
                              f"[0, max_num_draft_tokens={self.max_num_draft_tokens}]")
        if len(requests) > self.max_num_sequences:
            raise LayoutError(f"{len(requests)} requests exceed max_num_sequences="
                              f"{self.max_num_sequences}")
        self.requests = GuidedRequests(list(requests), draft_len)
        self._start_compiles(self.requests)

    def _start_compiles(self, requests: GuidedRequests) -> None:
        for req in requests.requests:
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
            (this build, rollbacks, disaggregated inits). Their rows are left unmasked.
        """
        requests = self._require_batch()
        self._check_logits(logits, d2t, requests.num_bitmask_tokens)
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
        elif any(self.num_guided_tokens[r.seq_slot] for r in requests.valid_requests()
                 if r.seq_slot is not None and 0 <= r.seq_slot < self.max_num_sequences):
            self.apply_bitmask(logits, d2t, n)
        self._record_failed(failed)
        return self.take_failed_requests()

    def take_failed_requests(self) -> list[FailedRequest]:
        """Failures recorded since the last call, then forgets them."""
        with self._failed_lock:
            failed, self._failed = self._failed, []
        return failed

    def _record_failed(self, failed: list[FailedRequest]) -> None:
        if failed:
            with self._failed_lock:
                self._failed.extend(failed)

    def build(self) -> list[FailedRequest]:
        """Host work only: advance matchers and fill the host bitmask for the latest batch."""
        return self._build(self._require_batch())

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
        """
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
        if self.max_num_draft_tokens <= 0:
            return
        for req in requests.valid_requests():
            slot = req.seq_slot
            if not self._slot_ok(slot) or self.num_advanced_tokens[slot] <= 0:
                continue
            advanced = self.num_advanced_tokens[slot]
            accepted = req.num_accepted_draft_tokens or 0
            matcher = self.grammar_matchers[slot]
            if accepted < 0 or matcher is None:
                self._record_failed([self._fail(req, RequestError(
                    f"cannot roll back: num_accepted_draft_tokens={accepted}, "
                    f"num_advanced_tokens={advanced}", request_id=req.request_id,
                    seq_slot=slot))])
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
        if not isinstance(seq_slot, int) or not self._slot_ok(seq_slot):
            raise RequestError(f"release: seq_slot {seq_slot!r} is outside [0, "
                               f"max_num_sequences={self.max_num_sequences})", seq_slot=seq_slot)
        self.grammar_matchers[seq_slot] = None
        self._pending_compiles.pop(seq_slot, None)
        self.num_advanced_tokens[seq_slot] = self.num_guided_tokens[seq_slot] = 0
        self.num_advanced_draft_tokens[seq_slot] = 0
        self.is_draft_terminated[seq_slot] = False

    def close(self) -> None:
        """Release what the decoder owns: the compile pool of a factory it built itself
        (a factory passed in stays open for its other users)."""
        if self._owns_factory:
            self.grammar_matcher_factory.close()

    # -- build -------------------------------------------------------------------------------
    @nvtx_range("GuidedDecoder.build")
    def _build(self, requests: GuidedRequests) -> list[FailedRequest]:
        """Init and advance every guided request's matcher, fill its rows, guard dead ends."""
        failed: list[FailedRequest] = []
        self._token_mask_np[:requests.num_bitmask_tokens] = 0
        entries: list[list] = []  # [req, slot, matcher, offset, drafts, new token or None]
        seen: set[int] = set()
        draft_slots: list[int] = []
        for req, offset in requests.valid_requests_with_offsets():
            duplicate = req.seq_slot in seen  # then the slot's matcher belongs to another request
            try:
                entry = self._prepare(req, offset, requests.max_num_draft_tokens, seen)
            except Exception as e:
                failed.append(self._fail(req, e, drop=not duplicate))
                continue
            if req.is_draft:
                draft_slots.append(req.seq_slot)  # type: ignore[arg-type]
            if entry is not None:
                entries.append(entry)
        self._fill_rounds(self._accept_new_tokens(entries, failed), failed)
        for slot in draft_slots:
            self.num_advanced_draft_tokens[slot] += self.num_advanced_tokens[slot]
        return failed

    def _prepare(self, req: GuidedRequest, offset: int, draft_len: int, seen: set[int]
                 ) -> list | None:
        """Validate one request and create its matcher if due; None if it has nothing to do."""
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
            return [req, slot, matcher, offset, drafts, None]
        # Skipped, not failed: the drafting loop stopped guiding this slot.
        if self.is_draft_terminated[slot]:
            return None
        return [req, slot, matcher, offset, drafts,
                self._checked_token(req, req.new_token, "new_token")]

    def _accept_new_tokens(self, entries: list[list], failed: list[FailedRequest]) -> list[list]:
        """Feed each entry its new token (one batched call); the entries left to fill."""
        advancing = [e for e in entries if e[5] is not None]
        if not advancing:
            return entries
        matchers, tokens = [e[2] for e in advancing], [e[5] for e in advancing]
        # one result per matcher: True / False, or the exception that matcher raised (a
        # matcher is never fed its token twice)
        accepted = self.grammar_matcher_factory.batch_accept(matchers, tokens)
        rejected = set()
        for entry, ok in zip(advancing, accepted):
            req, slot = entry[0], entry[1]
            if ok is True:
                self.num_advanced_tokens[slot] += 1
                if entry[2].is_terminated():
                    rejected.add(id(entry))
                continue
            rejected.add(id(entry))
            if isinstance(ok, BaseException):
                failed.append(self._fail(req, ok))
            elif req.is_draft:
                self.is_draft_terminated[slot] = True
            else:
                failed.append(self._fail(req, RequestError(
                    f"new_token {entry[5]} is not allowed by the grammar",
                    request_id=req.request_id, seq_slot=slot)))
        return [e for e in entries if id(e) not in rejected]

    def _fill_rounds(self, active: list[list], failed: list[FailedRequest]) -> None:
        """Round i fills row ``offset + i`` of every still-guided request with one batch call,
        checks dead ends for all of them at once, then feeds each its i-th draft token."""
        bitmask = self.bitmask_host
        factory = self.grammar_matcher_factory
        i = 0
        while active:
            rows = [e[3] + i for e in active]
            try:
                factory.batch_fill([e[2] for e in active], bitmask, rows)
            except Exception:  # find the culprit(s): fill one by one
                active, rows = self._fill_each(active, rows, i, failed)
                if not active:
                    return
            self._clear_tail(rows)
            valid = self._rows_valid(rows)
            guided_rows, survivors = [], []
            for entry, row, ok in zip(active, rows, valid):
                req, slot, matcher, _, drafts, _ = entry
                if not ok:
                    if i == 0 and not req.is_draft:
                        # the golden token's advance is never verified: exclude it from rollback
                        self.num_advanced_tokens[slot] = 0
                        failed.append(self._fail(req, DeadEndError(
                            f"request {req.request_id} at slot {slot} reached a grammar state "
                            "with no valid token")))
                    elif i == 0:
                        self.is_draft_terminated[slot] = True
                    continue  # a dead draft position is left unconstrained
                guided_rows.append(row)
                self.num_guided_tokens[slot] += 1
                if i < len(drafts):
                    try:
                        if not matcher.accept_token(drafts[i]):
                            continue
                    except Exception as e:
                        failed.append(self._fail(req, e))
                        continue
                    self.num_advanced_tokens[slot] += 1
                    if not matcher.is_terminated():
                        survivors.append(entry)
            if len(guided_rows) == 1:
                self._token_mask_np[guided_rows[0]] = 1
            elif guided_rows:
                self._token_mask_np[guided_rows] = 1
            active = survivors
            i += 1

    def _fill_each(self, active, rows, i, failed):
        kept, kept_rows = [], []
        for entry, row in zip(active, rows):
            try:
                entry[2].fill_next_token_bitmask(self.bitmask_host, row)
            except Exception as e:
                failed.append(self._fail(entry[0], e))
                continue
            kept.append(entry)
            kept_rows.append(row)
        return kept, kept_rows

    def _row_block(self, rows: list[int]) -> np.ndarray:
        """The bitmask rows as a NumPy view when evenly spaced (the common layout), else a copy."""
        bm = self._bitmask_np
        if len(rows) == 1:
            return bm[rows[0]:rows[0] + 1]
        step = rows[1] - rows[0]
        if step > 0 and all(b - a == step for a, b in zip(rows, rows[1:])):
            return bm[rows[0]:rows[-1] + 1:step]
        return bm[rows]

    def _rows_valid(self, rows: list[int]) -> list[bool]:
        """Dead-end guard: does each row allow a token below vocab_size_padded?"""
        bm, full, tail = self._bitmask_np, self._full_words, self._tail_word_mask
        if len(rows) <= 16:
            # a bytes comparison per row (memcmp, ~1 us) beats a NumPy reduction's call cost
            zero = self._zero_words
            return [bm[r, :full].tobytes() != zero
                    or (tail is not None and bool(bm[r, full] & tail)) for r in rows]
        block = self._row_block(rows)
        # max over uint32 is a vectorised reduction (~10x faster than any() on int32 here)
        valid = block[:, :full].view(np.uint32).max(axis=1) != 0
        if tail is not None:
            valid |= (block[:, full] & tail) != 0
        return valid.tolist()

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

    def _checked_token(self, req: GuidedRequest, token: int | None, what: str) -> int:
        if token is None or not 0 <= token < self.vocab_size_padded:
            raise RequestError(f"{what} {token!r} is outside the vocabulary "
                               f"[0, {self.vocab_size_padded})", request_id=req.request_id,
                               seq_slot=req.seq_slot)
        return int(token)

    def _checked_drafts(self, req: GuidedRequest, draft_len: int) -> list[int]:
        drafts = req.draft_tokens
        if not drafts or req.is_draft:
            return []
        if len(drafts) > self.max_num_draft_tokens:
            raise RequestError(f"{len(drafts)} draft tokens exceed max_num_draft_tokens="
                               f"{self.max_num_draft_tokens}", request_id=req.request_id,
                               seq_slot=req.seq_slot)
        # only this step's runtime draft length has rows reserved
        drafts = list(drafts[:draft_len])
        for t in drafts:
            self._checked_token(req, t, "draft token")
        return drafts

    def _slot_ok(self, slot: int | None) -> bool:
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
        if drop and self._slot_ok(req.seq_slot):
            self.grammar_matchers[req.seq_slot] = None  # type: ignore[index]
        rid = req.request_id if req.request_id is not None else -1
        return rid, f"{type(error).__name__}: {error}"

    def _require_batch(self) -> GuidedRequests:
        if self.requests is None:
            raise LayoutError("no batch: call add_batch() first")
        return self.requests

    def _check_logits(self, logits: torch.Tensor, d2t: torch.Tensor | None,
                      rows: int | None) -> None:
        if not isinstance(logits, torch.Tensor) or logits.dim() != 2:
            raise TensorArgError(f"logits must be a 2-D tensor, got "
                                 f"{getattr(logits, 'shape', type(logits))}")
        if logits.device != self.device and not (
                logits.device.type == self.device.type == "cuda" and self.device.index is None):
            raise TensorArgError(f"logits are on {logits.device}, the decoder on {self.device}")
        if rows is None:  # capturable: static rows, at least the layout's (padding allowed)
            rows = self._require_batch().num_bitmask_tokens
            if logits.shape[0] < rows:
                raise TensorArgError(f"logits have {logits.shape[0]} rows, fewer than the "
                                     f"batch layout's {rows}")
        elif logits.shape[0] != rows:
            raise TensorArgError(f"logits have {logits.shape[0]} rows, the batch layout has "
                                 f"{rows} (1 per context request, 1 + draft length per "
                                 "generation request)")
        if logits.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise TensorArgError(f"logits must be float32, float16 or bfloat16, got "
                                 f"{logits.dtype}")
        if d2t is not None:
            if not isinstance(d2t, torch.Tensor) or d2t.dim() != 1:
                raise TensorArgError(f"d2t must be a 1-D tensor, got shape "
                                     f"{tuple(getattr(d2t, 'shape', ()))}")
            if d2t.dtype != torch.int32:
                raise TensorArgError(f"d2t must be int32, got {d2t.dtype}")
            if d2t.device != logits.device:
                raise TensorArgError(f"d2t is on {d2t.device}, logits on {logits.device}")
        # (all of this is checked before the build advances any matcher: a retry after the
        # error must find the matchers where they were)
        full = self.vocab_size_padded if d2t is None else d2t.shape[0]
        width = logits.shape[1]
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
