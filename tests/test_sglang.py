"""capgraph as an SGLang grammar backend, against SGLang's real classes and its own xgrammar
backend on the same guides and the same (bundled Tekken) tokenizer.

SGLang is an optional extra: without it these tests skip, unless ``CAPGRAPH_REQUIRE_SGLANG=1``
(set by ``.ci/run``, which installs it) makes its absence a failure.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

_REQUIRED = os.environ.get("CAPGRAPH_REQUIRE_SGLANG", "").strip() in ("1", "true", "yes")
try:
    from sglang.srt.constrained.base_grammar_backend import (GRAMMAR_BACKEND_REGISTRY,
                                                             GrammarRow, InvalidGrammarObject)
    from sglang.srt.constrained.xgrammar_backend import XGrammarGrammarBackend
except ImportError as e:  # (SGLang absent, or one of the small packages it imports)
    if _REQUIRED:
        pytest.fail(f"CAPGRAPH_REQUIRE_SGLANG is set but SGLang's grammar modules do not "
                    f"import: {e}", pytrace=False)
    pytest.skip(f"SGLang is not importable ({e}); install ci/sglang-requirements.txt with "
                f"--no-deps to run these tests", allow_module_level=True)

from capgraph.errors import (CompileQueueFullError, ConfigError,  # noqa: E402
                             LayoutError, MatcherError, RequestError)
from capgraph.integrations.sglang import (BACKEND_NAME, CONFIG_ENV,  # noqa: E402
                                          CapgraphGrammar, CapgraphGrammarBackend,
                                          config_from_server_args, create_backend)
from capgraph.tokenizers import special_token_ids  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
# SGLang's xgrammar backend passes xgrammar a deprecated argument; not ours
pytestmark = pytest.mark.filterwarnings("ignore:max_rollback_tokens is deprecated")

# (SGLang key type, guide, text a model would generate under it)
CASES = {
    "json_schema": ("json", json.dumps({
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                       "tags": {"type": "array", "items": {"type": "string"}}},
        "required": ["name", "age", "tags"]}),
        '{"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry"]}'),
    "regex": ("regex", r"\d{3}-[a-z]+( [A-Z][a-z]*)*", "415-abc Hello World"),
    # SGLang's legacy structural-tag format (free text, then a triggered JSON call)
    "structural_tag": ("structural_tag", json.dumps({
        "structures": [{"begin": "<function=get>", "end": "</function>", "schema": {
            "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}],
        "triggers": ["<function="]}),
        'Sure. <function=get>{"q": "weather"}</function>'),
    "ebnf": ("ebnf", 'root ::= expr\nexpr ::= term ("+" term)*\nterm ::= [0-9]+ | "(" expr ")"',
             "(12+3)+45"),
}


@pytest.fixture(scope="module")
def sglang_xgrammar(tekken):
    """SGLang's own xgrammar backend, as SGLang builds it for this tokenizer."""
    return XGrammarGrammarBackend(tekken, vocab_size=len(tekken),
                                  model_eos_token_ids=[tekken.eos_token_id])


@pytest.fixture(scope="module")
def capgraph_backend(tekken):
    backend = CapgraphGrammarBackend(tekken, len(tekken), [tekken.eos_token_id])
    yield backend
    backend.close()


@pytest.fixture(scope="module")
def keep_bits(tekken):
    """[words] int32: every bit set except the special tokens that are not stop tokens, which
    capgraph masks on every guided row and SGLang's xgrammar backend reads as plain text."""
    words = -(-len(tekken) // 32)
    keep = torch.full((words,), -1, dtype=torch.int64)
    for t in special_token_ids(tekken) - {tekken.eos_token_id}:
        keep[t // 32] &= ~(1 << (t % 32))
    return keep.to(torch.int32)


def _dispatch(backend, key_type: str, guide: str):
    grammar = backend._init_value_dispatch((key_type, guide), False)
    assert not isinstance(grammar, InvalidGrammarObject), grammar
    return grammar


def _tokens(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]


def _assert_same_mask(capgraph_grammar, sglang_grammar, keep, what: str) -> bool:
    """One row each, filled by each backend's own methods: capgraph's row is SGLang's with the
    non-stop special tokens cleared and, by capgraph's UTF-8 guard, the tokens whose bytes
    are not UTF-8 after the text so far, bit for bit. Returns whether SGLang's row allowed a
    special token there."""
    vocab = capgraph_grammar.backend.vocab_size
    ours = capgraph_grammar.allocate_vocab_mask(vocab, 1, "cpu")
    capgraph_grammar.fill_vocab_mask_batched([GrammarRow(0, capgraph_grammar)], ours)
    theirs = sglang_grammar.allocate_vocab_mask(vocab, 1, "cpu")
    sglang_grammar.fill_vocab_mask(theirs, 0)
    guard = capgraph_grammar.matcher.utf8_guard
    utf8 = torch.from_numpy(guard.tables.allowed[guard.state()][:theirs.shape[1]].copy())
    expected = theirs[0] & keep & utf8
    differ = (ours[0] != expected).nonzero().flatten().tolist()
    assert not differ, f"{what}: words {differ[:5]} differ"
    return not torch.equal(theirs[0], expected)


@pytest.mark.parametrize("case", sorted(CASES))
def test_masks_equal_sglang_xgrammar_row_for_row(case, tekken, sglang_xgrammar,
                                                 capgraph_backend, keep_bits):
    """Teacher-forced through a whole output and its stop token, then rolled back and copied:
    at every step capgraph's mask equals SGLang's xgrammar backend's (less the special
    tokens capgraph never allows), termination agrees, rollback of 3 tokens returns both to
    the same masks, and a copy starts over on both."""
    key_type, guide, text = CASES[case]
    ours, theirs = (_dispatch(capgraph_backend, key_type, guide),
                    _dispatch(sglang_xgrammar, key_type, guide))
    assert isinstance(ours, CapgraphGrammar)
    tokens = _tokens(tekken, text)
    specials_allowed_by_sglang = 0
    for i, token in enumerate(tokens):
        specials_allowed_by_sglang += _assert_same_mask(ours, theirs, keep_bits,
                                                        f"{case} before token {i}")
        ours.accept_token(token)
        theirs.accept_token(token)
        assert ours.is_terminated() == theirs.is_terminated() == (i == len(tokens) - 1)
    # inside a JSON string or free text SGLang's xgrammar backend lets [INST], <s>, ... through
    assert (specials_allowed_by_sglang > 0) == (case in ("json_schema", "structural_tag"))
    ours.rollback(3)
    theirs.rollback(3)
    assert not ours.is_terminated() and not theirs.is_terminated()
    _assert_same_mask(ours, theirs, keep_bits, f"{case} after rollback(3)")
    for token in tokens[-3:]:
        ours.accept_token(token)
        theirs.accept_token(token)
    assert ours.is_terminated() and theirs.is_terminated()
    ours_copy, theirs_copy = ours.copy(), theirs.copy()
    assert ours_copy.grammar_stats.is_cache_hit and not ours_copy.is_terminated()
    _assert_same_mask(ours_copy, theirs_copy, keep_bits, f"{case} copy")
    ours_copy.accept_token(tokens[0])
    theirs_copy.accept_token(tokens[0])
    _assert_same_mask(ours_copy, theirs_copy, keep_bits, f"{case} copy after one token")


def test_batched_fill_equals_single_fill(tekken, capgraph_backend):
    """A batched fill (the C++ build on a ring mask, xgrammar's batch matcher on any other
    mask) writes exactly what single fills write into the listed rows and leaves the other
    rows unconstrained."""
    grammars = []
    for case in sorted(CASES):
        key_type, guide, text = CASES[case]
        tokens = _tokens(tekken, text)
        for advance in (0, 1, len(tokens) // 2):
            g = _dispatch(capgraph_backend, key_type, guide)
            for t in tokens[:advance]:
                g.accept_token(t)
            grammars.append(g)
    rows = [2 * k + 1 for k in range(len(grammars))]  # every other row, the rest unlisted
    batch = 2 * len(grammars) + 1
    single = torch.full((batch, grammars[0].backend.masks.words), -1, dtype=torch.int32)
    for g, row in zip(grammars, rows):
        g.fill_vocab_mask(single, row)
    entries = [GrammarRow(row, g) for row, g in zip(rows, grammars)]
    ring_mask = grammars[0].allocate_vocab_mask(len(tekken), batch, "cpu")
    grammars[0].fill_vocab_mask_batched(entries, ring_mask)
    assert torch.equal(ring_mask, single)
    other = torch.full_like(single, -1)
    grammars[0].fill_vocab_mask_batched(list(reversed(entries)), other)
    assert torch.equal(other, single)
    assert (single[0] == -1).all() and not (single[1] == -1).all()


def test_llguidance_backend_through_sglang_contract(tekken):
    """With CAPGRAPH_SGLANG_CONFIG's backend="llguidance" the same object contract holds (its
    matchers fill through their own methods): teacher-forced regex output, batched fill equal
    to single fills, termination at the stop token, rollback."""
    pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    backend = CapgraphGrammarBackend(tekken, len(tekken), [tekken.eos_token_id],
                                     config={"backend": "llguidance"})
    try:
        key_type, guide, text = CASES["regex"]
        g = _dispatch(backend, key_type, guide)
        assert g.compiled.backend == "llguidance" and g._handle is None
        tokens = _tokens(tekken, text)
        for token in tokens:
            batched = g.allocate_vocab_mask(len(tekken), 2, "cpu")
            g.fill_vocab_mask_batched([GrammarRow(1, g)], batched)
            single = torch.full_like(batched, -1)
            g.fill_vocab_mask(single, 1)
            assert torch.equal(batched, single) and (batched[0] == -1).all()
            assert int(batched[1, token // 32]) >> (token % 32) & 1
            g.accept_token(token)
        assert g.is_terminated()
        g.rollback(1)
        assert not g.is_terminated()
    finally:
        backend.close()


def test_batched_fill_runs_capgraphs_native_build(capgraph_backend):
    """Where the C++ host build compiles here, the backend's ring masks fill through it."""
    from capgraph.build import library

    reason = library.unavailable_reason()
    if reason is not None:
        pytest.skip(f"capgraph's C++ host build is unavailable here: {reason}")
    assert capgraph_backend.masks.native


def test_ring_reuses_buffers_and_grows(capgraph_backend):
    """allocate_vocab_mask hands out the ring's buffers in turn (no allocation per step once
    warm), every bit set each time, and grows a buffer for a larger batch."""
    ring = capgraph_backend.masks
    first = [ring.allocate(4) for _ in range(len(ring._slots))]
    first[0][1].zero_()
    again = ring.allocate(4)
    assert again.data_ptr() == first[0].data_ptr() and (again == -1).all()
    big = ring.allocate(300)
    assert big.shape == (300, ring.words) and (big == -1).all()
    with pytest.raises(ValueError, match="batch_size"):
        ring.allocate(0)


def test_ring_waits_for_a_device_copy_before_reuse(capgraph_backend, monkeypatch):
    """A ring buffer copied to a CUDA device (move_vocab_mask records an event on that
    device's current stream) is handed out again only after that event completes, and before
    its rows are reset; buffers of other slots and host-only masks wait for nothing."""
    ring = capgraph_backend.masks
    waits = []

    class FakeEvent:  # stands in for torch.cuda.Event on this CPU-only build
        def record(self, stream):
            self.stream = stream

        def synchronize(self):
            waits.append((self.stream, int(mask[0, 0])))  # the buffer is not reset yet

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: f"stream of {device}")
    mask = ring.allocate(2)
    mask[0, 0] = 7
    ring.copied(mask, torch.device("cuda", 1))
    for _ in range(len(ring._slots) - 1):
        ring.allocate(2)
    assert waits == []
    again = ring.allocate(2)
    assert again.data_ptr() == mask.data_ptr() and (again == -1).all()
    assert waits == [("stream of cuda:1", 7)]
    ring.copied(torch.full((2, ring.words), -1, dtype=torch.int32), torch.device("cuda", 0))
    for _ in range(len(ring._slots)):
        ring.allocate(2)
    assert len(waits) == 1  # (a mask outside the ring records nothing)


@pytest.mark.parametrize("key", [("regex", "("), ("ebnf", 'root ::= "a" (')])
def test_invalid_guide_is_reported_as_sglang_reports_it(key, sglang_xgrammar, capgraph_backend):
    """A guide that does not compile comes back through SGLang's compile path
    (get_cached_or_future_value -> future) as an InvalidGrammarObject with a message, as on
    SGLang's own backend; capgraph's message names its error."""
    for backend in (capgraph_backend, sglang_xgrammar):
        value, cache_hit = backend.get_cached_or_future_value(key, False)
        assert not cache_hit
        result = value.result(timeout=60)
        assert isinstance(result, InvalidGrammarObject) and result.error_message
    assert capgraph_backend.get_cached_or_future_value(key, False)[0].result(
        timeout=60).error_message.startswith("GrammarCompileError: cannot compile")


@pytest.mark.parametrize("key_type, guide, error", [
    ("json", json.dumps({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}),
     "UnsupportedGuideError: .*uniqueItems"),
    ("json", '{"type": "object", "properties": ', "GrammarCompileError"),
    ("regex", "a{70000}", "UnsupportedGuideError: .*70000"),
])
def test_unenforceable_guide_is_an_invalid_grammar(key_type, guide, error, capgraph_backend):
    """capgraph's refusals (a schema keyword xgrammar would not enforce, a repetition count
    over max_repetition_count, malformed schema text) reach SGLang as InvalidGrammarObject
    naming the error and what was wrong."""
    result = capgraph_backend._init_value_dispatch((key_type, guide), False)
    assert isinstance(result, InvalidGrammarObject)
    assert re.search(error, result.error_message), result.error_message


def test_rejected_token_raises_value_error_and_keeps_state(tekken, capgraph_backend):
    """accept_token of a token the grammar refuses raises a ValueError (what SGLang catches
    to abort the request) naming the token, and leaves the grammar where it was; a
    terminated grammar ignores further tokens, as SGLang's xgrammar backend does."""
    g = _dispatch(capgraph_backend, "regex", "[0-9]+")
    letter = tekken.encode("x", add_special_tokens=False)[0]
    digit = tekken.encode("7", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match=f"rejects token {letter}"):
        g.accept_token(letter)
    g.accept_token(digit)
    g.accept_token(tekken.eos_token_id)
    assert g.is_terminated() and g.num_accepted == 2
    g.accept_token(letter)  # ignored once terminated
    assert g.num_accepted == 2


def test_apply_vocab_mask_matches_xgrammar(tekken, capgraph_backend):
    """apply_vocab_mask (capgraph's op) masks logits exactly as xgrammar's CPU apply does."""
    import xgrammar as xgr

    g = _dispatch(capgraph_backend, "json", json.dumps({"type": "integer"}))
    mask = g.allocate_vocab_mask(len(tekken), 2, "cpu")
    g.fill_vocab_mask_batched([GrammarRow(1, g)], mask)
    moved = g.move_vocab_mask(mask, "cpu")
    logits = torch.randn(2, len(tekken), generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected, moved, backend="cpu")
    g.apply_vocab_mask(logits, moved)
    assert torch.equal(logits, expected)
    assert logits[0].isfinite().all() and 0 < int(logits[1].isfinite().sum()) < 1000
    g.reset_vocab_mask(mask)
    assert (mask == -1).all()


def test_jump_forward_matches_sglang_xgrammar(tekken, sglang_xgrammar, capgraph_backend):
    """try_jump_forward returns the text the grammar forces next, as SGLang's xgrammar
    backend does, and jump_and_retokenize rolls back to the common prefix and re-accepts."""
    guide = "hello (world|there)"
    ours, theirs = _dispatch(capgraph_backend, "regex", guide), \
        _dispatch(sglang_xgrammar, "regex", guide)
    helper = ours.try_jump_forward(tekken)
    assert helper == theirs.try_jump_forward(tekken) and helper[1].startswith("hello")
    assert ours.jump_forward_str_state(helper) == (helper[1], -1)
    old = tekken.encode("hello", add_special_tokens=False)
    new = tekken.encode("hello wor", add_special_tokens=False)
    for t in old:
        ours.accept_token(t)
    ours.jump_and_retokenize(old, new, -1)
    assert ours.num_accepted == len(new)
    assert ours.try_jump_forward(tekken) is None or "ld".startswith(ours.try_jump_forward(
        tekken)[1])


def test_jump_forward_is_bounded(tekken, capgraph_backend):
    """A grammar that forces 8192 bytes gets no jump-forward text (xgrammar's own walk has no
    length bound: it returned all of them); one that forces a short run gets it whole."""
    from capgraph.grammar.forced import MAX_FORCED_TEXT_BYTES

    rules = ['root ::= r13 "!"', 'r0 ::= "a"'] + [f"r{i} ::= r{i - 1} r{i - 1}"
                                                   for i in range(1, 14)]
    long = _dispatch(capgraph_backend, "ebnf", "\n".join(rules))
    assert long.try_jump_forward(tekken) is None
    assert long.matcher.native.find_jump_forward_string() == "a" * 8192 + "!"
    assert 8192 > MAX_FORCED_TEXT_BYTES
    short = _dispatch(capgraph_backend, "ebnf", "\n".join(rules[:1] + rules[1:9]).replace(
        "r13", "r7"))
    assert short.try_jump_forward(tekken) == ([], "a" * 128 + "!")


def test_jump_forward_failure_aborts_only_its_request(tekken, capgraph_backend, monkeypatch,
                                                      caplog):
    """A matcher whose forced-text search fails gives SGLang's scheduler no exception: no
    jump, and the request's next accept_token raises RequestError naming the failure; another
    request on the same guide goes on."""
    from capgraph.errors import MatcherError, RequestError

    bad, good = (_dispatch(capgraph_backend, "regex", "hello (world|there)") for _ in range(2))

    def fail(max_bytes):
        raise MatcherError("boom", backend="xgrammar")

    monkeypatch.setattr(bad.matcher, "forced_bytes", fail)
    with caplog.at_level(logging.ERROR):
        assert bad.try_jump_forward(tekken) is None
    assert "finding its forced text" in caplog.text and "boom" in caplog.text
    with pytest.raises(RequestError, match="finding its forced text.*boom"):
        bad.accept_token(tekken.encode("hello", add_special_tokens=False)[0])
    assert good.try_jump_forward(tekken)[1].startswith("hello")


def test_jump_forward_on_llguidance(tekken):
    """The llguidance backend's matchers say their forced text too (SGLang's jump-forward
    needs no xgrammar matcher)."""
    backend = CapgraphGrammarBackend(tekken, len(tekken), [tekken.eos_token_id],
                                     config={"backend": "llguidance"})
    try:
        g = _dispatch(backend, "regex", "hello (world|there)")
        helper = g.try_jump_forward(tekken)
        assert helper is not None and helper[0] == [] and helper[1].startswith("hello ")
        for t in tekken.encode(helper[1], add_special_tokens=False):
            g.accept_token(t)
        assert g.try_jump_forward(tekken) is None  # world or there
    finally:
        backend.close()


def test_dead_end_row_allows_only_stop_tokens(tekken, capgraph_backend, caplog):
    """A grammar whose state allows no token would mask a whole logits row to -inf: its row
    allows the stop tokens instead (so the request ends) and an error names the guide."""
    g = _dispatch(capgraph_backend, "regex", "[0-9]+")

    class NothingAllowed:
        def fill_next_token_bitmask(self, bitmask, index):
            bitmask[index].zero_()

        def is_terminated(self):
            return False

    g.matcher, g._handle = NothingAllowed(), None
    mask = g.allocate_vocab_mask(len(tekken), 2, "cpu")
    with caplog.at_level("ERROR"):
        g.fill_vocab_mask_batched([GrammarRow(0, g)], mask)
    allowed = [t for t in range(len(tekken)) if int(mask[0, t // 32]) >> (t % 32) & 1]
    assert allowed == [tekken.eos_token_id]
    assert (mask[1] == -1).all()
    assert "allows no token" in caplog.text and "[0-9]+" in caplog.text
    # the single-row fill SGLang's speculative tree walk uses guards the same (it left the
    # row all zero: every logit -inf)
    single = torch.full_like(mask, -1)
    g.fill_vocab_mask(single, 1)
    assert [t for t in range(len(tekken)) if int(single[1, t // 32]) >> (t % 32) & 1] == \
        [tekken.eos_token_id]
    assert (single[0] == -1).all()


def test_config_from_server_args(monkeypatch):
    """SGLang's JSON whitespace flags map onto json_whitespace; CAPGRAPH_SGLANG_CONFIG adds
    GuidedDecodingConfig fields; what capgraph cannot honour is a named error."""
    args = types.SimpleNamespace(constrained_json_whitespace_pattern=None,
                                 constrained_json_disable_any_whitespace=False,
                                 constrained_json_max_whitespace_cnt=None)
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    assert config_from_server_args(args) == {}
    args.constrained_json_max_whitespace_cnt = 4
    assert config_from_server_args(args) == {"json_whitespace": "bounded",
                                             "json_max_whitespace": 4}
    args.constrained_json_disable_any_whitespace = True
    monkeypatch.setenv(CONFIG_ENV, '{"compile_timeout_s": 5, "backend": "xgrammar"}')
    assert config_from_server_args(args) == {"json_whitespace": "bounded",
                                             "json_max_whitespace": 1,
                                             "compile_timeout_s": 5, "backend": "xgrammar"}
    monkeypatch.setenv(CONFIG_ENV, "[1]")
    with pytest.raises(ConfigError, match="JSON object"):
        config_from_server_args(args)
    args.constrained_json_whitespace_pattern = r"[ ]?"
    with pytest.raises(ConfigError, match="whitespace-pattern"):
        config_from_server_args(args)


def test_backend_refuses_fields_sglang_sets(tekken):
    """The backend config may not override what SGLang's own arguments set."""
    with pytest.raises(ConfigError, match="stop_token_ids"):
        CapgraphGrammarBackend(tekken, len(tekken), config={"stop_token_ids": [1]})


def _declared_entry_point() -> tuple[str, str]:
    text = (ROOT / "pyproject.toml").read_text()
    section = re.search(r'\[project\.entry-points\."sglang\.srt\.plugins"\]\n(.*?)(?:\n\[|\Z)',
                        text, re.S)
    assert section, "pyproject.toml declares no sglang.srt.plugins entry point"
    name, value = re.search(r'^(\w+)\s*=\s*"([^"]+)"', section.group(1), re.M).groups()
    return name, value


def test_entry_point_registers_backend_with_sglang(tmp_path, monkeypatch):
    """The entry point pyproject.toml declares, once installed, is found and run by SGLang's
    plugin loader (group sglang.srt.plugins), and makes ``capgraph`` a --grammar-backend choice
    that SGLang's own argument parser accepts and whose registry entry builds this backend."""
    from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES
    from sglang.srt.plugins import GENERAL_PLUGINS_GROUP, load_plugins_by_group

    name, value = _declared_entry_point()
    assert name == BACKEND_NAME and value == "capgraph.integrations.sglang:register"
    # an installed distribution declaring exactly that entry point
    dist = tmp_path / "capgraph_entry_point_probe-0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: capgraph-entry-point-probe\n"
                                   "Version: 0\n")
    (dist / "entry_points.txt").write_text(f"[{GENERAL_PLUGINS_GROUP}]\n{name} = {value}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("SGLANG_PLUGINS", raising=False)
    monkeypatch.delitem(GRAMMAR_BACKEND_REGISTRY, BACKEND_NAME, raising=False)
    plugins = load_plugins_by_group(GENERAL_PLUGINS_GROUP)
    assert BACKEND_NAME in plugins
    plugins[BACKEND_NAME][0]()
    plugins[BACKEND_NAME][0]()  # idempotent
    assert GRAMMAR_BACKEND_REGISTRY[BACKEND_NAME] is create_backend
    assert GRAMMAR_BACKEND_CHOICES.count(BACKEND_NAME) == 1
    import argparse

    from sglang.srt.server_args import ServerArgs

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = parser.parse_args(["--model-path", "m", "--grammar-backend", BACKEND_NAME])
    assert args.grammar_backend == BACKEND_NAME


def test_installed_capgraph_declares_the_entry_point():
    """The capgraph distribution installed from this tree carries the entry point (what
    `pip install` of this pyproject gives SGLang)."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution("capgraph")
    except PackageNotFoundError:
        pytest.skip("capgraph is not installed as a distribution")
    origin = Path(sys.modules["capgraph"].__file__).resolve().parent.parent
    url = json.loads(dist.read_text("direct_url.json") or "{}").get("url")
    if url is not None and url != origin.as_uri():  # (an editable install of another tree)
        pytest.skip(f"the installed capgraph metadata comes from {url}, not {origin}")
    found = {(ep.name, ep.value) for ep in dist.entry_points
             if ep.group == "sglang.srt.plugins"}
    assert found == {_declared_entry_point()}


def _allowed(mask_row: torch.Tensor, vocab: int) -> list[int]:
    return [t for t in range(vocab) if int(mask_row[t // 32]) >> (t % 32) & 1]


def _accepts(grammar, tok, text: str) -> bool:
    """Whether the grammar takes ``text`` and then the stop token (SGLang's accept path: a
    ValueError is a refusal)."""
    for token in _tokens(tok, text):
        try:
            grammar.accept_token(token)
        except ValueError:
            return False
    return grammar.is_terminated()


class _BrokenMatcher:
    """A matcher in llguidance's error state: every call raises capgraph's MatcherError (a
    RuntimeError, which SGLang's handlers do not catch)."""

    def fill_next_token_bitmask(self, bitmask, index):
        raise MatcherError("Current row has 2005 items; max is 2000", backend="llguidance")

    def accept_token(self, token):
        raise MatcherError("Current row has 2005 items; max is 2000", backend="llguidance")

    def is_terminated(self):
        return False


def test_matcher_failure_ends_only_its_request(tekken, capgraph_backend, caplog):
    """A matcher that fails (llguidance's "row has 2005 items" on an ambiguous grammar) in the
    batched fill does not raise out of it (SGLang's scheduler would die): its row allows only
    the stop tokens, the other rows fill as usual, the error is logged, and its next
    accept_token raises a ValueError (what SGLang turns into that request's abort). A failure
    in accept_token itself is a ValueError as well."""
    good = _dispatch(capgraph_backend, "regex", "[0-9]+")
    bad = _dispatch(capgraph_backend, "regex", "[0-9]+")
    bad.matcher, bad._handle = _BrokenMatcher(), None
    expected = torch.full((3, capgraph_backend.masks.words), -1, dtype=torch.int32)
    good.fill_vocab_mask(expected, 0)
    mask = good.allocate_vocab_mask(len(tekken), 3, "cpu")
    with caplog.at_level("ERROR"):
        good.fill_vocab_mask_batched([GrammarRow(0, good), GrammarRow(1, bad)], mask)
    assert torch.equal(mask[0], expected[0]) and (mask[2] == -1).all()
    assert _allowed(mask[1], len(tekken)) == [tekken.eos_token_id]
    assert "row has 2005 items" in caplog.text
    with pytest.raises(ValueError, match="MatcherError: .*2005 items"):
        bad.accept_token(tekken.eos_token_id)
    single = torch.full_like(expected, -1)
    bad.fill_vocab_mask(single, 2)  # (SGLang's speculative path fills row by row)
    assert _allowed(single[2], len(tekken)) == [tekken.eos_token_id]
    good.accept_token(tekken.encode("7", add_special_tokens=False)[0])

    failing = _dispatch(capgraph_backend, "regex", "[0-9]+")
    failing.matcher = _BrokenMatcher()
    with pytest.raises(ValueError, match="MatcherError"):
        failing.accept_token(tekken.encode("7", add_special_tokens=False)[0])


def test_transient_compile_failure_is_not_cached(capgraph_backend, monkeypatch):
    """SGLang caches ``grammar.copy()`` of whatever a compile gave (grammar_manager.py), an
    InvalidGrammarObject included: a transient failure (queue full, timeout, worker out of
    memory) or SGLang's own preprocessing timeout is not kept, so the next request with the
    guide compiles again; a guide that is wrong stays a cached failure, as on SGLang's
    backends."""
    key = ("regex", "transient-[a-z]+")

    def refuse(params, **kwargs):
        raise CompileQueueFullError("12 compiles already queued", guide_type="REGEX",
                                    backend="xgrammar")

    with monkeypatch.context() as m:
        m.setattr(capgraph_backend.factory, "compile_async", refuse)
        value, hit = capgraph_backend.get_cached_or_future_value(key, False)
        first = value.result(timeout=60)
    assert not hit and isinstance(first, InvalidGrammarObject)
    assert first.error_message.startswith("CompileQueueFullError")
    capgraph_backend.set_cache(key, first.copy())  # (what SGLang does with the result)
    value, hit = capgraph_backend.get_cached_or_future_value(key, False)
    assert not hit and isinstance(value.result(timeout=60), CapgraphGrammar)

    timed_out = ("regex", "sglang-timeout-[a-z]+")
    capgraph_backend.set_cache(timed_out, InvalidGrammarObject("Grammar preprocessing timed out"))
    assert not capgraph_backend.get_cached_or_future_value(timed_out, False)[1]

    wrong = ("regex", "wrong-(")
    value, hit = capgraph_backend.get_cached_or_future_value(wrong, False)
    failed = value.result(timeout=60)
    capgraph_backend.set_cache(wrong, failed.copy())
    again, hit = capgraph_backend.get_cached_or_future_value(wrong, False)
    assert hit and again is failed


def test_sglang_cache_keeps_no_compiled_guides(tekken):
    """SGLang's grammar cache never evicts: it keeps only the guide's key (bounded), and a
    cache hit takes the compiled guide from capgraph's byte-bounded cache, so
    compile_cache_bytes bounds what compiled guides cost; a guide evicted there compiles
    again."""
    backend = CapgraphGrammarBackend(tekken, len(tekken), [tekken.eos_token_id])
    try:
        key = ("regex", "cached-[0-9]+")
        value, hit = backend.get_cached_or_future_value(key, False)
        grammar = value.result(timeout=60)
        backend.set_cache(key, grammar.copy())
        assert backend.cache == {}  # SGLang's dict holds no grammar (nor its compiled guide)
        assert not any(isinstance(v, CapgraphGrammar) for v, _ in backend._keys._items.values())
        again, hit = backend.get_cached_or_future_value(key, False)
        assert hit and isinstance(again, CapgraphGrammar) and again.grammar_stats.is_cache_hit
        assert again.compiled is grammar.compiled and again.matcher is not grammar.matcher
        assert _accepts(again, tekken, "cached-123")
        with backend.factory._lock:
            backend.factory.cache.clear()  # (evicted)
        value, hit = backend.get_cached_or_future_value(key, False)
        assert not hit and _accepts(value.result(timeout=60), tekken, "cached-45")
        backend.reset()
        assert not backend.get_cached_or_future_value(key, False)[1]
    finally:
        backend.close()


def _whitespace_args(disable: bool, count=None):
    return types.SimpleNamespace(constrained_json_whitespace_pattern=None,
                                 constrained_json_disable_any_whitespace=disable,
                                 constrained_json_max_whitespace_cnt=count)


def test_disable_any_whitespace_accepts_what_sglang_xgrammar_accepts(tekken, monkeypatch):
    """--constrained-json-disable-any-whitespace: SGLang's xgrammar backend then allows exactly
    the separators ", " and ": "; capgraph has no such mode and bounds every whitespace run to
    one character, which accepts all of SGLang's spellings (and the compact one as well) and
    nothing with a longer run. "$$ANY$$" (json_object) ignores the flag on both, as SGLang's
    builtin JSON grammar does."""
    monkeypatch.delenv(CONFIG_ENV, raising=False)
    ours = create_backend(_whitespace_args(True), tekken, len(tekken), [tekken.eos_token_id])
    theirs = XGrammarGrammarBackend(tekken, vocab_size=len(tekken),
                                    model_eos_token_ids=[tekken.eos_token_id],
                                    any_whitespace=False)
    try:
        schema = json.dumps({"type": "object", "properties": {
            "a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}},
            "required": ["a", "b"]})
        for text, sglang, capgraph in [('{"a": 1, "b": [2, 3]}', True, True),
                                       ('{"a":1,"b":[2,3]}', False, True),
                                       ('{"a":  1, "b": [2, 3]}', False, False),
                                       ('{\n  "a": 1, "b": [2]\n}', False, False)]:
            assert _accepts(_dispatch(theirs, "json", schema), tekken, text) is sglang, text
            assert _accepts(_dispatch(ours, "json", schema), tekken, text) is capgraph, text
        for text in ('{"a":1}', '{"a": 1, "b": [1, 2]}', '{\n  "a": 1\n}'):
            assert _accepts(_dispatch(theirs, "json", "$$ANY$$"), tekken, text), text
            assert _accepts(_dispatch(ours, "json", "$$ANY$$"), tekken, text), text
    finally:
        ours.close()


def test_structural_tag_null_json_schema_is_repaired_as_sglang_does(tekken, sglang_xgrammar,
                                                                    capgraph_backend):
    """A current-format structural tag whose json_schema is missing or null at any nesting
    level (a tool without parameters) is served as {} there, as SGLang's xgrammar backend
    repairs it, with the same masks."""
    tag = json.dumps({"type": "structural_tag", "format": {
        "type": "triggered_tags", "triggers": ["<tool"], "tags": [
            {"type": "tag", "begin": "<tool=a>", "content": {"type": "json_schema",
                                                             "json_schema": None},
             "end": "</tool>"},
            {"type": "tag", "begin": "<tool=b>", "content": {
                "type": "sequence", "elements": [{"type": "json_schema"}]}, "end": "</tool>"}]}})
    ours = _dispatch(capgraph_backend, "structural_tag", tag)
    theirs = _dispatch(sglang_xgrammar, "structural_tag", tag)
    for token in _tokens(tekken, 'Hi <tool=b>{"x": [1]}</tool>'):
        a = ours.allocate_vocab_mask(len(tekken), 1, "cpu")
        ours.fill_vocab_mask(a, 0)
        b = theirs.allocate_vocab_mask(len(tekken), 1, "cpu")
        theirs.fill_vocab_mask(b, 0)
        assert int(a[0, token // 32]) >> (token % 32) & 1
        assert int(b[0, token // 32]) >> (token % 32) & 1
        ours.accept_token(token)
        theirs.accept_token(token)
    assert ours.is_terminated() and theirs.is_terminated()


def test_unknown_config_field_is_a_named_config_error(tekken, monkeypatch):
    """An unknown field in CAPGRAPH_SGLANG_CONFIG (or the backend's config) is a ConfigError
    naming the variable and the field, not a TypeError."""
    monkeypatch.setenv(CONFIG_ENV, '{"bogus_field": 1}')
    with pytest.raises(ConfigError, match=f"{CONFIG_ENV}.*'bogus_field'"):
        config_from_server_args(_whitespace_args(False))
    with pytest.raises(ConfigError, match="'bogus_field'"):
        CapgraphGrammarBackend(tekken, len(tekken), config={"bogus_field": 1})


def test_several_eos_ids_on_a_one_stop_backend(tekken):
    """A model with several EOS ids (SGLang passes them all) on a backend that takes one stop
    token (llguidance here; also "auto" and json_unenforced_keywords="fallback"): the backend
    starts, every EOS id is allowed exactly where the grammar may end, and each ends it."""
    pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    eos, other = tekken.eos_token_id, 11
    backend = CapgraphGrammarBackend(tekken, len(tekken), {other, eos},
                                     config={"backend": "llguidance"})
    try:
        assert backend.stop_ids == tuple(sorted((eos, other)))
        digit = tekken.encode("7", add_special_tokens=False)[0]
        for stop in (eos, other):
            g = _dispatch(backend, "regex", "[0-9]+")
            for batched in (False, True):
                mask = g.allocate_vocab_mask(len(tekken), 1, "cpu")
                if batched:
                    g.fill_vocab_mask_batched([GrammarRow(0, g)], mask)
                else:
                    g.fill_vocab_mask(mask, 0)
                allowed = set(_allowed(mask[0], len(tekken)))
                assert (eos in allowed) == (other in allowed) == (g.num_accepted > 0)
                if not batched and g.num_accepted == 0:
                    with pytest.raises(ValueError):
                        g.accept_token(other)
                    g.accept_token(digit)
            g.accept_token(stop)
            assert g.is_terminated()
            g.rollback(1)
            assert not g.is_terminated()
    finally:
        backend.close()


@pytest.mark.parametrize("config", [{}, {"backend": "llguidance"}, {"backend": "auto"},
                                    {"json_unenforced_keywords": "fallback"}],
                         ids=["xgrammar", "llguidance", "auto", "fallback"])
@pytest.mark.parametrize("bad", ["negative", "past_vocab", "float", "bool", "str"])
def test_bad_eos_ids_are_a_config_error_on_every_backend(tekken, config, bad):
    """Every EOS id SGLang passes is checked before one is chosen as the matchers' stop token,
    on the backends that take one stop token as on xgrammar: an id that is not an exact int in
    [0, vocab_size) is a ConfigError naming it (never a text token opened by a -1, nor an
    IndexError at every fill)."""
    if config.get("backend") in ("llguidance", "auto") or config.get("json_unenforced_keywords"):
        pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    value = {"negative": -1, "past_vocab": len(tekken) + 5, "float": 11.0, "bool": True,
             "str": "11"}[bad]
    with pytest.raises(ConfigError, match=re.escape(f"eos_token_ids holds {value!r}")):
        CapgraphGrammarBackend(tekken, len(tekken), [tekken.eos_token_id, value],
                               config=config)


def test_bad_mask_row_is_refused_without_blaming_a_request(tekken, capgraph_backend):
    """A row index outside the vocab mask (or not an integer), in a single or a batched fill,
    is a LayoutError naming the row and the mask's rows: no row is written (a -1 does not
    reach the last row, another request's) and the grammar keeps no error (its request is not
    aborted for the engine's mistake); a NumPy integer row is a row."""
    grammar = _dispatch(capgraph_backend, "regex", "ab+c")
    other = _dispatch(capgraph_backend, "regex", "ab+c")
    mask = grammar.allocate_vocab_mask(len(tekken), 2, "cpu")
    grammar.fill_vocab_mask_batched([GrammarRow(0, grammar), GrammarRow(1, other)], mask)
    before = mask.clone()
    for row in (-1, 2, 100, 1.0, True, None):
        with pytest.raises(LayoutError, match=re.escape(f"row {row!r} is outside the mask's 2 "
                                                        f"rows [0, 2)")):
            grammar.fill_vocab_mask_batched([GrammarRow(0, other), GrammarRow(row, grammar)],
                                            mask)
        with pytest.raises(LayoutError, match=re.escape(f"row {row!r}")):
            grammar.fill_vocab_mask(mask, row)
        assert torch.equal(mask, before)
        assert grammar._error is None and other._error is None
    single = torch.full_like(mask, -1)
    grammar.fill_vocab_mask(single, np.int64(1))
    grammar.fill_vocab_mask_batched([GrammarRow(np.int32(0), grammar)], single)
    assert torch.equal(single[0], before[0]) and torch.equal(single[1], before[0])
    grammar.accept_token(tekken.encode("a", add_special_tokens=False)[0])


def test_rollback_past_the_accepted_tokens_is_a_request_error(tekken, capgraph_backend):
    """rollback(k) with k outside [0, tokens accepted] (or not an integer) is a RequestError
    naming k and the limit, not xgrammar's RuntimeError into SGLang's scheduler; nothing is
    undone, and a rollback within the limit still works."""
    grammar = _dispatch(capgraph_backend, "regex", "ab+c")
    a, b = (tekken.encode(t, add_special_tokens=False)[0] for t in "ab")
    grammar.accept_token(a)
    grammar.accept_token(b)
    for k in (3, -1, 1.5, True, "1", None):
        with pytest.raises(RequestError, match=re.escape(f"rollback({k!r})") + r".*\[0, 2\]"):
            grammar.rollback(k)
        assert grammar.num_accepted == 2
    grammar.rollback(2)
    assert grammar.num_accepted == 0
    grammar.accept_token(a)
    with pytest.raises(RequestError, match=r"\[0, 1\]"):
        grammar.rollback(2)


def test_a_rollback_past_the_utf8_guards_history_is_a_request_error(tekken, capgraph_backend):
    """A rollback deeper than an xgrammar matcher's UTF-8 guard keeps (jump_and_retokenize
    over a long output) is a RequestError, the contract's error for a rollback it cannot
    make, and undoes nothing; one within it undoes its tokens."""
    from capgraph.grammar.utf8 import RING

    grammar = _dispatch(capgraph_backend, "regex", "a*")
    a = tekken.convert_tokens_to_ids("a")
    for _ in range(RING + 4):
        grammar.accept_token(a)
    with pytest.raises(RequestError, match="UTF-8 guard's history"):
        grammar.rollback(RING + 2)
    assert grammar.num_accepted == RING + 4
    grammar.rollback(RING - 1)
    assert grammar.num_accepted == 5


# A draft-tree walk written to the contract SGLang's speculative decoding calls a grammar with
# (its ``traverse_tree``): node 0 is the committed token; each other node's draft is accepted
# where its parent's row allows it, its own row filled unless the grammar terminated, its
# children visited, then it is rolled back, then its siblings. It runs as a function of a
# module in SGLang's speculative package, as SGLang's walk does, outside any try block.
_WALK_SOURCE = '''
def walk(grammar, tokens, children, mask):
    def visit(node, parent):
        if node:
            token = tokens[node]
            if not (int(mask[parent, token // 32]) >> (token % 32)) & 1:
                return
            grammar.accept_token(token)
        if not grammar.is_terminated():
            grammar.fill_vocab_mask(mask, node)
            for child in children.get(node, ()):
                visit(child, node)
        if node:
            grammar.rollback(1)
    visit(0, -1)
'''


@pytest.fixture(scope="module")
def tree_walk():
    module = types.ModuleType("sglang.srt.speculative._capgraph_test_walk")
    exec(_WALK_SOURCE, module.__dict__)
    return module.walk


def test_a_dead_end_under_a_draft_ends_its_branch_of_the_tree_walk(tekken, capgraph_backend,
                                                                    tree_walk):
    """SGLang's draft-tree walk over a grammar with a dead end after "a" (``x ::= x`` never
    completes): the row under draft "a" allows only the stop token, and the walk accepts a
    draft stop token there. That ends the branch (no exception out of the walk, which would
    take down SGLang's scheduler); the sibling draft "b" is walked as usual and the grammar is
    back where it started. When verification then brings the request down that branch, its
    accept_token of the stop token raises the ValueError SGLang aborts the request with."""
    g = _dispatch(capgraph_backend, "ebnf", 'root ::= "a" x | "b" "c"\nx ::= x')
    V, eos = len(tekken), tekken.eos_token_id
    a, b, c = (tekken.encode(ch, add_special_tokens=False)[0] for ch in "abc")
    mask = g.allocate_vocab_mask(V, 4, "cpu")
    tree_walk(g, [0, a, eos, b], {0: [1, 3], 1: [2]}, mask)
    assert _allowed(mask[1], V) == [eos]  # (the dead end's row)
    assert _allowed(mask[3], V) == [c]
    assert g.num_accepted == 0 and not g.is_terminated()
    g.accept_token(b)  # (verification took the sibling: the request goes on)
    g.rollback(1)
    g.accept_token(a)
    with pytest.raises(ValueError, match="rejects token"):
        g.accept_token(eos)


def test_a_fill_failure_inside_the_tree_walk_fails_the_request_after_it(tekken,
                                                                       capgraph_backend,
                                                                       tree_walk):
    """A matcher whose fill fails under one draft of the walk (llguidance's error state):
    its row allows only the stop tokens, the walk goes on through the drafts after it (the
    stop token under it, the sibling draft) without raising, and the request's next
    accept_token, on its verified path, raises the kept error: SGLang aborts that request
    alone."""
    g = _dispatch(capgraph_backend, "regex", "[0-9]+")
    V, eos = len(tekken), tekken.eos_token_id
    one, two, three = (tekken.encode(ch, add_special_tokens=False)[0] for ch in "123")
    fill, calls = g.matcher.fill_next_token_bitmask, []

    def fails_second(bitmask, index):
        calls.append(index)
        if len(calls) == 2:
            raise MatcherError("Current row has 2005 items; max is 2000", backend="llguidance")
        return fill(bitmask, index)
    g.matcher.fill_next_token_bitmask, g._handle = fails_second, None
    g.accept_token(one)
    mask = g.allocate_vocab_mask(V, 4, "cpu")
    tree_walk(g, [one, two, eos, three], {0: [1, 3], 1: [2]}, mask)
    assert calls == [0, 1] and _allowed(mask[1], V) == [eos]
    with pytest.raises(ValueError, match="2005 items"):
        g.accept_token(two)


def test_a_matcher_raising_inside_the_tree_walk_fails_the_request_after_it(
        tekken, capgraph_backend, tree_walk):
    """A matcher whose accept raises under one draft of the walk: nothing raises out of the
    walk (the sibling draft is walked), and the request's next accept_token raises a
    ValueError naming the failure, its cause the matcher's own exception."""
    g = _dispatch(capgraph_backend, "regex", "[0-9]+")
    V = len(tekken)
    one, two, three = (tekken.encode(ch, add_special_tokens=False)[0] for ch in "123")
    accept = g.matcher.accept_token

    def raises_on_two(token):
        if token == two:
            raise RuntimeError("matcher state lost")
        return accept(token)
    g.matcher.accept_token, g._handle = raises_on_two, None
    g.accept_token(one)
    mask = g.allocate_vocab_mask(V, 3, "cpu")
    tree_walk(g, [one, two, three], {0: [1, 2]}, mask)
    with pytest.raises(ValueError, match="matcher state lost") as raised:
        g.accept_token(three)
    assert isinstance(raised.value.__cause__, RuntimeError)


def test_outside_the_tree_walk_a_refused_draft_still_raises(tekken, capgraph_backend):
    """The tree walk's leniency is the walk's alone: called from anywhere else (SGLang's
    verified-token path), a token the grammar refuses raises at once and counts nothing."""
    g = _dispatch(capgraph_backend, "regex", "[0-9]+")
    with pytest.raises(ValueError, match="rejects token"):
        g.accept_token(tekken.encode("x", add_special_tokens=False)[0])
    assert g.num_accepted == 0 and not g.is_terminated()


@pytest.mark.parametrize("dispatch", ["dispatch_json", "dispatch_structural_tag"])
def test_a_guide_nested_too_deep_is_an_invalid_grammar_not_a_recursion_error(capgraph_backend,
                                                                            dispatch):
    """A guide nested 5000 levels deep (an array inside an array...) comes back as SGLang's
    invalid grammar naming the depth, from the JSON and the structural-tag dispatchers alike
    (the structural tag's repair reads it first, with a reader that recurses: its
    RecursionError must not reach SGLang's compile thread)."""
    grammar = getattr(capgraph_backend, dispatch)("[" * 5000 + "]" * 5000)
    assert isinstance(grammar, InvalidGrammarObject)
    assert "nests 5000 levels deep" in grammar.error_message
