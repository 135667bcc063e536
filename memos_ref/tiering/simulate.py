"""Eviction policies and prefetch on agent traces, simulated at the block level (no tensors): exact counts.

Each event of a trace (:mod:`memos_ref.traces`) that makes the model run — a user turn, a tool result, a
reply — is a *request* whose prompt is the session's whole token sequence so far. Its full blocks are looked up
by prefix hash, in order, as the engine does: a block on the device is a hit; a block in the tier below is
swapped in (a hit too: no recompute, but bytes move); the first block found nowhere ends the prefix, and it and
every block after it are recomputed. New blocks enter the device; when it is full, the policy picks the victim,
which moves down to the tier (unbounded here, so the policies are compared on what they keep close). Without a
tier (``tier=False``) a victim is simply lost.

A block's reference history (:class:`~memos_ref.tiering.policies.BlockHistory`) outlives its eviction for
``retained_period`` clock units after its last use (LRU-K's *retained information period*, O'Neil, O'Neil and
Weikum 1993; default: forever), so a block that comes back resumes its history: without it LRU-2 sees every
returning block as referenced once, and cannot tell a hot block from a scan (``retained_period=0`` shows that).
Policies that look only at the last use (``lru``, ``priority``) are unaffected by it.

:func:`scan_trace` is the classic case LRU-K was made for: a small hot working set interleaved with one-time
scans larger than the device; LRU lets each scan flush the hot set, LRU-2 keeps it.

Token contents are the sessions' own (:class:`~memos_ref.session.SessionLayout`: BOS, then per segment a marker
and the text's bytes, as a real :class:`~memos_ref.session.SessionManager` session on the shipped model holds
them, so the block hashes match); generated replies are pseudo-tokens from a seeded generator, so every figure is
exact and repeatable.

Prefetch (seed 001 §3.1): a first-order Markov model of which session follows which, over the last ``window``
transitions of each session; when the most likely next session's probability reaches ``threshold``, up to
``max_blocks`` of its blocks are brought from the tier to the device right after the current request. Counted:
blocks prefetched, how many were then used (hits that would otherwise have been swap-ins on the critical path),
and how many were fetched for nothing (evicted or never used).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from memos_ref.errors import ArgumentTypeError, ConfigError, check_index, check_type
from memos_ref.paged.prefix import block_hashes
from memos_ref.tiering.policies import BlockHistory, priority_function
from memos_ref.tiering.prefetch import MarkovPredictor
from memos_ref.traces import TraceEvent, make_trace

__all__ = [
    "MarkovPredictor",
    "Request",
    "TraceLayout",
    "interleaved_trace",
    "requests_from_trace",
    "scan_trace",
    "set_default_layout",
    "simulate",
]


@dataclass
class Request:
    t: float
    session: str
    token_ids: list[int]
    kinds: list[str] = field(default_factory=list)  # per full block: system, tools, turn
    hashes: list[bytes] = field(default_factory=list)  # per full block, when known (hashed once)


def interleaved_trace(name: str, copies: int = 4, scale: float = 1.0) -> list[TraceEvent]:
    """``copies`` independent users of trace ``name`` (seeds 0..copies-1) active at once: their events merged
    by time. A single shipped trace runs its sessions one after another; caches only feel pressure, and
    policies only differ, when users overlap."""
    check_type("name", name, str)
    copies = check_index("copies", copies, lo=1)
    check_type("scale", scale, (int, float))
    events = []
    for c in range(copies):
        for e in make_trace(name, seed=c, scale=scale):
            parent = f"{c}:{e.parent}" if e.parent else None
            events.append(replace(e, session=f"{c}:{e.session}", parent=parent))
    return sorted(events, key=lambda e: e.t)


class TraceLayout(Protocol):
    """What turns a trace into prompts: the session layer's :class:`~memos_ref.session.SessionLayout` (declared
    here, below it, so the simulator never imports sessions)."""

    def trace_prompts(
        self, events: Sequence[TraceEvent], seed: int = 0, block_size: int = 16
    ) -> Iterable[tuple[float, str, list[int], list[str]]]: ...


_default_layout: TraceLayout | None = None


def set_default_layout(layout: TraceLayout) -> None:
    """The layout :func:`requests_from_trace` uses when given none (``memos_ref.session`` sets its own on import)."""
    global _default_layout
    if not callable(getattr(layout, "trace_prompts", None)):
        raise ArgumentTypeError(f"layout: expected an object with trace_prompts(), got {type(layout).__name__}")
    _default_layout = layout


def requests_from_trace(
    events: list[TraceEvent],
    seed: int = 0,
    block_size: int = 16,
    *,
    layout: TraceLayout | None = None,
    fingerprint: str = "",
) -> list[Request]:
    """The model-running requests of a trace, each with its session's whole token sequence so far, laid out as
    real sessions lay them out (``layout``: default the session layer's), its per-block labels and its block
    hashes (computed once, here, with ``fingerprint``: a real session's prefix cache keys the same blocks the
    same way)."""
    check_type("events", events, list)
    check_type("seed", seed, int)
    block_size = check_index("block_size", block_size, lo=1)
    check_type("fingerprint", fingerprint, str)
    if layout is None:
        if _default_layout is None:
            import_hint = "import memos_ref.session (it registers the sessions' layout) or pass layout="
            raise ConfigError(f"no session layout to replay the trace with: {import_hint}")
        layout = _default_layout
    out = []
    for t, session, token_ids, kinds in layout.trace_prompts(events, seed, block_size):
        hashes = block_hashes(token_ids, block_size, fingerprint=fingerprint)
        out.append(Request(t, session, token_ids, kinds, hashes))
    return out


def scan_trace(
    *,
    hot: int = 8,
    hot_blocks: int = 2,
    scan_per_hot: int = 3,
    scan_blocks: int = 2,
    rounds: int = 12,
    block_size: int = 16,
    seed: int = 0,
) -> list[Request]:
    """A scan-heavy trace: ``hot`` prompts of ``hot_blocks`` blocks (the hot working set, read once per round in
    a seeded order), each followed by ``scan_per_hot`` one-time prompts of ``scan_blocks`` blocks that never come
    back (a scan: ``hot · scan_per_hot · scan_blocks`` blocks per round, larger than a device that holds the hot
    set). Token ids are drawn from ``random.Random(seed)`` (distinct contents, so distinct block hashes); one
    request per clock tick. Deterministic: the same arguments give the same requests."""
    for name, value in (("hot", hot), ("hot_blocks", hot_blocks), ("scan_blocks", scan_blocks), ("rounds", rounds)):
        check_index(name, value, lo=1)
    scan_per_hot = check_index("scan_per_hot", scan_per_hot, lo=0)
    block_size = check_index("block_size", block_size, lo=1)
    check_type("seed", seed, int)
    rng = random.Random(seed)

    def prompt(blocks: int) -> list[int]:
        return [rng.randrange(1, 1 << 16) for _ in range(blocks * block_size)]

    hot_prompts = [prompt(hot_blocks) for _ in range(hot)]
    out: list[Request] = []

    def add(session: str, ids: list[int]) -> None:
        out.append(Request(float(len(out)), session, ids, ["turn"] * (len(ids) // block_size)))
        out[-1].hashes = block_hashes(ids, block_size)

    for _ in range(rounds):
        for i in rng.sample(range(hot), hot):
            add(f"hot{i}", hot_prompts[i])
            for _ in range(scan_per_hot):
                add(f"scan{len(out)}", prompt(scan_blocks))
    return out


def simulate(
    requests: list[Request],
    *,
    device_blocks: int,
    policy: str = "lru",
    block_size: int = 16,
    bytes_per_block: int = 32768,
    tier: bool = True,
    prefetch: MarkovPredictor | None = None,
    prefetch_max_blocks: int = 8,
    retained_period: float = math.inf,
) -> dict[str, Any]:
    """Replay ``requests`` through a device of ``device_blocks`` blocks and (optionally) an unbounded tier.

    ``retained_period``: how long (clock units, after its last use) an evicted block's reference history is
    kept, so the policy sees it again when the block returns; ``math.inf`` (default) keeps it forever, ``0``
    forgets it at eviction."""
    check_type("requests", requests, list)
    device_blocks = check_index("device_blocks", device_blocks, lo=1)
    block_size = check_index("block_size", block_size, lo=1)
    bytes_per_block = check_index("bytes_per_block", bytes_per_block, lo=1)
    check_type("tier", tier, bool)
    if prefetch is not None:
        check_type("prefetch", prefetch, MarkovPredictor)
    prefetch_max_blocks = check_index("prefetch_max_blocks", prefetch_max_blocks, lo=0)
    check_type("retained_period", retained_period, (int, float))
    if not retained_period >= 0:  # NaN fails too
        raise ConfigError(f"retained_period must be >= 0 (clock units; math.inf = forever), got {retained_period!r}")
    score = priority_function(policy)
    device: dict[bytes, BlockHistory] = {}
    retained: dict[bytes, BlockHistory] = {}  # histories of evicted blocks (the retained information period)
    lower: set[bytes] = set()
    prefetched: set[bytes] = set()
    session_blocks: dict[str, list[bytes]] = {}
    kinds: dict[bytes, str] = {}
    c: Counter[str] = Counter()

    def evict(protect: set[bytes], now: float) -> None:
        victims = [h for h in device if h not in protect] or list(device)  # a prompt longer than the device
        victim = min(victims, key=lambda h: score(device[h], now))
        retained[victim] = device.pop(victim)
        if victim in prefetched:
            prefetched.discard(victim)
            c["prefetched_unused"] += 1
        if tier and victim not in lower:
            lower.add(victim)
            c["swap_out_blocks"] += 1

    def admit(h: bytes, protect: set[bytes], now: float) -> None:
        if h in device:  # on the device after a miss earlier in the prompt: recomputed, but it takes no room
            device[h].touch(now)
            return
        while len(device) >= device_blocks:
            evict(protect, now)
        hist = retained.pop(h, None)
        if hist is None or now - hist.last >= retained_period:
            hist = BlockHistory(kind=kinds.get(h, "turn"))
        hist.touch(now)
        device[h] = hist

    for r in requests:
        now = r.t
        hashes = r.hashes
        if len(hashes) != len(r.token_ids) // block_size:  # not hashed yet, or for another block size
            hashes = block_hashes(r.token_ids, block_size)
        for h, kind in zip(hashes, r.kinds):
            kinds.setdefault(h, kind)
        protect: set[bytes] = set()
        missing = False
        for h in hashes:
            c["prompt_tokens"] += block_size
            if not missing and h in device:
                device[h].touch(now)
                c["device_hit_tokens"] += block_size
                if h in prefetched:
                    prefetched.discard(h)
                    c["prefetched_used"] += 1
            elif not missing and tier and h in lower:
                c["tier_hit_tokens"] += block_size
                c["swap_in_blocks"] += 1
                admit(h, protect, now)
            else:
                missing = True
                c["recomputed_tokens"] += block_size
                admit(h, protect, now)
            protect.add(h)
        session_blocks[r.session] = hashes
        if prefetch is not None:
            prefetch.observe(r.session)
            nxt = prefetch.predict(r.session)
            if nxt is not None and tier:
                fetched = 0
                for h in session_blocks.get(nxt, []):
                    if fetched >= prefetch_max_blocks:
                        break
                    if h in device or h not in lower:
                        continue
                    admit(h, set(hashes), now)
                    prefetched.add(h)
                    fetched += 1
                c["prefetched_blocks"] += fetched
    served = c["device_hit_tokens"] + c["tier_hit_tokens"]
    return {
        "policy": policy,
        "device_blocks": device_blocks,
        "tier": tier,
        "requests": len(requests),
        "prompt_tokens": c["prompt_tokens"],
        "hit_rate": served / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
        "device_hit_rate": c["device_hit_tokens"] / c["prompt_tokens"] if c["prompt_tokens"] else 0.0,
        "recomputed_tokens": c["recomputed_tokens"],
        "swap_in_blocks": c["swap_in_blocks"],
        "swap_out_blocks": c["swap_out_blocks"],
        "bytes_moved": (c["swap_in_blocks"] + c["swap_out_blocks"] + c["prefetched_blocks"]) * bytes_per_block,
        "prefetched_blocks": c["prefetched_blocks"],
        "prefetched_used": c["prefetched_used"],
        "prefetched_unused": c["prefetched_unused"],
    }
