"""README and reference-page figures generated from committed benchmark results, never typed.

A benchmark run is recorded into ``results/<stem>.json``: the benchmark's own JSON (its ``machine``, ``config``,
``results`` and ``summary``) plus a ``recorded`` block (UTC date, commit, the 1-minute load average before and
after, the exact command). The README (its headline table) and the reference pages under ``docs/`` (every other
table, in ``docs/results.md``) hold generated blocks between markers::

    <!-- results:waste -->
    ... generated markdown ...
    <!-- /results:waste -->

``render`` rewrites every block of README.md and ``docs/*.md`` from the recorded results; ``--check`` only
compares and exits 1 on any difference (``tests/test_readme_results.py`` runs it, so a figure that disagrees with
the committed results fails ``make test``)::

    python -m memos_ref.bench.report record waste            # runs `python -m memos_ref.bench waste --json`
    python -m memos_ref.bench.report record quant --model smollm2-135m-instruct
    python -m memos_ref.bench.report record-notebooks [--only 05 06]   # every notebook's claims table
    python -m memos_ref.bench.report render [--check]

``record-notebooks`` executes the notebooks headless with ``MEMOS_REF_CLAIMS_OUT`` set, so each row a notebook's
:class:`memos_ref.notebook.ClaimsTable` computed (claim, measured value, verdict chosen by code) lands in
``results/notebooks.json``; the README's claims ledger is rendered from it and from the benchmarks' results.

A block's renderer names the result file it reads (:data:`BLOCKS`); each block ends with a provenance line
(date, machine, load, command), so a reader sees what the numbers were measured on.

A benchmark module can render its own table: if ``memos_ref.bench.NAME`` defines ``render_markdown(result)``,
a block ``<!-- results:NAME -->`` (empty at first) in ``docs/results.md`` is filled from ``results/NAME.json`` by
that function — adding a table is one line there (:func:`module_renderer`).

This module holds the blocks and the command line; the rest is split by concept:
:mod:`memos_ref.bench.report_results` (recording and loading results), :mod:`memos_ref.bench.report_tables` (one
table per benchmark) and :mod:`memos_ref.bench.report_ledger` (the claims ledger and the headline). Every name is
still importable from here.
"""

from __future__ import annotations

import argparse
import importlib
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memos_ref.bench.report_ledger import LEDGER_BLOCKS
from memos_ref.bench.report_results import (
    MAX_CLAIMS_BYTES,
    NOT_BENCHMARKS,
    Report,
    adopt,
    load_results,
    notebook_paths,
    provenance,
    read_claims,
    record,
    record_notebooks,
    repo_root,
    short_provenance,
)
from memos_ref.bench.report_tables import TABLE_BLOCKS
from memos_ref.errors import ConfigError

__all__ = [
    "BLOCKS",
    "NOT_BENCHMARKS",
    "Report",
    "adopt",
    "blocks_in",
    "check",
    "load_results",
    "module_renderer",
    "notebook_paths",
    "provenance",
    "record",
    "record_notebooks",
    "render",
    "render_block",
    "render_text",
    "targets",
]

_MARKER = re.compile(r"<!-- results:([a-z0-9_-]+) -->\n(.*?)<!-- /results:\1 -->", re.S)
# The names this module had before the split (tests and notebooks' helpers read them here)
_root = repo_root
_read_claims = read_claims
_MAX_CLAIMS_BYTES = MAX_CLAIMS_BYTES


BLOCKS: dict[str, tuple[str | tuple[str, ...], Callable[[Any], str]]] = {**TABLE_BLOCKS, **LEDGER_BLOCKS}
"""README block name → (result file stem, renderer of that report) or (stems, renderer of ``{stem: report}``)."""

_decode = BLOCKS["decode-quick"][1]
_notebook_claims = BLOCKS["notebook-claims"][1]


def blocks_in(text: str) -> list[str]:
    """The names of the results blocks in a README text, in order."""
    return [m[1] for m in _MARKER.finditer(text)]


def module_renderer(name: str) -> Callable[[Report], str] | None:
    """``memos_ref.bench.NAME.render_markdown`` when that module exists and defines it, else None."""
    if not re.fullmatch(r"[a-z0-9_]+", name):
        return None
    try:
        module = importlib.import_module(f"memos_ref.bench.{name}")
    except ImportError:
        return None
    fn = getattr(module, "render_markdown", None)
    return fn if callable(fn) else None


def _renderer(name: str) -> tuple[str | tuple[str, ...], Callable[[Any], str]]:
    if name in BLOCKS:
        return BLOCKS[name]
    fn = module_renderer(name)
    if fn is None:
        raise ConfigError(
            f"results block {name}: expected one of {sorted(BLOCKS)}, or a benchmark module "
            f"memos_ref.bench.{name} with render_markdown(result)"
        )
    return name, fn


def render_block(name: str, results: dict[str, Report]) -> str:
    """The generated markdown of one results block (table + provenance line)."""
    stems, fn = _renderer(name)
    for stem in (stems,) if isinstance(stems, str) else stems:
        if stem not in results:
            raise ConfigError(
                f"README block results:{name} needs results/{stem}.json; record it with "
                f"`python -m memos_ref.bench.report record {stem.split('_')[0]}`"
            )
    if isinstance(stems, str):
        return fn(results[stems]) + "\n\n" + provenance(results[stems], stems) + "\n"
    sources = "; ".join(short_provenance(results[stem], stem) for stem in stems)
    return fn({stem: results[stem] for stem in stems}) + f"\n\n<sub>Computed from {sources}.</sub>\n"


def render_text(text: str, results: dict[str, Report]) -> str:
    """``text`` with every results block regenerated."""
    opened = re.findall(r"<!-- results:([a-z0-9_-]+) -->", text)
    closed = re.findall(r"<!-- /results:([a-z0-9_-]+) -->", text)
    if opened != closed:
        raise ConfigError(f"README results markers unbalanced: opened {opened}, closed {closed}")
    return _MARKER.sub(
        lambda m: f"<!-- results:{m[1]} -->\n{render_block(m[1], results)}<!-- /results:{m[1]} -->", text
    )


def targets(root: Path | None = None) -> list[Path]:
    """The files whose results blocks are generated: README.md, then every ``docs/*.md`` in name order."""
    root = root or repo_root()
    docs = root / "docs"
    return [root / "README.md", *(sorted(docs.glob("*.md")) if docs.is_dir() else [])]


def render(root: Path | None = None, *, write: bool = True) -> list[str]:
    """Regenerate the results blocks of every :func:`targets` file; returns the names of blocks whose text
    changed (README's first, then each docs page's, in order)."""
    root = root or repo_root()
    results = load_results(root)
    changed: list[str] = []
    for path in targets(root):
        text = path.read_text()
        new = render_text(text, results)
        changed += [m[1] for m, n in zip(_MARKER.finditer(text), _MARKER.finditer(new), strict=True) if m[0] != n[0]]
        if write and new != text:
            path.write_text(new)
    return changed


def check(root: Path | None = None) -> list[str]:
    """Names of results blocks that disagree with the committed results (empty when all agree)."""
    return render(root, write=False)


def main(argv: list[str] | None = None) -> int:
    """The command line: ``record``, ``adopt``, ``record-notebooks``, ``render [--check]`` (module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m memos_ref.bench.report", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    rec = sub.add_parser("record", help="run a benchmark and store results/<name>.json")
    rec.add_argument("name")
    rec.add_argument("--model")
    rec.add_argument("--quick", action="store_true")
    ado = sub.add_parser("adopt", help="store an earlier benchmark JSON (its load unrecorded) as results/STEM.json")
    ado.add_argument("file", type=Path)
    ado.add_argument("--stem", required=True)
    ado.add_argument("--command", required=True, help="the command that produced it")
    ado.add_argument("--commit", required=True, help="the commit it was measured on")
    ado.add_argument("--load", type=float, help="the 1-minute load average when the run started")
    nbs = sub.add_parser("record-notebooks", help="run the notebooks and store their claims in results/notebooks.json")
    nbs.add_argument("--only", nargs="+", metavar="NN", help="only these notebooks (the others' rows are kept)")
    ren = sub.add_parser("render", help="regenerate the README's results blocks")
    ren.add_argument("--check", action="store_true", help="compare only; exit 1 when the README disagrees")
    args = parser.parse_args(argv)
    if args.cmd == "record":
        print(record(args.name, model=args.model, quick=args.quick))
        return 0
    if args.cmd == "record-notebooks":
        print(record_notebooks(args.only))
        return 0
    if args.cmd == "adopt":
        print(adopt(args.file, stem=args.stem, command=args.command, commit=args.commit, load_1m=args.load))
        return 0
    if args.check:
        stale = check()
        if stale:
            print(f"results blocks disagree with results/: {stale}; run `python -m memos_ref.bench.report render`")
            return 1
        print("README and docs/ results blocks agree with results/")
        return 0
    print(f"rewrote {render() or 'nothing'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
