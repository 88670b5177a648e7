"""Grammar backends behind one contract; backends import lazily (llguidance is optional)."""

from __future__ import annotations

from ..errors import ConfigError
from ..params import GuidedDecodingBackend, GuidedDecodingConfig
from .base import (CompiledGuide, CompileHandle, CompileStats, GrammarMatcher,
                   GrammarMatcherFactory)

__all__ = ["GrammarMatcher", "GrammarMatcherFactory", "CompiledGuide", "CompileHandle",
           "CompileStats", "create_matcher_factory"]


def create_matcher_factory(config: GuidedDecodingConfig) -> GrammarMatcherFactory:
    """The factory of the configured backend (building it reads the whole vocabulary once)."""
    if config.backend is GuidedDecodingBackend.XGRAMMAR:
        from .xgrammar_backend import XGrammarMatcherFactory
        return XGrammarMatcherFactory(config)
    if config.backend is GuidedDecodingBackend.LLGUIDANCE:
        from .llguidance_backend import LLGuidanceMatcherFactory
        return LLGuidanceMatcherFactory(config)
    raise ConfigError(f"unknown backend {config.backend!r}")  # pragma: no cover
