"""What xgrammar's ``CompiledGrammar.serialize_json`` costs against a grammar's rule count, and
how the disk cache's estimate (:func:`capgraph.grammar.disk_cache.serialized_bytes_estimate`)
compares: an EBNF chain ``root ::= r0``, ``r{i} ::= r{i+1}`` per size, on a small vocabulary.

    python tools/serialize_cost.py                  # 250 500 1000 rules
    python tools/serialize_cost.py --rules 250 2000

Prints per size: compile and serialize seconds, ``memory_size_bytes``, the text's length, the
estimate and the text / estimate ratio (the cache serializes only what its estimate allows,
so the ratio must stay below 1), and the process's peak RSS so far (sizes run in the order
given, so give them ascending to read each peak as that size's).
"""

from __future__ import annotations

import argparse
import resource
import time

import xgrammar as xgr

from capgraph.grammar.disk_cache import serialized_bytes_estimate


def chain(rules: int) -> str:
    """An EBNF grammar of ``rules`` rules, each referring to the next; the last is "a"."""
    lines = ["root ::= r0"]
    lines += [f"r{i} ::= r{i + 1}" for i in range(rules - 1)]
    lines.append(f'r{rules - 1} ::= "a"')
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rules", type=int, nargs="+", default=[250, 500, 1000])
    args = parser.parse_args(argv)
    vocab = [chr(ord("a") + i) for i in range(26)] + ["</s>"]
    compiler = xgr.GrammarCompiler(xgr.TokenizerInfo(vocab, stop_token_ids=[26]))
    print(f"{'rules':>6} {'compile s':>9} {'serialize s':>11} {'memory B':>10} {'text B':>12} "
          f"{'estimate B':>12} {'text/est':>8} {'peak RSS MB':>11}")
    for rules in args.rules:
        start = time.perf_counter()
        compiled = compiler.compile_grammar(chain(rules))
        compile_s = time.perf_counter() - start
        start = time.perf_counter()
        text = compiled.serialize_json()
        serialize_s = time.perf_counter() - start
        memory = int(compiled.memory_size_bytes)
        estimate = serialized_bytes_estimate(memory, str(compiled.grammar).count("::="))
        peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"{rules:>6} {compile_s:>9.3f} {serialize_s:>11.2f} {memory:>10} {len(text):>12} "
              f"{estimate:>12} {len(text) / estimate:>8.2f} {peak_mb:>11.0f}")


if __name__ == "__main__":
    main()
