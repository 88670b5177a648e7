"""The ``capgraph`` command line.

    capgraph info                 versions, devices, backends, bundled tokenizers
    capgraph tokenizer [NAME]     load (and convert once) a bundled tokenizer, show its facts
    capgraph bench BENCHMARK      the benchmark suite (build, tail, compile, apply, memory, loop,
                                  spec, sglang, all)
    capgraph demo [OPTIONS]       guided generation with a tiny random Llama, outputs validated
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from importlib import metadata
from typing import Sequence

__all__ = ["main", "read_text_file", "read_json_file", "json_kind"]


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def read_text_file(path: str, option: str) -> str:
    """The text of the file a command-line option names; a missing file, a directory, an
    unreadable file or one that is not UTF-8 is a :class:`~capgraph.errors.ConfigError` naming
    the option and the file (``capgraph: error: ...``), not a traceback."""
    from .errors import ConfigError
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ConfigError(f"{option} {path}: no such file") from None
    except IsADirectoryError:
        raise ConfigError(f"{option} {path}: is a directory, expected a file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{option} {path}: not UTF-8 text (byte {e.start}: {e.reason})") \
            from None
    except (OSError, ValueError) as e:  # (no permission, a NUL in the path, ...)
        raise ConfigError(f"{option} {path}: cannot read it "
                          f"({getattr(e, 'strerror', None) or e})") from None


def read_json_file(path: str, option: str) -> object:
    """The JSON value of the file a command-line option names (see :func:`read_text_file`);
    text that is not JSON is a ``ConfigError`` naming the file, the line and the column."""
    import json

    from .errors import ConfigError
    text = read_text_file(path, option)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{option} {path}: invalid JSON at line {e.lineno} column "
                          f"{e.colno}: {e.msg}") from None


def json_kind(value: object) -> str:
    """The JSON name of a parsed JSON value's kind (``object``, ``array``, ``string``, ...)."""
    kinds = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number",
             float: "number", type(None): "null"}
    return kinds.get(type(value), type(value).__name__)


def cmd_info(args: argparse.Namespace) -> int:
    """Print what capgraph runs on; touches no GPU beyond a guarded device count."""
    import torch

    from .tokenizers import BUNDLED_TOKENIZERS
    print(f"capgraph      {_version('capgraph')}")
    print(f"python        {platform.python_version()} on {platform.platform()}")
    for dist in ("torch", "xgrammar", "llguidance", "cuda-python", "cuda-bindings", "transformers",
                 "nvtx"):
        print(f"{dist:<13} {_version(dist)}")
    cuda = torch.cuda.is_available()
    devices = torch.cuda.device_count() if cuda else 0
    print(f"cuda          {'available, ' + str(devices) + ' device(s)' if cuda else 'no device'}")
    print("tokenizers    " + ", ".join(f"{n} ({s.vocab_size})" for n, s in
                                       BUNDLED_TOKENIZERS.items()))
    return 0


def cmd_tokenizer(args: argparse.Namespace) -> int:
    from .tokenizers import load_tokenizer
    t0 = time.perf_counter()
    tok = load_tokenizer(args.name)
    print(f"{args.name}: {len(tok)} tokens, eos={tok.eos_token!r} ({tok.eos_token_id}), "
          f"loaded in {time.perf_counter() - t0:.2f} s")
    if args.text:
        ids = tok.encode(args.text, add_special_tokens=False)
        print(ids)
        print(tok.convert_ids_to_tokens(ids))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(args)


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import run
    return run(args, args.argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="capgraph",
        description="Grammar-guided decoding for CUDA-graph-replayed inference.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("info", help="versions, devices, grammar backends, bundled tokenizers")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("tokenizer", help="load a bundled tokenizer (converted once, cached)")
    p.add_argument("name", nargs="?", default="tekken",
                   help="tekken | mistral-sp32k | qwen | a local tokenizer directory")
    p.add_argument("--text", help="also show how this text tokenizes")
    p.set_defaults(func=cmd_tokenizer)
    from .demo import add_arguments as add_demo_arguments
    p = sub.add_parser(
        "demo", help="guided generation end to end (tiny random Llama, Tekken), outputs validated",
        description="Generate a batch under a tool-call JSON schema, a date regex and a "
                    "key=value EBNF grammar with a tiny random Llama and the bundled Tekken "
                    "tokenizer (offline), validate every output that ended on its stop token "
                    "(jsonschema, re.fullmatch, a fresh grammar matcher) and print a timing "
                    "breakdown (forward, build, apply, sample). Exits 1 if an output fails.")
    add_demo_arguments(p)
    p.set_defaults(func=cmd_demo)
    from .bench import add_arguments as add_bench_arguments
    p = sub.add_parser(
        "bench", help="benchmark suite (build, tail, compile, apply, memory, loop, spec, sglang, "
        "all): tables and JSON",
        description="Each sub-benchmark measures capgraph next to its baseline in one run, "
                    "prints a table and writes every figure with the machine and versions to "
                    "JSON (default results/<name>-<UTC timestamp>.json).")
    add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``capgraph`` command: parse ``argv`` (default: ``sys.argv[1:]``), run the subcommand,
    return its exit code."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # a named, readable error instead of a traceback for users
        from .errors import CapgraphError
        if isinstance(e, CapgraphError):
            print(f"capgraph: error: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
