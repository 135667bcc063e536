"""Tier codecs and budgets (issue 30's survivors): a frame that decodes to more bytes than declared was caught only
by the block file's checksum, never at the codec's own API; and replacing a key's value in a budgeted backend was
checked only by an unrelated test file. Oracles: the byte counts computed here from what was put."""

from __future__ import annotations

import lz4.frame
import pytest
import zstandard

from memos_ref.errors import CorruptCacheError
from memos_ref.tiering.backends import DiskBackend, HostMemoryBackend
from memos_ref.tiering.codecs import CODECS, Codec

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
