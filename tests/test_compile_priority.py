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
from capgraph.grammar.compile_pool import BACKGROUND_NICE, CompilePool

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="per-thread nice values are a Linux feature (elsewhere compiles keep normal priority)")

TOKENIZER = "mistral-sp32k"


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


def test_pool_runs_a_background_job_at_lower_priority_and_others_at_normal():
    """``submit(nice=19)`` lowers only that job's thread; a plain job and the caller keep
    their priority."""
    pool = CompilePool(2)
    base = _own_nice()
    low = pool.submit(_own_nice, nice=BACKGROUND_NICE).result(10)
    plain = pool.submit(_own_nice).result(10)
    assert low == min(19, base + BACKGROUND_NICE)
    assert plain == base
    assert _own_nice() == base


def test_hand_over_compiles_xgrammar_in_the_background(tokenizer_cache, factory_cache,
                                                       monkeypatch):
    """A hand-over guide: xgrammar's compile thread runs at the lowest priority while
    llguidance's (the one the request waits for) runs at normal priority; an xgrammar-only
    guide (EBNF) compiles at normal priority."""
    pytest.importorskip("llguidance", reason="the llguidance extra is not installed")
    from capgraph.grammar.handover import HandOverMatcherFactory

    tok = tokenizer_cache(TOKENIZER)
    xgr, llg = factory_cache(TOKENIZER, "xgrammar"), factory_cache(TOKENIZER, "llguidance")
    seen: dict[str, list[int]] = {"xgrammar": [], "llguidance": []}
    for name, side in (("xgrammar", xgr), ("llguidance", llg)):
        def recording(params, _compile=side._compile, _name=name):
            seen[_name].append(_own_nice())
            if _name == "xgrammar":
                time.sleep(0.2)  # (a slow compile: llguidance lands first, a hand-over guide)
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
    assert seen["llguidance"] == [base]
    assert seen["xgrammar"] == [min(19, base + BACKGROUND_NICE)]

    seen["xgrammar"].clear()
    ebnf = GuidedDecodingParams.ebnf(f'root ::= "{uuid.uuid4().hex}" [0-9]+')
    factory.compile_async(ebnf).result(30, backend="auto")
    assert seen["xgrammar"] == [base]
