"""Two backends behind one factory: a JSON schema one cannot enforce goes to the other.

With ``GuidedDecodingConfig(json_unenforced_keywords="fallback")``,
:func:`~capgraph.grammar.create_matcher_factory` returns a :class:`FallbackMatcherFactory`.
Every guide is compiled by the configured backend first; a JSON schema that backend refuses
(a constraint it would not enforce, :mod:`capgraph.grammar.schema_policy`, or a schema it
cannot compile) is compiled by the other one, and refused only when both refuse it. The
compiled guide records who serves it and why (:attr:`CompiledGuide.backend`,
:attr:`CompiledGuide.fallback_reason`); :meth:`FallbackMatcherFactory.served_by` answers it
for a request's params, and each fallback is logged at INFO on ``capgraph.grammar.fallback``.

The decoder sees one factory: matchers of both engines share a batch. xgrammar's matchers keep
the native host build (:mod:`capgraph.build.native`) when a batch holds only them; a batch with an llguidance matcher takes
the Python build, where :meth:`batch_fill` and :meth:`batch_accept` hand each engine its own
matchers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..errors import GrammarCompileError, UnsupportedGuideError
from ..params import GuidedDecodingParams, GuideType
from .base import CompiledGuide, GrammarMatcher, GrammarMatcherFactory

__all__ = ["FallbackMatcherFactory"]

_log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Routed:
    """What :meth:`FallbackMatcherFactory._compile` hands the base class: the engine's payload
    and who compiled it."""

    payload: Any
    backend: str
    reason: str | None


class FallbackMatcherFactory(GrammarMatcherFactory):
    """Compiles with ``primary``; JSON schemas ``primary`` refuses go to ``secondary``.

    Args:
        primary: the configured backend's factory (serves every guide it accepts).
        secondary: the other backend's factory (serves only JSON schemas ``primary`` refuses).
        Both must refuse unenforced keywords (``json_unenforced_keywords`` other than
        ``"ignore"``), or a dropped constraint would not trigger the fallback.
    """

    def __init__(self, primary: GrammarMatcherFactory,
                 secondary: GrammarMatcherFactory) -> None:
        super().__init__(primary.config)
        for f in (primary, secondary):
            if f.config.json_unenforced_keywords == "ignore":
                raise ValueError(f"the {f.backend_name} factory ignores unenforced keywords; "
                                 "a fallback needs both to refuse them")
        self.primary = primary
        self.secondary = secondary
        self.backend_name = f"{primary.backend_name}+{secondary.backend_name}"
        self._by_backend = {primary.backend_name: primary, secondary.backend_name: secondary}
        # matcher class -> the factory whose batch calls take it
        self._owners: dict[type, GrammarMatcherFactory] = {}
        for f in (primary, secondary):
            owned = _matcher_class(f)
            if owned is not None:
                self._owners[owned] = f

    # -- compile routing ----------------------------------------------------------------------
    def _limits_backend(self, params: GuidedDecodingParams) -> str:
        # every guide but a JSON schema compiles on the primary, in its syntax (a JSON schema
        # reads the same to both)
        return self.primary.backend_name

    def _compile(self, params: GuidedDecodingParams) -> tuple[Any, int]:
        primary, secondary = self.primary, self.secondary
        if params.guide_type is not GuideType.JSON_SCHEMA:
            payload, nbytes = primary._compile(params)
            return _Routed(payload, primary.backend_name, None), nbytes
        try:
            payload, nbytes = primary._compile(params)
            return _Routed(payload, primary.backend_name, None), nbytes
        except GrammarCompileError as e:
            first = e
        reason = f"{primary.backend_name} refused it: {_finding(first)}"
        try:
            payload, nbytes = secondary._compile(params)
        except GrammarCompileError as second:
            both_unsupported = isinstance(first, UnsupportedGuideError) and \
                isinstance(second, UnsupportedGuideError)
            error = UnsupportedGuideError if both_unsupported else GrammarCompileError
            raise error(f"neither backend takes this schema: {primary.backend_name}: "
                        f"{_finding(first)} | {secondary.backend_name}: {_finding(second)}",
                        guide_type=GuideType.JSON_SCHEMA.name,
                        backend=self.backend_name) from second
        _log.info("capgraph: JSON schema served by %s (%s)", secondary.backend_name, reason)
        return _Routed(payload, secondary.backend_name, reason), nbytes

    def _stop_compile(self, key: tuple[str, str]) -> bool:
        # the primary's worker process compiles under the same key (the secondary's threads
        # cannot be stopped)
        return self.primary._stop_compile(key)

    def _served_by(self, payload: Any) -> tuple[Any, str, str | None]:
        return payload.payload, payload.backend, payload.reason

    def served_by(self, params: GuidedDecodingParams) -> tuple[str, str | None]:
        """``(backend, fallback_reason)`` of the guide of ``params``: which engine serves it
        and, where that is not the configured one, why. Compiles it if needed (through the
        cache, as a request would); raises the request's compile error if neither engine
        takes it."""
        compiled = self.compile(params)
        return compiled.backend, compiled.fallback_reason

    def create_from_compiled(self, compiled: CompiledGuide) -> GrammarMatcher:
        return self._by_backend[compiled.backend].create_from_compiled(compiled)

    # -- per-step calls: each engine gets its own matchers ----------------------------------
    def _owner(self, matcher: GrammarMatcher) -> GrammarMatcherFactory | None:
        return self._owners.get(type(matcher))

    def batch_fill(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor,
                   indices: Sequence[int]) -> None:
        owners = [self._owner(m) for m in matchers]
        if owners and owners[0] is not None and all(o is owners[0] for o in owners):
            owners[0].batch_fill(matchers, bitmask, indices)
            return
        groups: dict[int, tuple[GrammarMatcherFactory | None, list, list]] = {}
        for m, i, owner in zip(matchers, indices, owners):
            group = groups.setdefault(id(owner), (owner, [], []))
            group[1].append(m)
            group[2].append(i)
        for owner, ms, rows in groups.values():
            if owner is None:  # a subclass or wrapper: its own methods
                super().batch_fill(ms, bitmask, rows)
            else:
                owner.batch_fill(ms, bitmask, rows)

    def batch_accept(self, matchers: Sequence[GrammarMatcher], tokens: Sequence[int]
                     ) -> list[bool | Exception]:
        owners = [self._owner(m) for m in matchers]
        first = owners[0] if owners else None
        if first is not None and all(o is first for o in owners):
            return first.batch_accept(matchers, tokens)
        results: list[bool | Exception] = [False] * len(matchers)
        positions: dict[int, tuple[GrammarMatcherFactory | None, list[int]]] = {}
        for k, owner in enumerate(owners):
            positions.setdefault(id(owner), (owner, []))[1].append(k)
        for owner, ks in positions.values():
            ms = [matchers[k] for k in ks]
            ts = [tokens[k] for k in ks]
            out = super().batch_accept(ms, ts) if owner is None else owner.batch_accept(ms, ts)
            for k, r in zip(ks, out):
                results[k] = r
        return results

    def _likely_allowed_ids(self) -> Sequence[int]:
        return [*self.primary.likely_allowed_token_ids(),
                *self.secondary.likely_allowed_token_ids()]

    def close(self) -> None:
        super().close()
        self.primary.close()
        self.secondary.close()

    def _close_collected(self) -> None:
        GrammarMatcherFactory.close(self)  # (its own pool only)


def _finding(error: GrammarCompileError) -> str:
    """A backend's refusal without the advice on how to get past it (which names this very
    fallback)."""
    return error.detail.split("; remove them,")[0]


def _matcher_class(factory: GrammarMatcherFactory) -> type | None:
    """The matcher class a backend's factory creates (None for a backend not known here)."""
    if factory.backend_name == "xgrammar":
        from .xgrammar_backend import XGrammarMatcher
        return XGrammarMatcher
    if factory.backend_name == "llguidance":
        from .llguidance_backend import LLGuidanceMatcher
        return LLGuidanceMatcher
    return None
