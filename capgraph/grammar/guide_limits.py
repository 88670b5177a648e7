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
- EBNF: GBNF ``{n}`` / ``{n,m}`` (xgrammar) and Lark ``{n}``, ``~ n``, ``~ n..m`` and
  ``%json {...}`` (llguidance), skipping strings, character classes and comments;
- structural tags: the schemas, regexes and grammars inside them.

A nested unbounded quantifier such as ``(a*)*`` is not refused here: star height is not
ambiguity (``(ab*)*`` and ``(\\w+\\s)*`` match in linear time), so refusing it would refuse
sound guides. The host-step budget (``GuidedDecodingConfig.host_step_budget_ms``) bounds what
an ambiguous guide can cost at match time instead.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Iterator

from ..errors import UnsupportedGuideError
from ..params import DEFAULT_MAX_REPETITION_COUNT, GuidedDecodingParams, GuideType
from .schema_policy import schema_positions

__all__ = ["BACKEND_MAX_COUNT", "DEFAULT_MAX_REPETITION_COUNT", "check_guide_limits",
           "regex_counts", "ebnf_counts", "schema_counts"]

#: The largest count both backends represent (xgrammar: a signed 32-bit integer).
BACKEND_MAX_COUNT = 2**31 - 1

#: JSON-schema keywords whose value becomes a repetition count.
COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems", "minProperties",
                  "maxProperties")

_BRACE_COUNT = re.compile(r"\{\s*(\d+)\s*(?:,\s*(\d*)\s*)?\}")
_LARK_TILDE = re.compile(r"~\s*(\d+)(?:\s*\.\.\s*(\d+))?")

# A count found: (value, offset in the text or JSON pointer, what it is).
Found = tuple[int, str, str]


def regex_counts(pattern: str, where: str = "regex") -> Iterator[Found]:
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
            yield int(lo), f"{where} offset {i}", m.group(0)
            if hi:
                yield int(hi), f"{where} offset {i}", m.group(0)
            i = m.end()
        else:
            prev_atom = c not in "(|"
            i += 1


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
    for node, where in schema_positions(schema, path):
        here = where or "/"
        for keyword in COUNT_KEYWORDS:
            value = node.get(keyword)
            if isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):  # (NaN, inf: the backend's own error)
                yield int(value), f"{where}/{keyword}", f"{keyword}={value!r}"
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            yield from regex_counts(pattern, f"pattern at {here}")
        props = node.get("patternProperties")
        if isinstance(props, dict):
            for key in props:
                yield from regex_counts(key, f"patternProperties key {key!r} at {here}")


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


def _line_end(text: str, i: int) -> int:
    end = text.find("\n", i)
    return len(text) if end < 0 else end


def _structural_counts(node: Any, path: str = "") -> Iterator[Found]:
    """The counts inside a structural tag: its schemas, regexes and GBNF grammars."""
    if isinstance(node, dict):
        for key, value in node.items():
            here = f"{path}/{key}"
            if key in ("schema", "json_schema") and isinstance(value, dict):
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


def guide_counts(params: GuidedDecodingParams, backend: str) -> Iterator[Found]:
    """Every repetition count of a guide as ``backend`` reads it. A guide that does not parse
    here (malformed JSON) yields nothing: the backend's own compile error describes it."""
    gt, guide = params.guide_type, params.guide
    if gt is GuideType.REGEX:
        yield from regex_counts(guide)
    elif gt is GuideType.EBNF_GRAMMAR:
        yield from ebnf_counts(guide, lark=backend == "llguidance")
    elif gt in (GuideType.JSON_SCHEMA, GuideType.STRUCTURAL_TAG):
        try:
            doc = json.loads(guide)
        except ValueError:
            return
        if gt is GuideType.JSON_SCHEMA:
            yield from schema_counts(doc)
        else:
            yield from _structural_counts(doc)


def check_guide_limits(params: GuidedDecodingParams, backend: str, max_count: int) -> None:
    """Refuse a guide asking for a repetition count above ``max_count`` (itself at most
    :data:`BACKEND_MAX_COUNT`).

    Raises:
        UnsupportedGuideError: naming the first such count, where it is, and the limit.
    """
    limit = min(max_count, BACKEND_MAX_COUNT)
    for value, where, what in guide_counts(params, backend):
        if value > limit:
            beyond = ("beyond what the backends represent (2**31 - 1; xgrammar would wrap "
                      "it modulo 2**32)" if value > BACKEND_MAX_COUNT else
                      f"above GuidedDecodingConfig.max_repetition_count={limit} (match time "
                      "grows with the count; raise the limit to allow it)")
            raise UnsupportedGuideError(f"repetition count {value} ({what}) at {where} is "
                                        f"{beyond}", guide_type=params.guide_type.name,
                                        backend=backend)


def main(argv: list[str] | None = None) -> None:
    """Measure what a regex guide costs: compile and matcher creation, then the host step
    (accept ``a``, fill one row) per token, fed ``--tokens`` times on the Tekken vocabulary.
    Prints the worst and the last step's milliseconds and the resident-memory growth."""
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
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    main()
