"""Every ```python block of README.md and of the reference pages it links in docs/ runs as written (offline, on the
shipped or the prepared real model), each on its own.

A block that cannot run here (a GPU, a Jetson, a download) is preceded by ``<!-- snippet: skip (reason) -->``;
it is reported as skipped with that reason, never silently left out.
"""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
from conftest import _real_model_path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the reference pages the README's manual section links (the manual that moved out of the README)
_MANUAL = ("getting-started", "api", "models", "paged", "sessions", "short-term-memory", "tiers", "quantization")
_MANUAL += ("kernels", "edge-jetson", "architecture", "results")
PAGES = [README, *(ROOT / "docs" / f"{name}.md" for name in _MANUAL)]
_BLOCK = re.compile(r"^```python[ \t]*\n(.*?)^```[ \t]*$", re.DOTALL | re.MULTILINE)
_SKIP = re.compile(r"<!--\s*snippet:\s*skip\s*\((?P<reason>[^)]*)\)\s*-->\s*$")


def readme_snippets(text: str) -> list[tuple[int, str, str | None]]:
    """``(line, code, skip reason or None)`` of every python block in ``text``."""
    snippets = []
    for match in _BLOCK.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        skip = _SKIP.search(before)
        snippets.append((line, match.group(1), skip.group("reason") if skip else None))
    return snippets


SNIPPETS = [
    (f"{page.relative_to(ROOT)}:{line}", code, skip)
    for page in PAGES
    for line, code, skip in readme_snippets(page.read_text(encoding="utf-8"))
]


def test_the_readme_has_python_snippets_and_the_extractor_sees_skips():
    assert len(SNIPPETS) >= 5
    sample = "x\n<!-- snippet: skip (needs a GPU) -->\n```python\nprint(1)\n```\n```python\nprint(2)\n```\n"
    assert readme_snippets(sample) == [(3, "print(1)\n", "needs a GPU"), (6, "print(2)\n", None)]


def test_the_readme_has_a_short_use_it_snippet():
    """The README's "use it in your code" section, code included, fits in about 20 lines."""
    text = README.read_text(encoding="utf-8")
    section = text.split("## Use it in your code\n", 1)[1].split("\n## ", 1)[0]
    assert "```python" in section and len(section.strip().splitlines()) <= 22


@pytest.mark.parametrize("line, code, skip", SNIPPETS, ids=[line for line, _, _ in SNIPPETS])
def test_readme_snippet_runs(line, code, skip, tmp_path, monkeypatch):
    if skip is not None:
        pytest.skip(f"{line}: {skip}")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # anything a snippet writes stays in the test's folder
    namespace = {"__name__": "readme_snippet"}
    if "pretrained_path" in code or "load_pretrained" in code:
        _real_model_path()  # skips (fails in CI) with the command to run when the real model is missing
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        exec(compile(code, line, "exec"), namespace)
