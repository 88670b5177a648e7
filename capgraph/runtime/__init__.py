"""The reference decode loop: a transformers model over a slot-indexed static KV cache, CUDA
graph capture of the decode step, sampling, speculative drafting, and :func:`generate`.

Importing this package loads torch and transformers; ``import capgraph`` does not (it exposes
``capgraph.generate`` lazily).
"""

from __future__ import annotations

from .drafter import Drafter, GrammarDrafter, ModelDrafter, NgramDrafter
from .engine import generate
from .model import SlotKVCache, load_model, tiny_llama
from .results import GenerationResult, GenerationResults, Timings
from .runner import EagerGraph, ModelRunner, graph_batch_sizes
from .sampler import Sampler, SamplingParams, greedy, sample_no_sync

__all__ = ["generate", "GenerationResult", "GenerationResults", "Timings", "tiny_llama",
           "load_model", "SlotKVCache", "ModelRunner", "EagerGraph", "graph_batch_sizes",
           "Sampler", "SamplingParams", "greedy", "sample_no_sync", "Drafter", "NgramDrafter",
           "ModelDrafter", "GrammarDrafter"]
