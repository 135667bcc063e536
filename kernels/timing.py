"""The one timer of the kernels package: ``triton.testing.do_bench`` on a GPU, ``torch.utils.benchmark`` elsewhere.

Every benchmark in ``kernels/`` times through :func:`time_ms`, so GPU figures are taken the way Triton's
tutorials take them (warm-up, cache flushed between runs, CUDA events) and CPU figures (Triton's interpreter
or plain torch) the way torch's own benchmarks do (blocked runs on one thread).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memos_ref.errors import InvalidArgumentError

__all__ = ["Timing", "bench_ms", "best_ms", "device_timings", "stopwatch", "time_ms"]


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


def stopwatch() -> float:
    """Seconds on a monotonic clock: for budgets, deadlines and phase times (not for kernel timings)."""
    return time.monotonic()


def device_timings(fn: Callable[[], Any], device: torch.device | str, *, rep_ms: int = 40) -> dict[str, Any]:
    """Median milliseconds of ``fn()`` with ``triton.testing.do_bench`` (``do_bench_ms``) beside
    ``do_bench_cudagraph`` (``cudagraph_ms``: launch overhead removed; ``None`` with ``cudagraph_error`` when the
    capture is refused) on a GPU; on the CPU one wall-clock call (``cudagraph_ms`` ``None``), the caller having
    run ``fn`` once already."""
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        fn()
        return {"do_bench_ms": (time.perf_counter() - t0) * 1e3, "cudagraph_ms": None}
    import triton.testing

    res: dict[str, Any] = {"do_bench_ms": float(triton.testing.do_bench(fn, rep=rep_ms, return_mode="median"))}
    try:
        res["cudagraph_ms"] = float(triton.testing.do_bench_cudagraph(fn, rep=rep_ms, return_mode="median"))
    except Exception as exc:  # capture can refuse (an allocation or a host sync inside): keep the row
        res["cudagraph_ms"] = None
        res["cudagraph_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return res


def bench_ms(fn: Callable[[], Any], device: torch.device | str, *, rep_ms: int = 40) -> float:
    """Median milliseconds of ``fn()`` with ``triton.testing.do_bench`` on a GPU (no CUDA-graph variant: ``fn``
    may replay a graph itself); on the CPU one wall-clock call."""
    if torch.device(device).type != "cuda":
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return float(triton.testing.do_bench(fn, rep=rep_ms, return_mode="median"))


def best_ms(timings: dict[str, Any]) -> float:
    """The faster of :func:`device_timings`' two medians (the CUDA-graph one when the capture worked)."""
    return min(x for x in (timings["do_bench_ms"], timings["cudagraph_ms"]) if x is not None)
