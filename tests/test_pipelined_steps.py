"""Steps scheduled ahead: an engine that calls ``add_batch`` for step N+1 before the replay of
step N has run (overlap scheduling). On hostfunc's CPU stand-in, a gate task holds the replay
stream so that every ``add_batch`` deterministically comes before the previous step's host
node: each step still takes its own batch and tokens (the step ticket and the token copy are
written in stream order), a new request placed in a slot whose previous request's last step is
still queued gets its matcher after that step, and missing or extra puts are still named."""

from __future__ import annotations

import random
import threading
from collections import deque

import pytest
import torch

import hostfunc
from capgraph import QueueEpochError
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest
from test_host_node import GUIDED, capture, one_request_after_context, same, texts_of


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


class Gate:
    """A task on the current HostStream that waits until :meth:`open`: whatever is enqueued
    after it runs only then."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self._wait = lambda: self.event.wait(30)
        hostfunc.current_stream().enqueue(self._wait)

    def open(self) -> None:
        self.event.set()


def enqueue(fn) -> None:
    hostfunc.current_stream().enqueue(fn)


def schedule(cases, texts, reuse_at: int):
    """Per step, the requests of two slots: request 1 (``cases[0]``) in slot 0 until step
    ``reuse_at - 1``, then request 3 (``cases[2]``) starts in slot 0; request 2 (``cases[1]``)
    in slot 1 throughout. Each entry: ``[(request id, slot, case, position)]`` (position 0:
    the context step; p > 0: the generation step that feeds token p - 1)."""
    steps = min(reuse_at + len(texts[2]), len(texts[1]) + 1)
    plan = []
    for step in range(steps):
        first = (1, 0, 0, step) if step < reuse_at else (3, 0, 2, step - reuse_at)
        plan.append([first, (2, 1, 1, step)])
    return plan


def requests_of(plan_step, cases, texts, buffered: bool):
    """The step's requests, and its ``[1, 2]`` token tensor (the token buffer's column per
    slot)."""
    reqs, tokens = [], torch.zeros(1, 2, dtype=torch.int32)
    for rid, slot, c, pos in plan_step:
        params = cases[c].params
        if pos == 0:
            reqs.append(GuidedRequest.context(rid, slot, params))
            continue
        token = texts[c][pos - 1]
        tokens[0, slot] = token
        reqs.append(GuidedRequest.generation(rid, slot, params, None if buffered else token,
                                             prev_seq_slot=slot if buffered else None))
    return reqs, tokens


@pytest.mark.parametrize("buffered", [True, False], ids=["token-buffer", "request-tokens"])
@pytest.mark.parametrize("host_node", ["native", "python"])
def test_steps_scheduled_ahead_equal_the_eager_decoder(factory, tekken, native_ok, host_node,
                                                        buffered):
    """Two slots decoded through a replayed HostGraph with every add_batch made while the
    previous step's replay is still held on the stream (two batches queued each time), slot 0
    reused by a new request while its previous request's last step is queued: every step's
    masked logits and token mask equal GuidedDecoder's run one step at a time, on the native
    node (every step native) and on the Python callback."""
    V = factory.config.vocab_size_padded
    cases = GUIDED[:3]
    texts = texts_of(tekken, cases)
    plan = schedule(cases, texts, reuse_at=4)
    eager = GuidedDecoder(factory.config, 2, 0, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node=host_node)
    static = torch.zeros(2, V)
    graph = capture(capt, requests_of(plan[0], cases, texts, False)[0], static)
    logits = [torch.randn(2, V, generator=torch.Generator().manual_seed(s)) for s in
              range(len(plan))]
    expected, got, depth = [], [], []
    for step, plan_step in enumerate(plan):
        reqs, _ = requests_of(plan_step, cases, texts, False)
        eager.add_batch(reqs)
        out = logits[step].clone()
        assert eager.execute(out) == [], f"step {step}"
        expected.append((out, eager.token_mask_host[:2].clone()))

    gate = Gate()
    for step, plan_step in enumerate(plan):
        reqs, tokens = requests_of(plan_step, cases, texts, buffered)
        capt.add_batch(reqs, tokens if buffered else None)
        depth.append(capt.queued_batches)
        gate.open()  # (the previous step runs now, after this add_batch)
        gate = Gate()  # (this step waits for the next add_batch)
        enqueue(lambda s=step: static.copy_(logits[s]))
        graph.replay()
        enqueue(lambda: got.append((static.clone(), capt.token_mask_host[:2].clone())))
    gate.open()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert min(depth[1:]) >= 2  # each add_batch came with the previous step still queued
    assert len(got) == len(plan)
    for step, ((out, mask), (want, want_mask)) in enumerate(zip(got, expected)):
        assert same(out, want), f"step {step}"
        assert torch.equal(mask, want_mask), f"step {step}"
    if host_node == "native":
        stats = capt.host_node_stats
        assert stats.runs == len(plan) and stats.python_runs == 0
    graph.reset()
    capt.close()


def greedy_plan(lengths: tuple[int, int, int], reuse_at: int):
    """Per step, ``[(request id, slot, guide, position)]`` for greedy decoding: request 1 (guide
    0) in slot 0 for ``reuse_at`` steps, then request 3 (guide 2) there; request 2 (guide 1) in
    slot 1 throughout; position 0 is the context step. ``lengths``: each request's steps."""
    plan = []
    for step in range(max(reuse_at + lengths[2], lengths[1])):
        row = []
        if step < reuse_at:
            row.append((1, 0, 0, step))
        elif step - reuse_at < lengths[2]:
            row.append((3, 0, 2, step - reuse_at))
        if step < lengths[1]:
            row.append((2, 1, 1, step))
        plan.append(row)
    return plan


def random_plan(rng: random.Random, slots: int, steps: int, guides: int):
    """Per step, ``[(request id, slot, guide or None, position)]``: each slot runs requests
    back to back (2 to 8 steps each, a guide drawn from ``guides`` or none), sometimes idle
    for a step; a request's first step is its context step."""
    plan: list[list] = [[] for _ in range(steps)]
    rid = 0
    for slot in range(slots):
        step = rng.randrange(2)
        while step < steps:
            rid += 1
            guide = rng.randrange(guides) if rng.random() < 0.85 else None
            length = rng.randint(2, 8)
            for pos in range(min(length, steps - step)):
                plan[step + pos].append((rid, slot, guide, pos))
            step += length + (rng.random() < 0.3)
    return [sorted(row, key=lambda r: r[1]) for row in plan]


def greedy_ahead(factory, plan, cases, host_node: str, depth: int, slots: int, seed: int):
    """Greedy decoding of ``plan`` on random logits (``seed``) with the eager decoder one
    step at a time and, on the CPU stand-in, with a captured step replayed ``depth`` steps
    ahead of the stream: each step's tokens are sampled by a task on the stream into one
    token tensor, which the next add_batch reads through the token buffer before the stream
    gets there (gates hold the stream until ``depth`` later steps are queued). Returns (the
    eager tokens per step, the replayed ones, the capturable decoder's failures, its
    decoder)."""
    V = factory.config.vocab_size_padded
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(slots, V, generator=g) for _ in plan]

    def requests(plan_step, last: dict, buffered: bool):
        reqs = []
        for rid, slot, guide, pos in plan_step:
            params = None if guide is None else cases[guide].params
            if pos == 0:
                reqs.append(GuidedRequest.context(rid, slot, params))
            else:
                reqs.append(GuidedRequest.generation(
                    rid, slot, params, None if buffered else last[slot],
                    prev_seq_slot=slot if buffered else None))
        return reqs

    eager = GuidedDecoder(factory.config, slots, 0, factory=factory)
    want, last = [], {}
    for step, plan_step in enumerate(plan):
        if not plan_step:
            want.append({})
            continue
        eager.add_batch(requests(plan_step, last, False))
        out = logits[step][:len(plan_step)].clone()
        assert eager.execute(out) == [], f"step {step}"
        last = {slot: int(out[i].argmax()) for i, (_, slot, _, _) in enumerate(plan_step)}
        want.append(last)
    eager.close()

    capt = CapturableGuidedDecoder(factory.config, slots, 0, factory=factory,
                                   host_node=host_node)
    static = torch.zeros(slots, V)
    graph = capture(capt, [GuidedRequest.context(0, 0, cases[0].params)], static)
    tokens = torch.zeros(1, slots, dtype=torch.int32)  # written by the stream's sampler
    got: list[dict] = []

    def sampler(plan_step):
        def sample() -> None:
            sampled = {}
            for i, (_, slot, _, _) in enumerate(plan_step):
                sampled[slot] = int(static[i].argmax())
                tokens[0, slot] = sampled[slot]
            got.append(sampled)
        return sample

    gates: deque[Gate] = deque([Gate()])
    for step, plan_step in enumerate(plan):
        capt.add_batch(requests(plan_step, {}, True), tokens)
        while len(gates) >= depth:  # (the step `depth` back runs now, after this add_batch)
            gates.popleft().open()
        gates.append(Gate())
        enqueue(lambda s=step: static.copy_(logits[s]))
        graph.replay()
        enqueue(sampler(plan_step))
    for gate in gates:
        gate.open()
    hostfunc.drain()
    failed = capt.take_failed_requests()
    graph.reset()
    return want, got, failed, capt


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_greedy_decoding_sampled_on_the_stream_and_scheduled_ahead(factory, native_ok,
                                                                   host_node):
    """An overlap scheduler's loop on the CPU stand-in: each step's tokens are sampled by a
    task on the stream (the argmax of the masked logits, written to one token tensor), and
    add_batch for the next step, reading its tokens from that tensor through the token
    buffer, comes before the step has run (a gate holds the stream); slot 0 takes a new
    request while its previous request's last step is queued. The tokens sampled equal
    greedy decoding with the eager decoder one step at a time, and every step ran on the
    node natively."""
    plan = greedy_plan((5, 12, 6), reuse_at=5)
    want, got, failed, capt = greedy_ahead(factory, plan, GUIDED[:3], host_node, 1, 2, 0)
    assert failed == []
    assert got == want
    if host_node == "native":
        stats = capt.host_node_stats
        assert stats.runs == len(plan) and stats.python_runs == 0, stats
    capt.close()


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("host_node", ["native", "python"])
def test_random_schedules_run_ahead_equal_step_by_step_greedy(factory, native_ok, host_node,
                                                              seed):
    """Random schedules (three slots, requests of 2 to 8 steps back to back with random
    guides or none, idle steps, slots reused at once) run 1 to 3 steps ahead of the stream:
    the tokens sampled on the stream equal step-by-step greedy decoding, without failures."""
    rng = random.Random(seed)
    plan = random_plan(rng, 3, 24, len(GUIDED))
    want, got, failed, capt = greedy_ahead(factory, plan, GUIDED, host_node,
                                           rng.randint(1, 3), 3, seed)
    assert failed == []
    assert got == want
    capt.close()


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_a_replay_without_its_add_batch_is_named_while_the_next_step_is_queued(
        factory, tekken, native_ok, host_node):
    """add_batch, replay, a second replay without its add_batch, then the next add_batch and
    replay, all before the stream runs any of them: the second replay raises a
    QueueEpochError at the drain and consumes nothing; the steps before and after it take
    their own batches (the matcher advanced exactly once per put)."""
    case = GUIDED[0]
    capt, graph, static, text = one_request_after_context(factory, tekken, case, host_node)

    gate = Gate()
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])
    graph.replay()
    graph.replay()  # without its add_batch
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[1])])
    enqueue(lambda: static.zero_())
    graph.replay()
    gate.open()
    with pytest.raises(hostfunc.HostFuncError, match="consumed already") as info:
        hostfunc.drain()
    assert isinstance(info.value.__cause__, QueueEpochError)
    hostfunc.drain()  # (the error was reported once)
    assert capt.take_failed_requests() == []
    assert capt.queued_batches == 0
    assert capt.num_advanced_tokens[0] == 1 and capt.token_mask_host[0] == 1
    assert torch.isneginf(static).any()  # the last step masked its row
    eager = GuidedDecoder(factory.config, 1, 0, factory=factory)
    eager.add_batch([GuidedRequest.context(1, 0, case.params)])
    eager.execute(torch.zeros(1, factory.config.vocab_size_padded))
    for token in text[:2]:
        eager.add_batch([GuidedRequest.generation(1, 0, case.params, token)])
        out = torch.zeros(1, factory.config.vocab_size_padded)
        eager.execute(out)
    assert same(static, out)  # the matcher saw text[0] then text[1], once each
    graph.reset()
    capt.close()


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_an_extra_add_batch_while_steps_are_queued_is_named(factory, tekken, native_ok,
                                                           host_node):
    """Two add_batch calls for one replay, made while an earlier step is still queued: the
    earlier step takes its own batch; the replay after the extra put raises a
    QueueEpochError naming the batch that had no step, masks nothing and consumes both; the
    next add_batch and replay are in step again."""
    case = GUIDED[0]
    text = texts_of(tekken, [case])[0]
    capt = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory, host_node=host_node)
    V = factory.config.vocab_size_padded
    static = torch.zeros(1, V)
    graph = capture(capt, [GuidedRequest.context(1, 0, case.params)], static)
    gate = Gate()
    capt.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph.replay()
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])  # no step of its own
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])
    assert capt.queued_batches == 3
    masked: list[bool] = []
    enqueue(lambda: static.fill_(1.0))
    graph.replay()
    enqueue(lambda: masked.append(bool(torch.isneginf(static).any())))
    gate.open()
    with pytest.raises(hostfunc.HostFuncError, match=r"had no step of their own") as info:
        hostfunc.drain()
    assert isinstance(info.value.__cause__, QueueEpochError)
    assert masked == [False] and capt.queued_batches == 0
    assert capt.num_advanced_tokens[0] == 0  # the context step ran; nothing advanced since
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])
    graph.replay()
    hostfunc.drain()
    assert capt.num_advanced_tokens[0] == 1 and capt.token_mask_host[0] == 1
    assert torch.isneginf(static).any()
    graph.reset()
    capt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch.cuda.is_available() is False")
@pytest.mark.parametrize("buffered", ["device", "host", None],
                         ids=["token-buffer", "cpu-token-buffer", "request-tokens"])
@pytest.mark.parametrize("host_node", ["native", "python"])
def test_steps_scheduled_ahead_of_cuda_graph_replays_equal_the_eager_decoder(
        factory, tekken, native_ok, host_node, buffered):
    """The CPU test's schedule on CUDA: a graph of [a ~20 ms GPU sleep, the guided step] is
    replayed once per step with the host loop running ahead (no sync until the end; the
    logits, the token tensor copies and the outputs' clones are stream-ordered), so each
    add_batch comes while earlier replays still sleep on the GPU; every step's masked logits
    equal GuidedDecoder's, slot 0's reuse included. The tokens come in the requests, in a
    device tensor, or in a CPU tensor (read at add_batch, landing after the queued steps)."""
    from test_host_node_gpu import _cycles_for_ms
    V = factory.config.vocab_size_padded
    cases = GUIDED[:3]
    texts = texts_of(tekken, cases)
    plan = schedule(cases, texts, reuse_at=4)
    eager = GuidedDecoder(factory.config, 2, 0, factory=factory)
    logits = [torch.randn(2, V, generator=torch.Generator().manual_seed(s)) for s in
              range(len(plan))]
    expected = []
    for step, plan_step in enumerate(plan):
        eager.add_batch(requests_of(plan_step, cases, texts, False)[0])
        out = logits[step].clone()
        assert eager.execute(out) == [], f"step {step}"
        expected.append(out)

    dec = CapturableGuidedDecoder(factory.config, 2, 0, device="cuda", factory=factory,
                                  host_node=host_node)
    static = torch.zeros(2, V, device="cuda")
    dec.add_batch(requests_of(plan[0], cases, texts, False)[0])
    with dec.warmup():
        dec.execute(static)
    cycles = _cycles_for_ms(20)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(cycles)
        dec.execute(static)
    steps = [requests_of(s, cases, texts, buffered is not None) for s in plan]
    logits_dev = [t.cuda() for t in logits]
    tokens_in = [tokens.cuda() if buffered == "device" else tokens for _, tokens in steps]
    torch.cuda.synchronize()
    outs, depth = [], []
    for step, (reqs, _) in enumerate(steps):
        dec.add_batch(reqs, tokens_in[step] if buffered else None)
        depth.append(dec.queued_batches)
        static.copy_(logits_dev[step])
        graph.replay()
        outs.append(static.clone())
    torch.cuda.synchronize()
    hostfunc.drain()
    assert dec.take_failed_requests() == []
    assert max(depth) >= 2, depth  # the host ran ahead of the replays
    for step, (out, want) in enumerate(zip(outs, expected)):
        assert same(out.cpu(), want), f"step {step}"
    if host_node == "native":
        stats = dec.host_node_stats
        assert stats.runs == len(plan) and stats.python_runs == 0, stats
    graph.reset()
    dec.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch.cuda.is_available() is False")
def test_a_cpu_count_tensor_is_refused_inside_a_cuda_capture(factory, tekken):
    """rollback_rejected_batch with CPU counts inside a CUDA graph capture: a named error
    before anything is queued (a replay would roll back by the capture's counts); with a
    device tensor the same capture succeeds."""
    from capgraph import TensorArgError
    case = GUIDED[0]
    dec = CapturableGuidedDecoder(factory.config, 1, 2, device="cuda", factory=factory,
                                  host_node="python")
    dec.add_batch([GuidedRequest.context(1, 0, case.params)])
    torch.cuda.synchronize()
    with pytest.raises(TensorArgError, match=r"CPU tensor while a CUDA graph is being captured"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            dec.rollback_rejected_batch(torch.ones(1, dtype=torch.int32))
    counts = torch.ones(1, dtype=torch.int32, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dec.rollback_rejected_batch(counts)
    torch.cuda.synchronize()
    hostfunc.drain()
    graph.reset()
    dec.close()


@pytest.mark.parametrize("host_node", ["native", "python", "eager"])
def test_a_new_request_in_a_reused_slot_is_not_rolled_back(factory, tekken, native_ok,
                                                          host_node):
    """Speculative decoding, slot 0 reused: request 1 advances three tokens (a token and two
    drafts), then request 3 starts in slot 0 and the rollback of that step's batch comes with
    an accepted count of 0 at the new request's position (nothing of it was verified). The
    slot's advances were request 1's: the new request is not rolled back and does not fail,
    and its row is a fresh matcher's first mask."""
    first, second = GUIDED[0], GUIDED[2]
    text = texts_of(tekken, [first])[0]
    V = factory.config.vocab_size_padded
    fresh = GuidedDecoder(factory.config, 1, 2, factory=factory)
    fresh.add_batch([GuidedRequest.context(3, 0, second.params)])
    want = torch.zeros(1, V)
    assert fresh.execute(want) == []

    context = [GuidedRequest.context(1, 0, first.params)]
    drafted = [GuidedRequest.generation(1, 0, first.params, text[0], draft_tokens=text[1:3])]
    reuse = [GuidedRequest.context(3, 0, second.params)]
    static = torch.zeros(3, V)
    if host_node == "eager":
        dec = GuidedDecoder(factory.config, 1, 2, factory=factory)
        for reqs in (context, drafted):
            dec.add_batch(reqs)
            assert dec.execute(torch.zeros(dec.requests.num_bitmask_tokens, V)) == []
        assert dec.num_advanced_tokens[0] == 3
        dec.add_batch(reuse)
        dec.requests.requests[0].num_accepted_draft_tokens = -1  # (a count of 0)
        dec.rollback_rejected_tokens()
        static = torch.zeros(1, V)
        failed = dec.execute(static)
    else:
        dec = CapturableGuidedDecoder(factory.config, 1, 2, factory=factory,
                                      host_node=host_node)
        graph = capture(dec, context, static)
        for reqs in (context, drafted):
            dec.add_batch(reqs)
            graph.replay()
            hostfunc.drain()
        assert dec.take_failed_requests() == [] and dec.num_advanced_tokens[0] == 3
        dec.add_batch(reuse)
        dec.rollback_rejected_batch(torch.tensor([0], dtype=torch.int32))
        static.zero_()
        graph.replay()
        hostfunc.drain()
        failed = dec.take_failed_requests()
        graph.reset()
    assert failed == []
    assert same(static[:1], want[:1])
    dec.close()


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_speculative_steps_scheduled_ahead_equal_the_eager_decoder(factory, tekken, native_ok,
                                                                   host_node):
    """Speculative decoding scheduled ahead: a captured [rollback of the last verification,
    guided step with two drafts] replayed with each add_batch made before the previous replay
    has run; the accepted counts are written by a task on the stream into the tensor the
    graph copies them from (where an engine's verification writes them). The rollback reads
    the batch of its own step, not a later queued one (the batch order alternates, so the two
    differ): every step's masked logits equal the eager decoder's with
    rollback_rejected_tokens, and on the node every step and rollback but the first ran
    natively."""
    from test_host_node import Speculation, accepted_counts, request_copies, speculative_graph
    V = factory.config.vocab_size_padded
    spec = Speculation(tekken, GUIDED[:2])
    accepted = [[0, 1], [2, 0], [1, 1], [0, 2], [2, 2], [1, 0]]
    steps = [spec.context(), spec.step(None)] + [spec.step(a) for a in accepted]
    # (the batch order alternates: a step's counts, by batch position, are not the next's)
    steps = [reqs[::-1] if k % 2 else reqs for k, reqs in enumerate(steps)]
    logits = [torch.randn(6, V, generator=torch.Generator().manual_seed(k)) for k in
              range(len(steps))]
    eager = GuidedDecoder(factory.config, 2, 2, factory=factory)
    expected = []
    for k, reqs in enumerate(steps):
        eager.add_batch(request_copies(reqs))
        eager.rollback_rejected_tokens()
        out = logits[k][:eager.requests.num_bitmask_tokens].clone()
        assert eager.execute(out) == [], f"step {k}"
        expected.append(out)

    capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory, host_node=host_node)
    static = torch.zeros(6, V)
    graph, counts = speculative_graph(capt, request_copies(steps[0]), static)
    got: list[torch.Tensor] = []

    def write_counts(values):
        def write() -> None:
            counts[:len(values)] = values
        return write

    gate = Gate()
    for k, reqs in enumerate(steps):
        capt.add_batch(request_copies(reqs))
        gate.open()
        gate = Gate()
        enqueue(write_counts(accepted_counts(reqs)))
        enqueue(lambda k=k: static.copy_(logits[k]))
        graph.replay()
        enqueue(lambda n=len(expected[k]): got.append(static[:n].clone()))
    gate.open()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert len(got) == len(steps)
    for k, (out, want) in enumerate(zip(got, expected)):
        assert same(out, want), f"step {k}"
    if host_node == "native":
        stats = capt.host_node_stats
        assert stats.python_runs == 0 and stats.python_rollback_runs <= 1, stats
    graph.reset()
    capt.close()


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_add_batch_refuses_to_queue_without_bound(factory, tekken, native_ok, host_node):
    """add_batch without replays queues up to MAX_QUEUED_BATCHES batches (a step's ticket
    tells its own among them), then raises a QueueEpochError saying what is missing, and
    queues nothing; discard_queued_batches() drops them and the next step is in step."""
    from capgraph.capturable import MAX_QUEUED_BATCHES
    case = GUIDED[0]
    capt, graph, static, text = one_request_after_context(factory, tekken, case, host_node)
    step = [GuidedRequest.generation(1, 0, case.params, text[0])]
    for _ in range(MAX_QUEUED_BATCHES):
        capt.add_batch(step)
    with pytest.raises(QueueEpochError, match=f"{MAX_QUEUED_BATCHES} batches are queued"):
        capt.add_batch(step)
    assert capt.queued_batches == MAX_QUEUED_BATCHES
    assert capt.discard_queued_batches() == MAX_QUEUED_BATCHES
    capt.add_batch(step)
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    assert capt.num_advanced_tokens[0] == 1 and capt.token_mask_host[0] == 1
    graph.reset()
    capt.close()


def test_draft_inputs_are_written_in_stream_order(factory):
    """On the CPU stand-in, add_draft_batch's tokens and counts reach the decoder's pinned
    buffers after the work already on the current stream (as CUDA copies on the current
    stream do), so a step still queued reads its own; on an idle stream at once."""
    capt = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory, host_node="python")
    capt.add_draft_batch(torch.tensor([5, 6]), torch.tensor([1, 2]), 0)
    assert capt.draft_new_tokens[:2].tolist() == [5, 6]  # (idle: at once)
    gate = Gate()
    seen: list = []
    enqueue(lambda: seen.append((capt.draft_new_tokens[:2].tolist(),
                                 capt.num_accepted_tokens[:2].tolist())))
    capt.add_draft_batch(torch.tensor([7, 8]), torch.tensor([3, 1]), 0)
    assert capt.draft_new_tokens[:2].tolist() == [5, 6]
    gate.open()
    hostfunc.drain()
    assert seen == [([5, 6], [1, 2])]
    assert capt.draft_new_tokens[:2].tolist() == [7, 8]
    assert capt.num_accepted_tokens[:2].tolist() == [3, 1]
    capt.close()


@pytest.mark.parametrize("state", ["idle", "busy", "capturing"])
def test_a_cpu_tensor_on_cuda_lands_in_stream_order_or_is_refused_in_a_capture(state):
    """How a CUDA decoder copies a CPU tensor into its pinned buffers (torch copies host to
    host at once, never in stream order, and a capture does not record it), with the stream
    faked (no device here): at once when the current stream is idle; staged on the device
    (read now, landing after the queued work) when it is busy; refused with a named error
    while capturing, before anything is copied. A device tensor is one stream copy."""
    from types import SimpleNamespace

    from capgraph import TensorArgError
    copies: list = []
    dst = SimpleNamespace(copy_=lambda src, non_blocking=False: copies.append((src,
                                                                               non_blocking)))
    staged = SimpleNamespace(device=SimpleNamespace(type="cuda"))
    src = SimpleNamespace(device=SimpleNamespace(type="cpu"),
                          to=lambda device, non_blocking=False: (device, non_blocking, staged))
    fake = SimpleNamespace(device=torch.device("cuda"),
                           _streams=SimpleNamespace(is_capturing=lambda: state == "capturing"),
                           _stream_idle=lambda: state == "idle")
    copy = CapturableGuidedDecoder._cuda_copy
    if state == "capturing":
        with pytest.raises(TensorArgError, match=r"num_accepted_tokens is a CPU tensor while a "
                                                 r"CUDA graph is being captured"):
            copy(fake, dst, src, "num_accepted_tokens")
        assert copies == []
    else:
        copy(fake, dst, src, "num_accepted_tokens")
        want = (src, False) if state == "idle" else ((torch.device("cuda"), True, staged), True)
        assert copies == [want]
    copies.clear()
    copy(fake, dst, staged, "num_accepted_tokens")  # a device tensor: one copy on the stream
    assert copies == [(staged, True)]


def _drain_error() -> BaseException | None:
    """The cause of the error the next drain raises (None: it raised none)."""
    try:
        hostfunc.drain()
    except hostfunc.HostFuncError as e:
        return e.__cause__
    return None


def _eager_first_step_mask(factory, case, token) -> torch.Tensor:
    """GuidedDecoder's mask of ``case``'s first generation step (``token`` fed)."""
    V = factory.config.vocab_size_padded
    eager = GuidedDecoder(factory.config, 2, 0, factory=factory)
    eager.add_batch([GuidedRequest.context(1, 0, case.params)])
    assert eager.execute(torch.zeros(1, V)) == []
    want = torch.zeros(1, V)
    eager.add_batch([GuidedRequest.generation(1, 0, case.params, token)])
    assert eager.execute(want) == []
    return want


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_a_failed_step_run_ahead_leaves_the_queued_step_its_matcher(factory, tekken, native_ok,
                                                                   host_node):
    """Step N (request 1) is replayed and still queued when the host runs ahead to step N+1,
    where request 1 fails admission (nothing guided is left) and which it executes eagerly
    while step N waits. Step N still masks as GuidedDecoder's does: the failed request's
    matcher is dropped in the stream's order, after step N, not at once (which unguided it)."""
    case = GUIDED[0]
    V = factory.config.vocab_size_padded
    capt, graph, static, text = one_request_after_context(factory, tekken, case, host_node)
    gate = Gate()
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])
    enqueue(static.zero_)
    graph.replay()  # step N: queued behind the gate
    nxt = GuidedRequest.generation(1, 0, case.params, text[1])
    nxt.draft_tokens = "12"  # (not a list of ints: request 1 fails admission)
    capt.add_batch([nxt])
    seen: list = []
    enqueue(lambda: seen.append(static.clone()))  # (step N's output)
    opener = threading.Timer(0.3, gate.open)  # (execute waits for its own step, behind N)
    opener.start()
    capt.execute(torch.zeros(1, V))  # step N+1, eager, called while step N is queued
    opener.join()
    assert _drain_error() is None
    assert [rid for rid, _ in capt.take_failed_requests()] == [1]
    assert torch.isneginf(seen[0]).any()
    assert same(seen[0], _eager_first_step_mask(factory, case, text[0]))
    assert capt.grammar_matchers[0] is None and capt.queued_batches == 0
    graph.reset()
    capt.close()


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_an_unguided_step_run_ahead_leaves_the_queued_step_its_token_mask(
        factory, tekken, native_ok, host_node):
    """A graph of [the host step (prepare), the forward, the apply (execute)]: step N's mask
    is built and its forward runs when the host runs ahead to an unguided step N+1 and
    executes it eagerly. Step N's apply still masks its row (the unguided step clears the
    token mask in the stream's order, not under step N's apply)."""
    case = GUIDED[0]
    V = factory.config.vocab_size_padded
    text = texts_of(tekken, [case])[0]
    capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node=host_node)
    static = torch.zeros(1, V)
    forward_ran, forward_may_end = threading.Event(), threading.Event()
    hold = [False]

    def forward() -> None:
        if hold[0]:
            forward_ran.set()
            forward_may_end.wait(30)
    capt.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        capt.prepare()
        hostfunc.launch(forward)
        capt.execute(static)
    capt.add_batch([GuidedRequest.context(1, 0, case.params)])
    graph.replay()
    hostfunc.drain()
    hold[0] = True
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])
    static.zero_()
    graph.replay()  # step N
    assert forward_ran.wait(30)  # (its mask is built, its forward runs)
    capt.add_batch([GuidedRequest.generation(2, 1, None, 5)])
    opener = threading.Timer(0.3, forward_may_end.set)
    opener.start()
    capt.execute(torch.zeros(1, V))  # step N+1, eager, nothing guided
    opener.join()
    assert _drain_error() is None and capt.take_failed_requests() == []
    assert torch.isneginf(static).any()
    assert same(static, _eager_first_step_mask(factory, case, text[0]))
    graph.reset()
    capt.close()


@pytest.mark.parametrize("ahead", [False, True], ids=["in-step", "run-ahead"])
@pytest.mark.parametrize("host_node", ["native", "python"])
def test_an_apply_fault_fails_its_own_steps_requests(factory, tekken, native_ok, host_node,
                                                     ahead, monkeypatch):
    """The apply of a replayed step that advanced only request 2 raises once: request 2 fails
    (named in the error, its matcher dropped) and request 1, which the step before advanced,
    keeps its matcher, with the next step queued behind it or not. On the native node the
    fault is handled after reading the node's steps up to it (it named the step before's
    request)."""
    from capgraph.decoder import GuidedDecoder as Base
    first, second = GUIDED[0], GUIDED[2]
    t1, t2 = texts_of(tekken, [first, second])
    V = factory.config.vocab_size_padded
    capt = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory, host_node=host_node)
    static = torch.zeros(2, V)
    ctx = [GuidedRequest.context(1, 0, first.params), GuidedRequest.context(2, 1, second.params)]
    graph = capture(capt, ctx, static)
    capt.add_batch(ctx)
    graph.replay()
    capt.add_batch([GuidedRequest.generation(1, 0, first.params, t1[0])])
    graph.replay()
    hostfunc.drain()
    assert capt.take_failed_requests() == []
    apply = Base.apply_bitmask
    faults: list = []

    def broken(self, *args):
        if not faults:
            faults.append(1)
            raise RuntimeError("injected apply fault")
        return apply(self, *args)
    gate = Gate() if ahead else None
    capt.add_batch([GuidedRequest.generation(2, 1, second.params, t2[0])])  # only request 2
    enqueue(lambda: monkeypatch.setattr(Base, "apply_bitmask", broken))
    graph.replay()
    enqueue(lambda: monkeypatch.setattr(Base, "apply_bitmask", apply))
    if ahead:
        capt.add_batch([GuidedRequest.generation(1, 0, first.params, t1[1])])
        graph.replay()
        gate.open()
    cause = _drain_error()
    assert faults == [1]
    assert getattr(cause, "request_ids", None) == [2], cause
    assert [rid for rid, _ in capt.take_failed_requests()] == [2]
    assert capt.grammar_matchers[0] is not None and capt.grammar_matchers[1] is None
    graph.reset()
    capt.close()


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_a_failed_requests_matcher_goes_when_a_queue_error_consumes_its_batch(
        factory, tekken, native_ok, host_node):
    """An extra add_batch (no step of its own) in which request 1 fails admission, then the
    next step's: that step takes both and raises QueueEpochError (masking nothing). Request 1
    fails and its matcher is dropped on both host nodes (the native node clears the slot in
    its own table too), so its next step is unguided and no matcher is left active."""
    case = GUIDED[0]
    capt, graph, static, text = one_request_after_context(factory, tekken, case, host_node)
    gate = Gate()
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[0])])
    graph.replay()
    bad = GuidedRequest.generation(1, 0, case.params, text[1])
    bad.draft_tokens = "12"
    capt.add_batch([bad])  # no replay of its own
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[1])])
    graph.replay()  # takes the extra batch and its own: a queue error
    gate.open()
    assert isinstance(_drain_error(), QueueEpochError)
    assert [rid for rid, _ in capt.take_failed_requests()] == [1]
    assert capt.grammar_matchers[0] is None and capt.num_active_matchers == 0
    static.zero_()
    capt.add_batch([GuidedRequest.generation(1, 0, case.params, text[1])])
    graph.replay()
    assert _drain_error() is None and capt.take_failed_requests() == []
    assert not torch.isneginf(static).any()  # (no matcher in the slot: nothing masked)
    graph.reset()
    capt.close()


@pytest.mark.parametrize("host_node", ["native", "python"])
def test_release_while_the_slots_last_step_is_queued_waits_for_it(factory, tekken, native_ok,
                                                                  host_node):
    """An engine running ahead releases request 1 (its last step, step N, still queued) and
    places request 3 in the slot at once. Step N masks request 1's row as GuidedDecoder's
    does (the release takes the matcher after it, in stream order; at once it left step N
    unguided, silently), and request 3's steps mask as a fresh decoder's."""
    first, second = GUIDED[0], GUIDED[2]
    capt, graph, static, text = one_request_after_context(factory, tekken, first, host_node)
    text3 = texts_of(tekken, [second])[0]
    gate = Gate()
    capt.add_batch([GuidedRequest.generation(1, 0, first.params, text[0])])
    enqueue(static.zero_)
    graph.replay()  # step N: request 1's last, queued behind the gate
    seen: list = []
    enqueue(lambda: seen.append(static.clone()))
    capt.release(0)
    capt.add_batch([GuidedRequest.context(3, 0, second.params)])
    enqueue(static.zero_)
    graph.replay()
    capt.add_batch([GuidedRequest.generation(3, 0, second.params, text3[0])])
    enqueue(static.zero_)
    graph.replay()
    enqueue(lambda: seen.append(static.clone()))
    gate.open()
    assert _drain_error() is None and capt.take_failed_requests() == []
    assert torch.isneginf(seen[0]).any()
    assert same(seen[0], _eager_first_step_mask(factory, first, text[0]))
    assert same(seen[1], _eager_first_step_mask(factory, second, text3[0]))
    assert capt.num_active_matchers == 1 and capt.queued_batches == 0
    capt.release(0)  # (an idle stream: at once)
    assert capt.grammar_matchers[0] is None and capt.num_active_matchers == 0
    graph.reset()
    capt.close()
