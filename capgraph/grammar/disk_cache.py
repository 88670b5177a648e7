"""Compiled grammars on disk, so that a restarted process loads its guides instead of compiling.

One file per entry under ``$CAPGRAPH_CACHE_DIR/grammars`` (:func:`capgraph._cache.cache_dir`),
named by its key: a SHA-256 over everything the compiled grammar depends on (see
:func:`entry_key`; the factory gathers the parts: format version, capgraph and backend
versions, the digest of the compile code, the tokenizer, the config fields of
:data:`KEY_FIELDS`, the guide type and text).

An entry is a fixed header (magic, :data:`FORMAT_VERSION`, the key, the lengths, a SHA-256 of
what follows), a small JSON record (who serves the guide) and the backend's serialization,
zlib-compressed. An entry that is truncated, altered or of another format is never used: it is
deleted, logged at INFO, and the guide compiled again. Writes go to a temporary file that
replaces the entry atomically, so processes sharing the folder never read a partial entry and
two writers of one key both succeed. The folder stays under ``limit_bytes``: a write evicts the
least recently used entries (a hit refreshes its file's mtime).

Writing costs a serialization and loading costs 11-30 ns per serialized byte, which for some
guides is more than compiling them. So an entry is written only for a compile of at least
``min_compile_s`` whose estimated load (:data:`LOAD_S_PER_BYTE`) is ``min_speedup`` times
faster, on one background thread per cache, at most ``max_pending`` waiting: the request that
compiled never waits for the disk.

The serialization is bounded before it starts. xgrammar 0.2.9's ``serialize_json`` writes the
grammar's whole FSM once per rule, so its text grows with rules x memory (about 0.08 x
``rules * memory_size_bytes`` bytes), not with the memory alone: a 5000-rule EBNF chain that
compiles in 0.2 s would serialize to ~0.5 GB of text, at 120-430 ns and ~13 bytes of peak
memory per byte of text (minutes, ~9 GB), and bundled JSON schemas of 500-1200 rules reach
70-390 MB. Every byte past the load rule is wasted (the text is dropped after), so the writer
asks the producer's estimate first (:func:`serialized_bytes_estimate`, above every measured
serialization) and serializes only where it fits :meth:`DiskCompileCache.text_budget`: what
the load rule allows for that compile, and at most ``max_text_bytes``
(:data:`MAX_SERIALIZED_BYTES`, 64 MiB: ~0.9 GB peak and 10-30 s of the writer thread at
worst). A text longer than the budget is not written either. So the writer's work per grammar,
and what interpreter exit waits for (:meth:`DiskCompileCache.close`), stay bounded. The record keeps the compile's time; the factory removes an entry that loaded slower
than that. A folder that cannot be written (read-only, full) is logged once, and the cache
keeps serving from memory; writes are tried again after :data:`RETRY_WRITES_AFTER_S`.
"""

from __future__ import annotations

import atexit
import dataclasses
import enum
import hashlib
import importlib.util
import json
import logging
import os
import stat
import struct
import threading
import time
import weakref
import zlib
from collections import deque
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

__all__ = ["DiskCompileCache", "DiskEntry", "Lookup", "entry_key", "config_key",
           "source_digest", "serialized_bytes_estimate", "FORMAT_VERSION", "KEY_FIELDS",
           "NOT_KEY_FIELDS", "TOKENIZER_FIELDS", "MAX_SERIALIZED_BYTES"]

_log = logging.getLogger(__name__)

#: Version of the entry layout; an entry of another version is rejected (and rewritten).
FORMAT_VERSION = 1
_MAGIC = b"CGGC"
# magic, format version, flags, key (32 bytes), record length, payload length, SHA-256 of
# record + payload
_HEADER = struct.Struct("<4sHH32sIQ32s")
_ZLIB = 1  # flags bit: the payload is zlib-compressed
_SUFFIX = ".grammar"
_TEMP_MARK = ".tmp-"

#: GuidedDecodingConfig fields that change what a guide compiles to: part of the key.
KEY_FIELDS = ("backend", "json_whitespace", "json_max_whitespace", "json_unenforced_keywords",
              "max_repetition_count")
#: Fields that reach the key through the tokenizer's identity (the backend's vocabulary view).
TOKENIZER_FIELDS = ("tokenizer", "encoded_vocab", "stop_token_ids", "vocab_size_padded",
                    "tokenizer_vocab_size")
#: Fields that do not change a compiled grammar (how and where it is compiled, cached, used).
NOT_KEY_FIELDS = ("compile_cache_bytes", "compile_disk_cache_bytes", "compile_timeout_s",
                  "compile_threads", "compile_isolation", "compile_memory_limit_bytes",
                  "fill_threads", "native_fill_threads", "native_build", "host_step_budget_ms")

#: Estimated seconds per serialized byte to load an entry (read, inflate, deserialize): the
#: median measured with xgrammar 0.2.9, Tekken, the bundled schemas, 2 cores, was 16 ns (11-30).
LOAD_S_PER_BYTE = 20e-9
#: Estimated fixed cost of one load (open, header, checksum of a small entry).
LOAD_S_FIXED = 2e-4
#: Compiles shorter than this are not written (loading saves less than the write costs).
MIN_COMPILE_S = 0.01
#: The most serialized text one entry may take (before compression); a grammar whose
#: estimated serialization is longer is not serialized (module docstring).
MAX_SERIALIZED_BYTES = 64 << 20
#: An entry is written only where its estimated load is this many times faster than its compile.
MIN_SPEEDUP = 1.5
#: Entries waiting for the writer thread; past it, a new one is dropped.
MAX_PENDING_WRITES = 16
#: After a failed write (read-only or full disk), writes pause this long.
RETRY_WRITES_AFTER_S = 300.0
#: Temporary files older than this are left over from a process that died mid-write.
STALE_TEMP_S = 3600.0


class Lookup(enum.Enum):
    """What :meth:`DiskCompileCache.load` found."""

    HIT = "hit"  #: a verified entry
    MISS = "miss"  #: no entry (or the folder cannot be read)
    REJECTED = "rejected"  #: an entry that failed its checks; deleted


@dataclasses.dataclass(frozen=True, slots=True)
class DiskEntry:
    """A verified entry: the record it was stored with and the backend's serialization."""

    record: Mapping[str, Any]
    text: str
    file_bytes: int


def entry_key(parts: Sequence[str]) -> str:
    """The hex SHA-256 of ``parts`` (each length-prefixed, so no two lists collide)."""
    h = hashlib.sha256()
    for part in parts:
        data = part.encode("utf-8", "surrogatepass")
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def config_key(config: Any) -> str:
    """The :data:`KEY_FIELDS` of a ``GuidedDecodingConfig`` as canonical text."""
    values = {}
    for name in KEY_FIELDS:
        value = getattr(config, name)
        values[name] = value.value if isinstance(value, enum.Enum) else value
    return json.dumps(values, sort_keys=True)


def source_digest(modules: Sequence[str]) -> str:
    """SHA-256 of the source files of ``modules`` (by import name): code that shapes a compile
    is part of the key, so an edited converter never serves what the old one compiled."""
    h = hashlib.sha256()
    for name in modules:
        spec = importlib.util.find_spec(name)
        origin = spec.origin if spec is not None else None
        h.update(name.encode())
        if origin and os.path.isfile(origin):
            h.update(Path(origin).read_bytes())
    return h.hexdigest()


def serialized_bytes_estimate(memory_bytes: int, rules: int) -> int:
    """An upper estimate of the serialized text of a compiled xgrammar grammar that takes
    ``memory_bytes`` in memory (``memory_size_bytes``) and has ``rules`` rules.

    ``serialize_json`` writes the whole FSM of the grammar once per rule, so the text grows with
    ``rules * memory_bytes``: measured with xgrammar 0.2.9 over the bundled JSON schemas
    (mistral-sp32k, 4-1178 rules, 12 KB-390 MB of text), EBNF chains of 250-2000 rules and a
    20000-word alternation under 30-300 rules, the text was at most 0.12 x ``rules *
    memory_bytes`` plus 2.5 x ``memory_bytes`` (about 0.08 x ``rules * memory_bytes`` from a
    hundred rules on), and at most 0.53 of this estimate."""
    return int(max(memory_bytes, 0) * (2 + max(rules, 0) / 6))


class DiskCompileCache:
    """A folder of compiled grammars bounded by ``limit_bytes`` (file sizes), shared by processes.

    Args:
        directory: the folder (created on the first write).
        limit_bytes: the most its entries may take together (> 0).
        min_compile_s, min_speedup: which compiles are worth writing (module docstring).
        max_pending: entries that may wait for the writer thread.
        max_text_bytes: the longest serialization an entry may hold (:meth:`text_budget`).

    Thread-safe. Nothing here raises on an I/O error: a read that fails is a miss, a write
    that fails is dropped.
    """

    def __init__(self, directory: Path, limit_bytes: int, *, min_compile_s: float = MIN_COMPILE_S,
                 min_speedup: float = MIN_SPEEDUP, max_pending: int = MAX_PENDING_WRITES,
                 max_text_bytes: int = MAX_SERIALIZED_BYTES) -> None:
        if limit_bytes <= 0:
            raise ValueError(f"limit_bytes must be > 0, got {limit_bytes}")
        self.directory = Path(directory)
        self.limit_bytes = int(limit_bytes)
        self.min_compile_s = min_compile_s
        self.min_speedup = min_speedup
        self.max_pending = max_pending
        self.max_text_bytes = int(max_text_bytes)
        self.evictions = 0  #: entries this cache deleted to stay under its limit
        self.skipped = 0  #: compiles not written (not worth it, queue full, writes paused)
        #: of those, the ones not even serialized: their estimate passed :meth:`text_budget`
        #: (or could not be made)
        self.oversized = 0
        self._cv = threading.Condition()
        self._queue: deque[tuple[str, float, Callable[[], tuple[str, Mapping[str, Any]]],
                                 Callable[[bool], None] | None,
                                 Callable[[], int | None] | None]] = deque()
        self._busy = 0  # queued + being written
        self._writer: threading.Thread | None = None
        self._paused_until = 0.0
        self._warned = False
        self._closed = False
        _OPEN_CACHES.add(self)

    def path_of(self, key: str) -> Path:
        """The file that holds (or would hold) the entry of ``key``."""
        return self.directory / f"{key}{_SUFFIX}"

    # -- reading -----------------------------------------------------------------------------
    def load(self, key: str) -> tuple[Lookup, DiskEntry | None]:
        """The entry of ``key`` if it is there and intact; a damaged one is deleted."""
        path = self.path_of(key)
        try:
            # (non-blocking: a FIFO there must not hold the compile thread; only a regular
            # file is read)
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
            with open(fd, "rb") as f:
                if not stat.S_ISREG(os.fstat(fd).st_mode):
                    _log.info("capgraph: %s is no compiled-grammar file; not read", path)
                    return Lookup.MISS, None
                data = f.read()
        except FileNotFoundError:
            return Lookup.MISS, None
        except OSError as e:
            self._warn_once("read", e)
            return Lookup.MISS, None
        try:
            record, text = _decode(key, data)
        except _Damaged as e:
            self.reject(key, str(e))
            return Lookup.REJECTED, None
        try:
            os.utime(path)  # recently used: evicted last
        except OSError:
            pass
        return Lookup.HIT, DiskEntry(record, text, len(data))

    def reject(self, key: str, why: str) -> None:
        """Delete the entry of ``key``: damaged, refused by its backend, or slower to load
        than to compile (``why`` is logged)."""
        _log.info("capgraph: compiled grammar %s removed from disk (%s)", key[:16], why)
        try:
            self.path_of(key).unlink(missing_ok=True)
        except OSError:
            pass

    # -- writing -----------------------------------------------------------------------------
    def worth_storing(self, compile_s: float) -> bool:
        """Whether a compile of ``compile_s`` seconds may be written (before serializing it)."""
        return (compile_s >= self.min_compile_s and time.monotonic() >= self._paused_until
                and self.text_budget(compile_s) > 0)

    def text_budget(self, compile_s: float) -> float:
        """The longest serialization worth writing for a compile of ``compile_s`` seconds: one
        whose estimated load is ``min_speedup`` times faster than the compile, and at most
        ``max_text_bytes``."""
        if self.min_speedup <= 0:
            return float(self.max_text_bytes)
        useful = (compile_s / self.min_speedup - LOAD_S_FIXED) / LOAD_S_PER_BYTE
        return min(float(self.max_text_bytes), useful)

    def store_later(self, key: str, compile_s: float,
                    produce: Callable[[], tuple[str, Mapping[str, Any]]],
                    done: Callable[[bool], None] | None = None, *,
                    estimate: Callable[[], int | None] | None = None) -> bool:
        """Write an entry on the writer thread: ``produce()`` returns the serialization and
        the record; ``done(written)`` is called after. Returns whether it was queued.

        ``estimate()``, called on the writer thread before ``produce``, returns an upper
        estimate of the serialization's length in characters, found without serializing (None:
        it cannot tell); ``produce`` is called only where that fits :meth:`text_budget`. With
        no ``estimate``, ``produce`` always runs (the caller bounds it) and only its result is
        checked."""
        if not self.worth_storing(compile_s):
            self.skipped += 1
            return False
        with self._cv:
            if self._closed:
                self.skipped += 1
                return False
            if len(self._queue) >= self.max_pending:
                self.skipped += 1
                _log.debug("capgraph: %d grammars wait for the disk; %s not written",
                           len(self._queue), key[:16])
                return False
            self._queue.append((key, compile_s, produce, done, estimate))
            self._busy += 1
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_queued, daemon=True,
                                                name="capgraph-grammar-writer")
                self._writer.start()
            self._cv.notify_all()
        return True

    def close(self, timeout_s: float | None = 60.0) -> None:
        """Stop writing: entries still queued are dropped, the one being written is finished
        (its serialization runs in the backend's C++ and cannot be interrupted, and is bounded
        by :meth:`text_budget`; at most ``timeout_s`` is waited for it). Runs at interpreter exit for every open cache: a
        writer thread still inside the backend while the process tears down its C++ state
        would abort the process."""
        with self._cv:
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
            self._busy -= dropped
            self.skipped += dropped
            writer = self._writer
            self._cv.notify_all()
        if writer is not None and writer is not threading.current_thread():
            writer.join(timeout_s)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued entry is written or dropped; False on timeout."""
        with self._cv:
            return self._cv.wait_for(lambda: self._busy == 0, timeout_s)

    def store(self, key: str, text: str, record: Mapping[str, Any]) -> bool:
        """Write the entry of ``key`` now (evicting to fit); False where it was not written."""
        meta = json.dumps(dict(record), sort_keys=True).encode()
        payload = zlib.compress(text.encode("utf-8", "surrogatepass"), 1)
        digest = hashlib.sha256(meta)
        digest.update(payload)
        header = _HEADER.pack(_MAGIC, FORMAT_VERSION, _ZLIB, bytes.fromhex(key), len(meta),
                              len(payload), digest.digest())
        size = len(header) + len(meta) + len(payload)
        if size > self.limit_bytes:
            self.skipped += 1
            return False
        path = self.path_of(key)
        temp = path.with_name(f"{path.name}{_TEMP_MARK}{os.getpid()}-{threading.get_ident()}")
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._evict_for(size, keep=path.name)
            with open(temp, "wb") as f:
                f.write(header)
                f.write(meta)
                f.write(payload)
            os.replace(temp, path)
        except OSError as e:
            if os.path.lexists(path) and not os.path.isfile(path):
                # something else sits at this entry's path: skip this entry, not the folder
                _log.info("capgraph: %s is no compiled-grammar file; entry not written", path)
            else:
                self._paused_until = time.monotonic() + RETRY_WRITES_AFTER_S
                self._warn_once("write", e)
            try:
                temp.unlink(missing_ok=True)
            except OSError:
                pass
            return False
        return True

    @property
    def nbytes(self) -> int:
        """Bytes the entries in the folder take now (every process's)."""
        return sum(size for _, size, _ in self._entries())

    # -- internals ---------------------------------------------------------------------------
    def _write_queued(self) -> None:
        while True:
            with self._cv:
                if not self._queue:
                    self._writer = None  # a later store_later starts a new one
                    return
                key, compile_s, produce, done, estimate = self._queue.popleft()
            written = False
            try:
                budget = self.text_budget(compile_s)
                expected = estimate() if estimate is not None else 0
                if expected is None or expected > budget:
                    self.skipped += 1
                    self.oversized += 1
                    _log.debug("capgraph: grammar %s not serialized: compiled in %.1f ms, its "
                               "serialization (estimated %s bytes) may take at most %d",
                               key[:16], compile_s * 1e3,
                               "?" if expected is None else expected, max(budget, 0))
                    continue  # (the finally clause still runs)
                text, record = produce()
                if len(text) <= budget:
                    written = self.store(key, text, record)
                else:
                    self.skipped += 1
                    _log.debug("capgraph: grammar %s not written: compiled in %.1f ms, its "
                               "%d bytes pass the %d worth writing", key[:16],
                               compile_s * 1e3, len(text), max(budget, 0))
            except Exception as e:  # noqa: BLE001 - a grammar that cannot be serialized
                _log.info("capgraph: grammar %s not written to disk: %s: %s", key[:16],
                          type(e).__name__, e)
            finally:
                if done is not None:
                    try:
                        done(written)
                    except Exception:  # noqa: BLE001 - the caller's counter
                        _log.exception("capgraph: disk cache callback failed")
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _entries(self) -> list[tuple[float, int, Path]]:
        """``(mtime, size, path)`` of every entry; removes temporary files left by dead
        writers."""
        found = []
        now = time.time()
        try:
            scan = list(os.scandir(self.directory))
        except OSError:
            return []
        for item in scan:
            try:
                st = item.stat(follow_symlinks=False)
            except OSError:
                continue  # removed meanwhile
            if _TEMP_MARK in item.name:
                if now - st.st_mtime > STALE_TEMP_S:
                    Path(item.path).unlink(missing_ok=True)
                continue
            if item.name.endswith(_SUFFIX) and item.is_file(follow_symlinks=False):
                found.append((st.st_mtime, st.st_size, Path(item.path)))
        return found

    def _evict_for(self, size: int, keep: str) -> None:
        """Delete least recently used entries until ``size`` more bytes fit (``keep``, the
        entry being replaced, is counted as gone)."""
        entries = sorted(e for e in self._entries() if e[2].name != keep)
        total = sum(s for _, s, _ in entries)
        for _, s, path in entries:
            if total + size <= self.limit_bytes:
                break
            path.unlink(missing_ok=True)  # another process may have removed it first
            total -= s
            self.evictions += 1

    def _warn_once(self, what: str, error: OSError) -> None:
        if not self._warned:
            self._warned = True
            _log.warning("capgraph: cannot %s compiled grammars in %s (%s: %s); compiles are "
                         "kept in memory only", what, self.directory, type(error).__name__,
                         error)
        else:
            _log.debug("capgraph: cannot %s %s: %s", what, self.directory, error)


#: The most bytes an entry's grammar text may inflate to (a serialized grammar is a few MiB
#: at most; a hand-made entry must not inflate into all of memory).
MAX_INFLATED_BYTES = 1 << 28


class _Damaged(Exception):
    """An entry that must not be used; the message says why."""


def _decode(key: str, data: bytes) -> tuple[dict[str, Any], str]:
    if len(data) < _HEADER.size:
        raise _Damaged(f"truncated: {len(data)} bytes, shorter than its header")
    magic, version, flags, stored_key, meta_len, payload_len, digest = \
        _HEADER.unpack_from(data)
    if magic != _MAGIC:
        raise _Damaged("not a capgraph grammar entry")
    if version != FORMAT_VERSION:
        raise _Damaged(f"format version {version}, this capgraph reads {FORMAT_VERSION}")
    if stored_key != bytes.fromhex(key):
        raise _Damaged("its header holds another key")
    expected = _HEADER.size + meta_len + payload_len
    if len(data) != expected:
        raise _Damaged(f"{len(data)} bytes where its header says {expected}")
    body = memoryview(data)[_HEADER.size:]
    if hashlib.sha256(body).digest() != digest:
        raise _Damaged("checksum mismatch")
    try:
        record = json.loads(bytes(body[:meta_len]))
        payload = bytes(body[meta_len:])
        if flags & _ZLIB:
            inflate = zlib.decompressobj()
            raw = inflate.decompress(payload, MAX_INFLATED_BYTES)
            if inflate.unconsumed_tail:
                raise _Damaged(f"inflates past {MAX_INFLATED_BYTES} bytes")
        else:
            raw = payload
        text = raw.decode("utf-8", "surrogatepass")
    except (ValueError, zlib.error, RecursionError) as e:  # (a hand-made or buggy writer's)
        raise _Damaged(f"undecodable: {type(e).__name__}: {e}") from None
    if not isinstance(record, dict):
        raise _Damaged("its record is not a JSON object")
    return record, text


_OPEN_CACHES: "weakref.WeakSet[DiskCompileCache]" = weakref.WeakSet()


@atexit.register
def _close_open_caches() -> None:
    for cache in list(_OPEN_CACHES):
        cache.close()
