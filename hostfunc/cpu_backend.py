"""Host callbacks on the CPU stand-in: the current HostStream runs them, or records them into the
HostGraph it is capturing into. Same contract as the CUDA backend.

Native host functions run on the stream's native lane (a C thread, see
:mod:`hostfunc.host_stream`); they need a C compiler for the lane's first build."""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from . import _context
from .host_stream import all_streams, current_stream
from .native import NativeCall, call_c
from .registry import REGISTRY

__all__ = ["CpuBackend"]


class CpuBackend:
    """Launches host callbacks on the calling thread's current :class:`~hostfunc.HostStream`."""

    name = "cpu"
    _lane_built = False  # the lane library was built and loaded (set on first native launch)

    def launch(self, fn: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        """Enqueue ``fn(*args, **kwargs)`` on the current HostStream, or record it into the graph
        that stream is capturing into (the graph then owns the entry)."""
        stream = current_stream()
        graph = stream.capture_graph
        if graph is not None:
            graph.add_call(REGISTRY.add(fn, args, kwargs, one_shot=False))
            return
        worker = stream._worker
        if stream.inline_when_idle and worker.claim_if_idle():
            # run now on this thread as the worker would (no registry entry, no stream or
            # backend made current, a failure kept for the drain); Ctrl-C still stops the caller
            saved = _context.clear()
            try:
                REGISTRY.call(fn, args, kwargs, reraise=(KeyboardInterrupt, SystemExit))
            finally:
                _context.restore(saved)
                worker.finish_inline()
            return
        key = REGISTRY.add(fn, args, kwargs, one_shot=True)
        try:
            stream.enqueue(functools.partial(REGISTRY.run, key))
        except BaseException:
            REGISTRY.release(key)
            raise

    def launch_native(self, call: NativeCall) -> None:
        """Enqueue a native call on the current HostStream's lane, or record it into the graph
        that stream is capturing into (``retain`` now, ``release`` with the graph). Eager, a
        ``retain``/``release`` pair brackets the one run: ``retain`` now, ``release`` right
        after ``fn`` on the lane. On an idle ``inline_when_idle`` stream an eager call runs
        on the calling thread instead, with the GIL released, as a Python launch would.

        Raises:
            HostFuncUsageError: the lane library cannot be built (no C compiler), or the
                stream is closed (a ``retain`` already done is undone with ``release``).
        """
        if not self._lane_built:  # fail here, before any retain, when there is no compiler
            from .lane import lane_library
            lane_library()
            self._lane_built = True
        stream = current_stream()
        graph = stream.capture_graph
        if graph is not None:
            graph.add_native(call)
            return
        worker = stream._worker
        if stream.inline_when_idle and worker.claim_if_idle():
            # run now on this thread, as the lane would (the GIL released for the call);
            # the caller holds user_data through it, so no retain/release bracket is needed
            try:
                call_c(call.fn, call.user_data)
            finally:
                worker.finish_inline()
            return
        if call.retain:
            call_c(call.retain, call.user_data)
        try:
            stream.enqueue_native(call)
        except BaseException:
            if call.release:
                call_c(call.release, call.user_data)
            raise

    def is_capturing(self) -> bool:
        """True while the current HostStream records into a HostGraph."""
        return current_stream().is_capturing

    def wait_all(self, timeout: float | None) -> None:
        """Wait until every HostStream has run what was enqueued on it so far (graph replays
        included); a no-op while the current stream captures."""
        if self.is_capturing():
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        for stream in all_streams():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            stream.synchronize(left)
