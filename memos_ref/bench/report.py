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
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from memos_ref.errors import ConfigError, CorruptCacheError

__all__ = [
    "BLOCKS",
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

Report = dict[str, Any]
_MAX_RESULT_BYTES = 8 << 20  # a recorded benchmark is a few KiB; refuse anything absurd before parsing
_MARKER = re.compile(r"<!-- results:([a-z0-9_-]+) -->\n(.*?)<!-- /results:\1 -->", re.S)


def _root() -> Path:
    """The repository root: the folder holding ``README.md`` and ``results/`` (cwd or a parent)."""
    here = Path.cwd().resolve()
    for folder in (here, *here.parents):
        if (folder / "README.md").is_file() and (folder / "pyproject.toml").is_file():
            return folder
    raise ConfigError(f"no repository root (README.md + pyproject.toml) at or above {here}")


def _stem(name: str, model: str | None) -> str:
    return name if model is None else f"{name}_{model}"


def _load_1m() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # not every platform has it
        return None


def _commit(root: Path) -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root, capture_output=True)
    except OSError:
        return "unknown"
    return head.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"


def record(name: str, *, model: str | None = None, quick: bool = False, root: Path | None = None) -> Path:
    """Run ``python -m memos_ref.bench NAME --json`` and store its result with where and when it ran."""
    root = root or _root()
    cmd = [sys.executable, "-m", "memos_ref.bench", name, "--json"]
    cmd += ["--model", model] if model else []
    cmd += ["--quick"] if quick else []
    load_before, commit = _load_1m(), _commit(root)  # the code as it was when the run started
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
        "load_1m_after": _load_1m(),
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
    root = root or _root()
    if path.is_symlink() or path.stat().st_size > _MAX_RESULT_BYTES:
        raise CorruptCacheError(f"{path}: expected a regular file of at most {_MAX_RESULT_BYTES} bytes")
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


_MAX_CLAIMS_BYTES = 1 << 20  # a notebook's claims are a few KiB


def _read_claims(path: Path) -> list[dict[str, str]]:
    """The rows one notebook wrote (bounded, and each a dict of four strings), or [] if it wrote none."""
    if not path.is_file():
        return []
    if path.stat().st_size > _MAX_CLAIMS_BYTES:
        raise CorruptCacheError(f"{path}: expected at most {_MAX_CLAIMS_BYTES} bytes of claims")
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

    root = root or _root()
    paths = notebook_paths(root / "notebooks", only)
    out = root / "results" / "notebooks.json"
    kept: list[dict[str, Any]] = []
    seconds: dict[str, float] = {}
    if only and out.is_file():
        if out.is_symlink() or out.stat().st_size > _MAX_RESULT_BYTES:
            raise CorruptCacheError(f"{out}: expected a regular file of at most {_MAX_RESULT_BYTES} bytes")
        old = json.loads(out.read_text())  # only this file: another benchmark's result need not be readable
        done = {p.stem for p in paths}
        kept = [r for r in old.get("results", []) if r["notebook"] not in done]
        seconds = {k: v for k, v in old.get("summary", {}).get("seconds", {}).items() if k not in done}
    load_before, commit = _load_1m(), _commit(root)
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
                rows += [{"notebook": path.stem, **r} for r in _read_claims(target)]
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
        "load_1m_after": _load_1m(),
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
    folder = (root or _root()) / "results"
    out: dict[str, Report] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        if path.stem in NOT_BENCHMARKS:
            continue
        if path.is_symlink() or path.stat().st_size > _MAX_RESULT_BYTES:
            raise CorruptCacheError(f"{path}: expected a regular file of at most {_MAX_RESULT_BYTES} bytes")
        data = json.loads(path.read_text())
        missing = {"bench", "machine", "config", "results", "summary", "recorded"} - set(data)
        if missing:
            raise CorruptCacheError(f"{path}: expected a recorded benchmark, missing keys {sorted(missing)}")
        out[path.stem] = data
    return out


# --- formatting --------------------------------------------------------------------------------------------------


def _n(x: float, digits: int = 0) -> str:
    return f"{x:,.{digits}f}"


def _pct(x: float, digits: int = 2) -> str:
    return f"{x:+.{digits}f}%"


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


def _short_provenance(report: Report, stem: str) -> str:
    """``results/STEM.json`` (date, load, commit) for a block computed from several results."""
    rec = report["recorded"]
    load = rec.get("load_1m_before")
    load_txt = f"load {load:g}" if load is not None else "load not recorded"
    return f"`results/{stem}.json` ({rec['date']}, {load_txt}, {rec['commit']})"


def _table(header: list[str], rows: list[list[str]], align: str = "") -> str:
    align = align or "l" + "r" * (len(header) - 1)
    sep = ["---" if a == "l" else "---:" for a in align]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(sep) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# --- renderers: one per README block -----------------------------------------------------------------------------


def _waste(r: Report) -> str:
    rows = r["results"]
    policies: list[str] = []
    for row in rows:
        if row["policy"] not in policies:
            policies.append(row["policy"])
    header = ["policy", *[p.replace("blocks of ", "").replace(" from 256", "").replace("x", "×") for p in policies]]
    body = []
    for trace in dict.fromkeys(row["trace"] for row in rows):
        cells = {row["policy"]: row["waste_percent"] for row in rows if row["trace"] == trace}
        body.append([f"waste, {trace}", *[f"{cells[p]:.2f}%" for p in policies]])
    return _table(header, body)


def _peer_label(r: Report, who: str) -> str:
    """A contender's name with the version or commit its result records."""
    base = {
        "ours": "memos-ref `BlockAllocator`",
        "deque": "deque baseline (nano-vllm style, same hashing)",
        "vllm": "vLLM {v} `BlockPool`, its own hashing (SHA-256 of pickle)",
        "vllm_shared_hash": "vLLM {v} `BlockPool`, the package's BLAKE2b",
        "nanovllm": "nano-vllm {v} `BlockManager`, its own xxh64",
    }.get(who, who)
    info = r.get("peers", {}).get("nanovllm" if who == "nanovllm" else "vllm") or {}
    version = info.get("version") or (info.get("commit") or "")[:7] or "(version not recorded)"
    return base.format(v=version)


def _allocator(r: Report) -> str:
    sizes = sorted({row["pool_blocks"] for row in r["results"]})
    contenders = r["config"]["contenders"]
    order = [c for c in ("ours", "vllm", "vllm_shared_hash", "nanovllm", "deque") if c in contenders]
    body = []
    for who in order:
        cells = []
        for size in sizes:
            row = next((x for x in r["results"] if x["contender"] == who and x["pool_blocks"] == size), None)
            cells.append(
                "not run (O(pool))"
                if row is None
                else f"{row['seconds']:.2f} s [{row['seconds_min']:.2f}–{row['seconds_max']:.2f}] ×{row['repeats']}"
            )
        body.append([_peer_label(r, who), *cells])
    table = _table(["CPU seconds, median [min–max] ×repeats", *[f"{s:,} blocks" for s in sizes]], body)
    summ, lines = r["summary"], []
    keys = ("64k", "1m") if "tokens_per_s_pool_1m" in summ else ("small", "large")
    for who in order[1:]:
        parts = []
        for key in keys:
            ratio = summ.get(f"ours_over_{who}_pool_{key}")
            if ratio is None:
                continue
            lo, hi = summ[f"ours_over_{who}_pool_{key}_min_max"]
            verdict = summ.get(f"ours_vs_{who}_pool_{key}_verdict", "")
            parts.append(f"{ratio:.2f} [{lo:.2f}–{hi:.2f}] at {key} ({verdict})")
        if parts:
            lines.append(f"ours / {_peer_label(r, who)}: " + ", ".join(parts))
    lo, hi = summ["pool_size_slowdown_min_max"]
    lines.append(f"ours at the large pool / the small one: {summ['pool_size_slowdown']:.2f} [{lo:.2f}–{hi:.2f}]")
    text = (
        table + "\n\nEach ratio is the median [min–max] of per-repeat pairs (the two runs of one repeat, order shuffled"
        " per repeat); below 1 ours is faster, and a spread that straddles 1 is inconclusive.\n\n- "
        + "\n- ".join(lines)
    )
    pred = summ.get("deque_scan_seconds_predicted_pool_64k")
    if pred is not None:
        text += (
            "\n\nThe deque baseline and nano-vllm keep the free list in a `deque` and call `deque.remove` whenever"
            f" a cached block is reused, which scans the list: {summ['deque_remove_calls_pool_64k']:,} removes"
            f" scanned {summ['deque_entries_scanned_pool_64k']:,} entries, at {summ['deque_scan_ns_per_entry']:.0f}"
            f" ns each (measured in the same run), which predicts {pred:.1f} s — an O(pool) step per reuse, where"
            " the intrusive free lists of ours and vLLM's are O(1). So they are not run at the large pool."
        )
    text += (
        "\n\nReproduce: `make peers && python -m memos_ref.bench allocator --json` (nano-vllm needs GitHub, or"
        " `MEMOS_REF_NANOVLLM_SRC` naming a checkout of the recorded commit)."
    )
    return text


_QUANT_NAMES = {
    "fp16": "fp16",
    "int8_tensor_fixed0.1": "int8 per tensor, scale 0.1 (seed 003)",
    "int8_tensor_calibrated": "int8 per tensor, calibrated",
    "int8_token": "int8 per token",
    "fp8_e4m3": "fp8 e4m3",
    "kivi4_g32": "KIVI-4 g32 (+128 residual)",
    "kivi4_g128": "KIVI-4 g128 (+128 residual)",
    "kivi4_g32_no_residual": "KIVI-4 g32, no residual",
    "kivi2_g32": "KIVI-2 g32 (+128 residual)",
    "kivi2_g32_no_residual": "KIVI-2 g32, no residual",
    "kivi2_g128": "KIVI-2 g128 (+128 residual)",
    "aging_int8_after256": "aging: int8 after 256 tokens",
    "aging_kivi4_after256": "aging: KIVI-4 after 256 tokens",
}


def _quant(r: Report) -> str:
    """Accuracy and bytes per scheme; a perplexity rise over 0.5% in bold (the seeds' threshold)."""
    n = r["config"]["generated_tokens"]
    wide = any("kl_mean_wide_random" in row for row in r["results"])
    body = []
    for row in r["results"]:
        delta = _pct(row["ppl_delta_pct"], 3)
        cells = [
            _QUANT_NAMES.get(row["scheme"], row["scheme"]),
            f"**{delta}**" if row["ppl_delta_pct"] > 0.5 else delta,
            f"{row['kl_mean']:.1e}",
        ]
        cells += [f"{row['kl_mean_wide_random']:.1e}" if "kl_mean_wide_random" in row else "—"] if wide else []
        cells += [f"{n - row['mismatches']}/{n}", f"{row['bytes_per_token_ratio']:.3f}"]
        body.append(cells)
    header = ["scheme", "perplexity Δ", "KL", *(["KL, wide random model"] if wide else []), "greedy"]
    head = f"fp32 perplexity {r['summary']['ppl_fp32']:.2f} over {r['config']['context_tokens']:,} tokens.\n\n"
    table = _table([*header, "bytes/token vs fp16"], body)
    return head + table


def _growth(r: Report) -> str:
    rows = [x for x in r["results"] if x["kind"] == "growth"]
    body = [
        [
            f"{x['old_capacity']:,} → {x['new_capacity']:,}",
            f"{x['bytes_copied'] / 2**20:,.0f}",
            f"{x['seed_003_ms']:g}",
            f"{x['ms_one_layer']:.2f}",
            f"{x['ms_32_layers']:,.0f}",
            f"{x['gb_per_s']:.1f}",
        ]
        for x in rows
    ]
    table = _table(["growth", "MiB copied", "seed 003 ms", "ms, one layer", "ms, × 32 layers", "GB/s"], body)
    amort = [x for x in r["results"] if x["kind"] == "amortised"]
    parts = ", ".join(f"{x['growth_factor']:g}× {x['copied_per_token_held']:.2f}" for x in amort)
    return table + (f"\n\nTokens copied per token held, growing to the end: {parts}." if parts else "")


def _memory(r: Report) -> str:
    names = {
        ("memory", 1): "memory",
        ("cachetools_ttl", 1): "`cachetools.TTLCache` + lock (hands out the stored object)",
        ("cachetools_ttl_json_copy", 1): "`cachetools.TTLCache` + lock + the same JSON copy",
        ("redis", 1): "Redis on loopback (one round trip per call)",
    }
    body = []
    for x in r["results"]:
        label = names.get((x["backend"], 1), x["backend"])
        label = (
            f"{label}, {x['shards']} shard{'s' * (x['shards'] > 1)}, {x['threads']} thread{'s' * (x['threads'] > 1)}"
        )
        cells = [x.get(k) for k in ("get_ops_per_s", "set_ops_per_s", "mix_ops_per_s", "mget100_get_ops_per_s")]
        body.append([label, *("" if c is None else _n(c) for c in cells)])
    table = _table(["configuration", "get ops/s", "set ops/s", "mixed ops/s", "`MGET` 100, gets/s"], body)
    s = r["summary"]
    text = (
        f"Ratios: ours / cachetools {s['ours_over_cachetools_json_copy_mix']:.2f}× with the same JSON copy"
        f" ({s['ours_over_cachetools_mix']:.2f}× against cachetools handing out its objects); 8 shards over one lock"
        f" at 4 threads {s['sharded_speedup_4_threads']:.2f}×; 4 threads over 1 (8 shards)"
        f" {s['threads4_over_1_8_shards']:.2f}×"
    )
    for op in ("set", "get"):
        t = s.get(f"{op}_time_over_cachetools_json_copy")
        if t:
            side = "faster" if t["max"] < 1 else "slower" if t["min"] > 1 else "inconclusive"
            text += (
                f"; `{op}` time, ours / cachetools {r.get('peers', {}).get('cachetools') or ''} + the same JSON copy:"
                f" {t['median']:.2f} [{t['min']:.2f}–{t['max']:.2f}] over {t['rounds']} interleaved rounds ({side})"
            )
    if "memory_over_redis_get" in s:
        text += (
            f"; the in-process store answers a get {s['memory_over_redis_get']:g}× faster than Redis on loopback,"
            f" `MGET` of 100 keys {s['redis_mget100_over_get']:.2f}× the gets/s of one key per call"
        )
    rates = r["summary"]["hit_rate_by_policy"]
    labels = {"hybrid": "hybrid (seed)", "hybrid_b10": "hybrid, age/10 s", "hybrid_exact": "hybrid, all entries scored"}
    labels |= {"lfu": "lfu", "lfu_exact": "lfu, all entries scored", "cachetools_ttl": "cachetools TTLCache"}
    hits = _table([labels.get(k, k) for k in rates], [[f"{v:.4f}" for v in rates.values()]], align="r" * len(rates))
    cap = r["config"]["hit_rate_capacity"]
    ops = r["config"]["hit_rate_trace_ops"]
    return (
        table + "\n\n" + text + f".\n\nHit rates on the seeded agent access pattern ({cap} entries, {ops:,} reads;"
        " exact):\n\n" + hits
    )


def _agent(r: Report) -> str:
    traces = [t for t, f in r["summary"].items() if isinstance(f, dict) and "ttft_ratio_median" in f]
    body = []
    for t in traces:
        w = next(x for x in r["results"] if x["trace"] == t and x["reuse"])
        wo = next(x for x in r["results"] if x["trace"] == t and not x["reuse"])
        body.append(
            [
                t,
                f"{w['requests']}",
                f"{w['prefill_computed']:,} / {wo['prefill_computed']:,}",
                f"{100 * r['summary'][t]['prefill_tokens_saved_fraction']:.1f}%",
                f"{w['peak_blocks']:,} / {wo['peak_blocks']:,}",
                f"{1e3 * w['ttft_median_s']:,.0f} / {1e3 * wo['ttft_median_s']:,.0f} ms",
                f"{w['tokens_per_s']:.1f} / {wo['tokens_per_s']:.1f}",
                f"{w['preemptions']} / {wo['preemptions']}",
            ]
        )
    table = _table(
        [
            "trace",
            "requests",
            "prefill tokens computed, reuse / none",
            "saved",
            "peak blocks, reuse / none",
            "median TTFT, reuse / none",
            "generated tokens/s, reuse / none",
            "preemptions",
        ],
        body,
    )
    real = r["summary"].get("smollm2-135m-instruct_real_weights")
    if real and real.get("ran"):
        w, wo = real["with_reuse"], real["without"]
        table += (
            f"\n\nSmolLM2-135M-Instruct, real weights: {real['agents']} agents over one"
            f" {real['system_prompt_tokens']}-token system prompt reuse {w['reused_tokens']} prompt tokens with the"
            f" prefix cache ({wo['reused_tokens']} without), peak blocks {w['peak_blocks']} vs {wo['peak_blocks']},"
            f" median TTFT {w['ttft_median_s']:.2f} vs {wo['ttft_median_s']:.2f} s, identical outputs."
        )
    elif real:
        table += f"\n\nSmolLM2-135M-Instruct real weights: not run ({real.get('why')})."
    return table


def _sharing(r: Report) -> str:
    body, above, below = [], [], []
    for row in r["results"]:
        if row["subagents"] == 1:
            continue
        case = f"{row['subagents']} × {row['prompt_tokens']:,}"
        timed = row.get("prefill_time_ratio") is not None
        lo, hi = row.get("prefill_time_ratio_min"), row.get("prefill_time_ratio_max")
        time_cell = f"{row['prefill_time_ratio']:.2f}× [{lo:.2f}–{hi:.2f}]" if timed else "(not timed)"
        body.append(
            [
                case,
                f"{row['blocks_shared']:,} / {row['blocks_unshared']:,}",
                f"{row['prefill_tokens_shared']:,} / {row['prefill_tokens_unshared']:,}",
                f"{row['prefill_tokens_ratio']:.2f}×",
                time_cell,
            ]
        )
        if timed:
            (above if row["prefill_time_ratio"] > row["prefill_tokens_ratio"] else below).append(case)
    table = _table(
        [
            "sub-agents × prompt",
            "blocks shared / unshared",
            "prefill tokens shared / unshared",
            "token ratio",
            "prefill time ratio, median [min–max]",
        ],
        body,
    )
    verdict = (
        f"The prefill time saved exceeds the tokens saved in {len(above)} of {len(above) + len(below)} timed cases"
    )
    if above:
        verdict += f" ({', '.join(above)}): recomputing a long prompt costs more than its share of tokens (attention"
        verdict += " is quadratic in the prompt's length)"
    if below:
        verdict += f"; it falls short of them in {', '.join(below)}, where each fork's own prefill (its task attends"
        verdict += " over the prompt gathered from the pool) weighs more than the prompt it skips"
    verdict += "."
    return table + "\n\n" + verdict


_DECODE_RATIOS = [
    ("paged_pool_size_slowdown_package", "package forward: paged in a 16× larger pool / paged", "≤ 1.1"),
    ("paged_pool_size_slowdown_transformers", "transformers forward: paged in a 16× larger pool / paged", "≤ 1.1"),
    ("paged_over_contiguous_ms_per_token_at_max_ctx", "package forward: paged / contiguous", "≤ 1.3"),
    ("paged_mirror_over_contiguous_package", "package forward: paged `dense_mirror=True` / contiguous", "≤ 1.3"),
    ("paged_over_dynamic_transformers", "transformers forward: `PagedCache` / `DynamicCache`", "≤ 1.15"),
    (
        "paged_mirror_over_dynamic_transformers",
        "transformers: `PagedCache(dense_mirror=True)` / `DynamicCache`",
        "≤ 1.15",
    ),
    ("dynamic_over_contiguous_ms_per_token_at_max_ctx", "transformers forward: `DynamicCache` / contiguous", ""),
]


def _decode(r: Report) -> str:
    """The side-by-side ratios on the wide model at the run's longest context, and the engine's overhead."""
    ratios, ctx = r["summary"]["ratios"], r["summary"]["max_context"]
    body = []
    for key, label, target in _DECODE_RATIOS:
        stat = ratios.get(key, {}).get("wide")
        if stat and stat.get("median") is not None:
            body.append([label, f"{stat['median']:.2f}× [{stat['min']:.2f}–{stat['max']:.2f}]", target])
    table = _table([f"wide model, {ctx:,} tokens: ratio", "median [min–max] of rounds", "target at 4,096"], body)
    eng = r["summary"].get("engine")
    if eng:
        table += (
            f"\n\nEngine ({eng['rows']} rows, context {eng['context']}, {eng['model']} model): per-step overhead beside"
            f" the forward {eng['overhead_us_per_row_step']:,.0f} µs per row and step"
            f" [{eng['overhead_us_per_row_step_min']:,.0f}–{eng['overhead_us_per_row_step_max']:,.0f}], against a"
            f" bare contiguous forward of {eng['contiguous_forward_us_per_row_step']:,.0f} µs"
            f" ({eng['overhead_us_per_row_step'] / eng['contiguous_forward_us_per_row_step']:.2f}× of it)."
        )
    return table


_POLICY_NAMES = {
    "lru_k2": "recency sum K=2 (seed 001's “LRU-K”)",
    "lru_k3": "recency sum K=3",
    "recency_sum_2": "recency sum K=2 (seed 001's “LRU-K”)",
    "recency_sum_3": "recency sum K=3",
    "lru_2": "LRU-2",
    "lru_3": "LRU-3",
}


def _tiering_policies(r: Report) -> str:
    """Device hit rate (share of prompt tokens served from the device) per trace and policy — exact counts."""
    rates = r["summary"]["hit_rate_by_policy"]
    policies = list(next(iter(rates.values())))
    order = ["lru", *[p for p in policies if p != "lru"]]
    body = []
    for trace, row in rates.items():
        best = max(row.values())
        body.append([trace, *[f"**{row[p]:.4f}**" if row[p] == best else f"{row[p]:.4f}" for p in order]])
    table = _table(["trace", *[_POLICY_NAMES.get(p, p) for p in order]], body)
    lines = []
    for p in order[1:]:
        deltas = [100 * (row[p] - row["lru"]) for row in rates.values()]
        lines.append(f"{_POLICY_NAMES.get(p, p)} {' / '.join(f'{d:+.1f}' for d in deltas)}")
    text = table + "\n\nPoints against LRU (" + " / ".join(rates) + "): " + "; ".join(lines) + "."
    forgot = r["summary"].get("scan_history_forgotten")
    if forgot and "scan" in rates:
        pairs = ", ".join(
            f"{_POLICY_NAMES.get(p, p)} {rates['scan'][p]:.4f} → {v:.4f}"
            for p, v in forgot.items()
            if p in rates["scan"]
        )
        text += f" On the scan trace with each block's history forgotten at eviction: {pairs}."
    return text


def _tiering_swap(r: Report) -> str:
    reload = r["config"]["calibration"]["reload_seconds_per_block"]
    names = {
        "host": "host",
        "disk": "disk (lz4; a temporary directory, reads from the page cache)",
        "redis": "Redis on loopback (lz4)",
    }
    body = []
    for row in r["results"]:
        tier = row["tier"]
        body.append(
            [
                names.get(tier, tier),
                f"{row['swap_out_gbps']:.3f}",
                f"{row['swap_in_gbps']:.3f}",
                f"{1e6 * reload[tier]:,.0f} µs",
                f"{r['summary']['break_even_tokens_' + tier]} tokens",
            ]
        )
    table = _table(["tier", "swap-out GB/s", "swap-in GB/s", "reload one block", "break-even context"], body)
    prefill = r["config"]["calibration"]["prefill_seconds"]
    ms = " / ".join(f"{1e3 * prefill[k]:,.0f}" for k in sorted(prefill, key=int))
    toks = " / ".join(f"{int(k):,}" for k in sorted(prefill, key=int))
    return table + f"\n\nPrefill of the shipped model measured {ms} ms at {toks} tokens in the same run."


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _notebook_claims(r: Report) -> str:
    """Every claims-table row the notebooks computed, grouped by notebook, with the verdict code chose."""
    body = []
    for row in r["results"]:
        link = f"[{row['notebook'][:2]}](../notebooks/{row['notebook']}.ipynb)"  # from docs/
        cells = [row["source"], row["claim"], row["measured"]]
        body.append([link, *(_md_cell(c) for c in cells), f"**{row['verdict']}**"])
    table = _table(["notebook", "source", "claim", "measured here", "verdict"], body, align="lllll")
    counts = r["summary"]["verdicts"]
    total = sum(counts.values())
    parts = ", ".join(f"{n} {v}" for v, n in counts.items())
    books = len({row["notebook"] for row in r["results"]})
    return table + f"\n\n{total} claims checked by {books} notebooks: {parts}."


# --- the claims ledger: each row's measured cell computed from the recorded benchmarks -----------------------------


def _q(results: dict[str, Report], stem: str, scheme: str) -> dict[str, Any]:
    return next(r for r in results[stem]["results"] if r["scheme"] == scheme)


def _claim_growth(res: dict[str, Report]) -> str:
    r = res["growth"]
    growth = [x for x in r["results"] if x["kind"] == "growth"]
    ms = ", ".join(f"{x['ms_one_layer']:.2f}" for x in growth)
    mib = ", ".join(f"{x['bytes_copied'] / 2**20:,.0f}" for x in growth)
    g = r["config"]["geometry"]
    return (
        f"one Llama-2-7B-shaped layer ({g['kv_heads']} KV heads × {g['head_dim']}, {g['dtype']}) on this CPU: {ms} ms,"
        f" copying exactly {mib} MiB; growing 1.5× from 256 to 8,192 tokens copies"
        f" {r['summary']['copied_per_token_held_at_1_5x']:.2f} tokens per token held (the bound is 3). The seed"
        " names no hardware: the copied bytes are the comparable figure"
    )


def _claim_reserve(res: dict[str, Report]) -> str:
    rows = {(x["trace"], x["policy"]): x["waste_percent"] for x in res["waste"]["results"]}
    trace = res["waste"]["results"][0]["trace"]
    reserve = res["waste"]["summary"]["reserve_max_waste_percent"]
    grow = next((v for (t, p), v in rows.items() if t == trace and p.startswith("grow")), None)
    inside = "inside" if 60 <= reserve <= 80 else "outside"
    text = f"{reserve:.1f}% on the seeded {trace} trace ({inside} 60–80%; it depends on the trace's lengths)"
    if grow is not None:
        text += f"; growing 1.5× from 256 wastes {grow:.1f}%"
    return text + f", 16-token blocks {res['waste']['summary']['block_16_waste_percent']:.2f}%"


def _claim_paging(res: dict[str, Report]) -> str:
    s = res["waste"]["summary"]
    b16, b128 = s["block_16_waste_percent"], s["block_128_waste_percent"]
    verdict = "holds" if b16 < 4 else "does not hold"
    return f"{b16:.2f}% with 16-token blocks ({verdict}), {b128:.2f}% with 128-token blocks"


def _claim_utilization(res: dict[str, Report]) -> str:
    s = res["waste"]["summary"]
    sizes = sorted(int(k.split("_")[3]) for k in s if k.startswith("short_calls_block_"))
    cells = ", ".join(f"{t}-token {100 * s[f'short_calls_block_{t}_utilization']:.0f}%" for t in sizes)
    below = [t for t in sizes if s[f"short_calls_block_{t}_utilization"] < 0.5]
    return (
        f"utilization n / (⌈n/T⌉·T) on short tool calls: {cells}; below 50% for blocks of"
        f" {', '.join(map(str, below)) or 'none'} — a sign the block is longer than the sequences, as claimed"
    )


def _claim_ttft(res: dict[str, Report]) -> str:
    s = res["agent"]["summary"]
    traces = [t for t, f in s.items() if isinstance(f, dict) and "ttft_ratio_median" in f]
    parts = ", ".join(f"{100 * (1 - s[t]['ttft_ratio_median']):.0f}% on `{t}`" for t in traces)
    saved = ", ".join(f"{100 * s[t]['prefill_tokens_saved_fraction']:.0f}%" for t in traces)
    lows = [100 * (1 - s[t]["ttft_ratio_median"]) for t in traces]
    inside = all(18.6 <= x <= 94.2 for x in lows)
    return (
        f"median TTFT lower by {parts} (shipped model, CPU, closed loop; prefill tokens saved {saved});"
        f" {'all inside' if inside else 'not all inside'} the claimed range"
    )


def _claim_sharing(res: dict[str, Report]) -> str:
    rows = [x for x in res["sharing"]["results"] if x["subagents"] > 1]
    parts = []
    for x in (rows[0], rows[-1]) if len(rows) > 1 else rows:
        saved = 100 * (1 - x["blocks_shared"] / x["blocks_unshared"])
        parts.append(
            f"{x['subagents']} sub-agents on {x['prompt_tokens']:,} tokens hold {x['blocks_shared']:,} blocks instead"
            f" of {x['blocks_unshared']:,} ({saved:.0f}% less)"
        )
    return "; ".join(parts) + " — more than 55% because the shared prompt dominates each agent's tokens"


def _claim_shards(res: dict[str, Report]) -> str:
    s = res["memory"]["summary"]
    sp, t4 = s["sharded_speedup_4_threads"], s["threads4_over_1_8_shards"]
    word = "faster" if sp > 1.05 else "no faster" if sp >= 0.95 else "slower"
    return (
        f"8 shards over one lock with 4 threads: {sp:.2f}× ({word}); 4 threads over 1: {t4:.2f}× (CPython's GIL"
        " serialises the work: sharding cannot help a CPU-bound Python store)"
    )


def _claim_hybrid(res: dict[str, Report]) -> str:
    h = res["memory"]["summary"]["hit_rate_by_policy"]
    cap = res["memory"]["config"]["hit_rate_capacity"]
    labels = {"hybrid_b10": "hybrid with age/10 s", "lfu_exact": "exact LFU", "hybrid_exact": "exact hybrid"}
    labels |= {"cachetools_ttl": "cachetools' TTLCache", "lfu": "sampled LFU"}
    best = labels.get(top := max((k for k in h if k != "unbounded"), key=h.get), top)
    return (
        f"hit rate at {cap} entries on the seeded agent pattern: hybrid {h['hybrid']:.3f}, LRU {h['lru']:.3f},"
        f" sampled LFU {h['lfu']:.3f}, exact LFU {h['lfu_exact']:.3f} (best: {best}; unbounded {h['unbounded']:.3f})"
    )


def _claim_int8(res: dict[str, Report]) -> str:
    out = []
    for stem, label in (("quant", "shipped model"), ("quant_smollm2-135m-instruct", "SmolLM2-135M")):
        fixed, cal, tok = (
            _q(res, stem, k)["ppl_delta_pct"] for k in ("int8_tensor_fixed0.1", "int8_tensor_calibrated", "int8_token")
        )
        out.append(
            f"{label}: perplexity {fixed:+.2f}% with the seed's fixed scale 0.1, {cal:+.2f}% calibrated per tensor,"
            f" {tok:+.2f}% per token"
        )
    fixed_real = _q(res, "quant_smollm2-135m-instruct", "int8_tensor_fixed0.1")["ppl_delta_pct"]
    verdict = "holds" if fixed_real < 0.5 else "does not hold"
    return "; ".join(out) + f" — half the bytes exactly; the seed's own recipe {verdict} on the real model"


def _claim_fp16(res: dict[str, Report]) -> str:
    parts = []
    for stem, label in (("quant", "shipped"), ("quant_smollm2-135m-instruct", "SmolLM2")):
        fp16, aging = _q(res, stem, "fp16"), _q(res, stem, "aging_int8_after256")
        parts.append(
            f"{label}: fp16 {fp16['ppl_delta_pct']:+.3f}%, aging int8 after 256 tokens {aging['ppl_delta_pct']:+.3f}%"
            f" at {aging['bytes_per_token_ratio']:.3f}× fp16 bytes"
        )
    return "; ".join(parts)


def _claim_kivi(res: dict[str, Report]) -> str:
    parts = []
    for stem, label in (("quant", "shipped"), ("quant_smollm2-135m-instruct", "SmolLM2")):
        w, wo = _q(res, stem, "kivi2_g32"), _q(res, stem, "kivi2_g32_no_residual")
        parts.append(
            f"{label}: KIVI-2 g32 {w['ppl_delta_pct']:+.2f}% with the residual, {wo['ppl_delta_pct']:+.2f}% without"
        )
    real = _q(res, "quant_smollm2-135m-instruct", "kivi2_g32")["ppl_delta_pct"]
    return "; ".join(parts) + (
        " — the residual window is what makes 2 bits work"
        + ("; at 135M even with it 2 bits cost more than 1%" if real > 1 else "")
    )


def _claim_lru_k(res: dict[str, Report]) -> str:
    rates = res["tiering"]["summary"]["hit_rate_by_policy"]
    parts = []
    for name in ("recency_sum_2", "lru_k2", "lru_2"):
        if any(name in row for row in rates.values()):
            deltas = " / ".join(f"{100 * (row[name] - row['lru']):+.1f}" for row in rates.values() if name in row)
            parts.append(f"{_POLICY_NAMES.get(name, name)} {deltas} points")
    return (
        f"against LRU on {' / '.join(rates)}: " + "; ".join(parts) + ". The seed's formula is a recency sum, not"
        " LRU-K (which ranks by the age of the K-th most recent reference)"
    )


def _claim_codecs(res: dict[str, Report]) -> str:
    c = res["tiering"]["summary"]["codec_ratio"]
    return (
        f"real KV (fp16): LZ4 {c['lz4']:.2f}×, Zstd-3 {c['zstd-3']:.2f}×, Zstd-3 after a byte shuffle"
        f" {c['zstd-3+shuffle']:.2f}× — nowhere near the claimed ratios"
    )


def _claim_prefetch(res: dict[str, Report]) -> str:
    rows = res["tiering"]["prefetch"]
    parts, unused = [], 0
    for trace in dict.fromkeys(x["trace"] for x in rows):
        by = {x["window"]: x for x in rows if x["trace"] == trace}
        if 3 in by and 5 in by:
            parts.append(f"{100 * (by[5]['device_hit_rate'] - by[3]['device_hit_rate']):+.1f} on `{trace}`")
    used = sum(x["prefetched_used"] for x in rows)
    unused = sum(x["prefetched_unused"] for x in rows)
    return (
        f"window 5 against 3, device hit rate: {', '.join(parts)} points; of {used + unused:,} prefetched blocks"
        f" {used:,} were used"
    )


def _claim_decode(res: dict[str, Report]) -> str:
    s = res["decode_quick"]["summary"]
    ctx = s["max_context"]
    nocache = s["ratios"]["nocache_over_contiguous_ms_per_token_at_max_ctx"]["wide"]["median"]
    dyn = s["ratios"]["dynamic_over_contiguous_ms_per_token_at_max_ctx"]["wide"]["median"]
    static = s["ratios"]["static_over_contiguous_ms_per_token_at_max_ctx"]["wide"]["median"]
    shd = s["ratios"]["shd_over_hsd_layout_ms_per_token_at_max_ctx"]["wide"]["median"]
    return (
        f"only at {ctx} tokens (the full 4,096-token run has not been recorded on this machine): no cache"
        f" {nocache:,.0f}× slower per token than a contiguous cache, `DynamicCache` {dyn:.2f}× and `StaticCache`"
        f" {static:.2f}× of it, `[S,H,D]` {shd:.2f}× of `[H,S,D]` (wide model, CPU)"
    )


_CLAIMS: list[tuple[str, str, Callable[[dict[str, Report]], str], str]] = [
    (
        "seed 003",
        "1.5× growth: 1024→1536 in 2.1 ms, 2048→3072 in 3.8 ms, 4096→6144 in 7.2 ms",
        _claim_growth,
        "`bench growth`",
    ),
    ("vLLM paper", "reserving the maximum length wastes 60–80% of KV memory", _claim_reserve, "`bench waste`"),
    ("PagedAttention (vLLM)", "paging wastes under 4% of KV memory", _claim_paging, "`bench waste`"),
    (
        "seed 000 §5.3",
        "block utilization below 50% means the block size should shrink",
        _claim_utilization,
        "`bench waste`",
    ),
    ("MemOS", "KV-cache reuse cuts time to first token by 18.6–94.2%", _claim_ttft, "`bench agent`"),
    ("vLLM paper", "sharing cuts memory for parallel sampling by up to 55%", _claim_sharing, "`bench sharing`"),
    ("seed 002 §5.1", "sharded locks bring a “very obvious” improvement under load", _claim_shards, "`bench memory`"),
    (
        "seed 002 §4.2",
        "the hybrid score keeps “what will be read again” better than LRU or LFU",
        _claim_hybrid,
        "`bench memory`",
    ),
    (
        "seed 003 §6.1",
        "int8 KV (`quantize_per_tensor`, `scale=0.1`) halves memory for a 0.5% accuracy loss",
        _claim_int8,
        "`bench quant`, `bench quant --model smollm2-135m-instruct`",
    ),
    (
        "seed 001 §4.1",
        "an FP16 cache halves memory with < 0.5% perplexity rise; old blocks in INT8",
        _claim_fp16,
        "`bench quant` (both models)",
    ),
    (
        "KIVI paper",
        "2-bit keys per channel and values per token with “almost the same quality”",
        _claim_kivi,
        "`bench quant` (both models)",
    ),
    ("seed 001 §2.2", "LRU-K gains 17% hit rate over LRU; K 2→3 another 9%", _claim_lru_k, "`bench tiering`"),
    ("seed 001 §4.2", "LZ4 2.1×, Zstd 3.3×, Delta+RL 4.5× on a 7B model", _claim_codecs, "`bench tiering`"),
    ("seed 001 §3.1", "prefetch window 3→5: +18% throughput", _claim_prefetch, "`bench tiering`"),
    (
        "seed 000, seed 003",
        "a cache makes decode O(n); `[H,S,D]` beats `[S,H,D]` by 50%; DynamicCache 1.54× StaticCache at 4k",
        _claim_decode,
        "`bench decode --quick`",
    ),
]
"""The ledger's rows: source, claim, the function computing the measured cell from the results, command."""

_CLAIM_STEMS = (
    "growth",
    "waste",
    "agent",
    "sharing",
    "memory",
    "quant",
    "quant_smollm2-135m-instruct",
    "tiering",
    "decode_quick",
)


def _claims_ledger(res: dict[str, Report]) -> str:
    body = [[src, _md_cell(claim), _md_cell(fn(res)), cmd] for src, claim, fn, cmd in _CLAIMS]
    return _table(["source", "claim", "measured here", "command"], body, align="llll")


def _tiering_codecs(r: Report) -> str:
    """Compression ratio of every codec on the shipped model's real KV, per dtype (exact for a given input)."""
    rows = r["codecs"]
    codecs = [c for c in dict.fromkeys(x["codec"] for x in rows) if c != "none"]
    body = []
    for dtype in dict.fromkeys(x["dtype"] for x in rows):
        ratio = {x["codec"]: x["ratio"] for x in rows if x["dtype"] == dtype}
        label = f"{dtype} (as stored)" if dtype == "float32" else dtype
        body.append([label, *(f"{ratio[c]:.2f}" if c in ratio else "—" for c in codecs)])
    return _table(["", *codecs], body)


def _tiering_prefetch(r: Report) -> str:
    """What Markov prefetch moved per trace and window, and what it changed in the device hit rate."""
    body = []
    for x in r["prefetch"]:
        body.append(
            [
                x["trace"],
                str(x["window"]),
                f"{x['prefetched_blocks']:,}",
                f"{x['prefetched_used']:,}",
                f"{100 * (x['device_hit_rate'] - x['device_hit_rate_without']):+.1f}",
                f"{x['wasted_bytes'] / 1e6:,.1f}",
            ]
        )
    return _table(
        ["trace", "window", "blocks prefetched", "used", "device hit rate, points vs none", "MB fetched for nothing"],
        body,
    )


def _headline(res: dict[str, Report]) -> str:
    """The README's headline: one line per idea, each from a recorded result (exact counts where possible)."""
    waste, sharing = res["waste"]["summary"], res["sharing"]["summary"]
    agent = res["agent"]["summary"]["multi_agent"]
    quant = res["quant_smollm2-135m-instruct"]["summary"]
    verdicts = res["notebooks"]["summary"]["verdicts"]
    counted = ", ".join(f"{n} {v}" for v, n in sorted(verdicts.items(), key=lambda kv: -kv[1]))
    body = [
        [
            "KV memory wasted (1,000 agent sessions)",
            f"{waste['reserve_max_waste_percent']:.1f}% reserving the maximum, "
            f"{waste['block_16_waste_percent']:.2f}% in 16-token blocks",
        ],
        [
            "16 sub-agents on one 8,192-token prompt",
            f"{sharing['blocks_ratio_16x8192']:.0f}× fewer KV blocks with refcounted sharing",
        ],
        [
            "multi-agent trace, prefix reuse",
            f"{100 * agent['prefill_tokens_saved_fraction']:.0f}% of prefill tokens skipped, peak KV "
            f"{agent['peak_blocks_ratio']:.2f}×",
        ],
        [
            "SmolLM2-135M, int8 KV per token",
            f"{quant['int8_token']['bytes_per_token_ratio']:.3f}× the bytes of fp16, perplexity "
            f"{quant['int8_token']['ppl_delta_pct']:+.2f}%",
        ],
        ["notebook claims, verdicts computed", counted],
    ]
    return _table(["measured", "result"], body, align="ll")


def _path(r: Report) -> str:
    """ "Start with notebook 00": the whole path's run time, from the notebooks' recorded durations."""
    seconds = r["summary"]["seconds"]
    total = sum(seconds.values())
    return (
        f"**Start with notebook 00: about {max(1, round(total / 60))} minutes for the whole path** run top to bottom "
        f"({len(seconds)} notebooks, {min(seconds.values()):.0f}–{max(seconds.values()):.0f} s each as measured), "
        "plus your reading and the exercises."
    )


_HEADLINE_STEMS = ("waste", "sharing", "agent", "quant_smollm2-135m-instruct", "notebooks")

BLOCKS: dict[str, tuple[str | tuple[str, ...], Callable[[Any], str]]] = {
    "waste": ("waste", _waste),
    "sharing": ("sharing", _sharing),
    "decode-quick": ("decode_quick", _decode),
    "decode-targets": ("decode-targets", _decode),
    "tiering-swap": ("tiering", _tiering_swap),
    "tiering-policies": ("tiering", _tiering_policies),
    "tiering-codecs": ("tiering", _tiering_codecs),
    "tiering-prefetch": ("tiering", _tiering_prefetch),
    "allocator": ("allocator", _allocator),
    "growth": ("growth", _growth),
    "memory": ("memory", _memory),
    "agent": ("agent", _agent),
    "quant": ("quant", _quant),
    "quant-real": ("quant_smollm2-135m-instruct", _quant),
    "notebook-claims": ("notebooks", _notebook_claims),
    "claims": (_CLAIM_STEMS, _claims_ledger),
    "headline": (_HEADLINE_STEMS, _headline),
    "path": ("notebooks", _path),
}
"""README block name → (result file stem, renderer of that report) or (stems, renderer of ``{stem: report}``)."""


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
    sources = "; ".join(_short_provenance(results[stem], stem) for stem in stems)
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
    root = root or _root()
    docs = root / "docs"
    return [root / "README.md", *(sorted(docs.glob("*.md")) if docs.is_dir() else [])]


def render(root: Path | None = None, *, write: bool = True) -> list[str]:
    """Regenerate the results blocks of every :func:`targets` file; returns the names of blocks whose text
    changed (README's first, then each docs page's, in order)."""
    root = root or _root()
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
