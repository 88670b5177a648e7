"""Native host functions on a real CUDA device: the GIL window, replay counts and lifetimes.

The issue's test on CUDA: a device stand-in for a forward (``torch.cuda._sleep``, about 300 ms)
followed by a native timestamp, captured in a ``torch.cuda.CUDAGraph`` and replayed (and eager),
while another Python thread holds the GIL for 2 s; the timestamp must land inside that window.
The same with a Python callback must land after it (so the test can fail).

Skipped with a reason where no CUDA device (or no CUDA build of torch) is present, or no C
compiler builds the test functions. Each scenario runs in a subprocess with a timeout, so a
deadlock fails instead of hanging tools/gpu_check.sh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from test_hostfunc_gpu import _no_gpu_reason

SUBPROCESS_TIMEOUT_S = 60


def _reason() -> str | None:
    reason = _no_gpu_reason()
    if reason is None and shutil.which(os.environ.get("CC") or "cc") is None:
        reason = "no C compiler ($CC, else cc) to build hostfunc's native test functions"
    return reason


_REASON = _reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]

PRELUDE = r'''
import ctypes, json, threading, time
import torch
import hostfunc
from hostfunc.native import test_functions

fns = test_functions()
torch.cuda.init()
MS = 1_000_000


def sleep_cycles_for(ms):
    """torch.cuda._sleep cycles that take about `ms` milliseconds on this device."""
    torch.cuda._sleep(1_000_000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(50_000_000)
    end.record()
    torch.cuda.synchronize()
    return int(50_000_000 * ms / start.elapsed_time(end))


def hold_gil_for_2s():
    """Hold the GIL on another thread for 2 s (libc sleep through PyDLL keeps it); the window
    in CLOCK_MONOTONIC ns, from a stamp taken holding the GIL to 2 s later."""
    window = []

    def hold():
        libc = ctypes.PyDLL(None)
        window.append(time.monotonic_ns())
        libc.sleep(2)
        window.append(time.monotonic_ns())

    t = threading.Thread(target=hold)
    t.start()
    t.join(30)
    assert len(window) == 2 and window[1] - window[0] >= 2_000_000_000
    return window[0], window[0] + 2_000_000_000


def done(**result):
    print("RESULT " + json.dumps(result))


CYCLES = sleep_cycles_for(300)
'''


def _run(body: str) -> dict:
    code = PRELUDE + textwrap.dedent(body)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"subprocess hung for {SUBPROCESS_TIMEOUT_S}s (deadlock?):\n"
                    f"{exc.stdout}\n{exc.stderr}")
    assert proc.returncode == 0, f"script failed:\n{proc.stdout}\n{proc.stderr}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"script printed no result:\n{proc.stdout}\n{proc.stderr}"
    return json.loads(lines[-1][len("RESULT "):])


def test_native_host_node_completes_while_another_thread_holds_the_gil() -> None:
    """Pins issue 19's window on CUDA: [_sleep ~300 ms, native timestamp] captured in a
    CUDAGraph and replayed, and the same launched eagerly, write the timestamp while another
    thread holds the GIL; with a Python callback in its place the callback runs only after."""
    r = _run("""
        stamp = ctypes.c_int64(0)
        py_stamps = []

        def step(native):
            torch.cuda._sleep(CYCLES)
            if native:
                hostfunc.launch_native(fns.timestamp_ns, ctypes.addressof(stamp))
            else:
                hostfunc.launch(lambda: py_stamps.append(time.monotonic_ns()))

        result = {}
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step(True)
        torch.cuda.synchronize()
        stamp.value = 0
        graph.replay()
        start, end = hold_gil_for_2s()
        torch.cuda.synchronize()
        result["graph"] = [start, stamp.value, end]

        stamp.value = 0
        step(True)
        start, end = hold_gil_for_2s()
        torch.cuda.synchronize()
        result["eager"] = [start, stamp.value, end]

        py_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(py_graph):
            step(False)
        torch.cuda.synchronize()
        py_graph.replay()
        start, end = hold_gil_for_2s()
        hostfunc.drain(30)
        result["python"] = [start, py_stamps[-1] if py_stamps else 0, end]
        graph.reset()
        py_graph.reset()
        deadline = time.monotonic() + 10  # the driver hands the Python entry back on its thread
        while hostfunc.live_entries() and time.monotonic() < deadline:
            time.sleep(0.01)
        done(**result)
    """)
    for kind in ("graph", "eager"):
        start, stamp, end = r[kind]
        assert start < stamp < end, f"{kind}: native timestamp outside the GIL window {r[kind]}"
    start, stamp, end = r["python"]
    assert stamp >= end, f"the Python callback ran while the GIL was held: {r['python']}"


def test_native_host_node_replays_and_releases_with_the_graph() -> None:
    """Pins on a real driver: a captured native call runs once per replay (10 replays), retain
    runs once at capture, release once after CUDAGraph.reset() (the user object's destructor,
    on a driver thread); eager with retain/release, each runs once; no registry entry held."""
    r = _run("""
        counts = (ctypes.c_int64 * 3)()
        ud = ctypes.addressof(counts)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hostfunc.launch_native(fns.count_call, ud, retain=fns.count_retain,
                                   release=fns.count_release)
        captured = list(counts)
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
        replayed = list(counts)
        live = hostfunc.live_entries()
        graph.reset()
        deadline = time.monotonic() + 10
        while counts[2] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        after_reset = list(counts)
        eager = (ctypes.c_int64 * 3)()
        hostfunc.launch_native(fns.count_call, ctypes.addressof(eager),
                               retain=fns.count_retain, release=fns.count_release)
        hostfunc.drain(30)
        done(captured=captured, replayed=replayed, after_reset=after_reset, live=live,
             eager=list(eager))
    """)
    assert r["captured"] == [0, 1, 0]
    assert r["replayed"] == [10, 1, 0] and r["live"] == 0
    assert r["after_reset"] == [10, 1, 1], "release did not run once with the graph's end"
    assert r["eager"] == [1, 1, 1]
