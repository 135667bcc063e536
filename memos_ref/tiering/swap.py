"""Swap-out and swap-in: moving blocks between the device pool and the tiers, under a
:class:`~memos_ref.tiering.manager.TierManager`.

* **Swap-out** (:func:`swap_out_cached`): cached blocks — held by no live sequence — that are not pinned and were
  not used within the minimum residency are written to the first tier that takes them and freed on the device,
  lowest policy priority first, until the device holds ``target_held`` blocks.
* **Write-back** (:func:`write_back`): a cached block the allocator evicts is written to the first tier first.
* **Swap-in** (:func:`extend_prefix`): after the device prefix lookup stops, the following blocks are looked up in
  the tiers by the hash chain the lookup already computed (:class:`~memos_ref.paged.prefix.PrefixHit`: a prompt is
  hashed once); device blocks further along are taken with the allocator's verified ``take_cached``; the run
  found is reloaded into fresh device blocks — or recomputed when the cost model says so. A copy that cannot be
  read ends the run: the rest is recomputed, never guessed.

What the functions need of the manager is :class:`SwapHost`, a Protocol declared here, so this module never imports
:mod:`~memos_ref.tiering.manager` (which imports it).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Protocol

from memos_ref.paged.allocator import BlockState
from memos_ref.paged.prefix import PrefixHit
from memos_ref.tiering.policies import BlockHistory

if TYPE_CHECKING:
    from memos_ref.paged.store import PagedKV
    from memos_ref.tiering.store import TierStore

__all__ = ["SwapHost", "candidates", "extend_prefix", "store_block", "swap_out_cached", "write_back"]

_Plan = list[tuple[int, bytes, "str | None", "int | None"]]  # (block index, hash, tier or None, device block)


class SwapHost(Protocol):
    """What swapping needs of the tier manager (:class:`~memos_ref.tiering.manager.TierManager` is the one): the
    device memory and the tiers, the policy state it keeps, its counters and clock, and the reload-or-recompute
    decision."""

    kv: PagedKV
    store: TierStore
    counts: Counter[str]
    history: dict[int, BlockHistory]  # device block -> its uses (the policies rank by them)
    pinned: set[bytes]  # prefix hashes never swapped out
    kinds: dict[bytes, str]  # prefix hash -> what the block holds (system, tools, memory, turn)
    min_residency: float
    write_back: bool
    clock: Callable[[], float]
    priority: Callable[[BlockHistory, float], float]

    def note_swap(self, n: int, now: float) -> None:
        """Record ``n`` blocks moved at ``now``."""
        ...

    def touch(self, blocks: Iterable[int], now: float | None = None) -> None:
        """Record a use of ``blocks``."""
        ...

    def should_reload_run(self, tier: str, blocks: int, start_block: int, stop_block: int) -> bool:
        """Reload ``blocks`` blocks from ``tier`` (True), or recompute from ``start_block`` on (False)?"""
        ...


# ---------------------------------------------------------------------- swap-out
def store_block(tm: SwapHost, block: int, key: str) -> str | None:
    """Write a device block to the first tier that takes it; the tier's name, or None."""
    data = tm.kv.pool.block(block)
    for tier in tm.store.tiers:
        if tm.store.put(key, data, tier.name):
            return tier.name
    return None


def write_back(tm: SwapHost, block: int, block_hash: bytes | None) -> None:
    """Write an evicted cached block to the first tier (unless write-back is off or a tier has it already)."""
    if not tm.write_back or block_hash is None or tm.store.locate(block_hash.hex()) is not None:
        return
    if store_block(tm, block, block_hash.hex()) is not None:
        tm.counts["write_backs"] += 1
        tm.note_swap(1, tm.clock())
    else:
        tm.counts["write_back_refused"] += 1  # no tier took it: the block is lost, and recomputed if needed


def candidates(tm: SwapHost, now: float) -> list[int]:
    """Cached blocks that may be swapped out, lowest policy priority first."""
    a = tm.kv.allocator
    out = []
    for b in sorted(a.cached_blocks()):  # the cached list (not a scan of the pool), in block order
        h = a.hash_of(b)
        if h is None or h in tm.pinned:
            continue
        hist = tm.history.setdefault(b, BlockHistory(kind=tm.kinds.get(h, "turn")))
        if not hist.uses:
            hist.touch(now)  # first seen now: treat as just used (protects it for min_residency)
        if now - hist.last < tm.min_residency:
            continue
        hist.kind = tm.kinds.get(h, hist.kind)
        out.append((b, hist))
    # sort (block, history) pairs: another thread may evict a block and drop its history meanwhile
    return [b for b, _ in sorted(out, key=lambda pair: tm.priority(pair[1], now))]


def swap_out_cached(tm: SwapHost, target_held: int, now: float) -> int:
    """Move cached blocks to the tiers until the device holds ``target_held`` blocks; how many moved."""
    a, moved = tm.kv.allocator, 0
    for b in candidates(tm, now):
        if a.num_active + a.num_cached <= target_held:
            break
        with a.lock:  # another thread may have revived or evicted the block since it was listed
            h = a.hash_of(b)
            if a.state[b] != BlockState.CACHED or h is None:
                continue
            data = tm.kv.pool.block(b).clone()  # a snapshot, so the slow write needs no lock
        key = h.hex()
        if tm.store.locate(key) is None and not any(tm.store.put(key, data, t.name) for t in tm.store.tiers):
            tm.counts["swap_out_failed"] += 1
            continue  # nowhere to put it: keep it on the device rather than lose it
        if not a.uncache_if(b, h):  # atomically: still cached under h? then back to the free list
            continue  # reused meanwhile: the stored copy is still right, the device block is not ours
        tm.history.pop(b, None)
        moved += 1
    if moved:
        tm.counts["swap_out_blocks"] += moved
        tm.counts["swap_out_bytes"] += moved * tm.kv.spec.bytes_per_block
        tm.note_swap(moved, now)
    return moved


# ---------------------------------------------------------------------- swap-in
def extend_prefix(
    tm: SwapHost,
    token_ids: Sequence[int],
    cache_salt: str | None,
    device_blocks: Sequence[int],
    reloaded_out: list[int] | None = None,
) -> list[int]:
    """Blocks that continue ``device_blocks``: reloaded from the tiers into fresh device blocks, interleaved with
    blocks still on the device further along (the caller owns one reference to each). Empty when nothing
    follows in the tiers or recomputing is cheaper; shorter when a copy cannot be read."""
    t, a = tm.kv.spec.block_size, tm.kv.allocator
    token_ids = list(token_ids)
    limit = max(0, (len(token_ids) - 1) // t)
    first = len(device_blocks)
    if first >= limit:
        return []
    hashes = chain_for(tm, token_ids, cache_salt, device_blocks, limit)
    located: dict[int, str | None] = {}  # tier lookups (network and disk) happen outside the allocator lock
    for i in range(first, limit):
        if a.block_with_hash(hashes[i]) is not None:
            continue
        located[i] = tm.store.locate(hashes[i].hex())
        if located[i] is None:
            break
    plan: _Plan = []
    with a.lock:  # device blocks in the plan get their reference now, so they cannot be evicted meanwhile
        for i in range(first, limit):
            h = hashes[i]
            block = a.take_cached(h, token_ids[i * t : (i + 1) * t])  # verified, with one more holder
            if block is not None:
                plan.append((i, h, None, block))
                continue
            tier = located.get(i)  # None: not in a tier, or it left the device after the lookups above
            if tier is None:
                break
            plan.append((i, h, tier, None))
    from_tiers = [p for p in plan if p[2] is not None]
    if not from_tiers:  # another thread restored the next blocks meanwhile: they are a valid continuation
        return [p[3] for p in plan]  # type: ignore[misc]
    owned = {p[3] for p in plan if p[3] is not None}  # device references this call holds
    fresh: list[int] = []
    try:
        return _reload(tm, plan, from_tiers, token_ids, owned, fresh, reloaded_out)
    except BaseException:
        for block in [*fresh, *owned]:  # nothing half-done stays referenced
            a.free(block)
        raise


def chain_for(
    tm: SwapHost, token_ids: list[int], cache_salt: str | None, device_blocks: Sequence[int], limit: int
) -> list[bytes]:
    """Chain hashes of blocks ``0..limit-1``: the chain the device lookup computed when ``device_blocks`` carries
    it for these token ids (no hashing at all); else those past the device prefix continue from its last
    block's indexed hash, or, for a private copy, the whole prefix is hashed."""
    pc, t, first = tm.kv.prefix_cache, tm.kv.spec.block_size, len(device_blocks)
    if (
        isinstance(device_blocks, PrefixHit)
        and len(device_blocks.chain) >= limit
        and device_blocks.extra == pc.extra_key(cache_salt)
        and device_blocks.token_ids[: limit * t] == token_ids[: limit * t]
    ):
        return device_blocks.chain[:limit]
    parent = tm.kv.allocator.hash_of(device_blocks[-1]) if first else b""
    if parent is None:  # not indexed (a private copy): hash the whole prefix
        return pc.hashes(token_ids[: limit * t], cache_salt)
    return [b""] * first + pc.hashes(token_ids[first * t : limit * t], cache_salt, parent)


def _reload(
    tm: SwapHost,
    plan: _Plan,
    from_tiers: _Plan,
    token_ids: list[int],
    owned: set[int],
    fresh: list[int],
    reloaded_out: list[int] | None,
) -> list[int]:
    """Bring ``from_tiers`` blocks into fresh device blocks, in plan order. ``owned`` (device references held)
    and ``fresh`` (allocated blocks) are kept current so the caller can release them on an error."""
    kv = tm.kv
    pc, t, a = kv.prefix_cache, kv.spec.block_size, kv.allocator
    tiers = {p[2] for p in from_tiers}
    slowest = from_tiers[0][2] if len(tiers) == 1 else tm.store.tiers[-1].name
    if not tm.should_reload_run(slowest, len(from_tiers), from_tiers[0][0], plan[-1][0] + 1):  # type: ignore[arg-type]
        tm.counts["decided_recompute"] += 1
        for block in list(owned):
            a.free(block)
            owned.discard(block)
        return []
    tm.counts["decided_reload"] += 1
    fresh.extend(a.allocate_up_to(len(from_tiers)))  # the count and the allocation agree
    loaded: list[int] = []
    now = tm.clock()
    reloaded = 0
    for pos, (i, h, _tier, block) in enumerate(plan):
        if block is not None:
            loaded.append(block)
            continue
        if reloaded >= len(fresh):
            tm.counts["reload_no_room"] += 1
            got = None
        else:
            got = tm.store.get(h.hex())
            if got is None:
                tm.counts["reload_failed"] += 1  # damaged or unreachable
        if got is None:  # the rest is recomputed
            for _, _, _, rest in plan[pos + 1 :]:
                if rest is not None:
                    a.free(rest)
                    owned.discard(rest)
            break
        b = fresh[reloaded]
        reloaded += 1
        kv.pool.block(b).copy_(got[0].to(kv.pool.device))
        if not pc.register(b, h, token_ids[i * t : (i + 1) * t]):
            tm.counts["reload_duplicates"] += 1  # restored meanwhile by another caller: this copy is private
        tm.history.setdefault(b, BlockHistory(kind=tm.kinds.get(h, "turn"))).touch(now)
        loaded.append(b)
        if reloaded_out is not None:
            reloaded_out.append(b)
    for b in fresh[reloaded:]:
        a.free(b)
    del fresh[:]  # from here on the caller owns every returned block
    owned.clear()
    tm.touch(loaded, now)
    if reloaded:
        tm.counts["swap_in_blocks"] += reloaded
        tm.counts["swap_in_bytes"] += reloaded * kv.spec.bytes_per_block
        tm.counts["reloaded_tokens"] += reloaded * t
        tm.note_swap(reloaded, now)
    return loaded
