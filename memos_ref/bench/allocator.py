"""``bench allocator``: block bookkeeping on an agent trace, against pool size, beside a deque baseline.

Metadata only — the allocator, prefix cache and block tables, no KV tensors — so pools of 65,536 and
1,048,576 blocks cost nothing to hold. The trace (seeded): 64 agents × 4 rounds; every agent's prompt is a
2,048-token system prompt shared by all, its own history from earlier rounds, and 256 new tokens; it then
decodes 256 tokens one at a time; block size 16. In a round all agents are live together (their decode steps
interleave); at the end of a round they release their blocks, which stay prefix-cached for the next round.

The baseline is a plain block manager in the style of nano-vllm: a ``deque`` free list and the same chained
hashes, where reviving a freed-but-cached block must ``deque.remove`` it — a scan whose cost grows with the
pool. The measured ``pool_size_slowdown`` (1M over 64k) shows that ours does not.
"""

from __future__ import annotations

import random
import statistics
import time
from collections import deque
from typing import Any

from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table
from memos_ref.paged.allocator import BlockAllocator
from memos_ref.paged.prefix import PrefixCache, block_hashes
from memos_ref.paged.sequence import SequenceCache
from memos_ref.spec import KVSpec

__all__ = ["DequeBlockManager", "human", "plot", "run"]

BLOCK = 16


class _NullPool:
    """Stands in for a BlockPool when only metadata is simulated (copy-on-write copies nothing)."""

    def __init__(self, layers: int = 1) -> None:
        self.spec = KVSpec(num_layers=layers, num_kv_heads=1, head_dim=1, block_size=BLOCK)

    def copy_block(self, src: int, dst: int) -> None:
        pass


class DequeBlockManager:
    """The baseline: free ids in a ``deque``; a hash hit on a freed block removes it from the deque (O(pool))."""

    def __init__(self, num_blocks: int) -> None:
        self.free = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.block_of: dict[bytes, int] = {}
        self.hash_of: dict[int, bytes] = {}

    def _take(self) -> int:
        block = self.free.popleft()
        old = self.hash_of.pop(block, None)
        if old is not None and self.block_of.get(old) == block:
            del self.block_of[old]
        self.refcount[block] = 1
        return block

    def start(self, token_ids: list[int]) -> tuple[list[int], int]:
        """Blocks reused for the longest cached prefix (never the whole prompt)."""
        limit = (len(token_ids) - 1) // BLOCK
        table = []
        for h in block_hashes(token_ids[: limit * BLOCK], BLOCK):
            block = self.block_of.get(h)
            if block is None:
                break
            if self.refcount[block] == 0:
                self.free.remove(block)  # the O(pool) scan
            self.refcount[block] += 1
            table.append(block)
        return table, len(table) * BLOCK

    def reserve(self, table: list[int], num_tokens: int, n: int) -> None:
        need = -(-(num_tokens + n) // BLOCK) - len(table)
        table.extend(self._take() for _ in range(need))

    def register(self, table: list[int], token_ids: list[int], chain: list[bytes]) -> None:
        """Hash and record the newly full blocks, extending ``chain`` (each block hashed once)."""
        full = len(token_ids) // BLOCK
        parent = chain[-1] if chain else b""
        chain.extend(block_hashes(token_ids[len(chain) * BLOCK : full * BLOCK], BLOCK, parent=parent))
        for block, h in zip(table[: len(chain)], chain):
            if h not in self.block_of and block not in self.hash_of:
                self.block_of[h], self.hash_of[block] = block, h

    def release(self, table: list[int]) -> None:
        for block in reversed(table):
            self.refcount[block] -= 1
            if self.refcount[block] == 0:
                self.free.append(block)


def _trace(agents: int, rounds: int, system: int, own: int, decode: int, seed: int = 0):
    rng = random.Random(seed)
    system_ids = [rng.randrange(256) for _ in range(system)]
    new_tokens = [[[rng.randrange(256) for _ in range(own)] for _ in range(rounds)] for _ in range(agents)]
    decoded = [[[rng.randrange(256) for _ in range(decode)] for _ in range(rounds)] for _ in range(agents)]
    return system_ids, new_tokens, decoded


def _run_ours(num_blocks: int, trace, rounds: int) -> dict[str, Any]:
    system_ids, new_tokens, decoded = trace
    alloc = BlockAllocator(num_blocks)
    prefix = PrefixCache(alloc, BLOCK)
    pool = _NullPool()
    history = [list(system_ids) for _ in new_tokens]
    latencies: list[float] = []
    started = time.perf_counter()
    for r in range(rounds):
        live = []
        for a, own in enumerate(new_tokens):
            prompt = history[a] + own[r]
            seq = SequenceCache(pool, alloc, prefix)  # type: ignore[arg-type]
            seq.adopt_prefix(prefix.lookup(prompt), prompt)
            t0 = time.perf_counter()
            seq.reserve(len(prompt) - seq.num_tokens, prompt[seq.num_tokens :])
            latencies.append(time.perf_counter() - t0)
            seq.mark_written()
            live.append((a, seq, prompt))
        for step in range(len(decoded[0][r])):
            for a, seq, _ in live:
                t0 = time.perf_counter()
                seq.reserve(1, [decoded[a][r][step]])
                latencies.append(time.perf_counter() - t0)
                seq.mark_written()
        for a, seq, prompt in live:
            history[a] = prompt + decoded[a][r]
            seq.free()
    elapsed = time.perf_counter() - started
    return {"seconds": elapsed, "latencies": latencies, "stats": {**alloc.stats(), **prefix.stats()}}


def _run_deque(num_blocks: int, trace, rounds: int) -> dict[str, Any]:
    system_ids, new_tokens, decoded = trace
    mgr = DequeBlockManager(num_blocks)
    history = [list(system_ids) for _ in new_tokens]
    started = time.perf_counter()
    for r in range(rounds):
        live = []
        for a, own in enumerate(new_tokens):
            prompt = history[a] + own[r]
            table, cached = mgr.start(prompt)
            mgr.reserve(table, cached, len(prompt) - cached)
            chain: list[bytes] = []
            mgr.register(table, prompt, chain)
            live.append([a, table, list(prompt), chain])
        for step in range(len(decoded[0][r])):
            for a, table, ids, chain in live:
                mgr.reserve(table, len(ids), 1)
                ids.append(decoded[a][r][step])
                if len(ids) % BLOCK == 0:
                    mgr.register(table, ids, chain)
        for a, table, ids, _ in live:
            history[a] = ids
            mgr.release(table)
    return {"seconds": time.perf_counter() - started}


def _work_tokens(trace, rounds: int, reused_tokens: int) -> int:
    system_ids, new_tokens, decoded = trace
    total = 0
    for r in range(rounds):
        for a in range(len(new_tokens)):
            prompt_len = len(system_ids) + r * (len(new_tokens[a][0]) + len(decoded[a][0])) + len(new_tokens[a][r])
            total += prompt_len + len(decoded[a][r])
    return total - reused_tokens


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Time ours and the deque baseline on the trace, on both pool sizes."""
    agents, rounds, system, own, decode = (8, 2, 256, 64, 32) if quick else (64, 4, 2048, 256, 256)
    pools = (4096, 65_536) if quick else (65_536, 1_048_576)
    trace = _trace(agents, rounds, system, own, decode)
    results: list[dict[str, Any]] = []
    for pool in tqdm(pools, desc="bench allocator", disable=not progress):
        ours = _run_ours(pool, trace, rounds)
        base = _run_deque(pool, trace, rounds)
        lat = sorted(ours["latencies"])
        stats = ours["stats"]
        tokens = _work_tokens(trace, rounds, 0)
        results.append(
            {
                "pool_blocks": pool,
                "tokens_processed": tokens,
                "prefix_hit_tokens": stats["prefix_hit_tokens"],
                "prefix_query_tokens": stats["prefix_query_tokens"],
                "ours_seconds": ours["seconds"],
                "deque_seconds": base["seconds"],
                "ours_tokens_per_s": tokens / ours["seconds"],
                "deque_tokens_per_s": tokens / base["seconds"],
                "alloc_p50_us": statistics.median(lat) * 1e6,
                "alloc_p99_us": lat[int(0.99 * (len(lat) - 1))] * 1e6,
                "reserve_calls": len(lat),
            }
        )
    small, large = results
    key = "1m" if not quick else "large"
    summary = {
        "tokens_per_s_pool_64k" if not quick else "tokens_per_s_pool_small": small["ours_tokens_per_s"],
        f"tokens_per_s_pool_{key}": large["ours_tokens_per_s"],
        "pool_size_slowdown": large["ours_seconds"] / small["ours_seconds"],
        "deque_pool_size_slowdown": large["deque_seconds"] / small["deque_seconds"],
        "alloc_p50_us": large["alloc_p50_us"],
        "alloc_p99_us": large["alloc_p99_us"],
        f"speedup_vs_deque_baseline_pool_{key}": large["deque_seconds"] / large["ours_seconds"],
        "prefix_hit_rate": large["prefix_hit_tokens"] / large["prefix_query_tokens"],
    }
    config = {
        "agents": agents,
        "rounds": rounds,
        "system_prompt_tokens": system,
        "own_tokens_per_round": own,
        "decode_tokens_per_round": decode,
        "block_size": BLOCK,
        "pools": list(pools),
        "metadata_only": True,
    }
    return envelope("allocator", config, results, summary)


def human(report: dict[str, Any]) -> str:
    cols = ["pool_blocks", "ours_tokens_per_s", "deque_tokens_per_s", "alloc_p50_us", "alloc_p99_us"]
    lines = [format_table(report["results"], cols), ""]
    lines += [f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in report["summary"].items()]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    xs = [r["pool_blocks"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(xs, [r["ours_tokens_per_s"] for r in rows], "o-", label="intrusive free list (memos-ref)")
    ax.plot(xs, [r["deque_tokens_per_s"] for r in rows], "s--", label="deque baseline")
    ax.set(xscale="log", yscale="log", xlabel="pool size (blocks)", ylabel="tokens / s (bookkeeping only)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
