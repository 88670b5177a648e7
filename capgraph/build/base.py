"""The host build contract: a step's batch in, per-request outcomes out.

A :class:`HostBuild` strategy does a decode step's host work for one decoder: it creates the
matchers that are due, feeds each guided request its new token and draft tokens, fills the
request's bitmask rows, guards against dead ends and marks the guided rows in the token mask.
What happened to a request other than plainly succeeding comes back as an :data:`Outcome`, a
status code with its detail; the decoder interprets every outcome in one place
(``GuidedDecoder._interpret``), whichever strategy produced it. The strategies promise the same
rows, masks, counters and outcomes for the same batch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from enum import IntEnum
from typing import ClassVar, NamedTuple, Sequence

from ..requests import GuidedRequests
from .slots import SlotState

__all__ = ["HostBuild", "Outcome", "Status", "StepResult"]


class Status(IntEnum):
    """What happened to a request in a build, when it did not plainly succeed. The values
    1-4 are also the C++ build's (``csrc/host_build.h``)."""

    #: the grammar refused the request's new token (nothing was filled)
    REJECTED = 1
    #: the request's first row allows no token
    DEAD_END = 2
    #: a matcher call or a check raised; detail: ``"ErrorType: message"``
    FAULT = 3
    #: the request's accept and fills took longer than the host-step budget; its rows are
    #: left unmasked and its counts are zero; detail: the milliseconds measured
    OVER_BUDGET = 4
    #: the request failed before it touched its slot, which belongs to another request of the
    #: batch (that request's matcher stays); detail: ``"ErrorType: message"``
    REFUSED = 5


#: ``(index of the request in the batch, status, detail or None)``
Outcome = tuple[int, Status, object]


class StepResult(NamedTuple):
    """A build's outcomes (in the order the strategy met them) and whether it guided a row."""

    outcomes: Sequence[Outcome]
    masked: bool


#: the results of a step in which every request plainly succeeded (shared: nothing mutates them)
PLAIN = (StepResult((), False), StepResult((), True))


class HostBuild(ABC):
    """A host build strategy, bound to one decoder's :class:`SlotState`.

    :meth:`run` builds a step synchronously. Strategies that can run the grammar work on a
    thread of their own offer :meth:`begin` / :meth:`finish`; between the two nothing may read
    the slot state. :meth:`admit` lets a strategy pass the common requests of a batch through
    the decoder's admission in native code (it only reads them).
    """

    #: the name ``GuidedDecoder(host_build=...)`` selects this strategy by
    name: ClassVar[str]
    #: whether :meth:`begin` can take a step (a thread of the strategy's own)
    asynchronous: ClassVar[bool] = False

    def __init__(self, slots: SlotState, budget_ms: float = 0.0) -> None:
        self.slots = slots
        self.budget_ms = float(budget_ms or 0.0)

    @abstractmethod
    def run(self, requests: GuidedRequests, clear_rows: int) -> StepResult:
        """Build the step of ``requests``: clear ``token_mask[:clear_rows]``, then create
        (through ``slots.create_matcher``), advance and fill. Raises only for faults outside
        any one request (the decoder then masks nothing this step)."""

    def begin(self, requests: GuidedRequests, clear_rows: int) -> bool:
        """Start the step's grammar work on the strategy's own thread and return True, or
        return False, touching nothing, when this strategy or batch cannot (then call
        :meth:`run`)."""
        return False

    @property
    def in_flight(self) -> bool:
        """Whether a build started by :meth:`begin` has not been finished."""
        return False

    def finish(self) -> StepResult:
        """Wait for the build :meth:`begin` started; what :meth:`run` would have returned."""
        raise RuntimeError(f"{type(self).__name__}: no build in flight")

    def admit(self, requests: list, slot_guides: list, slot_owners: list) -> int:
        """How many leading ``requests`` pass the decoder's inline admission test
        (:meth:`capgraph.admission.Admission.admit`), checked natively; 0 where this strategy
        has no such check."""
        return 0

    def close(self) -> None:
        """Release threads the strategy owns (a build in flight is finished first)."""
