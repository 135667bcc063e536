"""ClusterTierBackend: KV blocks in a Redis Cluster (or Valkey), shared by every process that points at it.

Keys. A block is two keys: ``{namespace}:{fingerprint[:16]}:{tenant}:{<block key>}:v`` (the block file) and
``…:{<block key>}:m`` (its metadata: ``<bytes>:<blake2b-128 of the bytes>``). The ``{…}`` hash tag puts both on
one slot, so one node answers for a block. The block key is the chained prefix hash (model fingerprint, tenant
salt, every token before it), so two processes computing the same prefix write the same key with the same bytes:
no locks are needed — the last writer wins, and every writer writes the same thing.

Rounds. :meth:`get_many` and :meth:`put_many` group keys by the node owning their slot (from the client's slot
map, no network) and send one pipeline per node. :meth:`read_ahead` fetches a prompt's blocks that way and keeps
them for a few seconds, so the tier store's per-block ``contains``/``get`` that follow cost no round trip.

Reads are bounded before anything is decoded: ``GETRANGE 0 max_item_bytes`` (a planted huge value is never
fully read), the metadata likewise; a value whose length or digest disagrees with its metadata is a miss counted
``corrupt`` (the block file's own checksum is checked again by the tier store). Nothing a server answers raises
into the caller: ``MOVED``/``ASK`` (retried once through the cluster client after the slot map is refreshed),
``CLUSTERDOWN``, ``TRYAGAIN``, a refused or timed-out node (a killed or hung one: that node is left alone for
``retry_after`` s), ``OOM``, ``WRONGTYPE`` — each is a miss or a dropped write, counted by kind and by node
(:meth:`stats`, :class:`~memos_ref.tiering.cluster_metrics.ClusterMetrics`).

Budget: ``tenant_budget_bytes`` caps this tenant's live bytes by a per-tenant counter (``INCRBY`` on each new block,
expiring with ``ttl``): a write past it is dropped and counted ``budget_refused``. Conservative (an evicted block
counts until the counter expires) and not atomic across writers; a counter that cannot be trusted (negative, not an
integer) refuses every write, counted ``budget_untrusted``. ``ttl`` expires blocks; ``maxmemory-policy`` evicts.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

from memos_ref.errors import ArgumentTypeError, BackendUnavailableError, ConfigError, check_index, check_type
from memos_ref.resilient import DEFAULT_TIMEOUT_S, check_seconds, error_kind, ttl_to_px, validate_ttl
from memos_ref.tiering.backends import TierBackend, validate_block_key
from memos_ref.tiering.cluster_readahead import ReadAhead
from memos_ref.tiering.cluster_write import PUT_NEW, PUT_REFUSED, PUT_SAME, PUT_SCRIPT, USAGE_READ_BYTES, parse_usage

__all__ = ["ClusterTierBackend"]

_REDIS_MAX_VALUE, _META_MAX = 512 * 2**20, 128  # the read bound; "<bytes>:<32 hex>" is at most 11 + 1 + 32 bytes
_BYTES = (bytes, bytearray, memoryview)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _nodes_of(url: str | list[tuple[str, int]]) -> list[tuple[str, int]]:
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


class ClusterTierBackend(TierBackend):
    """Blocks in a Redis Cluster: the shared tier of many processes (see the module docstring).

    Args:
        url: a startup node (``redis://host:port``, ``rediss://`` for TLS) or a list of ``(host, port)``.
        fingerprint: the model fingerprint (keys carry its first 16 characters).
        namespace / tenant: the rest of the key prefix (1-128 of ``[A-Za-z0-9_-]``).
        ttl: seconds until a block expires (None: never).
        tenant_budget_bytes: the most bytes this tenant may hold (None: no limit).
        timeout: socket connect/read timeout per node, seconds: the longest one node can stall a call.
        retry_after: seconds a node that refused or timed out is left alone (its keys are misses meanwhile).
        failure_threshold: consecutive timeouts of one node before it is left alone (a refusal: at once).
        readahead_s: how long blocks fetched by :meth:`read_ahead` are kept for the reads that follow.
        username / password / ssl / ssl_ca_certs / ssl_certfile / ssl_keyfile: AUTH/ACL and TLS, passed to redis-py.
        client_kwargs: more keyword arguments for ``redis.cluster.RedisCluster``.
        client: an existing ``RedisCluster`` (then the connection options above are ignored).
    """

    name = "cluster"

    def __init__(
        self,
        url: str | list[tuple[str, int]] = "redis://127.0.0.1:7000",
        *,
        fingerprint: str,
        namespace: str = "memos-kv",
        tenant: str = "default",
        ttl: float | None = None,
        tenant_budget_bytes: int | None = None,
        timeout: float = DEFAULT_TIMEOUT_S,
        retry_after: float = 0.5,
        failure_threshold: int = 2,
        readahead_s: float = 5.0,
        max_item_bytes: int = _REDIS_MAX_VALUE,
        username: str | None = None,
        password: str | None = None,
        ssl: bool | None = None,
        ssl_ca_certs: str | None = None,
        ssl_certfile: str | None = None,
        ssl_keyfile: str | None = None,
        client_kwargs: Mapping[str, Any] | None = None,
        client: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(max_item_bytes)
        for label, value in (("namespace", namespace), ("tenant", tenant), ("fingerprint", fingerprint)):
            check_type(label, value, str)
            try:
                validate_block_key(value)
            except ConfigError:
                raise ConfigError(f"{label} must be 1-128 of [A-Za-z0-9_-], got {value!r}") from None
        self.ttl = validate_ttl(ttl)
        self._px = ttl_to_px(self.ttl)
        if tenant_budget_bytes is not None:
            check_index("tenant_budget_bytes", tenant_budget_bytes, lo=1)
        self.tenant_budget_bytes = tenant_budget_bytes
        self.timeout = check_seconds("timeout", timeout)
        self.retry_after = check_seconds("retry_after", retry_after, allow_zero=True)
        self.readahead_s = check_seconds("readahead_s", readahead_s, allow_zero=True)
        check_type("failure_threshold", failure_threshold, int)
        if failure_threshold < 1:
            raise ConfigError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.failure_threshold = failure_threshold
        self.nodes = _nodes_of(url)
        tls = isinstance(url, str) and url.startswith("rediss://")
        self._options: dict[str, Any] = dict(client_kwargs or {})
        passed = {"username": username, "password": password, "ssl_ca_certs": ssl_ca_certs}
        passed |= {"ssl_certfile": ssl_certfile, "ssl_keyfile": ssl_keyfile}
        self._options |= {k: v for k, v in passed.items() if v is not None}
        if ssl or (ssl is None and tls):
            self._options["ssl"] = True
        self.clock = clock
        self.prefix = f"{namespace}:{fingerprint[:16]}:{tenant}:"
        self._usage_key = f"{self.prefix}{{usage-{tenant}}}"
        self._client = client
        self.node_counts: dict[str, Counter[str]] = defaultdict(Counter)
        self.error_counts: Counter[str] = Counter()
        self.slowest_call_s = 0.0
        self._down: dict[str, float] = {}  # node -> monotonic time until which it is left alone
        self._timeouts: Counter[str] = Counter()
        self._ahead = ReadAhead(self.readahead_s, clock=clock)
        self._lock = threading.RLock()
        self._stale, self._refreshed_at = False, float("-inf")  # the slot map: known stale; when last re-read

    # ------------------------------------------------------------------ keys and the client
    def _vk(self, key: str) -> str:
        return f"{self.prefix}{{{validate_block_key(key)}}}:v"

    def _mk(self, key: str) -> str:
        return f"{self.prefix}{{{key}}}:m"

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
                **self._options,
            }
            for host, port in self.nodes:  # the first startup node that answers (a dead one must not stop us)
                try:
                    self._client = RedisCluster(startup_nodes=[ClusterNode(host, port)], **options)
                    break
                except TypeError as exc:  # an option redis-py does not know: a configuration error
                    raise ConfigError(f"RedisCluster refused the options: {exc}") from None
                except Exception as exc:  # this node did not answer: counted; the next one, or the next call
                    self._count("client", exc)
        return self._client

    def _count(self, node: str, exc: BaseException) -> str:
        kind = _kind(exc)
        with self._lock:
            self.counts["errors"] += 1
            self.error_counts[kind] += 1
            self.node_counts[node][f"errors_{kind}"] += 1
            if kind in ("moved", "clusterdown", "connection", "refused", "timeout", "slotnotcovered"):
                self._stale = True  # the slot map is stale (ASK is temporary: it keeps the map)
        return kind

    def _refresh(self) -> None:
        """Re-read the slot map once known stale (a redirection, failover, dead node); at most every 0.2 s."""
        now = self.clock()
        if not self._stale or now - self._refreshed_at < 0.2 or self._client is None:
            return
        self._stale, self._refreshed_at = False, now
        try:
            self._client.nodes_manager.initialize()
            self.counts["slot_map_refreshes"] += 1
        except Exception as exc:
            self._count("client", exc)

    def _by_node(self, rkeys: list[tuple[str, Any]]) -> dict[str, list[tuple[str, Any]]]:
        """Group ``(key, item)`` pairs by the node owning their hash slot (local: the client's slot map)."""
        groups: dict[str, list[tuple[str, Any]]] = defaultdict(list)
        client = self.client
        for key, item in rkeys:
            if client is None:
                groups["unknown"].append((key, item))
                continue
            try:
                node = client.get_node_from_key(self._vk(key)).name
            except Exception as exc:  # no node covers the slot (a failover in progress)
                self._count("unknown", exc)
                node = "unknown"
            groups[node].append((key, item))
        return groups

    def _node_pipeline(self, node: str, build: Callable[[Any], None]) -> list | None:
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
            kind = self._count(node, exc)
            if kind == "refused" or (kind == "timeout" and self._timed_out(node)):
                self._down[node] = self.clock() + self.retry_after
            return None
        finally:
            self.slowest_call_s = max(self.slowest_call_s, time.perf_counter() - started)
        self._timeouts[node] = 0
        self.node_counts[node]["rounds"] += 1
        return replies

    def _timed_out(self, node: str) -> bool:
        self._timeouts[node] += 1
        return self._timeouts[node] >= self.failure_threshold

    # ------------------------------------------------------------------ reads
    def _verify(self, node: str, key: str, value: object, meta: object) -> bytes | None:
        """A value and its metadata as read: the bytes, or None (absent, another type, too large, disagreeing)."""
        for reply in (value, meta):
            if isinstance(reply, Exception):
                if self._count(node, reply) == "wrongtype":
                    self._heal(key)
                return None
        if not isinstance(value, bytes) or not value:  # GETRANGE answers b"" for a missing key
            return None
        if len(value) > self.max_item_bytes:
            self.counts["corrupt"] += 1
            return None
        try:
            size, digest = bytes(meta).decode("ascii").split(":")  # type: ignore[arg-type]
            agrees = int(size) == len(value) and digest == _digest(value)
        except (TypeError, ValueError):  # missing (a write in flight) or not ours
            self.counts["unverified"] += 1
            return None
        if not agrees:
            self.counts["corrupt"] += 1
            self._heal(key)
            return None
        return value

    def _heal(self, key: str) -> None:
        """Remove a block's keys that hold something else (a later write stores the right bytes)."""
        self.counts["healed"] += 1
        self._guarded(lambda: self.client.unlink(self._vk(key), self._mk(key)), 0)

    def _fetch(self, keys: list[str]) -> dict[str, bytes | None]:
        """One pipelined round per node; every key maps to its bytes or None."""
        self._refresh()
        out: dict[str, bytes | None] = dict.fromkeys(keys)
        limit = self.max_item_bytes
        redirected: list[str] = []
        for node, group in self._by_node([(k, None) for k in keys]).items():

            def build(pipe: Any, group: list = group) -> None:
                for key, _ in group:
                    pipe.getrange(self._vk(key), 0, limit)
                    pipe.getrange(self._mk(key), 0, _META_MAX)

            replies = self._node_pipeline(node, build)
            self.node_counts[node]["reads"] += len(group)
            if replies is None:
                continue
            for i, (key, _) in enumerate(group):
                value, meta = replies[2 * i], replies[2 * i + 1]
                if any(_kind(r) in ("moved", "ask") for r in (value, meta) if isinstance(r, Exception)):
                    self._count(node, value if isinstance(value, Exception) else meta)
                    redirected.append(key)
                    continue
                out[key] = self._verify(node, key, value, meta)
        for key in redirected:  # the slot moved: once more through the cluster client (it follows MOVED/ASK)
            out[key] = self._redirected(key)
        return out

    def _redirected(self, key: str) -> bytes | None:
        def read() -> tuple:
            c = self.client
            return c.getrange(self._vk(key), 0, self.max_item_bytes), c.getrange(self._mk(key), 0, _META_MAX)

        got = self._guarded(read, None)
        self.counts["redirect_retries"] += 1
        return None if got is None else self._verify("redirect", key, *got)

    def _guarded(self, fn: Callable[[], Any], fallback: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn() if self.client is not None else fallback
        except Exception as exc:
            self._count("client", exc)
            return fallback
        finally:
            self.slowest_call_s = max(self.slowest_call_s, time.perf_counter() - started)

    def read_ahead(self, keys: Iterable[str]) -> int:
        """Fetch ``keys`` (one round per node) and keep them ``readahead_s`` s for the per-block reads that
        follow (a prompt's lookup); returns how many were found."""
        keys = self._ahead.missing([validate_block_key(k) for k in keys])
        if not keys:
            return 0
        found = self._fetch(keys)
        self._ahead.hold(found)
        self.counts["read_ahead_blocks"] += len(keys)
        self.counts["read_ahead_misses"] += sum(v is None for v in found.values())
        return sum(v is not None for v in found.values())

    def get(self, key: str) -> bytes | None:
        validate_block_key(key)
        known, data = self._ahead.lookup(key, take=True)
        if not known:
            data = self._fetch([key])[key]
        self.counts["hits" if data is not None else "misses"] += 1
        return data

    def get_many(self, keys: Iterable[str]) -> dict[str, bytes]:
        keys = _listed(keys)
        found = {k: v for k, v in self._fetch(keys).items() if v is not None}
        self.counts["hits"] += len(found)
        self.counts["misses"] += len(keys) - len(found)
        return found

    def contains(self, key: str) -> bool:
        validate_block_key(key)
        known, data = self._ahead.lookup(key, take=False)
        if known:
            return data is not None
        return bool(self._guarded(lambda: self.client.exists(self._vk(key)), 0))

    # ------------------------------------------------------------------ writes
    def put(self, key: str, data: bytes) -> bool:
        return self.put_many({key: data})[key]  # True only where the key now holds these bytes

    def put_many(self, items: Mapping[str, bytes]) -> dict[str, bool]:
        """Store blocks, one pipelined round per node of atomic scripts (value ``SET NX`` + metadata: see
        :mod:`~memos_ref.tiering.cluster_write`); True only where the key now holds these bytes. Dropped and counted:
        too large, over the budget, a key holding other bytes (``put_conflicts``), refused by the node (OOM, …)."""
        check_type("items", items, Mapping)
        ok = dict.fromkeys(items, False)
        todo = []
        for k, v in items.items():
            validate_block_key(k)
            check_type("data", v, _BYTES)
            if len(v) <= self.max_item_bytes:
                todo.append((k, bytes(v)))
            else:
                self.counts["rejected"] += 1
        if todo and not self._within_budget(sum(len(v) for _, v in todo)):
            self.counts["budget_refused"] += len(todo)
            todo = []
        self._refresh()
        new_bytes, px = 0, self._px or 0
        for node, group in self._by_node(todo).items():

            def build(pipe: Any, group: list = group) -> None:
                for key, data in group:
                    pipe.eval(PUT_SCRIPT, 2, self._vk(key), self._mk(key), data, f"{len(data)}:{_digest(data)}", px)

            replies = self._node_pipeline(node, build)
            self.node_counts[node]["writes"] += len(group)
            for (key, data), reply in zip(group, replies or [], strict=False):
                self.counts["put_conflicts"] += reply == PUT_REFUSED  # other bytes under this key: nothing written
                if isinstance(reply, Exception):
                    self._count(node, reply)
                ok[key] = reply in (PUT_NEW, PUT_SAME)
                new_bytes += len(data) if reply == PUT_NEW else 0
        if new_bytes and self.tenant_budget_bytes is not None:
            self._guarded(self._charge(new_bytes), None)
        self.forget_read_ahead(ok)
        stored = sum(ok.values())
        self.counts["puts"] += stored
        self.counts["dropped_puts"] += len(ok) - stored
        return ok

    def forget_read_ahead(self, keys: Iterable[str]) -> None:
        """Forget read-ahead answers for ``keys`` (they were just written or deleted)."""
        self._ahead.forget(keys)

    def _within_budget(self, size: int) -> bool:
        """Whether ``size`` more bytes fit the budget; fails closed on an unreadable or untrusted counter."""
        if self.tenant_budget_bytes is None:
            return True
        used = self._usage()
        if used is None:
            self.counts["budget_untrusted"] += 1
        return used is not None and used + size <= self.tenant_budget_bytes

    def _usage(self) -> int | None:
        """The usage counter, read bounded: its value, 0 when absent, None when unreadable or untrusted."""
        return parse_usage(self._guarded(lambda: self.client.getrange(self._usage_key, 0, USAGE_READ_BYTES - 1), None))

    def _charge(self, size: int) -> Callable[[], None]:
        def charge() -> None:
            self.client.incrby(self._usage_key, size)
            if self._px is not None:
                self.client.pexpire(self._usage_key, self._px)

        return charge

    def delete(self, key: str) -> bool:
        validate_block_key(key)
        self.forget_read_ahead([key])
        return bool(self._guarded(lambda: self.client.unlink(self._vk(key), self._mk(key)), 0))

    # ------------------------------------------------------------------ listing and stats
    def keys(self) -> list[str]:
        """This namespace's block keys (SCAN on every master); foreign keys are skipped and counted."""
        raw = self._guarded(lambda: list(self.client.scan_iter(match=self.prefix + "{*}:v", count=1000)), [])
        out, prefix = [], self.prefix.encode() + b"{"
        for rkey in raw:
            key = rkey[len(prefix) : -3].decode("ascii", "replace") if rkey.startswith(prefix) else ""
            try:
                out.append(validate_block_key(key))
            except ConfigError:
                self.counts["foreign_keys"] += 1
        return out

    @property
    def nbytes(self) -> int:
        """Bytes this tenant has written that are still counted (the budget counter; 0 when untrusted)."""
        return self._usage() or 0

    def clear(self) -> None:
        """Remove this namespace's blocks and its usage counter (SCAN + UNLINK; never FLUSHALL)."""
        for key in self.keys():
            self.delete(key)
        self._guarded(lambda: self.client.unlink(self._usage_key), 0)

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {**self.counts, **{f"errors_{k}": v for k, v in self.error_counts.items()}}
        out["nodes"] = {n: dict(c) for n, c in self.node_counts.items()}
        out["slowest_call_s"] = self.slowest_call_s
        out["degraded"] = int(self.degraded)
        out["blocks"] = len(self.keys())
        out["bytes"] = self.nbytes
        return out

    @property
    def degraded(self) -> bool:
        """True while no client could be built or a node is being left alone."""
        now = self.clock()
        return self._client is None or any(t > now for t in self._down.values())

    def close(self) -> None:
        """Close the client's connections."""
        if self._client is not None:
            self._client, client = None, self._client
            self._guarded(client.close, None)


def _kind(exc: BaseException) -> str:
    """A Redis error's kind: the reply's code (``moved``, ``oom``, ``wrongtype``, …) or the connection failure."""
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


def _listed(keys: Iterable[str]) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise ArgumentTypeError(f"keys: expected an iterable of str, got {type(keys).__name__}")
    return [validate_block_key(k) for k in keys]
