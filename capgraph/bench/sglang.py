"""SGLang's per-step vocab mask: SGLang's own xgrammar backend next to capgraph's backend.

Both backends serve the same JSON-schema requests (:data:`capgraph.bench.build.SCHEMA`, each
request teacher-forced through its own valid instance) with the same tokenizer. A step is what
SGLang's ``SamplingBatchInfo.update_regex_vocab_mask`` does on the host: ``allocate_vocab_mask``
for the batch, then ``fill_vocab_mask_batched`` over every request's row (SGLang's xgrammar
backend fills row by row through the base class; capgraph's fills a ring mask in one call of
its C++ build); the allocation and the fill are timed apart, as is advancing every grammar by
its next token (``accept``). SGLang's allocation is a ``torch.full`` of the whole mask, which
runs on torch's intra-op threads (``--threads`` sets their number); capgraph's resets a reused
buffer with NumPy. The
sides alternate step by step, so a change of machine load hits both, and the figures are
medians over steps; capgraph / SGLang < 1 means capgraph is faster. The first step's masks are
checked equal (less the special tokens capgraph never allows) before anything is timed.

Needs SGLang importable (``pip install --no-deps -r ci/sglang-requirements.txt``); it is not
part of ``capgraph bench all``.
"""

from __future__ import annotations

import argparse
import json
import time

from .common import Column, median, pick, print_table

HELP = "SGLang's per-step mask fill: its xgrammar backend vs capgraph's backend (needs SGLang)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 32 128)")
    p.add_argument("--tokenizer", help="bundled tokenizer (default tekken)")
    p.add_argument("--steps", type=int, help="timed steps per batch size (default 40)")
    p.add_argument("--threads", type=int, help="torch intra-op threads (default: torch's)")


def _import_sglang():
    try:
        from sglang.srt.constrained.base_grammar_backend import GrammarRow, InvalidGrammarObject
        from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
    except ImportError as e:
        raise SystemExit(f"capgraph bench sglang needs SGLang's grammar modules ({e}); install "
                         "them with: pip install --no-deps -r ci/sglang-requirements.txt") from None
    return GrammarRow, InvalidGrammarObject, XGrammarGrammarBackend


def run(args: argparse.Namespace) -> dict:
    GrammarRow, InvalidGrammarObject, XGrammarGrammarBackend = _import_sglang()
    from capgraph.integrations.sglang import CapgraphGrammarBackend
    from capgraph.tokenizers import load_tokenizer

    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    q = args.quick
    batches = pick(args.batches, q, [1, 4], [1, 32, 128])
    name = pick(args.tokenizer, q, "tekken", "tekken")
    steps = pick(args.steps, q, 5, 40)
    tok = load_tokenizer(name)
    V, eos = len(tok), tok.eos_token_id
    sglang_backend = XGrammarGrammarBackend(tok, vocab_size=V, model_eos_token_ids=[eos])
    capgraph_backend = CapgraphGrammarBackend(tok, V, [eos])
    rows = []
    try:
        for batch in batches:
            row = measure(tok, name, sglang_backend, capgraph_backend, batch, steps)
            rows.append(row)
            print(f"  {name} V={V} batch={batch}: allocate+fill sglang "
                  f"{row['sglang_step_ms']:.3f} ms, capgraph {row['capgraph_step_ms']:.3f} ms "
                  f"(ratio {row['step_ratio']:.2f}); fill alone ratio {row['fill_ratio']:.2f}; "
                  f"accept ratio {row['accept_ratio']:.2f}", flush=True)
    finally:
        capgraph_backend.close()
    print_table(COLUMNS, rows)
    return {"rows": rows, "native_fill": capgraph_backend.masks.native,
            "torch_threads": torch.get_num_threads(),
            "method": "median over steps of host time per step; step = allocate_vocab_mask + "
                      "fill_vocab_mask_batched over every request (SGLang's "
                      "update_regex_vocab_mask without the device copy), alloc and fill its "
                      "two parts; accept = accept_token of every request; sides alternate "
                      "step by step"}


COLUMNS = [Column("tokenizer", "tokenizer"), Column("batch", "batch"),
           Column("sglang_alloc_ms", "sglang alloc ms", ".4f"),
           Column("sglang_fill_ms", "sglang fill ms", ".4f"),
           Column("capgraph_alloc_ms", "capgraph alloc ms", ".4f"),
           Column("capgraph_fill_ms", "capgraph fill ms", ".4f"),
           Column("fill_ratio", "fill capgraph/sglang", ".2f"),
           Column("step_ratio", "alloc+fill capgraph/sglang", ".2f"),
           Column("accept_ratio", "accept capgraph/sglang", ".2f")]


def _keep_bits(tok, words: int):
    """[words] int32: every bit but the non-stop special tokens (capgraph masks them)."""
    import torch

    from capgraph.tokenizers import special_token_ids

    keep = torch.full((words,), -1, dtype=torch.int64)
    for t in special_token_ids(tok) - {tok.eos_token_id}:
        keep[t // 32] &= ~(1 << (t % 32))
    return keep.to(torch.int32)


def measure(tok, name: str, sglang_backend, capgraph_backend, batch: int, steps: int) -> dict:
    """One batch size: ``batch`` requests on each backend, ``steps`` alternated steps."""
    import torch

    GrammarRow, InvalidGrammarObject, _ = _import_sglang()

    from capgraph.tokenizers import encode_continuation

    from .build import SCHEMA, instance

    key = ("json", json.dumps(SCHEMA))
    texts = [encode_continuation(tok, instance(i)) for i in range(batch)]
    steps = max(1, min(steps, min(len(t) for t in texts) - 1))
    V = len(tok)
    sides = {}
    for side, backend in (("sglang", sglang_backend), ("capgraph", capgraph_backend)):
        compiled = backend._init_value_dispatch(key, False)
        if isinstance(compiled, InvalidGrammarObject):
            raise RuntimeError(f"{side} could not compile the schema: {compiled!r}")
        sides[side] = [compiled.copy() for _ in range(batch)]

    def fill(grammars):
        t0 = time.perf_counter()
        mask = grammars[0].allocate_vocab_mask(vocab_size=V, batch_size=batch, device="cpu")
        t1 = time.perf_counter()
        grammars[0].fill_vocab_mask_batched(
            [GrammarRow(row=i, grammar=g) for i, g in enumerate(grammars)], mask)
        return t1 - t0, time.perf_counter() - t1, mask

    def accept(grammars, s):
        t0 = time.perf_counter()
        for g, t in zip(grammars, texts):
            g.accept_token(t[s])
        return time.perf_counter() - t0

    theirs = fill(sides["sglang"])[2]
    ours = fill(sides["capgraph"])[2]
    if not torch.equal(ours, theirs & _keep_bits(tok, ours.shape[1])):
        raise RuntimeError(f"batch {batch}: capgraph's first mask differs from SGLang's")
    times: dict[str, list[float]] = {f"{s}_{w}": [] for s in sides
                                     for w in ("alloc", "fill", "step", "accept")}
    order = list(sides)
    for s in range(steps):
        for side in (order if s % 2 == 0 else order[::-1]):
            times[f"{side}_accept"].append(accept(sides[side], s))
            alloc_s, fill_s, _ = fill(sides[side])
            times[f"{side}_alloc"].append(alloc_s)
            times[f"{side}_fill"].append(fill_s)
            times[f"{side}_step"].append(alloc_s + fill_s)
    ms = {k: median(v) * 1e3 for k, v in times.items()}
    return {"tokenizer": name, "vocab": V, "batch": batch, "steps": steps,
            "sglang_alloc_ms": ms["sglang_alloc"], "capgraph_alloc_ms": ms["capgraph_alloc"],
            "sglang_fill_ms": ms["sglang_fill"], "capgraph_fill_ms": ms["capgraph_fill"],
            "fill_ratio": ms["capgraph_fill"] / ms["sglang_fill"],
            "sglang_step_ms": ms["sglang_step"], "capgraph_step_ms": ms["capgraph_step"],
            "step_ratio": ms["capgraph_step"] / ms["sglang_step"],
            "sglang_accept_ms": ms["sglang_accept"],
            "capgraph_accept_ms": ms["capgraph_accept"],
            "accept_ratio": ms["capgraph_accept"] / ms["sglang_accept"],
            **{f"{k}_steps_ms": [round(x * 1e3, 4) for x in v] for k, v in times.items()}}
