"""Notebooks are committed without outputs, in order, and each ends with assertions."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_the_first_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    for expected in ("00_why_kv_cache.ipynb", "01_naive_concat.ipynb", "02_preallocated.ipynb"):
        assert expected in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [], f"{path.name}: a code cell has outputs"
            assert cell.execution_count is None, f"{path.name}: a code cell has an execution count"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_skeleton_and_final_assertions(path):
    nb = nbformat.read(path, as_version=4)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for heading in ("What you'll build", "## Setup", "## Takeaways", "## Check yourself"):
        assert heading in markdown, f"{path.name} lacks {heading!r}"
    last = nb.cells[-1]
    assert last.cell_type == "code" and "assert " in last.source
    assert "torch.manual_seed" in nb.cells[2].source or any("manual_seed" in c.source for c in nb.cells[:4])
