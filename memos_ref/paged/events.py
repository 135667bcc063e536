"""Block events: the kinds, the event, a subscriber's queue, and the hub that routes events to queues.

Instead of hook chains, every change of block state a consumer may care about is appended as a
:class:`BlockEvent` (``stored``, ``cached``, ``evicted``, ``removed``, ``freed``, ``allocated``) to the queue of
each subscriber that asked for that kind (:meth:`~memos_ref.paged.allocator.BlockAllocator.subscribe`). A
subscription with a ``handler`` is drained by the allocator itself at the end of the operation that produced the
events, before it returns (so a write-back sees an evicted block's bytes before the caller overwrites them, and a
quantized pool releases a staging slot before the block is handed out again); one without is drained by its
consumer (:meth:`EventQueue.drain`). Nothing is recorded for a kind nobody subscribed to.

:class:`EventHub` holds the subscriptions of one allocator and is one of its parts: the allocator produces the
events (it alone knows block state) and calls :meth:`EventHub.emit` / :meth:`EventHub.dispatch`; the hub never
reads block state. Its :attr:`~EventHub.routes` and :attr:`~EventHub.pending` are shared with the allocator and
only ever changed in place, so the allocator's hot paths test them as cheaply as attributes of its own.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable
from typing import NamedTuple

from memos_ref.errors import InvalidArgumentError, check_index

__all__ = [
    "ALLOCATED",
    "CACHED",
    "EVENT_KINDS",
    "EVICTED",
    "FREED",
    "REMOVED",
    "STORED",
    "BlockEvent",
    "EventHub",
    "EventQueue",
    "block_handler",
]

#: A full block entered the prefix-hash index (``block_hash`` set).
STORED = "stored"
#: The last holder let go of a cacheable block: it stays, evictable, on the LRU list.
CACHED = "cached"
#: A cached block was taken back for a new allocation (``block_hash``: the hash it held, or None).
EVICTED = "evicted"
#: A block's hash left the index without an eviction (:meth:`~memos_ref.paged.allocator.BlockAllocator.uncache`).
REMOVED = "removed"
#: A block returned to the free list (not after an eviction: that block is handed out at once).
FREED = "freed"
#: One :meth:`~memos_ref.paged.allocator.BlockAllocator.allocate` call: ``count`` blocks in ``seconds``.
ALLOCATED = "allocated"
EVENT_KINDS = frozenset({STORED, CACHED, EVICTED, REMOVED, FREED, ALLOCATED})


class BlockEvent(NamedTuple):
    """One change of block state. ``block`` is -1 for an ``allocated`` event (``count`` says how many)."""

    kind: str
    block: int
    block_hash: bytes | None = None
    count: int = 1
    seconds: float = 0.0


class EventQueue:
    """A consumer's queue of :class:`BlockEvent` (from :meth:`~memos_ref.paged.allocator.BlockAllocator.subscribe`).

    Without a handler the consumer calls :meth:`drain` when it likes (``maxlen`` bounds what waits; the oldest
    events are dropped and counted in :attr:`dropped`). With a handler the allocator drains it at the end of each
    operation. :meth:`close` ends the subscription.
    """

    def __init__(
        self,
        owner: EventHub,
        kinds: frozenset[str],
        handler: Callable[[BlockEvent], None] | None,
        maxlen: int | None,
    ) -> None:
        self.owner, self.kinds, self.handler = owner, kinds, handler
        self._items: deque[BlockEvent] = deque()
        self.maxlen = maxlen
        self.dropped = 0

    def _put(self, event: BlockEvent) -> None:
        if self.maxlen is not None and len(self._items) >= self.maxlen:
            self._items.popleft()
            self.dropped += 1
        self._items.append(event)

    def drain(self) -> list[BlockEvent]:
        """Every event waiting, oldest first; the queue is left empty."""
        with self.owner.lock:
            out = list(self._items)
            self._items.clear()
            return out

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """Stop receiving events (idempotent)."""
        self.owner.unsubscribe(self)


class EventHub:
    """The subscriptions of one allocator: which queues want each kind, and the draining of handler queues.

    Args:
        lock: the owner's lock (re-entrant); every change of the subscriptions and every drain holds it.

    Attributes:
        routes: per kind, the queues that want it (``()`` when none: the producer then builds no event). One dict
            for the hub's life, updated in place.
        pending: non-empty while a handler queue holds events :meth:`dispatch` has not delivered. One list for the
            hub's life (a producer tests its truth after each operation).
    """

    def __init__(self, lock: threading.RLock) -> None:
        self.lock = lock
        self._subs: list[EventQueue] = []
        self.routes: dict[str, tuple[EventQueue, ...]] = {kind: () for kind in EVENT_KINDS}
        self._handled: list[EventQueue] = []
        self.pending: list[bool] = []
        self._dispatching = False

    def subscribe(
        self,
        kinds: Iterable[str],
        handler: Callable[[BlockEvent], None] | None,
        maxlen: int | None,
    ) -> EventQueue:
        """A new queue for ``kinds`` (validated first: :class:`InvalidArgumentError` for an unknown kind, a
        handler that is not callable, a ``maxlen`` below 1)."""
        if isinstance(kinds, str):
            kinds = {kinds}
        kinds = frozenset(kinds)
        unknown = kinds - EVENT_KINDS
        if unknown:
            raise InvalidArgumentError(f"unknown event kinds {sorted(unknown)}; expected some of {sorted(EVENT_KINDS)}")
        if handler is not None and not callable(handler):
            raise InvalidArgumentError(f"handler must be callable, got {type(handler).__name__}")
        if maxlen is not None:
            maxlen = check_index("maxlen", maxlen, lo=1)
        with self.lock:
            queue = EventQueue(self, kinds, handler, maxlen)
            self._subs.append(queue)
            self._reroute()
            return queue

    def unsubscribe(self, queue: EventQueue) -> None:
        """End a subscription (its waiting events stay readable with ``drain``; idempotent)."""
        with self.lock:
            if queue in self._subs:
                self._subs.remove(queue)
                self._reroute()

    def _reroute(self) -> None:
        self.routes.update({kind: tuple(q for q in self._subs if kind in q.kinds) for kind in EVENT_KINDS})
        self._handled = [q for q in self._subs if q.handler is not None]

    def emit(self, routes: tuple[EventQueue, ...], event: BlockEvent) -> None:
        """Queue ``event`` on ``routes`` (``routes[event.kind]``, which the producer has already looked up)."""
        for queue in routes:
            queue._put(event)
            if queue.handler is not None and not self.pending:
                self.pending.append(True)

    def dispatch(self) -> None:
        """Drain every handler queue into its handler (called by the producer at the end of each operation, under
        the lock). A handler's own allocator call does not dispatch again: this loop delivers its events too."""
        if self._dispatching:
            return
        self._dispatching = True
        try:
            while self.pending:
                self.pending.clear()
                for queue in self._handled:
                    items = queue._items
                    while items:
                        queue.handler(items.popleft())  # type: ignore[misc]
        finally:
            self._dispatching = False


def block_handler(fn: Callable[[int], None]) -> Callable[[BlockEvent], None]:
    """Adapt an old-style ``fn(block)`` hook to an event handler."""

    def handler(event: BlockEvent) -> None:
        fn(event.block)

    return handler
