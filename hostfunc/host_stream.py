"""The CPU stand-in for a CUDA stream: an ordered queue of host tasks run by one worker thread.

:class:`HostStream` runs what is enqueued on it in order, one task at a time, on its own thread,
as a CUDA stream runs its host callbacks. :class:`HostEvent` marks a point in a stream's queue
that another stream (or the host) can wait for. :func:`use_stream` makes a stream current for the
calling thread, like ``torch.cuda.stream``; :func:`current_stream` returns it.

Waits (``synchronize``) release the GIL while they wait (``threading.Condition.wait`` does).

Native host functions (:func:`hostfunc.launch_native`) run on the stream's native lane, a C
thread started on the stream's first native call (:class:`hostfunc.lane.Lane`), so that no
Python runs between the stream reaching the call and its return. The stream stays one ordered
queue: a native call on a stream with nothing queued or running in Python goes straight to the
lane; otherwise it is queued behind the Python tasks, and the worker hands it to the lane and
waits for it (GIL released; consecutive queued native calls are handed over together). A Python
task never starts while earlier native calls of its stream are unfinished (the worker waits for
the lane first, GIL released). ``synchronize``, ``query``, ``HostEvent.record`` on an idle
stream and ``inline_when_idle`` count native calls too.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import _context
from .errors import HostFuncTimeoutError, HostFuncUsageError
from .registry import REGISTRY

if TYPE_CHECKING:
    from .host_graph import HostGraph
    from .lane import Lane
    from .native import NativeCall

__all__ = ["HostStream", "HostEvent", "use_stream", "current_stream", "explicit_stream",
           "all_streams"]

Task = Callable[[], None]
_POLL_S = 0.05  # how often a blocked worker re-checks whether its stream was closed
_stream_ids = itertools.count()


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


class _Worker:
    """The queue and thread of one HostStream; holds no reference to the stream itself, so an
    unreferenced HostStream is collected and its thread told to stop.

    Once the stream has a native lane, each task queued is wrapped so that it first waits for
    the native calls enqueued before it (see :func:`_after_lane`).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self.cond = threading.Condition()
        self.tasks: deque[Task] = deque()
        self.enqueued = 0
        self.completed = 0
        self.closed = False
        self.inline: int | None = None  # ident of the thread running a task inline, if any
        self.thread: threading.Thread | None = None
        self.lane: Lane | None = None   # started on the first native call
        _ALL_WORKERS.add(self)

    def put(self, task: Task) -> int:
        """Append ``task``; returns its ticket number."""
        with self.cond:
            if self.closed:
                raise HostFuncUsageError(f"{self.name} is closed")
            lane = self.lane
            if lane is not None:
                task = functools.partial(_after_lane, lane, lane.enqueued, task)
            self.tasks.append(task)
            self.enqueued += 1
            self._wake()
            return self.enqueued

    def _wake(self) -> None:
        # (under self.cond) a task was appended: start the thread if needed, wake it
        if self.thread is None:
            self.thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self.thread.start()
        self.cond.notify_all()

    def put_native(self, call: NativeCall) -> None:
        """Enqueue a native call: straight to the lane when nothing is queued or running in
        Python, else as a task that hands it to the lane when the worker reaches it."""
        if self.lane is None:
            from .lane import Lane, lane_library
            lane_library()  # a first build happens here, outside the stream's lock
            with self.cond:
                if self.lane is None and not self.closed:
                    self.lane = Lane(self.name)
        with self.cond:
            if self.closed:
                raise HostFuncUsageError(f"{self.name} is closed")
            lane = self.lane
            assert lane is not None
            if self.completed >= self.enqueued:
                lane.push(call)
                return
            last = self.tasks[-1] if self.tasks else None
            if type(last) is _NativeBatch and not last.started:
                last.calls.append(call)  # one hand-over for consecutive native calls
                return
            self.tasks.append(_NativeBatch(self.cond, lane, call))
            self.enqueued += 1
            self._wake()

    def idle(self) -> bool:
        """Nothing queued or running, native calls included (without the lock: ``completed``
        is read first, and only grows up to ``enqueued``, so a busy stream never reads as
        idle)."""
        completed = self.completed
        if completed < self.enqueued:
            return False
        lane = self.lane
        return lane is None or lane.idle()

    def claim_if_idle(self) -> bool:
        """With nothing queued or running, count one task as running on the calling thread
        (later ones queue behind it) and return True; the caller runs it, then calls
        :meth:`finish_inline`. Else False."""
        with self.cond:
            if self.closed:
                raise HostFuncUsageError(f"{self.name} is closed")
            if self.completed < self.enqueued or (self.lane is not None
                                                  and not self.lane.idle()):
                return False
            self.enqueued += 1
            self.inline = threading.get_ident()
            return True

    def finish_inline(self) -> None:
        with self.cond:
            self.inline = None
            self.completed += 1
            self.cond.notify_all()

    def _in_own_task(self) -> bool:
        """True on this stream's worker thread, or inside a task it runs inline."""
        return (threading.current_thread() is self.thread
                or self.inline == threading.get_ident())

    def _loop(self) -> None:
        while True:
            with self.cond:
                while self.inline is not None or (not self.tasks and not self.closed):
                    self.cond.wait()
                if not self.tasks:
                    lane = self.lane
                    break
                task = self.tasks.popleft()
            try:
                task()
            except BaseException as exc:  # noqa: BLE001 — tasks are ours and should not raise;
                # if one does, keep the worker alive (drains would hang) and report it.
                REGISTRY.record_error(f"<{self.name} task>", exc)
            del task
            with self.cond:
                self.completed += 1
                self.cond.notify_all()
        if lane is not None:  # closed and drained: end the lane once its calls returned
            lane.close(wait=True)

    def wait_for(self, ticket: int, timeout: float | None, lane_ticket: int = 0) -> None:
        """Wait until Python task ``ticket`` and native call ``lane_ticket`` have finished."""
        if self._in_own_task():
            raise HostFuncUsageError(f"{self.name} cannot wait for itself from one of its tasks")
        deadline = _deadline(timeout)
        with self.cond:
            while self.completed < ticket:
                left = _left(deadline)
                if left == 0.0:
                    raise HostFuncTimeoutError(self.name, timeout or 0.0)
                self.cond.wait(left)
            lane = self.lane
        if lane_ticket and lane is not None:
            lane.wait(lane_ticket, _left(deadline))

    def tickets(self) -> tuple[int, int]:
        """The (Python, native) tickets of everything enqueued so far."""
        with self.cond:
            lane = self.lane
            return self.enqueued, 0 if lane is None else lane.enqueued

    def stop(self) -> None:
        """Refuse later enqueues; the worker (and lane) end once their queues are empty."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()

    def close(self, join: bool = False, timeout: float | None = 5.0) -> None:
        """Stop the worker once its queue is empty; with ``join``, wait for its thread to end
        (never from the worker itself). The lane ends after the worker: the worker thread
        closes it as it ends; with no worker thread, it is closed here (waited for with
        ``join``, else it ends by itself once its calls returned)."""
        with self.cond:
            self.closed = True
            self.cond.notify_all()
            thread, lane = self.thread, self.lane
        if thread is None:
            if lane is not None:
                lane.close(wait=join)
        elif join and not self._in_own_task():
            thread.join(timeout)


def _after_lane(lane: Lane, ticket: int, task: Task) -> None:
    # A task queued once the stream has a lane: the native calls enqueued before it first.
    lane.wait(ticket)  # (GIL released; returns at once for ticket 0 or a reached one)
    task()


class _NativeBatch:
    """Native calls queued behind Python tasks, as one task: when the worker reaches it, it
    hands them to the lane (behind any native calls still running there, in order) and waits
    for the last, GIL released. Calls enqueued while it is the last queued task and not yet
    started join it."""

    __slots__ = ("cond", "lane", "calls", "started")

    def __init__(self, cond: threading.Condition, lane: Lane, call: NativeCall) -> None:
        self.cond = cond
        self.lane = lane
        self.calls = [call]
        self.started = False

    def __call__(self) -> None:
        with self.cond:
            self.started = True
            calls = self.calls
        ticket = 0
        for call in calls:
            ticket = self.lane.push(call)
        self.lane.wait(ticket)


# Workers are daemon threads; one still running Python (dropping a tensor, say) while the
# interpreter finalizes can abort the process (exit 134). Close and join every worker at exit.
_ALL_WORKERS: weakref.WeakSet[_Worker] = weakref.WeakSet()


@atexit.register
def _join_workers_at_exit() -> None:
    workers = list(_ALL_WORKERS)
    for worker in workers:
        worker.stop()
    for worker in workers:
        worker.close(join=True)


class HostStream:
    """An ordered host work queue run by one worker thread (the stand-in for a CUDA stream).

    Args:
        name: thread name, shown in errors and debuggers.

    Tasks run one at a time in enqueue order. The worker thread starts on the first enqueue and
    stops when the stream is closed or collected. A stream that is capturing into a
    :class:`~hostfunc.HostGraph` records launches instead of running them.

    With ``inline_when_idle``, a host callback launched while the stream has nothing queued or
    running runs at once on the launching thread (with no stream or backend made current, as
    on the worker), and the launch returns when it has run; anything launched meanwhile
    queues behind it. Its failure is kept for the next drain as on the worker. For a
    stream whose callbacks hand their heavy work to threads of their own: a Python worker
    thread then only adds a GIL hand-off beside the caller's (CPU) work, which on a small
    machine costs more than the callback's Python. An eager native call
    (:func:`~hostfunc.launch_native`) on such an idle stream runs on the launching thread too,
    with the GIL released, instead of a hand-over to the native lane.
    """

    def __init__(self, name: str | None = None, *, inline_when_idle: bool = False) -> None:
        self.name = name or f"HostStream-{next(_stream_ids)}"
        self.inline_when_idle = inline_when_idle
        self._worker = _Worker(self.name)
        self.capture_graph: HostGraph | None = None
        weakref.finalize(self, self._worker.close)
        _ALL_STREAMS.add(self)

    def __repr__(self) -> str:
        return f"HostStream({self.name!r})"

    def enqueue(self, task: Task) -> int:
        """Append ``task`` (which must not raise) to the queue; returns its ticket number."""
        return self._worker.put(task)

    def enqueue_native(self, call: NativeCall) -> None:
        """Append a native call (``call.fn(call.user_data)``, then ``call.release`` where
        given) in stream order; it runs on the stream's native lane, without the GIL.

        Raises:
            HostFuncUsageError: the stream is closed, or the lane library cannot be built.
        """
        self._worker.put_native(call)

    @property
    def thread(self) -> threading.Thread | None:
        """The worker thread running this stream's tasks; None until a task needed it (tasks
        run inline with ``inline_when_idle`` start none)."""
        return self._worker.thread

    @property
    def is_capturing(self) -> bool:
        """True while this stream records into a HostGraph instead of running."""
        return self.capture_graph is not None

    def query(self) -> bool:
        """True when everything enqueued so far has run (never blocks)."""
        return self._worker.idle()

    def synchronize(self, timeout: float | None = None) -> None:
        """Block until every task enqueued so far has run; the GIL is released while waiting.

        Raises:
            HostFuncTimeoutError: ``timeout`` seconds passed first.
            HostFuncUsageError: called from one of this stream's own tasks (it would deadlock).
        """
        ticket, lane_ticket = self._worker.tickets()
        self._worker.wait_for(ticket, timeout, lane_ticket)

    def wait_event(self, event: HostEvent) -> None:
        """Make later work on this stream wait until ``event``'s latest record has completed."""
        event.wait(self)

    def close(self, join: bool = True) -> None:
        """Stop the worker once the queue is empty (later enqueues raise); by default wait for
        its thread to end, so nothing of this stream runs after ``close`` returns."""
        self._worker.close(join=join)


class HostEvent:
    """A marker in a HostStream's queue (the stand-in for a CUDA event).

    ``record(stream)`` places the marker; ``wait(stream)`` makes another stream's later work wait
    for the marker placed by the latest ``record`` (none recorded yet: no wait, as in CUDA);
    ``synchronize`` and ``query`` do the same for the host. While ``stream`` is capturing, record
    and wait are recorded into the graph and happen at each replay.
    """

    def __init__(self, name: str | None = None) -> None:
        self.name = name or f"HostEvent-{id(self):x}"
        self._cond = threading.Condition()
        self._recorded = 0   # generation of the latest record()
        self._completed = 0  # highest generation whose marker has been reached

    def __repr__(self) -> str:
        return f"HostEvent({self.name!r})"

    def record(self, stream: HostStream | None = None) -> None:
        """Place the marker at the end of ``stream`` (default: the current stream)."""
        stream = stream or current_stream()
        if stream.capture_graph is not None:
            stream.capture_graph.add_step(lambda s: self.record(s))
            return
        worker = stream._worker
        if worker.closed:
            raise HostFuncUsageError(f"{worker.name} is closed")
        if worker.idle():
            # On an idle stream the marker is reached at once (as a CUDA event recorded on an
            # idle stream): complete it here rather than wake the stream's thread for it; and
            # where the latest record is reached already, a new one changes nothing a wait sees.
            if not self.query():
                with self._cond:
                    self._recorded += 1
                    self._completed = self._recorded
                    self._cond.notify_all()
            return
        with self._cond:  # (the marker counts only once it is enqueued: a closed stream refuses)
            generation = self._recorded + 1
            worker.put(lambda: self._complete(generation))
            self._recorded = generation

    def wait(self, stream: HostStream | None = None) -> None:
        """Make later work on ``stream`` (default: current) wait for the latest record."""
        stream = stream or current_stream()
        if stream.capture_graph is not None:
            stream.capture_graph.add_step(lambda s: self.wait(s))
            return
        if self._completed >= self._recorded:  # reached: no wait (read in this order: see
            return                              # _Worker.idle)
        with self._cond:
            generation = self._recorded
            reached = self._completed >= generation
        if not reached:  # (a wait for a marker already reached is no wait, as in CUDA)
            stream.enqueue(lambda: self._block_until(generation, stream._worker))

    def query(self) -> bool:
        """True when the latest record has been reached (or nothing was recorded)."""
        completed = self._completed  # (without the lock, read in this order: see _Worker.idle)
        return completed >= self._recorded

    def synchronize(self, timeout: float | None = None) -> None:
        """Block the host until the latest record has been reached; the GIL is released.

        Raises:
            HostFuncTimeoutError: ``timeout`` seconds passed first.
        """
        if self._completed >= self._recorded:  # (read in this order: see _Worker.idle)
            return
        deadline = _deadline(timeout)
        with self._cond:
            generation = self._recorded
            while self._completed < generation:
                left = _left(deadline)
                if left == 0.0:
                    raise HostFuncTimeoutError(self.name, timeout or 0.0)
                self._cond.wait(left)

    def _complete(self, generation: int) -> None:
        with self._cond:
            self._completed = max(self._completed, generation)
            self._cond.notify_all()

    def _block_until(self, generation: int, waiter: _Worker) -> None:
        # Runs on the waiting stream's worker; wakes now and then so that close() can end it.
        with self._cond:
            while self._completed < generation and not waiter.closed:
                self._cond.wait(_POLL_S)


# ---- the current stream (per thread, like torch's) ----

_ALL_STREAMS: weakref.WeakSet[HostStream] = weakref.WeakSet()
_default_lock = threading.Lock()
_default: list[HostStream] = []


def all_streams() -> list[HostStream]:
    """Every HostStream still alive (the drain waits on all of them)."""
    return list(_ALL_STREAMS)


def explicit_stream() -> HostStream | None:
    """The stream made current by :func:`use_stream` on this thread, if any."""
    stack = _context.streams.stack
    return stack[-1] if stack else None


def current_stream() -> HostStream:
    """The calling thread's current HostStream: the innermost :func:`use_stream`, else the
    process's default HostStream (created on first use)."""
    stack = _context.streams.stack
    if stack:
        return stack[-1]
    if _default:  # (the lock only guards creation)
        return _default[0]
    with _default_lock:
        if not _default:
            _default.append(HostStream("HostStream-default"))
        return _default[0]


class use_stream:  # noqa: N801 - used as a function, like torch.cuda.stream
    """Make ``stream`` the calling thread's current stream inside the block (like
    ``torch.cuda.stream``). While any HostStream is current, launches use the CPU stand-in even
    on a machine with a GPU.

    Example::

        with hostfunc.use_stream(side):
            hostfunc.launch(work)   # enqueued on ``side``
    """

    __slots__ = ("stream",)

    def __init__(self, stream: HostStream) -> None:
        if not isinstance(stream, HostStream):
            raise TypeError(f"use_stream expects a HostStream, got {type(stream).__name__}")
        self.stream = stream

    def __enter__(self) -> HostStream:
        _context.streams.stack.append(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        _context.streams.stack.pop()
