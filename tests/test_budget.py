"""The per-request host-step budget (GuidedDecodingConfig.host_step_budget_ms): a request whose
accept and fills take too long fails alone, in every build path, and the batch goes on.

No timing is asserted: the slow requests here are either ambiguous grammars whose per-token cost
grows without bound (tens of ms after ~200 tokens, seconds later), or matchers that spend CPU
time far beyond a budget that healthy requests stay three orders of magnitude below. An overrun
counts the CPU time the request's thread spent, not time it waited: a matcher that sleeps (as a
preempted thread does) never fails its request.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from capgraph import ConfigError, GuidedDecodingConfig, GuidedDecodingParams
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.build import library as native
from capgraph.grammar import GrammarMatcher, create_matcher_factory
from capgraph.params import DEFAULT_HOST_STEP_BUDGET_MS
from capgraph.requests import GuidedRequest
from conftest import AimedMethods, spend_cpu

VOCAB = ["a", "b", "</s>", "c"]
V = 64
A = 0  # token 'a'
BUDGET_MS = 20.0
HEALTHY = GuidedDecodingParams.regex("a*b?")
# (a*)*b as grammar rules (what Grammar.from_regex writes for it): the cost per token grows
# with the output (as a REGEX guide it is one automaton, whose cost does not; nested counts
# such as ((a|aa)*){1000} are refused at compile: test_guide_limits.py)
AMBIGUOUS = ['root ::= inner "b"\nrun ::= "" | "a" run\ninner ::= "" | run inner']
MAX_STEPS = 800

native_reason = native.unavailable_reason()


@pytest.fixture(scope="module")
def tiny():
    """xgrammar on a 4-token raw vocabulary padded to 64 ids, budget 20 ms."""
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[2], vocab_size_padded=V,
                                  host_step_budget_ms=BUDGET_MS)
    factory = create_matcher_factory(config)
    yield factory
    factory.close()


def _decoder(factory, build: str, kind: str, slots: int = 3, drafts: int = 0,
             budget: float | None = BUDGET_MS, methods: AimedMethods | None = None
             ) -> GuidedDecoder:
    """``methods``: the native build's C++ loop calls these (see :func:`_slow_native`)."""
    if build == "native" and native_reason is not None:
        pytest.skip(f"the C++ build is unavailable: {native_reason}")
    config = dataclasses.replace(factory.config, host_step_budget_ms=budget,
                                 native_build="on" if build == "native" else "off")
    cls = CapturableGuidedDecoder if kind == "capturable" else GuidedDecoder
    return cls(config, slots, drafts, factory=factory,
               host_build=methods.host_build() if methods is not None else "auto")


def _step(dec: GuidedDecoder, requests: list[GuidedRequest], rows: int
          ) -> tuple[torch.Tensor, list]:
    """One step: add_batch, execute on zero logits; the logits and the failures."""
    dec.add_batch(requests)
    logits = torch.zeros(rows, V)
    failed = dec.execute(logits)
    if isinstance(dec, CapturableGuidedDecoder):
        failed = dec.take_failed_requests()
    return logits, failed


def _allowed(logits_row: torch.Tensor) -> list[int]:
    return torch.isfinite(logits_row).nonzero().flatten().tolist()


@pytest.mark.parametrize("kind", ["eager", "capturable"])
@pytest.mark.parametrize("build", ["python", "native"])
@pytest.mark.parametrize("pattern", AMBIGUOUS)
def test_ambiguous_guide_fails_alone(tiny, pattern, build, kind):
    """An ambiguous grammar fed 'a' step after step (its host step grows past the budget)
    fails with BudgetExceededError, once, while two healthy requests in the same batch keep
    their exact masks and never fail; afterwards its rows are unmasked and its matcher is
    gone, so it costs nothing more. Three requests: the Python build runs batched rounds."""
    dec = _decoder(tiny, build, kind)
    bad = GuidedDecodingParams.ebnf(pattern)
    guides = [HEALTHY, bad, HEALTHY]
    reference = tiny.create(HEALTHY)
    _, failed = _step(dec, [GuidedRequest.context(i, i, p) for i, p in enumerate(guides)], 3)
    assert failed == []
    failures, failed_at = [], None
    for step in range(MAX_STEPS):
        logits, failed = _step(dec, [GuidedRequest.generation(i, i, p, A)
                                     for i, p in enumerate(guides)], 3)
        failures += failed
        assert reference.accept_token(A)
        row = torch.zeros(1, 2, dtype=torch.int32)
        reference.fill_next_token_bitmask(row, 0)
        expect = [t for t in range(V) if row[0, t // 32] >> (t % 32) & 1]
        assert _allowed(logits[0]) == expect and _allowed(logits[2]) == expect
        if failed_at is not None:
            assert _allowed(logits[1]) == list(range(V))  # unmasked
            if step >= failed_at + 3:
                break
        elif failed:
            failed_at = step
    dec.close()
    assert failed_at is not None, f"{pattern} never went over the budget in {MAX_STEPS} steps"
    assert [f[0] for f in failures] == [1]
    assert "BudgetExceededError" in failures[0][1] and f"{BUDGET_MS:g} ms budget" in failures[0][1]
    assert dec.grammar_matchers[1] is None and dec.grammar_matchers[0] is not None


class _Slow(GrammarMatcher):
    """A matcher that spends ``delay`` s of CPU in every fill, or with ``sleep`` sleeps that
    long (and otherwise is ``inner``)."""

    def __init__(self, inner: GrammarMatcher, delay: float, sleep: bool = False) -> None:
        self.inner, self.delay = inner, delay
        self.wait = time.sleep if sleep else spend_cpu

    def accept_token(self, token_id: int) -> bool:
        return self.inner.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.wait(self.delay)
        self.inner.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


@pytest.mark.parametrize("batch", [2, 3])  # request by request; batched rounds
@pytest.mark.parametrize("kind", ["eager", "capturable"])
def test_python_build_names_the_slow_request(tiny, batch, kind):
    """Python build: a matcher whose fill takes 5x the budget fails alone -- in its first
    step when requests are built one by one, in the step after a batched round went over the
    budget otherwise (that round cannot say whose call was slow); the others are masked as
    usual throughout and never fail."""
    dec = _decoder(tiny, "python", kind, slots=batch)
    guides = [HEALTHY] * batch
    _step(dec, [GuidedRequest.context(i, i, p) for i, p in enumerate(guides)], batch)
    dec.grammar_matchers[1] = _Slow(dec.grammar_matchers[1], 5 * BUDGET_MS / 1e3)
    failures = []
    for step in range(3):
        logits, failed = _step(dec, [GuidedRequest.generation(i, i, p, A)
                                     for i, p in enumerate(guides)], batch)
        failures.append(failed)
        assert _allowed(logits[0]) == [0, 1, 2]
    dec.close()
    first = 0 if batch <= dec.host_build.sequential_fill_max else 1
    assert [[f[0] for f in failed] for failed in failures] == \
        [[1] if step == first else [] for step in range(3)]
    assert "BudgetExceededError" in failures[first][0][1]


@pytest.mark.parametrize("build", ["python", "native"])
def test_over_budget_draft_rows_are_all_unmasked(tiny, build):
    """With drafts, a request that goes over the budget while filling its third row leaves
    all its rows of the step unmasked (the ones filled before the overrun too), zero counts,
    and the other request's rows masked."""
    delay = 0.4 * BUDGET_MS / 1e3  # the overrun comes at the third row
    methods = _slow_native(delay) if build == "native" else None
    dec = _decoder(tiny, build, "eager", slots=2, drafts=2, methods=methods)
    _step(dec, [GuidedRequest.context(i, i, HEALTHY) for i in range(2)], 2)
    if build == "python":
        dec.grammar_matchers[1] = _Slow(dec.grammar_matchers[1], delay)
    else:
        methods.aim(dec.grammar_matchers[1])
    logits, failed = _step(dec, [GuidedRequest.generation(i, i, HEALTHY, A,
                                                          draft_tokens=[A, A])
                                 for i in range(2)], 6)
    assert [f[0] for f in failed] == [1] and "BudgetExceededError" in failed[0][1]
    assert all(_allowed(logits[r]) == [0, 1, 2] for r in range(3))
    assert all(_allowed(logits[r]) == list(range(V)) for r in range(3, 6))
    assert dec.num_advanced_tokens[1] == 0 and dec.num_guided_tokens[1] == 0
    assert dec.num_advanced_tokens[0] == 3  # the new token and both drafts
    dec.close()


def _slow_native(delay: float, sleep: bool = False) -> AimedMethods:
    """xgrammar's methods for the C++ loop, with a fill that spends ``delay`` s of CPU (with
    ``sleep``: sleeps) for the matcher aimed at (tvm-ffi calls back into Python)."""
    wait = time.sleep if sleep else spend_cpu

    def slow_fill(fill, handle, bitmask, index, debug):
        wait(delay)
        return fill(handle, bitmask, index, debug)

    return AimedMethods(fill=slow_fill)


@pytest.mark.parametrize("kind", ["eager", "capturable"])
def test_native_build_names_the_slow_request(tiny, kind):
    """C++ build (its CPython entry; on the capturable decoder, its own thread): a fill that
    spends 5x the budget fails its request alone in its first step, its row unmasked, the
    others masked."""
    methods = _slow_native(5 * BUDGET_MS / 1e3)
    dec = _decoder(tiny, "native", kind, slots=3, methods=methods)
    _step(dec, [GuidedRequest.context(i, i, HEALTHY) for i in range(3)], 3)
    methods.aim(dec.grammar_matchers[1])
    logits, failed = _step(dec, [GuidedRequest.generation(i, i, HEALTHY, A) for i in range(3)],
                           3)
    dec.close()
    assert _allowed(logits[0]) == [0, 1, 2] and _allowed(logits[2]) == [0, 1, 2]
    assert [f[0] for f in failed] == [1] and "BudgetExceededError" in failed[0][1]
    assert _allowed(logits[1]) == list(range(V))


@pytest.mark.parametrize("kind", ["eager", "capturable"])
@pytest.mark.parametrize("build", ["python", "native"])
def test_a_request_that_waits_off_the_cpu_is_not_over_budget(tiny, build, kind):
    """An overrun is CPU time the request's thread spent, not time it waited: a request whose
    fill sleeps 5x the budget (off the CPU, as a thread preempted on a loaded host or waiting
    for the GIL is) is served, its row masked, on every build and thread (the caller's, the
    capturable decoder's host-stream worker or C++ build thread); one that spends that much
    CPU fails (the same step, with the fill busy)."""
    delay = 5 * BUDGET_MS / 1e3
    for sleep in (True, False):
        methods = _slow_native(delay, sleep) if build == "native" else None
        dec = _decoder(tiny, build, kind, slots=2, methods=methods)  # (Python: one by one)
        _step(dec, [GuidedRequest.context(i, i, HEALTHY) for i in range(2)], 2)
        if build == "python":
            dec.grammar_matchers[1] = _Slow(dec.grammar_matchers[1], delay, sleep)
        else:
            methods.aim(dec.grammar_matchers[1])
        logits, failed = _step(dec, [GuidedRequest.generation(i, i, HEALTHY, A)
                                     for i in range(2)], 2)
        dec.close()
        assert _allowed(logits[0]) == [0, 1, 2]
        if sleep:
            assert failed == [] and _allowed(logits[1]) == [0, 1, 2]
        else:
            assert [f[0] for f in failed] == [1] and "BudgetExceededError" in failed[0][1]


@pytest.mark.parametrize("kind", ["eager", "capturable"])
@pytest.mark.parametrize("waited", [0.9, 3.0])
def test_a_request_after_one_that_waited_is_judged_by_its_own_cpu_time(tiny, waited, kind):
    """Python build, one thread: a request whose fill sleeps ``waited`` budgets (under the
    budget, or a wall-time overrun), then one whose fill spends 1.5 budgets of CPU: the first
    is served, the second fails (the wait before it does not hide its CPU time)."""
    dec = _decoder(tiny, "python", kind, slots=2)
    _step(dec, [GuidedRequest.context(i, i, HEALTHY) for i in range(2)], 2)
    dec.grammar_matchers[0] = _Slow(dec.grammar_matchers[0], waited * BUDGET_MS / 1e3, True)
    dec.grammar_matchers[1] = _Slow(dec.grammar_matchers[1], 1.5 * BUDGET_MS / 1e3)
    logits, failed = _step(dec, [GuidedRequest.generation(i, i, HEALTHY, A) for i in range(2)], 2)
    dec.close()
    assert [f[0] for f in failed] == [1] and "BudgetExceededError" in failed[0][1]
    assert _allowed(logits[0]) == [0, 1, 2] and _allowed(logits[1]) == list(range(V))


@pytest.mark.parametrize("budget", [None, 0])
@pytest.mark.parametrize("build", ["python", "native"])
def test_no_budget_never_fails_a_slow_request(tiny, budget, build):
    """``host_step_budget_ms`` None or 0 turns the guard off: a request twice as slow as the
    default budget allows is served, not failed."""
    delay = 2 * DEFAULT_HOST_STEP_BUDGET_MS / 1e3
    methods = _slow_native(delay) if build == "native" else None
    dec = _decoder(tiny, build, "eager", slots=2, budget=budget, methods=methods)
    _step(dec, [GuidedRequest.context(i, i, HEALTHY) for i in range(2)], 2)
    if build == "python":
        dec.grammar_matchers[1] = _Slow(dec.grammar_matchers[1], delay)
    else:
        methods.aim(dec.grammar_matchers[1])
    logits, failed = _step(dec, [GuidedRequest.generation(i, i, HEALTHY, A) for i in range(2)], 2)
    dec.close()
    assert failed == [] and _allowed(logits[1]) == [0, 1, 2]


@pytest.mark.parametrize("value", [-1, float("nan"), float("inf"), 1e9, "5", True])
def test_budget_is_validated(value):
    """The budget is a number of ms in [0, 60000] or None; anything else is a ConfigError
    naming the field."""
    with pytest.raises(ConfigError, match="host_step_budget_ms"):
        GuidedDecodingConfig(encoded_vocab=VOCAB, host_step_budget_ms=value)


def test_budget_error_carries_its_context():
    """BudgetExceededError carries the request id, slot, measured ms and budget."""
    from capgraph import BudgetExceededError

    err = BudgetExceededError(request_id=7, seq_slot=2, elapsed_ms=93.25, budget_ms=50.0)
    assert (err.request_id, err.seq_slot, err.elapsed_ms, err.budget_ms) == (7, 2, 93.25, 50.0)
    assert "93.2 ms" in str(err) and "50 ms budget" in str(err) and "request_id=7" in str(err)


class _FaultyAtSecondFill(GrammarMatcher):
    """``inner``, except that its second fill raises (a fault after a row was filled)."""

    def __init__(self, inner: GrammarMatcher) -> None:
        self.inner, self.fills = inner, 0

    def accept_token(self, token_id: int) -> bool:
        return self.inner.accept_token(token_id)

    def rollback(self, num_tokens: int) -> None:
        self.inner.rollback(num_tokens)

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self.fills += 1
        if self.fills == 2:
            raise RuntimeError("fault at the second fill")
        self.inner.fill_next_token_bitmask(bitmask, index)

    def is_terminated(self) -> bool:
        return self.inner.is_terminated()


@pytest.mark.parametrize("kind", ["eager", "capturable"])
@pytest.mark.parametrize("build", ["python", "native"])
def test_a_fault_after_a_filled_row_leaves_all_its_rows_unmasked(tiny, build, kind):
    """A request whose matcher faults at its second row (the first already filled) fails
    alone with all its rows of the step unmasked, the row filled before the fault too, as
    every failure leaves them; the other request's rows are masked."""
    methods = None
    if build == "native":
        def faulty_fill(fill, handle, bitmask, index, debug, calls=[0]):
            calls[0] += 1
            if calls[0] == 2:
                raise RuntimeError("fault at the second fill")
            return fill(handle, bitmask, index, debug)
        methods = AimedMethods(fill=faulty_fill)
    dec = _decoder(tiny, build, kind, slots=2, drafts=2, methods=methods)
    _step(dec, [GuidedRequest.context(i, i, HEALTHY) for i in range(2)], 2)
    if build == "python":
        dec.grammar_matchers[1] = _FaultyAtSecondFill(dec.grammar_matchers[1])
    else:
        methods.aim(dec.grammar_matchers[1])
    logits, failed = _step(dec, [GuidedRequest.generation(i, i, HEALTHY, A,
                                                          draft_tokens=[A, A])
                                 for i in range(2)], 6)
    assert [f[0] for f in failed] == [1] and "fault at the second fill" in failed[0][1]
    assert all(_allowed(logits[r]) == [0, 1, 2] for r in range(3))
    assert all(_allowed(logits[r]) == list(range(V)) for r in range(3, 6))
    dec.close()


@pytest.mark.skipif(bool(native_reason), reason=f"the native build: {native_reason}")
@pytest.mark.parametrize("budget_ms", [1e-7, 1e-4])
def test_native_budget_outcomes_equal_the_python_builds(budget_ms):
    """A request whose new token is the stop token that ends its grammar is done, never over
    the budget (the native build failed it, dropping a finished matcher, where its last
    accept was slow); and a budget under a nanosecond is still a budget (the native build
    rounded it to none): each build fails exactly the request that takes 'b' and fills."""
    guide = GuidedDecodingParams.ebnf('root ::= "a" "b"?')
    factory = create_matcher_factory(GuidedDecodingConfig(
        encoded_vocab=["a", "b", "</s>"], stop_token_ids=[2], vocab_size_padded=64,
        native_build="on", host_step_budget_ms=None))
    try:
        for build in ("python", "native"):
            dec = GuidedDecoder(factory.config, 2, 0, factory=factory, host_build=build)
            dec.add_batch([GuidedRequest.context(1, 0, guide), GuidedRequest.context(2, 1, guide)])
            dec.build()
            dec.add_batch([GuidedRequest.generation(1, 0, guide, 0),
                           GuidedRequest.generation(2, 1, guide, 0)])
            dec.build()
            # the budget from this step on (host_step_budget_ms would time the context step's
            # matcher creation too)
            dec.host_build.budget_ms, dec.host_build._budget_s = budget_ms, budget_ms / 1e3
            if build == "native":
                dec.host_build.builder.set_budget_ms(budget_ms)
            dec.add_batch([GuidedRequest.generation(1, 0, guide, 2),
                           GuidedRequest.generation(2, 1, guide, 1)])
            failed = dec.build()
            assert [rid for rid, _ in failed] == [2], (build, failed)
            assert "BudgetExceededError" in failed[0][1]
            dec.close()
    finally:
        factory.close()


def test_ambiguous_cost_tool_runs_the_guide_these_tests_use(capsys):
    """tools/ambiguous_cost.py (the figures docs/RELIABILITY.md quotes) feeds this module's
    ambiguous grammar, and prints one row per step it reports."""
    from conftest import load_tool

    tool = load_tool("ambiguous_cost")
    assert tool.GRAMMAR == AMBIGUOUS[0] and tool.VOCAB == VOCAB
    assert tool.main(["--tokens", "4", "--every", "2", "--build", "python"]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [int(r[0]) for r in rows] == [1, 2, 4]
    assert all(float(r[1]) >= 0 for r in rows)
