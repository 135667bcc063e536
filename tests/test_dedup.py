"""Issue 15, "ideas exist in 2-4 copies": the shared pieces behave the same for each of their users.

* one Prometheus mechanism (:mod:`memos_ref.promutil`) under the paged pool's, the short-term memory's and the
  tiers' exporters — each still exposes exactly the metric families (names, types, labels) it exposed when it
  was a collector of its own (the lists below were read from the three old collectors' expositions);
* one LRU bookkeeping (:class:`memos_ref.lru.SizedLRU`) under the short-term memory store and the tier
  backends' byte budgets, checked against the ``OrderedDict`` bookkeeping each wrote by hand before.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.parser import text_string_to_metric_families

from memos_ref.lru import SizedLRU
from memos_ref.memory import MemoryBackend, MemoryMetrics, TTLStore
from memos_ref.metrics import PagedMetrics
from memos_ref.paged import PagedKV
from memos_ref.promutil import ScrapeExporter, counter, family_types, gauge
from memos_ref.spec import KVSpec
from memos_ref.tiering.backends import HostMemoryBackend
from memos_ref.tiering.manager import TierManager
from memos_ref.tiering.metrics import TierMetrics
from memos_ref.tiering.store import Tier, TierStore

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=8, dtype=torch.float32)

# (family, type, label names) of each exporter before the merge, as the three old collectors exposed them
_C, _G = "counter", "gauge"
OLD_FAMILIES = {
    "paged": {
        ("memos_kv_allocate_seconds", "histogram", ("le",)),
        ("memos_kv_blocks_active", _G, ()),
        ("memos_kv_blocks_cached", _G, ()),
        ("memos_kv_blocks_free", _G, ()),
        ("memos_kv_blocks_total", _G, ()),
        ("memos_kv_evictions", _C, ()),
        ("memos_kv_prefix_hit_tokens", _C, ()),
        ("memos_kv_prefix_query_tokens", _C, ()),
        ("memos_kv_slot_utilization", _G, ()),
    },
    "memory": {
        ("memos_memory_bytes", _G, ("backend",)),
        ("memos_memory_computations", _C, ("backend",)),
        ("memos_memory_entries", _G, ("backend",)),
        ("memos_memory_evictions", _C, ("backend", "reason")),
        ("memos_memory_hits", _C, ("backend",)),
        ("memos_memory_misses", _C, ("backend",)),
        ("memos_memory_negative_hits", _C, ("backend",)),
        ("memos_memory_sets", _C, ("backend",)),
    },
    "tier": {
        ("memos_tier_decided_recompute", _C, ()),
        ("memos_tier_decided_reload", _C, ()),
        ("memos_tier_device_utilization", _G, ()),
        ("memos_tier_recomputed_tokens", _C, ()),
        ("memos_tier_reload_failed", _C, ()),
        ("memos_tier_reloaded_tokens", _C, ()),
        ("memos_tier_swap_in_blocks", _C, ()),
        ("memos_tier_swap_in_bytes", _C, ()),
        ("memos_tier_swap_out_blocks", _C, ()),
        ("memos_tier_swap_out_bytes", _C, ()),
        ("memos_tier_swap_rate", _G, ()),
        ("memos_tier_tier_blocks", _G, ("tier",)),
        ("memos_tier_tier_bytes", _G, ("tier",)),
        ("memos_tier_tier_corrupt", _C, ("tier",)),
        ("memos_tier_tier_degraded", _G, ("tier",)),
        ("memos_tier_write_backs", _C, ()),
    },
}


def _exporters() -> dict[str, ScrapeExporter]:
    kv = PagedKV(SPEC, 16, fingerprint="fp")
    memory = MemoryBackend(shards=2)
    memory.set("a", 1)
    memory.get("a")
    memory.get("b")
    store = TierStore([Tier(HostMemoryBackend(1 << 20))], spec=SPEC, fingerprint="fp")
    return {"paged": PagedMetrics(kv), "memory": MemoryMetrics(memory), "tier": TierMetrics(TierManager(kv, store))}


def _families(text: str) -> set[tuple[str, str, tuple[str, ...]]]:
    return {
        (f.name, f.type, tuple(sorted({k for s in f.samples for k in s.labels})))
        for f in text_string_to_metric_families(text)
        if not f.name.endswith("_created")  # the histogram's creation time, present or not by client version
    }


@pytest.mark.parametrize("user", sorted(OLD_FAMILIES))
def test_every_exporter_uses_the_one_mechanism_and_exposes_what_it_did(user):
    exporter = _exporters()[user]
    assert isinstance(exporter, ScrapeExporter)
    assert _families(exporter.exposition()) == OLD_FAMILIES[user]


def test_exporters_read_at_scrape_time():
    """No copy to keep in sync: a change shows in the next scrape."""
    backend = MemoryBackend(shards=1)
    metrics = MemoryMetrics(backend)
    assert "memos_memory_sets_total" not in metrics.exposition()  # a counter the backend has not started
    backend.set("k", 1)
    assert 'memos_memory_sets_total{backend="memory"} 1.0' in metrics.exposition()


def _expose(*families) -> str:
    class Fixed:
        def collect(self):
            yield from families

    registry = CollectorRegistry()
    registry.register(Fixed())
    return generate_latest(registry).decode()


def test_counter_and_gauge_helpers_build_what_prometheus_client_builds():
    labelled = CounterMetricFamily("x_hits", "hits", labels=["backend", "kind"])
    labelled.add_metric(["memory", "a"], 2)
    labelled.add_metric(["redis", "b"], 3)
    plain = GaugeMetricFamily("x_size", "entries", value=7)
    by_hand = _expose(labelled, plain)
    helped = _expose(
        counter("x_hits", "hits", labels=["backend", "kind"], samples=[(["memory", "a"], 2), (["redis", "b"], 3)]),
        gauge("x_size", "entries", 7),
    )
    assert helped == by_hand
    assert family_types(helped) == {"x_hits": "counter", "x_size": "gauge"}


def test_exporters_have_their_own_registries():
    a, b = MemoryMetrics(MemoryBackend(shards=1)), MemoryMetrics(MemoryBackend(shards=1), prefix="other")
    assert a.registry is not b.registry
    renamed = {name.replace("memos_memory", "other") for name in family_types(a.exposition())}
    assert set(family_types(b.exposition())) == renamed


# ---------------------------------------------------------------------- one LRU bookkeeping
_OPS = st.lists(
    st.tuples(st.sampled_from(["put", "touch", "pop", "oldest"]), st.integers(0, 7), st.integers(1, 50)),
    max_size=80,
)


@settings(max_examples=60, deadline=None)
@given(_OPS)
def test_sized_lru_matches_an_ordered_dict_model(ops):
    """SizedLRU against the OrderedDict bookkeeping both stores wrote by hand before."""
    lru, model = SizedLRU(int), OrderedDict()
    for op, k, size in ops:
        key = f"k{k}"
        if op == "put":
            lru.put(key, size)
            model.pop(key, None)
            model[key] = size
        elif op == "touch" and key in model:
            lru.touch(key)
            model.move_to_end(key)
        elif op == "pop" and key in model:
            assert lru.pop(key) == model.pop(key)
        elif op == "oldest":
            assert lru.oldest(exclude=key) == next((x for x in model if x != key), None)
        assert list(lru) == list(model) and lru.total == sum(model.values()) and len(lru) == len(model)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 11)), max_size=60))
def test_both_users_evict_the_least_recently_used(trace):
    """The memory store (policy "lru", 4 entries) and the host tier (a budget of 4 equal blocks) replay one trace
    of reads and writes and keep the same keys as an OrderedDict LRU of 4 — the same bookkeeping under both."""
    store = TTLStore(max_entries=4, policy="lru", default_ttl=None)
    tier = HostMemoryBackend(4 * 8, pin=False)
    model: OrderedDict[str, None] = OrderedDict()
    for write, k in trace:
        key = f"{k:02d}" * 4  # a valid block key and a valid memory key
        if write:
            store.set(key, "x")
            tier.put(key, b"8 bytes!")
            model.pop(key, None)
            model[key] = None
            while len(model) > 4:
                model.popitem(last=False)
        else:
            store.get(key)
            tier.get(key)
            if key in model:
                model.move_to_end(key)
    assert [e.key for e in store.entries()] == list(model) == tier.keys()
    assert store.bytes == sum(e.size_bytes for e in store.entries()) and tier.nbytes == 8 * len(model)
