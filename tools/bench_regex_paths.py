"""A regex as xgrammar's automaton or as grammar rules: compile and per-token mask time, one run.

xgrammar 0.2.9 turns a regex into a grammar two ways: a ``Regex("...")`` element (an EBNF
guide's, a JSON-schema ``pattern``) is built into one automaton; ``Grammar.from_regex`` (a
REGEX guide in xgrammar) writes grammar rules. capgraph gives each path the regex as
:func:`capgraph.grammar.semantics.ecma_regex` writes it for xgrammar, and compiles a REGEX
guide as the automaton but where xgrammar would make a repeat an edge of the automaton
(the ``capgraph`` column: ``_regex_grammar`` in the xgrammar backend). This compiles each
regex both ways (xgrammar's cache off) over the bundled tokenizer's vocabulary, feeds a text
of its language token by token to a matcher of each, the two timed alternately on the same
token (``fill_next_token_bitmask``, fastest of ``--repeat`` passes per token), and prints
per regex and overall (``capgraph``: each regex on the path capgraph picks).

    python tools/bench_regex_paths.py
    python tools/bench_regex_paths.py --repeat 9 --tokenizer qwen
"""

from __future__ import annotations

import argparse
import sys
import time

#: (name, regex, a text of its language): shapes JSON schemas' patterns take
CASES = [
    ("email", r"[A-Za-z0-9._%+-]+@[A-Za-z0-9.-]+\.[A-Za-z]{2,}", "john.smith+news@example.co.uk"),
    ("uuid", r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}",
     "123e4567-e89b-12d3-a456-426614174000"),
    ("date", r"\d{4}-\d{2}-\d{2}", "2024-01-31"),
    ("slug", r"[a-z0-9_-]{3,16}", "hello_world-42"),
    ("phone", r"\+?[1-9]\d{1,14}", "+14155552671"),
    ("no-angle", r"[^<>]*", "A free text field, with punctuation; numbers 12345 and words."),
    ("words", r"\w+(\s\w+)*", "the quick brown fox jumps over the lazy dog again"),
    ("ipv4", r"((25[0-5]|2[0-4]\d|[01]?\d?\d)\.){3}(25[0-5]|2[0-4]\d|[01]?\d?\d)",
     "192.168.100.254"),
    ("semver", r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(-[0-9A-Za-z.-]+)?", "10.2.33-rc.1"),
    ("url", r"https?://[^\s/$.?#].[^\s]*", "https://example.com/path/to/page?query=1#frag"),
    ("long-repeat", r"[A-Za-z0-9]{1,255}", "abcdefghijklmnopqrstuvwxyz0123456789ABCDEFGHIJ"),
    ("opt-group", r"[A-Z]{3}(-[0-9]+)?", "ABC-12345"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="tekken", help="bundled tokenizer")
    parser.add_argument("--repeat", type=int, default=5, help="passes over each text")
    args = parser.parse_args(argv)

    import xgrammar as xgr

    from capgraph import GuidedDecodingConfig
    from capgraph.bench.common import (Column, fastest_masks, print_mask_summary,
                                       print_table)
    from capgraph.grammar.semantics import ebnf_escape, ecma_regex
    from capgraph.grammar.xgrammar_backend import _regex_grammar, build_tokenizer_info
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    tok = load_tokenizer(args.tokenizer)
    info = build_tokenizer_info(GuidedDecodingConfig.from_tokenizer(tok))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(1, info.vocab_size)
    sides = ("automaton", "rules")
    masks: dict[str, list[float]] = {side: [] for side in (*sides, "capgraph")}
    rows = []
    for name, regex, text in CASES:
        written = ecma_regex(regex, "xgrammar")
        automaton = f'root ::= Regex("{ebnf_escape(written)}")'
        grammars = {"automaton": xgr.Grammar.from_ebnf(automaton),
                    "rules": xgr.Grammar.from_regex(written)}
        picked = str(_regex_grammar(written)).startswith("root ::= Regex(")
        row: dict = {"name": name, "capgraph": "automaton" if picked else "rules"}
        compiled = {}
        for side in sides:
            start = time.perf_counter()
            compiled[side] = compiler.compile_grammar(grammars[side])
            row[f"compile_{side}"] = (time.perf_counter() - start) * 1e3
        tokens = encode_continuation(tok, text)
        best = fastest_masks(compiled, tokens, args.repeat, bitmask, f"{name}: {text!r}")
        row["tokens"] = len(tokens)
        for side in sides:
            masks[side] += best[side]
            row[f"mask_{side}"] = sum(best[side]) / len(tokens) * 1e3
        masks["capgraph"] += best[row["capgraph"]]
        row["ratio"] = row["mask_rules"] / row["mask_automaton"]
        rows.append(row)
    print_table([Column("name", "regex"), Column("tokens", "tokens"),
                 Column("mask_automaton", "automaton ms/token", ".4f"),
                 Column("mask_rules", "rules ms/token", ".4f"),
                 Column("ratio", "rules / automaton", ".3g"), Column("capgraph", "capgraph"),
                 Column("compile_automaton", "compile automaton ms", ".1f"),
                 Column("compile_rules", "compile rules ms", ".1f")], rows)
    print()
    print_mask_summary(masks, "regex as")
    return 0


if __name__ == "__main__":
    sys.exit(main())
