"""A slot belongs to one request at a time: a request the build refuses on a slot (the same
slot twice in a batch) touches nothing there at rollback, and a new request's matcher starts
with none of the slot's last request's draft state. Each host build (Python, and the C++
ones where they build here)."""

from __future__ import annotations

import pytest
import torch

from capgraph import GuidedDecoder, GuidedDecodingConfig, GuidedDecodingParams, GuideType
from capgraph.build import library as native
from capgraph.errors import TensorArgError
from capgraph.grammar import create_matcher_factory
from capgraph.requests import GuidedRequest

native_reason = native.unavailable_reason()
BUILDS = ["python", *([] if native_reason else ["native-loop", "native"])]
VOCAB = ["a", "b", "c", "d", "x", "1", "2", "</s>"]
A, B, C, D, X, ONE, TWO, EOS = range(8)
V = 32
PAIRS = GuidedDecodingParams(GuideType.REGEX, "(ab|cd)+x")
DIGITS = GuidedDecodingParams(GuideType.REGEX, "[12]+")
TWO_THEN_X = GuidedDecodingParams(GuideType.REGEX, "(1|2)(1|2)x")


@pytest.fixture(scope="module")
def factory():
    made = create_matcher_factory(GuidedDecodingConfig(
        encoded_vocab=VOCAB, stop_token_ids=[EOS], vocab_size_padded=V))
    yield made
    made.close()


def _decoder(factory, build: str, seqs: int, drafts: int) -> GuidedDecoder:
    return GuidedDecoder(factory.config, seqs, drafts, factory=factory, host_build=build)


def _capturable(factory, host_node: str, drafts: int):
    """A CapturableGuidedDecoder of two slots on ``host_node``; the test skips where that host
    node is unavailable here."""
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.errors import ConfigError
    try:
        return CapturableGuidedDecoder(factory.config, 2, drafts, factory=factory,
                                       host_node=host_node)
    except ConfigError as e:
        pytest.skip(f"host_node={host_node!r} is unavailable here: {e}")


def _step(dec: GuidedDecoder, requests: list) -> tuple[list, torch.Tensor]:
    dec.add_batch(requests)
    logits = torch.zeros(dec.requests.num_bitmask_tokens, V)
    return dec.execute(logits), logits


def _draft(request_id: int, slot: int, params, token: int) -> GuidedRequest:
    return GuidedRequest(params, request_id, slot, None, False, False, True, False, token, True,
                         None, None)


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("duplicate_accepted", [0, -1])
def test_a_request_refused_on_a_slot_does_not_roll_back_its_owner(factory, build,
                                                                   duplicate_accepted):
    """Request 1 drafts b c d on slot 0 and all three are accepted; request 99 on the same
    slot is refused by the build ("appears twice"). Its rollback count (0, or a bad -1) must
    not touch slot 0: request 1 keeps its four tokens and its next token x passes (slot 0 was
    rolled back to one token, or its matcher dropped and request 1 left unguided)."""
    dec = _decoder(factory, build, 4, 3)
    _step(dec, [GuidedRequest.context(1, 0, PAIRS)])
    failed, _ = _step(dec, [GuidedRequest.generation(1, 0, PAIRS, A, draft_tokens=[B, C, D]),
                            GuidedRequest.generation(99, 0, PAIRS, A, draft_tokens=[])])
    assert [rid for rid, _ in failed] == [99]
    dec.requests.requests[0].num_accepted_draft_tokens = 3
    dec.requests.requests[1].num_accepted_draft_tokens = duplicate_accepted
    dec.rollback_rejected_tokens()
    assert dec.take_failed_requests() == []
    assert dec.num_advanced_tokens[0] == 4 and dec.grammar_matchers[0] is not None
    failed, logits = _step(dec, [GuidedRequest.generation(1, 0, PAIRS, X)])
    assert failed == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    dec.close()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("aborted_draft", [B, X])
def test_a_new_request_on_a_slot_starts_without_the_last_ones_drafts(factory, build,
                                                                     aborted_draft):
    """Request 1 is aborted inside a drafting loop on slot 0 after drafting ``b`` (accepted:
    one advanced draft left counted) or ``x`` (refused: the slot marked draft-terminated);
    request 3 then takes slot 0 with a context request, no release. Its own drafting loop
    must roll back its own draft only (the stale count rolled back one token more and let
    1 or 2 where only x may come), and its rows must be guided (the stale flag left them
    all allowed)."""
    dec = _decoder(factory, build, 2, 2)
    _step(dec, [GuidedRequest.context(1, 0, PAIRS), GuidedRequest.context(2, 1, DIGITS)])
    _step(dec, [GuidedRequest.generation(1, 0, PAIRS, A),
                GuidedRequest.generation(2, 1, DIGITS, ONE)])
    dec.rollback_rejected_tokens()
    _step(dec, [_draft(1, 0, PAIRS, aborted_draft), _draft(2, 1, DIGITS, TWO)])
    _step(dec, [_draft(2, 1, DIGITS, TWO)])  # (request 1 aborted: not in the loop's last step)
    dec.rollback_draft_tokens()
    _step(dec, [GuidedRequest.context(3, 0, TWO_THEN_X),
                GuidedRequest.generation(2, 1, DIGITS, TWO)])
    failed, logits = _step(dec, [GuidedRequest.generation(3, 0, TWO_THEN_X, ONE),
                                 GuidedRequest.generation(2, 1, DIGITS, TWO)])
    assert failed == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ONE, TWO]
    dec.rollback_rejected_tokens()
    _step(dec, [_draft(3, 0, TWO_THEN_X, TWO), _draft(2, 1, DIGITS, TWO)])
    dec.rollback_draft_tokens()
    failed, logits = _step(dec, [GuidedRequest.generation(3, 0, TWO_THEN_X, TWO),
                                 GuidedRequest.generation(2, 1, DIGITS, TWO)])
    assert failed == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [X]
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("aborted_draft", [B, X])
def test_capturable_new_request_starts_without_the_last_ones_drafts(factory, host_node,
                                                                    aborted_draft):
    """The same on CapturableGuidedDecoder, each host node: a drafting loop of three steps
    left after two (request 1 aborted), then request 3 on slot 0 without release. Its row
    is its own grammar's (after a refused draft the stale flag left every token allowed)."""
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.errors import ConfigError
    try:
        capt = CapturableGuidedDecoder(factory.config, 2, 3, factory=factory,
                                       host_node=host_node)
    except ConfigError as e:
        pytest.skip(f"host_node={host_node!r} is unavailable here: {e}")
    rows = 4  # (the layout's rows: a request and its three drafts)

    def run(requests: list) -> torch.Tensor:
        capt.add_batch(requests)
        logits = torch.zeros(rows, V)
        capt.execute(logits)
        return logits

    run([GuidedRequest.context(1, 0, PAIRS)])
    capt.add_batch([GuidedRequest.generation(1, 0, PAIRS, A, num_accepted_draft_tokens=0)])
    for step, token in enumerate([A, aborted_draft]):
        capt.add_draft_batch(torch.tensor([token]), torch.tensor([1]) if step == 0 else None,
                             step)
        capt.execute_draft_batch(torch.zeros(1, V), draft_step=step)
    assert capt.is_draft_terminated[0] == (aborted_draft == X)
    run([GuidedRequest.context(3, 0, TWO_THEN_X)])
    logits = run([GuidedRequest.generation(3, 0, TWO_THEN_X, ONE)])
    assert capt.take_failed_requests() == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ONE, TWO]
    capt.close()


@pytest.mark.parametrize("kind", ["eager", "capturable"])
@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_a_context_chunk_on_a_held_slot_leaves_its_owners_rollback(factory, build, kind,
                                                                   shape):
    """Request 1 drafts 2 then 1 on slot 0, as a chain or as a tree (1 under 2); before its
    verification is rolled back, a step holds another request's context chunk before its
    last on slot 0 (an engine that reuses a slot too early). The chunk creates no matcher,
    so it must leave slot 0's counts and draft tree. Chain: no draft accepted, bonus 2; the
    rollback keeps one token and the row allows x alone (a zeroed count would roll back
    nothing and fail the bonus). Tree: node 0 accepted (text 1 2), bonus x; the rollback
    feeds that path and only the stop token is left (a forgotten tree kept the root alone,
    and the bonus x failed request 1)."""
    tree = shape == "tree"
    if kind == "capturable":
        from capgraph.capturable import CapturableGuidedDecoder
        dec = CapturableGuidedDecoder(factory.config, 2, 2, factory=factory, host_build=build)
    else:
        dec = _decoder(factory, build, 2, 2)

    def step(requests: list, draft_len: int, accepted: int | None = None) -> torch.Tensor:
        dec.add_batch(requests, runtime_draft_len=draft_len)
        if accepted is not None:
            if kind == "eager":
                dec.rollback_rejected_tokens()
            elif tree:
                dec.rollback_rejected_batch(torch.tensor([accepted + 1]),
                                            torch.tensor([accepted - 1]))
            else:
                dec.rollback_rejected_batch(torch.tensor([accepted + 1], dtype=torch.int32))
        logits = torch.zeros(dec.requests.num_bitmask_tokens, V)
        assert (dec.execute(logits) or []) + dec.take_failed_requests() == []
        return logits

    step([GuidedRequest.context(1, 0, TWO_THEN_X)], 2)
    step([GuidedRequest.generation(1, 0, TWO_THEN_X, ONE, draft_tokens=[TWO, ONE],
                                   draft_parents=[-1, 0] if tree else None)], 2)
    step([GuidedRequest.context(2, 0, DIGITS, last_chunk=False)], 2)
    accepted = 1 if tree else 0
    logits = step([GuidedRequest.generation(1, 0, TWO_THEN_X, X if tree else TWO,
                                            num_accepted_draft_tokens=accepted,
                                            accepted_draft_node=0 if tree else None)], 0,
                  accepted=accepted)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == ([EOS] if tree else [X])
    dec.close()


def _disagg(request_id: int, slot: int, params, token: int) -> GuidedRequest:
    """A first generation step whose prefill ran elsewhere."""
    return GuidedRequest(params, request_id, slot, None, False, False, True, True, token, False,
                         None, None)


AB = GuidedDecodingParams(GuideType.REGEX, "[ab]+")


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("released", [False, True])
@pytest.mark.parametrize("init_called", [False, True])
def test_a_disaggregated_first_step_gets_its_own_matcher(factory, build, released,
                                                        init_called):
    """Request 2 (``[ab]+``, first token ``b`` sampled elsewhere) takes slot 0 after request
    1 (``(ab|cd)+x``, one token in). Whether or not the engine called
    init_disagg_gen_requests, execute masks it with its own new matcher (a, b or the stop
    token), never with request 1's (which allowed c and x, refused b, or after a release left
    the row unguided); a second init call creates nothing more."""
    dec = _decoder(factory, build, 2, 0)
    _step(dec, [GuidedRequest.context(1, 0, PAIRS)])
    _step(dec, [GuidedRequest.generation(1, 0, PAIRS, A)])
    if released:
        dec.release(0)
    dec.add_batch([_disagg(2, 0, AB, B)])
    if init_called:
        dec.init_disagg_gen_requests()
        created = dec.grammar_matchers[0]
        dec.init_disagg_gen_requests()
        assert dec.grammar_matchers[0] is created
    logits = torch.zeros(1, V)
    assert dec.execute(logits) == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [A, B, EOS]
    failed, logits = _step(dec, [GuidedRequest.generation(2, 0, AB, A)])
    assert failed == [] and torch.isfinite(logits[0]).nonzero().flatten().tolist() == [A, B, EOS]
    dec.close()


@pytest.mark.parametrize("build", BUILDS)
def test_a_release_between_add_batch_and_execute_fails_the_released_request(factory, build):
    """Slot 0 is released after add_batch queued its generation request: that request fails
    with a RequestError naming the release (its step has no matcher for it, so serving its
    row would have been unguided without a word); slot 1's request is masked as before."""
    dec = _decoder(factory, build, 2, 0)
    _step(dec, [GuidedRequest.context(1, 0, DIGITS), GuidedRequest.context(2, 1, DIGITS)])
    dec.add_batch([GuidedRequest.generation(1, 0, DIGITS, ONE),
                   GuidedRequest.generation(2, 1, DIGITS, ONE)])
    dec.release(0)
    logits = torch.zeros(2, V)
    failed = dec.execute(logits)
    assert [rid for rid, _ in failed] == [1]
    assert "RequestError" in failed[0][1] and "released" in failed[0][1]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ONE, TWO, EOS]
    dec.close()


@pytest.mark.parametrize("queued", ["generation", "context"])
@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("captured", [False, True])
def test_capturable_release_before_a_queued_step_fails_the_released_request(
        factory, host_node, captured, queued):
    """With no step in flight, slot 0 is released after add_batch queued a request there (its
    next token, or a new request's context) and before its step runs (eagerly, or a replay of
    a captured step: the native node's job already queued, with the new matcher to install):
    that request fails once, with a RequestError naming the release, and its row takes no
    mask; slot 1's request is masked as before."""
    import hostfunc
    capt = _capturable(factory, host_node, 0)
    logits = torch.zeros(2, V)
    contexts = [GuidedRequest.context(1, 0, DIGITS), GuidedRequest.context(2, 1, DIGITS)]
    capt.add_batch(contexts)
    if captured:
        graph = hostfunc.HostGraph()
        with hostfunc.capture(graph):
            capt.execute(logits)
        capt.add_batch(contexts)
        graph.replay()
        hostfunc.drain()
    else:
        capt.execute(logits)
    assert capt.take_failed_requests() == []
    first = (GuidedRequest.generation(1, 0, DIGITS, ONE) if queued == "generation"
             else GuidedRequest.context(3, 0, TWO_THEN_X))
    capt.add_batch([first, GuidedRequest.generation(2, 1, DIGITS, ONE)])
    capt.release(0)
    logits.zero_()
    if captured:
        graph.replay()
        hostfunc.drain()
    else:
        capt.execute(logits)
    failed = capt.take_failed_requests()
    assert [rid for rid, _ in failed] == [first.request_id]
    assert "RequestError" in failed[0][1] and "released" in failed[0][1]
    assert bool(torch.isfinite(logits[0]).all())
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ONE, TWO, EOS]
    assert capt.take_failed_requests() == []
    capt.close()


@pytest.mark.parametrize("kind", ["eager", "capturable"])
def test_a_released_request_whose_batch_never_runs_fails_nothing(factory, kind):
    """The released request's batch is replaced by the next add_batch (eager) or discarded
    (capturable) before any step runs it: nothing is reported failed."""
    from capgraph.capturable import CapturableGuidedDecoder
    dec = (CapturableGuidedDecoder(factory.config, 2, 0, factory=factory) if kind == "capturable"
           else _decoder(factory, "python", 2, 0))
    dec.add_batch([GuidedRequest.context(1, 0, DIGITS)])
    dec.release(0)
    if kind == "capturable":
        assert dec.discard_queued_batches() == 1
    dec.add_batch([GuidedRequest.context(2, 1, DIGITS)])
    logits = torch.zeros(1, V)
    assert (dec.execute(logits) or []) + dec.take_failed_requests() == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ONE, TWO]
    dec.close()


@pytest.mark.parametrize("build", BUILDS)
def test_a_draft_step_of_a_context_chunk_on_a_held_slot_rolls_back_no_target_token(factory,
                                                                                   build):
    """Request 1 takes 1 on slot 0 (no drafts); a draft step then holds another request's
    context chunk before its last on slot 0. Ending that drafting loop must roll back none of
    request 1's target tokens: its next token 2 leaves only x allowed."""
    dec = _decoder(factory, build, 2, 2)

    def step(requests: list) -> tuple[list, torch.Tensor]:
        dec.add_batch(requests, runtime_draft_len=0)
        logits = torch.zeros(dec.requests.num_bitmask_tokens, V)
        return dec.execute(logits) + dec.take_failed_requests(), logits

    assert step([GuidedRequest.context(1, 0, TWO_THEN_X)])[0] == []
    assert step([GuidedRequest.generation(1, 0, TWO_THEN_X, ONE)])[0] == []
    draft_chunk = GuidedRequest(DIGITS, 2, 0, None, True, False, False, False, None, True)
    assert step([draft_chunk])[0] == []
    dec.rollback_draft_tokens()
    failed, logits = step([GuidedRequest.generation(1, 0, TWO_THEN_X, TWO)])
    assert failed == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [X]
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_replayed_context_chunk_on_a_held_slot_leaves_its_owners_rollback(factory, host_node):
    """test_a_context_chunk_on_a_held_slot_leaves_its_owners_rollback with the steps replayed
    from a captured graph, so that the native node runs them: its job's skipped entry leaves
    the held slot's counts too."""
    import hostfunc
    dec = _capturable(factory, host_node, 2)
    logits = torch.zeros(3, V)
    dec.add_batch([GuidedRequest.placeholder(0, 2)], runtime_draft_len=2)
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        dec.execute(logits)

    def step(requests: list, draft_len: int, accepted: int | None = None) -> None:
        dec.add_batch(requests, runtime_draft_len=draft_len)
        if accepted is not None:
            dec.rollback_rejected_batch(torch.tensor([accepted + 1], dtype=torch.int32))
        logits.zero_()
        graph.replay()
        hostfunc.drain()
        assert dec.take_failed_requests() == []

    step([GuidedRequest.context(1, 0, TWO_THEN_X)], 2)
    step([GuidedRequest.generation(1, 0, TWO_THEN_X, ONE, draft_tokens=[TWO, ONE])], 2)
    step([GuidedRequest.context(2, 0, DIGITS, last_chunk=False)], 2)
    assert dec.num_advanced_tokens[0] == 2  # (1 and its first draft; the second refused)
    step([GuidedRequest.generation(1, 0, TWO_THEN_X, TWO, num_accepted_draft_tokens=0)], 0,
         accepted=0)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [X]
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_release_while_a_prepared_step_waits_on_the_side_stream_comes_after_it(factory,
                                                                                 host_node):
    """prepare() enqueued the step's host work on the side stream, which is still busy (its
    host work not run yet) while the current stream is idle; release(0) then is ordered after
    that step: the prepared step masks slot 0's request as queued (it fails nothing), and the
    slot is free for the next request, whose matcher starts fresh."""
    import threading

    import hostfunc
    capt = _capturable(factory, host_node, 0)
    side = capt._streams.stream
    if not isinstance(side, hostfunc.HostStream):
        pytest.skip("the side stream is a CUDA stream here (the test holds a HostStream busy)")
    logits = torch.zeros(2, V)
    capt.add_batch([GuidedRequest.context(1, 0, PAIRS), GuidedRequest.context(2, 1, DIGITS)])
    capt.execute(logits)
    assert capt.take_failed_requests() == []
    gate, blocker = threading.Event(), hostfunc.HostStream("blocker")
    with hostfunc.use_stream(blocker):
        hostfunc.launch(gate.wait, 5.0)
    opened = hostfunc.HostEvent("gate")
    opened.record(blocker)
    side.wait_event(opened)  # (the side stream waits until the gate opens)
    assert not side.query()
    capt.add_batch([GuidedRequest.generation(1, 0, PAIRS, A),
                    GuidedRequest.generation(2, 1, DIGITS, ONE)])
    capt.prepare()
    capt.release(0)
    gate.set()
    logits.zero_()
    capt.execute(logits)
    assert capt.take_failed_requests() == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [B]
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [ONE, TWO, EOS]
    capt.add_batch([GuidedRequest.context(3, 0, DIGITS)])
    logits.zero_()
    capt.execute(logits[:1])
    assert capt.take_failed_requests() == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ONE, TWO]
    capt.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_the_next_add_batch_while_a_prepared_step_waits_leaves_that_steps_tokens(factory,
                                                                                host_node):
    """prepare() enqueued step N's host work on a side stream still busy; the next step's
    add_batch (its new tokens and ticket) comes before step N's execute: step N's host work
    still reads its own tokens (slot 0 takes "a", then "b"), so both steps mask as queued."""
    import threading

    import hostfunc
    capt = _capturable(factory, host_node, 0)
    side = capt._streams.stream
    if not isinstance(side, hostfunc.HostStream):
        pytest.skip("the side stream is a CUDA stream here (the test holds a HostStream busy)")
    logits = torch.zeros(1, V)
    capt.add_batch([GuidedRequest.context(1, 0, PAIRS)])
    capt.execute(logits)
    gate, blocker = threading.Event(), hostfunc.HostStream("blocker")
    with hostfunc.use_stream(blocker):
        hostfunc.launch(gate.wait, 5.0)
    opened = hostfunc.HostEvent("gate")
    opened.record(blocker)
    side.wait_event(opened)
    capt.add_batch([GuidedRequest.generation(1, 0, PAIRS, A)])
    capt.prepare()
    capt.add_batch([GuidedRequest.generation(1, 0, PAIRS, B)])
    gate.set()
    logits.zero_()
    capt.execute(logits)
    assert capt.take_failed_requests() == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [B]
    logits.zero_()
    capt.execute(logits)
    assert capt.take_failed_requests() == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [A, C, X]
    capt.close()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("golden", ["allowed", "refused"])
@pytest.mark.parametrize("ended", ["rollback_draft_tokens", "target build"])
def test_a_drafting_loop_whose_batches_shrink_is_undone_for_every_slot(factory, build, golden,
                                                                       ended):
    """Draft step 0 holds slots 0 and 1, draft step 1 only slot 0 (slot 1's drafter stopped).
    The loop's end (rollback_draft_tokens, or the next target build where it was left open)
    undoes slot 1 too: its golden token is not fed twice ("1" then "1" again would leave only
    x), and a refused golden token does not leave its target rows unguided."""
    dec = _decoder(factory, build, 2, 2)

    def draft(request_id: int, slot: int, params, token: int) -> GuidedRequest:
        return GuidedRequest(params, request_id, slot, is_draft=True,
                             is_generation_in_progress_state=True, new_token=token)

    assert _step(dec, [GuidedRequest.context(1, 0, PAIRS),
                       GuidedRequest.context(2, 1, TWO_THEN_X)])[0] == []
    dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, A),
                   GuidedRequest.generation(2, 1, TWO_THEN_X, ONE)])
    dec.rollback_rejected_tokens()
    _step(dec, [draft(1, 0, PAIRS, A), draft(2, 1, TWO_THEN_X, ONE if golden == "allowed" else A)])
    _step(dec, [draft(1, 0, PAIRS, B)])
    if ended == "rollback_draft_tokens":
        dec.rollback_draft_tokens()
    dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, A, draft_tokens=[B]),
                   GuidedRequest.generation(2, 1, TWO_THEN_X, ONE, draft_tokens=[TWO])], 1)
    logits = torch.zeros(dec.requests.num_bitmask_tokens, V)
    assert dec.execute(logits) + dec.take_failed_requests() == []
    rows = [torch.isfinite(row).nonzero().flatten().tolist() for row in logits]
    assert rows == [[B], [A, C, X], [ONE, TWO], [X]]
    assert dec.num_advanced_draft_tokens[:2] == [0, 0]
    assert list(dec.is_draft_terminated[:2]) == [False, False]
    dec.close()


FOUR = GuidedDecodingParams(GuideType.REGEX, "[12]{4}")


@pytest.mark.parametrize("build", BUILDS)
def test_a_step_after_drafts_left_without_its_rollback_is_rolled_back_first(factory, build):
    """A step verified drafts (new token 1, drafts 1 1; none accepted, bonus 2) and the next
    step's batch (which says none was accepted) is built without rollback_rejected_tokens:
    the build rolls the rejected drafts back first, as that call would, so the text "1 2"
    leaves 1 and 2 allowed (not the stop token, as after "1 1 1 2"). A call made after all
    rolls back nothing more."""
    for call in (False, True):
        dec = _decoder(factory, build, 2, 2)
        assert _step(dec, [GuidedRequest.context(1, 0, FOUR)])[0] == []
        failed, _ = _step(dec, [GuidedRequest.generation(1, 0, FOUR, ONE,
                                                          draft_tokens=[ONE, ONE])])
        assert failed == []
        dec.add_batch([GuidedRequest.generation(1, 0, FOUR, TWO, num_accepted_draft_tokens=0)])
        if call:
            dec.rollback_rejected_tokens()
        logits = torch.zeros(dec.requests.num_bitmask_tokens, V)
        assert dec.execute(logits) + dec.take_failed_requests() == []
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [ONE, TWO]
        dec.close()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("accepted,after", [(0, X), (1, C)])
def test_a_drafting_loop_after_drafts_left_without_their_rollback_rolls_them_back_first(
        factory, build, accepted, after):
    """The eager draft-model order with rollback_rejected_tokens left out: a step verified
    drafts 1 2 after new token 1; the next target batch (new token 2, its count) is added,
    a drafting loop runs, and the target step is built. The loop's first build rolls the
    rejected drafts back by that target batch, as the call would have: the text is "1 2" (x
    next) or "1 1 2" (c next), with no failure (the draft build would otherwise have reset
    the counts the target build reads)."""
    grammar = GuidedDecodingParams(GuideType.REGEX, "12x|112c")
    dec = _decoder(factory, build, 1, 2)
    assert _step(dec, [GuidedRequest.context(1, 0, grammar)])[0] == []
    assert _step(dec, [GuidedRequest.generation(1, 0, grammar, ONE,
                                                draft_tokens=[ONE, TWO])])[0] == []

    def target() -> list:
        return [GuidedRequest.generation(1, 0, grammar, TWO, num_accepted_draft_tokens=accepted)]
    dec.add_batch(target(), 0)
    draft = GuidedRequest(grammar, 1, 0, is_draft=True, is_generation_in_progress_state=True,
                          new_token=TWO)
    assert _step(dec, [draft])[0] == []
    dec.rollback_draft_tokens()
    failed, logits = _step(dec, target())
    assert failed + dec.take_failed_requests() == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [after]
    dec.close()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("accepted,after", [(0, X), (1, C)])
def test_a_target_request_beside_drafts_settles_its_forgotten_rollback(factory, build,
                                                                       accepted, after):
    """As above, with the target request of slot 1 beside slot 0's draft in the draft step
    (a target request beside drafts ends its own slot's loop): its slot is rolled back by
    its own count first, so its new token 2 makes "1 2" (x next) or "1 1 2" (c next)."""
    grammar = GuidedDecodingParams(GuideType.REGEX, "12x|112c")
    dec = _decoder(factory, build, 2, 2)
    assert _step(dec, [GuidedRequest.context(1, 0, grammar),
                       GuidedRequest.context(2, 1, grammar)])[0] == []
    assert _step(dec, [GuidedRequest.generation(r, r - 1, grammar, ONE, draft_tokens=[ONE, TWO])
                       for r in (1, 2)])[0] == []
    dec.add_batch([GuidedRequest.generation(r, r - 1, grammar, TWO,
                                            num_accepted_draft_tokens=accepted)
                   for r in (1, 2)], 0)
    failed, logits = _step(dec, [
        GuidedRequest(grammar, 1, 0, is_draft=True, is_generation_in_progress_state=True,
                      new_token=TWO),
        GuidedRequest.generation(2, 1, grammar, TWO, num_accepted_draft_tokens=accepted)])
    assert failed + dec.take_failed_requests() == []
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [after]
    dec.close()


class _PythonOnly:
    """A matcher wrapper forwarding everything: not xgrammar's matcher, so a slot holding it
    makes the native node's step Python's."""

    def __init__(self, inner):
        self._inner = inner

    def __getattr__(self, name):
        return getattr(self._inner, name)


def _serving(capt, host_node: str, requests: list, rows: int):
    """For ``host_node`` "native": capture one step of ``capt`` (shaped by ``requests``) on
    a HostGraph, after which the native node serves every step, eager calls included; the
    graph (reset by the caller), or None for the Python host step."""
    if host_node != "native":
        return None
    import hostfunc
    capt.add_batch(requests)
    graph = hostfunc.HostGraph()
    with hostfunc.capture(graph):
        capt.execute(torch.zeros(rows, V))
    return graph


def _capturable_after_context(factory, kind: str, drafts: int, request_id: int, slot: int):
    """A capturable decoder of ``kind`` ("capturable": the Python host step;
    "capturable-native": its native node serving) whose ``slot`` has had request
    ``request_id``'s context step on PAIRS: ``(decoder, graph or None)``."""
    host_node = "native" if kind == "capturable-native" else "python"
    dec = _capturable(factory, host_node, drafts)
    context = [GuidedRequest.context(request_id, slot, PAIRS)]
    graph = _serving(dec, host_node, context, 1 + drafts)
    dec.add_batch(context)
    dec.execute(torch.zeros(1, V))
    return dec, graph


def _drafted_then(factory, host_node: str, python_drafts: bool = False):
    """A capturable decoder on ``host_node`` whose slot 0 ("12x|112c") has had its context
    step and a step with new token 1 and drafts 1 2 (runtime draft length 2), verified with
    no rollback_rejected_batch after it: ``(decoder, graph or None, grammar)``.
    ``python_drafts``: the drafts' step is a Python step of the native node (the slot's
    matcher wrapped as one only Python runs, and unwrapped after)."""
    grammar = GuidedDecodingParams(GuideType.REGEX, "12x|112c")
    capt = _capturable(factory, host_node, 2)
    graph = _serving(capt, host_node, [GuidedRequest.context(1, 0, grammar)], 3)
    capt.add_batch([GuidedRequest.context(1, 0, grammar)])
    capt.execute(torch.zeros(1, V))
    if python_drafts:
        capt.grammar_matchers[0] = _PythonOnly(capt.grammar_matchers[0])
    capt.add_batch([GuidedRequest.generation(1, 0, grammar, ONE, draft_tokens=[ONE, TWO])],
                   runtime_draft_len=2)
    capt.execute(torch.zeros(3, V))
    assert capt.take_failed_requests() == []
    if python_drafts:
        capt.grammar_matchers[0] = capt.grammar_matchers[0]._inner
    return capt, graph, grammar


def _settling_step(capt, grammar, accepted) -> list[int]:
    """The step after :func:`_drafted_then`'s, its rollback left out: new token 2, its
    request saying ``accepted`` drafts were accepted; the tokens its row allows (the step
    fails nothing)."""
    capt.add_batch([GuidedRequest.generation(1, 0, grammar, TWO,
                                             num_accepted_draft_tokens=accepted)],
                   runtime_draft_len=0)
    logits = torch.zeros(1, V)
    capt.execute(logits)
    assert capt.take_failed_requests() == []
    return torch.isfinite(logits[0]).nonzero().flatten().tolist()


@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("accepted,after", [(0, X), (1, C)])
def test_capturable_step_after_drafts_without_its_rollback_is_rolled_back_first(
        factory, host_node, accepted, after):
    """The capturable decoder (the Python host step, and the native node): rollback_rejected_
    batch left out after a step that verified drafts 1 2 after new token 1; the next step's
    request says how many were accepted, and its step rolls the rest back first: its new
    token 2 makes "1 2" (x next) or "1 1 2" (c next). The node does it natively."""
    capt, graph, grammar = _drafted_then(factory, host_node)
    assert _settling_step(capt, grammar, accepted) == [after]
    if graph is not None:
        assert capt.host_node_stats.python_runs == 0
        graph.reset()
    capt.close()


def test_a_forgotten_rollback_past_the_advances_fails_alike_on_both_host_nodes(factory):
    """The settling of a rollback left out takes the request's count as the call would: a
    count past the drafts its matcher advanced (3 accepted of 2) fails the request by name,
    with the same report from the native node as from the Python host step, and its row is
    left unmasked."""
    reports = {}
    for host_node in ("python", "native"):
        capt, graph, grammar = _drafted_then(factory, host_node)
        capt.add_batch([GuidedRequest.generation(1, 0, grammar, TWO,
                                                 num_accepted_draft_tokens=3)],
                       runtime_draft_len=0)
        logits = torch.zeros(1, V)
        capt.execute(logits)
        reports[host_node] = capt.take_failed_requests()
        assert bool(torch.isfinite(logits).all()), host_node
        if graph is not None:
            graph.reset()
        capt.close()
    (request_id, message), = reports["native"]
    assert request_id == 1 and "num_accepted_draft_tokens=3" in message \
        and "by 2 draft token(s)" in message, message
    # (the Python step's RequestError adds the request's names, which the report carries)
    assert [i for i, _ in reports["python"]] == [1]
    assert reports["python"][0][1] == message + " [request_id=1, seq_slot=0]"


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_forgotten_rollback_past_a_draft_stop_token_leaves_the_matcher_running(factory,
                                                                              host_node):
    """A step with new token 1 and the draft stop token (the matcher terminates on it), no
    draft accepted and rollback_rejected_batch left out: the next step settles the slot past
    the stop token, and the host sees its matcher running again (not terminated), so the
    step after it, a draft tree the Python build serves, masks both its rows to 1, 2 and the
    stop token instead of skipping the slot as finished and leaving its rows unmasked."""
    capt = _capturable(factory, host_node, 2)
    graph = _serving(capt, host_node, [GuidedRequest.context(1, 0, DIGITS)], 3)
    steps = [([GuidedRequest.context(1, 0, DIGITS)], 0, 1),
             ([GuidedRequest.generation(1, 0, DIGITS, ONE, draft_tokens=[EOS])], 1, 2),
             ([GuidedRequest.generation(1, 0, DIGITS, TWO, num_accepted_draft_tokens=0)], 0, 1)]
    for requests, draft_len, rows in steps:
        capt.add_batch(requests, runtime_draft_len=draft_len)
        capt.execute(torch.zeros(rows, V))
        assert capt.take_failed_requests() == []
    assert not capt.grammar_matchers[0].is_terminated()
    capt.add_batch([GuidedRequest.generation(1, 0, DIGITS, ONE, draft_tokens=[TWO],
                                             draft_parents=[-1])], runtime_draft_len=1)
    capt.rollback_rejected_batch(torch.tensor([1], dtype=torch.int32))
    logits = torch.zeros(2, V)
    capt.execute(logits)
    assert capt.take_failed_requests() == []
    assert [torch.isfinite(row).nonzero().flatten().tolist() for row in logits] \
        == [[ONE, TWO, EOS]] * 2
    if graph is not None:
        graph.reset()
    capt.close()


@pytest.mark.parametrize("accepted,after", [(0, X), (1, C)])
def test_the_node_and_its_python_steps_hand_each_other_a_forgotten_rollback(factory,
                                                                           accepted, after):
    """With the native node serving, the rollback left out is settled across a change of
    host step both ways: drafts a Python step advanced (the slot's matcher one only Python
    runs, unwrapped after) are settled by the node's next step, and drafts the node advanced
    are settled by a Python step (a count as a NumPy integer: the node leaves it to
    Python)."""
    import numpy as np

    for python_first in (True, False):
        capt, graph, grammar = _drafted_then(factory, "native", python_drafts=python_first)
        first = capt.host_node_stats.python_runs
        count = accepted if python_first else np.int64(accepted)
        assert _settling_step(capt, grammar, count) == [after]
        runs = capt.host_node_stats.python_runs
        assert (first, runs) == ((1, 1) if python_first else (0, 1)), (python_first, first, runs)
        graph.reset()
        capt.close()


@pytest.mark.parametrize("kind", [*BUILDS, "capturable", "capturable-native"])
@pytest.mark.parametrize("table", ["one table", "written in place"])
def test_a_draft_row_whose_allowed_tokens_the_draft_vocabulary_misses_is_left_unmasked(
        factory, kind, table):
    """A draft step with a pruned draft vocabulary (d2t: draft ids 0-3 are the target's b, d,
    1 and the stop token): after "a b" the grammar allows a, c and x, none of which the draft
    vocabulary holds. That row is left unmasked (a dead end in draft coordinates), not masked
    whole (a softmax of it is NaN); the row before it, which allows b, is masked as usual.
    The native node's drafting loop does the same natively. "written in place": the first
    step's table maps draft ids 0-3 to b, a, c and x, and is rewritten to the table above
    through ``.numpy()`` before the second step (a write torch does not count), which must
    still see the second table's reach."""
    d2t = torch.tensor([1, 2, 3, 4] if table == "one table" else [1, -1, 0, 1],
                       dtype=torch.int32)

    def tables(k: int) -> torch.Tensor:
        if k == 1 and table == "written in place":
            d2t.numpy()[:] = [1, 2, 3, 4]
        return d2t
    rows = []
    graph = None
    if kind.startswith("capturable"):
        dec, graph = _capturable_after_context(factory, kind, 2, 1, 0)
        dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, A)])
        for k, token in enumerate([A, B]):
            dec.add_draft_batch(torch.tensor([token]), torch.tensor([1]) if k == 0 else None, k)
            logits = torch.zeros(1, 4)
            dec.execute_draft_batch(logits, tables(k), draft_step=k)
            rows.append(logits[0])
        assert dec.take_failed_requests() == []
        if graph is not None:
            stats = dec.host_node_stats
            assert stats.draft_runs == 2 and stats.python_draft_runs == 0
            graph.reset()
    else:
        dec = _decoder(factory, kind, 1, 2)
        assert _step(dec, [GuidedRequest.context(1, 0, PAIRS)])[0] == []
        dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, A)])
        dec.rollback_rejected_tokens()
        for k, token in enumerate((A, B)):
            dec.add_batch([GuidedRequest(PAIRS, 1, 0, is_draft=True,
                                         is_generation_in_progress_state=True,
                                         new_token=token)])
            logits = torch.zeros(1, 4)
            assert dec.execute(logits, tables(k)) == []
            rows.append(logits[0])
    assert torch.isfinite(rows[0]).nonzero().flatten().tolist() == [0]  # (b: draft id 0)
    assert bool(torch.isfinite(rows[1]).all())
    dec.close()


@pytest.mark.parametrize("kind", [*BUILDS, "capturable", "capturable-native"])
def test_any_row_masked_through_a_draft_table_it_cannot_reach_is_left_unmasked(factory,
                                                                               kind):
    """Logits in a pruned draft vocabulary (d2t: b, d, 1 and the stop token) for a batch of
    target requests, not a draft step: the context row of slot 0 (the grammar allows a and
    c, which the table misses) is left unmasked rather than masked whole, and the
    generation row of slot 1 after "a" (b allowed: draft id 0) is masked as usual; the
    native node's step does the same natively."""
    d2t = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    if kind.startswith("capturable"):
        dec, graph = _capturable_after_context(factory, kind, 0, 2, 1)
        dec.add_batch([GuidedRequest.context(1, 0, PAIRS),
                       GuidedRequest.generation(2, 1, PAIRS, A)])
        logits = torch.zeros(2, 4)
        dec.execute(logits, d2t)
        assert dec.take_failed_requests() == []
        if graph is not None:
            assert dec.host_node_stats.python_runs == 0
            graph.reset()
    else:
        dec = _decoder(factory, kind, 2, 0)
        assert _step(dec, [GuidedRequest.context(2, 1, PAIRS)])[0] == []
        dec.add_batch([GuidedRequest.context(1, 0, PAIRS),
                       GuidedRequest.generation(2, 1, PAIRS, A)])
        logits = torch.zeros(2, 4)
        assert dec.execute(logits, d2t) == []
    assert bool(torch.isfinite(logits[0]).all())
    assert torch.isfinite(logits[1]).nonzero().flatten().tolist() == [0]
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("first", ["plain", "table"])
def test_each_captured_step_guards_with_its_own_draft_table(factory, host_node, first):
    """Two graphs of one decoder: a step on full-vocabulary logits (no d2t) and a step on
    logits in a pruned draft vocabulary (d2t: b, d, 1 and the stop token), captured in
    either order. Replayed in turn, each step's host work guards with its own table, not
    the one captured last: the plain step's context row is masked to a and c (the table,
    which reaches neither, would have left it unmasked), and the table step's context row
    is left unmasked (without the guard it would be masked whole)."""
    import hostfunc

    d2t = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    dec = _capturable(factory, host_node, 0)
    steps = [(torch.zeros(1, V), None), (torch.zeros(1, 4), d2t)]
    graphs: list = [None, None]
    for slot in ((0, 1) if first == "plain" else (1, 0)):
        logits, table = steps[slot]
        dec.add_batch([GuidedRequest.context(slot + 1, slot, PAIRS)])
        graph = graphs[slot] = hostfunc.HostGraph()
        with hostfunc.capture(graph):
            dec.execute(logits, table)
    for slot, (graph, (logits, _)) in enumerate(zip(graphs, steps)):
        dec.add_batch([GuidedRequest.context(slot + 1, slot, PAIRS)])
        graph.replay()
        hostfunc.drain()
        assert dec.take_failed_requests() == []
    assert torch.isfinite(steps[0][0][0]).nonzero().flatten().tolist() == [A, C]
    assert bool(torch.isfinite(steps[1][0][0]).all())
    for graph in graphs:
        graph.reset()
    dec.close()


@pytest.mark.parametrize("first", ["plain", "table"])
def test_the_native_nodes_python_steps_guard_with_their_launchs_draft_table(factory, first):
    """As above on the native node, with slot 0's matcher one only Python runs, so that the
    node hands each replayed step to its Python host step: that step guards with the table
    of the launch it runs for, whichever graph was captured last: after "a" the table
    step's row allows b (draft id 0); after "a b" it allows a, c and x, which the table
    cannot reach, and is left unmasked; after "a b c" the plain step's row allows d."""
    import hostfunc

    d2t = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    dec = _capturable(factory, "native", 0)
    steps = {"plain": (torch.zeros(1, V), None), "table": (torch.zeros(1, 4), d2t)}
    graphs = {}
    for name in ((first, "table") if first == "plain" else (first, "plain")):
        logits, table = steps[name]
        dec.add_batch([GuidedRequest.context(1, 0, PAIRS)])
        graphs[name] = hostfunc.HostGraph()
        with hostfunc.capture(graphs[name]):
            dec.execute(logits, table)

    def run(name: str, request) -> list[int]:
        logits = steps[name][0]
        logits.zero_()
        dec.add_batch([request])
        graphs[name].replay()
        hostfunc.drain()
        assert dec.take_failed_requests() == []
        return torch.isfinite(logits[0]).nonzero().flatten().tolist()

    assert run("plain", GuidedRequest.context(1, 0, PAIRS)) == [A, C]
    dec.grammar_matchers[0] = _PythonOnly(dec.grammar_matchers[0])
    runs = dec.host_node_stats.python_runs
    assert run("table", GuidedRequest.generation(1, 0, PAIRS, A)) == [0]  # (b: draft id 0)
    assert run("table", GuidedRequest.generation(1, 0, PAIRS, B)) == [0, 1, 2, 3]
    assert run("plain", GuidedRequest.generation(1, 0, PAIRS, C)) == [D]
    assert dec.host_node_stats.python_runs - runs == 3
    for graph in graphs.values():
        graph.reset()
    dec.close()


def test_a_draft_table_given_anew_each_step_makes_no_new_native_launch(factory):
    """With the native node serving, steps given the same draft table as a new tensor each
    time, or as one tensor rewritten through torch, share one launch of the node (its
    launches live as long as the node: one per step would grow without bound)."""
    dec = _capturable(factory, "native", 0)
    graph = _serving(dec, "native", [GuidedRequest.context(1, 0, DIGITS)], 1)
    dec.add_batch([GuidedRequest.context(1, 0, DIGITS)])
    dec.execute(torch.zeros(1, V))
    table = torch.tensor([5, 5, 5, 5], dtype=torch.int32)  # (draft ids 0-3: 1, 2, </s>, -)
    rewritten = table.clone()
    for step in range(40):
        dec.add_batch([GuidedRequest.generation(1, 0, DIGITS, ONE)])
        rewritten.copy_(table)
        logits = torch.zeros(1, 4)
        dec.execute(logits, table.clone() if step % 2 else rewritten)
        assert dec.take_failed_requests() == []
        assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 1, 2]
    assert len(dec._node._launches) == 2  # (the capture's, and the table's)
    assert dec.host_node_stats.python_runs == 0
    graph.reset()
    dec.close()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_a_step_prepared_for_a_draft_table_guards_its_rows_and_holds_execute_to_it(
        factory, host_node):
    """``prepare(rows, d2t)`` enqueues the step's host work for that table: its context
    row, which the table cannot reach, is left unmasked when ``execute`` is given the same
    table. ``execute`` with another table (or none) than the step was prepared for is a
    TensorArgError before anything is masked, and so is preparing it again for another."""
    d2t = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    dec = _capturable(factory, host_node, 0)
    graph = _serving(dec, host_node, [GuidedRequest.context(1, 0, PAIRS)], 1)
    dec.add_batch([GuidedRequest.context(1, 0, PAIRS)])
    dec.prepare(1, d2t)
    with pytest.raises(TensorArgError, match="prepared"):
        dec.prepare(1, d2t.clone())
    logits = torch.zeros(1, 4)
    with pytest.raises(TensorArgError, match="prepared for another"):
        dec.execute(logits, d2t.clone())
    assert bool((logits == 0).all())
    dec.execute(logits, d2t)
    assert dec.take_failed_requests() == [] and bool(torch.isfinite(logits).all())
    dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, A)])
    dec.prepare(1)
    with pytest.raises(TensorArgError, match="prepared without one"):
        dec.execute(torch.zeros(1, 4), d2t)
    if graph is not None:
        graph.reset()
    dec.close()


@pytest.mark.parametrize("build", BUILDS)
@pytest.mark.parametrize("case", ["more than given", "past a refused draft",
                                  "past the runtime draft length"])
def test_an_accepted_count_no_masked_row_allows_fails_its_request_by_name(factory, build,
                                                                           case):
    """A verification count past what the last step's rows could have let through (more
    drafts than were given, a draft the grammar refused, drafts past the runtime draft
    length) fails the request with a RequestError naming both numbers, at the rollback,
    instead of being clamped (the engine's text then holds tokens no mask checked)."""
    dec = _decoder(factory, build, 1, 3)
    assert _step(dec, [GuidedRequest.context(1, 0, PAIRS)])[0] == []
    drafts, draft_len = {"more than given": ([B], 3), "past a refused draft": ([B, D, C], 3),
                         "past the runtime draft length": ([B, C, D], 1)}[case]
    dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, A, draft_tokens=drafts)], draft_len)
    dec.execute(torch.zeros(dec.requests.num_bitmask_tokens, V))
    assert dec.take_failed_requests() == []
    dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, X, num_accepted_draft_tokens=3)], 0)
    dec.rollback_rejected_tokens()
    (rid, message), = dec.take_failed_requests()
    assert rid == 1 and "RequestError: num_accepted_draft_tokens=3, but the last step " \
        "advanced its matcher by 1 draft token(s)" in message
    dec.close()


@pytest.mark.parametrize("build", BUILDS)
def test_an_accepted_count_past_a_draft_stop_token_is_clamped(factory, build):
    """Verification may accept past a draft stop token, where the matcher stopped advancing:
    that count is clamped, and nothing fails."""
    dec = _decoder(factory, build, 1, 3)
    assert _step(dec, [GuidedRequest.context(1, 0, DIGITS)])[0] == []
    dec.add_batch([GuidedRequest.generation(1, 0, DIGITS, ONE, draft_tokens=[EOS, ONE, ONE])], 3)
    dec.execute(torch.zeros(dec.requests.num_bitmask_tokens, V))
    dec.add_batch([GuidedRequest.generation(1, 0, DIGITS, ONE, num_accepted_draft_tokens=3)], 0)
    dec.rollback_rejected_tokens()
    assert dec.take_failed_requests() == []
    dec.close()


@pytest.mark.parametrize("build", BUILDS)
def test_a_tree_path_through_a_refused_node_fails_by_name(factory, build):
    """An accepted tree node whose path holds a token the grammar refused (its parent's row
    masked it) fails the request at the rollback, naming the node and the token, instead of
    a clamped path whose next token is then blamed."""
    dec = _decoder(factory, build, 1, 2)
    assert _step(dec, [GuidedRequest.context(1, 0, PAIRS)])[0] == []
    dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, A, draft_tokens=[D, C],
                                            draft_parents=[-1, 0])], 2)
    dec.execute(torch.zeros(dec.requests.num_bitmask_tokens, V))
    dec.add_batch([GuidedRequest.generation(1, 0, PAIRS, X, num_accepted_draft_tokens=2,
                                            accepted_draft_node=1)], 0)
    dec.rollback_rejected_tokens()
    (rid, message), = dec.take_failed_requests()
    assert rid == 1 and f"accepted_draft_node=1: the token {D} at depth 1" in message
    dec.close()


def test_capturable_counts_without_nodes_after_a_tree_keep_the_root(factory):
    """rollback_rejected_batch(counts) after a tree step, without accepted_draft_nodes: a
    count of one (the bonus alone) keeps the root, not the node the request object names for
    the previous verification (the eager convention); the text is then "a b c x", where only
    the stop token is left (the stale node fed "d" too)."""
    grammar = GuidedDecodingParams(GuideType.REGEX, "(ab|cd){2}xx|abcx")
    capt = _capturable(factory, "python", 4)
    capt.add_batch([GuidedRequest.context(1, 0, grammar)])
    capt.execute(torch.zeros(1, V))
    capt.add_batch([GuidedRequest.generation(1, 0, grammar, A, draft_tokens=[B],
                                             draft_parents=[-1])], runtime_draft_len=1)
    capt.execute(torch.zeros(2, V))
    capt.rollback_rejected_batch(torch.tensor([2]), torch.tensor([0]))  # (a b kept)
    capt.add_batch([GuidedRequest.generation(1, 0, grammar, C, draft_tokens=[D],
                                             draft_parents=[-1], accepted_draft_node=0,
                                             num_accepted_draft_tokens=1)],
                   runtime_draft_len=1)
    capt.execute(torch.zeros(2, V))
    capt.rollback_rejected_batch(torch.tensor([1]))  # (the bonus alone: "a b c" kept)
    assert capt.take_failed_requests() == []
    capt.add_batch([GuidedRequest.generation(1, 0, grammar, X)], runtime_draft_len=0)
    logits = torch.zeros(1, V)
    capt.execute(logits)
    assert capt.take_failed_requests() == []
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [EOS]
    capt.close()
