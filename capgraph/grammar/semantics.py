"""What a guide means, the same on every backend.

- ``GuideType.JSON`` is a JSON object or array (:data:`JSON_CONTAINER_SCHEMA`): xgrammar's
  builtin JSON grammar, and the same schema on llguidance.
- JSON whitespace (``GuidedDecodingConfig.json_whitespace``) is space, newline, carriage return
  and tab (:data:`JSON_WHITESPACE_CHARS`), between tokens only, as xgrammar reads it.
- Regexes (REGEX guides, schema ``pattern``s, structural-tag ``regex`` elements, an EBNF
  ``Regex("...")``) follow ECMA-262 read without flags, as JSON Schema's ``pattern`` does:
  ``\\d`` is ``[0-9]`` and ``\\w`` is ``[0-9A-Za-z_]`` (ASCII), ``\\s`` is ECMA's white space
  (tab, vertical tab, form feed, space, no-break space, BOM, every ``Zs`` space, the line
  terminators), ``.`` is any character but ``\\n``, ``\\r``, U+2028 and U+2029, and an escaped
  surrogate pair is the one character it spells (a regex matches code points: ``.`` takes
  U+1F600 whole, as ECMA-262 does with the ``u`` flag). A schema ``pattern`` matches the
  string, not its JSON text (:func:`ecma_regex` with ``json_string``). xgrammar reads the
  classes so; its ``.`` is any character, so :func:`ecma_regex` writes ECMA's out for it, and
  an optional group as ``{0,1}`` (its ``?`` on a group with a repeat inside takes more).
  llguidance reads Rust's regex syntax (Unicode ``\\d`` / ``\\w`` / ``\\s``, nested classes
  and set operations, ``\\p{..}``, inline flags), so :func:`ecma_regex` writes every class out
  for it as ECMA reads it. What either backend would read otherwise and cannot be written out
  (``\\e``, ``\\a``, ``\\p{L}``, ``\\x{41}``, ``(?i)``, a lone surrogate escape) is refused
  with ``UnsupportedGuideError``.
- A Lark grammar (an EBNF_GRAMMAR guide on llguidance, a structural tag's ``grammar`` element
  with ``"syntax": "lark"`` on xgrammar) means what llguidance reads: its regex literals in
  Rust's syntax, with Unicode ``\\d`` / ``\\w`` / ``\\s`` and Unicode case folding under the
  ``i`` flag (Python's ``re``, which the ``lark`` package uses, agrees on these). xgrammar reads
  ``\\d`` and ``\\w`` as ASCII, ``\\s`` as ECMA's (which takes U+FEFF and not U+0085), so
  :func:`ecma_tag` writes each positive ``\\s`` out as Unicode White_Space for it
  (:func:`lark_spaces`); it reads classes and escapes as ECMA's and folds ASCII letters only:
  a regex literal it would read wider otherwise (a negated shorthand, a nested or POSIX
  class, a set operation, a surrogate escape: :func:`xgrammar_wider`) is refused on
  xgrammar.
- Properties and items a JSON schema does not list are absent where it lists some (xgrammar's
  strict reading); llguidance is given those defaults written out (:func:`llguidance_schema`).
  Where an array or object schema lists none, any are allowed, as JSON Schema has it; xgrammar
  reads such a schema as ``[]`` / ``{}`` only once it has any keyword besides ``type``, so it
  is given ``items: true`` / ``additionalProperties: true`` written out
  (:func:`xgrammar_schema`).
"""

from __future__ import annotations

import bisect
import functools
import json
import re
from typing import Any, Callable, Iterator, Mapping

from .formats import exact_format, exact_format_beside_pattern
from .lark_text import LarkTextError, lark_regexes
from .regex_classes import CharClass, OutsideEscape, regex_parts
from .schema_policy import declares_draft_before_2020_12, subschemas

__all__ = ["ECMA_DOT", "JSON_CONTAINER_SCHEMA", "JSON_WHITESPACE_CHARS", "ascii_classes",
           "ascii_schema_patterns", "ecma_ebnf", "ecma_regex", "ecma_tag", "lark_spaces",
           "llguidance_schema",
           "xgrammar_schema", "xgrammar_wider"]

#: ``GuideType.JSON`` on every backend: a JSON object or array (the "JSON mode" of serving
#: engines; xgrammar's builtin JSON grammar, which fills a mask twice as fast as a schema).
JSON_CONTAINER_SCHEMA = '{"type": ["object", "array"]}'
#: JSON whitespace as both backends are configured to read it.
JSON_WHITESPACE_CHARS = " \n\r\t"

_DIGIT = "0-9"
_WORD = "0-9A-Za-z_"
# ECMA-262's WhiteSpace and LineTerminator code points (\s): tab, vertical tab, form feed,
# space, no-break space, every Zs space, the BOM, and LF, CR, U+2028, U+2029
_SPACE = ("\\t\\n\\x0B\\x0C\\r \\xA0\\u1680\\u2000-\\u200A\\u2028\\u2029\\u202F\\u205F"
          "\\u3000\\uFEFF")
#: ECMA-262's ``.`` (without the ``s`` flag): any character but a line terminator. Both
#: backends read ``\n``, ``\r`` and ``\uHHHH`` inside a class as those code points.
ECMA_DOT = "[^\\n\\r\\u2028\\u2029]"
# escape letter -> (outside a class, inside a class), for llguidance; negated ones nest a
# class, which llguidance's regex syntax reads as a union with the enclosing class
_REWRITE = {
    "d": (f"[{_DIGIT}]", _DIGIT),
    "D": (f"[^{_DIGIT}]", f"[^{_DIGIT}]"),
    "w": (f"[{_WORD}]", _WORD),
    "W": (f"[^{_WORD}]", f"[^{_WORD}]"),
    "s": (f"[{_SPACE}]", _SPACE),
    "S": (f"[^{_SPACE}]", f"[^{_SPACE}]"),
}
# the single characters an escape letter stands for in ECMA-262 (without flags)
_CONTROL_ESCAPES = {"f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B}
_HEX = frozenset("0123456789abcdefABCDEF")
_QUANTIFIER = re.compile(r"\{[0-9]+(?:,[0-9]*)?\}")
_GROUP_NAME = re.compile(r"\(\?<[A-Za-z_$][A-Za-z0-9_$]*>")

# -- character sets as sorted, disjoint, inclusive code-point intervals --------------------------
Intervals = list[tuple[int, int]]
#: every character a text can hold (no surrogate code point)
_UNIVERSE: Intervals = [(0, 0xD7FF), (0xE000, 0x10FFFF)]
_SHORTHAND_SETS: dict[str, Intervals] = {
    "d": [(0x30, 0x39)],
    "w": [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)],
    "s": [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A),
          (0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000),
          (0xFEFF, 0xFEFF)],
}
_LINE_TERMINATOR_SET: Intervals = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]
#: the characters a JSON string cannot hold unescaped: U+0000-U+001F, '"' and '\'
_JSON_ESCAPED_SET: Intervals = [(0, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_JSON_CONTROLS: Intervals = [(0, 0x1F)]


def _union(sets: list[Intervals]) -> Intervals:
    merged: Intervals = []
    for lo, hi in sorted(iv for ivs in sets for iv in ivs):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _subtract(ivs: Intervals, minus: Intervals) -> Intervals:
    out: Intervals = []
    minus = _union([minus])
    for lo, hi in _union([ivs]):
        for mlo, mhi in minus:
            if mhi < lo or mlo > hi:
                continue
            if mlo > lo:
                out.append((lo, mlo - 1))
            lo = mhi + 1
            if lo > hi:
                break
        if lo <= hi:
            out.append((lo, hi))
    return out


def _complement(ivs: Intervals) -> Intervals:
    return _subtract(_UNIVERSE, ivs)


def _shorthand_set(letter: str) -> Intervals:
    base = _SHORTHAND_SETS[letter.lower()]
    return base if letter.islower() else _complement(base)


# -- sets and characters written for xgrammar's regex parser ------------------------------------
# xgrammar 0.2.9 misreads some ECMA spellings that mean one character (measured on Tekken):
# it reads the hex digits after \x and \u greedily ('\x090' is U+0090, '[\u00e9b]' takes
# U+0E9B, '[\u00e9\w]' fails to compile), a '\^' first in a class as the class's negation
# ('[\^a]' takes any character but 'a'), and refuses a raw line feed or carriage return in a
# class. A raw control or non-ASCII character in a JSON-schema pattern makes xgrammar build
# the pattern from grammar rules instead of one automaton, whose steps can be slow
# ('^(?:[^\0-<U+001F>"\\a]|...)*$': 45 ms a step; with '\x1f' 0.06 ms). So every class, and
# every character written as an escape, is written out for it from the character's code
# point: the character itself, an identity escape for regex syntax, '\n' / '\r' / '\t',
# '\xHH' for the other ASCII control characters and '\uHHHH' for the rest of the BMP, only
# where no hex digit follows, and '^' never first in a class.
_XG_CLASS_ESCAPE = {0x5C: "\\\\", 0x5D: "\\]", 0x5B: "\\[", 0x5E: "\\^", 0x2D: "\\-",
                    0x0A: "\\n", 0x0D: "\\r", 0x09: "\\t"}
_XG_SYNTAX = frozenset("^$\\.*+?()[]{}|/-")


def _xg_hex_escaped(code: int) -> bool:
    """Whether xgrammar is given ``code`` as a hex escape (no hex digit may follow it)."""
    return (code < 0x20 or 0x7F <= code <= 0xFFFF) and code not in _XG_CLASS_ESCAPE


def _xg_class_char(code: int) -> str:
    if _xg_hex_escaped(code):
        return f"\\x{code:02x}" if code < 0x80 else f"\\u{code:04x}"
    return _XG_CLASS_ESCAPE.get(code) or chr(code)


def _xg_literal(code: int) -> str:
    """The character ``code`` outside a class, for xgrammar's regex parser."""
    ch = chr(code)
    if ch in _XG_SYNTAX or ch == '"':
        return "\\" + ch
    if _xg_hex_escaped(code):
        return f"[{_xg_class_char(code)}]"  # closed by ']': no hex digit can follow
    return _XG_CLASS_ESCAPE.get(code) or ch


_JSON_SHORT_ESCAPES = {0x22: '\\"', 0x5C: "\\\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r",
                      0x09: "t"}


def _json_escapes(codes: list[int]) -> str:
    """A regex (xgrammar's syntax) for the JSON escapes of ``codes``, characters a JSON string
    holds only escaped: ``\\"``, ``\\\\``, ``\\n`` ..., ``\\u00XX`` for a control character
    without a short escape (hex letters in either case). One leading backslash shared by
    all, the ``\\u`` escapes grouped by their third hex digit."""
    short = [_JSON_SHORT_ESCAPES[c] for c in codes if c in _JSON_SHORT_ESCAPES]
    branches = []
    for high in (0, 1):
        lows = [c & 0xF for c in codes if c >> 4 == high and c not in _JSON_SHORT_ESCAPES]
        if len(lows) == 16:
            branches.append(f"u00{high}[0-9a-fA-F]")
        elif lows:
            digits = "".join(f"{d:x}{d:X}" if d > 9 else f"{d}" for d in lows)
            branches.append(f"u00{high}" + (f"[{digits}]" if len(digits) > 1 else digits))
    if short:
        branches.append("[" + "".join(short) + "]" if len(short) > 1 else short[0])
    return "\\\\" + (branches[0] if len(branches) == 1 else "(?:" + "|".join(branches) + ")")


def _xg_class(ivs: Intervals) -> str:
    """The non-empty set ``ivs`` as one xgrammar class (or a single escaped ``^``)."""
    complement = _complement(ivs)
    if complement and len(complement) < len(ivs):
        items, head = complement, "[^"
    else:
        items, head = list(ivs), "["
    if head == "[" and len(items) == 1 and items[0][0] == 0x5E:
        lo, hi = items[0]  # '^' alone, or first with nothing to put before it
        if lo == hi:
            return "\\^"
        items = [(lo + 1, hi), (lo, lo)]
    parts = [_xg_class_char(lo) if lo == hi else f"{_xg_class_char(lo)}-{_xg_class_char(hi)}"
             for lo, hi in items]
    # a part ending in a hex escape goes last (those all begin with '\', but for at most one
    # range from a printable character, which goes first among them): no hex digit after it
    hex_ended = [p for (lo, hi), p in zip(items, parts) if _xg_hex_escaped(hi)]
    plain = [p for (lo, hi), p in zip(items, parts) if not _xg_hex_escaped(hi)]
    hex_ended.sort(key=lambda p: p.startswith("\\"))
    if head == "[" and plain and plain[0].startswith("\\^"):
        caret = plain.pop(0)
        if plain:
            plain.append(caret)
        else:
            hex_ended.append(caret)
    return head + "".join(plain + hex_ended) + "]"


def _xg_set(ivs: Intervals, json_string: bool) -> str | None:
    """The set ``ivs`` as xgrammar's regex parser reads it; None for the empty set.

    In a JSON string (a ``pattern``) a set matches the characters of ``ivs`` that JSON writes
    bare; only a set of characters JSON always escapes (U+0000-U+001F, ``"``, ``\\``) is
    matched as their escapes. xgrammar 0.2.9 builds a pattern as one automaton with those
    characters taken out of every character it matches, a backslash included, unless that
    leaves it nothing to match: an escape next to a bare alternative is dead there
    (``^(?:a|\\\\n)$`` takes neither ``"\\n"`` nor ``"\n"``), so a set holding both kinds is
    narrowed to its bare characters, which refuses some valid strings and never lets an
    invalid one through."""
    ivs = _union([ivs])
    if not json_string:
        return _xg_class(ivs) if ivs else None
    bare = _subtract(ivs, _JSON_ESCAPED_SET)
    if bare:
        return _xg_class(bare)
    escaped = [code for lo, hi in ivs for code in range(lo, hi + 1)]
    return "(?:" + _json_escapes(escaped) + ")" if escaped else None


def _rust_char(code: int) -> str:
    """The character ``code`` in a llguidance (Rust syntax) regex, in a class or outside."""
    ch = chr(code)
    return ch if ch.isalnum() or code > 0x7F else f"\\x{{{code:X}}}"


def _non_ecma(what: str, position: int, backend: str, guide_type: str, where: str) -> Exception:
    from ..errors import UnsupportedGuideError
    place = f" of {where}" if where else ""
    return UnsupportedGuideError(
        f"regex {what} at position {position}{place} is not ECMA-262 (read without flags) "
        f"or {backend} would read it otherwise; capgraph refuses it rather than let a "
        "different language through", guide_type=guide_type, backend=backend)


def ecma_regex(pattern: str, backend: str, guide_type: str = "REGEX", where: str = "",
               json_string: bool = False) -> str:
    """``pattern``, an ECMA-262 regex (as JSON Schema's ``pattern`` is, read without flags), in
    the syntax ``backend`` (``"xgrammar"`` or ``"llguidance"``) reads with that meaning.

    On both: ``.`` outside a class is ECMA's (no line terminator: :data:`ECMA_DOT`); an escaped
    surrogate pair (``\\ud83d\\ude00``) is the one character it spells, written as itself; a
    ``{`` that starts no quantifier is a literal ``{``. Refused (``UnsupportedGuideError``,
    naming the construct and its position): a lone surrogate escape; a letter escape ECMA reads
    as the plain letter (``\\a``, ``\\e``, ``\\z``, ``\\p``, ``\\A``, ...; the backends read
    several as something else); ``\\x`` / ``\\u`` / ``\\c`` without their hex digits or letter;
    ``\\0`` before a digit (an octal escape); group syntax ECMA does not have (``(?i)``,
    ``(?P<n>...)``); an empty class ``[]``; a quantifier right after a quantifier and its
    optional lazy ``?`` (``a++``, ``a*+``, ``a**``, ``a{2}{3}``, ``a+??``: possessive or
    stacked repeats, which ECMA-262 does not have and other dialects read differently).

    llguidance reads Rust's regex syntax, so for it every character class is written out as
    ECMA reads it: ``\\d`` / ``\\w`` / ``\\s`` (and negations) as ECMA's explicit sets,
    ``[`` / ``&&`` / ``--`` / ``~~`` inside a class as literal characters (Rust nests classes
    and reads set operations there; ``[[:alpha:]]`` is a class and a ``]``, as ECMA has it),
    ``[^]`` as any character, ``[\\b]`` as backspace, ``\\cX`` and ``\\0`` as the characters
    they stand for. For xgrammar every character class, and every character written as an
    escape, is written out from its code points (xgrammar misreads ``\\x090``, ``[\\u00e9b]``
    and ``[\\^a]``: the note above ``_xg_class``), and ``?`` after a group as ``{0,1}``
    (xgrammar 0.2.9's automaton for ``(X)?`` lets a loop inside X skip part of it:
    ``a(bx+)?d`` takes ``axd``); it reads the rest as ECMA does and gets it as written.

    ``json_string``: the regex is a JSON schema's ``pattern`` or ``patternProperties`` key.
    llguidance 1.9.1 takes ``\\"`` and ``\\\\`` for a set that holds every control character
    but not both of ``"`` and ``\\``, so it is given such a set without U+001F. xgrammar
    0.2.9 matches such a regex against the JSON text of the string, escapes included, not
    against the string: a ``\\\\`` or ``\\x22`` in the pattern would let a bare ``\\`` or
    ``"`` into the JSON text (not JSON), and a set such as ``[\\D]`` a bare control
    character. So a character the pattern spells that JSON writes escaped (U+0000-U+001F,
    ``"``, ``\\``) is matched as its escape (``\\"``, ``\\n``, ``\\u001c`` ...), and so is a
    class of such characters only; any other set is matched as its characters JSON writes
    bare (``_xg_set``). Stricter than JSON Schema where a string spells a character with an
    escape it does not need (``\\u0061``) or holds an escaped character where the pattern
    has a set (``"\\n"`` for ``.``), never looser."""
    rust = backend == "llguidance"
    xg_json = json_string and not rust
    out: list[str] = []
    i, n = 0, len(pattern)

    def refuse(what: str, at: int) -> Exception:
        return _non_ecma(what, at, backend, guide_type, where)

    def escape(at: int, in_class: bool) -> tuple[str, Any, int]:
        """The escape at ``at`` (a backslash): ("class", letter, end), ("char", code point,
        end) or ("other", None, end) (kept as written; the backend reads or refuses it); a
        backslash that ends the pattern is refused."""
        if at + 1 >= n:  # (ECMA-262 refuses it; llguidance would read it as nothing)
            raise refuse("a lone backslash at the end of the pattern", at)
        c = pattern[at + 1]
        if c in _REWRITE:
            return "class", c, at + 2
        if c in _CONTROL_ESCAPES:
            return "char", _CONTROL_ESCAPES[c], at + 2
        if c in "xu":
            width = 2 if c == "x" else 4
            digits = pattern[at + 2:at + 2 + width]
            if len(digits) != width or not set(digits) <= _HEX:
                raise refuse(f"escape '\\{c}' without {width} hex digits", at)
            code, end = int(digits, 16), at + 2 + width
            if 0xDC00 <= code <= 0xDFFF:
                raise refuse(f"lone surrogate escape '{pattern[at:end]}'", at)
            if 0xD800 <= code <= 0xDBFF:
                low = pattern[end:end + 6]
                if (len(low) == 6 and low[:2] == "\\u" and set(low[2:]) <= _HEX
                        and 0xDC00 <= int(low[2:], 16) <= 0xDFFF):
                    code = 0x10000 + ((code - 0xD800) << 10) + (int(low[2:], 16) - 0xDC00)
                    return "char", code, end + 6
                raise refuse(f"lone surrogate escape '{pattern[at:end]}'", at)
            return "char", code, end
        if c == "c":
            letter = pattern[at + 2:at + 3]
            if not (letter.isascii() and letter.isalpha()):
                raise refuse("escape '\\c' without a control letter", at)
            return "char", ord(letter) % 32, at + 3
        if c == "0":
            if pattern[at + 2:at + 3].isdigit():
                raise refuse("octal escape '\\0' followed by a digit", at)
            return "char", 0, at + 2
        if c == "b" and in_class:
            return "char", 0x08, at + 2
        if c in "123456789" or (c in "bBk" and not in_class):
            return "other", None, at + 2  # a backreference or an assertion: the backend's
        if c.isascii() and c.isalpha():
            raise refuse(f"escape '\\{c}' (ECMA-262 reads it as a plain '{c}')", at)
        return "char", ord(c), at + 2  # an identity escape

    def xg_char(code: int) -> str:
        """The one character ``code`` outside a class, for xgrammar."""
        if xg_json and (code < 0x20 or code in (0x22, 0x5C)):
            return "(?:" + _json_escapes([code]) + ")"
        return _xg_literal(code)

    # after a quantifier ("quantified"), or after its lazy "?" ("lazy"): another quantifier
    # there is no ECMA-262 (a SyntaxError) and means something else elsewhere: "a++" is
    # possessive in PCRE, Java and Python (so "a++a" matches nothing), stacked repeats
    # ("a**", "a{2}{3}") an error in Python; llguidance would read either as nested repeats
    # ("a++a" taking "aa") and xgrammar refuses them with its own error
    after, previous = "", 0
    group_closed = False  # the last thing written closes a group
    while i < n:
        ch = pattern[i]
        quantifier = _QUANTIFIER.match(pattern, i) if ch == "{" else None
        quantifier_text = quantifier.group(0) if quantifier else ch if ch in "*+?" else ""
        if quantifier_text and after and not (ch == "?" and after == "quantified"):
            raise refuse(f"quantifier '{quantifier_text}' right after the quantifier "
                         f"'{pattern[previous:i]}' (a possessive or stacked repeat)", i)
        if quantifier_text:
            lazy = after == "quantified" and ch == "?"
            after, previous = ("lazy", previous) if lazy else ("quantified", i)
        else:
            after = ""
        closed, group_closed = group_closed, False
        if ch == "?" and closed and not rust:
            # xgrammar 0.2.9 builds 'X?' as X's automaton plus an empty path from X's start
            # to its first end, without a new start or end, so a loop of X into its start or
            # out of that end skips part of X: 'a(bx+)?d' takes 'axd', 'x(b{2,3})?' takes
            # 'xb'. Its '{0,1}' adds a new start, as its other repeats do.
            out.append("{0,1}")
            i += 1
        elif ch == "\\":
            kind, value, end = escape(i, False)
            if kind == "class" and rust:
                out.append(_REWRITE[value][0])
            elif kind == "char" and rust:
                out.append(_rust_char(value))
            elif kind == "class" and xg_json:
                out.append(_xg_set(_shorthand_set(value), True) or "")
            elif kind == "char":
                out.append(xg_char(value))
            else:
                out.append(pattern[i:end])
            i = end
        elif ch == "[":
            i = _class(pattern, i, rust, out, escape, refuse, json_string)
        elif ch == ".":
            out.append(_xg_set(_complement(_LINE_TERMINATOR_SET), True) or ""
                       if xg_json else ECMA_DOT)
            i += 1
        elif ch == "(" and pattern.startswith("(?", i):
            if not (pattern[i + 2:i + 3] in (":", "=", "!")
                    or pattern.startswith(("(?<=", "(?<!"), i)
                    or _GROUP_NAME.match(pattern, i)):
                raise refuse(f"group syntax '{pattern[i:i + 4]}'", i)
            out.append("(?")
            i += 2
        elif ch == "{":
            m = _QUANTIFIER.match(pattern, i)
            if m:
                out.append(m.group(0))
                i = m.end()
            else:
                out.append("\\{")  # ECMA-262 (Annex B): a literal brace
                i += 1
        elif xg_json and (ch == '"' or ord(ch) < 0x20):
            out.append(xg_char(ord(ch)))
            i += 1
        elif ch in "]}" and not rust:
            out.append("\\" + ch)  # Annex B: a literal (xgrammar's automaton refuses it bare)
            i += 1
        else:
            out.append(ch)
            group_closed = ch == ")"
            i += 1
    return "".join(out)


def _class(pattern: str, start: int, rust: bool, out: list[str], escape: Any,
           refuse: Any, json_string: bool = False) -> int:
    """Append the ECMA character class at ``start`` (its ``[``) to ``out`` as the backend reads
    it (:func:`ecma_regex`); the index after it. ECMA classes do not nest: ``[`` inside is a
    character."""
    n = len(pattern)
    i = start + 1
    negated = pattern.startswith("^", i)
    i += negated
    if pattern.startswith("]", i):
        if not negated:
            raise refuse("empty character class '[]'", start)
        out.append("[\\x{0}-\\x{10FFFF}]" if rust else
                   _xg_set(_UNIVERSE, json_string) or "")
        return i + 1
    # each item: ("char", code, src) / ("class", letter, src) / ("range", (lo, hi), src)
    items: list[tuple[str, Any, str]] = []

    def atom(at: int) -> tuple[str, Any, str, int]:
        if pattern[at] == "\\":
            kind, value, end = escape(at, True)
            if kind == "other":
                raise refuse(f"escape '{pattern[at:end]}' inside a class", at)
            return kind, value, pattern[at:end], end
        return "char", ord(pattern[at]), pattern[at], at + 1

    while i < n and pattern[i] != "]":
        at = i
        kind, value, src, i = atom(i)
        if (pattern.startswith("-", i) and i + 1 < n and pattern[i + 1] != "]"):
            kind2, value2, src2, end = atom(i + 1)
            if kind == "char" and kind2 == "char":
                if value > value2:
                    raise refuse(f"class range '{pattern[at:end]}' out of order", at)
                items.append(("range", (value, value2), f"{src}-{src2}"))
            else:  # Annex B: a class escape at either end makes the '-' a character
                items += [(kind, value, src), ("char", 0x2D, "-"), (kind2, value2, src2)]
            i = end
        else:
            items.append((kind, value, src))
    if i >= n:  # unterminated: the backend's error says so
        out.append(pattern[start:])
        return n

    members = _union([_shorthand_set(value) if kind == "class" else
                      [value] if kind == "range" else [(value, value)]
                      for kind, value, _ in items])
    members = _complement(members) if negated else _subtract(members, [(0xD800, 0xDFFF)])
    if not members:  # '[^\s\S]': a regex that can only dead-end where it is reached
        raise refuse(f"character class '{pattern[start:i + 1]}' that matches no character",
                     start)
    if not rust:
        out.append(_xg_set(members, json_string) or "")
        return i + 1

    if json_string and _subtract(_JSON_CONTROLS, members) == [] and \
            _subtract([(0x22, 0x22), (0x5C, 0x5C)], members) != []:
        # llguidance 1.9.1 takes '\\"' and '\\\\' for a set holding every control character
        # but not both of '"' and '\\' ('[^"]' took '"\\""', '[\\x00-\\x1fa]' took
        # '"\\\\"'), and not for one control character fewer: the set without U+001F
        members = _subtract(members, [(0x1F, 0x1F)])
        out.append("[" + "".join(_rust_char(lo) if lo == hi else
                                 f"{_rust_char(lo)}-{_rust_char(hi)}" for lo, hi in members) + "]")
        return i + 1

    parts = ["[^" if negated else "["]
    for kind, value, src in items:
        if kind == "class":
            parts.append(_REWRITE[value][1])
        elif kind == "range":
            parts.append(f"{_rust_char(value[0])}-{_rust_char(value[1])}")
        else:
            parts.append(_rust_char(value))
    parts.append("]")
    out.append("".join(parts))
    return i + 1


# an EBNF string escape (xgrammar's grammar parser) -> the character; \x takes every hex
# digit that follows, \u four, \U eight
_EBNF_SIMPLE = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "r": "\r", "t": "\t", "v": "\v",
                "f": "\f", "a": "\a", "e": "\x1b", "b": "\b", "[": "[", "]": "]", "-": "-",
                "?": "?", "0": "\0"}
_EBNF_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]+)|u([0-9a-fA-F]{4})|U([0-9a-fA-F]{8})|(.))",
                          re.DOTALL)
_EBNF_SURROGATE = re.compile(r"\\u([dD][89abAB][0-9a-fA-F]{2})"
                             r"(?:\\u([dD][c-fC-F][0-9a-fA-F]{2}))?"
                             r"|\\u([dD][c-fC-F][0-9a-fA-F]{2})")
# a string literal, a character class or a comment of EBNF text, or a Regex("...") call
_EBNF_TOKEN = re.compile(r'(?P<regex>\bRegex\s*\(\s*)"(?P<body>(?:\\.|[^"\\])*)"'
                         r'|"(?:\\.|[^"\\])*"|\[(?:\\.|[^\]\\])*\]|#[^\n]*', re.DOTALL)


def ebnf_unescape(body: str) -> str | None:
    """The text an xgrammar EBNF string literal's ``body`` spells (None: an escape not read
    here, left for xgrammar's parser to read or refuse)."""
    out: list[str] = []
    pos = 0
    for m in _EBNF_ESCAPE.finditer(body):
        out.append(body[pos:m.start()])
        pos = m.end()
        hex_digits = m.group(1) or m.group(2) or m.group(3)
        if hex_digits is not None:
            code = int(hex_digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                return None
            out.append(chr(code))
        elif m.group(4) in _EBNF_SIMPLE:
            out.append(_EBNF_SIMPLE[m.group(4)])
        else:
            return None
    out.append(body[pos:])
    return "".join(out)


def ebnf_escape(text: str) -> str:
    """``text`` as the body of an xgrammar EBNF string literal."""
    out: list[str] = []
    for ch in text:
        if ch in '\\"':
            out.append("\\" + ch)
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return "".join(out)


def _ebnf_surrogates(text: str, where: str) -> str:
    """``text`` (an EBNF string literal or class) with every escaped surrogate pair written as
    the ``\\U`` escape of the one character it spells; a lone surrogate escape is refused."""
    def join(m: re.Match[str]) -> str:
        # (the match must follow an even run of backslashes to be an escape)
        run = len(text[:m.start()]) - len(text[:m.start()].rstrip("\\"))
        if run % 2:
            return m.group(0)
        if m.group(1) is None or m.group(2) is None:
            raise _non_ecma(f"lone surrogate escape '{m.group(0)}'", m.start(), "xgrammar",
                            "EBNF_GRAMMAR", where)
        code = 0x10000 + ((int(m.group(1), 16) - 0xD800) << 10) + (int(m.group(2), 16) - 0xDC00)
        return f"\\U{code:08x}"
    return _EBNF_SURROGATE.sub(join, text)


def ecma_ebnf(grammar: str, guide_type: str = "EBNF_GRAMMAR") -> str:
    """The xgrammar EBNF text ``grammar`` with the regex of every ``Regex("...")`` as
    :func:`ecma_regex` writes it for xgrammar, and every escaped surrogate pair in a string
    literal or character class written as the one character it spells (a lone surrogate
    escape is refused). Comments and everything else are kept as written; a ``Regex`` string
    with an escape not read here is left for xgrammar's parser."""
    def token(m: re.Match[str]) -> str:
        text = m.group(0)
        if text.startswith("#"):
            return text
        if m.group("regex") is None:
            return _ebnf_surrogates(text, f"the EBNF literal at offset {m.start()}")
        pattern = ebnf_unescape(m.group("body"))
        if pattern is None:
            return text
        rewritten = ecma_regex(pattern, "xgrammar", guide_type,
                               f"Regex(...) at offset {m.start()} of the grammar")
        return f'{m.group("regex")}"{ebnf_escape(rewritten)}"'
    return _EBNF_TOKEN.sub(token, grammar)


def tag_nodes(doc: Any) -> Iterator[tuple[dict[str, Any], str]]:
    """Every JSON object of a structural-tag document ``doc`` with its JSON pointer (``""``
    for the root), a parent before its children, without recursion; the JSON schema a node
    embeds (the value of its ``json_schema`` key) is not walked: its objects are schemas, not
    tag nodes. A consumer may replace the values of a node's keys before the walk goes on into
    them."""
    stack: list[tuple[Any, str]] = [(doc, "")]
    while stack:
        node, at = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{at}/{k}") for k, item in reversed(list(enumerate(node))))
        elif isinstance(node, dict):
            yield node, at
            stack.extend((value, f"{at}/{key}") for key, value in reversed(list(node.items()))
                         if key != "json_schema")


def changed_tag(tag: str, change: Callable[[dict[str, Any], str], bool]) -> str:
    """The structural tag ``tag`` (JSON text) after ``change(node, pointer)`` is called on
    each of its JSON objects (:func:`tag_nodes`; it may change the node in place and says
    whether it did); ``tag`` itself where nothing changed or it is not JSON (xgrammar's error
    says what is wrong)."""
    try:
        doc = json.loads(tag)
    except ValueError:
        return tag
    changed = False
    for node, at in tag_nodes(doc):
        changed |= change(node, at)
    return json.dumps(doc, ensure_ascii=False) if changed else tag


def ecma_tag(tag: str) -> str:
    """The xgrammar structural tag ``tag`` (JSON text) with the pattern of every ``regex``
    element as :func:`ecma_regex` writes it for xgrammar and every EBNF ``grammar`` element as
    :func:`ecma_ebnf` writes it (:func:`changed_tag`)."""
    def change(node: dict[str, Any], at: str) -> bool:
        kind, before = node.get("type"), dict(node)
        if kind == "regex" and isinstance(node.get("pattern"), str):
            node["pattern"] = ecma_regex(node["pattern"], "xgrammar", "STRUCTURAL_TAG",
                                         f"the regex element at {at or '/'}")
        if kind == "grammar" and isinstance(node.get("grammar"), str):
            if node.get("syntax", "ebnf") == "lark":
                node["grammar"] = lark_spaces(node["grammar"])
            else:
                node["grammar"] = ecma_ebnf(node["grammar"], "STRUCTURAL_TAG")
        return node != before
    return changed_tag(tag, change)


# Unicode White_Space: what a Lark regex's \s is (Rust's, and Python's but for U+001C-U+001F)
_WHITE_SPACE_SET: Intervals = [(0x09, 0x0D), (0x20, 0x20), (0x85, 0x85), (0xA0, 0xA0),
                               (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
                               (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]


def lark_spaces(grammar: str) -> str:
    """The Lark ``grammar`` with every positive ``\\s`` of its regex literals written out as
    the Unicode White_Space characters for xgrammar, whose ECMA ``\\s`` takes U+FEFF (no
    White_Space character) and not U+0085: outside a class as a class of them, inside a
    class as its members (last, where no hex digit follows them). A ``\\s`` in a negated
    class is left (:func:`xgrammar_wider` refuses it); text that cannot be read is returned
    unchanged (the compile's check reports it)."""
    try:
        regexes = lark_regexes(grammar)
    except LarkTextError:
        return grammar
    out, pos = [], 0
    for found in regexes:
        pattern = _spaces_written(found.pattern)
        if pattern != found.pattern:
            out += [grammar[pos:found.start], f"/{pattern}/{found.flags}"]
            pos = found.end
    return "".join(out) + grammar[pos:] if out else grammar


def _spaces_written(pattern: str) -> str:
    """``pattern`` with each positive ``\\s`` written out (:func:`lark_spaces`): outside a
    class as a class of White_Space; a class holding it (and no escape but ``\\d``, ``\\w``,
    read as xgrammar reads them, ASCII) rewritten whole from its characters, so that no
    neighbour of the inserted ones changes what they mean; a negated class holding ``\\S``
    and no other escape (``[^\\S\\n]``: the spaces but a line feed) as the positive class of
    the White_Space characters it leaves. A class that nests a class or uses a set
    operation is left as written, for :func:`xgrammar_wider` to refuse. A ``/`` in a class
    written out is escaped (the class goes into a Lark regex literal)."""
    edits: list[tuple[int, int, str]] = []
    for part in regex_parts(pattern):
        if isinstance(part, OutsideEscape):
            if part.letter == "s":
                edits.append((part.position, part.position + 2, _xg_class(_WHITE_SPACE_SET)))
            continue
        if _nests_or_sets(part):
            continue
        if part.negated:
            if set(part.escapes) != {"S"}:
                continue
            chars = _subtract(_WHITE_SPACE_SET, list(part.ranges))
            if not chars:  # (matches nothing: left, for xgrammar_wider to name)
                continue
        elif "s" in part.escapes and set(part.escapes) <= {"s", "d", "w"}:
            chars = _union([list(part.ranges)] + [
                _WHITE_SPACE_SET if e == "s" else _SHORTHAND_SETS[e] for e in part.escapes])
        else:
            continue
        edits.append((part.start, part.start + len(part.text),
                      _xg_class(chars).replace("/", "\\/")))
    out, pos = [], 0
    for start, end, text in edits:
        out += [pattern[pos:start], text]
        pos = end
    return "".join(out) + pattern[pos:]


def _nests_or_sets(part: CharClass) -> bool:
    """Whether the class ``part`` nests a class or a POSIX class, or uses one of Rust's set
    operations (``&&``, ``--``, ``~~``), which xgrammar's ECMA reading takes for characters."""
    inner = _ESCAPED_PAIR.sub("", part.text[2 if part.negated else 1:-1])
    return "[" in inner or any(op in inner for op in ("&&", "--", "~~"))


# ASCII letters a case-insensitive match takes non-ASCII characters for (Python's ``re``,
# which Lark's regexes are: U+0130 and U+0131 for i, U+212A KELVIN SIGN for k, U+017F LONG S
# for s).
_ASCII_WITH_NON_ASCII_CASE = frozenset("iIkKsS")
_CLASS_SHORTHANDS = frozenset("dDwWsS")  # closed under case: a case variant stays in or out


@functools.cache
def _non_ascii_case_sensitive() -> list[int]:
    """Sorted code points whose case-insensitive match differs once non-ASCII case variants
    count: the ASCII letters of :data:`_ASCII_WITH_NON_ASCII_CASE` and every non-ASCII
    character with a case variant."""
    out = sorted(ord(c) for c in _ASCII_WITH_NON_ASCII_CASE)
    for cp in range(0x80, 0x1F000):  # (no cased character above U+1E943)
        c = chr(cp)
        if c.lower() != c or c.upper() != c or c.casefold() != c:
            out.append(cp)
    return out


def _case_sensitive_in(lo: str, hi: str) -> str | None:
    """A character of :func:`_non_ascii_case_sensitive` in ``lo``-``hi``, or None."""
    points = _non_ascii_case_sensitive()
    k = bisect.bisect_left(points, ord(lo))
    return chr(points[k]) if k < len(points) and points[k] <= ord(hi) else None


_SURROGATE_ESCAPE = re.compile(r"(?<!\\)(?:\\\\)*(\\u[dD][89a-fA-F][0-9a-fA-F]{2})")
_ESCAPED_PAIR = re.compile(r"\\.", re.DOTALL)


def xgrammar_wider(pattern: str, nocase: bool) -> str | None:
    """Where xgrammar would read the Lark regex ``pattern`` (``nocase``: with the ``i`` flag)
    wider than Lark does (llguidance's Rust ``regex``, and Python's ``re`` alike), a
    description of the construct; else None.

    xgrammar's ``\\d``, ``\\w`` and ``\\s`` are ASCII (``\\s`` with U+00A0 and a few
    more), so ``\\D``, ``\\W`` and ``\\S``, and a negated class holding ``\\d``, ``\\w`` or
    ``\\s``, take non-ASCII digits, letters or spaces the Lark grammar excludes. It folds case
    for ASCII letters only, so with ``i`` a negated class holding a character with a non-ASCII
    case variant lets the variant through (``[^kσ]``: ``Σ``, ``ς``, U+212A KELVIN SIGN).
    Positive ``\\d`` and ``\\w`` are only narrower. A positive ``\\s`` is ECMA's there
    (U+FEFF in, U+0085 out): reported here, it is what :func:`lark_spaces` writes out as
    Unicode White_Space for xgrammar first, so a grammar checked after that rewrite (as
    compiles check it) would be refused only for a class it could not write out (one that
    also holds an escape such as ``\\p{L}``, which xgrammar refuses already).
    An escape this reader does not know
    (``\\p{..}``) inside a negated class counts as such a construct. Beyond width: a class
    that nests a class or a POSIX class (``[[:digit:]]``) or uses Rust's set operations
    (``&&``, ``--``, ``~~``) means another set on xgrammar's ECMA reading (``[[:digit:]]+``
    took ``d]``), and a surrogate escape (``\\ud83d``), which Rust does not read, compiles
    on xgrammar to bytes that are not UTF-8."""
    surrogate = _SURROGATE_ESCAPE.search(pattern)
    if surrogate:
        return (f"the surrogate escape {surrogate.group(1)!r} at position {surrogate.start(1)} "
                "(Lark's regexes read no surrogates; xgrammar would write bytes that are not "
                "UTF-8): write the character itself or \\u{...}")
    for part in regex_parts(pattern):
        if isinstance(part, OutsideEscape):
            if part.letter in ("D", "W", "S"):
                return (f"'\\{part.letter}' at position {part.position} (xgrammar's \\d, \\w "
                        "and \\s are ASCII, so it would take the non-ASCII ones)")
            if part.letter == "s":
                return (f"'\\s' at position {part.position} (xgrammar's \\s takes U+FEFF, "
                        "which is no White_Space character)")
            continue
        where = f"the {'negated ' if part.negated else ''}class {part.text!r}"
        if _nests_or_sets(part):
            return (f"{where} nests a class or uses a set operation, which Lark's regexes "
                    "(Rust's) read and xgrammar's (ECMA's) read as other characters")

        shorthand = next((e for e in part.escapes
                          if e in _CLASS_SHORTHANDS and e.isupper() != part.negated), None)
        if shorthand:
            return (f"{where} holds '\\{shorthand}' (xgrammar's \\d, \\w and \\s are ASCII, "
                    "so the class would take the non-ASCII ones)")
        spaces = "S" if part.negated else "s"  # (a class of spaces lark_spaces left)
        if spaces in part.escapes:
            return (f"{where} holds '\\{spaces}' (xgrammar's \\s takes U+FEFF, which is no "
                    "White_Space character) beside an escape capgraph cannot write out for "
                    "it, or matching nothing")
        if not (part.negated and nocase):
            continue
        cased: str | None = None
        if any(e not in _CLASS_SHORTHANDS for e in part.escapes):
            cased = "an escape whose characters are not read here"
        else:
            hit = next((h for lo, hi in part.ranges
                        if (h := _case_sensitive_in(chr(lo), chr(hi))) is not None), None)
            cased = None if hit is None else (
                f"{hit!r} (U+{ord(hit):04X}), which has a non-ASCII case variant")
        if cased:
            return (f"{where} with the i flag holds {cased} (xgrammar folds case for ASCII "
                    "letters only, so the class would take the variant)")
    return None


def ascii_classes(pattern: str) -> str:
    """``pattern`` as llguidance must be given it (:func:`ecma_regex`)."""
    return ecma_regex(pattern, "llguidance")


# Keywords whose values are instances, not schemas: patterns inside them are data.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names (not keywords) to schemas (or, for draft-07's
# ``dependencies``, to lists of names).
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"})


def _exact_llguidance_format(result: dict[str, Any], node: dict[str, Any]) -> None:
    """Give ``result`` (``node`` as llguidance gets it) the exact pattern of a ``format``
    llguidance reads wider: in the format's place, or, beside a ``pattern``, as an ``allOf``
    branch of its own (llguidance intersects them)."""
    where = f"the pattern of format {node.get('format')!r}"
    if exact_format(result, "llguidance"):
        result["pattern"] = ecma_regex(result["pattern"], "llguidance", "JSON_SCHEMA", where,
                                       json_string=True)
        return
    beside = exact_format_beside_pattern(result, "llguidance")
    branches = result.get("allOf", [])
    if beside is not None and isinstance(branches, list):
        del result["format"]
        result["allOf"] = [*branches, {"pattern": ecma_regex(
            beside, "llguidance", "JSON_SCHEMA", where, json_string=True)}]


def ascii_schema_patterns(schema_text: str) -> str:
    """The JSON schema ``schema_text`` with every ``pattern`` and every ``patternProperties``
    key as llguidance must be given it (:func:`ecma_regex`); text that is not JSON is returned
    unchanged."""
    return _rewrite(schema_text, unlisted_absent=False, formats=False)


def llguidance_schema(schema_text: str) -> str:
    """The JSON schema ``schema_text`` as llguidance must be given it to mean what xgrammar
    reads: every pattern as :func:`ecma_regex` writes it for llguidance, and properties and
    items a schema does not list are absent.

    xgrammar (in the strict mode capgraph compiles with) reads an object schema that lists
    ``properties`` or ``patternProperties`` without ``additionalProperties`` /
    ``unevaluatedProperties`` as allowing no other property, and ``prefixItems`` (or draft-07's
    list-form ``items``) without ``items`` / ``additionalItems`` / ``unevaluatedItems`` as
    allowing no further item; llguidance reads JSON Schema's default (allowed). (A schema
    that ``required`` a property it does not list means the default, and keeps it.) So those
    defaults are written out as ``false`` for llguidance (a ``prefixItems`` only where the
    schema's ``$schema`` names no draft before 2020-12, which has no such keyword and leaves
    any array item allowed), on every schema that describes the
    instance itself or one of its parts: the root, property and item schemas, ``anyOf`` /
    ``oneOf`` branches and ``$defs`` / ``definitions`` entries. Conditions (``not``, ``if``,
    ``contains``, ``propertyNames``, ...) and ``allOf`` branches (which xgrammar merges with
    their parent before it reads them) are left as written. A bare ``{"type": "object"}`` or ``{"type": "array"}`` allows anything on
    both. A ``format`` llguidance reads wider than the format is given as its exact pattern
    (:func:`~capgraph.grammar.formats.exact_format`; beside a ``pattern``, in an ``allOf``
    branch of its own), and the schema ``true`` as ``{}`` (the same: any value; llguidance
    applies its options, capgraph's whitespace among them, to an object schema only). Text
    that is not JSON is returned unchanged."""
    if schema_text.strip() == "true":
        return "{}"
    return _rewrite(schema_text, unlisted_absent=True, formats=True)


# Where a subschema describes (part of) the instance itself, so the strict reading applies to
# it: keyword -> how it holds subschemas ("one", "list", "map").
_DESCRIBING = {"properties": "map", "patternProperties": "map", "additionalProperties": "one",
               "items": "one", "prefixItems": "list", "additionalItems": "one",
               "anyOf": "list", "oneOf": "list", "$defs": "map", "definitions": "map"}


def llguidance_described(root: Any) -> set[int]:
    """The ids of the schema objects in ``root`` that :func:`llguidance_schema` reads as
    describing the instance or one of its parts (the root, and what every keyword on the way
    there, each one of :data:`_DESCRIBING`, leads to: not an ``allOf`` branch, a ``not``, an
    ``if``, ...): where it writes out xgrammar's reading of unlisted properties and items.
    One linear walk, as :func:`llguidance_schema` makes it."""
    found: set[int] = set()
    stack: list[tuple[Any, bool]] = [(root, True)]
    while stack:
        node, describes = stack.pop()
        if isinstance(node, list):
            stack.extend((item, describes) for item in node)
            continue
        if not isinstance(node, dict):
            continue
        if describes:
            found.add(id(node))
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                continue
            inner = describes and key in _DESCRIBING
            if (key == "patternProperties" or key in _SCHEMA_MAPS) and isinstance(value, dict):
                stack.extend((v, inner) for v in value.values())
            else:
                stack.append((value, inner))
    return found


def llguidance_closes_properties(node: dict[str, Any], described: set[int]) -> bool:
    """Whether :func:`llguidance_schema` writes ``additionalProperties: false`` into the object
    schema ``node``: it describes the instance or a part of it (its id is in ``described``,
    from :func:`llguidance_described` of the whole schema), lists properties, says nothing of
    others, and requires none it does not list."""
    if id(node) not in described:
        return False
    written: dict[str, Any] = {}
    _strict_defaults(node, written)
    return written.get("additionalProperties") is False


def _strict_defaults(node: dict[str, Any], result: dict[str, Any],
                     prefix_items: bool = True) -> None:
    """Write out xgrammar's reading of unlisted properties and items into ``result``.
    ``prefix_items`` False: the schema's draft has no ``prefixItems`` keyword (one before
    2020-12), so a ``prefixItems`` lists no items and closes nothing."""
    required = node.get("required")
    requires_unlisted = isinstance(required, list) and any(
        not _listed(node, name) for name in required)
    if (("properties" in node or "patternProperties" in node) and not requires_unlisted
            and "additionalProperties" not in node and "unevaluatedProperties" not in node):
        result["additionalProperties"] = False
    if prefix_items and "prefixItems" in node:
        if "items" not in node and "unevaluatedItems" not in node:
            result["items"] = False
    elif isinstance(node.get("items"), list):  # draft-07's tuple form
        if "additionalItems" not in node and "unevaluatedItems" not in node:
            result["additionalItems"] = False


def _listed(node: dict[str, Any], name: Any) -> bool:
    """Whether the object schema ``node`` lists property ``name`` (by name or pattern; a
    pattern Python cannot read counts as not listing it)."""
    listed = node.get("properties")
    if isinstance(listed, dict) and name in listed:
        return True
    patterns = node.get("patternProperties")
    for pattern in patterns if isinstance(patterns, dict) and isinstance(name, str) else ():
        try:
            if re.search(pattern, name):
                return True
        except (re.error, TypeError):
            continue
    return False


def _rewrite(schema_text: str, unlisted_absent: bool, formats: bool) -> str:
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text
    prefix_items = not declares_draft_before_2020_12(schema)

    def walk(node: Any, describes: bool) -> Any:
        if isinstance(node, list):
            return [walk(item, describes) for item in node]
        if not isinstance(node, dict):
            return node
        result: dict[str, Any] = {}
        for key, value in node.items():
            inner = describes and key in _DESCRIBING
            if key in _DATA_KEYWORDS:
                result[key] = value
            elif key == "pattern" and isinstance(value, str):
                result[key] = ecma_regex(value, "llguidance", "JSON_SCHEMA",
                                         f"the pattern {value!r}", json_string=True)
            elif key == "patternProperties" and isinstance(value, dict):
                result[key] = rewritten_keys(
                    {k: walk(v, inner) for k, v in value.items()},
                    lambda k: ecma_regex(k, "llguidance", "JSON_SCHEMA",
                                         f"the patternProperties key {k!r}", json_string=True))
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                result[key] = {k: walk(v, inner) for k, v in value.items()}
            else:
                result[key] = walk(value, inner)
        if unlisted_absent and describes:
            _strict_defaults(node, result, prefix_items)
        if formats:
            _exact_llguidance_format(result, node)
        return result

    return json.dumps(walk(schema, True))


# What xgrammar 0.2.9 skips when it decides whether a schema is a bare {"type": "array"} /
# {"type": "object"} (its builtin any-array / any-object): its annotation keywords.
_XGRAMMAR_ANNOTATIONS = frozenset({"title", "default", "description", "examples", "deprecated",
                                   "readOnly", "writeOnly", "$comment", "$schema"})
# The keywords that list items / properties (or, for propertyNames, already let xgrammar admit
# any name it allows).
_LISTS_ITEMS = ("items", "prefixItems", "unevaluatedItems")
_LISTS_PROPERTIES = ("properties", "patternProperties", "additionalProperties",
                     "unevaluatedProperties", "propertyNames")
# Keywords whose schemas xgrammar reads together with their sibling keywords; such a schema is
# left as written (the keyword policy refuses them next to other assertions).
_COMBINED_WITH_SIBLINGS = ("$ref", "allOf", "anyOf", "oneOf")


def xgrammar_schema(schema_text: str, *, patterns: bool = True) -> str:
    """The JSON schema ``schema_text`` as xgrammar must be given it to mean what capgraph
    documents: an array or object schema that lists no items / properties allows any.

    xgrammar 0.2.9 (strict mode) reads ``{"type": "array", "maxItems": 5}`` as admitting only
    ``[]`` (``"minItems": 1`` then fails to compile) and ``{"type": "object",
    "maxProperties": 3}`` as admitting only ``{}``: every schema whose ``type`` is or lists
    ``"array"`` / ``"object"``, that has a keyword besides ``type`` and annotations, and lists
    none of ``items`` / ``prefixItems`` / ``unevaluatedItems`` (arrays) or ``properties`` /
    ``patternProperties`` / ``additionalProperties`` / ``unevaluatedProperties`` /
    ``propertyNames`` (objects). Such schemas get ``"items": true`` / ``"additionalProperties":
    true``, at every schema position (:func:`~capgraph.grammar.schema_policy.subschemas`); the
    keywords added are no-ops in JSON Schema, and no existing key moves, so JSON pointers stay
    the same. Left as written: a bare ``{"type": "array"}`` (xgrammar's any-array already), a
    schema without ``type`` (xgrammar reads ``{"maxItems": 5}`` as any value), ``enum`` /
    ``const`` schemas (their values win) and schemas next to ``$ref`` / ``allOf`` / ``anyOf`` /
    ``oneOf`` (read together with those). Text that is not a JSON object, and a schema with
    nothing to add, are returned unchanged. A ``format`` xgrammar reads wider than the format
    becomes its exact ``pattern`` (:func:`~capgraph.grammar.formats.exact_format`), and every
    ``pattern`` and ``patternProperties`` key is written as :func:`ecma_regex` writes it for
    xgrammar, unless ``patterns`` is false: the keyword policy judges that form, whose
    keywords are the user's and whose patterns still mean what they say (the rewritten ones
    match JSON text, escapes included, not the string a validator sees)."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text
    if not isinstance(schema, dict):
        return schema_text
    changed = False
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema, or malformed: xgrammar's own error says so
        stack.extend(sub for sub, _ in subschemas(node))
        changed |= _allow_unlisted(node)
        if patterns:
            changed |= exact_format(node, "xgrammar")
            changed |= _xgrammar_patterns(node)
    return json.dumps(schema) if changed else schema_text


def _xgrammar_patterns(node: dict[str, Any]) -> bool:
    """Write ``node``'s ``pattern`` and ``patternProperties`` keys as :func:`ecma_regex` writes
    them for xgrammar in a JSON string (ECMA's ``.``, surrogate pairs joined, the characters
    JSON escapes matched as their escapes; non-ECMA escapes refused); whether any changed."""
    changed = False
    pattern = node.get("pattern")
    if isinstance(pattern, str):
        new = ecma_regex(pattern, "xgrammar", "JSON_SCHEMA", f"the pattern {pattern!r}",
                         json_string=True)
        changed |= new != pattern
        node["pattern"] = new
    keyed = node.get("patternProperties")
    if isinstance(keyed, dict):
        new_keys = rewritten_keys(keyed, lambda k: ecma_regex(
            k, "xgrammar", "JSON_SCHEMA", f"the patternProperties key {k!r}", json_string=True))
        if list(new_keys) != list(keyed):
            node["patternProperties"] = new_keys
            changed = True
    return changed


def rewritten_keys(keyed: Mapping[str, Any], rewrite: Callable[[str], str]) -> dict[str, Any]:
    """The ``patternProperties`` map ``keyed`` with each key as ``rewrite`` writes it. Keys
    that differ as text but are written alike (``^a$`` and ``^\\x61$``) are one regex with
    both schemas: its value is ``{"allOf": [...]}`` of their values, in the order given (a
    dict would keep only the last, dropping the other's constraints)."""
    out: dict[str, Any] = {}
    merged: set[str] = set()
    for key, value in keyed.items():
        new = rewrite(key)
        if new not in out:
            out[new] = value
        elif new in merged:
            out[new]["allOf"].append(value)
        else:
            out[new] = {"allOf": [out[new], value]}
            merged.add(new)
    return out


def _allow_unlisted(node: dict[str, Any]) -> bool:
    """Write ``items: true`` / ``additionalProperties: true`` into ``node`` where xgrammar
    would read it as admitting no item / property (:func:`xgrammar_schema`); whether it did."""
    kind = node.get("type")
    types = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    if ("array" not in types and "object" not in types) or "enum" in node or "const" in node \
            or any(k in node for k in _COMBINED_WITH_SIBLINGS) \
            or all(k == "type" or k in _XGRAMMAR_ANNOTATIONS for k in node):
        return False
    changed = False
    if "array" in types and not any(k in node for k in _LISTS_ITEMS):
        node["items"] = True
        changed = True
    if "object" in types and not any(k in node for k in _LISTS_PROPERTIES):
        node["additionalProperties"] = True
        changed = True
    return changed
