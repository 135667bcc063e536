"""Prefill/decode disaggregation: the manifest a prefill process publishes beside a prompt's blocks.

A prefill process computes a prompt's KV, writes its full blocks to the shared tier (``Engine(publish_to=...)``)
and publishes a :class:`Manifest`: the model fingerprint, the KV geometry, the prompt's token ids and the
block keys (chained prefix hashes) it wrote. A decode process reads the manifest (bounded, strictly validated:
it is foreign data), checks the block keys against the chain it computes itself from the token ids, and submits
the prompt to its own engine, whose prefix lookup reloads the blocks from the tier instead of prefilling them;
the partial last block (fewer than ``block_size`` tokens) is recomputed, then it decodes.

Quantized pools are refused (:class:`~memos_ref.errors.ConfigError`): the tier holds full-precision blocks, and
the tier manager does not tier quantized pools.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memos_ref.errors import ConfigError, CorruptCacheError, ModelMismatchError, check_type
from memos_ref.spec import KVSpec
from memos_ref.tiering.backends import TierBackend, validate_block_key

__all__ = [
    "MANIFEST_FORMAT",
    "Manifest",
    "check_disaggregable",
    "manifest_name",
    "publish_manifest",
    "read_manifest",
    "verify_chain",
]

MANIFEST_FORMAT = "memos-kv-manifest/1"
_MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class Manifest:
    """What a decode process needs to adopt a prefilled prompt."""

    fingerprint: str
    spec: dict
    token_ids: list[int]
    block_keys: list[str]

    def to_bytes(self) -> bytes:
        body = {"format": MANIFEST_FORMAT, "fingerprint": self.fingerprint, "spec": self.spec}
        body |= {"token_ids": self.token_ids, "block_keys": self.block_keys}
        return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def manifest_name(token_ids: Sequence[int], fingerprint: str) -> str:
    """A content-addressed manifest key: the same prompt of the same model always has the same name."""
    h = hashlib.blake2b(digest_size=16)
    h.update(fingerprint.encode())
    h.update(b"\x00" + b",".join(str(int(t)).encode() for t in token_ids))
    return f"manifest-{h.hexdigest()}"


def check_disaggregable(kv: Any) -> None:
    """Refuse a quantized pool with :class:`ConfigError` naming what is supported."""
    if kv.pool.quantized:
        raise ConfigError(
            "prefill/decode disaggregation moves full-precision blocks through the tier; this pool is quantized "
            "(expected an unquantized PagedKV, got a quantized one): tiering of quantized pools is not supported"
        )


def publish_manifest(
    backend: TierBackend, token_ids: Sequence[int], block_keys: Sequence[str], *, spec: KVSpec, fingerprint: str
) -> str | None:
    """Store the manifest of a prefilled prompt; its name, or None when the tier dropped the write."""
    check_type("spec", spec, KVSpec)
    keys = [validate_block_key(k) for k in block_keys]
    ids = [int(t) for t in token_ids]
    name = manifest_name(ids, fingerprint)
    manifest = Manifest(fingerprint, spec.to_dict(), ids, keys)
    return name if backend.put_many({name: manifest.to_bytes()}).get(name) else None


def read_manifest(backend: TierBackend, name: str, *, spec: KVSpec, fingerprint: str) -> Manifest | None:
    """The manifest stored under ``name``, or None when absent or unreachable. A manifest that is not one,
    or is of another model or geometry, raises :class:`CorruptCacheError` / :class:`ModelMismatchError`."""
    validate_block_key(name)
    data = backend.get(name)  # bounded by the backend's max_item_bytes before anything is parsed
    if data is None:
        return None
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise CorruptCacheError(f"manifest {name!r} is not JSON: {type(exc).__name__}") from None
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise CorruptCacheError(f"{name!r} is not a {MANIFEST_FORMAT} manifest")
    if body.get("fingerprint") != fingerprint:
        raise ModelMismatchError(f"manifest of model {body.get('fingerprint')!r:.40}, this model is {fingerprint!r}")
    if body.get("spec") != json.loads(json.dumps(spec.to_dict())):
        raise ModelMismatchError(f"manifest geometry {str(body.get('spec'))[:200]} does not match {spec.to_dict()}")
    ids, keys = body.get("token_ids"), body.get("block_keys")
    if not (isinstance(ids, list) and 0 < len(ids) <= _MAX_TOKENS and all(type(t) is int and t >= 0 for t in ids)):
        raise CorruptCacheError(f"manifest {name!r}: token_ids must be 1-{_MAX_TOKENS} non-negative ints")
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys)):
        raise CorruptCacheError(f"manifest {name!r}: block_keys must be a list of strings")
    for k in keys:
        try:
            validate_block_key(k)
        except ConfigError:
            raise CorruptCacheError(f"manifest {name!r}: invalid block key {k!r:.80}") from None
    if manifest_name(ids, fingerprint) != name:
        raise CorruptCacheError(f"manifest {name!r} holds another prompt (its name is not its content's)")
    return Manifest(fingerprint, body["spec"], ids, keys)


def verify_chain(manifest: Manifest, chain: Sequence[bytes]) -> None:
    """Check the manifest's block keys are the chain the decode process computed from its token ids."""
    mine = [h.hex() for h in chain]
    if manifest.block_keys != mine[: len(manifest.block_keys)] or len(manifest.block_keys) > len(mine):
        raise CorruptCacheError(
            f"manifest block keys disagree with the token ids' hash chain ({len(manifest.block_keys)} keys, "
            f"{len(mine)} computed)"
        )
