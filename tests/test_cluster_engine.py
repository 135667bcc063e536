"""Two OS processes sharing the cluster tier (each its own Engine and pool, the shipped model): B's prefix lookup
reloads A's blocks instead of prefilling them; a prefill process and a decode process (disaggregation). Tokens
are compared with a single-process run of the same prompt."""

from __future__ import annotations

import pytest

from memos_ref.bench.cluster import cross_process, disaggregated


def test_second_process_reloads_the_first_ones_prefix(redis_cluster):
    r = cross_process(redis_cluster.url, "test-xp", new=4)
    assert r["distinct_pids"]
    a, b = r["a"], r["b"]
    assert a["tiered"]["reused"] == 0 and a["tier_counts"]["published_blocks"] > 0  # A computed and published
    assert r["cross_process_reused_tokens"] >= 16 * 30  # the shared system prompt (~580 tokens), block by block
    assert r["prefill_tokens_saved"] == r["cross_process_reused_tokens"]
    # B found them by read-ahead (one round per node), beside its warm-up prompt's 10 blocks A also published
    assert b["tier_counts"]["read_ahead_found"] == r["cross_process_reused_tokens"] // 16 + 10
    assert r["tokens_identical"]


def test_prefill_and_decode_in_two_processes(redis_cluster):
    r = disaggregated(redis_cluster.url, "test-pd", new=4)
    p, d = r["prefill"], r["decode"]
    assert p["manifest"] is not None and p["pid"] != d["pid"]
    full_blocks = (p["prompt_tokens"] - 1) // 16
    # the prompt's full blocks, beside the warm-up prompt's 10 (161 tokens), all written through by the engine
    assert p["published_blocks"] == full_blocks + 10 and d["blocks_moved"] == full_blocks
    assert r["reused_tokens"] == 16 * full_blocks  # every full block adopted; only the tail is recomputed
    assert r["bytes_moved"] > 0 and r["disaggregated_tokens_identical"]


def test_quantized_pools_are_refused_clearly():
    import torch

    from memos_ref.errors import ConfigError
    from memos_ref.paged import PagedKV
    from memos_ref.quant import FP8E4M3
    from memos_ref.spec import KVSpec
    from memos_ref.tiering.cluster_manifest import check_disaggregable

    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=8, dtype=torch.float32)
    check_disaggregable(PagedKV(spec, 4))  # unquantized: accepted
    with pytest.raises(ConfigError, match="quantized"):
        check_disaggregable(PagedKV(spec, 4, quant=FP8E4M3(), prefix_caching=False))
