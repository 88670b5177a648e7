"""The reference decode loop: slot KV cache, sampler, drafters, generate() end to end.

A tiny random Llama over the 32k sentencepiece vocabulary keeps every forward cheap; guides are
bounded (string lengths, repetition counts) so that even a random model reaches their end.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph.grammar import create_matcher_factory
from capgraph.runtime import (ModelRunner, NgramDrafter, Sampler, SamplingParams, generate,
                              graph_batch_sizes, tiny_llama)

HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="no CUDA device")
try:
    from capgraph.capturable import CapturableGuidedDecoder  # noqa: F401
    HAS_CAPTURABLE = True
except ImportError:
    HAS_CAPTURABLE = False
needs_capturable = pytest.mark.skipif(not HAS_CAPTURABLE,
                                      reason="capturable decoder not available")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "get_time"]},
        "args": {
            "type": "object",
            "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 8},
                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "args"],
    "additionalProperties": False,
}
DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
KV = 'root ::= pair (";" pair){0,2}\npair ::= [a-z]{1,4} "=" [0-9]{1,3}'
JSON_G = GuidedDecodingParams.json_schema(SCHEMA)
DATE_G = GuidedDecodingParams.regex(DATE)
KV_G = GuidedDecodingParams.ebnf(KV)
PROMPTS = ["Call a tool:", "The date is", "Settings:", "Once upon a time", "Weather in Oslo:",
           "Born on", "Config:"]
GUIDES = [JSON_G, DATE_G, KV_G, None, JSON_G, DATE_G, KV_G]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def sp(tokenizer_cache):
    return tokenizer_cache("mistral-sp32k")


@pytest.fixture(scope="module")
def factory(sp):
    f = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(sp, json_whitespace="compact"))
    yield f
    f.close()


@pytest.fixture(scope="module")
def model(sp):
    return tiny_llama(len(sp), seed=0, eos_token_id=sp.eos_token_id)


def run(sp, model, factory, prompts=PROMPTS, guides=GUIDES, **kw):
    kw.setdefault("max_new_tokens", 40)
    kw.setdefault("max_batch_size", 4)
    return generate(prompts, guides, model=model, tokenizer=sp, factory=factory, **kw)


@pytest.fixture(scope="module")
def greedy_run(sp, model, factory):
    return run(sp, model, factory)


def check(result, params, factory) -> bool:
    """Validate an output that ended on its stop token without the decoder that made it."""
    if params.guide_type.value == "json_schema":
        import jsonschema
        try:
            jsonschema.validate(json.loads(result.text), json.loads(params.guide))
        except (ValueError, jsonschema.ValidationError):
            return False
        return True
    if params.guide_type.value == "regex":
        return re.fullmatch(params.guide, result.text) is not None
    matcher = factory.create(params)
    return all(matcher.accept_token(t) for t in result.tokens) and matcher.is_terminated()


# -- model runner ------------------------------------------------------------------------------

def test_slot_cache_decode_equals_full_forward():
    """Prefill into slots, then a batched multi-token decode step over slots of different
    lengths (and a padded batch) gives the logits of a plain cache-free forward."""
    m = tiny_llama(300, seed=3)
    r = ModelRunner(m, max_num_sequences=3, max_seq_len=32, tokens_per_seq=3)
    a, b = [5, 6, 7, 8, 9], [11, 12]
    with torch.no_grad():
        la = r.prefill(2, a)
        r.prefill(0, b)
        r.prefill(1, [40, 41, 42, 43, 44, 45, 46])  # a neighbour whose keys must not leak
        ref = lambda ids: m(input_ids=torch.tensor([ids])).logits[0]  # noqa: E731
        torch.testing.assert_close(la[0], ref(a)[-1])
        r.load_step([2, 0], [[1, 2, 3], [4, 5, 6]], [5, 2], batch_size=3)
        got = r.forward_step(3).view(3, 3, -1)
        torch.testing.assert_close(got[0], ref(a + [1, 2, 3])[-3:])
        torch.testing.assert_close(got[1], ref(b + [4, 5, 6])[-3:])
        # a rejected draft left stale keys at positions 3..4 of slot 0: overwriting works
        r.load_step([0], [[7, 8, 9]], [3])
        torch.testing.assert_close(r.forward_step(1).view(3, -1), ref(b + [4, 7, 8, 9])[-3:])


def test_tiny_llama_is_seeded_and_round_trips_through_a_checkpoint(tmp_path):
    """The same seed gives the same weights (the global RNG untouched), another seed others,
    and load_model reads a saved checkpoint back offline with identical logits."""
    from capgraph.runtime import load_model
    state = torch.random.get_rng_state()
    a, b, c = tiny_llama(200, seed=5), tiny_llama(200, seed=5), tiny_llama(200, seed=6)
    assert torch.equal(torch.random.get_rng_state(), state)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    a.save_pretrained(tmp_path)
    loaded = load_model(tmp_path)
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, a(input_ids=ids).logits)


def test_graph_batch_sizes():
    """Captured sizes: powers of two up to 8, then multiples of 8, always the maximum."""
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(6) == [1, 2, 4, 6]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]


# -- sampler -----------------------------------------------------------------------------------

def test_sampler_never_draws_masked_tokens_and_is_reproducible():
    """Temperature / top-k draws with a seed repeat exactly, differ across seeds, and never
    pick a -inf entry, even at extreme temperatures or with top_k above the finite count."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 500, generator=g) * 5
    allowed = torch.rand(64, 500, generator=g) < 0.02
    allowed[:, 7] = True
    logits[~allowed] = float("-inf")
    for temperature, top_k in ((1.0, 0), (1e-3, 0), (100.0, 0), (1.0, 3), (2.0, 400)):
        draws = [Sampler(SamplingParams(temperature, top_k, seed=s))(logits) for s in (1, 1, 2)]
        assert torch.equal(draws[0], draws[1])
        for d in draws:
            assert allowed.gather(1, d[:, None]).all(), (temperature, top_k)
    hot = Sampler(SamplingParams(5.0, 0, seed=1))(logits)
    assert not torch.equal(hot, Sampler(SamplingParams(5.0, 0, seed=2))(logits))
    assert torch.equal(Sampler(SamplingParams())(logits), logits.argmax(-1))


def test_top_k_keeps_only_the_k_best():
    """top_k=2 only ever returns one of the two largest logits of a row."""
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0, float("-inf")]]).repeat(200, 1)
    got = Sampler(SamplingParams(10.0, 2, seed=0))(logits)
    assert set(got.tolist()) == {1, 2}


# -- drafters ----------------------------------------------------------------------------------

def test_ngram_drafter_proposes_what_followed_the_latest_match():
    """The longest matching suffix wins, the latest occurrence wins, short matches are padded
    with their last token, and no match repeats the last token."""
    d = NgramDrafter(3, max_ngram=2)
    assert d.lookup([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 2, 3]) == [4, 5, 2]
    assert d.lookup([7, 1, 2, 8, 1, 2]) == [8, 1, 2]
    assert d.lookup([5, 6, 5]) == [6, 5, 5]
    assert d.lookup([1, 2, 3]) == [3, 3, 3]


# -- generate ----------------------------------------------------------------------------------

def test_guided_outputs_validate(greedy_run, factory):
    """Every JSON-schema / regex / EBNF output that ends on its stop token validates
    (jsonschema, re.fullmatch, a fresh matcher); the bounded guides all finish that way; the
    unguided request runs to the length limit; the timing breakdown covers every stage."""
    assert [r.index for r in greedy_run] == list(range(len(PROMPTS)))
    for r, g in zip(greedy_run, GUIDES):
        if g is None:
            assert r.finish_reason in ("stop", "length")
            continue
        assert r.finish_reason == "stop", (r.index, r.text)
        assert r.tokens[-1] == factory.config.stop_token_ids[0]
        assert check(r, g, factory), (r.index, r.text)
    stages = greedy_run.timings.stages
    assert all(stages[k] > 0 for k in ("prefill", "guide", "forward", "build", "apply",
                                       "sample"))
    assert greedy_run.timings.steps > 0 and greedy_run.timings.tokens == sum(
        len(r.tokens) for r in greedy_run)


@pytest.mark.parametrize("draft,same_weights", [("ngram", False), ("model", False),
                                                ("model", True)])
def test_speculative_equals_greedy(sp, model, factory, greedy_run, draft, same_weights):
    """With the n-gram drafter, a random draft model, or a draft model equal to the target
    (which gets drafts accepted), outputs equal non-speculative greedy token for token."""
    draft_model = tiny_llama(len(sp), seed=0) if same_weights else None
    for k in (1, 3):
        spec = run(sp, model, factory, draft=draft, num_draft_tokens=k, draft_model=draft_model)
        assert [r.tokens for r in spec] == [r.tokens for r in greedy_run], (draft, k)
        assert [r.finish_reason for r in spec] == [r.finish_reason for r in greedy_run]
        assert spec.timings.steps <= greedy_run.timings.steps
        if same_weights:
            assert sum(r.num_accepted_draft_tokens for r in spec) > 0


def test_more_requests_than_slots_each_with_its_own_grammar(sp, model, factory):
    """Seven requests through two slots all complete, in prompt order, each matching its own
    regex, and with the same tokens as when all run at once."""
    guides = [GuidedDecodingParams.regex(f"r{i}-[a-z]{{1,3}}") for i in range(7)]
    prompts = [f"Item {i}:" for i in range(7)]
    narrow = run(sp, model, factory, prompts, guides, max_batch_size=2)
    wide = run(sp, model, factory, prompts, guides, max_batch_size=7)
    for i, r in enumerate(narrow):
        assert r.index == i and r.finish_reason == "stop"
        assert re.fullmatch(f"r{i}-[a-z]{{1,3}}", r.text), r.text
    assert [r.tokens for r in narrow] == [r.tokens for r in wide]
    assert narrow[-1].queue_s > narrow[0].queue_s  # the last one waited for a free slot


def test_bad_guide_fails_alone(sp, model, factory):
    """A guide that does not compile ends its request with finish_reason 'error' and a message;
    the other requests produce exactly what they produce without it."""
    bad = GuidedDecodingParams.regex("(unclosed")
    prompts, guides = ["a", "b", "c"], [DATE_G, bad, None]
    mixed = run(sp, model, factory, prompts, guides, max_batch_size=2)
    assert mixed[1].finish_reason == "error" and "REGEX" in mixed[1].error
    assert mixed[1].tokens == []
    alone = run(sp, model, factory, ["a", "c"], [DATE_G, None], max_batch_size=2)
    assert [mixed[0].tokens, mixed[2].tokens] == [r.tokens for r in alone]
    assert mixed[0].error is None and mixed[0].finish_reason == "stop"


def test_sampled_generation_is_seeded_and_guided(sp, model, factory):
    """Temperature / top-k sampling repeats exactly with the same seed, differs with another,
    and guided outputs that finish still validate."""
    kw = dict(temperature=1.5, top_k=50, max_new_tokens=30)
    a = run(sp, model, factory, PROMPTS[:4], GUIDES[:4], seed=1, **kw)
    b = run(sp, model, factory, PROMPTS[:4], GUIDES[:4], seed=1, **kw)
    c = run(sp, model, factory, PROMPTS[:4], GUIDES[:4], seed=2, **kw)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    assert [r.tokens for r in a] != [r.tokens for r in c]
    for r, g in zip(a + c, GUIDES[:4] * 2):
        if g is not None and r.finish_reason == "stop":
            assert check(r, g, factory), r.text


def test_length_limit_and_argument_errors(sp, model, factory):
    """max_new_tokens caps every request ('length'), token-id prompts work, and bad arguments
    raise ConfigError naming the value."""
    from capgraph import ConfigError
    out = generate([[1, 500, 600], "x"], None, model=model, tokenizer=sp, max_new_tokens=3)
    assert [len(r.tokens) for r in out] == [3, 3]
    assert {r.finish_reason for r in out} <= {"length", "stop"}
    with pytest.raises(ConfigError, match="temperature=0"):
        generate(["x"], model=model, tokenizer=sp, draft="ngram", temperature=1.0)
    with pytest.raises(ConfigError, match="draft='beam'"):
        generate(["x"], model=model, tokenizer=sp, draft="beam")
    with pytest.raises(ConfigError, match="2 guides for 1 prompts"):
        generate(["x"], [None, None], model=model, tokenizer=sp)
    # token-id prompts and counts are checked, not truncated or cast (a bare ValueError /
    # TypeError before, and [1.9, 2.2] ran as [1, 2])
    for prompts, where in (([["a", "b"]], r"prompts\[0\]\[0\] is 'a'"),
                           ([[1.9, 2.2]], r"prompts\[0\]\[0\] is 1.9"),
                           ([[None]], r"prompts\[0\]\[0\] is None"),
                           ([[True, 5]], r"prompts\[0\]\[0\] is True"),
                           ([[10**9]], r"expected a token id in \[0, "),
                           ([7], r"prompts\[0\] is int")):
        with pytest.raises(ConfigError, match=where):
            generate(prompts, model=model, tokenizer=sp, max_new_tokens=2)
    for field, value in (("max_new_tokens", "5"), ("max_batch_size", 2.5)):
        with pytest.raises(ConfigError, match=f"{field}="):
            generate(["x"], model=model, tokenizer=sp, **{field: value})
    if not HAS_CAPTURABLE:
        with pytest.raises(ConfigError, match="capturable"):
            run(sp, model, factory, ["x"], [DATE_G], decoder="capturable")


def test_draft_count_seed_and_prompt_containers_are_checked(sp, model):
    """num_draft_tokens (with a drafter) and seed must be integers in range, and prompts and
    guides sequences with a length: anything else is a ConfigError naming the argument (not a
    TypeError from torch.zeros or len(), a ValueError from int(), or the model runner's
    message); NumPy integers are taken as integers."""
    import numpy as np

    from capgraph import ConfigError
    for value in (2.5, "2", -1, 0, True, None):
        with pytest.raises(ConfigError, match=re.escape(f"num_draft_tokens={value!r}: expected "
                                                        "an integer >= 1")):
            generate(["x"], model=model, tokenizer=sp, draft="ngram", num_draft_tokens=value)
    for value in ("x", 1.5, True, 2**64, -2**63 - 1):
        with pytest.raises(ConfigError, match=re.escape(f"seed={value!r}: expected an integer")):
            generate(["x"], model=model, tokenizer=sp, seed=value)
    with pytest.raises(ConfigError, match="prompts is a generator"):
        generate((p for p in ["x"]), model=model, tokenizer=sp)
    with pytest.raises(ConfigError, match="guides is a generator"):
        generate(["x"], (g for g in [None]), model=model, tokenizer=sp)
    out = generate(["x"], model=model, tokenizer=sp, max_new_tokens=2, draft="ngram",
                   num_draft_tokens=np.int64(2), seed=np.int32(3))
    assert len(out[0].tokens) == 2 and out[0].num_draft_tokens == 2  # (one step of 2 drafts)


def test_argument_kinds_are_named_before_any_work(sp, model, monkeypatch):
    """An argument of the wrong kind is a ConfigError naming it and the value, raised before
    the tokenizer, model or grammar is touched: not a bare RuntimeError from torch.device, a
    TypeError from SamplingParams, an AttributeError from a string model / factory /
    tokenizer; and nothing is silently taken as something else (bytes read as token ids, a
    bool temperature or top_k read as 1, a string flag read as true, a draft model no
    drafter reads)."""
    import capgraph.tokenizers
    from capgraph import ConfigError

    def no_load(*args, **kwargs):
        raise AssertionError("the tokenizer was loaded before the argument check")

    monkeypatch.setattr(capgraph.tokenizers, "load_tokenizer", no_load)
    cases = [
        (dict(device="nowhere"), "device='nowhere' is not a torch device"),
        (dict(device=None), "device=None is not a torch device"),
        (dict(device="meta"), "device='meta': expected a CPU or CUDA device"),
        (dict(temperature=None), "temperature=None must be a finite number"),
        (dict(temperature="0.7"), "temperature='0.7' must be a finite number"),
        (dict(temperature=True), "temperature=True must be a finite number"),
        (dict(temperature=float("inf")), "temperature=inf must be a finite number"),
        (dict(temperature=float("nan")), "temperature=nan must be a finite number"),
        (dict(temperature=1.0, top_k=True), "top_k=True must be an int"),
        (dict(temperature=1.0, top_k=2.0), "top_k=2.0 must be an int"),
        (dict(model="llama"), "model is a str ('llama'): expected a torch.nn.Module"),
        (dict(draft="model", draft_model="x"), "draft_model is a str"),
        (dict(draft="ngram", draft_model=model), "draft_model is given but draft='ngram'"),
        (dict(factory="xgrammar"), "factory='xgrammar': expected a GrammarMatcherFactory"),
        (dict(tokenizer="tekken"), "tokenizer='tekken': expected a tokenizer object"),
        (dict(tokenizer=object()), "tokenizer is a object: expected a Hugging Face"),
        (dict(progress="yes"), "progress='yes': expected a bool or a callable"),
        (dict(progress=1), "progress=1: expected a bool or a callable"),
        (dict(cuda_graph="no"), "cuda_graph='no': expected True, False or None"),
        (dict(batch_after_launch="yes"), "batch_after_launch='yes': expected True"),
    ]
    for kwargs, message in cases:
        kwargs = {"model": model, "tokenizer": None, **kwargs}
        with pytest.raises(ConfigError, match=re.escape(message)):
            generate(["x"], GuidedDecodingParams.regex("a"), max_new_tokens=1, **kwargs)
    # bytes are a sequence of ints, but not token ids
    for prompt in (b"hi", bytearray(b"hi")):
        with pytest.raises(ConfigError, match=re.escape(
                f"prompts[0] is {type(prompt).__name__}: expected a string or a sequence")):
            generate([prompt], model=model, tokenizer=sp, max_new_tokens=1)
    # a CUDA index this machine lacks, named before torch touches the device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ConfigError, match=re.escape("device='cuda:3': this machine has 1 CUDA")):
        generate(["x"], model=model, device="cuda:3", max_new_tokens=1)
    # an integer device is a CUDA index (torch reads it as the accelerator's)
    with pytest.raises(ConfigError, match=re.escape("device=2: this machine has 1 CUDA")):
        generate(["x"], model=model, device=2, max_new_tokens=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=re.escape(
            "device=0 requested but no CUDA device is available")):
        generate(["x"], model=model, device=0, max_new_tokens=1)


def test_sampling_params_take_numbers_only():
    """SamplingParams keeps a float temperature and an int top_k: NumPy numbers are taken,
    a bool, text or a non-finite temperature is a ConfigError naming the field."""
    import numpy as np

    from capgraph import ConfigError
    p = SamplingParams(np.float32(0.5), np.int64(3), seed=1)
    assert (p.temperature, p.top_k) == (0.5, 3)
    assert type(p.temperature) is float and type(p.top_k) is int
    assert SamplingParams(1, 0).temperature == 1.0 and not SamplingParams(1, 0).greedy
    # 0-d real tensors, as for top_k
    p = SamplingParams(torch.tensor(0.5, dtype=torch.float64), torch.tensor(3))
    assert (p.temperature, p.top_k) == (0.5, 3) and type(p.temperature) is float
    assert SamplingParams(torch.tensor(0.0)).greedy
    for temperature in (-1.0, None, "1", False, float("-inf"), torch.tensor([0.5]),
                        torch.tensor(True), torch.tensor(float("nan"))):
        with pytest.raises(ConfigError, match="SamplingParams.temperature="):
            SamplingParams(temperature)
    for top_k in (-1, False, "3", 1.5):
        with pytest.raises(ConfigError, match="SamplingParams.top_k="):
            SamplingParams(1.0, top_k)


def test_numpy_flags_are_taken(sp, model):
    """NumPy bools are taken as the flags they are (progress, cuda_graph), as NumPy integers
    are as counts."""
    import numpy as np
    seen = []
    out = generate(["x"], model=model, tokenizer=sp, max_new_tokens=1,
                   cuda_graph=np.bool_(False), progress=np.bool_(False))
    assert len(out[0].tokens) == 1
    out = generate(["x"], model=model, tokenizer=sp, max_new_tokens=1,
                   progress=lambda done, total: seen.append((done, total)))
    assert seen == [(1, 1)]
    out = generate(["x"], model=model, tokenizer=sp, max_new_tokens=1, progress=None)
    assert len(out[0].tokens) == 1  # (None: no progress shown, as False)


@pytest.mark.parametrize("decoder", ["eager", pytest.param("capturable", marks=needs_capturable)])
@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_graph_path_on_cpu_equals_eager(sp, model, factory, greedy_run, decoder, draft):
    """The graph path's step — static buffers, batches padded to a captured size with dummy
    slots and unguided placeholder requests — replayed by the CPU stand-in gives the plain
    eager outputs token for token."""
    out = run(sp, model, factory, cuda_graph=True, decoder=decoder, draft=draft,
              num_draft_tokens=2)
    assert [r.tokens for r in out] == [r.tokens for r in greedy_run]


@needs_capturable
def test_capturable_decoder_equals_eager(sp, model, factory, greedy_run):
    """The capturable decoder (host build overlapping the forward) gives the eager decoder's
    outputs token for token, speculative decoding included."""
    cap = run(sp, model, factory, decoder="capturable")
    assert [r.tokens for r in cap] == [r.tokens for r in greedy_run]
    spec = run(sp, model, factory, decoder="capturable", draft="ngram", num_draft_tokens=3)
    assert [r.tokens for r in spec] == [r.tokens for r in greedy_run]


# -- GPU ---------------------------------------------------------------------------------------

@needs_cuda
@pytest.mark.gpu
@pytest.mark.parametrize("draft", ["none", "ngram", "grammar+ngram"])
def test_graph_replay_equals_eager_on_gpu(sp, factory, draft):
    """On CUDA, generation replaying captured decode-step graphs equals eager CUDA generation
    token for token (eager decoder: the graph holds the forward)."""
    model = tiny_llama(len(sp), seed=0, eos_token_id=sp.eos_token_id, device="cuda")
    kw = dict(device="cuda", draft=draft, num_draft_tokens=3)
    eager = run(sp, model, factory, cuda_graph=False, **kw)
    graphed = run(sp, model, factory, cuda_graph=True, **kw)
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]
    assert all(r.finish_reason == "stop" for r, g in zip(graphed, GUIDES) if g is not None)


@needs_cuda
@needs_capturable
@pytest.mark.gpu
@pytest.mark.parametrize("draft", ["none", "ngram", "model", "grammar", "grammar+model"])
def test_captured_guided_step_equals_eager_on_gpu(sp, factory, draft):
    """With the capturable decoder the graph holds forward, mask and sampling; outputs equal
    the eager decoder's token for token, with speculative decoding too (drafts verified and
    rolled back by callbacks inside the graph)."""
    model = tiny_llama(len(sp), seed=0, eos_token_id=sp.eos_token_id, device="cuda")
    kw = dict(device="cuda", draft=draft, num_draft_tokens=3)
    eager = run(sp, model, factory, cuda_graph=False, **kw)
    graphed = run(sp, model, factory, cuda_graph=True, decoder="capturable", **kw)
    assert [r.tokens for r in graphed] == [r.tokens for r in eager]


@needs_cuda
@needs_capturable
@pytest.mark.gpu
def test_sampling_inside_the_graph_is_seeded_and_guided_on_gpu(sp, factory):
    """Temperature / top-k sampling captured in the graph (its generator registered with every
    captured batch size) repeats exactly with the same seed, and guided outputs that stop
    validate."""
    model = tiny_llama(len(sp), seed=0, eos_token_id=sp.eos_token_id, device="cuda")
    kw = dict(device="cuda", cuda_graph=True, decoder="capturable", temperature=1.5, top_k=50,
              max_new_tokens=30)
    a = run(sp, model, factory, PROMPTS[:4], GUIDES[:4], seed=1, **kw)
    b = run(sp, model, factory, PROMPTS[:4], GUIDES[:4], seed=1, **kw)
    assert [r.tokens for r in a] == [r.tokens for r in b]
    for r, g in zip(a, GUIDES[:4]):
        assert r.finish_reason != "error", r.error
        if g is not None and r.finish_reason == "stop":
            assert check(r, g, factory), r.text


@needs_capturable
def test_take_failed_reraises_a_callback_error_of_the_step(factory):
    """A replayed step reaches no drain: GuideDriver.take_failed (called after the step's
    synchronisation) re-raises a host callback's exception then, not at a later, unrelated
    drain. Eager drivers have no callbacks and do not look."""
    import hostfunc
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    from capgraph.runtime.guide import GuideDriver

    capt = GuideDriver(CapturableGuidedDecoder(factory.config, 2, 0, factory=factory), 0)
    eager = GuideDriver(GuidedDecoder(factory.config, 2, 0, factory=factory), 0)
    try:
        hostfunc.launch(lambda: 1 / 0)  # stands in for a replayed callback that raised
        hostfunc.current_stream().synchronize(30)
        assert eager.take_failed() == []
        with pytest.raises(hostfunc.HostFuncError) as info:
            capt.take_failed()
        assert isinstance(info.value.__cause__, ZeroDivisionError)
        assert capt.take_failed() == []  # reported once
    finally:
        capt.close()
        eager.close()


@needs_capturable
@pytest.mark.parametrize("drafts", [0, 2])
def test_the_guide_drivers_decode_requests_are_generation_requests_handed_over(factory, drafts):
    """GuideDriver.begin_decode makes each sequence's request with GuidedRequest.generation's
    fields (its newest token, drafts, accepted count; placeholders padding the batch) and hands
    them to the capturable decoder with copy=False (tests/test_capturable.py: queued uncopied);
    the eager decoder, which takes no copy argument, gets the same fields. The draft
    lists are the driver's own copies: a drafter changing its list later changes no request."""
    from types import SimpleNamespace

    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    from capgraph.requests import GuidedRequest
    from capgraph.runtime.guide import GuideDriver

    params = GuidedDecodingParams.regex("[ab]+")
    seqs = [SimpleNamespace(index=7 + i, seq_slot=i, guide=params, output=[3, 4 + i],
                            accepted_prev=i) for i in range(2)]
    proposed = [[5, 6][:drafts], [8, 9][:drafts]] if drafts else None
    expected = [GuidedRequest.generation(
        s.index, s.seq_slot, params, s.output[-1],
        draft_tokens=proposed[i] if proposed else None, num_accepted_draft_tokens=i)
        for i, s in enumerate(seqs)]
    for make in (CapturableGuidedDecoder, GuidedDecoder):
        decoder = make(factory.config, 3, drafts, factory=factory)
        driver = GuideDriver(decoder, drafts)
        taken: list = []
        original = decoder.add_batch

        def add_batch(requests, *args, _original=original, **kwargs):
            taken.append((list(requests), kwargs))
            return _original(requests, *args, **kwargs)

        decoder.add_batch = add_batch  # type: ignore[method-assign]
        try:
            driver.begin_decode(seqs, proposed, pad_to=3)
        except Exception:
            pass  # (the slots have no matchers: only what add_batch was given matters here)
        finally:
            driver.close()
        (requests, kwargs), = taken
        assert requests[:2] == expected
        assert requests[2].guided_decoding_params is None and requests[2].seq_slot is None
        assert kwargs.get("copy", True) is (make is GuidedDecoder)
        if proposed:
            assert requests[0].draft_tokens is not proposed[0]
            proposed[0].append(99)
            assert requests[0].draft_tokens == [5, 6]
            proposed[0].pop()


def test_batch_after_launch_is_refused_where_the_loop_cannot_make_it(factory, sp):
    """generate(batch_after_launch=True) needs CUDA graphs on a CUDA device with the capturable
    decoder's native node and no speculation; where it cannot, a ConfigError names what is
    missing (on CPU: the graphs, or the CUDA device the stand-in lacks), before any step.
    False and the default None run as before."""
    from capgraph import ConfigError

    guide = GuidedDecodingParams.regex("[ab]{3}")
    with pytest.raises(ConfigError, match="needs CUDA graphs"):
        generate(["x"], guide, decoder="capturable", tokenizer=sp, factory=factory, max_new_tokens=2,
                 batch_after_launch=True)
    with pytest.raises(ConfigError, match="needs a CUDA device"):
        generate(["x"], guide, decoder="capturable", cuda_graph=True, tokenizer=sp, factory=factory,
                 max_new_tokens=2, batch_after_launch=True)
    with pytest.raises(ConfigError, match="needs the capturable decoder"):
        generate(["x"], guide, cuda_graph=True, tokenizer=sp, factory=factory, max_new_tokens=2,
                 batch_after_launch=True)
    for order in (None, False):
        results = generate(["x"], guide, decoder="capturable", cuda_graph=True,
                           tokenizer=sp, factory=factory, max_new_tokens=4, batch_after_launch=order)
        assert re.fullmatch("[ab]{3}", results[0].text), results[0].text


@needs_capturable
@pytest.mark.parametrize("draft", ["none", "ngram"])
def test_the_graph_step_enqueues_its_host_work_before_the_forward(sp, model, factory, greedy_run,
                                                                  monkeypatch, draft):
    """generate()'s graph step (what it captures on CUDA; the CPU stand-in runs it as is)
    enqueues the guided host work (host node, bitmask copy) with ``prepare`` for all of the
    step's logits rows before the forward, so a capture creates those nodes ahead of the
    forward's kernels; ``_HOST_WORK_FIRST = False`` (bench_graph_replay's ``native-node-last``)
    leaves it to ``execute`` after the forward. Both orders give the eager outputs."""
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.runtime import engine

    events: list[tuple[str, int]] = []
    enqueue, forward_step = CapturableGuidedDecoder._enqueue_step, ModelRunner.forward_step

    def spy_enqueue(self, num_rows, capturing, *rest):
        events.append(("host work", num_rows))
        return enqueue(self, num_rows, capturing, *rest)

    def spy_forward(self, bs):
        events.append(("forward", bs))
        return forward_step(self, bs)

    monkeypatch.setattr(CapturableGuidedDecoder, "_enqueue_step", spy_enqueue)
    monkeypatch.setattr(ModelRunner, "forward_step", spy_forward)
    K = 2 if draft == "ngram" else 0
    for first in (True, False):
        monkeypatch.setattr(engine, "_HOST_WORK_FIRST", first)
        events.clear()
        out = run(sp, model, factory, cuda_graph=True, decoder="capturable", draft=draft,
                  num_draft_tokens=2)
        assert [r.tokens for r in out] == [r.tokens for r in greedy_run]
        forwards = [i for i, (what, _) in enumerate(events) if what == "forward"]
        assert forwards
        for i in forwards:  # each graph step: its host work right before or right after
            near = events[i - 1] if first else events[i + 1]
            assert near == ("host work", events[i][1] * (1 + K)), (first, events[i - 1:i + 2])


def test_the_runner_passes_the_cache_under_the_models_own_keyword():
    """transformers 5.24 renamed the KV-cache argument (``past_key_values`` -> ``cache``) and a
    wrong name is silently ignored (the model then runs without the cache): the runner reads
    the name from the model's signature, and refuses a model that takes neither."""
    from capgraph import ConfigError
    from capgraph.runtime.runner import cache_keyword

    class New(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, **kw): ...

    class Old(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, **kw): ...

    class Neither(torch.nn.Module):
        def forward(self, x): ...

    assert cache_keyword(New()) == "cache" and cache_keyword(Old()) == "past_key_values"
    with pytest.raises(ConfigError, match="neither 'cache' nor 'past_key_values'"):
        cache_keyword(Neither())
