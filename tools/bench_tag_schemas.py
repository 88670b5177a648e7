"""A structural tag's JSON schemas as xgrammar converts them or as capgraph gives them: the
conversion, the compile and the per-token mask time, one run.

A tool-calling tag holds one ``json_schema`` element per tool. xgrammar converts each element
itself; capgraph gives each plain element to xgrammar as a ``grammar`` element holding the
repaired grammar of the JSON-schema guide of that schema (``_tag_schemas_repaired`` in the
xgrammar backend: no raw control character in a length-limited string, no listed name
spelled with an escape as an additional one, long-repeat patterns as rules). This takes the
first ``--tools`` schemas of the bundled JSON Schema Bench sample's tool-call categories
(BFCL, Glaiveai2K) that capgraph's policy admits, puts them in one ``triggered_tags`` tag
(``<f{i}>`` ... ``</f>``), and for each side measures the conversion (best of ``--repeat``),
the compile (xgrammar's cache off) and the mask time of every token of each tool's first
instance written inside its tag (the two matchers timed alternately on the same token,
fastest of ``--repeat`` passes).

    python tools/bench_tag_schemas.py
    python tools/bench_tag_schemas.py --tools 32 --repeat 5
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from importlib import resources

CATEGORIES = ("BFCL", "Glaiveai2K")


def tool_schemas() -> list[tuple[dict, object]]:
    """``(schema, first instance)`` of each tool-call schema of the bundled sample."""
    text = resources.files("capgraph").joinpath("data/jsonschemabench.jsonl").read_text()
    found = []
    for line in text.splitlines():
        rec = json.loads(line)
        if rec["category"] in CATEGORIES and rec["instances"]:
            found.append((rec["schema"], rec["instances"][0]))
    return found


def tag_of(schemas: list[dict]) -> str:
    return json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<f"], "tags": [
            {"begin": f"<f{i}>", "content": {"type": "json_schema", "json_schema": schema},
             "end": "</f>"} for i, schema in enumerate(schemas)]}})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="tekken", help="bundled tokenizer")
    parser.add_argument("--tools", type=int, default=16, help="tool schemas in the tag")
    parser.add_argument("--repeat", type=int, default=3, help="passes (conversion, masks)")
    args = parser.parse_args(argv)

    import xgrammar as xgr

    from capgraph import GuidedDecodingConfig, GuidedDecodingParams
    from capgraph.bench.common import (Column, fastest_masks, print_mask_summary,
                                       print_table)
    from capgraph.errors import GrammarCompileError
    from capgraph.grammar import create_matcher_factory
    from capgraph.grammar.xgrammar_backend import (_tag_regexes_faster, _tag_schemas_prepared,
                                                   _tag_schemas_repaired)
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok))
    tools = []
    try:
        for schema, instance in tool_schemas():
            if len(tools) == args.tools:
                break
            try:  # capgraph's policy admits it (xgrammar enforces every keyword)
                factory.compile(GuidedDecodingParams.structural_tag(tag_of([schema])))
            except GrammarCompileError:
                continue
            tools.append((schema, instance))
    finally:
        factory.close()
    if not tools:
        raise SystemExit("no tool schema of the sample compiles")
    tag = _tag_schemas_prepared(tag_of([schema for schema, _ in tools]))
    convert = {"xgrammar": lambda: xgr.Grammar.from_structural_tag(tag),
               "capgraph": lambda: xgr.Grammar.from_structural_tag(
                   _tag_schemas_repaired(_tag_regexes_faster(tag)))}
    sides = tuple(convert)
    compiler = xgr.GrammarCompiler(factory.tokenizer_info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, factory.tokenizer_info.vocab_size)
    row: dict = {"tools": len(tools)}
    compiled = {}
    for side in sides:
        best = float("inf")
        for _ in range(max(1, args.repeat)):
            start = time.perf_counter()
            grammar = convert[side]()
            best = min(best, time.perf_counter() - start)
        row[f"convert_{side}"] = best * 1e3
        start = time.perf_counter()
        compiled[side] = compiler.compile_grammar(grammar)
        row[f"compile_{side}"] = (time.perf_counter() - start) * 1e3
    masks: dict[str, list[float]] = {side: [] for side in sides}
    for i, (_, instance) in enumerate(tools):
        tokens = encode_continuation(tok, f"<f{i}>{json.dumps(instance)}</f>")
        best = fastest_masks(compiled, tokens, args.repeat, bitmask, f"tool {i}'s instance")
        for side in sides:
            masks[side] += best[side]
    print_table([Column("tools", "tools"),
                 Column("convert_xgrammar", "convert xgrammar ms", ".1f"),
                 Column("convert_capgraph", "convert capgraph ms", ".1f"),
                 Column("compile_xgrammar", "compile xgrammar ms", ".0f"),
                 Column("compile_capgraph", "compile capgraph ms", ".0f")], [row])
    print()
    print_mask_summary(masks, "schemas as")
    return 0


if __name__ == "__main__":
    sys.exit(main())
