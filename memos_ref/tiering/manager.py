"""TierManager: moves KV blocks between the device pool and the tiers below it, visibly and safely.

The tier key of a block is its prefix hash (chained over the model fingerprint, the tenant salt and every
token before it — :mod:`memos_ref.paged.prefix`), so a block stored in any tier is found again by the same
lookup that finds it on the device, by this process or by another one sharing a Redis tier (LMCache's and
SGLang HiCache's design). What it does:

* **Swap-out** (:meth:`step`): when device utilization (active + cached blocks over all blocks) passes the
  high watermark (0.85), cached blocks — held by no live sequence — are written to the first tier that takes
  them and freed on the device, lowest policy priority first, until utilization falls below the low
  watermark (0.60) (seed 000 §5.2). Blocks used less than ``min_residency_s`` ago (30 s) and pinned blocks
  (current system prompts) are never candidates. If that is not enough, ``on_pressure`` asks the session
  layer to suspend idle sessions (their blocks become cached), and it tries again.
* **Write-back on eviction**: a cached block the allocator takes back for a new allocation is first written
  to the first tier, so nothing reusable is lost silently.
* **Swap-in** (:meth:`extend_prefix`, called by ``PagedKV.start_from_prefix``): after the device prefix
  lookup stops, the following blocks are looked up in the tiers; the run found is reloaded into fresh device
  blocks — or recomputed, when the measured reload time exceeds the measured prefill time for those tokens
  (``reload="auto"``; :meth:`break_even_tokens` says where the two cross). A copy that cannot be read (damaged,
  Redis down) ends the run: the rest is recomputed, never guessed.

Everything is counted (:meth:`stats`): blocks and bytes per tier, swaps in and out, write-backs, decisions,
tokens reloaded and recomputed, and the swap rate (seed 000 §5.3: several swaps a second means the watermarks
are too aggressive). ``step(now)`` makes it deterministic in tests; :meth:`start` drives it from a thread.
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, check_index, check_type
from memos_ref.paged.allocator import EVICTED, BlockEvent, BlockState
from memos_ref.paged.store import PagedKV
from memos_ref.tiering.policies import BlockHistory, priority_function
from memos_ref.tiering.store import TierStore

__all__ = ["TierManager"]


class TierManager:
    """Tiering for one :class:`PagedKV` (unquantized pools; single segment or several).

    Args:
        kv: the device memory (must have prefix caching: tier keys are prefix hashes).
        store: the tiers below it.
        high_watermark / low_watermark: utilization that starts swap-out, and where it stops.
        min_residency_s: a block used more recently than this is never swapped out.
        policy: eviction policy name (:data:`memos_ref.tiering.policies.POLICIES`).
        reload: ``"auto"`` (compare measured costs), ``"always"`` or ``"never"`` (always recompute).
        write_back: write evicted cached blocks to the first tier.
        clock: time source (inject one in tests).
    """

    def __init__(
        self,
        kv: PagedKV,
        store: TierStore,
        *,
        high_watermark: float = 0.85,
        low_watermark: float = 0.60,
        min_residency_s: float = 30.0,
        policy: str = "lru",
        reload: str = "auto",
        write_back: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_type("kv", kv, PagedKV)
        check_type("store", store, TierStore)
        for name, value in (("high_watermark", high_watermark), ("low_watermark", low_watermark)):
            _finite(name, value)
        _finite("min_residency_s", min_residency_s)
        check_type("policy", policy, str)
        check_type("reload", reload, str)
        check_type("write_back", write_back, bool)
        _callable("clock", clock)
        if kv.prefix_cache is None:
            raise ConfigError("tiering needs a PagedKV with prefix caching (blocks are stored under prefix hashes)")
        if getattr(kv.pool, "quantized", False):
            raise ConfigError("tiering of quantized pools is not supported yet; tier an unquantized PagedKV")
        if store.spec != kv.spec:
            raise ConfigError(f"the tier store holds blocks of {store.spec}, the device pool is {kv.spec}")
        if store.fingerprint != kv.prefix_cache.fingerprint:
            raise ConfigError(
                f"the tier store's fingerprint {store.fingerprint!r} differs from the prefix cache's "
                f"{kv.prefix_cache.fingerprint!r}: blocks would be keyed for one model and checked against another"
            )
        if not 0 < low_watermark < high_watermark <= 1:
            raise ConfigError(f"need 0 < low < high <= 1, got low={low_watermark}, high={high_watermark}")
        if reload not in ("auto", "always", "never"):
            raise ConfigError(f"reload must be 'auto', 'always' or 'never', got {reload!r}")
        if min_residency_s < 0:
            raise ConfigError(f"min_residency_s must be >= 0, got {min_residency_s}")
        self.kv, self.store = kv, store
        self.high, self.low, self.min_residency = high_watermark, low_watermark, min_residency_s
        self.policy_name, self.priority = policy, priority_function(policy)
        self.reload_mode, self.write_back, self.clock = reload, write_back, clock
        self.history: dict[int, BlockHistory] = {}
        self.pinned: set[bytes] = set()
        self.kinds: dict[bytes, str] = {}
        self.counts: Counter[str] = Counter()
        self.swap_events: deque[float] = deque(maxlen=10_000)
        self.on_pressure: Callable[[int], int] | None = None
        self._recompute_fit: tuple[float, float, float] | None = None  # seconds = a + b·n + c·n²
        self._block_seconds: dict[str, float] = {}
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_error: str | None = None
        self._events_lock = threading.Lock()
        # write-back on eviction: the allocator drains this before the allocation that evicted returns, so the
        # block still holds its bytes; the event carries the hash the block had
        self._evictions = kv.allocator.subscribe({EVICTED}, handler=self._on_evicted)
        kv.tier_manager = self

    def _on_evicted(self, event: BlockEvent) -> None:
        try:
            self._write_back(event.block, event.block_hash)
        except Exception:  # a failing tier must never break an allocation half-way: the block is just lost
            self.counts["write_back_failed"] += 1
        finally:
            self.history.pop(event.block, None)

    def close(self) -> None:
        """Stop the background thread and stop writing evicted blocks back (the manager can be dropped)."""
        self.stop()
        self._evictions.close()
        if self.kv.tier_manager is self:
            self.kv.tier_manager = None

    # ------------------------------------------------------------------ bookkeeping
    def utilization(self) -> float:
        """(active + cached) / total device blocks."""
        a = self.kv.allocator
        return (a.num_active + a.num_cached) / a.num_blocks

    def _hash_of(self, block: int) -> bytes | None:
        return self.kv.allocator.hash_of(block)

    def pin(self, hashes: Iterable[bytes]) -> None:
        """Never swap out the blocks with these prefix hashes (e.g. the current system prompts) in :meth:`step`.
        The allocator may still evict a pinned block that nobody holds when it runs out of free blocks; it is
        written back to the first tier first, like any other."""
        self.pinned.update(_hashes(hashes))

    def unpin(self, hashes: Iterable[bytes]) -> None:
        self.pinned.difference_update(_hashes(hashes))

    def label(self, hashes: Iterable[bytes], kind: str) -> None:
        """Tell the ``priority`` policy what these blocks hold (``system``, ``tools``, ``memory``, ``turn``)."""
        check_type("kind", kind, str)
        for h in _hashes(hashes):
            self.kinds[h] = kind

    def residency(self, block_hash: bytes) -> str | None:
        """Where the block with this prefix hash lives: ``"device"``, a tier's name, or None."""
        check_type("block_hash", block_hash, bytes)
        if self.kv.allocator.block_with_hash(block_hash) is not None:
            return "device"
        return self.store.locate(block_hash.hex())

    def touch(self, blocks: Iterable[int], now: float | None = None) -> None:
        """Record a use of ``blocks`` (the policies rank by these)."""
        now = self.clock() if now is None else _finite("now", now)
        hi = self.kv.allocator.num_blocks - 1
        blocks = [check_index("blocks[i]", b, lo=0, hi=hi) for b in _iterable("blocks", blocks)]
        with self._lock:
            for b in blocks:
                self.history.setdefault(b, BlockHistory()).touch(now)

    def _note_swap(self, n: int, now: float) -> None:
        with self._events_lock:
            for _ in range(n):
                self.swap_events.append(now)

    def swap_rate(self, now: float | None = None, window_s: float = 10.0) -> float:
        """Blocks swapped (in or out) per second over the last ``window_s`` seconds."""
        now = self.clock() if now is None else _finite("now", now)
        if _finite("window_s", window_s) <= 0:
            raise InvalidArgumentError(f"window_s must be > 0 seconds, got {window_s!r}")
        with self._events_lock:
            events = list(self.swap_events)
        return sum(1 for t in events if now - t <= window_s) / window_s

    # ------------------------------------------------------------------ swap-out
    def _store_block(self, block: int, key: str) -> str | None:
        """Write a device block to the first tier that takes it; the tier's name, or None."""
        data = self.kv.pool.block(block)
        for tier in self.store.tiers:
            if self.store.put(key, data, tier.name):
                return tier.name
        return None

    def _write_back(self, block: int, h: bytes | None) -> None:
        if not self.write_back or h is None or self.store.locate(h.hex()) is not None:
            return
        if self._store_block(block, h.hex()) is not None:
            self.counts["write_backs"] += 1
            self._note_swap(1, self.clock())
        else:
            self.counts["write_back_refused"] += 1  # no tier took it: the block is lost, and recomputed if needed

    def _candidates(self, now: float) -> list[int]:
        a = self.kv.allocator
        out = []
        for b in sorted(a.cached_blocks()):  # the cached list (not a scan of the pool), in block order
            h = self._hash_of(b)
            if h is None or h in self.pinned:
                continue
            hist = self.history.setdefault(b, BlockHistory(kind=self.kinds.get(h, "turn")))
            if not hist.uses:
                hist.touch(now)  # first seen now: treat as just used (protects it for min_residency)
            if now - hist.last < self.min_residency:
                continue
            hist.kind = self.kinds.get(h, hist.kind)
            out.append((b, hist))
        # sort (block, history) pairs: another thread may evict a block and drop its history meanwhile
        return [b for b, _ in sorted(out, key=lambda pair: self.priority(pair[1], now))]

    def _swap_out_cached(self, target_held: int, now: float) -> int:
        a, moved = self.kv.allocator, 0
        for b in self._candidates(now):
            if a.num_active + a.num_cached <= target_held:
                break
            with a.lock:  # another thread may have revived or evicted the block since it was listed
                h = self._hash_of(b)
                if a.state[b] != BlockState.CACHED or h is None:
                    continue
                data = self.kv.pool.block(b).clone()  # a snapshot, so the slow write needs no lock
            key = h.hex()
            if self.store.locate(key) is None and not any(self.store.put(key, data, t.name) for t in self.store.tiers):
                self.counts["swap_out_failed"] += 1
                continue  # nowhere to put it: keep it on the device rather than lose it
            if not a.uncache_if(b, h):  # atomically: still cached under h? then back to the free list
                continue  # reused meanwhile: the stored copy is still right, the device block is not ours
            self.history.pop(b, None)
            moved += 1
        if moved:
            self.counts["swap_out_blocks"] += moved
            self.counts["swap_out_bytes"] += moved * self.kv.spec.bytes_per_block
            self._note_swap(moved, now)
        return moved

    def step(self, now: float | None = None) -> dict[str, Any]:
        """Enforce the watermarks once. Returns what happened (utilization before and after, blocks moved)."""
        now = self.clock() if now is None else _finite("now", now)
        with self._lock:
            before = self.utilization()
            report = {"utilization_before": before, "swapped_out": 0, "suspended_blocks": 0}
            if before <= self.high:
                report["utilization_after"] = before
                return report
            a = self.kv.allocator
            target = math.floor(self.low * a.num_blocks)
            report["swapped_out"] = self._swap_out_cached(target, now)
            held = a.num_active + a.num_cached
            if held > target and self.on_pressure is not None:
                report["suspended_blocks"] = self.on_pressure(held - target)
                self.counts["pressure_calls"] += 1
                report["swapped_out"] += self._swap_out_cached(target, now)
            report["utilization_after"] = self.utilization()
            self.counts["steps_over_watermark"] += 1
            return report

    # ------------------------------------------------------------------ swap-in
    def recompute_seconds(self, start: int, stop: int) -> float | None:
        """Estimated time to prefill positions ``start..stop`` (from :meth:`calibrate`), or None."""
        start = check_index("start", start, lo=0)
        stop = check_index("stop", stop, lo=0)
        if self._recompute_fit is None:
            return None
        a, b, c = self._recompute_fit

        def total(n: int) -> float:
            return a + b * n + c * n * n if n > 0 else 0.0

        return max(total(stop) - total(start), 0.0)

    def reload_seconds(self, tier: str, blocks: int) -> float | None:
        """Estimated time to bring ``blocks`` back from ``tier`` (measured per block), or None."""
        check_type("tier", tier, str)
        blocks = check_index("blocks", blocks, lo=0)
        per = self._block_seconds.get(tier)
        if per is None:
            bw = self.store.bandwidth(tier)
            per = None if bw is None else self.kv.spec.bytes_per_block / bw
        return None if per is None else per * blocks

    def _should_reload_run(self, tier: str, blocks: int, start_block: int, stop_block: int) -> bool:
        """Reload ``blocks`` blocks from ``tier``, or recompute every token from the first missing block on?"""
        if self.reload_mode != "auto":
            return self.reload_mode == "always"
        t = self.kv.spec.block_size
        reload = self.reload_seconds(tier, blocks)
        recompute = self.recompute_seconds(start_block * t, stop_block * t)
        if reload is None or recompute is None:
            return True  # nothing measured yet: moving bytes is the usual winner
        return reload <= recompute

    def extend_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        device_blocks: Sequence[int],
        reloaded_out: list[int] | None = None,
    ) -> list[int]:
        """Blocks that continue ``device_blocks``: reloaded from the tiers into fresh device blocks, interleaved
        with blocks still on the device further along (the caller owns one reference to each). Empty when
        nothing follows in the tiers or recomputing is cheaper; shorter when a copy cannot be read."""
        t, a = self.kv.spec.block_size, self.kv.allocator
        token_ids = list(token_ids)
        limit = max(0, (len(token_ids) - 1) // t)
        first = len(device_blocks)
        if first >= limit:
            return []
        hashes = self._chain_from(token_ids, cache_salt, device_blocks, limit)
        located: dict[int, str | None] = {}  # tier lookups (network and disk) happen outside the allocator lock
        for i in range(first, limit):
            if a.block_with_hash(hashes[i]) is not None:
                continue
            located[i] = self.store.locate(hashes[i].hex())
            if located[i] is None:
                break
        plan: list[tuple[int, bytes, str | None, int | None]] = []  # (index, hash, tier or None, device block)
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
            return [p[3] for p in plan]
        owned = {p[3] for p in plan if p[3] is not None}  # device references this call holds
        fresh: list[int] = []
        try:
            loaded = self._reload(plan, from_tiers, token_ids, first, owned, fresh, reloaded_out)
        except BaseException:
            for block in [*fresh, *owned]:  # nothing half-done stays referenced
                self.kv.allocator.free(block)
            raise
        return loaded

    def _chain_from(
        self, token_ids: list[int], cache_salt: str | None, device_blocks: Sequence[int], limit: int
    ) -> list[bytes]:
        """Chain hashes of blocks ``0..limit-1``; those past the device prefix continue from its last block's
        indexed hash (the prefix is not hashed again), the others are hashed from the token ids."""
        pc, t, first = self.kv.prefix_cache, self.kv.spec.block_size, len(device_blocks)
        parent = self.kv.allocator.hash_of(device_blocks[-1]) if first else b""
        if parent is None:  # not indexed (a private copy): hash the whole prefix
            return pc.hashes(token_ids[: limit * t], cache_salt)
        return [b""] * first + pc.hashes(token_ids[first * t : limit * t], cache_salt, parent)

    def _reload(
        self, plan, from_tiers, token_ids, first, owned: set[int], fresh: list[int], reloaded_out: list[int] | None
    ) -> list[int]:
        """Bring ``from_tiers`` blocks into fresh device blocks, in plan order. ``owned`` (device references
        held) and ``fresh`` (allocated blocks) are kept current so the caller can release them on an error."""
        pc, t = self.kv.prefix_cache, self.kv.spec.block_size
        tiers = {p[2] for p in from_tiers}
        slowest = from_tiers[0][2] if len(tiers) == 1 else self.store.tiers[-1].name
        if not self._should_reload_run(slowest, len(from_tiers), from_tiers[0][0], plan[-1][0] + 1):
            self.counts["decided_recompute"] += 1
            for block in list(owned):
                self.kv.allocator.free(block)
                owned.discard(block)
            return []
        self.counts["decided_reload"] += 1
        fresh.extend(self.kv.allocator.allocate_up_to(len(from_tiers)))  # the count and the allocation agree
        loaded: list[int] = []
        now = self.clock()
        reloaded = 0
        for pos, (i, h, _tier, block) in enumerate(plan):
            if block is not None:
                loaded.append(block)
                continue
            if reloaded >= len(fresh):
                self.counts["reload_no_room"] += 1
                got = None
            else:
                got = self.store.get(h.hex())
                if got is None:
                    self.counts["reload_failed"] += 1  # damaged or unreachable
            if got is None:  # the rest is recomputed
                for _, _, _, rest in plan[pos + 1 :]:
                    if rest is not None:
                        self.kv.allocator.free(rest)
                        owned.discard(rest)
                break
            b = fresh[reloaded]
            reloaded += 1
            self.kv.pool.block(b).copy_(got[0].to(self.kv.pool.device))
            if not pc.register(b, h, token_ids[i * t : (i + 1) * t]):
                self.counts["reload_duplicates"] += 1  # restored meanwhile by another caller: this copy is private
            self.history.setdefault(b, BlockHistory(kind=self.kinds.get(h, "turn"))).touch(now)
            loaded.append(b)
            if reloaded_out is not None:
                reloaded_out.append(b)
        for b in fresh[reloaded:]:
            self.kv.allocator.free(b)
        del fresh[:]  # from here on the caller owns every returned block
        owned.clear()
        self.touch(loaded, now)
        if reloaded:
            self.counts["swap_in_blocks"] += reloaded
            self.counts["swap_in_bytes"] += reloaded * self.kv.spec.bytes_per_block
            self.counts["reloaded_tokens"] += reloaded * t
            self._note_swap(reloaded, now)
        return loaded

    def prefetch(self, token_ids: Sequence[int], cache_salt: str | None = None, max_blocks: int = 8) -> int:
        """Bring up to ``max_blocks`` of a prompt's blocks from the tiers to the device ahead of its request
        (seed 001 §3.1); they wait there as cached blocks. Returns how many were fetched by this call."""
        max_blocks = check_index("max_blocks", max_blocks, lo=0)
        if cache_salt is not None:
            check_type("cache_salt", cache_salt, str)
        t, pc = self.kv.spec.block_size, self.kv.prefix_cache
        token_ids = list(token_ids)
        device = pc.lookup(token_ids, cache_salt, count=False)  # a prefetch is not a request: no hit statistics
        reloaded: list[int] = []
        try:
            more = self.extend_prefix(token_ids[: (len(device) + max_blocks) * t + 1], cache_salt, device, reloaded)
        except BaseException:
            self.kv.allocator.free_many(device)
            raise
        fetched = len(reloaded)
        self.kv.allocator.free_many(device + more)  # nobody holds them now: they wait as cached blocks
        self.counts["prefetched_blocks"] += fetched
        return fetched

    # ------------------------------------------------------------------ measured costs
    @torch.no_grad()
    def calibrate(self, model: Any, lengths: Sequence[int] = (32, 128, 512), repeats: int = 3) -> dict[str, Any]:
        """Measure prefill time against context length (fit ``a + b·n + c·n²``) and the time to reload one
        block from each tier; returns the measurements (``break_even_tokens`` uses them)."""
        from memos_ref.hf import PagedCache

        spec = self.kv.spec
        times = []
        for n in lengths:
            scratch = PagedKV(spec, -(-n // spec.block_size) + 1, prefix_caching=False, device=self.kv.pool.device)
            ids = torch.randint(0, 256, (1, n))
            best = math.inf
            for _ in range(repeats):
                cache = PagedCache(scratch)
                started = time.perf_counter()
                model(ids, cache)
                best = min(best, time.perf_counter() - started)
                cache.free()
            times.append(best)
        xs = torch.tensor([[1.0, n, n * n] for n in lengths], dtype=torch.float64)
        fit = torch.linalg.lstsq(xs, torch.tensor(times, dtype=torch.float64)[:, None]).solution.flatten()
        self._recompute_fit = tuple(float(v) for v in fit)  # type: ignore[assignment]
        probe = torch.randn(spec.block_shape).to(spec.dtype)
        key = f"calibration-probe-{os.getpid()}-{id(self)}"  # unique: processes may share a Redis tier
        for tier in self.store.tiers:
            if not self.store.put(key, probe, tier.name):
                continue
            best = math.inf
            for _ in range(repeats):
                started = time.perf_counter()
                got = self.store.get(key, tiers=[tier.name])
                if got is not None:
                    best = min(best, time.perf_counter() - started)
            tier.backend.delete(key)
            if best < math.inf:
                self._block_seconds[tier.name] = best
        return {
            "prefill_seconds": dict(zip(lengths, times)),
            "prefill_fit": self._recompute_fit,
            "reload_seconds_per_block": dict(self._block_seconds),
        }

    def break_even_tokens(self, tier: str, max_tokens: int = 1 << 17) -> int | None:
        """The shortest context (a multiple of the block size) from which reloading it from ``tier`` is faster
        than recomputing it, by the measured costs; None if recomputing always wins up to ``max_tokens``."""
        check_type("tier", tier, str)
        max_tokens = check_index("max_tokens", max_tokens, lo=0)
        t = self.kv.spec.block_size
        n = t
        while n <= max_tokens:
            reload, recompute = self.reload_seconds(tier, n // t), self.recompute_seconds(0, n)
            if reload is None or recompute is None:
                return None
            if reload < recompute:
                return n
            n += t
        return None

    # ------------------------------------------------------------------ background driver
    def start(self, interval_s: float = 0.5) -> None:
        """Call :meth:`step` every ``interval_s`` seconds from a daemon thread (seed 000 §4.2)."""
        if _finite("interval_s", interval_s) <= 0:
            raise InvalidArgumentError(f"interval_s must be > 0 seconds, got {interval_s!r}")
        if self._thread is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.step()
                except Exception as exc:  # keep driving: one failed step must not stop tiering for good
                    self.counts["step_errors"] += 1
                    self.last_error = repr(exc)

        self._thread = threading.Thread(target=loop, name="memos-tier-manager", daemon=True)
        self._thread.start()

    @property
    def driven_by_thread(self) -> bool:
        """True while :meth:`start`'s background thread calls :meth:`step` (then callers must not step it)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    # ------------------------------------------------------------------ metrics
    def stats(self) -> dict[str, Any]:
        a = self.kv.allocator
        return {
            **dict(self.counts),
            "device_blocks_held": a.num_active + a.num_cached,
            "device_utilization": self.utilization(),
            "swap_rate_per_s": self.swap_rate(),
            "policy": self.policy_name,
            "tiers": self.store.stats(),
        }


def _finite(name: str, value: object) -> float:
    """A finite real number (not a bool), as a float."""
    check_type(name, value, (int, float))
    if not math.isfinite(value):  # type: ignore[arg-type]
        raise InvalidArgumentError(f"{name} must be finite, got {value!r}")
    return float(value)  # type: ignore[arg-type]


def _callable(name: str, value: object) -> None:
    if not callable(value):
        raise ArgumentTypeError(f"{name}: expected a callable, got {type(value).__name__} ({value!r:.80})")


def _iterable(name: str, value: object) -> Iterable:
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise ArgumentTypeError(f"{name}: expected an iterable, got {type(value).__name__} ({value!r:.80})")
    return value


def _hashes(hashes: Iterable[bytes]) -> list[bytes]:
    """Prefix hashes (bytes), validated before anything is changed."""
    out = list(_iterable("hashes", hashes))
    for h in out:
        check_type("hashes[i]", h, bytes)
    return out
