"""``bench sharing``: sub-agents sharing a system prompt — blocks and prefill tokens with and without sharing
(exact), and the prefill time ratio measured on the shipped model.

Each of *n* sub-agents gets the shared prompt of *P* tokens plus a 64-token task of its own and then decodes
64 tokens. With sharing, a main agent prefills the prompt once and forks (refcounts, copy-on-write of the
partly filled tail); without, every sub-agent prefills and stores the prompt itself. Block size 16.

Prefill time is measured in interleaved rounds (the two contenders alternate; the per-round ratio's median and
min–max are reported) for the 512- and 2,048-token prompts only: one 8,256-token prefill through the
package's forward (dense fp32 attention) takes about 23 s on 2 CPU cores, so the 16-agent case alone would take
six minutes; the block and token counts, which are exact, cover 8,192.
"""

from __future__ import annotations

import random
import statistics
from typing import Any

import torch
from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table, ratio_stats, time_interleaved_ms
from memos_ref.hf import PagedCache
from memos_ref.paged import PagedKV

__all__ = ["human", "plot", "run"]

TASK, DECODE, BLOCK = 64, 64, 16


def _count(n: int, prompt: int) -> dict[str, int]:
    """Blocks held and prefill tokens, by running the paged bookkeeping (no model needed)."""
    from memos_ref.bench.allocator import NullPool  # metadata-only pool stand-in
    from memos_ref.paged.allocator import BlockAllocator
    from memos_ref.paged.sequence import SequenceCache

    total = n * 4 + (prompt + TASK + DECODE) // BLOCK * (n + 1) + 8
    pool = NullPool()

    def new(alloc):
        return SequenceCache(pool, alloc)  # type: ignore[arg-type]

    shared_alloc = BlockAllocator(total)
    main = new(shared_alloc)
    main.reserve(prompt)
    main.mark_written()
    subs = [main.fork() for _ in range(n)]
    for sub in subs:
        sub.reserve(TASK)
        for _ in range(DECODE):
            sub.reserve(1)
        sub.mark_written()
    shared_blocks = shared_alloc.num_active
    alone_alloc = BlockAllocator(total)
    for _ in range(n):
        seq = new(alone_alloc)
        seq.reserve(prompt + TASK)
        for _ in range(DECODE):
            seq.reserve(1)
        seq.mark_written()
    return {
        "blocks_shared": shared_blocks,
        "blocks_unshared": alone_alloc.num_active,
        "prefill_tokens_shared": prompt + n * TASK,
        "prefill_tokens_unshared": n * (prompt + TASK),
        "cow_copies": sum(sub.cow_copies for sub in subs),
    }


def _prefill_calls(model: Any, n: int, prompt_ids: torch.Tensor, tasks: list[torch.Tensor]) -> dict[str, Any]:
    """The two contenders: a main agent prefilling the prompt once and forking, or every agent alone."""
    spec = model.kv_spec(block_size=BLOCK)
    blocks = (prompt_ids.shape[1] + TASK) // BLOCK * (n + 2) + 4 * n + 8

    def shared() -> None:
        with torch.inference_mode():
            main = PagedCache(PagedKV(spec, blocks))
            model(prompt_ids, main)
            for task in tasks:
                model(task, main.fork())

    def alone() -> None:
        with torch.inference_mode():
            kv = PagedKV(spec, blocks)
            for task in tasks:
                model(torch.cat([prompt_ids, task], dim=1), PagedCache(kv))

    return {"shared": shared, "unshared": alone}


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    from memos_ref.model import load_model

    subagents = (1, 4) if quick else (1, 4, 8, 16)
    prompts = (128, 512) if quick else (512, 2048, 8192)
    timed_prompts = prompts if quick else (512, 2048)
    repeats = 2 if quick else 3
    model = load_model()
    rng = random.Random(0)
    results = []
    for n in tqdm(subagents, desc="bench sharing", disable=not progress):
        for p in prompts:
            row: dict[str, Any] = {"subagents": n, "prompt_tokens": p, **_count(n, p)}
            row["blocks_ratio"] = row["blocks_unshared"] / row["blocks_shared"]
            row["prefill_tokens_ratio"] = row["prefill_tokens_unshared"] / row["prefill_tokens_shared"]
            if p in timed_prompts:
                prompt_ids = torch.tensor([[rng.randrange(256) for _ in range(p)]])
                tasks = [torch.tensor([[rng.randrange(256) for _ in range(TASK)]]) for _ in range(n)]
                # rounds alternate the two contenders (the first round untimed), so load hits both alike
                times = time_interleaved_ms(_prefill_calls(model, n, prompt_ids, tasks), repeats, warmup=1)
                ratio = ratio_stats(times["unshared"], times["shared"])
                row.update(
                    prefill_seconds_shared=statistics.median(times["shared"]) / 1e3,
                    prefill_seconds_unshared=statistics.median(times["unshared"]) / 1e3,
                    prefill_time_ratio=ratio["median"],
                    prefill_time_ratio_min=ratio["min"],
                    prefill_time_ratio_max=ratio["max"],
                    rounds=repeats,
                )
            results.append(row)

    def pick(n: int, p: int, key: str) -> Any:
        return next(r[key] for r in results if (r["subagents"], r["prompt_tokens"]) == (n, p))

    big_n, big_p, timed_p = subagents[-1], prompts[-1], timed_prompts[-1]
    summary = {
        f"blocks_ratio_{big_n}x{big_p}": pick(big_n, big_p, "blocks_ratio"),
        f"prefill_tokens_ratio_{big_n}x{big_p}": pick(big_n, big_p, "prefill_tokens_ratio"),
        f"prefill_time_ratio_{big_n}x{timed_p}": pick(big_n, timed_p, "prefill_time_ratio"),
    }
    config = {
        "task_tokens": TASK,
        "decode_tokens": DECODE,
        "block_size": BLOCK,
        "model": "shipped",
        "forward": "package",
        "timed_prompts": list(timed_prompts),
        "timing": f"{repeats} interleaved rounds after one untimed round; median and min-max of per-round ratios",
    }
    return envelope("sharing", config, results, summary)


def human(report: dict[str, Any]) -> str:
    cols = [
        "subagents",
        "prompt_tokens",
        "blocks_shared",
        "blocks_unshared",
        "prefill_tokens_shared",
        "prefill_tokens_unshared",
        "prefill_time_ratio",
    ]
    lines = [format_table(report["results"], cols), ""]
    lines += [f"{k}: {v:.3f}" for k, v in report["summary"].items()]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for p in sorted({r["prompt_tokens"] for r in report["results"]}):
        rows = [r for r in report["results"] if r["prompt_tokens"] == p]
        ax.plot([r["subagents"] for r in rows], [r["blocks_ratio"] for r in rows], "o-", label=f"prompt {p}")
    ax.set(xlabel="sub-agents", ylabel="blocks without / with sharing", title="KV blocks saved by sharing")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
