"""The C++ host build (csrc/builder.cc and python_entry.cc, through capgraph.build.library):
same results as the Python build, faults per request, and a clear story when it cannot be
built."""

from __future__ import annotations

import dataclasses
import json
import os
import random
import signal
import time
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from capgraph import ConfigError, GuidedDecodingConfig, GuidedDecodingParams, GuideType
from capgraph.decoder import GuidedDecoder
from capgraph.grammar import create_matcher_factory
from capgraph.build import library as native
from capgraph.build.library import NativeBuildError, NativeBuilder
from capgraph.requests import REQUEST_FIELDS, GuidedRequest
from capgraph.tokenizers import encode_continuation
from conftest import (AimedMethods, assert_steps_agree, build_threads,
                      request_type_whose_field_raises)

pytestmark = pytest.mark.skipif(native.unavailable_reason() is not None,
                                reason=f"C++ host build unavailable: "
                                       f"{native.unavailable_reason()}")

VOCAB = ["a", "b", "</s>", "ab", "c", "d"]
# 'a' 'x' dead-ends after 'a' (no token spells 'x'); "b"+ may stop
DEAD = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= "a" "x" | "b" "a" "x" | "b"+')
ALIVE = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= ("a" | "b")+')
SHORT = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= "a" "b"?')


@pytest.fixture(scope="module")
def tiny():
    """A 6-token raw vocabulary padded to 64 ids (the padding ids exercise the tail clear)."""
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[2], vocab_size_padded=64,
                                  native_build="off")
    factory = create_matcher_factory(config)
    yield factory
    factory.close()


class _AsyncBuildDecoder(GuidedDecoder):
    """Builds as the capturable decoder's CPU host step does: the CPython entry's xgrammar
    work on its own thread, left in flight until whatever reads the decoder next joins it."""

    def _build(self, requests, asynchronous=False, clear_rows=None):
        return super()._build(requests, True, clear_rows)


def _decoder(factory, slots, drafts, mode, sequential_max=None, cls=GuidedDecoder,
             host_build="auto"):
    """A decoder with ``native_build=mode``; ``sequential_max``: the Python strategy's
    ``sequential_fill_max``."""
    config = dataclasses.replace(factory.config, native_build=mode)
    dec = cls(config, slots, drafts, factory=factory, host_build=host_build)
    if sequential_max is not None:
        dec.host_build.sequential_fill_max = sequential_max
    return dec


class _StatelessFlaky:
    """Python-path twin of :func:`_flaky_methods`: accepting "c" (id 4) raises, and so does
    filling ``bad_row``. Stateless, so every build path meets the same faults."""

    def __init__(self, inner, bad_row: int) -> None:
        self.inner, self.bad_row = inner, bad_row

    def accept_token(self, token_id):
        if token_id == 4:
            raise RuntimeError("flaky accept")
        return self.inner.accept_token(token_id)

    def fill_next_token_bitmask(self, bitmask, index):
        if index == self.bad_row:
            raise RuntimeError("flaky fill")
        self.inner.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens):
        self.inner.rollback(num_tokens)

    def is_terminated(self):
        return self.inner.is_terminated()


def _flaky_methods(bad_row: int) -> AimedMethods:
    """xgrammar's FFI methods, wrapped so that the matcher aimed at fails like
    :class:`_StatelessFlaky` (tvm-ffi turns the raised error into a C++ one and back)."""

    def flaky_accept(accept, handle, token, debug):
        if token == 4:
            raise RuntimeError("flaky accept")
        return accept(handle, token, debug)

    def flaky_fill(fill, handle, bitmask, index, debug):
        if index == bad_row:
            raise RuntimeError("flaky fill")
        return fill(handle, bitmask, index, debug)

    return AimedMethods(accept=flaky_accept, fill=flaky_fill)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1))
def test_native_and_python_builds_agree(tiny, seed):
    """Over random steps -- dead ends, rejected and stop tokens (in golden and draft
    positions), drafts, runtime draft lengths, rollbacks, re-initialised slots, unguided
    requests between guided ones, a matcher that raises in some calls -- the C++ build (with
    and without its CPython entry, whose work also runs on its own thread) leaves the same
    masks, token masks, counters, failures, termination and matchers as both Python fills."""
    rng = random.Random(seed)
    K, slots = 3, 4
    guides = [rng.choice([DEAD, ALIVE, SHORT]) for _ in range(slots)]
    flaky, bad_row = rng.randrange(slots), rng.randrange(slots * (K + 1))
    methods = [_flaky_methods(bad_row) for _ in range(3)]  # one per native decoder
    decs = [_decoder(tiny, slots, K, "off", 0), _decoder(tiny, slots, K, "off", 1000),
            _decoder(tiny, slots, K, "on", host_build=methods[0].host_build()),
            # the tvm-ffi step only, without the CPython entry
            _decoder(tiny, slots, K, "on", host_build=methods[1].host_build(entry=False)),
            _decoder(tiny, slots, K, "on", cls=_AsyncBuildDecoder,
                     host_build=methods[2].host_build())]
    assert [d.native_build for d in decs] == [False, False, True, True, True]
    assert [d.host_build.name for d in decs[2:]] == ["native", "native-loop", "native"]
    steps: list = [[GuidedRequest.context(10 + s, s, guides[s]) for s in range(slots)]]
    steps += [None] * 10
    for n, step in enumerate(steps):
        if n == 1:
            for dec in decs[:2]:
                if dec.grammar_matchers[flaky] is not None:
                    dec.grammar_matchers[flaky] = _StatelessFlaky(dec.grammar_matchers[flaky],
                                                                  bad_row)
            for dec, aimed in zip(decs[2:], methods):
                if dec.grammar_matchers[flaky] is not None:
                    aimed.aim(dec.grammar_matchers[flaky])
        if step is None:
            chosen = rng.sample(range(slots), rng.randint(1, slots))
            step = []
            for s in chosen:
                if n > 1 and s != flaky and rng.random() < 0.1:  # a fresh matcher (token None)
                    step.append(GuidedRequest.context(10 + s, s, guides[s]))
                    continue
                step.append(GuidedRequest.generation(
                    10 + s, s, guides[s], rng.choice([0, 1, 1, 2, 3, 4]),
                    draft_tokens=[rng.choice([0, 1, 2, 3, 4])
                                  for _ in range(rng.randint(0, K))],
                    num_accepted_draft_tokens=rng.randint(0, K)))
            if len(step) < slots and rng.random() < 0.2:  # unguided rows between guided ones
                step.insert(rng.randint(0, len(step)),
                            GuidedRequest.placeholder(99, rng.randint(0, K)))
        assert_steps_agree(decs, step, rng.randint(0, K))


def test_native_build_teacher_forced_equals_python(factory_cache):
    """A JSON-schema text on Tekken, fed with drafts of four: the native decoder's rows equal
    the Python decoder's at every step, and every golden token stays allowed."""
    factory = factory_cache("tekken")
    schema = {"type": "object", "properties": {"name": {"type": "string"},
                                               "tags": {"type": "array",
                                                        "items": {"type": "integer"}}},
              "required": ["name", "tags"]}
    params = GuidedDecodingParams(GuideType.JSON_SCHEMA, json.dumps(schema))
    text = encode_continuation(factory.config.tokenizer,
                               json.dumps({"name": "ab cd", "tags": [1, 22, 333]}))
    eos = factory.config.stop_token_ids[0]
    tokens = list(text) + [eos]
    decs = [_decoder(factory, 2, 4, mode) for mode in ("off", "on")]
    assert [d.native_build for d in decs] == [False, True]
    for dec in decs:
        dec.add_batch([GuidedRequest.context(1, 1, params)])
        assert dec.build() == []
    pos, accepted = 0, 0
    while pos < len(tokens) - 1:
        drafts = tokens[pos + 1:pos + 5]
        rows = []
        for dec in decs:
            dec.add_batch([GuidedRequest.generation(
                1, 1, params, tokens[pos], draft_tokens=drafts,
                num_accepted_draft_tokens=accepted)], runtime_draft_len=4)
            dec.rollback_rejected_tokens()  # the verifier took every draft: nothing rolls back
            assert dec.build() == []
            n = dec.requests.num_bitmask_tokens
            rows.append((dec.bitmask_host[:n].clone(), dec.token_mask_host[:n].clone(),
                         dec.num_advanced_tokens[1], dec.num_guided_tokens[1]))
        (bm_a, tm_a, adv_a, g_a), (bm_b, tm_b, adv_b, g_b) = rows
        assert torch.equal(tm_a, tm_b) and (adv_a, g_a) == (adv_b, g_b)
        assert torch.equal(bm_a[tm_a.bool()], bm_b[tm_b.bool()])
        for i, t in enumerate(drafts[:g_b]):  # each guided row allows the next text token
            word = int(bm_b[i, t // 32]) & 0xFFFFFFFF
            assert word >> (t % 32) & 1, f"token {t} masked at step {pos} row {i}"
        pos, accepted = pos + 1 + len(drafts), len(drafts)
    assert all(d.grammar_matchers[1].is_terminated() for d in decs)


class _Spy:
    """Wraps a decoder's CPython entry, recording whether each step took it (a result) or
    declined it (None: the Python loop around the tvm-ffi step ran instead)."""

    def __init__(self, dec: GuidedDecoder) -> None:
        entry = dec.host_build.entry
        self.step = entry.step
        self.taken: list[bool] = []
        dec.host_build.entry = entry._replace(step=self)

    def __call__(self, *args):
        result = self.step(*args)
        self.taken.append(result is not None)
        return result


class _RequestSubclass(GuidedRequest):
    __slots__ = ()


def test_cpython_entry_takes_plain_batches_and_declines_the_rest(tiny):
    """The CPython entry runs a batch only when every guided request is the plain case and
    otherwise touches nothing, so that the Python build decides: a context request, a
    duplicate slot, a token that is not an exact int or lies outside the vocabulary, a draft
    request, too many drafts, a matcher that is not exactly XGrammarMatcher. A request
    subclass or unguided request does not stop it. Each step's outcome equals the Python
    build's."""
    import numpy as np

    decs = [_decoder(tiny, 4, 2, "off"), _decoder(tiny, 4, 2, "on")]
    spy = _Spy(decs[1])

    def step(reqs, draft_len=2):
        assert_steps_agree(decs, reqs, draft_len)
        return spy.taken.pop()

    gen = GuidedRequest.generation
    assert not step([GuidedRequest.context(s, s, ALIVE) for s in range(4)])
    assert step([gen(s, s, ALIVE, 0, draft_tokens=[1, 0]) for s in range(4)])
    assert step([GuidedRequest.placeholder(9, 2), gen(0, 0, ALIVE, 1),
                 _RequestSubclass(ALIVE, 1, 1, None, False, False, True, False, 3, False,
                                  [0], 0)])
    declined = [
        [gen(0, 0, ALIVE, 0), GuidedRequest.context(1, 1, ALIVE)],
        [gen(0, 0, ALIVE, 0), gen(0, 0, ALIVE, 1)],  # (the slot's owner twice)
        [gen(0, 0, ALIVE, np.int64(1))],
        [gen(0, 0, ALIVE, True)],
        [gen(0, 0, ALIVE, 64)],
        [gen(0, 0, ALIVE, 1, draft_tokens=[0, 0, 0])],
        [gen(0, 0, ALIVE, 1, draft_tokens=[np.int64(0)])],
        [dataclasses.replace(gen(0, 0, ALIVE, 1), is_draft=True)],
    ]
    for reqs in declined:
        assert not step(reqs), reqs
    assert step([gen(s, s, ALIVE, 1) for s in range(4)])
    for dec in decs:  # a wrapped matcher must run its own methods
        dec.grammar_matchers[2] = _StatelessFlaky(dec.grammar_matchers[2], bad_row=-1)
    assert not step([gen(2, 2, ALIVE, 0), gen(3, 3, ALIVE, 0)])
    assert step([gen(3, 3, ALIVE, 0)])


_READERS = {
    "apply_bitmask": lambda d: d.apply_bitmask(torch.zeros(d.requests.num_bitmask_tokens, 64),
                                               None, d.requests.num_bitmask_tokens),
    "take_failed_requests": lambda d: d.take_failed_requests(),
    "rollback_rejected_tokens": lambda d: d.rollback_rejected_tokens(),
    "rollback_draft_tokens": lambda d: d.rollback_draft_tokens(),
    "init_disagg_gen_requests": lambda d: d.init_disagg_gen_requests(),
    "release": lambda d: d.release(3),
    "build": lambda d: d.build(),
    "close": lambda d: d.close(),
}


@pytest.mark.parametrize("reader", list(_READERS))
def test_asynchronous_build_is_ended_before_anything_reads_the_decoder(tiny, reader):
    """A build left on the CPython entry's thread (the capturable decoder's CPU host step)
    is ended by whatever next reads the matchers, counters or masks, and then equals the
    synchronous build: failures, counters, token mask and bitmask rows."""
    sync, later = _decoder(tiny, 4, 2, "on"), _decoder(tiny, 4, 2, "on")
    gen = GuidedRequest.generation
    context = [GuidedRequest.context(s, s, ALIVE if s else SHORT) for s in range(4)]
    # slot 0 (SHORT) rejects "a" after "a": a failure that must not be lost
    steps = [context, [gen(0, 0, SHORT, 0)] + [gen(s, s, ALIVE, 1, draft_tokens=[0, 4])
                                                for s in (1, 2)] + [gen(3, 3, ALIVE, 0)],
             [gen(0, 0, SHORT, 0)] + [gen(s, s, ALIVE, 0, draft_tokens=[1])
                                      for s in (1, 2, 3)]]
    for n, reqs in enumerate(steps):
        for dec in (sync, later):
            dec.add_batch(reqs, runtime_draft_len=2)
        expected = sync.build()
        assert later._build(later.requests, asynchronous=True) == []
        assert later.host_build.in_flight == (n > 0)  # (a context step is declined)
        rows = sync.requests.num_bitmask_tokens
        state = (list(sync.num_advanced_tokens), list(sync.num_guided_tokens),
                 sync.token_mask_host[:rows].tolist(), sync.bitmask_host[:rows].clone())
        result = _READERS[reader](later) if n else None
        assert not later.host_build.in_flight
        failed = result if n and reader == "take_failed_requests" else \
            later.take_failed_requests()
        assert failed == expected
        if reader in ("apply_bitmask", "take_failed_requests", "close") or not n:
            got = (list(later.num_advanced_tokens), list(later.num_guided_tokens),
                   later.token_mask_host[:rows].tolist())
            assert got == state[:3]
            assert torch.equal(later.bitmask_host[:rows][later.token_mask_host[:rows].bool()],
                               state[3][sync.token_mask_host[:rows].bool()])
        if n and reader not in ("apply_bitmask", "take_failed_requests"):
            return  # the reader changed the decoder on purpose (rollback, release, rebuild,
            # close: a closed decoder takes no further step)


class _TokenProperty(GuidedRequest):
    """A request subclass that serves ``new_token`` through a property of its own."""

    __slots__ = ("_token",)

    @property  # type: ignore[override]
    def new_token(self):
        return self._token

    @new_token.setter
    def new_token(self, value):
        self._token = value


class _LookAlike:
    """Not a GuidedRequest: a plain object with the same attributes."""

    def __init__(self, request: GuidedRequest) -> None:
        for name in REQUEST_FIELDS:
            setattr(self, name, getattr(request, name))


_RaisingDrafts = request_type_whose_field_raises("draft_tokens", "draft_tokens read fails")


def test_cpython_entry_reads_request_subclasses_and_look_alikes(tiny):
    """Pins the native boundary's request side: the entry reads each field by name, so a
    request subclass serving a field through a property and an object that is no
    GuidedRequest at all but has its attributes are read as the Python build reads them: the
    C++ admission and the entry take the batch, and every step's outcome equals the Python
    build's."""
    decs = [_decoder(tiny, 3, 1, "off"), _decoder(tiny, 3, 1, "on")]
    spy = _Spy(decs[1])
    gen = GuidedRequest.generation
    assert_steps_agree(decs, [GuidedRequest.context(s, s, ALIVE) for s in range(3)], 1)
    spy.taken.clear()
    for step in range(3):
        plain = gen(0, 0, ALIVE, step % 2, draft_tokens=[1])
        subclass = _TokenProperty(ALIVE, 1, 1, None, False, False, True, False, 1, False,
                                  [step % 2], 0)
        look_alike = _LookAlike(gen(2, 2, ALIVE, 0, draft_tokens=[0]))
        assert type(subclass).new_token is not GuidedRequest.new_token
        assert_steps_agree(decs, [plain, subclass, look_alike], 1)
        assert spy.taken.pop() is True
        assert decs[1].num_advanced_tokens == decs[0].num_advanced_tokens != [0, 0, 0]


def test_cpython_entry_declines_a_field_read_that_raises(tiny, monkeypatch):
    """A field whose read raises -- a subclass's property, a look-alike without the field, or
    GuidedRequest's own field served by a property (read through the descriptor the entry
    looked up at bind time) -- declines the batch untouched (step and begin return None),
    stops admission at that request, and leaves no exception set; the batch without it is
    taken."""
    gen = GuidedRequest.generation
    member = GuidedRequest.__dict__["new_token"]
    failing = {"on": False}

    def read(request):
        if failing["on"]:
            raise RuntimeError("new_token read fails")
        return member.__get__(request, GuidedRequest)

    monkeypatch.setattr(GuidedRequest, "new_token",
                        property(read, lambda request, value: member.__set__(request, value)))
    dec = _decoder(tiny, 2, 0, "on")  # (binds the property as GuidedRequest's descriptor)
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE), GuidedRequest.context(2, 1, ALIVE)])
    assert dec.build() == []
    fast = dec.host_build.entry
    guides, owners = [ALIVE, ALIVE], [1, 2]
    first = gen(1, 0, ALIVE, 0)
    missing = _LookAlike(gen(2, 1, ALIVE, 0))
    del missing.draft_tokens
    for bad in (_RaisingDrafts(ALIVE, 2, 1, None, False, False, True, False, 0, False, [], 0),
                missing):
        batch = [first, bad]
        for call in (fast.step, fast.begin):
            assert call(fast.state, batch, [0, 1], 0, 2) is None, bad
        assert fast.admit(fast.state, batch, guides, owners) == 1
        assert fast.admit(fast.state, batch[::-1], guides, owners) == 0
        assert dec.num_advanced_tokens == [0, 0]  # (nothing touched)
    second = gen(2, 1, ALIVE, 1)
    failing["on"] = True
    for call in (fast.step, fast.begin):
        assert call(fast.state, [first, second], [0, 1], 0, 2) is None
    # (admission reads no token)
    assert fast.admit(fast.state, [first, second], guides, owners) == 2
    assert dec.num_advanced_tokens == [0, 0]
    failing["on"] = False
    assert fast.step(fast.state, [first, second], [0, 1], 0, 2) == (True, None)
    assert dec.num_advanced_tokens == [1, 1]


def test_matcher_handles_follow_the_matchers(tiny):
    """Pins the native boundary's matcher side: per slot, the decoder keeps in step with its
    matcher what the C++ runs -- None (no matcher), the address of an exact XGrammarMatcher's
    FFI object, False for any other matcher (the batch that needs it is declined) -- on every
    assignment, and the slot list's length cannot change."""
    dec = _decoder(tiny, 3, 0, "on")
    matchers = dec.grammar_matchers
    assert matchers.handles == [None, None, None]
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE), GuidedRequest.context(2, 2, ALIVE)])
    assert dec.build() == []
    assert matchers.handles[0] == matchers[0].ffi_address != 0
    assert matchers.handles[1] is None and matchers.handles[2] == matchers[2].ffi_address
    wrapped = _StatelessFlaky(matchers[2], bad_row=-1)
    matchers[2] = wrapped
    assert matchers.handles[2] is False
    matchers[0:2] = [None, matchers[0]]
    assert matchers.handles[:2] == [None, matchers[1].ffi_address]
    for change in (lambda: matchers.append(None), lambda: matchers.pop(),
                   lambda: matchers.__setitem__(slice(0, 1), []), lambda: matchers.clear()):
        with pytest.raises(TypeError, match="fixed length"):
            change()
    assert len(matchers) == len(matchers.handles) == 3


def test_make_fast_refuses_bad_field_names(tiny, monkeypatch):
    """The entry is handed the request field names (capgraph/requests.py,
    NATIVE_RECORD_FIELDS) when it is bound: anything but a tuple of as many str as the C++
    reads positions raises TypeError there, never later in a step."""
    import capgraph.requests as requests_module

    fields = requests_module.NATIVE_RECORD_FIELDS
    builder = _decoder(tiny, 2, 0, "on").host_build.builder

    def bind():
        return builder.bind_fast([None, None], [False, False], [0, 0], [0, 0], 64, 0)

    assert bind() is not None
    for bad in (list(fields), fields[:-1], fields + ("request_id",), fields[:-1] + (7,), None):
        monkeypatch.setattr(requests_module, "NATIVE_RECORD_FIELDS", bad)
        with pytest.raises(TypeError, match="field_names"):
            bind()
        with pytest.raises(TypeError, match="field_names"):
            _decoder(tiny, 2, 0, "on")


def test_fast_begin_and_end_are_paired(tiny):
    """fast_begin / fast_end misuse raises a clear error and touches nothing; fast_close
    ends the thread and a later fast_begin starts another."""
    dec = _decoder(tiny, 2, 0, "on")
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE)])
    assert dec.build() == []
    fast = dec.host_build.entry
    with pytest.raises(RuntimeError, match="no build in flight"):
        fast.end(fast.state)
    dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 0)])
    reqs = dec.requests
    args = (fast.state, reqs.requests, reqs.offsets, 0, reqs.num_bitmask_tokens)
    assert fast.begin(*args) is True
    for call in (lambda: fast.begin(*args), lambda: fast.step(*args)):
        with pytest.raises(RuntimeError, match="has not been ended"):
            call()
    assert fast.end(fast.state) == (True, None)
    assert dec.num_advanced_tokens[0] == 1 and dec.num_guided_tokens[0] == 1
    dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 1)])
    reqs = dec.requests
    assert fast.begin(fast.state, reqs.requests, reqs.offsets, 0, 1) is True
    fast.close(fast.state)  # with a job in flight: it runs to its end first
    assert fast.end(fast.state) == (True, None) and dec.num_advanced_tokens[0] == 1
    fast.close(fast.state)  # (nothing to end twice)
    dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 0)])
    assert fast.begin(fast.state, [], [], 0, 1) is True  # nothing to build
    assert fast.end(fast.state) == (False, None)
    assert dec._build(dec.requests, asynchronous=True) == []
    assert dec.take_failed_requests() == [] and dec.num_advanced_tokens[0] == 1


def test_capturable_rollback_after_prepare_reads_the_finished_build(tiny):
    """rollback_rejected_batch after prepare(): the accepted counts are clamped to the
    counters of the build prepare() started, which it waits for (not to the zeros the build
    starts from): no failure, the same counters as with the Python build."""
    from capgraph.capturable import CapturableGuidedDecoder

    results = []
    for mode in ("on", "off"):
        config = dataclasses.replace(tiny.config, native_build=mode)
        dec = CapturableGuidedDecoder(config, 2, 2, factory=tiny)
        dec.add_batch([GuidedRequest.context(1, 0, ALIVE)], runtime_draft_len=2)
        dec.execute(torch.zeros(1, 64))
        assert dec.take_failed_requests() == []
        dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 0, draft_tokens=[0, 1])],
                      runtime_draft_len=2)
        dec.prepare()
        dec.rollback_rejected_batch(torch.tensor([2]))
        dec.execute(torch.zeros(3, 64))
        results.append((dec.take_failed_requests(), list(dec.num_advanced_tokens)))
        dec.close()
    assert results[0] == results[1] and results[0][0] == []


def test_capturable_close_ends_a_build_still_queued_on_its_side_stream(tiny):
    """close() while the side stream still holds the step's host step: the step runs, its
    build ends, and the C++ build's thread is stopped afterwards (none is left running)."""
    from capgraph.capturable import CapturableGuidedDecoder

    config = dataclasses.replace(tiny.config, native_build="on")
    dec = CapturableGuidedDecoder(config, 2, 0, factory=tiny)
    if dec.host_build.name != "native":
        pytest.skip("the C++ build's CPython entry is not built here (no Python headers)")
    before = build_threads()  # (other tests' decoders may still hold theirs)
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE)])
    dec.execute(torch.zeros(1, 64))
    dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 0)])
    dec.streams.stream.enqueue(lambda: time.sleep(0.2))  # the side stream is busy
    dec.prepare()  # the host step queues behind it, on the stream's worker
    dec.close()
    assert not dec.host_build.in_flight and dec.host_build.entry.state is not None
    assert dec.take_failed_requests() == [] and dec.num_advanced_tokens[0] == 1
    assert not build_threads() - before



@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_starts_its_own_build_thread(tiny):
    """A child forked after the parent's build thread started has no such thread: its
    asynchronous builds run on a thread of its own, and closing the decoder there ends that
    one without touching the parent's (which a join would wait for forever)."""
    dec = _decoder(tiny, 2, 0, "on")
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE)])
    assert dec.build() == []
    for token in (0, 1):
        dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, token)])
        assert dec._build(dec.requests, asynchronous=True) == []
        assert dec.take_failed_requests() == []  # (ended: the parent's thread is running)
    for build_first in (True, False):
        pid = os.fork()
        if pid == 0:  # the child: report through the exit code only
            signal.alarm(20)  # a hang ends the child with SIGALRM
            try:
                ok = True
                if build_first:
                    dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 0)])
                    ok = dec._build(dec.requests, asynchronous=True) == [] and \
                        dec.take_failed_requests() == [] and dec.num_advanced_tokens[0] == 1
                dec.close()  # ends the child's thread, leaves the parent's (not here) alone
            except BaseException:
                ok = False
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, \
            f"child (build_first={build_first}) status {status:#x}"
    # forked with a build in flight: the child gets the result (the parent's thread finished
    # it before the fork) or a clear error, never a hang
    dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 1)])
    assert dec._build(dec.requests, asynchronous=True) == []
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)
        try:
            dec._finish_build()
            ok = True
        except RuntimeError as e:
            ok = "forked while this build was in flight" in str(e) and \
                not dec.host_build.in_flight
        except BaseException:
            ok = False
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status:#x}"
    assert dec.take_failed_requests() == [] and dec.num_advanced_tokens[0] == 1


def test_native_fault_fails_only_its_request(tiny):
    """A matcher call that raises inside the C++ loop fails that request alone, with the
    error's type and text; the other request's row is masked as usual."""
    methods = _flaky_methods(bad_row=-1)
    dec = _decoder(tiny, 2, 0, "on", host_build=methods.host_build())
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE), GuidedRequest.context(2, 1, ALIVE)])
    assert dec.build() == []
    methods.aim(dec.grammar_matchers[0])
    dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 4),  # "c": the flaky accept raises
                   GuidedRequest.generation(2, 1, ALIVE, 0)])
    logits = torch.zeros(2, 64)
    failed = dec.execute(logits)
    assert failed == [(1, "RuntimeError: flaky accept")]
    assert dec.grammar_matchers[0] is None and dec.grammar_matchers[1] is not None
    assert torch.isfinite(logits[0]).all()
    assert torch.isfinite(logits[1]).tolist()[:6] == [True, True, True, True, False, False]
    assert torch.isinf(logits[1, 6:]).all()  # padding ids stay masked


def test_native_rejects_bad_buffers(tiny):
    """The C++ side checks what it is bound to and says what was wrong."""
    import xgrammar as xgr

    methods = native.matcher_methods(xgr.matcher._core.GrammarMatcher)
    bitmask = torch.zeros(4, 2, dtype=torch.int32)
    with pytest.raises(NativeBuildError, match="bitmask must be a 2-D int32 CPU tensor"):
        NativeBuilder(methods, bitmask.float(), torch.zeros(4, dtype=torch.int32), 4, [2],
                      2, 0, None)
    with pytest.raises(NativeBuildError, match="token_mask has fewer rows"):
        NativeBuilder(methods, bitmask, torch.zeros(2, dtype=torch.int32), 4, [2], 2, 0, None)
    with pytest.raises(NativeBuildError, match="must be contiguous"):
        NativeBuilder(methods, torch.zeros(2, 4, dtype=torch.int32).t(),
                      torch.zeros(4, dtype=torch.int32), 4, [2], 2, 0, None)
    b = NativeBuilder(methods, bitmask, torch.zeros(4, dtype=torch.int32), 4, [2], 2, 0, None)
    with pytest.raises(ValueError, match="column lengths differ"):
        b.step([], [1], [0], [], [], 0, 0)
    with pytest.raises(ValueError, match="clear_rows 9 is outside"):
        b.step([], [], [], [], [], 0, 9)


def test_native_build_modes(tiny, monkeypatch):
    """'on' with a backend setting that has no native loop is a named error; the environment
    variable sets the default and an explicit value wins over it; a bad value names where it
    came from."""
    config = dataclasses.replace(tiny.config, native_build="on", fill_threads=2)
    factory = create_matcher_factory(config)
    with pytest.raises(ConfigError, match="needs the xgrammar backend with fill_threads=1"):
        GuidedDecoder(config, 1, 0, factory=factory)
    factory.close()
    with pytest.raises(ConfigError, match="native_build='maybe'"):
        GuidedDecodingConfig(encoded_vocab=VOCAB, native_build="maybe")
    monkeypatch.setenv("CAPGRAPH_NATIVE_BUILD", "OFF")
    assert GuidedDecodingConfig(encoded_vocab=VOCAB).native_build == "off"
    assert GuidedDecodingConfig(encoded_vocab=VOCAB, native_build="on").native_build == "on"
    monkeypatch.setenv("CAPGRAPH_NATIVE_BUILD", "sometimes")
    with pytest.raises(ConfigError, match="CAPGRAPH_NATIVE_BUILD='sometimes'"):
        GuidedDecodingConfig(encoded_vocab=VOCAB)


def test_unbuildable_native_falls_back_once_or_fails(tiny, monkeypatch, tmp_path):
    """Without a compiler: 'auto' warns once and builds in Python (same masks); 'on' raises
    NativeBuildError naming the compiler; nothing compiles at import."""
    import capgraph.build as build_module

    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    monkeypatch.setattr(build_module, "_native_warned", False)
    with pytest.warns(RuntimeWarning, match="no-such-compiler-xyz"):
        dec = _decoder(tiny, 1, 0, "auto")
    assert not dec.native_build
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the second decoder says nothing
        assert not _decoder(tiny, 1, 0, "auto").native_build
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE)])
    assert dec.build() == [] and dec.token_mask_host[0] == 1
    with pytest.raises(NativeBuildError, match="no C\\+\\+ compiler"):
        _decoder(tiny, 1, 0, "on")
    assert not list(tmp_path.iterdir())  # nothing was written


def test_native_library_is_cached_on_disk(monkeypatch, tmp_path):
    """The first load compiles into $CAPGRAPH_CACHE_DIR/native; a later process (here: a
    cleared in-memory state) loads the file without compiling."""
    from capgraph import jit

    calls = []
    real = jit._compile_and_link
    monkeypatch.setattr(jit, "_compile_and_link", lambda *a: (calls.append(a), real(*a)))
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path))
    for _ in range(2):  # (_python_module too: restored after, it stays the process's copy)
        for name in ("_module", "_error", "_python_module"):
            monkeypatch.setattr(native, name, None)
        assert native.load() is not None
    assert len(calls) == 1
    files = [p.name for p in (tmp_path / "native").iterdir() if p.suffix == ".so"]
    assert len(files) == 1 and files[0].startswith("host_build-")


def test_library_without_python_headers_serves_the_tvm_ffi_step(tiny, monkeypatch, tmp_path):
    """Where Python's headers are missing (CAPGRAPH_NATIVE_PYTHON=off builds as if they were)
    the library has no CPython entry: the decoder runs the tvm-ffi step, with the same
    results as the Python build."""
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CAPGRAPH_NATIVE_PYTHON", "off")
    for name in ("_module", "_error", "_python_module"):
        monkeypatch.setattr(native, name, None)
    assert native._python_flags() == []
    assert native.python_module() is None and native.load() is not None
    decs = [_decoder(tiny, 2, 0, "off"), _decoder(tiny, 2, 0, "on")]
    assert decs[1].native_build and decs[1].host_build.name == "native-loop"
    assert_steps_agree(decs, [GuidedRequest.context(1, 0, ALIVE),
                              GuidedRequest.context(2, 1, SHORT)], 0)
    assert_steps_agree(decs, [GuidedRequest.generation(1, 0, ALIVE, 0),
                              GuidedRequest.generation(2, 1, SHORT, 0)], 0)


def test_compile_error_is_reported_with_the_compiler_output(monkeypatch, tmp_path):
    """A source that does not compile gives NativeBuildError with the command and the
    compiler's own message (not a bare exit code), remembered by the loader."""
    from capgraph import jit

    for name in ("builder.cc", "python_entry.cc", "host_build.h"):
        (tmp_path / name).write_bytes(jit.csrc_path(name).read_bytes())
    (tmp_path / "builder.cc").write_text("this is not C++;\n")
    real = jit.cxx_library
    monkeypatch.setattr(jit, "cxx_library",
                        lambda *a, **k: real(*a, **{**k, "source_dir": tmp_path}))
    monkeypatch.setattr(native, "_module", None)
    monkeypatch.setattr(native, "_error", None)
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(NativeBuildError, match="compiling builder.cc failed.*error"):
        native.load()
    assert "error" in str(native.unavailable_reason())  # remembered, not recompiled


def test_native_clears_padding_ids_a_backend_sets(tiny):
    """Ids at or above the tokenizer's vocabulary (6 here, padded to 64) are cleared on every
    row the C++ loop fills, even when the engine's fill sets them (xgrammar itself does not;
    the clear guards against an engine that does)."""
    import xgrammar as xgr

    from capgraph.build import make_native_build

    accept, fill, is_terminated = native.matcher_methods(xgr.matcher._core.GrammarMatcher)

    def dirty_fill(handle, bitmask, index, debug):
        result = fill(handle, bitmask, index, debug)
        torch.from_dlpack(bitmask)[index] |= torch.tensor([-64, -1], dtype=torch.int32)
        return result

    def dirty_build(slots, factory, budget_ms):
        return make_native_build(slots, factory, budget_ms,
                                 methods=(accept, dirty_fill, is_terminated))

    dec = _decoder(tiny, 1, 2, "on", host_build=dirty_build)
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE)])
    assert dec.build() == []
    dec.add_batch([GuidedRequest.generation(1, 0, ALIVE, 0, draft_tokens=[1, 3])])
    assert dec.build() == []
    assert dec.token_mask_host[:3].tolist() == [1, 1, 1]
    rows = dec.bitmask_host[:3]
    # exactly the grammar's own bits after "a" / "ab" / "abab": a, b, </s>, ab
    assert rows[:, 1].tolist() == [0, 0, 0] and rows[:, 0].tolist() == [0b1111] * 3


# Values that the admission's inline test must tell apart from the common request's fields
# (exact ints, exact bools, the slot's own guide object and owner, a list of drafts).
_ADMISSION_MUTATIONS = [
    ("seq_slot", 1.0), ("seq_slot", True), ("seq_slot", "1"), ("seq_slot", -1), ("seq_slot", 9),
    ("request_id", 11.0), ("request_id", True), ("request_id", None), ("request_id", 99),
    ("is_draft", 1), ("is_draft", None), ("is_context_init_state", 0),
    ("is_generation_in_progress_state", 1), ("is_generation_only_first_iteration", None),
    ("draft_tokens", (1,)), ("draft_tokens", "ab"), ("draft_tokens", torch.tensor([1])),
    ("new_token", 1.0), ("new_token", True), ("new_token", 64),
    ("guided_decoding_params", ALIVE), ("guided_decoding_params", SHORT),
    ("guided_decoding_params", GuidedDecodingParams(GuideType.EBNF_GRAMMAR, ALIVE.guide)),
]


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("field, value", _ADMISSION_MUTATIONS,
                         ids=[f"{f}={v!r}"[:40] for f, v in _ADMISSION_MUTATIONS])
def test_admission_in_cpp_equals_the_python_check(tiny, field, value, position):
    """Pins: ``FastPath.admit`` (the C++ copy of ``GuidedDecoder._admit``'s inline test)
    passes exactly the requests the Python test passes: with one field of one request of a
    steady-state batch changed to a look-alike value, at the start, middle or end of the
    batch, the C++-admitted decoder reports the same failures and masks the same rows as a
    decoder without the C++ entry (``native_build="off"``)."""
    decoders = [_decoder(tiny, 4, 1, mode) for mode in ("auto", "off")]
    assert [dec.host_build.name for dec in decoders] == ["native", "python"]
    outcomes = []
    try:
        for dec in decoders:
            dec.add_batch([GuidedRequest.context(10 + s, s, ALIVE) for s in range(3)])
            assert dec.execute(torch.zeros(3, 64)) == []
            reqs = [GuidedRequest.generation(10 + s, s, ALIVE, 0, draft_tokens=[1])
                    for s in range(3)]
            setattr(reqs[position], field, value)
            try:
                dec.add_batch(reqs, 1)
            except Exception as e:  # (a batch-level error must be the same error too)
                outcomes.append((type(e).__name__, str(e)))
                continue
            logits = torch.zeros(6, 64)
            failed = dec.execute(logits)
            outcomes.append((sorted(failed), logits.isinf().tolist(),
                             [m is None for m in dec.grammar_matchers]))
    finally:
        for dec in decoders:
            dec.close()
    assert outcomes[0] == outcomes[1]


def test_sync_state_that_raises_fails_only_its_request(tiny, monkeypatch):
    """Pins: after the C++ step reports a stop token accepted, re-reading the matcher's state
    (``sync_state``) is inside the per-request isolation: if it raises, that request alone
    fails with the error, and the other request of the step is masked as before."""
    from capgraph.grammar.xgrammar_backend import XGrammarMatcher

    dec = _decoder(tiny, 2, 0, "auto")
    try:
        dec.add_batch([GuidedRequest.context(1, 0, SHORT), GuidedRequest.context(2, 1, ALIVE)])
        assert dec.execute(torch.zeros(2, 64)) == []
        dec.add_batch([GuidedRequest.generation(1, 0, SHORT, 0),
                       GuidedRequest.generation(2, 1, ALIVE, 0)])
        assert dec.execute(torch.zeros(2, 64)) == []

        def broken(self):
            raise RuntimeError("sync_state fault")
        monkeypatch.setattr(XGrammarMatcher, "sync_state", broken)
        dec.add_batch([GuidedRequest.generation(1, 0, SHORT, 2),  # the stop token: terminates
                       GuidedRequest.generation(2, 1, ALIVE, 1)])
        logits = torch.zeros(2, 64)
        failed = dec.execute(logits)
        assert [f[0] for f in failed] == [1] and "sync_state fault" in failed[0][1]
        assert dec.grammar_matchers[0] is None and dec.grammar_matchers[1] is not None
        assert torch.isneginf(logits[1]).any() and torch.isfinite(logits[1, :2]).all()
    finally:
        dec.close()
