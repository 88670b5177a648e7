"""JSON-schema constraints are enforced or refused, never silently dropped (both backends).

The probes of ``tools/conformance_table.py`` (each keyword alone and next to its common
neighbours) run on both backends: a compiled schema must refuse its violating instance token by
token. ``docs/CONFORMANCE.md`` must equal what the probes give now. The issue's examples run on
the three bundled tokenizers, and ``json_unenforced_keywords="fallback"`` routes what one
backend cannot enforce to the other, per request, in mixed batches.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph.errors import ConfigError, GrammarCompileError, UnsupportedGuideError
from capgraph.grammar import create_matcher_factory
from capgraph.grammar.converter_log import converter_warnings
from capgraph.grammar.schema_policy import schema_positions, unenforced, unenforced_in_tag
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation
from conftest import load_tool

pytest.importorskip("llguidance", reason="the llguidance extra is not installed")

table = load_tool("conformance_table")
walk = load_tool("conformance_walk")
PROBE_IDS = [f"{p.keyword}-{p.context}".replace(" ", "_") for p in table.PROBES]

# The issue's reproductions and the classes it names, each with an instance that violates
# only the constraint at stake.
ISSUE_EXAMPLES = {
    # number bounds a backend compares as another number (its double, written short)
    "number_minimum_past_2_53": ({"type": "number", "minimum": 2**53 + 1}, 2**53),
    "number_exclusive_bound_with_a_fraction": (
        {"type": "number", "exclusiveMaximum": 123456789012.3}, 123456789012.3),
    "number_bound_of_16_digits": (
        {"type": "number", "exclusiveMaximum": 96836.12535043583}, 96836.12535043583),
    "number_whole_float_bound": ({"type": "number", "minimum": 9007199254740991.0},
                                 9007199254740990),
    "integer_float_bound_past_2_53": ({"type": "integer", "exclusiveMinimum": 1e16}, 10**16),
    # an enum's values checked against their siblings as ECMA-262 and the formats read them
    "enum_next_to_a_class_python_reads_as_posix": (
        {"type": "string", "pattern": "^[[:alpha:]]$", "enum": ["b", "a"]}, "b"),
    "enum_next_to_email": ({"type": "string", "format": "email", "enum": ["@", "a@b.c"]}, "@"),
    "pattern_property_matching_a_listed_name_in_ecma_only": (
        {"type": "object", "properties": {"\ufeff": {"type": "string"}},
         "patternProperties": {"^\\s$": {"type": "integer"}}, "additionalProperties": False},
        {"\ufeff": 1}),
    "multipleOf_number": ({"type": "number", "multipleOf": 120}, 7),
    "maxLength_next_to_pattern": ({"type": "string", "pattern": "^a+$", "maxLength": 2}, "aaa"),
    "allOf_two_branches": ({"allOf": [{"type": "integer"}, {"minimum": 0}]}, -1),
    "propertyNames_next_to_properties": (
        {"type": "object", "properties": {"x": {"type": "integer"}},
         "propertyNames": {"pattern": "^a"}}, {"x": 1}),
    "patternProperties_next_to_properties": (
        {"type": "object", "properties": {"ab": {"type": "string"}},
         "patternProperties": {"^a": {"type": "integer"}}}, {"ab": "s"}),
    "patternProperties_overlapping": (
        {"type": "object", "patternProperties": {"^a": {"type": "integer"},
                                                 "b$": {"minimum": 0}}}, {"ab": -1}),
    "anyOf_next_to_sibling": ({"anyOf": [{"type": "integer"}, {"type": "string"}],
                               "minimum": 5}, 3),
    "oneOf_next_to_sibling": ({"oneOf": [{"type": "integer"}, {"type": "string"}],
                               "minimum": 5}, 3),
    "format_with_length": ({"type": "string", "format": "email", "maxLength": 8},
                           "abcdefgh@example.com"),
    # a closed branch must not take an instance both branches as written match
    "oneOf_closed_branch": ({"oneOf": [
        {"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
        {"type": "object", "properties": {"m": {"type": "integer"}}}]}, {"k": "x"}),
    # before 2020-12, prefixItems is no keyword: items applies to every item
    "prefixItems_under_draft_07": ({"$schema": "http://json-schema.org/draft-07/schema#",
                                    "type": "array", "prefixItems": [{"type": "integer"}],
                                    "items": {"type": "string"}}, [1]),
    # each draft's form of an exclusive bound (draft-04: a boolean; later: a number)
    "exclusiveMinimum_number_under_draft_04": (
        {"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer",
         "minimum": 5, "exclusiveMinimum": 3}, 5),
    "exclusiveMinimum_boolean_under_2020_12": (
        {"type": "number", "exclusiveMinimum": True}, 0.5),
}


@pytest.fixture(scope="module")
def tekken_factories(tekken):
    """backend -> (default-policy factory, "ignore" factory), Tekken."""
    return table.factories(tekken)


@pytest.fixture(scope="module")
def probe_results(tekken_factories, tekken):
    """(probe index, backend) -> Outcome for every probe, run once per module."""
    return {(i, backend): table.run_probe(strict, lenient, tekken, probe)
            for backend, (strict, lenient) in tekken_factories.items()
            for i, probe in enumerate(table.PROBES)}


def _violation_accepted(factory, tokenizer, schema, instance) -> bool | None:
    """True if the compiled schema lets ``instance`` + stop through; None if refused."""
    try:
        compiled = factory.compile(GuidedDecodingParams.json_schema(schema))
    except GrammarCompileError:
        return None
    return table.accepts(factory, compiled, tokenizer, instance)


@pytest.mark.parametrize("backend", table.BACKENDS)
@pytest.mark.parametrize("index", range(len(table.PROBES)), ids=PROBE_IDS)
def test_probe_is_enforced_or_refused(index, backend, probe_results):
    """Each probe's schema is either refused at compile time (an UnsupportedGuideError that
    names a keyword and its JSON pointer or what the backend reported, or the backend's own
    compile error) or compiled into a grammar that refuses the violating instance."""
    probe = table.PROBES[index]
    outcome = probe_results[(index, backend)]
    assert outcome.status != "VIOLATION", f"{backend} lets {probe.violating!r} through"
    if outcome.status == "refused":
        assert "' at /" in outcome.detail or "reported:" in outcome.detail, outcome.detail


@pytest.mark.parametrize("index", range(len(table.PROBES)), ids=PROBE_IDS)
def test_probe_instances_are_what_they_claim(index):
    """The probe table is sound: jsonschema finds each violating instance invalid and each
    valid instance valid (formats jsonschema cannot check here are skipped)."""
    from jsonschema import Draft202012Validator, FormatChecker
    probe = table.PROBES[index]
    if probe.keyword in ("x-guidance",):
        pytest.skip("x-guidance is no JSON Schema keyword; the probe violates 'not'")
    checker = FormatChecker(formats=walk.CHECKED_FORMATS)
    fmt = probe.schema.get("format")
    if fmt is not None and fmt not in checker.checkers:
        pytest.skip(f"jsonschema has no standard check for format {fmt!r} here")
    validator = Draft202012Validator(probe.schema, format_checker=checker)
    if probe.keyword in ("items", "additionalItems") and "draft-07" in probe.context:
        from jsonschema import Draft7Validator
        validator = Draft7Validator(probe.schema, format_checker=checker)
    if probe.context == "draft-04 boolean form":
        from jsonschema import Draft4Validator
        validator = Draft4Validator(probe.schema, format_checker=checker)
    if probe.keyword == "dependencies":
        from jsonschema import Draft7Validator
        validator = Draft7Validator(probe.schema, format_checker=checker)
    if "$schema" in probe.schema:
        from jsonschema import validators
        validator = validators.validator_for(probe.schema)(probe.schema, format_checker=checker)
    if isinstance(probe.violating, table.Raw):  # not JSON, or JSON whose parse is invalid
        try:
            parsed = json.loads(probe.violating.text)
        except ValueError:
            pass
        else:
            assert not validator.is_valid(parsed), parsed
    else:
        assert not validator.is_valid(probe.violating)
    if probe.valid is not table.NO_VALID:
        assert validator.is_valid(probe.valid)


def test_conformance_doc_is_current(probe_results):
    """docs/CONFORMANCE.md is exactly what tools/conformance_table.py generates from the
    probes now (plus the recorded walk), and it reports no violation."""
    text = table.render(probe_results, table.load_walk())
    assert "VIOLATION" not in text
    assert table.DOC.read_text() == text, \
        "docs/CONFORMANCE.md is stale: run python tools/conformance_table.py"


@pytest.mark.parametrize("tok_name", ["tekken", "mistral-sp32k", "qwen"])
@pytest.mark.parametrize("backend", table.BACKENDS)
@pytest.mark.parametrize("example", list(ISSUE_EXAMPLES))
def test_issue_examples_never_pass_a_violation(example, backend, tok_name, factory_cache,
                                               tokenizer_cache):
    """The issue's reproductions, on every bundled tokenizer and both backends: refused at
    compile time, or the violating instance is refused token by token."""
    schema, violating = ISSUE_EXAMPLES[example]
    factory = factory_cache(tok_name, backend)
    accepted = _violation_accepted(factory, tokenizer_cache(tok_name), schema, violating)
    assert accepted is not True


@pytest.mark.parametrize("example", ["multipleOf_number", "maxLength_next_to_pattern",
                                     "allOf_two_branches"])
def test_xgrammar_refuses_issue_examples_naming_keyword_and_pointer(example, factory_cache):
    """On xgrammar (which would drop them) the three reproductions are refused by default with
    an UnsupportedGuideError naming the keyword and its JSON pointer."""
    schema, _ = ISSUE_EXAMPLES[example]
    keyword = {"multipleOf_number": "'multipleOf' at /", "maxLength_next_to_pattern":
               "'maxLength' at /", "allOf_two_branches": "'allOf' at /"}[example]
    with pytest.raises(UnsupportedGuideError) as info:
        factory_cache("tekken").compile(GuidedDecodingParams.json_schema(schema))
    assert keyword in str(info.value) and "json_unenforced_keywords" in str(info.value)


def test_xgrammar_warning_refuses_a_schema_the_allow_list_passes(factory_cache, capfd):
    """oneOf alone is allowed (xgrammar enforces disjoint branches), but for overlapping ones
    xgrammar logs that it falls back to anyOf: the captured warning refuses the schema, and the
    warning still reaches stderr."""
    schema = {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}
    assert unenforced(schema, "xgrammar") == []
    with pytest.raises(UnsupportedGuideError) as info:
        factory_cache("tekken").compile(GuidedDecodingParams.json_schema(schema))
    assert "xgrammar reported: oneOf" in str(info.value)
    assert "falling back to anyOf" in capfd.readouterr().err


def test_converter_warnings_reads_only_converter_lines_and_reemits_all(capfd):
    """Inside the capture, a converter warning is returned; any other stderr text (another
    thread's, Python's) is not read as a warning; everything reaches the real stderr."""
    with converter_warnings() as warned:
        os.write(2, b"[10:00:00] /x/cpp/json_schema_converter.cc:12: Warning: dropped foo\n")
        os.write(2, b"unrelated Warning: not from the converter\n")
    assert warned == ["dropped foo"]
    err = capfd.readouterr().err
    assert "dropped foo" in err and "unrelated Warning" in err


def test_converter_warnings_restores_stderr_when_the_body_raises(capfd):
    """Descriptor 2 is restored (and the captured text re-emitted) when the compile raises."""
    before = os.fstat(2).st_ino
    with pytest.raises(RuntimeError):
        with converter_warnings():
            os.write(2, b"partial output\n")
            raise RuntimeError("compile failed")
    assert os.fstat(2).st_ino == before
    assert "partial output" in capfd.readouterr().err


@pytest.mark.parametrize("schema,expected", [
    ({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}},
     []),
    ({"type": "integer", "title": "t", "x-vendor": {"not": 1}, "_comment": "c",
      "nullable": True}, []),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": False, "minItems": 0}, []),
    ({"type": "object", "properties": {"a/b": {"type": "array", "items": {"type": "integer"},
                                               "uniqueItems": True}}},
     [("uniqueItems", "/properties/a~1b")]),
    ({"$ref": "#/$defs/missing", "$defs": {}}, [("$ref", "")]),
    ({"$ref": "https://example.com/s.json"}, [("$ref", "")]),
    ({"type": "string", "enum": ["a", "b"], "maxLength": 1}, []),
    ({"type": "string", "enum": ["a", "bb"], "maxLength": 1}, [("enum", ""), ]),
    ({"properties": {"a": {"$id": "http://x/a", "type": "integer"}}}, [("$id", "/properties/a")]),
    # an enum decides alone only where its values satisfy the siblings as the schema's own
    # draft reads them, under formats jsonschema can check, in a form that draft defines
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "enum": [{"a": 1}], "dependencies": {"a": ["b"]}}, [("enum", "")]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "object",
      "enum": [{"a": 1, "b": 2}], "dependencies": {"a": ["b"]}}, []),
    ({"type": "string", "enum": ["-a-"], "format": "hostname"}, [("enum", "")]),
    ({"type": "string", "enum": ["2020-01-01"], "format": "date"}, []),
    ({"enum": [[1, "a"]], "items": [{"type": "integer"}]}, [("enum", "")]),
    ({"type": []}, [("type", "")]),
    # places only a '$ref' reaches are judged like any other
    ({"type": "object", "properties": {"a": {"$ref": "#/x-foo"}},
      "x-foo": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
     [("uniqueItems", "/x-foo")]),
    ({"$ref": "#/default", "default": {"type": "string", "format": "regex"}},
     [("format", "/default")]),
    ({"$ref": "#/x", "x": {"$ref": "#/y"}, "y": {"not": {"const": 1}}}, [("not", "/y")]),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"type": "array", "items": {"$ref": "#/$defs/a"}}}},
     []),
    # a name the schema does not list can be written twice: minProperties cannot count it
    ({"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
     [("minProperties", "")]),
    ({"type": "object", "minProperties": 1}, [("minProperties", "")]),
    ({"type": "object", "properties": {"a": {}, "b": {}}, "minProperties": 1}, []),
    # prefixItems is a 2020-12 keyword; xgrammar reads no $schema
    ({"$schema": "https://json-schema.org/draft/2019-09/schema", "type": "array",
      "prefixItems": [{"type": "integer"}]}, [("prefixItems", "")]),
    ({"$schema": "https://json-schema.org/draft/2020-12/schema", "type": "array",
      "prefixItems": [{"type": "integer"}]}, []),
    # draft-04's exclusiveMinimum is a boolean modifier: a number there is no bound of its own
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 5,
      "exclusiveMinimum": 3}, [("exclusiveMinimum", "")]),
    # a number's decimal text is compared with the bound's double: an exclusive bound leaks
    # where doubles are sparser than six fractional digits; an integer past 2**53 is rounded
    ({"type": "number", "minimum": 2.5, "exclusiveMaximum": 1e6}, []),
    ({"type": "number", "maximum": 1.2345678, "minimum": 123456789012.3}, []),
    ({"type": ["number", "null"], "exclusiveMinimum": 123456789012.3},
     [("exclusiveMinimum", "")]),
    ({"type": "number", "exclusiveMinimum": 10**12}, [("exclusiveMinimum", "")]),
    ({"type": "number", "exclusiveMaximum": 1e9}, []),
    ({"type": "number", "exclusiveMaximum": 1e10, "exclusiveMinimum": -12345678901.5}, []),
    ({"type": "number", "exclusiveMaximum": -8589934592.3}, [("exclusiveMaximum", "")]),
    ({"type": "number", "maximum": 2**53}, []),
    ({"type": "number", "maximum": 2**53 + 1}, [("maximum", "")]),
    ({"type": "integer", "minimum": 2**53 + 1, "exclusiveMaximum": 1e12}, []),
    # enum values and listed names are read against patterns as ECMA-262 reads them
    ({"type": "string", "pattern": "^[[:alpha:]]$", "enum": ["b", "a"]}, [("enum", "")]),
    ({"type": "string", "pattern": "^[A-Z][a-z]+$", "enum": ["London\n"]}, [("enum", "")]),
    ({"type": "string", "pattern": "^\\d{3}$", "enum": ["\u0661\u0662\u0663"]},
     [("enum", "")]),
    ({"type": "string", "pattern": "^a{,3}$", "enum": ["aa"]}, [("enum", "")]),
    ({"type": "string", "pattern": "^.$", "enum": ["\u2028"]}, [("enum", "")]),
    ({"type": "string", "pattern": "^[A-Z][a-z]+$", "enum": ["London", "Paris"]}, []),
    ({"type": "string", "pattern": "^[\\S]+$", "enum": ["abc", "def"]}, []),
    ({"type": "string", "pattern": "^(?:(a)|b)\\1$", "enum": ["b"]}, [("enum", "")]),
    ({"type": "object", "properties": {"name": {"type": "string"}},
      "patternProperties": {"^[\\S]+$": {"type": "integer"}}}, [("patternProperties", "")]),
    ({"type": "object", "properties": {"\ufeff": {"type": "string"}},
      "patternProperties": {"^\\s$": {"type": "integer"}}}, [("patternProperties", "")]),
    # ... and against a format by its definition (jsonschema's email check wants only an @)
    ({"type": "string", "format": "email", "enum": ["@"]}, [("enum", "")]),
    ({"type": "string", "format": "email", "enum": ["a@b.c", "x.y@ex-ample.org"]}, []),
    ({"type": "string", "format": "email", "enum": ["a" * 65 + "@b.c"]}, [("enum", "")]),
    ({"type": "string", "format": "time", "enum": ["12:00:00Z"]}, []),
    ({"type": "string", "format": "uuid", "enum": ["12345678-1234-1234-1234-1234-5678-9abc"]},
     [("enum", "")]),
    ({"type": "string", "format": "uuid", "enum": ["12345678-1234-1234-1234-123456789abc"]},
     []),
    ({"type": "string", "format": "uri", "enum": ["http://x"]}, [("enum", "")]),
])
def test_policy_findings_xgrammar(schema, expected):
    """The xgrammar allow-list: names and annotations are not keywords, no-op values constrain
    nothing, pointers escape '/', an enum whose values satisfy its siblings decides alone,
    unresolvable or remote references and nested identifiers are reported, and so is what
    a '$ref' reaches outside the usual places."""
    found = [(f.keyword, f.pointer) for f in unenforced(schema, "xgrammar")]
    assert found[:len(expected)] == expected and (expected or not found)


@pytest.mark.parametrize("schema,expected", [
    # a negated class that excludes '"' or '\\' is enforced (semantics.ecma_regex writes it
    # for llguidance without the control character that made llguidance take their escapes)
    ({"type": "string", "pattern": '^[^"]+$'}, []),
    ({"type": "string", "pattern": "^[^\\\\]+$"}, []),
    ({"type": "object", "patternProperties": {'^[^"]': {}}, "additionalProperties": False},
     []),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True},
     [("properties", "")]),
    # a listed schema that takes any value loses nothing to a name spelled with an escape
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": True}, []),
    # llguidance_schema writes no additionalProperties: false into an allOf branch, nor next
    # to a required name the schema does not list
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]},
     [("properties", "/allOf/0")]),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"]},
     [("properties", "")]),
    ({"type": "object", "properties": {"x": {"type": "object",
                                             "properties": {"a": {"type": "integer"}}}}}, []),
    ({"$ref": "#/x-o", "x-o": {"type": "object", "properties": {"a": {"type": "integer"}}}},
     [("properties", "/x-o")]),
    ({"type": "object", "properties": {"a": {}}, "additionalProperties": False}, []),
    ({"type": "object", "properties": {"a": {}}}, []),
    ({"type": "object", "additionalProperties": {"type": "integer"}}, []),
    # a closed schema combined with one listing a property it does not: never written
    ({"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}], "$defs": {
        "A": {"type": "object", "properties": {"a": {"type": "integer"}}},
        "B": {"type": "object", "properties": {"b": {"type": "string"}}}}}, [("allOf", "")]),
    ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
      "anyOf": [{"properties": {"a": {"minimum": 0}}}]}, [("anyOf", "")]),
    ({"type": "object", "properties": {"a": {"type": "integer"}},
      "anyOf": [{"required": ["a"]}, {"properties": {"a": {"minimum": 0}}}]}, []),
    ({"anyOf": [{"type": "object", "properties": {"a": {"const": 1}, "x": {}}},
                {"type": "object", "properties": {"a": {"const": 2}, "y": {}}}]}, []),
    # another branch lists (or leaves open) the parent's property: it can be written
    ({"type": "object", "properties": {"a": {"type": "string"}, "b": {"type": "integer"}},
      "anyOf": [{"properties": {"a": {"minLength": 1}}, "required": ["a"]},
                {"required": ["b"]}]}, []),
    # only an excluded bound at or nearer zero than the other leaks on llguidance
    ({"type": "number", "minimum": 0.5, "exclusiveMaximum": 1}, []),
    ({"type": "number", "exclusiveMinimum": -1, "maximum": -0.5}, []),
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}, [("exclusiveMinimum", "")]),
    # closed oneOf branches keep "one" only where the branches as written are disjoint: by a
    # type, or by a property both require with values they do not share
    ({"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
                {"type": "object", "properties": {"m": {"type": "integer"}}}]},
     [("oneOf", "")]),
    ({"oneOf": [{"type": "object", "properties": {"t": {"const": "a"}, "x": {}},
                 "required": ["t"]},
                {"type": "object", "properties": {"t": {"enum": ["b", "c"]}, "y": {}},
                 "required": ["t"]}]}, []),
    ({"oneOf": [{"type": "object", "properties": {"t": {"const": 1}}, "required": ["t"]},
                {"type": "object", "properties": {"t": {"enum": [1.0, 2]}},
                 "required": ["t"]}]}, [("oneOf", "")]),
    ({"oneOf": [{"type": "object", "properties": {"a": {}}},
                {"type": "array", "prefixItems": [{}]}]}, []),
    # ... or by a property each requires that the other, closed, does not list
    ({"oneOf": [{"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}},
                 "required": ["b"]}]}, []),
    ({"oneOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {}}, "required": ["b"],
                 "additionalProperties": False}]}, []),
    ({"oneOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]},
                {"type": "object", "properties": {"a": {}, "b": {}}, "required": ["a"]}]},
     [("oneOf", "")]),
    ({"oneOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {}}}]}, [("oneOf", "")]),
    ({"oneOf": [{"properties": {"a": {}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {}}, "required": ["b"]}]},
     [("oneOf", "")]),
    ({"oneOf": [{"type": "object", "properties": {"a": {}}, "required": ["a"],
                 "allOf": [{"properties": {"b": {}}}]},
                {"type": "object", "properties": {"b": {}}, "required": ["b"]}]},
     [("oneOf", "")]),
    ({"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]}, []),
    # each draft's form of an exclusive bound: draft-04 a boolean beside its bound (served),
    # later drafts a number
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 5,
      "exclusiveMinimum": True}, []),
    ({"$schema": "http://json-schema.org/draft-04/schema#", "type": "integer", "minimum": 5,
      "exclusiveMinimum": 3}, [("exclusiveMinimum", "")]),
    ({"type": "number", "exclusiveMinimum": True}, [("exclusiveMinimum", "")]),
    ({"$schema": "http://json-schema.org/draft-07/schema#", "type": "number",
      "maximum": 1, "exclusiveMaximum": True}, [("exclusiveMaximum", "")]),
    # a bound of more than 15 significant digits may be compared as another number; a whole
    # double or an integer from 2**53 is not exact; an integer bound below 2**53 is
    ({"type": "number", "minimum": 0.1, "maximum": 12345678901234.5}, []),
    ({"type": "number", "exclusiveMaximum": 96836.12535043583}, [("exclusiveMaximum", "")]),
    ({"type": "integer", "exclusiveMinimum": 1e16}, [("exclusiveMinimum", "")]),
    ({"type": "integer", "exclusiveMinimum": 2**53}, [("exclusiveMinimum", "")]),
    ({"type": "integer", "minimum": 1234567890123457}, []),
])
def test_policy_findings_llguidance(schema, expected):
    """The llguidance allow-list: listed names next to additional ones (a listed name spelled
    with an escape passes as additional) are reported; patterns are not."""
    found = [(f.keyword, f.pointer) for f in unenforced(schema, "llguidance")]
    assert found[:len(expected)] == expected and (expected or not found)


def test_schema_positions_visit_each_place_once_without_recursion():
    """Every schema object once, in document order, then what only a '$ref' reaches; a
    schema nested far past Python's recursion limit is walked all the same."""
    schema = {"properties": {"a": {"$ref": "#/x"}, "b": {"$ref": "#"}},
              "x": {"items": {"$ref": "#/x"}}, "$defs": {"d": {}}}
    assert [p for _, p in schema_positions(schema)] == [
        "", "/properties/a", "/properties/b", "/$defs/d", "/x", "/x/items"]
    deep: dict = {}
    for _ in range(5000):
        deep = {"items": deep}
    assert len(list(schema_positions(deep))) == 5001


@pytest.mark.parametrize("tok_name", ["tekken", "mistral-sp32k", "qwen"])
def test_xgrammar_length_limits_count_characters_and_stay_json(tok_name, factory_cache,
                                                               tokenizer_cache):
    """A length-limited string on xgrammar counts characters (not bytes), and never takes a
    raw control character (which xgrammar's own length rule lets through, and capgraph
    repairs); a string without a length limit does not either."""
    factory = factory_cache(tok_name)
    tokenizer = tokenizer_cache(tok_name)
    compiled = factory.compile(GuidedDecodingParams.json_schema(
        {"type": "object", "properties": {"s": {"type": "string", "minLength": 1,
                                                "maxLength": 2}}, "required": ["s"]}))
    assert table.accepts(factory, compiled, tokenizer, {"s": "\u00e9\u6f22"})
    assert not table.accepts(factory, compiled, tokenizer, {"s": "\u00e9\u6f22\u5b57"})
    assert not table.accepts(factory, compiled, tokenizer, {"s": ""})
    assert not table.accepts(factory, compiled, tokenizer, table.Raw('{"s":"\x0f"}'))


def test_length_limits_stay_json_when_unenforced_keywords_are_ignored(tokenizer_cache):
    """The character-class repair of xgrammar's length-limited strings is a JSON-validity fix,
    not a keyword policy: ``json_unenforced_keywords="ignore"`` gets it too, so no raw control
    character enters a string."""
    tokenizer = tokenizer_cache("mistral-sp32k")
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tokenizer, json_unenforced_keywords="ignore"))
    try:
        compiled = factory.compile(GuidedDecodingParams.json_schema(
            {"type": "object", "properties": {"s": {"type": "string", "maxLength": 2}},
             "required": ["s"]}))
        assert table.accepts(factory, compiled, tokenizer, {"s": "ab"})
        assert not table.accepts(factory, compiled, tokenizer, table.Raw('{"s":"\x0f"}'))
    finally:
        factory.close()


def _tag(schema: dict, **element) -> str:
    return json.dumps({"type": "structural_tag", "format": {
        "type": "tag", "begin": "<t>", "content": {"type": "json_schema", "json_schema": schema,
                                                   **element},
        "end": "</t>"}})


_LENGTH = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}}
_ADDITIONAL = {"type": "object", "properties": {"a": {"type": "integer"}},
               "additionalProperties": {"type": "string"}}


def test_structural_tag_schemas_follow_the_policy(factory_cache):
    """A JSON schema embedded in a structural tag goes through the same xgrammar converter: a
    constraint it would drop there refuses the tag, naming keyword and pointer."""
    from capgraph import GuideType
    with pytest.raises(UnsupportedGuideError) as info:
        factory_cache("tekken").compile(GuidedDecodingParams(
            GuideType.STRUCTURAL_TAG, _tag({"type": "number", "multipleOf": 120})))
    assert "'multipleOf' at /format/content/json_schema" in str(info.value)


@pytest.mark.parametrize("schema,fragment", [
    (_LENGTH, "'maxLength' at /format/content/json_schema/properties/s"),
    (_ADDITIONAL, "'properties' at /format/content/json_schema"),
])
def test_structural_tag_schemas_xgrammar_converts_keep_its_gaps(schema, fragment,
                                                               factory_cache):
    """A plain json_schema element compiles as a JSON-schema guide, repairs included, so its
    length limits and listed names next to additional ones compile; in an XML-style element
    xgrammar converts the schema itself, without them, and the tag is refused."""
    from capgraph import GuideType
    factory = factory_cache("tekken")
    factory.compile(GuidedDecodingParams(GuideType.STRUCTURAL_TAG, _tag(schema)))
    assert unenforced_in_tag(json.loads(_tag(schema))) == []
    with pytest.raises(UnsupportedGuideError) as info:
        factory.compile(GuidedDecodingParams(GuideType.STRUCTURAL_TAG,
                                             _tag(schema, style="qwen_xml")))
    assert fragment in str(info.value)


def test_structural_tag_refuses_any_order_schemas(factory_cache, tekken):
    """A tag schema whose properties may come in any order is refused: xgrammar checks
    neither that the required ones are present nor that each appears once there (measured:
    ``{"a":1,"a":2}`` passed for required a and b)."""
    from capgraph import GuideType
    tag = json.dumps({"type": "structural_tag", "format": {
        "type": "json_schema", "any_order": True, "json_schema": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"]}}})
    assert [(f.keyword, f.pointer) for f in unenforced_in_tag(json.loads(tag))] == [
        ("any_order", "/format")]
    with pytest.raises(UnsupportedGuideError, match="'any_order' at /format"):
        factory_cache("tekken").compile(GuidedDecodingParams(GuideType.STRUCTURAL_TAG, tag))
    ordered = json.loads(tag)
    ordered["format"]["any_order"] = False
    factory_cache("tekken").compile(GuidedDecodingParams(GuideType.STRUCTURAL_TAG,
                                                         json.dumps(ordered)))


def test_structural_tag_with_enforced_schema_compiles(factory_cache, tekken):
    """A tag whose schema xgrammar enforces compiles and refuses a violating value."""
    from capgraph import GuideType
    factory = factory_cache("tekken")
    compiled = factory.compile(GuidedDecodingParams(
        GuideType.STRUCTURAL_TAG, _tag({"type": "integer", "minimum": 0})))
    assert table.accepts(factory, compiled, tekken, table.Raw("<t>5</t>"))
    assert not table.accepts(factory, compiled, tekken, table.Raw("<t>-5</t>"))


def test_llguidance_serves_a_oneof_told_apart_by_required_properties(factory_cache, tekken):
    """A oneOf whose branches each require a property the other does not list: llguidance
    closes both, so what it writes for one branch never has the other's required property,
    and every instance it writes matches exactly one branch as written. It writes either
    branch's instance and not one with both properties (which both open branches as written
    would match)."""
    import jsonschema

    from capgraph.tokenizers import encode_continuation

    schema = {"oneOf": [
        {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]},
        {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]}
    factory = factory_cache("tekken", "llguidance")
    params = GuidedDecodingParams.json_schema(schema)
    factory.compile(params)  # (served: not refused by the policy)
    for text, written in (('{"a":"x"}', True), ('{"b":1}', True), ('{"a":"x","b":1}', False)):
        matcher = factory.create(params)
        ok = all(matcher.accept_token(t) for t in encode_continuation(tekken, text))
        assert ok is written, text
        if written:
            assert matcher.accept_token(tekken.eos_token_id) and matcher.is_terminated()
            jsonschema.validate(json.loads(text), schema)
    with pytest.raises(jsonschema.ValidationError):  # (the one it does not write)
        jsonschema.validate({"a": "x", "b": 1}, schema)


def test_policy_refuses_x_guidance_on_llguidance(factory_cache):
    """A schema's own x-guidance options could make llguidance ignore keywords (lenient
    mode); the llguidance policy refuses them, naming the key and where."""
    schema = {"type": "integer", "x-guidance": {"lenient": True}}
    with pytest.raises(UnsupportedGuideError) as info:
        factory_cache("tekken", "llguidance").compile(GuidedDecodingParams.json_schema(schema))
    assert "'x-guidance' at /" in str(info.value)


# -- json_unenforced_keywords="fallback" ------------------------------------------------------

@pytest.fixture(scope="module")
def fallback_factory(tekken):
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tekken, json_unenforced_keywords="fallback"))
    yield factory
    factory.close()


@pytest.mark.parametrize("example", ["multipleOf_number", "maxLength_next_to_pattern",
                                     "allOf_two_branches", "anyOf_next_to_sibling"])
def test_fallback_serves_what_xgrammar_drops_with_llguidance(example, fallback_factory,
                                                            tekken):
    """A schema xgrammar would not enforce is served by llguidance, recorded on the compiled
    guide with the reason, and the violating instance is refused."""
    schema, violating = ISSUE_EXAMPLES[example]
    params = GuidedDecodingParams.json_schema(schema)
    compiled = fallback_factory.compile(params)
    assert compiled.backend == "llguidance"
    assert compiled.fallback_reason and "xgrammar refused it" in compiled.fallback_reason
    assert fallback_factory.served_by(params) == ("llguidance", compiled.fallback_reason)
    assert not table.accepts(fallback_factory, compiled, tekken, violating)


def test_fallback_keeps_xgrammar_where_it_enforces(fallback_factory):
    """A schema xgrammar enforces stays on xgrammar, with no fallback reason."""
    params = GuidedDecodingParams.json_schema({"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0}}, "required": ["a"]})
    assert fallback_factory.served_by(params) == ("xgrammar", None)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"x": {"type": "integer"}}, "propertyNames": {"pattern": "^a"}},
    {"oneOf": [{"type": "integer"}, {"type": "number", "minimum": 0}]},
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "integer", "not": {"const": 1}},
])
def test_fallback_refuses_what_neither_backend_enforces(schema, fallback_factory):
    """propertyNames next to properties, overlapping oneOf, uniqueItems and not: neither
    backend enforces them, so the schema is refused, naming both backends' reasons."""
    with pytest.raises(GrammarCompileError) as info:
        fallback_factory.compile(GuidedDecodingParams.json_schema(schema))
    message = str(info.value)
    assert "neither backend" in message and "xgrammar:" in message and "llguidance:" in message


def test_fallback_from_llguidance_goes_to_xgrammar(tekken):
    """With llguidance configured, a schema it refuses (a format it does not check) is served
    by xgrammar where xgrammar enforces it, and the violating instance is refused."""
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tekken, backend="llguidance", json_unenforced_keywords="fallback"))
    try:
        schema = {"type": "string", "format": "uri-reference"}
        compiled = factory.compile(GuidedDecodingParams.json_schema(schema))
        assert compiled.backend == "xgrammar"
        assert "llguidance refused it" in (compiled.fallback_reason or "")
        assert not table.accepts(factory, compiled, tekken, "\\\\")
        assert table.accepts(factory, compiled, tekken, "/a/b")
    finally:
        factory.close()


def test_fallback_needs_one_stop_token(tekken):
    """Fallback builds llguidance too, which takes exactly one stop token: ConfigError at
    construction, naming the fallback and the reason."""
    with pytest.raises(ConfigError) as info:
        create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
            tekken, json_unenforced_keywords="fallback", stop_token_ids=[1, 2]))
    assert "'fallback'" in str(info.value) and "exactly one stop token" in str(info.value)


def test_fallback_needs_the_llguidance_extra(tekken, monkeypatch):
    """Without the llguidance extra, fallback is a ConfigError naming the missing extra."""
    from capgraph.grammar import llguidance_backend
    monkeypatch.setattr(llguidance_backend, "llguidance", None)
    with pytest.raises(ConfigError) as info:
        create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
            tekken, json_unenforced_keywords="fallback"))
    assert "'fallback'" in str(info.value) and "llguidance" in str(info.value)


def test_unknown_policy_is_a_config_error(tekken):
    """json_unenforced_keywords takes 'error', 'fallback' or 'ignore'."""
    with pytest.raises(ConfigError) as info:
        GuidedDecodingConfig.from_tokenizer(tekken, json_unenforced_keywords="lenient")
    assert "'fallback'" in str(info.value)


def test_fallback_mixed_batch_masks_match_each_backend(fallback_factory, tekken):
    """A decoder batch holding an xgrammar-served and an llguidance-served request: every
    step's mask of each row equals the mask of its serving backend's own matcher advanced by
    the same tokens, and the allowed tokens sampled keep both outputs valid."""
    from capgraph import GuidedDecoder
    from capgraph.grammar.xgrammar_backend import XGrammarMatcher
    schemas = [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "number", "multipleOf": 120}]
    params = [GuidedDecodingParams.json_schema(s) for s in schemas]
    texts = ['{"a":12}', "240"]
    tokens = [encode_continuation(tekken, t) + [fallback_factory.config.stop_token_ids[0]]
              for t in texts]
    served = [fallback_factory.compile(p) for p in params]
    assert [c.backend for c in served] == ["xgrammar", "llguidance"]
    refs = [fallback_factory.create_from_compiled(c) for c in served]
    assert type(refs[0]) is XGrammarMatcher and type(refs[1]) is not XGrammarMatcher
    V = fallback_factory.config.vocab_size_padded
    dec = GuidedDecoder(fallback_factory.config, max_num_sequences=2, vocab_size_padded=V,
                        factory=fallback_factory)
    try:
        steps = max(len(t) for t in tokens)
        for step in range(steps):
            live = [i for i in range(2) if step < len(tokens[i])]
            reqs = [GuidedRequest.context(i, i, params[i]) if step == 0 else
                    GuidedRequest.generation(i, i, params[i], tokens[i][step - 1])
                    for i in live]
            dec.add_batch(reqs)
            logits = torch.zeros(len(live), V)
            assert dec.execute(logits) == []
            for row, i in enumerate(live):
                if step:
                    assert refs[i].accept_token(tokens[i][step - 1])
                want = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
                refs[i].fill_next_token_bitmask(want, 0)
                allowed = torch.isfinite(logits[row])
                expect = ((want[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
                          ).flatten()[:V].bool()
                assert torch.equal(allowed, expect), f"row {row} (request {i}) at step {step}"
                assert bool(allowed[tokens[i][step]])
    finally:
        dec.close()


def test_ignore_policy_still_compiles_unenforced_schemas(tekken_factories, tekken):
    """json_unenforced_keywords='ignore' is the explicit opt-in: the schema compiles and the
    dropped constraint is indeed not enforced (what the CONFORMANCE table calls 'dropped')."""
    _, lenient = tekken_factories["xgrammar"]
    schema, violating = ISSUE_EXAMPLES["multipleOf_number"]
    assert lenient.config.json_unenforced_keywords == "ignore"
    assert _violation_accepted(lenient, tekken, schema, violating) is True


def test_enum_against_a_backtracking_pattern_is_decided_without_a_stall():
    """The enum-covers-siblings check matches the values against the schema's own pattern:
    on Python's ``re`` (through jsonschema) ``^(a+)+$`` against 28 ``a`` and a ``!`` held
    the GIL for 46 s. On the ``regex`` module it is decided at once (the value does not
    match: reported), and a pattern still slow there stops at REGEX_CHECK_SECONDS and is
    reported as unchecked: never served on an unproven claim."""
    import time

    from capgraph.grammar import schema_policy
    start = time.perf_counter()
    found = unenforced({"type": "string", "pattern": "^(a+)+$", "enum": ["a" * 28 + "!"]},
                       "xgrammar")
    assert [f.keyword for f in found] == ["enum"] and "lets" in found[0].reason
    found = unenforced({"type": "string", "pattern": "^(a|aa)+$", "enum": ["a" * 40 + "!"]},
                       "xgrammar")
    assert [f.keyword for f in found] == ["enum"] and "within" in found[0].reason
    assert time.perf_counter() - start < 10 * schema_policy.REGEX_CHECK_SECONDS
    assert unenforced({"type": "string", "pattern": "^[A-Z]{2}$", "enum": ["US", "CA"]},
                      "xgrammar") == []
    assert [f.keyword for f in unenforced(
        {"type": "string", "pattern": "^[A-Z]{2}$", "enum": ["US", "usa"]}, "xgrammar")] \
        == ["enum"]


def test_pattern_properties_against_listed_names_are_matched_with_a_bound():
    """``patternProperties`` keys are matched against the listed names (xgrammar applies
    neither to a name both cover) with the bounded matcher: a slow one is reported as
    unchecked, not run for minutes on the decoder's process."""
    import time

    def schema(pattern: str, name: str) -> dict:
        return {"type": "object", "properties": {name: {"type": "string"}},
                "patternProperties": {pattern: {"type": "string"}},
                "additionalProperties": False}

    start = time.perf_counter()
    assert unenforced(schema("^(a+)+$", "a" * 30 + "!"), "xgrammar") == []
    found = unenforced(schema("^(a|aa)+$", "a" * 40 + "!"), "xgrammar")
    assert [f.keyword for f in found] == ["patternProperties"]
    assert "cannot be checked" in found[0].reason
    assert time.perf_counter() - start < 10
    found = unenforced(schema("^a", "ab"), "xgrammar")
    assert [f.keyword for f in found] == ["patternProperties"]


def test_policy_walk_keeps_no_pointer_per_node():
    """A deep schema with long property names is judged in memory linear in its size: no
    full JSON pointer per node (300 levels of 10 000-character names: 450 MB of them)."""
    import tracemalloc
    schema: dict = {"type": "number", "multipleOf": 3}
    for i in range(300):
        schema = {"type": "object", "properties": {chr(97 + i % 26) * 10000: schema}}
    tracemalloc.start()
    try:
        found = unenforced(schema, "xgrammar")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    assert [f.keyword for f in found] == ["multipleOf"]
    assert found[0].pointer.endswith("/" + "a" * 10000) and len(str(found[0])) < 1000
    assert len(list(schema_positions({"items": {"$ref": "#/$defs/x"},
                                      "$defs": {"x": {"$ref": "#/items"}}}))) == 3
