"""Helpers for graph-capture regression tests: call them from your own test suite.

* :func:`compare_eager_and_replay` runs a step function eagerly and, on a second instance,
  captured once and replayed, step by step, and reports where the outputs differ.
* :func:`record_host_callbacks` records the host callbacks that run (name, in order), eagerly
  or inside replays, so a test can pin the order of a step's host work.

On CUDA the capture is a ``torch.cuda.CUDAGraph`` (warm-up on a side stream first, as torch
requires). On CPU it is a :class:`hostfunc.HostGraph`, which records hostfunc callbacks only:
torch CPU ops inside the step run once, at capture, so on CPU the replayed part of a step is
its host callbacks (the capturable decoder's whole step is, the apply included).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterator, Protocol, Sequence

import torch

import hostfunc
import hostfunc.api

__all__ = ["StepHarness", "StepDiff", "ReplayReport", "compare_eager_and_replay",
           "record_host_callbacks"]


class StepHarness(Protocol):
    """One independent instance of the code under test (its own decoder, buffers, state).

    ``prepare(i)`` does the host-side work before step ``i`` (``add_batch``, copying inputs
    into static buffers); ``step()`` is the part that is captured; ``outputs()`` returns the
    tensors to compare after a step (they are cloned).

    Optional, used on CUDA when present: a ``decoder`` attribute (a capturable decoder: the
    warm-up runs inside its ``warmup()``); a ``generators`` attribute, the CUDA
    ``torch.Generator`` objects the step draws from (registered with the graph so that replays
    advance them, and their states restored after the warm-up); a ``reset()`` method, called
    after the warm-up to put back any other state the warm-up steps changed (sampled tokens,
    counters), so that the captured instance starts where the eager one does.
    """

    def prepare(self, step: int) -> None:
        """The host-side work before step ``step`` (``add_batch``, inputs into static buffers)."""

    def step(self) -> None:
        """The step itself: what is run eagerly, and captured and replayed."""

    def outputs(self) -> Sequence[torch.Tensor]:
        """The tensors to compare after a step (the harness clones them)."""


@dataclass(frozen=True)
class StepDiff:
    """Where step ``step`` differs: output ``index``, its largest absolute difference and the
    number of differing elements (NaNs compare equal to NaNs, -inf to -inf)."""

    step: int
    index: int
    max_abs_diff: float
    num_different: int


@dataclass
class ReplayReport:
    """What :func:`compare_eager_and_replay` saw: ``diffs`` is empty when every step matched."""

    steps: int
    diffs: list[StepDiff] = field(default_factory=list)

    @property
    def equal(self) -> bool:
        """True when no step's output differed."""
        return not self.diffs

    def assert_equal(self) -> None:
        """Raise AssertionError naming the first differing step and output."""
        if self.diffs:
            d = self.diffs[0]
            raise AssertionError(
                f"replayed step {d.step} differs from eager in output {d.index}: "
                f"{d.num_different} elements, max |diff| {d.max_abs_diff:g} "
                f"({len(self.diffs)} differing outputs over {self.steps} steps)")


def _compare(step: int, eager: Sequence[torch.Tensor], replayed: Sequence[torch.Tensor],
             atol: float) -> list[StepDiff]:
    if len(eager) != len(replayed):
        raise ValueError(f"step {step}: {len(eager)} eager outputs, {len(replayed)} replayed")
    diffs = []
    for i, (a, b) in enumerate(zip(eager, replayed)):
        a, b = a.detach().to("cpu"), b.detach().to("cpu")
        if a.shape != b.shape or a.dtype != b.dtype:
            diffs.append(StepDiff(step, i, float("inf"), max(a.numel(), b.numel())))
            continue
        if a.is_floating_point():
            same = (a == b) | (a.isnan() & b.isnan())
            if atol:
                same |= (a - b).abs() <= atol
            delta = (a.double() - b.double()).abs().nan_to_num(nan=0.0, posinf=float("inf"))
        else:
            same = a == b
            delta = (a.long() - b.long()).abs().double()
        bad = int((~same).sum())
        if bad:
            diffs.append(StepDiff(step, i, float(delta[~same].max()), bad))
    return diffs


def compare_eager_and_replay(make: Callable[[], StepHarness], num_steps: int, *,
                             device: torch.device | str = "cpu", warmup: int = 2,
                             atol: float = 0.0) -> ReplayReport:
    """Run ``num_steps`` steps on two instances from ``make()``: one eagerly, one captured once
    and replayed; compare their outputs after every step.

    Args:
        make: builds an independent :class:`StepHarness` (called twice).
        num_steps: steps to compare.
        device: ``"cuda"`` captures a ``torch.cuda.CUDAGraph``; ``"cpu"`` a ``HostGraph``.
        warmup: CUDA only: eager runs of ``step()`` on a side stream before capture (inside a
            capturable decoder's ``warmup()`` if the harness has a ``decoder`` attribute).
        atol: allowed absolute difference for floating outputs (default: bit-identical).

    Returns:
        A :class:`ReplayReport`; call ``assert_equal()`` on it in a test.
    """
    eager, graphed = make(), make()
    device = torch.device(device)
    graphed.prepare(0)  # shapes for the capture (a capturable decoder consumes this batch)
    graph = _capture(graphed, device, warmup)
    report = ReplayReport(num_steps)
    try:
        for i in range(num_steps):
            eager.prepare(i)
            eager.step()
            _sync(device)
            expect = [t.clone() for t in eager.outputs()]
            graphed.prepare(i)
            graph.replay()
            _sync(device)
            report.diffs += _compare(i, expect, [t.clone() for t in graphed.outputs()], atol)
    finally:
        graph.reset()
    return report


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    hostfunc.drain()


def _capture(harness: StepHarness, device: torch.device, warmup: int
             ) -> "hostfunc.HostGraph | torch.cuda.CUDAGraph":
    if device.type != "cuda":
        host_graph = hostfunc.HostGraph()
        with hostfunc.capture(host_graph):
            harness.step()
        return host_graph
    decoder = getattr(harness, "decoder", None)
    warmup_fn = getattr(decoder, "warmup", None)
    warm = warmup_fn() if warmup_fn is not None else nullcontext()
    generators = list(getattr(harness, "generators", ()))
    states = [g.get_state() for g in generators]
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side), warm:
        for _ in range(warmup):
            harness.step()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)
    for g, state in zip(generators, states):  # the warm-up's draws did not happen
        g.set_state(state)
    reset = getattr(harness, "reset", None)
    if reset is not None:
        reset()
    graph = torch.cuda.CUDAGraph()
    for g in generators:
        graph.register_generator_state(g)
    with torch.cuda.graph(graph):
        harness.step()
    return graph


@contextmanager
def record_host_callbacks() -> Iterator[list[str]]:
    """Record the name of every host callback launched inside the block, in the order they
    run (eager runs, and replays of graphs captured inside the block). Native host functions
    (:func:`hostfunc.launch_native`, such as the capturable decoder's native host node) run
    no Python and are not recorded; a decoder's ``host_node_stats`` counts its node's runs.

    Example::

        with record_host_callbacks() as names:
            decoder.add_batch(requests); decoder.execute(logits)
        assert names == ["host_step"]
    """
    names: list[str] = []
    lock = threading.Lock()

    def wrap(fn):
        name = getattr(fn, "__name__", repr(fn))

        def recorded(*a, **k):
            with lock:
                names.append(name)
            return fn(*a, **k)
        recorded.__name__ = name
        return recorded

    # at the launch itself, so hostfunc.launch and @hostfunc methods are both seen
    hostfunc.api.LAUNCH_WRAPPERS.append(wrap)
    try:
        yield names
    finally:
        hostfunc.api.LAUNCH_WRAPPERS.remove(wrap)
