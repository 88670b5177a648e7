"""The text a user decodes is the text the grammar accepted: tokenizer views of the backends
and forced-token drafts, on the bundled tokenizers (reproducers of the tokenizer audit)."""

from __future__ import annotations

import pytest
import torch

from capgraph import GuidedDecodingParams
from capgraph.grammar.forced import ForcedTokenEncoder
from capgraph.tokenizers import encode_continuation


def _allowed(factory, matcher) -> list[int]:
    words = (factory.config.vocab_size_padded + 31) // 32
    bitmask = torch.zeros((1, words), dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    bits = bitmask[0].numpy().view("uint8")
    import numpy as np
    return [int(i) for i in np.nonzero(np.unpackbits(bits, bitorder="little"))[0]]


@pytest.mark.parametrize("name,pattern", [
    ("mistral-sp32k", " [a-z]{1,5}"), ("mistral-sp32k", " a"), ("mistral-sp32k", "  x"),
    ("mistral-sp32k", "a b"), ("qwen", "xe\u0301y"), ("qwen", "x\u212b")])
def test_llguidance_masks_only_tokens_its_parser_accepts(factory_cache, name: str,
                                                         pattern: str) -> None:
    """llguidance tokenizes forced bytes with the tokenizer's encode and allows its first
    token. With sentencepiece's dummy prefix that encode spells an extra space (" a" ->
    "▁", "▁a"): a guide starting with a space panicked at its first mask (" [a-z]{1,5}").
    Qwen's NFC normalizer encodes a forced "e\u0301" as "é", which the mask then allowed
    alone and the parser refused. Every allowed token of the first masks is accepted."""
    pytest.importorskip("llguidance")
    factory = factory_cache(name, "llguidance")
    params = GuidedDecodingParams.regex(pattern)
    prefix = encode_continuation(factory.config.tokenizer, "x") if pattern[0] == "x" else []
    matcher = factory.create(params)
    assert all(matcher.accept_token(t) for t in prefix)
    allowed = _allowed(factory, matcher)
    assert allowed
    for token in allowed[:64]:
        matcher = factory.create(params)
        assert all(matcher.accept_token(t) for t in prefix)
        assert matcher.accept_token(token), factory.config.tokenizer.convert_ids_to_tokens(token)


@pytest.mark.parametrize("name,text", [("qwen", "e\u0301"), ("qwen", "x\u212b!"),
                                       ("mistral-sp32k", "\u2581a"),
                                       ("mistral-sp32k", "a\u2581b"),
                                       ("tekken", '{"k": "caf\u00e9"}'),
                                       ("mistral-sp32k", ' {"a": 1}')])
def test_forced_tokens_spell_the_forced_text(tokenizer_cache, name: str, text: str) -> None:
    """Forced-token drafts are the tokenizer's encoding of the forced text only as far as
    that encoding spells it: Qwen's NFC normalizer turns "e\\u0301" into "é", sentencepiece
    reads a literal "▁" as a space. The drafted ids, decoded after a token as a model's
    continuation, are a prefix of the forced text."""
    tok = tokenizer_cache(name)
    encoder = ForcedTokenEncoder(tok, max_bytes_per_token=64)
    ids = encoder.encode(text.encode(), 8)
    context = encode_continuation(tok, "x")
    before = tok.decode(context)
    spelled = tok.decode(context + ids)
    assert spelled.startswith(before)
    assert text.startswith(spelled[len(before):]), (ids, spelled)
    if name == "tekken" or text.startswith(" "):
        assert spelled[len(before):] == text  # (nothing to cut: the whole text is drafted)


@pytest.mark.parametrize("name", ["mistral-sp32k", "tekken"])
def test_a_decode_that_cleans_up_spaces_is_refused(tokenizer_cache, name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' clean_up_tokenization_spaces turns " ." into "." and " 's" into "'s"
    in decode() (for BPE tokenizers only with its ..._even_though_it_will_corrupt_output
    flag, as a tokenizer_config.json may set it): a guided JSON string "a ." would reach the
    user as "a.". Such a tokenizer is refused at from_tokenizer with a ConfigError naming the
    setting; the bundled tokenizers as they load, and with clean-up asked for but ignored
    (BPE without the flag), pass."""
    from capgraph import GuidedDecodingConfig
    from capgraph.errors import ConfigError

    tok = tokenizer_cache(name)
    GuidedDecodingConfig.from_tokenizer(tok)
    monkeypatch.setattr(tok, "clean_up_tokenization_spaces", True)
    GuidedDecodingConfig.from_tokenizer(tok)  # (ignored for BPE: decode is unchanged)
    monkeypatch.setattr(
        tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", True)
    ids = encode_continuation(tok, '"a ."')
    assert tok.decode(ids, skip_special_tokens=True) == '"a."'  # the hole itself
    with pytest.raises(ConfigError, match="clean_up_tokenization_spaces"):
        GuidedDecodingConfig.from_tokenizer(tok)


@pytest.mark.parametrize("name,pattern,text", [
    ("mistral-sp32k", "a</s>", "a</s>"),          # the stop token's text
    ("tekken", r"a\[INST\]", "a[INST]"),          # a control token's text
    ("qwen", r"a<\|im_start\|>b", "a<|im_start|>b"),
])
def test_llguidance_forced_text_that_spells_a_special_token_stays_text(
        factory_cache, tokenizer_cache, name: str, pattern: str, text: str) -> None:
    """llguidance tokenizes the text a grammar forces with the tokenizer's encode, which
    reads "</s>" / "[INST]" / "<|im_start|>" as the special token; its mask then allowed
    only that id: the stop token ended "a</s>" after "a", and skip_special_tokens dropped
    the others (or the parser refused the id it had just allowed). Now no special id is
    allowed there, and taking the first allowed token each step spells the guide's text."""
    pytest.importorskip("llguidance")
    from capgraph.tokenizers import special_token_ids

    tok = tokenizer_cache(name)
    factory = factory_cache(name, "llguidance")
    stops = set(factory.config.stop_token_ids)
    specials = special_token_ids(tok)
    matcher = factory.create(GuidedDecodingParams.regex(pattern))
    ids = encode_continuation(tok, "a")
    assert all(matcher.accept_token(t) for t in ids)
    for _ in range(len(text) + 1):
        allowed = set(_allowed(factory, matcher))
        assert not (allowed & specials) - stops, tok.convert_ids_to_tokens(sorted(allowed)[:4])
        if allowed <= stops:
            break
        token = min(allowed - stops)
        assert matcher.accept_token(token)
        ids.append(token)
    assert tok.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("name", ["mistral-sp32k", "tekken", "qwen"])
def test_decode_continuation_keeps_a_leading_space(tokenizer_cache, name: str) -> None:
    """A sentencepiece decode() drops the first leading space of what it decodes: ["▁a"],
    which a guide " a" accepts, decodes to "a". decode_continuation gives the text the
    grammar matched, on every tokenizer."""
    from capgraph.tokenizers import decode_continuation

    tok = tokenizer_cache(name)
    for text in [" a", "  x", "a", ' {"k": 1}', "\n b", "é 日", ""]:
        ids = encode_continuation(tok, text)
        assert decode_continuation(tok, ids) == text
    if name == "mistral-sp32k":
        assert tok.decode(encode_continuation(tok, " a")) == "a"  # the hole itself


def test_generate_text_keeps_a_guided_leading_space(tokenizer_cache) -> None:
    """capgraph.generate's text is the text the guide accepted: a regex " [a-z]{1,3}" on the
    sentencepiece tokenizer (whose decode() strips the first leading space) gave "abc"."""
    import re

    from capgraph.runtime import generate, tiny_llama

    sp = tokenizer_cache("mistral-sp32k")
    model = tiny_llama(len(sp), seed=0)
    pattern = " [a-z]{1,3}"
    out = generate(["Say:", "Go"], GuidedDecodingParams.regex(pattern), model=model,
                   tokenizer=sp, max_new_tokens=8)
    for result in out:
        assert result.finish_reason == "stop", result
        assert re.fullmatch(pattern, result.text), (result.text, result.tokens)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
@pytest.mark.parametrize("pattern", [" ", "\n", " \t"])
def test_a_whitespace_regex_is_a_guide(factory_cache, backend: str, pattern: str) -> None:
    """A regex of whitespace only (one space, a newline) is a guide, not an empty one: it
    compiles, and its output decodes to exactly that text."""
    if backend == "llguidance":
        pytest.importorskip("llguidance")
    factory = factory_cache("tekken", backend)
    tok = factory.config.tokenizer
    matcher = factory.create(GuidedDecodingParams.regex(pattern))
    ids = encode_continuation(tok, pattern)
    assert all(matcher.accept_token(t) for t in ids)
    assert matcher.accept_token(factory.config.stop_token_ids[0])
    assert tok.decode(ids, skip_special_tokens=True) == pattern


@pytest.mark.parametrize("kind,guide", [
    ("regex", "x\u2581y"), ("regex", "a\\u2581+b"),
    ("json_schema", '{"const": "a\u2581b"}'), ("json_schema", '{"enum": ["a\\u2581"]}'),
    ("json_schema", '{"type": "string", "pattern": "^\\\\u2581$"}')])
def test_llguidance_refuses_u2581_a_sentencepiece_encode_reads_as_space(
        factory_cache, kind: str, guide: str) -> None:
    """sentencepiece reads a literal "▁" as a space, so llguidance's tokenization of forced
    text gave the space token where a guide forced "▁": its mask allowed that token and its
    parser refused it, failing the request at that step. Such a guide is refused at compile
    with a named error on llguidance (xgrammar places "▁" as its three byte tokens); where
    the tokenizer spells "▁" (Tekken) it compiles."""
    pytest.importorskip("llguidance")
    from capgraph import UnsupportedGuideError
    params = GuidedDecodingParams(guide_type=kind, guide=guide)
    with pytest.raises(UnsupportedGuideError, match="U\\+2581"):
        factory_cache("mistral-sp32k", "llguidance").compile(params)
    factory_cache("tekken", "llguidance").compile(params)
    factory_cache("mistral-sp32k", "xgrammar").compile(params)


def test_llguidance_class_around_u2581_compiles_and_masks_exactly(factory_cache) -> None:
    """Only a guide that writes "▁" is refused: a class around it (nothing forced there)
    compiles on sentencepiece, and every token its first mask allows is accepted."""
    pytest.importorskip("llguidance")
    factory = factory_cache("mistral-sp32k", "llguidance")
    params = GuidedDecodingParams.regex("[\u2580-\u2582]")
    allowed = _allowed(factory, factory.create(params))
    assert allowed
    for token in allowed:
        assert factory.create(params).accept_token(token)
