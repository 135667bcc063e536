"""The device's Triton (3.6) beside CI's (issue 25 item 3): ``aot_check`` under Triton 3.6, installed side by side
with ``pip install --no-deps --target`` into ``~/.cache/memos-ref/triton-3.6.0`` (once; later runs reuse it),
compiles the launch planner's set for sm_87 and sm_90 without a spill. Skipped, with the reason, where the package
registry cannot be reached and no copy is cached. The report is cached too, keyed by the kernels' source and the
arguments, so an unchanged tree costs CI nothing the second time. Also: the register table in docs/gpu.md is
rendered from the committed results of both versions (``kernels/aot_results.jsonl``)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

try:
    import triton  # noqa: F401
except ImportError:  # pragma: no cover - triton is part of the dev install
    if os.environ.get("CI"):
        raise
    pytest.skip("triton is not installed (pip install 'memos-ref[kernels]')", allow_module_level=True)

from memos_kernels.aot_check import format_versions, load_results
from memos_kernels.launch_plan import launches

DEVICE_TRITON = "3.6.0"
ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("MEMOS_REF_CACHE", Path.home() / ".cache" / "memos-ref"))
RESULTS = ROOT / "kernels" / "aot_results.jsonl"


def _installed_version(target: Path) -> str | None:
    init = target / "triton" / "__init__.py"
    if not init.exists():
        return None
    found = re.search(r"__version__\s*=\s*['\"]([^'\"]+)", init.read_text())
    return found.group(1) if found else None


def side_by_side_triton(version: str = DEVICE_TRITON) -> Path:
    """``~/.cache/memos-ref/triton-<version>``, installed there once with pip (``--no-deps --target``, into a
    temporary folder renamed when complete); skips the test with pip's reason when it cannot be installed."""
    target = CACHE / f"triton-{version}"
    if _installed_version(target) == version:
        return target
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"triton-{version}-", dir=CACHE))
    try:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--disable-pip-version-check",
             "--target", str(tmp), f"triton=={version}"],
            capture_output=True, text=True, timeout=900,
        )  # fmt: skip
        if done.returncode != 0 or _installed_version(tmp) != version:
            pytest.skip(f"Triton {version} could not be installed side by side (registry unreachable?): "
                        f"{done.stderr.strip()[-300:]}")  # fmt: skip
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    except subprocess.TimeoutExpired:
        pytest.skip(f"installing Triton {version} side by side took over 900 s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _source_key(args: list[str], version: str) -> str:
    digest = hashlib.sha256(f"{version} {' '.join(args)}".encode())
    for path in sorted((ROOT / "kernels").glob("*.py")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()[:24]


def aot_report(args: list[str], version: str = DEVICE_TRITON) -> dict:
    """``python -m memos_kernels.aot_check ARGS`` under Triton ``version`` (this checkout's kernels on
    PYTHONPATH through a link named ``memos_kernels``), cached under ``~/.cache/memos-ref/aot``."""
    cached = CACHE / "aot" / f"{_source_key(args, version)}.json"
    if cached.exists():
        return json.loads(cached.read_text())
    triton_dir = side_by_side_triton(version)
    with tempfile.TemporaryDirectory() as shim:
        os.symlink(ROOT / "kernels", Path(shim) / "memos_kernels")
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join([str(triton_dir), shim, str(ROOT)])
        env["TRITON_CACHE_DIR"] = str(CACHE / f"triton-cache-{version}")
        done = subprocess.run([sys.executable, "-m", "memos_kernels.aot_check", *args], capture_output=True,
                              text=True, env=env, timeout=1800)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    cached.parent.mkdir(parents=True, exist_ok=True)
    cached.write_text(json.dumps(report))
    return report


def test_the_device_triton_compiles_every_launch_without_spills():
    """Under Triton 3.6 (the device image's), the planner's set (its hot subset; MEMOS_REF_FULL_AOT=1: all of it)
    compiles for sm_87 and sm_90 to cubins, and nothing spills. Before the retune 3.6 spilled the KIVI decode
    (255 registers, 120-236 B), the sm_87 prefill (36/32 B), fp32 int8/KIVI decode (up to 548 B)."""
    args = ["87", "90"] + (["--full"] if os.environ.get("MEMOS_REF_FULL_AOT") == "1" else [])
    report = aot_report(args)
    assert report["triton"] == DEVICE_TRITON
    assert report["resources"] and all("cubin" in r["stages"] for r in report["resources"])
    assert report["hot_spills"] == [], report["hot_spills"]


def test_the_docs_register_table_is_rendered_from_both_versions():
    """docs/gpu.md's register table is ``aot_check --render kernels/aot_results.jsonl``, and those results hold
    every launch of the planner (the full set, not only :func:`~memos_kernels.aot_check.hot`) under Triton 3.6
    and CI's version at sm_87 and sm_90, none spilled, and no launch the planner no longer makes: a new launch
    (or a retune of one) without a new run fails here. Before 2026-12-02's full run 471 of the 644 cells were
    ``?`` (not compiled)."""
    rows = load_results(str(RESULTS))
    versions = {r["triton"] for r in rows}
    assert DEVICE_TRITON in versions and len(versions) >= 2
    for version in versions:
        for cap in (87, 90):
            got = {r["name"] for r in rows if r["triton"] == version and r["capability"] == cap}
            assert got == {x.name for x in launches(cap)}, (version, cap)
    assert not [r["name"] for r in rows if r["spill_stores"] or r["spill_loads"]]
    docs = (ROOT / "docs" / "gpu.md").read_text()
    table = docs.split("<!-- aot-table:start -->")[1].split("<!-- aot-table:end -->")[0].strip()
    assert table == format_versions(rows).strip()
    assert ": 0 spill, 0 not compiled." in table.splitlines()[0]
