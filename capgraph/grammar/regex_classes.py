"""The character classes of a regex, read once for the checks that look inside them
(:func:`~capgraph.grammar.semantics.xgrammar_wider`), and the escapes outside them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

__all__ = ["CharClass", "OutsideEscape", "regex_parts"]

_HEX = frozenset("0123456789abcdefABCDEF")
_HEX_WIDTHS = {"x": 2, "u": 4, "U": 8}
_CONTROLS = {"n": 0x0A, "r": 0x0D, "t": 0x09, "f": 0x0C, "v": 0x0B, "0": 0x00, "a": 0x07,
             "b": 0x08, "e": 0x1B}


@dataclass(frozen=True, slots=True)
class CharClass:
    """A character class: ``text`` as written (brackets included); the code point ranges it
    lists (one character is ``(c, c)``); the letters of the escapes it holds that are not one
    character (``d``, ``W``, ``p``, an unknown letter); where it starts in the pattern."""

    text: str
    negated: bool
    ranges: tuple[tuple[int, int], ...]
    escapes: tuple[str, ...]
    start: int = field(default=0, compare=False)


@dataclass(frozen=True, slots=True)
class OutsideEscape:
    """An escape outside any class that is not one character (``\\d``, ``\\W``, ``\\p{..}``):
    its letter and position."""

    letter: str
    position: int


def _member(pattern: str, i: int) -> tuple[int | None, str, int]:
    """The class member at ``i``: its code point (None for an escape that is not one
    character, whose letter comes second) and the index after it. ``\\xHH``, ``\\x{..}``,
    ``\\uHHHH``, ``\\UHHHHHHHH`` and the control escapes are characters; ``\\p{..}`` is read
    whole."""
    if pattern[i] != "\\" or i + 1 >= len(pattern):
        return ord(pattern[i]), "", i + 1
    letter = pattern[i + 1]
    if letter in _HEX_WIDTHS:
        if pattern[i + 2:i + 3] == "{":
            end = pattern.find("}", i + 3)
            digits, after = (pattern[i + 3:end], end + 1) if end > 0 else ("", i + 2)
        else:
            width = _HEX_WIDTHS[letter]
            digits, after = pattern[i + 2:i + 2 + width], i + 2 + width
        if digits and all(c in _HEX for c in digits) and int(digits, 16) <= 0x10FFFF:
            return int(digits, 16), "", after
        return None, letter, i + 2
    if letter in _CONTROLS:
        return _CONTROLS[letter], "", i + 2
    if letter.isalnum():
        end = pattern.find("}", i + 2) if letter in "pPN" and pattern[i + 2:i + 3] == "{" else -1
        return None, letter, (end + 1 if end > 0 else i + 2)
    return ord(letter), "", i + 2


def regex_parts(pattern: str) -> Iterator[CharClass | OutsideEscape]:
    """The classes of ``pattern`` and the escapes outside them that are not one character,
    in order. A ``]`` right after ``[`` or ``[^`` is a member (Python's and Rust's reading,
    as in a Lark regex literal)."""
    i, n = 0, len(pattern)
    while i < n:
        if pattern[i] == "\\":
            code, letter, after = _member(pattern, i)
            if code is None:
                yield OutsideEscape(letter, i)
            i = max(after, i + 2) if i + 1 < n else n
            continue
        if pattern[i] != "[":
            i += 1
            continue
        start = i
        negated = pattern.startswith("[^", i)
        i += 2 if negated else 1
        ranges: list[tuple[int, int]] = []
        escapes: list[str] = []
        if pattern[i:i + 1] == "]":
            ranges.append((ord("]"), ord("]")))
            i += 1
        while i < n and pattern[i] != "]":
            low, letter, i = _member(pattern, i)
            if low is None:
                escapes.append(letter)
                continue
            high = low
            if pattern[i:i + 1] == "-" and pattern[i + 1:i + 2] not in ("]", ""):
                high_code, high_letter, after = _member(pattern, i + 1)
                if high_code is None:  # [a-\d]: 'a', '-' and the escape
                    ranges.append((ord("-"), ord("-")))
                    escapes.append(high_letter)
                else:
                    high = max(low, high_code)
                i = after
            ranges.append((low, high))
        i += 1
        yield CharClass(pattern[start:i], negated, tuple(ranges), tuple(escapes), start)
