#!/usr/bin/env python3
"""What the UTF-8 guard of xgrammar matchers costs a decode step, one run.

Two decoders take the same JSON-schema requests through the same valid texts (one golden
token and ``draft`` drafts per request per step, every draft accepted), alternating step by
step: one over a factory with the UTF-8 tables (its matchers guarded, as every xgrammar
factory's are: ``capgraph.grammar.utf8``), one over a factory whose tables were removed before
any matcher was made (unguarded). Prints the median host time of ``build`` per step (accept,
fill, guard: the host work, without the mask's application) on each and their ratio, for the
C++ build and the Python build.

    python tools/bench_utf8_guard.py
    python tools/bench_utf8_guard.py --tokenizer qwen --steps 100
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default="tekken")
    p.add_argument("--steps", type=int, default=60, help="steps per row of the table")
    p.add_argument("--shapes", nargs="+", default=["1x0", "32x0", "32x4"],
                   help="batch x draft length")
    args = p.parse_args(argv)

    import torch

    from capgraph import GuidedDecodingConfig, GuidedDecodingParams
    from capgraph.bench.build import SCHEMA, instance
    from capgraph.decoder import GuidedDecoder
    from capgraph.grammar import create_matcher_factory
    from capgraph.requests import GuidedRequest
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    config = GuidedDecodingConfig.from_tokenizer(tok)
    guarded = create_matcher_factory(config)
    unguarded = create_matcher_factory(config)
    unguarded.utf8 = None  # type: ignore[attr-defined]  # (before any matcher exists)
    params = GuidedDecodingParams.json_schema(SCHEMA)
    V = config.vocab_size_padded
    print(f"{'build':8s} {'batch':>5s} {'draft':>5s} {'steps':>5s} {'guarded ms':>11s} "
          f"{'unguarded ms':>13s} {'ratio':>6s}")
    for build in ("auto", "off"):
        for shape in args.shapes:
            batch, draft = (int(x) for x in shape.split("x"))
            cfg = dataclasses.replace(config, native_build=build)
            decoders = {"guarded": GuidedDecoder(cfg, batch, draft, factory=guarded),
                        "unguarded": GuidedDecoder(cfg, batch, draft, factory=unguarded)}
            texts = [encode_continuation(tok, instance(i)) for i in range(batch)]
            times: dict[str, list[float]] = {k: [] for k in decoders}
            for d in decoders.values():
                d.add_batch([GuidedRequest.context(i, i, params) for i in range(batch)])
                d.execute(torch.zeros(batch, V))
            pos = steps = 0
            while pos + 1 + draft < min(map(len, texts)) and steps < args.steps:
                requests = [GuidedRequest.generation(
                    i, i, params, texts[i][pos], draft_tokens=texts[i][pos + 1:pos + 1 + draft],
                    num_accepted_draft_tokens=draft) for i in range(batch)]
                for name, d in decoders.items():
                    d.add_batch(requests, draft)
                    start = time.perf_counter()
                    failed = d.build()
                    times[name].append(time.perf_counter() - start)
                    if failed:
                        raise SystemExit(f"{name}: {failed}")
                pos, steps = pos + 1 + draft, steps + 1
            g, u = (statistics.median(times[k]) for k in ("guarded", "unguarded"))
            name = decoders["guarded"].host_build.name
            print(f"{name:8s} {batch:5d} {draft:5d} {steps:5d} {g * 1e3:11.3f} {u * 1e3:13.3f} "
                  f"{g / u:6.3f}")
            for d in decoders.values():
                d.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
