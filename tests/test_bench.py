"""Smoke tests of ``capgraph bench``: each sub-benchmark runs at tiny sizes and writes JSON with
the keys the docs and tools read. Nothing here asserts a timing."""

from __future__ import annotations

import json
import math
import re

import pytest

from capgraph import bench
from capgraph.bench import common

SP = "mistral-sp32k"  # the small bundled tokenizer keeps every run short


def run_bench(tmp_path, *argv: str) -> dict:
    out = tmp_path / f"{argv[0]}.json"
    assert bench.main([*argv, "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == argv[0]
    machine = doc["machine"]
    for key in ("date", "cpu_count", "cpu_model", "memory_bytes", "torch", "xgrammar",
                "python", "load_average", "cuda_available"):
        assert key in machine, key
    assert machine["cpu_count"] >= 1 and machine["xgrammar"]
    assert doc["options"]["quick"] is True and doc["elapsed_s"] > 0
    assert doc["rows"], "no figures"
    return doc


def test_percentiles_match_linear_interpolation():
    """percentile/median/summarize follow NumPy's default (linear) definition."""
    np = pytest.importorskip("numpy")
    values = [5.0, 1.0, 4.0, 2.0, 3.0, 10.0, 7.5]
    for q in (0, 10, 50, 90, 99, 99.9, 100):
        assert math.isclose(common.percentile(values, q), float(np.percentile(values, q)))
    assert common.median([3.0, 1.0, 2.0]) == 2.0
    s = common.summarize(values, scale=1e3)
    assert set(s) == {"p50", "p90", "p99", "p99.9", "max", "mean", "n"}
    assert s["max"] == 10e3 and s["n"] == len(values)
    with pytest.raises(ValueError):
        common.percentile([], 50)


def test_write_json_default_name_and_table(tmp_path, capsys):
    """Without a path the file lands at <results>/<name>-<UTC stamp>.json; tables print."""
    path = common.write_json("demo", {"rows": [{"a": 1}]}, results_dir=tmp_path / "res")
    assert re.fullmatch(r"demo-\d{8}T\d{6}Z\.json", path.name)
    assert path.parent == tmp_path / "res" and json.loads(path.read_text())["rows"]
    text = common.print_table([common.Column("a", "A"), common.Column("b", "B", ".2f")],
                              [{"a": 1, "b": 2.0}, {"a": 22}])
    assert "2.00" in text and "-" in text.splitlines()[-1]
    assert capsys.readouterr().out.strip() == text


def test_build(tmp_path):
    """build: capgraph and the plain xgrammar loop per (tokenizer, draft, batch), with a ratio."""
    doc = run_bench(tmp_path, "build", "--tokenizer", SP, "--batches", "2", "--draft", "0", "1",
                    "--steps", "3")
    assert [(r["draft"], r["batch"]) for r in doc["rows"]] == [(0, 2), (1, 2)]
    for r in doc["rows"]:
        assert r["vocab"] == 32000 and r["capgraph_ms"] > 0 and r["plain_ms"] > 0
        assert math.isclose(r["ratio"], r["capgraph_ms"] / r["plain_ms"])
        assert len(r["capgraph_steps_ms"]) == len(r["plain_steps_ms"]) == r["steps"]


def test_tail(tmp_path):
    """tail: per-token mask percentiles for both sides, compile percentiles and the counts."""
    doc = run_bench(tmp_path, "tail", "--tokenizer", SP, "--limit", "3", "--repeat", "2")
    kinds = [r["what"] for r in doc["rows"]]
    assert kinds == ["xgrammar mask, first pass", "xgrammar mask, best of 2",
                     "capgraph mask, first pass", "capgraph mask, best of 2",
                     "compile (xgrammar via capgraph)"]
    for r in doc["rows"]:
        assert r["p50"] <= r["p90"] <= r["p99"] <= r["p99.9"] <= r["max"]
    counts = doc["counts"]
    assert counts["schemas"] == 3 and counts["instances"] >= 1 and counts["tokens"] >= 1
    assert {"compile_failed", "compile_timeout", "instances_rejected",
            "instances_invalid"} <= set(counts)
    assert len(doc["per_schema"]) == 3


def test_tail_data_is_bundled_and_valid():
    """The bundled subset loads from package data; every record has a schema and an instance
    that jsonschema accepts."""
    pytest.importorskip("jsonschema")
    from capgraph.bench.tail import load_records, valid_instances
    records = load_records()
    assert 50 <= len(records) <= 150
    for record in records[:10]:
        good, bad = valid_instances(record)
        assert good and not bad, record["id"]


def test_apply(tmp_path):
    """apply: capgraph (also through its indices argument) next to xgrammar's CPU applies,
    results checked equal before timing."""
    doc = run_bench(tmp_path, "apply", "--batches", "1", "3", "--vocab", "4096", "--repeat", "2")
    assert {(r["dtype"], r["batch"]) for r in doc["rows"]} == {
        ("fp32", 1), ("fp32", 3), ("bf16", 1), ("bf16", 3)}
    for r in doc["rows"]:
        assert r["errors"] == {}, r["errors"]
        for name in ("capgraph", "capgraph_indices", "xgr_cpu", "xgr_torch_native"):
            assert r[name]["median_ms"] > 0
        assert r["ratio_vs_best_xgrammar"] > 0 and r["best_xgrammar"].startswith("xgr_")


def test_memory(tmp_path):
    """memory: buffers as the layout predicts, and allocation counts for all three paths."""
    doc = run_bench(tmp_path, "memory", "--tokenizer", SP, "--slots", "2", "--draft", "0", "1",
                    "--batch", "2", "--steps", "3", "--warmup", "2", "--alloc-tokenizer", SP)
    assert doc["all_buffers_as_predicted"] is True
    assert len(doc["buffers"]) == 2
    paths = {r["path"]: r for r in doc["rows"]}
    assert set(paths) == {"eager", "capturable", "replay"}
    for name in ("eager", "capturable"):
        assert paths[name]["torch"]["per_step"] >= 0
        assert "sites_per_step" in paths[name]["torch"]
    for r in doc["rows"]:
        assert len(r["python"]["windows"]) == 2 and r["python"]["transient_peak_bytes_max"] >= 0


@pytest.mark.parametrize("model", ["runtime", "standin"])
def test_loop(tmp_path, model):
    """loop: unguided, eager and capturable step times side by side, with the ratios."""
    if model == "runtime":
        pytest.importorskip("capgraph.runtime")
    doc = run_bench(tmp_path, "loop", "--tokenizer", SP, "--batches", "2", "--steps", "3",
                    "--warmup", "1", "--model", model)
    (row,) = doc["rows"]
    assert row["model"] == model and row["batch"] == 2
    for v in ("unguided", "eager", "capturable"):
        assert row[f"{v}_ms"] > 0 and len(row[f"{v}_samples_ms"]) == 3
    assert math.isclose(row["eager_ratio"], row["eager_ms"] / row["unguided_ms"])


def test_all_runs_each_and_writes_one_file_each(tmp_path, monkeypatch):
    """`bench all` runs every registered sub-benchmark and writes one JSON file per run."""
    monkeypatch.setattr(bench, "BENCHMARKS", ("apply",))
    combined = tmp_path / "all.json"
    assert bench.main(["all", "--quick", "--results", str(tmp_path / "r"), "--json",
                       str(combined)]) == 0
    files = list((tmp_path / "r").glob("apply-*.json"))
    assert len(files) == 1
    assert set(json.loads(combined.read_text())["benchmarks"]) == {"apply"}


def test_compile(tmp_path):
    """compile: time to first mask and mask time per backend mode that can be built, ratios
    over the schemas both served, and every mode that cannot be built named with its reason."""
    from capgraph.bench.compile import MODES
    doc = run_bench(tmp_path, "compile", "--tokenizer", SP, "--limit", "2")
    measured = [r["mode"] for r in doc["rows"]]
    assert measured and set(measured) | set(doc["skipped"]) == set(MODES)
    assert "xgrammar" in measured
    for r in doc["rows"]:
        assert r["served"] + r["compile_failed"] + r["compile_timeout"] == 2
        if r["served"]:
            first = r["first_mask"]
            assert 0 < first["p50"] <= first["p99"] <= first["max"]
            assert r["compile"]["max"] <= first["max"] and r["mask"]["n"] == r["masks"]
    for ratio in doc["ratios"]:  # "a / b", or "auto on xgrammar / xgrammar" (masks only)
        mode, _, on = ratio["mode"].partition(" on ")
        assert mode in measured and ratio["over"] in measured and ratio["schemas"] >= 1
        assert ratio["first_mask_p99"] > 0 if not on else on == ratio["over"]
    assert len(doc["per_schema"]) == 2 and doc["config_fields"]["compile_disk_cache_bytes"] == 0


# SGLang's xgrammar backend passes xgrammar a deprecated argument; not ours
@pytest.mark.filterwarnings("ignore:max_rollback_tokens is deprecated")
def test_sglang(tmp_path):
    """sglang: allocate + batched fill and accept per step on SGLang's xgrammar backend and on
    capgraph's, with the ratios (skips where SGLang is not importable, fails in CI, which
    installs it: CAPGRAPH_REQUIRE_SGLANG)."""
    import os
    try:
        import sglang.srt.constrained.xgrammar_backend  # noqa: F401
    except ImportError as e:
        if os.environ.get("CAPGRAPH_REQUIRE_SGLANG", "").strip() in ("1", "true", "yes"):
            raise
        pytest.skip(f"SGLang is not importable ({e})")
    doc = run_bench(tmp_path, "sglang", "--tokenizer", SP, "--batches", "1", "3", "--steps",
                    "3")
    assert [r["batch"] for r in doc["rows"]] == [1, 3]
    for r in doc["rows"]:
        assert r["vocab"] == 32000 and r["steps"] == 3
        assert math.isclose(r["fill_ratio"], r["capgraph_fill_ms"] / r["sglang_fill_ms"])
        assert math.isclose(r["step_ratio"], r["capgraph_step_ms"] / r["sglang_step_ms"])
        assert r["capgraph_alloc_ms"] > 0 and r["sglang_alloc_ms"] > 0
        assert math.isclose(r["accept_ratio"], r["capgraph_accept_ms"] / r["sglang_accept_ms"])
        assert len(r["capgraph_fill_steps_ms"]) == len(r["sglang_fill_steps_ms"]) == 3


def test_spec(tmp_path):
    """spec: teacher-forced steps per token per draft source over JSONSchemaBench and the tool
    calls (grammar drafts accepted: under one step per token), generation per drafter equal
    to greedy output, and the forced-token query's cost over the build."""
    pytest.importorskip("capgraph.runtime")
    from capgraph.bench.spec import DRAFTS, SOURCES
    doc = run_bench(tmp_path, "spec", "--tokenizer", SP, "--limit", "3", "--num-draft-tokens",
                    "3", "--max-new-tokens", "8", "--batch", "2", "--steps", "3")
    rows = {(r["workload"], r["data"], r["drafts"]): r for r in doc["rows"]}
    for data in ("jsonschemabench", "tool-calls"):
        for source in SOURCES:
            r = rows[("teacher-forced", data, source)]
            assert r["tokens"] > 0 and 0 < r["steps_per_token"] <= 1
            assert math.isclose(r["steps_per_token"] + r["accepted_share"], 1.0)
    assert rows[("teacher-forced", "tool-calls", "tokenizer")]["steps_per_token"] < 0.8
    for draft in DRAFTS:
        r = rows[("generate", "demo", draft)]
        assert r["exact"] is True and r["tokens_per_s"] > 0 and r["steps_per_token"] <= 1
    cost = rows[("cost", "batch 2", "build+forced")]
    assert cost["ratio"] >= 1 and cost["ms"] >= rows[("cost", "batch 2", "build")]["ms"]
