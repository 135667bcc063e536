"""Session persistence: ``path.safetensors`` (K/V ``[L, 2, H, S, D]``) and ``path.json`` (a manifest with
checksums, the model fingerprint and the KVSpec).

Both files are untrusted when read back: sizes are bounded before reading (:func:`read_bounded` refuses FIFOs,
devices and growing files), the manifest's checksum covers every field and every field is checked
(:func:`parse_manifest`), the tensor file holds exactly one tensor of the manifest's dtype and shape with finite
values (:func:`read_session_tensor`). Nothing is unpickled; nothing is allocated before everything is checked.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import secrets
import stat
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from memos_ref.errors import CorruptCacheError, InvalidArgumentError, KVCacheError, check_type
from memos_ref.session.segments import SEGMENT_KIND_VALUES, Segment, SegmentKind
from memos_ref.spec import KVSpec

__all__ = [
    "MANIFEST_VERSION",
    "MAX_MANIFEST_BYTES",
    "MAX_TENSOR_HEADER_BYTES",
    "manifest_checksum",
    "manifest_limit",
    "parse_manifest",
    "read_bounded",
    "read_session_tensor",
    "session_files",
    "write_session",
]

MANIFEST_VERSION = 2

#: Largest session manifest read (bytes): room for about four million token ids.
MAX_MANIFEST_BYTES = 32 << 20
#: Largest safetensors header accepted in a session tensor file, beyond the tensor's own bytes.
MAX_TENSOR_HEADER_BYTES = 64 << 10
_MANIFEST_FIELDS = frozenset(
    {"format", "version", "fingerprint", "kv_spec", "token_ids", "segments", "sha256", "bytes", "manifest_sha256"}
)
_SEGMENT_FIELDS = frozenset({"kind", "seg_id", "start", "stop"})


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def manifest_checksum(manifest: dict[str, Any]) -> str:
    """SHA-256 of the canonical JSON (sorted keys, no spaces, ASCII) of every manifest field but
    ``manifest_sha256`` itself."""
    return hashlib.sha256(_canonical_json({k: v for k, v in manifest.items() if k != "manifest_sha256"})).hexdigest()


def read_bounded(path: Path, limit: int) -> bytes:
    """The bytes of a regular file of at most ``limit`` bytes; anything else (a missing file, a FIFO, a device,
    a directory, a larger file, a file that grows while read, a path with a NUL) is refused with
    :class:`CorruptCacheError`. The descriptor is closed on every path (nothing leaks per call). A ``path`` that
    is not a ``str`` or ``os.PathLike`` (a descriptor number, ``None``) or a ``limit`` that is not an ``int`` is
    :class:`ArgumentTypeError`; a negative ``limit`` is :class:`InvalidArgumentError`."""
    check_type("path", path, (str, os.PathLike))
    check_type("limit", limit, int)
    if limit < 0:
        raise InvalidArgumentError(f"limit: expected a number of bytes >= 0, got {limit}")
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the path
        raise CorruptCacheError(f"cannot open {str(path)[:200]!r}: {exc}") from None
    try:
        info = os.fstat(fd)  # on the raw descriptor: fdopen refuses a directory without closing it
        if not stat.S_ISREG(info.st_mode):
            raise CorruptCacheError(f"{path} is not a regular file")
        if info.st_size > limit:
            raise CorruptCacheError(f"{path} holds {info.st_size} bytes, more than the {limit} expected at most")
        chunks, size = [], 0
        while size <= limit:  # bounded: at most limit + 1 bytes, in reads of at most 1 MiB
            try:
                chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            except OSError as exc:
                raise CorruptCacheError(f"cannot read {path}: {exc}") from None
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    data = b"".join(chunks)
    if len(data) > limit:
        raise CorruptCacheError(f"{path} grew past {limit} bytes while being read")
    return data


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_manifest(raw: bytes, where: Path, vocab_size: int) -> dict[str, Any]:
    """Parse and validate a session manifest; returns its fields plus ``spec`` (a :class:`KVSpec`) and
    ``segments`` as :class:`Segment` objects. Raises :class:`CorruptCacheError` naming the bad field."""

    def bad(what: str) -> CorruptCacheError:
        return CorruptCacheError(f"{where}: {what}")

    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not JSON")

    try:
        manifest = json.loads(raw.decode("utf-8"), parse_constant=refuse_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise bad(f"cannot read the session manifest: {str(exc)[:200]}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != "memos-ref-session":
        raise bad("is not a memos-ref session manifest (format 'memos-ref-session')")
    if manifest.get("version") != MANIFEST_VERSION:
        raise bad(
            f"manifest version {manifest.get('version')!r} is not {MANIFEST_VERSION} (earlier versions are not "
            f"checksummed as a whole and are refused: save the session again with this version)"
        )
    if set(manifest) != _MANIFEST_FIELDS:
        raise bad(f"manifest fields {sorted(manifest)} are not the expected {sorted(_MANIFEST_FIELDS)}")
    if manifest["manifest_sha256"] != manifest_checksum(manifest):
        raise bad("the manifest does not match its checksum (modified or damaged)")
    # The checksum only proves the manifest is intact, not that it was written by this package: check every field.
    fingerprint = manifest["fingerprint"]
    if not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= 256:
        raise bad(f"fingerprint must be a non-empty string of at most 256 characters, got {fingerprint!r:.80}")
    digest = manifest["sha256"]
    if not isinstance(digest, str) or len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
        raise bad(f"sha256 must be 64 lowercase hex digits, got {digest!r:.80}")
    if not _is_int(manifest["bytes"]) or manifest["bytes"] < 0:
        raise bad(f"bytes must be a non-negative int, got {manifest['bytes']!r:.80}")
    spec_dict = manifest["kv_spec"]
    try:
        if not isinstance(spec_dict, dict):
            raise TypeError(f"expected an object, got {type(spec_dict).__name__}")
        spec = KVSpec.from_dict(spec_dict)
    except (KVCacheError, KeyError, TypeError, ValueError, OverflowError) as exc:
        raise bad(f"kv_spec is malformed: {exc}") from None
    if spec.to_dict() != spec_dict:
        raise bad(f"kv_spec {spec_dict} is not what KVSpec.to_dict() writes: {spec.to_dict()}")
    tokens = manifest["token_ids"]
    if not isinstance(tokens, list) or not tokens:
        raise bad(f"token_ids must be a non-empty list, got {type(tokens).__name__}")
    for i, t in enumerate(tokens):
        if not _is_int(t) or not 0 <= t < vocab_size:
            raise bad(f"token_ids[{i}] must be an int in [0, {vocab_size}), got {t!r:.80}")
    manifest["spec"] = spec
    manifest["segments"] = _parse_segments(manifest["segments"], len(tokens), bad)
    return manifest


def _parse_segments(raw: Any, num_tokens: int, bad: Callable[[str], CorruptCacheError]) -> list[Segment]:
    """Segments in order, without overlap, inside ``[0, num_tokens]``."""
    if not isinstance(raw, list):
        raise bad(f"segments must be a list, got {type(raw).__name__}")
    segments: list[Segment] = []
    previous_stop = 0
    for i, item in enumerate(raw):
        if not isinstance(item, dict) or set(item) != _SEGMENT_FIELDS:
            raise bad(f"segments[{i}] must be an object with fields {sorted(_SEGMENT_FIELDS)}, got {item!r:.120}")
        kind, seg_id, start, stop = item["kind"], item["seg_id"], item["start"], item["stop"]
        if not isinstance(kind, str) or kind not in SEGMENT_KIND_VALUES:
            raise bad(f"segments[{i}].kind must be one of {[k.value for k in SegmentKind]}, got {kind!r:.80}")
        if not isinstance(seg_id, str) or len(seg_id) > 4096:
            raise bad(f"segments[{i}].seg_id must be a string of at most 4096 characters, got {seg_id!r:.80}")
        if not (_is_int(start) and _is_int(stop) and previous_stop <= start <= stop <= num_tokens):
            raise bad(
                f"segments[{i}] range [{start!r:.20}, {stop!r:.20}) must be ints with {previous_stop} <= start "
                f"<= stop <= {num_tokens} (segments in order, inside the session's tokens)"
            )
        segments.append(Segment(SegmentKind(kind), seg_id, start, stop))
        previous_stop = stop
    return segments


def read_session_tensor(path: Path, manifest: dict[str, Any], spec: KVSpec) -> torch.Tensor:
    """The KV ``[L, 2, H, S, D]`` of a session file, checked against its manifest before and after parsing:
    size bounded by the geometry, checksum, exactly one tensor, the manifest's dtype (never converted) and
    shape, finite values."""
    expected = (spec.num_layers, 2, spec.num_kv_heads, len(manifest["token_ids"]), spec.head_dim)
    payload = math.prod(expected) * spec.bytes_per_element
    declared = manifest["bytes"]
    if not payload + 8 <= declared <= payload + 8 + MAX_TENSOR_HEADER_BYTES:
        raise CorruptCacheError(
            f"{path}: the manifest declares {declared} bytes, but KV of shape {expected} in {spec.dtype} takes "
            f"{payload} bytes plus a header of at most {MAX_TENSOR_HEADER_BYTES}"
        )
    data = read_bounded(path, declared)
    if len(data) != declared or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise CorruptCacheError(f"{path} does not match its checksum (truncated or modified)")
    try:
        tensors = safetensors_load(data)
    except Exception as exc:  # safetensors raises its own error types
        raise CorruptCacheError(f"{path} is not a readable session tensor file: {str(exc)[:200]}") from None
    if set(tensors) != {"kv"}:
        raise CorruptCacheError(f"{path} must hold exactly one tensor 'kv', holds {sorted(tensors)}")
    kv = tensors["kv"]
    if kv.dtype != spec.dtype:
        raise CorruptCacheError(
            f"{path}: stored KV is {kv.dtype}, the manifest says {spec.dtype}; refusing to convert it"
        )
    if tuple(kv.shape) != expected:
        raise CorruptCacheError(f"{path}: stored KV has shape {tuple(kv.shape)}, the manifest implies {expected}")
    if kv.is_floating_point() and not bool(torch.isfinite(kv).all()):
        raise CorruptCacheError(f"{path}: stored KV holds NaN or infinite values")
    return kv


def manifest_limit() -> int:
    """The largest manifest read: ``memos_ref.session.MAX_MANIFEST_BYTES`` (the package's knob, settable there)."""
    package = sys.modules.get("memos_ref.session")
    return int(getattr(package, "MAX_MANIFEST_BYTES", MAX_MANIFEST_BYTES))


def session_files(path: str | os.PathLike[str]) -> tuple[Path, Path]:
    """``(path.json, path.safetensors)`` for a session path; a path without a file name (``""``, ``"/"``) or
    with a NUL character is refused with :class:`InvalidArgumentError`."""
    text = os.fspath(path)
    if not isinstance(text, str) or "\x00" in text:
        raise InvalidArgumentError(f"path: expected a file path without NUL characters, got {text!r:.120}")
    try:
        p = Path(text)
        return p.with_suffix(".json"), p.with_suffix(".safetensors")
    except ValueError as exc:  # no file name to put a suffix on
        raise InvalidArgumentError(f"path: expected a file path, got {text!r:.120} ({exc})") from None


def _write_atomic(target: Path, data: bytes) -> None:
    """Write ``data`` to a temporary file beside ``target`` and rename it into place: a reader sees the old
    file or the new one, never a truncated one. A path that cannot be written is an :class:`InvalidArgumentError`."""
    # at most 200 characters of the name: the temporary name then fits NAME_MAX (255) whenever the target's does
    tmp = target.with_name(f".{target.name[:200]}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        os.replace(tmp, target)
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError, PermissionError) as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise InvalidArgumentError(f"path: cannot write {target}: {exc}") from None
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        if exc.errno != errno.ENAMETOOLONG:
            raise
        raise InvalidArgumentError(f"path: cannot write {target}: {exc}") from None
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def write_session(
    path: Path, kv: torch.Tensor, fingerprint: str, spec: KVSpec, token_ids: list[int], segments: list[Segment]
) -> Path:
    """Write ``path.safetensors`` (``kv``: ``[L, 2, H, S, D]``) and ``path.json`` (the manifest; its
    ``manifest_sha256`` covers every other field, ``sha256`` the tensor file). Each file is written to a
    temporary name and renamed into place, the manifest last: an interrupted save leaves the old pair or a pair
    whose checksums disagree (refused at load), never a half-written file."""
    manifest_path, tensor_path = session_files(path)
    data = safetensors_save({"kv": kv.contiguous()})
    manifest: dict[str, Any] = {
        "format": "memos-ref-session",
        "version": MANIFEST_VERSION,
        "fingerprint": fingerprint,
        "kv_spec": spec.to_dict(),
        "token_ids": token_ids,
        "segments": [s.to_dict() for s in segments],
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
    }
    manifest["manifest_sha256"] = manifest_checksum(manifest)
    _write_atomic(tensor_path, data)
    _write_atomic(manifest_path, json.dumps(manifest).encode())
    return path
