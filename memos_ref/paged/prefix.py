"""PrefixCache: content-addressed full blocks, so prompts that share a prefix share its KV blocks.

Block *i* of a sequence gets the chained hash ``h_i = H(h_{i-1} ‖ extra_key ‖ token_ids of block i)``
(BLAKE2b, 128 bits). Chaining makes a block's identity depend on everything before it: the same tokens at
another position have different keys (RoPE), and hash equality means prefix equality. ``extra_key`` carries
the model fingerprint and an optional per-tenant ``cache_salt`` so tenants never share or probe each other's
blocks. A hit also compares the stored token ids, so a hash collision cannot return wrong KV.

Lookups return the longest cached prefix in whole blocks, but never the whole prompt: at least one token is
always left to compute (nano-vllm issue 144: a full hit gave the model zero query tokens). Hits are counted
only in tokens actually reused. A lookup's hashes travel with the sequence that adopts its blocks
(:class:`PrefixHit`), so a prompt's blocks are hashed once.

The hash -> block index itself (with the token ids a hit is verified against) is owned by the
:class:`~memos_ref.paged.allocator.BlockAllocator`, which drops a hash in the same step that evicts its block;
:class:`PrefixCache` is the hashing and hit-statistics front end over it.
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections.abc import Iterator, Sequence

import torch

from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, ShapeError, check_index, check_type
from memos_ref.paged.allocator import BlockAllocator

__all__ = [
    "UNKNOWN_TOKEN",
    "PrefixCache",
    "PrefixHit",
    "block_hashes",
    "check_token_ids",
    "hash_block",
    "hash_packed_block",
    "iter_block_hashes",
    "iter_packed_hashes",
    "pack_token_ids",
]

HASH_BYTES = 16  # 128-bit BLAKE2b digests
#: Token id recorded for positions whose ids were not given (such blocks are never prefix-cached).
UNKNOWN_TOKEN = -1
#: Largest token id: ids are hashed as signed 64-bit integers.
MAX_TOKEN_ID = 2**63 - 1
_INT_ONLY = frozenset({int})


def check_token_ids(name: str, token_ids: object) -> list[int]:
    """Token ids as a list of ints, each in ``[UNKNOWN_TOKEN, MAX_TOKEN_ID]`` (-1 = unknown; ids are hashed as
    signed 64-bit ints); a string, a float or a tensor of floats is refused with :class:`ArgumentTypeError`, an
    id out of that range with :class:`InvalidArgumentError`."""
    if type(token_ids) is not list:  # a list (the common case) skips the type checks below
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dtype.is_floating_point or token_ids.dtype.is_complex or token_ids.dtype == torch.bool:
                raise ArgumentTypeError(f"{name}: expected integer token ids, got a tensor of {token_ids.dtype}")
            token_ids = token_ids.reshape(-1).tolist()
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise ArgumentTypeError(
                f"{name}: expected a sequence of int token ids, got {type(token_ids).__name__} ({token_ids!r:.80})"
            )
    out = list(token_ids)
    if not set(map(type, out)) <= _INT_ONLY:  # plain ints checked in C; others (numpy ints) are converted
        out = [check_index(f"{name}[{i}]", t, lo=UNKNOWN_TOKEN, hi=MAX_TOKEN_ID) for i, t in enumerate(out)]
    elif out and (min(out) < UNKNOWN_TOKEN or max(out) > MAX_TOKEN_ID):
        bad = min(out) if min(out) < UNKNOWN_TOKEN else max(out)
        raise InvalidArgumentError(
            f"{name}: token ids must lie in [0, 2**63) (or be {UNKNOWN_TOKEN} = unknown), got {bad}"
        )
    return out


def pack_token_ids(name: str, token_ids: object) -> tuple[list[int], bytes]:
    """:func:`check_token_ids` and the ids packed as int64 bytes (what block hashes hash) in one step: a list of
    plain ints is checked by its one type pass, the packing (which refuses any id above ``MAX_TOKEN_ID``) and one
    vectorised minimum over the packed ids, instead of three passes and a second packing for the hashes."""
    if type(token_ids) is list and token_ids and set(map(type, token_ids)) <= _INT_ONLY:
        try:
            packed = array("q", token_ids)
        except OverflowError:
            packed = None
        if packed is not None and _min_packed(packed, token_ids) >= UNKNOWN_TOKEN:
            return list(token_ids), packed.tobytes()
    out = check_token_ids(name, token_ids)  # the general path, and the precise error for a bad id
    return out, array("q", out).tobytes()


def _min_packed(packed: array, ids: list[int]) -> int:
    """The smallest id (over the packed int64s in one vectorised call for a long prompt)."""
    if len(ids) < 512:
        return min(ids)
    return int(torch.frombuffer(packed, dtype=torch.int64).min())


def _extra_key(fingerprint: str, cache_salt: str | None) -> bytes:
    return f"{fingerprint}\x00{cache_salt or ''}".encode()


def hash_block(parent: bytes, tokens: Sequence[int], extra: bytes) -> bytes:
    """``H(parent ‖ extra ‖ tokens)``: one link of the chain (``parent`` is ``b""`` for the first block)."""
    return hash_packed_block(parent, array("q", tokens).tobytes(), extra)


def hash_packed_block(parent: bytes, packed: bytes, extra: bytes) -> bytes:
    """:func:`hash_block` of token ids already packed as int64 bytes (``array("q", tokens).tobytes()``)."""
    return hashlib.blake2b(parent + extra + packed, digest_size=HASH_BYTES).digest()


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
    return list(iter_block_hashes(token_ids, block_size, extra, parent))


def iter_block_hashes(token_ids: Sequence[int], block_size: int, extra: bytes, parent: bytes = b"") -> Iterator[bytes]:
    """Lazily, the chained hashes of the full blocks of ``token_ids`` (``extra``: the fingerprint and salt key)."""
    full = len(token_ids) // block_size
    if not full:
        return
    # every full block packed in one pass; each block hashes a slice of it (no per-block list and array)
    yield from iter_packed_hashes(array("q", token_ids[: full * block_size]).tobytes(), block_size, extra, parent)


def iter_packed_hashes(
    packed: bytes, block_size: int, extra: bytes, parent: bytes = b"", blocks: int | None = None
) -> Iterator[bytes]:
    """:func:`iter_block_hashes` of token ids already packed as int64 bytes: the chained hashes of the first
    ``blocks`` full blocks (all of them by default). The same bytes as hashing the ids block by block."""
    blake2b, width = hashlib.blake2b, 8 * block_size
    full = len(packed) // width if blocks is None else min(blocks, len(packed) // width)
    for start in range(0, full * width, width):
        parent = blake2b(parent + extra + packed[start : start + width], digest_size=HASH_BYTES).digest()
        yield parent


class PrefixHit(list):
    """The block ids a :meth:`PrefixCache.lookup` found (a plain ``list`` to every caller), carrying the hash chain
    the lookup computed for the prompt's full blocks (``chain``, found or not) and the ids it hashed, so the
    sequence that adopts them hashes none of those blocks again: neither the prefix nor, when it registers them,
    the blocks after it."""

    __slots__ = ("chain", "extra", "token_ids")

    def __init__(self, blocks: list[int], chain: list[bytes], extra: bytes, token_ids: list[int]) -> None:
        super().__init__(blocks)
        self.chain, self.extra, self.token_ids = chain, extra, token_ids  # token_ids: the lookup's (checked) ids


class PrefixCache:
    """Prefix hashing and hit statistics over one allocator's hash index (cached blocks live in its LRU list).

    Args:
        allocator: the allocator whose blocks are shared; it owns the hash -> block index.
        block_size: tokens per block.
        fingerprint: the model fingerprint, part of every hash.
    """

    def __init__(self, allocator: BlockAllocator, block_size: int, *, fingerprint: str = "") -> None:
        check_type("allocator", allocator, BlockAllocator)
        if block_size <= 0:
            raise ConfigError(f"block_size must be positive, got {block_size}")
        self.allocator, self.block_size, self.fingerprint = allocator, block_size, fingerprint
        self._stats_lock = threading.Lock()
        self.query_tokens = 0
        self.hit_tokens = 0
        self.queries = 0

    # ------------------------------------------------------------------ registry
    def __contains__(self, block: object) -> bool:
        return (
            type(block) is int and 0 <= block < self.allocator.num_blocks and self.allocator.hash_of(block) is not None
        )

    def __len__(self) -> int:
        return self.allocator.num_indexed

    @property
    def _block_of(self) -> dict[bytes, int]:
        """Compatibility view for old tests: hash -> block (a copy)."""
        return {h: b for b, h in self.allocator.indexed_blocks().items()}

    @property
    def _hash_of(self) -> dict[int, bytes]:
        """Compatibility view for old tests: block -> hash (a copy)."""
        return self.allocator.indexed_blocks()

    def extra_key(self, cache_salt: str | None = None) -> bytes:
        """The fingerprint and salt bytes mixed into every hash of this cache."""
        return _extra_key(self.fingerprint, cache_salt)

    def hashes(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None = None,
        parent: bytes = b"",
        *,
        packed: bytes | None = None,
        blocks: int | None = None,
    ) -> list[bytes]:
        """Chained hashes of the full blocks of ``token_ids``, continuing from ``parent``. ``packed``: the ids
        already packed as int64 bytes (hashed as they are; ``blocks``: only the first so many full blocks)."""
        check_type("cache_salt", cache_salt, (str, type(None)))
        check_type("parent", parent, bytes)
        if packed is not None:
            check_type("packed", packed, bytes)
            extra = _extra_key(self.fingerprint, cache_salt)
            return list(iter_packed_hashes(packed, self.block_size, extra, parent, blocks))
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
        return self.allocator.cache_block(block, block_hash, tokens)

    def forget(self, block: int) -> None:
        """Drop a block from the cache (it is freed, not cached, when its last holder lets go)."""
        self.allocator.uncache(block)

    # ------------------------------------------------------------------ lookup
    def lookup(self, token_ids: Sequence[int], cache_salt: str | None = None, *, count: bool = True) -> list[int]:
        """The blocks of the longest cached prefix of ``token_ids``, each with one more holder (the caller
        owns those references). At most ``(len - 1) // block_size`` blocks: one token is always left. The
        returned list carries the prompt's block hashes (:class:`PrefixHit`). ``count=False`` keeps the lookup
        out of the hit statistics (a prefetch is not a request)."""
        return self.lookup_checked(check_token_ids("token_ids", token_ids), cache_salt, count=count)

    def lookup_checked(
        self, token_ids: list[int], cache_salt: str | None = None, *, count: bool = True, packed: bytes | None = None
    ) -> PrefixHit:
        """:meth:`lookup` of ids already validated by :func:`check_token_ids` (the caller's guarantee: a prompt is
        validated once, where it enters, and carried inward). The returned hit keeps ``token_ids`` itself.
        ``packed``: the ids packed as int64 bytes (:func:`pack_token_ids`), hashed and verified without packing
        them again."""
        check_type("cache_salt", cache_salt, (str, type(None)))
        t = self.block_size
        limit = max(0, (len(token_ids) - 1) // t)
        if packed is None or len(packed) != 8 * len(token_ids):
            packed = array("q", token_ids[: limit * t]).tobytes()
        # every full block, once (vLLM: at arrival)
        chain = self.hashes(token_ids, cache_salt, packed=packed, blocks=limit)
        extra = _extra_key(self.fingerprint, cache_salt)
        blocks = self.allocator.match_prefix(chain, token_ids, t, packed=packed)
        found = PrefixHit(blocks, chain, extra, token_ids)
        if count:
            with self._stats_lock:
                self.queries += 1
                self.query_tokens += len(token_ids)
                self.hit_tokens += len(found) * t
        return found

    def uncount_hits(self, tokens: int) -> None:
        """Take back hit tokens a caller looked up but did not use (hits count only reused tokens)."""
        with self._stats_lock:
            self.hit_tokens -= tokens

    def stats(self) -> dict[str, float]:
        with self._stats_lock:
            return {
                "prefix_queries": self.queries,
                "prefix_query_tokens": self.query_tokens,
                "prefix_hit_tokens": self.hit_tokens,
                "prefix_hit_rate": self.hit_tokens / self.query_tokens if self.query_tokens else 0.0,
                "prefix_cached_blocks": len(self),
            }
