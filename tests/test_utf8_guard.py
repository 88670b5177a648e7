"""The UTF-8 guard of xgrammar matchers (capgraph.grammar.utf8): its tables against Python's
own UTF-8 decoder, and masks that never let a sampler spell bytes that are not UTF-8, on the
Python and C++ builds, with drafts, rollbacks and the native host node."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest
import torch

import hostfunc
from capgraph import GuidedDecodingParams
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.errors import MatcherError
from capgraph.grammar.utf8 import INVALID, RING, START, Utf8Guard, utf8_tables
from capgraph.requests import GuidedRequest

# bytes at every boundary of UTF-8's ranges
EDGES = [0x00, 0x41, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xC0, 0xC1, 0xC2, 0xDF, 0xE0,
         0xE1, 0xEC, 0xED, 0xEE, 0xEF, 0xF0, 0xF1, 0xF3, 0xF4, 0xF5, 0xFF]


def valid_prefix(data: bytes) -> bool:
    """Whether ``data`` starts some valid UTF-8 text: Python's strict decoder takes it, or it
    with up to three more continuation bytes (one at each bound of the ranges a second byte
    may be restricted to)."""
    for n in range(4):
        for tail in itertools.product((0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF), repeat=n):
            try:
                (data + bytes(tail)).decode("utf-8", errors="strict")
                return True
            except UnicodeDecodeError:
                pass
    return False


def test_tables_agree_with_pythons_utf8_decoder():
    """Every byte string of up to four bytes drawn from the bytes at UTF-8's range
    boundaries, split into two tokens every way: the guard takes the second token after the
    first exactly where the whole is the start of valid UTF-8, and the first alone where it
    is; a token without text is taken only at a character boundary."""
    strings = [bytes(p) for n in range(1, 5) for p in itertools.product(EDGES, repeat=n)
               if n < 4 or random.Random(sum(p)).random() < 0.05]
    vocab = sorted({s[:k] for s in strings for k in range(1, len(s) + 1)} |
                   {s[k:] for s in strings for k in range(len(s))})
    index = {v: i for i, v in enumerate(vocab)}
    textless = len(vocab)
    tables = utf8_tables(vocab + [b""], len(vocab) + 3)
    for s in strings:
        first = tables.trans[START, index[s[:1]]]
        assert (first != INVALID) == valid_prefix(s[:1]), s
        for k in range(1, len(s)):
            head, tail = s[:k], s[k:]
            state = tables.trans[START, index[head]]
            if state == INVALID:
                continue
            after = tables.trans[state, index[tail]]
            assert (after != INVALID) == valid_prefix(s), (head, tail)
            bit = (int(tables.allowed[state, index[tail] // 32]) >> (index[tail] % 32)) & 1
            assert bit == (after != INVALID)
            assert (tables.trans[state, textless] != INVALID) == (state == START)
    assert not tables.allowed[INVALID].any()


def test_guard_ring_and_rollback_past_its_history():
    tables = utf8_tables([b"a", b"\xc3", b"\xa9"], 3)
    guard = Utf8Guard(tables)
    for token in (1, 2) * (RING // 2 + 3):  # "é" again and again: START, pending, START ...
        state = guard.next_state(token)
        assert state != INVALID
        guard.push(state)
    assert guard.state() == START
    guard.pop(1)
    assert guard.state() == 1  # inside "é"
    assert guard.next_state(0) == INVALID and guard.next_state(2) == START
    with pytest.raises(MatcherError, match="past the UTF-8 guard's history"):
        guard.pop(RING - 1)  # (with the one above: RING tokens back)
    guard.pop(RING - 2)
    assert guard.count == 2 * (RING // 2 + 3) - (RING - 1)


def test_rollbacks_in_a_row_reach_no_further_than_the_ring():
    """After more tokens than the ring holds, two rollbacks each within ``RING - 1`` tokens
    but together past the oldest state the ring still holds: the second raises and changes
    nothing; one back to that state restores it, and pushes after it move the floor on."""
    tables = utf8_tables([b"a", b"\xc3", b"\xa9"], 3)
    guard = Utf8Guard(tables)
    n = 2 * RING + 68  # "é" again and again: the state after k tokens is 1 for odd k
    for k in range(n):
        guard.push(guard.next_state(1 + k % 2))
    guard.pop(1000)
    with pytest.raises(MatcherError, match=rf"history \({RING - 1 - 1000} tokens\)"):
        guard.pop(500)
    assert guard.count == n - 1000
    guard.pop(RING - 1 - 1000)
    assert guard.count == n - (RING - 1) and guard.state() == (guard.count % 2)
    with pytest.raises(MatcherError, match=r"history \(0 tokens\)"):
        guard.pop(1)
    guard.push(guard.next_state(1 + guard.count % 2))
    guard.pop(1)  # (the state it pushed over is still the floor's)
    assert guard.count == n - (RING - 1) and guard.state() == (guard.count % 2)


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


@pytest.fixture(scope="module")
def byte_ids(tekken):
    import xgrammar as xgr
    vocab = xgr.TokenizerInfo.from_huggingface(tekken).decoded_vocab
    return {v[0]: i for i, v in enumerate(vocab) if len(v) == 1}


def decoder_for(factory, build: str, drafts: int = 0) -> GuidedDecoder:
    config = dataclasses.replace(factory.config, native_build=build)
    return GuidedDecoder(config, 1, drafts, factory=factory)


def rows_allow(logits: torch.Tensor, row: int, token: int) -> bool:
    return bool(torch.isfinite(logits[row, token]))


@pytest.mark.parametrize("build", ["auto", "off"])
def test_a_draft_that_is_not_utf8_is_refused_and_the_matcher_stays_in_step(factory, byte_ids,
                                                                          build):
    """A request's new token is ED (a lead byte) and its drafts A0 (which would spell a
    surrogate: xgrammar takes it) then 80: row 0 masks A0, the draft is refused like one
    the grammar refuses (its rows unguided, one token advanced), and after the target
    accepts no draft the next mask equals a fresh matcher's after ED."""
    params = GuidedDecodingParams.regex(".+")
    V = factory.config.vocab_size_padded
    ed, a0, x80 = byte_ids[0xED], byte_ids[0xA0], byte_ids[0x80]
    dec = decoder_for(factory, build, drafts=2)
    dec.add_batch([GuidedRequest.context(1, 0, params)])
    dec.execute(torch.zeros(1, V))
    dec.add_batch([GuidedRequest.generation(1, 0, params, ed, draft_tokens=[a0, x80])])
    logits = torch.zeros(3, V)
    assert dec.execute(logits) == []
    assert not rows_allow(logits, 0, a0) and rows_allow(logits, 0, x80)
    assert dec.num_advanced_tokens[0] == 1 and dec.token_mask_host[:3].tolist() == [1, 0, 0]
    dec.add_batch([GuidedRequest.generation(1, 0, params, x80, num_accepted_draft_tokens=0)],
                  0)
    dec.rollback_rejected_tokens()
    got = torch.zeros(1, V)
    assert dec.execute(got) == []
    ref = decoder_for(factory, "off")
    ref.add_batch([GuidedRequest.context(1, 0, params)])
    ref.execute(torch.zeros(1, V))
    for token in (ed, x80):
        ref.add_batch([GuidedRequest.generation(1, 0, params, token)])
        want = torch.zeros(1, V)
        assert ref.execute(want) == []
    assert torch.equal(want, got)
    assert not rows_allow(got, 0, byte_ids[0x41])  # inside a character: a continuation only
    dec.close()
    ref.close()


@pytest.mark.parametrize("build", ["auto", "off"])
@pytest.mark.parametrize("guide", [GuidedDecodingParams.regex(".{1,6}"),
                                   GuidedDecodingParams.regex("[^a]+"),
                                   GuidedDecodingParams.json_schema({"type": "string"})])
def test_walks_under_the_masks_spell_utf8(factory, byte_ids, build, guide):
    """Random walks under the masks, biased to single byte tokens (the ones that can split a
    character), with random drafts: every output is valid UTF-8 and every row's allowed
    bytes go on validly from the text before it."""
    V = factory.config.vocab_size_padded
    byte_tokens = list(byte_ids.values())
    token_byte = {i: bytes([b]) for b, i in byte_ids.items()}
    vocab = factory.tokenizer_info.decoded_vocab
    eos = factory.config.stop_token_ids[0]
    rng = random.Random(7)
    dec = decoder_for(factory, build, drafts=2)
    for walk in range(6):
        dec.add_batch([GuidedRequest.context(walk, 0, guide)])
        logits = torch.zeros(1, V)
        assert dec.execute(logits) == []
        text = b""
        for _ in range(12):
            allowed = torch.isfinite(logits[0]).nonzero().flatten().tolist()
            singles = [t for t in allowed if t in token_byte]
            for t in singles:  # every allowed byte goes on validly
                assert valid_prefix(text + token_byte[t]), (text, token_byte[t])
            pick = rng.choice(singles or allowed)
            if pick == eos:
                break
            text += vocab[pick]
            assert valid_prefix(text), text
            drafts = [rng.choice(byte_tokens) for _ in range(2)]
            dec.add_batch([GuidedRequest.generation(walk, 0, guide, pick, draft_tokens=drafts,
                                                    num_accepted_draft_tokens=0)])
            dec.rollback_rejected_tokens()
            logits = torch.zeros(3, V)
            assert dec.execute(logits) == []
            logits = logits[:1]
        dec.release(0)
    dec.close()


def test_the_native_nodes_rollbacks_keep_the_guard_in_step(factory, byte_ids, native_ok):
    """Speculative steps replayed through the native host node (its rollbacks of rejected
    drafts in C++) over drafts that split characters into bytes: every target row equals
    the eager Python build's for the same steps, so the guard rolled back with the
    matcher."""
    params = GuidedDecodingParams.regex("(é|ü|x)+")
    V = factory.config.vocab_size_padded
    c3, a9, bc, x = byte_ids[0xC3], byte_ids[0xA9], byte_ids[0xBC], byte_ids[0x78]
    eager = decoder_for(factory, "off", drafts=3)
    capt = CapturableGuidedDecoder(factory.config, 1, 3, factory=factory, host_node="native")
    context = [GuidedRequest.context(1, 0, params)]
    static, counts = torch.zeros(4, V), torch.ones(1, dtype=torch.int32)
    capt.add_batch(context)
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        capt.rollback_rejected_batch(counts)
        capt.execute(static)
    # (new token, drafts, drafts the verification accepted of the step before)
    # texts: "\xc3", "é", "éx\xc3" + "\xbc", "éxüx", "éxüx\xc3" + "\xa9"; drafts that are
    # not UTF-8 after their prefix ("\xbc" after "ü", "\xc3" after "\xc3") are refused
    steps = [(None, None, 0), (c3, [a9, c3, bc], 0), (a9, [x, c3, a9], 0),
             (bc, [bc, x, c3], 2), (x, [c3, c3, a9], 0), (a9, [c3, bc, x], 1)]
    for k, (token, drafts, accepted) in enumerate(steps):
        request = context[0] if token is None else GuidedRequest.generation(
            1, 0, params, token, draft_tokens=drafts, num_accepted_draft_tokens=accepted)
        eager.add_batch([request])
        eager.rollback_rejected_tokens()
        n = eager.requests.num_bitmask_tokens
        want = torch.zeros(4, V)
        assert eager.execute(want[:n]) == [], k
        capt.add_batch([dataclasses.replace(request)])
        counts[0] = accepted + 1
        static.zero_()
        graph.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == [], k
        assert torch.equal(want[:n], static[:n]), k
        assert capt.num_advanced_tokens[0] == eager.num_advanced_tokens[0], k
    stats = capt.host_node_stats
    assert stats.python_runs == 0 and stats.rollback_runs - stats.python_rollback_runs >= 4, \
        stats
    graph.reset()
    capt.close()
    eager.close()


def test_factories_build_the_tables_once_per_vocabulary(factory):
    """The factory's tables: every special and stop token without text (allowed at a
    character boundary only), the lone continuation bytes refused at one."""
    tables = factory.utf8
    eos = factory.config.stop_token_ids[0]
    assert tables.trans[START, eos] == START and tables.trans[1, eos] == INVALID
    assert np.count_nonzero(tables.trans[START] == INVALID) > 64


@pytest.mark.parametrize("build", ["auto", "off"])
def test_a_rollback_of_hundreds_of_drafts_keeps_the_guard(factory, tekken, build):
    """A step of 300 drafts, none accepted: the rollback of 300 tokens stays within the
    guard's history (the decoder refuses more drafts than it keeps), and the next mask is a
    fresh matcher's."""
    from capgraph import ConfigError
    from capgraph.decoder import MAX_DRAFT_TOKENS
    from capgraph.tokenizers import encode_continuation

    with pytest.raises(ConfigError, match="max_num_draft_tokens=1015 exceeds 1014"):
        decoder_for(factory, build, drafts=MAX_DRAFT_TOKENS + 1)
    params = GuidedDecodingParams.regex("a*b")
    V = factory.config.vocab_size_padded
    a, b = (encode_continuation(tekken, t)[0] for t in ("a", "b"))
    dec = decoder_for(factory, build, drafts=300)
    dec.add_batch([GuidedRequest.context(1, 0, params)])
    dec.execute(torch.zeros(1, V))
    dec.add_batch([GuidedRequest.generation(1, 0, params, a, draft_tokens=[a] * 300)])
    assert dec.execute(torch.zeros(301, V)) == [] and dec.num_advanced_tokens[0] == 301
    dec.add_batch([GuidedRequest.generation(1, 0, params, b, num_accepted_draft_tokens=0)], 0)
    dec.rollback_rejected_tokens()
    got = torch.zeros(1, V)
    assert dec.execute(got) == []
    assert dec.grammar_matchers[0].is_terminated() is False
    assert dec.grammar_matchers[0].utf8_guard.count == 2  # ("a", then "b")
    dec.close()


def test_a_guard_held_past_its_matcher_keeps_its_state(factory, native_ok):
    """The guard a matcher hands out (utf8_guard) keeps its C++ memory while it is held:
    after the matcher is collected and other matchers take C++ guards, it reads what it
    read before."""
    import gc

    params = GuidedDecodingParams.regex(".+")
    matcher = factory.create(params)
    matcher.native_handle()
    assert matcher.utf8_guard.native
    c3 = [i for i, v in enumerate(factory.tokenizer_info.decoded_vocab) if v == b"\xc3"][0]
    assert matcher.accept_token(c3)
    guard = matcher.utf8_guard
    del matcher
    gc.collect()
    others = [factory.create(params) for _ in range(50)]
    for m in others:
        m.native_handle()
        m.accept_token(factory.config.stop_token_ids[0] + 1000)
    assert (guard.count, guard.state()) == (1, 1)


@pytest.mark.parametrize("build", ["auto", "off"])
def test_rollbacks_in_a_row_past_the_ring_fail_on_a_long_output(factory, byte_ids, build):
    """A 2100-token output spelled one byte token at a time (the C++ build's guard in C++
    memory, the Python build's in its own), then two rollbacks of the matcher, 1000 and
    500 tokens: the second goes past the oldest state the ring holds and raises
    ``MatcherError`` with nothing moved; rolled back to that state instead, the matcher's
    row equals that of a fresh matcher fed the same tokens (a guard left on a later token's
    state would refuse a valid lead byte, or after text ending in E0 allow an overlong
    continuation)."""
    params = GuidedDecodingParams.regex("€+")
    V = factory.config.vocab_size_padded
    euro = [byte_ids[b] for b in "€".encode()]
    dec = decoder_for(factory, build)
    dec.add_batch([GuidedRequest.context(1, 0, params)])
    dec.execute(torch.zeros(1, V))
    n = 2100
    logits = torch.zeros(1, V)
    for k in range(n):
        dec.add_batch([GuidedRequest.generation(1, 0, params, euro[k % 3])])
        assert dec.execute(logits) == []
    matcher = dec.grammar_matchers[0]
    guard = matcher.utf8_guard
    assert guard.native == (dec.host_build.name != "python")
    matcher.rollback(1000)
    with pytest.raises(MatcherError, match=rf"history \({RING - 1 - 1000} tokens\)"):
        matcher.rollback(500)
    matcher.rollback(RING - 1 - 1000)
    assert guard.count == n - (RING - 1)  # (the oldest state the ring holds)
    fresh = factory.create(params)
    for k in range(guard.count):
        assert fresh.accept_token(euro[k % 3])
    got = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    want = torch.zeros_like(got)
    matcher.fill_next_token_bitmask(got, 0)
    fresh.fill_next_token_bitmask(want, 0)
    assert torch.equal(got, want) and guard.state() == fresh.utf8_guard.state()
    dec.close()
