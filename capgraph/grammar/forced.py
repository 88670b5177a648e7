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
from .forced_bound import forced_text_bound, grammar_hides_bytes

__all__ = ["ForcedTokenEncoder", "forced_text_bound", "grammar_hides_bytes",
           "MAX_FORCED_TEXT_BYTES", "MAX_FORCED_WALK_MS"]


class ForcedTokenEncoder:
    """Encodes a matcher's forced text with a Hugging Face tokenizer.

    Args:
        tokenizer: the tokenizer the model was trained with (its ``encode`` is called with
            ``add_special_tokens=False``; a dummy-prefix space is kept off, as
            :func:`capgraph.tokenizers.encode_continuation` does).
        max_bytes_per_token: bytes of forced text asked for per wanted token (the text is
            cut to this before it is encoded, so a long forced run costs no more to encode;
            the backend's search for it is bounded per grammar, see below).
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
        self._decode = getattr(tokenizer, "decode", None)
        self._probe_text = self._decoded(probe) if dummy else ""

    def _encode_text(self, text: str) -> list[int]:
        # forced text that spells a special token ("[INST]", "</s>") is encoded as text
        from ..tokenizers import encode_text
        if self._probe is None:
            return encode_text(self.tokenizer, text)
        ids = encode_text(self.tokenizer, "\n" + text)
        n = len(self._probe)
        return ids[n:] if ids[:n] == self._probe else []  # (no clean split: no drafts)

    def _decoded(self, ids: list[int]) -> str:
        """The text of ``ids`` as a user's ``decode`` gives it (no clean-up of spaces)."""
        assert self._decode is not None
        try:
            return str(self._decode(ids, clean_up_tokenization_spaces=False))
        except TypeError:
            return str(self._decode(ids))

    def _spelled_prefix(self, ids: list[int], text: str) -> list[int]:
        """The longest prefix of ``ids`` whose text is a prefix of ``text``. A tokenizer's
        encoding does not always spell its input: a normalizer rewrites it (Qwen's NFC turns
        ``"e\\u0301"`` into ``"é"``; sentencepiece reads a literal ``"▁"`` as a space), and
        such tokens are not the forced text, so they are never drafted. The continuation's
        text is read after the newline the dummy-prefix trick encodes, so a first token's
        leading space is kept as the grammar sees it."""
        if self._decode is None or not ids:
            return ids
        for k in range(len(ids), 0, -1):
            if self._probe is None:
                spelled = self._decoded(ids[:k])
            else:
                spelled = self._decoded(self._probe + ids[:k])
                if not spelled.startswith(self._probe_text):
                    return []
                spelled = spelled[len(self._probe_text):]
            if text.startswith(spelled):
                return ids[:k]
        return []

    def encode(self, forced: bytes, max_tokens: int) -> list[int]:
        """At most ``max_tokens`` token ids of the tokenizer's encoding of ``forced``
        (whole UTF-8 characters), asked for with ``max_tokens * max_bytes_per_token`` bytes;
        cut before the first token that does not spell the forced text (:meth:`_spelled_prefix`)."""
        if max_tokens <= 0 or not forced:
            return []
        text = forced.decode("utf-8", "replace")
        ids = self._encode_text(text)
        reached_end = len(forced) < max_tokens * self.max_bytes_per_token
        if len(ids) <= max_tokens and reached_end and not self.keep_last:
            ids = ids[:-1]
        elif len(ids) > max_tokens or not reached_end:
            # the bound cut the text: its last token may be cut short, never draft it
            ids = ids[:min(max_tokens, len(ids) - 1)]
        return self._spelled_prefix(ids, text)

    def __call__(self, matcher: GrammarMatcher, max_tokens: int) -> list[int]:
        """The forced tokens of ``matcher`` at its current state (unchanged), at most
        ``max_tokens``; empty where nothing is forced."""
        if max_tokens <= 0:
            return []
        forced = matcher.forced_bytes(max_tokens * self.max_bytes_per_token)
        return self.encode(forced, max_tokens) if forced else []


# --- how much forced text capgraph asks xgrammar for ----------------------------------------
#
# xgrammar's jump-forward search walks the forced text to its end, with no length bound
# (``root ::= "ab" root``: it ran out of memory after 16 s; doubling rules: 2^24 bytes;
# ``r ::= "[" r "]" | "x"``: one "]" per "[" written, so as long as the output's nesting).
# :func:`~capgraph.grammar.forced_bound.forced_text_bound` bounds the forced text of every
# state of a grammar from the grammar alone; the xgrammar matcher asks for forced text only
# where that is at most :data:`MAX_FORCED_TEXT_BYTES`.

#: Grammars whose forced text may be longer than this (bytes, at any state:
#: :func:`~capgraph.grammar.forced_bound.forced_text_bound`) get no forced text; the
#: bundled corpus's largest is 3196, the JSON grammar's 12
#: (``python -m capgraph.grammar.forced_bound``).
MAX_FORCED_TEXT_BYTES = 4096

#: A jump-forward walk longer than this (ms) ends forced text for every matcher of its
#: grammar. The walk's length is bounded by :data:`MAX_FORCED_TEXT_BYTES`; its cost per byte
#: is that of xgrammar's parser, which grows with the grammar's ambiguity.
MAX_FORCED_WALK_MS = 10.0
