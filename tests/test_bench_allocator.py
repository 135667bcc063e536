"""``bench allocator``: interleaved, shuffled, paired ratios; peers pinned, fetched and recorded with versions."""

from __future__ import annotations

import io
import json
import statistics
import tarfile
import zipfile
from pathlib import Path

import pytest

from memos_ref.bench import allocator as bench
from memos_ref.bench import peers

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_gc_between_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench.run collects garbage before every timed run so no contender is billed for another's; with a test
    process's heap (torch, transformers) each collection takes most of a second on a loaded machine, and these
    tests check what is run, in which order and how it is summarised, not the timing hygiene."""
    monkeypatch.setattr(bench.gc, "collect", lambda *args: 0)


def _fake_runner(times: dict[int, list[float]]):
    """A contender whose 'CPU seconds' are scripted per pool, one value per call, in call order."""

    def run(num_blocks, trace, rounds):
        return {"seconds": times[num_blocks].pop(0)}

    return run


def test_bench_allocator_reports_median_min_max_and_ours_over_each_contender(monkeypatch, no_gc_between_runs):
    runners = {"ours": bench._run_ours, "deque": bench._run_deque, "peer": bench._run_deque}
    monkeypatch.setattr(bench, "_contenders", lambda: (runners, {"peer": "the deque baseline again"}, {}))
    report = bench.run(quick=True, progress=False, repeats=2)
    for row in report["results"]:
        assert len(row["seconds_all"]) == row["repeats"] == 2
        assert row["seconds_min"] <= row["seconds"] <= row["seconds_max"]
    summary = report["summary"]
    for key in ("small", "large"):
        low, high = summary[f"ours_over_peer_pool_{key}_min_max"]
        assert low <= summary[f"ours_over_peer_pool_{key}"] <= high
        assert summary[f"ours_over_peer_pool_{key}_pairs"] == 2
    assert report["config"]["interleaved"] is True


def test_ratios_are_paired_per_repeat_not_a_ratio_of_medians(monkeypatch, no_gc_between_runs):
    """Each repeat's ratio uses the two runs of that repeat: with scripted times where the ratio of medians
    (2.0 / 2.0 = 1.0) differs from every paired ratio (0.5 or 2.0), the summary reports the paired ones."""
    ours_times = {4096: [1.0, 4.0, 2.0], 65_536: [1.0, 1.0, 1.0]}
    peer_times = {4096: [2.0, 2.0, 1.0], 65_536: [1.0, 1.0, 1.0]}
    stats = {"prefix_hit_tokens": 1, "prefix_query_tokens": 2}

    def ours(num_blocks, trace, rounds, latencies=None):
        if latencies is not None:  # the separate probed run
            latencies.append(1e-6)
            return {"seconds": 0.0, "stats": stats}
        return {"seconds": ours_times[num_blocks].pop(0), "stats": stats}

    runners = {"ours": ours, "deque": _fake_runner({4096: [1.0] * 3, 65_536: [1.0] * 3}), "peer": None}
    runners["peer"] = _fake_runner(peer_times)
    monkeypatch.setattr(bench, "_contenders", lambda: (runners, {}, {}))
    monkeypatch.setattr(bench, "_run_ours", ours)
    report = bench.run(quick=True, progress=False, repeats=3)
    s = report["summary"]
    # pairs: 1/2, 4/2, 2/1 -> median 2.0, min 0.5, max 2.0; the ratio of medians would be 2.0/2.0 = 1.0
    assert s["ours_over_peer_pool_small"] == statistics.median([0.5, 2.0, 2.0]) == 2.0
    assert s["ours_over_peer_pool_small_min_max"] == [0.5, 2.0]
    assert s["ours_vs_peer_pool_small_verdict"] == "inconclusive"  # the spread straddles 1
    assert s["ours_vs_peer_pool_large_verdict"] == "inconclusive"  # every pair exactly 1.0


def test_order_is_shuffled_per_repeat_and_reproducible(monkeypatch, no_gc_between_runs):
    calls: list[str] = []

    def named(name):
        def run(num_blocks, trace, rounds, latencies=None):
            if latencies is None:
                calls.append(f"{name}@{num_blocks}")
            else:
                latencies.append(1e-6)
            return {"seconds": 1.0, "stats": {"prefix_hit_tokens": 1, "prefix_query_tokens": 1}}

        return run

    runners = {name: named(name) for name in ("ours", "deque", "a", "b")}
    monkeypatch.setattr(bench, "_contenders", lambda: (runners, {}, {}))
    monkeypatch.setattr(bench, "_run_ours", runners["ours"])
    report = bench.run(quick=True, progress=False, repeats=4, seed=3)
    orders = report["config"]["orders"]
    assert [c for order in orders for c in order] == calls  # the order recorded is the order run
    assert all(sorted(order) == sorted(orders[0]) for order in orders)  # every pair once per repeat
    assert len({tuple(order) for order in orders}) > 1  # shuffled, not a fixed rotation
    calls.clear()
    again = bench.run(quick=True, progress=False, repeats=4, seed=3)
    assert again["config"]["orders"] == orders  # seeded


def _wheel(path: Path) -> None:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("vllm/__init__.py", "")
        zf.writestr("vllm/v1/core/block_pool.py", "X = 1\n")
        zf.writestr("vllm/_C.abi3.so", b"\x7fELF")
        zf.writestr("vllm-0.33.0.dist-info/METADATA", "Name: vllm\n")


def test_fetch_unpacks_only_the_python_sources_and_records_where_they_came_from(tmp_path, monkeypatch):
    """The wheel's .py files under vllm/ land in the cache with PEER.json (version, wheel sha256); compiled
    files and metadata do not; a second fetch reuses the folder; locate() finds it."""
    import subprocess

    def fake_pip(cmd, **kwargs):
        assert cmd[1:4] == ["-m", "pip", "download"] and f"vllm=={peers.VLLM_VERSION}" in cmd
        _wheel(Path(cmd[cmd.index("-d") + 1]) / f"vllm-{peers.VLLM_VERSION}-cp38-abi3-any.whl")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def no_network(url, timeout):
        raise OSError("offline")

    monkeypatch.setenv("MEMOS_REF_PEERS", str(tmp_path))
    monkeypatch.delenv("MEMOS_REF_VLLM_SRC", raising=False)
    monkeypatch.delenv("MEMOS_REF_NANOVLLM_SRC", raising=False)
    monkeypatch.setattr(peers.subprocess, "run", fake_pip)
    monkeypatch.setattr(peers.urllib.request, "urlopen", no_network)
    report = peers.fetch()
    folder = tmp_path / f"vllm-{peers.VLLM_VERSION}"
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert files == ["PEER.json", "vllm/__init__.py", "vllm/v1/core/block_pool.py"]
    assert report["vllm"]["version"] == peers.VLLM_VERSION and len(report["vllm"]["wheel_sha256"]) == 64
    assert "offline" in report["nanovllm"]["skipped"] and peers.NANOVLLM_COMMIT in report["nanovllm"]["skipped"]
    found = peers.locate("vllm")
    assert found is not None and found.path == folder and found.info["version"] == peers.VLLM_VERSION
    assert peers.locate("nanovllm") is None
    monkeypatch.setattr(peers.subprocess, "run", lambda *a, **k: pytest.fail("fetched twice"))
    assert peers.fetch()["vllm"] == report["vllm"]


def test_fetch_refuses_archive_paths_outside_the_peer_folder(tmp_path, monkeypatch):
    """nano-vllm's archive is foreign data: only nanovllm/*.py members are extracted, never a path with '..'."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, body in (
            ("nano-vllm-x/nanovllm/engine/block_manager.py", b"Y = 2\n"),
            ("nano-vllm-x/nanovllm/../../escape.py", b"bad\n"),
            ("nano-vllm-x/bench.py", b"not ours\n"),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    data = buf.getvalue()

    class Resp(io.BytesIO):
        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(peers.urllib.request, "urlopen", lambda url, timeout: Resp(data))
    info = peers._fetch_nanovllm(tmp_path)
    folder = tmp_path / f"nanovllm-{peers.NANOVLLM_COMMIT[:12]}"
    files = sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file())
    assert files == [f"{folder.name}/PEER.json", f"{folder.name}/nanovllm/engine/block_manager.py"]
    assert info["commit"] == peers.NANOVLLM_COMMIT


def test_versions_names_every_peer_it_is_asked_for():
    got = peers.versions("transformers", "cachetools", "redis-py", "redis-server", "vllm")
    assert set(got) == {"transformers", "cachetools", "redis-py", "redis-server", "vllm"}
    import cachetools
    import transformers

    assert got["transformers"] == transformers.__version__ and got["cachetools"] == cachetools.__version__


# A result that names a side-by-side peer must say which version it measured. Citations (a claim's "source")
# name projects without measuring them, so they are not counted.
_PEERS = {"vllm": ("vllm",), "nanovllm": ("nano-vllm", "nanovllm"), "cachetools": ("cachetools",)}
_CITATION_KEYS = {"source", "sources", "claim", "sentence", "why"}


def _measured_text(value, key=None) -> str:
    if key in _CITATION_KEYS:
        return ""
    if isinstance(value, dict):
        return " ".join(_measured_text(v, k) for k, v in value.items()) + " " + " ".join(map(str, value))
    if isinstance(value, list):
        return " ".join(_measured_text(v) for v in value)
    return str(value)


def _recorded_version(result: dict, peer: str):
    found = result.get("peers", {}).get(peer) or result.get("machine", {}).get(peer)
    if isinstance(found, dict):
        return found.get("version") or found.get("commit")
    return found


#: results/ files that hold no side-by-side figure: mutation.json records mutants and the tests that kill them (test
#: names such as "redis" or "vllm" are not a measurement of a peer).
NOT_FIGURES = {"mutation.json"}


@pytest.mark.parametrize(
    "path", sorted(p for p in (ROOT / "results").glob("*.json") if p.name not in NOT_FIGURES), ids=lambda p: p.name
)
def test_every_recorded_result_that_names_a_peer_records_its_version(path):
    result = json.loads(path.read_text())
    text = _measured_text({k: v for k, v in result.items() if k not in ("peers", "machine", "recorded")}).lower()
    for peer, spellings in _PEERS.items():
        if any(s in text for s in spellings):
            assert _recorded_version(result, peer), f"{path.name} names {peer} but records no version of it"
    if "transformers" in text:
        assert result.get("machine", {}).get("transformers"), f"{path.name}: no transformers version"
    if "redis" in text and path.name != "notebooks.json":
        assert _recorded_version(result, "redis-server"), f"{path.name} measures Redis but records no version"


def test_the_version_check_fails_on_a_result_without_one(tmp_path):
    """The guard itself: a result naming vLLM with no peers entry is refused."""
    bad = {"bench": "allocator", "config": {"contenders": ["ours", "vllm"]}, "machine": {}}
    text = _measured_text(bad).lower()
    assert "vllm" in text and not _recorded_version(bad, "vllm")


def test_bench_allocator_explains_the_deque_time_by_its_scans(no_gc_between_runs):
    """The O(pool) contenders' time is their free-list scans: every revival of a cached block scans past every
    never-used id, so doubling the pool adds exactly one pool's worth of entries per ``deque.remove``; the bench
    reports those counts, the measured cost of one scanned entry, and what every contender is."""
    trace = bench._trace(4, 2, 64, 16, 16)
    small, large = bench._deque_scan_work(256, trace, 2), bench._deque_scan_work(512, trace, 2)
    assert small["removes"] == large["removes"] > 0
    assert large["scanned"] - small["scanned"] == 256 * small["removes"]
    report = bench.run(quick=True, progress=False, repeats=1)
    summary, notes = report["summary"], report["config"]["contender_notes"]
    assert summary["deque_remove_calls_pool_small"] > 0 and summary["deque_scan_ns_per_entry"] > 0
    assert summary["deque_scan_seconds_predicted_pool_small"] == pytest.approx(
        summary["deque_entries_scanned_pool_small"] * summary["deque_scan_ns_per_entry"] * 1e-9
    )
    assert set(report["config"]["contenders"]) <= set(notes) and "deque.remove" in notes["deque"]
