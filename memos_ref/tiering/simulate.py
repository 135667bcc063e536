"""Eviction policies and prefetch on agent traces, simulated at the block level (no tensors): exact counts.

Each event of a trace (:mod:`memos_ref.traces`) that makes the model run — a user turn, a tool result, a
reply — is a *request* whose prompt is the session's whole token sequence so far. Its full blocks are looked up
by prefix hash, in order, as the engine does: a block on the device is a hit; a block in the tier below is
swapped in (a hit too: no recompute, but bytes move); the first block found nowhere ends the prefix, and it and
every block after it are recomputed. New blocks enter the device; when it is full, the policy picks the victim,
which moves down to the tier (unbounded here, so the policies are compared on what they keep close). Without a
tier (``tier=False``) a victim is simply lost.

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
) -> dict[str, Any]:
    """Replay ``requests`` through a device of ``device_blocks`` blocks and (optionally) an unbounded tier."""
    check_type("requests", requests, list)
    device_blocks = check_index("device_blocks", device_blocks, lo=1)
    block_size = check_index("block_size", block_size, lo=1)
    bytes_per_block = check_index("bytes_per_block", bytes_per_block, lo=1)
    check_type("tier", tier, bool)
    if prefetch is not None:
        check_type("prefetch", prefetch, MarkovPredictor)
    prefetch_max_blocks = check_index("prefetch_max_blocks", prefetch_max_blocks, lo=0)
    score = priority_function(policy)
    device: dict[bytes, BlockHistory] = {}
    lower: set[bytes] = set()
    prefetched: set[bytes] = set()
    session_blocks: dict[str, list[bytes]] = {}
    kinds: dict[bytes, str] = {}
    c: Counter[str] = Counter()

    def evict(protect: set[bytes], now: float) -> None:
        victims = [h for h in device if h not in protect] or list(device)  # a prompt longer than the device
        victim = min(victims, key=lambda h: score(device[h], now))
        del device[victim]
        if victim in prefetched:
            prefetched.discard(victim)
            c["prefetched_unused"] += 1
        if tier and victim not in lower:
            lower.add(victim)
            c["swap_out_blocks"] += 1

    def admit(h: bytes, protect: set[bytes], now: float) -> None:
        while len(device) >= device_blocks:
            evict(protect, now)
        device[h] = BlockHistory(kind=kinds.get(h, "turn"))
        device[h].touch(now)

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
