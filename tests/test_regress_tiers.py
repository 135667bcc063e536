"""Regression tests (issue 13, items 11, 12, 13 and 16 for tiering/ and memory/): the tiers and the short-term
memory store under attack and faults. None of these may crash a caller, serve wrong KV, hang, allocate without
bound, or touch anything outside the cache's own root.

Attacks on the disk tier use ``tmp_path`` with an ``outside`` folder that must stay exactly as it was. Calls that
blocked forever on the old code run in a thread with a join timeout, so a regression fails instead of hanging.
The Redis tests run against a real ``redis-server`` (the ``redis_server`` fixture of ``conftest.py``); replies a
single server cannot give (``READONLY``, ``MOVED``) are raised by a patched client.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
import tracemalloc
import warnings
from fractions import Fraction

import pytest
import torch
from safetensors.torch import save as st_save

from memos_ref.errors import (
    ArgumentTypeError,
    BackendDegradedWarning,
    ConfigError,
    InvalidArgumentError,
    KVCacheError,
)
from memos_ref.memory import MemoryBackend, RedisBackend, RedisServer, TTLStore
from memos_ref.resilient import ResilientRedis, validate_ttl
from memos_ref.spec import KVSpec
from memos_ref.tiering.backends import DiskBackend, HostMemoryBackend, RedisTierBackend
from memos_ref.tiering.blockfile import FORMAT, decode_block, encode_block
from memos_ref.tiering.codecs import Codec, get_codec
from memos_ref.tiering.store import Tier, TierStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float16)
FP = "a1b2c3d4e5f60718"
JOIN_S = 10.0  # how long a call that must return at once may take before the test calls it a hang


def block(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SPEC.block_shape, generator=g).to(SPEC.dtype)


def snapshot(folder) -> dict[str, bytes]:
    """Every file below ``folder`` (relative name -> contents): what 'untouched' means."""
    out = {}
    for dirpath, _, files in os.walk(folder):
        for name in files:
            full = os.path.join(dirpath, name)
            with open(full, "rb") as fh:
                out[os.path.relpath(full, folder)] = fh.read()
    return out


def run_bounded(fn, timeout: float = JOIN_S):
    """Run ``fn`` in a daemon thread; fail (rather than hang) if it has not returned after ``timeout``."""
    result: dict = {}

    def target() -> None:
        try:
            result["value"] = fn()
        except BaseException as exc:  # reported to the test below
            result["error"] = exc

    t = threading.Thread(target=target, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), f"call did not return within {timeout} s (blocked)"
    if "error" in result:
        raise result["error"]
    return result["value"]


# ====================================================================== item 11: the disk tier
@pytest.fixture
def outside(tmp_path):
    folder = tmp_path / "outside"
    (folder / "ab").mkdir(parents=True)
    (folder / "abvictim.kvb").write_bytes(b"precious data outside the cache root")
    (folder / "ab" / "abcd.kvb").write_bytes(b"another precious file")
    (folder / "secret.txt").write_bytes(b"a secret")
    return folder


def test_disk_symlinked_shard_dir_at_start_is_neither_adopted_nor_written_through(tmp_path, outside):
    root = tmp_path / "kv"
    root.mkdir()
    os.symlink(outside, root / "ab")  # a shard directory that is a symlink to a folder outside the root
    before = snapshot(outside)
    disk = DiskBackend(root, 10_000)
    assert disk.keys() == []  # outside/abvictim.kvb was not adopted (eviction would have deleted it)
    assert disk.put("abcd", b"x" * 100) is False  # refused: it would be written outside
    assert disk.put("abzz", b"y" * 100) is False
    assert disk.get("abcd") is None and disk.stats()["unsafe"] >= 2
    for i in range(30):  # plenty of puts and evictions in other shards
        disk.put(f"k{i:02d}", bytes(1000))
    assert snapshot(outside) == before
    assert disk.nbytes <= 10_000


def test_disk_shard_dir_replaced_by_symlink_later_deletes_and_serves_nothing_outside(tmp_path, outside):
    root = tmp_path / "kv"
    disk = DiskBackend(root, 10_000)
    assert disk.put("abcd", b"mine" * 10)
    (root / "ab" / "abcd.kvb").unlink()
    (root / "ab").rmdir()
    os.symlink(outside / "ab", root / "ab")  # swapped for a symlink to a folder holding a file of the same name
    before = snapshot(outside)
    assert disk.get("abcd") is None  # the outside file is not served
    assert disk.put("abcd", b"new") is False  # and not overwritten
    disk.delete("abcd")
    disk2 = DiskBackend(root, 10_000)  # a restart, then eviction of everything
    for i in range(30):
        disk2.put(f"k{i:02d}", bytes(1000))
    assert snapshot(outside) == before


def test_disk_eviction_through_a_symlinked_shard_deletes_nothing_outside(tmp_path, outside):
    root = tmp_path / "kv"
    disk = DiskBackend(root, 300)
    assert disk.put("abcd", bytes(100))
    (root / "ab" / "abcd.kvb").unlink()
    (root / "ab").rmdir()
    os.symlink(outside / "ab", root / "ab")
    before = snapshot(outside)
    for i in range(5):  # abcd is the least recently used: evicted first
        disk.put(f"zz{i}", bytes(100))
    assert not disk.contains("abcd")
    assert snapshot(outside) == before


def test_disk_block_file_symlinked_to_a_file_outside_is_not_served(tmp_path, outside):
    disk = DiskBackend(tmp_path / "kv", 10_000)
    assert disk.put("abcd", b"mine")
    path = disk.path("abcd")
    path.unlink()
    os.symlink(outside / "secret.txt", path)
    before = snapshot(outside)
    assert disk.get("abcd") is None
    assert disk.stats()["corrupt"] == 1 and not os.path.lexists(path)  # the planted link is removed
    assert disk.put("abcd", b"again") and disk.get("abcd") == b"again"
    assert snapshot(outside) == before


def test_disk_fifo_planted_as_a_block_file_is_a_prompt_miss(tmp_path):
    disk = DiskBackend(tmp_path / "kv", 10_000)
    assert disk.put("abcd", b"mine")
    path = disk.path("abcd")
    path.unlink()
    os.mkfifo(path)
    try:
        assert run_bounded(lambda: disk.get("abcd")) is None
    finally:  # on a regression the reader thread waits for a writer: give it one so it ends
        try:
            fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            os.close(fd)
        except OSError:
            pass
    assert disk.stats()["corrupt"] == 1
    assert run_bounded(lambda: disk.put("abcd", b"back")) and disk.get("abcd") == b"back"  # the lock was freed


def test_disk_symlink_to_dev_zero_is_a_miss_counted_corrupt(tmp_path):
    disk = DiskBackend(tmp_path / "kv", 10_000)
    store = TierStore([Tier(disk)], spec=SPEC, fingerprint=FP)
    assert store.put("abcd", block(), "disk")
    path = disk.path("abcd")
    path.unlink()
    os.symlink("/dev/zero", path)
    assert run_bounded(lambda: store.get("abcd")) is None
    assert store.stats()["disk"]["corrupt"] == 1


def test_disk_oversized_file_is_not_read(tmp_path):
    """A regular file far larger than any block file of the geometry: refused by its size, before reading."""
    disk = DiskBackend(tmp_path / "kv", 1 << 26)
    store = TierStore([Tier(disk)], spec=SPEC, fingerprint=FP)
    assert store.put("abcd", block(), "disk")
    disk.path("abcd").write_bytes(bytes(8 << 20))
    tracemalloc.start()
    try:
        assert store.get("abcd") is None
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"reading a refused file allocated {peak} bytes"
    assert store.stats()["disk"]["corrupt"] == 1


def test_disk_start_keeps_another_process_temp_file(tmp_path):
    from memos_ref.tiering.backends import temp_name

    first = DiskBackend(tmp_path / "kv", 10_000)
    first.put("abcd", b"x")
    shard = first.path("abcd").parent
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        in_flight = shard / temp_name(pid=writer.pid)  # another live process is writing this one
        in_flight.write_bytes(b"half a block, still being written")
        mine = shard / temp_name()  # another backend in this very process
        mine.write_bytes(b"also in flight")
        dead = shard / temp_name(pid=2**30)  # no process can have this pid: abandoned
        dead.write_bytes(b"left by a crash")
        DiskBackend(tmp_path / "kv", 10_000)
        assert in_flight.exists() and mine.exists() and not dead.exists()
    finally:
        writer.kill()
        writer.wait()


_COLLECT_INSIDE_THE_CONSTRUCTOR = """
import gc, subprocess, sys
from memos_ref.tiering import disk_backend
from memos_ref.tiering.backends import DiskBackend

gc.disable()  # the collection happens where this script says, not at some allocation before it
old_root, new_root = sys.argv[1:]
old = DiskBackend(old_root, 10_000)
old.cycle = old  # only the garbage collector can free it now
del old
take_root = disk_backend._lock_root  # called inside the constructor's critical section (a new root's lock)

def collect_then_take(root):
    gc.collect()  # runs the old backend's finalizer here, as an allocation there could
    return take_root(root)

disk_backend._lock_root = collect_then_take
new = DiskBackend(new_root, 10_000)  # kept alive: its own release would drain the queue
other = "import sys; from memos_ref.tiering.backends import DiskBackend; DiskBackend(sys.argv[1], 10_000)"
taken = subprocess.run([sys.executable, "-c", other, old_root], capture_output=True, text=True, timeout=60)
print("the old root, from another process:", taken.returncode, taken.stderr.strip().splitlines()[-1:])
sys.exit(taken.returncode)
"""


def test_a_backend_collected_inside_another_backends_constructor_neither_deadlocks_nor_keeps_its_root(tmp_path):
    """The garbage collector can run a dead backend's finalizer in the middle of a new backend's constructor, which
    holds the module's lock on the roots (a CI worker beside a CPU hog hung there for good). The finalizer must not
    wait for that lock, and the release must still happen by the time the constructor returns: another process
    can then take the old root."""
    import memos_ref

    here = os.path.dirname(os.path.dirname(memos_ref.__file__))  # the child imports the package this test does
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-c", _COLLECT_INSIDE_THE_CONSTRUCTOR, str(tmp_path / "old"), str(tmp_path / "new")],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert run.returncode == 0, f"rc {run.returncode}: {run.stdout}{run.stderr}"


def test_disk_start_survives_dangling_symlinks_and_odd_entries(tmp_path):
    root = tmp_path / "kv"
    first = DiskBackend(root, 10_000)
    first.put("abcd", b"x" * 10)
    os.symlink(tmp_path / "nowhere", root / "ab" / "abzz.kvb")  # a dangling block file
    os.symlink(tmp_path / "nowhere", root / "cd")  # a dangling shard directory
    os.mkfifo(root / "ab" / "abff.kvb")
    (root / "ab" / "abdd.kvb").mkdir()  # a directory where a file belongs
    (root / "ef").write_bytes(b"a file where a shard directory belongs")
    second = run_bounded(lambda: DiskBackend(root, 10_000))
    assert second.keys() == ["abcd"] and second.get("abcd") == b"x" * 10


def test_disk_start_survives_a_read_only_directory(tmp_path, monkeypatch):
    """Root ignores permission bits, so a read-only file system is simulated: every unlink fails."""
    root = tmp_path / "kv"
    first = DiskBackend(root, 10_000)
    first.put("abcd", b"x" * 10)
    stale = first.path("abcd").parent / ".tmp-crashed"
    stale.write_bytes(b"half")
    os.utime(stale, (1.0, 1.0))

    def read_only(*args, **kwargs):
        raise PermissionError(30, "Read-only file system")

    monkeypatch.setattr(os, "unlink", read_only)
    second = DiskBackend(root, 10_000)
    assert second.get("abcd") == b"x" * 10 and stale.exists()


def test_disk_start_survives_an_unreadable_shard(tmp_path, monkeypatch):
    root = tmp_path / "kv"
    first = DiskBackend(root, 10_000)
    first.put("abcd", b"x" * 10)
    first.put("cdef", b"y" * 10)
    real = os.scandir

    def scandir(path=".", *a):
        if not isinstance(path, int) and os.path.basename(os.fspath(path)) == "ab":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        if isinstance(path, int) and os.path.basename(os.readlink(f"/proc/self/fd/{path}")) == "ab":
            raise PermissionError(13, "Permission denied")
        return real(path, *a)

    monkeypatch.setattr(os, "scandir", scandir)
    second = DiskBackend(root, 10_000)
    monkeypatch.undo()
    assert second.keys() == ["cdef"]


# ====================================================================== item 12: decompression bombs
def bomb(codec: str, raw_size: int = 8 << 20, *, sized: bool = True) -> bytes:
    """A block file whose header is valid for SPEC but whose payload decompresses to ``raw_size`` bytes."""
    zeros = bytes(raw_size)
    if codec.startswith("lz4"):
        import lz4.frame

        payload = lz4.frame.compress(zeros, store_size=sized)
    elif codec.startswith("zstd"):
        import zstandard

        payload = zstandard.ZstdCompressor(level=3, write_content_size=sized).compress(zeros)
    else:
        payload = zeros
    meta = {
        "format": FORMAT,
        "fingerprint": FP,
        "spec": json.dumps(SPEC.to_dict(), sort_keys=True),
        "codec": codec,
        "raw_nbytes": str(SPEC.bytes_per_block),  # what the geometry expects: the old check passed
        "checksum": "0" * 32,
        "key": "bomb",
    }
    return st_save({"payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}, metadata=meta)


BOMBS = [
    ("lz4", True),
    ("lz4", False),
    ("lz4+shuffle", True),
    ("zstd-3", True),
    ("zstd-3", False),
    ("zstd-3+shuffle", True),
]


def peak_of(fn) -> tuple[object, int]:
    tracemalloc.start()
    try:
        out = fn()
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(("codec", "sized"), BOMBS)
def test_decode_of_a_bomb_is_refused_with_bounded_allocation(codec, sized):
    data = bomb(codec, sized=sized)
    assert len(data) < 64 * 1024  # a small file ...

    def decode():
        with pytest.raises(KVCacheError):
            decode_block(data, spec=SPEC, fingerprint=FP, key="bomb")

    _, peak = peak_of(decode)
    assert peak < 1 << 20, f"a {len(data)}-byte file made decoding allocate {peak} bytes"  # ... stays small


def test_uncompressed_payload_larger_than_the_geometry_is_refused_before_copying():
    data = bomb("none", 2 << 20)

    def decode():
        with pytest.raises(KVCacheError):
            decode_block(data, spec=SPEC, fingerprint=FP)

    _, peak = peak_of(decode)
    assert peak < 1 << 20, f"refusing a {len(data)}-byte payload allocated {peak} bytes"


def _tier(kind: str, tmp_path, request):
    if kind == "host":
        return HostMemoryBackend(1 << 22)
    if kind == "disk":
        return DiskBackend(tmp_path / "kv", 1 << 22)
    server = request.getfixturevalue("redis_server")
    backend = RedisTierBackend(server.url, fingerprint=FP, tenant=f"bomb{abs(hash(request.node.name)) % 10**8}")
    request.addfinalizer(backend.clear)
    return backend


@pytest.mark.parametrize("kind", ["host", "disk", "redis"])
@pytest.mark.parametrize(("codec", "sized"), BOMBS)
def test_bomb_in_a_tier_is_a_miss_counted_corrupt(kind, codec, sized, tmp_path, request):
    backend = _tier(kind, tmp_path, request)
    store = TierStore([Tier(backend, get_codec("lz4"))], spec=SPEC, fingerprint=FP)
    assert backend.put("bomb", bomb(codec, sized=sized))  # planted (any client of a shared tier can)
    got, peak = peak_of(lambda: store.get("bomb"))
    assert got is None
    assert store.stats()[backend.name]["corrupt"] == 1
    assert peak < 2 << 20, f"reading a planted bomb allocated {peak} bytes"
    assert store.put("bomb", block(3)) and torch.equal(store.get("bomb")[0], block(3))  # the key works again


def test_redis_tier_reads_are_bounded(redis_server):
    import redis

    backend = RedisTierBackend(redis_server.url, fingerprint=FP, tenant="huge")
    store = TierStore([Tier(backend)], spec=SPEC, fingerprint=FP)
    try:
        redis.Redis.from_url(redis_server.url).set(backend.prefix + "huge", bytes(8 << 20))  # 8 MiB planted
        got, peak = peak_of(lambda: store.get("huge"))
        assert got is None and store.stats()["redis"]["corrupt"] == 1
        assert peak < 2 << 20, f"a planted 8 MiB value was read whole ({peak} bytes allocated)"
    finally:
        backend.clear()


# ====================================================================== item 13: Redis errors
def test_redis_tier_value_of_another_type_is_a_miss(redis_server):
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    backend = RedisTierBackend(redis_server.url, fingerprint=FP, tenant="wrongtype")
    store = TierStore([Tier(backend, get_codec("lz4"))], spec=SPEC, fingerprint=FP)
    try:
        assert store.put("good", block(1))
        raw.rpush(backend.prefix + "listed", "not", "a", "string")  # a list where a block belongs
        assert store.get("listed") is None
        assert backend.get_many(["listed", "good"]).keys() == {"good"}
        assert torch.equal(store.get("good")[0], block(1))
        stats = store.stats()["redis"]
        assert stats["redis_errors_wrongtype"] >= 2 and stats["blocks"] == 2 and stats["bytes"] > 0
    finally:
        backend.clear()


def test_redis_tier_keys_and_stats_survive_foreign_keys(redis_server):
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    backend = RedisTierBackend(redis_server.url, fingerprint=FP, tenant="foreign")
    try:
        assert backend.put("good", b"data")
        raw.set(backend.prefix.encode() + b"\xff\xfe", b"x")  # not UTF-8
        raw.set(backend.prefix + "dots.and:colons", b"x")  # not a block key
        raw.hset(backend.prefix + "hashed", "f", "v")  # a valid name, another type
        assert sorted(backend.keys()) == ["good", "hashed"]
        stats = backend.stats()
        assert stats["blocks"] == 2 and stats["bytes"] == 4 and stats["foreign_keys"] >= 2
    finally:
        backend.clear()


@pytest.fixture
def full_server():
    """A private server that refuses writes: maxmemory 1 byte, noeviction."""
    with RedisServer(policy="noeviction") as server:
        import redis

        redis.Redis.from_url(server.url).config_set("maxmemory", 1)
        yield server


def test_full_redis_server_drops_writes_without_raising(full_server):
    tier = RedisTierBackend(full_server.url, fingerprint=FP, tenant="full")
    store = TierStore([Tier(tier)], spec=SPEC, fingerprint=FP)
    assert store.put("k", block()) is False
    assert tier.put_many({"a": b"1", "b": b"2"}) == {"a": False, "b": False}
    assert store.get("k") is None
    mem = RedisBackend(full_server.url, namespace="full")
    mem.set("k", {"v": 1})
    mem.set_many({"a": 1, "b": 2})
    assert mem.get("k") is None and mem.get_or_compute("c", lambda: 5) == 5
    assert tier.stats()["redis_errors_oom"] >= 3 and tier.stats()["dropped_puts"] == 3
    stats = mem.stats()
    assert stats["errors_oom"] >= 4 and stats["dropped_sets"] == 4 and stats["degraded"] == 0


@pytest.mark.parametrize(
    ("reply", "kind"),
    [("readonly", "readonly"), ("moved", "moved"), ("oom", "oom")],
)
def test_error_replies_are_misses_and_dropped_writes(redis_server, monkeypatch, reply, kind):
    import redis
    import redis.exceptions as rx

    errors = {
        "readonly": lambda: rx.ReadOnlyError("You can't write against a read only replica."),
        "moved": lambda: rx.ResponseError("MOVED 3999 127.0.0.1:6381"),
        "oom": lambda: rx.OutOfMemoryError("command not allowed when used memory > 'maxmemory'."),
    }

    def fail(*args, **kwargs):
        raise errors[reply]()

    tier = RedisTierBackend(redis_server.url, fingerprint=FP, tenant=f"reply-{reply}")
    mem = RedisBackend(redis_server.url, namespace="replies", tenant=reply)
    store = TierStore([Tier(tier)], spec=SPEC, fingerprint=FP)
    monkeypatch.setattr(redis.Redis, "execute_command", fail)
    monkeypatch.setattr(redis.client.Pipeline, "execute", fail)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an error reply is not a lost server: no degraded-mode warning
        assert store.put("k", block()) is False and store.get("k") is None
        assert tier.get_many(["k"]) == {} and tier.put_many({"k": b"1"}) == {"k": False}
        assert tier.keys() == [] and tier.delete("k") is False
        mem.set("k", 1)
        mem.set_many({"a": 1})
        assert mem.get("k", "default") == "default" and mem.get_many(["k"]) == {}
        assert mem.get_or_compute("c", lambda: 9) == 9 and mem.delete("k") is False
        mem_stats, tier_stats = mem.stats(), tier.stats()
    assert mem_stats[f"errors_{kind}"] >= 5 and mem_stats["dropped_sets"] >= 2 and mem_stats["degraded"] == 0
    assert tier_stats[f"redis_errors_{kind}"] >= 4 and tier_stats["degraded"] == 0


@pytest.mark.parametrize(
    "planted",
    [b"\xff\xfe\x00garbage", b"{not json", b"[" * 100_000, b'"' + b"x" * 300_000 + b'"'],
    ids=["not-utf8", "not-json", "deeply-nested", "too-large"],
)
def test_memory_store_planted_values_are_corrupt_misses(redis_server, planted):
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    mem = RedisBackend(redis_server.url, namespace="planted", tenant="t", max_value_bytes=200_000)
    try:
        raw.set("planted:t:k", planted)
        assert mem.get("k", "default") == "default"
        assert mem.get_many(["k"]) == {}
        assert mem.get_or_compute("k", lambda: {"fresh": True}) == {"fresh": True}  # recomputed, overwritten
        assert mem.get("k") == {"fresh": True}
        assert mem.stats()["corrupt"] == 3
    finally:
        mem.clear()


def test_memory_store_value_of_another_type_is_a_miss(redis_server):
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    mem = RedisBackend(redis_server.url, namespace="typed", tenant="t")
    try:
        raw.rpush("typed:t:k", "a", "b")
        assert mem.get("k", "default") == "default" and mem.get_many(["k"]) == {}
        assert mem.stats()["errors_wrongtype"] == 2
        raw.set(b"typed:t:\xff\xfe", b"1")  # a non-UTF-8 key under the namespace
        assert mem.stats()["size"] == 2
    finally:
        mem.clear()


BAD_TTLS = [math.inf, -math.inf, math.nan, 0, -1.5, 1e300, 2**63]


@pytest.mark.parametrize("ttl", BAD_TTLS, ids=repr)
@pytest.mark.parametrize("kind", ["memory", "ttlstore", "redis"])
def test_bad_ttls_raise_the_same_error_everywhere(kind, ttl, request):
    if kind == "memory":
        b = MemoryBackend(shards=2)
    elif kind == "ttlstore":
        b = TTLStore()
    else:
        server = request.getfixturevalue("redis_server")
        b = RedisBackend(server.url, namespace="ttl", tenant=f"t{BAD_TTLS.index(ttl)}")
    b.set("k", "old")
    with pytest.raises(InvalidArgumentError, match="ttl must be a finite number"):
        b.set("k", "new", ttl)
    if kind != "ttlstore":
        with pytest.raises(InvalidArgumentError, match="ttl must be a finite number"):
            b.set_many({"k": "new", "j": 1}, ttl)
        with pytest.raises(InvalidArgumentError, match="ttl must be a finite number"):
            b.get_or_compute("c", lambda: 1, ttl)
        with pytest.raises(InvalidArgumentError, match="default_ttl must be a finite number"):
            if kind == "memory":
                MemoryBackend(default_ttl=ttl)
            else:
                RedisBackend(server.url, default_ttl=ttl)
    assert b.get("k") == "old" and b.get("j") is None  # nothing was stored
    if kind == "redis":
        with pytest.raises(InvalidArgumentError, match="ttl must be a finite number"):
            RedisTierBackend(server.url, fingerprint=FP, ttl=ttl)
        b.clear()


def test_ttl_of_the_wrong_type_is_an_argument_type_error():
    b = MemoryBackend(shards=1)
    for bad in ["10", [1], True]:
        with pytest.raises(ArgumentTypeError, match="ttl"):
            b.set("k", 1, bad)
    assert len(b) == 0


def test_largest_ttl_is_accepted_on_redis(redis_server):
    from memos_ref.resilient import MAX_TTL_S

    b = RedisBackend(redis_server.url, namespace="maxttl")
    try:
        b.set("k", 1, MAX_TTL_S)
        assert b.get("k") == 1 and b.ttl("k") > 1e12
    finally:
        b.clear()


class FlakyClient:
    """A redis.Redis stand-in whose GET times out while ``failing`` is true."""

    def __init__(self) -> None:
        self.failing = True

    def getrange(self, key, start, end):
        import redis

        if self.failing:
            raise redis.TimeoutError("Timeout reading from socket")
        return b'"ok"'


def test_a_few_timeouts_under_load_do_not_degrade_the_store():
    client = FlakyClient()
    mem = RedisBackend(client=client, namespace="flaky")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert mem.get("k") is None and mem.get("k") is None  # two slow replies: two misses ...
        client.failing = False
        assert mem.get("k") == "ok"  # ... and the next call goes through
        assert not mem._degraded()
    client.failing = True
    for _ in range(2):
        mem.get("k")
    with pytest.warns(BackendDegradedWarning, match="3 consecutive failures"):
        mem.get("k")
    assert mem._degraded() and mem.stats()["errors_timeout"] == 5


def test_the_default_timeout_is_not_a_hair_trigger():
    from memos_ref.resilient import DEFAULT_FAILURE_THRESHOLD, DEFAULT_TIMEOUT_S

    mem = RedisBackend("redis://127.0.0.1:1/0")
    kwargs = mem.client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == DEFAULT_TIMEOUT_S >= 0.25 and DEFAULT_FAILURE_THRESHOLD >= 2
    assert mem.redis.failure_threshold == DEFAULT_FAILURE_THRESHOLD
    tier = RedisTierBackend("redis://127.0.0.1:1/0", fingerprint=FP)
    assert tier.redis.client.connection_pool.connection_kwargs["socket_timeout"] == DEFAULT_TIMEOUT_S


def test_a_refused_connection_degrades_at_once():
    mem = RedisBackend("redis://127.0.0.1:1/0")  # nothing listens on port 1
    with pytest.warns(BackendDegradedWarning):
        assert mem.get("k", "fallback") == "fallback"
    assert mem._degraded() and mem.stats()["errors_refused"] == 1


# ====================================================================== item 16: wrong argument types
def _wrong_type_calls(tmp_path):
    host = HostMemoryBackend(1 << 20)
    disk = DiskBackend(tmp_path / "types", 1 << 20)
    store = TierStore([Tier(host)], spec=SPEC, fingerprint=FP)
    mem = MemoryBackend(shards=2)
    return {
        "host budget str": lambda: HostMemoryBackend("1000"),
        "host put str data": lambda: host.put("k", "not bytes"),
        "host put int key": lambda: host.put(5, b"x"),
        "host get_many str": lambda: host.get_many("abc"),
        "disk root int": lambda: DiskBackend(123, 1000),
        "disk put list data": lambda: disk.put("k", [1, 2]),
        "disk get None key": lambda: disk.get(None),
        "store tiers str": lambda: TierStore("host", spec=SPEC, fingerprint=FP),
        "store spec str": lambda: TierStore([Tier(HostMemoryBackend(10))], spec="spec", fingerprint=FP),
        "store put str block": lambda: store.put("k", "not a tensor"),
        "store get tiers str": lambda: store.get("k", tiers="host"),
        "store tier float": lambda: store.tier(1.5),
        "store delete int": lambda: store.delete(7),
        "codec int": lambda: get_codec(5),
        "encode list block": lambda: encode_block([1], spec=SPEC, fingerprint=FP, codec=Codec()),
        "memory shards str": lambda: MemoryBackend(shards="8"),
        "memory set int key": lambda: mem.set(5, 1),
        "memory get None key": lambda: mem.get(None),
        "memory get_many str": lambda: mem.get_many("abc"),
        "memory set_many list": lambda: mem.set_many([("a", 1)]),
        "memory compute not callable": lambda: mem.get_or_compute("k", 5),
        "ttlstore max_entries str": lambda: TTLStore(max_entries="10"),
        "ttlstore policy int": lambda: TTLStore(policy=3),
        "redis namespace int": lambda: RedisBackend("redis://127.0.0.1:1/0", namespace=5),
        "redis timeout str": lambda: RedisBackend("redis://127.0.0.1:1/0", timeout="fast"),
        "redis threshold float": lambda: RedisBackend("redis://127.0.0.1:1/0", failure_threshold=2.5),
        "redis tier fingerprint int": lambda: RedisTierBackend("redis://127.0.0.1:1/0", fingerprint=5),
    }, (host, disk, store, mem)


def test_wrong_argument_types_raise_package_errors_and_change_nothing(tmp_path):
    calls, (host, disk, _, mem) = _wrong_type_calls(tmp_path)
    host.put("keep", b"1")
    mem.set("keep", 1)
    before = (host.keys(), host.nbytes, disk.keys(), mem.stats()["size"], mem.stats()["sets"])
    for name, call in calls.items():
        with pytest.raises(ArgumentTypeError) as info:
            call()
        assert "expected" in str(info.value), name
    assert (host.keys(), host.nbytes, disk.keys(), mem.stats()["size"], mem.stats()["sets"]) == before


def test_tier_manager_wrong_argument_types(tmp_path):
    from memos_ref.paged import PagedKV
    from memos_ref.tiering.manager import TierManager

    kv = PagedKV(SPEC, 8, fingerprint=FP)
    store = TierStore([Tier(HostMemoryBackend(1 << 20))], spec=SPEC, fingerprint=FP)
    calls = {
        "kv": lambda: TierManager("kv", store),
        "store": lambda: TierManager(kv, "store"),
        "watermark": lambda: TierManager(kv, store, high_watermark="0.9"),
        "policy": lambda: TierManager(kv, store, policy=1),
    }
    for name, call in calls.items():
        with pytest.raises(ArgumentTypeError):
            call()
        assert kv.tier_manager is None, name  # nothing attached by a refused constructor
    tm = TierManager(kv, store)
    for call in [
        lambda: tm.pin("abc"),
        lambda: tm.pin([1, 2]),
        lambda: tm.label([b"h"], 5),
        lambda: tm.residency("abc"),
        lambda: tm.touch([1.5]),
        lambda: tm.step(now="later"),
        lambda: tm.reload_seconds(0, 1),
        lambda: tm.swap_rate(window_s="10"),
    ]:
        with pytest.raises(ArgumentTypeError):
            call()
    with pytest.raises(InvalidArgumentError):
        tm.touch([99])  # out of range
    with pytest.raises(InvalidArgumentError):
        tm.step(now=math.nan)
    assert tm.pinned == set() and tm.history == {} and tm.kinds == {}


def test_simulation_and_trace_helpers_wrong_argument_types():
    from memos_ref.memory.access_pattern import agent_memory_trace
    from memos_ref.tiering.simulate import interleaved_trace, requests_from_trace, simulate

    for call in [
        lambda: interleaved_trace(3),
        lambda: interleaved_trace("chat", copies="4"),
        lambda: requests_from_trace("events"),
        lambda: simulate("requests", device_blocks=4),
        lambda: simulate([], device_blocks=4.0),
        lambda: simulate([], device_blocks=4, prefetch="markov"),
        lambda: agent_memory_trace("100"),
        lambda: agent_memory_trace(100, p_hot="half"),
    ]:
        with pytest.raises(ArgumentTypeError):
            call()
    with pytest.raises(InvalidArgumentError):
        agent_memory_trace(100, p_hot=1.5)


# ---------------------------------------------------------------------- budget and huge-number regressions
@pytest.mark.parametrize("kind", ["host", "disk"])
def test_reputting_the_lru_key_larger_stays_within_the_budget(kind, tmp_path):
    b = HostMemoryBackend(100, pin=False) if kind == "host" else DiskBackend(tmp_path, 100)
    b.put("aa", b"x" * 40)
    b.put("bb", b"y" * 40)
    assert b.put("aa", b"z" * 90)  # "aa" is the least recently used key: the others must go, not the budget
    assert b.nbytes == 90 <= b.budget_bytes
    assert b.keys() == ["aa"] and b.get("aa") == b"z" * 90


HUGE_TTLS = [10**400, -(10**400), Fraction(1, 10**400)]


@pytest.mark.parametrize("ttl", HUGE_TTLS, ids=["1e400", "-1e400", "1/1e400"])
def test_a_ttl_beyond_float_range_is_an_invalid_argument(ttl):
    with pytest.raises(InvalidArgumentError, match="ttl must be a finite number"):
        validate_ttl(ttl)
    for b in (TTLStore(), MemoryBackend(shards=1)):
        b.set("k", "old")
        with pytest.raises(InvalidArgumentError, match="ttl must be a finite number"):
            b.set("k", "new", ttl)
        assert b.get("k") == "old"


def test_seconds_beyond_float_range_are_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="stale_tmp_s"):
        DiskBackend(tmp_path, 100, stale_tmp_s=10**400)
    with pytest.raises(ConfigError, match="timeout"):
        ResilientRedis("redis://127.0.0.1:1/0", timeout=10**400)
