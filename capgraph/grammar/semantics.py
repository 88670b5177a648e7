"""What a guide means, the same on every backend.

- ``GuideType.JSON`` is a JSON object or array (:data:`JSON_CONTAINER_SCHEMA`): xgrammar's
  builtin JSON grammar, and the same schema on llguidance.
- JSON whitespace (``GuidedDecodingConfig.json_whitespace``) is space, newline, carriage return
  and tab (:data:`JSON_WHITESPACE_CHARS`), between tokens only, as xgrammar reads it.
- Regex character-class escapes follow ECMA-262, as JSON Schema's ``pattern`` does: ``\\d`` is
  ``[0-9]`` and ``\\w`` is ``[0-9A-Za-z_]`` (ASCII, without the ``u``/``v`` flags' case
  folding), and ``\\s`` is Unicode whitespace (tab, vertical tab, form feed, space, no-break
  space, BOM, every ``Zs`` space, the line terminators). xgrammar already reads them so, for
  REGEX guides and schema patterns alike; llguidance reads ``\\d`` and ``\\w`` as Unicode
  classes (``1३4`` would match ``\\d+``), so the llguidance backend rewrites them with
  :func:`ascii_classes` / :func:`ascii_schema_patterns` first. Its ``\\s`` already agrees.
- Properties and items a JSON schema does not list are absent where it lists some (xgrammar's
  strict reading); llguidance is given those defaults written out (:func:`llguidance_schema`).
  Where an array or object schema lists none, any are allowed, as JSON Schema has it; xgrammar
  reads such a schema as ``[]`` / ``{}`` only once it has any keyword besides ``type``, so it
  is given ``items: true`` / ``additionalProperties: true`` written out
  (:func:`xgrammar_schema`).
"""

from __future__ import annotations

import json
import re
from typing import Any

from .schema_policy import subschemas

__all__ = ["JSON_CONTAINER_SCHEMA", "JSON_WHITESPACE_CHARS", "ascii_classes",
           "ascii_schema_patterns", "llguidance_schema", "xgrammar_schema"]

#: ``GuideType.JSON`` on every backend: a JSON object or array (the "JSON mode" of serving
#: engines; xgrammar's builtin JSON grammar, which fills a mask twice as fast as a schema).
JSON_CONTAINER_SCHEMA = '{"type": ["object", "array"]}'
#: JSON whitespace as both backends are configured to read it.
JSON_WHITESPACE_CHARS = " \n\r\t"

_DIGIT = "0-9"
_WORD = "0-9A-Za-z_"
# escape letter -> (outside a class, inside a class); negated ones nest a class, which
# llguidance's regex syntax reads as a union with the enclosing class
_REWRITE = {
    "d": (f"[{_DIGIT}]", _DIGIT),
    "D": (f"[^{_DIGIT}]", f"[^{_DIGIT}]"),
    "w": (f"[{_WORD}]", _WORD),
    "W": (f"[^{_WORD}]", f"[^{_WORD}]"),
}


def ascii_classes(pattern: str) -> str:
    """``pattern`` with ``\\d``, ``\\D``, ``\\w`` and ``\\W`` spelled as explicit ASCII classes,
    inside and outside character classes. Every other escape (``\\\\d`` is a backslash and a
    ``d``) and every other character is kept as written."""
    out: list[str] = []
    depth = 0  # character-class nesting (llguidance's syntax nests classes)
    i, n = 0, len(pattern)
    while i < n:
        ch = pattern[i]
        if ch == "\\" and i + 1 < n:
            letter = pattern[i + 1]
            rewrite = _REWRITE.get(letter)
            out.append(rewrite[1 if depth else 0] if rewrite else pattern[i:i + 2])
            i += 2
            continue
        if ch == "[":
            out.append(ch)
            i += 1
            if i < n and pattern[i] == "^":
                out.append("^")
                i += 1
            if i < n and pattern[i] == "]":  # a leading "]" is literal
                out.append("]")
                i += 1
            depth += 1
            continue
        if ch == "]" and depth:
            depth -= 1
        out.append(ch)
        i += 1
    return "".join(out)


# Keywords whose values are instances, not schemas: patterns inside them are data.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Keywords whose values map names (not keywords) to schemas (or, for draft-07's
# ``dependencies``, to lists of names).
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions", "dependentSchemas",
                          "dependencies"})


def ascii_schema_patterns(schema_text: str) -> str:
    """The JSON schema ``schema_text`` with :func:`ascii_classes` applied to every ``pattern``
    and every ``patternProperties`` key; text that is not JSON is returned unchanged."""
    return _rewrite(schema_text, unlisted_absent=False)


def llguidance_schema(schema_text: str) -> str:
    """The JSON schema ``schema_text`` as llguidance must be given it to mean what xgrammar
    reads: :func:`ascii_classes` in every pattern, and properties and items a schema does not
    list are absent.

    xgrammar (in the strict mode capgraph compiles with) reads an object schema that lists
    ``properties`` or ``patternProperties`` without ``additionalProperties`` /
    ``unevaluatedProperties`` as allowing no other property, and ``prefixItems`` (or draft-07's
    list-form ``items``) without ``items`` / ``additionalItems`` / ``unevaluatedItems`` as
    allowing no further item; llguidance reads JSON Schema's default (allowed). (A schema
    that ``required`` a property it does not list means the default, and keeps it.) So those
    defaults are written out as ``false`` for llguidance, on every schema that describes the
    instance itself or one of its parts: the root, property and item schemas, ``anyOf`` /
    ``oneOf`` branches and ``$defs`` / ``definitions`` entries. Conditions (``not``, ``if``,
    ``contains``, ``propertyNames``, ...) and ``allOf`` branches (which xgrammar merges with
    their parent before it reads them) are left as written. A bare ``{"type": "object"}`` or ``{"type": "array"}`` allows anything on
    both. Text that is not JSON is returned unchanged."""
    return _rewrite(schema_text, unlisted_absent=True)


# Where a subschema describes (part of) the instance itself, so the strict reading applies to
# it: keyword -> how it holds subschemas ("one", "list", "map").
_DESCRIBING = {"properties": "map", "patternProperties": "map", "additionalProperties": "one",
               "items": "one", "prefixItems": "list", "additionalItems": "one",
               "anyOf": "list", "oneOf": "list", "$defs": "map", "definitions": "map"}


def _strict_defaults(node: dict[str, Any], result: dict[str, Any]) -> None:
    """Write out xgrammar's reading of unlisted properties and items into ``result``."""
    required = node.get("required")
    requires_unlisted = isinstance(required, list) and any(
        not _listed(node, name) for name in required)
    if (("properties" in node or "patternProperties" in node) and not requires_unlisted
            and "additionalProperties" not in node and "unevaluatedProperties" not in node):
        result["additionalProperties"] = False
    if "prefixItems" in node:
        if "items" not in node and "unevaluatedItems" not in node:
            result["items"] = False
    elif isinstance(node.get("items"), list):  # draft-07's tuple form
        if "additionalItems" not in node and "unevaluatedItems" not in node:
            result["additionalItems"] = False


def _listed(node: dict[str, Any], name: Any) -> bool:
    """Whether the object schema ``node`` lists property ``name`` (by name or pattern; a
    pattern Python cannot read counts as not listing it)."""
    listed = node.get("properties")
    if isinstance(listed, dict) and name in listed:
        return True
    patterns = node.get("patternProperties")
    for pattern in patterns if isinstance(patterns, dict) and isinstance(name, str) else ():
        try:
            if re.search(pattern, name):
                return True
        except (re.error, TypeError):
            continue
    return False


def _rewrite(schema_text: str, unlisted_absent: bool) -> str:
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text

    def walk(node: Any, describes: bool) -> Any:
        if isinstance(node, list):
            return [walk(item, describes) for item in node]
        if not isinstance(node, dict):
            return node
        result: dict[str, Any] = {}
        for key, value in node.items():
            inner = describes and key in _DESCRIBING
            if key in _DATA_KEYWORDS:
                result[key] = value
            elif key == "pattern" and isinstance(value, str):
                result[key] = ascii_classes(value)
            elif key == "patternProperties" and isinstance(value, dict):
                result[key] = {ascii_classes(k): walk(v, inner) for k, v in value.items()}
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                result[key] = {k: walk(v, inner) for k, v in value.items()}
            else:
                result[key] = walk(value, inner)
        if unlisted_absent and describes:
            _strict_defaults(node, result)
        return result

    return json.dumps(walk(schema, True))


# What xgrammar 0.2.9 skips when it decides whether a schema is a bare {"type": "array"} /
# {"type": "object"} (its builtin any-array / any-object): its annotation keywords.
_XGRAMMAR_ANNOTATIONS = frozenset({"title", "default", "description", "examples", "deprecated",
                                   "readOnly", "writeOnly", "$comment", "$schema"})
# The keywords that list items / properties (or, for propertyNames, already let xgrammar admit
# any name it allows).
_LISTS_ITEMS = ("items", "prefixItems", "unevaluatedItems")
_LISTS_PROPERTIES = ("properties", "patternProperties", "additionalProperties",
                     "unevaluatedProperties", "propertyNames")
# Keywords whose schemas xgrammar reads together with their sibling keywords; such a schema is
# left as written (the keyword policy refuses them next to other assertions).
_COMBINED_WITH_SIBLINGS = ("$ref", "allOf", "anyOf", "oneOf")


def xgrammar_schema(schema_text: str) -> str:
    """The JSON schema ``schema_text`` as xgrammar must be given it to mean what capgraph
    documents: an array or object schema that lists no items / properties allows any.

    xgrammar 0.2.9 (strict mode) reads ``{"type": "array", "maxItems": 5}`` as admitting only
    ``[]`` (``"minItems": 1`` then fails to compile) and ``{"type": "object",
    "maxProperties": 3}`` as admitting only ``{}``: every schema whose ``type`` is or lists
    ``"array"`` / ``"object"``, that has a keyword besides ``type`` and annotations, and lists
    none of ``items`` / ``prefixItems`` / ``unevaluatedItems`` (arrays) or ``properties`` /
    ``patternProperties`` / ``additionalProperties`` / ``unevaluatedProperties`` /
    ``propertyNames`` (objects). Such schemas get ``"items": true`` / ``"additionalProperties":
    true``, at every schema position (:func:`~capgraph.grammar.schema_policy.subschemas`); the
    keywords added are no-ops in JSON Schema, and no existing key moves, so JSON pointers stay
    the same. Left as written: a bare ``{"type": "array"}`` (xgrammar's any-array already), a
    schema without ``type`` (xgrammar reads ``{"maxItems": 5}`` as any value), ``enum`` /
    ``const`` schemas (their values win) and schemas next to ``$ref`` / ``allOf`` / ``anyOf`` /
    ``oneOf`` (read together with those). Text that is not a JSON object, and a schema with
    nothing to add, are returned unchanged."""
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text
    if not isinstance(schema, dict):
        return schema_text
    changed = False
    stack: list[Any] = [schema]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict):
            continue  # a boolean schema, or malformed: xgrammar's own error says so
        stack.extend(sub for sub, _ in subschemas(node))
        changed |= _allow_unlisted(node)
    return json.dumps(schema) if changed else schema_text


def _allow_unlisted(node: dict[str, Any]) -> bool:
    """Write ``items: true`` / ``additionalProperties: true`` into ``node`` where xgrammar
    would read it as admitting no item / property (:func:`xgrammar_schema`); whether it did."""
    kind = node.get("type")
    types = [kind] if isinstance(kind, str) else kind if isinstance(kind, list) else []
    if ("array" not in types and "object" not in types) or "enum" in node or "const" in node \
            or any(k in node for k in _COMBINED_WITH_SIBLINGS) \
            or all(k == "type" or k in _XGRAMMAR_ANNOTATIONS for k in node):
        return False
    changed = False
    if "array" in types and not any(k in node for k in _LISTS_ITEMS):
        node["items"] = True
        changed = True
    if "object" in types and not any(k in node for k in _LISTS_PROPERTIES):
        node["additionalProperties"] = True
        changed = True
    return changed
