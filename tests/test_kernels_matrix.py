"""The kernels over the hidden-shape matrix (issue 18, items 1 and 5): shuffled non-contiguous block ids, lengths
0, 1, T-1, T+1 and several blocks, GQA 1-8 (3, 6 and 7 included), head dims 64/128, blocks 8-128, fp32/fp16/bf16,
int8/fp8/KIVI, chunked prefill across blocks — every input built on the kernel's device (CUDA when present,
Triton's interpreter otherwise).

By default a representative subset runs (every value of every axis at least once, a few minutes on one CPU
core); ``MEMOS_REF_FULL_KERNELS=1`` runs the full product (``scripts/gpu_check.sh`` sets it on a GPU)."""

from __future__ import annotations

import itertools
import os

import pytest
import torch
from conftest import kernel_modules

from memos_ref.errors import DeviceError

kd, pd, wk = kernel_modules(
    "kivi_decode", "paged_decode", "write_kv"
)  # the whole file skips without Triton (raises in CI)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FULL = os.environ.get("MEMOS_REF_FULL_KERNELS") == "1"
FP8_OK = DEVICE == "cpu" or torch.cuda.get_device_capability() >= (8, 9)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
GROUPS = tuple(range(1, 9))
BLOCKS = (8, 16, 32, 64, 128)
HEAD_DIMS = (64, 128)


def hidden_lens(t: int) -> list[int]:
    """Lengths around a block of ``t`` tokens: empty, one token, T-1, T+1 and several blocks plus a bit."""
    return [0, 1, t - 1, t + 1, 3 * t + 5]


def _rotating_subset() -> list[tuple[torch.dtype, int, int, int]]:
    """Every GQA group once, dtype, block size and head dim rotating with it: each value of each axis appears."""
    return [(DTYPES[i % 3], g, BLOCKS[i % 5], HEAD_DIMS[(i // 2) % 2]) for i, g in enumerate(GROUPS)]


FULL_GROUPS, FULL_BLOCKS = (1, 3, 4, 6, 7, 8), (8, 16, 64, 128)  # 144 specializations: compiles fit the device check
DECODE_CASES = list(itertools.product(DTYPES, FULL_GROUPS, FULL_BLOCKS, HEAD_DIMS)) if FULL else _rotating_subset()


def _reference(q, pool, tables, lens, **quant):
    return pd.paged_decode_reference(q.float(), pool[:, 0], pool[:, 1], tables, lens, **quant)


@pytest.mark.parametrize("dtype,group,block,head_dim", DECODE_CASES, ids=str)
def test_decode_matrix(dtype, group, block, head_dim):
    lens = hidden_lens(block)
    q, pool, tables, seq_lens = pd.random_paged_case(
        block + group, lens, kv_heads=2, group=group, block_size=block, head_dim=head_dim, dtype=dtype, device=DEVICE
    )
    got = pd.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, seq_lens)
    want = _reference(q, pool.float(), tables, seq_lens)
    assert got.dtype == dtype and got.device.type == DEVICE
    assert torch.allclose(got.float(), want, atol=TOL[dtype], rtol=TOL[dtype]), float((got.float() - want).abs().max())
    assert torch.equal(got[0], torch.zeros_like(got[0]))  # the empty sequence gives zeros, not NaN


@pytest.mark.parametrize("tokens_per_split", [5, 16, 100, None])
def test_decode_is_the_same_for_every_split(tokens_per_split):
    """Splits of any size (odd, one tile, several tiles, the planned default) give the same output."""
    q, pool, tables, lens = pd.random_paged_case(5, [45, 0, 17], group=3, block_size=8, head_dim=64, device=DEVICE)
    got = pd.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens, tokens_per_split=tokens_per_split)
    assert torch.allclose(got, _reference(q, pool, tables, lens), atol=1e-5, rtol=1e-4)


def _int8(pool: torch.Tensor) -> tuple[torch.Tensor, dict]:
    scales = (pool.abs().amax(-1) / 127).clamp(min=1e-4).to(torch.float16)  # [N, 2, H, T]
    codes = torch.round(pool / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    return codes, {"quant": "int8", "key_scale": scales[:, 0], "value_scale": scales[:, 1]}


def _fp8(pool: torch.Tensor) -> tuple[torch.Tensor, dict]:
    scales = pool.abs().amax(dim=(-1, -2)).clamp(min=1e-4) / 448  # [N, 2, H]
    codes = (pool / scales[..., None, None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return codes, {"quant": "fp8", "key_scale": scales[:, 0].float(), "value_scale": scales[:, 1].float()}


QUANT_CASES = [("int8", 3, 8, torch.float32), ("int8", 7, 64, torch.float16), ("fp8", 6, 16, torch.float32)]
if FULL:
    QUANT_CASES += [(s, g, b, dt) for s in ("int8", "fp8") for g in (1, 4, 8) for b in (16, 128) for dt in DTYPES]


@pytest.mark.parametrize("scheme,group,block,dtype", QUANT_CASES, ids=str)
def test_quantized_decode_matrix(scheme, group, block, dtype):
    if scheme == "fp8" and not FP8_OK:
        pytest.skip("fp8 kernels need sm_89+")
    q, pool, tables, lens = pd.random_paged_case(
        group, hidden_lens(block), group=group, block_size=block, head_dim=64, device=DEVICE
    )
    codes, extras = (_int8 if scheme == "int8" else _fp8)(pool)
    q = q.to(dtype)
    got = pd.paged_decode_attention(q, codes[:, 0], codes[:, 1], tables, lens, **extras)
    want = _reference(q, codes, tables, lens, **extras)
    assert torch.allclose(got.float(), want, atol=TOL[dtype] * 2, rtol=TOL[dtype]), float(
        (got.float() - want).abs().max()
    )


KIVI_CASES = [(4, 16, 3, 32), (2, 32, 6, 64)] + ([(4, 32, 7, 128), (2, 16, 1, 16)] if FULL else [])


@pytest.mark.parametrize("bits,kivi_group,group,block", KIVI_CASES, ids=str)
def test_kivi_decode_matrix(bits, kivi_group, group, block):
    lens = hidden_lens(block)
    q, pool, tables, seq_lens = pd.random_paged_case(bits, lens, group=group, block_size=block, device=DEVICE)
    staged = (int(tables[4, 3]), int(tables[2, 0]))  # the newest block of the longest sequence, T-1's only block
    blocks = kd.random_kivi_blocks(
        bits, pool.shape[0], bits=bits, group_size=kivi_group, block_size=block, staged=staged, device=DEVICE
    )
    got = kd.paged_decode_attention_kivi_packed(q, blocks, tables, seq_lens, tokens_per_split=block)
    want = kd.paged_decode_kivi_reference(q, blocks, tables, seq_lens)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_kivi_refuses_a_slot_map_on_another_device():
    """Regression (issue 18): the KIVI wrapper copied the staging slot map to the query's device on every call
    (a host copy per step, no CUDA graph); now it must already be there, and a CPU map next to CUDA queries is
    refused. Here (CPU only) a meta-device map stands in for "another device"."""
    blocks = kd.random_kivi_blocks(0, 4, staged=(1,), device=DEVICE)
    blocks.staging_slot = torch.empty(4, dtype=torch.long, device="meta")
    q = torch.zeros(1, 4, 32, device=DEVICE)
    tables, lens = torch.tensor([[1, 2]], device=DEVICE), torch.tensor([40], device=DEVICE)
    with pytest.raises(DeviceError, match="staging"):
        kd.paged_decode_attention_kivi_packed(q, blocks, tables, lens)


def test_decode_reuses_its_workspace_and_writes_into_out():
    """Regression (issue 18): every decode call allocated its partials and NaN-filled its output. Now a
    workspace is taken once and reused (same storage call after call), and ``out`` is written in place."""
    q, pool, tables, lens = pd.random_paged_case(2, [33, 70], group=4, block_size=16, device=DEVICE)
    ws = pd.DecodeWorkspace(DEVICE)
    out = torch.empty_like(q)
    first = pd.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens, workspace=ws, out=out)
    ptr = ws.acc.data_ptr()
    second = pd.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens, workspace=ws, out=out)
    assert first is out and second is out and ws.acc.data_ptr() == ptr
    assert torch.allclose(out, _reference(q, pool, tables, lens), atol=1e-5, rtol=1e-4)


def test_the_tile_does_not_follow_the_block_size():
    """Regression (issue 18): the token tile equalled the block size (8-token tiles at block 8, below tl.dot's
    16); now it depends on head dim and dtype only, and the group is padded to 16 rows."""
    tiles = {pd.decode_config(4, t, 128, torch.float16).tile for t in (8, 16, 32, 64)}
    assert tiles == {64}
    assert (
        pd.decode_config(3, 16, 128, torch.float16).gp == 16 and pd.decode_config(1, 8, 64, torch.bfloat16).tile >= 16
    )


def test_splits_follow_lengths_and_sm_count():
    """Regression (issue 18): a fixed 512-token split whatever the batch; now enough programs fill ~2x the SMs,
    no split is shorter than a tile, and one sequence on a small GPU still gets one split."""
    splits, per = pd.plan_splits(batch=1, kv_heads=8, max_len=32768, tile=64, sms=132)
    assert 132 <= splits * 8 <= 4 * 132 and per % 64 == 0 and splits * per >= 32768
    assert pd.plan_splits(batch=64, kv_heads=8, max_len=32768, tile=64, sms=132)[0] == 1
    assert pd.plan_splits(batch=1, kv_heads=1, max_len=10, tile=64, sms=132) == (1, 64)


PREFILL_CASES = [([20, 5, 40], [4, 5, 17], 8), ([70, 1], [33, 1], 16)]


@pytest.mark.parametrize("lens,qlens,block", PREFILL_CASES, ids=str)
def test_chunked_prefill_across_blocks(lens, qlens, block):
    from memos_kernels import paged_prefill as pp

    q, pool, tables, seq_lens = pd.random_paged_case(block, lens, group=3, block_size=block, device=DEVICE)
    g = torch.Generator().manual_seed(block)
    query = torch.randn(len(lens), q.shape[1], max(qlens), 32, generator=g).to(DEVICE)
    qlens_t = torch.tensor(qlens, device=DEVICE)
    got = pp.paged_prefill_attention(query, pool[:, 0], pool[:, 1], tables, seq_lens, qlens_t)
    want = pp.paged_prefill_reference(query, pool[:, 0], pool[:, 1], tables, seq_lens, qlens_t)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("dtype,block", [(torch.float16, 8), (torch.bfloat16, 128)] + ([(torch.float32, 32)] * FULL))
def test_write_kv_matrix(dtype, block):
    """Shuffled slots (one skipped) into a poisoned pool of the given block size: equal to the reference."""
    g = torch.Generator().manual_seed(block)
    key = torch.randn(block + 3, 3, 64, generator=g).to(dtype).to(DEVICE)
    value = torch.randn(block + 3, 3, 64, generator=g).to(dtype).to(DEVICE)
    slots = torch.randperm(4 * block, generator=g)[: block + 3].to(DEVICE)
    slots[1] = -1
    pool = torch.full((4, 2, 3, block, 64), float("nan"), dtype=dtype, device=DEVICE)
    want = pool.clone()
    wk.write_kv(key, value, slots, pool[:, 0], pool[:, 1])
    wk.write_kv_reference(key, value, slots, want[:, 0], want[:, 1])
    assert torch.equal(pool.nan_to_num(7.0), want.nan_to_num(7.0))


@pytest.mark.parametrize("kivi", [False, True])
def test_one_split_writes_the_output_directly_without_a_reduce_launch(monkeypatch, kivi):
    """Issue 25 item 5: the reduce kernel ran even with one split. Now one split writes the normalized output
    itself (no reduce launch, no partials); two splits still merge through the reduce kernel."""
    launches = []
    real = pd.decode_reduce_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(pd, "decode_reduce_kernel", Counting())
    q, pool, tables, lens = pd.random_paged_case(5, [40, 0, 17], group=4, block_size=16, device=DEVICE)
    if kivi:
        blocks = kd.random_kivi_blocks(5, pool.shape[0], block_size=16, staged=(int(tables[0, 0]),), device=DEVICE)
        k, v = kd.kivi_dequantize(blocks)
        call = lambda per: kd.paged_decode_attention_kivi_packed(q, blocks, tables, lens, tokens_per_split=per)  # noqa: E731
    else:
        k, v = pool[:, 0], pool[:, 1]
        call = lambda per: pd.paged_decode_attention(q, k, v, tables, lens, tokens_per_split=per)  # noqa: E731
    want = pd.paged_decode_reference(q, k, v, tables, lens)
    one = call(64)  # the table holds 48 tokens: one split
    assert launches == [] and torch.allclose(one, want, atol=1e-4)
    assert torch.equal(one[1], torch.zeros_like(one[1]))  # the empty sequence: zeros
    two = call(32)
    assert len(launches) == 1 and torch.allclose(two, want, atol=1e-4)


def test_the_decode_tile_is_capped_at_64_for_head_dim_128():
    """Issue 25: at block size 128 the tile was forced to 128, which spills at head dim 128 (int8 116 bytes, fp8
    164 under Triton 3.6/3.9); a tile may read part of a block, so it is capped at 64 there (not at head dim 64)."""
    for dtype in (torch.float16, torch.bfloat16):
        assert pd.decode_config(4, 128, 128, dtype).tile == 64
    assert pd.decode_config(4, 128, 128, torch.float32).tile == 32  # fp32: 16 KiB of K per stage
    assert pd.decode_config(4, 128, 64, torch.float16).tile == 128
    q, pool, tables, lens = pd.random_paged_case(6, [200, 129], group=2, block_size=128, head_dim=128, device=DEVICE)
    got = pd.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens)  # tiles of half a block
    assert torch.allclose(got, _reference(q, pool, tables, lens), atol=1e-5, rtol=1e-4)
