"""Build the notebooks and the reference pages into a static HTML book that works offline.

    python scripts/build_book.py                 # every chapter -> book/ (what `make book` runs)
    python scripts/build_book.py --only 01 07    # a subset (the test builds one chapter this way)
    python scripts/build_book.py --out /tmp/book

The committed notebooks carry no outputs; this executes each one headless (nbclient, the same kernel `make test`
uses) in ``notebooks/`` and renders it with nbconvert's HTML exporter, figures embedded as data URIs. Every page
of ``docs/`` becomes a reference page (``ref-NAME.html``). Formulas are typeset by a copy of MathJax placed in
the book folder (from the ``jupyter-server-mathjax`` package), and no page loads anything from the network, so
the folder can be opened from disk offline or served by any static host. Exercise solutions are folded behind
``<details>``. The landing page lists the chapters, by title and in reading order (:data:`CHAPTER_ORDER`), the
reference pages, and the README's headline results.
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
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
DOCS = ROOT / "docs"

CHAPTER_ORDER = ["00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12"]
"""Reading order, by the number before a notebook's first ``_``: the chapters are numbered in the order they are
read. A notebook not listed here comes after these, by name."""

MATHJAX_DIR = "mathjax"
MATHJAX_URL = f"{MATHJAX_DIR}/MathJax.js?config=TeX-AMS-MML_HTMLorMML-full,Safe"

_STYLE = """
body { font-family: system-ui, sans-serif; max-width: 60rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.5; }
table { border-collapse: collapse; margin: 1rem 0; font-size: 0.9rem; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.5rem; vertical-align: top; }
th { background: #f3f3f3; } code { background: #f6f6f6; padding: 0 0.2rem; }
pre { background: #f6f6f6; padding: 0.5rem; overflow-x: auto; }
nav a { margin-right: 1rem; } details { margin: 0.5rem 0; } summary { cursor: pointer; font-weight: 600; }
"""
_MATHJAX_CONFIG = """<script type="text/x-mathjax-config">
MathJax.Hub.Config({tex2jax: {inlineMath: [['$','$'], ['\\\\(','\\\\)']], processEscapes: true},
                   messageStyle: 'none'});
</script>"""


def chapter_key(path: Path) -> str:
    """A notebook's chapter key: the part of its name before the first ``_`` ("07" for ``07_tiering.ipynb``)."""
    return path.name.split("_", 1)[0]


def ordered(paths: list[Path]) -> list[Path]:
    """``paths`` in reading order (:data:`CHAPTER_ORDER`, then any others by name)."""
    rank = {key: i for i, key in enumerate(CHAPTER_ORDER)}
    return sorted(paths, key=lambda p: (rank.get(chapter_key(p), len(rank)), p.name))


def chapter_title(nb: nbformat.NotebookNode, fallback: str) -> str:
    """The first ``# `` heading of a notebook's first markdown cell (its title), else ``fallback``."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            match = re.search(r"^#\s+(.+)$", cell.source, re.M)
            return match.group(1).strip() if match else fallback
    return fallback


def page_title(markdown: str, fallback: str) -> str:
    match = re.search(r"^#\s+(.+)$", markdown, re.M)
    return match.group(1).strip() if match else fallback


def _markdown(text: str) -> str:
    """Markdown to HTML (tables; raw HTML passed through), with HTML comments (the results markers) removed."""
    import mistune  # nbconvert's own markdown renderer

    text = re.sub(r"<!--.*?-->\n?", "", text, flags=re.S)
    render = mistune.create_markdown(escape=False, plugins=["table"])
    return str(render(text))


def _link_pages(body: str, chapters: set[str], refs: set[str]) -> str:
    """Point links at the built pages: ``notebooks/NAME.ipynb`` (from the README or ``docs/``) to ``NAME.html``
    when that chapter was built, ``docs/NAME.md`` / ``NAME.md`` to ``ref-NAME.html``."""

    def notebook(m: re.Match[str]) -> str:
        return f'href="{m.group(1)}.html"' if m.group(1) in chapters else m.group(0)

    def doc(m: re.Match[str]) -> str:
        stem, anchor = m.group(1), m.group(2) or ""
        return f'href="ref-{stem}.html{anchor}"' if stem in refs else m.group(0)

    body = re.sub(r'href="(?:\.\./)?notebooks/([0-9A-Za-z_]+)\.ipynb"', notebook, body)
    return re.sub(r'href="(?:docs/)?([0-9A-Za-z_-]+)\.md(#[0-9A-Za-z_-]+)?"', doc, body)


def _offline(page: str) -> str:
    """Drop every script a page would fetch from the network (require.js, jQuery, widget renderers)."""
    return re.sub(r'<script[^>]*\bsrc="(?:https?:)?//[^"]*"[^>]*>\s*</script>\n?', "", page)


def _fold_solutions(nb: nbformat.NotebookNode) -> None:
    """Replace each solution cell (its source hidden in Lab) by a closed ``<details>`` holding its code and
    what it printed: in the book the answers stay out of sight until the reader opens them."""
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code" or not cell.metadata.get("jupyter", {}).get("source_hidden"):
            continue
        printed = "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream")
        parts = [f"<pre><code>{html.escape(cell.source)}</code></pre>"]
        if printed:
            parts.append(f"<pre>{html.escape(printed)}</pre>")
        folded = "<details><summary>Solution (open when you have tried)</summary>\n" + "\n".join(parts)
        nb.cells[i] = nbformat.v4.new_markdown_cell(folded + "\n</details>")


def execute(path: Path, timeout: int = 300) -> nbformat.NotebookNode:
    """Run one notebook top to bottom in its own folder; a failing cell raises (the book never shows errors)."""
    nb = nbformat.read(path, as_version=4)
    NotebookClient(
        nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    return nb


def copy_mathjax(out: Path) -> Path:
    """Copy MathJax (from the ``jupyter-server-mathjax`` package) into ``out/mathjax`` once."""
    target = out / MATHJAX_DIR
    if (target / "MathJax.js").is_file():
        return target
    try:
        import jupyter_server_mathjax
    except ImportError:
        raise SystemExit(
            "the book's formulas need a local MathJax: pip install jupyter-server-mathjax (in the notebook extra)"
        ) from None
    source = Path(jupyter_server_mathjax.__file__).parent / "static"
    shutil.copytree(source, target, dirs_exist_ok=True)
    return target


def _reference_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md")) if DOCS.is_dir() else []


def _wrap(title: str, body: str) -> str:
    nav = '<nav><a href="index.html">← memos-ref book</a></nav>'
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title><style>{_STYLE}</style>
{_MATHJAX_CONFIG}
<script src="{MATHJAX_URL}"></script></head><body>{nav}
{body}
</body></html>
"""


def build(out: Path, only: list[str] | None = None, *, progress: bool = True) -> list[Path]:
    """Execute and render the chapters (``only``: their numbers, e.g. ``01`` or ``07``), render every
    reference page of ``docs/``, and write the landing page; returns the pages written."""
    try:
        paths = ordered(notebook_paths(NOTEBOOKS, only))
    except ConfigError as exc:
        raise SystemExit(str(exc)) from None
    out.mkdir(parents=True, exist_ok=True)
    copy_mathjax(out)
    refs = {p.stem: p for p in _reference_pages()}
    exporter = HTMLExporter(template_name="lab", embed_images=True, mathjax_url=MATHJAX_URL, require_js_url="")
    pages: list[Path] = []
    chapters: list[tuple[str, str]] = []
    built = {p.stem for p in paths}
    for path in paths:
        start = time.perf_counter()
        nb = execute(path)
        title = chapter_title(nb, path.stem)
        _fold_solutions(nb)
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title}})
        body = body.replace('<script src=""></script>', "")
        nav = '<nav style="padding:0.5rem 1rem"><a href="index.html">← memos-ref book</a></nav>'
        body = re.sub(r"(<body[^>]*>)", r"\1" + nav, body, count=1)
        page = out / f"{path.stem}.html"
        page.write_text(_offline(_link_pages(body, built, set(refs))))
        pages.append(page)
        chapters.append((path.stem, title))
        if progress:
            print(f"  {path.name}: {time.perf_counter() - start:.0f} s", file=sys.stderr)
    titles = {}
    for stem, source in refs.items():
        text = source.read_text(encoding="utf-8")
        titles[stem] = page_title(text, stem)
        page = out / f"ref-{stem}.html"
        page.write_text(_wrap(titles[stem], _link_pages(_markdown(text), built, set(refs))))
        pages.append(page)
    pages.append(_landing(out, chapters, titles, built))
    return pages


def _readme_section(readme: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", readme, re.S | re.M)
    return match.group(1) if match else ""


def _landing(out: Path, chapters: list[tuple[str, str]], refs: dict[str, str], built: set[str]) -> Path:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    intro = readme.split("\n## ", 1)[0].split("\n", 1)[1]  # what it is and who it is for
    items = "".join(f'<li><a href="{stem}.html">{html.escape(title)}</a></li>' for stem, title in chapters)
    ref_items = "".join(
        f'<li><a href="ref-{stem}.html">{html.escape(title)}</a></li>'
        for stem, title in sorted(refs.items(), key=lambda kv: kv[1])
    )
    headline = _readme_section(readme, "Headline results")
    body = f"""<h1>memos-ref: the KV-cache memory layer, step by step</h1>
{_link_pages(_markdown(intro), built, set(refs))}
<p>Each chapter is a notebook, executed when this book was built, with its outputs and plots. Read them in order:
every chapter builds its idea inline first, then uses the package's version and checks the two agree.</p>
<h2>Chapters</h2><ol id="chapters">{items}</ol>
<h2>Reference pages</h2><ul id="reference">{ref_items}</ul>
<h2>Headline results</h2>
{_link_pages(_markdown(headline), built, set(refs))}
"""
    index = out / "index.html"
    index.write_text(_wrap("memos-ref — the KV-cache memory layer, step by step", body))
    return index


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "book")
    parser.add_argument("--only", nargs="*", metavar="NN", help="chapter numbers to build (default: all)")
    args = parser.parse_args(argv)
    pages = build(args.out, args.only, progress=True)
    print(f"book: {len(pages)} pages -> {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
