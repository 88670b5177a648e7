"""Time capgraph's logits_bitmask against xgrammar's CPU applies on the same inputs.

For each dtype and batch B: logits [B, V] (randn), a random bitmask (every bit a coin flip:
the worst case for per-element branches), a token mask with every even row on (B=1 has its
row on, larger B half their rows). xgrammar gets the active rows as ``indices``. Every
method's result is checked bit for bit against ours before timing. Each timed call starts from
a fresh copy of the logits (the copy is not timed), and the methods take turns within each
repetition so that a change of machine load hits all of them alike. Prints the median per call
and the ratio ours / fastest xgrammar path.

    python tools/bench_apply.py [--batches 1,8,64,512] [--vocab 131072] [--dtypes fp32,bf16]
                                [--repeat 20] [--threads N] [--json PATH]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import json
import os
import platform
import statistics
import sys
import time

import torch

from capgraph.ops import logits_bitmask

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def _methods():
    """name -> callable(logits, bitmask, token_mask, indices, vocab) masking in place."""
    import xgrammar as xgr

    def ours(logits, bitmask, token_mask, indices, vocab):
        logits_bitmask(logits, bitmask, token_mask)

    def xgrammar_backend(backend):
        def apply(logits, bitmask, token_mask, indices, vocab):
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices,
                                            backend=backend)
        return apply

    return {"capgraph": ours, "xgr_cpu": xgrammar_backend("cpu"),
            "xgr_torch_native": xgrammar_backend("torch_native")}


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _time_all(methods, original, work, args, repeat):
    """name -> seconds per call, ``repeat`` samples each, methods interleaved."""
    samples = {name: [] for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            work.copy_(original)
            start = time.perf_counter()
            fn(work, *args)
            samples[name].append(time.perf_counter() - start)
    return samples


def bench(batches, vocab, dtypes, repeat):
    """Run every (dtype, batch) case; returns one dict of figures per case."""
    methods = _methods()
    results = []
    gen = torch.Generator().manual_seed(0)
    for dtype_name in dtypes:
        for batch in batches:
            original = torch.randn(batch, vocab, generator=gen).to(_DTYPES[dtype_name])
            bitmask = torch.randint(-2**31, 2**31 - 1, (batch, -(-vocab // 32)), generator=gen,
                                    dtype=torch.int32)
            token_mask = (torch.arange(batch) % 2 == 0).to(torch.int32)
            indices = token_mask.nonzero().flatten().tolist()
            args = (bitmask, token_mask, indices, vocab)

            outputs = {}
            for name, fn in methods.items():  # warm-up, and the check of every result
                outputs[name] = original.clone()
                fn(outputs[name], *args)
            for name, out in outputs.items():
                if not torch.equal(_bits(out), _bits(outputs["capgraph"])):
                    raise SystemExit(f"{name} disagrees with capgraph at {dtype_name} B={batch}")

            row = {"dtype": dtype_name, "batch": batch, "vocab": vocab,
                   "active_rows": len(indices)}
            work = original.clone()
            for name, samples in _time_all(methods, original, work, args, repeat).items():
                row[name] = {"median_ms": statistics.median(samples) * 1e3,
                             "min_ms": min(samples) * 1e3, "max_ms": max(samples) * 1e3}
            best = min(row[n]["median_ms"] for n in methods if n != "capgraph")
            row["ratio_vs_best_xgrammar"] = row["capgraph"]["median_ms"] / best
            results.append(row)
            _print_row(row)
    return results


def _print_header():
    print(f"{'dtype':>5} {'B':>4} {'active':>6} {'capgraph ms':>12} {'xgr cpu ms':>11} "
          f"{'xgr torch ms':>13} {'ours/best':>9}")


def _print_row(row):
    print(f"{row['dtype']:>5} {row['batch']:>4} {row['active_rows']:>6} "
          f"{row['capgraph']['median_ms']:>12.3f} {row['xgr_cpu']['median_ms']:>11.3f} "
          f"{row['xgr_torch_native']['median_ms']:>13.3f} "
          f"{row['ratio_vs_best_xgrammar']:>9.3f}", flush=True)


def _machine():
    def version(pkg):
        try:
            return md.version(pkg)
        except md.PackageNotFoundError:
            return None
    return {
        "platform": platform.platform(), "processor": platform.processor(),
        "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "load_average_at_start": os.getloadavg(), "python": sys.version.split()[0],
        "torch": torch.__version__, "xgrammar": version("xgrammar"),
        "capgraph": version("capgraph"),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,64,512", help="comma-separated batch sizes")
    parser.add_argument("--vocab", type=int, default=131072)
    parser.add_argument("--dtypes", default="fp32,bf16", help="from fp32, fp16, bf16")
    parser.add_argument("--repeat", type=int, default=20, help="timed calls per method")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--json", default=None, help="write machine, versions and figures here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = _machine()
    print(f"torch {machine['torch']}, xgrammar {machine['xgrammar']}, "
          f"{machine['torch_threads']} threads, load {machine['load_average_at_start']}")
    _print_header()
    results = bench([int(b) for b in args.batches.split(",")], args.vocab,
                    args.dtypes.split(","), args.repeat)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"date": dt.datetime.now(dt.timezone.utc).isoformat(), "machine": machine,
                       "argv": sys.argv[1:], "repeat": args.repeat, "results": results},
                      f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
