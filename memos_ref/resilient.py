"""ResilientRedis: a redis-py client that fails fast and degrades instead of blocking or failing the caller.

Shared by the short-term memory store's Redis backend and the Redis KV tier. Every call has a socket timeout
(default :data:`DEFAULT_TIMEOUT_S`, 0.5 s) and no retries (redis-py 8 retries three times by default). What a
failed call does depends on what failed:

* **The connection** (refused, reset, timed out): the call answers its fallback (a read is a miss, a write is
  dropped) and counts ``errors`` and ``errors_refused`` / ``errors_timeout`` / ``errors_connection``. After
  ``failure_threshold`` consecutive connection failures (default 3) — or at once when the connection is
  refused (nothing listens: a dead server, never a symptom of load) — the client enters *degraded mode*: it
  warns once (:class:`~memos_ref.errors.BackendDegradedWarning`), and for ``retry_after`` seconds every call answers its
  fallback without touching the network; the next call after that tries again, and a success ends degraded
  mode (``reconnects``). One slow reply under load therefore drops one call, not a second of traffic.
* **The server's answer** (any other ``redis.RedisError``: ``WRONGTYPE`` for a value of another type planted at
  a key, ``OOM command not allowed`` from a full server, ``READONLY`` from a replica, ``MOVED``/``ASK``,
  ``CLUSTERDOWN``, ``TRYAGAIN`` from a cluster node, ...) and what a ``RedisCluster`` client raises on its own
  (``redis.exceptions.RedisClusterException``, which is not a ``RedisError``: ``SlotNotCoveredError`` while a
  failover or migration leaves a slot without a node; ``ClusterError`` when its redirections ran out): the call
  answers its fallback and counts ``errors`` and ``errors_<kind>`` (``errors_wrongtype``, ``errors_oom``,
  ``errors_readonly``, ``errors_moved``, ``errors_slotnotcovered``, ``errors_cluster``, ...). The connection is
  fine, so it never degrades.

Nothing a Redis server answers raises into the caller.

**One public call, one timeout.** A backend wraps each public call (``get``, ``update``, ``stats``, ...) in
:meth:`ResilientRedis.operation`. Inside it, the first connection failure ends the call's network traffic: every
later Redis call of the same operation answers its fallback at once (counted ``skipped_ops``). So against a
hung server (SIGSTOP, a dead network path) a call that makes several round trips — ``stats`` (SCAN, then
INFO), the tier's ``stats`` (SCAN, then STRLEN), ``get_or_compute`` (a read, then a write) — returns after about
one ``timeout``, not one per round trip. The time a caller's own code takes (``get_or_compute``'s ``compute``)
is not counted. redis-py is built with no retries (``Retry(NoBackoff(), 0)``), a connect timeout equal to the
read timeout and a non-blocking connection pool (a thread never waits for another's connection), so one Redis
call blocks at most ``timeout``.
"""

from __future__ import annotations

import math
import numbers
import re
import threading
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from memos_ref.errors import (
    ArgumentTypeError,
    BackendDegradedWarning,
    BackendUnavailableError,
    ConfigError,
    InvalidArgumentError,
    check_type,
)

__all__ = [
    "DEFAULT_FAILURE_THRESHOLD",
    "DEFAULT_TIMEOUT_S",
    "MAX_TTL_S",
    "ResilientRedis",
    "error_kind",
    "ttl_to_px",
    "validate_ttl",
]

#: Default socket timeout, seconds: long enough that a loaded machine's scheduling delays do not read as a dead
#: server, short enough that a dead one costs at most this per call until degraded mode starts.
DEFAULT_TIMEOUT_S = 0.5
#: Consecutive connection failures before degraded mode (1 = the first failure degrades).
DEFAULT_FAILURE_THRESHOLD = 3

#: The longest TTL accepted, seconds: 2**53 ms (exact in a float, far inside Redis's 64-bit millisecond range).
MAX_TTL_S = 2**53 / 1000

_CODE = re.compile(r"[A-Z][A-Z_-]{1,31}")
#: redis-py's exception classes for server replies, by the reply's error code (lower case)
_KINDS = {
    "ReadOnlyError": "readonly",
    "OutOfMemoryError": "oom",
    "MovedError": "moved",
    "AskError": "ask",
    "TryAgainError": "tryagain",
    "MasterDownError": "masterdown",
    "ClusterDownError": "clusterdown",
    "ClusterCrossSlotError": "crossslot",
    "NoPermissionError": "noperm",
    "NoScriptError": "noscript",
    "ExecAbortError": "execabort",
    "BusyLoadingError": "loading",
    # raised by redis-py's RedisCluster client itself, not by a server reply
    "SlotNotCoveredError": "slotnotcovered",
    "CrossSlotTransactionError": "crossslot",
    "InvalidPipelineStack": "pipelinestack",
    "ClusterError": "cluster",
    "RedisClusterException": "cluster",
}


def error_kind(exc: BaseException) -> str:
    """A short, bounded label for a Redis error: the server's error code (``wrongtype``, ``oom``,
    ``readonly``, ``moved``, ...) when the reply has one, else the exception's class name in lower case."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and _CODE.fullmatch(code):
        return code.lower().replace("-", "_")
    for cls in type(exc).__mro__:  # raised without a status code: the class says which reply it stands for
        if cls.__name__ in _KINDS:
            return _KINDS[cls.__name__]
    first = str(exc).split(" ", 1)[0] if exc.args else ""
    return (first if _CODE.fullmatch(first) else type(exc).__name__).lower().replace("-", "_")


def validate_ttl(ttl: object, name: str = "ttl") -> float | None:
    """A TTL in seconds: ``None`` (never expires) or a finite number in ``(0, MAX_TTL_S]``.

    The one check of every TTL, on every backend (in-process memory store, Redis memory store, Redis tier), so a
    TTL that is ``inf``, NaN, zero, negative or beyond Redis's range fails the same way everywhere: with
    :class:`~memos_ref.errors.InvalidArgumentError` (:class:`~memos_ref.errors.ArgumentTypeError` for a
    non-number), before anything is stored.
    """
    if ttl is None:
        return None
    if isinstance(ttl, bool):  # a bool is an int to Python, never a number of seconds to a caller
        raise ArgumentTypeError(f"{name}: expected a number of seconds or None, got bool ({ttl!r})")
    check_type(name, ttl, numbers.Real)
    seconds = _as_float(ttl)
    if seconds is None or not (math.isfinite(seconds) and 0 < seconds <= MAX_TTL_S):
        raise InvalidArgumentError(
            f"{name} must be a finite number of seconds in (0, {MAX_TTL_S}], or None for no expiry; got {ttl!r:.80}"
        )
    return seconds


def _as_float(value: object) -> float | None:
    """``float(value)``, or None where it does not fit a float (an int like ``10**400``)."""
    try:
        return float(value)  # type: ignore[arg-type]
    except (OverflowError, ValueError, TypeError):
        return None


def ttl_to_px(ttl: float | None) -> int | None:
    """A validated TTL as Redis milliseconds (``PX``), at least 1; None for no expiry."""
    return None if ttl is None else max(1, min(round(ttl * 1000), 2**53))


def _refused(exc: BaseException) -> bool:
    """True when nothing listens at the address (a refused connection is never a symptom of load, unlike a
    timeout, so it degrades at once)."""
    seen = 0
    cur: BaseException | None = exc
    while cur is not None and seen < 8:
        if isinstance(cur, ConnectionRefusedError):
            return True
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    return False


def check_seconds(name: str, value: object, *, allow_zero: bool = False) -> float:
    """A configured duration in seconds as a float: finite and ``> 0`` (``>= 0`` with ``allow_zero``), else
    :class:`~memos_ref.errors.ConfigError` (:class:`~memos_ref.errors.ArgumentTypeError` for a non-number)."""
    check_type(name, value, (int, float))
    seconds = _as_float(value)
    ok = seconds is not None and math.isfinite(seconds) and (seconds >= 0 if allow_zero else seconds > 0)
    if not ok:
        bound = "finite and >= 0" if allow_zero else "finite and > 0"
        raise ConfigError(f"{name} must be {bound} seconds, got {value!r:.80}")
    return seconds  # type: ignore[return-value]


class ResilientRedis:
    """A redis-py client plus degraded mode.

    Args:
        url: ``redis://host:port/db`` (ignored when ``client`` is given).
        client: an existing ``redis.Redis`` (its own timeouts and retries then apply).
        timeout: socket connect and read timeout, seconds — the longest one call can block.
        retry_after: seconds a lost server is left alone before the next attempt.
        failure_threshold: consecutive connection failures that start degraded mode.
        clock: time source for ``retry_after`` (inject one in tests).
    """

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        client: Any = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_after: float = 1.0,
        failure_threshold: int = DEFAULT_FAILURE_THRESHOLD,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        check_type("url", url, str)
        timeout = check_seconds("timeout", timeout)
        retry_after = check_seconds("retry_after", retry_after, allow_zero=True)
        check_type("failure_threshold", failure_threshold, int)
        if failure_threshold < 1:
            raise ConfigError(f"failure_threshold must be >= 1, got {failure_threshold}")
        if not callable(clock):
            raise ConfigError(f"clock must be callable, got {type(clock).__name__}")
        try:
            import redis
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError as exc:  # pragma: no cover - redis is a dependency
            raise BackendUnavailableError("redis-py is not installed: pip install redis") from exc
        self.errors = (redis.ConnectionError, redis.TimeoutError, OSError)
        self._timeouts = (redis.TimeoutError, TimeoutError)
        # RedisClusterException (SlotNotCoveredError, ...) is not a RedisError: a RedisCluster client raises it
        # when its slot map has no node for a key (a failover or a migration in progress)
        self.server_errors = (redis.RedisError, redis.exceptions.RedisClusterException)
        self.url, self.retry_after, self.clock = url, retry_after, clock
        self.failure_threshold = failure_threshold
        self.timeout = timeout  # the socket timeout (a given client's own apply to it)
        self._op = threading.local()  # .depth (nesting), .failed (the operation lost its connection)
        if client is None:
            try:
                client = redis.Redis.from_url(
                    url, socket_timeout=timeout, socket_connect_timeout=timeout, retry=Retry(NoBackoff(), 0)
                )
            except ValueError as exc:  # a malformed URL
                raise ConfigError(f"url: {exc}") from None
        self.client = client
        self.degraded = False
        self._down_until: float | None = None
        self._consecutive = 0
        self.counts: Counter[str] = Counter()
        self._lock = threading.Lock()

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] += n

    def is_down(self) -> bool:
        """True while inside ``retry_after`` of degrading (calls answer their fallback)."""
        return self._down_until is not None and self.clock() < self._down_until

    def count_error(self, exc: BaseException) -> str:
        """Count one failed Redis call by kind (also used for the failed commands of a pipeline)."""
        if isinstance(exc, self._timeouts):
            kind = "timeout"
        elif _refused(exc):
            kind = "refused"
        elif isinstance(exc, self.errors):
            kind = "connection"
        else:
            kind = error_kind(exc)
        with self._lock:
            self.counts["errors"] += 1
            self.counts[f"errors_{kind}"] += 1
        return kind

    @contextmanager
    def operation(self) -> Iterator[None]:
        """Bound one public call (see the module docstring): its Redis calls stop at the first connection
        failure, so a hung server costs it one ``timeout``. Nested operations (a public call made by
        another, on this thread) are part of the outer one."""
        op = self._op
        depth = getattr(op, "depth", 0)
        if depth == 0:
            op.failed = False
        op.depth = depth + 1
        try:
            yield
        finally:
            op.depth = depth

    def call(self, fn: Callable[[], Any], fallback: Any) -> Any:
        """Run one Redis call; on any Redis error return ``fallback`` (see the module docstring)."""
        if self.is_down():
            self.count("degraded_ops")
            return fallback
        op = self._op
        in_op = getattr(op, "depth", 0) > 0
        if in_op and op.failed:
            self.count("skipped_ops")
            return fallback
        try:
            result = fn()
        except self.errors as exc:  # the connection: maybe the server is gone
            if in_op:
                op.failed = True
            self.count_error(exc)
            self._connection_failed(exc)
            return fallback
        except self.server_errors as exc:  # the server answered with an error: the connection is fine
            self.count_error(exc)
            self._succeeded()
            return fallback
        self._succeeded()
        return result

    def _connection_failed(self, exc: BaseException) -> None:
        refused = _refused(exc)
        with self._lock:
            self._consecutive += 1
            self.counts["degraded_ops"] += 1
            if self._consecutive < self.failure_threshold and not refused:
                return
            self._down_until = self.clock() + self.retry_after
            first = not self.degraded
            self.degraded = True
        if first:
            warnings.warn(
                f"Redis at {self.url} is unreachable ({type(exc).__name__}: {exc}) after {self._consecutive} "
                f"consecutive failures; answering reads as misses and dropping writes, retrying in "
                f"{self.retry_after} s",
                BackendDegradedWarning,
                stacklevel=5,
            )

    def _succeeded(self) -> None:
        with self._lock:
            self._consecutive = 0
            if self.degraded:
                self.degraded = False
                self._down_until = None
                self.counts["reconnects"] += 1
