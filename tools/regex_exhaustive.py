"""Every short text against xgrammar's reading of random regexes, judged by regex_walk's own
matcher. Where ``regex_walk.py`` walks the masks (what a model could write), this asks the
grammar capgraph gives xgrammar about every text up to ``--length`` characters over each
regex's own characters (its letters, digits, spaces and ``_`` / ``-``, shuffled, at most
four, and ``q``), so a construct read wider or narrower shows up even where random walks
rarely reach it. Two readings per regex: a REGEX guide's grammar (``_regex_grammar``: one
automaton, or ``Grammar.from_regex``'s rules) and an EBNF guide's ``Regex("...")`` element
(``_ebnf_grammar``: the automaton, or the rules where xgrammar would give the automaton a
repeat edge, written into the printed grammar and read back), each from the regex as
``ecma_regex`` writes it for xgrammar.
xgrammar's character-level matcher (``xgrammar.testing``) answers; no tokenizer is involved.

    python tools/regex_exhaustive.py                   # 1500 regexes, texts up to 4
    python tools/regex_exhaustive.py --regexes 5000 --seed 3 --length 5

Exit status 1 if any text is read otherwise than the judge reads it.
"""

from __future__ import annotations

import argparse
import itertools
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import regex_walk  # noqa: E402


def alphabet(regex: regex_walk.Regex, rng: random.Random) -> list[str]:
    """Up to four characters the regex spells (letters, digits, spaces, '_', '-'), and 'q'."""
    chars = sorted({c for c in regex.text if c.isalnum() or c in " _-"})
    rng.shuffle(chars)
    return chars[:4] + ["q"]


def disagreements(regexes: list[regex_walk.Regex], length: int, seed: int
                  ) -> tuple[dict[str, int], list[str]]:
    """Counts per reading (``refused``, ``checked``, ``disagree``) and a line per regex with
    a text read otherwise than the judge reads it (the first such text)."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from capgraph.grammar.semantics import ebnf_escape, ecma_regex
    from capgraph.grammar.xgrammar_backend import _ebnf_grammar, _regex_grammar

    rng = random.Random(seed)
    counts = {"regexes": len(regexes), "refused": 0, "checked": 0, "disagree": 0}
    found: list[str] = []
    for regex in regexes:
        try:
            written = ecma_regex(regex.text, "xgrammar")
            readings = {"regex": _regex_grammar(written),
                        "ebnf": _ebnf_grammar(f'root ::= Regex("{ebnf_escape(written)}")')}
            for grammar in readings.values():  # (one xgrammar cannot build is refused)
                accepts(grammar, "")
        except Exception:  # noqa: BLE001 - refused: nothing is generated from it
            counts["refused"] += 1
            continue
        counts["checked"] += 1
        chars = alphabet(regex, rng)
        texts = ("".join(t) for n in range(length + 1)
                 for t in itertools.product(chars, repeat=n))
        for text in texts:
            want = regex_walk.matches(regex, text)
            wrong = [name for name, grammar in readings.items()
                     if accepts(grammar, text) != want]
            if wrong:
                counts["disagree"] += 1
                found.append(f"{regex.text!r} as {'/'.join(wrong)}: {text!r} "
                             f"{'refused' if want else 'taken'}")
                break
    return counts, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--regexes", type=int, default=1500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--length", type=int, default=4, help="longest text checked")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    counts, found = disagreements(regex_walk.random_regexes(args.regexes, args.seed),
                                  args.length, args.seed)
    for line in found[:20]:
        print("  " + line)
    print(f"{counts['regexes']} regexes (seed {args.seed}), {counts['refused']} refused, "
          f"{counts['checked']} checked on every text up to {args.length} characters: "
          f"{counts['disagree']} read otherwise than ECMA-262 "
          f"({time.perf_counter() - start:.0f} s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
