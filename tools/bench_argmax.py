#!/usr/bin/env python3
"""GPU: greedy sampling under a token bitmask, fused or not.

Times, on the same logits and bitmask, the three ways a greedy guided step can end:

* ``argmax``: ``torch.argmax`` alone (an unguided greedy step's sampling);
* ``mask+argmax``: ``capgraph.ops.logits_bitmask`` in place, then ``torch.argmax`` (what
  ``CapturableGuidedDecoder.execute`` and a sampler do);
* ``fused``: ``capgraph.ops.masked_argmax`` (``execute_argmax``: one kernel that reads the
  bitmask and the allowed logits only).

Each is captured ``--repeat`` times into one CUDA graph and replayed; the figure is the
replay's time (CUDA events) per call, the median of ``--trials`` replays, in microseconds.
Every row is guided (a token mask of ones, as the decoder passes). Patterns: ``2%`` and
``98%`` of each row's tokens allowed, or ``random`` bits. ``fused/mask+argmax`` is the
fraction of the unfused time the fused call takes; ``fused/argmax`` the guided greedy step's
sampling over the unguided one's. ``--device cpu`` runs the same protocol without graphs,
timed on the host (a check of the tool, not a measurement).

    python tools/bench_argmax.py --batches 1 4 16 64 256 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

PATTERNS = ("2%", "98%", "random")


def _bitmask(torch, rows: int, vocab: int, pattern: str, g):
    """[rows, ceil(vocab / 32)] int32 on g's device: random bits, or each bit allowed with the
    pattern's probability."""
    words = -(-vocab // 32)
    if pattern == "random":
        return torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int32,
                             device=g.device)
    share = float(pattern.rstrip("%")) / 100
    keep = torch.rand(rows, words * 32, generator=g, device=g.device) < share
    weights = torch.tensor([1 << b for b in range(32)], dtype=torch.int64, device=g.device)
    packed = (keep.view(rows, words, 32).long() * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).int()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--vocab", type=int, default=131072)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                    choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--patterns", nargs="+", default=list(PATTERNS), choices=PATTERNS)
    ap.add_argument("--repeat", type=int, default=20, help="calls per captured graph")
    ap.add_argument("--trials", type=int, default=15, help="timed replays per figure")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    if min(args.batches) < 1 or args.vocab < 1 or args.repeat < 1 or args.trials < 1:
        ap.error("--batches, --vocab, --repeat and --trials must be >= 1")
    import torch
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_argmax: no CUDA device, nothing measured")
        return 0
    from capgraph.bench.common import write_json
    from capgraph.ops import argmax_scratch, logits_bitmask, masked_argmax
    from capgraph.ops import cuda as cuda_backend
    device = torch.device(args.device)
    if device.type == "cuda" and cuda_backend.load_kernel() is None:
        print(f"bench_argmax: the CUDA kernel is unavailable: {cuda_backend.unavailable_reason()}")
        return 1

    def timed(call) -> float:
        """us per call: a CUDA graph of --repeat calls replayed --trials times (CPU: calls)."""
        if device.type == "cpu":
            times = []
            for _ in range(args.trials):
                start = time.perf_counter()
                for _ in range(args.repeat):
                    call()
                times.append((time.perf_counter() - start) / args.repeat * 1e6)
            return statistics.median(times)
        call()  # (first launches outside the capture)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            for _ in range(args.repeat):
                call()
        torch.cuda.synchronize()
        graph.replay()
        times = []
        for _ in range(args.trials):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3 / args.repeat)
        del graph
        return statistics.median(times)

    out = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "vocab": args.vocab,
           "repeat": args.repeat, "trials": args.trials, "rows": []}
    print(f"vocab {args.vocab}, {args.device}, us per call (median of {args.trials} replays of "
          f"{args.repeat} calls)")
    print(f"{'dtype':>9}{'pattern':>8}{'batch':>6}{'argmax':>9}{'mask+argmax':>13}{'fused':>8}"
          f"{'fused/mask+argmax':>19}{'fused/argmax':>14}")
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        for pattern in args.patterns:
            for batch in args.batches:
                g = torch.Generator(device=device).manual_seed(batch)
                logits = torch.randn(batch, args.vocab, generator=g, device=device).to(dtype)
                bitmask = _bitmask(torch, batch, args.vocab, pattern, g)
                token_mask = torch.ones(batch, dtype=torch.int32, device=device)
                picks = torch.empty(batch, dtype=torch.int64, device=device)
                scratch = argmax_scratch(batch, device)
                fused_picks = masked_argmax(logits, bitmask, token_mask, out=picks.clone(),
                                            scratch=scratch)
                masked = logits.clone()
                logits_bitmask(masked, bitmask, token_mask)
                if not torch.equal(fused_picks, masked.argmax(-1)):
                    print(f"bench_argmax: the fused argmax disagrees with mask+argmax "
                          f"({dtype_name}, {pattern}, batch {batch})")
                    return 1
                row = {"dtype": dtype_name, "pattern": pattern, "batch": batch,
                       "argmax_us": timed(lambda: torch.argmax(logits, -1, out=picks)),
                       "mask_argmax_us": timed(lambda: (
                           logits_bitmask(masked, bitmask, token_mask),
                           torch.argmax(masked, -1, out=picks))),
                       "fused_us": timed(lambda: masked_argmax(
                           logits, bitmask, token_mask, out=picks, scratch=scratch))}
                row["fused_over_unfused"] = row["fused_us"] / row["mask_argmax_us"]
                row["fused_over_argmax"] = row["fused_us"] / row["argmax_us"]
                out["rows"].append(row)
                print(f"{dtype_name:>9}{pattern:>8}{batch:>6}{row['argmax_us']:>9.1f}"
                      f"{row['mask_argmax_us']:>13.1f}{row['fused_us']:>8.1f}"
                      f"{row['fused_over_unfused']:>19.2f}{row['fused_over_argmax']:>14.2f}")
                if args.json:  # (rewritten after each row: a time-boxed run keeps its rows)
                    write_json("bench_argmax", out, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
