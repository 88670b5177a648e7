"""xgrammar compiles in spawned worker processes (``compile_isolation="process"``): killed at
their timeout, bounded in memory and in number, equal to in-thread compiles."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
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


#: Memory the hostile compile must hold before it is timed out (MB of resident memory), and
#: how much this process's resident size may move meanwhile (allocator noise, not a compile).
_COMPILE_MB = 64
_RSS_SLACK_MB = 48


def _rss_mb(pid: int) -> float:
    """Resident memory of ``pid`` in MB (0 where it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def _children_mb(*excluding: int) -> float:
    """Resident memory of this process's live children (not ``excluding``), in MB."""
    total = 0.0
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in excluding:
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == os.getpid() and _alive(int(name)):
            total += _rss_mb(int(name))
    return total


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
    """A compile that takes minutes times out: its worker process is killed (gone within
    seconds of the timeout, not when the compile would end), the machine's memory is back (this process never grew by the compile's
    memory, and this process plus its children hold no more than before without the killed
    worker), the other requests of the batch are served, and the next request with a
    different schema compiles normally."""
    slow = _salted(_anyof(14))
    good = [_salted({"type": "object", "properties": {"n": {"type": "integer"}}}),
            GuidedDecodingParams.regex(f"[a-z]+{uuid.uuid4().hex}")]
    slow_handle = procs.compile_async(slow)
    handles = [procs.compile_async(p) for p in good]
    for h in handles:
        assert h.result(180, backend="xgrammar").nbytes > 0
    # (a worker starts in seconds; its nice 10 makes that 40 s and more on a loaded host)
    deadline = time.monotonic() + 150
    pid = None
    while pid is None and time.monotonic() < deadline:
        pid = procs.processes.pid_compiling((slow.guide_type.value, slow.guide))
        time.sleep(0.01)
    assert pid is not None and _alive(pid)
    start_mb, grow_deadline = _rss_mb(pid), time.monotonic() + 120
    while _rss_mb(pid) - start_mb < _COMPILE_MB and time.monotonic() < grow_deadline:
        time.sleep(0.05)  # until the compile holds memory worth getting back
    parent_mb, others_mb, worker_mb = _rss_mb(os.getpid()), _children_mb(pid), _rss_mb(pid)
    assert worker_mb - start_mb >= _COMPILE_MB
    with pytest.raises(CompileTimeoutError):
        slow_handle.result(time.monotonic() - slow_handle.started, backend="xgrammar")
    timed_out = time.monotonic()
    while _alive(pid) and time.monotonic() - timed_out < 15.0:  # (a niced process's teardown
        time.sleep(0.01)                                          # is slow on a loaded host)
    assert not _alive(pid), "the timed-out compile's worker still runs"
    assert pid not in procs.processes.pids
    # the memory is back: this process never held the compile's, and its worker's is gone
    after_mb = _rss_mb(os.getpid())
    assert after_mb - parent_mb < _RSS_SLACK_MB, (parent_mb, after_mb)
    assert after_mb + _children_mb() < parent_mb + others_mb + _RSS_SLACK_MB, \
        (parent_mb, others_mb, worker_mb, after_mb, _children_mb())
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
        small = _salted({"anyOf": [{"type": "integer"}, {"type": "null"}]})  # (to a worker)
        assert factory.compile(small).nbytes > 0
        assert len(factory.processes.stats.compile_s) == 1
    finally:
        factory.close()


def test_a_crashed_worker_fails_its_request_naming_the_signal(procs):
    """A worker that crashes while compiling (a backend fault: here a SIGSEGV sent to it)
    fails that request with CompileResourceError naming the signal, not a memory limit; the
    next compile gets a new worker."""
    slow = _salted(_anyof(14))
    handle = procs.compile_async(slow)
    deadline, pid = time.monotonic() + 150, None
    while pid is None and time.monotonic() < deadline:
        pid = procs.processes.pid_compiling((slow.guide_type.value, slow.guide))
        time.sleep(0.01)
    assert pid is not None
    died = procs.processes.stats.died
    os.kill(pid, signal.SIGSEGV)
    with pytest.raises(CompileResourceError, match=r"crashed \(SIGSEGV\)") as info:
        handle.result(120, backend="xgrammar")
    assert "memory limit" not in str(info.value)
    assert procs.processes.stats.died == died + 1
    after = _salted({"type": "object", "properties": {"t": {"type": "string"}}})
    assert procs.compile_async(after).result(120, backend="xgrammar").nbytes > 0


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
    """Grammars compiled in a worker, and cheap ones compiled in the decoder's process, give
    the same masks as in-thread ones over a few teacher-forced tokens of a valid output."""
    threads = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tekken))
    cases = [  # (schema, text, compiled in a worker)
        ({"type": "object", "properties": {"city": {"anyOf": [{"type": "string"},
                                                              {"type": "null"}]},
                                           "n": {"type": "integer"}}},
         '{"city": "Paris", "n": 12}', True),
        ({"type": "array", "items": {"enum": ["a", "bc"]}}, '["bc", "a"]', False),
    ]
    V = procs.config.vocab_size_padded
    words = (V + 31) // 32
    for schema, text, in_worker in cases:
        params = GuidedDecodingParams.json_schema({**schema, "title": uuid.uuid4().hex})
        stats = procs.processes.stats
        before = (len(stats.compile_s), stats.compiled_here)
        a, b = procs.create(params), threads.create(params)
        assert (len(stats.compile_s), stats.compiled_here) == \
            ((before[0] + 1, before[1]) if in_worker else (before[0], before[1] + 1))
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
    params = [GuidedDecodingParams.json_schema(json.dumps(  # (anyOf: not cheap, to a worker)
        {"type": "object", "properties": {f"k{i}_{salt}": {"anyOf": [{"type": "integer"},
                                                                     {"type": "null"}]}}}))
        for i in range(200)]
    handles = [procs.compile_async(p) for p in params]
    most = 0
    ok = refused = 0
    for h in handles:
        most = max(most, len(procs.processes.pids))
        try:
            h.result(180, backend="xgrammar")  # (from submission: two cold workers first)
            ok += 1
        except CompileQueueFullError:
            refused += 1
    after = {p.pid for p in multiprocessing.active_children()} - before
    assert most <= 2 and len(procs.processes.pids) <= 2 and len(after) <= 2
    assert ok + refused == 200 and ok >= 2 * 4 and refused > 0


def _hostile_guides() -> dict[str, GuidedDecodingParams]:
    """Guides whose xgrammar compile is slow or large (measured, or unbounded by their size)."""
    ebnf = "root ::= item+\n" + "\n".join(
        f'item ::= "k{i}" [a-z]{{0,4}} | "v{i}" ("," [0-9]+)*' for i in range(200))
    return {
        "nested anyOf": GuidedDecodingParams.json_schema(_anyof(14)),
        "1000 patternProperties": GuidedDecodingParams.json_schema(
            {"type": "object", "patternProperties": {f"^p{i}_[a-z]+$": {"type": "string"}
                                                     for i in range(1000)}}),
        "huge minItems": GuidedDecodingParams.json_schema(
            {"type": "array", "items": {"type": "object"}, "minItems": 50_000}),
        "huge maxLength": GuidedDecodingParams.json_schema(
            {"type": "string", "maxLength": 60_000}),
        "counted dot": GuidedDecodingParams.regex(".{0,64}"),
        "counted group": GuidedDecodingParams.regex("((.|,){1,4}){1,4}"),
        "long nested regex": GuidedDecodingParams.regex(
            "(" + "|".join(f"(w{i}[a-z]+)+" for i in range(12)) + ")*"),
        "repetition count": GuidedDecodingParams.regex("a{1000}"),
        "large EBNF": GuidedDecodingParams.ebnf(ebnf),
        "small EBNF": GuidedDecodingParams.ebnf('root ::= "a"'),
        "additionalProperties": GuidedDecodingParams.json_schema(
            {"type": "object", "properties": {"a": {"type": "string", "minLength": 1}},
             "required": ["a"], "additionalProperties": True}),
        "$ref": GuidedDecodingParams.json_schema(
            {"$defs": {"x": {"type": "integer"}}, "properties": {"a": {"$ref": "#/$defs/x"}}}),
    }


def test_cost_estimate_sends_every_hostile_guide_to_a_worker(tekken):
    """why_not_cheap calls no hostile guide cheap (each with its reason), and calls the
    common cheap ones cheap: builtin JSON, short regexes, flat schemas without combinators."""
    from capgraph.grammar.compile_cost import why_not_cheap
    from cases import ORDER_SCHEMA, TOOL_CALL_SCHEMA
    config = GuidedDecodingConfig.from_tokenizer(tekken)
    for name, params in _hostile_guides().items():
        assert why_not_cheap(params, config), name
    cheap = [GuidedDecodingParams.json(), GuidedDecodingParams.regex("[a-z]+@[a-z]+\\.com"),
             GuidedDecodingParams.regex("[A-Z]{2}-[0-9]{4}"),
             GuidedDecodingParams.json_schema(TOOL_CALL_SCHEMA),
             GuidedDecodingParams.json_schema({"type": "string", "maxLength": 255}),
             GuidedDecodingParams.json_schema({"type": "array", "items": {"type": "string",
                                                                          "format": "email"}})]
    for params in cheap:
        assert why_not_cheap(params, config) is None, params.guide
    assert "anyOf" in why_not_cheap(GuidedDecodingParams.json_schema(ORDER_SCHEMA), config)
    wide = GuidedDecodingConfig.from_tokenizer(tekken, json_whitespace="bounded",
                                               json_max_whitespace=64)
    assert "json_max_whitespace" in why_not_cheap(GuidedDecodingParams.json(), wide)


def test_cheap_guides_compile_here_and_the_others_in_a_worker(procs):
    """In process mode a guide estimated cheap is compiled in the decoder's process (no worker
    compile counted) and one that is not goes to a worker."""
    stats = procs.processes.stats
    here, in_worker = stats.compiled_here, len(stats.compile_s)
    cheap = GuidedDecodingParams.regex(f"[a-z]+{uuid.uuid4().hex[:16]}")
    assert procs.compile(cheap).nbytes > 0
    assert (stats.compiled_here, len(stats.compile_s)) == (here + 1, in_worker)
    costly = _salted({"anyOf": [{"type": "integer"}, {"type": "string"}]})
    assert procs.compile(costly).nbytes > 0
    assert (stats.compiled_here, len(stats.compile_s)) == (here + 1, in_worker + 1)


def _cpu_ticks(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])  # utime + stime


def test_a_compile_stopped_while_its_worker_starts_never_runs(tekken):
    """A request that times out while the worker for its compile is still starting: the
    compile never reaches a worker (no worker compiles it, none burns CPU for it), the worker
    started for it serves the next compile instead of being started again."""
    config = GuidedDecodingConfig.from_tokenizer(tekken, compile_isolation="process",
                                                 compile_threads=1)
    factory = create_matcher_factory(config)
    pool = factory.processes
    try:
        slow = _salted(_anyof(12))  # (minutes to compile; checked before it in 0.1 s)
        handle = factory.compile_async(slow)
        with pytest.raises(CompileTimeoutError):
            handle.result(1.0, backend="xgrammar")
        assert pool.stats.spawned == 0, "the worker was ready before the timeout"
        deadline = time.monotonic() + 120
        while pool.stats.not_started == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.stats.not_started == 1 and pool.stats.spawned == 1
        assert pool.pid_compiling((slow.guide_type.value, slow.guide)) is None
        (pid,) = pool.pids
        ticks = _cpu_ticks(pid)
        time.sleep(0.5)
        assert _cpu_ticks(pid) - ticks <= 5, "the idle worker burns CPU: it compiles"
        assert pool.stats.compile_s == []
        after = _salted({"anyOf": [{"type": "integer"}, {"type": "string"}]})
        assert factory.compile_async(after).result(60, backend="xgrammar").nbytes > 0
        assert pool.stats.spawned == 1 and pool.pids == [pid]
    finally:
        factory.close()


def test_a_compile_stopped_while_waiting_for_a_worker_fails_at_once(tekken):
    """With the only worker busy, a compile waiting for it that nobody waits for any more
    leaves compile() within a second with CompileTimeoutError and never runs."""
    import threading
    from capgraph.grammar.process_pool import ProcessCompilePool
    config = GuidedDecodingConfig.from_tokenizer(tekken)
    pool = ProcessCompilePool(config, workers=1, memory_limit_bytes=0)
    outcome: dict[str, BaseException | None] = {}

    def compile_(name: str, params: GuidedDecodingParams) -> None:
        try:
            pool.compile(name, params)
            outcome[name] = None
        except BaseException as e:  # noqa: BLE001 - looked at below
            outcome[name] = e

    try:
        busy = threading.Thread(target=compile_, args=("busy", _salted(_anyof(14))))
        busy.start()
        deadline = time.monotonic() + 120
        while pool.pid_compiling("busy") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert pool.pid_compiling("busy") is not None
        queued = threading.Thread(target=compile_, args=("queued", _salted(_anyof(3))))
        queued.start()
        time.sleep(0.2)
        assert "queued" not in outcome  # it waits for the worker
        stopped = time.monotonic()
        assert pool.stop("queued")
        queued.join(10.0)  # (at once: not after the busy compile, which takes minutes)
        assert not queued.is_alive() and time.monotonic() - stopped < 10.0
        assert isinstance(outcome["queued"], CompileTimeoutError)
        assert pool.stats.not_started == 1 and pool.pid_compiling("busy") is not None
        assert pool.stop("busy")
        busy.join(30.0)
        assert isinstance(outcome.get("busy"), CompileTimeoutError)
        assert pool.stats.compile_s == []
    finally:
        pool.close()


def test_workers_run_at_a_lower_cpu_priority(procs):
    """Every thread of a compile worker (xgrammar's compile threads included) runs at nice
    WORKER_NICE or lower priority, so a compile cannot take CPU from the decode loop."""
    from capgraph.grammar.process_pool import WORKER_NICE
    assert procs.compile(_salted({"anyOf": [{"type": "integer"}, {"type": "null"}]})).nbytes
    pids = procs.processes.pids
    assert pids
    for pid in pids:
        tasks = os.listdir(f"/proc/{pid}/task")
        assert len(tasks) >= 1
        for tid in tasks:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                nice = int(f.read().rsplit(")", 1)[1].split()[16])
            assert nice >= WORKER_NICE, (pid, tid, nice)


def test_guides_at_the_estimates_limits_compile_small_and_fast(tekken):
    """Guides built to the cost estimate's limits, which it calls cheap, compile in the
    decoder's process in bounded time and memory (what lets them skip the worker): each under
    8 MiB and 5 s (they take 20-100 ms on 2 idle cores; the bound only catches a runaway)."""
    from capgraph.grammar import compile_cost as cc

    def nested_arrays(depth: int) -> dict:
        schema: dict = {"type": "string", "maxLength": cc.MAX_SCHEMA_COUNT}
        for _ in range(depth):
            schema = {"type": "array", "items": schema, "minItems": cc.MAX_SCHEMA_COUNT,
                      "maxItems": cc.MAX_SCHEMA_COUNT}
        return schema

    formats = ["email", "uri", "date-time", "ipv6", "hostname", "uuid", "date", "time"]
    guides = [
        GuidedDecodingParams.json_schema(nested_arrays(cc.MAX_SCHEMA_DEPTH)),
        GuidedDecodingParams.json_schema({"type": "object", "properties": {
            f"p{i}": {"type": "string", "format": f} for i, f in enumerate(formats)},
            "required": [f"p{i}" for i in range(len(formats))]}),
        GuidedDecodingParams.json_schema({"type": "object", "properties": {
            f"p{i}": {"type": "string", "minLength": 200, "maxLength": cc.MAX_SCHEMA_COUNT}
            for i in range(cc.MAX_SCHEMA_NODES - 1)}}),
        GuidedDecodingParams.json_schema({"enum": [f"{'x' * 25}{i}"
                                                   for i in range(cc.MAX_ENUM)]}),
        GuidedDecodingParams.regex(f".{{{cc.MAX_REGEX_COUNTS}}}"),
        GuidedDecodingParams.regex("(.*a.*b.*c.*d.*e.*f.*g.*h.*i.*j.*k.*l.*m.*n.*o.*p.*q.*)*"),
        GuidedDecodingParams.json(),
    ]
    config = GuidedDecodingConfig.from_tokenizer(tekken, compile_cache_bytes=0,
                                                 compile_disk_cache_bytes=0)
    factory = create_matcher_factory(config)
    try:
        for params in guides:
            assert cc.why_not_cheap(params, config) is None, params.guide[:80]
            start = time.perf_counter()
            compiled = factory.compile(params)
            seconds = time.perf_counter() - start
            assert compiled.nbytes < 8 << 20 and seconds < 5.0, (params.guide[:80], seconds)
    finally:
        factory.close()


def _rule_chain(rules: int) -> GuidedDecodingParams:
    """An EBNF chain ``r{i} ::= r{i+1}``: compiles in milliseconds, but xgrammar's
    serialization writes the whole FSM once per rule (hundreds of MB at 3000 rules)."""
    text = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(rules))
    return GuidedDecodingParams.ebnf(text + f'r{rules} ::= "{uuid.uuid4().hex[:8]}"\n')


def test_a_grammar_too_large_to_send_back_is_compiled_here(procs):
    """A guide whose serialized form would pass MAX_SERIALIZED_BYTES is not serialized in the
    worker (that took ~25 s and GBs for this chain); compiled quickly there, it is compiled
    again in the decoder's process and served."""
    from capgraph.grammar.disk_cache import MAX_SERIALIZED_BYTES
    params = _rule_chain(3000)
    stats = procs.processes.stats
    before = (stats.too_large, len(stats.serialize_s))
    start = time.perf_counter()
    compiled = procs.compile(params)
    took = time.perf_counter() - start
    assert (stats.too_large, len(stats.serialize_s)) == (before[0] + 1, before[1])
    assert procs._serialized_bytes_estimate(compiled) > MAX_SERIALIZED_BYTES
    assert took < 15, took
    matcher = procs.create(params)
    tail = params.guide.rsplit('"', 2)[1]
    for t in encode_continuation(procs.config.tokenizer, tail):
        assert matcher.accept_token(t)
    assert matcher.accept_token(procs.config.stop_token_ids[0]) and matcher.is_terminated()


def test_a_grammar_too_large_to_send_back_and_slow_fails_with_a_named_error(procs, monkeypatch):
    """Where the worker's compile took more than COMPILE_HERE_SHARE of the timeout, compiling
    it again here would cost as much: the request fails with CompileResourceError."""
    from capgraph.grammar import process_pool
    monkeypatch.setattr(process_pool, "COMPILE_HERE_SHARE", 0.0)
    with pytest.raises(CompileResourceError, match="would serialize to about"):
        procs.compile(_rule_chain(3000))


def test_a_config_without_stop_tokens_compiles_in_a_worker():
    """A config from an encoded vocabulary with no stop token (its ``stop_token_ids`` read
    back as ``[]``) builds a process-isolated factory, and a guide compiled in its worker
    serves a matcher."""
    vocab = [chr(97 + i % 26) * (1 + i // 26) for i in range(52)]
    config = GuidedDecodingConfig(encoded_vocab=vocab, compile_isolation="process",
                                  compile_threads=1)
    assert config.stop_token_ids == []
    factory = create_matcher_factory(config)
    try:
        params = GuidedDecodingParams.ebnf('root ::= "a" "bb"')  # (EBNF: always in a worker)
        matcher = factory.create(params)
        assert len(factory.processes.stats.compile_s) == 1
        assert matcher.accept_token(0) and matcher.accept_token(27)
    finally:
        factory.close()


def test_a_compile_never_waits_for_a_background_compiles_worker(tekken):
    """With one worker per kind, a background compile (a hand-over's xgrammar compile) that
    holds its worker for minutes does not hold back a compile a request waits for: that one
    gets a worker of its own, and the background one's runs at BACKGROUND_NICE."""
    from capgraph.grammar.compile_pool import BACKGROUND_NICE, CompilePool
    from capgraph.grammar.process_pool import ProcessCompilePool
    config = GuidedDecodingConfig.from_tokenizer(tekken)
    pool = ProcessCompilePool(config, workers=1, memory_limit_bytes=0)
    threads = CompilePool(1)
    try:
        busy = threads.submit(lambda: pool.compile("busy", _salted(_anyof(14))),
                              nice=BACKGROUND_NICE)
        deadline = time.monotonic() + 120
        while pool.pid_compiling("busy") is None and time.monotonic() < deadline:
            time.sleep(0.02)
        pid = pool.pid_compiling("busy")
        assert pid is not None
        with open(f"/proc/{pid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[16]) >= BACKGROUND_NICE
        small = _salted({"anyOf": [{"type": "integer"}, {"type": "string"}]})
        text, nbytes, _ = threads.submit(lambda: pool.compile("small", small)).result(120)
        assert text and nbytes > 0 and not busy.done()
        assert pool.stats.spawned == 2
        assert pool.stop("busy")
        with pytest.raises(CompileTimeoutError):
            busy.result(30)
    finally:
        pool.stop("busy")
        pool.close()


def test_cost_estimate_counts_spelled_out_wide_atoms_and_sums_a_schemas_patterns(tekken):
    """A wide atom ('.', a negated class, \\W, \\S, \\D) spelled out n times costs what its
    count {n} does (``"." * 64`` took 1.2 s), and a schema's patterns add up (20 properties
    of ``^.{62}$`` spelled out, 2012 characters, took 35 s): both go to a worker. Narrow atoms
    spelled out, and wide ones under ``*`` or ``+``, stay cheap."""
    from capgraph.grammar.compile_cost import MAX_REGEX_COUNTS, why_not_cheap
    config = GuidedDecodingConfig.from_tokenizer(tekken)
    regex = GuidedDecodingParams.regex
    for wide in (".", "[^x]", "\\W", "\\S", "\\D", ".?"):
        assert why_not_cheap(regex(wide * (MAX_REGEX_COUNTS + 1)), config), wide
        assert why_not_cheap(regex(wide * MAX_REGEX_COUNTS), config) is None, wide
    assert "wide atoms" in why_not_cheap(regex("." * 64), config)
    assert why_not_cheap(regex("a.b.c.d.e.f.g.h.i.j"), config)
    for cheap in ("[a-z]" * 12, "\\w\\d\\s" * 4, ".*a.+b[^c]*\\S+", "x{4}.{4}"):
        assert why_not_cheap(regex(cheap), config) is None, cheap

    def schema(n: int, pattern: str) -> GuidedDecodingParams:
        props = {f"p{i}": {"type": "string", "pattern": pattern} for i in range(n)}
        return GuidedDecodingParams.json_schema(
            json.dumps({"type": "object", "properties": props}, separators=(",", ":")))

    assert why_not_cheap(schema(20, "^" + "." * 62 + "$"), config)
    assert "patterns repeat" in why_not_cheap(schema(4, "^.{8}$"), config)
    assert why_not_cheap(schema(2, "^.{8}$"), config) is None
    assert why_not_cheap(schema(8, "^[a-z]+$"), config) is None
