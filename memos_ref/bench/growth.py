"""``bench growth``: what growing a full preallocated cache costs, beside seed 003's table.

Seed 003 §4.2 reports 1.5× growths of 1024→1536 in 2.1 ms, 2048→3072 in 3.8 ms and 4096→6144 in 7.2 ms (on an
RTX 4090, geometry unstated). Here each growth is timed on one layer of Llama-2-7B's geometry (32 KV heads ×
128, fp16: 16 KiB per token per layer) — a whole model is 32 such layers — as the median of repeats. Also
reported, exactly: the bytes each growth copies, and the total copied by a cache grown from 256 tokens.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table
from memos_ref.caches import ContiguousCache

__all__ = ["SEED_003_MS", "human", "plot", "run"]

#: Seed 003's growth table: old capacity -> milliseconds to grow by 1.5×.
SEED_003_MS = {1024: 2.1, 2048: 3.8, 4096: 7.2}
HEADS, HEAD_DIM, DTYPE = 32, 128, torch.float16


def _one_growth(old_capacity: int) -> Any:
    cache = ContiguousCache(capacity=old_capacity, growth_factor=1.5, num_layers=1)
    full = torch.zeros(1, HEADS, old_capacity, HEAD_DIM, dtype=DTYPE)
    cache.update(full, full, 0)
    one = torch.zeros(1, HEADS, 1, HEAD_DIM, dtype=DTYPE)
    cache.update(one, one, 0)  # the token that does not fit triggers the growth
    (event,) = cache.growth_events
    return event


def _amortised(final_tokens: int, factor: float) -> dict[str, Any]:
    cache = ContiguousCache(capacity=256, growth_factor=factor, num_layers=1)
    one = torch.zeros(1, 1, 1, 1)
    for _ in range(final_tokens):
        cache.update(one, one, 0)
    copied_tokens = sum(e.bytes_copied for e in cache.growth_events) // (2 * one.element_size())
    return {
        "growth_factor": factor,
        "final_tokens": final_tokens,
        "growths": len(cache.growth_events),
        "tokens_copied_by_growth": copied_tokens,
        "copied_per_token_held": copied_tokens / final_tokens,
        "final_capacity": cache.layers[0].capacity,
    }


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Time each growth of seed 003's table; count the amortised copies."""
    repeats = 3 if quick else 11
    sizes = (1024,) if quick else tuple(SEED_003_MS)
    results: list[dict[str, Any]] = []
    for old in tqdm(sizes, desc="bench growth", disable=not progress):
        _one_growth(old)  # warm-up
        events = [_one_growth(old) for _ in range(repeats)]
        ms = statistics.median(e.seconds for e in events) * 1e3
        results.append(
            {
                "kind": "growth",
                "old_capacity": old,
                "new_capacity": events[0].new_capacity,
                "bytes_copied": events[0].bytes_copied,
                "ms_one_layer": ms,
                "ms_32_layers": ms * 32,
                "seed_003_ms": SEED_003_MS[old],
                "gb_per_s": events[0].bytes_copied / (ms / 1e3) / 1e9,
            }
        )
    amortised = [_amortised(2048 if quick else 8192, f) for f in (1.25, 1.5, 2.0)]
    results.extend({"kind": "amortised", **a} for a in amortised)
    summary = {
        "growth_ms_one_layer": {str(r["old_capacity"]): round(r["ms_one_layer"], 3) for r in results[: len(sizes)]},
        "seed_003_ms": {str(k): SEED_003_MS[k] for k in sizes},
        "copied_per_token_held_at_1_5x": amortised[1]["copied_per_token_held"],
    }
    config = {
        "geometry": {"kv_heads": HEADS, "head_dim": HEAD_DIM, "dtype": "float16", "layers_timed": 1},
        "repeats": repeats,
        "growth_factor": 1.5,
    }
    return envelope("growth", config, results, summary)


def human(report: dict[str, Any]) -> str:
    growth = [r for r in report["results"] if r["kind"] == "growth"]
    amort = [r for r in report["results"] if r["kind"] == "amortised"]
    rows = [
        {
            "growth": f"{r['old_capacity']}->{r['new_capacity']}",
            "MiB copied": r["bytes_copied"] / 2**20,
            "seed 003 ms": r["seed_003_ms"],
            "ms (1 layer)": r["ms_one_layer"],
            "ms (x32 layers)": r["ms_32_layers"],
            "GB/s": r["gb_per_s"],
        }
        for r in growth
    ]
    cols = ["growth_factor", "final_tokens", "growths", "tokens_copied_by_growth", "copied_per_token_held"]
    return format_table(rows, list(rows[0])) + "\n\n" + format_table(amort, cols)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    growth = [r for r in report["results"] if r["kind"] == "growth"]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["old_capacity"] for r in growth]
    ax.plot(xs, [r["ms_one_layer"] for r in growth], "o-", label="measured, 1 layer (this machine)")
    ax.plot(xs, [r["seed_003_ms"] for r in growth], "s--", label="seed 003 claim (RTX 4090)")
    ax.set(xlabel="capacity before growth (tokens)", ylabel="ms", title="1.5x growth of a full cache")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
