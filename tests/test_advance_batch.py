"""``CapturableGuidedDecoder.advance_batch``: the next step of the latest batch from its tokens
alone. On the CPU stand-in (a replayed HostGraph): every step masks, advances and fails as the
same requests given to ``add_batch`` do, on the native node (where it queues the node's last
job again) and on the Python callback; what it refuses is named and queues nothing; and
``generate()``'s guide driver uses it for a decode step of the same sequences."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import hostfunc
from capgraph import GuidedDecodingParams, LayoutError, TensorArgError
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest
from test_host_node import (GUIDED, PythonOnly, after_two_steps, capture, context_requests,
                            decoders_for, generation_requests, request_copies, same, texts_of)


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


def capture_behind_spin(capt: CapturableGuidedDecoder, requests, static: torch.Tensor
                        ) -> hostfunc.HostGraph:
    """A HostGraph of [a 100 ms native spin (the forward's stand-in), ``capt``'s step], its
    shapes from ``requests``: a step replayed from it is still queued 100 ms later."""
    from hostfunc.native import test_functions

    capt.add_batch(requests)
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        hostfunc.launch_native(test_functions().spin_ns, 100_000_000)
        capt.execute(static)
    return graph


def advance_and_replay(capt: CapturableGuidedDecoder, graph, tokens, after_launch: bool
                       ) -> None:
    """One step: advance_batch before the replay, or after its launch."""
    if after_launch:
        graph.replay()
        capt.advance_batch(tokens)
    else:
        capt.advance_batch(tokens)
        graph.replay()


class Repeats:
    """Counts the native node's repeat calls that queued a job (the fast path)."""

    def __init__(self, decoder: CapturableGuidedDecoder) -> None:
        self.queued = 0
        node = decoder._node
        if node is None:
            return
        repeat = node.repeat

        def counted(*args):
            queued = repeat(*args)
            self.queued += bool(queued)
            return queued
        node.repeat = counted  # type: ignore[method-assign]


@pytest.mark.parametrize("host_node,after_launch", [("native", False), ("native", True),
                                                    ("python", False)],
                         ids=["native", "native-after-launch", "python"])
def test_advanced_steps_equal_add_batch_steps(factory, tekken, native_ok, host_node,
                                              after_launch):
    """Three schema/regex/EBNF requests: a context step by add_batch, then every step by
    advance_batch with the requests' tokens. Each step's masked logits, token mask and
    advance counts equal an eager GuidedDecoder's given the same requests; on the native
    node every step after the first advanced one queues the node's job again (the first
    advances the context batch, which makes generation requests of it), also with the batch
    made after the replay's launch; on the Python callback each is an add_batch."""
    V = factory.config.vocab_size_padded
    cases = GUIDED[:3]
    texts, steps, eager, capt, static = decoders_for(factory, tekken, cases, host_node)
    graph = capture(capt, context_requests(cases), static, prepare_first=True)
    repeats = Repeats(capt)
    if after_launch:
        capt.set_batch_after_launch(5.0)
    for step in range(steps):
        logits = torch.randn(3, V, generator=torch.Generator().manual_seed(step))
        tokens = [t[step - 1] for t in texts] if step else None
        eager.add_batch(generation_requests(cases, tokens) if step else context_requests(cases))
        expect = logits.clone()
        assert eager.execute(expect) == []
        static.copy_(logits)
        if step == 0:  # the context step: add_batch, then its step (eager after launch)
            capt.add_batch(context_requests(cases))
            capt.execute(static) if after_launch else graph.replay()
        else:
            advance_and_replay(capt, graph, tokens, after_launch)
        hostfunc.drain()
        assert capt.take_failed_requests() == []
        assert same(static, expect), f"step {step}"
        assert torch.isneginf(static).any()
        assert torch.equal(capt.token_mask_host[:3], eager.token_mask_host[:3])
        assert capt.num_advanced_tokens == eager.num_advanced_tokens
    if host_node == "native":
        assert repeats.queued == steps - 2
        assert capt.host_node_stats.python_runs == 0
    else:  # (no node to queue a job again: each step was an add_batch)
        assert capt.host_node == "python" and capt._node is None
    graph.reset()
    capt.close()
    eager.close()


def test_advance_batch_refusals_are_named_and_queue_nothing(factory, tekken, native_ok):
    """What advance_batch cannot continue is a LayoutError (or, for a device tensor, a
    TensorArgError) that names it, with nothing queued: no batch yet; a token count other
    than the batch's; a batch with drafts; a context request before its last chunk; a
    request that failed since the batch was queued (until add_batch makes a new batch); a
    released slot; a batch whose step never ran (discarded). A bad token on the native
    node's path fails its request alone, as add_batch would."""
    cases = GUIDED[:2]
    texts = texts_of(tekken, cases)
    V = factory.config.vocab_size_padded
    capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory, host_node="native")
    with pytest.raises(LayoutError, match="no batch to advance"):
        capt.advance_batch([1, 2])
    static = torch.zeros(2 * 3, V)
    graph = capture(capt, context_requests(cases), static)
    capt.add_batch(context_requests(cases), runtime_draft_len=0)
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    with pytest.raises(LayoutError, match="3 tokens for the latest batch's 2 requests"):
        capt.advance_batch([1, 2, 3])
    with pytest.raises(LayoutError, match="must be a sequence of token ids, got int"):
        capt.advance_batch(7)
    with pytest.raises(TensorArgError, match="meta tensor"):
        capt.advance_batch(torch.zeros(2, dtype=torch.int64, device="meta"))
    assert capt.queued_batches == 0
    # a batch with drafts
    capt.add_batch([GuidedRequest.generation(i, i, c.params, texts[i][0], draft_tokens=[1, 2])
                    for i, c in enumerate(cases)], runtime_draft_len=2)
    with pytest.raises(LayoutError, match="without drafts; the latest has runtime draft length 2"):
        capt.advance_batch([texts[0][1], texts[1][1]])
    assert capt.queued_batches == 1
    capt.discard_queued_batches()
    # a context request before its last chunk
    capt.add_batch([GuidedRequest.context(7, 0, cases[0].params, last_chunk=False),
                    GuidedRequest.generation(1, 1, cases[1].params, texts[1][0])],
                   runtime_draft_len=0)
    with pytest.raises(LayoutError, match="request 7 .batch index 0. is a context request "
                                          "before its last chunk"):
        capt.advance_batch([5, texts[1][1]])
    assert capt.queued_batches == 1
    capt.discard_queued_batches()
    # the latest batch discarded: its step never ran
    with pytest.raises(LayoutError, match="latest batch's step did not run"):
        capt.advance_batch([5, texts[1][1]])
    capt.close()
    graph.reset()

    # a failure since the batch was queued, and a release
    capt, graph, _static, _texts = after_two_steps(factory, tekken, cases)
    repeats = Repeats(capt)
    eos = tekken.eos_token_id  # (a stop token: not allowed before a guide's end)
    capt.advance_batch([texts[0][1], V + 5])  # (not a token: request 1 fails alone)
    graph.replay()
    hostfunc.drain()
    (failed_id, message), = capt.take_failed_requests()
    assert failed_id == 1 and "outside the vocabulary" in message
    assert repeats.queued == 0  # (the node's job cannot hold it: the step was add_batch's)
    with pytest.raises(LayoutError, match="a request failed or a slot was released since"):
        capt.advance_batch([texts[0][2], texts[1][2]])
    assert capt.queued_batches == 0
    capt.add_batch([GuidedRequest.generation(0, 0, cases[0].params, texts[0][2]),
                    GuidedRequest.placeholder(-1)])
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    capt.advance_batch([texts[0][3], 0])  # (a new batch: it continues again)
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == [] and repeats.queued == 1
    capt.advance_batch([eos, 0])
    graph.replay()
    hostfunc.drain()
    (failed_id, message), = capt.take_failed_requests()
    assert failed_id == 0
    capt.add_batch([GuidedRequest.placeholder(-1), GuidedRequest.placeholder(-2)])
    graph.replay()
    hostfunc.drain()
    capt.release(0)
    with pytest.raises(LayoutError, match="a request failed or a slot was released since"):
        capt.advance_batch([0, 0])
    graph.reset()
    capt.close()


def test_a_python_step_of_an_advanced_batch_reads_its_tokens(factory, tekken, native_ok):
    """A slot whose matcher only Python can run makes the node's step of an advanced batch a
    Python step: it feeds each request the token advance_batch gave (written into the
    batch's requests when Python takes the step), so the masks equal the eager decoder's;
    the next steps run natively again."""
    V = factory.config.vocab_size_padded
    cases = GUIDED[:2]
    texts = texts_of(tekken, cases)
    steps = min(6, min(len(t) for t in texts))
    eager = GuidedDecoder(factory.config, 2, 0, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node="native")
    static = torch.zeros(2, V)
    graph = capture(capt, context_requests(cases), static)
    for step in range(steps):
        tokens = [t[step - 1] for t in texts] if step else None
        eager.add_batch(generation_requests(cases, tokens) if step else context_requests(cases))
        expect = torch.zeros(2, V)
        assert eager.execute(expect) == []
        if step == 3:
            capt.grammar_matchers[0] = PythonOnly(capt.grammar_matchers[0])
        elif step == 4:
            capt.grammar_matchers[0] = capt.grammar_matchers[0]._inner
        static.zero_()
        if step == 0:
            capt.add_batch(context_requests(cases))
        else:
            capt.advance_batch(tokens)
        graph.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == []
        assert same(static, expect), f"step {step}"
    assert capt.host_node_stats.python_runs == 1
    graph.reset()
    capt.close()
    eager.close()


def test_an_advance_behind_a_queued_step_is_an_add_batch(factory, tekken, native_ok):
    """Run ahead of the stream (the previous step still queued behind a 100 ms native spin,
    the forward's stand-in), advance_batch makes the requests and queues them as add_batch
    does, ticket and all: both steps then mask as two add_batch calls would."""
    V = factory.config.vocab_size_padded
    cases = GUIDED[:2]
    texts = texts_of(tekken, cases)
    eager = GuidedDecoder(factory.config, 2, 0, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node="native")
    static = torch.zeros(2, V)
    graph = capture_behind_spin(capt, context_requests(cases), static)
    capt.add_batch(context_requests(cases))
    graph.replay()
    hostfunc.drain()
    eager.add_batch(context_requests(cases))
    eager.execute(torch.zeros(2, V))
    repeats = Repeats(capt)
    expected = []
    for k in (0, 1):
        eager.add_batch(generation_requests(cases, [t[k] for t in texts]))
        expect = torch.zeros(2, V)
        assert eager.execute(expect) == []
        expected.append(expect)
    static.zero_()
    capt.add_batch(generation_requests(cases, [t[0] for t in texts]))
    graph.replay()
    capt.advance_batch([t[1] for t in texts])  # (the step before it has not run)
    assert capt.queued_batches == 2 and repeats.queued == 0
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert same(static, expected[0])
    static.zero_()
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert same(static, expected[1])
    graph.reset()
    capt.close()
    eager.close()


def test_the_guide_driver_advances_a_decode_step_of_the_same_sequences(factory):
    """GuideDriver.begin_decode queues a decode step of the same sequences (same objects,
    order and padding) as the latest decode step with advance_batch (their newest tokens,
    placeholders' zeros); a context step, another set of sequences, other padding, a capture's
    batch or an advance_batch refusal make the step with add_batch; the eager decoder and a
    loop with drafts always do."""
    from capgraph.runtime.guide import GuideDriver

    params = GuidedDecodingParams.regex("[ab]+")
    seqs = [SimpleNamespace(index=7 + i, seq_slot=i, guide=params, output=[3, 4 + i],
                            accepted_prev=0) for i in range(2)]
    for make, drafts in ((CapturableGuidedDecoder, 0), (GuidedDecoder, 0),
                         (CapturableGuidedDecoder, 2)):
        decoder = make(factory.config, 3, drafts, factory=factory)
        driver = GuideDriver(decoder, drafts)
        calls: list = []
        refuse = []
        decoder.add_batch = (  # type: ignore[method-assign]
            lambda reqs, *a, **k: calls.append(("add", len(reqs))))

        def advance(tokens):
            if refuse:
                raise LayoutError("refused")
            calls.append(("advance", list(tokens)))
        decoder.advance_batch = advance  # type: ignore[attr-defined]
        decoder.rollback_rejected_batch = lambda *a, **k: None  # type: ignore[attr-defined]
        decoder.prepare = lambda *a, **k: None  # type: ignore[method-assign]
        chains = [[1] * drafts, [2] * drafts] if drafts else None
        driver.begin_decode(seqs, chains, pad_to=3)
        seqs[0].output.append(9)
        driver.begin_decode(seqs, chains, pad_to=3)
        driver.begin_decode(seqs, chains, pad_to=3)
        driver.begin_decode(seqs, chains, pad_to=4)  # other padding
        driver.begin_decode(list(seqs), chains, pad_to=4)  # (a new list of the same objects)
        driver.begin_context(seqs[:1])
        driver.begin_decode(seqs, chains, pad_to=4)
        driver.begin_decode(seqs[:1], chains, pad_to=4)  # other sequences
        driver.begin_capture(4)
        driver.begin_decode(seqs[:1], chains, pad_to=4)
        refuse.append(True)
        driver.begin_decode(seqs[:1], chains, pad_to=4)  # refused: add_batch
        refuse.clear()
        driver.begin_decode(seqs[:1], chains, pad_to=None)  # unpadded: other padding
        driver.begin_decode(seqs[:1], chains, pad_to=None)
        if make is CapturableGuidedDecoder and not drafts:
            assert calls == [("add", 3), ("advance", [9, 5, 0]), ("advance", [9, 5, 0]),
                             ("add", 4), ("advance", [9, 5, 0, 0]), ("add", 1), ("add", 4),
                             ("add", 4), ("add", 4), ("add", 4), ("add", 4), ("add", 1),
                             ("advance", [9])]
        else:
            assert all(kind == "add" for kind, _ in calls) and len(calls) == 13
        driver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch.cuda.is_available() is False")
@pytest.mark.parametrize("after_launch", [False, True], ids=["batch-before", "batch-after"])
def test_advanced_steps_in_a_cuda_graph_decode_what_eager_decodes(factory_cache, native_ok,
                                                                  after_launch):
    """In a real torch.cuda.CUDAGraph of (host work prepared first, forward, execute, greedy
    sample), 4 requests under the tool-call schema decoded with a context step by add_batch
    and every later step by advance_batch (the batch made before the replay, or after its
    launch) give the eager GuidedDecoder loop's tokens, every step run natively and every step
    after the first advanced one queued as the node's job again."""
    from test_capturable_gpu import ToyModel, _decode, _tool_schema, capture_after_warmup

    from capgraph import GuidedDecodingParams, GuideType
    factory = factory_cache("tekken")
    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, _tool_schema())
    batch, steps, V = 4, 48, factory.config.vocab_size_padded
    expected = _decode(GuidedDecoder, factory, params, batch, steps, graph=False)
    model = ToyModel(V, batch)
    dec = CapturableGuidedDecoder(factory.config, batch, 0, device="cuda", factory=factory,
                                  host_node="native")
    context = [GuidedRequest.context(i, i, params) for i in range(batch)]

    def step_fn() -> None:
        dec.record_tokens_ready()
        dec.prepare(batch)
        model.forward()
        dec.execute(model.logits)
        model.tokens.copy_(model.logits.argmax(-1))

    dec.add_batch(context)
    graph = capture_after_warmup(dec, step_fn)
    model.tokens.zero_()
    repeats = Repeats(dec)
    out: list[list[int]] = [[] for _ in range(batch)]
    dec.add_batch(context)
    graph.replay()
    if after_launch:
        dec.set_batch_after_launch(10.0)
    ran = 1
    for _ in range(steps - 1):
        torch.cuda.synchronize()
        assert dec.take_failed_requests() == []
        for i, t in enumerate(model.tokens.tolist()):
            out[i].append(t)
        if all(dec.grammar_matchers[i].is_terminated() for i in range(batch)):
            break
        advance_and_replay(dec, graph, [o[-1] for o in out], after_launch)
        ran += 1
    torch.cuda.synchronize()
    assert dec.take_failed_requests() == []
    assert out == [o[:len(out[0])] for o in expected]
    stats = dec.host_node_stats
    assert stats.python_runs == 0 and stats.runs == ran
    assert repeats.queued == ran - 2
    graph.reset()
    dec.close()


def test_a_refused_token_is_named_as_add_batch_names_it(factory, tekken, native_ok):
    """A token the grammar refuses, given to advance_batch and run natively: the request's
    failure names that token, word for word as add_batch's does."""
    cases = GUIDED[:1]
    stop = tekken.eos_token_id  # (a stop token: not allowed before the guide's end)
    messages = []
    for how in ("add_batch", "advance_batch"):
        capt, graph, _static, _texts = after_two_steps(factory, tekken, cases)
        repeats = Repeats(capt)
        if how == "add_batch":
            capt.add_batch(generation_requests(cases, [stop]))
        else:
            capt.advance_batch([stop])
        graph.replay()
        hostfunc.drain()
        (_, message), = capt.take_failed_requests()
        messages.append(message)
        assert repeats.queued == (how == "advance_batch")
        graph.reset()
        capt.close()
    assert f"new_token {stop} " in messages[0]
    assert messages[1] == messages[0]


@pytest.mark.parametrize("after_launch", [False, True], ids=["before-launch", "after-launch"])
def test_a_steady_steps_record_is_read_once_the_next_step_is_queued(factory, tekken, native_ok,
                                                                   after_launch):
    """On the native node, a steady step's record (every request ok, no matcher installed)
    holds only counters: a drain and take_failed_requests leave it unread, and the next
    advance_batch reads it after it has queued its own step (which the node may be waiting
    for: the batch after launch), not before; the count properties read it first. A step
    whose token the grammar refuses is read by the drain, and take_failed_requests names
    the request, as the drain reads the record of a step that installs matchers."""
    cases = GUIDED[:3]
    texts = texts_of(tekken, cases)
    capt = CapturableGuidedDecoder(factory.config, 3, 0, factory=factory, host_node="native")
    graph = capture(capt, context_requests(cases),
                    torch.zeros(3, factory.config.vocab_size_padded))
    node = capt._node
    capt.add_batch(context_requests(cases))
    graph.replay()
    hostfunc.drain()
    assert node.pending()[0] == 0  # (the context step installed matchers: read)
    capt.add_batch(generation_requests(cases, [t[0] for t in texts]))
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    calls: list[tuple[str, object]] = []
    for name in ("take", "repeat"):
        method = getattr(node, name)

        def logged(*args, _method=method, _name=name):
            result = _method(*args)
            calls.append((_name, len(result) if _name == "take" else result))
            return result
        setattr(node, name, logged)
    if after_launch:
        capt.set_batch_after_launch(5.0)
    for step in range(1, 4):
        records, _, plain = node.pending()
        assert (records, plain) == (1, True), f"step {step}: the previous step's record"
        calls.clear()
        advance_and_replay(capt, graph, [t[step] for t in texts], after_launch)
        # the repeat first; then the reads, which take the previous record (and this
        # step's, where the node ran it already)
        assert calls[0] == ("repeat", True), calls
        assert [c[0] for c in calls[1:]] == ["take"] * (len(calls) - 1), calls
        assert sum(c[1] for c in calls[1:]) >= 1, calls
        hostfunc.drain()
        assert capt.take_failed_requests() == []
    assert node.pending()[0] == 1
    assert capt.num_advanced_tokens == [1, 1, 1] and capt.num_guided_tokens == [1, 1, 1]
    assert node.pending()[0] == 0  # (the property read it)
    stop = tekken.eos_token_id  # (a stop token: not allowed before the guide's end)
    advance_and_replay(capt, graph, [texts[0][4], stop, texts[2][4]], after_launch)
    hostfunc.drain()
    assert node.pending()[0] == 0  # (a record with a failure is read by the drain)
    (request_id, message), = capt.take_failed_requests()
    assert request_id == 1 and f"new_token {stop} " in message
    graph.reset()
    capt.close()


@settings(max_examples=10, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 2**32 - 1), after_launch=st.booleans())
def test_random_advances_failures_and_reads_equal_eager(factory, tekken, native_ok, seed,
                                                        after_launch):
    """Random replayed steps of three slots on the native node: each step advance_batch
    where the batch can continue (else add_batch of the same requests, as the guide driver
    falls back), now and then a token the grammar refuses (its request restarted in its slot
    the step after, as an engine ends it), a request restarted at the end of its text, the
    count lists read or left unread between steps. The node's records of steady steps are
    then read at different places (the next advance_batch, add_batch, a property, a drain
    with a failure); every step's masked logits and failures, and the counts wherever read,
    equal an eager GuidedDecoder's given the same requests."""
    rng = random.Random(seed)
    V = factory.config.vocab_size_padded
    cases = GUIDED[:3]
    texts = texts_of(tekken, cases)
    stop = tekken.eos_token_id  # (refused before a guide's end)
    eager = GuidedDecoder(factory.config, 3, 0, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 3, 0, factory=factory, host_node="native")
    static = torch.zeros(3, V)
    graph = capture(capt, context_requests(cases), static)
    if after_launch:
        capt.set_batch_after_launch(5.0)
    ids = [0, 1, 2]  # each slot's request id
    pos = [None, None, None]  # each slot's next token index (None: a context step next)
    next_id, advanced = 3, 0
    for step in range(24):
        tokens, reqs = [], []
        for slot, case in enumerate(cases):
            if pos[slot] is None:
                reqs.append(GuidedRequest.context(ids[slot], slot, case.params))
                tokens.append(0)
                continue
            token = stop if rng.random() < 0.1 else texts[slot][pos[slot]]
            reqs.append(GuidedRequest.generation(ids[slot], slot, case.params, token))
            tokens.append(token)
        logits = torch.randn(3, V, generator=torch.Generator().manual_seed(step))
        eager.add_batch(reqs)
        expect = logits.clone()
        failed_a = eager.execute(expect)
        static.copy_(logits)

        def queue():
            nonlocal advanced
            if all(p is not None for p in pos) and rng.random() < 0.85:
                try:
                    capt.advance_batch(tokens)
                    advanced += 1
                    return
                except LayoutError:  # (a failure or a restart since: a new batch)
                    pass
            capt.add_batch(request_copies(reqs))
        if after_launch:
            graph.replay()
            queue()
        else:
            queue()
            graph.replay()
        hostfunc.drain()
        failed_b = capt.take_failed_requests()
        assert sorted(failed_a) == sorted(failed_b), f"step {step}"
        assert same(static, expect), f"step {step}: logits"
        if rng.random() < 0.5:
            assert capt.num_advanced_tokens == eager.num_advanced_tokens, f"step {step}"
            assert capt.num_guided_tokens == eager.num_guided_tokens, f"step {step}"
        failed = {rid for rid, _ in failed_a}
        for slot in range(3):
            at = 0 if pos[slot] is None else pos[slot] + 1
            if ids[slot] in failed or at >= len(texts[slot]):
                eager.release(slot)
                capt.release(slot)
                ids[slot], next_id, pos[slot] = next_id, next_id + 1, None
            else:
                pos[slot] = at
    assert capt.num_advanced_tokens == eager.num_advanced_tokens
    assert advanced > 0 and capt.host_node_stats.python_runs == 0
    graph.reset()
    capt.close()
    eager.close()


def test_the_tokens_are_read_at_the_call(factory, tekken, native_ok):
    """advance_batch reads its tokens at the call: a caller refilling its list right after
    it changes nothing, also where the node hands the step to Python (a slot only Python can
    run), which takes the tokens when the step runs. Regex c(aa|bb)d after "ca": the step fed
    'a' allows 'a' next and masks 'b'."""
    from capgraph.tokenizers import encode_continuation

    V = factory.config.vocab_size_padded
    a, = encode_continuation(tekken, "a")
    b, = encode_continuation(tekken, "b")
    c, = encode_continuation(tekken, "c")
    params = GuidedDecodingParams.regex("c(aa|bb)d")
    capt = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node="native")
    static = torch.zeros(1, V)
    graph = capture(capt, [GuidedRequest.context(0, 0, params)], static)
    for batch in ([GuidedRequest.context(0, 0, params)],
                  [GuidedRequest.generation(0, 0, params, c)]):
        capt.add_batch(batch)
        graph.replay()
        hostfunc.drain()
    assert capt.take_failed_requests() == []
    capt.grammar_matchers[0] = PythonOnly(capt.grammar_matchers[0])
    tokens = [a]
    capt.advance_batch(tokens)
    tokens[0] = b  # (the caller's next step)
    static.zero_()
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert capt.host_node_stats.python_runs == 1
    assert static[0, a] == 0 and torch.isneginf(static[0, b])
    graph.reset()
    capt.close()


def test_a_column_of_tokens_is_taken_and_other_shapes_are_refused(factory, tekken, native_ok):
    """A sampler's ``[n, 1]`` CPU tensor (or array) is taken as ``[n]``; a tensor of another
    shape is a LayoutError naming it, and a float tensor or array a TensorArgError naming its
    dtype, with nothing queued and every request still guided."""
    import numpy as np

    cases = GUIDED[:2]
    capt, graph, _static, texts = after_two_steps(factory, tekken, cases)
    with pytest.raises(LayoutError, match=r"shape \(2, 2\)"):
        capt.advance_batch(torch.zeros(2, 2, dtype=torch.int64))
    floats = [float(texts[0][1]), float(texts[1][1])]
    for bad, dtype in ((torch.tensor(floats), "torch.float32"), (np.array(floats), "float64")):
        with pytest.raises(TensorArgError, match=f"new_tokens must hold integer token ids, "
                                                 f"got dtype {dtype}"):
            capt.advance_batch(bad)
    assert capt.queued_batches == 0 and capt.take_failed_requests() == []
    for k, make in ((1, torch.tensor), (2, np.array)):
        capt.advance_batch(make([[texts[0][k]], [texts[1][k]]]))
        graph.replay()
        hostfunc.drain()
        assert capt.take_failed_requests() == []
    assert capt.num_advanced_tokens[:2] == [1, 1]
    graph.reset()
    capt.close()


@pytest.mark.parametrize("how", ["add_batch", "advance_batch"])
def test_a_fault_in_a_python_step_of_a_shared_batch_fails_its_requests(factory, tekken,
                                                                        native_ok, how):
    """A fault after a Python step of the node took its batch (injected into the past-rows
    check), with the next step already queued behind a 100 ms native spin: every request of
    the step is reported failed, whether the step's batch came from add_batch or is the
    previous batch shared by advance_batch; and advance_batch then refuses to continue."""
    cases = GUIDED[:2]
    capt, graph, _static, texts = after_two_steps(factory, tekken, cases, capture_behind_spin)
    capt.grammar_matchers[0] = PythonOnly(capt.grammar_matchers[0])  # (a Python step)
    calls = []

    def fault(batch, rows):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected fault")
    capt._fail_past_rows = fault  # type: ignore[method-assign]

    def step(k):
        tokens = [t[k] for t in texts]
        if how == "advance_batch":
            capt.advance_batch(tokens)
        else:
            capt.add_batch(generation_requests(cases, tokens))
    step(1)
    graph.replay()
    step(2)  # (queued behind the replay's spin)
    with pytest.raises(hostfunc.HostFuncError, match="injected fault"):
        hostfunc.drain()
    assert sorted(i for i, _ in capt.take_failed_requests()) == [0, 1]
    with pytest.raises(LayoutError, match="a request failed"):
        capt.advance_batch([t[3] for t in texts])
    graph.replay()  # (step 2: its requests, failed at step 1, have no matchers now)
    hostfunc.drain()
    graph.reset()
    capt.close()
