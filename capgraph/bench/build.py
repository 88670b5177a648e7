"""Host build time per decode step: GuidedDecoder next to a plain loop calling xgrammar directly.

Both sides advance the same JSON-schema requests through the same valid texts (encoded with
:func:`capgraph.tokenizers.encode_continuation`), one golden token plus ``draft`` draft tokens
per request per step, and fill one bitmask row per guided position. The plain loop does it
serially with ``xgrammar.GrammarMatcher``; the decoder with its bookkeeping and dead-end guard,
through its C++ build loop (``GuidedDecodingConfig.native_build``) and, in the same run, through
its Python build. They alternate step by step (so a change of machine load hits all) and the
figures are medians over steps; capgraph / plain is the figure of merit (< 1: capgraph is
faster).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import time

from .common import Column, median, percentile, pick, print_table

HELP = "host time per step to advance matchers and fill masks, vs a plain xgrammar loop"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["search_flights", "book_hotel", "get_weather"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "dates": {"type": "array", "items": {"type": "string",
                                                     "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}},
                "guests": {"type": "integer", "minimum": 1},
                "notes": {"type": "string"},
                "rooms": {"type": "array", "items": {
                    "type": "object",
                    "properties": {"kind": {"type": "string", "enum": ["single", "double"]},
                                   "count": {"type": "integer"}},
                    "required": ["kind", "count"]}},
            },
            "required": ["city", "dates", "guests"],
        },
    },
    "required": ["name", "arguments"],
}


def instance(i: int) -> str:
    """A long valid instance of :data:`SCHEMA`, varied per request ``i``."""
    rooms = [{"kind": ("single", "double")[(i + j) % 2], "count": j + 1} for j in range(6)]
    return json.dumps({"name": "book_hotel", "arguments": {
        "city": f"Springfield {i}", "dates": [f"2026-0{1 + j % 9}-1{j % 10}" for j in range(6)],
        "guests": 2 + i % 5, "notes": "late arrival, quiet room, near the elevator " * 2,
        "rooms": rooms}})


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8 32 128)")
    p.add_argument("--draft", type=int, nargs="+", help="draft lengths (default 0 4)")
    p.add_argument("--tokenizer", nargs="+",
                   help="bundled tokenizers (default tekken mistral-sp32k)")
    p.add_argument("--steps", type=int, help="timed steps per case (default 40)")
    p.add_argument("--threads", type=int, default=1,
                   help="capgraph batch-fill threads (default 1, the library default; "
                        "0 = xgrammar's auto)")


def run(args: argparse.Namespace) -> dict:
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import load_tokenizer

    q = args.quick
    batches = pick(args.batches, q, [1, 8], [1, 8, 32, 128])
    drafts = pick(args.draft, q, [0, 4], [0, 4])
    tokenizers = pick(args.tokenizer, q, ["mistral-sp32k"], ["tekken", "mistral-sp32k"])
    steps = pick(args.steps, q, 8, 40)
    rows = []
    for name in tokenizers:
        tok = load_tokenizer(name)
        config = GuidedDecodingConfig.from_tokenizer(tok, fill_threads=args.threads)
        factory = create_matcher_factory(config)
        try:
            for draft in drafts:
                for batch in batches:
                    row = measure(tok, name, factory, batch, draft, steps)
                    rows.append(row)
                    py = "" if row["python_ms"] is None else \
                        f", python build {row['python_ms']:.3f} ms ({row['python_ratio']:.2f})"
                    print(f"  {name} V={row['vocab']} batch={batch} draft={draft}: plain "
                          f"{row['plain_ms']:.3f} ms, capgraph {row['capgraph_ms']:.3f} ms, "
                          f"ratio {row['ratio']:.2f}{py}", flush=True)
        finally:
            factory.close()
    print_table(COLUMNS, rows)
    return {"rows": rows, "schema": SCHEMA,
            "method": "median over steps of host time per step; plain = serial "
                      "xgrammar.GrammarMatcher accept_token + fill_next_token_bitmask; "
                      "capgraph = GuidedDecoder.add_batch + build (C++ build loop where it "
                      "builds); python = the same with native_build='off'; steps alternate"}


COLUMNS = [Column("tokenizer", "tokenizer"), Column("vocab", "V"), Column("batch", "batch"),
           Column("draft", "draft"), Column("plain_ms", "plain xgrammar ms", ".4f"),
           Column("capgraph_ms", "capgraph ms", ".4f"), Column("ratio", "capgraph/plain", ".2f"),
           Column("python_ms", "python build ms", ".4f"),
           Column("python_ratio", "python/plain", ".2f")]


def measure(tok, tokenizer_name: str, factory, batch: int, draft: int, steps: int) -> dict:
    """One case: ``batch`` requests, ``draft`` drafts each, ``steps`` alternated steps."""
    import xgrammar as xgr

    from capgraph import GuidedDecodingParams, GuideType
    from capgraph.bitmask import allocate_host_bitmask
    from capgraph.decoder import GuidedDecoder
    from capgraph.requests import GuidedRequest
    from capgraph.tokenizers import encode_continuation

    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, json.dumps(SCHEMA))
    texts = [encode_continuation(tok, instance(i)) for i in range(batch)]
    stride = 1 + draft
    steps = max(1, min(steps, min(len(t) for t in texts) // stride - 1))
    V = factory.config.vocab_size_padded

    dec = GuidedDecoder(factory.config, batch, draft, factory=factory)
    decs = [dec]
    if dec.native_build:  # the Python build too, for the before/after in one run
        decs.append(GuidedDecoder(dataclasses.replace(factory.config, native_build="off"),
                                  batch, draft, factory=factory))
    for d in decs:
        d.add_batch([GuidedRequest.context(i, i, params) for i in range(batch)])
        failed = d.build()
        if failed:
            raise RuntimeError(f"capgraph context step failed: {failed}")

    matchers = [xgr.GrammarMatcher(factory.compile(params).payload) for _ in range(batch)]
    bitmask = allocate_host_bitmask(batch * stride, V)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, i * stride)

    def ours(s: int, d: GuidedDecoder) -> float:
        reqs = [GuidedRequest.generation(i, i, params, t[s * stride],
                                         draft_tokens=t[s * stride + 1:(s + 1) * stride],
                                         num_accepted_draft_tokens=draft)
                for i, t in enumerate(texts)]
        t0 = time.perf_counter()
        d.add_batch(reqs)
        failed = d.build()
        elapsed = time.perf_counter() - t0
        if failed:
            raise RuntimeError(f"capgraph step {s} failed: {failed}")
        return elapsed

    def plain(s: int) -> float:
        t0 = time.perf_counter()
        for i, (m, t) in enumerate(zip(matchers, texts)):
            for j in range(stride):
                if not m.accept_token(t[s * stride + j]):
                    raise RuntimeError(f"plain loop: token rejected at step {s}")
                m.fill_next_token_bitmask(bitmask, i * stride + j)
        return time.perf_counter() - t0

    samples: list[list[float]] = [[] for _ in range(len(decs) + 1)]  # plain, decs...
    runs = [plain] + [functools.partial(ours, d=d) for d in decs]
    for s in range(steps):  # rotate the order so that no side always runs first
        for j in range(len(runs)):
            k = (s + j) % len(runs)
            samples[k].append(runs[k](s))
    plain_s, ours_s = samples[0], samples[1]
    o, p = median(ours_s), median(plain_s)
    py = median(samples[2]) if len(decs) > 1 else None
    return {"tokenizer": tokenizer_name, "vocab": V, "batch": batch, "draft": draft,
            "steps": steps, "native_build": dec.native_build,
            "capgraph_ms": o * 1e3, "plain_ms": p * 1e3, "ratio": o / p,
            "python_ms": None if py is None else py * 1e3,
            "python_ratio": None if py is None else py / p,
            "python_steps_ms": [round(x * 1e3, 4) for x in samples[2]] if py is not None else [],
            "capgraph_p90_ms": percentile(ours_s, 90) * 1e3,
            "plain_p90_ms": percentile(plain_s, 90) * 1e3,
            "capgraph_steps_ms": [round(x * 1e3, 4) for x in ours_s],
            "plain_steps_ms": [round(x * 1e3, 4) for x in plain_s]}
