"""ResilientRedis against what a Redis Cluster and redis-py's ``RedisCluster`` client raise: every cluster error
(``MOVED``/``ASK``, ``CLUSTERDOWN``, ``TRYAGAIN``, a slot no node covers, redirections run out) is the call's
fallback — a miss or a dropped write — counted by kind, never an exception into the caller and never degraded
mode (the connection is fine). ``RedisClusterException`` is not a ``RedisError`` in redis-py, so it is checked
on its own, by class and on a real cluster."""

from __future__ import annotations

import pytest
from redis import exceptions as rx

from memos_ref.resilient import ResilientRedis

# (the exception as redis-py raises it, the kind counted): the reply's code, or the client's own error
CLUSTER_ERRORS = [
    (rx.MovedError("3999 127.0.0.1:7002"), "moved"),
    (rx.AskError("3999 127.0.0.1:7002"), "ask"),
    (rx.ClusterDownError("CLUSTERDOWN The cluster is down"), "clusterdown"),
    (rx.MasterDownError("MASTERDOWN Link with MASTER is down"), "masterdown"),
    (rx.TryAgainError("TRYAGAIN Multiple keys request during rehashing of slot"), "tryagain"),
    (rx.ClusterError("TTL exhausted."), "cluster"),  # RedisCluster's redirections ran out
    (rx.SlotNotCoveredError('Slot "12" not covered by the cluster.'), "slotnotcovered"),  # not a RedisError
    (rx.RedisClusterException("Redis Cluster cannot be connected."), "cluster"),  # not a RedisError
    (rx.CrossSlotTransactionError("all keys must map to the same slot"), "crossslot"),  # not a RedisError
    (rx.InvalidPipelineStack("Invalid pipeline stack"), "pipelinestack"),  # not a RedisError
]


def _raiser(exc: BaseException):
    def call() -> None:
        raise exc

    return call


@pytest.mark.parametrize(("exc", "kind"), CLUSTER_ERRORS, ids=[type(e).__name__ for e, _ in CLUSTER_ERRORS])
def test_each_cluster_error_is_a_counted_miss_or_dropped_write(exc, kind):
    r = ResilientRedis(client=object(), failure_threshold=1)
    assert r.call(_raiser(exc), None) is None  # a read: a miss
    assert r.call(_raiser(exc), False) is False  # a write: dropped
    assert r.counts["errors"] == 2 and r.counts[f"errors_{kind}"] == 2
    assert not r.degraded and not r.is_down()  # a server's (or the client's) answer: the connection is fine
    with r.operation():  # inside one public call it does not end the call's traffic either
        assert r.call(_raiser(exc), None) is None
        assert r.call(lambda: "served", None) == "served"
    assert r.counts["skipped_ops"] == 0


def test_a_slot_the_cluster_client_cannot_place_is_a_counted_miss(redis_cluster):
    """A RedisCluster client whose slot map has no node for a key's slot (as during a failover or a migration)
    raises SlotNotCoveredError — not a RedisError — out of ``get``; through ResilientRedis it is a miss."""
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.retry import Retry

    port = int(redis_cluster.url.rsplit(":", 1)[1].split("/")[0])
    client = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", port)], retry=Retry(NoBackoff(), 0))
    try:
        r = ResilientRedis(client=client)
        assert r.call(lambda: client.set("resilient-slot", b"v"), False) is True
        slot = client.keyslot("resilient-slot")
        client.nodes_manager.slots_cache.pop(slot)  # the map has lost the slot's node
        assert r.call(lambda: client.get("resilient-slot"), None) is None
        assert r.counts["errors_slotnotcovered"] == 1 and not r.degraded
        assert r.call(lambda: client.set("resilient-slot", b"w"), False) is False  # a write: dropped
        assert r.counts["errors_slotnotcovered"] == 2
        client.nodes_manager.initialize()  # the slot map re-read (as ClusterTierBackend does after such errors)
        assert r.call(lambda: client.get("resilient-slot"), None) == b"v"  # served; the dropped write wrote nothing
        client.delete("resilient-slot")
    finally:
        client.close()
