"""One KV block as bytes for a lower tier: a safetensors file holding the (compressed) block, whose header says
what it is — format, model fingerprint, KV geometry, codec, the raw size and a BLAKE2b checksum of the raw bytes.

Nothing is unpickled: safetensors stores raw bytes and a JSON header. Decoding checks everything before
trusting anything: a truncated or garbled file, a checksum mismatch or a block of another model or geometry
raises :class:`~memos_ref.errors.CorruptCacheError` (:class:`~memos_ref.errors.ModelMismatchError` for a
foreign model), which the tier store counts and treats as a miss.
"""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import save as st_save

from memos_ref.errors import ConfigError, CorruptCacheError, ModelMismatchError, ShapeError, check_type
from memos_ref.spec import KVSpec
from memos_ref.tiering.codecs import Codec, get_codec

__all__ = ["FORMAT", "MAX_HEADER_BYTES", "decode_block", "encode_block", "max_encoded_bytes"]

FORMAT = "memos-kv-block/1"
#: The largest JSON header a block file may have (ours are a few hundred bytes).
MAX_HEADER_BYTES = 1 << 16


def max_encoded_bytes(spec: KVSpec) -> int:
    """The largest a block file of this geometry can be, with any codec: the header bound, the raw bytes and
    the worst-case expansion of lz4 or zstd on incompressible input. Tiers refuse to read anything larger."""
    raw = spec.bytes_per_block
    return 8 + MAX_HEADER_BYTES + raw + raw // 64 + 4096


def _raw(block: torch.Tensor) -> bytes:
    return block.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def encode_block(block: torch.Tensor, *, spec: KVSpec, fingerprint: str, codec: Codec, key: str = "") -> bytes:
    """Serialise one block ``[L, 2, H, T, D]`` (in ``spec.dtype``) with ``codec``."""
    check_type("block", block, torch.Tensor)
    check_type("spec", spec, KVSpec)
    check_type("fingerprint", fingerprint, str)
    check_type("codec", codec, Codec)
    check_type("key", key, str)
    if tuple(block.shape) != spec.block_shape or block.dtype != spec.dtype:
        raise ShapeError(f"block must be {spec.block_shape} {spec.dtype}, got {tuple(block.shape)} {block.dtype}")
    raw = _raw(block)
    payload = codec.encode(raw, block.element_size())
    meta = {
        "format": FORMAT,
        "fingerprint": fingerprint,
        "spec": json.dumps(spec.to_dict(), sort_keys=True),
        "codec": codec.name,
        "raw_nbytes": str(len(raw)),
        "checksum": hashlib.blake2b(raw, digest_size=16).hexdigest(),
        "key": key,
    }
    return st_save({"payload": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}, metadata=meta)


def _header(data: bytes | memoryview) -> tuple[dict, int]:
    """The parsed JSON header and its length; bounded before it is parsed."""
    if len(data) < 8:
        raise CorruptCacheError(f"truncated block file: {len(data)} bytes")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > MAX_HEADER_BYTES:
        raise CorruptCacheError(f"truncated block file: header of {n} bytes in a file of {len(data)}")
    try:
        header = json.loads(bytes(data[8 : 8 + n]))
        meta = header["__metadata__"]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:  # RecursionError: nesting bombs
        raise CorruptCacheError(f"unreadable block header: {type(exc).__name__}: {exc}") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise CorruptCacheError(f"not a {FORMAT} file (format {found!r})")
    return header, n


def _payload(data: bytes | memoryview, header: dict, n: int, limit: int) -> memoryview:
    """The stored payload bytes (a view, nothing copied), after checking the safetensors entry describes
    exactly the rest of the file and is at most ``limit`` bytes."""
    entry = header.get("payload")
    if set(header) != {"__metadata__", "payload"} or not isinstance(entry, dict):
        raise CorruptCacheError(f"block file must hold one 'payload' tensor, found {sorted(header)[:8]}")
    offsets, shape = entry.get("data_offsets"), entry.get("shape")
    valid = (
        entry.get("dtype") == "U8"
        and isinstance(offsets, list)
        and len(offsets) == 2
        and all(type(x) is int for x in offsets)
        and 0 <= offsets[0] <= offsets[1]
        and shape == [offsets[1] - offsets[0]]
        and 8 + n + offsets[1] == len(data)
    )
    if not valid:
        raise CorruptCacheError(f"damaged block file: payload entry {str(entry)[:200]} in a file of {len(data)}")
    if offsets[1] - offsets[0] > limit:
        raise CorruptCacheError(f"payload of {offsets[1] - offsets[0]} bytes; this geometry allows {limit}")
    return memoryview(data)[8 + n + offsets[0] : 8 + n + offsets[1]]


def decode_block(data: bytes, *, spec: KVSpec, fingerprint: str, key: str | None = None) -> torch.Tensor:
    """The block ``[L, 2, H, T, D]`` stored in ``data``, after checking format, model, geometry and checksum.

    Untrusted input: the header is bounded before it is parsed, the payload before it is copied, and the
    decompressed size is bounded by the geometry before it is allocated (no decompression bombs)."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise CorruptCacheError(f"block data must be bytes, got {type(data).__name__}")
    header, n = _header(data)
    meta = header["__metadata__"]
    if meta.get("fingerprint") != fingerprint:
        raise ModelMismatchError(
            f"block was written by model {meta.get('fingerprint')!r}, this model is {fingerprint!r}"
        )
    if meta.get("spec") != json.dumps(spec.to_dict(), sort_keys=True):
        raise ModelMismatchError(f"block geometry {meta.get('spec')} does not match {spec.to_dict()}")
    if key is not None and meta.get("key") != key:
        raise CorruptCacheError(f"block file holds key {meta.get('key')!r}, expected {key!r}")
    try:
        codec = get_codec(meta["codec"])
        declared = int(meta["raw_nbytes"])
        checksum = meta["checksum"]
    except (KeyError, ValueError, TypeError, ConfigError) as exc:  # ArgumentTypeError is a TypeError
        raise CorruptCacheError(f"damaged block header: {type(exc).__name__}: {exc}") from None
    if declared != spec.bytes_per_block:
        raise CorruptCacheError(f"block header says {declared} raw bytes; this geometry has {spec.bytes_per_block}")
    payload = _payload(data, header, n, max_encoded_bytes(spec))
    raw = codec.decode(payload, spec.dtype.itemsize, size=declared)
    if len(raw) != declared or hashlib.blake2b(raw, digest_size=16).hexdigest() != checksum:
        raise CorruptCacheError(f"block {meta.get('key')!r} failed its checksum ({len(raw)} bytes)")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(spec.dtype).reshape(spec.block_shape)
