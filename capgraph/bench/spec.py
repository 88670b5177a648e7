"""Speculation from the grammar: decode steps per output token with forced tokens as drafts.

Three workloads in one run:

* ``teacher-forced``: what a trained model emits, replayed through the grammar drafter. The
  texts are the valid instances of the bundled JSONSchemaBench subset (each checked against
  its schema with ``jsonschema``) and a fixed set of tool calls under the bundled tool-call
  schema, serialised as compact JSON (the guides are compiled with
  ``json_whitespace="compact"``, as ``generate()`` does) and encoded with the tokenizer
  (:func:`~capgraph.tokenizers.encode_continuation`), the stop token last. Per step, the
  drafter proposes at most ``--num-draft-tokens`` forced tokens at the matcher's state; the
  step accepts the drafts while they equal the text's next tokens, plus one token of its own
  (as verification does). Figures: decode steps per output token, and the share of output
  tokens that were drafted and accepted. Draft sources side by side: ``tokenizer`` (the
  tokenizer's encoding of the forced text, :class:`~capgraph.grammar.ForcedTokenEncoder`,
  what the runtime drafts), ``tokenizer-trim`` (the same without the token that reaches the
  end of the forced text) and ``xgrammar-jf`` (xgrammar's own greedy jump-forward tokens).
  Schemas are compiled with ``json_unenforced_keywords="ignore"`` (drafting is measured, not
  enforcement). An instance the grammar refuses (xgrammar does not implement every
  JSON-Schema feature) or a schema that does not compile is counted and left out.
* ``generate``: the demo's requests (tool-call schema, date regex, key=value grammar) through
  :func:`capgraph.generate` with its tiny random Llama, for no speculation, ``grammar``,
  ``ngram`` and ``grammar+ngram``: tokens per second (the fastest of ``--repeat`` runs, taken
  in rotating order), steps per token, and whether the tokens equal the non-speculative ones. A random model picks any tokenization the grammar allows, so
  fewer grammar drafts are accepted here than under teacher forcing.
* ``cost``: the host build of a batch of requests where the grammar forces nothing (a free
  JSON string), with and without the per-slot forced-token query a drafter adds
  (:meth:`GuidedDecoder.forced_tokens_batch
  <capgraph.decoder.GuidedDecoder.forced_tokens_batch>`):
  median milliseconds per step and their ratio.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, NamedTuple

from .common import Column, median, pick, print_table

HELP = "steps per token with grammar drafts: teacher-forced JSON, generation, query cost"

#: draft sources of the teacher-forced workload
SOURCES = ("tokenizer", "tokenizer-trim", "xgrammar-jf")
#: draft choices of the generation workload
DRAFTS = ("none", "grammar", "ngram", "grammar+ngram")

#: the teacher-forced tool calls: one per (tool, city, days, unit) below
TOOL_CITIES = ("Paris", "Oslo", "Tokyo", "São Paulo", "New York")
TOOL_DAYS = (1, 3, 14)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", help="bundled tokenizer (default tekken)")
    p.add_argument("--num-draft-tokens", type=int, default=8,
                   help="drafts per step, at most (default 8)")
    p.add_argument("--limit", type=int, help="the first N JSONSchemaBench schemas (default: "
                   "all; quick: the 8 smallest)")
    p.add_argument("--data", help="a JSONL file of {id, category, schema, instances} records "
                   "(default: the bundled subset)")
    p.add_argument("--max-new-tokens", type=int, help="generation workload: tokens per "
                   "request (default 64; quick 24)")
    p.add_argument("--repeat", type=int, help="generation workload: runs per drafter, in "
                   "rotating order, the fastest kept (default 3; quick 1)")
    p.add_argument("--batch", type=int, help="cost workload: requests per step (default 32; "
                   "quick 4)")
    p.add_argument("--steps", type=int, help="cost workload: timed steps (default 200; quick 20)")


def tool_calls() -> list[dict]:
    """The teacher-forced tool calls: valid under the bundled tool-call schema."""
    calls = []
    for name in ("get_weather", "get_time", "search_flights"):
        for city in TOOL_CITIES:
            for days in TOOL_DAYS:
                unit = "celsius" if (len(city) + days) % 2 else "fahrenheit"
                calls.append({"name": name,
                              "arguments": {"city": city, "days": days, "unit": unit}})
    return calls


def compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class ToolCallWorkload(NamedTuple):
    """The host benchmarks' workload: a matcher factory for a bundled tokenizer (default
    config), the bundled tool-call schema as a guide, and the :func:`tool_calls` encoded as
    compact JSON with that tokenizer (no stop token)."""

    factory: Any
    params: Any
    texts: list[list[int]]


def tool_call_workload(tokenizer: str) -> ToolCallWorkload:
    """:class:`ToolCallWorkload` for the bundled tokenizer named ``tokenizer``."""
    from capgraph import GuidedDecodingConfig, GuidedDecodingParams
    from capgraph.demo import bundled_schema
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    tok = load_tokenizer(tokenizer)
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok))
    params = GuidedDecodingParams.json_schema(bundled_schema())
    return ToolCallWorkload(factory, params,
                            [encode_continuation(tok, compact(c)) for c in tool_calls()])


def run(args: argparse.Namespace) -> dict:
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import load_tokenizer

    from .tail import chosen_records

    q = args.quick
    k = args.num_draft_tokens
    if k < 1:
        raise SystemExit(f"--num-draft-tokens={k} must be >= 1")
    tokenizer = pick(args.tokenizer, q, "tekken", "tekken")
    tok = load_tokenizer(tokenizer)
    # drafting is measured, not enforcement: a schema with keywords xgrammar does not enforce
    # is compiled as is (its valid instances are still accepted by the looser grammar)
    config = GuidedDecodingConfig.from_tokenizer(tok, json_whitespace="compact",
                                                 json_unenforced_keywords="ignore")
    factory = create_matcher_factory(config)
    try:
        records = chosen_records(args, "spec", 8)
        rows = teacher_forced(records, tok, factory, k)
        rows += generation(tok, factory, k, pick(args.max_new_tokens, q, 24, 64),
                           max(1, pick(args.repeat, q, 1, 3)))
        rows += cost(tok, factory, pick(args.batch, q, 4, 32), pick(args.steps, q, 20, 200))
    finally:
        factory.close()
    print_table(COLUMNS, rows)
    return {"rows": rows, "tokenizer": tokenizer, "num_draft_tokens": k,
            "method": "teacher-forced: steps = verification steps, each accepting the drafts "
                      "that equal the text's next tokens plus one; generate: capgraph.generate "
                      "with the demo's guides and tiny random model; cost: median host ms per "
                      "step of add_batch + build, with and without forced_tokens_batch over the batch"}


COLUMNS = [Column("workload", "workload"), Column("data", "data"), Column("drafts", "drafts"),
           Column("tokens", "tokens"), Column("steps_per_token", "steps/token", ".3f"),
           Column("accepted_share", "drafted+accepted", ".3f"),
           Column("tokens_per_s", "tokens/s", ".0f"), Column("exact", "= greedy"),
           Column("ms", "ms/step", ".4f"), Column("ratio", "ratio", ".3f")]


# -- teacher forcing -------------------------------------------------------------------------

def teacher_forced(records: list[dict], tok, factory, k: int) -> list[dict]:
    from capgraph import GuidedDecodingParams
    from capgraph.demo import bundled_schema
    from capgraph.grammar import ForcedTokenEncoder
    from capgraph.tokenizers import encode_continuation

    from .tail import valid_instances

    eos = factory.config.stop_token_ids[0]
    sets: dict[str, list[tuple[Any, list[list[int]]]]] = {"jsonschemabench": [],
                                                           "tool-calls": []}
    for record in records:
        good, _bad = valid_instances(record)
        texts = [encode_continuation(tok, compact(inst)) + [eos] for inst in good]
        if texts:
            sets["jsonschemabench"].append((record["schema"], texts))
    sets["tool-calls"].append(
        (bundled_schema(), [encode_continuation(tok, compact(c)) + [eos] for c in tool_calls()]))

    encoders: dict[str, Callable[[Any, int], list[int]]] = {
        "tokenizer": ForcedTokenEncoder(tok),
        "tokenizer-trim": ForcedTokenEncoder(tok, keep_last=False),
        "xgrammar-jf": lambda m, n: list(m.native.find_jump_forward_tokens())[:n],
    }
    rows = []
    for data, items in sets.items():
        totals = {s: [0, 0, 0] for s in SOURCES}  # tokens, steps, accepted
        counts = {"schemas_with_instances": len(items), "compile_failed": 0, "instances": 0,
                  "instances_rejected": 0}
        for schema, texts in items:
            try:
                compiled = factory.compile(GuidedDecodingParams.json_schema(json.dumps(schema)))
            except Exception:  # noqa: BLE001 - counted: xgrammar refuses some public schemas
                counts["compile_failed"] += 1
                continue
            for ids in texts:
                counts["instances"] += 1
                if not _accepts(factory.create_from_compiled(compiled), ids):
                    counts["instances_rejected"] += 1
                    continue
                for source, encode in encoders.items():
                    steps, accepted = replay(factory.create_from_compiled(compiled), ids,
                                             encode, k)
                    t = totals[source]
                    t[0] += len(ids)
                    t[1] += steps
                    t[2] += accepted
        for source in SOURCES:
            n, steps, accepted = totals[source]
            rows.append({"workload": "teacher-forced", "data": data, "drafts": source,
                         "tokens": n, "steps_per_token": steps / n if n else None,
                         "accepted_share": accepted / n if n else None, **counts})
            print(f"  teacher-forced {data} {source}: {n} tokens, "
                  f"{rows[-1]['steps_per_token'] or 0:.3f} steps/token", flush=True)
    return rows


def _accepts(matcher, ids: list[int]) -> bool:
    return all(matcher.accept_token(t) for t in ids)


def replay(matcher, ids: list[int], encode: Callable[[Any, int], list[int]], k: int
           ) -> tuple[int, int]:
    """Teacher-forced speculative decoding of ``ids``: ``(steps, drafts accepted)``."""
    pos = steps = accepted = 0
    while pos < len(ids):
        drafts = encode(matcher, k)[:len(ids) - pos - 1]
        a = 0
        while a < len(drafts) and drafts[a] == ids[pos + a]:
            a += 1
        for t in ids[pos:pos + a + 1]:  # the accepted drafts and the step's own token
            if not matcher.accept_token(t):
                raise RuntimeError(f"the matcher refused token {t} at {pos} of a text it "
                                   "accepted before")
        steps += 1
        accepted += a
        pos += a + 1
    return steps, accepted


# -- generation ------------------------------------------------------------------------------

def generation(tok, factory, k: int, max_new_tokens: int, repeat: int) -> list[dict]:
    from capgraph.demo import DEFAULT_PROMPTS, bundled_schema, demo_guides
    from capgraph.runtime import generate, tiny_llama

    guides = demo_guides(bundled_schema())
    prompts = [p for ps in DEFAULT_PROMPTS.values() for p in ps]
    gs = [guides[i // 2] for i in range(len(prompts))]
    model = tiny_llama(len(tok), seed=0, eos_token_id=tok.eos_token_id)
    best = {d: float("inf") for d in DRAFTS}
    outs: dict[str, Any] = {}
    for d in DRAFTS:  # warm-up: every drafter's first call pays its one-time costs here
        generate(prompts[:1], gs[:1], model=model, tokenizer=tok, factory=factory, draft=d,
                 num_draft_tokens=k, max_new_tokens=4)
    for r in range(repeat):  # rotating order, so load changes hit every drafter alike
        for d in DRAFTS[r % len(DRAFTS):] + DRAFTS[:r % len(DRAFTS)]:
            t0 = time.perf_counter()
            outs[d] = generate(prompts, gs, model=model, tokenizer=tok, factory=factory,
                               draft=d, num_draft_tokens=k, max_new_tokens=max_new_tokens)
            best[d] = min(best[d], time.perf_counter() - t0)
    base = [r.tokens for r in outs["none"]]
    rows = []
    for d in DRAFTS:
        out = outs[d]
        n = sum(len(r.tokens) for r in out)
        rows.append({"workload": "generate", "data": "demo", "drafts": d, "tokens": n,
                     "steps_per_token": sum(r.num_steps for r in out) / n,
                     "accepted_share": sum(r.num_accepted_draft_tokens for r in out) / n,
                     "tokens_per_s": n / best[d], "exact": [r.tokens for r in out] == base})
        print(f"  generate {d}: {n / best[d]:.0f} tokens/s (fastest of {repeat}), "
              f"{rows[-1]['steps_per_token']:.3f} steps/token", flush=True)
    return rows


# -- cost of the query -----------------------------------------------------------------------

def cost(tok, factory, batch: int, steps: int) -> list[dict]:
    """Per step, the host build of ``batch`` requests inside a free JSON string (nothing is
    forced) and then the forced-token query over the batch, timed apart on the same step."""
    from capgraph import GuidedDecodingParams
    from capgraph.decoder import GuidedDecoder
    from capgraph.requests import GuidedRequest
    from capgraph.tokenizers import encode_continuation

    schema = {"type": "object", "properties": {"text": {"type": "string"}},
              "required": ["text"], "additionalProperties": False}
    params = GuidedDecodingParams.json_schema(json.dumps(schema))
    prefix = encode_continuation(tok, '{"text":"')
    free = encode_continuation(tok, '{"text":"' + "lorem ipsum dolor sit amet " * 200)
    free = free[len(prefix):]
    if len(free) < steps:
        raise RuntimeError(f"the free text has {len(free)} tokens, fewer than {steps}")
    slots = list(range(batch))
    build_s: list[float] = []
    query_s: list[float] = []
    dec = GuidedDecoder(factory.config, batch, 0, factory=factory)
    try:
        dec.add_batch([GuidedRequest.context(i, i, params) for i in slots])
        dec.build()
        for t in prefix:  # into the free string, where nothing is forced
            dec.add_batch([GuidedRequest.generation(i, i, params, t) for i in slots])
            dec.build()
        for t in free[:steps]:
            reqs = [GuidedRequest.generation(i, i, params, t) for i in slots]
            t0 = time.perf_counter()
            dec.add_batch(reqs)
            failed = dec.build()
            t1 = time.perf_counter()
            forced = dec.forced_tokens_batch(slots, 8)
            t2 = time.perf_counter()
            if failed:
                raise RuntimeError(f"the cost workload's build failed: {failed}")
            if any(forced):
                raise RuntimeError(f"something is forced inside a free string: {forced}")
            build_s.append(t1 - t0)
            query_s.append(t2 - t1)
    finally:
        dec.close()
    build, query = median(build_s) * 1e3, median(query_s) * 1e3
    print(f"  cost batch={batch}: build {build:.4f} ms, forced_tokens_batch {query:.4f} ms "
          f"(+{query / build:.1%})", flush=True)
    return [{"workload": "cost", "data": f"batch {batch}", "drafts": "build", "ms": build},
            {"workload": "cost", "data": f"batch {batch}", "drafts": "build+forced",
             "ms": build + query, "ratio": (build + query) / build}]
