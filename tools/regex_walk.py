"""Differential walk of regexes: random outputs of ``GuidedDecoder`` under the masks of small
random ECMA-262 regexes, as REGEX guides and as JSON-schema ``pattern``s, each finished output
judged by a matcher of this file's own. Every output capgraph lets through must match.

Each regex is given as a REGEX guide, as a string schema's ``pattern``, and on xgrammar as an
EBNF guide's ``Regex("...")`` and a structural tag's ``regex`` element (``--kinds``).

The regexes (:func:`random_regex`) are drawn as syntax trees and written out in ECMA-262
syntax (read without flags, as capgraph's REGEX guides and JSON Schema's ``pattern`` are),
mixing what such regexes are made of and where the backends' readings could part from ECMA's:
literals written plain, as ``\\xHH``, ``\\uHHHH``, an escaped surrogate pair or a control
escape (``\\cJ``, ``\\t``, ``\\0``), ECMA's Annex B literals (an unescaped ``]``, ``}`` or
``{`` that starts no quantifier), classes with ranges, ``\\d`` / ``\\w`` / ``\\s`` and their
negations, an unescaped ``[`` or ``-`` and ``\\b`` (backspace) inside, negated classes, ``.``,
groups (capturing or not), alternatives with empty branches, greedy and lazy quantifiers,
``^`` / ``$`` at the pattern's ends, over an alphabet with non-ASCII letters, digits of another
script, the space characters ECMA's ``\\s`` has and some it has not, line terminators and a
character outside the BMP.

The judge (:func:`matches`) walks the tree itself, over code points (an escaped surrogate
pair is the one character it spells, as capgraph reads it): ``\\d`` is ``[0-9]``, ``\\w`` is
``[0-9A-Za-z_]``, ``\\s`` is ECMA's WhiteSpace and LineTerminator (every ``Zs`` space), ``.``
anything but a line terminator. No regex engine is involved, so the judge shares no reading
with the backends; ``--node`` checks it against Node's ``RegExp`` on every output that has
no character outside the BMP (where ECMA without the ``u`` flag counts UTF-16 units).

    python tools/regex_walk.py                        # 300 regexes, 4 walks each, every kind
    python tools/regex_walk.py --regexes 2000 --backends xgrammar --seed 7 --node

Exit status 1 if any output does not match its regex (or, with ``--node``, if the judge and
Node disagree). ``tests/test_regex_walk.py`` runs a short version.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import time
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence, Union

sys.path.insert(0, str(Path(__file__).resolve().parent))
import conformance_walk  # noqa: E402

BACKENDS = ("xgrammar", "llguidance")
#: how a regex is given: a REGEX guide, a string schema's ``pattern``, an EBNF guide's
#: ``Regex("...")`` and a structural tag's ``regex`` element (the last two: xgrammar's)
KINDS = ("regex", "pattern", "ebnf", "tag")
#: the kinds each backend serves
SERVED = {"xgrammar": KINDS, "llguidance": ("regex", "pattern")}

#: the characters of the regexes' literals and classes: ASCII letters and digits, a Kelvin
#: sign (folds to k), non-ASCII letters, an Arabic-Indic digit, ECMA spaces (no-break space,
#: BOM, an en quad, line separator), characters Python's or Rust's \s has but ECMA's has not
#: (U+001C, U+0085), newline and tab, regex syntax characters, and one character outside
#: the BMP
ALPHABET = ("a", "b", "k", "Z", "0", "7", "_", "\u212a", "é", "ж", "\u0661", " ", "\u00a0",
            "\ufeff", "\u2000", "\u2028", "\x1c", "\u0085", "\n", "\t", "-", ".", "*", "[",
            "]", "{", "}", "(", "|", "^", "$", "\\", "/", "\U0001f600")
#: the walk's tilt: the alphabet's single-character tokens are drawn more often
TILT = tuple((c, 5.0) for c in ALPHABET)
#: for a pattern, the closing quote too (a search pattern lets a string run on)
PATTERN_TILT = TILT + (('"', 8.0),)


def tilt(kind: str) -> tuple[tuple[str, float], ...]:
    """The walk's tilt for guides of ``kind`` (``"regex"`` or ``"pattern"``)."""
    return PATTERN_TILT if kind == "pattern" else TILT

_SYNTAX = set("^$\\.*+?()[]{}|/")
_RANGE_ENDS = ("0", "7", "A", "Z", "a", "k", "z", "é", "ж", "\u2000")
_LINE_TERMINATORS = {"\n", "\r", "\u2028", "\u2029"}
_CONTROL_ESCAPES = {"\t": "t", "\n": "n", "\r": "r", "\x0b": "v", "\x0c": "f", "\0": "0"}


# -- the syntax tree --------------------------------------------------------------------------
@dataclass(frozen=True)
class Char:
    char: str


@dataclass(frozen=True)
class Shorthand:
    letter: str  #: d, w, s, D, W or S


@dataclass(frozen=True)
class Dot:
    pass


@dataclass(frozen=True)
class Range:
    lo: str
    hi: str


@dataclass(frozen=True)
class Class:
    negated: bool
    items: tuple[Union[Char, Range, Shorthand], ...]


@dataclass(frozen=True)
class Seq:
    items: tuple["Node", ...]


@dataclass(frozen=True)
class Alt:
    branches: tuple["Node", ...]


@dataclass(frozen=True)
class Group:
    body: "Node"
    capturing: bool


@dataclass(frozen=True)
class Repeat:
    body: "Node"
    lo: int
    hi: int | None  #: None: unbounded
    lazy: bool
    form: str  #: "?", "*", "+" or "{}" (how it is written)


Node = Union[Char, Shorthand, Dot, Class, Seq, Alt, Group, Repeat]


@dataclass(frozen=True)
class Regex:
    """A random regex: its tree, whether it is anchored at either end, and its ECMA text."""
    tree: Node
    start_anchor: bool
    end_anchor: bool
    text: str


# -- what a character matches -----------------------------------------------------------------
def _ecma_space(c: str) -> bool:
    return c in "\t\x0b\x0c \u00a0\ufeff" or c in _LINE_TERMINATORS or \
        unicodedata.category(c) == "Zs"


def _shorthand(letter: str, c: str) -> bool:
    low = letter.lower()
    if low == "d":
        hit = "0" <= c <= "9"
    elif low == "w":
        hit = c.isascii() and (c.isalnum() or c == "_")
    else:
        hit = _ecma_space(c)
    return hit if letter.islower() else not hit


def _in_class(node: Class, c: str) -> bool:
    hit = False
    for item in node.items:
        if isinstance(item, Char):
            hit = item.char == c
        elif isinstance(item, Range):
            hit = item.lo <= c <= item.hi
        else:
            hit = _shorthand(item.letter, c)
        if hit:
            break
    return hit != node.negated


def _ends(node: Node, text: str, starts: frozenset[int]) -> frozenset[int]:
    """The positions where ``node`` can end a match begun at any of ``starts``."""
    if not starts:
        return starts
    if isinstance(node, (Char, Shorthand, Dot, Class)):
        out = set()
        for p in starts:
            if p < len(text):
                c = text[p]
                if isinstance(node, Char):
                    hit = c == node.char
                elif isinstance(node, Shorthand):
                    hit = _shorthand(node.letter, c)
                elif isinstance(node, Dot):
                    hit = c not in _LINE_TERMINATORS
                else:
                    hit = _in_class(node, c)
                if hit:
                    out.add(p + 1)
        return frozenset(out)
    if isinstance(node, Seq):
        for item in node.items:
            starts = _ends(item, text, starts)
        return starts
    if isinstance(node, Alt):
        return frozenset().union(*(_ends(b, text, starts) for b in node.branches))
    if isinstance(node, Group):
        return _ends(node.body, text, starts)
    # Repeat: at least lo times, then up to hi (or until nothing new is reached)
    current = starts
    for _ in range(node.lo):
        current = _ends(node.body, text, current)
    reached = set(current)
    extra = 0
    while node.hi is None or extra < node.hi - node.lo:
        current = _ends(node.body, text, current) - reached
        if not current:
            break
        reached |= current
        extra += 1
    return frozenset(reached)


def matches(regex: Regex, text: str, search: bool = False) -> bool:
    """Whether ``text`` matches ``regex`` whole (a REGEX guide), or, with ``search``, whether
    some part of it does (a JSON-schema ``pattern``), ``^`` / ``$`` tying the match to the
    text's ends."""
    if not search:
        return len(text) in _ends(regex.tree, text, frozenset([0]))
    begins = [0] if regex.start_anchor else range(len(text) + 1)
    ends = _ends(regex.tree, text, frozenset(begins))
    return len(text) in ends if regex.end_anchor else bool(ends)


# -- writing a tree out in ECMA-262 syntax ----------------------------------------------------
def _literal(c: str, rng: random.Random, in_class: bool) -> str:
    code = ord(c)
    if code > 0xFFFF:
        if rng.random() < 0.5:
            return c
        pair = c.encode("utf-16-be")
        return "".join(f"\\u{int.from_bytes(pair[i:i + 2], 'big'):04x}" for i in (0, 2))
    roll = rng.random()
    if roll < 0.15 and code < 0x100:
        return f"\\x{code:02X}"
    if roll < 0.3:
        return f"\\u{code:04x}"
    if c in _CONTROL_ESCAPES and roll < 0.6:
        return "\\" + _CONTROL_ESCAPES[c]
    if c == "\n" and roll < 0.7:
        return "\\cJ"
    if in_class:
        if c in "\\]^-" or (c == "[" and rng.random() < 0.5):
            return "\\" + c
        return c
    if c in "]}" and rng.random() < 0.5:
        return c  # Annex B: a literal
    if c in _SYNTAX:
        return "\\" + c
    return c


def _class_text(node: Class, rng: random.Random) -> str:
    parts = []
    for i, item in enumerate(node.items):
        if isinstance(item, Shorthand):
            parts.append("\\" + item.letter)
        elif isinstance(item, Range):
            parts.append(_literal(item.lo, rng, True) + "-" + _literal(item.hi, rng, True))
        elif item.char == "-" and rng.random() < 0.5 and (
                i in (0, len(node.items) - 1) or isinstance(node.items[i - 1], Shorthand)):
            # a plain '-' at either end of the class, or after \d (Annex B: '[\d-z]' is
            # a digit, '-' or 'z')
            parts.append("-")
        elif item.char == "\b":
            parts.append("\\b")
        else:
            parts.append(_literal(item.char, rng, True))
    return "[" + ("^" if node.negated else "") + "".join(parts) + "]"


def _text(node: Node, rng: random.Random) -> str:
    if isinstance(node, Char):
        return _literal(node.char, rng, False)
    if isinstance(node, Shorthand):
        return "\\" + node.letter
    if isinstance(node, Dot):
        return "."
    if isinstance(node, Class):
        return _class_text(node, rng)
    if isinstance(node, Seq):
        out = []
        for i, item in enumerate(node.items):
            piece = _text(item, rng)
            after = node.items[i + 1] if i + 1 < len(node.items) else None
            # Annex B: a '{' that starts no quantifier is a literal; only before a letter
            if piece == "\\{" and isinstance(after, Char) and after.char.isascii() and \
                    after.char.isalpha() and rng.random() < 0.5:
                piece = "{"
            out.append(piece)
        return "".join(out)
    if isinstance(node, Alt):
        return "|".join(_text(b, rng) for b in node.branches)
    if isinstance(node, Group):
        return ("(" if node.capturing else "(?:") + _text(node.body, rng) + ")"
    body = _text(node.body, rng)
    if node.form == "{}":
        if node.hi is None:
            quant = f"{{{node.lo},}}"
        elif node.hi == node.lo:
            quant = f"{{{node.lo}}}"
        else:
            quant = f"{{{node.lo},{node.hi}}}"
    else:
        quant = node.form
    return body + quant + ("?" if node.lazy else "")


# -- random trees -----------------------------------------------------------------------------
def _class(rng: random.Random) -> Class:
    items: list[Union[Char, Range, Shorthand]] = []
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        if roll < 0.2:
            items.append(Shorthand(rng.choice("dwsDWS")))
        elif roll < 0.4:
            lo, hi = sorted(rng.sample(_RANGE_ENDS, 2))
            items.append(Range(lo, hi))
        elif roll < 0.45:
            items.append(Char("\b"))
        else:
            items.append(Char(rng.choice(ALPHABET)))
    return Class(rng.random() < 0.35, tuple(items))


def _atom(rng: random.Random, depth: int) -> Node:
    roll = rng.random()
    if roll < 0.3:
        return _class(rng)
    if roll < 0.45:
        return Shorthand(rng.choice("dwsDWS"))
    if roll < 0.52:
        return Dot()
    if roll < 0.68 and depth < 2:
        return Group(_alternatives(rng, depth + 1), rng.random() < 0.5)
    return Char(rng.choice(ALPHABET))


def _piece(rng: random.Random, depth: int) -> Node:
    atom = _atom(rng, depth)
    roll = rng.random()
    if roll < 0.55:
        return atom
    lazy = rng.random() < 0.15
    if roll < 0.65:
        return Repeat(atom, 0, 1, lazy, "?")
    if roll < 0.75:
        return Repeat(atom, 0, None, lazy, "*")
    if roll < 0.85:
        return Repeat(atom, 1, None, lazy, "+")
    lo = rng.randint(0, 2)
    hi = rng.choice((lo, lo + 1, lo + 2, None))
    return Repeat(atom, lo, hi, lazy, "{}")


def _sequence(rng: random.Random, depth: int) -> Node:
    n = rng.choice((0, 1, 1, 2, 2, 3)) if depth else rng.randint(1, 3)
    return Seq(tuple(_piece(rng, depth) for _ in range(n)))


def _alternatives(rng: random.Random, depth: int) -> Node:
    n = rng.choice((1, 1, 2, 3))
    if n == 1:
        return _sequence(rng, depth)
    return Alt(tuple(_sequence(rng, depth) for _ in range(n)))


def random_regex(rng: random.Random) -> Regex:
    """A small random regex in the ECMA-262 syntax capgraph takes (see the module's text)."""
    tree = _alternatives(rng, 0)
    start, end = rng.random() < 0.25, rng.random() < 0.25
    body = _text(tree, rng)
    if (start or end) and isinstance(tree, Alt):
        body = "(?:" + body + ")"  # '^a|b$' would tie only one branch
    return Regex(tree, start, end, ("^" if start else "") + body + ("$" if end else ""))


def random_regexes(n: int, seed: int) -> list[Regex]:
    rng = random.Random(seed)
    return [random_regex(rng) for _ in range(n)]


# -- guides and their judges ------------------------------------------------------------------
def _pattern_verdict(regex: Regex, text: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return isinstance(value, str) and matches(regex, value, search=True)


def _ebnf_string(text: str) -> str:
    """``text`` as the body of an xgrammar EBNF string literal."""
    return "".join("\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if ord(c) < 0x20 else c
                   for c in text)


def guides(regexes: Sequence[Regex], kind: str) -> list[tuple[Any, Callable[[str], bool], str]]:
    """``(params, checker, label)`` of each regex given as ``kind`` (:data:`KINDS`), judged
    by :func:`matches` (a pattern: on the JSON string's value, searched)."""
    from capgraph import GuidedDecodingParams, GuideType
    out: list[tuple[Any, Callable[[str], bool], str]] = []
    for regex in regexes:
        def whole(text: str, r: Regex = regex) -> bool:
            return matches(r, text)
        if kind == "regex":
            out.append((GuidedDecodingParams(GuideType.REGEX, regex.text), whole, regex.text))
        elif kind == "ebnf":
            grammar = f'root ::= Regex("{_ebnf_string(regex.text)}")'
            out.append((GuidedDecodingParams(GuideType.EBNF_GRAMMAR, grammar), whole, grammar))
        elif kind == "tag":
            tag = json.dumps({"type": "structural_tag",
                              "format": {"type": "regex", "pattern": regex.text}})
            out.append((GuidedDecodingParams(GuideType.STRUCTURAL_TAG, tag), whole, tag))
        else:
            schema = json.dumps({"type": "string", "pattern": regex.text})
            out.append((GuidedDecodingParams(GuideType.JSON_SCHEMA, schema),
                        lambda text, r=regex: _pattern_verdict(r, text), schema))
    return out


def node_disagreements(cases: Sequence[tuple[Regex, str, bool]]) -> list[str]:
    """The ``(regex, text, search)`` cases where :func:`matches` and Node's ``RegExp`` (no
    flags) differ, cases with a character outside the BMP in the regex or the text left out
    (ECMA without the ``u`` flag reads it as two UTF-16 units); raises ``RuntimeError`` where
    Node is not installed."""
    node = shutil.which("node")
    if node is None:
        raise RuntimeError("node is not installed")
    kept = [(r, t, s) for r, t, s in cases
            if all(ord(c) <= 0xFFFF for c in r.text + t) and "\\ud83d" not in r.text]
    script = ("const lines=require('fs').readFileSync(0,'utf8').split('\\n').filter(Boolean);"
              "const out=lines.map(l=>{const [p,t,s]=JSON.parse(l);"
              "return new RegExp(s?p:'^(?:'+p+')$').test(t)});"
              "process.stdout.write(JSON.stringify(out));")
    feed = "\n".join(json.dumps([r.text, t, s]) for r, t, s in kept)
    done = subprocess.run([node, "-e", script], input=feed, capture_output=True, text=True,
                          check=True, timeout=600)
    verdicts = json.loads(done.stdout)
    return [f"{r.text!r} on {t!r}{' (search)' if s else ''}: judge {matches(r, t, s)}, "
            f"node {v}" for (r, t, s), v in zip(kept, verdicts) if matches(r, t, s) != v]


class _NoMember(Exception):
    pass


def _member(node: Node, rng: random.Random) -> str:
    """A random string ``node`` matches whole (characters from :data:`ALPHABET`)."""
    if isinstance(node, (Char, Shorthand, Dot, Class)):
        if isinstance(node, Char):
            return node.char
        for _ in range(60):
            c = rng.choice(ALPHABET)
            if len(_ends(node, c, frozenset([0]))):
                return c
        raise _NoMember
    if isinstance(node, Seq):
        return "".join(_member(item, rng) for item in node.items)
    if isinstance(node, Alt):
        return _member(rng.choice(node.branches), rng)
    if isinstance(node, Group):
        return _member(node.body, rng)
    times = rng.randint(node.lo, node.lo + 2 if node.hi is None else node.hi)
    return "".join(_member(node.body, rng) for _ in range(times))


def sample_texts(regex: Regex, rng: random.Random, n: int) -> list[str]:
    """``n`` texts for ``regex``: half drawn from its language (where one can be), half
    random strings of the alphabet, some of them a member with one character changed."""
    out = []
    for i in range(n):
        try:
            text = _member(regex.tree, rng)
        except _NoMember:
            text = ""
        if i % 2:
            if text and rng.random() < 0.5:
                at = rng.randrange(len(text))
                text = text[:at] + rng.choice(ALPHABET) + text[at + 1:]
            else:
                text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 4)))
        out.append(text)
    return out


def run(tokenizer_name: str, backends: Iterable[str], kinds: Iterable[str], n: int, walks: int,
        seed: int, max_tokens: int) -> dict[str, conformance_walk.Counts]:
    regexes = random_regexes(n, seed)
    kinds = list(kinds)
    return conformance_walk.walk_backends(
        tokenizer_name, backends,
        lambda backend: [(f"{backend}/{kind}", guides(regexes, kind), tilt(kind))
                         for kind in kinds if kind in SERVED[backend]],
        walks=walks, seed=seed, max_tokens=max_tokens)


def main(argv: Sequence[str] | None = None) -> int:
    parser = conformance_walk.walk_arguments((__doc__ or "").split("\n\n")[0], "regexes",
                                             BACKENDS)
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    parser.add_argument("--node", action="store_true",
                        help="first check the judge against Node's RegExp on random texts")
    args = parser.parse_args(argv)
    start = time.perf_counter()
    if args.node:
        rng = random.Random(args.seed)
        cases = [(r, t, s) for r in random_regexes(args.regexes, args.seed)
                 for t in sample_texts(r, rng, 20) for s in (False, True)]
        differ = node_disagreements(cases)
        print(f"judge vs node: {len(cases)} cases, {len(differ)} disagreements")
        for line in differ[:20]:
            print("  DIFFER", line)
        if differ:
            return 1
    results = run(args.tokenizer, args.backends, args.kinds, args.regexes, args.walks,
                  args.seed, args.max_tokens)
    conformance_walk.print_counts(results, "regexes")
    print(f"({time.perf_counter() - start:.0f} s; tokenizer {args.tokenizer}, seed {args.seed})")
    return 1 if any(c.invalid for c in results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
