"""ClusterTierBackend: KV blocks in a Redis Cluster (or Valkey), shared by every process that points at it.

Keys. A block is two keys: ``{namespace}:{fingerprint[:16]}:{tenant}:{<block key>}:v`` (the block file) and
``…:{<block key>}:m`` (its metadata: ``<bytes>:<blake2b-128 of the bytes>``). The ``{…}`` hash tag puts both on
one slot, so one node answers for a block. The block key is the chained prefix hash (model fingerprint, tenant
salt, every token before it), so two processes computing the same prefix write the same key with the same bytes:
no locks are needed — the last writer wins, and every writer writes the same thing.

Rounds. :meth:`get_many` and :meth:`put_many` group keys by the node owning their slot (from the client's slot
map, no network) and send one pipeline per node; a read's replies that answer ``MOVED``/``ASK`` (a slot migrated or
migrating) are re-sent in one pipeline per node they name, at most twice (the nodes' part lives in
:mod:`~memos_ref.tiering.cluster_nodes`). :meth:`read_ahead` fetches a prompt's blocks that way and keeps
them for a few seconds, so the tier store's per-block ``contains``/``get`` that follow cost no round trip.

Reads are bounded before anything is decoded: ``GETRANGE 0 max_item_bytes`` (a planted huge value is never
fully read), the metadata likewise; a value whose length or digest disagrees with its metadata is a miss counted
``corrupt`` (the block file's own checksum is checked again by the tier store). Nothing a server answers raises
into the caller: ``MOVED``/``ASK`` on a read (followed in batches, the slot map re-read after ``MOVED``; on a write,
dropped),
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
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from memos_ref.errors import ArgumentTypeError, ConfigError, check_index, check_type
from memos_ref.resilient import DEFAULT_TIMEOUT_S, check_seconds, ttl_to_px, validate_ttl
from memos_ref.tiering.backends import TierBackend, validate_block_key
from memos_ref.tiering.cluster_nodes import ClusterNodes, is_redirect, startup_nodes
from memos_ref.tiering.cluster_readahead import ReadAhead
from memos_ref.tiering.cluster_write import PUT_NEW, PUT_REFUSED, PUT_SAME, PUT_SCRIPT, USAGE_READ_BYTES, parse_usage

__all__ = ["ClusterTierBackend"]

_REDIS_MAX_VALUE, _META_MAX = 512 * 2**20, 128  # the read bound; "<bytes>:<32 hex>" is at most 11 + 1 + 32 bytes
_BYTES = (bytes, bytearray, memoryview)
_FAILED = object()  # a reply that could not be had (a redirection not followed): already counted


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


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
        self.nodes = startup_nodes(url)
        tls = isinstance(url, str) and url.startswith("rediss://")
        options: dict[str, Any] = dict(client_kwargs or {})
        passed = {"username": username, "password": password, "ssl_ca_certs": ssl_ca_certs}
        passed |= {"ssl_certfile": ssl_certfile, "ssl_keyfile": ssl_keyfile}
        options |= {k: v for k, v in passed.items() if v is not None}
        if ssl or (ssl is None and tls):
            options["ssl"] = True
        self.clock = clock
        self.prefix = f"{namespace}:{fingerprint[:16]}:{tenant}:"
        self._usage_key = f"{self.prefix}{{usage-{tenant}}}"
        self._nodes = ClusterNodes(
            self.nodes,
            options,
            timeout=self.timeout,
            retry_after=self.retry_after,
            failure_threshold=failure_threshold,
            counts=self.counts,
            clock=clock,
            client=client,
        )
        self._ahead = ReadAhead(self.readahead_s, clock=clock)

    # ------------------------------------------------------------------ keys, the client, the counts
    def _vk(self, key: str) -> str:
        return f"{self.prefix}{{{validate_block_key(key)}}}:v"

    def _mk(self, key: str) -> str:
        return f"{self.prefix}{{{key}}}:m"

    @property
    def client(self) -> Any:
        """The ``RedisCluster`` client, built at first use (None while no startup node answers)."""
        return self._nodes.client

    @property
    def client_options(self) -> dict[str, Any]:
        """The keyword arguments given to ``RedisCluster`` beyond the timeouts (AUTH/ACL, TLS, ``client_kwargs``)."""
        return dict(self._nodes.options)

    @property
    def node_counts(self) -> dict[str, Counter[str]]:
        """Per node (``host:port``): ``rounds``, ``reads``, ``writes`` and ``errors_<kind>``."""
        return self._nodes.node_counts

    @property
    def error_counts(self) -> Counter[str]:
        """Errors by kind (``moved``, ``ask``, ``timeout``, ``oom``, ``wrongtype``, …), every node together."""
        return self._nodes.error_counts

    @property
    def slowest_call_s(self) -> float:
        """The slowest single network call so far (one pipeline, or one command through the cluster client, which
        redis-py may retry once), seconds."""
        return self._nodes.slowest_call_s

    @property
    def slowest_round_trip_s(self) -> float:
        """The slowest pipeline to one node so far: one round trip, so at most one socket ``timeout`` of waiting
        (plus the time a loaded machine takes to run the thread again once the timeout fired), seconds."""
        return self._nodes.slowest_round_trip_s

    def _count(self, node: str, exc: BaseException) -> str:
        return self._nodes.count(node, exc)

    def _guarded(self, fn: Callable[[], Any], fallback: Any) -> Any:
        return self._nodes.guarded(fn, fallback)

    # ------------------------------------------------------------------ reads
    def _verify(self, node: str, key: str, value: object, meta: object) -> bytes | None:
        """A value and its metadata as read: the bytes, or None (absent, another type, too large, disagreeing)."""
        if value is _FAILED or meta is _FAILED:  # a redirection not followed: counted where it failed
            return None
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
        """One pipelined round per node, then the replies redirected (``MOVED``/``ASK``) followed in one round per
        node they name (:meth:`ClusterNodes.follow`); every key maps to its bytes or None."""
        nodes, limit = self._nodes, self.max_item_bytes
        nodes.refresh()
        out: dict[str, bytes | None] = dict.fromkeys(keys)
        read: dict[str, tuple[str, list]] = {}  # key -> (node, [value reply, metadata reply])
        redirected: list[tuple[tuple, BaseException]] = []
        where: list[tuple[str, int]] = []
        for node, group in nodes.group([(k, None) for k in keys], self._vk).items():

            def build(pipe: Any, group: list = group) -> None:
                for key, _ in group:
                    pipe.getrange(self._vk(key), 0, limit)
                    pipe.getrange(self._mk(key), 0, _META_MAX)

            replies = nodes.pipeline(node, build)
            nodes.node_counts[node]["reads"] += len(group)
            if replies is None:
                continue
            for i, (key, _) in enumerate(group):
                pair = [replies[2 * i], replies[2 * i + 1]]
                for j, reply in enumerate(pair):
                    if is_redirect(reply):  # the slot moved or is moving: followed below, with the others
                        nodes.count(node, reply)
                        rkey, bound = (self._vk(key), limit) if j == 0 else (self._mk(key), _META_MAX)
                        redirected.append((("GETRANGE", rkey, 0, bound), reply))
                        where.append((key, j))
                read[key] = (node, pair)
        if redirected:
            for (key, j), reply in zip(where, nodes.follow(redirected), strict=True):
                read[key][1][j] = _FAILED if reply is None else reply
        for key, (node, (value, meta)) in read.items():
            out[key] = self._verify(node, key, value, meta)
        return out

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
        nodes = self._nodes
        nodes.refresh()
        new_bytes, px = 0, self._px or 0
        for node, group in nodes.group(todo, self._vk).items():

            def build(pipe: Any, group: list = group) -> None:
                for key, data in group:
                    pipe.eval(PUT_SCRIPT, 2, self._vk(key), self._mk(key), data, f"{len(data)}:{_digest(data)}", px)

            replies = nodes.pipeline(node, build)
            nodes.node_counts[node]["writes"] += len(group)
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
        return self._nodes.degraded

    def close(self) -> None:
        """Close the client's connections."""
        self._nodes.close()


def _listed(keys: Iterable[str]) -> list[str]:
    if isinstance(keys, (str, bytes)) or not isinstance(keys, Iterable):
        raise ArgumentTypeError(f"keys: expected an iterable of str, got {type(keys).__name__}")
    return [validate_block_key(k) for k in keys]
