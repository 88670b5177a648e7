"""xgrammar compiles in spawned worker processes (``compile_isolation="process"``): killed at
their timeout, bounded in memory and in number, equal to in-thread compiles."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
import uuid

import pytest
import torch

from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph.errors import (CompileQueueFullError, CompileResourceError, CompileTimeoutError,
                             ConfigError, GrammarCompileError)
from capgraph.grammar import create_matcher_factory
from capgraph.tokenizers import encode_continuation
from cases import nested_anyof_schema as _anyof


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a killed child not yet waited for is a zombie: gone for CPU and memory
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _salted(schema: dict) -> GuidedDecodingParams:
    return GuidedDecodingParams.json_schema({**schema, "title": uuid.uuid4().hex})


@pytest.fixture(scope="module")
def procs(tekken):
    config = GuidedDecodingConfig.from_tokenizer(tekken, compile_isolation="process",
                                                 compile_threads=2)
    factory = create_matcher_factory(config)
    yield factory
    factory.close()


def test_config_validates_isolation_and_memory_limit(tekken):
    """compile_isolation is "thread" or "process"; the memory limit is a byte count >= 0."""
    with pytest.raises(ConfigError, match="compile_isolation"):
        GuidedDecodingConfig.from_tokenizer(tekken, compile_isolation="fork")
    with pytest.raises(ConfigError, match="compile_memory_limit_bytes"):
        GuidedDecodingConfig.from_tokenizer(tekken, compile_memory_limit_bytes=-1)
    assert GuidedDecodingConfig.from_tokenizer(tekken).compile_isolation == "thread"


def test_timed_out_compile_is_killed_and_the_others_are_served(procs):
    """A compile that takes minutes times out: its worker process is gone within a second of
    the timeout, the other requests of the batch are served, and the next request with a
    different schema compiles normally."""
    slow = _salted(_anyof(14))
    good = [_salted({"type": "object", "properties": {"n": {"type": "integer"}}}),
            GuidedDecodingParams.regex(f"[a-z]+{uuid.uuid4().hex}")]
    slow_handle = procs.compile_async(slow)
    handles = [procs.compile_async(p) for p in good]
    for h in handles:
        assert h.result(60, backend="xgrammar").nbytes > 0
    deadline = time.monotonic() + 10
    pid = None
    while pid is None and time.monotonic() < deadline:
        pid = procs.processes.pid_compiling((slow.guide_type.value, slow.guide))
        time.sleep(0.01)
    assert pid is not None and _alive(pid)
    with pytest.raises(CompileTimeoutError):
        slow_handle.result(time.monotonic() - slow_handle.started + 0.5, backend="xgrammar")
    timed_out = time.monotonic()
    while _alive(pid) and time.monotonic() - timed_out < 1.0:
        time.sleep(0.01)
    assert not _alive(pid), "the timed-out compile's worker still runs"
    assert pid not in procs.processes.pids
    assert procs.processes.stats.killed >= 1
    after = _salted({"type": "object", "properties": {"s": {"type": "string"}}})
    assert procs.compile_async(after).result(60, backend="xgrammar").nbytes > 0
    assert (slow.guide_type.value, slow.guide) not in procs.cache


def test_memory_limit_fails_the_request_with_a_named_error(tekken):
    """A compile that needs more than compile_memory_limit_bytes fails its request with
    CompileResourceError naming the limit; the next compile gets a working worker."""
    config = GuidedDecodingConfig.from_tokenizer(
        tekken, compile_isolation="process", compile_threads=1,
        compile_memory_limit_bytes=256 << 20)
    factory = create_matcher_factory(config)
    try:
        big = _salted({"enum": [f"value_{i}" for i in range(100_000)]})
        with pytest.raises(CompileResourceError, match="256 MiB"):
            factory.compile(big)
        small = GuidedDecodingParams.regex(f"[0-9]+{uuid.uuid4().hex}")
        assert factory.compile(small).nbytes > 0
    finally:
        factory.close()


def test_compile_errors_keep_their_type_and_fields(procs):
    """An unsupported keyword refused in the worker arrives as UnsupportedGuideError with its
    guide type and backend."""
    from capgraph.errors import UnsupportedGuideError
    with pytest.raises(UnsupportedGuideError) as info:
        procs.compile(_salted({"type": "string", "not": {"const": "x"}}))
    assert info.value.guide_type == "JSON_SCHEMA" and info.value.backend == "xgrammar"
    with pytest.raises(GrammarCompileError, match="root"):
        procs.compile(GuidedDecodingParams.ebnf(f'start ::= "{uuid.uuid4().hex}"'))


def test_masks_equal_in_thread_compiles(procs, tekken):
    """Grammars compiled in a worker give the same masks as in-thread ones over a few
    teacher-forced tokens of a valid output."""
    threads = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tekken))
    cases = [
        ({"type": "object", "properties": {"city": {"type": "string"},
                                           "n": {"type": "integer"}}},
         '{"city": "Paris", "n": 12}'),
        ({"type": "array", "items": {"enum": ["a", "bc"]}}, '["bc", "a"]'),
    ]
    V = procs.config.vocab_size_padded
    words = (V + 31) // 32
    for schema, text in cases:
        params = GuidedDecodingParams.json_schema({**schema, "title": uuid.uuid4().hex})
        a, b = procs.create(params), threads.create(params)
        tokens = encode_continuation(tekken, text)
        for t in [*tokens, *(procs.config.stop_token_ids or [])]:
            ma = torch.zeros(1, words, dtype=torch.int32)
            mb = torch.zeros(1, words, dtype=torch.int32)
            a.fill_next_token_bitmask(ma, 0)
            b.fill_next_token_bitmask(mb, 0)
            assert torch.equal(ma, mb)
            assert a.accept_token(t) and b.accept_token(t)
        assert a.is_terminated() and b.is_terminated()
    threads.close()


def test_a_burst_of_schemas_creates_at_most_compile_threads_processes(procs):
    """200 distinct schemas at once: never more than compile_threads worker processes, and the
    compiles beyond the queue bound fail at once with CompileQueueFullError."""
    before = {p.pid for p in multiprocessing.active_children()}
    salt = uuid.uuid4().hex
    params = [GuidedDecodingParams.json_schema(
        json.dumps({"type": "object", "properties": {f"k{i}_{salt}": {"type": "integer"}}}))
        for i in range(200)]
    handles = [procs.compile_async(p) for p in params]
    most = 0
    ok = refused = 0
    for h in handles:
        most = max(most, len(procs.processes.pids))
        try:
            h.result(60, backend="xgrammar")
            ok += 1
        except CompileQueueFullError:
            refused += 1
    after = {p.pid for p in multiprocessing.active_children()} - before
    assert most <= 2 and len(procs.processes.pids) <= 2 and len(after) <= 2
    assert ok + refused == 200 and ok >= 2 * 4 and refused > 0
