"""Which guides xgrammar compiles cheaply enough to skip the compile worker.

With ``compile_isolation="process"`` every compile a worker runs also pays a round trip:
``CompiledGrammar.serialize_json`` in the worker, the pipe, and ``deserialize_json`` here. Over
the bundled JSON schemas that round trip costs about what most of them take to compile, so a
guide :func:`why_not_cheap` calls cheap compiles on a compile thread of the decoder's process
instead, and reaches its first mask that much sooner.

The estimate is a whitelist, so that it errs one way only: a guide it cannot bound goes to a
worker, where a long compile can be killed. Compile cost in xgrammar 0.2.9 does not follow a
guide's size (measured with Tekken on 2 cores): a 287-character schema whose object allows
``additionalProperties`` compiled in 0.66 s and one of 24 optional enum properties (by
``$ref``) plus ``additionalProperties`` in 6.5 s, while string ``maxLength`` 4096, arrays of
``minItems`` 256, formats, enums and number ranges stayed under 25 ms; the regex ``.{0,64}``
took 1.1 s but ``[^x]{0,64}x`` 12 ms, and ``(a+)+b`` 0.2 ms. So cheap means:

- JSON (any value): always, unless ``json_whitespace="bounded"`` allows more than
  :data:`MAX_WHITESPACE` characters (the grammar grows with it: 0.17 s at 256);
- a regex of at most :data:`MAX_REGEX_CHARS` characters whose counted repetitions
  (``{n}``, ``{n,m}``) apply to single characters, classes or escapes, never to groups, and sum
  to at most :data:`MAX_REGEX_COUNTS`, where each wide atom (``.``, a negated class, ``\\W``,
  ``\\S``, ``\\D``) without a quantifier counts 1: spelled out, ``........`` costs what
  ``.{8}`` does (27 ms; 64 dots took 1.2 s), while ``[0-9]{8}`` compiles in under
  1 ms. ``*`` and ``+`` are free (xgrammar compiles them to an automaton: nesting them costs
  little at compile time), and so is ``?`` on a narrow atom;
- a JSON schema of at most :data:`MAX_SCHEMA_CHARS` characters, :data:`MAX_SCHEMA_NODES`
  subschemas nested at most :data:`MAX_SCHEMA_DEPTH` deep, without combinators, references,
  conditionals or pattern-keyed properties (:data:`COSTLY_KEYWORDS`), no object that allows
  ``additionalProperties``, no tuple ``items``, counts (``maxLength``, ``minItems``, ...) of at
  most :data:`MAX_SCHEMA_COUNT`, enums of at most :data:`MAX_ENUM` values, and patterns cheap
  as regexes above whose counts sum to at most :data:`MAX_SCHEMA_REGEX_COUNTS` over the
  whole schema (their compile times add up: 20 properties of pattern ``^.{62}$`` took 35 s),
  none next to ``enum`` or ``const`` (the policy check matches the values against it:
  :data:`~capgraph.grammar.schema_policy.REGEX_CHECK_SECONDS`);
- EBNF grammars and structural tags: never (their cost is not estimated here).

``python -m capgraph.grammar.compile_cost`` (:func:`main`) measures the estimate over the
bundled JSON schemas: the share it calls cheap, their compile time here and their time through
a worker. With xgrammar 0.2.9, Tekken, 2 cores: 48 of the 108 schemas are cheap; they compile
here in p50 11 ms, p99 18 ms, max 20 ms, and through a worker in p50 25 ms, p99 79 ms, max
91 ms. Guides built to the limits above compiled here in 20-100 ms, under 3 MiB each (the
test ``test_guides_at_the_estimates_limits_compile_small_and_fast`` keeps them bounded).
"""

from __future__ import annotations

import json
from typing import Any

from ..params import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from .schema_policy import subschemas

__all__ = ["why_not_cheap", "COSTLY_KEYWORDS", "MAX_SCHEMA_CHARS", "MAX_SCHEMA_NODES",
           "MAX_SCHEMA_DEPTH", "MAX_SCHEMA_COUNT", "MAX_ENUM", "MAX_REGEX_CHARS",
           "MAX_REGEX_COUNTS", "MAX_SCHEMA_REGEX_COUNTS", "MAX_WHITESPACE", "main"]

#: The longest JSON-schema text compiled in the decoder's process.
MAX_SCHEMA_CHARS = 2048
#: The most schema objects (the root and every subschema) of a cheap schema.
MAX_SCHEMA_NODES = 32
#: The deepest subschema nesting of a cheap schema (the root is depth 0).
MAX_SCHEMA_DEPTH = 6
#: The largest ``minLength``/``maxLength``/``minItems``/``maxItems``/... of a cheap schema.
MAX_SCHEMA_COUNT = 256
#: The most ``enum`` values of one cheap subschema.
MAX_ENUM = 64
#: The longest cheap regex (a REGEX guide or a schema ``pattern``).
MAX_REGEX_CHARS = 64
#: The largest sum of a cheap regex's repetition counts, a wide atom without a quantifier
#: counting 1 (``[a-z]{2}-[0-9]{4}``: 6; ``a.b.c``: 2).
MAX_REGEX_COUNTS = 8
#: The largest sum of those counts over all the patterns of a cheap schema.
MAX_SCHEMA_REGEX_COUNTS = 16
#: The most whitespace ``json_whitespace="bounded"`` may allow for a JSON guide to be cheap.
MAX_WHITESPACE = 16
#: Schema keywords whose compile cost is not bounded by the schema's size (or that this
#: estimate does not follow): a schema using any of them compiles in a worker.
COSTLY_KEYWORDS = frozenset({
    "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "$ref", "$dynamicRef",
    "$recursiveRef", "patternProperties", "propertyNames", "dependencies",
    "dependentSchemas", "dependentRequired", "unevaluatedProperties", "unevaluatedItems",
    "additionalItems", "prefixItems", "contains", "minProperties", "maxProperties"})
_COUNT_KEYWORDS = ("minLength", "maxLength", "minItems", "maxItems")
#: Escapes of wide atoms: each matches all but a few characters, as ``.`` does.
_WIDE_ESCAPES = ("W", "S", "D")


def why_not_cheap(params: GuidedDecodingParams, config: GuidedDecodingConfig) -> str | None:
    """Why ``params`` should compile in a worker, or None where it is cheap to compile in the
    decoder's process (see the module docstring). Pure Python, no backend call; at most a
    :data:`MAX_SCHEMA_CHARS` JSON parse."""
    gt, guide = params.guide_type, params.guide
    if gt in (GuideType.JSON, GuideType.JSON_SCHEMA) and config.json_whitespace == "bounded" \
            and config.json_max_whitespace > MAX_WHITESPACE:
        return (f"json_max_whitespace={config.json_max_whitespace} is above "
                f"{MAX_WHITESPACE}")
    if gt is GuideType.JSON:
        return None
    if gt is GuideType.REGEX:
        return _regex_cost(guide, "the regex")
    if gt is GuideType.JSON_SCHEMA:
        if len(guide) > MAX_SCHEMA_CHARS:
            return f"the schema has {len(guide)} characters (over {MAX_SCHEMA_CHARS})"
        try:
            schema = json.loads(guide)
        except ValueError:
            return "the schema is not JSON"
        return _schema_cost(schema)
    return f"{gt.name} guides always compile in a worker"


def _schema_cost(root: Any) -> str | None:
    """Why the parsed schema ``root`` is not cheap, or None."""
    nodes, counts = 0, 0
    stack: list[tuple[Any, str, int]] = [(root, "", 0)]
    while stack:
        node, where, depth = stack.pop()
        here = where or "/"
        if isinstance(node, bool):
            continue
        if not isinstance(node, dict):
            return f"the subschema at {here} is not an object"
        nodes += 1
        if nodes > MAX_SCHEMA_NODES:
            return f"the schema has over {MAX_SCHEMA_NODES} subschemas"
        if depth > MAX_SCHEMA_DEPTH:
            return f"the subschema at {here} is nested over {MAX_SCHEMA_DEPTH} deep"
        costly = COSTLY_KEYWORDS.intersection(node)
        if costly:
            return f"{sorted(costly)[0]} at {here}"
        extra = node.get("additionalProperties", False)
        if extra is not False:
            return f"additionalProperties at {here} allows more properties"
        if isinstance(node.get("items"), list):
            return f"tuple items at {here}"
        for keyword in _COUNT_KEYWORDS:
            value = node.get(keyword)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                if value is not None:
                    return f"{keyword} at {here} is not a number"
            elif not 0 <= value <= MAX_SCHEMA_COUNT:
                return f"{keyword}={value!r} at {here} is over {MAX_SCHEMA_COUNT}"
        enum = node.get("enum")
        if isinstance(enum, list) and len(enum) > MAX_ENUM:
            return f"enum at {here} has {len(enum)} values (over {MAX_ENUM})"
        pattern = node.get("pattern")
        if pattern is not None:
            if not isinstance(pattern, str):
                return f"pattern at {here} is not a string"
            if "enum" in node or "const" in node:
                # the policy check matches the values against the pattern (bounded, but up to
                # schema_policy.REGEX_CHECK_SECONDS): not in the decoder's process
                return f"pattern next to enum/const at {here}"
            reason, n = _regex_counts(pattern, f"pattern at {here}")
            if reason is not None:
                return reason
            counts += n
            if counts > MAX_SCHEMA_REGEX_COUNTS:
                return (f"the schema's patterns repeat {counts} times in counts, up to the "
                        f"one at {here} (over {MAX_SCHEMA_REGEX_COUNTS})")
        stack.extend((sub, path, depth + 1) for sub, path in subschemas(node, where))
    return None


def _regex_cost(pattern: str, what: str) -> str | None:
    """Why the regex ``pattern`` is not cheap (:data:`MAX_REGEX_CHARS`,
    :data:`MAX_REGEX_COUNTS`, no count on a group), or None."""
    return _regex_counts(pattern, what)[0]


def _regex_counts(pattern: str, what: str) -> tuple[str | None, int]:
    """``(why the regex is not cheap or None, the sum of its counts)``: the counts of its
    ``{n}``/``{n,m}`` (the larger bound) plus 1 per wide atom without a ``*``, ``+`` or count
    on it (a spelled-out repeat of one compiles like its counted form)."""
    if len(pattern) > MAX_REGEX_CHARS:
        return f"{what} has {len(pattern)} characters (over {MAX_REGEX_CHARS})", 0
    total, i, n = 0, 0, len(pattern)
    after_group = False  # whether the last atom was a group, a count on which multiplies
    while i < n:
        c = pattern[i]
        if c == "{" and i + 1 < n and pattern[i + 1].isdigit():
            end = pattern.find("}", i)
            if end < 0:
                return f"{what} has an unclosed count at offset {i}", total
            if after_group:
                return f"{what} repeats a group a counted number of times (offset {i})", total
            try:
                total += max(int(v) for v in pattern[i + 1:end].split(",") if v.strip())
            except ValueError:
                return f"{what} has a count it cannot read at offset {i}", total
            i = end + 1
        else:
            if c == "\\":
                wide = pattern[i + 1:i + 2] in _WIDE_ESCAPES
                i += 2
            elif c == "[":
                wide = pattern[i + 1:i + 2] == "^"
                i = _class_end(pattern, i)
            else:
                wide = c == "."
                i += 1
            after_group = c == ")"
            quantified = i < n and (pattern[i] in "*+" or (
                pattern[i] == "{" and pattern[i + 1:i + 2].isdigit()))
            if wide and not quantified:
                total += 1
        if total > MAX_REGEX_COUNTS:
            return (f"{what} repeats {total} times in counts and wide atoms (over "
                    f"{MAX_REGEX_COUNTS})"), total
    return None, total


def _class_end(pattern: str, i: int) -> int:
    """The index just past the character class opening at ``pattern[i] == '['``."""
    j, n = i + 1, len(pattern)
    if j < n and pattern[j] == "^":
        j += 1
    if j < n and pattern[j] == "]":  # a leading ']' is a member
        j += 1
    while j < n and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def main(argv: list[str] | None = None) -> None:
    """Over the bundled JSON schemas (or ``--data``), print the share :func:`why_not_cheap`
    calls cheap, and for those, p50/p99/max of the best of ``--repeat`` interleaved runs:
    the compile here; the time through a worker (compile, serialize, pipe, deserialize) at
    nice 0 and at :data:`~capgraph.grammar.process_pool.WORKER_NICE`, and the compile inside
    each; then why the other schemas go to a worker."""
    import argparse
    import collections
    import re
    import time

    from ..bench.common import summarize
    from ..bench.tail import load_records
    from ..tokenizers import load_tokenizer
    from .process_pool import WORKER_NICE, ProcessCompilePool
    from .xgrammar_backend import XGrammarMatcherFactory

    parser = argparse.ArgumentParser(prog="python -m capgraph.grammar.compile_cost")
    parser.add_argument("--data", help="a JSONL file of {id, schema} records")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    config = GuidedDecodingConfig.from_tokenizer(
        load_tokenizer("tekken"), compile_cache_bytes=0, compile_disk_cache_bytes=0,
        json_unenforced_keywords="ignore")
    factory = XGrammarMatcherFactory(config)
    pools = {nice: ProcessCompilePool(config, 1, 0, nice=nice) for nice in (0, WORKER_NICE)}
    records = load_records(args.data)
    times: dict[str, list[float]] = collections.defaultdict(list)
    reasons: collections.Counter[str] = collections.Counter()

    def through(nice: int, params: GuidedDecodingParams) -> tuple[float, float]:
        start = time.perf_counter()
        text, _, compile_s = pools[nice].compile(None, params)
        factory._deserialize(params, text)
        return time.perf_counter() - start, compile_s

    try:
        for pool_nice in pools:  # (the workers' start)
            through(pool_nice, GuidedDecodingParams.json())
        for record in records:
            params = GuidedDecodingParams.json_schema(json.dumps(record["schema"]))
            reason = why_not_cheap(params, config)
            if reason is not None:
                reasons[re.sub(r"\d+", "N", reason.split(" at ")[0])] += 1
                continue
            best: dict[str, float] = collections.defaultdict(lambda: float("inf"))
            try:
                for _ in range(max(1, args.repeat)):
                    start = time.perf_counter()
                    factory._compile_here(params)
                    best["compiled here"] = min(best["compiled here"],
                                                time.perf_counter() - start)
                    for nice in pools:
                        total, inside = through(nice, params)
                        for name, seconds in ((f"through a worker, nice {nice}", total),
                                              (f"  its compile, nice {nice}", inside)):
                            best[name] = min(best[name], seconds)
            except Exception as e:  # noqa: BLE001 - a schema refused alike on every path
                reasons[f"refused ({type(e).__name__})"] += 1
                continue
            for name, seconds in best.items():
                times[name].append(seconds)
    finally:
        for pool in pools.values():
            pool.close()
        factory.close()
    cheap = len(times["compiled here"])
    print(f"{cheap} of {len(records)} schemas cheap ({cheap / len(records):.0%})")
    for name, values in times.items():
        s = summarize(values, 1e3)
        print(f"  {name:26}: p50 {s['p50']:6.1f} ms, p99 {s['p99']:6.1f} ms, "
              f"max {s['max']:6.1f} ms")
    for reason, count in reasons.most_common():
        print(f"  to a worker: {count:3} {reason}")


if __name__ == "__main__":
    main()
