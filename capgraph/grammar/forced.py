"""Forced text as tokens: what a grammar allows as the only continuation, in the tokenizer's
own encoding, ready to be drafted.

A matcher says which bytes every continuation of its state starts with
(:meth:`~capgraph.grammar.GrammarMatcher.forced_bytes`). Those bytes are encoded here with the
tokenizer itself rather than taken as the backend's token choice (xgrammar's jump-forward
tokens pick the longest token greedily): a trained model emits the tokenizer's encoding, so
that encoding is the one verification most often accepts. A forced token is only ever a
draft: one the model or the mask refuses is rejected by verification, and the output stays
what greedy decoding without drafts gives.
"""

from __future__ import annotations

import re
from typing import Any

from ..errors import ConfigError
from .base import GrammarMatcher

__all__ = ["ForcedTokenEncoder", "forced_bounds", "forced_run_bound", "forced_stack_bound",
           "MAX_FORCED_SEQUENCE_BYTES", "MAX_FORCED_STACK_BYTES", "MAX_FORCED_WALK_MS"]


class ForcedTokenEncoder:
    """Encodes a matcher's forced text with a Hugging Face tokenizer.

    Args:
        tokenizer: the tokenizer the model was trained with (its ``encode`` is called with
            ``add_special_tokens=False``; a dummy-prefix space is kept off, as
            :func:`capgraph.tokenizers.encode_continuation` does).
        max_bytes_per_token: bytes of forced text asked for per wanted token (the text is
            cut to this before it is encoded, so a long forced run costs no more to encode;
            the backend's search for it is bounded per grammar, see below).
        keep_last: keep the last token of an encoding that reaches the end of the forced
            text. The text after it is free, and the tokenizer may merge that token with
            what the model writes next, so dropping it trades a draft for a likelier
            acceptance; ``bench spec`` measures both.
    """

    def __init__(self, tokenizer: Any, max_bytes_per_token: int = 16,
                 keep_last: bool = True) -> None:
        if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
            raise ConfigError("forced tokens need a tokenizer with an encode() method, got "
                              f"{type(tokenizer).__name__}")
        if max_bytes_per_token < 1:
            raise ConfigError(f"max_bytes_per_token={max_bytes_per_token} must be >= 1")
        self.tokenizer = tokenizer
        self.max_bytes_per_token = max_bytes_per_token
        self.keep_last = keep_last
        # a sentencepiece-style tokenizer prepends a dummy-prefix space to what it encodes:
        # encode "\n" + text and drop the newline's ids, as capgraph.tokenizers'
        # encode_continuation does (probed once here, not per call)
        probe = list(tokenizer.encode("\n", add_special_tokens=False))
        convert = getattr(tokenizer, "convert_ids_to_tokens", None)
        dummy = bool(probe) and convert is not None and \
            str(convert(probe[0])).startswith("\u2581")
        self._probe: list[int] | None = probe if dummy else None
        self._decode = getattr(tokenizer, "decode", None)
        self._probe_text = self._decoded(probe) if dummy else ""

    def _encode_text(self, text: str) -> list[int]:
        # forced text that spells a special token ("[INST]", "</s>") is encoded as text
        from ..tokenizers import encode_text
        if self._probe is None:
            return encode_text(self.tokenizer, text)
        ids = encode_text(self.tokenizer, "\n" + text)
        n = len(self._probe)
        return ids[n:] if ids[:n] == self._probe else []  # (no clean split: no drafts)

    def _decoded(self, ids: list[int]) -> str:
        """The text of ``ids`` as a user's ``decode`` gives it (no clean-up of spaces)."""
        assert self._decode is not None
        try:
            return str(self._decode(ids, clean_up_tokenization_spaces=False))
        except TypeError:
            return str(self._decode(ids))

    def _spelled_prefix(self, ids: list[int], text: str) -> list[int]:
        """The longest prefix of ``ids`` whose text is a prefix of ``text``. A tokenizer's
        encoding does not always spell its input: a normalizer rewrites it (Qwen's NFC turns
        ``"e\\u0301"`` into ``"é"``; sentencepiece reads a literal ``"▁"`` as a space), and
        such tokens are not the forced text, so they are never drafted. The continuation's
        text is read after the newline the dummy-prefix trick encodes, so a first token's
        leading space is kept as the grammar sees it."""
        if self._decode is None or not ids:
            return ids
        for k in range(len(ids), 0, -1):
            if self._probe is None:
                spelled = self._decoded(ids[:k])
            else:
                spelled = self._decoded(self._probe + ids[:k])
                if not spelled.startswith(self._probe_text):
                    return []
                spelled = spelled[len(self._probe_text):]
            if text.startswith(spelled):
                return ids[:k]
        return []

    def encode(self, forced: bytes, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` token ids of the tokenizer's encoding of ``forced``
        (whole UTF-8 characters), asked for with ``max_tokens * max_bytes_per_token`` bytes;
        cut before the first token that does not spell the forced text (:meth:`_spelled_prefix`)."""
        if max_tokens <= 0 or not forced:
            return []
        text = forced.decode("utf-8", "replace")
        ids = self._encode_text(text)
        reached_end = len(forced) < max_tokens * self.max_bytes_per_token
        if len(ids) <= max_tokens and reached_end and not self.keep_last:
            ids = ids[:-1]
        elif len(ids) > max_tokens or not reached_end:
            # the bound cut the text: its last token may be cut short, never draft it
            ids = ids[:min(max_tokens, len(ids) - 1)]
        return self._spelled_prefix(ids, text)

    def __call__(self, matcher: GrammarMatcher, max_tokens: int) -> list[int]:
        """The forced tokens of ``matcher`` at its current state (unchanged), at most
        ``max_tokens``; empty where nothing is forced."""
        if max_tokens <= 0:
            return []
        forced = matcher.forced_bytes(max_tokens * self.max_bytes_per_token)
        return self.encode(forced, max_tokens) if forced else []


# --- a bound on the forced text of an xgrammar grammar ------------------------------------
#
# xgrammar's jump-forward search (``find_jump_forward_string``) has no length bound: it walks
# the forced text to its end, one character and one parser state at a time, and only then
# returns. The forced text from a state is never longer than the shortest completion from it
# (the walk stops where the grammar may end), so where every rule has a completion the walk
# ends; where one has none (``root ::= "ab" root``) it runs until memory is exhausted, and
# where completions are exponentially long (``r1 ::= r0 r0``, ``r2 ::= r1 r1``, ...) it takes
# exponential time. :func:`forced_run_bound` reads the grammar once, as xgrammar prints it, and
# gives the length of the longest shortest completion of any of its sequences: the matcher
# asks xgrammar for forced text only where that is at most :data:`MAX_FORCED_SEQUENCE_BYTES`.
# That bounds the text one open rule forces; recursion nests open rules as deep as the output
# goes, so :func:`forced_stack_bound` bounds what each level of it adds (at most
# :data:`MAX_FORCED_STACK_BYTES`), and a walk that still runs long (:data:`MAX_FORCED_WALK_MS`)
# ends forced text for its grammar.

#: Grammars with a sequence (one alternative of a rule) whose shortest completion is longer
#: than this get no forced text (the xgrammar walk would cost ~0.6 us per byte of it).
MAX_FORCED_SEQUENCE_BYTES = 4096

#: Grammars where one level of recursion may add more than this to the forced text
#: (:func:`forced_stack_bound`; JSON's is 1, every schema of the bundled corpus's at most 16)
#: get no forced text: the walk would grow by that much per level the output nests.
MAX_FORCED_STACK_BYTES = 16

#: A jump-forward walk longer than this (ms) ends forced text for every matcher of its
#: grammar: within :data:`MAX_FORCED_STACK_BYTES` a level, the walk still grows with the
#: nesting of the output (``r ::= "[" r "]" | "x"`` forces one ``]`` per ``[``).
MAX_FORCED_WALK_MS = 10.0

_INF = float("inf")
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


class _Unreadable(ValueError):
    pass


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


_ESCAPES = {"\\": "\\", '"': '"', "?": "?", "n": "\n", "t": "\t", "r": "\r"}


def _unescape(text: str) -> str:
    """A string argument as xgrammar prints it (C-style escapes, ``\\?`` for ``?``)."""
    return re.sub(r"\\(.)", lambda m: _ESCAPES.get(m.group(1), "\\" + m.group(1)), text)


def _regex_min(pattern: str) -> float:
    import re._parser as sre  # type: ignore[import-not-found]  # (Python's own reader)
    try:
        return float(sre.parse(pattern).getwidth()[0])
    except Exception as e:  # noqa: BLE001 - a syntax Python's reader lacks: unknown
        raise _Unreadable(str(e)) from None


class _Reader:
    """Recursive descent over one rule body; builds ('seq', [...]) / ('alt', [...]) /
    ('lit', n) / ('ref', name) / ('rep', lo, node) nodes."""

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
            kind, text, m = self.take()
            if text == "*" or text == "?":
                node = ("lit", 0.0)
            elif text == "+":
                node = ("rep", 1, node)
            else:
                node = ("rep", max(0, int(m.group("lo"))), node)
        return node

    def atom(self) -> tuple:
        kind, text, _ = self.take()
        if kind == "str":
            body = text[1:-1]
            # escapes count as written: never fewer bytes than they stand for
            return ("lit", float(len(body.encode("utf-8"))))
        if kind == "cls":
            return ("lit", 1.0)
        if kind == "name":
            return ("ref", text)
        if kind == "look":  # a lookahead: matches nothing itself
            self.expr()
            self.close()
            return ("lit", 0.0)
        if kind == "call":
            if text != "Regex(":
                raise _Unreadable(f"unknown element {text}")
            kind, pattern, _ = self.take()
            if kind != "str":
                raise _Unreadable("Regex without a string")
            while self.peek() is not None and self.peek() != ("op", ")"):
                self.take()  # (options: json_string=true)
            self.close()
            return ("lit", _regex_min(_unescape(pattern[1:-1])))
        if (kind, text) == ("op", "("):
            node = self.expr()
            self.close()
            return node
        raise _Unreadable(f"unexpected {text!r}")

    def close(self) -> None:
        if self.take()[:2] != ("op", ")"):
            raise _Unreadable("missing ')'")


def _read_rules(grammar_text: str) -> dict[str, tuple] | None:
    """The rules of ``grammar_text`` (as ``str(xgrammar.Grammar)`` prints it) by name, as
    :class:`_Reader` nodes; None where the text cannot be read or holds no rule."""
    rules: dict[str, tuple] = {}
    try:
        for line in grammar_text.splitlines():
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


def _shortest(rules: dict[str, tuple]) -> dict[str, float] | None:
    """Each rule's shortest completion in bytes (``inf``: none); None on a recursion too deep
    to read."""
    lengths = {name: _INF for name in rules}
    try:
        for _ in range(len(rules) + 1):  # shortest lengths: a fixpoint from above
            changed = False
            for name, node in rules.items():
                new = _length(node, lengths)
                if new < lengths[name]:
                    lengths[name], changed = new, True
            if not changed:
                break
    except RecursionError:
        return None
    return lengths


def _length(node: tuple, lengths: dict[str, float], seqs: list[tuple] | None = None) -> float:
    """The shortest text ``node`` matches, in bytes, given the rules' ``lengths``; each
    sequence met is appended to ``seqs``."""
    kind = node[0]
    if kind == "lit":
        return node[1]
    if kind == "ref":
        return lengths.get(node[1], _INF)
    if kind == "rep":
        inner = _length(node[2], lengths, seqs)
        return 0.0 if node[1] == 0 else node[1] * inner
    if kind == "alt":
        return min(_length(a, lengths, seqs) for a in node[1])
    total = sum((_length(n, lengths, seqs) for n in node[1]), 0.0)
    if seqs is not None:
        seqs.append(node)
    return total


def forced_bounds(grammar_text: str) -> tuple[float, float]:
    """``(forced_run_bound, forced_stack_bound)`` of the grammar ``grammar_text``, read once
    (see those two)."""
    rules = _read_rules(grammar_text)
    lengths = _shortest(rules) if rules is not None else None
    if rules is None or lengths is None or any(v == _INF for v in lengths.values()):
        return _INF, _INF
    try:
        return _run_bound(rules, lengths), _stack_bound(rules, lengths)
    except RecursionError:
        return _INF, _INF


def forced_run_bound(grammar_text: str) -> float:
    """The longest shortest completion of any sequence of the grammar ``grammar_text`` (as
    ``str(xgrammar.Grammar)`` prints it), in bytes; ``inf`` where a rule has no completion or
    the text cannot be read. The forced text from any state of a matcher is at most this
    times the nesting depth of the state (each open rule contributes at most its sequence's
    shortest completion); :func:`forced_stack_bound` bounds what recursion adds to that."""
    return forced_bounds(grammar_text)[0]


def forced_stack_bound(grammar_text: str) -> float:
    """The most bytes one open level of a recursive rule may add to the forced text, in the
    grammar ``grammar_text``: over every reference to a rule from which the referring rule can
    be reached again, the shortest completion of what follows the reference to the end of the
    referring rule. 0 where no rule recurses, or only at its end (``r ::= "a" r | "b"``);
    ``inf`` where the text cannot be read or a rule has no completion.

    A state nested ``d`` levels deep in such recursion may force up to ``d`` times this:
    ``root ::= "=" root "bbbb" | "c"`` forces ``"bbbb"`` once per ``=`` written before the
    ``c``, and xgrammar's jump-forward walk builds all of it (``d`` grows with the output).
    Choices are not looked at (an alternative or an optional part may still be forced where
    its branches agree), so this is an upper bound: JSON's ``{ ... }`` gives 1 (the ``}``
    after a nested value)."""
    return forced_bounds(grammar_text)[1]


def _run_bound(rules: dict[str, tuple], lengths: dict[str, float]) -> float:
    seqs: list[tuple] = []
    for node in rules.values():
        _length(node, lengths, seqs)
    return max((_length(s, lengths) for s in seqs), default=0.0)


def _stack_bound(rules: dict[str, tuple], lengths: dict[str, float]) -> float:
    refs: dict[str, list[str]] = {name: [] for name in rules}  # what each body refers to

    def collect(name: str, node: tuple) -> None:
        kind = node[0]
        if kind == "ref":
            if node[1] in rules:
                refs[name].append(node[1])
        elif kind in ("seq", "alt"):
            for child in node[1]:
                collect(name, child)
        elif kind == "rep":
            collect(name, node[2])

    for name, node in rules.items():
        collect(name, node)
    component = _components(refs)  # (a reference recurses where it stays in its component)
    worst = 0.0

    def tails(name: str, node: tuple, tail: float) -> None:
        nonlocal worst
        kind = node[0]
        if kind == "ref":
            if node[1] in rules and component[node[1]] == component[name]:
                worst = max(worst, tail)
        elif kind == "alt":
            for child in node[1]:
                tails(name, child, tail)
        elif kind == "rep":  # (later repetitions may follow: at least lo - 1 of them)
            tails(name, node[2], tail + max(node[1] - 1, 0) * _length(node[2], lengths))
        elif kind == "seq":
            after = tail
            for child in reversed(node[1]):
                tails(name, child, after)
                after += _length(child, lengths)

    for name, node in rules.items():
        tails(name, node, 0.0)
    return worst


def _components(refs: dict[str, list[str]]) -> dict[str, int]:
    """The strongly connected component of each rule of the reference graph ``refs``
    (Tarjan's algorithm, iterative: a grammar may hold thousands of rules)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    component: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    for root in refs:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            name, k = work.pop()
            if k == 0:
                index[name] = low[name] = len(index)
                stack.append(name)
                on_stack.add(name)
            edges = refs[name]
            while k < len(edges) and edges[k] in index:
                other = edges[k]
                if other in on_stack:
                    low[name] = min(low[name], index[other])
                k += 1
            if k < len(edges):  # (descend into an unvisited rule; come back after it)
                work.append((name, k + 1))
                work.append((edges[k], 0))
                continue
            if low[name] == index[name]:
                while True:
                    other = stack.pop()
                    on_stack.discard(other)
                    component[other] = index[name]
                    if other == name:
                        break
            if work:  # (the caller takes the lowest link of the rule it descended into)
                parent = work[-1][0]
                low[parent] = min(low[parent], low[name])
    return component
