"""The memory store's eviction (issue 30's survivors): under LFU and hybrid scoring a key that was just set has
the lowest score there is (no accesses yet), so whether it survives the eviction its own insertion triggers was
never pinned down; nor was the byte accounting when a key's value is replaced. The oracles: which keys a caller
set and read, and the sum of len(key) + len(JSON value) computed here."""

from __future__ import annotations

import json

import pytest

from memos_ref.errors import ArgumentTypeError, CapacityExceededError, ConfigError, InvalidArgumentError, StateError
from memos_ref.memory import AbsentKeyError, ShardedStore, TTLStore
from memos_ref.memory.store import MISSING, encode_value, json_text, validate_key


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


# ---------------------------------------------------------------- full mutmut run of store.py / values.py (issue 30)

BAD_KEYS = [("has space", ConfigError), ("", ConfigError), ("x" * 251, ConfigError), ("tab\there", ConfigError),
            ("new\nline", ConfigError), (5, ArgumentTypeError), (b"bytes", ArgumentTypeError)]  # fmt: skip


@pytest.mark.parametrize("key, error", BAD_KEYS)
def test_every_write_and_read_path_refuses_a_bad_key_and_changes_nothing(key, error):
    """A key that could not be a Redis key (whitespace, control characters, empty, over 250 characters, not a str)
    is refused on every path — TTLStore.set, a one-shard ShardedStore's set (which checks the key itself) and get
    — with the error naming it, and the store is left as it was; 250 printable characters are accepted."""
    for name, store, shard, _clock in _stores("lru"):
        store.set("ok", 1)
        with pytest.raises(error):
            store.set(key, 1)
        with pytest.raises(error):
            store.get(key)
        assert len(shard) == 1 and shard.bytes == _size("ok", 1) and shard.stats == {"sets": 1}, name
        store.set("y" * 250, 2)
        assert store.get("y" * 250) == 2, name


def test_an_entry_larger_than_the_byte_budget_is_refused_naming_the_binding_limit():
    """An entry over max_bytes (but under max_value_bytes) is refused saying max_bytes is the reason; one over
    max_value_bytes says the largest allowed size. needed/capacity carry the figures; nothing is stored."""
    for name, store, shard, _clock in _stores("lru", max_bytes=50, max_value_bytes=1_000):
        with pytest.raises(CapacityExceededError, match="max_bytes is 50, so an entry this large") as info:
            store.set("k", "x" * 60)  # 1 + 62 bytes
        assert (info.value.needed, info.value.capacity) == (63, 50) and len(shard) == 0, name
        store.set("k", "x" * 47)  # 1 + 49 = 50: exactly the budget
        assert shard.bytes == 50, name
    for name, store, shard, _clock in _stores("lru", max_bytes=10_000, max_value_bytes=20):
        with pytest.raises(CapacityExceededError, match="is 21 bytes; the largest allowed is 20") as info:
            store.set("k", "x" * 18)
        assert "max_bytes" not in str(info.value) and info.value.capacity == 20 and len(shard) == 0, name


BAD_ARGS = [
    ({"max_entries": 0}, ConfigError, "capacity limits must be positive"),
    ({"max_bytes": -1}, ConfigError, "capacity limits must be positive"),
    ({"max_value_bytes": 0}, ConfigError, "capacity limits must be positive"),
    ({"max_entries": 2.5}, ArgumentTypeError, "max_entries: expected int"),
    ({"max_bytes": True}, ArgumentTypeError, "max_bytes: expected int"),
    ({"max_value_bytes": "9"}, ArgumentTypeError, "max_value_bytes: expected int"),
    ({"policy": "fifo"}, ConfigError, r"policy must be one of \('lru', 'lfu', 'hybrid'\), got 'fifo'"),
    ({"policy": 1}, ArgumentTypeError, "policy: expected str"),
    ({"default_ttl": 0}, InvalidArgumentError, "default_ttl"),
    ({"clock": 5}, ArgumentTypeError, "clock: expected a callable, got int"),
    ({"hybrid_weights": [0.1, 10.0]}, ArgumentTypeError, "hybrid_weights: expected tuple"),
    ({"hybrid_weights": (0.1,)}, ConfigError, r"hybrid_weights must be a pair \(a, b\), got \(0.1,\)"),
    ({"hybrid_weights": (0.1, "b")}, ArgumentTypeError, r"hybrid_weights\[i\]: expected int or float"),
    ({"sample": 0}, ConfigError, "sample must be >= 1 or None, got 0"),
    ({"sample": 2.0}, ArgumentTypeError, "sample: expected int"),
]


@pytest.mark.parametrize("kwargs, error, message", BAD_ARGS)
def test_a_bad_constructor_argument_is_refused_naming_it(kwargs, error, message):
    with pytest.raises(error, match=message):
        TTLStore(**kwargs)


def test_the_smallest_valid_limits_are_accepted_and_hold():
    """max_entries=1 and sample=1 are valid: the store holds one entry and evicts the other on every new key."""
    store = TTLStore(max_entries=1, sample=1, policy="lfu", default_ttl=None)
    store.set("a", 1)
    store.set("b", 2)
    assert [e.key for e in store.entries()] == ["b"] and store.stats["evictions_entries"] == 1
    assert (store.max_entries, store.sample, store.policy, store.default_ttl) == (1, 1, "lfu", None)


def test_the_hybrid_and_lfu_scores_are_the_documented_formulas():
    """hybrid: (1 + a*count) / (1 + age/b) with age clamped at 0; lfu: the count itself."""
    clock = Clock()
    hybrid = TTLStore(clock=clock, hybrid_weights=(0.5, 20.0), default_ttl=None)
    hybrid.set("k", 1)
    for _ in range(4):
        hybrid.get("k")
    entry = hybrid.entry("k")
    assert hybrid.score(entry, clock.t + 10) == pytest.approx((1 + 0.5 * 4) / (1 + 10 / 20))
    assert hybrid.score(entry, clock.t - 50) == pytest.approx(1 + 0.5 * 4)  # a clock behind: age 0, not negative
    lfu = TTLStore(clock=clock, policy="lfu", default_ttl=None)
    lfu.set("k", 1)
    lfu.get("k")
    assert lfu.score(lfu.entry("k"), clock.t + 99) == 1.0


def test_sampled_eviction_scores_only_the_least_recently_used_candidates():
    """With sample=2 only the two least recently used keys (other than the one being set) are candidates: the
    never-read "c", written last, is not among them and survives although its score is the lowest; with
    sample=None every entry is scored and "c" goes."""
    for sample, kept in ((2, {"b", "c", "d"}), (None, {"a", "b", "d"})):
        store = TTLStore(clock=Clock(), policy="lfu", max_entries=3, sample=sample, default_ttl=None)
        for key in ("a", "b"):
            store.set(key, key)
            for _ in range(3):
                store.get(key)
        store.set("c", "c")  # recency: a, b, c; counts 3, 3, 0
        store.set("d", "d")  # sampled: a or b (a tie at 3: the least recent, a); all: c
        assert {e.key for e in store.entries()} == kept, sample


def test_an_entry_expires_at_its_expiry_exactly_on_every_read_path():
    """At expire_at exactly an entry is gone for get, in, ttl and delete (expiry is `now >= expire_at`); a moment
    before, it is live with the exact seconds left."""
    for name, store, shard, clock in _stores("lru"):
        store.set("k", 1, ttl=10)
        clock.t += 9.5
        assert "k" in shard and shard.remaining_ttl("k") == pytest.approx(0.5) and store.get("k") == 1, name
        clock.t += 0.5
        assert "k" not in shard and store.get("k") is None, name
        store.set("j", 1, ttl=10)
        clock.t += 10
        with pytest.raises(AbsentKeyError):
            shard.remaining_ttl("j")
        assert shard.delete("j") is False and shard.stats["expirations"] == 2, name
        store.set("n", 1, ttl=None)
        assert shard.remaining_ttl("n") is None, name


def test_delete_clear_and_negative_entries_count_and_answer_exactly():
    clock = Clock()
    store = TTLStore(clock=clock, default_ttl=60)
    store.set("a", 1)
    store.set("b", 2)
    store.set_missing("m", 5)
    assert store.lookup("m") is MISSING and store.get("m") is None and "m" in store
    with pytest.raises(AbsentKeyError, match="no live value for key 'm'"):
        store.remaining_ttl("m")
    assert store.delete("a") is True and store.delete("a") is False and store.stats["deletes"] == 1
    store.clear()
    assert len(store) == 0 and store.bytes == 0 and store.heap_size == 0 and store.stats["deletes"] == 3
    assert repr(MISSING) == "MISSING"
    long = AbsentKeyError("k" * 100)
    assert str(long) == f"no live value for key {'k' * 80!r} (100 characters)"


def test_update_refuses_re_entry_and_a_failing_fn_changes_nothing():
    store = TTLStore(clock=Clock(), default_ttl=60)
    store.set("n", 1)
    with pytest.raises(StateError, match="called from inside update"):
        store.update("n", lambda v: store.get("n"))
    with pytest.raises(StateError):
        store.update("n", lambda v: store.set("x", 1))
    with pytest.raises(ArgumentTypeError, match="fn: expected a callable, got int"):
        store.update("n", 5)
    assert store.get("n") == 1 and "x" not in store and store.update("n", lambda v: v + 1) == 2


@pytest.mark.parametrize(
    "value", [{"a": [1, 2.5, None, True]}, [1, "é☃", {"b": {}}], "plain", 3, -0.0, None, {"k": 'x\n\t"\\'}]
)
def test_json_text_is_compact_strict_ascii_json(value):
    """json_text writes exactly what json.dumps writes with separators=(",", ":"), allow_nan=False (ASCII, no
    spaces); NaN and the infinities are refused. (Built once at import: mutmut cannot switch its mutants on, so
    this test is checked by hand.)"""
    assert json_text(value) == json.dumps(value, separators=(",", ":"), allow_nan=False)
    for bad in (float("nan"), [float("inf")], {"x": -float("inf")}):
        with pytest.raises(ValueError):
            json_text(bad)


def test_encode_value_bounds_and_errors_name_their_figures():
    """encode_value (the Redis backend's encoder) accepts len(key) + len(JSON) == max_value_bytes exactly, refuses
    one byte more with needed/capacity set, and names the exception type of a value JSON cannot encode."""
    assert encode_value("k", "x" * 7, 10) == b'"xxxxxxx"'
    with pytest.raises(CapacityExceededError, match="is 11 bytes; the largest allowed is 10") as info:
        encode_value("k", "x" * 8, 10)
    assert (info.value.needed, info.value.capacity) == (11, 10)
    with pytest.raises(ConfigError, match=r"value for 'k' is not JSON-serialisable: TypeError: "):
        encode_value("k", object(), 10)


def test_entry_inspection_negative_ttl_and_update_ttl():
    """entry() names its key (None for an absent key); a negatively cached key expires after its own TTL; update()
    stores with the TTL it is given."""
    for name, store, shard, clock in _stores("lru"):
        store.set("k", 1)
        assert shard.entry("k").key == "k" and shard.entry("absent") is None, name
        shard.set_missing("m", 5)
        assert shard.lookup("m") is MISSING, name
        clock.t += 5
        assert shard.lookup("m", "gone") == "gone", name
        store.update("u", lambda v: 1, ttl=7)
        assert shard.remaining_ttl("u") == pytest.approx(7), name


# ------------------------------------------------------- second full mutmut run of store.py (2026-12-02, issue 30)


def test_expired_entries_go_before_a_live_entry_is_evicted_for_room():
    """At max_entries, a new key first drops the entries that have expired; a live entry is evicted only if that
    was not enough. Here the older live key survives because an expired one made the room."""
    for name, store, shard, clock in _stores("lru", max_entries=2):
        store.set("live", 1)
        store.set("short", 2, ttl=1)
        clock.t += 2
        store.set("new", 3)
        assert store.get("live") == 1 and store.get("new") == 3, name
        assert shard.stats["expirations"] == 1 and "evictions_entries" not in shard.stats, name


def test_a_store_exactly_at_its_byte_budget_keeps_every_entry():
    """Byte eviction stops as soon as the total is within max_bytes: equal to the budget is within it. (Three
    entries of 9 bytes, max_entries 2, max_bytes 18: the third evicts one entry for the count, and no more.)"""
    for name, store, shard, clock in _stores("lru", max_entries=2, max_bytes=18):
        for key in ("k0", "k1", "k2"):
            store.set(key, "x" * 5)  # 2 + 7 = 9 bytes
            clock.t += 1
        assert store.get("k1") == "x" * 5 and store.get("k2") == "x" * 5, name
        assert shard.bytes == 18 and shard.stats.get("evictions_bytes", 0) == 0, name


def test_byte_eviction_goes_down_to_one_entry_when_the_budget_needs_it():
    """Two entries that together exceed max_bytes do not both stay: the older one is evicted."""
    for name, store, shard, clock in _stores("lru", max_bytes=10, max_entries=100):
        store.set("a", "x" * 5)  # 1 + 7 = 8 bytes
        clock.t += 1
        store.set("b", "y" * 5)
        assert len(shard) == 1 and store.get("b") == "y" * 5 and shard.bytes == 8, name
        assert shard.stats["evictions_bytes"] == 1, name


@pytest.mark.parametrize("value", [object(), float("nan"), {1j: 2}], ids=["object", "nan", "complex-key"])
def test_a_value_json_cannot_encode_is_refused_on_both_write_paths_and_changes_nothing(value):
    """TTLStore.set and a one-shard ShardedStore's set (which encodes outside the shard's lock) refuse a value that
    is not JSON with ConfigError naming the key, and store nothing."""
    for name, store, shard, _clock in _stores("lru"):
        with pytest.raises(ConfigError, match=r"value for 'k' is not JSON-serialisable"):
            store.set("k", value)
        assert len(shard) == 0 and shard.bytes == 0 and "k" not in shard and shard.stats == {}, name


def test_an_entry_s_size_is_its_key_plus_payload_unless_given():
    """KVEntry computes size_bytes as len(key) + len(payload) when it is not given, and keeps a given size,
    0 included, as it is."""
    from memos_ref.memory import KVEntry

    assert KVEntry("key", '"v"', None, 0, 0.0, 0.0, 1).size_bytes == 6
    assert KVEntry("key", '"v"', None, 0, 0.0, 0.0, 1, 10).size_bytes == 10
    assert KVEntry("key", '"v"', None, 0, 0.0, 0.0, 1, 0).size_bytes == 0


def test_rewriting_a_key_with_the_same_or_a_later_expiry_adds_no_heap_record():
    """An overwrite keeps the entry's expiry record when the new expiry is the same or later (sweep moves it), and
    pushes one only for an earlier expiry; so rewriting a hot key does not grow the heap."""
    for name, store, shard, clock in _stores("lru"):
        for _ in range(3):
            store.set("k", 1, ttl=10)
        assert shard.heap_size == 1, name
        clock.t += 1
        store.set("k", 2, ttl=10)  # later expiry: the record stands
        assert shard.heap_size == 1, name
        store.set("k", 3, ttl=1)  # earlier expiry: a new record
        assert shard.heap_size == 2, name
        clock.t += 1
        assert shard.sweep() == 1 and store.get("k") is None, name


def test_sweep_counts_what_it_removes_as_expirations():
    for name, store, shard, clock in _stores("lru"):
        store.set("a", 1, ttl=1)
        store.set("b", 2, ttl=5)
        clock.t += 2
        assert shard.sweep() == 1 and shard.stats == {"sets": 2, "expirations": 1}, name


@pytest.mark.parametrize(
    ("args", "text"),
    [
        (("m",), "no live value for key 'm'"),
        ((), "no live value for key ''"),
        ((5,), "no live value for key '5'"),
        (("k" * 80,), f"no live value for key {'k' * 80!r}"),
        (("k" * 81,), f"no live value for key {'k' * 80!r} (81 characters)"),
    ],
)
def test_an_absent_key_error_quotes_its_key_up_to_80_characters(args, text):
    """The message names the key exactly (its repr when not a str) and adds the length only when it was cut."""
    assert str(AbsentKeyError(*args)) == text


def test_validate_key_accepts_250_characters_and_names_what_it_refuses():
    """validate_key (what the stores call for any key their inline check does not accept outright) accepts 1 to
    250 printable characters and refuses the rest with the key, its length and the rule in the message."""
    assert validate_key("y" * 250) == "y" * 250 and validate_key("k") == "k"
    with pytest.raises(ArgumentTypeError, match=r"^key: expected str, got int \(5\)$"):
        validate_key(5)
    with pytest.raises(ConfigError, match=r"^invalid key 'a b' \(3 characters\): expected 1-250 printable characters"
                       r" without whitespace$"):  # fmt: skip
        validate_key("a b")


@pytest.mark.parametrize("value", [{"b": 1, "a": [1.5, None, True]}, "é\n", ["é", {"k": "x"}], 0, -2.5, None])
def test_a_freshly_built_json_text_writes_what_json_dumps_writes(value):
    """json_text is built once, at import, by _json_text_fn: a mutant of the builder never reaches the module's
    json_text under mutmut, so the builder is called here: the text equals json.dumps(value, separators=(",",
    ":"), allow_nan=False) (keys unsorted, ASCII), and what that refuses (NaN, infinities, a non-str key) it
    refuses too."""
    from memos_ref.memory.values import _json_text_fn

    fresh = _json_text_fn()
    assert fresh(value) == json.dumps(value, separators=(",", ":"), allow_nan=False)
    for bad in (float("nan"), [float("inf")], {(1, 2): 3}):
        with pytest.raises((ValueError, TypeError)):
            fresh(bad)


def test_the_documented_defaults_hold():
    """A TTLStore built with no arguments keeps values 300 s and samples 16 eviction candidates (the documented
    defaults), and a call back into the store from update()'s fn is refused with the whole explanation."""
    store = TTLStore()
    assert store.default_ttl == 300.0 and store.sample == 16
    message = (
        "the store was called from inside update()'s fn: fn must compute the new value from the current one only "
        "(it runs under the key's lock); read other keys before calling update()"
    )
    with pytest.raises(StateError) as info:
        store.update("k", lambda v: store.get("other"))
    assert str(info.value) == message


def test_bad_limits_and_a_bad_default_ttl_are_refused_naming_them():
    """A zero capacity and a negative default TTL are refused with messages that say which argument and why."""
    with pytest.raises(ConfigError) as info:
        TTLStore(max_entries=0)
    assert str(info.value) == "capacity limits must be positive"
    with pytest.raises(InvalidArgumentError, match=r"^default_ttl must be a finite number of seconds in \(0, "):
        TTLStore(default_ttl=-1)
