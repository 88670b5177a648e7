"""Token sampling from (masked) logits: greedy, or temperature / top-k with a seeded generator.

Masked logits are true ``-inf``; neither path can pick them. Sampling uses the Gumbel-max trick
in log space (``argmax(logits / T - log(E))``, ``E ~ Exp(1)``), so a ``-inf`` logit stays
``-inf`` whatever the draw, no softmax underflow can make an allowed token lose to a masked
one, and nothing synchronises with the host: both functions are safe inside a CUDA graph
capture (register the generator with the graph, see :class:`Sampler`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import ConfigError
from ..requests import as_int

__all__ = ["SamplingParams", "Sampler", "greedy", "sample_no_sync"]

# smallest Exp(1) draw kept: -log(E) stays finite, so -inf + (-log E) is -inf, never NaN
_MIN_EXP = 1e-30


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How a token is picked from a logits row.

    Args:
        temperature: 0 for greedy (argmax); > 0 divides the logits before sampling. A finite
            number (kept as a float; a NumPy number or a 0-d real tensor is taken, as for
            ``top_k``); a bool or text is a ``ConfigError``.
        top_k: keep only the ``top_k`` largest logits (0 keeps all); ignored when greedy. An
            integer >= 0 (a NumPy integer is taken; a bool or a float is a ``ConfigError``).
        seed: seed of the sampler's generator (reproducible draws for the same inputs).
    """

    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        # a number, not a bool read as 0 / 1 nor text;
        # finite: an infinite temperature turns the masked logits' -inf into NaN
        temperature = self.temperature
        if isinstance(temperature, torch.Tensor) and temperature.dim() == 0 \
                and not temperature.dtype.is_complex and temperature.dtype != torch.bool:
            temperature = temperature.item()  # (read once, when the parameters are made)
        if isinstance(temperature, (bool, np.bool_)) or not isinstance(
                temperature, (int, float, np.integer, np.floating)) \
                or not math.isfinite(temperature) or not temperature >= 0:
            raise ConfigError(f"SamplingParams.temperature={temperature!r} must be a finite "
                              "number >= 0")
        top_k = as_int(self.top_k)  # (a bool is not read as 1, a NumPy integer is taken)
        if top_k is None or top_k < 0:
            raise ConfigError(f"SamplingParams.top_k={self.top_k!r} must be an int >= 0")
        object.__setattr__(self, "temperature", float(temperature))
        object.__setattr__(self, "top_k", top_k)

    @property
    def greedy(self) -> bool:
        """True at temperature 0 (argmax sampling)."""
        return self.temperature == 0


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """``argmax`` per row. logits: ``[rows, V]`` -> ``[rows]`` int64 (first index on ties)."""
    return logits.argmax(dim=-1)


def sample_no_sync(logits: torch.Tensor, temperature: float, top_k: int,
                   generator: torch.Generator | None) -> torch.Tensor:
    """One token per row by temperature / top-k sampling; ``-inf`` entries are never drawn.

    logits: ``[rows, V]`` float (not modified) -> ``[rows]`` int64. No host synchronisation.
    """
    scores = logits.float() / temperature
    if 0 < top_k < scores.shape[-1]:
        # kth largest per row; with fewer than top_k finite entries it is -inf and keeps them all
        kth = torch.topk(scores, top_k, dim=-1).values[:, -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    noise = torch.empty_like(scores).exponential_(1.0, generator=generator)
    return (scores - noise.clamp_min_(_MIN_EXP).log_()).argmax(dim=-1)


class Sampler:
    """Picks tokens from logits per :class:`SamplingParams`, with its own seeded generator.

    Args:
        params: greedy or temperature / top-k.
        device: where logits live; the generator is created there.

    Under CUDA graph capture, call :meth:`register_with` on the graph so that replays advance
    the generator's state instead of repeating one draw.
    """

    def __init__(self, params: SamplingParams, device: torch.device | str = "cpu") -> None:
        self.params = params
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(params.seed)

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """logits ``[rows, V]`` -> tokens ``[rows]`` int64 (graph-safe, no host sync)."""
        if self.params.greedy:
            return greedy(logits)
        return sample_no_sync(logits, self.params.temperature, self.params.top_k, self.generator)

    def register_with(self, graph: "torch.cuda.CUDAGraph") -> None:
        """Let a CUDA graph own this generator's offsets (needed before capturing a draw)."""
        if not self.params.greedy and hasattr(graph, "register_generator_state"):
            graph.register_generator_state(self.generator)
