"""TierManager: watermarks, pins, labels, the step that enforces them, stats, and the thread that drives it.

The tier key of a block is its prefix hash (chained over the model fingerprint, the tenant salt and every
token before it — :mod:`memos_ref.paged.prefix`), so a block stored in any tier is found again by the same
lookup that finds it on the device, by this process or by another one sharing a Redis tier (LMCache's and
SGLang HiCache's design). What it does:

* **Swap-out** (:meth:`step`): when device utilization (active + cached blocks over all blocks) passes the
  high watermark (0.85), cached blocks — held by no live sequence — are written to the first tier that takes
  them and freed on the device, lowest policy priority first, until utilization falls below the low
  watermark (0.60) (seed 000 §5.2). Blocks used less than ``min_residency_s`` ago (30 s) and pinned blocks
  (current system prompts) are never candidates. If that is not enough, the least recently active of the
  holders the layer above lists (a :class:`PressureRelief` registered with :meth:`TierManager.set_relief`: the
  session layer lists its sessions) that were idle for the minimum residency are suspended — their blocks become
  cached — and it tries again.
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

The parts live beside it: :mod:`~memos_ref.tiering.swap` (swap-out, write-back, swap-in),
:mod:`~memos_ref.tiering.costs` (the reload-or-recompute cost model), :mod:`~memos_ref.tiering.prefetch` (the Markov
predictor and prefetch).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, check_index, check_type
from memos_ref.paged.allocator import EVICTED, BlockEvent
from memos_ref.paged.store import PagedKV
from memos_ref.tiering import prefetch as _prefetch
from memos_ref.tiering import swap
from memos_ref.tiering.costs import CostModel
from memos_ref.tiering.policies import BlockHistory, priority_function
from memos_ref.tiering.store import TierStore

__all__ = ["PressureRelief", "Suspendable", "TierManager"]


@runtime_checkable
class Suspendable(Protocol):
    """Something holding device blocks that can let go of them (a session): its last use, and ``suspend`` that
    releases its blocks (they stay cached, so they can move to a tier) and returns how many it released — 0 when
    ``blocking`` is False and it is busy."""

    last_active: float

    def suspend(self, blocking: bool = True) -> int: ...


@runtime_checkable
class PressureRelief(Protocol):
    """What the layer above offers when swapping cached blocks out is not enough (declared here, so tiering never
    calls up into sessions): the holders of device blocks that may be suspended. Which of them are suspended, and
    in what order, is tiering's residency policy (:meth:`TierManager.relieve`)."""

    def suspendable(self) -> list[Suspendable]: ...


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
        if kv.pool.quantized:
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
        self.relief: PressureRelief | None = None  # set_relief(): the layer above frees blocks under pressure
        self.costs = CostModel()  # reload-or-recompute: calibrate(), or assign a CostModel built from figures
        self._lock = threading.RLock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.last_error: str | None = None
        self._events_lock = threading.Lock()
        # write-back on eviction: the allocator drains this before the allocation that evicted returns, so the
        # block still holds its bytes; the event carries the hash the block had
        self._evictions = kv.allocator.subscribe({EVICTED}, handler=self._on_evicted)
        kv.tier_manager = self

    def set_relief(self, relief: PressureRelief | None) -> None:
        """Register what :meth:`step` asks for blocks when swapping out is not enough (None: nothing)."""
        if relief is not None and not isinstance(relief, PressureRelief):
            raise ArgumentTypeError(
                f"relief: expected an object with suspendable() -> list of holders, got {type(relief).__name__}"
            )
        self.relief = relief

    def relieve(self, blocks_wanted: int) -> int:
        """Suspend the least recently active holders the relief lists that were idle for at least the minimum
        residency, until about ``blocks_wanted`` blocks were released; returns how many were."""
        if self.relief is None:
            return 0
        now = self.clock()
        idle = [h for h in self.relief.suspendable() if now - h.last_active >= self.min_residency]
        released = 0
        for holder in sorted(idle, key=lambda h: h.last_active):
            if released >= blocks_wanted:
                break
            released += holder.suspend(blocking=False)
        return released

    def _on_evicted(self, event: BlockEvent) -> None:
        try:
            swap.write_back(self, event.block, event.block_hash)
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

    def note_swap(self, n: int, now: float) -> None:
        """Record ``n`` blocks moved at ``now`` (for :meth:`swap_rate`)."""
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

    # ------------------------------------------------------------------ step
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
            report["swapped_out"] = swap.swap_out_cached(self, target, now)
            held = a.num_active + a.num_cached
            if held > target and self.relief is not None:
                report["suspended_blocks"] = self.relieve(held - target)
                self.counts["pressure_calls"] += 1
                report["swapped_out"] += swap.swap_out_cached(self, target, now)
            report["utilization_after"] = self.utilization()
            self.counts["steps_over_watermark"] += 1
            return report

    # ------------------------------------------------------------------ swap-in, prefetch, costs
    def extend_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        device_blocks: Sequence[int],
        reloaded_out: list[int] | None = None,
    ) -> list[int]:
        """Blocks that continue ``device_blocks`` (a device prefix lookup's result) from the tiers, interleaved
        with blocks still on the device further along; the caller owns one reference to each
        (:func:`memos_ref.tiering.swap.extend_prefix`)."""
        return swap.extend_prefix(self, token_ids, cache_salt, device_blocks, reloaded_out)

    def prefetch(self, token_ids: Sequence[int], cache_salt: str | None = None, max_blocks: int = 8) -> int:
        """Bring up to ``max_blocks`` of a prompt's blocks from the tiers to the device ahead of its request
        (seed 001 §3.1); they wait there as cached blocks. Returns how many were fetched by this call."""
        return _prefetch.prefetch(self, token_ids, cache_salt, max_blocks)

    def recompute_seconds(self, start: int, stop: int) -> float | None:
        """Estimated time to prefill positions ``start..stop`` (from :meth:`calibrate`), or None."""
        return self.costs.recompute_seconds(start, stop)

    def reload_seconds(self, tier: str, blocks: int) -> float | None:
        """Estimated time to bring ``blocks`` back from ``tier`` (measured per block), or None."""
        return self.costs.reload_seconds(self.store, tier, blocks, self.kv.spec.bytes_per_block)

    def should_reload_run(self, tier: str, blocks: int, start_block: int, stop_block: int) -> bool:
        """Reload ``blocks`` blocks from ``tier``, or recompute every token from the first missing block on?"""
        if self.reload_mode != "auto":
            return self.reload_mode == "always"
        t = self.kv.spec.block_size
        return self.costs.should_reload(
            self.store, tier, blocks, start_block * t, stop_block * t, self.kv.spec.bytes_per_block
        )

    def calibrate(self, model: Any, lengths: Sequence[int] = (32, 128, 512), repeats: int = 3) -> dict[str, Any]:
        """Measure prefill time against context length (fit ``a + b·n + c·n²``) and the time to reload one
        block from each tier; returns the measurements (``break_even_tokens`` uses them)."""
        return self.costs.calibrate(model, self.kv, self.store, lengths, repeats)

    def break_even_tokens(self, tier: str, max_tokens: int = 1 << 17) -> int | None:
        """The shortest context (a multiple of the block size) from which reloading it from ``tier`` is faster
        than recomputing it, by the measured costs; None if recomputing always wins up to ``max_tokens``."""
        spec = self.kv.spec
        return self.costs.break_even_tokens(self.store, tier, spec.block_size, spec.bytes_per_block, max_tokens)

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
