"""``capgraph bench loop``'s schedule: every case is set up and warmed up before the first timed
step, warm-up and timed steps run the same code, and a batch size listed twice is measured the
same way both times. The steps are recorded, not timed: nothing here asserts a timing."""

from __future__ import annotations

import functools
import json

import pytest

from capgraph import bench
from capgraph.bench import loop

SP = "mistral-sp32k"  # the small bundled tokenizer keeps the run short


def _record(events: list, name: str, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        events.append(("setup", name))
        return fn(*args, **kwargs)
    return wrapper


def test_every_case_is_warmed_up_before_any_timed_step(tmp_path, monkeypatch):
    """One-time work (tokenizer, matcher factory, any guide compile, a case's runner, decoders
    and context step) happens before the first timed step; each case and variant runs
    ``--warmup`` untimed steps, all before any case's first timed step, through the same
    ``Case.step`` as its timed ones; the same batch size listed twice gets the same steps."""
    import capgraph.grammar as grammar
    import capgraph.tokenizers as tokenizers
    from capgraph.grammar.base import GrammarMatcherFactory

    events: list[tuple] = []
    monkeypatch.setattr(tokenizers, "load_tokenizer",
                        _record(events, "load_tokenizer", tokenizers.load_tokenizer))
    monkeypatch.setattr(grammar, "create_matcher_factory",
                        _record(events, "create_matcher_factory", grammar.create_matcher_factory))
    monkeypatch.setattr(GrammarMatcherFactory, "compile_async",
                        _record(events, "compile_async", GrammarMatcherFactory.compile_async))
    monkeypatch.setattr(loop.Case, "__init__", _record(events, "case", loop.Case.__init__))
    step = loop.Case.step

    def recorded_step(self, variant, s, timed):
        events.append(("step", id(self), variant, s, timed))
        return step(self, variant, s, timed)
    monkeypatch.setattr(loop.Case, "step", recorded_step)

    warmup, steps = 2, 3
    out = tmp_path / "loop.json"
    assert bench.main(["loop", "--quick", "--json", str(out), "--tokenizer", SP, "--model",
                       "standin", "--batches", "2", "1", "2", "--steps", str(steps),
                       "--warmup", str(warmup)]) == 0
    doc = json.loads(out.read_text())

    names = [e[1] for e in events if e[0] == "setup"]
    assert names.count("case") == 3 and "compile_async" in names and "load_tokenizer" in names
    first_timed = next(i for i, e in enumerate(events) if e[0] == "step" and e[4])
    late = [e for e in events[first_timed:] if e[0] == "setup" or (e[0] == "step" and not e[4])]
    assert not late, f"one-time work or warm-up after the first timed step: {late[:5]}"

    per_case: dict[int, list[tuple]] = {}
    for e in events:
        if e[0] == "step":
            per_case.setdefault(e[1], []).append(e[2:])
    assert len(per_case) == 3
    for calls in per_case.values():
        for variant in loop.VARIANTS:
            mine = [(s, timed) for v, s, timed in calls if v == variant]
            assert mine == [(s, s >= warmup) for s in range(warmup + steps)], (variant, mine)
    first, _, repeated = per_case.values()  # batch 2, batch 1, batch 2 again
    assert first == repeated

    assert [r["batch"] for r in doc["rows"]] == [2, 1, 2]
    for row in doc["rows"]:
        assert row["warmup"] == warmup and row["steps"] == steps
        for v in loop.VARIANTS:
            assert len(row[f"{v}_samples_ms"]) == steps


@pytest.mark.parametrize("flag", [["--warmup", "0"], ["--steps", "0"], ["--batches", "0"]])
def test_rejects_counts_below_one(tmp_path, flag):
    """A case with no warm-up step (or no step, or no sequence) is refused before any setup."""
    with pytest.raises(ValueError, match="must all be >= 1"):
        bench.main(["loop", "--quick", "--json", str(tmp_path / "x.json"), *flag])
