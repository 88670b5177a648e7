#!/usr/bin/env python3
"""The native build's fill threads: host time per decode step against the batch size, per
thread count, and where the pool starts to pay (the crossover that sets
``capgraph.build.library.POOL_MIN_REQUESTS``).

    python tools/bench_fill_threads.py [--batches 1 2 4 ... 256] [--threads 1 2 4 8 16]
        [--min-requests 1] [--draft 0] [--steps 60] [--tokenizer tekken] [--json PATH] [--quick]

Workload: the bundled JSON schemas (``capgraph bench build``'s hotel-booking schema and the
tool-call schema of ``capgraph/data``), xgrammar backend, every other request on each, each
request advancing through a valid instance of its schema one token (plus ``--draft`` drafts)
per step. One decoder per thread count (``native_fill_threads=T``, its pool used at every
step from ``--min-requests`` requests on, ``adaptive=False``: 1, the default, uses it at every
batch so the crossover shows), plus one with the library's defaults (``native_fill_threads=0``,
automatic, from ``POOL_MIN_REQUESTS`` requests on where the pool has been the faster lately:
the "auto" column). Per step every decoder runs in turn, the order
rotating (so machine load hits all alike); a step's time is its ``GuidedDecoder.build()``
(``add_batch`` is not timed; it does not change with the threads). Figures are medians over
steps; each ratio is a median over steps of that step's time / the one-thread decoder's, both
measured in the same step; "pool share" is the share of the requests the pool's threads ran
(the rest ran on the calling thread). Thread counts above the usable cores are skipped unless
given explicitly. Checks that every decoder masks the same rows as the one-thread one, step by
step.

``--quick`` (batches 1 8 64, threads 1 2, 12 steps) finishes in under 30 s.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from capgraph.bench.common import (Column, describe_machine, machine_info, median,  # noqa: E402
                                   print_table, write_json)

FULL_BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]
FULL_THREADS = [1, 2, 4, 8, 16]


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def workload(tok: Any, batch: int, draft: int) -> tuple[list[Any], list[list[int]]]:
    """Per request its guide and the token ids of a valid instance of its schema."""
    from capgraph import GuidedDecodingParams
    from capgraph.bench.build import SCHEMA, instance
    from capgraph.bench.spec import compact, tool_calls
    from capgraph.demo import bundled_schema
    from capgraph.tokenizers import encode_continuation

    hotel = GuidedDecodingParams.json_schema(json.dumps(SCHEMA))
    tool = GuidedDecodingParams.json_schema(json.dumps(bundled_schema()))
    calls = tool_calls()
    guides, texts = [], []
    for i in range(batch):
        if i % 2 == 0:
            guides.append(hotel)
            texts.append(encode_continuation(tok, instance(i)))
        else:
            guides.append(tool)
            texts.append(encode_continuation(tok, compact(calls[i % len(calls)])))
    return guides, texts


def measure(factory: Any, tok: Any, batch: int, threads: list[int], min_requests: int,
            draft: int, steps: int) -> dict[str, Any]:
    """One batch size: every thread count (and the defaults) over ``steps`` alternated steps."""
    import dataclasses

    from capgraph.build.library import POOL_MIN_REQUESTS
    from capgraph.decoder import GuidedDecoder
    from capgraph.requests import GuidedRequest

    guides, texts = workload(tok, batch, draft)
    stride = 1 + draft
    per_round = min(len(t) for t in texts) // stride - 1  # steps before a text runs out
    names = [f"t{t}" for t in threads] + ["auto"]
    decs: dict[str, GuidedDecoder] = {}
    for name, t in zip(names, threads + [0]):
        config = dataclasses.replace(factory.config, native_fill_threads=t, native_build="on")
        dec = GuidedDecoder(config, batch, draft, factory=factory, host_build="native")
        if name != "auto":
            dec.host_build.builder.set_fill_threads(t, min_requests, adaptive=False)
        decs[name] = dec

    def start_round() -> None:  # fresh matchers: every request at the start of its text
        for dec in decs.values():
            dec.add_batch([GuidedRequest.context(i, i, g) for i, g in enumerate(guides)])
            failed = dec.build()
            if failed:
                raise RuntimeError(f"context step failed: {failed}")

    times: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in names}
    used: dict[str, set[int]] = {n: set() for n in names}
    pooled: dict[str, int] = {n: 0 for n in names}
    done = 0
    position = per_round
    while done < steps:
        if position >= per_round:
            start_round()
            position = 0
        s = position
        reqs = [GuidedRequest.generation(i, i, g, t[s * stride],
                                         draft_tokens=t[s * stride + 1:(s + 1) * stride],
                                         num_accepted_draft_tokens=draft)
                for i, (g, t) in enumerate(zip(guides, texts))]
        step_times = {}
        masks = {}
        for j in range(len(names)):
            name = names[(done + j) % len(names)]
            dec = decs[name]
            dec.add_batch(reqs)
            t0 = time.perf_counter()
            failed = dec.build()
            step_times[name] = time.perf_counter() - t0
            if failed:
                raise RuntimeError(f"{name} step {s} failed: {failed}")
            rows = dec.requests.num_bitmask_tokens
            masks[name] = (dec.token_mask_host[:rows].tolist(),
                           dec.bitmask_host[:rows].clone())
            stats = dec.host_build.builder.last_step()
            used[name].add(stats.threads)
            pooled[name] += stats.pool_requests
        first = masks[names[0]]
        for name in names[1:]:
            if masks[name][0] != first[0] or not bool((masks[name][1] == first[1]).all()):
                raise RuntimeError(f"batch {batch}: {name} masked other rows than {names[0]}")
        for name in names:
            times[name].append(step_times[name])
            ratios[name].append(step_times[name] / step_times[names[0]])
        position += 1
        done += 1
    for dec in decs.values():
        dec.close()
    row: dict[str, Any] = {"batch": batch, "draft": draft, "steps": steps,
                           "min_requests": min_requests, "auto_min_requests": POOL_MIN_REQUESTS}
    for name in names:
        row[f"{name}_us"] = median(times[name]) * 1e6
        row[f"{name}_ratio"] = median(ratios[name])
        row[f"{name}_threads_used"] = sorted(used[name])
        row[f"{name}_pool_requests"] = pooled[name]
    for name in names:  # the share of the requests the pool's threads ran
        row[f"{name}_pool_share"] = pooled[name] / (batch * steps)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", help=f"default {FULL_BATCHES}")
    p.add_argument("--threads", type=int, nargs="+",
                   help=f"thread counts (1 is always measured; default {FULL_THREADS}, those "
                        "up to the usable cores)")
    p.add_argument("--min-requests", type=int, default=1,
                   help="the pool's threshold for the T-thread decoders (default 1: always)")
    p.add_argument("--draft", type=int, default=0, help="draft tokens per request (default 0)")
    p.add_argument("--steps", type=int, help="timed steps per batch (default 60; quick 12)")
    p.add_argument("--tokenizer", default="tekken", help="a bundled tokenizer (default tekken)")
    p.add_argument("--json", help="also write the rows and the machine to this file")
    p.add_argument("--quick", action="store_true", help="batches 1 8 64, threads 1 2, 12 steps")
    args = p.parse_args(argv)

    from capgraph import GuidedDecodingConfig
    from capgraph.build import library
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import load_tokenizer

    reason = library.unavailable_reason()
    if reason is not None:
        print(f"the native build is unavailable here: {reason}", file=sys.stderr)
        return 2
    cores = usable_cores()
    batches = args.batches or ([1, 8, 64] if args.quick else FULL_BATCHES)
    if args.threads:
        threads = sorted(set(args.threads) | {1})
    else:
        threads = [t for t in ([1, 2] if args.quick else FULL_THREADS) if t <= max(cores, 2)]
    steps = args.steps or (12 if args.quick else 60)
    if min(batches) < 1 or min(threads) < 1 or args.min_requests < 1 or steps < 1 \
            or args.draft < 0:
        p.error("batches, threads, --min-requests and --steps must be >= 1, --draft >= 0")
    info = machine_info()
    print(f"# {describe_machine(info)}; usable cores {cores}; threads {threads}; "
          f"auto = {library.automatic_fill_threads()} threads from "
          f"{library.POOL_MIN_REQUESTS} requests", flush=True)
    tok = load_tokenizer(args.tokenizer)
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok))
    rows = []
    try:
        for batch in batches:
            row = measure(factory, tok, batch, threads, args.min_requests, args.draft, steps)
            rows.append(row)
            cells = ", ".join(f"{t}T {row[f't{t}_us']:.0f} us ({row[f't{t}_ratio']:.2f})"
                              for t in threads)
            print(f"  batch {batch}: {cells}, auto {row['auto_us']:.0f} us "
                  f"({row['auto_ratio']:.2f})", flush=True)
    finally:
        factory.close()
    columns = [Column("batch", "batch")]
    for t in threads:
        columns.append(Column(f"t{t}_us", f"{t} thr us/step", ".0f"))
    for t in threads[1:]:
        columns.append(Column(f"t{t}_ratio", f"{t} thr / 1", ".2f"))
    for t in threads[1:]:
        columns.append(Column(f"t{t}_pool_share", f"{t} thr pool share", ".2f"))
    columns += [Column("auto_us", "auto us/step", ".0f"), Column("auto_ratio", "auto / 1", ".2f"),
                Column("auto_pool_share", "auto pool share", ".2f")]
    print_table(columns, rows)
    if args.json:
        path = write_json("fill_threads", {
            "rows": rows, "machine": info, "usable_cores": cores, "threads": threads,
            "tokenizer": args.tokenizer, "argv": sys.argv[1:],
            "method": "median over steps of GuidedDecoder.build() per decoder, decoders "
                      "alternating within each step; ratio: median of per-step time / the "
                      "1-thread decoder's in the same step"}, args.json)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
