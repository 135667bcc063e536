"""The device check (``scripts/gpu_check.sh`` -> ``memos_kernels.gpu_check``, issue 25 item 4) proven on the CPU:
its ``--dry-run`` runs the same phases in Triton's interpreter within its budget, and any wrong kernel result, a
timed-out phase or a missing pytest shows in the JSON and the exit status.

``GPU_CHECK_BUDGET_SCALE`` stretches the phases' budgets. Its default here is 3: `make test` runs these beside the
rest of the suite on xdist workers (and CI beside a CPU hog), where a phase gets about a third of a core; the
dry run itself takes about 45 s of CPU. ``GPU_CHECK_BUDGET_SCALE=1`` checks the device budgets as written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
import torch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
SCALE = os.environ.get("GPU_CHECK_BUDGET_SCALE", "3")
pytestmark = [
    pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the device check runs for real"),
    pytest.mark.timeout(900),  # the budgets (x GPU_CHECK_BUDGET_SCALE) bound each run; this only backs them up
]


def run_check(tmp_path: Path, *args: str, site: str | None = None) -> tuple[int, dict]:
    """The script with this Python; ``site`` is a ``sitecustomize.py`` planted in every process it starts."""
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out")}
    if site is not None:
        (tmp_path / "site").mkdir()
        (tmp_path / "site" / "sitecustomize.py").write_text(site)
        env["PYTHONPATH"] = f"{tmp_path / 'site'}{os.pathsep}{env.get('PYTHONPATH', '')}"
    done = subprocess.run(["bash", str(SCRIPT), "--budget-scale", SCALE, *args], capture_output=True, text=True,
                          env=env, timeout=600)  # fmt: skip
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, (done.stdout[-3000:], done.stderr[-3000:])
    report = json.loads(lines[0])
    assert json.loads((tmp_path / "out" / "gpu_check.json").read_text()) == report  # the same one JSON
    return done.returncode, report


def test_the_dry_run_passes_every_phase_within_its_budget(tmp_path):
    from memos_kernels.gpu_check import DRY_BUDGET_S

    assert sum(DRY_BUDGET_S.values()) <= 120  # CI's budget: 2 minutes
    rc, report = run_check(tmp_path, "--dry-run")
    assert rc == 0 and report["ok"] is True, json.dumps(report)[-3000:]
    assert report["dry_run"] is True and list(report["phases"]) == ["env", "correctness", "tests", "bench"]
    assert all(p["rc"] == 0 and not p["timed_out"] for p in report["phases"].values())
    names = {r["name"] for r in report["correctness"]}
    assert {"check_paged_decode", "check_kivi_decode[4]", "check_write_kv", "check_copy_blocks",
            "decode_real_shape", "prefill_real_shape", "kivi_real_shape"} <= names  # fmt: skip
    assert all(r["ok"] for r in report["correctness"])
    groups = report["tests"]["groups"]
    assert len(groups) >= 2 and all(g["ok"] and g["tests"] >= 1 for g in groups)  # parallel pytest processes
    rows = {r["row"] for r in report["bench"]}
    assert rows == {"host", "copy", "decode", "prefill", "decode_step_graph", "decode_forward_graph"}
    graphed = [r for r in report["bench"] if r["row"] == "decode_step_graph"]  # the CUDA-graph bookkeeping, rerun
    assert [r["batch"] for r in graphed] == [1, 2] and all(r["captures"] == 1 and r["ok"] for r in graphed)
    forward = [r for r in report["bench"] if r["row"] == "decode_forward_graph"]  # the whole forward, graphed
    assert [r["batch"] for r in forward] == [1, 2] and all(r["ok"] and r["captures"] == 1 for r in forward)
    assert all(r["max_abs_err"] <= r["tolerance"] and r["eager"] == "PagedCache" for r in forward)
    decode = [r for r in report["bench"] if r["row"] == "decode"]
    assert all("do_bench_ms" in r and "cudagraph_ms" in r and r["copy_fraction"] > 0 for r in decode)
    assert set(report["goals"]) == {"decode_8k_copy_fraction_batch_ge_8", "decode_8k_copy_fraction_batch_1",
                                    "prefill_fraction_of_fa2_h100", "host_us_per_layer"}  # fmt: skip


PLANT = """
import os
os.environ.setdefault("TRITON_INTERPRET", "1")
from memos_kernels import paged_decode

_real = paged_decode.paged_decode_attention


def planted(*args, **kwargs):  # a wrong kernel result: every output off by one
    return _real(*args, **kwargs) + 1.0


paged_decode.paged_decode_attention = planted
"""


def test_a_planted_wrong_kernel_result_makes_it_exit_non_zero(tmp_path):
    rc, report = run_check(tmp_path, "--dry-run", "--only", "correctness", site=PLANT)
    assert rc != 0 and report["ok"] is False
    failed = {r["name"] for r in report["correctness"] if not r["ok"]}
    assert {"check_paged_decode", "decode_real_shape"} <= failed
    assert "check_write_kv" not in failed  # only what was planted
    assert report["phases"]["correctness"]["rc"] == 1


def test_a_phase_past_its_budget_fails_the_run(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_OUT": str(tmp_path / "out")}
    done = subprocess.run(["bash", str(SCRIPT), "--dry-run", "--only", "env", "--budget-scale", "0.001"],
                          capture_output=True, text=True, env=env, timeout=120)  # fmt: skip
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert done.returncode != 0 and report["ok"] is False
    assert report["phases"]["env"]["timed_out"] is True and report["phases"]["env"]["rc"] == 124


NO_PYTEST = """
import sys
sys.modules["pytest"] = None  # this image has no pytest
"""


def test_without_pytest_the_tests_phase_runs_each_kernel_files_checks(tmp_path):
    rc, report = run_check(tmp_path, "--dry-run", "--only", "tests", site=NO_PYTEST)
    assert rc == 0, json.dumps(report)[-3000:]
    assert report["tests"]["pytest"] == "absent" and report["tests"]["fallback"] == "each kernel file's checks"
    assert report["tests"]["checks"] >= 11 and report["tests"]["ok"] is True
