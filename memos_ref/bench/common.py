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

from memos_ref.errors import StateError
from memos_ref.paged.allocator import BlockEvent
from memos_ref.spec import KVSpec

__all__ = [
    "NullPool",
    "envelope",
    "format_table",
    "machine_info",
    "ratio_stats",
    "time_calls_ms",
    "time_interleaved_ms",
]


class NullPool:
    """A :class:`~memos_ref.paged.kvpool.KVPool` that stores nothing: it stands in for a pool when a benchmark
    simulates only block metadata (copy-on-write copies nothing; writes and reads are refused).

    Args:
        layers: layers of its (1 KV head, head dim 1) spec.
        block_size: tokens per block.
        num_blocks: the block ids it pretends to hold (the allocator's size).
    """

    quantized: bool = False
    tracks_windows: bool = False
    block_events: frozenset[str] = frozenset()

    def __init__(self, layers: int = 1, *, block_size: int = 16, num_blocks: int = 0) -> None:
        self.spec = KVSpec(num_layers=layers, num_kv_heads=1, head_dim=1, block_size=block_size)
        self.device = torch.device("cpu")
        self.num_blocks = num_blocks
        self.nbytes = 0
        self.segments: list[torch.Tensor] = []

    def _refuse(self, what: str) -> StateError:
        return StateError(f"a NullPool stores no K/V ({what}): use a BlockPool for runs that move data")

    def check_kv(self, key: torch.Tensor, value: torch.Tensor, layer: int | None = None) -> None:
        raise self._refuse("check_kv")

    def write(self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
        raise self._refuse("write")

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._refuse("gather")

    def block(self, block: int) -> torch.Tensor:
        raise self._refuse("block")

    def copy_block(self, src: int, dst: int) -> None:
        """Copy-on-write of metadata only: nothing to copy."""

    def poison(self, block: int) -> None:
        """Nothing to poison."""

    def on_block_event(self, event: BlockEvent) -> None:
        """Hears no events (:attr:`block_events` is empty)."""


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
    """The one JSON object a benchmark prints, with the versions of the peers a benchmark may compare with
    (``peers``: cachetools, redis-py, redis-server as found now; a benchmark adds the ones it loads itself)."""
    from memos_ref import __version__
    from memos_ref.bench.peers import versions

    return {
        "bench": name,
        "version": __version__,
        "machine": machine_info(),
        "peers": versions("cachetools", "redis-py", "redis-server"),
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


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_interleaved_ms(
    calls: dict[str, Callable[[], Any]], repeats: int | dict[str, int], warmup: int = 1
) -> dict[str, list[float]]:
    """Wall times in milliseconds of several contenders measured side by side: ``warmup`` untimed rounds, then
    rounds in which every contender runs once (in a rotated order, so none always runs right after another);
    a contender given fewer ``repeats`` (a dict name -> count) sits out the later rounds. A load that comes and
    goes hits every contender alike, so ratios of samples taken in the same round stay meaningful.

    Returns name -> samples (ms), in round order."""
    counts = repeats if isinstance(repeats, dict) else dict.fromkeys(calls, repeats)
    names = list(calls)
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(warmup + max(counts.values(), default=0)):
        order = names[r % len(names) :] + names[: r % len(names)] if names else []
        for name in order:
            timed = r >= warmup
            if timed and len(samples[name]) >= counts[name]:
                continue
            _sync()
            started = time.perf_counter()
            calls[name]()
            _sync()
            if timed:
                samples[name].append((time.perf_counter() - started) * 1e3)
    return samples


def ratio_stats(num: list[float], den: list[float]) -> dict[str, float | None]:
    """Median, min and max of the per-round ratios ``num[i] / den[i]`` of two contenders timed side by side
    (:func:`time_interleaved_ms`), and the ratio of their medians (all ``None`` without a usable round)."""
    rounds = [a / b for a, b in zip(num, den) if b > 0]
    if not rounds:
        return {"median": None, "min": None, "max": None, "of_medians": None}
    return {
        "median": round(statistics.median(rounds), 3),
        "min": round(min(rounds), 3),
        "max": round(max(rounds), 3),
        "of_medians": round(statistics.median(num) / statistics.median(den), 3),
    }


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
