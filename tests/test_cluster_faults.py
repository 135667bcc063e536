"""Faults on a real 6-node Redis Cluster of its own (the suite's one extra cluster): a hung master (SIGSTOP, then
SIGCONT) and a killed master (its replica promoted) while requests run through the cluster tier. Each fails if
the tier raises into the engine, loses a request or serves different tokens."""

from __future__ import annotations

import pytest
from redis_cluster import running_cluster

from memos_ref.tiering.cluster import ClusterTierBackend


@pytest.fixture(scope="module")
def fault_cluster():
    with running_cluster() as cluster:
        yield cluster


def _owner_ports(b: ClusterTierBackend, keys: list[str]) -> dict[str, int]:
    return {k: int(b.client.get_node_from_key(b.prefix + f"{{{k}}}:v").port) for k in keys}


def test_a_hung_master_costs_one_timeout_then_is_left_alone(fault_cluster):
    b = ClusterTierBackend(
        fault_cluster.url, fingerprint="faults", tenant="hung", timeout=0.2, retry_after=5.0, failure_threshold=1
    )
    keys = {f"h{i}": bytes([i]) * 500 for i in range(24)}
    assert all(b.put_many(keys).values())
    owners = _owner_ports(b, list(keys))
    hung = fault_cluster.master_ports()[0]
    fault_cluster.pause(hung)
    try:
        got = b.get_many(keys)  # the hung node's keys are misses after one timeout; the others are served
        expected = {k: v for k, v in keys.items() if owners[k] != hung}
        assert got == expected and b.error_counts["timeout"] == 1
        got = b.get_many(keys)  # left alone for retry_after: no second timeout, no network to it
        assert got == expected and b.error_counts["timeout"] == 1 and b.counts["node_down_skips"] == 1
        stored = b.put_many({"late": b"x"})
        assert stored["late"] == (_owner_ports(b, ["late"])["late"] != hung)
    finally:
        fault_cluster.resume(hung)
    assert b.slowest_call_s < 0.2 * 10  # bounded by the timeout (with scheduling slack on a loaded machine)
    fault_cluster.wait_healthy(30)
    b.close()


def test_killed_master_fails_over_without_lost_requests_or_wrong_tokens(fault_cluster):
    """A master is killed while an engine serves prompts through the tier (fresh pools, so every prompt reads the
    cluster); until its replica is promoted its blocks are misses and its writes are dropped, all counted."""
    from memos_ref.bench.cluster import failover

    fault_cluster.wait_healthy(30)
    report = failover(fault_cluster, "faults-fo", requests=3, new=3)
    assert report["requests_lost"] == 0 and report["failover_wrong_kv"] == 0
    assert report["failover_misses"] > 0  # the dead master's blocks were read as misses, not raised
    # writes in the window are dropped and counted (while the cluster is down, on every master: full coverage)
    assert report["probe_dropped"] > 0 and report["failover_dropped_writes"] >= report["probe_dropped"]
    after = ClusterTierBackend(fault_cluster.startup_nodes, fingerprint="faults", tenant="after")  # the dead one too
    assert all(after.put_many({f"k{i}": b"v" for i in range(12)}).values())  # healed: every slot takes writes
    assert report["failover_window_s"] is not None  # the replica was promoted and the cluster healed
    assert len(fault_cluster.master_ports()) == 3
