"""``bench tiering``: swap bandwidth per tier, reload against recompute, codecs on real KV, eviction policies and
prefetch on the agent traces, and the check that tiering never changes an output.

* Swap bandwidth: real KV blocks of the shipped model (16 tokens, 32 KiB each, from a 2,048-token prefill)
  written to and read back from host memory, disk (a temporary directory) and a private redis-server, through
  the tier store (block file format, checksum, the tier's codec); GB/s of raw KV.
* Reload against recompute: :meth:`TierManager.calibrate` measures prefill time against context length and the
  time to reload one block per tier; ``break_even_tokens_*`` is the shortest context from which reloading wins.
* Codecs: compression ratio on the same KV (full blocks only: no padding) and encode/decode speed, for fp32
  (the shipped model's dtype) and the same values in fp16 and bf16, beside seed 001's LZ4 2.1× / Zstd 3.3×.
* Policies: :mod:`memos_ref.tiering.simulate` on the ``chat``, ``multi_agent`` and ``tool_heavy`` traces, four
  users of each active at once (:func:`interleaved_trace`), at device capacities of 1, 1.5, 2 and 3 times the
  largest prompt; and on :func:`~memos_ref.tiering.simulate.scan_trace` (``scan``: a hot working set of 16 blocks
  interleaved with one-time scans of 48 blocks a round) at 1, 1.5, 2 and 3 times the hot set. Exact counts
  (seeded traces, block-level simulation); each row's ``headline`` marks the capacity the summary quotes (1× the
  largest prompt; 1.5× the hot set for ``scan``: the hot set plus room for the scan's current prompt). Evicted
  blocks keep their reference history (LRU-K's retained information period); ``retention`` shows, on ``scan``,
  what the history-based policies score when it is forgotten at eviction instead. ``--quick`` (a smoke run; no
  recorded figure comes from it) keeps the headline capacities and one larger: 1 and 2 times the largest prompt,
  1.5 and 3 times the hot set, two users of each trace.
* Prefetch: the Markov predictor (window 5, threshold 0.6, 8 blocks — seed 001's defaults — and window 3).
* Outputs: four sessions taking turns on a pool too small for them, with host + disk tiers, against the same
  sessions on a large pool without tiering.
"""

from __future__ import annotations

import tempfile
import time
import warnings
from typing import Any

import torch
from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table
from memos_ref.session import SessionLayout
from memos_ref.tiering.backends import DiskBackend, HostMemoryBackend, RedisTierBackend
from memos_ref.tiering.codecs import CODECS, get_codec
from memos_ref.tiering.manager import TierManager
from memos_ref.tiering.simulate import MarkovPredictor, interleaved_trace, requests_from_trace, scan_trace, simulate
from memos_ref.tiering.store import Tier, TierStore

__all__ = ["POLICIES", "SCAN", "codec_table", "human", "plot", "real_blocks", "run", "scan_policies"]

#: Policies compared: LRU, real LRU-K (K = 2, 3), seed 001's recency sum (which it calls "LRU-K"), LFU, seed 002's
#: hybrid, and the kind-priority policy.
POLICIES = ("lru", "lru_2", "lru_3", "recency_sum_2", "recency_sum_3", "lfu", "hybrid", "priority")

#: The scan-heavy trace's parameters (:func:`memos_ref.tiering.simulate.scan_trace`).
SCAN = {"hot": 8, "hot_blocks": 2, "scan_per_hot": 3, "scan_blocks": 2, "rounds": 12, "seed": 0}


def real_blocks(model: Any, tokens: int) -> tuple[Any, list[torch.Tensor]]:
    """Full KV blocks of the shipped model after prefilling ``tokens`` bytes of held-out code."""
    from memos_ref.hf import PagedCache
    from memos_ref.model import shipped_model_dir
    from memos_ref.paged import PagedKV

    text = (shipped_model_dir().parent / "data" / "heldout_stdlib.txt").read_bytes()[:tokens]
    spec = model.kv_spec(block_size=16)
    kv = PagedKV(spec, tokens // 16 + 2, prefix_caching=False)
    cache = PagedCache(kv)
    with torch.no_grad():
        model(torch.tensor([list(text)]), cache)
    seq = cache.sequences[0]
    full = seq.num_tokens // 16
    return spec, [kv.pool.block(b).clone() for b in seq.block_table[:full]]


def _swap_bandwidth(store: TierStore, tier: str, blocks: list[torch.Tensor]) -> dict[str, float]:
    keys = [f"bw{i}" for i in range(len(blocks))]
    raw = sum(b.nbytes for b in blocks)
    started = time.perf_counter()
    for k, b in zip(keys, blocks):
        store.put(k, b, tier)
    out_s = time.perf_counter() - started
    started = time.perf_counter()
    for k in keys:
        store.get(k, tiers=[tier])
    in_s = time.perf_counter() - started
    for k in keys:
        store.tier(tier).backend.delete(k)
    return {"tier": tier, "swap_out_gbps": raw / out_s / 1e9, "swap_in_gbps": raw / in_s / 1e9, "blocks": len(blocks)}


def codec_table(spec: Any, blocks: list[torch.Tensor], quick: bool) -> list[dict[str, Any]]:
    """Per dtype and codec: compression ratio and encode/decode throughput of the tier codecs over ``blocks``."""
    rows = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        sample = [b.to(dtype) for b in blocks[: 16 if quick else 64]]
        raw = b"".join(b.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for b in sample)
        for name, codec in CODECS.items():
            started = time.perf_counter()
            packed = codec.encode(raw, sample[0].element_size())
            enc = time.perf_counter() - started
            started = time.perf_counter()
            codec.decode(packed, sample[0].element_size())
            dec = time.perf_counter() - started
            rows.append(
                {
                    "dtype": str(dtype).removeprefix("torch."),
                    "codec": name,
                    "ratio": len(raw) / len(packed),
                    "encode_mb_s": len(raw) / max(enc, 1e-9) / 1e6,
                    "decode_mb_s": len(raw) / max(dec, 1e-9) / 1e6,
                }
            )
    return rows


def _row(trace: str, capacity: str, cap: int, policy: str, reqs: list, headline: bool) -> dict[str, Any]:
    with_tier = simulate(reqs, device_blocks=cap, policy=policy)
    no_tier = simulate(reqs, device_blocks=cap, policy=policy, tier=False)
    return {
        "trace": trace,
        "capacity": capacity,
        "headline": headline,
        "device_blocks": cap,
        "policy": policy,
        "device_hit_rate": with_tier["device_hit_rate"],
        "device_hit_tokens": round(with_tier["device_hit_rate"] * with_tier["prompt_tokens"]),
        "prompt_tokens": with_tier["prompt_tokens"],
        "hit_rate_with_tier": with_tier["hit_rate"],
        "bytes_moved": with_tier["bytes_moved"],
        "hit_rate_no_tier": no_tier["hit_rate"],
        "recomputed_tokens_no_tier": no_tier["recomputed_tokens"],
        "recomputed_tokens_with_tier": with_tier["recomputed_tokens"],
    }


def scan_policies(quick: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Every policy on the scan-heavy trace (:data:`SCAN`) at 1, 1.5, 2 and 3 times the hot set (``quick``: 1.5,
    the headline, and 3); and, at the headline capacity, the history-based policies with the history of evicted
    blocks kept and forgotten."""
    reqs = scan_trace(**SCAN)
    hot_set = SCAN["hot"] * SCAN["hot_blocks"]
    rows = []
    for factor in (1.5, 3.0) if quick else (1.0, 1.5, 2.0, 3.0):
        cap = int(hot_set * factor)
        for policy in POLICIES:
            rows.append(_row("scan", f"{factor:g}x hot set", cap, policy, reqs, headline=factor == 1.5))
    cap = int(hot_set * 1.5)
    retention = []
    for policy in ("lru", "lru_2", "lru_3", "recency_sum_2", "lfu"):
        kept = simulate(reqs, device_blocks=cap, policy=policy)["device_hit_rate"]
        forgotten = simulate(reqs, device_blocks=cap, policy=policy, retained_period=0)["device_hit_rate"]
        row = {"trace": "scan", "device_blocks": cap, "policy": policy}
        retention.append({**row, "history_kept": kept, "history_forgotten": forgotten})
    return rows, retention


def _policies(quick: bool) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    rows, prefetch_rows = [], []
    for trace in ("chat", "multi_agent", "tool_heavy"):
        # the sessions' own token layout (BOS, marker + bytes per segment): the hashes real sessions would have
        reqs = requests_from_trace(interleaved_trace(trace, copies=2 if quick else 4), layout=SessionLayout())
        largest = max(len(r.token_ids) // 16 for r in reqs)  # the device must hold one whole prompt
        for factor in (1.0, 2.0) if quick else (1.0, 1.5, 2.0, 3.0):  # quick keeps the headline capacity
            cap = int(largest * factor)
            for policy in POLICIES:
                rows.append(_row(trace, f"{factor:g}x largest prompt", cap, policy, reqs, headline=factor == 1.0))
        base = simulate(reqs, device_blocks=largest, policy="lru")
        for window in (3, 5):
            p = simulate(reqs, device_blocks=largest, policy="lru", prefetch=MarkovPredictor(window, 0.6))
            prefetch_rows.append(
                {
                    "trace": trace,
                    "window": window,
                    "device_hit_rate": p["device_hit_rate"],
                    "device_hit_rate_without": base["device_hit_rate"],
                    "prefetched_blocks": p["prefetched_blocks"],
                    "prefetched_used": p["prefetched_used"],
                    "prefetched_unused": p["prefetched_unused"],
                    "bytes_moved": p["bytes_moved"],
                    "bytes_moved_without": base["bytes_moved"],
                }
            )
    return rows, prefetch_rows


def _outputs_equal(model: Any) -> dict[str, Any]:
    from memos_ref.session import SegmentKind, SessionManager

    system = "You are a careful coding agent. Plan, call tools, check results, and report briefly.\n" * 2
    replies = {}
    counts: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for tiering in (False, True):
            manager = SessionManager(model, num_blocks=48 if tiering else 256, fingerprint="bench")
            manager.register_system_prompt("agent", "v1", system)
            tm = None
            if tiering:
                store = TierStore(
                    [Tier(HostMemoryBackend(1 << 20)), Tier(DiskBackend(tmp, 1 << 26), get_codec("lz4"))],
                    spec=manager.spec,
                    fingerprint="bench",
                )
                tm = manager.enable_tiering(store, min_residency_s=0.0)
            sessions = [manager.new_session(system=("agent", "v1"), tools=[f"tool{i}"]) for i in range(4)]
            out = []
            for turn in range(4):
                for i, s in enumerate(sessions):
                    s.append(SegmentKind.USER, f"u{turn}", f"Turn {turn} for agent {i}: list the files in src/.\n")
                    out.append(s.generate(12))
            replies[tiering] = out
            if tm is not None:
                counts = {k: v for k, v in tm.counts.items() if isinstance(v, int)}
    return {"outputs_equal": replies[True] == replies[False], "replies": len(replies[True]), **counts}


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    from memos_ref.memory import RedisServer, redis_server_path
    from memos_ref.model import load_model

    model = load_model()
    bar = tqdm(total=6, desc="bench tiering", disable=not progress)
    spec, blocks = real_blocks(model, 512 if quick else 2048)
    bar.update()
    bandwidth, break_even = [], {}
    server = RedisServer().start() if redis_server_path() is not None else None
    try:
        with tempfile.TemporaryDirectory() as tmp:
            tiers = [Tier(HostMemoryBackend(1 << 28)), Tier(DiskBackend(tmp, 1 << 30), get_codec("lz4"))]
            if server is not None:
                tiers.append(Tier(RedisTierBackend(server.url, fingerprint="bench", timeout=1.0), get_codec("lz4")))
            store = TierStore(tiers, spec=spec, fingerprint="bench")
            for tier in tiers:
                bandwidth.append(_swap_bandwidth(store, tier.name, blocks))
            from memos_ref.paged import PagedKV

            tm = TierManager(PagedKV(spec, 8, fingerprint="bench"), store)
            calibration = tm.calibrate(model, lengths=(64, 256, 1024) if quick else (64, 256, 1024, 2048))
            for tier in tiers:
                break_even[tier.name] = tm.break_even_tokens(tier.name)
            if server is not None:
                tiers[-1].backend.clear()
        bar.update()
        policies, prefetch = _policies(quick)
        scan_rows, retention = scan_policies(quick)
        policies += scan_rows
        bar.update()
    finally:
        if server is not None:
            server.stop()
    per_block = calibration["reload_seconds_per_block"].get("host")
    for row in prefetch:  # what prefetch took off the critical path, and what it moved for nothing
        row["critical_path_reload_ms_avoided"] = row["prefetched_used"] * per_block * 1e3 if per_block else None
        row["wasted_bytes"] = row["prefetched_unused"] * spec.bytes_per_block
    codecs = codec_table(spec, blocks, quick)
    bar.update()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outputs = _outputs_equal(model)
    bar.update()
    bar.close()
    bw = {r["tier"]: r for r in bandwidth}
    hit_by_policy: dict[str, dict[str, float]] = {}
    for r in policies:
        if r["headline"]:
            hit_by_policy.setdefault(r["trace"], {})[r["policy"]] = round(r["device_hit_rate"], 4)
    summary: dict[str, Any] = {
        "host_swap_gbps": round(bw["host"]["swap_in_gbps"], 3),
        "disk_swap_gbps": round(bw["disk"]["swap_in_gbps"], 3),
        "redis_swap_gbps": round(bw["redis"]["swap_in_gbps"], 3) if "redis" in bw else None,
        "break_even_tokens_host": break_even.get("host"),
        "break_even_tokens_disk": break_even.get("disk"),
        "break_even_tokens_redis": break_even.get("redis"),
        "hit_rate_by_policy": hit_by_policy,
        "codec_ratio": {r["codec"]: round(r["ratio"], 3) for r in codecs if r["dtype"] == "float16"},
        "codec_ratio_fp32": {r["codec"]: round(r["ratio"], 3) for r in codecs if r["dtype"] == "float32"},
        "scan_history_forgotten": {r["policy"]: round(r["history_forgotten"], 4) for r in retention},
        "outputs_equal": outputs["outputs_equal"],
    }
    config = {
        "model": "shipped (fp32, 2 KiB of KV per token); blocks of 16 tokens = 32 KiB",
        "kv_tokens": 512 if quick else 2048,
        "codec_blocks": 16 if quick else 64,
        "trace_users": 2 if quick else 4,
        "scan_trace": {**SCAN, "block_size": 16, "hot_set_blocks": SCAN["hot"] * SCAN["hot_blocks"]},
        "redis": "private redis-server on 127.0.0.1" if server is not None else "redis-server not installed",
        "calibration": {k: v for k, v in calibration.items() if k != "prefill_fit"},
    }
    report = envelope("tiering", config, bandwidth, summary)
    report.update(codecs=codecs, policies=policies, retention=retention, prefetch=prefetch, outputs=outputs)
    return report


def human(report: dict[str, Any]) -> str:
    s = report["summary"]
    lines = [format_table(report["results"], ["tier", "swap_out_gbps", "swap_in_gbps", "blocks"]), ""]
    lines.append(
        "break-even context (tokens) from which reloading beats recomputing: "
        + ", ".join(f"{t} {s.get(f'break_even_tokens_{t}')}" for t in ("host", "disk", "redis"))
    )
    lines += ["", format_table(report["codecs"], ["dtype", "codec", "ratio", "encode_mb_s", "decode_mb_s"]), ""]
    rows = [r for r in report["policies"] if r["headline"]]
    cols = ["trace", "capacity", "device_blocks", "policy", "device_hit_rate", "bytes_moved", "hit_rate_no_tier"]
    lines += [format_table(rows, cols), ""]
    lines += ["scan trace, evicted blocks' history kept vs forgotten at eviction:"]
    lines += [format_table(report["retention"], list(report["retention"][0])), ""]
    lines += [format_table(report["prefetch"], list(report["prefetch"][0])), ""]
    lines.append(f"outputs with tiering equal outputs without: {s['outputs_equal']} ({report['outputs']})")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = ("chat", "multi_agent", "tool_heavy", "scan")
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    for ax, trace in zip(axes, traces):
        for policy in POLICIES:
            rows = [r for r in report["policies"] if r["trace"] == trace and r["policy"] == policy]
            ax.plot([r["device_blocks"] for r in rows], [r["device_hit_rate"] for r in rows], marker="o", label=policy)
        ax.set_title(trace)
        ax.set_xlabel("device blocks")
    axes[0].set_ylabel("tokens served from the device")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
