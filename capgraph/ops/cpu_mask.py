"""The CPU kernel of ``logits_bitmask`` in C++ (``csrc/cpu_mask.cc``): one pass over the logits.

The torch code (:mod:`capgraph.ops.torch_impl`) makes five passes; this library's
``apply_bitmask`` makes one, with AVX2 / AVX-512 clones where the CPU has them;
``apply_bitmask_indices`` is the same pass over chosen logits rows. It is a small
library of its own (tvm-ffi's headers only), built on first use through :mod:`capgraph.jit`
with the machine's C++ compiler and cached under ``$CAPGRAPH_CACHE_DIR/native``; nothing
compiles at import.

It is process-wide and follows only the environment variable ``CAPGRAPH_NATIVE_BUILD``: with
``off`` it is never built and :func:`cpu_apply` returns None (the torch code then runs).
"""

from __future__ import annotations

import threading
from typing import Any

from .. import jit
from ..errors import NativeBuildError
from ..params import native_build_env

__all__ = ["cpu_apply", "cpu_apply_indices", "load", "unavailable_reason"]

_LIBRARY = "cpu_mask"
_SOURCES = ("cpu_mask.cc",)

_lock = threading.Lock()
_module: Any = None
_error: NativeBuildError | None = None


def load() -> Any:
    """The loaded tvm-ffi module (built on the first call of the machine); raises
    :class:`NativeBuildError` where it cannot be built. A failure is remembered."""
    global _module, _error
    with _lock:
        if _module is not None:
            return _module
        if _error is not None:
            raise _error
        try:
            _module = jit.load_tvm_ffi_module(jit.build(jit.cxx_library(_LIBRARY, _SOURCES)))
        except NativeBuildError as e:
            _error = e
            raise
        return _module


def unavailable_reason() -> str | None:
    """None if :func:`load` succeeds, else why it does not (compiling if needed)."""
    return jit.unavailable_reason(load)


_cpu_apply: Any = None


def cpu_apply() -> Any:
    """The one-pass CPU mask, ``apply_bitmask(logits, bitmask, token_mask, col_offset)``
    (arguments checked by :func:`capgraph.ops.logits_bitmask`), or None where the library
    cannot be built or ``CAPGRAPH_NATIVE_BUILD=off`` (:func:`capgraph.ops.logits_bitmask` then
    runs its torch code; the decoder is the one that warns about a missing compiler)."""
    global _cpu_apply
    if _cpu_apply is None:  # decided once per process: this runs on every CPU mask
        if native_build_env() == "off":
            _cpu_apply = False
        else:
            try:
                _cpu_apply = load().apply_bitmask
            except NativeBuildError:
                _cpu_apply = False
    return _cpu_apply or None


_cpu_apply_indices: Any = None


def cpu_apply_indices() -> Any:
    """The one-pass CPU mask over chosen rows, ``apply_bitmask_indices(logits, bitmask,
    token_mask, col_offset, indices)`` (bitmask row ``i`` masks logits row ``indices[i]``;
    arguments, index range and distinctness checked by :func:`capgraph.ops.logits_bitmask`),
    or None where :func:`cpu_apply` is None."""
    global _cpu_apply_indices
    if _cpu_apply_indices is None:
        _cpu_apply_indices = cpu_apply() is not None and load().apply_bitmask_indices
    return _cpu_apply_indices or None
