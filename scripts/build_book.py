"""Build the notebooks into a static HTML book: every notebook executed, with its outputs and plots.

    python scripts/build_book.py                 # all notebooks -> book/ (what `make book` runs)
    python scripts/build_book.py --only 01 07    # a subset (the test builds one page this way)
    python scripts/build_book.py --out /tmp/book

The committed notebooks carry no outputs; this executes each one headless (nbclient, the same kernel `make test`
uses) in ``notebooks/`` and renders it with nbconvert's HTML exporter, figures embedded as data URIs, so the
folder can be opened from disk or served by any static host. The landing page gives the learning path (the
README's notebook table) and the README's claims table, linked to the pages.
"""

from __future__ import annotations

import argparse
import html
import re
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient
from nbconvert import HTMLExporter

from memos_ref.bench.report import notebook_paths
from memos_ref.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.5; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.5rem; vertical-align: top; }
th { background: #f3f3f3; } code { background: #f6f6f6; padding: 0 0.2rem; }
nav a { margin-right: 1rem; }
"""


def _section(readme: str, title: str) -> str:
    """The markdown of one ``## title`` section of the README (without its heading)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    if match is None:
        raise SystemExit(f"README.md has no '## {title}' section")
    return match.group(1)


def _markdown(text: str) -> str:
    import mistune  # nbconvert's own markdown renderer

    render = mistune.create_markdown(plugins=["table"])
    return str(render(text))


def _link_pages(body: str, built: set[str]) -> str:
    """Point the README's ``notebooks/NAME.ipynb`` links at the built pages (those that were built)."""

    def repl(m: re.Match[str]) -> str:
        stem = m.group(1)
        return f'href="{stem}.html"' if stem in built else m.group(0)

    return re.sub(r'href="notebooks/([0-9A-Za-z_]+)\.ipynb"', repl, body)


def execute(path: Path, timeout: int = 300) -> nbformat.NotebookNode:
    """Run one notebook top to bottom in its own folder; a failing cell raises (the book never shows errors)."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    return nb


def build(out: Path, only: list[str] | None = None, *, progress: bool = True) -> list[Path]:
    """Execute and render the notebooks (``only``: their two-digit numbers) and write the landing page."""
    try:
        paths = notebook_paths(NOTEBOOKS, only)
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    exporter = HTMLExporter(template_name="lab", embed_images=True)
    pages: list[Path] = []
    try:
        from tqdm import tqdm

        bar = tqdm(paths, desc="book", unit="notebook", disable=not progress)
    except ImportError:  # tqdm is a dependency; a bare environment still builds
        bar = paths
    for path in bar:
        start = time.perf_counter()
        nb = execute(path)
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
        nav = '<nav style="padding:0.5rem 1rem"><a href="index.html">← memos-ref book</a></nav>'
        body = re.sub(r"(<body[^>]*>)", r"\1" + nav, body, count=1)
        page = out / f"{path.stem}.html"
        page.write_text(body)
        pages.append(page)
        if progress:
            print(f"  {path.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    pages.append(_landing(out, {p.stem for p in pages}))
    return pages


def _landing(out: Path, built: set[str]) -> Path:
    readme = (ROOT / "README.md").read_text()
    path_md = _section(readme, "Notebooks")
    claims_md = _section(readme, "Claims vs measured")
    items = "".join(f'<li><a href="{stem}.html">{html.escape(stem)}</a></li>' for stem in sorted(built))
    page = f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>memos-ref — the KV-cache memory layer, step by step</title>
<style>{_STYLE}</style></head><body>
<h1>memos-ref: the KV-cache memory layer, step by step</h1>
<p>Each chapter is a notebook, executed when this book was built, with its outputs and plots. Read them in order:
every notebook builds its idea inline first, then uses the package's version and checks the two agree.</p>
<h2>Chapters in this build</h2><ul id="chapters">{items}</ul>
<h2>The learning path</h2>
{_link_pages(_markdown(path_md), built)}
<h2>Claims vs measured</h2>
{_markdown(claims_md)}
</body></html>
"""
    index = out / "index.html"
    index.write_text(page)
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "book")
    parser.add_argument("--only", nargs="*", metavar="NN", help="notebook numbers to build (default: all)")
    args = parser.parse_args(argv)
    pages = build(args.out, args.only, progress=True)
    print(f"book: {len(pages) - 1} notebooks -> {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
