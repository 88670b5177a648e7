"""The ``capgraph`` command line: help texts, and ``capgraph demo`` end to end in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from capgraph import GuidedDecodingParams
from capgraph.demo import bundled_schema, validate
from capgraph.tokenizers import encode_continuation


def capgraph_cmd() -> list[str]:
    """The installed console script next to this interpreter, else ``python -m capgraph.cli``."""
    script = Path(sys.executable).with_name("capgraph")
    return [str(script)] if script.exists() else [sys.executable, "-m", "capgraph.cli"]


def run_cli(*args: str, cwd: Path, timeout: float = 180) -> subprocess.CompletedProcess:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    return subprocess.run(capgraph_cmd() + list(args), capture_output=True, text=True,
                          timeout=timeout, cwd=cwd, env=env)


def test_help_lists_subcommands_and_demo_options(tmp_path):
    """`capgraph --help` names info, tokenizer and demo; `capgraph demo --help` documents every
    demo option."""
    out = run_cli("--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for sub in ("info", "tokenizer", "demo"):
        assert sub in out.stdout
    out = run_cli("demo", "--help", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    for opt in ("--schema", "--prompt", "--batch-size", "--num-requests", "--draft-tokens",
                "--drafter", "--device", "--decoder", "--no-cuda-graph", "--max-new-tokens",
                "--seed", "--threads"):
        assert opt in out.stdout, opt


def test_demo_runs_and_validates(tmp_path):
    """`capgraph demo` with a user schema file and the n-gram drafter exits 0, prints one
    validation line per request, the timing breakdown and the draft acceptance."""
    schema = {"type": "object",
              "properties": {"ok": {"type": "boolean"},
                             "n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    out = run_cli("demo", "--schema", str(path), "--num-requests", "3", "--batch-size", "2",
                  "--max-new-tokens", "32", "--drafter", "ngram", "--draft-tokens", "2",
                  cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    verdicts = [line for line in lines if line.startswith("[")]
    assert len(verdicts) == 3
    assert sum("valid (" in line for line in verdicts) >= 1
    assert not any("failed" in line or "rejected" in line for line in verdicts)
    timing = next(line for line in lines if line.startswith("timing:"))
    for stage in ("forward", "build", "apply", "sample"):
        assert stage in timing
    assert any(line.startswith("drafts:") for line in lines)


@pytest.fixture(scope="module")
def sp_factory(factory_cache):
    return factory_cache("mistral-sp32k")


def test_validate_catches_bad_outputs(sp_factory):
    """The demo's validator rejects text that breaks the schema / regex / grammar and skips
    outputs that did not finish on their stop token (the demo's exit status rests on it)."""
    schema = GuidedDecodingParams.json_schema(bundled_schema())
    bad_json = SimpleNamespace(finish_reason="stop", text='{"name": "nope"}', tokens=[])
    assert validate(bad_json, schema, sp_factory).ok is False
    regex = GuidedDecodingParams.regex(r"\d{4}")
    assert validate(SimpleNamespace(finish_reason="stop", text="12a4", tokens=[]), regex,
                    sp_factory).ok is False
    assert validate(SimpleNamespace(finish_reason="length", text="", tokens=[]), regex,
                    sp_factory).ok is None
    ebnf = GuidedDecodingParams.ebnf('root ::= "ab"')
    tok = sp_factory.config.tokenizer
    eos = sp_factory.config.stop_token_ids[0]
    wrong = encode_continuation(tok, "ba") + [eos]
    assert validate(SimpleNamespace(finish_reason="stop", text="ba", tokens=wrong), ebnf,
                    sp_factory).ok is False


def test_bad_input_files_are_named_errors(tmp_path, capsys):
    """A `--schema` (demo) or `--data` (bench) file that is missing, a directory, not UTF-8,
    not JSON or not a JSON object ends as `capgraph: error: ...` naming the option, the file
    and what is wrong (with line and column for bad JSON), exit status 1: not a traceback
    (FileNotFoundError, IsADirectoryError, a JSONDecodeError that names no file), and a JSON
    string is not read as schema text."""
    from capgraph import ConfigError
    from capgraph.bench.tail import load_records
    from capgraph.cli import main
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object",\n')
    latin = tmp_path / "latin.json"
    latin.write_bytes(b'{"title": "caf\xe9"}')
    text = tmp_path / "text.json"
    text.write_text('"{\\"type\\": \\"object\\"}"')
    missing = tmp_path / "missing.json"
    for path, what in ((missing, "no such file"), (tmp_path, "is a directory"),
                       (bad, "invalid JSON at line 2 column 1: Expecting property name"),
                       (latin, "not UTF-8 text"),
                       (text, "expected a JSON object (a JSON schema), got a JSON string")):
        assert main(["demo", "--schema", str(path), "--num-requests", "1"]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"capgraph: error: --schema {path}: {what}"), err
    records = tmp_path / "records.jsonl"
    ok = '{"id": 1, "schema": {}, "instances": [1]}'
    records.write_text(ok + '\n\n[1, 2]\n')
    with pytest.raises(ConfigError, match="--data .*records.jsonl line 3: expected a JSON "
                                          "object \\(a record\\), got a JSON array"):
        load_records(str(records))
    records.write_text(ok + '\n{"id": 2,}\n')
    with pytest.raises(ConfigError, match="line 2: invalid JSON at column 10"):
        load_records(str(records))
    records.write_text(ok + '\n{"id": 2, "schema": {}}\n')
    with pytest.raises(ConfigError, match="line 2: the record has no 'instances'"):
        load_records(str(records))
    records.write_text(ok + '\n{"id": 2, "schema": "{}", "instances": []}\n')
    with pytest.raises(ConfigError, match="line 2: 'schema' must be a JSON schema \\(object or "
                                          "boolean\\), got a JSON string"):
        load_records(str(records))
    one = tmp_path / "one.jsonl"
    one.write_text(ok + "\n")
    assert load_records(str(one)) == [{"id": 1, "schema": {}, "instances": [1]}]
    with pytest.raises(ConfigError, match="missing.json: no such file"):
        load_records(str(missing))
    assert len(load_records()) > 0  # (the bundled records)


def test_bad_schema_file_exits_without_traceback(tmp_path):
    """The same through the installed command: one `capgraph: error:` line naming the file,
    exit status 1, no traceback."""
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object",\n')
    out = run_cli("demo", "--schema", str(bad), cwd=tmp_path)
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stderr
    assert out.stderr.strip() == (f"capgraph: error: --schema {bad}: invalid JSON at line 2 "
                                  "column 1: Expecting property name enclosed in double quotes")
