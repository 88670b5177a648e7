"""Repetition counts in guides, bounded before any backend compiles them.

xgrammar 0.2.9 stores a repetition count as a 32-bit integer: ``a{4294967297}`` wraps to
``a{1}`` and accepts ``"a"`` then the stop token; counts from 2**31 on fail inside xgrammar's
own check; JSON-schema ``maxLength`` and ``maxItems`` and GBNF ``{n}`` wrap the same way.
llguidance refuses counts beyond 32 bits, but its per-token cost grows with the count (``a{N}``
fed ``a``, after 300 tokens: about 0.2 ms per token at N = 1000, 3 ms at 10000, 9-13 ms at
30000, 60-70 ms at 100000; ``a{1000000}`` ends in its "lexer too complex" error), while
xgrammar's stays under 0.1 ms at N = 100000. Compile time and memory stay flat in N on both
backends (``a{N}``, ``a{0,N}``, ``[a-z]{1,N}`` up to N = 10**7). Measured on 2
cores with Tekken, token ``a`` fed 300 times: ``python -m capgraph.grammar.guide_limits
--backend llguidance 'a{1000}' 'a{10000}' 'a{30000}' 'a{100000}'`` (:func:`main`; its own
limit is 2**31 - 1). :data:`DEFAULT_MAX_REPETITION_COUNT` is 65535: real schemas ask for 16-bit
limits (two of the bundled JSON Schema Bench schemas have ``maxLength`` 32767 and 65535), and
the per-request host-step budget (``host_step_budget_ms``) bounds what such a count costs per
token on llguidance; a lower limit trades those schemas for less per-token work.

:func:`check_guide_limits` finds every count a guide asks for and refuses, with an
:class:`~capgraph.errors.UnsupportedGuideError` naming the count and where it is, any count
above ``GuidedDecodingConfig.max_repetition_count`` (never above :data:`BACKEND_MAX_COUNT`).
It reads:

- regexes (REGEX guides, JSON-schema ``pattern`` values and ``patternProperties`` keys, Lark
  ``/regex/`` literals): ``{n}``, ``{n,}``, ``{n,m}``, skipping escapes (``\\{3}``) and
  character classes (``[{]``);
- JSON schemas: ``minLength``, ``maxLength``, ``minItems``, ``maxItems``, ``minProperties``,
  ``maxProperties`` (xgrammar turns them into repetition counts), in schema positions only
  (a property *named* ``maxLength`` is not a keyword);
- EBNF: GBNF ``{n}`` / ``{n,m}`` and the regex of ``Regex("...")`` (xgrammar) and Lark
  ``{n}``, ``~ n``, ``~ n..m`` and ``%json {...}`` (llguidance), skipping other strings,
  character classes and comments;
- structural tags: ``repeat``'s ``min``/``max``, ``max_chars``/``max_tokens``, and the
  schemas, regexes and grammars inside them.

Reading the same regexes, it refuses groups nested deeper than :data:`MAX_GROUP_DEPTH`
(:class:`GroupNestingError`): xgrammar builds a regex's automaton by recursion and a 60 kB
regex of 30 000 nested groups overflows the compile thread's stack (the process dies with
SIGSEGV).

Counts each under the limit still multiply when nested: xgrammar's cost of one step grows
with the product along a chain of nested quantifiers and with the token's length, and one
call cannot be interrupted (figures below). :func:`nested_counts` finds every chain of nested
quantifiers with a count among them (through regex groups, EBNF groups, the regexes inside
them, EBNF rule and Lark terminal references, and a structural tag's ``repeat``, ``star`` and
``plus``), an unbounded quantifier weighing :data:`UNBOUNDED_FACTOR`; a chain of two may multiply to
:data:`MAX_NESTED_PRODUCT` (1024), one of three or more to :data:`MAX_DEEP_NESTED_PRODUCT`
(64), and neither past ``max_repetition_count``. One accept of a 64-character token of ``a``
by a fresh xgrammar 0.2.9 matcher (2 cores, other jobs running; ``python -m
capgraph.grammar.guide_limits --long-token 64 '(a{0,32}){0,32}' '(a*){0,16}' ...``, see
:func:`main`): at the limits ``(a{0,32}){0,32}`` 3.0 ms, ``(a*){0,16}`` 2.3 ms,
``(a{0,256}){0,4}`` 9.9 ms, ``((a{0,4}){0,4}){0,4}`` 1.3 ms; past them ``(a{0,256}){0,256}``
55 ms, ``(a*){0,1000}`` 205 ms, ``((a*){0,4}){0,4}`` 258 ms; with ``--long-token 32``,
``((a{0,8}){0,8}){0,8}`` 42 ms and ``((a{0,16}){0,16}){0,16}`` 1.2 s. Chains
of unbounded quantifiers alone (``(a*)*``: 0.14 ms for the 64-character token) are not
refused: star height is not ambiguity (``(ab*)*`` and ``(\\w+\\s)*`` match in linear time), and the
host-step budget (``GuidedDecodingConfig.host_step_budget_ms``) bounds what an ambiguous guide
costs over many steps.

A chain split across rules costs what it costs inline, so rule references are followed
(:class:`_Grammar`): with the 64-character token, ``root ::= x{0,256}`` and ``x ::= "a"{0,256}``
36 ms (``("a"{0,256}){0,256}``: 37 ms), ``x{0,8}``, ``y{0,8}``, ``"a"{0,8}`` 103 ms (inline
104 ms), ``x*`` with ``x ::= "a"{0,1000}`` 9.5 ms, a tag's ``repeat`` 0..256 of a ``repeat``
0..256 36 ms, and three ``repeat`` 0..16 8.6 s (``x{0,16}``, ``y{0,16}``, ``"a"{0,16}``: 7.2 s);
``python -m capgraph.grammar.guide_limits --long-token 64 --guide-type ebnf $'root ::=
x{0,256}\\nx ::= "a"{0,256}' ...`` (``--guide-type structural_tag`` for tags). Recursion nests a
count once per level (``x ::= "b" | ("a" x){0,40}``: 3.2 s; ``x ::= ("a" | x){0,40}`` did not
return in 120 s): a rule whose chains still grow after a few rounds of its cycle is taken as
nesting without end and refused, while plain recursion (JSON's ``value`` inside ``array``'s
``*``) only nests unbounded quantifiers, which pass. A chain stops going outward at a sequence
where a sibling cannot be part of its text: ``("," ws value)*`` around a number's
``[0-9]{0,15}``, ``"\\u" [0-9a-fA-F]{4}`` in a string's ``*``, a tag's ``begin`` and ``end``
strings (``x{0,64}`` with ``x ::= "a"{0,64} "b"``: 0.08 ms; with ``"a"`` as the delimiter
5.9 ms, refused). llama.cpp's ``json.gbnf`` and ``arithmetic.gbnf``, xgrammar's builtin JSON
grammar, Lark JSON and expression grammars and the demo's EBNF pass. llguidance's cost grows
the same way (Lark on Tekken, accept and mask of a 16-character token: ``start: x{0,32}`` with
``x: /[a-z]/{0,32}`` up to 150 ms a step, inline 165 ms; at 256 x 256 its parser gives up,
"Current row has 2393 items; max is 2000"). Not followed: a JSON schema (Lark ``%json``, a
tag's ``json_schema``), ``any_text`` and the triggered or dispatched tags expose no chain to a
quantifier around them, and inside a regex (REGEX guides, patterns) no delimiter stops a chain
(``(a{0,64}b){0,64}`` is refused). Checking stays about linear (2 shared cores): a 5000-rule
chain takes 50-60 ms, a 5000-rule cycle 0.5-0.9 s, 20 000 alternatives (430 kB) 0.5-0.8 s.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Iterator, TypeVar

from ..errors import UnsupportedGuideError
from ..params import DEFAULT_MAX_REPETITION_COUNT, GuidedDecodingParams, GuideType
from .graphs import strongly_connected
from .schema_policy import Pointer, _short, schema_nodes

T = TypeVar("T")

__all__ = ["BACKEND_MAX_COUNT", "DEFAULT_MAX_REPETITION_COUNT", "MAX_NESTED_PRODUCT",
           "MAX_DEEP_NESTED_PRODUCT", "MAX_GROUP_DEPTH", "GroupNestingError",
           "UNBOUNDED_FACTOR", "check_guide_limits", "regex_counts", "regex_nesting",
           "ebnf_counts", "schema_counts", "nested_counts"]

#: The largest count both backends represent (xgrammar: a signed 32-bit integer).
BACKEND_MAX_COUNT = 2**31 - 1

#: JSON-schema keywords whose value becomes a repetition count.
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                  "maxProperties")

_BRACE_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_TILDE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")
_GBNF_REGEX = re.compile(r'\bRegex\s*\(\s*"')  # xgrammar's Regex("...") in GBNF
_RULE_START = re.compile(r"\n\s*[A-Za-z_][\w.-]*\s*(::=|:)")  # a new rule: no group goes on

#: The largest product of the counts of two nested quantifiers (at least one counted), such
#: as ``(a{0,32}){0,32}`` (1024) or ``(\\w{1,63}\\.){1,10}`` (630). See :func:`nested_counts`.
MAX_NESTED_PRODUCT = 1024
#: The largest product along a chain of three or more nested quantifiers (at least one
#: counted), such as ``((a{0,4}){0,4}){0,4}`` (64).
MAX_DEEP_NESTED_PRODUCT = 64
#: The deepest nesting of groups a regex may have. llguidance's regex reader refuses more
#: than 250 itself; xgrammar's automaton builder recurses once per level and, past about
#: 20 000 levels (60 kB of regex), overflows the compile thread's stack and kills the process.
MAX_GROUP_DEPTH = 250
#: What an unbounded quantifier (``*``, ``+``, ``{n,}``) nested with a counted one weighs in
#: the product (about the longest token's characters it can absorb in one step).
UNBOUNDED_FACTOR = 64

# A count found: (value, offset in the text or JSON pointer, what it is). The location is a
# string, or an object written out by str() only when a refusal names it (a JSON pointer deep
# in a large schema).
Found = tuple[int, Any, str]


class _At:
    """A location written out only when read: its parts' ``str()`` one after the other."""

    __slots__ = ("parts",)

    def __init__(self, *parts: object) -> None:
        self.parts = parts

    def __str__(self) -> str:
        return "".join(str(p) for p in self.parts)


def _at(where: Any, tail: str) -> Any:
    return where + tail if isinstance(where, str) else _At(where, tail)


class GroupNestingError(UnsupportedGuideError):
    """A regex nests its groups deeper than :data:`MAX_GROUP_DEPTH` (raised by
    :func:`regex_counts`; :func:`check_guide_limits` adds the guide type and backend)."""


def regex_counts(pattern: str, where: Any = "regex") -> Iterator[Found]:
    """Every repetition count of ``pattern``: ``(count, location, description)``.

    Escapes (``\\{``, ``\\x{41}``, ``\\p{L}``) and character classes (``[{]``, ``[[:digit:]]``)
    hold no repetition; a ``{`` that does not open ``{n}``, ``{n,}`` or ``{n,m}`` is a literal.

    Raises:
        GroupNestingError: where groups nest deeper than :data:`MAX_GROUP_DEPTH`.
    """
    i, n = 0, len(pattern)
    prev_atom = False  # whether a quantifier here would apply to something
    depth = 0
    while i < n:
        c = pattern[i]
        if c == "\\":
            # \p{..}, \x{..}, \u{..}, \N{..}: the braces belong to the escape
            if i + 2 < n and pattern[i + 1] in "pPxuN" and pattern[i + 2] == "{":
                end = pattern.find("}", i + 3)
                i = n if end < 0 else end + 1
            else:
                i += 2
            prev_atom = True
        elif c == "[":
            i = _skip_class(pattern, i)
            prev_atom = True
        elif c == "{" and prev_atom:
            m = _BRACE_COUNT.match(pattern, i)
            if m is None:
                i += 1  # a literal brace
                continue
            lo, hi = m.group(1), m.group(2)
            yield int(lo), _at(where, f" offset {i}"), m.group(0)
            if hi:
                yield int(hi), _at(where, f" offset {i}"), m.group(0)
            i = m.end()
        else:
            if c == "(":
                depth += 1
                if depth > MAX_GROUP_DEPTH:
                    raise GroupNestingError(
                        f"groups nest over {MAX_GROUP_DEPTH} deep at "
                        f"{_short(str(_at(where, f' offset {i}')))} (capgraph.grammar."
                        "guide_limits.MAX_GROUP_DEPTH: llguidance refuses deeper regexes, and "
                        "xgrammar builds them by a recursion that can exhaust its thread's "
                        "stack)")
            elif c == ")":
                depth = max(depth - 1, 0)
            prev_atom = c not in "(|"
            i += 1


# A chain of nested quantifiers found: (product of its counts, how many quantifiers (3: three
# or more), location of the outermost one, its text).
Nested = tuple[int, int, Any, str]
_CAP = 2**62  # products stop growing here (any such product is refused)


class _Chains:
    """Folds a quantifier structure (``open``/``close`` of groups, atoms, alternatives and
    quantifiers, from :func:`_regex_events` or :func:`_ebnf_events`) into the chains of
    nested quantifiers it holds: for each chain ending at a quantifier, the product of the
    counts along it (an unbounded quantifier weighs :data:`UNBOUNDED_FACTOR`), by depth (1, 2,
    3 or more) and whether any of them is counted. Chains of unbounded quantifiers alone
    (``(a*)*``) are left to the host-step budget."""

    def __init__(self) -> None:
        # per open group: the worst product per (depth, counted) inside it, and what the
        # next quantifier would apply to (None: nothing)
        self.stack: list[tuple[dict[tuple[int, bool], int],
                               list[dict[tuple[int, bool], int] | None]]] = [({}, [None])]

    def atom(self) -> None:
        self.stack[-1][1][0] = {}

    def alt(self) -> None:
        self.stack[-1][1][0] = None

    def open(self) -> None:
        self.stack.append(({}, [None]))

    def close(self) -> None:
        if len(self.stack) == 1:
            return  # an unbalanced ')': the backend's own error
        inner, _ = self.stack.pop()
        worst, last = self.stack[-1]
        _merge(worst, inner)
        last[0] = dict(inner)

    def end(self) -> None:
        while len(self.stack) > 1:
            self.close()

    def quantifier(self, factor: int, counted: bool, where: Any,
                   text: str) -> Iterator[Nested]:
        worst, last = self.stack[-1]
        base = last[0]
        if base is None:
            return  # nothing to repeat: the backend's own error
        chains = {(1, counted): factor}
        for (depth, was_counted), product in base.items():
            key = (min(depth + 1, 3), was_counted or counted)
            chains[key] = max(chains.get(key, 0), min(product * factor, _CAP))
        for (depth, any_counted), product in chains.items():
            if depth >= 2 and any_counted:
                yield product, depth, where, text
        _merge(worst, chains)
        last[0] = chains


def _merge(into: dict[tuple[int, bool], int], more: dict[tuple[int, bool], int]) -> None:
    for key, value in more.items():
        into[key] = max(into.get(key, 0), value)


def regex_nesting(pattern: str, where: Any = "regex") -> Iterator[Nested]:
    """Every chain of two or more nested quantifiers of ``pattern`` with a counted one among
    them (``(\\d{1,3}\\.){3}``: 3 x 3 = 9, depth 2): ``(product, depth, location, text)``,
    the depth 3 for three or more."""
    chains = _Chains()
    yield from _regex_events(pattern, where, chains)
    chains.end()


def _regex_events(pattern: str, where: Any, chains: _Chains) -> Iterator[Nested]:
    i, n = 0, len(pattern)
    prev_atom = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            if i + 2 < n and pattern[i + 1] in "pPxuN" and pattern[i + 2] == "{":
                end = pattern.find("}", i + 3)
                i = n if end < 0 else end + 1
            else:
                i += 2
            chains.atom()
            prev_atom = True
            continue
        if c == "[":
            i = _skip_class(pattern, i)
            chains.atom()
            prev_atom = True
            continue
        m = _BRACE_COUNT.match(pattern, i) if c == "{" and prev_atom else None
        if m is not None:
            lo, hi = int(m.group(1)), m.group(2)
            unbounded = m.group(0).rstrip("} \t").endswith(",")
            factor = max(lo, UNBOUNDED_FACTOR) if unbounded else int(hi) if hi else lo
            yield from chains.quantifier(factor, True, _at(where, f" offset {i}"), m.group(0))
            i = m.end()
        elif c in "*+" and prev_atom:
            yield from chains.quantifier(UNBOUNDED_FACTOR, False, _at(where, f" offset {i}"), c)
            i += 1
        elif c == "(":
            chains.open()
            i += 1
            prev_atom = False
            continue
        elif c == ")":
            chains.close()
            i += 1
            prev_atom = True
            continue
        elif c == "|":
            chains.alt()
            i += 1
            prev_atom = False
            continue
        elif c == "?" or (c == "{" and prev_atom):
            i += 1  # optional (no product), a lazy modifier, or a literal brace
            continue
        else:
            chains.atom()
            i += 1
            prev_atom = True
            continue
        # after a quantifier: a lazy '?' or possessive '+' modifies it
        if i < n and pattern[i] in "?+":
            i += 1
        prev_atom = True


def _skip_class(text: str, i: int) -> int:
    """The index just past the character class opening at ``text[i] == '['``: at its first
    unescaped ``]``, the shortest reading any backend has. ECMA-262 (the guides' regexes)
    and xgrammar's grammar classes end there: ``[]`` is an empty class, a ``[`` inside is a
    member (``[[:alpha:]]`` is a class and a ``]``). A reader that takes a leading ``]`` as
    a member, nests classes or reads POSIX ones (Rust's and Python's, in a Lark regex) ends
    them later, never earlier, so what follows is at worst scanned as syntax and counted,
    never skipped (skipping to a later ``:]`` would hide the counts after an unclosed
    ``[[=``)."""
    n = len(text)
    j = i + 1
    if j < n and text[j] == "^":
        j += 1
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == "]":
            return j + 1
        else:
            j += 1
    return n


def schema_counts(schema: Any, path: str = "") -> Iterator[Found]:
    """Every count of a JSON schema (already parsed): the count keywords' values and the
    counts of the regexes in ``pattern`` and ``patternProperties`` keys, by JSON pointer, in
    every schema object a backend reads (:func:`~capgraph.grammar.schema_policy.
    schema_positions`: the places only a ``$ref`` reaches included)."""
    for node, where in schema_nodes(schema):
        for keyword in COUNT_KEYWORDS:
            value = node.get(keyword)
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):  # (NaN, inf: the backend's own error)
                yield int(value), _At(path, where, "/", keyword), f"{keyword}={value!r}"
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            yield from regex_counts(pattern, _At("pattern at ", _Here(path, where)))
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for key in props:
                if isinstance(key, str):
                    yield from regex_counts(key, _At(f"patternProperties key {key[:40]!r} at ",
                                                _Here(path, where)))


def ebnf_counts(grammar: str, lark: bool) -> Iterator[Found]:
    """Every repetition count of an EBNF grammar: GBNF for xgrammar (``lark=False``), Lark for
    llguidance (``lark=True``, where ``[...]`` is an optional group, ``/.../`` a regex and
    ``%json {...}`` an inline JSON schema). Strings and comments hold none."""
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"' or (c == "'" and lark):
            i = _skip_string(grammar, i)
        elif c == "#" and not lark:
            i = _line_end(grammar, i)
        elif c == "/" and lark and grammar.startswith("//", i):
            i = _line_end(grammar, i)
        elif c == "/" and lark:
            end = _skip_string(grammar, i)
            yield from regex_counts(grammar[i + 1:end - 1], f"regex at grammar offset {i}")
            i = end
        elif c == "[" and not lark:
            i = _skip_class(grammar, i)
        elif c == "R" and not lark and (m := _GBNF_REGEX.match(grammar, i)):
            end = _skip_string(grammar, m.end() - 1)
            yield from regex_counts(_unquote(grammar[m.end():end - 1]),
                                    f"Regex at grammar offset {i}")
            i = end
        elif c == "%" and lark and grammar.startswith("%json", i):
            start = grammar.find("{", i)
            try:
                schema, end = json.JSONDecoder().raw_decode(grammar, start)
            except ValueError:
                i += 5  # not a schema: llguidance's own error says why
                continue
            yield from schema_counts(schema, f"%json at grammar offset {i}")
            i = end
        elif c == "{" or (c == "~" and lark):  # {n} / {n,m}, and Lark's ~n / ~n..m
            m = (_BRACE_COUNT if c == "{" else _LARK_TILDE).match(grammar, i)
            if m is None:
                i += 1
                continue
            yield int(m.group(1)), f"grammar offset {i}", m.group(0)
            if m.group(2):
                yield int(m.group(2)), f"grammar offset {i}", m.group(0)
            i = m.end()
        else:
            i += 1


def _skip_string(text: str, i: int) -> int:
    """The index just past the string (or Lark regex) opened by ``text[i]``."""
    quote, j, n = text[i], i + 1, len(text)
    while j < n:
        if text[j] == "\\":
            j += 2
        elif text[j] == quote:
            return j + 1
        elif text[j] == "\n":
            return j  # unterminated: the backend reports it
        else:
            j += 1
    return n


def _unquote(text: str) -> str:
    """The regex a GBNF string literal holds: its ``\\\\`` and ``\\"`` escapes undone."""
    return re.sub(r'\\([\\"])', r"\1", text)


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end


#: Structural-tag keys whose integer value is a count (``repeat``'s ``min``/``max``, the
#: ``max_chars``/``max_tokens`` of free text).
_TAG_COUNT_KEYS = frozenset({"min", "max", "max_chars", "max_tokens"})


def _structural_counts(node: Any, path: str = "") -> Iterator[Found]:
    """The counts inside a structural tag: ``repeat`` counts, ``max_chars``/``max_tokens``,
    and its schemas, regexes and GBNF grammars."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}/{key}"
            if key in _TAG_COUNT_KEYS and isinstance(value, int) and not isinstance(value, bool):
                yield value, here, f"{key}={value}"
            elif key in ("schema", "json_schema") and isinstance(value, dict):
                yield from schema_counts(value, here)
            elif key in ("pattern", "regex") and isinstance(value, str):
                yield from regex_counts(value, f"regex at {here}")
            elif key in ("grammar", "ebnf") and isinstance(value, str):
                lark = node.get("syntax") == "lark"  # (xgrammar's grammar element: GBNF or Lark)
                yield from ((v, f"{here} {w}", d) for v, w, d in ebnf_counts(value, lark))
            else:
                yield from _structural_counts(value, here)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _structural_counts(value, f"{path}/{i}")


def ebnf_nesting(grammar: str, lark: bool) -> Iterator[Nested]:
    """:func:`regex_nesting` for an EBNF grammar (GBNF, or Lark with ``lark=True``): chains
    of quantifiers nested through parenthesised groups (Lark ``[...]`` too), the regexes
    inside (Lark ``/.../``, GBNF ``Regex("...")``) taking part as groups, the rules and
    terminals they reference (``x{0,9}`` with ``x ::= "a"{0,9}``: 81, recursion included:
    :class:`_Grammar`), and those of the patterns of Lark ``%json`` schemas."""
    return _Grammar(grammar, lark).nesting()


# -- EBNF chains through rule references ------------------------------------------------------
# Characters as an int: bit c for ASCII c, bit 128 for any other character.
_NON_ASCII = 1 << 128
_ALL_CHARS = (1 << 129) - 1
_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "/": "/",
            "]": "]", "[": "[", "-": "-", "^": "^", "0": "\0", " ": " ", ".": "."}
_DIGITS = sum(1 << o for o in range(48, 58))
_WORD = _DIGITS | sum(1 << o for o in range(65, 91)) | sum(1 << o for o in range(97, 123)) \
    | 1 << 95 | _NON_ASCII
_SPACE = sum(1 << ord(c) for c in " \t\n\r\f\v") | _NON_ASCII
#: ``\d``, ``\w``, ``\s`` (their negations: anything)
_CLASS_ESCAPES = {"d": _DIGITS, "w": _WORD, "s": _SPACE, "D": _ALL_CHARS, "W": _ALL_CHARS,
                  "S": _ALL_CHARS}
_HEX_ESCAPE = re.compile(r"x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})")
_NAME_TAIL = re.compile(r"[\w.-]*")
_DEFINES = re.compile(r"[ \t]*::=")
_LARK_DEFINES = re.compile(r"[ \t]*:(?!:)")
_PRIORITY = re.compile(r"\.\d+$")
_UNBOUNDED_CLAMP = UNBOUNDED_FACTOR ** 3  # an uncounted chain's product stops here (its
#                                          depth alone decides what a count above it makes)

# A chain's key: (depth 1, 2 or 3+, any counted, the characters its outermost quantifier
# repeats); its value: (product, the trace naming it).
_Key = tuple[int, bool, int]
_Entries = dict[_Key, tuple[int, Any]]


def _bits(ch: str) -> int:
    o = ord(ch)
    return 1 << o if o < 128 else _NON_ASCII


def _unescape(text: str, i: int) -> tuple[str | None, int]:
    """The character of the escape at ``text[i] == '\\\\'`` (None: not known) and the index
    past it."""
    if i + 1 >= len(text):
        return None, i + 1
    m = _HEX_ESCAPE.match(text, i + 1)
    if m:
        code = int(m.group(1) or m.group(2) or m.group(3), 16)
        return (chr(code) if code < 0x110000 else None), m.end()
    return _ESCAPES.get(text[i + 1]), i + 2


def _literal_chars(body: str, nocase: bool) -> tuple[int, int]:
    """(characters a string literal's text may hold, characters it surely holds)."""
    chars = must = 0
    i, n = 0, len(body)
    while i < n:
        if body[i] == "\\":
            ch, i = _unescape(body, i)
            if ch is None:
                chars = _ALL_CHARS
                continue
        else:
            ch, i = body[i], i + 1
        bit = _bits(ch)
        if nocase and ch.lower() != ch.upper():
            chars |= bit | _bits(ch.lower()) | _bits(ch.upper())
        else:
            chars |= bit
            must |= bit
    return chars, must


def _class_member(body: str, i: int) -> tuple[str | None, int]:
    """The character at ``body[i]`` of a class, escaped or not (None: not known), and the
    index past it."""
    if body[i] == "\\":
        return _unescape(body, i)
    return body[i], i + 1


def _class_chars(body: str) -> int:
    """The characters a GBNF character class (``[...]``'s inside) matches, or more."""
    negated = body.startswith("^")
    if "[:" in body or "[=" in body or "[." in body:
        return _ALL_CHARS
    i, n, chars = (1 if negated else 0), len(body), 0
    prev: str | None = None
    while i < n:
        if body[i] == "\\" and body[i + 1:i + 2] in _CLASS_ESCAPES:
            chars |= _CLASS_ESCAPES[body[i + 1]]
            i += 2
            prev = None
            continue
        ch, i = _class_member(body, i)
        if ch is None:
            return _ALL_CHARS
        if ch == "-" and prev is not None and i < n:  # a range prev-next
            hi, i = _class_member(body, i)
            if hi is None:
                return _ALL_CHARS
            lo_o, hi_o = ord(prev), ord(hi)
            for o in range(lo_o, min(hi_o, 127) + 1):
                chars |= 1 << o
            if hi_o >= 128:
                chars |= _NON_ASCII
            prev = None
            continue
        chars |= _bits(ch)
        prev = ch
    return (_ALL_CHARS & ~chars) | _NON_ASCII if negated else chars


def _regex_pieces(pattern: str, where: str, nocase: bool = False) -> list["_Piece"]:
    """A regex as rule-body pieces (:data:`_Piece`) for the chains it exposes to the
    quantifiers around it: literals, classes, groups, alternatives and quantifiers (a
    lookaround as an optional group; a case-insensitive one, or one with inline flags, as a
    single piece of any characters)."""
    if nocase or "(?" in pattern and re.search(r"\(\?[a-zA-Z-]+[:)]", pattern):
        return [("lit", _OPAQUE)]
    pieces: list[_Piece] = []
    i, n = 0, len(pattern)
    prev_atom = False
    while i < n:
        c = pattern[i]
        if c == "\\":
            e = pattern[i + 1:i + 2]
            if e in _CLASS_ESCAPES:
                pieces.append(("lit", _Item({}, _CLASS_ESCAPES[e], False)))
                i += 2
            elif e in "pPxuN" and pattern[i + 2:i + 3] == "{" or e in "pPN":
                end = pattern.find("}", i + 3) if pattern[i + 2:i + 3] == "{" else i + 2
                pieces.append(("lit", _Item({}, _ALL_CHARS, False)))
                i = n if end < 0 else end + 1
            elif e.isalpha() and e not in "ntrfvxu0":  # \b, \A, \z ...: anything
                pieces.append(("lit", _OPAQUE))
                i += 2
            else:
                ch, i = _unescape(pattern, i)
                if ch is None and e:
                    ch = e
                bits = _ALL_CHARS if ch is None else _bits(ch)
                pieces.append(("lit", _Item({}, bits, False, 0 if ch is None else bits)))
            prev_atom = True
            continue
        if c == "[":
            end = _skip_class(pattern, i)
            pieces.append(("lit", _Item({}, _class_chars(pattern[i + 1:end - 1]), False)))
            i, prev_atom = end, True
            continue
        m = _BRACE_COUNT.match(pattern, i) if c == "{" and prev_atom else None
        if m is not None:
            lo, hi = int(m.group(1)), m.group(2)
            unbounded = m.group(0).rstrip("} \t").endswith(",")
            factor = max(lo, UNBOUNDED_FACTOR) if unbounded else int(hi) if hi else lo
            pieces.append(("quant", (factor, True, lo == 0, m.group(0),
                                     f"{where} offset {i}")))
            i = m.end()
        elif c in "*+" and prev_atom:
            pieces.append(("quant", (UNBOUNDED_FACTOR, False, c == "*", c,
                                     f"{where} offset {i}")))
            i += 1
        elif c == "?" and prev_atom:
            pieces.append(("opt", None))
            i += 1
        elif c == "(":
            look = pattern.startswith(("(?=", "(?!", "(?<=", "(?<!"), i)
            pieces.append(("open", look))
            if pattern.startswith("(?", i):  # (?:, (?P<name>, (?<name>, lookarounds
                j = i + 2
                if pattern.startswith(("P<", "<"), j) and not look:
                    close = pattern.find(">", j)
                    j = n if close < 0 else close + 1
                else:
                    while j < n and pattern[j] in ":=!<":
                        j += 1
                i = j
            else:
                i += 1
            prev_atom = False
            continue
        elif c == ")":
            pieces.append(("close", None))
            i, prev_atom = i + 1, True
            continue
        elif c == "|":
            pieces.append(("alt", None))
            i, prev_atom = i + 1, False
            continue
        elif c in "^$":
            i += 1
            continue
        else:
            bits = _ALL_CHARS if c == "." else _bits(c)
            pieces.append(("lit", _Item({}, bits, False, 0 if c == "." else bits)))
            i, prev_atom = i + 1, True
            continue
        if i < n and pattern[i] in "?+":  # a lazy or possessive quantifier
            i += 1
        prev_atom = True
    return pieces


class _Item:
    """What a piece of a rule body (a literal, a group, a quantified item, a reference)
    contributes to the chains around it: the chains it exposes to a quantifier applied to
    it, the characters its text may hold, whether it may be empty, and characters its text
    surely holds."""

    __slots__ = ("chains", "chars", "nullable", "must")

    def __init__(self, chains: _Entries, chars: int, nullable: bool, must: int = 0) -> None:
        self.chains, self.chars, self.nullable, self.must = chains, chars, nullable, must


_OPAQUE = _Item({}, _ALL_CHARS, True)  # an unknown reference, a %json schema, <[...]>


def _put(into: _Entries, key: _Key, value: tuple[int, Any]) -> None:
    old = into.get(key)
    if old is None or value[0] > old[0]:
        into[key] = value


def _guarded(item_index: int, chars: int, guards: list[tuple[int, int, int]]) -> bool:
    """Whether a chain whose outermost quantifier repeats ``chars`` is kept from going on
    past its sequence by a sibling that cannot be part of its text (``"," x{0,9}``): a
    non-empty one of other characters, or a literal holding one. The outer quantifier's
    iterations then cannot split the chain's text in several ways."""
    for index, g_chars, g_must in guards:
        if index != item_index and (g_chars & chars == 0 or g_must & ~chars):
            return True
    return False


def _sequence(items: list[_Item]) -> _Item:
    if len(items) == 1:
        return items[0]
    if not items:
        return _Item({}, 0, True)
    chars = must = 0
    nullable = True
    guards: list[tuple[int, int, int]] = []
    seen: dict[tuple[int, int], int] = {}
    for i, item in enumerate(items):
        chars |= item.chars
        must |= item.must
        nullable = nullable and item.nullable
        if not item.nullable or item.must:
            sig = (item.chars if not item.nullable else _ALL_CHARS, item.must)
            if sig in seen:
                if seen[sig] >= 0:
                    guards.append((-1, *sig))  # twice: a guard for every item
                    seen[sig] = -1
            elif len(seen) < 64:
                seen[sig] = i
                guards.append((i, *sig))
    chains: _Entries = {}
    for i, item in enumerate(items):
        for key, value in item.chains.items():
            if not guards or not _guarded(i, key[2], guards):
                _put(chains, key, value)
    return _Item(_bounded(chains), chars, nullable, must)


def _bounded(chains: _Entries) -> _Entries:
    """``chains``, or where they hold more than 64 kinds of characters, one chain per depth
    and countedness with all their characters (fewer siblings keep it from going on)."""
    if len(chains) <= 64:
        return chains
    merged: dict[tuple[int, bool], tuple[int, int, Any]] = {}
    for (depth, counted, chars), (product, trace) in chains.items():
        old = merged.get((depth, counted))
        if old is None:
            merged[depth, counted] = (chars, product, trace)
        else:
            best = (product, trace) if product > old[1] else (old[1], old[2])
            merged[depth, counted] = (old[0] | chars, *best)
    return {(d, c, chars): (product, trace)
            for (d, c), (chars, product, trace) in merged.items()}


def _alternatives(alts: list[_Item]) -> _Item:
    if len(alts) == 1:
        return alts[0]
    chains: _Entries = {}
    chars, nullable, must = 0, False, -1
    for alt in alts:
        for key, value in alt.chains.items():
            _put(chains, key, value)
        chars |= alt.chars
        nullable = nullable or alt.nullable
        must &= alt.must
    return _Item(_bounded(chains), chars, nullable, must if must > 0 else 0)


class _Link:
    """A quantifier of a chain, for a message: its text, where and in which rule, and the
    chain inside it (written out only when read)."""

    __slots__ = ("text", "where", "rule", "inner")

    def __init__(self, text: str, where: Any, rule: str, inner: _Link | None) -> None:
        self.text, self.where, self.rule, self.inner = text, where, rule, inner

    def __str__(self) -> str:
        parts: list[str] = []
        link: _Link | None = self
        while link is not None and len(parts) < 6:
            parts.append(f"{link.text} ({link.rule}, {link.where})")
            link = link.inner
        more = "" if link is None else " > ..."
        return f"{self.where} in {self.rule} (the chain: {' > '.join(parts)}{more})"


def _quantify(item: _Item, factor: int, counted: bool, nullable: bool, link: tuple[str, Any,
              str], found: list[Nested] | None) -> _Item:
    text, where, rule = link
    chains: _Entries = {(1, counted, item.chars): (factor, _Link(text, where, rule, None))}
    for (depth, was_counted, _), (product, inner) in item.chains.items():
        any_counted = was_counted or counted
        product = min(product * factor, _CAP if any_counted else _UNBOUNDED_CLAMP)
        key = (min(depth + 1, 3), any_counted, item.chars)
        trace = _Link(text, where, rule, inner)
        _put(chains, key, (product, trace))
        if found is not None and any_counted:
            found.append((product, key[0], trace, text))
    return _Item(chains, item.chars, nullable or item.nullable,
                 0 if nullable else item.must)


# A rule body's pieces, read once: ("lit", _Item), ("ref", name), ("open", lark optional),
# ("close", None), ("alt", None), ("quant", (factor, counted, may be empty, text, where)),
# ("opt", None), ("regex", (pattern, where)), ("json", (schema, where)).
_Piece = tuple[str, Any]


class _Grammar:
    """An EBNF grammar's rules, read once, and the chains of nested quantifiers in them,
    followed through rule (and Lark terminal) references.

    Each rule has a summary, the :class:`_Item` of its body: the chains a quantifier around
    a reference to it extends. Rules are summarised callee first (strongly connected
    components, Tarjan's order); a component holding a cycle (``value ::= object | ...``,
    ``object ::= "{" (value ("," value)*)? "}"``) is summarised again until nothing changes,
    a reference to a rule of the cycle reading its summary so far, so that recursion through
    a quantifier nests it once more per round: what still grows after a few rounds (a count
    around a reference to its own rule, ``x ::= ("a" x){0,4}``, nests without end) is taken
    as unbounded. A chain stops going on outward at a sequence where a sibling cannot be
    part of its text (:func:`_guarded`): JSON's ``("," value)*`` does not multiply the counts
    inside its quoted strings and numbers, nor ``"\\\\u" [0-9a-f]{4}`` the quantifiers around
    it."""

    def __init__(self, grammar: str, lark: bool) -> None:
        self.text, self.lark = grammar, lark
        self.rules: dict[str, list[_Piece]] = {}
        self.order: list[str] = []
        self.summary: dict[str, _Item] = {}
        self.inner: dict[str, tuple[list[Nested], _Item]] = {}  # per regex, by location
        self.found: list[Nested] = []  # the chains of the rules outside cycles
        self.cyclic: list[str] = []  # the rules in cycles
        self._read()

    # reading ----------------------------------------------------------------------------
    def _name_at(self, i: int) -> int:
        return _NAME_TAIL.match(self.text, i + 1).end()  # type: ignore[union-attr]

    def _read(self) -> None:
        text, lark, n = self.text, self.lark, len(self.text)
        pieces: list[_Piece] = []
        self.rules[""] = pieces  # (text before any rule)
        i = 0
        while i < n:
            c = text[i]
            if c == '"' or (c == "'" and lark):
                end = _skip_string(text, i)
                nocase = lark and end < n and text[end] == "i"
                chars, must = _literal_chars(text[i + 1:end - 1], nocase)
                pieces.append(("lit", _Item({}, chars, end - i <= 2, must)))
                i = end + nocase
                if lark and text.startswith("..", i):  # "a".."z": a range
                    i = _skip_string(text, i + 2) if i + 2 < n else n
                    pieces[-1] = ("lit", _Item({}, _ALL_CHARS, False))
            elif (c == "#" and not lark) or (c == "/" and lark and text.startswith("//", i)):
                i = _line_end(text, i)
            elif c == "/" and lark:
                end = _skip_string(text, i)
                flags = re.match(r"[imslux]*", text[end:]).group(0)  # type: ignore[union-attr]
                pieces.append(("regex", (text[i + 1:end - 1], f"regex at grammar offset {i}",
                                         "i" in flags or "x" in flags)))
                i = end + len(flags)
            elif c == "R" and not lark and (m := _GBNF_REGEX.match(text, i)):
                end = _skip_string(text, m.end() - 1)
                pieces.append(("regex", (_unquote(text[m.end():end - 1]),
                                         f"Regex at grammar offset {i}", False)))
                close = text.find(")", end)
                i = n if close < 0 else close + 1
            elif c == "[" and not lark:
                end = _skip_class(text, i)
                pieces.append(("lit", _Item({}, _class_chars(text[i + 1:end - 1]), False)))
                i = end
            elif c == "%" and lark:
                if text.startswith("%json", i):
                    start = text.find("{", i)
                    try:
                        schema, end = json.JSONDecoder().raw_decode(text, start)
                    except ValueError:
                        i += 5
                        continue
                    pieces.append(("json", (schema, f"%json at grammar offset {i}")))
                    i = end
                else:  # %import, %ignore, %llguidance ...: no chain
                    i = _line_end(text, i)
            elif c == "(" and not lark and re.match(r"\(\s*=", text[i:i + 16]):
                i = self._skip_group(i)  # a lookahead: no text of its own
            elif c in "([":
                pieces.append(("open", c == "["))
                i += 1
            elif c in ")]":
                pieces.append(("close", None))
                i += 1
            elif c == "|":
                pieces.append(("alt", None))
                i += 1
            elif c == "{" or (c == "~" and lark):
                m = (_BRACE_COUNT if c == "{" else _LARK_TILDE).match(text, i)
                if m is None:
                    i += 1
                    continue
                lo, hi = int(m.group(1)), m.group(2)
                unbounded = c == "{" and m.group(0).rstrip("} \t").endswith(",")
                factor = max(lo, UNBOUNDED_FACTOR) if unbounded else int(hi) if hi else lo
                pieces.append(("quant", (factor, True, lo == 0, m.group(0),
                                         f"grammar offset {i}")))
                i = m.end()
            elif c in "*+":
                pieces.append(("quant", (UNBOUNDED_FACTOR, False, c == "*", c,
                                         f"grammar offset {i}")))
                i += 1
            elif c == "?":
                pieces.append(("opt", None))
                i += 1
            elif c == "-" and text.startswith("->", i):  # a Lark alias: not a reference
                j = i + 2
                while j < n and text[j] in " \t":
                    j += 1
                i = self._name_at(j) if j < n and (text[j].isalnum() or text[j] == "_") \
                    else j
            elif c == "<" and lark:  # <[...]>, <name>: special tokens
                end = text.find(">", i)
                pieces.append(("lit", _OPAQUE))
                i = n if end < 0 else end + 1
            elif c.isalpha() or c == "_":
                j = self._name_at(i)
                name = text[i:j]
                d = (_LARK_DEFINES if lark else _DEFINES).match(text, j)
                if d is not None:
                    if lark:
                        name = _PRIORITY.sub("", name)
                        if pieces and pieces[-1][0] == "opt":  # ?rule: (inlined)
                            pieces.pop()
                    pieces = self.rules.setdefault(name, [])
                    if pieces:
                        pieces.append(("alt", None))  # a rule given twice: both alternatives
                    else:
                        self.order.append(name)
                    i = d.end()
                else:
                    pieces.append(("ref", name))
                    i = j
            else:
                i += 1

    def _skip_group(self, i: int) -> int:
        depth, n = 0, len(self.text)
        while i < n:
            c = self.text[i]
            if c == '"':
                i = _skip_string(self.text, i)
                continue
            if c == "[":
                i = _skip_class(self.text, i)
                continue
            if c == "(":
                depth += 1
            elif c == ")":
                depth -= 1
                if depth == 0:
                    return i + 1
            i += 1
        return n

    # summarising ------------------------------------------------------------------------
    def _refs(self, name: str) -> list[str]:
        return [p[1] for p in self.rules[name] if p[0] == "ref" and p[1] in self.rules]

    def _components(self) -> list[list[str]]:
        """The strongly connected components of the reference graph, callees first."""
        return strongly_connected({name: self._refs(name) for name in self.rules})

    def _summarise(self) -> None:
        for component in self._components():
            cyclic = len(component) > 1 or component[0] in self._refs(component[0])
            if not cyclic:  # summarised once, its chains found on the way
                self.summary[component[0]] = self._body(component[0], self.found)
                continue
            self.cyclic.extend(component)
            for name in component:
                self.summary[name] = _Item({}, 0, True)
            for round_ in range(40):
                changed = False
                for name in component:
                    new = self._body(name, None)
                    old = self.summary[name]
                    if new.chars != old.chars or any(
                            old.chains.get(k, (-1,))[0] < v[0] for k, v in new.chains.items()):
                        changed = True
                        if round_ >= 6:  # still growing: a nesting without end
                            for key, (product, trace) in list(new.chains.items()):
                                if old.chains.get(key, (-1,))[0] < product:
                                    new.chains[key] = (_CAP if key[1] else _UNBOUNDED_CLAMP,
                                                       trace)
                        _merge_item(new, old)
                    self.summary[name] = new
                if not changed:
                    break

    def _regex(self, pattern: str, where: str, nocase: bool,
               rule: str) -> tuple[list[Nested], _Item]:
        """A regex's own chains (as :func:`regex_nesting` finds them) and what it exposes
        to the quantifiers around it."""
        cached = self.inner.get(where)
        if cached is None:
            found = list(regex_nesting(pattern, where))
            cached = found, self._evaluate(_regex_pieces(pattern, where, nocase), rule, None)
            self.inner[where] = cached
        return cached

    def _body(self, name: str, found: list[Nested] | None) -> _Item:
        """The summary of rule ``name``'s body; with ``found``, the chains of two or more
        nested quantifiers with a count among them appended to it."""
        return self._evaluate(self.rules[name], name, found)

    def _evaluate(self, pieces: list[_Piece], name: str, found: list[Nested] | None) -> _Item:
        label = name if name == "structural tag" else f"rule {name}"
        frames: list[tuple[list[_Item], list[_Item], bool]] = [([], [], False)]
        for kind, value in pieces:
            alts, seq, _ = frames[-1]
            if kind == "lit":
                seq.append(value)
            elif kind == "ref":
                ref = self.summary.get(value)
                seq.append(_OPAQUE if ref is None else
                           _Item(ref.chains, ref.chars, True))  # (a reference guards nothing)
            elif kind == "regex":
                pattern, where, nocase = value
                inner, item = self._regex(pattern, where, nocase, name)
                if found is not None:
                    found.extend(inner)
                seq.append(item)
            elif kind == "json":
                if found is not None:
                    found.extend(schema_nesting(value[0], value[1]))
                seq.append(_OPAQUE)
            elif kind == "open":
                frames.append(([], [], value))
            elif kind == "close":
                if len(frames) > 1:
                    self._close(frames)
            elif kind == "alt":
                alts.append(_sequence(seq))
                seq.clear()
            elif kind == "quant" and seq:
                factor, counted, empty, text, where = value
                seq[-1] = _quantify(seq[-1], factor, counted, empty, (text, where, label),
                                    found)
            elif kind == "opt" and seq:
                last = seq[-1]
                seq[-1] = _Item(last.chains, last.chars, True)
        while len(frames) > 1:
            self._close(frames)
        alts, seq, _ = frames[0]
        return _alternatives(alts + [_sequence(seq)])

    @staticmethod
    def _close(frames: list[tuple[list[_Item], list[_Item], bool]]) -> None:
        alts, seq, optional = frames.pop()
        group = _alternatives(alts + [_sequence(seq)])
        if optional:  # Lark [...]
            group = _Item(group.chains, group.chars, True)
        frames[-1][1].append(group)

    def nesting(self) -> Iterator[Nested]:
        self._summarise()
        yield from self.found
        for name in self.cyclic:  # once more, on the final summaries
            found: list[Nested] = []
            self._body(name, found)
            yield from found


def _merge_item(into: _Item, old: _Item) -> None:
    """Keep what an earlier round found (summaries only grow)."""
    for key, value in old.chains.items():
        _put(into.chains, key, value)
    into.chars |= old.chars


def schema_nesting(schema: Any, path: str = "") -> Iterator[Nested]:
    """:func:`regex_nesting` of every ``pattern`` and ``patternProperties`` key of a JSON
    schema, at every schema position (as :func:`schema_counts`)."""
    for node, where in schema_nodes(schema):
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            yield from regex_nesting(pattern, _At("pattern at ", _Here(path, where)))
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for key in props:
                if isinstance(key, str):
                    yield from regex_nesting(key, _At(f"patternProperties key {key[:40]!r} at ",
                                                _Here(path, where)))


class _Here:
    """A schema position for a message: ``path`` and its JSON pointer ("/" where both are
    empty), when read."""

    __slots__ = ("path", "where")

    def __init__(self, path: str, where: Pointer) -> None:
        self.path, self.where = path, where

    def __str__(self) -> str:
        return f"{self.path}{self.where}" or "/"


def _structural_nesting(node: Any, path: str = "") -> Iterator[Nested]:
    """:func:`regex_nesting` of the schemas, regexes and grammars inside a structural tag."""
    stack: list[tuple[Any, str]] = [(node, path)]
    while stack:
        item, here = stack.pop()
        if isinstance(item, list):
            stack.extend((v, f"{here}/{i}") for i, v in enumerate(item))
        elif isinstance(item, dict):
            for key, value in item.items():
                at = f"{here}/{key}"
                if key in ("schema", "json_schema") and isinstance(value, dict):
                    yield from schema_nesting(value, at)
                elif key in ("pattern", "regex") and isinstance(value, str):
                    yield from regex_nesting(value, f"regex at {at}")
                elif key in ("grammar", "ebnf") and isinstance(value, str):
                    yield from ((p, d, f"{at} {w}", t) for p, d, w, t in
                                ebnf_nesting(value, item.get("syntax") == "lark"))
                else:
                    stack.append((value, at))
    if isinstance(node, dict) and isinstance(node.get("format"), dict):
        found: list[Nested] = []
        _format_item(node["format"], f"{path}/format", found, 0)
        yield from found


_TAG_FORMAT_DEPTH = 200  # deeper formats count as a chain without end


def _format_item(node: Any, path: str, found: list[Nested], depth: int) -> _Item:
    """What a structural tag's format exposes to a ``repeat`` (``star``, ``plus``) around
    it, the chains those quantifiers make appended to ``found``: ``repeat``, ``star``,
    ``plus``, ``optional``, ``sequence``, ``or``, ``tag`` (its ``begin`` and ``end`` strings
    as literals), ``const_string``, ``regex`` and ``grammar`` (its root rule) are followed;
    any other format (``json_schema``, ``any_text``, the triggered and dispatched tags)
    exposes no chain."""
    if depth > _TAG_FORMAT_DEPTH:
        return _Item({(3, True, _ALL_CHARS): (_CAP, _Link("nesting", path, "structural tag",
                                                          None))}, _ALL_CHARS, True)
    if not isinstance(node, dict):
        return _OPAQUE
    kind, content = node.get("type"), node.get("content")
    if kind in ("repeat", "star", "plus", "optional"):
        item = _format_item(content, f"{path}/content", found, depth + 1)
        if kind == "optional":
            return _Item(item.chains, item.chars, True)
        if kind != "repeat":
            return _quantify(item, UNBOUNDED_FACTOR, False, kind == "star",
                             (kind, path, "structural tag"), found)
        lo, hi = node.get("min"), node.get("max")
        if not isinstance(hi, int) or isinstance(hi, bool) or \
                not isinstance(lo, int) or isinstance(lo, bool):
            return item  # the backend's own error
        factor = max(lo, UNBOUNDED_FACTOR) if hi < 0 else hi
        return _quantify(item, factor, True, lo <= 0, (f"repeat min={lo} max={hi}", path,
                                                        "structural tag"), found)
    if kind in ("sequence", "or") and isinstance(node.get("elements"), list):
        items = [_format_item(e, f"{path}/elements/{i}", found, depth + 1)
                 for i, e in enumerate(node["elements"])]
        return _sequence(items) if kind == "sequence" else _alternatives(items)
    if kind == "tag":
        begin, end = node.get("begin"), node.get("end")
        ends = [end] if isinstance(end, str) else end if isinstance(end, list) else []
        return _sequence([
            _literal_item(begin) if isinstance(begin, str) else _OPAQUE,
            _format_item(content, f"{path}/content", found, depth + 1),
            _alternatives([_literal_item(e) if isinstance(e, str) else _OPAQUE
                           for e in ends] or [_OPAQUE])])
    if kind == "const_string" and isinstance(node.get("value"), str):
        return _literal_item(node["value"])
    if kind == "regex" and isinstance(node.get("pattern"), str):
        where = f"regex at {path}/pattern"
        grammar = _Grammar("", False)
        return grammar._evaluate(_regex_pieces(node["pattern"], where), "structural tag", None)
    if kind == "grammar" and isinstance(node.get("grammar"), str):
        lark = node.get("syntax") == "lark"
        grammar = _Grammar(node["grammar"], lark)
        grammar._summarise()
        return grammar.summary.get("start" if lark else "root", _OPAQUE)
    return _OPAQUE


def _literal_item(text: str) -> _Item:
    chars, must = _literal_chars(text.replace("\\", "\\\\"), False)
    return _Item({}, chars, not text, must)


def _per_guide_type(params: GuidedDecodingParams, backend: str,
                    regex: Callable[[str], Iterator[T]],
                    ebnf: Callable[[str, bool], Iterator[T]],
                    schema: Callable[[Any], Iterator[T]],
                    tag: Callable[[Any], Iterator[T]]) -> Iterator[T]:
    """The walk of ``params`` for its guide type (EBNF read as Lark for llguidance, a JSON
    guide parsed first). A guide that does not parse here (malformed JSON) yields nothing:
    the backend's own compile error describes it."""
    gt, guide = params.guide_type, params.guide
    if gt is GuideType.REGEX:
        return regex(guide)
    if gt is GuideType.EBNF_GRAMMAR:
        return ebnf(guide, backend == "llguidance")
    if gt in (GuideType.JSON_SCHEMA, GuideType.STRUCTURAL_TAG):
        try:
            doc = json.loads(guide)
        except ValueError:
            return iter(())
        return schema(doc) if gt is GuideType.JSON_SCHEMA else tag(doc)
    return iter(())


def nested_counts(params: GuidedDecodingParams, backend: str) -> Iterator[Nested]:
    """Every chain of nested quantifiers of a guide with a count among them, as ``backend``
    reads it: ``(product, depth, location, text of the outermost quantifier)``."""
    return _per_guide_type(params, backend, regex_nesting, ebnf_nesting, schema_nesting,
                           _structural_nesting)


def guide_counts(params: GuidedDecodingParams, backend: str) -> Iterator[Found]:
    """Every repetition count of a guide as ``backend`` reads it. A guide that does not parse
    here (malformed JSON) yields nothing: the backend's own compile error describes it."""
    return _per_guide_type(params, backend, regex_counts, ebnf_counts, schema_counts,
                           _structural_counts)


def check_guide_limits(params: GuidedDecodingParams, backend: str, max_count: int) -> None:
    """Refuse a guide asking for a repetition count above ``max_count`` (itself at most
    :data:`BACKEND_MAX_COUNT`), or nesting quantifiers whose counts multiply past
    :data:`MAX_NESTED_PRODUCT` (two nested) or :data:`MAX_DEEP_NESTED_PRODUCT` (three or
    more), or past ``max_count`` where that is lower (:func:`nested_counts`), or nesting
    a regex's groups deeper than :data:`MAX_GROUP_DEPTH`.

    Raises:
        UnsupportedGuideError: naming the first such count or chain, where it is, and the
            limit.
    """
    limit = min(max_count, BACKEND_MAX_COUNT)
    try:
        for value, where, what in guide_counts(params, backend):
            if value > limit:
                beyond = ("beyond what the backends represent (2**31 - 1; xgrammar would "
                          "wrap it modulo 2**32)" if value > BACKEND_MAX_COUNT else
                          f"above GuidedDecodingConfig.max_repetition_count={limit} (match "
                          "time grows with the count; raise the limit to allow it)")
                raise UnsupportedGuideError(f"repetition count {value} ({what}) at "
                                            f"{_short(str(where))} is "
                                            f"{beyond}", guide_type=params.guide_type.name,
                                            backend=backend)
    except GroupNestingError as e:
        raise GroupNestingError(e.detail, guide_type=params.guide_type.name,
                                backend=backend) from None
    for product, depth, where, what in nested_counts(params, backend):
        name, most = (("MAX_NESTED_PRODUCT", MAX_NESTED_PRODUCT) if depth == 2 else
                      ("MAX_DEEP_NESTED_PRODUCT", MAX_DEEP_NESTED_PRODUCT))
        bound = min(limit, most)
        if product > bound:
            shown = f"over {_CAP}" if product >= _CAP else str(product)
            nesting = "two nested quantifiers" if depth == 2 else \
                "three or more nested quantifiers"
            rule = (f"{bound} (capgraph.grammar.guide_limits.{name}, or "
                    "max_repetition_count where lower)")
            raise UnsupportedGuideError(
                f"{nesting} ending in {what} at {_short(str(where), 480)} repeat {shown} times "
                "(their counts "
                f"multiplied, an unbounded one as {UNBOUNDED_FACTOR}), above {rule}: one "
                "step over a long token grows with that product and cannot be interrupted",
                guide_type=params.guide_type.name, backend=backend)


def main(argv: list[str] | None = None) -> None:
    """Measure what a regex guide costs: compile and matcher creation, then the host step
    (accept ``a``, fill one row) per token, fed ``--tokens`` times on the Tekken vocabulary.
    Prints the worst and the last step's milliseconds and the resident-memory growth.

    With ``--long-token N``: on a vocabulary of the tokens ``a`` .. ``a`` x N, the time of one
    accept of the N-character token by a fresh matcher, the nested-count limits lifted
    (``--limit`` still applies to single counts); with ``--guide-type ebnf`` (or
    ``structural_tag``) the arguments are such guides (xgrammar only: llguidance needs a real
    tokenizer)."""
    import argparse
    import time

    import torch

    from ..params import GuidedDecodingConfig
    from ..tokenizers import load_tokenizer
    from . import create_matcher_factory

    parser = argparse.ArgumentParser(prog="python -m capgraph.grammar.guide_limits")
    parser.add_argument("patterns", nargs="+")
    parser.add_argument("--backend", default="xgrammar", choices=["xgrammar", "llguidance"])
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--limit", type=int, default=BACKEND_MAX_COUNT)
    parser.add_argument("--long-token", type=int, default=0)
    parser.add_argument("--guide-type", default="regex",
                        choices=["regex", "ebnf", "structural_tag"])
    args = parser.parse_args(argv)
    if args.long_token:
        _long_token(args.patterns, args.backend, args.long_token, args.limit, args.guide_type)
        return
    tokenizer = load_tokenizer("tekken")
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tokenizer, backend=args.backend, max_repetition_count=args.limit,
        host_step_budget_ms=None))
    token = int(tokenizer.convert_tokens_to_ids("a"))  # type: ignore[arg-type]
    bitmask = torch.zeros(1, (len(tokenizer) + 31) // 32, dtype=torch.int32)

    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096 / 2**20

    for pattern in args.patterns:
        rss, start = rss_mb(), time.perf_counter()
        try:
            matcher = factory.create(GuidedDecodingParams.regex(pattern))
        except Exception as e:
            print(f"{pattern}: {type(e).__name__}: {e}")
            continue
        created = time.perf_counter() - start
        worst = last = 0.0
        for fed in range(args.tokens):
            start = time.perf_counter()
            try:
                ok = matcher.accept_token(token)
                matcher.fill_next_token_bitmask(bitmask, 0)
            except Exception as e:
                print(f"{pattern}: after {fed} tokens {type(e).__name__}: {str(e)[:80]}")
                break
            last = (time.perf_counter() - start) * 1e3
            worst = max(worst, last)
            if not ok:
                break
        print(f"{args.backend} {pattern}: compile+create {created * 1e3:.1f} ms, {fed + 1} "
              f"tokens, worst {worst:.2f} ms, last {last:.2f} ms per token, "
              f"rss +{rss_mb() - rss:.0f} MB")
    factory.close()


def _long_token(patterns: list[str], backend: str, chars: int, limit: int,
                guide_type: str = "regex") -> None:
    import time

    from ..params import GuidedDecodingConfig
    from . import create_matcher_factory
    from . import guide_limits  # (the module the factory reads, also when run as __main__)

    guide_limits.MAX_NESTED_PRODUCT = BACKEND_MAX_COUNT  # lifted in this process only
    guide_limits.MAX_DEEP_NESTED_PRODUCT = BACKEND_MAX_COUNT
    vocab = ["a" * (i + 1) for i in range(chars)] + ["</s>"]
    factory = create_matcher_factory(GuidedDecodingConfig(
        encoded_vocab=vocab, stop_token_ids=[chars], vocab_size_padded=chars + 32,
        backend=backend,  # type: ignore[arg-type]
        max_repetition_count=limit, host_step_budget_ms=None, compile_disk_cache_bytes=0))
    for pattern in patterns:
        kind = {"ebnf": GuideType.EBNF_GRAMMAR, "structural_tag": GuideType.STRUCTURAL_TAG}.get(
            guide_type, GuideType.REGEX)
        matcher = factory.create(GuidedDecodingParams(kind, pattern))
        start = time.perf_counter()
        ok = matcher.accept_token(chars - 1)
        print(f"{backend} {pattern}: one accept of a {chars}-character token "
              f"{(time.perf_counter() - start) * 1e3:.2f} ms (accepted: {ok})", flush=True)
    factory.close()


if __name__ == "__main__":
    main()
