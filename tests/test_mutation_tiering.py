"""Tier codecs and budgets (issue 30's survivors): a frame that decodes to more bytes than declared was caught only
by the block file's checksum, never at the codec's own API; and replacing a key's value in a budgeted backend was
checked only by an unrelated test file. Oracles: the byte counts computed here from what was put."""

from __future__ import annotations

import errno
import hashlib
import os
import re
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time

import lz4.frame
import pytest
import torch
import zstandard

from memos_ref.errors import ArgumentTypeError, BackendUnavailableError, ConfigError, CorruptCacheError, StateError
from memos_ref.tiering.backend_base import TierBackend
from memos_ref.tiering.backends import DiskBackend, HostMemoryBackend, temp_name
from memos_ref.tiering.codecs import CODECS, Codec, get_codec, shuffle, unshuffle

SIZE = 4096
RAW = bytes(range(256)) * (SIZE // 256)


def _frame_without_size(codec: Codec, data: bytes) -> bytes:
    """A valid frame of ``data`` that does not declare its content size (so only decoding can tell)."""
    if codec.algorithm == "lz4":
        return lz4.frame.compress(data, store_size=False)
    return zstandard.ZstdCompressor(level=3, write_content_size=False).compress(data)


@pytest.mark.parametrize("algorithm", ["lz4", "zstd"])
@pytest.mark.parametrize("extra", [1, 4096])
def test_a_frame_that_decodes_to_more_than_the_block_size_is_refused_at_the_codec(algorithm, extra):
    """decode(data, size) with a frame holding size + extra bytes (no declared size): CorruptCacheError from the
    codec itself, whatever stands behind it (the block file's checksum is not the only guard)."""
    codec = Codec(algorithm)
    frame = _frame_without_size(codec, RAW + b"\x07" * extra)
    with pytest.raises(CorruptCacheError, match=codec.name):
        codec.decode(frame, 2, SIZE)


@pytest.mark.parametrize("algorithm", ["lz4", "zstd"])
def test_a_frame_of_the_exact_size_decodes_and_one_byte_short_is_refused(algorithm):
    codec = Codec(algorithm)
    assert codec.decode(_frame_without_size(codec, RAW), 2, SIZE) == RAW
    with pytest.raises(CorruptCacheError, match=codec.name):
        codec.decode(_frame_without_size(codec, RAW[:-1]), 2, SIZE)


@pytest.mark.parametrize("name", sorted(CODECS))
def test_every_codec_round_trips_and_refuses_a_frame_declaring_another_size(name):
    """Each codec's own frames: the block back exactly; a frame of another block size (declared, or for "none"
    the raw length) refused before it is decompressed."""
    codec = CODECS[name]
    assert codec.decode(codec.encode(RAW, 2), 2, SIZE) == RAW
    bigger = codec.encode(RAW + RAW[:512], 2)
    with pytest.raises(CorruptCacheError):
        codec.decode(bigger, 2, SIZE)


def _backends(tmp_path, budget):
    return [HostMemoryBackend(budget), DiskBackend(tmp_path / "disk", budget)]


def _held(backend) -> int:
    """The oracle: bytes of what the backend really returns for its keys."""
    return sum(len(backend.get(k) or b"") for k in backend.keys())  # noqa: SIM118 - a method, not a dict


def test_replacing_a_value_counts_only_the_new_bytes(tmp_path):
    """Putting a key again replaces its bytes in the budget: nbytes is the sum of what is held, larger or smaller."""
    for backend in _backends(tmp_path, 10_000):
        assert backend.put("aa01", b"x" * 100) and backend.put("bb02", b"y" * 50)
        assert backend.put("aa01", b"z" * 300)
        assert backend.nbytes == 350 == _held(backend), type(backend).__name__
        assert backend.put("aa01", b"w" * 10)
        assert backend.nbytes == 60 == _held(backend), type(backend).__name__
        assert backend.get("aa01") == b"w" * 10


def test_replacing_a_value_at_the_budget_evicts_others_never_the_key_itself(tmp_path):
    """At a 1,000-byte budget, growing a key's value evicts the least recently used other keys until it fits; the
    replaced key is never the victim (its old size is still counted while room is made)."""
    for backend in _backends(tmp_path, 1000):
        for i in range(4):
            assert backend.put(f"k{i:03d}", bytes([i]) * 200)  # 800 bytes
        assert backend.put("k000", b"n" * 500)  # 800 - 200 + 500 = 1100 > 1000: evict k001 (the oldest other)
        name = type(backend).__name__
        assert backend.get("k000") == b"n" * 500, name
        assert sorted(backend.keys()) == ["k000", "k002", "k003"], name
        assert backend.nbytes == 900 == _held(backend), name


def test_a_replacement_that_can_never_fit_leaves_the_old_value(tmp_path):
    """A value over the budget is refused (put returns False) before anything changes: the key keeps its old
    value and the books are unchanged."""
    for backend in _backends(tmp_path, 1000):
        assert backend.put("k001", b"a" * 300)
        assert backend.put("k002", b"b" * 300)
        assert not backend.put("k001", b"c" * 1001)
        assert backend.get("k001") == b"a" * 300, type(backend).__name__
        assert backend.nbytes == 600 == _held(backend)


# ---------------------------------------------------- full mutmut run of tiering/codecs.py (2026-12-02, issue 30)


@pytest.mark.parametrize(
    ("name", "codec"),
    [
        ("zstd-1+shuffle", Codec("zstd", 1, True)),
        ("zstd-5", Codec("zstd", 5)),
        ("zstd-22+shuffle", Codec("zstd", 22, True)),
    ],
)
def test_get_codec_parses_every_zstd_level_with_or_without_shuffle(name, codec):
    assert get_codec(name) == codec and get_codec(name).name == name


@pytest.mark.parametrize("name", ["zstd-0", "zstd-23", "zstd-x", "zstd-", "zstd-5+foo", "zstdx5", "lz4+zstd-5"])
def test_get_codec_refuses_an_unknown_name_listing_the_known_ones(name):
    with pytest.raises(ConfigError, match=rf"^unknown codec {re.escape(repr(name))}: expected one of \['lz4', "):
        get_codec(name)


def test_get_codec_refuses_a_name_that_is_not_a_string():
    with pytest.raises(ArgumentTypeError, match=r"^name: expected str, got int"):
        get_codec(5)


def test_a_raw_block_of_the_wrong_size_is_refused_naming_both_sizes():
    with pytest.raises(CorruptCacheError, match=r"^none: holds 3 bytes, expected 4$"):
        Codec("none").decode(b"abc", 1, size=4)


def test_a_missing_compression_library_is_unavailable_not_corrupt(monkeypatch):
    """Without lz4 installed a compressed block is not damaged: BackendUnavailableError, naming the codec."""
    monkeypatch.setitem(sys.modules, "lz4.frame", None)
    with pytest.raises(BackendUnavailableError, match=r"^lz4 needs a library that is not installed: "):
        Codec("lz4").decode(b"\x04\x22\x4d\x18", 1, size=4)


def test_a_damaged_frame_is_refused_naming_the_library_error():
    with pytest.raises(CorruptCacheError, match=r"^zstd-3: cannot decompress \(ZstdError: "):
        Codec("zstd").decode(b"not a zstd frame", 1, size=10)


def test_frames_declaring_another_size_are_refused_saying_both_sizes():
    """lz4 and zstd frames carry their content size: one that disagrees with the block's size is refused before
    decompressing, naming both."""
    with pytest.raises(CorruptCacheError, match=r"^lz4: frame declares 10 bytes, expected 12$"):
        Codec("lz4").decode(lz4.frame.compress(b"x" * 10), 1, size=12)
    with pytest.raises(CorruptCacheError, match=r"^zstd-3: frame declares 10 bytes, expected 12$"):
        Codec("zstd").decode(zstandard.ZstdCompressor().compress(b"x" * 10), 1, size=12)


def test_frames_without_a_size_are_cut_at_the_block_size():
    """A frame that does not declare its size and holds more than the block is refused at the block's size (lz4
    saying so, zstd by its own bound of max(size, 1) bytes)."""
    lz4_frame = lz4.frame.compress(b"x" * 20, store_size=False)
    with pytest.raises(CorruptCacheError, match=r"^lz4: frame decompresses to more than 10 bytes \(or is truncated\)$"):
        Codec("lz4").decode(lz4_frame, 1, size=10)
    zstd_frame = zstandard.ZstdCompressor(write_content_size=False).compress(b"xy")
    with pytest.raises(CorruptCacheError, match=r"^zstd-3: cannot decompress \(ZstdError: "):
        Codec("zstd").decode(zstd_frame, 1, size=1)


def test_shuffle_leaves_data_that_is_not_whole_elements_alone():
    assert shuffle(b"abc", 2) == b"abc" and unshuffle(b"abc", 2) == b"abc"
    assert shuffle(b"abcd", 2) == b"acbd" and unshuffle(b"acbd", 2) == b"abcd"


# ------------------------------------------ full mutmut run of the backends' budget and bounds (2026-12-02, issue 30)
# Oracles: byte counts and event counts computed here from the operations the test performs.


def _stats(backend) -> dict:
    """stats() without the zero counters (a Counter keeps a key once touched)."""
    return {k: v for k, v in backend.stats().items() if v}


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_stats_count_every_put_hit_miss_and_rejection_exactly(tmp_path, kind):
    """Three puts, two hits, two misses, two refusals (over the budget, over the item bound): each counted once,
    under its own name, beside the blocks held and their bytes."""
    backend = HostMemoryBackend(100) if kind == "host" else DiskBackend(tmp_path / "d", 100)
    backend.limit_item_bytes(60)
    assert backend.put("aa01", b"a" * 10) and backend.put("bb02", b"b" * 20) and backend.put("aa01", b"c" * 30)
    assert backend.get("aa01") == b"c" * 30 and backend.get("bb02") == b"b" * 20
    assert backend.get("cc03") is None and backend.get("dd04") is None
    assert not backend.put("ee05", b"e" * 101) and not backend.put("ee05", b"e" * 61)
    assert backend.stats() == {"puts": 3, "hits": 2, "misses": 2, "rejected": 2, "blocks": 2, "bytes": 50}


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_an_item_of_exactly_the_bounds_is_stored_and_read_back(tmp_path, kind):
    """``size == budget_bytes`` and ``size == max_item_bytes`` are inside the bounds (one byte more is not)."""
    backend = HostMemoryBackend(100) if kind == "host" else DiskBackend(tmp_path / "d", 100)
    assert backend.put("aa01", bytes(range(100)))
    assert backend.get("aa01") == bytes(range(100))
    backend.limit_item_bytes(40)
    assert backend.put("bb02", b"b" * 40) and not backend.put("cc03", b"c" * 41)
    assert backend.get("bb02") == b"b" * 40
    assert _stats(backend) == {"puts": 2, "hits": 2, "rejected": 1, "blocks": 1, "bytes": 40, "evictions": 1}


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_an_item_over_the_item_bound_is_refused_even_under_the_budget(tmp_path, kind):
    backend = HostMemoryBackend(1000) if kind == "host" else DiskBackend(tmp_path / "d", 1000)
    backend.limit_item_bytes(100)
    assert not backend.put("aa01", b"a" * 101)
    assert backend.keys() == [] and backend.nbytes == 0 and _stats(backend) == {"rejected": 1}


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_a_put_one_byte_over_the_budget_evicts_the_oldest(tmp_path, kind):
    """The budget is never exceeded, not even by one byte: 50 + 51 > 100 evicts the 50-byte block."""
    backend = HostMemoryBackend(100) if kind == "host" else DiskBackend(tmp_path / "d", 100)
    assert backend.put("aa01", b"a" * 50) and backend.put("bb02", b"b" * 51)
    assert backend.keys() == ["bb02"] and backend.nbytes == 51 == _held(backend)
    assert backend.put("cc03", b"c" * 49)  # 51 + 49 == 100: fits exactly, nothing evicted
    assert backend.keys() == ["bb02", "cc03"] and backend.nbytes == 100


@pytest.mark.parametrize("kind", ["host", "disk"])
def test_growing_a_key_hands_only_the_other_victims_to_on_evict(tmp_path, kind):
    """Replacing a key at the budget evicts the least recently used *other* keys, each handed to on_evict with its
    bytes once; the key being replaced is never handed over nor counted as an eviction."""
    backend = HostMemoryBackend(1000) if kind == "host" else DiskBackend(tmp_path / "d", 1000)
    evicted = []
    backend.on_evict = lambda key, data: evicted.append((key, data))
    for i in range(4):
        assert backend.put(f"k{i:03d}", bytes([i]) * 200)
    assert backend.put("k000", b"n" * 500)  # 1,100 > 1,000: k001 goes
    assert evicted == [("k001", bytes([1]) * 200)]
    assert _stats(backend) == {"puts": 5, "evictions": 1, "blocks": 3, "bytes": 900}


def test_a_lowered_item_bound_turns_larger_stored_blocks_into_counted_misses():
    """Blocks stored before limit_item_bytes lowered the bound are misses on read, counted corrupt, and forgotten;
    a block of exactly the new bound is still a hit."""
    backend = HostMemoryBackend(1000)
    assert backend.put("aa01", b"a" * 100) and backend.put("bb02", b"b" * 80) and backend.put("cc03", b"c" * 60)
    backend.limit_item_bytes(60)
    assert backend.get("aa01") is None and backend.get("bb02") is None and backend.get("zz99") is None
    assert backend.get("cc03") == b"c" * 60
    assert backend.keys() == ["cc03"] and backend.nbytes == 60
    assert _stats(backend) == {"puts": 3, "corrupt": 2, "misses": 3, "hits": 1, "blocks": 1, "bytes": 60}


def test_limit_item_bytes_refuses_a_bound_that_is_not_positive_naming_it():
    backend = HostMemoryBackend(100)
    with pytest.raises(ConfigError, match=r"^limit must be a positive int, got 0$"):
        backend.limit_item_bytes(0)
    with pytest.raises(ArgumentTypeError, match=r"^limit: expected int, got str"):
        backend.limit_item_bytes("5")
    assert backend.max_item_bytes == 100


def test_host_pin_is_what_was_asked_else_whether_cuda_is_available():
    assert HostMemoryBackend(10).pin is torch.cuda.is_available()
    assert HostMemoryBackend(10, pin=True).pin is True and HostMemoryBackend(10, pin=False).pin is False
    with pytest.raises(ArgumentTypeError, match=r"^pin: expected bool, got int"):
        HostMemoryBackend(10, pin=1)


def test_a_pinned_host_backend_stores_a_pinned_uint8_copy_and_returns_bytes(monkeypatch):
    """With pin=True each block is one pinned uint8 buffer of its length; reads (and on_evict) get bytes equal to
    what was put. (torch.empty is recorded so the test runs without CUDA: the pinned allocation is faked.)"""
    real_empty, calls = torch.empty, []

    def empty(*args, **kwargs):
        calls.append((args, dict(kwargs)))
        kwargs.pop("pin_memory", None)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    backend = HostMemoryBackend(16, pin=True)
    evicted = []
    backend.on_evict = lambda key, data: evicted.append((key, data))
    data = bytes(range(200, 208))
    assert backend.put("aa01", bytearray(data))
    assert calls == [((8,), {"dtype": torch.uint8, "pin_memory": True})]
    got = backend.get("aa01")
    assert type(got) is bytes and got == data
    assert backend.put("bb02", b"x" * 8) and backend.put("cc03", b"y" * 8)  # 24 > 16: aa01 is evicted
    assert evicted == [("aa01", data)] and type(evicted[0][1]) is bytes


def test_pinned_memory_running_out_refuses_the_block_and_counts_an_error(monkeypatch):
    """An allocation failure (RuntimeError) is a refused put (False), counted ``errors``, not an exception."""

    def empty(*args, **kwargs):
        raise RuntimeError("out of pinned memory")

    monkeypatch.setattr(torch, "empty", empty)
    backend = HostMemoryBackend(100, pin=True)
    assert backend.put("aa01", b"a" * 10) is False and backend.put("bb02", b"b" * 10) is False
    assert backend.keys() == [] and _stats(backend) == {"errors": 2}


class _DictBackend(TierBackend):
    """The smallest backend: the base class's own contains / put_many / get_many / stats over a dict."""

    def __init__(self) -> None:
        super().__init__(1 << 20)
        self.data: dict[str, bytes] = {}

    def put(self, key, data):
        self.data[key] = bytes(data)
        return len(data) > 0

    def get(self, key):
        return self.data.get(key)

    def delete(self, key):
        return self.data.pop(key, None) is not None

    def keys(self):
        return list(self.data)

    @property
    def nbytes(self):
        return sum(map(len, self.data.values()))


def test_the_base_backend_contains_and_put_many_answer_per_key():
    backend = _DictBackend()
    assert backend.put_many({"aa01": b"xy", "bb02": b""}) == {"aa01": True, "bb02": False}
    assert backend.data == {"aa01": b"xy", "bb02": b""}
    assert backend.contains("aa01") and not backend.contains("cc03")
    assert backend.get_many(["aa01", "cc03"]) == {"aa01": b"xy"}
    assert backend.stats() == {"blocks": 2, "bytes": 2}
    with pytest.raises(ArgumentTypeError, match=r"^items: expected Mapping, got list"):
        backend.put_many([("aa01", b"x")])


# ---------------------------------------------------------------- the disk backend: temp files, foreign files, bounds
_THIS_HOST = hashlib.blake2b(socket.gethostname().encode(errors="replace"), digest_size=4).hexdigest()


def _block_file(root, key: str, data: bytes):
    """A block file written outside the backend (as another writer, or an attacker, would)."""
    path = root / key[:2] / f"{key}.kvb"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def test_temp_name_says_this_host_and_this_pid_with_a_12_hex_token():
    assert re.fullmatch(rf"\.tmp-{_THIS_HOST}-{os.getpid()}-[0-9a-f]{{12}}", temp_name())
    assert re.fullmatch(rf"\.tmp-{_THIS_HOST}-77-[0-9a-f]{{12}}", temp_name(77))


def _default_sighup() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def test_a_live_writers_temp_file_is_kept_and_the_writer_is_not_signalled(tmp_path):
    """At start a fresh temp file of a live process of this host is another write in flight: kept; checking that
    the process lives sends it no signal (it exits normally, code 0, once its input ends)."""
    writer = subprocess.Popen(  # SIGHUP at its default (a nohup'ed runner would have it ignored)
        ["cat"], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, preexec_fn=_default_sighup
    )
    try:
        in_flight = tmp_path / "d" / "ab" / temp_name(writer.pid)
        in_flight.parent.mkdir(parents=True)
        in_flight.write_bytes(b"half")
        backend = DiskBackend(tmp_path / "d", 100)
        assert in_flight.exists() and backend.keys() == []
    finally:
        writer.stdin.close()
        assert writer.wait() == 0


def test_temp_files_of_pid_0_are_abandoned_and_of_pid_1_alive(tmp_path):
    """pid 0 is no process (a write by it is abandoned: removed); pid 1 always lives (its write is kept)."""
    shard = tmp_path / "d" / "ab"
    shard.mkdir(parents=True)
    (shard / temp_name(0)).write_bytes(b"x")
    (shard / temp_name(1)).write_bytes(b"y")
    DiskBackend(tmp_path / "d", 100)
    assert [p.name.split("-")[2] for p in shard.iterdir()] == ["1"]


def test_a_temp_file_of_a_pid_the_os_cannot_hold_is_kept(tmp_path):
    """A pid past what kill(2) accepts (2**31) cannot be checked: its write is assumed in flight, not removed."""
    shard = tmp_path / "d" / "ab"
    shard.mkdir(parents=True)
    (shard / temp_name(2**31)).write_bytes(b"x")
    DiskBackend(tmp_path / "d", 100)
    assert [p.name.split("-")[2] for p in shard.iterdir()] == [str(2**31)]


def test_another_hosts_or_an_unknown_temp_file_is_judged_by_age_only(tmp_path):
    """A fresh temp file of another host (its pid means nothing here) or of an unknown naming is kept; one exactly
    ``stale_tmp_s`` old (by default one hour) is removed."""
    other = "00000000" if _THIS_HOST != "00000000" else "11111111"
    shard = tmp_path / "d" / "ab"
    shard.mkdir(parents=True)
    foreign, unknown, old = shard / f".tmp-{other}-0-abcdef", shard / ".tmp-something", shard / ".tmp-old"
    for path in (foreign, unknown, old):
        path.write_bytes(b"x")
    os.utime(old, ns=(1_000_000_000_000_000_000,) * 2)  # 1e9 s, exactly
    real_time = time.time
    time.time = lambda: 1_000_003_600.0  # now - mtime == stale_tmp_s == 3600 exactly
    try:
        DiskBackend(tmp_path / "d", 100)  # the default stale_tmp_s: one hour
    finally:
        time.time = real_time
    assert sorted(p.name for p in shard.iterdir()) == sorted([foreign.name, unknown.name])


def test_files_that_are_not_this_shards_blocks_are_not_adopted_nor_removed(tmp_path):
    """Only ``<shard>/<key>.kvb`` with a valid key starting with the shard is a block: a file without the suffix, a
    block file in the wrong shard, a symlink to a regular file (followed it would be adopted) are left alone."""
    root = tmp_path / "d"
    outside = tmp_path / "outside"
    outside.write_bytes(b"secret")
    planted = [root / "ab" / "abcdefgh", root / "XX" / "readme", root / "cd" / "efgh.kvb"]  # no suffix; wrong shard
    for path in planted:
        path.parent.mkdir(parents=True)
        path.write_bytes(b"12345")
    link = root / "gh" / "ghij.kvb"
    link.parent.mkdir()
    link.symlink_to(outside)
    backend = DiskBackend(root, 100)
    assert backend.keys() == [] and backend.nbytes == 0
    assert all(p.exists() for p in planted) and link.is_symlink()
    assert _stats(backend) == {"unsafe": 1}  # the symlink


def test_a_block_read_back_is_exactly_its_bytes_up_to_the_item_bound(tmp_path):
    """Reads are chunked (1 MiB): a block over one chunk comes back byte for byte; one of exactly max_item_bytes
    is read whole, not cut nor refused."""
    big = bytes(range(256)) * ((1 << 20) // 256 + 8)  # 1 MiB + 2 KiB
    backend = DiskBackend(tmp_path / "d", 4 << 20, max_item_bytes=len(big))
    assert backend.put("aa01", big) and backend.get("aa01") == big
    assert _stats(backend) == {"puts": 1, "hits": 1, "blocks": 1, "bytes": len(big)}


def test_a_file_that_grows_after_its_size_was_checked_is_never_read_past_the_bound(tmp_path, monkeypatch):
    """The race a bounded read guards: the file is within max_item_bytes at fstat, then grows. The read stops at
    max_item_bytes + 1 bytes, refuses the file (a counted corrupt miss, forgotten by the books), raises nothing, and
    removes it: a file over the bound is never adopted at a restart, so left behind it would hold disk outside the
    budget for good."""
    limit = (1 << 20) + 10
    backend = DiskBackend(tmp_path / "d", 4 << 20, max_item_bytes=limit)
    assert backend.put("aa01", b"a" * limit)
    path = backend.path("aa01")
    real_fstat, real_read, got = os.fstat, os.read, []

    def fstat(fd):
        st = real_fstat(fd)
        with open(path, "ab") as f:  # another writer appends right after the check
            f.write(b"b" * 100)
        return st

    def read(fd, n):
        chunk = real_read(fd, n)
        got.append(len(chunk))
        return chunk

    with monkeypatch.context() as m:
        m.setattr(os, "fstat", fstat)
        m.setattr(os, "read", read)
        assert backend.get("aa01") is None
    assert sum(got) == limit + 1
    assert backend.keys() == [] and backend.nbytes == 0 and not path.exists()
    assert _stats(backend) == {"puts": 1, "corrupt": 1, "misses": 1}


def test_block_files_are_written_rw_r__r__(tmp_path):
    old = os.umask(0o022)
    try:
        backend = DiskBackend(tmp_path / "d", 100)
        assert backend.put("aa01", b"x")
    finally:
        os.umask(old)
    assert stat.S_IMODE(backend.path("aa01").stat().st_mode) == 0o644


def test_a_failed_write_leaves_the_old_block_no_temp_file_and_counts_an_error(tmp_path, monkeypatch):
    """An I/O error while writing (here: fsync) is a refused put, counted ``errors`` (not ``unsafe``: nothing was
    a symlink); the temporary file is removed and the key keeps its old value and size."""
    backend = DiskBackend(tmp_path / "d", 100)
    assert backend.put("aa01", b"old")

    def fsync(fd):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "fsync", fsync)
    assert backend.put("aa01", b"new!") is False
    monkeypatch.undo()
    assert sorted(p.name for p in backend.path("aa01").parent.iterdir()) == ["aa01.kvb"]
    assert backend.get("aa01") == b"old" and backend.nbytes == 3
    assert _stats(backend) == {"puts": 1, "errors": 1, "hits": 1, "blocks": 1, "bytes": 3}


def test_a_block_file_resized_outside_takes_its_real_size_and_evicts_only_others(tmp_path):
    """A block file another writer replaced with other bytes: the books take its size (counted ``resized``); if
    that fills the budget exactly nothing is evicted; past it, the least recently used others are — never the
    block being read."""
    root = tmp_path / "d"
    backend = DiskBackend(root, 100)
    assert backend.put("bb02", b"b" * 10) and backend.put("aa01", b"a" * 10)
    _block_file(root, "bb02", b"B" * 90)  # 90 + 10 == 100: fits exactly
    assert backend.get("bb02") == b"B" * 90 and backend.keys() == ["aa01", "bb02"]
    _block_file(root, "aa01", b"A" * 100)  # 100 + 90 > 100: bb02 goes, aa01 stays
    assert backend.get("aa01") == b"A" * 100
    assert backend.keys() == ["aa01"] and backend.nbytes == 100
    assert _stats(backend) == {"puts": 2, "hits": 2, "resized": 2, "evictions": 1, "blocks": 1, "bytes": 100}


def test_block_files_resized_past_the_budget_are_corrupt_misses(tmp_path):
    """With max_item_bytes above the budget, files grown past the budget are read, then dropped as corrupt."""
    root = tmp_path / "d"
    backend = DiskBackend(root, 100, max_item_bytes=1000)
    assert backend.put("aa01", b"a") and backend.put("bb02", b"b")
    _block_file(root, "aa01", b"A" * 101)
    _block_file(root, "bb02", b"B" * 101)
    assert backend.get("aa01") is None and backend.get("bb02") is None
    assert backend.keys() == [] and not backend.path("aa01").exists()
    assert _stats(backend) == {"puts": 2, "resized": 2, "corrupt": 2, "misses": 2}


def test_deleting_a_block_whose_shard_vanished_or_became_a_symlink(tmp_path):
    """A shard directory removed outside: delete forgets the block quietly. A shard replaced by a symlink: nothing
    is deleted through it, and it is counted ``unsafe``."""
    root = tmp_path / "d"
    backend = DiskBackend(root, 100)
    assert backend.put("aa01", b"a") and backend.put("bb02", b"b")
    shutil.rmtree(root / "aa")
    assert backend.delete("aa01") and _stats(backend) == {"puts": 2, "blocks": 1, "bytes": 1}
    elsewhere = tmp_path / "elsewhere"
    (root / "bb").rename(elsewhere)
    (root / "bb").symlink_to(elsewhere)
    assert backend.delete("bb02") and (elsewhere / "bb02.kvb").exists()
    assert _stats(backend) == {"puts": 2, "unsafe": 1}


def test_a_disk_block_evicted_is_handed_to_on_evict_with_its_bytes(tmp_path):
    backend = DiskBackend(tmp_path / "d", 10)
    evicted = []
    backend.on_evict = lambda key, data: evicted.append((key, data))
    assert backend.put("aa01", b"a" * 6) and backend.put("bb02", b"b" * 6)
    assert evicted == [("aa01", b"a" * 6)] and not backend.path("aa01").exists()


# ----------------------------------------------------------------------------- arguments refused, naming what
def test_block_keys_are_1_to_128_safe_characters_else_refused_naming_the_key():
    backend = HostMemoryBackend(1000)
    assert backend.put("k" * 128, b"x") and backend.put("A-z_9", b"y")
    with pytest.raises(ConfigError, match=r"^invalid block key 'a/b': expected 1-128 characters of \[A-Za-z0-9_-\]$"):
        backend.put("a/b", b"x")
    for bad in ("", "k" * 129, "a.b"):
        with pytest.raises(ConfigError, match=r"^invalid block key "):
            backend.get(bad)
    with pytest.raises(ArgumentTypeError, match=r"^block key: expected str, got int \(5\)$"):
        backend.get(5)
    with pytest.raises(ArgumentTypeError, match=r"^data: expected bytes or bytearray or memoryview, got str"):
        backend.put("aa01", "text")
    assert backend.put("mv01", memoryview(b"mv")) and backend.get("mv01") == b"mv"


def test_get_many_refuses_a_lone_string_or_a_non_iterable_naming_it():
    backend = HostMemoryBackend(100)
    assert backend.put("aa01", b"x")
    with pytest.raises(ArgumentTypeError, match=r"^keys: expected an iterable of str, got str \('aa01'\)$"):
        backend.get_many("aa01")
    with pytest.raises(ArgumentTypeError, match=r"^keys: expected an iterable of str, got int \(5\)$"):
        backend.get_many(5)
    with pytest.raises(ConfigError, match=r"^invalid block key 'a/b'"):
        backend.get_many(["aa01", "a/b"])
    assert backend.get_many(k for k in ["aa01", "bb02"]) == {"aa01": b"x"}


def test_budgets_and_item_bounds_are_positive_ints_named_when_refused(tmp_path):
    """1 is the smallest budget and bound; 0 and a non-int are refused naming the argument. The item bound
    defaults to the budget."""
    assert HostMemoryBackend(1).put("aa01", b"x")
    assert DiskBackend(tmp_path / "a", 100).max_item_bytes == 100
    assert DiskBackend(tmp_path / "b", 100, max_item_bytes=1).max_item_bytes == 1
    with pytest.raises(ConfigError, match=r"^budget_bytes must be a positive int, got 0$"):
        HostMemoryBackend(0)
    with pytest.raises(ArgumentTypeError, match=r"^budget_bytes: expected int, got str"):
        HostMemoryBackend("5")
    with pytest.raises(ConfigError, match=r"^max_item_bytes must be a positive int, got -1$"):
        DiskBackend(tmp_path / "c", 100, max_item_bytes=-1)


# ------------------------------------------------------------------- the disk backend: what it finds on disk
def test_disk_blocks_over_a_lowered_item_bound_are_counted_corrupt_misses_and_removed(tmp_path):
    backend = DiskBackend(tmp_path / "d", 1000)
    assert backend.put("aa01", b"a" * 100) and backend.put("bb02", b"b" * 80) and backend.put("cc03", b"c" * 60)
    backend.limit_item_bytes(60)
    assert backend.get("aa01") is None and backend.get("bb02") is None and backend.get("zz99") is None
    assert backend.get("cc03") == b"c" * 60
    assert not backend.path("aa01").exists() and not backend.path("bb02").exists()
    assert backend.keys() == ["cc03"] and backend.nbytes == 60
    assert _stats(backend) == {"puts": 3, "corrupt": 2, "misses": 3, "hits": 1, "blocks": 1, "bytes": 60}


def test_disk_blocks_removed_outside_are_quiet_misses_and_forgotten(tmp_path):
    """A block file deleted by someone else: a miss (not an error), and the books forget it."""
    backend = DiskBackend(tmp_path / "d", 100)
    assert backend.put("aa01", b"a" * 10) and backend.put("bb02", b"b" * 10) and backend.put("cc03", b"c")
    backend.path("aa01").unlink()
    backend.path("bb02").unlink()
    assert backend.get("aa01") is None and backend.get("bb02") is None and backend.get("cc03") == b"c"
    assert backend.keys() == ["cc03"] and backend.nbytes == 1
    assert _stats(backend) == {"puts": 3, "misses": 2, "hits": 1, "blocks": 1, "bytes": 1}


def test_entries_at_the_root_that_cannot_be_shards_are_counted_once_each_and_left_alone(tmp_path):
    """A file and a symlink under shard names are counted ``unsafe`` (one each); a directory whose name is not a
    shard's is no shard: not counted, and even its stale-looking temporary files are not touched."""
    root = tmp_path / "d"
    root.mkdir()
    (root / "ab").write_bytes(b"a file")
    (tmp_path / "dir").mkdir()
    (root / "cd").symlink_to(tmp_path / "dir")
    (root / "abc").mkdir()
    (root / "abc" / ".tmp-old").write_bytes(b"x")
    (root / "abc" / "abcd.kvb").write_bytes(b"x")
    backend = DiskBackend(root, 100, stale_tmp_s=0)
    assert backend.keys() == [] and (root / "abc" / ".tmp-old").exists() and (root / "ab").exists()
    assert _stats(backend) == {"unsafe": 2}


def test_an_entry_that_vanishes_during_the_scan_is_skipped_not_the_rest_of_its_shard(tmp_path, monkeypatch):
    root = tmp_path / "d"
    _block_file(root, "ab01", b"1")
    _block_file(root, "ab02", b"22")
    real = os.scandir

    class Vanished:
        name = "ab00.kvb"

        def stat(self, *, follow_symlinks=True):
            raise FileNotFoundError(errno.ENOENT, "gone", self.name)

    class Listing(list):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    def scandir(path="."):
        with real(path) as it:
            entries = sorted(it, key=lambda e: e.name)
        return Listing([Vanished(), *entries] if isinstance(path, int) else entries)

    monkeypatch.setattr(os, "scandir", scandir)
    backend = DiskBackend(root, 100)
    monkeypatch.undo()
    assert sorted(backend.keys()) == ["ab01", "ab02"] and backend.nbytes == 3


# ------------------------------------------------------------------ the disk root's lock: one process per root
def _in_child(fn) -> str:
    """``fn()`` run in a forked child: ``returned <repr>`` or ``<Error>: <message>``."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child reports and leaves without the parent's finalizers or pytest's teardown
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


def test_the_root_lock_names_this_pid_and_is_released_once_every_backend_on_it_is_closed(tmp_path):
    """root/.lock (rw-r--r--) holds this process's pid; another process is refused while any backend of this one
    is open on the root, and takes the root once the last one is closed."""
    root = tmp_path / "d"
    old = os.umask(0o022)
    try:
        first, second = DiskBackend(root, 100), DiskBackend(root, 100)
    finally:
        os.umask(old)
    lock = root / ".lock"
    # read in a child: closing any descriptor of the file in this process would drop this process's lockf lock
    assert _in_child(lock.read_bytes) == f"returned {str(os.getpid()).encode()!r}"
    assert stat.S_IMODE(lock.stat().st_mode) == 0o644
    first.close()
    refused = _in_child(lambda: DiskBackend(root, 100).keys())
    assert refused.startswith(f"StateError: disk tier root {str(root.resolve())!r} is in use by another process")
    second.close()
    assert _in_child(lambda: DiskBackend(root, 100).keys()) == "returned []"


def test_a_closed_or_inherited_backend_refuses_use_naming_its_root_and_processes(tmp_path):
    root = tmp_path / "d"
    backend = DiskBackend(root, 100)
    where = repr(str(root.resolve()))
    inherited = _in_child(lambda: backend.get("aa01"))
    assert re.fullmatch(
        rf"StateError: disk tier backend on {re.escape(where)} was made by process {os.getpid()}, used in \d+ \(after "
        r"fork\): one process per root — make the child its own DiskBackend on its own root",
        inherited,
    )
    backend.close()
    with pytest.raises(
        StateError, match=rf"^disk tier backend on {re.escape(where)} is closed: make a new DiskBackend$"
    ):
        backend.get("aa01")


def test_a_lock_file_that_is_a_symlink_or_a_fifo_is_refused_naming_the_root(tmp_path):
    for name, plant, says in (
        ("s", lambda p: p.symlink_to(tmp_path / "elsewhere"), ".lock is a symlink or a directory"),
        ("f", os.mkfifo, ".lock is not a regular file (mode 10644)"),
    ):
        root = tmp_path / name
        root.mkdir()
        old = os.umask(0o022)
        try:
            plant(root / ".lock")
        finally:
            os.umask(old)
        where = re.escape(f"disk tier root {str(root.resolve())!r}: {says}")
        with pytest.raises(ConfigError, match=rf"^{where}$"):
            DiskBackend(root, 100)
    assert not (tmp_path / "elsewhere").exists()


@pytest.mark.parametrize(
    ("content", "named"),
    [
        (None, "{pid}"),
        (b"   \n", "unknown"),
        (b"\xff42", "\ufffd42"),
        (b"7" * 40, "7" * 20),
        (b" " * 32 + b"7", "unknown"),
    ],
)
def test_a_held_root_names_its_holder_as_the_lock_file_says(tmp_path, content, named):
    """The refusal names the pid written in root/.lock (its first 32 bytes, at most 20 characters shown;
    undecodable bytes replaced; nothing there: "unknown") — never a decoding error."""
    root = tmp_path / "d"
    holder = DiskBackend(root, 100)
    if content is not None:  # written by another process: closing a descriptor here would drop our lock
        assert _in_child(lambda: (root / ".lock").write_bytes(content)) == f"returned {len(content)}"
    refused = _in_child(lambda: DiskBackend(root, 100))
    pid = named.format(pid=os.getpid())
    assert refused == (
        f"StateError: disk tier root {str(root.resolve())!r} is in use by another process (pid {pid}): one process "
        "per root — give each process its own root (or share blocks through the Redis tier)"
    )
    holder.close()


# ----------------------------------------------------------------------- the disk backend: construction, restart
def test_a_disk_root_is_a_path_made_with_its_parents_else_refused_naming_it(tmp_path):
    assert DiskBackend(tmp_path / "a" / "b" / "c", 100).root == (tmp_path / "a" / "b" / "c").resolve()
    with pytest.raises(ArgumentTypeError, match=r"^root: expected str or PathLike, got int \(5\)$"):
        DiskBackend(5, 100)
    (tmp_path / "file").write_bytes(b"x")
    under_a_file = str(tmp_path / "file" / "d")
    with pytest.raises(ConfigError, match=rf"^cannot use {re.escape(repr(under_a_file))} as a disk tier root: "):
        DiskBackend(under_a_file, 100)
    with pytest.raises(ConfigError, match=r"^stale_tmp_s must be finite and >= 0 seconds, got -1$"):
        DiskBackend(tmp_path / "e", 100, stale_tmp_s=-1)
    assert DiskBackend(tmp_path / "f", 100, stale_tmp_s=0).stale_tmp_s == 0


def test_a_restart_adopts_every_shards_blocks_oldest_first_and_keeps_exactly_the_budget(tmp_path):
    """Blocks in several shards, written with known mtimes, totalling exactly the budget: a new backend on the root
    (after the first is closed) adopts all of them, least recently modified first; at a smaller budget it evicts
    the oldest until the rest fit."""
    root = tmp_path / "d"
    first = DiskBackend(root, 100)
    for i, key in enumerate(["cc03", "aa01", "bb02", "dd04"]):
        assert first.put(key, bytes([i]) * 25)
        os.utime(first.path(key), ns=(10**18 + i * 10**9,) * 2)
    first.close()
    again = DiskBackend(root, 100)
    assert again.keys() == ["cc03", "aa01", "bb02", "dd04"] and again.nbytes == 100
    assert again.get("aa01") == bytes([1]) * 25
    again.close()
    smaller = DiskBackend(root, 60)
    assert smaller.keys() == ["bb02", "dd04"] and smaller.nbytes == 50
    assert not smaller.path("cc03").exists() and not smaller.path("aa01").exists()
    assert _stats(smaller) == {"evictions": 2, "blocks": 2, "bytes": 50}


def test_a_second_backend_in_the_process_shares_the_books_and_forgets_files_gone(tmp_path):
    """Backends of one process on one root share the books; a new one re-scans and forgets blocks whose files
    went away meanwhile."""
    root = tmp_path / "d"
    first = DiskBackend(root, 100)
    assert first.put("aa01", b"a" * 10) and first.put("bb02", b"b" * 20)
    first.path("aa01").unlink()
    second = DiskBackend(root, 100)
    assert second.keys() == ["bb02"] == first.keys() and first.nbytes == 20 == second.nbytes


def test_a_shard_scan_goes_on_past_temp_files_and_unsafe_entries(tmp_path, monkeypatch):
    """In one shard, listed in name order (temp files first): a fresh temp file is kept, a file that is not a block
    is left alone, a dangling symlink and a file over max_item_bytes are counted ``unsafe`` (one each) and not
    adopted, and the blocks after them are — one of exactly max_item_bytes included."""
    root = tmp_path / "d"
    shard = root / "ab"
    shard.mkdir(parents=True)
    (shard / ".tmp-fresh").write_bytes(b"x")
    (shard / "ab00.kvb").symlink_to(tmp_path / "missing")
    (shard / "ab00.txt").write_bytes(b"not a block")
    (shard / "ab01.kvb").write_bytes(b"1" * 11)
    (shard / "ab02.kvb").write_bytes(b"2" * 5)
    (shard / "ab03.kvb").write_bytes(b"3" * 10)
    real = os.scandir

    def scandir(path="."):
        with real(path) as it:
            return sorted(it, key=lambda e: e.name) if isinstance(path, int) else list(it)

    monkeypatch.setattr(os, "scandir", lambda path=".": _Listing(scandir(path)))
    backend = DiskBackend(root, 100, max_item_bytes=10)
    monkeypatch.undo()
    assert sorted(backend.keys()) == ["ab02", "ab03"] and backend.nbytes == 15
    assert (shard / ".tmp-fresh").exists() and (shard / "ab00.txt").exists() and (shard / "ab01.kvb").exists()
    assert _stats(backend) == {"unsafe": 2, "blocks": 2, "bytes": 15}


class _Listing(list):
    """A directory listing usable as os.scandir's context manager."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_an_unreadable_root_or_root_entry_is_counted_not_raised(tmp_path, monkeypatch):
    """A root that cannot be listed: an empty backend, counted ``errors``. A root entry under a shard name whose
    type cannot be read is not taken for a shard: counted ``unsafe``, never scanned."""
    root = tmp_path / "d"
    _block_file(root, "ab01", b"1")
    real = os.scandir

    def unreadable(path="."):
        if isinstance(path, int):
            return real(path)
        raise PermissionError(errno.EACCES, "Permission denied", os.fspath(path))

    monkeypatch.setattr(os, "scandir", unreadable)
    backend = DiskBackend(root, 100)
    monkeypatch.undo()
    assert backend.keys() == [] and _stats(backend) == {"errors": 1}
    backend.close()

    class Unknown:
        name = "zz"

        def is_dir(self, *, follow_symlinks=True):
            raise OSError(errno.EIO, "I/O error", self.name)

    def with_unknown(path="."):
        with real(path) as it:
            entries = list(it)
        return _Listing(entries if isinstance(path, int) else [Unknown(), *entries])

    monkeypatch.setattr(os, "scandir", with_unknown)
    backend = DiskBackend(root, 100)
    monkeypatch.undo()
    assert backend.keys() == ["ab01"] and _stats(backend) == {"unsafe": 1, "blocks": 1, "bytes": 1}
