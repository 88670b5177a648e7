"""Vocab masks of the SGLang backend: a ring of reusable host bitmasks, and the batched fill
through capgraph's C++ host build (:mod:`capgraph.build.library`).

SGLang asks for a fresh mask every step (``allocate_vocab_mask``), fills the rows of its
grammar requests (``fill_vocab_mask_batched``), copies the mask to the device
(``move_vocab_mask``) and applies it. Here a mask is a row slice of one of ``depth`` host
buffers taken in turn, each bound once to its own :class:`~capgraph.build.library.NativeBuilder`,
so a step allocates nothing and fills every row in one C++ call (xgrammar's FFI methods, no
Python between rows), which also checks each filled row for a dead end. A buffer is handed
out again only after the device copy made from it last time has completed (a CUDA event per
buffer), so a ``non_blocking`` copy never reads a buffer being refilled. A mask used on the
host, or copied other than through ``move_vocab_mask`` (SGLang's speculative path copies its
tree masks itself), must be done with before ``depth`` more masks are allocated: SGLang uses
each mask within its step and waits for that step's sampled tokens before the next.

Where the native build is not available (another grammar backend, ``native_build="off"``, no
compiler) the rows fill through the factory's ``batch_fill`` and the same dead-end check runs
in torch.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch

from ..bitmask import (allocate_host_bitmask, allocate_host_token_mask, rows_have_valid_token,
                       split_last_word, words_per_row)
from ..errors import ConfigError, NativeBuildError
from ..grammar import GrammarMatcher, GrammarMatcherFactory

__all__ = ["MaskRing", "DEFAULT_RING_DEPTH"]

_log = logging.getLogger(__name__)

#: Host buffers a backend cycles through (SGLang keeps at most one mask in flight per step,
#: two with its overlap scheduler).
DEFAULT_RING_DEPTH = 4
_STATUS_DEAD_END = 2  # capgraph.build.library.STATUS_DEAD_END, without importing the library
_STATUS_FAULT = 3


class _Slot:
    """One host buffer of the ring, its C++ builder (built lazily) and its pending copy."""

    __slots__ = ("bitmask", "bitmask_np", "token_mask", "builder", "copied")

    def __init__(self, rows: int, vocab_size: int) -> None:
        # bitmask: [rows, ceil(V/32)] int32 (pinned where CUDA is available)
        self.bitmask = allocate_host_bitmask(rows, vocab_size)
        # NumPy's fill of a few rows costs ~1 us where torch's intra-op threads can cost ms
        # while other threads hold the cores
        self.bitmask_np = self.bitmask.numpy()
        self.token_mask = allocate_host_token_mask(rows)  # the builder marks filled rows here
        self.builder: Any = None
        self.copied: Any = None  # CUDA event recorded after the last device copy, or None


class MaskRing:
    """The mask buffers of one backend and the batched fill into them.

    Args:
        factory: the backend's matcher factory (its config says whether the C++ build may run).
        vocab_size: width of SGLang's logits rows (the config's ``vocab_size_padded``).
        depth: buffers in the ring (>= 2).
    """

    def __init__(self, factory: GrammarMatcherFactory, vocab_size: int,
                 depth: int = DEFAULT_RING_DEPTH) -> None:
        if type(depth) is not int or depth < 2:
            raise ConfigError(f"MaskRing depth={depth!r}: expected an int >= 2")
        self.factory = factory
        self.vocab_size = vocab_size
        self.words = words_per_row(vocab_size)
        self._slots: list[_Slot | None] = [None] * depth
        self._by_address: dict[int, _Slot] = {}  # buffer address -> its slot
        self._next = 0
        self._lock = threading.Lock()
        self._native: Callable[[_Slot], Any] | None = self._native_maker()

    @property
    def native(self) -> bool:
        """Whether batched fills run in capgraph's C++ host build."""
        return self._native is not None

    def _native_maker(self) -> Callable[[_Slot], Any] | None:
        """A function binding a :class:`NativeBuilder` to a slot, or None where the factory's
        config or the machine rules the C++ build out (``native_build="on"``: an error)."""
        from ..build import library
        from ..build.library import NativeBuilder, matcher_methods
        from ..build.native import xgrammar_factory

        config = self.factory.config
        if config.native_build == "off":
            return None
        xgr_factory = xgrammar_factory(self.factory)
        if xgr_factory is None or config.fill_threads != 1:
            if config.native_build == "on":
                raise ConfigError("GuidedDecodingConfig.native_build='on' needs the xgrammar "
                                  "backend with fill_threads=1 for SGLang's batched fill")
            return None
        try:
            methods = matcher_methods(xgr_factory.ffi_matcher_type())
            library.load()  # (compiles on the machine's first use, then cached on disk)
        except NativeBuildError as e:
            if config.native_build == "on":
                raise
            _log.warning("capgraph: SGLang's batched mask fill runs through xgrammar's batch "
                         "matcher, not capgraph's C++ build: %s", e)
            return None
        full_words, tail_mask = split_last_word(self.vocab_size)
        tokenizer_vocab = config.tokenizer_vocab_size
        tail = (tokenizer_vocab // 32, tokenizer_vocab % 32) \
            if tokenizer_vocab < 32 * words_per_row(self.vocab_size) else None
        stops = list(config.stop_token_ids or ())

        threads = config.native_fill_threads or library.automatic_fill_threads()

        def bind(slot: _Slot) -> Any:
            builder = NativeBuilder(methods, slot.bitmask, slot.token_mask,
                                    slot.bitmask.shape[0], stops, full_words, tail_mask, tail)
            if xgr_factory.utf8 is not None:  # (the matchers' UTF-8 guards)
                builder.set_utf8(xgr_factory.utf8)
            # a large batch's rows on the fill pool, as the decoders' native build fills them
            builder.set_fill_threads(threads, library.POOL_MIN_REQUESTS)
            return builder
        return bind

    def allocate(self, batch_size: int) -> torch.Tensor:
        """The next buffer's first ``batch_size`` rows, every bit set (no row constrained)."""
        if type(batch_size) is not int or batch_size < 1:
            raise ValueError(f"allocate_vocab_mask: batch_size must be an int >= 1, got "
                             f"{batch_size!r}")
        with self._lock:
            i = self._next
            self._next = (i + 1) % len(self._slots)
            slot = self._slots[i]
            if slot is None or slot.bitmask.shape[0] < batch_size:
                if slot is not None:
                    del self._by_address[slot.bitmask.data_ptr()]
                rows = batch_size if slot is None else max(batch_size, 2 * slot.bitmask.shape[0])
                slot = self._slots[i] = _Slot(rows, self.vocab_size)
                self._by_address[slot.bitmask.data_ptr()] = slot
            elif slot.copied is not None:
                slot.copied.synchronize()  # (returns at once where the copy is done)
            slot.copied = None
        slot.bitmask_np[:batch_size].fill(-1)
        return slot.bitmask[:batch_size]

    def _slot_of(self, mask: torch.Tensor) -> _Slot | None:
        """The slot whose buffer ``mask`` starts at (a ring mask), else None."""
        slot = self._by_address.get(mask.data_ptr())
        if slot is None or mask.device.type != "cpu" or not mask.is_contiguous():
            return None
        return slot

    def fill(self, matchers: Sequence[GrammarMatcher], handles: list | None,
             rows: Sequence[int], mask: torch.Tensor
             ) -> tuple[list[int], list[tuple[int, Exception]]]:
        """Fill ``mask[rows[i]]`` from ``matchers[i]``.

        Returns ``(dead, failed)``: the positions ``i`` whose row allows no token at all (a
        dead end; the row is left as filled), and ``(i, error)`` for each matcher whose fill
        raised (its row is left in an unspecified state for the caller to overwrite). A
        failing matcher never stops the other rows from filling.

        ``handles``: the xgrammar FFI object of every matcher
        (``XGrammarMatcher.native_handle()``), or None where some matcher has none; with them
        a ring mask fills in the C++ build.
        """
        if not matchers:
            return [], []
        if mask.dim() != 2 or mask.shape[1] != self.words or mask.dtype != torch.int32:
            raise ValueError(f"fill_vocab_mask_batched: the mask is {mask.dtype} of shape "
                             f"{tuple(mask.shape)}, expected int32 [rows, {self.words}]")
        if handles is not None and self._native is not None:
            slot = self._slot_of(mask)
            if slot is not None:
                return self._fill_native(slot, handles, rows)
        failed: list[tuple[int, Exception]] = []
        try:
            self.factory.batch_fill(matchers, mask, rows)
        except Exception:
            # one matcher's failure (llguidance's sticky error, say) stopped the batch: each
            # row alone, so that only the failing ones are reported
            for k, (matcher, row) in enumerate(zip(matchers, rows)):
                try:
                    matcher.fill_next_token_bitmask(mask, row)
                except Exception as e:
                    failed.append((k, e))
        bad = {k for k, _ in failed}
        checked = [k for k in range(len(rows)) if k not in bad]
        if not checked:
            return [], failed
        index = torch.tensor([rows[k] for k in checked], dtype=torch.long)
        valid = rows_have_valid_token(mask.index_select(0, index), self.vocab_size)
        return [k for k, ok in zip(checked, valid.tolist()) if not ok], failed

    def _fill_native(self, slot: _Slot, handles: list, rows: Sequence[int]
                     ) -> tuple[list[int], list[tuple[int, Exception]]]:
        assert self._native is not None
        if slot.builder is None:
            slot.builder = self._native(slot)
        builder = slot.builder
        n = len(handles)
        if builder.out.shape[0] < n:  # (a ring mask has at most the buffer's rows)
            raise ValueError(f"fill_vocab_mask_batched: {n} rows exceed the mask's "
                             f"{builder.out.shape[0]}")
        unusual = builder.step(handles, [-1] * n, rows, (), (), 0, 0)
        if not unusual:
            return [], []
        out = builder.out[:n]
        faults = [k for k in range(n) if out[k, 0] == _STATUS_FAULT]
        failed: list[tuple[int, Exception]] = []
        if faults:
            messages = builder.errors()
            if len(messages) != len(faults):  # (no budget is set: one message per fault)
                messages = [messages[0] if messages else "native build fault"] * len(faults)
            failed = [(k, RuntimeError(f"capgraph: filling mask row {rows[k]} failed: {m}"))
                      for k, m in zip(faults, messages)]
        return [k for k in range(n) if out[k, 0] == _STATUS_DEAD_END], failed

    def copied(self, mask: torch.Tensor, device: torch.device) -> None:
        """Record that a copy of the ring mask ``mask`` to the CUDA ``device`` was just enqueued
        (on that device's current stream, where torch enqueues it): its buffer is not handed
        out again before that copy completes."""
        slot = self._slot_of(mask)
        if slot is not None:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(device))
            slot.copied = event
