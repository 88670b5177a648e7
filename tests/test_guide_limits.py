"""Repetition counts are bounded before any backend compiles a guide (capgraph.grammar.guide_limits)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from capgraph import (ConfigError, GrammarCompileError, GuidedDecodingConfig,
                      GuidedDecodingParams, GuideType, UnsupportedGuideError)
from capgraph.decoder import GuidedDecoder
from capgraph.demo import KV_GRAMMAR
from capgraph.grammar import create_matcher_factory
from capgraph.grammar.guide_limits import (check_guide_limits, ebnf_counts, regex_counts,
                                           schema_counts)
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


@pytest.mark.parametrize("guide_type, guide", [
    (GuideType.REGEX, "[[=](-{0,256}){0,256}"),
    (GuideType.REGEX, "[[:](-{0,256}){0,256}:]"),
    (GuideType.REGEX, "[]a{0,1000000}]"),
    (GuideType.EBNF_GRAMMAR, 'root ::= [[=] ("-"{0,256}){0,256}'),
    (GuideType.JSON_SCHEMA, '{"type": "string", "pattern": "[[=](-{0,256}){0,256}"}'),
])
def test_a_class_ends_where_the_backend_ends_it(guide_type, guide):
    """A class ends at its first unescaped ']', as ECMA-262 and xgrammar's grammar reader end
    it: a '[=' / '[:' inside is a member, not the start of a POSIX class running to a later
    (or, unclosed, no) ':]', which hid the counts after it (a 40 s compile; a JSON-schema
    accept that ran past 200 s)."""
    with pytest.raises(UnsupportedGuideError, match="nested quantifiers|repetition count"):
        check_guide_limits(GuidedDecodingParams(guide_type, guide), "xgrammar", 65535)


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


# -- chains of nested quantifiers through rule references ------------------------------------

def _check(guide: str, backend: str = "xgrammar") -> None:
    from capgraph.grammar.guide_limits import check_guide_limits
    check_guide_limits(GuidedDecodingParams.ebnf(guide), backend, 65535)


def _check_refused(guide: str, backend: str, *needles: str) -> str:
    with pytest.raises(UnsupportedGuideError) as info:
        _check(guide, backend)
    message = str(info.value)
    for needle in needles:
        assert needle in message, (needle, message)
    return message


@pytest.mark.parametrize("grammar, needles", [
    # one reference: 65536, one accept of a 64-character token 36 ms (as inline)
    ('root ::= x{0,256}\nx ::= "a"{0,256}',
     ["two nested", "65536", "{0,256} (rule root, grammar offset 10) > {0,256} (rule x"]),
    # two references, three levels: 4096 (7.2 s for that token)
    ('root ::= x{0,16}\nx ::= y{0,16}\ny ::= "a"{0,16}',
     ["three or more nested", "4096", "(rule root,", "(rule x,", "(rule y,"]),
    # a reference passed on by a rule without quantifiers
    ('root ::= x{0,256}\nx ::= y | "b"\ny ::= "a"{0,256}', ["65536", "(rule y,"]),
    # a rule under '*' and '+'
    ('root ::= "s" x*\nx ::= "a"{0,1000}', ["64000", "* (rule root"]),
    ('root ::= (x "," | x)+\nx ::= [a-z]{0,100}', ["6400", "(rule x,"]),
    # the regex of a referenced rule
    ('root ::= x{0,256}\nx ::= Regex("a{0,256}")', ["65536", "Regex at grammar offset 24"]),
])
def test_nested_counts_through_gbnf_rule_references_are_refused(tiny, grammar, needles):
    """A chain of nested quantifiers split across rules costs what the same chain inline
    costs (``x{0,256}`` with ``x ::= "a"{0,256}``: 36 ms per long-token accept, as
    ``("a"{0,256}){0,256}``): it is refused by the same products, the message naming each
    count of the chain and its rule."""
    _refused(tiny, GuidedDecodingParams.ebnf(grammar), "the chain:", *needles)


@pytest.mark.parametrize("grammar, needles", [
    ('start: x{0,256}\nx: "a"{0,256}', ["65536", "(rule start,", "(rule x,"]),
    ('start: x{0,16}\nx: y ~ 0..16\ny: "a" ~ 0..16',
     ["three or more nested", "4096", "~ 0..16 (rule x,", "(rule y,"]),
    ('start: "s" x*\nx: X\nX: /a{0,1000}/', ["64000", "regex at grammar offset"]),
    ('?start: item+\nitem.2: [A] B{0,100}\nB: "b" | "c"\nA: "a"', ["6400", "(rule item,"]),
])
def test_nested_counts_through_lark_rules_and_terminals_are_refused(grammar, needles):
    """The same through Lark rules and terminals (``~ n..m``, priorities and ``?rule``
    read)."""
    _check_refused(grammar, "llguidance", "the chain:", *needles)


@pytest.mark.parametrize("grammar, needles", [
    # left recursion under a count: xgrammar did not finish one accept in 120 s
    ('root ::= x\nx ::= ("a" | x){0,40}', ["1600", "(rule x,"]),
    # a count around a reference to its own rule nests without end (3.2 s at {0,40})
    ('root ::= x\nx ::= "b" | ("a" x){0,4}', ["over 4611686018427387904", "{0,4} (rule x"]),
    ('root ::= x\nx ::= "a" | ("a" x?){0,16}', ["three or more nested"]),  # 940 ms
    ('root ::= y\ny ::= "c" z\nz ::= "d" | ("a" y){0,4}', ["(rule z,"]),  # through two rules
])
def test_counts_nested_through_recursion_are_refused(tiny, grammar, needles):
    """A rule reached from itself inside a count repeats that count once per level of
    recursion: such a chain grows without end and is refused."""
    _refused(tiny, GuidedDecodingParams.ebnf(grammar), *needles)


LLAMA_CPP_JSON = r'''
root   ::= object
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::=
  "[" ws (
            value
    ("," ws value)*
  )? "]" ws
string ::=
  "\"" (
    [^"\\\x7F\x00-\x1F] |
    "\\" (["\\bfnrt] | "u" [0-9a-fA-F]{4}) # escapes
  )* "\"" ws
number ::= ("-"? ([0-9] | [1-9] [0-9]{0,15})) ("." [0-9]+)? ([eE] [-+]? [0-9] [1-9]{0,15})? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''
EXPRESSION = '''root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]{1,10} ("." [0-9]{1,6})? | "(" ws expr ws ")" | "-" factor
ws ::= [ ]*
'''
LARK_JSON = r'''
?start: value
?value: object | array | string | SIGNED_NUMBER -> number | "true" -> true | "null" -> null
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : string ":" value
string : ESCAPED_STRING
ESCAPED_STRING : /"([^"\\]|\\(["\\\/bfnrt]|u[0-9a-fA-F]{4}))*"/
SIGNED_NUMBER: /-?[0-9]{1,15}(\.[0-9]+)?([eE][+-]?[0-9]+)?/
%ignore /[ \t\n]+/
'''
LARK_EXPRESSION = r'''
start: sum
sum: product (("+" | "-") product)*
product: atom (("*" | "/") atom)*
atom: NUMBER | "-" atom | "(" sum ")"
NUMBER: /[0-9]{1,10}/
%ignore " "
'''


@pytest.mark.parametrize("grammar, backend, undelimited", [
    # llama.cpp's json.gbnf: recursion through '*', counts in strings, numbers, whitespace
    (LLAMA_CPP_JSON, "xgrammar", ('("," ws value)*', '(ws value)*')),
    (EXPRESSION, "xgrammar", ('(("*" | "/") factor)*', '(factor)*')),
    (LARK_JSON, "llguidance", ('("," value)*', '(value)*')),
    (LARK_EXPRESSION, "llguidance", ('(("*" | "/") atom)*', '(atom)*')),
    (KV_GRAMMAR, "xgrammar", ('(";" pair){0,2}', '(value){0,200}')),  # the demo's
])
def test_recursive_and_delimited_grammars_pass(grammar, backend, undelimited):
    """Real grammars pass: plain recursion (JSON's ``value`` inside ``array``'s ``*``) and
    counts a delimiter keeps apart (``("," ws value)*`` around a number's ``[0-9]{0,15}``,
    ``"\\\\u" [0-9a-fA-F]{4}`` in a string's ``*``: the separator cannot be part of the
    inner count's text, so the outer repetition cannot split it in several ways). Without
    the delimiter the same grammar nests the counts, and is refused."""
    _check(grammar, backend)
    old, new = undelimited
    assert old in grammar
    _check_refused(grammar.replace(old, new), backend, "nested", "the chain:")


def test_xgrammar_builtin_json_grammar_passes():
    """xgrammar's own JSON grammar (lookaheads, recursion through rules) passes."""
    xgrammar = pytest.importorskip("xgrammar")
    _check(str(xgrammar.Grammar.builtin_json_grammar()))
    _check_refused('root ::= x{0,256}\nx ::= y (= "b")\ny ::= "a"{0,256}', "xgrammar",
                   "(rule y,")


def test_a_delimiter_keeps_counts_apart_only_when_it_cannot_be_their_text():
    """``x{0,64}`` with ``x ::= "a"{0,64} "b"`` passes (0.08 ms per long-token accept:
    each ``b`` ends an iteration); with ``"a"`` as the delimiter the iterations can split
    the text in many ways (5.9 ms; ``("a" ("a"{0,16}){0,16}){0,16}``: 18 s), and it is
    refused."""
    _check('root ::= x{0,64}\nx ::= "a"{0,64} "b"')
    _check_refused('root ::= x{0,64}\nx ::= "a"{0,64} "a"', "xgrammar", "4096")
    _check_refused('root ::= x{0,16}\nx ::= "a" y{0,16}\ny ::= "a"{0,16}', "xgrammar",
                   "three or more nested")


def _tag(fmt: dict) -> GuidedDecodingParams:
    return GuidedDecodingParams(GuideType.STRUCTURAL_TAG,
                                json.dumps({"type": "structural_tag", "format": fmt}))


def _repeat(lo: int, hi: int, content: dict) -> dict:
    return {"type": "repeat", "min": lo, "max": hi, "content": content}


_A = {"type": "const_string", "value": "a"}


@pytest.mark.parametrize("fmt, needles", [
    # 36 ms per long-token accept, as ("a"{0,256}){0,256}
    (_repeat(0, 256, _repeat(0, 256, _A)), ["65536", "repeat min=0 max=256 (structural tag, "
                                                      "/format/content)"]),
    (_repeat(0, 16, _repeat(0, 16, _repeat(0, 16, _A))), ["three or more", "4096"]),  # 8.6 s
    ({"type": "star", "content": _repeat(0, 1000, _A)}, ["64000"]),
    (_repeat(0, 256, {"type": "regex", "pattern": "a{0,256}"}), ["regex at /format/content"]),
    (_repeat(0, 256, {"type": "grammar", "grammar": 'root ::= x\nx ::= "a"{0,256}'}),
     ["(rule x,"]),
    (_repeat(0, 256, {"type": "sequence", "elements": [
        {"type": "optional", "content": _A}, _repeat(1, 256, _A)]}), ["65536"]),
])
def test_structural_tag_repeats_nested_in_repeats_are_refused(tiny, fmt, needles):
    """A tag's ``repeat`` (``star``, ``plus``) around another, or around a regex or grammar
    with counts, multiplies them like nested quantifiers."""
    _refused(tiny, _tag(fmt), "nested", "/format", *needles)


def test_structural_tag_repeats_kept_apart_by_tags_pass(tiny):
    """A repeat of tags whose begin and end strings cannot be part of the inner repeat's
    text does not multiply (one long-token accept: 0.01 ms)."""
    from capgraph.grammar.guide_limits import check_guide_limits
    check_guide_limits(_tag(_repeat(0, 256, {"type": "tag", "begin": "<b>", "content":
                                             _repeat(0, 256, _A), "end": "</b>"})),
                       "xgrammar", 65535)
    _refused(tiny, _tag(_repeat(0, 256, {"type": "tag", "begin": "a", "content":
                                         _repeat(0, 256, _A), "end": ""})), "65536")


def test_rule_following_stays_fast():
    """Summaries are computed once per rule (a cycle a few rounds): a chain of 5000 rules
    (50 ms alone), a 2000-rule cycle and 5000 alternatives take under a second each on 2
    cores. The bound is loose on purpose: it catches work that grows with the square of
    the grammar (a 5000-rule chain walked once per rule), not a slower machine."""
    import time
    grammars = [
        "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(5000)) + 'r5000 ::= "a"',
        "root ::= r0\n" + "".join(f'r{i} ::= "x" (r{i + 1})* | "y" [0-9]{{1,3}}\n'
                                  for i in range(2000)) + "r2000 ::= r0",
        "root ::= " + " | ".join(f'"k{i}" [a-z]{{0,4}}' for i in range(5000)),
    ]
    for grammar in grammars:
        start = time.perf_counter()
        _check(grammar)
        assert time.perf_counter() - start < 10.0
    _check_refused("root ::= r0{0,256}\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(5000))
                   + 'r5000 ::= "a"{0,256}', "xgrammar", "(rule r5000,")


@needs_llguidance
def test_a_large_choice_list_serves_on_llguidance(tekken_factories, tekken):
    """A Lark rule of 3000 alternatives (over llguidance's default 2000 items in a parser row)
    serves its request to the end on llguidance: the row bound is raised to the per-step item
    cap, which still bounds the step; before, the request failed at its first token."""
    from cases import accepts
    grammar = "start: " + " | ".join(f'"w{i}"' for i in range(3000))
    params = GuidedDecodingParams.ebnf(grammar)
    factory = tekken_factories["llguidance"]
    assert accepts(factory, tekken, params, "w2999")
    assert accepts(factory, tekken, params, "w17")
    assert not accepts(factory, tekken, params, "w3000")


def _deep(n: int) -> str:
    return "(" * n + "a" + ")" * n


@pytest.mark.parametrize("params, backend", [
    (GuidedDecodingParams.regex(_deep(251)), "xgrammar"),
    (GuidedDecodingParams.json_schema({"type": "string", "pattern": _deep(251)}), "xgrammar"),
    (GuidedDecodingParams.json_schema({"type": "object",
                                       "patternProperties": {_deep(251): {}}}), "llguidance"),
    (GuidedDecodingParams.ebnf(f'root ::= Regex("{_deep(251)}")'), "xgrammar"),
    (GuidedDecodingParams.ebnf(f"start: /{_deep(251)}/"), "llguidance"),
    (GuidedDecodingParams.structural_tag(json.dumps({
        "type": "structural_tag", "format": {"type": "regex", "pattern": _deep(251)}})),
     "xgrammar"),
])
def test_regex_groups_nested_too_deep_are_refused_everywhere(params, backend):
    """A regex whose groups nest past MAX_GROUP_DEPTH is refused by name wherever a regex
    can be (a guide, a pattern, a patternProperties key, GBNF Regex, a Lark terminal, a
    structural tag), on the backend that would read it; one level less passes."""
    with pytest.raises(UnsupportedGuideError, match="groups nest over 250 deep") as info:
        check_guide_limits(params, backend, 65535)
    assert info.value.guide_type == params.guide_type.name and info.value.backend == backend
    shallower = dataclasses.replace(params, guide=params.guide.replace("(", "", 1)
                                    .replace(")", "", 1))
    check_guide_limits(shallower, backend, 65535)
    # escaped parentheses and parentheses in a class are no groups
    check_guide_limits(GuidedDecodingParams.regex("\\(" * 300 + "[(]" * 300), backend, 65535)


def test_a_deep_regex_fails_its_request_instead_of_crashing_the_process():
    """xgrammar's automaton builder recursed once per group level and overflowed the compile
    thread's stack at about 20 000 levels, killing the whole process (SIGSEGV, no traceback).
    Run in a child process so that a regression fails this test, not the test run."""
    import subprocess
    import sys
    code = (
        "import torch\n"
        "from capgraph import GuidedDecodingConfig as C, GuidedDecodingParams as P\n"
        "from capgraph.decoder import GuidedDecoder\n"
        "from capgraph.requests import GuidedRequest as R\n"
        "V = [chr(97 + i % 26) * (1 + i // 26) for i in range(200)] + ['</s>']\n"
        "d = GuidedDecoder(C(encoded_vocab=V, stop_token_ids=[200]), 2)\n"
        "bad = P.json_schema({'type': 'string', 'pattern': '(' * 30000 + 'a' + ')' * 30000})\n"
        "d.add_batch([R.context(1, 0, P.regex('a+')), R.context(2, 1, bad)])\n"
        "print('FAILED', d.execute(torch.zeros(2, 201)))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert "FAILED" in done.stdout and "groups nest over 250 deep" in done.stdout, done.stdout


def test_the_documented_command_runs_without_a_warning():
    """`python -m capgraph.grammar.guide_limits PATTERN` (README, docs/RELIABILITY.md) prints
    its verdict with nothing on stderr: no import of the package loads the module before it
    runs as __main__ (Python's RuntimeWarning said it then may behave unpredictably)."""
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-m",
                           "capgraph.grammar.guide_limits", "((a|aa)*){1000}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-2000:]
    assert "UnsupportedGuideError" in done.stdout and "MAX_NESTED_PRODUCT" in done.stdout
