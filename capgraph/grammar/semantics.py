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
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["JSON_CONTAINER_SCHEMA", "JSON_WHITESPACE_CHARS", "ascii_classes",
           "ascii_schema_patterns"]

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
    try:
        schema = json.loads(schema_text)
    except ValueError:
        return schema_text

    def walk(node: Any) -> Any:
        if isinstance(node, list):
            return [walk(item) for item in node]
        if not isinstance(node, dict):
            return node
        result: dict[str, Any] = {}
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                result[key] = value
            elif key == "pattern" and isinstance(value, str):
                result[key] = ascii_classes(value)
            elif key == "patternProperties" and isinstance(value, dict):
                result[key] = {ascii_classes(k): walk(v) for k, v in value.items()}
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                result[key] = {k: walk(v) for k, v in value.items()}
            else:
                result[key] = walk(value)
        return result

    return json.dumps(walk(schema))
