"""bench decode's side-by-side timing and its summary (no timing is asserted: fake clocks and fake results)."""

from __future__ import annotations

import pytest
import torch

from memos_ref.bench import common, decode
from memos_ref.spec import KVSpec


def test_time_interleaved_runs_one_of_each_per_round_in_rotated_order():
    order: list[str] = []
    calls = {name: (lambda name=name: order.append(name)) for name in ("a", "b", "c")}
    samples = common.time_interleaved_ms(calls, {"a": 3, "b": 3, "c": 1}, warmup=1)
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 1}
    # warm-up round a b c, then rounds starting at b, c, a; c sits out once it has its one sample
    assert order == ["a", "b", "c", "b", "c", "a", "a", "b", "a", "b"]


def test_ratio_stats_are_per_round():
    stats = common.ratio_stats([2.0, 9.0, 4.0], [1.0, 3.0, 4.0])
    assert (stats["median"], stats["min"], stats["max"]) == (2.0, 1.0, 3.0)
    assert stats["of_medians"] == pytest.approx(4.0 / 3.0, abs=1e-3)
    assert common.ratio_stats([], [])["median"] is None  # JSON-safe, no NaN


class _Model:
    def __init__(self, spec: KVSpec) -> None:
        self.spec = spec

    def kv_spec(self) -> KVSpec:
        return self.spec


def _row(model, method, forward, samples, ctx=64):
    return {"model": model, "method": method, "forward": forward, "context": ctx, "samples_ms": samples,
            "ms_per_token": sorted(samples)[len(samples) // 2]}  # fmt: skip


def test_summary_keeps_the_old_fields_and_adds_pool_size_slowdown_and_targets():
    spec = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    models = {name: (_Model(spec), None) for name in ("shipped", "wide", decode.SMOLLM2)}
    results = []
    for model in models:
        for forward in ("package", "transformers"):
            for method in decode.METHODS:
                if method.forward == forward:
                    slow = 2.0 if method.name.startswith("paged") else 1.0
                    big = 1.5 if method.name == "paged_pool16x" and model == "wide" else 1.0
                    results.append(_row(model, method.name, forward, [slow * big, slow * big * 1.1, slow * big]))
    summary = decode._summary(results, models, quick=True)
    for key in decode.RATIOS:
        assert set(summary[key]) == set(decode.CLASSIC_MODELS)
    assert summary["paged_over_contiguous_ms_per_token_at_max_ctx"]["shipped"] == 2.0
    assert summary["paged_pool_size_slowdown"]["wide"] == {"package": 1.5, "transformers": 1.5}
    assert summary["paged_pool_size_slowdown"]["shipped"] == {"package": 1.0, "transformers": 1.0}
    assert summary["paged_pool_size_slowdown_max"] == 1.5
    targets = summary["targets_wide_at_max_ctx"]
    assert targets["paged_pool_size_slowdown_package"]["met"] is False
    assert targets["paged_over_dynamic_transformers"] == {
        "value": 2.0,
        "min": 2.0,
        "max": 2.0,
        "target": 1.15,
        "met": False,
    }
    assert summary["kv_bytes_per_token_fp16"][decode.SMOLLM2] == spec.bytes_per_token // 2
    assert summary["ratios"]["paged_over_dynamic_transformers"][decode.SMOLLM2]["median"] == 2.0


def test_smollm2_geometry_is_23040_fp16_bytes_per_token():
    g = decode.SMOLLM2_GEOMETRY
    assert g["num_hidden_layers"] * 2 * g["num_key_value_heads"] * g["head_dim"] * 2 == 23_040


def test_decode_targets_times_exactly_the_contenders_the_targets_compare() -> None:
    from memos_ref.bench import decode, decode_targets, report

    out = decode_targets.run(quick=True, progress=False)
    got = {(r["forward"], r["method"]) for r in out["results"]}
    assert got == {(f, m) for f, ms in decode_targets.CONTENDERS.items() for m in ms}
    assert all(r["context"] == 128 and len(r["samples_ms"]) == 3 for r in out["results"])
    targets = out["summary"]["targets_wide_at_max_ctx"]
    assert set(targets) == set(decode.TARGETS)
    for key, t in targets.items():  # each verdict follows its own measured median and bound
        assert t["met"] == (t["value"] <= decode.TARGETS[key]) and t["min"] <= t["value"] <= t["max"]
    text = report._decode(out)  # the README renderer reads this shape
    assert "paged in a 16× larger pool" in text and "Engine (4 rows" in text
