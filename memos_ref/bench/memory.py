"""``bench memory``: the short-term memory store (seed 002) — throughput and hit rates.

Throughput: a seeded read-heavy workload (90% get / 10% set, keys drawn by a Zipf law from a preloaded key
space, JSON values of about 100 bytes) run on the memory backend with 1 and 8 shards, from 1 and 4 threads;
on the Redis backend (a private redis-server on loopback, one round trip per call, and batched ``MGET``);
and on ``cachetools.TTLCache`` behind one lock, the well-known Python TTL cache, both as it is (it hands out
the stored object) and with the same JSON copy ours makes (equal safety: the very function ours encodes with,
:func:`~memos_ref.memory.store.json_text`, and ``json.loads``). Each configuration runs 3 times; the median
counts.

Ours against cachetools + the JSON copy, ``set`` and ``get`` each: the two run the same op list alternately,
round after round (:func:`~memos_ref.bench.common.time_interleaved_ms`, the order rotated each round), and the
figure is the median [min–max] of the per-round time ratios ours / cachetools (``ratio_stats``), not a ratio of
medians. The peers' versions (cachetools, redis-py, redis-server) are in the result's ``peers``.

Under CPython's GIL, sharding cannot make threads run in parallel — the figure shows what it does buy.

Hit rates: the seeded agent access pattern of :mod:`memos_ref.memory.access_pattern` replayed cache-aside
through each eviction policy at a capacity of 128 entries (exact, deterministic figures), with the unbounded
cache as the ceiling.
"""

from __future__ import annotations

import json
import random
import statistics
import threading
from collections.abc import Callable, Iterable
from typing import Any

from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table, ratio_stats, time_calls_ms, time_interleaved_ms
from memos_ref.errors import ConfigError
from memos_ref.memory import MemoryBackend, RedisBackend, RedisServer, TTLStore, redis_server_path
from memos_ref.memory.access_pattern import agent_memory_trace, replay_hit_rate
from memos_ref.memory.backend import key_list
from memos_ref.memory.store import json_text

__all__ = ["POLICY_CONFIGS", "human", "ops_per_s", "plot", "policy_hit_rates", "run"]

#: name -> TTLStore keyword arguments compared on the agent pattern.
POLICY_CONFIGS: dict[str, dict[str, Any]] = {
    "lru": {"policy": "lru"},
    "lfu": {"policy": "lfu"},
    "hybrid": {"policy": "hybrid"},  # seed 002's (1 + 0.1·count) / (1 + age/1000 s), 16 sampled candidates
    "hybrid_b10": {"policy": "hybrid", "hybrid_weights": (0.1, 10.0)},
    "lfu_exact": {"policy": "lfu", "sample": None},
    "hybrid_exact": {"policy": "hybrid", "sample": None},
}


class _Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def policy_hit_rates(
    capacity: int = 128, num_ops: int = 20_000, seed: int = 0, policies: Iterable[str] | None = None
) -> dict[str, dict[str, float]]:
    """Hit rates (overall and per kind of access) of every policy, cachetools' TTLCache and an unbounded cache;
    with ``policies`` (names of :data:`POLICY_CONFIGS`), of those policies only."""
    import cachetools

    names = list(POLICY_CONFIGS) if policies is None else key_list(policies)
    unknown = [name for name in names if name not in POLICY_CONFIGS]
    if unknown:
        raise ConfigError(f"unknown policies {unknown}: expected names from {list(POLICY_CONFIGS)}")
    trace = agent_memory_trace(num_ops, seed=seed)
    out: dict[str, dict[str, float]] = {}
    for name in names:
        clock = _Clock()
        store = TTLStore(max_entries=capacity, default_ttl=300.0, clock=clock, **POLICY_CONFIGS[name])
        out[name] = replay_hit_rate(store.get, store.set, trace, clock)
    if policies is not None:
        return out
    clock = _Clock()
    ttl_cache = cachetools.TTLCache(maxsize=capacity, ttl=300.0, timer=clock)
    out["cachetools_ttl"] = replay_hit_rate(ttl_cache.get, ttl_cache.__setitem__, trace, clock)
    clock = _Clock()
    unbounded = TTLStore(max_entries=10**9, max_bytes=2**40, default_ttl=300.0, clock=clock)
    out["unbounded"] = replay_hit_rate(unbounded.get, unbounded.set, trace, clock)
    return out


def _workload(num_keys: int, num_ops: int, seed: int = 0) -> tuple[list[str], list[tuple[str, str, Any]]]:
    rng = random.Random(seed)
    keys = [f"tool:{i}" for i in range(num_keys)]
    weights = [1 / (i + 1) ** 1.1 for i in range(num_keys)]
    chosen = rng.choices(keys, weights, k=num_ops)
    ops = []
    for key in chosen:
        if rng.random() < 0.9:
            ops.append(("get", key, None))
        else:
            ops.append(("set", key, {"tool": "search", "args": {"q": key}, "result": [rng.random() for _ in range(4)]}))
    return keys, ops


def _value(key: str) -> dict[str, Any]:
    return {"tool": "search", "args": {"q": key}, "result": [0.25, 0.5, 0.75, 1.0]}


def ops_per_s(get: Callable, set_: Callable, ops: list, threads: int, repeats: int = 3) -> float:
    """Median over ``repeats`` of total operations / wall time, the op list split evenly across ``threads``."""
    parts = [ops[i::threads] for i in range(threads)]

    def work(part: list) -> None:
        for op, key, value in part:
            if op == "get":
                get(key)
            else:
                set_(key, value)

    def run_all() -> None:
        workers = [threading.Thread(target=work, args=(p,)) for p in parts]
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    _, samples_ms = time_calls_ms(run_all, repeats, warmup=0)  # the benchmarks' one timer
    return statistics.median(len(ops) / (ms / 1e3) for ms in samples_ms)


class _LockedTTLCache:
    """cachetools.TTLCache behind one lock (it is not thread-safe), optionally copying values through JSON."""

    def __init__(self, maxsize: int, copy: bool) -> None:
        import cachetools

        self.cache = cachetools.TTLCache(maxsize=maxsize, ttl=300.0)
        self.lock = threading.Lock()
        self.copy = copy

    def get(self, key: str, default: Any = None) -> Any:
        with self.lock:
            value = self.cache.get(key, default)
        return json.loads(value) if self.copy and isinstance(value, str) else value

    def set(self, key: str, value: Any) -> None:
        stored = json_text(value) if self.copy else value  # the encoder the memory store uses
        with self.lock:
            self.cache[key] = stored


def paired_ratios(
    ours: Callable[[str, Any], Any], peer: Callable[[str, Any], Any], ops: list[tuple[str, Any]], rounds: int
) -> dict[str, float | None]:
    """Median [min–max] over ``rounds`` of the time ratio ours / peer, each round running ``fn(key, arg)`` for
    every op on both sides, in an order rotated each round (one untimed warm-up round)."""

    def loop(fn: Callable[[str, Any], Any]) -> Callable[[], None]:
        def run_ops() -> None:
            for key, arg in ops:
                fn(key, arg)

        return run_ops

    samples = time_interleaved_ms({"ours": loop(ours), "peer": loop(peer)}, rounds, warmup=1)
    return {**ratio_stats(samples["ours"], samples["peer"]), "rounds": rounds}


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    num_keys = 1_000 if quick else 10_000
    num_ops = 4_000 if quick else 60_000
    redis_ops = 2_000 if quick else 20_000
    keys, ops = _workload(num_keys, num_ops)
    get_only = [("get", k, None) for _, k, _ in ops]
    set_only = [("set", k, _value(k)) for _, k, _ in ops]
    results: list[dict[str, Any]] = []

    def preload(backend_set: Callable) -> None:
        for key in keys:
            backend_set(key, _value(key))

    steps = [("memory", 1, 1), ("memory", 8, 1), ("memory", 1, 4), ("memory", 8, 4)]
    bar = tqdm(total=len(steps) + 5, desc="bench memory", disable=not progress)
    # ours (1 shard) against cachetools + the same JSON copy, side by side, round by round
    rounds = 5 if quick else 15
    ours = MemoryBackend(shards=1, max_entries=num_keys * 2, default_ttl=300.0)
    peer = _LockedTTLCache(num_keys * 2, copy=True)
    preload(ours.set)
    preload(peer.set)
    set_pairs = [(k, v) for _, k, v in set_only]
    get_pairs = [(k, None) for _, k, _ in get_only]
    paired = {
        "set": paired_ratios(ours.set, peer.set, set_pairs, rounds),
        "get": paired_ratios(ours.get, peer.get, get_pairs, rounds),
    }
    bar.update()
    for backend_name, shards, threads in steps:
        store = MemoryBackend(shards=shards, max_entries=num_keys * 2, default_ttl=300.0)
        preload(store.set)
        row = {"backend": backend_name, "shards": shards, "threads": threads}
        row["mix_ops_per_s"] = ops_per_s(store.get, store.set, ops, threads)
        if threads == 1 and shards == 1:
            row["get_ops_per_s"] = ops_per_s(store.get, store.set, get_only, 1)
            row["set_ops_per_s"] = ops_per_s(store.get, store.set, set_only, 1)
        results.append(row)
        bar.update()
    for copy in (False, True):
        cache = _LockedTTLCache(num_keys * 2, copy)
        preload(cache.set)
        name = "cachetools_ttl_json_copy" if copy else "cachetools_ttl"
        row = {"backend": name, "shards": 1, "threads": 1}
        row["mix_ops_per_s"] = ops_per_s(cache.get, cache.set, ops, 1)
        row["get_ops_per_s"] = ops_per_s(cache.get, cache.set, get_only, 1)
        row["set_ops_per_s"] = ops_per_s(cache.get, cache.set, set_only, 1)
        results.append(row)
        bar.update()

    redis_note = None
    if redis_server_path() is None:
        redis_note = "redis-server not installed (apt-get install -y redis-server): Redis rows skipped"
        bar.update(1)
    else:
        with RedisServer() as server:
            backend = RedisBackend(server.url, namespace="bench", timeout=1.0)
            backend.set_many({k: _value(k) for k in keys})
            r_ops = ops[:redis_ops]
            for threads in (1, 4):
                row = {"backend": "redis", "shards": 1, "threads": threads}
                row["mix_ops_per_s"] = ops_per_s(backend.get, backend.set, r_ops, threads)
                if threads == 1:
                    row["get_ops_per_s"] = ops_per_s(backend.get, backend.set, get_only[:redis_ops], 1)
                    row["set_ops_per_s"] = ops_per_s(backend.get, backend.set, set_only[:redis_ops], 1)
                    batches = [[k for _, k, _ in r_ops[i : i + 100]] for i in range(0, len(r_ops), 100)]
                    _, (ms,) = time_calls_ms(lambda b=batches: [backend.get_many(x) for x in b], 1, warmup=0)
                    row["mget100_get_ops_per_s"] = len(r_ops) / (ms / 1e3)
                results.append(row)
            backend.clear()
        bar.update()
    hit_rates = policy_hit_rates(capacity=128, num_ops=4_000 if quick else 20_000)
    bar.update()
    bar.close()

    def find(backend: str, shards: int, threads: int) -> dict[str, Any]:
        return next(r for r in results if (r["backend"], r["shards"], r["threads"]) == (backend, shards, threads))

    base = find("memory", 1, 1)
    mix = {(r["backend"], r["shards"], r["threads"]): r["mix_ops_per_s"] for r in results}
    summary: dict[str, Any] = {
        "get_ops_per_s": round(base["get_ops_per_s"]),
        "set_ops_per_s": round(base["set_ops_per_s"]),
        "mix_ops_per_s": round(base["mix_ops_per_s"]),
        "sharded_speedup_4_threads": round(mix["memory", 8, 4] / mix["memory", 1, 4], 3),
        "threads4_over_1_8_shards": round(mix["memory", 8, 4] / mix["memory", 8, 1], 3),
        "ours_over_cachetools_mix": round(base["mix_ops_per_s"] / find("cachetools_ttl", 1, 1)["mix_ops_per_s"], 3),
        "ours_over_cachetools_json_copy_mix": round(
            base["mix_ops_per_s"] / find("cachetools_ttl_json_copy", 1, 1)["mix_ops_per_s"], 3
        ),
        "hit_rate_by_policy": {name: round(r["hit_rate"], 4) for name, r in hit_rates.items()},
        # time ours / cachetools + the same JSON copy, per round: median [min-max] (issue 29 item 3)
        "set_time_over_cachetools_json_copy": paired["set"],
        "get_time_over_cachetools_json_copy": paired["get"],
    }
    if redis_note is None:
        r1, r4 = find("redis", 1, 1), find("redis", 1, 4)
        summary.update(
            redis_get_ops_per_s=round(r1["get_ops_per_s"]),
            redis_set_ops_per_s=round(r1["set_ops_per_s"]),
            redis_4_threads_over_1=round(r4["mix_ops_per_s"] / r1["mix_ops_per_s"], 3),
            redis_mget100_over_get=round(r1["mget100_get_ops_per_s"] / r1["get_ops_per_s"], 3),
            memory_over_redis_get=round(base["get_ops_per_s"] / r1["get_ops_per_s"], 1),
        )
    config = {
        "num_keys": num_keys,
        "num_ops": num_ops,
        "redis_ops": redis_ops,
        "mix": "90% get / 10% set, Zipf(1.1) keys, ~100-byte JSON values",
        "repeats": 3,
        "paired_rounds": rounds,
        "paired": "ours (1 shard) vs cachetools.TTLCache + lock + json_text/json.loads, same ops, interleaved",
        "hit_rate_capacity": 128,
        "hit_rate_trace_ops": 4_000 if quick else 20_000,
        "redis": redis_note or "private redis-server on 127.0.0.1",
    }
    report = envelope("memory", config, results, summary)
    report["hit_rates"] = hit_rates
    return report


def human(report: dict[str, Any]) -> str:
    cols = ["backend", "shards", "threads", "get_ops_per_s", "set_ops_per_s", "mix_ops_per_s", "mget100_get_ops_per_s"]
    rows = [{k: (round(v) if isinstance(v, float) else v) for k, v in r.items()} for r in report["results"]]
    lines = [format_table(rows, cols), ""]
    hit_rows = [{"policy": name, **{k: round(v, 4) for k, v in r.items()}} for name, r in report["hit_rates"].items()]
    lines.append(format_table(hit_rows, ["policy", "hit_rate", "hit_rate_hot", "hit_rate_tool", "hit_rate_scan"]))
    lines.append("")
    lines += [f"{k}: {v}" for k, v in report["summary"].items() if k != "hit_rate_by_policy"]
    lines.append(f"peers: {report.get('peers')}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows = report["results"]
    labels = [f"{r['backend']}\n{r['shards']} sh × {r['threads']} th" for r in rows]
    ax1.barh(labels, [r["mix_ops_per_s"] for r in rows], color="tab:blue")
    ax1.set_xscale("log")
    ax1.set_xlabel("operations / s (90% get, 10% set), log scale")
    ax1.invert_yaxis()
    ax1.set_title("throughput")
    rates = report["hit_rates"]
    names = list(rates)
    ax2.bar(names, [rates[n]["hit_rate"] for n in names], color="tab:green")
    ax2.set_ylabel("hit rate")
    ax2.set_title(f"agent access pattern, {report['config']['hit_rate_capacity']} entries")
    ax2.tick_params(axis="x", rotation=35)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
