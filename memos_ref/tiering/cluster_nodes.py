"""The cluster tier's view of a Redis Cluster's nodes: the client, one pipelined round per node, redirections
followed in batches, a failing node left alone, every error counted by node and kind.

:class:`ClusterNodes` is what :class:`~memos_ref.tiering.cluster.ClusterTierBackend` talks to the cluster through:

* **The client**: redis-py's ``RedisCluster``, built at first use from the first startup node that answers, with
  the socket timeout as both connect and read timeout (the node clients redis-py builds never retry), so one
  round trip to one node blocks at most ``timeout``.
* **One round per node**: :meth:`ClusterNodes.group` sorts keys by the node owning their slot (the client's slot
  map, no network) and :meth:`ClusterNodes.pipeline` sends one pipeline to one node. A node that refused a
  connection, or timed out ``failure_threshold`` times in a row, is left alone for ``retry_after`` s: its keys
  are misses and its writes dropped meanwhile, without touching the network (``node_down_skips``).
* **Redirections in batches**: the commands of a round that answered ``MOVED`` or ``ASK`` (a slot migrating or
  migrated) are re-sent by :meth:`ClusterNodes.follow` to the node each reply names, one pipeline per named node
  (``ASKING`` before each command an ``ASK`` redirected), at most :data:`MAX_REDIRECT_ROUNDS` times. A read of
  ``n`` blocks therefore costs at most ``1 + MAX_REDIRECT_ROUNDS`` round trips per node, never one per block;
  a command still redirected after that, or redirected to a node the slot map does not know, is a counted
  failure (a miss), never an exception.
* **The slot map** is re-read only once a reply showed it stale (``MOVED``, a refused or timed-out node,
  ``CLUSTERDOWN``, a slot without a node) and at most every 0.2 s, asking the node most recently left alone last
  (redis-py asks the startup nodes in a random order, and a hung one costs a timeout); ``ASK`` is temporary and
  keeps the map.
"""

from __future__ import annotations

import inspect
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlsplit

from memos_ref.errors import BackendUnavailableError, ConfigError, check_type
from memos_ref.resilient import error_kind

__all__ = ["MAX_REDIRECT_ROUNDS", "ClusterNodes", "cluster_error_kind", "is_redirect", "startup_nodes"]

#: Rounds of redirections one call follows (a ``MOVED`` to the new owner, which may answer ``ASK`` while the slot
#: migrates on): a command redirected again after that is a counted failure.
MAX_REDIRECT_ROUNDS = 2
_STALE_KINDS = ("moved", "clusterdown", "connection", "refused", "timeout", "slotnotcovered")
_REFRESH_EVERY_S = 0.2


def startup_nodes(url: str | list[tuple[str, int]]) -> list[tuple[str, int]]:
    """The startup nodes of ``url``: ``redis://host:port`` / ``rediss://host:port`` or a list of ``(host, port)``
    (:class:`~memos_ref.errors.ConfigError` for anything else)."""
    if isinstance(url, str):
        parts = urlsplit(url)
        if parts.scheme not in ("redis", "rediss") or not parts.hostname:
            raise ConfigError(f"url must be redis://host:port or rediss://host:port, got {url!r}")
        return [(parts.hostname, parts.port or 6379)]
    check_type("url", url, list)
    for i, node in enumerate(url):
        if not (isinstance(node, tuple) and len(node) == 2 and isinstance(node[0], str) and isinstance(node[1], int)):
            raise ConfigError(f"url[{i}]: expected (host, port), got {node!r:.80}")
    if not url:
        raise ConfigError("url: expected at least one (host, port) startup node")
    return list(url)


def cluster_error_kind(exc: BaseException) -> str:
    """A Redis error's kind: the reply's code (``moved``, ``oom``, ``wrongtype``, …) or the connection failure
    (``refused``: nothing listens; ``timeout``; ``connection``)."""
    seen, cur = 0, exc
    while cur is not None and seen < 8:
        if isinstance(cur, ConnectionRefusedError):
            return "refused"
        cur, seen = cur.__cause__ or cur.__context__, seen + 1
    names = {c.__name__ for c in type(exc).__mro__}
    if "TimeoutError" in names:
        return "timeout"
    if "ConnectionError" in names and "ResponseError" not in names:
        return "connection"
    return error_kind(exc)


def is_redirect(reply: object) -> bool:
    """Whether a reply is a ``MOVED`` or ``ASK`` redirection naming the node to ask instead."""
    return (
        isinstance(reply, Exception)
        and cluster_error_kind(reply) in ("moved", "ask")
        and isinstance(getattr(reply, "host", None), str)
        and isinstance(getattr(reply, "port", None), int)
    )


class ClusterNodes:
    """A Redis Cluster's nodes, reached one pipeline per node (see the module docstring).

    Args:
        nodes: startup nodes, tried in order until one answers.
        options: keyword arguments for ``redis.cluster.RedisCluster`` (AUTH/ACL, TLS, ...), over the defaults.
        timeout / retry_after / failure_threshold: as :class:`~memos_ref.tiering.cluster.ClusterTierBackend`'s.
        counts: the owner's counter (``errors``, ``node_down_skips``, ``slot_map_refreshes``, ``redirect_retries``
            are counted into it).
        clock: time source for ``retry_after`` and the refresh interval.
        client: an existing ``RedisCluster`` (then ``options`` are not used).
    """

    def __init__(
        self,
        nodes: list[tuple[str, int]],
        options: Mapping[str, Any],
        *,
        timeout: float,
        retry_after: float,
        failure_threshold: int,
        counts: Counter[str],
        clock: Callable[[], float] = time.monotonic,
        client: Any = None,
    ) -> None:
        self.nodes, self.options = list(nodes), dict(options)
        self.timeout, self.retry_after, self.failure_threshold = timeout, retry_after, failure_threshold
        self.counts, self.clock = counts, clock
        self._client = client
        self.node_counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.error_counts: Counter[str] = Counter()
        self.slowest_call_s = 0.0  # any one network call: a pipeline, or a command through the cluster client
        self.slowest_round_trip_s = 0.0  # one pipeline to one node: one round trip, at most one socket timeout
        self._down: dict[str, float] = {}  # node -> monotonic time until which it is left alone
        self._timeouts: Counter[str] = Counter()
        self._lock = threading.RLock()
        self._stale, self._refreshed_at = False, float("-inf")  # the slot map: known stale; when last re-read

    @property
    def client(self) -> Any:
        """The ``RedisCluster`` client, built at first use (None while no startup node answers)."""
        if self._client is None:
            try:
                from redis.backoff import NoBackoff
                from redis.cluster import ClusterNode, RedisCluster
                from redis.retry import Retry
            except ImportError as exc:  # pragma: no cover - redis is a dependency
                raise BackendUnavailableError("redis-py is not installed: pip install redis") from exc
            options = {
                "socket_timeout": self.timeout,
                "socket_connect_timeout": self.timeout,
                "retry": Retry(NoBackoff(), 1),  # one retry: startup past a dead node listed in the slot map
                "require_full_coverage": False,
                **self.options,
            }
            for host, port in self.nodes:  # the first startup node that answers (a dead one must not stop us)
                try:
                    self._client = RedisCluster(startup_nodes=[ClusterNode(host, port)], **options)
                    break
                except TypeError as exc:  # an option redis-py does not know: a configuration error
                    raise ConfigError(f"RedisCluster refused the options: {exc}") from None
                except Exception as exc:  # this node did not answer: counted; the next one, or the next call
                    self.count("client", exc)
        return self._client

    def count(self, node: str, exc: BaseException) -> str:
        """Count one failed call (or failed command of a pipeline) of ``node``; its kind."""
        kind = cluster_error_kind(exc)
        with self._lock:
            self.counts["errors"] += 1
            self.error_counts[kind] += 1
            self.node_counts[node][f"errors_{kind}"] += 1
            if kind in _STALE_KINDS:
                self._stale = True  # the slot map is stale (ASK is temporary: it keeps the map)
        return kind

    def refresh(self, *, force: bool = False) -> None:
        """Re-read the slot map once known stale (``force``: now, whatever is known), at most every 0.2 s."""
        now = self.clock()
        if not (self._stale or force) or now - self._refreshed_at < _REFRESH_EVERY_S or self._client is None:
            return
        self._stale, self._refreshed_at = False, now
        down = [node for node, until in self._down.items() if until > now]
        try:
            manager = self._client.nodes_manager
            if down and "last_failed_node_name" in inspect.signature(manager.initialize).parameters:
                manager.initialize(last_failed_node_name=down[-1])  # ask a node left alone last (a hung one stalls)
            else:
                manager.initialize()
            self.counts["slot_map_refreshes"] += 1
        except Exception as exc:
            self.count("client", exc)

    def group(self, items: list[tuple[str, Any]], rkey: Callable[[str], str]) -> dict[str, list[tuple[str, Any]]]:
        """Group ``(key, item)`` pairs by the node owning ``rkey(key)``'s slot (the client's slot map, no network);
        ``"unknown"`` holds those no node covers (a failover in progress) or all of them when no client answers."""
        groups: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        client = self.client
        for key, item in items:
            if client is None:
                groups["unknown"].append((key, item))
                continue
            try:
                node = client.get_node_from_key(rkey(key)).name
            except Exception as exc:  # no node covers the slot (a failover in progress)
                self.count("unknown", exc)
                node = "unknown"
            groups[node].append((key, item))
        return groups

    def pipeline(self, node: str, build: Callable[[Any], None]) -> list | None:
        """Run one pipeline on ``node``; its replies (exceptions in place of failed commands), or None when the
        node is left alone, unknown or failed as a whole (counted)."""
        if node == "unknown" or self.clock() < self._down.get(node, 0.0):
            self.counts["node_down_skips"] += 1
            return None
        started = time.perf_counter()
        try:
            pipe = self.client.get_redis_connection(self.client.get_node(node_name=node)).pipeline(transaction=False)
            build(pipe)
            replies = pipe.execute(raise_on_error=False)
        except Exception as exc:
            kind = self.count(node, exc)
            if kind == "refused" or (kind == "timeout" and self._timed_out(node)):
                self._down[node] = self.clock() + self.retry_after
            return None
        finally:
            took = time.perf_counter() - started
            self.slowest_call_s = max(self.slowest_call_s, took)
            self.slowest_round_trip_s = max(self.slowest_round_trip_s, took)
        self._timeouts[node] = 0
        self.node_counts[node]["rounds"] += 1
        return replies

    def _timed_out(self, node: str) -> bool:
        self._timeouts[node] += 1
        return self._timeouts[node] >= self.failure_threshold

    def follow(self, redirected: list[tuple[tuple, BaseException]]) -> list[object]:
        """Re-send redirected commands, batched per named node (see the module docstring).

        ``redirected``: ``(command, reply)`` pairs, the command as ``execute_command`` arguments and the reply a
        ``MOVED``/``ASK`` already counted. Returns each command's final reply, in order, or None where it failed
        (redirected too often, a node the slot map does not know, a node left alone or failing: all counted)."""
        out: list[object] = [reply if is_redirect(reply) else None for _, reply in redirected]
        todo = [i for i, reply in enumerate(out) if reply is not None]
        refreshed = False
        for _ in range(MAX_REDIRECT_ROUNDS):
            if not todo:
                break
            by_node: dict[str, list[int]] = defaultdict(list)
            for i in todo:
                target = self._target(out[i])  # type: ignore[arg-type]
                if target is None and not refreshed:  # a node the map does not know yet: re-read it once
                    refreshed = True
                    self.refresh(force=True)
                    target = self._target(out[i])  # type: ignore[arg-type]
                if target is None:
                    self.counts["redirect_unknown_node"] += 1
                    out[i] = None
                else:
                    by_node[target].append(i)
            todo = []
            for node, indices in by_node.items():
                todo += self._resend(node, indices, redirected, out)
        for i in todo:  # still redirected after the last round: a failure, counted
            self.counts["redirect_exhausted"] += 1
            out[i] = None
        return out

    def _target(self, reply: BaseException) -> str | None:
        client = self.client
        try:
            node = None if client is None else client.get_node(host=reply.host, port=reply.port)  # type: ignore[attr-defined]
        except Exception:  # pragma: no cover - get_node reads a dict
            node = None
        return None if node is None else node.name

    def _resend(self, node: str, indices: list[int], redirected: list[tuple[tuple, BaseException]], out: list) -> list:
        """One pipeline to ``node`` of the commands at ``indices`` (``ASKING`` before those ``ASK`` sent there);
        fills ``out`` and returns the indices redirected once more."""
        asking = [cluster_error_kind(out[i]) == "ask" for i in indices]  # type: ignore[arg-type]

        def build(pipe: Any) -> None:
            for i, ask in zip(indices, asking, strict=True):
                if ask:
                    pipe.execute_command("ASKING")
                pipe.execute_command(*redirected[i][0])

        replies = self.pipeline(node, build)
        self.counts["redirect_retries"] += len(indices)
        again = []
        if replies is None:  # the node failed as a whole or is left alone: counted there
            for i in indices:
                out[i] = None
            return again
        replies = iter(replies)
        for i, ask in zip(indices, asking, strict=True):
            if ask:
                next(replies)  # ASKING's OK (an error there shows in the command's own reply)
            reply = next(replies)
            if isinstance(reply, Exception):
                self.count(node, reply)
                if is_redirect(reply):
                    again.append(i)
                    out[i] = reply
                    continue
                reply = None
            out[i] = reply
        return again

    def guarded(self, fn: Callable[[], Any], fallback: Any) -> Any:
        """``fn()`` through the cluster client, or ``fallback`` on any error (counted) or while no client answers."""
        started = time.perf_counter()
        try:
            return fn() if self.client is not None else fallback
        except Exception as exc:
            self.count("client", exc)
            return fallback
        finally:
            self.slowest_call_s = max(self.slowest_call_s, time.perf_counter() - started)

    @property
    def degraded(self) -> bool:
        """True while no client could be built or a node is being left alone."""
        now = self.clock()
        return self._client is None or any(t > now for t in self._down.values())

    def close(self) -> None:
        """Close the client's connections (a later call builds a new client)."""
        if self._client is not None:
            self._client, client = None, self._client
            try:
                client.close()
            except Exception as exc:
                self.count("client", exc)
