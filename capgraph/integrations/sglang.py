"""capgraph as an SGLang grammar backend: ``--grammar-backend capgraph``.

:class:`CapgraphGrammarBackend` is a ``BaseGrammarBackend`` whose dispatchers (JSON, JSON
schema, regex, EBNF, structural tag) compile through capgraph's
:func:`~capgraph.grammar.create_matcher_factory`, so capgraph's keyword policy (a schema
constraint the backend would not enforce is refused, or served by llguidance), special-token
masking, guide limits, compile timeout and isolation, and memory and disk caches apply to
SGLang's requests. :class:`CapgraphGrammar` is the per-request ``BaseGrammarObject``: accept,
rollback, termination, copy, the vocab mask (allocation, single and batched fill, reset, move,
apply with :func:`capgraph.ops.logits_bitmask`) and jump-forward, as SGLang's xgrammar backend
does them. A guide that does not compile comes back as SGLang's ``InvalidGrammarObject``
carrying capgraph's named error, which SGLang turns into an aborted request.

SGLang loads the package's ``sglang.srt.plugins`` entry point (``capgraph``, declared in
pyproject.toml) in every process at start; :func:`register` then adds ``capgraph`` to
``--grammar-backend``'s choices and to SGLang's grammar-backend registry. ``SGLANG_PLUGINS``,
where set, must name ``capgraph``. The backend is configured by SGLang's own JSON whitespace
flags and, for capgraph's other :class:`~capgraph.params.GuidedDecodingConfig` fields, by the
environment variable ``CAPGRAPH_SGLANG_CONFIG`` (a JSON object of field values, for example
``{"backend": "auto", "compile_isolation": "process"}``).

This module imports SGLang; ``import capgraph`` never imports it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
from sglang.srt.constrained.base_grammar_backend import (BaseGrammarBackend,
                                                         BaseGrammarObject, GrammarRow,
                                                         GrammarStats, InvalidGrammarObject)

from ..errors import CapgraphError, ConfigError, RequestError
from ..grammar import CompiledGuide, GrammarMatcher, GrammarMatcherFactory, create_matcher_factory
from ..ops import logits_bitmask
from ..params import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from .sglang_masks import DEFAULT_RING_DEPTH, MaskRing

__all__ = ["BACKEND_NAME", "CONFIG_ENV", "CapgraphGrammar", "CapgraphGrammarBackend",
           "config_from_server_args", "create_backend", "register"]

_log = logging.getLogger(__name__)

#: The name ``--grammar-backend`` selects.
BACKEND_NAME = "capgraph"
#: Environment variable with further :class:`GuidedDecodingConfig` fields, as a JSON object.
CONFIG_ENV = "CAPGRAPH_SGLANG_CONFIG"
# fields SGLang's own arguments set; CAPGRAPH_SGLANG_CONFIG may not name them
_SET_BY_SGLANG = ("tokenizer", "encoded_vocab", "stop_token_ids", "vocab_size_padded",
                  "tokenizer_vocab_size")
_ANY_JSON = "$$ANY$$"  # SGLang's key for "any JSON value"


class CapgraphGrammar(BaseGrammarObject):
    """One request's grammar state: a capgraph matcher over a compiled guide.

    Args:
        backend: the backend that compiled ``compiled`` (its factory and mask ring serve it).
        compiled: the compiled guide; :meth:`copy` makes fresh matchers from it.
        key_string: SGLang's guide text (for messages).
        grammar_stats: SGLang's statistics record of this grammar.
    """

    def __init__(self, backend: "CapgraphGrammarBackend", compiled: CompiledGuide,
                 key_string: str, grammar_stats: Optional[GrammarStats] = None) -> None:
        super().__init__()
        self.backend = backend
        self.compiled = compiled
        self.key_string = key_string
        self.grammar_stats = grammar_stats
        self.matcher: GrammarMatcher = backend.factory.create_from_compiled(compiled)
        # the xgrammar FFI object the C++ fill runs (None: the matcher's own methods must run)
        self._handle = _native_handle(self.matcher)
        self.num_accepted = 0
        self._dead_end_logged = False

    # -- token state ---------------------------------------------------------------------------
    def accept_token(self, token: int) -> None:
        """Advance by ``token`` (ignored once terminated, as SGLang's xgrammar backend does).

        Raises:
            RequestError: (a ``ValueError``, which SGLang turns into an aborted request) the
                grammar rejects the token.
        """
        if self.matcher.is_terminated():
            return
        self.current_token = token
        if not self.matcher.accept_token(token):
            raise RequestError(f"capgraph: the {self.compiled.params.guide_type.name} grammar "
                               f"rejects token {token} after {self.num_accepted} accepted "
                               f"tokens (guide {_clip(self.key_string)!r})")
        self.num_accepted += 1

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens (a stop token counts as one)."""
        self.matcher.rollback(k)
        self.num_accepted = max(0, self.num_accepted - k)

    def is_terminated(self) -> bool:
        """True once the matcher has reached a stop (SGLang's question)."""
        return self.matcher.is_terminated()

    def copy(self) -> "CapgraphGrammar":
        """A grammar at the start of the same compiled guide (what SGLang caches and hands out)."""
        stats = self.grammar_stats
        if stats is not None:
            stats = dataclasses.replace(stats, is_cache_hit=True, tree_traversal_time=[])
        return CapgraphGrammar(self.backend, self.compiled, self.key_string, stats)

    # -- vocab masks ---------------------------------------------------------------------------
    def allocate_vocab_mask(self, vocab_size: int, batch_size: int, device: Any
                            ) -> torch.Tensor:
        """A host mask ``[batch_size, ceil(V/32)]`` int32 from the backend's ring, every row
        unconstrained (``device`` is where it will be moved to; it is allocated on the host)."""
        ring = self.backend.masks
        if vocab_size != ring.vocab_size:
            raise ValueError(f"allocate_vocab_mask: vocab_size {vocab_size} differs from the "
                             f"{ring.vocab_size} the capgraph backend was built for")
        return ring.allocate(batch_size)

    def fill_vocab_mask(self, vocab_mask: torch.Tensor, idx: int) -> None:
        """Write the tokens allowed next into row ``idx`` (1 = allowed)."""
        self.matcher.fill_next_token_bitmask(vocab_mask, idx)

    def fill_vocab_mask_batched(self, entries: List[GrammarRow],  # type: ignore[override]
                                vocab_mask: torch.Tensor) -> None:
        """Fill the listed rows in one call (capgraph's C++ host build on a ring mask), leaving
        the other rows untouched. Grammars of another backend fill through their own method.

        A row that allows no token at all (a dead end) would mask a whole logits row to -inf;
        it allows the stop tokens instead, so that request ends, and an error is logged.
        """
        ours: list[CapgraphGrammar] = []
        rows: list[int] = []
        handles: list | None = []
        backend = self.backend
        for row, grammar in entries:
            if type(grammar) is CapgraphGrammar and grammar.backend is backend:
                ours.append(grammar)
                rows.append(row)
                handle = grammar._handle
                if handle is None:
                    handles = None
                elif handles is not None:
                    handles.append(handle)
            else:
                grammar.fill_vocab_mask(vocab_mask, row)
        if not ours:
            return
        dead = backend.masks.fill([g.matcher for g in ours], handles, rows, vocab_mask)
        for k in dead:
            ours[k]._on_dead_end(vocab_mask, rows[k])

    def _on_dead_end(self, vocab_mask: torch.Tensor, row: int) -> None:
        stops = self.backend.factory.config.stop_token_ids or []
        if not self._dead_end_logged:
            self._dead_end_logged = True
            _log.error("capgraph: the %s grammar allows no token after %d accepted tokens "
                       "(guide %r); its row allows only the stop tokens %s",
                       self.compiled.params.guide_type.name, self.num_accepted,
                       _clip(self.key_string), stops)
        words = [0] * vocab_mask.shape[1]
        for t in stops:
            words[t // 32] |= 1 << (t % 32)
        # (as signed int32 words: bit 31 set is a negative value)
        vocab_mask[row] = torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words],
                                       dtype=vocab_mask.dtype)

    @staticmethod
    def reset_vocab_mask(vocab_mask: torch.Tensor) -> None:
        """Every row back to unconstrained (every bit set)."""
        vocab_mask.fill_(-1)

    def move_vocab_mask(self, vocab_mask: torch.Tensor, device: Any  # type: ignore[override]
                        ) -> torch.Tensor:
        """The mask on ``device`` (a ``non_blocking`` copy from pinned memory on CUDA)."""
        moved = vocab_mask.to(device, non_blocking=True)
        if moved.device.type == "cuda" and moved is not vocab_mask:
            self.backend.masks.copied(vocab_mask, moved.device)
        return moved

    @staticmethod
    def apply_vocab_mask(logits: torch.Tensor, vocab_mask: torch.Tensor) -> None:
        """Set the logits of disallowed tokens to -inf in place
        (:func:`capgraph.ops.logits_bitmask`: graph-safe on CUDA, any device torch runs on)."""
        logits_bitmask(logits, vocab_mask)

    # -- jump-forward --------------------------------------------------------------------------
    def try_jump_forward(self, tokenizer: Any) -> Optional[Tuple[List[int], str]]:
        """The text the grammar forces next, as ``([], text)``, or None (none, or a backend
        that cannot say: only xgrammar matchers can)."""
        native = getattr(self.matcher, "native", None)
        find = getattr(native, "find_jump_forward_string", None)
        if find is None:
            return None
        text = find()
        return ([], text) if text else None

    def jump_forward_str_state(self, helper: Tuple[List[int], str]) -> Tuple[str, int]:
        return helper[1], -1

    def jump_and_retokenize(self, old_output_ids: List[int], new_output_ids: List[int],
                            next_state: int) -> None:
        """Roll back to the longest common prefix of the two tokenizations, then accept the
        rest of ``new_output_ids``."""
        common = 0
        for old, new in zip(old_output_ids, new_output_ids):
            if old != new:
                break
            common += 1
        if common < len(old_output_ids):
            self.rollback(len(old_output_ids) - common)
        for token in new_output_ids[common:]:
            self.accept_token(token)

    def __repr__(self) -> str:
        return (f"CapgraphGrammar({self.compiled.params.guide_type.name}, "
                f"backend={self.compiled.backend!r}, accepted={self.num_accepted}, "
                f"key={_clip(self.key_string)!r})")


class CapgraphGrammarBackend(BaseGrammarBackend):
    """SGLang's grammar backend over a capgraph matcher factory.

    Args:
        tokenizer: the Hugging Face tokenizer SGLang serves with.
        vocab_size: width of the model's logits rows (>= the tokenizer's vocabulary).
        eos_token_ids: the model's stop tokens (None: the tokenizer's EOS).
        config: further :class:`GuidedDecodingConfig` fields (backend, compile isolation,
            json_unenforced_keywords, ...); those SGLang sets may not appear here.
        mask_ring_depth: host mask buffers cycled through (:mod:`.sglang_masks`).

    Raises:
        ConfigError: a config field is invalid (it names the field and the value).
    """

    def __init__(self, tokenizer: Any, vocab_size: int,
                 eos_token_ids: Optional[Iterable[int]] = None, *,
                 config: Optional[dict[str, Any]] = None,
                 mask_ring_depth: int = DEFAULT_RING_DEPTH) -> None:
        super().__init__()
        fields = dict(config or {})
        for name in _SET_BY_SGLANG:
            if name in fields:
                raise ConfigError(f"capgraph SGLang backend: {name!r} is set from SGLang's own "
                                  f"arguments, not from the backend config")
        stops = sorted({int(t) for t in eos_token_ids}) if eos_token_ids else None
        self.config = GuidedDecodingConfig(tokenizer=tokenizer, vocab_size_padded=vocab_size,
                                           stop_token_ids=stops, **fields)
        self.factory: GrammarMatcherFactory = create_matcher_factory(self.config)
        self.vocab_size = vocab_size
        self.masks = MaskRing(self.factory, vocab_size, mask_ring_depth)

    # -- dispatchers (run on SGLang's compile executor) ----------------------------------------
    def dispatch_json(self, key_string: str) -> BaseGrammarObject:
        if key_string == _ANY_JSON:
            return self._compile("json", GuideType.JSON, "", key_string)
        return self._compile("json", GuideType.JSON_SCHEMA, key_string, key_string)

    def dispatch_regex(self, key_string: str) -> BaseGrammarObject:
        return self._compile("regex", GuideType.REGEX, key_string, key_string)

    def dispatch_ebnf(self, key_string: str) -> BaseGrammarObject:
        return self._compile("ebnf", GuideType.EBNF_GRAMMAR, key_string, key_string)

    def dispatch_structural_tag(self, key_string: str) -> BaseGrammarObject:
        return self._compile("structural_tag", GuideType.STRUCTURAL_TAG,
                             _current_tag_format(key_string), key_string)

    def _compile(self, dispatch_type: str, guide_type: GuideType, guide: str,
                 key_string: str) -> BaseGrammarObject:
        """Compile through the factory (its caches, pool and timeout); a failure becomes
        SGLang's ``InvalidGrammarObject`` carrying capgraph's error."""
        try:
            params = GuidedDecodingParams(guide_type, guide)
            compiled = self.factory.compile_async(params).result(
                self.config.compile_timeout_s, backend=self.factory.backend_name)
        except CapgraphError as e:
            _log.error("capgraph: invalid %s guide %r: %s", dispatch_type, _clip(key_string), e)
            return InvalidGrammarObject(f"{type(e).__name__}: {e}")
        return CapgraphGrammar(self, compiled, key_string,
                               GrammarStats(dispatch_type=dispatch_type))

    def reset(self) -> None:
        """Forget SGLang's cached grammar objects (capgraph's byte-bounded caches stay)."""
        super().reset()

    def close(self) -> None:
        """Stop the factory's queued compiles and worker processes."""
        self.factory.close()


def _current_tag_format(key_string: str) -> str:
    """A structural tag in the format capgraph compiles: SGLang's legacy form
    (``{"structures": [...], "triggers": [...]}``) converted the way SGLang's xgrammar
    backend converts it; anything else unchanged (capgraph's compile reports what is wrong)."""
    try:
        tag = json.loads(key_string)
    except ValueError:
        return key_string
    if not (isinstance(tag, dict) and "structures" in tag and "triggers" in tag):
        return key_string
    import xgrammar as xgr
    from xgrammar.structural_tag import TriggeredTagsFormat

    try:
        items = [xgr.StructuralTagItem(begin=s["begin"],
                                       schema=json.dumps(s.get("schema") or {}),
                                       end=s["end"]) for s in tag["structures"]]
        converted = xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
    except (KeyError, TypeError, ValueError):
        return key_string
    if isinstance(converted.format, TriggeredTagsFormat):
        converted.format.at_least_one = bool(tag.get("at_least_one", False))
    return str(converted.model_dump_json())


def _native_handle(matcher: GrammarMatcher) -> Any:
    """The xgrammar FFI object of a plain ``XGrammarMatcher`` (what the C++ fill runs), else
    None (an llguidance, hand-over or wrapped matcher: its own methods must run)."""
    from ..grammar.xgrammar_backend import XGrammarMatcher

    return matcher._handle if type(matcher) is XGrammarMatcher else None


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def config_from_server_args(server_args: Any) -> dict[str, Any]:
    """The :class:`GuidedDecodingConfig` fields of SGLang's JSON whitespace flags and of
    ``$CAPGRAPH_SGLANG_CONFIG`` (a JSON object; its fields win).

    Raises:
        ConfigError: the variable is not a JSON object, or SGLang asks for a whitespace
            pattern (a regex), which capgraph cannot enforce.
    """
    fields: dict[str, Any] = {}
    if getattr(server_args, "constrained_json_whitespace_pattern", None):
        raise ConfigError("capgraph SGLang backend: --constrained-json-whitespace-pattern is "
                          "not supported; use --constrained-json-disable-any-whitespace or "
                          "--constrained-json-max-whitespace-cnt")
    if getattr(server_args, "constrained_json_disable_any_whitespace", False):
        fields["json_whitespace"] = "compact"
    elif getattr(server_args, "constrained_json_max_whitespace_cnt", None) is not None:
        fields["json_whitespace"] = "bounded"
        fields["json_max_whitespace"] = server_args.constrained_json_max_whitespace_cnt
    text = os.environ.get(CONFIG_ENV, "").strip()
    if text:
        try:
            extra = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"{CONFIG_ENV} is not JSON: {e}") from None
        if not isinstance(extra, dict):
            raise ConfigError(f"{CONFIG_ENV} must be a JSON object of GuidedDecodingConfig "
                              f"fields, got {type(extra).__name__}")
        fields.update(extra)
    return fields


def create_backend(server_args: Any, tokenizer: Any, vocab_size: int,
                   eos_token_ids: Optional[Sequence[int]] = None) -> CapgraphGrammarBackend:
    """SGLang's grammar-backend init function (``register_grammar_backend``'s signature)."""
    return CapgraphGrammarBackend(tokenizer, vocab_size, eos_token_ids,
                                  config=config_from_server_args(server_args))


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: add ``capgraph`` to ``--grammar-backend``'s
    choices and to SGLang's grammar-backend registry (idempotent)."""
    from sglang.srt.arg_groups.choices import GRAMMAR_BACKEND_CHOICES, add_grammar_backend_choices
    from sglang.srt.constrained.base_grammar_backend import register_grammar_backend

    if BACKEND_NAME not in GRAMMAR_BACKEND_CHOICES:
        add_grammar_backend_choices([BACKEND_NAME])
    register_grammar_backend(BACKEND_NAME, create_backend)
