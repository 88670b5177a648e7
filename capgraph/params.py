"""Guide parameters per request and the decoder-wide configuration.

``GuidedDecodingParams`` says what one request must follow; ``GuidedDecodingConfig`` says how
grammars are compiled for every request (backend, vocabulary, stop tokens, cache, timeout).
Both validate in ``__post_init__`` and raise :class:`~capgraph.errors.ConfigError` naming the
bad field and the value received.
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
import re
import sys
from collections.abc import Mapping, Set as AbstractSet
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from .errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "GuideType",
    "GuidedDecodingBackend",
    "GuidedDecodingParams",
    "GuidedDecodingConfig",
    "COMPILE_CACHE_ENV",
    "COMPILE_DISK_CACHE_ENV",
    "NATIVE_BUILD_ENV",
    "native_build_env",
    "DEFAULT_COMPILE_CACHE_BYTES",
    "DEFAULT_COMPILE_DISK_CACHE_BYTES",
    "JSON_WHITESPACE_MODES",
    "MAX_COMPILE_TIMEOUT_S",
    "MAX_JSON_WHITESPACE",
    "COMPILE_ISOLATION_MODES",
    "DEFAULT_COMPILE_MEMORY_LIMIT_BYTES",
]

#: Environment variable that sets the default of ``GuidedDecodingConfig.compile_cache_bytes``
#: (bytes; suffixes K, M, G accepted, e.g. ``512M``); an explicit argument wins.
COMPILE_CACHE_ENV = "CAPGRAPH_COMPILE_CACHE_BYTES"
#: Environment variable that sets the default of
#: ``GuidedDecodingConfig.compile_disk_cache_bytes`` (same syntax; 0 turns the disk cache off).
COMPILE_DISK_CACHE_ENV = "CAPGRAPH_COMPILE_DISK_CACHE_BYTES"
#: Environment variable that sets the default of ``GuidedDecodingConfig.native_build`` (auto,
#: on, off; an explicit argument wins); ``off`` also keeps the process-wide CPU mask pass from
#: compiling.
NATIVE_BUILD_ENV = "CAPGRAPH_NATIVE_BUILD"


NATIVE_BUILD_MODES = ("auto", "on", "off")
#: Where xgrammar compiles run (``GuidedDecodingConfig.compile_isolation``).
COMPILE_ISOLATION_MODES = ("thread", "process")
#: Default of ``GuidedDecodingConfig.compile_memory_limit_bytes``: 4 GiB per compile worker.
DEFAULT_COMPILE_MEMORY_LIMIT_BYTES = 4 << 30


def _default_cache_bytes() -> int:
    """``compile_cache_bytes`` when not given: ``$CAPGRAPH_COMPILE_CACHE_BYTES``, else 1 GiB."""
    env = os.environ.get(COMPILE_CACHE_ENV)
    return _parse_bytes(env, COMPILE_CACHE_ENV) if env else DEFAULT_COMPILE_CACHE_BYTES


def _default_disk_cache_bytes() -> int:
    """``compile_disk_cache_bytes`` when not given: ``$CAPGRAPH_COMPILE_DISK_CACHE_BYTES``,
    else 1 GiB."""
    env = os.environ.get(COMPILE_DISK_CACHE_ENV)
    return _parse_bytes(env, COMPILE_DISK_CACHE_ENV) if env else \
        DEFAULT_COMPILE_DISK_CACHE_BYTES


def _default_native_build() -> str:
    """``native_build`` when not given: ``$CAPGRAPH_NATIVE_BUILD``, else ``"auto"``."""
    env = native_build_env()
    if env is None:
        return "auto"
    if env not in NATIVE_BUILD_MODES:
        raise ConfigError(f"{NATIVE_BUILD_ENV}={env!r}; expected 'auto', 'on' or 'off'")
    return env


def native_build_env() -> str | None:
    """``$CAPGRAPH_NATIVE_BUILD`` lower-cased, or None when unset or empty (the default of
    ``GuidedDecodingConfig.native_build``; ``"off"`` also stops the CPU mask pass)."""
    env = os.environ.get(NATIVE_BUILD_ENV, "").strip().lower()
    return env or None
DEFAULT_COMPILE_CACHE_BYTES = 1 << 30
DEFAULT_COMPILE_DISK_CACHE_BYTES = 1 << 30
#: Values of ``GuidedDecodingConfig.json_whitespace``.
JSON_WHITESPACE_MODES = ("any", "compact", "bounded")
#: Largest ``GuidedDecodingConfig.json_max_whitespace``.
MAX_JSON_WHITESPACE = 256


class GuideType(enum.Enum):
    """What kind of constraint a guide string holds."""

    JSON = "json"  #: a JSON object or array; the guide string is ignored (may be empty)
    JSON_SCHEMA = "json_schema"  #: a JSON Schema document (text)
    REGEX = "regex"  #: a regular expression the whole output must match
    EBNF_GRAMMAR = "ebnf_grammar"  #: GBNF/EBNF for xgrammar, Lark for llguidance
    STRUCTURAL_TAG = "structural_tag"  #: xgrammar structural tag (JSON text)


class GuidedDecodingBackend(enum.Enum):
    """Grammar engine used to compile guides and match tokens."""

    XGRAMMAR = "xgrammar"
    LLGUIDANCE = "llguidance"
    #: fast start: a regex or JSON-schema request starts on llguidance while xgrammar compiles,
    #: then xgrammar takes over (:mod:`capgraph.grammar.handover`)
    AUTO = "auto"


@dataclass(frozen=True, slots=True)
class GuidedDecodingParams:
    """The constraint of one request.

    Args:
        guide_type: the kind of guide (a :class:`GuideType` or its value string, e.g. ``"regex"``).
        guide: the guide text; ignored for ``GuideType.JSON``, required non-empty otherwise.
            A JSON schema may also be given as a ``dict``; it is serialised to text.
    """

    guide_type: GuideType
    guide: str = ""

    def __post_init__(self) -> None:
        gt: GuideType | str = self.guide_type
        if isinstance(gt, str):
            name = gt
            try:
                gt = GuideType(name.lower())
            except ValueError:
                try:
                    gt = GuideType[name.upper()]
                except KeyError:
                    raise ConfigError(
                        f"GuidedDecodingParams.guide_type: unknown guide type {self.guide_type!r}; "
                        f"expected one of {[t.value for t in GuideType]}") from None
            object.__setattr__(self, "guide_type", gt)
        elif not isinstance(gt, GuideType):
            raise ConfigError(
                f"GuidedDecodingParams.guide_type: expected GuideType or str, got {gt!r}")
        guide = self.guide
        if isinstance(guide, dict) and gt is GuideType.JSON_SCHEMA:
            try:
                # (no NaN / Infinity, which JSON has not; keys that print alike, 1 and "1",
                # would be one key twice, the first lost to a parser)
                guide = json.dumps(guide, allow_nan=False)
                json.loads(guide, object_pairs_hook=_no_repeated_keys)
            except (TypeError, ValueError) as e:
                raise ConfigError(f"GuidedDecodingParams.guide: the schema dict is not JSON "
                                  f"({e})") from None
            except RecursionError:
                raise ConfigError("GuidedDecodingParams.guide: the schema dict nests too deeply "
                                  "to serialise (dicts and lists inside each other deeper than "
                                  f"Python's recursion limit, {sys.getrecursionlimit()})"
                                  ) from None
            object.__setattr__(self, "guide", guide)
        if guide is None:
            guide = ""
            object.__setattr__(self, "guide", guide)
        if not isinstance(guide, str):
            raise ConfigError(
                f"GuidedDecodingParams.guide: expected str, got {type(guide).__name__}")
        # (a regex of whitespace only, " " or "\n", is a guide: one space, one newline)
        if gt is not GuideType.JSON and not (guide if gt is GuideType.REGEX else guide.strip()):
            raise ConfigError(
                f"GuidedDecodingParams.guide: empty guide for guide_type {gt.name}; "
                "only GuideType.JSON takes no guide")
        if gt in (GuideType.JSON_SCHEMA, GuideType.STRUCTURAL_TAG):
            _refuse_trailing_text(gt, guide)


    @classmethod
    def json_schema(cls, schema: str | dict[str, Any]) -> "GuidedDecodingParams":
        """A JSON-schema guide from schema text or a dict."""
        return cls(GuideType.JSON_SCHEMA, schema)  # type: ignore[arg-type]

    @classmethod
    def regex(cls, pattern: str) -> "GuidedDecodingParams":
        return cls(GuideType.REGEX, pattern)

    @classmethod
    def ebnf(cls, grammar: str) -> "GuidedDecodingParams":
        return cls(GuideType.EBNF_GRAMMAR, grammar)

    @classmethod
    def json(cls) -> "GuidedDecodingParams":
        return cls(GuideType.JSON, "")

    @classmethod
    def structural_tag(cls, tag: str) -> "GuidedDecodingParams":
        return cls(GuideType.STRUCTURAL_TAG, tag)


def _refuse_trailing_text(guide_type: GuideType, text: str) -> None:
    """Refuse JSON guide text with anything but whitespace after its first JSON value: a
    backend would compile that first value alone, and a schema's keyword checks would see
    text that is not the guide. Text whose first value does not parse is left to the
    backend, whose compile error says where."""
    start = len(text) - len(text.lstrip())
    try:
        _, end = _JSON_DECODER.raw_decode(text, start)
    except ValueError:
        return
    except RecursionError:  # (the parser recurses per nesting level)
        raise ConfigError(f"GuidedDecodingParams.guide: the {guide_type.name} text nests "
                          f"{_json_nesting(text)} levels deep (arrays and objects inside each "
                          "other), too deep to parse within Python's recursion limit "
                          f"({sys.getrecursionlimit()}); a guide nests at most a few hundred "
                          "levels") from None
    if text[end:].strip():
        raise ConfigError(f"GuidedDecodingParams.guide: the {guide_type.name} text has more after "
                          f"its JSON value at character {end}: {text[end:end + 40]!r}; a guide "
                          "is one JSON document")


_JSON_DECODER = json.JSONDecoder()
_JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}


def _json_nesting(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text`` (strings skipped), counted
    without recursion (for the error of a guide too deep to parse)."""
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def _parse_bytes(text: str, env: str) -> int:
    t = text.strip().upper().removesuffix("B")
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    if scale != 1:
        t = t[:-1]
    try:
        value = float(t) * scale
    except ValueError:
        raise ConfigError(f"{env}={text!r} is not a byte count "
                          "(examples: 1073741824, 512M, 1G)") from None
    if not math.isfinite(value) or value < 0 or value != int(value) or value > _MAX_BYTES:
        raise ConfigError(f"{env}={text!r} must be a whole byte count in [0, {_MAX_BYTES}]")
    return int(value)


#: The largest byte count a config field or variable takes (2**62: past it no cache or
#: process limit means anything, and the OS's own limits overflow).
_MAX_BYTES = 1 << 62


#: The widest ``GuidedDecodingConfig.vocab_size_padded`` accepted: token ids are int32 on
#: every path (xgrammar, the bitmask kernels), so 2**31 - 1 is the hard bound.
MAX_VOCAB_SIZE = 2**31 - 1
#: The longest ``GuidedDecodingConfig.compile_timeout_s`` accepted (one day): longer ones are
#: mistakes, and beyond ``threading.TIMEOUT_MAX`` a wait raises OverflowError.
MAX_COMPILE_TIMEOUT_S = 24 * 3600.0
#: Default of ``GuidedDecodingConfig.max_repetition_count``
#: (:mod:`capgraph.grammar.guide_limits` says how it was chosen).
DEFAULT_MAX_REPETITION_COUNT = 65_535
#: Default of ``GuidedDecodingConfig.host_step_budget_ms``: about 10**4 times a plain request's
#: host step (docs/BENCHMARKS.md, "build"), below the 93-234 ms an ambiguous regex reaches.
DEFAULT_HOST_STEP_BUDGET_MS = 50.0
#: The largest ``host_step_budget_ms`` accepted (one minute; beyond it, use None).
MAX_HOST_STEP_BUDGET_MS = 60_000.0


def _no_repeated_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` hook: a JSON object, refusing a key written twice (ValueError)."""
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"the key {next(k for k in keys if keys.count(k) > 1)!r} comes "
                         "twice in one object (keys that are not strings print as strings)")
    return dict(pairs)


def _field_error(name: str, value: Any, expected: str) -> ConfigError:
    return ConfigError(f"GuidedDecodingConfig.{name}={value!r}: expected {expected}")


def _int_field(name: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """A config integer: an int (not a bool, not a float) in ``[minimum, maximum]``."""
    if type(value) is not int or value < minimum or (maximum is not None and value > maximum):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise _field_error(name, value, f"an int {bound}")
    return value


def _seconds_field(name: str, value: Any, maximum: float) -> float:
    """A config duration: a finite int or float in ``(0, maximum]`` seconds (not a bool)."""
    if type(value) not in (int, float) or not 0 < value <= maximum:  # (nan fails too)
        raise _field_error(name, value, f"a number of seconds in (0, {maximum:g}]")
    return float(value)


def _choice_field(name: str, value: Any, choices: Sequence[str]) -> str:
    """A config string that must be one of ``choices``."""
    if type(value) is not str or value not in choices:
        raise _field_error(name, value, f"one of {list(choices)}")
    return value


def _check_eos_is_its_token(tokenizer: Any, eos: int) -> None:
    """Refuse a tokenizer whose EOS id spells another token than its EOS token (an EOS
    string missing from the vocabulary maps to the unknown token's id: that would end
    outputs)."""
    name = getattr(tokenizer, "eos_token", None)
    convert = getattr(tokenizer, "convert_ids_to_tokens", None)
    if not isinstance(name, str) or convert is None:
        return
    try:
        spelled = convert(eos)
    except Exception:  # noqa: BLE001 - a tokenizer that cannot say: nothing to compare
        return
    if isinstance(spelled, str) and spelled != name:
        raise ConfigError(
            f"GuidedDecodingConfig.stop_token_ids: the tokenizer's EOS token {name!r} is not "
            f"in its vocabulary (eos_token_id={eos} is {spelled!r}); pass stop_token_ids=[...]")


def _token_ids_field(name: str, value: Any) -> list[int]:
    """A non-empty collection of integer token ids (a str, a bare int or a 0-d array is
    refused, and so is a bool, however it is held)."""
    if isinstance(value, (str, bytes, dict)) or not hasattr(value, "__iter__") \
            or getattr(value, "ndim", 1) == 0:
        raise _field_error(name, value, "a list of integer token ids")
    ids = []
    for t in value:
        if isinstance(t, (bool, float, str, bytes)) or not hasattr(t, "__index__") \
                or "bool" in str(getattr(t, "dtype", "")):
            raise _field_error(name, value, f"a list of integer token ids ({t!r} is not one)")
        try:
            ids.append(t.__index__())
        except Exception:
            raise _field_error(name, value, f"a list of integer token ids ({t!r} is not "
                                            "one)") from None
    if not ids:
        raise _field_error(name, value, "at least one stop token id (None: the tokenizer's "
                                        "EOS)")
    return ids


@dataclass(frozen=True, slots=True)
class GuidedDecodingConfig:
    """How guides are compiled and matched, shared by every request of a decoder.

    Every field is checked at construction: a wrong type (a bool or float where an int
    belongs, a string where a list or bool belongs) or value raises
    :class:`~capgraph.errors.ConfigError` naming the field, the value and what is allowed.
    The config is frozen (assigning a field raises ``dataclasses.FrozenInstanceError``):
    factories, decoders and the caches' keys read it once; ``dataclasses.replace(config,
    field=value)`` makes a changed, checked copy.

    Args:
        backend: grammar engine (:class:`GuidedDecodingBackend` or ``"xgrammar"`` /
            ``"llguidance"`` / ``"auto"``). ``"auto"`` (fast start,
            :mod:`capgraph.grammar.handover`): a regex or JSON-schema request whose xgrammar
            grammar is not compiled yet starts on llguidance and is handed over to xgrammar
            when its compile lands; other guide types, and guides xgrammar has compiled
            already, go to xgrammar; a JSON schema one backend refuses is served by the other,
            refused only when both refuse it. Needs the llguidance extra, a tokenizer, exactly
            one stop token and ``json_unenforced_keywords`` other than ``"ignore"``.
        tokenizer: a Hugging Face tokenizer; the vocabulary and its metadata (vocab type,
            prefix space) are read from it. Either this or ``encoded_vocab`` is required.
        encoded_vocab: the vocabulary as strings indexed by token id (xgrammar only, used
            when no tokenizer is given; read as a raw vocabulary).
        stop_token_ids: tokens that end a guided output: a non-empty list (or tuple) of
            integer ids; None (the default) takes the tokenizer's EOS (a tokenizer without
            one is a ConfigError: pass the ids). With ``encoded_vocab`` alone None means no
            stop token: a guide that completes leaves no valid token, and its request fails
            (``DeadEndError``) instead of ending. llguidance takes exactly one.
        vocab_size_padded: width of the logits rows (>= the tokenizer's vocabulary); 0 (the
            default; ``None`` is read the same) means the tokenizer's vocabulary. Ids at or
            above the tokenizer's vocabulary are always masked on guided rows.
        compile_cache_bytes: byte budget of the compiled-grammar cache; 0 disables caching.
            Default: the environment variable ``CAPGRAPH_COMPILE_CACHE_BYTES`` where set (a
            finite byte count), else 1 GiB; an explicit value wins over the variable.
        compile_disk_cache_bytes: byte budget of the compiled grammars kept on disk under
            ``$CAPGRAPH_CACHE_DIR/grammars`` (:mod:`capgraph.grammar.disk_cache`), so a
            restarted process loads them instead of compiling; least recently used entries
            go first; 0 turns it off. Default: the environment variable
            ``CAPGRAPH_COMPILE_DISK_CACHE_BYTES`` where set, else 1 GiB; an explicit value
            wins over the variable.
        compile_timeout_s: a compile that takes longer fails its request alone; a finite
            number of seconds up to ``MAX_COMPILE_TIMEOUT_S`` (one day).
        compile_threads: compiles that run at once off the decode path for requests that
            wait for them (with ``compile_isolation="process"``: compile worker processes);
            as many again may run for background compiles (``backend="auto"``'s xgrammar
            compiles behind llguidance), at the lowest CPU priority, so that those never
            hold a compile a request waits for.
        compile_isolation: where xgrammar compiles run. ``"thread"`` (default): on threads of
            the decoder's process; a compile past its timeout fails its request but runs on.
            ``"process"``: in spawned worker processes (:mod:`capgraph.grammar.process_pool`);
            a compile whose every waiter timed out is killed, so its CPU and memory come back
            (one that had not reached a worker yet never runs), and compiles queued beyond
            ``4 * compile_threads`` fail at once with
            :class:`~capgraph.errors.CompileQueueFullError`. Workers run at a lower CPU
            priority (nice 10) than the decode loop. Guides estimated cheap
            (:func:`capgraph.grammar.compile_cost.why_not_cheap`: builtin JSON, short regexes,
            small schemas without combinators, references or ``additionalProperties``)
            still compile on threads of the decoder's process, skipping the worker's
            serialize-and-load round trip; EBNF grammars and structural tags always go to a
            worker. llguidance compiles (about 1 ms) always run on threads.
        compile_memory_limit_bytes: with ``compile_isolation="process"``, the address space a
            compile worker may add to what it holds once started (``RLIMIT_AS``; Linux and
            macOS); a compile over it fails its request with
            :class:`~capgraph.errors.CompileResourceError`. Default 4 GiB; 0: no limit.
        fill_threads: threads of xgrammar's batched bitmask fill; 1 (default) fills in the
            calling thread, 0 lets xgrammar choose (half the hardware threads). Measured with
            batches of 8 and 64 on a 2-core and a 16-core host, every thread count above 1 made
            the fill slower (docs/BENCHMARKS.md): the hand-off to the pool's threads costs more
            than the rows it spreads. The native build (``native_build``) needs 1 here and
            has a pool of its own, ``native_fill_threads``.
        native_fill_threads: threads of the native build's fill (:mod:`capgraph.build.native`):
            the calling thread and ``native_fill_threads - 1`` threads of a pool of the
            decoder's own (started by the first step that uses them, parked between steps,
            ended by ``close()``), which split a step's requests from
            ``capgraph.build.library.POOL_MIN_REQUESTS`` requests on, where they pay;
            smaller steps fill on the calling thread. Masks, counters and failures are the
            same for every value. 0 (default): automatic, ``min(cores, 8)`` (1 on one core);
            1: the calling thread only; up to 256. A field of its own, not ``fill_threads``:
            that one sizes xgrammar's batch fill for the Python build, where more threads
            were measured slower (see above), and the native build requires it at 1.
        native_build: the every-step build loop in C++ (:mod:`capgraph.build.native`,
            xgrammar or auto backend with ``fill_threads=1``; an auto request once handed
            over to xgrammar): ``"auto"`` (default) compiles it on the
            first decoder of the machine (a few seconds, then cached on disk) and falls back to
            the Python loop, with one warning, where it cannot; ``"on"`` makes that an error;
            ``"off"`` always runs the Python loop. Both give the same masks, counters and
            failures. Default: the environment variable ``CAPGRAPH_NATIVE_BUILD`` where set,
            else ``"auto"``; an explicit value wins over the variable.
        json_whitespace: whitespace outside strings in JSON and JSON-schema guides, the same
            on both backends (whitespace is space, newline, carriage return, tab; never before
            or after the whole value). ``"any"`` (default): any amount between tokens.
            ``"compact"``: none, so ``{"a":1,"b":[2,3]}`` is the only spelling of that value.
            ``"bounded"``: any whitespace, at most ``json_max_whitespace`` characters in a row,
            so a model cannot loop on whitespace until it runs out of tokens.
        json_max_whitespace: the longest whitespace run ``"bounded"`` allows (1 to 256;
            default 8, enough for a newline and a three-level indent; xgrammar's compile time
            grows with it, about 0.3 s at 256).
        json_unenforced_keywords: what happens to a JSON schema with a constraint the backend
            is not known to enforce (decided per keyword and combination, and from what the
            backend reports while compiling: :mod:`capgraph.grammar.schema_policy`,
            ``docs/CONFORMANCE.md``). ``"error"`` (default): it fails to compile with an
            :class:`~capgraph.errors.UnsupportedGuideError` naming the keyword and its JSON
            pointer. ``"fallback"``: it is compiled by the other backend if that one enforces
            it, per request (the compiled guide's ``backend`` and ``fallback_reason`` say which
            served it and why), and refused if neither does; needs the llguidance extra, a
            tokenizer and exactly one stop token. ``"ignore"``: it compiles with those
            constraints unenforced.
        max_repetition_count: the largest repetition count a guide may ask for (regex
            ``{n,m}``, EBNF repetitions, JSON-schema ``minLength`` / ``maxItems`` / ...); a
            guide above it fails to compile with an
            :class:`~capgraph.errors.UnsupportedGuideError` naming the count and where it is
            (:mod:`capgraph.grammar.guide_limits`). An int in ``[1, 2**31 - 1]``; default 65535.
        host_step_budget_ms: milliseconds one request's host step (accepting its tokens
            and filling its rows) may take, in wall time and in the CPU time of the thread
            that runs it (time a thread spends preempted or waiting for the GIL does not
            count; the CPU clock is read once per quarter budget, so a request fails by 1.25
            budgets of CPU time at the latest); a request over it fails alone with a
            :class:`~capgraph.errors.BudgetExceededError` (rows unmasked, matcher dropped),
            so an ambiguous guide whose per-token cost grows cannot slow its batch step after
            step. Default 50; 0 or None: no budget.
    """

    backend: GuidedDecodingBackend = GuidedDecodingBackend.XGRAMMAR
    tokenizer: "PreTrainedTokenizerBase | None" = None
    encoded_vocab: Sequence[str] | None = None
    stop_token_ids: list[int] | None = None
    vocab_size_padded: int = 0
    compile_cache_bytes: int = field(default_factory=_default_cache_bytes)
    compile_disk_cache_bytes: int = field(default_factory=_default_disk_cache_bytes)
    compile_timeout_s: float = 30.0
    compile_threads: int = 2
    compile_isolation: str = "thread"
    compile_memory_limit_bytes: int = DEFAULT_COMPILE_MEMORY_LIMIT_BYTES
    fill_threads: int = 1
    native_fill_threads: int = 0
    native_build: str = field(default_factory=_default_native_build)
    json_whitespace: str = "any"
    json_max_whitespace: int = 8
    json_unenforced_keywords: str = "error"
    max_repetition_count: int = DEFAULT_MAX_REPETITION_COUNT
    host_step_budget_ms: float | None = DEFAULT_HOST_STEP_BUDGET_MS
    tokenizer_vocab_size: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        _set = object.__setattr__  # (frozen: the checked values are set once, here)
        # every field is checked here, each by one line or helper (_int_field, _seconds_field,
        # _choice_field, _token_ids_field), naming the field, the value and what is allowed
        if isinstance(self.backend, str):
            try:
                _set(self, "backend", GuidedDecodingBackend(self.backend.lower()))
            except ValueError:
                raise ConfigError(
                    f"GuidedDecodingConfig.backend: unknown backend {self.backend!r}; expected "
                    f"one of {[b.value for b in GuidedDecodingBackend]}") from None
        if not isinstance(self.backend, GuidedDecodingBackend):
            raise _field_error("backend", self.backend, "a GuidedDecodingBackend or one of "
                               f"{[b.value for b in GuidedDecodingBackend]}")
        if self.tokenizer is None and self.encoded_vocab is None:
            raise ConfigError("GuidedDecodingConfig: give a tokenizer or an encoded_vocab")
        if self.tokenizer is not None:
            try:
                _set(self, "tokenizer_vocab_size", len(self.tokenizer))
                if not hasattr(self.tokenizer, "get_vocab") or self.tokenizer_vocab_size < 1:
                    raise TypeError
            except TypeError:
                raise _field_error("tokenizer", self.tokenizer, "a Hugging Face tokenizer "
                                   "(get_vocab(), and len() >= 1 its vocabulary size)") from None
            from .tokenizers import check_decode_round_trips
            check_decode_round_trips(self.tokenizer)  # (what decode() shows is what was guided)
        else:
            vocab = self.encoded_vocab
            if isinstance(vocab, Mapping):
                raise _field_error("encoded_vocab", type(vocab).__name__,
                                   "a sequence of token strings indexed by token id (a "
                                   "mapping is not one: for get_vocab()'s token -> id, pass "
                                   "the tokens sorted by id)")
            if isinstance(vocab, (str, bytes, AbstractSet)) or not hasattr(vocab, "__iter__"):
                raise _field_error("encoded_vocab", type(vocab).__name__,
                                   "a sequence of token strings indexed by token id")
            vocab = list(vocab)  # type: ignore[arg-type]  # (once: a generator is read here)
            if not all(isinstance(t, (str, bytes)) for t in vocab):
                raise _field_error("encoded_vocab", "a sequence with a non-string",
                                   "a sequence of token strings indexed by token id")
            _set(self, "encoded_vocab", vocab)
            if not self.encoded_vocab:
                raise ConfigError("GuidedDecodingConfig.encoded_vocab: empty vocabulary")
            _set(self, "tokenizer_vocab_size", len(self.encoded_vocab))
            if self.backend is not GuidedDecodingBackend.XGRAMMAR:
                raise ConfigError(f"GuidedDecodingConfig: the {self.backend.value} backend "
                                  "needs a tokenizer, not only an encoded_vocab")
        if self.vocab_size_padded is None or (type(self.vocab_size_padded) is int
                                               and self.vocab_size_padded == 0):
            _set(self, "vocab_size_padded", self.tokenizer_vocab_size)
        _int_field("vocab_size_padded", self.vocab_size_padded, 0, MAX_VOCAB_SIZE)
        if self.vocab_size_padded < self.tokenizer_vocab_size:
            raise ConfigError(
                f"GuidedDecodingConfig.vocab_size_padded={self.vocab_size_padded} is smaller "
                f"than the tokenizer's vocabulary ({self.tokenizer_vocab_size})")
        if self.stop_token_ids is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            if self.tokenizer is not None and type(eos) is not int:
                raise ConfigError(
                    f"GuidedDecodingConfig.stop_token_ids: the tokenizer has no EOS token "
                    f"(eos_token_id={eos!r}); pass stop_token_ids=[...], the ids that end a "
                    "guided output")
            # (an encoded_vocab without stop_token_ids has none: a guide that completes
            # then leaves no valid token and its request fails with DeadEndError)
            stops: list[int] = [eos] if type(eos) is int else []
            if self.tokenizer is not None and type(eos) is int:
                _check_eos_is_its_token(self.tokenizer, eos)
        else:
            stops = _token_ids_field("stop_token_ids", self.stop_token_ids)
        _set(self, "stop_token_ids", stops)
        for t in stops:
            if not 0 <= t < self.tokenizer_vocab_size:
                raise ConfigError(
                    f"GuidedDecodingConfig.stop_token_ids: {t} is outside the vocabulary "
                    f"[0, {self.tokenizer_vocab_size})")
        if (self.backend is not GuidedDecodingBackend.XGRAMMAR
                and len(stops) != 1):
            raise ConfigError(
                f"GuidedDecodingConfig.stop_token_ids: the {self.backend.value} backend takes "
                f"exactly one stop token, got {stops}")
        _int_field("compile_cache_bytes", self.compile_cache_bytes, 0, _MAX_BYTES)
        _int_field("compile_disk_cache_bytes", self.compile_disk_cache_bytes, 0, _MAX_BYTES)
        _set(self, "compile_timeout_s", _seconds_field("compile_timeout_s",
                                                       self.compile_timeout_s,
                                                       MAX_COMPILE_TIMEOUT_S))
        _int_field("compile_threads", self.compile_threads, 1, 1024)
        _choice_field("compile_isolation", self.compile_isolation, COMPILE_ISOLATION_MODES)
        _int_field("compile_memory_limit_bytes", self.compile_memory_limit_bytes, 0, _MAX_BYTES)
        _choice_field("json_unenforced_keywords", self.json_unenforced_keywords,
                      ("error", "fallback", "ignore"))
        if (self.backend is GuidedDecodingBackend.AUTO
                and self.json_unenforced_keywords == "ignore"):
            raise ConfigError(
                "GuidedDecodingConfig: backend='auto' hands a request from llguidance to "
                "xgrammar only where both enforce its schema, which "
                "json_unenforced_keywords='ignore' hides; use 'error' or 'fallback'")
        _int_field("fill_threads", self.fill_threads, 0, 1024)
        _int_field("native_fill_threads", self.native_fill_threads, 0, 256)  # (MAX_FILL_THREADS)
        _int_field("max_repetition_count", self.max_repetition_count, 1, 2**31 - 1)
        budget = self.host_step_budget_ms
        if budget is not None and (type(budget) not in (int, float)
                                   or not 0 <= budget <= MAX_HOST_STEP_BUDGET_MS):
            raise _field_error("host_step_budget_ms", budget, "a number of milliseconds in "
                               f"[0, {MAX_HOST_STEP_BUDGET_MS:g}], or None (0 and None: no "
                               "budget)")
        _choice_field("json_whitespace", self.json_whitespace, JSON_WHITESPACE_MODES)
        _int_field("json_max_whitespace", self.json_max_whitespace, 1, MAX_JSON_WHITESPACE)
        if type(self.native_build) is not str or self.native_build not in NATIVE_BUILD_MODES:
            raise ConfigError(f"GuidedDecodingConfig.native_build={self.native_build!r}; "
                              "expected 'auto', 'on' or 'off'")

    @classmethod
    def from_tokenizer(cls, tokenizer: "PreTrainedTokenizerBase", **kwargs: Any
                       ) -> "GuidedDecodingConfig":
        """Config for a Hugging Face tokenizer; keyword arguments are the other fields."""
        return cls(tokenizer=tokenizer, **kwargs)
