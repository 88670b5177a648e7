"""``generate()``: the reference decode loop — slots, prefill, guided decode steps, drafts.

Per iteration: waiting requests join free slots (prefill, then a context step whose masked
logits give their first token), then one decode step runs every live sequence: drafts are
proposed, the target reads the newest token and the drafts (``1 + k`` logits rows per
sequence), the guided decoder masks the rows, tokens are picked, and verification accepts
drafts while each equals the target's greedy pick. Sequences leave at a stop token, at
``max_new_tokens``, or when the guided decoder reports their request as failed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Any, Callable, Sequence

import torch

from ..capturable import CapturableGuidedDecoder
from ..decoder import GuidedDecoder, checked_device
from ..errors import ConfigError
from ..grammar.base import GrammarMatcherFactory
from ..params import GuidedDecodingConfig, GuidedDecodingParams
from ..requests import _flag, as_int
from ..tokenizers import decode_continuation
from .drafter import Drafter, GrammarDrafter, ModelDrafter, NgramDrafter
from .guide import GuideDriver, StageClock
from .model import tiny_llama
from .runner import ModelRunner, graph_batch_sizes
from .results import GenerationResult, GenerationResults, Timings
from .sampler import Sampler, SamplingParams
from .scheduler import Sequence as Seq
from .scheduler import SlotScheduler

__all__ = ["generate", "DRAFTS"]

#: The ``draft`` choices of :func:`generate`.
DRAFTS = ("none", "model", "ngram", "grammar", "grammar+ngram", "grammar+model")

#: Where a captured decode step enqueues its guided host work (the host node and the bitmask
#: copy): True, before the forward (``CapturableGuidedDecoder.prepare``), so that those are
#: graph nodes created ahead of the forward's kernels; False, after the forward, inside
#: ``execute``. ``tools/bench_graph_replay.py`` sets it False for its ``native-node-last`` kind,
#: which measures the two orders in one run.
_HOST_WORK_FIRST = True

#: Whether a captured greedy decode step takes its tokens from the decoder's fused masked
#: argmax (``CapturableGuidedDecoder.execute_argmax``: one pass that reads the bitmask and the
#: allowed logits, the logits left unmasked) rather than masking the logits in place and then
#: taking ``argmax``. ``tools/bench_graph_replay.py`` sets it False for its ``native-unfused``
#: kind, which measures the two in one run.
_FUSED_ARGMAX = True

#: The devices on which a greedy step outside a CUDA graph (a context step, or any step where
#: no graph holds the guide) takes its tokens from the decoder's fused masked argmax
#: (``execute_argmax``) too: CUDA, where the fused kernel skips the mask's pass over the
#: logits. On CPU the fused call masks a copy of the logits, which costs more than masking
#: them in place.
_FUSED_EAGER_DEVICES = ("cuda",)


def generate(prompts: Sequence[str | Sequence[int]],
             guides: Sequence[GuidedDecodingParams | None] | GuidedDecodingParams | None = None,
             *, model: torch.nn.Module | None = None, tokenizer: Any = None,
             max_new_tokens: int = 64, max_batch_size: int = 8, draft: str = "none",
             num_draft_tokens: int = 4, draft_model: torch.nn.Module | None = None,
             decoder: str = "eager", cuda_graph: bool | None = None,
             device: torch.device | str = "cpu", temperature: float = 0.0, top_k: int = 0,
             seed: int = 0, progress: bool | Callable[[int, int], None] = False,
             backend: str = "xgrammar", factory: Any = None,
             host_node: str | None = None,
             batch_after_launch: bool | None = None) -> GenerationResults:
    """Generate a continuation of each prompt, each following its own guide.

    Args:
        prompts: texts (encoded with ``tokenizer``) or token-id lists (not bytes).
        guides: one :class:`GuidedDecodingParams` or None per prompt, or one for all.
        model: a causal LM; default a :func:`tiny_llama` with random weights (seed ``seed``)
            sized to the tokenizer.
        tokenizer: a Hugging Face fast tokenizer object (not a name: ``load_tokenizer``
            loads one); default ``load_tokenizer("tekken")``.
        max_new_tokens: the length limit per request (finish reason ``"length"``).
        max_batch_size: sequence slots; more requests wait and join as slots free.
        draft: ``"none"``, ``"model"`` (a second small LM, ``draft_model`` or a random
            ``tiny_llama``), ``"ngram"`` (prompt lookup), ``"grammar"`` (the tokens each
            guide forces next, :class:`~capgraph.runtime.drafter.GrammarDrafter`), or
            ``"grammar+ngram"`` / ``"grammar+model"`` (the forced tokens first, the other
            drafter after them). Needs greedy decoding; the output equals non-speculative
            greedy output token for token (a request with drafts fills up to
            ``1 + num_draft_tokens`` rows a step within the same ``host_step_budget_ms``, so
            a guide whose fills are slow can fail by its budget where it would finish
            without drafts).
        num_draft_tokens: drafts per sequence per step (an integer >= 1; unused with
            ``draft="none"``).
        draft_model: the draft LM of ``draft="model"`` / ``"grammar+model"``, with the
            target's vocabulary (else ``ConfigError``); default a random ``tiny_llama`` (seed
            ``seed + 1``). Moved to ``device`` and the target's dtype. With another ``draft``,
            a ``ConfigError`` (no drafter would read it).
        decoder: ``"eager"`` (:class:`~capgraph.decoder.GuidedDecoder`) or ``"capturable"``
            (``capgraph.capturable.CapturableGuidedDecoder``, host work as stream callbacks).
        cuda_graph: capture the decode step in CUDA graphs (one per batch size); default on
            when ``device`` is CUDA. With the capturable decoder the graph holds forward, mask
            and sampling; with the eager one, forward (and sampling when nothing is guided).
            On CPU, True runs the graph path's padded static-buffer step eagerly instead.
        device: where the model runs (the model is moved there): ``"cpu"``, ``"cuda"`` or
            ``"cuda:N"`` (or such a ``torch.device``) of this machine.
        temperature, top_k, seed: sampling (``temperature=0`` is greedy): a finite number
            >= 0, an integer >= 0, an integer (see :class:`SamplingParams`).
        progress: show a progress bar on stderr, or a callable ``(finished, total)``.
        backend: grammar backend when ``factory`` is None (``"xgrammar"`` / ``"llguidance"``).
        factory: a matcher factory to reuse (its config must have the model's vocabulary);
            default: built for ``tokenizer`` with compact JSON (no free whitespace, so a
            model cannot loop on it). Not a backend name: that is ``backend``.
        host_node: the capturable decoder's ``host_node`` argument (which host function its
            step runs, passed through unchecked); None leaves the decoder's default. Needs
            ``decoder="capturable"``.
        batch_after_launch: replay each decode step's CUDA graph first and make its guided
            batch after the launch, while the GPU runs the forward
            (``CapturableGuidedDecoder.set_batch_after_launch``). None (default): where it can
            (the capturable decoder on its native host node, CUDA graphs on a CUDA device, no
            speculation); False: never; True: required (a ``ConfigError`` where it cannot).

    Raises:
        ConfigError: an argument of the wrong type or out of range, naming it; raised before
            any model, tokenizer or grammar work where the check needs none of them.

    Returns:
        :class:`GenerationResults`: one :class:`GenerationResult` per prompt, in order, with
        ``.timings``. A request whose guide fails (compile error, dead end) ends with
        ``finish_reason="error"`` and its message; the others continue.
    """
    engine = _Engine(prompts, guides, model=model, tokenizer=tokenizer,
                     max_new_tokens=max_new_tokens, max_batch_size=max_batch_size, draft=draft,
                     num_draft_tokens=num_draft_tokens, draft_model=draft_model,
                     decoder=decoder, cuda_graph=cuda_graph, device=device,
                     sampling=SamplingParams(temperature, top_k, seed), progress=progress,
                     backend=backend, factory=factory, host_node=host_node,
                     batch_after_launch=batch_after_launch)
    try:
        with torch.no_grad():
            return engine.run()
    finally:
        engine.close()


def _replay_blocks() -> str | None:
    """Why a CUDA graph replay here waits for its work before it returns, or None:
    ``CUDA_LAUNCH_BLOCKING``, or a driver before 11.4 (torch's replay synchronises the device
    there)."""
    if os.environ.get("CUDA_LAUNCH_BLOCKING", "") not in ("", "0"):
        return "CUDA_LAUNCH_BLOCKING is set"
    try:
        from cuda.bindings import driver
        err, version = driver.cuDriverGetVersion()
    except Exception:  # noqa: BLE001 - no cuda-python: torch's own launch rules then
        return None
    if int(err) == 0 and 0 < int(version) < 11040:
        return f"CUDA driver {int(version)} is older than 11.4"
    return None


def _token_ids(prompt: object, index: int, vocab_size: int) -> list[int]:
    """A prompt given as token ids, checked: a sequence of integers in the vocabulary (a
    float is not truncated, nor a bool read as 0 / 1, nor bytes read as their byte values)."""
    if isinstance(prompt, (bytes, bytearray, memoryview)):
        raise ConfigError(f"prompts[{index}] is {type(prompt).__name__}: expected a string or "
                          "a sequence of token ids (decode the bytes to a str first)")
    try:
        tokens = list(prompt)  # type: ignore[call-overload]
    except TypeError:
        raise ConfigError(f"prompts[{index}] is {type(prompt).__name__}: expected a string or "
                          "a sequence of token ids") from None
    ids = [as_int(t) for t in tokens]
    for k, (t, value) in enumerate(zip(tokens, ids)):
        if value is None or not 0 <= value < vocab_size:
            raise ConfigError(f"prompts[{index}][{k}] is {t!r}: expected a token id in "
                              f"[0, {vocab_size})")
    return ids  # type: ignore[return-value]


def _check_objects(*, model: object, tokenizer: object, draft: str, draft_model: object,
                   factory: object, progress: object, cuda_graph: object,
                   batch_after_launch: object) -> None:
    """Refuse, before any model, tokenizer or grammar work, an argument of the wrong kind
    (each would fail deep inside the loop, or be taken as something else: a flag that is not
    a bool, a draft model no drafter reads)."""
    for name, value in (("model", model), ("draft_model", draft_model)):
        if value is not None and not isinstance(value, torch.nn.Module):
            raise ConfigError(f"{name} is a {type(value).__name__} ({value!r:.60}): expected a "
                              "torch.nn.Module (a causal LM) or None")
    if draft_model is not None and not draft.endswith("model"):
        raise ConfigError(f"draft_model is given but draft={draft!r} uses no draft model "
                          "(draft='model' or 'grammar+model' does)")
    if tokenizer is not None:
        if isinstance(tokenizer, (str, bytes, os.PathLike)):
            raise ConfigError(f"tokenizer={tokenizer!r}: expected a tokenizer object, not a "
                              "name or path (capgraph.tokenizers.load_tokenizer loads one)")
        if not (callable(getattr(tokenizer, "encode", None))
                and callable(getattr(tokenizer, "decode", None))
                and hasattr(tokenizer, "__len__")):
            raise ConfigError(f"tokenizer is a {type(tokenizer).__name__}: expected a Hugging "
                              "Face tokenizer (with encode, decode and len()) or None")
    if factory is not None and not isinstance(factory, GrammarMatcherFactory):
        hint = (" (backend= picks the grammar backend by name)" if isinstance(factory, str)
                else "")
        raise ConfigError(f"factory={factory!r:.60}: expected a GrammarMatcherFactory "
                          f"(capgraph.grammar.create_matcher_factory) or None{hint}")
    if progress is not None and _flag(progress) is None and not callable(progress):
        raise ConfigError(f"progress={progress!r}: expected a bool or a callable "
                          "(finished, total)")
    for name, value in (("cuda_graph", cuda_graph), ("batch_after_launch", batch_after_launch)):
        if value is not None and _flag(value) is None:
            raise ConfigError(f"{name}={value!r}: expected True, False or None")


class _Engine:
    """The state of one ``generate`` call."""

    def __init__(self, prompts, guides, *, model, tokenizer, max_new_tokens, max_batch_size,
                 draft, num_draft_tokens, draft_model, decoder, cuda_graph, device, sampling,
                 progress, backend, factory, host_node=None,
                 batch_after_launch=None) -> None:
        for name, value in (("max_new_tokens", max_new_tokens),
                            ("max_batch_size", max_batch_size)):
            if as_int(value) is None or value < 1:
                raise ConfigError(f"{name}={value!r}: expected an integer >= 1")
        if draft not in DRAFTS:
            raise ConfigError(f"draft={draft!r}: expected one of {', '.join(map(repr, DRAFTS))}")
        if decoder not in ("eager", "capturable"):
            raise ConfigError(f"decoder={decoder!r}: expected 'eager' or 'capturable'")
        if host_node is not None and decoder != "capturable":
            raise ConfigError(f"host_node={host_node!r} needs decoder='capturable' (the eager "
                              f"decoder runs no host node), got decoder={decoder!r}")
        _check_objects(model=model, tokenizer=tokenizer, draft=draft, draft_model=draft_model,
                       factory=factory, progress=progress, cuda_graph=cuda_graph,
                       batch_after_launch=batch_after_launch)
        progress = progress if callable(progress) or progress is None else _flag(progress)
        cuda_graph = None if cuda_graph is None else _flag(cuda_graph)
        batch_after_launch = None if batch_after_launch is None else _flag(batch_after_launch)
        self._decoder_options = {} if host_node is None else {"host_node": host_node}
        K = 0
        if draft != "none":
            drafts = as_int(num_draft_tokens)
            if drafts is None or drafts < 1:
                raise ConfigError(f"num_draft_tokens={num_draft_tokens!r}: expected an integer "
                                  f">= 1 (drafts per sequence with draft={draft!r})")
            K = drafts
        self.K = K
        seed = as_int(sampling.seed)
        # (torch seeds are 64-bit; the default draft model takes seed + 1)
        if seed is None or not -(1 << 63) <= seed < (1 << 64) - 1:
            raise ConfigError(f"seed={sampling.seed!r}: expected an integer in "
                              f"[-2**63, 2**64 - 1)")
        if type(sampling.seed) is not int:
            sampling = dataclasses.replace(sampling, seed=seed)
        if K and not sampling.greedy:
            raise ConfigError("speculative decoding verifies greedily: use temperature=0")
        self.device = checked_device(device)
        if tokenizer is None:
            from ..tokenizers import load_tokenizer
            tokenizer = load_tokenizer("tekken")
        self.tokenizer = tokenizer
        self._own_factory = False
        self.sequences = self._sequences(prompts, guides, max_new_tokens)
        if model is None:
            model = tiny_llama(len(tokenizer), seed=sampling.seed,
                               eos_token_id=tokenizer.eos_token_id)
        model = model.to(self.device).eval()
        S = min(max_batch_size, len(self.sequences))
        max_seq_len = max(len(s.prompt) for s in self.sequences) + max_new_tokens + K + 1
        self.runner = ModelRunner(model, S, max_seq_len, 1 + K)
        for s in self.sequences:
            if not all(0 <= t < self.runner.vocab_size for t in s.prompt):
                raise ConfigError(f"prompt {s.index} holds token ids outside the model's "
                                  f"vocabulary [0, {self.runner.vocab_size})")
        self.sampler = Sampler(sampling, self.device)
        self.clock = StageClock(self.device, sync=True)
        self.guide = self._guide(decoder, factory, backend, S)
        try:
            self.drafter = self._drafter(draft, draft_model, model, S, max_seq_len,
                                         sampling.seed)
        except BaseException:
            self.close()
            raise
        self.stop_ids = (list(self.guide.decoder.config.stop_token_ids or []) if self.guide else
                         [t for t in [tokenizer.eos_token_id] if t is not None])
        self.scheduler = SlotScheduler(self.sequences, S)
        self.steps = 0
        self.progress = progress
        self.use_graphs = self.device.type == "cuda" if cuda_graph is None else bool(cuda_graph)
        self.guide_in_graph = self.use_graphs and self.guide is not None and self.guide.capturable
        # sampling joins the graph unless an eager decoder must mask the logits first
        self.sample_in_graph = self.use_graphs and (self.guide is None or self.guide_in_graph)
        # a greedy step sampled outside a graph takes its tokens from the guide's fused
        # masked argmax (see _FUSED_EAGER_DEVICES)
        self.fused_eager = self.guide is not None and self.sampler.params.greedy \
            and _FUSED_ARGMAX and self.device.type in _FUSED_EAGER_DEVICES
        # the batch after launch (CapturableGuidedDecoder.set_batch_after_launch): a replayed
        # decode step's guided host work (its requests, add_batch) runs after the launch,
        # while the GPU runs the forward, rather than before it with the GPU idle; on the
        # native node, without speculation (whose rollback must precede the step)
        self.batch_after_launch = False
        if self.use_graphs:
            try:
                self._capture()
                if batch_after_launch is not False:
                    self._set_batch_after_launch(batch_after_launch is True)
            except BaseException:
                self.close()
                raise
        elif batch_after_launch is True:
            self.close()
            raise ConfigError("batch_after_launch=True needs CUDA graphs (cuda_graph and a "
                              "CUDA device)")

    # -- setup -------------------------------------------------------------------------------
    def _sequences(self, prompts, guides, max_new_tokens) -> list[Seq]:
        if not hasattr(prompts, "__len__"):
            raise ConfigError(f"prompts is a {type(prompts).__name__}: expected a list (a "
                              f"sequence with a length) of texts or token-id lists")
        if isinstance(prompts, (str, bytes)) or not len(prompts):
            raise ConfigError("prompts must be a non-empty list of texts or token-id lists")
        n = len(prompts)
        if guides is None or isinstance(guides, GuidedDecodingParams):
            guides = [guides] * n
        if not hasattr(guides, "__len__"):
            raise ConfigError(f"guides is a {type(guides).__name__}: expected one "
                              f"GuidedDecodingParams or None, or a list of them, one per prompt")
        if len(guides) != n:
            raise ConfigError(f"{len(guides)} guides for {n} prompts")
        seqs = []
        for i, (p, g) in enumerate(zip(prompts, guides)):
            if g is not None and not isinstance(g, GuidedDecodingParams):
                raise ConfigError(f"guides[{i}] is {type(g).__name__}, not GuidedDecodingParams")
            ids = self.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) \
                else _token_ids(p, i, len(self.tokenizer))
            if not ids:
                bos = self.tokenizer.bos_token_id
                if bos is None:
                    raise ConfigError(f"prompt {i} encodes to no tokens")
                ids = [bos]
            seqs.append(Seq(i, ids, g, max_new_tokens))
        return seqs

    def _drafter(self, draft, draft_model, model, S, max_seq_len, seed) -> Drafter | None:
        if draft.startswith("grammar"):
            then = self._drafter(draft.partition("+")[2] or "none", draft_model, model, S,
                                 max_seq_len, seed)
            factory = self._factory if self.guide is not None else None
            return GrammarDrafter(factory, self.tokenizer, self.K, then=then)
        if draft == "ngram":
            return NgramDrafter(self.K)
        if draft == "model":
            vocab = self.runner.vocab_size
            if draft_model is None:
                draft_model = tiny_llama(vocab, seed=seed + 1, hidden=32, layers=1, heads=2)
            draft_model = draft_model.to(self.device, self.runner.dtype).eval()
            drafter = ModelDrafter(draft_model, self.K, S, max_seq_len)
            if drafter.vocab_size != vocab:
                raise ConfigError(f"draft model vocabulary {drafter.vocab_size} differs from "
                                  f"the target's {vocab}")
            return drafter
        return None

    def _guide(self, kind, factory, backend, S) -> GuideDriver | None:
        if all(s.guide is None for s in self.sequences):
            return None
        V = self.runner.vocab_size
        self._own_factory = factory is None
        if factory is None:
            from ..grammar import create_matcher_factory
            config = GuidedDecodingConfig.from_tokenizer(
                self.tokenizer, backend=backend, vocab_size_padded=V, json_whitespace="compact")
            factory = create_matcher_factory(config)
        self._factory = factory
        if factory.config.vocab_size_padded != V:
            raise ConfigError(f"the factory's vocab_size_padded={factory.config.vocab_size_padded}"
                              f" differs from the model's vocabulary ({V})")
        dec: GuidedDecoder
        if kind == "capturable":
            dec = CapturableGuidedDecoder(factory.config, S, self.K, device=self.device,
                                          factory=factory, **self._decoder_options)
        else:
            dec = GuidedDecoder(factory.config, S, self.K, device=self.device, factory=factory)
        driver = GuideDriver(dec, self.K)
        self.clock.instrument(dec, sync=not driver.capturable)
        return driver

    def _capture(self) -> None:
        """One graph per batch size: forward [+ mask + sample with the capturable decoder]."""
        runner, sampler, guide = self.runner, self.sampler, self.guide
        # greedy tokens straight from the masked argmax (the logits are then left unmasked:
        # nothing after the step reads them)
        fused = self.guide_in_graph and self.sample_in_graph and sampler.params.greedy \
            and _FUSED_ARGMAX

        def warmup(bs: int):
            logits = runner.forward_step(bs)
            if self.guide_in_graph:
                # the kernel's first launch on this stream happens here, not in the capture
                # (every token_mask row is still 0: nothing is masked)
                decoder: Any = guide.decoder  # type: ignore[union-attr]
                if fused:
                    tokens = torch.empty(logits.shape[0], dtype=torch.int64,
                                         device=logits.device)
                    decoder.argmax_bitmask(logits, tokens, logits.shape[0])
                    return tokens
                decoder.apply_bitmask(logits, None, logits.shape[0])
            return sampler(logits)

        def step(bs: int):
            if self.guide_in_graph:
                guide.tokens_ready()  # type: ignore[union-attr]
                if _HOST_WORK_FIRST:  # (its host node and bitmask copy ahead of the forward)
                    guide.prepare(bs * (1 + self.K))  # type: ignore[union-attr]
            logits = runner.forward_step(bs)
            if fused:
                return logits, guide.apply_argmax(logits)  # type: ignore[union-attr]
            if self.guide_in_graph:
                guide.apply(logits)  # type: ignore[union-attr]
            return logits, sampler(logits) if self.sample_in_graph else None

        def before_capture(graph, bs: int) -> None:
            sampler.register_with(graph)
            if self.guide_in_graph:
                guide.begin_capture(bs)  # type: ignore[union-attr]

        runner.capture_cudagraphs(step, graph_batch_sizes(runner.max_num_sequences),
                                  warmup=warmup, before_capture=before_capture)

    def _late_begin_decode(self, seqs: list[Seq], drafts: list[list[int]], bs: int) -> None:
        """The decode step's guided batch, after its replay's launch. If making it raises,
        the replay's node gets an empty batch (it masks nothing) or, where a batch may be
        queued in part, stops waiting, rather than holding the step's sync for its whole
        timeout; the mode ends with the error."""
        guide = self.guide
        assert guide is not None
        decoder: Any = guide.decoder
        put = decoder._put_epoch
        try:
            guide.begin_decode(seqs, drafts, pad_to=bs)
        except BaseException:
            self.batch_after_launch = False
            try:
                if decoder._put_epoch == put:  # nothing queued for the launched step
                    decoder.add_batch([])
            except Exception:  # noqa: BLE001 - (the first error is the one raised)
                pass
            try:
                decoder.set_batch_after_launch(None)
            except Exception:  # noqa: BLE001
                pass
            raise

    def _set_batch_after_launch(self, required: bool) -> None:
        """Make decode steps' guided batches after their launch where the loop can (see
        ``generate``'s ``batch_after_launch``); ``required``: a ConfigError saying why not."""
        decoder = self.guide.decoder if self.guide is not None else None
        reason = None
        if not self.guide_in_graph:
            reason = "the capturable decoder with its step in the CUDA graph"
        elif self.device.type != "cuda":
            reason = "a CUDA device (the CPU stand-in runs the graph's step eagerly)"
        elif self.K:
            reason = "no speculation (a step's rollback must come before its replay)"
        elif getattr(decoder, "host_node", None) != "native":
            reason = "the native host node"
        else:
            blocking = _replay_blocks()
            if blocking is not None:
                reason = (f"a graph replay that returns before its work ends ({blocking}): a "
                          "replay that waited for its host node would wait for the batch "
                          "made after it")
        if reason is None:
            decoder.set_batch_after_launch()  # type: ignore[union-attr]
            self.batch_after_launch = True
        elif required:
            raise ConfigError(f"batch_after_launch=True needs {reason}")

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> GenerationResults:
        self.t0 = time.perf_counter()
        bar = self._progress_bar()
        finished = 0
        while not self.scheduler.done:
            admitted = self.scheduler.admit()
            if admitted:
                self._context_step(admitted)
            live = [s for s in self.scheduler.running if not s.finished]
            if live:
                self._decode_step(live)
            for seq in self.scheduler.retire_finished():
                if self.guide is not None:
                    self.guide.release(seq.seq_slot)
                if self.drafter is not None:
                    self.drafter.release(seq.seq_slot)
                finished += 1
                if bar is not None:
                    bar.update(1)
                elif callable(self.progress):
                    self.progress(finished, len(self.sequences))
        if bar is not None:
            bar.close()
        return self._results()

    def _context_step(self, seqs: list[Seq]) -> None:
        with self.clock.time("prefill"):
            logits = torch.cat([self.runner.prefill(s.seq_slot, s.prompt) for s in seqs])
            if self.drafter is not None:
                for s in seqs:
                    self.drafter.start(s.seq_slot, s.prompt, s.guide)
        if self.guide is not None:
            self.guide.begin_context(seqs)
        tokens = self._sample_eager(logits).tolist()
        failed = dict(self.guide.take_failed()) if self.guide is not None else {}
        for s, t in zip(seqs, tokens):
            if s.index in failed:
                s.finish("error", failed[s.index])
            else:
                s.append([t], self.stop_ids)

    def _sample_eager(self, logits: torch.Tensor) -> torch.Tensor:
        """The tokens of a step run outside a graph: the guide's fused masked argmax
        (``fused_eager``; timed as the decoder's build and apply), else the guide's mask, if
        any, and then the sampler."""
        guide = self.guide
        if self.fused_eager:
            assert guide is not None
            return guide.apply_argmax(logits)
        if guide is not None:
            guide.apply(logits)
        with self.clock.time("sample"):
            return self.sampler(logits)

    def _decode_step(self, seqs: list[Seq]) -> None:
        K, B, runner = self.K, len(seqs), self.runner
        slots = [s.seq_slot for s in seqs]
        drafts: list[list[int]] = [[] for _ in seqs]
        if self.drafter is not None:
            with self.clock.time("draft"):
                drafts = self.drafter.propose(slots, [s.context for s in seqs])
        fitting = runner.graph_batch_size(B) if self.use_graphs else B
        if fitting is None:
            raise RuntimeError(f"no captured CUDA graph holds a batch of {B} (captured: "
                               f"{sorted(runner.graphs)})")
        bs = fitting
        # each sequence feeds its newest token (not yet in its cache) and its drafts
        inputs = [[s.output[-1]] + d for s, d in zip(seqs, drafts)]
        runner.load_step(slots, inputs, [s.num_cached for s in seqs], bs)
        rows = B * (1 + K)
        late = self.batch_after_launch
        if self.guide is not None and not late:
            with self.clock.time("guide", sync=False):
                self.guide.begin_decode(seqs, drafts,
                                        pad_to=bs if self.guide_in_graph else None)
        if self.use_graphs:
            with self.clock.time("forward"):
                logits, sampled = runner.replay(bs)
                if late:  # (the replay's host node waits for this batch)
                    self._late_begin_decode(seqs, drafts, bs)
            logits = logits[:rows]
        else:
            with self.clock.time("forward"):
                logits = runner.forward_step(B)
        if not self.sample_in_graph:  # (nor, then, the guide: see __init__)
            sampled = self._sample_eager(logits)
        picks = sampled[:rows].view(B, 1 + K).tolist()
        failed = {}
        if self.guide is not None:
            with self.clock.time("guide", sync=False):
                failed = dict(self.guide.take_failed())
        self.steps += 1
        for s, d, p in zip(seqs, drafts, picks):
            s.num_steps += 1
            if s.index in failed:
                s.finish("error", failed[s.index])
                continue
            accepted = 0
            while accepted < K and d[accepted] == p[accepted]:
                accepted += 1
            s.accepted_prev = accepted
            s.num_draft_tokens += K
            s.num_accepted_draft_tokens += accepted
            s.append(d[:accepted] + [p[accepted]], self.stop_ids)

    # -- results -------------------------------------------------------------------------------
    def _progress_bar(self):
        if self.progress is not True:
            return None
        from tqdm import tqdm
        return tqdm(total=len(self.sequences), desc="generate", unit="req", file=sys.stderr,
                    leave=False)

    def _results(self) -> GenerationResults:
        # the native host node times itself (on the driver's or the lane's thread); it serves
        # captured steps only, so a run without a graph has no such stage
        stats = getattr(self.guide.decoder, "host_node_stats", None) if self.guide else None
        if stats is not None and stats.runs:
            self.clock.add("host_node", stats.busy_ns / 1e9)
        out = GenerationResults()
        ntok = 0
        for s in self.sequences:
            body = s.output[:-1] if s.finish_reason == "stop" else s.output
            ntok += len(s.output)
            out.append(GenerationResult(
                index=s.index, tokens=list(s.output),
                # (as a continuation: a sentencepiece decode() drops a leading space)
                text=decode_continuation(self.tokenizer, body, skip_special_tokens=False),
                finish_reason=s.finish_reason or "error", error=s.error,
                prompt_len=len(s.prompt), num_steps=s.num_steps,
                num_draft_tokens=s.num_draft_tokens,
                num_accepted_draft_tokens=s.num_accepted_draft_tokens,
                queue_s=s.t_admitted - self.t0,
                time_to_first_token_s=(s.t_first_token - self.t0) if s.output else 0.0,
                latency_s=s.t_finished - self.t0))
        out.timings = Timings(dict(self.clock.seconds), time.perf_counter() - self.t0,
                              self.steps, ntok)
        return out

    def close(self) -> None:
        if getattr(self, "guide", None) is not None:
            self.guide.close()  # type: ignore[union-attr]
            self.guide = None
            if self._own_factory:
                self._factory.close()
        if getattr(self, "runner", None) is not None:
            self.runner.release_graphs()
