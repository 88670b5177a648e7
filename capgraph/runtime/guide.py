"""How the loop drives a guided decoder each step, and where its stage times come from.

:class:`GuideDriver` turns the loop's sequences into :class:`~capgraph.requests.GuidedRequest`
snapshots and runs one decoder protocol per step:

* eager :class:`~capgraph.decoder.GuidedDecoder`: ``add_batch`` -> (speculative)
  ``rollback_rejected_tokens`` -> ``execute(logits)``, failures returned by ``execute``;
* capturable decoder: ``add_batch`` -> (speculative) ``rollback_rejected_batch(accepted + 1)``
  (stream callbacks) -> ``prepare()`` before the forward (the host build is enqueued first,
  so it overlaps the forward; a captured step records ``record_tokens_ready()`` and then
  calls ``prepare(rows)`` inside the graph) -> ``execute(logits)`` after the forward ->
  ``take_failed_requests()``.

:class:`StageClock` accumulates wall time per stage; :meth:`StageClock.instrument` wraps a
decoder instance's build and apply methods (the ones its NVTX ranges cover) to time them.
"""

from __future__ import annotations

import functools
import operator
import time
from contextlib import contextmanager
from typing import Iterator, Sequence, TypeGuard

import torch

import hostfunc

from ..capturable import CapturableGuidedDecoder
from ..decoder import FailedRequest, GuidedDecoder
from ..errors import LayoutError
from ..requests import GuidedRequest
from .scheduler import Sequence as Seq

__all__ = ["GuideDriver", "StageClock", "is_capturable"]


def is_capturable(decoder: GuidedDecoder) -> TypeGuard[CapturableGuidedDecoder]:
    """Whether ``decoder`` follows the capturable protocol (``execute`` returns nothing)."""
    return isinstance(decoder, CapturableGuidedDecoder)


class StageClock:
    """Seconds spent per named stage (``forward``, ``build``, ``apply``, ``sample``, ...).

    On CUDA, ``sync=True`` synchronises the device at the end of each block timed with
    :meth:`time` so that asynchronous work is charged to the stage that launched it; never
    while a graph is being captured.
    """

    def __init__(self, device: torch.device, sync: bool = False) -> None:
        self.seconds: dict[str, float] = {}
        self._sync = sync and device.type == "cuda"
        self._device = device

    def add(self, stage: str, seconds: float) -> None:
        """Charge ``seconds`` to ``stage``."""
        self.seconds[stage] = self.seconds.get(stage, 0.0) + seconds

    @contextmanager
    def time(self, stage: str, sync: bool = True) -> Iterator[None]:
        """Charge the block's wall time to ``stage`` (see the class for ``sync``)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if sync and self._sync and not torch.cuda.is_current_stream_capturing():
                torch.cuda.synchronize(self._device)
            self.add(stage, time.perf_counter() - t0)

    def instrument(self, decoder: GuidedDecoder, sync: bool = True) -> None:
        """Time this decoder's host build and its mask application, in place or fused with the
        greedy argmax (instance-level wrappers).

        Pass ``sync=False`` for a decoder whose methods run inside host callbacks, where a
        device synchronisation is not allowed; its apply time is then the launch time only.
        """
        for name, stage in (("_build", "build"), ("apply_bitmask", "apply"),
                            ("argmax_bitmask", "apply")):
            method = getattr(decoder, name, None)
            if method is None or getattr(method, "_capgraph_timed", False):
                continue

            def timed(*args, _method=method, _stage=stage, **kwargs):
                with self.time(_stage, sync=sync and _stage == "apply"):
                    return _method(*args, **kwargs)
            functools.update_wrapper(timed, method)
            timed._capgraph_timed = True  # type: ignore[attr-defined]
            setattr(decoder, name, timed)


class GuideDriver:
    """Runs one guided decoder through the loop's context and decode steps.

    Args:
        decoder: an eager or capturable guided decoder with ``max_num_sequences`` >= the
            loop's slots and ``max_num_draft_tokens`` = the loop's draft length.
        num_draft_tokens: drafts per sequence per decode step (0 without speculation).
    """

    def __init__(self, decoder: GuidedDecoder, num_draft_tokens: int) -> None:
        self.decoder = decoder
        self.num_draft_tokens = num_draft_tokens
        # the same decoder, typed for the capturable protocol's calls (None if eager)
        self._capt = decoder if is_capturable(decoder) else None
        self._failed: list[FailedRequest] = []
        # the latest batch's decode step, where it was one without drafts on the capturable
        # decoder: (its sequences, its padded size); the next step of the same sequences is
        # queued with advance_batch
        self._last_decode: tuple[list[Seq], int | None] | None = None

    @property
    def capturable(self) -> bool:
        """Whether the decoder follows the capturable protocol."""
        return self._capt is not None

    # -- the two kinds of step ---------------------------------------------------------------
    def begin_context(self, seqs: Sequence[Seq]) -> None:
        """Snapshots of sequences whose prompt was just prefilled (1 logits row each)."""
        reqs = [GuidedRequest.context(s.index, s.seq_slot, s.guide) for s in seqs]
        self._begin(reqs, self.num_draft_tokens, speculative=False)

    def begin_decode(self, seqs: Sequence[Seq], drafts: Sequence[Sequence[int]] | None,
                     pad_to: int | None = None) -> None:
        """Snapshots of a decode step: the newest token, this step's drafts, and how many
        drafts the previous verification accepted. ``pad_to`` adds unguided placeholder
        requests so the layout matches a padded (graph) batch. Without drafts, on the
        capturable decoder, the same sequences as the latest decode step (same objects, same
        order, same padding) are queued with ``advance_batch``: their newest tokens alone."""
        K = self.num_draft_tokens
        last, self._last_decode = self._last_decode, None
        if last is not None and last[1] == pad_to and len(last[0]) == len(seqs) \
                and all(map(operator.is_, last[0], seqs)):
            # the same sequences as the latest step: each advanced by its newest token, with
            # no request object per row (placeholders read no token)
            tokens = [s.output[-1] for s in seqs]
            if pad_to is not None and pad_to > len(seqs):
                tokens += [0] * (pad_to - len(seqs))
            capt = self._capt
            assert capt is not None
            try:
                capt.advance_batch(tokens)
            except LayoutError:  # (a failure or a release since: the batch is made below)
                pass
            else:
                self._last_decode = last
                if pad_to is None:
                    capt.prepare()
                return
        chains = drafts if K and drafts is not None else None
        # (positional: GuidedRequest.generation's fields, without its keyword handling; the
        # lists are new, and the decoder takes the requests over)
        reqs = [GuidedRequest(s.guide, s.index, s.seq_slot, None, False, False, True, False,
                              s.output[-1], False, [] if chains is None else list(chains[i]),
                              s.accepted_prev) for i, s in enumerate(seqs)]
        reqs += self._placeholders(len(seqs), pad_to or 0)
        self._begin(reqs, K, speculative=K > 0, graphed=pad_to is not None)
        if self._capt is not None and not K:
            self._last_decode = (list(seqs), pad_to)

    def begin_capture(self, batch_size: int) -> None:
        """Queue a batch of ``batch_size`` unguided placeholders for a graph capture to consume
        (the capture needs only its shapes)."""
        self._last_decode = None
        self.decoder.add_batch(self._placeholders(0, batch_size),
                               runtime_draft_len=self.num_draft_tokens)

    def _placeholders(self, start: int, stop: int) -> list[GuidedRequest]:
        return [GuidedRequest.placeholder(-1 - i, self.num_draft_tokens)
                for i in range(start, stop)]

    def _begin(self, reqs: list[GuidedRequest], draft_len: int, speculative: bool,
               graphed: bool = False) -> None:
        dec = self.decoder
        self._last_decode = None
        if self._capt is not None:  # (the requests are this driver's own, made for this call)
            self._capt.add_batch(reqs, runtime_draft_len=draft_len, copy=False)
        else:
            dec.add_batch(reqs, runtime_draft_len=draft_len)
        if speculative:
            # settle the previous verification before this step's build advances the matchers
            if self._capt is not None:
                accepted = [(r.num_accepted_draft_tokens or 0) + 1 for r in reqs]  # bonus too
                self._capt.rollback_rejected_batch(torch.tensor(accepted, dtype=torch.int32))
            else:
                dec.rollback_rejected_tokens()
        if self._capt is not None and not graphed:
            self._capt.prepare()  # enqueue the host build now, so it overlaps the forward

    def tokens_ready(self) -> None:
        """Inside a captured step, before the forward: each replay's callbacks wait for the
        tokens copied before it (capturable decoder only)."""
        if self._capt is not None:
            self._capt.record_tokens_ready()

    def prepare(self, rows: int) -> None:
        """Inside a captured step, after :meth:`tokens_ready` and before the forward: enqueue
        the step's host work (its host node and bitmask copy) for ``rows`` logits rows now, so
        the graph holds them ahead of the forward's kernels (capturable decoder only)."""
        if self._capt is not None:
            self._capt.prepare(rows)

    def apply(self, logits: torch.Tensor) -> None:
        """Mask ``logits`` (one row per layout row) in place; safe in a capture if capturable."""
        failed = self.decoder.execute(logits)
        if failed:
            self._failed.extend(failed)

    def apply_argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of ``logits`` under the step's mask, ``[rows]`` int64, the logits left
        unmasked (the decoder's ``execute_argmax``; the capturable decoder's is safe in a
        capture)."""
        if self._capt is not None:
            return self._capt.execute_argmax(logits)
        tokens, failed = self.decoder.execute_argmax(logits)
        if failed:
            self._failed.extend(failed)
        return tokens

    def take_failed(self) -> list[FailedRequest]:
        """Requests that failed since the last call (call after the step has synchronised).

        With the capturable decoder this is also where a host callback's exception from this
        step's graph replay is re-raised (``hostfunc.HostFuncError``): nothing else in a
        replayed step reaches a drain, and a pending error would otherwise surface at a later,
        unrelated one.
        """
        if self._capt is not None:
            hostfunc.check_errors()
        failed, self._failed = self._failed, []
        if self._capt is not None:
            failed.extend(self._capt.take_failed_requests())
        return [(rid, msg) for rid, msg in failed if rid >= 0]

    def release(self, slot: int) -> None:
        """A sequence left ``slot``: forget its matcher."""
        self.decoder.release(slot)

    def close(self) -> None:
        """Release the decoder (a shared matcher factory stays open for its owner)."""
        self.decoder.close()