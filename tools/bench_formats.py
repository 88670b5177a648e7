"""String formats as the backend reads them or as capgraph gives them (the exact patterns of
``capgraph.grammar.formats``): the compile and the per-token mask time, one run.

For each format a backend reads wider than its definition, a schema ``{"type": "object",
"properties": {"v": {"type": "string", "format": F}}}`` is compiled twice through capgraph's
factory for that backend: once with the backend's own format regex (capgraph's rewrite turned
off for this side) and once as capgraph gives it. Each side's compile is timed (fresh factory,
best of ``--repeat``), and each token of a valid instance's mask is timed on a fresh matcher
per pass (the sides alternately on the same token, fastest of ``--repeat`` passes). The
``leap`` rows time the pattern that spells out a leap second at every offset's local minute
(RFC 3339's whole reading, which capgraph does not use) against the one it uses.

    python tools/bench_formats.py
    python tools/bench_formats.py --backends xgrammar --repeat 5
"""

from __future__ import annotations

import argparse
import json
import math
import time
from contextlib import contextmanager
from typing import Any, Iterator

INSTANCES = {"date": "2024-02-29", "time": "23:59:60.25Z",
             "date-time": "2021-11-30T08:15:00.5+01:30", "ipv4": "192.168.100.254",
             "ipv6": "::ffff:10.0.0.1", "hostname": "api.eu-west.example.com"}


def every_offset_leap_seconds() -> str:
    """A ``time`` pattern that takes the second 60 at each offset's local 23:59 UTC minute
    (2,880 alternatives): what RFC 3339 allows, priced here."""
    from capgraph.grammar import formats
    digit = "[0-9]"
    fraction = f"(?:\\.{digit}+)?"
    hours = []
    for hour in range(24):
        minutes = []
        for minute in range(60):
            local, utc = hour * 60 + minute, 23 * 60 + 59
            ahead, behind = (local - utc) % 1440, (utc - local) % 1440
            offsets = [f"\\+{ahead // 60:02d}:{ahead % 60:02d}",
                       f"-{behind // 60:02d}:{behind % 60:02d}"]
            if local == utc:
                offsets.append("[Zz]")
            minutes.append(f"{minute:02d}:60{fraction}(?:{'|'.join(offsets)})")
        hours.append(f"{hour:02d}:(?:{'|'.join(minutes)})")
    usual = formats.FORMAT_PATTERNS["time"][1:-1].split("|23:59:60")[0]
    return f"^(?:{usual}|{'|'.join(hours)}))$"


@contextmanager
def own_formats() -> Iterator[None]:
    """capgraph's format rewrite off (every backend reads its own formats) inside."""
    from capgraph.grammar import formats
    saved = formats.WIDER_FORMATS
    formats.WIDER_FORMATS = {}
    try:
        yield
    finally:
        formats.WIDER_FORMATS = saved


def timed_side(tokenizer: Any, backend: str, schema: dict, instance: str, repeat: int
               ) -> tuple[float, list[float]]:
    """(best compile seconds, fastest mask seconds per token) of ``schema`` on ``backend``."""
    from capgraph import GuidedDecodingConfig, GuidedDecodingParams
    from capgraph.bitmask import allocate_host_bitmask
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import encode_continuation

    params = GuidedDecodingParams.json_schema(json.dumps(schema))
    config = GuidedDecodingConfig.from_tokenizer(tokenizer, backend=backend)
    compile_s = math.inf
    for _ in range(max(1, repeat)):
        factory = create_matcher_factory(config)
        start = time.perf_counter()
        factory.compile(params)
        compile_s = min(compile_s, time.perf_counter() - start)
    tokens = encode_continuation(tokenizer, json.dumps({"v": instance}))
    bitmask = allocate_host_bitmask(1, config.vocab_size_padded, pin=False)
    best = [math.inf] * len(tokens)
    for _ in range(max(1, repeat)):
        matcher = factory.create(params)
        for i, token in enumerate(tokens):
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            best[i] = min(best[i], time.perf_counter() - start)
            if not matcher.accept_token(token):
                raise SystemExit(f"{backend} refuses token {i} of {instance!r} ({schema})")
    return compile_s, best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", default="tekken", help="bundled tokenizer")
    parser.add_argument("--backends", nargs="+", default=["xgrammar", "llguidance"],
                        choices=["xgrammar", "llguidance"])
    parser.add_argument("--repeat", type=int, default=3, help="passes (compiles, masks)")
    args = parser.parse_args(argv)

    from capgraph.bench.common import (Column, describe_machine, machine_info, mask_cells,
                                       mask_columns, print_table)
    from capgraph.grammar.formats import FORMAT_PATTERNS, WIDER_FORMATS
    from capgraph.tokenizers import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    print(describe_machine(machine_info()))
    rows = []
    for backend in args.backends:
        sides: list[tuple[str, str, dict, Any]] = []
        for fmt in sorted(WIDER_FORMATS[backend]):
            schema = {"type": "object", "properties": {"v": {"type": "string", "format": fmt}},
                      "required": ["v"]}
            sides += [(fmt, "own", schema, own_formats), (fmt, "capgraph", schema, None)]
        leap = {"type": "object", "required": ["v"], "properties": {"v": {
            "type": "string", "pattern": FORMAT_PATTERNS["time"]}}}
        every = {"type": "object", "required": ["v"], "properties": {"v": {
            "type": "string", "pattern": every_offset_leap_seconds()}}}
        sides += [("leap", "capgraph", leap, None), ("leap", "every offset", every, None)]
        for fmt, side, schema, context in sides:
            instance = INSTANCES["time" if fmt == "leap" else fmt]
            if context is not None:
                with context():
                    compile_s, masks = timed_side(tokenizer, backend, schema, instance,
                                                  args.repeat)
            else:
                compile_s, masks = timed_side(tokenizer, backend, schema, instance,
                                              args.repeat)
            rows.append({"backend": backend, "format": fmt, "side": side,
                         "compile": compile_s * 1e3, **mask_cells(masks)})
    print(f"tokenizer {args.tokenizer}, fastest of {args.repeat} passes")
    print_table([Column("backend", "backend"), Column("format", "format"),
                 Column("side", "regex"), *mask_columns()], rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
