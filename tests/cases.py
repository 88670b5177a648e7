"""Guides with valid and invalid texts, shared by the grammar and decoder tests.

Hand-written cases plus two schemas in the style of public function-calling benchmarks
(BFCL-like tool calls with nested objects, enums, arrays and numeric bounds).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from capgraph import GuidedDecodingParams, GuideType


@dataclass(frozen=True)
class Case:
    name: str
    params: GuidedDecodingParams
    valid: str
    invalid: str  # a text whose some prefix the grammar must reject


TOOL_CALL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "get_time"]},
        "arguments": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}

ORDER_SCHEMA = {
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "items": {
            "type": "array",
            "minItems": 1,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string"},
                    "qty": {"type": "integer"},
                    "price": {"type": "number"},
                },
                "required": ["sku", "qty"],
            },
        },
        "express": {"type": "boolean"},
        "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    },
    "required": ["order_id", "items", "express"],
}

ARITH_EBNF = r'''
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= factor (("*" | "/") factor)*
factor ::= [0-9]+ | "(" expr ")"
'''

CSV_EBNF = r'''
root ::= row ("\n" row)*
row ::= field ("," field)*
field ::= [a-z]+ | [0-9]+
'''

STRUCTURAL_TAG = json.dumps({
    "type": "structural_tag",
    "format": {
        "type": "triggered_tags",
        "triggers": ["<tool="],
        "tags": [{
            "type": "tag",
            "begin": "<tool=get_weather>",
            "content": {"type": "json_schema",
                        "json_schema": TOOL_CALL_SCHEMA["properties"]["arguments"]},
            "end": "</tool>",
        }],
        "at_least_one": False,
        "stop_after_first": True,
    },
})

CASES = [
    Case("json_schema_tool", GuidedDecodingParams(GuideType.JSON_SCHEMA, json.dumps(TOOL_CALL_SCHEMA)),
         '{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}',
         '{"name": "launch_rocket"'),
    Case("json_schema_order", GuidedDecodingParams(GuideType.JSON_SCHEMA, json.dumps(ORDER_SCHEMA)),
         '{"order_id": "FR-2024", "items": [{"sku": "A1", "qty": 2, "price": 9.5}], '
         '"express": true, "note": null}',
         '{"order_id": "fr-'),
    Case("regex_phone", GuidedDecodingParams(GuideType.REGEX, r"\+\d{1,3} \(\d{3}\) \d{3}-\d{4}"),
         "+33 (555) 123-4567", "+33 (55a"),
    Case("ebnf_arith", GuidedDecodingParams(GuideType.EBNF_GRAMMAR, ARITH_EBNF),
         "(12+3)*4-56/7", "(12+)"),
    Case("ebnf_csv", GuidedDecodingParams(GuideType.EBNF_GRAMMAR, CSV_EBNF),
         "abc,12\nxyz,7,q", "abc,,"),
    Case("json_any", GuidedDecodingParams(GuideType.JSON, ""),
         '[1, {"a": null, "b": [true, 2.5e3]}, "x"]', '{"a" 1'),
    Case("structural_tag", GuidedDecodingParams(GuideType.STRUCTURAL_TAG, STRUCTURAL_TAG),
         'Let me check. <tool=get_weather>{"city": "Oslo", "days": 2}</tool>',
         'Let me check. <tool=get_weather>{"town"'),
]

# Lark versions for the llguidance backend (same languages as the EBNF cases above).
ARITH_LARK = r'''
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: /[0-9]+/ | "(" expr ")"
'''

LLG_CASES = [c for c in CASES if c.params.guide_type in (GuideType.JSON_SCHEMA, GuideType.REGEX)]
LLG_CASES.append(Case("lark_arith", GuidedDecodingParams(GuideType.EBNF_GRAMMAR, ARITH_LARK),
                      "(12+3)*4-56/7", "(12+)"))


def public_cases(categories=("BFCL", "Glaiveai2K", "JME", "Kubernetes", "JsonSchemaStore",
                             "WashingtonPost", "Github_medium", "Snowplow")) -> list[Case]:
    """One public schema per category with its first valid instance (JSONSchemaBench subset
    shipped in capgraph/data, MIT; see jsonschemabench.NOTICE)."""
    from importlib import resources
    text = resources.files("capgraph").joinpath("data/jsonschemabench.jsonl").read_text()
    taken: dict[str, Case] = {}
    for line in text.splitlines():
        rec = json.loads(line)
        if rec["category"] in categories and rec["category"] not in taken:
            taken[rec["category"]] = Case(
                f"public_{rec['id']}", GuidedDecodingParams(GuideType.JSON_SCHEMA,
                                                            json.dumps(rec["schema"])),
                json.dumps(rec["instances"][0]), "")
    return list(taken.values())


def nested_anyof_schema(depth: int) -> dict:
    """A JSON schema of ``depth`` nested anyOf levels (object or array around the level below):
    a hostile compile for xgrammar (about 2 s at depth 10, minutes at 14 on 2 cores)."""
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"anyOf": [{"type": "object",
                             "properties": {"a": schema, "b": {"type": "string"}}},
                            {"type": "array", "items": schema}]}
    return schema


def accepts(factory, tok, params: GuidedDecodingParams, text: str) -> bool:
    """Whether a fresh matcher of ``factory`` accepts ``text`` (the tokenizer ``tok``'s own
    encoding) token by token and the stop token may follow it."""
    from capgraph.tokenizers import encode_continuation
    matcher = factory.create(params)
    for t in encode_continuation(tok, text):
        if not matcher.accept_token(t):
            return False
    return matcher.accept_token(factory.config.stop_token_ids[0])
