"""The architecture's two rules, checked over the source: calls go down the layers (the import-linter contract in
pyproject.toml, lazy imports included), and no module reads another module's private attributes."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"memos_ref": ROOT / "memos_ref", "memos_kernels": ROOT / "kernels", "memos_edge": ROOT / "edge"}


def _lint_imports() -> subprocess.CompletedProcess[str]:
    exe = Path(sys.executable).with_name("lint-imports")
    if not exe.exists():
        found = shutil.which("lint-imports")
        if found is None:
            pytest.fail("lint-imports is missing: `pip install -e '.[dev]'` installs import-linter")
        exe = Path(found)
    return subprocess.run([str(exe), "--no-cache"], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_the_layer_contract_holds():
    result = _lint_imports()
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "2 kept, 0 broken" in result.stdout  # the layers, and memos_kernels importing only memos_ref.errors


def test_the_contracts_have_no_exemptions():
    """Issue 15: the layer contract passes with no ignored imports (the last one, PagedKV building the quantized
    pool, went when PagedKV started taking a pool)."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    assert {c["id"] for c in config["contracts"]} == {"layers", "kernels-standalone"}
    for contract in config["contracts"]:
        assert not contract.get("ignore_imports"), f"{contract['id']} exempts {contract['ignore_imports']}"


def test_every_module_sits_in_a_layer():
    """A module the contract does not name is constrained by nothing: every top-level module and subpackage of
    memos_ref (and the two other packages) must sit in a layer, and the kernels must be forbidden each of them."""
    import tomllib

    contracts = {
        c["id"]: c for c in tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    }
    named = {m.strip() for layer in contracts["layers"]["layers"] for part in re.split(r"[|:]", layer) for m in [part]}
    present = {"memos_kernels", "memos_edge"}
    for child in (ROOT / "memos_ref").iterdir():
        if child.name.startswith("_"):
            continue
        if child.suffix == ".py" or (child.is_dir() and (child / "__init__.py").exists()):
            present.add(f"memos_ref.{child.stem}")
    assert present - named == set(), f"modules in no layer of the contract: {sorted(present - named)}"
    forbidden = set(contracts["kernels-standalone"]["forbidden_modules"])
    assert present - forbidden - {"memos_ref.errors", "memos_kernels", "memos_edge"} == set()


def _private_accesses(path: Path, root: Path = ROOT) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self``/``cls`` and ``_name`` is no attribute this module defines itself
    (a class comparing two of its own instances may read ``other._x``), plus ``from memos_* import _name``."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    own: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            own.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            own.add(node.name)
        elif isinstance(node, (ast.AnnAssign, ast.Assign)):  # class-level attributes
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name):
                    own.add(target.id)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            if node.attr not in own:
                found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            found += [
                f"{path.relative_to(root)}:{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


def test_no_module_reads_another_modules_private_attributes():
    files = [path for folder in PACKAGES.values() for path in sorted(folder.rglob("*.py"))]
    found = [hit for path in files for hit in _private_accesses(path)]
    assert found == []


def test_the_private_access_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from memos_ref.paged import _helper\n"
        "def f(kv):\n    return kv.allocator._lock, kv._x\n\n\n"
        "class A:\n    def eq(self, other):\n        self._y = 1\n        return other._y, super()._z\n"
    )
    hits = [hit.split(": ", 1)[1] for hit in _private_accesses(probe, root=tmp_path)]
    # other._y is A's own attribute, super()._z its base's: not flagged
    assert sorted(hits) == ["from memos_ref.paged import _helper", "kv._x", "kv.allocator._lock"]


_NOTEBOOK_PRIVATE = re.compile(r"from\s+(memos_\w+(?:\.\w+)*)\s+import\s+([^\n]*)")


@pytest.mark.parametrize("notebook", sorted((ROOT / "notebooks").glob("*.ipynb")), ids=lambda p: p.name)
def test_notebooks_import_only_public_names(notebook):
    cells = json.loads(notebook.read_text(encoding="utf-8"))["cells"]
    code = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    private = []
    for module, names in _NOTEBOOK_PRIVATE.findall(code):
        for name in re.split(r"[,\s()]+", names):
            if name.startswith("_") and not name.startswith("__"):
                private.append(f"{module}.{name}")
    private += [m.group(0) for m in re.finditer(r"\b(?:memos_ref|memos_kernels|memos_edge)(?:\.\w+)*\._\w+", code)]
    assert private == []
