"""The suite's own safety net (issue 30 item 3, issue 29 item 5): a per-test timeout is configured, a planted hang
fails its one test with a traceback within that timeout, Hypothesis has a fast and a deeper CI profile, and the
conftest marks tests by what they need so `make check` can leave out the real model and the servers."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest
from hypothesis import settings

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
INI = PYPROJECT["tool"]["pytest"]["ini_options"]
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "no:xdist"]


def test_a_per_test_timeout_is_configured_for_every_run(pytestconfig):
    """pytest-timeout is loaded and pyproject gives every test a finite timeout with the signal method (the hung
    test fails with a traceback and the run goes on, instead of killing the worker)."""
    assert pytestconfig.pluginmanager.hasplugin("timeout"), "pytest-timeout is not installed: pip install -e '.[dev]'"
    assert INI["timeout"] == conftest.DEFAULT_TIMEOUT_S == 600
    assert INI["timeout_method"] == "signal"
    assert float(pytestconfig.getini("timeout")) == 600
    dev = PYPROJECT["project"]["optional-dependencies"]["dev"]
    assert any(d.startswith("pytest-timeout") for d in dev) and any(d.startswith("pytest-xdist") for d in dev)


def test_every_longer_timeout_names_a_real_test_and_is_longer():
    """A typo in LONG_TESTS would silently leave a slow test on the default timeout."""
    for key, seconds in conftest.LONG_TESTS.items():
        filename, name = key.split("::")
        tree = ast.parse((ROOT / "tests" / filename).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in names, f"{key}: no such test"
        assert conftest.DEFAULT_TIMEOUT_S < seconds <= 1800
    for filename in conftest.SLOW_FILES:
        assert (ROOT / "tests" / filename).is_file(), filename


PLANTED_FILE = "test_hang.py"
PLANTED = """
import threading
import time


def test_a_busy_loop_hangs():
    while True:
        pass


def test_a_lock_never_released_hangs():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()


def test_after_the_hangs_the_run_goes_on():
    time.sleep(0)
"""


def test_a_planted_hang_fails_its_test_with_a_timeout_traceback(tmp_path):
    """Two planted hangs (a pure-Python busy loop, a lock acquired twice) each fail with pytest-timeout's traceback
    naming the hung line, within a 2 s timeout set on the command line; the project's own timeout settings (the
    signal method) are read from pyproject.toml; and the test after them still runs and passes."""
    (tmp_path / PLANTED_FILE).write_text(PLANTED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    done = subprocess.run(
        [*PYTEST, "-c", str(ROOT / "pyproject.toml"), "--rootdir", str(tmp_path), "--timeout=2", "-q", PLANTED_FILE],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,  # the bound of this test itself: without the per-test timeout the child would never return
        env=env,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "2 failed, 1 passed" in out, out
    # each hung test fails with the timeout (the -ra summary may repeat the line, or cut it to the terminal width)
    for name in ("test_a_busy_loop_hangs", "test_a_lock_never_released_hangs"):
        assert re.search(rf"_+ {name} _+\n(?:.*\n)*?E\s+Failed: Timeout \(>2\.0s\) from pytest-timeout", out), out
    assert "while True:" in out and "lock.acquire()" in out, out  # the traceback points at each hung line


def test_hypothesis_profiles_fast_default_and_deeper_ci():
    """dev (default) is quick; ci (CI set, or HYPOTHESIS_PROFILE=ci) runs more examples and keeps no local database;
    both print the reproduce blob and have no deadline (a loaded machine would make deadlines flaky)."""
    dev, ci = settings.get_profile("dev"), settings.get_profile("ci")
    assert dev.max_examples < ci.max_examples <= 200  # CI stays under its time budget beside a CPU hog
    assert dev.print_blob and ci.print_blob
    assert dev.deadline is None and ci.deadline is None
    assert ci.database is None
    wanted = os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev")
    assert settings.get_current_profile_name() == wanted


def test_a_failing_property_reports_its_seed(tmp_path):
    """A failing @given test's report carries the seed to replay it (`--hypothesis-seed=N`) and the blob."""
    (tmp_path / "conftest.py").write_text(
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('memos_conftest', {str(ROOT / 'tests' / 'conftest.py')!r})\n"
        "module = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(module)\n"
        "pytest_runtest_makereport = module.pytest_runtest_makereport\n"
    )
    (tmp_path / "test_prop.py").write_text(
        "from hypothesis import given, settings, strategies as st\n\n"
        "@settings(database=None, print_blob=True)\n@given(st.integers())\n"
        "def test_small(x):\n    assert x < 10\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    done = subprocess.run(
        [*PYTEST, "-q", "--rootdir", str(tmp_path), "test_prop.py"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "--hypothesis-seed=" in out and "@reproduce_failure(" in out, out


def _item(filename: str, name: str, fixtures: tuple[str, ...] = (), source_fn=None):
    marks: list[pytest.MarkDecorator] = []
    return SimpleNamespace(
        fspath=ROOT / "tests" / filename,
        name=name,
        fixturenames=list(fixtures),
        function=source_fn,
        add_marker=marks.append,
        get_closest_marker=lambda n: next((m for m in marks if m.name == n), None),
        marks=marks,
    )


def _starts_its_own_server():
    from memos_ref.memory import RedisServer

    return RedisServer  # the marker reads the source: "RedisServer(" below starts one
    RedisServer()


def test_markers_follow_fixture_use_not_file_edits():
    """real_model from the SmolLM2 fixtures (or a test_real_* file), server from the redis fixture or a test that
    starts RedisServer itself, slow from SLOW_FILES; LONG_TESTS' timeouts applied; a plain unit test gets none."""
    plain = _item("test_paged_allocator.py", "test_x", ("tmp_path",))
    real = _item("test_pretrained.py", "test_y", ("smollm2",))
    real_file = _item("test_real_chat.py", "test_z")
    server = _item("test_memory_backends.py", "test_w[redis]", ("redis_server",))
    own_server = _item("test_tiering_manager.py", "test_v", (), _starts_its_own_server)
    slow = _item("test_packaging.py", "test_wheel_holds_every_source_module_and_the_model", ("wheel",))
    items = [plain, real, real_file, server, own_server, slow]
    conftest.pytest_collection_modifyitems(None, items)
    names = [sorted(m.name for m in it.marks) for it in items]
    assert names == [[], ["real_model"], ["real_model"], ["server"], ["server"], ["slow", "timeout"]]
    assert slow.get_closest_marker("timeout").args == (900,)


def test_the_markers_are_registered(pytestconfig):
    lines = pytestconfig.getini("markers")
    for name in ("real_model", "server", "slow"):
        assert any(line.startswith(f"{name}:") for line in lines), name


# ---------------------------------------------------------------- what `make check` selects (issue 29 item 5)
def _check_command() -> tuple[dict[str, str], str]:
    """The environment assignments and the ``-m`` expression of the Makefile's ``check`` recipe."""
    recipe = (ROOT / "Makefile").read_text().split("\ncheck:", 1)[1].split("\n\n", 1)[0]
    env = dict(re.findall(r"\b([A-Z_]+)=(\S+)\s+\$\(BIN\)/python -m pytest", recipe))
    (expr,) = re.findall(r'-m "([^"]+)"', recipe)
    return env, expr


# One test of each kind `make check` must leave out, each in a file it otherwise runs, and tests it must keep.
CHECK_EXCLUDES = {
    "tests/test_pretrained.py::test_the_real_model_answers_the_issue_question": "loads the real model",
    "tests/test_pretrained.py::test_a_lock_another_process_keeps_is_a_state_error_naming_it_and_its_holder": (
        "starts a subprocess"
    ),
    "tests/test_suite_config.py::test_a_planted_hang_fails_its_test_with_a_timeout_traceback": "runs pytest",
    "tests/test_readme_results.py::test_record_notebooks_stores_what_each_notebook_measured": "a Jupyter kernel",
    "tests/test_cluster_tier.py::test_tenants_and_models_are_separate": "a Redis Cluster (the fixture)",
    "tests/test_memory_backends.py::test_redis_server_helper_errors": "starts redis-server itself",
    "tests/test_bench_and_demo.py::test_other_benchmarks_quick_json_contract[agent]": "a benchmark (SLOW_FILES)",
    "tests/test_caches.py::test_hf_generate_equals_dynamic_cache[llama-shipped-concat]": "the larger model size",
    "tests/test_memory_backends.py::test_get_never_extends_the_ttl_and_overwrite_restarts_it[redis]": (
        "a Redis parameter (its fixture asks for redis_server at run time)"
    ),
    "tests/test_reliability_store.py::test_get_or_compute_rechecks_after_taking_the_lead[redis]": "the same (a helper)",
}
CHECK_KEEPS = (
    "tests/test_suite_config.py::test_markers_follow_fixture_use_not_file_edits",
    "tests/test_model.py::test_config_reads_rope_through_the_one_reader",
    "tests/test_caches.py::test_hf_generate_equals_dynamic_cache[llama-tiny-concat]",  # its tiny-model twin
    "tests/test_model.py::test_train_script_runs_end_to_end",  # trains the shipped architecture in-process
    "tests/test_readme_results.py::test_readme_agrees_with_committed_results",
    "tests/test_memory_backends.py::test_get_never_extends_the_ttl_and_overwrite_restarts_it[memory]",
)


def test_make_check_selects_no_real_model_server_or_subprocess_test():
    """Collect with the Makefile's own ``check`` environment and ``-m`` expression (a subprocess: pytest itself
    applies the markers): each test of CHECK_EXCLUDES is left out, the plain tests stay, and make check selects
    the capped Hypothesis profile."""
    env_vars, expr = _check_command()
    assert env_vars.get("HYPOTHESIS_PROFILE") == "check"
    files = sorted({node.split("::")[0] for node in [*CHECK_EXCLUDES, *CHECK_KEEPS]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")} | env_vars
    done = subprocess.run(
        [*PYTEST, "--collect-only", "-q", "-m", expr, *files],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    selected = {line.strip() for line in done.stdout.splitlines() if "::" in line}
    assert done.returncode == 0 and selected, done.stdout[-3000:] + done.stderr[-3000:]
    wrongly = {node: why for node, why in CHECK_EXCLUDES.items() if node in selected}
    assert wrongly == {}, f"make check would run these: {wrongly}"
    assert set(CHECK_KEEPS) <= selected


def test_the_check_markers_follow_what_a_test_starts():
    """In process (fast, so make check runs it too): a test whose own source, fixture or file helper starts a
    process is slow; one that asks for the real model by its helper is real_model; one that starts a Redis Cluster
    itself is server; the shipped-model variant of a test parametrized over model sizes is slow (its tiny twin is
    not); a plain test gets nothing."""

    def starts_a_process():
        return subprocess.run  # the marker reads the source: subprocess.run(...) below
        subprocess.run(["true"])

    def asks_for_the_real_model():
        return conftest  # conftest._real_model_path() below
        conftest._real_model_path()

    def starts_a_cluster():
        running_cluster()  # noqa: F821  (never called: the marker reads the source)

    def plain():
        return 1 + 1

    shipped, tiny = _item("test_x.py", "test_m[shipped]", (), plain), _item("test_x.py", "test_m[tiny]", (), plain)
    shipped.callspec, tiny.callspec = (
        SimpleNamespace(params={"which": "shipped"}),
        SimpleNamespace(params={"which": "tiny"}),
    )
    items = [
        _item("test_x.py", "test_process", (), starts_a_process),
        _item("test_x.py", "test_real", (), asks_for_the_real_model),
        _item("test_x.py", "test_cluster", (), starts_a_cluster),
        _item("test_x.py", "test_cluster_fixture", ("redis_cluster",), plain),
        _item("test_x.py", "test_plain", ("tmp_path",), plain),
        shipped,
        tiny,
    ]
    conftest.pytest_collection_modifyitems(None, items)
    marks = [sorted(m.name for m in it.marks) for it in items]
    assert marks == [["slow"], ["real_model"], ["server"], ["server"], [], ["slow"], []]


def test_make_check_caps_every_property_test_even_a_pinned_one():
    """Under the "check" profile the conftest caps a @given test that pins 300 examples, and a state machine's
    TestCase settings, at CHECK_MAX_EXAMPLES; without the cap the same test runs its 300."""
    from hypothesis import given
    from hypothesis import strategies as st
    from hypothesis.stateful import RuleBasedStateMachine, rule

    def make():
        seen: list[int] = []

        @settings(max_examples=300, database=None, deadline=None)
        @given(st.integers())
        def prop(x):
            seen.append(x)

        return prop, seen

    prop, seen = make()
    prop()
    assert len(seen) > conftest.CHECK_MAX_EXAMPLES  # the pinned count runs uncapped
    prop, seen = make()
    conftest._cap_examples(SimpleNamespace(obj=prop, cls=None))
    prop()
    assert 1 <= len(seen) <= conftest.CHECK_MAX_EXAMPLES

    class Machine(RuleBasedStateMachine):
        @rule()
        def step(self):
            pass

    Machine.TestCase.settings = settings(max_examples=250, stateful_step_count=5, deadline=None)
    conftest._cap_examples(SimpleNamespace(obj=None, cls=Machine.TestCase))
    assert Machine.TestCase.settings.max_examples == conftest.CHECK_MAX_EXAMPLES
    assert Machine.TestCase.settings.stateful_step_count == 5  # only the count changes
    assert settings.get_profile("check").max_examples == conftest.CHECK_MAX_EXAMPLES


def test_an_xdist_worker_gives_torch_cores_over_workers_threads():
    """Inside an xdist worker (PYTEST_XDIST_WORKER_COUNT set before conftest loads), PyTorch and the processes the
    worker starts use cores // workers CPU threads (at least 1): workers x threads never oversubscribe the cores."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    probe = "import os, conftest, torch; print(torch.get_num_threads(), os.environ['OMP_NUM_THREADS'])"
    for workers in (2, os.cpu_count() or 1, 64):
        env["PYTEST_XDIST_WORKER_COUNT"] = str(workers)
        out = subprocess.run(
            [sys.executable, "-c", probe], cwd=ROOT / "tests", env=env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, out.stderr[-2000:]
        want = max(1, (os.cpu_count() or 1) // workers)
        assert out.stdout.split() == [str(want), str(want)]


def test_files_run_heaviest_first_by_their_recorded_seconds():
    """The collection is regrouped by file, heaviest recorded file first (a file missing from durations.json counts
    as the median file; ties keep the collection order), and each file keeps its own test order — so xdist's
    loadfile scheduler (with --no-loadscope-reorder) starts the long files first instead of last."""

    def item(nodeid: str) -> SimpleNamespace:
        return SimpleNamespace(nodeid=nodeid)

    items = [
        item("tests/test_a.py::t1"),
        item("tests/test_b.py::t1"),
        item("tests/test_a.py::t2"),
        item("tests/test_c.py::t1"),
        item("notebooks/05.ipynb::05.ipynb"),
        item("tests/test_d.py::t1"),
        item("tests/test_c.py::t2"),
    ]
    recorded = {"tests/test_a.py": 1.0, "tests/test_c.py": 90.0, "notebooks/05.ipynb": 30.0, "tests/gone.py": 5.0}
    # median of the recorded figures [1, 5, 30, 90] is 30: test_b and test_d count as 30 and tie with the notebook
    order = [i.nodeid for i in conftest.heaviest_first(items, recorded)]
    assert order == [
        "tests/test_c.py::t1",
        "tests/test_c.py::t2",
        "tests/test_b.py::t1",
        "notebooks/05.ipynb::05.ipynb",
        "tests/test_d.py::t1",
        "tests/test_a.py::t1",
        "tests/test_a.py::t2",
    ]
    # nothing recorded: the files in the order they were collected, each file's tests together
    assert [i.nodeid for i in conftest.heaviest_first(items, {})] == [items[k].nodeid for k in (0, 2, 1, 3, 6, 4, 5)]
    # a hand-edited file with junk figures: those files count as the median of the valid ones (30), nothing raises
    junk = {**recorded, "tests/test_a.py": "slow", "tests/test_b.py": -1, "tests/test_d.py": float("nan")}
    weights = conftest.file_weights(items, junk)
    assert weights["tests/test_a.py"] == weights["tests/test_b.py"] == weights["tests/test_d.py"] == 30.0
    makefile = (ROOT / "Makefile").read_text()
    assert "--no-loadscope-reorder" in makefile.split("\nXDIST", 1)[1].split("\n", 1)[0]


def test_durations_are_recorded_per_file_for_the_scheduler(tmp_path):
    """MEMOS_DURATIONS_OUT makes a run write each file's summed seconds (setup, call and teardown), which the next
    run's scheduler reads: a planted file of two sleeping tests records at least their sum."""
    (tmp_path / "test_sleepy.py").write_text(
        "import time\n\ndef test_one():\n    time.sleep(0.3)\n\ndef test_two():\n    time.sleep(0.2)\n"
    )
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    out = tmp_path / "durations.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")} | {"MEMOS_DURATIONS_OUT": str(out)}
    done = subprocess.run(
        [*PYTEST, "-q", "--rootdir", str(tmp_path), "-c", os.devnull, "test_sleepy.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:]
    import json

    files = json.loads(out.read_text())["files"]
    assert list(files) == ["test_sleepy.py"] and 0.5 <= files["test_sleepy.py"] < 60
