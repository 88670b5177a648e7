"""Other engines' structured-output test cases run through capgraph: no string their tests (or
an independent oracle) mark invalid may get through a guide capgraph compiles, and no guide or
string may crash capgraph.

The cases are read at run time from local checkouts of the engines' repositories (nothing of
them is copied here), plus a small bundled file of guides from vLLM's and SGLang's tests with
strings written for them (``tests/data/engine_cases/serving_engines.json``, each with its source):

* ``--outlines-core PATH``: dottxt-ai/outlines-core, ``src/json_schema/mod.rs``: every tuple
  ``(schema, regex, [strings that match], [strings that do not])`` of its tests;
* ``--xgrammar PATH``: mlc-ai/xgrammar, the ``tests/python`` files named in
  :data:`XGRAMMAR_FILES`: ``pytest.mark.parametrize`` tables (``pytest.param`` rows too) and
  ``assert`` / ``_assert_language`` / ``check_stag_with_instance`` calls whose schema, regex,
  EBNF or Lark grammar, structural-tag format and strings are literals (read with :mod:`ast`,
  never imported);
* ``--llguidance PATH``: guidance-ai/llguidance, ``parser/tests/test_json_*.rs``: in each test
  function, every ``json!`` schema it checks against every ``json!`` value or string case it
  holds; ``parser/tests/test_lark.rs``: its ``lark_str_test_many`` (a Lark grammar, strings
  accepted, strings refused) and ``json_test_many`` calls.

What makes a string valid is decided by an oracle where one exists, not by the engine's own
expectation (an engine's regex for a schema may be stricter or looser than the schema): for a
JSON schema, the string must parse as JSON and validate with ``jsonschema`` (the schema's
``$schema`` or draft 2020-12, format assertion on); for ``GuideType.JSON``, parse as a JSON object
or array; for a regex, ``re.fullmatch``; for an EBNF grammar with an ``oracle`` regex (the
serving engines' tests check their outputs with one), that regex; for a Lark grammar, the
``lark`` package's Earley parser over every length each terminal matches whole, its regexes'
``\\d`` / ``\\w`` / ``\\s`` read as Rust's (llguidance's) ``regex`` reads them (``start:
%json SCHEMA``: the schema's verdict). Where there is no oracle (an EBNF grammar, a regex Python
cannot compile, a Lark grammar with llguidance's or xgrammar's extensions) the engine's
expectation is the verdict. A string
whose oracle verdict differs from the engine's expectation is counted as "disputed" and listed
with ``-v``. A JSON-schema string that fails only a ``format`` assertion and is accepted is
counted under "format gaps", not as invalid: JSON Schema leaves format assertion optional, and
docs/CONFORMANCE.md lists what the grammars' formats do not check.

For every case and every backend (``xgrammar``, ``llguidance``, ``fallback``: xgrammar with
``json_unenforced_keywords="fallback"``) the guide is compiled with the Tekken tokenizer (a Lark
grammar as an ``ebnf_grammar`` guide on llguidance, as a structural tag's Lark ``grammar``
element on xgrammar); a
compiled guide gets each string token by token with the stop token
(``tools/schema_test_suite.py``'s feed); a JSON value is fed in its six spellings, accepted when
one is. The fault is an **invalid string accepted**, and a crash: an exception that is not a
``CapgraphError``, or a compile or a string over ``--timeout`` seconds.

    python tools/engine_cases.py --outlines-core ~/src/outlines-core \\
        --xgrammar ~/src/xgrammar --llguidance ~/src/llguidance
    python tools/engine_cases.py --backends xgrammar -v        # the bundled cases alone

Exit status 1 on any invalid string accepted or any crash. docs/ENGINE_CASES.md has the run.
"""

from __future__ import annotations

import argparse
import ast
import concurrent.futures
import dataclasses
import json
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

sys.path.insert(0, str(Path(__file__).resolve().parent))
import schema_test_suite as suite  # noqa: E402  (the feed and the factories are shared)

ROOT = Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "tests" / "data" / "engine_cases" / "serving_engines.json"
BACKENDS = suite.BACKENDS
DEFAULT_TIMEOUT_S = suite.DEFAULT_TIMEOUT_S
KINDS = ("json_schema", "json", "regex", "ebnf", "lark", "structural_tag")
XGRAMMAR_FILES = ("test_json_schema_converter.py", "test_grammar_matcher_json_schema.py",
                  "test_grammar_matcher_regex.py", "test_regex_converter.py",
                  "test_grammar_matcher_ebnf.py", "test_grammar_matcher_json.py",
                  "test_grammar_matcher_basic.py", "test_lark.py",
                  "test_structural_tag_converter.py")
#: xgrammar test files whose grammars are Lark, not GBNF
XGRAMMAR_LARK_FILES = ("test_lark.py",)


@dataclass
class Instance:
    """One string (or JSON value) for a guide and the engine's expectation (None: none)."""

    text: str | None = None  #: fed as is
    value: Any = None  #: fed in :func:`schema_test_suite.spellings` (``text`` None)
    expected: bool | None = None

    def texts(self) -> list[str]:
        return [self.text] if self.text is not None else suite.spellings(self.value)

    def shown(self) -> str:
        return self.text if self.text is not None else json.dumps(self.value)


@dataclass
class Case:
    """A guide, its strings, and where it comes from."""

    kind: str  #: one of :data:`KINDS` (``lark``: a Lark grammar, compiled as an
    #: ``ebnf_grammar`` guide on llguidance and as a structural tag's Lark ``grammar`` element on
    #: xgrammar, which reads Lark only there)
    guide: str
    source: str  #: "repo path:line"
    instances: list[Instance] = field(default_factory=list)
    oracle: str | None = None  #: for ``ebnf``: a regex the whole string must match
    compiles: bool | None = None  #: the engine's own verdict on compiling the guide


@dataclass
class Tally:
    """What one backend did with a set of cases."""

    cases: int = 0
    compiled: int = 0
    refused: int = 0  #: UnsupportedGuideError
    compile_errors: int = 0  #: another named capgraph error
    invalid_refused: int = 0
    valid_accepted: int = 0
    valid_refused: int = 0  #: stricter than the guide: allowed, listed in the doc
    format_gaps: list[str] = field(default_factory=list)
    invalid_accepted: list[str] = field(default_factory=list)
    crashes: list[str] = field(default_factory=list)
    disputed: list[str] = field(default_factory=list)
    compiled_upstream_refuses: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)  #: "where: error" of refused guides
    valid_refusals: list[str] = field(default_factory=list)

    def add(self, other: "Tally") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    @property
    def ok(self) -> bool:
        return not self.invalid_accepted and not self.crashes


# ---------------------------------------------------------------------------------------------
# oracles


def _strict_json(text: str) -> Any:
    """``text`` parsed as strict JSON (no NaN/Infinity); ValueError otherwise."""
    def bad(name: str) -> Any:
        raise ValueError(f"not JSON: {name}")
    return json.loads(text, parse_constant=bad)


def oracle(case: Case, inst: Instance) -> tuple[bool | None, bool]:
    """(valid, fails only a format assertion) for ``inst`` under ``case``; valid is None where
    there is no oracle."""
    if case.kind in ("json_schema", "json"):
        if inst.text is not None:
            try:
                value = _strict_json(inst.text)
            except (ValueError, RecursionError):
                return False, False
        else:
            value = inst.value
        if case.kind == "json":
            return isinstance(value, (dict, list)), False
        return _schema_verdict(json.loads(case.guide), value)
    if case.kind == "lark" and case.oracle is None:
        if inst.text is None:
            return None, False
        only = _LARK_JSON_ONLY.fullmatch(case.guide)
        if only:  # start: %json SCHEMA: the schema's verdict
            try:
                schema = json.loads(only.group(1))
            except ValueError:
                return None, False
            try:
                value = _strict_json(inst.text)
            except (ValueError, RecursionError):
                return False, False
            return _schema_verdict(schema, value)
        return lark_verdict(case.guide, inst.text), False
    pattern = case.guide if case.kind == "regex" else case.oracle
    if pattern is None or inst.text is None:
        return None, False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            compiled = re.compile(pattern, re.ASCII)
    except (re.error, RecursionError, OverflowError):
        return None, False
    return compiled.fullmatch(inst.text) is not None, False


_LARK_PARSERS: dict[str, Any] = {}
_LARK_JSON_ONLY = re.compile(r"\s*start\s*:\s*%json\s*(\{.*\})\s*", re.S)


# A string literal of a Lark grammar, and the escapes the ``lark`` package reads in one (it
# keeps any other, ``\b`` say, as a backslash and a letter, where llguidance and xgrammar read
# a control character).
_LARK_STRING = re.compile(r'"((?:\\.|[^"\\\n])*)"')
_LARK_READ_ESCAPES = frozenset('\\"Uuxnftr')


class _LongestFullMatch:
    """A terminal matcher for ``lark``'s dynamic Earley lexer that finds every length a
    terminal's regex matches whole, not only the lengths of the prefixes of its first match:
    asked at ``(stream, i)`` it returns the longest full match from ``i``, and asked for a
    prefix of that text (the lexer's next questions) the longest full match within it. (The
    stock matcher misses ``ab`` for ``/a|ab/`` and ``aaa`` for ``/a{2,}?/``.)"""

    def __init__(self, regexps: dict[str, Any]) -> None:
        self.regexps = regexps
        self._last: tuple[str, str, list[int]] = ("", "", [])  # term, its text, match ends

    def __call__(self, term: Any, text: str, index: int = 0) -> Any:
        rx = self.regexps[term.name]
        last_term, last_text, last_ends = self._last
        if index == 0 and text and term.name == last_term and last_text.startswith(text):
            ends = [e for e in last_ends if e <= len(text)]
        else:
            ends = [e - index for e in range(index + 1, len(text) + 1)
                    if rx.fullmatch(text, index, e)]
            self._last = (term.name, text[index:index + ends[-1]] if ends else "", ends)
        return rx.fullmatch(text, index, index + ends[-1]) if ends else None


# Rust's regex classes (llguidance's reading of a Lark grammar's regexes), in the ``regex``
# module's syntax: \d is \p{Nd}, \s is \p{White_Space}, \w is this union (Python's \w
# leaves out combining marks, Rust's takes them).
_RUST_WORD = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}"
_RUST_OUTSIDE = {"d": "\\p{Nd}", "D": "\\P{Nd}", "s": "\\p{White_Space}",
                 "S": "\\P{White_Space}", "w": f"[{_RUST_WORD}]", "W": f"[^{_RUST_WORD}]"}
_RUST_INSIDE = {**_RUST_OUTSIDE, "w": _RUST_WORD, "W": f"[^{_RUST_WORD}]"}  # \W: a nested set


def _rust_classes(pattern: str) -> tuple[str, bool]:
    """``pattern`` with ``\\d``, ``\\w``, ``\\s`` and their negations written as Rust reads
    them, for the ``regex`` module; and whether it holds a nested set (``regex.V1`` needed)."""
    out, i, n, in_class, nested = [], 0, len(pattern), False, False
    while i < n:
        c = pattern[i]
        if c == "\\" and i + 1 < n:
            e = pattern[i + 1]
            table = _RUST_INSIDE if in_class else _RUST_OUTSIDE
            if e in table:
                out.append(table[e])
                nested |= in_class and e == "W"
            else:
                out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            i += 1
            for lead in ("^", "]"):  # a leading '^', then a leading ']' (a member)
                if pattern[i:i + 1] == lead:
                    out.append(lead)
                    i += 1
            continue
        if c == "]" and in_class:
            in_class = False
        out.append(c)
        i += 1
    return "".join(out), nested


def _lark_parser(grammar: str) -> Any:
    """The ``lark`` Earley parser of ``grammar`` with :class:`_LongestFullMatch` terminals and
    its regexes' classes as Rust (llguidance) reads them, or None where ``lark`` cannot build
    it or reads its string literals differently."""
    for m in _LARK_STRING.finditer(grammar):
        if any(e not in _LARK_READ_ESCAPES for e in re.findall(r"\\(.)", m.group(1))):
            return None
    try:
        import lark
        import regex

        from capgraph.grammar.lark_text import lark_regexes
        rewritten, pos, v1 = [], 0, False
        for found in lark_regexes(grammar):
            pattern, nested = _rust_classes(found.pattern)
            v1 |= nested
            rewritten += [grammar[pos:found.start], f"/{pattern}/{found.flags}"]
            pos = found.end
        text = "".join(rewritten) + grammar[pos:]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # (ambiguity="forest": recognition only; building the trees of an ambiguous
            # parse can take exponential time and memory)
            parser = lark.Lark(text, parser="earley", lexer="dynamic_complete", start="start",
                               regex=True, g_regex_flags=regex.V1 if v1 else 0,
                               ambiguity="forest")
    except Exception:  # noqa: BLE001 - ImportError, GrammarError, regex.error, ...
        return None
    earley = parser.parser.parser
    earley.term_matcher = _LongestFullMatch(earley.term_matcher.__self__.regexps)
    return parser


def lark_verdict(grammar: str, text: str) -> bool | None:
    """Whether ``text`` is in the language of the Lark grammar ``grammar`` by the ``lark``
    package (Earley over every way to cut the text into terminals: the grammar's language with
    its terminals as Python regexes); None where ``lark`` cannot build the grammar
    (llguidance's or xgrammar's extensions: ``%json``, special tokens, attributes, their regex
    syntax) or is not installed."""
    if grammar not in _LARK_PARSERS:
        _LARK_PARSERS[grammar] = _lark_parser(grammar)
    parser = _LARK_PARSERS[grammar]
    if parser is None:
        return None
    import lark
    try:
        parser.parse(text)
    except lark.exceptions.UnexpectedInput:
        return False
    except Exception:  # noqa: BLE001 - lark's own limits (recursion): no verdict
        return None
    return True


def _schema_verdict(schema: Any, value: Any) -> tuple[bool | None, bool]:
    import jsonschema
    try:
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        with_format = cls(schema, format_checker=cls.FORMAT_CHECKER)
        if with_format.is_valid(value):
            return True, False
        return False, cls(schema).is_valid(value)
    except Exception:  # noqa: BLE001 - an unresolvable $ref, a schema jsonschema cannot read
        return None, False


# ---------------------------------------------------------------------------------------------
# Rust test files: a small lexer for string literals and brackets


@dataclass
class _Tok:
    kind: str  #: "str", "open", "close", ",", "word", "punct"
    text: str  #: the value of a string, else the source text
    pos: int


def _rust_string(src: str, i: int) -> tuple[str, int]:
    """The value of the (non-raw) Rust string literal opening at ``src[i] == '"'``, and the
    index after it."""
    out, i = [], i + 1
    simple = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", '"': '"', "'": "'", "0": "\0"}
    while src[i] != '"':
        c = src[i]
        if c != "\\":
            out.append(c)
            i += 1
            continue
        e = src[i + 1]
        if e in simple:
            out.append(simple[e])
            i += 2
        elif e == "x":
            out.append(chr(int(src[i + 2:i + 4], 16)))
            i += 4
        elif e == "u":
            end = src.index("}", i)
            out.append(chr(int(src[i + 3:end], 16)))
            i = end + 1
        elif e == "\n":  # line continuation: the newline and the next line's indent go
            i += 2
            while src[i] in " \t\n\r":
                i += 1
        else:
            raise ValueError(f"unknown escape \\{e} at {i}")
    return "".join(out), i + 1


def rust_tokens(src: str) -> list[_Tok]:
    """Tokens of Rust source: string literals (raw or not, with their values), brackets,
    commas, words and other punctuation; comments dropped."""
    toks, i, n = [], 0, len(src)
    raw = re.compile(r'b?r(#*)"')
    while i < n:
        c = src[i]
        if c.isspace():
            i += 1
        elif src.startswith("//", i):
            i = src.find("\n", i) if "\n" in src[i:] else n
        elif src.startswith("/*", i):
            i = src.index("*/", i) + 2
        elif (m := raw.match(src, i)) and (i == 0 or not (src[i - 1].isalnum() or
                                                          src[i - 1] == "_")):
            end = src.index('"' + m.group(1), m.end())
            toks.append(_Tok("str", src[m.end():end], i))
            i = end + 1 + len(m.group(1))
        elif c == '"' or (c == "b" and src.startswith('b"', i)):
            start = i + (c == "b")
            value, i = _rust_string(src, start)
            toks.append(_Tok("str", value, start))
        elif c == "'":  # a char literal or a lifetime
            m2 = re.compile(r"'(\\.|[^\\'])'").match(src, i)
            if m2:
                toks.append(_Tok("word", m2.group(0), i))
                i = m2.end()
            else:
                i += 1
        elif c in "([{":
            toks.append(_Tok("open", c, i))
            i += 1
        elif c in ")]}":
            toks.append(_Tok("close", c, i))
            i += 1
        elif c == ",":
            toks.append(_Tok(",", c, i))
            i += 1
        elif c.isalnum() or c == "_":
            m3 = re.compile(r"[A-Za-z0-9_.]+").match(src, i)
            assert m3 is not None
            toks.append(_Tok("word", m3.group(0), i))
            i = m3.end()
        else:
            toks.append(_Tok("punct", c, i))
            i += 1
    return toks


def _matching(toks: list[_Tok], i: int, step: int = 1) -> int:
    """The index of the bracket closing the one opened at ``toks[i]`` (``step=-1``: opening
    the one closed there)."""
    depth = 0
    for j in range(i, len(toks) if step > 0 else -1, step):
        depth += step * ((toks[j].kind == "open") - (toks[j].kind == "close"))
        if depth == 0 and toks[j].kind in ("open", "close"):
            return j
    raise ValueError(f"unbalanced bracket at {toks[i].pos}")


def _split(toks: list[_Tok]) -> list[list[_Tok]]:
    """Tokens split at the commas outside brackets (an empty last item dropped)."""
    items: list[list[_Tok]] = [[]]
    depth = 0
    for t in toks:
        if t.kind == "," and depth == 0:
            items.append([])
            continue
        depth += (t.kind == "open") - (t.kind == "close")
        items[-1].append(t)
    return [it for it in items if it]


def _json_of(toks: list[_Tok]) -> Any:
    """The value of the tokens inside a ``json!( )``, or raise ValueError (a Rust expression)."""
    parts = [json.dumps(t.text) if t.kind == "str" else t.text for t in toks]
    text = re.sub(r",\s*([\]}])", r"\1", " ".join(parts))
    text = re.sub(r"(?<=\d)\s*_\s*(?=\d)", "", text)
    if re.search(r"\b(f32|f64|i64|u64|i32|u32|usize)\b", text):
        text = re.sub(r"_?(f32|f64|i64|u64|i32|u32|usize)\b", "", text)
    text = re.sub(r"(-)\s+(\d)", r"\1\2", text)
    return _strict_json(text)


def _line(src: str, pos: int) -> int:
    return src.count("\n", 0, pos) + 1


def load_outlines_core(root: Path) -> list[Case]:
    """dottxt-ai/outlines-core: the ``(schema, regex, matches, non-matches)`` tuples of the tests
    in ``src/json_schema/mod.rs``."""
    path = root / "src" / "json_schema" / "mod.rs"
    src = path.read_text(encoding="utf-8")
    toks = rust_tokens(src)
    cases = []
    for i, t in enumerate(toks):
        if t.kind != "open" or t.text != "(":
            continue
        items = _split(toks[i + 1:_matching(toks, i)])
        if len(items) != 4 or len(items[0]) != 1 or items[0][0].kind != "str":
            continue
        lists = [_vec_strings(it) for it in items[2:]]
        if any(v is None for v in lists):
            continue
        try:
            schema = json.loads(items[0][0].text)
        except ValueError:
            continue
        if not isinstance(schema, (dict, bool)):
            continue
        case = Case("json_schema", json.dumps(schema),
                    f"outlines-core src/json_schema/mod.rs:{_line(src, t.pos)}")
        for strings, expected in zip(lists, (True, False)):
            case.instances += [Instance(text=s, expected=expected) for s in strings or ()]
        cases.append(case)
    return cases


def _vec_strings(toks: list[_Tok]) -> list[str] | None:
    """The string literals of ``vec![...]`` tokens, or None if they are not that."""
    if len(toks) < 4 or [t.text for t in toks[:3]] != ["vec", "!", "["]:
        return None
    return [t.text for t in toks[3:-1] if t.kind == "str"]


def load_llguidance(root: Path) -> list[Case]:
    """guidance-ai/llguidance: in each test function of ``parser/tests/test_json_*.rs``, every
    ``json!`` schema it checks (``let schema = json!(...)``, a first argument of
    ``json_schema_check``/``json_err_test``, a ``lazy_static`` schema it names) against every
    ``json!`` value and string ``#[case]``/``#[values]`` it holds. The verdicts are the oracle's."""
    cases: dict[tuple[str, str], Case] = {}
    for path in sorted((root / "parser" / "tests").glob("test_json_*.rs")):
        src = path.read_text(encoding="utf-8")
        toks = rust_tokens(src)
        statics: dict[str, Any] = {}
        for i in range(len(toks) - 5):
            if toks[i].text == "static" and toks[i + 1].text == "ref":
                j = next(k for k in range(i, len(toks)) if toks[k].text == "json")
                try:
                    statics[toks[i + 2].text] = _json_of(toks[j + 3:_matching(toks, j + 2)])
                except ValueError:
                    pass
        for fn_start, fn_end, attrs_start in _rust_functions(toks):
            schemas, values = [], []
            names = {t.text for t in toks[fn_start:fn_end] if t.text in statics}
            schemas += [(statics[n], n) for n in sorted(names)]
            for j in range(attrs_start, fn_end):
                if not (toks[j].text == "json" and toks[j + 1].text == "!" and
                        toks[j + 2].kind == "open"):
                    continue
                end = _matching(toks, j + 2)
                try:
                    value = _json_of(toks[j + 3:end])
                except ValueError:
                    continue
                before = [t.text for t in toks[max(j - 3, 0):j]]
                if "schema" in before[-3:] and "=" in before[-2:] or \
                        before[-2:] in (["json_schema_check", "("], ["json_err_test", "("]) or \
                        before[-3:-1] in (["json_schema_check", "("], ["json_err_test", "("]):
                    schemas.append((value, f"line {_line(src, toks[j].pos)}"))
                else:
                    values.append(value)
            attr_strings = _case_strings(toks, attrs_start, fn_start)
            values += attr_strings
            for schema, _ in schemas:
                if not isinstance(schema, (dict, bool)):
                    continue
                key = (path.name, json.dumps(schema, sort_keys=True))
                case = cases.setdefault(key, Case(
                    "json_schema", json.dumps(schema),
                    f"llguidance parser/tests/{path.name}:{_line(src, toks[fn_start].pos)}"))
                seen = {json.dumps(i.value, sort_keys=True) for i in case.instances}
                for v in values:
                    if json.dumps(v, sort_keys=True) not in seen:
                        seen.add(json.dumps(v, sort_keys=True))
                        case.instances.append(Instance(value=v))
    return list(cases.values())


_FINAL_REJECT = "FINAL_REJECT:"  # llguidance's mark of a string refused only at its end


def load_llguidance_lark(root: Path) -> list[Case]:
    """guidance-ai/llguidance, ``parser/tests/test_lark.rs``: each ``lark_str_test_many``
    call (a Lark grammar, strings it accepts, strings it refuses; a grammar named by a
    ``for NAME in &[...]`` loop gives one case per grammar) and each ``json_test_many`` call
    (a ``json!`` schema, values valid, values invalid) whose arguments are literals."""
    path = root / "parser" / "tests" / "test_lark.rs"
    src = path.read_text(encoding="utf-8")
    toks = rust_tokens(src)
    out = []
    for i in range(len(toks) - 1):
        name = toks[i].text
        if toks[i].kind != "word" or toks[i + 1].text != "(" or name not in (
                "lark_str_test_many", "lark_str_test_many_quiet", "json_test_many"):
            continue
        items = _split(toks[i + 2:_matching(toks, i + 1)])
        if len(items) != 3:
            continue
        where = f"llguidance parser/tests/test_lark.rs:{_line(src, toks[i].pos)}"
        if name == "json_test_many":
            schema = _json_macro(items[0])
            lists = [_json_values(it) for it in items[1:]]
            if not isinstance(schema, (dict, bool)) or any(v is None for v in lists):
                continue
            case = Case("json_schema", json.dumps(schema), where)
            for values, flag in zip(lists, (True, False)):
                case.instances += [Instance(value=v, expected=flag) for v in values or ()]
            out.append(case)
            continue
        grammars = _literal_or_loop(toks, i, items[0])
        lists = [_str_slice(it) for it in items[1:]]
        for grammar in grammars:
            case = Case("lark", grammar, where)
            for strings, flag in zip(lists, (True, False)):
                case.instances += [Instance(text=t.removeprefix(_FINAL_REJECT), expected=flag)
                                   for t in strings]
            out.append(case)
    return out


def _str_slice(toks: list[_Tok]) -> list[str]:
    """The string literals that are whole items of ``&[...]`` (others, ``&format!(...)``,
    are left)."""
    if len(toks) < 3 or [t.text for t in toks[:2]] != ["&", "["]:
        return []
    return [it[0].text for it in _split(toks[2:-1]) if len(it) == 1 and it[0].kind == "str"]


def _json_macro(toks: list[_Tok]) -> Any:
    """The value of ``[&]json!(...)`` tokens, or None."""
    toks = toks[1:] if toks and toks[0].text == "&" else toks
    if len(toks) < 4 or [t.text for t in toks[:2]] != ["json", "!"]:
        return None
    try:
        return _json_of(toks[3:-1])
    except ValueError:
        return None


def _json_values(toks: list[_Tok]) -> list[Any] | None:
    """The values of ``&[json!(...), ...]``, or None if an item is not one."""
    if len(toks) < 3 or [t.text for t in toks[:2]] != ["&", "["]:
        return None
    values = []
    for item in _split(toks[2:-1]):
        value = _json_macro(item)
        if value is None:
            return None
        values.append(value)
    return values


def _literal_or_loop(toks: list[_Tok], call: int, arg: list[_Tok]) -> list[str]:
    """The grammar argument of a call: a literal, or the literals of the nearest ``for NAME
    in &[...]`` before the call naming the same variable; [] otherwise."""
    arg = arg[1:] if arg and arg[0].text == "&" else arg
    if len(arg) == 1 and arg[0].kind == "str":
        return [arg[0].text]
    if len(arg) != 1 or arg[0].kind != "word":
        return []
    for k in range(call - 1, 2, -1):
        if toks[k].text == "fn":
            break
        if toks[k].text == "for" and toks[k + 1].text == arg[0].text and \
                toks[k + 2].text == "in" and toks[k + 3].text == "&" and toks[k + 4].text == "[":
            return _str_slice(toks[k + 3:_matching(toks, k + 4) + 1])
    return []


def _rust_functions(toks: list[_Tok]) -> Iterator[tuple[int, int, int]]:
    """(index of ``fn``, index after its body, index of its first attribute) of each
    function."""
    i = 0
    while i < len(toks):
        if toks[i].text == "fn" and i + 1 < len(toks) and toks[i + 1].kind == "word":
            body = next(k for k in range(i, len(toks)) if toks[k].text == "{")
            end = _matching(toks, body) + 1
            attrs = i
            while attrs > 0 and toks[attrs - 1].text in ("pub",):
                attrs -= 1
            while attrs >= 2 and toks[attrs - 1].text == "]":
                try:
                    opening = _matching(toks, attrs - 1, step=-1)
                except ValueError:
                    break
                if opening > 0 and toks[opening - 1].text == "#":
                    attrs = opening - 1
                else:
                    break
            yield i, end, attrs
            i = end
        else:
            i += 1


def _case_strings(toks: list[_Tok], start: int, end: int) -> list[str]:
    """The string literals that are whole arguments of ``#[case(...)]`` attributes in
    ``toks[start:end]`` (values fed as JSON strings by ``json!(s)``)."""
    out = []
    for j in range(start, end - 2):
        if toks[j].text == "case" and toks[j + 1].text == "(":
            for item in _split(toks[j + 2:_matching(toks, j + 1)]):
                if len(item) == 1 and item[0].kind == "str":
                    out.append(item[0].text)
    return out


# ---------------------------------------------------------------------------------------------
# xgrammar's Python tests, read with ast


class _Unknown:
    """A value the reader cannot evaluate (a name, a call, a pydantic model)."""


UNKNOWN = _Unknown()


def _eval(node: ast.AST, env: dict[str, Any]) -> Any:
    """``node``'s value where it is a literal (names of literal module values allowed)."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(e, env) for e in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_eval(k, env) if k is not None else UNKNOWN for k in node.keys]
        if any(not isinstance(k, (str, int, float, bool)) or k is None for k in keys):
            return UNKNOWN
        return {k: _eval(v, env) for k, v in zip(keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        v = _eval(node.operand, env)
        return -v if isinstance(v, (int, float)) and not isinstance(v, bool) else UNKNOWN
    if isinstance(node, ast.BinOp):
        a, b = _eval(node.left, env), _eval(node.right, env)
        if isinstance(node.op, ast.Add) and isinstance(a, str) and isinstance(b, str):
            return a + b
        if isinstance(node.op, ast.Mult) and isinstance(a, str) and isinstance(b, int):
            return a * b if b <= 10_000 else UNKNOWN
        return UNKNOWN
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.JoinedStr):  # an f-string of known strings
        parts = [_eval(v.value if isinstance(v, ast.FormattedValue) else v, env)
                 for v in node.values]
        if all(isinstance(p, str) for p in parts) and not any(
                isinstance(v, ast.FormattedValue) and (v.conversion != -1 or v.format_spec)
                for v in node.values):
            return "".join(parts)
        return UNKNOWN
    if isinstance(node, ast.Call) and not node.keywords or isinstance(node, ast.Call) and all(
            k.arg in ("id", "marks") for k in node.keywords):
        func = ast.unparse(node.func)
        if func == "pytest.param":  # a parametrize row: its values
            return [_eval(a, env) for a in node.args]
        if func == "json.dumps" and len(node.args) == 1 and not node.keywords:
            value = _eval(node.args[0], env)
            return json.dumps(value) if _known(value) else UNKNOWN
    return UNKNOWN


def _known(value: Any) -> bool:
    if isinstance(value, _Unknown):
        return False
    if isinstance(value, list):
        return all(_known(v) for v in value)
    if isinstance(value, dict):
        return all(_known(v) for v in value.values())
    return True


_SCHEMA_NAMES = ("schema",)
_REGEX_NAMES = ("regex", "regex_string", "regex_str", "pattern")
_GRAMMAR_NAMES = ("grammar_str", "ebnf_grammar_str", "grammar", "ebnf")
_TEXT_NAMES = ("instance", "input", "input_str", "string", "test_value", "value")
_FLAG_NAMES = ("accepted", "is_accepted", "expected", "should_match")


def load_xgrammar(root: Path) -> list[Case]:
    """mlc-ai/xgrammar: the literal cases of the files in :data:`XGRAMMAR_FILES`."""
    cases: dict[tuple[str, str], Case] = {}
    for name in XGRAMMAR_FILES:
        path = root / "tests" / "python" / name
        if not path.is_file():
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        env: dict[str, Any] = {}
        for node in tree.body:
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name):
                env[node.targets[0].id] = _eval(node.value, env)
        for fn in tree.body:
            if isinstance(fn, ast.FunctionDef):
                where = f"xgrammar tests/python/{name}:{fn.lineno}"
                for case in _xgrammar_function(fn, env, where, name in XGRAMMAR_LARK_FILES):
                    key = (case.kind, case.guide)
                    if key in cases:
                        cases[key].instances += case.instances
                        if case.compiles is False:
                            cases[key].compiles = False
                    else:
                        cases[key] = case
    return list(cases.values())


def _xgrammar_function(fn: ast.FunctionDef, env: dict[str, Any], where: str,
                       lark: bool = False) -> list[Case]:
    local = dict(env)
    guides: dict[str, tuple[str, str]] = {}  # variable -> (kind, guide) of a Grammar
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                isinstance(node.targets[0], ast.Name):
            value = _eval(node.value, local)
            if _known(value):
                local[node.targets[0].id] = value
    rows = _parametrize_rows(fn, env) or [{}]
    out = []
    body = ast.unparse(fn)
    quoted = "'\"' + instance + '\"'" in body
    for row in rows:
        scope = {**local, **row}
        for node in ast.walk(fn):  # grammar objects built from literals
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and \
                    isinstance(node.targets[0], ast.Name) and isinstance(node.value, ast.Call):
                made = _grammar_of(node.value, scope)
                if made:
                    guides[node.targets[0].id] = made
        out += _row_cases(fn, row, scope, guides, quoted, where)
        if lark:
            out += _lark_language_cases(fn, scope, where)
        out += _structural_tag_cases(fn, scope, where)
    return out


def _structural_tag_cases(fn: ast.FunctionDef, scope: dict[str, Any], where: str
                          ) -> list[Case]:
    """The ``check_stag_with_instance(format, instance[, is_accepted])`` calls of xgrammar's
    structural-tag tests whose format (a dict: the tag is ``{"type": "structural_tag",
    "format": ...}``) and instance are known."""
    out = []
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) ==
                "check_stag_with_instance" and len(node.args) >= 2):
            continue
        fmt, text = _eval(node.args[0], scope), _eval(node.args[1], scope)
        flags = [_eval(a, scope) for a in node.args[2:3]] + [
            _eval(k.value, scope) for k in node.keywords if k.arg == "is_accepted"]
        flag = flags[0] if flags else True
        if not (isinstance(fmt, dict) and _known(fmt) and isinstance(text, str)
                and isinstance(flag, bool)):
            continue
        tag = json.dumps({"type": "structural_tag", "format": fmt}, ensure_ascii=False)
        out.append(Case("structural_tag", tag, where, [Instance(text=text, expected=flag)]))
    return out


def _lark_language_cases(fn: ast.FunctionDef, scope: dict[str, Any], where: str) -> list[Case]:
    """The ``_assert_language(grammar, accepted, rejected)`` calls of xgrammar's Lark tests
    whose arguments are known (calls with a ``tokenizer_info`` of their own vocabulary are
    left: their strings are token ids)."""
    out = []
    for node in ast.walk(fn):
        if not (isinstance(node, ast.Call) and ast.unparse(node.func) == "_assert_language"
                and len(node.args) == 3 and not node.keywords):
            continue
        grammar, accepted, rejected = (_eval(a, scope) for a in node.args)
        if not isinstance(grammar, str):
            continue
        case = Case("lark", grammar, where)
        for strings, flag in ((accepted, True), (rejected, False)):
            if isinstance(strings, list):
                case.instances += [Instance(text=t, expected=flag) for t in strings
                                   if isinstance(t, str)]
        out.append(case)
    return out


def _parametrize_rows(fn: ast.FunctionDef, env: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for dec in fn.decorator_list:
        if not (isinstance(dec, ast.Call) and ast.unparse(dec.func).endswith("parametrize")):
            continue
        names = _eval(dec.args[0], env)
        values = _eval(dec.args[1], env)
        if not isinstance(names, str) or not isinstance(values, list):
            continue
        keys = [n.strip() for n in names.split(",")]
        if "tokenizer_path" in keys:
            continue
        new = []
        for v in values:
            if len(keys) == 1:
                new.append({keys[0]: v})
            elif isinstance(v, list) and len(v) == len(keys):
                new.append(dict(zip(keys, v)))
        if rows:  # stacked decorators: the product
            rows = [{**a, **b} for a in rows for b in new]
        else:
            rows = new
    return rows


def _grammar_of(call: ast.Call, scope: dict[str, Any]) -> tuple[str, str] | None:
    func = ast.unparse(call.func)
    kinds = {"from_ebnf": "ebnf", "from_regex": "regex", "from_json_schema": "json_schema",
             "_regex_to_ebnf": "regex"}
    kind = next((k for f, k in kinds.items() if func.endswith(f)), None)
    if kind is None or not call.args or any(k.arg == "root_rule_name" for k in call.keywords):
        return None  # (capgraph has no other root rule)
    guide = _eval(call.args[0], scope)
    if kind == "json_schema":
        if isinstance(guide, str):
            try:
                guide = json.loads(guide)
            except ValueError:
                return None
        if isinstance(call.args[0], ast.Call) and ast.unparse(call.args[0].func) == "json.dumps":
            guide = _eval(call.args[0].args[0], scope)
        if not _known(guide) or not isinstance(guide, (dict, bool)):
            return None
        return kind, json.dumps(guide)
    return (kind, guide) if isinstance(guide, str) else None


def _row_cases(fn: ast.FunctionDef, row: dict[str, Any], scope: dict[str, Any],
               guides: dict[str, tuple[str, str]], quoted: bool, where: str) -> list[Case]:
    found: dict[tuple[str, str], Case] = {}

    def add(kind: str, guide: str, inst: Instance | None) -> Case:
        """The case of ``guide`` (made on first sight), ``inst`` added unless None."""
        found_case = found.setdefault((kind, guide), Case(kind, guide, where))
        if inst is not None:
            found_case.instances.append(inst)
        return found_case

    schema = next((scope[n] for n in _SCHEMA_NAMES if n in scope), None)
    regex = next((scope[n] for n in _REGEX_NAMES if isinstance(scope.get(n), str)), None)
    grammar = next((scope[n] for n in _GRAMMAR_NAMES if isinstance(scope.get(n), str)), None)
    guide: tuple[str, str] | None = None
    if isinstance(schema, (dict, bool)) and _known(schema):
        guide = ("json_schema", json.dumps(schema))
    elif regex is not None:
        guide = ("regex", regex)
    elif grammar is not None:
        guide = ("ebnf", grammar)
    if "json_input_accepted" in row or "json_input_refused" in row:
        text = row.get("json_input_accepted", row.get("json_input_refused"))
        if isinstance(text, str):
            add("json", "", Instance(text=text, expected="json_input_accepted" in row))
        return list(found.values())
    if "regex_input_refused" in row and isinstance(row["regex_input_refused"], str):
        add("regex", row["regex_input_refused"], None).compiles = False
        return list(found.values())
    if guide is not None:
        for key, flag in (("accepted_instances", True), ("rejected_instances", False),
                          ("accepted_inputs", True), ("rejected_inputs", False)):
            for inst in row.get(key) or []:
                if _known(inst):
                    add(*guide, _instance(inst, flag, guide[0]))
        for pair in row.get("instances") or []:
            if isinstance(pair, list) and len(pair) == 2 and isinstance(pair[1], bool) \
                    and _known(pair[0]):
                add(*guide, _instance(pair[0], pair[1], guide[0]))
        text = next((row[n] for n in _TEXT_NAMES if n in row), None)
        flag = next((row[n] for n in _FLAG_NAMES if isinstance(row.get(n), bool)), None)
        if text is not None and _known(text) and (flag is not None or row.keys() & {
                "instance", "input_str"}):
            if quoted and isinstance(text, str):
                text = '"' + text + '"'
            add(*guide, _instance(text, flag, guide[0]))
    # assert [not] _is_grammar_accept_string(grammar, "literal") and
    # check_schema_with_instance(schema, literal, is_accepted=...) in the body
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assert):
            continue
        test, flag = node.test, True
        if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
            test, flag = test.operand, False
        if isinstance(test, ast.Call) and ast.unparse(test.func).endswith(
                "_is_grammar_accept_string") and len(test.args) >= 2:
            g = test.args[0]
            made = guides.get(g.id) if isinstance(g, ast.Name) else None
            if made is None and isinstance(g, ast.Name) and isinstance(scope.get(g.id), str):
                made = ("ebnf", scope[g.id])
            if made is None and isinstance(g, ast.Call):
                made = _grammar_of(g, scope)
            text = _eval(test.args[1], scope)
            if made and isinstance(text, str):
                add(*made, Instance(text=text, expected=flag))
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and \
                ast.unparse(node.func) == "check_schema_with_instance" and len(node.args) >= 2:
            s, inst = _eval(node.args[0], scope), _eval(node.args[1], scope)
            flags = [_eval(k.value, scope) for k in node.keywords if k.arg == "is_accepted"]
            if len(node.args) >= 3:
                flags.append(_eval(node.args[2], scope))
            flag = flags[0] if flags and isinstance(flags[0], bool) else True
            if isinstance(s, (dict, bool)) and _known(s) and _known(inst) and \
                    not any(isinstance(a, ast.Name) and a.id in row for a in node.args[1:2]):
                add("json_schema", json.dumps(s), _instance(inst, flag, "json_schema"))
    return list(found.values())


def _instance(inst: Any, flag: bool | None, kind: str) -> Instance | None:
    """A string is a text; any other value (a JSON-schema instance) is fed in its spellings;
    None for what is neither (bytes)."""
    if isinstance(inst, bytes) or (kind != "json_schema" and not isinstance(inst, str)):
        return None
    if isinstance(inst, str):
        return Instance(text=inst, expected=flag)
    return Instance(value=inst, expected=flag)


# ---------------------------------------------------------------------------------------------
# the bundled serving-engine cases


def load_bundled(path: Path = BUNDLED) -> list[Case]:
    """The hand-written file: ``{"cases": [{"kind", "guide", "source", "oracle"?,
    "valid": [...], "invalid": [...]}]}`` (a JSON-schema guide may be an object)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    out = []
    for c in data["cases"]:
        guide = c["guide"] if isinstance(c["guide"], str) else json.dumps(c["guide"])
        case = Case(c["kind"], guide, c["source"], oracle=c.get("oracle"))
        for key, flag in (("valid", True), ("invalid", False)):
            case.instances += [Instance(text=t, expected=flag) for t in c.get(key, [])]
        out.append(case)
    return out


# ---------------------------------------------------------------------------------------------
# running


def params_for(case: Case, backend: str) -> Any:
    """The guide of ``case`` for a factory of ``backend`` (a ``GuidedDecodingBackend`` value)."""
    from capgraph import GuidedDecodingParams
    if case.kind == "json":
        return GuidedDecodingParams.json()
    if case.kind == "structural_tag":
        return GuidedDecodingParams.structural_tag(case.guide)
    if case.kind == "lark":
        if backend == "llguidance":
            return GuidedDecodingParams.ebnf(case.guide)
        return GuidedDecodingParams.structural_tag(json.dumps({
            "type": "structural_tag",
            "format": {"type": "grammar", "grammar": case.guide, "syntax": "lark"}}))
    return GuidedDecodingParams(case.kind if case.kind != "ebnf" else "ebnf_grammar", case.guide)


def run_case(factory: Any, tokenizer: Any, case: Case,
             timeout_s: float = DEFAULT_TIMEOUT_S) -> Tally:
    """One case on one factory."""
    from capgraph.errors import CapgraphError, UnsupportedGuideError

    tally = Tally(cases=1)
    where = f"{case.source} {case.kind} {case.guide[:80]!r}"
    try:
        params = params_for(case, factory.config.backend.value)
        compiled = factory.compile_async(params).future.result(timeout=timeout_s)
    except UnsupportedGuideError as e:
        tally.refused += 1
        tally.refusals.append(f"{where}: {str(e)[:160]}")
        return tally
    except concurrent.futures.TimeoutError:
        tally.crashes.append(f"{where}: compile over {timeout_s:g} s")
        return tally
    except CapgraphError as e:
        tally.compile_errors += 1
        tally.refusals.append(f"{where}: {type(e).__name__}: {str(e)[:160]}")
        return tally
    except Exception as e:  # noqa: BLE001 - anything else is the fault this tool reports
        tally.crashes.append(f"{where}: compile raised {type(e).__name__}: {e}"[:400])
        return tally
    tally.compiled += 1
    if case.compiles is False:
        tally.compiled_upstream_refuses.append(where)
    for inst in case.instances:
        name = f"{where} / {inst.shown()[:100]!r}"
        valid, format_only = oracle(case, inst)
        if valid is not None and inst.expected is not None and valid != inst.expected:
            tally.disputed.append(f"{name}: engine says {'valid' if inst.expected else 'invalid'}"
                                  f", oracle {'valid' if valid else 'invalid'}")
        verdict = valid if valid is not None else inst.expected
        taken = suite.fed(factory, compiled, tokenizer, inst.texts(), name, timeout_s,
                          tally.crashes)
        if taken is None or verdict is None:
            continue
        if verdict:
            if taken:
                tally.valid_accepted += 1
            else:
                tally.valid_refused += 1
                tally.valid_refusals.append(name)
        elif not taken:
            tally.invalid_refused += 1
        elif format_only:
            tally.format_gaps.append(f"{name}: accepted {taken[0][:100]!r}")
        else:
            tally.invalid_accepted.append(f"{name}: accepted {taken[0][:100]!r}")
    return tally


def load_sources(outlines_core: Path | None = None, xgrammar: Path | None = None,
                 llguidance: Path | None = None, bundled: Path | None = BUNDLED
                 ) -> dict[str, list[Case]]:
    """source name -> its cases, for the sources given."""
    out: dict[str, list[Case]] = {}
    for name, path, loader in (("outlines-core", outlines_core, load_outlines_core),
                               ("xgrammar", xgrammar, load_xgrammar),
                               ("llguidance", llguidance,
                                lambda root: load_llguidance(root) + load_llguidance_lark(root)),
                               ("vllm+sglang", bundled, load_bundled)):
        if path is not None:
            if not Path(path).exists():
                raise FileNotFoundError(f"{path}: no such checkout or file for {name}")
            out[name] = [c for c in loader(Path(path)) if c.instances or c.compiles is False]
    return out


def table(rows: dict[str, Tally]) -> str:
    """The summary table (Markdown), one row per label."""
    lines = ["| backend | source | cases | compiled | refused | compile errors | crashes | "
             "INVALID ACCEPTED | invalid refused | valid accepted | valid refused | "
             "format gaps | disputed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for label, t in rows.items():
        backend, _, source = label.partition(" / ")
        lines.append(f"| {backend} | {source} | {t.cases} | {t.compiled} | {t.refused} | "
                     f"{t.compile_errors} | {len(t.crashes)} | {len(t.invalid_accepted)} | "
                     f"{t.invalid_refused} | {t.valid_accepted} | {t.valid_refused} | "
                     f"{len(t.format_gaps)} | {len(t.disputed)} |")
    return "\n".join(lines)


def run(sources: dict[str, list[Case]], factories: dict[str, Any], tokenizer: Any,
        timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Tally]:
    """``"backend / source" -> Tally`` for every backend and source."""
    rows = {}
    for backend, factory in factories.items():
        for source, cases in sources.items():
            tally = Tally()
            for case in cases:
                tally.add(run_case(factory, tokenizer, case, timeout_s))
            rows[f"{backend} / {source}"] = tally
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--outlines-core", type=Path, help="a checkout of dottxt-ai/outlines-core")
    parser.add_argument("--xgrammar", type=Path, help="a checkout of mlc-ai/xgrammar")
    parser.add_argument("--llguidance", type=Path, help="a checkout of guidance-ai/llguidance")
    parser.add_argument("--bundled", type=Path, default=BUNDLED,
                        help="the serving engines' case file (default: %(default)s)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--tokenizer", default="tekken")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="also list disputed strings, format gaps, refusals and valid "
                             "strings refused")
    args = parser.parse_args(argv)

    from capgraph.tokenizers import load_tokenizer
    sources = load_sources(args.outlines_core, args.xgrammar, args.llguidance, args.bundled)
    tokenizer = load_tokenizer(args.tokenizer)
    factories = suite.make_factories(tokenizer, args.backends, args.timeout)
    start = time.perf_counter()
    try:
        rows = run(sources, factories, tokenizer, args.timeout)
    finally:
        for factory in factories.values():
            factory.close()
    counts = ", ".join(f"{s} {len(c)} cases / {sum(len(x.instances) for x in c)} strings"
                       for s, c in sources.items())
    print(f"engine cases: {counts}; tokenizer {args.tokenizer}, "
          f"{time.perf_counter() - start:.0f} s")
    totals: dict[str, Tally] = {}
    for label, t in rows.items():
        totals.setdefault(label.split(" / ")[0] + " / all", Tally()).add(t)
    print(table({**rows, **totals}))
    lists = [("INVALID ACCEPTED", "invalid_accepted"), ("CRASH", "crashes")]
    if args.verbose:
        lists += [("FORMAT GAP", "format_gaps"), ("DISPUTED", "disputed"),
                  ("COMPILED, ENGINE REFUSES", "compiled_upstream_refuses"),
                  ("REFUSED", "refusals"), ("VALID REFUSED", "valid_refusals")]
    for label, t in rows.items():
        for what, attr in lists:
            for item in getattr(t, attr):
                print(f"{label.split(' / ')[0]}: {what}: {item}")
    return 0 if all(t.ok for t in rows.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
