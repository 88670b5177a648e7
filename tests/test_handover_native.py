"""The native host builds serve hand-over requests (``backend="auto"``): before the switch a
request's matcher runs its own Python methods; once handed over to xgrammar, the C++ build
drives the xgrammar matcher it forwards to (capgraph/build/native.py, SlotMatchers' watch in
capgraph/build/slots.py, HandOverMatcher.delegate in capgraph/grammar/handover.py).

The xgrammar compiles are held back and released at a chosen step (``HeldHandOver`` of
tests/test_handover.py); every step is compared row for row with the Python build.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
import torch  # noqa: E402

from capgraph import GuidedDecodingConfig, GuidedDecodingParams  # noqa: E402
from capgraph.build import library as native  # noqa: E402
from capgraph.build import make_native_build  # noqa: E402
from capgraph.build.native import xgrammar_factory  # noqa: E402
from capgraph.decoder import GuidedDecoder  # noqa: E402
from capgraph.grammar.handover import HandOverMatcher  # noqa: E402
from capgraph.requests import GuidedRequest  # noqa: E402
from capgraph.tokenizers import encode_continuation  # noqa: E402
from test_handover import TOKENIZER, HeldHandOver, cases  # noqa: E402

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"C++ host build unavailable: "
                                       f"{native.unavailable_reason()}")

BUILDS = ("python", "native-loop", "native")
K = 3  # max_num_draft_tokens


@pytest.fixture(scope="module")
def tok(tokenizer_cache):
    return tokenizer_cache(TOKENIZER)


@pytest.fixture(scope="module")
def sides(factory_cache):
    return factory_cache(TOKENIZER, "xgrammar"), factory_cache(TOKENIZER, "llguidance")


@pytest.fixture(scope="module")
def jobs(tok, sides):
    """Bundled schemas and regexes both backends take, with a token walk ending in EOS."""
    return cases(sides, tok)[:4]


def held(tok, sides) -> HeldHandOver:
    return HeldHandOver(GuidedDecodingConfig.from_tokenizer(tok, backend="auto"), *sides)


class EntryWatch:
    """Records, per build, whether the CPython entry of a ``"native"`` strategy took the batch
    (its ``step``/``begin`` returned a result) or declined it (None) -- read from the
    strategy's public :attr:`~capgraph.build.NativeBuild.entry`, whose calls it forwards."""

    def __init__(self, strategy) -> None:
        self.taken: list[bool] = []
        entry = strategy.entry

        def watched(call):
            def run(*args):
                result = call(*args)
                self.taken.append(result is not None)
                return result
            return run
        strategy.entry = entry._replace(step=watched(entry.step), begin=watched(entry.begin))


def counted_loop(fills: dict[int, int]):
    """A ``host_build`` callable: the native loop ("native-loop") whose C++ loop counts its
    fills per xgrammar FFI object (by address) in ``fills`` before calling xgrammar's."""
    def make(slots, factory, budget_ms):
        accept, fill, is_terminated = native.matcher_methods(
            xgrammar_factory(factory).ffi_matcher_type())

        def counted_fill(handle, bitmask, index, debug):
            address = handle.__chandle__()
            fills[address] = fills.get(address, 0) + 1
            return fill(handle, bitmask, index, debug)
        return make_native_build(slots, factory, budget_ms, entry=False,
                                 methods=(accept, counted_fill, is_terminated))
    return make


def _eager(factory, n, build):
    return GuidedDecoder(factory.config, n, K, factory=factory, host_build=build)


def _capturable(factory, n, build):
    from capgraph.capturable import CapturableGuidedDecoder
    return CapturableGuidedDecoder(factory.config, n, K, factory=factory, host_build=build)


def _step(dec, reqs, accepted, draft_len):
    """One target step on ``dec``; the rows' masked logits, its failures and its slot state.
    ``accepted``: per request, the drafts of this step the verification keeps (rolled back
    after the step: the capturable decoder's rollback_rejected_batch, or the eager decoder's
    rollback_rejected_tokens at its next add_batch, which reads num_accepted_draft_tokens)."""
    import hostfunc
    dec.add_batch(reqs, runtime_draft_len=draft_len)
    rows = dec.requests.num_bitmask_tokens
    logits = torch.zeros(rows, dec.vocab_size_padded)
    if type(dec) is GuidedDecoder:
        dec.rollback_rejected_tokens()
        failed = dec.execute(logits)
    else:
        dec.execute(logits)
        hostfunc.drain()
        failed = dec.take_failed_requests()
        dec.rollback_rejected_batch(torch.tensor([1 + a for a in accepted], dtype=torch.int32))
    return (sorted(failed), torch.isinf(logits), dec.token_mask_host[:rows].tolist(),
            list(dec.num_advanced_tokens), list(dec.num_guided_tokens),
            [m is not None and m.is_terminated() for m in dec.grammar_matchers],
            [getattr(m, "served_by", None) for m in dec.grammar_matchers])


def _plan(jobs, seed):
    """Per step, the requests' (slot, new token, drafts, drafts kept), teacher-forced through
    each job's tokens with random draft lengths and acceptances; the last step of a job feeds
    its EOS as the new token."""
    rng = random.Random(seed)
    pos = [0] * len(jobs)
    steps = []
    while any(p < len(tokens) for p, (_, tokens) in zip(pos, jobs)):
        step = []
        for slot, (_, tokens) in enumerate(jobs):
            p = pos[slot]
            if p >= len(tokens):
                continue
            drafts = tokens[p + 1:p + 1 + rng.randint(0, K)]
            kept = rng.randint(0, len(drafts))
            step.append((slot, tokens[p], drafts, kept))
            pos[slot] = p + 1 + kept
        steps.append(step)
    return steps


@pytest.mark.parametrize("make", [_eager, _capturable], ids=["eager", "capturable"])
def test_native_builds_equal_python_across_the_switch(tok, sides, jobs, make):
    """Teacher-forced over bundled schemas and regexes with drafts (random lengths, random
    acceptances rolled back), the xgrammar compiles released at step 3: the masked rows,
    failures, counters, termination and serving backend of the "native-loop" and "native"
    builds equal the Python build's at every step, before, at and after the switch. After
    it the slots' handles are the xgrammar delegates' FFI addresses and the CPython entry
    takes every batch (it declined every one before)."""
    factory = held(tok, sides)
    fills: dict[int, int] = {}
    decs = [make(factory, len(jobs), b) for b in ("python", counted_loop(fills), "native")]
    assert [d.host_build.name for d in decs] == list(BUILDS)
    watch = EntryWatch(decs[2].host_build)
    release, accepted = 3, [0] * len(jobs)
    guided_after = [0] * len(jobs)  # rows the Python build guided per slot after the switch
    try:
        for n, step in enumerate([None, *_plan(jobs, seed=7)]):
            if n == release:
                factory.release()
            if step is None:
                reqs = [GuidedRequest.context(10 + s, s, params)
                        for s, (params, _) in enumerate(jobs)]
                kept = [0] * len(jobs)
            else:
                reqs = [GuidedRequest.generation(10 + s, s, jobs[s][0], t, draft_tokens=d,
                                                 num_accepted_draft_tokens=accepted[s])
                        for s, t, d, _ in step]
                kept = [k for *_, k in step]
                for s, _, _, k in step:
                    accepted[s] = k
            results = [_step(d, reqs, kept, K) for d in decs]
            for build, got in zip(BUILDS[1:], results[1:]):
                for what, a, b in zip(("failed", "masked", "token mask", "advanced",
                                       "guided", "terminated", "served"), results[0], got):
                    assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b), \
                        f"step {n}, {build}: {what} differs"
            served = results[0][-1]
            assert set(served) == ({"llguidance"} if n < release else {"xgrammar"}), (n, served)
            if n >= release:  # the entry's per-slot handles: the delegates' FFI objects
                matchers = decs[2].grammar_matchers
                assert matchers.handles == [m.delegate.ffi_address for m in matchers]
            if n > release:
                present = {s for s, *_ in step}  # (a slot that sits a step out keeps
                # its last build's count, which that step did not guide again)
                guided_after = [a + (b if s in present else 0)
                                for s, (a, b) in enumerate(zip(guided_after, results[0][4]))]
        assert all(all(r[5]) for r in results), "every request ended terminated"
        # the native loop filled every row after the switching step in C++ (none before)
        assert fills == {m.delegate.ffi_address: g
                         for m, g in zip(decs[1].grammar_matchers, guided_after)}
        # the entry declined the context step and every step before the switch (an
        # llguidance matcher in the batch), the switching step too; it took every later one
        # the entry declined every call up to the switching step (an llguidance matcher in
        # the batch; a declined asynchronous begin is followed by a step, declined too) and
        # took the batch of every later step
        after = n - release
        assert watch.taken == [False] * (len(watch.taken) - after) + [True] * after
        assert len(watch.taken) > after > 5
    finally:
        for d in decs:
            d.close()


def test_drafting_loop_rolls_back_replayed_tokens_natively(tok, sides, jobs):
    """A drafting loop (draft requests, one token and one row each) across the switch: the
    compile lands after two draft steps, so the xgrammar matcher is replayed tokens the loop
    drafted on llguidance, and rollback_draft_tokens then rolls them back on xgrammar. Every
    step's rows and counters equal the Python build's, and the requests finish natively."""
    factory = held(tok, sides)
    decs = [_eager(factory, len(jobs), b) for b in BUILDS]
    pos = [0] * len(jobs)
    try:
        def compare(step_reqs, what, draft_len=0, rollback=True):
            results = []
            for dec in decs:
                dec.add_batch(step_reqs, runtime_draft_len=draft_len)
                if rollback:
                    dec.rollback_rejected_tokens()
                rows = dec.requests.num_bitmask_tokens
                logits = torch.zeros(rows, dec.vocab_size_padded)
                failed = dec.execute(logits)
                results.append((failed, torch.isinf(logits), list(dec.num_advanced_tokens),
                                list(dec.num_advanced_draft_tokens),
                                [m is not None and m.is_terminated()
                                 for m in dec.grammar_matchers]))
            for build, got in zip(BUILDS[1:], results[1:]):
                assert all(torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
                           for a, b in zip(results[0], got)), f"{what}: {build} differs"
            return results[0]

        compare([GuidedRequest.context(10 + s, s, p) for s, (p, _) in enumerate(jobs)],
                "context", rollback=False)
        loops = 0
        while any(p < len(t) for p, (_, t) in zip(pos, jobs)):
            live = [s for s, (_, t) in enumerate(jobs) if pos[s] < len(t)]
            # target step: the next committed token, no drafts
            compare([GuidedRequest.generation(10 + s, s, jobs[s][0], jobs[s][1][pos[s]])
                     for s in live], f"target {loops}")
            for s in live:
                pos[s] += 1
            live = [s for s in live if pos[s] < len(jobs[s][1])]
            if live and loops < 2:  # a drafting loop of three draft steps
                for d in range(3):
                    if loops == 1 and d == 2:
                        factory.release()  # lands inside the loop
                    reqs = [dataclasses.replace(GuidedRequest.generation(
                        10 + s, s, jobs[s][0], jobs[s][1][min(pos[s] + d, len(jobs[s][1]) - 2)]),
                        is_draft=True) for s in live]
                    compare(reqs, f"loop {loops} draft {d}", rollback=False)
                drafted = [dec.num_advanced_draft_tokens[s] for dec in decs for s in live]
                for dec in decs:
                    dec.rollback_draft_tokens()
                assert any(drafted)
            loops += 1
        for dec in decs:
            for m in dec.grammar_matchers:
                assert m.served_by == "xgrammar" and m.is_terminated()
                assert m.handover_position is not None and m.handover_position > 2
    finally:
        for d in decs:
            d.close()


@pytest.mark.parametrize("refusal", ["replay", "compile"])
def test_a_request_left_on_llguidance_keeps_working_natively(tok, sides, refusal):
    """A request that stays on llguidance (xgrammar refuses its replay, or fails to compile)
    beside one that is handed over: under the native strategies it keeps its own Python
    methods (its slot's handle stays False, so the CPython entry declines the batch) and every
    row equals the Python build's; its reason is recorded."""
    factory = held(tok, sides)
    stays = GuidedDecodingParams.regex(r"[a-z]+")
    moves = GuidedDecodingParams.regex(r"(\d{3}-){2}\d{4}")
    # xgrammar reads the guide otherwise and refuses a replayed token, or fails to compile it
    factory.substitute[stays.guide] = GuidedDecodingParams.regex(
        r"[a-z]{1,2}" if refusal == "replay" else r"[a-z")
    walks = [encode_continuation(tok, "abcdefghijkl") + [tok.eos_token_id],
             encode_continuation(tok, "555-123-4567") + [tok.eos_token_id]]
    decs = [_eager(factory, 2, b) for b in BUILDS]
    try:
        for n in range(max(map(len, walks)) + 1):
            if n == 3:
                factory.release()
            reqs = [GuidedRequest.context(10 + s, s, p) if n == 0 else
                    GuidedRequest.generation(10 + s, s, p, walks[s][n - 1])
                    for s, p in enumerate((stays, moves)) if n <= len(walks[s])]
            out = []
            for dec in decs:
                dec.add_batch(reqs)
                logits = torch.zeros(dec.requests.num_bitmask_tokens, dec.vocab_size_padded)
                out.append((dec.execute(logits), torch.isinf(logits)))
            assert out[0][0] == [] and all(o[0] == out[0][0] and torch.equal(o[1], out[0][1])
                                           for o in out[1:]), n
        for dec in decs:
            first, second = dec.grammar_matchers
            assert first.served_by == "llguidance" and first.handover_failed_reason
            assert second.served_by == "xgrammar"
            assert first.is_terminated() and second.is_terminated()
        handles = decs[2].grammar_matchers.handles  # ("native": the CPython entry's)
        assert handles[0] is False and handles[1] == decs[2].grammar_matchers[1].delegate.ffi_address
    finally:
        for d in decs:
            d.close()


def test_auto_backend_takes_the_native_build(tok, sides):
    """backend='auto' with fill_threads=1: the native strategies are built over the hand-over
    factory's xgrammar side, and host_build='auto' chooses the CPython entry ("native")."""
    factory = held(tok, sides)
    assert xgrammar_factory(factory) is sides[0]
    dec = GuidedDecoder(factory.config, 2, 0, factory=factory)
    try:
        assert dec.host_build.name == "native" and dec.native_build
    finally:
        dec.close()


def test_termination_reached_in_cpp_after_the_switch_is_seen(tok, sides):
    """After the switch the CPython entry feeds the EOS (as a draft, then as the new token):
    the hand-over matcher's is_terminated() says so at once (its sync_state re-read the
    xgrammar matcher the C++ advanced), a rollback of the draft undoes it, and the request
    finishes terminated on xgrammar."""
    factory = held(tok, sides)
    params = GuidedDecodingParams.regex(r"(\d{3}-){2}\d{4}")
    tokens = encode_continuation(tok, "555-123-4567")
    eos = tok.eos_token_id
    dec = GuidedDecoder(factory.config, 1, 1, factory=factory, host_build="native")
    watch = EntryWatch(dec.host_build)
    try:
        dec.add_batch([GuidedRequest.context(1, 0, params)])
        assert dec.build() == []
        factory.release()
        dec.add_batch([GuidedRequest.generation(1, 0, params, tokens[0])])
        assert dec.build() == []  # (the switch: Python fills, the entry declined)
        matcher = dec.grammar_matchers[0]
        assert isinstance(matcher, HandOverMatcher) and matcher.served_by == "xgrammar"
        for t in tokens[1:-1]:
            dec.add_batch([GuidedRequest.generation(1, 0, params, t)])
            assert dec.build() == []
        assert not matcher.is_terminated()
        dec.add_batch([GuidedRequest.generation(1, 0, params, tokens[-1], draft_tokens=[eos])])
        dec.rollback_rejected_tokens()
        assert dec.build() == [] and list(dec.num_advanced_tokens) == [2]
        assert matcher.is_terminated()  # the EOS draft, accepted in C++
        dec.add_batch([GuidedRequest.generation(1, 0, params, eos, num_accepted_draft_tokens=0)])
        dec.rollback_rejected_tokens()  # drops the EOS draft
        assert not matcher.is_terminated()
        assert dec.build() == [] and matcher.is_terminated()  # the EOS as the new token
        assert watch.taken == [False, False] + [True] * len(tokens)  # context, switch: Python
    finally:
        dec.close()


def test_a_slot_is_refreshed_only_by_the_matcher_it_holds(tok, sides):
    """The slot tracking hears of a hand-over from the matcher that settled: a matcher moved
    out of its slot before its switch leaves that slot's handle alone, the one still in a
    slot gets its delegate's address, and a matcher dropped from its slot before its switch
    is freed at once (the tracking keeps no reference to it, so its compile is given up)."""
    import gc
    import weakref

    factory = held(tok, sides)
    params = GuidedDecodingParams.regex(r"[a-z]{3}-\d+")
    dec = GuidedDecoder(factory.config, 3, 0, factory=factory, host_build="native")
    try:
        dec.add_batch([GuidedRequest.context(1, 0, params), GuidedRequest.context(2, 1, params),
                       GuidedRequest.context(3, 2, params)])
        assert dec.build() == []
        matchers = dec.grammar_matchers
        moved, kept, dropped = matchers[0], matchers[1], weakref.ref(matchers[2])
        assert matchers.handles == [False, False, False]
        gc.disable()  # (freed by reference counting, not by a collection)
        try:
            matchers[0] = None
            matchers[2] = None
            assert dropped() is None
        finally:
            gc.enable()
        factory.release()
        row = torch.zeros(1, dec.bitmask_host.shape[1], dtype=torch.int32)
        moved.fill_next_token_bitmask(row, 0)
        kept.fill_next_token_bitmask(row, 0)
        assert moved.served_by == kept.served_by == "xgrammar"
        assert matchers.handles == [None, kept.delegate.ffi_address, None]
    finally:
        dec.close()
