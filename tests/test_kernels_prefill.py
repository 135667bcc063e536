"""The prefill's mask-free main loop (issue 25 item 5): whole token tiles that every query row of a program sees
run without a causal or length mask (``full_tile``); only the diagonal tile(s) and a partial last tile take the
masked path (``tile_slots``). Counted in Triton's interpreter by wrapping both helpers, and checked against the
torch reference where the tail is a partial tile, a whole tile, or absent. Tiny fp32 shapes: head dim 16, one KV
head, group 2 — the planner's fp32 launch is a 16-token tile and 16 query positions per program."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import kernel_modules

pd, pp = kernel_modules("paged_decode", "paged_prefill")  # the whole file skips without Triton (raises in CI)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
interpreted = pytest.mark.skipif(DEVICE != "cpu", reason="counts the interpreter's calls of the jitted helpers")


@pytest.fixture
def counted(monkeypatch):
    """``{"full": n, "tail": n}``: how many whole (unmasked) and masked token tiles the prefill folded."""
    calls = {"full": 0, "tail": 0}
    full_tile, tile_slots = pp.full_tile, pp.tile_slots

    def full(*args, **kwargs):
        calls["full"] += 1
        return full_tile(*args, **kwargs)

    def tail(*args, **kwargs):
        calls["tail"] += 1
        return tile_slots(*args, **kwargs)

    monkeypatch.setattr(pp, "full_tile", full)
    monkeypatch.setattr(pp, "tile_slots", tail)
    return calls


# (length, query length, block size, whole tiles, masked tiles): QB = 16 query positions per program, 16-token
# tiles. 70/20: program 0 (first position 50) has tiles 0-47 whole and 48, 64 masked; program 1 (66) 0-63 whole
# and a partial 64-69. 64/16: the tail is one whole tile (48-63, diagonal). 48/1: the only position, 47, ends a
# tile: no masked tile at all. 40/40 at block 8: all chunk, tiles cross blocks (programs at 0, 16, 32: 0, 1 and 2
# whole tiles, one masked each).
CASES = [(70, 20, 8, 7, 3), (64, 16, 16, 3, 1), (48, 1, 8, 3, 0), (40, 40, 8, 0 + 1 + 2, 1 + 1 + 1)]


@interpreted
@pytest.mark.parametrize("n,nq,block,whole,masked", CASES, ids=str)
def test_the_prefill_masks_only_the_diagonal_and_last_tiles(counted, n, nq, block, whole, masked):
    _q, pool, tables, lens = pd.random_paged_case(n + nq, [n], kv_heads=1, group=2, head_dim=16, block_size=block)
    g = torch.Generator().manual_seed(n)
    query = torch.randn(1, 2, nq, 16, generator=g)
    qlens = torch.tensor([nq])
    assert pp.prefill_config(2, block, 16, torch.float32)[::2] == (16, 16)  # QB, TILE: the counts above
    got = pp.paged_prefill_attention(query, pool[:, 0], pool[:, 1], tables, lens, qlens)
    want = pp.paged_prefill_reference(query, pool[:, 0], pool[:, 1], tables, lens, qlens)
    assert counted == {"full": whole, "tail": masked}
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@interpreted
def test_a_query_tile_past_the_chunk_reads_nothing(counted):
    """Q = 20 rows but this sequence's chunk is 3: its second query tile (rows 16-19) has no query and folds no
    tile (before, it streamed the whole prefix for rows it never stores)."""
    _q, pool, tables, lens = pd.random_paged_case(1, [50, 50], kv_heads=1, group=2, head_dim=16, block_size=8)
    query = torch.randn(2, 2, 20, 16, generator=torch.Generator().manual_seed(1))
    qlens = torch.tensor([20, 3])
    got = pp.paged_prefill_attention(query, pool[:, 0], pool[:, 1], tables, lens, qlens)
    want = pp.paged_prefill_reference(query, pool[:, 0], pool[:, 1], tables, lens, qlens)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)
    # sequence 0: first positions 30 and 46 -> (1 whole, 2 masked: 16-31, 32-45) and (2 whole, 2 masked: 32-47,
    # 48-49); sequence 1 (positions 47-49): 3 whole, 1 masked (48-49); its second query tile: nothing
    assert counted == {"full": 1 + 2 + 3, "tail": 2 + 2 + 1}


def test_a_block_outside_the_pool_in_a_whole_tile_counts_as_absent():
    """Unvalidated metadata: sequence 0's column 1 (tokens 16-31, a whole tile for every query) holds -1 and its
    column 2 the pool's size; sequence 1 (one query at position 31) has only such ids. Those tokens are absent
    (the main loop reads block 0 instead, inside the pool, and masks them; block 0 holds keys 1,000 times larger,
    which would swamp the softmax if they entered it), never the data around the pool (NaN); sequence 1 is zeros."""
    n_blocks, t, d = 4, 16, 16
    g = torch.Generator().manual_seed(3)
    big = torch.randn(n_blocks + 2, 2, 1, t, d, generator=g)
    big[1, 0] *= 1000.0  # the pool's block 0: never read by a valid token here
    big[0], big[-1] = float("nan"), float("nan")  # around the pool: a read would poison the output
    big = big.to(DEVICE)
    pool = big[1 : n_blocks + 1]  # block -1 and block N are foreign rows of `big`
    tables = torch.tensor([[3, -1, n_blocks, 1], [-1, n_blocks, -1, n_blocks]], device=DEVICE)
    lens, qlens = torch.tensor([60, 32], device=DEVICE), torch.tensor([4, 1], device=DEVICE)
    query = torch.randn(2, 2, 4, d, generator=g).to(DEVICE)
    got = pp.paged_prefill_attention(query, pool[:, 0], pool[:, 1], tables, lens, qlens, validate=False).cpu()
    assert torch.equal(got[1], torch.zeros(2, 4, d))
    # oracle: row j of sequence 0 (position 56 + j) over the tokens of columns 0 and 3 at or before it
    keep = [tok for tok in range(60) if tok // t in (0, 3)]
    k = torch.stack([pool[tables[0, tok // t], 0, 0, tok % t].cpu() for tok in keep])  # [S, D]
    v = torch.stack([pool[tables[0, tok // t], 1, 0, tok % t].cpu() for tok in keep])
    for j in range(4):
        seen = torch.tensor([tok <= 56 + j for tok in keep])
        w = torch.softmax((query[0, :, j].cpu() @ k.T / math.sqrt(d)).masked_fill(~seen, float("-inf")), -1)
        assert torch.allclose(got[0, :, j], w @ v, atol=1e-5)
