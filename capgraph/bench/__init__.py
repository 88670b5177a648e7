"""``capgraph bench``: the benchmark suite, one module per sub-benchmark.

    capgraph bench {build,tail,compile,apply,memory,loop,spec,sglang,all} [--quick] [--json PATH]
                   [--results DIR]

Each sub-benchmark measures capgraph side by side with its baseline in one run, prints a table
and writes every figure, with the machine and the versions, to JSON (default
``results/<name>-<UTC timestamp>.json``). ``--quick`` shrinks each to a smoke run of well under
a minute on 2 cores. Figures for the project's machines are in ``docs/BENCHMARKS.md``.

Importing this package loads nothing heavy; each sub-benchmark imports torch, xgrammar and the
tokenizers when it runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
import traceback
from typing import Sequence

__all__ = ["main", "build_parser", "BENCHMARKS"]

#: sub-benchmark name -> module under capgraph.bench (run in this order by ``all``)
BENCHMARKS = ("build", "tail", "compile", "apply", "memory", "loop", "spec")
#: sub-benchmarks that need an optional package (``sglang``: SGLang), left out of ``all``
OPTIONAL_BENCHMARKS = ("sglang",)


def _module(name: str):
    return importlib.import_module(f"{__name__}.{name}")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true",
                   help="small sizes and few repetitions (a smoke run, not a measurement)")
    p.add_argument("--json", metavar="PATH", help="write the results here (default: "
                   "<results>/<name>-<UTC timestamp>.json)")
    p.add_argument("--results", metavar="DIR", default="results",
                   help="folder for the default JSON file names (default: ./results)")


def build_parser(prog: str = "capgraph bench") -> argparse.ArgumentParser:
    """The argument parser; ``capgraph.cli`` mounts the same arguments as its subcommand."""
    parser = argparse.ArgumentParser(
        prog=prog, description="capgraph's benchmark suite: each sub-benchmark measures "
        "capgraph next to its baseline in one run, prints a table and writes JSON.")
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the sub-benchmark subcommands to ``parser`` (for mounting under another CLI)."""
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", required=True)
    for name in (*BENCHMARKS, *OPTIONAL_BENCHMARKS):
        module = _module(name)
        p = sub.add_parser(name, help=module.HELP, description=module.__doc__.split("\n\n")[0])
        _add_common(p)
        module.add_arguments(p)
    p = sub.add_parser("all", help="every sub-benchmark with its defaults, one JSON file each "
                       f"(not {', '.join(OPTIONAL_BENCHMARKS)})")
    _add_common(p)


def run_one(name: str, args: argparse.Namespace, argv: Sequence[str]) -> dict:
    """Run one sub-benchmark, print its table, write its JSON; returns the document written."""
    from .common import describe_machine, machine_info, write_json

    module = _module(name)
    machine = machine_info()
    print(f"== capgraph bench {name}{' --quick' if args.quick else ''}: "
          f"{describe_machine(machine)}", flush=True)
    t0 = time.perf_counter()
    payload = module.run(args)
    elapsed = time.perf_counter() - t0
    options = {k: v for k, v in vars(args).items() if k not in ("func", "bench")}
    doc = {"benchmark": name, "machine": machine, "argv": list(argv), "options": options,
           "elapsed_s": elapsed, **payload}
    doc["machine"]["load_average_at_end"] = _load()
    path = write_json(name, doc, args.json, args.results)
    print(f"({elapsed:.1f} s) wrote {path}", flush=True)
    return doc


def _load() -> list[float] | None:
    import os
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``capgraph bench``; returns the process exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    return run(args, argv)


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the sub-benchmark(s) that parsed ``args`` name; 1 if any of them failed."""
    if args.bench != "all":
        run_one(args.bench, args, argv)
        return 0
    parser = build_parser()
    failed = []
    docs = {}
    for name in BENCHMARKS:
        sub_argv = [name, "--results", args.results] + (["--quick"] if args.quick else [])
        try:
            docs[name] = run_one(name, parser.parse_args(sub_argv), sub_argv)
        except Exception:  # keep going: one broken sub-benchmark should not hide the others
            traceback.print_exc()
            failed.append(name)
        print()
    if args.json:
        from .common import write_json
        write_json("all", {"benchmarks": docs, "failed": failed}, args.json)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0
