"""``bench waste``: internal waste of paged blocks by block size, beside max-length reservation (exact).

Waste = 1 − tokens stored / token slots held. Two seeded traces: agent conversations (a 400-token system
prompt plus a log-normal dialogue, capped at 4,096: notebook 02's trace) and short tool calls (a median of 24
tokens), where seed 000 §5.3's rule "block utilization below 50% → shrink the block size" comes into play.
"""

from __future__ import annotations

from typing import Any

from memos_ref.bench.common import envelope, format_table
from memos_ref.workload import agent_conversation_lengths

__all__ = ["BLOCK_SIZES", "human", "plot", "run"]

BLOCK_SIZES = (8, 16, 32, 64, 128)


def _growth_capacity(length: int, start: int = 256, factor: float = 1.5) -> int:
    cap = start
    while cap < length:
        cap = -(-int(cap * factor * 2) // 2)
    return cap


def _rows(name: str, lengths: tuple[int, ...], max_len: int) -> list[dict[str, Any]]:
    used = sum(lengths)
    rows = [
        {"trace": name, "policy": f"reserve {max_len}", "slots": len(lengths) * max_len},
        {"trace": name, "policy": "grow 1.5x from 256", "slots": sum(_growth_capacity(n) for n in lengths)},
    ]
    rows += [
        {"trace": name, "policy": f"blocks of {t}", "block_size": t, "slots": sum(-(-n // t) * t for n in lengths)}
        for t in BLOCK_SIZES
    ]
    for row in rows:
        row["tokens"] = used
        row["waste_percent"] = 100 * (1 - used / row["slots"])
        row["utilization"] = used / row["slots"]
    return rows


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Deterministic: no timing, the same numbers on every machine."""
    n = 200 if quick else 1000
    agents = agent_conversation_lengths(n, seed=0, max_len=4096)
    tools = agent_conversation_lengths(n, seed=1, max_len=4096, system_prompt=0, median_dialogue=24, sigma=0.8)
    results = _rows("agent conversations", agents.lengths, 4096) + _rows("short tool calls", tools.lengths, 4096)

    def waste(trace: str, policy: str) -> float:
        return next(r["waste_percent"] for r in results if (r["trace"], r["policy"]) == (trace, policy))

    summary = {
        "reserve_max_waste_percent": waste("agent conversations", "reserve 4096"),
        **{f"block_{t}_waste_percent": waste("agent conversations", f"blocks of {t}") for t in BLOCK_SIZES},
        **{
            f"short_calls_block_{t}_utilization": 1 - waste("short tool calls", f"blocks of {t}") / 100
            for t in BLOCK_SIZES
        },
    }
    config = {"sessions": n, "seeds": {"agent conversations": 0, "short tool calls": 1}, "max_len": 4096}
    return envelope("waste", config, results, summary)


def human(report: dict[str, Any]) -> str:
    return format_table(report["results"], ["trace", "policy", "tokens", "slots", "waste_percent", "utilization"])


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for ax, trace in zip(axes, ("agent conversations", "short tool calls")):
        rows = [r for r in report["results"] if r["trace"] == trace]
        ax.bar([r["policy"] for r in rows], [r["waste_percent"] for r in rows])
        ax.set(yscale="log", ylabel="% waste (log)", title=trace)
        ax.tick_params(axis="x", labelsize=7, rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
