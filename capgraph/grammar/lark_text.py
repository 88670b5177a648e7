"""What a Lark grammar (llguidance's dialect, which xgrammar's ``Grammar.from_lark`` shares for
these parts) embeds: ``%json`` schemas, ``%llguidance`` options and token references.

The text is read the way llguidance's Lark lexer reads it (``parser/src/lark/lexer.rs``): as
one sequence of its lexemes, each the longest match at its position (comments, blanks, string
and regex literals, names, punctuation, ``<...>`` token references with no ``<``, ``>`` or
Unicode whitespace inside, and the JSON value after ``%json`` / ``%regex`` / ``%llguidance``),
so text inside a literal or a comment is never taken for a token reference and no text is
skipped unread: where llguidance's lexer would fail, so does this reader
(:class:`LarkTextError`), and a grammar it reads is read alike.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Iterator

__all__ = ["LarkJson", "LarkLazyRule", "LarkRegex", "LarkTokenRef", "lark_json_values",
           "lark_lazy_rules", "lark_options", "lark_regexes", "lark_token_refs",
           "replace_json_values"]

# The Unicode White_Space characters: what ``\s`` means to llguidance's regexes (Python's
# ``\s`` also takes U+001C-U+001F, which would end a token reference llguidance reads on).
_WHITE = "\t\n\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000"

# llguidance's Lark lexemes (``lex_lark``: the skipped comments and blanks, the literal
# tokens and the regex tokens), by the first character they can start with. The lexer
# takes the longest match at each position (the first listed among equally long ones) and
# fails where none matches; so does :func:`_scan`.
_SKIP = r"(?:#|//)[^\n]*|[ \t]+"
_LITERALS = ("->", ":", ",", ".", "..", "%declare", "%llguidance", "%ignore", "%import",
             "%override", "%json", "%regex", "%lark", "%if", "(", ")", "{", "}", "[", "]", "~",
             "|", "&", "=", "#", "_", "::",
             # xgrammar's Lark directive, with a JSON value as %llguidance has (llguidance's
             # lexer fails on it, and so its compile: read so, nothing is hidden from either)
             "%grammar_options")
# The directives followed by a JSON value.
_JSON_DIRECTIVES = ("%json", "%llguidance", "%regex", "%grammar_options")
_REGEX_TOKENS = (
    ("op", r"[+*?]"),
    ("rule", r"!?[_?]?[a-z][_a-z0-9\-]*"),
    ("token", r"_?[A-Z][_A-Z0-9\-]*"),
    ("string", r'"(?:\\(?:["\\/bfnrt]|u[a-fA-F0-9]{4}|x[a-fA-F0-9]{2})'
               r'|[^"\\\x00-\x1f\x7f])*+"i?'),
    ("regex", r"/(?:\\.|[^/\\])++/[imslux]*"),
    ("number", r"[+-]?[0-9]+(?:\.[0-9]*)?(?:[eE][+-]?[0-9]+)?"),
    ("hex", r"0[xX][0-9a-fA-F]+"),
    ("newline", r"(?:\r?\n)+[ \t]*"),
    ("ref", f"<[^<>{_WHITE}]+>"),
    ("grammar_ref", r"@[a-zA-Z0-9_\-]+"),
)
# (``.`` without DOTALL, as in llguidance's regexes: an escape in a regex literal is a
# backslash and any character but a newline)
_LEXEMES = (("skip", re.compile(_SKIP)),
            *((lit, re.compile(re.escape(lit))) for lit in _LITERALS),
            *((kind, re.compile(pattern)) for kind, pattern in _REGEX_TOKENS))
_BY_NAME = dict(_LEXEMES)
_PERCENT = tuple(lit for lit in _LITERALS if lit.startswith("%"))
# The lexemes that can start with each character (a letter or digit stands for its class:
# ``a`` for a-z, ``A`` for A-Z, ``0`` for 0-9; a character absent starts none).
_STARTING = {"#": ("skip", "#"), "/": ("skip", "regex"), " ": ("skip",), "\t": ("skip",),
             "-": ("->", "number"), ":": (":", "::"), ".": (".", ".."), "%": _PERCENT,
             "_": ("_", "rule", "token"), "+": ("op", "number"), "*": ("op",),
             "?": ("op", "rule"), "!": ("rule",), "a": ("rule",), "A": ("token",),
             "\"": ("string",), "0": ("number", "hex"), "\r": ("newline",),
             "\n": ("newline",), "<": ("ref",), "@": ("grammar_ref",),
             **{c: (c,) for c in ",(){}[]~|&="}}
_CANDIDATES = {c: tuple((kind, _BY_NAME[kind]) for kind in kinds)
               for c, kinds in _STARTING.items()}


def _first_class(c: str) -> str:
    if "a" <= c <= "z":
        return "a"
    if "A" <= c <= "Z":
        return "A"
    if "0" <= c <= "9":
        return "0"
    return c


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


# How llguidance reads the ends of a token range: Rust's ``str::trim`` (Unicode White_Space)
# and ``u32::from_str`` (an optional ``+``, ASCII digits, at most 2**32 - 1).
_STRIPPED = "".join(chr(c) for c in range(0x3001) if re.fullmatch(f"[{_WHITE}]", chr(c)))
_U32 = re.compile(r"\+?[0-9]+", re.ASCII)
_U32_MAX = 2**32 - 1


class LarkTextError(ValueError):
    """The text cannot be read (a ``%json`` value that is not JSON, a malformed token range)."""


def _lexemes(text: str) -> Iterator[tuple[str, int, int, Any]]:
    """``(kind, start, end, value)`` for each lexeme of the Lark grammar ``text`` but comments
    and blanks, as llguidance's lexer reads it: one pass, each lexeme the longest match at its
    position (the first listed among equally long ones); ``kind`` is a literal token's text
    or one of ``rule``, ``token``, ``string``, ``regex``, ``op``, ``number``, ``hex``,
    ``newline``, ``ref``, ``grammar_ref``; ``value`` the lexeme's text. A ``%json``,
    ``%llguidance``, ``%regex`` or (xgrammar's) ``%grammar_options`` keyword is followed by a
    lexeme of kind ``json`` whose value is the JSON value after it (``text[start:end]`` its
    text).

    Raises:
        LarkTextError: a position where no lexeme starts (llguidance's lexer fails there
            too), or a directive's value that is not JSON.
    """
    text += "\n"  # (as llguidance reads it)
    pos, n = 0, len(text)
    while pos < n:
        best, kind = pos, ""
        for name, rx in _CANDIDATES.get(_first_class(text[pos]), ()):
            m = rx.match(text, pos)
            if m is not None and m.end() > best:
                best, kind = m.end(), name
        if not kind:
            raise LarkTextError(f"the grammar cannot be read at line {_line(text, pos)}, "
                                f"column {pos - text.rfind(chr(10), 0, pos)}: "
                                f"{text[pos:pos + 20]!r}")
        if kind != "skip":
            yield kind, pos, best, text[pos:best]
        if kind in _JSON_DIRECTIVES:
            start = _JSON_SPACE.match(text, best).end()  # type: ignore[union-attr]
            try:
                value, best = _DECODER.raw_decode(text, start)
            except (ValueError, RecursionError) as e:
                raise LarkTextError(f"the value after {kind} at line {_line(text, pos)} is "
                                    f"not JSON: {type(e).__name__}: {e}") from None
            yield "json", start, best, value
        pos = best


@functools.lru_cache(maxsize=4)
def _read(text: str) -> tuple[tuple[str, int, int, Any], ...]:
    """:func:`_lexemes` of ``text``, kept for the few texts read last: a compile asks for
    the references, the ``%json`` values, the options and the lazy rules of one grammar,
    and reads it once (an error is not kept: it is raised again)."""
    return tuple(_lexemes(text))


def _scan(text: str) -> Iterator[tuple[str, int, int, Any]]:
    """``(kind, start, end, value)`` for each ``%json`` value (kind ``json``), ``%llguidance``
    value (``options``), token reference (``ref``) and regex literal (``regex``, the literal's
    text) of :func:`_lexemes`.

    Raises:
        LarkTextError: as :func:`_lexemes`.
    """
    keyword = ""
    for kind, start, end, value in _read(text):
        if kind == "json":
            if keyword == "%json":
                yield "json", start, end, value
            elif keyword == "%llguidance":
                yield "options", start, end, value
        elif kind in ("ref", "regex"):
            yield kind, start, end, value
        keyword = kind


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
            ends = [e.strip(_STRIPPED) for e in part.split("-")]
            if len(ends) == 1 and not ends[0]:
                continue
            if len(ends) > 2 or not all(_U32.fullmatch(e) and int(e) <= _U32_MAX
                                        for e in ends):
                raise LarkTextError(f"the token reference {ref!r} at line {line} is malformed")
            ranges.append((int(ends[0]), int(ends[-1])))
        refs.append(LarkTokenRef(ref, line, tuple(ranges), negated))
    return refs


@dataclass(frozen=True, slots=True)
class LarkLazyRule:
    """A rule or terminal of a Lark grammar whose match llguidance makes lazy with nothing
    after it (a ``lazy`` attribute, no ``stop`` / ``suffix``): ``empty`` says whether its body may
    match the empty text, None where capgraph cannot tell (a ``%regex`` or ``%lark`` value, a
    grammar reference, a template, a regex Python's ``regex`` cannot read, an undefined
    name)."""

    name: str
    line: int
    empty: bool | None


def _definitions(lexemes: list[tuple[str, int, int, Any]]
                 ) -> dict[str, tuple[int, list[tuple[str, Any]], list[tuple[str, Any]]]]:
    """name -> (offset, attribute lexemes, body lexemes) of each definition ``name[...]: body``
    starting a line (a body goes on over lines that start with ``|``); the name without its
    ``!`` / ``?`` marks; a later definition of a name wins (llguidance refuses both)."""
    found: dict[str, tuple[int, list[tuple[str, Any]], list[tuple[str, Any]]]] = {}
    n, i = len(lexemes), 0
    while i < n:
        kind, start, _, value = lexemes[i]
        line_start = i == 0 or lexemes[i - 1][0] == "newline"
        i += 1
        if not (line_start and kind in ("rule", "token")):
            continue
        j, attrs = i, []
        if j < n and lexemes[j][0] == "[":
            while j < n and lexemes[j][0] not in ("]", "newline"):
                attrs.append((lexemes[j][0], lexemes[j][3]))
                j += 1
            j += 1
        if j + 1 < n and lexemes[j][0] == "." and lexemes[j + 1][0] == "number":
            j += 2  # (a priority)
        if j >= n or lexemes[j][0] != ":":
            continue
        j += 1
        body = []
        while j < n:
            k = lexemes[j][0]
            if k == "newline":
                if j + 1 < n and lexemes[j + 1][0] == "|":
                    j += 1
                    continue
                break
            body.append((k, lexemes[j][3]))
            j += 1
        found[value.lstrip("!?")] = (start, attrs[1:], body)
        i = j
    return found


def _lazy(attrs: list[tuple[str, Any]]) -> bool:
    """Whether the attributes ``attrs`` (the lexemes inside ``[...]``) make a lexeme lazy with
    nothing after it: ``lazy`` without a non-empty ``stop`` / ``suffix`` (the lexeme of one
    with a stop or suffix ends with it, so it is never empty)."""
    lazy = ending = False
    for k, (kind, value) in enumerate(attrs):
        lazy |= kind == "rule" and value == "lazy"
        ending |= (kind == "rule" and value in ("stop", "suffix") and k + 2 < len(attrs)
                   and attrs[k + 1][0] == "=" and attrs[k + 2] != ("string", '""'))
    return lazy and not ending


def _regex_may_be_empty(literal: str) -> bool | None:
    import regex as _regex
    close = literal.rindex("/")
    flags = 0
    for flag, value in (("i", _regex.IGNORECASE), ("m", _regex.MULTILINE),
                        ("s", _regex.DOTALL), ("x", _regex.VERBOSE)):
        if flag in literal[close + 1:]:
            flags |= value
    try:
        return _regex.fullmatch(literal[1:close].replace("\\/", "/"), "", flags) is not None
    except (_regex.error, RecursionError, OverflowError, ValueError):
        return None


def _all(values: list[bool | None]) -> bool | None:
    return False if False in values else None if None in values else True


def _any(values: list[bool | None]) -> bool | None:
    return True if True in values else None if None in values else False


class _Nullable:
    """Whether the body of each definition may match the empty text (see
    :class:`LarkLazyRule`), memoised; a name met again while its own body is being read
    counts as not empty there (the least fixpoint)."""

    def __init__(self, definitions: dict[str, tuple[int, list, list]]) -> None:
        self.definitions = definitions
        self.memo: dict[str, bool | None] = {}
        self.active: set[str] = set()

    def name(self, name: str) -> bool | None:
        if name in self.memo:
            return self.memo[name]
        if name in self.active:
            return False
        if name not in self.definitions:
            return None
        self.active.add(name)
        try:
            body = self.definitions[name][2]
            result, end = self.alternatives(body, 0, "")
            self.memo[name] = result if end == len(body) else None
        finally:
            self.active.discard(name)
        return self.memo[name]

    def alternatives(self, body: list[tuple[str, Any]], i: int, close: str
                     ) -> tuple[bool | None, int]:
        options: list[bool | None] = []
        items: list[bool | None] = []
        while i < len(body) and body[i][0] != close:
            kind = body[i][0]
            if kind == "|":
                options.append(_all(items))
                items, i = [], i + 1
            elif kind == "->":  # an alias: the name after it
                i += 2
            else:
                item, i = self.item(body, i)
                items.append(item)
        options.append(_all(items))
        return _any(options), i + 1 if close else i

    def item(self, body: list[tuple[str, Any]], i: int) -> tuple[bool | None, int]:
        kind, value = body[i]
        i += 1
        result: bool | None
        if kind == "(":
            result, i = self.alternatives(body, i, ")")
        elif kind == "[":
            _, i = self.alternatives(body, i, "]")
            result = True
        elif kind == "string":
            result = value in ('""', '""i')
        elif kind == "regex":
            result = _regex_may_be_empty(value)
        elif kind in ("rule", "token"):
            if i < len(body) and body[i][0] == "{":  # a template's arguments
                return None, _skip_braces(body, i)
            result = self.name(value.lstrip("!?"))
        elif kind in ("ref", "%json"):
            result = False
            i += kind == "%json"  # (its value)
        elif kind == "%lark":
            return None, _skip_braces(body, i)
        else:  # %regex's value, a grammar reference, anything unexpected
            result = None
            i += kind == "%regex"
        while i < len(body):  # postfix: ?, *, +, ~ n[..m], {n[,m]}
            kind, value = body[i]
            if kind == "op":
                result = True if value in "?*" else result
                i += 1
            elif kind == "~" and i + 1 < len(body) and body[i + 1][0] == "number":
                result = True if float(body[i + 1][1]) == 0 else result
                i += 2  # (then "..m"; "0..2" reads as the numbers "0." and ".", "2")
                while i + 1 < len(body) and body[i][0] in (".", "..") \
                        and body[i + 1][0] == "number":
                    i += 2
            elif kind == "{" and i + 1 < len(body) and body[i + 1][0] == "number":
                result = True if float(body[i + 1][1]) == 0 else result
                i = _skip_braces(body, i)
            else:
                break
        return result, i


def _skip_braces(body: list[tuple[str, Any]], i: int) -> int:
    """The index after the ``}`` closing the ``{`` at ``body[i]``."""
    depth = 0
    while i < len(body):
        depth += {"{": 1, "}": -1}.get(body[i][0], 0)
        i += 1
        if depth == 0:
            break
    return i


def lark_lazy_rules(text: str) -> list[LarkLazyRule]:
    """Every rule or terminal of the Lark grammar ``text`` that llguidance makes lazy with
    nothing after it, in order, with whether its body may match the empty text
    (:class:`LarkLazyRule`).

    Raises:
        LarkTextError: as :func:`lark_token_refs`.
    """
    definitions = _definitions(list(_read(text)))
    nullable = _Nullable(definitions)
    return [LarkLazyRule(name, _line(text, start), nullable.name(name))
            for name, (start, attrs, _) in definitions.items() if _lazy(attrs)]
