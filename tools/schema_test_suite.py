"""Differential check against the official JSON Schema Test Suite: no instance the suite marks
invalid may get through a compiled schema, and no schema or instance may crash capgraph.

For every test group of the suite's keyword files (a schema and instances, each with its
``valid`` flag) and every backend (``xgrammar``, ``llguidance``, and ``fallback``: xgrammar
with ``json_unenforced_keywords="fallback"``), the schema is compiled under that backend's
policy with the Tekken tokenizer. A refused schema (``UnsupportedGuideError``) or a compile
error the backend names (another ``GrammarCompileError``) is counted. A compiled schema gets
each instance as JSON text in six spellings (:func:`spellings`), each fed token by token to a
fresh matcher and followed by the stop token; with ``--wrap``, the schema is run again put in
an ``allOf`` branch, a required property or a tuple item, each instance moved along. An
instance is accepted when any spelling is; capgraph's grammars write numbers and ``const``
objects one way only, so a valid instance refused is "stricter", not a
fault. The fault is an **invalid instance accepted**, and a crash: an exception that is not a
``CapgraphError``, or a compile or an instance over ``--timeout`` seconds (an instance still
running at twice that ends the process with every thread's traceback).

    python tools/schema_test_suite.py                             # the vendored draft 2020-12
    python tools/schema_test_suite.py PATH/tests/draft7           # a checkout's draft folder
    python tools/schema_test_suite.py --backends xgrammar --files enum.json const.json -v
    python tools/schema_test_suite.py --wrap allOf property item  # each schema moved too

The vendored copy is ``tests/data/json_schema_test_suite/draft2020-12`` (see the README
there); ``tests/test_schema_test_suite.py`` runs it. Exit status 1 on any invalid instance
accepted or any crash.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import decimal
import faulthandler
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

ROOT = Path(__file__).resolve().parent.parent
VENDORED = ROOT / "tests" / "data" / "json_schema_test_suite" / "draft2020-12"
BACKENDS = ("xgrammar", "llguidance", "fallback")
DEFAULT_TIMEOUT_S = 20.0


@dataclass
class Tally:
    """What one backend did with a set of test groups."""

    schemas: int = 0
    compiled: int = 0
    refused: int = 0  #: UnsupportedGuideError (capgraph's policy or a backend report)
    compile_errors: int = 0  #: another GrammarCompileError (the backend's own, named)
    invalid_refused: int = 0
    valid_accepted: int = 0
    valid_refused: int = 0  #: stricter than the schema: allowed
    invalid_accepted: list[str] = field(default_factory=list)  #: the hole: each one named
    crashes: list[str] = field(default_factory=list)  #: non-capgraph exceptions, timeouts

    def add(self, other: "Tally") -> None:
        """Add ``other``'s counts and lists to this one."""
        for f in dataclasses.fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            setattr(self, f.name, mine + theirs)

    @property
    def ok(self) -> bool:
        """No invalid instance accepted and no crash."""
        return not self.invalid_accepted and not self.crashes


def spellings(instance: Any) -> list[str]:
    """The JSON texts of ``instance`` fed to a matcher (distinct, in a fixed order): compact,
    ``json.dumps``' default separators, compact without ASCII escapes, and where it holds
    numbers, each number written another way (``1`` as ``1.0`` and ``1e0``, ``1.5`` as
    ``1.5E+0``, ``2.0`` as ``2``): the same value, so the same verdict."""
    texts = [json.dumps(instance, separators=(",", ":")), json.dumps(instance),
             json.dumps(instance, separators=(",", ":"), ensure_ascii=False)]
    texts += [_dumps(instance, spell) for spell in (_as_fraction, _as_exponent)]
    texts.append(_dumps(instance, json.dumps, _escaped_first))
    return list(dict.fromkeys(texts))


def _escaped_first(text: str) -> str:
    """``text`` as a JSON string whose first character is written as a ``\\uXXXX`` escape
    (the same string: a property name so spelled is the same name)."""
    if not text or ord(text[0]) > 0xFFFF:
        return json.dumps(text)
    return f'"\\u{ord(text[0]):04x}' + json.dumps(text[1:])[1:]


def _as_fraction(number: int | float) -> str:
    """``number`` written with a fraction (an integer) or without one (an integral float)."""
    if isinstance(number, float):
        return str(int(number)) if number.is_integer() else repr(number)
    return f"{number}.0"


def _as_exponent(number: int | float) -> str:
    """``number`` in exponent notation, every digit kept."""
    if isinstance(number, int):
        return f"{number}e0"
    if not math.isfinite(number):
        return json.dumps(number)
    return f"{decimal.Decimal(repr(number)):E}"


def _dumps(value: Any, number: Callable[[Any], str],
           string: Callable[[str], str] = json.dumps) -> str:
    """Compact JSON text of ``value`` with every number written by ``number`` and every
    string (property names included) by ``string``."""
    if isinstance(value, bool) or value is None:
        return json.dumps(value)
    if isinstance(value, str):
        return string(value)
    if isinstance(value, (int, float)):
        return number(value)
    if isinstance(value, list):
        return "[" + ",".join(_dumps(v, number, string) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{string(k)}:{_dumps(v, number, string)}"
                              for k, v in value.items()) + "}"
    raise TypeError(f"not a JSON value: {type(value).__name__}")


def load_groups(path: Path) -> list[dict[str, Any]]:
    """The test groups of one suite file (``[{"description", "schema", "tests"}, ...]``)."""
    groups = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(groups, list):
        raise ValueError(f"{path}: not a list of test groups")
    return groups


def suite_files(where: Path, names: Sequence[str] = ()) -> list[Path]:
    """The keyword files of a suite draft folder (its ``optional/`` folder left out), or
    ``where`` itself if it is a file; only ``names`` where given."""
    if where.is_file():
        return [where]
    if not where.is_dir():
        raise FileNotFoundError(f"{where}: no such suite file or draft folder")
    files = sorted(where.glob("*.json"))
    if names:
        wanted = {n if n.endswith(".json") else n + ".json" for n in names}
        missing = wanted - {f.name for f in files}
        if missing:
            raise FileNotFoundError(f"{where}: no {', '.join(sorted(missing))}")
        files = [f for f in files if f.name in wanted]
    return files


def make_factories(tokenizer: Any, backends: Iterable[str] = BACKENDS,
                   timeout_s: float = DEFAULT_TIMEOUT_S) -> dict[str, Any]:
    """``backend -> matcher factory`` over ``tokenizer``: the default policy for
    ``xgrammar`` and ``llguidance``, ``json_unenforced_keywords="fallback"`` (xgrammar first)
    for ``fallback``."""
    from capgraph import GuidedDecodingConfig
    from capgraph.grammar import create_matcher_factory
    out = {}
    for name in backends:
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; one of {', '.join(BACKENDS)}")
        backend = "xgrammar" if name == "fallback" else name
        policy = "fallback" if name == "fallback" else "error"
        out[name] = create_matcher_factory(GuidedDecodingConfig.from_tokenizer(
            tokenizer, backend=backend, json_unenforced_keywords=policy,
            compile_timeout_s=timeout_s))
    return out


def _accepted(factory: Any, compiled: Any, tokenizer: Any, text: str) -> bool:
    """Whether a fresh matcher takes ``text``'s tokens and then the stop token."""
    from capgraph.errors import MatcherError
    from capgraph.tokenizers import encode_continuation
    matcher = factory.create_from_compiled(compiled)
    stop = factory.config.stop_token_ids[0]
    try:
        return all(matcher.accept_token(t) for t in [*encode_continuation(tokenizer, text),
                                                       stop])
    except MatcherError:
        return False  # a matcher that refuses by raising a named error refuses



def accepted_texts(factory: Any, compiled: Any, tokenizer: Any, texts: Iterable[str],
                   timeout_s: float) -> tuple[list[str], float]:
    """The ``texts`` the compiled guide accepts (each fed token by token), and the seconds
    that took. A matcher that never returns cannot be interrupted from Python: past twice
    ``timeout_s`` the process dies with every thread's traceback on stderr (exit status 1).
    A matcher's exception propagates."""
    start = time.perf_counter()
    faulthandler.dump_traceback_later(2 * timeout_s, exit=True, file=sys.__stderr__)
    try:
        taken = [text for text in texts if _accepted(factory, compiled, tokenizer, text)]
    finally:
        faulthandler.cancel_dump_traceback_later()
    return taken, time.perf_counter() - start

def fed(factory: Any, compiled: Any, tokenizer: Any, texts: Iterable[str], name: str,
        timeout_s: float, crashes: list[str]) -> list[str] | None:
    """:func:`accepted_texts` for the case ``name``; a feed that raised (then None is
    returned) or took over ``timeout_s`` is added to ``crashes``."""
    try:
        taken, spent = accepted_texts(factory, compiled, tokenizer, texts, timeout_s)
    except Exception as e:  # noqa: BLE001 - anything is the fault the tools report
        crashes.append(f"{name}: {type(e).__name__}: {e}"[:400])
        return None
    if spent > timeout_s:
        crashes.append(f"{name}: {spent:.1f} s over {timeout_s:g} s")
    return taken


def run_group(factory: Any, tokenizer: Any, group: dict[str, Any], where: str,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> Tally:
    """One test group on one factory. ``where`` names the group in the lists of faults."""
    from capgraph import GuidedDecodingParams
    from capgraph.errors import CapgraphError, GrammarCompileError, UnsupportedGuideError

    tally = Tally(schemas=1)
    try:
        params = GuidedDecodingParams.json_schema(json.dumps(group["schema"]))
        handle = factory.compile_async(params)
        compiled = handle.future.result(timeout=timeout_s)
    except UnsupportedGuideError:
        tally.refused += 1
        return tally
    except GrammarCompileError:
        tally.compile_errors += 1
        return tally
    except concurrent.futures.TimeoutError:
        tally.crashes.append(f"{where}: compile over {timeout_s:g} s")
        return tally
    except CapgraphError:  # another named error (a ConfigError for the guide text)
        tally.compile_errors += 1
        return tally
    except Exception as e:  # noqa: BLE001 - anything else is the fault this tool reports
        tally.crashes.append(f"{where}: compile raised {type(e).__name__}: {e}"[:300])
        return tally
    tally.compiled += 1
    for test in group["tests"]:
        name = f"{where} / {test['description']}"
        taken = fed(factory, compiled, tokenizer, spellings(test["data"]), name, timeout_s,
                    tally.crashes)
        if taken is None:
            continue
        if test["valid"]:
            if taken:
                tally.valid_accepted += 1
            else:
                tally.valid_refused += 1
        elif taken:
            tally.invalid_accepted.append(f"{name}: accepted {taken[0][:120]}")
        else:
            tally.invalid_refused += 1
    return tally


#: Places a group's schema can be put, with the instances moved along: name -> (schema of
#: the suite's schema, instance of the suite's instance). The verdicts stay the suite's.
WRAPS: dict[str, tuple[Callable[[Any], Any], Callable[[Any], Any]]] = {
    "allOf": (lambda s: {"allOf": [s]}, lambda d: d),
    "property": (lambda s: {"type": "object", "properties": {"x": s}, "required": ["x"],
                            "additionalProperties": False}, lambda d: {"x": d}),
    "item": (lambda s: {"type": "array", "prefixItems": [s], "items": False, "minItems": 1},
             lambda d: [d]),
}
# keywords whose meaning depends on where the schema sits in its document
_PLACED = ("$ref", "$dynamicRef", "$recursiveRef", "$id", "$anchor", "$dynamicAnchor",
           "$recursiveAnchor")


def wrapped(group: dict[str, Any], wrap: str) -> dict[str, Any] | None:
    """``group`` with its schema and instances put in the place ``wrap`` names
    (:data:`WRAPS`; the schema's own ``$schema`` kept at the new root), or None where the
    schema holds a reference or an identifier (which would then resolve elsewhere)."""
    schema = group["schema"]
    if any(f'"{k}"' in json.dumps(schema) for k in _PLACED):
        return None
    declared = schema.get("$schema") if isinstance(schema, dict) else None
    if declared is not None:
        schema = {k: v for k, v in schema.items() if k != "$schema"}
    schema_of, instance_of = WRAPS[wrap]
    new = schema_of(schema)
    if declared is not None:
        new = {"$schema": declared, **new}
    return {"description": group.get("description", ""), "schema": new,
            "tests": [dict(t, data=instance_of(t["data"])) for t in group["tests"]]}


def run_file(factories: dict[str, Any], tokenizer: Any, path: Path,
             timeout_s: float = DEFAULT_TIMEOUT_S, wraps: Sequence[str] = ()
             ) -> dict[str, Tally]:
    """Every group of one suite file on every factory, as written and put in each place of
    ``wraps`` (:data:`WRAPS`): ``backend -> Tally``."""
    out = {}
    groups = load_groups(path)
    for backend, factory in factories.items():
        tally = Tally()
        for i, group in enumerate(groups):
            name = f"{path.name}#{i} {group.get('description', '')!r}"
            tally.add(run_group(factory, tokenizer, group, name, timeout_s))
            for wrap in wraps:
                moved = wrapped(group, wrap)
                if moved is not None:
                    tally.add(run_group(factory, tokenizer, moved, f"{name} in {wrap}",
                                        timeout_s))
        out[backend] = tally
    return out


def table(totals: dict[str, Tally]) -> str:
    """The summary table, one row per backend (Markdown)."""
    lines = ["| backend | schemas | compiled | refused | compile errors | crashes | "
             "invalid refused | INVALID ACCEPTED | valid accepted | valid refused |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for backend, t in totals.items():
        lines.append(f"| {backend} | {t.schemas} | {t.compiled} | {t.refused} | "
                     f"{t.compile_errors} | {len(t.crashes)} | {t.invalid_refused} | "
                     f"{len(t.invalid_accepted)} | {t.valid_accepted} | {t.valid_refused} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """The command line: see the module docstring."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", nargs="?", type=Path, default=VENDORED,
                        help="a draft folder of the suite (tests/draft2020-12) or one file of "
                             "it (default: the vendored draft 2020-12 files)")
    parser.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=BACKENDS)
    parser.add_argument("--files", nargs="+", default=[],
                        help="only these keyword files (enum.json or enum)")
    parser.add_argument("--wrap", nargs="*", default=[], choices=sorted(WRAPS),
                        help="also run each group's schema (without references) put in these "
                             "places: an allOf branch, a required property, a tuple item")
    parser.add_argument("--tokenizer", default="tekken")
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S,
                        help="seconds one compile or one instance may take (default %(default)s)")
    parser.add_argument("-v", "--verbose", action="store_true", help="a line per file")
    args = parser.parse_args(argv)

    from capgraph.tokenizers import load_tokenizer
    files = suite_files(args.suite, args.files)
    tokenizer = load_tokenizer(args.tokenizer)
    factories = make_factories(tokenizer, args.backends, args.timeout)
    totals = {b: Tally() for b in factories}
    start = time.perf_counter()
    try:
        for path in files:
            for backend, tally in run_file(factories, tokenizer, path, args.timeout,
                                           args.wrap).items():
                totals[backend].add(tally)
                if args.verbose:
                    print(f"{path.name:32} {backend:10} compiled {tally.compiled}/"
                          f"{tally.schemas}, invalid accepted {len(tally.invalid_accepted)}, "
                          f"crashes {len(tally.crashes)}", flush=True)
    finally:
        for factory in factories.values():
            factory.close()
    wraps = f", also in {', '.join(args.wrap)}" if args.wrap else ""
    print(f"JSON Schema Test Suite, {args.suite.name}: {len(files)} files{wraps}, tokenizer "
          f"{args.tokenizer}, {time.perf_counter() - start:.0f} s")
    print(table(totals))
    for backend, t in totals.items():
        for what, items in (("INVALID ACCEPTED", t.invalid_accepted), ("CRASH", t.crashes)):
            for item in items:
                print(f"{backend}: {what}: {item}")
    return 0 if all(t.ok for t in totals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
