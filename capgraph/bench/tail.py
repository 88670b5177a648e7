"""Mask latency tail (the MaskBench method) over public JSON schemas with valid instances.

Each schema of the bundled JSONSchemaBench subset (``capgraph/data/jsonschemabench.jsonl``, see
its NOTICE) is compiled once through capgraph's xgrammar factory (compile times: the tail of the
time to first mask); each of its valid instances, checked against the schema with
``jsonschema`` first, is serialised and fed token by token, and the time of every mask is kept.
Two sides, per token, on one thread of control:

* ``xgrammar``: the bare matcher, ``fill_next_token_bitmask`` then ``accept_token`` (MaskBench);
* ``capgraph``: a batch-1 :class:`~capgraph.decoder.GuidedDecoder` step, ``add_batch`` + ``build``
  (advance, fill, dead-end guard, padded-vocabulary tail), i.e. what an engine pays per token.

Percentiles are over all tokens of all instances (p50, p90, p99, p99.9, max). With
``--repeat R`` every instance is fed R times and a second set of figures takes, per token, the
fastest of the R (this removes preemption by other processes on a shared machine; the first
pass alone is MaskBench's figure). Schemas xgrammar cannot compile are skipped and counted; an
instance the grammar rejects (xgrammar does not implement every JSON-Schema feature) is counted
and its tokens up to the rejection are kept.
"""

from __future__ import annotations

import argparse
import json
import time
from importlib import resources

from .common import Column, pick, print_table, summarize

HELP = "per-token mask time percentiles over public JSON schemas (MaskBench method)"

DATA = "jsonschemabench.jsonl"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", help="bundled tokenizer (default tekken)")
    p.add_argument("--limit", type=int, help="use the first N schemas (default: all; quick: 8)")
    p.add_argument("--repeat", type=int, help="passes over each instance (default 3; quick 1)")
    p.add_argument("--compile-timeout", type=float, default=120.0,
                   help="seconds before a compile is given up (counted as a timeout)")
    p.add_argument("--data", help="a JSONL file of {id, category, schema, instances} records "
                   "(default: the bundled subset)")


def load_records(path: str | None = None) -> list[dict]:
    """The benchmark records: ``{"id", "category", "schema", "instances": [...]}`` per line.

    ``path`` is the ``--data`` file of the commands that read records: a file that cannot be
    read, a line that is not JSON or not a JSON object, or a record without its ``id``,
    ``schema`` or ``instances``, is a :class:`~capgraph.errors.ConfigError` naming the file
    and the line, not a traceback."""
    if not path:
        text = resources.files("capgraph").joinpath("data", DATA).read_text()
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    from capgraph.cli import json_kind, read_text_file
    from capgraph.errors import ConfigError
    records = []
    for number, line in enumerate(read_text_file(path, "--data").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--data {path} line {number}: invalid JSON at column {e.colno}: "
                              f"{e.msg}") from None
        if not isinstance(record, dict):
            raise ConfigError(f"--data {path} line {number}: expected a JSON object (a record), "
                              f"got a JSON {json_kind(record)}")
        for key, kinds, what in (("id", (str, int), "a string or integer"),
                                 ("schema", (dict, bool), "a JSON schema (object or boolean)"),
                                 ("instances", (list,), "a list of JSON values")):
            if key not in record:
                raise ConfigError(f"--data {path} line {number}: the record has no {key!r} "
                                  f"(each holds 'id', 'schema' and 'instances')")
            if not isinstance(record[key], kinds) or isinstance(record[key], bool) \
                    and bool not in kinds:
                raise ConfigError(f"--data {path} line {number}: {key!r} must be {what}, got "
                                  f"a JSON {json_kind(record[key])}")
        records.append(record)
    return records


def valid_instances(record: dict) -> tuple[list, list[str]]:
    """The record's instances that validate against its schema (jsonschema, formats checked),
    and a message per instance that does not."""
    import jsonschema
    from jsonschema import validators

    schema = record["schema"]
    cls = validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    cls.check_schema(schema)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    good, bad = [], []
    for i, inst in enumerate(record["instances"]):
        error = next(iter(validator.iter_errors(inst)), None)
        if error is None:
            good.append(inst)
        else:
            bad.append(f"instance {i}: {error.message[:120]}")
    return good, bad


def chosen_records(args: argparse.Namespace, bench: str, quick_count: int) -> list[dict]:
    """The schema records a bench over them runs on: ``--data`` (default: the bundled subset),
    the first ``--limit``, or with ``--quick`` the ``quick_count`` smallest. Exits naming
    ``bench`` where jsonschema (which validates every instance) is missing."""
    try:
        import jsonschema  # noqa: F401
    except ImportError as e:
        raise SystemExit(f"capgraph bench {bench} validates every instance with jsonschema: "
                         "pip install jsonschema") from e
    records = load_records(args.data)
    if args.limit:
        return records[:args.limit]
    if args.quick:  # the smallest schemas, so the smoke run stays short
        return sorted(records, key=lambda r: len(json.dumps(r["schema"])))[:quick_count]
    return records


def run(args: argparse.Namespace) -> dict:
    records = chosen_records(args, "tail", 8)
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import load_tokenizer

    q = args.quick
    tokenizer = pick(args.tokenizer, q, "tekken", "tekken")
    repeat = max(1, pick(args.repeat, q, 1, 3))
    tok = load_tokenizer(tokenizer)
    # mask timing only: schemas with keywords xgrammar does not enforce are measured as is;
    # compiles are timed, so none is read from the disk cache
    config = GuidedDecodingConfig.from_tokenizer(tok, compile_timeout_s=args.compile_timeout,
                                                 json_unenforced_keywords="ignore",
                                                 compile_disk_cache_bytes=0)
    factory = create_matcher_factory(config)
    try:
        result = measure(records, tok, factory, repeat, args.compile_timeout)
    finally:
        factory.close()
    result["tokenizer"] = tokenizer
    result["vocab"] = config.vocab_size_padded
    _print(result)
    return result


def measure(records: list[dict], tok, factory, repeat: int, timeout: float) -> dict:
    from capgraph import GuidedDecodingParams
    from capgraph.decoder import GuidedDecoder
    from capgraph.errors import CompileTimeoutError, GrammarCompileError
    from capgraph.tokenizers import encode_continuation

    dec = GuidedDecoder(factory.config, 1, 0, factory=factory)
    compile_s: list[float] = []
    samples: dict[str, list[float]] = {"xgrammar": [], "capgraph": []}  # first pass
    best: dict[str, list[float]] = {"xgrammar": [], "capgraph": []}  # fastest of `repeat`
    counts = {"schemas": len(records), "compile_failed": 0, "compile_timeout": 0,
              "instances": 0, "instances_invalid": 0, "instances_rejected": 0, "tokens": 0,
              "masks": 0}
    per_schema, failures = [], []
    for n, record in enumerate(records):
        instances, invalid = valid_instances(record)
        counts["instances_invalid"] += len(invalid)
        entry: dict = {"id": record["id"], "category": record.get("category")}
        per_schema.append(entry)
        if invalid:
            entry["invalid"] = invalid
        params = GuidedDecodingParams.json_schema(json.dumps(record["schema"]))
        t0 = time.perf_counter()
        try:
            compiled = factory.compile_async(params).result(timeout, backend="xgrammar")
        except GrammarCompileError as e:
            timed_out = isinstance(e, CompileTimeoutError)
            counts["compile_timeout" if timed_out else "compile_failed"] += 1
            entry["compile_error"] = str(e)[:300]
            failures.append(entry)
            continue
        entry["compile_ms"] = (time.perf_counter() - t0) * 1e3
        compile_s.append(compiled.compile_s)
        for inst in instances:
            ids = encode_continuation(tok, json.dumps(inst))
            passes: dict[str, list[list[float]]] = {"xgrammar": [], "capgraph": []}
            for _ in range(repeat):
                xs, rejected_x = _xgrammar_pass(compiled.payload, ids, factory)
                cs, rejected_c = _capgraph_pass(dec, params, ids)
                passes["xgrammar"].append(xs)
                passes["capgraph"].append(cs)
            if rejected_x is not None or rejected_c is not None:
                counts["instances_rejected"] += 1
                entry.setdefault("rejected_at_token", []).append(
                    {"xgrammar": rejected_x, "capgraph": rejected_c, "tokens": len(ids)})
            counts["instances"] += 1
            counts["tokens"] += len(ids)
            counts["masks"] += len(passes["xgrammar"][0])
            for side in samples:
                samples[side] += passes[side][0]
                best[side] += [min(ts) for ts in zip(*passes[side])]
            entry.setdefault("tokens", []).append(len(ids))
            entry.setdefault("max_mask_ms", []).append(
                {side: max(passes[side][0]) * 1e3 for side in passes})
        print(f"  [{n + 1}/{len(records)}] {record['id']}: compile "
              f"{entry.get('compile_ms', float('nan')):.1f} ms, {sum(entry.get('tokens', []))} "
              f"tokens", flush=True)
    rows = []
    for side in ("xgrammar", "capgraph"):
        if samples[side]:
            rows.append({"what": f"{side} mask, first pass", **summarize(samples[side], 1e3)})
        if repeat > 1 and best[side]:
            rows.append({"what": f"{side} mask, best of {repeat}", **summarize(best[side], 1e3)})
    if compile_s:
        rows.append({"what": "compile (xgrammar via capgraph)", **summarize(compile_s, 1e3)})
    return {"rows": rows, "counts": counts, "repeat": repeat, "per_schema": per_schema,
            "compile_failures": failures}


def _xgrammar_pass(compiled, ids: list[int], factory) -> tuple[list[float], int | None]:
    """Mask before each token and after the last; returns the times and where it rejected."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, factory.config.vocab_size_padded)
    times = []
    for k, token in enumerate(ids):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t0)
        if not matcher.accept_token(token):
            return times, k
    t0 = time.perf_counter()
    matcher.fill_next_token_bitmask(bitmask, 0)
    times.append(time.perf_counter() - t0)
    return times, None


def _capgraph_pass(dec, params, ids: list[int]) -> tuple[list[float], int | None]:
    """A context step, then one generation step per token (each: add_batch + build)."""
    from capgraph.requests import GuidedRequest

    dec.release(0)
    times = []
    t0 = time.perf_counter()
    dec.add_batch([GuidedRequest.context(0, 0, params)])
    failed = dec.build()
    times.append(time.perf_counter() - t0)
    if failed:
        raise RuntimeError(f"context step failed: {failed}")
    for k, token in enumerate(ids):
        request = GuidedRequest.generation(0, 0, params, token)
        t0 = time.perf_counter()
        dec.add_batch([request])
        failed = dec.build()
        elapsed = time.perf_counter() - t0
        if failed:
            return times, k
        times.append(elapsed)
    return times, None


COLUMNS = [Column("what", "measured"), Column("n", "n"), Column("p50", "p50 ms", ".4f"),
           Column("p90", "p90 ms", ".4f"), Column("p99", "p99 ms", ".3f"),
           Column("p99.9", "p99.9 ms", ".3f"), Column("max", "max ms", ".2f"),
           Column("mean", "mean ms", ".4f")]


def _print(result: dict) -> None:
    print_table(COLUMNS, result["rows"])
    c = result["counts"]
    print(f"schemas {c['schemas']}: compile failed {c['compile_failed']}, timed out "
          f"{c['compile_timeout']}; instances {c['instances']} ({c['instances_invalid']} invalid "
          f"per jsonschema, skipped; {c['instances_rejected']} rejected by the grammar part-way);"
          f" tokens {c['tokens']}, masks timed per side {c['masks']}", flush=True)
