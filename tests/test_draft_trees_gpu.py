"""Draft trees on CUDA: the capturable decoder's step captured once in a torch.cuda.CUDAGraph
and replayed over a whole decode, against the eager GuidedDecoder on CPU (skipped without a
CUDA device; run by tools/gpu_check.sh).

The sequences, their random trees and the brute force come from ``test_draft_trees``; here
everything the graph and the rollback read lives in static device tensors: the logits, the
token tensor (golden token and tree drafts per slot), the accepted counts and the accepted
nodes that ``rollback_rejected_batch`` reads.
"""

from __future__ import annotations

import random

import pytest
import torch

import hostfunc

from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest
from test_draft_trees import K, Sequence, brute_force_rows, make_sequences

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")]


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


def split_tokens(reqs: list[GuidedRequest], num_slots: int
                 ) -> tuple[list[GuidedRequest], torch.Tensor]:
    """The capturable decoder's view of a step: copies of ``reqs`` without their tokens and
    accepted nodes, and the token tensor ``[1 + K, num_slots]`` (per slot: the golden token,
    then the tree's drafts) that replaces those tokens."""
    tokens = torch.zeros(K + 1, num_slots, dtype=torch.int32)
    stripped = []
    for r in reqs:
        c = GuidedRequest.snapshot(r)
        if not c.is_context_init_state:
            slot, token = r.seq_slot, r.new_token
            assert slot is not None and token is not None, r  # (a generation request)
            tokens[0, slot] = token
            drafts = list(r.draft_tokens or [])
            tokens[1:1 + len(drafts), slot] = torch.tensor(drafts, dtype=torch.int32)
            c.new_token, c.draft_tokens = None, None
        c.accepted_draft_node = None  # (comes from rollback_rejected_batch's tensor)
        stripped.append(c)
    return stripped, tokens


def capture_step(capt: CapturableGuidedDecoder, logits: torch.Tensor) -> torch.cuda.CUDAGraph:
    """Warm up on a side stream (kernel load, allocator), then capture ``execute`` once. The
    batch queued before it only gives the capture its shapes: the caller queues it again."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), capt.warmup():  # a warm-up run fetches and advances nothing
        for _ in range(2):
            capt.execute(logits)
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        capt.execute(logits)
    return graph


def check_brute_force(factory, capt: CapturableGuidedDecoder, live: list[Sequence],
                      reqs: list[GuidedRequest], rl: int, step: int) -> None:
    """Each row the replayed callbacks built (host twin) is a fresh matcher's mask after the
    accepted prefix and the node's path; rows the brute force leaves unguided are unmasked."""
    batch = capt.requests
    assert batch is not None
    for s, r, offset in zip(live, reqs, batch.offsets):
        if r.is_context_init_state:
            expect = brute_force_rows(factory, s.case.params, [], [], [], 0)
        else:
            parents = s.parents if s.parents is not None else \
                [-1] + list(range(len(s.drafts) - 1))
            expect = brute_force_rows(factory, s.case.params, s.tokens[:s.p + 1], s.drafts,
                                      parents, rl)
        for k, e in enumerate(expect[:r.num_rows(rl)]):
            where = f"{s.case.name} step {step} node {k - 1}"
            if e is None:
                assert not capt.token_mask_host[offset + k], where
            else:
                assert capt.token_mask_host[offset + k], where
                assert torch.equal(capt.bitmask_host[offset + k], e), where


def run_graphed(factory, seed: int, names: list[str]) -> tuple[int, int]:
    """Decode ``names`` with random trees: the eager CPU decoder and the capturable CUDA
    decoder (one captured step replayed each step, rollback from device tensors) must mask
    every logit alike and every row must equal the brute force. Returns (steps, steps in
    which a tree's accepted node below the root was rolled back to)."""
    rng = random.Random(seed)
    seqs = make_sequences(factory, names)
    V = factory.config.vocab_size_padded
    S = len(seqs)
    eager = GuidedDecoder(factory.config, S, K, factory=factory)
    capt = CapturableGuidedDecoder(factory.config, S, K, device="cuda", factory=factory)
    # everything the graph and the rollback read: static device tensors
    logits_dev = torch.zeros(S * (K + 1), V, device="cuda")  # [max rows, V]
    tokens_dev = torch.zeros(K + 1, S, dtype=torch.int32, device="cuda")  # [1 + K, slots]
    accepted_dev = torch.ones(S, dtype=torch.int32, device="cuda")  # [batch]
    nodes_dev = torch.full((S,), -1, dtype=torch.int32, device="cuda")  # [batch]
    graph = None
    step = tree_rollbacks = 0
    try:
        while not all(s.done for s in seqs):
            live = [s for s in seqs if not s.done]
            rl = K if rng.random() < 0.7 else rng.randint(1, K)
            reqs = [s.request(rng, rl) for s in live]
            n = sum(r.num_rows(rl) for r in reqs)
            logits = torch.randn(n, V, generator=torch.Generator().manual_seed(seed + step))

            eager.add_batch(reqs, runtime_draft_len=rl)
            eager.rollback_rejected_tokens()
            expect = logits.clone()
            assert eager.execute(expect) == [], f"step {step}"

            stripped, tokens = split_tokens(reqs, S)
            tokens_dev.copy_(tokens)
            capt.add_batch(stripped, tokens_dev, runtime_draft_len=rl)
            if graph is None:
                graph = capture_step(capt, logits_dev)
                capt.add_batch(stripped, tokens_dev, runtime_draft_len=rl)
            if step:
                b = len(reqs)
                accepted_dev[:b].copy_(torch.tensor(
                    [(r.num_accepted_draft_tokens or 0) + 1 for r in reqs], dtype=torch.int32))
                nodes = [-1 if r.accepted_draft_node is None else r.accepted_draft_node
                         for r in reqs]
                nodes_dev[:b].copy_(torch.tensor(nodes, dtype=torch.int32))
                capt.rollback_rejected_batch(accepted_dev[:b], nodes_dev[:b])
                tree_rollbacks += any(j >= 0 for j in nodes)
            logits_dev.zero_()
            logits_dev[:n].copy_(logits)
            graph.replay()
            torch.cuda.synchronize()
            hostfunc.drain()  # re-raises a callback's exception, if any
            assert capt.take_failed_requests() == [], f"step {step}"

            assert capt.requests is not None and eager.requests is not None
            assert capt.requests.offsets == eager.requests.offsets, f"step {step}"
            mask = eager.token_mask_host[:n]
            assert torch.equal(capt.token_mask_host[:n], mask), f"token mask, step {step}"
            assert torch.equal(capt.token_mask[:n].cpu(), mask), f"device token mask, step {step}"
            rows = mask.bool()
            assert torch.equal(capt.bitmask_host[:n][rows], eager.bitmask_host[:n][rows]), \
                f"bitmask, step {step}"
            assert torch.equal(logits_dev[:n].cpu(), expect), f"masked logits, step {step}"
            check_brute_force(factory, capt, live, reqs, rl, step)
            for s in live:
                s.verify(rng, rl)
            step += 1
        for s in seqs:
            for dec in (eager, capt):
                matcher = dec.grammar_matchers[s.slot]
                assert matcher is not None and matcher.is_terminated(), s.case.name
    finally:
        if graph is not None:
            graph.reset()
        capt.close()
    return step, tree_rollbacks


@pytest.mark.parametrize("seed,names", [
    (6, ["json_schema_order", "regex_phone"]),
    (7, ["json_schema_tool", "ebnf_csv"]),
], ids=["order+phone", "tool+csv"])
def test_cuda_graph_replayed_tree_steps_equal_eager_and_brute_force(factory, seed, names):
    """The capturable decoder's step, captured once in a CUDA graph and replayed for every
    step of a decode with random draft trees (and some chains): tree tokens come from a
    device token tensor, accepted counts and nodes from device tensors through
    rollback_rejected_batch; every step's token mask (host and device), bitmask rows and
    masked logits equal the eager CPU GuidedDecoder's, every row equals a fresh matcher's
    mask over the node's path, and both decoders end with every matcher terminated."""
    steps, tree_rollbacks = run_graphed(factory, seed, names)
    assert steps >= 3 and tree_rollbacks >= 1, (steps, tree_rollbacks)
