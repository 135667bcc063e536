"""Faults while an engine's requests run through the cluster tier: a slot range migrated mid-run (clients see
``ASK`` while its keys move, then ``MOVED``) and a master SIGSTOPped, then SIGCONTed. Used by ``bench cluster``
and tests/test_cluster_faults.py.

Each fault is interleaved with *rounds* of requests. A round is a fresh engine and pool (so every prompt reads the
tier) over one tier client kept across rounds, as a long-running process keeps it (so its slot map goes stale);
a round's requests are submitted together and are in flight together. Every public call the engine makes on the
tier is timed from outside (:class:`TimedCalls`), so the slowest call is measured independently of the backend's
own account. Reported per fault: requests lost, wrong tokens (against the same prompts served together without a
tier), the tier errors the engine caught, the misses and dropped writes the tier counted, its errors by kind, and
the slowest call against the configured timeout.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

__all__ = ["FaultRun", "TimedCalls", "hung_node_mid_run", "migrate_slots_mid_run"]

_TIMED = ("get", "get_many", "put", "put_many", "read_ahead", "contains", "delete")
_MAX_SLOTS = 64  # the most slots one migration moves (each is a few commands per master)


class TimedCalls:
    """Wraps a backend's public calls (on the instance) to record the slowest one and any that raised."""

    def __init__(self, backend: Any) -> None:
        self.slowest_s, self.calls, self.raised = 0.0, 0, 0
        for name in _TIMED:
            setattr(backend, name, self._timed(getattr(backend, name)))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            except BaseException:
                self.raised += 1
                raise
            finally:
                self.calls += 1
                self.slowest_s = max(self.slowest_s, time.perf_counter() - started)

        return call


class FaultRun:
    """Rounds of requests through one cluster tier client (see the module docstring).

    Args:
        model: the model every round's engine serves (the bench's shipped model).
        cluster: a started :class:`~memos_ref.tiering.cluster_server.ClusterServer`.
        namespace: the tier's key namespace (one per fault, so faults do not share blocks).
        prompts: token ids of the requests of every round.
        new: tokens generated per request.
        timeout: the tier's socket timeout, seconds.
        retry_after: seconds a node that refused or timed out is left alone.
    """

    def __init__(
        self,
        model: Any,
        cluster: Any,
        namespace: str,
        prompts: list[list[int]],
        new: int,
        timeout: float,
        retry_after: float = 0.5,
    ) -> None:
        from memos_ref.engine import Engine
        from memos_ref.model import model_fingerprint
        from memos_ref.paged import PagedKV
        from memos_ref.tiering.cluster import ClusterTierBackend

        self.model, self.cluster, self.prompts, self.new, self.timeout = model, cluster, prompts, new, timeout
        self.spec, self.fp = model.kv_spec(block_size=16), model_fingerprint(model)
        self.backend = ClusterTierBackend(
            cluster.startup_nodes, fingerprint=self.fp, namespace=namespace, timeout=timeout, retry_after=retry_after
        )
        self.timed = TimedCalls(self.backend)
        kv = PagedKV(self.spec, 256, fingerprint=self.fp)
        self.expected = [r.output for r in self._serve(Engine(model, kv))]  # together, without a tier
        t = self.spec.block_size
        self.keys = [h.hex() for p in prompts for h in kv.prefix_cache.hashes(p[: (len(p) - 1) // t * t])]
        self.rounds: list[dict[str, Any]] = []
        self.totals: Counter[str] = Counter()
        self._before: tuple[Counter[str], Counter[str]] = (Counter(), Counter())

    def fault_starts(self) -> None:
        """From now on the tier's counts (misses, dropped writes, errors) are the fault's: the rounds before it
        (publishing into an empty tier) are not counted."""
        self._before = (Counter(self.backend.counts), Counter(self.backend.error_counts))

    def _serve(self, engine: Any) -> list[Any]:
        from memos_ref.engine import Request

        requests = [engine.submit(Request(p, max_new_tokens=self.new)) for p in self.prompts]
        engine.run()
        return requests

    def rkey(self, key: str) -> str:
        """The Redis key of a block's value (its slot is the block's slot)."""
        return f"{self.backend.prefix}{{{key}}}:v"

    def round(self, label: str, probes: dict[str, bytes] | None = None) -> dict[str, Any]:
        """Serve every prompt once on a fresh pool over the shared tier client; ``probes``: another agent's new
        blocks, written while the requests are queued (writes during the fault)."""
        from memos_ref.engine import Engine
        from memos_ref.paged import PagedKV
        from memos_ref.tiering.manager import TierManager
        from memos_ref.tiering.store import Tier, TierStore

        self.backend.forget_read_ahead(self.keys)
        kv = PagedKV(self.spec, 256, fingerprint=self.fp)
        TierManager(kv, TierStore([Tier(self.backend)], spec=self.spec, fingerprint=self.fp), reload="always")
        engine = Engine(self.model, kv, publish_to="cluster")
        started = time.perf_counter()
        if probes:
            try:
                stored = self.backend.put_many(probes)
            except Exception:  # counted by TimedCalls (calls_raised): a fault the tier must have absorbed
                stored = dict.fromkeys(probes, False)
            self.totals["probe_writes"] += len(stored)
            self.totals["probe_dropped"] += len(stored) - sum(stored.values())
        requests = self._serve(engine)
        row = {
            "round": label,
            "seconds": time.perf_counter() - started,
            "reused_tokens": sum(r.stats.reused_tokens for r in requests),
            "lost": sum(r.failed or not r.finished for r in requests),
            "wrong": sum(r.output != e for r, e in zip(requests, self.expected, strict=True)),
            "tier_errors": engine.tier_counts["tier_errors"],
            "published_blocks": engine.tier_counts["published_blocks"],
            "publish_dropped": engine.tier_counts["publish_dropped"],
        }
        for k in ("lost", "wrong", "tier_errors", "publish_dropped"):
            self.totals[k] += row[k]
        self.totals["requests"] += len(requests)
        self.rounds.append(row)
        return row

    def report(self, **extra: Any) -> dict[str, Any]:
        """The figures of every round so far (see the module docstring)."""
        b = self.backend
        counts, errors = Counter(b.counts) - self._before[0], Counter(b.error_counts) - self._before[1]
        out = {
            "requests": self.totals["requests"],
            "requests_lost": self.totals["lost"],
            "wrong_kv": self.totals["wrong"],
            "tier_errors": self.totals["tier_errors"],  # a tier call that raised into the engine (caught there)
            "calls_raised": self.timed.raised,
            "full_blocks": len(self.keys),
            "misses": counts.get("misses", 0) + counts.get("read_ahead_misses", 0),
            "dropped_writes": counts.get("dropped_puts", 0),
            "put_conflicts": counts.get("put_conflicts", 0),  # a recomputed block's bytes differ: kept the first
            "probe_writes": self.totals["probe_writes"],
            "probe_dropped": self.totals["probe_dropped"],
            "redirect_retries": counts.get("redirect_retries", 0),
            "node_down_skips": counts.get("node_down_skips", 0),
            "errors_by_kind": dict(errors),
            "tier_calls": self.timed.calls,
            "slowest_call_s": self.timed.slowest_s,  # one public call, timed from outside
            "slowest_network_call_s": b.slowest_call_s,  # one pipeline or cluster-client command, the backend's
            "slowest_round_trip_s": b.slowest_round_trip_s,  # one pipeline to one node: at most one timeout of waiting
            "timeout_s": self.timeout,
            "rounds": self.rounds,
            **extra,
        }
        b.close()
        return out


def _node(port: int, timeout: float = 5.0) -> Any:
    import redis

    return redis.Redis(host="127.0.0.1", port=port, socket_timeout=timeout)


def _owner(run: FaultRun, key: str) -> int:
    return int(run.backend.client.get_node_from_key(run.rkey(key)).port)


def _probes_in(run: FaultRun, slots: set[int], per_slot: int = 1) -> dict[str, bytes]:
    """Block keys of another agent whose slots are in ``slots`` (found by hashing names, bounded)."""
    from redis.crc import key_slot

    wanted, data, out = Counter({s: per_slot for s in slots}), os.urandom(4096), {}
    for n in range(400_000):
        name = f"probe{n}"
        slot = key_slot(run.rkey(name).encode())
        if wanted[slot] > 0:
            wanted[slot] -= 1
            out[name] = data
            if not +wanted:
                break
    return out


def _move_keys(src: Any, dst_port: int, slot: int, suffix: str | None) -> int:
    """MIGRATE the keys of ``slot`` on ``src`` (only those ending in ``suffix`` when given) to ``dst_port``."""
    moved = 0
    for _ in range(100):  # bounded: 100 batches of 100 keys
        listed = [k.decode() if isinstance(k, bytes) else k for k in src.cluster("getkeysinslot", slot, 100)]
        keys = [k for k in listed if suffix is None or k.endswith(suffix)]
        if not keys:
            return moved
        src.execute_command("MIGRATE", "127.0.0.1", dst_port, "", 0, 5000, "KEYS", *keys)
        moved += len(keys)
        if suffix is not None:
            return moved
    return moved


def migrate_slots_mid_run(
    model: Any, cluster: Any, namespace: str, prompts: list[list[int]], new: int = 3, timeout: float = 0.2
) -> dict[str, Any]:
    """Publish the prompts' blocks, then migrate every slot holding them on one master to another while rounds of
    requests run: first half-way (the blocks' values moved, their metadata not: reads and writes answer ``ASK``),
    then to the end (``CLUSTER SETSLOT NODE``: the client's stale slot map answers ``MOVED``), then once more."""
    run = FaultRun(model, cluster, namespace, prompts, new, timeout)
    run.round("publish")  # the tier is empty: every full block is computed and published
    run.fault_starts()
    by_owner = Counter(_owner(run, k) for k in run.keys)
    src_port = by_owner.most_common(1)[0][0]
    dst_port = next(p for p in cluster.master_ports() if p != src_port)
    src, dst = _node(src_port), _node(dst_port)
    on_src = [k for k in run.keys if _owner(run, k) == src_port]
    slots = sorted({src.cluster("keyslot", run.rkey(k)) for k in on_src})[:_MAX_SLOTS]
    src_id, dst_id = src.cluster("myid").decode(), dst.cluster("myid").decode()
    started = time.perf_counter()
    moved = 0
    for slot in slots:  # half-way: IMPORTING/MIGRATING, the values moved
        dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        moved += _move_keys(src, dst_port, slot, ":v")
    run.round("migrating", _probes_in(run, set(slots)))
    for slot in slots:  # to the end: the rest moved, every master told the slot's new owner
        moved += _move_keys(src, dst_port, slot, None)
        for port in [dst_port, src_port, *(p for p in cluster.master_ports() if p not in (src_port, dst_port))]:
            _node(port).execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    migration_s = time.perf_counter() - started
    run.round("moved", _probes_in(run, set(slots)))
    after = run.round("after")["reused_tokens"]
    return run.report(
        slots_migrated=len(slots),
        keys_migrated=moved,
        migration_s=migration_s,
        after_reused_tokens=after,
        blocks_on_moved_slots=len(on_src),
        moved_to_new_owner=all(_owner(run, k) == dst_port for k in on_src),
    )


def hung_node_mid_run(
    model: Any,
    cluster: Any,
    namespace: str,
    prompts: list[list[int]],
    new: int = 3,
    timeout: float = 0.2,
    pause_s: float = 5.0,
) -> dict[str, Any]:
    """Publish the prompts' blocks, SIGSTOP the master holding the first prompt's first block, serve a round of
    requests while it is stopped (a timer SIGCONTs it after ``pause_s``: longer than the cluster's node timeout,
    so its replica may be promoted meanwhile), then, once the cluster is whole again, another round."""
    run = FaultRun(model, cluster, namespace, prompts, new, timeout, retry_after=0.5)
    run.round("publish")
    run.fault_starts()
    victim = _owner(run, run.keys[0])
    resumed = threading.Timer(pause_s, cluster.resume, [victim])
    cluster.pause(victim)
    paused = time.perf_counter()
    resumed.start()
    try:
        run.round("paused", {f"hung-probe{i}": os.urandom(4096) for i in range(12)})
        paused_round_s = time.perf_counter() - paused
    finally:
        resumed.join(pause_s + 5)
        if cluster.node(victim).stopped:  # the timer did not fire (it always does; never leave a node stopped)
            cluster.resume(victim)
    healed_s = cluster.wait_healthy(60)
    time.sleep(run.backend.retry_after)  # the node left alone is tried again
    after = run.round("resumed")["reused_tokens"]
    return run.report(
        pause_s=pause_s,
        paused_round_s=paused_round_s,
        healed_after_resume_s=healed_s,
        victim_failed_over=victim not in cluster.master_ports(),
        after_reused_tokens=after,
    )
