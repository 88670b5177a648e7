"""The per-slot state every host build strategy reads and writes, in one place.

A decoder has ``max_num_sequences`` slots. Each slot holds the matcher of the request occupying
it and the counters of the last build; the host bitmask and token mask hold one row per layout
row. The dead-end guard (:meth:`SlotState.dead_rows`) and the padding clear
(:meth:`SlotState.clear_tail`) are here because every strategy that fills rows from Python runs
them on the rows it filled.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Protocol, Sequence, TypeGuard

import numpy as np

from ..bitmask import (allocate_host_bitmask, allocate_host_token_mask, split_last_word,
                       words_per_row)
from ..grammar import GrammarMatcher
from ..requests import GuidedRequest, as_int

__all__ = ["Delegating", "SlotFlags", "SlotMatchers", "SlotState", "probe_window"]


def _no_compiles(request: GuidedRequest) -> GrammarMatcher:
    raise RuntimeError("this SlotState has no create_matcher: set it to create matchers")


def _python_only(matcher: object) -> bool | None:
    return None if matcher is None else False


class Delegating(Protocol):
    """A matcher that forwards every call, unchanged, to another matcher once it has settled
    (for example :class:`~capgraph.grammar.handover.HandOverMatcher`): native code may then
    drive the delegate directly, and calls the forwarder's ``sync_state`` after it did."""

    @property
    def delegate(self) -> GrammarMatcher | None:
        """The matcher every call goes to now, or None while this one runs its own methods."""

    def on_delegate(self, callback: Callable[[Any], None] | None) -> None:
        """Call ``callback(self)`` once :attr:`delegate` is set."""


class SlotMatchers(list[GrammarMatcher | None]):
    """The matcher of each slot: a list of fixed length, with :attr:`handles` beside it.

    ``handles[slot]`` is what the native build's CPython entry runs for ``self[slot]``
    (``handle_of(matcher)``, see :meth:`track`: None for no matcher, the address of the
    matcher's FFI object, False for a matcher only Python can run). It is recomputed on every
    assignment, so the two never disagree: the C++ side runs the address it finds, and a stale
    one would run an object that may have been freed. Changing the length raises TypeError.

    A matcher that forwards to another one once it settles (a :class:`Delegating` matcher,
    such as a request handed over between backends) is watched while tracking: when its
    delegate is set, its slot's handle is recomputed then (``handle_of`` may look at the
    delegate), so no step pays for looking.

    :attr:`on_change`, when set, is called with the slot after every change of a slot's handle
    (a native host node keeps its own table of them, :class:`~capgraph.build.library.HostNode`).
    """

    def __init__(self, num_slots: int) -> None:
        super().__init__([None] * num_slots)
        self.handles: list[Any] = [None] * num_slots
        self._handle_of: Callable[[Any], Any] = _python_only
        self._tracking = False
        #: called with the slot after its handle changed (None: nobody listens)
        self.on_change: Callable[[int], None] | None = None

    def track(self, handle_of: Callable[[Any], Any]) -> None:
        """Compute the handles with ``handle_of`` from now on (the current matchers' too)."""
        self._handle_of = handle_of
        self._tracking = True
        self.handles[:] = [handle_of(m) for m in self]
        for slot, m in enumerate(self):
            self._watch(slot, m)
        self._changed(range(len(self)))

    def handle_of(self, matcher: Any) -> Any:
        """What the native build would run for ``matcher`` in a slot (see :attr:`handles`)."""
        return self._handle_of(matcher)

    def _changed(self, slots: Iterable[int]) -> None:
        if self.on_change is not None:
            for slot in slots:
                self.on_change(slot)

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, slice):
            new = list(self)
            new[index] = value
            if len(new) != len(self):
                raise TypeError(f"the {len(self)} slots' matcher list has a fixed length")
            old = list(self)
            super().__setitem__(slice(None), new)
            self.handles[:] = [self._handle_of(m) for m in new]
            for slot, (m, before) in enumerate(zip(new, old)):
                if m is not before:
                    self._watch(slot, m)
            self._changed(range(len(self)))
            return
        handle = self._handle_of(value)  # (first: a failure here changes neither list)
        super().__setitem__(index, value)
        self.handles[index] = handle
        if handle is False and self._tracking:
            self._watch(index, value)
        if self.on_change is not None:
            self.on_change(index % len(self))

    def _watch(self, slot: int, matcher: Any) -> None:
        """Have a :class:`Delegating` ``matcher`` not settled yet refresh ``slot``'s handle
        when it settles. The callback holds this list weakly (no cycle through the matcher)
        and changes nothing once the slot holds another matcher."""
        if not self._tracking or getattr(matcher, "delegate", True) is not None:
            return  # (no delegate protocol, or settled already)
        on_delegate = getattr(matcher, "on_delegate", None)
        if on_delegate is None:
            return
        ref = weakref.ref(self)

        def refresh(settled: Any) -> None:
            slots = ref()
            if slots is not None and slot < len(slots) and \
                    list.__getitem__(slots, slot) is settled:
                slots.handles[slot] = slots._handle_of(settled)
                slots._changed((slot,))

        on_delegate(refresh)

    def _fixed(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"the {len(self)} slots' matcher list has a fixed length and order "
                        "(assign matchers[slot] instead)")

    __delitem__ = append = extend = insert = pop = remove = clear = _fixed  # type: ignore
    __iadd__ = __imul__ = sort = reverse = _fixed  # type: ignore


class SlotFlags(list[bool]):
    """A per-slot list of flags that calls :attr:`on_change` with the slot after each
    assignment (the decoder's ``is_draft_terminated``, which a native host node mirrors)."""

    def __init__(self, num_slots: int) -> None:
        super().__init__([False] * num_slots)
        #: called with the slot after its flag was assigned (None: nobody listens)
        self.on_change: Callable[[int], None] | None = None

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(index, value)
        if self.on_change is not None:
            slots = range(len(self))[index] if isinstance(index, slice) else \
                (index % len(self),)
            for slot in slots:
                self.on_change(slot)


class SlotState:
    """Matchers, counters and host buffers of one decoder.

    Args:
        max_num_sequences: number of slots.
        max_num_draft_tokens: largest draft length (rows per generation request minus one).
        vocab_size_padded: width of a full logits row (bits per bitmask row that count).
        tokenizer_vocab_size: ids from here on are padding, cleared on every filled row.
        stop_token_ids: tokens whose acceptance may terminate a matcher.
        likely_allowed_ids: token ids most grammar states allow (the dead-end guard looks at
            their bitmask words first).

    The lists are mutated in place only (the decoder exposes them as its public attributes and
    the native strategies hold references to them).
    """

    def __init__(self, max_num_sequences: int, max_num_draft_tokens: int,
                 vocab_size_padded: int, tokenizer_vocab_size: int,
                 stop_token_ids: Sequence[int], likely_allowed_ids: Sequence[int]) -> None:
        S, V = max_num_sequences, vocab_size_padded
        self.max_num_sequences = S
        self.max_num_draft_tokens = max_num_draft_tokens
        self.vocab_size_padded = V
        #: per slot, its matcher (and, kept in step, what the native build runs for it)
        self.matchers: SlotMatchers = SlotMatchers(S)
        #: how a request's matcher is created (the decoder's compile handles; may raise)
        self.create_matcher: Callable[[GuidedRequest], GrammarMatcher] = _no_compiles
        self.num_advanced_tokens = [0] * S  #: tokens accepted in the last build
        self.num_guided_tokens = [0] * S  #: rows masked in the last build
        self.num_advanced_draft_tokens = [0] * S  #: tokens accepted over a drafting loop
        #: the drafting loop stopped guiding the slot
        self.is_draft_terminated: SlotFlags = SlotFlags(S)
        #: per slot, the draft tree the slot's last build traversed, for the rollback to keep
        #: its accepted path: ``(tokens, parents)`` of the nodes that had rows
        #: (``tokens`` None once the rollback kept a path); None where there was none. It
        #: stays the slot's while builds of other slots run (its request may sit out steps
        #: before its rollback) and is forgotten by the slot's next build
        #: (:meth:`forget_trees`) or :meth:`reset`.
        self.draft_trees: list[tuple[list[int] | None, list[int]] | None] = [None] * S
        #: how many slots hold a draft tree (a build forgets trees only where there are any)
        self.num_trees = 0
        rows = S * (max_num_draft_tokens + 1)
        self.words = words_per_row(V)
        self.bitmask = allocate_host_bitmask(rows, V)
        self.token_mask = allocate_host_token_mask(rows)
        # NumPy views: the per-step bookkeeping touches a few rows, and NumPy's small-array
        # calls cost ~1 us where torch's intra-op thread pool can cost ms while the batch
        # fill's threads hold the cores
        self.bitmask_np = self.bitmask.numpy()
        self.token_mask_np = self.token_mask.numpy()
        self.stop_ids = frozenset(stop_token_ids)
        # the same split as bitmask.row_has_valid_token: only bits below V count
        self.full_words, tail_mask = split_last_word(V)
        self.tail_mask = tail_mask
        self._tail_word_mask = np.int32(tail_mask) if tail_mask else None
        self._zero_words = bytes(4 * self.full_words)
        #: ``(word, bits)`` of the tokenizer's vocabulary where it is smaller than the row's
        #: ``32 * words`` bits, else None: from there on every filled row is cleared, the
        #: padding ids below V and the bits past V in the last word alike (xgrammar sets those
        #: where most tokens are allowed, and a d2t target among them would read one)
        self.tail: tuple[int, int] | None = \
            (tokenizer_vocab_size // 32, tokenizer_vocab_size % 32) \
            if tokenizer_vocab_size < 32 * self.words else None
        # the dead-end guard's first look: the 16-word window holding most likely-allowed ids
        self._probe = probe_window(likely_allowed_ids, self.full_words)

    def slot_ok(self, slot: object) -> TypeGuard[int]:
        """Whether ``slot`` is an int slot index of this state."""
        return type(slot) is int and 0 <= slot < self.max_num_sequences

    def reset(self, slot: int) -> None:
        """Forget the matcher and counters of ``slot``."""
        self.matchers[slot] = None
        self.num_advanced_tokens[slot] = self.num_guided_tokens[slot] = 0
        self.num_advanced_draft_tokens[slot] = 0
        self.is_draft_terminated[slot] = False
        self.forget_tree(slot)

    def current_tree(self, slot: int) -> tuple[list[int] | None, list[int]] | None:
        """The draft tree ``slot``'s request had in the slot's latest build (other slots may
        have been built since), or None."""
        return self.draft_trees[slot]

    def record_tree(self, slot: int, tokens: list[int] | None, parents: list[int]) -> None:
        """Store the draft tree ``slot``'s build traversed (``tokens`` None: the rollback kept
        its path)."""
        if self.draft_trees[slot] is None:
            self.num_trees += 1
        self.draft_trees[slot] = (tokens, parents)

    def forget_tree(self, slot: int) -> None:
        """Forget ``slot``'s draft tree (if any)."""
        if self.draft_trees[slot] is not None:
            self.draft_trees[slot] = None
            self.num_trees -= 1

    def forget_trees(self, requests: Iterable[Any]) -> None:
        """A build of ``requests`` starts: the draft trees of their slots are no longer
        current (a request's tree is the one of its slot's latest target build). A draft
        request, and a context chunk before its last (which neither creates nor advances
        the slot's matcher: another request's, on a slot still held), leave the tree to
        the rollback still to come. Cheap where no slot holds a tree."""
        if not self.num_trees:
            return
        trees, S = self.draft_trees, self.max_num_sequences
        for req in requests:
            if getattr(req, "is_draft", False) or (
                    getattr(req, "is_context_init_state", False)
                    and not getattr(req, "is_last_context_chunk", False)):
                continue
            slot = getattr(req, "seq_slot", None)
            if type(slot) is not int:
                slot = as_int(slot)  # (an index-like slot the build takes as its int)
            if slot is not None and 0 <= slot < S and trees[slot] is not None:
                trees[slot] = None
                self.num_trees -= 1

    def dead_rows(self, rows: list[int]) -> list[int]:
        """Dead-end guard: positions in ``rows`` whose row allows no token below
        ``vocab_size_padded`` (usually none).

        Up to 8 rows: one bytes comparison per row (a memcmp, ~0.4 us at V = 131072) beats
        NumPy's call costs. Many rows: first a look at the few words that hold most of the
        likely-allowed ids (single-byte tokens, set in almost every state), then a full scan
        of only the rows where none of them is set.
        """
        bm, full, zero, tail = (self.bitmask_np, self.full_words, self._zero_words,
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

    def clear_tail(self, rows: list[int]) -> None:
        """Clear the bits of ids >= the tokenizer's vocabulary in ``rows``, to the end of the
        row (padding ids are never allowed, and no bit past V reads as one)."""
        if self.tail is None:
            return
        word, bits = self.tail
        bm = self.bitmask_np
        if bits:
            bm[rows, word] &= np.int32((1 << bits) - 1)
            word += 1
        if word < self.words:
            bm[np.asarray(rows)[:, None], np.arange(word, self.words)] = 0

    def nbytes(self) -> int:
        """Bytes of the host buffers."""
        return self.bitmask.nbytes + self.token_mask.nbytes


def probe_window(token_ids: Sequence[int], full_words: int, width: int = 16
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
