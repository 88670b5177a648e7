"""NVTX ranges in the "capgraph" domain through the ``nvtx`` package.

A profiler (nsys, or any NVTX tool) attaches when the process starts; ``nvtx`` then hands out
a live domain, and every decorated method pushes and pops its named range. Without one the
domain is nvtx's no-op ``DummyDomain`` and :func:`nvtx_range` returns the method undecorated,
as nvtx's own ``annotate`` does, so the per-step API pays nothing for its ranges (a no-op range
still cost 0.12 us per call through the wrapper, two per step: about 5% of a batch-1 host
build).

``CAPGRAPH_NVTX=always`` keeps the wrappers without a tool (tests record the ranges that way).
"""

from __future__ import annotations

import functools
import os
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import nvtx

__all__ = ["DOMAIN", "ACTIVE", "nvtx_range", "annotate"]

DOMAIN = "capgraph"
_domain = nvtx.get_domain(DOMAIN)
#: whether ranges are emitted: a tool is attached, or CAPGRAPH_NVTX=always
ACTIVE: bool = (type(_domain).__name__ != "DummyDomain"
                or os.environ.get("CAPGRAPH_NVTX", "").lower() == "always")
F = TypeVar("F", bound=Callable)


@functools.lru_cache(maxsize=None)
def _attributes(name: str):
    return _domain.get_event_attributes(message=name)


def _push(name: str, attributes: object) -> None:
    """Open a range (a seam for tests, which replace it to record the names)."""
    _domain.push_range(attributes)


def _pop() -> None:
    _domain.pop_range()


def _unchanged(fn: F) -> F:
    return fn


@contextmanager
def annotate(name: str) -> Iterator[None]:
    """A range around a block: ``with annotate("GuidedDecoder.copy"): ...``."""
    _push(name, _attributes(name))
    try:
        yield
    finally:
        _pop()


def nvtx_range(name: str) -> Callable[[F], F]:
    """Decorator: the whole call is one range named ``name`` (the undecorated function when
    no tool is attached: see :data:`ACTIVE`)."""
    if not ACTIVE:
        return _unchanged
    attributes = _attributes(name)

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            _push(name, attributes)
            try:
                return fn(*args, **kwargs)
            finally:
                _pop()
        return inner  # type: ignore[return-value]
    return wrap
