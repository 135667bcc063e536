"""Reliability of the short-term memory store and the disk tier (issue 24 items 4, 5, 6, 7, 9, 10).

Every test here failed on the code before the fix (checked by running it against that tree). Races are made
deterministic with events that pause a thread at the exact step; servers are real (a private redis-server on
loopback, a second Python process for the disk lock). The only timings are correctness bounds on a stopped
server, stated with their slack.
"""

from __future__ import annotations

import gc
import itertools
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import warnings

import pytest

from memos_ref.errors import BackendUnavailableError, CapacityExceededError, ConfigError, KVCacheError, StateError
from memos_ref.memory import (
    AbsentKeyError,
    MemoryBackend,
    RedisBackend,
    RedisServer,
    ShardedStore,
    TTLStore,
    redis_server_path,
)
from memos_ref.tiering.backends import DiskBackend, RedisTierBackend

_tenants = itertools.count()


def make(kind: str, request, **kwargs):
    if kind == "memory":
        return MemoryBackend(**kwargs)
    server = request.getfixturevalue("redis_server")
    return RedisBackend(server.url, namespace="rel", tenant=f"t{next(_tenants)}", **kwargs)


def raw_client(backend: RedisBackend):
    import redis

    return redis.Redis.from_url(backend.url)


def _raises(cls: type[BaseException], fn) -> bool:
    """True when ``fn()`` raises ``cls``."""
    try:
        fn()
    except cls:
        return True
    return False


def run_bounded(fn, seconds: float = 20.0):
    """Run ``fn`` in a daemon thread; returns ("ok", value) / ("raised", exc), or fails if it never returns (a
    deadlock in the old code must fail the test, not hang the suite)."""
    out: list = []

    def target() -> None:
        try:
            out.append(("ok", fn()))
        except BaseException as exc:  # handed to the test
            out.append(("raised", exc))

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"the call did not return within {seconds} s: a deadlock"
    return out[0]


# ====================================================================== item 4: update over a key of another type
PLANT = {
    "list": lambda raw, rkey: raw.rpush(rkey, "a"),
    "hash": lambda raw, rkey: raw.hset(rkey, "f", "v"),
    "set": lambda raw, rkey: raw.sadd(rkey, "m"),
}


@pytest.mark.parametrize("planted", list(PLANT))
def test_redis_update_over_a_key_of_another_type_overwrites_like_set(redis_server, planted):
    b = RedisBackend(redis_server.url, namespace="rel", tenant=f"wrongtype-{planted}")
    raw = raw_client(b)
    try:
        PLANT[planted](raw, b.prefix + "k")
        assert b.update("k", lambda v: v + 1, default=0) == 1
        assert b.get("k") == 1 and raw.type(b.prefix + "k") == b"string"  # what update returned is stored
        assert b.stats()["errors_wrongtype"] >= 1
    finally:
        b.clear()


@pytest.mark.parametrize("planted", list(PLANT))
def test_redis_every_read_path_answers_a_miss_for_a_key_of_another_type(redis_server, planted):
    b = RedisBackend(redis_server.url, namespace="rel", tenant=f"wrongread-{planted}")
    raw = raw_client(b)
    try:
        PLANT[planted](raw, b.prefix + "k")
        assert b.get("k", "absent") == "absent" and "k" not in b
        assert b.get_many(["k"]) == {}
        with pytest.raises(KeyError):
            b.ttl("k")  # get says absent: ttl agrees
        assert b.get_or_compute("k", lambda: "computed") == "computed" and b.get("k") == "computed"
    finally:
        b.clear()


# ====================================================================== item 5: single flight
class _PausedReads:
    """Pauses the thread named ``B`` right after its first read of the store missed, until ``resume`` is set."""

    def __init__(self) -> None:
        self.read_missed, self.resume = threading.Event(), threading.Event()
        self.fired = False

    def after_read(self, value, absent) -> None:
        if threading.current_thread().name == "B" and value is absent and not self.fired:
            self.fired = True
            self.read_missed.set()
            assert self.resume.wait(20)


def _paused_backend(kind: str, request):
    base = MemoryBackend if kind == "memory" else RedisBackend
    pause = _PausedReads()

    class Paused(base):
        def get(self, key, default=None):  # the read of the code before the fix
            value = super().get(key, default)
            pause.after_read(value, default)
            return value

        def _lookup(self, key, absent):  # the read of the fixed code (get() goes through it too)
            value = super()._lookup(key, absent)
            pause.after_read(value, absent)
            return value

    if kind == "memory":
        return Paused(shards=2), pause
    server = request.getfixturevalue("redis_server")
    return Paused(server.url, namespace="rel", tenant=f"t{next(_tenants)}"), pause


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_get_or_compute_rechecks_after_taking_the_lead(kind, request):
    """B reads a miss; the leader then computes, stores and finishes; only then does B look for a flight. B must
    find the stored value, not compute a second time."""
    backend, pause = _paused_backend(kind, request)
    calls: list[str] = []

    def compute():
        calls.append(threading.current_thread().name)
        return {"answer": 42}

    got: list = []
    b = threading.Thread(target=lambda: got.append(backend.get_or_compute("q", compute)), name="B", daemon=True)
    try:
        b.start()
        assert pause.read_missed.wait(20)
        assert backend.get_or_compute("q", compute) == {"answer": 42}  # the leader, from start to finish
        pause.resume.set()
        b.join(20)
        assert not b.is_alive()
        assert got == [{"answer": 42}] and calls == ["MainThread"] and backend.computations == 1
    finally:
        pause.resume.set()
        backend.clear()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_get_or_compute_waiters_take_the_leaders_result_each_a_copy(kind, request):
    backend = make(kind, request)
    started, release = threading.Event(), threading.Event()
    computed = []

    def compute():
        computed.append(1)
        started.set()
        assert release.wait(20)
        return {"steps": [1, 2]}

    results: list = []
    leader = threading.Thread(target=lambda: results.append(backend.get_or_compute("plan", compute)), daemon=True)
    leader.start()
    assert started.wait(20)
    waiters = [
        threading.Thread(target=lambda: results.append(backend.get_or_compute("plan", compute)), daemon=True)
        for _ in range(4)
    ]
    for w in waiters:
        w.start()
    deadline = time.monotonic() + 20
    while backend.stats().get("misses", 0) < 5 and time.monotonic() < deadline:  # every waiter has read its miss
        time.sleep(0.01)
    release.set()
    for t in [leader, *waiters]:
        t.join(20)
    try:
        assert computed == [1] and len(results) == 5 and all(r == {"steps": [1, 2]} for r in results)
        results[1]["steps"].append(3)  # a waiter's copy is its own
        assert results[2] == {"steps": [1, 2]} and backend.get("plan") == {"steps": [1, 2]}
    finally:
        backend.clear()


# ====================================================================== item 6: limits and the sentinel
def test_a_value_larger_than_max_bytes_is_refused_and_nothing_changes():
    store = TTLStore(max_bytes=1000, policy="lru")
    store.set("keep", "x" * 100)
    with pytest.raises(CapacityExceededError, match="max_bytes is 1000"):
        store.set("big", "y" * 5000)
    with pytest.raises(CapacityExceededError):
        store.set("keep", "y" * 5000)  # an overwrite too: the old value stays
    assert store.get("keep") == "x" * 100 and "big" not in store and store.bytes == 106
    backend = MemoryBackend(shards=1, max_bytes=1000)
    with pytest.raises(CapacityExceededError):
        backend.set("big", "z" * 5000)
    assert backend.get("big") is None and backend.stats()["bytes"] == 0
    store.set("fits", "w" * 990)  # exactly at the budget with its key: accepted, the rest evicted
    assert store.bytes <= 1000 and store.get("fits") == "w" * 990


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_a_user_value_equal_to_the_old_sentinel_reads_back_as_itself(kind, request):
    backend = make(kind, request)
    try:
        looks_like_a_miss = {"__memos_missing__": True}
        backend.set("k", looks_like_a_miss)
        assert backend.get("k") == looks_like_a_miss
        assert backend.get_or_compute("k", lambda: "recomputed") == looks_like_a_miss
        assert backend.get_many(["k"]) == {"k": looks_like_a_miss}
        assert backend.get_or_compute("nothing", lambda: None) is None  # negative caching still works
        assert backend.get_or_compute("nothing", lambda: "not called") is None
        assert backend.computations == 1 and backend.negative_hits == 1
        assert backend.get("nothing", "default") == "default" and backend.get_many(["nothing"]) == {}
        assert backend.update("nothing", lambda v: v, default="fresh") == "fresh"  # a cached miss is absent
    finally:
        backend.clear()


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_non_json_numbers_are_refused(kind, request):
    backend = make(kind, request)
    for bad in [float("nan"), float("inf"), {"x": [float("-inf")]}]:
        with pytest.raises(ConfigError, match="JSON"):
            backend.set("k", bad)
    assert backend.get("k") is None


# ====================================================================== item 7: the disk tier's budget and root
def test_disk_restart_with_a_smaller_budget_enforces_it_at_start(tmp_path):
    big = DiskBackend(tmp_path / "kv", 50_000)
    for i in range(40):
        assert big.put(f"k{i:02d}", bytes(1000))
    del big  # a restart: the first backend is gone (garbage-collected, as at a process exit)
    gc.collect()
    small = DiskBackend(tmp_path / "kv", 11_260)
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").glob("*/*.kvb"))
    assert small.nbytes <= 11_260 and on_disk == small.nbytes == 11_000
    assert sorted(small.keys()) == [f"k{i:02d}" for i in range(29, 40)]  # the most recently written kept


def test_disk_two_backends_of_one_process_share_the_budget(tmp_path):
    a, b = DiskBackend(tmp_path / "kv", 11_260), DiskBackend(tmp_path / "kv", 11_260)
    for i in range(20):
        assert (a if i % 2 else b).put(f"k{i:02d}", bytes(1000))
    on_disk = sum(p.stat().st_size for p in (tmp_path / "kv").glob("*/*.kvb"))
    assert on_disk <= 11_260 and a.nbytes == b.nbytes == on_disk


_HOLDER = textwrap.dedent(
    """
    import sys
    from memos_ref.tiering.backends import DiskBackend
    disk = DiskBackend(sys.argv[1], 11_260)
    disk.put("held", b"x" * 100)
    print("ready", flush=True)
    sys.stdin.readline()
    """
)


def test_disk_root_is_locked_against_a_second_process(tmp_path):
    root = tmp_path / "kv"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=os.getcwd(),
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(StateError, match=f"in use by another process \\(pid {holder.pid}\\)"):
            DiskBackend(root, 11_260)
        assert sorted(p.name for p in root.glob("*/*.kvb")) == ["held.kvb"]  # nothing touched
    finally:
        holder.stdin.close()
        holder.wait(30)
    second = DiskBackend(root, 11_260)  # the holder is gone: its lock went with it
    assert second.get("held") == b"x" * 100


def test_disk_lock_file_that_is_a_symlink_is_refused(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    os.symlink(tmp_path / "elsewhere", root / ".lock")
    with pytest.raises(ConfigError, match="symlink"):
        DiskBackend(root, 1000)
    assert not (tmp_path / "elsewhere").exists()


def _in_forked_child(fn) -> str:
    """Run ``fn()`` in a forked child; what it returned (or the class and message it raised), as a string."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report and leave without running the parent's finalizers or pytest's teardown
        try:
            try:
                out = f"returned {fn()!r}"
            except BaseException as exc:
                out = f"{type(exc).__name__}: {exc}"
            os.write(write_end, out.encode()[:4000])
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        with os.fdopen(read_end, "rb") as f:
            return f.read().decode()
    finally:
        os.waitpid(pid, 0)


def _disk_bytes(root) -> int:
    return sum(p.stat().st_size for p in root.glob("*/*.kvb"))


def test_disk_root_is_locked_against_a_forked_child(tmp_path):
    """A forked child inherits the process's books but not its record lock: a backend it makes on the root, or
    the parent's backend it inherited, raises StateError and writes nothing (before: 20,000 bytes on disk for a
    10,000 budget)."""
    root = tmp_path / "kv"
    parent = DiskBackend(root, 10_000)

    def second_backend():
        child = DiskBackend(root, 10_000)
        for i in range(10):
            child.put(f"c{i}", b"x" * 1000)

    assert _in_forked_child(second_backend).startswith("StateError: disk tier root")
    assert "StateError" in _in_forked_child(lambda: parent.put("c0", b"x" * 1000))
    assert _disk_bytes(root) == 0
    for i in range(10):
        assert parent.put(f"p{i}", b"y" * 1000)
    assert _disk_bytes(root) == 10_000 == parent.nbytes


def test_disk_backend_refuses_use_after_close(tmp_path):
    root = tmp_path / "kv"
    backend = DiskBackend(root, 10_000)
    assert backend.put("k", b"x" * 10)
    backend.close()
    for call in (lambda: backend.put("j", b"y"), lambda: backend.get("k"), lambda: backend.delete("k")):
        with pytest.raises(StateError, match="closed"):
            call()
    assert sorted(p.name for p in root.glob("*/*.kvb")) == ["k.kvb"]  # nothing written or removed
    assert DiskBackend(root, 10_000).get("k") == b"x" * 10  # the root is free again


def test_disk_lock_file_that_is_a_fifo_is_refused(tmp_path):
    root = tmp_path / "kv"
    root.mkdir()
    os.mkfifo(root / ".lock")
    with pytest.raises(ConfigError, match="not a regular file"):
        DiskBackend(root, 1000)
    assert sorted(p.name for p in root.iterdir()) == [".lock"]


def test_disk_file_resized_outside_updates_the_books_and_the_budget_holds(tmp_path):
    """A block file whose size differs from the books (replaced by someone else): the books take its real size and
    evict the least recently used others until the budget holds (before: books 3000, on disk 4500, budget 3000);
    one larger than the whole budget is dropped as corrupt."""
    root = tmp_path / "kv"
    backend = DiskBackend(root, 3000, max_item_bytes=5000)
    for key in ("aa", "bb", "cc"):
        assert backend.put(key, b"a" * 1000)
    (root / "bb" / "bb.kvb").write_bytes(b"B" * 2500)
    assert backend.get("bb") == b"B" * 2500  # the bytes are served: whether they are a block is the caller's check
    assert backend.keys() == ["bb"] and backend.counts["resized"] == 1 and backend.counts["evictions"] == 2
    assert backend.nbytes == _disk_bytes(root) == 2500
    (root / "bb" / "bb.kvb").write_bytes(b"C" * 4000)  # within max_item_bytes, over the budget: never fits
    assert backend.get("bb") is None and backend.counts["corrupt"] == 1
    assert backend.keys() == [] and backend.nbytes == _disk_bytes(root) == 0


# ====================================================================== item 9: re-entrant update
REENTRANT = {
    "get same key": lambda b: b.get("k"),
    "get another key": lambda b: b.get("other"),
    "set another key": lambda b: b.set("other", 1),
    "delete": lambda b: b.delete("k"),
    "nested update": lambda b: b.update("other", lambda v: 1),
    "get_or_compute": lambda b: b.get_or_compute("other", lambda: 1),
    "get_many": lambda b: b.get_many(["k", "other"]),
}


@pytest.mark.parametrize("call", list(REENTRANT))
@pytest.mark.parametrize("kind", ["memory-1-shard", "memory-4-shards", "redis"])
def test_update_whose_fn_calls_the_store_raises_instead_of_deadlocking(kind, call, request):
    backend = make(
        "redis" if kind == "redis" else "memory",
        request,
        **({} if kind == "redis" else {"shards": 1 if "1" in kind else 4}),
    )
    try:
        backend.set("k", 1)

        def fn(value):
            REENTRANT[call](backend)
            return value + 1

        outcome, value = run_bounded(lambda: backend.update("k", fn))
        assert outcome == "raised" and isinstance(value, StateError), (outcome, value)
        assert "inside update()'s fn" in str(value)
        assert backend.get("k") == 1 and backend.get("other") is None  # nothing changed
        assert backend.update("k", lambda v: v + 1) == 2  # and the store still works
    finally:
        backend.clear()


def test_update_in_one_thread_does_not_refuse_other_threads():
    backend = MemoryBackend(shards=4)
    inside, release = threading.Event(), threading.Event()

    def fn(value):
        inside.set()
        assert release.wait(20)
        return 1

    t = threading.Thread(target=lambda: backend.update("k", fn), daemon=True)
    t.start()
    assert inside.wait(20)
    backend.set("other", 2)  # another thread, another shard: allowed while fn runs
    assert backend.get("other") == 2
    release.set()
    t.join(20)
    assert backend.get("k") == 1


def test_ttl_store_update_refuses_reentry():
    store = TTLStore()
    with pytest.raises(StateError):
        store.update("k", lambda v: store.get("k"))
    assert "k" not in store


# ====================================================================== item 10: a hung server
TIMEOUT = 1.0  # the configured timeout; each call must return within TIMEOUT + SLACK
SLACK = 0.5  # scheduling on a loaded 2-core machine; one extra round trip would take another full TIMEOUT


def test_every_call_is_bounded_by_one_timeout_while_redis_is_stopped():
    if redis_server_path() is None and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed here (apt-get install -y redis-server)")
    server = RedisServer().start()
    mem = RedisBackend(server.url, tenant="hung", timeout=TIMEOUT, failure_threshold=1000, retry_after=0.0)
    tier = RedisTierBackend(
        server.url, fingerprint="ab" * 8, tenant="hung", timeout=TIMEOUT, failure_threshold=1000, retry_after=0.0
    )
    mem.set("k", 1)
    tier.put("blk", b"data")
    calls = {
        "get": lambda: mem.get("k", "miss") == "miss",
        "set": lambda: mem.set("k", 2) is None,
        "update": lambda: _raises(BackendUnavailableError, lambda: mem.update("k", lambda v: 3, default=0)),
        "delete": lambda: mem.delete("k") is False,
        "get_many": lambda: mem.get_many(["k", "j"]) == {},
        "set_many": lambda: mem.set_many({"a": 1, "b": 2}) is None,
        "get_or_compute": lambda: mem.get_or_compute("c", lambda: 5) == 5,
        "len": lambda: _raises(BackendUnavailableError, lambda: len(mem)),  # unknown, not 0
        "clear": lambda: mem.clear() is None,
        "stats": lambda: "errors" in (stats := mem.stats()) and "size" not in stats,
        "tier get": lambda: tier.get("blk") is None,
        "tier put": lambda: tier.put("blk", b"x") is False,
        "tier get_many": lambda: tier.get_many(["blk"]) == {},
        "tier put_many": lambda: tier.put_many({"blk": b"x"}) == {"blk": False},
        "tier keys": lambda: tier.keys() == [],
        "tier nbytes": lambda: tier.nbytes == 0,
        "tier stats": lambda: "blocks" in tier.stats(),
        "tier clear": lambda: tier.clear() is None,
    }
    os.kill(server.process.pid, signal.SIGSTOP)
    slow, wrong, errors = {}, [], {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for name, call in calls.items():
                client = tier.redis if name.startswith("tier") else mem.redis
                before = client.counts["errors_timeout"]
                started = time.monotonic()
                if not call():
                    wrong.append(name)
                elapsed = time.monotonic() - started
                errors[name] = client.counts["errors_timeout"] - before
                if elapsed > TIMEOUT + SLACK:
                    slow[name] = round(elapsed, 2)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        server.stop()
    assert not wrong, f"answers other than a miss / a dropped write: {wrong}"
    assert errors == dict.fromkeys(calls, 1), "each call must wait on exactly one timed-out round trip"
    assert not slow, f"calls past {TIMEOUT} + {SLACK} s: {slow}"


def test_redis_tier_contains_agrees_with_get_for_a_key_of_another_type(redis_server):
    tier = RedisTierBackend(redis_server.url, fingerprint="cd" * 8, tenant="wrongtype")
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    try:
        raw.rpush(tier.prefix + "blk", "a")
        assert tier.get("blk") is None and tier.get_many(["blk"]) == {}
        assert tier.contains("blk") is False  # get says absent: contains agrees
        assert tier.put("blk", b"data") and tier.contains("blk") and tier.get("blk") == b"data"
    finally:
        tier.clear()


# ====================================================================== beyond the named cases
@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_set_many_with_one_bad_item_writes_nothing(kind, request):
    backend = make(kind, request)
    try:
        with pytest.raises(ConfigError):
            backend.set_many({"a": 1, "b": object(), "c": 3})
        assert backend.get_many(["a", "b", "c"]) == {}
    finally:
        backend.clear()


@pytest.mark.parametrize("kind", ["memory", "redis"])
@pytest.mark.parametrize("ttl", [True, False])
def test_a_bool_ttl_is_refused(kind, ttl, request):
    from memos_ref.errors import ArgumentTypeError

    backend = make(kind, request)
    try:
        with pytest.raises(ArgumentTypeError, match="bool"):
            backend.set("k", 1, ttl=ttl)
        assert backend.get("k") is None
    finally:
        backend.clear()


# ====================================================================== follow-up review (H9 items 5, 7, 8, 13, 14)
@pytest.mark.parametrize(
    "planted", [b"NaN", b"-Infinity", b"[1,Infinity]", b"1e999", b'{"a":-1e400}', b'"\xed\xa0\x80"']
)
def test_redis_planted_non_json_numbers_and_raw_surrogates_are_corrupt_misses(redis_server, planted):
    """What this store's writes refuse (NaN, infinities, a surrogate encoded as UTF-8 bytes) is not served when
    another client plants it: a miss counted corrupt (before: get returned nan, inf or a lone surrogate)."""
    b = RedisBackend(redis_server.url, namespace="planted", tenant=f"t{next(_tenants)}")
    with pytest.raises(ConfigError):
        b.set("k", float("nan"))
    raw_client(b).set(b.prefix + "k", planted)
    assert b.get("k", "miss") == "miss" and b.get_many(["k"]) == {}
    assert b.stats()["corrupt"] == 2
    assert b.update("k", lambda v: [v], default="absent") == ["absent"]  # read as absent, then overwritten


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_get_or_compute_reentered_for_its_own_key_raises_instead_of_hanging(kind, request):
    backend = make(kind, request)
    outcome, value = run_bounded(lambda: backend.get_or_compute("k", lambda: backend.get_or_compute("k", lambda: 1)))
    assert outcome == "raised" and isinstance(value, StateError), (outcome, value)
    assert "inside its own compute()" in str(value)
    assert backend.get("k") is None  # nothing stored by the failed flight
    assert backend.get_or_compute("k", lambda: 2) == 2  # the flight was cleared: the key computes again
    assert backend.get_or_compute("j", lambda: backend.get_or_compute("i", lambda: 3)) == 3  # other keys: fine


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_get_or_compute_waiter_gives_up_after_wait_s(kind, request):
    """A leader whose compute hangs does not block its waiters forever: after ``wait_s`` they raise
    BackendUnavailableError; the leader's flight goes on and stores its value."""
    backend = make(kind, request)
    started, release = threading.Event(), threading.Event()

    def slow():
        started.set()
        release.wait(30)
        return "leader"

    leader = threading.Thread(target=lambda: backend.get_or_compute("k", slow), daemon=True)
    leader.start()
    assert started.wait(30)
    outcome, value = run_bounded(lambda: backend.get_or_compute("k", lambda: "waiter", wait_s=0.05))
    assert outcome == "raised" and isinstance(value, BackendUnavailableError), (outcome, value)
    assert "wait_s=0.05" in str(value) and backend.computations == 1  # the waiter computed nothing
    release.set()
    leader.join(30)
    assert backend.get("k") == "leader"
    with pytest.raises(ConfigError, match="wait_s"):
        backend.get_or_compute("k", lambda: 1, wait_s=0)


def test_sharded_store_limits_are_for_the_whole_store():
    """``ShardedStore(4, max_bytes=1000)`` holds at most 1000 bytes (before: 1000 per shard, 3220 in all)."""
    store = ShardedStore(4, max_bytes=1000)
    for i in range(100):
        store.set(f"k{i}", "x" * 100)
    held = sum(shard.bytes for shard in store.shards)
    assert 0 < held <= 1000 and store.max_bytes == 1000
    by_entries = ShardedStore(4, max_entries=10)
    for i in range(100):
        by_entries.set(f"k{i}", i)
    assert 0 < len(by_entries) <= 10 and by_entries.max_entries == 8  # 10 // 4 per shard
    with pytest.raises(CapacityExceededError):  # larger than one shard's share: could never be held
        store.set("big", "x" * 300)
    with pytest.raises(ConfigError, match="split across 4 shards"):
        ShardedStore(4, max_entries=3)


def test_redis_update_on_an_unreachable_server_raises_and_claims_nothing():
    """Issue 24 item 4: never claim a write that did not happen (before: update returned fn(default))."""
    if redis_server_path() is None and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed here (apt-get install -y redis-server)")
    server = RedisServer().start()
    b = RedisBackend(server.url, tenant="gone", retry_after=60.0)
    assert b.update("k", lambda v: v + 1, default=0) == 1 and len(b) == 1
    server.stop()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(BackendUnavailableError, match="stored nothing"):
            b.update("k", lambda v: v + 1, default=0)
        with pytest.raises(BackendUnavailableError, match="unknown"):
            len(b)
        stats = b.stats()
    assert stats["dropped_sets"] == 1 and "size" not in stats


@pytest.mark.parametrize("kind", ["memory", "redis"])
def test_ttl_of_an_absent_or_negatively_cached_key_is_a_package_key_error(kind, request):
    backend = make(kind, request)
    assert backend.get_or_compute("neg", lambda: None) is None
    for key in ("neg", "absent"):
        with pytest.raises(AbsentKeyError) as info:
            backend.ttl(key)
        assert isinstance(info.value, KeyError) and isinstance(info.value, KVCacheError)
        assert key not in backend and backend.get(key) is None  # ttl agrees with in and get
    backend.set("live", 1, ttl=100)
    assert 0 < backend.ttl("live") <= 100
