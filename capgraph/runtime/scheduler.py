"""Sequences and slots: requests wait, join a free slot, generate, and leave when finished.

A :class:`Sequence` is one request's state in the loop. Its KV cache holds
``prompt + output[:-1]``: the newest output token (the "golden" token of the next step) is fed
by the next decode step together with its drafts. :class:`SlotScheduler` admits waiting
sequences first-come first-served into free slots and frees a slot when its sequence finishes.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Iterable, Sequence as Seq

from ..params import GuidedDecodingParams

__all__ = ["Sequence", "SlotScheduler"]


@dataclass(slots=True, eq=False)
class Sequence:
    """One request in the loop (times are ``time.perf_counter()`` values)."""

    index: int
    prompt: list[int]
    guide: GuidedDecodingParams | None
    max_new_tokens: int
    slot: int | None = None
    output: list[int] = field(default_factory=list)
    accepted_prev: int = 0  # drafts the target accepted in this sequence's latest verification
    finish_reason: str | None = None
    error: str | None = None
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_steps: int = 0
    t_admitted: float = 0.0
    t_first_token: float = 0.0
    t_finished: float = 0.0

    @property
    def finished(self) -> bool:
        """True once the sequence has a finish reason."""
        return self.finish_reason is not None

    @property
    def seq_slot(self) -> int:
        """The slot of a scheduled sequence."""
        if self.slot is None:
            raise RuntimeError(f"sequence {self.index} is not scheduled into a slot")
        return self.slot

    @property
    def context(self) -> list[int]:
        """Prompt and output so far (what a drafter continues)."""
        return self.prompt + self.output

    @property
    def num_cached(self) -> int:
        """Positions of this sequence held in its KV cache slot."""
        return len(self.prompt) + len(self.output) - 1

    def append(self, tokens: Iterable[int], stop_token_ids: Seq[int]) -> int:
        """Append accepted tokens up to a stop token or the length limit; returns how many."""
        n = 0
        for t in tokens:
            if not self.output:
                self.t_first_token = time.perf_counter()
            self.output.append(t)
            n += 1
            if t in stop_token_ids:
                self.finish("stop")
            elif len(self.output) >= self.max_new_tokens:
                self.finish("length")
            if self.finished:
                break
        return n

    def finish(self, reason: str, error: str | None = None) -> None:
        """End the sequence with ``reason`` (``stop``, ``length``, ``error``) and ``error``'s
        message; a finished sequence keeps its first reason."""
        if not self.finished:
            self.finish_reason, self.error = reason, error
            self.t_finished = time.perf_counter()


class SlotScheduler:
    """First-come first-served admission of sequences into ``num_slots`` slots."""

    def __init__(self, sequences: Seq[Sequence], num_slots: int) -> None:
        self.waiting: deque[Sequence] = deque(sequences)
        self.running: list[Sequence] = []
        self.free_slots: list[int] = list(range(num_slots - 1, -1, -1))  # pop() gives slot 0 first

    @property
    def done(self) -> bool:
        """True when no sequence waits or runs."""
        return not self.waiting and not self.running

    def admit(self) -> list[Sequence]:
        """Move waiting sequences into free slots; returns the newly admitted ones."""
        admitted = []
        while self.waiting and self.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.free_slots.pop()
            seq.t_admitted = time.perf_counter()
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def retire_finished(self) -> list[Sequence]:
        """Take finished sequences out of their slots (slots become free); returns them."""
        gone = [s for s in self.running if s.finished]
        if gone:
            self.running = [s for s in self.running if not s.finished]
            for s in gone:
                self.free_slots.append(s.seq_slot)
        return gone
