"""``bench allocator``: block bookkeeping on an agent trace, against pool size, side by side with other managers.

Metadata only — the allocator, prefix index and block tables, no KV tensors — so pools of 65,536 and
1,048,576 blocks cost nothing to hold. The trace (seeded): 64 agents × 4 rounds; every agent's prompt is a
2,048-token system prompt shared by all, its own history from earlier rounds, and 256 new tokens; it then
decodes 256 tokens one at a time; block size 16. In a round all agents are live together (their decode steps
interleave); at the end of a round they release their blocks, which stay prefix-cached for the next round.

Contenders, run interleaved (repeat 1 of every contender and pool, then repeat 2, ...) so a loaded machine
slows them alike, each timed in CPU seconds of the process; each row reports the median and the min–max over
repeats (and every repeat), the summary the ratios ours / contender with their min–max over paired repeats:

* ``ours`` — :class:`~memos_ref.paged.allocator.BlockAllocator` + :class:`~memos_ref.paged.prefix.PrefixCache`
  + :class:`~memos_ref.paged.sequence.SequenceCache`: ``admit`` per request (the prompt validated and hashed
  once, the cached prefix reused, the rest reserved and marked written) and ``append_token`` per decoded token
  (no allocator call until a block fills or a new one starts — vLLM's driver likewise calls its pool only then);
* ``deque`` — a plain block manager in the style of nano-vllm with the same chained hashes, whose revival of a
  freed-but-cached block is a ``deque.remove`` scan (its cost grows with the pool);
* ``vllm`` — vLLM v1's ``BlockPool`` + ``FreeKVCacheBlockQueue`` (pure Python) at the pinned release
  (:data:`memos_ref.bench.peers.VLLM_VERSION`), driven as its ``KVCacheManager`` drives it, with vLLM's own
  default hashing; ``vllm_shared_hash`` is the same pool fed the package's BLAKE2b chain, so the two rows show
  what hashing costs apart from bookkeeping (:mod:`memos_ref.bench.allocator_peers`);
* ``nanovllm`` — nano-vllm's ``BlockManager`` at the pinned commit, driven as its scheduler drives it, with its
  own ``xxh64``.

``make peers`` fetches both into a cache folder (:mod:`memos_ref.bench.peers`); a peer that is absent is
skipped with the reason in the JSON, and the JSON's ``peers`` records each one's version or commit and source.
Each repeat runs every (pool, contender) pair once in a shuffled order; each ratio ``ours / peer`` is taken per
repeat (the two runs of the same repeat) and reported as the median [min–max] of those pairs, with a verdict
("faster", "slower", or "inconclusive" when the pairs straddle 1). ``--quick`` runs a small
trace on pools of 4,096 and 65,536 blocks.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tqdm.auto import tqdm

from memos_ref.bench import peers
from memos_ref.bench.allocator_peers import nanovllm_contender, vllm_contender
from memos_ref.bench.common import envelope, format_table
from memos_ref.paged.allocator import BlockAllocator
from memos_ref.paged.prefix import PrefixCache, block_hashes
from memos_ref.paged.sequence import SequenceCache
from memos_ref.spec import KVSpec

__all__ = ["DequeBlockManager", "NullPool", "human", "plot", "run"]

BLOCK = 16
Runner = Callable[[int, Any, int], dict[str, Any]]
#: Every contender is timed in CPU seconds of this process: on a loaded machine wall time also counts the time
#: slices other processes took (the work is single-threaded, so CPU time is the work's own time)
_clock = time.process_time
_EXTRA = b"\x00"  # the extra key of an empty fingerprint and no salt (what PrefixCache(alloc, 16) mixes in)


class NullPool:
    """Stands in for a BlockPool when only metadata is simulated (copy-on-write copies nothing)."""

    def __init__(self, layers: int = 1) -> None:
        self.spec = KVSpec(num_layers=layers, num_kv_heads=1, head_dim=1, block_size=BLOCK)

    def copy_block(self, src: int, dst: int) -> None:
        pass


class DequeBlockManager:
    """The baseline: free ids in a ``deque``; a hash hit on a freed block removes it from the deque (O(pool))."""

    def __init__(self, num_blocks: int, free: deque[int] | None = None) -> None:
        self.free = deque(range(num_blocks)) if free is None else free
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


# ---------------------------------------------------------------------------------------------- ours
def _run_ours(num_blocks: int, trace, rounds: int, latencies: list[float] | None = None) -> dict[str, Any]:
    """The trace through the package's bookkeeping. With ``latencies``, each reserve is timed (slower)."""
    system_ids, new_tokens, decoded = trace
    alloc = BlockAllocator(num_blocks)
    prefix = PrefixCache(alloc, BLOCK)
    pool = NullPool()
    history = [list(system_ids) for _ in new_tokens]
    clock = _clock
    started = clock()
    for r in range(rounds):
        live, seqs = [], []
        for a, own in enumerate(new_tokens):
            prompt = history[a] + own[r]
            seq = SequenceCache(pool, alloc, prefix)  # type: ignore[arg-type]
            if latencies is None:
                seq.admit(prompt)  # validate and hash once, reuse the cached prefix, reserve + mark written the rest
            else:
                t0 = clock()
                seq.admit(prompt)
                latencies.append(clock() - t0)
            live.append((seq.append_token, decoded[a][r]))
            seqs.append(seq)
        for step in range(len(decoded[0][r])):
            if latencies is None:
                for append, tokens in live:
                    append(tokens[step])  # allocates only when the token starts a new block
            else:
                for append, tokens in live:
                    t0 = clock()
                    append(tokens[step])
                    latencies.append(clock() - t0)
        for a, seq in enumerate(seqs):
            history[a] = seq.token_ids  # free() keeps the ids; the next round's prompt is a new list
            seq.free()
    elapsed = clock() - started
    return {"seconds": elapsed, "stats": {**alloc.stats(), **prefix.stats()}}


class _CountingDeque(deque):
    """A free list that counts what each ``remove`` scans (its position + 1): the deque baseline's O(pool) work."""

    def __init__(self, items: Any) -> None:
        super().__init__(items)
        self.removes = self.scanned = 0

    def remove(self, value: Any) -> None:
        i = self.index(value)
        self.removes += 1
        self.scanned += i + 1
        del self[i]


def _deque_scan_work(num_blocks: int, trace, rounds: int) -> dict[str, int]:
    """Untimed: how many ``deque.remove`` calls the deque baseline makes on the trace and how many free-list
    entries they scan in all (the work behind its time; nano-vllm's ``BlockManager`` revives cached blocks with
    the same ``deque.remove`` over the same kind of free list)."""
    free = _CountingDeque(range(num_blocks))
    _run_deque(num_blocks, trace, rounds, free=free)
    return {"removes": free.removes, "scanned": free.scanned}


def _scan_ns_per_entry(num_blocks: int, repeats: int = 20) -> float:
    """CPU nanoseconds ``deque.remove`` spends per entry scanned on this machine now (a free list of
    ``num_blocks`` ids, the value near its end, as the baseline's revivals are)."""
    free = deque(range(num_blocks))
    started = _clock()
    for i in range(repeats):
        value = free[-1 - i]
        free.remove(value)
        free.append(value)
    return (_clock() - started) / (repeats * num_blocks) * 1e9


def _run_deque(num_blocks: int, trace, rounds: int, free: deque[int] | None = None) -> dict[str, Any]:
    system_ids, new_tokens, decoded = trace
    mgr = DequeBlockManager(num_blocks, free)
    history = [list(system_ids) for _ in new_tokens]
    started = _clock()
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
    return {"seconds": _clock() - started}


def _contenders() -> tuple[dict[str, Runner], dict[str, str], dict[str, Any]]:
    """The contenders to run, notes on each (how it was loaded, or why it was skipped), and the peers'
    versions (what :func:`memos_ref.bench.peers.locate` found)."""
    runners: dict[str, Runner] = {"ours": _run_ours, "deque": _run_deque}
    notes: dict[str, str] = {
        "ours": "memos_ref BlockAllocator + PrefixCache + SequenceCache (admit per request, append_token per token); "
        "chained BLAKE2b-128 block hashes, token ids verified on every hit, prompts validated once",
        "deque": "in-package baseline (DequeBlockManager), not nano-vllm's code: free ids in a collections.deque, "
        "the same chained BLAKE2b hashes as ours, no token verification; reviving a cached block is deque.remove, "
        "a scan of the free list, so its time grows with the pool (see deque_entries_scanned_* and "
        "deque_scan_ns_per_entry in the summary)",
    }
    peer_info: dict[str, Any] = {}
    for name in ("vllm", "nanovllm"):
        src = peers.locate(name)
        if src is None:
            notes[name] = f"skipped: run `make peers` (or set {peers.ENV[name]} to a {name} source folder)"
            peer_info[name] = None
            continue
        peer_info[name] = src.info
        try:
            if name == "vllm":
                runners["vllm"] = vllm_contender(src.path, hashing="own")
                runners["vllm_shared_hash"] = vllm_contender(src.path, hashing="shared")
                where = f"vLLM {src.info.get('version')} from {src.info.get('source')}"
                notes["vllm"] = (
                    f"{where}: vllm.v1.core.block_pool + kv_cache_utils with stubbed imports, vLLM's default "
                    "hashing (prefix_caching_hash_algo='sha256': SHA-256 of the pickle of (parent, tokens, None))"
                )
                notes["vllm_shared_hash"] = f"{where}: the same BlockPool fed the package's chained BLAKE2b-128"
            else:
                runners[name], hashing = nanovllm_contender(src.path)
                notes[name] = (
                    f"nano-vllm {src.info.get('commit', '(commit unknown)')} from {src.info.get('source')}; "
                    f"hashing: {hashing}; revives a cached block with deque.remove over its free-id deque "
                    "(the same O(pool) scan as the deque baseline)"
                )
        except Exception as exc:  # an incompatible checkout must not break the benchmark
            notes[name] = f"skipped: could not load from {src.path}: {type(exc).__name__}: {exc}"
    return runners, notes, peer_info


# ---------------------------------------------------------------------------------------------- driver
def _work_tokens(trace, rounds: int) -> int:
    system_ids, new_tokens, decoded = trace
    total = 0
    for r in range(rounds):
        for a in range(len(new_tokens)):
            prompt_len = len(system_ids) + r * (len(new_tokens[a][0]) + len(decoded[a][0])) + len(new_tokens[a][r])
            total += prompt_len + len(decoded[a][r])
    return total


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def run(quick: bool = False, progress: bool = True, repeats: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Time every contender on the trace at both pool sizes, interleaved over ``repeats``: each repeat runs
    every (pool, contender) pair once, in an order shuffled per repeat (seeded), so a loaded machine slows
    them alike and no contender always runs first or last."""
    agents, rounds, system, own, decode = (8, 2, 256, 64, 32) if quick else (64, 4, 2048, 256, 256)
    pools = (4096, 65_536) if quick else (65_536, 1_048_576)
    repeats = repeats if repeats is not None else (2 if quick else 5)
    trace = _trace(agents, rounds, system, own, decode)
    runners, notes, peer_info = _contenders()
    # deque.remove scans the pool: the O(pool) contenders run at most 3 times at the small pool and not at all at
    # the large one in full runs (about 8 CPU minutes each there; their scan count explains their time instead)
    slow = {"deque", "nanovllm"}
    rng = random.Random(seed)
    seconds: dict[tuple[str, int], list[float]] = {(name, pool): [] for name in runners for pool in pools}
    by_repeat: dict[tuple[str, int], dict[int, float]] = {key: {} for key in seconds}
    ours_stats: dict[int, dict[str, Any]] = {}
    orders: list[list[str]] = []
    steps = []
    for rep in range(repeats):
        order = [(pool, name) for pool in pools for name in runners]
        rng.shuffle(order)
        orders.append([f"{name}@{pool}" for pool, name in order])
        steps += [(rep, pool, name) for pool, name in order]
    for rep, pool, name in tqdm(steps, desc="bench allocator", disable=not progress):
        if name in slow and not quick and (pool == pools[-1] or rep >= 3):
            continue
        gc.collect()  # the garbage of the previous run (vLLM's pool is a cycle of Python objects) is not billed here
        out = runners[name](pool, trace, rounds)
        seconds[(name, pool)].append(out["seconds"])
        by_repeat[(name, pool)][rep] = out["seconds"]
        if name == "ours":
            ours_stats[pool] = out["stats"]
    latencies: list[float] = []
    _run_ours(pools[-1], trace, rounds, latencies)  # a separate probed run: per-call timers slow the total
    # what the O(pool) contenders' time is made of: the deque baseline's scans counted (untimed, small pool)
    # and the CPU cost of one scanned entry measured now, on this machine
    scans = _deque_scan_work(pools[0], trace, rounds)
    scan_ns = statistics.median(_scan_ns_per_entry(pools[0]) for _ in range(3))
    latencies.sort()
    tokens = _work_tokens(trace, rounds)
    results = []
    for pool in pools:
        for name in runners:
            if not seconds[(name, pool)]:
                continue  # not run at this pool (an O(pool) contender at the large pool)
            spread = _spread(seconds[(name, pool)])
            row = {
                "pool_blocks": pool,
                "seconds_all": seconds[(name, pool)],
                "contender": name,
                "repeats": len(seconds[(name, pool)]),
                "seconds": spread["median"],
                "seconds_min": spread["min"],
                "seconds_max": spread["max"],
                "tokens_per_s": tokens / spread["median"],
                "tokens_processed": tokens,
            }
            if name == "ours":
                stats = ours_stats[pool]
                row["prefix_hit_tokens"] = stats["prefix_hit_tokens"]
                row["prefix_query_tokens"] = stats["prefix_query_tokens"]
            results.append(row)
    summary = _summary(by_repeat, runners, pools, quick, tokens, ours_stats, latencies)
    s_key = "small" if quick else "64k"
    summary[f"deque_remove_calls_pool_{s_key}"] = scans["removes"]
    summary[f"deque_entries_scanned_pool_{s_key}"] = scans["scanned"]
    summary["deque_scan_ns_per_entry"] = scan_ns
    # the scans alone, at the measured cost per entry: compare with the deque row's seconds at the small pool
    summary[f"deque_scan_seconds_predicted_pool_{s_key}"] = scans["scanned"] * scan_ns * 1e-9
    config = {
        "agents": agents,
        "rounds": rounds,
        "system_prompt_tokens": system,
        "own_tokens_per_round": own,
        "decode_tokens_per_round": decode,
        "block_size": BLOCK,
        "pools": list(pools),
        "repeats": repeats,
        "interleaved": True,
        "order": "shuffled per repeat (random.Random(seed)); both pools in every repeat",
        "orders": orders,
        "seed": seed,
        "ratios": "per repeat: ours / contender at the same pool in the same repeat; median [min-max] of those",
        "o_pool_contenders": "deque and nanovllm: at most 3 repeats at the small pool, not run at the large pool"
        if not quick
        else "every repeat at both pools",
        "contenders": sorted(runners),
        "contender_notes": notes,
        "metadata_only": True,
    }
    report = envelope("allocator", config, results, summary)
    report["peers"] |= {**peer_info, **peers.versions("transformers")}
    return report


def _paired(by_repeat, a: tuple[str, int], b: tuple[str, int]) -> list[float]:
    """The ratios a / b of the repeats where both ran (same repeat, so the same machine state)."""
    return [by_repeat[a][rep] / by_repeat[b][rep] for rep in sorted(by_repeat[a]) if rep in by_repeat[b]]


def _summary(by_repeat, runners, pools, quick, tokens, ours_stats, latencies) -> dict[str, Any]:
    small, large = pools
    s_key, l_key = ("small", "large") if quick else ("64k", "1m")
    med = {k: statistics.median(v.values()) for k, v in by_repeat.items() if v}
    slowdown = _paired(by_repeat, ("ours", large), ("ours", small))
    summary: dict[str, Any] = {
        f"tokens_per_s_pool_{s_key}": tokens / med[("ours", small)],
        f"tokens_per_s_pool_{l_key}": tokens / med[("ours", large)],
        "pool_size_slowdown": statistics.median(slowdown),
        "pool_size_slowdown_min_max": [min(slowdown), max(slowdown)],
        "alloc_p50_us": latencies[len(latencies) // 2] * 1e6,
        "alloc_p99_us": latencies[int(0.99 * (len(latencies) - 1))] * 1e6,
        "prefix_hit_rate": ours_stats[large]["prefix_hit_tokens"] / ours_stats[large]["prefix_query_tokens"],
    }
    for name in runners:
        if name == "ours":
            continue
        for pool, key in ((small, s_key), (large, l_key)):
            ratios = _paired(by_repeat, ("ours", pool), (name, pool))
            if not ratios:
                continue
            # < 1: ours is faster. The median and min-max of the per-repeat paired ratios (not a ratio of medians)
            summary[f"ours_over_{name}_pool_{key}"] = statistics.median(ratios)
            summary[f"ours_over_{name}_pool_{key}_min_max"] = [min(ratios), max(ratios)]
            summary[f"ours_over_{name}_pool_{key}_pairs"] = len(ratios)
            verdict = "faster" if max(ratios) < 1 else "slower" if min(ratios) > 1 else "inconclusive"
            summary[f"ours_vs_{name}_pool_{key}_verdict"] = verdict
        own = _paired(by_repeat, (name, large), (name, small))
        if own:
            summary[f"{name}_pool_size_slowdown"] = statistics.median(own)
    return summary


def human(report: dict[str, Any]) -> str:
    cols = ["pool_blocks", "contender", "tokens_per_s", "seconds", "seconds_min", "seconds_max", "repeats"]
    lines = [format_table(report["results"], cols), ""]
    lines += [f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in report["summary"].items()]
    lines += [f"{k}: {v}" for k, v in report["config"]["contender_notes"].items()]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = {
        "ours": "memos-ref BlockAllocator",
        "deque": "deque baseline",
        "vllm": "vLLM v1 BlockPool",
        "nanovllm": "nano-vllm BlockManager",
    }
    for name in report["config"]["contenders"]:
        mine = [r for r in rows if r["contender"] == name]
        ax.plot([r["pool_blocks"] for r in mine], [r["tokens_per_s"] for r in mine], "o-", label=labels.get(name, name))
    ax.set(xscale="log", yscale="log", xlabel="pool size (blocks)", ylabel="tokens / s (bookkeeping only)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
