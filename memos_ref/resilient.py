"""ResilientRedis: a redis-py client that fails fast and degrades instead of blocking the caller.

Shared by the short-term memory store's Redis backend and the Redis KV tier. Every call has a socket timeout
(default 50 ms) and no retries (redis-py 8 retries three times by default). A lost connection warns once
(:class:`~memos_ref.errors.BackendDegradedWarning`), counts an error, and for ``retry_after`` seconds every
call returns its fallback without touching the network; the next call after that tries again, and a success
ends degraded mode (``reconnects``).
"""

from __future__ import annotations

import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

from memos_ref.errors import BackendDegradedWarning, BackendUnavailableError, ConfigError

__all__ = ["ResilientRedis"]


class ResilientRedis:
    """A redis-py client plus degraded mode.

    Args:
        url: ``redis://host:port/db`` (ignored when ``client`` is given).
        client: an existing ``redis.Redis``.
        timeout: socket connect and read timeout, seconds — the longest one call can block.
        retry_after: seconds a lost server is left alone before the next attempt.
        clock: time source for ``retry_after`` (inject one in tests).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        client: Any = None,
        timeout: float = 0.05,
        retry_after: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if timeout <= 0 or retry_after < 0:
            raise ConfigError(f"timeout must be positive and retry_after non-negative, got {timeout}, {retry_after}")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - redis is a dependency
            raise BackendUnavailableError("redis-py is not installed: pip install redis") from exc
        self.errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self.url, self.retry_after, self.clock = url, retry_after, clock
        self.client = client or redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
        )
        self.degraded = False
        self._down_until: float | None = None
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def is_down(self) -> bool:
        """True while inside ``retry_after`` of a failure (calls answer their fallback)."""
        return self._down_until is not None and self.clock() < self._down_until

    def call(self, fn: Callable[[], Any], fallback: Any) -> Any:
        """Run one Redis call; on a lost connection enter degraded mode and return ``fallback``."""
        if self.is_down():
            self.count("degraded_ops")
            return fallback
        try:
            result = fn()
        except self.errors as exc:
            self._down_until = self.clock() + self.retry_after
            self.count("errors")
            self.count("degraded_ops")
            if not self.degraded:
                self.degraded = True
                warnings.warn(
                    f"Redis at {self.url} is unreachable ({type(exc).__name__}: {exc}); answering reads as misses "
                    f"and dropping writes, retrying in {self.retry_after} s",
                    BackendDegradedWarning,
                    stacklevel=4,
                )
            return fallback
        if self.degraded:
            self.degraded = False
            self._down_until = None
            self.count("reconnects")
        return result
