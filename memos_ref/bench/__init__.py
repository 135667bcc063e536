"""Benchmarks: ``python -m memos_ref.bench NAME [--quick] [--json] [--plot FILE]``.

Each benchmark is a module with ``run(quick, progress) -> dict`` (the JSON envelope of
:mod:`memos_ref.bench.common`), ``human(report) -> str`` and ``plot(report, path)``.
"""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["BENCHMARKS", "get"]

#: Benchmark name -> module under memos_ref.bench.
BENCHMARKS: dict[str, str] = {
    "agent": "memos_ref.bench.agent",
    "allocator": "memos_ref.bench.allocator",
    "cluster": "memos_ref.bench.cluster",
    "decode": "memos_ref.bench.decode",
    "decode-targets": "memos_ref.bench.decode_targets",
    "growth": "memos_ref.bench.growth",
    "memory": "memos_ref.bench.memory",
    "quant": "memos_ref.bench.quant",
    "sharing": "memos_ref.bench.sharing",
    "tiering": "memos_ref.bench.tiering",
    "waste": "memos_ref.bench.waste",
}


def get(name: str) -> ModuleType:
    """The module implementing benchmark ``name``."""
    if name not in BENCHMARKS:
        from memos_ref.errors import ConfigError

        raise ConfigError(f"unknown benchmark {name!r}: expected one of {sorted(BENCHMARKS)}")
    return importlib.import_module(BENCHMARKS[name])
