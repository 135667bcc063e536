"""The one timer of the kernels package: ``triton.testing.do_bench`` on a GPU, ``torch.utils.benchmark`` elsewhere.

Every benchmark in ``kernels/`` times through :func:`time_ms`, so GPU figures are taken the way Triton's
tutorials take them (warm-up, cache flushed between runs, CUDA events) and CPU figures (Triton's interpreter
or plain torch) the way torch's own benchmarks do (blocked runs on one thread).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memos_ref.errors import InvalidArgumentError

__all__ = ["Timing", "time_ms"]


@dataclass(frozen=True)
class Timing:
    """Milliseconds per call: median, fastest and slowest over ``samples`` measured runs."""

    median_ms: float
    min_ms: float
    max_ms: float
    samples: int

    def as_dict(self, prefix: str) -> dict[str, float | int]:
        """``{prefix}_ms`` (the median) and ``{prefix}_ms_min`` / ``_max``, for a benchmark's JSON row."""
        return {f"{prefix}_ms": self.median_ms, f"{prefix}_ms_min": self.min_ms, f"{prefix}_ms_max": self.max_ms}


def time_ms(fn: Callable[[], Any], device: torch.device | str = "cpu", *, budget_ms: float = 100.0) -> Timing:
    """Time ``fn()``: with ``triton.testing.do_bench`` (``budget_ms`` of repeats after a warm-up) when
    ``device`` is a CUDA device, else with ``torch.utils.benchmark.Timer.blocked_autorange`` (at least
    ``budget_ms`` of runs, one of them a warm-up)."""
    if budget_ms <= 0:
        raise InvalidArgumentError(f"budget_ms must be positive, got {budget_ms}")
    if torch.device(device).type == "cuda":
        import triton.testing

        times = [float(t) for t in triton.testing.do_bench(fn, rep=max(1, round(budget_ms)), return_mode="all")]
    else:
        from torch.utils.benchmark import Timer

        measurement = Timer(stmt="fn()", globals={"fn": fn}).blocked_autorange(min_run_time=budget_ms / 1e3)
        times = [t * 1e3 for t in measurement.times]
    return Timing(statistics.median(times), min(times), max(times), len(times))
