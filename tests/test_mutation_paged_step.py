"""StepBatch (one forward step's paged metadata) and PrefixCache hashing: issue 30's mutation survivors in
memos_ref/paged/step.py and memos_ref/paged/prefix.py. Each test states what a user relies on; the oracles are the
K/V tensors the test wrote (per row, token by token), the allocator's counts before a call, and block hashes written
out with hashlib (BLAKE2b-128 of parent ‖ fingerprint\\0salt ‖ the ids as little-endian signed int64)."""

from __future__ import annotations

import hashlib
from array import array

import numpy as np
import pytest
import torch

from memos_ref.errors import (
    ArgumentTypeError,
    ConfigError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    OutOfBlocksError,
    ShapeError,
    StateError,
)
from memos_ref.paged import BlockAllocator, PagedKV, PrefixCache, block_hashes
from memos_ref.paged.prefix import check_token_ids, iter_packed_hashes
from memos_ref.paged.step import StepBatch
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)
FP = "model-m"


def _kv(seed: int, rows: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random K/V ``[rows, H, n, D]`` of one step."""
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(2, rows, SPEC.num_kv_heads, n, SPEC.head_dim, generator=gen).unbind(0)
    return k, v


def _row_major(x: torch.Tensor) -> torch.Tensor:
    """``[B, H, n, D]`` as ``[B·n, H, D]``, row by row and token by token (the slot mapping's order), built by hand."""
    return torch.stack([x[b, :, t, :] for b in range(x.shape[0]) for t in range(x.shape[2])])


def _chain(ids: list[int], extra: bytes, parent: bytes = b"") -> list[bytes]:
    """The oracle: BLAKE2b-128 of parent ‖ extra ‖ int64 ids, block by block, written out with hashlib."""
    out = []
    for i in range(len(ids) // T):
        packed = b"".join(x.to_bytes(8, "little", signed=True) for x in ids[i * T : (i + 1) * T])
        parent = hashlib.blake2b(parent + extra + packed, digest_size=16).digest()
        out.append(parent)
    return out


# ---------------------------------------------------------------------------------------------- StepBatch metadata
def test_step_metadata_is_long_on_the_pools_device_whatever_torchs_default_device_is():
    """A step's slot mapping, block tables and lengths are int64 tensors on the pool's device even when torch's
    default device is another (here meta): the slots of each row's new tokens in row-major order, each row's block
    table padded with -1 to the widest, the lengths after the step; a reserved batch is not a resumed one."""
    kv = PagedKV(SPEC, 8)
    long_row, short_row = kv.new_sequence(), kv.new_sequence()
    StepBatch.reserve([long_row], T + 2).mark_written_by_kernel()  # 2 blocks, the second partly filled
    with torch.device("meta"):
        batch = StepBatch.reserve([long_row, short_row], 3)
    for tensor in (batch.slot_mapping, batch.block_tables, batch.seq_lens):
        assert tensor.device == torch.device("cpu") and tensor.dtype == torch.long
    a, b = long_row.block_table, short_row.block_table
    assert len(a) == 2 and len(b) == 1
    slots = [a[p // T] * T + p % T for p in range(T + 2, T + 5)] + [b[0] * T + p for p in range(3)]
    assert batch.slot_mapping.tolist() == slots
    assert batch.block_tables.tolist() == [a, [b[0], -1]] and batch.tables == [a, b]
    assert batch.seq_lens.tolist() == [T + 5, 3] == batch.lens and batch.starts == [T + 2, 0]
    assert batch.resumed is False


def test_a_step_of_zero_tokens_over_empty_rows_has_int64_metadata_and_writes_nothing():
    """A step of no new tokens over rows holding none: its slot mapping ``[0]`` and block tables ``[B, 0]`` are
    int64 like any other step's (usable as indices), and each layer's write of empty K/V changes no count."""
    kv = PagedKV(SPEC, 4)
    rows = [kv.new_sequence(), kv.new_sequence()]
    batch = StepBatch.reserve(rows, 0)
    assert batch.slot_mapping.dtype == torch.long and batch.slot_mapping.shape == (0,)
    assert batch.block_tables.dtype == torch.long and batch.block_tables.shape == (2, 0)
    empty = torch.zeros(2, SPEC.num_kv_heads, 0, SPEC.head_dim)
    for layer in range(SPEC.num_layers):
        batch.write(layer, empty, empty)
    assert batch.complete and [seq.layer_tokens for seq in rows] == [[0, 0], [0, 0]]
    assert kv.allocator.num_available == 4


# ---------------------------------------------------------------------------------------------- StepBatch.reserve
def test_a_step_of_no_rows_is_refused_saying_so():
    """StepBatch.reserve of no sequences is a ConfigError saying a step needs at least one."""
    with pytest.raises(ConfigError, match=r"^a step needs at least one sequence$"):
        StepBatch.reserve([], 1)


def test_a_step_over_a_row_with_a_lagging_layer_is_refused_naming_the_row_and_its_counts():
    """A row whose layers do not all hold its reserved tokens (the last step wrote layer 0 only) is refused before
    anything is reserved: a ConfigError naming the sequence, the distinct counts its layers hold and the tokens
    reserved; the other rows of the batch reserve nothing."""
    kv = PagedKV(SPEC, 8)
    other, lagging = kv.new_sequence(), kv.new_sequence()
    k, v = _kv(0, 1, 3)
    StepBatch.reserve([lagging], 3).write(0, k, v)  # layer 1 never writes
    assert lagging.layer_tokens == [3, 0]
    before = kv.allocator.stats()
    msg = (
        rf"^sequence {lagging.seq_id}: layers hold \[0, 3\] of 3 reserved tokens; a step starts only when every "
        r"layer holds every token \(roll the last step back\)$"
    )
    with pytest.raises(ConfigError, match=msg):
        StepBatch.reserve([other, lagging], 1)
    assert other.num_tokens == 0 and other.block_table == [] and kv.allocator.stats() == before


def test_a_step_that_runs_out_of_blocks_on_a_later_row_gives_back_what_every_earlier_row_took():
    """All rows or none: three rows, blocks for the first two only. The step is refused (OutOfBlocksError) and the
    first two rows are back at their own starts (the first kept its earlier tokens and block), every block they
    took is free again."""
    kv = PagedKV(SPEC, 3)
    a, b, c = kv.new_sequence(), kv.new_sequence(), kv.new_sequence()
    StepBatch.reserve([a], 2).mark_written_by_kernel()  # a holds 2 tokens in one block
    held = list(a.block_table)
    before = kv.allocator.stats()
    with pytest.raises(OutOfBlocksError):
        StepBatch.reserve([a, b, c], T)  # a: 1 block more, b: 1, c: none left
    assert a.num_tokens == 2 and a.layer_tokens == [2, 2] and a.block_table == held
    assert b.num_tokens == 0 and b.block_table == [] and c.num_tokens == 0 and c.block_table == []
    assert kv.allocator.stats() == before and kv.allocator.num_available == 2
    kv.check()


# ---------------------------------------------------------------------------------------------- StepBatch.check_kv
def _batch(kv: PagedKV, rows: int = 2, n: int = 3) -> StepBatch:
    return StepBatch.reserve([kv.new_sequence() for _ in range(rows)], n)


def test_check_kv_refuses_a_key_or_a_value_of_the_wrong_shape_alone_naming_expected_and_both_shapes():
    """K/V must both be ``[B, H, n, D]``: a key alone, or a value alone, of another shape is a ShapeError naming
    the expected shape and the two shapes received; a write refused so changes no row's counts."""
    kv = PagedKV(SPEC, 8)
    batch = _batch(kv)
    k, v = _kv(1, 2, 3)
    head = r"^key/value: expected \[batch, kv_heads, tokens, head_dim\] = \[2, 2, 3, 4\], got "
    with pytest.raises(ShapeError, match=head + r"\[2, 2, 3, 5\] and \[2, 2, 3, 4\]$"):
        batch.check_kv(torch.zeros(2, 2, 3, 5), v)
    with pytest.raises(ShapeError, match=head + r"\[2, 2, 3, 4\] and \[2, 2, 1, 4\]$"):
        batch.check_kv(k, torch.zeros(2, 2, 1, 4))
    with pytest.raises(ShapeError, match=head + r"\[1, 2, 3, 4\] and \[2, 2, 3, 4\]$"):
        batch.write(0, k[:1], v)
    assert [seq.layer_tokens for seq in batch.sequences] == [[0, 0], [0, 0]] and batch.written == [False, False]
    batch.check_kv(k, v)  # the right shapes pass


def test_check_kv_refuses_a_key_or_a_value_of_another_dtype_alone_naming_both_and_the_pools():
    """K/V must hold the pool's dtype: a key alone, or a value alone, of another dtype is a DTypeError naming the
    two dtypes received and the pool's."""
    kv = PagedKV(SPEC, 8)
    batch = _batch(kv)
    k, v = _kv(2, 2, 3)
    msg = r"^key/value dtype torch.float16/torch.float32 does not match the pool's torch.float32$"
    with pytest.raises(DTypeError, match=msg):
        batch.check_kv(k.half(), v)
    msg = r"^key/value dtype torch.float32/torch.float64 does not match the pool's torch.float32$"
    with pytest.raises(DTypeError, match=msg):
        batch.write(1, k, v.double())
    assert batch.written == [False, False]


def test_check_kv_refuses_a_key_or_a_value_on_another_device_alone():
    """K/V must live on the pool's device: a key alone on another device is a DeviceError naming that device and the
    pool's; a value alone on another device is a DeviceError too (and a write refused so changes nothing)."""
    kv = PagedKV(SPEC, 8)
    batch = _batch(kv)
    k, v = _kv(3, 2, 3)
    with pytest.raises(DeviceError, match=r"^key device meta does not match the pool's cpu$"):
        batch.check_kv(k.to("meta"), v)
    with pytest.raises(DeviceError):
        batch.check_kv(k, v.to("meta"))
    with pytest.raises(DeviceError):
        batch.write(0, k, v.to("meta"))
    assert batch.written == [False, False]


def test_check_kv_names_the_device_of_a_value_on_another_device():
    """A value on another device than the pool's: the DeviceError names that device (expected vs actual)."""
    batch = _batch(PagedKV(SPEC, 8))
    k, v = _kv(4, 2, 3)
    with pytest.raises(DeviceError, match=r"meta"):
        batch.check_kv(k, v.to("meta"))


# ---------------------------------------------------------------------------------------------- StepBatch.write
def test_each_layer_writes_once_per_step_and_the_rows_register_after_the_last_layer():
    """Every row's K/V of each layer land at its positions (its dense K/V equal what was written); a layer written
    twice in one step is a StateError naming it, with nothing changed; the step is complete, and the rows' full
    blocks are registered under the hashes of their ids, only once the last layer wrote."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    rows = [kv.new_sequence(), kv.new_sequence()]
    ids = [list(range(100, 100 + T)), list(range(200, 200 + T))]
    batch = StepBatch.reserve(rows, T)
    for seq, row_ids in zip(rows, ids):
        seq.set_token_ids(row_ids)
    k0, v0 = _kv(5, 2, T)
    batch.write(0, k0, v0)
    assert batch.written == [True, False] and not batch.complete
    assert [seq.layer_tokens for seq in rows] == [[T, 0], [T, 0]]
    assert [kv.allocator.hash_of(seq.block_table[0]) for seq in rows] == [None, None]
    with pytest.raises(StateError, match=r"^layer 0 already wrote this step$"):
        batch.write(0, *_kv(6, 2, T))
    k1, v1 = _kv(7, 2, T)
    batch.write(1, k1, v1)
    assert batch.written == [True, True] and batch.complete
    for i, seq in enumerate(rows):
        assert seq.layer_tokens == [T, T]
        for layer, (k, v) in enumerate(((k0, v0), (k1, v1))):
            dk, dv = seq.to_dense(layer)
            assert torch.equal(dk, k[i]) and torch.equal(dv, v[i])
        assert kv.allocator.hash_of(seq.block_table[0]) == _chain(ids[i], FP.encode() + b"\x00")[0]
    kv.check()


def test_a_write_refuses_a_row_freed_or_rewritten_since_the_step_was_prepared():
    """A row freed since the step was prepared (its layers still at the step's start), or whose layer another batch
    wrote meanwhile: a StateError naming the sequence, and no row's counts change."""
    kv = PagedKV(SPEC, 8)
    kept, gone = kv.new_sequence(), kv.new_sequence()
    batch = StepBatch.reserve([kept, gone], 2)
    gone.free()
    with pytest.raises(StateError, match=rf"^sequence {gone.seq_id} changed since this step was prepared$"):
        batch.write(0, *_kv(8, 2, 2))
    assert kept.layer_tokens == [0, 0] and batch.written == [False, False]
    seq = kv.new_sequence()
    step = StepBatch.reserve([seq], 2)
    StepBatch.resume([seq], 0, 2).write(0, *_kv(9, 1, 2))  # another batch writes layer 0 first
    with pytest.raises(StateError, match=rf"^sequence {seq.seq_id} changed since this step was prepared$"):
        step.write(0, *_kv(10, 1, 2))
    assert step.written == [False, False]


def test_a_write_through_a_store_hands_it_the_step_the_layer_and_the_kv_row_major():
    """``store(step, layer, k, v)`` replaces the pool store: it is called once with this step, the layer index and
    K/V as ``[B·n, H, D]`` in row-major token order (what a kernel indexing :attr:`slot_mapping` needs); the rows'
    counts then advance as after a plain write."""
    kv = PagedKV(SPEC, 8)
    rows = [kv.new_sequence(), kv.new_sequence()]
    batch = StepBatch.reserve(rows, 3)
    calls = []

    def store(step: StepBatch, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        calls.append((step, layer, k.clone(), v.clone()))

    key, value = _kv(11, 2, 3)
    batch.write(1, key, value, store=store)
    assert len(calls) == 1
    step, layer, k, v = calls[0]
    assert step is batch and layer == 1
    assert torch.equal(k, _row_major(key)) and torch.equal(v, _row_major(value))
    assert [seq.layer_tokens for seq in rows] == [[0, 3], [0, 3]] and batch.written == [False, True]


def test_a_write_to_a_pool_of_two_segments_stores_each_rows_kv_in_its_own_segment():
    """A plain pool of two segments (one block each): one row's block lies in each; every layer's write puts each
    row's K/V in its own block (its dense K/V equal what was written)."""
    kv = PagedKV(SPEC, 2, segments=2)
    rows = [kv.new_sequence(), kv.new_sequence()]
    batch = StepBatch.reserve(rows, T)
    assert sorted(seq.block_table[0] for seq in rows) == [0, 1]
    written = [_kv(12 + layer, 2, T) for layer in range(SPEC.num_layers)]
    for layer, (k, v) in enumerate(written):
        batch.write(layer, k, v)
    for i, seq in enumerate(rows):
        for layer, (k, v) in enumerate(written):
            dk, dv = seq.to_dense(layer)
            assert torch.equal(dk, k[i]) and torch.equal(dv, v[i])


# ---------------------------------------------------------------------------------------------- check_token_ids
@pytest.mark.parametrize("dtype", [torch.float32, torch.complex64, torch.bool])
def test_check_token_ids_refuses_a_tensor_of_non_integers_naming_its_dtype(dtype):
    """A tensor of floats, complex numbers or bools is no token ids: an ArgumentTypeError naming the argument and
    the tensor's dtype (not a complaint about its first element); an integer tensor of any shape is read row-major."""
    with pytest.raises(ArgumentTypeError, match=rf"^ids: expected integer token ids, got a tensor of {dtype}$"):
        check_token_ids("ids", torch.ones(3, dtype=dtype))
    assert check_token_ids("ids", torch.tensor([[1, 2], [3, -1]])) == [1, 2, 3, -1]


def test_check_token_ids_of_numpy_ints_keeps_the_unknown_id_and_refuses_one_past_int64_by_position():
    """Ids that are not plain ints (numpy integers) are converted one by one: -1 (unknown) is kept, -2 and 2**63
    (past signed int64, what hashes pack) are InvalidArgumentErrors naming the position, the range and the id."""
    out = check_token_ids("ids", [np.int64(5), np.int64(-1)])
    assert out == [5, -1] and {type(x) for x in out} == {int}
    msg = r"^ids\[1\]: expected an integer in \[-1, 9223372036854775807\], got "
    with pytest.raises(InvalidArgumentError, match=msg + r"9223372036854775808$"):
        check_token_ids("ids", [np.uint64(3), np.uint64(2**63)])
    with pytest.raises(InvalidArgumentError, match=msg + r"-2$"):
        check_token_ids("ids", [np.int64(3), np.int64(-2)])


@pytest.mark.parametrize(
    ("ids", "bad"), [([5, 2**63], 2**63), ([-1, 2**63, 3], 2**63), ([-2, 2**63], -2), ([0, -5], -5)]
)
def test_check_token_ids_names_the_id_out_of_range(ids, bad):
    """Plain int ids out of [-1, 2**63): the InvalidArgumentError names the offending id — the one below -1 if any,
    else the one past int64 (an unknown -1 beside it is not the culprit)."""
    with pytest.raises(InvalidArgumentError, match=rf"^ids: token ids must lie in \[0, 2\*\*63\) .*, got {bad}$"):
        check_token_ids("ids", ids)


# ---------------------------------------------------------------------------------------------- block hashing
def test_block_hashes_pack_ids_as_signed_int64_so_unknown_ids_hash():
    """Ids are hashed as signed 64-bit ints: a block holding unknown ids (-1) hashes as their two's complement
    bytes, like any other id (no overflow), and the largest id hashes too."""
    ids = [-1, 3, -1, 2**63 - 1, 0, 1, 2, -1]
    assert block_hashes(ids, T) == _chain(ids, b"\x00")
    assert block_hashes([*ids, *ids], T, fingerprint=FP) == _chain([*ids, *ids], FP.encode() + b"\x00")


def test_iter_packed_hashes_starts_from_no_parent_and_hashes_at_most_the_full_blocks_there_are():
    """iter_packed_hashes: without ``parent`` the chain starts from nothing (the first block of a prompt); asked
    for more blocks than the packed ids fill, it hashes the full blocks there are; asked for fewer, only those."""
    ids = list(range(40, 40 + 2 * T + 3))  # two full blocks and a partial one
    packed = array("q", ids).tobytes()
    extra = FP.encode() + b"\x00"
    whole = _chain(ids, extra)
    assert len(whole) == 2
    assert list(iter_packed_hashes(packed, T, extra)) == whole
    assert list(iter_packed_hashes(packed, T, extra, blocks=5)) == whole
    assert list(iter_packed_hashes(packed[: 16 * T], T, extra, blocks=3)) == whole
    assert list(iter_packed_hashes(packed, T, extra, blocks=1)) == whole[:1]
    assert list(iter_packed_hashes(packed[8 * T :], T, extra, whole[0], blocks=9)) == whole[1:]


# ---------------------------------------------------------------------------------------------- PrefixCache
def _prefix_cache() -> PrefixCache:
    return PrefixCache(BlockAllocator(4), T, fingerprint=FP)


def test_a_prefix_cache_checks_its_allocator_and_block_size_and_starts_with_no_fingerprint_and_no_queries():
    """PrefixCache: an allocator that is not a BlockAllocator, or a block size below 1, is refused by name with the
    value received; a block size of 1 is a cache of one-token blocks; without a fingerprint it hashes under the
    empty one (as block_hashes does); a new cache has counted nothing."""
    alloc = BlockAllocator(4)
    with pytest.raises(ArgumentTypeError, match=r"^allocator: expected BlockAllocator, got list \(\[\]\)$"):
        PrefixCache([], T)
    for bad in (0, -3):
        with pytest.raises(ConfigError, match=rf"^block_size must be positive, got {bad}$"):
            PrefixCache(alloc, bad)
    ids = list(range(70, 70 + 2 * T + 1))
    assert PrefixCache(alloc, T).hashes(ids) == _chain(ids, b"\x00") == block_hashes(ids, T)
    ones = PrefixCache(alloc, 1)
    assert ones.hashes([5, 6]) == block_hashes([5, 6], 1) and len(ones.hashes([5, 6])) == 2
    assert ones.stats() == {
        "prefix_queries": 0,
        "prefix_query_tokens": 0,
        "prefix_hit_tokens": 0,
        "prefix_hit_rate": 0.0,
        "prefix_cached_blocks": 0,
    }
    assert ones.lookup([5, 6, 7]) == [] and ones.stats()["prefix_queries"] == 1
    assert ones.stats()["prefix_query_tokens"] == 3 and ones.stats()["prefix_hit_tokens"] == 0


def test_prefix_hashes_refuse_a_salt_parent_or_packed_ids_of_the_wrong_type_by_name():
    """PrefixCache.hashes: a salt that is not a str (or None), a parent that is not bytes, packed ids that are not
    bytes — each an ArgumentTypeError naming that argument, the type expected and the value received."""
    cache, ids = _prefix_cache(), list(range(T))
    with pytest.raises(ArgumentTypeError, match=r"^cache_salt: expected str or NoneType, got int \(5\)$"):
        cache.hashes(ids, 5)
    with pytest.raises(ArgumentTypeError, match=r"^parent: expected bytes, got str \('p'\)$"):
        cache.hashes(ids, parent="p")
    with pytest.raises(ArgumentTypeError, match=r"^packed: expected bytes, got str \('x'\)$"):
        cache.hashes(ids, packed="x")


def test_prefix_hashes_mix_in_the_fingerprint_and_salt_and_continue_a_given_parent():
    """PrefixCache.hashes of ids (and of the same ids packed) are the chain under this cache's fingerprint and the
    salt; continued from ``parent`` they are the whole chain's tail (the hashes after a sequence's first block)."""
    cache = _prefix_cache()
    ids = list(range(60, 60 + 2 * T + 1))
    whole = _chain(ids, b"model-m\x00")
    assert cache.hashes(ids) == whole and len(whole) == 2
    assert cache.hashes(ids, "s") == _chain(ids, b"model-m\x00s") != whole
    assert cache.hashes(ids[T:], parent=whole[0]) == whole[1:]
    assert cache.hashes(ids[T:], None, whole[0], packed=array("q", ids[T:]).tobytes()) == whole[1:]


def test_a_lookup_refuses_a_salt_of_the_wrong_type_by_name_and_counts_nothing():
    """lookup / lookup_checked with a salt that is not a str (or None): an ArgumentTypeError naming cache_salt,
    and no query is counted."""
    cache, ids = _prefix_cache(), list(range(T + 1))
    for call in (cache.lookup, cache.lookup_checked):
        with pytest.raises(ArgumentTypeError, match=r"^cache_salt: expected str or NoneType, got bytes \(b's'\)$"):
            call(ids, b"s")
    assert cache.stats()["prefix_queries"] == 0


def test_a_lookup_of_a_prompt_with_unknown_ids_finds_nothing_and_counts_the_query():
    """A prompt whose ids include unknown ones (-1, a padded position) is looked up like any other: no block is
    found (blocks of unknown ids are never cached), the query and its tokens are counted, nothing is held."""
    alloc = BlockAllocator(4)
    cache = PrefixCache(alloc, T, fingerprint=FP)
    prompt = [-1, *range(1, 2 * T)]
    hit = cache.lookup(prompt)
    assert hit == [] and hit.chain == _chain(prompt, b"model-m\x00")[:1]
    assert cache.stats()["prefix_queries"] == 1 and cache.stats()["prefix_query_tokens"] == 2 * T
    assert alloc.num_available == 4


def test_a_salted_prompt_is_hashed_once_by_the_lookup_and_never_again_by_the_sequence_adopting_it(monkeypatch):
    """The hash chain a salted lookup computed travels with its hit (under the salt's key), so the sequence started
    from it adopts the cached blocks without hashing the prompt again: one PrefixCache.hashes call in all."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    prompt = list(range(500, 500 + 2 * T + 1))
    first = kv.new_sequence("tenant")
    first.admit(prompt)  # both full blocks registered under the salt
    calls = []
    real = PrefixCache.hashes

    def counting(self, *args, **kwargs):
        calls.append(args)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(PrefixCache, "hashes", counting)
    seq = kv.start_from_prefix(prompt, cache_salt="tenant")
    monkeypatch.undo()
    assert seq.block_table[:2] == first.block_table[:2] and seq.num_tokens == 2 * T
    assert len(calls) == 1
    hit = kv.prefix_cache.lookup(prompt, "tenant", count=False)
    assert hit.extra == kv.prefix_cache.extra_key("tenant") == b"model-m\x00tenant"
    for block in hit:
        kv.allocator.free(block)  # the lookup's references
    kv.check()
