"""Which JSON-schema constraints each backend enforces, decided before compiling.

Both backends accept JSON schemas whose constraints they do not fully enforce: xgrammar 0.2.9
compiles ``{"type": "number", "multipleOf": 120}`` and then lets ``7`` through, and llguidance
drops whatever its ``x-guidance`` options tell it to ignore. A constraint silently dropped is
worse than a refused schema, so :func:`unenforced` walks every schema position and reports each
keyword that is *not positively known* to be enforced by the backend, with the JSON pointer of
the schema that holds it.

The decision is an allow-list per backend, keyword and combination (:data:`XGRAMMAR` and
:data:`LLGUIDANCE`): a keyword of the JSON Schema vocabulary (draft 2020-12 and draft-04..07
spellings) is enforced only where its rule says so, given its sibling keywords; a vocabulary
keyword without a rule is reported. Annotations (``title``, ``description``, ``default``,
``examples``, ...) and keywords outside the vocabulary carry no assertion: JSON Schema
validators ignore them, so leaving them out of the grammar drops nothing. A few values are
no-ops wherever they appear (``uniqueItems: false``, ``additionalProperties: true``, ...), and
a keyword for instances that ``type`` excludes (``minLength`` next to ``"type": "integer"``)
asserts nothing either. A ``$schema`` naming draft-03 or earlier is reported wherever it
appears: that draft asserts with keywords (``disallow``, ``divisibleBy``, ``extends``) that
later drafts, and so both backends, read as unknown ones.

The rules are pinned by ``tests/test_conformance_schema.py``: for an enforced keyword, an
instance that violates only it is refused token by token; for a reported one, the schema is
refused by default. ``docs/CONFORMANCE.md`` is generated from the same probes
(``tools/conformance_table.py``). Backend reports made while compiling (xgrammar's logged
warnings, llguidance's grammar warnings) are a second net, applied by the backends.
"""

from __future__ import annotations

import contextlib
import decimal
import functools
import json
import math
import threading
import time
import urllib.parse
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import regex

from .lark_text import LarkTextError, lark_json_values

__all__ = ["Unenforced", "Pointer", "unenforced", "unenforced_in_tag", "plain_tag_schema",
           "describe",
           "schema_positions", "schema_nodes", "subschemas", "ANNOTATIONS", "VOCABULARY",
           "XGRAMMAR", "XGRAMMAR_TAG", "XGRAMMAR_XML", "LLGUIDANCE", "xml_style",
           "XGRAMMAR_FORMATS", "LLGUIDANCE_FORMATS"]


class Pointer:
    """A JSON pointer kept as a link to its parent's and one more token, written out only
    when read (``str()``): a walk over nested schemas with long property names then costs
    time and memory linear in the schema's size, not in its depth times its names
    (``tests/test_conformance_schema.py::test_policy_walk_keeps_no_pointer_per_node``)."""

    __slots__ = ("parent", "token")

    def __init__(self, parent: "Pointer | None" = None, token: str = "") -> None:
        self.parent = parent
        self.token = token  #: the escaped token this pointer adds to its parent's

    def child(self, *tokens: str) -> "Pointer":
        """This pointer followed by ``tokens`` (unescaped)."""
        p = self
        for t in tokens:
            p = Pointer(p, _escape(t))
        return p

    @property
    def is_root(self) -> bool:
        return self.parent is None

    def __str__(self) -> str:
        parts: list[str] = []
        p: Pointer | None = self
        while p is not None and p.parent is not None:
            parts.append(p.token)
            p = p.parent
        return "".join("/" + t for t in reversed(parts))

    def __repr__(self) -> str:
        return f"Pointer({str(self)!r})"


_ROOT = Pointer()


@dataclass(frozen=True, slots=True)
class Unenforced:
    """A keyword the backend would not enforce: where it is and why."""

    keyword: str
    where: object  #: the schema object holding the keyword, written out by ``str()``
    reason: str
    prefix: str = ""  #: written before ``where`` (the place of the schema in a larger document)

    @property
    def pointer(self) -> str:
        """JSON pointer of the schema object holding the keyword ("" is the root)."""
        return self.prefix + str(self.where)

    def __str__(self) -> str:
        return f"'{self.keyword}' at {_short(self.pointer) or '/'} ({self.reason})"


def _short(text: str, most: int = 160) -> str:
    """``text``, its middle cut out where it is longer than ``most`` characters."""
    if len(text) <= most:
        return text
    return f"{text[:most // 2]}...({len(text) - most} characters)...{text[-most // 2:]}"


#: Keywords that assert nothing about an instance (meta-data, content and core annotations).
ANNOTATIONS = frozenset({
    "$schema", "$comment", "$vocabulary", "title", "description", "default", "examples",
    "deprecated", "readOnly", "writeOnly", "contentEncoding", "contentMediaType",
    "contentSchema"})

# Keyword -> the instance types it constrains (None: every type).
_NUMERIC = frozenset({"integer", "number"})
_APPLIES_TO: dict[str, frozenset[str] | None] = {
    **dict.fromkeys(("multipleOf", "minimum", "maximum", "exclusiveMinimum",
                     "exclusiveMaximum"), _NUMERIC),
    **dict.fromkeys(("minLength", "maxLength", "pattern", "format"), frozenset({"string"})),
    **dict.fromkeys(("items", "prefixItems", "additionalItems", "unevaluatedItems", "contains",
                     "minContains", "maxContains", "minItems", "maxItems", "uniqueItems"),
                    frozenset({"array"})),
    **dict.fromkeys(("properties", "patternProperties", "additionalProperties",
                     "unevaluatedProperties", "propertyNames", "required", "minProperties",
                     "maxProperties", "dependentRequired", "dependentSchemas", "dependencies"),
                    frozenset({"object"})),
    **dict.fromkeys(("type", "enum", "const", "allOf", "anyOf", "oneOf", "not", "if", "then",
                     "else", "$ref", "$dynamicRef", "$recursiveRef", "$id", "id", "$anchor",
                     "$dynamicAnchor", "$recursiveAnchor", "$defs", "definitions"), None),
}
#: Every keyword of the vocabulary that is not an annotation.
VOCABULARY = frozenset(_APPLIES_TO)

# Where subschemas live: a map of them, a list of them, or one.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas",
                "dependencies")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalItems", "additionalProperties", "unevaluatedItems",
               "unevaluatedProperties", "propertyNames", "contains", "not", "if", "then", "else")
_CONTAINERS = frozenset({"$defs", "definitions"})  # hold subschemas, assert nothing themselves
_APPLICATORS = frozenset({"allOf", "anyOf", "oneOf", "not", "if", "then", "else", "$ref",
                          "$dynamicRef", "$recursiveRef", "dependentSchemas", "dependencies",
                          "contains"})

# Values that constrain nothing, wherever they appear.
_NO_OPS: dict[str, tuple[Any, ...]] = {
    "uniqueItems": (False,), "additionalProperties": (True, {}), "items": (True, {}),
    "minItems": (0,), "minLength": (0,), "minProperties": (0,), "required": ([],),
    "unevaluatedProperties": (True, {}), "unevaluatedItems": (True, {}), "minContains": (1,),
    "dependentRequired": ({},), "dependentSchemas": ({},), "patternProperties": ({},),
    "properties": ({},), "$defs": ({},), "definitions": ({},)}

#: ``format`` values whose violations xgrammar 0.2.9 refuses (each pinned by a test).
XGRAMMAR_FORMATS = frozenset({"date", "date-time", "time", "duration", "email", "hostname",
                              "ipv4", "ipv6", "uri", "uri-reference", "uuid", "json-pointer"})
#: ``format`` values llguidance enforces (it refuses to compile any other).
LLGUIDANCE_FORMATS = frozenset({"date", "date-time", "time", "duration", "email", "hostname",
                                "ipv4", "ipv6", "uri", "uuid"})

Rule = Callable[["_Node"], "str | None"]  # None: enforced; else why not


@dataclass(frozen=True, slots=True)
class _Node:
    """One schema object under analysis, with what the rules need to judge its keywords."""

    schema: Mapping[str, Any]
    keyword: str
    root: Any
    is_root: bool
    #: llguidance: the ids of the schema objects ``llguidance_schema`` writes its strict
    #: defaults into (:func:`~capgraph.grammar.semantics.llguidance_described`); else None
    described: "set[int] | None" = None

    @property
    def value(self) -> Any:
        return self.schema[self.keyword]

    def types(self) -> frozenset[str] | None:
        t = self.schema.get("type")
        if isinstance(t, str):
            return frozenset({t})
        if isinstance(t, list) and all(isinstance(x, str) for x in t):
            return frozenset(t)
        return None

    def siblings(self) -> set[str]:
        """The other asserting keywords next to this one (annotations, containers and no-op
        values left out)."""
        return {k for k in self.schema
                if k != self.keyword and k in VOCABULARY and k not in _CONTAINERS
                and not (k in ("$id", "id") and self.is_root) and not _is_no_op(k, self.schema[k])}


def _vacuous(node: _Node) -> bool:
    """Whether ``type`` excludes every instance the keyword constrains (``minLength`` next to
    ``"type": "integer"``): then it asserts nothing, enforced or not."""
    applies = _APPLIES_TO.get(node.keyword)
    types = node.types()
    if applies is None or types is None:
        return False
    return not applies & types


def _is_no_op(keyword: str, value: Any) -> bool:
    return any(type(value) is type(v) and value == v for v in _NO_OPS.get(keyword, ()))


# -- rule builders -----------------------------------------------------------------------------
def _needs_type(node: _Node) -> str | None:
    """Type-specific keywords are applied by xgrammar only where ``type`` names a type."""
    if node.types() is None:
        return f"xgrammar applies '{node.keyword}' only next to a 'type'"
    return None


def _alone(*allowed: str) -> Callable[[_Node], str | None]:
    """Enforced only without asserting siblings other than ``allowed``."""
    def rule(node: _Node) -> str | None:
        extra = sorted(node.siblings() - set(allowed))
        if extra:
            return f"not enforced next to {', '.join(repr(k) for k in extra)}"
        return None
    return rule


def _all(*rules: Rule) -> Rule:
    def rule(node: _Node) -> str | None:
        for r in rules:
            why = r(node)
            if why is not None:
                return why
        return None
    return rule


def _without(*keywords: str) -> Rule:
    def rule(node: _Node) -> str | None:
        present = sorted(set(keywords) & node.siblings())
        if present:
            return f"not enforced next to {', '.join(repr(k) for k in present)}"
        return None
    return rule


def _ok(node: _Node) -> str | None:
    return None


def _local_ref(node: _Node) -> str | None:
    ref = node.value
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return f"{ref!r} is not a local '#/...' reference"
    if _resolve(node.root, ref) is _MISSING:
        return f"{ref!r} does not resolve inside the schema"
    return None


def _root_only(node: _Node) -> str | None:
    return None if node.is_root else "a nested identifier changes how '$ref' resolves"


def _formats(known: frozenset[str], backend: str) -> Rule:
    def rule(node: _Node) -> str | None:
        if node.value not in known:
            return f"format {node.value!r} is not checked by {backend}"
        return None
    return rule


def _integer_multiple(node: _Node) -> str | None:
    types = node.types() or frozenset()
    if "number" in types:
        return "xgrammar ignores multipleOf on type 'number'"
    if not isinstance(node.value, int) or isinstance(node.value, bool):
        return "xgrammar ignores a non-integer multipleOf"
    return None


def _required_declared(node: _Node) -> str | None:
    props = node.schema.get("properties")
    names = node.value if isinstance(node.value, list) else []
    missing = [n for n in names if not isinstance(props, dict) or n not in props]
    if missing:
        return f"xgrammar ignores required names not in 'properties': {missing[:3]}"
    return None


#: Seconds of regex matching one schema check (:func:`unenforced`, :func:`unenforced_in_tag`)
#: may spend on the guide's own patterns (``patternProperties`` against listed names, an
#: ``enum``'s values against a sibling ``pattern``). Matching runs on the ``regex`` module,
#: which releases the GIL and stops at its timeout: a backtracking pattern (``^(a|aa)+$``
#: against 40 ``a`` and a ``!``) costs this compile that long at most and no other thread
#: anything; past it the check cannot decide, and the keyword is reported as not known to be
#: enforced (the schema is refused, never served unchecked).
REGEX_CHECK_SECONDS = 0.5

_budget = threading.local()  # .deadline: the perf_counter() the running check stops at


class RegexUndecided(Exception):
    """A guide's regex did not finish within the check's :data:`REGEX_CHECK_SECONDS`."""


@contextlib.contextmanager
def _regex_budget() -> Iterator[None]:
    """One :data:`REGEX_CHECK_SECONDS` for every regex match of the check inside (a check
    nested in another shares the outer one's)."""
    if getattr(_budget, "deadline", None) is not None:
        yield
        return
    _budget.deadline = time.perf_counter() + REGEX_CHECK_SECONDS
    try:
        yield
    finally:
        _budget.deadline = None


def _search(pattern: str, text: str) -> bool:
    """Whether the ECMA-262 regex ``pattern`` (a schema's ``pattern`` or ``patternProperties``
    key) matches somewhere in ``text``, as ECMA-262 reads it (:func:`_as_ecma`), on the
    ``regex`` module within what is left of the running check's budget.

    Raises:
        RegexUndecided: past the budget (outside a budgeted check: one of its own).
        regex.error: ``pattern`` does not compile, or is no ECMA-262 regex capgraph reads.
    """
    deadline = getattr(_budget, "deadline", None)
    left = REGEX_CHECK_SECONDS if deadline is None else deadline - time.perf_counter()
    if left <= 0:
        raise RegexUndecided(f"pattern {pattern[:40]!r}: over {REGEX_CHECK_SECONDS} s")
    try:
        return regex.search(_as_ecma(pattern), text, flags=_ECMA_FLAGS,
                            timeout=left) is not None
    except TimeoutError:
        raise RegexUndecided(f"pattern {pattern[:40]!r}: over {REGEX_CHECK_SECONDS} s") \
            from None


_RUST_HEX = regex.compile(r"\\x\{([0-9A-Fa-f]+)\}")
_BACKREFERENCE = regex.compile(r"\\(?:[1-9]|k<)")

#: How :func:`_search` runs :func:`_as_ecma`'s patterns: nested classes are unions (as in
#: Rust, whose syntax the patterns are written in), ``\\b`` is ECMA's ASCII boundary.
_ECMA_FLAGS = regex.V1 | regex.ASCII


@functools.lru_cache(maxsize=4096)
def _as_ecma(pattern: str) -> str:
    """The ECMA-262 regex ``pattern`` written for the ``regex`` module (searched with
    :data:`_ECMA_FLAGS`) with ECMA's meaning: every class, ``\\d``, ``\\w``, ``\\s`` and
    ``.`` written out as ECMA reads them (as for llguidance:
    :func:`~capgraph.grammar.semantics.ecma_regex`; ``[[:alpha:]]`` is a class and a ``]``,
    ``\\s`` holds U+FEFF, ``\\d`` is ASCII, ``[\\S]`` a class of a negated set), ``{,3}``
    literal text, and ``$`` only at the end (Python's ``$`` also matches before a final
    newline).

    Raises:
        regex.error: ``pattern`` is no ECMA-262 regex capgraph reads, or holds a
            backreference (ECMA matches one to a group that has not matched as empty; the
            ``regex`` module fails it).
    """
    from .semantics import ecma_regex
    try:
        rust = ecma_regex(pattern, "llguidance", "JSON_SCHEMA")
    except Exception as e:  # noqa: BLE001 - refused constructs: not checkable here
        raise regex.error(f"{type(e).__name__}: {e}") from None
    out: list[str] = []
    i, depth = 0, 0  # (depth: the classes open here, nested ones included)
    while i < len(rust):
        c = rust[i]
        if c == "\\":
            if depth == 0 and _BACKREFERENCE.match(rust, i):
                raise regex.error(f"pattern {pattern[:40]!r} holds a backreference")
            m = _RUST_HEX.match(rust, i)
            if m is not None:
                out.append(f"\\U{int(m.group(1), 16):08X}")
                i = m.end()
            else:
                out.append(rust[i:i + 2])
                i += 2
            continue
        if c == "[":
            depth += 1
        elif c == "]" and depth:
            depth -= 1
        elif c == "|" and depth:
            c = "\\|"  # (a set operator in V1: '||')
        elif c == "$" and not depth:
            c = "\\Z"
        out.append(c)
        i += 1
    return "".join(out)


def _one_pattern_disjoint(node: _Node) -> str | None:
    patterns = node.value if isinstance(node.value, dict) else {}
    if len(patterns) > 1:
        return "xgrammar does not intersect overlapping patternProperties"
    props = node.schema.get("properties")
    for pattern in patterns:
        try:
            if isinstance(props, dict) and any(_search(pattern, name) for name in props):
                return ("xgrammar does not apply patternProperties to names listed in "
                        "'properties'")
        except (regex.error, RegexUndecided) as e:
            return (f"pattern {pattern[:40]!r} cannot be checked against 'properties' "
                    f"({type(e).__name__})")
    return None


def _enum_covers_siblings(node: _Node) -> str | None:
    """``enum``/``const`` win over their siblings in xgrammar; enforced when every allowed value
    also satisfies the siblings (then the siblings add nothing), as the schema's own draft
    (its ``$schema``, else 2020-12) reads them. A sibling form that draft does not define, or a
    ``format`` the installed ``jsonschema`` cannot check, cannot be shown to add nothing."""
    rest = {k: v for k, v in node.schema.items()
            if k in VOCABULARY and k not in ("enum", "const") and k not in _CONTAINERS}
    if not any(k in node.siblings() for k in rest):
        return None
    if "$ref" in json.dumps(rest):
        return "not enforced next to a '$ref'"
    values = node.value if node.keyword == "enum" else [node.value]
    if not isinstance(values, list):
        return None  # malformed: the backend's own error says so
    from jsonschema import Draft202012Validator, validators
    declared = node.schema.get("$schema", node.root.get("$schema")
                               if isinstance(node.root, dict) else None)
    with warnings.catch_warnings():  # an unknown $schema: 2020-12, without jsonschema's warning
        warnings.simplefilter("ignore")
        cls = validators.validator_for({"$schema": declared} if isinstance(declared, str)
                                       else {}, default=Draft202012Validator)
    unchecked = sorted(f for f in _formats_in(rest) if f not in _EXACT_FORMAT_VALUES)
    if unchecked:
        return (f"capgraph cannot check the {node.keyword} values against format "
                f"{unchecked[0]!r} by its definition, which xgrammar would not apply next "
                "to them")
    if _keys_in(rest) >= {"unevaluatedProperties", "patternProperties"}:
        # (jsonschema matches those patterns with Python's backtracking 're')
        return (f"capgraph cannot check the {node.keyword} values against "
                "'unevaluatedProperties' next to 'patternProperties'")
    try:
        cls.check_schema(rest)
        validator = _bounded_regexes(cls)(rest, format_checker=_exact_formats(cls))
        bad = [v for v in values if not validator.is_valid(v)]
    except RegexUndecided:
        return (f"capgraph cannot check the {node.keyword} values against the sibling "
                f"patterns within {REGEX_CHECK_SECONDS} s")
    except Exception as e:  # noqa: BLE001 - any failure to check is a reason to refuse
        return (f"capgraph cannot check the {node.keyword} values against the sibling "
                f"keywords ({type(e).__name__})")
    if bad:
        return (f"xgrammar lets {json.dumps(bad[0])[:40]} through, which the sibling keywords "
                "refuse")
    return None


def _exact_format_values() -> dict[str, Any]:
    """Per format, a test that a value is one by the format's definition, where jsonschema's
    own check is looser (``email``: it asks only for an ``@``; ``uuid``: it takes braces and
    extra hyphens) or a value's form is fixed: capgraph's exact patterns
    (:data:`~capgraph.grammar.formats.FORMAT_PATTERNS`), a UUID's hex groups, and for
    ``email`` the dot-atom form of RFC 5321 at a hostname, its local part at most 64 and its
    domain at most 253 characters (stricter than the definition: a quoted local part or an
    address literal is not shown to be one). A test needs no checker of jsonschema's."""
    from .formats import FORMAT_PATTERNS
    tests = {name: regex.compile(pattern) for name, pattern in FORMAT_PATTERNS.items()}
    atom = "[A-Za-z0-9!#$%&'*+/=?^_`{|}~-]+"
    tests["uuid"] = regex.compile("^[0-9A-Fa-f]{8}(?:-[0-9A-Fa-f]{4}){3}-[0-9A-Fa-f]{12}$")
    address = regex.compile(f"^{atom}(?:\\.{atom})*@" + FORMAT_PATTERNS["hostname"][1:])
    found: dict[str, Any] = {name: (lambda value, t=test: t.fullmatch(value) is not None)
                             for name, test in tests.items()}
    found["email"] = lambda value: address.fullmatch(value) is not None \
        and len(value.partition("@")[0]) <= 64 and len(value.rpartition("@")[2]) <= 253
    return found


#: The formats an ``enum`` / ``const`` next to them is checked against by definition
#: (:func:`_exact_formats`); next to any other the values cannot be shown to be one.
_EXACT_FORMAT_VALUES = _exact_format_values()


@functools.lru_cache(maxsize=None)
def _exact_formats(cls: Any) -> Any:
    """``cls``'s format checker (a jsonschema validator class's) with each format of
    :data:`_EXACT_FORMAT_VALUES` also checked by its definition (a string must pass both;
    where jsonschema has no checker of the format, the definition's alone)."""
    from jsonschema import FormatChecker
    base = cls.FORMAT_CHECKER
    checker = FormatChecker(list(base.checkers))
    for name, exact in _EXACT_FORMAT_VALUES.items():
        func, raises = base.checkers.get(name, (lambda value: True, ()))

        def both(value: Any, func: Any = func, exact: Any = exact) -> bool:
            return func(value) and (not isinstance(value, str) or exact(value))
        checker.checkers[name] = (both, raises)
    return checker


@functools.lru_cache(maxsize=None)
def _bounded_regexes(cls: Any) -> Any:
    """``cls`` (a jsonschema validator class) matching every regex of the schema it checks
    with :func:`_search` (linear-time and budgeted) instead of Python's backtracking ``re``,
    which holds the GIL for as long as a hostile pattern takes: ``pattern``,
    ``patternProperties`` and the names ``additionalProperties`` leaves to them. (The other
    place jsonschema matches them, ``unevaluatedProperties``, is refused before.)"""
    from jsonschema import ValidationError, validators

    def pattern(validator: Any, patrn: Any, instance: Any, schema: Any) -> Iterator[Any]:
        if validator.is_type(instance, "string") and not _search(patrn, instance):
            yield ValidationError(f"{instance[:40]!r} does not match {patrn[:40]!r}")

    def pattern_properties(validator: Any, patterns: Any, instance: Any,
                           schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        for patrn, subschema in patterns.items():
            for k, v in instance.items():
                if _search(patrn, k):
                    yield from validator.descend(v, subschema, path=k, schema_path=patrn)

    def additional_properties(validator: Any, extra: Any, instance: Any,
                              schema: Any) -> Iterator[Any]:
        if not validator.is_type(instance, "object"):
            return
        listed = schema.get("properties", {})
        patterns = list(schema.get("patternProperties", {}))
        extras = [k for k in instance if k not in listed
                  and not any(_search(p, k) for p in patterns)]
        if validator.is_type(extra, "object"):
            for k in extras:
                yield from validator.descend(instance[k], extra, path=k)
        elif not extra and extras:
            yield ValidationError(f"additional properties {extras[:3]!r} are not allowed")

    found = {"pattern": pattern, "patternProperties": pattern_properties,
             "additionalProperties": additional_properties}
    return validators.extend(cls, {k: v for k, v in found.items() if k in cls.VALIDATORS})


def _keys_in(value: Any) -> set[str]:
    """Every object key anywhere inside ``value``."""
    found: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            found.update(k for k in item if isinstance(k, str))
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _formats_in(value: Any) -> set[str]:
    """Every ``format`` string anywhere inside ``value`` (schemas nested in it included)."""
    found: set[str] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("format"), str):
                found.add(item["format"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _count(node: _Node) -> str | None:
    if not _is_count(node.value):
        return f"'{node.keyword}' must be a non-negative integer"
    return None


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number_bound(node: _Node) -> str | None:
    if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
        return "xgrammar reads only the numeric form (draft-06 and later)"
    return None


_DRAFT_04 = regex.compile(r"^https?://json-schema\.org/draft-04/")


def _declared_draft(node: _Node) -> str | None:
    draft = node.root.get("$schema") if isinstance(node.root, Mapping) else None
    return draft if isinstance(draft, str) else None


def _exclusive_form(node: _Node) -> str | None:
    """``exclusiveMinimum`` / ``exclusiveMaximum`` in a form the schema's draft defines: a
    number, or draft-04's boolean modifier beside its ``minimum`` / ``maximum`` (read so
    where no ``$schema`` names a later draft). A number under a draft-04 ``$schema`` (which
    the backends would read as a bound of its own) and a boolean alone or under a later
    draft (which llguidance drops; a validator of that draft reads ``true`` as 1) are
    refused."""
    draft = _declared_draft(node)
    draft_04 = draft is not None and bool(_DRAFT_04.match(draft))
    if isinstance(node.value, bool):
        bound = "minimum" if node.keyword == "exclusiveMinimum" else "maximum"
        if draft_04 or (draft is None and bound in node.schema):
            return None
        return (f"a boolean is draft-04's form of it, a modifier of '{bound}'"
                + (f", and {draft!r} wants a number" if draft is not None
                   else f", and no '{bound}' is beside it"))
    if draft_04 and isinstance(node.value, (int, float)):
        return ("draft-04 reads it as a boolean modifier of 'minimum' / 'maximum', and the "
                "backends would read the number as a bound of its own")
    return None


def _numbers_in(value: Any) -> Iterator[int | float]:
    """Every number in a JSON value (``const`` / ``enum`` values hold objects and arrays)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, bool):
            continue
        if isinstance(item, (int, float)):
            yield item
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


#: The largest integer a double holds exactly (llguidance reads every schema number as one).
_EXACT_DOUBLE_INT = 2**53


def _llg_exact_numbers(node: _Node) -> str | None:
    """llguidance reads a schema's numbers as doubles and writes them back with 16
    significant digits: an integer past 2**53 is rounded (``minimum`` 2**53 + 1 lets 2**53
    through; ``const`` 2**53 + 1 produces 2**53), and a double that needs 17 digits becomes
    another number (``const`` 123456789.12345679 produces 123456789.1234568)."""
    for number in _numbers_in(node.value):
        if isinstance(number, int):
            if abs(number) > _EXACT_DOUBLE_INT:
                return (f"llguidance reads {number} as a double, rounded (integers past "
                        "2**53 are not exact)")
        elif number == number and abs(number) != float("inf") \
                and float(f"{number:.16g}") != number:
            return (f"llguidance writes {number!r} with 16 significant digits, another "
                    "number")
    return None


def _llg_exact_bound(node: _Node) -> str | None:
    """A number bound llguidance compares exactly: as :func:`_llg_exact_numbers`, an integer
    below 2**53 (``exclusiveMinimum`` 2**53 of an integer lets 2**53 through), no whole double
    past 2**53 (``exclusiveMinimum`` 1e16 of an integer lets 10000000000000000 through), and a
    double of at most 15 significant digits: some of 16 or 17 are compared as another number
    (``exclusiveMaximum`` 96836.12535043583 lets that number through) and capgraph cannot tell
    which, so all are refused."""
    found = _llg_exact_numbers(node)
    bound = node.value
    if found is not None or isinstance(bound, bool):
        return found
    if isinstance(bound, int):
        if abs(bound) >= _EXACT_DOUBLE_INT:
            return f"llguidance compares with the bound {bound} as a double, not exactly"
        return None
    if not isinstance(bound, float) or bound != bound or abs(bound) == float("inf"):
        return None
    if bound.is_integer() and abs(bound) >= _EXACT_DOUBLE_INT:
        return f"llguidance reads the bound {bound!r} as a double past 2**53, not exact"
    if float(f"{bound:.15g}") != bound:
        return (f"the bound {bound!r} has more than 15 significant digits, where llguidance "
                "compares some as another number")
    return None


#: The spacing of the decimals xgrammar's number range writes (six fractional digits at most).
_XGRAMMAR_FRACTION = 1e-6


def _xgrammar_exclusive_leaks(bound: float) -> bool:
    """Whether a decimal of at most six fractional digits strictly inside the exclusive bound
    ``bound`` may parse to it: where doubles are more than two millionths apart (the next
    decimal inside rounds to the bound), or over one millionth apart and the bound's double is
    not its own six-decimal form (the bound's text lies inside it)."""
    step = math.ulp(bound)
    if step > 2 * _XGRAMMAR_FRACTION:
        return True
    if step < _XGRAMMAR_FRACTION:
        return False
    exact = decimal.Decimal(bound)
    return exact != exact.quantize(decimal.Decimal("1e-6"))


def _xgrammar_exact_bound(node: _Node) -> str | None:
    """A bound of a ``number`` that xgrammar's range keeps: it compares a number's decimal
    text (six fractional digits at most) with the bound's double written to six decimals,
    rounded toward the inside of the range. So an inclusive bound holds for the number the
    text parses to, but an exclusive one does not where doubles are sparser than those
    decimals (from about 2**33: ``exclusiveMaximum`` 123456789012.3 is written
    123456789012.300003 and lets ``123456789012.3`` through, ``exclusiveMinimum`` 1e12 lets
    ``1000000000000.000001`` through: each parses to the bound); and an integer bound past
    2**53 is rounded to a double first (``minimum`` 2**53 + 1 lets 2**53 through). An
    ``integer``'s bounds are exact."""
    types = node.schema.get("type")
    if "number" not in (types if isinstance(types, list) else [types]):
        return None
    bound = node.value
    if isinstance(bound, bool) or not isinstance(bound, (int, float)):
        return None
    if isinstance(bound, int) and abs(bound) > _EXACT_DOUBLE_INT:
        return (f"xgrammar reads the bound {bound} of a 'number' as a double, rounded "
                "(integers past 2**53 are not exact)")
    if node.keyword.startswith("exclusive") and abs(bound) != float("inf") \
            and _xgrammar_exclusive_leaks(float(bound)):
        return (f"near the exclusive bound {bound!r} of a 'number' doubles are "
                f"{math.ulp(float(bound)):.3g} apart, so a decimal xgrammar writes inside it "
                "may parse to the bound itself")
    return None


def _xgrammar_int64(node: _Node) -> str | None:
    """xgrammar writes a ``const`` / ``enum`` integer outside the signed 64-bit range as a
    double (``const`` 2**64 + 1 produces 1.8446744073709552e+19)."""
    for number in _numbers_in(node.value):
        if isinstance(number, int) and not -2**63 <= number < 2**63:
            return f"xgrammar writes {number} as a double (outside the 64-bit integers)"
    return None


def _xgrammar_values(node: _Node) -> str | None:
    """xgrammar's ``enum`` / ``const``: written exactly (:func:`_xgrammar_int64`) and
    deciding alone where every value satisfies the siblings (:func:`_enum_covers_siblings`)."""
    return _xgrammar_int64(node) or _enum_covers_siblings(node)


def _numeric(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and value == value and abs(value) != float("inf")


def _llg_narrow_exclusive(node: _Node) -> str | None:
    """llguidance lets an excluded whole-number bound ``k`` through where the other bound lies
    strictly between ``k`` and the next whole number away from zero (``exclusiveMinimum`` 0
    with ``maximum`` 0.5 accepts ``0``; ``exclusiveMaximum`` 0 with ``minimum`` -0.5 accepts
    ``-0``; ``exclusiveMaximum`` 1 with ``minimum`` 0.5 refuses ``1``, as it should), in the
    draft-06 form and in draft-04's (``exclusiveMinimum: true`` next to ``minimum``)."""
    s, lower = node.schema, node.keyword == "exclusiveMinimum"
    bound, own = node.value, "minimum" if lower else "maximum"
    if bound is True:
        bound = s.get(own)
    if not _numeric(bound) or not float(bound).is_integer() or \
            (bound < 0 if lower else bound > 0):
        return None  # (only an excluded bound at or nearer zero than the other leaks)
    other = ("maximum", "exclusiveMaximum") if lower else ("minimum", "exclusiveMinimum")
    for key in other:
        value = s.get(key)
        if value is True:
            value = s.get(other[0])
        if _numeric(value) and 0 < (value - bound if lower else bound - value) < 1:
            return (f"llguidance lets the excluded bound {bound} through when '{key}' "
                    f"{value} lies less than 1 from it")
    return None


def _all_properties_required(node: _Node) -> str | None:
    props = node.schema.get("properties")
    required = node.schema.get("required")
    if isinstance(props, dict) and props and not (
            isinstance(required, list) and set(props) <= set(required)):
        return "llguidance counts properties only when every listed one is required"
    return None


def _one_branch(node: _Node) -> str | None:
    if not isinstance(node.value, list) or len(node.value) != 1:
        return "xgrammar does not intersect the branches of allOf"
    return None


def _items_schema(node: _Node) -> str | None:
    if isinstance(node.value, list):
        return "tuple-form 'items' (draft-07) is not read by xgrammar"
    return None


def _additional_items(node: _Node) -> str | None:
    # with a schema 'items' (or none), additionalItems has no effect in draft-07 and is no
    # keyword at all in 2020-12
    if isinstance(node.schema.get("items"), list):
        return "tuple-form 'items' (draft-07) is not read by xgrammar"
    return None


def _repeatable_names(schema: Mapping[str, Any]) -> bool:
    """Whether an object may hold a name the schema does not list, which the grammar then
    admits twice (no grammar tracks the names already written): pattern-matched names, or
    additional ones (allowed unless ``additionalProperties`` / ``unevaluatedProperties`` is
    ``false``, and by default where the schema lists no names)."""
    if schema.get("patternProperties"):
        return True
    for key in ("additionalProperties", "unevaluatedProperties"):
        if key in schema:
            return schema[key] is not False
    return not schema.get("properties")


def _counts_names_once(node: _Node) -> str | None:
    """``minProperties`` is counted on names as written; a name written twice counts twice in
    the grammar and once in the parsed object (``{"b": 1, "b": 2}`` has one property)."""
    if _repeatable_names(node.schema):
        return ("a name the schema does not list may be written twice, which the grammar "
                "counts twice and a JSON parser once")
    return None


def _names_spelled_once(node: _Node) -> str | None:
    """llguidance tells listed names from additional ones by their text as written, so a
    listed name spelled with an escape (``"\\u0061"`` for ``"a"``) passes as an additional
    one: its value escapes the listed name's schema. Enforced only where llguidance is given
    ``additionalProperties: false``: written so, or written out for it by
    :func:`~capgraph.grammar.semantics.llguidance_schema` (not in an ``allOf`` branch, nor
    next to a ``required`` name the schema does not list). Listed schemas that take any value
    (``true``, ``{}``) lose nothing to a name so spelled."""
    listed = node.value if isinstance(node.value, dict) else {}
    if all(v is True or (isinstance(v, dict) and not v) for v in listed.values()):
        return None
    extra = node.schema.get("additionalProperties", _MISSING)
    if extra is _MISSING:
        from .semantics import llguidance_closes_properties
        closed = isinstance(node.schema, dict) and node.described is not None and \
            llguidance_closes_properties(node.schema, node.described)
    else:
        closed = extra is False
    if not closed:
        return ("llguidance takes a listed name written with a JSON escape ('\\u0061' for "
                "'a') as an additional property, so its value is not checked against the "
                "listed schema; set 'additionalProperties' to false or use xgrammar")
    return None


def _closed_beside_listed(node: _Node) -> str | None:
    """llguidance intersects a schema with its ``allOf`` branches, each ``anyOf`` /
    ``oneOf`` branch and a ``$ref``'s target, and :func:`~capgraph.grammar.semantics.
    llguidance_schema` closes every object schema that describes the instance (its
    ``additionalProperties: false``): where one closed schema of such a combination does not
    list a property another one lists, that property can never be written (``allOf`` of two
    ``$ref``s to closed objects with ``a`` and ``b`` allowed only ``{}``). Reported rather
    than served narrower than written."""
    from .semantics import llguidance_closes_properties
    described = node.described
    if described is None:
        return None
    value = node.value
    if node.keyword == "$ref":
        others = [_resolve(node.root, value)] if isinstance(value, str) else []
    else:
        others = list(value) if isinstance(value, list) else []
    resolved = []
    for branch in others:
        seen: set[int] = set()
        while isinstance(branch, dict) and isinstance(branch.get("$ref"), str) \
                and id(branch) not in seen and len(branch) == 1:
            seen.add(id(branch))
            branch = _resolve(node.root, branch["$ref"])
        if isinstance(branch, dict):
            resolved.append(branch)
    def closes(schema: Any) -> bool:
        return isinstance(schema, dict) and "patternProperties" not in schema and \
            llguidance_closes_properties(schema, described)

    if node.keyword in ("anyOf", "oneOf"):
        if node.keyword == "oneOf" and any(closes(b) for b in resolved):
            # a closed branch takes fewer instances, so an instance the branches as written
            # share may match it alone: only branches disjoint as written keep oneOf's "one"
            for i, a in enumerate(resolved):
                for b in resolved[i + 1:]:
                    if not _disjoint_as_written(a, b) and not (
                            _writes_none_of(a, b, closes) and _writes_none_of(b, a, closes)):
                        return ("llguidance closes 'oneOf' branches (their unlisted "
                                "properties absent), which lets through an instance two "
                                "branches as written both match, unless a branch's 'type', "
                                "a property both require with 'const' / 'enum' values, or a "
                                "property each requires that the other (closed) does not "
                                "list tells them apart; none does here")
        # a branch is one way to be valid: a property of the parent is lost only where every
        # branch closes without it; a closed parent loses what a branch lists beyond it
        listed = node.schema.get("properties")
        if isinstance(listed, dict) and resolved and all(closes(b) for b in resolved):
            for name in listed:
                if not any(name in (b.get("properties") or {}) for b in resolved):
                    return (f"llguidance closes every '{node.keyword}' branch (their unlisted "
                            f"properties absent) and none lists {name!r}, which the schema "
                            "lists beside them: it could never be written")
        if closes(node.schema) and isinstance(listed, dict):
            for branch in resolved:
                extra = sorted(set(branch.get("properties") or {}) - set(listed))
                if extra:
                    return (f"llguidance closes this schema (its unlisted properties absent) "
                            f"and a '{node.keyword}' branch lists {extra[0]!r} beyond it: it "
                            "could never be written")
        return None
    for group in [[node.schema, *resolved]]:
        for closed in group:
            if not (isinstance(closed, dict) and llguidance_closes_properties(closed, described)
                    and "patternProperties" not in closed):
                continue
            listed = closed.get("properties", {})
            for other in group:
                names = other.get("properties") if other is not closed else None
                if isinstance(names, dict) and isinstance(listed, dict):
                    missing = sorted(set(names) - set(listed))
                    if missing:
                        return (f"llguidance closes a schema combined here (its unlisted "
                                f"properties absent) that does not list {missing[0]!r}, "
                                "which another schema of the combination lists: it could "
                                "never be written")
    return None


# the meta-schemas of the drafts before 2020-12 that capgraph reads, http or https
_BEFORE_2020_12 = regex.compile(
    r"^https?://json-schema\.org/(?:draft-0[4-7]/|draft/2019-09/)")


def declares_draft_before_2020_12(schema: object) -> bool:
    """Whether the root schema ``schema`` names, in its ``$schema``, a draft before 2020-12
    (draft-04 to draft-07, 2019-09): one where ``prefixItems`` is no keyword."""
    draft = schema.get("$schema") if isinstance(schema, Mapping) else None
    return isinstance(draft, str) and bool(_BEFORE_2020_12.match(draft))


def _prefix_items_draft(node: _Node) -> str | None:
    """``prefixItems`` is a keyword of 2020-12 only: under an earlier draft's ``$schema`` it is
    none (that draft's ``items`` applies to every item), and xgrammar, which reads no
    ``$schema``, would apply it."""
    draft = _declared_draft(node)
    if draft is not None and _BEFORE_2020_12.match(draft):
        return (f"'prefixItems' is no keyword of {draft!r} (its 'items' applies to every "
                "item), and xgrammar reads it as 2020-12 does")
    return None


# keywords whose subschemas may list or allow properties beside a schema's own
_PROPERTY_APPLICATORS = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then",
                         "else", "dependentSchemas", "dependencies", "unevaluatedProperties")


def _schema_types(schema: Mapping[str, Any]) -> frozenset[str] | None:
    """The JSON types a schema's ``type`` allows (None: no ``type``, or not a list of names)."""
    t = schema.get("type")
    if isinstance(t, str):
        t = [t]
    if not (isinstance(t, list) and all(isinstance(x, str) for x in t)):
        return None
    return frozenset(t) | ({"integer"} if "number" in t else set())  # (integers are numbers)


def _writes_none_of(written: Mapping[str, Any], other: Mapping[str, Any],
                    closes: Callable[[Any], bool]) -> bool:
    """Whether no instance llguidance writes for the branch ``written`` matches ``other`` as
    written: ``written`` takes objects alone, with no property but those it lists (llguidance
    closes it, or its ``additionalProperties`` is false, and it has no
    ``patternProperties``), and ``other`` requires a property it does not list."""
    if _schema_types(written) != {"object"} or "patternProperties" in written:
        return False
    if any(k in written for k in _PROPERTY_APPLICATORS):  # (they may let more properties in)
        return False
    if not (closes(written) or written.get("additionalProperties") is False):
        return False
    listed, required = written.get("properties", {}), other.get("required")
    if not (isinstance(listed, dict) and isinstance(required, list)):
        return False
    return any(isinstance(name, str) and name not in listed for name in required)


def _disjoint_as_written(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether no instance matches both schemas, shown by their ``type``s alone or by a
    property both require whose ``const`` / ``enum`` values share none (a tag field). False
    where neither shows it (they may still be disjoint)."""
    ta, tb = _schema_types(a), _schema_types(b)
    if ta is not None and tb is not None and not ta & tb:
        return True

    def values(schema: Mapping[str, Any], name: str) -> list[Any] | None:
        required, props = schema.get("required"), schema.get("properties")
        if not (isinstance(required, list) and name in required and isinstance(props, dict)):
            return None
        prop = props.get(name)
        if not isinstance(prop, dict):
            return None
        if "const" in prop:
            return [prop["const"]]
        enum = prop.get("enum")
        return enum if isinstance(enum, list) else None

    listed = a.get("properties")
    for name in listed if isinstance(listed, dict) else ():
        va, vb = values(a, name), values(b, name)
        if va is not None and vb is not None and not any(
                _same_json(x, y) for x in va for y in vb):
            return True
    return False


def _same_json(x: Any, y: Any) -> bool:
    """JSON equality (1 == 1.0, True is no number, key order ignored)."""
    if isinstance(x, bool) or isinstance(y, bool):
        return type(x) is type(y) and x == y
    if isinstance(x, (int, float)) and isinstance(y, (int, float)):
        return x == y
    if isinstance(x, list) and isinstance(y, list):
        return len(x) == len(y) and all(_same_json(p, q) for p, q in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same_json(x[k], y[k]) for k in x)
    return type(x) is type(y) and x == y


def _patterns_without_additional(node: _Node) -> str | None:
    """xgrammar writes an additional name next to pattern-matched ones as any string: it
    neither leaves out the listed names nor the names the patterns match."""
    if node.schema.get("additionalProperties", False) is not False:
        return ("xgrammar lets a name that is listed or matches a pattern through as an "
                "additional property next to patternProperties")
    return None


def _tag_names_spelled_once(node: _Node) -> str | None:
    """In a schema xgrammar converts inside a structural tag (:data:`XGRAMMAR_TAG`) additional
    names keep their escapes, so ``"\\u0061"`` passes for a listed ``"a"``."""
    extra = node.schema.get("additionalProperties", node.schema.get("unevaluatedProperties",
                                                                     False))
    if extra is not False:
        return ("in a structural tag xgrammar takes a listed name written with a JSON escape "
                "('\\u0061' for 'a') as an additional property; capgraph repairs that in "
                "JSON-schema guides and plain json_schema elements only")
    return None


def _no_guidance_options(node: _Node) -> str | None:
    return "x-guidance options can make llguidance ignore keywords"


_TYPE_NAMES = frozenset({"string", "integer", "number", "boolean", "null", "object", "array"})


def _known_type(node: _Node) -> str | None:
    types = node.types()
    if types is None or not types <= _TYPE_NAMES:
        return f"unknown type {node.value!r}"
    if not types:
        return "an empty list of types admits no instance"
    return None


def _some_branch(node: _Node) -> str | None:
    """An ``anyOf`` / ``oneOf`` must list a schema: with none no instance is valid (and the
    meta-schema requires one), and xgrammar reads an empty ``anyOf`` as the empty text."""
    if isinstance(node.value, list) and not node.value:
        return f"an empty {node.keyword} admits no instance"
    return None


#: xgrammar 0.2.9 (``compile_json_schema`` with ``any_order=False``, as capgraph calls it).
XGRAMMAR: dict[str, Rule] = {
    "type": _known_type,
    "enum": _xgrammar_values,
    "const": _xgrammar_values,
    "minimum": _all(_needs_type, _number_bound, _xgrammar_exact_bound),
    "maximum": _all(_needs_type, _number_bound, _xgrammar_exact_bound),
    "exclusiveMinimum": _all(_needs_type, _number_bound, _exclusive_form,
                             _xgrammar_exact_bound),
    "exclusiveMaximum": _all(_needs_type, _number_bound, _exclusive_form,
                             _xgrammar_exact_bound),
    "multipleOf": _all(_needs_type, _integer_multiple,
                       _without("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")),
    # enforced once the backend repairs the character class of length-limited strings
    # (xgrammar_backend._repair_length_strings); next to pattern or format xgrammar drops them
    "minLength": _all(_needs_type, _without("pattern", "format"), _count),
    "maxLength": _all(_needs_type, _without("pattern", "format"), _count),
    "pattern": _all(_needs_type, _without("format")),
    "format": _all(_needs_type, _formats(XGRAMMAR_FORMATS, "xgrammar"),
                   _without("minLength", "maxLength", "pattern")),
    "items": _items_schema,  # xgrammar reads items/prefixItems as "an array" without a type
    "prefixItems": _prefix_items_draft,
    "additionalItems": _additional_items,
    "minItems": _needs_type, "maxItems": _needs_type,
    "unevaluatedItems": _all(_needs_type, _without(*_APPLICATORS)),
    "properties": _ok,
    "additionalProperties": _ok,
    "required": _required_declared,
    "patternProperties": _all(_needs_type, _one_pattern_disjoint,
                              _patterns_without_additional),
    "propertyNames": _all(_needs_type, _without("properties", "patternProperties")),
    "minProperties": _all(_needs_type, _without("patternProperties", "propertyNames"),
                          _counts_names_once),
    "maxProperties": _all(_needs_type, _without("patternProperties", "propertyNames")),
    "unevaluatedProperties": _all(_needs_type, _without(*_APPLICATORS)),
    "allOf": _all(_one_branch, _alone()),
    "anyOf": _all(_some_branch, _alone()),
    "oneOf": _all(_some_branch, _alone()),  # (branches it cannot prove disjoint: its warning)
    "$ref": _all(_local_ref, _alone()),
    "$id": _root_only, "id": _root_only,
    "$defs": _ok, "definitions": _ok,
}

#: llguidance (strict mode, no ``x-guidance`` options): it intersects sibling keywords and
#: refuses to compile the vocabulary keywords it does not implement, naming them.
LLGUIDANCE: dict[str, Rule] = {
    "type": _known_type,
    "enum": _llg_exact_numbers, "const": _llg_exact_numbers,
    "minimum": _llg_exact_bound, "maximum": _llg_exact_bound,
    "exclusiveMinimum": _all(_exclusive_form, _llg_exact_bound, _llg_narrow_exclusive),
    "exclusiveMaximum": _all(_exclusive_form, _llg_exact_bound, _llg_narrow_exclusive),
    "multipleOf": _llg_exact_numbers,
    "minLength": _ok, "maxLength": _ok, "pattern": _ok,
    "format": _formats(LLGUIDANCE_FORMATS, "llguidance"),
    "items": _ok, "prefixItems": _ok, "additionalItems": _ok,
    "minItems": _ok, "maxItems": _ok,
    "properties": _names_spelled_once, "additionalProperties": _ok, "required": _ok,
    "patternProperties": _names_spelled_once,
    "minProperties": _all(_all_properties_required, _counts_names_once),
    "maxProperties": _all_properties_required,
    "allOf": _closed_beside_listed, "anyOf": _closed_beside_listed,
    # (llguidance refuses oneOf branches it cannot prove disjoint)
    "oneOf": _closed_beside_listed,
    "$ref": _all(_local_ref, _closed_beside_listed),
    "$id": _root_only, "id": _root_only,
    "$defs": _ok, "definitions": _ok,
}

def _unrepaired_length(node: _Node) -> str | None:
    return ("xgrammar's length rule lets raw control characters into the string; capgraph "
            "repairs it in JSON-schema guides and plain json_schema elements only")


#: xgrammar on a JSON schema embedded in a structural tag other than as a plain
#: ``json_schema`` element (:func:`plain_tag_schema`): in an XML-style element
#: (``qwen_xml_parameter``, a ``style`` other than ``"json"``) or a Lark ``%json``. As
#: :data:`XGRAMMAR`, but string length limits and listed names next to additional ones stay
#: unenforced there: xgrammar converts those schemas itself, and capgraph's repairs of its
#: grammar apply to the grammars it converts (JSON-schema guides and plain elements).
XGRAMMAR_TAG: dict[str, Rule] = {
    **XGRAMMAR, "minLength": _unrepaired_length, "maxLength": _unrepaired_length,
    "properties": _tag_names_spelled_once,
    "patternProperties": _all(XGRAMMAR["patternProperties"], _tag_names_spelled_once)}

def _xml_raw_text(node: _Node) -> str | None:
    return ("an XML-style element writes names and string values as raw text, and capgraph "
            "writes patterns and formats for xgrammar to match JSON string text (escapes "
            "included): they would not mean what they say there")


#: xgrammar on a JSON schema in an XML-style element (``qwen_xml_parameter``, a ``style``
#: other than ``"json"``): as :data:`XGRAMMAR_TAG`, and ``pattern``, ``patternProperties``
#: and ``format``, which capgraph writes for JSON string text, are refused.
XGRAMMAR_XML: dict[str, Rule] = {
    **XGRAMMAR_TAG, "pattern": _xml_raw_text, "patternProperties": _xml_raw_text,
    "format": _xml_raw_text}

_RULES = {"xgrammar": XGRAMMAR, "llguidance": LLGUIDANCE, "xgrammar-tag": XGRAMMAR_TAG,
          "xgrammar-xml": XGRAMMAR_XML}

# draft-00 to draft-03 meta-schemas (schema and hyper-schema), http or https
_OLD_DRAFT = regex.compile(r"^https?://json-schema\.org/draft-0[0-3]/")


def _readable_draft(node: _Node) -> str | None:
    """``$schema`` naming draft-03 or earlier: that draft asserts with keywords no backend
    reads (``disallow``, ``divisibleBy``, ``extends``, ``required: true`` inside a property,
    schemas in ``type``), which later drafts and both backends take for unknown keywords and
    drop. capgraph reads draft-04 and later."""
    if isinstance(node.value, str) and _OLD_DRAFT.match(node.value):
        return ("a draft-03 (or earlier) schema asserts with keywords no backend reads "
                "('disallow', 'divisibleBy', 'extends', a boolean 'required'); capgraph reads "
                "draft-04 and later")
    return None


# Keywords outside the vocabulary (or annotations) that change what a schema asserts: on
# every backend, and per backend.
_DRAFT_KEYS: dict[str, Rule] = {"$schema": _readable_draft}
_BACKEND_KEYS: dict[str, dict[str, Rule]] = {
    "xgrammar": _DRAFT_KEYS, "xgrammar-tag": _DRAFT_KEYS, "xgrammar-xml": _DRAFT_KEYS,
    "llguidance": {**_DRAFT_KEYS, "x-guidance": _no_guidance_options}}


def unenforced(schema: Any, backend: str) -> list[Unenforced]:
    """Every keyword of ``schema`` that ``backend`` (``"xgrammar"``, ``"llguidance"``, or
    ``"xgrammar-tag"`` / ``"xgrammar-xml"`` for a schema inside a structural tag) is not
    known to enforce, in
    document order (then the places only a ``$ref`` reaches); an empty list means every
    assertion is enforced.

    Property names that happen to spell a keyword are names, not keywords, and are not read.
    """
    rules = _RULES[backend]
    special = _BACKEND_KEYS.get(backend, {})
    described = None
    if backend == "llguidance":
        from .semantics import llguidance_described
        described = llguidance_described(schema)
    with _regex_budget():
        return [found for node, pointer in schema_nodes(schema)
                for found in _judge(node, pointer, schema, rules, special, described)]


def unenforced_in_text(guide: str, backend: str) -> list[Unenforced]:
    """:func:`unenforced` of a schema given as JSON text; empty where the text is not JSON
    (the backend's own compile error then says where)."""
    try:
        schema = json.loads(guide)
    except ValueError:
        return []
    return unenforced(schema, backend)


def unenforced_in_tag(tag: Any) -> list[Unenforced]:
    """:func:`unenforced` for every JSON schema a structural tag embeds (the value of any
    ``"json_schema"`` key, and each ``%json`` value of a ``grammar`` element with
    ``"syntax": "lark"``), judged for xgrammar, with pointers into the tag document: a plain
    ``json_schema`` element's (:func:`plain_tag_schema`) as a JSON-schema guide's
    (:data:`XGRAMMAR`), every other as :data:`XGRAMMAR_TAG`; an ``any_order`` schema (whose
    keys xgrammar does not check) is reported too."""
    found: list[Unenforced] = []
    with _regex_budget():
        _walk_tag(tag, found)
    return found


def plain_tag_schema(node: Mapping[str, Any]) -> bool:
    """Whether the structural-tag object ``node`` is a ``json_schema`` element whose schema
    is written as plain JSON in the order listed: an object schema, ``style`` absent or
    ``"json"``, ``any_order`` absent or false, ``max_whitespace_cnt`` absent, null or a
    positive integer, ``excludes`` absent or empty, and no other key. The xgrammar backend
    compiles such an element as the repaired grammar of a JSON-schema guide of that schema
    (with the element's whitespace), which has no place for anything else the element says;
    any other form is left to xgrammar (and an ill-formed one to its error)."""
    if node.get("type") != "json_schema" or not isinstance(node.get("json_schema"), dict) \
            or not _PLAIN_TAG_SCHEMA_KEYS.issuperset(node):
        return False
    cap = node.get("max_whitespace_cnt")
    return (node.get("style", "json") == "json" and node.get("any_order", False) is False
            and (cap is None or (type(cap) is int and cap > 0))
            and node.get("excludes", []) == [])


def xml_style(node: Mapping[str, Any]) -> bool:
    """Whether the structural-tag object ``node`` writes its JSON schema's instance XML-style
    (``qwen_xml_parameter``, or a ``style`` other than ``"json"``): names and string values
    as raw text between tags."""
    return node.get("type") == "qwen_xml_parameter" or node.get("style", "json") != "json"


# The keys of a json_schema element :func:`plain_tag_schema` knows what to do with.
_PLAIN_TAG_SCHEMA_KEYS = frozenset({"type", "json_schema", "style", "any_order",
                                    "max_whitespace_cnt", "excludes"})


def _walk_tag(tag: Any, found: list[Unenforced]) -> None:
    """:func:`unenforced_in_tag`'s walk, appending to ``found``."""
    # iterative, in document order: any depth, no recursion
    stack: list[Iterator[tuple[Any, Any, Pointer]]] = [iter([(None, tag, _ROOT)])]
    while stack:
        step = next(stack[-1], None)
        if step is None:
            stack.pop()
            continue
        key, node, pointer = step
        if isinstance(node, list):
            stack.append((i, item, pointer.child(str(i))) for i, item in enumerate(node))
        elif isinstance(node, dict):
            stack.append(_tag_members(node, pointer, found))


def _tag_members(node: dict[str, Any], pointer: Pointer,
                 found: list[Unenforced]) -> Iterator[tuple[Any, Any, Pointer]]:
    """The members of one object of a structural tag to walk further; what a member itself
    reports (``any_order``, an embedded ``json_schema``) goes to ``found`` on the way."""
    for key, value in node.items():
        where = pointer.child(str(key))
        if key == "any_order" and value is not False:
            found.append(Unenforced(key, pointer, (
                "xgrammar checks neither which properties are present nor that each "
                "appears once when they may come in any order")))
        elif key == "json_schema" and isinstance(value, dict):
            rules = "xgrammar" if plain_tag_schema(node) else \
                "xgrammar-xml" if xml_style(node) else "xgrammar-tag"
            found.extend(Unenforced(f.keyword, _Joined(where, f.where), f.reason)
                         for f in unenforced(value, rules))
        elif key == "grammar" and node.get("syntax") == "lark" and isinstance(value, str):
            try:
                embedded = lark_json_values(value)
            except LarkTextError:  # the tag's compile reports it
                embedded = []
            for schema in embedded:
                at = _Joined(where, f" (%json at line {schema.line})")
                found.extend(Unenforced(f.keyword, _Joined(at, f.where), f.reason)
                             for f in unenforced(schema.value, "xgrammar-tag"))
        else:
            yield key, value, where


class _Joined:
    """Two pointers written one after the other, when read."""

    __slots__ = ("head", "tail")

    def __init__(self, head: object, tail: object) -> None:
        self.head, self.tail = head, tail

    def __str__(self) -> str:
        return f"{self.head}{self.tail}"


def describe(found: list[Unenforced], limit: int = 5) -> str:
    """One line naming the first ``limit`` findings."""
    more = f" (+{len(found) - limit} more)" if len(found) > limit else ""
    return "; ".join(str(f) for f in found[:limit]) + more


def _judge(schema: dict[str, Any], pointer: Pointer, root: Any, rules: Mapping[str, Rule],
           special: Mapping[str, Rule], described: "set[int] | None" = None
           ) -> Iterator[Unenforced]:
    """The keywords of one schema object that the rules do not show enforced (``described``:
    :attr:`_Node.described`)."""
    node_of = {k: _Node(schema, k, root, pointer.is_root, described) for k in schema}
    # xgrammar: an enum/const whose every value satisfies the siblings decides the node alone
    # (its subschemas are still judged: a '$ref' elsewhere may point into them)
    covered = any(rules.get(k) is _xgrammar_values and _xgrammar_values(node_of[k])
                  is None for k in ("enum", "const") if k in schema)
    for keyword, node in node_of.items():
        if keyword in special:
            why = special[keyword](node)
        elif keyword not in VOCABULARY or _is_no_op(keyword, schema[keyword]) or covered \
                or _vacuous(node):
            continue
        else:
            rule = rules.get(keyword)
            why = "not enforced by this backend" if rule is None else rule(node)
        if why is not None:
            yield Unenforced(keyword, pointer, why)


def schema_positions(root: Any, pointer: str = "") -> Iterator[tuple[dict[str, Any], str]]:
    """:func:`schema_nodes` with each JSON pointer written out (prefixed by ``pointer``).
    Writing every pointer costs depth times name length per node: walkers over guides use
    :func:`schema_nodes`, which writes none."""
    for node, where in schema_nodes(root):
        yield node, pointer + str(where)


def schema_nodes(root: Any) -> Iterator[tuple[dict[str, Any], Pointer]]:
    """Every schema object a backend may read in ``root``, once each (by identity), with its
    JSON pointer as a :class:`Pointer` (written out only when read): ``root``, the subschemas
    in every place JSON Schema keeps them (:func:`subschemas`), in document order, then each
    place a local ``$ref`` points at that those do not reach (a schema kept under an unknown
    keyword or in ``default``: the backends follow the pointer wherever it leads). Iterative:
    nesting depth costs no Python stack; time and memory linear in the schema's size."""
    seen: set[int] = set()
    refs: list[str] = []
    stack: list[tuple[Any, Pointer]] = [(root, _ROOT)]
    while True:
        while stack:
            node, where = stack.pop()
            if not isinstance(node, dict) or id(node) in seen:
                continue  # booleans assert all or nothing; anything else is the backend's error
            seen.add(id(node))
            yield node, where
            ref = node.get("$ref")
            if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
                refs.append(ref)
            stack.extend(reversed([(sub, where.child(*tokens))
                                   for sub, tokens in _children(node)]))
        pending = [(r, v) for r in refs
                   if isinstance(v := _resolve(root, r), dict) and id(v) not in seen]
        refs.clear()
        if not pending:
            return
        for ref, value in reversed(pending):
            target = _ROOT
            for token in ref[2:].split("/") if ref != "#" else ():
                target = Pointer(target, token)  # (already escaped, as written in the ref)
            stack.append((value, target))


def subschemas(schema: dict[str, Any], pointer: str = "") -> Iterator[tuple[Any, str]]:
    """The schemas directly inside ``schema`` (2020-12 and draft-04..07 places), each with its
    JSON pointer (prefixed by ``pointer``)."""
    for value, tokens in _children(schema):
        yield value, pointer + "".join("/" + _escape(t) for t in tokens)


def _children(schema: dict[str, Any]) -> Iterator[tuple[Any, tuple[str, ...]]]:
    """The schemas directly inside ``schema``, each with the (unescaped) pointer tokens that
    lead to it; the one definition of where subschemas live, for every walker here."""
    for key in _SCHEMA_MAPS:
        sub = schema.get(key)
        if isinstance(sub, dict):
            for name, value in sub.items():
                yield value, (key, str(name))
    for key in _SCHEMA_LISTS:
        sub = schema.get(key)
        if isinstance(sub, list):
            for i, value in enumerate(sub):
                yield value, (key, str(i))
    for key in _SCHEMA_ONE:
        sub = schema.get(key)
        if isinstance(sub, dict):
            yield sub, (key,)
        elif key == "items" and isinstance(sub, list):  # draft-04..07 tuple items
            for i, value in enumerate(sub):
                yield value, ("items", str(i))


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")


_MISSING = object()


def _resolve(root: Any, ref: str) -> Any:
    """The value a local ``#/...`` reference points at, or ``_MISSING``. The fragment is
    percent-decoded before it is read as a JSON pointer (RFC 6901, section 6), as both
    backends read it: ``#/$defs/a%20b`` is the entry ``a b``."""
    node = root
    pointer = urllib.parse.unquote(ref[1:])
    if pointer and not pointer.startswith("/"):
        return _MISSING
    for part in pointer[1:].split("/") if pointer else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return _MISSING
    return node
