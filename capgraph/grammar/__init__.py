"""Grammar backends behind one contract; backends import lazily (llguidance is optional)."""

from __future__ import annotations

from ..errors import ConfigError
from ..params import GuidedDecodingBackend, GuidedDecodingConfig
from .base import (CompiledGuide, CompileHandle, CompileStats, GrammarMatcher,
                   GrammarMatcherFactory)
from .forced import ForcedTokenEncoder

__all__ = ["GrammarMatcher", "GrammarMatcherFactory", "CompiledGuide", "CompileHandle",
           "CompileStats", "ForcedTokenEncoder", "create_matcher_factory"]


def _backend_factory(config: GuidedDecodingConfig,
                     backend: GuidedDecodingBackend) -> GrammarMatcherFactory:
    if backend is GuidedDecodingBackend.XGRAMMAR:
        from .xgrammar_backend import XGrammarMatcherFactory
        return XGrammarMatcherFactory(config)
    if backend is GuidedDecodingBackend.LLGUIDANCE:
        from .llguidance_backend import LLGuidanceMatcherFactory
        return LLGuidanceMatcherFactory(config)
    raise ConfigError(f"unknown backend {backend!r}")  # pragma: no cover


def create_matcher_factory(config: GuidedDecodingConfig) -> GrammarMatcherFactory:
    """The factory of the configured backend (building it reads the whole vocabulary once).

    With ``backend="auto"``, a :class:`~capgraph.grammar.handover.HandOverMatcherFactory` over
    both backends (fast start). With ``json_unenforced_keywords="fallback"``, a
    :class:`~capgraph.grammar.fallback.FallbackMatcherFactory` over the configured backend and
    the other one; a :class:`~capgraph.errors.ConfigError` says why where the other one cannot
    be built (the llguidance extra missing, no tokenizer, not exactly one stop token).
    """
    if config.backend is GuidedDecodingBackend.AUTO:
        return _handover_factory(config)
    primary = _backend_factory(config, config.backend)
    if config.json_unenforced_keywords != "fallback":
        return primary
    other = (GuidedDecodingBackend.LLGUIDANCE if config.backend is GuidedDecodingBackend.XGRAMMAR
             else GuidedDecodingBackend.XGRAMMAR)
    try:
        secondary = _backend_factory(config, other)
    except ConfigError as e:
        primary.close()
        raise ConfigError(f"GuidedDecodingConfig.json_unenforced_keywords='fallback' needs the "
                          f"{other.value} backend as well, which cannot be built here: {e}"
                          ) from e
    from .fallback import FallbackMatcherFactory
    return FallbackMatcherFactory(primary, secondary)


def _handover_factory(config: GuidedDecodingConfig) -> GrammarMatcherFactory:
    """``backend="auto"``: both backends, each with the user's config but its own ``backend``
    and ``json_unenforced_keywords="error"`` (the routing between them is the hand-over
    factory's; xgrammar's disk cache then keys its grammars as a plain xgrammar factory with
    "error" does). Each side has its own memory cache of ``compile_cache_bytes``."""
    import dataclasses

    from .handover import HandOverMatcherFactory

    sides = []
    try:
        for backend in (GuidedDecodingBackend.XGRAMMAR, GuidedDecodingBackend.LLGUIDANCE):
            sides.append(_backend_factory(dataclasses.replace(
                config, backend=backend, json_unenforced_keywords="error"), backend))
    except ConfigError as e:
        for f in sides:
            f.close()
        raise ConfigError(f"GuidedDecodingConfig.backend='auto' needs both backends, and one "
                          f"cannot be built here: {e}") from e
    return HandOverMatcherFactory(config, sides[0], sides[1])
