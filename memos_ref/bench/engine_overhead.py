"""``bench decode``'s engine overhead: the engine's per-step time beyond the model's forward, on a model whose
forward is timed separately."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from memos_ref.bench.common import time_interleaved_ms
from memos_ref.caches import ContiguousCache

__all__ = ["engine_overhead"]


class _TimedModel:
    """The package forward, timing each call (the engine's forward inside its step)."""

    def __init__(self, model: Any) -> None:
        self.model, self.config, self.calls_ms = model, model.config, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.calls_ms.append((time.perf_counter() - started) * 1e3)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def engine_overhead(model: Any, rows: int, context: int, warmup: int, steps: int) -> dict[str, Any]:
    """µs per row per step of ``Engine.step`` (decode only: every row admitted and prefilled first), of the
    forward inside it, of what lies outside that forward, and of the forward's excess over the same batch
    through a ContiguousCache — timed side by side."""
    from memos_ref.engine import Engine, Request
    from memos_ref.paged import PagedKV

    spec = model.kv_spec(block_size=16)
    length = context + warmup + steps + 2 * rows + 4
    kv = PagedKV(spec, rows * (spec.blocks_for(length) + 1))
    timed = _TimedModel(model)
    engine = Engine(timed, kv, max_batch=rows)
    gen = torch.Generator().manual_seed(rows)
    prompts = torch.randint(1, 256, (rows, context), generator=gen)
    for prompt in prompts.tolist():
        engine.submit(Request(prompt, max_new_tokens=warmup + steps + rows + 2))
    with torch.inference_mode():
        for _ in range(rows + 1):  # admission and prefill of every row (however many per step), untimed
            engine.step()
            if len(engine.running) == rows and not engine.waiting:
                break
    cache = ContiguousCache(capacity=length)
    with torch.inference_mode():
        model(prompts, cache)
    last = prompts[:, -1:]
    forward_ms: list[float] = []

    def engine_step() -> None:
        before = len(timed.calls_ms)
        engine.step()
        forward_ms.append(sum(timed.calls_ms[before:]))

    def contiguous_step() -> None:
        with torch.inference_mode():
            model(last, cache)

    samples = time_interleaved_ms({"engine": engine_step, "contiguous": contiguous_step}, steps, warmup=warmup)
    forward_ms = forward_ms[warmup:]
    per = 1e3 / rows  # ms per step -> µs per row

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs) * per, 1)

    outside = [a - b for a, b in zip(samples["engine"], forward_ms)]
    excess = [a - b for a, b in zip(forward_ms, samples["contiguous"])]
    overhead = [a - b for a, b in zip(samples["engine"], samples["contiguous"])]
    for _request, seq in list(engine.running):
        seq.free()
    return {
        "rows": rows,
        "context": context,
        "timed_steps": steps,
        "model": "shipped",
        "step_us_per_row_step": med(samples["engine"]),
        "forward_us_per_row_step": med(forward_ms),
        "outside_forward_us_per_row_step": med(outside),
        "contiguous_forward_us_per_row_step": med(samples["contiguous"]),
        "paged_forward_excess_us_per_row_step": med(excess),
        "overhead_us_per_row_step": med(overhead),
        "overhead_us_per_row_step_min": round(min(overhead) * per, 1),
        "overhead_us_per_row_step_max": round(max(overhead) * per, 1),
    }
