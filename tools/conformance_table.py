"""JSON Schema conformance probes: each keyword, alone and next to its common neighbours, on
each backend; writes ``docs/CONFORMANCE.md`` from their results.

A probe is a schema plus an instance that violates only the probed keyword (and, where one
exists, a valid instance). On each backend, under the default ``json_unenforced_keywords=
"error"``, the schema is either refused (``UnsupportedGuideError`` naming the keyword and its
JSON pointer, or the backend's own compile error) or compiled; a compiled schema must refuse
the violating instance token by token (its encoding plus the stop token fed to a matcher),
else the probe reports a ``VIOLATION``. Refused schemas are compiled again under ``"ignore"``
to show what opting in would drop.

    python tools/conformance_table.py            # rewrite docs/CONFORMANCE.md
    python tools/conformance_table.py --check    # exit 1 if the committed file differs

``tests/test_conformance_schema.py`` runs the same probes and checks the committed file.
The walk's counts come from ``docs/conformance_walk.json``, which ``tools/conformance_walk.py
--record`` writes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "CONFORMANCE.md"
WALK_RECORD = ROOT / "docs" / "conformance_walk.json"
BACKENDS = ("xgrammar", "llguidance")
NO_VALID = object()  # the schema has no valid instance worth feeding


@dataclass(frozen=True)
class Raw:
    """Output text fed as it is (an instance that is not JSON at all)."""

    text: str


@dataclass(frozen=True)
class Probe:
    keyword: str
    context: str
    schema: dict
    violating: Any
    valid: Any = NO_VALID


def _p(keyword: str, context: str, schema: dict, violating: Any, valid: Any = NO_VALID
       ) -> Probe:
    return Probe(keyword, context, schema, violating, valid)


_INT = {"type": "integer"}
PROBES: list[Probe] = [
    _p("type", "alone", {"type": "integer"}, "a", 1),
    _p("type", "list of types", {"type": ["integer", "null"]}, "a", None),
    _p("enum", "alone", {"enum": ["a", "b"]}, "c", "a"),
    _p("enum", "next to type (values of that type)", {"type": "string", "enum": ["a", "b"]},
       "c", "b"),
    _p("enum", "next to type (a value of another type)", {"type": "string", "enum": ["a", 1]},
       1, "a"),
    _p("const", "alone", {"const": "a"}, "b", "a"),
    _p("const", "next to maxLength (value too long)", {"const": "abc", "maxLength": 2}, "abc"),
    _p("minimum", "type integer", {"type": "integer", "minimum": 0}, -1, 0),
    _p("minimum", "without type", {"minimum": 0}, -1, 0),
    _p("maximum", "type number", {"type": "number", "maximum": 1.5}, 2, 1.5),
    _p("exclusiveMinimum", "type integer", {"type": "integer", "exclusiveMinimum": 0}, 0, 1),
    _p("exclusiveMaximum", "type number", {"type": "number", "exclusiveMaximum": 3}, 3, 2.5),
    _p("exclusiveMinimum", "draft-04 boolean form",
       {"type": "number", "minimum": 3, "exclusiveMinimum": True}, 3, 4),
    _p("exclusiveMinimum", "whole number, maximum less than 1 above",
       {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}, 0, 0.25),
    _p("exclusiveMaximum", "whole number, minimum less than 1 below",
       {"type": "number", "exclusiveMaximum": -1, "minimum": -1.5}, -1, -1.25),
    _p("exclusiveMinimum", "draft-04 form, maximum less than 1 above",
       {"type": "number", "minimum": 1, "exclusiveMinimum": True, "maximum": 1.5}, 1, 1.25),
    _p("minimum", "an integer past 2**53", {"type": "integer", "minimum": 2**53 + 1},
       2**53, 2**53 + 1),
    _p("minimum", "type number, an integer past 2**53",
       {"type": "number", "minimum": 2**53 + 1}, 2**53, 2**53 + 1),
    _p("exclusiveMaximum", "type number, a fraction past 1e10",
       {"type": "number", "exclusiveMaximum": 123456789012.3}, 123456789012.3, 123456789012),
    _p("exclusiveMaximum", "a double of 16 significant digits",
       {"type": "number", "exclusiveMaximum": 96836.12535043583}, 96836.12535043583, 96836),
    _p("const", "an integer past 2**53", {"const": 2**53 + 1}, 2**53, 2**53 + 1),
    _p("const", "an integer past 2**64", {"const": 2**64 + 1}, 1.8446744073709552e+19,
       2**64 + 1),
    _p("const", "a double of 17 significant digits", {"const": 123456789.12345679},
       123456789.1234568, 123456789.12345679),
    _p("multipleOf", "type integer", {"type": "integer", "multipleOf": 3}, 4, 6),
    _p("multipleOf", "type number", {"type": "number", "multipleOf": 120}, 7, 240),
    _p("multipleOf", "type integer, next to minimum",
       {"type": "integer", "multipleOf": 3, "minimum": 0}, 4, 3),
    _p("multipleOf", "type integer, fractional", {"type": "integer", "multipleOf": 1.5}, 1, 3),
    _p("minLength", "type string", {"type": "string", "minLength": 2}, "a", "ab"),
    _p("minLength", "without type", {"minLength": 2}, "a", "ab"),
    _p("minLength", "next to pattern", {"type": "string", "pattern": "^a+$", "minLength": 2},
       "a", "aa"),
    _p("maxLength", "type string", {"type": "string", "maxLength": 2}, "aaa", "aa"),
    _p("maxLength", "raw control character in the string (not JSON)",
       {"type": "string", "maxLength": 5}, Raw('"a\x0fb"'), "a\u000fb"),
    _p("minLength", "raw control character in the string (not JSON)",
       {"type": "string", "minLength": 1}, Raw('"a\x0fb"'), "a\u000fb"),
    _p("maxLength", "a valid string that needs an escape", {"type": "string", "maxLength": 5},
       "abcdef", 'a"b'),
    _p("maxLength", "type string or null", {"type": ["string", "null"], "maxLength": 2},
       "aaa", None),
    _p("type", "string with a raw control character (not JSON)", {"type": "string"},
       Raw('"a\x0fb"'), "a\u000fb"),
    _p("maxLength", "next to pattern", {"type": "string", "pattern": "^a+$", "maxLength": 2},
       "aaa", "aa"),
    _p("maxLength", "next to format", {"type": "string", "format": "email", "maxLength": 8},
       "abcdefgh@example.com", "a@b.io"),
    _p("pattern", "type string", {"type": "string", "pattern": "^a+$"}, "b", "aa"),
    _p("pattern", "without type", {"pattern": "^a+$"}, "b", "aa"),
    _p("pattern", "unanchored", {"type": "string", "pattern": "a"}, "b", "bab"),
    _p("pattern", "next to format", {"type": "string", "format": "email", "pattern": "^a"},
       "b@example.com", "a@example.com"),
    *[_p("format", name, {"type": "string", "format": name}, bad, good) for name, bad, good in [
        ("date", "2020-13-01", "2020-12-01"),
        ("date-time", "2020-01-01", "2020-01-01T10:00:00Z"),
        ("time", "25:00:00Z", "10:00:00Z"),
        ("duration", "P", "P1D"),
        ("email", "nope", "a@example.com"),
        ("hostname", "-a-", "example.com"),
        ("ipv4", "1.2.3", "1.2.3.4"),
        ("ipv6", "xyz", "::1"),
        ("uri", "not a uri", "https://example.com/a"),
        ("uri-reference", "\\\\", "/a/b"),
        ("uuid", "abc", "123e4567-e89b-12d3-a456-426614174000"),
        ("json-pointer", "a", "/a"),
        ("regex", "(", "a+"),
    ]],
    *[_p("format", f"{name}: {what}", {"type": "string", "format": name}, bad, good)
      for name, what, bad, good in [
        ("date", "day past the month's last", "2020-04-31", "2020-04-30"),
        ("date", "February 29 of a year that is not leap", "2100-02-29", "2000-02-29"),
        ("date-time", "day past the month's last", "1990-02-31T15:59:59Z",
         "1990-02-28T15:59:59Z"),
        ("time", "leap second at another minute", "23:58:60Z", "23:59:60Z"),
        ("ipv4", "leading zero", "01.2.3.4", "1.2.3.4"),
        ("ipv6", "IPv4 tail with a leading zero", "::ffff:1.2.3.04", "::ffff:1.2.3.4"),
        ("hostname", "label over 63 characters", "a" * 64 + ".com", "a" * 63 + ".com"),
    ]],
    _p("format", "color (no standard format)", {"type": "string", "format": "color"}, "abc",
       "red"),
    _p("format", "without type", {"format": "email"}, "nope", "a@example.com"),
    _p("items", "type array", {"type": "array", "items": _INT}, ["a"], [1]),
    _p("items", "without type", {"items": _INT}, ["a"], [1]),
    _p("items", "draft-07 tuple form", {"type": "array", "items": [_INT]}, ["a"], [1]),
    _p("prefixItems", "type array", {"type": "array", "prefixItems": [_INT]}, ["a"], [1]),
    _p("prefixItems", "next to items",
       {"type": "array", "prefixItems": [_INT], "items": {"type": "string"}}, [1, 2], [1, "a"]),
    _p("prefixItems", "under a draft-07 $schema (no keyword there)",
       {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
        "prefixItems": [_INT], "items": {"type": "string"}}, [1], ["a"]),
    _p("prefixItems", "under a draft-07 $schema, no items (any item there)",
       {"$schema": "http://json-schema.org/draft-07/schema#", "type": "array",
        "prefixItems": [_INT]}, "a", ["a", 1]),
    _p("additionalItems", "after draft-07 tuple items",
       {"type": "array", "items": [_INT], "additionalItems": False}, [1, 2], [1]),
    _p("minItems", "type array", {"type": "array", "items": _INT, "minItems": 1}, [], [1]),
    _p("maxItems", "type array", {"type": "array", "items": _INT, "maxItems": 1}, [1, 2], [1]),
    _p("maxItems", "without type", {"maxItems": 1}, [1, 2], [1]),
    _p("uniqueItems", "type array", {"type": "array", "items": _INT, "uniqueItems": True},
       [1, 1], [1, 2]),
    _p("contains", "type array", {"type": "array", "items": _INT, "contains": {"const": 5}},
       [1], [5]),
    _p("maxContains", "next to contains",
       {"type": "array", "items": _INT, "contains": {"const": 1}, "maxContains": 1}, [1, 1],
       [1]),
    _p("unevaluatedItems", "next to prefixItems",
       {"type": "array", "prefixItems": [_INT], "unevaluatedItems": False}, [1, 2], [1]),
    _p("properties", "type object", {"type": "object", "properties": {"a": _INT}},
       {"a": "x"}, {"a": 1}),
    _p("properties", "without type", {"properties": {"a": _INT}}, {"a": "x"}, {"a": 1}),
    _p("required", "names in properties",
       {"type": "object", "properties": {"a": _INT}, "required": ["a"]}, {}, {"a": 1}),
    _p("required", "a name not in properties",
       {"type": "object", "properties": {"a": {}}, "required": ["a", "b"]}, {"a": 1},
       {"a": 1, "b": 2}),
    _p("additionalProperties", "false, next to properties",
       {"type": "object", "properties": {"a": _INT}, "additionalProperties": False},
       {"b": 1}, {"a": 1}),
    _p("additionalProperties", "a schema", {"type": "object", "additionalProperties": _INT},
       {"b": "x"}, {"b": 1}),
    _p("patternProperties", "alone", {"type": "object", "patternProperties": {"^a": _INT}},
       {"ab": "x"}, {"ab": 1}),
    _p("patternProperties", "next to properties (a name matches)",
       {"type": "object", "properties": {"ab": {"type": "string"}},
        "patternProperties": {"^a": _INT}}, {"ab": "s"}, {}),
    _p("patternProperties", "next to properties (disjoint names)",
       {"type": "object", "properties": {"b": {"type": "string"}},
        "patternProperties": {"^a": _INT}}, {"ab": "s"}, {"b": "s", "ab": 1}),
    _p("patternProperties", "two overlapping patterns",
       {"type": "object", "patternProperties": {"^a": _INT, "b$": {"minimum": 0}}},
       {"ab": -1}, {"ab": 1}),
    _p("propertyNames", "alone", {"type": "object", "propertyNames": {"pattern": "^a"}},
       {"b": 1}, {"a": 1}),
    _p("propertyNames", "next to properties",
       {"type": "object", "properties": {"x": _INT}, "propertyNames": {"pattern": "^a"}},
       {"x": 1}, {}),
    _p("minProperties", "next to properties",
       {"type": "object", "properties": {"a": _INT, "b": _INT}, "minProperties": 2},
       {"a": 1}, {"a": 1, "b": 2}),
    _p("maxProperties", "next to additionalProperties",
       {"type": "object", "additionalProperties": _INT, "maxProperties": 1},
       {"a": 1, "b": 2}, {"a": 1}),
    _p("unevaluatedProperties", "next to properties",
       {"type": "object", "properties": {"a": _INT}, "unevaluatedProperties": False},
       {"b": 1}, {"a": 1}),
    _p("dependentRequired", "next to properties",
       {"type": "object", "properties": {"a": {}, "b": {}}, "dependentRequired": {"a": ["b"]}},
       {"a": 1}, {"a": 1, "b": 2}),
    _p("dependentSchemas", "next to properties",
       {"type": "object", "properties": {"a": {}, "b": _INT},
        "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}, {"a": 1, "b": 2}),
    _p("dependencies", "draft-07",
       {"type": "object", "properties": {"a": {}, "b": {}}, "dependencies": {"a": ["b"]}},
       {"a": 1}, {"a": 1, "b": 2}),
    _p("allOf", "one branch", {"allOf": [{"type": "integer", "minimum": 0}]}, -1, 1),
    _p("allOf", "two branches", {"allOf": [_INT, {"minimum": 0}]}, -1, 1),
    _p("allOf", "next to a sibling", {"allOf": [_INT], "minimum": 0}, -1, 1),
    _p("anyOf", "alone", {"anyOf": [_INT, {"type": "boolean"}]}, "a", 1),
    _p("anyOf", "next to a sibling", {"anyOf": [_INT, {"type": "string"}], "minimum": 5}, 3, 7),
    _p("oneOf", "disjoint branches", {"oneOf": [_INT, {"type": "string"}]}, True, 1),
    _p("oneOf", "overlapping branches", {"oneOf": [_INT, {"type": "number", "minimum": 0}]},
       1, 0.5),
    _p("oneOf", "next to a sibling", {"oneOf": [_INT, {"type": "string"}], "minimum": 5}, 3, 7),
    _p("oneOf", "object branches overlapping as written",
       {"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"]},
                  {"type": "object", "properties": {"m": _INT}}]}, {"k": "x"}, {"m": 1}),
    _p("oneOf", "object branches each requiring a property the other does not list",
       {"oneOf": [{"type": "object", "properties": {"k": {"type": "string"}}, "required": ["k"]},
                  {"type": "object", "properties": {"m": _INT}, "required": ["m"]}]},
       {"k": "x", "m": 1}, {"m": 1}),
    _p("not", "next to type", {"type": "integer", "not": {"const": 1}}, 1, 2),
    _p("if/then", "next to type",
       {"type": "integer", "if": {"minimum": 0}, "then": {"multipleOf": 2}}, 1, 2),
    _p("$ref", "to $defs", {"$ref": "#/$defs/a", "$defs": {"a": {"type": "integer",
                                                              "minimum": 0}}}, -1, 1),
    _p("$ref", "to definitions (draft-07)",
       {"$ref": "#/definitions/a", "definitions": {"a": {"type": "integer", "minimum": 0}}},
       -1, 1),
    _p("$ref", "next to a sibling", {"$ref": "#/$defs/a", "$defs": {"a": _INT}, "minimum": 0},
       -1, 1),
    _p("allOf", "of two $refs to objects listing other properties",
       {"allOf": [{"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}], "$defs": {
           "A": {"type": "object", "properties": {"a": _INT}},
           "B": {"type": "object", "properties": {"b": {"type": "string"}}}}},
       {"a": "x"}, {"a": 1, "b": "x"}),
    _p("anyOf", "branch listing fewer properties than its parent",
       {"type": "object", "properties": {"a": _INT, "b": {"type": "string"}},
        "anyOf": [{"properties": {"a": {"minimum": 0}}}]}, {"a": -1}, {"a": 1, "b": "x"}),
    _p("$ref", "percent-encoded", {"$ref": "#/x/a%20b", "x": {
        "a b": {"type": "array", "items": _INT, "uniqueItems": True}, "a%20b": {}}},
       [1, 1], [1, 2]),
    _p("$ref", "to an $anchor", {"$ref": "#a", "$defs": {"x": {"$anchor": "a", **_INT}}},
       "s", 1),
    _p("enum", "next to a draft-04 bound (its $schema's reading)",
       {"$schema": "http://json-schema.org/draft-04/schema#", "type": "number",
        "enum": [3, 4], "minimum": 3, "exclusiveMinimum": True}, 3, 4),
    _p("enum", "next to format date-time",
       {"type": "string", "enum": ["yesterday", "2020-01-01T10:00:00Z"],
        "format": "date-time"}, "yesterday", "2020-01-01T10:00:00Z"),
    _p("type", "empty list", {"type": []}, 1),
    _p("$ref", "to a schema under an unknown keyword",
       {"$ref": "#/x-schema", "x-schema": {"type": "integer", "not": {"const": 1}}}, 1, 2),
    _p("pattern", "lookahead", {"type": "string", "pattern": "^(?!a).*$"}, "a", "b"),
    _p("pattern", "an anchor inside the pattern", {"type": "string", "pattern": "^a$b"}, "ab"),
    _p("pattern", "a negated class that excludes a quote",
       {"type": "string", "pattern": '^[^"]+$'}, Raw('"\\""'), "abc"),
    _p("additionalProperties", "a schema, next to properties (a name spelled with an escape)",
       {"type": "object", "properties": {"a": _INT}, "additionalProperties": {"type": "string"}},
       Raw('{"\\u0061":"x"}'), {"a": 1, "b": "x"}),
    _p("additionalProperties", "true, next to properties (a name written twice)",
       {"type": "object", "properties": {"a": _INT}, "required": ["a"],
        "additionalProperties": True}, Raw('{"a":1,"\\u0061":"x"}'), {"a": 1, "b": "x"}),
    _p("properties", "in an allOf branch (a name spelled with an escape)",
       {"allOf": [{"type": "object", "properties": {"a": _INT}}]}, Raw('{"\\u0061":"x"}'),
       {"a": 1}),
    _p("properties", "next to a required name it does not list (a name written twice)",
       {"type": "object", "properties": {"a": _INT}, "required": ["a", "b"]},
       Raw('{"a":1,"b":1,"\\u0061":"x"}'), {"a": 1, "b": 2}),
    _p("patternProperties", "next to additionalProperties (a name spelled with an escape)",
       {"type": "object", "patternProperties": {"^a": _INT},
        "additionalProperties": {"type": "string"}}, Raw('{"\\u0061b":"x"}'),
       {"ab": 1, "c": "x"}),
    _p("additionalProperties", "a schema, next to properties and patternProperties",
       {"type": "object", "properties": {"a": _INT}, "patternProperties": {"^b": _INT},
        "additionalProperties": {"type": "string"}}, {"a": "x"}, {"a": 1, "c": "x"}),
    _p("minProperties", "next to additionalProperties (a name written twice)",
       {"type": "object", "additionalProperties": _INT, "minProperties": 2},
       Raw('{"b":1,"b":2}'), {"a": 1, "b": 2}),
    _p("maxItems", "type array without items", {"type": "array", "maxItems": 2}, [1, 2, 3],
       [1, 2]),
    _p("maxProperties", "type object without properties",
       {"type": "object", "maxProperties": 1}, {"a": 1, "b": 2}, {"a": 1}),
    _p("$schema", "draft-03 (its 'disallow' would be dropped)",
       {"$schema": "http://json-schema.org/draft-03/schema#", "type": ["integer", "string"],
        "disallow": "string"}, "a", 1),
    _p("x-guidance", "making llguidance lenient",
       {"type": "integer", "x-guidance": {"lenient": True}, "not": {"const": 1}}, 1, 2),
    _p("annotations", "title, description, examples, default, $comment, deprecated",
       {"type": "integer", "title": "t", "description": "d", "examples": [1], "default": 1,
        "$comment": "c", "deprecated": False}, "a", 1),
]


@dataclass(frozen=True)
class Outcome:
    """What one backend did with one probe under the default policy (and under "ignore")."""

    status: str  #: "enforced", "refused" (UnsupportedGuideError), "error" (compile error), "VIOLATION"
    detail: str = ""  #: the refusal's message
    valid_accepted: bool | None = None  #: None: no valid instance, or not compiled
    ignore: str = ""  #: where refused: "dropped", "enforced", "error" under "ignore"

    def cell(self) -> str:
        if self.status == "enforced":
            return "enforced" if self.valid_accepted is not False else \
                "enforced (also refuses the valid instance)"
        if self.status == "VIOLATION":
            return "**VIOLATION: the violating instance is accepted**"
        head = "refused" if self.status == "refused" else "refused (compile error)"
        tail = {"dropped": "dropped on `ignore`", "enforced": "enforced on `ignore`",
                "error": "`ignore` cannot compile it"}.get(self.ignore, "")
        return f"{head}; {tail}" if tail else head


def _instance_tokens(tokenizer: Any, instance: Any) -> list[int]:
    from capgraph.tokenizers import encode_continuation
    text = instance.text if isinstance(instance, Raw) else \
        json.dumps(instance, separators=(",", ":"), ensure_ascii=False)
    return encode_continuation(tokenizer, text)


def accepts(factory: Any, compiled: Any, tokenizer: Any, instance: Any) -> bool:
    """Whether a fresh matcher takes the instance's tokens and then the stop token."""
    matcher = factory.create_from_compiled(compiled)
    stop = factory.config.stop_token_ids[0]
    return all(matcher.accept_token(t) for t in [*_instance_tokens(tokenizer, instance), stop])


def run_probe(strict: Any, lenient: Any | None, tokenizer: Any, probe: Probe) -> Outcome:
    """The outcome of ``probe`` on a factory with the default policy (``strict``) and, for a
    refused schema, on one with ``json_unenforced_keywords="ignore"`` (``lenient``; None
    skips that part)."""
    from capgraph import GuidedDecodingParams
    from capgraph.errors import GrammarCompileError, UnsupportedGuideError

    params = GuidedDecodingParams.json_schema(probe.schema)
    try:
        compiled = strict.compile(params)
    except GrammarCompileError as e:
        status = "refused" if isinstance(e, UnsupportedGuideError) else "error"
        ignore = ""
        if lenient is not None:
            try:
                loose = lenient.compile(params)
            except GrammarCompileError:
                ignore = "error"
            else:
                ignore = "dropped" if accepts(lenient, loose, tokenizer, probe.violating) \
                    else "enforced"
        return Outcome(status, str(e), None, ignore)
    if accepts(strict, compiled, tokenizer, probe.violating):
        return Outcome("VIOLATION")
    valid = None if probe.valid is NO_VALID else \
        accepts(strict, compiled, tokenizer, probe.valid)
    return Outcome("enforced", "", valid)


def factories(tokenizer: Any) -> dict[str, tuple[Any, Any]]:
    """``backend -> (default-policy factory, "ignore" factory)`` for ``tokenizer``."""
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    out = {}
    for backend in BACKENDS:
        config = GuidedDecodingConfig.from_tokenizer(tokenizer, backend=backend)
        out[backend] = (create_matcher_factory(config), create_matcher_factory(
            dataclasses.replace(config, json_unenforced_keywords="ignore")))
    return out


def run_all(tokenizer: Any) -> dict[tuple[int, str], Outcome]:
    """Every probe on both backends: ``(probe index, backend) -> Outcome``."""
    results = {}
    for backend, (strict, lenient) in factories(tokenizer).items():
        for i, probe in enumerate(PROBES):
            results[(i, backend)] = run_probe(strict, lenient, tokenizer, probe)
    return results


def _fallback_cell(xg: Outcome, llg: Outcome) -> str:
    if xg.status == "enforced":
        return "xgrammar"
    if llg.status == "enforced":
        return "llguidance"
    return "refused"


def render(results: dict[tuple[int, str], Outcome], walk: dict | None) -> str:
    """The Markdown of docs/CONFORMANCE.md."""
    lines = [
        "# JSON Schema conformance, per keyword and backend",
        "",
        "Generated by `python tools/conformance_table.py` from the probes in that file (Tekken",
        "tokenizer, xgrammar and llguidance as installed); `tests/test_conformance_schema.py`",
        "fails when this file differs from what the probes give now. Do not edit by hand.",
        "",
        "Each row is a schema whose violating instance breaks only the named keyword. Under the",
        "default `json_unenforced_keywords=\"error\"` a backend either **enforces** it (the",
        "violating instance, fed token by token with the stop token, is refused; the valid",
        "instance is accepted) or **refuses** the schema (`UnsupportedGuideError` naming the",
        "keyword and its JSON pointer, from `capgraph/grammar/schema_policy.py` or from what",
        "the backend reports while compiling; \"compile error\": the backend's own error). After",
        "the `;`: what `json_unenforced_keywords=\"ignore\"` would do with a refused schema —",
        "\"dropped\" means it compiles and lets the violation through. `fallback` is the backend",
        "that serves the schema under `json_unenforced_keywords=\"fallback\"` with xgrammar",
        "configured. \"also refuses the valid instance\" marks a backend stricter than the",
        "schema: xgrammar anchors `pattern` and takes no escape inside a length-limited string",
        "(whose character class capgraph repairs: xgrammar's own lets raw control characters",
        "through; every way of letting an escape in costs seconds of compile or tens of",
        "milliseconds a mask there: `python tools/bench_length_escapes.py`,",
        "docs/BENCHMARKS.md). Both backends read the properties and items of a schema that lists some as",
        "the only ones allowed (xgrammar's strict reading; llguidance is given those defaults",
        "written out by `capgraph/grammar/semantics.py`). A JSON schema inside an",
        "xgrammar structural tag follows the xgrammar column: a `json_schema` element in JSON",
        "style is compiled as that JSON-schema guide, repairs included. Where xgrammar converts",
        "the schema itself (an XML-style element such as `qwen_xml_parameter`, a `%json` in a",
        "tag's Lark grammar) string length limits and listed names next to additional ones are",
        "refused, and an element with `any_order` is refused everywhere. A `%json` schema",
        "inside a Lark guide on llguidance follows the llguidance column.",
        "",
        "What a grammar sees is text, what a validator sees is the parsed value, and three",
        "places differ. Property names: JSON can spell a name with escapes (`\"\\u0061\"` is",
        "`a`) and write it twice (a parser keeps the last value). capgraph makes xgrammar take",
        "no escape in the name of an additional property, so that it cannot spell a listed one;",
        "llguidance cannot be repaired so and refuses listed names next to additional ones; and",
        "`minProperties` is refused wherever a name may be written twice. Numbers and `const`",
        "objects: both backends write a number one way only (`1`, not `1.0` or `1e0`) and",
        "a `const` or `enum` object with its keys in the given order, which is stricter, never",
        "looser. Formats: `format` is enforced as the format's definition. Where a backend's",
        "own regex for a format is wider (both backends' `date`, `date-time` and `time` take",
        "`2021-02-29`, xgrammar's also `2020-04-31`, and the second `60` at any minute;",
        "xgrammar's `ipv4` and `ipv6` take leading zeros, its `hostname` labels over 63",
        "characters) capgraph gives the schema an exact `pattern` in its place",
        "(`capgraph/grammar/formats.py`), which is stricter in two places: the year `0000`",
        "and a leap second written with an offset other than zero (`01:29:60+01:30`;",
        "`23:59:60Z` is taken) are refused. Not checked, on either backend: a `hostname`'s",
        "total length (253) and that an `xn--` label is valid Punycode.",
        "Next to a `pattern` (which only llguidance takes there) the exact pattern is a",
        "second pattern in an `allOf` branch; next to `enum` or `const` the values are the",
        "language.",
        "(JSON Schema makes asserting `format` optional; these cases come from the official",
        "test suite's `optional/format` files, run with `tools/schema_test_suite.py`.)",
        "",
        "Stricter in a few more places, never looser: a number a backend would not write",
        "exactly (llguidance reads schema numbers as doubles: integers past 2**53, doubles of",
        "17 significant digits, a bound of more than 15 or from 2**53; xgrammar: `const` /",
        "`enum` integers past 64 bits, a `number`'s integer bound past 2**53, and an",
        "exclusive bound of a `number` where doubles are sparser than its six fractional",
        "digits, from about 2**33: `exclusiveMaximum` 123456789012.3 let that number through)",
        "is refused on that backend; a raw DEL (U+007F) in a string is refused where its",
        "`\\u007f` escape is",
        "taken (llguidance: in any string; both: in an `enum` / `const` value); llguidance on a",
        "SentencePiece vocabulary (mistral-sp32k) takes an escaped quote in a listed property",
        "name as two tokens, not the tokenizer's own `\\\"` token.",
        "",
        "| keyword | next to / form | xgrammar | llguidance | fallback |",
        "|---|---|---|---|---|",
    ]
    for i, probe in enumerate(PROBES):
        xg, llg = results[(i, "xgrammar")], results[(i, "llguidance")]
        lines.append(f"| `{probe.keyword}` | {probe.context} | {xg.cell()} | {llg.cell()} | "
                     f"{_fallback_cell(xg, llg)} |")
    lines += ["", "## Differential walk", ""]
    if walk is None:
        lines.append("Not recorded yet: run `python tools/conformance_walk.py --record`.")
    else:
        lines += [
            "Random walks through `GuidedDecoder` under the mask (random logits, a sampled",
            "allowed token fed back, until a stop token or the length cap); every finished",
            "output validated with `jsonschema` (Draft 2020-12 or the schema's `$schema`, with",
            "the format checks that need no optional package: date, email, ipv4, ipv6, uuid).",
            "Schemas refused under the default policy are counted, not walked. The row",
            "`xgrammar-tag` walks each schema on xgrammar as the `json_schema` element of a",
            "structural tag `<t>...</t>`; its outputs must be that tag around valid JSON.",
            "",
            f"Command: `{walk['command']}`",
            "",
            "| backend | schemas | refused | walked | outputs validated | invalid | "
            "unfinished (length cap) |",
            "|---|---|---|---|---|---|---|",
        ]
        for backend, c in walk["backends"].items():
            lines.append(f"| {backend} | {c['schemas']} | {c['refused']} | {c['walked']} | "
                         f"{c['validated']} | {c['invalid']} | {c['unfinished']} |")
    return "\n".join(lines) + "\n"


def load_walk() -> dict | None:
    return json.loads(WALK_RECORD.read_text()) if WALK_RECORD.exists() else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="compare with the committed file instead of writing it")
    args = parser.parse_args(argv)
    from capgraph.tokenizers import load_tokenizer
    text = render(run_all(load_tokenizer("tekken")), load_walk())
    violations = text.count("VIOLATION")
    if args.check:
        same = DOC.exists() and DOC.read_text() == text
        print("docs/CONFORMANCE.md is current" if same else "docs/CONFORMANCE.md differs")
        return 0 if same and not violations else 1
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}: {len(PROBES)} probes x {len(BACKENDS)} backends, "
          f"{violations} violations")
    return 1 if violations else 0


if __name__ == "__main__":
    sys.exit(main())
