"""close() on both decoders: what a closed decoder answers, what close() waits for, and a
process that uses decoders after close() and exits right after closing them.

After ``close()`` every step method raises :class:`~capgraph.errors.DecoderClosedError` before
it reads or changes anything; ``close()`` is idempotent, works on a decoder that never ran a
step, waits for a step method running on another thread, and waits for the compiles the
decoder started that no build took (a compile thread still inside xgrammar when the
interpreter exits aborts the process: "terminate called without an active exception").
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from capgraph import (CapgraphError, DecoderClosedError, GuidedDecodingConfig,
                      GuidedDecodingParams)
from capgraph.capturable import CapturableGuidedDecoder
from capgraph.decoder import GuidedDecoder
from capgraph.grammar import create_matcher_factory
from capgraph.requests import GuidedRequest

KINDS = ["eager", "capturable"]
V = 64
A, B = 0, 1  # token ids of "a" and "b" in the vocabulary below
ABC = GuidedDecodingParams.regex("[a-c]+")


@pytest.fixture(scope="module")
def config() -> GuidedDecodingConfig:
    vocab = [chr(97 + i) for i in range(26)] + ["</s>"]
    return GuidedDecodingConfig(encoded_vocab=vocab, stop_token_ids=[26], vocab_size_padded=V)


@pytest.fixture(scope="module")
def factory(config):
    made = create_matcher_factory(config)
    yield made
    made.close()


def _decoder(kind: str, factory, drafts: int = 0) -> GuidedDecoder:
    cls = GuidedDecoder if kind == "eager" else CapturableGuidedDecoder
    return cls(factory.config, 4, drafts, factory=factory)


def _step(dec: GuidedDecoder, requests, logits: torch.Tensor) -> list:
    if isinstance(dec, CapturableGuidedDecoder):
        dec.add_batch(requests, runtime_draft_len=0)
        dec.execute(logits)
        return dec.take_failed_requests()
    dec.add_batch(requests, 0)
    return dec.execute(logits)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


NEW = GuidedDecodingParams.regex("[a-z]{3}")  # a guide no step has compiled

# every step method, as (name, call); each must be refused on a closed decoder
COMMON = [
    ("add_batch new guide", lambda d: d.add_batch([GuidedRequest.context(2, 1, NEW)])),
    ("add_batch generation", lambda d: d.add_batch([GuidedRequest.generation(1, 0, ABC, A)])),
    ("execute", lambda d: d.execute(torch.zeros(1, V))),
    ("build", lambda d: d.build()),
    ("rollback_rejected_tokens", lambda d: d.rollback_rejected_tokens()),
    ("rollback_draft_tokens", lambda d: d.rollback_draft_tokens()),
    ("init_disagg_gen_requests", lambda d: d.init_disagg_gen_requests()),
    ("release", lambda d: d.release(0)),
    ("forced_tokens", lambda d: d.forced_tokens(0, 4)),
    ("forced_tokens_batch", lambda d: d.forced_tokens_batch([0], 4)),
]
CAPTURABLE = [
    ("prepare", lambda d: d.prepare()),
    ("add_draft_batch", lambda d: d.add_draft_batch(torch.zeros(1, dtype=torch.int32), None)),
    ("execute_draft_batch", lambda d: d.execute_draft_batch(torch.zeros(1, V))),
    ("rollback_rejected_batch",
     lambda d: d.rollback_rejected_batch(torch.ones(1, dtype=torch.int32))),
    ("discard_queued_batches", lambda d: d.discard_queued_batches()),
]


@pytest.mark.parametrize("kind", KINDS)
def test_every_step_method_after_close_is_a_named_error_and_changes_nothing(kind, factory):
    """After close(), each step method raises DecoderClosedError (a CapgraphError and a
    RuntimeError, naming the method) before it reads or changes anything: no matcher moves,
    no compile starts, nothing is queued, the logits stay as they were; the failures recorded
    before the close are still returned; close() again does nothing; another decoder on the
    same factory masks as a fresh one."""
    dec = _decoder(kind, factory, drafts=1)
    assert _step(dec, [GuidedRequest.context(1, 0, ABC)], torch.zeros(1, V)) == []
    assert _step(dec, [GuidedRequest.generation(1, 0, ABC, A)], torch.zeros(1, V)) == []
    dec._record_failed([(99, "recorded before the close")])
    dec.close()
    matcher = dec.grammar_matchers[0]
    state = (list(dec.num_advanced_tokens), dec.requests, dict(dec._pending_compiles),
             list(dec._admission.slot_guides), dec.num_active_matchers)
    queued = dec.queued_batches if kind == "capturable" else None
    calls = COMMON + (CAPTURABLE if kind == "capturable" else [])
    for name, call in calls:
        with pytest.raises(DecoderClosedError, match="closed") as info:
            call(dec)
        assert isinstance(info.value, CapgraphError) and isinstance(info.value, RuntimeError)
        method = name.split()[0]
        assert f"{type(dec).__name__}.{method}" in str(info.value), name
    logits = torch.zeros(1, V)
    with pytest.raises(DecoderClosedError):
        dec.execute(logits)
    assert torch.equal(logits, torch.zeros(1, V))  # untouched
    assert dec.grammar_matchers[0] is matcher
    assert (list(dec.num_advanced_tokens), dec.requests, dict(dec._pending_compiles),
            list(dec._admission.slot_guides), dec.num_active_matchers) == state
    if kind == "capturable":
        assert dec.queued_batches == queued
    assert dec.take_failed_requests() == [(99, "recorded before the close")]
    dec.close()  # idempotent
    dec.close()
    # the shared factory, and a decoder on it, are unaffected
    other, fresh = _decoder(kind, factory), _decoder(kind, factory)
    try:
        for requests, rows in ([GuidedRequest.context(5, 2, NEW)], 1), \
                ([GuidedRequest.generation(5, 2, NEW, B)], 1):
            got, want = torch.zeros(rows, V), torch.zeros(rows, V)
            assert _step(other, requests, got) == [] and _step(fresh, requests, want) == []
            assert _same(got, want) and torch.isneginf(got).any()
    finally:
        other.close()
        fresh.close()


@pytest.mark.parametrize("kind", KINDS)
def test_closing_a_decoder_that_never_ran_a_step_and_closing_twice(kind, config):
    """close() on a decoder that never ran a step (its own factory too) works, twice; the
    next add_batch is refused."""
    cls = GuidedDecoder if kind == "eager" else CapturableGuidedDecoder
    dec = cls(config, 2, 0)
    dec.close()
    dec.close()
    with pytest.raises(DecoderClosedError):
        dec.add_batch([GuidedRequest.context(1, 0, ABC)])
    assert dec.requests is None and dec.take_failed_requests() == []


@pytest.mark.parametrize("kind", KINDS)
def test_close_waits_for_a_step_running_on_another_thread(kind, factory):
    """close() called while another thread is inside execute() waits for that step to
    return (which then masks as usual); a step method called after it is refused."""
    dec = _decoder(kind, factory)
    _step(dec, [GuidedRequest.context(1, 0, ABC)], torch.zeros(1, V))
    inside, events = threading.Event(), []
    original = dec._build

    def slow_build(*args, **kwargs):
        inside.set()
        time.sleep(0.3)
        events.append("build")
        return original(*args, **kwargs)
    dec._build = slow_build  # type: ignore[method-assign]
    logits = torch.zeros(1, V)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            _step(dec, [GuidedRequest.generation(1, 0, ABC, A)], logits)
            events.append("step returned")
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)
    worker = threading.Thread(target=run)
    worker.start()
    assert inside.wait(10)
    dec.close()
    events.append("closed")
    worker.join(10)
    assert not errors and events == ["build", "step returned", "closed"]
    assert torch.isneginf(logits).any()  # the step masked
    with pytest.raises(DecoderClosedError):
        dec.add_batch([GuidedRequest.generation(1, 0, ABC, B)])


@pytest.mark.parametrize("kind", KINDS)
def test_close_waits_for_the_compiles_it_started(kind, config):
    """A compile started by add_batch whose step never ran is finished (or given up past its
    deadline) when close() returns: no compile thread of the decoder runs on."""
    factory = create_matcher_factory(config)
    original = factory._compile
    slow = GuidedDecodingParams.regex("[a-z]{4}")

    def compile_(params):
        if params.guide == slow.guide:
            time.sleep(0.4)
        return original(params)
    factory._compile = compile_
    dec = _decoder(kind, factory)
    try:
        dec.add_batch([GuidedRequest.context(1, 0, slow)])
        handle = dec._pending_compiles[0]
        assert not handle.done()
        dec.close()
        assert handle.done() and dec._pending_compiles == {}
    finally:
        dec.close()
        factory.close()


SCENARIO = textwrap.dedent("""
    import torch
    from capgraph import GuidedDecodingConfig, GuidedDecodingParams, DecoderClosedError
    from capgraph.capturable import CapturableGuidedDecoder
    from capgraph.decoder import GuidedDecoder
    from capgraph.requests import GuidedRequest as R
    torch.set_num_threads(1)
    V = 64
    config = GuidedDecodingConfig(encoded_vocab=[chr(97 + i) for i in range(26)] + ["</s>"],
                                  stop_token_ids=[26], vocab_size_padded=V, compile_threads=4)
    ABC = GuidedDecodingParams.regex("[a-c]+")
    kinds = [GuidedDecoder, CapturableGuidedDecoder]
    refused = 0
    for round in range(3):  # each decoder used after close()
        for cls in kinds:
            d = cls(config, 4, 0)
            d.add_batch([R.context(1, 0, ABC)])
            d.execute(torch.zeros(1, V))
            d.close()
            for call in (lambda: d.add_batch([R.context(2, 1, GuidedDecodingParams.regex(
                             f"[a-z]{{{round + 3}}}"))]),
                         lambda: d.execute(torch.zeros(1, V)), lambda: d.release(0)):
                try:
                    call()
                except DecoderClosedError:
                    refused += 1
                except Exception:
                    pass
            d.close()
    # closed with compiles in flight, then the interpreter exits at once
    closing = [cls(config, 4, 0) for cls in kinds]
    for k, d in enumerate(closing):
        d.add_batch([R.context(i, i, GuidedDecodingParams.regex(
            f"[a-z]{{1,{2000 + 10 * k + i}}}x")) for i in range(4)])
    for d in closing:
        d.close()
    print("refused", refused, "of", 3 * len(kinds) * 3, flush=True)
""")


def test_a_process_using_decoders_after_close_exits_cleanly():
    """A process that uses an eager and a capturable decoder after close() (three rounds),
    then closes two more right after starting compiles and exits at once: exit code 0 and no
    "terminate called" (a compile thread left inside xgrammar at interpreter exit aborted the
    process in about 3 runs in 4; the use after close started such compiles)."""
    env = dict(os.environ, CAPGRAPH_COMPILE_DISK_CACHE_BYTES="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    done = subprocess.run([sys.executable, "-c", SCENARIO], env=env, capture_output=True,
                          text=True, timeout=120)
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, (done.returncode, done.stdout[-1000:], done.stderr[-2000:])
    assert "refused 18 of 18" in done.stdout, done.stdout[-1000:]


def _run_python(code: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, CAPGRAPH_COMPILE_DISK_CACHE_BYTES="0")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_exit_waits_for_a_running_compile_and_cancels_one_not_started(tmp_path):
    """At interpreter exit a compile running on a pool's thread is waited for (its job ends:
    a marker written after a 1 s sleep exists), and one still waiting for a slot never
    starts."""
    done = _run_python(f"""
        import pathlib, time
        from capgraph.grammar.compile_pool import CompilePool
        root = pathlib.Path({str(tmp_path)!r})
        def job(name, sleep):
            def run():
                time.sleep(sleep)
                (root / name).write_text("done")
            return run
        pool = CompilePool(1)
        pool.submit(job("running", 1.0))
        while pool.running == 0:
            time.sleep(0.01)
        pool.submit(job("queued", 0.0))
    """)
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "running").exists(), done.stderr[-2000:]
    assert not (tmp_path / "queued").exists()
    assert "waiting up to 30 s for 1 grammar compile(s) still running" in done.stderr


def test_the_wait_at_exit_is_bounded_by_the_pools_exit_wait():
    """A compile that outlives ``exit_wait_s`` is waited for that long only, with a warning
    that says so."""
    done = _run_python("""
        import time
        from capgraph.grammar.compile_pool import CompilePool
        pool = CompilePool(1, exit_wait_s=0.5)
        pool.submit(lambda: time.sleep(60))
        while pool.running == 0:
            time.sleep(0.01)
        print("exit at", time.time(), flush=True)
    """)
    ended = time.time()
    assert done.returncode == 0, done.stderr[-2000:]
    started = float(done.stdout.split("exit at")[1])
    assert ended - started < 20, ended - started  # (60 s without the bound)
    assert "1 grammar compile(s) still running after 0 s" in done.stderr, done.stderr[-2000:]


def test_a_process_that_exits_while_the_factory_compiles_exits_cleanly():
    """Compiles started by the factory itself (``compile_async``, as the auto backend's
    background compiles are) and still inside xgrammar when the script ends: exit code 0, no
    "terminate called" (without the wait at exit about one run in two aborts)."""
    done = _run_python("""
        from capgraph import GuidedDecodingConfig, GuidedDecodingParams
        from capgraph.grammar import create_matcher_factory
        config = GuidedDecodingConfig(encoded_vocab=[chr(97 + i) for i in range(26)] + ["</s>"],
                                      stop_token_ids=[26], vocab_size_padded=64,
                                      compile_threads=2)
        factory = create_matcher_factory(config)
        for i in range(4):
            factory.compile_async(GuidedDecodingParams.regex(f"[a-z]{{1,{2000 + i}}}x"))
    """)
    assert "terminate called" not in done.stderr, done.stderr[-2000:]
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
