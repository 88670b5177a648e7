"""What a guide means, the same on both backends and every bundled tokenizer: special tokens are
never grammar text, JSON whitespace modes, ECMA-262 regex classes."""

from __future__ import annotations

import json

import pytest

from capgraph import GuidedDecodingParams, GuideType, UnsupportedGuideError
from capgraph.bitmask import allocate_host_bitmask
from capgraph.grammar.llguidance_backend import available as llg_available
from capgraph.tokenizers import BUNDLED_TOKENIZERS, encode_continuation, special_token_ids
from conftest import bits_of
from cases import accepts

ALL_TOKENIZERS = list(BUNDLED_TOKENIZERS)
needs_llg = pytest.mark.skipif(
    not llg_available(), reason="llguidance extra not installed (pip install capgraph[llguidance])")
BACKENDS = ["xgrammar", pytest.param("llguidance", marks=needs_llg)]


def allowed_ids(factory, matcher) -> set[int]:
    """The ids the matcher's filled bitmask row allows."""
    vocab = factory.config.vocab_size_padded
    mask = allocate_host_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    return set(bits_of(mask[0], vocab).nonzero().flatten().tolist())


def force(factory, tok, params: GuidedDecodingParams, text: str):
    """A matcher for ``params`` that has accepted ``text``'s tokens (each one must be accepted)."""
    matcher = factory.create(params)
    for i, t in enumerate(encode_continuation(tok, text)):
        assert matcher.accept_token(t), f"token {i} ({t}) of {text!r} was refused"
    return matcher



# --- special tokens ----------------------------------------------------------------------------

_STRING_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
_ANY_TEXT_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}}

# (guide type, backend) -> (params, text that leaves the matcher inside free text, may end there)
FREE_TEXT_STATES = {
    ("JSON", "xgrammar"): (GuidedDecodingParams.json(), '{"a": "x', False),
    ("JSON", "llguidance"): (GuidedDecodingParams.json(), '{"a": "x', False),
    ("JSON_SCHEMA", "xgrammar"): (GuidedDecodingParams.json_schema(_STRING_SCHEMA), '{"a": "x',
                                  False),
    ("JSON_SCHEMA", "llguidance"): (GuidedDecodingParams.json_schema(_STRING_SCHEMA),
                                    '{"a": "x', False),
    ("REGEX", "xgrammar"): (GuidedDecodingParams.regex(".*"), "x", True),
    ("REGEX", "llguidance"): (GuidedDecodingParams.regex(".*"), "x", True),
    ("EBNF_GRAMMAR", "xgrammar"): (GuidedDecodingParams.ebnf('root ::= "<" [^>]* ">"'), "<x",
                                   False),
    ("EBNF_GRAMMAR", "llguidance"): (GuidedDecodingParams.ebnf('start: "<" /[^>]*/ ">"'), "<x",
                                     False),
    ("STRUCTURAL_TAG", "xgrammar"): (GuidedDecodingParams.structural_tag(
        json.dumps(_ANY_TEXT_TAG)), "<a>x", False),
}


@pytest.mark.parametrize("tok_name", ALL_TOKENIZERS)
@pytest.mark.parametrize("guide_backend", list(FREE_TEXT_STATES),
                         ids=lambda k: f"{k[0]}-{k[1]}")
def test_special_tokens_are_never_grammar_text(factory_cache, tokenizer_cache, tok_name,
                                               guide_backend):
    """Inside free text (a JSON string, a regex's ``.*``, an EBNF character class, a structural
    tag's any_text) the mask allows no special token of the tokenizer; a stop token is allowed
    exactly where the grammar may end, and ordinary text stays allowed."""
    guide_type, backend = guide_backend
    if backend == "llguidance" and not llg_available():
        pytest.skip("llguidance extra not installed")
    params, text, may_end = FREE_TEXT_STATES[guide_backend]
    tok = tokenizer_cache(tok_name)
    factory = factory_cache(tok_name, backend)
    allowed = allowed_ids(factory, force(factory, tok, params, text))
    stops = set(factory.config.stop_token_ids)
    specials = special_token_ids(tok)
    assert len(specials) >= 3
    leaked = sorted((allowed & specials) - stops)
    assert not leaked, f"{len(leaked)} special tokens allowed, e.g. " \
                       f"{tok.convert_ids_to_tokens(leaked[:5])}"
    assert bool(allowed & stops) == may_end
    assert set(encode_continuation(tok, "y")[:1]) <= allowed, "ordinary text was masked"


def test_respelled_vocabulary_changes_only_special_tokens(tokenizer_cache):
    """The xgrammar vocabulary differs from xgrammar's own reading of the tokenizer only at
    special ids, whose text is empty (special to xgrammar, never allowed by a grammar), or
    spelled with a 0xFF lead byte no grammar text contains where a tag places them; stop tokens
    stay stop tokens."""
    import xgrammar as xgr

    from capgraph import GuidedDecodingConfig
    from capgraph.grammar.xgrammar_backend import SPECIAL_SPELLING_PREFIX, build_tokenizer_info

    tok = tokenizer_cache("qwen")
    config = GuidedDecodingConfig.from_tokenizer(tok, vocab_size_padded=len(tok) + 5)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    info = build_tokenizer_info(config)
    placing = build_tokenizer_info(config, placeable={start})
    theirs = xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=config.vocab_size_padded,
        stop_token_ids=config.stop_token_ids).decoded_vocab
    specials = special_token_ids(tok)
    for ours in (info.decoded_vocab, placing.decoded_vocab):
        assert len(ours) == len(theirs) == config.vocab_size_padded
        assert {i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b} == specials
    assert set(info.special_token_ids) == specials - set(config.stop_token_ids) \
        | set(range(len(tok), config.vocab_size_padded))
    assert placing.decoded_vocab[start] == SPECIAL_SPELLING_PREFIX + b"<|im_start|>"
    assert info.stop_token_ids == placing.stop_token_ids == config.stop_token_ids


@pytest.mark.parametrize("by", ["name", "id", "lark name", "lark id"])
def test_structural_tag_token_element_places_a_special_token(factory_cache, tokenizer_cache, by):
    """A structural tag that places a special token -- a ``token`` element naming it by string
    or id, or ``<name>`` / ``<[id]>`` in a Lark ``grammar`` element -- allows exactly that
    token at its place; the tag's text after it still cannot produce it."""
    tok = tokenizer_cache("qwen")
    factory = factory_cache("qwen")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    if by.startswith("lark"):
        ref = "<|im_start|>" if by == "lark name" else f"<[{start}]>"
        fmt = {"type": "grammar", "syntax": "lark",
               "grammar": f'start: {ref} "assistant\\n" /[a-z<|>]*/'}
    else:
        fmt = {"type": "sequence", "elements": [
            {"type": "token", "token": "<|im_start|>" if by == "name" else start},
            {"type": "const_string", "value": "assistant\n"},
            {"type": "any_text"}]}
    tag = {"type": "structural_tag", "format": fmt}
    matcher = factory.create(GuidedDecodingParams.structural_tag(json.dumps(tag)))
    assert allowed_ids(factory, matcher) == {start}
    assert matcher.accept_token(start)
    for t in encode_continuation(tok, "assistant\nhello"):
        assert matcher.accept_token(t)
    allowed = allowed_ids(factory, matcher)
    assert start not in allowed and not (allowed & special_token_ids(tok)) - {tok.eos_token_id}
    assert not matcher.accept_token(start)


@pytest.mark.parametrize("guide_type", [GuideType.REGEX, GuideType.EBNF_GRAMMAR])
def test_special_token_text_in_a_guide_is_plain_text(factory_cache, tokenizer_cache, guide_type):
    """A guide that spells a special token's text (``<|im_start|>``) matches that text as
    ordinary characters: the special token itself is never allowed for it."""
    tok = tokenizer_cache("qwen")
    factory = factory_cache("qwen")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    guide = "<\\|im_start\\|>" if guide_type is GuideType.REGEX else 'root ::= "<|im_start|>"'
    matcher = factory.create(GuidedDecodingParams(guide_type, guide))
    allowed = allowed_ids(factory, matcher)
    assert start not in allowed and allowed
    assert not matcher.accept_token(start)


def test_a_placed_special_token_is_the_only_one_a_tags_free_text_can_reach(factory_cache,
                                                                            tokenizer_cache):
    """The documented limit of placing: a special token a structural tag places by a ``token``
    element may also appear inside that tag's any_text content (xgrammar matches it as any
    bytes); no other special token can, and the same text under a tag that places nothing
    allows none."""
    tok = tokenizer_cache("qwen")
    factory = factory_cache("qwen")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    free = {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}
    specials = special_token_ids(tok)
    for head, text in (([{"type": "token", "token": "<|im_start|>"}], "<a>x"), ([], "<a>x")):
        tag = {"type": "structural_tag", "format": {"type": "sequence",
                                                     "elements": [*head, free]}}
        matcher = factory.create(GuidedDecodingParams.structural_tag(json.dumps(tag)))
        if head:
            assert matcher.accept_token(start)
        for t in encode_continuation(tok, text):
            assert matcher.accept_token(t)
        reached = allowed_ids(factory, matcher) & specials
        assert reached <= ({start} if head else set()), tok.convert_ids_to_tokens(sorted(reached))


def _qwen_xml_tag(schema: dict, *head: dict) -> GuidedDecodingParams:
    element = {"type": "tag", "begin": "<tool_call>\n<function=f>\n",
               "content": {"type": "json_schema", "json_schema": schema, "style": "qwen_xml"},
               "end": "\n</function>\n</tool_call>"}
    return GuidedDecodingParams.structural_tag(json.dumps({
        "type": "structural_tag", "format": {"type": "sequence",
                                             "elements": [*head, element]}}))


@pytest.mark.parametrize("keyword, value", [
    ("pattern", '^a"b$'), ("format", "date"), ("patternProperties", {"^a": {}})])
def test_xml_style_schemas_refuse_patterns_written_for_json_text(factory_cache, keyword,
                                                                 value):
    """An XML-style element writes string values as raw text, while capgraph writes patterns
    and formats for xgrammar to match JSON string text: ``^a"b$`` accepted ``a\\"b`` and
    refused ``a"b``. Such schemas are refused by name; without them they compile."""
    factory = factory_cache("qwen")
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    if keyword == "patternProperties":
        schema[keyword] = value
    else:
        schema["properties"]["q"][keyword] = value
    with pytest.raises(UnsupportedGuideError, match=f"'{keyword}'.*XML-style"):
        factory.compile(_qwen_xml_tag(schema))
    factory.compile(_qwen_xml_tag({"type": "object", "properties": {"q": {"type": "string"}},
                                   "required": ["q"]}))


def test_xml_style_patterns_compiled_anyway_are_read_as_raw_text(tokenizer_cache):
    """With json_unenforced_keywords='ignore' such a pattern is compiled as xgrammar reads it,
    on the raw text: ``a"b`` passes, its JSON escape does not."""
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    tok = tokenizer_cache("tekken")
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tok, json_unenforced_keywords="ignore"))
    try:
        params = _qwen_xml_tag({"type": "object", "properties": {
            "q": {"type": "string", "pattern": '^a"b$'}}, "required": ["q"]})
        head = '<tool_call>\n<function=f>\n<parameter=q>\n'
        for value, ok in (('a"b', True), ('a\\"b', False)):
            matcher = factory.create(params)
            text = encode_continuation(tok, head + value + "\n</parameter>\n</function>\n"
                                       "</tool_call>")
            fed = all(matcher.accept_token(t) for t in text)
            assert (fed and matcher.is_terminated() or fed and matcher.accept_token(
                factory.config.stop_token_ids[0])) == ok, value
    finally:
        factory.close()


@pytest.mark.parametrize("head, needle", [
    ([{"type": "token", "token": "<|endoftext|>"}, {"type": "const_string", "value": "x"}],
     "places stop token"),
    ([{"type": "token", "token": "hello"}], "names token 'hello' by text"),
    ([{"type": "token", "token": "<|im_start|>"}], "XML-style element"),
])
def test_tags_whose_tokens_xgrammar_would_not_match_are_refused(factory_cache, head, needle):
    """A stop token placed by a token element (xgrammar allows it only where the output ends:
    the tag dead-ended after 'a' and before its text), an ordinary token named by text (no
    vocabulary to look it up in), and special tokens placed beside an XML-style element
    (whose raw-text values took the placed token as text) are refused at compile, before any
    matcher moves."""
    factory = factory_cache("qwen")
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    with pytest.raises(UnsupportedGuideError, match=needle):
        factory.compile(_qwen_xml_tag(schema, *head))


def test_a_schema_inside_a_tag_keeps_values_that_spell_tag_tokens(factory_cache,
                                                                  tokenizer_cache):
    """A const that spells a token element ({"type": "token", "token": "<|im_end|>"}) is
    schema data: it is produced as written inside a tag (the token name was replaced by its
    id, 151645, and the tag counted as placing it)."""
    tok = tokenizer_cache("qwen")
    factory = factory_cache("qwen")
    value = {"type": "token", "token": "<|im_end|>"}
    schema = {"type": "object", "properties": {"fmt": {"const": value}}, "required": ["fmt"]}
    params = GuidedDecodingParams.structural_tag(json.dumps({
        "type": "structural_tag", "format": {"type": "json_schema", "json_schema": schema}}))
    matcher = factory.create(params)
    # (the text spelled out in ordinary tokens: the special token is never JSON text)
    text = tok(json.dumps({"fmt": value}, separators=(",", ":")), add_special_tokens=False,
               split_special_tokens=True)["input_ids"]
    assert 151645 not in text and all(matcher.accept_token(t) for t in text)
    assert matcher.accept_token(factory.config.stop_token_ids[0])


# --- JSON whitespace modes ---------------------------------------------------------------------

_WS_SCHEMA = {"type": "object", "properties": {
    "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}},
    "c": {"type": "string"}}, "required": ["a", "b"]}

# text -> accepted under ("any", "compact", "bounded" with json_max_whitespace=3)
WHITESPACE_TABLE = [
    ('{"a":1,"b":[1,2]}', (True, True, True)),
    ('{"a": 1, "b": [1, 2]}', (True, False, True)),
    ('{ "a" : 1 , "b" : [ 1 , 2 ] }', (True, False, True)),
    ('{\n  "a": 1,\n  "b": [1,2]\n}', (True, False, True)),
    ('{"a":1,\r\n"b":[1]}', (True, False, True)),
    ('{"a":1,\t"b":[1]}', (True, False, True)),
    ('{"a":1,   "b":[1]}', (True, False, True)),
    ('{"a":1,    "b":[1]}', (True, False, False)),
    ('{"a":1,"b":[1],"c":"x    y"}', (True, True, True)),
    (' {"a":1,"b":[1]}', (False, False, False)),
    ('{"a":1,"b":[1]} ', (False, False, False)),
]
# GuideType.JSON: a JSON object or array, the same modes
JSON_VALUE_TABLE = [
    ('{"a":1,"b":2}', (True, True, True)),
    ('{"a": 1}', (True, False, True)),
    ('[1,   {"x":"y"}]', (True, False, True)),
    ('[1,    2]', (True, False, False)),
    ('{"s":"s p a c e s"}', (True, True, True)),
    ("1", (False, False, False)),
    ('"s"', (False, False, False)),
]
MODES = ("any", "compact", "bounded")


@pytest.fixture(scope="module")
def whitespace_factories(tokenizer_cache):
    """Factories by (backend, whitespace mode) over Tekken, ``json_max_whitespace=3``."""
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory

    built: dict = {}

    def get(backend: str, mode: str):
        if (backend, mode) not in built:
            config = GuidedDecodingConfig.from_tokenizer(
                tokenizer_cache("tekken"), backend=backend, json_whitespace=mode,
                json_max_whitespace=3)
            built[backend, mode] = create_matcher_factory(config)
        return built[backend, mode]
    yield get
    for factory in built.values():
        factory.close()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
def test_json_whitespace_modes_accept_and_refuse_the_same_texts(whitespace_factories,
                                                                tokenizer_cache, backend, mode):
    """``json_whitespace`` means the same on both backends, for JSON-schema and JSON guides:
    "any" takes any whitespace between tokens, "compact" none (minified JSON is accepted,
    ``", "`` refused), "bounded" at most ``json_max_whitespace`` whitespace characters in a
    row; whitespace inside strings is text, and none is allowed around the whole value. A
    JSON guide is an object or array in every mode."""
    tok = tokenizer_cache("tekken")
    factory = whitespace_factories(backend, mode)
    column = MODES.index(mode)
    for params, table in ((GuidedDecodingParams.json_schema(_WS_SCHEMA), WHITESPACE_TABLE),
                          (GuidedDecodingParams.json(), JSON_VALUE_TABLE)):
        got = {text: accepts(factory, tok, params, text) for text, _ in table}
        want = {text: expected[column] for text, expected in table}
        assert got == want, params.guide_type


@pytest.mark.parametrize("backend", BACKENDS)
def test_compact_json_masks_whitespace_after_separators(whitespace_factories, tokenizer_cache,
                                                        backend):
    """In "compact" mode the mask itself (not only accept_token) refuses a space after
    ``,`` and ``:``; in "any" mode it allows it."""
    tok = tokenizer_cache("tekken")
    space = encode_continuation(tok, " ")[0]
    params = GuidedDecodingParams.json_schema(_WS_SCHEMA)
    for prefix in ('{"a":', '{"a":1,'):
        compact = whitespace_factories(backend, "compact")
        anyws = whitespace_factories(backend, "any")
        assert space not in allowed_ids(compact, force(compact, tok, params, prefix))
        assert space in allowed_ids(anyws, force(anyws, tok, params, prefix))


@pytest.mark.parametrize("kwargs, field", [
    ({"json_whitespace": "pretty"}, "json_whitespace='pretty'"),
    ({"json_whitespace": None}, "json_whitespace=None"),
    ({"json_max_whitespace": 0}, "json_max_whitespace=0"),
    ({"json_max_whitespace": True}, "json_max_whitespace=True"),
    ({"json_max_whitespace": "4"}, "json_max_whitespace='4'"),
    ({"json_max_whitespace": 257}, "json_max_whitespace=257"),
])
def test_json_whitespace_config_errors_name_the_field(tekken, kwargs, field):
    """A bad whitespace mode or limit is a ConfigError naming the field and the value."""
    from capgraph import ConfigError, GuidedDecodingConfig

    with pytest.raises(ConfigError, match=f"GuidedDecodingConfig.{field}"):
        GuidedDecodingConfig.from_tokenizer(tekken, **kwargs)


# --- regex classes: ECMA-262 on both backends ---------------------------------------------------

# (pattern, text, matches under ECMA-262): \d and \w are ASCII, \s is Unicode whitespace
REGEX_TABLE = [
    (r"\d+", "134", True), (r"\d+", "1३4", False), (r"\d+", "١٢", False),
    (r"[\d]+", "134", True), (r"[\d]+", "1३4", False),
    (r"\D+", "ab३", True), (r"\D+", "a1", False), (r"[^\d]+", "३", True),
    (r"[a\D]+", "a३", True), (r"[a\D]+", "a1", False),
    (r"\w+", "ab_1", True), (r"\w+", "é", False), (r"[\w-]+", "a-ж", False),
    (r"\W+", "é-ж", True), (r"\W+", "_", False),
    (r"\s+", " \t\u00a0\u2003", True), (r"\S+", "a\u00a0", False),
    (r"\\d", "\\d", True), (r"\\d", "1", False),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_classes_follow_ecma262(factory_cache, tokenizer_cache, backend):
    """REGEX guides read ``\\d``/``\\D``/``\\w``/``\\W`` as ECMA-262's ASCII classes, inside and
    outside character classes, and ``\\s`` as Unicode whitespace, on both backends: ``1३4`` is
    refused by ``\\d+``, ``134`` accepted; an escaped backslash stays a backslash."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    got = [(p, t, accepts(factory, tok, GuidedDecodingParams.regex(p), t))
           for p, t, _ in REGEX_TABLE]
    assert got == REGEX_TABLE


@pytest.mark.parametrize("backend", BACKENDS)
def test_json_schema_patterns_follow_ecma262(factory_cache, tokenizer_cache, backend):
    """A JSON-schema ``pattern`` (here under a property named ``pattern``, next to an ``enum``
    whose data is left alone) reads ``\\d`` as ASCII on both backends."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    schema = {"type": "object", "properties": {
        "pattern": {"type": "string", "pattern": "^\\d+$"},
        "w": {"type": "string", "pattern": "^\\w+$"}}, "required": ["pattern", "w"]}
    params = GuidedDecodingParams.json_schema(schema)
    assert accepts(factory, tok, params, '{"pattern": "134", "w": "a_1"}')
    assert not accepts(factory, tok, params, '{"pattern": "1३4", "w": "a"}')
    assert not accepts(factory, tok, params, '{"pattern": "1", "w": "é"}')


@pytest.mark.parametrize("pattern, rewritten", [
    (r"\d+", "[0-9]+"), (r"[\d]", "[0-9]"), (r"[^\w]", "[^0-9A-Za-z_]"),
    (r"[a\D]", "[a[^0-9]]"), (r"\W", "[^0-9A-Za-z_]"), (r"\\d", r"\x{5C}d"),
    (r"\x41", r"A"),
])
def test_ascii_classes_rewrites_only_class_escapes(pattern, rewritten):
    """The llguidance rewrite spells ``\\d \\D \\w \\W`` as ASCII classes (a class nests the
    negated ones) and an escaped character as the character (its ``\\x{..}`` escape where
    Rust's syntax gives it a meaning); a backslash that ends the pattern is refused."""
    from capgraph.grammar.semantics import ascii_classes

    assert ascii_classes(pattern) == rewritten
    with pytest.raises(UnsupportedGuideError, match="lone backslash"):
        ascii_classes(pattern + "\\")


def test_schema_rewrite_leaves_data_and_names_alone():
    """Patterns inside ``enum``/``const`` data and property names are not schema patterns."""
    from capgraph.grammar.semantics import ascii_schema_patterns

    schema = {"properties": {"enum": {"pattern": "\\d"}},
              "enum": [{"pattern": "\\d"}], "patternProperties": {"^\\w$": {}}}
    out = json.loads(ascii_schema_patterns(json.dumps(schema)))
    assert out == {"properties": {"enum": {"pattern": "[0-9]"}},
                   "enum": [{"pattern": "\\d"}], "patternProperties": {"^[0-9A-Za-z_]$": {}}}


def test_schema_rewrite_reaches_draft07_dependencies():
    """A ``pattern`` inside a draft-07 ``dependencies`` schema is rewritten to ASCII classes
    too, whatever the property it depends on is called (even a keyword's name, like
    ``enum``); a list of names under ``dependencies`` stays as it is."""
    from capgraph.grammar.semantics import ascii_schema_patterns

    schema = {"type": "object", "dependencies": {
        "enum": {"properties": {"code": {"type": "string", "pattern": "^\\d+$"}}},
        "a": ["b", "c"]}}
    rewritten = json.loads(ascii_schema_patterns(json.dumps(schema)))
    pattern = rewritten["dependencies"]["enum"]["properties"]["code"]["pattern"]
    assert "\\d" not in pattern and "0-9" in pattern
    assert rewritten["dependencies"]["a"] == ["b", "c"]


# (schema, instance, accepted) under the strict reading both backends share: properties and
# items a schema lists some of are the only ones; a bare object or array allows anything; a
# schema that requires a property it does not list means JSON Schema's default
UNLISTED_TABLE = [
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1}', True),
    ({"type": "object", "properties": {"a": {"type": "integer"}}}, '{"a": 1, "b": 2}', False),
    ({"type": "object", "properties": {}}, "{}", True),
    ({"type": "object", "properties": {}}, '{"b": 2}', False),
    ({"type": "object"}, '{"b": 2}', True),
    ({"type": "object", "additionalProperties": True}, '{"a": 1, "b": 2}', True),
    ({"type": "object", "properties": {"o": {"type": "object", "properties": {"x": {}}}}},
     '{"o": {"x": 1, "y": 2}}', False),
    ({"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}},
                {"type": "string"}]}, '{"a": 1, "z": 0}', False),
    ({"$defs": {"P": {"type": "object", "properties": {"a": {"type": "integer"}}}},
      "$ref": "#/$defs/P"}, '{"a": 1, "z": 0}', False),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1]", True),
    ({"type": "array", "prefixItems": [{"type": "integer"}]}, "[1, 2]", False),
    ({"type": "array"}, "[1, 2]", True),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_unlisted_properties_and_items_are_absent_on_both_backends(factory_cache,
                                                                   tokenizer_cache, backend):
    """A schema that lists properties (or tuple items) allows no others, on llguidance as on
    xgrammar (whose strict reading it is); a bare object or array, or an explicit
    ``additionalProperties: true``, allows them on both."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    got = [(s, t, accepts(factory, tok, GuidedDecodingParams.json_schema(s), t))
           for s, t, _ in UNLISTED_TABLE]
    assert got == UNLISTED_TABLE


@pytest.mark.skipif(not llg_available(), reason="the llguidance extra is not installed")
def test_explicit_additional_properties_next_to_listed_ones(factory_cache, tokenizer_cache):
    """``additionalProperties: true`` next to listed properties allows others on xgrammar
    (whose additional names take no escape, so none spells a listed one); llguidance, which
    would let ``"\\u0061"`` pass for a listed ``"a"``, refuses the schema, naming it."""
    tok = tokenizer_cache("tekken")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}},
              "additionalProperties": True}
    params = GuidedDecodingParams.json_schema(schema)
    assert accepts(factory_cache("tekken", "xgrammar"), tok, params, '{"a": 1, "b": 2}')
    assert not accepts(factory_cache("tekken", "xgrammar"), tok, params, '{"\\u0061": "x"}')
    with pytest.raises(UnsupportedGuideError, match="'properties' at /"):
        factory_cache("tekken", "llguidance").compile(params)


def test_llguidance_schema_writes_out_only_describing_defaults():
    """The rewrite adds ``additionalProperties``/``items``/``additionalItems: false`` where the
    schema describes the instance and leaves conditions, ``allOf`` branches, data, explicit
    values and a requirement of an unlisted property as written."""
    from capgraph.grammar.semantics import llguidance_schema

    def rewrite(schema):
        return json.loads(llguidance_schema(json.dumps(schema)))

    props = {"a": {}}
    assert rewrite({"properties": props}) == {"properties": props,
                                               "additionalProperties": False}
    assert rewrite({"properties": props, "unevaluatedProperties": True}) == \
        {"properties": props, "unevaluatedProperties": True}
    assert rewrite({"items": [{}]}) == {"items": [{}], "additionalItems": False}
    assert rewrite({"prefixItems": [{}], "items": {}}) == {"prefixItems": [{}], "items": {}}
    assert rewrite({"prefixItems": [{}]}) == {"prefixItems": [{}], "items": False}
    # prefixItems is no keyword before 2020-12: it lists nothing there, so nothing is closed
    # (draft-07's list-form items still is)
    for draft in ("http://json-schema.org/draft-07/schema#",
                  "https://json-schema.org/draft/2019-09/schema"):
        assert rewrite({"$schema": draft, "prefixItems": [{}]}) == \
            {"$schema": draft, "prefixItems": [{}]}
        assert rewrite({"$schema": draft, "prefixItems": [{}], "items": [{}]}) == \
            {"$schema": draft, "prefixItems": [{}], "items": [{}], "additionalItems": False}
    draft = "https://json-schema.org/draft/2020-12/schema"
    assert rewrite({"$schema": draft, "prefixItems": [{}]}) == \
        {"$schema": draft, "prefixItems": [{}], "items": False}
    for condition in ("not", "if", "contains", "propertyNames"):
        assert rewrite({condition: {"properties": props}}) == {condition: {"properties": props}}
    both = {"allOf": [{"properties": props}, {"properties": {"b": {}}}]}
    assert rewrite(both) == both
    assert rewrite({"enum": [{"properties": {}}]}) == {"enum": [{"properties": {}}]}
    assert rewrite({"properties": props, "required": ["b"]}) == \
        {"properties": props, "required": ["b"]}
    assert rewrite({"patternProperties": {"^x": {}}, "required": ["xy"]}) == \
        {"patternProperties": {"^x": {}}, "required": ["xy"], "additionalProperties": False}
    # a property called "properties" is a name, its schema still gets the default
    assert rewrite({"properties": {"properties": {"properties": props}}}) == {
        "properties": {"properties": {"properties": props, "additionalProperties": False}},
        "additionalProperties": False}


# --- Lark regex literals -----------------------------------------------------------------------

def lark_guide(backend: str, grammar: str) -> GuidedDecodingParams:
    """A Lark grammar as each backend takes it: an EBNF guide on llguidance, a structural tag's
    Lark ``grammar`` element on xgrammar."""
    if backend == "llguidance":
        return GuidedDecodingParams.ebnf(grammar)
    return GuidedDecodingParams.structural_tag(json.dumps({
        "type": "structural_tag",
        "format": {"type": "grammar", "grammar": grammar, "syntax": "lark"}}))


# (grammar, text, accepted) where both backends serve the grammar: what Lark means.
LARK_TABLE = [
    ("start: /[^a-c]+/i", "dD", True), ("start: /[^a-c]+/i", "B", False),
    ('start: /[^"]+/i', "x!", True),
    ("start: /[kσ]+/i", "kK", True),  # (xgrammar narrower: its ASCII folding refuses 'Σ')
    ("start: /\\d+/", "12", True), ("start: /[^\\W]+/", "ab", True),
    ("start: /[^\\D]+/", "12", True), ("start: /[\\s]+/", " \t", True),
]
# (grammar, text outside its language): xgrammar would read these wider than Lark.
LARK_WIDER_ON_XGRAMMAR = [
    ("start: /[^kσ]+/i", "\u212a"),  # KELVIN SIGN: a case variant of k
    ("start: /[^kσ]+/i", "Σ"),
    ("start: /[^a-z]+/i", "\u017f"),  # LONG S: a case variant of s
    ("start: /\\W+/", "é"),
    ("start: /a\\D/", "a\u0661"),  # ARABIC-INDIC DIGIT ONE
    ("start: /[^\\s]+/", "\u0085"),
    ("start: /[\\S]+/", "\u0085"),
    ("start: A\nA: /[^\\w]/", "ж"),
    ("start: /[[:digit:]]+/", "d]"), ("start: /[a-c--b]/", "b"),  # Rust's class syntax
    # ... beside a \s, which lark_spaces leaves for this refusal (Rust: White_Space but "\n")
    ("start: /[\\s--\\n]+/", "-"), ("start: /[\\s&&[^\\n]]+/", "&]"),
    ("start: /[[\\s]]/", "[]"), ("start: /[\\s~~a]/", "~"),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_lark_regex_literals_mean_the_same_on_both_backends(factory_cache, tokenizer_cache,
                                                           backend):
    """Lark regex literals xgrammar reads as Lark does compile and match alike on both
    backends."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    got = [(g, t, accepts(factory, tok, lark_guide(backend, g), t)) for g, t, _ in LARK_TABLE]
    assert got == LARK_TABLE


# (grammar, text, accepted): a Lark regex's positive \s is Unicode White_Space on both backends
LARK_WHITE_SPACE = [
    ("start: /\\s+/", " \t\u3000", True), ("start: /\\s+/", "\u0085", True),
    ("start: /\\s+/", "\ufeff", False),  # (no White_Space character; ECMA's \s takes it)
    ("start: /[a\\s]+/", "a\u2028a", True), ("start: /[a\\s]+/", "a\ufeff", False),
    ("start: /x\\s?y/", "x\u00a0y", True), ("start: /x\\s?y/", "x\ufeffy", False),
    ("start: /[\\d\\s-]+/", "1-\u0085", True), ("start: /[\\d\\s-]+/", "1\ufeff", False),
    # a negated class of \S: the spaces it leaves
    ("start: /[^\\S\\n]+/", " \u0085\t", True), ("start: /[^\\S\\n]+/", " \ufeff", False),
    ("start: /[^\\S\\n]+/", " \n", False), ("start: /[^\\S]+/", "\ufeff", False),
    # a "/" beside a \s in a class (the class written out keeps it escaped in the literal)
    ("start: /[\\s\\/]+/", "/ \u3000/", True), ("start: /[\\s\\/]+/", "/\ufeff", False),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_lark_regex_white_space_is_unicode_white_space(factory_cache, tokenizer_cache,
                                                         backend):
    """A positive ``\\s`` in a Lark regex is Unicode White_Space on both backends:
    xgrammar, whose ECMA ``\\s`` takes U+FEFF and not U+0085, is given the characters
    written out."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    got = [(g, t, accepts(factory, tok, lark_guide(backend, g), t))
           for g, t, _ in LARK_WHITE_SPACE]
    assert got == LARK_WHITE_SPACE


@pytest.mark.parametrize("grammar, text", LARK_WIDER_ON_XGRAMMAR)
def test_lark_regex_xgrammar_reads_wider_is_refused_on_xgrammar(factory_cache, tokenizer_cache,
                                                                grammar, text):
    """A Lark regex literal xgrammar would read wider than Lark (ASCII ``\\d``/``\\w``/``\\s``
    under a negation, ASCII-only case folding in a negated class) is refused on xgrammar by
    name, with the literal and its line; llguidance serves it and refuses the text outside
    it."""
    tok = tokenizer_cache("tekken")
    with pytest.raises(UnsupportedGuideError, match=r"at line \d+ of .* wider than Lark does: "):
        factory_cache("tekken").create(lark_guide("xgrammar", grammar))
    if llg_available():
        assert not accepts(factory_cache("tekken", "llguidance"), tok,
                           lark_guide("llguidance", grammar), text)


@pytest.mark.parametrize("pattern, nocase, wider", [
    ("[^kσ]+", True, "'k' (U+006B)"), ("[^kσ]+", False, None),
    ("[^a-h]", True, None), ("[^a-z]", True, "'i' (U+0069)"), ("[^\\u00e9]", True, "'é'"),
    ("[^\\p{L}]", True, "not read here"), ("[^]k]", True, "'k'"), ("\\[^k]", True, None),
    ("\\\\W", False, None), ("\\W", False, "'\\W' at position 0"), ("[\\S]", False, "'\\S'"),
    ("[^\\d]", False, "'\\d'"), ("[^\\D]", False, None), ("[\\w]", False, None),
    ("[^0-9_-]", True, None), ("[^\\x41-\\x43]", True, None), ("[^\\x{212a}]", True, "U+212A"),
    # Rust's nested, POSIX and set-operation classes and surrogate escapes mean other text on
    # xgrammar; a positive \s is reported (U+FEFF), which lark_spaces writes out before the
    # compile's check sees it, but for a class it cannot write out
    ("\\s+", False, "'\\s' at position 0"), ("[\\d\\s]", False, "holds '\\s'"),
    ("[[:digit:]]+", False, "nests"),
    ("[a-z&&[^x]]", False, "nests"), ("[a-c--b]", False, "set operation"),
    ("\\ud83d\\ude00", False, "surrogate"), ("\\\\ud83d", False, None), ("[\\[]", False, None),
    ("[+\\-]", False, None),
    ("[^\\S\\n]", False, "holds '\\S'"),  # (spaces: reported as a positive \s is)
])
def test_xgrammar_wider_names_the_construct(pattern, nocase, wider):
    """:func:`xgrammar_wider` finds negated shorthands, shorthands a negated class holds, and
    with ``i`` a negated class holding a character with a non-ASCII case variant (ASCII i, k,
    s included); escapes and a leading ``]`` are read as class members, an escaped ``[`` is no
    class."""
    from capgraph.grammar.semantics import xgrammar_wider
    found = xgrammar_wider(pattern, nocase)
    assert (found is None) == (wider is None), found
    if wider:
        assert wider in found


def test_lark_regexes_reads_literals_not_comments_or_strings():
    """:func:`lark_regexes` returns each ``/pattern/flags`` with its line, skipping strings and
    comments that hold slashes."""
    from capgraph.grammar.lark_text import LarkRegex, lark_regexes
    text = 'start: /[^k]+/i "/x/" // /c/\nB: /a\\/b/ # /z/\nC: /q/imsx'
    assert lark_regexes(text) == [LarkRegex("[^k]+", "i", 1), LarkRegex("a\\/b", "", 2),
                                  LarkRegex("q", "imsx", 3)]


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "integer", "not": {"const": 3}}, "not"),
    ({"type": "integer", "if": {"minimum": 5}, "then": {"multipleOf": 2}}, "if"),
    ({"type": "integer", "enum": [1, 2], "minimum": 2}, "enum"),
    ({"type": "object", "properties": {"a": {"type": "integer", "not": {"const": 1}}}}, "not"),
])
def test_lark_json_on_xgrammar_is_judged_like_a_tag_schema(factory_cache, schema, keyword):
    """A ``%json`` schema in a tag's Lark grammar on xgrammar is judged as a schema xgrammar
    converts inside a tag: a keyword xgrammar would drop is refused, named with the
    grammar element, the line of the ``%json`` and the pointer inside the schema."""
    grammar = 'start: "v=" value\nvalue: %json ' + json.dumps(schema)
    with pytest.raises(UnsupportedGuideError, match=(
            rf"'{keyword}' at /format/grammar \(%json at line 2\)")):
        factory_cache("tekken").create(lark_guide("xgrammar", grammar))


@pytest.mark.parametrize("backend", BACKENDS)
def test_lark_json_means_the_same_on_both_backends(factory_cache, tokenizer_cache, backend):
    """A Lark grammar's ``%json`` schemas read as JSON-schema guides do on both backends:
    listed properties only where some are listed, any items where none are, bounds kept."""
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    grammar = ('start: "o=" obj " a=" arr\n'
               'obj: %json {"type": "object", "properties": {"a": {"type": "integer"}}}\n'
               'arr: %json {"type": "array", "maxItems": 2}')
    params = lark_guide(backend, grammar)
    assert accepts(factory, tok, params, 'o={"a": 1} a=["x", 2]')
    assert not accepts(factory, tok, params, 'o={"a": 1, "b": 2} a=[]')
    assert not accepts(factory, tok, params, 'o={"a": "1"} a=[]')
    assert not accepts(factory, tok, params, 'o={} a=[1, 2, 3]')


# --- UTF-8 -------------------------------------------------------------------------------------

def _byte_token_ids(tok) -> dict[int, int]:
    """The id of the token whose text is the one byte ``b``, for every byte that has one."""
    import xgrammar as xgr
    vocab = xgr.TokenizerInfo.from_huggingface(tok).decoded_vocab
    return {v[0]: i for i, v in enumerate(vocab) if len(v) == 1}


UTF8_CASES = [  # (guide, bytes that are not UTF-8, each of them a token)
    (GuidedDecodingParams.regex("."), b"\xed\xa0\x80"),  # a surrogate's encoding
    (GuidedDecodingParams.regex("."), b"\xe0\x80\x80"),  # an overlong form
    (GuidedDecodingParams.json_schema({"type": "string", "maxLength": 1}), b'"\xed\xa0\x80"'),
]
UTF8_BUILDS = [("xgrammar", "auto"), ("xgrammar", "off"),
               pytest.param("llguidance", "off", marks=needs_llg)]


@pytest.mark.parametrize("backend, native_build", UTF8_BUILDS)
@pytest.mark.parametrize("params, data", UTF8_CASES)
def test_masks_never_spell_bytes_that_are_not_utf8(factory_cache, tokenizer_cache, backend,
                                                   native_build, params, data):
    """Fed one byte token a step, a guide allowing any character never lets the bytes of a
    sequence that is not UTF-8 through: some byte of it is masked. xgrammar's own masks take
    the encoding of a surrogate where any character is allowed and overlong forms in what it
    builds as one automaton; its matchers' UTF-8 guard (capgraph.grammar.utf8) masks them, on
    the C++ build ("auto") and the Python build ("off") alike."""
    import dataclasses

    from capgraph.decoder import GuidedDecoder
    from capgraph.requests import GuidedRequest
    import torch
    tok = tokenizer_cache("tekken")
    factory = factory_cache("tekken", backend)
    ids = [_byte_token_ids(tok)[b] for b in data]
    config = dataclasses.replace(factory.config, native_build=native_build)
    decoder = GuidedDecoder(config, 1, factory=factory)
    request = GuidedRequest.context(1, 0, params)
    allowed = []
    for token in ids:
        decoder.add_batch([request])
        logits = torch.zeros(1, factory.config.vocab_size_padded)
        assert decoder.execute(logits) == []
        allowed.append(bool(torch.isfinite(logits[0, token])))
        if not allowed[-1]:
            break
        request = GuidedRequest.generation(1, 0, params, token)
    decoder.close()
    assert not all(allowed), f"every byte of {data!r} was allowed"
