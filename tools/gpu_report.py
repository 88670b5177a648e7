#!/usr/bin/env python3
"""Turn what tools/gpu_check.sh brought back into Markdown for docs/BENCHMARKS.md.

Reads the output folder of one GPU run (``summary.txt``, ``gpu_tests.xml``,
``gpu_tests_rest.xml``, ``bench_kernel.json``, ``bench_kernel_xgr_cuda.json``,
``bench_apply.json``, ``bench_argmax.json``, ``bench_replay.json``, ``profile_cupti.json``; any
of them may be missing) and prints, in Markdown: the step summary, the test counts with every failing test, one table per benchmark,
the profile's summary, and the verdict on each GPU target of the issues:

* kernel bandwidth: at batch >= 256, at least 80% of the device-to-device copy's bandwidth
  measured in the same run, counting the bytes actually moved (every dtype and pattern);
* kernel speed: never slower than xgrammar's fastest kernel (CUDA or Triton) at any batch,
  judged for the variant the library runs by default in each cell (``auto``: ``rmw`` at
  large batches) and, on a line of its own, for the fastest of the
  mask kernel's variants in each cell (``rmw``, ``ahead``, ``store``; the table names it);
* graph replay: a replayed guided step costs at most 1.05x a replayed unguided one at each
  point of :data:`REPLAY_POINTS` (the demo's tiny model at batch 64 and 256, the 1024-wide
  model at batch 8, 64 and 256), per host-node kind (``python``, ``native``);
* profile: the last traced replayed step shows capgraph's NVTX ranges, the host node's ranges
  and the mask kernel.

    python tools/gpu_report.py OUT_DIR > /tmp/gpu_tables.md
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, Callable, Sequence

BANDWIDTH_TARGET = 0.80  # of the copy's bandwidth, at batch >= 256
BANDWIDTH_MIN_BATCH = 256
REPLAY_TARGET = 1.05  # guided / unguided replayed step, at each of REPLAY_POINTS
#: (model, batch) points of tools/bench_graph_replay.py that the replay target names
REPLAY_POINTS = (("tiny", 64), ("tiny", 256), ("small", 8), ("small", 64), ("small", 256))
HOST_NODES = ("python", "native")
PROFILE_SUMMARY_ROWS = 15
#: The junit XML of gpu_check.sh's two test steps (the open issues' files, then the others).
TEST_XML = ("gpu_tests.xml", "gpu_tests_rest.xml")
#: the mask kernel's mixed-group variants that tools/bench_kernel.py times
KERNEL_VARIANTS = ("rmw", "ahead", "store")


def _load(path: Path) -> Any | None:
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except ValueError as exc:  # a step killed mid-write leaves a truncated file
        return {"error": f"{path.name} is not readable JSON ({exc})"}


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table; numbers right-aligned, None shown as '-'."""
    def cell(v: Any) -> str:
        return "-" if v is None else str(v)
    lines = ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value: float | None, spec: str) -> str | None:
    return None if value is None else format(value, spec)


def _us(row: dict, key: str) -> str | None:
    """A seconds figure of a bench_kernel row in microseconds (None when absent)."""
    return _fmt(row[key] * 1e6 if row.get(key) else None, ".1f")


def _ms(row: dict, method: str) -> str | None:
    """A method's median of a bench-apply row in milliseconds (None when absent)."""
    return _fmt(row[method]["median_ms"] if method in row else None, ".4f")


def tests_section(xml_paths: Sequence[Path]) -> tuple[str, dict]:
    """Counts from pytest's junit XML files (one per test step) and the failing tests' names;
    a step whose file is missing did not finish and is named."""
    found = [p for p in xml_paths if p.is_file()]
    if not found:
        return "GPU tests: no junit XML (the step did not finish)", {"ran": False}
    counts: dict[str, Any] = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    failing = []
    for xml_path in found:
        root = ET.parse(xml_path).getroot()
        suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
        for k in counts:
            counts[k] += sum(int(s.get(k, 0)) for s in suites)
        for case in root.iter("testcase"):
            for kind in ("failure", "error"):
                node = case.find(kind)
                if node is not None:
                    message = (node.get("message") or "").splitlines()[0][:160] if \
                        node.get("message") else ""
                    failing.append(f"{case.get('classname')}::{case.get('name')} ({kind}: "
                                   f"{message})")
    passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    text = (f"GPU tests: {passed} passed, {counts['failures']} failed, {counts['errors']} "
            f"errors, {counts['skipped']} skipped")
    missing = [p.name for p in xml_paths if not p.is_file()]
    if missing:
        text += f" (no junit XML from {', '.join(missing)}: that step did not finish)"
    if failing:
        text += "\n\n" + "\n".join(f"- {f}" for f in failing)
    counts.update(passed=passed, failing=failing, ran=True, missing=missing)
    return text, counts


def _variant_seconds(r: dict) -> dict[str, float]:
    """Seconds per call of each variant a bench_kernel row timed; a row written before there
    were variants (``ours_s``) is the rmw kernel's."""
    times = {v: r[f"{v}_s"] for v in KERNEL_VARIANTS if r.get(f"{v}_s")}
    if not times and r.get("ours_s"):
        times["rmw"] = r["ours_s"]
    return times


def kernel_section(data: dict | None, title: str) -> tuple[str, dict]:
    """bench_kernel.py's rows as a table (each variant's time, the fastest named per cell),
    and the kernel targets over them: bandwidth of the rmw kernel (what large batches run),
    speed of the variant run by default in each cell, speed of the fastest variant per cell."""
    if data is None:
        return f"{title}: no results", {}
    if "error" in data:
        return f"{title}: {data['error']}", {}
    rows: list[list[Any]] = []
    verdict: dict[str, Any] = {"min_pct_copy_large": None, "max_ratio_vs_xgrammar": None,
                               "max_best_ratio_vs_xgrammar": None}
    by_pattern: dict[str, float] = {}
    wins: dict[str, int] = {}
    for r in data.get("rows", []):
        times = _variant_seconds(r)
        # the variant the library runs by default at this launch (bench_kernel's
        # default_variant; rows written before the choice per width ran rmw)
        default = r.get("default_variant") or "rmw"
        default = default if default in times else "rmw"
        gbps = r.get("rmw_GBps", r.get("ours_GBps"))
        pct = 100 * gbps / r["copy_GBps"] if gbps and r.get("copy_GBps") else None
        theirs = [r[k] for k in ("xgr_cuda_s", "xgr_triton_s") if r.get(k)]
        fastest = min(times, key=times.__getitem__) if times else None
        ratio = times[default] / min(theirs) if theirs and times.get(default) else None
        best = times[fastest] / min(theirs) if theirs and fastest else None
        if len(times) > 1 and fastest is not None:
            wins[fastest] = wins.get(fastest, 0) + 1
        if pct is not None and r["batch"] >= BANDWIDTH_MIN_BATCH:
            prev = verdict["min_pct_copy_large"]
            verdict["min_pct_copy_large"] = pct if prev is None else min(prev, pct)
            by_pattern[r["pattern"]] = min(by_pattern.get(r["pattern"], pct), pct)
        for key, value in (("max_ratio_vs_xgrammar", ratio), ("max_best_ratio_vs_xgrammar", best)):
            if value is not None:
                prev = verdict[key]
                verdict[key] = value if prev is None else max(prev, value)
        rows.append([r["dtype"], r["pattern"], r["batch"],
                     *(_fmt(times[v] * 1e6 if v in times else None, ".1f")
                       for v in KERNEL_VARIANTS),
                     _fmt(gbps, ".0f"), _fmt(r.get("copy_GBps"), ".0f"), _fmt(pct, ".1f"),
                     _us(r, "xgr_cuda_s"), _us(r, "xgr_triton_s"), _fmt(ratio, ".2f"),
                     _fmt(best, ".2f"), fastest, default])
    if len(by_pattern) > 1:
        verdict["pct_by_pattern"] = by_pattern
    head = (f"{title} ({data.get('device', '?')}, V = {data.get('vocab', '?')}, "
            f"{data.get('date', '?')})")
    unavailable = data.get("unavailable") or {}
    if unavailable:
        head += "\n\n" + "\n".join(f"- {k}: {v}" for k, v in unavailable.items())
    if data.get("token_mask"):
        head += "\n\n- capgraph's kernels were given a token mask of ones, xgrammar's none"
    errors = sorted({f"{k}: {v}" for r in data.get("rows", []) for k, v in r.items()
                     if k.endswith("_error")})
    if errors:
        head += "\n\n" + "\n".join(f"- {e}" for e in errors)
    text = head + "\n\n" + table(
        ["dtype", "pattern", "B", "rmw us", "ahead us", "store us", "GB/s (rmw)", "copy GB/s",
         "% of copy (rmw)", "xgr cuda us", "xgr triton us", "default / best xgr",
         "fastest / best xgr", "fastest", "default"], rows)
    if wins:
        text += ("\n\nFastest variant, over the cells where more than one ran: "
                 + ", ".join(f"{v} {wins[v]}" for v in KERNEL_VARIANTS if v in wins)
                 + " (ahead and store exist at 4 and 8 columns per thread: small batches)")
    return text, verdict


def apply_section(data: dict | None) -> str:
    if data is None:
        return "capgraph bench apply (CUDA): no results"
    rows = []
    for r in data.get("cuda_rows", []):
        rows.append([r["dtype"], r["batch"], r.get("active_rows"), _ms(r, "capgraph"),
                     _ms(r, "xgr_cuda"), _ms(r, "xgr_triton"), _ms(r, "xgr_torch_native"),
                     _ms(r, "d2d_copy_floor"), _fmt(r.get("ratio_vs_best_xgrammar"), ".2f"),
                     _fmt(r.get("ratio_vs_copy_floor"), ".2f")])
    if not rows:
        return "capgraph bench apply (CUDA): no CUDA rows"
    return "capgraph bench apply (CUDA, V = 131072)\n\n" + table(
        ["dtype", "B", "active", "capgraph ms", "xgr cuda ms", "xgr triton ms",
         "xgr torch ms", "d2d copy ms", "capgraph/best", "capgraph/copy"], rows)


def argmax_section(data: dict | None) -> str:
    """tools/bench_argmax.py's table: us per call of argmax, mask+argmax and the fused call."""
    if data is None:
        return "bench_argmax: no results"
    if "error" in data:
        return f"bench_argmax: {data['error']}"
    rows = [[r["dtype"], r["pattern"], r["batch"], _fmt(r.get("argmax_us"), ".1f"),
             _fmt(r.get("mask_argmax_us"), ".1f"), _fmt(r.get("fused_us"), ".1f"),
             _fmt(r.get("fused_over_unfused"), ".2f"), _fmt(r.get("fused_over_argmax"), ".2f")]
            for r in data.get("rows", [])]
    if not rows:
        return "bench_argmax: no rows"
    return (f"bench_argmax (greedy sampling under a bitmask, V = {data.get('vocab')}, us per "
            "call)\n\n" + table(["dtype", "pattern", "B", "argmax", "mask+argmax", "fused",
                                  "fused/mask+argmax", "fused/argmax"], rows))


def replay_section(data: dict | None) -> tuple[str, dict]:
    """bench_graph_replay.py's rows (one per model, batch and host-node kind) as a table, and
    the verdict input: ``ratios[(kind, model, batch)]`` and ``unavailable[kind]``. A row
    without a host-node kind is the Python callback's (the only kind before there were two)."""
    if data is None:
        return "bench_graph_replay: no results", {}
    if "error" in data:
        return f"bench_graph_replay: {data['error']}", {}
    rows, ratios, failed = [], {}, {}
    for r in data.get("rows", []):
        kind = r.get("host_node", "python")
        if "error" in r:
            failed[(kind, r.get("model"), r["batch"])] = r["error"]
            continue
        rows.append([r.get("model", "?"), r["batch"], kind,
                     f"{r['unguided_steps']}/{r['guided_steps']}",
                     _fmt(r["unguided_ms_per_step"], ".3f"), _fmt(r["guided_ms_per_step"], ".3f"),
                     _fmt(r["ratio"], ".3f"), _fmt(r.get("replay_ratio"), ".3f"),
                     _fmt(r.get("host_build_ms_per_step"), ".3f"),
                     _fmt(r.get("host_build_us_per_row"), ".2f"),
                     _fmt(r.get("native_node_ms_per_step"), ".3f"),
                     _fmt(r.get("native_node_us_per_row"), ".2f")])
        ratios[(kind, r.get("model"), r["batch"])] = r["ratio"]
    unavailable = {k: v for k, v in (data.get("host_nodes") or {}).items() if v != "measured"}
    head = f"bench_graph_replay ({data.get('device', '?')}"
    head += f", {data['steps']} steps)" if "steps" in data else ")"
    if data.get("replayed") is False:  # --device cpu: a check of the tool, no graph replay
        head += "\n\n- not replayed in CUDA graphs (a CPU run): no verdicts from it"
        ratios = {}
    if unavailable:
        head += "\n\n" + "\n".join(f"- {k} host node: {v}" for k, v in unavailable.items())
    problems = [f"{m} batch {b}, {k} host node: failed: {e}" for (k, m, b), e in failed.items()]
    problems += [e for e in data.get("errors", []) if "warm-up" in e]
    if problems:
        head += "\n\n" + "\n".join(f"- {p}" for p in problems)
    return head + "\n\n" + table(
        ["model", "batch", "host node", "steps unguided/guided", "unguided ms/step",
         "guided ms/step", "ratio", "replay ratio", "host build ms/step", "host build us/row",
         "native node ms/step", "native node us/row"], rows), \
        {"ratios": ratios, "failed": failed, "unavailable": unavailable}


def profile_section(data: dict | None) -> tuple[str, dict]:
    """profile_cupti.py's JSON: the step lengths, what the last step shows, and the largest
    entries of the summary (the full timeline is in profile_cupti.txt)."""
    if data is None:
        return "profile (CUPTI): no results", {}
    if "error" in data:
        return f"profile (CUPTI): {data['error']}", {}
    marks = data.get("landmarks") or {}
    steps = data.get("step_us") or []
    nvtx = "live" if data.get("nvtx_active") else "inactive"
    text = (f"profile (CUPTI, {data.get('device', '?')}; {data.get('host_node', '?')} host "
            f"node; NVTX {nvtx}): {len(steps)} replayed steps of "
            + ", ".join(f"{d:.0f}" for d in steps) + " us")
    if data.get("unavailable"):
        text += "\n\n" + "\n".join(f"- activity {k}: {v}" for k, v in
                                      data["unavailable"].items())
    if marks:
        text += (f"\n\nlast step: {marks.get('capgraph_ranges', 0)} capgraph ranges; host node "
                 f"ranges: {', '.join(marks.get('host_node_ranges') or []) or 'none'}; mask "
                 f"kernel: {', '.join(marks.get('mask_kernels') or []) or 'none'}")
    if "critical_path" in data:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        try:
            from profile_cupti import format_critical_path
        finally:
            sys.path.pop(0)
        text += "\n\n" + format_critical_path(data["critical_path"])
    rows = [[r["kind"], r["name"][:80], r["count"], _fmt(r["mean_us"], ".1f"),
             _fmt(r["total_us"], ".1f")]
            for r in (data.get("summary") or [])[:PROFILE_SUMMARY_ROWS]]
    if rows:
        text += "\n\n" + table(["kind", "name", "count", "mean us", "total us"], rows)
    return text, marks


def targets_section(kernel: dict, replay: dict, profile: dict | None = None) -> str:
    def line(name: str, value: float | None, ok: Callable[[float], bool], shown: str) -> str:
        if value is None:
            return f"| {name} | not measured | - |"
        return f"| {name} | {shown.format(value)} | {'yes' if ok(value) else 'no'} |"
    bandwidth = "lowest {:.1f}%"
    if kernel.get("pct_by_pattern"):
        bandwidth += " (" + ", ".join(f"{k} {v:.1f}%" for k, v in
                                      kernel["pct_by_pattern"].items()) + ")"
    lines = [
        "| target | measured | met? |", "|---|---|---|",
        line(f"kernel >= {BANDWIDTH_TARGET:.0%} of copy bandwidth at batch >= "
             f"{BANDWIDTH_MIN_BATCH}", kernel.get("min_pct_copy_large"),
             lambda v: v >= 100 * BANDWIDTH_TARGET, bandwidth),
        line("kernel no slower than xgrammar's fastest at any batch, default variant",
             kernel.get("max_ratio_vs_xgrammar"), lambda v: v <= 1.0, "worst {:.2f}x"),
        line("kernel no slower than xgrammar's fastest at any batch, fastest variant per cell "
             "(not always the default)", kernel.get("max_best_ratio_vs_xgrammar"),
             lambda v: v <= 1.0, "worst {:.2f}x"),
    ]
    ratios = replay.get("ratios") or {}
    unavailable = replay.get("unavailable") or {}
    for kind in HOST_NODES:
        if kind in unavailable:
            lines.append(f"| replayed guided step <= {REPLAY_TARGET}x unguided, {kind} host "
                         f"node | {unavailable[kind]} | - |")
            continue
        for model, batch in REPLAY_POINTS:
            error = (replay.get("failed") or {}).get((kind, model, batch))
            if error is not None:
                lines.append(f"| replayed guided step <= {REPLAY_TARGET}x unguided, {kind} host "
                             f"node, {model} model, batch {batch} | failed: {error[:120]} | no |")
                continue
            lines.append(line(f"replayed guided step <= {REPLAY_TARGET}x unguided, {kind} host "
                              f"node, {model} model, batch {batch}",
                              ratios.get((kind, model, batch)), lambda v: v <= REPLAY_TARGET,
                              "{:.3f}x"))
    if profile is not None:
        name = "profile: capgraph ranges, host node and mask kernel in one replayed step"
        if not profile:
            lines.append(f"| {name} | not measured | - |")
        else:
            seen = [what for what, ok in (
                ("capgraph ranges", profile.get("capgraph_ranges")),
                ("host node", profile.get("host_node_ranges")),
                ("mask kernel", profile.get("mask_kernels"))) if ok]
            lines.append(f"| {name} | {', '.join(seen) or 'none of them'} | "
                         f"{'yes' if profile.get('all_three') else 'no'} |")
    return "\n".join(lines)


def report(out: Path) -> str:
    parts = []
    summary = out / "summary.txt"
    if summary.is_file():
        parts.append("Steps (name, exit code, seconds):\n\n```\n" + summary.read_text().strip()
                     + "\n```")
    parts.append(tests_section([out / name for name in TEST_XML])[0])
    kernel_text, kernel = kernel_section(_load(out / "bench_kernel.json"), "bench_kernel")
    parts.append(kernel_text)
    xgr_text, xgr = kernel_section(_load(out / "bench_kernel_xgr_cuda.json"),
                                   "bench_kernel with xgrammar's CUDA kernel")
    parts.append(xgr_text)
    parts.append(apply_section(_load(out / "bench_apply.json")))
    parts.append(argmax_section(_load(out / "bench_argmax.json")))
    replay_text, replay = replay_section(_load(out / "bench_replay.json"))
    parts.append(replay_text)
    profile_text, profile = profile_section(_load(out / "profile_cupti.json"))
    parts.append(profile_text)
    # the speed verdicts over both kernel runs (the second adds xgrammar's CUDA kernel)
    for key in ("max_ratio_vs_xgrammar", "max_best_ratio_vs_xgrammar"):
        ratios = [v for v in (kernel.get(key), xgr.get(key)) if v is not None]
        kernel[key] = max(ratios) if ratios else None
    parts.append(targets_section(kernel, replay, profile))
    return "\n\n".join(parts) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder gpu_check.sh wrote ($OUT)")
    args = ap.parse_args(argv)
    if not args.out.is_dir():
        print(f"gpu_report: {args.out} is not a folder", file=sys.stderr)
        return 2
    sys.stdout.write(report(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
