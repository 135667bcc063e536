"""Every benchmark runs in --quick mode and keeps the JSON contract (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from memos_ref.bench import BENCHMARKS, get
from memos_ref.errors import ConfigError


@pytest.fixture(scope="module")
def quick_decode(tmp_path_factory):
    plot = tmp_path_factory.mktemp("bench") / "decode.png"
    out = subprocess.run(
        [sys.executable, "-m", "memos_ref.bench", "decode", "--quick", "--json", "--plot", str(plot)],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    ).stdout
    return json.loads(out), plot  # exactly one JSON object on stdout


def test_decode_quick_json_contract(quick_decode):
    report, _ = quick_decode
    assert set(report) == {"bench", "version", "machine", "peers", "config", "results", "summary"}
    summary = report["summary"]
    for key in (
        "concat_over_contiguous_ms_per_token_at_max_ctx",
        "dynamic_over_contiguous_ms_per_token_at_max_ctx",
        "nocache_over_contiguous_ms_per_token_at_max_ctx",
    ):
        assert set(summary[key]) == {"shipped", "wide"}
        assert all(v > 0 for v in summary[key].values())
    assert summary["kv_bytes_per_token"] == {"shipped": 2 * 4 * 2 * 32 * 4, "wide": 2 * 8 * 8 * 64 * 4}
    methods = {(r["method"], r["forward"]) for r in report["results"]}
    assert {("no_cache", "package"), ("dynamic", "transformers"), ("static", "transformers")} <= methods
    # deterministic figure: a contiguous cache preallocated to max_len holds exactly that many tokens
    row = next(r for r in report["results"] if r["method"] == "contiguous" and r["model"] == "wide")
    cfg = report["config"]
    assert row["kv_bytes"] == (row["context"] + cfg["warmup_steps"] + cfg["timed_steps"] + 1) * 2 * 8 * 8 * 64 * 4


@pytest.mark.parametrize("name", sorted(set(BENCHMARKS) - {"decode"}))
def test_other_benchmarks_quick_json_contract(name, capsys):
    """The command line's own ``main`` in this process (``decode`` above runs it as ``python -m`` in a subprocess,
    the way a user does): stdout is exactly one JSON object whatever the benchmark prints while it measures."""
    from memos_ref.bench.__main__ import main

    assert main([name, "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bench"] == name and report["results"] and report["summary"]
    assert get(name).human(report)


def test_growth_counts_are_exact():
    from memos_ref.bench import growth

    report = growth.run(quick=True, progress=False)
    (row,) = [r for r in report["results"] if r["kind"] == "growth"]
    assert (row["old_capacity"], row["new_capacity"]) == (1024, 1536)
    assert row["bytes_copied"] == 2 * 1024 * 32 * 128 * 2  # K and V of every held token, fp16
    for amortised in (r for r in report["results"] if r["kind"] == "amortised"):
        assert amortised["final_capacity"] >= amortised["final_tokens"]
        # geometric series: the copies sum to less than final_capacity / (factor - 1)
        copied = amortised["tokens_copied_by_growth"]
        assert copied < amortised["final_capacity"] / (amortised["growth_factor"] - 1)


def test_every_benchmark_is_registered_and_unknown_names_fail():
    for name in BENCHMARKS:
        module = get(name)
        assert callable(module.run) and callable(module.human) and callable(module.plot)
    with pytest.raises(ConfigError, match="unknown benchmark"):
        get("nope")


def test_plot_and_human_table(quick_decode):
    from memos_ref.bench import decode

    report, plot = quick_decode
    assert "ms/token" in decode.human(report)
    assert plot.stat().st_size > 1000


def test_demo_prints_identical_tokens_for_every_cache(capsys):
    from memos_ref import demo

    demo.main(["--toy", "--new-tokens", "12"])
    out = capsys.readouterr().out
    table = out.split("same tokens", 1)[1].split("columns:", 1)[0]
    assert "True" in table and "False" not in table
    legend = out.split("columns:", 1)[1]
    assert all(f"  {name}" in legend for name in demo.COLUMNS)  # every column explained
    assert "Takeaway: " in out and "identical tokens from every cache" in out


def test_demo_takeaway_is_computed_from_the_rows():
    from memos_ref import demo

    def row(cache, forward, ms, copied, same=True):
        return {
            "cache": cache,
            "forward": forward,
            "ms/token (median)": ms,
            "bytes copied KiB": copied,
            "same tokens": same,
        }

    rows = [
        row("no cache (recompute)", "package", 30.0, "0"),
        row("ConcatCache", "package", 6.0, "1,234"),
        row("ContiguousCache", "package", 5.0, "0"),
        row("DynamicCache", "transformers", 1.0, "—"),  # another forward: not the package's comparison
    ]
    line = demo.takeaway(rows)
    assert "(ContiguousCache) a decode step took 5.0 ms against 30.0 ms recomputing (6.0x faster)" in line
    assert "concatenation moved 1,234 KiB where a preallocated buffer wrote each token once, 0 KiB" in line
    rows[2]["same tokens"] = False
    assert "SOME TOKENS DIFFER" in demo.takeaway(rows)


def test_demo_on_the_real_model_answers_readably(capsys):
    from conftest import _real_model_path

    from memos_ref import demo

    _real_model_path()  # skips (fails in CI) with the command to run when SmolLM2 is not prepared
    demo.main(["--new-tokens", "6"])
    out = capsys.readouterr().out
    assert out.startswith("smollm2-135m-instruct, greedy") and "\nA: " in out
    table = out.split("same tokens", 1)[1].split("columns:", 1)[0]
    assert "True" in table and "False" not in table
