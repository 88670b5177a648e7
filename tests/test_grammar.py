"""Grammar backends on real tokenizers: teacher forcing, rejection, rollback, termination, errors."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from capgraph import (CompileTimeoutError, ConfigError, GrammarCompileError,
                      GuidedDecodingConfig, GuidedDecodingParams, GuideType, MatcherError,
                      UnsupportedGuideError)
from capgraph.bitmask import allocate_host_bitmask
from capgraph.grammar import GrammarMatcher, GrammarMatcherFactory
from capgraph.grammar.cache import ByteLRUCache
from capgraph.grammar.llguidance_backend import available as llg_available
from capgraph.tokenizers import encode_continuation
from cases import CASES, LLG_CASES, Case
from conftest import TOKENIZERS, bits_of

needs_llg = pytest.mark.skipif(not llg_available(),
                               reason="llguidance extra not installed (pip install capgraph[llguidance])")


def teacher_force(factory, tok, case: Case, text: str):
    """Feed ``text``'s tokens; return (matcher, tokens, number accepted before a rejection)."""
    matcher = factory.create(case.params)
    tokens = encode_continuation(tok, text)
    mask = allocate_host_bitmask(1, factory.config.vocab_size_padded)
    for i, t in enumerate(tokens):
        mask.zero_()
        matcher.fill_next_token_bitmask(mask, 0)
        allowed = bool(bits_of(mask[0], factory.config.vocab_size_padded)[t])
        accepted = matcher.accept_token(t)
        assert allowed == accepted, f"mask and accept_token disagree on token {i} ({t})"
        if not accepted:
            return matcher, tokens, i
    return matcher, tokens, len(tokens)


def _eos(factory) -> int:
    return factory.config.stop_token_ids[0]


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_valid_text_is_accepted_token_by_token(factory_cache, tokenizer_cache, tok_name, case):
    """Every token of a valid text is inside the filled mask and accepted; then EOS terminates."""
    factory = factory_cache(tok_name)
    matcher, tokens, n = teacher_force(factory, tokenizer_cache(tok_name), case, case.valid)
    assert n == len(tokens)
    assert not matcher.is_terminated()
    mask = allocate_host_bitmask(1, factory.config.vocab_size_padded)
    matcher.fill_next_token_bitmask(mask, 0)
    assert bits_of(mask[0], factory.config.vocab_size_padded)[_eos(factory)], "EOS not allowed"
    assert matcher.accept_token(_eos(factory))
    assert matcher.is_terminated()
    assert not matcher.accept_token(tokens[0]), "a terminated matcher accepted a token"


@pytest.mark.parametrize("tok_name", TOKENIZERS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_invalid_text_is_rejected(factory_cache, tokenizer_cache, tok_name, case):
    """Some token of an invalid text is outside the mask and rejected by accept_token."""
    factory = factory_cache(tok_name)
    _, tokens, n = teacher_force(factory, tokenizer_cache(tok_name), case, case.invalid)
    assert n < len(tokens)


@pytest.mark.parametrize("case", CASES[:4], ids=lambda c: c.name)
def test_rollback_restores_state(factory_cache, tekken, case):
    """After rollback(k) the mask equals the mask seen k tokens earlier, EOS included."""
    factory = factory_cache("tekken")
    V = factory.config.vocab_size_padded
    tokens = encode_continuation(tekken, case.valid)
    matcher = factory.create(case.params)
    masks = allocate_host_bitmask(len(tokens) + 2, V)
    for i, t in enumerate(tokens):
        matcher.fill_next_token_bitmask(masks, i)
        assert matcher.accept_token(t)
    matcher.fill_next_token_bitmask(masks, len(tokens))
    assert matcher.accept_token(_eos(factory)) and matcher.is_terminated()
    matcher.rollback(1)  # the stop token counts as one step
    assert not matcher.is_terminated()
    for k in (1, 3, len(tokens)):
        k = min(k, len(tokens))
        probe = allocate_host_bitmask(1, V)
        matcher.rollback(k)
        matcher.fill_next_token_bitmask(probe, 0)
        assert torch.equal(probe[0], masks[len(tokens) - k])
        for t in tokens[len(tokens) - k:]:
            assert matcher.accept_token(t)


def test_padded_vocab_tail_is_always_masked(factory_cache, tekken):
    """Ids at or above the tokenizer's vocabulary are never allowed on a guided row."""
    factory = factory_cache("tekken", pad=61)
    V = factory.config.vocab_size_padded
    assert V == len(tekken) + 61
    matcher = factory.create(GuidedDecodingParams(GuideType.JSON_SCHEMA, '{"type": "string"}'))
    mask = allocate_host_bitmask(1, V)
    # at the start (only '"' fits) and inside the string (almost everything fits)
    for t in [None, *tekken.encode('"abc', add_special_tokens=False)]:
        if t is not None:
            assert matcher.accept_token(t)
        mask.fill_(-1)  # garbage everywhere: the fill must clear the tail itself
        matcher.fill_next_token_bitmask(mask, 0)
        bits = bits_of(mask[0], V)
        assert bits[:len(tekken)].any()
        assert not bits[len(tekken):].any()


@pytest.mark.parametrize("ffi", [True, False])
def test_batch_fill_equals_serial_fill(factory_cache, tekken, monkeypatch, ffi):
    """The multi-threaded batch fill writes the same rows as filling matchers one by one,
    through xgrammar's FFI objects or (an xgrammar without them) its Python batch call."""
    factory = factory_cache("tekken")
    if not ffi:
        monkeypatch.setattr(factory, "_batch_fill_ffi", None)
        calls = []
        batch_call = factory._batch.batch_fill_next_token_bitmask
        monkeypatch.setattr(factory._batch, "batch_fill_next_token_bitmask",
                            lambda *a: (calls.append(1), batch_call(*a)))
    V = factory.config.vocab_size_padded
    matchers = []
    for case in CASES:
        m = factory.create(case.params)
        for t in encode_continuation(tekken, case.valid)[:3]:
            assert m.accept_token(t)
        matchers.append(m)
    rows = list(range(1, 2 * len(matchers), 2))
    serial = allocate_host_bitmask(2 * len(matchers), V)
    batch = allocate_host_bitmask(2 * len(matchers), V)
    for m, r in zip(matchers, rows):
        m.fill_next_token_bitmask(serial, r)
    factory.batch_fill(matchers, batch, rows)
    assert torch.equal(serial, batch)
    if not ffi:
        assert calls == [1]  # threaded, not the one-by-one loop


# -- named errors ----------------------------------------------------------------------------

BAD_GUIDES = [
    (GuideType.JSON_SCHEMA, '{"type": "object", "properties": {', "JSON_SCHEMA"),
    (GuideType.REGEX, "(ab[", "REGEX"),
    (GuideType.EBNF_GRAMMAR, 'root ::= "a" | ', "EBNF_GRAMMAR"),
    (GuideType.STRUCTURAL_TAG, '{"type": "structural_tag", "format": {"type": "nope"}}',
     "STRUCTURAL_TAG"),
]


@pytest.mark.parametrize("guide_type,guide,name", BAD_GUIDES, ids=lambda x: str(x)[:20])
def test_malformed_guides_raise_named_compile_errors(factory_cache, guide_type, guide, name):
    """Malformed schema, regex, EBNF and structural tag raise GrammarCompileError with context."""
    factory = factory_cache("tekken")
    with pytest.raises(GrammarCompileError) as info:
        factory.compile(GuidedDecodingParams(guide_type, guide))
    assert info.value.guide_type == name and info.value.backend == "xgrammar"
    assert name in str(info.value) and "xgrammar" in str(info.value)
    assert factory.stats.failures >= 1


def test_lark_given_to_xgrammar_is_named(factory_cache):
    """Lark text given to xgrammar's EBNF fails with a hint that names the syntax mix-up."""
    from cases import ARITH_LARK
    with pytest.raises(GrammarCompileError, match="looks like Lark"):
        factory_cache("tekken").compile(GuidedDecodingParams(GuideType.EBNF_GRAMMAR, ARITH_LARK))


def test_compile_errors_keep_the_request_id(factory_cache):
    """A failed async compile re-raised for a request carries that request's id."""
    factory = factory_cache("tekken")
    handle = factory.compile_async(GuidedDecodingParams(GuideType.REGEX, "(unclosed"))
    with pytest.raises(GrammarCompileError) as info:
        handle.result(30.0, backend="xgrammar", request_id=42)
    assert info.value.request_id == 42 and "request_id=42" in str(info.value)


@pytest.mark.parametrize("kwargs,field", [
    (dict(backend="tensorrt"), "backend"),
    (dict(vocab_size_padded=10), "vocab_size_padded"),
    (dict(vocab_size_padded=-5), "vocab_size_padded"),
    (dict(vocab_size_padded=131072.0), "vocab_size_padded"),
    (dict(stop_token_ids=[10**9]), "stop_token_ids"),
    (dict(compile_timeout_s=0), "compile_timeout_s"),
    (dict(compile_threads=0), "compile_threads"),
    (dict(backend="llguidance", stop_token_ids=[1, 2]), "stop_token_ids"),
])
def test_config_validation_names_the_field(tekken, kwargs, field):
    """GuidedDecodingConfig rejects bad values with a ConfigError naming the field."""
    with pytest.raises(ConfigError, match=field):
        GuidedDecodingConfig.from_tokenizer(tekken, **kwargs)


def test_vocab_size_padded_defaults_to_the_tokenizers_vocabulary(tekken):
    """0 (the default) and None both mean the tokenizer's vocabulary; the attribute is an int."""
    for kwargs in ({}, dict(vocab_size_padded=0), dict(vocab_size_padded=None)):
        config = GuidedDecodingConfig.from_tokenizer(tekken, **kwargs)
        assert config.vocab_size_padded == len(tekken) == config.tokenizer_vocab_size
    assert GuidedDecodingConfig.from_tokenizer(
        tekken, vocab_size_padded=len(tekken) + 64).vocab_size_padded == len(tekken) + 64


def test_cache_env_override(tekken, monkeypatch):
    """CAPGRAPH_COMPILE_CACHE_BYTES sets the default cache budget, an explicit value wins
    over it; junk is named."""
    monkeypatch.setenv("CAPGRAPH_COMPILE_CACHE_BYTES", "64M")
    assert GuidedDecodingConfig.from_tokenizer(tekken).compile_cache_bytes == 64 << 20
    assert GuidedDecodingConfig.from_tokenizer(
        tekken, compile_cache_bytes=1 << 20).compile_cache_bytes == 1 << 20
    monkeypatch.setenv("CAPGRAPH_COMPILE_CACHE_BYTES", "lots")
    with pytest.raises(ConfigError, match="CAPGRAPH_COMPILE_CACHE_BYTES"):
        GuidedDecodingConfig.from_tokenizer(tekken)


@pytest.mark.parametrize("guide_type,guide", [("mystery", "x"), (GuideType.REGEX, ""),
                                              (GuideType.JSON_SCHEMA, "   ")])
def test_params_validation(guide_type, guide):
    """Unknown guide types and empty guides are ConfigErrors naming the field."""
    with pytest.raises(ConfigError, match="guide"):
        GuidedDecodingParams(guide_type, guide)


def test_params_accept_strings_and_dicts():
    """Guide types can be given by value or name; a schema dict is serialised."""
    p = GuidedDecodingParams("json_schema", {"type": "integer"})  # type: ignore[arg-type]
    assert p.guide_type is GuideType.JSON_SCHEMA and json.loads(p.guide) == {"type": "integer"}
    assert GuidedDecodingParams("REGEX", "a+").guide_type is GuideType.REGEX


# -- compile cache and thread pool -----------------------------------------------------------

class _SlowFactory(GrammarMatcherFactory):
    """A backend whose compile sleeps; pins the base class's cache, pool and timeout."""

    backend_name = "fake"

    def __init__(self, config, delay: float, nbytes: int = 100, quick: tuple[str, ...] = ()):
        super().__init__(config)
        self.delay, self.nbytes, self.calls = delay, nbytes, 0
        self.quick = quick  # guides that compile at once, whatever the delay

    def _compile(self, params):
        self.calls += 1
        time.sleep(0.0 if params.guide in self.quick else self.delay)
        return params.guide, self.nbytes

    def create_from_compiled(self, compiled) -> GrammarMatcher:  # pragma: no cover
        raise NotImplementedError


def _vocab_config(**kw):
    return GuidedDecodingConfig(encoded_vocab=[chr(97 + i) for i in range(26)], **kw)


def test_concurrent_compiles_of_one_guide_share_one_compile():
    """Many simultaneous requests for one guide run one compile; later ones hit the cache."""
    factory = _SlowFactory(_vocab_config(), delay=0.2)
    p = GuidedDecodingParams(GuideType.REGEX, "a+")
    handles = [factory.compile_async(p) for _ in range(8)]
    results = [h.result(5.0, backend="fake") for h in handles]
    assert all(r is results[0] for r in results)
    assert factory.calls == 1 and factory.stats.inflight_hits == 7
    factory.compile_async(p).result(5.0, backend="fake")
    assert factory.stats.cache_hits == 1 and factory.calls == 1
    factory.close()


def test_compile_timeout_fails_only_that_handle():
    """A compile past the timeout raises CompileTimeoutError; a quick one still succeeds."""
    factory = _SlowFactory(_vocab_config(compile_threads=2), delay=1.0, quick=("fast",))
    slow = factory.compile_async(GuidedDecodingParams(GuideType.REGEX, "slow"))
    fast = factory.compile_async(GuidedDecodingParams(GuideType.REGEX, "fast"))
    with pytest.raises(CompileTimeoutError) as info:
        slow.result(0.1, backend="fake", request_id=7)
    assert info.value.request_id == 7 and "0.1" in str(info.value)
    assert fast.result(5.0, backend="fake").payload == "fast"
    factory.close()


def test_compile_runs_off_the_calling_thread():
    """compile_async returns before the compile finishes (the pool does the work): the
    compile here waits for a gate that is opened only after compile_async has returned (run
    on the calling thread, it would return when the gate's 10 s wait ran out)."""
    gate = threading.Event()

    class Gated(_SlowFactory):
        def _compile(self, params):
            gate.wait(10)
            return super()._compile(params)

    factory = Gated(_vocab_config(), delay=0.0)
    t0 = time.perf_counter()
    handle = factory.compile_async(GuidedDecodingParams(GuideType.REGEX, "b+"))
    returned_s = time.perf_counter() - t0
    assert not handle.done() and returned_s < 5, returned_s
    gate.set()
    assert handle.result(10.0, backend="fake").payload == "b+"
    factory.close()


def test_byte_lru_cache_evicts_oldest_to_fit():
    """The cache never holds more bytes than its limit and evicts least recently used first."""
    cache: ByteLRUCache[str, int] = ByteLRUCache(100)
    for i in range(5):
        assert cache.put(f"k{i}", i, 30)
        assert cache.nbytes <= 100
    assert len(cache) == 3 and "k0" not in cache and "k1" not in cache
    cache.get("k2")  # refresh: k3 is now the oldest
    cache.put("k5", 5, 30)
    assert "k2" in cache and "k3" not in cache
    assert not cache.put("huge", 0, 101) and "huge" not in cache


def test_factory_cache_is_bounded_in_bytes(factory_cache, tekken):
    """Compiled grammars beyond the byte budget are evicted; the budget is never exceeded."""
    config = GuidedDecodingConfig.from_tokenizer(tekken, compile_cache_bytes=1)
    factory = _SlowFactory(config, delay=0.0, nbytes=1)
    for i in range(10):
        factory.compile(GuidedDecodingParams(GuideType.REGEX, f"a{i}"))
    assert factory.cache.nbytes <= 1 and len(factory.cache) == 1
    assert factory.cache.evictions == 9


def test_xgrammar_compile_releases_the_gil(factory_cache):
    """A compile on the pool lets the main thread run Python meanwhile (GIL released)."""
    factory = factory_cache("tekken")
    schema = {"type": "object", "properties": {
        f"f{i}": {"type": "array", "items": {"type": "string", "pattern": "[a-z]{2,8}"}}
        for i in range(30)}}
    handle = factory.compile_async(GuidedDecodingParams(GuideType.JSON_SCHEMA, json.dumps(schema)))
    ticks = 0
    while not handle.done():
        ticks += 1
        time.sleep(0.001)
    handle.result(60.0, backend="xgrammar")
    assert ticks > 0


# -- llguidance ------------------------------------------------------------------------------

@needs_llg
@pytest.mark.parametrize("case", LLG_CASES, ids=lambda c: c.name)
def test_llguidance_valid_and_invalid(factory_cache, tekken, case):
    """llguidance: valid texts are accepted token by token with EOS, invalid ones rejected."""
    factory = factory_cache("tekken", "llguidance")
    matcher, tokens, n = teacher_force(factory, tekken, case, case.valid)
    assert n == len(tokens)
    assert matcher.accept_token(_eos(factory)) and matcher.is_terminated()
    matcher.rollback(2)  # EOS (wrapper-level) + one real token
    assert not matcher.is_terminated()
    assert matcher.accept_token(tokens[-1])
    _, tokens, n = teacher_force(factory, tekken, case, case.invalid)
    assert n < len(tokens)


@needs_llg
def test_llguidance_rejects_unsupported_and_gbnf(factory_cache):
    """llguidance: structural tags are unsupported; GBNF given as EBNF is named as such."""
    from cases import ARITH_EBNF, STRUCTURAL_TAG
    factory = factory_cache("tekken", "llguidance")
    with pytest.raises(UnsupportedGuideError, match="STRUCTURAL_TAG"):
        factory.compile(GuidedDecodingParams(GuideType.STRUCTURAL_TAG, STRUCTURAL_TAG))
    with pytest.raises(GrammarCompileError, match="looks like GBNF"):
        factory.compile(GuidedDecodingParams(GuideType.EBNF_GRAMMAR, ARITH_EBNF))
    with pytest.raises(GrammarCompileError, match="llguidance"):
        factory.compile(GuidedDecodingParams(GuideType.JSON_SCHEMA, '{"type": 12}'))


@needs_llg
def test_llguidance_sticky_error_is_raised(factory_cache):
    """An llguidance matcher in its error state raises MatcherError at the call that caused it."""
    factory = factory_cache("tekken", "llguidance")
    matcher = factory.create(GuidedDecodingParams(GuideType.REGEX, "ab"))
    with pytest.raises(MatcherError, match="llguidance"):
        matcher.rollback(5)  # more than was ever consumed


@needs_llg
def test_llguidance_matchers_are_independent_copies_of_the_compiled_guide(factory_cache, tekken):
    """llguidance's compiled guide is a matcher built once (first mask computed); every request
    gets a copy: one advanced, rolled back or in error leaves the next one at the start, with
    the same first mask as a matcher built from the grammar text."""
    import llguidance
    import llguidance.torch
    factory = factory_cache("tekken", "llguidance")
    case = LLG_CASES[0]
    compiled = factory.compile(case.params)
    first = allocate_host_bitmask(2, factory.config.vocab_size_padded, pin=False)
    fresh = llguidance.LLMatcher(factory.tokenizer, compiled.payload.grammar, log_level=0)
    llguidance.torch.fill_next_token_bitmask(fresh, first, 0)
    advanced = factory.create_from_compiled(compiled)
    tokens = encode_continuation(tekken, case.valid)
    assert all(advanced.accept_token(t) for t in tokens[:3])
    with pytest.raises(MatcherError):
        advanced.rollback(50)  # more than it consumed: this copy is in error now
    factory.create_from_compiled(compiled).fill_next_token_bitmask(first, 1)
    assert torch.equal(first[0], first[1])
    assert not compiled.payload.template.is_error()
    again, _, n = teacher_force(factory, tekken, case, case.valid)
    assert n == len(tokens)


def test_threads_do_not_share_matcher_state(factory_cache, tekken):
    """Matchers created concurrently from one compiled guide advance independently."""
    factory = factory_cache("tekken")
    case = CASES[0]
    tokens = encode_continuation(tekken, case.valid)
    errors = []

    def run():
        try:
            _, _, n = teacher_force(factory, tekken, case, case.valid)
            assert n == len(tokens)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors


def test_a_queued_compile_every_waiter_gave_up_on_never_starts():
    """Pins: with one compile slot busy, a queued compile whose only waiter timed out is not
    run when the slot frees (it would hold the slot for a request that failed); asked for
    again later, the guide compiles afresh."""
    factory = _SlowFactory(_vocab_config(compile_threads=1), delay=0.5, quick=("b",))
    busy = factory.compile_async(GuidedDecodingParams(GuideType.REGEX, "a"))
    queued = factory.compile_async(GuidedDecodingParams(GuideType.REGEX, "b"))
    with pytest.raises(CompileTimeoutError):
        queued.result(0.05, backend="fake")
    assert busy.result(5.0, backend="fake").payload == "a"
    with pytest.raises(CompileTimeoutError, match="not started"):
        queued.future.result(timeout=5.0)
    assert factory.calls == 1
    again = factory.compile_async(GuidedDecodingParams(GuideType.REGEX, "b"))
    assert again.result(5.0, backend="fake").payload == "b" and factory.calls == 2
    factory.close()
