"""Prefetch (seed 001 §3.1): a first-order Markov model of which session follows which, and bringing a prompt's
blocks up from the tiers to the device before its request.

:class:`MarkovPredictor` counts, over the last ``window`` transitions out of each session, which session came
next; when the most likely one reaches ``threshold`` it is predicted. :func:`prefetch` reloads up to
``max_blocks`` of a prompt's blocks (through the tier manager's swap-in) and leaves them cached on the device,
outside the prefix hit statistics (a prefetch is not a request). The simulator (:mod:`memos_ref.tiering.simulate`)
and the session layer use the same predictor.

:func:`prefetch` asks the manager only for what :class:`PrefetchHost` declares, so this module never imports
:mod:`~memos_ref.tiering.manager` (which imports it).
"""

from __future__ import annotations

from collections import Counter, defaultdict, deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from memos_ref.errors import check_index, check_type

if TYPE_CHECKING:
    from memos_ref.paged.store import PagedKV

__all__ = ["MarkovPredictor", "PrefetchHost", "prefetch"]


class PrefetchHost(Protocol):
    """What :func:`prefetch` needs of the tier manager (:class:`~memos_ref.tiering.manager.TierManager` is the
    one): the device memory, its counters, and swap-in."""

    kv: PagedKV
    counts: Counter[str]

    def extend_prefix(
        self,
        token_ids: Sequence[int],
        cache_salt: str | None,
        device_blocks: Sequence[int],
        reloaded_out: list[int] | None = None,
    ) -> list[int]:
        """Blocks continuing ``device_blocks`` from the tiers (the caller owns one reference to each)."""
        ...


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


def prefetch(tm: PrefetchHost, token_ids: Sequence[int], cache_salt: str | None = None, max_blocks: int = 8) -> int:
    """Bring up to ``max_blocks`` of a prompt's blocks from ``tm``'s tiers to the device ahead of its request;
    they wait there as cached blocks. Returns how many were fetched by this call."""
    max_blocks = check_index("max_blocks", max_blocks, lo=0)
    if cache_salt is not None:
        check_type("cache_salt", cache_salt, str)
    kv = tm.kv
    t, pc = kv.spec.block_size, kv.prefix_cache
    token_ids = list(token_ids)
    device = pc.lookup(token_ids, cache_salt, count=False)  # a prefetch is not a request: no hit statistics
    reloaded: list[int] = []
    try:
        more = tm.extend_prefix(token_ids[: (len(device) + max_blocks) * t + 1], cache_salt, device, reloaded)
    except BaseException:
        kv.allocator.free_many(device)
        raise
    fetched = len(reloaded)
    kv.allocator.free_many(device + more)  # nobody holds them now: they wait as cached blocks
    tm.counts["prefetched_blocks"] += fetched
    return fetched
