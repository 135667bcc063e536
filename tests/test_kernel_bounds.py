"""Memory safety of the kernels (issue 25 item 1): every index a kernel derives from a block table, a slot mapping
or a length stays inside the table and the pool.

Each case is run twice: through the wrapper's check (it must refuse the metadata with a package error naming
expected and actual), and with ``validate=False`` (what a GPU caller gets without a host sync), where the kernel
must equal the *clamped* reference — tokens past the table's width, in blocks outside the pool or in staging rows
outside the slab count as absent. The pools are views into larger tensors whose extra rows hold other data, so a
read outside the pool would show (and never leaves the process's memory)."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")
from memos_kernels import triton_paged as tk
from memos_kernels.common import check_tables
from memos_kernels.copy_blocks import copy_blocks_kernel
from memos_kernels.kivi_decode import kivi_dequantize, paged_decode_attention_kivi_packed, random_kivi_blocks
from memos_kernels.write_kv import write_kv_reference

from memos_ref.errors import DTypeError, InvalidArgumentError, InvalidBlockError, ShapeError

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, GROUP, T, D, N = 1, 2, 16, 16, 6  # tiny: the interpreter runs every program in Python


def padded_pool(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(big, pool)``: a ``[N + 2, 2, H, T, D]`` tensor and its rows ``1 .. N`` — block -1 of the pool is row 0
    of ``big`` and block N its last row, both holding data that must never be read."""
    g = torch.Generator().manual_seed(seed)
    big = torch.randn(N + 2, 2, H, T, D, generator=g).to(DEVICE)
    return big, big[1 : N + 1]


def query(seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed + 100)
    return torch.randn(batch, H * GROUP, D, generator=g).to(DEVICE)


def clamped_decode_reference(
    q: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor
) -> torch.Tensor:
    """Independent oracle: each sequence over its *valid* tokens only — position below its length and below the
    table's width × T, in a block id of ``[0, N)``; zeros when none is valid."""
    n, h, t, d = k_all.shape
    out = torch.zeros(q.shape, dtype=torch.float32)
    width = tables.shape[1]
    for b in range(q.shape[0]):
        keys, values = [], []
        for tok in range(min(max(int(lens[b]), 0), width * t)):
            block = int(tables[b, tok // t])
            if 0 <= block < n:
                keys.append(k_all[block, :, tok % t].float().cpu())
                values.append(v_all[block, :, tok % t].float().cpu())
        if not keys:
            continue
        k, v = torch.stack(keys, 1), torch.stack(values, 1)  # [H, S, D]
        group = q.shape[1] // h
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        w = torch.softmax((k @ q[b].float().cpu()[:, :, None])[..., 0] / math.sqrt(d), -1)
        out[b] = (w[:, None, :] @ v)[:, 0]
    return out


# ---------------------------------------------------------------------------------------------- decode
def test_decode_refuses_lengths_past_a_short_table_and_clamps_without_validation():
    """Issue 25: a 2-column table asked for 50 tokens read 2 columns of unrelated memory (here: the 2 columns of
    the wider table it is a view of), equal to the 4-column result instead of refused or clamped."""
    _, pool = padded_pool(0)
    wide = torch.tensor([[0, 1, 2, 3]], device=DEVICE)
    table = wide[:, :2]  # width 2: capacity 32 tokens
    lens = torch.tensor([50], device=DEVICE)
    q = query(0)
    with pytest.raises(ShapeError, match=r"50 tokens, expected 0\.\.32"):
        tk.paged_decode_attention(q, pool[:, 0], pool[:, 1], table, lens, validate=True)
    with pytest.raises(ShapeError, match=r"max_seq_len 64 exceeds .* capacity 32"):
        tk.paged_decode_attention(q, pool[:, 0], pool[:, 1], table, lens, max_seq_len=64, validate=False)
    got = tk.paged_decode_attention(q, pool[:, 0], pool[:, 1], table, lens, validate=False)
    want = clamped_decode_reference(q, pool[:, 0], pool[:, 1], table, lens)
    assert torch.allclose(got.cpu(), want, atol=1e-5)


@pytest.mark.parametrize("bad_id", [-1, N, -3, 10 * N])
def test_decode_refuses_block_ids_outside_the_pool_and_masks_them_without_validation(bad_id):
    _, pool = padded_pool(1)
    tables = torch.tensor([[2, bad_id, 4], [5, 0, -1]], device=DEVICE)
    lens = torch.tensor([40, 20], device=DEVICE)
    q = query(1, batch=2)
    with pytest.raises(InvalidBlockError, match=rf"column 1 holds block id {bad_id}, expected an id in \[0, {N}\)"):
        tk.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens)
    got = tk.paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens, validate=False, tokens_per_split=16)
    want = clamped_decode_reference(q, pool[:, 0], pool[:, 1], tables, lens)
    assert torch.allclose(got.cpu(), want, atol=1e-5)


def test_decode_refuses_negative_lengths_and_gives_zeros_without_validation():
    _, pool = padded_pool(2)
    tables = torch.tensor([[0, 1]], device=DEVICE)
    lens = torch.tensor([-5], device=DEVICE)
    with pytest.raises(ShapeError, match=r"-5 tokens, expected 0\.\.32"):
        tk.paged_decode_attention(query(2), pool[:, 0], pool[:, 1], tables, lens)
    got = tk.paged_decode_attention(query(2), pool[:, 0], pool[:, 1], tables, lens, validate=False)
    assert torch.equal(got.cpu(), torch.zeros_like(got.cpu()))


def test_int8_decode_masks_a_block_outside_the_pool():
    _, pool = padded_pool(3)
    scales = (pool.abs().amax(-1) / 127).clamp(min=1e-4).to(torch.float16)  # [N, 2, H, T]
    codes = torch.round(pool / scales.float()[..., None]).clamp(-127, 127).to(torch.int8)
    big_codes = torch.zeros(N + 1, 2, H, T, D, dtype=torch.int8, device=DEVICE)
    big_codes[:N] = codes
    big_codes[N] = 100  # block N: foreign codes
    codes = big_codes[:N]
    tables = torch.tensor([[1, N]], device=DEVICE)
    lens = torch.tensor([30], device=DEVICE)
    extras = dict(quant="int8", key_scale=scales[:, 0], value_scale=scales[:, 1])
    with pytest.raises(InvalidBlockError):
        tk.paged_decode_attention(query(3), codes[:, 0], codes[:, 1], tables, lens, **extras)
    # block N's scales are outside the scale tensor too: validate=False must read neither
    got = tk.paged_decode_attention(query(3), codes[:, 0], codes[:, 1], tables, lens, validate=False, **extras)
    deq = codes.float() * scales.float()[..., None]
    want = clamped_decode_reference(query(3), deq[:, 0], deq[:, 1], tables, lens)
    assert torch.allclose(got.cpu(), want, atol=1e-4)


# ---------------------------------------------------------------------------------------------- prefill
def clamped_prefill_reference(q, k_all, v_all, tables, lens, qlens):
    """Query row j of sequence b (j < min(qlens[b], Q)) at position lens[b] - qlens[b] + j sees the valid tokens
    at or before it (valid as in :func:`clamped_decode_reference`)."""
    bsz, _hq, nq, _d = q.shape
    out = torch.zeros(q.shape, dtype=torch.float32)
    for b in range(bsz):
        for j in range(min(int(qlens[b]), nq)):
            pos = int(lens[b]) - int(qlens[b]) + j
            row = clamped_decode_reference(q[b : b + 1, :, j], k_all, v_all, tables[b : b + 1],
                                           torch.tensor([pos + 1]))  # fmt: skip
            out[b, :, j] = row[0]
    return out


def test_prefill_refuses_a_short_table_and_bad_ids_and_clamps_without_validation():
    _, pool = padded_pool(4)
    wide = torch.tensor([[0, 1, 2, 3], [4, -1, 5, 1]], device=DEVICE)
    tables = wide[:, :2]  # capacity 32 tokens
    lens = torch.tensor([40, 30], device=DEVICE)  # the first past the table, the second through a -1 column
    qlens = torch.tensor([6, 5], device=DEVICE)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, H * GROUP, 6, D, generator=g).to(DEVICE)
    with pytest.raises(ShapeError, match=r"40 tokens, expected 0\.\.32"):
        tk.paged_prefill_attention(q, pool[:, 0], pool[:, 1], tables, lens, qlens)
    with pytest.raises(InvalidBlockError, match="column 1 holds block id -1"):
        tk.paged_prefill_attention(q, pool[:, 0], pool[:, 1], tables, torch.tensor([20, 30], device=DEVICE), qlens)
    got = tk.paged_prefill_attention(q, pool[:, 0], pool[:, 1], tables, lens, qlens, validate=False)
    want = clamped_prefill_reference(q, pool[:, 0], pool[:, 1], tables, lens, qlens)
    assert torch.allclose(got.cpu(), want, atol=1e-5)


def test_prefill_never_reads_or_writes_query_rows_past_q():
    """A query length past the query tensor's Q (unchecked on a GPU) read rows of the next head and wrote the
    output past its rows; now rows past Q are neither read nor written."""
    _, pool = padded_pool(5)
    tables = torch.tensor([[0, 1]], device=DEVICE)
    lens, qlens = torch.tensor([20], device=DEVICE), torch.tensor([9], device=DEVICE)  # 9 queries, Q = 4
    g = torch.Generator().manual_seed(5)
    q_big = torch.randn(1, H * GROUP, 8, D, generator=g).to(DEVICE)
    q = q_big[:, :, :4]  # rows 4..7 of each head are foreign
    with pytest.raises(ShapeError, match="9 queries"):
        tk.paged_prefill_attention(q, pool[:, 0], pool[:, 1], tables, lens, qlens)
    out_big = torch.full((1, H * GROUP, 8, D), 7.0, device=DEVICE)
    out = out_big[:, :, :4]
    tk.paged_prefill_attention(q, pool[:, 0], pool[:, 1], tables, lens, qlens, out=out, validate=False)
    assert torch.equal(out_big[:, :, 4:].cpu(), torch.full((1, H * GROUP, 4, D), 7.0))
    want = clamped_prefill_reference(q, pool[:, 0], pool[:, 1], tables, lens, qlens)
    assert torch.allclose(out.cpu(), want, atol=1e-5)


# ---------------------------------------------------------------------------------------------- KIVI
def test_kivi_refuses_a_staging_row_outside_the_slab_and_masks_it_without_validation():
    n = 5
    blocks = random_kivi_blocks(6, n, bits=4, group_size=16, kv_heads=H, block_size=T, head_dim=D, staged=(1, 3),
                                device=DEVICE)  # fmt: skip
    k_all, v_all = kivi_dequantize(blocks)  # before the slot map is broken
    slab = blocks.staging
    big = torch.randn(slab.shape[0] + 1, *slab.shape[1:], device=DEVICE)
    big[: slab.shape[0]] = slab
    blocks.staging = big[: slab.shape[0]]  # row S of `big` is foreign
    blocks.staging_slot = blocks.staging_slot.clone()
    blocks.staging_slot[3] = slab.shape[0]  # past the slab
    tables = torch.tensor([[1, 3, 0]], device=DEVICE)
    lens = torch.tensor([40], device=DEVICE)
    q = query(6)
    with pytest.raises(InvalidBlockError, match=r"staging_slot\[3\] = 2, expected -1 \(sealed\) or 0\.\.1"):
        paged_decode_attention_kivi_packed(q, blocks, tables, lens)
    got = paged_decode_attention_kivi_packed(q, blocks, tables, lens, validate=False)
    masked = tables.clone()
    masked[0, 1] = -1  # block 3's tokens are absent
    want = clamped_decode_reference(q, k_all, v_all, masked, lens)
    assert torch.allclose(got.cpu(), want, atol=1e-4)


def test_kivi_masks_a_short_table_and_a_block_outside_the_pool():
    n = 4
    blocks = random_kivi_blocks(7, n, bits=2, group_size=16, kv_heads=H, block_size=T, head_dim=D, staged=(0,),
                                device=DEVICE)  # fmt: skip
    k_all, v_all = kivi_dequantize(blocks)
    wide = torch.tensor([[0, n, 2, 1]], device=DEVICE)
    tables, lens = wide[:, :3], torch.tensor([60], device=DEVICE)  # capacity 48; column 1 outside the pool
    with pytest.raises(ShapeError, match=r"60 tokens, expected 0\.\.48"):
        paged_decode_attention_kivi_packed(query(7), blocks, tables, lens)
    got = paged_decode_attention_kivi_packed(query(7), blocks, tables, lens, validate=False)
    want = clamped_decode_reference(query(7), k_all, v_all, tables, lens)
    assert torch.allclose(got.cpu(), want, atol=1e-4)


# ---------------------------------------------------------------------------------------------- writes, copies
@pytest.mark.parametrize("bad_slot", [N * T, N * T + 5, -2])
def test_write_refuses_slots_past_the_pool_and_never_writes_outside_it(bad_slot):
    big, pool = padded_pool(8)
    before = big.clone()
    g = torch.Generator().manual_seed(8)
    key = torch.randn(3, H, D, generator=g).to(DEVICE)
    value = torch.randn(3, H, D, generator=g).to(DEVICE)
    slots = torch.tensor([5, bad_slot, 17], device=DEVICE)
    with pytest.raises(InvalidArgumentError, match=rf"slot_mapping\[1\] = {bad_slot}, expected -1 \(skip\) or a slot"):
        tk.write_kv(key, value, slots, pool[:, 0], pool[:, 1])
    assert torch.equal(big, before)  # refused before anything changed
    tk.write_kv(key, value, slots, pool[:, 0], pool[:, 1], validate=False)
    want = before.clone()
    write_kv_reference(key, value, torch.tensor([5, -1, 17], device=DEVICE), want[1 : N + 1, 0],
                          want[1 : N + 1, 1])  # fmt: skip
    assert torch.equal(big, want)  # rows 0 and N + 1 of `big` untouched, the bad slot skipped


def test_int8_write_never_writes_outside_the_pool():
    codes_big = torch.zeros(N + 1, 2, H, T, D, dtype=torch.int8, device=DEVICE)
    scales_big = torch.zeros(N + 1, 2, H, T, dtype=torch.float16, device=DEVICE)
    codes, scales = codes_big[:N], scales_big[:N]
    key = torch.randn(2, H, D, device=DEVICE)
    slots = torch.tensor([N * T + 3, 4], device=DEVICE)
    with pytest.raises(InvalidArgumentError):
        tk.write_kv_int8(key, key, slots, codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1])
    tk.write_kv_int8(key, key, slots, codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1], validate=False)
    assert not codes_big[N].any() and not scales_big[N].any()
    assert codes[0, 0, :, 4].any()  # the good slot was written


def test_copy_kernel_copies_nothing_for_a_pair_outside_the_pool():
    """The wrapper refuses such pairs; the kernel itself must not read or write outside the pool either."""
    big = torch.arange(float((N + 1) * 64), device=DEVICE).reshape(N + 1, 64)
    pool = big[:N]
    before = big.clone()
    pairs = torch.tensor([[0, 2], [1, N], [N, 3], [-1, 4]], dtype=torch.int64, device=DEVICE)
    copy_blocks_kernel[(4, 1)](pool, pairs, 64, N, CHUNK=64)
    want = before.clone()
    want[2] = before[0]
    assert torch.equal(big, want)


# ---------------------------------------------------------------------------------------------- metadata dtypes
NOT_INTEGER = [torch.float32, torch.bool]  # truncated by .to(int64) or read as bytes: the wrong blocks, silently


@pytest.mark.parametrize("dtype", NOT_INTEGER)
def test_copy_blocks_refuses_pairs_that_are_not_integers(dtype):
    """[[0.7, 1.2]] was truncated to 0 -> 1 (and [[False, True]] too): block 1 silently overwritten."""
    pool = torch.arange(4 * 6, dtype=torch.float32, device=DEVICE).reshape(4, 6)
    before = pool.clone()
    pairs = (
        torch.tensor([[0.7, 1.2]], device=DEVICE).to(dtype)
        if dtype != torch.bool
        else torch.tensor([[False, True]], device=DEVICE)
    )
    with pytest.raises(DTypeError, match=rf"pairs must be int32 or int64, got {dtype}"):
        tk.copy_blocks(pool, pairs)
    assert torch.equal(pool, before)


def test_copy_blocks_refuses_a_destination_named_twice():
    pool = torch.arange(5 * 6, dtype=torch.float32, device=DEVICE).reshape(5, 6)
    before = pool.clone()
    with pytest.raises(InvalidArgumentError, match=r"pairs\[0\] and pairs\[1\] both copy onto block 3"):
        tk.copy_blocks(pool, torch.tensor([[0, 3], [1, 3]], device=DEVICE))
    with pytest.raises(InvalidArgumentError, match="block 3 is both a source and a destination"):
        tk.copy_blocks(pool, torch.tensor([[0, 3], [3, 4]], device=DEVICE))
    assert torch.equal(pool, before)


@pytest.mark.parametrize("dtype", NOT_INTEGER)
@pytest.mark.parametrize("validate", [True, False])
def test_write_refuses_a_slot_mapping_that_is_not_integers(dtype, validate):
    big, pool = padded_pool(9)
    before = big.clone()
    key = torch.randn(2, H, D, device=DEVICE)
    slots = torch.tensor([1, 0], device=DEVICE).to(dtype)
    with pytest.raises(DTypeError, match=rf"slot_mapping must be int32 or int64, got {dtype}"):
        tk.write_kv(key, key, slots, pool[:, 0], pool[:, 1], validate=validate)
    assert torch.equal(big, before)


def test_write_refuses_a_slot_named_twice_when_validating():
    """Two tokens onto one slot: on a GPU which write wins is undefined. -1 (skip) may repeat."""
    big, pool = padded_pool(10)
    before = big.clone()
    g = torch.Generator().manual_seed(10)
    key = torch.randn(4, H, D, generator=g).to(DEVICE)
    slots = torch.tensor([-1, 3, -1, 3], device=DEVICE)
    with pytest.raises(InvalidArgumentError, match=r"slot_mapping\[1\] and slot_mapping\[3\] both name slot 3"):
        tk.write_kv(key, key, slots, pool[:, 0], pool[:, 1], validate=True)
    assert torch.equal(big, before)
    codes = torch.zeros(N, 2, H, T, D, dtype=torch.int8, device=DEVICE)
    scales = torch.zeros(N, 2, H, T, dtype=torch.float16, device=DEVICE)
    with pytest.raises(InvalidArgumentError, match="both name slot 3"):
        tk.write_kv_int8(key, key, slots, codes[:, 0], codes[:, 1], scales[:, 0], scales[:, 1], validate=True)
    assert not codes.any() and not scales.any()
    tk.write_kv(key, key, torch.tensor([-1, 3, -1, 4], device=DEVICE), pool[:, 0], pool[:, 1], validate=True)
    assert torch.equal(pool[0, 0, :, 3], key[1]) and torch.equal(pool[0, 0, :, 4], key[3])


@pytest.mark.parametrize("dtype", NOT_INTEGER)
@pytest.mark.parametrize("which", ["block_tables", "seq_lens", "query_lens"])
def test_prefill_refuses_metadata_that_is_not_integers(dtype, which):
    _, pool = padded_pool(11)
    meta = {
        "block_tables": torch.tensor([[0, 1]], device=DEVICE),
        "seq_lens": torch.tensor([1], device=DEVICE),
        "query_lens": torch.tensor([1], device=DEVICE),
    }
    meta[which] = meta[which].to(dtype)
    q = torch.randn(1, H * GROUP, 2, D, device=DEVICE)
    for validate in (True, False):
        with pytest.raises(DTypeError, match=rf"{which} must be int32 or int64, got {dtype}"):
            tk.paged_prefill_attention(q, pool[:, 0], pool[:, 1], **meta, validate=validate)


@pytest.mark.parametrize("dtype", NOT_INTEGER)
@pytest.mark.parametrize("which", ["block_tables", "seq_lens"])
def test_decode_refuses_metadata_that_is_not_integers(dtype, which):
    _, pool = padded_pool(12)
    meta = {"block_tables": torch.tensor([[0, 1]], device=DEVICE), "seq_lens": torch.tensor([1], device=DEVICE)}
    meta[which] = meta[which].to(dtype)
    with pytest.raises(DTypeError, match=rf"{which} must be int32 or int64, got {dtype}"):
        tk.paged_decode_attention(query(12), pool[:, 0], pool[:, 1], meta["block_tables"], meta["seq_lens"],
                                  validate=False)  # fmt: skip
    with pytest.raises(DTypeError, match=rf"{which} must be int32 or int64"):
        check_tables(meta["block_tables"], meta["seq_lens"], N, T)


@pytest.mark.parametrize("dtype", NOT_INTEGER)
def test_kivi_refuses_a_staging_slot_map_that_is_not_integers(dtype):
    blocks = random_kivi_blocks(13, 3, bits=4, group_size=16, kv_heads=H, block_size=T, head_dim=D, staged=(1,),
                                device=DEVICE)  # fmt: skip
    blocks.staging_slot = blocks.staging_slot.to(dtype)
    tables, lens = torch.tensor([[0, 1]], device=DEVICE), torch.tensor([20], device=DEVICE)
    with pytest.raises(DTypeError, match=rf"staging_slot must be int32 or int64, got {dtype}"):
        paged_decode_attention_kivi_packed(query(13), blocks, tables, lens, validate=False)


# ---------------------------------------------------------------------------------------------- device placement
class RecordingKernel:
    """Stands in for a Triton kernel: ``kernel[grid](*args, **kwargs)`` records the tensors it was handed."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.tensors += [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]

        return launch


def test_a_kivi_pool_hands_the_kernel_only_tensors_on_its_device(monkeypatch):
    """Issue 25: the quantized pool kept ``staging_slot`` on the CPU and ``paged_decode_attention_kivi(pool)``
    passed it to the wrapper, which raised DeviceError on CUDA. A pool on the ``meta`` device shows it without a
    GPU: every tensor of ``kernel_args`` and every tensor the kernel is launched with lives on the pool's device."""
    from memos_kernels import kivi_decode, paged_decode

    from memos_ref.quant import KIVI
    from memos_ref.quant.pool import QuantizedBlockPool
    from memos_ref.spec import KVSpec

    spec = KVSpec(num_layers=2, num_kv_heads=H, head_dim=D, block_size=T, dtype=torch.float32)
    pool = QuantizedBlockPool(spec, 4, KIVI(bits=4, group_size=16), device="meta")
    args = pool.kernel_args(1)
    assert {"staging", "staging_slot"} <= set(args)
    assert {k: v.device.type for k, v in args.items() if isinstance(v, torch.Tensor)} == {
        k: "meta" for k, v in args.items() if isinstance(v, torch.Tensor)
    }
    split, reduce = RecordingKernel(), RecordingKernel()
    monkeypatch.setattr(kivi_decode, "decode_kivi_split_kernel", split)
    monkeypatch.setattr(paged_decode, "decode_reduce_kernel", reduce)
    q = torch.empty(2, H * GROUP, D, device="meta")
    tables = torch.empty(2, 3, dtype=torch.long, device="meta")
    lens = torch.empty(2, dtype=torch.long, device="meta")
    kivi_decode.paged_decode_attention_kivi(q, pool, 0, tables, lens)
    handed = split.tensors + reduce.tensors
    assert handed and all(t.device.type == "meta" for t in handed), [t.device for t in handed]


def test_the_device_slot_map_follows_the_host_map():
    """The kernels' copy of the staging slot map is refreshed after staging and sealing (one tensor for the
    pool's life), and equals the host's map."""
    from memos_ref.quant import KIVI
    from memos_ref.quant.pool import QuantizedBlockPool
    from memos_ref.spec import KVSpec

    spec = KVSpec(num_layers=1, num_kv_heads=H, head_dim=D, block_size=T, dtype=torch.float32)
    pool = QuantizedBlockPool(spec, 4, KIVI(bits=4, group_size=16), residual_tokens=16, staging_blocks=2)
    mirror = pool.device_staging_slot
    kv = torch.randn(T, H, D)
    pool.write(0, torch.arange(2 * T, 3 * T), kv, kv)  # block 2 staged
    assert pool.device_staging_slot is mirror and torch.equal(mirror.cpu(), pool.staging_slot)
    assert int(mirror[2]) >= 0
    pool.seal([2])
    assert torch.equal(pool.kernel_args(0)["staging_slot"].cpu(), pool.staging_slot) and int(mirror[2]) == -1
