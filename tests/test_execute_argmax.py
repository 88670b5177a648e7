"""execute_argmax: CapturableGuidedDecoder's on hostfunc's CPU stand-in gives the same tokens as
``execute`` followed by ``argmax``, eagerly and replayed from a HostGraph, on both host nodes;
GuidedDecoder's gives them with the step's failures, on CPU and (where there is one) CUDA; their
argument checks; and ``generate()``'s greedy steps, fused or not, give the same text."""

from __future__ import annotations

import pytest
import torch

import hostfunc
from capgraph import GuidedDecodingParams
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.errors import TensorArgError
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation
from cases import CASES
from conftest import settled_live_entries

SCHEMA = GuidedDecodingParams.json_schema(
    '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')


@pytest.fixture(scope="module")
def factory(factory_cache):
    return factory_cache("tekken")


def _skip_without(host_node: str) -> None:
    from capgraph.build import library
    if host_node == "native" and library.unavailable_reason():
        pytest.skip(f"the native host node does not build here: {library.unavailable_reason()}")


def _requests(step: int, cases, texts, unguided_text):
    """Step 0: context requests (the cases, then an unguided one); later: each request's next
    token along its valid text."""
    if step == 0:
        return [GuidedRequest.context(i, i, c.params) for i, c in enumerate(cases)] + [
            GuidedRequest.context(len(cases), len(cases), None)]
    return [GuidedRequest.generation(i, i, c.params, texts[i][step - 1])
            for i, c in enumerate(cases)] + [
        GuidedRequest.generation(len(cases), len(cases), None, unguided_text[step - 1])]


@pytest.mark.parametrize("host_node", ["python", "native"])
@pytest.mark.parametrize("captured", [False, True])
def test_argmax_equals_execute_then_argmax(factory, tekken, host_node, captured):
    """Step by step along valid texts of three guides and one unguided request, with padding
    rows past the batch: execute_argmax's tokens equal those of a twin decoder's execute and
    argmax (eager, or replayed from a HostGraph captured once), and its logits stay as given."""
    _skip_without(host_node)
    live = settled_live_entries()
    V = factory.config.vocab_size_padded
    cases = [c for c in CASES if c.params.guide_type.name in ("JSON_SCHEMA", "REGEX")][:3]
    texts = [encode_continuation(tekken, c.valid) for c in cases]
    unguided = [5] * 64
    steps = min(len(t) for t in texts)
    rows = len(cases) + 2  # (one unguided request, one padding row)
    fused = CapturableGuidedDecoder(factory.config, rows, 0, factory=factory,
                                    host_node=host_node)
    twin = CapturableGuidedDecoder(factory.config, rows, 0, factory=factory,
                                   host_node=host_node)
    static = torch.zeros(rows, V)
    out = torch.zeros(rows, dtype=torch.int64)
    graph = None
    if captured:
        fused.add_batch([GuidedRequest.placeholder(-1 - i) for i in range(rows)])
        graph = hostfunc.HostGraph()
        with hostfunc.capture(graph):
            assert fused.execute_argmax(static, out) is out
    g = torch.Generator().manual_seed(7)
    for step in range(steps):
        logits = torch.randn(rows, V, generator=g)
        logits[:, :500] += 4.0  # (the unmasked argmax would mostly pick one of these)
        fused.add_batch(_requests(step, cases, texts, unguided))
        twin.add_batch(_requests(step, cases, texts, unguided))
        static.copy_(logits)
        if graph is not None:
            graph.replay()
            hostfunc.drain()
        else:
            assert fused.execute_argmax(static, out) is out
        expect = logits.clone()
        twin.execute(expect)
        assert fused.take_failed_requests() == twin.take_failed_requests() == []
        assert out.tolist() == expect.argmax(-1).tolist(), f"step {step}"
        assert torch.equal(static, logits), "execute_argmax wrote the logits"
        if step:  # (each guided row's pick is the text's next token or another it allows)
            assert all(expect[i, out[i]].item() != float("-inf") for i in range(len(cases)))
    if graph is not None:
        graph.reset()
    fused.close()
    twin.close()
    assert hostfunc.live_entries() == live


def test_argmax_of_an_inactive_step_is_the_plain_argmax(factory, monkeypatch):
    """A step with nothing guided enqueues nothing (no host step, no argmax callback) and
    returns the plain argmax."""
    V = factory.config.vocab_size_padded
    dec = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory)
    dec.add_batch([GuidedRequest.context(0, 0, None), GuidedRequest.context(1, 1, None)])

    def enqueued(*args, **kwargs):
        raise AssertionError("an inactive step enqueued work")
    monkeypatch.setattr(dec, "_enqueue_step", enqueued)
    monkeypatch.setattr(dec, "_join_and_apply", enqueued)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(1))
    assert dec.execute_argmax(logits).tolist() == logits.argmax(-1).tolist()
    assert dec.queued_batches == 0
    dec.close()


def test_argmax_refuses_a_shard_and_a_bad_out_before_any_work(factory):
    """A tensor-parallel shard, an ``out`` of another dtype, length or device, and bad logits
    are TensorArgErrors naming the problem; the queued batch stays for a correct call."""
    V = factory.config.vocab_size_padded
    dec = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory)
    dec.add_batch([GuidedRequest.context(0, 0, SCHEMA)])
    logits = torch.randn(2, V)
    with pytest.raises(TensorArgError, match=r"a tensor-parallel shard .* needs the full "
                                              r"vocabulary: mask a shard with execute"):
        dec.execute_argmax(logits[:, :V // 2])
    with pytest.raises(TensorArgError, match=r"is not the full vocabulary nor a tensor-parallel"):
        dec.execute_argmax(torch.zeros(2, V + 32))
    with pytest.raises(TensorArgError, match=r"out must be an int64 \[2\]"):
        dec.execute_argmax(logits, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TensorArgError, match=r"out must be an int64 \[2\].*\(3,\)"):
        dec.execute_argmax(logits, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(TensorArgError, match=r"out must be an int64 \[2\].*list"):
        dec.execute_argmax(logits, [0, 0])  # type: ignore[arg-type]
    with pytest.raises(TensorArgError):
        dec.execute_argmax(logits.int())
    assert dec.queued_batches == 1 and dec.num_advanced_tokens[0] == 0
    tokens = dec.execute_argmax(logits)
    assert dec.take_failed_requests() == []
    expect = logits.clone()
    twin = CapturableGuidedDecoder(factory.config, 2, 0, factory=factory)
    twin.add_batch([GuidedRequest.context(0, 0, SCHEMA)])
    twin.execute(expect)
    assert tokens.tolist() == expect.argmax(-1).tolist()
    twin.close()
    dec.close()


def _eager_twins(factory, tekken, device: str) -> None:
    """GuidedDecoder.execute_argmax against a twin's execute then argmax, step by step along
    valid texts of three guides and one unguided request (a slot left free), on ``device``;
    at one step one request's token is one its grammar refuses (its failure returned, its
    rows unmasked, its slot restarted by a context request the step after)."""
    V = factory.config.vocab_size_padded
    cases = [c for c in CASES if c.params.guide_type.name in ("JSON_SCHEMA", "REGEX")][:3]
    texts = [encode_continuation(tekken, c.valid) for c in cases]
    unguided = [5] * 64
    steps = min(len(t) for t in texts)
    rows = len(cases) + 1  # (eager logits have the layout's rows exactly)
    fused, twin = (GuidedDecoder(factory.config, rows + 1, 0, factory=factory, device=device)
                   for _ in range(2))
    out = torch.zeros(rows, dtype=torch.int64, device=device)
    g = torch.Generator().manual_seed(11)
    refused_at, failures = 3, 0
    for step in range(steps):
        reqs = _requests(step, cases, texts, unguided)
        if step == refused_at:
            reqs[1] = GuidedRequest.generation(1, 1, cases[1].params, tekken.eos_token_id)
        elif step == refused_at + 1:
            reqs[1] = GuidedRequest.context(1, 1, cases[1].params)
        elif step > refused_at + 1:  # (the restarted request along its text from its start)
            reqs[1] = GuidedRequest.generation(1, 1, cases[1].params,
                                               texts[1][step - refused_at - 2])
        logits = torch.randn(rows, V, generator=g).to(device)
        logits[:, :500] += 4.0  # (the unmasked argmax would mostly pick one of these)
        given = logits.clone()
        fused.add_batch(reqs)
        twin.add_batch(reqs)
        tokens, failed = fused.execute_argmax(logits, out if step % 2 else None)
        assert (tokens is out) == bool(step % 2)
        expect = given.clone()
        assert failed == twin.execute(expect), f"step {step}"
        failures += len(failed)
        assert tokens.tolist() == expect.argmax(-1).tolist(), f"step {step}"
        assert torch.equal(logits, given), "execute_argmax wrote the logits"
        assert fused.num_advanced_tokens == twin.num_advanced_tokens
    assert failures == 1
    fused.close()
    twin.close()


def test_eager_argmax_equals_execute_then_argmax(factory, tekken):
    """GuidedDecoder.execute_argmax on CPU: each step's tokens and failures equal a twin's
    execute then argmax (a refused token included), the logits stay as given."""
    _eager_twins(factory, tekken, "cpu")


def test_eager_argmax_of_a_step_that_masks_nothing_is_the_plain_argmax(factory):
    """A step whose rows are all unguided masks nothing: execute_argmax writes the plain
    argmax, into ``out`` where given."""
    V = factory.config.vocab_size_padded
    dec = GuidedDecoder(factory.config, 2, 0, factory=factory)
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(5))
    for out in (None, torch.full((2,), -1, dtype=torch.int64)):
        dec.add_batch([GuidedRequest.context(0, 0, None), GuidedRequest.context(1, 1, None)])
        tokens, failed = dec.execute_argmax(logits, out)
        assert failed == [] and tokens.tolist() == logits.argmax(-1).tolist()
        assert out is None or tokens is out
    dec.close()


def test_the_guide_driver_returns_an_eager_fused_steps_failures(factory, tekken):
    """GuideDriver.apply_argmax on the eager decoder: a token the grammar refuses fails its
    request, which the driver's take_failed returns, as apply's failures."""
    from types import SimpleNamespace

    from capgraph.runtime.guide import GuideDriver
    V = factory.config.vocab_size_padded
    driver = GuideDriver(GuidedDecoder(factory.config, 2, 0, factory=factory), 0)
    seqs = [SimpleNamespace(index=i, seq_slot=i, guide=SCHEMA, output=[], accepted_prev=0)
            for i in range(2)]
    driver.begin_context(seqs)
    driver.apply_argmax(torch.zeros(2, V))
    assert driver.take_failed() == []
    seqs[0].output.append(tekken.encode("{", add_special_tokens=False)[0])
    seqs[1].output.append(tekken.eos_token_id)  # (refused before the object's end)
    driver.begin_decode(seqs, None)
    tokens = driver.apply_argmax(torch.zeros(2, V))
    (index, message), = driver.take_failed()
    assert index == 1 and "is not allowed" in message and tokens.shape == (2,)
    driver.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="no CUDA device: torch.cuda.is_available() is False")
def test_eager_argmax_equals_execute_then_argmax_on_gpu(factory, tekken):
    """The same on CUDA, where execute_argmax runs the fused masked argmax kernel after the
    bitmask copy."""
    _eager_twins(factory, tekken, "cuda")


def test_eager_argmax_refuses_a_shard_and_a_bad_out_before_any_work(factory):
    """GuidedDecoder.execute_argmax refuses a tensor-parallel shard, a bad ``out`` and bad
    logits with TensorArgErrors naming them, before any matcher moves: the batch is still
    there for a correct call, which builds it once."""
    V = factory.config.vocab_size_padded
    dec = GuidedDecoder(factory.config, 2, 0, factory=factory)
    dec.add_batch([GuidedRequest.context(0, 0, SCHEMA), GuidedRequest.context(1, 1, None)])
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(3))
    with pytest.raises(TensorArgError, match=r"execute_argmax: logits have \d+ columns, a "
                                              r"tensor-parallel shard"):
        dec.execute_argmax(logits[:, :V // 2])
    with pytest.raises(TensorArgError, match=r"execute_argmax: out must be an int64 \[2\]"):
        dec.execute_argmax(logits, torch.zeros(2, dtype=torch.int32))
    with pytest.raises(TensorArgError):
        dec.execute_argmax(logits.int())
    assert dec.num_advanced_tokens[0] == 0 and dec.num_guided_tokens[0] == 0
    tokens, failed = dec.execute_argmax(logits)
    assert failed == [] and dec.num_guided_tokens[0] == 1
    expect = logits.clone()
    twin = GuidedDecoder(factory.config, 2, 0, factory=factory)
    twin.add_batch([GuidedRequest.context(0, 0, SCHEMA), GuidedRequest.context(1, 1, None)])
    twin.execute(expect)
    assert tokens.tolist() == expect.argmax(-1).tolist()
    assert torch.isneginf(expect[0]).any()  # (the schema masked the row)
    twin.close()
    dec.close()


def _generate_fused_then_not(factory, tekken, monkeypatch, cls, unfuse, **kwargs):
    """generate() of three prompts (under a schema, a regex, unguided; greedy) as configured,
    then again after ``unfuse()``: ``(fused results, unfused results, the fused run's calls
    of cls.execute_argmax, the unfused run's)``."""
    from capgraph.runtime.engine import generate

    def run():
        return generate(["a", "bb", "c"], [SCHEMA, GuidedDecodingParams.regex("[0-9]{2,5}"),
                                           None],
                        tokenizer=tekken, factory=factory, max_new_tokens=12,
                        max_batch_size=3, **kwargs)
    calls = []
    original = cls.execute_argmax

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)
    monkeypatch.setattr(cls, "execute_argmax", counted)
    fused = run()
    steps = len(calls)
    unfuse()
    unfused = run()
    assert [(r.tokens, r.finish_reason) for r in fused] == \
        [(r.tokens, r.finish_reason) for r in unfused]
    assert fused[1].finish_reason == "stop" and fused[1].text.isdigit()
    return fused, unfused, steps, len(calls) - steps


@pytest.mark.parametrize("host_node", ["python", "native"])
def test_generate_gives_the_same_text_fused_or_not(factory, tekken, host_node, monkeypatch):
    """generate()'s captured greedy steps (the CPU stand-in's graph path) give the same text
    and finish reasons with the fused masked argmax as with mask-then-argmax."""
    _skip_without(host_node)
    from capgraph.runtime import engine
    _, _, fused_calls, unfused_calls = _generate_fused_then_not(
        factory, tekken, monkeypatch, CapturableGuidedDecoder,
        lambda: monkeypatch.setattr(engine, "_FUSED_ARGMAX", False),
        decoder="capturable", cuda_graph=True, host_node=host_node)
    assert fused_calls > 0 and unfused_calls == 0


@pytest.mark.parametrize("decoder", ["eager", "capturable"])
def test_generate_fuses_greedy_steps_outside_a_graph_where_asked(factory, tekken, decoder,
                                                                 monkeypatch):
    """generate()'s greedy steps outside a CUDA graph (context and decode steps, no graph
    here) take their tokens from execute_argmax on the devices _FUSED_EAGER_DEVICES names
    (CUDA by default; the CPU added here), and give the same text and finish reasons as
    mask-then-argmax."""
    from capgraph.runtime import engine
    monkeypatch.setattr(engine, "_FUSED_EAGER_DEVICES", ("cuda", "cpu"))
    fused, _, fused_calls, unfused_calls = _generate_fused_then_not(
        factory, tekken, monkeypatch,
        GuidedDecoder if decoder == "eager" else CapturableGuidedDecoder,
        lambda: monkeypatch.setattr(engine, "_FUSED_EAGER_DEVICES", ("cuda",)),
        decoder=decoder, cuda_graph=False)
    # (one call a step: at least as many steps as the longest output's tokens)
    assert fused_calls >= max(len(r.tokens) for r in fused) and unfused_calls == 0


def test_generate_never_fuses_a_sampled_step(factory, tekken, monkeypatch):
    """A step that samples (temperature > 0) is not greedy: generate() masks the logits and
    samples from them, never taking execute_argmax's tokens, also where the device is one
    _FUSED_EAGER_DEVICES names."""
    from capgraph.runtime import engine
    from capgraph.runtime.engine import generate
    monkeypatch.setattr(engine, "_FUSED_EAGER_DEVICES", ("cuda", "cpu"))

    def refused(self, *args, **kwargs):
        raise AssertionError("a sampled step took the fused argmax")
    monkeypatch.setattr(GuidedDecoder, "execute_argmax", refused)
    results = generate(["a", "bb"], [SCHEMA, GuidedDecodingParams.regex("[0-9]{2,5}")],
                       tokenizer=tekken, factory=factory, max_new_tokens=12, max_batch_size=2,
                       decoder="eager", cuda_graph=False, temperature=0.8, seed=3)
    assert all(r.finish_reason in ("stop", "length") for r in results)
    assert results[1].finish_reason != "stop" or results[1].text.isdigit()
