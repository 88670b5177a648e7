"""capgraph: grammar-guided decoding for CUDA-graph-replayed inference.

Importing capgraph compiles nothing, touches no GPU and imports no grammar backend; the heavier
submodules load on first use of the names below.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .errors import *  # noqa: F401,F403
from .errors import __all__ as _errors_all
from .params import (GuidedDecodingBackend, GuidedDecodingConfig, GuidedDecodingParams,
                     GuideType)

__version__ = "0.1.0"

# name -> submodule that defines it; loaded lazily (PEP 562).
_LAZY = {
    "GrammarMatcher": "capgraph.grammar",
    "GrammarMatcherFactory": "capgraph.grammar",
    "create_matcher_factory": "capgraph.grammar",
    "logits_bitmask": "capgraph.ops",
    "load_tokenizer": "capgraph.tokenizers",
    "GuidedRequest": "capgraph.requests",
    "GuidedRequests": "capgraph.requests",
    "GuidedDecoder": "capgraph.decoder",
    "CapturableGuidedDecoder": "capgraph.capturable",
    "generate": "capgraph.runtime",
    "compare_eager_and_replay": "capgraph.testing",
    "record_host_callbacks": "capgraph.testing",
}

__all__ = [
    "GuideType", "GuidedDecodingBackend", "GuidedDecodingParams", "GuidedDecodingConfig",
    *_errors_all, *_LAZY,
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'capgraph' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # pragma: no cover
    from .grammar import GrammarMatcher, GrammarMatcherFactory, create_matcher_factory
    from .ops import logits_bitmask
    from .capturable import CapturableGuidedDecoder
    from .decoder import GuidedDecoder
    from .requests import GuidedRequest, GuidedRequests
    from .runtime import generate
    from .testing import compare_eager_and_replay, record_host_callbacks
    from .tokenizers import load_tokenizer
