"""ModelRunner: one causal LM over sequence slots — per-request prefill, batched decode steps,
and the CUDA-graph capture of a decode step.

A decode step takes ``T = 1 + num_draft_tokens`` tokens per sequence (the last accepted token
and its drafts). Its inputs live in static max-size buffers (``input_ids``, ``positions``,
``slot_ids``); :meth:`ModelRunner.load_step` copies a step's values into their first rows and
points the unused rows of a padded batch at a dummy slot, so a graph captured for batch size
``bs`` replays for any batch of at most ``bs`` sequences.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence, cast

import torch

from .._nvtx import nvtx_range
from ..errors import ConfigError
from .model import SlotKVCache

__all__ = ["ModelRunner", "EagerGraph", "graph_batch_sizes"]


class EagerGraph:
    """CPU stand-in for a captured step: :meth:`replay` re-runs the step on the static
    buffers, so the graph path's padded-batch protocol runs (and is tested) without CUDA."""

    def __init__(self, step: Callable[[int], Any], batch_size: int) -> None:
        self.step, self.batch_size = step, batch_size

    def replay(self) -> Any:
        """Run the step again at the captured batch size (eagerly: nothing was captured)."""
        return self.step(self.batch_size)


def graph_batch_sizes(max_batch_size: int) -> list[int]:
    """Batch sizes to capture: 1, 2, 4, 8, then multiples of 8, and ``max_batch_size``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch_size]
    sizes += list(range(8, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


def cache_keyword(model: torch.nn.Module) -> str:
    """The name under which ``model``'s forward takes its KV cache: ``cache`` (transformers
    5.2x renamed it) or ``past_key_values`` (earlier releases). Passing the wrong one is not an
    error there: the model silently runs without the cache."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    if "past_key_values" in params:
        return "past_key_values"
    raise ConfigError(f"{type(model).__name__}.forward takes neither 'cache' nor "
                      "'past_key_values': not a transformers causal LM this runner can drive")


class ModelRunner:
    """Runs ``model`` over a slot-indexed static KV cache.

    Args:
        model: a transformers causal LM (eval mode, on its device).
        max_num_sequences: slots ``0 .. max_num_sequences - 1``; one more, the dummy slot, takes
            the writes of a padded batch's unused rows.
        max_seq_len: positions per slot (prompt + new tokens + drafts must fit).
        tokens_per_seq: tokens per sequence in a decode step (``1 + num_draft_tokens``).
        cache: share another runner's cache (same model, slots and length) instead of
            allocating one, e.g. to run steps of two widths over one cache.
    """

    def __init__(self, model: torch.nn.Module, max_num_sequences: int, max_seq_len: int,
                 tokens_per_seq: int = 1, cache: SlotKVCache | None = None) -> None:
        if max_num_sequences < 1 or max_seq_len < 2 or tokens_per_seq < 1:
            raise ConfigError(f"ModelRunner: max_num_sequences={max_num_sequences}, "
                              f"max_seq_len={max_seq_len}, tokens_per_seq={tokens_per_seq} "
                              "must be >= 1, >= 2, >= 1")
        param = next(model.parameters())
        self.model = model
        self._cache_kwarg = cache_keyword(model)
        self.device, self.dtype = param.device, param.dtype
        config: Any = model.config  # a transformers model's config
        self.vocab_size: int = config.get_text_config(decoder=True).vocab_size
        self.max_num_sequences = max_num_sequences
        self.max_seq_len = max_seq_len
        self.tokens_per_seq = T = tokens_per_seq
        self.dummy_slot = max_num_sequences
        if cache is not None and (cache.num_slots != max_num_sequences + 1
                                  or cache.max_seq_len != max_seq_len):
            raise ConfigError(f"ModelRunner: the shared cache has {cache.num_slots} slots of "
                              f"{cache.max_seq_len}, expected {max_num_sequences + 1} of "
                              f"{max_seq_len}")
        self.cache = cache or SlotKVCache(model.config, max_num_sequences + 1, max_seq_len,
                                          device=self.device, dtype=self.dtype)
        # static inputs, max size: [S, T] token ids and positions, [S] slots
        S = max_num_sequences
        self.input_ids = torch.zeros(S, T, dtype=torch.long, device=self.device)
        self.positions = torch.arange(T, device=self.device).repeat(S, 1)
        self.slot_ids = torch.full((S,), self.dummy_slot, dtype=torch.long, device=self.device)
        self._kv_positions = torch.arange(max_seq_len, device=self.device)
        self._pinned = self.device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, Any]] = {}
        self.graph_pool: Any = None  # the shared memory pool, set by the first capture

    # -- forward -----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slot_ids: torch.Tensor,
                last_only: bool = False) -> torch.Tensor:
        """Logits of every input position, ``[B * T, V]`` (``[B, V]`` with ``last_only``).

        input_ids, positions: ``[B, T]`` int64; slot_ids: ``[B]`` int64. Writes the new keys
        at ``positions`` of each slot, attends to positions ``<=`` each query's own. No host
        synchronisation: safe inside a CUDA graph capture.
        """
        B, T = input_ids.shape
        target = self.cache.target
        target.slot_ids, target.positions = slot_ids, positions
        # mask: [B, 1, T, max_seq_len], additive (0 = visible)
        visible = self._kv_positions.view(1, 1, 1, -1) <= positions.view(B, 1, T, 1)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask.masked_fill_(~visible, torch.finfo(self.dtype).min)
        out = self.model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                         use_cache=True, logits_to_keep=1 if last_only else 0,
                         **{self._cache_kwarg: self.cache})
        return out.logits.reshape(-1, out.logits.shape[-1])

    @torch.no_grad()
    @nvtx_range("ModelRunner.prefill")
    def prefill(self, slot: int, tokens: Sequence[int]) -> torch.Tensor:
        """Run a prompt into ``slot`` (batch 1, eager); returns its last logits ``[1, V]``."""
        n = len(tokens)
        if not 0 <= slot < self.max_num_sequences or not 0 < n <= self.max_seq_len:
            raise ConfigError(f"prefill: slot {slot} or prompt length {n} out of range "
                              f"(slots {self.max_num_sequences}, max_seq_len {self.max_seq_len})")
        ids = torch.tensor([list(tokens)], dtype=torch.long, device=self.device)
        pos = torch.arange(n, device=self.device).unsqueeze(0)
        slots = torch.tensor([slot], dtype=torch.long, device=self.device)
        return self.forward(ids, pos, slots, last_only=True)

    # -- decode steps --------------------------------------------------------------------------
    def load_step(self, slots: Sequence[int], tokens: Sequence[Sequence[int]],
                  starts: Sequence[int], batch_size: int | None = None) -> int:
        """Copy one decode step into the static inputs; returns the (padded) batch size.

        Sequence ``b`` feeds ``tokens[b]`` (``T`` ids) at positions ``starts[b] ..
        starts[b] + T - 1`` of slot ``slots[b]``. Rows ``len(slots) .. batch_size - 1`` point
        at the dummy slot.
        """
        B, T = len(slots), self.tokens_per_seq
        bs = B if batch_size is None else batch_size
        if not 0 < B <= bs <= self.max_num_sequences:
            raise ConfigError(f"load_step: {B} sequences, batch size {bs}, "
                              f"max_num_sequences {self.max_num_sequences}")
        last = max(starts) + T
        if last > self.max_seq_len:
            raise ConfigError(f"load_step: position {last - 1} is past max_seq_len="
                              f"{self.max_seq_len}")
        ids = torch.zeros(bs, T, dtype=torch.long)
        ids[:B] = torch.tensor([list(t) for t in tokens], dtype=torch.long)
        pos = torch.arange(T).repeat(bs, 1)
        pos[:B] += torch.tensor(list(starts), dtype=torch.long).unsqueeze(1)
        sl = torch.full((bs,), self.dummy_slot, dtype=torch.long)
        sl[:B] = torch.tensor(list(slots), dtype=torch.long)
        for dst, src in ((self.input_ids, ids), (self.positions, pos), (self.slot_ids, sl)):
            dst[:bs].copy_(src.pin_memory() if self._pinned else src, non_blocking=True)
        return bs

    def step_inputs(self, bs: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Views of the first ``bs`` rows of the static inputs (what a captured step reads)."""
        return self.input_ids[:bs], self.positions[:bs], self.slot_ids[:bs]

    def forward_step(self, bs: int) -> torch.Tensor:
        """The decode forward over the static inputs' first ``bs`` rows: ``[bs * T, V]``."""
        return self.forward(*self.step_inputs(bs))

    # -- CUDA graphs ---------------------------------------------------------------------------
    def graph_batch_size(self, n: int) -> int | None:
        """The smallest captured batch size that holds ``n`` sequences (None if none)."""
        fitting = [bs for bs in self.graphs if bs >= n]
        return min(fitting) if fitting else None

    @torch.no_grad()
    def capture_cudagraphs(self, step: Callable[[int], Any], batch_sizes: Sequence[int],
                           warmup: Callable[[int], Any] | None = None,
                           before_capture: Callable[[torch.cuda.CUDAGraph, int], None]
                           | None = None) -> None:
        """Capture ``step(bs)`` once per batch size: largest first, one shared memory pool.

        ``step(bs)`` reads the static inputs' first ``bs`` rows and returns its outputs, which
        stay valid (static) for every replay of that graph. ``warmup(bs)`` (default ``step``)
        runs once on a side stream before each capture so lazy allocations and library
        initialisation happen outside it. ``before_capture(graph, bs)`` runs just before each
        capture (register a sampling generator, queue a placeholder batch).

        On CPU nothing is captured: each batch size gets an :class:`EagerGraph` that runs
        ``step`` at every replay (no warm-up, no ``before_capture``).
        """
        if self.device.type != "cuda":
            for bs in batch_sizes:
                self.graphs[bs] = (EagerGraph(step, bs), None)  # type: ignore[assignment]
            return
        warmup = warmup or step
        self.input_ids.zero_()
        self.positions.copy_(torch.arange(self.tokens_per_seq, device=self.device)
                             .repeat(self.max_num_sequences, 1))
        self.slot_ids.fill_(self.dummy_slot)
        torch.cuda.synchronize(self.device)
        for bs in sorted(set(batch_sizes), reverse=True):
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                warmup(bs)
            torch.cuda.current_stream(self.device).wait_stream(side)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            if before_capture is not None:
                before_capture(graph, bs)
            with torch.cuda.graph(graph, pool=self.graph_pool):
                outputs = step(bs)
            if self.graph_pool is None:
                self.graph_pool = graph.pool()
            self.graphs[bs] = (graph, outputs)
        torch.cuda.synchronize(self.device)

    def replay(self, bs: int) -> Any:
        """Replay the graph captured for ``bs``; returns its static outputs."""
        graph, outputs = self.graphs[bs]
        replayed = cast(Any, graph).replay()  # a CPU stand-in graph returns its outputs
        return outputs if outputs is not None else replayed

    def release_graphs(self) -> None:
        """Drop the captured graphs and their pool."""
        self.graphs.clear()
        self.graph_pool = None
