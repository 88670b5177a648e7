"""Differential walk of Lark grammars: random outputs of ``GuidedDecoder`` under the masks of
small random Lark grammars, each finished output checked with the ``lark`` package. Every
output capgraph lets through must be in the grammar's language.

The grammars (:func:`random_lark`) mix what Lark grammars are made of and where the backends'
readings could part from Lark's: string literals (some case-insensitive), regex literals with
classes, negated classes, ranges, ``\\d`` / ``\\w`` / ``\\s`` and their negations, ``.``,
quantifiers and the ``i`` flag, over an alphabet with non-ASCII letters that have case
variants; named terminals; rules with alternatives, groups, ``?`` / ``*`` / ``+`` / ``[...]``.
Each grammar is compiled on each backend (llguidance: an ``ebnf_grammar`` guide; xgrammar: a
structural tag's Lark ``grammar`` element), walked through the public decoder API
(:func:`conformance_walk.walk_guides`: random logits tilted towards the alphabet and the stop
token, one allowed token drawn per row), and each finished output is judged by
:func:`engine_cases.lark_verdict` (the ``lark`` package's Earley parser over every length a
terminal matches whole).

    python tools/lark_walk.py                         # 300 grammars, 4 walks each
    python tools/lark_walk.py --grammars 2000 --backends xgrammar --seed 7

Exit status 1 if any output is outside its grammar. ``tests/test_lark_walk.py`` runs a short
version.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conformance_walk  # noqa: E402
import engine_cases  # noqa: E402

BACKENDS = ("xgrammar", "llguidance")
#: the characters of the grammars' literals and classes: ASCII letters with non-ASCII case
#: variants (k, s), non-ASCII letters with case variants (é, σ, Σ, ж), digits of two scripts,
#: punctuation
ALPHABET = ("a", "b", "c", "k", "K", "s", "é", "σ", "Σ", "ж", "1", "2", "١", "-", "_")
#: the walk's tilt: the alphabet's single-character tokens are drawn more often
TILT = tuple((c, 5.0) for c in ALPHABET)


def _lit(rng: random.Random) -> str:
    text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 3)))
    return '"' + text + '"' + ("i" if rng.random() < 0.2 else "")


def _class(rng: random.Random) -> str:
    members = []
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.2:
            members.append(rng.choice(("\\d", "\\w", "\\s", "\\D", "\\W", "\\S")))
        elif roll < 0.4:
            lo, hi = sorted(rng.sample(("a", "c", "k", "s", "z"), 2))
            members.append(f"{lo}-{hi}")
        else:
            char = rng.choice(ALPHABET)
            members.append("\\-" if char == "-" else char)
    return "[" + ("^" if rng.random() < 0.4 else "") + "".join(members) + "]"


def _atom(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.45:
        atom = _class(rng)
    elif roll < 0.65:
        atom = rng.choice(("\\d", "\\w", "\\s", "\\D", "\\W", "\\S", "."))
    else:
        char = rng.choice(ALPHABET)
        atom = "\\-" if char == "-" else char
    return atom + rng.choice(("", "", "+", "{1,2}"))


def _regex(rng: random.Random) -> str:
    body = "".join(_atom(rng) for _ in range(rng.randint(1, 2)))
    return "/" + body + "/" + ("i" if rng.random() < 0.3 else "")


def random_lark(rng: random.Random) -> str:
    """A small random Lark grammar (``start`` and up to a few rules and terminals), in the
    part of Lark that the ``lark`` package, llguidance and xgrammar all read; no terminal
    matches the empty string."""
    rules: list[str] = []
    terminals: list[str] = []

    def terminal() -> str:
        return _lit(rng) if rng.random() < 0.5 else _regex(rng)

    def expr(depth: int) -> str:
        roll = rng.random()
        if roll < 0.35 or depth >= 2:
            item = terminal()
        elif roll < 0.5:
            name = f"T{len(terminals)}"
            terminals.append(f"{name}: {terminal()}")
            item = name
        elif roll < 0.7:
            name = f"r{len(rules)}"
            rules.append("")  # reserve the name; the body is written below
            body = alternatives(depth + 1)
            rules[int(name[1:])] = f"{name}: {body}"
            item = name
        else:
            item = "(" + alternatives(depth + 1) + ")"
        suffix = rng.choice(("", "", "", "?", "*", "+"))
        if suffix == "" and rng.random() < 0.1:
            return "[" + item + "]"
        return item + suffix

    def sequence(depth: int) -> str:
        return " ".join(expr(depth) for _ in range(rng.randint(1, 3)))

    def alternatives(depth: int) -> str:
        return " | ".join(sequence(depth) for _ in range(rng.randint(1, 2)))

    start = f"start: {alternatives(0)}"
    return "\n".join([start, *rules, *terminals])


def random_larks(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [random_lark(rng) for _ in range(n)]


def guides(grammars: Sequence[str], backend: str) -> list[tuple[Any, Any, str]]:
    """``(params, checker, label)`` of each grammar as ``backend`` takes it."""
    out = []
    for grammar in grammars:
        case = engine_cases.Case("lark", grammar, "random")
        out.append((engine_cases.params_for(case, backend),
                    lambda text, g=grammar: engine_cases.lark_verdict(g, text), grammar))
    return out


def run(tokenizer_name: str, backends: Iterable[str], n: int, walks: int, seed: int,
        max_tokens: int) -> dict[str, conformance_walk.Counts]:
    grammars = random_larks(n, seed)
    return conformance_walk.walk_backends(
        tokenizer_name, backends, lambda backend: [(backend, guides(grammars, backend), TILT)],
        walks=walks, seed=seed, max_tokens=max_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = conformance_walk.walk_arguments((__doc__ or "").split("\n\n")[0], "grammars",
                                             BACKENDS)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    results = run(args.tokenizer, args.backends, args.grammars, args.walks, args.seed,
                  args.max_tokens)
    conformance_walk.print_counts(results, "grammars")
    print(f"({time.perf_counter() - start:.0f} s; tokenizer {args.tokenizer}, seed {args.seed})")
    return 1 if any(c.invalid for c in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
