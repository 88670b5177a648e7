#!/usr/bin/env python3
"""Host build time per decode step, capgraph vs a plain xgrammar loop: ``capgraph bench build``.

Kept as a thin wrapper; the benchmark lives in capgraph/bench/build.py.

    python tools/bench_build.py --batches 1 8 32 128 --draft 0 4 --tokenizer tekken mistral-sp32k
"""

from __future__ import annotations

import sys

from capgraph.bench import main

if __name__ == "__main__":
    sys.exit(main(["build", *sys.argv[1:]]))
