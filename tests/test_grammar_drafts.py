"""Forced tokens as drafts: the backends' forced text, its encoding, the decoder's per-slot
query, and generation with the grammar drafter equal to greedy generation token for token.

Generation runs the demo's guides (the bundled tool-call schema, the date regex, the key=value
grammar) with the Tekken tokenizer and the runtime's tiny random Llama, as ``capgraph demo``.
"""

from __future__ import annotations

import json
import random
import time

import pytest
import torch

from capgraph import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from capgraph.decoder import GuidedDecoder
from capgraph.errors import ConfigError, RequestError
from capgraph.demo import DEFAULT_PROMPTS, bundled_schema, demo_guides
from capgraph.grammar import ForcedTokenEncoder, create_matcher_factory
from capgraph.grammar.base import whole_utf8_prefix
from capgraph.grammar.llguidance_backend import available as llguidance_available
from capgraph.requests import GuidedRequest
from capgraph.runtime import GrammarDrafter, NgramDrafter, generate, tiny_llama

needs_llguidance = pytest.mark.skipif(not llguidance_available(),
                                      reason="the llguidance extra is not installed")

SCHEMA = json.dumps({
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"], "additionalProperties": False})
PROMPTS = [p for ps in DEFAULT_PROMPTS.values() for p in ps]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def compact_factory(tok, backend: str = "xgrammar"):
    return create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tok, backend=backend, json_whitespace="compact"))


@pytest.fixture(scope="module")
def factory(tekken):
    f = compact_factory(tekken)
    yield f
    f.close()


@pytest.fixture(scope="module")
def model(tekken):
    return tiny_llama(len(tekken), seed=0, eos_token_id=tekken.eos_token_id)


def demo_batch(guides=None):
    guides = guides or demo_guides(bundled_schema())
    return PROMPTS, [guides[i // 2] for i in range(len(PROMPTS))]


def run(tok, model, factory, prompts, guides, **kw):
    kw.setdefault("max_new_tokens", 60)
    kw.setdefault("max_batch_size", 4)
    return generate(prompts, guides, model=model, tokenizer=tok, factory=factory, **kw)


@pytest.fixture(scope="module")
def greedy(tekken, model, factory):
    return run(tekken, model, factory, *demo_batch())


# -- forced text -------------------------------------------------------------------------------

def test_whole_utf8_prefix_never_cuts_a_character():
    """Forced bytes are cut to whole UTF-8 characters: at the byte bound, at a character cut
    short by the backend, and not at all where the data starts inside a character."""
    e_acute = "é".encode()  # 2 bytes
    assert whole_utf8_prefix(b"ab" + e_acute, 3) == b"ab"
    assert whole_utf8_prefix(b"ab" + e_acute, 4) == b"ab" + e_acute
    assert whole_utf8_prefix(b"ab" + e_acute[:1], 10) == b"ab"
    assert whole_utf8_prefix(e_acute[1:] + b"ab", 10) == b""
    assert whole_utf8_prefix("€x".encode(), 10) == "€x".encode()
    assert whole_utf8_prefix(b"abc", 0) == b""


@pytest.mark.parametrize("backend", ["xgrammar",
                                     pytest.param("llguidance", marks=needs_llguidance)])
def test_forced_bytes_follow_the_grammar_and_leave_the_state(tekken, backend):
    """Each backend forces a schema's keys and punctuation, nothing inside a free string, and
    nothing once terminated; asking changes neither the state nor the mask."""
    f = compact_factory(tekken, backend)
    try:
        m = f.create(GuidedDecodingParams.json_schema(SCHEMA))
        assert m.forced_bytes(64) == b'{"name":"'
        assert m.forced_bytes(4) == b'{"na'
        for t in tekken.encode('{"name":"Bob', add_special_tokens=False):
            assert m.accept_token(t)
        assert m.forced_bytes(64) == b""
        before = torch.zeros((1, (len(tekken) + 31) // 32), dtype=torch.int32)
        after = before.clone()
        m.fill_next_token_bitmask(before, 0)
        for t in tekken.encode('","', add_special_tokens=False):
            assert m.accept_token(t)
        assert m.forced_bytes(64) == b'age":'
        m.rollback(len(tekken.encode('","', add_special_tokens=False)))
        m.fill_next_token_bitmask(after, 0)
        assert torch.equal(before, after)
        for t in tekken.encode('","age":7}', add_special_tokens=False):
            assert m.accept_token(t)
        assert m.accept_token(f.config.stop_token_ids[0]) and m.is_terminated()
        assert m.forced_bytes(64) == b""
    finally:
        f.close()


def test_encoder_drafts_the_tokenizers_own_encoding_within_the_bound(tekken):
    """Forced text becomes the tokenizer's encoding of it; a bound that cuts the text never
    drafts the token it cut; ``keep_last=False`` leaves out the token at the end of the
    forced text; bad arguments raise ConfigError."""
    text = b'{"name":"'
    own = tekken.encode(text.decode(), add_special_tokens=False)
    enc = ForcedTokenEncoder(tekken)
    assert enc.encode(text, 16) == own
    assert enc.encode(text, 1) == own[:1]
    assert enc.encode(text, 0) == [] and enc.encode(b"", 5) == []
    assert ForcedTokenEncoder(tekken, keep_last=False).encode(text, 16) == own[:-1]
    short = ForcedTokenEncoder(tekken, max_bytes_per_token=3)  # 2 tokens: 6 bytes asked for
    cut = tekken.encode('{"name', add_special_tokens=False)
    assert len(cut) == 2 and short(_Forcing(text), 2) == cut[:1]
    with pytest.raises(ConfigError, match="max_bytes_per_token"):
        ForcedTokenEncoder(tekken, max_bytes_per_token=0)
    with pytest.raises(ConfigError, match="tokenizer"):
        ForcedTokenEncoder(None)


SPECIAL_TEXTS = [("tekken", "[INST] hi"), ("qwen", "<|im_start|>user"),
                 ("mistral-sp32k", "a</s>b")]


@pytest.mark.parametrize("name,text", SPECIAL_TEXTS)
def test_forced_text_that_spells_a_special_token_is_drafted_as_text(tokenizer_cache, name,
                                                                    text):
    """A guide whose forced text spells a special token ("[INST]", "<|im_start|>", "</s>"):
    the encoder and the decoder's forced_tokens draft the text's ordinary tokens, never the
    special id (which every guided row masks, so such a draft was always refused); each
    drafted token is allowed by the mask of its step."""
    from capgraph.tokenizers import special_token_ids
    tok = tokenizer_cache(name)
    specials = special_token_ids(tok)
    assert set(tok.encode(text, add_special_tokens=False)) & specials  # what encode() does
    enc = ForcedTokenEncoder(tok)
    ids = enc.encode(text.encode(), 32)
    assert ids and not set(ids) & specials
    assert tok.decode(ids) == text
    regex = "".join("\\" + c if c in "[]|()<>/" else c for c in text)
    config = GuidedDecodingConfig.from_tokenizer(tok)
    dec = GuidedDecoder(config, 1, 4)
    try:
        params = GuidedDecodingParams.regex(regex)
        dec.add_batch([GuidedRequest.context(1, 0, params)])
        logits = torch.zeros(1, len(tok))
        assert dec.execute(logits) == []
        forced = dec.forced_tokens(seq_slot=0, max_tokens=8)
        assert forced and not set(forced) & specials, tok.convert_ids_to_tokens(forced)
        for t in forced[:3]:  # each draft is allowed where it is drafted
            assert torch.isfinite(logits[0, t])
            dec.add_batch([GuidedRequest.generation(1, 0, params, new_token=t)], 0)
            logits = torch.zeros(1, len(tok))
            assert dec.execute(logits) == []
    finally:
        dec.close()


class _Forcing:
    """A matcher stand-in that forces a fixed text (only ``forced_bytes`` is called)."""

    def __init__(self, text: bytes) -> None:
        self.text = text

    def forced_bytes(self, max_bytes: int) -> bytes:
        return whole_utf8_prefix(self.text, max_bytes)


def test_decoder_forced_tokens_after_the_steps_accept(tekken, factory):
    """``GuidedDecoder.forced_tokens`` reads the slot's matcher as the latest build left it
    (after the new token it accepted), without changing it; a slot without a matcher forces
    nothing; a bad slot or bound raises a named error."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    V = factory.config.vocab_size_padded
    dec = GuidedDecoder(factory.config, 2, 0, factory=factory)
    try:
        dec.add_batch([GuidedRequest.context(7, 0, params)])
        assert dec.execute(torch.zeros(1, V)) == []
        own = tekken.encode('{"name":"', add_special_tokens=False)
        assert dec.forced_tokens(0, 16) == own
        assert dec.forced_tokens(0, 16) == own  # unchanged by asking
        assert dec.forced_tokens(1, 16) == []  # no matcher there
        first = own[0]
        dec.add_batch([GuidedRequest.generation(7, 0, params, first)])
        assert dec.execute(torch.zeros(1, V)) == []
        rest = tekken.encode('{"name":"', add_special_tokens=False)[1:]
        assert dec.forced_tokens(0, 16) == rest
        with pytest.raises(RequestError, match="seq_slot"):
            dec.forced_tokens(2, 4)
        with pytest.raises(ConfigError, match="max_tokens"):
            dec.forced_tokens(0, -1)
    finally:
        dec.close()


def test_a_tool_calls_structural_tag_forces_the_call_after_its_trigger(tekken, factory):
    """A structural tag of triggered tool calls (xgrammar's ``TagDispatch``: free text until
    a trigger): its free text forces nothing, and once the trigger is written the rest of
    the call's opening up to its arguments is forced text, drafted as the tokenizer's own
    encoding."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    begin = '<tool_call>{"name": "get_weather", "arguments": '
    guide = GuidedDecodingParams(GuideType.STRUCTURAL_TAG, json.dumps({
        "type": "structural_tag", "format": {
            "type": "triggered_tags", "triggers": ["<tool_call>"],
            "tags": [{"type": "tag", "begin": begin,
                      "content": {"type": "json_schema", "json_schema": schema},
                      "end": "}</tool_call>"}]}}))
    matcher = factory.create(guide)
    for token in tekken.encode("Let me check.", add_special_tokens=False):
        assert matcher.forced_bytes(64) == b""  # (free text)
        assert matcher.accept_token(token)
    for token in tekken.encode(" <tool_call>", add_special_tokens=False):
        assert matcher.accept_token(token)
    forced = matcher.forced_bytes(4096)
    assert forced.startswith(b'{"name": "get_weather", "arguments": {'), forced
    encoder = ForcedTokenEncoder(tekken)
    assert encoder(matcher, 64) == tekken.encode(forced.decode(), add_special_tokens=False)


@pytest.mark.parametrize("mode,own,excludes,spaces", [
    ("compact", None, False, 0), ("any", None, False, 9), ("bounded", None, False, 8),
    ("compact", 2, False, 2), ("compact", None, True, 1), ("bounded", None, True, 8),
    ("any", None, True, 9)])
def test_a_structural_tags_json_schema_takes_the_factorys_json_whitespace(
        tekken, mode, own, excludes, spaces):
    """The JSON-schema body of a structural tag's call gets the factory's ``json_whitespace``,
    as a JSON-schema guide does (compact: none, so a model cannot loop on whitespace there;
    bounded: at most ``json_max_whitespace``), unless the element gives its own
    ``max_whitespace_cnt``: the most spaces accepted after the body's opening brace. An
    element xgrammar converts itself (here one with ``excludes``) is bounded too, compact
    reading as one (the least xgrammar's element takes)."""
    element: dict = {"type": "json_schema", "json_schema": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
    if own is not None:
        element["max_whitespace_cnt"] = own
    if excludes:
        element["excludes"] = ["zz"]
    guide = GuidedDecodingParams(GuideType.STRUCTURAL_TAG, json.dumps({
        "type": "structural_tag", "format": {"type": "tag", "begin": "<c>",
                                             "content": element, "end": "</c>"}}))
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tekken, json_whitespace=mode))
    space = tekken.encode(" ", add_special_tokens=False)
    assert len(space) == 1
    try:
        matcher = factory.create(guide)
        for token in tekken.encode("<c>{", add_special_tokens=False):
            assert matcher.accept_token(token)
        taken = 0
        while taken < 9 and matcher.accept_token(space[0]):
            taken += 1
        assert taken == spaces
    finally:
        factory.close()


# -- the drafter -------------------------------------------------------------------------------

def test_grammar_drafter_pads_and_hands_over_to_the_next_drafter(tekken, factory):
    """A proposal always has k tokens: the forced prefix, then the continuing drafter's
    tokens after it (n-gram over context + prefix), or the prefix's last token repeated;
    an unguided sequence drafts only from the continuing drafter."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    factory.compile(params)  # compiled: the drafter's matcher exists at the first proposal
    prompt = [1, 2, 3]
    forced = tekken.encode('{"name":"', add_special_tokens=False)
    k = len(forced) + 2
    alone = GrammarDrafter(factory, tekken, k)
    alone.start(0, prompt, params)
    alone.start(1, prompt, None)
    out = alone.propose([0, 1], [prompt, prompt])
    assert out[0] == forced + [forced[-1]] * 2
    assert out[1] == [prompt[-1]] * k
    ngram = NgramDrafter(k)
    combined = GrammarDrafter(factory, tekken, k, then=ngram)
    combined.start(0, prompt, params)
    after = combined.propose([0], [prompt])[0]
    assert after[:len(forced)] == forced
    assert after[len(forced):] == ngram.lookup(prompt + forced)[:2]
    # the output so far is fed to the drafter's matcher: after the forced text, a free string
    assert combined.propose([0], [prompt + forced])[0] == ngram.lookup(prompt + forced)
    with pytest.raises(ConfigError, match="proposes"):
        GrammarDrafter(factory, tekken, 3, then=NgramDrafter(2))
    assert alone.num_forced == len(forced) and alone.num_refused == 0


@pytest.mark.parametrize("fails_in", ["accept_token", "forced_bytes"])
def test_a_drafter_matcher_that_raises_stops_drafting_for_its_sequence_alone(tekken, factory,
                                                                            fails_in):
    """The drafter's own matcher for one sequence raises (llguidance's error state, say) in
    its accept or its forced-text query: that sequence drafts nothing from the grammar from
    then on (counted in num_refused), its proposal is padded as an unguided one's, and the
    other sequence's forced drafts are unchanged; nothing escapes into the batch's step."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    factory.compile(params)
    prompt = [1, 2, 3]
    forced = tekken.encode('{"name":"', add_special_tokens=False)
    k = len(forced)
    drafter = GrammarDrafter(factory, tekken, k)
    drafter.start(0, prompt, params)
    drafter.start(1, prompt, params)
    assert drafter.propose([0, 1], [prompt, prompt]) == [forced, forced]
    matcher = drafter._slots[0].matcher

    def broken(*args, **kwargs):
        raise RuntimeError("llguidance error: the matcher is in its error state")
    setattr(matcher, fails_in, broken)
    context = prompt + forced[:1]
    out = drafter.propose([0, 1], [context, context])
    assert out == [[context[-1]] * k, forced[1:] + [forced[-1]]]
    assert drafter.num_refused == 1
    assert drafter.propose([0], [context])[0] == [context[-1]] * k


@pytest.mark.parametrize("draft", ["grammar", "grammar+ngram", "grammar+model"])
@pytest.mark.parametrize("decoder", ["eager", "capturable"])
def test_grammar_drafts_equal_greedy_generation(tekken, model, factory, greedy, draft, decoder):
    """Over the demo's schema, regex and grammar, generation with the grammar drafter alone or
    combined equals greedy generation without speculation token for token, with the eager and
    the capturable decoder, and takes fewer steps (the schema's keys are drafted and
    accepted)."""
    out = run(tekken, model, factory, *demo_batch(), draft=draft, num_draft_tokens=4,
              decoder=decoder)
    assert [r.tokens for r in out] == [r.tokens for r in greedy]
    assert [r.finish_reason for r in out] == [r.finish_reason for r in greedy]
    assert sum(r.num_accepted_draft_tokens for r in out) > 0
    assert out.timings.steps < greedy.timings.steps


@pytest.mark.parametrize("decoder", ["eager", "capturable"])
def test_grammar_drafts_on_the_graph_path_equal_greedy(tekken, model, factory, greedy, decoder):
    """The graph path's fixed draft length (shorter proposals padded, batches padded to a
    captured size), replayed by the CPU stand-in, gives greedy output token for token."""
    out = run(tekken, model, factory, *demo_batch(), draft="grammar+ngram",
              num_draft_tokens=3, decoder=decoder, cuda_graph=True)
    assert [r.tokens for r in out] == [r.tokens for r in greedy]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("draft", ["grammar", "grammar+ngram"])
@pytest.mark.parametrize("decoder", ["eager", "capturable"])
def test_grammar_drafts_in_cuda_graphs_equal_greedy_on_gpu(tekken, factory, draft, decoder):
    """On CUDA, generation replaying captured decode-step graphs with the grammar drafter
    (alone and combined with n-grams; fixed draft length) equals CUDA greedy generation
    without speculation token for token, over the demo's schema, regex and grammar, with
    the eager decoder (the graph holds the forward) and the capturable one (forward, mask
    and the drafts' verification), and drafted tokens are accepted."""
    model = tiny_llama(len(tekken), seed=0, eos_token_id=tekken.eos_token_id, device="cuda")
    kw = dict(device="cuda", cuda_graph=True, decoder=decoder)
    base = run(tekken, model, factory, *demo_batch(), **kw)
    out = run(tekken, model, factory, *demo_batch(), draft=draft, num_draft_tokens=3, **kw)
    assert [r.tokens for r in out] == [r.tokens for r in base]
    assert [r.finish_reason for r in out] == [r.finish_reason for r in base]
    assert sum(r.num_accepted_draft_tokens for r in out) > 0


def test_grammar_drafts_with_unguided_and_one_draft(tekken, model, factory):
    """A batch mixing guided and unguided requests, with one draft per step, gives greedy
    output; the unguided request drafts nothing from the grammar."""
    prompts, guides = PROMPTS[:3], [demo_guides(bundled_schema())[0], None,
                                    demo_guides(bundled_schema())[1]]
    base = run(tekken, model, factory, prompts, guides, max_new_tokens=30)
    out = run(tekken, model, factory, prompts, guides, max_new_tokens=30, draft="grammar",
              num_draft_tokens=1)
    assert [r.tokens for r in out] == [r.tokens for r in base]


@needs_llguidance
def test_grammar_drafts_equal_greedy_on_llguidance(tekken, model):
    """With the llguidance backend (its forced bytes), the schema and regex guides give
    greedy output token for token with the grammar drafter."""
    f = compact_factory(tekken, "llguidance")
    try:
        guides = demo_guides(bundled_schema())[:2]
        prompts, gs = PROMPTS[:4], [guides[0], guides[0], guides[1], guides[1]]
        base = run(tekken, model, f, prompts, gs)
        out = run(tekken, model, f, prompts, gs, draft="grammar", num_draft_tokens=4)
        assert [r.tokens for r in out] == [r.tokens for r in base]
        assert out.timings.steps < base.timings.steps
    finally:
        f.close()


def test_draft_choice_is_checked(tekken, model, factory):
    """An unknown draft choice raises ConfigError listing the choices."""
    with pytest.raises(ConfigError, match="grammar\\+ngram"):
        run(tekken, model, factory, PROMPTS[:1], None, draft="grammar+beam")


# --- forced text is bounded ---------------------------------------------------------------

_ENDLESS_CHILD = r'''
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import torch
from capgraph import GuidedDecodingConfig, GuidedDecodingParams as P
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest as R
from capgraph.tokenizers import load_tokenizer
tok = load_tokenizer("tekken")
cfg = GuidedDecodingConfig.from_tokenizer(tok, compile_disk_cache_bytes=0)
dec = GuidedDecoder(cfg, max_num_sequences=2, max_num_draft_tokens=4)
doubling = "\n".join(['root ::= r24', 'r0 ::= "x"'] + [f"r{i} ::= r{i-1} r{i-1}" for i in range(1, 25)])
dec.add_batch([R.context(1, 0, P.ebnf('root ::= "ab" root')), R.context(2, 1, P.ebnf(doubling))])
assert dec.execute(torch.zeros(2, len(tok))) == []
start = time.perf_counter()
out = dec.forced_tokens_batch([0, 1], max_tokens=4)
print("OK", out, round(time.perf_counter() - start, 3))
'''


def test_forced_tokens_of_an_endless_or_exponential_forced_run_are_bounded():
    """A grammar whose forced text never ends (``root ::= "ab" root``: xgrammar's walk has no
    length bound and ran out of memory after ~16 s) or is 2^24 bytes long (doubling rules)
    answers at once, with no drafts, under a 3 GiB address-space limit."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _ENDLESS_CHILD], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("OK")][-1]
    assert line.startswith("OK [[], []]")
    assert float(line.split()[-1]) < 5.0  # (milliseconds here; the walk took 16 s and 4 GB)


_STACKED_CHILD = r'''
import resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
import torch
from capgraph import GuidedDecodingConfig, GuidedDecodingParams as P
from capgraph.decoder import GuidedDecoder
from capgraph.requests import GuidedRequest as R
from capgraph.tokenizers import load_tokenizer
tok = load_tokenizer("tekken")
vocab = tok.get_vocab()
eq = vocab[max((t for t in vocab if t and set(t) == {"="}), key=len)]
c = tok.encode("c", add_special_tokens=False)[-1]
cfg = GuidedDecodingConfig.from_tokenizer(tok, compile_disk_cache_bytes=0)
dec = GuidedDecoder(cfg, max_num_sequences=1, max_num_draft_tokens=0)
guide = P.ebnf('root ::= "=" root "' + "b" * 4000 + '" | "c"')
dec.add_batch([R.context(1, 0, guide)])
assert dec.execute(torch.zeros(1, len(tok))) == []
for token in [eq] * 30 + [c]:
    dec.add_batch([R.generation(1, 0, guide, token)])
    assert dec.execute(torch.zeros(1, len(tok))) == []
start = time.perf_counter()
out = dec.forced_tokens(0, max_tokens=8)
print("OK", out, round(time.perf_counter() - start, 3))
'''


def test_forced_tokens_of_recursion_that_stacks_forced_text_are_bounded():
    """Every alternative of ``root ::= "=" root "<4000 b>" | "c"`` completes within 4096 bytes,
    but each ``=`` written opens a level that forces its 4000 ``b`` once the ``c`` comes:
    after 30 tokens of ``=`` xgrammar's walk would build megabytes of it at once.
    The grammar gets no forced text: the answer is at once and empty."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", _STACKED_CHILD], capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("OK")][-1]
    assert line.startswith("OK []")
    assert float(line.split()[-1]) < 1.0


def test_a_jump_forward_walk_too_long_ends_forced_text_for_its_grammar(tekken, monkeypatch):
    """A walk over MAX_FORCED_WALK_MS (the forced text of recursion nested deep in the
    output) still answers, and from then on no matcher of that grammar walks again; another
    grammar's matchers still do."""
    from capgraph.grammar import forced
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tekken))
    try:
        guide = GuidedDecodingParams.ebnf('root ::= "[" root ("," root)* "]" | "x"')
        first, second = factory.create(guide), factory.create(guide)
        other = factory.create(GuidedDecodingParams.regex("ab[0-9]"))
        walks = []

        def slow() -> str:
            walks.append("slow")
            time.sleep(2 * forced.MAX_FORCED_WALK_MS / 1e3)
            return "[x]"

        def quick() -> str:
            walks.append("quick")
            return "["
        first._jump, second._jump = slow, quick
        assert second.forced_bytes(16) == b"["  # (a matcher that walked before the long one)
        assert first.forced_bytes(16) == b"[x]"
        assert second.forced_bytes(16) == b"" and first.forced_bytes(16) == b""
        assert walks == ["quick", "slow"]
        assert other.forced_bytes(16) == b"ab"
    finally:
        factory.close()


_INF = float("inf")


@pytest.mark.parametrize("ebnf,bound", [
    ('root ::= "ab" root', _INF),  # no completion: the walk never ends
    ('root ::= r3\nr0 ::= "xy"\nr1 ::= r0 r0\nr2 ::= r1 r1\nr3 ::= r2 r2', 16.0),
    ('root ::= "a" x\nx ::= "" | "z"*', 1.0),
    ('root ::= "x" Regex("[0-9]{3}q")', 17.0),  # (a regex's character: up to 4 bytes)
    ('root ::= "a" root | "b"', 2.0),  # recursion at the end adds nothing
    # recursion with no choice after it forces text at every level it nests
    ('root ::= "[" root "]" | "x"', _INF),
    ('root ::= "=" root "bbbb" | "c"', _INF),
    ('root ::= x "q"\nx ::= "(" y\ny ::= x ")" "zz" | "!"', _INF),  # (through two rules)
    ('root ::= "{" root "}" | "{" "}"', _INF),
    # a choice after the recursion ("," or "]") ends the forced text at every level
    ('root ::= "[" root ("," root)* "]" | "x"', 3.0),
    ('root ::= "=" root ("x" | "y") "' + "b" * 4000 + '" | "c"', 4003.0),
    ('root ::= "(" root [ \\t]* ")" | "x"', 3.0),
    ('root ::= "(" root [ab]? ")" | "x"', 3.0),
    ('root ::= "(" root [a]? ")" | "x"', 3.0),
    ('root ::= "(" root ")"? ")" | "x"', _INF),  # (one or two ")": the same first byte)
    ('root ::= "(" root ")"? | "x"', 2.0),  # (")" or the end: not forced past it)
    # rules nested without recursion add their tails up
    ('root ::= "<" a ">"\na ::= "<" b "..>"\nb ::= "<" c "...>"\nc ::= "x"', 12.0),
    # a TagDispatch: free text forces nothing; the rule a trigger dispatches to is forced,
    # then free text again (the loop) or the rest after the element ("<f": "xyz" "bcd")
    ('root ::= TagDispatch(("<f", r), loop_after_dispatch=true, excludes=())\nr ::= "xyz"',
     3.0),
    ('root ::= "a" TagDispatch(("<f", r), loop_after_dispatch=false, excludes=("zz")) "bcd"'
     '\nr ::= "xyz"', 6.0),
    ('root ::= TagDispatch(("<f", r), loop_after_dispatch=true, excludes=('
     + ", ".join(f'"q{c}"' for c in "abcdefghijklmno") + '))\nr ::= "x"', _INF),
])
def test_forced_text_bound_reads_the_longest_forced_text(ebnf, bound):
    import xgrammar as xgr
    from capgraph.grammar.forced import forced_text_bound
    assert forced_text_bound(str(xgr.Grammar.from_ebnf(ebnf))) == bound


@pytest.mark.parametrize("ebnf,bound", [
    # (a regex's character: up to 4 bytes; 6 in a JSON string, as \uXXXX)
    ('root ::= Regex("a|bbbbbbbbbbbbb")', 52.0),  # (after "b": 12 bytes still forced)
    ('root ::= Regex("(abcdefghijklmnop)*") "z"', 65.0),  # (after "a": "bcd...p")
    ('root ::= "q" Regex("[0-9]{3}") "' + "w" * 10 + '"', 23.0),
])
def test_forced_text_bound_reads_what_is_left_inside_a_regex(ebnf, bound):
    """From inside a regex's match the forced text can be longer than its shortest match."""
    import xgrammar as xgr
    from capgraph.grammar.forced import forced_text_bound
    assert forced_text_bound(str(xgr.Grammar.from_ebnf(ebnf))) == bound


@pytest.mark.parametrize("guide,prefix", [
    (GuidedDecodingParams.ebnf('root ::= "q" ("a" | "b") "\\0' + "d" * 5000 + '"'), "qa"),
    (GuidedDecodingParams.ebnf('root ::= "q" Regex("x\\0' + "y" * 5000 + '")'), "q"),
    (GuidedDecodingParams.regex("q[ab]\\x00" + "d" * 5000), "qa"),
    (GuidedDecodingParams(GuideType.STRUCTURAL_TAG, json.dumps({
        "type": "structural_tag", "format": {"type": "grammar", "grammar":
                                             'root ::= "q" ("a" | "b") "\\0' + "d" * 5000
                                             + '"'}})), "qa"),
])
def test_a_grammar_whose_printed_text_hides_a_nul_gets_no_forced_text(tekken, guide, prefix,
                                                                     tmp_path, monkeypatch):
    """xgrammar prints a byte string or regex only up to its first NUL byte, so the printed
    grammar is not the one the matcher runs (``"\\0ddd..."`` prints as ``""``, and its 5000
    forced bytes looked like none): its serialized form shows it, and the guide (EBNF, regex
    or a structural tag's grammar) gets no forced text, compiled here or loaded from the disk
    cache."""
    import xgrammar as xgr
    from capgraph.grammar.forced import grammar_hides_bytes
    source = guide.guide if guide.guide_type is GuideType.EBNF_GRAMMAR else None
    if source is not None:
        assert grammar_hides_bytes(xgr.Grammar.from_ebnf(source))
        assert not grammar_hides_bytes(xgr.Grammar.from_ebnf(source.replace("\\0", "Q")))
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(tmp_path / "cache"))
    for how in ("compiled", "written", "loaded"):
        factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
            tekken, compile_disk_cache_bytes=0 if how == "compiled" else 1 << 28))
        try:
            if how == "written":  # (every compile written: the next factory loads it)
                factory.disk_cache.min_compile_s = factory.disk_cache.min_speedup = 0.0
                factory.compile(guide)
                assert factory.disk_cache.flush(30)
            loads = factory.stats.disk_hits if how == "loaded" else None
            matcher = factory.create(guide)
            if loads is not None:
                assert factory.stats.disk_hits == loads + 1
            for token in tekken.encode(prefix, add_special_tokens=False):
                assert matcher.accept_token(token)
            assert matcher.forced_bytes(4096) == b""
            assert len(matcher.native.find_jump_forward_string()) > 4096  # (what it hid)
        finally:
            factory.close()


def test_forced_text_bound_admits_the_bundled_schemas_and_json():
    """The bundled schemas' and the JSON grammar's forced text is bounded (their recursion
    meets a choice after every value), in every whitespace mode: drafts are kept."""
    import xgrammar as xgr
    from capgraph.grammar.forced import MAX_FORCED_TEXT_BYTES, forced_text_bound
    schema = bundled_schema()
    for options in ({"any_whitespace": True}, {"any_whitespace": False},
                    {"any_whitespace": False, "separators": (",", ":")}):
        assert forced_text_bound(str(xgr.Grammar.from_json_schema(schema, **options))) \
            <= MAX_FORCED_TEXT_BYTES
    assert forced_text_bound(str(xgr.Grammar.builtin_json_grammar())) <= 16


def _byte_matcher_factory():
    """xgrammar's compiler over a vocabulary of the 256 single bytes (token i: byte i)."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo([bytes([i]) for i in range(256)], xgr.VocabType.RAW,
                             stop_token_ids=[0])
    return xgr.GrammarCompiler(info, cache_enabled=False)


def _random_grammar(rng: random.Random, tag_dispatch: bool = False) -> str:
    """A random EBNF grammar; ``tag_dispatch``: with ``TagDispatch`` elements (free text
    with triggers, excluded strings, and with or without the loop after a dispatch)."""
    names = ["root"] + [f"r{i}" for i in range(1, rng.randint(1, 4))]

    def dispatch() -> str:
        entries = ", ".join(f'("{rng.choice(["a", "<", "x[", "ab", "{"])}", {rng.choice(names)})'
                            for _ in range(rng.randint(1, 2)))
        excludes = ", ".join(f'"{e}"' for e in rng.sample(["b", "]]", "xa", "}"],
                                                          rng.randint(0, 2)))
        return (f"TagDispatch({entries}, loop_after_dispatch="
                f"{rng.choice(['true', 'false'])}, excludes=({excludes}))")

    def atom(depth: int) -> str:
        pick = rng.random()
        if tag_dispatch and pick < 0.15:
            return dispatch()
        if pick < 0.35:
            return '"' + "".join(rng.choice("ab[]{},x") for _ in range(rng.randint(1, 3))) + '"'
        if pick < 0.45:
            return rng.choice(['[ab]', '[a]', '[,\\]]', '[^a]', '[x-z]', '"é"', '[é-ê]', '""'])
        if pick < 0.75 or depth >= 2:
            return rng.choice(names)
        return "(" + seq(depth + 1) + ")" + rng.choice(["", "*", "+", "?", "{2}", "{0,3}",
                                                        "{1,}"])

    def seq(depth: int) -> str:
        return " ".join(atom(depth) for _ in range(rng.randint(1, 4)))

    return "\n".join(f"{name} ::= " + " | ".join(
        [seq(0) for _ in range(rng.randint(1, 3))] + [f'"{rng.choice("xyz")}"'])
        for name in names)


@pytest.mark.parametrize("tag_dispatch", [False, True], ids=["plain", "tag-dispatch"])
def test_forced_text_bound_holds_on_random_grammars_and_outputs(tag_dispatch):
    """Soundness: on random grammars (recursion, repetition, classes, multibyte text; with
    ``TagDispatch`` free text, triggers and excluded strings), at random outputs sampled from
    their masks, xgrammar's jump-forward string is never longer than the bound; where the
    bound is inf nothing is walked (the walk could be endless)."""
    import numpy as np
    import xgrammar as xgr
    from capgraph.grammar.forced import forced_text_bound
    compiler = _byte_matcher_factory()
    bitmask = xgr.allocate_token_bitmask(1, 256)
    walks = bounded = dispatching = 0
    tight = False
    for seed in range(400):
        rng = random.Random(seed)
        try:
            grammar = xgr.Grammar.from_ebnf(_random_grammar(rng, tag_dispatch))
            compiled = compiler.compile_grammar(grammar)
        except RuntimeError:
            continue  # (a grammar xgrammar refuses)
        bound = forced_text_bound(str(grammar))
        if bound == _INF:
            continue
        bounded += 1
        dispatching += "TagDispatch" in str(grammar)
        for _ in range(3):
            matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
            for _ in range(rng.randint(0, 40)):
                if matcher.is_terminated():
                    break
                forced = matcher.find_jump_forward_string().encode("utf-8", "surrogateescape")
                walks += 1
                assert len(forced) <= bound, (seed, str(grammar), forced)
                tight = tight or (bound > 0 and len(forced) == bound)
                matcher.fill_next_token_bitmask(bitmask)
                bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")
                allowed = [i for i in range(1, 256) if bits[i]]
                if not allowed:
                    break
                assert matcher.accept_token(rng.choice(allowed))
    assert bounded > 50 and walks > 500 and tight  # (the test reached real forced text)
    assert dispatching > 20 or not tag_dispatch


def _nested_chain(levels: int, tail: int) -> str:
    """``levels`` distinct rules, each ``"c"`` or opening the next after an "a" and closing
    with a ``tail``-byte run: no recursion, no alternative whose shortest completion is over
    ``tail + 2`` bytes, but a "c" after ``levels`` "a" forces ``levels * tail`` bytes."""
    rules = [f'root ::= "a" r1 "{"z" * tail}" | "c"']
    rules += [f'r{k} ::= "a" r{k + 1} "{"z" * tail}" | "c"' for k in range(1, levels)]
    rules.append(f'r{levels} ::= "c"')
    return "\n".join(rules)


@pytest.mark.parametrize("guide_text,tokens", [
    # a deep stack of short levels (each "=" opens one that forces 16 bytes once "c" comes)
    ('root ::= "=" root "' + "b" * 16 + '" | "c"', ["=" * 8] * 64 + ["c"]),
    # a chain of 400 distinct rules with 16-byte tails: 6400 forced bytes at the deepest
    (_nested_chain(400, 16), ["a" * 8] * 50 + ["c"]),
])
def test_forced_tokens_where_nesting_stacks_forced_text_are_empty_at_once(tekken, guide_text,
                                                                         tokens):
    """Grammars whose forced text grows with the output's nesting get no forced text, so no
    jump-forward walk runs at any depth (the walk builds all of it at once: 5.8 s and 1.4 GB
    for 20k tokens of a 64-level-per-token stack)."""
    import xgrammar as xgr
    from capgraph.grammar.forced import MAX_FORCED_TEXT_BYTES, forced_text_bound
    assert forced_text_bound(str(xgr.Grammar.from_ebnf(guide_text))) > MAX_FORCED_TEXT_BYTES
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tekken))
    try:
        matcher = factory.create(GuidedDecodingParams.ebnf(guide_text))
        for text in tokens:
            for token in tekken.encode(text, add_special_tokens=False):
                assert matcher.accept_token(token)
        assert matcher.native.find_jump_forward_string().startswith("b" * 16) \
            or matcher.native.find_jump_forward_string().startswith("z" * 16)
        start = time.perf_counter()
        assert matcher.forced_bytes(4096) == b""
        assert time.perf_counter() - start < 0.5
    finally:
        factory.close()


def test_forced_text_of_recursive_json_schemas_is_kept(tekken):
    """A recursive schema keeps its forced text: its recursion meets a choice after every
    nested value."""
    schema = {"type": "object", "properties": {"kids": {"type": "array",
                                                        "items": {"$ref": "#"}}},
              "required": ["kids"], "additionalProperties": False}
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tekken))
    try:
        matcher = factory.create(GuidedDecodingParams.json_schema(json.dumps(schema)))
        for token in tekken.encode('{"kids": [{"k', add_special_tokens=False):
            assert matcher.accept_token(token)
        assert matcher.forced_bytes(64) == b'ids"'
    finally:
        factory.close()


def test_xgrammar_forced_bytes_errors_are_matcher_errors(tekken):
    """A failure inside xgrammar's jump-forward search is a named MatcherError."""
    from capgraph.errors import MatcherError
    factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tekken))
    matcher = factory.create(GuidedDecodingParams.regex("ab[0-9]"))

    def broken() -> str:
        raise RuntimeError("std::bad_alloc")
    matcher._jump = broken
    with pytest.raises(MatcherError, match="bad_alloc"):
        matcher.forced_bytes(16)
