"""GuidedDecoder end to end on CPU: teacher forcing, speculative rollback, mixed batches, dead ends."""

from __future__ import annotations

import dataclasses
import os
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capgraph import (GuidedDecodingConfig, GuidedDecodingParams, GuideType, LayoutError,
                      TensorArgError)
from capgraph.bitmask import allocate_host_bitmask
from capgraph.errors import UnsupportedGuideError
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest, GuidedRequests
from capgraph.tokenizers import encode_continuation
from cases import CASES, public_cases
from conftest import assert_steps_agree, bits_of

TEACHER_CASES = [c for c in CASES if c.params.guide_type in
                 (GuideType.JSON_SCHEMA, GuideType.REGEX, GuideType.EBNF_GRAMMAR)]


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


def make_decoder(factory, seqs=8, drafts=0) -> GuidedDecoder:
    return GuidedDecoder(factory.config, seqs, drafts, factory=factory)


def reference_masks(factory, params, tokens):
    """Masks a matcher driven directly gives before each token (None once terminated)."""
    V = factory.config.vocab_size_padded
    matcher = factory.create(params)
    masks = []
    for t in list(tokens) + [None]:
        if matcher.is_terminated():
            masks.append(None)
        else:
            row = allocate_host_bitmask(1, V)
            matcher.fill_next_token_bitmask(row, 0)
            masks.append(bits_of(row[0], V))
        if t is not None:
            assert matcher.accept_token(t)
    return masks


def accepts_whole(factory, params, tokens) -> bool:
    """Whether a directly driven matcher accepts every token (xgrammar's strict JSON mode
    rejects properties a schema does not list, which some public instances have); False for a
    schema the backend refuses (a constraint it would not enforce)."""
    try:
        matcher = factory.create(params)
    except UnsupportedGuideError:
        return False
    return all(matcher.accept_token(t) for t in tokens)


def step_logits(rows: int, V: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g)


# -- teacher forcing -------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["hand-written", "public"])
def test_teacher_forced_batch_masks_equal_a_direct_matcher(factory, tekken, which):
    """Step by step over a batch of schema/regex/EBNF requests (hand-written cases, and public
    JSONSchemaBench schemas with their valid instances), the finite logits of every guided row
    are exactly the tokens a directly driven matcher allows, and the text's next token is
    always finite."""
    cases = TEACHER_CASES if which == "hand-written" else [
        c for c in public_cases() if accepts_whole(factory, c.params, encode_continuation(tekken, c.valid))]
    assert len(cases) >= 5
    V = factory.config.vocab_size_padded
    eos = factory.config.stop_token_ids[0]
    texts = [encode_continuation(tekken, c.valid) + [eos] for c in cases]
    texts = [t if len(t) <= 40 else t[:40] for t in texts]  # long public instances: a prefix
    refs = [reference_masks(factory, c.params, t) for c, t in zip(cases, texts)]
    dec = make_decoder(factory, seqs=len(cases))
    step = 0
    while True:
        live = [i for i, t in enumerate(texts) if step <= len(t)]
        if not live:
            break
        reqs = []
        for i in live:
            params = cases[i].params
            reqs.append(GuidedRequest.context(i, i, params) if step == 0 else
                        GuidedRequest.generation(i, i, params, texts[i][step - 1]))
        dec.add_batch(reqs)
        logits = step_logits(len(reqs), V, step)
        assert dec.execute(logits) == []
        for row, i in enumerate(live):
            expect = refs[i][step]
            finite = torch.isfinite(logits[row])
            if expect is None:
                assert finite.all()
            else:
                assert torch.equal(finite, expect), f"request {i} step {step}"
                if step < len(texts[i]):
                    assert finite[texts[i][step]], "the text's next token was masked"
                assert torch.isneginf(logits[row][~expect]).all()
        step += 1
    assert all(dec.grammar_matchers[i].is_terminated() for i in range(len(texts))
               if texts[i][-1] == eos)


# -- speculative decoding vs one token per step ----------------------------------------------

def run_plain(factory, params, tokens):
    """One token per step; returns masks by position and the final matcher."""
    V = factory.config.vocab_size_padded
    dec = make_decoder(factory, seqs=1)
    masks = {}
    for p in range(len(tokens) + 1):
        req = (GuidedRequest.context(0, 0, params) if p == 0 else
               GuidedRequest.generation(0, 0, params, tokens[p - 1]))
        dec.add_batch([req])
        assert dec.execute(torch.zeros(1, V)) == []
        masks[p] = dec.bitmask_host[0].clone() if dec.token_mask_host[0] else None
        if dec.grammar_matchers[0].is_terminated():
            break
    return masks, dec


def run_speculative(factory, params, tokens, rng: random.Random, k: int):
    """Drafts partly from the text, partly random; random acceptance. Returns guided rows by
    position, the decoder and the failures seen."""
    V = factory.config.vocab_size_padded
    tok_vocab = factory.config.tokenizer_vocab_size
    dec = make_decoder(factory, seqs=2, drafts=k)
    slot = 1
    dec.add_batch([GuidedRequest.context(5, slot, params)])
    failed = dec.execute(torch.zeros(1, V))
    masks = {0: dec.bitmask_host[0].clone() if dec.token_mask_host[0] else None}
    p, accepted_prev = 0, 0
    while p < len(tokens):
        n_text = rng.randint(0, k)
        drafts = tokens[p + 1:p + 1 + n_text]
        drafts += [rng.randrange(tok_vocab) for _ in range(k - len(drafts))]
        rl = rng.randint(len(drafts) and 1, k) if rng.random() < 0.3 else k
        req = GuidedRequest.generation(5, slot, params, tokens[p], draft_tokens=drafts[:k],
                                       num_accepted_draft_tokens=accepted_prev)
        dec.add_batch([req], runtime_draft_len=rl)
        dec.rollback_rejected_tokens()
        failed += dec.execute(torch.zeros(1 + rl, V))
        # verification: accept drafts equal to the text; past the text's EOS anything goes
        match = 0
        while match < rl and p + 1 + match < len(tokens) and drafts[match] == tokens[p + 1 + match]:
            match += 1
        ends_in_text = p + 1 + match >= len(tokens)
        accepted = rng.randint(0, match) if not ends_in_text else rng.randint(match, rl)
        for i in range(min(accepted, match) + 1):
            if dec.token_mask_host[i]:
                masks[p + 1 + i] = dec.bitmask_host[i].clone()
            else:
                masks.setdefault(p + 1 + i, None)
        p += 1 + min(accepted, match)
        accepted_prev = accepted
        if ends_in_text:
            break
    # the next step's add_batch + rollback settle the last verification
    dec.add_batch([GuidedRequest.generation(5, slot, params, tokens[-1],
                                            num_accepted_draft_tokens=accepted_prev)], 0)
    dec.rollback_rejected_tokens()
    return masks, dec, failed + dec.take_failed_requests()


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=st.sampled_from(TEACHER_CASES), seed=st.integers(0, 2**32 - 1),
       k=st.integers(1, 4))
def test_speculative_path_equals_plain_path(factory_cache, case, seed, k):
    """With random drafts and random acceptance, every verified position's mask and the final
    matcher state equal those of the one-token-per-step path; EOS inside drafts with
    acceptance past it is absorbed by the clamp (no failure)."""
    factory = factory_cache("tekken")
    tok = factory.config.tokenizer
    tokens = encode_continuation(tok, case.valid) + [factory.config.stop_token_ids[0]]
    plain, plain_dec = run_plain(factory, case.params, tokens)
    spec, spec_dec, failed = run_speculative(factory, case.params, tokens, random.Random(seed), k)
    assert failed == []
    for pos, row in spec.items():
        if row is None:
            assert plain.get(pos) is None
        else:
            assert torch.equal(row, plain[pos]), f"position {pos}"
    a, b = plain_dec.grammar_matchers[0], spec_dec.grammar_matchers[1]
    assert a.is_terminated() and b.is_terminated()
    b.rollback(1)
    a.rollback(1)
    V = factory.config.vocab_size_padded
    ra, rb = allocate_host_bitmask(1, V), allocate_host_bitmask(1, V)
    a.fill_next_token_bitmask(ra, 0)
    b.fill_next_token_bitmask(rb, 0)
    assert torch.equal(ra, rb)


def test_eos_inside_drafts_is_clamped(factory, tekken):
    """Verification accepting drafts past a draft EOS rolls back nothing and fails nothing."""
    case = TEACHER_CASES[2]  # regex
    V = factory.config.vocab_size_padded
    eos = factory.config.stop_token_ids[0]
    tokens = encode_continuation(tekken, case.valid)
    dec = make_decoder(factory, seqs=1, drafts=3)
    dec.add_batch([GuidedRequest.context(1, 0, case.params)])
    dec.execute(torch.zeros(1, V))
    # feed all but the last token one by one, then the last with drafts [EOS, x, y]
    for t in tokens[:-1]:
        dec.add_batch([GuidedRequest.generation(1, 0, case.params, t)], 0)
        assert dec.execute(torch.zeros(1, V)) == []
    dec.add_batch([GuidedRequest.generation(1, 0, case.params, tokens[-1],
                                            draft_tokens=[eos, 1234, 99])])
    logits = torch.zeros(4, V)
    assert dec.execute(logits) == []
    assert dec.num_advanced_tokens[0] == 2  # golden + EOS; the matcher stopped there
    assert dec.token_mask_host[:4].tolist() == [1, 0, 0, 0]
    assert torch.isfinite(logits[1:]).all()
    dec.add_batch([GuidedRequest.generation(1, 0, case.params, 99,
                                            num_accepted_draft_tokens=3)], 0)
    dec.rollback_rejected_tokens()
    assert dec.take_failed_requests() == []
    assert dec.grammar_matchers[0].is_terminated()


def test_negative_acceptance_fails_only_that_request(factory, tekken):
    """A negative accepted count is a failed request reported with its id, not an exception."""
    V = factory.config.vocab_size_padded
    a, b = TEACHER_CASES[0], TEACHER_CASES[2]
    ta, tb = (encode_continuation(tekken, c.valid) for c in (a, b))
    dec = make_decoder(factory, seqs=2, drafts=2)
    dec.add_batch([GuidedRequest.context(10, 0, a.params), GuidedRequest.context(11, 1, b.params)])
    dec.execute(torch.zeros(2, V))
    dec.add_batch([GuidedRequest.generation(10, 0, a.params, ta[0], draft_tokens=ta[1:3]),
                   GuidedRequest.generation(11, 1, b.params, tb[0], draft_tokens=tb[1:3])])
    dec.execute(torch.zeros(6, V))
    dec.add_batch([GuidedRequest.generation(10, 0, a.params, ta[3], num_accepted_draft_tokens=-1),
                   GuidedRequest.generation(11, 1, b.params, tb[3], draft_tokens=tb[4:6],
                                            num_accepted_draft_tokens=2)])
    dec.rollback_rejected_tokens()
    failed = dec.execute(torch.zeros(6, V))
    assert [f[0] for f in failed] == [10] and "num_accepted_draft_tokens=-1" in failed[0][1]
    assert dec.token_mask_host[3:6].tolist() == [1, 1, 1]


# -- mixed batches ---------------------------------------------------------------------------

def _mixed_requests(tekken, step: int):
    """Context, generation with drafts, unguided and guided generation requests in one batch."""
    a, b, c = TEACHER_CASES[0], TEACHER_CASES[2], TEACHER_CASES[3]
    ta, tb, tc = (encode_continuation(tekken, x.valid) for x in (a, b, c))
    if step == 0:
        return [GuidedRequest.context(1, 0, a.params), GuidedRequest.context(2, 1, None),
                GuidedRequest.context(3, 2, b.params), GuidedRequest.context(4, 3, c.params)]
    return [GuidedRequest.generation(1, 0, a.params, ta[0], draft_tokens=ta[1:3]),
            GuidedRequest.generation(2, 1, None, 5, draft_tokens=[6, 7]),
            GuidedRequest.context(9, 4, c.params),  # a new request joining
            GuidedRequest.generation(3, 2, b.params, tb[0], draft_tokens=[tb[1], 17]),
            GuidedRequest.generation(4, 3, c.params, tc[0])]


def test_mixed_batch_rows_equal_each_request_alone(factory, tekken):
    """Guided/unguided, context/generation, drafting/not in one step: each request's rows are
    masked exactly as if it ran alone, and unguided rows are untouched."""
    V = factory.config.vocab_size_padded
    together = make_decoder(factory, seqs=5, drafts=2)
    for step in range(2):
        reqs = _mixed_requests(tekken, step)
        together.add_batch(reqs)
        n = together.requests.num_bitmask_tokens
        logits = step_logits(n, V, 100 + step)
        before = logits.clone()
        assert together.execute(logits) == []
    layout = GuidedRequests(reqs, 2)
    for req, offset in zip(reqs, layout.offsets):
        rows = req.num_rows(2)
        mine = logits[offset:offset + rows]
        if req.guided_decoding_params is None:
            assert torch.equal(mine, before[offset:offset + rows])
            continue
        alone = make_decoder(factory, seqs=5, drafts=2)
        solo_steps = [[r for r in _mixed_requests(tekken, s) if r.seq_slot == req.seq_slot]
                      for s in range(2)]
        for s, solo in enumerate(solo_steps):
            if not solo:
                continue
            alone.add_batch(solo)
            solo_logits = step_logits(alone.requests.num_bitmask_tokens, V, 0)
            alone.execute(solo_logits)
        assert torch.equal(torch.isfinite(mine), torch.isfinite(solo_logits))


def test_layout_offsets_count_unguided_rows():
    """Offsets follow request order and count unguided and draft-step rows (1 each)."""
    p = GuidedDecodingParams(GuideType.REGEX, "a+")
    reqs = [GuidedRequest.context(0, 0, p), GuidedRequest.generation(1, 1, None, 3),
            GuidedRequest.generation(2, 2, p, 3, draft_tokens=[1, 2])]
    layout = GuidedRequests(reqs, 3)
    assert layout.offsets == [0, 1, 5] and layout.num_bitmask_tokens == 9
    assert [o for _, o in layout.valid_requests_with_offsets()] == [0, 5]
    drafts = [GuidedRequest(p, 0, 0, is_draft=True, is_generation_in_progress_state=True),
              GuidedRequest(None, 1, 1, is_draft=True), GuidedRequest(p, 2, 2, is_draft=True)]
    layout = GuidedRequests(drafts, 3)
    assert layout.offsets == [0, 1, 2] and layout.num_bitmask_tokens == 3


# -- dead ends -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    """A raw 6-token vocabulary where 'a' 'x' dead-ends after 'a' (no token spells 'x')."""
    from capgraph.grammar import create_matcher_factory
    vocab = ["a", "b", "</s>", "ab", "c", "d"]
    config = GuidedDecodingConfig(encoded_vocab=vocab, stop_token_ids=[2], vocab_size_padded=64)
    return create_matcher_factory(config)


DEAD = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= "a" "x" | "b" "a" "x" | "b"+')
ALIVE = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= ("a" | "b")+')


def test_dead_end_fails_only_that_request(tiny):
    """A state with no valid token fails its request (reported with its id, row unmasked,
    never NaN or all -inf) while the other request's row is masked as usual."""
    dec = GuidedDecoder(tiny.config, 2, 0, factory=tiny)
    dec.add_batch([GuidedRequest.context(1, 0, DEAD), GuidedRequest.context(2, 1, ALIVE)])
    dec.execute(torch.zeros(2, 64))
    dec.add_batch([GuidedRequest.generation(1, 0, DEAD, 0), GuidedRequest.generation(2, 1, ALIVE, 0)])
    logits = torch.randn(2, 64)
    failed = dec.execute(logits)
    assert [f[0] for f in failed] == [1] and "no valid token" in failed[0][1]
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).tolist()[:6] == [True, True, True, True, False, False]
    assert not torch.isfinite(logits[1][6:]).any(), "padding ids must stay masked"
    assert dec.grammar_matchers[0] is None and dec.grammar_matchers[1] is not None
    assert not torch.isnan(logits).any()


def test_draft_dead_end_stops_guiding_and_rolls_back(tiny):
    """A draft token leading to a dead end leaves later rows unconstrained without failing; a
    draft-model step in a dead end marks the slot and rollback_draft_tokens restores it."""
    dec = GuidedDecoder(tiny.config, 1, 2, factory=tiny)
    dec.add_batch([GuidedRequest.context(1, 0, DEAD)])
    dec.execute(torch.zeros(1, 64))
    dec.add_batch([GuidedRequest.generation(1, 0, DEAD, 1, draft_tokens=[0, 1])])
    logits = torch.randn(3, 64)
    assert dec.execute(logits) == []
    # golden 'b' is fine; draft 'a' is accepted but "ba" allows nothing: stop guiding there
    assert dec.token_mask_host[:3].tolist() == [1, 0, 0]
    assert dec.num_advanced_tokens[0] == 2
    assert torch.isfinite(logits[1:]).all() and not torch.isnan(logits).any()
    # the target rejected the draft: back to "b"
    dec.add_batch([GuidedRequest.generation(1, 0, DEAD, 1, num_accepted_draft_tokens=0)], 0)
    dec.rollback_rejected_tokens()
    assert dec.num_advanced_tokens[0] == 1
    # draft-model steps: the drafted 'a' leads to a dead end -> the slot's drafting stops
    draft = dict(is_draft=True, is_generation_in_progress_state=True)
    dec.add_batch([GuidedRequest(DEAD, 1, 0, new_token=0, **draft)])
    assert dec.execute(torch.zeros(1, 64)) == []
    assert dec.is_draft_terminated[0] and dec.num_advanced_draft_tokens[0] == 1
    dec.add_batch([GuidedRequest(DEAD, 1, 0, new_token=1, **draft)])
    logits = torch.zeros(1, 64)
    assert dec.execute(logits) == []
    assert dec.num_advanced_draft_tokens[0] == 1 and torch.isfinite(logits).all()
    dec.rollback_draft_tokens()
    assert not dec.is_draft_terminated[0] and dec.num_advanced_draft_tokens[0] == 0
    # back at "b": the target's next token 'b' gives "bb", where 'a' is not allowed
    dec.add_batch([GuidedRequest.generation(1, 0, DEAD, 1)], 0)
    logits = torch.zeros(1, 64)
    assert dec.execute(logits) == []
    assert torch.isfinite(logits[0]).tolist()[:3] == [False, True, True]


def test_disaggregated_first_step_creates_the_matcher(factory, tekken):
    """A generation-only first step gets its matcher from init_disagg_gen_requests."""
    case = TEACHER_CASES[2]
    V = factory.config.vocab_size_padded
    tokens = encode_continuation(tekken, case.valid)
    dec = make_decoder(factory, seqs=1)
    req = GuidedRequest(case.params, 3, 0, None, False, False, True, True, tokens[0])
    dec.add_batch([req])
    dec.init_disagg_gen_requests()
    logits = torch.zeros(1, V)
    assert dec.execute(logits) == []
    assert torch.equal(torch.isfinite(logits[0]), reference_masks(factory, case.params, tokens)[1])


# -- per-request failures and batch-level errors ----------------------------------------------

def test_bad_requests_fail_alone(factory, tekken):
    """Out-of-vocab tokens, a bad slot, another request on a slot, too many drafts and a bad
    guide each fail only their request; the good request is masked as if alone."""
    V = factory.config.vocab_size_padded
    good = TEACHER_CASES[2]
    tokens = encode_continuation(tekken, good.valid)
    bad_regex = GuidedDecodingParams(GuideType.REGEX, "(unclosed")
    dec = make_decoder(factory, seqs=4, drafts=1)
    dec.add_batch([GuidedRequest.context(1, 0, good.params), GuidedRequest.context(2, 1, good.params),
                   GuidedRequest.context(3, 2, bad_regex)])
    failed = dec.execute(torch.zeros(3, V))
    assert [f[0] for f in failed] == [3] and "REGEX" in failed[0][1]
    dec.add_batch([
        GuidedRequest.generation(1, 0, good.params, tokens[0]),
        GuidedRequest.generation(2, 1, good.params, V + 5),
        GuidedRequest.generation(4, 9, good.params, tokens[0]),
        GuidedRequest.generation(5, 0, good.params, tokens[0]),
    ], 0)
    logits = torch.zeros(4, V)
    failed = dict(dec.execute(logits))
    assert set(failed) == {2, 4, 5}
    assert "outside the vocabulary" in failed[2] and "seq_slot 9" in failed[4]
    assert "holds the matcher of request 1" in failed[5]
    assert dec.grammar_matchers[0] is not None, "another request must not drop the owner's matcher"
    ref = reference_masks(factory, good.params, tokens)[1]
    assert torch.equal(torch.isfinite(logits[0]), ref)
    assert torch.isfinite(logits[1:]).all()


def test_batch_level_errors_are_named(factory):
    """Too many requests, a bad runtime draft length and mis-shaped logits raise named errors."""
    V = factory.config.vocab_size_padded
    dec = make_decoder(factory, seqs=2, drafts=1)
    p = TEACHER_CASES[2].params
    with pytest.raises(LayoutError, match="max_num_sequences=2"):
        dec.add_batch([GuidedRequest.context(i, i, p) for i in range(3)])
    with pytest.raises(LayoutError, match="runtime_draft_len=2"):
        dec.add_batch([GuidedRequest.context(0, 0, p)], 2)
    dec.add_batch([GuidedRequest.context(0, 0, p)])
    with pytest.raises(TensorArgError, match="2 rows"):
        dec.execute(torch.zeros(2, V))
    with pytest.raises(TensorArgError, match="width"):
        dec.execute(torch.zeros(1, V - 3))
    with pytest.raises(TensorArgError, match="2-D"):
        dec.execute(torch.zeros(V))


def test_compile_starts_at_first_sight(factory, tekken, monkeypatch):
    """add_batch of a non-final context chunk already starts the compile; the final chunk's
    build finds it done. (The compiles are seen where the decoder starts them, the factory's
    ``compile_async``.)"""
    params = GuidedDecodingParams(GuideType.REGEX, r"[a-z]{3}-first-sight-\d+")
    started = []
    compile_async = factory.compile_async

    def recording_compile_async(p):
        started.append(compile_async(p))
        return started[-1]
    monkeypatch.setattr(factory, "compile_async", recording_compile_async)
    dec = make_decoder(factory, seqs=1)
    dec.add_batch([GuidedRequest.context(1, 0, params, last_chunk=False)])
    assert [h.params for h in started] == [params]  # the slot's pending compile
    handle = started[0]
    assert dec.execute(torch.zeros(1, factory.config.vocab_size_padded)) == []
    assert dec.grammar_matchers[0] is None
    handle.future.result(timeout=30)
    dec.add_batch([GuidedRequest.context(1, 0, params)])
    assert started == [handle]  # still the slot's pending compile: none started again
    assert dec.execute(torch.zeros(1, factory.config.vocab_size_padded)) == []
    assert dec.grammar_matchers[0] is not None and started == [handle]  # the build took it
    # ... and no longer holds it pending: the slot's next context request starts a compile
    dec.add_batch([GuidedRequest.context(2, 0, params, last_chunk=False)])
    assert len(started) == 2 and started[1] is not handle


_NVTX_SCRIPT = """
import json, sys, torch
import capgraph._nvtx as cnvtx
from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest
events = []
cnvtx._push = lambda name, attributes: events.append(("push", name))
cnvtx._pop = lambda: events.append(("pop", None))
config = GuidedDecodingConfig(encoded_vocab=["a", "b", "c", "</s>"], vocab_size_padded=64,
                              stop_token_ids=[3])
dec = GuidedDecoder(config, 1, 1)
dec.add_batch([GuidedRequest.context(1, 0, GuidedDecodingParams.regex("a+b"))])
assert dec.execute(torch.zeros(1, 64)) == []
dec.rollback_rejected_tokens()
dec.rollback_draft_tokens()
print(json.dumps({"active": cnvtx.ACTIVE, "events": events}))
"""


def test_every_stage_emits_an_nvtx_range():
    """With ranges on (a tool attached; here CAPGRAPH_NVTX=always, in a fresh process since
    the choice is made at import), add_batch, build, copy, apply and the rollbacks each push a
    named range in the "capgraph" domain, balanced by a pop."""
    import json
    import subprocess
    import sys
    env = dict(os.environ, CAPGRAPH_NVTX="always")
    out = subprocess.run([sys.executable, "-c", _NVTX_SCRIPT], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["active"] is True
    events = result["events"]
    pushed = [a for kind, a in events if kind == "push"]
    assert len(pushed) == sum(kind == "pop" for kind, _ in events)
    for stage in ("add_batch", "execute", "build", "apply_bitmask", "rollback_rejected_tokens",
                  "rollback_draft_tokens"):
        assert any(stage in str(p) for p in pushed), stage


def test_no_tool_no_range_wrappers():
    """Without an NVTX tool (and without CAPGRAPH_NVTX=always) the per-step methods are the
    undecorated functions: ranges cost nothing when nobody records them."""
    import capgraph._nvtx as cnvtx
    from capgraph.capturable import CapturableGuidedDecoder
    methods = [GuidedDecoder.add_batch, GuidedDecoder.execute, GuidedDecoder._build,
               GuidedDecoder.apply_bitmask, CapturableGuidedDecoder.prepare]
    for fn in methods:
        assert hasattr(fn, "__wrapped__") is cnvtx.ACTIVE, fn.__qualname__
    expect_active = (type(cnvtx._domain).__name__ != "DummyDomain"
                     or os.environ.get("CAPGRAPH_NVTX", "").lower() == "always")
    assert cnvtx.ACTIVE is expect_active


@pytest.mark.parametrize("V", [64, 100, 131072, 128001])
def test_the_decoders_dead_end_guard_agrees_with_row_has_valid_token(factory_cache, V):
    """The decoder's fast guard (bytes comparisons, a first look at the likely-allowed words)
    answers exactly like bitmask.row_has_valid_token, padding-bit garbage included, for one
    row, small and large batches, evenly and unevenly spaced rows."""
    from capgraph.bitmask import row_has_valid_token
    config = GuidedDecodingConfig(encoded_vocab=[chr(97 + i % 26) * (1 + i // 26)
                                                 for i in range(50)], vocab_size_padded=V)
    dec = GuidedDecoder(config, 40, 0)
    g = torch.Generator().manual_seed(V)
    W = dec.bitmask_size
    rows = dec.bitmask_host
    rows.zero_()
    for r in range(40):  # dead rows, single bits anywhere, garbage only in the padding bits
        kind = r % 4
        if kind == 1:
            bit = int(torch.randint(0, V, (1,), generator=g))
            rows[r, bit // 32] = 1 << (bit % 32) if bit % 32 != 31 else -(1 << 31)
        elif kind == 2 and V % 32:
            rows[r, W - 1] = -(1 << (V % 32))  # only bits >= V set
        elif kind == 3:
            rows[r] = torch.randint(-2**31, 2**31 - 1, (W,), generator=g, dtype=torch.int32)
    rows[5, 0] = 1  # a row whose only allowed token lies in the guard's first look
    uneven = [0, 1, 2, 4, 5, 7, 8, 11, 13, 14, 17, 19, 20, 22, 25, 26, 29, 31, 33, 38]
    for subset in ([3], [5], list(range(8)), list(range(0, 40, 2)), list(range(40)), uneven,
                   uneven[::-1]):
        expect = [k for k, r in enumerate(subset) if not row_has_valid_token(rows[r], V)]
        assert dec.slots.dead_rows(subset) == expect, subset


def test_probe_window_picks_the_densest_run_of_words():
    from capgraph.build.slots import probe_window
    # Tekken-like: stop token in word 0, 256 byte tokens at ids 1000..1255 (words 31..39)
    assert probe_window([2, *range(1000, 1256)], 4096) == (31, 47)
    assert probe_window([2, *range(1000, 1256)], 40) == (31, 40)  # clipped to full words
    assert probe_window([5, 40, 70, 5000], 4096) == (0, 16)
    assert probe_window([], 4096) is None
    assert probe_window([10_000], 100) is None  # only padding words: nothing to look at


def test_xgrammar_matchers_take_the_ffi_route_on_the_pinned_version(factory_cache):
    """The per-call saving relies on xgrammar's wrappers keeping their FFI object in
    ``_handle``; if an upgrade drops it the public methods are used (correct, slower) and
    this test says so."""
    from capgraph.grammar.xgrammar_backend import XGrammarMatcher
    factory = factory_cache("mistral-sp32k")
    m = factory.create(GuidedDecodingParams.regex("[a-c]+"))
    assert isinstance(m, XGrammarMatcher)
    assert m._handle is not None, "xgrammar.GrammarMatcher._handle is gone: public route used"
    assert factory._batch_fill_ffi is not None


def test_request_snapshot_copies_every_field_and_owns_its_drafts():
    """GuidedRequest.snapshot lists the fields by hand (for speed): a field added to the
    dataclass but not to snapshot fails here."""
    import dataclasses
    values = {}
    for i, f in enumerate(dataclasses.fields(GuidedRequest)):
        values[f.name] = {"guided_decoding_params": GuidedDecodingParams.regex("a+"),
                          "draft_tokens": [7, 8, 9]}.get(f.name, 1000 + i)
    original = GuidedRequest(**values)
    copy = GuidedRequest.snapshot(original)
    assert copy == original and copy is not original
    assert copy.draft_tokens is not original.draft_tokens
    original.draft_tokens.append(10)
    original.new_token = 5
    assert copy.draft_tokens == [7, 8, 9] and copy.new_token != 5
    assert GuidedRequest.snapshot(GuidedRequest()).draft_tokens is None


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_both_backends_name_the_single_byte_tokens_for_the_guard(factory_cache, backend):
    """The dead-end guard's first look (speed only) covers Tekken's 256 byte tokens
    (ids 1000-1255) and the stop token with either backend."""
    factory = factory_cache("tekken", backend)
    ids = set(factory.likely_allowed_token_ids())
    assert factory.config.stop_token_ids[0] in ids
    assert len(ids & set(range(1000, 1256))) >= 255
    assert len(ids) < 400


class _Flaky:
    """A matcher that raises in fixed states: filling after it accepted "ab" (id 3), and
    accepting "c" (id 4). State-based, so both fill paths meet the same faults (a call count
    would not be: a failed batch fill refills the other rows)."""

    def __init__(self, inner) -> None:
        self.inner, self.last = inner, None

    def accept_token(self, token_id):
        if token_id == 4:
            raise RuntimeError("flaky accept")
        ok = self.inner.accept_token(token_id)
        if ok:
            self.last = token_id
        return ok

    def fill_next_token_bitmask(self, bitmask, index):
        if self.last == 3:
            raise RuntimeError("flaky fill")
        self.inner.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens):
        self.inner.rollback(num_tokens)
        self.last = None

    def is_terminated(self):
        return self.inner.is_terminated()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_sequential_and_round_fills_agree(tiny, seed):
    """The two ways a build fills rows (request by request for small batches, in rounds for
    larger ones) leave identical masks, token masks, counters, failures and matchers, over
    random steps with dead ends, invalid tokens, drafts, runtime draft lengths, rollbacks and
    a matcher that raises in some states. (The Python build only: the C++ one is tied to both
    fills by tests/test_native_build.py.)"""
    rng = random.Random(seed)
    K, slots = 3, 4
    config = dataclasses.replace(tiny.config, native_build="off")
    decs = [GuidedDecoder(config, slots, K, factory=tiny) for _ in range(2)]
    decs[0].host_build.sequential_fill_max, decs[1].host_build.sequential_fill_max = 0, 1000
    guides = [rng.choice([DEAD, ALIVE]) for _ in range(slots)]
    ctx = [GuidedRequest.context(10 + s, s, guides[s]) for s in range(slots)]
    flaky = rng.randrange(slots)  # this slot's matcher raises in some states (both decoders)
    steps = [ctx] + [None] * 10
    for n, step in enumerate(steps):
        if n == 1:
            for dec in decs:
                if dec.grammar_matchers[flaky] is not None:
                    dec.grammar_matchers[flaky] = _Flaky(dec.grammar_matchers[flaky])
        if step is None:
            chosen = rng.sample(range(slots), rng.randint(1, slots))
            step = [GuidedRequest.generation(
                10 + s, s, guides[s], rng.choice([0, 1, 1, 3, 4]),
                draft_tokens=[rng.choice([0, 1, 3, 4]) for _ in range(rng.randint(0, K))],
                num_accepted_draft_tokens=rng.randint(0, K)) for s in chosen]
        assert_steps_agree(decs, step, rng.randint(0, K))


def test_placeholder_takes_generation_rows_and_is_never_masked(tiny):
    """GuidedRequest.placeholder pads a batch: 1 + draft length rows, unguided, no slot."""
    p = GuidedRequest.placeholder(-3, 2)
    assert (p.request_id, p.seq_slot, p.guided_decoding_params, p.draft_tokens) == \
        (-3, None, None, [0, 0])
    assert GuidedRequest.placeholder(-1).draft_tokens is None
    dec = GuidedDecoder(tiny.config, 2, 2, factory=tiny)
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE), p], runtime_draft_len=2)
    assert dec.requests.offsets == [0, 1] and dec.requests.num_bitmask_tokens == 4
    logits = torch.zeros(4, 64)
    assert dec.execute(logits) == []
    assert torch.isinf(logits[0]).any() and torch.isfinite(logits[1:]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_cpu_apply_calls_the_native_pass_directly_with_the_ops_result(dtype):
    """On CPU, full-width rows without d2t go straight to the op's C++ pass (no custom-op
    dispatch): same logits as logits_bitmask; other shapes (fewer rows than passed, a shard)
    still take the op."""
    from capgraph.ops import logits_bitmask
    V = 256
    config = GuidedDecodingConfig(encoded_vocab=["a", "b", "c", "</s>"], vocab_size_padded=V,
                                  stop_token_ids=[3])
    from torch.utils._python_dispatch import TorchDispatchMode

    from capgraph.ops.cpu_mask import cpu_apply

    class OpCalls(TorchDispatchMode):
        """Records the capgraph ops the dispatcher sees."""

        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith("capgraph."):
                self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    if cpu_apply() is None:
        pytest.skip("the C++ library is unavailable here: only the op path exists")
    dec = GuidedDecoder(config, 4, 0)
    g = torch.Generator().manual_seed(1)
    dec.bitmask_host.copy_(torch.randint(-2**31, 2**31 - 1, dec.bitmask_host.shape,
                                         generator=g, dtype=torch.int32))
    dec.token_mask_host.copy_(torch.tensor([1, 0, 1, 1], dtype=torch.int32))
    calls = []  # (logits shape, whether the custom op was dispatched)
    for rows, width in [(4, V), (3, V), (4, V // 2)]:
        logits = torch.randn(4, width, generator=g).to(dtype)
        expect = logits.clone()
        logits_bitmask(expect[:rows], dec.bitmask[:rows], dec.token_mask[:rows], None,
                       col_offset=dec.rank * width if width < V else 0)
        passed = logits[:rows] if rows < 4 else logits
        with OpCalls() as seen:
            dec.apply_bitmask(passed, None, rows)
        calls.append((passed.shape, seen.ops != []))
        assert torch.equal(logits[:rows], expect[:rows]), (rows, width)
    assert calls == [(torch.Size([4, V]), False), (torch.Size([3, V]), False),
                     (torch.Size([4, V // 2]), True)]


@pytest.mark.parametrize("draft_text", ["a", "x"])  # accepted; refused (drafting stops)
@pytest.mark.parametrize("after", ["execute", "rollback_rejected_tokens"])
def test_a_drafting_loop_left_without_its_rollback_is_undone_by_the_next_target_step(
        factory, tekken, draft_text, after):
    """A drafting loop whose rollback_draft_tokens was never called: the next target build
    (or rollback of rejected tokens) undoes its advances first, so the target rows equal
    those of a decoder whose loop was rolled back. Before, the target masked after the
    draft prefix, and a slot whose draft token was refused stayed unguided."""
    params = GuidedDecodingParams.regex("a{3}b")
    V = factory.config.vocab_size_padded
    a, d_tok = (encode_continuation(tekken, t)[0] for t in ("a", draft_text))
    decoders = [make_decoder(factory, seqs=1, drafts=2) for _ in range(2)]
    draft = dict(is_draft=True, is_generation_in_progress_state=True)
    rows = []
    for k, dec in enumerate(decoders):
        dec.add_batch([GuidedRequest.context(1, 0, params)])
        dec.execute(torch.zeros(1, V))
        for token in (a, d_tok):
            dec.add_batch([GuidedRequest(params, 1, 0, new_token=token, **draft)])
            assert dec.execute(torch.zeros(1, V)) == []
        if k == 0:
            dec.rollback_draft_tokens()  # the reference; the other decoder forgets it
        if after == "rollback_rejected_tokens":
            dec.add_batch([GuidedRequest.generation(1, 0, params, a,
                                                    num_accepted_draft_tokens=0)], 0)
            dec.rollback_rejected_tokens()
        dec.add_batch([GuidedRequest.generation(1, 0, params, a, draft_tokens=[a])], 1)
        logits = torch.zeros(2, V)
        assert dec.execute(logits) == []
        rows.append(logits)
    assert torch.isneginf(rows[0]).any(dim=1).all()
    assert torch.equal(rows[0], rows[1])
    assert not decoders[1].is_draft_terminated[0]
    assert decoders[1].num_advanced_draft_tokens[0] == 0


@pytest.mark.parametrize("pad_at", [None, 0, 1])
def test_a_draft_batch_with_padding_first_stays_a_draft_step(factory, tekken, pad_at):
    """A drafting loop whose batch at step ``pad_at`` starts with an unguided placeholder
    (padding): the batch is still a draft step, so the loop goes on from its advances and the
    last row allows only what the draft prefix leaves ("b" after "aaa"); the placeholder
    does not make the build end the loop mid-way."""
    params = GuidedDecodingParams.regex("a{3}b")
    V = factory.config.vocab_size_padded
    a, b = (encode_continuation(tekken, t)[0] for t in ("a", "b"))
    dec = make_decoder(factory, seqs=2, drafts=3)
    dec.add_batch([GuidedRequest.context(1, 0, params)])
    dec.execute(torch.zeros(1, V))
    dec.add_batch([GuidedRequest.generation(1, 0, params, a)], 3)
    dec.rollback_rejected_tokens()
    for k in range(3):
        reqs = [GuidedRequest(params, 1, 0, new_token=a, is_draft=True,
                              is_generation_in_progress_state=True)]
        if k == pad_at:
            reqs.insert(0, GuidedRequest.placeholder(99))
        dec.add_batch(reqs, 3)
        logits = torch.zeros(dec.requests.num_bitmask_tokens, V)
        assert dec.execute(logits) == []
        assert dec.num_advanced_draft_tokens[0] == k + 1
    assert torch.isneginf(logits[-1, a]) and torch.isfinite(logits[-1, b])
    dec.rollback_draft_tokens()
    assert dec.num_advanced_draft_tokens[0] == 0


def test_a_target_request_beside_drafts_ends_its_slots_open_loop(factory, tekken):
    """A drafting loop on slot 0 left without its rollback, then a batch holding a target
    request for slot 0 beside a draft request for slot 1: slot 0's loop ends before the
    build (its target row equals that of a decoder whose loop was rolled back), while the
    batch's drafts go on as a loop of their own (slot 0's target row is not masked after
    the draft prefix)."""
    params = GuidedDecodingParams.regex("a{3}b")
    V = factory.config.vocab_size_padded
    a, b = (encode_continuation(tekken, t)[0] for t in ("a", "b"))
    draft = dict(is_draft=True, is_generation_in_progress_state=True)
    rows = []
    for explicit in (True, False):
        dec = make_decoder(factory, seqs=2, drafts=3)
        dec.add_batch([GuidedRequest.context(1, 0, params), GuidedRequest.context(2, 1, params)])
        dec.execute(torch.zeros(2, V))
        dec.add_batch([GuidedRequest.generation(1, 0, params, a),
                       GuidedRequest.generation(2, 1, params, a)], 0)
        assert dec.execute(torch.zeros(2, V)) == []
        dec.add_batch([GuidedRequest(params, 1, 0, new_token=a, **draft)], 3)
        assert dec.execute(torch.zeros(1, V)) == []
        if explicit:
            dec.rollback_draft_tokens()
        dec.add_batch([GuidedRequest.generation(1, 0, params, a),
                       GuidedRequest(params, 2, 1, new_token=a, **draft)], 0)
        logits = torch.zeros(2, V)
        assert dec.execute(logits) == []
        assert torch.isfinite(logits[0, a]) and torch.isneginf(logits[0, b])  # ("aa" so far)
        assert dec.num_advanced_draft_tokens[0] == 0 and dec.num_advanced_draft_tokens[1] == 1
        rows.append(logits)
        dec.rollback_draft_tokens()
        assert dec.num_advanced_draft_tokens[1] == 0
        dec.close()
    assert torch.equal(rows[0], rows[1])
