"""`make book`: the notebooks executed into a static HTML book, opened in headless Chromium.

Building the whole book runs every notebook (minutes); this builds one chapter (01, which draws a plot and
ends in a claims table with computed verdicts) and the landing page, then asks a real browser what it renders.
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
VERDICT = re.compile(r"\b(reproduced|not reproduced|opposite)\b")


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
    assert f'href="{CHAPTER}.html"' in index  # the learning path links the built chapter
    assert 'href="notebooks/02_preallocated.ipynb"' in index  # chapters not built keep their source link
    assert "Claims vs measured" in index and "<table>" in index
    assert re.search(r'<img[^>]+src="data:image/png;base64,', page), "the chapter's plot is embedded"
    assert any(VERDICT.search(out) for out in _outputs(page)), "the chapter's computed verdicts are in its outputs"
    assert "Traceback" not in page


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
    assert re.search(r'<ul id="chapters"><li><a href="01_naive_concat\.html">', index)
    assert "<td>" in index  # the claims table rendered as a table
    chapter = _dom(browser, book / f"{CHAPTER}.html")
    figures = re.findall(r'<img[^>]+src="data:image/png;base64,([A-Za-z0-9+/=]{100,})', chapter)
    assert figures, "no figure in the rendered chapter"
    assert any(VERDICT.search(out) for out in _outputs(chapter)), "no computed verdict in the rendered chapter"
