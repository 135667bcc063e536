"""Codecs for KV blocks moved to a lower tier: none, lz4, zstd (levels), each optionally after a byte shuffle.

KV values are floats whose bytes look random except the high ones (sign, exponent): general compressors find
little to exploit in them. A *byte shuffle* groups the bytes of every element by significance (all first bytes,
then all second bytes, ...) so that the exponent bytes, which repeat, sit together — the trick of Blosc and
HDF5. The design expects ratios of roughly 1.0-1.4× on real fp16 KV; seed 001 §4.2 claims LZ4 2.1×,
Zstd 3.3×. ``bench tiering`` measures them on the shipped model's KV (docs/tiers.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memos_ref.errors import BackendUnavailableError, ConfigError, CorruptCacheError, check_type

__all__ = ["CODECS", "Codec", "get_codec", "shuffle", "unshuffle"]


def shuffle(data: bytes, itemsize: int) -> bytes:
    """Group the bytes of ``itemsize``-byte elements by significance: ``[n, s] -> [s, n]``."""
    if itemsize <= 1 or len(data) % itemsize:
        return data
    return np.frombuffer(data, dtype=np.uint8).reshape(-1, itemsize).T.tobytes()


def unshuffle(data: bytes, itemsize: int) -> bytes:
    if itemsize <= 1 or len(data) % itemsize:
        return data
    return np.frombuffer(data, dtype=np.uint8).reshape(itemsize, -1).T.tobytes()


@dataclass(frozen=True)
class Codec:
    """``algorithm`` in ``none | lz4 | zstd``, a ``level`` for zstd, and whether to byte-shuffle first."""

    algorithm: str = "none"
    level: int = 3
    shuffled: bool = False

    @property
    def name(self) -> str:
        base = f"zstd-{self.level}" if self.algorithm == "zstd" else self.algorithm
        return base + ("+shuffle" if self.shuffled else "")

    def encode(self, data: bytes, itemsize: int) -> bytes:
        if self.shuffled:
            data = shuffle(data, itemsize)
        if self.algorithm == "lz4":
            import lz4.frame

            return lz4.frame.compress(data)
        if self.algorithm == "zstd":
            import zstandard

            return zstandard.ZstdCompressor(level=self.level).compress(data)
        return data

    def decode(self, data: bytes | memoryview, itemsize: int, size: int | None = None) -> bytes:
        """Decompress (and unshuffle) ``data``.

        ``size`` is the exact length the output must have (the block's raw size, from the geometry): a frame
        that declares another length, or that would decompress to more, is refused with
        :class:`~memos_ref.errors.CorruptCacheError` before anything larger than ``size`` is allocated — a
        tier file of a few kilobytes cannot make a read allocate gigabytes. ``None`` (trusted input only)
        leaves the output unbounded.
        """
        try:
            if self.algorithm == "lz4":
                out = _lz4_decode(data, size)
            elif self.algorithm == "zstd":
                out = _zstd_decode(data, size)
            elif size is not None and len(data) != size:  # checked before copying anything
                raise CorruptCacheError(f"holds {len(data)} bytes, expected {size}")
            else:
                out = bytes(data)
        except ImportError as exc:  # a missing library is not a damaged block: never delete a good copy for it
            raise BackendUnavailableError(f"{self.name} needs a library that is not installed: {exc}") from None
        except CorruptCacheError as exc:
            raise CorruptCacheError(f"{self.name}: {exc}") from None
        except Exception as exc:  # lz4 and zstd raise their own error types on damaged input
            raise CorruptCacheError(f"{self.name}: cannot decompress ({type(exc).__name__}: {exc})") from None
        if size is not None and len(out) != size:
            raise CorruptCacheError(f"{self.name}: decompressed to {len(out)} bytes, expected {size}")
        return unshuffle(out, itemsize) if self.shuffled else out


def _lz4_decode(data: bytes | memoryview, size: int | None) -> bytes:
    import lz4.frame

    if size is None:
        return lz4.frame.decompress(data)
    declared = lz4.frame.get_frame_info(data).get("content_size", 0)
    if declared and declared != size:  # 0: the frame does not say
        raise CorruptCacheError(f"frame declares {declared} bytes, expected {size}")
    decompressor = lz4.frame.LZ4FrameDecompressor()
    out = decompressor.decompress(data, max_length=size)  # never more than size bytes
    if not decompressor.eof:
        raise CorruptCacheError(f"frame decompresses to more than {size} bytes (or is truncated)")
    return out


#: zstd's "content size unknown" marker.
_ZSTD_UNKNOWN = 2**64 - 1


def _zstd_decode(data: bytes | memoryview, size: int | None) -> bytes:
    import zstandard

    if size is None:
        return zstandard.ZstdDecompressor().decompress(data)
    declared = zstandard.get_frame_parameters(data).content_size
    if declared != _ZSTD_UNKNOWN and declared != size:
        raise CorruptCacheError(f"frame declares {declared} bytes, expected {size}")
    # One-shot: the output buffer is the declared size (checked above) or at most max_output_size; no window
    # buffer is allocated for a one-shot decode.
    return zstandard.ZstdDecompressor().decompress(data, max_output_size=max(size, 1))


#: Every codec compared by ``bench tiering``, by name.
CODECS: dict[str, Codec] = {
    c.name: c
    for c in [
        Codec("none"),
        Codec("lz4"),
        Codec("lz4", shuffled=True),
        Codec("zstd", 1),
        Codec("zstd", 3),
        Codec("zstd", 9),
        Codec("zstd", 3, shuffled=True),
        Codec("zstd", 9, shuffled=True),
    ]
}


def get_codec(name: str) -> Codec:
    """A codec by name (``none``, ``lz4``, ``lz4+shuffle``, ``zstd-N``, ``zstd-N+shuffle``)."""
    check_type("name", name, str)
    if name in CODECS:
        return CODECS[name]
    base, _, suffix = name.partition("+")
    if base.startswith("zstd-") and base[5:].isdigit() and suffix in ("", "shuffle") and 1 <= int(base[5:]) <= 22:
        return Codec("zstd", int(base[5:]), shuffled=suffix == "shuffle")
    raise ConfigError(f"unknown codec {name!r}: expected one of {sorted(CODECS)} or zstd-1..22[+shuffle]")
