"""CapturableGuidedDecoder inside a real torch.cuda.CUDAGraph (skipped without a CUDA device;
run by tools/gpu_check.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False")]

HIDDEN = 64


def _tool_schema():
    from cases import TOOL_CALL_SCHEMA
    return json.dumps(TOOL_CALL_SCHEMA)


class ToyModel:
    """A model-like step on static buffers: embed the last token, matmul to logits."""

    def __init__(self, V: int, batch: int, seed: int = 0):
        g = torch.Generator(device="cuda").manual_seed(seed)
        self.embed = torch.randn(V, HIDDEN, device="cuda", generator=g)
        self.head = torch.randn(V, HIDDEN, device="cuda", generator=g)
        self.tokens = torch.zeros(batch, dtype=torch.long, device="cuda")
        self.logits = torch.zeros(batch, V, device="cuda")

    def forward(self) -> None:
        torch.matmul(self.embed[self.tokens], self.head.T, out=self.logits)


def capture_after_warmup(dec, step_fn) -> torch.cuda.CUDAGraph:
    """Two warm-up runs of ``step_fn`` on a side stream (inside ``dec.warmup()``: they mask
    and advance nothing), then its capture into a new graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), dec.warmup():
        for _ in range(2):
            step_fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step_fn()
    return graph


def _decode(decoder_cls, factory, params, batch, steps, graph: bool, fused: bool = False):
    from capgraph.requests import GuidedRequest
    V = factory.config.vocab_size_padded
    model = ToyModel(V, batch)
    dec = decoder_cls(factory.config, batch, 0, device="cuda", factory=factory)
    out = [[] for _ in range(batch)]

    def requests(step):
        if step == 0:
            return [GuidedRequest.context(i, i, params) for i in range(batch)]
        return [GuidedRequest.generation(i, i, params, out[i][-1], prev_seq_slot=i)
                for i in range(batch)]

    def step_fn():
        model.forward()
        if fused:  # (the greedy tokens straight from the masked argmax)
            dec.execute_argmax(model.logits, model.tokens)
            return
        dec.execute(model.logits)
        model.tokens.copy_(model.logits.argmax(-1))

    cuda_graph = None
    for step in range(steps):
        dec.add_batch(requests(step))
        if graph and cuda_graph is None:
            tokens = model.tokens.clone()  # the warm-up steps sample; the replay starts here
            # (no record_tokens_ready() in step_fn: execute records it)
            cuda_graph = capture_after_warmup(dec, step_fn)
            model.tokens.copy_(tokens)
            dec.add_batch(requests(step))  # the capture consumed the shape-giving batch
        if graph:
            cuda_graph.replay()
        else:
            step_fn()
        torch.cuda.synchronize()
        failed = dec.take_failed_requests()
        assert failed == [], failed
        for i, t in enumerate(model.tokens.tolist()):
            out[i].append(t)
        if all(dec.grammar_matchers[i] is not None and dec.grammar_matchers[i].is_terminated()
               for i in range(batch)):
            break
    if cuda_graph is not None:
        cuda_graph.reset()
    dec.close()
    return out


def test_graph_replayed_guided_decoding_equals_eager(factory_cache):
    """A captured step (forward, execute, greedy sample) replayed for up to 64 steps decodes
    exactly what the eager GuidedDecoder loop decodes, and the texts satisfy the schema."""
    import jsonschema

    from capgraph import GuidedDecodingParams, GuideType
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    factory = factory_cache("tekken")
    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, _tool_schema())
    eager = _decode(GuidedDecoder, factory, params, 4, 64, graph=False)
    replayed = _decode(CapturableGuidedDecoder, factory, params, 4, 64, graph=True)
    assert eager == replayed
    tok = factory.config.tokenizer
    eos = factory.config.stop_token_ids[0]
    for tokens in replayed:
        if eos in tokens:
            text = tok.decode(tokens[:tokens.index(eos)])
            jsonschema.validate(json.loads(text), json.loads(_tool_schema()))


def test_graph_replayed_fused_argmax_equals_eager(factory_cache):
    """A captured step whose greedy tokens come from execute_argmax (the masked argmax kernel,
    logits left unmasked), replayed for up to 64 steps, decodes exactly what the eager
    GuidedDecoder loop (mask in place, then argmax) decodes."""
    from capgraph import GuidedDecodingParams, GuideType
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    factory = factory_cache("tekken")
    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, _tool_schema())
    eager = _decode(GuidedDecoder, factory, params, 4, 64, graph=False)
    replayed = _decode(CapturableGuidedDecoder, factory, params, 4, 64, graph=True, fused=True)
    assert eager == replayed


DEADLOCK_SCRIPT = textwrap.dedent("""
    import ctypes, torch, sys
    sys.path.insert(0, {tests!r})
    from conftest import *  # noqa
    from capgraph import GuidedDecodingConfig, GuidedDecodingParams, GuideType
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.requests import GuidedRequest
    from capgraph.tokenizers import load_tokenizer
    tok = load_tokenizer("mistral-sp32k")
    config = GuidedDecodingConfig.from_tokenizer(tok)
    dec = CapturableGuidedDecoder(config, 2, 0, device="cuda")
    params = GuidedDecodingParams(GuideType.REGEX, "[a-z]+")
    libcuda = ctypes.PyDLL("libcuda.so.1")  # PyDLL: the GIL stays held during the call
    logits = torch.zeros(2, len(tok), device="cuda")
    for step in range(20):
        reqs = [GuidedRequest.context(i, i, params) if step == 0 else
                GuidedRequest.generation(i, i, params, 1000 + step) for i in range(2)]
        dec.add_batch(reqs)
        torch.cuda._sleep(10_000_000)  # keep the stream busy so the callbacks are pending
        dec.execute(logits)
        # a native call that holds the GIL and synchronises: safe only because execute drained
        assert libcuda.cuCtxSynchronize() == 0
        dec.take_failed_requests()
    print("done")
""")


def test_gil_holding_sync_after_execute_does_not_deadlock(tmp_path):
    """A native call that holds the GIL and synchronises right after execute completes: the
    drain ran the pending callbacks first (run in a subprocess with a timeout)."""
    from pathlib import Path
    script = tmp_path / "deadlock.py"
    script.write_text(DEADLOCK_SCRIPT.format(tests=str(Path(__file__).parent)))
    try:
        out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                             timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: the GIL-holding synchronize never returned")
    assert out.returncode == 0 and "done" in out.stdout, out.stderr[-2000:]
