"""What a Lark grammar (llguidance's dialect, which xgrammar's ``Grammar.from_lark`` shares for
these parts) embeds: ``%json`` schemas, ``%llguidance`` options and token references.

The text is read the way llguidance's Lark lexer reads it (``parser/src/lark/lexer.rs``):
comments (``#`` or ``//`` to the end of the line), string literals, regex literals and the JSON
value after ``%json`` / ``%regex`` / ``%llguidance`` are skipped as units, so text inside them
is never taken for a token reference; every other ``<...>`` (no ``<``, ``>`` or whitespace
inside) is one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = ["LarkJson", "LarkRegex", "LarkTokenRef", "lark_json_values", "lark_options",
           "lark_regexes", "lark_token_refs", "replace_json_values"]

# One unit at a position, as llguidance's lexer reads it (longest match; "//" is always a
# comment: a regex literal has at least one character between its slashes).
_UNIT = re.compile(
    r'(?P<comment>(?:#|//)[^\n]*)'
    r'|(?P<string>"(?:\\.|[^"\\\n])*"i?)'
    r'|(?P<regex>/(?:\\.|[^/\\])+/[imslux]*)'
    r'|(?P<directive>%(?:json|regex|llguidance))'
    r'|(?P<ref><[^<>\s]+>)')
_JSON_SPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


@dataclass(frozen=True, slots=True)
class LarkJson:
    """The JSON value after a ``%json`` or ``%llguidance`` (``text[start:end]``)."""

    value: Any
    start: int
    end: int
    line: int


@dataclass(frozen=True, slots=True)
class LarkRegex:
    """A regex literal ``/pattern/flags``: ``pattern`` as written between the slashes (``\\/``
    still escaped); the literal is ``text[start:end]``."""

    pattern: str
    flags: str
    line: int
    start: int = field(default=0, compare=False)
    end: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class LarkTokenRef:
    """A token reference: ``<[id]>``, ``<[a-b, c]>``, ``<[^a-b]>``, ``<[*]>`` or ``<name>``.

    ``ranges`` (inclusive id ranges) is None for a reference by name; ``negated`` means every
    id outside ``ranges``; ``everything`` is ``<[*]>``."""

    text: str
    line: int
    ranges: tuple[tuple[int, int], ...] | None
    negated: bool = False
    everything: bool = False


class LarkTextError(ValueError):
    """The text cannot be read (a ``%json`` value that is not JSON, a malformed token range)."""


def _scan(text: str) -> Iterator[tuple[str, int, int, Any]]:
    """``(kind, start, end, value)`` for each ``%json`` value (kind ``json``), ``%llguidance``
    value (``options``), token reference (``ref``) and regex literal (``regex``, the literal's
    text)."""
    pos, n = 0, len(text)
    while pos < n:
        m = _UNIT.search(text, pos)
        if m is None:
            return
        kind = m.lastgroup
        if kind == "directive":
            start = _JSON_SPACE.match(text, m.end()).end()  # type: ignore[union-attr]
            try:
                value, end = _DECODER.raw_decode(text, start)
            except ValueError as e:
                raise LarkTextError(f"the value after {m.group(0)} at line "
                                    f"{text.count(chr(10), 0, m.start()) + 1} is not JSON: {e}"
                                    ) from None
            if m.group(0) == "%json":
                yield "json", start, end, value
            elif m.group(0) == "%llguidance":
                yield "options", start, end, value
            pos = end
            continue
        if kind in ("ref", "regex"):
            yield kind, m.start(), m.end(), m.group(0)
        pos = m.end()


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def lark_json_values(text: str) -> list[LarkJson]:
    """Every ``%json`` value of the Lark grammar ``text``, in order.

    Raises:
        LarkTextError: a ``%json`` / ``%regex`` / ``%llguidance`` value is not JSON.
    """
    return [LarkJson(value, start, end, _line(text, start))
            for kind, start, end, value in _scan(text) if kind == "json"]


def lark_options(text: str) -> list[LarkJson]:
    """Every ``%llguidance`` value (the grammar's llguidance options) of the Lark grammar
    ``text``, in order.

    Raises:
        LarkTextError: a ``%json`` / ``%regex`` / ``%llguidance`` value is not JSON.
    """
    return [LarkJson(value, start, end, _line(text, start))
            for kind, start, end, value in _scan(text) if kind == "options"]


def lark_regexes(text: str) -> list[LarkRegex]:
    """Every regex literal (``/.../flags``) of the Lark grammar ``text``, in order.

    Raises:
        LarkTextError: a ``%json`` / ``%regex`` / ``%llguidance`` value is not JSON.
    """
    out = []
    for kind, start, end, literal in _scan(text):
        if kind == "regex":
            close = literal.rindex("/")
            out.append(LarkRegex(literal[1:close], literal[close + 1:], _line(text, start),
                                 start, end))
    return out


def replace_json_values(text: str, values: list[LarkJson], new: list[str]) -> str:
    """``text`` with each ``%json`` value of ``values`` replaced by the JSON text ``new[k]``."""
    out, pos = [], 0
    for found, replacement in zip(values, new):
        out.append(text[pos:found.start])
        out.append(replacement)
        pos = found.end
    out.append(text[pos:])
    return "".join(out)


def lark_token_refs(text: str) -> list[LarkTokenRef]:
    """Every token reference of the Lark grammar ``text``, in order, read as llguidance reads
    it (``compiler.rs``: ``<[...]>`` holds ``*`` or comma-separated ids and ``a-b`` ranges,
    optionally after ``^``; anything else in ``<...>`` names a special token).

    Raises:
        LarkTextError: a value after a directive is not JSON, or a ``<[...]>`` is malformed.
    """
    refs = []
    for kind, start, _, ref in _scan(text):
        if kind != "ref":
            continue
        line = _line(text, start)
        if not (ref.startswith("<[") and ref.endswith("]>")):
            refs.append(LarkTokenRef(ref, line, None))
            continue
        body = ref[2:-2]
        negated = body.startswith("^")
        body = body[1:] if negated else body
        if body.strip() == "*":
            refs.append(LarkTokenRef(ref, line, (), negated, everything=True))
            continue
        ranges = []
        for part in body.split(","):
            ends = [e.strip() for e in part.split("-")]
            if len(ends) == 1 and not ends[0]:
                continue
            if len(ends) > 2 or not all(e.isdigit() for e in ends):
                raise LarkTextError(f"the token reference {ref!r} at line {line} is malformed")
            ranges.append((int(ends[0]), int(ends[-1])))
        refs.append(LarkTokenRef(ref, line, tuple(ranges), negated))
    return refs
