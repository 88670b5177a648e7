#!/usr/bin/env python3
"""The host time a replayed guided decode step adds to an unguided one, as ``generate()``
spends it.

In a loop that synchronises every step (``capgraph.runtime.generate``), the GPU waits while the
host prepares the next replay, so every microsecond of host work before the launch lengthens
the step. A guided step adds two pieces of it: before the launch, the guide driver's
``begin_decode`` (the step's request objects and the capturable decoder's ``add_batch``), and
after the sync, ``take_failed`` (failures interpreted; the native node's record of a step is
read there only where it holds more than counters, else by the next ``begin_decode`` once its
step is queued, as in this tool's teacher-forced steps). This
tool times exactly those calls (``capgraph.runtime.guide.GuideDriver``, the engine's own), one
replayed step at a time, on a captured graph of the decoder's step alone (static logits, no
forward): every request under the bundled tool-call schema, teacher-forced along valid tool
calls (each block of steps starts new requests with a context step, untimed).

It prints, per batch size, the median over steps of each piece in microseconds, per step and
per request. ``--device cpu`` (default) runs the CPU stand-in (``hostfunc.HostGraph``);
``--device cuda`` a CUDA graph, where ``add_batch`` also enqueues its step ticket and token
event on the stream.

The blocks alternate between the two orders of a step: ``before`` (the batch made before the
replay: begin_decode, replay, sync, take_failed) and ``after`` (replay, then begin_decode while
the replay runs, sync, take_failed: ``CapturableGuidedDecoder.set_batch_after_launch``, what
``generate()`` does on CUDA graphs). ``--forward-us`` (CPU stand-in only) captures a native
spin of that many microseconds before the step, the forward's stand-in, so that the wall time
per step shows what each order leaves on the step's path; the ``forward`` column is a replay
of that spin alone. (The CPU stand-in's step also masks the logits on the CPU, which a GPU
does in a kernel: read the orders against each other.)

    python tools/bench_guided_host.py --batches 8 64 256 --blocks 8 --forward-us 400
    python tools/bench_guided_host.py --device cuda --json guided_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from types import SimpleNamespace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 64, 256])
    ap.add_argument("--blocks", type=int, default=6, help="blocks of decode steps per batch")
    ap.add_argument("--steps", type=int, default=16,
                    help="timed decode steps per block (at most the shortest text's tokens)")
    ap.add_argument("--tokenizer", default="tekken")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--forward-us", type=float, default=0.0,
                    help="a native spin captured before the step (CPU stand-in only)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.forward_us < 0 or (args.forward_us and args.device != "cpu"):
        ap.error("--forward-us must be >= 0, and is for the CPU stand-in only")

    import torch

    import hostfunc
    from hostfunc.backend import active_backend
    from capgraph.bench.spec import tool_call_workload
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.runtime.guide import GuideDriver

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_guided_host: no CUDA device; nothing measured")
        return 0
    factory, params, texts = tool_call_workload(args.tokenizer)
    config = factory.config
    steps = min(args.steps, min(len(t) for t in texts) - 1)
    V = config.vocab_size_padded

    from hostfunc.native import test_functions
    spin = test_functions().spin_ns if args.forward_us else None
    spin_ns = int(args.forward_us * 1000)

    rows = []
    print(f"device {args.device}, {steps} decode steps x {args.blocks} blocks per batch (the "
          f"orders in turn), forward stand-in {args.forward_us:g} us; median us per step "
          "(per request)")
    print(f"{'batch':>5} {'begin_decode':>16} {'take_failed':>14} {'host total':>16} "
          f"{'node us/step':>12} {'forward':>8} {'step before':>11} {'step after':>10} "
          f"{'after/before':>12}")
    for batch in args.batches:
        decoder = CapturableGuidedDecoder(config, batch, 0, device=args.device,
                                          factory=factory, host_node="native")
        driver = GuideDriver(decoder, 0)
        logits = torch.zeros(batch, V, device=args.device)
        driver.begin_capture(batch)
        if args.device == "cuda":
            with decoder.warmup():
                decoder.execute(logits)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                driver.tokens_ready()
                driver.apply(logits)
            forward = None
        else:
            graph = hostfunc.HostGraph()
            with hostfunc.capture(graph):
                driver.tokens_ready()
                if spin is not None:
                    hostfunc.launch_native(spin, spin_ns)
                driver.apply(logits)
            forward = hostfunc.HostGraph()
            with hostfunc.capture(forward):
                if spin is not None:
                    hostfunc.launch_native(spin, spin_ns)
        orders = ["before", "after"] if hasattr(decoder, "set_batch_after_launch") else \
            ["before"]

        def sync() -> None:
            # the step's work done, as generate() waits for it: a device sync on CUDA, the
            # HostStreams' own wait on the CPU stand-in; not hostfunc.drain(), whose drain
            # hooks would read a native node's record with a failure before take_failed is
            # timed
            if args.device == "cuda":
                torch.cuda.synchronize()
            else:
                active_backend().wait_all(None)

        begin: list[float] = []
        take: list[float] = []
        wall: dict[str, list[float]] = {order: [] for order in orders}
        alone: list[float] = []
        next_index = 0
        for block in range(args.blocks):
            order = orders[block % len(orders)]
            if order == "after":
                decoder.set_batch_after_launch(10.0)
            seqs = []
            for i in range(batch):
                seqs.append(SimpleNamespace(index=next_index, seq_slot=i, guide=params,
                                            output=[], accepted_prev=0,
                                            text=texts[(block * batch + i) % len(texts)]))
                next_index += 1
            driver.begin_context(seqs)
            driver.apply(torch.zeros(batch, V, device=args.device))
            sync()
            if driver.take_failed():
                raise RuntimeError("a context request failed")
            for s in seqs:
                s.output.append(s.text[0])
            for k in range(1, steps + 1):
                t0 = time.perf_counter()
                if order == "after":
                    graph.replay()
                    t_begin = time.perf_counter()
                    driver.begin_decode(seqs, None, pad_to=batch)
                    t1 = time.perf_counter()
                    t0_host = t_begin
                else:
                    t0_host = t0
                    driver.begin_decode(seqs, None, pad_to=batch)
                    t1 = time.perf_counter()
                    graph.replay()
                sync()
                t2 = time.perf_counter()
                failed = driver.take_failed()
                t3 = time.perf_counter()
                if failed:
                    raise RuntimeError(f"a teacher-forced request failed: {failed[0]}")
                begin.append(t1 - t0_host)
                take.append(t3 - t2)
                wall[order].append(t3 - t0)
                for s in seqs:
                    s.output.append(s.text[k])
                if forward is not None and spin is not None:
                    t0 = time.perf_counter()
                    forward.replay()
                    hostfunc.drain()
                    alone.append(time.perf_counter() - t0)
            for s in seqs:
                driver.release(s.seq_slot)
            if order == "after":
                decoder.set_batch_after_launch(None)
        stats = decoder.host_node_stats
        node_us = stats.busy_ns / max(stats.runs, 1) / 1e3 if stats is not None else None
        driver.close()
        b_us = statistics.median(begin) * 1e6
        t_us = statistics.median(take) * 1e6
        total = [(a + b) * 1e6 for a, b in zip(begin, take)]
        h_us = statistics.median(total)
        step_us = {order: statistics.median(v) * 1e6 for order, v in wall.items() if v}
        f_us = statistics.median(alone) * 1e6 if alone else None
        ratio = (step_us["after"] / step_us["before"]
                 if "after" in step_us and "before" in step_us else None)
        rows.append({"batch": batch, "begin_decode_us": b_us, "take_failed_us": t_us,
                     "host_us": h_us, "host_us_per_request": h_us / batch,
                     "node_us_per_step": node_us, "steps": len(begin),
                     "forward_us": f_us, "step_before_us": step_us.get("before"),
                     "step_after_us": step_us.get("after"), "after_over_before": ratio})
        node = f"{node_us:12.1f}" if node_us is not None else f"{'-':>12}"

        def cell(value, width, spec=".1f"):
            return f"{value:{width}{spec}}" if value is not None else f"{'-':>{width}}"

        print(f"{batch:>5} {b_us:8.1f} ({b_us / batch:5.2f}) {t_us:6.1f} ({t_us / batch:5.2f}) "
              f"{h_us:8.1f} ({h_us / batch:5.2f}) {node} {cell(f_us, 8)} "
              f"{cell(step_us.get('before'), 11)} {cell(step_us.get('after'), 10)} "
              f"{cell(ratio, 12, '.3f')}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "steps_per_block": steps, "blocks": args.blocks,
                       "forward_us": args.forward_us, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
