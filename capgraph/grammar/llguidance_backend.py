"""llguidance backend (optional extra): JSON schema, regex and Lark grammars, one stop token.

llguidance keeps errors as a sticky state instead of raising; every call here checks it and
raises :class:`~capgraph.errors.MatcherError`. Termination on the stop token is tracked by the
wrapper, and :meth:`rollback` counts a stop token llguidance never consumed as one step.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence, cast

import numpy as np
import torch

from ..errors import ConfigError, GrammarCompileError, MatcherError, UnsupportedGuideError
from ..params import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from .base import CompiledGuide, GrammarMatcher, GrammarMatcherFactory, whole_utf8_prefix
from .semantics import (JSON_CONTAINER_SCHEMA, JSON_WHITESPACE_CHARS, ecma_regex,
                        llguidance_schema)
from .lark_text import (LarkJson, LarkTextError, LarkTokenRef, lark_json_values, lark_lazy_rules,
                        lark_options, lark_token_refs, replace_json_values)
from .schema_policy import describe, unenforced_in_text

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

try:  # optional extra
    import llguidance
    import llguidance.hf
    import llguidance.torch
except ImportError:  # pragma: no cover - exercised where the extra is absent
    llguidance = None  # type: ignore[assignment]

__all__ = ["LLGuidanceGuide", "LLGuidanceMatcher", "LLGuidanceMatcherFactory", "available"]

BACKEND = "llguidance"
# one JSON whitespace character, as xgrammar reads it: [\x20\x0A\x0D\x09]
_JSON_WHITESPACE = "[" + "".join(f"\\x{ord(c):02X}" for c in JSON_WHITESPACE_CHARS) + "]"


#: llguidance's cap on the Earley items of one step (its default); the items of one row (a
#: rule's live alternatives) may take all of it.
STEP_MAX_ITEMS = 50_000


def _parser_limits() -> "llguidance.LLParserLimits":
    """llguidance's defaults, but for ``max_items_in_row`` (2000 by default) raised to the
    per-step cap :data:`STEP_MAX_ITEMS`, which still bounds a step's work. With the default,
    a rule of more than 2000 alternatives (a large choice list) compiles and then fails its
    request at the first token ("Current row has 3001 items; max is 2000")."""
    return llguidance.LLParserLimits(max_items_in_row=STEP_MAX_ITEMS,
                                     step_max_items=STEP_MAX_ITEMS)


def json_whitespace_options(config: GuidedDecodingConfig) -> JsonCompileOptions:
    """llguidance JSON compile options for ``config.json_whitespace``, given as ``overrides``
    so that they win over a schema's own ``x-guidance``; the same strings as the xgrammar
    backend accepts."""
    mode = config.json_whitespace
    if mode == "compact":
        return {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
    limit = f"{{0,{config.json_max_whitespace}}}" if mode == "bounded" else "*"
    return {"whitespace_flexible": True, "whitespace_pattern": _JSON_WHITESPACE + limit,
            "item_separator": ",", "key_separator": ":"}


#: The options a Lark grammar's ``%llguidance {...}`` may name (llguidance's
#: ``LLGuidanceOptions``); capgraph refuses ``allow_invalid_utf8`` set to true.
LLGUIDANCE_OPTIONS = ("allow_initial_skip", "allow_invalid_utf8", "ignore_once", "no_forcing")


def _refuse(what: str) -> None:
    raise UnsupportedGuideError(
        f"llguidance would not enforce {what}; remove them, use the xgrammar backend, set "
        "GuidedDecodingConfig(json_unenforced_keywords='fallback') to let xgrammar serve such "
        "schemas, or 'ignore' to generate with them unenforced", guide_type="JSON_SCHEMA",
        backend=BACKEND)


def _refuse_lark(what: str) -> None:
    raise UnsupportedGuideError(
        f"llguidance would not enforce {what}; remove them, use a JSON_SCHEMA guide or the "
        "xgrammar backend, or set GuidedDecodingConfig(json_unenforced_keywords='ignore') to "
        "generate with them unenforced", guide_type="EBNF_GRAMMAR", backend=BACKEND)


def available() -> bool:
    """Whether the llguidance extra is installed."""
    return llguidance is not None


#: Appended to every Lark guide. llguidance 1.9.1 computes the bytes a grammar forces in a
#: loop that stops only where the parser accepts or more than one byte may follow; with a
#: lexeme that may end or go on before one that starts the same way (``start: /a+/ "a"``,
#: ``start: / +/ " "``) the parser never reports accepting there, and the loop forces the
#: same byte forever, holding its memory growing (the first mask of ``/a+/ "a"`` never
#: returns). Without forcing a mask is the grammar's, every tokenization of forced text
#: allowed; the forced bytes of such a guide are read from masks
#: (:meth:`LLGuidanceMatcher.forced_bytes`). JSON-schema and regex guides, whose lexemes
#: are separated, keep llguidance's forcing.
_NO_FORCING = '\n%llguidance {"no_forcing": true}\n'

#: What a compiled guide's parser and lexer count for in the compile cache's byte bound,
#: besides the grammar text: llguidance does not report its size; a template of a bundled
#: JSON schema, first mask computed, grows the process by a few tens of KiB.
_TEMPLATE_BYTES = 64 * 1024


@dataclass(frozen=True, slots=True)
class LLGuidanceGuide:
    """llguidance's compiled guide: the grammar text and the matcher built from it, at the
    start with its first mask computed (every request's matcher is a copy of it; the template
    itself is never advanced)."""

    grammar: str
    template: "llguidance.LLMatcher"
    #: llguidance forces bytes for this guide (JSON-schema and regex guides; not Lark:
    #: :data:`_NO_FORCING`)
    forcing: bool = True


def _refuse_empty_lazy(grammar: str) -> None:
    """Refuse a ``lazy`` rule or terminal of the Lark ``grammar`` that may match the empty
    text, however it is written (``r[lazy]: /[a-z]*/``, ``r[lazy]: R`` with ``R: /[a-z]*/``,
    ``r[lazy]: "a"? | "b"*``: :func:`~capgraph.grammar.lark_text.lark_lazy_rules`), and one
    whose body capgraph cannot judge. llguidance documents a lazy lexeme as matching as few
    bytes as possible, none here, but 1.9.1 takes one character (``"<" r ">"`` accepts
    ``<a>`` and refuses ``<ab>``), and with byte forcing its first mask panicked. A lazy rule
    with a ``stop`` or ``suffix`` ends with it and is never empty.

    Raises:
        LarkTextError: the grammar cannot be read.
    """
    for rule in lark_lazy_rules(grammar):
        if rule.empty is False:
            continue
        reason = ("matches the empty text" if rule.empty else
                  "has a body capgraph cannot tell is never empty (a %regex or %lark value, "
                  "a grammar reference, a template, an undefined name or a regex it cannot "
                  "read)")
        raise UnsupportedGuideError(
            f"the lazy rule {rule.name!r} at line {rule.line} of the grammar {reason}: "
            "llguidance documents a lazy lexeme as matching as few bytes as possible, yet "
            "takes a character where its body may be empty; make it match at least one "
            "character, give it a stop or suffix, or drop 'lazy'",
            guide_type="EBNF_GRAMMAR", backend=BACKEND)


#: The most masks :meth:`LLGuidanceMatcher.forced_bytes` reads for a guide llguidance does
#: not force bytes for (one per forced token; a mask is a fraction of a millisecond).
MAX_FORCED_MASKS = 16


class LLGuidanceMatcher(GrammarMatcher):
    """Wraps ``llguidance.LLMatcher``.

    The stop token reaches a terminated state two ways: consumed by llguidance itself (the
    grammar could go on but may also end), or — once llguidance has stopped because the grammar
    cannot go on — accepted by this wrapper alone. Only the second kind is invisible to
    llguidance, so only it is subtracted by :meth:`rollback` before delegating.
    """

    __slots__ = ("_matcher", "_eos", "_terminated", "_wrapper_eos", "_eos_is_text", "_tokens")

    def __init__(self, matcher: "llguidance.LLMatcher", eos_token: int,
                 eos_is_text: bool = False,
                 tokens: "llguidance.LLTokenizer | None" = None) -> None:
        self._matcher = matcher
        self._eos = eos_token
        # the tokenizer whose token bytes :meth:`forced_bytes` reads masks with, for a guide
        # llguidance does not force bytes for; None: llguidance's own forced bytes
        self._tokens = tokens
        # the stop token is ordinary text: llguidance's mask allows it wherever its text fits,
        # but consumes it only as the end (fill_next_token_bitmask)
        self._eos_is_text = eos_is_text
        self._terminated = False
        self._wrapper_eos = False
        self._check()

    @property
    def native(self) -> "llguidance.LLMatcher":
        """The wrapped ``llguidance.LLMatcher``."""
        return self._matcher

    def _check(self) -> None:
        if self._matcher.is_error():
            raise MatcherError(self._matcher.get_error(), backend=BACKEND)

    def accept_token(self, token_id: int) -> bool:
        if self._terminated:
            return False
        self._check()  # an errored matcher also reports is_stopped(): raise, never accept EOS
        if self._matcher.is_stopped():
            if token_id == self._eos:
                self._terminated = self._wrapper_eos = True
                return True
            return False
        ok = self._matcher.try_consume_tokens([token_id]) > 0
        self._check()
        if ok and token_id == self._eos:
            self._terminated = True
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"rollback needs num_tokens >= 0, got {num_tokens}")
        if num_tokens == 0:
            return
        if self._terminated:
            self._terminated = False
            if self._wrapper_eos:  # llguidance never saw this stop token
                self._wrapper_eos = False
                num_tokens -= 1
        if num_tokens:
            self._matcher.rollback(num_tokens)
        self._check()

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """llguidance's mask; a stop token that is ordinary text is allowed only where the
        output may end, as on xgrammar (llguidance allows it wherever its text fits, then
        refuses it there as the end)."""
        llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, index)
        self._check()
        if self._eos_is_text and not self._matcher.is_accepting():
            word, bit = divmod(self._eos, 32)
            value = int(bitmask[index, word])
            if (value >> bit) & 1:
                bitmask[index, word] = value & ~(1 << bit)  # (stays within int32)

    def is_terminated(self) -> bool:
        return self._terminated

    def forced_bytes(self, max_bytes: int) -> bytes:
        """llguidance's forced bytes, cut to whole characters and ``max_bytes``; for a guide
        llguidance does not force bytes for (a Lark guide), the bytes its masks force, read
        on a copy of the matcher (:meth:`_masks_force`)."""
        if self._terminated or max_bytes <= 0 or self._matcher.is_stopped():
            return b""
        if self._tokens is not None:
            return whole_utf8_prefix(self._masks_force(max_bytes), max_bytes)
        forced = self._matcher.compute_ff_bytes()
        self._check()
        return whole_utf8_prefix(forced, max_bytes)

    def _masks_force(self, max_bytes: int) -> bytes:
        """The bytes every token the masks allow starts with, token after token, on a copy
        of the matcher: while no stop token is allowed, the allowed tokens' common prefix is
        forced; where it is itself an allowed token, that token is taken and the next mask
        read. At most :data:`MAX_FORCED_MASKS` masks and ``max_bytes`` (llguidance's own
        forcing can loop forever on such guides: :data:`_NO_FORCING`)."""
        assert self._tokens is not None
        tokens, copy = self._tokens, self._matcher.deep_copy()
        words = (tokens.vocab_size + 31) // 32
        mask = torch.zeros((1, words), dtype=torch.int32)
        out = bytearray()
        for _ in range(MAX_FORCED_MASKS):
            if len(out) >= max_bytes:
                break
            llguidance.torch.fill_next_token_bitmask(copy, mask, 0)
            if copy.is_error():
                break
            bits = np.unpackbits(mask.numpy().view(np.uint8), bitorder="little")
            ids = np.flatnonzero(bits[:tokens.vocab_size]).tolist()
            common, whole = self._common_prefix(ids)
            if not common:
                break
            out += common
            if whole is None or not copy.consume_token(whole):
                break
        return bytes(out)

    def _common_prefix(self, ids: list[int]) -> tuple[bytes, int | None]:
        """The bytes every token of ``ids`` starts with (nothing where the stop token or a
        special token is among them), and a token that is exactly those bytes, if any. Stops
        decoding at the first token that leaves nothing in common, so a wide mask costs a few
        decodes, not one per allowed token."""
        assert self._tokens is not None
        tokens = self._tokens
        common: bytes | None = None
        texts: dict[int, bytes] = {}
        for t in ids:
            if t == self._eos or tokens.is_special_token(t):
                return b"", None
            text = tokens.decode_bytes([t])
            texts[t] = text
            common = text if common is None else cast(bytes, os.path.commonprefix([common, text]))
            if not common:
                return b"", None
        if not common:
            return b"", None
        return common, next((t for t, text in texts.items() if text == common), None)


#: Texts whose llguidance tokenization must spell exactly their bytes (see _ll_tokenizer);
#: the last ones spell special tokens of the bundled tokenizers.
_TOKENIZE_PROBES = ("a", " a", "  a", "a b", "\n a", "a</s>", "<s>[INST]", "<|im_start|>",
                    "e\u0301\u212b")


def _tokenizes_exactly(tokenizer: Any) -> bool:
    return all(bytes(tokenizer.decode_bytes(tokenizer.tokenize_str(text))) == text.encode()
               for text in _TOKENIZE_PROBES)


#: Normalizers that change the text itself (not only how a space is written), dropped for
#: llguidance's tokenization of forced text: a dummy-prefix ``Prepend`` and the Unicode
#: normalizations (Qwen's NFC turned a forced ``"e\u0301"`` into the token ``"é"``).
_REWRITING_NORMALIZERS = ("Prepend", "NFC", "NFD", "NFKC", "NFKD", "Lowercase", "StripAccents",
                          "Strip")


def _as_llguidance_reads_it(spec: Any, specials: frozenset[int]) -> Any:
    """A tokenizer.json document (``spec``, changed in place) for llguidance's own
    tokenization of forced text: the text of every special token (``specials``) renamed so
    that no text spells it, no sentencepiece dummy prefix (Metaspace pre-tokenizers
    prepend nothing; ``Replace`` normalizers anchored at the start of the text, ``\\A▁`` ->
    ``▁▁``, are dropped) and no normalizer that rewrites the text
    (:data:`_REWRITING_NORMALIZERS`). The vocabulary, the decoder (which give each ordinary
    token its bytes) and which tokens are special are untouched."""
    renamed = {}
    for added in spec.get("added_tokens") or []:
        if isinstance(added, dict) and added.get("id") in specials:
            renamed[added["content"]] = added["content"] = \
                f"<|capgraph special {added['id']}: {added['content']}|>"
    vocab = (spec.get("model") or {}).get("vocab")
    if isinstance(vocab, dict):  # BPE, WordLevel: where a special token is a piece as well
        for old, new in renamed.items():
            if old in vocab:
                vocab[new] = vocab.pop(old)
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs
        for entry in vocab:
            if isinstance(entry, list) and entry and entry[0] in renamed:
                entry[0] = renamed[entry[0]]

    def normalizer(node: Any) -> Any:
        if not isinstance(node, dict):
            return node
        if node.get("type") == "Sequence":
            kept = [normalizer(n) for n in node.get("normalizers", [])]
            node["normalizers"] = [n for n in kept if n is not None]
            return node
        if node.get("type") in _REWRITING_NORMALIZERS:
            return None
        pattern = node.get("pattern")
        if node.get("type") == "Replace" and isinstance(pattern, dict) and \
                str(pattern.get("Regex", "")).startswith(("\\A", "^")):
            return None
        return node

    def pre_tokenizer(node: Any) -> None:
        if not isinstance(node, dict):
            return
        if node.get("type") == "Sequence":
            for n in node.get("pretokenizers", []):
                pre_tokenizer(n)
        elif node.get("type") == "Metaspace":
            node["prepend_scheme"] = "never"
            node["add_prefix_space"] = False

    spec["normalizer"] = normalizer(spec.get("normalizer"))
    pre_tokenizer(spec.get("pre_tokenizer"))
    return spec


#: U+2581 ``"▁"`` written in a guide: the character, or an escape of it (a regex's or JSON's
#: ``\u2581``, also with its backslash escaped inside a JSON string, ``\u{2581}``)
_U2581 = re.compile(r"\u2581|\\+(?:u2581|u\{0*2581\})", re.IGNORECASE)


def _places_u2581(tokenizer: Any) -> bool:
    """Whether ``tokenizer``'s encoding of forced text spells a literal ``"▁"``. A
    sentencepiece tokenizer writes a space as ``"▁"`` and reads the character itself as one:
    ``"▁"`` encodes to a token whose text is ``" "``."""
    return bytes(tokenizer.decode_bytes(tokenizer.tokenize_str("\u2581"))) == \
        "\u2581".encode()


def _ll_tokenizer(config: GuidedDecodingConfig, eos_token: int, specials: frozenset[int]
                  ) -> Any:
    """llguidance's ``LLTokenizer`` for ``config.tokenizer``.

    Where a grammar forces bytes, llguidance tokenizes them with the tokenizer's own encode
    (``tokenize_str``) and its mask allows the first token of that encoding only, trusting it
    to spell those bytes. Two ways it does not:

    - text that spells a special token is encoded as that token: a guide forcing ``"</s>"``,
      ``"[INST]"`` or ``"<|im_start|>"`` would get a mask allowing only the special id (the
      stop token ends the output before the text; ``skip_special_tokens`` drops the others,
      or the parser refuses the token it has just allowed);
    - a sentencepiece dummy prefix (``mistral-sp32k``, Llama) encodes ``" a"`` as
      ``["▁", "▁a"]``, two spaces: the mask would allow tokens the parser refuses, and
      llguidance panics at the first mask of a guide that starts with a space (regex
      ``" [a-z]+"``).

    So llguidance is given the tokenizer as :func:`_as_llguidance_reads_it` rewrites it,
    checked to spell :data:`_TOKENIZE_PROBES` exactly (``specials``: the tokenizer's special
    ids, renamed); where that build fails, the tokenizer as it is."""
    import copy

    n_vocab = config.vocab_size_padded
    try:
        backend = copy.copy(config.tokenizer.backend_tokenizer)  # type: ignore[union-attr]
        backend.no_padding()
        backend.no_truncation()
        spec = _as_llguidance_reads_it(json.loads(backend.to_str()), specials)
        tokenizer = llguidance.LLTokenizer(json.dumps(spec), n_vocab=n_vocab,
                                           eos_token=eos_token)
        placed = [i for i in specials if i < n_vocab]
        if _tokenizes_exactly(tokenizer) and all(  # (each special kept its id)
                tokenizer.is_special_token(i)
                and b"<|capgraph special " in bytes(tokenizer.decode_bytes([i]))
                for i in placed):
            return tokenizer
        why = "its forced-text tokenization still does not spell the probe texts"
    except Exception as e:  # noqa: BLE001 - not a fast tokenizer, or a document llguidance refuses
        why = f"{type(e).__name__}: {e}"
    import warnings
    warnings.warn(f"llguidance: the tokenizer could not be prepared for forced text ({why}); "
                  "using it as it is, where a guide forcing text that spells a special token "
                  "or starting with a space may be masked wrongly (prefer xgrammar)",
                  RuntimeWarning, stacklevel=3)
    return llguidance.hf.from_tokenizer(  # a fast tokenizer; its error if not
        config.tokenizer, n_vocab=n_vocab, eos_token=eos_token)  # type: ignore[arg-type]


class LLGuidanceMatcherFactory(GrammarMatcherFactory):
    """Builds an ``LLTokenizer`` from the HF tokenizer once; grammars are validated at compile."""

    backend_name = BACKEND

    def __init__(self, config: GuidedDecodingConfig) -> None:
        if llguidance is None:
            raise ConfigError("the llguidance backend needs the 'llguidance' extra: "
                              "pip install 'capgraph[llguidance]'")
        super().__init__(config)
        if config.tokenizer is None:
            raise ConfigError("the llguidance backend needs a tokenizer, not only an "
                              "encoded_vocab")
        if not config.stop_token_ids or len(config.stop_token_ids) != 1:
            raise ConfigError("the llguidance backend takes exactly one stop token, got "
                              f"{config.stop_token_ids}")
        self.eos_token = config.stop_token_ids[0]
        from ..tokenizers import special_token_ids
        specials = special_token_ids(config.tokenizer)  # type: ignore[arg-type]
        self.tokenizer = _ll_tokenizer(config, self.eos_token, specials)
        self._json_options = json_whitespace_options(config)
        self._mask_words = (config.vocab_size_padded + 31) // 32
        self._eos_is_text = not self.tokenizer.is_special_token(self.eos_token)
        self._places_u2581 = _places_u2581(self.tokenizer)
        # ids that are never grammar text: special tokens, the stop token, padding ids
        self._not_text = sorted(specials | {self.eos_token}
                                | set(range(len(config.tokenizer), config.vocab_size_padded)))

    def _likely_allowed_ids(self) -> Sequence[int]:
        t = self.tokenizer
        single_byte = [i for i in range(t.vocab_size)
                       if not t.is_special_token(i) and len(t.decode_bytes([i])) == 1]
        return [self.eos_token, *single_byte]

    def _grammar_text(self, params: GuidedDecodingParams) -> str:
        gt, guide = params.guide_type, params.guide
        if not self._places_u2581 and _U2581.search(guide):
            # llguidance encodes text the grammar forces with the tokenizer, trusting it to
            # spell it: its mask would allow the space token where "▁" is forced, and the
            # parser refuse that token, failing the request there
            raise UnsupportedGuideError(
                "the guide writes '\u2581' (U+2581), which this tokenizer's encoding reads as a "
                "space: llguidance cannot place it; use the xgrammar backend",
                guide_type=gt.name, backend=BACKEND)
        if gt is GuideType.JSON_SCHEMA and self.config.json_unenforced_keywords != "ignore":
            self._refuse_unenforced(guide)
        if gt is GuideType.EBNF_GRAMMAR:
            guide = self._prepared_lark(guide)
        try:
            if gt is GuideType.JSON:
                return llguidance.LLMatcher.grammar_from_json_schema(  # as on xgrammar
                    JSON_CONTAINER_SCHEMA, overrides=self._json_options)
            if gt is GuideType.JSON_SCHEMA:
                return llguidance.LLMatcher.grammar_from_json_schema(  # as xgrammar reads it
                    llguidance_schema(guide), overrides=self._json_options)
            if gt is GuideType.REGEX:
                # ECMA-262's classes, '.' and escapes, as on xgrammar; Rust-only syntax refused
                return llguidance.LLMatcher.grammar_from_regex(ecma_regex(guide, BACKEND))
            if gt is GuideType.EBNF_GRAMMAR:
                # llguidance reads Lark, not GBNF: the same guide type means a different syntax
                return llguidance.LLMatcher.grammar_from_lark(guide)
        except UnsupportedGuideError:
            raise  # (a regex, or a schema pattern, :func:`ecma_regex` refused)
        except Exception as e:
            raise GrammarCompileError(f"{type(e).__name__}: {e}", guide_type=gt.name,
                                      backend=BACKEND) from e
        raise UnsupportedGuideError(f"guide type {gt.name} is not supported by llguidance "
                                    "(use the xgrammar backend)", guide_type=gt.name,
                                    backend=BACKEND)

    def _compile(self, params: GuidedDecodingParams) -> tuple[Any, int]:
        """The guide's grammar built into an ``LLMatcher`` (llguidance parses the grammar and
        builds its parser and lexer there) with its first mask computed once, so the lexer
        states the start needs are built too: :meth:`create_from_compiled` hands each request
        a copy of it, which fills its first mask at once."""
        grammar = self._grammar_text(params)
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0,
                                        limits=_parser_limits())
        if template.is_error():
            detail = template.get_error() or "invalid grammar"
            if params.guide_type is GuideType.EBNF_GRAMMAR and "::=" in params.guide:
                detail += (" (this looks like GBNF; the llguidance backend takes Lark, the "
                           "xgrammar backend takes GBNF/EBNF)")
            raise GrammarCompileError(detail, guide_type=params.guide_type.name,
                                      backend=BACKEND)
        warnings = template.get_grammar_warnings()
        if (warnings and params.guide_type in (GuideType.JSON_SCHEMA, GuideType.EBNF_GRAMMAR)
                and self.config.json_unenforced_keywords != "ignore"):
            # a warning is llguidance saying it approximates (oneOf as anyOf, ignored keys);
            # llguidance warns only about JSON schemas, a Lark grammar's from its %json values
            reported = "; ".join(f"llguidance reported: {m}" for m in warnings)
            if params.guide_type is GuideType.JSON_SCHEMA:
                _refuse(reported)
            _refuse_lark(f"a %json schema of this grammar: {reported}")
        scratch = torch.zeros((1, self._mask_words), dtype=torch.int32)
        llguidance.torch.fill_next_token_bitmask(template, scratch, 0)
        if template.is_error():
            raise GrammarCompileError(f"the grammar has no valid start: {template.get_error()}",
                                      guide_type=params.guide_type.name, backend=BACKEND)
        forcing = params.guide_type is not GuideType.EBNF_GRAMMAR
        return (LLGuidanceGuide(grammar, template, forcing),
                _TEMPLATE_BYTES + len(grammar.encode()))

    def _prepared_lark(self, grammar: str) -> str:
        """The Lark grammar ``grammar`` as llguidance must be given it to mean what capgraph
        documents.

        - A token reference that may place a special token (``<name>``, ``<[id]>``, a range,
          ``<[^...]>``, ``<[*]>``; :mod:`capgraph.grammar.lark_text`) is refused: special
          tokens, the stop token and padding ids are never grammar text.
        - ``%llguidance`` options are checked (:meth:`_check_options`): ``allow_invalid_utf8``
          and option names llguidance does not know are refused.
        - Each ``%json`` schema is judged by the keyword policy
          (:func:`~capgraph.grammar.schema_policy.unenforced`, its ``x-guidance`` options
          included) as a JSON-schema guide is, outside ``json_unenforced_keywords="ignore"``,
          and given as :func:`~capgraph.grammar.semantics.llguidance_schema` writes it, with
          ``json_whitespace`` (as ``x-guidance`` options, which win over its own).
        - ``%llguidance {"no_forcing": true}`` is appended (:data:`_NO_FORCING`).
        """
        return self._checked_lark(grammar) + _NO_FORCING

    def _checked_lark(self, grammar: str) -> str:
        """:meth:`_prepared_lark` but for the appended options."""
        try:
            refs = lark_token_refs(grammar)
            values = lark_json_values(grammar)
            directives = lark_options(grammar)
        except LarkTextError as e:
            raise GrammarCompileError(str(e), guide_type="EBNF_GRAMMAR",
                                      backend=BACKEND) from None
        for found in directives:
            self._check_options(found)
        _refuse_empty_lazy(grammar)
        for ref in refs:
            placed = self._placed_special(ref)
            if placed is not None:
                raise UnsupportedGuideError(
                    f"the token reference {ref.text} at line {ref.line} of the grammar may "
                    f"place the special token {placed}; special tokens (and the stop token) "
                    "are never grammar text: only the stop token ends an output, and only an "
                    "xgrammar structural tag may place a special token",
                    guide_type="EBNF_GRAMMAR", backend=BACKEND)
        if not values:
            return grammar
        refuse = self.config.json_unenforced_keywords != "ignore"
        new = []
        for found in values:
            if refuse:
                unenforced = unenforced_in_text(json.dumps(found.value), BACKEND)
                if unenforced:
                    _refuse_lark(f"the %json schema at line {found.line}: "
                                 + describe(unenforced))
            schema = json.loads(llguidance_schema(json.dumps(found.value)))
            if isinstance(schema, dict):
                options = schema.get("x-guidance")
                schema["x-guidance"] = {**(options if isinstance(options, dict) else {}),
                                        **self._json_options}
            new.append(json.dumps(schema))
        return replace_json_values(grammar, values, new)

    @staticmethod
    def _check_options(found: LarkJson) -> None:
        """Refuse the ``%llguidance`` options ``found`` where they would break what capgraph
        promises: ``allow_invalid_utf8`` (llguidance's lexer then matches bytes, not characters,
        so ``/.+/`` lets every special token and invalid UTF-8 into the output), and any name
        llguidance does not know (it ignores such a name: a misspelt option would be dropped
        without a word). ``no_forcing`` and ``allow_initial_skip`` are taken."""
        where = f"the %llguidance options at line {found.line} of the grammar"
        if not isinstance(found.value, dict):
            raise GrammarCompileError(f"{where} are not a JSON object: {found.value!r}",
                                      guide_type="EBNF_GRAMMAR", backend=BACKEND)
        unknown = sorted(set(found.value) - set(LLGUIDANCE_OPTIONS))
        if unknown:
            raise UnsupportedGuideError(
                f"{where} name {', '.join(map(repr, unknown))}, which llguidance does not "
                f"know and would ignore; its options are {', '.join(LLGUIDANCE_OPTIONS)}",
                guide_type="EBNF_GRAMMAR", backend=BACKEND)
        if found.value.get("allow_invalid_utf8"):
            raise UnsupportedGuideError(
                f"{where} set allow_invalid_utf8: llguidance then matches bytes instead of "
                "characters, which lets special tokens and invalid UTF-8 into the output; "
                "capgraph's outputs are text", guide_type="EBNF_GRAMMAR", backend=BACKEND)

    def _placed_special(self, ref: LarkTokenRef) -> str | None:
        """The special (or stop, or padding) token the token reference ``ref`` may place,
        named with its id, or None. llguidance resolves ``<name>`` among special tokens only."""
        if ref.ranges is None:
            return repr(ref.text[1:-1])
        not_text = self._not_text
        if ref.everything:
            found = not_text
        else:
            inside = [i for i in not_text if any(lo <= i <= hi for lo, hi in ref.ranges)]
            found = sorted(set(not_text) - set(inside)) if ref.negated else inside
        if not found:
            return None
        name = self.config.tokenizer.convert_ids_to_tokens(found[0])  # type: ignore[union-attr]
        return f"{name!r} (id {found[0]})"

    @staticmethod
    def _refuse_unenforced(guide: str) -> None:
        """Raise UnsupportedGuideError for the keywords of ``guide`` that llguidance is not
        known to enforce (:mod:`capgraph.grammar.schema_policy`)."""
        found = unenforced_in_text(guide, BACKEND)
        if found:
            _refuse(describe(found))

    def create_from_compiled(self, compiled: CompiledGuide) -> LLGuidanceMatcher:
        guide: LLGuidanceGuide = compiled.payload
        return LLGuidanceMatcher(guide.template.deep_copy(), self.eos_token, self._eos_is_text,
                                 None if guide.forcing else self.tokenizer)

    def batch_fill(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                   indices: Sequence[int]) -> None:
        # llguidance's compute releases the GIL per call; rows are filled in order
        for matcher, index in zip(matchers, indices):
            matcher.fill_next_token_bitmask(bitmask, index)
