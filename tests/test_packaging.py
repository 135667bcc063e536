"""Packaging: a built wheel carries all three import packages and the shipped model, and imports on its own."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(ROOT)],
        check=True,
        capture_output=True,
        timeout=600,
    )
    (path,) = out.glob("memos_ref-*.whl")
    return path


def test_wheel_holds_every_source_module_and_the_model(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, package in (("memos_ref", "memos_ref"), ("kernels", "memos_kernels"), ("edge", "memos_edge")):
        for source in (ROOT / folder).rglob("*.py"):
            assert f"{package}/{source.relative_to(ROOT / folder).as_posix()}" in names, source
    for asset in ("config.json", "model.safetensors", "training_report.json"):
        assert f"memos_ref/model/assets/{asset}" in names
    assert "memos_ref/model/data/heldout_stdlib.txt" in names
    assert not any(n.startswith(("kernels/", "edge/", "tests/")) for n in names)  # no clashing top-level names


def test_wheel_imports_without_the_source_tree(wheel, tmp_path):
    zipfile.ZipFile(wheel).extractall(tmp_path / "site")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import memos_ref, memos_kernels, memos_edge;"
        "from memos_ref.model import load_model, shipped_model_dir;"
        "assert memos_ref.__file__.startswith(sys.argv[1]), memos_ref.__file__;"
        "assert str(shipped_model_dir()).startswith(sys.argv[1]);"
        "load_model(); print('ok')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_editable_install_maps_the_renamed_folders():
    import memos_edge
    import memos_kernels

    assert Path(memos_kernels.__file__).parent.name == "kernels"
    assert Path(memos_edge.__file__).parent.name == "edge"
