#!/usr/bin/env python3
"""logits_bitmask vs xgrammar's applies on [B, V] logits: ``capgraph bench apply``.

Kept as a thin wrapper; the benchmark lives in capgraph/bench/apply.py. Comma-separated lists
(the older spelling, ``--batches 1,8,64,512``) are still accepted.

    python tools/bench_apply.py [--batches 1 8 64 512] [--vocab 131072] [--dtypes fp32 bf16]
                                [--repeat 20] [--threads N] [--json PATH]
"""

from __future__ import annotations

import sys

from capgraph.bench import main


def _split_commas(argv: list[str]) -> list[str]:
    out: list[str] = []
    for arg in argv:
        out += [a for a in arg.split(",") if a] if "," in arg and not arg.startswith("-") \
            else [arg]
    return out


if __name__ == "__main__":
    sys.exit(main(["apply", *_split_commas(sys.argv[1:])]))
