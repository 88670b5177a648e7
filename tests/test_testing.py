"""capgraph.testing: the helpers users call in their own graph-capture regression tests."""

from __future__ import annotations

import pytest
import torch

import hostfunc
from capgraph import ConfigError
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.requests import GuidedRequest
from capgraph.testing import compare_eager_and_replay, record_host_callbacks
from capgraph.tokenizers import encode_continuation
from cases import CASES

CASE = CASES[2]  # a regex


class DecoderStep:
    """A capturable decoder masking static logits: the step a user would capture."""

    def __init__(self, factory, tokens, extra_torch_op=False, host_node="auto"):
        self.decoder = CapturableGuidedDecoder(factory.config, 1, 0, factory=factory,
                                               host_node=host_node)
        self.logits = torch.zeros(1, factory.config.vocab_size_padded)
        self.tokens, self.extra = tokens, extra_torch_op

    def prepare(self, step):
        req = (GuidedRequest.context(1, 0, CASE.params) if step == 0 else
               GuidedRequest.generation(1, 0, CASE.params, self.tokens[step - 1]))
        self.decoder.add_batch([req])
        self.logits.copy_(torch.randn(self.logits.shape,
                                      generator=torch.Generator().manual_seed(step)))

    def step(self):
        if self.extra:
            self.logits.mul_(2.0)  # a CPU torch op: runs at capture only, never at replay
        self.decoder.execute(self.logits)

    def outputs(self):
        return [self.logits]


def test_replay_of_a_capturable_step_equals_eager(factory_cache, tekken):
    """The capturable decoder's step captured once into a HostGraph and replayed matches eager
    execution step for step (the helper reports no difference)."""
    factory = factory_cache("tekken")
    tokens = encode_continuation(tekken, CASE.valid)
    report = compare_eager_and_replay(lambda: DecoderStep(factory, tokens), len(tokens))
    report.assert_equal()
    assert report.steps == len(tokens) and report.equal


def test_a_step_that_does_not_replay_is_caught(factory_cache, tekken):
    """A torch op outside host callbacks is not replayed by a HostGraph: the helper names the
    first differing step and output."""
    factory = factory_cache("tekken")
    tokens = encode_continuation(tekken, CASE.valid)
    report = compare_eager_and_replay(lambda: DecoderStep(factory, tokens, True), 3)
    assert not report.equal and report.diffs[0].step == 0 and report.diffs[0].index == 0
    with pytest.raises(AssertionError, match="replayed step 0 differs"):
        report.assert_equal()


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_host_callbacks_are_recorded_in_order(factory_cache, tekken, host_node):
    """record_host_callbacks sees the fused host step eagerly, and the host step then the
    apply at every replay of a captured step; with the native host node, a replay's host
    step is the node, which runs no Python and is not seen (the apply is)."""
    factory = factory_cache("tekken")
    tokens = encode_continuation(tekken, CASE.valid)
    try:
        harness = DecoderStep(factory, tokens, host_node=host_node)
    except ConfigError as e:
        pytest.skip(f"the native host node is not available here: {e}")
    with record_host_callbacks() as names:
        harness.prepare(0)
        harness.step()
        hostfunc.drain()
    assert names == ["host_step"]
    harness.prepare(1)
    graph = hostfunc.HostGraph()
    with record_host_callbacks() as names:
        with hostfunc.capture(graph):
            harness.step()
        for step in (1, 2):
            harness.prepare(step)
            graph.replay()
            hostfunc.drain()
    graph.reset()
    if host_node == "python":
        assert names == ["host_step", "apply", "host_step", "apply"]
    else:
        assert names == ["apply", "apply"]
        assert harness.decoder.host_node_stats.runs == 2


def test_records_plain_hostfunc_launches_and_stops_after_the_block():
    """Callbacks launched with ``hostfunc.launch`` (not only decorated methods) are recorded;
    after the block nothing is wrapped any more."""
    import hostfunc.api

    ran = []

    def probe(x):
        ran.append(x)

    with record_host_callbacks() as names:
        hostfunc.launch(probe, 1)
        hostfunc.drain()
    hostfunc.launch(probe, 2)
    hostfunc.drain()
    assert names == ["probe"] and ran == [1, 2]
    assert hostfunc.api.LAUNCH_WRAPPERS == []
