"""Masking logits: capgraph's logits_bitmask next to xgrammar's applies, on the same inputs.

For each dtype and batch B: logits ``[B, V]`` (randn), a random bitmask (every bit a coin flip,
the worst case for per-element branches) and a token mask with every even row on (B = 1: its
one row; larger B: half the rows); xgrammar gets the active rows as ``indices``, and so does
capgraph's ``capgraph_indices`` case (the op's ``indices`` argument, a device tensor, with the
compact bitmask of those rows, gathered before timing). Every method's
result is checked bit for bit against capgraph's before timing. Each timed call starts from a
fresh copy of the logits (the copy is not timed) and the methods take turns within each
repetition, so a change of machine load hits all of them alike. Figures are medians per call.

On CPU the baselines are xgrammar's C++ apply (``backend="cpu"``) and its torch-native one. On
a CUDA device (``torch.cuda.is_available()``) the same cases also run there: capgraph's op next
to xgrammar's ``cuda`` and ``triton`` kernels, timed with CUDA events, with a device-to-device
copy of the logits as the bandwidth floor.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

from .common import Column, pick, print_table

HELP = "logits_bitmask on [B, V] logits vs xgrammar's CPU (and CUDA/Triton) applies"

_DTYPES = ("fp32", "fp16", "bf16")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8 64 512)")
    p.add_argument("--vocab", type=int, help="vocabulary width V (default 131072)")
    p.add_argument("--dtypes", nargs="+", choices=_DTYPES, help="default fp32 bf16")
    p.add_argument("--repeat", type=int, help="timed calls per method (default 20)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA section")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU section")
    p.add_argument("--no-xgrammar-cuda", action="store_true",
                   help="leave out xgrammar's CUDA kernel (its first use builds a torch "
                        "extension with nvcc, which can take a minute)")


def _torch_dtype(name: str):
    import torch
    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def _bits(t):
    import torch
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def _xgrammar_backend(backend: str) -> Callable:
    """xgrammar's ``apply_token_bitmask_inplace`` with one backend, in the methods' signature."""
    import xgrammar as xgr

    def apply(logits, bitmask, token_mask, indices, vocab):
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=vocab, indices=indices,
                                        backend=backend)
    return apply


def cpu_methods() -> dict[str, Callable]:
    """name -> fn(logits, bitmask, token_mask, indices, vocab) masking in place."""
    from capgraph.ops import logits_bitmask

    from capgraph.ops.torch_impl import apply_logits_bitmask_torch_

    def ours(logits, bitmask, token_mask, indices, vocab):
        logits_bitmask(logits, bitmask, token_mask)

    def ours_torch(logits, bitmask, token_mask, indices, vocab):  # the no-compiler fallback
        apply_logits_bitmask_torch_(logits, bitmask, token_mask, None, 0)

    return {"capgraph": ours, "capgraph_torch": ours_torch, "xgr_cpu": _xgrammar_backend("cpu"),
            "xgr_torch_native": _xgrammar_backend("torch_native")}


def _indices_method(bitmask, indices: list[int]) -> Callable:
    """capgraph's op with ``indices``: the active rows as a tensor on the bitmask's device and
    their compact bitmask, both made here, outside the timed call."""
    import torch

    from capgraph.ops import logits_bitmask
    rows = torch.tensor(indices, dtype=torch.int64).to(bitmask.device)
    compact = bitmask[rows]

    def ours_indices(logits, bitmask, token_mask, indices, vocab):
        logits_bitmask(logits, compact, indices=rows)
    return ours_indices


def cuda_methods(xgrammar_cuda: bool = True) -> dict[str, Callable]:
    """The CUDA set: capgraph, xgrammar's cuda and triton kernels, and the copy floor."""
    methods = cpu_methods()
    del methods["xgr_cpu"]
    if xgrammar_cuda:
        methods["xgr_cuda"] = _xgrammar_backend("cuda")
    methods["xgr_triton"] = _xgrammar_backend("triton")
    return methods


def _inputs(batch: int, vocab: int, dtype_name: str, device: str, gen):
    import torch
    original = torch.randn(batch, vocab, generator=gen).to(_torch_dtype(dtype_name))
    bitmask = torch.randint(-2**31, 2**31 - 1, (batch, -(-vocab // 32)), generator=gen,
                            dtype=torch.int32)
    token_mask = (torch.arange(batch) % 2 == 0).to(torch.int32)
    indices = token_mask.nonzero().flatten().tolist()
    return (original.to(device), bitmask.to(device), token_mask.to(device), indices)


def _check(methods: dict, original, args, reference: str = "capgraph") -> dict[str, str]:
    """Run every method once (warm-up, JIT builds); drop and report those that fail or
    disagree with capgraph bit for bit."""
    import torch
    outputs, errors = {}, {}
    for name, fn in list(methods.items()):
        out = original.clone()
        try:
            fn(out, *args)
        except Exception as e:  # a baseline that cannot run here is reported, not fatal
            if name == reference:
                raise
            errors[name] = f"{type(e).__name__}: {str(e).strip()[:200]}"
            del methods[name]
            continue
        outputs[name] = out
    for name, out in outputs.items():
        if not torch.equal(_bits(out), _bits(outputs[reference])):
            errors[name] = "result differs from capgraph's"
            del methods[name]
    return errors


def _time_cpu(methods: dict, original, work, args, repeat: int) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeat):
        for name, fn in methods.items():
            work.copy_(original)
            t0 = time.perf_counter()
            fn(work, *args)
            samples[name].append(time.perf_counter() - t0)
    return samples


def _time_cuda(methods: dict, original, work, args, repeat: int) -> dict[str, list[float]]:
    import torch
    floor = torch.empty_like(original)
    everything = dict(methods)
    everything["d2d_copy_floor"] = lambda logits, *rest: floor.copy_(logits)
    samples: dict[str, list[float]] = {name: [] for name in everything}
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeat):
        for name, fn in everything.items():
            work.copy_(original)
            start.record()
            fn(work, *args)
            end.record()
            end.synchronize()
            samples[name].append(start.elapsed_time(end) * 1e-3)
    return samples


def _summarize(row: dict, samples: dict[str, list[float]]) -> None:
    for name, xs in samples.items():
        row[name] = {"median_ms": statistics.median(xs) * 1e3, "min_ms": min(xs) * 1e3,
                     "max_ms": max(xs) * 1e3}
    best_name = min((n for n in samples if n.startswith("xgr_")),
                    key=lambda n: row[n]["median_ms"], default=None)
    row["best_xgrammar"] = best_name
    if best_name is not None:
        row["ratio_vs_best_xgrammar"] = row["capgraph"]["median_ms"] / row[best_name]["median_ms"]
    if "d2d_copy_floor" in samples:
        row["ratio_vs_copy_floor"] = (row["capgraph"]["median_ms"]
                                      / row["d2d_copy_floor"]["median_ms"])


def bench(device: str, batches, vocab: int, dtypes, repeat: int,
          xgrammar_cuda: bool = True) -> list[dict]:
    """Every (dtype, batch) case on ``device``; one dict of figures per case."""
    import torch
    gen = torch.Generator().manual_seed(0)
    rows = []
    for dtype_name in dtypes:
        for batch in batches:
            methods = cpu_methods() if device == "cpu" else cuda_methods(xgrammar_cuda)
            original, bitmask, token_mask, indices = _inputs(batch, vocab, dtype_name, device,
                                                             gen)
            methods["capgraph_indices"] = _indices_method(bitmask, indices)
            args = (bitmask, token_mask, indices, vocab)
            errors = _check(methods, original, args)
            work = original.clone()
            timer = _time_cpu if device == "cpu" else _time_cuda
            row = {"device": device, "dtype": dtype_name, "batch": batch, "vocab": vocab,
                   "active_rows": len(indices), "errors": errors}
            _summarize(row, timer(methods, original, work, args, repeat))
            rows.append(row)
            print(f"  {device} {dtype_name} B={batch}: " + ", ".join(
                f"{n} {row[n]['median_ms']:.3f} ms" for n in (*methods, "d2d_copy_floor")
                if n in row) + (f"; skipped {errors}" if errors else ""), flush=True)
            del original, work
    return rows


def _ms(name: str) -> Callable[[dict], float | None]:
    return lambda row: row[name]["median_ms"] if name in row else None


CPU_COLUMNS = [Column("dtype", "dtype"), Column("batch", "B"), Column("active_rows", "active"),
               Column(_ms("capgraph"), "capgraph ms", ".3f"),
               Column(_ms("capgraph_torch"), "capgraph torch ms", ".3f"),
               Column(_ms("capgraph_indices"), "capgraph idx ms", ".3f"),
               Column(_ms("xgr_cpu"), "xgr cpu ms", ".3f"),
               Column(_ms("xgr_torch_native"), "xgr torch ms", ".3f"),
               Column("ratio_vs_best_xgrammar", "capgraph/best", ".2f")]
CUDA_COLUMNS = [Column("dtype", "dtype"), Column("batch", "B"), Column("active_rows", "active"),
                Column(_ms("capgraph"), "capgraph ms", ".4f"),
                Column(_ms("capgraph_indices"), "capgraph idx ms", ".4f"),
                Column(_ms("xgr_cuda"), "xgr cuda ms", ".4f"),
                Column(_ms("xgr_triton"), "xgr triton ms", ".4f"),
                Column(_ms("xgr_torch_native"), "xgr torch ms", ".4f"),
                Column(_ms("d2d_copy_floor"), "d2d copy ms", ".4f"),
                Column("ratio_vs_best_xgrammar", "capgraph/best", ".2f"),
                Column("ratio_vs_copy_floor", "capgraph/copy", ".2f")]


def run(args: argparse.Namespace) -> dict:
    import torch

    q = args.quick
    batches = pick(args.batches, q, [1, 8], [1, 8, 64, 512])
    vocab = pick(args.vocab, q, 131072, 131072)
    dtypes = pick(args.dtypes, q, ["fp32", "bf16"], ["fp32", "bf16"])
    repeat = pick(args.repeat, q, 5, 20)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows: list[dict] = []
    if args.no_cpu:
        print("cpu: skipped (--no-cpu)")
    else:
        rows = bench("cpu", batches, vocab, dtypes, repeat)
        print_table(CPU_COLUMNS, rows)
    cuda_rows: list[dict] = []
    if torch.cuda.is_available() and not args.no_cuda:
        cuda_rows = bench("cuda", batches, vocab, dtypes, repeat,
                          xgrammar_cuda=not args.no_xgrammar_cuda)
        print_table(CUDA_COLUMNS, cuda_rows)
    else:
        print("cuda: skipped (" + ("--no-cuda" if args.no_cuda else "no CUDA device") + ")")
    return {"rows": rows, "cuda_rows": cuda_rows, "repeat": repeat,
            "torch_threads": torch.get_num_threads()}
