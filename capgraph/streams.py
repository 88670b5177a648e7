"""The side stream and two events of a guided step, on CUDA or on hostfunc's CPU stand-in.

The decoder forks host work (fetch, build) and the mask copy onto a side stream that waits for
the token event, records the bitmask event when done, and joins the main stream back on it.
On CUDA these are torch streams and events, so a graph capture records the fork and join. On the
CPU stand-in they are HostStreams and HostEvents; while the main HostStream is capturing into a
HostGraph there is no fork at all (everything is recorded in order on the capturing stream).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager

import torch

import hostfunc

__all__ = ["StepStreams", "CudaStepStreams", "HostStepStreams"]


class StepStreams:
    """Interface: fork to the side stream, the two events, the join and the drain."""

    def side(self) -> ContextManager[object]:  # pragma: no cover - interface
        """A context in which work goes on the side stream (the step's host work)."""
        raise NotImplementedError

    def wait_tokens(self) -> None:
        """(On the side stream) wait until the step's tokens are ready."""

    def record_tokens(self) -> None:
        """(On the current stream) mark the step's tokens ready."""

    def record_bitmask(self) -> None:
        """(On the side stream) mark the host work and the copy done."""

    def wait_bitmask(self) -> None:
        """(On the main stream) wait for the side stream's work: the join."""

    def side_idle(self) -> bool:
        """Whether the side stream has run everything queued on it (never blocks)."""
        return True

    def is_capturing(self) -> bool:
        """True while hostfunc records into a graph on the calling thread's stream."""
        return hostfunc.is_capturing()

    def drain(self, owner: object = None) -> None:
        """Wait (GIL released) until every host callback enqueued so far has run, then re-raise
        a callback error (``owner``: only its own and those of no owner); a no-op wait while
        capturing."""
        hostfunc.drain(owner=owner)


class CudaStepStreams(StepStreams):
    def __init__(self, device: torch.device) -> None:
        self.stream = torch.cuda.Stream(device=device)
        self.token_event = torch.cuda.Event()
        self.bitmask_event = torch.cuda.Event()

    def side(self) -> ContextManager[object]:
        """The side CUDA stream as torch's current stream."""
        return torch.cuda.stream(self.stream)

    def wait_tokens(self) -> None:
        torch.cuda.current_stream().wait_event(self.token_event)

    def record_tokens(self) -> None:
        self.token_event.record()

    def record_bitmask(self) -> None:
        self.bitmask_event.record()

    def wait_bitmask(self) -> None:
        torch.cuda.current_stream().wait_event(self.bitmask_event)

    def side_idle(self) -> bool:
        return bool(self.stream.query())

    def is_capturing(self) -> bool:
        """True while torch captures a CUDA graph on the current stream."""
        return torch.cuda.is_current_stream_capturing()

    def drain(self, owner: object = None) -> None:
        # bitmask_event is recorded after every callback the decoder enqueues; waiting on it
        # releases the GIL, so a pending callback can take it (else: the host node waits for
        # the GIL this thread holds while it waits for the host node).
        if not self.is_capturing():
            self.bitmask_event.synchronize()
        hostfunc.check_errors(owner=owner)


class HostStepStreams(StepStreams):
    """``inline_when_idle``: the side stream's host step runs on the calling thread when the
    stream is idle (see :class:`hostfunc.HostStream`); its xgrammar work then goes to the C++
    build's own thread, which never takes the GIL (``CapturableGuidedDecoder.prepare``)."""

    def __init__(self, inline_when_idle: bool = False) -> None:
        self.stream = hostfunc.HostStream("capgraph-side", inline_when_idle=inline_when_idle)
        self.token_event = hostfunc.HostEvent("capgraph-tokens")
        self.bitmask_event = hostfunc.HostEvent("capgraph-bitmask")

    def side(self) -> ContextManager[object]:
        """The side HostStream as hostfunc's current stream; while capturing, nothing (the
        HostGraph records in order)."""
        return nullcontext() if self.is_capturing() else hostfunc.use_stream(self.stream)

    def is_capturing(self) -> bool:
        """True while the calling thread's current HostStream records into a HostGraph."""
        return hostfunc.current_stream().is_capturing

    def wait_tokens(self) -> None:
        if hostfunc.current_stream() is self.stream:
            self.stream.wait_event(self.token_event)

    def record_tokens(self) -> None:
        stream = hostfunc.current_stream()
        if not stream.is_capturing:
            self.token_event.record(stream)

    def record_bitmask(self) -> None:
        if hostfunc.current_stream() is self.stream:
            self.bitmask_event.record(self.stream)

    def wait_bitmask(self) -> None:
        if not self.is_capturing():
            hostfunc.current_stream().wait_event(self.bitmask_event)

    def side_idle(self) -> bool:
        return self.stream.query()

    def close(self) -> None:
        """Close the side HostStream: its queued work runs, then its thread ends (waited for)."""
        self.stream.close()
