"""Attention's sliding window on a single-query (decode) step (issue 30: a mutant that ignores the window when only
one query is asked survived, because the oracle tests use several queries and the family tests' contexts never
outgrow the window on a decode step). The oracle is written out here: softmax over exactly the last W keys."""

from __future__ import annotations

import math

import pytest
import torch

from memos_ref import attention
from memos_ref.attention import attend_sequences, dense_attention, paged_attention
from memos_ref.errors import ArgumentTypeError, InvalidArgumentError, ShapeError
from memos_ref.paged import PagedKV
from memos_ref.quant import PerTokenInt8
from memos_ref.spec import KVSpec


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


# ------------------------------------------------------------------------------------ attend_sequences (issue 30)
SPEC = KVSpec(num_layers=1, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=8, num_q_heads=4)
LENS = (10, 21)  # rows of 2 and 3 blocks: the shorter row's table is padded


def _oracle(q, k, v, *, scale=None, mask=None, sliding_window=None, softcap=None, sinks=None):
    """q [Hq, Q, D] at the newest positions over k, v [H, S, D], written out in float64 one (head, query, key) at a
    time: mask [1 or Hq, Q, S] bool (True = may attend) or float (added); a query that may see no key gets zeros."""
    hq, nq, d = q.shape
    h, s, _ = k.shape
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(hq, nq, d, dtype=torch.float64)
    for j in range(hq):
        kv = j // (hq // h)
        for i in range(nq):
            p = s - nq + i
            logits, keep = [], []
            for t in range(s):
                x = float(q[j, i].double() @ k[kv, t].double()) * scale
                if softcap is not None:
                    x = math.tanh(x / softcap) * softcap
                ok = t <= p and (sliding_window is None or t > p - sliding_window)
                if mask is not None:
                    m = mask[j if mask.shape[0] > 1 else 0, i, t]
                    if m.dtype == torch.bool:
                        ok = ok and bool(m)
                    else:
                        x += float(m)
                if ok:
                    logits.append(x)
                    keep.append(t)
            if not keep:
                continue
            top = max(logits + ([float(sinks[j])] if sinks is not None else []))
            w = [math.exp(x - top) for x in logits]
            den = sum(w) + (math.exp(float(sinks[j]) - top) if sinks is not None else 0.0)
            for x, t in zip(w, keep, strict=True):
                out[j, i] += (x / den) * v[kv, t].double()
    return out


def _sequences(kind: str):
    """Two rows (LENS tokens) in a float pool of one segment, of two segments, or a per-token int8 pool; the rows'
    blocks interleave so each table is out of order."""
    kw = {"quant": PerTokenInt8()} if kind == "int8" else {"segments": 2} if kind == "segments" else {}
    kv = PagedKV(SPEC, 12, prefix_caching=False, **kw)
    gen = torch.Generator().manual_seed(5)
    seqs = [kv.new_sequence() for _ in LENS]
    for step in range(max(LENS)):
        for seq, n in zip(seqs, LENS, strict=True):
            if step < n:
                k, v = torch.randn(2, 1, 8, generator=gen), torch.randn(2, 1, 8, generator=gen)
                seq.append(0, k, v)
    return kv, seqs


def _features(nq: int) -> dict[str, dict]:
    gen = torch.Generator().manual_seed(nq)
    per_row = torch.rand(2, 1, nq, max(LENS), generator=gen) > 0.3  # [B, 1, Q, K]: each row its own pattern
    per_row[:, :, :, 0] = True
    per_row[1, :, :, 1] = False
    shared = torch.randn(1, 4, nq, max(LENS), generator=gen)  # [1, Hq, Q, K] float, one for every row
    return {
        "plain": {},
        "scale": {"scale": 0.3},
        "bool_mask_per_row": {"mask": per_row},
        "float_mask_shared": {"mask": shared},
        "window": {"sliding_window": 3},
        "softcap": {"softcap": 0.5},
        "sinks": {"sinks": torch.tensor([0.5, -1.0, 2.0, 0.0])},
    }


@pytest.mark.parametrize("kind", ["float", "segments", "int8"])
@pytest.mark.parametrize("nq", [1, 3])
@pytest.mark.parametrize("feature", list(_features(1)))
def test_attend_sequences_equals_attention_over_each_rows_own_tokens(monkeypatch, kind, nq, feature):
    """Each row's newest ``nq`` queries attend over exactly its own tokens (read back with ``to_dense``) with the
    scale, mask (per row, or one for every row), window, softcap and sinks asked for, in any pool layout."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "reference")
    _, seqs = _sequences(kind)
    opts = _features(nq)[feature]
    query = torch.randn(2, 4, nq, 8, generator=torch.Generator().manual_seed(9))
    got = attend_sequences(query, seqs, 0, **opts)
    assert got.shape == (2, 4, nq, 8)
    for i, (seq, n) in enumerate(zip(seqs, LENS, strict=True)):
        k, v = seq.to_dense(0)
        row = dict(opts)
        if "mask" in opts:
            row["mask"] = opts["mask"][i if opts["mask"].shape[0] > 1 else 0, :, :, :n]
        torch.testing.assert_close(got[i].double(), _oracle(query[i], k, v, **row), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind, kernel_calls", [("float", 1), ("segments", 0), ("int8", 0)])
def test_only_a_plain_decode_step_of_a_one_segment_float_pool_goes_to_paged_decode(monkeypatch, kind, kernel_calls):
    """The switch: a decode step (one query per row) with no mask, window, softcap or sinks over a float pool of one
    segment is handed to ``paged_decode`` (the call a kernel replaces) once for the whole batch, with the pool's
    own K and V views; a prefill chunk, a feature, a segmented or a quantized pool never is."""
    monkeypatch.setenv("MEMOS_REF_KERNELS", "reference")
    _, seqs = _sequences(kind)
    calls = []
    real = attention.paged_decode

    def spy(query, key_cache, value_cache, tables, lens, **kw):
        calls.append((query.shape, key_cache.data_ptr(), value_cache.data_ptr(), tables.tolist(), lens.tolist()))
        return real(query, key_cache, value_cache, tables, lens, **kw)

    monkeypatch.setattr(attention, "paged_decode", spy)
    gen = torch.Generator().manual_seed(1)
    attend_sequences(torch.randn(2, 4, 1, 8, generator=gen), seqs, 0)
    assert len(calls) == kernel_calls
    if kernel_calls:
        view = seqs[0].pool.layer_view(0)
        shape, k_ptr, v_ptr, tables, lens = calls[0]
        assert shape == (2, 4, 8) and (k_ptr, v_ptr) == (view[:, 0].data_ptr(), view[:, 1].data_ptr())
        assert lens == list(LENS) and tables == [s.block_table + [-1] * (3 - s.num_blocks) for s in seqs]
    calls.clear()
    for nq, opts in ((3, {}), (1, {"sliding_window": 4}), (1, {"softcap": 1.0}), (1, {"scale": 0.5})):
        attend_sequences(torch.randn(2, 4, nq, 8, generator=gen), seqs, 0, **opts)
    assert len(calls) == (kernel_calls if kind == "float" else 0)  # only the scale-only decode step: it is plain


def test_a_decode_step_hands_paged_decode_its_tables_and_lengths_on_the_pools_device(monkeypatch):
    """On a pool that is not on the CPU (``meta`` here, a GPU in use) the block tables and lengths handed to the
    decode kernel live on the pool's device, where the kernel reads them."""
    kv = PagedKV(SPEC, 8, device="meta", prefix_caching=False)
    seq = kv.new_sequence()
    seq.append(0, torch.empty(2, 9, 8, device="meta"), torch.empty(2, 9, 8, device="meta"))
    seen = []

    def spy(query, key_cache, value_cache, tables, lens, **kw):
        seen.append((tables.device.type, lens.device.type, key_cache.device.type))
        return torch.empty(query.shape, device=query.device)

    monkeypatch.setattr(attention, "paged_decode", spy)
    out = attend_sequences(torch.empty(1, 4, 1, 8, device="meta"), [seq], 0)
    assert seen == [("meta", "meta", "meta")] and out.shape == (1, 4, 1, 8)


def test_attend_sequences_refuses_bad_arguments_by_name():
    """A non-tensor query, no sequences, a query whose batch is not the number of sequences, and (on a pool read
    row by row) a mask that is not 4-D or is shorter than the longest row: each a specific error naming the
    argument, expected vs actual."""
    _, seqs = _sequences("int8")
    q = torch.randn(2, 4, 1, 8)
    with pytest.raises(ArgumentTypeError, match=r"^query: expected Tensor, got list"):
        attend_sequences([[0.0]], seqs, 0)
    with pytest.raises(InvalidArgumentError) as info:
        attend_sequences(q, [], 0)
    assert str(info.value) == "sequences: expected at least one sequence, got none"
    for bad in (torch.randn(3, 4, 1, 8), torch.randn(2, 4, 8)):
        with pytest.raises(ShapeError) as info:
            attend_sequences(bad, seqs, 0)
        assert str(info.value) == f"query: expected [2, q_heads, queries, head_dim], got {tuple(bad.shape)}"
    for bad in (torch.zeros(2, 1, 21), torch.zeros(2, 1, 1, 20)):
        with pytest.raises(ShapeError) as info:
            attend_sequences(q, seqs, 0, mask=bad)
        assert str(info.value) == f"mask: expected [batch, heads, queries, >= 21], got {tuple(bad.shape)}"
    mask = torch.zeros(2, 1, 1, 21)  # exactly as long as the longest row: accepted
    assert attend_sequences(q, seqs, 0, mask=mask).shape == (2, 4, 1, 8)
