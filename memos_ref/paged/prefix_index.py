"""The prefix-hash index: ``hash -> block``, and per indexed block its hash and its token ids for verification.

A block's token ids are kept packed (signed 64-bit, the bytes its hash covers, :func:`pack_ids`): a lookup
verifies a block with one ``bytes`` comparison, so a hash collision never returns another prompt's KV.

Bookkeeping only: the index never reads or changes block state. Its owner,
:class:`~memos_ref.paged.allocator.BlockAllocator`, decides when a block enters it (held and written) and drops a
block's hash in the same step that evicts the block, so the index and the free lists can never disagree;
:class:`~memos_ref.paged.prefix.PrefixCache` is the hashing and statistics front end over both.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence

from memos_ref.errors import ArgumentTypeError, InvalidArgumentError

__all__ = ["PrefixIndex", "pack_checked", "pack_ids"]


class PrefixIndex:
    """``hash -> block`` with each indexed block's hash and packed token ids.

    Attributes (read-only outside; the same dicts for the index's life):
        by_hash: hash -> block.
        hash_by_block: block -> the hash it is indexed under.
        tokens_by_block: block -> its token ids packed as int64 bytes.
    """

    __slots__ = ("by_hash", "hash_by_block", "tokens_by_block")

    def __init__(self) -> None:
        self.by_hash: dict[bytes, int] = {}
        self.hash_by_block: dict[int, bytes] = {}
        self.tokens_by_block: dict[int, bytes] = {}

    def __len__(self) -> int:
        return len(self.by_hash)

    def add(self, block: int, block_hash: bytes, packed: bytes) -> bool:
        """Index ``block`` under ``block_hash`` with its packed token ids. False (nothing changed) when the hash is
        already indexed (another block holds that content) or the block already has a hash."""
        if block_hash in self.by_hash or block in self.hash_by_block:
            return False
        self.by_hash[block_hash] = block
        self.hash_by_block[block] = block_hash
        self.tokens_by_block[block] = packed
        return True

    def add_run(self, blocks: Sequence[int], hashes: Sequence[bytes], packed: bytes, width: int) -> list[int]:
        """:meth:`add` of ``blocks[i]`` under ``hashes[i]`` with ``packed[i*width : (i+1)*width]``, in order;
        returns the blocks newly indexed."""
        by_hash, hash_by_block, tokens_by_block = self.by_hash, self.hash_by_block, self.tokens_by_block
        stored = []
        for i, (block, block_hash) in enumerate(zip(blocks, hashes)):
            if block_hash in by_hash or block in hash_by_block:
                continue
            by_hash[block_hash] = block
            hash_by_block[block] = block_hash
            tokens_by_block[block] = packed[i * width : (i + 1) * width]
            stored.append(block)
        return stored

    def drop(self, block: int) -> bytes | None:
        """Take ``block`` out of the index; returns the hash it had (None: it had none)."""
        block_hash = self.hash_by_block.pop(block, None)
        if block_hash is not None:
            del self.tokens_by_block[block]
            if self.by_hash.get(block_hash) == block:
                del self.by_hash[block_hash]
        return block_hash

    def block_with_hash(self, block_hash: bytes) -> int | None:
        """The block indexed under ``block_hash``, or None."""
        return self.by_hash.get(block_hash)

    def verified(self, block_hash: bytes, tokens: Sequence[int]) -> int | None:
        """The block indexed under ``block_hash`` whose token ids equal ``tokens``, or None."""
        block = self.by_hash.get(block_hash)
        if block is None or self.tokens_by_block.get(block) != pack_ids(tokens):
            return None
        return block

    def match(
        self,
        hashes: Iterable[bytes],
        token_ids: Sequence[int],
        block_size: int,
        start: int,
        packed: bytes | None,
    ) -> list[int]:
        """Longest run of indexed blocks continuing a prefix: block ``start + i`` indexed under ``hashes[i]`` with
        ``token_ids[(start+i)*block_size : ...]`` as its tokens (verified against ``packed``, the ids as int64
        bytes, when given). ``hashes`` is consumed only up to the first miss."""
        found: list[int] = []
        width = 8 * block_size
        by_hash, tokens_of = self.by_hash, self.tokens_by_block
        position = start * block_size
        for block_hash in hashes:
            block = by_hash.get(block_hash)
            if block is None:
                break
            # verify the token ids: a hash collision must not return wrong KV
            if packed is not None:
                held = packed[position * 8 : position * 8 + width]
            else:
                held = pack_ids(token_ids[position : position + block_size])
            if tokens_of[block] != held:
                break
            found.append(block)
            position += block_size
        return found


def pack_ids(tokens: Sequence[int]) -> bytes | None:
    """Token ids packed as signed 64-bit ints (the bytes a block hash covers), or None when they cannot be (a
    non-integer, an id outside int64, a ``str``/``bytes``): such ids match no indexed block."""
    if isinstance(tokens, (str, bytes, bytearray, memoryview)):
        return None
    try:
        return array("q", tokens).tobytes()
    except (TypeError, OverflowError):
        return None


def pack_checked(name: str, tokens: Sequence[int]) -> bytes:
    """:func:`pack_ids`, refusing ids it cannot pack: :class:`ArgumentTypeError` for a non-integer,
    :class:`InvalidArgumentError` for an id outside int64."""
    packed = pack_ids(tokens)
    if packed is None:
        if isinstance(tokens, (str, bytes, bytearray, memoryview)):
            raise ArgumentTypeError(f"{name}: expected a sequence of int token ids, got {type(tokens).__name__}")
        bad = next((t for t in tokens if not hasattr(t, "__index__")), None)
        if bad is not None:
            raise ArgumentTypeError(f"{name}: expected int token ids, got {type(bad).__name__} ({bad!r:.40})")
        raise InvalidArgumentError(f"{name}: token ids must fit a signed 64-bit int")
    return packed
