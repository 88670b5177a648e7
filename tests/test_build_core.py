"""The build core (capgraph.build): a decoder's host build strategy chosen by name or callable,
the choices it refuses, and the Python strategy run on its own, plan by plan, reporting each
request's outcome by its position in the batch."""

from __future__ import annotations

import dataclasses

import pytest

from capgraph import ConfigError, GuidedDecodingConfig, GuidedDecodingParams, GuideType
from capgraph.build import (HostBuild, NativeBuild, NativeLoopBuild, PythonBuild, SlotState,
                            Status, StepResult)
from capgraph.decoder import GuidedDecoder
from capgraph.build import library as native
from capgraph.grammar import create_matcher_factory
from capgraph.requests import GuidedRequest, GuidedRequests
from conftest import request_type_whose_field_raises

VOCAB = ["a", "b", "</s>", "ab", "c", "d"]
V = 64
A, B, C = 0, 1, 4  # token ids of "a", "b", "c"
# 'a' 'x' dead-ends after 'a' (no token spells 'x'); "b"+ may stop
DEAD = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= "a" "x" | "b" "a" "x" | "b"+')
ALIVE = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= ("a" | "b")+')
SHORT = GuidedDecodingParams(GuideType.EBNF_GRAMMAR, 'root ::= "a" "b"?')

native_reason = native.unavailable_reason()
needs_native = pytest.mark.skipif(native_reason is not None,
                                  reason=f"the C++ host build is unavailable: {native_reason}")


@pytest.fixture(scope="module")
def tiny():
    """xgrammar over a 6-token raw vocabulary padded to 64 ids (the C++ build where asked)."""
    config = GuidedDecodingConfig(encoded_vocab=VOCAB, stop_token_ids=[2], vocab_size_padded=V,
                                  native_build="auto")
    factory = create_matcher_factory(config)
    yield factory
    factory.close()


def _decoder(factory, host_build, native_build: str = "auto", **config) -> GuidedDecoder:
    config = dataclasses.replace(factory.config, native_build=native_build, **config)
    return GuidedDecoder(config, 2, 1, factory=factory, host_build=host_build)


# -- choosing a strategy -------------------------------------------------------------------------
def test_python_is_chosen_by_name(tiny):
    """``"python"`` is the reference strategy, whatever ``native_build`` says."""
    dec = _decoder(tiny, "python", native_build="on")  # the name wins over the config
    assert type(dec.host_build) is PythonBuild and dec.host_build.name == "python"
    assert not dec.host_build.asynchronous and not dec.native_build
    dec.close()


@needs_native
def test_native_loop_is_chosen_by_name(tiny):
    """``"native-loop"``: Python selection and the C++ loop, even with ``native_build="off"``
    (the name wins); it has no thread of its own."""
    dec = _decoder(tiny, "native-loop", native_build="off")
    assert type(dec.host_build) is NativeLoopBuild and dec.host_build.name == "native-loop"
    assert dec.native_build and not dec.host_build.asynchronous
    dec.close()


@needs_native
def test_native_is_chosen_by_name(tiny):
    """``"native"``: the CPython entry over the C++ loop, asynchronous (its own thread)."""
    if native.python_module() is None:
        pytest.skip("the C++ library has no CPython entry here (no Python headers): "
                    "'native' is the native loop")
    dec = _decoder(tiny, "native", native_build="off")
    assert type(dec.host_build) is NativeBuild and dec.host_build.name == "native"
    assert dec.host_build.asynchronous and dec.host_build.entry is not None
    assert dec.host_build.builder is not None
    dec.close()


def test_auto_follows_the_config(tiny):
    """``"auto"`` with ``native_build="off"`` is the Python build; with ``"on"``, a native
    strategy (where the C++ library builds)."""
    dec = _decoder(tiny, "auto", native_build="off")
    assert type(dec.host_build) is PythonBuild
    dec.close()
    if native_reason is None:
        dec = _decoder(tiny, "auto", native_build="on")
        assert isinstance(dec.host_build, NativeLoopBuild) and dec.native_build
        dec.close()


def test_a_callable_gives_the_strategy(tiny):
    """A callable is called once with the decoder's slot state, factory and budget; the
    strategy it returns is the decoder's."""
    calls = []

    def choose(slots, factory, budget_ms):
        calls.append((slots, factory, budget_ms))
        return PythonBuild(slots, factory, budget_ms)

    dec = _decoder(tiny, choose, host_step_budget_ms=7.0)
    assert calls == [(dec.slots, tiny, 7.0)]
    assert type(dec.host_build) is PythonBuild and dec.host_build.budget_ms == 7.0
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE)])
    assert dec.build() == [] and dec.grammar_matchers[0] is not None
    dec.close()


@pytest.mark.parametrize("choice", ["fast", "Python", "", None, 3])
def test_an_unknown_name_is_a_config_error(tiny, choice):
    """A name outside ``capgraph.build.HOST_BUILDS`` (names are case-sensitive) or a value
    that is neither a name nor a callable is a ConfigError naming ``host_build``."""
    with pytest.raises(ConfigError, match="host_build="):
        _decoder(tiny, choice)


def test_a_callable_returning_no_host_build_is_a_config_error(tiny):
    """What a callable returns must be a HostBuild; the error names the type it got."""
    with pytest.raises(ConfigError, match="returned dict, not a capgraph.build.HostBuild"):
        _decoder(tiny, lambda slots, factory, budget_ms: {})


@pytest.mark.parametrize("choice", ["native", "native-loop"])
def test_native_with_two_fill_threads_is_a_config_error(tiny, choice):
    """The C++ loop serves xgrammar with ``fill_threads=1`` only: asked for by name, it is a
    ConfigError (before any library is built), whatever the config says."""
    config = dataclasses.replace(tiny.config, fill_threads=2, native_build="off")
    factory = create_matcher_factory(config)
    try:
        with pytest.raises(ConfigError, match="fill_threads=1"):
            GuidedDecoder(config, 1, 0, factory=factory, host_build=choice)
    finally:
        factory.close()


def test_native_on_llguidance_is_a_config_error(factory_cache):
    """The C++ loop calls xgrammar's methods: asked for on the llguidance backend by name, it
    is a ConfigError naming the backend; ``"auto"`` there is the Python build."""
    pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    factory = factory_cache("mistral-sp32k", "llguidance")
    with pytest.raises(ConfigError, match="backend='llguidance'"):
        GuidedDecoder(factory.config, 1, 0, factory=factory, host_build="native")
    dec = GuidedDecoder(factory.config, 1, 0, factory=factory, host_build="auto")
    assert type(dec.host_build) is PythonBuild  # auto: the Python build serves llguidance
    dec.close()


# -- the Python strategy on its own ------------------------------------------------------------
class _Raising:
    """A matcher whose ``accept_token`` raises (the others forward to ``inner``)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def accept_token(self, token_id):
        raise RuntimeError("accept raised")

    def fill_next_token_bitmask(self, bitmask, index):
        self.inner.fill_next_token_bitmask(bitmask, index)

    def rollback(self, num_tokens):
        self.inner.rollback(num_tokens)

    def is_terminated(self):
        return self.inner.is_terminated()


def _state(factory, slots: int = 4, drafts: int = 1) -> SlotState:
    config = factory.config
    return SlotState(slots, drafts, V, config.tokenizer_vocab_size, config.stop_token_ids,
                     factory.likely_allowed_token_ids())


def _run(build, requests, draft_len: int = 0) -> StepResult:
    """One step of ``requests`` through ``build`` (its slots create matchers from the
    factory, or as the test set ``slots.create_matcher``)."""
    batch = GuidedRequests(requests, draft_len)
    return build.run(batch, batch.num_bitmask_tokens)


def _started(factory, guides, sequential_fill_max: int | None = None
             ) -> tuple[SlotState, PythonBuild]:
    """A slot state whose slot ``s`` holds a fresh matcher of ``guides[s]`` (created by a
    context step of the strategy)."""
    slots = _state(factory)
    slots.create_matcher = lambda req: factory.create(req.guided_decoding_params)
    build = PythonBuild(slots, factory)
    if sequential_fill_max is not None:
        build.sequential_fill_max = sequential_fill_max
    result = _run(build, [GuidedRequest.context(10 + s, s, g) for s, g in enumerate(guides)])
    assert not result.outcomes and result.masked
    assert all(m is not None for m in slots.matchers[:len(guides)])
    assert slots.token_mask_np[:len(guides)].tolist() == [1] * len(guides)
    return slots, build


@pytest.mark.parametrize("sequential_fill_max", [0, 1000], ids=["rounds", "sequential"])
def test_python_build_reports_each_outcome_at_its_batch_index(tiny, sequential_fill_max):
    """One step: an unguided request first (it shifts every index and row), then a refused
    new token ("c" on ALIVE), a dead end ("a" on DEAD wants an "x" no token spells), a matcher
    that raises, and a plain request. The outcomes name the batch positions 1, 2, 3 with
    REJECTED, DEAD_END and FAULT (the error's type and text); only the plain request's row is
    marked in the token mask, and the strategy touches no decoder (it has none)."""
    slots, build = _started(tiny, [ALIVE, DEAD, ALIVE, ALIVE], sequential_fill_max)
    slots.matchers[2] = _Raising(slots.matchers[2])
    requests = [GuidedRequest.placeholder(99), GuidedRequest.generation(10, 0, ALIVE, C),
                GuidedRequest.generation(11, 1, DEAD, A),
                GuidedRequest.generation(12, 2, ALIVE, A),
                GuidedRequest.generation(13, 3, ALIVE, B)]
    result = _run(build, requests)
    assert sorted(result.outcomes) == [(1, Status.REJECTED, None), (2, Status.DEAD_END, None),
                                       (3, Status.FAULT, "RuntimeError: accept raised")]
    assert result.masked
    assert slots.token_mask_np[:5].tolist() == [0, 0, 0, 0, 1]
    assert slots.num_advanced_tokens[:4] == [0, 1, 0, 1]
    assert slots.num_guided_tokens[:4] == [0, 0, 0, 1]


def test_python_build_reports_a_dead_end_only_at_the_first_row(tiny):
    """A draft that runs into the dead end leaves that row to verification: no outcome, the
    rows before it guided."""
    slots, build = _started(tiny, [DEAD])
    result = _run(build, [GuidedRequest.generation(10, 0, DEAD, B, draft_tokens=[A])],
                  draft_len=1)
    assert not result.outcomes and result.masked
    assert slots.token_mask_np[:2].tolist() == [1, 0]
    assert slots.num_advanced_tokens[0] == 2 and slots.num_guided_tokens[0] == 1


def test_python_build_refuses_a_request_that_does_not_own_its_slot(tiny):
    """A second request on a slot of the batch fails without touching the slot (REFUSED, the
    first request keeps its matcher and row); a matcher whose creation raises is a FAULT at
    its own position; a request past the last slot is a FAULT."""
    slots, build = _started(tiny, [ALIVE, SHORT])

    def create(req):
        if req.request_id == 20:
            raise RuntimeError("no compile")
        return tiny.create(req.guided_decoding_params)

    requests = [GuidedRequest.generation(10, 0, ALIVE, A),
                GuidedRequest.generation(11, 0, ALIVE, B),
                GuidedRequest.context(20, 1, SHORT),
                GuidedRequest.generation(30, 9, ALIVE, A)]
    slots.create_matcher = create
    result = _run(build, requests)
    assert [(i, status) for i, status, _ in sorted(result.outcomes)] == \
        [(1, Status.REFUSED), (2, Status.FAULT), (3, Status.FAULT)]
    details = {i: detail for i, _, detail in result.outcomes}
    assert details[1].startswith("RequestError") and "appears twice" in details[1]
    assert details[2] == "RuntimeError: no compile"
    assert details[3].startswith("RequestError") and "seq_slot 9" in details[3]
    assert slots.matchers[0] is not None and slots.num_advanced_tokens[0] == 1
    assert slots.token_mask_np[0] == 1


@needs_native
@pytest.mark.parametrize("choice", ["native-loop", "native"])
def test_native_strategies_report_what_the_python_one_reports(tiny, choice):
    """The same plans through a native strategy: the same outcomes, token mask and counters
    as the Python strategy (an unguided request first, a refused token, a dead end, a plain
    request)."""
    from capgraph.build import make_host_build

    results = []
    for strategy in ("python", choice):
        slots = _state(tiny)
        slots.create_matcher = lambda req: tiny.create(req.guided_decoding_params)
        build = make_host_build(strategy, slots, tiny)
        assert isinstance(build, HostBuild) and build.name in (strategy, "native-loop")
        steps = [[GuidedRequest.context(10 + s, s, g)
                  for s, g in enumerate([ALIVE, DEAD, ALIVE])],
                 [GuidedRequest.placeholder(99), GuidedRequest.generation(10, 0, ALIVE, C),
                  GuidedRequest.generation(11, 1, DEAD, A),
                  GuidedRequest.generation(12, 2, ALIVE, B)]]
        seen = []
        for requests in steps:
            result = _run(build, requests)
            rows = GuidedRequests(requests, 0).num_bitmask_tokens
            seen.append((sorted(result.outcomes), result.masked,
                         slots.token_mask_np[:rows].tolist(), list(slots.num_advanced_tokens),
                         list(slots.num_guided_tokens)))
        build.close()
        results.append(seen)
    assert results[0] == results[1]
    assert results[0][1][0] == [(1, Status.REJECTED, None), (2, Status.DEAD_END, None)]


class _FillRaising(_Raising):
    """A matcher whose ``fill_next_token_bitmask`` raises (accepting works)."""

    def accept_token(self, token_id):
        return self.inner.accept_token(token_id)

    def fill_next_token_bitmask(self, bitmask, index):
        raise RuntimeError("fill raised")


@pytest.mark.parametrize("host_build", ["python", "native-loop", "native"])
def test_a_draft_request_that_faults_adds_nothing_to_the_drafting_loops_count(tiny, host_build):
    """Pins: a draft-model step whose request accepts its token and then faults fails alone, and
    its advance is not counted into ``num_advanced_draft_tokens`` (its matcher is dropped: a
    later matcher on the slot must not be rolled back by it)."""
    if host_build != "python" and native_reason is not None:
        pytest.skip(f"the C++ host build is unavailable: {native_reason}")
    dec = _decoder(tiny, host_build)
    try:
        dec.add_batch([GuidedRequest.context(10, 0, ALIVE), GuidedRequest.context(11, 1, ALIVE)])
        assert dec.build() == []
        dec.grammar_matchers[0] = _FillRaising(dec.grammar_matchers[0])
        drafts = [dataclasses.replace(GuidedRequest.generation(10 + s, s, ALIVE, A),
                                      is_draft=True) for s in (0, 1)]
        dec.add_batch(drafts)
        failed = dec.build()
        assert failed == [(10, "RuntimeError: fill raised")]
        assert dec.num_advanced_draft_tokens[:2] == [0, 1]
        assert dec.grammar_matchers[0] is None and dec.grammar_matchers[1] is not None
    finally:
        dec.close()


@needs_native
def test_closing_the_native_strategy_finishes_a_build_in_flight(tiny):
    """Pins: ``NativeBuild.close()`` with a build begun and not finished ends that build first
    (the counters are written back), then stops its thread."""
    dec = _decoder(tiny, "native")
    try:
        if not dec.host_build.asynchronous:
            pytest.skip("the C++ build's CPython entry is not built here (no Python headers)")
        dec.add_batch([GuidedRequest.context(10, 0, ALIVE)])
        assert dec.build() == []
        dec.add_batch([GuidedRequest.generation(10, 0, ALIVE, A)])
        requests = dec.requests
        assert dec.host_build.begin(requests, requests.num_bitmask_tokens)
        dec.host_build.close()
        assert not dec.host_build.in_flight
        assert dec.num_advanced_tokens[0] == 1 and dec.num_guided_tokens[0] == 1
    finally:
        dec.close()


_TreeUnreadable = request_type_whose_field_raises("draft_parents", "draft tree unavailable")


@needs_native
@pytest.mark.parametrize("build", ["python", "native-loop", "native"])
def test_a_request_whose_tree_field_raises_is_refused_by_every_build(tiny, build):
    """A draft_parents that raises when read (not one that is absent) is refused at add_batch
    by every build, as Python's getattr(req, "draft_parents", None) lets it through only when
    the field is missing; the native admission read it as absent and advanced the matcher
    three tokens as a chain."""
    from capgraph.errors import LayoutError
    dec = GuidedDecoder(tiny.config, 1, 2, factory=tiny, host_build=build)
    dec.add_batch([GuidedRequest.context(1, 0, ALIVE)])
    dec.build()
    with pytest.raises(LayoutError, match="draft tree unavailable"):
        dec.add_batch([_TreeUnreadable.generation(1, 0, ALIVE, A, draft_tokens=[B, A])])
    assert dec.num_advanced_tokens[0] == 0
    dec.close()
