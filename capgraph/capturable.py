"""CapturableGuidedDecoder: the guided step as host callbacks that a replayed graph runs.

The host side (:meth:`~CapturableGuidedDecoder.add_batch`) snapshots the step's requests and
puts them on a queue; everything else is enqueued on streams, so that a CUDA graph (or a
hostfunc ``HostGraph`` on the CPU stand-in) that captured one :meth:`execute` replays the whole
step: the side stream waits for the tokens event, the callbacks fetch the batch, create matchers
for disaggregated requests and build the masks, the mask is copied, the bitmask event joins the
main stream, and the main stream applies the mask to the logits.

Beyond the reference design: every put carries an epoch, which ``add_batch`` also writes to a
pinned step ticket in stream order, so that each step takes its own batch even when the host
has already queued the next step's (an engine that schedules step N+1 before step N has run), and
a replay without its ``add_batch`` or an extra ``add_batch`` raises
:class:`~capgraph.errors.QueueEpochError` at the next sync instead of silently reusing or
skipping a batch; failures and callback exceptions reach the caller through
:meth:`take_failed_requests` and the drain; captured callbacks are freed with their graph
(hostfunc); nothing process-wide is changed.
"""

from __future__ import annotations

import threading
import weakref
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Literal, Sequence

import numpy as np
import torch

import hostfunc
import hostfunc.native

from ._nvtx import nvtx_range
from .bitmask import _pin_host
from .decoder import FailedRequest, GuidedDecoder, _open_only, _request_id, _stand_ins_on
from .build.base import Status
from .build.library import NODE_RECORDS, HostNode, NodeStats
from .errors import (CallbackError, ConfigError, LayoutError, NativeBuildError, QueueEpochError,
                     RequestError, TensorArgError)
from .ops.argmax import argmax_out, full_vocabulary
from .requests import GuidedRequest, GuidedRequests
from .streams import HostStepStreams, StepStreams

__all__ = ["CapturableGuidedDecoder", "HOST_NODES", "HostNodeChoice", "MAX_QUEUED_BATCHES"]

# the kinds of the native node's records
_ROLLBACK, _DRAFT_START, _DRAFT_BUILD, _DRAFT_END = (
    NODE_RECORDS.index(k) for k in ("rollback", "draft_start", "draft_build", "draft_end"))

#: what ``CapturableGuidedDecoder(host_node=...)`` accepts
HOST_NODES = ("auto", "native", "python")
HostNodeChoice = Literal["auto", "native", "python"]

#: the step ticket holds a put's epoch modulo this (a step tells its own batch from those put
#: up to half of it before or after)
TICKET_RING = 4096
#: ``add_batch`` refuses to queue more batches than this that no step has fetched
MAX_QUEUED_BATCHES = TICKET_RING // 4

#: integer dtypes every value of which is an int32: copied into the int32 buffers as they are
_INT32_DTYPES = frozenset({torch.int8, torch.uint8, torch.int16, torch.int32,
                           getattr(torch, "uint16", torch.int16)})
#: the dtypes a token or count tensor may have: those and int64, which the copy clamps into
#: int32's range (:meth:`CapturableGuidedDecoder._int32_source`); torch has no clamp for
#: uint32 / uint64
_INDEX_DTYPES = _INT32_DTYPES | {torch.int64}
_INT32_MIN, _INT32_MAX = -2**31, 2**31 - 1
_INT32_BOUNDS_CPU = (torch.tensor(_INT32_MIN), torch.tensor(_INT32_MAX))  # (cheaper than ints)


def _clamped(src: torch.Tensor, wide: torch.Tensor, narrow: torch.Tensor | None
             ) -> torch.Tensor:
    """int64 ``src`` clamped into int32's range, in the scratch ``wide`` (int64, src's shape
    and device); on a device also cast into ``narrow`` (int32), so that the copy to the pinned
    buffer is a plain one (a cross-device copy that casts would allocate)."""
    if src.is_cpu:
        torch.clamp(src, *_INT32_BOUNDS_CPU, out=wide)
    else:
        torch.clamp(src, _INT32_MIN, _INT32_MAX, out=wide)
    if narrow is None:
        return wide  # (the CPU copy into the int32 buffer casts without a temporary)
    narrow.copy_(wide)
    return narrow


def ticket_distance(ticket: int, epoch: int) -> int:
    """How many puts ``epoch`` lies before the put whose ticket is ``ticket`` (0: that put; <0:
    a later one)."""
    d = (ticket - epoch) % TICKET_RING
    return d - TICKET_RING if d >= TICKET_RING // 2 else d


@dataclass(slots=True)
class _Put:
    """One ``add_batch``: its epoch, batch, whether the step reads its tokens from the token
    buffer, whether it wrote the step ticket (not while capturing), and the matchers it created
    for the native node to install when the step runs (``(slot, matcher or None)``)."""
    epoch: int
    batch: GuidedRequests
    has_new_tokens: bool
    ticketed: bool
    installs: list[tuple[int, Any]] = field(default_factory=list)
    #: the decoder's count of failures and releases when the put was made (advance_batch)
    events: int = 0
    #: an advance_batch step's tokens, one per request of ``batch`` (the previous put's batch,
    #: shared): a Python step writes them into the generation requests' ``new_token``
    tokens: list | None = None
    #: the failures of requests whose slot was released while the put was queued (they are
    #: stand-ins by now), recorded when its step runs (not where the put is discarded)
    released: list = field(default_factory=list)


def _callback(name: str) -> Callable:
    """A decoder method run as a host callback: when it raises, every guided request of the
    batch fails (recorded with its id, its matcher dropped) and the exception is re-raised
    (hostfunc hands it to the next drain)."""
    def wrap(fn: Callable) -> hostfunc.HostFunction:
        def run(self: "CapturableGuidedDecoder", *args) -> None:
            try:
                fn(self, *args)
            except (QueueEpochError, CallbackError):
                raise
            except Exception as e:
                # every guided request of the batch fails as any failed request does: its
                # matcher dropped (the fault may have left it half advanced), reported once;
                # the native node's steps up to this one are read first (they name the batch)
                self._node_collect()
                self._events += 1  # (advance_batch: the batch cannot simply continue)
                batch = self.requests_hostfunc
                ids = self._fail_batch(batch, f"{name}: {type(e).__name__}: {e}") \
                    if batch else []
                raise CallbackError(f"{type(e).__name__}: {e}", callback=name,
                                    request_ids=ids) from e
        run.__name__ = run.__qualname__ = name
        return hostfunc.hostfunc(nvtx_range(f"CapturableGuidedDecoder.{name}")(run))
    return wrap


def _past_rows(first: int, end: int, rows: int) -> str:
    """The failure of a request whose bitmask rows ``[first, end)`` lie past the ``rows``
    logits rows its step masks (the native node's text is the same: ``PastRows``)."""
    return (f"LayoutError: the request's bitmask rows [{first}, {end}) lie past the {rows} "
            "logits rows this step masks (a graph captured for a smaller batch, or "
            "prepare(num_rows) below the batch layout): they would be sampled unmasked")


def _check_draft_step(draft_step: object) -> None:
    if type(draft_step) is not int or draft_step < 0:
        raise LayoutError(f"draft_step={draft_step!r} must be an int >= 0")


class CapturableGuidedDecoder(GuidedDecoder):
    """A :class:`GuidedDecoder` whose per-step work runs as host callbacks on streams.

    Arguments as for :class:`GuidedDecoder`. Use it the same way per step — ``add_batch``
    then ``execute`` — and it works unchanged inside ``torch.cuda.graph`` capture (CUDA) or
    ``hostfunc.capture`` (CPU stand-in): capture one ``execute`` (with its forward and sampling)
    and, each step, call ``add_batch`` then replay. The host may run ahead: ``add_batch`` for
    the next step may come before the previous replay has run (no sync between steps), on the
    stream the steps are replayed on; each replay takes its own batch (see :meth:`add_batch`).

    ``execute`` returns nothing (a host callback cannot); call :meth:`take_failed_requests`
    after the step's sync. Callback exceptions are re-raised by the drain that ends each
    non-captured ``execute`` (and by ``hostfunc.drain()``), as ``hostfunc.HostFuncError``.
    ``close()`` runs the work queued on the side stream, then ends it (see
    :meth:`GuidedDecoder.close`); afterwards every step method, the draft and rollback ones
    included, raises :class:`~capgraph.errors.DecoderClosedError`.

    ``host_node`` chooses the step's host callback: ``"native"``, the C++ host node, which a
    replayed graph calls as a C function that never takes the GIL for a steady-state batch
    (every guided request a target request generating, with a chain of drafts; any other
    batch is a Python step inside the same node, which takes the GIL); ``"python"``, the
    Python host callback (any backend and strategy); ``"auto"`` (default): native where the
    decoder's host build is the native one (:mod:`capgraph.build`) and hostfunc can launch
    native functions here (a C compiler for the CPU stand-in's lane), else Python. The
    native node serves every step from the first capture of the decoder's step on (steps
    before any capture, such as graph warm-up, take the Python callback, which on the CPU
    stand-in runs the build on the C++ build's own thread). With the native node, a step's
    batch is read at ``add_batch`` and what the step did is read back at the next
    ``add_batch``, ``take_failed_requests`` or drain; :meth:`rollback_rejected_batch` (without
    draft trees) and a drafting loop's :meth:`execute_draft_batch` steps are the node's too,
    Python's only after a Python step or where a slot's matcher only Python can run.

    Where the signatures differ from :class:`GuidedDecoder`'s (on purpose, marked
    ``type: ignore[override]``): ``add_batch(requests, new_tokens=None,
    runtime_draft_len=None)`` takes the token tensor second (a positional draft length is
    refused with a :class:`~capgraph.errors.TensorArgError` saying so), and ``execute``
    returns None. It is built on the base class's protected interface only.
    """

    #: hostfunc keeps the errors of this decoder's callbacks as its own: its execute and
    #: rollbacks raise those (and ownerless ones), never another decoder's
    __hostfunc_owner__ = True

    def __init__(self, *args, host_node: HostNodeChoice = "auto", **kwargs) -> None:
        super().__init__(*args, **kwargs)
        S, D = self.max_num_sequences, self.max_num_draft_tokens
        pin = _pin_host()
        # [position, slot]: the golden token and the drafts of each slot
        self.new_tokens = torch.zeros(D + 1, S, dtype=torch.int32, pin_memory=pin)
        # [batch position]: the token each request's matcher consumes in a draft step
        self.draft_new_tokens = torch.zeros(S, dtype=torch.int32, pin_memory=pin)
        # [batch position]: accepted tokens of the last verification, bonus token included
        self.num_accepted_tokens = torch.zeros(S, dtype=torch.int32, pin_memory=pin)
        # [batch position]: the deepest accepted node of each request's draft tree (-1: none)
        self.accepted_draft_nodes = torch.full((S,), -1, dtype=torch.int32, pin_memory=pin)
        # per int32 buffer, device (and shape): the clamp scratch of an int64 source
        self._int32_scratch: dict[tuple, Any] = {}
        self._new_tokens_np = self.new_tokens.numpy()
        # the epoch of the latest add_batch (modulo TICKET_RING), written in stream order: on
        # CUDA copied from _ticket_ids on the current stream, on the CPU stand-in by a task on
        # the current HostStream where it has work queued (_write_step)
        self._ticket = torch.zeros(1, dtype=torch.int32, pin_memory=pin)
        self._ticket_np = self._ticket.numpy()
        self._ticket_ids = torch.arange(TICKET_RING, dtype=torch.int32, device=self.device) \
            if self.device.type == "cuda" else None
        self.requests_hostfunc: GuidedRequests | None = None  # read and written by callbacks
        self._draft_requests: GuidedRequests | None = None
        self._rollback_batch: GuidedRequests | None = None  # fetch_accepted_batch's batch
        self._queue: deque[_Put] = deque()
        # requests of the latest add_batch: the per-request tensors of the calls after it
        # (add_draft_batch, rollback_rejected_batch) must give at least that many entries
        self._batch_len = 0
        self._put_epoch = 0  # host side
        self._fetched_epoch = 0  # callback side
        self._last_put: _Put | None = None  # the latest put (the batch advance_batch advances)
        self._ran_epoch = 0  # the latest put whose step ran (natively or in Python)
        self._events = 0  # failures recorded and slots released (see advance_batch)
        self._popped = False  # fetch_batch's _pop took its put off the queue
        self._warmup = 0
        self._prepared = False
        #: the prepared step's execute was refused (its logits): the next add_batch leaves it
        self._prepared_refused = False
        self._prepared_rows = 0  # the bitmask rows the step prepared copies (and masks)
        self._prepared_d2t: torch.Tensor | None = None  # the d2t the prepared step guards for
        # the index of the current drafting loop's last step (its batch's runtime draft
        # length - 1, 0 for none; read when its first step runs)
        self._draft_last = 0
        self._tokens_recorded_in_capture = False  # record_tokens_ready() ran in this capture
        self.active = False
        if self.device.type == "cpu":  # on CUDA the base class made the torch streams
            # with the C++ build's own thread, no Python thread runs beside a CPU forward
            self._streams = HostStepStreams(inline_when_idle=self.host_build.asynchronous)
        else:  # probe the driver for hostfunc now, not inside a first graph capture
            hostfunc.cuda_available()
        # the CPU step outside capture builds on that thread (see _enqueue_step)
        self._async_build = self.bitmask is self.bitmask_host and self.host_build.asynchronous
        self._node: HostNode | None = None
        self._mirror: _Mirror | None = None  # the node's copy of the slots (_make_host_node)
        self._node_active = False  # a step was captured with the node: every step takes it
        self._in_node = False  # a Python step of the node runs (it took its job itself)
        # one reader of the node's results at a time (the host thread and a Python step
        # inside the node may both read; results are applied in step order)
        self._collect_lock = threading.RLock()
        # (finishing a build may change a slot, which reads the node's results first: one
        # lock for both, so that the two are never taken in opposite orders)
        self._finish_lock = self._collect_lock
        # the batch after launch (set_batch_after_launch): the node's wait in seconds, or None
        self._after_launch: float | None = None
        #: which host step the step's callback runs: ``"native"`` (the C++ host node,
        #: :class:`~capgraph.build.library.HostNode`) or ``"python"``
        self.host_node: str = self._make_host_node(host_node)

    @property
    def batch_after_launch(self) -> float | None:
        """How long a replayed step's native node waits for its batch when ``add_batch``
        follows the step's launch (:meth:`set_batch_after_launch`), in seconds; None: each
        step's ``add_batch`` comes before its replay."""
        return self._after_launch

    @_open_only
    def set_batch_after_launch(self, timeout_s: float | None = 10.0) -> None:
        """Let each replayed step's ``add_batch`` come after the step's launch, so that the
        host work of making and queueing the batch runs while the GPU runs the forward.

        In a loop that synchronises every step the GPU is idle while the host prepares the
        next replay: a guided step's requests and ``add_batch`` then lengthen every step. With
        this set, a loop replays first and calls ``add_batch`` next, before its sync; the
        replay's native node, which the driver may start before that, waits (on its own
        thread, without the GIL) up to ``timeout_s`` for the batch, then runs it as usual::

            decoder.set_batch_after_launch()
            for requests in batches:
                graph.replay()                  # forward, host node (waits for its batch)
                decoder.add_batch(requests)     # on the host while the forward runs
                torch.cuda.synchronize()
                failed = decoder.take_failed_requests()

        In this mode (from the first capture on, outside a capture) ``add_batch`` writes no
        step ticket, so the host cannot queue a step ahead of the stream, and takes no
        ``new_tokens`` (the requests carry their tokens). A step's batch is the one put after
        the previous step's; eager steps (``add_batch``, then ``execute``) work as before.

        Where a replay's ``add_batch`` raised, ``add_batch([])`` gives the waiting step an
        empty batch: it masks nothing (the step's tokens were sampled unguided: feed its
        requests again). ``set_batch_after_launch(None)`` (or ``close()``, or the decoder's
        collection without it) also lets a waiting step go (it masks nothing and reports a
        ``QueueEpochError`` at the next drain); switch the mode on again only after the stream
        has synchronised, or that step may take the next batch. A replay with no batch within
        ``timeout_s`` reports a ``QueueEpochError`` and stops the mode: every later step masks
        nothing and reports one (a batch that came after its step gave up is dropped, never
        masked for another step) until
        ``set_batch_after_launch`` or ``discard_queued_batches`` resumes it. The matchers took
        none of the dropped steps' tokens: the requests are fed from where their last served
        step left them. ``generate()`` sets this mode where it replays CUDA graphs with the
        native node and without speculation.

        Args:
            timeout_s: the node's wait in seconds, > 0 and at most 3600; None: back to
                ``add_batch`` before each replay.

        Raises:
            ConfigError: the native host node does not serve this decoder (the Python host
                callback runs under the GIL, which the waiting thread would need), the decoder
                takes drafts (a step's rollback of rejected drafts must come before its
                replay), or a bad ``timeout_s``.
            DecoderClosedError: the decoder was closed.
        """
        if timeout_s is not None:
            if self._node is None:
                raise ConfigError(
                    "set_batch_after_launch needs the native host node (host_node='native' or "
                    f"'auto' where it builds); this decoder's host node is {self.host_node!r}")
            if self.max_num_draft_tokens:
                raise ConfigError(
                    "set_batch_after_launch needs a decoder without drafts "
                    f"(max_num_draft_tokens={self.max_num_draft_tokens}): a step's rollback of "
                    "rejected drafts and its drafting loop must come before its replay")
            if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                    or not 0 < timeout_s <= 3600:
                raise ConfigError(f"set_batch_after_launch: timeout_s={timeout_s!r} must be a "
                                  "number of seconds in (0, 3600]")
        self._after_launch = None if timeout_s is None else float(timeout_s)
        if self._node is not None:
            self._node.set_batch_wait(self._batch_wait_ms())
            self._resume_after_launch()

    def _batch_wait_ms(self) -> int:
        return 0 if self._after_launch is None else max(1, round(self._after_launch * 1000))

    def _resume_after_launch(self) -> None:
        """Where a step's wait for its batch ran out (the mode stopped), drop the batches
        queued since and resynchronise the node's epochs with the host's."""
        node = self._node
        if node is None or not node.batch_wait_stopped():
            return
        self._node_collect()
        while self._queue:
            self._consume_put(newest=False)
        self._fetched_epoch = self._put_epoch
        node.set_batch_wait(self._batch_wait_ms(), self._put_epoch)

    def _after_launch_now(self) -> bool:
        """Whether this ``add_batch`` follows its step's launch (see
        :meth:`set_batch_after_launch`): the mode is set, the node serves steps, no capture."""
        return self._after_launch is not None and self._node_active \
            and not self._streams.is_capturing()

    @property
    def queued_batches(self) -> int:
        """Batches put by ``add_batch`` that no step has fetched yet: 0 or 1 in step, more
        while the host schedules ahead of steps still in flight."""
        self._node_collect()  # (a batch the native node has run is fetched)
        return len(self._queue)

    @_open_only
    def discard_queued_batches(self) -> int:
        """Drop the batches ``add_batch`` queued that no step will fetch (say, after an error
        between ``add_batch`` and ``execute``), so that the next ``add_batch`` is in step;
        the matchers their failed requests owned are dropped as a fetch would. Returns how
        many were dropped. Call it host side, with no step in flight."""
        self._node_collect()  # (a batch the native node has run is fetched)
        n = len(self._queue)
        while self._queue:
            self._consume_put(newest=False)
        self._resume_after_launch()
        return n

    @property
    def streams(self) -> StepStreams:
        """The step's side stream and its two events (:mod:`capgraph.streams`)."""
        return self._streams

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held by the decoder's buffers, the pinned token buffers included."""
        sizes = super().memory_bytes()
        sizes["host"] += (self.new_tokens.nbytes + self.draft_new_tokens.nbytes
                          + self.num_accepted_tokens.nbytes + self.accepted_draft_nodes.nbytes
                          + self._ticket.nbytes)
        if self._ticket_ids is not None:
            sizes["device"] = sizes.get("device", 0) + self._ticket_ids.nbytes
        return sizes

    # -- host side ---------------------------------------------------------------------------
    @nvtx_range("CapturableGuidedDecoder.add_batch")
    @_open_only
    def add_batch(  # type: ignore[override]  # new_tokens second, before runtime_draft_len
            self, requests: Sequence[GuidedRequest], new_tokens: torch.Tensor | None = None,
            runtime_draft_len: int | None = None, *, copy: bool = True) -> None:
        """Snapshot this step's requests and queue them for the step's callbacks (host side).

        Args:
            requests: this step's requests in batch order (copied: later changes by the caller
                do not reach the callbacks).
            new_tokens: optional int tensor ``[1 + max_num_draft_tokens, max_num_sequences]``
                (a trailing dim of 1 is accepted): per slot, the golden token then the drafts,
                read by the fetch callback instead of the requests' ``new_token`` /
                ``draft_tokens`` for requests with a ``prev_seq_slot``. Copied without blocking,
                in the current stream's order: a device tensor read when the stream gets there,
                a CPU tensor read at the call.
            runtime_draft_len: draft length of this step (default: the maximum).
            copy: ``False`` hands the requests that are exact :class:`GuidedRequest` instances
                over instead of copying them: the caller makes them for this call and never
                changes them, nor their ``draft_tokens`` / ``draft_parents`` lists, afterwards
                (the step's callbacks and the failure reports after it read them; the decoder
                writes into them: a request whose tokens come from ``new_tokens`` gets them in
                its ``new_token`` and ``draft_tokens`` where a Python step builds it or the
                native node reports it failed, and ``rollback_rejected_batch`` its
                accepted count and node in ``num_accepted_draft_tokens`` and
                ``accepted_draft_node``). Any other object is still copied. It saves
                the copy, about a third of ``add_batch``'s time per request
                (``tools/bench_guided_host.py``); ``generate()``'s guide driver hands its
                fresh requests over this way.

        The step may be scheduled before the previous one has run (its replay still queued on
        the stream): the tokens and the step's ticket are written in stream order (on the
        current stream, where the step is replayed), so each step takes its own batch and
        tokens, and a new request placed in a slot whose previous request's last step is still
        in flight gets its matcher after that step.

        The requests are checked as :meth:`GuidedDecoder.add_batch` checks them: a bad one
        fails alone (an unguided stand-in takes its rows; :meth:`take_failed_requests` returns
        its failure), a ``draft_tokens`` tuple, tensor or array becomes a list of ints.

        Raises:
            LayoutError: as for :meth:`GuidedDecoder.add_batch`, or ``copy`` is not a bool;
                nothing is queued.
            TensorArgError: ``new_tokens`` is not an integer tensor of the shape above, or
                has fewer position rows than ``1 + runtime_draft_len``, or is given with the
                batch after launch (:meth:`set_batch_after_launch`).
            QueueEpochError: :data:`MAX_QUEUED_BATCHES` batches are queued already that no
                step has fetched (each ``add_batch`` without its replay); nothing is queued.
            DecoderClosedError: the decoder was closed; nothing is read or changed.
        """
        if type(copy) is not bool:
            raise LayoutError(f"add_batch: copy={copy!r} is not a bool (True: copy the "
                              "requests; False: take exact GuidedRequest instances as they are)")
        after_launch = self._after_launch_now()
        if after_launch and new_tokens is not None:
            raise TensorArgError(
                "new_tokens with the batch after launch (set_batch_after_launch): the tokens "
                "would be copied in stream order after the step that reads them; the requests "
                "carry their new_token and draft_tokens instead")
        self._queue_batch(requests, new_tokens, runtime_draft_len, copy, after_launch)

    @nvtx_range("CapturableGuidedDecoder.advance_batch")
    @_open_only
    def advance_batch(self, new_tokens: Sequence[int]) -> None:
        """Queue the next step of the latest batch: the same requests in the same rows, each
        advanced by its token, in one call instead of a request object per row.

        What ``add_batch`` would queue for the same requests one step later (a context request
        at its last chunk becomes a generation request, a disaggregated first step a plain
        one; unguided requests stay as they are). Where the native node's latest job is every
        guided request generating with its own token (no drafts, no new matcher), it queues
        that job again with the new tokens, which costs about as much as the list of tokens.
        Elsewhere (the Python host node, a context or disaggregated first step, a step of the
        latest batch still queued, a token that is not an exact int in the vocabulary) it
        makes the requests and queues them as ``add_batch`` does. The tokens are read at the
        call (the caller may refill its list at once). Works with the batch after launch
        (:meth:`set_batch_after_launch`): the tokens come with the call.

        Args:
            new_tokens: one token id per request of the latest batch, in batch order (an
                unguided request's entry is not read); a list, tuple, or a ``[n]`` or
                ``[n, 1]`` NumPy array or CPU tensor.

        Raises:
            LayoutError: no batch was queued since the decoder began; the latest batch has
                drafts (a runtime draft length above 0) or draft requests, or a context
                request before its last chunk; ``new_tokens`` does not hold one entry per
                request, or is an array of another shape; since that batch's ``add_batch``
                began a request failed (there or in a step) or a slot was released; or its
                step did not run (discarded, a capture's, a queue error): it cannot simply
                continue, so make the next batch with ``add_batch``. Nothing is queued.
            TensorArgError: ``new_tokens`` is a device tensor (reading it here would wait for
                the stream: give the tokens on the host, or pass the tensor to ``add_batch``),
                or a tensor or array whose dtype is not an integer one.
            QueueEpochError, DecoderClosedError: as for ``add_batch``.
        """
        last = self._last_put
        if last is None:
            raise LayoutError("advance_batch: no batch to advance (queue the first with "
                              "add_batch)")
        batch = last.batch
        if batch.max_num_draft_tokens or batch.is_draft_step:
            raise LayoutError(
                "advance_batch advances a batch without drafts; the latest has runtime draft "
                f"length {batch.max_num_draft_tokens}"
                f"{' and draft requests' if batch.is_draft_step else ''}: make the next "
                "batch with add_batch")
        tokens = self._advance_tokens(new_tokens, len(batch.requests))
        after_launch = self._after_launch_now()
        with self._collect_lock:  # (a step taking its put reads and writes these together)
            if self._advance_queued(last, batch, tokens, after_launch):
                return
        self._queue_batch(self._advanced_requests(batch, tokens), None, 0, False,
                          after_launch)

    def _advance_queued(self, last: _Put, batch: GuidedRequests, tokens: list,
                        after_launch: bool) -> bool:
        """advance_batch's checks, and its step queued as the native node's last job again
        where it can be (True); False: queue it as add_batch does."""
        # the node's unread records: where they are plain steps of every queued put, the
        # latest included, they are read after this step's job is queued (the node may be
        # waiting for it: the batch after launch); else first (the failures of the steps
        # that ran so far)
        deferred = False
        if self._node_active and self._node is not None:
            plain = self._plain_records(self._node)
            queue = self._queue
            deferred = plain is not None and plain[0] > 0 and plain[0] == len(queue) \
                and queue[-1] is last and plain[1] == last.epoch
            if not deferred:
                self._node_collect()
        if self._events != last.events:
            raise LayoutError(
                "advance_batch: a request failed or a slot was released since the latest "
                "batch's add_batch began (take_failed_requests() names the failures), so that "
                "batch cannot simply continue: make the next batch with add_batch")
        queued = not deferred and bool(self._queue) and self._queue[-1] is last
        if not queued and not deferred and self._ran_epoch != last.epoch:
            raise LayoutError(
                "advance_batch: the latest batch's step did not run (discarded, taken by a "
                "capture for its shapes, or consumed by a queue error), so its matchers did "
                "not take its tokens: make the next batch with add_batch")
        node = self._node
        if node is not None and self._node_active and (deferred or not self._queue) \
                and not self._streams.is_capturing():
            if node.repeat(tokens, self._put_epoch + 1, not after_launch):
                self._append_put(batch, None, after_launch, last.events, tokens)
                self.requests, self._batch_built = batch, False
                self._streams.record_tokens()
                if deferred:  # (the earlier steps' records leave the queue ahead of this one)
                    self._node_collect()
                return True
        if deferred:
            self._node_collect()
        return False

    @staticmethod
    def _advance_tokens(new_tokens: object, count: int) -> list:
        """advance_batch's tokens as a new list of ``count`` items (values checked later: the
        caller may refill its own list or array as soon as the call returns)."""
        if isinstance(new_tokens, torch.Tensor) and new_tokens.device.type != "cpu":
            raise TensorArgError(
                f"advance_batch: new_tokens is a {new_tokens.device} tensor; reading it on the "
                "host would wait for the stream: give the tokens on the host, or pass the "
                "tensor to add_batch(requests, new_tokens)")
        shape = getattr(new_tokens, "shape", None)
        tokens: list
        if shape is not None and hasattr(new_tokens, "tolist"):  # a tensor or an array
            dtype = new_tokens.dtype  # type: ignore[attr-defined]
            if dtype not in _INDEX_DTYPES if isinstance(new_tokens, torch.Tensor) \
                    else getattr(dtype, "kind", None) not in ("i", "u"):
                raise TensorArgError(f"advance_batch: new_tokens must hold integer token ids, "
                                     f"got dtype {dtype}")
            array: Any = new_tokens
            if len(shape) == 2 and shape[1] == 1:  # (a sampler's column)
                shape = shape[:1]
                array = array.reshape(-1)
            if len(shape) != 1:
                raise LayoutError(f"advance_batch: new_tokens has shape {tuple(shape)}; it "
                                  "takes one token id per request ([n] or [n, 1])")
            tokens = array.tolist()
        elif isinstance(new_tokens, (list, tuple)):
            tokens = list(new_tokens)
        else:
            raise LayoutError(f"advance_batch: new_tokens must be a sequence of token ids, "
                              f"got {type(new_tokens).__name__}")
        if len(tokens) != count:
            raise LayoutError(f"advance_batch: {len(tokens)} tokens for the latest "
                              f"batch's {count} requests (one per request, in batch order)")
        return tokens

    @staticmethod
    def _advanced_requests(batch: GuidedRequests, tokens: list) -> list[GuidedRequest]:
        """The requests of ``batch`` one step later, each with its token from ``tokens``."""
        reqs = batch.requests
        chunk = next((i for i, r in enumerate(reqs) if r.is_context_init_state
                      and not r.is_last_context_chunk and r.guided_decoding_params is not None),
                     None)
        if chunk is not None:
            raise LayoutError(
                f"advance_batch: request {reqs[chunk].request_id} (batch index {chunk}) is a "
                "context request before its last chunk: its next step is another chunk, not a "
                "token; make the next batch with add_batch")
        # (GuidedRequest.generation's fields, positional: this runs per row)
        return [GuidedRequest(p, r.request_id, r.seq_slot, None, False, False, True, False, t,
                              False, [], 0)
                if (p := r.guided_decoding_params) is not None else GuidedRequest.snapshot(r)
                for r, t in zip(reqs, tokens)]

    def _queue_batch(self, requests: Sequence[GuidedRequest], new_tokens: torch.Tensor | None,
                     runtime_draft_len: int | None, copy: bool, after_launch: bool) -> None:
        """add_batch's work; ``after_launch``: the step was launched already (no ticket)."""
        if new_tokens is not None:
            self._check_new_tokens(new_tokens)
            draft_len = self.max_num_draft_tokens if runtime_draft_len is None else \
                self._checked_draft_len(runtime_draft_len)
            rows = (new_tokens.squeeze(-1) if new_tokens.dim() == 3 else new_tokens).shape[0]
            if rows < 1 + draft_len:
                raise TensorArgError(
                    f"new_tokens has {rows} position rows; this step reads 1 + "
                    f"runtime_draft_len = {1 + draft_len} (the new token and each draft), and "
                    "rows it does not give would hold an earlier step's tokens")
        if isinstance(requests, (str, bytes)) or not hasattr(requests, "__len__"):
            raise LayoutError(f"requests must be a sequence of GuidedRequest, got "
                              f"{type(requests).__name__}")
        if self._node_active:
            self._node_collect()  # (what the last step did, before this batch is admitted)
        events = self._events  # (before the admission, which may fail a request)
        if len(self._queue) >= MAX_QUEUED_BATCHES:
            raise QueueEpochError(
                f"{len(self._queue)} batches are queued that no step has fetched (at most "
                f"{MAX_QUEUED_BATCHES}): each add_batch needs its replay or execute; "
                "discard_queued_batches() drops them")
        snapshot = GuidedRequest.snapshot
        try:
            if copy:
                snapshots = [snapshot(r) for r in requests]
            else:  # handed over: exact instances as they are
                snapshots = [r if type(r) is GuidedRequest else snapshot(r) for r in requests]
        except Exception:  # a request without the fields: checked_request names it
            snapshots = list(requests)
        # checked as GuidedDecoder.add_batch checks them; the slots a failed request drops
        # are dropped by the callback that fetches this batch (_pop), in step order
        batch = self._add_batch(snapshots, runtime_draft_len, new_tokens is not None)
        self._batch_len = len(batch.requests)  # type: ignore[union-attr]
        put = self._append_put(batch, new_tokens, after_launch, events)
        if self._node_active:
            self._node_push(put)
        self.active = \
            next(batch.valid_requests(), None) is not None  # type: ignore[union-attr]
        if not self._streams.is_capturing():
            self._streams.record_tokens()  # orders the callbacks after the token copy

    def _append_put(self, batch: GuidedRequests, new_tokens: torch.Tensor | None,
                    after_launch: bool, events: int, tokens: list | None = None) -> _Put:
        """Queue the step of ``batch`` as the next epoch's and make it the latest put: its
        ticket (and ``new_tokens``) written in stream order unless the step was launched
        already; ``tokens``: an advance_batch step's. Returns the put (add_batch and
        advance_batch share this; each queues the node's job itself)."""
        self._tokens_recorded_in_capture = False
        self._put_epoch += 1
        ticketed = False if after_launch else self._write_step(self._put_epoch, new_tokens)
        put = _Put(self._put_epoch, batch, new_tokens is not None, ticketed, events=events,
                   tokens=tokens)
        self._queue.append(put)
        self._last_put = put
        if self._prepared_refused:  # a step prepare() enqueued whose execute was refused (bad
            # logits) is over: its host work ran, its mask is never applied, and this batch's
            # step enqueues its own
            self._prepared = self._prepared_refused = False
        return put

    def _check_new_tokens(self, new_tokens: object) -> None:
        if not isinstance(new_tokens, torch.Tensor):
            raise TensorArgError(
                f"new_tokens must be a tensor or None, got {type(new_tokens).__name__} "
                f"{new_tokens!r}; CapturableGuidedDecoder.add_batch takes (requests, new_tokens, "
                "runtime_draft_len): pass runtime_draft_len by keyword")
        if new_tokens.dtype not in _INDEX_DTYPES:
            raise TensorArgError(f"new_tokens must be an integer tensor (int8 to int64, uint8, "
                                 f"uint16), got {new_tokens.dtype}")
        t = new_tokens.squeeze(-1) if new_tokens.dim() == 3 else new_tokens
        if t.dim() != 2 or t.shape[0] > self.new_tokens.shape[0] or t.shape[1] != self.max_num_sequences:
            raise TensorArgError(
                f"new_tokens has shape {tuple(new_tokens.shape)}; expected [<= "
                f"{self.new_tokens.shape[0]}, {self.max_num_sequences}] (positions x slots)")

    def _token_rows(self, new_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``new_tokens`` as ``[positions, slots]`` and the token buffer's rows it fills."""
        t = new_tokens.squeeze(-1) if new_tokens.dim() == 3 else new_tokens
        return self.new_tokens[:t.shape[0]], t

    def _copy_new_tokens(self, new_tokens: torch.Tensor) -> None:
        dst, t = self._token_rows(new_tokens)
        dst.copy_(self._int32_source(t, dst), non_blocking=True)

    def _int32_scratch_for(self, src: torch.Tensor, dst: torch.Tensor
                           ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """None where ``src``'s values all fit the int32 buffer ``dst`` (a plain copy keeps
        them); else (int64) the scratch :func:`_clamped` writes, shaped as ``src``, on its
        device: allocated once per buffer and device, so a step allocates nothing and a
        captured graph keeps reading the same memory."""
        if src.dtype in _INT32_DTYPES:
            return None
        cache, device = self._int32_scratch, src.device
        key = (dst.data_ptr(), device, src.shape)
        views = cache.get(key)
        if views is None:
            base = cache.get(key[:2])
            if base is None:  # the whole buffer's size: any rows of it
                n = dst.untyped_storage().nbytes() // dst.element_size()
                base = cache[key[:2]] = (
                    torch.empty(n, dtype=torch.int64, device=device),
                    None if device.type == "cpu" else
                    torch.empty(n, dtype=torch.int32, device=device))
            k = src.numel()
            views = cache[key] = tuple(None if b is None else b[:k].view(src.shape)
                                       for b in base)
        return views

    def _int32_source(self, src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        """What the copy of ``src`` into the int32 buffer ``dst`` reads: ``src`` itself, or
        for an int64 ``src`` its values clamped into int32's range (in stream order on a
        device, reading nothing on the host: no sync, capturable), so that a value past
        int32 stays outside the vocabulary or count range the request checks refuse, where a
        plain copy would wrap it (``2**32 + 1`` to ``1``)."""
        scratch = self._int32_scratch_for(src, dst)
        return src if scratch is None else _clamped(src, *scratch)

    def _write_step(self, epoch: int, new_tokens: torch.Tensor | None) -> bool:
        """Write the step's tokens and ticket (``epoch`` modulo :data:`TICKET_RING`) where the
        stream that runs the step reads them after every step enqueued before: on CUDA as
        copies on the current stream (a CPU ``new_tokens`` as :meth:`_cuda_copy` lands it);
        on the CPU stand-in as :meth:`_in_stream_order` runs
        them, reading ``new_tokens`` when the stream gets there (as a CUDA copy does: a
        sampler enqueued before may still write them). While capturing only the tokens are
        copied (as before a capture's shapes-only step) and no ticket is written: False."""
        if self._streams.is_capturing():
            if new_tokens is not None:
                self._copy_new_tokens(new_tokens)
            return False
        self._join_prepared()
        k = epoch % TICKET_RING
        if self._ticket_ids is not None:
            if new_tokens is not None:
                dst, t = self._token_rows(new_tokens)
                self._cuda_copy(dst, self._int32_source(t, dst), "new_tokens")
            self._ticket.copy_(self._ticket_ids[k:k + 1], non_blocking=True)
            return True
        ticket, copy = self._ticket_np, self._copy_new_tokens

        def write() -> None:
            if new_tokens is not None:
                copy(new_tokens)  # (checked at add_batch: it cannot fail)
            ticket[0] = k
        self._in_stream_order(write)
        return True

    def _join_prepared(self) -> None:
        """Where a prepared step's host work is still queued on the side stream (``prepare``
        ran, its ``execute`` not yet), make the current stream wait for it (the join its
        ``execute`` makes): what is then written or released in the current stream's order
        (the next step's tokens and ticket, a slot) comes after that step has read the
        buffers and run its matchers. Outside capture only (a capture records in order)."""
        if self._prepared and not self._streams.is_capturing() \
                and not self._streams.side_idle():
            self._streams.wait_bitmask()

    @staticmethod
    def _in_stream_order(work: Callable[[], None]) -> None:
        """On the CPU stand-in, run ``work`` (which must not raise) after the work already on
        the current HostStream: at once where the stream is idle, else as a task on it."""
        stream = hostfunc.current_stream()
        if stream.query():  # nothing queued reads the buffers before this
            work()
        else:
            stream.enqueue(work)

    def record_tokens_ready(self) -> None:
        """Record the tokens event on the current stream.

        Call it from the step's input preparation *inside* the captured region, after the
        step's new tokens are in place, so that each replay's callbacks wait for them (and
        no longer: the host work then overlaps the forward). ``add_batch`` also records it
        (outside capture) after its own token copy. A capture without it still works: the
        step's ``prepare`` / ``execute`` records it where it is called, so the host work waits
        for everything enqueued before it.
        """
        self._streams.record_tokens()
        if self._streams.is_capturing():
            self._tokens_recorded_in_capture = True

    @contextmanager
    def warmup(self) -> Iterator[None]:
        """Runs inside this block fetch no batch and so mask and advance nothing.

        Graph warm-up runs the step several times before capture for one ``add_batch``; the
        queued batch is left for the capture (which only needs its shapes) to consume.
        """
        self._warmup += 1
        if self._node is not None:
            self._node.set_warmup(True)
        try:
            yield
        finally:
            self._warmup -= 1
            if self._node is not None and not self._warmup:
                self._node.set_warmup(False)

    # -- the step ----------------------------------------------------------------------------
    @nvtx_range("CapturableGuidedDecoder.prepare")
    @_open_only
    def prepare(self, num_rows: int | None = None, d2t: torch.Tensor | None = None) -> None:
        """Enqueue this step's host work (fetch, init, build, copy) on the side stream now.

        Optional: ``execute`` does it when not done. On the CPU stand-in, call it before the
        forward so that mask building overlaps the (synchronous) CPU forward; ``execute``
        after the forward then only waits and applies. In a CUDA graph capture, call it right
        after :meth:`record_tokens_ready`, before the forward: the step's host node and
        bitmask copy are then nodes created before the forward's kernels, which a replay
        submits first (``generate()`` captures its steps so), rather than after the last of
        them. A prepared step whose ``execute`` is refused (bad logits) stays prepared for an
        ``execute`` with proper logits; the next ``add_batch`` instead leaves it (its host
        work ran, its mask is never applied) and that batch's step runs its own. Without a
        refusal, the next step's ``add_batch`` may come before this step's ``execute``.

        Args:
            num_rows: bitmask rows to copy to the device (the logits' rows); default all. A
                request whose rows lie past them fails (a ``LayoutError`` from
                :meth:`take_failed_requests`), and ``execute`` masks only these rows.
            d2t: the draft-to-target table ``execute`` will be given (logits in a pruned draft
                vocabulary), or None: the host work then leaves a row whose allowed tokens
                the draft vocabulary misses unmasked, as ``execute`` does when it enqueues
                the step; ``execute`` must be given the same tensor.

        Raises:
            LayoutError: ``num_rows`` is not an int in ``[1, bitmask rows]``, or the step is
                prepared already for another number of rows; nothing is enqueued.
            TensorArgError: a bad ``d2t`` (as for :meth:`execute`), or the step is prepared
                already for another ``d2t``; nothing is enqueued.
        """
        rows = self.bitmask_host.shape[0]
        if num_rows is not None and (type(num_rows) is not int or not 1 <= num_rows <= rows):
            raise LayoutError(f"prepare: num_rows={num_rows!r} must be None or an int in "
                              f"[1, {rows}] (the bitmask's rows)")
        if self._prepared and d2t is not self._prepared_d2t:
            raise TensorArgError("prepare: the step is prepared already for another d2t (its "
                                 "host work is enqueued)")
        if d2t is not None:
            self._tensors.check_table(d2t)
        if not self._prepared:
            self._enqueue_step(num_rows, self._streams.is_capturing(), d2t)
        elif num_rows is not None and num_rows != self._prepared_rows:
            raise LayoutError(f"prepare: num_rows={num_rows} for a step prepared already for "
                              f"{self._prepared_rows} rows (its host work is enqueued; its "
                              "execute masks those rows)")

    def _enqueue_step(self, num_rows: int | None, capturing: bool,
                      d2t: torch.Tensor | None = None) -> None:
        if capturing:
            # the batch queued before capture only gave the shapes: no replay will fetch it
            self._consume_put()
        if capturing and not self._tokens_recorded_in_capture:
            # the side stream must wait on an event recorded inside this capture: one recorded
            # before it would leave the host work outside the graph (and CUDA rejects the join)
            self._streams.record_tokens()
        self._tokens_recorded_in_capture = False
        # On the CPU stand-in, outside capture, the build's xgrammar work runs on the C++
        # build's own thread, which never takes the GIL and yields to the caller's threads,
        # beside the forward; the mask application waits for it (GuidedDecoder._finish_build).
        # The host step's Python runs on this thread (the side stream runs idle launches
        # inline): a Python thread beside a CPU forward costs more in GIL hand-offs than that
        # Python (docs/BENCHMARKS.md, "loop"). A captured step builds synchronously: its
        # replays run the apply right after it.
        node = self._node
        rows = self._prepared_rows = num_rows or self.bitmask_host.shape[0]
        # (the build leaves a row its draft vocabulary cannot reach unmasked: _build)
        self._prepared_d2t = d2t
        reach = None if d2t is None else self._tensors.reach(d2t)
        if capturing:
            self._activate_node()
        with self._streams.side():
            self._streams.wait_tokens()
            if node is not None and self._node_active and (capturing or not self._warmup):
                # the C++ host node (a warm-up run outside capture takes the Python step)
                hostfunc.launch_native(node.run, node.launch(rows, -1, reach),
                                       retain=node.retain, release=node.release)
            else:  # fetch, init, build
                self.host_step(self._async_build and not capturing, rows, reach)
            self.copy_bitmask(rows)
            self._streams.record_bitmask()
        self._prepared = True

    def _activate_node(self) -> None:
        """From the first capture on, every step and rollback takes the native node (if any)."""
        node = self._node
        if node is not None and not self._node_active:
            self._node_active = True  # (the batches queued from now on queue jobs too)
            node.set_epoch(self._put_epoch)
            node.sync_counts(self.slots.num_advanced_tokens,  # (what the eager steps advanced)
                             self.slots.num_advanced_draft_tokens, self.slots.draft_trees,
                             self._rollback_due)

    @nvtx_range("CapturableGuidedDecoder.execute")
    @_open_only
    def execute(self, logits: torch.Tensor, d2t: torch.Tensor | None = None) -> None:  # type: ignore[override]
        """Mask ``logits`` in place for the batch of the latest ``add_batch``: graph-safe.

        Args:
            logits: ``[rows, W]`` (rows may exceed the layout's rows: padding rows are left
                untouched); full vocabulary or a tensor-parallel shard, as for GuidedDecoder.
            d2t: optional draft-to-target table (see GuidedDecoder.execute).

        Returns nothing; failures come from :meth:`take_failed_requests` after the step. When
        not capturing this drains (waits for the callbacks with the GIL released) and
        re-raises a callback exception as ``hostfunc.HostFuncError``.
        """
        self._execute(logits, d2t)

    @nvtx_range("CapturableGuidedDecoder.execute_argmax")
    @_open_only
    def execute_argmax(self, logits: torch.Tensor,  # type: ignore[override]  # as execute:
                       out: torch.Tensor | None = None) -> torch.Tensor:  # failures come later
        """Greedy sampling fused with the mask, for the batch of the latest ``add_batch``:
        the column of each row's largest allowed logit, the logits left as they are.
        Graph-safe, like :meth:`execute`.

        ``out[r]`` is ``argmax`` of logits row ``r`` after :meth:`execute` would have masked
        it (rows past the layout's rows, and unguided rows, unmasked), ties to the lowest
        column (:func:`capgraph.ops.masked_argmax`). On CUDA one kernel reads each row's
        bitmask and the logits of its allowed tokens only, where ``execute`` followed by
        ``argmax`` reads every logit twice and writes the masked ones; use it where the step
        samples greedily and nothing else reads the masked logits.

        Args:
            logits: ``[rows, vocab_size_padded]``, the full vocabulary (a tensor-parallel
                shard's argmax needs the other shards': mask with :meth:`execute` there).
            out: int64 ``[rows]`` on the logits' device, or None for a new tensor (inside a
                CUDA graph capture, one the graph keeps for its replays).

        Returns:
            ``out``. Failures come from :meth:`take_failed_requests` after the step, as for
            :meth:`execute`; a failed request's rows are unmasked, as ``execute`` leaves them.

        On CUDA the decoder's argmax launches share one small scratch that each leaves zero:
        run them one at a time, in one stream's order, as a decoder's steps run.

        Raises:
            TensorArgError: bad logits (as for :meth:`execute`), logits that are not the full
                vocabulary, or a bad ``out``; nothing is enqueued.
        """
        result = self._execute(logits, None, argmax=True, out=out)
        assert result is not None
        return result

    def _execute(self, logits: torch.Tensor, d2t: torch.Tensor | None, argmax: bool = False,
                 out: object = None) -> torch.Tensor | None:
        """execute's work; with ``argmax``, execute_argmax's (the argmax written to ``out``,
        returned, instead of the mask)."""
        capturing = self._streams.is_capturing()
        self._prepared_refused = self._prepared  # (until the logits pass: see add_batch)
        self._check_logits(logits, d2t, None)
        if self._prepared and d2t is not self._prepared_d2t:
            raise TensorArgError(
                f"execute: d2t is {'None' if d2t is None else 'a table'}, but the step was "
                f"prepared {'without one' if self._prepared_d2t is None else 'for another'}: "
                "its host work is enqueued for that table (pass the same d2t to prepare)")
        if not capturing and self.requests is not None and \
                logits.shape[0] < self.requests.num_bitmask_tokens:
            raise TensorArgError(
                f"logits have {logits.shape[0]} rows, fewer than the batch layout's "
                f"{self.requests.num_bitmask_tokens}")
        tokens = None
        if argmax:
            full_vocabulary(logits, self.vocab_size_padded, "execute_argmax")
            tokens = argmax_out(out, logits, "execute_argmax")
        self._prepared_refused = False
        if not capturing and not self.active and not self._prepared and self._stream_idle():
            # nothing guided and nothing queued that reads the token mask or the slots (an
            # earlier step the host ran ahead of): enqueue nothing at all, consume here
            last = self._consume_put()
            if last is not None:  # (its step had nothing to run: advance_batch continues it)
                self._ran_epoch = last.epoch
            self._clear_token_mask()
            if tokens is not None:  # (nothing is masked: the plain argmax)
                torch.argmax(logits, dim=-1, out=tokens)
            return tokens
        if not self._prepared:
            self._enqueue_step(logits.shape[0], capturing, d2t)
        self._prepared = False
        # (rows past those prepare copied hold another step's mask: left untouched)
        self._join_and_apply(logits, d2t, capturing, min(logits.shape[0], self._prepared_rows),
                             tokens)
        return tokens

    def _join_and_apply(self, logits: torch.Tensor, d2t: torch.Tensor | None,
                        capturing: bool, rows: int | None = None,
                        out: torch.Tensor | None = None) -> None:
        """Apply the step's mask to ``logits[:rows]`` once its bitmask copy is done (with
        ``out``: write the masked argmax there instead)."""
        rows = logits.shape[0] if rows is None else rows
        streams = self._streams
        if not capturing and self.device.type == "cpu":
            # CPU stand-in, not capturing: wait for the side stream on the host (GIL released)
            # and apply here, rather than hand the apply to another worker thread and drain it
            self._sync_side()
            self._apply_now(logits, d2t, rows, out)
            hostfunc.check_errors(owner=self)
            return
        streams.wait_bitmask()
        if self.device.type == "cuda":
            self._apply_now(logits, d2t, rows, out)
        elif out is None:  # recorded into the HostGraph, so every replay applies
            self.apply_hostfunc(logits, d2t, rows)
        else:
            self.argmax_hostfunc(logits, out, rows)
        streams.drain(self)

    def _apply_now(self, logits: torch.Tensor, d2t: torch.Tensor | None, rows: int,
                   out: torch.Tensor | None) -> None:
        """The mask of ``logits[:rows]`` in place, or with ``out`` the masked argmax there."""
        if out is None:
            self.apply_bitmask(logits, d2t, rows)
        else:
            self.argmax_bitmask(logits, out, rows)

    def _sync_side(self) -> None:
        self._streams.bitmask_event.synchronize()  # type: ignore[attr-defined]

    # -- speculative decoding ----------------------------------------------------------------
    @_open_only
    def add_draft_batch(self, new_tokens: torch.Tensor, num_accepted_tokens: torch.Tensor | None,
                        draft_step: int = 0) -> None:
        """Host side of a draft-model step: the tokens each request's matcher consumes now.

        Args:
            new_tokens: int ``[batch]`` in batch order: at step 0 the golden (bonus) token, then
                the token drafted at the previous step.
            num_accepted_tokens: int ``[batch]``, required at step 0 (later steps do not read
                it): tokens the last verification accepted per request, bonus included;
                min-clamped to the matcher's advances.
            draft_step: index of this step in the drafting loop.

        Both tensors are copied in the current stream's order. On CUDA a device tensor is read
        when the stream gets there (at each replay when captured); a CPU tensor is read at
        the call and cannot be captured.

        Raises:
            TensorArgError: a tensor that is not integer, has more entries than slots or fewer
                than the latest ``add_batch`` has requests; ``num_accepted_tokens`` None at
                ``draft_step`` 0 (these before any copy); a CPU tensor while a CUDA graph is
                being captured.
            DecoderClosedError: the decoder was closed; nothing is read or changed.
        """
        _check_draft_step(draft_step)
        tokens = self._per_request("new_tokens", new_tokens)
        counts = None
        if draft_step == 0:
            if num_accepted_tokens is None:
                raise TensorArgError(
                    "num_accepted_tokens is None at draft_step 0: the drafting loop's first "
                    "step rolls back by the last verification's counts (one per request, the "
                    "bonus token included), and without them it would read an earlier loop's")
            counts = self._per_request("num_accepted_tokens", num_accepted_tokens)
        self._copy_in_stream_order(self.draft_new_tokens[:tokens.shape[0]], tokens,
                                   "new_tokens")
        if counts is not None:
            self._copy_in_stream_order(self.num_accepted_tokens[:counts.shape[0]], counts,
                                       "num_accepted_tokens")
        self._streams.record_tokens()

    def _copy_in_stream_order(self, dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        """``dst.copy_(src)`` as a CUDA copy on the current stream is: after the work already
        on the stream, and while capturing, at each replay (reading ``src`` then). On CUDA
        that copy (:meth:`_cuda_copy` for a CPU ``src``); on the CPU stand-in at once where
        the current HostStream is idle, a task on it where it has work queued, and while
        capturing a copy the HostGraph replays (:meth:`_capture_copy`)."""
        self._join_prepared()
        if self.device.type == "cuda":
            self._cuda_copy(dst, self._int32_source(src, dst), name)
            return
        scratch = self._int32_scratch_for(src, dst)  # (an int64 src: clamped by the copy)
        graph = hostfunc.current_stream().capture_graph
        if graph is not None:
            self._capture_copy(graph, dst, src, scratch)
            return

        def copy() -> None:
            dst.copy_(src if scratch is None else _clamped(src, *scratch))
        self._in_stream_order(copy)

    @_open_only
    def release(self, seq_slot: int) -> None:
        """Forget the matcher and counters of a slot whose request has finished, after the
        steps already queued on the current stream.

        Admission sees the slot free at once (the next ``add_batch`` may place a new request
        there); the matcher goes in stream order: at once where the stream is idle, else as a
        host call after the steps queued before it, which still mask the finished request's
        rows (an engine running ahead releases a request whose last step is in flight; a
        step :meth:`prepare` enqueued counts as queued, its ``execute`` still to come). With
        no step in flight, a guided request on the slot in a batch still queued fails with a
        :class:`~capgraph.errors.RequestError` when that batch's step runs (its rows take no
        mask; a batch discarded fails nothing).

        Raises:
            RequestError: ``seq_slot`` is outside ``[0, max_num_sequences)``.
            DecoderClosedError: the decoder was closed; nothing is read or changed.
        """
        slot = self._release_slot(seq_slot)
        self._events += 1  # (the latest batch cannot simply continue: advance_batch)
        self._join_prepared()  # (a step prepare() queued comes before the release)
        if self._streams.is_capturing() or self._stream_idle():
            self._fail_queued_on(slot)
            self._release_now(slot)
            return

        def release_in_order() -> None:
            self._node_collect()  # (the node's steps before this one are read first)
            self._release_now(slot)
        hostfunc.launch(release_in_order)

    def _fail_queued_on(self, slot: int) -> None:
        """With no step in flight, each guided request on ``slot`` of a batch still queued
        (its step not launched yet, so it would find the slot released) replaced by an
        unguided stand-in with its rows, failing by name when that step runs (as the eager
        decoder's release fails an unbuilt one); a matcher it would install is not installed
        by Python."""
        self._node_collect()  # (the puts of steps that ran leave the queue first)
        with self._collect_lock:
            for put in self._queue:
                failed = _stand_ins_on(put.batch.requests, slot, f" (epoch {put.epoch})")
                # (a matcher whose creation failed was reported at add_batch already)
                if not any(s == slot and m is None for s, m in put.installs):
                    put.released.extend(failed)
                put.installs = [(s, m) for s, m in put.installs if s != slot]
            if self._node_active and self._node is not None:
                self._node.forget_slot(slot)  # (the node's queued jobs hold the same)

    def _stream_idle(self) -> bool:
        """Whether the current stream (torch's on CUDA, hostfunc's on the CPU stand-in) has
        finished all the work queued on it: host-side changes are then in its order."""
        if self.device.type == "cuda":
            return bool(torch.cuda.current_stream(self.device).query())
        return hostfunc.current_stream().query()

    def _cuda_copy(self, dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
        """Copy ``src`` into the pinned ``dst`` in the current CUDA stream's order.

        A device ``src`` is a copy on the stream (captured: replayed, reading ``src`` then). A
        CPU ``src`` is host memory, which a CUDA copy into host memory never reads in stream
        order (torch copies host to host at once) and a capture never records: outside a
        capture it is copied at once where the stream is idle, else staged on the device so
        that it lands after the work already queued (read at the call, unless it is pinned);
        while capturing it is refused, since every replay would see the capture's values.

        Raises:
            TensorArgError: ``src`` is a CPU tensor and a CUDA graph is being captured.
        """
        if src.device.type != "cpu":
            dst.copy_(src, non_blocking=True)
        elif self._streams.is_capturing():
            raise TensorArgError(
                f"{name} is a CPU tensor while a CUDA graph is being captured: a copy from host "
                f"memory is not part of a graph, so every replay would use the values it had at "
                f"capture; pass a tensor on {self.device} that the graph's kernels write")
        elif self._stream_idle():
            dst.copy_(src)  # nothing queued: now is the stream's order
        else:
            dst.copy_(src.to(self.device, non_blocking=True), non_blocking=True)

    @staticmethod
    def _capture_copy(graph: hostfunc.HostGraph, dst: torch.Tensor, src: torch.Tensor,
                      scratch: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> None:
        """Record ``dst.copy_(src)`` into a HostGraph: a native copy (no GIL in the replay)
        where both are contiguous CPU tensors of one dtype and size and hostfunc's native
        functions build here (the graph holds the tensors and the arguments), else a Python
        task (which clamps an int64 ``src`` into ``scratch`` first: :func:`_clamped`)."""
        try:
            fn = hostfunc.native.copy_function()
        except hostfunc.HostFuncUsageError:
            fn = 0
        if fn and src.device.type == "cpu" and src.dtype == dst.dtype \
                and src.numel() == dst.numel() and src.is_contiguous() and dst.is_contiguous():
            args = np.array([dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()],
                            dtype=np.uint64)
            graph.keep_alive((args, dst, src))
            graph.add_native(hostfunc.native.NativeCall(fn, args.ctypes.data))
            return

        def copy() -> None:
            dst.copy_((src if scratch is None else _clamped(src, *scratch)).reshape(dst.shape))

        def step(replay: hostfunc.HostStream) -> None:
            replay.enqueue(copy)
        graph.add_step(step)

    def _per_request(self, name: str, values: torch.Tensor) -> torch.Tensor:
        """A ``[batch]`` integer tensor, flattened: at least one entry per request of the
        latest ``add_batch`` (the callbacks read one per request, and an entry not given would
        be an earlier call's value left in the buffer) and at most ``max_num_sequences``."""
        if not isinstance(values, torch.Tensor) or values.dtype not in _INDEX_DTYPES:
            raise TensorArgError(f"{name} must be an integer tensor (int8 to int64, uint8, "
                                 f"uint16), got {getattr(values, 'dtype', type(values))}")
        flat = values.reshape(-1)
        if flat.shape[0] > self.max_num_sequences:
            raise TensorArgError(f"{name} has {flat.shape[0]} entries, more than "
                                 f"max_num_sequences={self.max_num_sequences}")
        if flat.shape[0] < self._batch_len:
            raise TensorArgError(
                f"{name} has {flat.shape[0]} entries for the {self._batch_len} requests of the "
                "latest add_batch: the step reads one per request, and the entries not given "
                "would hold an earlier call's values")
        return flat

    @nvtx_range("CapturableGuidedDecoder.execute_draft_batch")
    @_open_only
    def execute_draft_batch(self, logits: torch.Tensor, d2t: torch.Tensor | None = None,
                            draft_step: int = 0) -> None:
        """Mask a draft-model step's logits (one row per request); graph-safe.

        At ``draft_step`` 0 the batch of the latest ``add_batch`` is fetched and the tokens the
        target rejected are rolled back; at the last step of that batch's runtime draft length
        every draft advance is rolled back, and a step past it masks and advances nothing. The
        batch decides when each step runs, so one captured loop serves batches of any runtime
        draft length up to its own number of steps; a loop replayed short of its batch's last
        step is ended (rolled back) by the next step that takes a batch. A request whose row
        lies past the step's logits rows (a graph captured for fewer requests) fails. With the
        native host node active, each step is the node's C function (a loop it cannot run is
        Python's from its first step to its last).
        """
        _check_draft_step(draft_step)
        requests = self._require_batch()
        self._check_logits(logits, d2t, None, len(requests))  # (one row per request)
        reach = None if d2t is None else self._tensors.reach(d2t)
        if draft_step == 0 and self._streams.is_capturing():
            self._consume_put()
        capturing = self._streams.is_capturing()
        if capturing:
            self._activate_node()
        node, rows = self._node, logits.shape[0]
        with self._streams.side():
            self._streams.wait_tokens()
            if node is not None and self._node_active and (capturing or not self._warmup):
                hostfunc.launch_native(node.run_draft, node.launch(rows, draft_step, reach),
                                       retain=node.retain, release=node.release)
            else:
                self.draft_host_step(draft_step, rows, reach)
            self.copy_bitmask(rows)
            self._streams.record_bitmask()
        self._join_and_apply(logits, d2t, self._streams.is_capturing())

    @_open_only
    def rollback_rejected_batch(self, num_accepted_tokens: torch.Tensor,
                                accepted_draft_nodes: torch.Tensor | None = None) -> None:
        """Roll back the rejected drafts for drafters without a logits loop (graph-safe).

        Args:
            num_accepted_tokens: int ``[batch]`` indexed by position in the latest
                ``add_batch``: accepted tokens per request including the bonus token.
            accepted_draft_nodes: optional int ``[batch]``, same positions: for a request
                whose drafts were a tree, its deepest accepted node (-1: none); it replaces the
                request's ``accepted_draft_node`` (entries of chain requests are not read).
                Whether it is given is fixed in a captured graph; its values are read at
                each replay.

        Both tensors are copied in the current stream's order. On CUDA a device tensor is read
        when the stream gets there (at each replay when captured); a CPU tensor is read at
        the call, and inside a CUDA graph capture it is refused (``TensorArgError``: every
        replay would roll back by the capture's counts).

        With the native host node (once a step has been captured with it) and without
        ``accepted_draft_nodes``, the rollback is the node's C function, which takes no GIL
        where the last step was native; otherwise a Python callback, which needs the GIL:
        call it then after the drafting kernels have been enqueued.

        Raises:
            TensorArgError: a tensor that is not integer, has more entries than slots or fewer
                than the latest ``add_batch`` has requests (these before any copy); a CPU
                tensor while a CUDA graph is being captured.
            DecoderClosedError: the decoder was closed; nothing is read or changed.
        """
        counts = self._per_request("num_accepted_tokens", num_accepted_tokens)
        with_nodes = accepted_draft_nodes is not None
        nodes = None if accepted_draft_nodes is None else \
            self._per_request("accepted_draft_nodes", accepted_draft_nodes)
        self._copy_in_stream_order(self.num_accepted_tokens[:counts.shape[0]], counts,
                                   "num_accepted_tokens")
        if nodes is not None:
            self._copy_in_stream_order(self.accepted_draft_nodes[:nodes.shape[0]], nodes,
                                       "accepted_draft_nodes")
        self._streams.record_tokens()
        node = self._node
        if self._streams.is_capturing():
            self._activate_node()
        with self._streams.side():
            self._streams.wait_tokens()
            if node is not None and self._node_active and not with_nodes:
                hostfunc.launch_native(node.run_rollback, node.launch(0), retain=node.retain,
                                       release=node.release)
            else:
                self.accepted_host_step(with_nodes)
            self._streams.record_bitmask()  # capture needs every fork joined
        if self.device.type == "cpu" and not self._streams.is_capturing():
            self._sync_side()
            hostfunc.check_errors(owner=self)
            return
        self._streams.wait_bitmask()
        self._streams.drain(self)

    # -- callbacks (run on the side stream) --------------------------------------------------
    # Each stage below is a host callback of its own; a step enqueues them fused (one hand-off
    # per step instead of one per stage), each stage keeping its own error handling.
    def _stages(self, *stages: tuple) -> None:
        first: Exception | None = None
        if self._node_active:  # (the node's steps and rollbacks so far left these due)
            self._rollback_due = set(self._node.due())  # type: ignore[union-attr]
        for stage, *args in stages:
            try:
                stage.__wrapped__(self, *args)
            except Exception as e:  # later stages still run (a failed fetch masks nothing)
                first = first or e
        if self._node_active:  # the counters these stages wrote are the node's from now on
            self._node_collect()
            self._node.sync_counts(  # type: ignore[union-attr]
                self.slots.num_advanced_tokens, self.slots.num_advanced_draft_tokens,
                self.slots.draft_trees, self._rollback_due)
        if first is not None:
            raise first

    @hostfunc.hostfunc
    def host_step(self, asynchronous: bool = False, rows: int | None = None,
                  reach: np.ndarray | None = None) -> None:
        """fetch_batch, init_disagg_gen_requests, build (``asynchronous``: see ``_build``;
        ``rows``: the logits rows the step masks, default all; ``reach``: the step's pruned
        draft vocabulary, :meth:`LogitsChecks.reach
        <capgraph.tensor_checks.LogitsChecks.reach>`, or None)."""
        cls = CapturableGuidedDecoder
        self._stages((cls.fetch_batch, rows), (cls.init_disagg_gen_requests_hostfunc,),
                     (cls.build_hostfunc, asynchronous, reach))

    @hostfunc.hostfunc
    def draft_host_step(self, draft_step: int, rows: int | None = None,
                        reach: np.ndarray | None = None) -> None:
        """fetch_draft_batch, [rollback_rejected_tokens at step 0], build_draft (its requests
        past ``rows`` failed first, once the rollback has set the matchers as the build reads
        them; ``reach`` as for :meth:`host_step`), rollback_draft_tokens (at the loop's last
        step)."""
        cls = CapturableGuidedDecoder
        self._stages((cls.fetch_draft_batch, draft_step),
                     *([(cls.rollback_rejected_tokens_hostfunc,)] if draft_step == 0 else []),
                     (cls.build_draft_hostfunc, rows, reach),
                     (cls.rollback_draft_tokens_hostfunc, draft_step))

    @hostfunc.hostfunc
    def accepted_host_step(self, with_nodes: bool = False) -> None:
        """fetch_accepted_batch, rollback_rejected_tokens (a warm-up run rolls nothing back,
        as it advances nothing)."""
        if self._warmup:
            return
        cls = CapturableGuidedDecoder
        self._stages((cls.fetch_accepted_batch, with_nodes),
                     (cls.rollback_rejected_tokens_hostfunc,))

    def _pop(self) -> None:
        """Take this step's batch off the queue (:meth:`_take_put`)."""
        if self._warmup:  # a warm-up run masks nothing, advances nothing, consumes no put
            self.requests_hostfunc = None
            return
        self._node_collect()  # (the batches the native node has run leave the queue first)
        with self._collect_lock:  # (advance_batch reads the queue and _ran_epoch together)
            taken, error = self._take_put()
            self._popped = True
            if error is None:
                self._ran_epoch = taken[-1].epoch
                self._record_failed(taken[-1].released)
            else:
                self._events += 1  # (a step that masks nothing: no batch of it continues)
        if self._node_active and not self._in_node:
            for _ in taken:  # (Python takes them: their jobs go)
                self._node.drop()  # type: ignore[union-attr]
        for put in taken:
            self.requests_hostfunc = put.batch  # from here on, a fault names these ids
            if put.batch.dropped_slots:
                self._drop_slots(put.batch)
        if error is not None:
            self.requests_hostfunc = None
            self._clear_token_mask()
            raise QueueEpochError(error)
        put = taken[-1]
        if put.tokens is not None:  # (an advance_batch step: the requests are shared)
            for req, token in zip(put.batch.requests, put.tokens):
                if req.guided_decoding_params is not None:
                    req.new_token = token
        if put.has_new_tokens:
            tokens = self._new_tokens_np
            for req in put.batch.requests:
                if req.prev_seq_slot is None or req.is_context_init_state \
                        or req.seq_slot is None \
                        or not 0 <= req.seq_slot < self.max_num_sequences:
                    continue  # (a context request takes one row: it reads no drafts)
                column = tokens[:, req.seq_slot].tolist()
                req.new_token, req.draft_tokens = column[0], column[1:]

    def _take_put(self) -> tuple[list[_Put], str | None]:
        """Take this step's put off the queue: ``(the puts taken, this step's last; a queue
        error or None)``. The step ticket names the step's own put: puts before it had no
        step of their own (taken with it, an error: the step masks nothing); a ticket older
        than every queued put is a step without its ``add_batch`` (nothing taken, an error);
        later puts stay queued for their steps. A put made while capturing (no ticket) must
        be the only one queued, the epoch after the last fetched (else all are dropped). The
        native node's ``TakeJob`` applies the same rules to its jobs."""
        queue, expected = self._queue, self._fetched_epoch + 1
        if not queue:
            return [], (f"no batch queued for this step (expected epoch {expected}): a replay "
                        "or execute without its add_batch")
        front = queue[0]
        if not front.ticketed:
            taken = [queue.popleft()]
            self._fetched_epoch = front.epoch
            if front.epoch == expected and not queue:
                return taken, None
            extra = [p.epoch for p in queue]
            taken.extend(queue)
            queue.clear()
            self._fetched_epoch = self._put_epoch
            return taken, (f"fetched epoch {front.epoch}, expected {expected}; still queued: "
                           f"{extra} (an add_batch without its execute)")
        own = front.epoch + ticket_distance(int(self._ticket_np[0]), front.epoch)
        if own < front.epoch:
            return [], (f"this step's batch (epoch {own}) was consumed already; still queued: "
                        f"{[p.epoch for p in queue]} (a replay or execute without its "
                        "add_batch)")
        taken = []
        while queue and queue[0].epoch <= own:
            taken.append(queue.popleft())
        self._fetched_epoch = own
        skipped = [p.epoch for p in taken if p.epoch < own]
        if skipped or taken[-1].epoch != own:
            return taken, (f"fetched epoch {taken[-1].epoch}, expected {own} (this step's "
                           f"add_batch); the batches of epochs {skipped} had no step of their "
                           "own (an add_batch without its execute)")
        return taken, None

    def _consume_put(self, newest: bool = True) -> _Put | None:
        """Host side: a put no callback fetches (a capture's, an inactive step's: the newest;
        a discarded one: the oldest) leaves the queue, its dropped slots dropped; returns it
        (None: none was queued). The node's unread records go first (their puts leave the
        queue with them)."""
        self._node_collect()
        if not self._queue:
            return None
        put = self._queue.pop() if newest else self._queue.popleft()
        if not self._queue:
            self._fetched_epoch = put.epoch
        if self._node_active:
            self._node.drop(newest)  # type: ignore[union-attr]
        if put.batch.dropped_slots:
            self._drop_slots(put.batch)
        return put

    @_callback("fetch_batch")
    def fetch_batch(self, rows: int | None = None) -> None:
        self._popped = False
        try:
            self._pop()
            batch = self.requests_hostfunc
            if batch is not None:
                self._end_open_draft(batch)  # (first: the check below reads the matchers)
            self._fail_past_rows(batch, rows)
        except QueueEpochError:
            raise
        except Exception as e:
            # A fault before the pop would leave this step's batch queued (the next step then
            # out of step) and blame the previous batch: take it off the queue and name it.
            batch = self.requests_hostfunc
            self._events += 1  # (the step masks nothing: no batch of it continues)
            if not self._popped and self._queue:
                taken, _ = self._take_put()
                if self._node_active and not self._in_node:
                    for _ in taken:
                        self._node.drop()  # type: ignore[union-attr]
                batch = taken[-1].batch if taken else None
            ids = [_request_id(r) for r in batch.valid_requests()] if batch is not None else []
            self._record_failed([(i, f"fetch_batch: {type(e).__name__}: {e}") for i in ids])
            self.requests_hostfunc = None  # the step masks nothing
            self._clear_token_mask()
            raise CallbackError(f"{type(e).__name__}: {e}", callback="fetch_batch",
                                request_ids=ids) from e

    @_callback("fetch_draft_batch")
    def fetch_draft_batch(self, draft_step: int) -> None:
        if draft_step == 0:
            self._pop()
            self._take_accepted(self.requests_hostfunc)
            batch = self.requests_hostfunc
            self._draft_last = 0 if batch is None else max(batch.max_num_draft_tokens, 1) - 1
        target = self.requests_hostfunc
        if target is None or draft_step > self._draft_last:  # (past the loop's last step)
            self._draft_requests = None
            return
        tokens = self.draft_new_tokens.tolist()
        drafts = [GuidedRequest(r.guided_decoding_params, r.request_id, r.seq_slot, r.prev_seq_slot,
                                r.is_context_init_state, r.is_last_context_chunk,
                                r.is_generation_in_progress_state, False, tokens[i], True)
                  for i, r in enumerate(target.requests)]
        self._draft_requests = GuidedRequests(drafts, 0)

    def _fail_past_rows(self, batch: GuidedRequests | None, rows: int | None) -> None:
        """Fail the guided requests of ``batch`` whose bitmask rows lie past the ``rows``
        logits rows their step masks (a graph captured for a smaller batch replayed for a
        larger one): an unguided stand-in takes their rows and their matchers are dropped,
        since the tokens sampled for them would be unmasked. As the native node does, a
        request with nothing to guide this step (an earlier prompt chunk; no matcher, or one
        that has terminated or stopped drafting) is left alone, and so is a second request on
        a slot (the build refuses it without touching the slot's matcher, which is the first
        one's); a second request on the slot of a first one failed here fails too, as the
        build would fail it ("appears twice"), since its stand-in no longer holds the slot."""
        if batch is None or rows is None or batch.num_bitmask_tokens <= rows:
            return
        failed = []
        seen: set[int | None] = set()
        gone: set[int | None] = set()  # the slots of the requests failed here
        reqs = batch.requests
        for i, (req, offset) in enumerate(zip(reqs, batch.offsets)):
            if req.guided_decoding_params is None:
                continue
            slot = req.seq_slot
            duplicate = slot in seen
            seen.add(slot)
            end = offset + req.num_rows(batch.max_num_draft_tokens)
            if duplicate and slot in gone:
                failed.append(self._fail(req, RequestError(
                    f"seq_slot {slot} appears twice in one batch", request_id=req.request_id,
                    seq_slot=slot), drop=False))
            elif end <= rows or duplicate or not self._guides_now(req):
                continue
            else:
                failed.append(self._fail_message(req, _past_rows(offset, end, rows)))
                gone.add(slot)
            reqs[i] = GuidedRequest.stand_in(req.request_id, req.is_context_init_state,
                                             req.is_draft)
        self._record_failed(failed)

    def _guides_now(self, req: GuidedRequest) -> bool:
        """Whether the build guides ``req`` this step: it creates its slot's matcher, or the
        slot's matcher runs (there, not terminated, its drafting not stopped)."""
        if not req.is_draft and (req.is_context_init_state
                                 or req.is_generation_only_first_iteration):
            return bool(req.is_generation_only_first_iteration or req.is_last_context_chunk)
        slot = req.seq_slot
        if not self.slots.slot_ok(slot):
            return False
        matcher = self.grammar_matchers[slot]  # type: ignore[index]
        return matcher is not None and not matcher.is_terminated() \
            and not self.is_draft_terminated[slot]  # type: ignore[index]

    @_callback("fetch_accepted_batch")
    def fetch_accepted_batch(self, with_nodes: bool = False) -> None:
        self._node_collect()  # (the native node's steps run so far leave the queue first)
        # the batch whose verification counts these are: queued (not yet fetched) or current
        batch = self._queue[0].batch if self._queue else self.requests_hostfunc
        self._take_accepted(batch, with_nodes, own_nodes=bool(self._queue))
        self._rollback_batch = batch

    def _take_accepted(self, batch: GuidedRequests | None, with_nodes: bool = False,
                       own_nodes: bool = True) -> None:
        """The counts (and nodes) of ``rollback_rejected_batch`` onto ``batch``'s requests.
        Without nodes a tree's accepted node is the request's own ``accepted_draft_node``
        where ``own_nodes`` (the next step's batch, which names it, as for the eager
        decoder), else none (the verified step's own batch: its requests name the node of
        the verification before it)."""
        self._finish_build()  # (the counters read below)
        if batch is None:
            return
        counts = self.num_accepted_tokens.tolist()
        nodes = self.accepted_draft_nodes.tolist() if with_nodes else None
        current_tree = self.slots.current_tree
        for i, req in enumerate(batch.requests):
            if req.guided_decoding_params is None or not self.slots.slot_ok(req.seq_slot):
                continue
            if current_tree(req.seq_slot) is not None:  # type: ignore[arg-type]
                # a tree's matcher is back at its root: the accepted node decides, and a
                # count with no node is refused by the rollback, never clamped to the root
                req.num_accepted_draft_tokens = counts[i] - 1
                if nodes is not None:
                    req.accepted_draft_node = nodes[i]
                elif not own_nodes:
                    req.accepted_draft_node = None
                continue
            # counts are clamped to the matcher's advances, as the native node's rollback
            # clamps them (verification can accept past a draft EOS where it stopped)
            req.num_accepted_draft_tokens = \
                min(counts[i], self.slots.num_advanced_tokens[req.seq_slot]) - 1  # type: ignore[index]

    @_callback("init_disagg_gen_requests")
    def init_disagg_gen_requests_hostfunc(self) -> None:
        if self.requests_hostfunc is not None:
            self._init_disagg_gen_requests(self.requests_hostfunc)

    @_callback("build")
    def build_hostfunc(self, asynchronous: bool = False, reach: np.ndarray | None = None
                       ) -> None:
        # (the step's own table, set in stream order once the build before it has ended)
        self._await_build()
        self._draft_reach = reach
        self._build_and_record(self.requests_hostfunc, asynchronous)

    @_callback("build_draft")
    def build_draft_hostfunc(self, rows: int | None = None, reach: np.ndarray | None = None
                             ) -> None:
        self._await_build()
        self._draft_reach = reach
        try:
            self._fail_past_rows(self._draft_requests, rows)
        except BaseException:
            self._build_and_record(None)  # (masks nothing)
            raise
        self._build_and_record(self._draft_requests)

    def _build_and_record(self, batch: GuidedRequests | None, asynchronous: bool = False
                          ) -> None:
        if batch is None:
            self._finish_build()  # (before the token mask is cleared under it)
            self._clear_token_mask()
            return
        # every row is cleared, not only the layout's: rows beyond this batch (graph padding)
        # stay unmasked
        try:
            self._record_failed(self._build(batch, asynchronous, self.token_mask_host.shape[0]))
        except BaseException:
            self._clear_token_mask()  # a build that raised masks nothing this step
            raise

    @_callback("rollback_rejected_tokens")
    def rollback_rejected_tokens_hostfunc(self) -> None:
        batch = self._rollback_batch or self.requests_hostfunc
        self._rollback_batch = None
        if batch is not None:
            self._rollback_rejected_tokens(batch)

    @_callback("rollback_draft_tokens")
    def rollback_draft_tokens_hostfunc(self, draft_step: int) -> None:
        """At the loop's last step (:attr:`_draft_last`), roll every draft advance back (a
        loop replayed short of it is ended by the next build or rollback of rejected tokens:
        ``GuidedDecoder._open_draft``)."""
        if draft_step == self._draft_last and self.requests_hostfunc is not None:
            self._rollback_draft_tokens(self.requests_hostfunc)

    @_callback("apply")
    def apply_hostfunc(self, logits: torch.Tensor, d2t: torch.Tensor | None, rows: int) -> None:
        self.apply_bitmask(logits, d2t, rows)

    @_callback("argmax")
    def argmax_hostfunc(self, logits: torch.Tensor, out: torch.Tensor, rows: int) -> None:
        self.argmax_bitmask(logits, out, rows)

    def _close(self) -> None:
        """close()'s work (see :meth:`GuidedDecoder.close`): the side stream first (its queued
        work runs, then its worker ends): a host step still queued on it may start a build,
        which the base close then ends before it stops the C++ build's thread."""
        if self._node is not None:
            self._node_finalizer()  # (a step waiting for its batch goes now; runs once)
        close = getattr(self._streams, "close", None)
        if close is not None:
            close()
        super()._close()
        if self._node is not None:
            hostfunc.remove_drain_hook(self._node_hook)

    # -- the native host node ----------------------------------------------------------------
    def _make_host_node(self, choice: object) -> str:
        """``"native"`` with :attr:`_node` made, or ``"python"`` (see the class docstring).

        Raises:
            ConfigError: ``choice`` is not one of :data:`HOST_NODES`, or ``"native"`` where
                the native node cannot run (the reason is named).
        """
        if choice not in HOST_NODES:
            raise ConfigError(f"host_node={choice!r} is not one of {HOST_NODES}")
        if choice == "python":
            return "python"
        reason = self._host_node_unavailable()
        if reason is None:
            try:
                self._node = node = HostNode(
                    self.host_build.entry, self.new_tokens,  # type: ignore[attr-defined]
                    _python_step(self), self.num_accepted_tokens,
                    self.host_build.rollback, _python_rollback(self),  # type: ignore[attr-defined]
                    self.draft_new_tokens, _python_draft(self), self._ticket, TICKET_RING)
            except NativeBuildError as e:
                reason = str(e)
        if reason is not None:
            if choice == "native":
                raise ConfigError(f"host_node='native' is not available: {reason}")
            return "python"
        slots = self.slots
        self._mirror = mirror = _Mirror(node, slots, _weak_collect(self, False))
        slots.matchers.on_change = slots.is_draft_terminated.on_change = mirror
        for slot in range(self.max_num_sequences):
            mirror(slot)
        self._node_hook = _weak_collect(self, True)
        hostfunc.add_drain_hook(self._node_hook)
        # a decoder dropped without close(): a replayed step waiting for its batch after the
        # launch goes at once (it masks nothing), as close() lets it, not at its timeout
        self._node_finalizer = weakref.finalize(self, node.set_batch_wait, 0)
        self._node_finalizer.atexit = False
        return "native"

    def _host_node_unavailable(self) -> str | None:
        """Why the native host node cannot serve this decoder, or None."""
        entry = getattr(self.host_build, "entry", None)
        if entry is None:
            return (f"the host build is {self.host_build.name!r}; the native node runs the "
                    "'native' one (the xgrammar or auto backend, fill_threads=1)")
        if getattr(self.host_build, "rollback", None) is None:
            return "this xgrammar's matcher has no FFI rollback method"
        if self.device.type == "cpu":  # the CPU stand-in runs native calls on a C thread
            from hostfunc.lane import lane_library
            try:
                lane_library()
            except hostfunc.HostFuncUsageError as e:
                return str(e)
        return None

    @property
    def num_advanced_tokens(self) -> list[int]:
        """Per slot, the tokens its matcher accepted in the slot's last build (what a
        rollback of rejected drafts can undo); the native node's steps read first."""
        self._node_collect()
        return self.slots.num_advanced_tokens

    @property
    def num_guided_tokens(self) -> list[int]:
        """Per slot, the logits rows its last build masked; the native node's steps read
        first."""
        self._node_collect()
        return self.slots.num_guided_tokens

    @property
    def num_advanced_draft_tokens(self) -> list[int]:
        """Per slot, the draft tokens its matcher accepted over the current drafting loop
        (rolled back when the loop ends); the native node's steps read first."""
        self._node_collect()
        return self.slots.num_advanced_draft_tokens

    @property
    def host_node_stats(self) -> NodeStats | None:
        """The native host node's counters and latest timestamps (None: the Python host
        callback serves this decoder)."""
        return None if self._node is None else self._node.stats()

    def _node_push(self, put: _Put) -> None:
        """Queue the step of ``put`` on the native node, and create here, on the host, the
        matchers its new (context) and disaggregated requests need, so that the node runs
        them too; the node installs them in their slots when the step runs (a step still
        queued before it runs the slots' previous matchers), and Python when it reads that
        step. A batch the node declines, or one with a matcher only Python can run, is a
        Python step (whose build creates the matchers itself)."""
        node = self._node
        assert node is not None
        batch = put.batch
        requests = batch.requests
        inits = None if batch.dropped_slots else node.push(
            requests, batch.offsets, batch.max_num_draft_tokens, self.token_mask_host.shape[0],
            put.epoch, put.has_new_tokens, put.ticketed)
        if inits is None:
            node.push_python(put.epoch, put.ticketed, batch.dropped_slots)
            return
        # (the node checked every slot: an int in range, once in the batch)
        context, disaggregated = inits
        if not (context or disaggregated):
            return
        created: list[tuple[int, Any]] = []
        failed: list[tuple[GuidedRequest, Exception]] = []
        handles: list | None = None
        try:
            for i in context + disaggregated:
                req = requests[i]
                matcher = None
                try:
                    matcher = self._create_matcher(req)
                except Exception as e:
                    failed.append((req, e))
                created.append((req.seq_slot, matcher))  # type: ignore[arg-type]
            handle_of = self.slots.matchers.handle_of
            handles = [handle_of(m) for _, m in created]
            if any(h is not None and type(h) is not int for h in handles):
                handles = None  # (the Python step's build creates and reports them itself)
        finally:
            node.commit(handles)
        if handles is not None:
            put.installs = created
            # the failure is reported now; the slot is cleared when the step runs
            self._record_failed([self._fail(req, e, drop=False) for req, e in failed])

    def _node_collect(self, unusual_only: bool = False) -> None:
        """Read what the native node's steps did since the last read, in order: counters,
        the tokens it read from the token buffer, failures (interpreted as any build's), and
        queue errors (kept for the next drain, as a Python step's).

        ``unusual_only`` (a step's failures taken, a drain): leave the records unread where
        every one is a plain step (:meth:`_plain_records`): reading them would change only
        the counters, which the count properties read first, and which batch ran, which
        every step method reads first. So the read of a steady step's record costs the
        loop nothing after its sync; the next ``advance_batch`` does it once its own step is
        queued."""
        node = self._node
        if node is None or not self._node_active:
            return
        with self._collect_lock:
            if unusual_only and self._plain_records(node) is not None:
                return
            self._apply_node_results(node.take(self.slots.num_advanced_tokens,
                                               self.slots.num_guided_tokens,
                                               self.slots.num_advanced_draft_tokens))

    def _plain_records(self, node: HostNode) -> tuple[int, int] | None:
        """``(records, newest epoch)`` of the node's unread records where every one is a
        plain step (:meth:`HostNode.pending`) of a put that installs no matcher and fails no
        released request; ``(0, -1)`` where there are none; None where one is not plain."""
        records, latest, plain = node.pending()
        if not plain:
            return None
        for put in self._queue:
            if put.epoch > latest:
                break
            if put.installs or put.released:  # (reading its record sets the slots'
                return None  # matchers here, or fails the requests of released slots)
        return records, latest

    def _apply_node_results(self, results: list[tuple]) -> None:
        """:meth:`_node_collect`'s work on the results of :meth:`HostNode.take`, in step order.
        The node made the slot changes they imply itself (a new request's matcher installed,
        a failed request's dropped), so they do not go back to it (:meth:`_Mirror.quiet_on`)."""
        if not results:  # (every read between two steps: nothing to apply)
            return
        mirror = self._mirror
        assert mirror is not None
        before = mirror.quiet_on(threading.get_ident())
        try:
            for record in results:
                self._apply_node_record(*record)
        finally:
            mirror.quiet_on(before)

    def _apply_node_record(self, kind: int, epoch: int, error: str | None, masked: bool,
                           unusual: list | None, columns: list | None, rolled: list | None,
                           stale: Sequence[int]) -> None:
        """One record of :meth:`HostNode.take` (see there)."""
        if kind == _ROLLBACK:
            self._apply_node_rollback(epoch, unusual, rolled, stale)  # type: ignore[arg-type]
            return
        if kind == _DRAFT_BUILD:
            self._apply_node_draft_build(epoch, masked, unusual, stale)
            return
        if kind == _DRAFT_END:
            self._apply_node_draft_end(epoch, unusual, rolled, stale)  # type: ignore[arg-type]
            return
        queue = self._queue
        if error is not None:  # the node took the puts through `epoch` (none where it was not)
            while queue and queue[0].epoch <= epoch:
                put = queue.popleft()
                if put.batch.dropped_slots:  # (the node cleared them itself, as a fetch does)
                    self._drop_slots(put.batch)
            self.requests_hostfunc = None
            self._fetched_epoch = max(self._fetched_epoch, epoch)
            hostfunc.record_error("CapturableGuidedDecoder.host_node", QueueEpochError(error),
                                  owner=self)
            return
        if not queue or queue[0].epoch != epoch:
            hostfunc.record_error("CapturableGuidedDecoder.host_node", QueueEpochError(
                f"the host node ran epoch {epoch}, which is not the oldest batch queued "
                f"({[p.epoch for p in queue]})"), owner=self)
            return
        put = queue.popleft()
        batch = put.batch
        self._fetched_epoch = self._ran_epoch = epoch
        self._record_failed(put.released)
        self.requests_hostfunc = batch
        if kind == _DRAFT_START:  # (a drafting loop took the batch: its builds follow, and a
            self._open_draft = batch  # later build or rollback ends it if its end never runs)
            return
        matchers = self.grammar_matchers
        for slot, matcher in put.installs:  # (installed by the node before the step ran)
            matchers[slot] = matcher
        for slot in rolled or ():  # (its settling of a rollback left out: a matcher that had
            m = matchers[slot]  # terminated and rolled back re-reads its state)
            if m is not None and m.is_terminated():
                m.sync_state()  # type: ignore[attr-defined]  # (a native slot's matcher)
        self.slots.forget_trees(batch.requests)  # (the node built these slots: see _build)
        self._masked_rows = masked
        if columns is not None:  # (the unusual requests' tokens, read from the buffer: the
            # others' stay as queued, and a Python step of a later put refreshes them)
            reqs = batch.requests
            for index, values in columns:
                reqs[index].new_token, reqs[index].draft_tokens = values[0], values[1:]
        if unusual is not None:
            if put.tokens is not None:  # (an advance_batch step: its requests are shared)
                for i, _, _ in unusual:
                    batch.requests[i].new_token = put.tokens[i]
            outcomes: list = []
            others = frozenset(stale)
            self.host_build._statuses(  # type: ignore[attr-defined]
                ((i, batch.requests[i].seq_slot, status, message)
                 for i, status, message in unusual), outcomes, others)
            self._record_failed(self._interpret(batch, outcomes, unmask=False, others=others))

    def _node_batch(self, epoch: int) -> GuidedRequests | None:
        """The batch of ``epoch``: queued first, or the one fetched last."""
        if self._queue and self._queue[0].epoch == epoch:
            return self._queue[0].batch
        return self.requests_hostfunc if self._fetched_epoch == epoch else None

    def _apply_node_draft_build(self, epoch: int, masked: bool, unusual: list | None,
                                stale: Sequence[int]) -> None:
        """What a native draft step's build did (counters written already): a refused draft
        token or a dead row stops guiding the slot for the rest of the loop; any other outcome
        is interpreted as a build's."""
        self._masked_rows = masked
        batch = self._node_batch(epoch)
        if batch is not None:
            self.slots.forget_trees(batch.requests)  # (the node built these slots)
        if unusual is None or batch is None:
            return
        outcomes: list = []
        others = frozenset(stale)
        self.host_build._statuses(  # type: ignore[attr-defined]
            ((i, batch.requests[i].seq_slot, status, message) for i, status, message in unusual),
            outcomes, others)
        rest = []
        for outcome in outcomes:
            if outcome[1] in (Status.REJECTED, Status.DEAD_END):
                if outcome[0] not in others:  # (the node set its own flag)
                    self.is_draft_terminated[batch.requests[outcome[0]].seq_slot] = True
            else:
                rest.append(outcome)
        if rest:
            self._record_failed(self._interpret(batch, rest, unmask=False, others=others))

    def _apply_node_draft_end(self, epoch: int, unusual: list | None, rolled: list[int],
                              stale: Sequence[int]) -> None:
        """The end of a native drafting loop: its slots are guided again, a matcher that had
        terminated and rolled back re-reads its state, a rollback that raised fails its
        request."""
        self._open_draft = None
        matchers = self.grammar_matchers
        for slot in rolled:
            self.is_draft_terminated[slot] = False  # (the node's is cleared)
            m = matchers[slot]
            if m is not None and m.is_terminated():
                m.sync_state()  # type: ignore[attr-defined]  # (a native slot's matcher)
        batch = self._node_batch(epoch)
        if unusual and batch is not None:
            self._record_failed([self._fail_message(batch.requests[i], text, i not in stale)
                                 for i, _, text in unusual])

    def _apply_node_rollback(self, epoch: int, unusual: list | None, rolled: list[int],
                             stale: Sequence[int]) -> None:
        """What a native rollback did (its counters are written already): a matcher that had
        terminated and rolled back re-reads its state; a request that could not roll back
        fails as the Python rollback fails it."""
        matchers = self.grammar_matchers
        for slot in rolled:
            m = matchers[slot]
            if m is not None and m.is_terminated():
                m.sync_state()  # type: ignore[attr-defined]  # (a native slot's matcher)
        if unusual is None:
            return
        batch = self._node_batch(epoch)
        failed = []
        for index, kind, text in unusual:
            if batch is None:  # (a rollback is always read before its batch is forgotten)
                hostfunc.record_error("CapturableGuidedDecoder.host_rollback", QueueEpochError(
                    f"a rollback of epoch {epoch} failed a request ({text}) whose batch is "
                    "no longer known"), owner=self)
                continue
            req, drop = batch.requests[index], index not in stale
            if kind == 1:
                failed.append(self._fail(req, RequestError(
                    text, request_id=req.request_id, seq_slot=req.seq_slot), drop))
            else:
                failed.append(self._fail_message(req, text, drop))
        self._record_failed(failed)

    def _finish_build(self) -> None:
        self._node_collect()
        super()._finish_build()

    def _record_failed(self, failed: list[FailedRequest]) -> None:
        if failed:
            self._events += 1  # (the latest batch cannot simply continue: advance_batch)
        super()._record_failed(failed)

    def take_failed_requests(self) -> list[FailedRequest]:
        """Failures recorded since the last call (the native node's steps read first where
        one holds anything but counters), then forgets them."""
        self._node_collect(unusual_only=True)
        return super().take_failed_requests()

    @contextmanager
    def _inside_node(self) -> Iterator[None]:
        """A Python step of the node runs: the node took its job off its queue itself."""
        self._in_node = True
        try:
            yield
        finally:
            self._in_node = False

    def _run_python_step(self, epoch: int, rows: int, launch: int) -> None:
        """A Python step of the native node (the node holds no GIL; this runs under it): the
        Python host step (its fetch reads the node's steps before it first) for a step that
        masks ``rows`` logits rows, with the pruned draft vocabulary of its ``launch``; its
        errors go to the next drain."""
        try:
            with self._inside_node():
                CapturableGuidedDecoder.host_step.__wrapped__(
                    self, False, rows, self._node.reach_of(launch))  # type: ignore[union-attr]
        except BaseException as e:  # noqa: BLE001 - nothing may escape into the node
            hostfunc.record_error("CapturableGuidedDecoder.host_step", e, owner=self)

    def _run_python_draft(self, draft_step: int, rows: int, launch: int) -> None:
        """A Python draft step of the native node (under the GIL, on the node's thread; the
        node took the loop's batch off its queue itself), with the pruned draft vocabulary of
        its ``launch``; its errors go to the next drain."""
        try:
            with self._inside_node():
                CapturableGuidedDecoder.draft_host_step.__wrapped__(
                    self, draft_step, rows, self._node.reach_of(launch))  # type: ignore[union-attr]
        except BaseException as e:  # noqa: BLE001 - nothing may escape into the node
            hostfunc.record_error("CapturableGuidedDecoder.draft_host_step", e, owner=self)

    def _run_python_rollback(self) -> None:
        """The node's Python rollback (under the GIL, on the node's thread): the Python
        accepted step; its errors go to the next drain."""
        try:
            CapturableGuidedDecoder.accepted_host_step.__wrapped__(self, False)
        except BaseException as e:  # noqa: BLE001 - nothing may escape into the node
            hostfunc.record_error("CapturableGuidedDecoder.accepted_host_step", e, owner=self)


def _python_draft(decoder: CapturableGuidedDecoder) -> Callable[[int, int, int], None]:
    """The node's Python draft step, holding the decoder weakly."""
    ref = weakref.ref(decoder)

    def draft(draft_step: int, rows: int, launch: int) -> None:
        d = ref()
        if d is not None:
            d._run_python_draft(draft_step, rows, launch)
    return draft


def _python_rollback(decoder: CapturableGuidedDecoder) -> Callable[[], None]:
    """The node's Python rollback, holding the decoder weakly."""
    ref = weakref.ref(decoder)

    def rollback() -> None:
        d = ref()
        if d is not None:
            d._run_python_rollback()
    return rollback


def _python_step(decoder: CapturableGuidedDecoder) -> Callable[[int, int, int], None]:
    """The node's fallback, holding the decoder weakly (the node lives in the decoder)."""
    ref = weakref.ref(decoder)

    def step(epoch: int, rows: int, launch: int) -> None:
        d = ref()
        if d is not None:
            d._run_python_step(epoch, rows, launch)
    return step


class _Mirror:
    """Keeps the node's per-slot table in step with ``slots`` (called with a changed slot),
    except for the changes made while :meth:`quiet_on` names the calling thread (Python
    reading the node's own records: the node made those changes itself, in step order, and a
    late copy could undo a later step's)."""

    def __init__(self, node: HostNode, slots, read_first: Callable[[], None]) -> None:
        self._node = node
        self._handles, self._stopped = slots.matchers.handles, slots.is_draft_terminated
        self._quiet: int | None = None  # the thread whose changes are not mirrored
        self._read_first = read_first  # (_weak_collect's)

    def __call__(self, slot: int) -> None:
        if self._quiet != threading.get_ident():
            self._read_first()
            self._node.set_slot(slot, self._handles[slot], self._stopped[slot])

    def quiet_on(self, thread: int | None) -> int | None:
        """From now on the changes of ``thread`` (a ``threading.get_ident()``; None: no
        thread's) are not mirrored; returns the thread named before, to restore it after.
        (A plain call, not a context manager: it runs at every read of the node's records,
        where making and finishing a generator cost more than the read of a steady step.)"""
        before, self._quiet = self._quiet, thread
        return before


def _weak_collect(decoder: CapturableGuidedDecoder, unusual_only: bool) -> Callable[[], None]:
    """``decoder._node_collect(unusual_only)``, the decoder held weakly; once it is gone, a
    call removes itself from hostfunc's drain hooks (where it is one). Unusual records only:
    the drain hook (a queue error is not plain: it is read). Every record: what the
    decoder's :class:`_Mirror` calls before it changes a slot of the node, while each slot
    still holds the matcher its steps ran (node_take writes a record's counters only to such
    slots, and a plain record may be left unread after a step)."""
    ref = weakref.ref(decoder)

    def collect() -> None:
        d = ref()
        if d is None:
            hostfunc.remove_drain_hook(collect)
        else:
            d._node_collect(unusual_only)
    return collect
