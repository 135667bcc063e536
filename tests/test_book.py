"""`make book`: the notebooks executed into a static HTML book, opened in headless Chromium.

Building the whole book runs every notebook (minutes); this builds one chapter (01, which has a formula, draws a
plot and ends in a claims table with computed verdicts), every reference page of docs/ and the landing page, then
asks a real browser what it renders — offline: MathJax is a copy inside the book folder.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAPTER = "01_naive_concat"
VERDICT = re.compile(r"\b(reproduced|not reproduced|opposite|inconclusive|not measured)\b")


def _builder():
    spec = importlib.util.spec_from_file_location("build_book", ROOT / "scripts" / "build_book.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


@pytest.fixture(scope="module")
def book(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("book")
    _builder().build(out, ["01"], progress=False)
    return out


def _outputs(html: str) -> list[str]:
    """The cells' output areas of a rendered chapter (what the run printed and drew, not the prose)."""
    return re.findall(r'class="[^"]*jp-OutputArea-output[^"]*"[^>]*>(.*?)</div>', html, re.S)


def _dom(browser: str, page: Path) -> str:
    """The DOM after the page's scripts ran, as a headless browser serializes it."""
    cmd = [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
    cmd += ["--virtual-time-budget=5000", "--dump-dom", page.as_uri()]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_book_files_and_links(book: Path) -> None:
    index = (book / "index.html").read_text()
    page = (book / f"{CHAPTER}.html").read_text()
    assert f'<a href="{CHAPTER}.html">01 · The naive cache: concatenate every step</a>' in index  # title, not stem
    path = (book / "ref-learning-path.html").read_text()
    assert f'href="{CHAPTER}.html"' in path  # a reference page links the built chapter ...
    assert 'href="../notebooks/02_preallocated.ipynb"' in path  # ... and the source of a chapter not built
    assert "<table>" in index and "Headline results" in index
    for literal in ("&lt;!--", "<!--", "&lt;sub&gt;", "results:headline"):  # no markup shown as text
        assert literal not in index, literal
    assert re.search(r'<img[^>]+src="data:image/png;base64,', page), "the chapter's plot is embedded"
    assert any(VERDICT.search(out) for out in _outputs(page)), "the chapter's computed verdicts are in its outputs"
    assert "Traceback" not in page
    for html_page in book.glob("*.html"):  # nothing is fetched from the network: the book works offline
        text = html_page.read_text()
        assert not re.search(r'<script[^>]+src="(https?:)?//', text), html_page.name
    assert (book / "mathjax" / "MathJax.js").is_file()
    refs = {p.name for p in book.glob("ref-*.html")}
    assert refs == {f"ref-{p.stem}.html" for p in (ROOT / "docs").glob("*.md")}, "every docs page is rendered"
    results = (book / "ref-results.html").read_text()
    assert '<a id="waste"></a>' in results and "<table>" in results


def test_solutions_are_folded_in_details() -> None:
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(42)")])
    nb.cells[0].metadata["jupyter"] = {"source_hidden": True, "outputs_hidden": True}
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="42\n")]
    _builder()._fold_solutions(nb)
    assert nb.cells[0].cell_type == "markdown"
    assert nb.cells[0].source.startswith("<details><summary>") and "print(42)" in nb.cells[0].source


def test_build_refuses_unknown_chapters(tmp_path: Path) -> None:
    with pytest.raises(SystemExit, match="no notebook numbered"):
        _builder().build(tmp_path, ["99"], progress=False)


def test_headless_chromium_renders_landing_page_and_chapter(book: Path) -> None:
    browser = _chromium()
    if browser is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI: `make browser` installs it (apt-get install -y chromium)")
        pytest.skip("no chromium here: `make browser` (or apt-get install -y chromium) to run this check")
    index = _dom(browser, book / "index.html")
    assert re.search(r'<ol id="chapters"><li><a href="01_naive_concat\.html">', index)
    assert "<td>" in index  # the headline table rendered as a table
    chapter = _dom(browser, book / f"{CHAPTER}.html")
    figures = re.findall(r'<img[^>]+src="data:image/png;base64,([A-Za-z0-9+/=]{100,})', chapter)
    assert figures, "no figure in the rendered chapter"
    assert any(VERDICT.search(out) for out in _outputs(chapter)), "no computed verdict in the rendered chapter"
    # the formula was typeset by the local MathJax: its TeX source is gone from the text, MathJax's markup is there
    assert re.search(r'class="MathJax[^"]*"', chapter), "no formula typeset as math"
    assert "$$\\text{bytes copied}" not in chapter
    results = _dom(browser, book / "ref-results.html")
    assert "<h1>Results and the claims ledger</h1>" in results and "<td>" in results  # a reference page, a table
