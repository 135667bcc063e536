"""SequenceCache: one sequence's logical view of the pool — a block table, its tokens, copy-on-write.

The physical slot of logical token *i* is ``table[i // T] * T + i % T``. Appending fills the tail block
before allocating a new one. A sequence may share blocks with others (after ``fork()`` or a prefix-cache
hit); a shared block is never written in place: the first write into a shared (or prefix-cached),
partly filled tail block copies it to a private block first (copy-on-write).

The model writes one layer at a time: the first layer to see new tokens reserves their slots (allocating and
copying as needed), the other layers write into the same slots. ``layer_tokens[l]`` is how many tokens layer
*l* holds; ``num_tokens`` is how many are reserved.

Over a quantized pool with a full-precision residual window, a sequence tells the pool which of its blocks lie
inside its window (``pool.hold``/``pool.unhold``, blocks ``block_table[window_start:]``): a shared block is
sealed only when it lies outside the window of every live sequence holding it.

Every argument is validated before anything changes (:class:`ArgumentTypeError`,
:class:`InvalidArgumentError`, :class:`ShapeError`); a freed sequence raises :class:`UseAfterFreeError`.
"""

from __future__ import annotations

import itertools
import threading
from array import array
from collections.abc import Sequence

import torch

from memos_ref.errors import (
    ArgumentTypeError,
    ConfigError,
    InvalidArgumentError,
    InvalidBlockError,
    KVCacheError,
    OutOfBlocksError,
    ShapeError,
    StagingFullError,
    StateError,
    UseAfterFreeError,
    check_index,
    check_layer_index,
    check_type,
)
from memos_ref.paged.allocator import BlockAllocator, BlockState
from memos_ref.paged.pool import BlockPool
from memos_ref.paged.prefix import (
    MAX_TOKEN_ID,
    UNKNOWN_TOKEN,
    PrefixCache,
    PrefixHit,
    check_token_ids,
    hash_packed_block,
    iter_block_hashes,
    iter_packed_hashes,
    pack_token_ids,
)

__all__ = ["UNKNOWN_TOKEN", "SequenceCache", "check_token_ids"]

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
        check_type("cache_salt", cache_salt, (str, type(None)))
        check_type("allocator", allocator, BlockAllocator)
        check_type("prefix_cache", prefix_cache, (PrefixCache, type(None)))
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
        # (hashes, token ids) of the prompt a prefix lookup hashed: reused when the blocks after the adopted
        # prefix are registered, as long as this sequence's tokens are the ones hashed
        self._lookahead: tuple[list[bytes], list[int]] | None = None
        self.cow_copies = 0
        # a quantized pool with a residual window: blocks block_table[window_start:] are held in the pool's
        # window_holds (this sequence reads them at full precision)
        self._windows = bool(getattr(pool, "tracks_windows", False))
        self.window_start = 0
        self._lock = threading.RLock()
        self._freed = False
        # append_token's inline case reads these: live and no window to track; the allocator's refcounts and
        # index (the same objects for the allocator's life: grow() extends them in place)
        self._plain = not self._windows
        self._refcount, self._indexed = allocator.refcount, allocator.hash_by_block
        if registry is not None:
            registry[self.seq_id] = self

    # ------------------------------------------------------------------ slots
    def slot(self, position: int) -> int:
        """The physical slot of logical position ``position`` (in ``[0, num_tokens)``)."""
        self._check_live()
        position = check_index("position", position, lo=0, hi=self.num_tokens - 1)
        return self.block_table[position // self.block_size] * self.block_size + position % self.block_size

    def slot_mapping(self, start: int, stop: int) -> torch.Tensor:
        """Physical slots ``[stop - start]`` of logical positions ``start..stop-1`` (within ``num_tokens``)."""
        self._check_live()
        start = check_index("start", start, lo=0, hi=self.num_tokens)
        stop = check_index("stop", stop, lo=start, hi=self.num_tokens)
        return self._slots(start, stop)

    def _slots(self, start: int, stop: int) -> torch.Tensor:
        return torch.tensor(self._slot_list(start, stop), dtype=torch.long)

    def _slot_list(self, start: int, stop: int) -> list[int]:
        t, table = self.block_size, self.block_table
        return [table[p // t] * t + p % t for p in range(start, stop)]

    def slot_list(self, start: int, stop: int) -> list[int]:
        """:meth:`slot_mapping` as a Python list (for callers that build one tensor for many rows)."""
        self._check_live()
        start = check_index("start", start, lo=0, hi=self.num_tokens)
        stop = check_index("stop", stop, lo=start, hi=self.num_tokens)
        return self._slot_list(start, stop)

    def block_table_tensor(self) -> torch.Tensor:
        return torch.tensor(self.block_table, dtype=torch.long)

    @property
    def caught_up(self) -> bool:
        """Every layer holds every reserved token (between model steps)."""
        return all(n == self.num_tokens for n in self.layer_tokens)

    @property
    def freed(self) -> bool:
        return self._freed

    def _check_live(self) -> None:
        if self._freed:
            raise UseAfterFreeError(f"sequence {self.seq_id} was freed; create a new one (or fork() it before freeing)")

    # ------------------------------------------------------------------ residual windows (quantized pools)
    def _window_for(self, num_tokens: int) -> int:
        """Index of the first block inside the residual window of a sequence of ``num_tokens`` tokens."""
        residual = self.pool.residual_tokens  # type: ignore[attr-defined]
        return min(len(self.block_table), max(0, num_tokens - residual) // self.block_size)

    def _hold(self, blocks: list[int]) -> None:
        if self._windows:
            self.pool.hold(blocks)  # type: ignore[attr-defined]

    def _unhold(self, blocks: list[int]) -> None:
        if self._windows:
            self.pool.unhold(blocks)  # type: ignore[attr-defined]

    def _seal_behind_window(self) -> None:
        """Move the window to the current length (every layer holds every token) and seal the blocks behind it
        that no other live sequence holds inside its own window."""
        if not self._windows:
            return
        start = self._window_for(self.num_tokens)
        if start > self.window_start:
            self._unhold(self.block_table[self.window_start : start])
            self.window_start = start
        self.pool.seal_unheld(self.block_table[: self.window_start])  # type: ignore[attr-defined]

    def staging_needed(self, n: int) -> int:
        """Full-precision staging blocks that appending ``n`` tokens needs from a quantized pool (0 for other
        pools): one per new block, plus one for a partly filled tail that must be copied or re-staged."""
        self._check_live()
        n = check_index("n", n, lo=0)
        if not self._windows or n == 0:
            return 0
        new_blocks = -(-(self.num_tokens + n) // self.block_size) - len(self.block_table)
        tail = 0
        if self.num_tokens % self.block_size and self.block_table:
            sealed = int(self.pool.staging_slot[self.block_table[-1]]) < 0  # type: ignore[attr-defined]
            tail = int(self._tail_needs_copy() or sealed)
        return new_blocks + tail

    def seal_idle(self) -> int:
        """Age a sequence that has gone quiet (seed 001's "untouched for a while"): seal every *full* block,
        its residual window included — except blocks another live sequence holds inside its own window; the
        partial last block stays staged. Returns how many blocks were sealed."""
        self._check_live()
        if not self._windows or not self.caught_up:
            return 0
        with self._lock:
            full = self.num_tokens // self.block_size
            own = self.block_table[self.window_start : full]
            self._unhold(own)
            try:
                return self.pool.seal_unheld(self.block_table[:full])  # type: ignore[attr-defined]
            finally:
                self._hold(own)

    # ------------------------------------------------------------------ growth
    def _tail_needs_copy(self) -> bool:
        if self.num_tokens % self.block_size == 0 or not self.block_table:
            return False  # the next token starts a new block
        tail = self.block_table[-1]
        # shared, or in the prefix index (a registered full block made a partial tail again by truncate)
        return self.allocator.refcount[tail] > 1 or tail in self.allocator.hash_by_block

    def blocks_needed(self, n: int) -> int:
        """Blocks that reserving ``n`` more tokens would allocate (new blocks plus a copy-on-write)."""
        self._check_live()
        n = check_index("n", n, lo=0)
        if n == 0:
            return 0
        new_blocks = -(-(self.num_tokens + n) // self.block_size) - len(self.block_table)
        return new_blocks + int(self._tail_needs_copy())

    def reserve(self, n: int, token_ids: Sequence[int] | None = None) -> torch.Tensor:
        """Reserve slots for ``n`` new tokens (copy-on-write of a shared tail, then new blocks — all or
        nothing); returns their slots ``[n]``."""
        with self._lock:
            positions = self.reserve_positions(n, token_ids)
            return self._slots(positions.start, positions.stop)

    def reserve_positions(self, n: int, token_ids: Sequence[int] | None = None) -> range:
        """:meth:`reserve` without building a slot tensor: returns the new logical positions (their slots are
        ``slot_list(r.start, r.stop)``), for callers that build one slot mapping per step, and bookkeeping."""
        if self._freed:
            self._check_live()
        if type(n) is not int or n < 0:
            n = check_index("n", n, lo=0)
        if token_ids is not None and not (  # a decode step's one plain id is checked inline
            n == 1
            and type(token_ids) is list
            and len(token_ids) == 1
            and type(token_ids[0]) is int
            and UNKNOWN_TOKEN <= token_ids[0] <= MAX_TOKEN_ID
        ):
            token_ids = check_token_ids("token_ids", token_ids)
            if len(token_ids) != n:
                raise ShapeError(f"{n} tokens reserved but {len(token_ids)} token ids given")
        with self._lock:
            start, t, table = self.num_tokens, self.block_size, self.block_table
            new_blocks = -(-(start + n) // t) - len(table)
            copy_tail = False
            if start % t and n:  # a partly filled tail is copied first when shared or in the prefix index
                alloc = self.allocator
                copy_tail = alloc.refcount[table[-1]] > 1 or table[-1] in alloc.hash_by_block
            if self._windows:
                self._check_staging(n)  # a quantized pool: refuse before anything changes
            if new_blocks or copy_tail:
                self._grow(new_blocks, copy_tail)
            self.num_tokens = start + n
            self.token_ids.extend(token_ids if token_ids is not None else [UNKNOWN_TOKEN] * n)
            return range(start, start + n)

    def _grow(self, new_blocks: int, copy_tail: bool) -> None:
        """Allocate ``new_blocks`` blocks (all or nothing) and copy a shared tail to a private block first."""
        fresh = self.allocator.allocate(new_blocks + copy_tail)  # raises before any change
        if copy_tail:
            private, old = fresh.pop(), self.block_table[-1]
            try:
                self.pool.copy_block(old, private)
            except BaseException:  # give everything back
                self.allocator.free_many([*fresh, private])
                raise
            self.block_table[-1] = private
            self._hold([private])  # the tail always lies inside the window
            self._unhold([old])
            self.allocator.free(old)
            self.cow_copies += 1
        if fresh:
            self._hold(fresh)
            self.block_table.extend(fresh)

    def _check_staging(self, n: int) -> None:
        need = self.staging_needed(n)
        if need and need > self.pool.staging_available:  # type: ignore[attr-defined]
            free, total = self.pool.staging_available, self.pool.staging.shape[0]  # type: ignore[attr-defined]
            raise StagingFullError(
                f"{need} blocks need full-precision staging but {free} of {total} staging blocks are free (they "
                f"hold the residual windows of live sequences): raise staging_blocks or lower residual_tokens",
                needed=need,
                capacity=free,
            )

    def append(self, layer: int, key: torch.Tensor, value: torch.Tensor, token_ids: Sequence[int] | None = None):
        """Write ``n`` tokens' K/V ``[H, n, D]`` of one layer. The first layer to get past ``num_tokens``
        reserves the slots; the others reuse them. Returns the slots written."""
        self._check_live()
        layer = check_layer_index(layer, len(self.layer_tokens))
        check_type("key", key, torch.Tensor)
        check_type("value", value, torch.Tensor)
        if key.ndim != 3 or key.shape != value.shape:
            raise ShapeError(
                f"key/value must be [kv_heads, tokens, head_dim], got {tuple(key.shape)} and {tuple(value.shape)}"
            )
        n = key.shape[1]
        self.pool.check_kv(key.transpose(0, 1), value.transpose(0, 1), layer=layer)  # before anything is reserved
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
                slots = self._slots(start, start + n)
            try:
                self.pool.write(layer, slots, key.transpose(0, 1), value.transpose(0, 1))
            except Exception as exc:
                if beyond > 0:
                    self.rollback_step(start)  # the blocks reserved above go back
                if isinstance(exc, KVCacheError) and not isinstance(exc, InvalidArgumentError):
                    raise
                # a slot the storage does not hold (allocator and pool apart), refused or raw
                raise StateError(
                    f"writing {n} tokens of layer {layer} failed: the pool holds {self.pool.num_blocks} blocks and "
                    f"the allocator {self.allocator.num_blocks} ({exc}); nothing was kept"
                ) from exc
            self.layer_tokens[layer] = start + n
            if self.caught_up:
                self._after_all_layers()
            return slots

    def mark_written(self) -> None:
        """Declare every reserved token written in every layer (when the K/V are written elsewhere — a kernel,
        or no tensors at all in a metadata-only simulation); registers full blocks for prefix reuse."""
        if self._freed:
            self._check_live()
        with self._lock:
            n = self.num_tokens
            self.layer_tokens = [n] * len(self.layer_tokens)
            if self.prefix_cache is not None and n // self.block_size > self.num_registered:
                self._register_full_blocks()
            if self._windows:
                self._seal_behind_window()

    def advance(self, token_ids: Sequence[int]) -> range:
        """Reserve the tokens ``token_ids`` and declare them written in every layer, in one call: ``reserve`` then
        ``mark_written`` for callers that write K/V elsewhere (one indexed store per step, or none in a
        bookkeeping simulation). A decode step's one token takes a short path. Returns the new positions."""
        if self._freed:
            self._check_live()
        with self._lock:
            if type(token_ids) is list and len(token_ids) == 1 and self._append_in_tail(token_ids[0]):
                return range(self.num_tokens - 1, self.num_tokens)
            positions = self.reserve_positions(len(token_ids), token_ids)
            self.mark_written()
            return positions

    def append_token(self, token: int) -> int:
        """One decoded token's bookkeeping — :meth:`advance` of ``[token]`` — returning its position. The decode
        hot path: while the token fits in the sequence's private tail block no block changes hands and the
        allocator is not called; a token that starts a new block (every ``block_size``-th) allocates one; a token
        that fills a block has it hashed (once, continuing the chain) and registered for prefix reuse.

        The in-tail case takes no lock (a lock costs more than the rest of it): drive a sequence from one thread
        at a time, as the engine and sessions do (other sequences may run concurrently; the allocator locks
        itself, and a private, unindexed tail is touched by no other sequence)."""
        start = self.num_tokens
        t = self.block_size
        if (  # the common case inline: room in a private, unindexed tail (what _append_in_tail checks first)
            start % t
            and (start + 1) % t
            and type(token) is int
            and UNKNOWN_TOKEN <= token <= MAX_TOKEN_ID
            and self._plain  # live, no residual window
            and self._refcount[self.block_table[-1]] == 1
            and self.block_table[-1] not in self._indexed
        ):
            self.token_ids.append(token)
            self.num_tokens = n = start + 1
            self.layer_tokens = [n] * len(self.layer_tokens)
            return start
        with self._lock:
            start = self.num_tokens
            if self._append_in_tail(token):
                return start
            return self.advance([token]).start

    def _append_in_tail(self, token: object) -> bool:
        """Append ``token`` written in every layer — into the private, unindexed tail, or a new block when the tail
        is full — for a plain valid id on a live sequence without a residual window to track; False (nothing
        changed) otherwise: a shared or indexed tail is copied on write by the general path. Under ``_lock``."""
        if self._freed or self._windows or type(token) is not int or not UNKNOWN_TOKEN <= token <= MAX_TOKEN_ID:
            return False
        start, t = self.num_tokens, self.block_size
        if start % t:
            tail, alloc = self.block_table[-1], self.allocator
            if alloc.refcount[tail] != 1 or tail in alloc.hash_by_block:  # shared or indexed: copy-on-write first
                return False
        else:
            self.block_table.extend(self.allocator.allocate(1))  # OutOfBlocksError before any change
        self.num_tokens = start + 1
        self.token_ids.append(token)
        self.layer_tokens = [start + 1] * len(self.layer_tokens)
        if self.prefix_cache is not None:
            if not (start + 1) % t:
                self._register_filled_block()
            elif not start % t and start // t > self.num_registered:  # as mark_written after a reserve would
                self._register_full_blocks()
        return True

    def _register_filled_block(self) -> None:
        """The tail block just filled: register it, continuing the hash chain by one link when everything before
        it is registered and no lookup hashed it already (the general path otherwise)."""
        t, done, chain = self.block_size, self.num_registered, self._chain
        full = self.num_tokens // t
        tokens = self.token_ids[-t:]
        lookahead = self._lookahead
        if (
            done != full - 1
            or len(chain) != done
            or UNKNOWN_TOKEN in tokens
            or (lookahead is not None and len(lookahead[0]) >= full)
        ):
            self._register_full_blocks()
            return
        extra = self.prefix_cache.extra_key(self.cache_salt)  # type: ignore[union-attr]
        packed = array("q", tokens).tobytes()  # packed once: hashed, and kept by the index to verify lookups
        block_hash = hash_packed_block(chain[-1] if chain else b"", packed, extra)
        chain.append(block_hash)
        self.allocator.cache_block(self.block_table[-1], block_hash, tokens, packed=packed)
        self.num_registered = full

    def admit(self, token_ids: Sequence[int]) -> range:
        """A new request's bookkeeping in one call, on an empty sequence: :meth:`PrefixCache.lookup`,
        :meth:`adopt_prefix` and :meth:`advance` of the rest, with the prompt validated once and each full block
        hashed once (the lookup's hash chain is the sequence's; vLLM computes a request's block hashes at arrival
        and carries them). Every token is declared written in every layer (as :meth:`advance`). Returns the
        positions added after the reused prefix, ``range(reused, len(token_ids))``.

        All or nothing: :class:`OutOfBlocksError` (the pool cannot hold the prompt even after reusing its cached
        prefix) is raised before anything changes — no reference taken, no lookup counted.

        An id of :data:`UNKNOWN_TOKEN` (-1) is accepted, as by :meth:`advance`: it marks a position whose token is
        not known (a padded or masked position that :class:`~memos_ref.hf.PagedCache` records). A block holding
        one is never entered in the prefix index, nor is any block after it, so no KV is ever shared on an unknown
        token; every other negative id is refused (:class:`InvalidArgumentError`)."""
        self._check_live()
        if self.num_tokens or self.block_table:
            raise StateError(f"admit() starts an empty sequence; this one holds {self.num_tokens} tokens")
        ids, packed = pack_token_ids("token_ids", token_ids)  # validated once, packed once (hashes and checks)
        if self._windows:  # a quantized pool's residual windows: the general path keeps their bookkeeping
            return self._admit_general(ids)
        t, n, prefix, alloc = self.block_size, len(ids), self.prefix_cache, self.allocator
        with self._lock, alloc.lock:
            if -(-n // t) > alloc.num_available:
                self._refuse_if_short(ids)
            hit = prefix.lookup_checked(ids, self.cache_salt, packed=packed) if prefix is not None else []
            fresh = alloc.allocate(-(-n // t) - len(hit))  # cannot fail: checked above, under the lock
            self.block_table = [*hit, *fresh]
            self.token_ids = ids
            self.num_tokens = n
            self.layer_tokens = [n] * len(self.layer_tokens)
            self.num_registered = len(hit)
            if prefix is not None:
                self._chain = hit.chain  # type: ignore[attr-defined]  # the lookup's: every full block but the last token's
                self._lookahead = None
                self._register_full_blocks(hashed=len(self._chain), packed=packed)
            return range(len(hit) * t, n)

    def _admit_general(self, ids: list[int]) -> range:
        """:meth:`admit` over a pool with residual windows: lookup, adopt, advance (the sequence is emptied again
        if the advance fails)."""
        with self._lock, self.allocator.lock:
            if -(-len(ids) // self.block_size) > self.allocator.num_available:
                self._refuse_if_short(ids)
            if self.prefix_cache is not None:
                hit = self.prefix_cache.lookup_checked(ids, self.cache_salt)
                self.adopt_prefix(hit, ids)
            start = self.num_tokens
            try:
                self.advance(ids[start:])
            except BaseException:
                if self.prefix_cache is not None:
                    self.prefix_cache.uncount_hits(start)
                self._reset()
                raise
            return range(start, len(ids))

    def _reset(self) -> None:
        """Back to an empty, live sequence (every block released)."""
        self._unhold(self.block_table[self.window_start :])
        self.allocator.free_many(self.block_table[::-1])
        self.block_table, self.token_ids, self._chain = [], [], []
        self.num_tokens = self.num_registered = self.window_start = 0
        self.layer_tokens = [0] * len(self.layer_tokens)
        self._lookahead = None

    def _refuse_if_short(self, ids: list[int]) -> None:
        """Raise :class:`OutOfBlocksError` (changing nothing) if ``ids`` cannot be admitted: its blocks minus its
        cached prefix exceed the blocks available once that prefix's cached blocks are revived."""
        t, alloc = self.block_size, self.allocator
        hits = revived = 0
        if self.prefix_cache is not None:
            limit = max(0, (len(ids) - 1) // t)
            extra = self.prefix_cache.extra_key(self.cache_salt)
            for i, h in enumerate(iter_block_hashes(ids[: limit * t], t, extra)):
                block = alloc.block_with_hash(h)
                if block is None or alloc.tokens_of(block) != tuple(ids[i * t : (i + 1) * t]):
                    break
                hits += 1
                revived += alloc.state[block] == BlockState.CACHED
        needed, available = -(-len(ids) // t) - hits, alloc.num_available - revived
        if needed > available:
            raise OutOfBlocksError(needed=needed, available=available)

    def _after_all_layers(self) -> None:
        """Every layer holds every reserved token: register full blocks for prefix reuse, and let a quantized
        pool seal the blocks that left the full-precision residual window."""
        if self.prefix_cache is not None and self.num_tokens // self.block_size > self.num_registered:
            self._register_full_blocks()
        if self._windows:
            self._seal_behind_window()

    def set_token_ids(self, token_ids: Sequence[int], start: int = 0) -> None:
        """Record the token ids of positions ``start..`` after the fact (e.g. after ``generate``), so full
        blocks can be prefix-cached. The ids of blocks already in the prefix cache cannot change."""
        self._check_live()
        start = check_index("start", start, lo=0, hi=self.num_tokens)
        token_ids = check_token_ids("token_ids", token_ids)
        if start + len(token_ids) > self.num_tokens:
            raise ShapeError(f"{len(token_ids)} ids from {start} exceed the {self.num_tokens} tokens held")
        with self._lock:
            frozen = max(0, min(self.num_registered * self.block_size, start + len(token_ids)) - start)
            if token_ids[:frozen] != self.token_ids[start : start + frozen]:
                raise InvalidArgumentError(
                    f"token_ids: positions {start}..{start + frozen - 1} lie in blocks already in the prefix cache "
                    f"under other ids; truncate() the sequence before recording different tokens there"
                )
            self.token_ids[start : start + len(token_ids)] = token_ids
            if self.prefix_cache is not None and self.caught_up:
                self._register_full_blocks()

    def _register_full_blocks(self, hashed: int = 0, packed: bytes | None = None) -> None:
        """Offer the newly full blocks with known ids to the prefix index. ``hashed``: how many leading entries of
        ``_chain`` are known to hash this sequence's ids (beyond the registered ones, which always do).
        ``packed``: this sequence's ``token_ids`` packed as int64 bytes, when the caller has them."""
        t, done = self.block_size, self.num_registered
        full = self.num_tokens // t
        if full <= done:
            return
        # only the newly full blocks are scanned for unknown ids (registered ones hold none)
        start, stop = done * t, full * t
        try:
            known = self.token_ids.index(UNKNOWN_TOKEN, start, stop) // t
        except ValueError:
            known = full
        if known <= done:
            return
        # extend the hash chain from the last registered block (each block is hashed once per sequence)
        keep = max(done, min(hashed, known))
        del self._chain[keep:]
        stop = known * t
        ids = self.token_ids[start:stop]
        if keep == done:
            self._chain.extend(self._lookahead_hashes(done, known))
        hashed = len(self._chain) * t  # the rest is hashed now, continuing the chain
        if packed is not None and len(packed) == 8 * len(self.token_ids):
            packed = packed[8 * start : 8 * stop]  # blocks done..known
        else:
            packed = None
        if hashed < stop:
            parent = self._chain[-1] if self._chain else b""
            extra = self.prefix_cache.extra_key(self.cache_salt)  # type: ignore[union-attr]
            if packed is not None:
                self._chain.extend(iter_packed_hashes(packed[8 * (hashed - start) :], t, extra, parent))
            else:
                self._chain.extend(iter_block_hashes(self.token_ids[hashed:stop], t, extra, parent))
        self.allocator.cache_blocks(self.block_table[done:known], self._chain[done:known], ids, t, packed=packed)
        self.num_registered = known

    def _lookahead_hashes(self, done: int, known: int) -> list[bytes]:
        """Hashes of blocks ``done..`` (at most to ``known``) the prefix lookup already computed: valid while the
        chain so far is the lookup's and each block holds the ids it hashed."""
        if self._lookahead is None:
            return []
        chain, ids = self._lookahead
        if done and (done > len(chain) or self._chain[done - 1] != chain[done - 1]):
            return []
        t, out = self.block_size, []
        for i in range(done, min(known, len(chain))):
            if self.token_ids[i * t : (i + 1) * t] != ids[i * t : (i + 1) * t]:
                break
            out.append(chain[i])
        return out

    # ------------------------------------------------------------------ sharing and rollback
    def adopt_prefix(self, blocks: Sequence[int], token_ids: Sequence[int]) -> None:
        """Start an empty sequence from prefix-cache blocks (already incref'd by the lookup)."""
        self._check_live()
        if self.num_tokens or self.block_table:
            raise StateError(f"a prefix can only be adopted by an empty sequence; this one holds {self.num_tokens}")
        if isinstance(blocks, (str, bytes)) or not isinstance(blocks, Sequence):
            raise ArgumentTypeError(f"blocks: expected a sequence of block ids, got {type(blocks).__name__}")
        hit = blocks if isinstance(blocks, PrefixHit) and self.prefix_cache is not None else None
        blocks = self._check_held_all(blocks)
        token_ids = check_token_ids("token_ids", token_ids)
        n = len(blocks) * self.block_size
        if len(token_ids) < n:
            raise ShapeError(f"{len(blocks)} blocks need {n} token ids, got {len(token_ids)}")
        carried = self._carried_chain(hit, token_ids[:n]) if hit is not None else None
        with self._lock:
            self.block_table = list(blocks)
            self.token_ids = list(token_ids[:n])
            self.num_tokens = n
            self.layer_tokens = [n] * len(self.layer_tokens)
            self.num_registered = len(blocks)
            if self.prefix_cache is not None:
                self._lookahead = (carried, hit.token_ids) if carried is not None else None  # type: ignore
                self._chain = (
                    carried[: len(blocks)]
                    if carried is not None
                    else self.prefix_cache.hashes(self.token_ids, self.cache_salt)
                )
            self.window_start = self._window_for(n) if self._windows else 0
            self._hold(self.block_table[self.window_start :])
            self._seal_behind_window()

    def _carried_chain(self, hit: PrefixHit, token_ids: list[int]) -> list[bytes] | None:
        """The hash chain a lookup computed for the prompt (each block hashed once per sequence), if it is this
        sequence's chain: same fingerprint and salt, covering the adopted blocks, and the lookup hashed exactly
        these token ids. None otherwise (the chain is then computed from the token ids)."""
        t = self.block_size
        if len(hit.chain) < len(hit) or hit.extra != self.prefix_cache.extra_key(self.cache_salt):  # type: ignore
            return None
        if hit.token_ids[: len(hit) * t] != token_ids:
            return None
        return list(hit.chain)

    def _check_held_all(self, blocks: Sequence[int]) -> list[int]:
        """Every block id allocated (see :meth:`_check_held`), as a list of ints."""
        out, alloc = list(blocks), self.allocator
        if not out or (  # plain ints in range, all active: checked in C
            set(map(type, out)) == {int}
            and min(out) >= 0
            and max(out) < alloc.num_blocks
            and set(map(alloc.state.__getitem__, out)) == {int(BlockState.ACTIVE)}
        ):
            return out
        return [self._check_held(b) for b in blocks]

    def _check_held(self, block: object) -> int:
        """A block id that is allocated (held by someone: the lookup's reference), as an int."""
        b = check_index("block", block, lo=-(2**62))
        if not 0 <= b < self.allocator.num_blocks:
            raise InvalidBlockError(f"block id {b} is not in [0, {self.allocator.num_blocks})")
        if self.allocator.state[b] != BlockState.ACTIVE:
            raise InvalidBlockError(
                f"block {b} is {BlockState(self.allocator.state[b]).name.lower()}: adopt only blocks a prefix "
                f"lookup returned (they carry the reference this sequence takes over)"
            )
        return b

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
            child._lookahead = self._lookahead
            child.window_start = self.window_start
            child._hold(child.block_table[child.window_start :])
            return child

    def truncate(self, n: int) -> None:
        """Keep the first ``n`` tokens (speculative decoding rollback, undo); blocks past them are freed."""
        self._check_live()
        with self._lock:
            n = check_index("n", n, lo=0, hi=self.num_tokens)
            if not self.caught_up:
                raise ConfigError("cannot truncate in the middle of a model step")
            keep = -(-n // self.block_size)
            dropped = self.block_table[keep:]
            # the window: let go of the dropped blocks, and take back kept blocks the shorter window covers again
            self._unhold(self.block_table[max(self.window_start, keep) :])
            old_start = min(self.window_start, keep)
            del self.block_table[keep:]
            if self._windows:
                self.window_start = self._window_for(n)
                self._hold(self.block_table[self.window_start : old_start])
            self.allocator.free_many(dropped)  # a dropped block left in the prefix cache is sealed there
            del self.token_ids[n:]
            self.num_tokens = n
            self.layer_tokens = [n] * len(self.layer_tokens)
            self.num_registered = min(self.num_registered, n // self.block_size)
            del self._chain[self.num_registered :]

    def rollback_step(self, n: int) -> None:
        """Undo a model step that failed part-way: back to ``n`` tokens in every layer, the blocks reserved past
        them given back (as :meth:`truncate`, which refuses mid-step). ``n`` is at most what every layer holds:
        tokens some layer already wrote are kept only up to ``n``."""
        self._check_live()
        with self._lock:
            n = check_index("n", n, lo=0, hi=min(self.layer_tokens, default=self.num_tokens))
            self.layer_tokens = [self.num_tokens] * len(self.layer_tokens)  # the step is abandoned, not finished
            self.truncate(n)

    def free(self) -> None:
        """Release every block; the sequence cannot be used afterwards (freeing twice is harmless)."""
        with self._lock:
            if self._freed:
                return
            self._unhold(self.block_table[self.window_start :])
            if self._windows and self.caught_up:
                # blocks this sequence alone kept in a window, now behind every remaining holder's: seal them
                # (they are full here); blocks whose last holder this was are sealed by the allocator if cached
                full = self.num_tokens // self.block_size
                shared = [b for b in self.block_table[:full] if self.allocator.refcount[b] > 1]
                self.pool.seal_unheld(shared)  # type: ignore[attr-defined]
            # last block first: cached blocks are evicted oldest first, so a prefix outlives its tail (vLLM's order)
            self.allocator.free_many(self.block_table[::-1])
            self.block_table = []
            self.num_tokens = 0
            self.window_start = 0
            self._freed = True
            self._plain = False
            self._lookahead = None
            if self.registry is not None:
                self.registry.pop(self.seq_id, None)

    # ------------------------------------------------------------------ checks
    def to_dense(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This sequence's K and V of one layer as dense ``[H, S, D]`` tensors (a copy, for checks)."""
        self._check_live()
        layer = check_layer_index(layer, len(self.layer_tokens))
        n = self.layer_tokens[layer]
        return self.pool.gather(layer, self.block_table_tensor(), n)

    @property
    def num_blocks(self) -> int:
        return len(self.block_table)

    def __repr__(self) -> str:
        return f"SequenceCache(id={self.seq_id}, tokens={self.num_tokens}, blocks={self.block_table})"
