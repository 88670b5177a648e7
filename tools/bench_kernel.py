"""Benchmark capgraph's CUDA logits_bitmask kernel on a GPU.

For each batch B (V = 128000 by default) and bitmask pattern, times one masking of logits [B, V]
and reports:

* time per call (median of CUDA-event timings, L2 flushed before each call);
* achieved bandwidth counting the bytes the memory system must move, whatever the kernel: per
  32-byte sector of logits (DRAM's unit of transfer on this hardware), nothing if every token
  in it is allowed, 32 bytes written if every one is masked, 32 read and 32 written if mixed;
  plus the bitmask words read. The same count serves every kernel compared;
* the bandwidth of a device-to-device copy of the same number of bytes, measured in the same
  run, as the ceiling to compare with;
* xgrammar's CUDA and Triton kernels (``xgrammar.apply_token_bitmask_inplace(...,
  backend="cuda" | "triton")``) on the same inputs, after checking they give our result.

Patterns: ``random`` (every bit a coin flip: nearly every group mixed, the worst case),
``sparse`` (2% of tokens allowed: mostly all-masked groups, as at JSON structure positions),
``dense`` (98% allowed: mostly untouched groups, as inside JSON strings).

    python tools/bench_kernel.py [--batches 1,4,16,64,256,1024,4096] [--vocab 128000]
                                 [--dtypes bf16,fp32] [--patterns random,sparse,dense]
                                 [--repeat 30] [--no-xgrammar-cuda] [--json PATH]

Without a CUDA device it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import sys
import time

import torch

_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
_DENSITY = {"random": 0.5, "sparse": 0.02, "dense": 0.98}
_INT_OF = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}


def _bitmask(rows: int, vocab: int, density: float, gen: torch.Generator) -> torch.Tensor:
    """[rows, ceil(V/32)] int32 with each token allowed with probability ``density``."""
    words = -(-vocab // 32)
    allowed = torch.rand(rows, words * 32, generator=gen, device="cuda") < density
    weights = (torch.ones(32, dtype=torch.int64, device="cuda") << torch.arange(32, device="cuda"))
    packed = (allowed.view(rows, words, 32).to(torch.int64) * weights).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def _bytes_moved(bitmask: torch.Tensor, vocab: int, element_size: int) -> int:
    """Bytes any masking kernel must move: per 32-byte sector of a logits row, 0 (all allowed),
    32 (all masked: written only) or 64 (mixed: read and written); plus the bitmask read."""
    rows, words = bitmask.shape
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).view(rows, words * 32)[:, :vocab]
    per_sector = 32 // element_size
    full = vocab // per_sector * per_sector
    sectors = allowed[:, :full].reshape(rows, -1, per_sector).sum(-1)
    all_masked = int((sectors == 0).sum())
    mixed = int(((sectors > 0) & (sectors < per_sector)).sum())
    tail = allowed[:, full:]  # a partial last sector: bytes of its masked tokens, read+written
    tail_bytes = 2 * int((tail == 0).sum()) * element_size
    return all_masked * 32 + mixed * 64 + tail_bytes + bitmask.numel() * 4


def _time(fn, flush: torch.Tensor, repeat: int) -> float:
    """Median seconds of ``fn`` (CUDA events around it alone), L2 flushed before each call."""
    fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeat):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3)
    return statistics.median(samples)


def _copy_bandwidth(nbytes: int, flush: torch.Tensor, repeat: int) -> float:
    """Bytes per second of a device-to-device copy that reads and writes ``nbytes`` in all."""
    n = max(nbytes // 2, 4096)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * n / _time(lambda: dst.copy_(src), flush, repeat)


def _xgrammar_methods(use_cuda: bool):
    """name -> callable(logits, bitmask, vocab), or name -> reason string where unavailable."""
    try:
        import xgrammar as xgr
    except ImportError as exc:
        return {"xgr_triton": f"xgrammar not importable: {exc}",
                "xgr_cuda": f"xgrammar not importable: {exc}"}

    def make(backend):
        def apply(logits, bitmask, vocab):
            xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, backend=backend)
        return apply

    methods = {"xgr_triton": make("triton")}
    # xgrammar's CUDA backend JIT-builds a torch extension with nvcc on first use (can take a
    # minute); --no-xgrammar-cuda skips it.
    methods["xgr_cuda"] = make("cuda") if use_cuda else "skipped (--no-xgrammar-cuda)"
    return methods


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_INT_OF[t.dtype])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,16,64,256,1024,4096")
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--patterns", default="random,sparse,dense")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--no-xgrammar-cuda", action="store_true")
    parser.add_argument("--json", default=None, help="write results here (updated per row)")
    args = parser.parse_args(argv)

    if not torch.cuda.is_available():
        print("bench_kernel: no CUDA device (torch.cuda.is_available() is False); nothing to "
              "measure")
        return 0
    from capgraph.ops import logits_bitmask
    from capgraph.ops.cuda import load_kernel, unavailable_reason

    if load_kernel() is None:
        print(f"bench_kernel: the CUDA kernel is unavailable: {unavailable_reason()}")
        return 1

    vocab = args.vocab
    batches = [int(b) for b in args.batches.split(",")]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # > L2 (60 MB on H200)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xgr = _xgrammar_methods(not args.no_xgrammar_cuda)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "vocab": vocab, "date": dt.datetime.now().isoformat(timespec="seconds"),
              "unavailable": {k: v for k, v in xgr.items() if isinstance(v, str)}, "rows": []}
    header = (f"{'dtype':5} {'pattern':7} {'B':>5} {'ours us':>9} {'GB/s':>7} {'copy GB/s':>9} "
              f"{'%copy':>6} {'xgr_cuda us':>11} {'xgr_triton us':>13}")
    print(f"device: {result['device']}, V = {vocab}")
    for name, reason in result["unavailable"].items():
        print(f"{name}: {reason}")
    print(header)
    for dtype_name in args.dtypes.split(","):
        dtype = _DTYPES[dtype_name]
        for pattern in args.patterns.split(","):
            for batch in batches:
                row = _bench_one(batch, vocab, dtype, _DENSITY[pattern], gen, flush, xgr,
                                 args.repeat, logits_bitmask)
                row.update(dtype=dtype_name, pattern=pattern, batch=batch)
                result["rows"].append(row)
                xc, xt = row.get("xgr_cuda_s"), row.get("xgr_triton_s")
                print(f"{dtype_name:5} {pattern:7} {batch:5d} {row['ours_s'] * 1e6:9.1f} "
                      f"{row['ours_GBps']:7.0f} {row['copy_GBps']:9.0f} "
                      f"{100 * row['ours_GBps'] / row['copy_GBps']:6.1f} "
                      f"{'-' if xc is None else f'{xc * 1e6:.1f}':>11} "
                      f"{'-' if xt is None else f'{xt * 1e6:.1f}':>13}", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(result, f, indent=1)
    return 0


def _bench_one(batch, vocab, dtype, density, gen, flush, xgr, repeat, logits_bitmask) -> dict:
    original = torch.randn(batch, vocab, generator=gen, device="cuda").to(dtype)
    bitmask = _bitmask(batch, vocab, density, gen)
    logits = original.clone()
    expected = original.clone()
    logits_bitmask(expected, bitmask)
    row: dict = {}
    moved = _bytes_moved(bitmask, vocab, original.element_size())
    row["ours_s"] = _time(lambda: logits_bitmask(logits, bitmask), flush, repeat)
    row["bytes_moved"] = moved
    row["ours_GBps"] = moved / row["ours_s"] / 1e9
    row["copy_GBps"] = _copy_bandwidth(moved, flush, repeat) / 1e9
    for name, method in xgr.items():
        if isinstance(method, str):
            continue
        try:
            theirs = original.clone()
            t0 = time.perf_counter()
            method(theirs, bitmask, vocab)  # first call may compile
            torch.cuda.synchronize()
            row[f"{name}_first_call_s"] = time.perf_counter() - t0
            if not torch.equal(_bits(theirs), _bits(expected)):
                row[f"{name}_error"] = "result differs from capgraph's"
                continue
            row[f"{name}_s"] = _time(lambda: method(theirs, bitmask, vocab), flush, repeat)
        except Exception as exc:  # report and carry on: one backend failing is a result
            row[f"{name}_error"] = f"{type(exc).__name__}: {exc}"
            print(f"  {name}: {row[f'{name}_error']}", file=sys.stderr)
    return row


if __name__ == "__main__":
    sys.exit(main())
