"""Differential walk of random regexes (short run of ``tools/regex_walk.py``): every output the
decoder lets through under a REGEX guide's masks, or under a string schema's ``pattern``, is
matched by the regex as ECMA-262 reads it, on both backends."""

from __future__ import annotations

import importlib.util
import random
import shutil

import pytest

from conftest import load_tool

regex_walk = load_tool("regex_walk")

BACKENDS = ["xgrammar", pytest.param("llguidance", marks=pytest.mark.skipif(
    importlib.util.find_spec("llguidance") is None,
    reason="the llguidance extra is not installed"))]


@pytest.mark.parametrize("kind", ["regex", "pattern"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_regex_walks_stay_in_the_language(backend, kind, factory_cache, tekken,
                                                 one_torch_thread):
    """40 random regexes, 2 walks each: no finished output outside its regex (for a pattern:
    not a JSON string, or a string the pattern does not match), and the walk is not vacuous."""
    regexes = regex_walk.random_regexes(40, seed=5)
    counts = regex_walk.conformance_walk.walk_guides(
        factory_cache("tekken", backend), tekken, regex_walk.guides(regexes, kind),
        walks=2, seed=5, max_tokens=16, tilt=regex_walk.tilt(kind))
    assert counts.invalid == 0, "\n".join(counts.examples)
    assert counts.walked >= 30 and counts.validated >= 10, counts


def test_random_regex_walks_in_structural_tags_stay_in_the_language(factory_cache, tekken,
                                                                      one_torch_thread):
    """A structural tag's ``regex`` element on xgrammar: the same promise."""
    regexes = regex_walk.random_regexes(40, seed=5)
    counts = regex_walk.conformance_walk.walk_guides(
        factory_cache("tekken", "xgrammar"), tekken, regex_walk.guides(regexes, "tag"),
        walks=2, seed=5, max_tokens=16, tilt=regex_walk.tilt("tag"))
    assert counts.invalid == 0, "\n".join(counts.examples)
    assert counts.walked >= 30 and counts.validated >= 10, counts


@pytest.mark.parametrize("text, tree, whole, search", [
    # (regex text, its tree, whether "ab" matches whole, whether some part of "xaby" does)
    ("ab", regex_walk.Seq((regex_walk.Char("a"), regex_walk.Char("b"))), True, True),
    ("^ab", regex_walk.Seq((regex_walk.Char("a"), regex_walk.Char("b"))), True, False),
    ("a|c", regex_walk.Alt((regex_walk.Char("a"), regex_walk.Char("c"))), False, True),
    ("[^a]b", regex_walk.Seq((regex_walk.Class(True, (regex_walk.Char("a"),)),
                              regex_walk.Char("b"))), False, False),
    (".{2}", regex_walk.Repeat(regex_walk.Dot(), 2, 2, False, "{}"), True, True),
    ("\\w*$", regex_walk.Repeat(regex_walk.Shorthand("w"), 0, None, False, "*"), True, True),
])
def test_judge_full_and_search_matches(text, tree, whole, search):
    """The judge's whole-text match (a REGEX guide) and its search (a pattern, ``^`` and
    ``$`` tying it to the ends)."""
    regex = regex_walk.Regex(tree, text.startswith("^"), text.endswith("$"), text)
    assert regex_walk.matches(regex, "ab") is whole
    assert regex_walk.matches(regex, "xaby", search=True) is search


@pytest.mark.parametrize("letter, inside, outside", [
    ("d", "7", "\u0661"), ("w", "_", "\u00e9"), ("s", "\ufeff", "\x1c"), ("s", "\u2028", "\u0085"),
    ("S", "\u0085", "\u00a0"), ("W", "\u212a", "k"), ("D", "a", "0"),
])
def test_judge_reads_shorthands_as_ecma(letter, inside, outside):
    """``\\d`` / ``\\w`` are ASCII, ``\\s`` is ECMA's white space and line terminators."""
    regex = regex_walk.Regex(regex_walk.Shorthand(letter), False, False, "\\" + letter)
    assert regex_walk.matches(regex, inside)
    assert not regex_walk.matches(regex, outside)


def test_generated_regexes_cover_the_readings_that_differ():
    """The generator writes the spellings where readings part: escapes of every form, Annex B
    literals, classes with shorthands and negation, lazy quantifiers, anchors, a character
    outside the BMP."""
    texts = [r.text for r in regex_walk.random_regexes(300, seed=1)]
    joined = "".join(texts)
    for spelling in ("\\x", "\\u", "\\cJ", "[^", "\\d", "\\W", "(?:", "*?", "{", "^", "$",
                     "\\ud83d", "\\b"):
        assert spelling in joined, spelling
    assert any("\U0001f600" in t for t in texts)


@pytest.mark.skipif(shutil.which("node") is None,
                    reason="node is not installed: the judge is checked against its RegExp")
def test_judge_agrees_with_node():
    """The judge and Node's ``RegExp`` (ECMA-262 itself) agree on random regexes and texts,
    half of them drawn from the regex's language."""
    rng = random.Random(2)
    cases = [(r, t, s) for r in regex_walk.random_regexes(150, seed=2)
             for t in regex_walk.sample_texts(r, rng, 8) for s in (False, True)]
    assert sum(regex_walk.matches(r, t, s) for r, t, s in cases) > len(cases) // 4
    assert regex_walk.node_disagreements(cases) == []


regex_exhaustive = load_tool("regex_exhaustive")


def test_every_short_text_is_read_as_ecma262_reads_it():
    """60 random regexes, every text up to 3 characters over each regex's own characters:
    xgrammar's REGEX and EBNF readings (what capgraph gives it) agree with the judge."""
    counts, found = regex_exhaustive.disagreements(regex_walk.random_regexes(60, seed=9), 3, 9)
    assert found == []
    assert counts["checked"] >= 50, counts


def test_the_exhaustive_check_finds_an_optional_group_read_wider(monkeypatch):
    """The check sees xgrammar's own '?' on a group with a repeat inside (the reading capgraph
    writes as '{0,1}'): 'a(bx+)?d' taking 'axd'."""
    import capgraph.grammar.semantics as semantics

    real = semantics.ecma_regex
    monkeypatch.setattr(semantics, "ecma_regex",
                        lambda *a, **k: real(*a, **k).replace("{0,1}", "?"))
    plus = regex_walk.Repeat(regex_walk.Char("x"), 1, None, False, "+")
    body = regex_walk.Group(regex_walk.Seq((regex_walk.Char("b"), plus)), True)
    tree = regex_walk.Seq((regex_walk.Char("a"), regex_walk.Repeat(body, 0, 1, False, "?"),
                           regex_walk.Char("d")))
    regex = regex_walk.Regex(tree, False, False, "a(bx+)?d")
    counts, found = regex_exhaustive.disagreements([regex], 3, 0)
    assert counts["disagree"] == 1 and "'axd' taken" in found[0], found
