#!/usr/bin/env python3
"""What one step of an ambiguous grammar costs as its output grows: the case that
``host_step_budget_ms`` bounds (docs/RELIABILITY.md, "Grammar work at match time").

    python tools/ambiguous_cost.py [--tokens 300] [--stop-ms 400] [--build native|python]

The guide is ``(a*)*b`` written as grammar rules (``root ::= inner "b"``, ``run ::= "" | "a"
run``, ``inner ::= "" | run inner``: what ``Grammar.from_regex`` makes of the regex; as a REGEX
guide it is one automaton, whose cost does not grow), on xgrammar over a 4-token vocabulary
(``a``, ``b``, ``</s>``, ``c``), fed ``a`` step after step by one request of a
``GuidedDecoder`` with no budget. Each step's time is its ``build()`` (accept the token, fill
the row); the tool prints it at the first step and every ``--every`` steps, and stops after
``--tokens`` steps or at the first step over ``--stop-ms``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GRAMMAR = 'root ::= inner "b"\nrun ::= "" | "a" run\ninner ::= "" | run inner'
VOCAB = ["a", "b", "</s>", "c"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=300, help="steps to run at most (default 300)")
    p.add_argument("--stop-ms", type=float, default=400.0,
                   help="stop after the first step slower than this (default 400)")
    p.add_argument("--every", type=int, default=25, help="print every N steps (default 25)")
    p.add_argument("--build", choices=["native", "python"], default="native",
                   help="the host build (default native: the C++ loop)")
    args = p.parse_args(argv)
    if args.tokens < 1 or args.every < 1 or args.stop_ms <= 0:
        p.error("--tokens and --every must be >= 1, --stop-ms > 0")

    from capgraph import GuidedDecodingConfig, GuidedDecodingParams
    from capgraph.decoder import GuidedDecoder
    from capgraph.requests import GuidedRequest

    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[2], vocab_size_padded=64,
                                  host_step_budget_ms=None,
                                  native_build="on" if args.build == "native" else "off")
    guide = GuidedDecodingParams.ebnf(GRAMMAR)
    dec = GuidedDecoder(config, 1, 0)
    try:
        dec.add_batch([GuidedRequest.context(0, 0, guide)])
        if dec.build():
            raise RuntimeError("the context step failed")
        print(f"(a*)*b as grammar rules, fed 'a', {args.build} build: ms per step (accept + fill)")
        print(f"{'step':>5} {'ms':>9}")
        last = 0.0
        step = 0
        for step in range(1, args.tokens + 1):
            dec.add_batch([GuidedRequest.generation(0, 0, guide, new_token=0)])
            t0 = time.perf_counter()
            failed = dec.build()
            last = (time.perf_counter() - t0) * 1e3
            if failed:
                raise RuntimeError(f"step {step} failed: {failed}")
            if step == 1 or step % args.every == 0 or last > args.stop_ms:
                print(f"{step:>5} {last:>9.3f}", flush=True)
            if last > args.stop_ms:
                break
        if step % args.every and last <= args.stop_ms and step != 1:
            print(f"{step:>5} {last:>9.3f}")
    finally:
        dec.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
