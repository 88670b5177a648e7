"""JSON-schema keywords a backend accepts but does not enforce, found before compiling.

xgrammar 0.2.9 compiles these without error and then allows output that violates them
(measured: a violating instance is accepted token by token). Silently dropping a constraint is
worse than refusing it, so by default such a schema fails to compile with an
:class:`~capgraph.errors.UnsupportedGuideError` naming the keyword and where it is.
"""

from __future__ import annotations

from typing import Any, Iterator

__all__ = ["XGRAMMAR_UNENFORCED", "unenforced_keywords"]

#: Keywords xgrammar 0.2.9 ignores (checked with violating instances; see the tests).
XGRAMMAR_UNENFORCED = frozenset({"not", "if", "then", "else", "dependentSchemas",
                                 "dependentRequired", "uniqueItems", "contains", "minContains",
                                 "maxContains"})

# Where subschemas live (JSON Schema 2020-12 and draft-04..07 spellings).
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
               "unevaluatedProperties", "propertyNames", "contains", "not", "if", "then", "else")


def unenforced_keywords(schema: Any, unenforced: frozenset[str] = XGRAMMAR_UNENFORCED,
                        path: str = "") -> Iterator[tuple[str, str]]:
    """Yield ``(keyword, JSON pointer)`` for every unenforced keyword (and remote ``$ref``) in
    schema positions of ``schema``; property names that happen to spell a keyword are not
    reported."""
    if not isinstance(schema, dict):
        return
    for keyword in sorted(unenforced.intersection(schema)):
        yield keyword, path or "/"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        yield "$ref (remote)", path or "/"
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                yield from unenforced_keywords(value, unenforced, f"{path}/{key}/{name}")
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                yield from unenforced_keywords(value, unenforced, f"{path}/{key}/{i}")
    for key in _SCHEMA_ONE:
        sub = schema.get(key)
        if isinstance(sub, dict):
            yield from unenforced_keywords(sub, unenforced, f"{path}/{key}")
        elif key == "items" and isinstance(sub, list):  # draft-04..07 tuple items
            for i, value in enumerate(sub):
                yield from unenforced_keywords(value, unenforced, f"{path}/items/{i}")
