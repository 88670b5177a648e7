"""NVTX ranges in the "capgraph" domain through the ``nvtx`` package.

Without a profiler attached the domain is a no-op object and a range costs about 0.1 us
(push + pop with attributes built once), so ranges stay on in production code.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

import nvtx

__all__ = ["DOMAIN", "nvtx_range", "annotate"]

DOMAIN = "capgraph"
_domain = nvtx.get_domain(DOMAIN)
F = TypeVar("F", bound=Callable)


@functools.lru_cache(maxsize=None)
def _attributes(name: str):
    return _domain.get_event_attributes(message=name)


def _push(name: str, attributes: object) -> None:
    """Open a range (a seam for tests, which replace it to record the names)."""
    _domain.push_range(attributes)


def _pop() -> None:
    _domain.pop_range()


@contextmanager
def annotate(name: str) -> Iterator[None]:
    """A range around a block: ``with annotate("GuidedDecoder.copy"): ...``."""
    _push(name, _attributes(name))
    try:
        yield
    finally:
        _pop()


def nvtx_range(name: str) -> Callable[[F], F]:
    """Decorator: the whole call is one range named ``name``."""
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
