"""The native host node (``CapturableGuidedDecoder(host_node="native")``) on hostfunc's CPU
stand-in: a captured step replayed through the C++ node gives the eager decoder's masks,
failures and matcher states; its steady state runs while another thread holds the GIL; a batch
it cannot run natively becomes a Python step inside the node; queue epochs, warm-up and
lifetimes hold as on the Python host callback."""

from __future__ import annotations

import gc
import random
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hostfunc
from capgraph import ConfigError, GuideType, QueueEpochError
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation
from cases import CASES
from gil import LEAD_MS, hold_gil
from test_capturable import (Scenario, assert_extra_put_is_out_of_step,
                             assert_same_matcher_states, assert_warmup_replays_mask_nothing,
                             draft_loops_pair)

GUIDED = [c for c in CASES if c.params.guide_type in
          (GuideType.JSON_SCHEMA, GuideType.REGEX, GuideType.EBNF_GRAMMAR)]
MS = 1_000_000


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def capture(decoder: CapturableGuidedDecoder, requests, logits: torch.Tensor,
            prepare_first: bool = False) -> hostfunc.HostGraph:
    """Capture one step of ``decoder`` (its shapes from ``requests``) into a HostGraph;
    ``prepare_first``: its host work enqueued before the (here absent) forward, as
    ``generate()`` captures it, rather than by ``execute``."""
    decoder.add_batch(requests)
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        if prepare_first:
            decoder.record_tokens_ready()
            decoder.prepare(logits.shape[0])
        decoder.execute(logits)
    return graph


def texts_of(tekken, cases):
    return [encode_continuation(tekken, c.valid) for c in cases]


def context_requests(cases):
    """Each case's context request, in slot = request id = its index."""
    return [GuidedRequest.context(i, i, c.params) for i, c in enumerate(cases)]


def generation_requests(cases, tokens):
    """Each case's generation request with its token (slots and ids as context_requests)."""
    return [GuidedRequest.generation(i, i, c.params, t)
            for i, (c, t) in enumerate(zip(cases, tokens))]


def after_two_steps(factory, tekken, cases, capture_with=None):
    """A native-node decoder whose captured step (``capture_with(decoder, requests,
    static)``; default :func:`capture`) has run ``cases``' context step and their first
    generation step (add_batch both, each drained, no failure): ``(decoder, graph, static
    logits, texts)``."""
    texts = texts_of(tekken, cases)
    capt = CapturableGuidedDecoder(factory.config, len(cases), 0, factory=factory,
                                   host_node="native")
    static = torch.zeros(len(cases), factory.config.vocab_size_padded)
    graph = (capture_with or capture)(capt, context_requests(cases), static)
    for batch in (context_requests(cases), generation_requests(cases, [t[0] for t in texts])):
        capt.add_batch(batch)
        graph.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == []
    return capt, graph, static, texts


def decoders_for(factory, tekken, cases, host_node):
    """One slot per case: the cases' token texts, the steps all of them have, an eager
    decoder, a capturable one on ``host_node`` and zero static logits, one row per case."""
    texts = texts_of(tekken, cases)
    n = len(cases)
    eager = GuidedDecoder(factory.config, n, 0, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, n, 0, factory=factory, host_node=host_node)
    return (texts, min(len(t) for t in texts), eager, capt,
            torch.zeros(n, factory.config.vocab_size_padded))


def one_request_after_context(factory, tekken, case, host_node="native"):
    """A one-slot decoder (native node by default) whose captured step has replayed
    ``case``'s context step: ``(decoder, graph, static logits, the case's tokens)``."""
    capt = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node=host_node)
    static = torch.zeros(1, factory.config.vocab_size_padded)
    graph = capture(capt, [GuidedRequest.context(1, 0, case.params)], static)
    capt.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph.replay()
    hostfunc.drain()
    return capt, graph, static, texts_of(tekken, [case])[0]


@pytest.mark.parametrize("prepare_first", [False, True], ids=["in-execute", "prepared-first"])
@pytest.mark.parametrize("host_node", ["native", "python"])
def test_replayed_steps_equal_the_eager_decoder(factory, tekken, native_ok, host_node,
                                                prepare_first):
    """Three schema/regex/EBNF requests decoded through a replayed HostGraph, tokens from the
    pinned token buffer: every step's masked logits and token mask equal GuidedDecoder's, on
    the native node (which runs every step natively, the context step's matchers created at
    its add_batch) and on the Python callback, whether the capture enqueued the host work in
    ``execute`` or with ``prepare`` before it."""
    V = factory.config.vocab_size_padded
    cases = GUIDED[:3]
    texts, steps, eager, capt, static = decoders_for(factory, tekken, cases, host_node)
    assert capt.host_node == host_node

    def requests(step, buffered):
        if step == 0:
            return [GuidedRequest.context(i, i, c.params) for i, c in enumerate(cases)]
        return [GuidedRequest.generation(i, i, c.params, None if buffered else texts[i][step - 1],
                                         prev_seq_slot=i) for i, c in enumerate(cases)]

    graph = capture(capt, requests(0, False), static, prepare_first)
    assert capt.queued_batches == 0  # (the capture's batch gave the shapes alone)
    for step in range(steps):
        logits = torch.randn(3, V, generator=torch.Generator().manual_seed(step))
        eager.add_batch(requests(step, False))
        expect = logits.clone()
        assert eager.execute(expect) == []
        tokens = torch.zeros(1, 3, dtype=torch.int32)
        if step:
            tokens[0] = torch.tensor([t[step - 1] for t in texts], dtype=torch.int32)
        capt.add_batch(requests(step, step > 0), tokens if step else None)
        static.copy_(logits)
        graph.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == []
        assert same(static, expect), f"step {step}"
        assert torch.equal(capt.token_mask_host[:3], eager.token_mask_host[:3])
        assert capt.num_advanced_tokens == eager.num_advanced_tokens
    if host_node == "native":
        stats = capt.host_node_stats
        assert stats.runs == steps and stats.python_runs == 0
        assert stats.rows > 0
    else:
        assert capt.host_node_stats is None
    graph.reset()
    capt.close()


def test_python_only_slot_makes_a_python_step(factory, tekken, native_ok):
    """A slot whose matcher only Python can run (here: a wrapper that is not xgrammar's
    matcher) turns the node's step into a Python step, with the same masks; once the slot
    holds a native matcher again the node runs natively."""
    case = GUIDED[0]
    capt, graph, _static, text = one_request_after_context(factory, tekken, case)
    native = capt.grammar_matchers[0]

    capt.grammar_matchers[0] = PythonOnly(native)
    before = capt.host_node_stats.python_runs
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert capt.host_node_stats.python_runs == before + 1
    assert capt.num_advanced_tokens[0] == 1 and capt.token_mask_host[0] == 1
    capt.grammar_matchers[0] = native
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[1])])
    graph.replay()
    hostfunc.drain()
    assert capt.host_node_stats.python_runs == before + 1  # native again
    assert capt.num_advanced_tokens[0] == 1 and capt.token_mask_host[0] == 1
    graph.reset()
    capt.close()


def test_failed_request_is_isolated_in_a_native_step(factory, tekken, native_ok):
    """A request whose new token the grammar refuses, inside a native step, fails alone: it is
    reported by take_failed_requests with its id, its rows stay unmasked and its matcher is
    dropped (the next step leaves it unguided), while the other request's row is masked as the
    eager decoder masks it."""
    V = factory.config.vocab_size_padded
    cases, texts, eager, capt, ctx = two_requests(factory, tekken, 0)
    static = torch.zeros(2, V)
    graph = capture(capt, ctx, static)
    for d in (eager,):
        d.add_batch(ctx)
        d.execute(torch.zeros(2, V))
    capt.add_batch(ctx)
    graph.replay()
    hostfunc.drain()
    bad = GuidedRequest.generation(1, 0, cases[0].params, tokenizer_refused(eager, 0, V))
    good = GuidedRequest.generation(2, 1, cases[1].params, texts[1][0])
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    eager.add_batch([bad, good])
    expect = logits.clone()
    failed_eager = eager.execute(expect)
    capt.add_batch([bad, good])
    static.copy_(logits)
    graph.replay()
    hostfunc.drain()
    failed = capt.take_failed_requests()
    assert [i for i, _ in failed] == [1] and failed == failed_eager
    assert capt.token_mask_host[0] == 0 and capt.token_mask_host[1] == 1
    assert same(static, expect)
    assert capt.grammar_matchers[0] is None
    # the next step: request 1 unguided, request 2 guided
    capt.add_batch([GuidedRequest.generation(1, 0, cases[0].params, 5),
                    GuidedRequest.generation(2, 1, cases[1].params, texts[1][1])])
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert capt.token_mask_host[0] == 0 and capt.token_mask_host[1] == 1
    graph.reset()
    capt.close()


def test_a_buffer_token_the_grammar_refuses_is_named_in_a_native_step(factory, tekken,
                                                                       native_ok):
    """A native step whose tokens come from the token buffer (add_batch's ``new_tokens``),
    not from its requests: the request whose buffer token the grammar refuses fails alone,
    its report names that token word for word as the eager decoder's does (given the token
    as the request's own), and the other request's row is masked as the eager decoder masks
    it."""
    V = factory.config.vocab_size_padded
    cases, texts, eager, capt, ctx = two_requests(factory, tekken, 0)
    static = torch.zeros(2, V)
    graph = capture(capt, ctx, static)
    eager.add_batch(ctx)
    eager.execute(torch.zeros(2, V))
    capt.add_batch(ctx)
    graph.replay()
    hostfunc.drain()
    refused = tokenizer_refused(eager, 1, V, start=1)  # (not 0: the requests' placeholder)
    eager.add_batch([GuidedRequest.generation(1, 0, cases[0].params, texts[0][0]),
                     GuidedRequest.generation(2, 1, cases[1].params, refused)])
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    expect = logits.clone()
    failed_eager = eager.execute(expect)
    before = capt.host_node_stats.python_runs
    # (the requests' own tokens are a placeholder, 0, which both grammars refuse: the step
    # reads the buffer's, each request at its previous slot's column)
    capt.add_batch([GuidedRequest.generation(1, 0, cases[0].params, 0, prev_seq_slot=0),
                    GuidedRequest.generation(2, 1, cases[1].params, 0, prev_seq_slot=1)],
                   torch.tensor([[texts[0][0], refused]], dtype=torch.int32))
    static.copy_(logits)
    graph.replay()
    hostfunc.drain()
    failed = capt.take_failed_requests()
    assert capt.host_node_stats.python_runs == before  # (the node ran it)
    assert [i for i, _ in failed] == [2] and failed == failed_eager
    assert f"new_token {refused} " in failed[0][1]
    assert same(static, expect)
    graph.reset()
    capt.close()


class PythonOnly:
    """A matcher wrapper that forwards everything: not xgrammar's matcher, so only Python can
    run it (a slot holding it makes the node's step, rollback or drafting loop Python's)."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def python_only_in_steps(capt, k: int, first: int, end: int) -> None:
    """Before step ``k``: slot 0's matcher is wrapped in :class:`PythonOnly` from step
    ``first`` on and is its own matcher again from step ``end`` on."""
    if k == first:
        capt.grammar_matchers[0] = PythonOnly(capt.grammar_matchers[0])
    elif k == end:
        capt.grammar_matchers[0] = capt.grammar_matchers[0]._inner


def two_requests(factory, tekken, drafts: int, host_node: str = "native"):
    """The first two guided cases, their token sequences, an eager decoder and a capturable
    one (``host_node``) of two slots with ``drafts`` drafts, and the cases' context requests
    (ids 1 and 2, slots 0 and 1)."""
    cases = GUIDED[:2]
    eager = GuidedDecoder(factory.config, 2, drafts, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, drafts, factory=factory,
                                   host_node=host_node)
    ctx = [GuidedRequest.context(i + 1, i, c.params) for i, c in enumerate(cases)]
    return cases, texts_of(tekken, cases), eager, capt, ctx


def tokenizer_refused(decoder: GuidedDecoder, slot: int, V: int, start: int = 0) -> int:
    """A token id from ``start`` on that the slot's current grammar state refuses (read from
    its last mask row)."""
    row = decoder.bitmask_host[slot]
    for token in range(start, V):
        if not (int(row[token // 32]) >> (token % 32)) & 1:
            return token
    raise AssertionError("every token is allowed")


def test_queue_epochs_warmup_and_drain(factory, tekken, native_ok):
    """On the native node: replays inside warmup() take no batch and mask nothing; a replay
    without its add_batch and an extra add_batch raise QueueEpochError at the drain (as on
    the Python callback); the step after works."""
    case = GUIDED[2]
    capt, graph, static, tokens = one_request_after_context(factory, tekken, case)
    assert capt.token_mask_host[0] == 1
    assert_warmup_replays_mask_nothing(capt, graph, static)
    graph.replay()  # no add_batch
    with pytest.raises(hostfunc.HostFuncError) as info:
        hostfunc.drain()
    assert isinstance(info.value.__cause__, QueueEpochError)
    assert_extra_put_is_out_of_step(capt, graph, static, case.params, tokens[0])
    assert capt.take_failed_requests() == []
    graph.reset()
    capt.close()


def test_native_step_completes_while_another_thread_holds_the_gil(factory, tekken, native_ok):
    """The issue's GIL test on the CPU stand-in: a HostGraph of [a 1 s native spin (the
    forward's stand-in), the guided step] is replayed, then another thread holds the GIL for
    2 s; the node's step (timestamps written by the node) begins and ends inside that window,
    and its masks are right. On the Python callback the same step ends after the window
    (the test can fail)."""
    from hostfunc.native import test_functions

    spin = test_functions().spin_ns
    V = factory.config.vocab_size_padded
    cases = GUIDED[:2]
    texts = texts_of(tekken, cases)
    for host_node in ("native", "python"):
        capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory,
                                       host_node=host_node)
        static = torch.zeros(2, V)
        ctx = [GuidedRequest.context(i + 1, i, c.params) for i, c in enumerate(cases)]
        capt.add_batch(ctx)
        graph = hostfunc.HostGraph()
        done = []
        with hostfunc.capture(graph):
            hostfunc.launch_native(spin, LEAD_MS * MS)
            capt.execute(static)
            if host_node == "python":
                hostfunc.launch(lambda: done.append(time.monotonic_ns()))
        capt.add_batch(ctx)
        graph.replay()
        hostfunc.drain()
        gen = [GuidedRequest.generation(i + 1, i, c.params, texts[i][0])
               for i, c in enumerate(cases)]
        capt.add_batch(gen)
        graph.replay()
        start, end = hold_gil(2)
        hostfunc.drain()
        assert capt.take_failed_requests() == []
        assert capt.num_advanced_tokens[:2] == [1, 1]
        if host_node == "native":
            stats = capt.host_node_stats
            assert start < stats.last_start_ns <= stats.last_end_ns < end, \
                (start, stats.last_start_ns, stats.last_end_ns, end)
            assert stats.python_runs == 0
        else:
            assert done[-1] > end
        graph.reset()
        capt.close()


def test_graph_keeps_the_node_after_the_decoder_is_gone(factory, tekken, native_ok):
    """A graph replayed after its decoder was closed and collected runs the node it holds
    (retained by the graph: no freed memory is touched) and masks nothing; reset frees it."""
    V = factory.config.vocab_size_padded
    case = GUIDED[0]
    capt = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node="native")
    static = torch.zeros(1, V)
    graph = capture(capt, [GuidedRequest.context(1, 0, case.params)], static)
    mask = capt.token_mask_host
    capt.close()
    del capt
    gc.collect()
    for _ in range(3):
        graph.replay()
        hostfunc.drain()
        assert mask[0] == 0
    graph.reset()
    gc.collect()


def test_host_node_choice_is_checked(factory):
    """host_node names its choices; 'native' where it cannot run names why."""
    with pytest.raises(ConfigError, match="host_node"):
        CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node="fast")
    with pytest.raises(ConfigError, match="native"):
        CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_build="python",
                                host_node="native")
    d = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_build="python")
    assert d.host_node == "python"
    d.close()


@settings(max_examples=8, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), drafts=st.sampled_from([0, 2, 3]))
def test_random_replayed_steps_equal_eager_with_drafts(factory, native_ok, seed, drafts):
    """Random replayed steps of mixed guided/unguided, context/generation, disaggregated and
    drafting requests (EOS inside drafts included), tokens from the pinned buffer, on the
    native node: masks, failures and matcher states equal the eager decoder's, step for
    step, and every step and rollback ran natively."""
    _random_replay(factory, seed, drafts, slots=4)


@pytest.mark.parametrize("seed", [3, 4])
def test_random_replayed_steps_with_rollbacks_left_out_equal_eager(factory, native_ok, seed):
    """As above with two drafts, the rollback of rejected drafts left out at random steps on
    both decoders (rollback_rejected_tokens / rollback_rejected_batch): each step after one
    settles its slots by its requests' counts, the node natively, and every step's masks,
    failures and matcher states equal the eager decoder's."""
    _random_replay(factory, seed, 2, slots=4, forget=0.5)


def test_node_steps_on_the_fill_pool_equal_eager(factory, native_ok):
    """The node's steps split across the fill pool (two threads, from one request on, the
    pool taking every step) give the eager decoder's masks, failures and matcher states over
    random replayed steps of eight slots; the pool ran requests. (Every fill sleeps 1 ms, so
    that on a loaded machine the node's thread cannot run a whole step before the pool's
    thread wakes.)"""
    from test_fill_pool import _SleepyOn

    pooled: list[int] = []

    def setup(capt):
        builder = capt.host_build.builder
        builder.set_fill_threads(2, 1, adaptive=False)
        return builder

    def after_step(builder):
        pooled.append(builder.last_step().pool_requests)

    _random_replay(factory, 11, 2, slots=8, setup=setup, after_step=after_step,
                   host_build=_SleepyOn("pool").host_build(2))
    assert sum(pooled) > 0


def _random_replay(factory, seed, drafts, slots, setup=None, after_step=None, host_build=None,
                   forget=0.0):
    """``forget``: the share of steps whose rollback of rejected drafts is left out on both
    decoders (drawn from a generator of its own: the scenario stays the seed's)."""
    rng = random.Random(seed)
    forget_rng = random.Random(seed + 1)
    left_out = 0
    scenario = Scenario(factory, rng, slots, drafts, 30)
    V = factory.config.vocab_size_padded
    rows = slots * (drafts + 1)
    eager = GuidedDecoder(factory.config, slots, drafts, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, slots, drafts, factory=factory,
                                   host_node="native",
                                   **({} if host_build is None else {"host_build": host_build}))
    hook = setup(capt) if setup is not None else None
    static = torch.zeros(rows, V)
    first, new_tokens, rl = scenario.step()
    graph = capture(capt, first, static)
    counts = None
    pending = (first, new_tokens, rl)
    for step in range(30):
        reqs, new_tokens, rl = pending if step == 0 else scenario.step()
        if not reqs:
            continue
        skip = forget_rng.random() < forget
        left_out += skip and counts is not None
        eager.add_batch(reqs, rl)
        if not skip:
            eager.rollback_rejected_tokens()
        eager.init_disagg_gen_requests()
        capt_reqs = [GuidedRequest(**{f: getattr(r, f) for f in r.__slots__}) for r in reqs]
        for r in capt_reqs:
            if r.prev_seq_slot is not None:
                r.new_token, r.draft_tokens = None, None
        capt.add_batch(capt_reqs, new_tokens, rl)
        if counts is not None and drafts and not skip:
            capt.rollback_rejected_batch(torch.tensor(
                [counts.get(r.seq_slot, 1) for r in capt_reqs], dtype=torch.int32))
        n = eager.requests.num_bitmask_tokens
        logits = torch.randn(rows, V, generator=torch.Generator().manual_seed(step))
        expect = logits.clone()
        failed_a = eager.execute(expect[:n])
        static.copy_(logits)
        graph.replay()
        hostfunc.drain()
        failed_b = capt.take_failed_requests()
        if after_step is not None:
            after_step(hook)
        assert sorted(failed_a) == sorted(failed_b), f"step {step}"
        assert same(static[:n], expect[:n]), f"logits differ at step {step}"
        assert_same_matcher_states(eager, capt)  # (a rolled-back stop token included)
        verified = scenario.verify(reqs)
        counts = {r.seq_slot: c for r, c in zip(reqs, verified)}
    assert_same_matcher_states(eager, capt)
    stats = capt.host_node_stats
    assert stats.runs > 0 and stats.python_runs == 0  # context and disaggregated steps too
    if drafts:  # every rollback of rejected drafts ran in the node too
        assert stats.rollback_runs > 0 and stats.python_rollback_runs == 0
    assert left_out > 0 or not forget
    graph.reset()
    capt.close()


# -- the rollback of rejected drafts on the node ---------------------------------------------

class Speculation:
    """Two requests decoding the cases' token sequences with two drafts a step, each step's
    drafts being the sequence's next tokens and ``accepted[i]`` of them accepted: the requests
    of each step, for the eager decoder (counts on the requests) and the capturable one
    (counts through ``rollback_rejected_batch``)."""

    def __init__(self, tekken, cases):
        self.cases = cases
        self.texts = texts_of(tekken, cases)
        self.consumed = [0] * len(cases)

    def context(self):
        return [GuidedRequest.context(i + 1, i, c.params) for i, c in enumerate(self.cases)]

    def step(self, accepted):
        """The next generation step after the previous one's drafts were verified with
        ``accepted`` of them accepted per request (None: the first generation step)."""
        reqs = []
        for i, c in enumerate(self.cases):
            if accepted is not None:
                self.consumed[i] += 1 + accepted[i]
            at, text = self.consumed[i], self.texts[i]
            reqs.append(GuidedRequest.generation(
                i + 1, i, c.params, text[at], draft_tokens=text[at + 1:at + 3],
                num_accepted_draft_tokens=0 if accepted is None else accepted[i]))
        return reqs


def speculative_graph(capt, requests, static, spin_ms=0, done=None):
    """A HostGraph of one speculative step as an engine captures it: [a native spin of
    ``spin_ms`` (the forward's stand-in)], the rollback of the last verification (its counts
    copied at each replay from the static tensor returned), the guided step[, a Python
    callback appending the monotonic time to ``done``]. Returns (graph, counts)."""
    from hostfunc.native import test_functions

    capt.add_batch(requests)
    counts = torch.ones(len(requests), dtype=torch.int32)
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        if spin_ms:
            hostfunc.launch_native(test_functions().spin_ns, spin_ms * MS)
        capt.rollback_rejected_batch(counts)
        capt.execute(static)
        if done is not None:
            hostfunc.launch(lambda: done.append(time.monotonic_ns()))
    return graph, counts


def request_copies(reqs):
    """Fresh copies of ``reqs`` (one decoder's reads must not see the other's)."""
    return [GuidedRequest(**{f: getattr(r, f) for f in r.__slots__}) for r in reqs]


def accepted_counts(reqs) -> torch.Tensor:
    """rollback_rejected_batch's counts for ``reqs``: each one's accepted drafts and the
    bonus token."""
    return torch.tensor([(r.num_accepted_draft_tokens or 0) + 1 for r in reqs],
                        dtype=torch.int32)


def test_a_matcher_replaced_after_a_steady_step_keeps_that_steps_counts(factory, tekken,
                                                                        native_ok):
    """A steady step's record, left unread after take_failed_requests, is read before a
    slot's matcher is replaced on the host (grammar_matchers[slot] = ...): the step's counts
    are the slot's, as they were with the record read at once."""
    capt, graph, _, _ = after_two_steps(factory, tekken, GUIDED[:2])
    assert capt._node.pending()[0] == 1  # (the steady step's record, unread)
    capt.grammar_matchers[0] = PythonOnly(capt.grammar_matchers[0])
    assert capt.num_advanced_tokens == [1, 1] and capt.num_guided_tokens == [1, 1]
    graph.reset()
    capt.close()


def test_a_matcher_replaced_between_speculative_steps_rolls_back_as_eager(factory, tekken,
                                                                         native_ok):
    """Speculative steps (the graph holds the step; each rollback of rejected drafts eager,
    after add_batch, as the guide driver orders them), a slot's matcher replaced by one only
    Python can run between a step's take_failed_requests and the next add_batch: that
    slot's rollback is Python's and reads the count of the step before, which the node's
    unread record gave it first. Failures, masks and matcher states equal the eager
    decoder's."""
    V = factory.config.vocab_size_padded
    spec = Speculation(tekken, GUIDED[:2])
    eager = GuidedDecoder(factory.config, 2, 2, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory, host_node="native")
    static = torch.zeros(6, V)
    capt.add_batch(spec.context())
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        capt.execute(static)
    steps = [spec.context(), spec.step(None), spec.step([1, 0]), spec.step([0, 2]),
             spec.step([1, 1])]
    for k, reqs in enumerate(steps):
        if k == 2:
            capt.grammar_matchers[0] = PythonOnly(capt.grammar_matchers[0])
        eager.add_batch(reqs)
        eager.rollback_rejected_tokens()
        n = eager.requests.num_bitmask_tokens
        logits = torch.randn(6, V, generator=torch.Generator().manual_seed(k))
        expect = logits.clone()
        failed = eager.execute(expect[:n])
        capt.add_batch(request_copies(reqs))
        capt.rollback_rejected_batch(accepted_counts(reqs))
        static.copy_(logits)
        graph.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == failed, f"step {k}"
        assert same(static[:n], expect[:n]), f"logits differ at step {k}"
    assert capt.num_advanced_tokens == eager.num_advanced_tokens
    assert_same_matcher_states(eager, capt)
    graph.reset()
    capt.close()
    eager.close()


def test_a_capture_after_a_steady_step_takes_no_put_that_ran(factory, tekken, native_ok):
    """A second graph captured from the latest batch's shapes after that batch's step ran
    (its record unread): the capture consumes no put of a step that ran, and the steps
    replayed from the new graph run in order, with no queue error."""
    cases = GUIDED[:2]
    V = factory.config.vocab_size_padded
    capt, graph, _, texts = after_two_steps(factory, tekken, cases)
    second = hostfunc.HostGraph()
    with hostfunc.capture(second):
        capt.execute(torch.zeros(2, V))
    for step in (1, 2):
        capt.add_batch(generation_requests(cases, [t[step] for t in texts]))
        second.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == []
    assert capt.num_advanced_tokens == [1, 1] and capt.queued_batches == 0
    graph.reset()
    second.reset()
    capt.close()


def speculative_step(eager, capt, graph, static, reqs, seed, counts, hold=False):
    """One speculative step of ``reqs`` on the eager decoder (add_batch,
    rollback_rejected_tokens, execute) and on the captured one (add_batch, the accepted
    counts in ``counts``, which the graph copies from, a replay of ``graph`` masking
    ``static``; another thread holding the GIL for 2 s after the replay where ``hold``), on
    the same random logits: failures, masks, counters and matcher states equal. Returns (the
    failures, the GIL window or None)."""
    eager.add_batch(reqs)
    eager.rollback_rejected_tokens()
    n = eager.requests.num_bitmask_tokens
    logits = torch.randn(tuple(static.shape), generator=torch.Generator().manual_seed(seed))
    expect = logits.clone()
    failed = eager.execute(expect[:n])
    capt.add_batch(request_copies(reqs))
    counts[:len(reqs)] = accepted_counts(reqs)
    static.copy_(logits)
    graph.replay()
    window = hold_gil(2) if hold else None
    if static.is_cuda:
        torch.cuda.synchronize()
    hostfunc.drain()
    assert capt.take_failed_requests() == failed, f"step {seed}"
    assert same(static[:n].cpu(), expect[:n]), f"logits differ at step {seed}"
    assert capt.num_advanced_tokens == eager.num_advanced_tokens, f"step {seed}"
    assert_same_matcher_states(eager, capt)
    return failed, window


def run_speculation(factory, tekken, host_node, accepted_steps, hold_at=None, done=None):
    """Replay ``speculative_graph`` over a context step and len(accepted_steps) + 1
    generation steps beside an eager decoder, comparing every step's masks, token mask and
    counters; at step ``hold_at`` another thread holds the GIL for 2 s after the replay (the
    graph then spins LEAD_MS first). Returns (decoder, the GIL window or None)."""
    V = factory.config.vocab_size_padded
    spec = Speculation(tekken, GUIDED[:2])
    eager = GuidedDecoder(factory.config, 2, 2, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory, host_node=host_node)
    static = torch.zeros(6, V)
    graph, counts = speculative_graph(capt, spec.context(), static,
                                      LEAD_MS if hold_at is not None else 0, done)
    window = None
    steps = [spec.context(), spec.step(None)] + [spec.step(a) for a in accepted_steps]
    for k, reqs in enumerate(steps):
        window = speculative_step(eager, capt, graph, static, reqs, k, counts,
                                  k == hold_at)[1] or window
    graph.reset()
    return capt, window


def test_speculative_step_and_its_rollback_run_while_another_thread_holds_the_gil(
        factory, tekken, native_ok):
    """The GIL test for a speculative step as an engine captures it (a 1 s spin, the
    rollback of the last verification, the guided step): on the node, the rollback and the
    step run natively inside the 2 s another thread holds the GIL (the step's timestamps lie
    inside it; the rollback ran before the step, after the spin), and every step equals the
    eager decoder with rollback_rejected_tokens; on the Python callback the rollback needs the
    GIL, so the step ends after the window (the test can fail)."""
    for host_node in ("native", "python"):
        done: list[int] = []
        capt, (start, end) = run_speculation(factory, tekken, host_node, [[0, 1], [2, 0]],
                                             hold_at=3, done=done)
        stats = capt.host_node_stats
        if host_node == "native":
            assert start < stats.last_start_ns <= stats.last_end_ns < end, \
                (start, stats.last_start_ns, stats.last_end_ns, end)
            assert stats.python_runs == 0
            # one rollback per replay: after the context step's replay (which rolls nothing
            # back) every one ran natively
            assert stats.rollback_runs == 4 and stats.python_rollback_runs == 1
        else:
            assert stats is None and done[3] > end
        capt.close()


def test_rollback_after_python_step_is_pythons_then_native_again(factory, tekken, native_ok):
    """Where a slot's matcher only Python can run, the node's rollback and step are Python's,
    and so is the rollback after a Python step (Python knows what that step advanced); once
    the slot's matcher is native again the steps and then the rollbacks are native again;
    every step equals the eager decoder."""
    V = factory.config.vocab_size_padded
    spec = Speculation(tekken, GUIDED[:2])
    eager = GuidedDecoder(factory.config, 2, 2, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory, host_node="native")
    static = torch.zeros(6, V)
    graph, counts = speculative_graph(capt, spec.context(), static)

    steps = [spec.context(), spec.step(None), spec.step([1, 0]), spec.step([0, 2]),
             spec.step([1, 1])]
    runs = []
    for k, reqs in enumerate(steps):
        python_only_in_steps(capt, k, 2, 3)
        speculative_step(eager, capt, graph, static, reqs, k, counts)
        s = capt.host_node_stats
        runs.append((s.python_runs, s.rollback_runs - s.python_rollback_runs,
                     s.python_rollback_runs))
    # (Python steps, native rollbacks, Python rollbacks) after each step: the first
    # rollback follows no step of the node (Python's); the one before step 2 meets the
    # Python-only slot (Python's), as does step 2 (a Python step); the one before step 3
    # follows a Python step (Python's); the one before step 4 is native again
    assert runs == [(0, 0, 1), (0, 1, 1), (1, 1, 2), (1, 1, 3), (1, 2, 3)], runs
    graph.reset()
    capt.close()


def test_rollback_that_cannot_roll_back_fails_its_request_alone(factory, tekken, native_ok):
    """A count of 0 (no token accepted, not even the bonus) for one request of a native
    rollback fails that request with the Python rollback's words, reported once; the other
    request rolls back and is masked as on the Python callback."""
    V = factory.config.vocab_size_padded
    results = {}
    for host_node in ("native", "python"):
        spec = Speculation(tekken, GUIDED[:2])
        capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory,
                                       host_node=host_node)
        static = torch.zeros(6, V)
        graph, counts = speculative_graph(capt, spec.context(), static)
        for k, reqs in enumerate([spec.context(), spec.step(None), spec.step([0, 1])]):
            capt.add_batch(reqs)
            counts[:] = torch.tensor([1, 1] if k < 2 else [0, 2], dtype=torch.int32)
            static.copy_(torch.randn(6, V, generator=torch.Generator().manual_seed(k)))
            graph.replay()
            hostfunc.drain()
            failed = capt.take_failed_requests()
        results[host_node] = (failed, static.clone(), capt.grammar_matchers[0] is None,
                              list(capt.num_advanced_tokens))
        if host_node == "native":
            assert capt.host_node_stats.python_rollback_runs == 1  # (before any node step)
        graph.reset()
        capt.close()
    failed, logits, dropped, advanced = results["native"]
    assert [i for i, _ in failed] == [1] and dropped
    assert "cannot roll back: num_accepted_draft_tokens=-1, num_advanced_tokens=3" in failed[0][1]
    assert failed == results["python"][0]
    assert same(logits, results["python"][1]) and advanced == results["python"][3]


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_int64_count_past_int32_is_refused_not_wrapped_in_a_captured_rollback(
        factory, tekken, native_ok, host_node):
    """An int64 counts tensor captured into the rollback (copied into the int32 buffer at each
    replay): a count of -2**32 + 1, whose low 32 bits read 1 (the right count here), fails its
    request ("cannot roll back") on the node and on the Python callback alike, where a
    wrapping copy rolled it back by 1 silently; the other request rolls back as usual."""
    V = factory.config.vocab_size_padded
    spec = Speculation(tekken, GUIDED[:2])
    capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory, host_node=host_node)
    static = torch.zeros(6, V)
    capt.add_batch(spec.context())
    counts = torch.ones(2, dtype=torch.int64)
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        capt.rollback_rejected_batch(counts)
        capt.execute(static)
    for k, reqs in enumerate([spec.context(), spec.step(None), spec.step([0, 1])]):
        capt.add_batch(reqs)
        counts[:] = torch.tensor([1, 1] if k < 2 else [-2**32 + 1, 2])
        graph.replay()
        hostfunc.drain()
        failed = capt.take_failed_requests()
        if k < 2:
            assert failed == []
    assert [i for i, _ in failed] == [1] and "cannot roll back" in failed[0][1], failed
    assert capt.grammar_matchers[0] is None and capt.grammar_matchers[1] is not None
    graph.reset()
    capt.close()


def test_native_rollback_of_a_stop_token_leaves_the_matcher_running(factory, tekken,
                                                                    native_ok):
    """A request drafts the last token of its text and the stop token (its matcher accepts
    both and terminates); the verification rejects both; the node's rollback brings the
    matcher back before the stop token, and the decoder's matcher says so (not terminated)
    after the next step, which feeds the text's last token without drafts, as on the eager
    decoder; a step with the stop token then terminates both alike."""
    V = factory.config.vocab_size_padded
    eos = factory.config.stop_token_ids[0]
    case = GUIDED[0]
    text = texts_of(tekken, [case])[0]
    last = len(text) - 1
    eager = GuidedDecoder(factory.config, 1, 2, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 1, 2, factory=factory, host_node="native")
    static = torch.zeros(3, V)
    ctx = [GuidedRequest.context(1, 0, case.params)]
    graph, counts = speculative_graph(capt, ctx, static)

    def gen(token, drafts, accepted):
        return [GuidedRequest.generation(1, 0, case.params, token, draft_tokens=drafts,
                                         num_accepted_draft_tokens=accepted)]

    # (requests, drafts the last verification accepted): the text a token and a draft a
    # step (an opening step without a draft where that makes the pairs end at text[-2]);
    # then text[-2] with drafts [text[-1], stop] (all advance: terminated), both rejected;
    # text[-1] without drafts; the stop token
    steps = [(ctx, 0)]
    pos = acc = 0
    if (last - 1) % 2:
        steps.append((gen(text[0], [], 0), 0))
        pos = 1
    while pos < last - 1:
        steps.append((gen(text[pos], [text[pos + 1]], acc), acc))
        pos, acc = pos + 2, 1
    steps.append((gen(text[pos], [text[last], eos], acc), acc))
    steps.append((gen(text[last], [], 0), 0))
    steps.append((gen(eos, [], 0), 0))
    terminated = []
    for k, (reqs, accepted) in enumerate(steps):
        assert reqs[0].num_accepted_draft_tokens in (accepted, None)
        failed = speculative_step(eager, capt, graph, static, reqs, k, counts)[0]
        assert failed == [], f"step {k}"
        terminated.append(capt.grammar_matchers[0].is_terminated())
    assert terminated[-3] and not terminated[-2] and terminated[-1], terminated
    stats = capt.host_node_stats
    assert stats.python_runs == 0 and stats.python_rollback_runs == 1
    graph.reset()
    capt.close()


def test_native_rollback_knows_what_a_python_step_advanced(factory, tekken, native_ok):
    """A request advanced by a Python step (another slot's matcher only Python can run),
    which then sits out a native step, is rolled back natively when it returns, from the
    advance the Python step made (the node copies Python's counters after every Python
    stage), as the eager decoder rolls it back."""
    V = factory.config.vocab_size_padded
    cases, texts, eager, capt, ctx = two_requests(factory, tekken, 2)
    static = torch.zeros(6, V)
    graph, counts = speculative_graph(capt, ctx, static)

    def gen(i, at, accepted):
        t = texts[i]
        return GuidedRequest.generation(i + 1, i, cases[i].params, t[at],
                                        draft_tokens=t[at + 1:at + 3],
                                        num_accepted_draft_tokens=accepted)

    # step 1: both (a Python step: slot 0 wrapped); step 2: request 1 alone; step 3: both,
    # request 2 back after sitting out step 2, with one of its step-1 drafts accepted
    steps = [ctx, [gen(0, 0, 0), gen(1, 0, 0)], [gen(0, 3, 2)], [gen(0, 6, 2), gen(1, 2, 1)]]
    for k, reqs in enumerate(steps):
        python_only_in_steps(capt, k, 1, 2)
        failed = speculative_step(eager, capt, graph, static, reqs, k, counts)[0]
        assert failed == [], f"step {k}"
    stats = capt.host_node_stats
    assert stats.python_runs == 1
    # Python's: before the context step, before step 1 (the wrapped slot), before step 2
    # (after a Python step); the node's: before step 3
    assert (stats.rollback_runs, stats.python_rollback_runs) == (4, 3)
    graph.reset()
    capt.close()


def test_bench_host_node_speculative_run(tmp_path, native_ok):
    """tools/bench_host_node.py --drafts 2 on the CPU stand-in: teacher-forced speculative
    steps (drafts partly rejected) on both kinds give equal masks (the tool checks) and, on
    the node, every step and every rollback after its first step ran natively."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "node.json"
    root = Path(__file__).resolve().parents[1]
    run = subprocess.run([sys.executable, str(root / "tools" / "bench_host_node.py"),
                          "--batches", "3", "--steps", "6", "--blocks", "1", "--drafts", "2",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["node_python_runs"] == 0 and row["node_python_rollbacks"] <= 1
    assert row["node_rollbacks"] >= 6 and row["node_us_per_step"] > 0


def test_drafting_loop_beside_the_node_equals_eager(factory, tekken, native_ok):
    """A draft-model loop (add_draft_batch / execute_draft_batch) on a decoder whose node is
    active (after a capture): the loop's first draft step takes its batch off the node's
    queue and rolls the rejected drafts back, each draft step builds its rows, the last rolls
    the loop's advances back, all in the node; every draft row and every target step masks as
    GuidedDecoder driven through the same loop (drafts off the grammar included), with no
    queue error, and every step ran natively."""
    V = factory.config.vocab_size_padded
    case = GUIDED[0]
    text = texts_of(tekken, [case])[0]
    K = 3
    eager = GuidedDecoder(factory.config, 2, K, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, K, factory=factory, host_node="native")
    ctx = [GuidedRequest.context(1, 1, case.params)]
    graph = capture(capt, ctx, torch.zeros(1 + K, V))  # (the node serves steps from now on)
    for d in (eager, capt):
        d.add_batch(ctx)
        d.execute(torch.zeros(1, V))
    assert capt.take_failed_requests() == []
    targets = draft_loops_pair(eager, capt, case, text, K)
    stats = capt.host_node_stats
    assert targets > 2 and stats.runs == targets + 1 and stats.python_runs == 0
    assert stats.draft_runs == K * targets and stats.python_draft_runs == 0
    graph.reset()
    capt.close()


def test_discard_queued_batches_drops_the_nodes_job_too(factory, tekken, native_ok):
    """With the node serving steps, a batch it has run is not queued, and
    discard_queued_batches drops the batch no step will fetch and the node's job for it: the
    next add_batch and replayed step are in step and run natively."""
    V = factory.config.vocab_size_padded
    case = GUIDED[2]
    capt, graph, static, tokens = one_request_after_context(factory, tekken, case)
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, tokens[0])])
    capt.execute(torch.zeros(1, V))  # (eager, on the node: nothing has read its results)
    assert capt.queued_batches == 0
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, tokens[1])])
    capt.execute(torch.zeros(1, V))
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, tokens[2])])  # never run
    assert capt.discard_queued_batches() == 1 and capt.queued_batches == 0
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, tokens[2])])
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert capt.num_advanced_tokens[0] == 1 and capt.token_mask_host[0] == 1
    assert capt.host_node_stats.python_runs == 0
    graph.reset()
    capt.close()


def verify(proposals, texts, pos, accepted, rng) -> None:
    """A verification of each request's drafts (``proposals[i][1:]``) against its text at
    ``pos[i]``: a random number of the drafts that match is accepted; ``accepted`` and
    ``pos`` move on."""
    for i, row in enumerate(proposals):
        match = 0
        while match < len(row) - 1 and row[1 + match] == texts[i][pos[i] + 1 + match]:
            match += 1
        accepted[i] = rng.randint(0, match)
        pos[i] += 1 + accepted[i]


def _draft_loops(factory, tekken, seed, K=3, wrap_loop=None, iterations=12):
    """Drafting loops over three requests (schema, regex, EBNF) with random proposals (the
    text's next tokens, tokens off the grammar, the stop token) and random acceptance,
    beside the eager decoder driven through the same loop: every draft row, target step and
    matcher state equal. ``wrap_loop``: the loop in which slot 0's matcher is one only Python
    can run. Returns the decoder's node stats."""
    V = factory.config.vocab_size_padded
    eos = factory.config.stop_token_ids[0]
    cases = GUIDED[:3]
    texts = texts_of(tekken, cases)
    S = len(cases)
    rng = random.Random(seed)
    eager = GuidedDecoder(factory.config, S, K, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, S, K, factory=factory, host_node="native")
    ctx = [GuidedRequest.context(i + 1, i, c.params) for i, c in enumerate(cases)]
    graph = capture(capt, ctx, torch.zeros(S * (K + 1), V))
    for d in (eager, capt):
        d.add_batch(ctx)
        d.execute(torch.zeros(S, V))
    assert capt.take_failed_requests() == []
    pos, accepted = [0] * S, [0] * S
    for it in range(iterations):
        if any(pos[i] + K + 1 >= len(texts[i]) for i in range(S)):
            break
        native = None
        if it == wrap_loop:
            native = capt.grammar_matchers[0]

            capt.grammar_matchers[0] = PythonOnly(native)
        golden = [texts[i][pos[i]] for i in range(S)]
        targets = [GuidedRequest.generation(i + 1, i, c.params, golden[i],
                                            num_accepted_draft_tokens=accepted[i])
                   for i, c in enumerate(cases)]
        eager.add_batch(targets)
        eager.rollback_rejected_tokens()
        capt.add_batch(targets)
        proposals = []
        for i in range(S):
            row = [golden[i]]
            for j in range(K):
                roll = rng.random()
                row.append(texts[i][pos[i] + 1 + j] if roll < 0.7 else
                           eos if roll < 0.8 else rng.randrange(1000, 9000))
            proposals.append(row)
        for k in range(K):
            drafts = [GuidedRequest(c.params, i + 1, i, is_draft=True,
                                    is_generation_in_progress_state=True,
                                    new_token=proposals[i][k]) for i, c in enumerate(cases)]
            eager.add_batch(drafts)
            la = torch.randn(S, V, generator=torch.Generator().manual_seed(100 * it + k))
            lb = la.clone()
            failed = eager.execute(la)
            capt.add_draft_batch(torch.tensor([p[k] for p in proposals]),
                                 torch.tensor([1 + a for a in accepted]) if k == 0 else None,
                                 k)
            capt.execute_draft_batch(lb, draft_step=k)
            assert capt.take_failed_requests() == failed == [], f"loop {it} step {k}"
            assert same(la, lb), f"draft step {k} of loop {it}"
        eager.rollback_draft_tokens()
        if native is not None:
            capt.grammar_matchers[0] = native
        targets = [GuidedRequest.generation(i + 1, i, c.params, golden[i],
                                            draft_tokens=proposals[i][1:])
                   for i, c in enumerate(cases)]
        eager.add_batch(targets)
        capt.add_batch(targets)
        la = torch.randn(S * (K + 1), V, generator=torch.Generator().manual_seed(it))
        lb = la.clone()
        n = eager.requests.num_bitmask_tokens
        failed = eager.execute(la[:n])
        capt.execute(lb[:n])
        assert capt.take_failed_requests() == failed == [], f"target of loop {it}"
        assert same(la[:n], lb[:n]), f"target step of loop {it}"
        assert_same_matcher_states(eager, capt)
        assert capt.is_draft_terminated[:S] == eager.is_draft_terminated[:S]
        assert capt.num_advanced_draft_tokens == eager.num_advanced_draft_tokens
        verify(proposals, texts, pos, accepted, rng)
    stats = capt.host_node_stats
    graph.reset()
    capt.close()
    return stats


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_drafting_loops_on_the_node_equal_eager(factory, tekken, native_ok, seed):
    """Random drafting loops over three requests, with drafts off the grammar and stop tokens
    (slots stop being guided mid-loop, matchers terminate inside a loop and are rolled back at
    its end), run in the node step for step as GuidedDecoder runs them."""
    stats = _draft_loops(factory, tekken, seed)
    assert stats.draft_runs > 0 and stats.python_draft_runs == 0 and stats.python_runs == 0


def test_drafting_loop_the_node_cannot_run_is_pythons_whole(factory, tekken, native_ok):
    """A drafting loop whose batch holds a slot whose matcher only Python can run is Python's
    from its first step to its last (inside the node), and the loops before and after it are
    native; every step equals the eager decoder."""
    stats = _draft_loops(factory, tekken, 5, wrap_loop=2, iterations=5)
    assert stats.python_draft_runs == 3  # (K draft steps of the one loop)
    assert stats.draft_runs > stats.python_draft_runs


def test_draft_step_runs_while_another_thread_holds_the_gil(factory, tekken, native_ok):
    """The GIL test for a drafting loop's step: a HostGraph of [a 1 s native spin, a
    one-step drafting loop (execute_draft_batch: take the batch, roll back, build the draft
    rows, roll the drafts back)] is replayed, then another thread holds the GIL for 2 s; on
    the node the draft step's run (its timestamps) lies inside that window, and its rows equal
    the eager decoder's; on the Python callback the draft step ends after the window (the
    test can fail)."""
    V = factory.config.vocab_size_padded
    for host_node in ("native", "python"):
        cases, texts, eager, capt, ctx = two_requests(factory, tekken, 1, host_node)
        target_graph = capture(capt, ctx, torch.zeros(4, V))
        for d in (eager, capt):
            d.add_batch(ctx)
        eager.execute(torch.zeros(2, V))
        target_graph.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == []
        golden = [t[0] for t in texts]
        targets = [GuidedRequest.generation(i + 1, i, c.params, golden[i])
                   for i, c in enumerate(cases)]
        static = torch.zeros(2, V)
        capt.add_batch(targets)
        done: list[int] = []
        graph = hostfunc.HostGraph()
        with hostfunc.capture(graph):
            from hostfunc.native import test_functions
            hostfunc.launch_native(test_functions().spin_ns, LEAD_MS * MS)
            capt.execute_draft_batch(static, draft_step=0)
            if host_node == "python":
                hostfunc.launch(lambda: done.append(time.monotonic_ns()))
        eager.add_batch(targets)
        eager.rollback_rejected_tokens()
        eager.add_batch([GuidedRequest(c.params, i + 1, i, is_draft=True,
                                       is_generation_in_progress_state=True,
                                       new_token=golden[i]) for i, c in enumerate(cases)])
        logits = torch.randn(2, V, generator=torch.Generator().manual_seed(7))
        expect = logits.clone()
        assert eager.execute(expect) == []
        eager.rollback_draft_tokens()
        capt.add_batch(targets)
        capt.add_draft_batch(torch.tensor(golden), torch.tensor([1, 1]), 0)
        static.copy_(logits)
        graph.replay()
        start, end = hold_gil(2)
        hostfunc.drain()
        assert capt.take_failed_requests() == []
        assert same(static, expect)
        assert_same_matcher_states(eager, capt)
        if host_node == "native":
            s = capt.host_node_stats
            assert start < s.last_start_ns <= s.last_end_ns < end, (start, s, end)
            assert s.draft_runs == 1 and s.python_draft_runs == 0
        else:
            assert done and done[-1] > end
        graph.reset()
        target_graph.reset()
        capt.close()


def test_draft_token_outside_the_vocabulary_fails_its_request_alone(factory, tekken,
                                                                     native_ok):
    """A draft step whose draft-token buffer holds an id outside the vocabulary for one
    request (a drafter's garbage): on the node, that request fails alone with a RequestError
    naming the token and the buffer, its row unmasked and its matcher dropped, while the other
    request's draft row is masked as on the Python callback; the loop's end and the next
    target step go on."""
    V = factory.config.vocab_size_padded
    results = {}
    for host_node in ("native", "python"):
        cases, texts, _, capt, ctx = two_requests(factory, tekken, 1, host_node)
        graph = capture(capt, ctx, torch.zeros(4, V))
        capt.add_batch(ctx)
        graph.replay()
        hostfunc.drain()
        golden = [t[0] for t in texts]
        capt.add_batch([GuidedRequest.generation(i + 1, i, c.params, golden[i])
                        for i, c in enumerate(cases)])
        capt.add_draft_batch(torch.tensor([golden[0], V + 7]), torch.tensor([1, 1]), 0)
        logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
        capt.execute_draft_batch(logits, draft_step=0)
        failed = capt.take_failed_requests()
        results[host_node] = (failed, logits, capt.token_mask_host[:2].tolist(),
                              capt.grammar_matchers[1] is None)
        capt.add_batch([GuidedRequest.generation(i + 1, i, c.params, golden[i])
                        for i, c in enumerate(cases)])
        capt.execute(torch.zeros(4, V))
        assert capt.take_failed_requests() == []
        if host_node == "native":
            stats = capt.host_node_stats
            assert stats.draft_runs == 1 and stats.python_draft_runs == 0
        graph.reset()
        capt.close()
    failed, logits, mask, dropped = results["native"]
    assert [i for i, _ in failed] == [2] and dropped and mask == [1, 0]
    assert "RequestError" in failed[0][1] and str(V + 7) in failed[0][1]
    assert "draft token buffer" in failed[0][1]
    assert [i for i, _ in results["python"][0]] == [2] and results["python"][3]
    assert results["python"][2] == mask and same(results["python"][1], logits)


def test_batch_after_launch_equals_the_batch_before_it(factory, tekken, native_ok):
    """With set_batch_after_launch the loop replays first and calls add_batch after: the
    replayed node, already started behind a 50 ms native spin (the forward's stand-in), waits
    for its batch and every step masks as a decoder whose add_batch comes first; an eager
    step (add_batch, then execute: generate()'s context step) is served as before; the waits
    are not counted in the node's busy time. None switches back to add_batch before the
    replay."""
    from hostfunc.native import test_functions

    spin = test_functions().spin_ns
    V = factory.config.vocab_size_padded
    cases = GUIDED[:3]
    texts = texts_of(tekken, cases)
    steps = min(len(t) for t in texts)
    before, after = (CapturableGuidedDecoder(factory.config, 3, 0, factory=factory,
                                             host_node="native") for _ in range(2))
    statics = [torch.zeros(3, V) for _ in range(2)]
    context = [GuidedRequest.context(i, i, c.params) for i, c in enumerate(cases)]
    graphs = []
    for dec, static in zip((before, after), statics):
        dec.add_batch(context)
        graph = hostfunc.HostGraph()
        with hostfunc.capture(graph):
            hostfunc.launch_native(spin, 50 * MS)
            dec.execute(static)
        graphs.append(graph)
    assert after.batch_after_launch is None
    after.set_batch_after_launch(5.0)
    assert after.batch_after_launch == 5.0

    def requests(step):
        if step == 0:
            return [GuidedRequest.context(i, i, c.params) for i, c in enumerate(cases)]
        return [GuidedRequest.generation(i, i, c.params, texts[i][step - 1])
                for i, c in enumerate(cases)]

    for step in range(steps):
        logits = torch.randn(3, V, generator=torch.Generator().manual_seed(step))
        statics[0].copy_(logits)
        before.add_batch(requests(step))
        graphs[0].replay()
        hostfunc.drain()
        statics[1].copy_(logits)
        if step == 0:  # generate()'s context step: eager, add_batch then execute, as ever
            after.add_batch(requests(step))
            after.execute(statics[1])
        else:
            graphs[1].replay()
            time.sleep(0.06)  # (the node has started and waits for its batch)
            after.add_batch(requests(step))
        hostfunc.drain()
        assert before.take_failed_requests() == [] and after.take_failed_requests() == []
        assert same(statics[0], statics[1]), f"step {step}"
        assert torch.isneginf(statics[1]).any()
    stats = after.host_node_stats
    assert stats.runs == steps and stats.python_runs == 0
    # (its last run waited from its start for the batch: about 10 ms)
    assert stats.last_start_ns + 2 * MS < stats.last_job_ns <= stats.last_end_ns
    # (each run waited about 10 ms for its batch: the busy time counts the work alone)
    assert stats.busy_ns < before.host_node_stats.busy_ns + steps * 5 * MS
    after.set_batch_after_launch(None)
    assert after.batch_after_launch is None
    after.add_batch(requests(0))  # (new requests in the slots: a batch before its replay)
    graphs[1].replay()
    hostfunc.drain()
    assert after.take_failed_requests() == []
    assert after.host_node_stats.runs == steps + 1
    for dec, graph in zip((before, after), graphs):
        graph.reset()
        dec.close()


def test_batch_after_launch_misuse_is_named_and_never_hangs(factory, tekken, native_ok):
    """The batch after launch never masks a batch for another step and never hangs:
    - a replay whose batch does not come within the wait reports a QueueEpochError and stops
      the mode; a batch that comes after that is dropped (an error), never masked for the next
      step; set_batch_after_launch resumes, the matcher where the last served step left it;
    - a replay whose add_batch raised: an empty batch, or switching the mode off, lets its node
      go at once (the step masks nothing), and the next step is served, the matcher unmoved;
    - an add_batch that raises in an eager step (add_batch, then execute) leaves the next
      eager step served (nothing left behind for a later step);
    - close() lets a waiting node go, and the mode cannot be switched on again after it;
    - the mode needs the native node, no drafts and a sane timeout, and refuses new_tokens."""
    from capgraph.errors import TensorArgError

    case = GUIDED[0]
    text = texts_of(tekken, [case])[0]
    capt, graph, static, _ = one_request_after_context(factory, tekken, case)

    def step(k):
        return [GuidedRequest.generation(1, 0, case.params, text[k])]

    def served(k):
        """Step k fed text[k] (no failure) and masked for text[k + 1]: the matcher took
        exactly the tokens of the steps served, none of a dropped or skipped batch."""
        assert capt.take_failed_requests() == []
        assert capt.num_advanced_tokens[0] == 1
        assert torch.isneginf(static).any() and torch.isfinite(static[0, text[k + 1]])

    def drain_error() -> str:
        with pytest.raises(hostfunc.HostFuncError) as info:
            hostfunc.drain()
        assert isinstance(info.value.__cause__, QueueEpochError)
        capt.take_failed_requests()
        return str(info.value.__cause__)

    capt.set_batch_after_launch(0.3)
    t0 = time.monotonic()
    graph.replay()  # its batch never comes in time
    time.sleep(0.5)
    capt.add_batch(step(0))  # (too late: dropped, never masked for the next step)
    assert "within 300 ms" in drain_error()
    assert 0.25 < time.monotonic() - t0 < 10
    graph.replay()
    capt.add_batch(step(0))
    assert "stopped at epoch" in drain_error()
    assert capt.num_advanced_tokens[0] == 0
    capt.set_batch_after_launch(5.0)  # resumes: the steps take their own batches again
    for k in range(2):
        static.fill_(0)
        graph.replay()
        capt.add_batch(step(k))
        hostfunc.drain()
        served(k)
    # a replay whose add_batch raised: an empty batch lets its node go at once (it masks
    # nothing); or the mode switched off does (a queue error), switched on after the sync
    for release in ("empty batch", "mode off"):
        static.fill_(0)
        graph.replay()
        t0 = time.monotonic()
        with pytest.raises(TensorArgError, match="new_tokens with the batch after launch"):
            capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[2],
                                                     prev_seq_slot=0)],
                           torch.zeros(1, 1, dtype=torch.int32))
        if release == "empty batch":
            capt.add_batch([])
            hostfunc.drain()
            assert capt.take_failed_requests() == []
        else:
            capt.set_batch_after_launch(None)
            assert "no batch queued" in drain_error()  # (switched off while waiting, or before)
            capt.set_batch_after_launch(5.0)
        assert time.monotonic() - t0 < 4
        assert torch.isfinite(static).all()  # (it masked nothing)
    static.fill_(0)
    graph.replay()
    capt.add_batch(step(2))
    hostfunc.drain()
    served(2)
    # an eager step's add_batch that raises leaves nothing behind for the next eager step
    with pytest.raises(TensorArgError):
        capt.add_batch(step(3), torch.zeros(1, 1, dtype=torch.int32))
    capt.add_batch(step(3))
    static.fill_(0)
    capt.execute(static)
    served(3)
    # closed while its node waits (5 s): the node goes at once, and stays off
    graph.replay()
    time.sleep(0.05)
    t0 = time.monotonic()
    capt.close()
    try:
        hostfunc.drain()
    except hostfunc.HostFuncError:
        pass
    assert time.monotonic() - t0 < 4
    from capgraph.errors import DecoderClosedError
    with pytest.raises(DecoderClosedError):
        capt.set_batch_after_launch(5.0)
    graph.reset()
    native = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node="native")
    for bad in (0, -1, True, "1", 3601):
        with pytest.raises(ConfigError, match="timeout_s"):
            native.set_batch_after_launch(bad)
    native.close()
    drafting = CapturableGuidedDecoder(factory.config, 1, 2, factory=factory,
                                       host_node="native")
    with pytest.raises(ConfigError, match="without drafts"):
        drafting.set_batch_after_launch()
    drafting.close()
    python = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node="python")
    with pytest.raises(ConfigError, match="native host node"):
        python.set_batch_after_launch()
    python.close()


class _SlowId(GuidedRequest):
    """A request whose request_id takes 0.5 s to read (add_batch's copy reads it)."""

    __slots__ = ()

    @property  # type: ignore[override]
    def request_id(self):
        time.sleep(0.5)
        return 1

    @request_id.setter
    def request_id(self, value):
        pass


def test_a_decoder_dropped_while_its_step_waits_for_its_batch_lets_it_go(factory, native_ok):
    """A decoder dropped without close() while a replayed step waits for its batch after the
    launch (30 s allowed) lets that step go when it is collected, as close() does: the stream
    drains at once (the step masks nothing), not at the wait's end. (The graph holds only the
    node and the bitmask copy, so nothing else keeps the decoder.)"""
    case = GUIDED[0]
    capt = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node="native")
    capt.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        capt.record_tokens_ready()
        capt.prepare(1)
    capt.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph.replay()
    hostfunc.drain()
    capt.set_batch_after_launch(30.0)
    graph.replay()
    time.sleep(0.05)  # (the node has started and waits)
    start = time.perf_counter()
    del capt
    gc.collect()
    hostfunc.drain()
    assert time.perf_counter() - start < 5.0
    graph.reset()


def test_a_batch_after_launch_that_outlives_the_wait_drops_its_slots_on_resume(
        factory, tekken, native_ok):
    """A step's wait runs out while its add_batch is under way (after the batch was collected
    for, before it is queued), and the batch refuses its request, dropping the slot's matcher:
    on resume the node drops that matcher too, so the slot's next request is not masked by
    the refused request's matcher behind Python's back (both sides: no matcher)."""
    import copy

    case = GUIDED[0]
    text = texts_of(tekken, [case])[0]
    capt, graph, static, _ = one_request_after_context(factory, tekken, case)
    capt.set_batch_after_launch(0.2)
    graph.replay()
    refused = _SlowId(copy.copy(case.params), 1, 0, None, False, False, True, False, "x")
    capt.add_batch([refused])  # (the wait runs out inside this call)
    with pytest.raises(hostfunc.HostFuncError):
        hostfunc.drain()
    assert [rid for rid, _ in capt.take_failed_requests()] == [1]
    assert capt.grammar_matchers[0] is None
    capt.set_batch_after_launch(1.0)  # resumes
    static.fill_(0)
    graph.replay()
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])
    hostfunc.drain()
    capt.take_failed_requests()  # (refused: the slot has no matcher)
    assert not torch.isneginf(static).any()
    graph.reset()
    capt.close()
