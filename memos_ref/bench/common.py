"""What every benchmark shares: the JSON contract, machine description, and side-by-side timing.

Contract (DESIGN.md §4): ``python -m memos_ref.bench NAME [--quick] [--json] [--plot FILE]``. With
``--json`` exactly one JSON object goes to stdout:
``{"bench", "version", "machine", "config", "results", "summary"}``; progress goes to stderr.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

__all__ = ["envelope", "format_table", "machine_info", "time_calls_ms"]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import transformers

    info: dict[str, Any] = {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }
    return info


def envelope(
    name: str, config: dict[str, Any], results: list[dict[str, Any]], summary: dict[str, Any]
) -> dict[str, Any]:
    """The one JSON object a benchmark prints."""
    from memos_ref import __version__

    return {
        "bench": name,
        "version": __version__,
        "machine": machine_info(),
        "config": config,
        "results": results,
        "summary": summary,
    }


def time_calls_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn()`` in milliseconds over ``repeats`` calls after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples), samples


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table (for the human-readable output and the README)."""
    cells = [[str(c) for c in columns]] + [[_fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return str(value)
