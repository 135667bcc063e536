"""Tier storage: codecs, the block file format and its checks, host / disk / Redis backends, the tier store's
handling of damaged copies."""

from __future__ import annotations

import os
import warnings

import pytest
import torch

from memos_ref.errors import ConfigError, CorruptCacheError, ModelMismatchError
from memos_ref.spec import KVSpec
from memos_ref.tiering.backends import DiskBackend, HostMemoryBackend, RedisTierBackend, temp_name
from memos_ref.tiering.blockfile import decode_block, encode_block
from memos_ref.tiering.codecs import CODECS, Codec, get_codec, shuffle, unshuffle
from memos_ref.tiering.store import Tier, TierStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16, dtype=torch.float16)
FP = "a1b2c3d4e5f60718"


def block(seed: int = 0, spec: KVSpec = SPEC) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.block_shape, generator=g).to(spec.dtype)


@pytest.fixture(scope="module")
def redis_url(redis_server):
    return redis_server.url


# ---------------------------------------------------------------------- codecs and the file format
@pytest.mark.parametrize("name", sorted(CODECS))
def test_codecs_round_trip(name):
    codec = get_codec(name)
    raw = block().reshape(-1).view(torch.uint8).numpy().tobytes()
    assert codec.decode(codec.encode(raw, 2), 2) == raw
    assert codec.name == name


def test_shuffle_groups_bytes_by_significance():
    data = bytes([1, 2, 3, 4, 5, 6])
    assert shuffle(data, 2) == bytes([1, 3, 5, 2, 4, 6]) and unshuffle(shuffle(data, 2), 2) == data
    with pytest.raises(ConfigError, match="unknown codec"):
        get_codec("gzip")
    assert get_codec("zstd-5+shuffle") == Codec("zstd", 5, shuffled=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_block_file_round_trip(dtype):
    spec = SPEC.with_(dtype=dtype)
    b = block(1, spec)
    data = encode_block(b, spec=spec, fingerprint=FP, codec=get_codec("zstd-3+shuffle"), key="k1")
    assert torch.equal(decode_block(data, spec=spec, fingerprint=FP, key="k1"), b)


def test_damaged_and_foreign_block_files_are_refused():
    good = encode_block(block(), spec=SPEC, fingerprint=FP, codec=get_codec("lz4"), key="k1")
    for cut in (0, 5, 40, len(good) // 2, len(good) - 1):
        with pytest.raises(CorruptCacheError):
            decode_block(good[:cut], spec=SPEC, fingerprint=FP)
    flipped = bytearray(good)
    flipped[-10] ^= 0xFF  # inside the compressed payload
    with pytest.raises(CorruptCacheError):
        decode_block(bytes(flipped), spec=SPEC, fingerprint=FP)
    with pytest.raises(CorruptCacheError):
        decode_block(os.urandom(500), spec=SPEC, fingerprint=FP)
    with pytest.raises(ModelMismatchError, match="written by model"):
        decode_block(good, spec=SPEC, fingerprint="another-model", key="k1")
    with pytest.raises(ModelMismatchError, match="geometry"):
        decode_block(good, spec=SPEC.with_(block_size=32), fingerprint=FP)
    with pytest.raises(CorruptCacheError, match="holds key"):
        decode_block(good, spec=SPEC, fingerprint=FP, key="other")
    raw_flip = bytearray(encode_block(block(), spec=SPEC, fingerprint=FP, codec=Codec("none"), key="k1"))
    raw_flip[-3] ^= 0x01  # an uncompressed payload decodes fine but fails its checksum
    with pytest.raises(CorruptCacheError, match="checksum"):
        decode_block(bytes(raw_flip), spec=SPEC, fingerprint=FP)


# ---------------------------------------------------------------------- backends
@pytest.fixture(params=["host", "disk", "redis"])
def backend(request, tmp_path):
    if request.param == "host":
        yield HostMemoryBackend(10_000)
    elif request.param == "disk":
        yield DiskBackend(tmp_path / "kv", 10_000)
    else:
        b = RedisTierBackend(request.getfixturevalue("redis_url"), fingerprint=FP, tenant=f"t{id(request)}")
        yield b
        b.clear()


def test_backend_basics(backend):
    assert backend.put("k1", b"x" * 100) and backend.put("k2", b"y" * 50)
    assert backend.get("k1") == b"x" * 100 and backend.get("nope") is None
    assert backend.contains("k2") and not backend.contains("nope")
    assert sorted(backend.keys()) == ["k1", "k2"] and backend.nbytes == 150
    assert backend.put("k1", b"z" * 10) and backend.get("k1") == b"z" * 10 and backend.nbytes == 60
    assert backend.get_many(["k1", "k2", "k3"]) == {"k1": b"z" * 10, "k2": b"y" * 50}
    assert backend.delete("k1") and not backend.delete("k1")
    for bad in ["../etc/passwd", "a/b", "a.b", "", "x" * 129, "spa ce"]:
        with pytest.raises(ConfigError, match="invalid block key"):
            backend.put(bad, b"1")


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_budget_evicts_least_recently_used(kind, tmp_path):
    b = HostMemoryBackend(300) if kind == "host" else DiskBackend(tmp_path / "kv", 300)
    for i in range(3):
        b.put(f"k{i}", bytes(100))
    b.get("k0")  # k0 is now the most recent
    b.put("k3", bytes(100))
    assert sorted(b.keys()) == ["k0", "k2", "k3"] and b.nbytes == 300 and b.stats()["evictions"] == 1
    assert not b.put("huge", bytes(301)) and b.stats()["rejected"] == 1 and b.nbytes == 300


def test_disk_adopts_files_and_cleans_half_writes(tmp_path):
    first = DiskBackend(tmp_path / "kv", 10_000)
    first.put("abc", b"hello")
    crashed = first.path("abc").parent / ".tmp-crashed"  # a writer of unknown pid, long ago
    crashed.write_bytes(b"half a block")
    os.utime(crashed, (1.0, 1.0))
    dead = first.path("abc").parent / temp_name(pid=2**30)  # a pid no process can have
    dead.write_bytes(b"half a block")
    second = DiskBackend(tmp_path / "kv", 10_000)  # a restart
    assert second.get("abc") == b"hello" and second.nbytes == 5
    assert not crashed.exists() and not dead.exists()
    assert str(second.path("abc")).startswith(str(tmp_path / "kv"))


def test_redis_tier_namespaces_and_degrades(redis_url):
    a = RedisTierBackend(redis_url, fingerprint=FP, tenant="alice")
    other_model = RedisTierBackend(redis_url, fingerprint="ffff0000ffff0000", tenant="alice")
    a.put("k1", b"data")
    assert other_model.get("k1") is None  # keys carry the model fingerprint
    a.clear()
    dead = RedisTierBackend("redis://127.0.0.1:1/0", fingerprint=FP, failure_threshold=1)  # nothing on port 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert dead.put("k", b"1") is False and dead.get("k") is None
    stats = dead.stats()
    assert stats["degraded"] == 1 and stats["dropped_puts"] == 1 and stats["redis_errors"] == 1


# ---------------------------------------------------------------------- the tier store
def test_tier_store_falls_through_damaged_copies(tmp_path):
    host = HostMemoryBackend(1 << 20)
    disk = DiskBackend(tmp_path / "kv", 1 << 20)
    store = TierStore([Tier(host, Codec("none")), Tier(disk, get_codec("zstd-3+shuffle"))], spec=SPEC, fingerprint=FP)
    b = block(3)
    assert store.put("k1", b, "host") and store.put("k1", b, "disk")
    got, tier = store.get("k1")
    assert tier == "host" and torch.equal(got, b)
    host._data["k1"] = host._data["k1"][:-7]  # truncate the host copy
    got, tier = store.get("k1")
    assert tier == "disk" and torch.equal(got, b)  # fell through to the good copy
    assert store.counts["host"]["corrupt"] == 1 and not host.contains("k1")  # the bad copy is gone
    path = disk.path("k1")
    path.write_bytes(path.read_bytes()[:100])  # now the disk copy is truncated too
    assert store.get("k1") is None and store.counts["disk"]["corrupt"] == 1
    foreign = TierStore([Tier(disk)], spec=SPEC, fingerprint="someone-else")
    foreign.put("k2", b)
    assert store.get("k2") is None and store.counts["disk"]["corrupt"] == 2  # another model's block: a miss
    assert store.bandwidth("host") is not None and store.stats()["disk"]["codec"] == "zstd-3+shuffle"
    with pytest.raises(ConfigError, match="distinct names"):
        TierStore([Tier(host), Tier(HostMemoryBackend(10))], spec=SPEC, fingerprint=FP)


def test_blocks_evicted_from_a_tier_are_demoted_to_the_next(tmp_path):
    file_size = len(encode_block(block(), spec=SPEC, fingerprint=FP, codec=Codec("none"), key="k0"))
    host = HostMemoryBackend(int(2.5 * file_size))  # room for two blocks
    disk = DiskBackend(tmp_path / "kv", 1 << 20)
    store = TierStore([Tier(host), Tier(disk, get_codec("zstd-3"))], spec=SPEC, fingerprint=FP)
    blocks = {f"k{i}": block(i) for i in range(4)}
    for key, b in blocks.items():
        assert store.put(key, b, "host")
    assert sorted(host.keys()) == ["k2", "k3"] and sorted(disk.keys()) == ["k0", "k1"]
    assert store.counts["host"]["demoted_out"] == 2 and store.counts["disk"]["demoted_in"] == 2
    for key, b in blocks.items():
        got, tier = store.get(key)
        assert torch.equal(got, b) and tier == ("host" if key in ("k2", "k3") else "disk")
