"""Why a length-limited JSON string admits no escape on xgrammar: what each way of allowing
escapes costs, one run.

xgrammar writes a string with ``minLength`` / ``maxLength`` as ``"\\"" chars{min,max} "\\""``
where ``chars`` is one character class; capgraph repairs the class (no raw control
character) and keeps it one class. A JSON escape (``\\"``, ``\\n``) is two characters of text
for one character of the string, so allowing it needs a unit longer than a class. This
compiles, for each ``--lengths`` limit, ``{"d": string of 1..limit}`` four ways over the
bundled tokenizer (xgrammar's cache off) and feeds each a text that holds escapes where the
way allows them:

- ``class``: capgraph's grammar (the repaired class repeated; no escape),
- ``rule``: the character rule given an escape alternative (``raw | "\\\\" [...]``),
- ``automaton``: the string as one ``Regex(..., json_string=false)`` automaton,
- ``regex rules``: the same regex as ``Grammar.from_regex``'s rules.

Each side's masks are timed token by token until the text ends or ``--budget`` seconds of
masks have passed (some sides take seconds a mask).

    python tools/bench_length_escapes.py
    python tools/bench_length_escapes.py --lengths 16 64 --budget 2
"""

from __future__ import annotations

import argparse
import json
import sys
import time

UNIT = r'(?:[^\x00-\x1f"\\]|\\["\\/bfnrt])'
TEXT = 'The quick "brown" fox\njumps over the lazy dog; ' * 8


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="tekken", help="bundled tokenizer")
    parser.add_argument("--lengths", type=int, nargs="+", default=[16, 64, 300])
    parser.add_argument("--budget", type=float, default=5.0,
                        help="seconds of masks per side and length")
    args = parser.parse_args(argv)

    import xgrammar as xgr

    from capgraph import GuidedDecodingConfig
    from capgraph.bench.common import Column, mask_cells, mask_columns, print_table
    from capgraph.grammar.semantics import ebnf_escape
    from capgraph.grammar.xgrammar_backend import (_JSON_STRING_CHARS, _repaired, _reparsed,
                                                   build_tokenizer_info)
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    info = build_tokenizer_info(GuidedDecodingConfig.from_tokenizer(tok))
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    rows = []
    for limit in args.lengths:
        schema = {"type": "object", "properties": {"d": {
            "type": "string", "minLength": 1, "maxLength": limit}}, "required": ["d"]}
        capgraph = _repaired(xgr.Grammar.from_json_schema(json.dumps(schema)))
        text = str(capgraph)
        rule = f"(({_JSON_STRING_CHARS}) | (\"\\\\\" [\\\"\\\\/bfnrt]))"
        escaped = _reparsed("\n".join(
            f"{line.split(' ::= ')[0]} ::= {rule}" if line.startswith("root_prop_0_characters ::=")
            else line for line in text.splitlines()))
        regex = f'\\{{"d": "{UNIT}{{1,{limit}}}"\\}}'
        grammars = {"class": capgraph, "rule": escaped,
                    "automaton": xgr.Grammar.from_ebnf(f'root ::= Regex("{ebnf_escape(regex)}")'),
                    "regex rules": xgr.Grammar.from_regex(regex)}
        plain = TEXT.replace('"', "'").replace("\n", " ")[:limit]
        for side, grammar in grammars.items():
            written = json.dumps({"d": plain if side == "class" else TEXT[:limit]})
            compiler = xgr.GrammarCompiler(info, cache_enabled=False)
            start = time.perf_counter()
            compiled = compiler.compile_grammar(grammar)
            compile_ms = (time.perf_counter() - start) * 1e3
            matcher = xgr.GrammarMatcher(compiled)
            times: list[float] = []
            for token in encode_continuation(tok, written):
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                times.append(time.perf_counter() - start)
                if not matcher.accept_token(token):
                    raise SystemExit(f"maxLength {limit}: the {side} grammar refuses token "
                                     f"{len(times) - 1} of {written!r}")
                if sum(times) > args.budget:
                    break
            rows.append({"limit": limit, "side": side, "escapes": side != "class",
                         "compile": compile_ms, **mask_cells(times)})
    print_table([Column("limit", "maxLength"), Column("side", "string as"),
                 Column("escapes", "escapes"), *mask_columns(".0f", "masks timed")], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
