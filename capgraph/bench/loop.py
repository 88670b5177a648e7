"""Decode steps per second of the reference loop: unguided, eager-guided, capturable-guided.

The loop is built from the reference runtime's parts (``capgraph.runtime``): a
:func:`~capgraph.runtime.tiny_llama` with random weights over the Tekken vocabulary (131072
tokens; by default the size ``generate()`` uses), a :class:`~capgraph.runtime.ModelRunner`
over a slot KV cache per batch size, and greedy picking. Each step runs, for B sequences: load
the step's tokens, [``add_batch``], the forward, [mask the logits], the argmax, and the token
list back on the host. The three variants run side by side on the same runner, taking turns
within each step (in rotating order, so load changes hit all three), and feed the same tokens
at the same positions: the valid texts of the build benchmark's JSON schema (teacher forcing),
so every guided step does real grammar work and every variant does exactly the same model
work. The capturable decoder enqueues its host build with ``prepare()`` before the forward, so
on the CPU stand-in it overlaps the forward on a host-stream thread, as in ``generate()``.

Every case (batch size) is set up and warmed up before the first timed step, so that no case
pays a one-time cost the others do not: the tokenizer, the matcher factory, the guide's
compile and the model weights are built once and shared; each case then builds its runner and
decoders and runs its context step (first forward at its shape, native library and mask kernel
loads, matcher creation); then the steps run in rounds over every case, the first ``--warmup``
of each case untimed, in rotating case order, so slow drifts of the machine hit every case
alike. A batch size listed twice is measured twice, the same way.

The figure is guided / unguided step time (median over steps). Where ``capgraph.runtime`` is
missing, ``--model standin`` runs the same loop on a stand-in step (embedding + matmul to V).
``--device cuda`` runs the same loop on a GPU, eagerly (no graph capture; the capturable
decoder's host work then runs as CUDA host callbacks on its side stream).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from typing import Any

from .common import Column, median, pick, print_table

HELP = "decode steps/s of the reference loop: unguided vs eager vs capturable decoder"

VARIANTS = ("unguided", "eager", "capturable")

#: untimed steps of every case before its first timed step (``--warmup``)
DEFAULT_WARMUP = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+",
                   help="batch sizes (default 1 8 32); one listed twice is measured twice")
    p.add_argument("--steps", type=int, help="timed steps per batch size (default 60)")
    p.add_argument("--warmup", type=int, default=DEFAULT_WARMUP,
                   help=f"untimed steps of every batch size, all run before the first timed "
                        f"step (default {DEFAULT_WARMUP})")
    p.add_argument("--tokenizer", help="bundled tokenizer (default tekken)")
    p.add_argument("--hidden", type=int, default=64, help="model width (generate()'s: 64)")
    p.add_argument("--layers", type=int, default=2, help="model layers (generate()'s: 2)")
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda: the same loop, eager "
                   "(no graph capture), the capturable decoder's build on CUDA host callbacks")
    p.add_argument("--model", choices=("runtime", "standin"),
                   help="runtime (capgraph.runtime's tiny Llama, default when importable) or a "
                        "stand-in step (embedding + matmul)")


class RuntimeModel:
    """capgraph.runtime's tiny Llama: one set of weights, one ModelRunner per batch size."""

    name = "runtime"

    def __init__(self, vocab: int, hidden: int, layers: int, device: str) -> None:
        from capgraph.runtime import tiny_llama
        self.model = tiny_llama(vocab, hidden=hidden, layers=layers,
                                heads=max(1, hidden // 16), device=device)

    def runner(self, batch: int, max_seq_len: int, prompt: list[int]) -> "_RuntimeRunner":
        return _RuntimeRunner(self.model, batch, max_seq_len, prompt)


class _RuntimeRunner:
    """B sequences prefilled with the prompt over their own slot KV cache; 1-token steps."""

    def __init__(self, model: Any, batch: int, max_seq_len: int, prompt: list[int]) -> None:
        from capgraph.runtime import ModelRunner
        self.batch = batch
        self.runner = ModelRunner(model, batch, max_seq_len, 1)
        for slot in range(batch):
            self.runner.prefill(slot, prompt)
        self.start = len(prompt)

    def load(self, tokens: list[int], step: int) -> None:
        n = len(tokens)
        self.runner.load_step(list(range(n)), [[t] for t in tokens], [self.start + step] * n)

    def forward(self):
        return self.runner.forward_step(self.batch)


class StandInModel:
    """A stand-in decode step: logits = embedding(tokens) @ W, ``[B, V]`` fp32."""

    name = "standin"

    def __init__(self, vocab: int, hidden: int, layers: int, device: str) -> None:
        import torch
        gen = torch.Generator().manual_seed(0)
        self.embedding = torch.randn(vocab, hidden, generator=gen).to(device)
        self.head = (torch.randn(hidden, vocab, generator=gen) / hidden ** 0.5).to(device)
        self.device = device

    def runner(self, batch: int, max_seq_len: int, prompt: list[int]) -> "_StandInRunner":
        return _StandInRunner(self, batch)


class _StandInRunner:
    def __init__(self, model: StandInModel, batch: int) -> None:
        import torch
        self.model, self.batch = model, batch
        self.tokens = torch.zeros(batch, dtype=torch.long, device=model.device)

    def load(self, tokens: list[int], step: int) -> None:
        import torch
        self.tokens[:len(tokens)].copy_(torch.tensor(tokens))

    def forward(self):
        # tokens: [B] -> hidden: [B, H] -> logits: [B, V]
        return self.model.embedding[self.tokens] @ self.model.head


def _runtime_available() -> bool:
    try:
        import capgraph.runtime  # noqa: F401
    except ImportError:
        return False
    return True


class Shared:
    """What every case shares, built once before any case: the tokenizer, the config, one
    matcher factory (so the guide compiles once, into its cache), the guide, the
    teacher-forced texts of the largest batch, the prompt and the model weights."""

    def __init__(self, tokenizer: str, max_batch: int, model_kind: str, hidden: int,
                 layers: int, device: str) -> None:
        from capgraph import GuidedDecodingConfig, GuidedDecodingParams
        from capgraph.grammar import create_matcher_factory
        from capgraph.tokenizers import encode_continuation, load_tokenizer

        from .build import SCHEMA, instance

        self.tokenizer_name, self.device = tokenizer, device
        self.hidden, self.layers = hidden, layers
        tok = load_tokenizer(tokenizer)
        self.config = GuidedDecodingConfig.from_tokenizer(tok)
        self.vocab = self.config.vocab_size_padded
        self.factory = create_matcher_factory(self.config)
        self.params = GuidedDecodingParams.json_schema(json.dumps(SCHEMA))
        self.texts = [encode_continuation(tok, instance(i)) for i in range(max_batch)]
        self.prompt = tok.encode("Book a room for the team:", add_special_tokens=False)
        model_cls = RuntimeModel if model_kind == "runtime" else StandInModel
        self.model = model_cls(self.vocab, hidden, layers, device)

    def close(self) -> None:
        self.factory.close()


class Case:
    """One batch size: its runner, an eager and a capturable decoder over the shared factory,
    and the teacher-forced tokens. The constructor runs the context step (every decoder
    creates its matchers and masks the first logits). :meth:`step` runs one step of one
    variant, timed or not by the same code; positions ``0 .. warmup - 1`` are the warm-up."""

    def __init__(self, shared: Shared, batch: int, warmup: int, steps: int) -> None:
        from capgraph.capturable import CapturableGuidedDecoder
        from capgraph.decoder import GuidedDecoder
        from capgraph.requests import GuidedRequest

        self.shared, self.batch, self.warmup = shared, batch, warmup
        self.texts = shared.texts[:batch]
        # every position takes one token of each text
        self.steps = max(1, min(steps, min(len(t) for t in self.texts) - warmup))
        self.positions = warmup + self.steps
        config, factory, params = shared.config, shared.factory, shared.params
        self.runner = shared.model.runner(batch, len(shared.prompt) + self.positions + 2,
                                          shared.prompt)
        self.decoders: dict[str, Any] = {}
        self.decoders["eager"] = GuidedDecoder(config, batch, 0, device=shared.device,
                                               factory=factory)
        self.decoders["capturable"] = CapturableGuidedDecoder(config, batch, 0,
                                                              device=shared.device,
                                                              factory=factory)
        self.stages = _time_stages(self.decoders["eager"])  # where the eager decoder's time goes
        self.samples: dict[str, list[float]] = {v: [] for v in VARIANTS}
        self._generation = GuidedRequest.generation

        try:
            self.runner.load([t[0] for t in self.texts], 0)
            first = self.runner.forward()
            for name, dec in self.decoders.items():
                dec.add_batch([GuidedRequest.context(i, i, params) for i in range(batch)])
                failed = dec.execute(first.clone())
                failed = failed if name == "eager" else dec.take_failed_requests()
                if failed:
                    raise RuntimeError(f"batch {batch}: {name} context step failed: {failed}")
        except BaseException:
            self.close()
            raise

    def step(self, variant: str, s: int, timed: bool) -> float:
        """Run position ``s`` for ``variant``; its elapsed seconds join the samples if
        ``timed`` (warm-up steps run the very same code and are dropped)."""
        t0 = time.perf_counter()
        tokens = [t[s] for t in self.texts]
        dec = self.decoders.get(variant)
        self.runner.load(tokens, s)
        if dec is not None:
            dec.add_batch([self._generation(i, i, self.shared.params, t)
                           for i, t in enumerate(tokens)])
            if variant == "capturable":
                dec.prepare()  # the host build overlaps the forward (host-stream thread)
        logits = self.runner.forward()
        failed = dec.execute(logits) if dec is not None else None
        picks = logits.argmax(dim=-1).tolist()  # greedy, as the runtime's sampler
        if variant == "capturable" and dec is not None:
            failed = dec.take_failed_requests()
        elapsed = time.perf_counter() - t0
        if failed:
            raise RuntimeError(f"batch {self.batch}: {variant} step {s} failed: {failed}")
        if len(picks) != self.batch:
            raise RuntimeError(f"{variant}: {len(picks)} tokens for {self.batch} sequences")
        if timed:
            self.samples[variant].append(elapsed)
        elif variant == "eager":
            for times in self.stages.values():  # keep the timed steps' stages only
                times.clear()
        return elapsed

    def row(self) -> dict:
        sh = self.shared
        row: dict = {"batch": self.batch, "vocab": sh.vocab, "tokenizer": sh.tokenizer_name,
                     "steps": self.steps, "warmup": self.warmup, "model": sh.model.name,
                     "hidden": sh.hidden, "layers": sh.layers, "device": sh.device}
        for v in VARIANTS:
            samples = self.samples[v]
            m = median(samples)
            row[f"{v}_ms"] = m * 1e3
            row[f"{v}_steps_per_s"] = 1.0 / m
            row[f"{v}_mean_ms"] = sum(samples) / len(samples) * 1e3
            row[f"{v}_samples_ms"] = [round(x * 1e3, 4) for x in samples]
        for v in ("eager", "capturable"):
            row[f"{v}_ratio"] = row[f"{v}_ms"] / row["unguided_ms"]
        for stage, times in self.stages.items():
            row[f"eager_{stage}_ms"] = median(times) * 1e3
        return row

    def close(self) -> None:
        for dec in self.decoders.values():
            dec.close()


def _rotated(items: tuple | list, k: int) -> list:
    k %= len(items)
    return list(items[k:]) + list(items[:k])


def measure_cases(cases: list[Case]) -> None:
    """Run every case's positions in rounds: round ``s`` runs position ``s`` of every case that
    has it (cases and variants in rotating order), untimed while ``s < case.warmup``. Every
    case's warm-up therefore ends before the first timed step of any case."""
    for s in range(max(c.positions for c in cases)):
        for case in _rotated(cases, s):
            if s < case.positions:
                for variant in _rotated(VARIANTS, s):
                    case.step(variant, s, timed=s >= case.warmup)


def _synchronize(device: str) -> None:
    import torch
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict:
    import torch

    q = args.quick
    batches = pick(args.batches, q, [1, 8], [1, 8, 32])
    steps = pick(args.steps, q, 8, 60)
    tokenizer = pick(args.tokenizer, q, "tekken", "tekken")
    if args.warmup < 1 or steps < 1 or min(batches) < 1:
        raise ValueError(f"capgraph bench loop: --warmup {args.warmup}, --steps {steps} and "
                         f"--batches {batches} must all be >= 1")
    model_kind = args.model or ("runtime" if _runtime_available() else "standin")
    with torch.no_grad():
        shared = Shared(tokenizer, max(batches), model_kind, args.hidden, args.layers,
                        args.device)
        cases: list[Case] = []
        try:
            for batch in batches:
                cases.append(Case(shared, batch, args.warmup, steps))
            _synchronize(args.device)
            gc.collect()  # the setup's garbage, collected now rather than inside a timed step
            measure_cases(cases)
        finally:
            for case in cases:
                case.close()
            shared.close()
    rows = [case.row() for case in cases]
    for row in rows:
        print(f"  batch {row['batch']}: " + ", ".join(
            f"{v} {row[v + '_ms']:.2f} ms" for v in VARIANTS), flush=True)
    print_table(COLUMNS, rows)
    if args.device == "cuda":
        print("(cuda: 'eager build/apply ms' are host times; the apply column is the kernel "
              "launch, its GPU time is in the step time)")
    return {"rows": rows, "model": model_kind, "hidden": args.hidden, "layers": args.layers,
            "device": args.device, "warmup": args.warmup,
            "method": "median step time over steps; every case set up and warmed up "
                      "(--warmup untimed steps each) before the first timed step; steps run "
                      "in rounds over the cases; variants alternate within each step; "
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


def _time_stages(decoder) -> dict[str, list[float]]:
    """Wrap this decoder's host build strategy (``decoder.host_build.run``) and its mask
    application with timers (about a microsecond each); returns the lists they fill, one entry
    per call. Host time: on CUDA the apply is its kernel launch (no synchronisation is added to
    measure it)."""
    stages: dict[str, list[float]] = {"build": [], "apply": []}
    for owner, name, stage in ((decoder.host_build, "run", "build"),
                               (decoder, "apply_bitmask", "apply")):
        method = getattr(owner, name)

        def timed(*args, _method=method, _times=stages[stage], **kwargs):
            t0 = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                _times.append(time.perf_counter() - t0)
        setattr(owner, name, timed)
    return stages
