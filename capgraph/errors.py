"""Named exceptions of capgraph.

Every error carries the context a user needs to find the culprit: the request id, the guide
type and the backend where they apply. All derive from :class:`CapgraphError`; those caused by
a bad argument also derive from :class:`ValueError`, so generic handlers keep working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CapgraphError",
    "ConfigError",
    "GrammarCompileError",
    "UnsupportedGuideError",
    "CompileTimeoutError",
    "CompileResourceError",
    "CompileQueueFullError",
    "TRANSIENT_COMPILE_ERRORS",
    "MatcherError",
    "DeadEndError",
    "RequestError",
    "LayoutError",
    "TensorArgError",
    "TokenizerLoadError",
    "QueueEpochError",
    "CallbackError",
    "NativeBuildError",
    "BudgetExceededError",
    "DecoderClosedError",
]


class CapgraphError(Exception):
    """Base class of every error capgraph raises on purpose."""


def _context(**fields: Any) -> str:
    parts = [f"{k}={v!r}" for k, v in fields.items() if v is not None]
    return f" [{', '.join(parts)}]" if parts else ""


class ConfigError(CapgraphError, ValueError):
    """A configuration value is invalid (names the field and the value received)."""


class GrammarCompileError(CapgraphError, ValueError):
    """A guide could not be compiled into a grammar by the backend.

    Attributes:
        guide_type: the :class:`~capgraph.params.GuideType` name of the guide.
        backend: ``"xgrammar"`` or ``"llguidance"``.
        detail: the backend's own message.
        request_id: the request that asked for it, when known.
    """

    def __init__(
        self,
        detail: str,
        *,
        guide_type: str | None = None,
        backend: str | None = None,
        request_id: int | None = None,
    ) -> None:
        self.detail = detail
        self.guide_type = guide_type
        self.backend = backend
        self.request_id = request_id
        super().__init__(
            f"cannot compile {guide_type or 'guide'} with {backend or 'backend'}: {detail}"
            + _context(request_id=request_id)
        )


class UnsupportedGuideError(GrammarCompileError):
    """The backend does not support this guide type (or this guide's features)."""


class CompileTimeoutError(GrammarCompileError):
    """Grammar compilation did not finish within the configured timeout."""


class CompileResourceError(GrammarCompileError):
    """A compile worker process went over its memory limit
    (``GuidedDecodingConfig.compile_memory_limit_bytes``) or died while compiling."""


class CompileQueueFullError(GrammarCompileError):
    """Too many compiles already wait for a compile worker; this one was refused at once
    rather than queued (``compile_isolation="process"``)."""


#: Compile failures that say nothing about the guide (a later compile of it may succeed): a
#: cache of outcomes must not keep them.
TRANSIENT_COMPILE_ERRORS = (CompileTimeoutError, CompileQueueFullError, CompileResourceError)


class MatcherError(CapgraphError, RuntimeError):
    """A grammar matcher entered an error state (llguidance's sticky error, for example)."""

    def __init__(self, detail: str, *, backend: str | None = None,
                 request_id: int | None = None) -> None:
        self.detail = detail
        self.backend = backend
        self.request_id = request_id
        super().__init__(f"{backend or 'matcher'} error: {detail}"
                         + _context(request_id=request_id))


class DeadEndError(CapgraphError, RuntimeError):
    """A grammar state allows no token at all (masking it would produce an all -inf row)."""


class RequestError(CapgraphError, ValueError):
    """One request of a batch is malformed (token id out of range, slot out of range, ...)."""

    def __init__(self, detail: str, *, request_id: int | None = None,
                 seq_slot: int | None = None) -> None:
        self.detail = detail
        self.request_id = request_id
        self.seq_slot = seq_slot
        super().__init__(detail + _context(request_id=request_id, seq_slot=seq_slot))


class LayoutError(CapgraphError, ValueError):
    """A batch does not fit the decoder's preallocated layout (too many rows, sequences, drafts)."""


class TensorArgError(CapgraphError, ValueError):
    """A tensor argument has the wrong dtype, shape, stride or device; names the argument."""


class TokenizerLoadError(CapgraphError, RuntimeError):
    """A bundled or local tokenizer could not be loaded or converted."""


class QueueEpochError(CapgraphError, RuntimeError):
    """A step out of step with its ``add_batch``: on the capturable decoder a host callback found
    a replay without its ``add_batch`` (missing put) or batches queued before its own that had
    no step (extra put), and that step masks nothing, or ``add_batch`` found too many batches
    queued (refused, nothing queued); on the eager decoder a second ``execute`` or ``build`` for
    one ``add_batch``, refused before any matcher moves."""


class CallbackError(CapgraphError, RuntimeError):
    """A decoder host callback raised; ``request_ids`` are the requests of the affected batch."""

    def __init__(self, detail: str, *, callback: str, request_ids: list[int]) -> None:
        self.detail = detail
        self.callback = callback
        self.request_ids = list(request_ids)
        super().__init__(f"{callback} failed: {detail} [request_ids={self.request_ids}]")


class NativeBuildError(CapgraphError, RuntimeError):
    """A native library of ``csrc/`` (the C++ host build, the CPU mask; :mod:`capgraph.jit`)
    could not be compiled or loaded; the message says which step and, for a compile, shows
    the compiler's own output."""


class BudgetExceededError(CapgraphError, RuntimeError):
    """One request's host step (accept and fill) took longer than
    ``GuidedDecodingConfig.host_step_budget_ms``, in wall time and in its thread's CPU time;
    the request fails alone and its matcher is dropped, so it cannot slow another step.

    Attributes:
        request_id: the request, when known.
        seq_slot: its sequence slot.
        elapsed_ms: the wall-clock milliseconds measured for its part of the step.
        budget_ms: the budget it exceeded.
    """

    def __init__(self, *, request_id: int | None, seq_slot: int | None, elapsed_ms: float,
                 budget_ms: float) -> None:
        self.request_id = request_id
        self.seq_slot = seq_slot
        self.elapsed_ms = elapsed_ms
        self.budget_ms = budget_ms
        super().__init__(f"host step took {elapsed_ms:.1f} ms, over the "
                         f"{budget_ms:g} ms budget (GuidedDecodingConfig.host_step_budget_ms)"
                         + _context(request_id=request_id, seq_slot=seq_slot))


class DecoderClosedError(CapgraphError, RuntimeError):
    """A decoder was used after its ``close()``: a step method (``add_batch``, ``execute``,
    a rollback, ``release``, ``forced_tokens``, ...) is refused before it reads or changes
    anything (no matcher moves, nothing is queued, no compile starts). ``close()`` itself may
    be called again (it does nothing more); ``take_failed_requests()`` still returns the
    failures recorded before the close. Build a new decoder to decode again."""
