"""What :func:`capgraph.generate` returns: one result per request and a timing breakdown."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["GenerationResult", "GenerationResults", "Timings", "STAGES"]

STAGES = ("prefill", "draft", "guide", "forward", "build", "host_node", "apply", "sample")


@dataclass(slots=True)
class GenerationResult:
    """One request's output.

    Attributes:
        index: the request's position in ``prompts``.
        tokens: generated ids, the stop token included when there is one.
        text: ``tokens`` decoded, without the stop token.
        finish_reason: ``"stop"`` (stop token), ``"length"`` (max_new_tokens) or ``"error"``.
        error: why the request failed (``finish_reason == "error"``), else None.
        num_draft_tokens / num_accepted_draft_tokens: drafts verified / accepted.
        queue_s, time_to_first_token_s, latency_s: seconds from the call's start to admission,
            to the first token and to the end of the request.
    """

    index: int
    tokens: list[int]
    text: str
    finish_reason: str
    error: str | None
    prompt_len: int
    num_steps: int
    num_draft_tokens: int
    num_accepted_draft_tokens: int
    queue_s: float
    time_to_first_token_s: float
    latency_s: float


@dataclass(slots=True)
class Timings:
    """Where a call's time went (seconds; stages may overlap with a capturable decoder).

    ``forward`` is the decode forward (with a CUDA graph: the whole replayed step, in which
    ``build`` and ``apply`` also run, and the step's guided batch where it is made after the
    launch); ``guide`` the decode steps' guided host work outside it (each step's requests and
    ``add_batch`` where they come before the forward, the failures read after it);
    ``build`` is host mask building in Python,
    ``host_node`` the native host node's own time (present where it ran steps of the
    capturable decoder), ``apply`` masking the logits, ``sample`` picking tokens (a greedy
    guided step's tokens from the fused masked argmax count under ``apply``: on CUDA, every
    such step outside a graph), ``draft`` the drafter, ``prefill`` prompt forwards.
    """

    stages: dict[str, float]
    total_s: float
    steps: int
    tokens: int

    def summary(self) -> str:
        """One line: total time, decode steps, tokens and tokens/s, then milliseconds per stage."""
        parts = [f"{k} {self.stages.get(k, 0.0) * 1e3:.0f} ms" for k in STAGES
                 if k in self.stages]
        rate = self.tokens / self.total_s if self.total_s > 0 else 0.0
        return (f"{self.total_s:.2f} s total, {self.steps} decode steps, {self.tokens} tokens "
                f"({rate:.0f} tok/s): " + ", ".join(parts))


class GenerationResults(list):
    """``list[GenerationResult]`` in prompt order, with the call's :class:`Timings`."""

    timings: Timings
