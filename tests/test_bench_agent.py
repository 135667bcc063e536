"""``bench agent``: the real model's KV geometry beside the shipped one (geometry only, no forward with its
weights). The replay itself runs in test_bench_and_demo's ``--quick --json`` contract test; these tests check the
geometry arithmetic, the report's labels and the human output without replaying a trace."""

from __future__ import annotations

import pytest

from memos_ref.bench import agent
from memos_ref.errors import ConfigError


def test_real_geometry_is_23_kib_of_fp16_kv_per_token():
    g = agent.REAL_GEOMETRY
    assert (g.num_layers, g.num_kv_heads, g.head_dim, g.num_q_heads, g.block_size) == (30, 3, 64, 9, 16)
    assert g.bytes_per_token == 30 * 2 * 3 * 64 * 2 == 23_040  # 22.5 KiB ("23 KiB" in the issue)
    assert g.bytes_per_block == 16 * 23_040


def test_real_geometry_figures_price_the_run_counts():
    row = {"peak_blocks": 40, "prefill_total": 5493, "prefill_computed": 1493}
    assert agent.real_geometry_figures(row) == {
        "peak_kv_bytes": 40 * 16 * 23_040,
        "prefill_kv_bytes_written": 1493 * 23_040,
        "prefill_kv_bytes_reused": 4000 * 23_040,
    }


def test_unknown_model_is_refused_before_any_work():
    with pytest.raises(ConfigError, match="model must be"):
        agent.run(quick=True, progress=False, model="llama-3-8b")


def _report() -> dict:
    rows = []
    for reuse, peak, computed in ((True, 10, 300), (False, 20, 1000)):
        row = {"trace": "chat", "reuse": reuse, "requests": 3, "prefill_total": 1000, "prefill_computed": computed,
               "peak_blocks": peak, "ttft_median_s": 0.1, "tokens_per_s": 5.0, "preemptions": 0}  # fmt: skip
        rows.append({**row, **{f"real_geometry_{k}": v for k, v in agent.real_geometry_figures(row).items()}})
    summary = {
        "chat": {
            "prefill_tokens_saved_fraction": 0.7,
            "real_geometry_peak_kv_bytes": {"with_reuse": 10 * 16 * 23_040, "without": 20 * 16 * 23_040},
            "real_geometry_prefill_kv_bytes_not_recomputed": 700 * 23_040,
        }
    }
    geometries = {agent.REAL_NAME: agent._geometry(agent.REAL_GEOMETRY, "geometry only")}
    return {"config": {"geometries": geometries, "real_weights": False}, "results": rows, "summary": summary}


def test_human_output_says_which_figures_are_geometry_only():
    text = agent.human(_report())
    assert "smollm2-135m-instruct geometry" in text and "GEOMETRY ONLY" in text
    assert "no forward with its weights" in text
    assert "23,040 bytes per token" in text
    assert "chat: peak KV 3.5 MiB with reuse vs 7.0 MiB without; prefill KV not recomputed 15.4 MiB" in text
    # the summary line of the shipped run keeps its old form (no nested geometry dicts in it)
    assert "chat: prefill_tokens_saved_fraction=0.700" in text.splitlines()


def test_quick_skips_the_real_weights_case_and_says_why():
    case = agent._real_weights_case(quick=True)
    assert case["ran"] is False and "--model smollm2-135m-instruct" in case["why"]
    text = agent.human({"config": {}, "results": [], "summary": {f"{agent.REAL_NAME}_real_weights": case}})
    assert "real weights: not run" in text


def test_real_weights_agents_refuses_a_bad_agent_count():
    with pytest.raises(ConfigError, match="agents must be"):
        agent.real_weights_agents(None, None, agents=0)
    with pytest.raises(ConfigError, match="agents must be"):
        agent.real_weights_agents(None, None, agents=len(agent.REAL_TASKS) + 1)


def test_model_option_asks_for_the_real_weights_even_under_quick():
    # regression: run() rebound its ``model`` argument to the shipped forward before deciding, so
    # ``bench agent --quick --model smollm2-135m-instruct`` silently skipped the real weights
    assert agent.wants_real_weights(quick=True, model=agent.REAL_NAME)
    assert not agent.wants_real_weights(quick=True, model=None)
    assert not agent.wants_real_weights(quick=True, model="shipped")
    assert agent.wants_real_weights(quick=False, model=None)
