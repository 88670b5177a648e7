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

Counts each under the limit still multiply when nested: xgrammar's cost of one step grows
with the product along a chain of nested quantifiers and with the token's length, and one
call cannot be interrupted (figures below). :func:`nested_counts` finds every chain of nested
quantifiers with a count among them (through regex groups, EBNF groups and the regexes inside
them), an unbounded quantifier weighing :data:`UNBOUNDED_FACTOR`; a chain of two may multiply to
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
costs over many steps. A chain through an EBNF rule reference (``x ::= "a"{0,40}`` used as
``x{0,40}``) is not followed.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Iterator, TypeVar

from ..errors import UnsupportedGuideError
from ..params import DEFAULT_MAX_REPETITION_COUNT, GuidedDecodingParams, GuideType
from .schema_policy import Pointer, _short, schema_nodes

T = TypeVar("T")

__all__ = ["BACKEND_MAX_COUNT", "DEFAULT_MAX_REPETITION_COUNT", "MAX_NESTED_PRODUCT",
           "MAX_DEEP_NESTED_PRODUCT",
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


def regex_counts(pattern: str, where: Any = "regex") -> Iterator[Found]:
    """Every repetition count of ``pattern``: ``(count, location, description)``.

    Escapes (``\\{``, ``\\x{41}``, ``\\p{L}``) and character classes (``[{]``, ``[[:digit:]]``)
    hold no repetition; a ``{`` that does not open ``{n}``, ``{n,}`` or ``{n,m}`` is a literal.
    """
    i, n = 0, len(pattern)
    prev_atom = False  # whether a quantifier here would apply to something
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
    """The index just past the character class opening at ``text[i] == '['``."""
    n = len(text)
    j = i + 1
    if j < n and text[j] == "^":
        j += 1
    if j < n and text[j] == "]":  # a leading ']' is a member
        j += 1
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
        elif c == "[" and j + 1 < n and text[j + 1] in ":.=":  # [:alpha:], [.x.], [=x=]
            end = text.find(text[j + 1] + "]", j + 2)
            j = n if end < 0 else end + 2
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
    inside (Lark ``/.../``, GBNF ``Regex("...")``) taking part as groups, and those of the
    patterns of Lark ``%json`` schemas. (A chain through a rule reference, ``x ::= y{0,9}``
    then ``x{0,9}``, is not followed.)"""
    chains = _Chains()
    i, n = 0, len(grammar)
    while i < n:
        c = grammar[i]
        if c == '"' or (c == "'" and lark):
            i = _skip_string(grammar, i)
            chains.atom()
        elif (c == "#" and not lark) or (c == "/" and lark and grammar.startswith("//", i)):
            i = _line_end(grammar, i)
        elif c == "/" and lark:
            end = _skip_string(grammar, i)
            chains.open()
            yield from _regex_events(grammar[i + 1:end - 1], f"regex at grammar offset {i}",
                                     chains)
            chains.close()
            i = end
            while i < n and grammar[i] in "imslux":  # the regex's flags
                i += 1
        elif c == "R" and not lark and (m := _GBNF_REGEX.match(grammar, i)):
            end = _skip_string(grammar, m.end() - 1)
            chains.open()
            yield from _regex_events(_unquote(grammar[m.end():end - 1]),
                                     f"Regex at grammar offset {i}", chains)
            chains.close()
            close = grammar.find(")", end)
            i = n if close < 0 else close + 1
        elif c == "[" and not lark:
            i = _skip_class(grammar, i)
            chains.atom()
        elif c == "%" and lark and grammar.startswith("%json", i):
            start = grammar.find("{", i)
            try:
                schema, end = json.JSONDecoder().raw_decode(grammar, start)
            except ValueError:
                i += 5
                continue
            yield from schema_nesting(schema, f"%json at grammar offset {i}")
            chains.atom()
            i = end
        elif c in "([" :
            chains.open()
            i += 1
        elif c in ")]":
            chains.close()
            i += 1
        elif c == "|" or c == "=" or c == ":":
            chains.alt()
            i += 1
        elif c == "{" or (c == "~" and lark):
            m = (_BRACE_COUNT if c == "{" else _LARK_TILDE).match(grammar, i)
            if m is None:
                i += 1
                continue
            lo, hi = int(m.group(1)), m.group(2)
            unbounded = c == "{" and m.group(0).rstrip("} \t").endswith(",")
            factor = max(lo, UNBOUNDED_FACTOR) if unbounded else int(hi) if hi else lo
            yield from chains.quantifier(factor, True, f"grammar offset {i}", m.group(0))
            i = m.end()
        elif c in "*+":
            yield from chains.quantifier(UNBOUNDED_FACTOR, False, f"grammar offset {i}", c)
            i += 1
        elif c == "\n" and _RULE_START.match(grammar, i):
            chains.end()  # a new rule: groups left open do not go on into it
            chains.alt()
            i += 1
        elif c.isspace() or c == "?":
            i += 1
        else:
            j = i + 1
            while j < n and (grammar[j].isalnum() or grammar[j] in "_.-"):
                j += 1
            chains.atom()
            i = j


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
    more), or past ``max_count`` where that is lower (:func:`nested_counts`).

    Raises:
        UnsupportedGuideError: naming the first such count or chain, where it is, and the
            limit.
    """
    limit = min(max_count, BACKEND_MAX_COUNT)
    for value, where, what in guide_counts(params, backend):
        if value > limit:
            beyond = ("beyond what the backends represent (2**31 - 1; xgrammar would wrap "
                      "it modulo 2**32)" if value > BACKEND_MAX_COUNT else
                      f"above GuidedDecodingConfig.max_repetition_count={limit} (match time "
                      "grows with the count; raise the limit to allow it)")
            raise UnsupportedGuideError(f"repetition count {value} ({what}) at "
                                        f"{_short(str(where))} is "
                                        f"{beyond}", guide_type=params.guide_type.name,
                                        backend=backend)
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
                f"{nesting} ending in {what} at {_short(str(where))} repeat {shown} times "
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
    (``--limit`` still applies to single counts)."""
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
    args = parser.parse_args(argv)
    if args.long_token:
        _long_token(args.patterns, args.backend, args.long_token, args.limit)
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


def _long_token(patterns: list[str], backend: str, chars: int, limit: int) -> None:
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
        matcher = factory.create(GuidedDecodingParams.regex(pattern))
        start = time.perf_counter()
        ok = matcher.accept_token(chars - 1)
        print(f"{backend} {pattern}: one accept of a {chars}-character token "
              f"{(time.perf_counter() - start) * 1e3:.2f} ms (accepted: {ok})", flush=True)
    factory.close()


if __name__ == "__main__":
    main()
