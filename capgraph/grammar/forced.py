"""Forced text as tokens: what a grammar allows as the only continuation, in the tokenizer's
own encoding, ready to be drafted.

A matcher says which bytes every continuation of its state starts with
(:meth:`~capgraph.grammar.GrammarMatcher.forced_bytes`). Those bytes are encoded here with the
tokenizer itself rather than taken as the backend's token choice (xgrammar's jump-forward
tokens pick the longest token greedily): a trained model emits the tokenizer's encoding, so
that encoding is the one verification most often accepts. A forced token is only ever a
draft: one the model or the mask refuses is rejected by verification, and the output stays
what greedy decoding without drafts gives.
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError
from .base import GrammarMatcher

__all__ = ["ForcedTokenEncoder"]


class ForcedTokenEncoder:
    """Encodes a matcher's forced text with a Hugging Face tokenizer.

    Args:
        tokenizer: the tokenizer the model was trained with (its ``encode`` is called with
            ``add_special_tokens=False``; a dummy-prefix space is kept off, as
            :func:`capgraph.tokenizers.encode_continuation` does).
        max_bytes_per_token: bytes of forced text asked for per wanted token (the text is
            bounded before it is encoded, so a long forced run costs no more than this).
        keep_last: keep the last token of an encoding that reaches the end of the forced
            text. The text after it is free, and the tokenizer may merge that token with
            what the model writes next, so dropping it trades a draft for a likelier
            acceptance; ``bench spec`` measures both.
    """

    def __init__(self, tokenizer: Any, max_bytes_per_token: int = 16,
                 keep_last: bool = True) -> None:
        if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
            raise ConfigError("forced tokens need a tokenizer with an encode() method, got "
                              f"{type(tokenizer).__name__}")
        if max_bytes_per_token < 1:
            raise ConfigError(f"max_bytes_per_token={max_bytes_per_token} must be >= 1")
        self.tokenizer = tokenizer
        self.max_bytes_per_token = max_bytes_per_token
        self.keep_last = keep_last
        # a sentencepiece-style tokenizer prepends a dummy-prefix space to what it encodes:
        # encode "\n" + text and drop the newline's ids, as capgraph.tokenizers'
        # encode_continuation does (probed once here, not per call)
        probe = list(tokenizer.encode("\n", add_special_tokens=False))
        convert = getattr(tokenizer, "convert_ids_to_tokens", None)
        dummy = bool(probe) and convert is not None and \
            str(convert(probe[0])).startswith("\u2581")
        self._probe: list[int] | None = probe if dummy else None

    def _encode_text(self, text: str) -> list[int]:
        if self._probe is None:
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids = list(self.tokenizer.encode("\n" + text, add_special_tokens=False))
        n = len(self._probe)
        return ids[n:] if ids[:n] == self._probe else []  # (no clean split: no drafts)

    def encode(self, forced: bytes, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` token ids of the tokenizer's encoding of ``forced``
        (whole UTF-8 characters), asked for with ``max_tokens * max_bytes_per_token`` bytes."""
        if max_tokens <= 0 or not forced:
            return []
        ids = self._encode_text(forced.decode("utf-8", "replace"))
        reached_end = len(forced) < max_tokens * self.max_bytes_per_token
        if len(ids) <= max_tokens and reached_end and not self.keep_last:
            ids = ids[:-1]
        elif len(ids) > max_tokens or not reached_end:
            # the bound cut the text: its last token may be cut short, never draft it
            ids = ids[:min(max_tokens, len(ids) - 1)]
        return ids

    def __call__(self, matcher: GrammarMatcher, max_tokens: int) -> list[int]:
        """The forced tokens of ``matcher`` at its current state (unchanged), at most
        ``max_tokens``; empty where nothing is forced."""
        if max_tokens <= 0:
            return []
        forced = matcher.forced_bytes(max_tokens * self.max_bytes_per_token)
        return self.encode(forced, max_tokens) if forced else []
