"""Do xgrammar and llguidance allow the same tokens? Teacher-forced over the bundled schemas.

For every bundled JSON Schema Bench schema both backends compile, the tokenizer's encoding of
its first valid instance (plus the stop token) is fed to an xgrammar and an llguidance matcher,
and their mask rows are compared before every token. Prints how many rows are equal and how
many have a token llguidance allows and xgrammar refuses — what a ``backend="auto"`` request
may write before its hand-over that xgrammar's replay then refuses (the request stays on
llguidance; xgrammar allowing more is harmless there), with the tokens seen most.

    python tools/backend_agreement.py [--tokenizer tekken] [--limit N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokenizer", default="tekken")
    p.add_argument("--limit", type=int, help="the first N bundled schemas")
    args = p.parse_args(argv)

    import torch

    from capgraph import GuidedDecodingConfig, GuidedDecodingParams
    from capgraph.bench.compile import valid_instances
    from capgraph.bench.tail import chosen_records
    from capgraph.grammar import create_matcher_factory
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    t0 = time.perf_counter()
    tok = load_tokenizer(args.tokenizer)
    common = {"compile_disk_cache_bytes": 0}
    xgr = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok, backend="xgrammar",
                                                                     **common))
    llg = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok, backend="llguidance",
                                                                     **common))
    records = chosen_records(argparse.Namespace(data=None, limit=args.limit, quick=False),
                             "agreement", 4)
    words = (xgr.config.vocab_size_padded + 31) // 32
    a = torch.zeros((1, words), dtype=torch.int32)
    b = torch.zeros((1, words), dtype=torch.int32)
    counts: Counter[str] = Counter()
    llg_only: Counter[str] = Counter()  # token text -> rows
    where: dict[str, str] = {}  # token text -> the first schema and row it was seen at
    for record in records:
        params = GuidedDecodingParams.json_schema(json.dumps(record["schema"]))
        instances, _ = valid_instances(record)
        try:
            cx, cl = xgr.compile(params), llg.compile(params)
        except Exception:  # noqa: BLE001 - one backend refuses it: no hand-over either
            counts["schemas one backend refuses"] += 1
            continue
        if not instances:
            continue
        counts["schemas compared"] += 1
        ids = encode_continuation(tok, json.dumps(instances[0])) + [tok.eos_token_id]
        mx, ml = xgr.create_from_compiled(cx), llg.create_from_compiled(cl)
        for t in ids:
            a.zero_()
            b.zero_()
            mx.fill_next_token_bitmask(a, 0)
            ml.fill_next_token_bitmask(b, 0)
            counts["rows"] += 1
            if torch.equal(a, b):
                counts["rows equal"] += 1
            only = (b & ~a)[0]
            if bool(only.any()):
                counts["rows where llguidance allows a token xgrammar refuses"] += 1
                word = int(only.nonzero()[0])
                bit = (int(only[word]) & -int(only[word])).bit_length() - 1
                text = repr(tok.decode([word * 32 + bit]))
                llg_only[text] += 1
                where.setdefault(text, f"{record['id']} row {counts['rows'] - 1}")
            if not (mx.accept_token(t) and ml.accept_token(t)):
                counts["instances refused part-way"] += 1
                break
    for key in ("schemas compared", "schemas one backend refuses", "rows", "rows equal", "rows where llguidance allows a token xgrammar refuses",
                "instances refused part-way"):
        print(f"{key:>55}: {counts[key]}")
    if llg_only:
        print("first token llguidance alone allows, by rows (first seen at):")
        for text, rows in llg_only.most_common(8):
            print(f"  {text} {rows} ({where[text]})")
    print(f"({time.perf_counter() - t0:.1f} s; {args.tokenizer})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
