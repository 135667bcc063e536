"""Rendering benchmark results as markdown: one table per recorded benchmark.

Each renderer takes one recorded envelope (:mod:`memos_ref.bench.report_results`) and returns the markdown of one
README/docs block; :data:`TABLE_BLOCKS` maps each block name to the result file it reads and its renderer. The
formatting helpers (:func:`md_table`, :func:`md_cell`) are shared with the claims ledger
(:mod:`memos_ref.bench.report_ledger`); :mod:`memos_ref.bench.report` fills the blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memos_ref.bench.report_results import Report

__all__ = ["POLICY_NAMES", "TABLE_BLOCKS", "md_cell", "md_table"]


# --- formatting --------------------------------------------------------------------------------------------------


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _pct(x: float, digits: int = 2) -> str:
    return f"{x:+.{digits}f}%"


def md_table(header: list[str], rows: list[list[str]], align: str = "") -> str:
    """A markdown table; ``align``: one ``l`` (left) or ``r`` (right) per column, default the first left."""
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --- renderers: one per README block -----------------------------------------------------------------------------


def _waste(r: Report) -> str:
    rows = r["results"]
    policies: list[str] = []
    for row in rows:
        if row["policy"] not in policies:
            policies.append(row["policy"])
    header = ["policy", *[p.replace("blocks of ", "").replace(" from 256", "").replace("x", "×") for p in policies]]
    body = []
    for trace in dict.fromkeys(row["trace"] for row in rows):
        cells = {row["policy"]: row["waste_percent"] for row in rows if row["trace"] == trace}
        body.append([f"waste, {trace}", *[f"{cells[p]:.2f}%" for p in policies]])
    return md_table(header, body)


def _peer_label(r: Report, who: str) -> str:
    """A contender's name with the version or commit its result records."""
    base = {
        "ours": "memos-ref `BlockAllocator`",
        "deque": "deque baseline (nano-vllm style, same hashing)",
        "vllm": "vLLM {v} `BlockPool`, its own hashing (SHA-256 of pickle)",
        "vllm_shared_hash": "vLLM {v} `BlockPool`, the package's BLAKE2b",
        "nanovllm": "nano-vllm {v} `BlockManager`, its own xxh64",
    }.get(who, who)
    info = r.get("peers", {}).get("nanovllm" if who == "nanovllm" else "vllm") or {}
    version = info.get("version") or (info.get("commit") or "")[:7] or "(version not recorded)"
    return base.format(v=version)


def _allocator(r: Report) -> str:
    sizes = sorted({row["pool_blocks"] for row in r["results"]})
    contenders = r["config"]["contenders"]
    order = [c for c in ("ours", "vllm", "vllm_shared_hash", "nanovllm", "deque") if c in contenders]
    body = []
    for who in order:
        cells = []
        for size in sizes:
            row = next((x for x in r["results"] if x["contender"] == who and x["pool_blocks"] == size), None)
            cells.append(
                "not run (O(pool))"
                if row is None
                else f"{row['seconds']:.2f} s [{row['seconds_min']:.2f}–{row['seconds_max']:.2f}] ×{row['repeats']}"
            )
        body.append([_peer_label(r, who), *cells])
    table = md_table(["CPU seconds, median [min–max] ×repeats", *[f"{s:,} blocks" for s in sizes]], body)
    summ, lines = r["summary"], []
    keys = ("64k", "1m") if "tokens_per_s_pool_1m" in summ else ("small", "large")
    for who in order[1:]:
        parts = []
        for key in keys:
            ratio = summ.get(f"ours_over_{who}_pool_{key}")
            if ratio is None:
                continue
            lo, hi = summ[f"ours_over_{who}_pool_{key}_min_max"]
            verdict = summ.get(f"ours_vs_{who}_pool_{key}_verdict", "")
            parts.append(f"{ratio:.2f} [{lo:.2f}–{hi:.2f}] at {key} ({verdict})")
        if parts:
            lines.append(f"ours / {_peer_label(r, who)}: " + ", ".join(parts))
    lo, hi = summ["pool_size_slowdown_min_max"]
    lines.append(f"ours at the large pool / the small one: {summ['pool_size_slowdown']:.2f} [{lo:.2f}–{hi:.2f}]")
    text = (
        table + "\n\nEach ratio is the median [min–max] of per-repeat pairs (the two runs of one repeat, order shuffled"
        " per repeat); below 1 ours is faster, and a spread that straddles 1 is inconclusive.\n\n- "
        + "\n- ".join(lines)
    )
    pred = summ.get("deque_scan_seconds_predicted_pool_64k")
    if pred is not None:
        text += (
            "\n\nThe deque baseline and nano-vllm keep the free list in a `deque` and call `deque.remove` whenever"
            f" a cached block is reused, which scans the list: {summ['deque_remove_calls_pool_64k']:,} removes"
            f" scanned {summ['deque_entries_scanned_pool_64k']:,} entries, at {summ['deque_scan_ns_per_entry']:.0f}"
            f" ns each (measured in the same run), which predicts {pred:.1f} s — an O(pool) step per reuse, where"
            " the intrusive free lists of ours and vLLM's are O(1). So they are not run at the large pool."
        )
    text += (
        "\n\nReproduce: `make peers && python -m memos_ref.bench allocator --json` (nano-vllm needs GitHub, or"
        " `MEMOS_REF_NANOVLLM_SRC` naming a checkout of the recorded commit)."
    )
    return text


_QUANT_NAMES = {
    "fp16": "fp16",
    "int8_tensor_fixed0.1": "int8 per tensor, scale 0.1 (seed 003)",
    "int8_tensor_calibrated": "int8 per tensor, calibrated",
    "int8_token": "int8 per token",
    "fp8_e4m3": "fp8 e4m3",
    "kivi4_g32": "KIVI-4 g32 (+128 residual)",
    "kivi4_g128": "KIVI-4 g128 (+128 residual)",
    "kivi4_g32_no_residual": "KIVI-4 g32, no residual",
    "kivi2_g32": "KIVI-2 g32 (+128 residual)",
    "kivi2_g32_no_residual": "KIVI-2 g32, no residual",
    "kivi2_g128": "KIVI-2 g128 (+128 residual)",
    "aging_int8_after256": "aging: int8 after 256 tokens",
    "aging_kivi4_after256": "aging: KIVI-4 after 256 tokens",
}


def _quant(r: Report) -> str:
    """Accuracy and bytes per scheme; a perplexity rise over 0.5% in bold (the seeds' threshold)."""
    n = r["config"]["generated_tokens"]
    wide = any("kl_mean_wide_random" in row for row in r["results"])
    body = []
    for row in r["results"]:
        delta = _pct(row["ppl_delta_pct"], 3)
        cells = [
            _QUANT_NAMES.get(row["scheme"], row["scheme"]),
            f"**{delta}**" if row["ppl_delta_pct"] > 0.5 else delta,
            f"{row['kl_mean']:.1e}",
        ]
        cells += [f"{row['kl_mean_wide_random']:.1e}" if "kl_mean_wide_random" in row else "—"] if wide else []
        cells += [f"{n - row['mismatches']}/{n}", f"{row['bytes_per_token_ratio']:.3f}"]
        body.append(cells)
    header = ["scheme", "perplexity Δ", "KL", *(["KL, wide random model"] if wide else []), "greedy"]
    head = f"fp32 perplexity {r['summary']['ppl_fp32']:.2f} over {r['config']['context_tokens']:,} tokens.\n\n"
    table = md_table([*header, "bytes/token vs fp16"], body)
    return head + table


def _growth(r: Report) -> str:
    rows = [x for x in r["results"] if x["kind"] == "growth"]
    body = [
        [
            f"{x['old_capacity']:,} → {x['new_capacity']:,}",
            f"{x['bytes_copied'] / 2**20:,.0f}",
            f"{x['seed_003_ms']:g}",
            f"{x['ms_one_layer']:.2f}",
            f"{x['ms_32_layers']:,.0f}",
            f"{x['gb_per_s']:.1f}",
        ]
        for x in rows
    ]
    table = md_table(["growth", "MiB copied", "seed 003 ms", "ms, one layer", "ms, × 32 layers", "GB/s"], body)
    amort = [x for x in r["results"] if x["kind"] == "amortised"]
    parts = ", ".join(f"{x['growth_factor']:g}× {x['copied_per_token_held']:.2f}" for x in amort)
    return table + (f"\n\nTokens copied per token held, growing to the end: {parts}." if parts else "")


def _memory(r: Report) -> str:
    names = {
        ("memory", 1): "memory",
        ("cachetools_ttl", 1): "`cachetools.TTLCache` + lock (hands out the stored object)",
        ("cachetools_ttl_json_copy", 1): "`cachetools.TTLCache` + lock + the same JSON copy",
        ("redis", 1): "Redis on loopback (one round trip per call)",
    }
    body = []
    for x in r["results"]:
        label = names.get((x["backend"], 1), x["backend"])
        label = (
            f"{label}, {x['shards']} shard{'s' * (x['shards'] > 1)}, {x['threads']} thread{'s' * (x['threads'] > 1)}"
        )
        cells = [x.get(k) for k in ("get_ops_per_s", "set_ops_per_s", "mix_ops_per_s", "mget100_get_ops_per_s")]
        body.append([label, *("" if c is None else _n(c) for c in cells)])
    table = md_table(["configuration", "get ops/s", "set ops/s", "mixed ops/s", "`MGET` 100, gets/s"], body)
    s = r["summary"]
    text = (
        f"Ratios: ours / cachetools {s['ours_over_cachetools_json_copy_mix']:.2f}× with the same JSON copy"
        f" ({s['ours_over_cachetools_mix']:.2f}× against cachetools handing out its objects); 8 shards over one lock"
        f" at 4 threads {s['sharded_speedup_4_threads']:.2f}×; 4 threads over 1 (8 shards)"
        f" {s['threads4_over_1_8_shards']:.2f}×"
    )
    for op in ("set", "get"):
        t = s.get(f"{op}_time_over_cachetools_json_copy")
        if t:
            side = "faster" if t["max"] < 1 else "slower" if t["min"] > 1 else "inconclusive"
            text += (
                f"; `{op}` time, ours / cachetools {r.get('peers', {}).get('cachetools') or ''} + the same JSON copy:"
                f" {t['median']:.2f} [{t['min']:.2f}–{t['max']:.2f}] over {t['rounds']} interleaved rounds ({side})"
            )
    if "memory_over_redis_get" in s:
        text += (
            f"; the in-process store answers a get {s['memory_over_redis_get']:g}× faster than Redis on loopback,"
            f" `MGET` of 100 keys {s['redis_mget100_over_get']:.2f}× the gets/s of one key per call"
        )
    rates = r["summary"]["hit_rate_by_policy"]
    labels = {"hybrid": "hybrid (seed)", "hybrid_b10": "hybrid, age/10 s", "hybrid_exact": "hybrid, all entries scored"}
    labels |= {"lfu": "lfu", "lfu_exact": "lfu, all entries scored", "cachetools_ttl": "cachetools TTLCache"}
    hits = md_table([labels.get(k, k) for k in rates], [[f"{v:.4f}" for v in rates.values()]], align="r" * len(rates))
    cap = r["config"]["hit_rate_capacity"]
    ops = r["config"]["hit_rate_trace_ops"]
    return (
        table + "\n\n" + text + f".\n\nHit rates on the seeded agent access pattern ({cap} entries, {ops:,} reads;"
        " exact):\n\n" + hits
    )


def _agent(r: Report) -> str:
    traces = [t for t, f in r["summary"].items() if isinstance(f, dict) and "ttft_ratio_median" in f]
    body = []
    for t in traces:
        w = next(x for x in r["results"] if x["trace"] == t and x["reuse"])
        wo = next(x for x in r["results"] if x["trace"] == t and not x["reuse"])
        body.append(
            [
                t,
                f"{w['requests']}",
                f"{w['prefill_computed']:,} / {wo['prefill_computed']:,}",
                f"{100 * r['summary'][t]['prefill_tokens_saved_fraction']:.1f}%",
                f"{w['peak_blocks']:,} / {wo['peak_blocks']:,}",
                f"{1e3 * w['ttft_median_s']:,.0f} / {1e3 * wo['ttft_median_s']:,.0f} ms",
                f"{w['tokens_per_s']:.1f} / {wo['tokens_per_s']:.1f}",
                f"{w['preemptions']} / {wo['preemptions']}",
            ]
        )
    table = md_table(
        [
            "trace",
            "requests",
            "prefill tokens computed, reuse / none",
            "saved",
            "peak blocks, reuse / none",
            "median TTFT, reuse / none",
            "generated tokens/s, reuse / none",
            "preemptions",
        ],
        body,
    )
    real = r["summary"].get("smollm2-135m-instruct_real_weights")
    if real and real.get("ran"):
        w, wo = real["with_reuse"], real["without"]
        table += (
            f"\n\nSmolLM2-135M-Instruct, real weights: {real['agents']} agents over one"
            f" {real['system_prompt_tokens']}-token system prompt reuse {w['reused_tokens']} prompt tokens with the"
            f" prefix cache ({wo['reused_tokens']} without), peak blocks {w['peak_blocks']} vs {wo['peak_blocks']},"
            f" median TTFT {w['ttft_median_s']:.2f} vs {wo['ttft_median_s']:.2f} s, identical outputs."
        )
    elif real:
        table += f"\n\nSmolLM2-135M-Instruct real weights: not run ({real.get('why')})."
    return table


def _sharing(r: Report) -> str:
    body, above, below = [], [], []
    for row in r["results"]:
        if row["subagents"] == 1:
            continue
        case = f"{row['subagents']} × {row['prompt_tokens']:,}"
        timed = row.get("prefill_time_ratio") is not None
        lo, hi = row.get("prefill_time_ratio_min"), row.get("prefill_time_ratio_max")
        time_cell = f"{row['prefill_time_ratio']:.2f}× [{lo:.2f}–{hi:.2f}]" if timed else "(not timed)"
        body.append(
            [
                case,
                f"{row['blocks_shared']:,} / {row['blocks_unshared']:,}",
                f"{row['prefill_tokens_shared']:,} / {row['prefill_tokens_unshared']:,}",
                f"{row['prefill_tokens_ratio']:.2f}×",
                time_cell,
            ]
        )
        if timed:
            (above if row["prefill_time_ratio"] > row["prefill_tokens_ratio"] else below).append(case)
    table = md_table(
        [
            "sub-agents × prompt",
            "blocks shared / unshared",
            "prefill tokens shared / unshared",
            "token ratio",
            "prefill time ratio, median [min–max]",
        ],
        body,
    )
    verdict = (
        f"The prefill time saved exceeds the tokens saved in {len(above)} of {len(above) + len(below)} timed cases"
    )
    if above:
        verdict += f" ({', '.join(above)}): recomputing a long prompt costs more than its share of tokens (attention"
        verdict += " is quadratic in the prompt's length)"
    if below:
        verdict += f"; it falls short of them in {', '.join(below)}, where each fork's own prefill (its task attends"
        verdict += " over the prompt gathered from the pool) weighs more than the prompt it skips"
    verdict += "."
    return table + "\n\n" + verdict


_DECODE_RATIOS = [
    ("paged_pool_size_slowdown_package", "package forward: paged in a 16× larger pool / paged", "≤ 1.1"),
    ("paged_pool_size_slowdown_transformers", "transformers forward: paged in a 16× larger pool / paged", "≤ 1.1"),
    ("paged_over_contiguous_ms_per_token_at_max_ctx", "package forward: paged / contiguous", "≤ 1.3"),
    ("paged_mirror_over_contiguous_package", "package forward: paged `dense_mirror=True` / contiguous", "≤ 1.3"),
    ("paged_over_dynamic_transformers", "transformers forward: `PagedCache` / `DynamicCache`", "≤ 1.15"),
    (
        "paged_mirror_over_dynamic_transformers",
        "transformers: `PagedCache(dense_mirror=True)` / `DynamicCache`",
        "≤ 1.15",
    ),
    ("dynamic_over_contiguous_ms_per_token_at_max_ctx", "transformers forward: `DynamicCache` / contiguous", ""),
]


def _decode(r: Report) -> str:
    """The side-by-side ratios on the wide model at the run's longest context, and the engine's overhead."""
    ratios, ctx = r["summary"]["ratios"], r["summary"]["max_context"]
    body = []
    for key, label, target in _DECODE_RATIOS:
        stat = ratios.get(key, {}).get("wide")
        if stat and stat.get("median") is not None:
            body.append([label, f"{stat['median']:.2f}× [{stat['min']:.2f}–{stat['max']:.2f}]", target])
    table = md_table([f"wide model, {ctx:,} tokens: ratio", "median [min–max] of rounds", "target at 4,096"], body)
    eng = r["summary"].get("engine")
    if eng:
        table += (
            f"\n\nEngine ({eng['rows']} rows, context {eng['context']}, {eng['model']} model): per-step overhead beside"
            f" the forward {eng['overhead_us_per_row_step']:,.0f} µs per row and step"
            f" [{eng['overhead_us_per_row_step_min']:,.0f}–{eng['overhead_us_per_row_step_max']:,.0f}], against a"
            f" bare contiguous forward of {eng['contiguous_forward_us_per_row_step']:,.0f} µs"
            f" ({eng['overhead_us_per_row_step'] / eng['contiguous_forward_us_per_row_step']:.2f}× of it)."
        )
    return table


POLICY_NAMES = {
    "lru_k2": "recency sum K=2 (seed 001's “LRU-K”)",
    "lru_k3": "recency sum K=3",
    "recency_sum_2": "recency sum K=2 (seed 001's “LRU-K”)",
    "recency_sum_3": "recency sum K=3",
    "lru_2": "LRU-2",
    "lru_3": "LRU-3",
}


def _tiering_policies(r: Report) -> str:
    """Device hit rate (share of prompt tokens served from the device) per trace and policy — exact counts."""
    rates = r["summary"]["hit_rate_by_policy"]
    policies = list(next(iter(rates.values())))
    order = ["lru", *[p for p in policies if p != "lru"]]
    body = []
    for trace, row in rates.items():
        best = max(row.values())
        body.append([trace, *[f"**{row[p]:.4f}**" if row[p] == best else f"{row[p]:.4f}" for p in order]])
    table = md_table(["trace", *[POLICY_NAMES.get(p, p) for p in order]], body)
    lines = []
    for p in order[1:]:
        deltas = [100 * (row[p] - row["lru"]) for row in rates.values()]
        lines.append(f"{POLICY_NAMES.get(p, p)} {' / '.join(f'{d:+.1f}' for d in deltas)}")
    text = table + "\n\nPoints against LRU (" + " / ".join(rates) + "): " + "; ".join(lines) + "."
    forgot = r["summary"].get("scan_history_forgotten")
    if forgot and "scan" in rates:
        pairs = ", ".join(
            f"{POLICY_NAMES.get(p, p)} {rates['scan'][p]:.4f} → {v:.4f}"
            for p, v in forgot.items()
            if p in rates["scan"]
        )
        text += f" On the scan trace with each block's history forgotten at eviction: {pairs}."
    return text


def _tiering_swap(r: Report) -> str:
    reload = r["config"]["calibration"]["reload_seconds_per_block"]
    names = {
        "host": "host",
        "disk": "disk (lz4; a temporary directory, reads from the page cache)",
        "redis": "Redis on loopback (lz4)",
    }
    body = []
    for row in r["results"]:
        tier = row["tier"]
        body.append(
            [
                names.get(tier, tier),
                f"{row['swap_out_gbps']:.3f}",
                f"{row['swap_in_gbps']:.3f}",
                f"{1e6 * reload[tier]:,.0f} µs",
                f"{r['summary']['break_even_tokens_' + tier]} tokens",
            ]
        )
    table = md_table(["tier", "swap-out GB/s", "swap-in GB/s", "reload one block", "break-even context"], body)
    prefill = r["config"]["calibration"]["prefill_seconds"]
    ms = " / ".join(f"{1e3 * prefill[k]:,.0f}" for k in sorted(prefill, key=int))
    toks = " / ".join(f"{int(k):,}" for k in sorted(prefill, key=int))
    return table + f"\n\nPrefill of the shipped model measured {ms} ms at {toks} tokens in the same run."


def md_cell(text: str) -> str:
    """``text`` safe inside one markdown table cell (pipes escaped, newlines flattened)."""
    return text.replace("|", "\\|").replace("\n", " ")


def _notebook_claims(r: Report) -> str:
    """Every claims-table row the notebooks computed, grouped by notebook, with the verdict code chose."""
    body = []
    for row in r["results"]:
        link = f"[{row['notebook'][:2]}](../notebooks/{row['notebook']}.ipynb)"  # from docs/
        cells = [row["source"], row["claim"], row["measured"]]
        body.append([link, *(md_cell(c) for c in cells), f"**{row['verdict']}**"])
    table = md_table(["notebook", "source", "claim", "measured here", "verdict"], body, align="lllll")
    counts = r["summary"]["verdicts"]
    total = sum(counts.values())
    parts = ", ".join(f"{n} {v}" for v, n in counts.items())
    books = len({row["notebook"] for row in r["results"]})
    return table + f"\n\n{total} claims checked by {books} notebooks: {parts}."


def _tiering_codecs(r: Report) -> str:
    """Compression ratio of every codec on the shipped model's real KV, per dtype (exact for a given input)."""
    rows = r["codecs"]
    codecs = [c for c in dict.fromkeys(x["codec"] for x in rows) if c != "none"]
    body = []
    for dtype in dict.fromkeys(x["dtype"] for x in rows):
        ratio = {x["codec"]: x["ratio"] for x in rows if x["dtype"] == dtype}
        label = f"{dtype} (as stored)" if dtype == "float32" else dtype
        body.append([label, *(f"{ratio[c]:.2f}" if c in ratio else "—" for c in codecs)])
    return md_table(["", *codecs], body)


def _tiering_prefetch(r: Report) -> str:
    """What Markov prefetch moved per trace and window, and what it changed in the device hit rate."""
    body = []
    for x in r["prefetch"]:
        body.append(
            [
                x["trace"],
                str(x["window"]),
                f"{x['prefetched_blocks']:,}",
                f"{x['prefetched_used']:,}",
                f"{100 * (x['device_hit_rate'] - x['device_hit_rate_without']):+.1f}",
                f"{x['wasted_bytes'] / 1e6:,.1f}",
            ]
        )
    return md_table(
        ["trace", "window", "blocks prefetched", "used", "device hit rate, points vs none", "MB fetched for nothing"],
        body,
    )


TABLE_BLOCKS: dict[str, tuple[str, Callable[[Any], str]]] = {
    "waste": ("waste", _waste),
    "sharing": ("sharing", _sharing),
    "decode-quick": ("decode_quick", _decode),
    "decode-targets": ("decode-targets", _decode),
    "tiering-swap": ("tiering", _tiering_swap),
    "tiering-policies": ("tiering", _tiering_policies),
    "tiering-codecs": ("tiering", _tiering_codecs),
    "tiering-prefetch": ("tiering", _tiering_prefetch),
    "allocator": ("allocator", _allocator),
    "growth": ("growth", _growth),
    "memory": ("memory", _memory),
    "agent": ("agent", _agent),
    "quant": ("quant", _quant),
    "quant-real": ("quant_smollm2-135m-instruct", _quant),
    "notebook-claims": ("notebooks", _notebook_claims),
}
"""Block name → (result file stem, renderer of that one recorded result)."""
