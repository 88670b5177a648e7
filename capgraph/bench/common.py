"""What every sub-benchmark shares: machine facts, statistics, a table printer, the JSON writer.

Each sub-benchmark returns a payload ``{"rows": [...], ...}``; :func:`write_json` stores it next
to :func:`machine_info` and the arguments that produced it, by default under
``results/<name>-<UTC timestamp>.json``.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import os
import platform
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

__all__ = ["machine_info", "median", "percentile", "summarize", "Column", "print_table",
           "write_json", "pick", "utc_stamp"]

#: The percentiles a latency summary reports (the MaskBench tail plus the median).
TAIL_QUANTILES = (50.0, 90.0, 99.0, 99.9)


# -- statistics --------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks
    (NumPy's default), of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


def summarize(values: Sequence[float], scale: float = 1.0,
              quantiles: Iterable[float] = TAIL_QUANTILES) -> dict[str, float]:
    """``{"p50": .., "p90": .., "p99": .., "p99.9": .., "max": .., "mean": .., "n": ..}``,
    every figure multiplied by ``scale`` (e.g. 1e3 for seconds -> ms)."""
    out = {f"p{q:g}": percentile(values, q) * scale for q in quantiles}
    out["max"] = max(values) * scale
    out["mean"] = sum(values) / len(values) * scale
    out["n"] = len(values)
    return out


# -- machine -----------------------------------------------------------------------------------
def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_bytes() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def machine_info() -> dict[str, Any]:
    """Date, host, CPU model and count, memory, load, Python/torch/xgrammar versions, GPU."""
    import torch

    info: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "memory_bytes": _memory_bytes(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "xgrammar": _version("xgrammar"),
        "capgraph": _version("capgraph"),
        "transformers": _version("transformers"),
        "cuda_available": torch.cuda.is_available(),
    }
    if info["cuda_available"]:
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    return info


def describe_machine(info: dict[str, Any]) -> str:
    """One line: ``2 cores AMD EPYC, 23.5 GiB, load 1.2, torch 2.13.0, xgrammar 0.2.9``."""
    mem = info.get("memory_bytes")
    load = info.get("load_average") or [float("nan")]
    parts = [f"{info['cpu_count']} cores {info['cpu_model']}",
             f"{mem / 2**30:.1f} GiB" if mem else "memory ?",
             f"load {load[0]:.2f}", f"torch {info['torch']} ({info['torch_threads']} threads)",
             f"xgrammar {info['xgrammar']}"]
    if info.get("gpu"):
        parts.append(info["gpu"])
    return ", ".join(parts)


# -- output ------------------------------------------------------------------------------------
class Column:
    """A table column: the row key (or a callable of the row), its header and its format."""

    def __init__(self, key: str | Callable[[dict], Any], header: str, fmt: str = "") -> None:
        self.key, self.header, self.fmt = key, header, fmt

    def cell(self, row: dict) -> str:
        value = self.key(row) if callable(self.key) else row.get(self.key)
        if value is None:
            return "-"
        if isinstance(value, float) and math.isnan(value):
            return "-"
        return format(value, self.fmt) if self.fmt else str(value)


def print_table(columns: Sequence[Column], rows: Sequence[dict], file=None) -> str:
    """Print (and return) a right-aligned plain-text table; markdown-compatible pipes."""
    cells = [[c.cell(r) for c in columns] for r in rows]
    widths = [max([len(c.header)] + [len(row[i]) for row in cells])
              for i, c in enumerate(columns)]
    lines = ["| " + " | ".join(c.header.rjust(w) for c, w in zip(columns, widths)) + " |",
             "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"]
    lines += ["| " + " | ".join(v.rjust(w) for v, w in zip(row, widths)) + " |"
              for row in cells]
    text = "\n".join(lines)
    print(text, file=file or sys.stdout, flush=True)
    return text


def utc_stamp() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def write_json(name: str, payload: dict[str, Any], path: str | os.PathLike | None = None,
               results_dir: str | os.PathLike = "results") -> Path:
    """Write ``payload`` to ``path``, or to ``<results_dir>/<name>-<UTC timestamp>.json``.

    Returns the path written. Parent folders are created.
    """
    target = Path(path) if path else Path(results_dir) / f"{name}-{utc_stamp()}.json"
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "w") as f:
        json.dump(payload, f, indent=1, default=_jsonable)
        f.write("\n")
    return target


def _jsonable(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def pick(value: Any, quick: bool, quick_default: Any, full_default: Any) -> Any:
    """An option's value: what the user gave, else the quick or the full default."""
    if value is not None:
        return value
    return quick_default if quick else full_default


def fastest_masks(compiled: dict[str, Any], tokens: Sequence[int], repeat: int,
                  bitmask: Any, what: str) -> dict[str, list[float]]:
    """Per side of ``compiled`` (name -> ``xgrammar.CompiledGrammar``), the fastest of
    ``repeat`` passes of ``fill_next_token_bitmask`` (seconds) before each of ``tokens``, fed
    to a fresh matcher per side per pass; the sides are timed alternately on the same token,
    so that a change of load hits all of them.

    Raises:
        SystemExit: a side's matcher refuses a token (``what`` names the text).
    """
    import time

    import xgrammar as xgr
    best = {side: [math.inf] * len(tokens) for side in compiled}
    for _ in range(max(1, repeat)):
        matchers = {side: xgr.GrammarMatcher(grammar) for side, grammar in compiled.items()}
        for i, token in enumerate(tokens):
            for side, matcher in matchers.items():
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask)
                best[side][i] = min(best[side][i], time.perf_counter() - start)
                if not matcher.accept_token(token):
                    raise SystemExit(f"the {side} grammar refuses token {i} of {what}")
    return best


def mask_cells(seconds: Sequence[float]) -> dict[str, float]:
    """The ``n``, ``mean`` and ``max`` (milliseconds) of per-token mask times in seconds, the
    cells of :func:`mask_columns`."""
    return {"n": len(seconds), "mean": sum(seconds) / len(seconds) * 1e3,
            "max": max(seconds) * 1e3}


def mask_columns(compile_fmt: str = ".1f", masks: str = "masks") -> list[Column]:
    """The columns of a compile time (row key ``compile``, milliseconds) and
    :func:`mask_cells`, headed ``masks`` for the count."""
    return [Column("compile", "compile ms", compile_fmt), Column("n", masks),
            Column("mean", "mask mean ms", ".4f"), Column("max", "mask max ms", ".3f")]


def print_mask_summary(masks: dict[str, list[float]], label: str) -> str:
    """Print (and return) one row per side of ``masks`` (name -> mask times in seconds): the
    count, p50, p90, p99, max and mean in milliseconds; ``label`` heads the side column."""
    rows = [{"side": side, **summarize(times, 1e3)} for side, times in masks.items()]
    return print_table([Column("side", label), Column("n", "masks"),
                        Column("p50", "p50 ms", ".4f"), Column("p90", "p90 ms", ".4f"),
                        Column("p99", "p99 ms", ".3f"), Column("max", "max ms", ".3f"),
                        Column("mean", "mean ms", ".4f")], rows)
