"""Tier codecs and budgets (issue 30's survivors): a frame that decodes to more bytes than declared was caught only
by the block file's checksum, never at the codec's own API; and replacing a key's value in a budgeted backend was
checked only by an unrelated test file. Oracles: the byte counts computed here from what was put."""

from __future__ import annotations

import re
import sys

import lz4.frame
import pytest
import zstandard

from memos_ref.errors import ArgumentTypeError, BackendUnavailableError, ConfigError, CorruptCacheError
from memos_ref.tiering.backends import DiskBackend, HostMemoryBackend
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
