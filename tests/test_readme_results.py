"""The generated figures of the README and docs/ agree with the committed benchmark results (memos_ref.bench.report)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from memos_ref.bench import report
from memos_ref.errors import ConfigError, CorruptCacheError

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    """A copy of the README, docs/, pyproject and results/ to edit freely."""
    for name in ("README.md", "pyproject.toml"):
        shutil.copy(ROOT / name, tmp_path / name)
    shutil.copytree(ROOT / "results", tmp_path / "results")
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    return tmp_path


def test_readme_agrees_with_committed_results() -> None:
    stale = report.check(ROOT)
    assert stale == [], f"README blocks {stale} disagree with results/: run `python -m memos_ref.bench.report render`"


def test_every_block_is_used_and_every_result_is_read() -> None:
    used = [name for path in report.targets(ROOT) for name in report.blocks_in(path.read_text())]
    assert len(used) == len(set(used)), f"a block appears twice: {sorted(used)}"
    modules = {name for name in used if name not in report.BLOCKS}
    assert all(report.module_renderer(name) for name in modules), f"blocks without a renderer: {sorted(modules)}"
    assert set(used) - modules == set(report.BLOCKS), f"blocks {sorted(used)} vs renderers {sorted(report.BLOCKS)}"
    stems = set(modules)
    for stem, _ in report.BLOCKS.values():
        stems |= {stem} if isinstance(stem, str) else set(stem)
    assert stems == set(report.load_results(ROOT))


def test_the_readme_keeps_only_the_front_door_tables() -> None:
    """The README holds the path and headline blocks; every other table lives in docs/results.md."""
    readme = (ROOT / "README.md").read_text()
    assert report.blocks_in(readme) == ["path", "headline"]
    assert len(readme.splitlines()) <= 300
    headline = readme.split("<!-- results:headline -->\n")[1].split("<!-- /results:headline -->")[0]
    assert len(headline.strip().splitlines()) <= 10
    results_page = (ROOT / "docs" / "results.md").read_text()
    assert {"waste", "claims", "notebook-claims", "quant-real"} <= set(report.blocks_in(results_page))


def test_a_bench_module_with_render_markdown_adds_a_table_in_one_line(repo: Path, monkeypatch) -> None:
    import sys
    import types

    module = types.ModuleType("memos_ref.bench.fakebench")
    module.render_markdown = lambda r: f"| nodes |\n|---|\n| {r['summary']['nodes']} |"
    monkeypatch.setitem(sys.modules, "memos_ref.bench.fakebench", module)
    data = json.loads((repo / "results" / "waste.json").read_text())
    data["summary"] = {"nodes": 7}
    (repo / "results" / "fakebench.json").write_text(json.dumps(data))
    page = repo / "docs" / "results.md"
    page.write_text(page.read_text() + "\n<!-- results:fakebench -->\n<!-- /results:fakebench -->\n")
    assert report.check(repo) == ["fakebench"]
    assert report.render(repo) == ["fakebench"]
    assert "| 7 |" in page.read_text() and "`results/fakebench.json`" in page.read_text()
    assert report.check(repo) == []
    with pytest.raises(ConfigError, match="render_markdown"):  # a name with neither a block nor a module
        report.render_text("<!-- results:nomodule -->\n<!-- /results:nomodule -->", report.load_results(repo))


def test_a_changed_result_makes_the_check_fail(repo: Path) -> None:
    path = repo / "results" / "waste.json"
    data = json.loads(path.read_text())
    data["results"][0]["waste_percent"] += 1.0
    path.write_text(json.dumps(data))
    assert report.check(repo) == ["waste"]
    assert report.render(repo) == ["waste"]  # rewriting brings them back in agreement
    assert report.check(repo) == []


def test_a_hand_typed_figure_inside_a_block_makes_the_check_fail(repo: Path) -> None:
    readme = repo / "docs" / "results.md"
    text = readme.read_text()
    start = text.index("<!-- results:waste -->")
    pos = text.index("70.52%", start)
    readme.write_text(text[:pos] + "70.5%" + text[pos + len("70.52%") :])
    assert report.check(repo) == ["waste"]


def test_unbalanced_markers_and_unknown_blocks_are_refused(repo: Path) -> None:
    results = report.load_results(repo)
    with pytest.raises(ConfigError, match="unbalanced"):
        report.render_text("<!-- results:waste -->\nx\n", results)
    with pytest.raises(ConfigError, match="expected one of"):
        report.render_text("<!-- results:nope -->\nx\n<!-- /results:nope -->", results)
    with pytest.raises(ConfigError, match="record it"):
        report.render_text("<!-- results:waste -->\nx\n<!-- /results:waste -->", {})


def test_foreign_result_files_are_bounded_and_checked(repo: Path) -> None:
    bad = repo / "results" / "bogus.json"
    bad.write_text(json.dumps({"bench": "x"}))
    with pytest.raises(CorruptCacheError, match="missing keys"):
        report.load_results(repo)
    bad.unlink()
    bad.symlink_to(repo / "results" / "waste.json")
    with pytest.raises(CorruptCacheError, match="regular file"):
        report.load_results(repo)


def test_recorded_waste_equals_a_fresh_run() -> None:
    """The waste benchmark is deterministic: the committed counts are what the code computes now."""
    from memos_ref.bench import waste

    fresh = waste.run(quick=False, progress=False)
    recorded = report.load_results(ROOT)["waste"]
    assert fresh["results"] == recorded["results"]
    assert fresh["config"] == recorded["config"]


def test_adopt_stores_an_earlier_run_with_its_date_and_no_load(repo: Path, tmp_path: Path) -> None:
    data = json.loads((repo / "results" / "waste.json").read_text())
    del data["recorded"]
    earlier = tmp_path / "earlier.json"
    earlier.write_text(json.dumps(data))
    out = report.adopt(earlier, stem="waste", command="python -m memos_ref.bench waste --json", commit="abc", root=repo)
    stored = json.loads(out.read_text())
    assert stored["recorded"]["commit"] == "abc" and stored["recorded"]["load_1m_before"] is None
    assert "load not recorded" in report.provenance(stored, "waste")
    # the provenance lines changed (the waste table's, and the headline's and the claims ledger's that read it)
    assert sorted(report.check(repo)) == ["claims", "headline", "waste"]
    del data["summary"]
    earlier.write_text(json.dumps(data))
    with pytest.raises(CorruptCacheError, match="missing keys"):
        report.adopt(earlier, stem="waste", command="x", commit="abc", root=repo)


def test_claims_tables_export_every_row_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from memos_ref import notebook

    target = tmp_path / "claims.json"
    monkeypatch.setattr(notebook, "_exported", [])
    monkeypatch.delenv(notebook.CLAIMS_OUT_ENV, raising=False)
    notebook.ClaimsTable().add("s", "not exported", "m", notebook.verdict(True))
    assert not target.exists()
    monkeypatch.setenv(notebook.CLAIMS_OUT_ENV, str(target))
    first, second = notebook.ClaimsTable(), notebook.ClaimsTable()
    first.add("seed 000", "a | b", "3 of 4", notebook.verdict(False))
    second.add("seed 001", "c", "5", notebook.verdict(False, opposite=True))
    rows = report._read_claims(target)
    assert rows == [
        {"source": "seed 000", "claim": "a | b", "measured": "3 of 4", "verdict": "not reproduced"},
        {"source": "seed 001", "claim": "c", "measured": "5", "verdict": "opposite"},
    ]
    assert list(tmp_path.iterdir()) == [target]  # the temporary file was renamed, none left behind


def test_notebook_claims_files_are_bounded_and_checked(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    assert report._read_claims(path) == []  # a notebook without a claims table wrote nothing
    path.write_text(" " * (report._MAX_CLAIMS_BYTES + 1))
    with pytest.raises(CorruptCacheError, match="at most"):
        report._read_claims(path)
    for bad in ([{"source": "s", "claim": "c", "measured": 3, "verdict": "reproduced"}], {"rows": []}, [["s"]]):
        path.write_text(json.dumps(bad))
        with pytest.raises(CorruptCacheError, match="string rows"):
            report._read_claims(path)


_TINY_NOTEBOOK = """
from memos_ref.notebook import ClaimsTable, verdict
claims = ClaimsTable()
measured = sum(range(5))
claims.add("test", "the sum of 0..4 is 10", f"{measured}", verdict(measured == 10))
claims.add("test", "it is odd", f"{measured % 2}", verdict(measured % 2 == 1))
"""


def test_record_notebooks_stores_what_each_notebook_measured(repo: Path) -> None:
    import nbformat

    folder = repo / "notebooks"
    folder.mkdir()
    for name in ("00_tiny", "01_other"):
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(_TINY_NOTEBOOK)])
        nbformat.write(nb, folder / f"{name}.ipynb")
    out = report.record_notebooks(root=repo, progress=False)
    data = json.loads(out.read_text())
    assert [(r["notebook"], r["verdict"]) for r in data["results"]] == [
        ("00_tiny", "reproduced"),
        ("00_tiny", "not reproduced"),
        ("01_other", "reproduced"),
        ("01_other", "not reproduced"),
    ]
    assert data["summary"]["verdicts"] == {"reproduced": 2, "not reproduced": 2}
    text = report._notebook_claims(data)
    assert "[00](../notebooks/00_tiny.ipynb)" in text and "4 claims checked by 2 notebooks" in text
    # --only reruns one notebook and keeps the other's rows
    (folder / "01_other.ipynb").unlink()
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1")]), folder / "01_other.ipynb")
    data = json.loads(report.record_notebooks(["01"], root=repo, progress=False).read_text())
    assert [r["notebook"] for r in data["results"]] == ["00_tiny", "00_tiny"]
    assert set(data["summary"]["seconds"]) == {"00_tiny", "01_other"}
