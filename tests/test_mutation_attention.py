"""Attention's sliding window on a single-query (decode) step (issue 30: a mutant that ignores the window when only
one query is asked survived, because the oracle tests use several queries and the family tests' contexts never
outgrow the window on a decode step). The oracle is written out here: softmax over exactly the last W keys."""

from __future__ import annotations

import math

import pytest
import torch

from memos_ref.attention import dense_attention, paged_attention


def _oracle_last_query(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
    """q [Hq, 1, D] at the newest position sees keys max(0, S - W) .. S - 1, in float64, one head at a time."""
    hq, _, d = q.shape
    h, s, _ = k.shape
    lo = 0 if window is None else max(0, s - window)
    out = torch.empty(hq, 1, d, dtype=torch.float64)
    for j in range(hq):
        kv = j // (hq // h)
        logits = (k[kv, lo:].double() @ q[j, 0].double()) / math.sqrt(d)
        out[j, 0] = logits.softmax(0) @ v[kv, lo:].double()
    return out


@pytest.mark.parametrize("s, window", [(9, 4), (9, 8), (9, 9), (9, 12), (2, 1), (17, 1)])
def test_a_decode_step_never_attends_beyond_the_window(s, window):
    """One query at the newest position sees exactly the last ``window`` keys: at s > W the older keys have no
    weight (W = s - 1 drops exactly one key, W = 1 sees only itself); at W >= s it sees every key."""
    gen = torch.Generator().manual_seed(s * 100 + window)
    q = torch.randn(4, 1, 8, generator=gen)
    k, v = torch.randn(2, s, 8, generator=gen), torch.randn(2, s, 8, generator=gen)
    got = dense_attention(q, k, v, sliding_window=window)
    torch.testing.assert_close(got.double(), _oracle_last_query(q, k, v, window), atol=1e-5, rtol=1e-5)


def test_the_keys_outside_the_window_cannot_change_a_decode_step():
    """Replacing every key and value older than the window leaves the decode step's output bit-identical."""
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(4, 1, 8, generator=gen)
    k, v = torch.randn(2, 12, 8, generator=gen), torch.randn(2, 12, 8, generator=gen)
    k2, v2 = k.clone(), v.clone()
    k2[:, :7], v2[:, :7] = 100.0, -100.0  # positions 0..6 are outside a window of 5 over 12 keys
    a = dense_attention(q, k, v, sliding_window=5)
    assert torch.equal(a, dense_attention(q, k2, v2, sliding_window=5))
    assert not torch.allclose(dense_attention(q, k, v), dense_attention(q, k2, v2))  # without the window it would


def test_a_paged_decode_step_honours_the_window_per_sequence():
    """paged_attention with one query per row and a window: each row's output is the oracle over its own last W
    tokens, for rows longer and shorter than the window."""
    gen = torch.Generator().manual_seed(3)
    block, h, hq, d, window = 4, 2, 4, 8, 6
    lens = [11, 3, 6]
    cache_k = torch.randn(12, h, block, d, generator=gen)
    cache_v = torch.randn(12, h, block, d, generator=gen)
    tables = torch.tensor([[5, 0, 9], [7, -1, -1], [2, 11, -1]])
    query = torch.randn(len(lens), hq, 1, d, generator=gen)
    out = paged_attention(query, cache_k, cache_v, tables, torch.tensor(lens), sliding_window=window)
    for i, n in enumerate(lens):
        ids = [int(b) for b in tables[i] if b >= 0]
        k = torch.cat([cache_k[b] for b in ids], dim=1)[:, :n]  # [H, n, D]
        v = torch.cat([cache_v[b] for b in ids], dim=1)[:, :n]
        want = _oracle_last_query(query[i], k, v, window)
        torch.testing.assert_close(out[i].double(), want, atol=1e-5, rtol=1e-5)
