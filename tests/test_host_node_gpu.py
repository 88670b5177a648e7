"""The native host node inside a real torch.cuda.CUDAGraph (skipped without a CUDA device; run
by tools/gpu_check.sh): replayed decoding equals the eager decoder and the Python host
callback, and the replayed step's host node (with the rollback of rejected drafts, in a
speculative step, and a drafting loop's steps) completes while another Python thread holds the
GIL."""

from __future__ import annotations

import functools
import json
import time

import pytest
import torch

import hostfunc
from gil import hold_gil

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"),
    # (a skip naming why, not four failures, where the image cannot build the native node)
    pytest.mark.usefixtures("native_ok")]


def _tool_schema() -> str:
    from cases import TOOL_CALL_SCHEMA
    return json.dumps(TOOL_CALL_SCHEMA)


def test_native_node_replays_decode_what_eager_and_python_decode(factory_cache):
    """Up to 64 replayed steps of (forward, execute, greedy sample) through the native host
    node decode exactly what the eager GuidedDecoder and the Python host callback decode, and
    every replayed step ran in the node without Python."""
    from test_capturable_gpu import _decode

    from capgraph import GuidedDecodingParams, GuideType
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    factory = factory_cache("tekken")
    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, _tool_schema())
    made: list = []

    def native(*args, **kwargs):
        d = CapturableGuidedDecoder(*args, host_node="native", **kwargs)
        made.append(d)
        return d

    eager = _decode(GuidedDecoder, factory, params, 4, 64, graph=False)
    python = _decode(functools.partial(CapturableGuidedDecoder, host_node="python"), factory,
                     params, 4, 64, graph=True)
    replayed = _decode(native, factory, params, 4, 64, graph=True)
    assert eager == python == replayed
    stats = made[0].host_node_stats
    assert stats.runs > 0 and stats.python_runs == 0, stats


def test_native_node_completes_while_another_thread_holds_the_gil(factory_cache):
    """The issue's GIL test on CUDA: a graph of [a ~300 ms GPU sleep (the forward's stand-in),
    the guided step] is replayed, then another thread holds the GIL for 2 s (libc sleep through
    PyDLL); the host node's timestamps (written by the node) lie inside that window, and the
    step masked its rows. The Python host callback, in the same graph, runs after the window
    (the test can fail)."""
    from capgraph import GuidedDecodingParams, GuideType
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.requests import GuidedRequest
    factory = factory_cache("tekken")
    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, _tool_schema())
    V = factory.config.vocab_size_padded
    cycles = _cycles_for_ms(300)
    for host_node in ("native", "python"):
        dec = CapturableGuidedDecoder(factory.config, 2, 0, device="cuda", factory=factory,
                                      host_node=host_node)
        logits = torch.zeros(2, V, device="cuda")
        ctx = [GuidedRequest.context(i, i, params) for i in range(2)]
        dec.add_batch(ctx)
        stamps: list[int] = []
        graph = _graph_after_sleep(dec, cycles, lambda: dec.execute(logits),
                                   stamps if host_node == "python" else None)
        dec.add_batch(ctx)
        graph.replay()
        torch.cuda.synchronize()
        assert dec.take_failed_requests() == []
        open_brace = factory.config.tokenizer.encode("{", add_special_tokens=False)[0]
        dec.add_batch([GuidedRequest.generation(i, i, params, open_brace, prev_seq_slot=i)
                       for i in range(2)])
        graph.replay()
        start, end = hold_gil(2)
        torch.cuda.synchronize()
        hostfunc.drain()
        assert dec.take_failed_requests() == []
        assert dec.num_advanced_tokens[:2] == [1, 1]
        assert int(dec.token_mask_host[:2].sum()) == 2
        if host_node == "native":
            s = dec.host_node_stats
            assert start < s.last_start_ns <= s.last_end_ns < end, (start, s, end)
        else:
            assert stamps and stamps[-1] > end, (stamps, end)
        graph.reset()
        dec.close()


def test_speculative_step_and_its_rollback_complete_while_another_thread_holds_the_gil(
        factory_cache, tekken):
    """The GIL test for a speculative step as an engine captures it on CUDA: a graph of [a
    ~300 ms GPU sleep, rollback_rejected_batch (its counts copied from a static device
    tensor at each replay), the guided step with two drafts] decodes as the eager decoder
    with rollback_rejected_tokens, step for step; on the node, the rollback and the step run
    natively and the step's timestamps lie inside the 2 s another thread holds the GIL; on
    the Python host callback the step ends after that window (the test can fail)."""
    from test_host_node import GUIDED, Speculation, speculative_step

    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    factory = factory_cache("tekken")
    V = factory.config.vocab_size_padded
    cycles = _cycles_for_ms(300)
    for host_node in ("native", "python"):
        spec = Speculation(tekken, GUIDED[:2])
        eager = GuidedDecoder(factory.config, 2, 2, factory=factory)
        dec = CapturableGuidedDecoder(factory.config, 2, 2, device="cuda", factory=factory,
                                      host_node=host_node)
        logits = torch.zeros(6, V, device="cuda")
        counts = torch.ones(2, dtype=torch.int32, device="cuda")
        dec.add_batch(spec.context())

        def step():
            dec.rollback_rejected_batch(counts)
            dec.execute(logits)

        stamps: list[int] = []
        graph = _graph_after_sleep(dec, cycles, step,
                                   stamps if host_node == "python" else None)
        window = None
        steps = [spec.context(), spec.step(None), spec.step([0, 1]), spec.step([2, 0])]
        for k, reqs in enumerate(steps):
            window = speculative_step(eager, dec, graph, logits, reqs, k, counts,
                                      k == 3)[1] or window
        start, end = window
        if host_node == "native":
            s = dec.host_node_stats
            assert start < s.last_start_ns <= s.last_end_ns < end, (start, s, end)
            assert s.python_runs == 0
            assert (s.rollback_runs, s.python_rollback_runs) == (4, 1), s  # (the first: no
            # step of the node before it)
        else:
            assert stamps and stamps[-1] > end, (stamps, end)
        graph.reset()
        dec.close()


def test_drafting_loop_in_a_cuda_graph_runs_in_the_node(factory_cache, tekken):
    """A drafting loop captured in a CUDA graph as an engine drafts with a model: [a ~300 ms
    GPU sleep, then per draft step add_draft_batch (its tokens and counts copied from static
    device tensors at each replay) and execute_draft_batch]; three loops, each followed by the
    verifying target step, mask every draft row and target row as the eager decoder driven
    through the same loops (drafts off the grammar and stop tokens included); on the node
    every draft step after the first loop runs natively and, in the last loop, inside the 2 s
    another thread holds the GIL; on the Python host callback the loop ends after that
    window."""
    import random

    from test_capturable import assert_same_matcher_states
    from test_host_node import GUIDED, texts_of, verify

    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    from capgraph.requests import GuidedRequest
    factory = factory_cache("tekken")
    V = factory.config.vocab_size_padded
    eos = factory.config.stop_token_ids[0]
    cases = GUIDED[:2]
    texts = texts_of(tekken, cases)
    S, K = 2, 2
    cycles = _cycles_for_ms(300)
    for host_node in ("native", "python"):
        rng = random.Random(4)
        eager = GuidedDecoder(factory.config, S, K, factory=factory)
        dec = CapturableGuidedDecoder(factory.config, S, K, device="cuda", factory=factory,
                                      host_node=host_node)
        ctx = [GuidedRequest.context(i + 1, i, c.params) for i, c in enumerate(cases)]
        for d, logits in ((eager, torch.zeros(S, V)),
                          (dec, torch.zeros(S, V, device="cuda"))):
            d.add_batch(ctx)
            d.execute(logits)
        torch.cuda.synchronize()
        assert dec.take_failed_requests() == []
        tokens = torch.zeros(K, S, dtype=torch.int32, device="cuda")
        counts = torch.ones(S, dtype=torch.int32, device="cuda")
        draft_logits = torch.zeros(K, S, V, device="cuda")

        def loop():
            for k in range(K):
                dec.add_draft_batch(tokens[k], counts if k == 0 else None, k)
                dec.execute_draft_batch(draft_logits[k], draft_step=k)

        pos, accepted = [0] * S, [0] * S
        golden = [texts[i][0] for i in range(S)]
        dec.add_batch([GuidedRequest.generation(i + 1, i, c.params, golden[i])
                       for i, c in enumerate(cases)])
        stamps: list[int] = []
        graph = _graph_after_sleep(dec, cycles, loop, stamps if host_node == "python" else None)
        window = in_window = None
        for it in range(3):
            golden = [texts[i][pos[i]] for i in range(S)]
            targets = [GuidedRequest.generation(i + 1, i, c.params, golden[i],
                                                num_accepted_draft_tokens=accepted[i])
                       for i, c in enumerate(cases)]
            proposals = [[golden[i]] + [texts[i][pos[i] + 1 + j] if rng.random() < 0.7 else
                                        eos if rng.random() < 0.3 else rng.randrange(1000, 9000)
                                        for j in range(K)] for i in range(S)]
            eager.add_batch(targets)
            eager.rollback_rejected_tokens()
            expected = []
            for k in range(K):
                eager.add_batch([GuidedRequest(c.params, i + 1, i, is_draft=True,
                                               is_generation_in_progress_state=True,
                                               new_token=proposals[i][k])
                                 for i, c in enumerate(cases)])
                values = torch.randn(S, V, generator=torch.Generator().manual_seed(10 * it + k))
                draft_logits[k].copy_(values)
                assert eager.execute(values) == []
                expected.append(values)
            eager.rollback_draft_tokens()
            dec.add_batch(targets)
            tokens.copy_(torch.tensor([[p[k] for p in proposals] for k in range(K)],
                                      dtype=torch.int32))
            counts.copy_(torch.tensor([1 + a for a in accepted], dtype=torch.int32))
            graph.replay()
            if it == 2:
                window = hold_gil(2)
            torch.cuda.synchronize()
            hostfunc.drain()
            if it == 2:  # (before the eager target step below, which the node runs too)
                in_window = dec.host_node_stats
            assert dec.take_failed_requests() == [], f"loop {it}"
            for k in range(K):
                assert torch.equal(draft_logits[k].cpu().view(torch.int32),
                                   expected[k].view(torch.int32)), f"loop {it} step {k}"
            targets = [GuidedRequest.generation(i + 1, i, c.params, golden[i],
                                                draft_tokens=proposals[i][1:])
                       for i, c in enumerate(cases)]
            eager.add_batch(targets)
            dec.add_batch(targets)
            n = eager.requests.num_bitmask_tokens
            values = torch.randn(n, V, generator=torch.Generator().manual_seed(it))
            target = values.cuda()
            assert eager.execute(values) == []
            dec.execute(target)
            torch.cuda.synchronize()
            assert dec.take_failed_requests() == []
            assert torch.equal(target.cpu().view(torch.int32), values.view(torch.int32)), \
                f"target of loop {it}"
            assert_same_matcher_states(eager, dec)
            verify(proposals, texts, pos, accepted, rng)
        start, end = window
        if host_node == "native":
            s = dec.host_node_stats
            # (the first loop follows no step of the node: Python's; then the node's)
            assert s.draft_runs == 3 * K and s.python_draft_runs == K, s
            assert in_window is not None
            assert start < in_window.last_start_ns <= in_window.last_end_ns < end, \
                (start, in_window, end)
        else:
            assert stamps and stamps[-1] > end, (stamps, end)
        graph.reset()
        dec.close()


def _graph_after_sleep(dec, cycles: int, body, stamps: list | None):
    """``body`` (the decoder's calls) run once under ``dec.warmup()``, then captured into a
    CUDA graph after a GPU sleep of ``cycles``, followed (``stamps`` given) by a Python host
    callback appending the monotonic time to ``stamps``."""
    with dec.warmup():
        body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda._sleep(cycles)
        body()
        if stamps is not None:  # a Python callback right after the decoder's
            hostfunc.launch(lambda: stamps.append(time.monotonic_ns()))
    return graph


def _cycles_for_ms(ms: float) -> int:
    """GPU clock cycles that torch.cuda._sleep spins for about ``ms`` milliseconds."""
    start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10_000_000)
    stop.record()
    stop.synchronize()
    per_ms = 10_000_000 / max(start.elapsed_time(stop), 1e-3)
    return int(per_ms * ms)
