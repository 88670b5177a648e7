"""tools/gpu_report.py: the Markdown and the target verdicts from a GPU run's output folder
(synthetic files in the formats gpu_check.sh's steps write)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def gpu_report():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "tools" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _kernel_row(batch, ours_us, gbps, copy_gbps, triton_us=None, cuda_us=None, **extra):
    row = {"dtype": "bf16", "pattern": "random", "batch": batch, "ours_s": ours_us * 1e-6,
           "ours_GBps": gbps, "copy_GBps": copy_gbps, "bytes_moved": 1}
    if triton_us is not None:
        row["xgr_triton_s"] = triton_us * 1e-6
    if cuda_us is not None:
        row["xgr_cuda_s"] = cuda_us * 1e-6
    row.update(extra)
    return row


POINTS = [("tiny", 64), ("tiny", 256), ("small", 8), ("small", 64), ("small", 256)]


def _replay_row(model, batch, ratio, host_node="python", build_ms=0.4):
    node_ms = 0.1 if host_node == "native" else None
    row = {"model": model, "batch": batch, "unguided_steps": 63, "guided_steps": 60,
           "unguided_ms_per_step": 2.0, "guided_ms_per_step": 2.0 * ratio, "ratio": ratio,
           "replay_ratio": ratio - 0.01,
           "host_build_ms_per_step": build_ms,
           "host_build_us_per_row": None if build_ms is None else build_ms * 1e3 / batch,
           "native_node_ms_per_step": node_ms,
           "native_node_us_per_row": None if node_ms is None else node_ms * 1e3 / batch}
    if host_node is not None:
        row["host_node"] = host_node
    return row


def _profile(mask_kernels=("capgraph_logits_bitmask_f32_b32_p4",),
             host_ranges=("CapturableGuidedDecoder.build",)):
    return {"device": "NVIDIA H200", "nvtx_active": True, "host_node": "native",
            "step_us": [610.0, 598.5],
            "unavailable": {}, "landmarks": {
                "capgraph_ranges": 5, "host_node_ranges": list(host_ranges),
                "mask_kernels": list(mask_kernels),
                "all_three": bool(mask_kernels) and bool(host_ranges)},
            "summary": [{"kind": "kernel", "name": "capgraph_logits_bitmask_f32_b32_p4",
                         "count": 2, "mean_us": 6.25, "total_us": 12.5},
                        {"kind": "nvtx", "name": "CapturableGuidedDecoder.build", "count": 2,
                         "mean_us": 401.0, "total_us": 802.0}],
            "critical_path": {"forward_end": 350.0, "mask_start": 410.0, "mask_end": 420.0,
                              "past_forward": 70.0, "node_start": 30.0, "node_end": 370.0}}


def _write(out: Path, kernel_rows, replay_rows, failing=False, xgr_rows=None, host_nodes=None,
           profile=None):
    (out / "summary.txt").write_text("kernel rc=0 3s\ngpu-tests rc=0 90s\n")
    failure = ('<testcase classname="tests.test_ops_gpu" name="test_x"><failure message="boom&#10;'
               'trace"/></testcase>' if failing else "")
    (out / "gpu_tests.xml").write_text(
        f'<testsuites><testsuite tests="3" failures="{int(failing)}" errors="0" skipped="1">'
        f'<testcase classname="a" name="b"/>{failure}</testsuite></testsuites>')
    (out / "bench_kernel.json").write_text(json.dumps(
        {"device": "NVIDIA H200", "vocab": 128000, "date": "2026-12-01", "unavailable": {
            "xgr_cuda": "skipped (--no-xgrammar-cuda)"}, "rows": kernel_rows}))
    if xgr_rows is not None:
        (out / "bench_kernel_xgr_cuda.json").write_text(json.dumps(
            {"device": "NVIDIA H200", "vocab": 128000, "rows": xgr_rows}))
    replay = {"device": "NVIDIA H200", "steps": 64, "rows": replay_rows}
    if host_nodes is not None:
        replay["host_nodes"] = host_nodes
    (out / "bench_replay.json").write_text(json.dumps(replay))
    if profile is not None:
        (out / "profile_cupti.json").write_text(json.dumps(profile))


def _verdict(text, kind, model, batch):
    """The measured cell and the verdict of one replay target line."""
    name = (f"| replayed guided step <= 1.05x unguided, {kind} host node, {model} model, "
            f"batch {batch} |")
    line = next(line for line in text.splitlines() if line.startswith(name))
    return [cell.strip() for cell in line[len(name):].strip(" |").split("|")]


def test_targets_met(gpu_report, tmp_path):
    """Every target met: kernel rows, xgrammar's CUDA run, all five replay points for both
    host-node kinds at <= 1.05x, and a profile that shows all three landmarks."""
    rows = [_replay_row(m, b, 1.0 + i / 100, kind) for kind in ("python", "native")
            for i, (m, b) in enumerate(POINTS)]
    _write(tmp_path, [_kernel_row(1, 5.0, 100, 3000, triton_us=9.0),
                      _kernel_row(256, 50.0, 3600, 4000, triton_us=80.0),
                      _kernel_row(4096, 700.0, 3900, 4200, triton_us=1000.0)], rows,
           xgr_rows=[_kernel_row(4096, 700.0, 3900, 4200, cuda_us=900.0)],
           host_nodes={"python": "measured", "native": "measured"}, profile=_profile())
    text = gpu_report.report(tmp_path)
    assert "GPU tests: 2 passed, 0 failed, 0 errors, 1 skipped" in text
    # rows written before the variants (ours_s) are the rmw kernel's
    assert ("| bf16 | random | 4096 | 700.0 | - | - | 3900 | 4200 | 92.9 | - | 1000.0 | 0.70 | "
            "0.70 | rmw | rmw |") in text
    assert "| kernel >= 80% of copy bandwidth at batch >= 256 | lowest 90.0% | yes |" in text
    assert "| kernel no slower than xgrammar's fastest at any batch, default variant | worst 0.78x | yes |" in text
    assert "fastest variant per cell (not always the default) | worst 0.78x | yes |" \
        in text
    for kind in ("python", "native"):
        for i, (model, batch) in enumerate(POINTS):
            assert _verdict(text, kind, model, batch) == [f"{1.0 + i / 100:.3f}x", "yes"]
    assert ("| small | 256 | native | 63/60 | 2.000 | 2.080 | 1.040 | 1.030 | 0.400 | 1.56 | 0.100 | "
            "0.39 |") in text
    assert "| tiny | 64 | python | 63/60 | 2.000 | 2.000 | 1.000 | 0.990 | 0.400 | 6.25 | - | - |" in text
    assert "xgr_cuda: skipped (--no-xgrammar-cuda)" in text
    assert ("| profile: capgraph ranges, host node and mask kernel in one replayed step | "
            "capgraph ranges, host node, mask kernel | yes |") in text
    assert "native host node; NVTX live): 2 replayed steps of 610, 598 us" in text
    assert "| nvtx | CapturableGuidedDecoder.build | 2 | 401.0 | 802.0 |" in text
    assert ("critical path of the last step (us from its first kernel): forward 0-350.0; host "
            "node 30.0-370.0; mask kernel 410.0-420.0: the mask kernel ends 70.0 us after the "
            "forward's last kernel") in text


def test_targets_missed_and_failures_named(gpu_report, tmp_path):
    """Missed targets say no; a failing test is named; a host-node kind the decoder lacks is
    reported as not available (not as missed); a profile without the mask kernel says no."""
    rows = [_replay_row(m, b, 1.2 if (m, b) == ("tiny", 64) else 1.01, build_ms=None)
            for m, b in POINTS]
    why = "not available (CapturableGuidedDecoder takes no host_node argument)"
    _write(tmp_path, [_kernel_row(256, 50.0, 2000, 4000, triton_us=40.0,
                                  xgr_triton_error="result differs from capgraph's")], rows,
           failing=True, host_nodes={"python": "measured", "native": why},
           profile=_profile(mask_kernels=()))
    text = gpu_report.report(tmp_path)
    assert "1 failed" in text and "tests.test_ops_gpu::test_x (failure: boom)" in text
    assert "| kernel >= 80% of copy bandwidth at batch >= 256 | lowest 50.0% | no |" in text
    assert "worst 1.25x | no |" in text
    assert _verdict(text, "python", "tiny", 64) == ["1.200x", "no"]
    assert _verdict(text, "python", "small", 256) == ["1.010x", "yes"]
    assert f"| replayed guided step <= 1.05x unguided, native host node | {why} | - |" in text
    assert f"- native host node: {why}" in text
    assert "| tiny | 64 | python | 63/60 | 2.000 | 2.400 | 1.200 | 1.190 | - | - | - | - |" in text
    assert "xgr_triton_error: result differs from capgraph's" in text
    assert ("| profile: capgraph ranges, host node and mask kernel in one replayed step | "
            "capgraph ranges, host node | no |") in text


def test_time_boxed_replay_and_rows_without_host_node(gpu_report, tmp_path):
    """A replay run stopped by its time box leaves its later points "not measured"; a row
    without a host_node field (the format before there were two kinds) counts as the Python
    callback's."""
    _write(tmp_path, [], [_replay_row("tiny", 64, 1.3, host_node=None),
                          _replay_row("tiny", 256, 1.6, host_node=None)])
    text = gpu_report.report(tmp_path)
    assert _verdict(text, "python", "tiny", 64) == ["1.300x", "no"]
    assert _verdict(text, "python", "tiny", 256) == ["1.600x", "no"]
    for model, batch in POINTS[2:]:
        assert _verdict(text, "python", model, batch) == ["not measured", "-"]
    for model, batch in POINTS:
        assert _verdict(text, "native", model, batch) == ["not measured", "-"]
    assert "profile (CUPTI): no results" in text


def test_failed_replay_run_is_named_and_missed(gpu_report, tmp_path):
    """A guided run that raised (its row carries the error) is a missed target with the
    error shown, and a failed warm-up is listed under the table."""
    rows = [_replay_row("tiny", 64, 1.01),
            {"model": "tiny", "batch": 64, "host_node": "native",
             "error": "CallbackError: native node refused the guide"}]
    _write(tmp_path, [], rows, host_nodes={"python": "measured", "native": "measured"})
    data = json.loads((tmp_path / "bench_replay.json").read_text())
    data["errors"] = ["tiny warm-up, native host node: RuntimeError: no library",
                      "tiny batch 64, native host node: CallbackError: native node refused "
                      "the guide"]
    (tmp_path / "bench_replay.json").write_text(json.dumps(data))
    text = gpu_report.report(tmp_path)
    assert _verdict(text, "native", "tiny", 64) == [
        "failed: CallbackError: native node refused the guide", "no"]
    assert _verdict(text, "python", "tiny", 64) == ["1.010x", "yes"]
    assert "- tiny batch 64, native host node: failed: CallbackError: native node" in text
    assert "- tiny warm-up, native host node: RuntimeError: no library" in text
    assert "| tiny | 64 | native |" not in text


def _variant_row(batch, pattern, rmw_us, ahead_us, store_us, triton_us, **extra):
    """A bench_kernel row in the format with variants (None: that variant was not timed)."""
    row = {"dtype": "fp32", "pattern": pattern, "batch": batch, "bytes_moved": 1,
           "copy_GBps": 4000.0, "xgr_triton_s": triton_us * 1e-6}
    for variant, us in (("rmw", rmw_us), ("ahead", ahead_us), ("store", store_us)):
        row[f"{variant}_kernel"] = f"capgraph_logits_bitmask_f32_b4_p4_{variant}"
        row[f"{variant}_s"] = None if us is None else us * 1e-6
        if us is not None:
            row[f"{variant}_GBps"] = 3600.0 * rmw_us / us
    row.update(extra)
    return row


def test_kernel_variants_table_and_verdicts(gpu_report, tmp_path):
    """Each variant's time has a column and the fastest is named per cell; the bandwidth and
    the default's speed verdict judge rmw, a line of its own judges the fastest variant per
    cell; the wins are counted over cells where more than one variant ran; a variant that
    failed its check is listed; the xgrammar-CUDA run's rows join both speed verdicts; a run
    that gave our kernels a token mask says so."""
    rows = [_variant_row(1, "dense", 4.7, 3.8, 4.1, 4.0),
            _variant_row(4, "sparse", 5.4, 5.2, 4.9, 5.0),
            _variant_row(16, "dense", 7.1, None, 6.0, 6.4,
                         ahead_error="result differs from the pure-torch kernel's"),
            _variant_row(4096, "random", 1000.0, None, None, 1800.0)]
    xgr_rows = [_variant_row(1, "dense", 4.6, 4.2, 4.4, 9.0, xgr_cuda_s=4.0e-6)]
    _write(tmp_path, rows, [], xgr_rows=xgr_rows)
    text = gpu_report.report(tmp_path)
    assert ("| fp32 | dense | 1 | 4.7 | 3.8 | 4.1 | 3600 | 4000 | 90.0 | - | 4.0 | 1.18 | 0.95 | "
            "ahead | rmw |") in text
    assert ("| fp32 | sparse | 4 | 5.4 | 5.2 | 4.9 | 3600 | 4000 | 90.0 | - | 5.0 | 1.08 | 0.98 | "
            "store | rmw |") in text
    assert "| fp32 | dense | 16 | 7.1 | - | 6.0 |" in text
    assert ("| fp32 | random | 4096 | 1000.0 | - | - | 3600 | 4000 | 90.0 | - | 1800.0 | 0.56 | "
            "0.56 | rmw | rmw |") in text
    assert "- ahead_error: result differs from the pure-torch kernel's" in text
    assert "Fastest variant, over the cells where more than one ran: ahead 1, store 2" in text
    assert "| kernel >= 80% of copy bandwidth at batch >= 256 | lowest 90.0% | yes |" in text
    # rows without default_variant ran rmw by default: worst 4.7 / 4.0 = 1.18 (bench_kernel),
    # 4.6 / 4.0 = 1.15 (the xgrammar-CUDA run)
    assert ("| kernel no slower than xgrammar's fastest at any batch, default variant | worst "
            "1.18x | no |") in text
    # fastest variant: 6.0 / 6.4 = 0.94 in the first run, 4.2 / 4.0 = 1.05 in the second
    assert ("fastest variant per cell (not always the default) | worst 1.05x | "
            "no |") in text
    assert "token mask of ones" not in text
    data = json.loads((tmp_path / "bench_kernel.json").read_text())
    # the default judged is the variant bench_kernel says the library runs in each cell: store
    # at batch 1 and 4 (4.1 / 4.0, 4.9 / 5.0), store at 16 (6.0 / 6.4), rmw at 4096 where
    # no other ran; the xgrammar-CUDA run's row still rmw (4.6 / 4.0)
    for r in data["rows"]:
        r["default_variant"] = "store" if r["batch"] <= 16 else "rmw"
    (tmp_path / "bench_kernel.json").write_text(json.dumps(data))
    text = gpu_report.report(tmp_path)
    assert ("| fp32 | dense | 1 | 4.7 | 3.8 | 4.1 | 3600 | 4000 | 90.0 | - | 4.0 | 1.02 | 0.95 | "
            "ahead | store |") in text
    assert ("| kernel no slower than xgrammar's fastest at any batch, default variant | worst "
            "1.15x | no |") in text
    (tmp_path / "bench_kernel.json").write_text(json.dumps(dict(data, token_mask=True)))
    assert ("- capgraph's kernels were given a token mask of ones, xgrammar's none"
            in gpu_report.report(tmp_path))


def test_cpu_replay_run_gives_no_verdict(gpu_report, tmp_path):
    """bench_graph_replay.py --device cpu writes "replayed": false; its ratios are shown but
    judge no GPU target."""
    _write(tmp_path, [], [_replay_row("tiny", 64, 1.01)])
    data = json.loads((tmp_path / "bench_replay.json").read_text())
    (tmp_path / "bench_replay.json").write_text(json.dumps(dict(data, replayed=False)))
    text = gpu_report.report(tmp_path)
    assert "| tiny | 64 | python | 63/60 | 2.000 | 2.020 | 1.010 | 1.000 | 0.400 | 6.25 | - | - |" in text
    assert "not replayed in CUDA graphs (a CPU run)" in text
    assert _verdict(text, "python", "tiny", 64) == ["not measured", "-"]


def test_both_test_steps_are_counted_and_a_missing_one_is_named(gpu_report, tmp_path):
    """gpu_check.sh runs the GPU tests in two steps, each with its junit XML: the report sums
    both and lists the failures of either; where the second step left no file it says which."""
    _write(tmp_path, [], [], failing=True)
    text = gpu_report.report(tmp_path)
    assert "GPU tests: 1 passed, 1 failed, 0 errors, 1 skipped (no junit XML from " \
        "gpu_tests_rest.xml: that step did not finish)" in text
    (tmp_path / "gpu_tests_rest.xml").write_text(
        '<testsuites><testsuite tests="4" failures="0" errors="1" skipped="0">'
        '<testcase classname="tests.test_ops_gpu" name="test_y"><error message="gone"/>'
        '</testcase></testsuite></testsuites>')
    text = gpu_report.report(tmp_path)
    assert "GPU tests: 4 passed, 1 failed, 1 errors, 1 skipped\n" in text
    assert "- tests.test_ops_gpu::test_x (failure: boom)" in text
    assert "- tests.test_ops_gpu::test_y (error: gone)" in text


def test_missing_and_truncated_files_are_said(gpu_report, tmp_path):
    """No files, or a JSON file cut mid-write: each section says so, every target is "not
    measured" (3 kernel + 5 points x 2 host-node kinds + the profile), and a missing folder
    exits 2."""
    (tmp_path / "bench_kernel.json").write_text('{"rows": [')  # killed mid-write
    (tmp_path / "bench_replay.json").write_text('{"rows": [{"model"')
    (tmp_path / "bench_argmax.json").write_text('{"rows": [{"dtype"')
    text = gpu_report.report(tmp_path)
    assert "GPU tests: no junit XML" in text
    assert "bench_kernel.json is not readable JSON" in text
    assert "bench_graph_replay: bench_replay.json is not readable JSON" in text
    assert "profile (CUPTI): no results" in text
    assert "bench_argmax: bench_argmax.json is not readable JSON" in text
    assert text.count("not measured") == 3 + 10 + 1
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "bench_argmax: no results" in gpu_report.report(empty)
    assert gpu_report.main([str(tmp_path / "nowhere")]) == 2


def test_argmax_table(gpu_report, tmp_path):
    """bench_argmax.json becomes a table row per dtype, pattern and batch with its three
    times and two ratios."""
    (tmp_path / "bench_argmax.json").write_text(json.dumps({"vocab": 131072, "rows": [
        {"dtype": "float32", "pattern": "2%", "batch": 256, "argmax_us": 40.0,
         "mask_argmax_us": 110.0, "fused_us": 22.0, "fused_over_unfused": 0.2,
         "fused_over_argmax": 0.55}]}))
    text = gpu_report.report(tmp_path)
    assert "bench_argmax (greedy sampling under a bitmask, V = 131072, us per call)" in text
    assert "| float32 | 2% | 256 | 40.0 | 110.0 | 22.0 | 0.20 | 0.55 |" in text


def test_bench_kernel_counts_the_bytes_of_32_byte_sectors():
    """tools/bench_kernel.py's byte count, on a hand-made row of fp32 logits (8 per sector):
    an all-allowed sector moves nothing, an all-masked one 32 bytes (written), a mixed one 64
    (read and written), a partial last sector its masked tokens twice; plus the bitmask."""
    spec = importlib.util.spec_from_file_location("bench_kernel", ROOT / "tools" / "bench_kernel.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    import torch

    vocab = 4 * 8 + 3  # four full sectors and three tokens of a fifth
    allowed = torch.zeros(64, dtype=torch.int64)
    allowed[0:8] = 1          # sector 0: all allowed -> 0
    #                           sector 1: all masked  -> 32
    allowed[16:23] = 1        # sector 2: one masked  -> 64
    allowed[24] = 1           # sector 3: one allowed -> 64
    allowed[32:34] = 1        # tail: 1 of 3 masked   -> 2 * 4
    allowed[35:] = 1          # (past the vocabulary: ignored)
    words = [int(sum(int(allowed[w * 32 + b]) << b for b in range(32))) for w in range(2)]
    bitmask = torch.tensor([[w - (1 << 32) if w >= 1 << 31 else w for w in words]],
                           dtype=torch.int32)
    assert module._bytes_moved(bitmask, vocab, 4) == 32 + 64 + 64 + 8 + 2 * 4
    # bf16: 16 tokens per sector; the first 32 tokens are sectors 0 (half allowed: mixed) and 1
    assert module._bytes_moved(bitmask, 32, 2) == 64 + 64 + 8
