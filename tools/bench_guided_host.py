#!/usr/bin/env python3
"""The host time a replayed guided decode step adds to an unguided one, as ``generate()``
spends it.

In a loop that synchronises every step (``capgraph.runtime.generate``), the GPU waits while the
host prepares the next replay, so every microsecond of host work before the launch lengthens
the step. A guided step adds two pieces of it: before the launch, the guide driver's
``begin_decode`` (the step's request objects and the capturable decoder's ``add_batch``), and
after the sync, ``take_failed`` (the native node's records read, failures interpreted). This
tool times exactly those calls (``capgraph.runtime.guide.GuideDriver``, the engine's own), one
replayed step at a time, on a captured graph of the decoder's step alone (static logits, no
forward): every request under the bundled tool-call schema, teacher-forced along valid tool
calls (each block of steps starts new requests with a context step, untimed).

It prints, per batch size, the median over steps of each piece in microseconds, per step and
per request. ``--device cpu`` (default) runs the CPU stand-in (``hostfunc.HostGraph``);
``--device cuda`` a CUDA graph, where ``add_batch`` also enqueues its step ticket and token
event on the stream.

    python tools/bench_guided_host.py --batches 8 64 256 --blocks 8
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
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()

    import torch

    import hostfunc
    from capgraph import GuidedDecodingConfig, GuidedDecodingParams, GuideType
    from capgraph.bench.spec import compact, tool_calls
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.demo import bundled_schema
    from capgraph.grammar import create_matcher_factory
    from capgraph.runtime.guide import GuideDriver
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_guided_host: no CUDA device; nothing measured")
        return 0
    tok = load_tokenizer(args.tokenizer)
    config = GuidedDecodingConfig.from_tokenizer(tok)
    factory = create_matcher_factory(config)
    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, json.dumps(bundled_schema()))
    texts = [encode_continuation(tok, compact(c)) for c in tool_calls()]
    steps = min(args.steps, min(len(t) for t in texts) - 1)
    V = config.vocab_size_padded

    rows = []
    print(f"device {args.device}, {steps} decode steps x {args.blocks} blocks per batch; "
          "median us per step (per request)")
    print(f"{'batch':>5} {'begin_decode':>16} {'take_failed':>14} {'host total':>16} "
          f"{'node us/step':>12}")
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
        else:
            graph = hostfunc.HostGraph()
            with hostfunc.capture(graph):
                driver.tokens_ready()
                driver.apply(logits)

        def sync() -> None:
            if args.device == "cuda":
                torch.cuda.synchronize()
            hostfunc.drain()

        begin: list[float] = []
        take: list[float] = []
        next_index = 0
        for block in range(args.blocks):
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
                driver.begin_decode(seqs, None, pad_to=batch)
                t1 = time.perf_counter()
                graph.replay()
                sync()
                t2 = time.perf_counter()
                failed = driver.take_failed()
                t3 = time.perf_counter()
                if failed:
                    raise RuntimeError(f"a teacher-forced request failed: {failed[0]}")
                begin.append(t1 - t0)
                take.append(t3 - t2)
                for s in seqs:
                    s.output.append(s.text[k])
            for s in seqs:
                driver.release(s.seq_slot)
        stats = decoder.host_node_stats
        node_us = stats.busy_ns / max(stats.runs, 1) / 1e3 if stats is not None else None
        driver.close()
        b_us = statistics.median(begin) * 1e6
        t_us = statistics.median(take) * 1e6
        total = [(a + b) * 1e6 for a, b in zip(begin, take)]
        h_us = statistics.median(total)
        rows.append({"batch": batch, "begin_decode_us": b_us, "take_failed_us": t_us,
                     "host_us": h_us, "host_us_per_request": h_us / batch,
                     "node_us_per_step": node_us, "steps": len(begin)})
        node = f"{node_us:12.1f}" if node_us is not None else f"{'-':>12}"
        print(f"{batch:>5} {b_us:8.1f} ({b_us / batch:5.2f}) {t_us:6.1f} ({t_us / batch:5.2f}) "
              f"{h_us:8.1f} ({h_us / batch:5.2f}) {node}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "steps_per_block": steps, "blocks": args.blocks,
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
