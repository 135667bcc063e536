"""PagedKV: one model's paged KV memory — pool, allocator, prefix cache and the live sequences together.

This is what an engine or a session manager holds: it creates sequences, looks prompts up in the prefix
cache, and checks the invariants over everything alive.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch

from memos_ref.errors import ArgumentTypeError, ConfigError, check_index, check_type
from memos_ref.paged.allocator import FREED, BlockAllocator, BlockEvent
from memos_ref.paged.check import check_invariants
from memos_ref.paged.kvpool import KVPool, PoolBuilder
from memos_ref.paged.pool import BlockPool
from memos_ref.paged.prefix import PrefixCache, PrefixHit, check_token_ids
from memos_ref.paged.sequence import SequenceCache
from memos_ref.spec import KVSpec

__all__ = ["GrowablePool", "PagedKV", "TierHook"]


@runtime_checkable
class TierHook(Protocol):
    """What the paged layer asks of the tiers below the device (``memos_ref.tiering.TierManager`` implements it and
    attaches itself as :attr:`PagedKV.tier_manager`): declared here so paged never imports tiering."""

    #: Whether its own thread drives :meth:`step` (else the engine calls it once per engine step).
    driven_by_thread: bool

    def step(self) -> object:
        """Apply the watermarks once (swap out under pressure)."""
        ...

    def touch(self, blocks: Iterable[int], now: float | None = None) -> None:
        """Record a use of device ``blocks`` (eviction policies rank by these)."""
        ...

    def extend_prefix(
        self, token_ids: Sequence[int], cache_salt: str | None, device_blocks: Sequence[int]
    ) -> list[int]:
        """Blocks continuing ``device_blocks`` as a cached prefix of ``token_ids``, reloaded from the tiers (each
        returned block holds one reference for the caller)."""
        ...


@runtime_checkable
class GrowablePool(Protocol):
    """A pool that can add blocks after it is built (:class:`BlockPool`: a segment per growth)."""

    num_blocks: int

    def grow(self, n: int, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None) -> range:
        """Add ``n`` blocks with the next ids, all or nothing; returns them."""
        ...

    def shrink(self, ids: range) -> None:
        """Undo the last :meth:`grow` (its ``ids``)."""
        ...


_DEBUG_EVENTS = frozenset({FREED})  # poisoning


class PagedKV:
    """Pool + allocator + prefix cache + registry of live sequences.

    Args:
        spec: KV geometry (its ``block_size`` is the block size).
        num_blocks / byte_budget / segments / device: passed to :class:`BlockPool` (when no ``pool`` is given).
        fingerprint: model fingerprint mixed into prefix hashes (KV of one model never serves another).
        prefix_caching: keep full blocks content-addressed for reuse.
        debug: poison freed blocks with NaN so a use-after-free shows in the output.
        pool: the K/V storage, any :class:`~memos_ref.paged.kvpool.KVPool` built for ``spec`` — e.g. a
            :class:`~memos_ref.quant.pool.QuantizedBlockPool` (``PagedKV(spec, pool=QuantizedBlockPool(spec, n,
            scheme))``); default a :class:`BlockPool`.
        quant: a scheme that builds its own pool (a :class:`~memos_ref.paged.kvpool.PoolBuilder`, e.g. any
            :mod:`memos_ref.quant` quantizer): blocks are stored quantized (same block ids, sharing and
            copy-on-write). Shorthand for ``pool=quant.build_pool(spec, num_blocks, ...)``.
        residual_tokens / staging_blocks / layer_scales: passed to ``quant.build_pool``.
    """

    def __init__(
        self,
        spec: KVSpec,
        num_blocks: int | None = None,
        *,
        byte_budget: int | None = None,
        segments: int = 1,
        device: str | torch.device = "cpu",
        fingerprint: str = "",
        prefix_caching: bool = True,
        debug: bool = False,
        pool: KVPool | None = None,
        quant: PoolBuilder | None = None,
        residual_tokens: int | None = None,
        staging_blocks: int | None = None,
        layer_scales: torch.Tensor | None = None,
    ) -> None:
        check_type("spec", spec, KVSpec)
        self.spec = spec
        self.pool: KVPool = self._build_pool(
            spec, num_blocks, byte_budget, segments, device, pool, quant, residual_tokens, staging_blocks, layer_scales
        )
        self.allocator = BlockAllocator(self.pool.num_blocks)
        pool_ = self.pool
        self.allocator.bind_capacity(lambda: pool_.num_blocks)  # allocator.grow alone cannot outgrow the pool
        self._debug = debug
        kinds = self.pool.block_events | (_DEBUG_EVENTS if debug else frozenset())
        self._pool_events = self.allocator.subscribe(kinds, handler=self._on_block_event) if kinds else None
        self.prefix_cache = (
            PrefixCache(self.allocator, spec.block_size, fingerprint=fingerprint) if prefix_caching else None
        )
        self.sequences: dict[int, SequenceCache] = {}
        self.tier_manager: TierHook | None = None  # a memos_ref.tiering.TierManager attaches itself here

    @staticmethod
    def _build_pool(
        spec: KVSpec,
        num_blocks: int | None,
        byte_budget: int | None,
        segments: int,
        device: str | torch.device,
        pool: KVPool | None,
        quant: PoolBuilder | None,
        residual_tokens: int | None,
        staging_blocks: int | None,
        layer_scales: torch.Tensor | None,
    ) -> KVPool:
        """The pool given, the one ``quant`` builds, or a :class:`BlockPool` (each option checked first)."""
        quant_only = {
            "residual_tokens": residual_tokens,
            "staging_blocks": staging_blocks,
            "layer_scales": layer_scales,
        }
        if pool is not None:
            given = {"num_blocks": num_blocks, "byte_budget": byte_budget, "quant": quant, **quant_only}
            extra = [name for name, value in given.items() if value is not None] + (
                ["segments"] if segments != 1 else []
            )
            if extra:
                raise ConfigError(f"pool= is the whole storage: drop {extra} (they size or build a pool)")
            if not isinstance(pool, KVPool):
                raise ArgumentTypeError(
                    f"pool: expected a KVPool (BlockPool, QuantizedBlockPool...), got {type(pool)!r}"
                )
            if pool.spec != spec:
                raise ConfigError(f"pool was built for {pool.spec}, not for this PagedKV's {spec}")
            return pool
        if quant is None:
            extra = [name for name, value in quant_only.items() if value is not None]
            if extra:
                raise ConfigError(f"{extra} configure a quantized pool: pass quant=<scheme> too")
            return BlockPool(spec, num_blocks, byte_budget=byte_budget, segments=segments, device=device)
        if not callable(getattr(quant, "build_pool", None)):
            raise ConfigError(f"quant: expected a memos_ref.quant scheme (one that builds its pool), got {quant!r}")
        if byte_budget is not None or segments != 1:
            raise ConfigError("a quantized pool is sized by num_blocks and has one segment")
        return quant.build_pool(
            spec,
            num_blocks,  # type: ignore[arg-type]  # the pool checks it
            residual_tokens=residual_tokens,
            staging_blocks=staging_blocks,
            layer_scales=layer_scales,
            device=device,
        )

    def _on_block_event(self, event: BlockEvent) -> None:
        """What the K/V memory does when block state changes (drained by the allocator before it returns): debug
        poisoning of freed blocks, and the events the pool asked for (:attr:`KVPool.block_events`: a quantized
        pool gives back the staging slot of a freed or evicted block and seals a block that stays cached)."""
        if self._debug and event.kind == FREED:
            self.pool.poison(event.block)  # a quantized pool's poison releases the staging slot too
        elif event.kind in self.pool.block_events:
            self.pool.on_block_event(event)

    def grow(
        self, n_blocks: int, *, dtype: torch.dtype | None = None, device: str | torch.device | None = None
    ) -> range:
        """Add ``n_blocks`` blocks: the pool appends a segment and the allocator appends the new ids (they follow
        the old ones) to the back of its free list. Every live sequence, cached prefix, refcount and event
        subscription is kept; the new blocks are free. ``dtype`` / ``device``, when given, must be the pool's.

        All or nothing: a bad ``n_blocks`` (:class:`ArgumentTypeError` / :class:`InvalidArgumentError`), another
        dtype or device (:class:`DTypeError` / :class:`DeviceError`), or a pool that cannot grow — a
        quantized pool holds per-block payload, scales and staging bookkeeping sized once (:class:`ConfigError`)
        — leaves the pool and the allocator exactly as they were; so does a size past the limits
        (:class:`InvalidArgumentError` beyond :data:`~memos_ref.paged.allocator.MAX_BLOCKS` blocks,
        :class:`CapacityExceededError` beyond the device's memory or when the allocation fails). Returns the new
        block ids. Readers need no lock meanwhile: the pool publishes the new segment in one assignment."""
        n_blocks = check_index("n_blocks", n_blocks, lo=1)
        if isinstance(self.pool, BlockPool):  # bounded before the lock and any allocation (grow(2**62))
            self.pool.check_grow(n_blocks, "n_blocks")
        if not isinstance(self.pool, GrowablePool):
            raise ConfigError(
                f"{type(self.pool).__name__} cannot grow: its per-block state is sized once; build the PagedKV with "
                f"the blocks it needs (a plain BlockPool grows by segments)"
            )
        with self.allocator.lock:
            if self.pool.num_blocks != self.allocator.num_blocks:
                raise ConfigError(
                    f"the pool holds {self.pool.num_blocks} blocks but the allocator {self.allocator.num_blocks}: "
                    f"grow them together with PagedKV.grow"
                )
            ids = self.pool.grow(n_blocks, dtype=dtype, device=device)  # raises before any change
            try:
                added = self.allocator.grow(n_blocks)
            except BaseException:
                self.pool.shrink(ids)
                raise
            assert added == ids
            return ids

    def new_sequence(self, cache_salt: str | None = None) -> SequenceCache:
        """An empty sequence over this memory."""
        check_type("cache_salt", cache_salt, (str, type(None)))
        return SequenceCache(
            self.pool, self.allocator, self.prefix_cache, cache_salt=cache_salt, registry=self.sequences
        )

    def start_from_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> SequenceCache:
        """A new sequence holding the longest cached prefix of ``token_ids`` (possibly none) — on the device,
        or reloaded from the tiers when a tier manager is attached; its ``num_tokens`` says how many tokens
        need no computing."""
        token_ids = check_token_ids("token_ids", token_ids)  # before anything is created
        seq = self.new_sequence(cache_salt)
        if self.prefix_cache is None:
            return seq
        try:
            blocks = self.prefix_cache.lookup_checked(token_ids, cache_salt)  # validated above: once
        except BaseException:
            seq.free()  # no sequence is left behind by a failed start
            raise
        try:
            if self.tier_manager is not None:  # continue the prefix from the tiers below the device
                self.tier_manager.touch(blocks)
                more = self.tier_manager.extend_prefix(token_ids, cache_salt, blocks)
                if more:  # keep the lookup's hash chain: the sequence hashes none of the prompt again
                    blocks = PrefixHit([*blocks, *more], blocks.chain, blocks.extra, blocks.token_ids)
            seq.adopt_prefix(blocks, token_ids)
        except BaseException:
            if not seq.block_table:  # adopt_prefix did not take them: the lookup's references are still ours
                self.allocator.free_many(blocks)
            seq.free()
            raise
        return seq

    def check(self) -> None:
        """Run the invariant checker over every live sequence."""
        check_invariants(self.allocator, list(self.sequences.values()), self.prefix_cache)

    def stats(self) -> dict[str, Any]:
        """Block counts, slot utilization and prefix hit accounting."""
        stats: dict[str, Any] = dict(self.allocator.stats())
        filled: dict[int, int] = {}  # per held block: the most tokens any holder keeps in it
        t = self.spec.block_size
        for seq in list(self.sequences.values()):
            for i, block in enumerate(seq.block_table):
                filled[block] = max(filled.get(block, 0), min(t, seq.num_tokens - i * t))
        stats["slot_utilization"] = sum(filled.values()) / (len(filled) * t) if filled else 1.0
        if self.prefix_cache is not None:
            stats.update(self.prefix_cache.stats())
        return stats
