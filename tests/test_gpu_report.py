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


def _write(out: Path, kernel_rows, replay_ratio_64, failing=False, xgr_rows=None):
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
    (out / "bench_replay.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": [
        {"batch": 8, "unguided_steps": 64, "guided_steps": 60, "unguided_ms_per_step": 1.0,
         "guided_ms_per_step": 1.2, "ratio": 1.2},
        {"batch": 64, "unguided_steps": 64, "guided_steps": 64, "unguided_ms_per_step": 2.0,
         "guided_ms_per_step": 2.0 * replay_ratio_64, "ratio": replay_ratio_64}]}))


def test_targets_met(gpu_report, tmp_path):
    _write(tmp_path, [_kernel_row(1, 5.0, 100, 3000, triton_us=9.0),
                      _kernel_row(256, 50.0, 3600, 4000, triton_us=80.0),
                      _kernel_row(4096, 700.0, 3900, 4200, triton_us=1000.0)], 1.02,
           xgr_rows=[_kernel_row(4096, 700.0, 3900, 4200, cuda_us=900.0)])
    text = gpu_report.report(tmp_path)
    assert "GPU tests: 2 passed, 0 failed, 0 errors, 1 skipped" in text
    assert "| bf16 | random | 4096 | 700.0 | 3900 | 4200 | 92.9 | - | 1000.0 | 0.70 |" in text
    assert "| kernel >= 80% of copy bandwidth at batch >= 256 | lowest 90.0% | yes |" in text
    assert "| kernel no slower than xgrammar's fastest at any batch | worst 0.78x | yes |" in text
    assert "| replayed guided step <= 1.05x unguided at batch 64 | 1.020x | yes |" in text
    assert "xgr_cuda: skipped (--no-xgrammar-cuda)" in text


def test_targets_missed_and_failures_named(gpu_report, tmp_path):
    _write(tmp_path, [_kernel_row(256, 50.0, 2000, 4000, triton_us=40.0,
                                  xgr_triton_error="result differs from capgraph's")], 1.2,
           failing=True)
    text = gpu_report.report(tmp_path)
    assert "1 failed" in text and "tests.test_ops_gpu::test_x (failure: boom)" in text
    assert "| kernel >= 80% of copy bandwidth at batch >= 256 | lowest 50.0% | no |" in text
    assert "worst 1.25x | no |" in text
    assert "| replayed guided step <= 1.05x unguided at batch 64 | 1.200x | no |" in text
    assert "xgr_triton_error: result differs from capgraph's" in text


def test_missing_and_truncated_files_are_said(gpu_report, tmp_path):
    (tmp_path / "bench_kernel.json").write_text('{"rows": [')  # killed mid-write
    text = gpu_report.report(tmp_path)
    assert "GPU tests: no junit XML" in text
    assert "bench_kernel.json is not readable JSON" in text
    assert "bench_graph_replay: no results" in text
    assert text.count("not measured") == 3
    assert gpu_report.main([str(tmp_path / "nowhere")]) == 2


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
