"""What the xgrammar backend does so that xgrammar 0.2.9 enforces the guide as written: constructs
it logs and ignores refuse the guide (REGEX, EBNF, JSON schema, structural tag), additional
property names admit no escape, and array / object schemas that list no items / properties
allow any."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time

import pytest
import xgrammar as xgr

from capgraph import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from capgraph.errors import GrammarCompileError, UnsupportedGuideError
from capgraph.grammar import create_matcher_factory
from capgraph.grammar.converter_log import captured, converter_warnings, exclusive
from capgraph.grammar.semantics import ebnf_escape, ecma_regex, xgrammar_schema
from capgraph.grammar import xgrammar_backend
from capgraph.grammar.xgrammar_backend import (GrammarShapeError, _repair_property_keys,
                                               _repaired, json_whitespace_options)
from cases import accepts

P = GuidedDecodingParams




# --- constructs xgrammar ignores ---------------------------------------------------------------

def test_converter_warnings_reads_the_regex_and_automaton_builders_lines(capfd):
    """Warnings of the regex reader, the automaton builder, the tag and Lark converters are
    read (each once); other xgrammar warnings and other text are not, and all reach stderr."""
    lines = [
        "[1] /p/cpp/regex_converter.cc:100: Warning: Regex parsing warning at position 2: '$'",
        "[1] /p/cpp/fsm_builder.cc:554: Warning: Escape sequence \\A is not recognized",
        "[1] /p/cpp/fsm_builder.cc:554: Warning: Escape sequence \\A is not recognized",
        "[1] /p/cpp/structural_tag.cc:1478: Warning: Repeat max is too large",
        "[1] /p/cpp/lark_converter.cc:1349: Warning: Ignoring max_chars on rule 'a'",
        "[1] /p/cpp/grammar_matcher.cc:1211: Warning: The token id 5 is out of range",
        "[1] /p/cpp/my_fsm_builder.cc:1: Warning: not xgrammar's",
    ]
    with converter_warnings() as warned:
        os.write(2, "\n".join(lines).encode() + b"\n")
    assert warned == ["Regex parsing warning at position 2: '$'",
                      "Escape sequence \\A is not recognized", "Repeat max is too large",
                      "Ignoring max_chars on rule 'a'"]
    assert "out of range" in capfd.readouterr().err


_WARN_LINE = b"[1] /p/cpp/json_schema_converter.cc:1: Warning: dropped %s\n"


def test_a_slow_conversion_does_not_hold_back_another():
    """Conversions capture at the same time: a quick one finishes while a slow one (a
    500-deep schema converts for ~10 s) is still inside its capture. (With one lock around
    every capture the quick one waited for the slow one to end: here, for 30 s.)"""
    release = threading.Event()
    results = {}

    def slow():
        results["slow"] = captured(lambda: release.wait(30))

    thread = threading.Thread(target=slow)
    thread.start()
    time.sleep(0.2)  # (the slow conversion is inside its capture)
    start = time.perf_counter()
    results["quick"] = captured(lambda: "grammar")
    quick_s = time.perf_counter() - start
    release.set()
    thread.join(35)
    assert results["quick"] == ("grammar", []) and quick_s < 10
    assert results["slow"] == (True, [])


def test_overlapping_conversions_keep_their_own_warnings(capfd):
    """A warning written while two conversions overlap is not read as the other's: the one
    that did not log it is converted again and gets none; the one that did gets its own."""
    b_inside, a_wrote = threading.Event(), threading.Event()
    b_calls = []
    a_calls = []
    results = {}

    def convert_a():
        a_calls.append(1)
        if len(a_calls) == 1:
            assert b_inside.wait(10)
            os.write(2, _WARN_LINE % b"a")
            a_wrote.set()
            time.sleep(0.3)  # (B's retry runs while A is still inside)
        else:
            os.write(2, _WARN_LINE % b"a")
        return "A"

    def convert_b():
        b_calls.append(1)
        if len(b_calls) == 1:
            b_inside.set()
            assert a_wrote.wait(10)
        return "B"

    thread = threading.Thread(target=lambda: results.setdefault("a", captured(convert_a)))
    thread.start()
    time.sleep(0.1)
    results["b"] = captured(convert_b)
    thread.join(20)
    assert results["b"] == ("B", []) and len(b_calls) == 2
    assert results["a"] == ("A", ["dropped a"])
    assert "dropped a" in capfd.readouterr().err


def test_exclusive_marks_an_overlapping_capture_ambiguous():
    """A compile that logs warnings again (``exclusive()``) does not block a capture; a
    capture alongside it that sees warnings knows they may not be its own."""
    with exclusive():
        with converter_warnings() as warned:
            os.write(2, _WARN_LINE % b"x")
    assert warned == ["dropped x"] and warned.ambiguous
    with converter_warnings() as alone:
        os.write(2, _WARN_LINE % b"y")
    assert alone == ["dropped y"] and not alone.ambiguous


IGNORED_REGEXES = [
    ("a$b", "Anchor '$' in the middle of regex is ignored", "ab"),
    ("x^a", "Anchor '^' in the middle of regex is ignored", "xa"),
    # (refused by capgraph's ECMA-262 scan before xgrammar's converter sees it)
    ("\\Aab", "regex escape '\\A' (ECMA-262 reads it as a plain 'A')", "Aab"),
]


@pytest.mark.parametrize("regex,reported,_", IGNORED_REGEXES)
@pytest.mark.parametrize("policy", ["error", "ignore"])
def test_regex_with_an_ignored_construct_is_refused(xg, xg_ignore, regex, reported, _, policy):
    """A REGEX guide with a construct xgrammar ignores (it would accept the text after
    dropping it) is refused, naming it, whatever json_unenforced_keywords says."""
    factory = xg if policy == "error" else xg_ignore
    with pytest.raises(UnsupportedGuideError) as info:
        factory.compile(P.regex(regex))
    assert info.value.guide_type == "REGEX" and info.value.backend == "xgrammar"
    assert reported in str(info.value)
    assert "rewrite that construct" in str(info.value) or "ECMA-262" in str(info.value)


@pytest.mark.parametrize("regex,_,dropped", IGNORED_REGEXES)
def test_xgrammar_alone_accepts_what_the_ignored_regex_construct_forbids(regex, _, dropped):
    """What the refusal prevents: xgrammar's own grammar accepts the text it should not."""
    from xgrammar.testing import _is_grammar_accept_string
    with converter_warnings():
        grammar = xgr.Grammar.from_regex(regex)
    assert _is_grammar_accept_string(grammar, dropped)


@pytest.mark.parametrize("ebnf,reported", [
    ('root ::= "x" Regex("a$b")', "Anchor '$' in the middle of regex is ignored"),
    ('root ::= Regex("(?!a)[a-z]")', "Lookahead assertion is not supported and is ignored"),
])
@pytest.mark.parametrize("policy", ["error", "ignore"])
def test_ebnf_with_an_ignored_regex_construct_is_refused(xg, xg_ignore, ebnf, reported, policy):
    """An EBNF guide whose Regex(...) has a construct xgrammar ignores is refused (xgrammar
    logs it only when it builds the automaton, which the conversion now does)."""
    factory = xg if policy == "error" else xg_ignore
    with pytest.raises(UnsupportedGuideError) as info:
        factory.compile(P.ebnf(ebnf))
    assert info.value.guide_type == "EBNF_GRAMMAR" and reported in str(info.value)


@pytest.mark.parametrize("pattern,dropped", [
    ("^(?!a).*$", "a"), ("a$b", "ab"), ("x^a", "xa")])
def test_schema_pattern_with_an_ignored_construct_is_refused(xg, xg_ignore, tekken, pattern,
                                                             dropped):
    """A schema pattern xgrammar would read without its anchor / lookahead is refused; with
    json_unenforced_keywords="ignore" it compiles, without that construct."""
    params = P.json_schema({"type": "string", "pattern": pattern})
    with pytest.raises(UnsupportedGuideError, match="xgrammar reported"):
        xg.compile(params)
    assert accepts(xg_ignore, tekken, params, json.dumps(dropped))


def test_schema_pattern_with_a_non_ecma_escape_is_refused_before_xgrammar(xg, xg_ignore):
    """An escape ECMA-262 reads as a plain letter (``\\A``) is refused by capgraph's own
    scan of the pattern, whatever json_unenforced_keywords says (xgrammar would drop it)."""
    params = P.json_schema({"type": "string", "pattern": "\\Aa"})
    for factory in (xg, xg_ignore):
        with pytest.raises(UnsupportedGuideError, match="ECMA-262 reads it as a plain 'A'"):
            factory.compile(params)


@pytest.mark.parametrize("fmt,reported", [
    ({"type": "regex", "pattern": "a$b"}, "Anchor '$' in the middle of regex is ignored"),
    ({"type": "repeat", "min": 0, "max": 3_000_000_000,
      "content": {"type": "const_string", "value": "a"}}, "repetition count 3000000000"),
])
def test_structural_tag_with_an_ignored_part_is_refused(xg, fmt, reported):
    """A structural tag whose regex xgrammar changes is refused (as a tag), and one whose
    repeat count xgrammar would wrap is refused by the count limit before xgrammar sees it."""
    with pytest.raises(UnsupportedGuideError) as info:
        xg.compile(P.structural_tag(json.dumps({"type": "structural_tag", "format": fmt})))
    assert info.value.guide_type == "STRUCTURAL_TAG" and reported in str(info.value)


def test_a_tag_regex_elements_lookahead_is_refused_whatever_the_policy(xg, xg_ignore):
    """A tag's regex element is checked as it is compiled (its automaton, which drops a
    lookahead with a warning), so ``json_unenforced_keywords="ignore"`` does not let the
    dropped lookahead through either, as for a REGEX guide (checked with the rules' reader,
    which raises on it, the element passed the check and then compiled without it)."""
    tag = json.dumps({"type": "structural_tag",
                      "format": {"type": "regex", "pattern": "(?!a)[a-z]"}})
    for factory in (xg, xg_ignore):
        with pytest.raises(UnsupportedGuideError, match="Lookahead"):
            factory.compile(P.structural_tag(tag))
        with pytest.raises(UnsupportedGuideError, match="Lookahead"):
            factory.compile(P.regex("(?!a)[a-z]"))


@pytest.mark.parametrize("regex,good,bad", [
    ("^\\d{3}-\\d{4}$", "123-4567", "1234567"),
    ("(foo|bar)*baz", "foobarbaz", "foobaz!"),
    ("[a-z]+@[a-z]+\\.com", "a@b.com", "a@b.org"),
])
def test_regex_guides_compile_as_xgrammar_compiles_them(xg, tekken, regex, good, bad):
    """Converting first (the regex as ECMA-262 reads it, as one automaton, built inside the
    capture), then compiling, gives exactly what xgrammar's compile of a grammar whose root is
    that ``Regex(...)`` gives; the guide is enforced."""
    compiler = xgr.GrammarCompiler(xg.tokenizer_info, cache_enabled=False)
    ours = xg.compile(P.regex(regex)).payload.serialize_json()
    root = f'root ::= Regex("{ebnf_escape(ecma_regex(regex, "xgrammar"))}")'
    assert ours == compiler.compile_grammar(root).serialize_json()
    assert accepts(xg, tekken, P.regex(regex), good)
    assert not accepts(xg, tekken, P.regex(regex), bad)


def test_a_regex_with_a_repeat_too_large_to_unroll_compiles_as_rules(xg, tekken):
    """xgrammar makes '{2,255}' an edge of the automaton whose masks take milliseconds; such a
    REGEX guide is compiled from the rules of Grammar.from_regex (what compile_regex gives)."""
    compiler = xgr.GrammarCompiler(xg.tokenizer_info, cache_enabled=False)
    ours = xg.compile(P.regex("x[a-z]{2,255}")).payload.serialize_json()
    assert ours == compiler.compile_regex("x[a-z]{2,255}").serialize_json()
    assert accepts(xg, tekken, P.regex("x[a-z]{2,255}"), "xab")
    assert not accepts(xg, tekken, P.regex("x[a-z]{2,255}"), "xa")


def test_a_regex_the_automaton_cannot_be_built_for_compiles_as_rules(xg, monkeypatch):
    functor = xgr.testing.GrammarFunctor

    def refuse(grammar):
        raise RuntimeError("the automaton's reader refuses it")
    monkeypatch.setattr(functor, "fsm_builder", refuse)
    from capgraph.grammar.xgrammar_backend import _regex_grammar
    assert str(_regex_grammar("ab+")) == str(xgr.Grammar.from_regex("ab+"))


@pytest.mark.parametrize("ebnf,good,bad", [
    ('root ::= "a" [b-z]* "x"', "abcx", "abc"),
    ('root ::= [a-z]+ Regex("[0-9]+")', "ab12", "ab"),
])
def test_ebnf_guides_compile_as_xgrammar_compiles_them(xg, tekken, ebnf, good, bad):
    """Parsing first (from_ebnf and the automata, inside the capture), then compiling, gives
    exactly what xgrammar's compile_grammar of the text gives; the guide is enforced."""
    compiler = xgr.GrammarCompiler(xg.tokenizer_info, cache_enabled=False)
    ours = xg.compile(P.ebnf(ebnf)).payload.serialize_json()
    assert ours == compiler.compile_grammar(ebnf).serialize_json()
    assert accepts(xg, tekken, P.ebnf(ebnf), good)
    assert not accepts(xg, tekken, P.ebnf(ebnf), bad)


def test_worker_processes_refuse_ignored_constructs_too(tokenizer_cache):
    """compile_isolation="process": an EBNF guide (always compiled in a worker) with an
    ignored construct arrives refused, with its type; a clean one compiles."""
    tok = tokenizer_cache("mistral-sp32k")  # (the smaller vocabulary: a faster worker start)
    config = GuidedDecodingConfig.from_tokenizer(tok, compile_isolation="process",
                                                 compile_threads=1)
    factory = create_matcher_factory(config)
    try:
        with pytest.raises(UnsupportedGuideError) as info:
            factory.compile(P.ebnf('root ::= "w" Regex("a$b")'))
        assert info.value.guide_type == "EBNF_GRAMMAR"
        assert "Anchor '$' in the middle" in str(info.value)
        assert accepts(factory, tok, P.ebnf('root ::= "w" Regex("[a-c]+")'), "wab")
        assert factory.processes is not None and factory.processes.stats.spawned == 1
    finally:
        factory.close()


# --- additional property names -----------------------------------------------------------------

_LISTED = {"a": {"type": "integer"}}


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": _LISTED, "additionalProperties": {"type": "string"}},
    {"type": "object", "properties": _LISTED, "additionalProperties": True},
    {"type": "object", "properties": _LISTED, "unevaluatedProperties": {"type": "string"}},
], ids=["additional-schema", "additional-true", "unevaluated-schema"])
def test_a_listed_name_written_with_an_escape_is_not_an_additional_one(xg, tekken, schema):
    """{"\\u0061": "x"} is {"a": "x"}: refused (a's value must be an integer); ordinary
    additional names and the listed one are still accepted."""
    params = P.json_schema(schema)
    assert not accepts(xg, tekken, params, '{"\\u0061": "x"}')
    # no additional name admits an escape (one spelling per name), "ax" written so neither
    assert not accepts(xg, tekken, params, '{"a": 1, "\\u0061x": "x"}')
    assert accepts(xg, tekken, params, '{"a": 1, "b": "x"}')
    assert accepts(xg, tekken, params, '{"é": "x", "ab": "x", "": "x"}')
    assert accepts(xg, tekken, params, '{"a": 1}')


def test_a_required_listed_name_cannot_come_again_escaped(xg, tekken):
    schema = {"type": "object", "properties": _LISTED, "required": ["a"],
              "additionalProperties": {"type": "string"}}
    assert not accepts(xg, tekken, P.json_schema(schema), '{"a": 1, "\\u0061": "x"}')
    assert accepts(xg, tekken, P.json_schema(schema), '{"a": 1, "b": "x"}')


def test_nested_objects_get_the_same_names(xg, tekken):
    inner = {"type": "object", "properties": _LISTED, "additionalProperties": {"type": "string"}}
    params = P.json_schema({"type": "object", "properties": {"x": inner}})
    assert not accepts(xg, tekken, params, '{"x": {"\\u0061": "x"}}')
    assert accepts(xg, tekken, params, '{"x": {"a": 1, "c": "x"}}')


def test_listed_names_beyond_ascii_are_left_out_by_their_characters(xg, tekken):
    """xgrammar's byte trie let a listed "é" through as an additional name and refused "Ã"
    (U+00C3, whose code is é's first byte); the character trie does neither."""
    schema = {"type": "object", "properties": {"é": {"type": "integer"},
                                               "😀x": {"type": "null"}},
              "additionalProperties": {"type": "string"}}
    params = P.json_schema(schema)
    assert not accepts(xg, tekken, params, '{"é": "x"}')
    assert not accepts(xg, tekken, params, '{"😀x": "x"}')
    assert accepts(xg, tekken, params, '{"é": 1, "😀x": null}')
    assert accepts(xg, tekken, params, '{"Ã": "x", "ë": "x", "😀": "x", "😀xy": "x"}')


def _key_rules(text: str) -> dict[str, str]:
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\w*_addl_key\w*) ::= (.*)$", text,
                                                        re.MULTILINE)}


@pytest.mark.parametrize("whitespace", ["compact", "any"])
def test_xgrammar_key_rule_shape_is_the_one_repaired(xg, whitespace):
    """Pins xgrammar's output and the repair: xgrammar's name rules let escapes in; the
    repaired ones (and the rest rule they end in) have none, keep the lookahead of
    basic_string_sub, and nothing else changes."""
    schema = json.dumps({"type": "object", "properties": {"a": {}, "b\"c": {}},
                         "additionalProperties": {"type": "string"}})
    config = dataclasses.replace(xg.config, json_whitespace=whitespace)
    text = str(xgr.Grammar.from_json_schema(schema, **json_whitespace_options(config)))
    before = _key_rules(text)
    assert any("basic_escape" in body for body in before.values())  # xgrammar's shape
    repaired = _repair_property_keys(text)
    after = _key_rules(repaired)
    assert after and not any("basic_escape" in b or "basic_string_sub" in b
                             for b in after.values())
    lookahead = re.search(r"^basic_string_sub ::= .*?( \(=.*\))$", text, re.MULTILINE).group(1)
    rest = re.search(r"^capgraph_key_rest ::= (.*)$", repaired, re.MULTILINE).group(1)
    assert rest == f'(("\\"") | ([^\\0-\\x1f\\"\\\\] capgraph_key_rest)){lookahead}'
    assert after["root_addl_key"] == before["root_addl_key"].replace(
        re.search(r'"\\"" (\w+)', before["root_addl_key"]).group(1), "root_addl_key_noesc")
    # listed "a" is left out; "b\"c" needs no exclusion (no escape-free name spells it)
    assert after["root_addl_key_noesc"] == (
        '(("\\"") | ([^\\0-\\x1f\\"\\\\a] capgraph_key_rest) | ("a" root_addl_key_noesc_1))')
    kept = [line for line in text.splitlines() if not re.match(r"\w*_addl_key", line)]
    assert kept == [line for line in repaired.splitlines()
                    if not re.match(r"\w*_addl_key|capgraph_key_rest", line)]
    xgr.Grammar.from_ebnf(repaired)  # reads back


def test_a_key_rule_of_another_shape_fails_loudly():
    """A name rule the repair does not know is an error, never a grammar left unrepaired."""
    text = str(xgr.Grammar.from_json_schema(json.dumps(
        {"type": "object", "properties": {"a": {}}, "additionalProperties": True})))
    with pytest.raises(GrammarShapeError):
        _repair_property_keys(text.replace('("\\\\" basic_escape basic_string_sub)',
                                           '("\\\\" basic_escape basic_string)'))
    with pytest.raises(GrammarShapeError):
        _repair_property_keys(text.replace('root_addl_key ::= (("\\""',
                                           'root_addl_key ::= ((" \\""'))


def test_grammars_without_additional_names_are_left_alone():
    text = str(xgr.Grammar.from_json_schema(json.dumps(
        {"type": "object", "properties": {"a": {}}, "additionalProperties": False})))
    assert _repair_property_keys(text) == text


# --- arrays and objects that list no items / properties ----------------------------------------

@pytest.mark.parametrize("schema,valid,invalid", [
    ({"type": "array", "maxItems": 3}, [[1, 2], []], [[1, 2, 3, 4]]),
    ({"type": "array", "uniqueItems": False}, [[1, 1]], [{"a": 1}]),
    ({"type": "array", "minItems": 0}, [[1, 2]], ["x"]),
    ({"type": "array", "minItems": 1}, [[1, 2]], [[]]),
    ({"type": ["array", "null"], "maxItems": 2}, [[1, 2], None], [[1, 2, 3]]),
    ({"type": "object", "maxProperties": 3}, [{"a": 1}, {}], [{"a": 1, "b": 2, "c": 3, "d": 4}]),
    ({"type": "object", "minProperties": 0}, [{"a": 1}], [[]]),
    ({"type": "object", "required": []}, [{"a": 1}], [1]),
    ({"type": "object", "properties": {"x": {"type": "array", "maxItems": 2}}},
     [{"x": [1, 2]}], [{"x": [1, 2, 3]}]),
    ({"type": "array", "items": {"type": "object", "maxProperties": 1}},
     [[{"a": 1}]], [[{"a": 1, "b": 2}]]),
])
def test_unlisted_items_and_properties_are_allowed_where_none_are_listed(xg, tekken, schema,
                                                                         valid, invalid):
    params = P.json_schema(schema)
    for instance in valid:
        assert accepts(xg, tekken, params, json.dumps(instance)), instance
    for instance in invalid:
        assert not accepts(xg, tekken, params, json.dumps(instance)), instance


@pytest.mark.parametrize("schema", [
    {"type": "array"}, {"type": "object", "title": "t"}, {"type": ["array", "object"]},
    {"maxItems": 3}, {"maxProperties": 3},  # no type: xgrammar reads any value
    {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
    {"type": "array", "prefixItems": [{}], "maxItems": 3},
    {"type": "array", "unevaluatedItems": {"type": "integer"}, "maxItems": 3},
    {"type": "object", "properties": {}, "maxProperties": 3},
    {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 3},
    {"type": "object", "propertyNames": {"maxLength": 2}, "maxProperties": 3},
    {"type": "array", "enum": [[1]], "maxItems": 3},
    {"type": "array", "maxItems": 3, "anyOf": [{"prefixItems": [{}]}]},
    {"type": "string", "maxLength": 3}, True,
])
def test_schemas_xgrammar_already_reads_right_are_given_unchanged(schema):
    text = json.dumps(schema)
    assert xgrammar_schema(text) == text


def test_the_defaults_are_written_at_every_position_and_pointers_stay():
    """items / additionalProperties are added where the position lists none, and nothing else
    changes: every JSON pointer of the schema as written names the same value."""
    schema = {"$defs": {"d": {"type": "object", "maxProperties": 2}},
              "type": ["array", "object"], "minItems": 1,
              "properties": {"x": {"type": "array", "maxItems": 2}},
              "anyOf": [{"type": "array", "uniqueItems": False}],
              "not": {"type": "object", "required": []}}
    out = json.loads(xgrammar_schema(json.dumps(schema)))
    added = [(out["$defs"]["d"], "additionalProperties"), (out["properties"]["x"], "items"),
             (out["anyOf"][0], "items"), (out["not"], "additionalProperties")]
    for node, key in added:
        assert node.pop(key) is True
    assert out == schema  # (the root lists properties and is read with its anyOf: as written)
    assert xgrammar_schema("not json") == "not json"


def test_the_keyword_policy_judges_the_schema_xgrammar_gets(xg):
    """A refusal still names the keyword at its pointer in the schema as written."""
    schema = {"type": "object", "properties": {"x": {"type": "array", "maxItems": 2,
                                                     "not": {"const": 1}}}}
    with pytest.raises(UnsupportedGuideError, match="'not' at /properties/x"):
        xg.compile(P.json_schema(schema))


@pytest.mark.parametrize("schema", [
    # a value the pattern refuses: "\\n" is backslash-n, the pattern takes a newline
    {"type": "string", "enum": ["\\n", "a"], "pattern": "^(a|\n)$"},
    {"type": "string", "const": "\\\"", "pattern": "^\"$"},
    # a listed name the pattern matches, whose schema then applies to it as well
    {"type": "object", "properties": {"\n": {"type": "integer"}},
     "patternProperties": {"^\n$": {"type": "integer", "minimum": 5}}, "required": ["\n"]},
])
def test_the_keyword_policy_reads_patterns_as_written(xg, schema):
    """The policy judges a schema's patterns as they are written, not as they are given to
    xgrammar (there they match JSON text: a newline as its escape), so it sees that a value
    or a listed name meets the pattern and refuses what xgrammar would not enforce (judging
    the rewritten patterns, these compiled and let the violating value through: the text
    backslash-n where a newline is meant, a backslash-quote where a quote is, the listed name
    with a value under the pattern's minimum)."""
    with pytest.raises(UnsupportedGuideError):
        xg.compile(P.json_schema(schema))
    tag = _schema_tag({"type": "object", "properties": {"v": schema}, "required": ["v"]})
    with pytest.raises(UnsupportedGuideError):
        xg.compile(P.structural_tag(tag))


def test_pattern_keys_written_alike_keep_both_schemas():
    """Two patternProperties keys that differ as text but are the same regex once written
    for a backend keep both schemas (as an allOf), for xgrammar and for llguidance: a dict
    of the rewritten keys kept only the last, dropping the first's constraints."""
    from capgraph.grammar.semantics import llguidance_schema, rewritten_keys
    schema = {"type": "object", "patternProperties": {
        "^a$": {"type": "integer"}, "^\\x61$": {"minimum": 3}, "^(?:a)$": {"maximum": 9},
        "^[a]$": {"multipleOf": 2}}}
    for written in (xgrammar_schema(json.dumps(schema)), llguidance_schema(json.dumps(schema))):
        keyed = json.loads(written)["patternProperties"]
        assert keyed["^a$"] == {"allOf": [{"type": "integer"}, {"minimum": 3}]}
        assert keyed["^(?:a)$"] == {"maximum": 9} and keyed["^[a]$"] == {"multipleOf": 2}
    assert rewritten_keys({"x": 1, "X": 2, "y": 3}, str.lower) == {"x": {"allOf": [1, 2]},
                                                                   "y": 3}
    assert rewritten_keys({"x": 1, "X": 2, "x ": 3}, lambda k: k.strip().lower()) == {
        "x": {"allOf": [1, 2, 3]}}


@pytest.mark.parametrize("schema, at", [
    ({"anyOf": []}, "'anyOf' at /"), ({"oneOf": []}, "'oneOf' at /"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]},
     "'anyOf' at /properties/a"),
    ({"$defs": {"e": {"anyOf": []}}, "$ref": "#/$defs/e"}, "'anyOf' at /\\$defs/e"),
])
def test_an_empty_anyof_is_refused(xg, tekken, schema, at):
    """An empty anyOf admits no instance; xgrammar read it as the empty text (``{"a": }``
    passed with the stop token): refused, naming it."""
    with pytest.raises(UnsupportedGuideError, match=f"{at} .*empty"):
        xg.compile(P.json_schema(schema))


def test_a_minitems_array_compiles(xg):
    """{"type": "array", "minItems": 1} was a compile error (xgrammar read "only []")."""
    try:
        xg.compile(P.json_schema({"type": "array", "minItems": 2}))
    except GrammarCompileError as e:  # pragma: no cover - the failure this test guards
        pytest.fail(f"refused: {e}")


# --- repaired grammars are read back as printed -----------------------------------------------

def test_a_repaired_grammar_keeps_its_characters_beyond_ascii(xg, tekken):
    """xgrammar prints 'é' as '\\xe9' and reads '\\xe9a' back as U+0E9A; a repaired schema
    grammar (here: property names made escape-free) keeps its enum value 'éa'."""
    schema = {"type": "object", "properties": {"x": {"enum": ["éa", "\u00ffb"]}},
              "required": ["x"], "additionalProperties": {"type": "integer"}}
    grammar = xgr.Grammar.from_json_schema(schema)
    assert "\\xe9a" in str(grammar)  # what xgrammar prints, and would misread
    repaired = _repaired(grammar)
    assert repaired is not grammar and "\\xe9a" in str(repaired)
    params = P.json_schema(schema)
    assert accepts(xg, tekken, params, '{"x": "éa"}')
    assert accepts(xg, tekken, params, '{"x": "\u00ffb"}')
    assert not accepts(xg, tekken, params, '{"x": "\u0e9a"}')


def test_a_grammar_whose_print_does_not_read_back_is_refused(monkeypatch):
    """A repair is a change of the printed text: where that text would not read back as the
    grammar it was printed for, the guide is refused, not compiled as something else."""
    real = xgrammar_backend._reparsed
    monkeypatch.setattr(xgrammar_backend, "_reparsed",
                        lambda text: real(text.replace("[1-9]", "[1-8]")))
    schema = {"type": "object", "properties": {"x": {"type": "integer"}},
              "additionalProperties": {"type": "integer"}}
    with pytest.raises(GrammarShapeError, match="does not read its printed grammar back"):
        _repaired(xgr.Grammar.from_json_schema(schema))


# --- patterns whose automaton would compute masks token by token -------------------------------

def test_a_pattern_with_a_repeat_xgrammar_would_not_unroll_is_given_as_rules(xg, tekken):
    """'{1,255}' becomes an edge of xgrammar's automaton, whose masks take milliseconds a token;
    such a pattern is given to xgrammar as from_regex's rules, and means the same."""
    schema = {"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[0-9a-z_-]{1,255}$"},
        "code": {"type": "string", "pattern": "^[A-Z]{2,16}$"}}, "required": ["id", "code"]}
    text = str(_repaired(xgr.Grammar.from_json_schema(xgrammar_schema(json.dumps(schema)))))
    assert "capgraph_regex_0 ::=" in text and "{1, 255}" in text
    assert text.count("Regex(") == 1 and "[A-Z]{2,16}" in text  # the small one: an automaton
    params = P.json_schema(schema)
    assert accepts(xg, tekken, params, '{"id": "' + "a" * 255 + '", "code": "AB"}')
    assert accepts(xg, tekken, params, '{"id": "x-1_y", "code": "ABC"}')
    for bad in ('{"id": "", "code": "AB"}', '{"id": "' + "a" * 256 + '", "code": "AB"}',
                '{"id": "A", "code": "AB"}', '{"id": "a", "code": "A"}'):
        assert not accepts(xg, tekken, params, bad), bad


def test_a_pattern_from_regex_cannot_read_keeps_its_automaton():
    """(?!..) is refused by from_regex and ignored by the automaton (which says so, and the
    guide is refused unless unenforced keywords are allowed): the automaton is left in place."""
    from capgraph.grammar.xgrammar_backend import _regexes_as_rules
    grammar = xgr.Grammar.from_json_schema({"type": "string", "pattern": "^(?!a)[a-z]{1,255}$"})
    text = str(grammar)
    assert _regexes_as_rules(text, json_string=True) == text and str(grammar) == text


def test_a_tag_regex_element_compiles_as_the_automaton_where_that_is_faster(xg, tekken):
    """A structural tag's regex element is given to xgrammar as a grammar element holding one
    Regex(...) (an automaton; xgrammar would convert the element to slower rules), except one
    with a repeat xgrammar would make an edge of the automaton; both mean what they did."""
    from capgraph.grammar.xgrammar_backend import _tag_regexes_faster
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "regex", "pattern": r"\w+(\s\w+)*"}, {"type": "const_string", "value": "!"},
        {"type": "regex", "pattern": "[a-z]{2,255}"}]}}
    given = json.loads(_tag_regexes_faster(json.dumps(tag)))["format"]["elements"]
    assert given[0] == {"type": "grammar", "grammar": 'root ::= Regex("\\\\w+(\\\\s\\\\w+)*")'}
    assert given[1:] == tag["format"]["elements"][1:]
    params = P.structural_tag(json.dumps(tag))
    assert accepts(xg, tekken, params, "hello big world!ab")
    assert not accepts(xg, tekken, params, "hello  world!ab")
    assert not accepts(xg, tekken, params, "hello!a")


# --- a structural tag's json_schema elements get the JSON-schema guide's repairs ---------------

def _schema_tag(schema: dict, **element) -> str:
    return json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<t>", "end": "</t>",
        "content": {"type": "json_schema", "json_schema": schema, **element}}})


_TOOL_ARGS = {"type": "object", "properties": {
    "city": {"type": "string", "minLength": 1, "maxLength": 3},
    "code": {"type": "string", "pattern": "^[a-z]{1,255}$"}},
    "required": ["city"], "additionalProperties": {"type": "integer"}}


def test_a_tag_json_schema_element_is_enforced_as_a_json_schema_guide(xg, tekken):
    """A tool call's arguments schema inside a structural tag, with a length-limited string and
    listed names next to additional ones, compiles (it was refused: xgrammar converts the
    element without capgraph's repairs) and is enforced as the same JSON-schema guide is: no
    raw control character in the limited string, no listed name spelled with an escape as an
    additional one, the long pattern's repeat as rules."""
    params = P.structural_tag(_schema_tag(_TOOL_ARGS))
    assert accepts(xg, tekken, params, '<t>{"city": "Osl", "code": "abc", "zip": 5}</t>')
    for bad in ('<t>{"city": "O\x0fs"}</t>',  # a raw control character: not JSON
                '<t>{"city": ""}</t>',  # under minLength
                '<t>{"city": "Oslo"}</t>',  # over maxLength
                '<t>{"city": "Osl", "\\u0063ity": 5}</t>',  # "city" again, escaped
                '<t>{"city": "Osl", "code": "' + "a" * 256 + '"}</t>'):
        assert not accepts(xg, tekken, params, bad), bad
    given = json.loads(xgrammar_backend._tag_schemas_repaired(_schema_tag(_TOOL_ARGS)))
    grammar = given["format"]["content"]["grammar"]
    assert given["format"]["content"]["type"] == "grammar"
    assert "capgraph_key_rest" in grammar and "capgraph_regex_0" in grammar


def test_a_tag_json_schema_element_keeps_its_whitespace_cap(xg, tekken):
    """The element's max_whitespace_cnt holds in the grammar it is given as."""
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 2}},
              "required": ["a"]}
    params = P.structural_tag(_schema_tag(schema, max_whitespace_cnt=1))
    assert accepts(xg, tekken, params, '<t>{"a": "xy"}</t>')
    assert not accepts(xg, tekken, params, '<t>{"a":  "xy"}</t>')


def test_a_tag_json_schema_elements_excludes_hold(xg, tekken):
    """An element with ``excludes`` is left to xgrammar, which enforces them (the repaired
    grammar has no place for them: given as one, a string holding an excluded text passed)."""
    schema = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
    params = P.structural_tag(_schema_tag(schema, excludes=["bad"]))
    assert accepts(xg, tekken, params, '<t>{"a": "ok"}</t>')
    assert not accepts(xg, tekken, params, '<t>{"a": "bad"}</t>')


@pytest.mark.parametrize("element", [{"style": "qwen_xml"}, {"any_order": True},
                                     {"max_whitespace_cnt": 0}, {"excludes": ["x"]},
                                     {"some_later_option": 1}])
def test_other_json_schema_elements_are_left_to_xgrammar(element):
    """An element written otherwise than as plain JSON in the listed order (or ill-formed, for
    xgrammar's error to name) is given to xgrammar as it is."""
    tag = _schema_tag(_TOOL_ARGS, **element)
    assert xgrammar_backend._tag_schemas_repaired(tag) == tag


def test_a_repaired_tag_schema_keeps_its_characters_beyond_ascii(xg, tekken):
    """The grammar text of a repaired element reads back as printed: an enum value 'éa'
    (printed '\\xe9a', which xgrammar would read as U+0E9A) stays 'éa'."""
    schema = {"type": "object", "properties": {"x": {"enum": ["éa"]}}, "required": ["x"],
              "additionalProperties": {"type": "integer"}}
    params = P.structural_tag(_schema_tag(schema))
    assert accepts(xg, tekken, params, '<t>{"x": "éa"}</t>')
    assert not accepts(xg, tekken, params, '<t>{"x": "\u0e9a"}</t>')


def test_a_schema_inside_a_tag_is_not_read_as_tag_elements():
    """The objects of an embedded schema are schemas: one spelled like a tag element (here a
    property schema of an XML-style element, which xgrammar converts itself) is given as
    written, not rewritten as an element."""
    inner = {"type": "json_schema", "json_schema": {"type": "string", "maxLength": 2}}
    tag = _schema_tag({"type": "object", "properties": {"p": inner}}, style="qwen_xml")
    assert xgrammar_backend._tag_schemas_repaired(tag) == tag
    assert xgrammar_backend._tag_regexes_faster(
        _schema_tag({"type": "object", "properties": {
            "p": {"type": "regex", "pattern": "a+"}}}, style="qwen_xml")) == _schema_tag(
        {"type": "object", "properties": {"p": {"type": "regex", "pattern": "a+"}}},
        style="qwen_xml")


# --- a grammar's Regex(...) whose automaton would compute masks token by token ----------------

_SLOW_EBNF = r'root ::= "id=" Regex("[0-9a-z_-]{1,255}") ";" Regex("[A-Z]{2,16}")'


def test_an_ebnf_regex_with_a_repeat_xgrammar_would_not_unroll_is_given_as_rules(xg, tekken):
    """An EBNF guide's Regex("...") whose automaton would have a repeat edge is compiled as
    from_regex's rules (the small one stays an automaton), and means the same."""
    grammar = xgrammar_backend._ebnf_grammar(_SLOW_EBNF)
    text = str(grammar)
    assert "capgraph_regex_0 ::=" in text and "{1, 255}" in text
    assert text.count("Regex(") == 1 and "[A-Z]{2,16}" in text
    params = P(GuideType.EBNF_GRAMMAR, _SLOW_EBNF)
    assert accepts(xg, tekken, params, "id=" + "a" * 255 + ";AB")
    assert accepts(xg, tekken, params, "id=x-1_y;ABC")
    for bad in ("id=;AB", "id=" + "a" * 256 + ";AB", "id=A;AB", "id=a;A"):
        assert not accepts(xg, tekken, params, bad), bad


def test_a_tag_grammar_elements_slow_regex_is_given_as_rules(xg, tekken):
    """The same in a structural tag's EBNF grammar element."""
    tag = json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<t>", "end": "</t>",
        "content": {"type": "grammar", "grammar": _SLOW_EBNF}}})
    given = json.loads(xgrammar_backend._tag_regexes_faster(tag))["format"]["content"]
    assert "capgraph_regex_0 ::=" in given["grammar"]
    params = P.structural_tag(tag)
    assert accepts(xg, tekken, params, "<t>id=abc;AB</t>")
    assert not accepts(xg, tekken, params, "<t>id=" + "a" * 256 + ";AB</t>")


def test_an_ebnf_grammar_whose_print_does_not_read_back_keeps_its_automata(monkeypatch):
    """Giving a slow Regex as rules is a change of the printed text; where that text would not
    read back, the guide keeps its automata (the same language) instead of being refused."""
    real = xgrammar_backend._reparsed
    monkeypatch.setattr(xgrammar_backend, "_reparsed",
                        lambda text: real(text.replace("[A-Z]", "[A-Y]")))
    text = str(xgrammar_backend._ebnf_grammar(_SLOW_EBNF))
    assert "capgraph_regex" not in text and 'Regex("[0-9a-z_-]{1,255}")' in text


def test_the_tag_schema_bench_runs_and_both_sides_accept_every_instance(capsys):
    """tools/bench_tag_schemas.py compiles a tag of tool schemas both ways and feeds each
    tool's instance to both (it exits naming the side that refuses a token)."""
    from conftest import load_tool
    assert load_tool("bench_tag_schemas").main(["--tools", "3", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "convert capgraph ms" in out and "|   capgraph |" in out


def test_the_length_escape_bench_runs_and_every_side_takes_its_text(capsys):
    """tools/bench_length_escapes.py compiles a length-limited string four ways and feeds each
    its text (it exits naming the side that refuses a token)."""
    from conftest import load_tool
    assert load_tool("bench_length_escapes").main(["--lengths", "4", "--budget", "0.5"]) == 0
    out = capsys.readouterr().out
    assert out.count("|         4 |") == 4 and "regex rules" in out


def test_unambiguous_hex_rewrites_exactly_the_hex_escapes():
    """Only a \\xHH whose backslash is not itself escaped is rewritten: read escape by escape
    from the left (the reading xgrammar's parser has), every random text over backslashes,
    'x', hex digits and others gives the same result."""
    import random

    def by_escapes(text: str) -> str:
        out, i = [], 0
        while i < len(text):
            if text[i] == "\\" and i + 1 < len(text):
                hex2 = text[i + 2:i + 4]
                if text[i + 1] == "x" and len(hex2) == 2 and all(
                        c in "0123456789abcdefABCDEF" for c in hex2):
                    out.append("\\u00" + hex2)
                    i += 4
                else:
                    out.append(text[i:i + 2])
                    i += 2
            else:
                out.append(text[i])
                i += 1
        return "".join(out)

    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice('\\\\\\x41fZ"[') for _ in range(rng.randrange(12)))
        assert xgrammar_backend._unambiguous_hex(text) == by_escapes(text), text
    assert xgrammar_backend._unambiguous_hex('[^\\0-\\x1f\\"\\\\] "\\\\x41" "\\\\\\xe9a"') == \
        '[^\\0-\\u001f\\"\\\\] "\\\\x41" "\\\\\\u00e9a"'
