"""Decoder memory: buffer bytes against the layout's prediction, and allocations per step.

Buffers: for each tokenizer, slot count S and draft length D, ``GuidedDecoder.memory_bytes()``
(host and device) and CapturableGuidedDecoder's extra pinned buffers are compared with what the
layout predicts: ``rows = S * (D + 1)``, bitmask ``rows * ceil(V / 32) * 4`` bytes, token mask
``rows * 4``; the capturable decoder adds ``new_tokens`` ``(D + 1) * S * 4``,
``draft_new_tokens``, ``num_accepted_tokens`` and ``accepted_draft_nodes`` ``S * 4`` each, and
the step ticket 4. Device bytes are 0 on CPU (the device buffers are the host buffers) and on
CUDA equal the host bitmask and token mask plus the masked argmax's scratch (``execute_argmax``,
``2 * rows * 8``; the capturable decoder adds its ticket ring there, ``TICKET_RING * 4``).

Allocations per step, in steady state (after warm-up), for B guided requests on real JSON
texts and static logits, in three paths: the eager decoder (``add_batch`` + ``execute``), the
capturable decoder run eagerly on the CPU stand-in (``add_batch`` + ``prepare`` + ``execute``,
callbacks on host-stream threads) and the capturable decoder captured once into a
``hostfunc.HostGraph`` and replayed (``add_batch`` + ``replay`` + drain):

* torch CPU allocations: ``torch.profiler`` with ``profile_memory=True``, each allocation
  attributed to the innermost op around it. The profiler only records the thread that started
  it, so the capturable path is counted with its callbacks run inline on that thread (the same
  functions in the same order; a replay runs those same callbacks again);
* Python allocations: ``tracemalloc`` (it traces every thread): blocks still held after the
  measured steps minus before, per step (0 = nothing accumulates), and the transient peak per
  step.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
import tracemalloc
from collections import Counter
from typing import Any, Callable

from .common import Column, pick, print_table

HELP = "buffer bytes vs the layout's prediction, and allocations per steady-state step"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", nargs="+", help="for the buffer table (default tekken "
                   "mistral-sp32k)")
    p.add_argument("--slots", type=int, nargs="+", help="max_num_sequences (default 8 64 256)")
    p.add_argument("--draft", type=int, nargs="+", help="max_num_draft_tokens (default 0 4)")
    p.add_argument("--batch", type=int, help="guided requests in the allocation loop (default 8)")
    p.add_argument("--steps", type=int, help="measured steps (default 50)")
    p.add_argument("--warmup", type=int, help="steps before measuring (default 20)")
    p.add_argument("--alloc-tokenizer", help="tokenizer of the allocation loop (default tekken)")


# -- buffers -----------------------------------------------------------------------------------
def predicted_bytes(slots: int, draft: int, vocab: int, device: str) -> dict[str, int]:
    rows = slots * (draft + 1)
    words = -(-vocab // 32)
    host = rows * words * 4 + rows * 4
    extra = (draft + 1) * slots * 4 + 3 * slots * 4 + 4
    return {"rows": rows, "host": host, "device": 0 if device == "cpu" else host + rows * 16,
            "capturable_extra_host": extra}


def buffer_rows(tokenizers: list[str], slots_list: list[int], drafts: list[int],
                device: str) -> list[dict]:
    from capgraph import GuidedDecodingConfig
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import load_tokenizer

    rows = []
    for name in tokenizers:
        config = GuidedDecodingConfig.from_tokenizer(load_tokenizer(name))
        factory = create_matcher_factory(config)
        V = config.vocab_size_padded
        for slots in slots_list:
            for draft in drafts:
                want = predicted_bytes(slots, draft, V, device)
                eager = GuidedDecoder(config, slots, draft, device=device, factory=factory)
                capt = CapturableGuidedDecoder(config, slots, draft, device=device,
                                               factory=factory)
                got = eager.memory_bytes()
                extra = sum(t.nbytes for t in (capt.new_tokens, capt.draft_new_tokens,
                                               capt.num_accepted_tokens,
                                               capt.accepted_draft_nodes, capt._ticket))
                capt_got = capt.memory_bytes()
                row = {"tokenizer": name, "vocab": V, "slots": slots, "draft": draft,
                       "rows": got["rows"], "host": got["host"], "device": got["device"],
                       "capturable_host": capt_got["host"],
                       "capturable_extra_host": extra,
                       "predicted_host": want["host"], "predicted_device": want["device"],
                       "predicted_capturable_host": want["host"] + want["capturable_extra_host"],
                       "host_per_slot": (got["host"]) / slots,
                       "capturable_host_per_slot": capt_got["host"] / slots,
                       "pinned": bool(eager.bitmask_host.is_pinned())}
                row["matches_layout"] = (row["host"] == want["host"]
                                         and row["device"] == want["device"]
                                         and row["capturable_host"]
                                         == row["predicted_capturable_host"]
                                         and capt_got["host"] == got["host"] + extra)
                rows.append(row)
                capt.close()
        factory.close()
    return rows


BUFFER_COLUMNS = [Column("tokenizer", "tokenizer"), Column("vocab", "V"),
                  Column("slots", "slots"), Column("draft", "draft"), Column("rows", "rows"),
                  Column(lambda r: r["host"] / 2**20, "host MiB", ".3f"),
                  Column("device", "device B"),
                  Column(lambda r: r["host_per_slot"] / 1024, "host KiB/slot", ".2f"),
                  Column("capturable_extra_host", "capturable extra B"),
                  Column(lambda r: r["predicted_host"] / 2**20, "predicted MiB", ".3f"),
                  Column(lambda r: "yes" if r["matches_layout"] else "NO", "as predicted")]


# -- allocations per step ----------------------------------------------------------------------
class InlineBackend:
    """A hostfunc backend that runs each callback at once on the launching thread.

    Only for counting torch allocations: torch.profiler sees the thread that started it, not
    the host-stream threads. Same callbacks, same order; nothing is captured.
    """

    name = "inline"

    def launch(self, fn: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        fn(*args, **kwargs)

    def is_capturing(self) -> bool:
        return False

    def wait_all(self, timeout: float | None) -> None:
        from hostfunc.host_stream import all_streams
        for stream in all_streams():
            stream.synchronize(timeout)


class StepLoop:
    """B guided requests stepping through valid JSON texts with static logits.

    ``kind``: ``"eager"`` (GuidedDecoder), ``"capturable"`` (eager use of the capturable
    decoder) or ``"replay"`` (the capturable decoder's step captured once into a HostGraph).
    """

    def __init__(self, kind: str, factory, tok, batch: int) -> None:
        import torch

        import hostfunc
        from capgraph import GuidedDecodingParams
        from capgraph.capturable import CapturableGuidedDecoder
        from capgraph.decoder import GuidedDecoder
        from capgraph.tokenizers import encode_continuation

        from .build import SCHEMA, instance

        self.kind = kind
        self.params = GuidedDecodingParams.json_schema(json.dumps(SCHEMA))
        self.texts = [encode_continuation(tok, instance(i)) for i in range(batch)]
        V = factory.config.vocab_size_padded
        gen = torch.Generator().manual_seed(0)
        self.source = torch.randn(batch, V, generator=gen)
        self.logits = self.source.clone()  # static: the replayed graph masks this tensor
        cls = GuidedDecoder if kind == "eager" else CapturableGuidedDecoder
        self.dec = cls(factory.config, batch, 0, factory=factory)
        self.step_index = 0
        self.graph = None
        if kind == "replay":
            self.dec.add_batch(self._requests(0))  # shapes for the capture
            self.graph = hostfunc.HostGraph()
            with hostfunc.capture(self.graph):
                self.dec.execute(self.logits)

    @property
    def max_steps(self) -> int:
        return min(len(t) for t in self.texts)

    def _requests(self, s: int):
        from capgraph.requests import GuidedRequest
        if s == 0:
            return [GuidedRequest.context(i, i, self.params) for i in range(len(self.texts))]
        return [GuidedRequest.generation(i, i, self.params, t[s - 1])
                for i, t in enumerate(self.texts)]

    def step(self) -> None:
        import hostfunc
        from capgraph.capturable import CapturableGuidedDecoder

        s = self.step_index
        self.step_index += 1
        self.logits.copy_(self.source)
        dec = self.dec
        dec.add_batch(self._requests(s))
        if self.kind == "eager":
            failed = dec.execute(self.logits)
        elif self.kind == "capturable" and isinstance(dec, CapturableGuidedDecoder):
            dec.prepare()
            dec.execute(self.logits)
            failed = dec.take_failed_requests()
        else:
            self.graph.replay()  # type: ignore[union-attr]
            hostfunc.drain()
            failed = dec.take_failed_requests()
        if failed:
            raise RuntimeError(f"{self.kind} step {s} failed: {failed}")

    def close(self) -> None:
        if self.graph is not None:
            self.graph.reset()
        self.dec.close()  # stops the factory's compile pool too; it restarts on demand


def count_torch_allocations(loop: StepLoop, steps: int) -> dict:
    """torch CPU allocations during ``steps`` steps, each attributed to the innermost aten op
    around it and the innermost capgraph function that called it."""
    import contextlib

    from torch.profiler import ProfilerActivity, profile

    import hostfunc

    inline = hostfunc.use_backend(InlineBackend()) if loop.kind == "capturable" \
        else contextlib.nullcontext()
    with inline, profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                         with_stack=True) as prof:
        for _ in range(steps):
            loop.step()
    events = prof.profiler.kineto_results.events()  # type: ignore[union-attr]
    spans = [e for e in events if e.name() != "[memory]"]
    allocs = [e for e in events if e.name() == "[memory]" and e.nbytes() > 0]
    sites: Counter[str] = Counter()
    nbytes = 0
    for a in allocs:
        t, thread = a.start_ns(), a.start_thread_id()
        around = sorted((e for e in spans if e.start_thread_id() == thread
                         and e.start_ns() <= t <= e.end_ns()),
                        key=lambda e: e.end_ns() - e.start_ns())
        op = next((e.name() for e in around if e.name().startswith("aten::")), "(no op)")
        caller = next((e.name() for e in around if "capgraph/" in e.name()
                       and "capgraph/bench/" not in e.name()), "(outside capgraph)")
        sites[f"{op} in {_short(caller)}"] += 1
        nbytes += a.nbytes()
    return {"allocations": len(allocs), "per_step": len(allocs) / steps,
            "bytes_per_step": nbytes / steps,
            "sites_per_step": {k: v / steps for k, v in sites.most_common()},
            "counted_inline": loop.kind == "capturable"}


def _short(frame: str) -> str:
    """``.../capgraph/ops/torch_impl.py(52): _row_spans`` -> ``ops/torch_impl.py:_row_spans``."""
    path, _, func = frame.partition(": ")
    path = path.split("capgraph/", 1)[-1].split("(")[0]
    return f"{path}:{func}" if func else path


def count_python_allocations(loop: StepLoop, steps: int, settle: int = 5) -> dict:
    """tracemalloc over two windows of ``steps`` steps after ``settle`` traced steps: the net
    change of live blocks in each (a leak grows both in proportion; a few objects in flight at
    the snapshot are a constant), and each step's transient peak above its starting level."""
    from array import array

    peaks = array("d", bytes(8 * 2 * steps))  # filled in place: no Python object per step
    gc.collect()
    tracemalloc.start(1)
    snapshots = []
    try:
        for _ in range(settle):
            loop.step()
        for i in range(2 * steps):
            if i % steps == 0:
                gc.collect()
                snapshots.append(tracemalloc.take_snapshot())
            start = tracemalloc.get_traced_memory()[0]
            tracemalloc.reset_peak()
            loop.step()
            peaks[i] = tracemalloc.get_traced_memory()[1] - start
        gc.collect()
        snapshots.append(tracemalloc.take_snapshot())
    finally:
        tracemalloc.stop()
    ignore = [tracemalloc.Filter(False, tracemalloc.__file__)]
    snapshots = [snap.filter_traces(ignore) for snap in snapshots]
    windows: list[dict[str, Any]] = []
    for before, after in zip(snapshots, snapshots[1:]):
        # by allocating line: the same live object reached through another caller is no change
        diff = after.compare_to(before, "lineno")
        windows.append({
            "net_blocks": sum(d.count_diff for d in diff),
            "net_bytes": sum(d.size_diff for d in diff),
            "changed_sites": [{"count_diff": d.count_diff, "size_diff": d.size_diff,
                               "where": f"{d.traceback[0].filename}:{d.traceback[0].lineno}"}
                              for d in sorted((d for d in diff if d.count_diff),
                                              key=lambda d: -abs(d.count_diff))[:8]]})
    return {"window_steps": steps, "windows": windows,
            "net_blocks_per_step": windows[-1]["net_blocks"] / steps,
            "transient_peak_bytes_median": statistics.median(peaks),
            "transient_peak_bytes_max": max(peaks)}


def allocation_rows(tokenizer: str, batch: int, warmup: int, steps: int) -> list[dict]:
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import load_tokenizer

    tok = load_tokenizer(tokenizer)
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok))
    rows = []
    try:
        for kind in ("eager", "capturable", "replay"):
            loop = StepLoop(kind, factory, tok, batch)
            try:
                n = min(steps, (loop.max_steps - warmup - 6) // 4)
                for _ in range(warmup):
                    loop.step()
                t0 = time.perf_counter()
                for _ in range(n):
                    loop.step()
                step_ms = (time.perf_counter() - t0) / n * 1e3
                torch_counts = count_torch_allocations(loop, n) if kind != "replay" else {
                    "note": "not counted: the replayed callbacks are the capturable path's, "
                    "and torch.profiler cannot see the host-stream thread that runs them"}
                py = count_python_allocations(loop, n)
            finally:
                loop.close()
            row = {"path": kind, "tokenizer": tokenizer, "vocab": factory.config.vocab_size_padded,
                   "batch": batch, "steps": n, "step_ms": step_ms, "torch": torch_counts,
                   "python": py}
            rows.append(row)
            print(f"  {kind}: torch allocations/step "
                  f"{torch_counts.get('per_step', 'n/a')}, python net blocks in two windows "
                  f"of {n} steps {[w['net_blocks'] for w in py['windows']]}, transient peak "
                  f"{py['transient_peak_bytes_median'] / 1024:.1f} KiB", flush=True)
    finally:
        factory.close()
    return rows


ALLOC_COLUMNS = [Column("path", "path"), Column("batch", "batch"), Column("steps", "steps"),
                 Column("step_ms", "step ms", ".3f"),
                 Column(lambda r: r["torch"].get("per_step"), "torch allocs/step", ".1f"),
                 Column(lambda r: (r["torch"]["bytes_per_step"] / 1024
                                   if "bytes_per_step" in r["torch"] else None),
                        "torch KiB/step", ".1f"),
                 Column(lambda r: " / ".join(str(w["net_blocks"]) for w in r["python"]["windows"]),
                        "py net blocks (2 windows)"),
                 Column(lambda r: r["python"]["transient_peak_bytes_median"] / 1024,
                        "py transient KiB/step", ".1f")]


def run(args: argparse.Namespace) -> dict:
    import torch

    q = args.quick
    tokenizers = pick(args.tokenizer, q, ["mistral-sp32k"], ["tekken", "mistral-sp32k"])
    slots = pick(args.slots, q, [8], [8, 64, 256])
    drafts = pick(args.draft, q, [0, 2], [0, 4])
    batch = pick(args.batch, q, 4, 8)
    steps = pick(args.steps, q, 6, 50)
    warmup = pick(args.warmup, q, 4, 20)
    alloc_tok = pick(args.alloc_tokenizer, q, "mistral-sp32k", "tekken")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    buffers = buffer_rows(tokenizers, slots, drafts, device)
    print_table(BUFFER_COLUMNS, buffers)
    allocs = allocation_rows(alloc_tok, batch, warmup, steps)
    print_table(ALLOC_COLUMNS, allocs)
    for row in allocs:
        sites = row["torch"].get("sites_per_step")
        if sites:
            print(f"  {row['path']} torch allocations per step by op: " + ", ".join(
                f"{k} {v:g}" for k, v in sites.items()))
    return {"device": device, "buffers": buffers, "rows": allocs,
            "all_buffers_as_predicted": all(r["matches_layout"] for r in buffers)}
