"""Drafters for speculative decoding: each proposes ``k`` tokens per sequence per step.

Drafts only decide how many tokens a step can accept; the output is whatever the target model
picks greedily, so a drafter can be wrong (or numerically noisy) without changing the result.

* :class:`NgramDrafter` — prompt lookup: find the latest earlier occurrence of the context's
  last ``n`` tokens (longest ``n`` first) and propose what followed it.
* :class:`ModelDrafter` — a second, smaller causal LM run greedily over its own slot cache.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence

import torch

from ..errors import ConfigError
from .runner import ModelRunner

__all__ = ["Drafter", "NgramDrafter", "ModelDrafter"]


class Drafter(ABC):
    """Proposes exactly ``num_draft_tokens`` tokens for each sequence of a step."""

    def __init__(self, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens={num_draft_tokens} must be >= 1 to draft")
        self.num_draft_tokens = num_draft_tokens

    def start(self, slot: int, prompt: Sequence[int]) -> None:
        """A sequence starts in ``slot`` with ``prompt`` (default: nothing to do)."""

    @abstractmethod
    def propose(self, slots: Sequence[int], contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        """``num_draft_tokens`` tokens to follow each context (prompt + output so far)."""


class NgramDrafter(Drafter):
    """Prompt-lookup drafting from the sequence's own tokens.

    Args:
        num_draft_tokens: tokens proposed per step; a shorter match is padded by repeating
            its last token (padding is verified like any draft).
        max_ngram, min_ngram: lengths of the suffix matched, tried longest first.
    """

    def __init__(self, num_draft_tokens: int, max_ngram: int = 3, min_ngram: int = 1) -> None:
        super().__init__(num_draft_tokens)
        if not 1 <= min_ngram <= max_ngram:
            raise ConfigError(f"NgramDrafter: need 1 <= min_ngram ({min_ngram}) <= max_ngram "
                              f"({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, slots: Sequence[int], contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        return [self.lookup(list(ctx)) for ctx in contexts]

    def lookup(self, ctx: list[int]) -> list[int]:
        """The drafts for one context (never empty: falls back to repeating the last token)."""
        k = self.num_draft_tokens
        for n in range(min(self.max_ngram, len(ctx) - 1), self.min_ngram - 1, -1):
            suffix = ctx[-n:]
            # latest earlier occurrence whose continuation starts before the suffix itself
            for i in range(len(ctx) - n - 1, -1, -1):
                if ctx[i:i + n] == suffix:
                    follow = ctx[i + n:i + n + k]
                    return follow + [follow[-1]] * (k - len(follow))
        return [ctx[-1]] * k


class ModelDrafter(Drafter):
    """Greedy drafts from a second causal LM with its own slot cache.

    Per step, for a batch of slots: one forward over each context's last two tokens (the
    newest token and the one before it, re-written so a step that accepted every draft needs
    no special case), then ``k - 1`` one-token forwards, each feeding the previous argmax.
    The draft cache is valid up to each context's length after every step: what verification
    rejected sits past that length and is overwritten when reached.

    Args:
        model: the draft LM; its vocabulary must be the target's.
        num_draft_tokens: ``k``.
        max_num_sequences, max_seq_len: as the target's runner.
    """

    def __init__(self, model: torch.nn.Module, num_draft_tokens: int, max_num_sequences: int,
                 max_seq_len: int) -> None:
        super().__init__(num_draft_tokens)
        self.pair_runner = ModelRunner(model, max_num_sequences, max_seq_len, 2)
        self.single_runner = ModelRunner(model, max_num_sequences, max_seq_len, 1,
                                         cache=self.pair_runner.cache)

    @property
    def vocab_size(self) -> int:
        return self.pair_runner.vocab_size

    @torch.no_grad()
    def start(self, slot: int, prompt: Sequence[int]) -> None:
        self.pair_runner.prefill(slot, prompt)

    @torch.no_grad()
    def propose(self, slots: Sequence[int], contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        pair, single = self.pair_runner, self.single_runner
        lengths = [len(c) for c in contexts]
        pair.load_step(slots, [c[-2:] for c in contexts], [n - 2 for n in lengths])
        B = len(slots)
        # [B*2, V] -> the second position of each sequence predicts the first draft
        drafts = pair.forward_step(B).view(B, 2, -1)[:, 1].argmax(-1, keepdim=True)
        out = [drafts]
        for i in range(1, self.num_draft_tokens):
            single.load_step(slots, [[0]] * B, [n - 1 + i for n in lengths])
            single.input_ids[:B].copy_(out[-1])
            out.append(single.forward_step(B).argmax(-1, keepdim=True))
        return torch.cat(out, dim=1).tolist()
