"""Repetition counts are bounded before any backend compiles a guide (capgraph.grammar.guide_limits)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from capgraph import (ConfigError, GrammarCompileError, GuidedDecodingConfig,
                      GuidedDecodingParams, GuideType, UnsupportedGuideError)
from capgraph.decoder import GuidedDecoder
from capgraph.grammar import create_matcher_factory
from capgraph.grammar.guide_limits import ebnf_counts, regex_counts, schema_counts
from capgraph.grammar.llguidance_backend import available as llguidance_available
from capgraph.requests import GuidedRequest

VOCAB = ["a", "b", "</s>", "{", "}", "[", "]", '"', ",", ":", "0", "1"]
WRAPS = 2**32 + 1  # xgrammar stores counts in 32 bits: this one becomes 1

needs_llguidance = pytest.mark.skipif(not llguidance_available(),
                                      reason="the llguidance extra is not installed")


@pytest.fixture(scope="module")
def tiny():
    """xgrammar on a raw 12-token vocabulary (ids 0 'a', 1 'b', 2 the stop token)."""
    factory = create_matcher_factory(GuidedDecodingConfig(
        encoded_vocab=VOCAB, stop_token_ids=[2], vocab_size_padded=64))
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def tekken_factories(factory_cache):
    """Both backends on Tekken (llguidance needs a real tokenizer)."""
    return {"xgrammar": factory_cache("tekken", "xgrammar"),
            "llguidance": factory_cache("tekken", "llguidance") if llguidance_available()
            else None}


def _refused(factory, params, *needles: str) -> UnsupportedGuideError:
    with pytest.raises(UnsupportedGuideError) as info:
        factory.compile(params)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))
    return info.value


def test_wrapping_regex_count_is_refused(tiny):
    """``a{4294967297}`` (which xgrammar wraps to ``a{1}``, so that it accepts "a" then the
    stop token) fails to compile with UnsupportedGuideError naming the count and its offset;
    nothing is cached for it."""
    err = _refused(tiny, GuidedDecodingParams.regex(f"a{{{WRAPS}}}"), str(WRAPS), "offset 1",
                   "2**31 - 1")
    assert err.backend == "xgrammar" and err.guide_type == "REGEX"
    assert tiny.cache.get(("regex", f"a{{{WRAPS}}}")) is None


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_both_backends_refuse_counts_by_name(tekken_factories, backend):
    """On both backends a count beyond 2**31-1 and a count above the configured limit are
    refused with the same named error (llguidance's own parser would give a generic one)."""
    factory = tekken_factories[backend]
    if factory is None:
        pytest.skip("the llguidance extra is not installed")
    _refused(factory, GuidedDecodingParams.regex(f"x{{2,{WRAPS}}}"), str(WRAPS))
    _refused(factory, GuidedDecodingParams.regex("(ab){65536}"), "65536",
             "max_repetition_count=65535")
    factory.compile(GuidedDecodingParams.regex("(ab){65535}"))  # at the limit: compiles


def test_configured_limit_is_the_bound(tiny):
    """``max_repetition_count`` moves the bound: 5 refuses ``a{6}`` and ``a{2,6}`` and
    compiles ``a{5}``; the error says how to raise it."""
    config = dataclasses.replace(tiny.config, max_repetition_count=5)
    factory = create_matcher_factory(config)
    try:
        _refused(factory, GuidedDecodingParams.regex("a{6}"), "max_repetition_count=5",
                 "raise the limit")
        _refused(factory, GuidedDecodingParams.regex("a{2,6}"), "6")
        factory.compile(GuidedDecodingParams.regex("a{5}"))
    finally:
        factory.close()


@pytest.mark.parametrize("value", [0, -1, 2**31, 1.5, "10", True, None])
def test_max_repetition_count_is_validated(value):
    """The config field takes an int in [1, 2**31-1]; anything else is a ConfigError naming
    it."""
    with pytest.raises(ConfigError, match="max_repetition_count"):
        GuidedDecodingConfig(encoded_vocab=VOCAB, max_repetition_count=value)


def test_regex_scan_skips_escapes_and_classes():
    """Escaped braces, braces in character classes (POSIX classes too) and the braces of
    ``\\p{..}`` are not repetitions; a lone ``{`` is a literal; real counts are found with
    their offsets."""
    assert list(regex_counts(r"a\{4294967297}")) == []
    assert list(regex_counts(r"[{]x[^]{]y[[:alpha:]{]")) == []
    assert list(regex_counts(r"\p{L}\x{41}{ab")) == []
    assert [(v, w) for v, w, _ in regex_counts(r"[{]{3}\{x{2,7}")] == [
        (3, "regex offset 3"), (2, "regex offset 9"), (7, "regex offset 9")]


def test_escaped_and_class_braces_still_compile(tiny):
    """A guide whose only braces are escaped or inside a class compiles and matches them
    literally."""
    matcher = tiny.create(GuidedDecodingParams.regex(r"\{[{]{2}a"))
    assert all(matcher.accept_token(t) for t in (3, 3, 3, 0, 2)) and matcher.is_terminated()


@pytest.mark.parametrize("schema,where", [
    ({"type": "string", "maxLength": WRAPS}, "/maxLength"),
    ({"type": "array", "items": {"type": "integer"}, "maxItems": WRAPS}, "/maxItems"),
    ({"type": "string", "minLength": 10**12}, "/minLength"),
    ({"type": "object", "maxProperties": 70001}, "/maxProperties"),
    ({"type": "object", "properties": {"p": {"type": "string", "pattern": "^a{70000}$"}}},
     "pattern at /properties/p"),
    ({"type": "object", "patternProperties": {"^k{99999}$": {"type": "integer"}}},
     "patternProperties key"),
    ({"anyOf": [{"type": "array", "minItems": 80000}, {"type": "null"}]}, "/anyOf/0/minItems"),
    # a schema only a '$ref' reaches (the backends follow the pointer wherever it leads)
    ({"x": {"type": "string", "pattern": f"^a{{{WRAPS}}}$"}, "$ref": "#/x"}, "pattern at /x"),
    ({"x": {"type": "string", "maxLength": 100000}, "$ref": "#/x"}, "/x/maxLength"),
])
def test_schema_counts_are_refused_with_their_pointer(tiny, schema, where):
    """JSON-schema count keywords (xgrammar wraps maxLength and maxItems beyond 32 bits),
    ``pattern`` values and ``patternProperties`` keys above the limit are refused, the error
    naming where in the schema they are."""
    _refused(tiny, GuidedDecodingParams.json_schema(schema), where)


def test_property_named_like_a_keyword_is_not_a_count(tiny):
    """A property *named* ``maxLength`` (or ``pattern``) holds a subschema, not a count: the
    scan reads keywords in schema positions only."""
    schema = {"type": "object", "properties": {"maxLength": {"type": "integer"},
                                               "pattern": {"type": "string"}}}
    assert list(schema_counts(schema)) == []
    tiny.compile(GuidedDecodingParams.json_schema(schema))


def test_gbnf_repetitions_are_refused_and_strings_skipped(tiny):
    """xgrammar's GBNF ``{n}`` beyond 32 bits (which it wraps) is refused; braces inside
    strings, classes and comments are not counts."""
    _refused(tiny, GuidedDecodingParams.ebnf(f'root ::= "a"{{{WRAPS}}}'), "grammar offset 12")
    _refused(tiny, GuidedDecodingParams.ebnf('root ::= ("a" | "b"){3,70000}'), "70000")
    tiny.compile(GuidedDecodingParams.ebnf(f'root ::= "{{{WRAPS}}}" [{{]{{2}} # x{{{WRAPS}}}\n'))


def test_lark_repetitions_are_found():
    """Lark (the llguidance dialect): ``{n}``, ``~ n``, ``~ n..m``, regex literals and inline
    ``%json`` schemas are read; strings and ``//`` comments are not."""
    grammar = ('start: "a"~3 b{4} x~2..9 /c{5}/ "d{6}" // e{7}\n'
               'b: %json {"type": "string", "maxLength": 8}\n')
    assert sorted(v for v, _, _ in ebnf_counts(grammar, lark=True)) == [2, 3, 4, 5, 8, 9]
    assert [v for v, _, _ in ebnf_counts('root ::= [a-z]{2} "x{3}"', lark=False)] == [2]


@needs_llguidance
def test_lark_count_refused_on_llguidance(tekken_factories):
    """On llguidance, a Lark ``~`` repetition and a regex literal above the limit are refused
    by name."""
    factory = tekken_factories["llguidance"]
    _refused(factory, GuidedDecodingParams.ebnf('start: "a"~70000'), "~70000")
    _refused(factory, GuidedDecodingParams.ebnf("start: /a{80000}/"), "regex at grammar")


def test_refused_guide_fails_its_request_alone(tiny):
    """In a batch, the request with a wrapping count fails with its id and the error's name;
    the other request is masked exactly as it would be alone."""
    dec = GuidedDecoder(tiny.config, 2, 0, factory=tiny)
    good = GuidedDecodingParams.regex("ab")
    dec.add_batch([GuidedRequest.context(1, 0, GuidedDecodingParams.regex(f"a{{{WRAPS}}}")),
                   GuidedRequest.context(2, 1, good)])
    logits = torch.zeros(2, 64)
    failed = dec.execute(logits)
    assert [f[0] for f in failed] == [1] and "UnsupportedGuideError" in failed[0][1]
    assert torch.isfinite(logits[0]).all()  # unmasked
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0]  # only 'a'
    dec.close()


def test_structural_tag_schemas_are_scanned(tiny):
    """A schema inside a structural tag is scanned too."""
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<f>", "end": "</f>",
        "content": {"type": "json_schema", "json_schema": {"type": "string",
                                                           "maxLength": WRAPS}}}}
    with pytest.raises(GrammarCompileError, match="maxLength"):
        tiny.compile(GuidedDecodingParams(GuideType.STRUCTURAL_TAG, json.dumps(tag)))


@needs_llguidance
def test_fallback_reads_counts_in_its_primary_backends_syntax(tokenizer_cache):
    """A fallback factory whose primary is llguidance compiles EBNF guides there, as Lark: its
    count check reads them as Lark too, so ``~ n`` past the limit is refused by name (read as
    GBNF it would pass unseen)."""
    config = GuidedDecodingConfig.from_tokenizer(
        tokenizer_cache("mistral-sp32k"), backend="llguidance",
        json_unenforced_keywords="fallback")
    factory = create_matcher_factory(config)
    try:
        _refused(factory, GuidedDecodingParams.ebnf('start: "a" ~ 70000'), "~ 70000")
    finally:
        factory.close()


def test_lark_grammars_inside_structural_tags_are_scanned_as_lark(tiny):
    """A structural tag's ``grammar`` element with ``syntax: lark`` is read as Lark: its
    ``~ n`` counts are bounded like a Lark guide's."""
    tag = {"type": "structural_tag", "format": {
        "type": "grammar", "syntax": "lark", "grammar": 'start: "a" ~ 70000'}}
    _refused(tiny, GuidedDecodingParams(GuideType.STRUCTURAL_TAG, json.dumps(tag)), "~ 70000")


@pytest.mark.parametrize("guide, needle", [
    (GuidedDecodingParams.regex("((((a{0,100}){0,100}){0,100}){0,100}){0,100}"), "nested"),
    (GuidedDecodingParams.regex("((a{0,8}){0,8}){0,8}"), "three or more nested"),
    (GuidedDecodingParams.regex("(a*){0,100}"), "two nested quantifiers"),
    (GuidedDecodingParams.regex("(a{0,64}b){0,64}"), "repeat 4096 times"),
    (GuidedDecodingParams.json_schema(json.dumps(
        {"type": "string", "pattern": "^((a{0,40}){0,40}){0,40}$"})), "pattern at /"),
    (GuidedDecodingParams.ebnf('root ::= ("a"{0,100}){0,100}'), "grammar offset"),
    (GuidedDecodingParams.ebnf('root ::= Regex("(a{0,100}){0,100}")'), "Regex at grammar"),
])
def test_nested_counts_are_bounded_by_their_product(tiny, guide, needle):
    """Counts each under ``max_repetition_count`` but nested multiply what one host step
    over a long token costs (``((((a{0,100}){0,100}){0,100}){0,100}){0,100}``: 35 s for a
    16-character token, uninterruptible): a chain of two nested quantifiers may multiply to
    MAX_NESTED_PRODUCT (1024), three or more to MAX_DEEP_NESTED_PRODUCT (64)."""
    _refused(tiny, guide, needle, "nested")


@pytest.mark.parametrize("guide", [
    r"(\d{1,3}\.){3}\d{1,3}", r"([0-9a-f]{4}:){7}[0-9a-f]{4}", r"(a{1,63}\.){1,10}",
    "((a{0,4}){0,4}){0,4}", "(a{0,32}){0,32}", "(a*)*b", "(a+b){0,16}"])
def test_nested_counts_within_the_products_compile(tiny, guide):
    tiny.compile(GuidedDecodingParams.regex(guide))


def test_nested_product_limit_follows_a_lower_max_repetition_count():
    factory = create_matcher_factory(GuidedDecodingConfig(
        encoded_vocab=VOCAB, stop_token_ids=[2], vocab_size_padded=64,
        max_repetition_count=100))
    try:
        factory.compile(GuidedDecodingParams.regex("(a{0,10}){0,10}"))
        _refused(factory, GuidedDecodingParams.regex("(a{0,10}){0,11}"), "110", "nested")
    finally:
        factory.close()


@pytest.mark.parametrize("fmt, needle", [
    ({"type": "repeat", "min": 100000, "max": 100000,
      "content": {"type": "const_string", "value": "ab"}}, "min=100000"),
    ({"type": "repeat", "min": 0, "max": 10**8,
      "content": {"type": "const_string", "value": "ab"}}, "max=100000000"),
    ({"type": "repeat", "min": 0, "max": WRAPS,
      "content": {"type": "const_string", "value": "ab"}}, "beyond"),
])
def test_structural_tag_repeat_counts_are_refused(tiny, fmt, needle):
    """A structural tag's ``repeat`` counts are repetition counts like any other."""
    tag = {"type": "structural_tag", "format": fmt}
    _refused(tiny, GuidedDecodingParams(GuideType.STRUCTURAL_TAG, json.dumps(tag)), needle,
             "/format/")


@pytest.mark.parametrize("grammar, needle", [
    ('root ::= Regex("a{100000}")', "100000"),
    ('root ::= "x" Regex("[a-z]{1,4294967297}")', "beyond"),
])
def test_gbnf_regex_counts_are_refused(tiny, grammar, needle):
    """The regex inside xgrammar's GBNF ``Regex("...")`` is read for counts (it is a string
    literal, whose other contents hold none)."""
    _refused(tiny, GuidedDecodingParams.ebnf(grammar), needle, "Regex at grammar offset")


def test_cost_estimate_sends_a_pattern_next_to_an_enum_to_a_worker():
    """The policy check matches an enum's values against a sibling pattern: such a schema
    is not called cheap enough for the decoder's process."""
    from capgraph.grammar.compile_cost import why_not_cheap
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[2],
                                  vocab_size_padded=64)
    for extra in ({"enum": ["aa"]}, {"const": "aa"}):
        schema = {"type": "string", "pattern": "^(a+)+$", **extra}
        why = why_not_cheap(GuidedDecodingParams.json_schema(json.dumps(schema)), config)
        assert why is not None and "enum/const" in why
    assert why_not_cheap(GuidedDecodingParams.json_schema(json.dumps(
        {"type": "string", "pattern": "^a+$"})), config) is None


def test_deep_schema_with_long_names_is_checked_in_linear_memory(monkeypatch):
    """Nested properties with long names: the walk keeps no JSON pointer per node and writes
    out only the one a refusal names (each is depth x name length: 300 levels of
    10 000-character names kept 450 MB of pointers; 480 x 40 000 took 4.8 GB and 18 s)."""
    import tracemalloc

    from capgraph.grammar import schema_policy
    from capgraph.grammar.guide_limits import check_guide_limits
    schema: dict = {"type": "string", "maxLength": 70000}
    for i in range(300):
        schema = {"type": "object", "properties": {chr(97 + i % 26) * 10000: schema}}
    params = GuidedDecodingParams.json_schema(json.dumps(schema))
    written = []
    to_text = schema_policy.Pointer.__str__
    monkeypatch.setattr(schema_policy.Pointer, "__str__",
                        lambda self: written.append(1) or to_text(self))
    tracemalloc.start()
    try:
        with pytest.raises(UnsupportedGuideError, match="maxLength") as info:
            check_guide_limits(params, "xgrammar", 65535)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    assert len(written) <= 2, len(written)  # the refused count's pointer only
    message = str(info.value)  # names where, its middle cut out
    assert "/properties/" + "n" * 40 in message and "/maxLength" in message
    assert len(message) < 1000
