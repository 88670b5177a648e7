"""CapturableGuidedDecoder on hostfunc's CPU stand-in: same results as GuidedDecoder, step for
step, eagerly and under HostGraph capture/replay; epochs, failures and callback errors."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hostfunc
from capgraph import GuidedDecodingParams, GuideType, QueueEpochError
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation
from cases import CASES
from conftest import settled_live_entries

GUIDED = [c for c in CASES if c.params.guide_type in
          (GuideType.JSON_SCHEMA, GuideType.REGEX, GuideType.EBNF_GRAMMAR)]


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-identical (NaN-safe) comparison of two float tensors."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


class Scenario:
    """Random requests joining and leaving slots, drafting or not, with random acceptance.

    Produces per step the requests (with explicit tokens), the new_tokens tensor for the
    capturable path, the runtime draft length and the accepted counts of the previous step.
    """

    def __init__(self, factory, rng: random.Random, slots: int, drafts: int, steps: int):
        tok = factory.config.tokenizer
        eos = factory.config.stop_token_ids[0]
        self.rng, self.slots, self.drafts, self.steps = rng, slots, drafts, steps
        self.vocab = factory.config.tokenizer_vocab_size
        self.texts = {c.name: encode_continuation(tok, c.valid) + [eos] for c in GUIDED}
        self.live: dict[int, dict] = {}
        self.next_id = 0

    def _new(self, slot: int) -> dict:
        case = self.rng.choice(GUIDED + [None])
        self.next_id += 1
        return {"id": self.next_id, "slot": slot, "params": case and case.params,
                "text": self.texts[case.name] if case else [7] * 30, "pos": 0, "state": "ctx",
                "disagg": self.rng.random() < 0.15, "accepted": 0}

    def step(self):
        for slot in range(self.slots):
            r = self.live.get(slot)
            if r is None or r["pos"] >= len(r["text"]) - 1:
                if self.rng.random() < 0.8:
                    self.live[slot] = self._new(slot)
                else:
                    self.live.pop(slot, None)
        rl = self.rng.randint(0, self.drafts)
        reqs, new_tokens = [], torch.zeros(self.drafts + 1, self.slots, dtype=torch.int32)
        for slot in sorted(self.live):
            r = self.live[slot]
            if r["state"] == "ctx" and not r["disagg"]:
                reqs.append(GuidedRequest.context(r["id"], slot, r["params"]))
                r["state"] = "gen"
                r["rows"], r["drafts"] = 1, []
                continue
            text, p = r["text"], r["pos"]
            n_text = self.rng.randint(0, rl)
            drafts = text[p + 1:p + 1 + n_text]
            drafts = drafts + [self.rng.randrange(self.vocab) for _ in range(rl - len(drafts))]
            req = GuidedRequest.generation(r["id"], slot, r["params"], text[p], draft_tokens=drafts,
                                           num_accepted_draft_tokens=r["accepted"],
                                           prev_seq_slot=slot)
            if r["state"] == "ctx":  # disaggregated: first step is generation-only
                req.is_generation_only_first_iteration = True
                req.prev_seq_slot = None
                r["state"] = "gen"
            new_tokens[0, slot] = text[p]
            new_tokens[1:1 + len(drafts), slot] = torch.tensor(drafts, dtype=torch.int32)
            reqs.append(req)
            r["drafts"] = drafts
        return reqs, new_tokens, rl

    def verify(self, reqs):
        """Random acceptance (past the text's end anything goes); advance positions."""
        counts = []
        for req in reqs:
            r = self.live[req.seq_slot]
            if req.is_context_init_state:
                counts.append(1)
                continue
            text, p, drafts = r["text"], r["pos"], r["drafts"]
            match = 0
            while match < len(drafts) and p + 1 + match < len(text) \
                    and drafts[match] == text[p + 1 + match]:
                match += 1
            if p + 1 + match >= len(text):
                accepted = self.rng.randint(match, len(drafts))
            else:
                accepted = self.rng.randint(0, match)
            r["accepted"] = accepted
            r["pos"] = min(p + 1 + accepted, len(text) - 1)
            counts.append(1 + accepted)
        return counts


def _recording_begin(taken: list):
    """A ``host_build`` choice: the default strategy, each ``begin`` verdict appended to
    ``taken``."""
    from capgraph.build import make_host_build

    def make(slots, factory, budget_ms):
        build = make_host_build("auto", slots, factory, budget_ms, factory.config.native_build)
        if build.asynchronous:
            begin = build.begin
            build.begin = lambda *step: taken.append(begin(*step)) or taken[-1]
        return build
    return make


def assert_same_matcher_states(eager, capt) -> None:
    """Every slot holds a matcher in both decoders or in neither, terminated alike."""
    for slot in range(eager.max_num_sequences):
        a, b = eager.grammar_matchers[slot], capt.grammar_matchers[slot]
        assert (a is None) == (b is None), f"slot {slot}"
        if a is not None:
            assert a.is_terminated() == b.is_terminated(), f"slot {slot}"


def assert_warmup_replays_mask_nothing(capt, graph, static) -> None:
    """Three replays of ``graph`` inside ``capt.warmup()``: nothing masked, no row active."""
    with capt.warmup():
        for _ in range(3):
            static.zero_()
            graph.replay()
            hostfunc.drain()
            assert torch.isfinite(static).all() and capt.token_mask_host[0] == 0


def assert_extra_put_is_out_of_step(capt, graph, static, params, token: int) -> None:
    """Two add_batch calls for one replay of ``graph`` (slot 0, after its context step): the
    drain raises a HostFuncError caused by a QueueEpochError naming the expected epoch; the
    next add_batch and replay are in step again (the matcher never advanced past the context
    step: one token now, its row masked)."""
    capt.add_batch([GuidedRequest.generation(1, 0, params, token)])
    capt.add_batch([GuidedRequest.generation(1, 0, params, token)])  # extra put
    graph.replay()
    with pytest.raises(hostfunc.HostFuncError, match="expected") as info:
        hostfunc.drain()
    assert isinstance(info.value.__cause__, QueueEpochError)
    capt.add_batch([GuidedRequest.generation(1, 0, params, token)])
    static.zero_()
    graph.replay()
    hostfunc.drain()
    assert capt.num_advanced_tokens[0] == 1 and capt.token_mask_host[0] == 1
    assert torch.isneginf(static).any()


def run_pair(factory, seed: int, steps: int, drafts: int, slots: int = 4, use_new_tokens=True):
    rng = random.Random(seed)
    scenario = Scenario(factory, rng, slots, drafts, steps)
    V = factory.config.vocab_size_padded
    eager = GuidedDecoder(factory.config, slots, drafts, factory=factory)
    taken: list = []  # the native strategy's asynchronous builds (the CPU host step's path)
    capt = CapturableGuidedDecoder(factory.config, slots, drafts, factory=factory,
                                   host_build=_recording_begin(taken))
    counts = None
    for step in range(steps):
        reqs, new_tokens, rl = scenario.step()
        if not reqs:
            continue
        eager.add_batch(reqs, rl)
        eager.rollback_rejected_tokens()
        eager.init_disagg_gen_requests()
        capt_reqs = reqs
        if use_new_tokens:  # the capturable path reads tokens from the pinned buffer
            capt_reqs = [GuidedRequest(**{f: getattr(r, f) for f in r.__slots__})
                         for r in reqs]
            for r in capt_reqs:
                if r.prev_seq_slot is not None:
                    r.new_token, r.draft_tokens = None, None
        capt.add_batch(capt_reqs, new_tokens if use_new_tokens else None, rl)
        if counts is not None and drafts:
            capt.rollback_rejected_batch(torch.tensor(
                [counts.get(r.seq_slot, 1) for r in capt_reqs], dtype=torch.int32))
        n = eager.requests.num_bitmask_tokens
        logits = torch.randn(n, V, generator=torch.Generator().manual_seed(step))
        la, lb = logits.clone(), logits.clone()
        failed_a = eager.execute(la)
        capt.execute(lb)
        failed_b = capt.take_failed_requests()
        assert sorted(failed_a) == sorted(failed_b), f"step {step}"
        assert same(la, lb), f"logits differ at step {step}"
        assert torch.equal(eager.token_mask_host[:n], capt.token_mask_host[:n])
        verified = scenario.verify(reqs)
        counts = {r.seq_slot: c for r, c in zip(reqs, verified)}
        # next step's requests carry these counts; the capturable path gets them as a tensor
    assert_same_matcher_states(eager, capt)
    if capt.host_build.asynchronous:  # plain steps built on the C++ thread, no Python worker ran
        assert any(taken) and capt.streams.stream.thread is None
    capt.close()
    return eager, capt


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), drafts=st.sampled_from([0, 2, 3]),
       use_new_tokens=st.booleans())
def test_capturable_equals_eager_over_random_steps(factory, seed, drafts, use_new_tokens):
    """Over random steps of mixed guided/unguided, context/generation, disaggregated and
    drafting requests (EOS inside drafts included), every mask row, every masked logit, every
    failure and the final matcher states equal GuidedDecoder's."""
    run_pair(factory, seed, steps=25, drafts=drafts, use_new_tokens=use_new_tokens)


def test_hostgraph_replay_equals_eager(factory, tekken):
    """Capture the decoder's step once into a HostGraph, then replay it for N steps with an
    add_batch before each: the masked logits equal the eager decoder's."""
    live = settled_live_entries()
    V = factory.config.vocab_size_padded
    cases = GUIDED[:3]
    texts = [encode_continuation(tekken, c.valid) for c in cases]
    steps = min(len(t) for t in texts)
    eager = GuidedDecoder(factory.config, 3, 0, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 3, 0, factory=factory)
    static = torch.zeros(3, V)

    def requests(step):
        if step == 0:
            return [GuidedRequest.context(i, i, c.params) for i, c in enumerate(cases)]
        return [GuidedRequest.generation(i, i, c.params, texts[i][step - 1])
                for i, c in enumerate(cases)]

    capt.add_batch(requests(0))  # shapes for the capture
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        capt.execute(static)
    assert graph.num_callbacks >= 2  # the fused host step and the apply
    for step in range(steps):
        logits = torch.randn(3, V, generator=torch.Generator().manual_seed(step))
        eager.add_batch(requests(step))
        expect = logits.clone()
        assert eager.execute(expect) == []
        capt.add_batch(requests(step))
        static.copy_(logits)
        graph.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == []
        assert same(static, expect), f"step {step}"
    graph.reset()
    capt.close()
    assert hostfunc.live_entries() == live


def test_warmup_replays_change_nothing_and_missing_put_is_reported(factory, tekken):
    """Replays inside warmup() with an empty queue mask and advance nothing; a replay without
    its add_batch outside warm-up raises QueueEpochError at the drain; an extra add_batch too;
    the step after works."""
    V = factory.config.vocab_size_padded
    case = GUIDED[2]
    tokens = encode_continuation(tekken, case.valid)
    capt = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory)
    static = torch.zeros(1, V)
    capt.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        capt.execute(static)
    capt.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph.replay()
    hostfunc.drain()
    assert capt.num_advanced_tokens[0] == 0 and capt.token_mask_host[0] == 1
    assert_warmup_replays_mask_nothing(capt, graph, static)
    static.zero_()
    graph.replay()  # no add_batch: a missing put
    with pytest.raises(hostfunc.HostFuncError) as info:
        hostfunc.drain()
    assert isinstance(info.value.__cause__, QueueEpochError)
    assert torch.isfinite(static).all()
    assert_extra_put_is_out_of_step(capt, graph, static, case.params, tokens[0])
    graph.reset()
    capt.close()


def test_failed_requests_come_back_with_their_ids(factory, tekken):
    """Compile errors and dead ends come back from take_failed_requests(); other rows are
    masked as usual."""
    V = factory.config.vocab_size_padded
    good = GUIDED[2]
    bad = GuidedDecodingParams(GuideType.REGEX, "(unclosed")
    tokens = encode_continuation(tekken, good.valid)
    capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory)
    capt.add_batch([GuidedRequest.context(1, 0, good.params), GuidedRequest.context(2, 1, bad)])
    logits = torch.zeros(2, V)
    capt.execute(logits)
    failed = capt.take_failed_requests()
    assert [f[0] for f in failed] == [2] and "REGEX" in failed[0][1]
    assert torch.isneginf(logits[0]).any() and torch.isfinite(logits[1]).all()
    capt.add_batch([GuidedRequest.generation(1, 0, good.params, tokens[0]),
                    GuidedRequest.generation(2, 1, bad, tokens[0])])
    capt.execute(torch.zeros(2, V))
    assert capt.take_failed_requests() == []
    capt.close()


def test_callback_exception_reaches_the_caller_and_the_next_step_works(factory, tekken,
                                                                       monkeypatch):
    """An exception injected into the build callback surfaces at the step's drain with its
    traceback and the batch's request ids, and that step masks nothing (not the previous
    step's rows); the batch's requests failed as any failed request does (their matchers
    dropped: no longer guided, not reported again), and the next request on the slot is
    masked normally."""
    V = factory.config.vocab_size_padded
    case = GUIDED[2]
    tokens = encode_continuation(tekken, case.valid)
    capt = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory)
    capt.add_batch([GuidedRequest.context(5, 0, case.params)])
    capt.execute(torch.zeros(1, V))
    original = GuidedDecoder._build

    def broken(self, requests, *args):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(GuidedDecoder, "_build", broken)
    capt.add_batch([GuidedRequest.generation(5, 0, case.params, tokens[0])])
    faulted = torch.zeros(1, V)
    with pytest.raises(hostfunc.HostFuncError, match="injected fault") as info:
        capt.execute(faulted)
    assert torch.isfinite(faulted).all()
    assert "injected fault" in info.value.traceback
    assert info.value.__cause__.request_ids == [5]
    assert [f[0] for f in capt.take_failed_requests()] == [5]
    monkeypatch.setattr(GuidedDecoder, "_build", original)
    assert capt.grammar_matchers[0] is None
    capt.add_batch([GuidedRequest.generation(5, 0, case.params, tokens[0])])
    logits = torch.zeros(1, V)
    capt.execute(logits)
    assert capt.take_failed_requests() == [] and torch.isfinite(logits).all()
    capt.add_batch([GuidedRequest.context(6, 0, case.params)])
    logits = torch.zeros(1, V)
    capt.execute(logits)
    assert capt.take_failed_requests() == [] and torch.isneginf(logits).any()
    capt.close()


def test_draft_loop_equals_eager(factory, tekken):
    """add_draft_batch/execute_draft_batch over a drafting loop, then the target step, mask
    exactly as GuidedDecoder driven through the same loop (draft rows, rollbacks, target rows)."""
    V = factory.config.vocab_size_padded
    case = GUIDED[0]
    text = encode_continuation(tekken, case.valid)
    K = 3
    eager = GuidedDecoder(factory.config, 2, K, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, K, factory=factory)
    ctx = [GuidedRequest.context(1, 1, case.params)]
    eager.add_batch(ctx)
    eager.execute(torch.zeros(1, V))
    capt.add_batch(ctx)
    capt.execute(torch.zeros(1, V))
    draft_loops_pair(eager, capt, case, text, K)
    capt.close()


def draft_loops_pair(eager, capt, case, text, K, seed=3) -> int:
    """Drafting loops of one request in slot 1 (add_draft_batch / execute_draft_batch: the
    golden token, then proposals from ``text`` or off the grammar), each followed by the target
    step verifying them, on ``eager`` (GuidedDecoder through the same loop) and ``capt``: every
    draft row and target row equal. Returns how many loops ran."""
    V = eager.vocab_size_padded
    p, accepted, loops = 0, 0, 0
    rng = random.Random(seed)
    while p + K + 1 < len(text):
        golden = text[p]
        target = GuidedRequest.generation(1, 1, case.params, golden,
                                          num_accepted_draft_tokens=accepted)
        eager.add_batch([target])
        eager.rollback_rejected_tokens()
        capt.add_batch([target])
        proposals = [golden] + [text[p + 1 + i] if rng.random() < 0.7
                                else rng.randrange(1000, 9000) for i in range(K)]
        for k in range(K):
            draft = GuidedRequest(case.params, 1, 1, is_draft=True,
                                  is_generation_in_progress_state=True, new_token=proposals[k])
            eager.add_batch([draft])
            la = torch.randn(1, V, generator=torch.Generator().manual_seed(k))
            lb = la.clone()
            assert eager.execute(la) == []
            capt.add_draft_batch(torch.tensor([proposals[k]]),
                                 torch.tensor([1 + accepted]) if k == 0 else None, k)
            capt.execute_draft_batch(lb, draft_step=k)
            assert capt.take_failed_requests() == []
            assert same(la, lb), f"draft step {k} at position {p}"
        eager.rollback_draft_tokens()
        drafts = proposals[1:]
        target = GuidedRequest.generation(1, 1, case.params, golden, draft_tokens=drafts)
        eager.add_batch([target])
        capt.add_batch([target])
        la = torch.randn(1 + K, V, generator=torch.Generator().manual_seed(p))
        lb = la.clone()
        assert eager.execute(la) == []
        capt.execute(lb)
        assert capt.take_failed_requests() == []
        assert same(la, lb), f"target step at position {p}"
        loops += 1
        match = 0
        while match < K and drafts[match] == text[p + 1 + match]:
            match += 1
        accepted = rng.randint(0, match)
        p += 1 + accepted
    return loops


def test_inactive_step_enqueues_nothing(factory):
    """A step without guided requests (and no capture) enqueues no callback at all."""
    V = factory.config.vocab_size_padded
    capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory)
    before = hostfunc.live_entries()
    capt.add_batch([GuidedRequest.context(1, 0, None), GuidedRequest.context(2, 1, None)])
    assert not capt.active
    logits = torch.randn(2, V)
    expect = logits.clone()
    capt.execute(logits)
    assert hostfunc.live_entries() == before and same(logits, expect)
    capt.close()


def test_runtime_draft_len_passed_positionally_is_a_named_error(factory_cache):
    """CapturableGuidedDecoder.add_batch takes (requests, new_tokens, runtime_draft_len), as
    DESIGN.md specifies; GuidedDecoder's second argument is runtime_draft_len. Code written
    for the eager decoder that passes it positionally gets a clear error, and nothing queued."""
    from capgraph.errors import TensorArgError
    factory = factory_cache("mistral-sp32k")
    capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory)
    try:
        reqs = [GuidedRequest.context(1, 0, GuidedDecodingParams.regex("a+"))]
        with pytest.raises(TensorArgError, match="runtime_draft_len by keyword"):
            capt.add_batch(reqs, 0)
        assert capt.requests is None and capt.queued_batches == 0
        capt.add_batch(reqs, runtime_draft_len=0)  # the keyword form works
        assert capt.queued_batches == 1
    finally:
        capt.close()


class _StreamLog:
    """A StepStreams stand-in that logs the protocol's calls (capturing or not)."""

    def __init__(self, capturing: bool) -> None:
        self.capturing, self.calls = capturing, []

    def is_capturing(self) -> bool:
        return self.capturing

    def side(self):
        import contextlib
        self.calls.append("side")
        return contextlib.nullcontext()

    def __getattr__(self, name):  # wait_tokens, record_tokens, record_bitmask, ...
        return lambda *a: self.calls.append(name)


@pytest.mark.parametrize("capturing,ready,expect", [
    # inside a capture the side stream must wait on an event recorded in that capture
    (True, False, ["record_tokens", "side", "wait_tokens", "record_bitmask"]),
    # ... but not a second time when the caller marked the tokens ready (keeps the overlap)
    (True, True, ["record_tokens", "side", "wait_tokens", "record_bitmask"]),
    # outside a capture add_batch recorded it already
    (False, False, ["side", "wait_tokens", "record_bitmask"]),
])
def test_prepare_records_the_tokens_event_inside_a_capture_once(factory_cache, capturing,
                                                               ready, expect):
    factory = factory_cache("mistral-sp32k")
    # the Python host callback (replaced below): a native node would really be launched on
    # this faked capture (the event order around either is the same code)
    capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node="python")
    try:
        capt.add_batch([GuidedRequest.context(1, 0, GuidedDecodingParams.regex("a+"))])
        original, capt._streams = capt._streams, _StreamLog(capturing)
        log = capt._streams
        capt.host_step = lambda *args: None
        capt.copy_bitmask = lambda n: None
        if ready:
            capt.record_tokens_ready()
        capt.prepare()
        assert log.calls == expect
        capt._prepared = False
        log.calls.clear()
        capt.prepare()  # a later step: the mark was for the previous one, so the same calls
        assert log.calls == expect
    finally:
        capt._streams = original
        capt.close()


@pytest.mark.parametrize("rows, draft_len", [(0, 0), (1, 2), (2, 3)])
def test_new_tokens_short_of_the_steps_positions_are_refused(factory, tekken, rows, draft_len):
    """new_tokens with fewer position rows than 1 + runtime_draft_len (zero rows included)
    was accepted, and the step read the earlier step's tokens left in the buffer; it is a
    TensorArgError at add_batch, before anything is queued."""
    from capgraph.errors import TensorArgError
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    dec = CapturableGuidedDecoder(factory.config, 1, 3, factory=factory)
    dec.add_batch([GuidedRequest.context(1, 0, params)], runtime_draft_len=0)
    dec.execute(torch.zeros(1, factory.config.vocab_size_padded))
    a = encode_continuation(tekken, "a")[0]
    with pytest.raises(TensorArgError, match="position rows"):
        dec.add_batch([GuidedRequest.generation(1, 0, params, None, prev_seq_slot=0)],
                      torch.full((rows, 1), a, dtype=torch.int32), runtime_draft_len=draft_len)
    assert dec.num_advanced_tokens[0] == 0 and len(dec._queue) == 0
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_graphs_of_several_sizes_and_eager_steps_beside_them(factory, tekken, host_node):
    """An engine captures batch sizes smallest first, runs batches larger than any captured
    graph eagerly, and captures drafting loops at several lengths: each is served (eager
    execute refuses only logits with fewer rows than the batch layout)."""
    from capgraph.build import library
    from capgraph.errors import TensorArgError
    if host_node == "native" and library.unavailable_reason():
        pytest.skip(f"the native host node does not build here: {library.unavailable_reason()}")
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    V = factory.config.vocab_size_padded
    a = encode_continuation(tekken, "a")[0]
    dec = CapturableGuidedDecoder(factory.config, 4, 3, factory=factory, host_node=host_node)
    graphs = {}
    for size in (1, 2):
        dec.add_batch([GuidedRequest.context(i, i, params) for i in range(size)],
                      runtime_draft_len=0)
        graphs[size] = (hostfunc.HostGraph(), torch.zeros(size, V))
        with hostfunc.capture(graphs[size][0]):
            dec.execute(graphs[size][1])
    dec.add_batch([GuidedRequest.context(i, i, params) for i in range(4)], runtime_draft_len=0)
    with pytest.raises(TensorArgError, match="fewer than the batch layout"):
        dec.execute(torch.zeros(2, V))
    logits = torch.zeros(4, V)
    dec.execute(logits)  # eager: larger than any captured graph
    assert dec.take_failed_requests() == [] and torch.isneginf(logits).all(dim=1).logical_not().all()
    for length in (2, 3):  # a drafting loop captured at each length
        dec.add_batch([GuidedRequest.generation(0, 0, params, a)], runtime_draft_len=length)
        tokens = torch.full((1,), a, dtype=torch.int32)
        with hostfunc.capture(hostfunc.HostGraph()):
            for k in range(length):
                dec.add_draft_batch(tokens, torch.ones(1, dtype=torch.int32) if k == 0 else None,
                                    k)
                dec.execute_draft_batch(torch.zeros(1, V), draft_step=k)
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_decoders_callback_error_is_raised_by_it_not_by_another(factory, host_node):
    """Decoder A's replay without its add_batch (a QueueEpochError in A's callback) was raised
    by decoder B's execute, which had masked its own row fine, and A never saw it. B's
    execute now raises only B's errors; A's error waits for A (or a global drain)."""
    from capgraph.build import library
    if host_node == "native" and library.unavailable_reason():
        pytest.skip(f"the native host node does not build here: {library.unavailable_reason()}")
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    V = factory.config.vocab_size_padded
    a = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node=host_node)
    b = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node=host_node)
    a.add_batch([GuidedRequest.context(1, 0, params)])
    graph, static = hostfunc.HostGraph(), torch.zeros(1, V)
    with hostfunc.capture(graph):
        a.execute(static)
    a.add_batch([GuidedRequest.context(1, 0, params)])
    graph.replay()
    graph.replay()  # without its add_batch: A's callback raises
    b.add_batch([GuidedRequest.context(7, 0, params)])
    logits = torch.zeros(1, V)
    a._sync_side()  # (A's replayed steps have run: its error is kept, or its node holds it)
    b.execute(logits)
    assert torch.isneginf(logits).any() and b.take_failed_requests() == []
    from hostfunc.registry import REGISTRY
    assert REGISTRY.pending_errors() == 1  # A's, kept
    with pytest.raises(hostfunc.HostFuncError, match="QueueEpochError"):
        hostfunc.drain()
    a.close()
    b.close()


def _native_or_skip(host_node: str) -> None:
    from capgraph.build import library
    if host_node == "native" and library.unavailable_reason():
        pytest.skip(f"the native host node does not build here: {library.unavailable_reason()}")


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_replay_for_more_rows_than_its_capture_fails_the_requests_past_them(
        factory, tekken, host_node):
    """A graph captured for 2 logits rows, replayed for a batch whose layout needs 4 (two
    requests of 1 + 1 draft rows): the first request's rows are masked and its matcher
    advances; the second's rows lie past the captured ones, so its tokens would be sampled
    unmasked: it fails with a LayoutError naming its rows and its matcher moves no further."""
    _native_or_skip(host_node)
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    V = factory.config.vocab_size_padded
    a = encode_continuation(tekken, "a")[0]
    x = encode_continuation(tekken, "x")[0]
    dec = CapturableGuidedDecoder(factory.config, 2, 1, factory=factory, host_node=host_node)
    contexts = [GuidedRequest.context(1, 0, params), GuidedRequest.context(2, 1, params)]
    graph, static = hostfunc.HostGraph(), torch.zeros(2, V)
    dec.add_batch(contexts, runtime_draft_len=0)
    with hostfunc.capture(graph):
        dec.execute(static)
    dec.add_batch(contexts, runtime_draft_len=0)
    graph.replay()
    hostfunc.drain()
    assert dec.take_failed_requests() == []
    dec.add_batch([GuidedRequest.generation(1, 0, params, a, draft_tokens=[a]),
                   GuidedRequest.generation(2, 1, params, a, draft_tokens=[a])],
                  runtime_draft_len=1)
    static.zero_()
    graph.replay()
    hostfunc.drain()
    failed = dec.take_failed_requests()
    assert [rid for rid, _ in failed] == [2], failed
    assert failed[0][1].startswith("LayoutError") and "[2, 4)" in failed[0][1] \
        and "2 logits rows" in failed[0][1]
    assert dec.num_advanced_tokens[0] == 2 and dec.num_advanced_tokens[1] == 0
    assert dec.grammar_matchers[1] is None and dec.grammar_matchers[0] is not None
    for row in range(2):  # the first request's rows: after "a", then "aa": no "x" yet
        assert torch.isfinite(static[row, a]) and torch.isneginf(static[row, x])
    graph.reset()
    dec.close()


def test_prepare_below_the_batch_layout_fails_the_requests_past_its_rows(factory, tekken):
    """``prepare(num_rows)`` copies that many bitmask rows: a request past them fails (its
    rows are not masked), and execute masks only the prepared rows."""
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    V = factory.config.vocab_size_padded
    dec = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node="python")
    dec.add_batch([GuidedRequest.context(1, 0, params), GuidedRequest.context(2, 1, params)])
    dec.prepare(1)
    logits = torch.zeros(2, V)
    dec.execute(logits)
    failed = dec.take_failed_requests()
    assert [rid for rid, _ in failed] == [2] and "[1, 2)" in failed[0][1]
    assert torch.isneginf(logits[0]).any() and not torch.isneginf(logits[1]).any()
    assert dec.grammar_matchers[0] is not None and dec.grammar_matchers[1] is None
    dec.close()


def _loop_decoders(factory, host_node: str, params, K: int):
    """An eager decoder and a capturable one past one context step of ``params`` on slot 0,
    the capturable one's step captured first (so that a native node serves every step), and
    that step's graph."""
    V = factory.config.vocab_size_padded
    eager = GuidedDecoder(factory.config, 1, K, factory=factory)
    dec = CapturableGuidedDecoder(factory.config, 1, K, factory=factory, host_node=host_node)
    context = [GuidedRequest.context(1, 0, params)]
    step_graph = hostfunc.HostGraph()
    dec.add_batch(context, runtime_draft_len=0)
    with hostfunc.capture(step_graph):
        dec.execute(torch.zeros(1, V))
    eager.add_batch(context)
    eager.execute(torch.zeros(1, V))
    dec.add_batch(context, runtime_draft_len=0)
    dec.execute(torch.zeros(1, V))
    return eager, dec, step_graph


@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("captured_len, runtime_len, one_graph", [
    (3, 1, False),  # a graph per draft step, captured at 3; a step drafting 1 replays one
    (1, 3, True),  # one graph of 3 steps captured while the batch drafted 1; replayed for 3
    (3, 2, True),  # one graph of 3 steps replayed for a batch drafting 2: the third is idle
])
def test_a_drafting_loop_ends_where_its_replayed_batch_ends(factory, tekken, host_node,
                                                            captured_len, runtime_len,
                                                            one_graph):
    """Which step of a captured drafting loop is its last is read from the batch a replay
    takes, not from the capture: the draft masks, and the target step after the loop, equal
    the eager decoder's for that batch (a loop ended at the captured length left the draft
    advances in the matcher, and the target step masked after the wrong prefix)."""
    _native_or_skip(host_node)
    K = 3
    params = GuidedDecodingParams.regex("a{3}b")
    V = factory.config.vocab_size_padded
    a = encode_continuation(tekken, "a")[0]
    eager, dec, step_graph = _loop_decoders(factory, host_node, params, K)
    statics = [torch.zeros(1, V) for _ in range(K)]
    tokens, accepted = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    dec.add_batch([GuidedRequest.generation(1, 0, params, a)], runtime_draft_len=captured_len)
    graphs = [hostfunc.HostGraph() for _ in range(1 if one_graph else K)]

    def draft_step(k: int) -> None:
        dec.add_draft_batch(tokens, accepted if k == 0 else None, k)
        dec.execute_draft_batch(statics[k], draft_step=k)
    if one_graph:
        with hostfunc.capture(graphs[0]):
            for k in range(K):
                draft_step(k)
    else:
        for k in range(K):
            with hostfunc.capture(graphs[k]):
                draft_step(k)
    target = GuidedRequest.generation(1, 0, params, a)
    eager.add_batch([target], runtime_len)
    eager.rollback_rejected_tokens()
    expected = []
    for _ in range(runtime_len):
        eager.add_batch([GuidedRequest(params, 1, 0, is_draft=True, new_token=a,
                                       is_generation_in_progress_state=True)], runtime_len)
        row = torch.zeros(1, V)
        eager.execute(row)
        expected.append(row)
    eager.rollback_draft_tokens()
    dec.add_batch([target], runtime_draft_len=runtime_len)
    tokens[0] = a
    for graph in (graphs if one_graph else graphs[:runtime_len]):
        graph.replay()
    hostfunc.drain()
    assert dec.take_failed_requests() == []
    for k in range(runtime_len):
        assert same(statics[k], expected[k]), k
    for k in range(runtime_len, K if one_graph else runtime_len):
        assert not torch.isneginf(statics[k]).any(), k  # past the batch's last step: idle
    verify = GuidedRequest.generation(1, 0, params, a, draft_tokens=[a] * runtime_len)
    eager.add_batch([verify], runtime_len)
    dec.add_batch([verify], runtime_draft_len=runtime_len)
    want, got = torch.zeros(1 + runtime_len, V), torch.zeros(1 + runtime_len, V)
    assert eager.execute(want) == []
    dec.execute(got)
    assert dec.take_failed_requests() == [] and same(want, got)
    if host_node == "native":  # (the loops ran in the node, not in its Python step)
        assert dec.host_node_stats.python_draft_runs == 0, dec.host_node_stats
    for graph in graphs + [step_graph]:
        graph.reset()
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("draft_text", ["a", "x"])  # accepted; refused (drafting stops)
@pytest.mark.parametrize("next_step", ["target", "loop"])
def test_a_drafting_loop_cut_short_is_ended_by_the_next_step(factory, tekken, host_node,
                                                             draft_text, next_step):
    """A replay that runs two of its batch's three draft steps never reaches the loop's
    last step: the next step taking a batch (a target step, or the next loop's first step)
    ends the loop first. Before, the draft advances stayed in the matcher (the target step
    masked after the draft prefix) and a slot whose draft token was refused stayed
    unguided."""
    _native_or_skip(host_node)
    K = 3
    params = GuidedDecodingParams.regex("a{3}b")
    V = factory.config.vocab_size_padded
    a = encode_continuation(tekken, "a")[0]
    d_tok = encode_continuation(tekken, draft_text)[0]
    eager, dec, step_graph = _loop_decoders(factory, host_node, params, K)
    statics = [torch.zeros(1, V) for _ in range(K)]
    tokens, accepted = torch.zeros(1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    dec.add_batch([GuidedRequest.generation(1, 0, params, a)], runtime_draft_len=K)
    graphs = [hostfunc.HostGraph() for _ in range(K)]
    for k in range(K):
        with hostfunc.capture(graphs[k]):
            dec.add_draft_batch(tokens, accepted if k == 0 else None, k)
            dec.execute_draft_batch(statics[k], draft_step=k)
    target = GuidedRequest.generation(1, 0, params, a)
    eager.add_batch([target], K)
    eager.rollback_rejected_tokens()
    for token in (a, d_tok):
        eager.add_batch([GuidedRequest(params, 1, 0, is_draft=True, new_token=token,
                                       is_generation_in_progress_state=True)], K)
        eager.execute(torch.zeros(1, V))
    eager.rollback_draft_tokens()
    dec.add_batch([target], runtime_draft_len=K)
    for k, token in enumerate((a, d_tok)):  # steps 0 and 1 only: the loop is cut short
        tokens[0] = token
        graphs[k].replay()
    hostfunc.drain()
    if next_step == "target":
        verify = GuidedRequest.generation(1, 0, params, a, draft_tokens=[a])
        eager.add_batch([verify], 1)
        dec.add_batch([verify], runtime_draft_len=1)
        want, got = torch.zeros(2, V), torch.zeros(2, V)
        assert eager.execute(want) == []
        dec.execute(got)
    else:  # the next loop's first step, for a target that took "a" again
        again = GuidedRequest.generation(1, 0, params, a)
        eager.add_batch([again], K)
        eager.rollback_rejected_tokens()
        eager.add_batch([GuidedRequest(params, 1, 0, is_draft=True, new_token=a,
                                       is_generation_in_progress_state=True)], K)
        want = torch.zeros(1, V)
        assert eager.execute(want) == []
        dec.add_batch([again], runtime_draft_len=K)
        tokens[0] = a
        graphs[0].replay()
        hostfunc.drain()
        got = statics[0]
    assert dec.take_failed_requests() == []
    assert torch.isneginf(got).any() and same(want, got)
    if host_node == "native":  # the cut loop ran in the node; the next loop's first step,
        # which ended it, is a Python step of the node (as the Python step after it)
        stats = dec.host_node_stats
        assert stats.draft_runs - stats.python_draft_runs == 2, stats
    for graph in graphs + [step_graph]:
        graph.reset()
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_second_request_on_a_slot_past_the_captured_rows_leaves_the_first_guided(
        factory, tekken, host_node):
    """A replayed batch of two requests on one slot whose second lies past the one captured
    row: the second fails as the eager decoder fails it ("appears twice"), and the first
    keeps the slot's matcher and its masked row, then and at the next step. Before, the
    second's failure dropped the slot's matcher: the first went unguided with no failure."""
    _native_or_skip(host_node)
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    V = factory.config.vocab_size_padded
    a, b = (encode_continuation(tekken, t)[0] for t in ("a", "b"))
    eager = GuidedDecoder(factory.config, 2, 0, factory=factory)
    dec = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node=host_node)
    context = [GuidedRequest.context(1, 0, params)]
    eager.add_batch(context)
    eager.execute(torch.zeros(1, V))
    dec.add_batch(context, runtime_draft_len=0)
    dec.execute(torch.zeros(1, V))
    graph, static = hostfunc.HostGraph(), torch.zeros(1, V)
    dec.add_batch([GuidedRequest.placeholder(99)], runtime_draft_len=0)
    with hostfunc.capture(graph):
        dec.execute(static)
    for batch in ([GuidedRequest.generation(1, 0, params, a),
                   GuidedRequest.generation(2, 0, params, a)],
                  [GuidedRequest.generation(1, 0, params, b)]):
        eager.add_batch(batch)
        want = torch.zeros(len(batch), V)
        expected = eager.execute(want)
        dec.add_batch(batch, runtime_draft_len=0)
        static.zero_()
        graph.replay()
        hostfunc.drain()
        assert dec.take_failed_requests() == expected
        assert torch.isneginf(static[0]).any() and same(static[0], want[0])
        assert dec.grammar_matchers[0] is not None
    graph.reset()
    dec.close()
    eager.close()


def _capturable_and_eager(factory, host_node: str, seqs: int):
    """A capturable decoder on ``host_node`` and an eager one, ``seqs`` slots, no drafts."""
    return (CapturableGuidedDecoder(factory.config, seqs, 0, factory=factory,
                                    host_node=host_node),
            GuidedDecoder(factory.config, seqs, 0, factory=factory))


def _replay_fails_request_11_on_row_1(dec, graph) -> None:
    """Replay ``graph`` (captured for one row) for a batch with request 11 on slot 1 at row
    1: it fails alone with a LayoutError, its matcher dropped and its row not built; then
    the graph and the decoder are released."""
    graph.replay()
    hostfunc.drain()
    failed = dec.take_failed_requests()
    assert [rid for rid, _ in failed] == [11] and failed[0][1].startswith("LayoutError"), failed
    assert dec.grammar_matchers[1] is None and int(dec.token_mask_host[1]) == 0
    graph.reset()
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("ending", ["refused", "eos"])  # drafting stopped; matcher terminated
@pytest.mark.parametrize("next_step", ["target", "loop"])
def test_a_request_past_the_captured_rows_fails_after_a_loop_cut_short(
        factory, tekken, host_node, ending, next_step):
    """A drafting loop cut short after a draft that stopped the slot's drafting (a refused
    token) or terminated its matcher (EOS), then a step replayed from a graph captured for one
    row, with the request at row 1: the cut loop is ended before the rows are checked, so the
    request, guided again, fails with a LayoutError and its row is not built (a check made
    first would read the slot as having nothing to guide, and the build would then guide a
    row the graph never masks, unreported)."""
    _native_or_skip(host_node)
    eos = factory.config.stop_token_ids[0]
    params = GuidedDecodingParams.regex("a{3}b" if ending == "refused" else "a{1,5}")
    V = factory.config.vocab_size_padded
    a = encode_continuation(tekken, "a")[0]
    d_tok = encode_continuation(tekken, "x")[0] if ending == "refused" else eos
    dec = CapturableGuidedDecoder(factory.config, 2, 3, factory=factory, host_node=host_node)
    tokens, accepted = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    graph, static = hostfunc.HostGraph(), torch.zeros(1, V)  # one row
    if next_step == "target":
        dec.add_batch([GuidedRequest.placeholder(99)], runtime_draft_len=0)
        with hostfunc.capture(graph):
            dec.execute(static)
    else:  # a one-step drafting loop
        dec.add_batch([GuidedRequest.placeholder(99, 1)], runtime_draft_len=1)
        with hostfunc.capture(graph):
            dec.add_draft_batch(tokens, accepted, 0)
            dec.execute_draft_batch(static, draft_step=0)
    dec.add_batch([GuidedRequest.context(11, 1, params)], runtime_draft_len=0)
    dec.execute(torch.zeros(1, V))
    dec.add_batch([GuidedRequest.generation(11, 1, params, a)], runtime_draft_len=3)
    for k, token in enumerate((a, d_tok)):  # steps 0 and 1 of 3
        tokens[0] = token
        dec.add_draft_batch(tokens, accepted if k == 0 else None, k)
        dec.execute_draft_batch(torch.zeros(1, V), draft_step=k)
    hostfunc.drain()
    assert dec.take_failed_requests() == []
    assert dec.is_draft_terminated[1] or dec.grammar_matchers[1].is_terminated()
    dec.add_batch([GuidedRequest.placeholder(98, 0 if next_step == "target" else 1),
                   GuidedRequest.generation(11, 1, params, a)],
                  runtime_draft_len=0 if next_step == "target" else 1)
    tokens[:] = torch.tensor([0, a])
    _replay_fails_request_11_on_row_1(dec, graph)


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_drafting_loop_checks_its_rows_after_the_rollback_of_rejected_tokens(
        factory, tekken, host_node):
    """A loop captured for one request, replayed with the request at row 1, whose matcher a
    draft EOS terminated at verification and the target rejected: the loop's first step rolls
    the EOS back (the matcher guides again) and only then checks the rows, so the request
    fails with a LayoutError on both host nodes (a check made first would read the matcher
    as terminated, and the build would then fill a row the graph never masks)."""
    _native_or_skip(host_node)
    eos = factory.config.stop_token_ids[0]
    params = GuidedDecodingParams.regex("a{1,5}")
    V = factory.config.vocab_size_padded
    a = encode_continuation(tekken, "a")[0]
    dec = CapturableGuidedDecoder(factory.config, 2, 1, factory=factory, host_node=host_node)
    dec.add_batch([GuidedRequest.placeholder(99), GuidedRequest.context(11, 1, params)],
                  runtime_draft_len=0)
    dec.execute(torch.zeros(2, V))
    tokens, accepted = torch.zeros(2, dtype=torch.int32), torch.ones(2, dtype=torch.int32)
    graph, static = hostfunc.HostGraph(), torch.zeros(1, V)
    dec.add_batch([GuidedRequest.placeholder(98, 1)], runtime_draft_len=1)
    with hostfunc.capture(graph):
        dec.add_draft_batch(tokens, accepted, 0)
        dec.execute_draft_batch(static, draft_step=0)
    dec.add_batch([GuidedRequest.placeholder(97, 1),
                   GuidedRequest.generation(11, 1, params, a, draft_tokens=[eos])],
                  runtime_draft_len=1)
    dec.execute(torch.zeros(4, V))
    hostfunc.drain()
    assert dec.take_failed_requests() == [] and dec.grammar_matchers[1].is_terminated()
    dec.add_batch([GuidedRequest.placeholder(96, 1), GuidedRequest.generation(11, 1, params, a)],
                  runtime_draft_len=1)
    tokens[:] = torch.tensor([0, a])  # (accepted: 1 each, the EOS draft rejected)
    _replay_fails_request_11_on_row_1(dec, graph)


@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("kind", ["context", "generation"])
def test_a_second_request_on_the_slot_of_one_past_the_captured_rows_fails_as_twice(
        factory, tekken, host_node, kind):
    """Two requests on one slot, the first past the one captured row: the first fails with a
    LayoutError and the second as the eager decoder fails it ("appears twice"), its row not
    built and the slot left without a matcher (the first one's stand-in holds no slot, so
    the build alone would let the second take it unreported). Two context requests of two
    requests, or the slot's owner twice in generation (a generation request of another
    request is refused at admission)."""
    _native_or_skip(host_node)
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    V = factory.config.vocab_size_padded
    a = encode_continuation(tekken, "a")[0]
    dec, eager = _capturable_and_eager(factory, host_node, 3)
    for d in (dec, eager):
        d.add_batch([GuidedRequest.context(1, 0, params)])
        d.execute(torch.zeros(1, V))
    graph, static = hostfunc.HostGraph(), torch.zeros(1, V)
    dec.add_batch([GuidedRequest.placeholder(99)], runtime_draft_len=0)
    with hostfunc.capture(graph):
        dec.execute(static)
    make = (lambda rid: GuidedRequest.context(rid, 0, params)) if kind == "context" else \
        (lambda rid: GuidedRequest.generation(rid, 0, params, a))
    second = 2 if kind == "context" else 1  # (a generation request of the slot's owner)
    batch = [GuidedRequest.placeholder(98), make(1), make(second)]
    eager.add_batch(batch)
    twice = [f for f in eager.execute(torch.zeros(3, V)) if "appears twice" in f[1]]
    assert len(twice) == 1 and twice[0][0] == second
    dec.add_batch(batch, runtime_draft_len=0)
    graph.replay()
    hostfunc.drain()
    failed = dec.take_failed_requests()
    assert [rid for rid, _ in failed] == [1, second], failed
    assert failed[0][1].startswith("LayoutError") and failed[1] == twice[0]
    assert dec.grammar_matchers[0] is None and dec.token_mask_host[:3].tolist() == [0, 0, 0]
    graph.reset()
    dec.close()
    eager.close()


@pytest.mark.parametrize("refused", ["execute", "execute_argmax wide", "execute_argmax out"])
@pytest.mark.parametrize("host_node", ["python", "native"])
def test_an_add_batch_after_a_refused_execute_of_a_prepared_step_runs_its_own_step(
        factory, tekken, host_node, refused):
    """``prepare()`` ran a step's host work and its ``execute`` (or ``execute_argmax``) was
    refused (logits of the wrong width, a bad ``out``); the engine moves on with the next
    ``add_batch``: that step runs its own host work and masks as the eager decoder does,
    rather than apply the prepared step's mask and leave every later step one batch
    behind."""
    from capgraph.errors import TensorArgError
    _native_or_skip(host_node)
    params = GuidedDecodingParams.regex("[a-c]{5}x")
    V = factory.config.vocab_size_padded
    a = encode_continuation(tekken, "a")[0]
    dec, eager = _capturable_and_eager(factory, host_node, 1)
    context = [GuidedRequest.context(1, 0, params)]
    dec.add_batch(context)
    eager.add_batch(context)
    eager.execute(torch.zeros(1, V))
    dec.prepare()
    with pytest.raises(TensorArgError):
        if refused == "execute":
            dec.execute(torch.zeros(1, V + 7))
        elif refused == "execute_argmax wide":
            dec.execute_argmax(torch.zeros(1, V + 7))
        else:
            dec.execute_argmax(torch.zeros(1, V), torch.zeros(1, dtype=torch.int32))
    for _ in range(3):
        step = [GuidedRequest.generation(1, 0, params, a)]
        dec.add_batch(step)
        eager.add_batch(step)
        got, want = torch.zeros(1, V), torch.zeros(1, V)
        dec.execute(got)
        hostfunc.drain()
        assert eager.execute(want) == [] and dec.take_failed_requests() == []
        assert torch.isneginf(got).any() and same(got, want)
    assert dec.num_advanced_tokens[0] == 1
    dec.close()
    eager.close()


@pytest.mark.parametrize("num_rows", [0, -1, 3, 2.0, "2", True])
def test_prepare_names_a_bad_num_rows_before_any_work(factory, num_rows):
    """``prepare(num_rows)`` outside ``[1, bitmask rows]``, or not an int, is a LayoutError
    naming it, and nothing is enqueued: the step then runs whole."""
    from capgraph.errors import LayoutError
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    V = factory.config.vocab_size_padded
    dec = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node="python")
    dec.add_batch([GuidedRequest.context(1, 0, params), GuidedRequest.context(2, 1, params)])
    with pytest.raises(LayoutError, match=r"num_rows=.* must be None or an int in \[1, 2\]"):
        dec.prepare(num_rows)
    logits = torch.zeros(2, V)
    dec.execute(logits)
    assert dec.take_failed_requests() == [] and torch.isneginf(logits).any(dim=1).all()
    dec.close()


def test_a_second_prepare_for_other_rows_is_named(factory):
    """A step prepared for one row, prepared again for two: a LayoutError naming both (the
    host work is enqueued for the first); again for one row, or with no count, is a no-op,
    and the step masks the one prepared row."""
    from capgraph.errors import LayoutError
    params = GuidedDecodingParams.regex("[a-c]{3}x")
    V = factory.config.vocab_size_padded
    dec = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node="python")
    dec.add_batch([GuidedRequest.context(1, 0, params)])
    dec.prepare(1)
    with pytest.raises(LayoutError, match=r"num_rows=2 for a step prepared already for 1 rows"):
        dec.prepare(2)
    dec.prepare(1)
    dec.prepare()
    logits = torch.zeros(2, V)
    dec.execute(logits)
    assert dec.take_failed_requests() == []
    assert torch.isneginf(logits[0]).any() and not torch.isneginf(logits[1]).any()
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_prepared_step_survives_the_next_steps_add_batch(factory, tekken, host_node):
    """``add_batch(N); prepare(); add_batch(N + 1); execute(N)``: the next step's batch is
    queued before the prepared step's execute, which applies the prepared step; every step
    masks as the eager decoder does."""
    _native_or_skip(host_node)
    params = GuidedDecodingParams.regex("abab")
    V = factory.config.vocab_size_padded
    a, b = (encode_continuation(tekken, t)[0] for t in ("a", "b"))
    dec, eager = _capturable_and_eager(factory, host_node, 1)
    steps = [[GuidedRequest.context(1, 0, params)]] + [
        [GuidedRequest.generation(1, 0, params, t)] for t in (a, b, a)]
    wants = []
    for step in steps:
        eager.add_batch(step)
        wants.append(torch.zeros(1, V))
        assert eager.execute(wants[-1]) == []
    dec.add_batch(steps[0])
    dec.prepare()
    for n, want in enumerate(wants):
        if n + 1 < len(steps):
            dec.add_batch(steps[n + 1])
        got = torch.zeros(1, V)
        dec.execute(got)
        hostfunc.drain()
        assert dec.take_failed_requests() == [] and same(got, want), n
        if n + 1 < len(steps):
            dec.prepare()
    dec.close()
    eager.close()


class _LookAlike:
    """A request object that is not a GuidedRequest (an engine's own type with the fields)."""

    def __init__(self, request: GuidedRequest) -> None:
        for name in GuidedRequest.__slots__:
            setattr(self, name, getattr(request, name))


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_handed_over_requests_are_queued_as_they_are_and_mask_as_copies(factory, tekken,
                                                                        host_node):
    """add_batch(copy=False) queues exact GuidedRequest instances themselves (the caller hands
    them over) and still copies any other request object; the replayed steps mask exactly as
    those of a decoder that copies every request, on either host node; a copy that is not a
    bool is a named LayoutError, nothing queued."""
    from capgraph.build import library
    if host_node == "native" and library.unavailable_reason():
        pytest.skip(f"the native host node does not build here: {library.unavailable_reason()}")
    V = factory.config.vocab_size_padded
    cases = GUIDED[:3]
    texts = [encode_continuation(tekken, c.valid) for c in cases]
    steps = min(len(t) for t in texts)
    decoders = [CapturableGuidedDecoder(factory.config, 3, 0, factory=factory,
                                        host_node=host_node) for _ in range(2)]
    statics = [torch.zeros(3, V) for _ in decoders]

    def requests(step):
        if step == 0:
            return [GuidedRequest.context(i, i, c.params) for i, c in enumerate(cases)]
        return [GuidedRequest.generation(i, i, c.params, texts[i][step - 1])
                for i, c in enumerate(cases)]

    graphs = []
    for dec, static in zip(decoders, statics):
        dec.add_batch(requests(0))  # shapes for the capture
        graph = hostfunc.HostGraph()
        with hostfunc.capture(graph):
            dec.execute(static)
        graphs.append(graph)
    copying, taking = decoders
    for step in range(steps):
        logits = torch.randn(3, V, generator=torch.Generator().manual_seed(step))
        copied = requests(step)
        handed = requests(step)
        handed[1] = _LookAlike(handed[1])  # (not an exact instance: copied all the same)
        copying.add_batch(copied)
        taking.add_batch(handed, copy=False)
        queued = taking.requests.requests
        if step:  # (a context step's requests are rewritten by admission's checks anyway)
            assert queued[0] is handed[0] and queued[2] is handed[2]
        assert queued[1] is not handed[1] and type(queued[1]) is GuidedRequest
        assert all(q is not r for q, r in zip(copying.requests.requests, copied))
        for dec, static, graph in zip(decoders, statics, graphs):
            static.copy_(logits)
            graph.replay()
            hostfunc.drain()
            assert dec.take_failed_requests() == []
        assert same(statics[0], statics[1]), f"step {step}"
        assert torch.isneginf(statics[1]).any()
    from capgraph.errors import LayoutError
    for bad in (0, "no", None):  # (named before anything is read or queued)
        with pytest.raises(LayoutError, match="copy=.* is not a bool"):
            taking.add_batch(requests(1), copy=bad)
    assert taking.queued_batches == 0
    for dec, graph in zip(decoders, graphs):
        graph.reset()
        dec.close()
