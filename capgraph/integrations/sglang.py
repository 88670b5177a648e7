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
import sys
import threading
from typing import Any, Iterable, List, Optional, Sequence, Tuple

import torch
from sglang.srt.constrained.base_grammar_backend import (BaseGrammarBackend,
                                                         BaseGrammarObject, GrammarRow,
                                                         GrammarStats, InvalidGrammarObject)

from ..errors import (TRANSIENT_COMPILE_ERRORS, CapgraphError, ConfigError, LayoutError,
                      MatcherError, RequestError)
from ..grammar import (CompiledGuide, CompileHandle, GrammarMatcher, GrammarMatcherFactory,
                       create_matcher_factory)
from ..grammar.cache import ByteLRUCache
from ..grammar.forced import MAX_FORCED_TEXT_BYTES
from ..ops import logits_bitmask
from ..params import GuidedDecodingBackend, GuidedDecodingConfig, GuidedDecodingParams, GuideType
from ..requests import as_int
from .sglang_masks import DEFAULT_RING_DEPTH, MaskRing

__all__ = ["BACKEND_NAME", "CONFIG_ENV", "CapgraphGrammar", "CapgraphGrammarBackend",
           "CapgraphInvalidGrammar",
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
# failures that say nothing about the guide: SGLang must not cache them
_TRANSIENT = TRANSIENT_COMPILE_ERRORS
# bytes of guide text SGLang's grammar cache keeps (keys and parameters, no compiled grammars)
_KEY_CACHE_BYTES = 64 << 20
# SGLang's speculative package, whose draft-tree walk (``traverse_tree``) accepts and rolls
# back each draft of a verify tree outside any try block: a call from there is that walk
_TREE_WALK_PACKAGE = "sglang.srt.speculative"


def _called_from_tree_walk(depth: int = 2) -> bool:
    """Whether the caller ``depth`` frames up (of the CapgraphGrammar method calling this) is a
    function of SGLang's speculative package: its draft-tree walk, where an exception is not
    one request's abort but the scheduler's crash. Asked only where a method would raise."""
    name = sys._getframe(depth).f_globals.get("__name__", "")
    return name == _TREE_WALK_PACKAGE or name.startswith(_TREE_WALK_PACKAGE + ".")


class CapgraphInvalidGrammar(InvalidGrammarObject):
    """SGLang's ``InvalidGrammarObject`` for a guide capgraph could not compile.

    ``transient``: the failure says nothing about the guide (the compile timed out, the compile
    queue was full, a compile worker ran out of memory or died), so the backend does not let
    SGLang cache it: the next request with the same guide compiles again. A permanent failure
    (a malformed or unsupported guide) is cached, as SGLang caches its own backends' failures.
    """

    def __init__(self, error_message: str, transient: bool) -> None:
        super().__init__(error_message)
        self.transient = transient


class CapgraphGrammar(BaseGrammarObject):
    """One request's grammar state: a capgraph matcher over a compiled guide.

    Args:
        backend: the backend that compiled ``compiled`` (its mask ring serves it).
        compiled: the compiled guide; :meth:`copy` makes fresh matchers from it.
        key_string: SGLang's guide text (for messages).
        grammar_stats: SGLang's statistics record of this grammar.
        factory: the factory that compiled ``compiled`` (default: the backend's).
    """

    def __init__(self, backend: "CapgraphGrammarBackend", compiled: CompiledGuide,
                 key_string: str, grammar_stats: Optional[GrammarStats] = None,
                 factory: Optional[GrammarMatcherFactory] = None) -> None:
        super().__init__()
        self.backend = backend
        self.compiled = compiled
        self.key_string = key_string
        self.grammar_stats = grammar_stats
        self.factory = factory if factory is not None else backend.factory
        self.matcher: GrammarMatcher = self.factory.create_from_compiled(compiled)
        # the xgrammar FFI object the C++ fill runs (None: the matcher's own methods must run)
        self._handle = _native_handle(self.matcher)
        self.num_accepted = 0
        self._dead_end_logged = False
        # a failure of this request's matcher in a mask fill, raised at its next accept_token
        self._error: Optional[RequestError] = None
        # drafts SGLang's tree walk accepted where they could not be (a refused token, or any
        # token after a failure): counted, not fed to the matcher, undone by the walk's
        # rollback; the branch ends there (is_terminated), and the request fails on its own
        # path, at the accept_token that verification brings it to
        self._walk_dead = 0

    # -- token state ---------------------------------------------------------------------------
    def accept_token(self, token: int) -> None:
        """Advance by ``token`` (ignored once terminated, as SGLang's xgrammar backend does).

        A model EOS id that capgraph's matcher does not take as its stop token (a model with
        several EOS ids on a backend that takes one) ends the grammar where its stop token
        would.

        Inside SGLang's draft-tree walk (its speculative package's ``traverse_tree``, which
        runs outside any try block) nothing raises: a draft that would is counted as accepted
        without reaching the matcher, the branch ends there (:meth:`is_terminated`) and the
        walk's ``rollback`` undoes it. So the stop token under a dead end's stop-token row ends
        that branch, and the request fails (aborted by SGLang) only where verification brings
        it there; a matcher that raises, or a fill that failed, keeps its error, every later
        draft of the walk ends its branch, and the request fails at its next accept_token on
        whichever branch.

        Raises:
            RequestError: (a ``ValueError``, which SGLang turns into an aborted request) the
                grammar rejects the token, the matcher failed (llguidance's error state, for
                example), or an earlier mask fill of this request failed.
        """
        if self._error is not None or self._walk_dead:
            if self._walk_dead or _called_from_tree_walk():
                self._walk_dead += 1
                self.num_accepted += 1
                return
            raise self._error  # type: ignore[misc]
        if self.matcher.is_terminated():
            return
        self.current_token = token
        try:
            stop = self.backend.stop_token_id
            if token in self.backend.extra_stop_ids and stop is not None:
                ok = self.matcher.accept_token(stop) or self.matcher.accept_token(token)
            else:
                ok = self.matcher.accept_token(token)
        except Exception as e:
            walking = _called_from_tree_walk()
            if isinstance(e, ValueError) and not walking:
                raise
            failure = e if isinstance(e, RequestError) else RequestError(
                f"capgraph: the {self.compiled.params.guide_type.name} grammar failed on "
                f"token {token} after {self.num_accepted} accepted tokens: "
                f"{type(e).__name__}: {e} (guide {_clip(self.key_string)!r})")
            if not walking:
                raise failure from e
            if failure is not e:
                failure.__cause__ = e
            self._error = failure  # (the request fails at its next accept_token)
        else:
            if ok:
                self.num_accepted += 1
                return
            if not _called_from_tree_walk():
                raise RequestError(f"capgraph: the {self.compiled.params.guide_type.name} "
                                   f"grammar rejects token {token} after {self.num_accepted} "
                                   f"accepted tokens (guide {_clip(self.key_string)!r})")
        self._walk_dead += 1  # (the walk: this branch ends here)
        self.num_accepted += 1

    def rollback(self, k: int) -> None:
        """Undo the last ``k`` accepted tokens (a stop token counts as one; nothing once a
        mask fill has failed: the request ends at its next token).

        Raises:
            RequestError: ``k`` is not an integer in ``[0, num_accepted]`` (nothing undone).
        """
        count = as_int(k)
        if self._walk_dead and count is not None and count > 0:  # (the walk's own first)
            undone = min(count, self._walk_dead)
            self._walk_dead -= undone
            self.num_accepted -= undone
            count -= undone
            if count == 0:
                return
        if self._error is not None:
            return
        if count is None or not 0 <= count <= self.num_accepted:
            raise RequestError(f"capgraph: rollback({k!r}) of the "
                               f"{self.compiled.params.guide_type.name} grammar: expected an "
                               f"integer in [0, {self.num_accepted}] (its accepted tokens)")
        try:
            self.matcher.rollback(count)
        except MatcherError as e:  # (deeper than the UTF-8 guard's history: nothing undone)
            raise RequestError(f"capgraph: rollback({count}) of the "
                               f"{self.compiled.params.guide_type.name} grammar: {e}") from e
        self.num_accepted -= count

    def is_terminated(self) -> bool:
        """True once the matcher has reached a stop (SGLang's question), and in SGLang's
        draft-tree walk after a draft that could not be accepted (see :meth:`accept_token`)."""
        return self._walk_dead > 0 or self.matcher.is_terminated()

    def copy(self) -> "CapgraphGrammar":
        """A grammar at the start of the same compiled guide (what SGLang caches and hands out)."""
        stats = self.grammar_stats
        if stats is not None:
            stats = dataclasses.replace(stats, is_cache_hit=True, tree_traversal_time=[])
        return CapgraphGrammar(self.backend, self.compiled, self.key_string, stats, self.factory)

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
        """Write the tokens allowed next into row ``idx`` (1 = allowed); a matcher that fails,
        or a row that allows no token (a dead end), gets the stop tokens only, as in
        :meth:`fill_vocab_mask_batched` (SGLang's speculative tree walk fills row by row).

        Raises:
            LayoutError: ``idx`` is not a row of ``vocab_mask`` (nothing written).
        """
        idx = _mask_row(idx, vocab_mask)
        if self._error is None:
            try:
                self.matcher.fill_next_token_bitmask(vocab_mask, idx)
            except Exception as e:
                self._on_fill_error(e)
            else:
                if not bool(vocab_mask[idx].any()):
                    self._on_dead_end(vocab_mask, idx)
                    return
                self.backend._mirror_stop(vocab_mask, [idx])
                return
        self._stops_only(vocab_mask, idx)

    def fill_vocab_mask_batched(self, entries: List[GrammarRow],  # type: ignore[override]
                                vocab_mask: torch.Tensor) -> None:
        """Fill the listed rows in one call (capgraph's C++ host build on a ring mask), leaving
        the other rows untouched. Grammars of another backend fill through their own method.

        A row that allows no token at all (a dead end) would mask a whole logits row to -inf;
        it allows the stop tokens instead, so that request ends, and an error is logged. A
        matcher whose fill fails (llguidance's error state, for example) gets the same row,
        the error is logged, and its next ``accept_token`` raises it as a ``RequestError``,
        which SGLang turns into that request's abort; the other rows fill as usual.

        Raises:
            LayoutError: an entry's row is not a row of ``vocab_mask`` (nothing written).
        """
        checked = [_mask_row(row, vocab_mask) for row, _ in entries]
        ours: list[CapgraphGrammar] = []
        rows: list[int] = []
        handles: list | None = []
        backend = self.backend
        for row, (_, grammar) in zip(checked, entries):
            if type(grammar) is CapgraphGrammar and grammar.backend is backend:
                if grammar._error is not None:
                    grammar._stops_only(vocab_mask, row)
                    continue
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
        dead, failed = backend.masks.fill([g.matcher for g in ours], handles, rows, vocab_mask)
        backend._mirror_stop(vocab_mask, rows)
        for k in dead:
            ours[k]._on_dead_end(vocab_mask, rows[k])
        for k, error in failed:
            ours[k]._on_fill_error(error)
            ours[k]._stops_only(vocab_mask, rows[k])

    def _on_fill_error(self, error: Exception) -> None:
        """Keep the matcher's failure for the next accept_token, and log it once."""
        self._keep_error(error, "filling its mask")
        _log.error("%s; its row allows only the stop tokens %s", self._error,
                   list(self.backend.stop_ids))

    def _keep_error(self, error: Exception, doing: str) -> None:
        """Make ``error`` this request's: its next accept_token raises it."""
        self._error = RequestError(
            f"capgraph: the {self.compiled.params.guide_type.name} grammar failed {doing} "
            f"after {self.num_accepted} accepted tokens: {type(error).__name__}: {error} "
            f"(guide {_clip(self.key_string)!r})")
        self._error.__cause__ = error

    def _on_dead_end(self, vocab_mask: torch.Tensor, row: int) -> None:
        if not self._dead_end_logged:
            self._dead_end_logged = True
            _log.error("capgraph: the %s grammar allows no token after %d accepted tokens "
                       "(guide %r); its row allows only the stop tokens %s",
                       self.compiled.params.guide_type.name, self.num_accepted,
                       _clip(self.key_string), list(self.backend.stop_ids))
        self._stops_only(vocab_mask, row)

    def _stops_only(self, vocab_mask: torch.Tensor, row: int) -> None:
        """Row ``row`` allows the model's stop tokens and nothing else."""
        words = [0] * vocab_mask.shape[1]
        for t in self.backend.stop_ids:
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
        """The text the grammar forces next, as ``([], text)``, or None (nothing forced, the
        matcher is terminated or failed, or its backend cannot tell).

        Asked through the matcher's bounded ``forced_bytes`` (at most
        :data:`~capgraph.grammar.forced.MAX_FORCED_TEXT_BYTES` bytes, whole characters,
        none on a grammar whose forced text could be unbounded), never xgrammar's own walk,
        which has no length bound. A matcher failure is kept for the request's next
        ``accept_token`` (which aborts the request) instead of raised into SGLang's scheduler.
        """
        if self._error is not None or self.matcher.is_terminated():
            return None
        try:
            text = self.matcher.forced_bytes(MAX_FORCED_TEXT_BYTES).decode("utf-8")
        except Exception as e:  # noqa: BLE001 - one request's failure, not the scheduler's
            self._keep_error(e, "finding its forced text")
            _log.error("%s", self._error)
            return None
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
        eos_token_ids: the model's stop tokens (None: the tokenizer's EOS). A backend that
            takes one stop token (llguidance, ``"auto"``, ``json_unenforced_keywords=
            "fallback"``) gets the tokenizer's EOS (else the smallest id); the other ids are
            allowed wherever it is and end the grammar as it does.
        config: further :class:`GuidedDecodingConfig` fields (backend, compile isolation,
            json_unenforced_keywords, ...); those SGLang sets may not appear here.
        mask_ring_depth: host mask buffers cycled through (:mod:`.sglang_masks`).

    Raises:
        ConfigError: a config field is unknown or invalid (it names the field and the value),
            or an EOS id is not an integer in ``[0, vocab_size)`` (it names the id).
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
        _check_field_names(fields, "capgraph SGLang backend config")
        stops = sorted({_eos_id(t, vocab_size) for t in eos_token_ids}) if eos_token_ids \
            else None
        primary = None
        if stops:
            eos = getattr(tokenizer, "eos_token_id", None)
            primary = eos if type(eos) is int and eos in stops else stops[0]
        cfg = GuidedDecodingConfig(tokenizer=tokenizer, vocab_size_padded=vocab_size,
                                   stop_token_ids=None if primary is None else [primary],
                                   **fields)
        #: model EOS ids capgraph's matchers do not know as stop tokens: allowed wherever
        #: :attr:`stop_token_id` is, and accepted as it (a backend that takes one stop token)
        self.extra_stop_ids: frozenset[int] = frozenset()
        if stops and len(stops) > 1:
            if (cfg.backend is GuidedDecodingBackend.XGRAMMAR
                    and cfg.json_unenforced_keywords != "fallback"):
                cfg = dataclasses.replace(cfg, stop_token_ids=stops)
            else:
                self.extra_stop_ids = frozenset(stops) - {primary}
        self.config = cfg
        #: the stop token capgraph's single-stop matchers end on (None: none, or several)
        self.stop_token_id: Optional[int] = primary
        #: every model stop token (what a row allows where a request must end)
        self.stop_ids: tuple[int, ...] = tuple(sorted(
            set(cfg.stop_token_ids or ()) | self.extra_stop_ids))
        self.factory: GrammarMatcherFactory = create_matcher_factory(cfg)
        self.vocab_size = vocab_size
        self.masks = MaskRing(self.factory, vocab_size, mask_ring_depth)
        # "$$ANY$$" compiles with any whitespace, as SGLang's builtin JSON grammar allows,
        # whatever the server's whitespace flags (a second factory, built on first use)
        self._any_json_factory: Optional[GrammarMatcherFactory] = (
            self.factory if cfg.json_whitespace == "any" else None)
        self._factory_lock = threading.Lock()
        # SGLang's cache of a guide, kept small: key -> (dispatch type, params) of a guide that
        # compiled (its compiled grammar is looked up in the factory's byte-bounded cache), or
        # the CapgraphInvalidGrammar of one that failed for good
        self._keys: ByteLRUCache[Tuple[str, str], Any] = ByteLRUCache(_KEY_CACHE_BYTES)
        self._keys_lock = threading.Lock()

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
            factory = self._factory_for(params)
            handle = factory.compile_async(params)
        except CapgraphError as e:
            return self._invalid(dispatch_type, key_string, e)
        return self._finish(factory, handle, dispatch_type, key_string)

    def _finish(self, factory: GrammarMatcherFactory, handle: CompileHandle,
                dispatch_type: str, key_string: str) -> BaseGrammarObject:
        try:
            compiled = handle.result(self.config.compile_timeout_s,
                                     backend=factory.backend_name)
        except CapgraphError as e:
            return self._invalid(dispatch_type, key_string, e)
        return CapgraphGrammar(self, compiled, key_string,
                               GrammarStats(dispatch_type=dispatch_type), factory)

    @staticmethod
    def _invalid(dispatch_type: str, key_string: str, e: CapgraphError
                 ) -> CapgraphInvalidGrammar:
        _log.error("capgraph: invalid %s guide %r: %s", dispatch_type, _clip(key_string), e)
        return CapgraphInvalidGrammar(f"{type(e).__name__}: {e}",
                                      transient=isinstance(e, _TRANSIENT))

    def _factory_for(self, params: GuidedDecodingParams) -> GrammarMatcherFactory:
        if params.guide_type is not GuideType.JSON:
            return self.factory
        with self._factory_lock:
            if self._any_json_factory is None:
                self._any_json_factory = create_matcher_factory(
                    dataclasses.replace(self.config, json_whitespace="any"))
            return self._any_json_factory

    # -- SGLang's grammar cache ----------------------------------------------------------------
    def get_cached_or_future_value(self, key: Tuple[str, str], require_reasoning: bool
                                   ) -> Tuple[Any, bool]:
        """SGLang's lookup: a guide that compiled before is looked up in capgraph's
        byte-bounded compile cache (a hit is a fresh grammar at once; an evicted guide compiles
        again); a guide that failed for good is its cached ``InvalidGrammarObject``; any other
        is compiled on SGLang's executor."""
        with self._keys_lock:
            entry = self._keys.get(key)
        if entry is None:
            return super().get_cached_or_future_value(key, require_reasoning)
        if isinstance(entry, InvalidGrammarObject):
            return entry, True
        dispatch_type, params = entry
        factory = self._factory_for(params)
        handle = factory.compile_async(params)
        if handle.done() and handle.future.exception() is None:
            try:
                grammar = CapgraphGrammar(self, handle.future.result(), key[1],
                                          GrammarStats(dispatch_type=dispatch_type,
                                                       is_cache_hit=True), factory)
            except Exception:  # (reported from SGLang's executor, for this request alone)
                pass
            else:
                grammar.maybe_init_reasoning(require_reasoning)
                return grammar, True
        return self.executor.submit(self._finish, factory, handle, dispatch_type, key[1]), False

    def set_cache(self, key: Tuple[str, str], value: BaseGrammarObject) -> None:
        """SGLang's store after a compile: only the guide's key and parameters of a grammar
        (never the compiled grammar, which capgraph's own cache bounds), and only a permanent
        failure (a transient one, or SGLang's own timeout, is compiled again next time)."""
        if isinstance(value, CapgraphGrammar):
            params = value.compiled.params
            stats = value.grammar_stats
            dispatch_type = stats.dispatch_type if stats is not None else None
            entry: Any = (dispatch_type, params)
            nbytes = len(key[0]) + len(key[1]) + 256 + (
                0 if params.guide is key[1] else len(params.guide))
        elif isinstance(value, CapgraphInvalidGrammar) and not value.transient:
            entry, nbytes = value, len(key[0]) + len(key[1]) + 256 + len(value.error_message)
        else:
            return
        with self._keys_lock:
            self._keys.put(key, entry, nbytes)

    def reset(self) -> None:
        """Forget SGLang's cached guides (capgraph's byte-bounded compile caches stay)."""
        super().reset()
        with self._keys_lock:
            self._keys.clear()

    # -- stop tokens -----------------------------------------------------------------------------
    def _mirror_stop(self, vocab_mask: torch.Tensor, rows: Sequence[int]) -> None:
        """Allow the extra EOS ids in ``rows`` wherever the stop token is allowed."""
        if not self.extra_stop_ids or not rows:
            return
        stop = self.stop_token_id
        assert stop is not None
        index = torch.tensor(list(rows), dtype=torch.long)
        allowed = (vocab_mask[index, stop // 32] >> (stop % 32)) & 1
        for t in self.extra_stop_ids:
            column = vocab_mask[index, t // 32]
            vocab_mask[index, t // 32] = column | (allowed << (t % 32))

    def close(self) -> None:
        """Stop the factories' queued compiles and worker processes."""
        self.factory.close()
        with self._factory_lock:
            other = self._any_json_factory
        if other is not None and other is not self.factory:
            other.close()


def _current_tag_format(key_string: str) -> str:
    """A structural tag in the format capgraph compiles, repaired and converted the way SGLang's
    xgrammar backend does it: SGLang's legacy form (``{"structures": [...], "triggers":
    [...]}``) converted to the current one, and a missing or null ``json_schema`` of a
    ``json_schema`` / ``qwen_xml_parameter`` format, at any nesting level, made ``{}``;
    anything else unchanged (capgraph's compile reports what is wrong)."""
    try:
        tag = json.loads(key_string)
        if not isinstance(tag, dict):
            return key_string
        if not ("structures" in tag and "triggers" in tag):
            if isinstance(tag.get("format"), dict) and _sanitize_tag_format(tag["format"]):
                return json.dumps(tag)
            return key_string
    except (ValueError, RecursionError):  # (nested too deep to read: the compile names it)
        return key_string
    import xgrammar as xgr
    from xgrammar.structural_tag import TriggeredTagsFormat

    try:
        items = [xgr.StructuralTagItem(begin=s["begin"],
                                       schema=json.dumps(s.get("schema") or {}),
                                       end=s["end"]) for s in tag["structures"]]
        converted = xgr.StructuralTag.from_legacy_structural_tag(items, tag["triggers"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return key_string
    if isinstance(converted.format, TriggeredTagsFormat):
        converted.format.at_least_one = bool(tag.get("at_least_one", False))
    return str(converted.model_dump_json())


def _sanitize_tag_format(fmt: Any) -> bool:
    """SGLang's ``_sanitize_structural_format`` (xgrammar backend): a missing or null
    ``json_schema`` becomes ``{}`` through tag / sequence / or / triggered_tags /
    tags_with_separator nesting, in place. Returns whether anything changed."""
    if not isinstance(fmt, dict):
        return False
    changed = False
    kind = fmt.get("type")
    if kind in ("json_schema", "qwen_xml_parameter") and fmt.get("json_schema") is None:
        fmt["json_schema"] = {}
        changed = True
    children: Any = ()
    if kind == "tag":
        children = [fmt.get("content")]
    elif kind in ("sequence", "or"):
        children = fmt.get("elements", [])
    elif kind in ("triggered_tags", "tags_with_separator"):
        children = fmt.get("tags", [])
    if isinstance(children, list):
        for child in children:
            changed = _sanitize_tag_format(child) or changed
    return changed


def _native_handle(matcher: GrammarMatcher) -> Any:
    """The xgrammar FFI object of a plain ``XGrammarMatcher`` (what the C++ fill runs), else
    None (an llguidance, hand-over or wrapped matcher: its own methods must run)."""
    from ..grammar.xgrammar_backend import XGrammarMatcher

    return matcher.native_handle() if type(matcher) is XGrammarMatcher else None


def _mask_row(row: Any, vocab_mask: torch.Tensor) -> int:
    """``row`` as an int when it is a row of ``vocab_mask`` (an engine's bad index is refused
    before any row is written or any request is blamed for it)."""
    index = as_int(row)
    rows = vocab_mask.shape[0]
    if index is None or not 0 <= index < rows:
        raise LayoutError(f"capgraph: vocab mask row {row!r} is outside the mask's {rows} "
                          f"rows [0, {rows})")
    return index


def _eos_id(token: Any, vocab_size: int) -> int:
    """``token`` as an int when it is a token id of the ``vocab_size``-wide logits rows."""
    value = as_int(token)
    if value is None or not 0 <= value < vocab_size:
        raise ConfigError(f"capgraph SGLang backend: eos_token_ids holds {token!r}, not a "
                          f"token id in [0, {vocab_size})")
    return value


def _clip(text: str, limit: int = 200) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def config_from_server_args(server_args: Any) -> dict[str, Any]:
    """The :class:`GuidedDecodingConfig` fields of SGLang's JSON whitespace flags and of
    ``$CAPGRAPH_SGLANG_CONFIG`` (a JSON object; its fields win).

    ``--constrained-json-disable-any-whitespace`` (SGLang's xgrammar backend: exactly the
    separators ``", "`` and ``": "``, no other whitespace) maps onto ``json_whitespace=
    "bounded"`` with ``json_max_whitespace=1``, which accepts every spelling that flag gives
    on SGLang's backend and ``{"a":1}`` and single newlines as well (capgraph has no mode of
    exactly those separators); ``--constrained-json-max-whitespace-cnt N`` onto
    ``"bounded"`` with N, as on SGLang's backend.

    Raises:
        ConfigError: the variable is not a JSON object or names an unknown field, or SGLang
            asks for a whitespace pattern (a regex), which capgraph cannot enforce.
    """
    fields: dict[str, Any] = {}
    if getattr(server_args, "constrained_json_whitespace_pattern", None):
        raise ConfigError("capgraph SGLang backend: --constrained-json-whitespace-pattern is "
                          "not supported; use --constrained-json-disable-any-whitespace or "
                          "--constrained-json-max-whitespace-cnt")
    if getattr(server_args, "constrained_json_disable_any_whitespace", False):
        fields["json_whitespace"] = "bounded"
        fields["json_max_whitespace"] = 1
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
        _check_field_names(extra, CONFIG_ENV)
        fields.update(extra)
    return fields


def _check_field_names(fields: dict[str, Any], where: str) -> None:
    known = {f.name for f in dataclasses.fields(GuidedDecodingConfig)}
    unknown = sorted(str(name) for name in fields if name not in known)
    if unknown:
        raise ConfigError(f"{where}: unknown GuidedDecodingConfig field(s) "
                          f"{', '.join(map(repr, unknown))}")


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
