"""The CPU-side logic of the GPU tools: tools/profile_cupti.py (marker pairing, step windows,
timeline and summary from synthetic CUPTI records, the CUPTI record conversion against a
stand-in ``cupti`` module, the no-CUDA exit), tools/bench_graph_replay.py (points, host-node
detection, a CPU run of its protocol) and the ``host_node`` option of ``capgraph.generate``."""

from __future__ import annotations

import dataclasses
import enum
import gc
import importlib.util
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
MAIN = 1000  # the main thread's id in the synthetic traces


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up while the class is built
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[name]
    return module


@pytest.fixture(scope="module")
def prof():
    return _tool("profile_cupti")


@pytest.fixture(scope="module")
def bench():
    return _tool("bench_graph_replay")


def _trace(prof):
    """Two replayed steps after a capture: each an add_batch range on the main thread, a
    runtime graph launch holding its driver launch, the host node's build range on the
    callback thread, the forward and mask kernels and the token copy; then the teardown."""
    R = prof.Record
    records = [R("runtime", "cudaStreamBeginCapture", 100, 110, f"thread {MAIN}"),
               R("nvtx", "CapturableGuidedDecoder.execute", 120, 300, f"thread {MAIN}",
                 "capgraph")]
    for t0 in (1_000, 3_000):
        records += [
            R("nvtx", "CapturableGuidedDecoder.add_batch", t0, t0 + 50, f"thread {MAIN}",
              "capgraph"),
            R("runtime", "cudaGraphLaunch", t0 + 100, t0 + 140, f"thread {MAIN}"),
            R("driver", "cuGraphLaunch", t0 + 105, t0 + 135, f"thread {MAIN}"),
            R("nvtx", "CapturableGuidedDecoder.build", t0 + 200, t0 + 600, "thread 77",
              "capgraph"),
            R("kernel", "forward_gemm", t0 + 150, t0 + 550, "stream 7"),
            R("kernel", "capgraph_logits_bitmask_f32_b32_p4", t0 + 620, t0 + 640, "stream 7"),
            R("memcpy", "memcpy DTOH 256 B", t0 + 700, t0 + 710, "stream 7"),
        ]
    records.append(R("runtime", "cudaGraphExecDestroy", 5_000, 5_100, f"thread {MAIN}"))
    return records


def test_pair_markers_joins_start_and_end_by_id(prof):
    """Two marker records with one id are one range (name and domain from the record that has
    them, whatever the order they arrive in); an id seen once is an instantaneous mark."""
    ranges = prof.pair_markers([
        {"id": 7, "timestamp": 900, "name": "", "domain": "", "thread": 5},
        {"id": 3, "timestamp": 50, "name": "mark", "domain": "", "thread": 6},
        {"id": 7, "timestamp": 400, "name": "CapturableGuidedDecoder.build",
         "domain": "capgraph", "thread": 5}])
    assert [(r.name, r.start, r.end, r.track, r.domain) for r in ranges] == [
        ("mark", 50, 50, "thread 6", ""),
        ("CapturableGuidedDecoder.build", 400, 900, "thread 5", "capgraph")]


def test_drop_nested_driver_keeps_direct_driver_calls(prof):
    """A driver call inside a runtime call on its thread is that call's repeat and goes; one
    on another thread, or outside any runtime call, stays."""
    R = prof.Record
    records = [R("runtime", "cudaMemcpyAsync", 10, 50, "thread 1"),
               R("driver", "cuMemcpyAsync", 15, 45, "thread 1"),
               R("driver", "cuGraphAddHostNode", 20, 30, "thread 2"),
               R("runtime", "cudaGraphLaunch", 60, 90, "thread 1"),
               R("driver", "cuLaunchHostFunc", 95, 99, "thread 1")]
    assert [r.name for r in prof.drop_nested_driver(records)] == [
        "cudaMemcpyAsync", "cuGraphAddHostNode", "cudaGraphLaunch", "cuLaunchHostFunc"]


def test_step_starts_at_the_marker_before_each_launch(prof):
    """One step per graph launch (a driver launch nested in the runtime one counts once),
    starting at the add_batch range before it; a launch with no marker since the previous
    one starts its own step; nothing before the first launch (the capture) is a step."""
    records = _trace(prof)
    assert prof.step_starts(records) == [1_000, 3_000]
    R = prof.Record
    records.append(R("runtime", "cudaGraphLaunch", 4_000, 4_050, f"thread {MAIN}"))
    assert prof.step_starts(records) == [1_000, 3_000, 4_000]
    assert prof.step_starts(records, marker="no such range") == [1_100, 3_100, 4_000]
    assert prof.step_starts(records[:2]) == []


def test_last_step_timeline_summary_and_landmarks(prof):
    """The last step's window ends where the teardown starts; the timeline gives offsets
    from the step's start, durations, kinds, tracks (main, cpu <tid>, stream) and names; the
    summary counts every replayed step per name; the landmarks find all three things."""
    records = prof.drop_nested_driver(_trace(prof))
    starts = prof.step_starts(records)
    end = prof.teardown_start(records, starts[-1])
    assert end == 5_000
    last = prof.step_records(records, starts[-1], end)
    assert [r.name for r in last][:3] == ["CapturableGuidedDecoder.add_batch",
                                          "cudaGraphLaunch", "forward_gemm"]
    assert prof.step_durations_us(records, starts) == [2.0, 0.71]
    lines = prof.format_timeline(last, starts[-1], MAIN).splitlines()
    assert lines[0].split() == ["start", "us", "dur", "us", "kind", "track", "name"]
    assert lines[1].split() == ["0.0", "0.1", "nvtx", "main", "CapturableGuidedDecoder.add_batch"]
    assert lines[4].split() == ["0.2", "0.4", "nvtx", "cpu", "77",
                                "CapturableGuidedDecoder.build"]
    assert lines[5].split() == ["0.6", "0.0", "kernel", "stream", "7",
                                "capgraph_logits_bitmask_f32_b32_p4"]
    assert len(lines) == 1 + len(last)
    cut = prof.format_timeline(last, starts[-1], MAIN, max_lines=2).splitlines()
    assert len(cut) == 4 and cut[-1] == f"... {len(last) - 2} more records (see the JSON)"
    summary = prof.summarize(prof.step_records(records, starts[0], end))
    assert summary[0] == {"kind": "kernel", "name": "forward_gemm", "count": 2,
                          "mean_us": 0.4, "total_us": 0.8}
    build = next(r for r in summary if r["name"] == "CapturableGuidedDecoder.build")
    assert (build["count"], build["mean_us"]) == (2, 0.4)
    assert not any(r["name"] == "cudaGraphExecDestroy" for r in summary)
    assert "    2       0.4        0.8  forward_gemm" in prof.format_summary(summary)
    assert prof.landmarks(last, MAIN) == {
        "capgraph_ranges": 2, "host_node_ranges": ["CapturableGuidedDecoder.build"],
        "mask_kernels": ["capgraph_logits_bitmask_f32_b32_p4"], "all_three": True}


def test_analyse_reports_the_last_step(prof):
    """analyse(), the text and JSON that profile_cupti prints and writes after a trace: the
    last step's length and timeline, the summary, the landmarks line; a trace without a
    graph launch says it has no replayed step."""
    text, out = prof.analyse(prof.drop_nested_driver(_trace(prof)), MAIN)
    assert text.startswith("last replayed step: 0.7 us (all 2 steps: 2, 1 us)")
    assert "summary over the 2 replayed steps" in text
    assert ("landmarks in the last step: 2 capgraph ranges; host node ranges: "
            "CapturableGuidedDecoder.build; mask kernel: "
            "capgraph_logits_bitmask_f32_b32_p4\n") in text
    assert text.endswith("critical path of the last step (us from its first kernel): forward "
                         "0-0.4; host node 0.1-0.5; mask kernel 0.5-0.5: the mask kernel ends "
                         "0.1 us after the forward's last kernel")
    assert out["step_us"] == [2.0, 0.71] and out["landmarks"]["all_three"] is True
    assert out["critical_path"] == {"forward_end": 0.4, "mask_start": 0.5, "mask_end": 0.5,
                                    "past_forward": 0.1, "node_start": 0.1, "node_end": 0.5}
    assert out["last_step"][0] == {
        "kind": "nvtx", "name": "CapturableGuidedDecoder.add_batch", "start": 3_000,
        "end": 3_050, "track": "main", "domain": "capgraph", "offset_us": 0.0}
    json.dumps(out)  # what --json writes
    text, out = prof.analyse(_trace(prof)[:2], MAIN)
    assert text == "no graph launch in the trace: no replayed step to show"
    assert out["last_step"] == [] and out["landmarks"] == {}


def test_critical_path_places_node_copy_and_mask_against_the_forward(prof):
    """critical_path: offsets (us) from the step's first kernel of the forward's end (the
    kernels, on any stream, that end before the mask kernel starts: a replayed graph runs the
    mask kernel on a stream of its own), the native node's run and where its batch came (its
    records preferred to capgraph ranges off the main thread), the bitmask's copy (the
    largest host-to-device copy before the mask kernel), and how far the mask kernel ends
    past the forward; None without a mask kernel or without a
    kernel before it."""
    R = prof.Record
    us = 1_000
    step = [
        R("kernel", "embed", 10 * us, 20 * us, "stream 7"),
        R("kernel", "other_stream", 5 * us, 600 * us, "stream 9"),
        R("kernel", "lm_head", 300 * us, 360 * us, "stream 7"),
        R("nvtx", "CapturableGuidedDecoder.add_batch", 50 * us, 140 * us, f"thread {MAIN}",
          "capgraph"),
        R("nvtx", "CapturableGuidedDecoder.host_node", 30 * us, 390 * us, "thread 77",
          "capgraph"),
        R("node", prof.NODE_RUN, 40 * us, 380 * us, "native node"),
        R("node", prof.NODE_WAIT, 40 * us, 150 * us, "native node"),
        R("memcpy", "memcpy HTOD 1048576 B", 381 * us, 416 * us, "stream 8"),
        R("memcpy", "memcpy HTOD 256 B", 417 * us, 418 * us, "stream 7"),  # (not the bitmask)
        R("memcpy", "memcpy DTOH 256 B", 440 * us, 441 * us, "stream 7"),
        R("kernel", "capgraph_logits_bitmask_f32_b16_p4", 420 * us, 430 * us, "stream 7"),
        R("kernel", "argmax", 431 * us, 433 * us, "stream 7"),
    ]
    path = prof.critical_path(step, MAIN)
    assert path == {"forward_end": 350.0, "mask_start": 410.0, "mask_end": 420.0,
                    "past_forward": 70.0, "node_start": 30.0, "node_end": 370.0,
                    "batch_at": 140.0, "copy_start": 371.0, "copy_end": 406.0}
    assert prof.format_critical_path(path) == (
        "critical path of the last step (us from its first kernel): forward 0-350.0; host "
        "node 30.0-370.0 (its batch at 140.0); bitmask copy 371.0-406.0; mask kernel "
        "410.0-420.0: the mask kernel ends 70.0 us after the forward's last kernel")
    on_a_branch = [dataclasses.replace(r, track="stream 8")
                   if r.name.startswith("capgraph_") else r for r in step]
    assert prof.critical_path(on_a_branch, MAIN) == path
    python_node = [r for r in step if r.kind != "node"]  # the span of the off-main ranges
    assert prof.critical_path(python_node, MAIN)["node_start"] == 20.0
    assert "batch_at" not in prof.critical_path(python_node, MAIN)
    assert prof.critical_path([r for r in step if not r.name.startswith("capgraph_")],
                              MAIN) is None
    assert prof.critical_path([r for r in step if r.name != "embed" and r.name != "lm_head"],
                              MAIN) is None
    assert prof.format_critical_path(None).startswith("critical path: no mask kernel")
    fused = [dataclasses.replace(r, name="capgraph_masked_argmax_f32")
             if r.name.startswith("capgraph_") else r for r in step if r.name != "argmax"]
    assert prof.critical_path(fused, MAIN) == path  # (the fused masked argmax is the mask)
    assert prof.landmarks(fused, MAIN)["mask_kernels"] == ["capgraph_masked_argmax_f32"]


def test_landmarks_without_host_node_ranges(prof):
    """capgraph ranges only on the main thread (no host node seen) do not make all three."""
    last = [r for r in _trace(prof) if r.track != "thread 77"]
    marks = prof.landmarks(last, MAIN)
    assert marks["host_node_ranges"] == [] and marks["all_three"] is False
    assert prof.landmarks(last, None)["host_node_ranges"] == [
        "CapturableGuidedDecoder.add_batch", "CapturableGuidedDecoder.execute"]


def test_native_node_record_on_cuptis_clock(prof):
    """The native node's last run (its monotonic-clock timestamps) becomes a record on
    CUPTI's clock through the offset of the tightest bracketed reading, and counts as the
    host node in the landmarks; a node that ran nothing gives no record."""
    readings = iter([100, 5_000, 130,  # 30 ns bracket
                     200, 5_095, 210,  # 10 ns bracket: offset 5_095 - 205 = 4_890
                     300, 5_300, 340])
    offset = prof.clock_offset_ns(lambda: next(readings), lambda: next(readings), samples=3)
    assert offset == 4_890
    stats = SimpleNamespace(runs=12, python_runs=0, last_start_ns=1_000, last_end_ns=1_250,
                            busy_ns=3_000, rows=768)
    node = prof.node_record(stats, offset)
    assert (node.kind, node.start, node.end, node.track) == ("node", 5_890, 6_140,
                                                             "native node")
    assert prof.node_record(SimpleNamespace(runs=0), offset) is None
    assert prof.node_record(None, offset) is None
    # a run that waited for its batch after launch: that wait is a record of its own
    assert prof.node_wait_record(stats, offset) is None  # (no last_job_ns)
    assert prof.node_wait_record(SimpleNamespace(**vars(stats), last_job_ns=1_500),
                                 offset) is None  # (waited 500 ns)
    wait = prof.node_wait_record(SimpleNamespace(**vars(stats), last_job_ns=9_000), offset)
    assert (wait.start, wait.end, wait.track) == (5_890, 13_890, "native node")
    assert "waiting for its batch" in wait.name
    last = [r for r in _trace(prof) if r.track != "thread 77"] + [node]
    marks = prof.landmarks(last, MAIN)
    assert marks["host_node_ranges"] == ["native host node (its last run)"]
    assert marks["all_three"] is True


def test_find_libcupti(prof, tmp_path):
    """The libcupti the process has mapped wins; else the first in a wheel's layout under a
    search directory; else None."""
    maps = ("7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n"
            "7f20-7f30 r-xp 00000000 08:01 456 /site/nvidia/cu13/lib/libcupti.so.13\n"
            "7f40-7f50 rw-p 00000000 00:00 0\n")
    assert prof.find_libcupti(maps, [str(tmp_path)]) == "/site/nvidia/cu13/lib/libcupti.so.13"
    assert prof.find_libcupti("", [str(tmp_path)]) is None
    lib = tmp_path / "nvidia" / "cu13" / "lib"
    lib.mkdir(parents=True)
    (lib / "libcupti.so.13").write_bytes(b"")
    assert prof.find_libcupti(maps.splitlines()[0], ["/nowhere", str(tmp_path)]) == \
        str(lib / "libcupti.so.13")


def _fake_cupti():
    """A stand-in for cupti-python's ``cupti.cupti`` module: the enums and calls that
    CuptiTrace uses, recording what it was asked."""
    class ActivityKind(enum.IntEnum):
        KERNEL, CONCURRENT_KERNEL, MEMCPY, MEMSET, RUNTIME, DRIVER, MARKER, NAME = range(8)

    calls = []

    def enable(kind):
        if kind == ActivityKind.MEMSET:
            raise RuntimeError("CUPTI_ERROR_NOT_COMPATIBLE")
        calls.append(("enable", kind.name))

    return SimpleNamespace(
        ActivityKind=ActivityKind,
        CallbackDomain=enum.IntEnum("CallbackDomain", "DRIVER_API RUNTIME_API"),
        ActivityMemcpyKind=enum.IntEnum("ActivityMemcpyKind", "HTOD DTOH"),
        ActivityObjectKind=enum.IntEnum("ActivityObjectKind", "PROCESS THREAD"),
        ActivityThreadIdType=enum.IntEnum("ActivityThreadIdType", "DEFAULT SYSTEM"),
        set_thread_id_type=lambda t: calls.append(("tid", t.name)),
        activity_register_callbacks=lambda req, done: calls.append(("callbacks", req())),
        activity_enable=enable,
        activity_disable=lambda kind: calls.append(("disable", kind.name)),
        activity_flush_all=lambda flag: calls.append(("flush", flag)),
        get_callback_name=lambda domain, cbid: {(2, 211): "cudaGraphLaunch_v10000",
                                                (1, 514): "cuGraphLaunch"}[(domain, cbid)],
        calls=calls)


def test_cupti_trace_converts_activity_records(prof):
    """CuptiTrace enables the six kinds (one refused is reported, the rest trace), copies
    each record type into a Record (API names through get_callback_name without their
    version suffix, an unknown cbid named by number, marker pairs joined), keeps a
    conversion error instead of raising into CUPTI's thread, and flushes and disables on
    stop."""
    cupti = _fake_cupti()
    A = cupti.ActivityKind
    trace = prof.CuptiTrace(cupti)
    trace.start()
    assert trace.unavailable == {"memset": "RuntimeError: CUPTI_ERROR_NOT_COMPATIBLE"}
    assert cupti.calls[:2] == [("tid", "SYSTEM"), ("callbacks", (8 << 20, 0))]
    assert [c[1] for c in cupti.calls if c[0] == "enable"] == [
        "CONCURRENT_KERNEL", "MEMCPY", "RUNTIME", "DRIVER", "MARKER"]
    thread = SimpleNamespace(pt=SimpleNamespace(thread_id=77))
    ns = SimpleNamespace
    trace._completed([
        ns(kind=A.CONCURRENT_KERNEL, name="capgraph_logits_bitmask_f32_b32_p4", start=10,
           end=20, stream_id=7),
        ns(kind=A.MEMCPY, copy_kind=2, bytes=256, start=30, end=31, stream_id=7),
        ns(kind=A.RUNTIME, cbid=211, start=1, end=5, thread_id=1000),
        ns(kind=A.DRIVER, cbid=514, start=2, end=4, thread_id=1000),
        ns(kind=A.DRIVER, cbid=9999, start=6, end=7, thread_id=1000),
        ns(kind=A.MARKER, id=4, timestamp=12, name="CapturableGuidedDecoder.build",
           domain="capgraph", object_kind=2, object_id=thread),
        ns(kind=A.MARKER, id=4, timestamp=18, name=None, domain=None, object_kind=2,
           object_id=thread),
        ns(kind=A.NAME),  # not traced: ignored
        ns(kind=A.KERNEL, name="broken", start=1),  # no end, no stream: a conversion error
    ])
    records = trace.stop()
    assert [(r.kind, r.name, r.start, r.end, r.track, r.domain) for r in records] == [
        ("kernel", "capgraph_logits_bitmask_f32_b32_p4", 10, 20, "stream 7", ""),
        ("memcpy", "memcpy DTOH 256 B", 30, 31, "stream 7", ""),
        ("runtime", "cudaGraphLaunch", 1, 5, "thread 1000", ""),
        ("driver", "cuGraphLaunch", 2, 4, "thread 1000", ""),
        ("driver", "cbid 9999", 6, 7, "thread 1000", ""),
        ("nvtx", "CapturableGuidedDecoder.build", 12, 18, "thread 77", "capgraph")]
    assert len(trace.errors) == 1 and trace.errors[0].startswith("AttributeError")
    assert ("flush", 1) in cupti.calls
    assert [c[1] for c in cupti.calls if c[0] == "disable"] == [
        "CONCURRENT_KERNEL", "MEMCPY", "RUNTIME", "DRIVER", "MARKER"]


def test_profile_cupti_arguments(prof):
    """Defaults trace 8 steps of the tiny model at batch 64 with CUPTI; counts below 1 and
    unknown choices are refused by name."""
    args = prof.parse_args([])
    assert (args.model, args.batch, args.steps, args.warmup, args.tracer, args.host_node) == \
        ("tiny", 64, 8, 4, "cupti", None)
    for bad in (["--steps", "0"], ["--batch", "-1"], ["--tracer", "nsys"], ["--model", "big"]):
        with pytest.raises(SystemExit) as info:
            prof.parse_args(bad)
        assert info.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_profile_cupti_without_cuda_exits_0(prof, capsys):
    """Where no CUDA device is present the profile says so and exits 0 (gpu_check.sh and
    profile_nsys.sh call it on any machine)."""
    assert prof.main(["--steps", "2"]) == 0
    assert "no CUDA device, nothing profiled" in capsys.readouterr().out


def test_parse_points(bench):
    """MODEL:BATCH lists parse in order; an unknown model, a bad batch, a missing colon or a
    repeated point is refused with the entry named."""
    assert bench.parse_points(bench.DEFAULT_POINTS) == [
        ("tiny", 64), ("tiny", 256), ("small", 8), ("small", 64), ("small", 256)]
    for text, said in (("huge:8", "'huge:8'"), ("tiny:0", "batch '0'"), ("tiny:x", "batch 'x'"),
                       ("tiny", "'tiny'"), ("tiny:8, tiny:8", "given twice")):
        with pytest.raises(ValueError, match=said):
            bench.parse_points(text)


def test_native_host_node_detection(bench):
    """host_node support is read from the constructor signatures, following **kwargs up the
    MRO: an explicit parameter (here or in a base that receives the keywords) is support; a
    chain that ends without it is not, and the reason names the class."""
    class Base:
        def __init__(self, config, host_node="auto"):
            pass

    class Forwarding(Base):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    class Plain:
        def __init__(self, config):
            pass

    class ForwardingToPlain(Plain):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)

    assert bench.native_host_node_support(Base) is None
    assert bench.native_host_node_support(Forwarding) is None
    assert bench.native_host_node_support(ForwardingToPlain) == \
        "ForwardingToPlain takes no host_node argument"
    from capgraph import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    import inspect
    takes = "host_node" in inspect.signature(GuidedDecoder.__init__).parameters or \
        "host_node" in inspect.signature(CapturableGuidedDecoder.__init__).parameters
    assert (bench.native_host_node_support() is None) == takes


def test_host_node_runs(bench):
    """--host-node both runs python then native where the decoder takes host_node; where it
    does not, python runs with the decoder's default and native is reported, not run."""
    assert bench.host_node_runs("both", None) == ([("python", "python"), ("native", "native")],
                                                  {})
    assert bench.host_node_runs("native", None) == ([("native", "native")], {})
    assert bench.host_node_runs("both", "X takes no host_node argument") == (
        [("python", None)], {"native": "not available (X takes no host_node argument)"})
    assert bench.host_node_runs("native", "why") == ([], {"native": "not available (why)"})
    with pytest.raises(ValueError, match="'auto'"):
        bench.host_node_runs("auto", None)


def test_bench_guided_host_leaves_a_steady_steps_record_to_the_next_begin_decode(
        tmp_path, monkeypatch, one_torch_thread):
    """tools/bench_guided_host.py on the CPU stand-in: one row per batch, the native node's
    runs counted; it waits for each step as generate() does, not through hostfunc.drain().
    A teacher-forced decode step's record holds only counters, so the take_failed it times
    leaves it unread and the next step's begin_decode reads it (after queuing its own step):
    no step record is read inside take_failed."""
    from capgraph.build.library import NODE_RECORDS
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.runtime.guide import GuideDriver
    STEP = NODE_RECORDS.index("step")
    inside: list[str | None] = [None]
    read_in = []
    real = {name: getattr(GuideDriver, name) for name in ("take_failed", "begin_decode")}
    real_apply = CapturableGuidedDecoder._apply_node_results

    def timed(name):
        def call(self, *args, **kwargs):
            inside[0] = name
            try:
                return real[name](self, *args, **kwargs)
            finally:
                inside[0] = None
        return call

    def apply(self, results):
        if results and any(r[0] == STEP for r in results):
            read_in.append(inside[0])
        return real_apply(self, results)
    for name in real:
        monkeypatch.setattr(GuideDriver, name, timed(name))
    monkeypatch.setattr(CapturableGuidedDecoder, "_apply_node_results", apply)
    tool = _tool("bench_guided_host")
    out = tmp_path / "host.json"
    monkeypatch.setattr(sys, "argv", ["bench_guided_host.py", "--batches", "2", "--blocks", "2",
                                      "--steps", "2", "--tokenizer", "mistral-sp32k",
                                      "--json", str(out)])
    assert tool.main() == 0
    row, = json.loads(out.read_text())["rows"]
    assert row["batch"] == 2 and row["steps"] == 4
    assert row["take_failed_us"] > 0 and row["node_us_per_step"] > 0
    # per block: the first decode step's record in the second's begin_decode; the second's
    # at the block's release (the context step is applied eagerly, read by its own drain)
    assert "take_failed" not in read_in
    assert read_in.count("begin_decode") == 2


def test_bench_graph_replay_cpu_run_writes_rows(bench, tmp_path, capsys, one_torch_thread,
                                               monkeypatch):
    """The whole protocol on the CPU stand-in (no replay): one row per point and measured
    host-node kind, the guided run's host build timed per step and per row, the JSON marked
    as not replayed, and a host-node kind the decoder lacks reported as not available. Each
    timed run starts on a collected, frozen heap, its collector time is in the JSON, and the
    heap is unfrozen when the tool returns."""
    import capgraph
    frozen = []
    real_generate = capgraph.generate

    def generate(*a, **k):
        frozen.append(gc.get_freeze_count())
        return real_generate(*a, **k)
    monkeypatch.setattr(capgraph, "generate", generate)
    out = tmp_path / "replay.json"
    assert bench.main(["--device", "cpu", "--points", "tiny:2", "--steps", "3",
                       "--warmup-steps", "1", "--tokenizer", "mistral-sp32k",
                       "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["replayed"] is False and data["device"] == "cpu"
    kinds = [k for k, v in data["host_nodes"].items() if v == "measured"]
    assert [(r["model"], r["batch"], r["host_node"]) for r in data["rows"]] == [
        ("tiny", 2, k) for k in kinds]
    for r in data["rows"]:
        assert r["unguided_steps"] >= 1 and r["guided_steps"] >= 1
        assert r["ratio"] == pytest.approx(r["guided_ms_per_step"] / r["unguided_ms_per_step"])
        assert 0 < r["replay_ratio"] < r["ratio"]  # (the guided host work outside the replay)
        if r["host_node"] == "python":
            assert r["host_build_ms_per_step"] > 0 and r["host_build_us_per_row"] > 0
        # the native node serves captured steps: no graph here, so it ran none
        assert r["native_node_ms_per_step"] is None and r["native_node_us_per_row"] is None
        assert r["unguided_gc_ms"] >= 0 and r["guided_gc_ms"] >= 0
    assert frozen and min(frozen) > 0 and gc.get_freeze_count() == 0
    printed = capsys.readouterr().out
    for kind, why in data["host_nodes"].items():
        if why != "measured":
            assert f"{kind}: {why}" in printed


def test_bench_graph_replay_breakdown_times_the_guided_host_work(bench, tmp_path, capsys,
                                                                 one_torch_thread):
    """--breakdown: each guided row carries every part's wall and CPU us per step and its
    calls (take_failed once per decode step and the context step, advance_batch on the decode
    steps after the first, the engine's decode step once per decode step), and the same
    parts of its unguided run (no guide calls there); two lines under the row say them, and
    the wrapped functions are the originals again when the tool returns."""
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.runtime.guide import GuideDriver
    import hostfunc.api
    from capgraph.runtime.engine import _Engine
    from capgraph.runtime.runner import ModelRunner
    before = (GuideDriver.take_failed, CapturableGuidedDecoder._node_collect,
              hostfunc.api._run_drain_hooks, _Engine._decode_step, ModelRunner.replay)
    out = tmp_path / "replay.json"
    assert bench.main(["--device", "cpu", "--points", "tiny:2", "--steps", "4",
                       "--warmup-steps", "1", "--tokenizer", "mistral-sp32k",
                       "--host-node", "native", "--before-points", "", "--breakdown",
                       "--json", str(out)]) == 0
    row, = json.loads(out.read_text())["rows"]
    parts = row["breakdown"]
    assert list(parts) == [name for name, *_ in bench.BREAKDOWN_PARTS]
    steps = row["guided_steps"]
    assert parts["take_failed"]["calls"] == steps + 1  # (and the context step's)
    assert parts["advance_batch"]["calls"] == steps - 1
    for p in parts.values():
        assert p["wall_us_per_step"] >= 0 and p["cpu_us_per_step"] >= 0
    assert parts["take_failed"]["wall_us_per_step"] > 0
    assert parts["decode step"]["calls"] == steps
    assert parts["decode step"]["wall_us_per_step"] >= parts["advance_batch"]["wall_us_per_step"]
    unguided = row["unguided_breakdown"]
    assert list(unguided) == list(parts)
    assert unguided["decode step"]["calls"] == row["unguided_steps"]
    assert unguided["take_failed"]["calls"] == unguided["advance_batch"]["calls"] == 0
    printed = capsys.readouterr().out
    assert "  unguided breakdown, us per step (wall/cpu): take_failed 0.0/0.0" in printed
    assert "\n  breakdown, us per step (wall/cpu): take_failed " in printed
    assert (GuideDriver.take_failed, CapturableGuidedDecoder._node_collect,
            hostfunc.api._run_drain_hooks, _Engine._decode_step, ModelRunner.replay) == before


def test_bench_graph_replay_failed_guided_run_is_reported(bench, tmp_path, monkeypatch,
                                                          one_torch_thread):
    """A guided run that raises becomes a row with its error and an entry of the JSON's
    errors, the run goes on, and the tool exits 1."""
    import capgraph
    real = capgraph.generate

    def failing(prompts, guides, **kw):
        if guides is not None and kw["max_new_tokens"] == 3:  # the measured guided runs
            raise RuntimeError("host node died")
        return real(prompts, guides, **kw)

    monkeypatch.setattr(capgraph, "generate", failing)
    out = tmp_path / "replay.json"
    assert bench.main(["--device", "cpu", "--points", "tiny:2", "--steps", "3",
                       "--warmup-steps", "1", "--tokenizer", "mistral-sp32k",
                       "--host-node", "python", "--json", str(out)]) == 1
    data = json.loads(out.read_text())
    assert data["rows"] == [{"model": "tiny", "batch": 2, "host_node": "python",
                             "error": "RuntimeError: host node died"}]
    assert data["errors"] == ["tiny batch 2, python host node: RuntimeError: host node died"]


def test_bench_graph_replay_runs_the_other_orders_at_its_points(bench, tmp_path, monkeypatch,
                                                                one_torch_thread):
    """At --before-points the native node also runs in each --compare kind's order: the batch
    made before the launch (native-before, generate(batch_after_launch=False)), the logits
    masked and then argmaxed (native-unfused, engine._FUSED_ARGMAX False for that run alone),
    the host work captured after the forward (native-node-last, engine._HOST_WORK_FIRST False
    for that run alone); the other kinds leave generate its defaults, other points run no such
    kind, and an unknown kind is refused by name."""
    import capgraph
    from capgraph.runtime import engine
    real = capgraph.generate
    calls = []

    def recording(prompts, guides, *, batch_after_launch=None, **kw):
        if guides is not None and kw["max_new_tokens"] == 3:  # the measured guided runs
            calls.append((len(prompts), kw["host_node"], batch_after_launch,
                          engine._HOST_WORK_FIRST, engine._FUSED_ARGMAX))
        return real(prompts, guides, batch_after_launch=batch_after_launch, **kw)

    monkeypatch.setattr(capgraph, "generate", recording)
    monkeypatch.setattr(bench, "native_host_node_support", lambda: None)
    out = tmp_path / "replay.json"
    assert bench.main(["--device", "cpu", "--points", "tiny:2,tiny:3", "--steps", "3",
                       "--warmup-steps", "1", "--tokenizer", "mistral-sp32k",
                       "--before-points", "tiny:3",
                       "--compare", "native-before,native-unfused,native-node-last",
                       "--json", str(out)]) == 0
    assert calls == [(2, "python", None, True, True), (2, "native", None, True, True),
                     (3, "python", None, True, True), (3, "native", None, True, True),
                     (3, "native", False, True, True), (3, "native", None, True, False),
                     (3, "native", None, False, True)]
    assert engine._HOST_WORK_FIRST is True and engine._FUSED_ARGMAX is True
    data = json.loads(out.read_text())
    assert [(r["batch"], r["host_node"]) for r in data["rows"]] == [
        (2, "python"), (2, "native"), (3, "python"), (3, "native"), (3, "native-before"),
        (3, "native-unfused"), (3, "native-node-last")]
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--compare", "native-sideways"])


def test_bench_argmax_checks_and_times_the_three_ways_on_cpu(tmp_path, capsys):
    """tools/bench_argmax.py on CPU (its protocol without graphs): a row per dtype, pattern and
    batch with the three times and their ratios, in the table and the JSON; the fused result
    was checked against mask+argmax before timing."""
    tool = _tool("bench_argmax")
    out = tmp_path / "argmax.json"
    assert tool.main(["--device", "cpu", "--batches", "1", "3", "--vocab", "300",
                      "--dtypes", "float32", "bfloat16", "--patterns", "2%", "random",
                      "--repeat", "2", "--trials", "2", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert [(r["dtype"], r["pattern"], r["batch"]) for r in data["rows"]] == [
        (d, p, b) for d in ("float32", "bfloat16") for p in ("2%", "random") for b in (1, 3)]
    for row in data["rows"]:
        assert min(row["argmax_us"], row["mask_argmax_us"], row["fused_us"]) > 0
        assert row["fused_over_unfused"] == pytest.approx(row["fused_us"] / row["mask_argmax_us"])
    assert "fused/mask+argmax" in capsys.readouterr().out


def test_generate_host_node_option(monkeypatch):
    """generate(host_node=...) reaches the capturable decoder's constructor as given, and is
    refused with the eager decoder (which runs no host node); the native node's own time (its
    host_node_stats) comes back as the "host_node" stage where the node ran steps, and there
    is no such stage where it ran none."""
    from capgraph import GuidedDecodingParams
    from capgraph.errors import ConfigError
    from capgraph.runtime import engine, generate, tiny_llama
    from capgraph.tokenizers import load_tokenizer

    with pytest.raises(ConfigError, match="host_node='native' needs decoder='capturable'"):
        generate(["x"], None, decoder="eager", host_node="native")
    seen = []
    node_runs = [3]

    class Recording(engine.CapturableGuidedDecoder):
        def __init__(self, *args, host_node=None, **kwargs):
            seen.append(host_node)
            super().__init__(*args, **kwargs)

        @property
        def host_node_stats(self):
            return SimpleNamespace(runs=node_runs[0], python_runs=0, busy_ns=1_500_000, rows=6)

    monkeypatch.setattr(engine, "CapturableGuidedDecoder", Recording)
    tok = load_tokenizer("mistral-sp32k")
    model = tiny_llama(len(tok), seed=0)

    def run(host_node):
        return generate(["Date:"], GuidedDecodingParams.regex(r"[0-9]{2}"), model=model,
                        tokenizer=tok, max_new_tokens=2, decoder="capturable",
                        host_node=host_node)
    results = run("native")
    assert seen == ["native"] and len(results) == 1
    assert results.timings.stages["host_node"] == pytest.approx(1.5e-3)
    node_runs[0] = 0
    assert "host_node" not in run("python").timings.stages
    assert seen == ["native", "python"]


def test_gpu_check_time_boxes():
    """tools/gpu_check.sh: the header lists every box with its seconds, and the sum it states
    is theirs; the device call's timeout it names leaves at least 45 s beyond the boxes (the
    wheel install, version lines and report) and stays within one call's 600 s; the open
    issues' GPU tests keep at least 120 s and the other GPU tests 60 s of their own; the
    fill-threads step runs only where its tool exists."""
    import re
    text = (ROOT / "tools" / "gpu_check.sh").read_text()
    boxes = dict(re.findall(r"\brun ([a-z-]+) (\d+) ", text))
    header = dict(re.findall(r"^#   ([a-z-]+) +(\d+)  ", text, flags=re.M))
    assert boxes == header
    total = sum(map(int, boxes.values()))
    assert re.findall(r"add up to (\d+) s", text) == [str(total)] * 2
    timeout = int(re.search(r"timeout_s=(\d+)", text).group(1))
    assert total + 45 <= timeout <= 600
    assert int(boxes["gpu-tests"]) >= 120 and int(boxes["gpu-tests-rest"]) >= 60
    assert boxes["fill-threads"] == "25"
    assert "[ -f tools/bench_fill_threads.py ] && run fill-threads" in text
