"""Host callbacks on CUDA streams through cuda-python's driver bindings (``cuda.bindings.driver``).

Eager launch (stream not capturing): ``cuLaunchHostFunc(stream, trampoline, key)`` with a one-shot
registry entry. The binding wraps the pointer in its own one-shot record (cuda-python #790), which
is all an eager launch needs.

Captured launch (stream capturing): the binding's wrapper would leave a dangling record in the
graph, so the host node is added by hand, with the raw trampoline and key:

    cuStreamGetCaptureInfo(stream)          -> graph being captured, current dependency nodes
    cuUserObjectCreate(key, release, 1, NO_DESTRUCTOR_SYNC)
    cuGraphRetainUserObject(graph, obj, 1, MOVE)   the graph (and each instantiation) owns key
    cuGraphAddHostNode(graph, deps, n, {fn: trampoline, userData: key})
    cuStreamUpdateCaptureDependencies(stream, [node], None, 1, SET)   later work orders after it

The user object is created first so that the entry is owned by the graph before any node can
refer to it: every failure path either releases the entry at once or leaves it to the graph.

The bindings release the GIL inside every driver call; the trampolines take it (ctypes does).

Native host functions (:func:`hostfunc.launch_native`) take the same two routes with the raw C
function and ``user_data`` in place of the trampoline and key, so the driver calls them directly
and no Python (no GIL) is on the stream's path:

- captured: the sequence above; the user object (``cuUserObjectCreate(user_data, release)``) only
  where a ``retain``/``release`` pair is given, ``retain(user_data)`` called first on the calling
  thread, ``release`` called once at once if a driver call refuses before the graph owns it;
- eager: not the bindings' ``cuLaunchHostFunc``, whose wrapper takes the GIL before calling the
  function, but the driver's own entry point, resolved once with ``driver.cuGetProcAddress``
  (legacy default-stream semantics, as torch's stream handles use) and called through a ctypes
  ``CFUNCTYPE`` (a ctypes foreign call releases the GIL). With a ``retain``/``release`` pair,
  ``retain`` runs now and ``release`` is launched right behind ``fn``.

tests/test_hostfunc_native.py pins the native sequence against the fake libcuda (raw values
reach the driver, ``fn`` runs without the GIL, one ``release`` on every failure path).
UNVERIFIED (needs a GPU; tests/test_hostfunc_native_gpu.py checks it): that a real driver hands
out ``cuLaunchHostFunc`` through ``cuGetProcAddress`` as used here, and that a native host node
completes while another thread holds the GIL, captured and eager.

What pins it: tests/test_hostfunc_fake_driver.py runs the call sequence against a fake
libcuda (argument passing -- the raw fn pointer and integer userData reach the driver unchanged
--, GIL release during the calls, replay running the bound call each time, the destructor
handing the key back); tests/test_hostfunc_gpu.py, on a GPU (``tools/gpu_check.sh``), checks
that a real capture accepts the user object and host node as issued here, that a captured pair
replayed ten times runs ten times, that the destructor fires on torch's ``CUDAGraph.reset()``,
that a second launch while a callback waits for the GIL does not deadlock, and that
cuda-python's one-shot wrapper fails replay where this route does not.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
import ctypes
from types import ModuleType
from typing import Any

from .errors import HostFuncLaunchError, HostFuncTimeoutError
from .native import NativeCall, call_c
from .registry import REGISTRY, callable_name
from .trampoline import trampoline_addresses

__all__ = ["CudaBackend", "torch_current_stream"]

_SUCCESS = 0
_NOT_READY = 600        # CUDA_ERROR_NOT_READY
_INVALID_HANDLE = 400   # CUDA_ERROR_INVALID_HANDLE
_POLL_S = 0.0005
_GET_PROC_ADDRESS_LEGACY_STREAM = 1  # CU_GET_PROC_ADDRESS_LEGACY_STREAM
# CUresult cuLaunchHostFunc(CUstream hStream, CUhostFn fn, void *userData)
_LAUNCH_HOST_FUNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p)


def torch_current_stream() -> int:
    """The raw ``CUstream`` handle of torch's current CUDA stream on the current device."""
    import torch

    return int(torch.cuda.current_stream().cuda_stream)


class CudaBackend:
    """Launches host callbacks on CUDA streams.

    Args:
        driver: the driver-bindings module; default ``cuda.bindings.driver``, imported on first
            use. Injectable so the call sequence can be tested without a GPU.
        current_stream: returns the raw handle of the stream to launch on; default torch's
            current stream.

    Nothing is loaded or initialised before the first launch / query.
    """

    name = "cuda"

    def __init__(self, driver: ModuleType | Any | None = None,
                 current_stream: Callable[[], int] | None = None) -> None:
        self._driver = driver
        self._stream_of = current_stream or torch_current_stream
        self._lock = threading.Lock()
        self._ready = False
        self._run_fn: Any = None       # CUhostFn of the run trampoline
        self._release_fn: Any = None   # CUhostFn of the release trampoline
        self._launched_on: set[int] = set()  # streams with eager launches since the last drain
        self._raw_launch: Any = None   # the driver's own cuLaunchHostFunc (ctypes), on first use

    # ---- driver access ----

    def _drv(self) -> Any:
        if not self._ready:
            with self._lock:
                if not self._ready:
                    if self._driver is None:
                        from cuda.bindings import driver
                        self._driver = driver
                    self._call("cuInit", "<init>", self._driver.cuInit, 0)
                    run_addr, release_addr = trampoline_addresses()
                    self._run_fn = self._driver.CUhostFn(run_addr)
                    self._release_fn = self._driver.CUhostFn(release_addr)
                    self._ready = True
        return self._driver

    @staticmethod
    def _call(call: str, fn_name: str, func: Callable[..., Any], *args: Any) -> tuple[Any, ...]:
        """Call a binding (it releases the GIL inside), raise on a non-success result."""
        result = func(*args)
        err = result[0]
        if int(err) != _SUCCESS:
            raise HostFuncLaunchError(call, err, fn_name)
        return tuple(result[1:])

    def _capture_status(self, stream: Any, fn_name: str) -> int:
        (status,) = self._call("cuStreamIsCapturing", fn_name,
                               self._drv().cuStreamIsCapturing, stream)
        return int(status)

    # ---- the backend interface ----

    def launch(self, fn: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> None:
        """Enqueue ``fn(*args, **kwargs)`` on the current stream (see the module docstring)."""
        d = self._drv()
        name = callable_name(fn)
        handle, stream, capture = self._capture_state(d, name)
        if capture is None:
            self._launch_eager(d, stream, handle, fn, args, kwargs, name)
        else:
            self._add_captured(d, stream, *capture, fn, args, kwargs, name)

    def _capture_state(self, d: Any, name: str
                       ) -> tuple[int, Any, tuple[Any, Any, Any, int] | None]:
        """The current stream's handle, its ``CUstream``, and ``(graph, deps, edges,
        num_deps)`` while it captures, else None.

        Raises:
            HostFuncLaunchError: the query failed, or the stream's capture was invalidated.
        """
        handle = self._stream_of()
        stream = d.CUstream(handle)
        status, _seq, graph, deps, edges, num_deps = self._call(
            "cuStreamGetCaptureInfo", name, d.cuStreamGetCaptureInfo, stream)
        status = int(status)
        if status == int(d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE):
            return handle, stream, None
        if status == int(d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_ACTIVE):
            return handle, stream, (graph, deps, edges, int(num_deps))
        raise HostFuncLaunchError("cuStreamGetCaptureInfo", status, name,
                                  "the stream's capture sequence was invalidated")

    def _launch_eager(self, d: Any, stream: Any, handle: int, fn: Callable[..., Any],
                      args: tuple[Any, ...], kwargs: dict[str, Any], name: str) -> None:
        key = REGISTRY.add(fn, args, kwargs, one_shot=True)
        try:
            self._call("cuLaunchHostFunc", name, d.cuLaunchHostFunc, stream, self._run_fn, key)
        except BaseException:
            REGISTRY.release(key)
            raise
        with self._lock:
            self._launched_on.add(handle)

    def _add_captured(self, d: Any, stream: Any, graph: Any, deps: Any, edges: Any,
                      num_deps: int, fn: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any], name: str) -> None:
        # A host node only takes full-completion edges; anything else (programmatic launch
        # ports) would be silently dropped by cuGraphAddHostNode, so refuse it.
        for edge in edges or ():
            if edge.from_port or edge.to_port or edge.type:
                raise HostFuncLaunchError("cuStreamGetCaptureInfo", "non-default edge data",
                                          name, "host nodes cannot follow programmatic edges")
        key = REGISTRY.add(fn, args, kwargs, one_shot=False)
        try:
            (obj,) = self._call(
                "cuUserObjectCreate", name, d.cuUserObjectCreate, key, self._release_fn, 1,
                d.CUuserObject_flags.CU_USER_OBJECT_NO_DESTRUCTOR_SYNC)
        except BaseException:
            REGISTRY.release(key)
            raise
        try:
            self._call("cuGraphRetainUserObject", name, d.cuGraphRetainUserObject, graph, obj,
                       1, d.CUuserObjectRetain_flags.CU_GRAPH_USER_OBJECT_MOVE)
        except BaseException:
            d.cuUserObjectRelease(obj, 1)  # its destructor hands the key back
            raise
        # The graph owns the entry from here on; a failure below leaves it to the graph.
        params = d.CUDA_HOST_NODE_PARAMS()
        params.fn = self._run_fn
        params.userData = key
        (node,) = self._call("cuGraphAddHostNode", name, d.cuGraphAddHostNode, graph, deps,
                             num_deps, params)
        self._call("cuStreamUpdateCaptureDependencies", name,
                   d.cuStreamUpdateCaptureDependencies, stream, [node], None, 1,
                   d.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES)

    # ---- native host functions ----

    def launch_native(self, call: NativeCall) -> None:
        """Enqueue the C function ``call.fn(call.user_data)`` on the current stream (see the
        module docstring); a retain done here is undone with release if the driver refuses."""
        d = self._drv()
        name = f"<native {call.fn:#x}>"
        handle, stream, capture = self._capture_state(d, name)
        if capture is None:
            self._launch_native_eager(handle, call, name)
        else:
            self._add_native_captured(d, stream, *capture, call, name)

    def _raw_launch_host_func(self, name: str) -> Any:
        if self._raw_launch is None:
            d = self._drv()
            (version,) = self._call("cuDriverGetVersion", name, d.cuDriverGetVersion)
            address, _status = self._call("cuGetProcAddress", name, d.cuGetProcAddress,
                                          b"cuLaunchHostFunc", int(version),
                                          _GET_PROC_ADDRESS_LEGACY_STREAM)
            if not address:
                raise HostFuncLaunchError("cuGetProcAddress", _status, name,
                                          "the driver has no cuLaunchHostFunc")
            self._raw_launch = _LAUNCH_HOST_FUNC(int(address))
        return self._raw_launch

    def _launch_native_eager(self, handle: int, call: NativeCall, name: str) -> None:
        raw = self._raw_launch_host_func(name)
        if call.retain:
            call_c(call.retain, call.user_data)
        err = raw(handle, call.fn, call.user_data)  # GIL released during the foreign call
        if err != _SUCCESS:
            if call.release:
                call_c(call.release, call.user_data)
            raise HostFuncLaunchError("cuLaunchHostFunc", err, name)
        with self._lock:
            self._launched_on.add(handle)
        if call.release:
            err = raw(handle, call.release, call.user_data)
            if err != _SUCCESS:  # fn is enqueued: release now would free what it still uses
                raise HostFuncLaunchError(
                    "cuLaunchHostFunc", err, name, "fn was enqueued but its release was not; "
                    "user_data keeps the reference that retain took")

    def _add_native_captured(self, d: Any, stream: Any, graph: Any, deps: Any, edges: Any,
                             num_deps: int, call: NativeCall, name: str) -> None:
        for edge in edges or ():  # (as for Python callbacks: see _add_captured)
            if edge.from_port or edge.to_port or edge.type:
                raise HostFuncLaunchError("cuStreamGetCaptureInfo", "non-default edge data",
                                          name, "host nodes cannot follow programmatic edges")
        if call.retain:
            call_c(call.retain, call.user_data)
            try:
                (obj,) = self._call(
                    "cuUserObjectCreate", name, d.cuUserObjectCreate, call.user_data,
                    d.CUhostFn(call.release), 1,
                    d.CUuserObject_flags.CU_USER_OBJECT_NO_DESTRUCTOR_SYNC)
            except BaseException:
                call_c(call.release, call.user_data)
                raise
            try:
                self._call("cuGraphRetainUserObject", name, d.cuGraphRetainUserObject, graph,
                           obj, 1, d.CUuserObjectRetain_flags.CU_GRAPH_USER_OBJECT_MOVE)
            except BaseException:
                d.cuUserObjectRelease(obj, 1)  # its destructor is release
                raise
        # The graph owns user_data's reference from here on; a failure leaves it to the graph.
        params = d.CUDA_HOST_NODE_PARAMS()
        params.fn = d.CUhostFn(call.fn)
        params.userData = call.user_data
        (node,) = self._call("cuGraphAddHostNode", name, d.cuGraphAddHostNode, graph, deps,
                             num_deps, params)
        self._call("cuStreamUpdateCaptureDependencies", name,
                   d.cuStreamUpdateCaptureDependencies, stream, [node], None, 1,
                   d.CUstreamUpdateCaptureDependencies_flags.CU_STREAM_SET_CAPTURE_DEPENDENCIES)

    def is_capturing(self) -> bool:
        """True while the current stream is in a capture sequence (active or invalidated)."""
        d = self._drv()
        return self._capture_status(d.CUstream(self._stream_of()), "<is_capturing>") != int(
            d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)

    def wait_all(self, timeout: float | None) -> None:
        """Wait for the current stream and every stream launched on since the last drain.

        A no-op while the current stream captures. Streams that are capturing are skipped (a
        wait on them would invalidate their capture). The bindings release the GIL in
        ``cuStreamSynchronize``; with a ``timeout`` the streams are polled with
        ``cuStreamQuery`` and ``time.sleep`` instead, which release it too.
        """
        d = self._drv()
        current = self._stream_of()
        none = int(d.CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)
        if self._capture_status(d.CUstream(current), "<drain>") != none:
            return
        with self._lock:
            handles = self._launched_on | {current}
        deadline = None if timeout is None else time.monotonic() + timeout
        for handle in handles:
            stream = d.CUstream(handle)
            try:
                if self._capture_status(stream, "<drain>") != none:
                    continue
                self._wait(d, stream, handle, deadline, timeout)
            except HostFuncLaunchError as exc:
                # A stream launched on earlier may since have been destroyed by its owner.
                if handle == current or exc.code != _INVALID_HANDLE:
                    raise
        with self._lock:
            self._launched_on -= handles

    def _wait(self, d: Any, stream: Any, handle: int, deadline: float | None,
              timeout: float | None) -> None:
        if deadline is None:
            self._call("cuStreamSynchronize", "<drain>", d.cuStreamSynchronize, stream)
            return
        while True:
            (err,) = d.cuStreamQuery(stream)
            if int(err) == _SUCCESS:
                return
            if int(err) != _NOT_READY:
                raise HostFuncLaunchError("cuStreamQuery", err, "<drain>")
            if time.monotonic() >= deadline:
                raise HostFuncTimeoutError(f"CUDA stream {handle:#x}", timeout or 0.0)
            time.sleep(_POLL_S)
