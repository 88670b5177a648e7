"""The native build's fill threads (csrc/builder.cc, FillPool; GuidedDecodingConfig.
native_fill_threads): a step's requests split across a pool of threads give the same rows,
masks, counters and outcomes as one thread, in both native strategies; the pool never needs
the GIL, is ended by close(), restarted by a later step and by a forked child; its
configuration is validated."""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import random
import signal
import threading
import time

import pytest
import torch

from capgraph import ConfigError, GuidedDecodingConfig, GuidedDecodingParams, GuideType
from capgraph.build import library as native
from capgraph.build import make_native_build
from capgraph.build.native import xgrammar_factory
from capgraph.decoder import GuidedDecoder
from capgraph.grammar import create_matcher_factory
from capgraph.requests import GuidedRequest
from conftest import assert_steps_agree, spend_cpu, threads_named

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"C++ host build unavailable: "
                                       f"{native.unavailable_reason()}")

VOCAB = ["a", "b", "</s>", "ab", "c", "d"]
STOP = 2
C = 4  # "c": the faulty slots' accept raises on it
# 'a' 'x' dead-ends after 'a' (no token spells 'x'); "b"+ may stop
DEAD = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= "a" "x" | "b" "a" "x" | "b"+')
ALIVE = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= ("a" | "b")+')
SHORT = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= "a" "b"?')
BUDGET_MS = 40.0
SLOW_S = 0.12  # a slow slot's fill: 3x the budget in CPU time; a healthy request: microseconds
THREADS = 4


@pytest.fixture(scope="module")
def tiny():
    """xgrammar on a 6-token raw vocabulary padded to 64 ids (the padding ids exercise the
    tail clear), host-step budget 40 ms."""
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[STOP],
                                  vocab_size_padded=64, native_build="on",
                                  host_step_budget_ms=BUDGET_MS)
    factory = create_matcher_factory(config)
    yield factory
    factory.close()


@pytest.fixture(scope="module")
def tekken():
    """Tekken (131072 tokens), an xgrammar factory over it, and the bundled JSON schemas'
    guides with valid texts for 256 requests (the build benchmark's hotel schema for even
    requests, the tool-call schema for odd ones)."""
    from capgraph.bench.build import SCHEMA, instance
    from capgraph.bench.spec import compact, tool_calls
    from capgraph.demo import bundled_schema
    from capgraph.tokenizers import encode_continuation, load_tokenizer

    tok = load_tokenizer("tekken")
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok, native_build="on"))
    hotel = GuidedDecodingParams.json_schema(json.dumps(SCHEMA))
    tool = GuidedDecodingParams.json_schema(json.dumps(bundled_schema()))
    calls = tool_calls()
    guides = [hotel if i % 2 == 0 else tool for i in range(256)]
    texts = [encode_continuation(tok, instance(i)) if i % 2 == 0 else
             encode_continuation(tok, compact(calls[i % len(calls)])) for i in range(256)]
    yield tok, factory, guides, texts
    factory.close()


def fill_threads() -> set[str]:
    """Ids of this process's threads named as the fill pool's, ``capgraph-fill``."""
    return threads_named("capgraph-fill")


class SlotFaults:
    """The matcher methods a native build's C++ loop calls (``make_native_build(methods=)``):
    xgrammar's own, except that on the slots in ``bad_accept`` accepting "c" raises, on the
    slots in ``bad_fill`` a step's second fill raises (after one row was filled), and on the
    slots in ``slow`` every fill spends ``spend_s`` (default ``SLOW_S``) of CPU time first (on
    those also in ``slow_sleeps``: sleeps ``sleep_s``, default ``SLOW_S``). A matcher's slot
    is looked up by its FFI address (:meth:`track`, once per step); messages name the slot,
    so a message handed to the wrong request shows. Every call goes through Python here, so the pool's threads
    take the GIL in these tests (the caller has released it)."""

    def __init__(self) -> None:
        self.bad_accept: set[int] = set()
        self.bad_fill: set[int] = set()
        self.slow: set[int] = set()
        self.slow_sleeps: set[int] = set()
        self.spend_s = self.sleep_s = SLOW_S
        self.slot_of: dict[int, int] = {}
        self.fills: dict[int, int] = {}  # this step's fills per slot
        self._held: list = []  # every tracked matcher: no later one reuses its address

    def track(self, dec: GuidedDecoder) -> None:
        self.fills.clear()
        for slot, m in enumerate(dec.grammar_matchers):
            if m is not None:
                self.slot_of[m.ffi_address] = slot
                self._held.append(m)

    def methods(self, factory) -> tuple:
        accept, fill, is_terminated = native.matcher_methods(
            xgrammar_factory(factory).ffi_matcher_type())

        def accept_token(handle, token, debug):
            slot = self.slot_of.get(handle.__chandle__())
            if slot in self.bad_accept and token == C:
                raise RuntimeError(f"flaky accept at slot {slot}")
            return accept(handle, token, debug)

        def fill_next_token_bitmask(handle, bitmask, index, debug):
            slot = self.slot_of.get(handle.__chandle__())
            if slot in self.bad_fill:
                self.fills[slot] = self.fills.get(slot, 0) + 1
                if self.fills[slot] == 2:
                    raise RuntimeError(f"flaky fill at slot {slot}, row {index}")
            if slot in self.slow:
                if slot in self.slow_sleeps:
                    time.sleep(self.sleep_s)
                else:
                    spend_cpu(self.spend_s)
            return fill(handle, bitmask, index, debug)

        return accept_token, fill_next_token_bitmask, is_terminated

    def host_build(self, entry: bool, threads: int, min_requests: int = 1):
        """A ``host_build`` callable: the native strategy (``entry``) or the native loop,
        filling on ``threads`` threads from ``min_requests`` requests on, every such step."""

        def make(slots, factory, budget_ms):
            build = make_native_build(slots, factory, budget_ms, entry=entry,
                                      methods=self.methods(factory))
            build.builder.set_fill_threads(threads, min_requests, adaptive=False)
            return build
        return make


def _normalized(failed: list) -> list:
    """Failures with an over-budget message reduced to its kind (it carries the ms measured)."""
    return sorted((rid, "BudgetExceededError" if "BudgetExceededError" in msg else msg)
                  for rid, msg in failed)


def _run_step(dec: GuidedDecoder, faults: SlotFaults, step: list, draft_len: int) -> tuple:
    """One step (add_batch, rollback of rejected drafts, execute on zero logits): what it
    left -- failures, token mask, masked bitmask rows, counters, draft termination, dropped
    and terminated matchers -- and how its requests ran."""
    dec.add_batch(step, runtime_draft_len=draft_len)
    dec.rollback_rejected_tokens()
    faults.track(dec)
    rows = dec.requests.num_bitmask_tokens
    logits = torch.zeros(rows, dec.vocab_size_padded)
    failed = dec.execute(logits)
    tm = dec.token_mask_host[:rows].clone()
    state = (_normalized(failed), tm.tolist(), dec.bitmask_host[:rows][tm.bool()].clone(),
             logits.isfinite().tolist(), list(dec.num_advanced_tokens),
             list(dec.num_guided_tokens), list(dec.is_draft_terminated),
             [m is None for m in dec.grammar_matchers],
             [m is not None and m.is_terminated() for m in dec.grammar_matchers])
    return state, dec.host_build.builder.last_step()


def _assert_same(states: list[tuple], where: str) -> None:
    first = states[0]
    for k, other in enumerate(states[1:], 1):
        assert first[:2] == other[:2] and first[3:] == other[3:], f"{where}: decoder {k}"
        assert torch.equal(first[2], other[2]), f"{where}: decoder {k} bitmask rows"


class _Steps:
    """Seeded steps for ``slots`` slots: a context step for every slot, then generation steps
    with random tokens -- mostly ones the grammar takes, some rejected, stop and dead-end
    ones -- and drafts; every third step re-initialises the slots whose matcher is gone (the
    strategies then take their native-loop path) and may put an unguided request between
    guided ones. ``aimed`` gives the named slots the token and drafts of the test's choice."""

    def __init__(self, rng: random.Random, slots: int, drafts: int) -> None:
        self.rng, self.slots, self.drafts = rng, slots, drafts
        self.guides = [ALIVE if s < 2 else rng.choices([ALIVE, DEAD, SHORT], [6, 2, 2])[0]
                       for s in range(slots)]

    def first(self) -> list:
        return [GuidedRequest.context(10 + s, s, self.guides[s]) for s in range(self.slots)]

    def next(self, n: int, ref: GuidedDecoder, aimed: dict[int, tuple]) -> list:
        rng, step = self.rng, []
        tokens = [0, 1, 3, 0, 1, 3, STOP, C]
        for s in range(self.slots):
            if ref.grammar_matchers[s] is None:
                if n % 3 == 0:
                    step.append(GuidedRequest.context(10 + s, s, self.guides[s]))
                continue
            if s in aimed:
                token, drafts = aimed[s]
                step.append(GuidedRequest.generation(10 + s, s, self.guides[s], token,
                                                     draft_tokens=drafts))
                continue
            step.append(GuidedRequest.generation(
                10 + s, s, self.guides[s], rng.choice(tokens),
                draft_tokens=[rng.choice(tokens) for _ in range(rng.randint(0, self.drafts))],
                num_accepted_draft_tokens=rng.randint(0, self.drafts)))
        if n % 3 == 0 and rng.random() < 0.5:
            step.insert(rng.randint(0, len(step)), GuidedRequest.placeholder(99999, 0))
        return step

    def alive(self, ref: GuidedDecoder, count: int) -> list[int]:
        """Up to ``count`` slots whose matcher takes "a" now (ALIVE, not terminated)."""
        ok = [s for s, m in enumerate(ref.grammar_matchers)
              if m is not None and self.guides[s] is ALIVE and not m.is_terminated()]
        return self.rng.sample(ok, min(count, len(ok)))


@pytest.mark.parametrize("batch", [1, 2, 7, 33, 256])
def test_pool_gives_the_one_thread_results(tiny, batch):
    """Over steps of ``batch`` requests -- drafts, rejected, stop and dead-end tokens,
    terminated matchers, re-initialised slots, unguided rows, faults in accept and fill on
    several slots (messages naming the slot), and requests over the host-step budget -- both
    native strategies (the CPython entry and the native loop) leave the same failures, token
    masks, bitmask rows, logits, counters, draft termination and matchers with 4 fill threads
    as with one; and the pool's threads did run requests (batch >= 2)."""
    rng = random.Random(batch)
    drafts = 3
    faults = [SlotFaults() for _ in range(4)]
    decs = []
    for k, (entry, threads) in enumerate([(True, 1), (True, THREADS), (False, 1),
                                          (False, THREADS)]):
        decs.append(GuidedDecoder(tiny.config, batch + 1, drafts, factory=tiny,
                                  host_build=faults[k].host_build(entry, threads)))
    assert [d.host_build.name for d in decs] == ["native", "native", "native-loop",
                                                 "native-loop"]
    pooled = [0] * len(decs)
    kinds: set[str] = set()  # of the failures met (the same in every decoder)
    steps = _Steps(rng, batch, drafts)
    step, draft_len = steps.first(), 0
    slow_rounds = 2
    for n in range(1, 10):
        results = [_run_step(dec, f, step, draft_len) for dec, f in zip(decs, faults)]
        _assert_same([state for state, _ in results], f"batch {batch}, step {n}")
        kinds |= {msg.split(":")[0] + (" " + " ".join(msg.split()[1:3]) if "flaky" in msg
                                       else "") for _, msg in results[0][0][0]}
        for k, (_, stats) in enumerate(results):
            assert stats.threads <= (THREADS if k % 2 else 1)
            pooled[k] += stats.pool_requests
        # the next step: faulty slots raise (step 2), slow slots fill (twice, from step 4)
        aimed: dict[int, tuple] = {}
        bad_accept: set[int] = set()
        bad_fill: set[int] = set()
        slow: set[int] = set()
        if n == 1:
            faulty = steps.alive(decs[0], max(2, batch // 8))
            bad_accept, bad_fill = set(faulty[::2]), set(faulty[1::2])
            aimed = {s: (C, []) if s in bad_accept else (0, [0, 0]) for s in faulty}
            draft_len = drafts
        else:
            draft_len = rng.randint(0, drafts)
            if n >= 3 and slow_rounds:
                slow = set(steps.alive(decs[0], 2))
                aimed = {s: (0, []) for s in slow}
                slow_rounds -= bool(slow)
        for f in faults:
            f.bad_accept, f.bad_fill, f.slow = bad_accept, bad_fill, slow
        step = steps.next(n, decs[0], aimed)
    for dec in decs:
        dec.close()
    assert pooled[0] == pooled[2] == 0
    # (the steps are seeded: each kind below is met, in the same request, in every decoder)
    assert {"RuntimeError flaky accept", "BudgetExceededError"} <= kinds, kinds
    if batch >= 2:
        assert "RuntimeError flaky fill" in kinds, kinds
    if batch >= 7:  # (slots 0 and 1 are ALIVE: a smaller batch may meet neither)
        assert {"RequestError", "DeadEndError"} <= kinds, kinds
    if batch >= 2:
        assert pooled[1] > 0 and pooled[3] > 0, pooled


def test_pool_gives_the_one_thread_results_on_tekken_json(tekken):
    """Tekken (131072 tokens) and the bundled JSON schemas, 256 requests with two drafts each
    (right ones, and for every third request a wrong one): 1 and 4 fill threads leave the
    same bitmask rows, token masks, counters and failures step after step, and the pool's
    threads ran requests."""
    tok, factory, guides, texts = tekken
    batch, drafts = 256, 2
    decs = [GuidedDecoder(dataclasses.replace(factory.config, native_fill_threads=t), batch,
                          drafts, factory=factory, host_build="native") for t in (1, 4)]
    decs[1].host_build.builder.set_fill_threads(4, 1, adaptive=False)
    pooled = 0
    try:
        for dec in decs:
            dec.add_batch([GuidedRequest.context(i, i, g) for i, g in enumerate(guides)])
            assert dec.build() == []
        pos = [0] * batch
        for step in range(5):
            reqs = []
            for i, t in enumerate(texts):
                p = pos[i]
                d = t[p + 1:p + 1 + drafts]
                if i % 3 == 0 and d:
                    d = [d[0], tok.eos_token_id]  # the second draft leaves the grammar
                reqs.append(GuidedRequest.generation(i, i, guides[i], t[p], draft_tokens=d,
                                                     num_accepted_draft_tokens=0))
                pos[i] += 1
            failed, token_mask = assert_steps_agree(decs, reqs, drafts)[:2]
            pooled += decs[1].host_build.builder.last_step().pool_requests
            assert failed == [] and sum(token_mask) >= batch, f"step {step}"
            for dec in decs:
                dec.rollback_rejected_tokens()  # (drafts are rolled back: next step restarts)
    finally:
        for dec in decs:
            dec.close()
        factory.close()
    assert pooled > 0


def _sleeping_holder(go: list, seconds: float, times: dict) -> None:
    """Once ``go[0]`` is set (waiting for it in Python, so that this thread is already asking
    for the GIL when the step releases it): hold the GIL for ``seconds`` (libc usleep through
    ctypes.PyDLL, which keeps it)."""
    libc = ctypes.PyDLL(None)
    while not go[0]:
        pass
    times["t0"] = time.monotonic_ns()
    libc.usleep(int(seconds * 1e6))
    times["t1"] = time.monotonic_ns()


def test_pool_fills_while_another_thread_holds_the_gil(tekken):
    """While another thread holds the GIL (a 1.5 s libc usleep called through ctypes.PyDLL),
    a step of 256 JSON-schema requests on Tekken (15 drafts each: about 4000 fills, several
    ms) split across the calling thread and a pool thread runs to its end: the step, pool
    thread included, ends (its native end time) inside the window, with most of it run
    there. The holder waits for the GIL while the step starts, so it takes it where the step
    releases it (two fill threads leave it a core to run on at once here); the step's
    requests call xgrammar's own methods, which never take the GIL."""
    _, factory, guides, texts = tekken
    batch, drafts = 256, 15
    guides, texts = [guides[0]] * batch, texts[0::2] * 2  # (the hotel schema: long texts)
    dec = GuidedDecoder(dataclasses.replace(factory.config, native_fill_threads=2,
                                            host_step_budget_ms=None), batch, drafts,
                        factory=factory, host_build="native")
    builder = dec.host_build.builder
    builder.set_fill_threads(2, 1, adaptive=False)
    try:
        dec.add_batch([GuidedRequest.context(i, i, g) for i, g in enumerate(guides)])
        assert dec.build() == []
        for attempt in range(8):  # the holder must take the GIL while the step runs
            p = 16 * attempt  # (every draft is accepted: the next step starts 16 tokens on)
            dec.add_batch([GuidedRequest.generation(i, i, guides[i], t[p],
                                                    draft_tokens=t[p + 1:p + 16],
                                                    num_accepted_draft_tokens=drafts)
                           for i, t in enumerate(texts)])
            times: dict = {}
            go = [False]
            holder = threading.Thread(target=_sleeping_holder, args=(go, 1.5, times))
            holder.start()
            go[0] = True
            failed = dec.build()  # (its GIL-free part runs while the holder sleeps)
            holder.join()
            stats = builder.last_step()
            assert failed == [] and stats.threads >= 1
            t0, t1 = times["t0"], times["t1"]
            inside = stats.end_ns - max(stats.start_ns, t0)
            if stats.start_ns < t1 and stats.threads > 1 and stats.pool_requests and \
                    inside > (stats.end_ns - stats.start_ns) / 2:
                break  # (else the holder slept before the step, or at its very end)
        else:
            pytest.fail("in 8 attempts the GIL holder never overlapped a pooled step")
        assert t0 < stats.end_ns < t1, "the pool waited for the GIL"
    finally:
        dec.close()


def test_close_joins_the_pool_and_a_later_step_starts_it_again(tiny):
    """The pool's threads (named capgraph-fill) start with the first step that uses them,
    stay parked between steps, end with close(); a later step starts new ones; the
    decoder's close() ends them for good."""
    before = fill_threads()
    dec = GuidedDecoder(dataclasses.replace(tiny.config, native_fill_threads=3), 16, 0,
                        factory=tiny, host_build="native")
    builder = dec.host_build.builder
    builder.set_fill_threads(3, 1, adaptive=False)
    assert not fill_threads() - before  # started on first use, not at construction
    dec.add_batch([GuidedRequest.context(i, i, ALIVE) for i in range(16)])
    assert dec.build() == []
    started = fill_threads() - before
    assert len(started) == 2  # (the caller is the third)
    dec.add_batch([GuidedRequest.generation(i, i, ALIVE, 0) for i in range(16)])
    assert dec.build() == []
    assert fill_threads() - before == started  # parked, reused
    builder.close()
    assert not started & fill_threads()
    dec.add_batch([GuidedRequest.generation(i, i, ALIVE, 1) for i in range(16)])
    assert dec.build() == [] and dec.num_advanced_tokens[0] == 1
    again = fill_threads() - before
    assert len(again) == 2 and not again & started
    dec.close()
    assert not again & fill_threads()


def test_forked_child_starts_its_own_pool(tiny):
    """A child forked after the parent's pool started has none of its threads: its pooled
    steps start a pool of its own and give the right counts, and closing there neither joins
    nor touches the parent's threads (which would hang); the parent's pool goes on."""
    dec = GuidedDecoder(dataclasses.replace(tiny.config, native_fill_threads=3), 8, 0,
                        factory=tiny, host_build="native")
    dec.host_build.builder.set_fill_threads(3, 1, adaptive=False)
    dec.add_batch([GuidedRequest.context(i, i, ALIVE) for i in range(8)])
    assert dec.build() == []
    parent_threads = fill_threads()
    assert parent_threads
    pid = os.fork()
    if pid == 0:  # the child: report through the exit code only
        signal.alarm(20)  # a hang ends the child with SIGALRM
        try:
            dec.add_batch([GuidedRequest.generation(i, i, ALIVE, 0) for i in range(8)])
            ok = dec.build() == [] and dec.num_advanced_tokens == [1] * 8
            ok = ok and dec.host_build.builder.last_step().threads >= 1
            ok = ok and len(fill_threads()) == 2  # its own, not the parent's
            dec.close()
            ok = ok and not fill_threads()
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
    assert fill_threads() >= parent_threads
    dec.add_batch([GuidedRequest.generation(i, i, ALIVE, 1) for i in range(8)])
    assert dec.build() == [] and dec.num_advanced_tokens == [1] * 8
    dec.close()


def test_a_step_sharing_a_matcher_or_a_row_runs_on_one_thread(tiny):
    """The tvm-ffi step splits its requests only when no two share a matcher or a bitmask
    row: over 20 steps of 32 requests, distinct ones run on the pool's threads at least once,
    while the same requests with one matcher handed in twice, or with two overlapping row
    ranges, run in order on the calling thread every time (the one-thread result). The calling
    thread's fills sleep 1 ms, so that on a loaded machine it cannot run a whole step before
    the pool's threads wake."""
    n = 32
    dec = GuidedDecoder(tiny.config, 2 * n, 1, factory=tiny,
                        host_build=_SleepyOn("caller").host_build(4))
    builder = dec.host_build.builder
    builder.set_fill_threads(4, 1, adaptive=False)
    try:
        handles = tiny.native_handles([tiny.create(ALIVE) for _ in range(n)])
        rows = 4 * n
        builder.step(handles, [-1] * n, list(range(n)), [], [], 0, rows)  # (fills only)
        assert builder.out[:n, 0].tolist() == [0] * n
        shared = handles[:-1] + handles[:1]  # the first matcher twice
        cases = {"distinct": (handles, list(range(n)), [], [], 0),
                 "shared": (shared, list(range(n)), [], [], 0),
                 # request k: rows 2k and 2k+1, except that request 1 starts on row 1
                 "overlap": (handles, [0, 1] + [2 * k for k in range(2, n)], [1] * n,
                             [k % 2 for k in range(n)], 1)}
        pooled = {name: 0 for name in cases}
        for step in range(20):
            for name, (ms, offsets, num_drafts, drafts, draft_len) in cases.items():
                builder.step(ms, [step % 2] * n, offsets, num_drafts, drafts, draft_len, rows)
                assert builder.out[:n, 0].tolist() == [0] * n, name  # (ALIVE takes a and b)
                pooled[name] += builder.last_step().threads > 1
        assert pooled["distinct"] > 0 and pooled["shared"] == pooled["overlap"] == 0, pooled
    finally:
        dec.close()


def test_small_steps_fill_on_the_calling_thread(tiny):
    """Below pool_min_requests a step runs on the calling thread alone (the pool is not even
    started); from it on, on the pool's threads too. The defaults: POOL_MIN_REQUESTS and
    native_fill_threads=0, automatic (min(cores, 8))."""
    before = fill_threads()
    dec = GuidedDecoder(dataclasses.replace(tiny.config, native_fill_threads=0), 64, 0,
                        factory=tiny, host_build="native")
    builder = dec.host_build.builder
    assert builder.fill_threads == native.automatic_fill_threads()
    assert builder.pool_min_requests == native.POOL_MIN_REQUESTS
    builder.set_fill_threads(2, 16)
    try:
        dec.add_batch([GuidedRequest.context(i, i, ALIVE) for i in range(15)])
        assert dec.build() == []
        assert builder.last_step().threads == 1 and not fill_threads() - before
        dec.add_batch([GuidedRequest.context(i, i, ALIVE) for i in range(15, 64)])
        assert dec.build() == []
        assert len(fill_threads() - before) == 1
    finally:
        dec.close()


@pytest.mark.parametrize("sleeps", [True, False])
def test_a_pool_thread_counts_cpu_time_against_the_budget(tiny, sleeps):
    """On the pool's threads, as on the calling thread, a request goes over the host-step
    budget by the CPU time its thread spends on it: 8 requests whose every fill sleeps 3x the
    budget (off the CPU, as a preempted thread is) are all served on 4 threads; 8 whose fills
    spend that much CPU all fail with BudgetExceededError, their rows unmasked."""
    faults = SlotFaults()
    dec = GuidedDecoder(tiny.config, 8, 0, factory=tiny,
                        host_build=faults.host_build(True, THREADS))
    try:
        dec.add_batch([GuidedRequest.context(i, i, ALIVE) for i in range(8)])
        assert dec.execute(torch.zeros(8, dec.vocab_size_padded)) == []
        faults.slow = set(range(8))
        faults.slow_sleeps = faults.slow if sleeps else set()
        faults.track(dec)
        dec.add_batch([GuidedRequest.generation(i, i, ALIVE, 0) for i in range(8)])
        logits = torch.zeros(8, dec.vocab_size_padded)
        failed = dec.execute(logits)
        assert dec.host_build.builder.last_step().threads > 1
    finally:
        dec.close()
    if sleeps:
        assert failed == [] and not logits.isfinite().all(dim=1).any()
    else:
        assert _normalized(failed) == [(i, "BudgetExceededError") for i in range(8)]
        assert logits.isfinite().all()


def test_a_request_after_one_that_waited_is_judged_by_its_own_cpu_time(tiny):
    """On one thread, a request that sleeps 0.9x the budget and then one that spends 1.5x the
    budget of CPU: the first is served, the second fails (the CPU clock is read again after a
    request that took over a quarter of the budget, so the wait before it does not hide its
    CPU time); the same after a request that sleeps 3x the budget (a wall-time overrun)."""
    for sleep_budgets in (0.9, 3.0):
        faults = SlotFaults()
        dec = GuidedDecoder(tiny.config, 2, 0, factory=tiny,
                            host_build=faults.host_build(True, 1))
        try:
            dec.add_batch([GuidedRequest.context(i, i, ALIVE) for i in range(2)])
            assert dec.execute(torch.zeros(2, dec.vocab_size_padded)) == []
            faults.slow, faults.slow_sleeps = {0, 1}, {0}
            faults.sleep_s = sleep_budgets * BUDGET_MS / 1e3
            faults.spend_s = 1.5 * BUDGET_MS / 1e3
            faults.track(dec)
            dec.add_batch([GuidedRequest.generation(i, i, ALIVE, 0) for i in range(2)])
            failed = dec.execute(torch.zeros(2, dec.vocab_size_padded))
        finally:
            dec.close()
        assert _normalized(failed) == [(1, "BudgetExceededError")], sleep_budgets


class _SleepyOn:
    """xgrammar's methods, except that every fill on the ``side`` given -- the thread that
    made this object ("caller") or any other ("pool") -- sleeps 1 ms first."""

    def __init__(self, side: str) -> None:
        self.side, self.caller = side, threading.get_ident()

    def host_build(self, threads: int):
        def make(slots, factory, budget_ms):
            accept, fill, is_terminated = native.matcher_methods(
                xgrammar_factory(factory).ffi_matcher_type())

            def slow_fill(handle, bitmask, index, debug):
                if (threading.get_ident() == self.caller) == (self.side == "caller"):
                    time.sleep(0.001)
                return fill(handle, bitmask, index, debug)

            build = make_native_build(slots, factory, budget_ms,
                                      methods=(accept, slow_fill, is_terminated))
            build.builder.set_fill_threads(threads, 1)  # (adaptive: the default)
            return build
        return make


@pytest.mark.parametrize("slow", ["pool", "caller"])
def test_adaptive_choice_runs_the_faster_side(tiny, slow):
    """By default a step that may use the pool runs where it has been faster per request:
    when the pool's threads are slow (their fills sleep 1 ms, the calling thread's do not),
    40 steps of 24 requests run on the calling thread alone but for the pool's first three (the
    one that starts its threads, two that seed its average) and a probe or two; when the calling thread is slow, all but a few probes run on the pool (asserted as
    fewer / more than half, which a stalled first measurement still meets)."""
    batch, steps = 24, 40
    config = dataclasses.replace(tiny.config, host_step_budget_ms=None)
    dec = GuidedDecoder(config, batch, 0, factory=tiny,
                        host_build=_SleepyOn(slow).host_build(THREADS))
    builder = dec.host_build.builder
    pooled = 0
    try:
        dec.add_batch([GuidedRequest.context(i, i, ALIVE) for i in range(batch)])
        assert dec.build() == []
        pooled += builder.last_step().threads > 1
        for n in range(steps - 1):
            dec.add_batch([GuidedRequest.generation(i, i, ALIVE, n % 2) for i in range(batch)])
            assert dec.build() == []
            pooled += builder.last_step().threads > 1
    finally:
        dec.close()
    # (a stall of the one step that first measures a side can make it look slower until its
    # next probe, kProbeMin = 16 steps later: fewer than half the steps on either side)
    if slow == "pool":
        assert pooled < steps // 2, f"{pooled} of {steps} steps on a slow pool"
    else:
        assert pooled > steps // 2, f"{pooled} of {steps} steps on a fast pool"


def test_each_side_warms_up_before_the_choice_and_the_pool_start_is_not_counted(tiny):
    """Starting the pool's threads is paid once, by the first step that uses the pool, and
    each side's first steps pay one-time costs: the step that starts the threads is not
    recorded, and each side then runs two steps in a row (the pool's first) whose times only
    seed its average, before the faster side takes the steps (here the pool: the calling
    thread's fills sleep 1 ms, so the pool's threads join every pooled step)."""
    batch = 24
    config = dataclasses.replace(tiny.config, host_step_budget_ms=None)
    dec = GuidedDecoder(config, batch, 0, factory=tiny,
                        host_build=_SleepyOn("caller").host_build(THREADS))
    builder = dec.host_build.builder
    on_pool = []
    try:
        dec.add_batch([GuidedRequest.context(i, i, ALIVE) for i in range(batch)])
        assert dec.build() == []
        on_pool.append(builder.last_step().threads > 1)
        for n in range(7):
            dec.add_batch([GuidedRequest.generation(i, i, ALIVE, n % 2) for i in range(batch)])
            assert dec.build() == []
            on_pool.append(builder.last_step().threads > 1)
    finally:
        dec.close()
    # the start (not recorded), two pool warm-up steps, two alone, then the faster side
    assert on_pool == [True, True, True, False, False, True, True, True], on_pool


def test_automatic_fill_threads():
    """native_fill_threads=0 stands for min(cores, 8), and 1 thread on one core."""
    assert native.automatic_fill_threads(1) == 1
    assert native.automatic_fill_threads(2) == 2
    assert native.automatic_fill_threads(16) == native.MAX_AUTO_FILL_THREADS == 8
    assert 1 <= native.automatic_fill_threads() <= 8


@pytest.mark.parametrize("value", ["2", 2.0, True, -1, 257, None])
def test_native_fill_threads_is_validated(tiny, value):
    """GuidedDecodingConfig.native_fill_threads takes an int in [0, 256]; anything else is a
    ConfigError naming the field and the value."""
    with pytest.raises(ConfigError, match=r"native_fill_threads=.*expected an int in \[0, 256\]"):
        dataclasses.replace(tiny.config, native_fill_threads=value)


@pytest.mark.parametrize("threads, min_requests, adaptive", [
    (0, 1, True), (257, 1, True), (2, 0, True), (2.0, 1, True), (True, 4, True),
    (2, "8", True), (2, 8, 1)])
def test_set_fill_threads_is_validated(tiny, threads, min_requests, adaptive):
    """NativeBuilder.set_fill_threads refuses thread counts outside [1, 256], thresholds
    below 1 (or not ints) and a non-bool adaptive with a ConfigError naming the argument; the
    C++ side refuses the numbers too (a ValueError), and the builder keeps its setting."""
    dec = GuidedDecoder(tiny.config, 2, 0, factory=tiny, host_build="native")
    builder = dec.host_build.builder
    try:
        kept = (builder.fill_threads, builder.pool_min_requests, builder.adaptive)
        with pytest.raises(ConfigError,
                           match="set_fill_threads: (threads|min_requests|adaptive)="):
            builder.set_fill_threads(threads, min_requests, adaptive)
        assert (builder.fill_threads, builder.pool_min_requests, builder.adaptive) == kept
        if type(threads) is int and type(min_requests) is int and adaptive is True:
            with pytest.raises(ValueError, match="fill threads"):
                builder._set_fill(threads, min_requests, True)
    finally:
        dec.close()


def test_bench_fill_threads_tool_measures_and_writes_json(tmp_path, capsys):
    """tools/bench_fill_threads.py (a short run: batches 1 and 40, threads 1 and 2, 3 steps)
    prints its table and writes a row per batch with every decoder's time, ratio and pool
    share, after checking that every decoder masked the same rows as the one-thread one."""
    from conftest import load_tool

    tool = load_tool("bench_fill_threads")
    path = tmp_path / "fill.json"
    assert tool.main(["--batches", "1", "40", "--threads", "1", "2", "--steps", "3",
                      "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| batch |" in out and "2 thr / 1" in out and "auto / 1" in out
    data = json.loads(path.read_text())
    assert [row["batch"] for row in data["rows"]] == [1, 40]
    for row in data["rows"]:
        for name in ("t1", "t2", "auto"):
            assert row[f"{name}_us"] > 0 and row[f"{name}_ratio"] > 0
            assert 0 <= row[f"{name}_pool_share"] <= 1
        assert row["t1_pool_share"] == 0
    assert data["rows"][0]["t2_pool_share"] == 0  # (one request: nothing to split)


def test_closing_the_pool_while_a_step_runs_on_it_waits_for_the_step():
    """NativeBuilder.close() (and a change of its fill threads) from another thread while
    steps run on the pool ended the pool's threads and freed it under the running step,
    which then hung (or read freed memory); the close now waits for the step, and the
    steps go on, starting a new pool."""
    factory = create_matcher_factory(GuidedDecodingConfig(
        encoded_vocab=["a", "b", "</s>"], stop_token_ids=[2], vocab_size_padded=64,
        native_build="on", native_fill_threads=4))
    guide = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= ("a" | "b")+')
    slots = 128
    dec = GuidedDecoder(factory.config, slots, 0, factory=factory, host_build="native")
    builder = dec.host_build.builder
    builder.set_fill_threads(4, 1, adaptive=False)
    dec.add_batch([GuidedRequest.context(s, s, guide) for s in range(slots)])
    dec.build()
    stop, steps, errors = threading.Event(), [0], []

    def engine() -> None:
        try:
            while not stop.is_set():
                dec.add_batch([GuidedRequest.generation(s, s, guide, 0) for s in range(slots)])
                assert dec.build() == []
                steps[0] += 1
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    thread = threading.Thread(target=engine, daemon=True)
    thread.start()
    deadline = time.monotonic() + 1.5
    k = 0
    while time.monotonic() < deadline:
        if k % 2:
            builder.close()
        else:
            builder.set_fill_threads(2 + k % 3, 1, adaptive=False)
        k += 1
        time.sleep(0.0005)
    stop.set()
    thread.join(20)
    assert not thread.is_alive(), "a step hung after its pool was closed under it"
    assert errors == [] and steps[0] > 0
    dec.close()
    factory.close()
