"""Differential walk of random Lark grammars (short run of ``tools/lark_walk.py``): every
output the decoder lets through under a Lark guide's masks is in the grammar's language by
the ``lark`` package, on both backends."""

from __future__ import annotations

import pytest

pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
pytest.importorskip("lark", reason="the lark package (the test extra) is not installed")

from conftest import load_tool  # noqa: E402

lark_walk = load_tool("lark_walk")
engine_cases = load_tool("engine_cases")


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_random_lark_walks_stay_in_the_grammar(backend, factory_cache, tekken,
                                               one_torch_thread):
    """24 random grammars, 3 walks each: no finished output outside its grammar, and the
    walk is not vacuous (grammars walked, outputs judged)."""
    grammars = lark_walk.random_larks(24, seed=11)
    counts = lark_walk.conformance_walk.walk_guides(
        factory_cache("tekken", backend), tekken, lark_walk.guides(grammars, backend),
        walks=3, seed=11, max_tokens=16, tilt=lark_walk.TILT)
    assert counts.invalid == 0, "\n".join(counts.examples)
    assert counts.walked >= 4 and counts.validated >= 8, counts


def test_random_grammars_are_read_by_the_oracle():
    """The generator writes grammars the lark package reads (so the walk has verdicts), each
    with a start rule, terminals that match something, and the alphabet's non-ASCII
    letters."""
    grammars = lark_walk.random_larks(40, seed=3)
    assert all(g.startswith("start: ") for g in grammars)
    readable = [g for g in grammars if engine_cases._lark_parser(g) is not None]
    assert len(readable) >= 36
    assert any("σ" in g or "é" in g or "ж" in g for g in grammars)


@pytest.mark.parametrize("grammar, text, valid", [
    ("start: /\\w+/", "a\u0301", True),  # a combining mark is a word character in Rust
    ("start: /\\s/", "\x1c", False),  # Python's \s takes U+001C, Rust's does not
    ("start: /[\\Wa]+/", "a-", True), ("start: /[\\Wa]+/", "b", False),
    ("start: /[^k]/i", "\u212a", False),  # the Kelvin sign folds to k
])
def test_lark_oracle_reads_classes_as_llguidance_does(grammar, text, valid):
    """The Lark oracle reads \\d, \\w, \\s and their negations as Rust's regex (llguidance's
    reading, what a Lark guide means), with Unicode case folding."""
    assert engine_cases.lark_verdict(grammar, text) is valid
