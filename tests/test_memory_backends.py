"""One test suite for every short-term memory backend: the in-process MemoryBackend and RedisBackend against a
real redis-server started on a free loopback port (seed 002 §5.2). Plus what only Redis has: namespacing,
JSON on the wire, degraded mode and the timeout bound.

Time: the memory backend runs on a fake clock; Redis expires keys on its own clock, so its tests sleep. TTLs
are multiples of ``U`` seconds with margins of at least half a ``U`` either side of every expiry.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import threading
import time
import warnings

import pytest

from memos_ref.errors import (
    ArgumentTypeError,
    BackendDegradedWarning,
    BackendUnavailableError,
    CapacityExceededError,
    ConfigError,
    InvalidArgumentError,
)
from memos_ref.memory import MemoryBackend, MemoryMetrics, RedisBackend, RedisServer, redis_server_path

U = 0.4  # seconds per TTL unit on Redis (real time)
_tenants = itertools.count()


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """Builds backends of one kind and moves their time forward."""

    def __init__(self, kind: str, server: RedisServer | None) -> None:
        self.kind, self.server = kind, server
        self.clock = FakeClock()
        self.made: list = []

    def make(self, **kwargs):
        if self.kind == "memory":
            backend = MemoryBackend(shards=4, clock=self.clock, **kwargs)
        else:
            backend = RedisBackend(self.server.url, namespace="test", tenant=f"t{next(_tenants)}", **kwargs)
        self.made.append(backend)
        return backend

    def advance(self, units: float) -> None:
        if self.kind == "memory":
            self.clock.now += units * U
        else:
            time.sleep(units * U)


@pytest.fixture(params=["memory", "redis"])
def harness(request):
    server = request.getfixturevalue("redis_server") if request.param == "redis" else None
    h = Harness(request.param, server)
    yield h
    for backend in h.made:
        backend.clear()


def test_round_trip_returns_a_copy(harness):
    b = harness.make()
    value = {"tool": "search", "hits": [1, 2, {"n": None}], "ok": True, "score": 0.5}
    b.set("r:1", value)
    got = b.get("r:1")
    assert got == value
    got["hits"].append(99)  # seed 002 §7.1: mutating what get returned must not change the store
    assert b.get("r:1") == value
    assert b.get("absent") is None and b.get("absent", "dflt") == "dflt"
    assert "r:1" in b and "absent" not in b


def test_get_never_extends_the_ttl_and_overwrite_restarts_it(harness):
    b = harness.make()
    b.set("k", 1, ttl=4 * U)
    harness.advance(3)
    assert b.get("k") == 1  # read at 3 U of 4 ...
    harness.advance(1.5)
    assert b.get("k") is None  # ... did not extend it (seed 002 §7.2)
    b.set("k", 2, ttl=4 * U)
    harness.advance(3)
    b.set("k", 3, ttl=4 * U)  # an overwrite restarts the TTL
    harness.advance(3)
    assert b.get("k") == 3  # 6 U after the first write, 3 U after the second
    harness.advance(1.5)
    assert b.get("k") is None


def test_remaining_ttl(harness):
    b = harness.make(default_ttl=10 * U)
    b.set("a", 1)
    b.set("forever", 2, ttl=None)
    assert 9 * U < b.ttl("a") <= 10 * U
    assert b.ttl("forever") is None
    with pytest.raises(KeyError):
        b.ttl("absent")


def test_bad_input_is_refused_and_changes_nothing(harness):
    b = harness.make(max_value_bytes=64)
    b.set("k", "small")
    with pytest.raises(CapacityExceededError, match="largest allowed is 64"):
        b.set("k", "x" * 100)  # seed 002 §7.3: refused, and the old value stays
    assert b.get("k") == "small"
    with pytest.raises(ConfigError, match="not JSON-serialisable"):
        b.set("k", {1, 2})
    assert b.get("k") == "small"
    for bad in ["", "has space", "new\nline", "x" * 251]:
        with pytest.raises(ConfigError, match="invalid key"):
            b.set(bad, 1)
    with pytest.raises(InvalidArgumentError, match="ttl must be a finite number"):
        b.set("k", 1, ttl=0)
    assert b.get("k") == "small"
    assert b.stats()["sets"] == 1


def test_delete_clear_and_counts(harness):
    b = harness.make()
    b.set_many({"a": 1, "b": 2, "c": 3})
    assert b.get_many(["a", "c", "zz"]) == {"a": 1, "c": 3}
    assert b.delete("a") is True and b.delete("a") is False
    assert b.get("a") is None
    stats = b.stats()
    assert (stats["hits"], stats["misses"], stats["sets"], stats["size"]) == (2, 2, 3, 2)
    b.clear()
    assert b.get_many(["b", "c"]) == {} and b.stats()["size"] == 0


def test_single_flight_computes_once_under_threads(harness):
    b = harness.make()
    barrier = threading.Barrier(8)
    results = []

    def slow():
        time.sleep(0.2)
        return {"answer": 42}

    def worker():
        barrier.wait()
        results.append(b.get_or_compute("expensive", slow))

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [{"answer": 42}] * 8
    assert b.stats()["computations"] == 1


def test_negative_caching_of_misses(harness):
    b = harness.make(negative_ttl=2 * U)
    calls = []

    def lookup():
        calls.append(1)
        return None  # nothing found

    assert b.get_or_compute("user:404", lookup) is None
    assert b.get_or_compute("user:404", lookup) is None  # answered by the cached miss
    assert len(calls) == 1 and b.stats()["negative_hits"] == 1
    harness.advance(3)
    assert b.get_or_compute("user:404", lookup) is None  # the negative entry expired: computed again
    assert len(calls) == 2


def test_ttl_jitter_spreads_expiry(harness):
    b = harness.make(ttl_jitter=0.2, default_ttl=100.0)
    b.set_many({f"k{i}": i for i in range(50)})
    ttls = [b.ttl(f"k{i}") for i in range(50)]
    assert all(80.0 - 1 <= t <= 120.0 for t in ttls)
    assert max(ttls) - min(ttls) > 10.0  # spread, not one cliff (50 uniform draws on a 40 s range)


def test_metrics_exposition(harness):
    b = harness.make()
    b.set("k", 1)
    b.get("k")
    b.get("nope")
    text = MemoryMetrics(b).exposition()
    assert f'memos_memory_hits_total{{backend="{b.name}"}} 1.0' in text
    assert f'memos_memory_misses_total{{backend="{b.name}"}} 1.0' in text
    assert f'memos_memory_entries{{backend="{b.name}"}} 1.0' in text


def _increment_concurrently(increment, threads: int, rounds: int) -> None:
    """``threads`` threads call ``increment()`` ``rounds`` times each, released together."""
    start = threading.Barrier(threads)

    def worker():
        start.wait()
        for _ in range(rounds):
            increment()

    workers = [threading.Thread(target=worker) for _ in range(threads)]
    for t in workers:
        t.start()
    for t in workers:
        t.join()


def _bump(n: int) -> int:
    time.sleep(0)  # give the GIL away inside the read-modify-write: a non-atomic update would lose writes here
    return n + 1


def test_update_is_atomic_under_threads(harness):
    """N threads x M increments through ``update`` end at exactly N*M (the shard lock, or WATCH/MULTI on Redis)."""
    b = harness.make()
    threads, rounds = (8, 200) if harness.kind == "memory" else (4, 25)
    _increment_concurrently(lambda: b.update("tool_calls", _bump, default=0), threads, rounds)
    assert b.get("tool_calls") == threads * rounds


def test_get_then_set_loses_updates_which_update_does_not(harness):
    """Why ``update`` exists: a ``get`` then a ``set`` is two operations, and when every thread reads before any
    writes (forced here by a barrier between the two), N increments leave the counter at 1."""
    b = harness.make()
    threads = 4
    b.set("n", 0)
    window = threading.Barrier(threads)

    def get_then_set():
        seen = b.get("n")
        window.wait()  # every thread has read before any writes
        b.set("n", seen + 1)

    _increment_concurrently(get_then_set, threads, 1)
    assert b.get("n") == 1  # threads - 1 updates lost
    b.set("n", 0)
    _increment_concurrently(lambda: b.update("n", _bump), threads, 1)
    assert b.get("n") == threads


def test_update_default_ttl_and_result(harness):
    b = harness.make(default_ttl=2 * U)
    assert b.update("log", lambda calls: [*calls, "search"], default=[]) == ["search"]
    assert b.update("log", lambda calls: [*calls, "read"], default=[]) == ["search", "read"]
    assert b.get("log") == ["search", "read"]
    assert b.update("forever", lambda _: 1, ttl=None) == 1 and b.ttl("forever") is None
    harness.advance(3)
    assert b.get("log") is None  # the write restarted the default TTL, which has now passed
    assert b.update("log", lambda calls: [*calls, "again"], default=[]) == ["again"]  # expired: default again
    stats = b.stats()
    assert stats["sets"] == 4 and stats["hits"] >= 1


def test_update_that_fails_changes_nothing(harness):
    b = harness.make(max_value_bytes=64)
    b.set("k", "small")
    before = b.stats()["sets"]

    def explode(_):
        raise ValueError("tool failed")

    with pytest.raises(ValueError, match="tool failed"):
        b.update("k", explode)
    with pytest.raises(CapacityExceededError, match="largest allowed is 64"):
        b.update("k", lambda v: v * 100)
    with pytest.raises(ConfigError, match="not JSON-serialisable"):
        b.update("k", lambda v: {v})
    with pytest.raises(ArgumentTypeError, match="fn: expected a callable"):
        b.update("k", "not callable")
    with pytest.raises(ConfigError, match="invalid key"):
        b.update("has space", _bump, default=0)
    with pytest.raises(InvalidArgumentError, match="ttl must be a finite number"):
        b.update("k", _bump, ttl=0)
    assert b.get("k") == "small" and b.stats()["sets"] == before


# ---------------------------------------------------------------------- Redis only
def test_redis_keys_are_namespaced_json(redis_server):
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    a = RedisBackend(redis_server.url, namespace="app", tenant="alice")
    b = RedisBackend(redis_server.url, namespace="app", tenant="bob")
    try:
        a.set("plan", {"steps": 3})
        b.set("plan", {"steps": 7})
        assert a.get("plan") == {"steps": 3} and b.get("plan") == {"steps": 7}
        assert json.loads(raw.get("app:alice:plan")) == {"steps": 3}  # plain JSON on the wire, never pickle
        a.clear()
        assert a.get("plan") is None and b.get("plan") == {"steps": 7}  # clear touched only alice's keys
        assert 0 < raw.pttl("app:bob:plan") <= 300_000  # a native TTL (the default 300 s)
    finally:
        b.clear()
    for bad in ["", "a:b", "a*", "x" * 65]:
        with pytest.raises(ConfigError, match="namespace must be"):
            RedisBackend(redis_server.url, namespace=bad)


def test_redis_degraded_mode_and_recovery():
    if redis_server_path() is None and not os.environ.get("CI"):
        pytest.skip("redis-server is not installed here (apt-get install -y redis-server)")
    clock = FakeClock()
    server = RedisServer().start()
    b = RedisBackend(server.url, clock=clock, retry_after=5.0, tenant="degraded")
    b.set("k", "v")
    server.stop()  # the server goes away
    with pytest.warns(BackendDegradedWarning, match="unreachable"):
        assert b.get("k", "fallback") == "fallback"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # warned once, not on every call
        b.set("k2", 1)  # dropped, not raised
        assert b.get("k2") is None and b.delete("k") is False
        assert b.get_or_compute("c", lambda: 7) == 7
    stats = b.stats()
    assert stats["degraded"] == 1 and stats["errors"] == 1 and stats["dropped_sets"] == 2
    assert stats["degraded_ops"] == 6  # the failed call and 5 answered without touching the network
    restarted = RedisServer(port=server.port).start()
    try:
        assert b.get("k") is None  # still inside retry_after: not tried yet
        clock.now += 5.0
        b.set("k", "back")
        assert b.get("k") == "back" and b.stats()["reconnects"] == 1 and b.stats()["degraded"] == 0
    finally:
        b.clear()
        restarted.stop()


def test_redis_never_blocks_past_its_timeout():
    """A server that accepts connections but never answers: each call returns after about ``timeout``."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    try:
        b = RedisBackend(f"redis://127.0.0.1:{port}/0", timeout=0.05, failure_threshold=3)
        started = time.monotonic()
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a timeout is not yet a dead server: no warning before the threshold
            assert b.get("k", "fallback") == "fallback" and b.get("k", "fallback") == "fallback"
        assert not b._degraded()
        with pytest.warns(BackendDegradedWarning, match="3 consecutive failures"):
            assert b.get("k", "fallback") == "fallback"
        assert time.monotonic() - started < 3.0  # a correctness bound (3 × 0.05 s configured), not a speed claim
        assert b._degraded() and b.stats()["errors_timeout"] == 3
    finally:
        listener.close()


def test_redis_server_helper_errors(monkeypatch):
    monkeypatch.setattr("memos_ref.memory.redis_server.shutil.which", lambda name: None)
    with pytest.raises(BackendUnavailableError, match="apt-get install -y redis-server"):
        RedisServer().start()
    with pytest.raises(ConfigError, match="port must be"):
        RedisServer(port=70000)
