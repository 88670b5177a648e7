#!/usr/bin/env python3
"""The replayed guided step on the native host node next to the Python host callback.

Each batch size decodes the bundled tool-call schema teacher-forced (valid tool calls, every
request restarting with a new context step when its text ends), one replayed graph step per
decode step: ``add_batch``, replay, drain, ``take_failed_requests``. The graph holds the
decoder's step only (static logits, no forward), so the figure is the host side of a replayed
step: on the CPU stand-in the step's host work and its mask apply; on CUDA the host node, the
copy and the mask kernel. Both kinds run in alternating blocks in one process (ratios in one
run), and their masks are checked equal step for step. Columns: ms per replayed step per
kind, native / python, and the native node's own time per step and per guided row (its
``host_node_stats``: wall time inside the node, on the lane or driver thread).

With ``--drafts K`` each generation step also carries the text's next K tokens as drafts, of
which step n's verification accepts ``n % (K + 1)`` (as far as the text goes), and each step
begins as a speculative engine's does: ``add_batch``, ``rollback_rejected_batch(accepted +
1)`` (on the native node its C rollback, counted in the node's time), replay.

With ``--ahead K`` each kind also runs with the host ahead of the stream (as an overlap
scheduler): no sync per step, the next ``add_batch`` made while up to K replays are still
queued (an event per step; the host waits for the one K steps back), every block ending with a
full sync; the extra columns are its ms per step and its time over the synced loop's. On the
CPU stand-in an eager ``rollback_rejected_batch`` syncs, so ``--ahead`` with ``--drafts``
measures little there.

    python tools/bench_host_node.py                    # batches 1 8 32 64, CPU stand-in
    python tools/bench_host_node.py --ahead 2 --batches 8 64
    python tools/bench_host_node.py --drafts 3 --batches 8 32
    python tools/bench_host_node.py --device cuda --batches 8 64 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import deque


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--steps", type=int, default=60, help="timed replayed steps per block")
    ap.add_argument("--blocks", type=int, default=3, help="alternating blocks per kind")
    ap.add_argument("--tokenizer", default="tekken")
    ap.add_argument("--drafts", type=int, default=0, help="drafts per generation step")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--ahead", type=int, default=0,
                    help="also run each kind with up to this many replays queued (0: not)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    if args.ahead < 0:
        ap.error(f"--ahead must be >= 0, got {args.ahead}")

    import torch

    import hostfunc
    from capgraph import ConfigError
    from capgraph.bench.spec import tool_call_workload
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.requests import GuidedRequest

    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench_host_node: no CUDA device; nothing measured")
        return 0
    factory, params, texts = tool_call_workload(args.tokenizer)
    config = factory.config
    eos = config.stop_token_ids[0]
    texts = [text + [eos] for text in texts]
    V = config.vocab_size_padded

    class Run:
        """One decoder of one kind, captured, with its requests' positions."""

        def __init__(self, kind: str, batch: int, ahead: int = 0) -> None:
            K = args.drafts
            self.ahead = ahead  # replays that may be queued when add_batch is called
            self.events: deque = deque()  # one per queued replay, oldest first
            self.decoder = CapturableGuidedDecoder(config, batch, K, device=args.device,
                                                   factory=factory, host_node=kind)
            self.batch = batch
            self.logits = torch.zeros(batch * (K + 1), V, device=args.device)
            self.pos = [-1] * batch  # -1: the next step is the request's context step
            self.accepted = [0] * batch  # drafts the last verification accepted
            self.steps = 0
            self.text = [i % len(texts) for i in range(batch)]
            self.next_id = 0
            self.ids = [0] * batch
            d = self.decoder
            d.add_batch(self.requests())
            if args.device == "cuda":
                with d.warmup():
                    d.execute(self.logits)
                torch.cuda.synchronize()
                self.graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(self.graph):
                    d.execute(self.logits)
            else:
                self.graph = hostfunc.HostGraph()
                with hostfunc.capture(self.graph):
                    d.execute(self.logits)

        def requests(self) -> list:
            out = []
            for i in range(self.batch):
                if self.pos[i] < 0:
                    self.next_id += 1
                    self.ids[i] = self.next_id
                    out.append(GuidedRequest.context(self.ids[i], i, params))
                else:
                    text, at = texts[self.text[i]], self.pos[i]
                    out.append(GuidedRequest.generation(
                        self.ids[i], i, params, text[at],
                        draft_tokens=text[at + 1:at + 1 + args.drafts],
                        num_accepted_draft_tokens=self.accepted[i]))
            return out

        def advance(self) -> None:
            self.steps += 1
            for i in range(self.batch):
                text, at = texts[self.text[i]], self.pos[i]
                drafts = 0 if at < 0 else len(text[at + 1:at + 1 + args.drafts])
                self.accepted[i] = min(self.steps % (args.drafts + 1), drafts)
                self.pos[i] += 1 + self.accepted[i]
                if self.pos[i] >= len(text):
                    self.pos[i] = -1
                    self.accepted[i] = 0
                    self.text[i] = (self.text[i] + 1) % len(texts)

        def step(self) -> None:
            d = self.decoder
            while len(self.events) > self.ahead - 1 and self.events:
                self.events.popleft().synchronize()  # (at most `ahead` replays queued)
            reqs = self.requests()
            d.add_batch(reqs)
            if args.drafts:
                d.rollback_rejected_batch(torch.tensor(
                    [(r.num_accepted_draft_tokens or 0) + 1 for r in reqs], dtype=torch.int32))
            self.graph.replay()  # (the logits keep earlier steps' -inf: the mask is what counts)
            if self.ahead:
                event = torch.cuda.Event() if args.device == "cuda" else hostfunc.HostEvent()
                event.record()
                self.events.append(event)
            else:
                self.finish()
            failed = d.take_failed_requests()
            if failed:
                raise RuntimeError(f"a teacher-forced request failed: {failed[0]}")
            self.advance()

        def finish(self) -> None:
            """Wait for every queued replay (and re-raise a callback's error)."""
            self.events.clear()
            if args.device == "cuda":
                torch.cuda.synchronize()
            hostfunc.drain()

    rows = []
    kinds = [("python", 0), ("native", 0)]
    if args.ahead:
        kinds += [("python", args.ahead), ("native", args.ahead)]
    extra = f" {'py ahead ms':>11} {'nat ahead ms':>12} {'py ahead/sync':>13} " \
            f"{'nat ahead/sync':>14}" if args.ahead else ""
    print(f"{'batch':>5} {'python ms':>10} {'native ms':>10} {'native/python':>13} "
          f"{'node us/step':>12} {'node us/row':>11}" + extra)
    for batch in args.batches:
        try:
            runs = {(kind + (" ahead" if ahead else "")): Run(kind, batch, ahead)
                    for kind, ahead in kinds}
        except ConfigError as e:
            print(f"{batch:>5} native host node unavailable: {e}")
            continue
        times: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(3):  # warm: every kind, untimed
            for run in runs.values():
                run.step()
                run.finish()
        for _block in range(args.blocks):
            for kind, run in runs.items():
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    run.step()
                run.finish()
                times[kind].append((time.perf_counter() - t0) / args.steps * 1e3)
        # the two kinds decoded the same texts in step: their last masks agree
        a, b = runs["python"].decoder, runs["native"].decoder
        for name, run in runs.items():
            if not torch.equal(a.token_mask_host, run.decoder.token_mask_host) or \
                    not torch.equal(a.bitmask_host, run.decoder.bitmask_host):
                raise RuntimeError(f"batch {batch}: the {name} and python steps' masks differ")
        stats = b.host_node_stats
        node_us = stats.busy_ns / max(stats.runs, 1) / 1e3
        row_us = stats.busy_ns / max(stats.rows, 1) / 1e3
        py, nat = statistics.median(times["python"]), statistics.median(times["native"])
        row = {"batch": batch, "python_ms": py, "native_ms": nat, "ratio": nat / py,
               "node_us_per_step": node_us, "node_us_per_row": row_us,
               "node_runs": stats.runs, "node_python_runs": stats.python_runs,
               "node_rollbacks": stats.rollback_runs,
               "node_python_rollbacks": stats.python_rollback_runs, "blocks": times}
        line = f"{batch:>5} {py:>10.4f} {nat:>10.4f} {nat / py:>13.3f} {node_us:>12.1f} " \
               f"{row_us:>11.2f}"
        if args.ahead:
            pya = statistics.median(times["python ahead"])
            nata = statistics.median(times["native ahead"])
            row.update(python_ahead_ms=pya, native_ahead_ms=nata, python_ahead_ratio=pya / py,
                       native_ahead_ratio=nata / nat)
            line += f" {pya:>11.4f} {nata:>12.4f} {pya / py:>13.3f} {nata / nat:>14.3f}"
        rows.append(row)
        print(line)
        for run in runs.values():
            if args.device == "cuda":
                run.graph.reset()
            else:
                run.graph.reset()
            run.decoder.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "tokenizer": args.tokenizer,
                       "drafts": args.drafts, "ahead": args.ahead, "steps": args.steps,
                       "blocks": args.blocks, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
