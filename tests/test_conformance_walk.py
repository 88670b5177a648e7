"""Differential walk (short run): random outputs of the decoder under JSON-schema masks are
all valid under ``jsonschema``, on both backends, with the fallback and inside a structural
tag on xgrammar.

The long run is ``python tools/conformance_walk.py`` (counts in docs/CONFORMANCE.md). Here the
32k-token sentencepiece tokenizer keeps the per-step work small.
"""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
pytest.importorskip("jsonschema", reason="jsonschema is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from conftest import load_tool  # noqa: E402

TOKENIZER = "mistral-sp32k"
walk = load_tool("conformance_walk")


@pytest.fixture(scope="module")
def walk_factories(tokenizer_cache):
    """backend -> factory on the 32k tokenizer, closed after the module."""
    tokenizer = tokenizer_cache(TOKENIZER)
    built = {b: walk.make_factory(tokenizer, b) for b in walk.BACKENDS}
    yield built
    for factory in built.values():
        factory.close()


def _assert_all_valid(counts) -> None:
    assert counts.invalid == 0, "\n".join(counts.examples)
    assert counts.failed == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["xgrammar", "llguidance", "xgrammar-tag"])
def test_bench_schema_walks_are_all_valid(backend, walk_factories, tokenizer_cache,
                                          one_torch_thread):
    """Every bundled JSON Schema Bench schema the backend accepts is walked once (on
    ``xgrammar-tag``: as a structural tag's json_schema element); every finished output parses
    as JSON and validates against its schema. Most schemas are walked and most walks finish
    (the walk is not vacuous)."""
    schemas = walk.bench_schemas()
    counts = walk.walk(walk_factories[backend], tokenizer_cache(TOKENIZER), schemas,
                       walks=1, max_tokens=96, seed=1, in_tag=backend.endswith("-tag"))
    _assert_all_valid(counts)
    assert counts.walked + counts.refused == len(schemas)
    assert counts.walked >= len(schemas) // 2 and counts.validated >= counts.walked // 2


@settings(max_examples=3, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rng=st.randoms(use_true_random=False))
def test_random_schema_walks_are_all_valid(rng, walk_factories, tokenizer_cache,
                                           one_torch_thread):
    """Small random schemas (tools/conformance_walk.py's generator, drawing from a
    hypothesis-controlled Random, so failures shrink), walked on both backends, with the
    fallback and inside a structural tag on xgrammar: no invalid output; the fallback refuses
    only what both backends refuse; a tag refuses what the JSON-schema guide refuses."""
    schemas = [walk.random_schema(rng) for _ in range(12)]
    seed = rng.randrange(2**31)
    tokenizer = tokenizer_cache(TOKENIZER)
    counts = {b: walk.walk(walk_factories[b], tokenizer, schemas, walks=1, max_tokens=64,
                           seed=seed, in_tag=b.endswith("-tag")) for b in walk.BACKENDS}
    for c in counts.values():
        _assert_all_valid(c)
    assert counts["fallback"].walked >= max(counts["xgrammar"].walked,
                                            counts["llguidance"].walked)
    # a tag's json_schema element is judged and compiled as the JSON-schema guide
    assert counts["xgrammar-tag"].walked == counts["xgrammar"].walked
