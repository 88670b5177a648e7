"""Short soak for CI: a few hundred steps of mixed guided requests joining and leaving slots,
speculative decoding on, through GuidedDecoder, CapturableGuidedDecoder (callbacks on hostfunc's
CPU stand-in) and a replayed HostGraph; every finished output is checked for validity.

The soak engine is ``tools/soak.py`` (run it directly for the long mode and its figures).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from conftest import settled_live_entries

ROOT = Path(__file__).resolve().parent.parent
RSS_GROWTH_LIMIT = 64 << 20  # generous: steady state measured at ~1 MiB over 300 steps


def _load_soak():
    spec = importlib.util.spec_from_file_location("capgraph_tools_soak", ROOT / "tools" / "soak.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


soak = _load_soak()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def xgr(factory_cache):
    factory = factory_cache("tekken")
    return factory, soak.decoded_vocab(factory)


def _check(rep, min_valid: int) -> None:
    assert rep.problems == [], "\n".join(rep.problems[:10])
    assert sum(rep.finished_valid.values()) >= min_valid, rep.summary()
    assert len(rep.finished_valid) == 5, f"every grammar finished at least once: {rep.summary()}"
    assert rep.drafts_accepted > 0 and rep.random_rejections > 0, rep.summary()
    assert rep.expected_failures > 0 and rep.aborted > 0, rep.summary()
    assert rep.matchers_end == 0
    assert rep.live_entries_end == rep.live_entries_start
    assert rep.rss_end - rep.rss_warm < RSS_GROWTH_LIMIT, rep.summary()


def test_soak_eager_and_graph_outputs_are_valid_and_identical(xgr):
    """300 steps through GuidedDecoder and through the capturable step replayed from one
    HostGraph: every finished JSON/regex/EBNF output is valid (jsonschema, re.fullmatch, fresh
    matcher), only the bad-guide requests fail, no NaN or dead row, both paths produce the same
    outputs token for token, and matchers, hostfunc entries and RSS come back after warm-up."""
    factory, vocab_bytes = xgr
    eager = soak.run_soak(factory, 300, "eager", seed=1, vocab_bytes=vocab_bytes)
    _check(eager, min_valid=40)
    graph = soak.run_soak(factory, 300, "graph", seed=1, vocab_bytes=vocab_bytes)
    _check(graph, min_valid=40)
    assert graph.outputs_digest == eager.outputs_digest
    assert graph.tokens == eager.tokens and graph.drafts_accepted == eager.drafts_accepted


def test_soak_advance_batch_outputs_equal_add_batch_outputs(xgr):
    """Without drafts, a step of the same requests as the step before queued with
    advance_batch (on the replayed HostGraph's native node: its previous job again; on the
    capturable decoder run eagerly: requests made and queued as add_batch does) among joins,
    aborts and bad guides: the same outputs token for token as add_batch steps and as the
    eager decoder, all valid, only the bad guides failing, nothing left held."""
    factory, vocab_bytes = xgr
    eager = soak.run_soak(factory, 300, "eager", seed=5, drafts=0, vocab_bytes=vocab_bytes)
    runs = [soak.run_soak(factory, steps, kind, seed=5, drafts=0, vocab_bytes=vocab_bytes,
                          advance=True) for kind, steps in (("graph", 300), ("capturable", 300))]
    for rep in (eager, *runs):
        assert rep.problems == [], "\n".join(rep.problems[:10])
        assert rep.expected_failures > 0 and rep.aborted > 0, rep.summary()
        assert rep.matchers_end == 0 and rep.live_entries_end == rep.live_entries_start
    assert sum(eager.finished_valid.values()) >= 40, eager.summary()
    for rep in runs:
        assert rep.advanced > 150, rep.summary()
        assert rep.outputs_digest == eager.outputs_digest and rep.tokens == eager.tokens
    with pytest.raises(ValueError, match="drafts=0"):
        soak.Soak(factory, "graph", drafts=2, advance=True, vocab_bytes=vocab_bytes)


def test_soak_capturable_callbacks(xgr):
    """200 steps of CapturableGuidedDecoder run eagerly (callbacks on the CPU stand-in's side
    stream, drained each step): the same validity, failure and leak checks hold."""
    factory, vocab_bytes = xgr
    rep = soak.run_soak(factory, 200, "capturable", seed=2, vocab_bytes=vocab_bytes)
    _check(rep, min_valid=25)


def test_soak_llguidance(factory_cache, xgr):
    """150 steps of GuidedDecoder on the llguidance backend (Lark EBNF, one stop token), without
    drafts: valid outputs, only the expected failures, nothing left held at the end. (With drafts,
    llguidance 1.9.1 can return a wrong mask after a rollback: see
    test_reliability.py::test_llguidance_mask_after_rollback_equals_a_fresh_matcher.)"""
    pytest.importorskip("llguidance")
    factory = factory_cache("tekken", "llguidance")
    rep = soak.run_soak(factory, 150, "eager", seed=3, drafts=0, vocab_bytes=xgr[1])
    assert rep.problems == [], "\n".join(rep.problems[:10])
    assert sum(rep.finished_valid.values()) >= 15, rep.summary()
    assert rep.matchers_end == 0 and rep.live_entries_end == rep.live_entries_start


def test_soak_through_the_reference_loop(tokenizer_cache):
    """generate() — the reference decode loop — over rounds of requests of mixed grammars that
    join and leave 4 slots, with n-gram speculative drafts (acceptance is whatever the target's
    greedy verification keeps) and the capturable decoder: every output that stops validates,
    no hostfunc entry is left behind, and resident memory stays flat across rounds."""
    import hostfunc
    from capgraph import GuidedDecodingConfig
    from capgraph.demo import bundled_schema, demo_guides, validate
    from capgraph.grammar import create_matcher_factory
    from capgraph.runtime import generate, tiny_llama
    tok = tokenizer_cache("mistral-sp32k")
    model = tiny_llama(len(tok), seed=1)
    factory = create_matcher_factory(
        GuidedDecodingConfig.from_tokenizer(tok, json_whitespace="compact"))
    guides = demo_guides(bundled_schema())
    live = settled_live_entries()
    rss, stops = [], 0
    for round_ in range(4):
        prompts = [f"Request {round_}.{i}:" for i in range(12)]
        chosen = [guides[(i + round_) % 3] for i in range(12)]
        results = generate(prompts, chosen, model=model, tokenizer=tok, max_new_tokens=40,
                           max_batch_size=4, draft="ngram", num_draft_tokens=3,
                           decoder="capturable", factory=factory)
        for result, params in zip(results, chosen):
            assert result.finish_reason in ("stop", "length"), result.error
            verdict = validate(result, params, factory)
            assert verdict.ok is not False, (params.guide_type, result.text, verdict.detail)
            stops += result.finish_reason == "stop"
        rss.append(soak.rss_bytes())
    factory.close()
    assert stops >= 12, f"only {stops} of 48 outputs finished on their stop token"
    assert hostfunc.live_entries() == live
    assert rss[-1] - rss[1] < RSS_GROWTH_LIMIT, [r >> 20 for r in rss]
