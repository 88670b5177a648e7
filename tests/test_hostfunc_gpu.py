"""hostfunc on a real CUDA device: stream order with kernels, replay of captured host nodes,
deadlock-freedom, graph-tied lifetimes, error delivery, and the cuda-python one-shot baseline.

Skipped with a reason where no CUDA device (or no CUDA build of torch) is present. The tests that
could hang or crash (deadlock, the one-shot baseline) run in a subprocess with a timeout.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import time
import weakref

import pytest

WAIT_S = 30.0
SUBPROCESS_TIMEOUT_S = 60  # a hang must not eat gpu_check.sh's test time box


def _no_gpu_reason() -> str | None:
    try:
        from cuda.bindings import runtime
    except Exception as exc:  # noqa: BLE001
        return f"no CUDA device: cuda.bindings.runtime not importable ({exc})"
    err, count = runtime.cudaGetDeviceCount()
    if int(err) != 0:
        return f"no CUDA device: cudaGetDeviceCount returned {getattr(err, 'name', err)}"
    if not count:
        return "no CUDA device: cudaGetDeviceCount reports 0 devices"
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device usable by torch: torch is a CPU build or sees no device"
    return None


_REASON = _no_gpu_reason()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(_REASON is not None, reason=_REASON or "")]


def _wait_for_live(expected: int, timeout: float = WAIT_S) -> int:
    """live_entries() after giving the driver's destructor thread time to hand keys back."""
    import hostfunc

    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        live = hostfunc.live_entries()
        if live == expected or time.monotonic() > deadline:
            return live
        time.sleep(0.01)


def _run(script: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run([sys.executable, "-c", textwrap.dedent(script)],
                              capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"subprocess hung for {SUBPROCESS_TIMEOUT_S}s (deadlock?):\n"
                    f"{exc.stdout}\n{exc.stderr}")


def test_eager_callbacks_run_in_stream_order_with_kernels() -> None:
    """Pins: an eager callback runs after the kernels and copies enqueued before it (it sees
    their results in pinned memory), and device work enqueued after it sees what it wrote."""
    import torch

    import hostfunc

    n = 16
    x = torch.zeros(1, device="cuda")
    seen_host = torch.zeros(n, pin_memory=True)
    written = torch.zeros(n, pin_memory=True)
    out = torch.zeros(n, device="cuda")
    seen_np, written_np = seen_host.numpy(), written.numpy()
    seen: list[tuple[int, float]] = []

    def check(i: int) -> None:
        seen.append((i, float(seen_np[i])))
        written_np[i] = 100 + i

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(n):
            torch.cuda._sleep(200_000)
            x.add_(1)
            seen_host[i].copy_(x[0], non_blocking=True)
            hostfunc.launch(check, i)
            out[i].copy_(written[i], non_blocking=True)
        hostfunc.drain(WAIT_S)
    assert seen == [(i, float(i + 1)) for i in range(n)]
    assert out.cpu().tolist() == [100.0 + i for i in range(n)]
    assert _wait_for_live(0) == 0


def test_captured_pair_replayed_ten_times_runs_ten_times() -> None:
    """Pins: two callbacks launched inside torch.cuda.graph run once per replay (10 replays -> 10
    runs each, in order, with the arguments bound at capture), none during capture; replaying is
    safe past the first replay (cuda-python #790 does not apply)."""
    import torch

    import hostfunc

    holder = {"step": -1}
    log: list[tuple[str, int]] = []
    static = torch.zeros(1, device="cuda")
    graph = torch.cuda.CUDAGraph()
    before = hostfunc.live_entries()
    with torch.cuda.graph(graph):
        assert hostfunc.is_capturing()
        static.add_(1)
        hostfunc.launch(lambda h: log.append(("fetch", h["step"])), holder)
        hostfunc.launch(lambda h: log.append(("build", h["step"])), holder)
    assert not hostfunc.is_capturing()
    assert log == []
    for step in range(10):
        holder["step"] = step
        graph.replay()
        hostfunc.drain(WAIT_S)
    assert log == [(name, s) for s in range(10) for name in ("fetch", "build")]
    assert static.item() == 10.0
    graph.reset()
    assert _wait_for_live(before) == before


def test_second_launch_while_gil_callback_in_flight_does_not_deadlock() -> None:
    """Pins: launching (eager and by replay) while a callback that holds and re-acquires the GIL
    is running completes, and drains/torch synchronizes finish (subprocess, fails on timeout)."""
    proc = _run("""
        import time, torch, hostfunc

        def busy():   # pure Python: holds the GIL, re-acquiring it at each switch interval
            t = time.perf_counter()
            while time.perf_counter() - t < 0.05:
                pass

        done = []
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            for i in range(20):
                hostfunc.launch(busy)
                hostfunc.launch(done.append, i)      # enqueued while busy() may be running
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            hostfunc.launch(busy)
            hostfunc.launch(done.append, "replayed")
        for _ in range(5):
            g.replay()
            hostfunc.launch(done.append, "eager")
        hostfunc.drain(60)
        torch.cuda.synchronize()
        assert done[:20] == list(range(20)), done
        assert done[20:].count("replayed") == 5 and done[20:].count("eager") == 5, done
        g.reset()
        # the driver frees the captured entries from its own thread: let it finish before the
        # interpreter shuts down (a callback into a finalizing interpreter ends that thread)
        deadline = time.monotonic() + 30
        while hostfunc.live_entries() and time.monotonic() < deadline:
            time.sleep(0.01)
        print("OK")
    """)
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


def test_releasing_a_graph_frees_its_entries() -> None:
    """Pins: a captured call's arguments live as long as the graph and die after graph.reset()
    (the user object's destructor hands the keys back; nothing kept until process exit)."""
    import torch

    import hostfunc

    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)
    before = hostfunc.live_entries()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hostfunc.launch(lambda p: None, payload)
    del payload
    for _ in range(3):
        graph.replay()
    hostfunc.drain(WAIT_S)
    gc.collect()
    assert ref() is not None, "the graph's entry died while the graph was alive"
    assert hostfunc.live_entries() == before + 1
    graph.reset()
    assert _wait_for_live(before) == before
    assert ref() is None


def test_exception_in_captured_callback_reaches_the_caller() -> None:
    """Pins: an exception raised by a replayed host node is re-raised by the next drain as
    HostFuncError carrying the function name, traceback text and the original cause."""
    import torch

    import hostfunc

    def explode(step: int) -> None:
        raise ValueError(f"bad step {step}")

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        hostfunc.launch(explode, 3)
    graph.replay()
    with pytest.raises(hostfunc.HostFuncError) as info:
        hostfunc.drain(WAIT_S)
    assert info.value.fn_name.endswith("explode")
    assert isinstance(info.value.__cause__, ValueError)
    assert "bad step" in info.value.traceback
    graph.reset()


def test_cuda_python_one_shot_wrapper_fails_replay_but_hostfunc_does_not() -> None:
    """Pins the reason this package exists: a host function captured through cuda-python's own
    cudaLaunchHostFunc wrapper does not survive replay (its record is freed after the first call:
    the callback is missed, gets a wrong userData, or the process crashes), while the same capture
    through hostfunc runs on every replay. Runs in a subprocess since the baseline may crash."""
    proc = _run("""
        import ctypes, torch, hostfunc
        from cuda.bindings import runtime

        REPLAYS, MAGIC = 5, 0x1234
        calls = []
        CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p)
        cb = CB(lambda ud: calls.append(ud))
        fn = runtime.cudaHostFn_t(ctypes.cast(cb, ctypes.c_void_p).value)
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        libc.malloc.argtypes = [ctypes.c_size_t]
        libc.free.argtypes = [ctypes.c_void_p]

        def churn():   # reuse freed small blocks so a dangling record is overwritten
            blocks = [libc.malloc(size) for size in (16, 24, 32, 48, 64) for _ in range(256)]
            for b in blocks:
                ctypes.memset(b, 0xA5, 16)
                libc.free(b)

        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            stream = torch.cuda.current_stream().cuda_stream
            err, = runtime.cudaLaunchHostFunc(stream, fn, MAGIC)
            assert int(err) == 0, err
        ours = []
        h = torch.cuda.CUDAGraph()
        with torch.cuda.graph(h):
            hostfunc.launch(ours.append, MAGIC)
        print("CAPTURED", flush=True)
        for _ in range(REPLAYS):
            g.replay(); h.replay()
            torch.cuda.synchronize()
            churn()
        hostfunc.drain(60)
        good = sum(1 for ud in calls if ud == MAGIC)
        print("RESULT", good, len(calls), len(ours), flush=True)
    """)
    out = proc.stdout + proc.stderr
    assert "CAPTURED" in proc.stdout, f"the baseline capture itself failed:\n{out}"
    result = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT")]
    if proc.returncode != 0 or not result:
        # The process died during the baseline's replays: replay failed, as this test expects.
        # hostfunc's own replay count is pinned by test_captured_pair_replayed_ten_times_*.
        return
    _, good, total, ours = result[0].split()
    assert int(ours) == 5, out
    assert int(good) < 5 or int(total) != 5, f"the one-shot baseline survived replay:\n{out}"
