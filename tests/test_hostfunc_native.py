"""Native host functions (hostfunc.launch_native): the CPU stand-in's lane and the CUDA call
sequence against the fake libcuda.

CPU stand-in: stream order with Python callbacks interleaved (a shared log both sides write),
synchronize / drain / query / events / inline streams counting native calls, HostGraph replay,
retain/release counts across capture, replay, reset and collection, the lane thread's end, the
library build (cache, no compiler), argument checks, and the GIL window: a native call completes
while another Python thread holds the GIL, where a Python callback cannot.

Fake driver (tests/fake_libcuda/fake_cuda.c, harness of test_hostfunc_fake_driver.py): eager
launches reach the driver's own cuLaunchHostFunc with the raw fn/userData and run without the GIL;
captured launches add host nodes with the raw values, owned by a user object whose destructor is
``release``; a driver failure after retain calls release exactly once.

Every wait has a timeout, so a regression fails instead of hanging the run.
"""

from __future__ import annotations

import ctypes
import gc
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import hostfunc
from hostfunc import HostEvent, HostGraph, HostStream
from hostfunc.lane import AppendArgs
from hostfunc.native import TestFunctions, test_functions

from conftest import threads_named
from gil import LEAD_MS, hold_gil

WAIT_S = 10.0
MS = 1_000_000  # nanoseconds

HAVE_CC = shutil.which(os.environ.get("CC") or "cc") is not None
needs_cc = pytest.mark.skipif(not HAVE_CC, reason="no C compiler ($CC, else cc): the lane "
                              "library cannot be built")


# every test on the CPU stand-in (even on a GPU machine), leaving no hostfunc entries behind
pytestmark = pytest.mark.usefixtures("cpu_stand_in_without_leaks")


@pytest.fixture
def fns() -> TestFunctions:
    if not HAVE_CC:
        pytest.skip("no C compiler ($CC, else cc): the lane library cannot be built")
    return test_functions()


@pytest.fixture
def stream() -> Iterator[HostStream]:
    s = HostStream("native-test")
    yield s
    s.close()


class SharedLog:
    """An int64 log written by native calls (``TestFunctions.append``) and Python callbacks."""

    def __init__(self, size: int = 256) -> None:
        self.log = (ctypes.c_int64 * size)()
        self.length = ctypes.c_int64(0)
        self._args: list[AppendArgs] = []

    def native_args(self, value: int) -> int:
        """``user_data`` for an append of ``value`` (kept alive by this object)."""
        args = AppendArgs(ctypes.cast(self.log, ctypes.POINTER(ctypes.c_int64)),
                          ctypes.pointer(self.length), value)
        self._args.append(args)
        return ctypes.addressof(args)

    def python_append(self, value: int) -> None:
        self.log[self.length.value] = value
        self.length.value += 1

    def values(self) -> list[int]:
        return list(self.log[: self.length.value])


class Counters:
    """int64[3] = {calls, retains, releases}, the ``user_data`` of the count_* functions."""

    def __init__(self) -> None:
        self.array = (ctypes.c_int64 * 3)()
        self.address = ctypes.addressof(self.array)

    def __call__(self) -> tuple[int, int, int]:
        return self.array[0], self.array[1], self.array[2]


def lane_threads() -> set[str]:
    """Ids of this process's running threads named ``hostfunc-lane``."""
    return threads_named("hostfunc-lane")


def new_lane(before: set[str]) -> str | None:
    """The one lane thread started since ``before`` was taken (None: none yet, or more)."""
    started = lane_threads() - before
    return next(iter(started)) if len(started) == 1 else None


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


# ---- ordering ----

def test_native_and_python_calls_keep_stream_order(fns: TestFunctions, stream: HostStream) -> None:
    """Pins the one ordered queue: interleaved native and Python calls write a shared log in
    launch order, whether a native call goes straight to the lane (stream idle in Python) or
    queues behind a slow Python callback, and whether a Python callback follows a slow native
    call (it must wait for the lane)."""
    log = SharedLog()

    def slow_python(value: int) -> None:
        time.sleep(0.03)  # a native call run early would be logged before this
        log.python_append(value)

    with hostfunc.use_stream(stream):
        hostfunc.launch_native(fns.spin_ns, 30 * MS)          # straight to the lane
        hostfunc.launch(log.python_append, 1)                 # must wait for the spin
        hostfunc.launch_native(fns.append, log.native_args(2))
        hostfunc.launch(slow_python, 3)
        hostfunc.launch_native(fns.append, log.native_args(4))  # queued behind slow_python
        hostfunc.launch_native(fns.spin_ns, 20 * MS)
        hostfunc.launch(log.python_append, 5)
        for i in range(6, 40):
            if i % 3:
                hostfunc.launch_native(fns.append, log.native_args(i))
            else:
                hostfunc.launch(log.python_append, i)
    stream.synchronize(WAIT_S)
    assert log.values() == list(range(1, 40))
    # the same again once the stream is idle: the first call goes straight to the lane
    with hostfunc.use_stream(stream):
        hostfunc.launch_native(fns.append, log.native_args(40))
        hostfunc.launch(log.python_append, 41)
    stream.synchronize(WAIT_S)
    assert log.values() == list(range(1, 42))


def test_native_call_on_an_idle_stream_starts_no_python_thread(fns: TestFunctions,
                                                               stream: HostStream) -> None:
    """Pins: a native call on a stream with nothing queued in Python goes straight to the lane
    (no Python worker thread started), and synchronize waits for it."""
    stamp = ctypes.c_int64(0)
    with hostfunc.use_stream(stream):
        hostfunc.launch_native(fns.spin_ns, 50 * MS)
        hostfunc.launch_native(fns.timestamp_ns, ctypes.addressof(stamp))
    assert stream.thread is None
    stream.synchronize(WAIT_S)
    assert stamp.value != 0 and stream.thread is None


# ---- waits, queries, events ----

def test_waits_and_queries_count_native_calls(fns: TestFunctions, stream: HostStream) -> None:
    """Pins: a stream with a native call running is not idle (query False); synchronize and
    drain return only after it; an event recorded behind it is reached only after it, for the
    host and for another stream that waits on it."""
    stamp, after_event = ctypes.c_int64(0), []
    other = HostStream("native-test-other")
    try:
        with hostfunc.use_stream(stream):
            hostfunc.launch_native(fns.spin_ns, LEAD_MS * MS)  # (the asserts below run first)
            hostfunc.launch_native(fns.timestamp_ns, ctypes.addressof(stamp))
        assert not stream.query()
        event = HostEvent()
        event.record(stream)
        assert not event.query()
        other.wait_event(event)
        with hostfunc.use_stream(other):
            hostfunc.launch(lambda: after_event.append(time.monotonic_ns()))
        event.synchronize(WAIT_S)
        assert stamp.value != 0, "the event was reached before the native call returned"
        hostfunc.drain(WAIT_S)
        assert stream.query() and other.query()
        assert after_event and after_event[0] > stamp.value
        # synchronize alone, on a stream whose only work is native
        stamp.value = 0
        with hostfunc.use_stream(stream):
            hostfunc.launch_native(fns.spin_ns, 80 * MS)
            hostfunc.launch_native(fns.timestamp_ns, ctypes.addressof(stamp))
        stream.synchronize(WAIT_S)
        assert stamp.value != 0 and stream.query()
    finally:
        other.close()


def test_synchronize_times_out_on_a_long_native_call(fns: TestFunctions,
                                                     stream: HostStream) -> None:
    """Pins: synchronize's timeout covers native calls (HostFuncTimeoutError, then a full
    wait succeeds)."""
    with hostfunc.use_stream(stream):
        hostfunc.launch_native(fns.spin_ns, 300 * MS)
    with pytest.raises(hostfunc.HostFuncTimeoutError):
        stream.synchronize(0.02)
    stream.synchronize(WAIT_S)
    assert stream.query()


def test_inline_stream_does_not_run_inline_while_a_native_call_runs(fns: TestFunctions) -> None:
    """Pins: with inline_when_idle, launches while the stream is busy are not inline: native
    calls queued behind a running task run on the lane, and a Python launch behind them runs
    on the worker after them; once idle, a Python launch is inline again."""
    stream = HostStream("native-inline", inline_when_idle=True)
    stamp, seen, go = ctypes.c_int64(0), [], threading.Event()
    try:
        stream.enqueue(lambda: go.wait(WAIT_S))  # (a launch would run inline: idle stream)
        with hostfunc.use_stream(stream):
            hostfunc.launch_native(fns.spin_ns, 60 * MS)  # behind the task: to the lane
            hostfunc.launch_native(fns.timestamp_ns, ctypes.addressof(stamp))
            hostfunc.launch(lambda: seen.append((threading.current_thread().name,
                                                 time.monotonic_ns())))
            go.set()
        stream.synchronize(WAIT_S)
        assert stamp.value > 0 and seen[0][0] == stream.name and seen[0][1] > stamp.value
        with hostfunc.use_stream(stream):
            hostfunc.launch(lambda: seen.append((threading.current_thread().name, 0)))
        assert seen[1][0] == threading.current_thread().name
    finally:
        stream.close()


def test_inline_stream_runs_an_eager_native_call_inline_when_idle(fns: TestFunctions) -> None:
    """Pins: with inline_when_idle, an eager native call on an idle stream runs on the
    launching thread (launch_native returns after a 50 ms spin, not before), with the GIL
    released (another thread runs Python meanwhile); on a stream without the option it is
    handed to the lane (the launch returns at once)."""
    ticks: list[int] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.monotonic_ns())
            time.sleep(0.002)

    for inline in (True, False):
        stream = HostStream(f"native-inline-{inline}", inline_when_idle=inline)
        t = threading.Thread(target=ticker)
        try:
            with hostfunc.use_stream(stream):
                stop.clear()
                t.start()
                t0 = time.monotonic_ns()
                hostfunc.launch_native(fns.spin_ns, 50 * MS)
                elapsed = time.monotonic_ns() - t0
                stream.synchronize(WAIT_S)
            stop.set()
            t.join()
            if inline:
                assert elapsed >= 50 * MS
                assert any(t0 < x < t0 + elapsed for x in ticks)  # (the GIL was free)
            else:
                assert elapsed < 40 * MS
        finally:
            stop.set()
            stream.close()


# ---- graphs and lifetimes ----

def test_graph_replay_runs_native_calls_each_time(fns: TestFunctions, stream: HostStream) -> None:
    """Pins: a native call captured into a HostGraph does not run at capture, runs once per
    replay, in order with the captured Python callbacks."""
    counters, log = Counters(), SharedLog(64)
    graph = HostGraph()
    with hostfunc.capture(graph, stream):
        hostfunc.launch_native(fns.count_call, counters.address)
        hostfunc.launch_native(fns.append, log.native_args(1))
        hostfunc.launch(log.python_append, 2)
    assert counters() == (0, 0, 0) and graph.num_callbacks == 3
    for _ in range(7):
        graph.replay(stream)
    stream.synchronize(WAIT_S)
    assert counters()[0] == 7
    assert log.values() == [1, 2] * 7
    graph.reset()


def test_captured_copy_reads_its_source_at_each_replay(stream: HostStream) -> None:
    """copy_function captured into a HostGraph (its arguments kept by keep_alive) copies at
    each replay from the source as it is then, in order with the graph's Python callbacks;
    the kept arguments go with reset()."""
    import weakref

    import numpy as np

    from hostfunc.native import NativeCall, copy_function
    src = np.arange(4, dtype=np.int32)
    dst = np.zeros(4, dtype=np.int32)
    seen: list[list[int]] = []
    args = np.array([dst.ctypes.data, src.ctypes.data, dst.nbytes], dtype=np.uint64)
    graph = HostGraph()
    with hostfunc.capture(graph, stream):
        graph.keep_alive(args)
        graph.add_native(NativeCall(copy_function(), args.ctypes.data))
        hostfunc.launch(lambda: seen.append(dst.tolist()))
    assert dst.tolist() == [0, 0, 0, 0]  # (not at capture)
    for k in range(3):
        src[:] = np.arange(4) * (k + 1)
        graph.replay(stream)
        stream.synchronize(WAIT_S)
    assert seen == [[0, 1, 2, 3], [0, 2, 4, 6], [0, 3, 6, 9]]
    kept = weakref.ref(args)
    del args
    assert kept() is not None  # (the graph holds it)
    graph.reset()
    gc.collect()
    assert kept() is None


def test_back_to_back_replays_keep_order_with_mixed_steps(fns: TestFunctions,
                                                          stream: HostStream) -> None:
    """Pins order when native calls queue behind Python work (replays launched back to back:
    consecutive native steps are handed to the lane together): 50 replays of [Python, native,
    native, Python, native] log exactly that sequence 50 times."""
    log = SharedLog(512)
    graph = HostGraph()
    with hostfunc.capture(graph, stream):
        hostfunc.launch(log.python_append, 1)
        hostfunc.launch_native(fns.append, log.native_args(2))
        hostfunc.launch_native(fns.append, log.native_args(3))
        hostfunc.launch(log.python_append, 4)
        hostfunc.launch_native(fns.append, log.native_args(5))
    for _ in range(50):
        graph.replay(stream)
    stream.synchronize(WAIT_S)
    assert log.values() == [1, 2, 3, 4, 5] * 50
    graph.reset()


def test_retain_and_release_follow_the_graph(fns: TestFunctions, stream: HostStream) -> None:
    """Pins the lifetime contract: retain once at capture; replays call neither; release once
    at reset (deferred until a replay in flight has finished) or at collection; eager, retain
    at launch and release right after the call; no registry entry is held."""
    live = hostfunc.live_entries()
    a = Counters()
    graph = HostGraph()
    with hostfunc.capture(graph, stream):
        hostfunc.launch_native(fns.spin_ns, LEAD_MS // 3 * MS)
        hostfunc.launch_native(fns.count_call, a.address, retain=fns.count_retain,
                               release=fns.count_release)
    assert a() == (0, 1, 0) and hostfunc.live_entries() == live
    for _ in range(3):
        graph.replay(stream)
    graph.reset()  # replays still in flight (LEAD_MS of spin queued): release waits for them
    assert a()[2] == 0
    stream.synchronize(WAIT_S)
    assert wait_until(lambda: a() == (3, 1, 1)), a()

    b = Counters()
    graph = HostGraph()
    with hostfunc.capture(graph, stream):
        hostfunc.launch_native(fns.count_call, b.address, retain=fns.count_retain,
                               release=fns.count_release)
    graph.replay(stream)
    stream.synchronize(WAIT_S)
    assert b() == (1, 1, 0)
    del graph
    gc.collect()
    assert b() == (1, 1, 1)

    c = Counters()
    with hostfunc.use_stream(stream):
        hostfunc.launch_native(fns.spin_ns, 50 * MS)
        hostfunc.launch_native(fns.count_call, c.address, retain=fns.count_retain,
                               release=fns.count_release)
        assert c()[1:] == (1, 0)
    stream.synchronize(WAIT_S)
    assert c() == (1, 1, 1) and hostfunc.live_entries() == live


def test_close_ends_the_lane_after_its_calls(fns: TestFunctions) -> None:
    """Pins: a stream's first native call starts one lane thread; close() returns after the
    queued native calls ran and the lane thread ended; later launches raise; a collected stream
    whose lane runs ends the lane by itself."""
    before = lane_threads()
    stream = HostStream("native-close")
    stamp = ctypes.c_int64(0)
    with hostfunc.use_stream(stream):
        hostfunc.launch(lambda: None)
        hostfunc.launch_native(fns.spin_ns, 80 * MS)
        hostfunc.launch_native(fns.timestamp_ns, ctypes.addressof(stamp))
    assert wait_until(lambda: new_lane(before) is not None)  # (it names itself on start)
    lane = new_lane(before)
    stream.close()
    assert stamp.value != 0, "close returned before the lane's calls ran"
    assert wait_until(lambda: lane not in lane_threads())
    with pytest.raises(hostfunc.HostFuncUsageError, match="closed"), hostfunc.use_stream(stream):
        hostfunc.launch_native(fns.spin_ns, 0)

    dropped = HostStream("native-dropped")
    before = lane_threads()
    with hostfunc.use_stream(dropped):
        hostfunc.launch_native(fns.spin_ns, 50 * MS)  # lane only, no Python worker thread
    assert wait_until(lambda: new_lane(before) is not None)
    lane = new_lane(before)
    del dropped
    gc.collect()
    assert wait_until(lambda: lane not in lane_threads()), "the dropped stream's lane lives on"


def test_close_while_another_thread_waits_on_the_lane(fns: TestFunctions) -> None:
    """Pins: closing a stream (no Python worker, lane only) while another thread synchronizes
    on it lets both return once the native calls ran; the closed stream still answers query
    and synchronize (the lane is freed only when nothing refers to it)."""
    stream = HostStream("native-close-race")
    stamp = ctypes.c_int64(0)
    with hostfunc.use_stream(stream):
        hostfunc.launch_native(fns.spin_ns, 150 * MS)
        hostfunc.launch_native(fns.timestamp_ns, ctypes.addressof(stamp))
    waited: list[int] = []
    waiter = threading.Thread(target=lambda: (stream.synchronize(WAIT_S),
                                              waited.append(stamp.value)))
    waiter.start()
    time.sleep(0.02)
    stream.close()
    waiter.join(WAIT_S)
    assert waited and waited[0] != 0 and stamp.value != 0
    assert stream.query()
    stream.synchronize(WAIT_S)


@needs_cc
def test_process_with_live_lanes_exits_cleanly() -> None:
    """Pins the exit path: a process that leaves 20 streams with lanes (idle and busy) alive
    exits with status 0, three times over (freeing a lane at exit while its stream could still
    close it crashed or hung such a process)."""
    code = """
        import hostfunc
        from hostfunc.native import test_functions
        fns = test_functions()
        streams = [hostfunc.HostStream(f"s{i}") for i in range(20)]
        with hostfunc.use_backend("cpu"):
            for i, s in enumerate(streams):
                with hostfunc.use_stream(s):
                    hostfunc.launch_native(fns.spin_ns, (i % 3) * MS)
        print("OK")
    """.replace("MS", str(MS))
    for _ in range(3):
        proc = _run(code, {})
        assert proc.returncode == 0 and "OK" in proc.stdout, (proc.returncode, proc.stderr)


# ---- the GIL window ----

def test_native_call_completes_while_another_thread_holds_the_gil(
        fns: TestFunctions, stream: HostStream) -> None:
    """Pins the point of native host functions (issue 19, CPU stand-in): a HostGraph of
    [native spin of LEAD_MS ms, native timestamp] replayed right before another thread holds
    the GIL for 2 s writes its timestamp inside that window."""
    stamp = ctypes.c_int64(0)
    graph = HostGraph()
    with hostfunc.capture(graph, stream):
        hostfunc.launch_native(fns.spin_ns, LEAD_MS * MS)
        hostfunc.launch_native(fns.timestamp_ns, ctypes.addressof(stamp))
    graph.replay(stream)
    start, end = hold_gil(2, WAIT_S)
    stream.synchronize(WAIT_S)
    assert start < stamp.value < end, (start, stamp.value, end)
    graph.reset()


def test_python_callback_waits_for_the_gil_holder(fns: TestFunctions, stream: HostStream) -> None:
    """Pins that the GIL-window test can fail: the same graph with a Python callback in place
    of the native timestamp runs the callback only after the holder let go of the GIL."""
    stamps: list[int] = []
    graph = HostGraph()
    with hostfunc.capture(graph, stream):
        hostfunc.launch_native(fns.spin_ns, LEAD_MS * MS)
        hostfunc.launch(lambda: stamps.append(time.monotonic_ns()))
    graph.replay(stream)
    start, end = hold_gil(2, WAIT_S)
    stream.synchronize(WAIT_S)
    assert stamps and stamps[0] >= end, (start, stamps, end)
    graph.reset()


# ---- arguments, backends, the build ----

@pytest.mark.parametrize("kwargs, match", [
    (dict(fn=0, user_data=0), "fn must be a nonzero"),
    (dict(fn=True, user_data=0), "fn must be a C function address"),
    (dict(fn="0x10", user_data=0), "fn must be a C function address"),
    (dict(fn=2 ** 64, user_data=0), "fn must be a nonzero pointer-sized"),
    (dict(fn=16, user_data=-1), "user_data must be a pointer-sized int"),
    (dict(fn=16, user_data=1.5), "user_data must be a pointer-sized int"),
    (dict(fn=16, user_data=0, retain=16), "retain was given without release"),
    (dict(fn=16, user_data=0, release=16), "release was given without retain"),
    (dict(fn=16, user_data=0, retain=0, release=16), "retain must be a nonzero"),
    (dict(fn=16, user_data=0, retain=16, release=None), "retain was given without release"),
])
def test_bad_arguments_raise_usage_errors(kwargs: dict, match: str) -> None:
    """Pins: non-int or zero addresses, a user_data that is no pointer-sized int and a lone
    retain/release are HostFuncUsageError naming the argument; nothing is enqueued."""
    with pytest.raises(hostfunc.HostFuncUsageError, match=match):
        hostfunc.launch_native(**kwargs)


def test_backend_without_native_support_is_named() -> None:
    """Pins: a backend that runs no native functions (an injected one without launch_native)
    gives a HostFuncUsageError naming it, not an AttributeError."""

    class PythonOnly:
        name = "python-only"

        def launch(self, fn, args, kwargs):  # type: ignore[no-untyped-def]
            fn(*args, **kwargs)

        def is_capturing(self) -> bool:
            return False

        def wait_all(self, timeout: float | None) -> None:
            pass

    with hostfunc.use_backend(PythonOnly()), pytest.raises(
            hostfunc.HostFuncUsageError, match="python-only"):
        hostfunc.launch_native(16, 0)


def _run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_without_a_compiler_native_launch_says_why(tmp_path: Path) -> None:
    """Pins: with no C compiler the CPU stand-in's launch_native raises HostFuncUsageError
    naming the missing compiler and $CC, nothing is retained, and Python callbacks still run."""
    proc = _run("""
        import ctypes, hostfunc
        counts = (ctypes.c_int64 * 3)()
        ran = []
        with hostfunc.use_backend("cpu"):
            try:
                hostfunc.launch_native(16, ctypes.addressof(counts), retain=16, release=16)
                print("NO ERROR")
            except hostfunc.HostFuncUsageError as exc:
                print("ERROR", exc)
            hostfunc.launch(ran.append, 1)
            hostfunc.drain(10)
        print("RAN", ran)
    """, {"CC": str(tmp_path / "no-such-cc"), "HOSTFUNC_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert "ERROR" in proc.stdout and "no-such-cc" in proc.stdout and "$CC" in proc.stdout
    assert "RAN [1]" in proc.stdout


@needs_cc
def test_lane_library_is_built_once_into_the_cache(tmp_path: Path) -> None:
    """Pins the build cache: two processes building at once into an empty
    $HOSTFUNC_CACHE_DIR leave exactly one library and no temporary files; a third process
    loads it without compiling (its mtime is unchanged)."""
    cache = tmp_path / "cache"
    code = """
        import ctypes, hostfunc
        from hostfunc.lane import lane_library
        from hostfunc.native import test_functions
        stamp = ctypes.c_int64(0)
        with hostfunc.use_backend("cpu"):
            hostfunc.launch_native(test_functions().timestamp_ns, ctypes.addressof(stamp))
            hostfunc.drain(10)
        print("OK", stamp.value > 0, lane_library()._name)
    """
    env = {"HOSTFUNC_CACHE_DIR": str(cache)}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], text=True,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              env={**os.environ, **env}) for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0 and "OK True" in out, err
    built = sorted(cache.iterdir())
    assert [f.suffix for f in built] == [".so"] and built[0].name.startswith("lane-"), built
    mtime = built[0].stat().st_mtime_ns
    third = _run(code, env)
    assert third.returncode == 0 and str(built[0]) in third.stdout, third.stderr
    assert built[0].stat().st_mtime_ns == mtime and sorted(cache.iterdir()) == built


# ---- CUDA call sequence against the fake libcuda ----

from test_hostfunc_fake_driver import calls, fake_libcuda, names, run_script  # noqa: E402,F401

needs_gcc = pytest.mark.skipif(shutil.which("gcc") is None,
                               reason="gcc not found: cannot build the fake libcuda")

PROBE = """
class FakeProbe(ctypes.Structure):
    _fields_ = [(n, ctypes.c_int64) for n in ("calls", "calls_with_gil", "retains", "releases")]

def addr(name):
    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value

CALL = addr("fake_probe_call")
RETAIN, RELEASE = addr("fake_probe_retain"), addr("fake_probe_release")
probe = FakeProbe()
UD = ctypes.addressof(probe)

def counts():
    return [probe.calls, probe.calls_with_gil, probe.retains, probe.releases]
"""


def run_probe(lib: Path, body: str) -> dict:
    """run_script with the probe (fake_probe_* functions and their counters) defined."""
    return run_script(lib, PROBE + textwrap.dedent(body))


@needs_gcc
def test_fake_eager_native_launch_reaches_the_raw_driver_entry(fake_libcuda: Path) -> None:
    """Pins the eager CUDA route: launch_native calls the driver's own cuLaunchHostFunc
    (resolved through cuGetProcAddress) with the raw fn and userData, the GIL released; fn runs
    without the GIL, in stream order with Python callbacks; a retain/release pair brackets the
    one run (release launched right behind fn); drain waits; no registry entry is held."""
    r = run_probe(fake_libcuda, """
        seen = []
        with hostfunc.use_backend(backend):
            hostfunc.launch_native(CALL, UD)
            hostfunc.launch(lambda: seen.append(probe.calls))
            hostfunc.launch_native(CALL, UD, retain=RETAIN, release=RELEASE)
            live = hostfunc.live_entries()
            after_launch = counts()
            hostfunc.drain()
            done(seen=seen, live=live, after_launch=after_launch, counts=counts(),
                 call=CALL, release=RELEASE, ud=UD, live_end=hostfunc.live_entries())
    """)
    assert r["seen"] == [1], "the Python callback did not run between the two native calls"
    # retained at launch; the release may already have run (the fake's eager launches run on
    # threads of their own), but once at most
    assert r["after_launch"][2] == 1 and r["after_launch"][3] in (0, 1)
    assert r["counts"] == [2, 0, 1, 1], "fn ran with the GIL held, or release did not run"
    assert r["live_end"] == 0 and r["live"] <= 1  # (the Python callback's entry, if pending)
    launches = calls(r["log"], "cuLaunchHostFunc")
    assert len(launches) == 4
    native = [c for c in launches if int(c["fn"], 16) in (r["call"], r["release"])]
    assert [int(c["fn"], 16) for c in native] == [r["call"], r["call"], r["release"]]
    assert all(int(c["userData"], 16) == r["ud"] for c in native), "userData not passed raw"
    assert all(c["gil"] == "0" and c["stream"] == "0x5000" for c in launches)
    assert calls(r["log"], "cuStreamSynchronize"), "drain did not wait for the stream"


@needs_gcc
def test_fake_captured_native_launch_adds_a_raw_host_node(fake_libcuda: Path) -> None:
    """Pins the captured CUDA route: retain runs once at capture; with retain/release the
    sequence is GetCaptureInfo -> UserObjectCreate(user_data, release) -> RetainUserObject(MOVE)
    -> AddHostNode(raw fn, raw userData) -> UpdateCaptureDependencies, without them no user
    object; replays run fn each time without the GIL; the graph's destruction calls release
    once; no registry entry is held."""
    r = run_probe(fake_libcuda, """
        with hostfunc.use_backend(backend):
            lib.fake_begin_capture(STREAM, GRAPH)
            hostfunc.launch_native(CALL, UD, retain=RETAIN, release=RELEASE)
            hostfunc.launch_native(CALL, UD)
            lib.fake_end_capture()
            captured, live = counts(), hostfunc.live_entries()
            lib.fake_replay(GRAPH, 4)
            replayed = counts()
            lib.fake_destroy_graph(GRAPH)
            done(captured=captured, live=live, replayed=replayed, destroyed=counts(),
                 call=CALL, release=RELEASE, ud=UD)
    """)
    assert r["captured"] == [0, 0, 1, 0] and r["live"] == 0
    assert r["replayed"] == [8, 0, 1, 0], "replays must run both nodes, without the GIL"
    assert r["destroyed"] == [8, 0, 1, 1]
    log = r["log"]
    seq = [n for n in names(log) if n.startswith("cu") and n not in ("cuInit",
                                                                     "cuStreamIsCapturing")]
    assert seq == ["cuStreamGetCaptureInfo_v3", "cuUserObjectCreate", "cuGraphRetainUserObject",
                   "cuGraphAddHostNode", "cuStreamUpdateCaptureDependencies_v2",
                   "cuStreamGetCaptureInfo_v3", "cuGraphAddHostNode",
                   "cuStreamUpdateCaptureDependencies_v2"]
    (obj,) = calls(log, "cuUserObjectCreate")
    assert int(obj["ptr"]) == r["ud"] and int(obj["destroy"], 16) == r["release"]
    assert obj["flags"] == "1"                                    # NO_DESTRUCTOR_SYNC
    (retain,) = calls(log, "cuGraphRetainUserObject")
    assert retain["obj"] == obj["obj"] and retain["flags"] == "1"  # MOVE
    nodes = calls(log, "cuGraphAddHostNode")
    assert all(int(n["fn"], 16) == r["call"] and int(n["userData"]) == r["ud"] for n in nodes)
    assert nodes[1]["deps"] == f"[{nodes[0]['node']}]"
    assert not calls(log, "cuLaunchHostFunc")


@needs_gcc
@pytest.mark.parametrize("failing, capture, released_at_once", [
    ("cuLaunchHostFunc", False, 1),
    ("cuUserObjectCreate", True, 1),
    ("cuGraphRetainUserObject", True, 1),
    ("cuGraphAddHostNode", True, 0),
])
def test_fake_driver_failure_after_retain_releases_once(
        fake_libcuda: Path, failing: str, capture: bool, released_at_once: int) -> None:
    """Pins: a driver refusal raises HostFuncLaunchError naming the call; a retain already
    done is undone by exactly one release, at once where the graph does not own it yet, with
    the graph's destruction where it does (cuGraphAddHostNode fails after the MOVE)."""
    r = run_probe(fake_libcuda, f"""
        with hostfunc.use_backend(backend):
            if {capture}:
                lib.fake_begin_capture(STREAM, GRAPH)
            lib.fake_fail({failing!r}.encode(), 999)
            try:
                hostfunc.launch_native(CALL, UD, retain=RETAIN, release=RELEASE)
                err = None
            except hostfunc.HostFuncLaunchError as e:
                err = dict(call=e.call, code=e.code)
            at_once = counts()
            lib.fake_end_capture()
            lib.fake_destroy_graph(GRAPH)
            hostfunc.drain()
            done(err=err, at_once=at_once, end=counts())
    """)
    assert r["err"] == {"call": failing, "code": 999}
    assert r["at_once"] == [0, 0, 1, released_at_once]
    assert r["end"] == [0, 0, 1, 1], "release must run exactly once"
