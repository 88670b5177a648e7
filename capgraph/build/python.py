"""The Python host build: the readable reference every other strategy matches.

Per guided request of a step (:func:`select` decides which take part)::

    if the request creates its matcher (context request, disaggregated first step):
        create it; fill its row
    else:
        accept the new token                      # refused: Status.REJECTED
        fill row 0                                # no token allowed: Status.DEAD_END
        for i, draft in enumerate(draft tokens):  # at most the step's draft length
            accept the draft (refused: stop guiding it); fill row i + 1

with the rows of ids past the tokenizer's vocabulary cleared, each filled row marked in the
token mask and the counters of the slot (:class:`~capgraph.build.slots.SlotState`) kept. A
batch of one or two requests runs that loop request by request; a larger one runs it in
rounds, each round one batched backend call over every request still guided
(:meth:`PythonBuild._fill_rounds`), because a batched call costs less than its per-request
calls from Python.

A request whose drafts are a tree (``draft_parents``, see :mod:`capgraph.requests`) is built
request by request, in xgrammar's ``traverse_draft_tree`` order (:meth:`PythonBuild._fill_tree`)::

    accept the new token; fill row 0 (the root)
    depth first from the root, children in node order:
        accept the node's draft (refused: the node and its subtree stay unguided)
        fill row 1 + node; visit its children; roll the matcher back by one

so the matcher ends the build where the root is (one token advanced) and the slot keeps the
tree for ``rollback_rejected_tokens``, which feeds it the accepted path. Where xgrammar
writes an empty mask for a node the grammar refuses, such a node is left unguided here, as a
refused draft of a chain is: a chain is the tree ``[-1, 0, 1, ...]`` and gets the same rows.
"""

from __future__ import annotations

import threading
from time import perf_counter, thread_time
from typing import Sequence, cast

from ..errors import RequestError
from ..grammar import GrammarMatcher, GrammarMatcherFactory
from ..requests import GuidedRequest, GuidedRequests, as_int
from .base import PLAIN, HostBuild, Outcome, Status, StepResult
from .slots import SlotState

__all__ = ["Active", "PythonBuild", "TreeEntry", "select"]


class Active:
    """The requests still being guided in a build, as parallel columns (one row each):
    ``index`` (position in the batch), ``slots``, ``matchers``, ``offsets`` (first bitmask
    row), ``drafts``, ``tokens`` (the new token, or None for a matcher created this step)."""

    __slots__ = ("index", "slots", "matchers", "offsets", "drafts", "tokens")

    def __init__(self, index: list[int], slots: list[int], matchers: list[GrammarMatcher],
                 offsets: list[int], drafts: list[Sequence[int]],
                 tokens: list[int | None]) -> None:
        self.index, self.slots, self.matchers = index, slots, matchers
        self.offsets, self.drafts, self.tokens = offsets, drafts, tokens

    @property
    def columns(self) -> tuple[list, list, list, list, list, list]:
        """The six columns (index, slots, matchers, offsets, drafts, tokens), in that order."""
        return self.index, self.slots, self.matchers, self.offsets, self.drafts, self.tokens

    def select(self, idx: Sequence[int]) -> "Active":
        """The rows ``idx``, in that order."""
        return Active(*([column[k] for k in idx] for column in self.columns))


#: a request with a draft tree in a build: ``(index in the batch, slot, matcher, first row,
#: draft tokens (at most the step's draft length), parents, new token)``
TreeEntry = tuple[int, int, GrammarMatcher, int, list[int], list[int], int]


def fault(index: int, error: BaseException, status: Status = Status.FAULT) -> Outcome:
    """The outcome of a request whose check or matcher call raised ``error``."""
    return index, status, f"{type(error).__name__}: {error}"


def select(requests: GuidedRequests, state: SlotState
           ) -> tuple[Active, list[Outcome], list[int], list[TreeEntry]]:
    """Which requests of the step take part, their matchers created where due.

    Returns the :class:`Active` columns, the outcomes of requests that failed here, the
    slots of draft requests (their advances are added to ``num_advanced_draft_tokens``) and
    the requests whose drafts are a tree (:data:`TreeEntry`, not in the columns). The
    common request (a target request generating, with an int slot seen once and an int token
    in the vocabulary) is checked inline; every other one takes :func:`_prepare`. Each slot's
    counters of the last build are zeroed as its request is met.
    """
    act = Active([], [], [], [], [], [])
    add_index, add_slot, add_matcher, add_offset, add_drafts, add_token = (
        act.index.append, act.slots.append, act.matchers.append, act.offsets.append,
        act.drafts.append, act.tokens.append)
    outcomes: list[Outcome] = []
    seen: set[int] = set()
    draft_slots: list[int] = []
    trees: list[TreeEntry] = []
    nseq, V, draft_len = state.max_num_sequences, state.vocab_size_padded, \
        requests.max_num_draft_tokens
    matchers, advanced, guided, draft_terminated = (
        state.matchers, state.num_advanced_tokens, state.num_guided_tokens,
        state.is_draft_terminated)
    for i, (req, offset) in enumerate(zip(requests.requests, requests.offsets)):
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
            parents = None
            if req_drafts:
                try:
                    req_drafts = _checked_drafts(req, draft_len, state)
                    parents = getattr(req, "draft_parents", None)
                except Exception as e:
                    outcomes.append(fault(i, e))
                    continue
            matcher = matchers[slot]
            try:  # (every matcher call sits inside the per-request isolation)
                if matcher is None or matcher.is_terminated() or draft_terminated[slot]:
                    continue
            except Exception as e:
                outcomes.append(fault(i, e))
                continue
            if parents is not None:
                trees.append((i, slot, matcher, offset,
                              cast("list[int]", req_drafts)[:len(parents)], parents, token))
                continue
            add_index(i)
            add_slot(slot)
            add_matcher(matcher)
            add_offset(offset)
            add_drafts(req_drafts or ())
            add_token(token)
            continue
        duplicate = slot in seen  # then the slot's matcher belongs to another request
        try:
            entry = _prepare(req, offset, draft_len, seen, state)
        except Exception as e:
            outcomes.append(fault(i, e, Status.REFUSED if duplicate else Status.FAULT))
            continue
        if req.is_draft:
            draft_slots.append(slot)  # type: ignore[arg-type]
        if entry is not None:
            parents = getattr(req, "draft_parents", None)
            if parents is not None and entry[3] and entry[4] is not None:
                tree_slot, matcher, offset, drafts, token = entry
                trees.append((i, tree_slot, matcher, offset, drafts[:len(parents)], parents,
                              token))
                continue
            for column, value in zip(act.columns, (i, *entry)):
                column.append(value)
    return act, outcomes, draft_slots, trees


def _prepare(req: GuidedRequest, offset: int, draft_len: int, seen: set[int],
             state: SlotState) -> tuple | None:
    """Check one request that is not the common case and create its matcher if due; None if
    it has nothing to do, else its :class:`Active` row without the index."""
    slot = req.seq_slot
    if not state.slot_ok(slot):
        raise RequestError(f"seq_slot {slot!r} is outside [0, max_num_sequences="
                           f"{state.max_num_sequences})", request_id=req.request_id,
                           seq_slot=slot)
    slot = cast(int, slot)
    if slot in seen:
        raise RequestError(f"seq_slot {slot} appears twice in one batch",
                           request_id=req.request_id, seq_slot=slot)
    seen.add(slot)
    init, advance = req.require_matcher_init(), req.require_matcher_advance()
    # (a target request that neither creates nor advances the slot's matcher, such as a
    # context chunk before its last, leaves the counts of the request that matcher serves,
    # whose rollback may still come: a slot taken over is the last chunk's to reset; a draft
    # step's counts are its drafting loop's)
    if init or advance or req.is_draft or state.matchers[slot] is None:
        state.num_advanced_tokens[slot] = state.num_guided_tokens[slot] = 0
    if not (init or advance):
        return None
    drafts = _checked_drafts(req, draft_len, state)
    if init:  # a new request: nothing of the slot's last one carries over
        state.reset(slot)
        state.matchers[slot] = state.create_matcher(req)
    matcher = state.matchers[slot]
    if matcher is None or matcher.is_terminated():
        return None
    if not advance:
        return (slot, matcher, offset, drafts, None)
    if state.is_draft_terminated[slot]:  # skipped, not failed: the drafting loop stopped
        return None
    return (slot, matcher, offset, drafts, checked_token(req, req.new_token, "new_token", state))


def checked_token(req: GuidedRequest, token: object, what: str, state: SlotState) -> int:
    """``token`` as an int in the vocabulary (never a truncated float or a bool)."""
    value = as_int(token)
    if value is None or not 0 <= value < state.vocab_size_padded:
        raise RequestError(f"{what} {token!r} is "
                           + ("not an integer token id" if value is None else
                              f"outside the vocabulary [0, {state.vocab_size_padded})"),
                           request_id=req.request_id, seq_slot=req.seq_slot)
    return value


def _checked_drafts(req: GuidedRequest, draft_len: int, state: SlotState) -> list[int]:
    drafts = req.draft_tokens
    if not drafts or req.is_draft:
        return []
    if len(drafts) > state.max_num_draft_tokens:
        raise RequestError(f"{len(drafts)} draft tokens exceed max_num_draft_tokens="
                           f"{state.max_num_draft_tokens}", request_id=req.request_id,
                           seq_slot=req.seq_slot)
    # only this step's runtime draft length has rows reserved, and a tree reads its nodes
    # only (positions past them, in a tokens tensor, may hold any padding, -1 among them)
    parents = getattr(req, "draft_parents", None)
    n = draft_len if type(parents) is not list else min(draft_len, len(parents))
    return [checked_token(req, t, "draft token", state) for t in drafts[:n]]


class _Anchor(threading.local):
    """This thread's budget anchor: a request's start (``perf_counter``) and the thread's CPU
    time (``thread_time``) then, kept from step to step."""
    wall = float("-inf")
    cpu = 0.0


_ANCHOR = _Anchor()


def _request_start(budget: float) -> float:
    """A timed request's start (``perf_counter``); the thread's anchor moves there where it
    is over a quarter of ``budget`` old (the CPU clock is a system call: one read per quarter
    budget of wall time, not one per request)."""
    start = perf_counter()
    anchor = _ANCHOR
    if start - anchor.wall > 0.25 * budget:
        anchor.wall, anchor.cpu = start, thread_time()
    return start


def _cpu_over(start: float, budget: float) -> bool:
    """Whether the request that began at ``start`` and went over ``budget`` in wall time also
    used that much of this thread's CPU time. Its CPU time is at least the CPU time since the
    anchor less the wall time between the anchor and its start (whatever ran then spent at
    most that much CPU), and that lower bound is at most a quarter budget short: a request
    over 1.25 budgets of CPU always fails, one within the budget never does (the rule of the
    C++ build, ``Builder::OverBudget``)."""
    anchor = _ANCHOR
    return thread_time() - anchor.cpu - (start - anchor.wall) > budget


class PythonBuild(HostBuild):
    """The reference strategy: :func:`select`, then the fill loop in Python over the backend's
    matcher calls (batched calls for larger batches).

    The host-step budget: request by request, each request's accept and fills are timed and a
    request over the budget ends with :attr:`Status.OVER_BUDGET` at once, where the CPU time
    this thread spent on it agrees (a thread preempted or waiting for the GIL spends wall
    time, not the budget: :func:`_cpu_over`). A batched call
    cannot be timed per request, so the rounds time each batched call instead (a few clock
    reads per step, whatever the batch size), and when one took longer than the budget, the
    next build runs request by request, timed, which names the culprit there; a batch that was
    merely large goes back to rounds after that one step. So a pathological request slows at
    most two steps, and the common step pays no per-request clock reads.
    """

    name = "python"
    #: batches of at most this many guided requests fill request by request, not in rounds
    #: (measured break-even on 2 cores, Tekken)
    sequential_fill_max: int = 2

    def __init__(self, slots: SlotState, factory: GrammarMatcherFactory,
                 budget_ms: float = 0.0) -> None:
        super().__init__(slots, budget_ms)
        self.factory = factory
        self._budget_s = self.budget_ms / 1e3
        self._budget_probe = False  # a batched stage went over the budget: time the next alone
        self._masked = False

    def run(self, requests: GuidedRequests, clear_rows: int) -> StepResult:
        state = self.slots
        state.token_mask_np[:clear_rows] = 0  # first: a build that fails masks nothing
        self._masked = False
        act, outcomes, draft_slots, trees = select(requests, state)
        if act.index:
            self._fill(act, outcomes, requests.max_num_draft_tokens)
        for entry in trees:
            self._fill_tree(entry, outcomes)
        if draft_slots:
            # a draft request that faulted is dropped (its advances are never rolled back)
            faulted = {requests.requests[i].seq_slot for i, status, _ in outcomes
                       if status == Status.FAULT}
            advanced, drafted = state.num_advanced_tokens, state.num_advanced_draft_tokens
            for slot in draft_slots:
                if slot not in faulted:
                    drafted[slot] += advanced[slot]
        return StepResult(outcomes, self._masked) if outcomes else PLAIN[self._masked]

    def _fill(self, act: Active, outcomes: list[Outcome], draft_len: int) -> None:
        """Advance and fill the selected requests: one by one for a small batch (or after a
        batched stage went over the budget), else in rounds."""
        if self._budget_probe or len(act.index) <= self.sequential_fill_max:
            self._budget_probe = False
            self._fill_sequential(act, outcomes, draft_len)
        else:
            self._fill_rounds(act, outcomes, draft_len)

    # -- request by request ------------------------------------------------------------------
    def _fill_sequential(self, act: Active, outcomes: list[Outcome], draft_len: int) -> None:
        """The build loop of the module docstring, request by request. With a budget, each
        request's accept and fills are timed, the clock read after each filled row, and a
        request over it stops there (:meth:`_over_budget`)."""
        state = self.slots
        bitmask, token_mask, stops = state.bitmask, state.token_mask_np, state.stop_ids
        guided, advanced = state.num_guided_tokens, state.num_advanced_tokens
        budget = self._budget_s
        for i, slot, matcher, offset, drafts, token in zip(*act.columns):
            start = _request_start(budget) if budget else 0.0
            if token is not None:  # None: a matcher created this step fills without advancing
                try:
                    if not matcher.accept_token(token):
                        outcomes.append((i, Status.REJECTED, None))
                        continue
                    advanced[slot] += 1
                    if token in stops and matcher.is_terminated():
                        continue
                except Exception as e:
                    outcomes.append(fault(i, e))
                    continue
            k = 0
            while True:
                row = offset + k
                try:
                    matcher.fill_next_token_bitmask(bitmask, row)
                except Exception as e:
                    outcomes.append(fault(i, e))
                    break
                if state.tail is not None:
                    state.clear_tail([row])
                if state.dead_rows([row]):
                    if k == 0:  # a dead draft position is left to the verification
                        outcomes.append((i, Status.DEAD_END, None))
                    break
                guided[slot] += 1
                token_mask[row] = 1
                self._masked = True
                if budget and (elapsed := perf_counter() - start) > budget and \
                        _cpu_over(start, budget):
                    outcomes.append(self._over_budget(i, slot, range(offset, row + 1), elapsed))
                    break
                if k >= draft_len or k >= len(drafts):
                    break
                token = drafts[k]
                try:
                    if not matcher.accept_token(token):
                        break  # the draft left the grammar; its later positions stay unguided
                    advanced[slot] += 1
                    if token in stops and matcher.is_terminated():
                        break
                except Exception as e:
                    outcomes.append(fault(i, e))
                    break
                k += 1

    # -- draft trees -------------------------------------------------------------------------
    def _fill_tree(self, entry: TreeEntry, outcomes: list[Outcome]) -> None:
        """Build one request whose drafts are a tree (the module docstring's second loop; its
        tokens were checked by :func:`select`); with a budget, timed as a request of
        :meth:`_fill_sequential` is. A fault or an overrun leaves all of the request's rows
        unmasked."""
        i, slot, matcher, offset, tokens, parents, token = entry
        state = self.slots
        budget = self._budget_s
        start = _request_start(budget) if budget else 0.0
        try:
            if not matcher.accept_token(token):
                outcomes.append((i, Status.REJECTED, None))
                return
            state.num_advanced_tokens[slot] += 1
            if token in state.stop_ids and matcher.is_terminated():
                return
            if not self._fill_node(matcher, offset, slot):
                outcomes.append((i, Status.DEAD_END, None))
                return
            n = len(tokens)
            if budget and (elapsed := perf_counter() - start) > budget and \
                    _cpu_over(start, budget):
                outcomes.append(self._over_budget(i, slot, range(offset, offset + 1 + n),
                                                  elapsed))
                return
            children: list[list[int]] = [[] for _ in range(n + 1)]  # [parent + 1]: its nodes
            for j in range(n):
                children[parents[j] + 1].append(j)
            stops = state.stop_ids
            path = [iter(children[0])]  # per node on the matcher's path, its children to visit
            while path:
                node = next(path[-1], None)
                if node is None:
                    path.pop()
                    if path:  # leave the node whose subtree is done
                        matcher.rollback(1)
                    continue
                if not matcher.accept_token(tokens[node]):
                    continue  # the draft left the grammar: its subtree stays unguided
                if (tokens[node] in stops and matcher.is_terminated()) or \
                        not self._fill_node(matcher, offset + 1 + node, slot):
                    matcher.rollback(1)  # a stop token or a dead position: no row below it
                    continue
                if budget and (elapsed := perf_counter() - start) > budget and \
                        _cpu_over(start, budget):
                    outcomes.append(self._over_budget(i, slot, range(offset, offset + 1 + n),
                                                      elapsed))
                    return
                path.append(iter(children[node + 1]))
        except Exception as e:
            state.token_mask_np[offset:offset + 1 + len(tokens)] = 0
            state.num_guided_tokens[slot] = 0
            outcomes.append(fault(i, e))
            return
        state.record_tree(slot, tokens, parents)

    def _fill_node(self, matcher: GrammarMatcher, row: int, slot: int) -> bool:
        """Fill ``row`` from ``matcher`` (``slot``'s) and mark it guided; False (unmarked)
        where it allows no token."""
        state = self.slots
        matcher.fill_next_token_bitmask(state.bitmask, row)
        if state.tail is not None:
            state.clear_tail([row])
        if state.dead_rows([row]):
            return False
        state.num_guided_tokens[slot] += 1
        state.token_mask_np[row] = 1
        self._masked = True
        return True

    def _over_budget(self, i: int, slot: int, rows: range, elapsed_s: float) -> Outcome:
        """Request ``i`` went over the host-step budget: its ``rows`` of this step are
        unmasked and its counts zeroed (its matcher is dropped, never rolled back)."""
        state = self.slots
        state.token_mask_np[rows.start:rows.stop] = 0
        state.num_advanced_tokens[slot] = state.num_guided_tokens[slot] = 0
        return i, Status.OVER_BUDGET, elapsed_s * 1e3

    # -- in rounds ---------------------------------------------------------------------------
    def _accept(self, matchers: list[GrammarMatcher], tokens: list[int]) -> list | None:
        """One batched accept; None when every token was accepted and none was a stop token
        (the common case, checked with C-level list operations), else the per-matcher
        results. A matcher terminates only by accepting a stop token."""
        results = self.factory.batch_accept(matchers, tokens)
        if results.count(True) == len(results) and self.slots.stop_ids.isdisjoint(tokens):
            return None
        return results

    def _kept_after_accept(self, act: Active, tokens: Sequence[int | None], results: list,
                           outcomes: list[Outcome], first: bool) -> list[int]:
        """Positions of ``act`` still guided after a batched accept's ``results``; a refused
        new token (``first``) is an outcome, a refused draft only stops that request."""
        advanced, stops = self.slots.num_advanced_tokens, self.slots.stop_ids
        keep = []
        for k, ok in enumerate(results):
            if ok is True:
                advanced[act.slots[k]] += 1
                try:
                    if tokens[k] not in stops or not act.matchers[k].is_terminated():
                        keep.append(k)
                except Exception as e:
                    outcomes.append(fault(act.index[k], e))
            elif isinstance(ok, BaseException):
                outcomes.append(fault(act.index[k], ok))
            elif first:
                outcomes.append((act.index[k], Status.REJECTED, None))
        return keep

    def _accept_new_tokens(self, act: Active, outcomes: list[Outcome]) -> Active:
        """Feed each request its new token (one batched call); the requests left to fill."""
        tokens = act.tokens
        if None in tokens:  # matchers created this step fill without advancing
            idx = [k for k, t in enumerate(tokens) if t is not None]
            if not idx:
                return act
            adv = act.select(idx)
        else:
            idx, adv = None, act
        results = self._accept(adv.matchers, cast("list[int]", adv.tokens))  # no None left
        if results is None:
            advanced = self.slots.num_advanced_tokens
            for slot in adv.slots:
                advanced[slot] += 1
            return act
        kept = self._kept_after_accept(adv, adv.tokens, results, outcomes, True)
        keep = [k for k, t in enumerate(tokens) if t is None]
        keep += kept if idx is None else [idx[j] for j in kept]
        keep.sort()
        return act.select(keep)

    def _fill_rounds(self, act: Active, outcomes: list[Outcome], draft_len: int) -> None:
        """Feed every request its new token with one batched call; then round ``r`` fills row
        ``offset + r`` of every still-guided request with one batched call, checks dead ends
        for all of them at once, then feeds each its r-th draft token (at most ``draft_len``
        rounds after the first). With a budget, each batched call is timed."""
        budget = self._budget_s
        start = perf_counter() if budget else 0.0
        act = self._accept_new_tokens(act, outcomes)
        if budget and perf_counter() - start > budget:
            self._budget_probe = True
        state = self.slots
        guided, advanced = state.num_guided_tokens, state.num_advanced_tokens
        token_mask = state.token_mask_np
        r = 0
        while act.index:
            rows = act.offsets if r == 0 else [o + r for o in act.offsets]
            if budget:
                start = perf_counter()
            try:
                self.factory.batch_fill(act.matchers, state.bitmask, rows)
                if budget and perf_counter() - start > budget:
                    self._budget_probe = True  # the next build times each request alone
            except Exception:  # find the culprit(s): fill one by one
                keep = self._fill_each(act, rows, outcomes)
                act, rows = act.select(keep), [rows[k] for k in keep]
                if not rows:
                    return
            if state.tail is not None:
                state.clear_tail(rows)
            dead = state.dead_rows(rows)
            if dead:
                if r == 0:  # dead draft positions are left to the verification
                    outcomes.extend((act.index[k], Status.DEAD_END, None) for k in dead)
                gone = set(dead)
                keep = [k for k in range(len(rows)) if k not in gone]
                act, rows = act.select(keep), [rows[k] for k in keep]
            for slot in act.slots:
                guided[slot] += 1
            if len(rows) == 1:
                token_mask[rows[0]] = 1
            elif rows:
                token_mask[rows] = 1
            if rows:
                self._masked = True
            if r >= draft_len:  # no request has a draft token left
                return
            # feed each request its r-th draft token; the ones that took it go on
            idx = [k for k, d in enumerate(act.drafts) if len(d) > r]
            if not idx:
                return
            nxt = act if len(idx) == len(act.drafts) else act.select(idx)
            tokens = [d[r] for d in nxt.drafts]
            if budget:
                start = perf_counter()
            results = self._accept(nxt.matchers, tokens)
            if budget and perf_counter() - start > budget:
                self._budget_probe = True
            if results is not None:
                # (a refused draft leaves the grammar: its later positions stay unguided)
                nxt = nxt.select(self._kept_after_accept(nxt, tokens, results, outcomes, False))
            else:
                for slot in nxt.slots:
                    advanced[slot] += 1
            act = nxt
            r += 1

    def _fill_each(self, act: Active, rows: list[int], outcomes: list[Outcome]) -> list[int]:
        """Fill row by row after a batched fill raised; the positions that filled."""
        keep = []
        for k, (matcher, row) in enumerate(zip(act.matchers, rows)):
            try:
                matcher.fill_next_token_bitmask(self.slots.bitmask, row)
            except Exception as e:
                outcomes.append(fault(act.index[k], e))
                continue
            keep.append(k)
        return keep
