"""xgrammar backend: all five guide types, several stop tokens, multi-threaded batch fill."""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

import torch
import xgrammar as xgr

from ..errors import GrammarCompileError, UnsupportedGuideError
from ..params import GuidedDecodingConfig, GuidedDecodingParams, GuideType
from .base import CompiledGuide, GrammarMatcher, GrammarMatcherFactory
from .native import NativeBuilder, NativeBuildError, matcher_methods
from .schema_check import unenforced_keywords

__all__ = ["XGrammarMatcher", "XGrammarMatcherFactory", "build_tokenizer_info"]

BACKEND = "xgrammar"
# A Lark rule head ("start:" / "?value:") where GBNF would have "root ::=".
_LARK_RULE = re.compile(r"^\s*[?!]?[a-z_][a-z0-9_]*\s*:(?!:=)", re.MULTILINE)


def build_tokenizer_info(config: GuidedDecodingConfig) -> xgr.TokenizerInfo:
    """xgrammar's view of the vocabulary, with metadata detected from the HF tokenizer.

    ``vocab_size`` is the padded width, so ids at or above the tokenizer's vocabulary are
    special to xgrammar and never allowed on a guided row.
    """
    if config.tokenizer is not None:
        return xgr.TokenizerInfo.from_huggingface(
            config.tokenizer, vocab_size=config.vocab_size_padded,
            stop_token_ids=list(config.stop_token_ids or []))
    return xgr.TokenizerInfo(list(config.encoded_vocab or []), vocab_type=xgr.VocabType.RAW,
                             vocab_size=config.vocab_size_padded,
                             stop_token_ids=list(config.stop_token_ids or []))


def _ffi(obj: Any, *methods: str) -> Any:
    """The FFI object behind an xgrammar wrapper, or None.

    xgrammar's Python classes are thin wrappers whose methods forward to ``_handle`` (an
    object fixed at construction, per xgrammar's ``XGRObject`` contract); calling its bound
    methods directly skips one Python frame per call (~0.1 us, measured with xgrammar 0.2.9),
    which this library pays per request per step. Without it the public methods are used.
    """
    handle = getattr(obj, "_handle", None)
    if handle is None or not all(hasattr(handle, m) for m in methods):
        return None
    return handle


class XGrammarMatcher(GrammarMatcher):
    """Wraps ``xgrammar.GrammarMatcher``; rollback is unlimited in xgrammar >= 0.2.9.

    ``is_terminated`` is answered from a flag kept in step with ``accept_token`` and
    ``rollback``: only an accepted stop token can terminate, only a rollback can undo it, and
    asking xgrammar costs a foreign call (~1.5 us) on every request of every step otherwise.
    """

    __slots__ = ("_matcher", "_stop_ids", "_terminated", "_handle", "_chandle", "_accept",
                 "_fill")

    def __init__(self, matcher: xgr.GrammarMatcher, stop_ids: frozenset[int] = frozenset()) -> None:
        self._matcher = matcher
        self._stop_ids = stop_ids
        self._terminated = matcher.is_terminated()
        handle = _ffi(matcher, "accept_token", "fill_next_token_bitmask")
        self._handle = handle  # what BatchGrammarMatcher's FFI object takes, or None
        # its address, for the C++ fast path (capgraph.grammar.native; 0: none)
        chandle = getattr(handle, "__chandle__", None)
        self._chandle: int = int(chandle()) if chandle is not None else 0
        if handle is not None:  # (token, debug_print) / (bitmask, index, debug_print)
            self._accept = handle.accept_token
            self._fill = handle.fill_next_token_bitmask
        else:
            self._accept = lambda token_id, _debug: matcher.accept_token(token_id)
            self._fill = lambda bitmask, index, _debug: matcher.fill_next_token_bitmask(
                bitmask, index)

    @property
    def native(self) -> xgr.GrammarMatcher:
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        ok = self._accept(token_id, False)
        if ok and token_id in self._stop_ids:
            self._terminated = self._matcher.is_terminated()
        return ok

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0:
            raise ValueError(f"rollback needs num_tokens >= 0, got {num_tokens}")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._terminated = False  # termination is always the last step

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        self._fill(bitmask, index, False)

    def is_terminated(self) -> bool:
        return self._terminated

    def sync_state(self) -> None:
        self._terminated = self._matcher.is_terminated()


class XGrammarMatcherFactory(GrammarMatcherFactory):
    """Compiles guides with ``xgrammar.GrammarCompiler`` (its own cache off: ours bounds bytes)."""

    backend_name = BACKEND

    def __init__(self, config: GuidedDecodingConfig) -> None:
        super().__init__(config)
        self.tokenizer_info = build_tokenizer_info(config)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info,
                                             max_threads=max(1, config.compile_threads),
                                             cache_enabled=False)
        # fill_threads 0 is xgrammar's "auto" (half the hardware threads); 1, the default, was
        # the fastest measured on a 2-core and a 16-core host (GuidedDecodingConfig).
        self._batch = xgr.BatchGrammarMatcher(config.fill_threads or "auto")
        batch_ffi = _ffi(self._batch, "batch_fill_next_token_bitmask")
        self._batch_fill_ffi = None if batch_ffi is None else \
            batch_ffi.batch_fill_next_token_bitmask  # (handles, bitmask, indices, debug)
        self._stop_ids = frozenset(config.stop_token_ids or ())

    def _compile(self, params: GuidedDecodingParams) -> tuple[Any, int]:
        gt, guide = params.guide_type, params.guide
        try:
            if gt is GuideType.JSON:
                compiled = self._compiler.compile_builtin_json_grammar()
            elif gt is GuideType.JSON_SCHEMA:
                if self.config.json_unenforced_keywords == "error":
                    self._refuse_unenforced(guide)
                compiled = self._compiler.compile_json_schema(
                    guide, any_whitespace=self.config.json_any_whitespace)
            elif gt is GuideType.REGEX:
                compiled = self._compiler.compile_regex(guide)
            elif gt is GuideType.EBNF_GRAMMAR:
                compiled = self._compiler.compile_grammar(guide)
            elif gt is GuideType.STRUCTURAL_TAG:
                compiled = self._compiler.compile_structural_tag(guide)
            else:  # pragma: no cover - GuideType is closed
                raise UnsupportedGuideError("unknown guide type", guide_type=str(gt),
                                            backend=BACKEND)
        except GrammarCompileError:
            raise
        except Exception as e:
            detail = f"{type(e).__name__}: {str(e).strip()}"
            if gt is GuideType.EBNF_GRAMMAR and "::=" not in guide and _LARK_RULE.search(guide):
                detail += (" (this looks like Lark; the xgrammar backend takes GBNF/EBNF with a "
                           "'root ::= ...' rule, the llguidance backend takes Lark)")
            raise GrammarCompileError(detail, guide_type=gt.name, backend=BACKEND) from e
        return compiled, int(compiled.memory_size_bytes)

    @staticmethod
    def _refuse_unenforced(guide: str) -> None:
        try:
            schema = json.loads(guide)
        except ValueError:
            return  # malformed: xgrammar's own error says where
        found = list(unenforced_keywords(schema))
        if found:
            where = ", ".join(f"'{k}' at {p}" for k, p in found[:5])
            more = f" (+{len(found) - 5} more)" if len(found) > 5 else ""
            raise UnsupportedGuideError(
                f"xgrammar would accept but not enforce {where}{more}; remove them, use the "
                "llguidance backend, or set GuidedDecodingConfig(json_unenforced_keywords="
                "'ignore') to generate with them unenforced", guide_type="JSON_SCHEMA",
                backend=BACKEND)

    def create_from_compiled(self, compiled: CompiledGuide) -> XGrammarMatcher:
        return XGrammarMatcher(xgr.GrammarMatcher(compiled.payload), self._stop_ids)

    def _likely_allowed_ids(self) -> Sequence[int]:
        single_byte = [i for i, b in enumerate(self.tokenizer_info.decoded_vocab) if len(b) == 1]
        return [*self._stop_ids, *single_byte]

    def batch_accept(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]
                     ) -> list[bool | Exception]:
        """Accept a token per matcher with one Python loop over the native matchers.

        Not ``xgrammar.BatchGrammarMatcher.batch_accept_token``: measured at batch 32
        (Tekken, JSON schema), converting its result array back to Python costs more than the
        calls it saves (26 us vs 15 us for this loop).
        """
        results: list[bool | Exception] = []
        append = results.append
        stops = self._stop_ids
        for m, t in zip(matchers, tokens):
            try:
                if type(m) is XGrammarMatcher:  # not a subclass or wrapper: its own methods
                    ok = m._accept(t, False)
                    if ok and t in stops:
                        m._terminated = m._matcher.is_terminated()
                else:
                    ok = m.accept_token(t)
            except Exception as e:
                append(e)
                continue
            append(bool(ok))
        return results

    def native_builder(self, bitmask: torch.Tensor, token_mask: torch.Tensor,
                       max_requests: int, full_words: int, tail_mask: int,
                       clear: tuple[int, int] | None) -> NativeBuilder | None:
        """The C++ loop (:mod:`capgraph.grammar.native`) with xgrammar's own FFI methods;
        None with ``fill_threads`` other than 1 (that asks for xgrammar's threaded batch fill,
        which the Python build calls)."""
        if self.config.fill_threads != 1:
            return None
        ffi_type = getattr(getattr(xgr.matcher, "_core", None), "GrammarMatcher", None)
        if ffi_type is None:
            raise NativeBuildError("this xgrammar exposes no FFI matcher type "
                                   "(xgrammar.matcher._core.GrammarMatcher)")
        return NativeBuilder(matcher_methods(ffi_type), bitmask, token_mask, max_requests,
                             sorted(self._stop_ids), full_words, tail_mask, clear)

    def native_matcher_type(self) -> type | None:
        return XGrammarMatcher

    def native_handles(self, matchers: Sequence[GrammarMatcher]) -> list | None:
        """The FFI object of every plain ``XGrammarMatcher``; None if one of ``matchers`` is a
        subclass or wrapper (its own methods must run) or xgrammar exposes no FFI object."""
        handles = [m._handle if type(m) is XGrammarMatcher else None  # type: ignore[attr-defined]
                   for m in matchers]
        return None if None in handles else handles

    def batch_fill(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                   indices: Sequence[int]) -> None:
        """One call into xgrammar's batch matcher: threads in C++, GIL released."""
        if not matchers:
            return
        if len(matchers) == 1 or any(type(m) is not XGrammarMatcher for m in matchers):
            # one row: the thread hand-off would cost more than it saves; subclasses or
            # wrappers: their own methods must run
            super().batch_fill(matchers, bitmask, indices)
            return
        handles = self.native_handles(matchers)
        if handles is not None and self._batch_fill_ffi is not None:
            self._batch_fill_ffi(handles, bitmask, list(indices), False)
        else:  # an xgrammar without the FFI objects: its Python batch call, threads all the same
            self._batch.batch_fill_next_token_bitmask(
                [m._matcher for m in matchers], bitmask, list(indices))  # type: ignore[attr-defined]
