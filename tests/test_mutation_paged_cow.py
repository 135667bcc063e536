"""Adopting a prefix, and a write the pool refuses (issue 30's survivors of sequence_cow.py and sequence_writes.py).

adopt_prefix: every refusal names what was wrong and leaves the sequence empty and the offered blocks with the
caller; a plain list of block ids is adopted like a lookup's hit (the chain is then hashed from the token ids);
over a pool without residual windows the state is the one admit leaves. append: a write that fails gives back
what that layer reserved, and only that. Oracles: block_hashes() of the tokens, refcounts counted by hand, the
K/V tensors the test wrote.
"""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import (
    ArgumentTypeError,
    ConfigError,
    InvalidArgumentError,
    InvalidBlockError,
    ShapeError,
    StateError,
)
from memos_ref.paged import PagedKV, block_hashes
from memos_ref.paged.prefix import PrefixHit
from memos_ref.spec import KVSpec

T = 8
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=T)
FP = "model-cow"


def _prefix_holder(kv, ids):
    """A live sequence holding ``ids`` (its full blocks registered in the prefix index)."""
    other = kv.new_sequence()
    other.advance(list(ids))
    return other


def _refcounts(kv):
    return list(kv.allocator.refcount)


# ---------------------------------------------------------------------------------------------- adopt_prefix
def test_adopt_prefix_on_a_sequence_that_holds_tokens_is_refused_naming_them_and_changes_nothing():
    """Only an empty sequence can start from a prefix: one holding 5 tokens is refused with a StateError naming
    them; its blocks, the offered blocks' references and the index are as before."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    holder = _prefix_holder(kv, range(100, 108))
    hit = kv.prefix_cache.lookup([*range(100, 108), 1])
    assert list(hit) == holder.block_table  # the lookup took one more reference on the holder's block
    seq = kv.new_sequence()
    seq.advance([1, 2, 3, 4, 5])
    table, refs = list(seq.block_table), _refcounts(kv)
    with pytest.raises(StateError, match=r"^a prefix can only be adopted by an empty sequence; this one holds 5$"):
        seq.adopt_prefix(hit, [*range(100, 108), 1])
    assert seq.num_tokens == 5 and seq.block_table == table and seq.token_ids == [1, 2, 3, 4, 5]
    assert _refcounts(kv) == refs and refs[holder.block_table[0]] == 2
    kv.allocator.free_many(hit)  # the refused references are still the caller's to give back
    kv.check()


@pytest.mark.parametrize(("blocks", "name"), [(0, "int"), ("01", "str"), (b"\x00\x01", "bytes"), ({0}, "set")])
def test_adopt_prefix_refuses_blocks_that_are_not_a_sequence_of_ids_naming_their_type(blocks, name):
    """``blocks`` must be a sequence of block ids (a lookup's result); an int, a string, bytes or a set is refused
    naming the argument and the type given, and the sequence stays empty."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    kv.allocator.allocate(2)
    seq = kv.new_sequence()
    with pytest.raises(ArgumentTypeError, match=rf"^blocks: expected a sequence of block ids, got {name}$"):
        seq.adopt_prefix(blocks, list(range(16)))
    assert seq.num_tokens == 0 and seq.block_table == [] and _refcounts(kv) == [1, 1, 0, 0]


@pytest.mark.parametrize(
    ("token_ids", "error", "message"),
    [
        (5, ArgumentTypeError, r"^token_ids: expected a sequence of int token ids, got int \(5\)$"),
        ("abcdefgh", ArgumentTypeError, r"^token_ids: expected a sequence of int token ids, got str"),
        ([*range(7), "x"], ArgumentTypeError, r"^token_ids\[7\]: expected int, got str"),
        ([*range(7), -2], InvalidArgumentError, r"^token_ids: token ids must lie in \[0, 2\*\*63\) .* got -2$"),
        ([*range(7), 2**63], InvalidArgumentError, r"^token_ids: token ids must lie in .* got 9223372036854775808$"),
    ],
)
def test_adopt_prefix_refuses_bad_token_ids_naming_token_ids_and_changes_nothing(token_ids, error, message):
    """Token ids that are not a sequence of ints in [-1, 2**63) are refused naming ``token_ids`` (and the bad
    position); the sequence stays empty and the offered block keeps only the caller's reference."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    (block,) = kv.allocator.allocate(1)
    seq = kv.new_sequence()
    with pytest.raises(error, match=message):
        seq.adopt_prefix([block], token_ids)
    assert seq.num_tokens == 0 and seq.block_table == [] and seq.token_ids == []
    assert _refcounts(kv)[block] == 1


@pytest.mark.parametrize(("num_blocks", "given"), [(1, 0), (1, 7), (2, 15)])
def test_adopt_prefix_with_fewer_token_ids_than_its_blocks_hold_is_refused_naming_both(num_blocks, given):
    """k blocks hold k * T tokens, so they need k * T token ids: fewer are refused with a ShapeError naming the
    blocks, the ids needed and the ids given; nothing changes."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    blocks = kv.allocator.allocate(num_blocks)
    seq = kv.new_sequence()
    need = num_blocks * T
    with pytest.raises(ShapeError, match=rf"^{num_blocks} blocks need {need} token ids, got {given}$"):
        seq.adopt_prefix(blocks, list(range(given)))
    assert seq.num_tokens == 0 and seq.block_table == []
    assert _refcounts(kv) == [1] * num_blocks + [0] * (4 - num_blocks)


@pytest.mark.parametrize("extra", [0, 1, 5])
def test_adopt_prefix_keeps_exactly_the_tokens_its_blocks_hold(extra):
    """With k blocks, exactly k * T token ids are enough; ids past them (the prompt's rest) are not adopted: the
    sequence holds k * T tokens in every layer, the first k * T ids, and reads the adopted blocks' K/V."""
    kv, gen = PagedKV(SPEC, 8, fingerprint=FP), torch.Generator().manual_seed(5)
    ids = list(range(200, 216 + extra))
    writer = kv.new_sequence()
    dense = []
    for layer in range(SPEC.num_layers):
        k = torch.randn(2, 16, 4, generator=gen)
        writer.append(layer, k, -k, ids[:16])
        dense.append(k)
    blocks = list(writer.block_table)
    for b in blocks:
        kv.allocator.incref(b)  # the reference the new sequence takes over (as a lookup's)
    seq = kv.new_sequence()
    seq.adopt_prefix(blocks, ids)
    assert seq.num_tokens == 16 and seq.layer_tokens == [16, 16] and seq.token_ids == ids[:16]
    assert seq.block_table == blocks and [kv.allocator.refcount[b] for b in blocks] == [2, 2]
    for layer in range(SPEC.num_layers):
        k, v = seq.to_dense(layer)
        assert torch.equal(k, dense[layer]) and torch.equal(v, -dense[layer])
    kv.check()


@pytest.mark.parametrize("kind", ["lookup hit", "plain list", "hit of another salt"])
def test_a_sequence_started_from_adopted_blocks_registers_its_next_blocks_under_the_chain_of_its_tokens(kind):
    """Whatever carries the block ids — a lookup's hit (with its hash chain), a plain list, or a hit whose chain
    was hashed under another salt — the sequence's next full blocks are registered under the chained hashes of
    its own token ids (block_hashes), so a later prompt with those ids finds every block."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    prompt = list(range(300, 340))  # 5 blocks
    holder = _prefix_holder(kv, prompt[:16])
    if kind == "hit of another salt":  # the right blocks with a chain the sequence must not carry
        salted = kv.prefix_cache.lookup_checked(prompt, "tenant-b")
        blocks = PrefixHit(list(holder.block_table), salted.chain, salted.extra, prompt)
        for b in blocks:
            kv.allocator.incref(b)
    else:
        blocks = kv.prefix_cache.lookup(prompt)
        assert list(blocks) == holder.block_table
        if kind == "plain list":
            blocks = list(blocks)
    seq = kv.new_sequence()
    seq.adopt_prefix(blocks, prompt)
    assert seq.num_tokens == 16 and seq.num_registered == 2
    seq.advance(prompt[16:])
    want = block_hashes(prompt, T, fingerprint=FP)
    assert [kv.allocator.hash_of(b) for b in seq.block_table] == want
    again = kv.prefix_cache.lookup([*prompt, 1])
    assert list(again) == seq.block_table
    kv.allocator.free_many(again)
    kv.check()


def test_a_hit_adopted_without_a_prefix_cache_is_plain_block_ids():
    """Over a PagedKV without prefix caching, a PrefixHit is only its block ids: adopted like a list, nothing is
    registered, and the sequence goes on writing after the prefix."""
    kv = PagedKV(SPEC, 8, fingerprint=FP, prefix_caching=False)
    blocks = kv.allocator.allocate(2)
    ids = list(range(16))
    hit = PrefixHit(blocks, block_hashes(ids, T, fingerprint=FP), b"model-cow\x00", ids)
    seq = kv.new_sequence()
    seq.adopt_prefix(hit, [*ids, 99])
    assert seq.block_table == blocks and seq.num_tokens == 16 and seq.token_ids == ids
    seq.advance(list(range(16, 24)))
    assert seq.num_tokens == 24 and len(seq.block_table) == 3 and kv.allocator.num_indexed == 0
    kv.check()


@pytest.mark.parametrize("prompt_len", [9, 17, 30])
def test_adopt_and_advance_over_a_plain_pool_leave_the_state_admit_leaves_window_start_included(prompt_len):
    """Over a pool without residual windows no block is ever read at reduced precision, so every block lies
    'inside the window': window_start is 0 after adopt_prefix, exactly as admit (which never sets it) leaves
    it — with the same table, ids and registered blocks."""

    def run(fused):
        kv = PagedKV(SPEC, 16, fingerprint=FP)
        _prefix_holder(kv, range(prompt_len + 8))  # a longer prompt sharing this one's blocks
        seq = kv.new_sequence()
        prompt = list(range(prompt_len))
        if fused:
            seq.admit(prompt)
        else:
            seq.adopt_prefix(kv.prefix_cache.lookup(prompt), prompt)
            assert seq.window_start == 0 and seq.num_tokens == (prompt_len - 1) // T * T
            seq.advance(prompt[seq.num_tokens :])
        kv.check()
        child = seq.fork()
        return (
            seq.block_table,
            seq.token_ids,
            seq.layer_tokens,
            seq.num_registered,
            seq.window_start,
            child.window_start,
        )

    fused = run(True)
    assert fused[4:] == (0, 0)
    assert run(False) == fused


# ---------------------------------------------------------------------------------------------- append failures
class _FailOnce:
    """pool.write that raises a raw error (a device fault) the first time layer ``layer`` is written."""

    def __init__(self, pool, layer):
        self.real, self.layer, self.failed = pool.write, layer, False

    def __call__(self, layer, slots, key, value):
        if layer == self.layer and not self.failed:
            self.failed = True
            raise RuntimeError("device lost")
        return self.real(layer, slots, key, value)


def _written_sequence(kv, n, gen):
    """A sequence holding ``n`` tokens in both layers; returns it and each layer's K written [H, n, D]."""
    seq = kv.new_sequence()
    ks = [torch.randn(2, n, 4, generator=gen) for _ in range(SPEC.num_layers)]
    for layer, k in enumerate(ks):
        seq.append(layer, k, k + 1, list(range(n)))
    return seq, ks


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("start", [5, 8])  # inside the tail block / at a block boundary (a new block)
def test_a_failed_write_of_the_layer_that_reserved_the_step_gives_it_back(monkeypatch, start, n):
    """The first layer of a step reserves its slots; when its write fails (a raw device error here) the step is
    given back — a one-token decode step included: the sequence holds its old tokens in every layer, the
    allocator has every block back, the K/V read are the old ones, and the same step then succeeds."""
    kv, gen = PagedKV(SPEC, 16, fingerprint=FP), torch.Generator().manual_seed(start * 10 + n)
    seq, ks = _written_sequence(kv, start, gen)
    table, available = list(seq.block_table), kv.allocator.num_available
    monkeypatch.setattr(kv.pool, "write", _FailOnce(kv.pool, 0))
    new = torch.randn(2, n, 4, generator=gen)
    msg = rf"^writing {n} tokens of layer 0 failed: .*\(device lost\); nothing was kept$"
    with pytest.raises(StateError, match=msg):
        seq.append(0, new, new + 1, list(range(start, start + n)))
    assert seq.num_tokens == start and seq.layer_tokens == [start, start]
    assert seq.block_table == table and kv.allocator.num_available == available
    assert seq.token_ids == list(range(start))
    for layer in range(SPEC.num_layers):
        assert torch.equal(seq.to_dense(layer)[0], ks[layer])
    kv.check()
    for layer in range(SPEC.num_layers):  # the device is back: the step goes through
        seq.append(layer, new, new + 1, list(range(start, start + n)))
    assert seq.num_tokens == start + n and len(seq.block_table) == -(-(start + n) // T)
    assert torch.equal(seq.to_dense(1)[0], torch.cat([ks[1], new], dim=1))
    kv.check()


@pytest.mark.parametrize("n", [1, 3])
def test_a_failed_write_of_a_later_layer_keeps_the_step_the_earlier_layers_wrote(monkeypatch, n):
    """A layer that writes slots an earlier layer reserved gives back nothing when its write fails: the step
    stays as the earlier layers left it (layer 0 holds the new tokens, layer 1 not), so that layer can be written
    again to finish the step — or the step undone with rollback_step."""
    kv, gen = PagedKV(SPEC, 16, fingerprint=FP), torch.Generator().manual_seed(40 + n)
    seq, ks = _written_sequence(kv, 8, gen)
    monkeypatch.setattr(kv.pool, "write", _FailOnce(kv.pool, 1))
    new = [torch.randn(2, n, 4, generator=gen) for _ in range(SPEC.num_layers)]
    ids = list(range(8, 8 + n))
    seq.append(0, new[0], new[0] + 1, ids)
    table, available = list(seq.block_table), kv.allocator.num_available
    assert len(table) == 2
    with pytest.raises(StateError, match=rf"^writing {n} tokens of layer 1 failed: .*; nothing was kept$"):
        seq.append(1, new[1], new[1] + 1, ids)
    assert seq.num_tokens == 8 + n and seq.layer_tokens == [8 + n, 8]
    assert seq.block_table == table and kv.allocator.num_available == available
    seq.append(1, new[1], new[1] + 1, ids)  # layer 1 again: the step completes
    assert seq.layer_tokens == [8 + n, 8 + n] and seq.token_ids == list(range(8 + n))
    for layer in range(SPEC.num_layers):
        k, v = seq.to_dense(layer)
        want = torch.cat([ks[layer], new[layer]], dim=1)
        assert torch.equal(k, want) and torch.equal(v, want + 1)
    kv.check()


# ---------------------------------------------------------------------------------------------- blocks_needed, fork
@pytest.mark.parametrize(
    ("n", "error", "message"),
    [
        ("1", ArgumentTypeError, r"^n: expected int, got str"),
        (1.0, ArgumentTypeError, r"^n: expected int, got float"),
        (-1, InvalidArgumentError, r"^n: expected an integer in >= 0, got -1$"),
    ],
)
def test_blocks_needed_refuses_a_bad_count_naming_n(n, error, message):
    """blocks_needed(n) takes a token count n >= 0; anything else is refused naming ``n`` and the value."""
    kv = PagedKV(SPEC, 4, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance(list(range(5)))
    with pytest.raises(error, match=message):
        seq.blocks_needed(n)
    assert seq.blocks_needed(0) == 0 and seq.blocks_needed(3) == 0 and seq.blocks_needed(4) == 1


def test_fork_in_the_middle_of_a_model_step_is_refused_and_creates_nothing():
    """A fork copies every layer's length, so it is refused while layers hold different lengths (layer 0 wrote
    this step, layer 1 not yet): ConfigError saying why; no sequence is made, no reference taken."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    seq.advance(list(range(10)))
    k = torch.ones(2, 3, 4)
    seq.append(0, k, k, [10, 11, 12])
    refs, live = _refcounts(kv), dict(kv.sequences)
    with pytest.raises(
        ConfigError, match=r"^cannot fork in the middle of a model step \(layers hold different lengths\)$"
    ):
        seq.fork()
    assert _refcounts(kv) == refs and kv.sequences == live and seq.layer_tokens == [13, 10]
    seq.append(1, k, k)
    assert seq.fork().layer_tokens == [13, 13]
    kv.check()


@pytest.mark.parametrize("salt", [None, "tenant-a"])
def test_a_fork_registers_the_blocks_it_fills_in_the_prefix_cache_under_its_parents_salt(salt):
    """A forked sequence is a full sequence of the same tenant: the blocks it fills are registered in the same
    prefix cache under the chained hashes of its ids with its parent's salt (block_hashes), so that tenant's next
    prompt reuses them and no other tenant's does."""
    kv = PagedKV(SPEC, 16, fingerprint=FP)
    parent = kv.new_sequence(cache_salt=salt)
    parent.advance(list(range(12)))  # block 0 full, 4 tokens in the tail
    child = parent.fork()
    assert child.cache_salt == salt
    child.advance(list(range(12, 20)))  # the shared tail is copied, then fills; block 2 holds 4 tokens
    ids = list(range(20))
    want = block_hashes(ids, T, fingerprint=FP, cache_salt=salt)
    assert [kv.allocator.hash_of(b) for b in child.block_table[:2]] == want
    hit = kv.prefix_cache.lookup([*ids[:16], 99], salt)
    assert list(hit) == child.block_table[:2]
    kv.allocator.free_many(hit)
    other = "tenant-z" if salt is None else None
    assert list(kv.prefix_cache.lookup([*ids[:16], 99], other)) == []
    kv.check()


def test_a_fork_of_a_sequence_started_from_a_prefix_hashes_none_of_the_prompt_again(monkeypatch):
    """The lookup that started a sequence hashed every full block of its prompt once; a fork taken before the
    prompt's remaining blocks are written carries those hashes, so when the fork writes them only the block
    past the lookup's reach (the last, which held the token the lookup left) is hashed — and every block is
    registered under block_hashes of the prompt."""
    import hashlib

    kv = PagedKV(SPEC, 32, fingerprint=FP)
    ids = list(range(500, 580))  # 10 blocks
    _prefix_holder(kv, ids[:48]).free()  # 6 blocks cached
    seq = kv.start_from_prefix(ids)  # the lookup hashes blocks 0..8; 6 of them are hits
    assert seq.num_tokens == 48
    child = seq.fork()
    calls = {"n": 0}
    real = hashlib.blake2b

    def counting(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(hashlib, "blake2b", counting)
    child.advance(ids[48:])  # blocks 6..9 become full
    assert calls["n"] == 1  # block 9 only
    monkeypatch.undo()
    assert [kv.allocator.hash_of(b) for b in child.block_table] == block_hashes(ids, T, fingerprint=FP)
    kv.check()


# ---------------------------------------------------------------------------------------------- copy-on-write
def _bookkept(kv, n, forks=0):
    """A sequence holding ``n`` tokens with no ids (never indexed), and ``forks`` live forks of it."""
    seq = kv.new_sequence()
    seq.reserve(n)
    seq.mark_written()
    return seq, [seq.fork() for _ in range(forks)]


def _scenario(kv, name):
    if name == "empty":
        return _bookkept(kv, 0)[0]
    if name == "private partial tail":
        return _bookkept(kv, 12)[0]
    if name == "full tail shared":
        return _bookkept(kv, 16, forks=1)[0]
    if name == "partial tail shared by two":
        return _bookkept(kv, 12, forks=1)[0]
    if name == "partial tail shared by three":
        return _bookkept(kv, 12, forks=2)[0]
    seq = kv.new_sequence()  # "partial tail indexed": a registered block made a partial tail again
    seq.advance(list(range(100, 124)))
    seq.truncate(20)
    return seq


@pytest.mark.parametrize("n", [1, 3, 4, 13])
@pytest.mark.parametrize(
    "name",
    [
        "empty",
        "private partial tail",
        "full tail shared",
        "partial tail shared by two",
        "partial tail shared by three",
        "partial tail indexed",
    ],
)
def test_blocks_needed_is_exactly_what_reserve_then_takes_from_the_allocator(name, n):
    """An admission check trusts blocks_needed(n): it is the number of blocks reserve(n) then allocates — the new
    blocks for the tokens past the table, plus one for copying a partly filled tail that another sequence shares
    or the prefix index holds (a full shared tail, an empty sequence or a private tail need no copy)."""
    kv = PagedKV(SPEC, 32, fingerprint=FP)
    seq = _scenario(kv, name)
    start, before = seq.num_tokens, list(seq.block_table)
    copy = start % T != 0 and (kv.allocator.refcount[before[-1]] > 1 or kv.allocator.hash_of(before[-1]) is not None)
    want = -(-(start + n) // T) - len(before) + copy
    assert seq.blocks_needed(n) == want
    seq.reserve(n)
    assert len(set(seq.block_table) - set(before)) == want  # every block new to the table was allocated for it
    assert seq.cow_copies == copy
    kv.check()


def _write(seq, n, gen, dense):
    """Append ``n`` random tokens to every layer of ``seq`` and to its dense copy ``dense[layer]`` [H, S, D]."""
    for layer in range(SPEC.num_layers):
        k = torch.randn(2, n, 4, generator=gen)
        seq.append(layer, k, -k)
        dense[layer] = torch.cat([dense[layer], k], dim=1)


def test_each_copy_on_write_copies_the_tail_it_replaces_and_is_counted_once():
    """Writing into a shared, partly filled tail copies that tail (and only it) to a private block first: the
    sequences that share it read their own K/V, the blocks before the tail stay shared (refcount = holders), and
    every copy adds one to the writer's cow_copies."""
    kv, gen = PagedKV(SPEC, 16, fingerprint=FP), torch.Generator().manual_seed(7)
    empty = torch.zeros(2, 0, 4)
    parent, d_parent = kv.new_sequence(), [empty, empty]
    _write(parent, 20, gen, d_parent)  # 3 blocks, 4 tokens in the tail
    child, d_child = parent.fork(), list(d_parent)
    _write(child, 2, gen, d_child)  # copy 1: block 2
    assert child.cow_copies == 1 and child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    grandchild, d_grand = child.fork(), list(d_child)
    _write(child, 1, gen, d_child)  # copy 2: child's private tail, now shared with the grandchild
    assert child.cow_copies == 2 and grandchild.cow_copies == 0 and parent.cow_copies == 0
    assert child.block_table[:2] == grandchild.block_table[:2] == parent.block_table[:2]
    assert len({parent.block_table[2], child.block_table[2], grandchild.block_table[2]}) == 3
    assert [kv.allocator.refcount[b] for b in parent.block_table] == [3, 3, 1]
    for seq, dense in ((parent, d_parent), (child, d_child), (grandchild, d_grand)):
        for layer in range(SPEC.num_layers):
            k, v = seq.to_dense(layer)
            assert torch.equal(k, dense[layer]) and torch.equal(v, -dense[layer])
    kv.check()


@pytest.mark.parametrize(
    "fault, error, message",
    [
        (
            RuntimeError("device lost"),
            StateError,
            r"^copying the shared tail block 1 to block \d+ failed \(device lost\); ",
        ),
        (InvalidBlockError("dst: block 9 out of range"), StateError, r"^copying the shared tail block 1 to block \d+ "),
        (KeyboardInterrupt(), KeyboardInterrupt, r"^$"),
    ],
    ids=["device error", "pool smaller than the allocator", "interrupt"],
)
def test_a_failed_tail_copy_gives_back_every_block_and_changes_nothing(monkeypatch, fault, error, message):
    """Copy-on-write allocates the private tail and the new blocks together; when the copy itself fails (a device
    error, a pool that does not hold the block) the caller gets a ``StateError`` naming both blocks, with the
    fault as its cause (an interrupt passes through as it is), and all of them go back: the table, refcounts and
    free blocks are as before, and the same reserve then succeeds."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq, (sibling,) = _bookkept(kv, 12, forks=1)
    table, refs, available = list(seq.block_table), _refcounts(kv), kv.allocator.num_available
    assert table[-1] == 1  # the shared, partly filled tail

    def broken(src, dst):
        raise fault

    monkeypatch.setattr(kv.pool, "copy_block", broken)
    assert seq.blocks_needed(10) == 2  # the copy and one new block
    with pytest.raises(error, match=message) as caught:
        seq.reserve(10)
    if error is StateError:
        assert caught.value.__cause__ is fault and caught.value.args[0].endswith("; nothing was kept")
    assert seq.block_table == table and seq.num_tokens == 12 and seq.cow_copies == 0
    assert _refcounts(kv) == refs and kv.allocator.num_available == available
    kv.check()
    monkeypatch.undo()
    seq.reserve(10)
    assert seq.num_tokens == 22 and seq.cow_copies == 1 and seq.block_table[0] == sibling.block_table[0]
    assert kv.allocator.num_available == available - 2
    kv.check()


def test_copy_on_write_over_a_windowed_pool_moves_the_window_holds_to_the_private_tail():
    """Over a quantized pool with a residual window, a sequence holds the blocks inside its window at full
    precision; after copy-on-write it holds its private copy and its new blocks instead of the shared tail, which
    only the other sequence still holds (holds counted by hand per block)."""
    from memos_ref.quant import FP8E4M3

    kv = PagedKV(SPEC, 16, quant=FP8E4M3(), residual_tokens=32, staging_blocks=12, fingerprint=FP)
    gen = torch.Generator().manual_seed(9)
    empty = torch.zeros(2, 0, 4)
    parent, dense = kv.new_sequence(), [empty, empty]
    _write(parent, 12, gen, dense)
    child = parent.fork()
    b0, b1 = parent.block_table
    holds = [0] * 16
    holds[b0] = holds[b1] = 2
    assert kv.pool.window_holds.tolist() == holds
    _write(child, 6, gen, [empty, empty])  # copy the shared tail, and one new block: 18 tokens, all in the window
    c0, private, new = child.block_table
    assert c0 == b0 and private != b1 and new not in (b0, b1, private)
    holds[b1], holds[private], holds[new] = 1, 1, 1
    assert kv.pool.window_holds.tolist() == holds
    kv.check()


@pytest.mark.parametrize(
    "n, ids, error, message",
    [
        (-1, None, InvalidArgumentError, r"^n: expected an integer in >= 0, got -1$"),
        ("2", None, ArgumentTypeError, r"^n: "),
        (2, [5], ShapeError, r"^2 tokens reserved but 1 token ids given$"),
        (1, [5, 6], ShapeError, r"^1 tokens reserved but 2 token ids given$"),
    ],
    ids=["negative", "str", "fewer ids", "more ids"],
)
def test_reserve_positions_refuses_a_bad_count_or_ids_of_another_length_and_changes_nothing(n, ids, error, message):
    """A count that is not a non-negative int is refused naming ``n``; ids of another length than the count are
    refused naming both numbers; the sequence and the allocator are as before. Zero tokens reserve nothing."""
    kv = PagedKV(SPEC, 8, fingerprint=FP)
    seq = kv.new_sequence()
    seq.reserve_positions(3, [1, 2, 3])
    table, available = list(seq.block_table), kv.allocator.num_available
    with pytest.raises(error, match=message):
        seq.reserve_positions(n, ids)
    assert seq.num_tokens == 3 and seq.token_ids == [1, 2, 3] and seq.block_table == table
    assert kv.allocator.num_available == available
    assert seq.reserve_positions(0) == range(3, 3) and seq.num_tokens == 3


def test_freeing_the_last_window_over_a_shared_full_block_seals_it_for_the_sequence_still_holding_it():
    """Over a quantized pool with a one-block residual window: a parent and its fork share three full blocks; the
    fork writes on, so its window leaves them, and only the parent's window keeps the third at full precision.
    When the parent is freed that block is inside no window any more: it is sealed (quantized, its staging slot
    given back) though the fork still holds it, and the fork reads it as the codec's round trip."""
    from memos_ref.quant import FP8E4M3

    kv = PagedKV(SPEC, 16, quant=FP8E4M3(), residual_tokens=T, staging_blocks=6, fingerprint=FP)
    gen = torch.Generator().manual_seed(21)
    empty = torch.zeros(2, 0, 4)
    parent, dense = kv.new_sequence(), [empty, empty]
    _write(parent, 3 * T, gen, dense)
    child = parent.fork()
    _write(child, 2 * T, gen, [empty, empty])
    b0, b1, b2 = parent.block_table
    assert kv.pool.is_staged(b2) and not kv.pool.is_staged(b0) and not kv.pool.is_staged(b1)
    staged_before = kv.pool.staging_available
    parent.free()
    assert not kv.pool.is_staged(b2) and kv.pool.staging_available == staged_before + 1
    assert child.block_table[:3] == [b0, b1, b2] and kv.allocator.refcount[b2] == 1
    kv.check()
    for layer in range(SPEC.num_layers):
        k, _ = child.to_dense(layer)
        want = kv.pool.codec.decode(kv.pool.payload, torch.tensor([b2]), layer)[0, 0]  # [H, T, D] sealed codes
        assert torch.equal(k[:, 2 * T : 3 * T], want)
        assert not torch.equal(k[:, 2 * T : 3 * T], dense[layer][:, 2 * T : 3 * T])  # not the full-precision copy


def test_freeing_a_sequence_seals_a_block_it_had_truncated_into_that_another_holds_whole_behind_its_window():
    """A block can be a partly filled tail for one holder and a whole block for another: ``a`` registered it full,
    ``b`` adopted it as a prefix and wrote on (its one-block window left it), then ``a`` truncated into it. When
    ``a`` is freed the block is inside no window: it is sealed (staging slot given back) like any whole block
    behind every window, though it was partial for the sequence that let go of it."""
    from memos_ref.quant import FP8E4M3

    kv = PagedKV(SPEC, 16, quant=FP8E4M3(), residual_tokens=T, staging_blocks=6, fingerprint=FP)
    gen = torch.Generator().manual_seed(22)
    ids = list(range(500, 500 + 2 * T))
    a = kv.new_sequence()
    for layer in range(SPEC.num_layers):
        k = torch.randn(2, 2 * T, 4, generator=gen)
        a.append(layer, k, -k, ids)
    a0, a1 = a.block_table
    b = kv.start_from_prefix([*ids, 7, 8, 9])
    assert b.block_table == [a0, a1] and b.num_tokens == 2 * T
    for layer in range(SPEC.num_layers):
        k = torch.randn(2, 2 * T, 4, generator=gen)
        b.append(layer, k, -k)
    a.truncate(2 * T - 3)  # a1: a's partial tail, b's whole block outside its window
    assert a.block_table == [a0, a1] and kv.allocator.refcount[a1] == 2 and kv.pool.is_staged(a1)
    slots = kv.pool.staging_available
    a.free()
    assert not kv.pool.is_staged(a1) and kv.pool.staging_available >= slots + 1
    kv.check()


def test_a_freed_sequence_reads_as_empty_and_leaves_the_registry_even_if_it_was_dropped_from_it():
    """After ``free()`` a sequence holds no tokens, no blocks, and its window starts at 0; it is gone from
    ``kv.sequences``. Freeing one a caller had already dropped from ``kv.sequences`` still gives its blocks
    back (no ``KeyError``), and freeing twice is harmless."""
    from memos_ref.quant import FP8E4M3

    kv = PagedKV(SPEC, 16, quant=FP8E4M3(), residual_tokens=T, staging_blocks=6, fingerprint=FP)
    gen = torch.Generator().manual_seed(23)
    empty = torch.zeros(2, 0, 4)
    seq, other = kv.new_sequence(), kv.new_sequence()
    _write(seq, 3 * T + 2, gen, [empty, empty])
    _write(other, T + 1, gen, [empty, empty])
    assert seq.window_start == 2
    seq.free()
    assert (seq.num_tokens, seq.block_table, seq.window_start) == (0, [], 0) and seq.seq_id not in kv.sequences
    del kv.sequences[other.seq_id]
    other.free()
    other.free()
    assert kv.allocator.num_active == 0 and kv.pool.staging_available == kv.pool.staging_capacity
    kv.check()
