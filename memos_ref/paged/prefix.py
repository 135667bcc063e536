"""PrefixCache: content-addressed full blocks, so prompts that share a prefix share its KV blocks.

Block *i* of a sequence gets the chained hash ``h_i = H(h_{i-1} ‖ extra_key ‖ token_ids of block i)``
(BLAKE2b, 128 bits). Chaining makes a block's identity depend on everything before it: the same tokens at
another position have different keys (RoPE), and hash equality means prefix equality. ``extra_key`` carries
the model fingerprint and an optional per-tenant ``cache_salt`` so tenants never share or probe each other's
blocks. A hit also compares the stored token ids, so a hash collision cannot return wrong KV.

Lookups return the longest cached prefix in whole blocks, but never the whole prompt: at least one token is
always left to compute (nano-vllm issue 144: a full hit gave the model zero query tokens). Hits are counted
only in tokens actually reused.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

import torch

from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, ShapeError, check_index, check_type
from memos_ref.paged.allocator import BlockAllocator

__all__ = ["UNKNOWN_TOKEN", "PrefixCache", "block_hashes", "check_token_ids", "hash_block"]

HASH_BYTES = 16  # 128-bit BLAKE2b digests
#: Token id recorded for positions whose ids were not given (such blocks are never prefix-cached).
UNKNOWN_TOKEN = -1
#: Largest token id: ids are hashed as signed 64-bit integers.
MAX_TOKEN_ID = 2**63 - 1


def check_token_ids(name: str, token_ids: object) -> list[int]:
    """Token ids as a list of ints, each in ``[UNKNOWN_TOKEN, MAX_TOKEN_ID]`` (-1 = unknown; ids are hashed as
    signed 64-bit ints); a string, a float or a tensor of floats is refused with :class:`ArgumentTypeError`, an
    id out of that range with :class:`InvalidArgumentError`."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
            raise ArgumentTypeError(f"{name}: expected integer token ids, got a tensor of {token_ids.dtype}")
        token_ids = token_ids.reshape(-1).tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise ArgumentTypeError(
            f"{name}: expected a sequence of int token ids, got {type(token_ids).__name__} ({token_ids!r:.80})"
        )
    out = list(token_ids)
    if not all(type(t) is int for t in out):  # fast path for plain ints; others (numpy ints) are converted
        out = [check_index(f"{name}[{i}]", t, lo=UNKNOWN_TOKEN, hi=MAX_TOKEN_ID) for i, t in enumerate(out)]
    elif out and (min(out) < UNKNOWN_TOKEN or max(out) > MAX_TOKEN_ID):
        bad = min(out) if min(out) < UNKNOWN_TOKEN else max(out)
        raise InvalidArgumentError(
            f"{name}: token ids must lie in [0, 2**63) (or be {UNKNOWN_TOKEN} = unknown), got {bad}"
        )
    return out


def _extra_key(fingerprint: str, cache_salt: str | None) -> bytes:
    return f"{fingerprint}\x00{cache_salt or ''}".encode()


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes) -> bytes:
    """``H(parent ‖ extra ‖ tokens)``: one link of the chain (``parent`` is ``b""`` for the first block)."""
    digest = hashlib.blake2b(digest_size=HASH_BYTES)
    digest.update(parent)
    digest.update(extra)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


def block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    fingerprint: str = "",
    cache_salt: str | None = None,
    parent: bytes = b"",
) -> list[bytes]:
    """Chained hashes of the *full* blocks of ``token_ids`` (a partial last block has none), continuing
    from ``parent`` (the hash of the block before ``token_ids[0]``, if any)."""
    extra = _extra_key(fingerprint, cache_salt)
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra)
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Maps block hashes to block ids over one allocator; cached blocks live in the allocator's LRU list.

    Args:
        allocator: the allocator whose blocks are shared; its ``on_evict`` is chained to forget hashes.
        block_size: tokens per block.
        fingerprint: the model fingerprint, part of every hash.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, *, fingerprint: str = "") -> None:
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.allocator, self.block_size, self.fingerprint = allocator, block_size, fingerprint
        # One lock for both: allocate() evicts (and calls back into this cache) under the allocator's lock,
        # and lookup() increfs under this one; two locks taken in opposite orders would deadlock.
        self._lock = allocator._lock
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self._tokens_of: dict[int, tuple[int, ...]] = {}
        self.query_tokens = 0
        self.hit_tokens = 0
        self.queries = 0
        previous = allocator.on_evict

        def on_evict(block: int) -> None:
            self._forget(block)
            if previous is not None:
                previous(block)

        allocator.on_evict = on_evict

    # ------------------------------------------------------------------ registry
    def __contains__(self, block: int) -> bool:
        return block in self._hash_of

    def __len__(self) -> int:
        return len(self._hash_of)

    def hashes(self, token_ids: Sequence[int], cache_salt: str | None = None, parent: bytes = b"") -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids``, continuing from ``parent``."""
        check_type("cache_salt", cache_salt, (str, type(None)))
        check_type("parent", parent, bytes)
        return block_hashes(
            token_ids, self.block_size, fingerprint=self.fingerprint, cache_salt=cache_salt, parent=parent
        )

    def register(self, block: int, block_hash: bytes, tokens: Sequence[int]) -> bool:
        """Record that ``block`` holds the full block with this hash. False if the hash is already cached
        (another block holds the same content; this one stays private)."""
        check_type("block_hash", block_hash, bytes)
        if len(tokens) != self.block_size:
            raise ShapeError(
                f"only full blocks can be registered: got {len(tokens)} tokens, block size is {self.block_size}"
            )
        with self._lock:
            if block_hash in self._block_of or block in self._hash_of:
                return False
            self._block_of[block_hash] = block
            self._hash_of[block] = block_hash
            self._tokens_of[block] = tuple(tokens)
            self.allocator.set_cacheable(block, True)
            return True

    def _forget(self, block: int) -> None:
        with self._lock:
            block_hash = self._hash_of.pop(block, None)
            if block_hash is not None:
                del self._block_of[block_hash]
                del self._tokens_of[block]

    def forget(self, block: int) -> None:
        """Drop a block from the cache (it is freed, not cached, when its last holder lets go)."""
        with self._lock:
            self._forget(block)
            self.allocator.set_cacheable(block, False)

    # ------------------------------------------------------------------ lookup
    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The blocks of the longest cached prefix of ``token_ids``, each with one more holder (the caller
        owns those references). At most ``(len - 1) // block_size`` blocks: one token is always left."""
        token_ids = check_token_ids("token_ids", token_ids)
        check_type("cache_salt", cache_salt, (str, type(None)))
        limit = max(0, (len(token_ids) - 1) // self.block_size)
        found: list[int] = []
        with self._lock:
            for i, block_hash in enumerate(self.hashes(token_ids[: limit * self.block_size], cache_salt)):
                block = self._block_of.get(block_hash)
                expected = tuple(token_ids[i * self.block_size : (i + 1) * self.block_size])
                if block is None or self._tokens_of[block] != expected:
                    break
                found.append(block)
            for block in found:
                self.allocator.incref(block)  # revives cached blocks in O(1)
            self.queries += 1
            self.query_tokens += len(token_ids)
            self.hit_tokens += len(found) * self.block_size
        return found

    def uncount_hits(self, tokens: int) -> None:
        """Take back hit tokens a caller looked up but did not use (hits count only reused tokens)."""
        with self._lock:
            self.hit_tokens -= tokens

    def stats(self) -> dict[str, float]:
        with self._lock:
            return {
                "prefix_queries": self.queries,
                "prefix_query_tokens": self.query_tokens,
                "prefix_hit_tokens": self.hit_tokens,
                "prefix_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
                "prefix_cached_blocks": len(self._hash_of),
            }
