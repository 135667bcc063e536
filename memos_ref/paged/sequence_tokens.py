"""A sequence's token bookkeeping: reserving positions, recording token ids, registering full blocks.

The first layer to see new tokens reserves their slots (:meth:`~SequenceTokens.reserve_positions`: allocating,
and copying a shared tail on write); :meth:`~SequenceTokens.admit` starts a request in one call (lookup, adopt,
advance, each block hashed once); :meth:`~SequenceTokens.append_token` is the decode hot path (no lock and no
allocator call while the token fits the private tail). Full blocks with known token ids are offered to the
prefix index, continuing the sequence's hash chain. Part of :class:`~memos_ref.paged.sequence.SequenceCache`
(a base class of it).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from memos_ref.errors import InvalidArgumentError, OutOfBlocksError, ShapeError, StateError, check_index
from memos_ref.paged.allocator import BlockState
from memos_ref.paged.prefix import (
    MAX_TOKEN_ID,
    UNKNOWN_TOKEN,
    check_token_ids,
    hash_packed_block,
    iter_block_hashes,
    iter_packed_hashes,
    pack_token_ids,
)
from memos_ref.paged.sequence_state import SequenceState

__all__ = ["SequenceTokens"]


class SequenceTokens(SequenceState):
    """The token bookkeeping of a :class:`~memos_ref.paged.sequence.SequenceCache`."""

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
            and self.layer_tokens[-1] == start  # between steps (a mid-step call takes the general path)
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
        if not self.caught_up:  # a mid-step call: reserve + mark_written register what set_token_ids recorded
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
            clash = token_ids[:frozen] != self.token_ids[start : start + frozen]
            t, end = self.block_size, start + len(token_ids)
            for b in range(max(self.num_registered, start // t), min(self.num_tokens // t, -(-end // t))):
                held = self.allocator.tokens_of(self.block_table[b])  # indexed by a fork that shares it
                lo, hi = max(b * t, start), min(b * t + t, end)
                if held is not None and tuple(token_ids[lo - start : hi - start]) != held[lo - b * t : hi - b * t]:
                    clash, frozen = True, hi - start
            if clash:
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
