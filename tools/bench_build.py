#!/usr/bin/env python3
"""Host build time per decode step: GuidedDecoder vs a plain loop calling xgrammar directly.

Both sides advance the same JSON-schema requests through the same valid texts, one golden token
(plus ``--draft`` draft tokens) per request per step, and fill one bitmask row per guided
position; the plain loop does it serially with ``xgrammar.GrammarMatcher``, the decoder with its
own bookkeeping, dead-end guard and multi-threaded batch fill. Figures are medians over steps,
measured side by side in one run; the ratio capgraph/plain is the figure of merit (< 1 is
faster).

    python tools/bench_build.py --batches 1 8 32 128 --draft 0 4 --tokenizer tekken mistral-sp32k
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone

import torch
import xgrammar as xgr

from capgraph import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from capgraph.bitmask import allocate_host_bitmask
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation, load_tokenizer

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
    """A long valid instance of SCHEMA, varied per request."""
    rooms = [{"kind": ("single", "double")[(i + j) % 2], "count": j + 1} for j in range(6)]
    return json.dumps({"name": "book_hotel", "arguments": {
        "city": f"Springfield {i}", "dates": [f"2026-0{1 + j % 9}-1{j % 10}" for j in range(6)],
        "guests": 2 + i % 5, "notes": "late arrival, quiet room, near the elevator " * 2,
        "rooms": rooms}})


def run(tokenizer_name: str, batch: int, draft: int, steps: int, threads: int) -> dict:
    tok = load_tokenizer(tokenizer_name)
    config = GuidedDecodingConfig.from_tokenizer(tok, fill_threads=threads)
    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, json.dumps(SCHEMA))
    texts = [encode_continuation(tok, instance(i)) for i in range(batch)]
    stride = 1 + draft
    steps = min(steps, min(len(t) for t in texts) // stride - 1)
    V = config.vocab_size_padded

    # -- capgraph ----------------------------------------------------------------------------
    dec = GuidedDecoder(config, batch, draft)
    dec.add_batch([GuidedRequest.context(i, i, params) for i in range(batch)])
    dec.build()
    ours = []
    for s in range(steps):
        reqs = [GuidedRequest.generation(i, i, params, t[s * stride],
                                         draft_tokens=t[s * stride + 1:(s + 1) * stride],
                                         num_accepted_draft_tokens=draft)
                for i, t in enumerate(texts)]
        t0 = time.perf_counter()
        dec.add_batch(reqs)
        failed = dec.build()
        ours.append(time.perf_counter() - t0)
        assert not failed, failed

    # -- plain xgrammar loop ----------------------------------------------------------------
    compiled = dec.grammar_matcher_factory.compile(params).payload
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(batch)]
    bitmask = allocate_host_bitmask(batch * stride, V)
    for i, m in enumerate(matchers):
        m.fill_next_token_bitmask(bitmask, i * stride)
    plain = []
    for s in range(steps):
        t0 = time.perf_counter()
        for i, (m, t) in enumerate(zip(matchers, texts)):
            for j in range(stride):
                assert m.accept_token(t[s * stride + j])
                m.fill_next_token_bitmask(bitmask, i * stride + j)
        plain.append(time.perf_counter() - t0)
    dec.close()
    o, p = statistics.median(ours), statistics.median(plain)
    return {"tokenizer": tokenizer_name, "vocab": V, "batch": batch, "draft": draft,
            "steps": steps, "capgraph_ms": o * 1e3, "plain_ms": p * 1e3, "ratio": o / p}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--draft", type=int, nargs="+", default=[0])
    ap.add_argument("--tokenizer", nargs="+", default=["tekken"])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--threads", type=int, default=0, help="batch-fill threads (0 = cores)")
    ap.add_argument("--json", help="write every figure here")
    args = ap.parse_args()
    rows = []
    print(f"{'tokenizer':<14}{'V':>8}{'batch':>6}{'draft':>6}{'plain ms':>10}"
          f"{'capgraph ms':>12}{'ratio':>7}")
    for name in args.tokenizer:
        for draft in args.draft:
            for b in args.batches:
                r = run(name, b, draft, args.steps, args.threads)
                rows.append(r)
                print(f"{name:<14}{r['vocab']:>8}{b:>6}{draft:>6}{r['plain_ms']:>10.3f}"
                      f"{r['capgraph_ms']:>12.3f}{r['ratio']:>7.2f}", flush=True)
    if args.json:
        meta = {"date": datetime.now(timezone.utc).isoformat(), "machine": platform.platform(),
                "cpus": os.cpu_count(), "python": sys.version.split()[0],
                "torch": torch.__version__, "xgrammar": xgr.__version__}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
