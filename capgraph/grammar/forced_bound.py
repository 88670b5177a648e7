"""A bound on the forced text of an xgrammar grammar, read from the grammar alone.

xgrammar's jump-forward search (``find_jump_forward_string``) walks the forced text to its
end, one byte and one parser step at a time: while every live parser state can go on with
one and the same byte (a character-class edge of two or more characters, two states that
disagree, or a state where the grammar may end all stop it), it takes that byte. It has no
length bound, so capgraph asks for forced text only on grammars where
:func:`forced_text_bound` shows the walk short, whatever the output so far.

**The bound.** A parser state is a stack of open rules: the innermost at some position of
one of its alternatives, each outer one just after the reference that opened the rule above
it. The forced text is a prefix of every completion of every live stack, so of one stack's
completions. Complete each level by its shortest completion: the rest of the innermost
alternative (at most ``head``: the longest "what is left of an atom from inside it plus
what must follow it to its rule's end" of the rule; inside a ``Regex`` that can be longer
than its shortest match), then the rest after each reference outward (its ``tail``). Two
completions of that stack part where a level's rest provably starts with two different
bytes: where a *choice* follows the reference (its rest, up to its first part that cannot
be empty, may start with at least two bytes: ``[ \\n\\t]* ","`` does, ``"]"`` does not). So
the forced text is at most ``head`` plus the tails of the references up to the first one a
choice follows; the bound is the longest such sum over the grammar's reference graph.

Where a cycle of references with no choice after them adds bytes
(``r ::= "[" r "]" | "x"``: one ``]`` per ``[`` written), the forced text grows with the
output's nesting and the bound is ``inf``: such grammars get no forced text. So does a
grammar with a rule that never completes (``root ::= "ab" root``, where the walk never
ends) or that this reader cannot read. xgrammar prints a string or a regex only up to a NUL
byte in it; :func:`grammar_hides_bytes` finds those grammars, whose printed text is not the
grammar the matcher runs.

A ``TagDispatch`` (structural tags' triggered tags and free text) is free text that may end
at any character and that dispatches to a rule when a trigger string completes: every
position of its free text is a choice (any character goes on, an excluded string removes
one byte of the choice at a time, so up to ``_MAX_EXCLUDES`` of them leave two), a rule it
dispatches to is read as a reference, and what follows that rule's end is a choice again
(``loop_after_dispatch``: back to free text) or the rest after the element. Its shortest
match is empty.

xgrammar's lookahead assertions (``(= ...)``) are read as matching nothing and restricting
nothing: its parser does not apply them (they serve its token-mask cache), so the walk's
states are those of the grammar without them. Character classes are of code points; a
string's ``\\xNN`` above 0x7F may be a raw byte or a code point, and is read as an unknown
first byte. Every length is an upper bound on some completion's length in bytes (an escape
counts as the characters it is printed with: never fewer than the bytes it stands for).
"""

from __future__ import annotations

import functools
import math
import re
from typing import Any, Callable, Iterator

from .graphs import strongly_connected

__all__ = ["forced_text_bound", "grammar_hides_bytes"]

_INF = math.inf
_NONE: frozenset[int] = frozenset()

_TOKEN = re.compile(r'''
    \s+
  | (?P<str>"(?:[^"\\]|\\.)*")
  | (?P<cls>\[(?:[^\]\\]|\\.)*\])
  | (?P<look>\(=)
  | (?P<call>(?:Regex|TagDispatch|[A-Za-z_]\w*)\()
  | (?P<rep>\{\s*(?P<lo>-?\d+)\s*(?:,\s*(?P<hi>-?\d+)\s*)?\})
  | (?P<name>[A-Za-z_][\w.\-]*)
  | (?P<op>[()|*+?,=])
''', re.VERBOSE)
_RULE = re.compile(r"^([A-Za-z_][\w.\-]*) ::= (.*)$")

# C-style escapes as xgrammar prints them (support/encoding.h), to their code points
_SIMPLE_ESCAPES = {"'": 0x27, '"': 0x22, "?": 0x3F, "\\": 0x5C, "a": 0x07, "b": 0x08,
                   "f": 0x0C, "n": 0x0A, "r": 0x0D, "t": 0x09, "v": 0x0B, "0": 0x00,
                   "e": 0x1B}
_HEX_ESCAPE = re.compile(r"\\(x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|U[0-9a-fA-F]{8})")
_MAX_CODEPOINT = 0x10FFFF

# Nodes: ("lit", bytes, first, inside) — a terminal with an upper bound on its shortest match
# in bytes, the bytes its matches may start with (those known: possibly fewer), and an upper
# bound on what is left of a match from any position inside it (a regex's or a multibyte
# character's); ("ref", name); ("rep", lo, hi, node) (hi -1: no upper bound); ("seq",
# [nodes]); ("alt", [nodes]); ("tagd", (rule names), loop_after_dispatch, first) — a
# TagDispatch, its first bytes two its free text may start with.
_EMPTY = ("lit", 0.0, _NONE, 0.0)

# xgrammar 0.2's expression codes in its serialized grammar (format "v18": the expressions'
# start offsets, and per expression [code, length, data...]): a byte string's data are its
# bytes, a regex's a flag then its pattern's bytes
_BYTE_STRING, _REGEX, _SERIALIZED = 0, 12, "v18"


#: The most excluded strings of a ``TagDispatch`` read: each removes at most one byte of
#: the choice at a position, and the fewest bytes a position of free text can go on with are
#: the 16 that may follow the UTF-8 lead byte 0xF4
_MAX_EXCLUDES = 14


class _Unreadable(ValueError):
    pass


def forced_text_bound(grammar_text: str) -> float:
    """The most bytes of forced text (xgrammar's jump-forward string) any state of a matcher
    of the grammar ``grammar_text`` (as ``str(xgrammar.Grammar)`` prints it) can have, in
    bytes: an upper bound, from the grammar alone (see the module's notes). ``inf`` where
    the forced text can grow with the output (recursion that forces text at every level it
    nests), a rule has no completion, or the text cannot be read."""
    rules = _read_rules(grammar_text)
    if rules is None:
        return _INF
    try:
        return _Bound(rules).value()
    except (_Unreadable, RecursionError):
        return _INF


def grammar_hides_bytes(grammar: Any) -> bool:
    """Whether the printed text of the ``xgrammar.Grammar`` ``grammar`` does not show all of
    it, so :func:`forced_text_bound` cannot read it: a byte string or a regex pattern holds a
    NUL byte, where xgrammar's printer ends the text (``"\\0ddd"`` prints as ``""``). Read
    from ``grammar.serialize_json()``: call it on a grammar before its compile (a compiled
    grammar's serialization holds its automata: megabytes); True for a serialization this
    reader does not know."""
    import json
    try:
        doc = json.loads(grammar.serialize_json())
        if doc.get("__VERSION__") != _SERIALIZED:
            return True
        data, starts = doc["grammar_expr_data"], doc["grammar_expr_indptr"]
        for start, end in zip(starts, [*starts[1:], len(data)]):
            code = data[start]
            if (code == _BYTE_STRING and 0 in data[start + 2:end]) \
                    or (code == _REGEX and 0 in data[start + 3:end]):
                return True
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        return True
    return False


# --- reading the printed grammar -----------------------------------------------------------

def _tokens(body: str) -> list[tuple[str, str, re.Match[str]]]:
    out = []
    pos = 0
    while pos < len(body):
        m = _TOKEN.match(body, pos)
        if m is None:
            raise _Unreadable(f"cannot read {body[pos:pos + 20]!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind is None:  # whitespace
            continue
        if kind in ("lo", "hi"):
            kind = "rep"
        out.append((kind, m.group(0), m))
    return out


def _codepoints(text: str) -> Iterator[tuple[int, bool]]:
    """The code points of a printed string or class body, each with whether it was a
    ``\\xNN`` escape (which may stand for a raw byte)."""
    i = 0
    while i < len(text):
        ch = text[i]
        if ch != "\\":
            yield ord(ch), False
            i += 1
            continue
        m = _HEX_ESCAPE.match(text, i)
        if m is not None:
            yield int(m.group(1)[1:], 16), m.group(1)[0] == "x"
            i = m.end()
            continue
        if i + 1 >= len(text):
            raise _Unreadable("a trailing backslash")
        nxt = text[i + 1]
        yield _SIMPLE_ESCAPES.get(nxt, ord(nxt)), False  # (\] \- \^ and the like: itself)
        i += 2


def _utf8_length(cp: int) -> int:
    return 1 if cp < 0x80 else 2 if cp < 0x800 else 3 if cp < 0x10000 else 4


def _lead_bytes(lo: int, hi: int) -> set[int]:
    """The first UTF-8 bytes of the code points ``lo..hi``."""
    out: set[int] = set()
    for start, end, shift, mark in ((0, 0x7F, 0, 0x00), (0x80, 0x7FF, 6, 0xC0),
                                    (0x800, 0xFFFF, 12, 0xE0), (0x10000, 0x10FFFF, 18, 0xF0)):
        a, b = max(lo, start), min(hi, end)
        if a <= b:
            out.update(range(mark | (a >> shift), (mark | (b >> shift)) + 1))
    return out


@functools.lru_cache(maxsize=4096)
def _string(printed: str) -> tuple:
    body = printed[1:-1]
    if not body:
        return _EMPTY
    cp, raw = next(_codepoints(body))
    first = _NONE if raw and cp > 0x7F else frozenset(_lead_bytes(cp, cp))
    return ("lit", float(len(body)), first, float(len(body)))


@functools.lru_cache(maxsize=4096)
def _class(printed: str) -> tuple:
    body = printed[1:-1]
    negated = body.startswith("^")
    source = body[1:] if negated else body
    points = [cp for cp, _ in _codepoints(source)]
    dash = _dash_positions(source)
    ranges: list[tuple[int, int]] = []
    k = 0
    while k < len(points):
        if k + 2 < len(points) and k + 1 in dash:
            ranges.append((points[k], points[k + 2]))
            k += 3
        else:
            ranges.append((points[k], points[k]))
            k += 1
    if negated:
        ranges = _complement(ranges)
    ranges = [(a, b) for a, b in ranges if a <= b]
    if not ranges:
        return ("lit", _INF, _NONE, _INF)  # (matches nothing)
    first: set[int] = set()
    for a, b in ranges:
        first |= _lead_bytes(a, b)
    return ("lit", float(_utf8_length(min(a for a, _ in ranges))), frozenset(first),
            float(_utf8_length(max(b for _, b in ranges))))


def _dash_positions(source: str) -> set[int]:
    """The indices, among a class body's code points, of the unescaped ``-`` between two
    (a range); a ``-`` first or last is itself."""
    items: list[bool] = []  # per code point: an unescaped "-"
    i = 0
    while i < len(source):
        if source[i] == "\\":
            m = _HEX_ESCAPE.match(source, i)
            i = m.end() if m is not None else i + 2
            items.append(False)
        else:
            items.append(source[i] == "-")
            i += 1
    return {k for k, is_dash in enumerate(items) if is_dash and 0 < k < len(items) - 1}


def _complement(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out = []
    at = 0
    for a, b in sorted(ranges):
        if a > at:
            out.append((at, a - 1))
        at = max(at, b + 1)
    if at <= _MAX_CODEPOINT:
        out.append((at, _MAX_CODEPOINT))
    return out


def _regex(pattern: str, json_string: bool) -> tuple:
    """A ``Regex(...)`` element: its shortest match and what is left of a match from inside
    it, in characters read with Python's parser, times the most bytes a character takes (4
    in UTF-8, 6 as a JSON string's ``\\uXXXX``); its first bytes unknown."""
    import re._parser as sre  # type: ignore[import-not-found]  # (Python's own reader)
    text = "".join(chr(cp) for cp, _ in _codepoints(pattern))
    try:
        parsed = sre.parse(text)
    except Exception as e:  # noqa: BLE001 - a syntax Python's reader lacks: unreadable
        raise _Unreadable(str(e)) from None
    shortest, inside = _regex_widths(parsed)
    scale = 6.0 if json_string else 4.0
    return ("lit", scale * shortest, _NONE, scale * inside)


def _regex_widths(items: Any) -> tuple[float, float]:
    """(the shortest match, the most left of a match from a position inside it) of a parsed
    regex sequence, in characters (``head`` and ``tail`` as for rules, over its parts)."""
    import re._constants as c  # type: ignore[import-not-found]
    parts = []
    for op, av in items:
        if op in (c.LITERAL, c.NOT_LITERAL, c.ANY, c.IN):
            parts.append((1.0, 1.0))
        elif op is c.AT:  # "^" and "$" match nothing; \A, \Z, \b may be letters to xgrammar
            parts.append((0.0, 0.0) if av in (c.AT_BEGINNING, c.AT_END) else (1.0, 1.0))
        elif op is c.BRANCH:
            branches = [_regex_widths(b) for b in av[1]]
            parts.append((min(b[0] for b in branches), max(b[1] for b in branches)))
        elif op is c.SUBPATTERN:
            parts.append(_regex_widths(av[-1]))
        elif op is getattr(c, "ATOMIC_GROUP", None):
            parts.append(_regex_widths(av))
        elif op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", c.MAX_REPEAT)):
            lo, _, inner = av
            shortest, inside = _regex_widths(inner)
            parts.append((lo * shortest if lo else 0.0,
                          inside + ((lo - 1) * shortest if lo > 1 else 0.0)))
        else:  # (a back reference or a lookaround: not a regular pattern xgrammar reads)
            raise _Unreadable(f"regex element {op}")
    inside, after = 0.0, 0.0
    for shortest, left in reversed(parts):
        inside = max(inside, left + after)
        after += shortest
    return after, inside


class _Reader:
    """Recursive descent over one printed rule body, to the nodes above."""

    def __init__(self, body: str) -> None:
        self.toks = _tokens(body)
        self.i = 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i][:2] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str, re.Match[str]]:
        if self.i >= len(self.toks):
            raise _Unreadable("unexpected end")
        tok = self.toks[self.i]
        self.i += 1
        return tok

    def expr(self) -> tuple:
        alts = [self.seq()]
        while self.peek() == ("op", "|"):
            self.i += 1
            alts.append(self.seq())
        return alts[0] if len(alts) == 1 else ("alt", alts)

    def seq(self) -> tuple:
        items = []
        while self.peek() is not None and self.peek() not in (("op", "|"), ("op", ")"),
                                                               ("op", ",")):
            items.append(self.postfix())
        return ("seq", items)

    def postfix(self) -> tuple:
        node = self.atom()
        while True:
            nxt = self.peek()
            if nxt is None or nxt[0] not in ("rep", "op") or nxt[1][:1] not in "*+?{":
                break
            _, text, m = self.take()
            if text == "*":
                node = ("rep", 0, -1, node)
            elif text == "+":
                node = ("rep", 1, -1, node)
            elif text == "?":
                node = ("rep", 0, 1, node)
            else:
                lo = max(0, int(m.group("lo")))
                hi = lo if m.group("hi") is None else int(m.group("hi"))
                node = ("rep", lo, hi if hi >= 0 else -1, node)
        return node

    def atom(self) -> tuple:
        kind, text, _ = self.take()
        if kind == "str":
            return _string(text)
        if kind == "cls":
            return _class(text)
        if kind == "name":
            return ("ref", text)
        if kind == "look":  # a lookahead: matches nothing, and the parser does not apply it
            self.expr()
            self.close()
            return _EMPTY
        if kind == "call":
            if text == "TagDispatch(":
                return self.tag_dispatch()
            if text != "Regex(":
                raise _Unreadable(f"unknown element {text}")
            kind, pattern, _ = self.take()
            if kind != "str":
                raise _Unreadable("Regex without a string")
            options = []
            while self.peek() is not None and self.peek() != ("op", ")"):
                options.append(self.take()[1])  # (options: json_string=true)
            self.close()
            return _regex(pattern[1:-1], "json_string" in options)
        if (kind, text) == ("op", "("):
            node = self.expr()
            self.close()
            return node
        raise _Unreadable(f"unexpected {text!r}")

    def close(self) -> None:
        if self.take()[:2] != ("op", ")"):
            raise _Unreadable("missing ')'")

    def tag_dispatch(self) -> tuple:
        """The arguments of a ``TagDispatch(`` as xgrammar prints them: ``("trigger", rule)``
        pairs, then ``loop_after_dispatch=true|false`` and ``excludes=("...", ...)``."""
        triggers, rules, excludes = [], [], []
        loop = None
        while True:
            kind, text, _ = self.take()
            if (kind, text) == ("op", ")"):
                break
            if (kind, text) == ("op", ","):
                continue
            if (kind, text) == ("op", "("):  # ("trigger", rule)
                kind, trigger, _ = self.take()
                comma = self.take()[:2]
                rule = self.take()
                if kind != "str" or comma != ("op", ",") or rule[0] != "name":
                    raise _Unreadable("a TagDispatch entry that is not (string, rule)")
                self.close()
                triggers.append(trigger[1:-1])
                rules.append(rule[1])
            elif kind == "name" and self.take()[:2] == ("op", "="):
                if text == "loop_after_dispatch":
                    value = self.take()[:2]
                    if value not in (("name", "true"), ("name", "false")):
                        raise _Unreadable(f"loop_after_dispatch={value[1]}")
                    loop = value[1] == "true"
                elif text == "excludes":
                    if self.take()[:2] != ("op", "("):
                        raise _Unreadable("excludes without '('")
                    while (tok := self.take())[:2] != ("op", ")"):
                        if tok[0] == "str":
                            excludes.append(tok[1][1:-1])
                        elif tok[:2] != ("op", ","):
                            raise _Unreadable("excludes holding other than strings")
                else:
                    raise _Unreadable(f"a TagDispatch argument {text}")
            else:
                raise _Unreadable(f"unexpected {text!r} in a TagDispatch")
        if loop is None or len(excludes) > _MAX_EXCLUDES:
            raise _Unreadable("a TagDispatch without loop_after_dispatch, or with more "
                              f"than {_MAX_EXCLUDES} excluded strings")
        # two bytes its free text may start with and end after: no trigger starts with them
        # and no excluded string is them
        taken = {t[:1] for t in triggers} | set(excludes)
        first = [c for c in "abcdefghijklmnopqrstuvwxyz" if c not in taken][:2]
        if len(first) < 2:
            raise _Unreadable("a TagDispatch whose triggers start with most letters")
        return ("tagd", tuple(rules), loop, frozenset(ord(c) for c in first))


def _read_rules(grammar_text: str) -> dict[str, tuple] | None:
    """The rules of ``grammar_text`` by name, as nodes; None where the text cannot be read
    or holds no rule."""
    rules: dict[str, tuple] = {}
    lines: list[str] = []
    for line in grammar_text.splitlines():  # (a TagDispatch is printed over several lines)
        if _RULE.match(line) is None and lines and line.strip():
            lines[-1] += " " + line.strip()
        else:
            lines.append(line)
    try:
        for line in lines:
            if not line.strip():
                continue
            m = _RULE.match(line)
            if m is None:
                raise _Unreadable(f"not a rule: {line[:40]!r}")
            reader = _Reader(m.group(2))
            node = reader.expr()
            while reader.peek() is not None:  # a rule's trailing lookahead "(=(...))"
                if reader.take()[:2] != ("look", "(="):
                    raise _Unreadable("trailing text")
                reader.expr()
                reader.close()
            rules[m.group(1)] = node
    except (_Unreadable, ValueError, RecursionError):
        return None
    return rules or None


# --- the bound -----------------------------------------------------------------------------

class _Bound:
    """The analysis of one grammar's rules (see :func:`forced_text_bound`)."""

    def __init__(self, rules: dict[str, tuple]) -> None:
        self.rules = rules
        refs: dict[str, list[str]] = {name: [] for name in rules}
        for name, node in rules.items():
            for other in _refs(node):
                if other not in rules:
                    raise _Unreadable(f"an undefined rule {other}")
                refs[name].append(other)
        self.order = strongly_connected(refs)  # (each component after those it refers to)
        self.lengths: dict[str, float] = {name: _INF for name in rules}
        self.firsts: dict[str, frozenset[int]] = {name: _NONE for name in rules}
        # per node (by id: the rules hold every node while this lives) its length and first
        # bytes, kept once every rule's are settled (before, they still change)
        self._settled = False
        self._known: dict[tuple[str, int], Any] = {}

    def value(self) -> float:
        for members in self.order:  # shortest completions, then first bytes: fixpoints
            self._settle(members)
        if any(v == _INF for v in self.lengths.values()):
            return _INF
        self._settled = True
        head = {name: 0.0 for name in self.rules}
        edges: dict[str, list[tuple[str, float, frozenset[int], bool]]] = {
            name: [] for name in self.rules}  # callee -> (caller, tail, next bytes, to end)
        for name, node in self.rules.items():
            self._walk(name, node, 0.0, None, head, edges)
        # A state: a rule just completed, and the bytes already known to follow at this
        # offset (from outer rests that can be empty here). Its successors: each caller,
        # unless two bytes are known to follow (a choice: the forced text ends here).
        graph: dict[tuple[str, frozenset[int]], list[tuple[tuple[str, frozenset[int]], float]]]
        graph = {}
        todo = [(name, _NONE) for name in self.rules]
        while todo:
            state = todo.pop()
            if state in graph:
                continue
            name, known = state
            nexts = graph[state] = []
            for caller, tail, follow, to_end in edges[name]:
                both = known | follow
                if len(both) >= 2:
                    continue
                nxt = (caller, both) if to_end else (caller, _NONE)
                nexts.append((nxt, tail))
                todo.append(nxt)
        above: dict[tuple[str, frozenset[int]], float] = {}  # the longest sum of tails out
        for states in strongly_connected({s: [n for n, _ in graph[s]] for s in graph}):
            group = set(states)
            best = 0.0
            for state in states:
                for nxt, tail in graph[state]:
                    if nxt in group:
                        if tail > 0:
                            best = _INF  # (a cycle that adds bytes at every level)
                    else:
                        best = max(best, tail + above[nxt])
            for state in states:
                above[state] = best
        return max(head[name] + above[(name, _NONE)] for name in self.rules)

    def _settle(self, members: list[str]) -> None:
        for table, step in ((self.lengths, self._length), (self.firsts, self._first)):
            for _ in range(256 * len(members) + 2):  # (each round moves a value, or ends)
                changed = False
                for name in members:
                    new = step(self.rules[name])
                    if new != table[name]:
                        table[name], changed = new, True  # type: ignore[assignment]
                if not changed:
                    break

    def _length(self, node: tuple) -> float:
        """An upper bound on the shortest match of ``node``, in bytes."""
        length: float = self._kept("length", self._length_of, node)
        return length

    def _kept(self, what: str, compute: Callable[[tuple], Any], node: tuple) -> Any:
        """``compute(node)``, kept per node once the rules are settled."""
        if not self._settled:
            return compute(node)
        key = (what, id(node))
        value = self._known.get(key)
        if value is None:
            value = self._known[key] = compute(node)
        return value

    def _length_of(self, node: tuple) -> float:
        kind = node[0]
        if kind == "lit":
            return node[1]
        if kind == "ref":
            return self.lengths[node[1]]
        if kind == "rep":
            return 0.0 if node[1] == 0 else node[1] * self._length(node[3])
        if kind == "tagd":  # (its free text may end at once)
            return 0.0
        if kind == "alt":
            return min(self._length(a) for a in node[1])
        return sum((self._length(n) for n in node[1]), 0.0)

    def _first(self, node: tuple) -> frozenset[int]:
        """Bytes some match of ``node`` starts with (every rule has a completion, so each
        can be followed to one)."""
        first: frozenset[int] = self._kept("first", self._first_of, node)
        return first

    def _first_of(self, node: tuple) -> frozenset[int]:
        kind = node[0]
        if kind == "lit":
            return node[2]
        if kind == "ref":
            return self.firsts[node[1]]
        if kind == "rep":
            return _NONE if node[2] == 0 else self._first(node[3])
        if kind == "tagd":
            return node[3]
        if kind == "alt":
            return frozenset().union(*(self._first(a) for a in node[1]))
        out: set[int] = set()
        for item in node[1]:
            out |= self._first(item)
            if self._length(item) > 0:
                break
        return frozenset(out)

    def _walk(self, name: str, node: tuple, tail: float, rest: Any, head: dict[str, float],
              edges: dict[str, list[tuple[str, float, frozenset[int], bool]]]) -> None:
        """Visit ``node`` of rule ``name``: ``tail`` bounds the shortest completion of what
        follows it to the rule's end, ``rest`` is that continuation as a chain
        (``("seq", items, index, rest)``, ``("rep", node, rest)``, None: the rule's end)."""
        kind = node[0]
        if kind in ("lit", "ref"):
            inside = node[3] if kind == "lit" else self._length(node)
            head[name] = max(head[name], inside + tail)
            if kind == "ref":
                follow, to_end = self._next_bytes(rest)
                if len(follow) < 2:
                    edges[node[1]].append((name, tail, frozenset(follow), to_end))
        elif kind == "alt":
            for child in node[1]:
                self._walk(name, child, tail, rest, head, edges)
        elif kind == "tagd":
            # its free text is a choice at every position (no forced byte: no head); a rule
            # it dispatches to returns to free text (a choice: no edge) or, without the
            # loop, ends the element: a reference here
            if not node[2]:
                follow, to_end = self._next_bytes(rest)
                if len(follow) < 2:
                    for rule in node[1]:
                        edges[rule].append((name, tail, frozenset(follow), to_end))
        elif kind == "rep":  # (inside one pass: at most lo - 1 more must follow)
            inner = node[3]
            more = (node[1] - 1) * self._length(inner) if node[1] > 1 else 0.0
            self._walk(name, inner, tail + more, ("rep", node, rest), head, edges)
        else:
            items = node[1]
            after = tail
            for k in range(len(items) - 1, -1, -1):
                self._walk(name, items[k], after, ("seq", items, k + 1, rest), head, edges)
                after += self._length(items[k])

    def _next_bytes(self, rest: Any) -> tuple[set[int], bool]:
        """Bytes the continuation ``rest`` may start with, collected up to its first part
        that cannot be empty (or two of them), each one some completion starts with; and
        whether all of it can be empty (the rule may end here)."""
        found: set[int] = set()
        while rest is not None:
            if rest[0] == "seq":
                _, items, k, rest = rest
                for item in items[k:]:
                    found |= self._first(item)
                    if len(found) >= 2 or self._length(item) > 0:
                        return found, False
            else:  # the end of one pass of a repetition: another, or what follows it
                _, node, rest = rest
                if node[2] < 0:  # (no upper bound: another pass is always allowed)
                    found |= self._first(node[3])
                if len(found) >= 2 or node[1] > 1:  # (what follows: only from lo passes)
                    return found, False
        return found, True


def _refs(node: tuple) -> Iterator[str]:
    kind = node[0]
    if kind == "ref":
        yield node[1]
    elif kind in ("seq", "alt"):
        for child in node[1]:
            yield from _refs(child)
    elif kind == "tagd":
        yield from node[1]
    elif kind == "rep":
        yield from _refs(node[3])



def _main() -> None:
    """``python -m capgraph.grammar.forced_bound``: the bound of xgrammar's JSON grammar and
    of the bundled corpus's schemas (as capgraph compiles them), with the time to read each."""
    import json
    import time
    from importlib import resources

    import xgrammar as xgr
    corpus = resources.files("capgraph.data").joinpath("jsonschemabench.jsonl")
    schemas = [json.loads(line)["schema"] for line in corpus.read_text().splitlines() if line]
    print(f"JSON grammar: {forced_text_bound(str(xgr.Grammar.builtin_json_grammar())):.0f} "
          "bytes")
    bounds, slowest, failed = [], 0.0, 0
    for schema in schemas:
        try:
            text = str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=True))
        except Exception:  # noqa: BLE001 - a schema xgrammar does not take
            failed += 1
            continue
        start = time.perf_counter()
        bounds.append(forced_text_bound(text))
        slowest = max(slowest, time.perf_counter() - start)
    finite = sorted(b for b in bounds if b != _INF)
    print(f"bundled corpus: {len(bounds)} schemas read ({failed} not compiled), "
          f"{len(bounds) - len(finite)} unbounded, largest bound "
          f"{finite[-1] if finite else 0:.0f} bytes, slowest read {slowest * 1e3:.0f} ms")


if __name__ == "__main__":
    _main()
