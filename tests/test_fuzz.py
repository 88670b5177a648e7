"""Property-based fuzzing: random guide texts, random JSON schemas and random token streams.

Whatever the input, capgraph either works or answers with one of its named errors
(:class:`~capgraph.errors.CapgraphError` subclasses), raised for batch-level mistakes or reported
per request in the failed list; the process never crashes, no NaN appears and no guided row is
left with every token masked. Examples are kept modest so the file runs in well under a minute.
"""

from __future__ import annotations

import json
import os
import string

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import capgraph.errors
from capgraph import (CapgraphError, ConfigError, GrammarCompileError, GuidedDecodingConfig,
                      GuidedDecodingParams, GuideType)
from capgraph.bitmask import allocate_host_bitmask
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.grammar import create_matcher_factory
from capgraph.grammar.llguidance_backend import available as llg_available
from capgraph.requests import GuidedRequest
from capgraph.tokenizers import encode_continuation
from cases import CASES

# CI runs a fixed, modest set of examples; CAPGRAPH_FUZZ_EXAMPLES=2000 hunts with fresh random
# ones (that is how the bugs listed in docs/RELIABILITY.md were looked for).
_EXAMPLES = int(os.environ.get("CAPGRAPH_FUZZ_EXAMPLES", "0"))
FUZZ = settings(max_examples=_EXAMPLES or 60, deadline=None, derandomize=not _EXAMPLES,
                database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture,
                                       HealthCheck.filter_too_much])
NAMED = set(capgraph.errors.__all__)
BACKENDS = ["xgrammar"] + (["llguidance"] if llg_available() else [])


@pytest.fixture(scope="module")
def factories(factory_cache):
    return {b: factory_cache("tekken", b) for b in BACKENDS}


def _named(message: str) -> bool:
    """A failed-list message starts with a capgraph error name (``Type: detail``), possibly
    after the callback's name (``build: Type: detail``)."""
    parts = message.split(": ")
    return parts[0] in NAMED or (len(parts) > 1 and parts[1] in NAMED)


# -- guide texts -------------------------------------------------------------------------------

# No digits: a random "a{99999}" would be a legitimately slow compile, not a bug.
REGEX_ALPHABET = "ab.|()[]{}*+?^$\\-,:=!<>dws" + "xyz"
EBNF_ALPHABET = 'root:=|()[]*+?"ab ;\n\\-' + "xyz"
TEXT_ALPHABET = string.ascii_letters + string.punctuation + " \n"


@FUZZ
@given(backend=st.sampled_from(BACKENDS),
       guide_type=st.sampled_from([GuideType.JSON_SCHEMA, GuideType.REGEX,
                                   GuideType.EBNF_GRAMMAR, GuideType.STRUCTURAL_TAG]),
       text=st.one_of(st.text(REGEX_ALPHABET, max_size=40), st.text(EBNF_ALPHABET, max_size=60),
                      st.text(TEXT_ALPHABET, max_size=60),
                      st.builds(lambda a, b: f"root ::= {a}", st.text(EBNF_ALPHABET, max_size=40),
                                st.none())))
def test_random_guide_text_compiles_or_raises_a_named_error(factories, backend, guide_type, text):
    """Random text given as a JSON schema, regex, EBNF grammar or structural tag either compiles
    (and its matcher then fills a mask without error) or raises ConfigError (empty guide) or
    GrammarCompileError naming the guide type and the backend; nothing else escapes."""
    factory = factories[backend]
    try:
        params = GuidedDecodingParams(guide_type, text)
    except ConfigError:
        assert not text.strip()
        return
    try:
        compiled = factory.compile(params)
    except GrammarCompileError as e:
        assert e.guide_type == guide_type.name and e.backend == backend
        return
    matcher = factory.create_from_compiled(compiled)
    row = allocate_host_bitmask(1, factory.config.vocab_size_padded)
    try:
        matcher.fill_next_token_bitmask(row, 0)
    except CapgraphError:
        pass


_KEYWORDS = ["type", "properties", "required", "items", "enum", "const", "anyOf", "oneOf",
             "allOf", "not", "pattern", "minLength", "maxLength", "minimum", "maximum",
             "exclusiveMinimum", "minItems", "maxItems", "additionalProperties", "format",
             "$ref", "$defs", "if", "then", "prefixItems", "multipleOf", "uniqueItems",
             "propertyNames", "default", "title"]
_TYPES = ["string", "integer", "number", "boolean", "null", "object", "array", "mystery"]
_scalars = st.one_of(st.sampled_from(_TYPES), st.integers(-20, 20),
                     st.floats(-1e3, 1e3, allow_nan=False), st.booleans(), st.none(),
                     st.text("abcxyz^$[]()*+.|-", max_size=8),
                     st.sampled_from(["#", "#/$defs/a", "#/nope", "http://example.com/s.json",
                                      "date-time", "email", "uuid", "[a-z]+", "^x{1,3}$"]))
_schemas = st.recursive(
    st.one_of(_scalars, st.fixed_dictionaries({"type": st.sampled_from(_TYPES)})),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.sampled_from(_KEYWORDS), inner, max_size=4),
        st.builds(lambda props: {"type": "object", "properties": props},
                  st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3))),
    max_leaves=10)


@FUZZ
@given(backend=st.sampled_from(BACKENDS), schema=_schemas,
       kind=st.sampled_from(["eager", "capturable"]))
def test_random_json_schema_fails_alone_in_a_batch(factories, backend, schema, kind):
    """A random JSON-schema-shaped document, sent as a request next to a good one, compiles or
    fails that request alone with a named error in the failed list; the good request's row is
    masked exactly as when it runs alone; no NaN, no row with every token masked."""
    factory = factories[backend]
    V = factory.config.vocab_size_padded
    good = GuidedDecodingParams.regex("[a-z]{1,8}@[a-z]{2,6}")
    try:
        fuzz = GuidedDecodingParams.json_schema(json.dumps(schema))
    except ConfigError:
        return
    cls = GuidedDecoder if kind == "eager" else CapturableGuidedDecoder
    dec = cls(factory.config, 2, 0, factory=factory)
    try:
        logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0))
        dec.add_batch([GuidedRequest.context(1, 0, fuzz), GuidedRequest.context(2, 1, good)])
        failed = dec.execute(logits)
        failed = dec.take_failed_requests() if kind == "capturable" else failed
        assert all(rid == 1 and _named(msg) for rid, msg in failed), failed
        alone = torch.randn(2, V, generator=torch.Generator().manual_seed(0))[1:]
        solo = GuidedDecoder(factory.config, 2, 0, factory=factory)
        solo.add_batch([GuidedRequest.context(2, 1, good)])
        assert solo.execute(alone) == []
        assert torch.equal(logits[1].view(torch.int32), alone[0].view(torch.int32))
        assert not torch.isnan(logits).any()
        assert torch.isfinite(logits).any(dim=1).all()
    finally:
        dec.close()


# -- token streams -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_factory():
    """A raw 6-token vocabulary padded to 64: random ids are often valid, padding ids exist."""
    vocab = ["a", "b", "</s>", "ab", "c", "d"]
    config = GuidedDecodingConfig(encoded_vocab=vocab, stop_token_ids=[2], vocab_size_padded=64)
    return create_matcher_factory(config)


TINY_GUIDES = [GuidedDecodingParams.ebnf('root ::= "a" "x" | "b" "a" "x" | ("a" | "b")+'),
               GuidedDecodingParams.regex("(ab|c)+d?"), GuidedDecodingParams.json(),
               GuidedDecodingParams.regex("(unclosed"), None]


def _token(V: int):
    return st.one_of(st.integers(0, 5), st.integers(0, V - 1), st.integers(V, V + 50),
                     st.integers(-5, -1), st.sampled_from([2]))


def _stream(V: int, S: int, K: int):
    """Steps of random requests: kind, slot (sometimes out of range), guide, tokens, drafts."""
    request = st.tuples(st.booleans(), st.integers(-1, S), st.integers(0, len(TINY_GUIDES) - 1),
                        _token(V), st.lists(_token(V), max_size=K + 1), st.integers(-1, K + 1))
    return st.lists(st.tuples(st.integers(0, K), st.lists(request, min_size=1, max_size=S)),
                    min_size=1, max_size=8)


def _drive(dec, factory, steps, K) -> None:
    V = factory.config.vocab_size_padded
    capturable = isinstance(dec, CapturableGuidedDecoder)
    for i, (draft_len, spec) in enumerate(steps):
        reqs = []
        for j, (ctx, slot, g, token, drafts, accepted) in enumerate(spec):
            params = TINY_GUIDES[g]
            if ctx:
                reqs.append(GuidedRequest.context(100 * i + j, slot, params))
            else:
                reqs.append(GuidedRequest.generation(100 * i + j, slot, params, token,
                                                     draft_tokens=drafts,
                                                     num_accepted_draft_tokens=accepted))
        dec.add_batch(reqs, runtime_draft_len=draft_len)
        if K:
            if capturable:
                dec.rollback_rejected_batch(torch.tensor(
                    [1 + max(-1, r.num_accepted_draft_tokens or 0) for r in reqs],
                    dtype=torch.int32))
            else:
                dec.rollback_rejected_tokens()
        n = dec.requests.num_bitmask_tokens
        logits = torch.randn(n, V)
        before = logits.clone()
        failed = dec.execute(logits)
        failed = dec.take_failed_requests() if capturable else failed
        ids = {r.request_id for r in reqs} | {100 * (i - 1) + j for j in range(len(reqs) + 8)}
        assert all(rid in ids and _named(msg) for rid, msg in failed), failed
        assert not torch.isnan(logits).any()
        assert torch.isfinite(logits).any(dim=1).all(), "a row with every token masked"
        untouched = dec.token_mask_host[:n] == 0
        assert torch.equal(logits[untouched].view(torch.int32), before[untouched].view(torch.int32))


@FUZZ
@given(kind=st.sampled_from(["eager", "capturable"]), K=st.integers(0, 2), data=st.data())
def test_random_token_streams_only_fail_requests(tiny_factory, kind, K, data):
    """Random batches (context/generation, slots in and out of range, duplicates, valid, padded,
    out-of-vocab and negative tokens and drafts, bad accepted counts, random draft lengths and
    guides, a bad guide among them) never raise from execute: every problem is a named error in
    the failed list with an id of the step, rows left unmasked are untouched, and no row is NaN
    or entirely masked."""
    S = 3
    steps = data.draw(_stream(tiny_factory.config.vocab_size_padded, S, K))
    cls = GuidedDecoder if kind == "eager" else CapturableGuidedDecoder
    dec = cls(tiny_factory.config, S, K, factory=tiny_factory)
    try:
        _drive(dec, tiny_factory, steps, K)
    finally:
        dec.close()


@FUZZ
@given(seed=st.integers(0, 2**31 - 1), kind=st.sampled_from(["eager", "capturable"]),
       noise=st.floats(0.0, 1.0))
def test_noisy_real_token_streams_on_tekken(factories, tekken, seed, kind, noise):
    """Real texts of the shared cases fed as token streams with a random fraction of tokens
    replaced by random ids (in or out of the 131k vocabulary), drafts taken from the stream:
    only named per-request failures, no NaN, no all-masked row, on every backend."""
    import random
    rng = random.Random(seed)
    backend = rng.choice(BACKENDS)
    factory = factories[backend]
    V = factory.config.vocab_size_padded
    cases = [c for c in CASES if c.params.guide_type in (GuideType.JSON_SCHEMA, GuideType.REGEX)]
    texts = [encode_continuation(tekken, c.valid) + [factory.config.stop_token_ids[0]]
             for c in cases]
    streams = [[t if rng.random() > noise else rng.choice([rng.randrange(V), V + 3, -2])
                for t in text] for text in texts]
    cls = GuidedDecoder if kind == "eager" else CapturableGuidedDecoder
    dec = cls(factory.config, len(cases), 2, factory=factory)
    try:
        for step in range(min(12, max(len(s) for s in streams))):
            reqs = []
            for i, (c, s) in enumerate(zip(cases, streams)):
                if step == 0:
                    reqs.append(GuidedRequest.context(i, i, c.params))
                elif step < len(s):
                    reqs.append(GuidedRequest.generation(i, i, c.params, s[step - 1],
                                                         draft_tokens=s[step:step + 2],
                                                         num_accepted_draft_tokens=0))
            if not reqs:
                break
            dec.add_batch(reqs, runtime_draft_len=2)
            if step:
                if kind == "capturable":
                    dec.rollback_rejected_batch(torch.ones(len(reqs), dtype=torch.int32))
                else:
                    dec.rollback_rejected_tokens()
            logits = torch.randn(dec.requests.num_bitmask_tokens, V)
            failed = dec.execute(logits)
            failed = dec.take_failed_requests() if kind == "capturable" else failed
            assert all(_named(msg) for _, msg in failed), failed
            assert not torch.isnan(logits).any()
            assert torch.isfinite(logits).any(dim=1).all()
    finally:
        dec.close()
