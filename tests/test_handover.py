"""Fast start (``backend="auto"``): a request starts on llguidance and is handed over to
xgrammar when its compile lands (capgraph/grammar/handover.py).

The xgrammar compile is held back by a test factory and released at a chosen fill, so the
switch happens where the test says. Masks are compared row for row with a request served by
llguidance alone before the switch and by xgrammar alone after it.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import Future

import pytest

pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
import torch  # noqa: E402

from capgraph import GuidedDecodingConfig, GuidedDecodingParams  # noqa: E402
from capgraph.errors import ConfigError, UnsupportedGuideError  # noqa: E402
from capgraph.grammar import create_matcher_factory  # noqa: E402
from capgraph.grammar.base import CompileHandle  # noqa: E402
from capgraph.grammar.handover import HandOverMatcher, HandOverMatcherFactory  # noqa: E402
from capgraph.params import GuidedDecodingBackend, GuideType  # noqa: E402
from capgraph.tokenizers import encode_continuation  # noqa: E402

TOKENIZER = "mistral-sp32k"


class HeldHandOver(HandOverMatcherFactory):
    """A hand-over factory whose xgrammar compiles wait for :meth:`release` (and which never
    finds a guide compiled already). ``substitute`` maps a guide to the params xgrammar really
    compiles for it (a replay-refusal test)."""

    def __init__(self, config, xgrammar, llguidance) -> None:
        super().__init__(config, xgrammar, llguidance)
        self.held: list[tuple[Future, GuidedDecodingParams]] = []
        self.substitute: dict[str, GuidedDecodingParams] = {}
        self.look_in_caches = False

    def xgrammar_ready(self, params) -> bool:
        return self.look_in_caches and super().xgrammar_ready(params)

    def _start_xgrammar(self, params) -> CompileHandle:
        future: Future = Future()
        self.held.append((future, params))
        return CompileHandle(future, params)

    def release(self, error: Exception | None = None) -> None:
        held, self.held = self.held, []
        for future, params in held:
            if error is not None:
                future.set_exception(error)
                continue
            try:
                compiled = self.xgrammar.compile(self.substitute.get(params.guide, params))
            except Exception as e:  # noqa: BLE001 - the compile's error, as a real one fails
                future.set_exception(e)
            else:
                future.set_result(compiled)


@pytest.fixture(scope="module")
def tok(tokenizer_cache):
    return tokenizer_cache(TOKENIZER)


@pytest.fixture(scope="module")
def sides(factory_cache):
    return factory_cache(TOKENIZER, "xgrammar"), factory_cache(TOKENIZER, "llguidance")


def held_factory(tok, sides, **config) -> HeldHandOver:
    cfg = GuidedDecodingConfig.from_tokenizer(tok, backend="auto", **config)
    return HeldHandOver(cfg, *sides)


def bench_cases(n: int) -> list[tuple[GuidedDecodingParams, str]]:
    """``n`` bundled JSON Schema Bench schemas both backends take, with a valid instance."""
    from importlib.resources import files
    found = []
    lines = files("capgraph.data").joinpath("jsonschemabench.jsonl").read_text().splitlines()
    for k, line in enumerate(lines):
        row = json.loads(line)
        text = json.dumps(row["instances"][0])
        if k % 9 == 4 and 20 < len(text) < 300:  # a spread of categories, short instances
            found.append((GuidedDecodingParams.json_schema(row["schema"]), text))
    return found[:n]


REGEX_CASES = [
    (GuidedDecodingParams.regex(r"(\d{3}-){2}\d{4}"), "555-123-4567"),
    (GuidedDecodingParams.regex(r"[A-Z][a-z]+( [A-Z][a-z]+)*, \w+@[a-z]+\.(com|org)"),
     "Ada Lovelace, ada_1@math.org"),
]


def usable(sides, tok, params, text):
    """Tokens of ``text`` plus the stop token, where both backends compile the guide and
    accept them all; else None."""
    tokens = encode_continuation(tok, text) + [tok.eos_token_id]
    for f in sides:
        try:
            m = f.create(params)
        except Exception:
            return None
        if not all(m.accept_token(t) for t in tokens) or not m.is_terminated():
            return None
    return tokens


def cases(sides, tok):
    out = []
    for params, text in [*bench_cases(8), *REGEX_CASES]:
        tokens = usable(sides, tok, params, text)
        if tokens is not None:
            out.append((params, tokens))
    assert len(out) >= 5, "too few bundled cases that both backends take"
    return out


class Rows:
    """One bitmask row per matcher, filled and compared."""

    def __init__(self, vocab: int) -> None:
        self.words = (vocab + 31) // 32

    def of(self, matcher) -> torch.Tensor:
        row = torch.zeros(1, self.words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(row, 0)
        return row[0]


def walk(factory, sides, params, tokens, release_at: int, drafts: int = 0, seed: int = 0):
    """Teacher-force ``tokens`` through a hand-over matcher and both backends alone, releasing
    the xgrammar compile before fill number ``release_at``. With ``drafts``, each step accepts
    one token, then walks up to ``drafts`` draft tokens (a fill before each), then rolls back a
    random number of them. Every hand-over row equals llguidance's before the switch and
    xgrammar's from it on. Returns the hand-over matcher."""
    xgr, llg = sides
    rng = random.Random(seed)
    handle = factory.compile_async(params)
    compiled = handle.result(10, backend="auto")
    assert compiled.backend == "auto"
    hand = factory.create_from_compiled(compiled)
    assert isinstance(hand, HandOverMatcher) and hand.served_by == "llguidance"
    refs = {"llguidance": llg.create(params), "xgrammar": xgr.create(params)}
    rows = Rows(factory.config.vocab_size_padded)
    fills = 0

    def fill_and_compare():
        nonlocal fills
        if hand.is_terminated():  # (the decoder fills no row of a terminated matcher)
            assert all(r.is_terminated() for r in refs.values())
            return
        if fills == release_at:
            factory.release()
        got = rows.of(hand)
        expect = "xgrammar" if fills >= release_at else "llguidance"
        assert hand.served_by == expect, (fills, hand.handover_failed_reason)
        assert torch.equal(got, rows.of(refs[expect])), f"fill {fills} on {expect}"
        fills += 1

    def accept(t):
        results = [hand.accept_token(t), *(r.accept_token(t) for r in refs.values())]
        assert results == [True] * 3, t

    def rollback(n):
        hand.rollback(n)
        for r in refs.values():
            r.rollback(n)

    i = 0
    while i < len(tokens):
        fill_and_compare()
        accept(tokens[i])
        i += 1
        ahead = tokens[i:i + drafts]
        for t in ahead:
            fill_and_compare()
            accept(t)
        if ahead:
            fill_and_compare()
            kept = rng.randint(0, len(ahead))
            rollback(len(ahead) - kept)
            i += kept
    assert hand.is_terminated() and all(r.is_terminated() for r in refs.values())
    if release_at < fills:
        assert hand.served_by == "xgrammar" and hand.handover_failed_reason is None
    return hand


def test_masks_equal_each_backend_alone_around_the_switch(tok, sides):
    """Teacher-forced over bundled schemas and regexes, the switch early, midway and at the
    last fill: rows equal llguidance alone before it, xgrammar alone from it on; the replay
    carries the tokens accepted so far."""
    factory = held_factory(tok, sides)
    for params, tokens in cases(sides, tok):
        for release_at in (0, len(tokens) // 2, len(tokens)):
            hand = walk(factory, sides, params, tokens, release_at)
            if release_at < len(tokens):
                assert hand.handover_position == release_at


def test_drafts_and_rollbacks_across_the_switch(tok, sides):
    """Drafts accepted, then the switch inside the draft walk, then a rollback of some of
    them (the xgrammar matcher rolls back tokens it was replayed): rows still equal."""
    factory = held_factory(tok, sides)
    for n, (params, tokens) in enumerate(cases(sides, tok)):
        for release_at in (2, 5, 9):
            walk(factory, sides, params, tokens, release_at, drafts=3, seed=n * 10 + release_at)


def test_replay_refusal_keeps_llguidance_and_says_why(tok, sides):
    """xgrammar's grammar (here a different regex, standing in for a backend that reads the
    guide otherwise) refuses a replayed token: the request stays on llguidance to its end,
    with masks equal to llguidance alone, and says why."""
    factory = held_factory(tok, sides)
    params = GuidedDecodingParams.regex(r"[a-z]+")
    factory.substitute[params.guide] = GuidedDecodingParams.regex(r"[a-z]{1,2}")
    tokens = encode_continuation(tok, "abcdefgh")
    hand = factory.create(params)
    llg = sides[1].create(params)
    rows = Rows(factory.config.vocab_size_padded)
    for k, t in enumerate(tokens):
        if k == 2:
            factory.release()
        assert torch.equal(rows.of(hand), rows.of(llg))
        assert hand.accept_token(t) and llg.accept_token(t)
    if sum(len(tok.decode([t])) for t in tokens[:2]) > 2:
        assert hand.served_by == "llguidance"
        assert "xgrammar refused token" in hand.handover_failed_reason


def test_xgrammar_failure_or_timeout_keeps_llguidance(tok, sides):
    """A failed xgrammar compile, or one not done within compile_timeout_s, leaves the request
    on llguidance with the reason."""
    params, tokens = REGEX_CASES[0][0], encode_continuation(tok, REGEX_CASES[0][1])
    factory = held_factory(tok, sides)
    hand = factory.create(params)
    factory.release(UnsupportedGuideError("no", guide_type="REGEX", backend="xgrammar"))
    assert hand.accept_token(tokens[0])
    Rows(factory.config.vocab_size_padded).of(hand)
    assert hand.served_by == "llguidance"
    assert "did not compile the guide: UnsupportedGuideError" in hand.handover_failed_reason

    slow = held_factory(tok, sides, compile_timeout_s=0.01)
    hand = slow.create(params)
    time.sleep(0.05)
    Rows(slow.config.vocab_size_padded).of(hand)
    assert hand.served_by == "llguidance" and "within 0.01 s" in hand.handover_failed_reason
    slow.release()  # lands too late: still llguidance
    Rows(slow.config.vocab_size_padded).of(hand)
    assert hand.served_by == "llguidance"


class CountedHandOver(HeldHandOver):
    """A held hand-over factory whose xgrammar handles say when they are given up: one held
    compile per guide, each handle on it numbered; ``given_up`` lists the numbers."""

    def __init__(self, config, xgrammar, llguidance) -> None:
        super().__init__(config, xgrammar, llguidance)
        self.futures: dict[str, Future] = {}
        self.handles: list[CompileHandle] = []
        self.given_up: list[int] = []

    def _start_xgrammar(self, params) -> CompileHandle:
        if params.guide not in self.futures:
            self.futures[params.guide] = Future()
            self.held.append((self.futures[params.guide], params))
        number = len(self.handles)
        handle = CompileHandle(self.futures[params.guide], params,
                               lambda _: self.given_up.append(number))
        self.handles.append(handle)
        return handle


def _given_up_settled() -> None:
    from capgraph.grammar.handover import give_ups_pending
    deadline = time.monotonic() + 10
    while give_ups_pending() and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.05)  # (the last one taken from the queue is being given up)


def test_each_matcher_of_a_compiled_guide_waits_for_xgrammar_on_its_own(tok, sides):
    """Matchers made from one compiled guide (an engine's copy of a request) each hold a
    handle of their own on the xgrammar compile: the first request to end gives up only its
    own, the other still hands over (one shared handle was given up for all of them: the
    compile was then dropped as unwanted, or in a process pool never started)."""
    params, tokens = REGEX_CASES[0][0], encode_continuation(tok, REGEX_CASES[0][1])
    factory = CountedHandOver(GuidedDecodingConfig.from_tokenizer(tok, backend="auto"), *sides)
    compiled = factory.compile(params)
    first, second = (factory.create_from_compiled(compiled) for _ in range(2))
    assert len(factory.handles) == 2 and first._pending is not second._pending
    del first
    _given_up_settled()
    assert factory.given_up == [0]
    factory.release()
    assert second.accept_token(tokens[0])
    Rows(factory.config.vocab_size_padded).of(second)
    assert second.served_by == "xgrammar" and factory.given_up == [0]


def test_a_matcher_dropped_under_the_factory_lock_gives_up_later(tok, sides):
    """A hand-over matcher collected on a thread that holds the xgrammar factory's lock (the
    garbage collector runs wherever an allocation triggers it) does not give its compile up
    there (that takes the same lock: the thread deadlocked, and with it every compile); the
    give-up comes once the lock is free."""
    import threading
    params = REGEX_CASES[0][0]
    xgrammar = sides[0]
    factory = CountedHandOver(GuidedDecodingConfig.from_tokenizer(tok, backend="auto"), *sides)
    compiled = factory.compile(params)
    taken: list[int] = []

    def give_up_under_lock(_: Future) -> None:
        with xgrammar._lock:  # (what the real give-up does: the factory's _timed_out)
            taken.append(1)

    factory.handles[0] = CompileHandle(factory.futures[params.guide], params,
                                       give_up_under_lock)
    object.__setattr__(compiled.payload, "xgrammar", factory.handles[0])

    def drop_under_lock() -> None:
        matcher = factory.create_from_compiled(compiled)
        with xgrammar._lock:
            del matcher  # (collected here: its finalizer runs on this thread, lock held)

    thread = threading.Thread(target=drop_under_lock, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "dropping the matcher under the factory lock deadlocked"
    _given_up_settled()
    assert taken == [1]
    factory.release()


def test_a_transient_xgrammar_failure_keeps_its_class_when_both_fail():
    """A guide llguidance refuses and xgrammar could not compile for a reason that says
    nothing about the guide (its queue full, its worker gone, its time up) fails with that
    transient class, so SGLang's cache (and any other) does not keep it; two refusals stay a
    refusal."""
    from capgraph.errors import (CompileQueueFullError, CompileResourceError,
                                 CompileTimeoutError)
    from capgraph.grammar.handover import _both_refused
    params = GuidedDecodingParams.json_schema('{"type": "string"}')
    refused = UnsupportedGuideError("no", guide_type="JSON_SCHEMA", backend="llguidance")
    for cls in (CompileQueueFullError, CompileResourceError, CompileTimeoutError):
        error = _both_refused(refused, cls("later", guide_type="JSON_SCHEMA",
                                           backend="xgrammar"), params)
        assert type(error) is cls and "llguidance: " in str(error) and "later" in str(error)
    both = _both_refused(refused, UnsupportedGuideError("no", guide_type="JSON_SCHEMA",
                                                        backend="xgrammar"), params)
    assert type(both) is UnsupportedGuideError


def test_routing(tok, sides):
    """Which guides get a hand-over: regex and JSON schema do; a guide xgrammar already has,
    an EBNF grammar and JSON go straight to xgrammar; a schema llguidance refuses is
    xgrammar's alone; one xgrammar refuses stays on llguidance; one both refuse fails."""
    factory = held_factory(tok, sides)
    factory.look_in_caches = True
    rows = Rows(factory.config.vocab_size_padded)

    def compiled(params, release: bool = False):
        handle = factory.compile_async(params)
        if release:
            factory.release()
        return handle.result(30, backend="auto")

    fresh = GuidedDecodingParams.regex(r"routing-[0-9]{5}")
    assert compiled(fresh).backend == "auto"
    factory.release()
    assert compiled(fresh).backend == "xgrammar"  # compiled already
    assert compiled(GuidedDecodingParams.ebnf('root ::= "a"')).backend == "xgrammar"
    assert compiled(GuidedDecodingParams(GuideType.JSON, "")).backend == "xgrammar"
    assert not factory.held  # none of those started a held compile
    uri = GuidedDecodingParams.json_schema({"type": "string", "format": "uri-reference"})
    got = compiled(uri, release=True)
    assert got.backend == "xgrammar" and "llguidance refused it" in got.fallback_reason
    loose = GuidedDecodingParams.json_schema({"minimum": 3})  # xgrammar refuses, llg enforces
    hand = factory.create_from_compiled(compiled(loose))
    assert isinstance(hand, HandOverMatcher)
    factory.release()
    rows.of(hand)
    assert hand.served_by == "llguidance"
    assert "UnsupportedGuideError" in hand.handover_failed_reason
    with pytest.raises(UnsupportedGuideError, match="neither backend"):
        compiled(GuidedDecodingParams.json_schema({"type": "array", "uniqueItems": True}),
                 release=True)


def test_an_escape_xgrammar_refuses_keeps_the_request_on_llguidance(tok, sides):
    """xgrammar takes no escape inside a length-limited string (stricter than the schema;
    docs/CONFORMANCE.md), llguidance does: a request that wrote one before the switch is not
    handed over (the replay is refused, the reason recorded) and goes on, on llguidance, to a
    text the schema accepts."""
    factory = held_factory(tok, sides)
    schema = {"type": "object", "properties": {"s": {"type": "string", "maxLength": 8}},
              "required": ["s"]}
    params = GuidedDecodingParams.json_schema(schema)
    hand = factory.create_from_compiled(factory.compile_async(params).result(10, backend="auto"))
    rows = Rows(factory.config.vocab_size_padded)
    tokens = encode_continuation(tok, '{"s": "a\\nb"}') + [tok.eos_token_id]
    for k, t in enumerate(tokens):
        if k == 6:
            factory.release()
        rows.of(hand)
        assert hand.accept_token(t), k
    assert hand.is_terminated() and hand.served_by == "llguidance"
    assert "xgrammar refused token" in hand.handover_failed_reason


def test_auto_config_validation(tok):
    """backend='auto' is validated like the others, and is not the default."""
    assert GuidedDecodingConfig.from_tokenizer(tok).backend is GuidedDecodingBackend.XGRAMMAR
    assert GuidedDecodingConfig.from_tokenizer(tok, backend="AUTO").backend \
        is GuidedDecodingBackend.AUTO
    with pytest.raises(ConfigError, match="ignore"):
        GuidedDecodingConfig.from_tokenizer(tok, backend="auto", json_unenforced_keywords="ignore")
    with pytest.raises(ConfigError, match="exactly one stop token"):
        GuidedDecodingConfig.from_tokenizer(tok, backend="auto", stop_token_ids=[1, 2])
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        GuidedDecodingConfig(backend="auto", encoded_vocab=["a", "b"])


def test_a_compile_a_request_waits_for_never_queues_behind_background_ones(tok,
                                                                           monkeypatch):
    """With one compile thread, a hand-over guide's xgrammar compile (background: llguidance
    serves its request) that runs on does not hold back an xgrammar-only guide's compile."""
    import threading
    import uuid
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tok, backend="auto", compile_threads=1, compile_disk_cache_bytes=0))
    xgr = factory.xgrammar
    held = GuidedDecodingParams.regex(f"id-{uuid.uuid4().hex}-[0-9]{{1,4}}")
    release, started = threading.Event(), threading.Event()

    def compile_(params, _compile=xgr._compile):
        if params == held:  # (a compile that takes long)
            started.set()
            release.wait(60)
        return _compile(params)

    monkeypatch.setattr(xgr, "_compile", compile_)
    try:
        compiled = factory.compile_async(held).result(10, backend="auto")
        assert compiled.backend == "auto" and started.wait(10)
        ebnf = GuidedDecodingParams.ebnf(f'root ::= "{uuid.uuid4().hex}" | "no"')
        assert factory.compile_async(ebnf).result(5, backend="auto").backend == "xgrammar"
        assert not compiled.payload.xgrammar.done()
        release.set()
        assert compiled.payload.xgrammar.result(30, backend="xgrammar").backend == "xgrammar"
    finally:
        release.set()
        factory.close()


def test_create_matcher_factory_builds_the_hand_over(tok):
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok, backend="auto"))
    try:
        assert isinstance(factory, HandOverMatcherFactory)
        assert factory.xgrammar.config.backend is GuidedDecodingBackend.XGRAMMAR
        assert factory.llguidance.config.backend is GuidedDecodingBackend.LLGUIDANCE
    finally:
        factory.close()


def _generate(make_decoder, factory, tok, jobs, release_step: int, seed: int):
    """Random generation under the mask through a decoder built by ``make_decoder``; the
    xgrammar compiles are released before step ``release_step``. Returns the texts and the
    backends that served each slot at the end."""
    from capgraph.requests import GuidedRequest
    V = factory.config.vocab_size_padded
    eos = tok.eos_token_id
    dec, execute = make_decoder(factory, len(jobs))
    gen = torch.Generator().manual_seed(seed)
    tilt = torch.zeros(V)
    for text, weight in (('"', 6.0), ("}", 8.0), ("]", 8.0), ("1", 4.0)):
        tilt[encode_continuation(tok, text)[-1]] += weight
    tilt[eos] += 10.0
    outputs: dict[int, list[int]] = {i: [] for i in range(len(jobs))}
    done: set[int] = set()
    served: dict[int, str] = {}
    try:
        for step in range(120):
            if step == release_step:
                factory.release()
            live = [i for i in range(len(jobs)) if i not in done]
            if not live:
                break
            reqs = [GuidedRequest.context(i, i, jobs[i][0]) if step == 0 else
                    GuidedRequest.generation(i, i, jobs[i][0], outputs[i][-1]) for i in live]
            dec.add_batch(reqs)
            logits = torch.randn(len(live), V, generator=gen) + tilt
            assert execute(dec, logits) == []
            for row, i in enumerate(live):
                token = int(logits[row].argmax())
                assert logits[row, token] != float("-inf")
                if token == eos:
                    done.add(i)
                    served[i] = dec.grammar_matchers[i].served_by
                else:
                    outputs[i].append(token)
    finally:
        dec.close()
    assert done == set(range(len(jobs))), "a generation did not finish"
    assert all(len(o) > release_step for o in outputs.values()), "ended before the hand-over"
    return [tok.decode(outputs[i]) for i in range(len(jobs))], served


def _eager(factory, n):
    from capgraph.decoder import GuidedDecoder
    return GuidedDecoder(factory.config, n, 0, factory=factory), \
        lambda dec, logits: dec.execute(logits)


def _capturable(factory, n):
    import hostfunc
    from capgraph.capturable import CapturableGuidedDecoder
    dec = CapturableGuidedDecoder(factory.config, n, 0, factory=factory)

    def execute(dec, logits):
        dec.execute(logits)
        hostfunc.drain()
        return dec.take_failed_requests()
    return dec, execute


@pytest.mark.parametrize("make_decoder", [_eager, _capturable], ids=["eager", "capturable"])
def test_generation_with_auto_validates(tok, sides, make_decoder):
    """A full generation through the decoder with backend='auto', the xgrammar compiles landing
    mid-generation: every output validates (schema) or matches (regex), and the requests
    ended on xgrammar."""
    import re

    jsonschema = pytest.importorskip("jsonschema")
    factory = held_factory(tok, sides)
    schema = {"type": "object", "properties": {"n": {"type": "integer"},
                                               "tags": {"type": "array", "maxItems": 2,
                                                        "items": {"type": "string",
                                                                  "maxLength": 4}}},
              "required": ["n"], "additionalProperties": False}
    regex = r"[a-c]{2,6}-\d{1,3}"
    jobs = [(GuidedDecodingParams.json_schema(schema), "schema"),
            (GuidedDecodingParams.regex(regex), "regex")]
    texts, served = _generate(make_decoder, factory, tok, jobs, release_step=3, seed=1)
    jsonschema.validate(json.loads(texts[0]), schema)
    assert re.fullmatch(regex, texts[1]), texts[1]
    assert served == {0: "xgrammar", 1: "xgrammar"}


def test_backend_agreement_tool_counts_rows(capsys):
    """``tools/backend_agreement.py`` (the figures README gives for the two backends' masks)
    runs over the bundled schemas and reports rows compared, equal, and llguidance-only."""
    from conftest import load_tool

    assert load_tool("backend_agreement").main(["--limit", "3"]) == 0
    out = capsys.readouterr().out
    figures = {name.strip(): int(value) for name, _, value in
               (line.partition(":") for line in out.splitlines())
               if value.strip().isdigit()}
    assert figures["schemas compared"] >= 1 and figures["rows"] > 0
    assert 0 <= figures["rows equal"] <= figures["rows"]
    assert 0 <= figures["rows where llguidance allows a token xgrammar refuses"] <= figures["rows"]
