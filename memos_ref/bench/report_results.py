"""Benchmark results on disk: recording a run into ``results/<stem>.json`` and loading the recorded envelopes.

A recorded result is the benchmark's own JSON (``bench``, ``machine``, ``config``, ``results``, ``summary``) plus a
``recorded`` block (UTC date, commit, the 1-minute load average before and after, the exact command):
:func:`record` runs a benchmark and stores it, :func:`adopt` stores a JSON produced earlier,
:func:`record_notebooks` executes the notebooks and stores every claims-table row they computed, and
:func:`load_results` reads them all back, each bounded in size and checked to be an envelope (foreign data);
:func:`provenance` is the line under a table saying when, on what and by which command a result was recorded.
The markdown rendered from them lives in :mod:`memos_ref.bench.report_tables` and
:mod:`memos_ref.bench.report_ledger`; the README blocks and the CLI in :mod:`memos_ref.bench.report`.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from memos_ref.errors import ConfigError, CorruptCacheError

__all__ = [
    "MAX_CLAIMS_BYTES",
    "MAX_RESULT_BYTES",
    "NOT_BENCHMARKS",
    "Report",
    "adopt",
    "git_commit",
    "load_1m",
    "load_results",
    "notebook_paths",
    "provenance",
    "read_claims",
    "record",
    "record_notebooks",
    "repo_root",
    "short_provenance",
]

Report = dict[str, Any]
MAX_RESULT_BYTES = 8 << 20  # a recorded benchmark is a few KiB; refuse anything absurd before parsing


def repo_root() -> Path:
    """The repository root: the folder holding ``README.md`` and ``results/`` (cwd or a parent)."""
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "README.md").is_file() and (folder / "pyproject.toml").is_file():
            return folder
    raise ConfigError(f"no repository root (README.md + pyproject.toml) at or above {here}")


def _stem(name: str, model: str | None) -> str:
    return name if model is None else f"{name}_{model}"


def load_1m() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not every platform has it
        return None


def git_commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def record(name: str, *, model: str | None = None, quick: bool = False, root: Path | None = None) -> Path:
    """Run ``python -m memos_ref.bench NAME --json`` and store its result with where and when it ran."""
    root = root or repo_root()
    cmd = [sys.executable, "-m", "memos_ref.bench", name, "--json"]
    cmd += ["--model", model] if model else []
    cmd += ["--quick"] if quick else []
    load_before, commit = load_1m(), git_commit(root)  # the code as it was when the run started
    started = _dt.datetime.now(_dt.UTC)
    proc = subprocess.run(cmd, cwd=root, stdout=subprocess.PIPE, text=True)
    if proc.returncode != 0:
        raise ConfigError(f"{' '.join(cmd[1:])} exited {proc.returncode}; nothing recorded")
    report = json.loads(proc.stdout)
    report["recorded"] = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round((_dt.datetime.now(_dt.UTC) - started).total_seconds(), 1),
        "commit": commit,
        "load_1m_before": load_before,
        "load_1m_after": load_1m(),
        "command": "python -m memos_ref.bench " + " ".join(cmd[3:]),
    }
    out = root / "results" / f"{_stem(name, model)}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    return out


def adopt(
    path: Path,
    *,
    stem: str,
    command: str,
    commit: str,
    load_1m: float | None = None,
    root: Path | None = None,
) -> Path:
    """Store a benchmark JSON produced earlier (``python -m memos_ref.bench NAME --json > FILE``) as
    ``results/<stem>.json``: its date is the file's modification time; ``load_1m`` is the 1-minute load average
    noted when the run started (None: not recorded)."""
    root = root or repo_root()
    if path.is_symlink() or path.stat().st_size > MAX_RESULT_BYTES:
        raise CorruptCacheError(f"{path}: expected a regular file of at most {MAX_RESULT_BYTES} bytes")
    report = json.loads(path.read_text())
    missing = {"bench", "machine", "config", "results", "summary"} - set(report)
    if missing:
        raise CorruptCacheError(f"{path}: expected a benchmark's JSON, missing keys {sorted(missing)}")
    mtime = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.UTC)
    report["recorded"] = {
        "date": mtime.strftime("%Y-%m-%d %H:%M UTC"),
        "commit": commit,
        "load_1m_before": load_1m,
        "load_1m_after": None,
        "command": command,
    }
    out = root / "results" / f"{stem}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True) + "\n")
    return out


MAX_CLAIMS_BYTES = 1 << 20  # a notebook's claims are a few KiB


def read_claims(path: Path) -> list[dict[str, str]]:
    """The rows one notebook wrote (bounded, and each a dict of four strings), or [] if it wrote none."""
    if not path.is_file():
        return []
    if path.stat().st_size > MAX_CLAIMS_BYTES:
        raise CorruptCacheError(f"{path}: expected at most {MAX_CLAIMS_BYTES} bytes of claims")
    rows = json.loads(path.read_text(encoding="utf-8"))
    keys = {"source", "claim", "measured", "verdict"}
    if not isinstance(rows, list) or not all(
        isinstance(r, dict) and set(r) == keys and all(isinstance(v, str) for v in r.values()) for r in rows
    ):
        raise CorruptCacheError(f"{path}: expected a list of {sorted(keys)} string rows")
    return rows


def notebook_paths(folder: Path, only: list[str] | None = None) -> list[Path]:
    """The notebooks ``NN_name.ipynb`` (or ``NNx_name.ipynb``, a chapter added between two numbers, e.g.
    ``05b_...``) in ``folder``, by name; ``only``: their numbers, the part before the first ``_`` (an unknown
    number raises :class:`~memos_ref.errors.ConfigError` naming the ones there are)."""
    paths = sorted(p for p in folder.glob("[0-9][0-9]*_*.ipynb") if re.fullmatch(r"[0-9]{2}[a-z]?", _number(p)))
    if only:
        wanted = {n.zfill(2) for n in only}
        unknown = wanted - {_number(p) for p in paths}
        if unknown:
            raise ConfigError(f"--only: no notebook numbered {sorted(unknown)}; have {[_number(p) for p in paths]}")
        paths = [p for p in paths if _number(p) in wanted]
    return paths


def _number(path: Path) -> str:
    return path.name.split("_", 1)[0]


def record_notebooks(
    only: list[str] | None = None, *, root: Path | None = None, timeout: int = 600, progress: bool = True
) -> Path:
    """Execute the notebooks (``only``: their two-digit numbers; the others' rows are kept from the last record)
    with ``MEMOS_REF_CLAIMS_OUT`` set and store every claims-table row in ``results/notebooks.json``."""
    import tempfile
    import time

    import nbformat
    from nbclient import NotebookClient
    from tqdm.auto import tqdm

    from memos_ref.bench.common import envelope
    from memos_ref.notebook import CLAIMS_OUT_ENV

    root = root or repo_root()
    paths = notebook_paths(root / "notebooks", only)
    out = root / "results" / "notebooks.json"
    kept: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    if only and out.is_file():
        if out.is_symlink() or out.stat().st_size > MAX_RESULT_BYTES:
            raise CorruptCacheError(f"{out}: expected a regular file of at most {MAX_RESULT_BYTES} bytes")
        old = json.loads(out.read_text())  # only this file: another benchmark's result need not be readable
        done = {p.stem for p in paths}
        kept = [r for r in old.get("results", []) if r["notebook"] not in done]
        seconds = {k: v for k, v in old.get("summary", {}).get("seconds", {}).items() if k not in done}
    load_before, commit = load_1m(), git_commit(root)
    started = _dt.datetime.now(_dt.UTC)
    rows: list[dict[str, Any]] = []
    previous = os.environ.get(CLAIMS_OUT_ENV)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for path in tqdm(paths, desc="notebooks", disable=not progress):
                target = Path(tmp) / f"{path.stem}.json"
                os.environ[CLAIMS_OUT_ENV] = str(target)  # the kernel inherits this process's environment
                nb = nbformat.read(path, as_version=4)
                t0 = time.perf_counter()
                client = NotebookClient(
                    nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
                )
                client.execute()
                seconds[path.stem] = round(time.perf_counter() - t0, 1)
                rows += [{"notebook": path.stem, **r} for r in read_claims(target)]
    finally:
        if previous is None:
            os.environ.pop(CLAIMS_OUT_ENV, None)
        else:
            os.environ[CLAIMS_OUT_ENV] = previous
    rows = sorted(kept + rows, key=lambda r: r["notebook"])  # stable: each notebook's rows keep their order
    counts = {v: sum(r["verdict"] == v for r in rows) for v in dict.fromkeys(r["verdict"] for r in rows)}
    config = {"notebooks": sorted({r["notebook"] for r in rows} | set(seconds)), "executor": "nbclient, python3"}
    report = envelope("notebooks", config, rows, {"verdicts": counts, "seconds": dict(sorted(seconds.items()))})
    report["recorded"] = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"),
        "seconds": round((_dt.datetime.now(_dt.UTC) - started).total_seconds(), 1),
        "commit": commit,
        "load_1m_before": load_before,
        "load_1m_after": load_1m(),
        "command": "python -m memos_ref.bench.report record-notebooks" + (f" --only {' '.join(only)}" if only else ""),
    }
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(report, indent=1, sort_keys=True, ensure_ascii=False) + "\n")
    return out


#: Records in ``results/`` that are not benchmark envelopes (written by their own tools, rendered by none here)
NOT_BENCHMARKS = frozenset({"mutation"})  # scripts/mutation.py: mutation scores per module


def load_results(root: Path | None = None) -> dict[str, Report]:
    """Every ``results/*.json`` but :data:`NOT_BENCHMARKS`, keyed by file stem; each is bounded in size and must
    be a benchmark envelope."""
    folder = (root or repo_root()) / "results"
    out: dict[str, Report] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.stem in NOT_BENCHMARKS:
            continue
        if path.is_symlink() or path.stat().st_size > MAX_RESULT_BYTES:
            raise CorruptCacheError(f"{path}: expected a regular file of at most {MAX_RESULT_BYTES} bytes")
        data = json.loads(path.read_text())
        missing = {"bench", "machine", "config", "results", "summary", "recorded"} - set(data)
        if missing:
            raise CorruptCacheError(f"{path}: expected a recorded benchmark, missing keys {sorted(missing)}")
        out[path.stem] = data
    return out


def provenance(report: Report, stem: str) -> str:
    """One line: when, on what, under what load, by which command, into which file."""
    rec, mach = report["recorded"], report["machine"]
    load = rec.get("load_1m_before")
    cores = mach.get("cores")
    load_txt = f"1-min load {load:g} on {cores} cores" if load is not None else f"{cores} cores, load not recorded"
    return (
        f"<sub>Measured {rec['date']} on {mach.get('cpu')}, {load_txt}, torch {mach.get('torch')}, "
        f"commit {rec['commit']}: `{rec['command']}` → `results/{stem}.json`.</sub>"
    )


def short_provenance(report: Report, stem: str) -> str:
    """``results/STEM.json`` (date, load, commit) for a block computed from several results."""
    rec = report["recorded"]
    load = rec.get("load_1m_before")
    load_txt = f"load {load:g}" if load is not None else "load not recorded"
    return f"`results/{stem}.json` ({rec['date']}, {load_txt}, {rec['commit']})"
