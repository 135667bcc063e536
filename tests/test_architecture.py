"""The architecture's rules, checked over the source: calls go down the layers (the import-linter contract in
pyproject.toml, lazy imports included), no module reads another module's private attributes, and no two modules
import each other, inside a package either (no file circles)."""

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
    """``obj._name`` (or ``getattr(obj, "_name")``) where ``obj`` is not ``self``/``cls`` and ``_name`` is no
    attribute this module defines itself (a class comparing two of its own instances may read ``other._x``), plus
    ``from memos_* import _name``."""
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
        elif (  # the same read spelled getattr(obj, "_name", ...) (or hasattr/setattr/delattr)
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
            and node.args[1].value.startswith("_")
            and not node.args[1].value.startswith("__")
            and not (isinstance(node.args[0], ast.Name) and node.args[0].id in ("self", "cls"))
            and node.args[1].value not in own
        ):
            found.append(f"{path.relative_to(root)}:{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            found += [
                f"{path.relative_to(root)}:{node.lineno}: from {node.module} import {a.name}"
                for a in node.names
                if a.name.startswith("_") and not a.name.startswith("__")
            ]
    return found


#: private reads of the standard library's objects, each with why there is no public way
STDLIB_PRIVATE = {
    "memos_ref/hf/rows.py": {"getattr(lock, '_is_owned', None)"},  # RLock: no public "held by this thread" query
}


def test_no_module_reads_another_modules_private_attributes():
    files = [path for folder in PACKAGES.values() for path in sorted(folder.rglob("*.py"))]
    found = [hit for path in files for hit in _private_accesses(path)]
    allowed = [f"{path}:" for path in STDLIB_PRIVATE]
    found = [
        h for h in found if not any(h.startswith(a) and h.split(": ", 1)[1] in STDLIB_PRIVATE[a[:-1]] for a in allowed)
    ]
    assert found == []


def test_the_private_access_check_can_fail(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from memos_ref.paged import _helper\n"
        "def f(kv):\n    return kv.allocator._lock, kv._x\n\n\n"
        "class A:\n    def eq(self, other):\n        self._y = 1\n        return other._y, super()._z\n"
        "def g(seq):\n    return getattr(seq, '_freed', False), hasattr(seq, '__len__'), getattr(seq, '_y')\n"
    )
    hits = [hit.split(": ", 1)[1] for hit in _private_accesses(probe, root=tmp_path)]
    # other._y is A's own attribute (so getattr(seq, '_y') too), super()._z its base's, __len__ a dunder: not flagged
    assert sorted(hits) == ["from memos_ref.paged import _helper", "getattr(seq, '_freed', False)", "kv._x",
                            "kv.allocator._lock"]  # fmt: skip


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


def _module_names(roots: dict[str, Path]) -> dict[str, Path]:
    """Every module of the packages, by dotted name (``pkg/__init__.py`` is ``pkg``)."""
    names = {}
    for package, folder in roots.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            names[".".join((package, *parts))] = path
    return names


def _import_graph(roots: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports anywhere in its file: at the top, under ``if TYPE_CHECKING:``, or
    inside a function (``ast.walk`` sees them all). Relative imports are resolved; ``from pkg import name`` is an
    import of the submodule ``pkg.name`` when there is one, else of ``pkg`` itself (its ``__init__``). The parent
    packages Python runs on the way to a submodule are not edges: every package re-exporting its submodules would
    otherwise be a circle with each of them."""
    modules = _module_names(roots)

    def known(dotted: str) -> str | None:  # the longest prefix that is a project module
        parts = dotted.split(".")
        for end in range(len(parts), 0, -1):
            if ".".join(parts[:end]) in modules:
                return ".".join(parts[:end])
        return None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                edges.update(t for a in node.names if (t := known(a.name)) is not None)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                    base = f"{anchor}.{node.module}" if node.module else anchor
                else:
                    base = node.module or ""
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else known(base)
                    if target is not None:
                        edges.add(target)
        edges.discard(name)
        graph[name] = edges
    return graph


def _shortest_circle(graph: dict[str, set[str]], start: str) -> list[str] | None:
    """The shortest import path from ``start`` back to itself (``[start, ..., start]``), or None (breadth-first)."""
    previous: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node]):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(previous[path[-1]])
                    return [*reversed(path), start]
                if child not in previous:
                    previous[child] = node
                    following.append(child)
        frontier = following
    return None


def _file_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every module that sits on a circle, with the shortest circle through it; a circle found from several of its
    modules is listed once, starting at its alphabetically first module."""
    circles: dict[frozenset[str], list[str]] = {}
    for module in sorted(graph):
        circle = _shortest_circle(graph, module)
        if circle is not None and frozenset(circle) not in circles:
            first = circle.index(min(circle))
            circles[frozenset(circle)] = [*circle[first:-1], *circle[:first], circle[first]]
    return sorted(circles.values())


def test_no_file_circles():
    """Issue 29: no two modules import each other, directly or round a longer loop, counting imports under
    ``if TYPE_CHECKING:`` and inside functions too (a lazy import hides a circle from Python, not from a reader).
    A seam between two modules is a Protocol in the lower one, or the shared piece moved down into its own file."""
    graph = _import_graph(PACKAGES)
    assert len(graph) > 100 and graph["memos_ref.quant.fp8"] >= {"memos_ref.quant.base", "memos_ref.errors"}
    circles = [" -> ".join(circle) for circle in _file_circles(graph)]
    assert circles == [], "file circles:\n" + "\n".join(circles)


def test_the_file_circle_check_can_fail(tmp_path):
    """The check sees a circle made by each kind of import: top-level, TYPE_CHECKING-only, lazy in a function,
    relative, ``from pkg import submodule``, and a submodule importing its own package's ``__init__``."""
    files = {
        "pkg/__init__.py": "from pkg.top import A\n",  # the package re-exports top, which imports the package
        "pkg/top.py": "import pkg.sub.deep\nfrom pkg import lazy\nfrom pkg import A as _a\nclass A: ...\n",
        "pkg/lazy.py": "def f():\n    from .top import A\n    return A\n",
        "pkg/sub/__init__.py": "",
        "pkg/sub/deep.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..typed import T\n",
        "pkg/typed.py": "from . import sub\nimport pkg.sub.deep as d\nimport os, json\nT = d\n",
        "pkg/alone.py": "import pkg.top\nfrom pkg.sub import deep\n",  # imports into the circles, is on none
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    graph = _import_graph({"pkg": tmp_path / "pkg"})
    assert graph == {
        "pkg": {"pkg.top"},
        "pkg.top": {"pkg", "pkg.sub.deep", "pkg.lazy"},
        "pkg.lazy": {"pkg.top"},
        "pkg.sub": set(),
        "pkg.sub.deep": {"pkg.typed"},
        "pkg.typed": {"pkg.sub", "pkg.sub.deep"},
        "pkg.alone": {"pkg.top", "pkg.sub.deep"},
    }
    assert _file_circles(graph) == [
        ["pkg", "pkg.top", "pkg"],
        ["pkg.lazy", "pkg.top", "pkg.lazy"],
        ["pkg.sub.deep", "pkg.typed", "pkg.sub.deep"],
    ]
    (tmp_path / "pkg/__init__.py").write_text("")  # breaking each circle leaves the package clean
    (tmp_path / "pkg/lazy.py").write_text("def f(a):\n    return a\n")
    (tmp_path / "pkg/sub/deep.py").write_text("T = int\n")
    (tmp_path / "pkg/top.py").write_text("import pkg.sub.deep\nfrom pkg import lazy\nclass A: ...\n")
    assert _file_circles(_import_graph({"pkg": tmp_path / "pkg"})) == []
