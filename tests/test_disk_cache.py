"""The compiled-grammar cache on disk: restart, integrity, byte bound, unwritable folders, keys,
and compiles whose requests timed out (capgraph.grammar.disk_cache)."""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import logging
import os
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph._cache import cache_dir
from capgraph.errors import CompileTimeoutError
from capgraph.grammar import create_matcher_factory
from capgraph.grammar import disk_cache as dc
from capgraph.grammar.xgrammar_backend import XGrammarMatcherFactory
from capgraph.tokenizers import encode_continuation

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = "mistral-sp32k"  # the cheapest bundled factory to build (about 0.25 s)
SCHEMA = json.loads((ROOT / "capgraph/data/tool_call_schema.json").read_text())
GIB = 1 << 30
# the converted tokenizers, before any test points $CAPGRAPH_CACHE_DIR elsewhere
TOKENIZER_CACHE = str(cache_dir("tokenizers"))


def _instance() -> str:
    """A short JSON text valid under SCHEMA, for teacher forcing."""
    return json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})


@pytest.fixture
def tok(tokenizer_cache):
    return tokenizer_cache(TOKENIZER)


@pytest.fixture
def cache_root(tok, tmp_path, monkeypatch):
    """``$CAPGRAPH_CACHE_DIR`` in a temporary folder (the tokenizer is loaded before)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(root))
    return root


def _factory(tok, **fields):
    """An xgrammar factory with the disk cache on, writing every compile (no time rule)."""
    config = GuidedDecodingConfig.from_tokenizer(tok, **{"compile_disk_cache_bytes": GIB,
                                                         **fields})
    factory = create_matcher_factory(config)
    if factory.disk_cache is not None:
        factory.disk_cache.min_compile_s = 0.0
        factory.disk_cache.min_speedup = 0.0
    return factory


def _compile_and_write(factory, params):
    factory.compile(params)
    assert factory.disk_cache.flush(30)
    return factory.disk_cache.path_of(factory._disk_key(params))


def _masks(factory, compiled, tokens: list[int]) -> list[list[int]]:
    """The bitmask rows before each teacher-forced token and after the last."""
    matcher = factory.create_from_compiled(compiled)
    words = (factory.config.vocab_size_padded + 31) // 32
    rows = []
    for t in [*tokens, None]:
        bitmask = torch.zeros(1, words, dtype=torch.int32)
        matcher.fill_next_token_bitmask(bitmask, 0)
        rows.append(bitmask[0].tolist())
        if t is not None:
            assert matcher.accept_token(t)
    return rows


_CHILD = r"""
import json, sys
from capgraph import GuidedDecodingConfig, GuidedDecodingParams
from capgraph.grammar import create_matcher_factory
from capgraph.tokenizers import load_tokenizer
import torch
args = json.loads(sys.argv[1])
tok = load_tokenizer(args["tokenizer"], cache_dir=args["tokenizer_cache"])
factory = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(tok))
compiled = factory.compile(GuidedDecodingParams.json_schema(args["schema"]))
matcher = factory.create_from_compiled(compiled)
words = (factory.config.vocab_size_padded + 31) // 32
rows = []
for t in args["tokens"] + [None]:
    bitmask = torch.zeros(1, words, dtype=torch.int32)
    matcher.fill_next_token_bitmask(bitmask, 0)
    rows.append(bitmask[0].tolist())
    if t is not None:
        assert matcher.accept_token(t)
s = factory.stats
print(json.dumps({"compiled": s.compiled, "disk_hits": s.disk_hits, "masks": rows}))
"""


def test_second_process_serves_the_schema_from_disk(tok, cache_root):
    """A second process with the same cache folder loads the compiled schema instead of
    compiling it (its stats: no compile, one disk hit), and its masks along a teacher-forced
    output equal those of a fresh compile."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    factory = _factory(tok)
    path = _compile_and_write(factory, params)
    assert path.is_file() and factory.stats.disk_writes == 1
    tokens = encode_continuation(tok, _instance())[:12]
    fresh = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
        tok, compile_disk_cache_bytes=0))
    expected = _masks(fresh, fresh.compile(params), tokens)

    env = {**os.environ, "CAPGRAPH_CACHE_DIR": str(cache_root)}
    env.pop("CAPGRAPH_COMPILE_DISK_CACHE_BYTES", None)  # the default: on
    args = {"tokenizer": TOKENIZER, "tokenizer_cache": TOKENIZER_CACHE, "schema": SCHEMA,
            "tokens": tokens}
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(args)], env=env,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["compiled"] == 0 and out["disk_hits"] == 1
    assert out["masks"] == expected


def _damage_truncate(data: bytes) -> bytes:
    return data[:len(data) // 2]


def _damage_flip_payload(data: bytes) -> bytes:
    i = len(data) - 10
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1:]


def _damage_flip_key(data: bytes) -> bytes:
    return data[:8] + bytes([data[8] ^ 0x80]) + data[9:]


def _damage_header_only(data: bytes) -> bytes:
    return data[:20]


def _damage_format_version(data: bytes) -> bytes:
    return data[:4] + struct.pack("<H", dc.FORMAT_VERSION + 1) + data[6:]


@pytest.mark.parametrize("damage", [_damage_truncate, _damage_flip_payload, _damage_flip_key,
                                    _damage_header_only, _damage_format_version],
                         ids=["truncated", "flipped-byte", "flipped-key", "header-cut",
                              "format-version"])
def test_damaged_entry_is_recompiled_and_rewritten(tok, cache_root, damage, caplog):
    """A truncated, altered or other-format entry is never used: it is rejected (logged),
    the guide compiles again and a good entry replaces it."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    path = _compile_and_write(_factory(tok), params)
    path.write_bytes(damage(path.read_bytes()))

    factory = _factory(tok)
    with caplog.at_level(logging.INFO, logger="capgraph.grammar.disk_cache"):
        compiled = factory.compile(params)
    assert factory.disk_cache.flush(30)
    s = factory.stats
    assert (s.compiled, s.disk_rejected, s.disk_hits, s.disk_writes) == (1, 1, 0, 1)
    assert "removed from disk" in caplog.text
    found, entry = factory.disk_cache.load(factory._disk_key(params))
    assert found is dc.Lookup.HIT
    assert factory.create_from_compiled(compiled).accept_token(
        encode_continuation(tok, _instance())[0])


def test_backend_version_mismatch_is_recompiled(tok, cache_root):
    """An intact entry whose serialization xgrammar refuses (another serialization version)
    is rejected and the guide compiled again."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    writer = _factory(tok)
    path = _compile_and_write(writer, params)
    key = writer._disk_key(params)
    found, entry = writer.disk_cache.load(key)
    doc = json.loads(entry.text)
    doc["__VERSION__"] = "v0-other"
    assert writer.disk_cache.store(key, json.dumps(doc), entry.record)

    factory = _factory(tok)
    factory.compile(params)
    assert (factory.stats.compiled, factory.stats.disk_rejected) == (1, 1)
    assert factory.disk_cache.flush(30) and path.is_file()
    reader = _factory(tok)
    reader.compile(params)  # the rewritten entry loads
    assert (reader.stats.disk_hits, reader.stats.compiled) == (1, 0)


def test_entry_slower_to_load_than_to_compile_is_removed(tok, cache_root):
    """An entry that loaded slower than its recorded compile is still served, then removed
    from disk and not written again by that factory."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    writer = _factory(tok)
    path = _compile_and_write(writer, params)
    key = writer._disk_key(params)
    _, entry = writer.disk_cache.load(key)
    writer.disk_cache.store(key, entry.text, {**entry.record, "compile_s": 1e-9})

    factory = _factory(tok)
    factory.compile(params)
    assert (factory.stats.disk_hits, factory.stats.compiled) == (1, 0)
    assert not path.exists()
    factory.cache.clear()
    factory.compile(params)  # compiled again, and not written
    assert factory.disk_cache.flush(30)
    assert factory.stats.compiled == 1 and not path.exists()


def test_an_entry_naming_another_backend_is_rejected(tok, cache_root):
    """An intact entry whose record names another backend than the factory's (a hand-made
    file: the key already holds the backend) is rejected and the guide compiled again (it
    was handed to that backend's matcher: a raw AttributeError, every time)."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    writer = _factory(tok)
    _compile_and_write(writer, params)
    key = writer._disk_key(params)
    _, entry = writer.disk_cache.load(key)
    assert writer.disk_cache.store(key, entry.text, {**entry.record, "backend": "llguidance"})
    factory = _factory(tok)
    compiled = factory.compile(params)
    assert compiled.backend == "xgrammar"
    assert (factory.stats.compiled, factory.stats.disk_rejected) == (1, 1)


def test_what_is_no_entry_file_costs_only_that_entry(tmp_path):
    """A folder or a FIFO at an entry's path is not read (a FIFO's open blocked the compile
    thread) and stops only that entry's write, not every write for minutes; an entry that
    inflates past MAX_INFLATED_BYTES or whose record nests past the recursion limit is
    damaged, not an exception that fails the request every time."""
    import zlib
    cache = dc.DiskCompileCache(tmp_path, GIB)
    blocked, other = dc.entry_key(["dir"]), dc.entry_key(["other"])
    cache.path_of(blocked).mkdir(parents=True)
    assert cache.load(blocked) == (dc.Lookup.MISS, None)
    assert not cache.store(blocked, "text", {"backend": "t"})
    assert cache.worth_storing(1.0) and cache.store(other, "text", {"backend": "t"})
    if hasattr(os, "mkfifo"):
        fifo = dc.entry_key(["fifo"])
        os.mkfifo(cache.path_of(fifo))
        assert cache.load(fifo) == (dc.Lookup.MISS, None)
    bomb = zlib.compress(b"\0" * (dc.MAX_INFLATED_BYTES + 1), 9)
    deep = "[" * 100_000 + "]" * 100_000
    for meta, payload in ((b"{}", bomb), (deep.encode(), zlib.compress(b"x"))):
        key = dc.entry_key([str(len(payload))])
        digest = hashlib.sha256(meta)
        digest.update(payload)
        header = dc._HEADER.pack(dc._MAGIC, dc.FORMAT_VERSION, dc._ZLIB, bytes.fromhex(key),
                                 len(meta), len(payload), digest.digest())
        cache.path_of(key).write_bytes(header + meta + payload)
        assert cache.load(key) == (dc.Lookup.REJECTED, None)
        assert not cache.path_of(key).exists()


def test_every_compile_module_is_in_the_code_digest_or_named_outside_it():
    """Every capgraph.grammar module the xgrammar backend imports (directly or not) is in
    the disk key's code digest or named as not deciding compiles, so an edit to one that
    decides (formats, regex_classes were missing) cannot leave stale entries served."""
    import ast
    import pathlib
    from capgraph.grammar import xgrammar_backend as xb
    root = pathlib.Path(xb.__file__).parent
    seen, stack = set(), ["xgrammar_backend"]
    while stack:
        name = stack.pop()
        if name in seen:
            continue
        seen.add(name)
        for node in ast.walk(ast.parse((root / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                stack.append(node.module.split(".")[0])
    imported = {f"capgraph.grammar.{name}" for name in seen}
    assert imported <= set(xb._COMPILE_MODULES) | set(xb._NOT_COMPILE_MODULES), \
        imported - set(xb._COMPILE_MODULES) - set(xb._NOT_COMPILE_MODULES)
    assert not set(xb._COMPILE_MODULES) & set(xb._NOT_COMPILE_MODULES)


def test_byte_bound_evicts_least_recently_used(tmp_path):
    """A write that would pass the byte bound deletes the least recently used entries first
    (a hit counts as a use); an entry larger than the bound is not written."""
    text = "x" * 1000
    keys = [dc.entry_key([str(i)]) for i in range(4)]
    probe = dc.DiskCompileCache(tmp_path, GIB)
    assert probe.store(keys[0], text, {"backend": "t"})
    size = probe.path_of(keys[0]).stat().st_size
    probe.path_of(keys[0]).unlink()

    cache = dc.DiskCompileCache(tmp_path, 3 * size)
    now = time.time()
    for age, key in zip((30, 20, 10), keys[:3]):
        assert cache.store(key, text, {"backend": "t"})
        os.utime(cache.path_of(key), (now - age, now - age))
    assert cache.load(keys[0])[0] is dc.Lookup.HIT  # now the most recent
    assert cache.store(keys[3], text, {"backend": "t"})
    present = [cache.path_of(k).exists() for k in keys]
    assert present == [True, False, True, True]
    assert cache.evictions == 1 and cache.nbytes <= 3 * size
    assert not cache.store(dc.entry_key(["big"]), os.urandom(4 * size).hex(), {"backend": "t"})


def test_unwritable_folder_still_serves(tok, tmp_path, monkeypatch, caplog):
    """With the cache folder impossible to create (a file stands where it should be), every
    request is served from compiles and memory; the failure is logged once."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("CAPGRAPH_CACHE_DIR", str(blocker))
    factory = _factory(tok)
    monkeypatch.setattr(dc, "RETRY_WRITES_AFTER_S", 0.0)  # every write tries (and fails)
    with caplog.at_level(logging.DEBUG, logger="capgraph.grammar.disk_cache"):
        for pattern in (r"[a-z]{3}", r"[0-9]{4}", r"(ab)+"):
            assert factory.create(GuidedDecodingParams.regex(pattern)) is not None
            assert factory.disk_cache.flush(30)
    assert factory.stats.compiled == 3 and factory.stats.disk_writes == 0
    assert factory.stats.disk_misses == 3
    warnings = [r for r in caplog.records
                if r.levelno == logging.WARNING and r.name == "capgraph.grammar.disk_cache"]
    assert len(warnings) == 1 and "kept in memory only" in warnings[0].getMessage()


def test_full_disk_pauses_writes_and_serves(tok, cache_root, monkeypatch, caplog):
    """A write that fails with ENOSPC leaves no partial file, pauses writes, and the request
    is served as usual."""
    factory = _factory(tok)

    def full(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dc.os, "replace", full)
    with caplog.at_level(logging.WARNING, logger="capgraph.grammar.disk_cache"):
        factory.compile(GuidedDecodingParams.regex(r"[a-z]{3}"))
        assert factory.disk_cache.flush(30)
        factory.compile(GuidedDecodingParams.regex(r"[0-9]{3}"))  # paused: not even queued
        assert factory.disk_cache.flush(30)
    assert factory.stats.compiled == 2 and factory.stats.disk_writes == 0
    assert factory.disk_cache.skipped == 1
    ours = [r for r in caplog.records if r.name == "capgraph.grammar.disk_cache"]
    assert len(ours) == 1 and "No space left" in ours[0].getMessage()
    assert list((cache_root / "grammars").iterdir()) == []  # no temporary file left


def test_every_config_field_is_classified():
    """Each GuidedDecodingConfig field is either in the key, in the tokenizer's identity, or
    known not to change a compile (a new field must be placed in one of them)."""
    names = {f.name for f in dataclasses.fields(GuidedDecodingConfig)}
    classified = [*dc.KEY_FIELDS, *dc.TOKENIZER_FIELDS, *dc.NOT_KEY_FIELDS]
    assert len(classified) == len(set(classified))
    assert names == set(classified), (
        f"classify {sorted(names - set(classified))} in capgraph.grammar.disk_cache "
        f"(stale: {sorted(set(classified) - names)})")


def test_key_follows_the_fields_that_change_a_compile(tok, cache_root):
    """The key changes with every compile-relevant field and with the vocabulary as xgrammar
    sees it (stop tokens, padding), and not with fields that do not change a compile."""
    params = GuidedDecodingParams.json_schema(SCHEMA)
    base = _factory(tok)
    key = base._disk_key(params)
    relevant = {"json_whitespace": "compact", "json_max_whitespace": 4,
                "json_unenforced_keywords": "ignore", "max_repetition_count": 1000}
    assert set(relevant) == set(dc.KEY_FIELDS) - {"backend"}
    base_text = dc.config_key(base.config)
    for name, value in relevant.items():
        changed = dataclasses.replace(base.config, **{name: value})
        assert dc.config_key(changed) != base_text, name
    irrelevant = {"compile_threads": 3, "compile_timeout_s": 5.0, "fill_threads": 2,
                  "native_fill_threads": 3,
                  "compile_cache_bytes": 1 << 20, "host_step_budget_ms": 10.0,
                  "native_build": "off", "compile_disk_cache_bytes": 1 << 20,
                  "compile_isolation": "process", "compile_memory_limit_bytes": 1 << 30}
    assert set(irrelevant) == set(dc.NOT_KEY_FIELDS)
    assert _factory(tok, **irrelevant)._disk_key(params) == key
    assert _factory(tok, json_whitespace="compact")._disk_key(params) != key
    assert _factory(tok, vocab_size_padded=len(tok) + 64)._disk_key(params) != key
    assert _factory(tok, stop_token_ids=[0])._disk_key(params) != key
    assert base._disk_key(GuidedDecodingParams.regex("a+")) != key
    text = 'root ::= "a"'
    assert base._disk_key(GuidedDecodingParams.ebnf(text)) != \
        base._disk_key(GuidedDecodingParams.regex(text))


class _HeldFactory(XGrammarMatcherFactory):
    """Compiles only once ``release`` is set (a compile that outlives its request)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.release = threading.Event()

    def _compile(self, params):
        self.release.wait(30)
        return super()._compile(params)


def _held(tok) -> _HeldFactory:
    factory = _HeldFactory(GuidedDecodingConfig.from_tokenizer(
        tok, compile_disk_cache_bytes=GIB))
    factory.disk_cache.min_compile_s = factory.disk_cache.min_speedup = 0.0
    return factory


def test_compile_whose_request_timed_out_is_not_written(tok, cache_root):
    """A compile that ends after its only request timed out is not written to disk."""
    factory = _held(tok)
    params = GuidedDecodingParams.regex(r"[a-z]{2,5}")
    handle = factory.compile_async(params)
    with pytest.raises(CompileTimeoutError):
        handle.result(0.05, backend="xgrammar")
    factory.release.set()
    handle.future.result(30)
    assert factory.disk_cache.flush(30)
    assert factory.stats.compiled == 1 and factory.stats.disk_writes == 0
    assert not factory.disk_cache.path_of(factory._disk_key(params)).exists()


def test_timed_out_compile_asked_again_is_written(tok, cache_root):
    """A compile whose first request timed out but that a later request joined is written."""
    factory = _held(tok)
    params = GuidedDecodingParams.regex(r"[a-z]{2,6}")
    first = factory.compile_async(params)
    with pytest.raises(CompileTimeoutError):
        first.result(0.05, backend="xgrammar")
    with pytest.raises(CompileTimeoutError):  # a second wait of the same handle counts once
        first.result(0.05, backend="xgrammar")
    again = factory.compile_async(params)
    assert factory.stats.inflight_hits == 1
    factory.release.set()
    again.result(30, backend="xgrammar")
    assert factory.disk_cache.flush(30)
    assert factory.stats.disk_writes == 1
    assert factory.disk_cache.path_of(factory._disk_key(params)).is_file()


def test_disk_budget_config_field(tok, monkeypatch):
    """compile_disk_cache_bytes: the variable sets the default (K/M/G accepted), an explicit
    value wins, 0 turns the disk cache off, and a bad value raises ConfigError naming it."""
    from capgraph.errors import ConfigError
    from capgraph.params import COMPILE_DISK_CACHE_ENV, DEFAULT_COMPILE_DISK_CACHE_BYTES
    monkeypatch.delenv(COMPILE_DISK_CACHE_ENV, raising=False)
    assert GuidedDecodingConfig.from_tokenizer(tok).compile_disk_cache_bytes == \
        DEFAULT_COMPILE_DISK_CACHE_BYTES == GIB
    monkeypatch.setenv(COMPILE_DISK_CACHE_ENV, "2M")
    assert GuidedDecodingConfig.from_tokenizer(tok).compile_disk_cache_bytes == 2 << 20
    explicit = GuidedDecodingConfig.from_tokenizer(tok, compile_disk_cache_bytes=0)
    assert explicit.compile_disk_cache_bytes == 0
    assert create_matcher_factory(explicit).disk_cache is None
    monkeypatch.setenv(COMPILE_DISK_CACHE_ENV, "lots")
    with pytest.raises(ConfigError, match=COMPILE_DISK_CACHE_ENV):
        GuidedDecodingConfig.from_tokenizer(tok)
    monkeypatch.delenv(COMPILE_DISK_CACHE_ENV)
    for bad in (-1, 1.5, True, "1G"):
        with pytest.raises(ConfigError, match="compile_disk_cache_bytes"):
            GuidedDecodingConfig.from_tokenizer(tok, compile_disk_cache_bytes=bad)


_EXIT_CHILD = r"""
import sys, threading, time
from pathlib import Path
from capgraph.grammar.disk_cache import DiskCompileCache
folder = Path(sys.argv[1])
cache = DiskCompileCache(folder, 1 << 20, min_compile_s=0.0, min_speedup=0.0)
started = threading.Event()

def produce():
    started.set()
    time.sleep(1.0)  # a serialization still running when the process exits
    return "x" * 100, {"backend": "test"}

for i in range(3):
    assert cache.store_later(f"{i:064x}", 1.0, produce)
assert started.wait(30)  # the first write has started; the process exits now
"""


def test_exit_finishes_the_write_in_flight_and_drops_the_rest(tmp_path):
    """Pins: at interpreter exit every open disk cache stops writing: the entry being written
    is finished (a writer thread inside a backend's C++ while the process tears down its C++
    state aborted the process: 'terminate called without an active exception'), the queued
    ones are dropped, and the process exits with 0."""
    proc = subprocess.run([sys.executable, "-c", _EXIT_CHILD, str(tmp_path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    written = [p.name for p in tmp_path.iterdir() if p.suffix == ".grammar"]
    assert len(written) == 1, sorted(p.name for p in tmp_path.iterdir())


def _chain(rules: int) -> GuidedDecodingParams:
    """An EBNF of ``rules`` rules each naming the next (about 20 bytes a rule): compiles in
    well under a second, but xgrammar's serialization writes the grammar's whole FSM once per
    rule (about 0.08 x rules x memory_size_bytes: 5000 rules, ~0.5 GB of text, minutes and
    ~9 GB to build)."""
    return GuidedDecodingParams.ebnf("root ::= r0\n" + "".join(
        f"r{i} ::= r{i + 1}\n" for i in range(rules)) + f'r{rules} ::= "a"\n')


def test_serialization_past_the_bound_never_starts(tok, cache_root, monkeypatch):
    """A guide whose estimated serialization passes the cache's text bound
    (MAX_SERIALIZED_BYTES, here with no load rule: every compile worth writing) is not
    serialized at all (a spy on the serializer is never called), nothing is written, the
    writer is done at once, and the guide decodes."""
    factory = _factory(tok)
    calls = []

    def spy(compiled):  # (the real one: ~1.5 GB and ~10 s for this guide)
        calls.append(compiled)
        raise AssertionError("serialized a guide past the bound")

    monkeypatch.setattr(factory, "_serialize", spy)
    params = _chain(2000)
    start = time.perf_counter()
    compiled = factory.compile(params)
    assert factory.disk_cache.flush(30)
    assert time.perf_counter() - start < 10
    assert calls == []
    estimate = factory._serialized_bytes_estimate(compiled)
    assert estimate is not None and estimate > dc.MAX_SERIALIZED_BYTES
    assert factory.stats.disk_writes == 0 and factory.disk_cache.oversized == 1
    assert not factory.disk_cache.path_of(factory._disk_key(params)).exists()
    matcher = factory.create_from_compiled(compiled)
    assert matcher.accept_token(encode_continuation(tok, "a")[0])


def test_serialization_past_the_load_rule_never_starts(tok, cache_root, monkeypatch):
    """With the default rules, a compile of a few tenths of a second is worth at most a few MB
    of text (loading it must be min_speedup times faster than the compile): a larger estimate
    is not serialized, however small the cache's absolute bound."""
    factory = _factory(tok)
    factory.disk_cache.min_speedup = dc.MIN_SPEEDUP
    calls = []
    monkeypatch.setattr(factory, "_serialize", lambda c: calls.append(c) or "")
    compiled = factory.compile(_chain(500))
    assert factory.disk_cache.flush(30)
    assert calls == []
    budget = factory.disk_cache.text_budget(compiled.compile_s)
    assert budget < factory._serialized_bytes_estimate(compiled)
    assert budget < dc.MAX_SERIALIZED_BYTES and factory.disk_cache.oversized == 1


def test_estimate_is_above_the_serialization(tok, cache_root):
    """The estimate made without serializing is above the real serialization's length, for
    the tool-call schema, regexes and an EBNF chain (a budget it fits is never passed by
    much); and guides like these are still written and loaded."""
    factory = _factory(tok)
    for params in (GuidedDecodingParams.json_schema(SCHEMA), GuidedDecodingParams.regex("a+"),
                   GuidedDecodingParams.regex(r"[a-z]{2,5}@[0-9]{3}"), _chain(200)):
        compiled = factory.compile(params)
        estimate = factory._serialized_bytes_estimate(compiled)
        assert estimate is not None and estimate >= len(factory._serialize(compiled)), params
    assert factory.disk_cache.flush(30)
    assert factory.stats.disk_writes == 4 and factory.disk_cache.oversized == 0
    reader = _factory(tok)
    reader.compile(_chain(200))
    assert (reader.stats.disk_hits, reader.stats.compiled) == (1, 0)


def test_writer_checks_the_estimate_before_producing(tmp_path):
    """DiskCompileCache: produce() runs only where estimate() fits text_budget (None: no
    estimate, not produced); a text that passes the budget anyway is not written; the budget
    is what the load rule allows for the compile's time, at most max_text_bytes."""
    cache = dc.DiskCompileCache(tmp_path, GIB, min_compile_s=0.0, min_speedup=0.0,
                                max_text_bytes=1000)
    assert cache.text_budget(1.0) == 1000
    produced = []

    def produce(text):
        def run():
            produced.append(text)
            return text, {"backend": "t"}
        return run

    keys = [dc.entry_key([str(i)]) for i in range(4)]
    assert cache.store_later(keys[0], 1.0, produce("x" * 10), estimate=lambda: 1001)
    assert cache.store_later(keys[1], 1.0, produce("y" * 10), estimate=lambda: None)
    assert cache.store_later(keys[2], 1.0, produce("z" * 1001), estimate=lambda: 10)
    assert cache.store_later(keys[3], 1.0, produce("w" * 1000), estimate=lambda: 1000)
    assert cache.flush(30)
    assert produced == ["z" * 1001, "w" * 1000]
    assert [cache.path_of(k).exists() for k in keys] == [False, False, False, True]
    assert (cache.oversized, cache.skipped) == (2, 3)

    timed = dc.DiskCompileCache(tmp_path, GIB)  # the load rule: 1.5x faster than the compile
    one_s = (1.0 / dc.MIN_SPEEDUP - dc.LOAD_S_FIXED) / dc.LOAD_S_PER_BYTE
    assert timed.text_budget(1.0) == pytest.approx(one_s)
    assert timed.text_budget(1000.0) == dc.MAX_SERIALIZED_BYTES
    timed.min_compile_s = 0.0
    assert not timed.worth_storing(dc.LOAD_S_FIXED)  # (a load would take longer)


def test_serialize_cost_tool_prints_the_text_under_its_estimate(capsys):
    """``tools/serialize_cost.py`` (the figures in docs/RELIABILITY.md) prints one row per
    size, and in each the serialized text is shorter than the disk cache's estimate."""
    from conftest import load_tool
    load_tool("serialize_cost").main(["--rules", "20", "120"])
    rows = capsys.readouterr().out.strip().splitlines()[1:]
    assert [int(r.split()[0]) for r in rows] == [20, 120]
    for row in rows:
        cells = row.split()
        assert int(cells[4]) < int(cells[5]) and 0 < float(cells[6]) < 1, row
