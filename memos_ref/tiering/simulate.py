"""Eviction policies and prefetch on agent traces, simulated at the block level (no tensors): exact counts.

Each event of a trace (:mod:`memos_ref.traces`) that makes the model run — a user turn, a tool result, a
reply — is a *request* whose prompt is the session's whole token sequence so far. Its full blocks are looked up
by prefix hash, in order, as the engine does: a block on the device is a hit; a block in the tier below is
swapped in (a hit too: no recompute, but bytes move); the first block found nowhere ends the prefix, and it and
every block after it are recomputed. New blocks enter the device; when it is full, the policy picks the victim,
which moves down to the tier (unbounded here, so the policies are compared on what they keep close). Without a
tier (``tier=False``) a victim is simply lost.

Token contents are synthetic but deterministic (bytes of the trace's text; generated replies are pseudo-tokens
seeded by the session and event), so every figure is exact and repeatable.

Prefetch (seed 001 §3.1): a first-order Markov model of which session follows which, over the last ``window``
transitions of each session; when the most likely next session's probability reaches ``threshold``, up to
``max_blocks`` of its blocks are brought from the tier to the device right after the current request. Counted:
blocks prefetched, how many were then used (hits that would otherwise have been swap-ins on the critical path),
and how many were fetched for nothing (evicted or never used).
"""

from __future__ import annotations

import random
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field, replace
from typing import Any

from memos_ref.errors import check_index, check_type
from memos_ref.paged.prefix import block_hashes
from memos_ref.tiering.policies import BlockHistory, priority_function
from memos_ref.traces import SYSTEM_PROMPTS, TraceEvent, make_trace

__all__ = ["MarkovPredictor", "Request", "interleaved_trace", "requests_from_trace", "simulate"]


@dataclass
class Request:
    t: float
    session: str
    token_ids: list[int]
    kinds: list[str] = field(default_factory=list)  # per full block: system, tools, turn


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


def _encode(text: str) -> list[int]:
    return list(text.encode())


def requests_from_trace(events: list[TraceEvent], seed: int = 0, block_size: int = 16) -> list[Request]:
    """The model-running requests of a trace, each with its session's whole token sequence so far."""
    check_type("events", events, list)
    check_type("seed", seed, int)
    block_size = check_index("block_size", block_size, lo=1)
    rng = random.Random(seed)
    tokens: dict[str, list[int]] = {}
    prefix_len: dict[str, tuple[int, int]] = {}  # system end, tools end
    out: list[Request] = []
    for e in events:
        if e.kind == "open":
            name, version = e.system.split("@", 1)
            system = [1, *_encode(SYSTEM_PROMPTS[(name, version)])]
            tools = _encode("\n".join(sorted(e.tools))) if e.tools else []
            tokens[e.session] = system + tools
            prefix_len[e.session] = (len(system), len(system) + len(tools))
        elif e.kind == "fork":
            tokens[e.session] = list(tokens[e.parent])
            prefix_len[e.session] = prefix_len[e.parent]
        elif e.kind in ("user", "tool_result"):
            tokens[e.session] += _encode(e.text)
            out.append(Request(e.t, e.session, list(tokens[e.session])))
        elif e.kind == "generate":
            out.append(Request(e.t, e.session, list(tokens[e.session])))
            tokens[e.session] += [rng.randrange(256) for _ in range(e.max_new_tokens)]
        elif e.kind == "compact":
            keep = prefix_len[e.session][1]
            tokens[e.session] = tokens[e.session][:keep] + _encode(e.text)
        elif e.kind == "close":
            tokens.pop(e.session, None)
    for r in out:
        sys_end, tools_end = prefix_len.get(r.session, (0, 0))
        r.kinds = []
        for i in range(len(r.token_ids) // block_size):
            last = (i + 1) * block_size - 1
            r.kinds.append("system" if last < sys_end else "tools" if last < tools_end else "turn")
    return out


class MarkovPredictor:
    """Which session comes next: transition counts over the last ``window`` transitions out of each session."""

    def __init__(self, window: int = 5, threshold: float = 0.6) -> None:
        self.window, self.threshold = window, threshold
        self.transitions: dict[str, deque[str]] = defaultdict(lambda: deque(maxlen=window))
        self.last: str | None = None

    def observe(self, session: str) -> None:
        if self.last is not None and self.last != session:
            self.transitions[self.last].append(session)
        self.last = session

    def predict(self, session: str) -> str | None:
        """The likely next session after ``session``, if its probability reaches the threshold."""
        seen = self.transitions.get(session)
        if not seen:
            return None
        nxt, count = Counter(seen).most_common(1)[0]
        return nxt if count / len(seen) >= self.threshold else None


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
        hashes = block_hashes(r.token_ids[: (len(r.token_ids) // block_size) * block_size], block_size)
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
