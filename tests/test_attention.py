"""Paged attention reference = dense SDPA over K/V gathered independently by the slot formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memos_ref.attention import dense_attention, paged_attention
from memos_ref.errors import ArgumentTypeError, InvalidArgumentError, ShapeError

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def _sdpa_last(q, k, v):
    """torch's SDPA for the last Q positions of a sequence of S keys (causal with offset), GQA."""
    nq, s = q.shape[1], k.shape[1]
    allowed = torch.arange(s)[None, :] <= torch.arange(s - nq, s)[:, None]  # [Q, S]
    return F.scaled_dot_product_attention(
        q[None].float(), k[None].float(), v[None].float(), attn_mask=allowed, enable_gqa=True
    )[0]


def _random_paged(batch_lens, h, d, t, num_blocks, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(num_blocks, h, t, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, h, t, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()  # scattered, non-contiguous block ids
    max_blocks = max(-(-n // t) for n in batch_lens) or 1
    tables = torch.full((len(batch_lens), max_blocks), -1, dtype=torch.long)
    for i, n in enumerate(batch_lens):
        need = -(-n // t)
        tables[i, :need] = torch.tensor([perm.pop() for _ in range(need)], dtype=torch.long)
    return k_cache, v_cache, tables


def _gather_by_slots(cache, table, n):
    t = cache.shape[2]
    flat = cache.permute(0, 2, 1, 3).reshape(-1, cache.shape[1], cache.shape[3])  # [blocks·T, H, D]
    pos = torch.arange(n)
    return flat[table[pos // t] * t + pos % t].transpose(0, 1)  # [H, n, D]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gqa", [1, 4, 8])
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("queries", [1, 5])  # decode, chunked prefill
def test_paged_equals_dense_sdpa(dtype, gqa, block_size, queries):
    lens = [1, 7, block_size, block_size + 1, 3 * block_size - 1]
    lens = [max(n, queries) for n in lens]
    h, d = 2, 16
    k_cache, v_cache, tables = _random_paged(lens, h, d, block_size, 32, dtype, seed=gqa + block_size)
    gen = torch.Generator().manual_seed(7)
    query = torch.randn(len(lens), h * gqa, queries, d, generator=gen).to(dtype)
    out = paged_attention(query, k_cache, v_cache, tables, torch.tensor(lens))
    for i, n in enumerate(lens):
        k = _gather_by_slots(k_cache, tables[i], n)
        v = _gather_by_slots(v_cache, tables[i], n)
        expected = _sdpa_last(query[i], k, v)
        assert (out[i].float() - expected).abs().max().item() <= TOL[dtype]


def test_variable_query_lengths_and_empty_sequences():
    k_cache, v_cache, tables = _random_paged([10, 0, 4], 1, 8, 8, 8, torch.float32, seed=1)
    query = torch.randn(3, 2, 3, 8)
    out = paged_attention(query, k_cache, v_cache, tables, torch.tensor([10, 0, 4]), query_lens=torch.tensor([3, 0, 1]))
    assert torch.count_nonzero(out[1]) == 0 and torch.count_nonzero(out[2, :, 1:]) == 0
    k = _gather_by_slots(k_cache, tables[2], 4)
    v = _gather_by_slots(v_cache, tables[2], 4)
    assert torch.allclose(out[2, :, :1], _sdpa_last(query[2, :, :1], k, v), atol=1e-5)


def test_dense_attention_matches_sdpa_and_rejects_bad_shapes():
    q, k, v = torch.randn(8, 4, 16), torch.randn(2, 9, 16), torch.randn(2, 9, 16)
    assert torch.allclose(dense_attention(q, k, v), _sdpa_last(q, k, v), atol=1e-5)
    with pytest.raises(ShapeError):
        dense_attention(torch.randn(3, 1, 16), k, v)
    with pytest.raises(ShapeError):
        paged_attention(
            torch.randn(1, 2, 1, 8),
            torch.zeros(4, 1, 8, 4),
            torch.zeros(4, 1, 8, 4),
            torch.zeros(1, 1, dtype=torch.long),
            torch.tensor([1]),
        )


# ----------------------------------------------------------------------------- features (issue 13.4)
def _eager(q, k, v, *, window=None, softcap=None, sinks=None, mask=None):
    """transformers' eager attention, written out: repeat K/V per query head, softcap, mask, sinks, softmax."""
    hq, nq, d = q.shape
    h, s, _ = k.shape
    k, v = k.repeat_interleave(hq // h, 0), v.repeat_interleave(hq // h, 0)
    logits = (q @ k.transpose(-1, -2)).double() / d**0.5  # [Hq, Q, S]
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    qi, kj = torch.arange(s - nq, s)[:, None], torch.arange(s)[None, :]
    allowed = kj <= qi
    if window is not None:
        allowed = allowed & (kj > qi - window)
    if mask is not None:
        allowed = allowed & mask
    logits = logits.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        logits = torch.cat([logits, sinks.double()[:, None, None].expand(hq, nq, 1)], dim=-1)
    probs = logits.softmax(-1).nan_to_num(0.0)[..., :s]
    return (probs @ v.double()).float()


def _qkv(hq=8, h=2, nq=5, s=19, d=16, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(hq, nq, d, generator=gen) * 2,
        torch.randn(h, s, d, generator=gen) * 2,
        torch.randn(h, s, d, generator=gen),
    )


@pytest.mark.parametrize(
    "features",
    [dict(window=4), dict(softcap=1.5), dict(sinks="random"), dict(window=3, softcap=2.0, sinks="random")],
    ids=["sliding_window", "softcap", "sinks", "all"],
)
def test_dense_attention_features_match_eager_attention(features):
    q, k, v = _qkv()
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(9)) if features.get("sinks") else None
    want = _eager(q, k, v, window=features.get("window"), softcap=features.get("softcap"), sinks=sinks)
    got = dense_attention(q, k, v, sliding_window=features.get("window"), softcap=features.get("softcap"), sinks=sinks)
    assert (got - want).abs().max() < 1e-5
    assert (dense_attention(q, k, v) - want).abs().max() > 1e-2  # the feature matters at this size


def test_a_padding_mask_is_honoured_and_fully_masked_queries_give_zeros():
    q, k, v = _qkv(nq=6, s=6)
    mask = torch.ones(6, 6, dtype=torch.bool)
    mask[:, :2] = False  # two left-padding positions: queries 0 and 1 may see no key at all
    got = dense_attention(q, k, v, mask=mask)
    assert torch.isfinite(got).all() and torch.equal(got[:, :2], torch.zeros_like(got[:, :2]))
    assert (got - _eager(q, k, v, mask=mask)).abs().max() < 1e-5
    additive = torch.zeros(6, 6).masked_fill(~mask, float("-inf"))  # the same mask as float, added to logits
    assert (dense_attention(q, k, v, mask=additive).nan_to_num(0.0) - got).abs().max() < 1e-6


def test_paged_attention_with_features_equals_dense_attention_per_sequence():
    lens, t, h, d = [13, 20], 4, 2, 16
    k_cache, v_cache, tables = _random_paged(lens, h, d, t, 16, torch.float32, seed=4)
    query = torch.randn(2, 8, 3, d, generator=torch.Generator().manual_seed(5))
    mask = torch.ones(2, 1, 3, 20, dtype=torch.bool)
    mask[1, :, :, :4] = False  # row 1 is left-padded by 4
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(6))
    extras = dict(sliding_window=5, softcap=3.0, sinks=sinks)
    out = paged_attention(query, k_cache, v_cache, tables, torch.tensor(lens), mask=mask, **extras)
    for i, n in enumerate(lens):
        k, v = _gather_by_slots(k_cache, tables[i], n), _gather_by_slots(v_cache, tables[i], n)
        want = dense_attention(query[i], k, v, mask=mask[i, :, :, :n], **extras)
        assert (out[i] - want).abs().max() < 1e-6


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda q, k, v: dense_attention(q.tolist(), k, v), ArgumentTypeError, "q: expected Tensor, got list"),
        (lambda q, k, v: dense_attention(q, k, v, scale="0.1"), ArgumentTypeError, "scale: expected int or float"),
        (lambda q, k, v: dense_attention(q, k, v, sliding_window=0), InvalidArgumentError, "sliding_window"),
        (lambda q, k, v: dense_attention(q, k, v, sliding_window=2.5), ArgumentTypeError, "sliding_window"),
        (lambda q, k, v: dense_attention(q, k, v, softcap=-1.0), InvalidArgumentError, "softcap"),
        (lambda q, k, v: dense_attention(q, k, v, sinks=torch.zeros(3)), ShapeError, r"sinks: expected .*\[8\]"),
        (lambda q, k, v: dense_attention(q, k, v, mask=torch.ones(2, 2, dtype=torch.bool)), ShapeError, "mask"),
        (lambda q, k, v: dense_attention(q, k[:, :2], v[:, :2]), ShapeError, "5 queries but only 2 keys"),
        (
            lambda q, k, v: paged_attention(q[None], k[None], v[None], torch.zeros(1, 1), torch.tensor([3])),
            ArgumentTypeError,
            "block_tables: expected an integer tensor",
        ),
        (
            lambda q, k, v: paged_attention(q[None], k[None], v[None], [[0]], torch.tensor([3])),
            ArgumentTypeError,
            "block_tables: expected Tensor, got list",
        ),
    ],
)
def test_wrong_arguments_raise_the_package_errors(call, error, match):
    q, k, v = _qkv()
    with pytest.raises(error, match=match):
        call(q, k, v)


@pytest.mark.parametrize("queries", [1, 3])
def test_batched_rows_of_different_lengths_equal_each_row_alone_even_beside_poisoned_slots(queries):
    """The batched reference (rows padded to the longest, one gather) equals dense attention of each row alone,
    and NaN in every slot no row holds (unused tails of last blocks, free blocks such as block 0, which the
    padding reads) stays out of the result."""
    lens, t, h, d = [5, 37, 16, 64], 16, 2, 8
    k_cache, v_cache, tables = _random_paged(lens, h, d, t, 24, torch.float32, seed=queries)
    held = torch.zeros(24, t, dtype=torch.bool)
    for row, n in zip(tables.tolist(), lens):
        for pos in range(n):
            held[row[pos // t], pos % t] = True
    for cache in (k_cache, v_cache):
        cache.masked_fill_(~held[:, None, :, None], float("nan"))  # [N, H, T, D]
    query = torch.randn(len(lens), h * 2, queries, d, generator=torch.Generator().manual_seed(1))
    out = paged_attention(query, k_cache, v_cache, tables, torch.tensor(lens))
    assert not out.isnan().any()
    for i, n in enumerate(lens):
        k, v = _gather_by_slots(k_cache, tables[i], n), _gather_by_slots(v_cache, tables[i], n)
        torch.testing.assert_close(out[i], dense_attention(query[i], k, v), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_mixed_dtypes_are_refused_by_name_not_by_torch(which):
    """Attention of tensors in different dtypes is a DTypeError naming each dtype (it was torch's bare
    RuntimeError "expected scalar type ..."), in the dense and the paged reference alike."""
    from memos_ref.attention_reference import dense_attention, paged_attention
    from memos_ref.errors import DTypeError

    gen = torch.Generator().manual_seed(0)
    t = {"q": torch.randn(4, 1, 8, generator=gen), "k": torch.randn(2, 5, 8, generator=gen)}
    t["v"] = torch.randn(2, 5, 8, generator=gen)
    t[which] = t[which].double()
    with pytest.raises(DTypeError, match=r"expected one dtype, got .*float64"):
        dense_attention(t["q"], t["k"], t["v"])
    cache = torch.randn(3, 2, 8, 8, generator=gen)
    caches = {"q": torch.randn(1, 4, 1, 8, generator=gen), "k": cache, "v": cache.clone()}
    caches[which] = caches[which].double()
    with pytest.raises(DTypeError, match=r"expected one dtype, got .*float64"):
        paged_attention(caches["q"], caches["k"], caches["v"], torch.tensor([[0, 1]]), torch.tensor([9]))
