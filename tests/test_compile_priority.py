"""Background compiles run at the lowest CPU priority (capgraph/grammar/compile_pool.py).

A hand-over's xgrammar compile (``backend="auto"``) serves nobody while it runs: llguidance
serves the request meanwhile. On a machine with few cores it would otherwise take CPU time
from llguidance's compile and first mask, and from the decode loop.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import uuid

import pytest

from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph.grammar.compile_pool import BACKGROUND_NICE, CompilePool, run_lowered

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="per-thread nice values are a Linux feature (elsewhere compiles keep normal priority)")

TOKENIZER = "mistral-sp32k"


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_pool_lowers_only_the_heavy_part_of_a_background_job():
    """``submit(nice=19)``: the job's own thread keeps its priority (its Python work must not
    hold the GIL starved), what it runs through ``run_lowered`` runs at the lowest; a plain
    job runs it at normal priority, and so does a caller outside the pool."""
    pool = CompilePool(2)
    base = _own_nice()

    def job():
        return _own_nice(), run_lowered(_own_nice)

    assert pool.submit(job, nice=BACKGROUND_NICE).result(10) == \
        (base, min(19, base + BACKGROUND_NICE))
    assert pool.submit(job).result(10) == (base, base)
    assert run_lowered(_own_nice) == base
    with pytest.raises(ZeroDivisionError):  # an error of the lowered part reaches the job
        pool.submit(lambda: run_lowered(lambda: 1 // 0), nice=BACKGROUND_NICE).result(10)


def test_a_compile_never_waits_for_background_slots():
    """Background jobs hold background slots of their own: with every one of them taken (and
    more background jobs waiting), a plain job starts at once and a background job waits for
    a background slot, not for the plain ones."""
    pool = CompilePool(1)  # (one background slot: as many as plain ones)
    release = threading.Event()
    started = threading.Event()

    def held():
        started.set()
        release.wait(30)
        return "background"

    try:
        first = pool.submit(held, nice=BACKGROUND_NICE)
        assert started.wait(10)
        queued = pool.submit(lambda: "queued", nice=BACKGROUND_NICE)
        assert pool.submit(lambda: "foreground").result(5) == "foreground"
        assert (pool.running_background, queued.done()) == (1, False)
        release.set()
        assert (first.result(10), queued.result(10)) == ("background", "queued")
    finally:
        release.set()
    assert pool.wait_idle(10)


def test_each_kind_has_its_own_waiting_bound():
    """``max_waiting`` bounds each kind apart: background compiles waiting in full do not
    refuse a plain one."""
    from capgraph.errors import CompileQueueFullError
    pool = CompilePool(1, max_waiting=1)
    release = threading.Event()
    held = []
    try:
        held.append(pool.submit(lambda: release.wait(30), nice=BACKGROUND_NICE))
        deadline = time.monotonic() + 10
        while pool.running < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        held.append(pool.submit(lambda: release.wait(30), nice=BACKGROUND_NICE))
        with pytest.raises(CompileQueueFullError, match="background"):
            pool.submit(lambda: None, nice=BACKGROUND_NICE)
        assert pool.submit(lambda: "foreground").result(5) == "foreground"
    finally:
        release.set()
    assert all(f.result(10) for f in held)


class _RecordingCompiler:
    """xgrammar's GrammarCompiler, recording the nice value of the thread of each compile."""

    def __init__(self, compiler, seen: list[int], delay_s: float) -> None:
        self._compiler, self._seen, self._delay_s = compiler, seen, delay_s

    def __getattr__(self, name):
        method = getattr(self._compiler, name)
        if not name.startswith("compile_"):
            return method

        def compile_recorded(*args, **kwargs):
            self._seen.append(_own_nice())
            time.sleep(self._delay_s)  # (slow: llguidance lands first, a hand-over guide)
            return method(*args, **kwargs)
        return compile_recorded


def test_hand_over_compiles_xgrammar_in_the_background(tokenizer_cache, factory_cache,
                                                       monkeypatch):
    """A hand-over guide: xgrammar's C++ compile runs at the lowest priority while
    llguidance's compile (the one the request waits for) and xgrammar's Python part run at
    normal priority; an xgrammar-only guide (EBNF) compiles at normal priority."""
    pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    from capgraph.grammar.handover import HandOverMatcherFactory

    tok = tokenizer_cache(TOKENIZER)
    xgr, llg = factory_cache(TOKENIZER, "xgrammar"), factory_cache(TOKENIZER, "llguidance")
    compiled_at: list[int] = []
    monkeypatch.setattr(xgr, "_compiler", _RecordingCompiler(xgr._compiler, compiled_at, 0.2))
    python_at: dict[str, list[int]] = {"xgrammar": [], "llguidance": []}
    for name, side in (("xgrammar", xgr), ("llguidance", llg)):
        def recording(params, _compile=side._compile, _name=name):
            python_at[_name].append(_own_nice())
            return _compile(params)
        monkeypatch.setattr(side, "_compile", recording)
    factory = HandOverMatcherFactory(
        GuidedDecodingConfig.from_tokenizer(tok, backend="auto"), xgr, llg)
    base = _own_nice()
    # a guide neither side has compiled (nor cached on disk): unique per run
    params = GuidedDecodingParams.regex(f"id-{uuid.uuid4().hex}-[0-9]{{1,4}}")
    compiled = factory.compile_async(params).result(30, backend="auto")
    assert compiled.backend == "auto"
    compiled.payload.xgrammar.result(30, backend="xgrammar")
    assert python_at == {"xgrammar": [base], "llguidance": [base]}
    assert compiled_at == [min(19, base + BACKGROUND_NICE)]

    compiled_at.clear()
    ebnf = GuidedDecodingParams.ebnf(f'root ::= "{uuid.uuid4().hex}" [0-9]+')
    factory.compile_async(ebnf).result(30, backend="auto")
    assert compiled_at == [base]
