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


def test_planted_values_and_a_full_node_while_requests_run(redis_cluster):
    """A prompt's published blocks are replaced under the engine — one by a list (WRONGTYPE), one by a block file
    with a valid header and a wrong body (its metadata agreeing) — and one master is full (OOM, noeviction): a
    second engine serves the prompt with the same tokens, reusing exactly the blocks before the damaged one,
    with every fault counted."""
    import hashlib

    import redis

    from memos_ref.bench.cluster import SYSTEM, _serve, _stack
    from memos_ref.model.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    prompt = [tok.bos_id, *tok.encode("Planted: " + SYSTEM[:300])]
    _, kv, writer_backend, writer, spec, _ = _stack(redis_cluster.url, "test-planted")
    expected = _serve(writer, prompt, 4)["output"]
    t = spec.block_size
    keys = [h.hex() for h in kv.prefix_cache.hashes(prompt[: (len(prompt) - 1) // t * t])]
    assert writer_backend.get_many(keys).keys() == set(keys)  # every full block was published
    client = writer_backend.client
    vk = lambda k: f"{writer_backend.prefix}{{{k}}}:v"  # noqa: E731
    mk = lambda k: f"{writer_backend.prefix}{{{k}}}:m"  # noqa: E731
    client.delete(vk(keys[6]))
    client.rpush(vk(keys[6]), b"not a block")  # wrong type
    body = bytearray(client.get(vk(keys[3])))
    body[-9] ^= 0x5A  # a valid header, a wrong body
    client.set(vk(keys[3]), bytes(body))
    client.set(mk(keys[3]), f"{len(body)}:{hashlib.blake2b(bytes(body), digest_size=16).hexdigest()}")
    full = int(client.get_node_from_key(vk(keys[0])).port)
    node = redis.Redis(port=full)
    node.config_set("maxmemory", "1")
    try:
        _, _, backend, reader, _, _ = _stack(redis_cluster.url, "test-planted", timeout=0.5)
        got = _serve(reader, prompt, 4)
    finally:
        node.config_set("maxmemory", "0")
    assert got["output"] == expected and reader.tier_counts["tier_errors"] == 0  # no wrong KV, nothing raised
    assert got["reused"] == 3 * t  # blocks 0-2 reloaded; block 3 failed its checksum, the rest was recomputed
    store = reader.kv.tier_manager.store.stats()["cluster"]
    assert store["corrupt"] == 1 and backend.error_counts["wrongtype"] == 1
    assert backend.error_counts["oom"] >= 1 and reader.tier_counts["publish_dropped"] >= 1  # the full node's writes
    assert backend.slowest_call_s < 0.5 * 10  # bounded by the timeout (generous slack for a loaded machine)


def test_second_process_reloads_the_first_ones_prefix_on_smollm2(redis_cluster, smollm2_path):
    """The same on SmolLM2-135M (the package's forward on its weights, in both processes): B reloads exactly the
    full blocks its prompt shares with A's, and its tokens equal a single-process run's."""
    from memos_ref.bench.cluster import SYSTEM_LINE, _prompt
    from memos_ref.model.tokenizer import ByteTokenizer

    r = cross_process(redis_cluster.url, "test-xp-smol", new=2, repeat=1, model_path=str(smollm2_path))
    tok = ByteTokenizer()
    a, b = _prompt(" User A: plan a trip.", tok, 1), _prompt(" User B: summarise a paper.", tok, 1)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)  # the common prefix, token by token
    assert shared > len(SYSTEM_LINE)
    assert r["distinct_pids"] and r["a"]["tiered"]["reused"] == 0
    assert r["cross_process_reused_tokens"] == 16 * (shared // 16)  # every full block of the shared prefix
    assert r["prefill_tokens_saved"] == r["cross_process_reused_tokens"] and r["tokens_identical"]
