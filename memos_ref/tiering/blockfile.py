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
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from memos_ref.errors import ConfigError, CorruptCacheError, ModelMismatchError, ShapeError
from memos_ref.spec import KVSpec
from memos_ref.tiering.codecs import Codec, get_codec

__all__ = ["FORMAT", "decode_block", "encode_block"]

FORMAT = "memos-kv-block/1"


def _raw(block: torch.Tensor) -> bytes:
    return block.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def encode_block(block: torch.Tensor, *, spec: KVSpec, fingerprint: str, codec: Codec, key: str = "") -> bytes:
    """Serialise one block ``[L, 2, H, T, D]`` (in ``spec.dtype``) with ``codec``."""
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


def _header(data: bytes) -> dict[str, str]:
    if len(data) < 8:
        raise CorruptCacheError(f"truncated block file: {len(data)} bytes")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8 or n > 1 << 20:
        raise CorruptCacheError(f"truncated block file: header of {n} bytes in a file of {len(data)}")
    try:
        header = json.loads(data[8 : 8 + n])
        meta = header["__metadata__"]
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptCacheError(f"unreadable block header: {exc}") from None
    found = meta.get("format") if isinstance(meta, dict) else None
    if found != FORMAT:
        raise CorruptCacheError(f"not a {FORMAT} file (format {found!r})")
    return meta


def decode_block(data: bytes, *, spec: KVSpec, fingerprint: str, key: str | None = None) -> torch.Tensor:
    """The block ``[L, 2, H, T, D]`` stored in ``data``, after checking format, model, geometry and checksum."""
    meta = _header(data)
    if meta.get("fingerprint") != fingerprint:
        raise ModelMismatchError(
            f"block was written by model {meta.get('fingerprint')!r}, this model is {fingerprint!r}"
        )
    if meta.get("spec") != json.dumps(spec.to_dict(), sort_keys=True):
        raise ModelMismatchError(f"block geometry {meta.get('spec')} does not match {spec.to_dict()}")
    if key is not None and meta.get("key") != key:
        raise CorruptCacheError(f"block file holds key {meta.get('key')!r}, expected {key!r}")
    try:
        payload = st_load(data)["payload"].numpy().tobytes()
    except Exception as exc:  # safetensors raises its own error types on damaged files
        raise CorruptCacheError(f"damaged block file: {type(exc).__name__}: {exc}") from None
    try:
        codec = get_codec(meta["codec"])
        declared = int(meta["raw_nbytes"])
        checksum = meta["checksum"]
    except (KeyError, ValueError, TypeError, ConfigError) as exc:
        raise CorruptCacheError(f"damaged block header: {type(exc).__name__}: {exc}") from None
    if declared != spec.bytes_per_block:
        raise CorruptCacheError(f"block header says {declared} raw bytes; this geometry has {spec.bytes_per_block}")
    raw = codec.decode(payload, spec.dtype.itemsize)
    if len(raw) != declared or hashlib.blake2b(raw, digest_size=16).hexdigest() != checksum:
        raise CorruptCacheError(f"block {meta.get('key')!r} failed its checksum ({len(raw)} bytes)")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(spec.dtype).reshape(spec.block_shape)
