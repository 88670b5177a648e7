"""The host build: one strategy interface, the Python reference and the native strategies.

A decoder chooses its strategy once, at construction (``GuidedDecoder(host_build=...)``):

========================  ===============================================================
``"python"``              :class:`PythonBuild`, the readable reference (any backend)
``"native-loop"``         :class:`NativeLoopBuild`: Python selection, the loop in C++
``"native"``              :class:`NativeBuild`: a steady-state step in one C++ call
                          (the native loop for any other batch)
``"auto"`` (default)      ``"native"`` where it builds (the xgrammar or auto backend,
                          ``fill_threads=1``, a C++ compiler), following
                          ``GuidedDecodingConfig.native_build``; else ``"python"``
a callable                ``(slots, factory, budget_ms) -> HostBuild``: a strategy of your own
========================  ===============================================================

Every strategy gives the same rows, masks, counters and outcomes for the same step
(``tests/test_native_build.py`` checks them against each other).
"""

from __future__ import annotations

import warnings
from typing import Callable, Literal, Union

from ..errors import ConfigError, NativeBuildError
from ..grammar import GrammarMatcherFactory
from .base import HostBuild, Outcome, Status, StepResult
from .native import NativeBuild, NativeLoopBuild, make_native_build
from .python import PythonBuild
from .slots import SlotState

__all__ = ["HostBuild", "HostBuildChoice", "NativeBuild", "NativeLoopBuild", "Outcome",
           "PythonBuild", "SlotState", "Status", "StepResult", "HOST_BUILDS",
           "make_host_build", "make_native_build"]

#: the strategy names ``GuidedDecoder(host_build=...)`` accepts
HOST_BUILDS = ("auto", "python", "native-loop", "native")

HostBuildChoice = Union[Literal["auto", "python", "native-loop", "native"],
                        Callable[[SlotState, GrammarMatcherFactory, float], HostBuild]]


def make_host_build(choice: HostBuildChoice, slots: SlotState, factory: GrammarMatcherFactory,
                    budget_ms: float = 0.0, native_mode: str = "auto") -> HostBuild:
    """The strategy ``choice`` names, bound to ``slots``.

    ``native_mode`` (``GuidedDecodingConfig.native_build``) decides what ``"auto"`` does:
    ``"auto"`` takes the native strategy where it builds and warns once where the C++
    library does not (the Python build then runs, with the same results); ``"on"`` makes
    that an error; ``"off"`` takes the Python build.

    Raises:
        ConfigError: an unknown choice, or a native one for a factory it cannot serve.
        NativeBuildError: a native strategy was required and the library cannot be built.
    """
    if callable(choice):
        strategy = choice(slots, factory, budget_ms)
        if not isinstance(strategy, HostBuild):
            raise ConfigError(f"host_build callable returned {type(strategy).__name__}, not a "
                              "capgraph.build.HostBuild")
        return strategy
    if choice not in HOST_BUILDS:
        raise ConfigError(f"host_build={choice!r} is not one of {HOST_BUILDS} or a callable")
    if choice == "python" or (choice == "auto" and native_mode == "off"):
        return PythonBuild(slots, factory, budget_ms)
    if choice != "auto":
        return make_native_build(slots, factory, budget_ms, entry=choice == "native")
    try:
        return make_native_build(slots, factory, budget_ms)
    except ConfigError:
        if native_mode == "on":
            raise
    except NativeBuildError as e:
        if native_mode == "on":
            raise
        _warn_native_unavailable(str(e))
    return PythonBuild(slots, factory, budget_ms)


_native_warned = False


def _warn_native_unavailable(reason: str) -> None:
    """Say once per process that the Python build runs instead of the C++ one."""
    global _native_warned
    if not _native_warned:
        _native_warned = True
        warnings.warn(f"capgraph: the C++ host build is unavailable, the Python build runs "
                      f"instead (same results, slower per step at small batch; set "
                      f"GuidedDecodingConfig.native_build='off' or CAPGRAPH_NATIVE_BUILD=off "
                      f"to silence this): {reason}", RuntimeWarning, stacklevel=4)
