"""Regexes mean what ECMA-262 (read without flags) means, on both backends, or are refused.

Each case drives the public factory token by token with the tekken tokenizer: the text's
tokens must each be accepted and the stop token after them (or one refused)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from capgraph import GuidedDecodingConfig, GuidedDecodingParams, UnsupportedGuideError
from capgraph.errors import GrammarCompileError
from capgraph.grammar import create_matcher_factory
from capgraph.grammar.llguidance_backend import available as llg_available
from cases import accepts

needs_llg = pytest.mark.skipif(not llg_available(), reason="llguidance extra not installed")
BACKENDS = ["xgrammar", pytest.param("llguidance", marks=needs_llg)]



# (pattern, text, whether ECMA-262's /^(?:pattern)$/ matches it; checked with node's RegExp)
ECMA_TABLE = [
    # '.' is any character but a line terminator
    ("a.b", "axb", True), ("a.b", "a\nb", False), ("a.b", "a\rb", False),
    ("a.b", "a\u2028b", False), ("a.b", "a\u2029b", False), ("a.b", "a\u0085b", True),
    ("[.]", "x", False), (r"\.", ".", True),
    # \s / \S are ECMA's white space, not Unicode's White_Space property
    (r"a\sb", "a\u0085b", False), (r"a\sb", "a\ufeffb", True), (r"a\Sb", "a\ufeffb", False),
    (r"a\Sb", "a\u0085b", True), (r"a[\s]b", "a\u0085b", False),
    # classes do not nest and know no set operations or POSIX names
    ("[[:alpha:]]", "a", False), ("[[:alpha:]]", "a]", True), ("[a-z&&[^b]]", "a", False),
    ("[a-z&&[^b]]", "&]", True), ("[%--]", "+", True),
    # an escaped surrogate pair is the one character it spells
    (r"\ud83d\ude00", "\U0001F600", True), (r"[^\ud83d\ude00]", "\U0001F600", False),
    (r"[^\ud83d\ude00]", "x", True),
    # code points, not UTF-16 units (ECMA-262 with the u flag; JSON Schema's own tests)
    (".", "\U0001F600", True), (".{2}", "\U0001F600", False), ("[^a]", "\U0001F600", True),
    # identity escapes and Annex B braces
    (r"a\%b", "a%b", True), ("a{,5}", "a{,5}", True), ("a{2}", "aa", True),
    (r"[\b]", "\x08", True), (r"\cA", "\x01", True),
    # a lazy quantifier is a quantifier and its "?": the same language
    ("a+?b", "aab", True), ("a{1,2}?", "aa", True), ("a??b", "b", True),
    # spellings xgrammar 0.2.9 misreads as written (tools/regex_walk.py draws them): the hex
    # digits after \x and \u taken greedily, an escaped '^' first in a class as negation
    (r"\x090", "\t0", True), (r"\x090", "\x90", False), (r"\x07b", "\x07b", True),
    (r"\x07b", "{", False), (r"[\u00e9b]", "b", True), (r"[\u00e9b]", "\u0e9b", False),
    (r"[\u00e9\w]", "_", True), (r"[\u00e9\w]", "\u0c8e", False),
    (r"[\x61-\u00e9\w]", "\u0c8e", False), (r"[\x61-\u00e9\w]", "\u00e9", True),
    (r"[\^a]", "^", True), (r"[\^a]", "x", False), (r"[\^-a]", "_", True),
    (r"[\^-a]", "x", False), (r"[\u005eK]", "x", False), (r"[\^]+", "^^", True),
    (r"[\^]", "x", False), (r"[\n\r]", "\r", True), (r"[\0a]", "\x00", True),
    (r"[\0a]", "\n", False), (r"\x00", "\x00", True),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_guides_follow_ecma262(factory_cache, tokenizer_cache, backend):
    """Line terminators against ``.``, ECMA white space against ``\\s``, literal ``[`` and
    ``&&`` inside a class, surrogate escapes, identity escapes: a REGEX guide admits exactly
    what ECMA-262 matches, on both backends."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    got = [(p, t, accepts(factory, tok, GuidedDecodingParams.regex(p), t))
           for p, t, _ in ECMA_TABLE]
    assert got == ECMA_TABLE


# regex syntax ECMA-262 reads as something else than one backend would (or not at all)
NON_ECMA = [r"a\eb", r"a\ab", r"\p{L}+", r"\P{L}", r"\x{41}", r"\u{41}", "(?i)a", "(?s:a.)",
            "(?P<n>a)", r"\ud83d", r"a\ude00", r"[\ud83d]", r"\z", r"\A", r"\U00000041", "[]a]",
            r"\01", r"[^\s\S]", r"a|[^\d\D]", r"[z-a]",
            # a quantifier right after a quantifier: possessive in PCRE and Python ("a++a"
            # matches nothing there; llguidance read it as "(a+)+a" and took "aa") or stacked
            "a++a", "a*+", "a?+", "a{2}+", "a**", "a{2}{3}", "a+??", "a{1,2}?{3}",
            # a backslash that ends the pattern (llguidance read it as nothing)
            "\\", "a\\", "(a|b)\\"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("pattern", NON_ECMA)
def test_non_ecma_regex_syntax_is_refused(factory_cache, backend, pattern):
    """Escapes ECMA-262 reads as the plain letter (``\\e``: xgrammar reads ESC, llguidance
    would error or read Rust's meaning), Rust-only syntax (``\\p{L}``, ``\\x{41}``, inline
    flags), lone surrogate escapes and an empty class are refused with
    UnsupportedGuideError naming the construct and its position."""
    factory = factory_cache("tekken", backend)
    with pytest.raises(UnsupportedGuideError, match="at position"):
        factory.create(GuidedDecodingParams.regex(pattern))


@pytest.mark.parametrize("backend", [*BACKENDS, "auto"])
def test_a_schema_pattern_ending_in_a_backslash_is_refused(factory_cache, tokenizer_cache,
                                                          backend):
    """A JSON schema ``pattern`` ending in a lone backslash (not a regex in ECMA-262) is
    refused on every backend, "auto" included, rather than read as the pattern without it."""
    schema = GuidedDecodingParams.json_schema(
        '{"type": "string", "pattern": "^ab\\\\"}')
    if backend == "auto":
        factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
            tokenizer_cache("tekken"), backend="auto"))
    else:
        factory = factory_cache("tekken", backend)
    try:
        with pytest.raises(UnsupportedGuideError, match="lone backslash"):
            factory.create(schema)
    finally:
        if backend == "auto":
            factory.close()


def test_xgrammar_tag_regex_and_ebnf_regex_dot(factory_cache, tokenizer_cache):
    """A structural tag's ``regex`` element and an EBNF ``Regex("...")`` read ``.`` as
    ECMA-262 does; an EBNF literal's surrogate pair is the one character it spells."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", "xgrammar")
    tag = GuidedDecodingParams.structural_tag(json.dumps(
        {"type": "structural_tag", "format": {"type": "regex", "pattern": "a.b"}}))
    ebnf = GuidedDecodingParams.ebnf('root ::= Regex("a.b") "." [.]')
    for text, ok in [("axb", True), ("a\nb", False), ("a\rb", False), ("a\u2028b", False)]:
        assert accepts(factory, tok, tag, text) is ok, (text, "tag")
        assert accepts(factory, tok, ebnf, text + "..") is ok, (text, "ebnf")
    emoji = GuidedDecodingParams.ebnf('root ::= "\\ud83d\\ude00" [^\\ud83d\\ude00]')
    assert accepts(factory, tok, emoji, "\U0001F600x")
    assert not accepts(factory, tok, emoji, "\U0001F600\U0001F600")
    with pytest.raises(UnsupportedGuideError, match="lone surrogate"):
        factory.create(GuidedDecodingParams.ebnf('root ::= "\\ud83d"'))
    with pytest.raises(UnsupportedGuideError, match="at position"):
        factory.create(GuidedDecodingParams.ebnf('root ::= Regex("a\\\\eb")'))


@pytest.mark.parametrize("backend", BACKENDS)
def test_schema_patterns_follow_ecma262(factory_cache, tokenizer_cache, backend):
    """A schema ``pattern`` reads ``.`` and ``\\s`` as ECMA-262 does and refuses ``\\e``."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)

    def schema(pattern: str) -> GuidedDecodingParams:
        return GuidedDecodingParams.json_schema({"type": "string", "pattern": pattern})

    assert accepts(factory, tok, schema("^a.b$"), '"axb"')
    assert not accepts(factory, tok, schema("^a.b$"), '"a\u2028b"')
    assert not accepts(factory, tok, schema("^a\\sb$"), '"a\u0085b"')
    with pytest.raises(UnsupportedGuideError, match="at position"):
        factory.create(schema("^a\\eb$"))
    # a possessive repeat: both backends once took "aa" for "^a++a$", which matches nothing
    # where "++" means anything (PCRE, Python)
    with pytest.raises(UnsupportedGuideError, match="right after the quantifier '\\+'"):
        factory.create(schema("^a++a$"))


# (pattern, JSON text, valid, whether xgrammar takes it): the pattern matches the string the
# JSON text spells, and the text is JSON. Where a set holds characters JSON writes bare and
# characters it escapes, xgrammar matches the bare ones only (semantics._xg_set): valid
# strings refused, never an invalid one taken
JSON_ESCAPE_TABLE = [
    ("^\\\\$", '"\\\\"', True, True), ("^\\\\$", '"\\"', False, False),
    ("^\\x22$", '"\\""', True, True), ("^\\x22$", '"""', False, False),
    ('^"$', '"\\""', True, True), ("^a\\nb$", '"a\\nb"', True, True),
    ("^a\\nb$", '"a\nb"', False, False), ("^\\D$", '"\\u0001"', True, False),
    ("^\\D$", '"\x01"', False, False), ("^\\D$", '"x"', True, True),
    ("^.$", '"\\\\"', True, False), ("^.$", '"\\n"', False, False),
    ("^[^a]+$", '"b!"', True, True), ("^[^a]+$", '"\t"', False, False),
    ("^[^a]+$", '"""', False, False), ("^\\s+$", '" \u00a0"', True, True),
    ("^\\s+$", '"\\u001c"', False, False), ("^\\W$", '"\\\\"', True, False),
    ("^[\\x00-\\x1f]$", '"\\u001e"', True, True),
    ("^[\\x00-\\x1f]$", '"\\u001E"', True, True),
    ("^[\\x00-\\x1f]$", '"\\u0020"', False, False),
    ("^[\\n\\t]+$", '"\\t\\n"', True, True), ("^[\\n\\t]+$", '"\t"', False, False),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_schema_patterns_match_the_string_not_its_json_text(factory_cache, tokenizer_cache,
                                                             backend):
    """A schema ``pattern`` matches the decoded string: a character JSON writes escaped (a
    backslash, a quote, a control character) never appears bare in the JSON text, and where
    the pattern spells it, it is taken as its escape. xgrammar 0.2.9, given a pattern as
    written, matches it against the JSON text: ``^\\\\$`` takes ``"\\"`` (not JSON) and
    ``[\\D]`` a bare control character."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    expected = [(p, t, valid if backend == "llguidance" else xg)
                for p, t, valid, xg in JSON_ESCAPE_TABLE]
    got = [(p, t, accepts(factory, tok, GuidedDecodingParams.json_schema(
        {"type": "string", "pattern": p}), t)) for p, t, _, _ in JSON_ESCAPE_TABLE]
    assert got == expected
    assert all(valid or not xg for _, _, valid, xg in JSON_ESCAPE_TABLE)


_CLASS_PARTS = {"C": ("\\x00-\\x1f", range(0x20)), "Q": ("\\x22", [0x22]),
                "B": ("\\x5c", [0x5C]), "A": ("a", [0x61]), "S": (" -!", [0x20, 0x21])}
_ESCAPED_TEXTS = {'"\\""': 0x22, '"\\\\"': 0x5C, '"\\n"': 0x0A, '"\\u0001"': 0x01,
                  '"\\u001f"': 0x1F, '"a"': 0x61, '" "': 0x20}


@needs_llg
def test_llguidance_classes_holding_every_control_character(factory_cache, tokenizer_cache):
    """llguidance 1.9.1 takes ``\\"`` and ``\\\\`` wherever a pattern's set holds every
    control character (U+0000-U+001F) but not both of ``"`` and ``\\``: ``[^"]`` took
    ``"\\""``, ``[\\x00-\\x1fa]`` took ``"\\\\"``. capgraph gives it such a set without
    U+001F. Every class of up to three parts, plain and negated: no escaped character outside
    the class is taken, every other member is, and U+001F only where ``"`` and ``\\`` are
    members too."""
    import itertools

    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", "llguidance")
    wrong = []
    for size in (1, 2, 3):
        for combo in itertools.combinations(_CLASS_PARTS, size):
            for negated in (False, True):
                listed = set().union(*(_CLASS_PARTS[c][1] for c in combo))
                members = {c for c in range(0x80) if (c in listed) != negated}
                narrowed = set(range(0x20)) <= members and not {0x22, 0x5C} <= members
                cls = "[" + "^" * negated + "".join(_CLASS_PARTS[c][0] for c in combo) + "]"
                params = GuidedDecodingParams.json_schema(
                    {"type": "string", "pattern": f"^{cls}$"})
                for text, code in _ESCAPED_TEXTS.items():
                    want = code in members and not (narrowed and code == 0x1F)
                    if accepts(factory, tok, params, text) != want:
                        wrong.append((cls, text, want))
    assert wrong == []


def test_pattern_properties_keys_match_the_name_not_its_json_text(factory_cache,
                                                                  tokenizer_cache):
    """A ``patternProperties`` key is a pattern over the property's name, which is a JSON
    string too: a name with a quote is written escaped."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", "xgrammar")
    params = GuidedDecodingParams.json_schema({
        "type": "object", "patternProperties": {'^a"$': {"type": "integer"}},
        "additionalProperties": False})
    assert accepts(factory, tok, params, '{"a\\"": 1}')
    assert not accepts(factory, tok, params, '{"a"": 1}')


@pytest.mark.parametrize("pattern, written", [
    ("[a-z]+", "[a-z]+"), ("[^a]", "[^a]"), (r"[\^a]", r"[a\^]"), (r"[\^]", r"\^"),
    (r"\x090", r"\t0"), (r"[\u00e9b]", r"[b\u00e9]"), (r"\x00", r"[\x00]"), (r"[\0a]", r"[a\x00]"),
    (r"[\x00-\x1fa]", r"[a\x00-\x1f]"), (r"[\x1f-a]", r"[\x1f-a]"),
    (r"[\w\-]", r"[\-0-9A-Z_a-z]"),
])
def test_ecma_regex_for_xgrammar(pattern, written):
    """What xgrammar is given: classes from their code points, escapes as the characters."""
    from capgraph.grammar.semantics import ecma_regex

    assert ecma_regex(pattern, "xgrammar") == written


@needs_llg
def test_auto_refuses_what_either_backend_refuses(tokenizer_cache):
    """``backend="auto"`` starts a regex on llguidance; a regex either backend refuses as
    unsupported fails its compile instead of staying on llguidance: Rust-only syntax, and a
    construct only xgrammar's conversion refuses (here an anchor xgrammar ignores inside a
    group, which llguidance reads)."""
    tok = tokenizer_cache("tekken")
    config = GuidedDecodingConfig.from_tokenizer(tok, backend="auto")
    factory = create_matcher_factory(config)
    try:
        for pattern in [r"\p{L}+", r"\x{41}", "(?i)a", "a\\", "[[:alpha:]]x"]:
            params = GuidedDecodingParams.regex(pattern)
            if pattern == "[[:alpha:]]x":  # ECMA: a class, then "]x"
                assert accepts(factory, tok, params, "a]x")
                assert not accepts(factory, tok, params, "ax")
                continue
            with pytest.raises(GrammarCompileError):
                factory.create(params)
        handle = factory.compile_async(GuidedDecodingParams.regex("(^a)"))
        with pytest.raises(UnsupportedGuideError):
            handle.result(30, backend="auto")
    finally:
        factory.close()


@pytest.mark.parametrize("pattern, rust", [
    (r"\d+", "[0-9]+"), (r"[\d.]", r"[0-9\x{2E}]"), (r"[^\w]", "[^0-9A-Za-z_]"),
    (r"[a\D]", "[a[^0-9]]"), ("a.b", r"a[^\n\r\u2028\u2029]b"),
    (r"[[:a:]]", r"[\x{5B}\x{3A}a\x{3A}]]"),
    (r"\ud83d\ude00", "\U0001F600"), ("a{,2}", r"a\{,2}"), (r"[^]", r"[\x{0}-\x{10FFFF}]"),
])
def test_ecma_regex_for_llguidance(pattern, rust):
    """What llguidance is given: every class written out as ECMA-262 reads it."""
    from capgraph.grammar.semantics import ecma_regex

    assert ecma_regex(pattern, "llguidance") == rust


def _tagged(content: dict) -> GuidedDecodingParams:
    return GuidedDecodingParams.structural_tag(json.dumps(
        {"type": "structural_tag", "format": {"type": "tag", "begin": "<a>",
                                              "content": content, "end": "</a>"}}))


def _regex_places(regex: str) -> list[tuple[str, GuidedDecodingParams, Any]]:
    """``regex`` at every place a guide can hold one, with how a text is written there."""
    ebnf_body = regex.replace("\\", "\\\\")
    string = {"type": "string", "pattern": f"^{regex}$"}
    return [
        ("regex", GuidedDecodingParams.regex(regex), str),
        ("ebnf", GuidedDecodingParams.ebnf(f'root ::= "<" Regex("{ebnf_body}") ">"'),
         lambda t: f"<{t}>"),
        ("pattern", GuidedDecodingParams.json_schema(string), json.dumps),
        ("patternProperties", GuidedDecodingParams.json_schema(
            {"type": "object", "patternProperties": {f"^{regex}$": {"type": "integer"}},
             "additionalProperties": False}),
         lambda t: json.dumps({t: 1})),
        ("propertyNames", GuidedDecodingParams.json_schema(
            {"type": "object", "propertyNames": string,
             "additionalProperties": {"type": "integer"}}), lambda t: json.dumps({t: 1})),
        ("tag json_schema", _tagged({"type": "json_schema", "json_schema": string}),
         lambda t: f"<a>{json.dumps(t)}</a>"),
        ("tag grammar", _tagged({"type": "grammar", "grammar": f'root ::= Regex("{ebnf_body}")'}),
         lambda t: f"<a>{t}</a>"),
    ]


# (regex, texts in its language, texts outside it that xgrammar 0.2.9's automaton for a
# Regex(...) element takes: an optional group of a character and a repeat lets the character
# be skipped; found by tools/regex_walk.py --kinds ebnf pattern)
AUTOMATON_CASES = [
    ("a(bx+)?[^n]", ["ax", "abxxk"], ["axk"]),
    ("a(bx+)?d", ["ad", "abxd"], ["axd"]),
    ("x(b{2,3})?", ["x", "xbb", "xbbb"], ["xb"]),
]


@pytest.mark.parametrize("pattern, written", [
    ("a(bx+)?d", "a(bx+){0,1}d"), ("(?:ab)??c", "(?:ab){0,1}?c"), ("((a)?)?", "((a){0,1}){0,1}"),
    ("a?b", "a?b"), (r"\)?", r"\)?"), ("[)]?", "[)]?"), ("(a)*(b)+(c){2}", "(a)*(b)+(c){2}"),
])
def test_an_optional_group_is_written_as_a_counted_repeat_for_xgrammar(pattern, written):
    """'?' after a group is '{0,1}' for xgrammar (whose '?' lets a loop inside the group skip
    part of it); a '?' after anything else, and llguidance's regexes, are left as written."""
    from capgraph.grammar.semantics import ecma_regex

    assert ecma_regex(pattern, "xgrammar") == written
    assert ecma_regex(pattern, "xgrammar", json_string=True) == written
    assert "{0,1}" not in ecma_regex(pattern, "llguidance")


@pytest.mark.parametrize("regex, inside, outside", AUTOMATON_CASES)
def test_xgrammar_regexes_mean_the_same_in_every_place(factory_cache, tokenizer_cache, regex,
                                                       inside, outside):
    """A regex inside a grammar, a schema or a tag takes what the same REGEX guide takes:
    xgrammar 0.2.9 builds an optional group into an automaton where a loop inside the group
    can skip part of it (``a(bx+)?d`` takes ``axd``), so capgraph writes the group's ``?`` as
    ``{0,1}``."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", "xgrammar")
    for place, params, written in _regex_places(regex):
        for text in inside:
            assert accepts(factory, tok, params, written(text)), (place, text)
        for text in outside:
            assert not accepts(factory, tok, params, written(text)), (place, text)


def test_an_ebnf_regex_spelling_its_quantifier_as_an_escape_is_read_the_same(factory_cache,
                                                                               tokenizer_cache):
    """xgrammar prints '?' in a string as '\\?' and reads it back as '?': a Regex(...) written
    so (as xgrammar prints grammars) is the same regex, its optional group included."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", "xgrammar")
    params = GuidedDecodingParams.ebnf('root ::= Regex("a(bx+)\\?d")')
    assert accepts(factory, tok, params, "ad") and accepts(factory, tok, params, "abxd")
    assert not accepts(factory, tok, params, "axd")
