#!/usr/bin/env python3
"""GPU: a CUPTI trace of replayed guided decode steps — capgraph's NVTX ranges, the host node
and the mask kernel on one timeline.

For machines without a working Nsight Systems (``tools/profile_nsys.sh`` falls back to this
script). It loads CUPTI (``cupti-python``; libcupti from the ``nvidia-cuda-cupti`` package that
torch depends on), points ``NVTX_INJECTION64_PATH`` at that same library before capgraph
creates its NVTX domain (so the "capgraph" ranges reach CUPTI), runs one short guided
``capgraph.generate`` to warm up (kernel compile, grammar cache), then traces a second one:
CUPTI activity for kernels, memcpy, memset, CUDA runtime and driver API calls and NVTX markers.
A replayed step runs from the capgraph range that starts it on the host (``--step-marker``,
default the decoder's ``add_batch``) through its graph launch to the next step's marker; where
generate() made each step's batch after its launch (``batch_after_launch``, its default on
CUDA graphs), from the graph launch to the next one, the step's ``add_batch`` inside it. The
native host node marks each run as the range ``CapturableGuidedDecoder.host_node`` on the
driver's callback thread where capgraph's C++ library was built with NVTX's headers
(``capgraph.build.library.nvtx_include``); its last run is also added, from its own
``host_node_stats`` timestamps moved onto CUPTI's clock, as a ``node`` record.

Prints the last step as a text timeline (per record: start offset and duration in us, kind,
track — ``main`` or ``cpu <tid>`` for host threads, where a host node runs on the driver's
callback thread, ``stream <id>`` for device work — and name), then a summary over every traced
step (per NVTX range, kernel, copy and API name: count, mean and total us) and which of the
three landmarks the last step shows. ``--json`` writes all of it. Exits 0 with a message where
no CUDA device is present; exits 3 where CUDA is present but CUPTI cannot be loaded.

    python tools/profile_cupti.py --model tiny --batch 64 --steps 8 --json /tmp/profile.json
    python tools/profile_cupti.py --tracer none ...   # the workload alone, for nsys
"""

from __future__ import annotations

import argparse
import bisect
import ctypes
import glob
import json
import os
import re
import sys
import threading
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

DOMAIN = "capgraph"
#: the step's mask kernel: the in-place mask, or the fused masked argmax a greedy generate()
#: step runs instead (CapturableGuidedDecoder.execute_argmax)
MASK_KERNEL_PREFIX = ("capgraph_logits_bitmask_", "capgraph_masked_argmax_")
STEP_MARKER = "CapturableGuidedDecoder.add_batch"
GRAPH_LAUNCH_APIS = frozenset({"cudaGraphLaunch", "cudaGraphLaunch_ptsz", "cuGraphLaunch",
                               "cuGraphLaunch_ptsz"})
TEARDOWN_API_PREFIXES = ("cudaGraphExecDestroy", "cuGraphExecDestroy", "cudaGraphDestroy",
                         "cuGraphDestroy")
#: where wheels put libcupti, under a sys.path entry (CUDA 13, then 12 layouts)
LIBCUPTI_DIRS = ("nvidia/cu13/lib", "nvidia/cuda_cupti/lib", "nvidia/cu12/lib")


@dataclass(slots=True)
class Record:
    """One traced interval (ns on CUPTI's clock, which host and device records share).

    ``kind``: nvtx, kernel, memcpy, memset, runtime, driver, or node (the native host
    node's last run, from its own timestamps); ``track``: ``thread <tid>`` for host records,
    ``stream <id>`` for device work, ``native node`` for the node."""

    kind: str
    name: str
    start: int
    end: int
    track: str
    domain: str = ""

    @property
    def duration(self) -> int:
        return self.end - self.start


# -- trace analysis (pure: tested on CPU with synthetic records) ---------------------------

def pair_markers(markers: Iterable[dict]) -> list[Record]:
    """NVTX marker records -> ranges. CUPTI reports a push/pop or start/end range as two
    records with one id (the first carries the name and domain); an id seen once is an
    instantaneous mark (duration 0). Each dict: id, timestamp, name, domain, thread."""
    by_id: dict[int, list[dict]] = {}
    for m in markers:
        by_id.setdefault(m["id"], []).append(m)
    ranges = []
    for group in by_id.values():
        group.sort(key=lambda m: m["timestamp"])
        first, last = group[0], group[-1]
        name = next((m["name"] for m in group if m.get("name")), "")
        domain = next((m["domain"] for m in group if m.get("domain")), "")
        ranges.append(Record("nvtx", name, first["timestamp"], last["timestamp"],
                             f"thread {first['thread']}", domain))
    ranges.sort(key=lambda r: r.start)
    return ranges


def drop_nested_driver(records: Sequence[Record]) -> list[Record]:
    """Driver API records that a runtime API call on the same thread made (they lie inside
    it) repeat that call; the driver calls made directly (hostfunc's, torch's graph
    launches through the driver) stay. Runtime calls on one thread do not overlap, so the
    one that started last before a driver call is the only one that can hold it."""
    runtime: dict[str, list[Record]] = {}
    for r in records:
        if r.kind == "runtime":
            runtime.setdefault(r.track, []).append(r)
    starts: dict[str, list[int]] = {}
    for track, calls in runtime.items():
        calls.sort(key=lambda r: r.start)
        starts[track] = [r.start for r in calls]
    kept = []
    for r in records:
        if r.kind == "driver" and r.track in runtime:
            i = bisect.bisect_right(starts[r.track], r.start) - 1
            if i >= 0 and r.end <= runtime[r.track][i].end:
                continue
        kept.append(r)
    return kept


def step_starts(records: Sequence[Record], marker: str = STEP_MARKER) -> list[int]:
    """Where each replayed step starts: one per graph launch (a driver launch inside a
    runtime launch counts once), at the last ``marker`` range that began after the previous
    launch, or at the launch itself where there is none."""
    launches: list[Record] = []
    for r in sorted((r for r in records if r.kind in ("runtime", "driver")
                     and r.name in GRAPH_LAUNCH_APIS), key=lambda r: r.start):
        if launches and r.start < launches[-1].end:  # nested in the previous launch
            continue
        launches.append(r)
    marks = sorted(r.start for r in records if r.kind == "nvtx" and r.name == marker)
    starts, previous = [], None
    for launch in launches:
        since = [m for m in marks if (previous is None or m > previous) and m <= launch.start]
        starts.append(since[-1] if since else launch.start)
        previous = launch.start
    return starts


def teardown_start(records: Sequence[Record], after: int) -> int | None:
    """Where generate() starts releasing its graphs after ``after`` (the first graph-destroy
    API call): the end of the last step's window, so the teardown is not counted in it."""
    ends = [r.start for r in records if r.kind in ("runtime", "driver") and r.start > after
            and r.name.startswith(TEARDOWN_API_PREFIXES)]
    return min(ends) if ends else None


def step_records(records: Sequence[Record], start: int, end: int | None = None) -> list[Record]:
    """The records that begin in [start, end) (end None: to the end of the trace)."""
    return sorted((r for r in records if r.start >= start and (end is None or r.start < end)),
                  key=lambda r: (r.start, -r.end))


def step_durations_us(records: Sequence[Record], starts: Sequence[int]) -> list[float]:
    """Each step's length: to the next step's start; the last to the end of its last record
    before the teardown."""
    out = [(b - a) / 1e3 for a, b in zip(starts, starts[1:])]
    if starts:
        tail = step_records(records, starts[-1], teardown_start(records, starts[-1]))
        out.append((max(r.end for r in tail) - starts[-1]) / 1e3 if tail else 0.0)
    return out


def track_label(track: str, main_thread: int | None) -> str:
    """``thread <main tid>`` -> ``main``; other threads -> ``cpu <tid>``; streams unchanged."""
    kind, _, ident = track.partition(" ")
    if kind == "thread":
        return "main" if main_thread is not None and ident == str(main_thread) else f"cpu {ident}"
    return track


def format_timeline(records: Sequence[Record], t0: int, main_thread: int | None = None,
                    max_lines: int | None = None, name_width: int = 72) -> str:
    """One line per record: start offset (us from ``t0``), duration (us), kind, track, name."""
    lines = [f"{'start us':>10} {'dur us':>9}  {'kind':<8}{'track':<12}name"]
    shown = records if max_lines is None else records[:max_lines]
    for r in shown:
        name = r.name if len(r.name) <= name_width else r.name[:name_width - 3] + "..."
        lines.append(f"{(r.start - t0) / 1e3:>10.1f} {r.duration / 1e3:>9.1f}  {r.kind:<8}"
                     f"{track_label(r.track, main_thread):<12}{name}")
    if len(shown) < len(records):
        lines.append(f"... {len(records) - len(shown)} more records (see the JSON)")
    return "\n".join(lines)


def summarize(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Per (kind, name): count, mean and total us; largest total first."""
    groups: dict[tuple[str, str], list[int]] = {}
    for r in records:
        groups.setdefault((r.kind, r.name), []).append(r.duration)
    rows: list[dict[str, Any]] = [
        {"kind": k, "name": n, "count": len(d), "mean_us": sum(d) / len(d) / 1e3,
         "total_us": sum(d) / 1e3} for (k, n), d in groups.items()]
    rows.sort(key=lambda row: (-row["total_us"], row["kind"], row["name"]))
    return rows


def format_summary(rows: Sequence[dict], limit: int | None = None,
                   name_width: int = 72) -> str:
    lines = [f"{'kind':<8}{'count':>7}{'mean us':>10}{'total us':>11}  name"]
    for row in rows[:limit]:
        name = row["name"] if len(row["name"]) <= name_width else \
            row["name"][:name_width - 3] + "..."
        lines.append(f"{row['kind']:<8}{row['count']:>7}{row['mean_us']:>10.1f}"
                     f"{row['total_us']:>11.1f}  {name}")
    if limit is not None and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more names (see the JSON)")
    return "\n".join(lines)


def landmarks(records: Sequence[Record], main_thread: int | None) -> dict[str, Any]:
    """What one step shows of the three things the profile is for: capgraph's NVTX ranges,
    the host node (capgraph ranges on a thread other than the main one — the driver's
    callback thread runs host nodes — or the native node's own record) and the mask
    kernel."""
    ours = [r for r in records if r.kind == "nvtx" and r.domain == DOMAIN]
    host = sorted({r.name for r in ours if track_label(r.track, main_thread) != "main"}
                  | {r.name for r in records if r.kind == "node"})
    masks = sorted({r.name for r in records if r.kind == "kernel"
                    and r.name.startswith(MASK_KERNEL_PREFIX)})
    return {"capgraph_ranges": len(ours), "host_node_ranges": host, "mask_kernels": masks,
            "all_three": bool(ours) and bool(host) and bool(masks)}


NODE_RUN = "native host node (its last run)"
NODE_WAIT = "native host node waiting for its batch (its last run)"


def critical_path(records: Sequence[Record], main_thread: int | None
                  ) -> dict[str, float] | None:
    """Where one step's guided work lies against its forward, in us from the step's first
    kernel that ends before the mask kernel starts (the forward's first): ``forward_end`` (the
    last of those kernels to end; a replayed graph runs its branches on streams of its own, so
    the mask kernel's stream need not be the forward's), ``node_start`` / ``node_end`` (the
    native node's record, else the span of capgraph ranges off the main thread), ``batch_at`` (where a node
    waited for a batch made after the launch: when it came), ``copy_start`` / ``copy_end``
    (the bitmask's: the largest host-to-device copy ending before the mask kernel, the last
    where no size is named),
    ``mask_start`` / ``mask_end``, and ``past_forward``: how much later than the forward's
    last kernel the mask kernel ends (what the guided work adds to the step's GPU path).
    None where the step has no mask kernel or no kernel before it."""
    kernels = sorted((r for r in records if r.kind == "kernel"), key=lambda r: r.start)
    mask = next((r for r in kernels if r.name.startswith(MASK_KERNEL_PREFIX)), None)
    if mask is None:
        return None
    forward = [r for r in kernels if r.end <= mask.start
               and not r.name.startswith(MASK_KERNEL_PREFIX)]
    if not forward:
        return None
    t0, forward_end = forward[0].start, max(r.end for r in forward)

    def us(ns: int) -> float:
        return round((ns - t0) / 1e3, 1)

    out = {"forward_end": us(forward_end), "mask_start": us(mask.start),
           "mask_end": us(mask.end), "past_forward": round((mask.end - forward_end) / 1e3, 1)}
    node = next((r for r in records if r.kind == "node" and r.name == NODE_RUN), None)
    off_main = [r for r in records if r.kind == "nvtx" and r.domain == DOMAIN
                and track_label(r.track, main_thread) != "main"]
    if node is not None:
        out.update(node_start=us(node.start), node_end=us(node.end))
    elif off_main:
        out.update(node_start=us(min(r.start for r in off_main)),
                   node_end=us(max(r.end for r in off_main)))
    wait = next((r for r in records if r.kind == "node" and r.name == NODE_WAIT), None)
    if wait is not None:
        out["batch_at"] = us(wait.end)
    copies = [r for r in records if r.kind == "memcpy" and "HTOD" in r.name.upper()
              and r.end <= mask.start]
    if copies:  # (the bitmask's: the step's largest, where the sizes are named; else the last)
        copy = max(copies, key=lambda r: (_copy_bytes(r.name), r.end))
        out.update(copy_start=us(copy.start), copy_end=us(copy.end))
    return out


def _copy_bytes(name: str) -> int:
    """The byte count a memcpy record's name ends with (``memcpy HTOD 1048576 B``), else -1."""
    match = re.search(r"(\d+) B$", name)
    return int(match.group(1)) if match else -1


def format_critical_path(path: dict[str, float] | None) -> str:
    """One line of :func:`critical_path`'s figures."""
    if path is None:
        return "critical path: no mask kernel after a forward kernel in the last step"
    parts = [f"forward 0-{path['forward_end']}"]
    if "node_start" in path:
        batch = f" (its batch at {path['batch_at']})" if "batch_at" in path else ""
        parts.append(f"host node {path['node_start']}-{path['node_end']}{batch}")
    if "copy_start" in path:
        parts.append(f"bitmask copy {path['copy_start']}-{path['copy_end']}")
    parts.append(f"mask kernel {path['mask_start']}-{path['mask_end']}")
    return (f"critical path of the last step (us from its first kernel): {'; '.join(parts)}: "
            f"the mask kernel ends {path['past_forward']} us after the forward's last kernel")


def analyse(records: Sequence[Record], main_thread: int | None, marker: str = STEP_MARKER,
            max_lines: int | None = None, summary_rows: int | None = None
            ) -> tuple[str, dict[str, Any]]:
    """A trace's text report (the last replayed step's timeline, the summary over every
    replayed step, the landmarks) and its JSON fields: step_us, last_step (records with
    their offset and track label), summary, landmarks."""
    starts = step_starts(records, marker)
    step_us = step_durations_us(records, starts)
    if not starts:
        return ("no graph launch in the trace: no replayed step to show",
                {"step_us": [], "last_step": [], "summary": summarize(records), "landmarks": {}})
    end = teardown_start(records, starts[-1])
    last = step_records(records, starts[-1], end)
    marks = landmarks(last, main_thread)
    path = critical_path(last, main_thread)
    summary = summarize(step_records(records, starts[0], end))
    text = "\n".join([
        f"last replayed step: {step_us[-1]:.1f} us (all {len(starts)} steps: "
        + ", ".join(f"{d:.0f}" for d in step_us) + " us)", "",
        format_timeline(last, starts[-1], main_thread, max_lines), "",
        f"summary over the {len(starts)} replayed steps", "",
        format_summary(summary, summary_rows), "",
        f"landmarks in the last step: {marks['capgraph_ranges']} capgraph ranges; host node "
        f"ranges: {', '.join(marks['host_node_ranges']) or 'none'}; mask kernel: "
        f"{', '.join(marks['mask_kernels']) or 'none'}", format_critical_path(path)])
    return text, {"step_us": step_us, "critical_path": path,
                  "last_step": [dict(asdict(r), offset_us=(r.start - starts[-1]) / 1e3,
                                     track=track_label(r.track, main_thread)) for r in last],
                  "summary": summary, "landmarks": marks}


def node_record(stats: Any, clock_offset_ns: int) -> Record | None:
    """The native host node's last run as a record on CUPTI's clock: ``stats`` is its
    ``host_node_stats`` (monotonic-clock ns), ``clock_offset_ns`` CUPTI's clock minus the
    monotonic clock. None where the node ran no step."""
    if stats is None or not stats.runs:
        return None
    return Record("node", NODE_RUN, stats.last_start_ns + clock_offset_ns,
                  stats.last_end_ns + clock_offset_ns, "native node")


def node_wait_record(stats: Any, clock_offset_ns: int) -> Record | None:
    """Where the native node's last run waited for its batch (queued after the step's launch:
    ``CapturableGuidedDecoder.set_batch_after_launch``), from its start to its
    ``last_job_ns``, on CUPTI's clock; None where it waited under a microsecond, ran no step,
    or its stats have no such field."""
    job = getattr(stats, "last_job_ns", None)
    if stats is None or not stats.runs or job is None or job - stats.last_start_ns < 1_000:
        return None
    return Record("node", NODE_WAIT,
                  stats.last_start_ns + clock_offset_ns, job + clock_offset_ns, "native node")


def clock_offset_ns(cupti_now: Callable[[], int], monotonic_now: Callable[[], int],
                    samples: int = 9) -> int:
    """CUPTI's clock minus the monotonic clock, from the tightest of ``samples`` bracketed
    readings (monotonic, CUPTI, monotonic)."""
    best: tuple[int, int] | None = None
    for _ in range(samples):
        before = monotonic_now()
        theirs = cupti_now()
        after = monotonic_now()
        if best is None or after - before < best[0]:
            best = (after - before, theirs - (before + after) // 2)
    assert best is not None
    return best[1]


def find_libcupti(maps_text: str, search_dirs: Sequence[str]) -> str | None:
    """The libcupti this process has mapped (``/proc/self/maps`` text), else the first one
    under ``search_dirs`` (sys.path entries) in a wheel's layout."""
    for line in maps_text.splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if os.path.basename(path).startswith("libcupti.so"):
            return path
    for base in search_dirs:
        for sub in LIBCUPTI_DIRS:
            hits = sorted(glob.glob(os.path.join(base, sub, "libcupti.so*")))
            if hits:
                return hits[0]
    return None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "small"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8, help="decode steps traced")
    ap.add_argument("--warmup", type=int, default=4, help="decode steps of the warm-up run")
    ap.add_argument("--host-node", default=None,
                    help="the decoder's host_node argument (default: the decoder's own)")
    ap.add_argument("--tokenizer", default="tekken")
    ap.add_argument("--tracer", default="cupti", choices=("cupti", "none"),
                    help="none: run the workload only (under nsys)")
    ap.add_argument("--step-marker", default=STEP_MARKER)
    ap.add_argument("--max-lines", type=int, default=400,
                    help="timeline lines printed (the JSON has every record)")
    ap.add_argument("--summary-rows", type=int, default=40)
    ap.add_argument("--json", help="write the trace's records, summary and landmarks here")
    args = ap.parse_args(argv)
    for name in ("batch", "steps", "warmup", "max_lines", "summary_rows"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)} must be >= 1")
    return args


# -- CUPTI (GPU machines only) ---------------------------------------------------------------

class CuptiTrace:
    """CUPTI activity collection into :class:`Record` lists (records are copied inside the
    buffer callback: CUPTI reuses the buffer once it returns)."""

    def __init__(self, cupti: Any) -> None:
        self.cupti = cupti
        A = cupti.ActivityKind
        self.kinds = {"kernel": A.CONCURRENT_KERNEL, "memcpy": A.MEMCPY, "memset": A.MEMSET,
                      "runtime": A.RUNTIME, "driver": A.DRIVER, "nvtx": A.MARKER}
        self.records: list[Record] = []
        self.markers: list[dict] = []
        self.errors: list[str] = []
        self.unavailable: dict[str, str] = {}
        self._api_names: dict[tuple[int, int], str] = {}
        self._convert = self._converters()

    def _api_name(self, domain: int, cbid: int) -> str:
        """The API call's name, without the version suffix CUPTI's runtime names carry
        (``cudaGraphLaunch_v10000`` -> ``cudaGraphLaunch``)."""
        key = (domain, cbid)
        if key not in self._api_names:
            try:
                name = str(self.cupti.get_callback_name(domain, cbid))
                self._api_names[key] = re.sub(r"_v\d+$", "", name)
            except Exception:  # noqa: BLE001 - an unnamed id is still shown
                self._api_names[key] = f"cbid {cbid}"
        return self._api_names[key]

    def _converters(self) -> dict[int, Callable[[Any], None]]:
        c, A, add = self.cupti, self.cupti.ActivityKind, self.records.append
        D = c.CallbackDomain

        def kernel(a):
            add(Record("kernel", str(a.name), a.start, a.end, f"stream {a.stream_id}"))

        def memcpy(a):
            try:
                what = c.ActivityMemcpyKind(a.copy_kind).name
            except ValueError:
                what = str(a.copy_kind)
            add(Record("memcpy", f"memcpy {what} {a.bytes} B", a.start, a.end,
                       f"stream {a.stream_id}"))

        def memset(a):
            add(Record("memset", f"memset {a.bytes} B", a.start, a.end, f"stream {a.stream_id}"))

        def api(kind, domain):
            def convert(a):
                add(Record(kind, self._api_name(domain, a.cbid), a.start, a.end,
                           f"thread {a.thread_id}"))
            return convert

        def marker(a):
            thread = a.object_id.pt.thread_id \
                if a.object_kind == c.ActivityObjectKind.THREAD else 0
            self.markers.append({"id": a.id, "timestamp": a.timestamp, "name": a.name or "",
                                 "domain": a.domain or "", "thread": thread})

        return {A.CONCURRENT_KERNEL: kernel, A.KERNEL: kernel, A.MEMCPY: memcpy,
                A.MEMSET: memset, A.RUNTIME: api("runtime", D.RUNTIME_API),
                A.DRIVER: api("driver", D.DRIVER_API), A.MARKER: marker}

    def _completed(self, activities: list) -> None:
        for a in activities:
            try:
                convert = self._convert.get(a.kind)
                if convert is not None:
                    convert(a)
            except Exception as e:  # noqa: BLE001 - CUPTI's thread must not see it
                if len(self.errors) < 10:
                    self.errors.append(f"{type(e).__name__}: {e}")

    def start(self) -> None:
        c = self.cupti
        try:  # thread ids as threading.get_native_id() gives them (gettid)
            c.set_thread_id_type(c.ActivityThreadIdType.SYSTEM)
        except Exception as e:  # noqa: BLE001 - the main thread is then not recognised
            self.errors.append(f"set_thread_id_type: {type(e).__name__}: {e}")
        c.activity_register_callbacks(lambda: (8 << 20, 0), self._completed)
        for name, kind in self.kinds.items():
            try:
                c.activity_enable(kind)
            except Exception as e:  # noqa: BLE001 - the others still trace
                self.unavailable[name] = f"{type(e).__name__}: {e}"

    def stop(self) -> list[Record]:
        c = self.cupti
        c.activity_flush_all(1)
        for name, kind in self.kinds.items():
            if name not in self.unavailable:
                c.activity_disable(kind)
        c.activity_flush_all(1)
        return self.records + pair_markers(self.markers)


def _load_cupti() -> tuple[Any, str | None]:
    """Import cupti-python with NVTX injection pointed at its libcupti (before capgraph
    creates its NVTX domain). Raises ImportError with the reason."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    path = find_libcupti(maps, sys.path)
    if path is not None:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # what the cupti module's dlopen finds
        os.environ.setdefault("NVTX_INJECTION64_PATH", path)
    from cupti import cupti
    return cupti, path


def _sibling(module: str) -> Any:
    """A module of tools/ (this script's folder)."""
    here = os.path.dirname(os.path.abspath(__file__))
    if here not in sys.path:
        sys.path.insert(0, here)
    return __import__(module)


def _workload(args: argparse.Namespace) -> Callable[[int], tuple[Any, str, Any]]:
    """One guided generate() of ``steps`` decode steps, on a model built once. The decoder
    class generate() builds is replaced by a subclass that keeps what its host node did."""
    import torch

    from capgraph import GuidedDecodingConfig, GuidedDecodingParams, generate
    from capgraph.demo import bundled_schema
    from capgraph.grammar import create_matcher_factory
    from capgraph.runtime import tiny_llama
    from capgraph.tokenizers import load_tokenizer

    from capgraph.runtime import engine

    class Observed(engine.CapturableGuidedDecoder):  # type: ignore[misc, valid-type]
        """generate()'s decoder, keeping its host-node kind and stats when it closes."""

        def close(self) -> None:
            seen.append((getattr(self, "host_node", "python"),
                         getattr(self, "host_node_stats", None)))
            run.batch_after_launch = (  # type: ignore[attr-defined]
                getattr(self, "batch_after_launch", None))
            super().close()

    seen: list[tuple[str, Any]] = []
    engine.CapturableGuidedDecoder = Observed  # type: ignore[misc]
    sizes = _sibling("bench_graph_replay").MODEL_SIZES
    tok = load_tokenizer(args.tokenizer)
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tok, json_whitespace="compact"))
    guide = GuidedDecodingParams.json_schema(bundled_schema())
    model = tiny_llama(len(tok), seed=0, device="cuda", **sizes[args.model])
    prompts = [f"Call {i}:" for i in range(args.batch)]

    def run(steps: int) -> tuple[Any, str, Any]:
        """generate()'s results, the host-node kind that served it and the node's stats
        (``run.batch_after_launch``: the decoder's wait for a batch made after the launch, or
        None)."""
        seen.clear()
        results = generate(prompts, [guide] * args.batch, model=model, tokenizer=tok,
                           max_new_tokens=steps + 1, max_batch_size=args.batch,
                           decoder="capturable", cuda_graph=True, device="cuda",
                           factory=factory, host_node=args.host_node)
        torch.cuda.synchronize()
        kind, stats = seen[-1] if seen else ("?", None)
        return results, kind, stats
    run.batch_after_launch = None  # type: ignore[attr-defined]
    return run


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("profile_cupti: no CUDA device, nothing profiled")
        return 0
    cupti, libcupti = None, None
    if args.tracer == "cupti":
        try:
            cupti, libcupti = _load_cupti()
        except (ImportError, OSError) as e:
            print(f"profile_cupti: CUPTI is not available ({type(e).__name__}: {e}); install "
                  f"cupti-python (tools/prepare_gpu_run.sh carries its wheel)", file=sys.stderr)
            return 3
    if args.host_node is not None:
        why = _sibling("bench_graph_replay").native_host_node_support()
        if why is not None:
            print(f"profile_cupti: --host-node {args.host_node}: not available ({why})",
                  file=sys.stderr)
            return 2
    from capgraph import _nvtx  # after NVTX_INJECTION64_PATH: the domain is live or not now

    run = _workload(args)
    run(args.warmup)
    if cupti is None:
        run(args.steps)
        print("profile_cupti: workload run without a tracer")
        return 0
    trace = CuptiTrace(cupti)
    trace.start()
    try:
        results, kind, stats = run(args.steps)
    finally:
        records = drop_nested_driver(trace.stop())
    offset = clock_offset_ns(cupti.get_timestamp, time.monotonic_ns)
    for node in (node_record(stats, offset), node_wait_record(stats, offset)):
        if node is not None:
            records.append(node)
    main_thread = threading.get_native_id()
    print(f"profile_cupti: {torch.cuda.get_device_name()}, libcupti {libcupti}, NVTX "
          f"{'live' if _nvtx.ACTIVE else 'inactive (no injection: no ranges recorded)'}, "
          f"{kind} host node, {len(records)} records ({results.timings.steps} decode steps "
          f"in generate)")
    for name, why in trace.unavailable.items():
        print(f"  activity {name}: not enabled ({why})")
    for error in trace.errors:
        print(f"  record conversion error: {error}")
    marker = args.step_marker
    if getattr(run, "batch_after_launch", None) is not None and marker == STEP_MARKER:
        marker = ""  # (no range has this name: each step starts at its graph launch)
        print("  each step's batch was made after its launch: steps start at their graph launch")
    text, analysis = analyse(records, main_thread, marker, args.max_lines, args.summary_rows)
    print(text)
    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "libcupti": libcupti,
        "nvtx_active": _nvtx.ACTIVE, "host_node": kind, "args": vars(args),
        "node_stats": None if stats is None else list(stats), "unavailable": trace.unavailable,
        "errors": trace.errors, **analysis}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
