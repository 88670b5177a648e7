"""What a guide means, the same on both backends and every bundled tokenizer: special tokens are
never grammar text, JSON whitespace modes, ECMA-262 regex classes."""

from __future__ import annotations

import json

import pytest

from capgraph import GuidedDecodingParams, GuideType
from capgraph.bitmask import allocate_host_bitmask
from capgraph.grammar.llguidance_backend import available as llg_available
from capgraph.tokenizers import BUNDLED_TOKENIZERS, encode_continuation, special_token_ids
from conftest import bits_of

ALL_TOKENIZERS = list(BUNDLED_TOKENIZERS)
needs_llg = pytest.mark.skipif(not llg_available(),
                               reason="llguidance extra not installed (pip install capgraph[llguidance])")
BACKENDS = ["xgrammar", pytest.param("llguidance", marks=needs_llg)]


def allowed_ids(factory, matcher) -> set[int]:
    """The ids the matcher's filled bitmask row allows."""
    vocab = factory.config.vocab_size_padded
    mask = allocate_host_bitmask(1, vocab)
    matcher.fill_next_token_bitmask(mask, 0)
    return set(bits_of(mask[0], vocab).nonzero().flatten().tolist())


def force(factory, tok, params: GuidedDecodingParams, text: str):
    """A matcher for ``params`` that has accepted ``text``'s tokens (each one must be accepted)."""
    matcher = factory.create(params)
    for i, t in enumerate(encode_continuation(tok, text)):
        assert matcher.accept_token(t), f"token {i} ({t}) of {text!r} was refused"
    return matcher


def accepts(factory, tok, params: GuidedDecodingParams, text: str) -> bool:
    """Whether ``text`` is accepted token by token and the stop token may follow it."""
    matcher = factory.create(params)
    for t in encode_continuation(tok, text):
        if not matcher.accept_token(t):
            return False
    return matcher.accept_token(factory.config.stop_token_ids[0])


# --- special tokens ----------------------------------------------------------------------------

_STRING_SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}
_ANY_TEXT_TAG = {"type": "structural_tag", "format": {
    "type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}}

# (guide type, backend) -> (params, text that leaves the matcher inside free text, may end there)
FREE_TEXT_STATES = {
    ("JSON", "xgrammar"): (GuidedDecodingParams.json(), '{"a": "x', False),
    ("JSON", "llguidance"): (GuidedDecodingParams.json(), '{"a": "x', False),
    ("JSON_SCHEMA", "xgrammar"): (GuidedDecodingParams.json_schema(_STRING_SCHEMA), '{"a": "x',
                                  False),
    ("JSON_SCHEMA", "llguidance"): (GuidedDecodingParams.json_schema(_STRING_SCHEMA),
                                    '{"a": "x', False),
    ("REGEX", "xgrammar"): (GuidedDecodingParams.regex(".*"), "x", True),
    ("REGEX", "llguidance"): (GuidedDecodingParams.regex(".*"), "x", True),
    ("EBNF_GRAMMAR", "xgrammar"): (GuidedDecodingParams.ebnf('root ::= "<" [^>]* ">"'), "<x",
                                   False),
    ("EBNF_GRAMMAR", "llguidance"): (GuidedDecodingParams.ebnf('start: "<" /[^>]*/ ">"'), "<x",
                                     False),
    ("STRUCTURAL_TAG", "xgrammar"): (GuidedDecodingParams.structural_tag(
        json.dumps(_ANY_TEXT_TAG)), "<a>x", False),
}


@pytest.mark.parametrize("tok_name", ALL_TOKENIZERS)
@pytest.mark.parametrize("guide_backend", list(FREE_TEXT_STATES),
                         ids=lambda k: f"{k[0]}-{k[1]}")
def test_special_tokens_are_never_grammar_text(factory_cache, tokenizer_cache, tok_name,
                                               guide_backend):
    """Inside free text (a JSON string, a regex's ``.*``, an EBNF character class, a structural
    tag's any_text) the mask allows no special token of the tokenizer; a stop token is allowed
    exactly where the grammar may end, and ordinary text stays allowed."""
    guide_type, backend = guide_backend
    if backend == "llguidance" and not llg_available():
        pytest.skip("llguidance extra not installed")
    params, text, may_end = FREE_TEXT_STATES[guide_backend]
    tok = tokenizer_cache(tok_name)
    factory = factory_cache(tok_name, backend)
    allowed = allowed_ids(factory, force(factory, tok, params, text))
    stops = set(factory.config.stop_token_ids)
    specials = special_token_ids(tok)
    assert len(specials) >= 3
    leaked = sorted((allowed & specials) - stops)
    assert not leaked, f"{len(leaked)} special tokens allowed, e.g. " \
                       f"{tok.convert_ids_to_tokens(leaked[:5])}"
    assert bool(allowed & stops) == may_end
    assert set(encode_continuation(tok, "y")[:1]) <= allowed, "ordinary text was masked"


def test_respelled_vocabulary_changes_only_special_tokens(tokenizer_cache):
    """The xgrammar vocabulary differs from xgrammar's own reading of the tokenizer only at
    special ids, whose text is empty (special to xgrammar, never allowed by a grammar), or
    spelled with a 0xFF lead byte no grammar text contains where a tag places them; stop tokens
    stay stop tokens."""
    import xgrammar as xgr

    from capgraph import GuidedDecodingConfig
    from capgraph.grammar.xgrammar_backend import SPECIAL_SPELLING_PREFIX, build_tokenizer_info

    tok = tokenizer_cache("qwen")
    config = GuidedDecodingConfig.from_tokenizer(tok, vocab_size_padded=len(tok) + 5)
    start = tok.convert_tokens_to_ids("<|im_start|>")
    info = build_tokenizer_info(config)
    placing = build_tokenizer_info(config, placeable={start})
    theirs = xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=config.vocab_size_padded,
        stop_token_ids=config.stop_token_ids).decoded_vocab
    specials = special_token_ids(tok)
    for ours in (info.decoded_vocab, placing.decoded_vocab):
        assert len(ours) == len(theirs) == config.vocab_size_padded
        assert {i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b} == specials
    assert set(info.special_token_ids) == specials - set(config.stop_token_ids) \
        | set(range(len(tok), config.vocab_size_padded))
    assert placing.decoded_vocab[start] == SPECIAL_SPELLING_PREFIX + b"<|im_start|>"
    assert info.stop_token_ids == placing.stop_token_ids == config.stop_token_ids


@pytest.mark.parametrize("by", ["name", "id"])
def test_structural_tag_token_element_places_a_special_token(factory_cache, tokenizer_cache, by):
    """A structural tag's ``token`` element, naming a special token by string or id, allows
    exactly that token at its place; the tag's text after it still cannot produce it."""
    tok = tokenizer_cache("qwen")
    factory = factory_cache("qwen")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    tag = {"type": "structural_tag", "format": {"type": "sequence", "elements": [
        {"type": "token", "token": "<|im_start|>" if by == "name" else start},
        {"type": "const_string", "value": "assistant\n"},
        {"type": "any_text"}]}}
    matcher = factory.create(GuidedDecodingParams.structural_tag(json.dumps(tag)))
    assert allowed_ids(factory, matcher) == {start}
    assert matcher.accept_token(start)
    for t in encode_continuation(tok, "assistant\nhello"):
        assert matcher.accept_token(t)
    allowed = allowed_ids(factory, matcher)
    assert start not in allowed and not (allowed & special_token_ids(tok)) - {tok.eos_token_id}
    assert not matcher.accept_token(start)


@pytest.mark.parametrize("guide_type", [GuideType.REGEX, GuideType.EBNF_GRAMMAR])
def test_special_token_text_in_a_guide_is_plain_text(factory_cache, tokenizer_cache, guide_type):
    """A guide that spells a special token's text (``<|im_start|>``) matches that text as
    ordinary characters: the special token itself is never allowed for it."""
    tok = tokenizer_cache("qwen")
    factory = factory_cache("qwen")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    guide = "<\\|im_start\\|>" if guide_type is GuideType.REGEX else 'root ::= "<|im_start|>"'
    matcher = factory.create(GuidedDecodingParams(guide_type, guide))
    allowed = allowed_ids(factory, matcher)
    assert start not in allowed and allowed
    assert not matcher.accept_token(start)


def test_a_placed_special_token_is_the_only_one_a_tags_free_text_can_reach(factory_cache,
                                                                            tokenizer_cache):
    """The documented limit of placing: a special token a structural tag places by a ``token``
    element may also appear inside that tag's any_text content (xgrammar matches it as any
    bytes); no other special token can, and the same text under a tag that places nothing
    allows none."""
    tok = tokenizer_cache("qwen")
    factory = factory_cache("qwen")
    start = tok.convert_tokens_to_ids("<|im_start|>")
    free = {"type": "tag", "begin": "<a>", "content": {"type": "any_text"}, "end": "</a>"}
    specials = special_token_ids(tok)
    for head, text in (([{"type": "token", "token": "<|im_start|>"}], "<a>x"), ([], "<a>x")):
        tag = {"type": "structural_tag", "format": {"type": "sequence",
                                                     "elements": [*head, free]}}
        matcher = factory.create(GuidedDecodingParams.structural_tag(json.dumps(tag)))
        if head:
            assert matcher.accept_token(start)
        for t in encode_continuation(tok, text):
            assert matcher.accept_token(t)
        reached = allowed_ids(factory, matcher) & specials
        assert reached <= ({start} if head else set()), tok.convert_ids_to_tokens(sorted(reached))
