"""hostfunc on the CPU stand-in: HostStream ordering, HostEvent, HostGraph capture/replay,
errors at the drain, the drain's waiting rules, and entry lifetimes (no leaks).

Every wait has a timeout, so a regression fails instead of hanging the run.
"""

from __future__ import annotations

import gc
import subprocess
import sys
import threading
import time
import weakref

import pytest

import hostfunc
from hostfunc import HostEvent, HostGraph, HostStream
from hostfunc.host_stream import explicit_stream

WAIT_S = 10.0


# every test on the CPU stand-in (even on a GPU machine), leaving no hostfunc entries behind
pytestmark = pytest.mark.usefixtures("cpu_stand_in_without_leaks")


class Gate:
    """A callback that blocks until opened (with a timeout, so nothing hangs forever)."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.passed = threading.Event()

    def __call__(self) -> None:
        assert self.opened.wait(WAIT_S), "gate never opened"
        self.passed.set()


def test_many_launches_run_in_order_on_a_worker_thread() -> None:
    """Pins: callbacks run in launch order, on the stream's worker thread, each once."""
    seen: list[int] = []
    threads: set[str] = set()

    def record(i: int) -> None:
        seen.append(i)
        threads.add(threading.current_thread().name)

    for i in range(2000):
        hostfunc.launch(record, i)
    hostfunc.drain(WAIT_S)
    assert seen == list(range(2000))
    assert threads == {hostfunc.current_stream().name}
    assert threading.current_thread().name not in threads


def test_decorator_enqueues_functions_and_methods() -> None:
    """Pins: @hostfunc makes calls enqueue (return None) for plain functions and methods, with
    the instance bound; keyword arguments are passed through; __wrapped__ is the plain function."""
    log: list[tuple[str, int]] = []

    @hostfunc.hostfunc
    def plain(x: int, *, tag: str) -> str:
        log.append((tag, x))
        return "ignored"

    class Decoder:
        def __init__(self) -> None:
            self.built = 0

        @hostfunc.hostfunc
        def build(self, n: int) -> None:
            self.built += n
            log.append(("build", n))

    dec = Decoder()
    assert plain(1, tag="p") is None
    assert dec.build(2) is None
    assert isinstance(Decoder.build, hostfunc.HostFunction)
    hostfunc.drain(WAIT_S)
    assert log == [("p", 1), ("build", 2)] and dec.built == 2
    assert plain.__wrapped__(3, tag="now") == "ignored" and log[-1] == ("now", 3)
    assert plain.__name__ == "plain"


def test_events_order_work_between_two_streams() -> None:
    """Pins: stream B's work after B.wait_event(e) runs only after the work recorded before
    e.record(A); query() is False while the marker is pending; synchronize waits for it."""
    a, b = HostStream("A"), HostStream("B")
    order: list[str] = []
    gate = Gate()
    event = HostEvent()
    with hostfunc.use_stream(a):
        hostfunc.launch(gate)
        hostfunc.launch(order.append, "a")
        event.record()
    b.wait_event(event)
    with hostfunc.use_stream(b):
        hostfunc.launch(order.append, "b")
    time.sleep(0.05)
    assert order == [] and not event.query() and not b.query()
    gate.opened.set()
    event.synchronize(WAIT_S)
    b.synchronize(WAIT_S)
    assert order == ["a", "b"] and event.query() and b.query()


def test_event_wait_before_any_record_does_not_block() -> None:
    """Pins: waiting on a never-recorded event is a no-op (CUDA semantics)."""
    s = HostStream()
    done: list[int] = []
    HostEvent().wait(s)
    with hostfunc.use_stream(s):
        hostfunc.launch(done.append, 1)
    s.synchronize(WAIT_S)
    assert done == [1]


def test_event_on_an_idle_stream_completes_without_waking_its_thread() -> None:
    """Pins: record() on a stream with nothing queued or running completes the marker at once
    (a CUDA event on an idle stream), without starting the stream's worker thread; a later
    wait() on the reached marker enqueues nothing; a record() behind pending work still waits
    for that work."""
    idle, other = HostStream("idle"), HostStream("other")
    event = HostEvent()
    event.record(idle)
    assert event.query() and idle._worker.thread is None and idle._worker.enqueued == 0
    event.wait(other)
    assert other._worker.enqueued == 0 and other._worker.thread is None
    gate = Gate()
    with hostfunc.use_stream(idle):
        hostfunc.launch(gate)
    event.record(idle)  # behind the gate: pending until it opens
    assert not event.query()
    order: list[str] = []
    event.wait(other)
    with hostfunc.use_stream(other):
        hostfunc.launch(order.append, "after")
    time.sleep(0.05)
    assert order == [] and other._worker.enqueued == 2
    gate.opened.set()
    other.synchronize(WAIT_S)
    assert order == ["after"] and event.query()


def test_synchronize_wakes_when_a_later_record_is_reached_at_once() -> None:
    """Pins: a thread waiting on an event (its marker behind pending work) wakes when the
    event is recorded again on an idle stream: CUDA waits for the latest record only."""
    busy, idle = HostStream("busy"), HostStream("idle")
    event = HostEvent()
    gate = Gate()
    with hostfunc.use_stream(busy):
        hostfunc.launch(gate)
    event.record(busy)
    woke = threading.Event()
    waiter = threading.Thread(target=lambda: (event.synchronize(WAIT_S), woke.set()))
    waiter.start()
    time.sleep(0.05)
    assert not woke.is_set()
    event.record(idle)  # reached at once: the waiter must be told
    assert woke.wait(WAIT_S / 2), "synchronize() missed the record on the idle stream"
    gate.opened.set()
    waiter.join(WAIT_S)


def test_inline_stream_runs_an_idle_launch_on_the_launching_thread() -> None:
    """Pins (``inline_when_idle``): a launch on an idle stream runs before ``launch``
    returns, on the calling thread, with no stream or backend made current (as on the
    worker), and starts no worker thread; its failure is kept for the drain."""
    stream = HostStream("inline", inline_when_idle=True)
    seen: list[tuple] = []

    def probe(x: int) -> None:
        seen.append((x, threading.current_thread().name, explicit_stream(),
                     list(hostfunc._context.backends.stack)))

    with hostfunc.use_stream(stream):  # (and the fixture's use_backend("cpu"))
        hostfunc.launch(probe, 1)
        assert seen == [(1, threading.current_thread().name, None, [])]
        assert hostfunc.current_stream() is stream and hostfunc._context.backends.stack
        hostfunc.launch(_raise_value_error, "inline boom")
    assert stream._worker.thread is None and stream.query()
    with pytest.raises(hostfunc.HostFuncError, match="inline boom"):
        hostfunc.drain(WAIT_S)


def test_inline_callback_cannot_wait_for_its_own_stream_and_ctrl_c_stops_the_caller() -> None:
    """Pins: inside a callback run inline, waiting for its own stream is the usage error the
    worker gives (not a hang), closing the stream does not wait for the worker; a
    KeyboardInterrupt leaves the launch at once and the stream stays usable. Recording an
    event on a closed stream is refused."""
    stream = HostStream("inline", inline_when_idle=True)
    stream.enqueue(lambda: None)
    stream.synchronize(WAIT_S)  # (the worker thread exists)
    errors: list[BaseException] = []

    def wait_for_own_stream() -> None:
        try:
            stream.synchronize(WAIT_S)
        except hostfunc.HostFuncUsageError as e:
            errors.append(e)

    def interrupt() -> None:
        raise KeyboardInterrupt

    with hostfunc.use_stream(stream):
        hostfunc.launch(wait_for_own_stream)
        assert len(errors) == 1 and "cannot wait for itself" in str(errors[0])
        with pytest.raises(KeyboardInterrupt):
            hostfunc.launch(interrupt)
        hostfunc.launch(errors.append, "after")
    assert errors[-1] == "after" and stream.query()
    started = time.monotonic()
    with hostfunc.use_stream(stream):
        hostfunc.launch(stream.close)
    assert time.monotonic() - started < 3.0, "close() from an inline callback waited"  # (its join: 5 s)
    with pytest.raises(hostfunc.HostFuncUsageError, match="closed"):
        HostEvent().record(stream)


def _raise_value_error(message: str) -> None:
    raise ValueError(message)


def test_inline_stream_queues_behind_pending_work_in_order() -> None:
    """Pins: on a busy ``inline_when_idle`` stream launches queue on its worker in order;
    and while an inline callback runs, a launch from another thread queues behind it (the
    worker does not start it early)."""
    stream = HostStream("inline", inline_when_idle=True)
    order: list[str] = []
    gate = Gate()
    stream.enqueue(gate)  # (a launch would run it inline: the stream is idle)
    with hostfunc.use_stream(stream):
        hostfunc.launch(order.append, "queued")  # behind the gate: not inline
    assert order == []
    gate.opened.set()
    stream.synchronize(WAIT_S)
    assert order == ["queued"]

    def launch_from_another_thread() -> None:
        with hostfunc.use_backend("cpu"), hostfunc.use_stream(stream):
            hostfunc.launch(order.append, "other thread")

    def inline() -> None:
        other = threading.Thread(target=launch_from_another_thread)
        other.start()
        other.join(WAIT_S)
        time.sleep(0.05)  # the worker would have run it by now, were it allowed to
        order.append("inline")

    with hostfunc.use_stream(stream):
        hostfunc.launch(inline)
    stream.synchronize(WAIT_S)
    assert order == ["queued", "inline", "other thread"]


def test_capture_then_replay_runs_each_callback_per_replay_with_bound_args() -> None:
    """Pins: launches inside capture() do not run; each replay runs every recorded callback once,
    in order, with the very argument objects bound at capture (mutations visible); is_capturing
    is True only inside the capture."""
    holder = {"step": 0}
    seen: list[tuple[str, int, int]] = []

    def fetch(name: str, h: dict[str, int]) -> None:
        seen.append((name, h["step"], id(h)))

    graph = HostGraph()
    assert not hostfunc.is_capturing()
    with hostfunc.capture(graph):
        assert hostfunc.is_capturing()
        hostfunc.launch(fetch, "fetch", holder)
        hostfunc.launch(fetch, "build", holder)
    assert not hostfunc.is_capturing()
    hostfunc.drain(WAIT_S)
    assert seen == [] and graph.num_callbacks == 2

    replays = 7
    for step in range(replays):
        holder["step"] = step
        graph.replay()
        hostfunc.drain(WAIT_S)  # replays see the holder's value at their own time
    expected = [(n, step, id(holder)) for step in range(replays) for n in ("fetch", "build")]
    assert seen == expected
    graph.reset()


def test_capture_records_event_steps_across_streams() -> None:
    """Pins: event record/wait inside a capture become graph steps, so each replay orders the
    other stream's work after the replayed callbacks."""
    side = HostStream("side")
    order: list[str] = []
    event = HostEvent()
    graph = HostGraph()
    with hostfunc.capture(graph):
        hostfunc.launch(time.sleep, 0.02)
        hostfunc.launch(order.append, "main")
        event.record()
    for _ in range(3):
        graph.replay()
        side.wait_event(event)
        with hostfunc.use_stream(side):
            hostfunc.launch(order.append, "side")
    hostfunc.drain(WAIT_S)
    assert order == ["main", "side"] * 3
    graph.reset()


def test_exception_surfaces_at_drain_with_original_traceback() -> None:
    """Pins: a callback's exception is not printed and dropped; the next drain raises
    HostFuncError with .fn_name, the original traceback text and __cause__; later callbacks still
    ran; further failures ride in .later_errors; the following drain is clean."""
    ran: list[str] = []

    def explode(x: int) -> None:
        raise KeyError(f"missing {x}")

    hostfunc.launch(explode, 1)
    hostfunc.launch(ran.append, "after")
    hostfunc.launch(explode, 2)
    with pytest.raises(hostfunc.HostFuncError) as info:
        hostfunc.drain(WAIT_S)
    err = info.value
    assert err.fn_name.endswith("explode")
    assert isinstance(err.__cause__, KeyError) and err.__cause__.args == ("missing 1",)
    assert 'raise KeyError(f"missing {x}")' in err.traceback
    assert len(err.later_errors) == 1 and err.later_errors[0].__cause__.args == ("missing 2",)
    assert ran == ["after"]
    hostfunc.drain(WAIT_S)
    hostfunc.check_errors()


def test_check_errors_raises_without_waiting() -> None:
    """Pins: check_errors() re-raises an error already recorded, without draining."""
    hostfunc.launch(lambda: 1 / 0)
    hostfunc.current_stream().synchronize(WAIT_S)
    with pytest.raises(hostfunc.HostFuncError) as info:
        hostfunc.check_errors()
    assert isinstance(info.value.__cause__, ZeroDivisionError)


def test_drain_returns_only_after_pending_callbacks() -> None:
    """Pins: drain blocks until callbacks enqueued before it have finished (on every stream),
    releasing the GIL meanwhile (another Python thread opens the gate), and a drain with a short
    timeout raises HostFuncTimeoutError instead of hanging."""
    other = HostStream("other")
    gate = Gate()
    with hostfunc.use_stream(other):
        hostfunc.launch(gate)
    with pytest.raises(hostfunc.HostFuncTimeoutError):
        hostfunc.drain(timeout=0.05)
    opener = threading.Timer(0.1, gate.opened.set)
    opener.start()
    hostfunc.drain(WAIT_S)
    assert gate.passed.is_set(), "drain returned before the pending callback ran"
    opener.join(WAIT_S)
    assert not opener.is_alive()


def test_drain_is_a_noop_while_capturing() -> None:
    """Pins: drain inside a capture does not wait (a host wait is illegal while capturing), even
    when other streams are busy."""
    busy = HostStream("busy")
    gate = Gate()
    with hostfunc.use_stream(busy):
        hostfunc.launch(gate)
    graph = HostGraph()
    with hostfunc.capture(graph):
        t0 = time.monotonic()
        hostfunc.drain(WAIT_S)
        assert time.monotonic() - t0 < 3.0  # (waiting for the busy stream: WAIT_S)
    assert not gate.passed.is_set()
    gate.opened.set()
    graph.reset()


def test_eager_entries_are_freed_after_they_run() -> None:
    """Pins: an eager launch's arguments are released once it has run (weakref dies)."""
    class Payload:
        pass

    payload = Payload()
    ref = weakref.ref(payload)
    before = hostfunc.live_entries()
    hostfunc.launch(lambda p: None, payload)
    del payload
    hostfunc.drain(WAIT_S)
    gc.collect()
    assert ref() is None
    assert hostfunc.live_entries() == before


def test_no_entries_leak_after_graphs_are_released() -> None:
    """Pins: a graph owns its captured entries until reset() or collection; replays do not add
    entries; released graphs free their payloads; reset during an in-flight replay defers the
    release until that replay has finished (like a CUDA user object)."""
    class Payload:
        pass

    before = hostfunc.live_entries()
    graphs, refs = [], []
    for _ in range(5):
        payload = Payload()
        refs.append(weakref.ref(payload))
        g = HostGraph()
        with hostfunc.capture(g):
            hostfunc.launch(lambda p: None, payload)
            hostfunc.launch(lambda p: None, payload)
        graphs.append(g)
        del payload
    assert hostfunc.live_entries() == before + 10
    for g in graphs:
        for _ in range(3):
            g.replay()
    hostfunc.drain(WAIT_S)
    assert hostfunc.live_entries() == before + 10

    graphs[0].reset()
    graphs[1].reset()
    del graphs[2]               # collection releases too, like torch's CUDAGraph
    gc.collect()
    assert hostfunc.live_entries() == before + 4
    assert [r() is None for r in refs] == [True, True, True, False, False]

    # reset while a replay is blocked: entries stay until the replay completes
    gate = Gate()
    stream = HostStream("replay")
    late = graphs[-1]
    with hostfunc.use_stream(stream):
        hostfunc.launch(gate)
        late.replay()
    late.reset()
    assert hostfunc.live_entries() == before + 4 + 1  # + the gate's own eager entry
    gate.opened.set()
    stream.synchronize(WAIT_S)
    assert hostfunc.live_entries() == before + 2
    graphs.clear()
    gc.collect()
    assert hostfunc.live_entries() == before
    assert all(r() is None for r in refs)


def test_graph_misuse_raises_usage_errors() -> None:
    """Pins: capturing into a graph that holds a capture, replaying inside a capture and a stream
    waiting on itself from its own task raise HostFuncUsageError instead of deadlocking."""
    g = HostGraph()
    with hostfunc.capture(g):
        hostfunc.launch(lambda: None)
    with pytest.raises(hostfunc.HostFuncUsageError):
        with hostfunc.capture(g):
            pass
    other = HostGraph()
    with hostfunc.capture(other):
        with pytest.raises(hostfunc.HostFuncUsageError):
            g.replay()
    g.reset()
    other.reset()

    stream = hostfunc.current_stream()
    hostfunc.launch(stream.synchronize, WAIT_S)
    with pytest.raises(hostfunc.HostFuncError) as info:
        hostfunc.drain(WAIT_S)
    assert isinstance(info.value.__cause__, hostfunc.HostFuncUsageError)


def test_capture_block_that_raises_resets_the_graph() -> None:
    """Pins: an exception inside capture() propagates and releases what was captured."""
    g = HostGraph()
    before = hostfunc.live_entries()
    with pytest.raises(RuntimeError, match="user error"):
        with hostfunc.capture(g):
            hostfunc.launch(lambda: None)
            raise RuntimeError("user error")
    assert g.num_callbacks == 0 and not hostfunc.is_capturing()
    assert hostfunc.live_entries() == before


def test_launches_from_many_threads_keep_per_stream_order() -> None:
    """Pins: threads launching onto their own streams concurrently keep each stream's order."""
    results: dict[int, list[int]] = {t: [] for t in range(4)}

    def worker(t: int) -> None:
        with hostfunc.use_stream(HostStream(f"t{t}")) as s:
            for i in range(300):
                hostfunc.launch(results[t].append, i)
            s.synchronize(WAIT_S)

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(WAIT_S)
        assert not th.is_alive(), "a launching thread hung"
    assert all(v == list(range(300)) for v in results.values())


def test_backend_selection_prefers_cpu_when_a_host_stream_is_current() -> None:
    """Pins: a current HostStream picks the CPU stand-in; without a GPU the default is CPU."""
    from hostfunc.backend import active_backend

    # the autouse fixture forces "cpu"; look underneath it from a fresh thread
    names: list[str] = []

    def probe() -> None:
        with hostfunc.use_stream(HostStream()):
            names.append(active_backend().name)
        names.append(active_backend().name)

    th = threading.Thread(target=probe)
    th.start()
    th.join(WAIT_S)
    expected_default = "cuda" if hostfunc.cuda_available() else "cpu"
    assert names == ["cpu", expected_default]


def test_import_is_clean() -> None:
    """Pins: `import hostfunc` loads no CUDA bindings, no torch and no ctypes trampoline."""
    code = ("import sys, hostfunc\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'cuda', 'ctypes')]\n"
            "assert not bad, bad\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, cwd="/")
    assert proc.returncode == 0, proc.stderr


def test_check_errors_with_an_owner_leaves_other_owners_errors_kept():
    """A method of a class marked __hostfunc_owner__ records its error under its object:
    check_errors(owner=x) raises x's and ownerless errors only; another owner's stays kept
    for its own check, and a plain drain raises everything."""
    from hostfunc.registry import REGISTRY

    class Owned:
        __hostfunc_owner__ = True

        @hostfunc.hostfunc
        def fail(self, what: str) -> None:
            raise ValueError(what)

    a, b = Owned(), Owned()
    a.fail("a's")
    hostfunc.drain(owner=b)  # waits for the launch; its error is a's, not raised to b
    assert REGISTRY.pending_errors() == 1
    hostfunc.check_errors(owner=b)
    with pytest.raises(hostfunc.HostFuncError, match="a's"):
        hostfunc.check_errors(owner=a)
    b.fail("b's")
    hostfunc.record_error("ownerless", RuntimeError("nobody's"))
    with pytest.raises(hostfunc.HostFuncError, match="b's|nobody's") as info:
        hostfunc.drain()
    assert len(info.value.later_errors) == 1
