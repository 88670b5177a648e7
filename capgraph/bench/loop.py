"""Decode steps per second of the reference loop: unguided, eager-guided, capturable-guided.

The loop is built from the reference runtime's parts (``capgraph.runtime``): a
:func:`~capgraph.runtime.tiny_llama` with random weights over the Tekken vocabulary (131072
tokens; by default the size ``generate()`` uses), its :class:`~capgraph.runtime.ModelRunner`
over a slot KV cache, and greedy picking. Each step runs, for B sequences: load the step's
tokens, [``add_batch``], the forward, [mask the logits], the argmax, and the token list back
on the host. The three variants run side by side on the same runner, taking turns within each
step (in rotating order, so load changes hit all three), and feed the same tokens at the same
positions: the valid texts of the build benchmark's JSON schema (teacher forcing), so every
guided step does real grammar work and every variant does exactly the same model work. The
capturable decoder enqueues its host build with ``prepare()`` before the forward, so on the
CPU stand-in it overlaps the forward on a host-stream thread, as in ``generate()``.

The figure is guided / unguided step time (median over steps). Where ``capgraph.runtime`` is
missing, ``--model standin`` runs the same loop on a stand-in step (embedding + matmul to V).
``--device cuda`` runs the same loop on a GPU, eagerly (no graph capture; the capturable
decoder's host work then runs as CUDA host callbacks on its side stream).
"""

from __future__ import annotations

import argparse
import json
import time

from .common import Column, median, pick, print_table

HELP = "decode steps/s of the reference loop: unguided vs eager vs capturable decoder"

VARIANTS = ("unguided", "eager", "capturable")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8 32)")
    p.add_argument("--steps", type=int, help="timed steps per batch size (default 60)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--tokenizer", help="bundled tokenizer (default tekken)")
    p.add_argument("--hidden", type=int, default=64, help="model width (generate()'s: 64)")
    p.add_argument("--layers", type=int, default=2, help="model layers (generate()'s: 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: the same loop, eager "
                   "(no graph capture), the capturable decoder's build on CUDA host callbacks")
    p.add_argument("--model", choices=("runtime", "standin"),
                   help="runtime (capgraph.runtime's tiny Llama, default when importable) or a "
                        "stand-in step (embedding + matmul)")


class RuntimeModel:
    """capgraph.runtime's tiny Llama behind its ModelRunner (batch of 1-token steps)."""

    name = "runtime"

    def __init__(self, vocab: int, batch: int, max_seq_len: int, hidden: int, layers: int,
                 prompt: list[int], device: str) -> None:
        from capgraph.runtime import ModelRunner, tiny_llama
        heads = max(1, hidden // 16)
        self.model = tiny_llama(vocab, hidden=hidden, layers=layers, heads=heads, device=device)
        self.runner = ModelRunner(self.model, batch, max_seq_len, 1)
        for slot in range(batch):
            self.runner.prefill(slot, prompt)
        self.start = len(prompt)

    def load(self, tokens: list[int], step: int) -> None:
        n = len(tokens)
        self.runner.load_step(list(range(n)), [[t] for t in tokens], [self.start + step] * n)

    def forward(self, batch: int):
        return self.runner.forward_step(batch)


class StandInModel:
    """A stand-in decode step: logits = embedding(tokens) @ W, ``[B, V]`` fp32."""

    name = "standin"

    def __init__(self, vocab: int, batch: int, max_seq_len: int, hidden: int, layers: int,
                 prompt: list[int], device: str) -> None:
        import torch
        gen = torch.Generator().manual_seed(0)
        self.embedding = torch.randn(vocab, hidden, generator=gen).to(device)
        self.head = (torch.randn(hidden, vocab, generator=gen) / hidden ** 0.5).to(device)
        self.tokens = torch.zeros(batch, dtype=torch.long, device=device)

    def load(self, tokens: list[int], step: int) -> None:
        import torch
        self.tokens[:len(tokens)].copy_(torch.tensor(tokens))

    def forward(self, batch: int):
        # tokens: [B] -> hidden: [B, H] -> logits: [B, V]
        return self.embedding[self.tokens[:batch]] @ self.head


def _runtime_available() -> bool:
    try:
        import capgraph.runtime  # noqa: F401
    except ImportError:
        return False
    return True


def run(args: argparse.Namespace) -> dict:
    import torch

    q = args.quick
    batches = pick(args.batches, q, [1, 8], [1, 8, 32])
    steps = pick(args.steps, q, 8, 60)
    tokenizer = pick(args.tokenizer, q, "tekken", "tekken")
    model_kind = args.model or ("runtime" if _runtime_available() else "standin")
    rows = []
    with torch.no_grad():
        for batch in batches:
            row = measure(tokenizer, batch, steps, args.warmup, model_kind, args.hidden,
                          args.layers, args.device)
            rows.append(row)
            print(f"  batch {batch}: " + ", ".join(
                f"{v} {row[v + '_ms']:.2f} ms" for v in VARIANTS), flush=True)
    print_table(COLUMNS, rows)
    if args.device == "cuda":
        print("(cuda: 'eager build/apply ms' are host times; the apply column is the kernel "
              "launch, its GPU time is in the step time)")
    return {"rows": rows, "model": model_kind, "hidden": args.hidden, "layers": args.layers,
            "device": args.device,
            "method": "median step time over steps; variants alternate within each step; "
                      "teacher-forced valid JSON texts; guided = add_batch + forward + mask + "
                      "argmax (+ prepare before the forward for the capturable decoder)"}


COLUMNS = [Column("batch", "batch"), Column("vocab", "V"),
           Column("unguided_ms", "unguided ms", ".2f"),
           Column("eager_ms", "eager ms", ".2f"),
           Column("capturable_ms", "capturable ms", ".2f"),
           Column("unguided_steps_per_s", "unguided steps/s", ".1f"),
           Column("capturable_steps_per_s", "capturable steps/s", ".1f"),
           Column("eager_build_ms", "eager build ms", ".2f"),
           Column("eager_apply_ms", "eager apply ms", ".2f"),
           Column("eager_ratio", "eager/unguided", ".3f"),
           Column("capturable_ratio", "capturable/unguided", ".3f")]


def measure(tokenizer: str, batch: int, steps: int, warmup: int, model_kind: str,
            hidden: int, layers: int, device: str = "cpu") -> dict:
    from capgraph import GuidedDecodingConfig, GuidedDecodingParams
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    from capgraph.grammar import create_matcher_factory
    from capgraph.requests import GuidedRequest
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    from .build import SCHEMA, instance

    tok = load_tokenizer(tokenizer)
    config = GuidedDecodingConfig.from_tokenizer(tok)
    V = config.vocab_size_padded
    factory = create_matcher_factory(config)
    params = GuidedDecodingParams.json_schema(json.dumps(SCHEMA))
    texts = [encode_continuation(tok, instance(i)) for i in range(batch)]
    steps = max(1, min(steps, min(len(t) for t in texts) - warmup))
    prompt = tok.encode("Book a room for the team:", add_special_tokens=False)
    model_cls = RuntimeModel if model_kind == "runtime" else StandInModel
    model = model_cls(V, batch, len(prompt) + warmup + steps + 2, hidden, layers, prompt,
                      device)
    decoders = {"eager": GuidedDecoder(config, batch, 0, device=device, factory=factory),
                "capturable": CapturableGuidedDecoder(config, batch, 0, device=device,
                                                      factory=factory)}
    stages = _time_stages(decoders["eager"])  # where the eager decoder's time goes

    # the context step: every decoder creates its matchers and masks the first logits
    model.load([t[0] for t in texts], 0)
    first = model.forward(batch)
    for name, dec in decoders.items():
        dec.add_batch([GuidedRequest.context(i, i, params) for i in range(batch)])
        failed = dec.execute(first.clone())
        failed = failed if name == "eager" else dec.take_failed_requests()
        if failed:
            raise RuntimeError(f"{name} context step failed: {failed}")

    def step(variant: str, s: int) -> float:
        tokens = [t[s] for t in texts]
        t0 = time.perf_counter()
        model.load(tokens, s)
        dec = decoders.get(variant)
        if dec is not None:
            dec.add_batch([GuidedRequest.generation(i, i, params, t)
                           for i, t in enumerate(tokens)])
            if isinstance(dec, CapturableGuidedDecoder):
                dec.prepare()  # the host build overlaps the forward (host-stream thread)
        logits = model.forward(batch)
        failed = dec.execute(logits) if dec is not None else None
        picks = logits.argmax(dim=-1).tolist()  # greedy, as the runtime's sampler
        if variant == "capturable":
            failed = dec.take_failed_requests()  # type: ignore[union-attr]
        elapsed = time.perf_counter() - t0
        if failed:
            raise RuntimeError(f"{variant} step {s} failed: {failed}")
        if len(picks) != batch:
            raise RuntimeError(f"{variant}: {len(picks)} tokens for {batch} sequences")
        return elapsed

    samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
    try:
        for s in range(warmup + steps):
            order = VARIANTS[s % 3:] + VARIANTS[:s % 3]
            for variant in order:
                elapsed = step(variant, s)
                if s >= warmup:
                    samples[variant].append(elapsed)
    finally:
        for dec in decoders.values():
            dec.close()
    row: dict = {"batch": batch, "vocab": V, "tokenizer": tokenizer, "steps": steps,
                 "model": model.name, "hidden": hidden, "layers": layers, "device": device}
    for v in VARIANTS:
        m = median(samples[v])
        row[f"{v}_ms"] = m * 1e3
        row[f"{v}_steps_per_s"] = 1.0 / m
        row[f"{v}_mean_ms"] = sum(samples[v]) / len(samples[v]) * 1e3
        row[f"{v}_samples_ms"] = [round(x * 1e3, 4) for x in samples[v]]
    for v in ("eager", "capturable"):
        row[f"{v}_ratio"] = row[f"{v}_ms"] / row["unguided_ms"]
    for stage, times in stages.items():
        row[f"eager_{stage}_ms"] = median(times[-steps:]) * 1e3
    return row


def _time_stages(decoder) -> dict[str, list[float]]:
    """Wrap this decoder instance's host build and mask application with timers (about a
    microsecond each); returns the lists they fill, one entry per call. Host time: on CUDA
    the apply is its kernel launch (no synchronisation is added to measure it)."""
    stages: dict[str, list[float]] = {"build": [], "apply": []}
    for name, stage in (("_build", "build"), ("apply_bitmask", "apply")):
        method = getattr(decoder, name)

        def timed(*args, _method=method, _times=stages[stage], **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                _times.append(time.perf_counter() - t0)
        setattr(decoder, name, timed)
    return stages
