"""SequenceCache: one sequence's logical view of the pool — a block table, its tokens, copy-on-write.

The physical slot of logical token *i* is ``table[i // T] * T + i % T``. Appending fills the tail block
before allocating a new one. A sequence may share blocks with others (after ``fork()`` or a prefix-cache
hit); a shared block is never written in place: the first write into a shared (or prefix-cached),
partly filled tail block copies it to a private block first (copy-on-write).

The model writes one layer at a time: the first layer to see new tokens reserves their slots (allocating and
copying as needed), the other layers write into the same slots. ``layer_tokens[l]`` is how many tokens layer
*l* holds; ``num_tokens`` is how many are reserved.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence

import torch

from memos_ref.errors import ConfigError, ShapeError
from memos_ref.paged.allocator import BlockAllocator
from memos_ref.paged.pool import BlockPool
from memos_ref.paged.prefix import PrefixCache

__all__ = ["UNKNOWN_TOKEN", "SequenceCache"]

#: Token id recorded for positions whose ids were not given (such blocks are never prefix-cached).
UNKNOWN_TOKEN = -1
_ids = itertools.count()


class SequenceCache:
    """A sequence's block table over a shared pool and allocator.

    Args:
        pool: the KV memory.
        allocator: block bookkeeping for ``pool``.
        prefix_cache: when given, full blocks with known token ids are registered for reuse.
        cache_salt: per-tenant salt mixed into prefix hashes.
    """

    def __init__(
        self,
        pool: BlockPool,
        allocator: BlockAllocator,
        prefix_cache: PrefixCache | None = None,
        *,
        cache_salt: str | None = None,
        registry: dict[int, SequenceCache] | None = None,
    ) -> None:
        self.pool, self.allocator, self.prefix_cache, self.cache_salt = pool, allocator, prefix_cache, cache_salt
        self.registry = registry
        self.seq_id = next(_ids)
        self.block_size = pool.spec.block_size
        self.block_table: list[int] = []
        self.token_ids: list[int] = []  # one per reserved position (UNKNOWN_TOKEN where not given)
        self.num_tokens = 0
        self.layer_tokens = [0] * pool.spec.num_layers
        self.num_registered = 0  # leading full blocks already offered to the prefix cache
        self._chain: list[bytes] = []  # their chained hashes
        self.cow_copies = 0
        self._lock = threading.RLock()
        self._freed = False
        if registry is not None:
            registry[self.seq_id] = self

    # ------------------------------------------------------------------ slots
    def slot(self, position: int) -> int:
        return self.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, start: int, stop: int) -> torch.Tensor:
        """Physical slots ``[stop - start]`` of logical positions ``start..stop-1``."""
        t, table = self.block_size, self.block_table
        return torch.tensor([table[p // t] * t + p % t for p in range(start, stop)], dtype=torch.long)

    def block_table_tensor(self) -> torch.Tensor:
        return torch.tensor(self.block_table, dtype=torch.long)

    @property
    def caught_up(self) -> bool:
        """Every layer holds every reserved token (between model steps)."""
        return all(n == self.num_tokens for n in self.layer_tokens)

    def _check_live(self) -> None:
        if self._freed:
            raise ConfigError(f"sequence {self.seq_id} was freed; create a new one")

    # ------------------------------------------------------------------ growth
    def _tail_needs_copy(self) -> bool:
        if self.num_tokens % self.block_size == 0 or not self.block_table:
            return False  # the next token starts a new block
        tail = self.block_table[-1]
        shared = self.allocator.refcount[tail] > 1
        cached = self.prefix_cache is not None and tail in self.prefix_cache
        return shared or cached

    def blocks_needed(self, n: int) -> int:
        """Blocks that reserving ``n`` more tokens would allocate (new blocks plus a copy-on-write)."""
        if n <= 0:
            return 0
        new_blocks = -(-(self.num_tokens + n) // self.block_size) - len(self.block_table)
        return new_blocks + int(self._tail_needs_copy())

    def reserve(self, n: int, token_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Reserve slots for ``n`` new tokens (copy-on-write of a shared tail, then new blocks — all or
        nothing); returns their slots ``[n]``."""
        self._check_live()
        if n < 0:
            raise ConfigError(f"cannot reserve {n} tokens")
        if token_ids is not None and len(token_ids) != n:
            raise ShapeError(f"{n} tokens reserved but {len(token_ids)} token ids given")
        with self._lock:
            copy_tail = self._tail_needs_copy() and n > 0
            new_blocks = -(-(self.num_tokens + n) // self.block_size) - len(self.block_table)
            fresh = self.allocator.allocate(new_blocks + int(copy_tail))  # raises before any change
            if copy_tail:
                private, old = fresh.pop(), self.block_table[-1]
                try:
                    self.pool.copy_block(old, private)
                except BaseException:  # e.g. a quantized pool without a free staging block: give everything back
                    self.allocator.free_many([*fresh, private])
                    raise
                self.block_table[-1] = private
                self.allocator.free(old)
                self.cow_copies += 1
            self.block_table.extend(fresh)
            start = self.num_tokens
            self.num_tokens += n
            self.token_ids.extend(token_ids if token_ids is not None else [UNKNOWN_TOKEN] * n)
            return self.slot_mapping(start, self.num_tokens)

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor, token_ids: Sequence[int] | None = None):
        """Write ``n`` tokens' K/V ``[H, n, D]`` of one layer. The first layer to get past ``num_tokens``
        reserves the slots; the others reuse them. Returns the slots written."""
        self._check_live()
        if key.ndim != 3 or key.shape != value.shape:
            raise ShapeError(
                f"key/value must be [kv_heads, tokens, head_dim], got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        if not 0 <= layer < len(self.layer_tokens):
            raise ConfigError(f"layer {layer} is not in [0, {len(self.layer_tokens)})")
        n = key.shape[1]
        self.pool.check_kv(key.transpose(0, 1), value.transpose(0, 1))  # before anything is reserved
        with self._lock:
            start = self.layer_tokens[layer]
            beyond = start + n - self.num_tokens
            if beyond > 0 and beyond != n:
                raise ConfigError(
                    f"layer {layer} holds {start} tokens and gets {n}, but {self.num_tokens} are reserved: layers "
                    f"must write the same tokens in order"
                )
            if beyond > 0:
                slots = self.reserve(n, token_ids)
            else:
                slots = self.slot_mapping(start, start + n)
            self.pool.write(layer, slots, key.transpose(0, 1), value.transpose(0, 1))
            self.layer_tokens[layer] = start + n
            if self.caught_up:
                self._after_all_layers()
            return slots

    def mark_written(self) -> None:
        """Declare every reserved token written in every layer (when the K/V are written elsewhere — a kernel,
        or no tensors at all in a metadata-only simulation); registers full blocks for prefix reuse."""
        with self._lock:
            self.layer_tokens = [self.num_tokens] * len(self.layer_tokens)
            self._after_all_layers()

    def _after_all_layers(self) -> None:
        """Every layer holds every reserved token: register full blocks for prefix reuse, and let a quantized
        pool seal the blocks that left the full-precision residual window."""
        if self.prefix_cache is not None:
            self._register_full_blocks()
        seal = getattr(self.pool, "after_append", None)
        if seal is not None:
            seal(self.block_table, self.num_tokens)

    def set_token_ids(self, token_ids: Sequence[int], start: int = 0) -> None:
        """Record the token ids of positions ``start..`` after the fact (e.g. after ``generate``), so full
        blocks can be prefix-cached."""
        if start + len(token_ids) > self.num_tokens:
            raise ShapeError(f"{len(token_ids)} ids from {start} exceed the {self.num_tokens} tokens held")
        with self._lock:
            self.token_ids[start : start + len(token_ids)] = list(token_ids)
            if self.prefix_cache is not None and self.caught_up:
                self._register_full_blocks()

    def _register_full_blocks(self) -> None:
        full = self.num_tokens // self.block_size
        if full <= self.num_registered:
            return
        known = full
        if UNKNOWN_TOKEN in self.token_ids[: full * self.block_size]:
            known = self.token_ids.index(UNKNOWN_TOKEN) // self.block_size
        if known <= self.num_registered:
            return
        # extend the hash chain from the last registered block (each block is hashed once)
        del self._chain[self.num_registered :]
        parent = self._chain[-1] if self._chain else b""
        start, stop = self.num_registered * self.block_size, known * self.block_size
        self._chain.extend(self.prefix_cache.hashes(self.token_ids[start:stop], self.cache_salt, parent))
        for i in range(self.num_registered, known):
            tokens = self.token_ids[i * self.block_size : (i + 1) * self.block_size]
            self.prefix_cache.register(self.block_table[i], self._chain[i], tokens)
        self.num_registered = known

    # ------------------------------------------------------------------ sharing and rollback
    def adopt_prefix(self, blocks: Sequence[int], token_ids: Sequence[int]) -> None:
        """Start an empty sequence from prefix-cache blocks (already incref'd by the lookup)."""
        self._check_live()
        if self.num_tokens:
            raise ConfigError("a prefix can only be adopted by an empty sequence")
        n = len(blocks) * self.block_size
        if len(token_ids) < n:
            raise ShapeError(f"{len(blocks)} blocks need {n} token ids, got {len(token_ids)}")
        self.block_table = list(blocks)
        self.token_ids = list(token_ids[:n])
        self.num_tokens = n
        self.layer_tokens = [n] * len(self.layer_tokens)
        self.num_registered = len(blocks)
        if self.prefix_cache is not None:
            self._chain = self.prefix_cache.hashes(self.token_ids, self.cache_salt)

    def fork(self) -> SequenceCache:
        """A new sequence sharing every block (refcounts +1); the first write to a shared tail copies it."""
        self._check_live()
        with self._lock:
            if not self.caught_up:
                raise ConfigError("cannot fork in the middle of a model step (layers hold different lengths)")
            child = SequenceCache(
                self.pool, self.allocator, self.prefix_cache, cache_salt=self.cache_salt, registry=self.registry
            )
            for block in self.block_table:
                self.allocator.incref(block)
            child.block_table = list(self.block_table)
            child.token_ids = list(self.token_ids)
            child.num_tokens = self.num_tokens
            child.layer_tokens = list(self.layer_tokens)
            child.num_registered = self.num_registered
            child._chain = list(self._chain)
            return child

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (speculative decoding rollback, undo); blocks past them are freed."""
        self._check_live()
        with self._lock:
            if not 0 <= n <= self.num_tokens:
                raise ConfigError(f"cannot truncate to {n} tokens: the sequence holds {self.num_tokens}")
            if not self.caught_up:
                raise ConfigError("cannot truncate in the middle of a model step")
            keep = -(-n // self.block_size)
            dropped = self.block_table[keep:]
            self._seal_full(dropped, first_index=keep)
            self.allocator.free_many(dropped)
            del self.block_table[keep:]
            del self.token_ids[n:]
            self.num_tokens = n
            self.layer_tokens = [n] * len(self.layer_tokens)
            self.num_registered = min(self.num_registered, n // self.block_size)
            del self._chain[self.num_registered :]

    def free(self) -> None:
        """Release every block; the sequence cannot be used afterwards."""
        with self._lock:
            if self._freed:
                return
            self._seal_full(self.block_table, first_index=0)
            self.allocator.free_many(self.block_table)
            self.block_table = []
            self.num_tokens = 0
            self._freed = True
            if self.registry is not None:
                self.registry.pop(self.seq_id, None)

    def _seal_full(self, blocks: Sequence[int], first_index: int) -> None:
        """A quantized pool keeps recent blocks at full precision in a small staging slab; a full block leaving
        this sequence may live on in the prefix cache, where no residual window applies: seal it so it does not
        hold a staging slot indefinitely (partial blocks are freed, which returns their slots)."""
        seal = getattr(self.pool, "seal", None)
        if seal is None or not self.caught_up:
            return
        full = self.num_tokens // self.block_size
        seal([b for i, b in enumerate(blocks, start=first_index) if i < full])

    # ------------------------------------------------------------------ checks
    def to_dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This sequence's K and V of one layer as dense ``[H, S, D]`` tensors (a copy, for checks)."""
        n = self.layer_tokens[layer]
        return self.pool.gather(layer, self.block_table_tensor(), n)

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def __repr__(self) -> str:
        return f"SequenceCache(id={self.seq_id}, tokens={self.num_tokens}, blocks={self.block_table})"
