"""The official JSON Schema Test Suite (draft 2020-12 keyword files, vendored under
``tests/data/json_schema_test_suite``) on xgrammar, llguidance and the fallback mode: no
instance the suite marks invalid gets through a schema capgraph compiles, and no schema or
instance ends in anything but a named capgraph error (``tools/schema_test_suite.py``).
"""

from __future__ import annotations

import json

import pytest

from conftest import load_tool

pytest.importorskip("llguidance", reason="the llguidance extra is not installed")

suite = load_tool("schema_test_suite")
FILES = suite.suite_files(suite.VENDORED)
# generous: the whole vendored draft takes about 15 s on 2 cores; a hang is what this catches
TIMEOUT_S = 20.0
WRAPS = tuple(suite.WRAPS)  # every schema also in an allOf branch, a property, a tuple item


@pytest.fixture(scope="module")
def factories(tekken):
    """backend -> factory (default policy; "fallback": xgrammar with the fallback policy)."""
    built = suite.make_factories(tekken, suite.BACKENDS, TIMEOUT_S)
    yield built
    for factory in built.values():
        factory.close()


@pytest.fixture(scope="module")
def results(factories, tekken):
    """file name -> backend -> Tally, each file run once per module."""
    done: dict[str, dict] = {}

    def get(path):
        if path.name not in done:
            done[path.name] = suite.run_file(factories, tekken, path, TIMEOUT_S, WRAPS)
        return done[path.name]
    return get


def test_the_vendored_suite_is_complete():
    """Every keyword file of the suite's draft 2020-12 folder but refRemote.json is here, with
    the licence and the README naming the commit."""
    names = {p.name for p in FILES}
    assert len(names) == 45
    assert {"type.json", "enum.json", "allOf.json", "unevaluatedProperties.json",
            "dynamicRef.json", "format.json"} <= names
    assert "refRemote.json" not in names
    folder = suite.VENDORED.parent
    assert "MIT" in (folder / "LICENSE").read_text() or \
        "Permission is hereby granted" in (folder / "LICENSE").read_text()
    assert "44401e0c046704b476ec9d2e2fccdaee618f259d" in (folder / "README.md").read_text()


@pytest.mark.parametrize("path", FILES, ids=[p.stem for p in FILES])
def test_no_invalid_instance_accepted_and_no_crash(results, path):
    """Every group of one keyword file on every backend, as written and moved into an
    ``allOf`` branch, a property and a tuple item: each schema is compiled, refused
    (``UnsupportedGuideError``) or a named compile error; a compiled one refuses every
    instance the suite marks invalid, in every spelling, token by token with the stop
    token."""
    groups = sum(1 + sum(suite.wrapped(g, w) is not None for w in WRAPS)
                 for g in suite.load_groups(path))
    for backend, tally in results(path).items():
        assert not tally.crashes, f"{backend}: {tally.crashes}"
        assert not tally.invalid_accepted, f"{backend}: {tally.invalid_accepted}"
        assert tally.schemas == groups == tally.compiled + tally.refused + tally.compile_errors


@pytest.mark.parametrize("name", ["type.json", "enum.json", "const.json"])
def test_the_check_compiles_and_feeds_on_every_backend(results, name):
    """The check is not vacuous: on these files every backend compiles at least 10 schemas,
    accepts at least 20 valid instances and refuses at least 20 invalid ones (a policy that
    refused everything, or a feed that took nothing, would pass the test above; the figures
    now: 11-17 compiled, 21-22 valid accepted, 23-59 invalid refused)."""
    for backend, tally in results(suite.VENDORED / name).items():
        assert tally.compiled >= 10, backend
        assert tally.valid_accepted >= 20, backend
        assert tally.invalid_refused >= 20, backend


def test_an_invalid_instance_accepted_is_reported(factories, tekken, tmp_path, capsys):
    """The tool's verdict path: a group whose "invalid" instance satisfies the schema (here
    marked invalid on purpose) is listed as INVALID ACCEPTED and the run exits 1; a schema
    that crashes nothing and a correct group exit 0."""
    group = {"description": "integers", "schema": {"type": "integer"},
             "tests": [{"description": "one", "data": 1, "valid": False},
                       {"description": "a string", "data": "a", "valid": False}]}
    tally = suite.run_group(factories["xgrammar"], tekken, group, "probe")
    assert tally.compiled == 1 and tally.invalid_refused == 1
    assert tally.invalid_accepted == ["probe / one: accepted 1"]
    assert not tally.ok
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([group]))
    assert suite.main([str(bad), "--backends", "xgrammar"]) == 1
    out = capsys.readouterr().out
    assert "xgrammar: INVALID ACCEPTED: bad.json#0 'integers' / one" in out
    good = tmp_path / "good.json"
    group["tests"][0]["valid"] = True
    good.write_text(json.dumps([group]))
    assert suite.main([str(good), "--backends", "xgrammar"]) == 0
    assert "| xgrammar | 1 | 1 | 0 | 0 | 0 | 1 | 0 | 1 | 0 |" in capsys.readouterr().out


def test_a_compile_over_the_timeout_is_reported(factories, tekken):
    """A compile that has not finished within the per-case timeout is a crash, named."""
    from cases import nested_anyof_schema
    group = {"description": "slow", "schema": nested_anyof_schema(7), "tests": []}
    tally = suite.run_group(factories["xgrammar"], tekken, group, "slow", timeout_s=1e-6)
    assert tally.crashes == ["slow: compile over 1e-06 s"]
    assert not tally.ok


def test_wrapped_groups_keep_the_verdicts():
    """A moved group keeps its tests' verdicts, moves each instance along, keeps the
    schema's $schema at the new root, leaves the suite's group as it was, and skips a schema
    whose references would resolve elsewhere."""
    group = {"description": "d", "schema": {"$schema": "S", "type": "integer"},
             "tests": [{"description": "t", "data": 1, "valid": True}]}
    moved = suite.wrapped(group, "property")
    assert moved["schema"] == {"$schema": "S", "type": "object",
                               "properties": {"x": {"type": "integer"}}, "required": ["x"],
                               "additionalProperties": False}
    assert moved["tests"] == [{"description": "t", "data": {"x": 1}, "valid": True}]
    assert group["schema"] == {"$schema": "S", "type": "integer"}
    assert suite.wrapped(group, "allOf")["schema"] == {"$schema": "S",
                                                       "allOf": [{"type": "integer"}]}
    assert suite.wrapped({"schema": {"$ref": "#/$defs/a"}, "tests": []}, "item") is None


def test_spellings_are_the_same_value():
    """Every text fed for an instance parses back to that instance."""
    value = {"ab": [1, 2.5, -0.0, 1e300, 10 ** 20, "é", "", True, None], "": {}}
    texts = suite.spellings(value)
    assert len(texts) == 6
    assert all(json.loads(t) == value for t in texts)
    assert '{"\\u0061b":' in texts[-1]
