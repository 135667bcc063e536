"""BlockPool's argument checks (check_block_table, check_kv) and a sequence's one-token bookkeeping path (the paged
area's mutation survivors): each test states what a user relies on, against an oracle worked out by hand (the
message's numbers, a registration compared with the general path's)."""

from __future__ import annotations

import re

import pytest
import torch
from torch.overrides import TorchFunctionMode

from memos_ref.errors import (
    ArgumentTypeError,
    DeviceError,
    DTypeError,
    InvalidArgumentError,
    InvalidBlockError,
    ShapeError,
)
from memos_ref.paged import BlockPool, PagedKV, block_hashes
from memos_ref.paged.pool import gather_blocks
from memos_ref.paged.prefix import MAX_TOKEN_ID
from memos_ref.paged.step import rollback
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)
FP = "model-checks"


def _table(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.long)


# ------------------------------------------------------------------------------------------------ check_block_table
def test_gather_refuses_num_tokens_past_the_table_naming_the_argument_and_its_range():
    """num_tokens beyond what the table's blocks hold (or negative) is an InvalidArgumentError naming
    ``num_tokens``, the range [0, blocks · block_size] and the value; the full range is accepted."""
    pool = BlockPool(SPEC, 4)
    with pytest.raises(InvalidArgumentError, match=rf"^num_tokens: expected an integer in \[0, {2 * T}\], got 17$"):
        pool.gather(0, _table(0, 1), 2 * T + 1)
    with pytest.raises(InvalidArgumentError, match=rf"^num_tokens: expected an integer in \[0, {2 * T}\], got -1$"):
        pool.gather(0, _table(0, 1), -1)
    with pytest.raises(ArgumentTypeError, match=r"^num_tokens: expected int, got float"):
        pool.gather(0, _table(0, 1), 1.0)
    assert pool.gather(0, _table(0, 1), 2 * T)[0].shape == (SPEC.num_kv_heads, 2 * T, SPEC.head_dim)
    assert pool.gather(0, _table(0, 1), 0)[0].shape == (SPEC.num_kv_heads, 0, SPEC.head_dim)


@pytest.mark.parametrize(
    ("table", "num_tokens", "bad"),
    [
        ((0, 4), 2 * T, [4]),  # one past the last block: the first id out of range
        ((0, -1, 3), 3 * T, [-1]),  # block 0 is a valid id, not listed
        ((1, 0, 9), 3 * T, [9]),
        ((4, 5, -1, 7, 0, -2, 8), 7 * T, [4, 5, -1, 7]),  # the message names the first four bad ids only
    ],
)
def test_gather_refuses_a_block_table_with_ids_outside_the_pool_listing_them(table, num_tokens, bad):
    """A block table holding an id outside [0, num_blocks) among the blocks num_tokens covers is an
    InvalidBlockError listing the bad ids (the first four, in table order; valid ids such as 0 are not listed) and
    the valid range, before anything is read."""
    pool = BlockPool(SPEC, 4)
    msg = rf"^block_table holds block ids {re.escape(str(bad))} outside \[0, 4\)$"
    with pytest.raises(InvalidBlockError, match=msg):
        pool.gather(1, _table(*table), num_tokens)


def test_gather_checks_only_the_blocks_num_tokens_covers():
    """Entries of the table past the blocks num_tokens needs are not read, so they need not be valid ids."""
    pool = BlockPool(SPEC, 4)
    pool.block(2).fill_(3.0)
    k, v = pool.gather(0, _table(2, 99, -5), T)
    assert torch.equal(k, torch.full((SPEC.num_kv_heads, T, SPEC.head_dim), 3.0)) and torch.equal(v, k)
    with pytest.raises(InvalidBlockError, match=r"^block_table holds block ids \[99\] outside \[0, 4\)$"):
        pool.gather(0, _table(2, 99, -5), T + 1)


# ---------------------------------------------------------------------------------------------------- gather_blocks
class _Calls(TorchFunctionMode):
    """Records the name of every torch function and tensor method called inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", str(func)))
        return func(*args, **(kwargs or {}))


def _runs_table(n: int, runs: int) -> list[int]:
    """``n`` block ids in exactly ``runs`` runs of consecutive ids (one unused id between runs)."""
    sizes = [n // runs + (i < n % runs) for i in range(runs)]
    out, b = [], 0
    for size in sizes:
        out.extend(range(b, b + size))
        b += size + 1
    return out


@pytest.mark.parametrize(
    ("n", "runs", "index_selects"),
    [(8, 8, 0), (9, 9, 1), (71, 8, 0), (72, 9, 0), (72, 10, 1), (80, 10, 0), (80, 11, 1)],
)
def test_gather_blocks_copies_run_by_run_up_to_max_8_or_n_over_8_runs_and_takes_one_index_select_beyond(
    n, runs, index_selects
):
    """gather_blocks copies a table of at most max(8, n // 8) runs of consecutive ids one strided slice per run (no
    index tensor, no intermediate copy), and a more scattered table with exactly one index_select; either way the
    result is the blocks in table order (oracle: advanced indexing)."""
    cache = torch.randn(96, 2, 1, T, 2, generator=torch.Generator().manual_seed(n + runs))  # [N, 2, H, T, D]
    blocks = _runs_table(n, runs)
    with _Calls() as calls:
        out = gather_blocks(cache, blocks)
    assert calls.names.count("index_select") == index_selects
    assert ("tensor" in calls.names) == bool(index_selects)  # the index tensor is built only for index_select
    assert torch.equal(out, cache[torch.tensor(blocks)].permute(1, 2, 0, 3, 4))  # [2, H, n, T, D]


# ------------------------------------------------------------------------------------------------------- check_kv
H, D = SPEC.num_kv_heads, SPEC.head_dim


@pytest.mark.parametrize(
    ("key", "value", "error", "message"),
    [
        ([[1.0]], torch.zeros(2, H, D), ArgumentTypeError, r"^key: expected Tensor, got list"),
        (torch.zeros(2, H, D), None, ArgumentTypeError, r"^value: expected Tensor, got NoneType"),
        (
            torch.zeros(2, H, D),
            torch.zeros(3, H, D),  # right heads and head_dim, but a different token count from key's
            ShapeError,
            r"^key/value must both be \[tokens, kv_heads=2, head_dim=4\], got \(2, 2, 4\) and \(3, 2, 4\)$",
        ),
        (
            torch.zeros(2, H, D),
            torch.zeros(2, H, D, dtype=torch.float16),  # key has the pool's dtype, value does not
            DTypeError,
            r"^key/value dtype torch\.float32/torch\.float16 does not match the pool's torch\.float32$",
        ),
        (
            torch.zeros(2, H, D, dtype=torch.float16),
            torch.zeros(2, H, D),
            DTypeError,
            r"^key/value dtype torch\.float16/torch\.float32 does not match the pool's torch\.float32$",
        ),
        (
            torch.zeros(2, H, D, device="meta"),
            torch.zeros(2, H, D, device="meta"),
            DeviceError,
            r"^key device meta does not match the pool's cpu$",
        ),
    ],
)
def test_write_refuses_key_value_the_pool_cannot_store_naming_expected_and_actual(key, value, error, message):
    """K/V a pool cannot store — not a tensor, key and value of different shapes, either of another dtype, on
    another device — is refused naming the argument or the expected and actual shape/dtype/device, and nothing is
    written."""
    pool = BlockPool(SPEC, 2)
    with pytest.raises(error, match=message):
        pool.write(0, torch.tensor([0, 1]), key, value)
    with pytest.raises(error, match=message):
        pool.check_kv(key, value)
    assert torch.count_nonzero(pool.layer_view(0)) == 0 and torch.count_nonzero(pool.layer_view(1)) == 0


# ---------------------------------------------------------------------------------- a sequence's one-token path
@pytest.mark.parametrize("ids", [{0: 7}, b"\x07"], ids=["dict", "bytes"])
def test_advance_refuses_one_element_ids_that_are_not_a_sequence_of_ints_and_changes_nothing(ids):
    """advance() takes a sequence of int ids: a one-element mapping or bytes object (whose [0] is an int) is refused
    with an ArgumentTypeError naming token_ids and the type received, and the sequence is left as it was."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance([1, 2, 3])
    with pytest.raises(
        ArgumentTypeError, match=rf"^token_ids: expected a sequence of int token ids, got {type(ids).__name__}"
    ):
        seq.advance(ids)
    assert (seq.num_tokens, seq.token_ids, seq.layer_tokens, len(seq.block_table)) == (3, [1, 2, 3], [3, 3], 1)
    kv.check()


def test_append_token_mid_step_on_a_three_layer_model_registers_the_blocks_whose_ids_were_set():
    """append_token is advance of one token, also mid-step on a model of any depth: when the last layer has not
    written the step yet, the call declares every layer written and registers the full blocks whose ids
    set_token_ids recorded meanwhile (a later lookup of that prefix hits at once)."""
    spec = KVSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)
    kv = PagedKV(spec, 4, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance([-1] * 10)  # a bookkeeping step whose ids are not known yet: nothing registered
    k = torch.zeros(2, 1, 4)  # [H, n, D]
    seq.append(0, k, k, [-1])
    seq.append(1, k, k, [-1])
    assert seq.num_tokens == 11 and seq.layer_tokens == [11, 11, 10]  # layer 2 has not written the step
    ids = list(range(100, 111))
    seq.set_token_ids(ids)
    assert seq.num_registered == 0  # mid-step: registered once every layer holds the tokens
    assert seq.append_token(7) == 11
    assert seq.layer_tokens == [12, 12, 12] and seq.token_ids == [*ids, 7]
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == [block_hashes(ids[:T], T, fingerprint=FP)[0], None]


def _rolled_back(n: int, route: str) -> tuple[PagedKV, object, list[int]]:
    """A sequence of ``n`` bookkeeping tokens (ids unknown), then a step that reserved one more token, recorded the
    ids of all ``n + 1`` with set_token_ids, and failed before any layer wrote: rolled back to ``n`` by
    ``seq.rollback_step`` or by :func:`memos_ref.paged.step.rollback` (a StepBatch's)."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance([-1] * n)
    seq.reserve(1)
    ids = list(range(100, 101 + n))
    seq.set_token_ids(ids)
    if route == "rollback_step":
        seq.rollback_step(n)
    else:
        rollback(seq, n)
    assert seq.caught_up and seq.num_tokens == n and seq.token_ids == ids[:n]
    return kv, seq, ids[:n]


@pytest.mark.parametrize("route", ["rollback_step", "step.rollback"])
@pytest.mark.parametrize("how", ["advance", "append_token", "advance_two"])
def test_a_token_appended_at_a_block_boundary_after_a_rollback_registers_the_full_blocks(how, route):
    """After a rolled-back step, the full blocks whose ids were recorded (every layer holds them) are registered by
    the next append at the latest — one token that starts a new block, by advance or append_token, or two tokens —
    as reserve + mark_written would: a lookup of that prefix then hits."""
    kv, seq, ids = _rolled_back(2 * T, route)
    if how == "advance":
        seq.advance([7])
    elif how == "append_token":
        seq.append_token(7)
    else:
        seq.advance([7, 8])
    assert seq.num_registered == 2
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == [*block_hashes(ids, T, fingerprint=FP), None]
    hit = kv.prefix_cache.lookup([*ids, 1])
    assert list(hit) == seq.block_table[:2]
    kv.allocator.free_many(hit)
    kv.check()


@pytest.mark.parametrize(
    ("how", "token", "route"),
    [
        ("advance", 7, "rollback_step"),
        ("append_token", 7, "rollback_step"),
        ("advance", 7, "step.rollback"),
        ("append_token", 7, "step.rollback"),
        ("advance", -1, "step.rollback"),
        ("advance", MAX_TOKEN_ID, "step.rollback"),
    ],
)
def test_a_token_appended_inside_the_tail_after_a_rollback_registers_the_full_blocks(how, token, route):
    """As at a block boundary: after a rolled-back step, one more token (any valid id, -1 = unknown included)
    inside the partly filled tail block finds the full blocks whose ids were recorded registered, as after advance
    of two tokens (reserve + mark_written)."""
    kv, seq, ids = _rolled_back(T + 4, route)
    if how == "advance":
        seq.advance([token])
    else:
        seq.append_token(token)
    assert seq.num_registered == 1 and seq.token_ids == [*ids, token]
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == [block_hashes(ids[:T], T, fingerprint=FP)[0], None]


def test_advance_and_mark_written_without_a_prefix_cache_keep_the_tokens_and_register_nothing():
    """With prefix caching off, declaring full blocks of known ids written (advance of several tokens, reserve +
    mark_written) keeps the tokens and indexes nothing: there is no prefix index to offer them to."""
    kv = PagedKV(SPEC, 8, prefix_caching=False)
    seq = kv.new_sequence()
    assert seq.advance(list(range(100, 120))) == range(20)
    seq.reserve(2 * T, list(range(120, 120 + 2 * T)))
    seq.mark_written()
    assert seq.num_tokens == 36 and seq.layer_tokens == [36, 36] and seq.token_ids == list(range(100, 136))
    assert seq.num_registered == 0 and not kv.allocator.indexed_blocks()
    kv.check()


def test_set_token_ids_refuses_other_ids_for_a_shared_block_a_fork_put_in_the_prefix_cache():
    """Token ids recorded for a block already in the prefix cache under other ids — put there by a fork sharing the
    block — are refused naming the positions, as for the sequence's own registered blocks, and change nothing: one
    block's K/V cannot stand for two different token sequences, and the pool's invariants keep holding."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance([-1] * T + [5])  # block 0 written while its ids were unknown: not registered
    child = seq.fork()
    child.set_token_ids(list(range(T)))  # the fork records ids: block 0 enters the index under them
    assert kv.allocator.tokens_of(seq.block_table[0]) == tuple(range(T))
    with pytest.raises(InvalidArgumentError, match=rf"^token_ids: positions 0\.\.{T - 1} lie in blocks already in"):
        seq.set_token_ids(list(range(100, 100 + T)))
    assert seq.token_ids == [-1] * T + [5] and seq.num_registered == 0
    kv.check()
