"""The CPU stand-in for a CUDA graph: record the callbacks launched during a capture, enqueue them
again on every replay.

A :class:`HostGraph` owns the registry entries of the calls captured into it, the way a CUDA graph
owns them through a user object: they live until :meth:`HostGraph.reset` or until the graph is
collected, and if a replay is still running then, they go once it has finished (the driver defers
a user object's destructor the same way). :func:`capture` is the ``torch.cuda.graph`` analogue.

Native host functions captured into a graph (:func:`hostfunc.launch_native`) hold no registry
entry: their ``retain`` runs at capture, their ``release`` when the graph's entries are released
(after replays in flight finish), and each replay runs them on the stream's native lane. What
their ``user_data`` points into may instead be held by the graph (:meth:`HostGraph.keep_alive`),
released at the same time.
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .errors import HostFuncUsageError
from .host_stream import HostStream, current_stream, use_stream
from .native import NativeCall, call_c
from .registry import REGISTRY

__all__ = ["HostGraph", "capture"]

Step = Callable[[HostStream], None]


class _Ownership:
    """The keys a graph owns and its replays in flight. Replay tasks and the graph's finalizer
    hold this object, never the graph, so that a graph can be collected mid-replay."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.keys: list[int] = []
        self.natives: list[NativeCall] = []  # captured native calls with a release to call
        self.kept: list[object] = []  # what captured native calls point into (keep_alive)
        self.num_native = 0
        self.in_flight = 0
        self.released = False

    def replay_started(self) -> None:
        with self.lock:
            self.in_flight += 1

    def replay_done(self) -> None:
        with self.lock:
            self.in_flight -= 1
            hand_back = self.released and self.in_flight == 0
        if hand_back:
            self._hand_back()

    def release(self) -> None:
        with self.lock:
            self.released = True
            hand_back = self.in_flight == 0
        if hand_back:
            self._hand_back()

    def _hand_back(self) -> None:
        with self.lock:
            keys, self.keys = self.keys, []
            natives, self.natives = self.natives, []
            self.kept = []
        for key in keys:
            REGISTRY.defer_release(key)
        for call in natives:  # on whichever thread lets go last; the GIL is released in C
            call_c(call.release, call.user_data)


class HostGraph:
    """A recorded sequence of host callbacks (and event records/waits), replayable any number of
    times with the arguments bound at capture.

    Capture with :func:`capture` (or ``capture_begin``/``capture_end`` around work on a
    HostStream); replay with :meth:`replay`; free the captured entries with :meth:`reset`
    (or by dropping the graph). After ``reset`` the graph is empty and can capture again.
    """

    def __init__(self) -> None:
        self._steps: list[Step] = []
        self._stream: HostStream | None = None
        self._own = _Ownership()
        self._finalizer = weakref.finalize(self, self._own.release)

    def __repr__(self) -> str:
        return f"HostGraph(callbacks={self.num_callbacks}, steps={len(self._steps)})"

    @property
    def num_callbacks(self) -> int:
        """Number of callbacks captured, Python and native (each runs once per replay)."""
        with self._own.lock:
            return len(self._own.keys) + self._own.num_native

    def capture_begin(self, stream: HostStream) -> None:
        """Start recording what is launched on ``stream``.

        Raises:
            HostFuncUsageError: the graph already holds a capture, or is capturing, or the
                stream is capturing into another graph.
        """
        if self._stream is not None or self._steps:
            raise HostFuncUsageError(f"{self!r} already holds a capture; reset() it first")
        if stream.capture_graph is not None:
            raise HostFuncUsageError(f"{stream!r} is already capturing into another graph")
        self._stream = stream
        stream.capture_graph = self

    def capture_end(self) -> None:
        """Stop recording; the graph can now be replayed."""
        if self._stream is None:
            raise HostFuncUsageError(f"{self!r} is not capturing")
        self._stream.capture_graph = None
        self._stream = None

    def add_call(self, key: int) -> None:
        """Record the registry entry ``key``; the graph now owns it (called by the backend)."""
        with self._own.lock:
            self._own.keys.append(key)
        def step(stream: HostStream) -> None:
            stream.enqueue(functools.partial(REGISTRY.run, key))
        self._steps.append(step)

    def add_native(self, call: NativeCall) -> None:
        """Record a native call (called by the backend): ``call.retain`` runs now, on this
        thread; ``call.release`` when the graph's entries are released."""
        if call.retain:
            call_c(call.retain, call.user_data)
        with self._own.lock:
            self._own.num_native += 1
            if call.release:
                self._own.natives.append(call)
        replayed = NativeCall(call.fn, call.user_data)

        def step(stream: HostStream) -> None:
            stream.enqueue_native(replayed)
        self._steps.append(step)

    def keep_alive(self, obj: object) -> None:
        """Hold ``obj`` until the graph's entries are released (after the replays in flight
        then): the memory a captured native call's ``user_data`` points to, say."""
        with self._own.lock:
            self._own.kept.append(obj)

    def add_step(self, step: Step) -> None:
        """Record an action to perform on the replay stream at each replay (events use this)."""
        self._steps.append(step)

    def replay(self, stream: HostStream | None = None) -> None:
        """Enqueue every recorded step on ``stream`` (default: the current HostStream), in
        capture order. Returns at once; drain or synchronize to wait for the callbacks.

        Raises:
            HostFuncUsageError: the graph is capturing, or the replay stream is capturing.
        """
        stream = stream or current_stream()
        if self._stream is not None:
            raise HostFuncUsageError(f"{self!r} cannot replay while it is capturing")
        if stream.capture_graph is not None:
            raise HostFuncUsageError(f"cannot replay {self!r} into a capturing {stream!r}")
        own = self._own
        own.replay_started()
        try:
            for step in self._steps:
                step(stream)
        finally:
            stream.enqueue(own.replay_done)

    def reset(self) -> None:
        """Release the captured entries (after any replay in flight finishes) and empty the
        graph. Safe to call more than once."""
        if self._stream is not None:
            self.capture_end()
        self._finalizer()  # runs _Ownership.release once
        self._steps = []
        self._own = _Ownership()
        self._finalizer = weakref.finalize(self, self._own.release)


@contextmanager
def capture(graph: HostGraph, stream: HostStream | None = None) -> Iterator[HostGraph]:
    """Capture the launches of the block into ``graph`` (like ``torch.cuda.graph``).

    Args:
        graph: an empty HostGraph.
        stream: the stream to capture on; default a fresh side HostStream, as torch uses a side
            stream. It is the current stream inside the block, so ``hostfunc.launch`` records
            onto it. If the block raises, the graph is reset and the error propagates.
    """
    stream = stream if stream is not None else HostStream("HostStream-capture")
    graph.capture_begin(stream)
    try:
        with use_stream(stream):
            yield graph
    except BaseException:
        graph.reset()
        raise
    graph.capture_end()
