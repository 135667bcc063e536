"""The reload-or-recompute cost model: is bringing blocks back from a tier faster than prefilling their tokens?

Prefill time against context length is fitted as ``a + b·n + c·n²`` (the quadratic term is attention), reload
time as a per-block time per tier (measured, or the tier's declared bandwidth). :meth:`CostModel.calibrate`
measures both; a model can also be built from known figures (``CostModel(recompute_fit=(a, b, c),
block_seconds={"host": 2e-5})``), which is how tests and capacity planning use it.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from memos_ref.errors import InvalidArgumentError, check_index, check_type
from memos_ref.paged.store import PagedKV
from memos_ref.tiering.store import TierStore

__all__ = ["CostModel"]


class CostModel:
    """Measured (or given) costs of recomputing tokens and reloading blocks.

    Args:
        recompute_fit: ``(a, b, c)``: prefilling ``n`` tokens takes ``a + b·n + c·n²`` seconds; None = unknown.
        block_seconds: seconds to reload one block, per tier name (a tier not listed falls back to its
            store's declared bandwidth).
    """

    def __init__(
        self,
        recompute_fit: Sequence[float] | None = None,
        block_seconds: Mapping[str, float] | None = None,
    ) -> None:
        if recompute_fit is not None:
            check_type("recompute_fit", recompute_fit, (tuple, list))
            if len(recompute_fit) != 3:
                raise InvalidArgumentError(f"recompute_fit: expected (a, b, c), got {len(recompute_fit)} numbers")
            recompute_fit = tuple(_finite(f"recompute_fit[{i}]", v) for i, v in enumerate(recompute_fit))
        check_type("block_seconds", block_seconds, (Mapping, type(None)))
        seconds = {}
        for tier, value in (block_seconds or {}).items():
            check_type("block_seconds key", tier, str)
            seconds[tier] = _finite(f"block_seconds[{tier!r}]", value)
        self.recompute_fit: tuple[float, float, float] | None = recompute_fit  # type: ignore[assignment]
        self.block_seconds: dict[str, float] = seconds

    def recompute_seconds(self, start: int, stop: int) -> float | None:
        """Estimated time to prefill positions ``start..stop``, or None if not measured."""
        start = check_index("start", start, lo=0)
        stop = check_index("stop", stop, lo=0)
        if self.recompute_fit is None:
            return None
        a, b, c = self.recompute_fit

        def total(n: int) -> float:
            return a + b * n + c * n * n if n > 0 else 0.0

        return max(total(stop) - total(start), 0.0)

    def reload_seconds(self, store: TierStore, tier: str, blocks: int, bytes_per_block: int) -> float | None:
        """Estimated time to bring ``blocks`` back from ``tier`` (measured per block, else the tier's declared
        bandwidth), or None."""
        check_type("tier", tier, str)
        blocks = check_index("blocks", blocks, lo=0)
        per = self.block_seconds.get(tier)
        if per is None:
            bw = store.bandwidth(tier)
            per = None if bw is None else bytes_per_block / bw
        return None if per is None else per * blocks

    def should_reload(
        self, store: TierStore, tier: str, blocks: int, start: int, stop: int, bytes_per_block: int
    ) -> bool:
        """Reload ``blocks`` blocks from ``tier`` rather than recompute positions ``start..stop``? True when
        nothing is measured yet (moving bytes is the usual winner)."""
        reload = self.reload_seconds(store, tier, blocks, bytes_per_block)
        recompute = self.recompute_seconds(start, stop)
        if reload is None or recompute is None:
            return True
        return reload <= recompute

    def break_even_tokens(
        self, store: TierStore, tier: str, block_size: int, bytes_per_block: int, max_tokens: int = 1 << 17
    ) -> int | None:
        """The shortest context (a multiple of ``block_size``) from which reloading it from ``tier`` is faster
        than recomputing it; None if recomputing always wins up to ``max_tokens`` (or nothing is measured)."""
        check_type("tier", tier, str)
        max_tokens = check_index("max_tokens", max_tokens, lo=0)
        n = block_size
        while n <= max_tokens:
            reload = self.reload_seconds(store, tier, n // block_size, bytes_per_block)
            recompute = self.recompute_seconds(0, n)
            if reload is None or recompute is None:
                return None
            if reload < recompute:
                return n
            n += block_size
        return None

    @torch.no_grad()
    def calibrate(
        self, model: Any, kv: PagedKV, store: TierStore, lengths: Sequence[int] = (32, 128, 512), repeats: int = 3
    ) -> dict[str, Any]:
        """Measure prefill time against context length on scratch memory shaped like ``kv`` (fit
        ``a + b·n + c·n²``) and the time to reload one block from each tier of ``store``; returns the
        measurements and keeps them."""
        from memos_ref.hf import PagedCache

        spec = kv.spec
        times = []
        for n in lengths:
            scratch = PagedKV(spec, -(-n // spec.block_size) + 1, prefix_caching=False, device=kv.pool.device)
            ids = torch.randint(0, 256, (1, n))
            best = math.inf
            for _ in range(repeats):
                cache = PagedCache(scratch)
                started = time.perf_counter()
                model(ids, cache)
                best = min(best, time.perf_counter() - started)
                cache.free()
            times.append(best)
        xs = torch.tensor([[1.0, n, n * n] for n in lengths], dtype=torch.float64)
        fit = torch.linalg.lstsq(xs, torch.tensor(times, dtype=torch.float64)[:, None]).solution.flatten()
        self.recompute_fit = tuple(float(v) for v in fit)  # type: ignore[assignment]
        probe = torch.randn(spec.block_shape).to(spec.dtype)
        key = f"calibration-probe-{os.getpid()}-{id(self)}"  # unique: processes may share a Redis tier
        for tier in store.tiers:
            if not store.put(key, probe, tier.name):
                continue
            best = math.inf
            for _ in range(repeats):
                started = time.perf_counter()
                got = store.get(key, tiers=[tier.name])
                if got is not None:
                    best = min(best, time.perf_counter() - started)
            tier.backend.delete(key)
            if best < math.inf:
                self.block_seconds[tier.name] = best
        return {
            "prefill_seconds": dict(zip(lengths, times)),
            "prefill_fit": self.recompute_fit,
            "reload_seconds_per_block": dict(self.block_seconds),
        }


def _finite(name: str, value: object) -> float:
    """A finite real number (not a bool), as a float."""
    check_type(name, value, (int, float))
    if not math.isfinite(value):  # type: ignore[arg-type]
        raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    return float(value)  # type: ignore[arg-type]
