"""Drafters for speculative decoding: each proposes ``k`` tokens per sequence per step.

Drafts only decide how many tokens a step can accept; the output is whatever the target model
picks greedily, so a drafter can be wrong (or numerically noisy) without changing the result.

* :class:`NgramDrafter` — prompt lookup: find the latest earlier occurrence of the context's
  last ``n`` tokens (longest ``n`` first) and propose what followed it.
* :class:`ModelDrafter` — a second, smaller causal LM run greedily over its own slot cache.
* :class:`GrammarDrafter` — the tokens a sequence's grammar forces next (JSON keys of a
  schema, punctuation, the fixed parts of a tool call), in the tokenizer's own encoding; an
  optional second drafter continues after that forced prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from ..errors import ConfigError
from ..grammar import CompileHandle, ForcedTokenEncoder, GrammarMatcher, GrammarMatcherFactory
from ..params import GuidedDecodingParams
from .runner import ModelRunner

__all__ = ["Drafter", "NgramDrafter", "ModelDrafter", "GrammarDrafter"]


class Drafter(ABC):
    """Proposes exactly ``num_draft_tokens`` tokens for each sequence of a step."""

    def __init__(self, num_draft_tokens: int) -> None:
        if num_draft_tokens < 1:
            raise ConfigError(f"num_draft_tokens={num_draft_tokens} must be >= 1 to draft")
        self.num_draft_tokens = num_draft_tokens

    def start(self, slot: int, prompt: Sequence[int],
              guide: GuidedDecodingParams | None = None) -> None:
        """A sequence starts in ``slot`` with ``prompt`` under ``guide`` (default: nothing to
        do)."""

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` finished (default: nothing to do)."""

    @abstractmethod
    def propose(self, slots: Sequence[int], contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        """``num_draft_tokens`` tokens to follow each context (prompt + output so far)."""

    def propose_after(self, slots: Sequence[int], contexts: Sequence[Sequence[int]],
                      prefixes: Sequence[Sequence[int]]) -> list[list[int]]:
        """``num_draft_tokens - len(prefix)`` tokens to follow each ``context + prefix``
        (the prefix drafted by another drafter; default: :meth:`propose` on the joined
        contexts)."""
        k = self.num_draft_tokens
        joined = [list(c) + list(p) for c, p in zip(contexts, prefixes)]
        return [d[:max(k - len(p), 0)]
                for d, p in zip(self.propose(slots, joined), prefixes)]


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
        """The draft model's vocabulary size."""
        return self.pair_runner.vocab_size

    @torch.no_grad()
    def start(self, slot: int, prompt: Sequence[int],
              guide: GuidedDecodingParams | None = None) -> None:
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

    @torch.no_grad()
    def propose_after(self, slots: Sequence[int], contexts: Sequence[Sequence[int]],
                      prefixes: Sequence[Sequence[int]]) -> list[list[int]]:
        """Greedy drafts after each ``context + prefix``, with the prefix written into the
        draft cache on the way: ``k + 1`` one-token rounds for every sequence whatever its
        prefix length. Round ``r`` feeds position ``len(context) - 2 + r``: the known token
        while the joined context has one there, else the previous round's argmax; a round
        whose output falls past the joined context gives a draft."""
        k, single = self.num_draft_tokens, self.single_runner
        B = len(slots)
        lengths = [len(c) for c in contexts]
        joined = [list(c) + list(p)[:k] for c, p in zip(contexts, prefixes)]
        # known[b, r]: the token of sequence b at position len(context) - 2 + r, where known
        known = torch.zeros(B, k + 1, dtype=torch.long)
        is_known = torch.zeros(B, k + 1, dtype=torch.bool)
        for b, (n, j) in enumerate(zip(lengths, joined)):
            tail = j[n - 2:n - 1 + k]
            known[b, :len(tail)] = torch.tensor(tail, dtype=torch.long)
            is_known[b, :len(tail)] = True
        known, is_known = known.to(single.device), is_known.to(single.device)
        outs: list[torch.Tensor] = []
        prev = known[:, 0]
        for r in range(k + 1):
            single.load_step(slots, [[0]] * B, [n - 2 + r for n in lengths])
            prev = torch.where(is_known[:, r], known[:, r], prev)  # [B]
            single.input_ids[:B, 0].copy_(prev)
            prev = single.forward_step(B).argmax(-1)  # [B]
            outs.append(prev)
        picks = torch.stack(outs, dim=1).tolist()  # [B, k + 1]
        # round r predicts position len(context) - 1 + r: drafts start at r = len(prefix) + 1
        return [row[len(j) - n + 1:] for row, n, j in zip(picks, lengths, joined)]


@dataclass(slots=True)
class _GrammarSlot:
    """A guided sequence as the grammar drafter follows it."""

    guide: GuidedDecodingParams
    prompt_len: int
    handle: CompileHandle | None  # the compile to create the matcher from (None: created)
    matcher: GrammarMatcher | None = None
    fed: int = 0  # output tokens the matcher has accepted


class GrammarDrafter(Drafter):
    """Drafts the tokens each sequence's grammar forces next, then lets ``then`` continue.

    The drafter keeps its own matcher per guided sequence, created from the decoder's factory
    (the compiled guide is shared through the factory's cache) and advanced by the tokens the
    sequence has accepted. Keeping it apart from the decoder's matchers makes it work the same
    with the eager and the capturable decoder (whose matchers belong to the build's host
    callbacks) and costs one accept per accepted token plus one forced-text query per sequence
    and step (a few microseconds with xgrammar). A compile not finished yet, an unguided
    sequence, or a matcher that refuses an accepted token or raises (llguidance's error state,
    for example: it then stops drafting for that sequence, which the decoder's own matcher
    fails or serves; see :attr:`num_refused`) drafts nothing from the grammar, and never
    affects the other sequences' drafts.

    Every proposal has exactly ``num_draft_tokens`` tokens: the forced prefix (the
    tokenizer's encoding, :class:`~capgraph.grammar.forced.ForcedTokenEncoder`), then
    ``then``'s drafts after it, then, without ``then``, the prefix's last token (or the
    context's) repeated, as :class:`NgramDrafter` pads.

    Args:
        factory: the matcher factory of the decoder that masks the sequences (None where
            no sequence is guided).
        tokenizer: the model's tokenizer (encodes the forced text).
        num_draft_tokens: ``k``.
        then: a drafter that continues after the forced prefix (same ``k``), or None.
        encoder: how forced text becomes tokens (default: ``ForcedTokenEncoder(tokenizer)``).
    """

    def __init__(self, factory: GrammarMatcherFactory | None, tokenizer: object,
                 num_draft_tokens: int, then: Drafter | None = None,
                 encoder: ForcedTokenEncoder | None = None) -> None:
        super().__init__(num_draft_tokens)
        if then is not None and then.num_draft_tokens != num_draft_tokens:
            raise ConfigError(f"GrammarDrafter: the continuing drafter proposes "
                              f"{then.num_draft_tokens} tokens, not {num_draft_tokens}")
        self.factory = factory
        self.then = then
        self.encoder = encoder or ForcedTokenEncoder(tokenizer)
        self._slots: dict[int, _GrammarSlot] = {}
        self.num_forced = 0  #: tokens drafted from the grammar
        #: sequences whose matcher refused an accepted token or raised
        self.num_refused = 0

    def start(self, slot: int, prompt: Sequence[int],
              guide: GuidedDecodingParams | None = None) -> None:
        self._slots.pop(slot, None)
        if guide is not None:
            if self.factory is None:
                raise ConfigError("GrammarDrafter: a guided sequence needs the decoder's "
                                  "matcher factory (built without one)")
            self._slots[slot] = _GrammarSlot(guide, len(prompt), self.factory.compile_async(guide))
        if self.then is not None:
            self.then.start(slot, prompt, guide)

    def forced(self, slot: int, context: Sequence[int]) -> list[int]:
        """The grammar's forced tokens after ``context`` for the sequence in ``slot`` (at most
        ``num_draft_tokens``), after feeding its matcher the output tokens it has not seen."""
        state = self._slots.get(slot)
        if state is None:
            return []
        matcher = self._matcher(state)
        if matcher is None:
            return []
        output = context[state.prompt_len:]
        try:
            while state.fed < len(output):
                if not matcher.accept_token(output[state.fed]):
                    break
                state.fed += 1
            else:
                return self.encoder(matcher, self.num_draft_tokens)
        except Exception:  # noqa: BLE001 - this drafter's own matcher: it drafts no more
            pass
        self.num_refused += 1
        del self._slots[slot]
        return []

    def _matcher(self, state: _GrammarSlot) -> GrammarMatcher | None:
        if state.matcher is None and state.handle is not None and state.handle.done() \
                and self.factory is not None:
            handle, state.handle = state.handle, None
            try:
                state.matcher = self.factory.create_from_compiled(
                    handle.result(0.0, backend=self.factory.backend_name))
            except Exception:  # noqa: BLE001 - the decoder reports the guide's failure
                return None
        return state.matcher

    def propose(self, slots: Sequence[int], contexts: Sequence[Sequence[int]]) -> list[list[int]]:
        k = self.num_draft_tokens
        prefixes = [self.forced(s, c) for s, c in zip(slots, contexts)]
        self.num_forced += sum(len(p) for p in prefixes)
        if self.then is not None:
            rests = self.then.propose_after(slots, contexts, prefixes)
            return [(p + r)[:k] for p, r in zip(prefixes, rests)]
        out = []
        for p, c in zip(prefixes, contexts):
            pad = p[-1] if p else c[-1]
            out.append(p + [pad] * (k - len(p)))
        return out

    def release(self, slot: int) -> None:
        """The sequence in ``slot`` finished: forget its matcher."""
        self._slots.pop(slot, None)
        if self.then is not None:
            self.then.release(slot)
