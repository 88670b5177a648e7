"""hostfunc: Python callables as host callbacks on streams, replay-safe inside captured graphs.

On CUDA the callbacks go through cuda-python's driver bindings (a captured launch adds the host
node itself and ties the callable's lifetime to the graph with a CUDA user object); without a GPU
the same API runs on a CPU stand-in (HostStream / HostEvent / HostGraph). A HostStream made with
``inline_when_idle=True`` runs a launch on an idle stream (a native one too) on the launching
thread instead of its worker (for callbacks that hand their heavy work to threads of their own).

:func:`launch_native` enqueues a C function ``void fn(void *user_data)`` (by address) in the same
stream order: the CUDA driver calls it directly as a host node, the CPU stand-in on the stream's
native lane (a C thread built from ``hostfunc/csrc/lane.c`` on first use). No Python and no GIL
are on the stream's path, so it completes while another thread holds the GIL and no GIL/driver
deadlock can form around it; in exchange hostfunc cannot see its errors, and ``user_data`` lives
as the caller keeps it, or as long as the graph with ``retain``/``release``.

Importing this package loads no CUDA library, no ctypes, and touches no device.

    import hostfunc

    @hostfunc.hostfunc
    def build(batch): ...

    build(batch)            # enqueued on the current stream
    hostfunc.launch_native(lib_fn_address, state_address)   # a C function, no GIL
    hostfunc.drain()        # waits for both; re-raises what build raised as HostFuncError
"""

from .api import (
    HostFunction,
    add_drain_hook,
    check_errors,
    drain,
    hostfunc,
    is_capturing,
    launch,
    launch_native,
    live_entries,
    record_error,
    remove_drain_hook,
    synchronize,
)
from .backend import active_backend, cuda_available, use_backend
from .errors import (
    HostFuncBaseError,
    HostFuncError,
    HostFuncLaunchError,
    HostFuncTimeoutError,
    HostFuncUsageError,
)
from .host_graph import HostGraph, capture
from .host_stream import HostEvent, HostStream, current_stream, use_stream

__all__ = [
    "launch",
    "launch_native",
    "add_drain_hook",
    "remove_drain_hook",
    "record_error",
    "hostfunc",
    "HostFunction",
    "drain",
    "synchronize",
    "check_errors",
    "is_capturing",
    "live_entries",
    "HostStream",
    "HostEvent",
    "HostGraph",
    "use_stream",
    "current_stream",
    "capture",
    "active_backend",
    "cuda_available",
    "use_backend",
    "HostFuncBaseError",
    "HostFuncError",
    "HostFuncLaunchError",
    "HostFuncTimeoutError",
    "HostFuncUsageError",
]
