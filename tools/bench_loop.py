#!/usr/bin/env python3
"""Decode steps/s of the reference loop, unguided vs guided: ``capgraph bench loop``.

A thin wrapper (tools/gpu_check.sh runs it with ``--device cuda``); the benchmark lives in
capgraph/bench/loop.py.

    python tools/bench_loop.py [--batches 1 8 32] [--steps 60] [--device cpu|cuda] [--json PATH]
"""

from __future__ import annotations

import sys

from capgraph.bench import main

if __name__ == "__main__":
    sys.exit(main(["loop", *sys.argv[1:]]))
