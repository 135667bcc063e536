"""The memory store's eviction (issue 30's survivors): under LFU and hybrid scoring a key that was just set has
the lowest score there is (no accesses yet), so whether it survives the eviction its own insertion triggers was
never pinned down; nor was the byte accounting when a key's value is replaced. The oracles: which keys a caller
set and read, and the sum of len(key) + len(JSON value) computed here."""

from __future__ import annotations

import json

import pytest

from memos_ref.memory import ShardedStore, TTLStore


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _stores(policy: str, **limits):
    """A TTLStore (set -> put_encoded) and a one-shard ShardedStore (set -> set_under): both write paths."""
    clock = Clock()
    plain = TTLStore(policy=policy, default_ttl=None, clock=clock, **limits)
    sharded = ShardedStore(1, policy=policy, default_ttl=None, clock=clock, **limits)
    return [("TTLStore", plain, plain, clock), ("ShardedStore", sharded, sharded.shards[0], clock)]


def _size(key: str, value) -> int:
    return len(key) + len(json.dumps(value, separators=(",", ":")).encode())


@pytest.mark.parametrize("policy", ["lfu", "hybrid", "lru"])
def test_a_key_just_set_survives_the_entry_eviction_it_triggers(policy):
    """At max_entries, setting a new key evicts an older one, never the new key itself, however often the older
    keys were read (its count is 0, the lowest LFU score)."""
    for name, store, shard, clock in _stores(policy, max_entries=3):
        for i in range(3):
            store.set(f"k{i}", i)
            clock.t += 1
        for _ in range(5):
            for i in range(3):
                assert store.get(f"k{i}") == i
        clock.t += 1
        store.set("new", 99)
        assert store.get("new") == 99, name
        assert len(shard) == 3 and shard.stats["evictions_entries"] == 1, name


@pytest.mark.parametrize("policy", ["lfu", "hybrid", "lru"])
def test_a_key_just_set_survives_the_byte_eviction_it_triggers(policy):
    """Over max_bytes, the new key's own insertion evicts older entries until the budget holds, and the new key is
    kept (it fits on its own)."""
    for name, store, shard, clock in _stores(policy, max_bytes=60, max_entries=100):
        for i in range(4):
            store.set(f"k{i}", "x" * 5)  # 2 + 7 = 9 bytes each
            clock.t += 1
            store.get(f"k{i}")
        store.set("big", "y" * 30)  # 3 + 32 = 35 bytes: 36 + 35 > 60
        assert store.get("big") == "y" * 30, name
        assert shard.bytes <= 60 and shard.stats["evictions_bytes"] >= 1, name
        assert shard.bytes == sum(e.size_bytes for e in shard.entries()), name


def test_lfu_evicts_the_least_read_older_key():
    """With every key older than the new one, LFU's victim is the one read least often (not the newest, not the
    oldest)."""
    for name, store, _shard, clock in _stores("lfu", max_entries=3, sample=None):
        for key, reads in (("a", 3), ("b", 1), ("c", 2)):
            store.set(key, key)
            for _ in range(reads):
                store.get(key)
            clock.t += 1
        store.set("d", "d")
        assert sorted(k for k in "abcd" if store.get(k) is not None) == ["a", "c", "d"], name


@pytest.mark.parametrize("policy", ["lfu", "hybrid", "lru"])
def test_overwriting_a_key_at_max_entries_evicts_nothing(policy):
    """Replacing a key's value adds no entry: at max_entries nothing is evicted and every key stays."""
    for name, store, shard, _clock in _stores(policy, max_entries=3):
        for i in range(3):
            store.set(f"k{i}", i)
        store.set("k0", "replaced")
        assert [store.get(f"k{i}") for i in range(3)] == ["replaced", 1, 2], name
        assert shard.stats["evictions_entries"] == 0, name


@pytest.mark.parametrize("values", [("short", "a much longer value than before"), ("a much longer value", "s")])
def test_replacing_a_value_accounts_its_bytes_exactly(values):
    """After a key's value is replaced (longer or shorter), the store's bytes are the sum of len(key) + len(JSON)
    over what it holds: the old value's bytes are given back, never counted twice."""
    for name, store, shard, _clock in _stores("hybrid", max_bytes=10_000):
        store.set("other", [1, 2, 3])
        for v in values:
            store.set("key", v)
        assert shard.bytes == _size("other", [1, 2, 3]) + _size("key", values[-1]), name
        store.delete("key")
        assert shard.bytes == _size("other", [1, 2, 3]), name


def test_replacing_values_at_the_byte_budget_keeps_the_budget():
    """Growing a value in place past max_bytes evicts other entries (not the replaced key) until it fits."""
    for name, store, shard, clock in _stores("lfu", max_bytes=50, max_entries=100):
        for i in range(4):
            store.set(f"k{i}", "v")  # 2 + 3 = 5 bytes
            store.get(f"k{i}")
            clock.t += 1
        store.set("k0", "z" * 40)  # 2 + 42 = 44: 44 + 15 > 50
        assert store.get("k0") == "z" * 40, name
        assert shard.bytes <= 50 and shard.bytes == sum(e.size_bytes for e in shard.entries()), name
