"""Measure what a host callback costs through hostfunc; prints, does not assert performance.

    python tools/bench_hostfunc.py [--launches 20000] [--nodes 16] [--replays 500]

Reported per callback, in microseconds:
  * CPU stand-in: enqueue cost of an eager launch, end-to-end (launch + run + drain), and the
    cost per callback of a replayed HostGraph;
  * CUDA (when a device is present): enqueue cost of an eager launch (cuLaunchHostFunc through
    cuda-python), end-to-end, and per host node of a replayed torch CUDA graph.
The "native" rows measure the same for a native host function (hostfunc.launch_native of a C
counter compiled with the CPU stand-in's lane; skipped without a C compiler).
Each section checks that every callback ran exactly as often as it was enqueued.
"""

from __future__ import annotations

import argparse
import ctypes
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import hostfunc


class Counter:
    """The callback under test: as cheap as a Python call gets, so the overhead shows."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


class NativeCounter:
    """A native host function that adds one to a C int64 (``count_call`` of the lane library);
    calling the object launches it."""

    def __init__(self) -> None:
        from hostfunc.native import test_functions

        self.counts = (ctypes.c_int64 * 3)()
        self.fn = test_functions().count_call
        self.user_data = ctypes.addressof(self.counts)

    @property
    def n(self) -> int:
        return int(self.counts[0])

    @n.setter
    def n(self, value: int) -> None:
        self.counts[0] = value

    def __call__(self) -> None:
        hostfunc.launch_native(self.fn, self.user_data)


def python_counter() -> tuple[Counter, Callable[[], None]]:
    counter = Counter()
    return counter, lambda: hostfunc.launch(counter)


def native_counter() -> tuple[NativeCounter, Callable[[], None]]:
    counter = NativeCounter()
    return counter, counter


def us_per(seconds: float, count: int) -> str:
    return f"{seconds / count * 1e6:8.2f} us"


Make = Callable[[], tuple[Any, Callable[[], None]]]


def eager(label: str, launches: int, sync: Callable[[], None],
          make: Make = python_counter) -> None:
    counter, launch = make()
    for _ in range(min(launches, 1000)):  # warm-up: thread start, driver init, caches
        launch()
    hostfunc.drain()
    counter.n = 0
    t0 = time.perf_counter()
    for _ in range(launches):
        launch()
    t1 = time.perf_counter()
    hostfunc.drain()
    sync()
    t2 = time.perf_counter()
    if counter.n != launches:
        raise SystemExit(f"{label}: {counter.n} of {launches} callbacks ran")
    print(f"{label:<11} eager launch (enqueue only)   {us_per(t1 - t0, launches)}  per callback")
    print(f"{label:<11} eager launch + run + drain    {us_per(t2 - t0, launches)}  per callback")


def replay(label: str, nodes: int, replays: int, capture: Callable[[Callable[[], None]], Any],
           run: Callable[[Any], None], sync: Callable[[], None],
           make: Make = python_counter) -> None:
    counter, launch = make()

    def body() -> None:
        for _ in range(nodes):
            launch()

    graph = capture(body)
    run(graph)  # warm-up replay
    hostfunc.drain()
    counter.n = 0
    t0 = time.perf_counter()
    for _ in range(replays):
        run(graph)
    hostfunc.drain()
    sync()
    t1 = time.perf_counter()
    if counter.n != nodes * replays:
        raise SystemExit(f"{label}: {counter.n} of {nodes * replays} replayed callbacks ran")
    print(f"{label:<11} replayed host node ({nodes}/graph) {us_per(t1 - t0, nodes * replays)}"
          f"  per callback ({us_per(t1 - t0, replays).strip()} per replay)")
    reset = getattr(graph, "reset", None)
    if reset is not None:
        reset()


def bench_cpu(args: argparse.Namespace) -> None:
    with hostfunc.use_backend("cpu"):
        eager("cpu", args.launches, lambda: None)

        def capture(body: Callable[[], None]) -> hostfunc.HostGraph:
            graph = hostfunc.HostGraph()
            with hostfunc.capture(graph):
                body()
            return graph

        replay("cpu", args.nodes, args.replays, capture,
               lambda g: g.replay(), lambda: None)
        if native_available():
            eager("cpu native", args.launches, lambda: None, native_counter)
            replay("cpu native", args.nodes, args.replays, capture,
                   lambda g: g.replay(), lambda: None, native_counter)


def native_available() -> bool:
    try:
        from hostfunc.native import test_functions
        test_functions()
    except hostfunc.HostFuncUsageError as exc:
        print(f"native   skipped: {exc}")
        return False
    return True


@contextmanager
def cuda_side_stream() -> Iterator[None]:
    import torch

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        yield


def bench_cuda(args: argparse.Namespace) -> None:
    import torch

    with cuda_side_stream():
        eager("cuda", args.launches, torch.cuda.synchronize)

        def capture(body: Callable[[], None]) -> torch.cuda.CUDAGraph:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                body()
            return graph

        replay("cuda", args.nodes, args.replays, capture,
               lambda g: g.replay(), torch.cuda.synchronize)
        if native_available():
            eager("cuda native", args.launches, torch.cuda.synchronize, native_counter)
            replay("cuda native", args.nodes, args.replays, capture,
                   lambda g: g.replay(), torch.cuda.synchronize, native_counter)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--launches", type=int, default=20000)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--replays", type=int, default=500)
    args = parser.parse_args()

    bench_cpu(args)
    if hostfunc.cuda_available():
        bench_cuda(args)
    else:
        print("cuda     skipped: no CUDA device (or torch is a CPU build)")
    # A reset graph's entries are freed by the driver from its own thread: wait for that
    # before the interpreter shuts down (a callback into a finalizing interpreter ends the
    # calling thread, a driver thread here).
    deadline = time.monotonic() + 30
    while hostfunc.live_entries() and time.monotonic() < deadline:
        time.sleep(0.01)
    live = hostfunc.live_entries()
    print(f"live entries at exit: {live}")


if __name__ == "__main__":
    main()
