"""Time to first mask and per-token mask time per grammar backend, over public JSON schemas.

Every schema of the bundled JSONSchemaBench subset (the records of :mod:`capgraph.bench.tail`)
is compiled cold by each backend mode of :data:`MODES` that this installation can build, one
factory per mode, with no disk cache and no memory cache (``compile_disk_cache_bytes=0``,
``compile_cache_bytes=0``), so every attempt compiles. Modes are interleaved per schema, the
first mode rotating from schema to schema, so background load falls on all of them alike.

* time to first mask: ``compile_async`` -> ``result`` -> ``create_from_compiled`` -> the first
  ``fill_next_token_bitmask``, what a request with a new schema waits for before its first
  token; a compile that fails or passes ``--compile-timeout`` is counted, not timed;
* per-token mask time once compiled: each valid instance (checked with ``jsonschema``) is fed
  token by token to a fresh matcher, ``fill_next_token_bitmask`` then ``accept_token``, and
  every fill is timed (the tokens of an instance the grammar rejects part-way are kept).

With ``--repeat R`` each schema is compiled R times and each instance fed R times; a schema's
time to first mask is the fastest of its R attempts and a token's mask time the fastest of its
R passes (this removes preemption by other processes). Ratios compare the modes two by two over
the schemas that both served, so a schema one backend refuses does not skew them. A mode whose
matcher switches backends (``auto``: llguidance first, xgrammar once its compile lands) waits,
untimed, for that compile after each first mask, so its mask passes measure the matcher once
handed over; a row ``auto on xgrammar / xgrammar`` compares its masks with xgrammar's over the
schemas where every pass ended on xgrammar.
"""

from __future__ import annotations

import argparse
import itertools
import json
import time
from typing import Any

from .common import Column, pick, print_table, summarize
from .tail import chosen_records, valid_instances

HELP = "time to first mask (cold compile) and per-token mask time per backend, with ratios"

#: mode name -> the GuidedDecodingConfig fields that select it (over the run's defaults); a
#: mode this installation cannot build (a ConfigError from its config or factory) is skipped
#: with the reason. "auto" refuses ``json_unenforced_keywords="ignore"``: it serves a schema
#: only as a backend that enforces it, so schemas neither enforces fail there.
MODES: dict[str, dict[str, Any]] = {
    "xgrammar": {"backend": "xgrammar"},
    "llguidance": {"backend": "llguidance"},
    "auto": {"backend": "auto", "json_unenforced_keywords": "error"},
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", help="bundled tokenizer (default tekken)")
    p.add_argument("--limit", type=int, help="use the first N schemas (default: all; quick: the "
                   "4 smallest)")
    p.add_argument("--repeat", type=int, help="cold compiles per schema and passes per instance "
                   "(default 3; quick 1)")
    p.add_argument("--compile-timeout", type=float, default=30.0,
                   help="seconds before a compile is given up (counted as a timeout; default 30)")
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="backend modes to measure (default: all that can be built here)")
    p.add_argument("--compile-isolation", choices=("thread", "process"),
                   help="GuidedDecodingConfig.compile_isolation (default: the config's)")
    p.add_argument("--data", help="a JSONL file of {id, category, schema, instances} records "
                   "(default: the bundled subset)")


def run(args: argparse.Namespace) -> dict:
    records = chosen_records(args, "compile", 4)
    from capgraph.tokenizers import load_tokenizer

    q = args.quick
    tokenizer = pick(args.tokenizer, q, "tekken", "tekken")
    repeat = max(1, pick(args.repeat, q, 1, 3))
    tok = load_tokenizer(tokenizer)
    # cold compiles only: no disk cache, no memory cache; masks of schemas with keywords a
    # backend does not enforce are measured as is (as in bench tail)
    fields: dict[str, Any] = {"compile_timeout_s": args.compile_timeout,
                              "json_unenforced_keywords": "ignore",
                              "compile_disk_cache_bytes": 0, "compile_cache_bytes": 0}
    if args.compile_isolation:
        fields["compile_isolation"] = args.compile_isolation
    factories, skipped, factory_s = _factories(tok, args.modes, fields)
    if not factories:
        raise SystemExit("capgraph bench compile: no backend mode can be built here: "
                         + "; ".join(f"{n}: {why}" for n, why in skipped.items()))
    try:
        result = measure(records, tok, factories, repeat, args.compile_timeout)
    finally:
        for factory in factories.values():
            factory.close()
    result.update(tokenizer=tokenizer, skipped=skipped, factory_s=factory_s,
                  config_fields=fields)
    _print(result)
    return result


def _factories(tok, modes: list[str], fields: dict[str, Any]) -> tuple[dict, dict, dict]:
    """A fresh factory per mode that can be built: ``(factories, {mode: why not}, {mode: s})``."""
    from capgraph import GuidedDecodingConfig
    from capgraph.errors import ConfigError
    from capgraph.grammar import create_matcher_factory

    factories, skipped, seconds = {}, {}, {}
    for name in modes:
        t0 = time.perf_counter()
        try:
            config = GuidedDecodingConfig.from_tokenizer(tok, **{**fields, **MODES[name]})
            factories[name] = create_matcher_factory(config)
        except ConfigError as e:
            skipped[name] = str(e)
            continue
        seconds[name] = time.perf_counter() - t0
    return factories, skipped, seconds


def measure(records: list[dict], tok, factories: dict, repeat: int, timeout: float) -> dict:
    from capgraph import GuidedDecodingParams
    from capgraph.bitmask import allocate_host_bitmask
    from capgraph.tokenizers import encode_continuation

    names = list(factories)
    bitmasks = {n: allocate_host_bitmask(1, f.config.vocab_size_padded, pin=False)
                for n, f in factories.items()}
    counts: dict[str, dict[str, Any]] = {
        n: {"served": 0, "compile_failed": 0, "compile_timeout": 0, "instances": 0,
            "instances_rejected": 0, "masks": 0} for n in names}
    ttfm: dict[str, dict[str, float]] = {n: {} for n in names}  # mode -> schema -> best s
    compile_s: dict[str, dict[str, float]] = {n: {} for n in names}
    masks: dict[str, dict[str, list[float]]] = {n: {} for n in names}  # mode -> schema -> s
    served_by: dict[str, dict[str, set[str]]] = {n: {} for n in names}  # mode -> schema -> set
    per_schema = []
    for i, record in enumerate(records):
        sid = record["id"]
        instances, invalid = valid_instances(record)
        params = GuidedDecodingParams.json_schema(json.dumps(record["schema"]))
        order = names[i % len(names):] + names[:i % len(names)]
        entry: dict[str, Any] = {"id": sid, "category": record.get("category"), "order": order,
                                 "first_mask_ms": {n: [] for n in names},
                                 "compile_ms": {n: [] for n in names}, "errors": {}}
        if invalid:
            entry["invalid"] = invalid
        per_schema.append(entry)
        compiled = {}
        for _ in range(repeat):
            for name in order:
                if name in entry["errors"]:
                    continue
                try:
                    seconds, compiled[name] = _first_mask(factories[name], params, timeout,
                                                          name, bitmasks[name])
                except Exception as e:  # counted per mode; the run goes on
                    entry["errors"][name] = f"{type(e).__name__}: {str(e)[:300]}"
                    compiled.pop(name, None)
                    counts[name][_failure_kind(e)] += 1
                    continue
                entry["first_mask_ms"][name].append(seconds * 1e3)
                _settle(compiled[name], timeout)
                entry["compile_ms"][name].append(compiled[name].compile_s * 1e3)
        for name in compiled:
            counts[name]["served"] += 1
            ttfm[name][sid] = min(entry["first_mask_ms"][name]) / 1e3
            compile_s[name][sid] = min(entry["compile_ms"][name]) / 1e3
            masks[name][sid] = []
        for inst in instances:
            ids = encode_continuation(tok, json.dumps(inst))
            passes: dict[str, list[list[float]]] = {n: [] for n in compiled}
            rejected: dict[str, int | None] = {}
            for _ in range(repeat):
                for name in order:
                    if name in compiled:
                        times, rejected[name], backend = _mask_pass(
                            factories[name], compiled[name], ids, bitmasks[name])
                        passes[name].append(times)
                        if backend is not None:
                            served = counts[name].setdefault("passes_served_by", {})
                            served[backend] = served.get(backend, 0) + 1
                            served_by[name].setdefault(sid, set()).add(backend)
            for name, runs in passes.items():
                best = [min(ts) for ts in zip(*runs)]
                masks[name][sid] += best
                counts[name]["instances"] += 1
                counts[name]["masks"] += len(best)
                if rejected[name] is not None:
                    counts[name]["instances_rejected"] += 1
                    entry.setdefault("rejected_at_token", {})[name] = rejected[name]
        shown = ", ".join(f"{n} {ttfm[n][sid] * 1e3:.1f} ms" if sid in ttfm[n] else f"{n} failed"
                          for n in names)
        print(f"  [{i + 1}/{len(records)}] {sid}: first mask {shown}", flush=True)
    rows = [_row(n, counts[n], ttfm[n], compile_s[n], masks[n]) for n in names]
    ratios = [_ratio(a, b, ttfm, masks, compile_s) for b, a in itertools.combinations(names, 2)]
    for name in names:  # a switching mode's masks where every pass ended on one backend
        for backend in sorted(set().union(*served_by[name].values())):
            alone = sorted(s for s, b in served_by[name].items() if b == {backend}
                           and s in masks.get(backend, {}))
            if backend != name and alone:
                ratios.append({"mode": f"{name} on {backend}", "over": backend,
                               "schemas": len(alone),
                               **_mask_ratio(masks[name], masks[backend], alone)})
    return {"rows": rows, "ratios": [r for r in ratios if r], "counts": counts,
            "schemas": len(records), "repeat": repeat, "per_schema": per_schema}


def _first_mask(factory, params, timeout: float, name: str, bitmask) -> tuple[float, Any]:
    """Seconds from a cold ``compile_async`` to the first filled mask, and the compiled guide."""
    t0 = time.perf_counter()
    compiled = factory.compile_async(params).result(timeout, backend=name)
    matcher = factory.create_from_compiled(compiled)
    matcher.fill_next_token_bitmask(bitmask, 0)
    return time.perf_counter() - t0, compiled


def _settle(compiled, timeout: float) -> None:
    """Wait (untimed) for the xgrammar compile a hand-over guide started, so that it loads
    neither the next mode's measurement nor the mask passes, which then measure the matcher
    once handed over; a compile that fails or times out leaves the guide on llguidance."""
    from capgraph.errors import GrammarCompileError
    from capgraph.grammar.handover import HandOverGuide

    if isinstance(compiled.payload, HandOverGuide):
        try:
            compiled.payload.xgrammar.result(timeout, backend="xgrammar")
        except GrammarCompileError:
            pass


def _failure_kind(error: Exception) -> str:
    from capgraph.errors import CompileTimeoutError
    return "compile_timeout" if isinstance(error, CompileTimeoutError) else "compile_failed"


def _mask_pass(factory, compiled, ids: list[int], bitmask
               ) -> tuple[list[float], int | None, str | None]:
    """A fresh matcher fed ``ids``: a mask before each token and after the last; returns the
    fill times, the index of the token the grammar rejected, if any, and the backend that
    served the last fill where the matcher can switch (a hand-over matcher's ``served_by``)."""
    matcher = factory.create_from_compiled(compiled)
    times = []
    for k, token in enumerate(ids):
        t0 = time.perf_counter()
        matcher.fill_next_token_bitmask(bitmask, 0)
        times.append(time.perf_counter() - t0)
        if not matcher.accept_token(token):
            return times, k, getattr(matcher, "served_by", None)
    t0 = time.perf_counter()
    matcher.fill_next_token_bitmask(bitmask, 0)
    times.append(time.perf_counter() - t0)
    return times, None, getattr(matcher, "served_by", None)


def _row(name: str, counts: dict, ttfm: dict, compile_s: dict, masks: dict) -> dict:
    row: dict[str, Any] = {"mode": name, **counts}
    samples = [t for ts in masks.values() for t in ts]
    for key, values, scale in (("first_mask", list(ttfm.values()), 1e3),
                               ("compile", list(compile_s.values()), 1e3),
                               ("mask", samples, 1e6)):
        if values:
            row[key] = summarize(values, scale)
    return row


def _ratio(a: str, b: str, ttfm: dict, masks: dict, compile_s: dict) -> dict | None:
    """``a`` over ``b`` on the schemas both served: time to first mask p50/p99/max, ``a``'s
    time to first mask p99 over ``b``'s compile p99, mask p50/p99 (over the tokens of those
    schemas)."""
    both = sorted(set(ttfm[a]) & set(ttfm[b]))
    if not both:
        return None
    out: dict[str, Any] = {"mode": a, "over": b, "schemas": len(both)}
    for q in ("p50", "p99", "max"):
        out[f"first_mask_{q}"] = (summarize([ttfm[a][s] for s in both])[q]
                                  / summarize([ttfm[b][s] for s in both])[q])
    out["first_mask_p99_over_compile_p99"] = (
        summarize([ttfm[a][s] for s in both])["p99"]
        / summarize([compile_s[b][s] for s in both])["p99"])
    out.update(_mask_ratio(masks[a], masks[b], both))
    return out


def _mask_ratio(a: dict, b: dict, schemas: list[str]) -> dict:
    """Mask time p50 and p99 of ``a`` over ``b`` (schema -> samples) over ``schemas``."""
    ma = [t for s in schemas for t in a[s]]
    mb = [t for s in schemas for t in b[s]]
    if not (ma and mb):
        return {}
    sa, sb = summarize(ma), summarize(mb)
    return {"mask_p50": sa["p50"] / sb["p50"], "mask_p99": sa["p99"] / sb["p99"]}


def _get(*path: str):
    def cell(row: dict) -> Any:
        value: Any = row
        for key in path:
            value = value.get(key) if isinstance(value, dict) else None
        return value
    return cell


COLUMNS = [Column("mode", "mode"), Column("served", "served"),
           Column("compile_failed", "failed"), Column("compile_timeout", "timed out"),
           Column(_get("first_mask", "p50"), "1st mask p50 ms", ".2f"),
           Column(_get("first_mask", "p99"), "p99 ms", ".1f"),
           Column(_get("first_mask", "max"), "max ms", ".1f"),
           Column(_get("compile", "p99"), "compile p99 ms", ".1f"),
           Column("masks", "masks"), Column(_get("mask", "p50"), "mask p50 us", ".1f"),
           Column(_get("mask", "p99"), "mask p99 us", ".1f")]

RATIO_COLUMNS = [Column(lambda r: f"{r['mode']} / {r['over']}", "ratio"),
                 Column("schemas", "schemas"),
                 Column("first_mask_p50", "1st mask p50", ".3f"),
                 Column("first_mask_p99", "1st mask p99", ".3f"),
                 Column("first_mask_max", "1st mask max", ".3f"),
                 Column("first_mask_p99_over_compile_p99", "1st mask p99 / compile p99",
                        ".2f"),
                 Column("mask_p50", "mask p50", ".2f"), Column("mask_p99", "mask p99", ".2f")]


def _print(result: dict) -> None:
    print_table(COLUMNS, result["rows"])
    if result["ratios"]:
        print_table(RATIO_COLUMNS, result["ratios"])
    for name, why in result["skipped"].items():
        print(f"{name}: not available ({why})")
    print(f"schemas {result['schemas']}, {result['repeat']} cold compile(s) of each per mode; "
          "valid instances fed (rejected part-way): " + ", ".join(
              f"{n} {k['instances']} ({k['instances_rejected']})"
              for n, k in result["counts"].items()), flush=True)
