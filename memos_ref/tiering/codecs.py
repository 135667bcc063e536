"""Codecs for KV blocks moved to a lower tier: none, lz4, zstd (levels), each optionally after a byte shuffle.

KV values are floats whose bytes look random except the high ones (sign, exponent): general compressors find
little to exploit in them. A *byte shuffle* groups the bytes of every element by significance (all first bytes,
then all second bytes, ...) so that the exponent bytes, which repeat, sit together — the trick of Blosc and
HDF5. DESIGN.md §7 expects ratios of roughly 1.0-1.4× on real fp16 KV; seed 001 §4.2 claims LZ4 2.1×,
Zstd 3.3×. ``bench tiering`` and notebook 06 measure them on the shipped model's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from memos_ref.errors import BackendUnavailableError, ConfigError, CorruptCacheError

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

    def decode(self, data: bytes, itemsize: int) -> bytes:
        try:
            if self.algorithm == "lz4":
                import lz4.frame

                data = lz4.frame.decompress(data)
            elif self.algorithm == "zstd":
                import zstandard

                data = zstandard.ZstdDecompressor().decompress(data)
        except ImportError as exc:  # a missing library is not a damaged block: never delete a good copy for it
            raise BackendUnavailableError(f"{self.name} needs a library that is not installed: {exc}") from None
        except Exception as exc:  # lz4 and zstd raise their own error types on damaged input
            raise CorruptCacheError(f"{self.name}: cannot decompress ({type(exc).__name__}: {exc})") from None
        return unshuffle(data, itemsize) if self.shuffled else data


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
    if name in CODECS:
        return CODECS[name]
    base, _, suffix = name.partition("+")
    if base.startswith("zstd-") and base[5:].isdigit() and suffix in ("", "shuffle") and 1 <= int(base[5:]) <= 22:
        return Codec("zstd", int(base[5:]), shuffled=suffix == "shuffle")
    raise ConfigError(f"unknown codec {name!r}: expected one of {sorted(CODECS)} or zstd-1..22[+shuffle]")
