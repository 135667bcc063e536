"""Issue 16 item 7: the four things only a Jetson can tell, as tests that read the ``results.json`` which the
generated ``deploy.sh`` writes on the device. Without one they SKIP, saying so: set ``MEMOS_EDGE_RESULTS`` to the
file brought back (``results/results.json``) to run them. Everything else of the Jetson path is tested without a
device (tests/test_edge_*.py, tests/test_real_edge.py); edge/README.md "What only the device can verify".

1. whether the reuse build (paged context FMHA) builds on sm_87 — ``variant_built``;
2. the KV pool TensorRT-LLM really allocates — ``kv_lines`` against the plan's ``kv_tokens``;
3. tokens/s — ``generation_tokens_per_second`` (gptSessionBenchmark, CUDA graphs) against the planner's bound;
4. the engine's fp16 numerics — ``greedy_vs_reference``: its greedy tokens against ``reference.json``.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

NEEDS_DEVICE = (
    "needs a Jetson Orin: run the generated deploy.sh on the device (edge/README.md section 4) and set "
    "MEMOS_EDGE_RESULTS=results/results.json"
)


def device_results() -> dict[str, Any]:
    """The results.json a device run brought back, or skip with the reason."""
    path = os.environ.get("MEMOS_EDGE_RESULTS")
    if not path:
        pytest.skip(NEEDS_DEVICE)
    return json.loads(Path(path).read_text())


def allocated_tokens(kv_lines: list[str]) -> int | None:
    """The KV tokens TensorRT-LLM reports it allocated (``Max Tokens In Paged KV Cache: N``, any case), if any."""
    found = [int(m.group(1)) for line in kv_lines for m in [re.search(r"max tokens in paged kv cache:\s*(\d+)", line,
                                                                      re.I)] if m]  # fmt: skip
    return found[-1] if found else None


def test_device_1_which_variant_builds_on_sm87():
    res = device_results()
    # reuse = paged context FMHA + block reuse (prefix sharing on the device); safe = NVIDIA's defaults. Only a
    # reuse build "refused" by a rule says paged context FMHA does not build on sm_87; out of memory, a missing
    # tool or a wrong path say nothing about sm_87 (issue 28)
    builds = [(b["variant"], b["class"], b["line"]) for b in res.get("builds", [])]
    assert res["variant_built"] in ("reuse", "safe"), f"no engine built: {builds}"


def test_device_2_the_kv_pool_allocated_is_the_plans():
    res = device_results()
    got = allocated_tokens(res["kv_lines"])
    assert got is not None, "TensorRT-LLM printed no KV pool size: look for it in run.log"
    want = res["plan"]["kv_tokens"]
    assert 0.8 * want <= got <= want, f"allocated {got} tokens, the plan passed {want}: correct the allowances"


def test_device_3_tokens_per_second_under_the_bound():
    res = device_results()
    tps, bound = res["generation_tokens_per_second"], res["plan"].get("decode_bound_batch1")
    if isinstance(tps, dict):  # unreadable: its reason and log; run.py's end-to-end rate is the stated fallback
        tps = res.get("run_py_tokens_per_second")
    assert isinstance(tps, (int, float)), f"no tokens/s: {res['generation_tokens_per_second']}"
    assert bound is None or tps <= bound, f"{tps} tok/s beats the bandwidth bound {bound}: the bound is wrong"


def test_device_4_engine_greedy_tokens_equal_the_reference():
    res = device_results()
    match = res["greedy_vs_reference"]
    assert "error" not in match, f"no token comparison: {match}"
    assert match["equal_prefix"] == match["reference"], f"fp16 engine diverged at token {match['equal_prefix']}"


def test_the_device_checks_read_what_deploy_sh_writes(tmp_path, monkeypatch):
    # the four checks above, run here on a results.json shaped like deploy.sh's (tests/test_edge_deploy.py runs the
    # script with stand-in tools): they pass on a good run and fail on a bad one, so they cannot pass vacuously
    good = {"variant_built": "safe", "plan": {"kv_tokens": 176000, "decode_bound_batch1": 232.38},
            "kv_lines": ["[TensorRT-LLM][INFO] Max Tokens In Paged KV Cache: 170112"],
            "generation_tokens_per_second": 180.0,
            "greedy_vs_reference": {"equal_prefix": 8, "reference": 8, "engine": [1] * 8}}  # fmt: skip
    checks = [test_device_1_which_variant_builds_on_sm87, test_device_2_the_kv_pool_allocated_is_the_plans,
              test_device_3_tokens_per_second_under_the_bound,
              test_device_4_engine_greedy_tokens_equal_the_reference]  # fmt: skip
    path = tmp_path / "results.json"
    monkeypatch.setenv("MEMOS_EDGE_RESULTS", str(path))
    path.write_text(json.dumps(good))
    for check in checks:
        check()
    bad = {**good, "variant_built": "failed", "kv_lines": ["max tokens in paged kv cache: 9000"],
           "generation_tokens_per_second": 400.0,
           "greedy_vs_reference": {"equal_prefix": 3, "reference": 8}}  # fmt: skip
    unreadable = {**good, "generation_tokens_per_second": {"error": "no [BENCHMARK] line", "log": "results/bench.log"},
                  "run_py_tokens_per_second": {"error": "no latency line", "log": "results/run.log"},
                  "greedy_vs_reference": {"error": "run.py wrote no out.csv", "log": "results/run.log"}}  # fmt: skip
    path.write_text(json.dumps(unreadable))
    for check in checks[2:]:
        with pytest.raises(AssertionError, match=r"no tokens/s|no token comparison"):
            check()
    path.write_text(json.dumps(bad))
    for check in checks:
        with pytest.raises(AssertionError):
            check()
    monkeypatch.delenv("MEMOS_EDGE_RESULTS")
    with pytest.raises(pytest.skip.Exception, match="needs a Jetson Orin"):
        device_results()
