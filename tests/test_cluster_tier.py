"""The cluster tier on a real 6-node Redis Cluster (3 masters, 3 replicas): keys, hash tags, one pipelined round
per node, tenants, TTL and budget, planted values, a full node, a slot migrated mid-run (MOVED/ASK), metrics."""

from __future__ import annotations

import time
from collections import Counter

import redis
import torch

from memos_ref.spec import KVSpec
from memos_ref.tiering.blockfile import encode_block
from memos_ref.tiering.cluster import ClusterTierBackend
from memos_ref.tiering.cluster_metrics import ClusterMetrics
from memos_ref.tiering.codecs import Codec
from memos_ref.tiering.store import Tier, TierStore

FP = "clustertest00000"
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=8, dtype=torch.float32)


def node(cluster, port: int) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=2)


def owner(cluster, rkey: str) -> int:
    """The port of the master owning ``rkey``'s slot."""
    any_node = node(cluster, cluster.master_ports()[0])
    slot = any_node.cluster("keyslot", rkey)
    for lo, hi, master, *_ in any_node.cluster("slots"):
        if lo <= slot <= hi:
            return int(master[1])
    raise AssertionError(f"slot {slot} has no owner")


def backend(cluster, tenant: str, **kw) -> ClusterTierBackend:
    return ClusterTierBackend(cluster.url, fingerprint=FP, tenant=tenant, timeout=0.5, **kw)


def test_hash_tag_one_round_per_node_and_roundtrip(redis_cluster):
    b = backend(redis_cluster, "rounds")
    items = {f"blk{i:03d}": bytes([i]) * (100 + i) for i in range(30)}
    assert all(b.put_many(items).values())
    rkey = b.prefix + "{blk007}"
    c = node(redis_cluster, redis_cluster.master_ports()[0])
    assert c.cluster("keyslot", rkey + ":v") == c.cluster("keyslot", rkey + ":m")  # value and metadata: one slot
    before = {n: c_["rounds"] for n, c_ in b.node_counts.items()}
    got = b.get_many([*items, "absent"])
    assert got == items
    rounds = {n: b.node_counts[n]["rounds"] - before.get(n, 0) for n in b.node_counts}
    assert sorted(rounds.values()) == [1, 1, 1]  # 31 keys on 3 masters: one pipelined round each
    assert b.counts["hits"] == 30 and b.counts["misses"] == 1
    assert sorted(b.keys()) == sorted(items)
    b.clear()
    assert b.keys() == []


def test_tenants_and_models_are_separate(redis_cluster):
    alice, bob = backend(redis_cluster, "alice"), backend(redis_cluster, "bob")
    other_model = ClusterTierBackend(redis_cluster.url, fingerprint="another0model000", tenant="alice")
    assert alice.put("k1", b"alice's block")
    assert bob.get("k1") is None and other_model.get("k1") is None and alice.get("k1") == b"alice's block"
    alice.clear()


def test_ttl_and_tenant_budget(redis_cluster):
    b = backend(redis_cluster, "budget", ttl=30, tenant_budget_bytes=3000)
    assert b.put_many({"a": b"x" * 1000, "b": b"y" * 1000}) == {"a": True, "b": True}
    assert b.nbytes == 2000
    assert b.put("a", b"x" * 1000)  # already stored (same key, same bytes): not charged again
    assert b.nbytes == 2000
    assert b.put("c", b"z" * 1500) is False and b.counts["budget_refused"] == 1  # would pass 3000
    assert b.get("c") is None and b.get("b") == b"y" * 1000
    port = owner(redis_cluster, b.prefix + "{a}:v")
    for rkey in (b.prefix + "{a}:v", b.prefix + "{a}:m"):  # the value and its metadata (one slot) expire alike
        assert 0 < node(redis_cluster, port).pttl(rkey) <= 30_000
    usage = b.prefix + "{usage-budget}"  # the budget counter expires with the blocks it counts
    assert 0 < node(redis_cluster, owner(redis_cluster, usage)).pttl(usage) <= 30_000
    b.clear()
    short = backend(redis_cluster, "expiry", ttl=0.05)
    assert short.put("e", b"gone soon")
    rkey = short.prefix + "{e}:v"
    expiring = node(redis_cluster, owner(redis_cluster, rkey))
    assert 0 < expiring.pttl(rkey) <= 50
    for _ in range(200):  # bounded (4 s): EXISTS reads the key, so Redis expires it then, 50 ms after the write
        if not expiring.exists(rkey):
            break
        time.sleep(0.02)
    assert short.get("e") is None and short.counts["misses"] == 1


def _block(seed: int) -> torch.Tensor:
    return torch.randn(SPEC.block_shape, generator=torch.Generator().manual_seed(seed))


def test_planted_wrong_type_and_wrong_body_are_counted_misses(redis_cluster):
    b = backend(redis_cluster, "planted")
    store = TierStore([Tier(b)], spec=SPEC, fingerprint=FP)
    good = _block(1)
    assert store.put("good", good) and torch.equal(store.get("good")[0], good)
    # a list planted where a block belongs: WRONGTYPE, a miss, and the keys are removed
    port = owner(redis_cluster, b.prefix + "{wt}:v")
    node(redis_cluster, port).rpush(b.prefix + "{wt}:v", b"not a block")
    assert store.get("wt") is None
    assert b.error_counts["wrongtype"] == 1 and b.counts["healed"] == 1
    assert node(redis_cluster, port).exists(b.prefix + "{wt}:v") == 0
    # a block file with a valid header and a wrong body, planted with metadata that agrees with it
    data = bytearray(encode_block(_block(2), spec=SPEC, fingerprint=FP, codec=Codec(), key="wb"))
    data[-5] ^= 0xFF
    assert b.put("wb", bytes(data))
    assert store.get("wb") is None
    assert store.counts["cluster"]["corrupt"] == 1 and b.get("wb") is None  # the store deleted it
    # the right bytes under metadata that disagrees with them: the backend refuses them before decoding
    assert store.put("wm", _block(3))
    port = owner(redis_cluster, b.prefix + "{wm}:m")
    node(redis_cluster, port).set(b.prefix + "{wm}:m", b"12:" + b"0" * 32)
    assert store.get("wm") is None and b.counts["corrupt"] == 1
    assert torch.equal(store.get("good")[0], good)  # nothing else was touched
    b.clear()


def test_a_full_node_drops_writes_and_keeps_serving_reads(redis_cluster):
    b = backend(redis_cluster, "oom")
    keys = {f"o{i}": b"v" * 200 for i in range(30)}
    assert all(b.put_many(keys).values())
    full = owner(redis_cluster, b.prefix + "{n0}:v")
    full_node = node(redis_cluster, full)
    full_node.config_set("maxmemory", "1")  # noeviction (the fixture's policy): every write is refused with OOM
    try:
        new = {f"n{i}": b"w" * 200 for i in range(30)}
        stored = b.put_many(new)
        on_full = [k for k in new if owner(redis_cluster, b.prefix + f"{{{k}}}:v") == full]
        assert on_full and not any(stored[k] for k in on_full)
        assert all(stored[k] for k in new if k not in on_full)
        assert b.error_counts["oom"] == len(on_full) and b.counts["dropped_puts"] == len(on_full)
        assert b.get_many(keys) == keys  # reads still served by the full node
    finally:
        full_node.config_set("maxmemory", "0")
    b.clear()


def test_slot_migrated_mid_run_answers_through_ask_and_moved(redis_cluster):
    b = backend(redis_cluster, "migrate")
    keys = {f"m{i}": bytes([i]) * 300 for i in range(20)}
    assert all(b.put_many(keys).values())
    assert b.get_many(keys) == keys  # the client's slot map is current
    key = "m3"
    v, m = b.prefix + f"{{{key}}}:v", b.prefix + f"{{{key}}}:m"
    src_port = owner(redis_cluster, v)
    dst_port = next(p for p in redis_cluster.master_ports() if p != src_port)
    src, dst = node(redis_cluster, src_port), node(redis_cluster, dst_port)
    slot = src.cluster("keyslot", v)
    src_id, dst_id = src.cluster("myid").decode(), dst.cluster("myid").decode()
    dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", v)  # half-way: the value moved
    assert b.get_many(keys) == keys  # the value answers ASK: followed, still the right bytes
    assert b.error_counts["ask"] >= 1
    src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", m)
    for port in redis_cluster.master_ports():
        node(redis_cluster, port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    assert b.get_many(keys) == keys  # the stale slot map answers MOVED: followed, then refreshed
    assert b.error_counts["moved"] >= 1 and b.counts["redirect_retries"] >= 2
    assert b.get_many(keys) == keys
    b.clear()


def test_a_current_slot_map_is_never_re_read(redis_cluster):
    """The slot map is re-read only once a reply showed it stale (MOVED, a dead node, ...), not every 0.2 s of
    clock: calls far apart cost no CLUSTER SLOTS round trip and a stale client really meets MOVED."""
    now = [0.0]
    b = backend(redis_cluster, "norefresh", clock=lambda: now[0])
    keys = {f"n{i}": bytes([i]) * 64 for i in range(9)}
    assert all(b.put_many(keys).values())
    for _ in range(4):
        now[0] += 1.0
        assert b.get_many(keys) == keys
        b.put_many({"n0": keys["n0"]})
    assert b.counts["slot_map_refreshes"] == 0 and not b.error_counts
    b.clear()


def test_metrics_per_node_and_error_kind(redis_cluster):
    b = backend(redis_cluster, "metrics")
    b.put_many({"x": b"1", "y": b"2"})
    port = owner(redis_cluster, b.prefix + "{z}:v")
    node(redis_cluster, port).rpush(b.prefix + "{z}:v", b"list")
    b.get_many(["x", "y", "z"])
    text = ClusterMetrics(b).exposition()
    assert f'memos_cluster_errors_total{{kind="wrongtype",node="127.0.0.1:{port}"}} 1.0' in text
    assert "memos_cluster_hits_total 2.0" in text and "memos_cluster_node_rounds_total{" in text
    b.clear()


def test_cluster_server_leaves_nothing_behind():
    """A cluster's processes are ended and its directory removed on exit; 1-2 masters are formed by hand, without
    replicas (refused with ConfigError); a bad option starts nothing."""
    import os

    import pytest
    from redis_cluster import running_cluster

    from memos_ref.errors import ConfigError
    from memos_ref.tiering.cluster_server import ClusterServer

    with pytest.raises(ConfigError, match="without replicas"):
        ClusterServer(2, 1)
    with running_cluster(masters=1, replicas=0) as cluster:
        processes = [n.process for n in cluster.nodes]
        home = cluster.directory
        b = ClusterTierBackend(cluster.url, fingerprint=FP)
        assert b.put("one", b"1") and b.get("one") == b"1" and cluster.master_ports() == [cluster.nodes[0].port]
        b.close()
    assert home and all(p.poll() is not None for p in processes) and not os.path.exists(home)


def test_read_ahead_expires_and_is_bounded():
    from memos_ref.tiering.cluster_readahead import ReadAhead

    now = [0.0]
    ahead = ReadAhead(ttl_s=5.0, max_bytes=10, clock=lambda: now[0])
    ahead.hold({"a": b"12345", "b": None, "c": b"678"})
    assert ahead.missing(["a", "b", "c", "d"]) == ["d"]
    assert ahead.lookup("b", take=False) == (True, None)  # known absent: no second fetch
    ahead.hold({"d": b"9999"})  # 5 + 3 + 4 bytes > 10: the oldest ("a") goes
    assert ahead.lookup("a", take=False) == (False, None) and ahead.lookup("c", take=True) == (True, b"678")
    assert ahead.missing(["c"]) == ["c"]  # taken
    now[0] = 6.0
    assert ahead.missing(["b", "d"]) == ["b", "d"]  # expired


def test_put_over_a_planted_value_reports_false_and_writes_nothing(redis_cluster):
    """A key holding other bytes (or another type) is not ours to overwrite: put is False, counted, and neither
    key changes; our bytes under a disagreeing metadata are stored by making the metadata agree."""
    b = backend(redis_cluster, "plantput")
    v, m = b.prefix + "{p1}:v", b.prefix + "{p1}:m"
    owner_node = node(redis_cluster, owner(redis_cluster, v))
    owner_node.set(v, b"planted")  # a foreign value, no metadata
    assert b.put_many({"p1": b"real", "fresh": b"new"}) == {"p1": False, "fresh": True}
    assert b.counts["put_conflicts"] == 1 and b.counts["dropped_puts"] == 1 and b.counts["puts"] == 1
    assert owner_node.get(v) == b"planted" and owner_node.exists(m) == 0  # no metadata written for foreign bytes
    assert b.get("p1") is None and b.get("fresh") == b"new"
    lv = b.prefix + "{p2}:v"
    node(redis_cluster, owner(redis_cluster, lv)).rpush(lv, b"a list")  # another type
    assert b.put("p2", b"real") is False and b.counts["put_conflicts"] == 2
    assert node(redis_cluster, owner(redis_cluster, lv)).exists(b.prefix + "{p2}:m") == 0
    v3, m3 = b.prefix + "{p3}:v", b.prefix + "{p3}:m"
    n3 = node(redis_cluster, owner(redis_cluster, v3))
    n3.set(v3, b"ours")
    n3.set(m3, b"4:" + b"0" * 32)  # our bytes, metadata that disagrees
    assert b.put("p3", b"ours") is True and b.get("p3") == b"ours"  # the metadata now agrees with the bytes
    b.clear()
    for key in (v, lv):
        node(redis_cluster, owner(redis_cluster, key)).delete(key)


def test_an_untrusted_usage_counter_refuses_every_write(redis_cluster):
    """The tenant budget fails closed: a planted negative, fractional, signed, spaced, overlong or other-type
    counter refuses the write (counted budget_untrusted); a counter in the form INCRBY writes is honoured."""
    b = backend(redis_cluster, "plantbudget", tenant_budget_bytes=10_000)
    usage = node(redis_cluster, owner(redis_cluster, b._usage_key))
    planted = [b"-1000000", b"12.5", b"+5", b" 5", b"1_000", b"9" * 25, b"\xff"]
    for i, value in enumerate(planted):
        usage.set(b._usage_key, value)
        assert b.put(f"u{i}", b"z" * 2000) is False, value
        assert b.counts["budget_untrusted"] == i + 1 and b.get(f"u{i}") is None
    usage.delete(b._usage_key)
    usage.rpush(b._usage_key, b"1")
    assert b.put("ul", b"z" * 2000) is False and b.counts["budget_untrusted"] == len(planted) + 1
    usage.delete(b._usage_key)
    usage.set(b._usage_key, b"9000")  # trusted: 9000 + 2000 > 10,000 refused, 9000 + 1000 fits
    assert b.put("big", b"z" * 2000) is False and b.counts["budget_refused"] == len(planted) + 2
    assert b.put("fits", b"z" * 1000) is True and b.nbytes == 10_000
    b.clear()


def wait_for_owner(cluster, slots: set[int], port: int, timeout: float = 10.0) -> None:
    """Wait until every live node's ``CLUSTER SLOTS`` names ``port`` as the owner of each of ``slots``."""
    deadline = time.monotonic() + timeout
    while True:
        views = {}
        for p in cluster.roles():  # every live node, masters and replicas
            owners = {
                int(master[1])
                for lo, hi, master, *_ in node(cluster, p).cluster("slots")
                for s in slots
                if lo <= s <= hi
            }
            views[p] = owners
        if all(v == {port} for v in views.values()):
            return
        assert time.monotonic() < deadline, f"the nodes still disagree on who owns {sorted(slots)}: {views}"
        time.sleep(0.05)


class RoundTrips:
    """Counts round trips per node port at the socket (every packed send of a connection: one command, or one
    whole pipeline), independently of the backend's own counts."""

    def __init__(self, monkeypatch) -> None:
        from redis.connection import AbstractConnection

        self.by_port: Counter[int] = Counter()
        send = AbstractConnection.send_packed_command

        def counted(conn, command, check_health=True):
            self.by_port[int(conn.port)] += 1
            return send(conn, command, check_health)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)

    def window(self) -> Counter[int]:
        """The round trips since the last window."""
        out, self.by_port = self.by_port, Counter()
        return out


def test_redirected_reads_are_batched_per_node(redis_cluster, monkeypatch):
    """A prefix's blocks on slots being migrated are re-read in one pipelined round per node they are redirected
    to, not one round trip per block: half-way through the migration (values moved: ASK) and after it (a stale
    slot map: MOVED) — round trips counted per node at the socket, the bytes checked against what was written."""
    b = backend(redis_cluster, "batched")
    items = {f"q{i:02d}": bytes([i]) * (200 + i) for i in range(24)}  # a prompt's 24 blocks
    assert all(b.put_many(items).values()) and b.get_many(items) == items  # every node's connection is open
    owners = {k: owner(redis_cluster, b.prefix + f"{{{k}}}:v") for k in items}
    src_port = Counter(owners.values()).most_common(1)[0][0]
    dst_port = next(p for p in redis_cluster.master_ports() if p != src_port)
    moving = [k for k in items if owners[k] == src_port]
    assert len(moving) >= 4  # several blocks of the prefix on the migrating slots
    src, dst = node(redis_cluster, src_port), node(redis_cluster, dst_port)
    src_id, dst_id = src.cluster("myid").decode(), dst.cluster("myid").decode()
    slots = {k: src.cluster("keyslot", b.prefix + f"{{{k}}}:v") for k in moving}
    for k in moving:  # half-way: every moving block's value is on the new owner, its metadata not yet
        dst.execute_command("CLUSTER", "SETSLOT", slots[k], "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slots[k], "MIGRATING", dst_id)
        src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", b.prefix + f"{{{k}}}:v")
    trips = RoundTrips(monkeypatch)
    assert b.get_many(items) == items  # the values answer ASK: followed, the right bytes
    ask = trips.window()
    others = {p: 1 for p in redis_cluster.master_ports() if p not in (src_port, dst_port)}
    # one round per node, plus one for every redirected value together on the node they were redirected to
    assert ask == Counter({src_port: 1, dst_port: 2, **others}), ask
    assert b.error_counts["ask"] == len(moving) and b.counts["redirect_retries"] == len(moving)
    # a write of a half-migrated block (its value moved, its metadata not) spans both nodes: TRYAGAIN, dropped
    assert b.put(moving[0], items[moving[0]]) is False and b.error_counts["tryagain"] == 1
    for k in moving:  # the migration ends: the metadata moves, every master learns the new owner
        src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", b.prefix + f"{{{k}}}:m")
    for port in redis_cluster.master_ports():
        for slot in set(slots.values()):
            node(redis_cluster, port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    # the replicas learn the new owner by gossip: wait (bounded) until every node says so, since the client re-reads
    # its slot map from a node picked at random, and a replica not yet told would hand it the old map again
    wait_for_owner(redis_cluster, set(slots.values()), dst_port)
    trips.window()
    assert b.get_many(items) == items  # the client's slot map is stale: MOVED for value and metadata, followed
    moved = trips.window()
    assert moved == Counter({src_port: 1, dst_port: 2, **others}), moved
    assert b.error_counts["moved"] == 2 * len(moving) and b.counts["redirect_retries"] == 3 * len(moving)
    assert b.get_many(items) == items  # the slot map re-read (MOVED showed it stale): no redirection any more
    assert b.error_counts["moved"] == 2 * len(moving) and b.counts["redirect_retries"] == 3 * len(moving)
    assert b.counts["slot_map_refreshes"] == 1
    text = ClusterMetrics(b).exposition()  # the redirections, per node and kind, through the exporter
    assert f"memos_cluster_redirect_retries_total {3 * len(moving)}.0" in text
    assert f'memos_cluster_errors_total{{kind="ask",node="127.0.0.1:{src_port}"}} {len(moving)}.0' in text
    assert f'memos_cluster_errors_total{{kind="moved",node="127.0.0.1:{src_port}"}} {2 * len(moving)}.0' in text
    assert "memos_cluster_slot_map_refreshes_total 1.0" in text
    b.clear()


def test_a_redirection_that_never_settles_is_a_bounded_counted_miss():
    """A node that answers every re-sent command with another ASK (or names a node the slot map does not know)
    is followed at most MAX_REDIRECT_ROUNDS times, in one pipeline per round: then a counted failure (a miss)."""
    from redis.exceptions import AskError, MovedError

    from memos_ref.tiering.cluster_nodes import MAX_REDIRECT_ROUNDS, ClusterNodes

    class Node:
        def __init__(self, name: str) -> None:
            self.name = name

    class Pipe:
        def __init__(self, sent: list) -> None:
            self.sent, self.commands = sent, []

        def execute_command(self, *args):
            self.commands.append(args)

        def execute(self, raise_on_error=True):
            self.sent.append(list(self.commands))
            return [b"OK" if c == ("ASKING",) else AskError("7 127.0.0.1:7001") for c in self.commands]

    class Client:
        def __init__(self) -> None:
            self.sent: list = []

        def get_node(self, host=None, port=None, node_name=None):
            name = node_name or f"{host}:{port}"
            return Node(name) if name in ("127.0.0.1:7001", "127.0.0.1:7002") else None

        def get_redis_connection(self, node):
            return type("R", (), {"pipeline": lambda _self, transaction=False: Pipe(self.sent)})()

    counts: Counter[str] = Counter()
    client = Client()
    nodes = ClusterNodes(
        [("127.0.0.1", 7000)], {}, timeout=0.1, retry_after=0, failure_threshold=1, counts=counts, client=client
    )
    asked = [(("GETRANGE", f"k{i}", 0, 10), AskError(f"{i} 127.0.0.1:7002")) for i in range(5)]
    unknown = [(("GETRANGE", "u", 0, 10), MovedError("9 10.9.9.9:7777"))]
    got = nodes.follow(asked + unknown)
    assert got == [None] * 6  # never settled, or nowhere to go: failures, not exceptions
    assert len(client.sent) == MAX_REDIRECT_ROUNDS  # one pipeline per round, every redirected command in it
    assert client.sent[0] == [c for (cmd, _) in asked for c in (("ASKING",), cmd)]
    assert counts["redirect_exhausted"] == 5 and counts["redirect_unknown_node"] == 1
    assert counts["redirect_retries"] == 5 * MAX_REDIRECT_ROUNDS
    assert nodes.error_counts["ask"] == 5 * MAX_REDIRECT_ROUNDS  # every redirect re-answered, counted


def test_acl_user_and_password_pass_through_to_every_node(redis_cluster):
    """AUTH/ACL reach redis-py: a user allowed only its tenant's keys stores and reads them on every master; a wrong
    password is a counted miss and a dropped write; the same user on another tenant's keys is refused by the
    servers (NOPERM): dropped and counted by kind — never an exception, never another tenant's bytes."""
    ports = [n.port for n in redis_cluster.nodes]  # ACLs are per node: masters and replicas alike
    for port in ports:
        node(redis_cluster, port).execute_command(
            "ACL", "SETUSER", "tier", "on", ">s3cret", f"~memos-kv:{FP}:acl:*", "+@all"
        )
    try:
        good = backend(redis_cluster, "acl", username="tier", password="s3cret")
        items = {f"a{i}": bytes([i]) * 64 for i in range(9)}
        assert all(good.put_many(items).values()) and good.get_many(items) == items
        assert {k: good.client_options[k] for k in ("username", "password")} == {
            "username": "tier",
            "password": "s3cret",
        }
        assert len({n for n, c in good.node_counts.items() if c["rounds"]}) == 3  # every master, as this user
        wrong = backend(redis_cluster, "acl", username="tier", password="nope")
        assert wrong.get("a1") is None and wrong.put("a9", b"z") is False and wrong.get_many(items) == {}
        assert wrong.counts["errors"] >= 1 and wrong.counts["dropped_puts"] == 1 and wrong.degraded
        other = backend(redis_cluster, "acl-other", username="tier", password="s3cret")
        assert other.put_many({"b1": b"w", "b2": b"v"}) == {"b1": False, "b2": False}
        assert other.get("b1") is None and other.error_counts["noperm"] >= 3  # two writes and a read refused
        good.clear()
        assert good.keys() == []
    finally:
        for port in ports:
            node(redis_cluster, port).execute_command("ACL", "DELUSER", "tier")


def test_tls_options_pass_through_and_a_failed_handshake_is_a_miss(redis_cluster, monkeypatch):
    """rediss:// and the ssl_* options reach RedisCluster as given; TLS spoken to a node that does not speak it is
    a counted miss and a dropped write, not an exception."""
    import redis.cluster

    seen = []

    class Recorder:
        def __init__(self, **kwargs):
            seen.append(kwargs)
            raise redis.exceptions.ConnectionError("recorded")

    tls = {"ssl_ca_certs": "/ca.pem", "ssl_certfile": "/c.pem", "ssl_keyfile": "/k.pem"}
    with monkeypatch.context() as m:
        m.setattr(redis.cluster, "RedisCluster", Recorder)
        b = ClusterTierBackend("rediss://127.0.0.1:7000", fingerprint=FP, timeout=0.25, **tls)
        assert b.get("k") is None and b.put("k", b"v") is False
        plain = ClusterTierBackend(
            "redis://127.0.0.1:7000", fingerprint=FP, client_kwargs={"ssl_check_hostname": False}
        )
        assert plain.get("k") is None
    assert seen[0]["ssl"] is True and {k: seen[0][k] for k in tls} == tls and seen[0]["socket_timeout"] == 0.25
    assert "ssl" not in seen[-1] and seen[-1]["ssl_check_hostname"] is False
    port = redis_cluster.nodes[0].port
    b = ClusterTierBackend(f"rediss://127.0.0.1:{port}", fingerprint=FP, timeout=0.5)  # a plain-text node
    assert b.get("k") is None and b.put("k", b"v") is False and b.get_many(["k"]) == {}
    assert b.counts["errors"] >= 1 and b.degraded


def test_the_slot_map_is_re_read_from_a_node_left_alone_last():
    """A node that refused a connection is left alone; the slot-map re-read its failure asks for is told to try
    that node last (redis-py shuffles the startup nodes, and a hung node would cost a timeout)."""
    from redis.exceptions import ConnectionError as RedisConnectionError

    from memos_ref.tiering.cluster_nodes import ClusterNodes

    calls: list[dict] = []

    class Manager:
        def initialize(self, additional_startup_nodes_info=None, last_failed_node_name=None):
            calls.append({"last_failed_node_name": last_failed_node_name})

    class Client:
        nodes_manager = Manager()

        def get_node(self, host=None, port=None, node_name=None):
            return type("N", (), {"name": node_name})()

        def get_redis_connection(self, node):
            def pipeline(transaction=False):
                raise RedisConnectionError("refused") from ConnectionRefusedError(111, "refused")

            return type("R", (), {"pipeline": staticmethod(pipeline)})()

    now = [10.0]
    counts: Counter[str] = Counter()
    nodes = ClusterNodes(
        [("h", 1)],
        {},
        timeout=0.1,
        retry_after=5,
        failure_threshold=2,
        counts=counts,
        clock=lambda: now[0],
        client=Client(),
    )
    assert nodes.pipeline("10.0.0.2:7001", lambda pipe: None) is None  # refused: left alone at once
    assert nodes.error_counts["refused"] == 1 and nodes.degraded
    nodes.refresh()
    assert calls == [{"last_failed_node_name": "10.0.0.2:7001"}] and counts["slot_map_refreshes"] == 1
    now[0] += 6  # retry_after passed: no node is left alone any more
    nodes.count("x", RedisConnectionError("reset"))  # the map is stale again
    nodes.refresh()
    assert calls[-1] == {"last_failed_node_name": None} and counts["slot_map_refreshes"] == 2
