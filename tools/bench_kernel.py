"""Benchmark capgraph's CUDA logits_bitmask kernel on a GPU.

For each batch B (V = 128000 by default) and bitmask pattern, times one masking of logits [B, V]
and reports:

* time per call of each of the kernel's mixed-group variants (``rmw``, ``ahead`` and
  ``store``: capgraph/ops/cuda.py, csrc/logits_bitmask.cu), launched on the same inputs
  and timed in turn within each repetition (median of CUDA-event timings, L2 flushed before
  each call); a variant with no entry point at the launch's columns per thread (16: large
  batches) is not timed, the JSON says which entry point each one launched;
* achieved bandwidth counting the bytes the memory system must move, whatever the kernel: per
  32-byte sector of logits (DRAM's unit of transfer on this hardware), nothing if every token
  in it is allowed, 32 bytes written if every one is masked, 32 read and 32 written if mixed;
  plus the bitmask words read. The same count serves every kernel compared;
* the bandwidth of a device-to-device copy of the same number of bytes, measured in the same
  run, as the ceiling to compare with;
* xgrammar's CUDA and Triton kernels (``xgrammar.apply_token_bitmask_inplace(...,
  backend="cuda" | "triton")``) on the same inputs, after checking they give our result;
* the fastest of our variants over the fastest xgrammar kernel, and which variant that was;
  which variant the library runs by default at that launch (``default_variant``: ``auto``,
  :data:`capgraph.ops.cuda.AUTO_VARIANTS`).

Every variant is first checked bit for bit against the pure-torch kernel on the same inputs.
With ``--token-mask`` our kernels also get a token mask of ones (every row active), as
capgraph's decoder always passes one; xgrammar's kernels take none, so that comparison is then
not like for like.

Patterns: ``random`` (every bit a coin flip: nearly every group mixed, the worst case),
``sparse`` (2% of tokens allowed: mostly all-masked groups, as at JSON structure positions),
``dense`` (98% allowed: mostly untouched groups, as inside JSON strings).

    python tools/bench_kernel.py [--batches 1,4,16,64,256,1024,4096] [--vocab 128000]
                                 [--dtypes bf16,fp32] [--patterns random,sparse,dense]
                                 [--variants rmw,ahead,store] [--token-mask] [--repeat 30]
                                 [--no-xgrammar-cuda] [--json PATH]

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


def _time(fn, flush: torch.Tensor, repeat: int, warm: bool = True) -> float:
    """Median seconds of ``fn`` (CUDA events around it alone), L2 flushed before each call;
    one untimed call first unless ``warm`` is False."""
    if warm:
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


def _time_in_turn(fns: dict, flush: torch.Tensor, repeat: int) -> dict:
    """Median seconds of each of ``fns`` (name -> callable), each repetition timing every one
    once in a rotating order, so that a slow spell of the machine is shared, not one's alone."""
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    names = list(fns)
    samples: dict = {name: [] for name in names}
    for i in range(repeat):
        for name in names[i % len(names):] + names[:i % len(names)]:
            samples[name].append(_time(fns[name], flush, 1, warm=False))
    return {name: statistics.median(values) for name, values in samples.items()}


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


VARIANTS = ("rmw", "ahead", "store")


def _us(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e6:.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,4,16,64,256,1024,4096")
    parser.add_argument("--vocab", type=int, default=128000)
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--patterns", default="random,sparse,dense")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--token-mask", action="store_true",
                        help="pass our kernels a token mask of ones, as the decoder does")
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--no-xgrammar-cuda", action="store_true")
    parser.add_argument("--json", default=None, help="write results here (updated per row)")
    args = parser.parse_args(argv)
    variants = args.variants.split(",")
    if "rmw" not in variants or not set(variants) <= set(VARIANTS):
        parser.error(f"--variants: a comma-separated subset of {','.join(VARIANTS)} that "
                     f"includes rmw (the reference of the others), not {args.variants!r}")

    if not torch.cuda.is_available():
        print("bench_kernel: no CUDA device (torch.cuda.is_available() is False); nothing to "
              "measure")
        return 0
    from capgraph.ops.cuda import load_kernel, unavailable_reason

    kernel = load_kernel()
    if kernel is None:
        print(f"bench_kernel: the CUDA kernel is unavailable: {unavailable_reason()}")
        return 1

    vocab = args.vocab
    batches = [int(b) for b in args.batches.split(",")]
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")  # > L2 (60 MB on H200)
    gen = torch.Generator(device="cuda").manual_seed(0)
    xgr = _xgrammar_methods(not args.no_xgrammar_cuda)
    sm_count = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "vocab": vocab, "sm_count": sm_count, "variants": variants,
              "token_mask": args.token_mask,
              "date": dt.datetime.now().isoformat(timespec="seconds"),
              "unavailable": {k: v for k, v in xgr.items() if isinstance(v, str)}, "rows": []}
    header = (f"{'dtype':5} {'pattern':7} {'B':>5} {'rmw us':>8} {'ahead us':>8} "
              f"{'store us':>8} {'GB/s':>6} {'copy GB/s':>9} {'%copy':>6} {'xgr_cuda us':>11} "
              f"{'xgr_triton us':>13} {'best/xgr':>8} fastest")
    print(f"device: {result['device']}, V = {vocab}; GB/s and %copy: rmw")
    if args.token_mask:
        print("our kernels get a token mask of ones; xgrammar's take none")
    for name, reason in result["unavailable"].items():
        print(f"{name}: {reason}")
    print(header)
    for dtype_name in args.dtypes.split(","):
        dtype = _DTYPES[dtype_name]
        for pattern in args.patterns.split(","):
            for batch in batches:
                row = _bench_one(batch, vocab, dtype, _DENSITY[pattern], gen, flush, xgr,
                                 args.repeat, kernel, variants, sm_count, args.token_mask)
                row.update(dtype=dtype_name, pattern=pattern, batch=batch)
                result["rows"].append(row)
                pct = (f"{100 * row['rmw_GBps'] / row['copy_GBps']:6.1f}"
                       if row.get("rmw_GBps") else f"{'-':>6}")
                ratio = row.get("best_vs_xgrammar")
                print(f"{dtype_name:5} {pattern:7} {batch:5d} {_us(row.get('rmw_s')):>8} "
                      f"{_us(row.get('ahead_s')):>8} {_us(row.get('store_s')):>8} "
                      f"{row.get('rmw_GBps') or 0:6.0f} {row['copy_GBps']:9.0f} {pct} "
                      f"{_us(row.get('xgr_cuda_s')):>11} {_us(row.get('xgr_triton_s')):>13} "
                      f"{'-' if ratio is None else f'{ratio:.2f}':>8} "
                      f"{row.get('fastest') or '-'}", flush=True)
                if args.json:
                    with open(args.json, "w") as f:
                        json.dump(result, f, indent=1)
    return 0


def _bench_one(batch, vocab, dtype, density, gen, flush, xgr, repeat, kernel, variants,
               sm_count, use_token_mask=False) -> dict:
    from capgraph.ops.cuda import plan_launch
    from capgraph.ops.torch_impl import apply_logits_bitmask_torch_

    original = torch.randn(batch, vocab, generator=gen, device="cuda").to(dtype)
    bitmask = _bitmask(batch, vocab, density, gen)
    token_mask = (torch.ones(batch, dtype=torch.int32, device="cuda") if use_token_mask
                  else None)
    expected = original.clone()
    apply_logits_bitmask_torch_(expected, bitmask, None, None, 0)
    row: dict = {}
    moved = _bytes_moved(bitmask, vocab, original.element_size())
    row["bytes_moved"] = moved
    timed = {}
    for variant in variants:
        entry = plan_launch(original, bitmask, token_mask, None, 0, sm_count,
                            variant=variant).kernel
        row[f"{variant}_kernel"] = entry
        if variant != "rmw" and entry == row["rmw_kernel"]:
            row[f"{variant}_s"] = None  # no entry point of its own at this launch's width
            continue
        ours = original.clone()
        kernel(ours, bitmask, token_mask, None, 0, variant=variant)
        if not torch.equal(_bits(ours), _bits(expected)):
            row[f"{variant}_error"] = "result differs from the pure-torch kernel's"
            print(f"  {variant}: {row[f'{variant}_error']}", file=sys.stderr)
            continue
        timed[variant] = (lambda v, t: lambda: kernel(t, bitmask, token_mask, None, 0,
                                                      variant=v))(variant, ours)
    auto = plan_launch(original, bitmask, token_mask, None, 0, sm_count, variant="auto").kernel
    row["default_variant"] = next((v for v in variants if row[f"{v}_kernel"] == auto), None)
    for variant, seconds in _time_in_turn(timed, flush, repeat).items():
        row[f"{variant}_s"] = seconds
        row[f"{variant}_GBps"] = moved / seconds / 1e9
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
    ours_s = {v: row[f"{v}_s"] for v in variants if row.get(f"{v}_s")}
    theirs_s = [row[k] for k in ("xgr_cuda_s", "xgr_triton_s") if row.get(k)]
    if ours_s:
        row["fastest"] = min(ours_s, key=ours_s.__getitem__)
        if theirs_s:
            row["best_vs_xgrammar"] = ours_s[row["fastest"]] / min(theirs_s)
    return row


if __name__ == "__main__":
    sys.exit(main())
