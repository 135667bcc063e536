"""`make mutation`: mutation testing of the core with mutmut 3, incremental by default (issue 30 item 1).

Each area (a group of modules and the test files that cover them) runs in a private copy of the committed tree
(``git archive HEAD``) under ``--workdir``: mutmut copies it into ``mutants/`` and never touches the checkout.

* Incremental (default): only the functions whose lines changed between ``--base`` and HEAD (``git diff -U0``) are
  mutated and tested; their results replace those functions' earlier ones in ``results/mutation.json``. The default
  base is the commit the last run recorded there (``HEAD~1`` when there is none).
* ``--full``: every function of every listed module (see docs/testing.md for its time).
* ``--area``/``--function``: narrow a run (several allowed); ``--list``: print what would run, run nothing.

``results/mutation.json`` keeps, per module and per function, the counts of killed / survived / no-tests / timeout
mutants and each survivor's one-line diff; ``equivalent`` lists mutants proven equivalent, one line each with why
(matched by function and diff, so renumbering does not lose them). A module's score is
``(killed + timeout) / (mutants - equivalent - not checked)``; "no tests" counts as survived.

Usage: ``python scripts/mutation.py [--full] [--base REF] [--area NAME ...] [--max-children N]``
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import difflib
import fcntl
import fnmatch
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results" / "mutation.json"

# area -> (module globs, test file globs). Globs, so a module split into several files stays covered.
AREAS: dict[str, tuple[list[str], list[str]]] = {
    "paged-alloc": (  # the allocator's parts: small, covered by fast unit tests, so a run of their own
        ["memos_ref/paged/free_list.py", "memos_ref/paged/prefix_index.py", "memos_ref/paged/events.py",
         "memos_ref/paged/indexing.py", "memos_ref/paged/allocator.py"],
        ["tests/test_paged_allocator.py", "tests/test_block_pool_events.py", "tests/test_pool_growth.py",
         "tests/test_reliability_paged.py", "tests/test_paged_pool.py", "tests/test_mutation_paged.py"],
    ),
    "paged": (
        ["memos_ref/paged/*.py", "!memos_ref/paged/free_list.py", "!memos_ref/paged/prefix_index.py",
         "!memos_ref/paged/events.py", "!memos_ref/paged/indexing.py", "!memos_ref/paged/allocator.py"],
        ["tests/test_paged_*.py", "tests/test_block_pool_events.py", "tests/test_pool_*.py",
         "tests/test_regress_paged_quant.py", "tests/test_gather_pool_size.py", "tests/test_dedup.py",
         "tests/test_mutation_paged*.py", "tests/test_value_device.py"],
    ),
    "attention": (
        ["memos_ref/attention.py", "memos_ref/attention_*.py"],
        ["tests/test_attention*.py", "tests/test_mutation_attention.py", "tests/test_kernel_path.py",
         "tests/test_gather_pool_size.py", "tests/test_paged_cache_hf.py", "tests/test_quant.py"],
    ),
    "quant-codecs": (  # the schemes' codecs and their math, without the pool
        ["memos_ref/quant/*.py", "!memos_ref/quant/pool.py"],
        ["tests/test_quant.py", "tests/test_mutation_quant.py", "tests/test_regress_paged_quant.py",
         "tests/test_kernel_path.py"],
    ),
    "quant": (
        ["memos_ref/quant/pool.py"],
        ["tests/test_quant.py", "tests/test_regress_paged_quant.py", "tests/test_mutation_quant.py"],
    ),
    "session": (
        ["memos_ref/session/persist.py"],
        ["tests/test_session.py", "tests/test_regress_engine_session.py", "tests/test_mutation_session.py"],
    ),
    "memory": (
        ["memos_ref/memory/store.py", "memos_ref/memory/values.py"],
        ["tests/test_memory_store.py", "tests/test_mutation_memory.py"],
    ),
    "engine": (
        ["memos_ref/engine.py", "memos_ref/engine/*.py", "memos_ref/request.py"],
        ["tests/test_engine.py", "tests/test_regress_engine_session.py", "tests/test_mutation_engine*.py",
         "tests/test_decode_graph.py", "tests/test_bad_input_table.py", "tests/test_tiering_manager.py"],
    ),
    "tiering-codecs": (
        ["memos_ref/tiering/*codec*.py"],
        ["tests/test_tiering_storage.py", "tests/test_regress_tiers.py", "tests/test_mutation_tiering.py"],
    ),
    "tiering": (
        ["memos_ref/tiering/*backend*.py", "memos_ref/tiering/backends/*.py"],
        ["tests/test_tiering_storage.py", "tests/test_regress_tiers.py", "tests/test_mutation_tiering.py",
         "tests/test_reliability_store.py", "tests/test_bad_input_table.py"],
    ),
}  # fmt: skip

#: Tests left out of an area's mutation runs, each with why (they still run in `make test`).
DESELECT: dict[str, dict[str, str]] = {
    "quant-codecs": {
        "tests/test_quant.py::test_generation_with_every_scheme": "end-to-end generation with the shipped model,"
        " 20-30 s a scheme under load, that every codec mutant would rerun; the codecs' error bounds, packing and"
        " pool round trips are checked by the unit tests of the same file (it still runs in `make test`)",
    },
    "tiering": {
        "tests/test_bad_input_table.py::test_docs_bad_input_page_is_the_rendered_table": "compares docs/bad-input.md,"
        " which mutmut's copy (mutants/) does not hold; it checks the page, not the code",
    },
    "engine": {
        "tests/test_bad_input_table.py::test_docs_bad_input_page_is_the_rendered_table": "as for tiering",
    },
    "attention": {
        "tests/test_quant.py::test_generation_with_every_scheme": "as for quant-codecs: the attention paths of"
        " quantized pools are checked by the same file's pool tests and tests/test_kernel_path.py",
    },
    "paged": {
        "tests/test_paged_stateful.py::TestPagedMachine": "as for memory: a Hypothesis state machine under mutmut's"
        " tracing risks FlakyStrategyDefinition in the stats phase (no mutant would run), and it costs 17 s a"
        " survivor; the deterministic tests of test_paged_sequence.py and test_mutation_paged.py cover its rules",
    },
    "memory": {
        "tests/test_memory_store.py::TestStoreMachine": "Hypothesis's stateful machine fails mutmut's stats phase with"
        " FlakyStrategyDefinition (its data generation differs under mutmut's tracing), so no mutant would run; the"
        " same semantics are checked by the deterministic model test"
        " test_sweep_removes_exactly_the_expired_entries_whatever_the_overwrites_did_to_their_expiry",
    },
}

STATUS = {1: "killed", 3: "killed", 0: "survived", 5: "no_tests", 33: "no_tests", 34: "skipped", 36: "timeout"}
STATUS.update({-24: "timeout", 24: "timeout", 152: "timeout", 255: "timeout", None: "not_checked"})


def git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def head_files(globs: list[str]) -> list[str]:
    """The committed files matching ``globs``, less those matching a ``!glob`` (``__init__.py`` left out: it only
    re-exports)."""
    files = git("ls-tree", "-r", "--name-only", "HEAD").splitlines()
    keep = [g for g in globs if not g.startswith("!")]
    drop = [g[1:] for g in globs if g.startswith("!")]
    return sorted(
        f
        for f in files
        if any(fnmatch.fnmatch(f, g) for g in keep)
        and not any(fnmatch.fnmatch(f, g) for g in drop)
        and not f.endswith("__init__.py")
    )


def mangled_functions(source: str) -> dict[str, tuple[int, int]]:
    """mutmut's names for the functions it mutates (top-level ``x_f``, methods ``xǁClassǁm``) -> (first, last)."""
    out: dict[str, tuple[int, int]] = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            out[f"x_{node.name}"] = (first, node.end_lineno or node.lineno)
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    first = min([item.lineno] + [d.lineno for d in item.decorator_list])
                    out[f"xǁ{node.name}ǁ{item.name}"] = (first, item.end_lineno or item.lineno)
    return out


def changed_lines(base: str, path: str) -> set[int]:
    """Lines of HEAD's ``path`` added or changed since ``base`` (all lines when the file is new)."""
    try:
        git("cat-file", "-e", f"{base}:{path}")
    except subprocess.CalledProcessError:
        return set(range(1, 1 + len(git("show", f"HEAD:{path}").splitlines())))
    lines: set[int] = set()
    for m in re.finditer(r"^@@ -\S+ \+(\d+)(?:,(\d+))? @@", git("diff", "-U0", base, "HEAD", "--", path), re.M):
        start, count = int(m.group(1)), int(m.group(2) or 1)
        lines.update(range(start, start + max(count, 1)))  # a pure deletion marks the line after it
    return lines


def module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


#: A pytest plugin written into each area's copy (``-p mutmut_order``): mutmut 3 hands pytest a mutant's covering
#: tests as a set, in no useful order, and stops at the first failure (``-x``), so a killed mutant costs whatever ran
#: before its killer. This runs the fastest test files first (by their median test time in mutmut's stats phase),
#: each file's tests fastest first and kept together, so module-scoped fixtures are set up once. A survivor still
#: runs every covering test; the verdicts do not change, only the time to reach them.
ORDER_PLUGIN = '''"""Order a mutant's tests fastest first (written by scripts/mutation.py; see ORDER_PLUGIN there)."""
import json
import statistics
from pathlib import Path

_STATS = Path("mutmut-stats.json")  # mutmut runs pytest inside mutants/, where it keeps this file


def _durations():
    try:
        return json.loads(_STATS.read_text())["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return {}  # the stats phase itself: no order yet


def pytest_collection_modifyitems(session, config, items):
    seconds = _durations()
    if not seconds:
        return
    by_file = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::")[0], []).append(seconds.get(item.nodeid, 0.0))
    median = {name: statistics.median(times) for name, times in by_file.items()}
    items.sort(key=lambda item: (median[item.nodeid.split("::")[0]], item.nodeid.split("::")[0],
                                 seconds.get(item.nodeid, 0.0)))
'''


def prepare_tree(
    tree: Path,
    modules: list[str],
    tests: list[str],
    max_children: int,
    deselect: list[str] | None = None,
    timeout: int = 120,
) -> None:
    """A fresh copy of HEAD with mutmut's config for one area."""
    if tree.exists():
        shutil.rmtree(tree)
    tree.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "HEAD"], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    # the installed names of the renamed package folders, so mutants/ imports them from this copy too
    (tree / "memos_kernels").symlink_to("kernels")
    (tree / "memos_edge").symlink_to("edge")
    config = {
        "source_paths": ["memos_ref"],
        "only_mutate": modules,
        "also_copy": ["memos_kernels", "memos_edge", "mutmut_order.py"],
        "pytest_add_cli_args_test_selection": tests,
        "pytest_add_cli_args": ["-p", "mutmut_order", "-p", "no:cacheprovider", "-p", "no:xdist", "-q"]
        + [f"--timeout={timeout}"]
        + [arg for test in deselect or [] for arg in ("--deselect", test)],
    }
    (tree / "mutmut_order.py").write_text(ORDER_PLUGIN)
    lines = ["", "[tool.mutmut]"] + [f"{k} = {json.dumps(v)}" for k, v in config.items()]
    with open(tree / "pyproject.toml", "a") as f:
        f.write("\n".join(lines) + "\n")


def function_variants(mutated: str) -> dict[str, str]:
    """In mutmut's trampolined file: each ``<mangled>__mutmut_<n>`` / ``__mutmut_orig`` function's source."""
    out: dict[str, str] = {}
    tree = ast.parse(mutated)
    lines = mutated.splitlines()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "__mutmut_" in node.name:
            out[node.name] = "\n".join(lines[node.lineno - 1 : node.end_lineno])
    return out


def one_line_diff(orig: str, mutant: str) -> str:
    """The changed lines of a mutant, ``-old / +new``, stripped and joined on one line. The ``def`` line is
    compared too, without mutmut's ``__mutmut_<n>`` suffix, so a mutated default argument has a diff of its own."""

    def lines(source: str) -> list[str]:
        first, *rest = source.splitlines() or [""]
        return [re.sub(r"__mutmut_(?:orig|\d+)\(", "(", first, count=1), *rest]

    changed = [
        d[0] + d[1:].strip()
        for d in difflib.unified_diff(lines(orig), lines(mutant), lineterm="", n=0)
        if d[:1] in "+-" and not d.startswith(("+++", "---"))
    ]
    return " | ".join(changed)[:400]


def collect(tree: Path, module: str, wanted: set[str]) -> dict[str, dict]:
    """Per function in ``wanted``: status counts and survivors (with their diffs) from mutmut's meta file."""
    meta_path = tree / "mutants" / f"{module}.meta"
    if not meta_path.exists():
        return {}
    meta = json.loads(meta_path.read_text())
    variants = function_variants((tree / "mutants" / module).read_text())
    prefix = module_name(module) + "."
    out: dict[str, dict] = {}
    for key, code in meta["exit_code_by_key"].items():
        mangled, _, _n = key.removeprefix(prefix).rpartition("__mutmut_")
        if mangled not in wanted:
            continue
        fn = out.setdefault(mangled, {"mutants": 0, "survivors": []})
        status = STATUS.get(code, "suspicious")
        fn["mutants"] += 1
        fn[status] = fn.get(status, 0) + 1
        if status in ("survived", "no_tests", "suspicious"):
            local = key.removeprefix(prefix)
            diff = one_line_diff(variants.get(f"{mangled}__mutmut_orig", ""), variants.get(local, ""))
            fn["survivors"].append({"mutant": local, "status": status, "diff": diff})
    return out


def module_totals(functions: dict[str, dict], equivalent: list[dict], module: str, by_hand: list[dict] = ()) -> dict:
    """A module's counts. ``score``: mutmut's own verdicts, ``(killed + timeout) / judged`` with ``judged = mutants -
    equivalent - not_checked``. ``killed_by_hand``: survivors of the recorded run that a test written afterwards
    kills, each checked by applying the mutant by hand (``killed_by_hand`` in the record, with the test's name);
    ``score_with_hand_kills`` counts them as killed until a mutmut re-run records them itself."""
    keys = ("mutants", "killed", "survived", "no_tests", "timeout", "not_checked", "equivalent", "killed_by_hand")
    tot = {k: 0 for k in keys}
    equiv = {(e["module"], e["function"], e["diff"]) for e in equivalent}
    hand = {(e["module"], e["function"], e["diff"]) for e in by_hand}
    for name, fn in functions.items():
        for k in tot:
            tot[k] += fn.get(k, 0)
        for s in fn["survivors"]:
            status = s["status"] if s["status"] in tot else "survived"
            if (module, name, s["diff"]) in equiv:
                tot["equivalent"] += 1
                tot[status] -= 1
            elif (module, name, s["diff"]) in hand:
                tot["killed_by_hand"] += 1
                tot[status] -= 1
    judged = tot["mutants"] - tot["equivalent"] - tot["not_checked"]
    tot["score"] = round((tot["killed"] + tot["timeout"]) / judged, 4) if judged else None
    if tot["killed_by_hand"]:
        tot["score_with_hand_kills"] = round((tot["killed"] + tot["timeout"] + tot["killed_by_hand"]) / judged, 4)
    return tot


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full", action="store_true", help="every function of the listed modules, not only changed ones")
    ap.add_argument("--base", help="git ref to diff against (default: the commit of the last recorded run)")
    ap.add_argument("--area", action="append", choices=sorted(AREAS), help="only these areas")
    ap.add_argument("--function", action="append", help="only functions whose mutmut name matches this glob")
    ap.add_argument("--workdir", type=Path, default=Path(os.environ.get("MUTATION_WORKDIR", "/tmp/memos-mutation")))
    ap.add_argument("--max-children", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument(
        "--timeout",
        type=int,
        default=120,
        help="pytest-timeout per test, seconds: a mutant that makes a test hang fails it after this (default 120;"
        " keep it at 3x the area's slowest test under load, or a slow unmutated test would count as a kill)",
    )
    ap.add_argument("--list", action="store_true", help="print the functions that would be mutated, run nothing")
    ap.add_argument("--tests", action="append", help="test file globs to use instead of the area's (a quick look)")
    ap.add_argument(
        "--rescore",
        action="store_true",
        help="recompute every module's totals (after editing the equivalent or killed_by_hand lists), run nothing",
    )
    ap.add_argument(
        "--merge-verdicts",
        type=Path,
        metavar="JSON",
        help="add a reviewer's verdicts on survivors (a list of {module, function, diff, verdict: killed_by_hand |"
        " equivalent | left, test | why}) to the equivalent / killed_by_hand lists, then rescore; run nothing",
    )
    ap.add_argument("--table", action="store_true", help="print the per-module table of docs/testing.md, run nothing")
    args = ap.parse_args(argv)
    if args.table:
        print(table(load_record()))
        return 0
    if args.merge_verdicts:
        with results_lock():
            record = load_record()
            added = merge_verdicts(record, json.loads(args.merge_verdicts.read_text()))
            for module, entry in record["modules"].items():
                entry["totals"] = module_totals(
                    entry["functions"], record["equivalent"], module, record["killed_by_hand"]
                )
            RESULTS.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        print(f"merged: {added}")
        return 0
    if args.rescore:
        with results_lock():
            record = load_record()
            for module, entry in record["modules"].items():
                entry["totals"] = module_totals(
                    entry["functions"], record["equivalent"], module, record["killed_by_hand"]
                )
            RESULTS.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        return 0

    record = load_record()
    head = git("rev-parse", "HEAD").strip()
    base = args.base or record.get("commit") or "HEAD~1"
    for area in args.area or sorted(AREAS):
        module_globs, test_globs = AREAS[area]
        modules = head_files(module_globs)
        tests = head_files(args.tests or test_globs)
        targets: dict[str, set[str]] = {}
        for module in modules:
            functions = mangled_functions(git("show", f"HEAD:{module}"))
            if not args.full:
                lines = changed_lines(base, module)
                functions = {n: s for n, s in functions.items() if any(s[0] <= i <= s[1] for i in lines)}
            if args.function:
                functions = {n: s for n, s in functions.items() if any(fnmatch.fnmatch(n, g) for g in args.function)}
            if functions:
                targets[module] = set(functions)
        print(f"== {area}: {sum(map(len, targets.values()))} functions in {len(targets)} modules; tests: {tests}")
        for module, names in targets.items():
            print(f"   {module}: {', '.join(sorted(names))}")
        if args.list or not targets:
            continue
        tree = args.workdir / area
        prepare_tree(tree, sorted(targets), tests, args.max_children, sorted(DESELECT.get(area, {})), args.timeout)
        patterns = [f"{module_name(m)}.{n}__mutmut_*" for m, names in targets.items() for n in sorted(names)]
        start = time.monotonic()
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        mutmut = Path(sys.executable).with_name("mutmut")
        log = tree / "mutmut.log"
        with open(log, "w") as f:
            done = subprocess.run(
                [str(mutmut), "run", "--max-children", str(args.max_children), *patterns],
                cwd=tree, env=env, stdout=f, stderr=subprocess.STDOUT,
            )  # fmt: skip
        seconds = round(time.monotonic() - start, 1)
        if done.returncode != 0:
            print(f"   mutmut exited with {done.returncode}; see {log}")
        run_summary = {"area": area, "commit": head, "base": None if args.full else base, "seconds": seconds}
        run_summary.update(tests=tests, only=args.function, max_children=args.max_children, timeout=args.timeout)
        run_summary["functions"] = sum(map(len, targets.values()))
        if done.returncode != 0:
            run_summary["partial"] = True  # stopped (deadline, kill): what mutmut's meta holds is recorded
        with results_lock():
            record = load_record()  # another area's process may have saved since this one started
            record_area(record, targets, tree, head, run_summary)
            save(record, head)  # after each area: an interrupted run keeps what finished
        print(f"   {area}: {seconds} s")
    return 0


def merge_verdicts(record: dict, verdicts: list[dict]) -> dict[str, int]:
    """Add ``verdicts`` to ``record``'s ``equivalent`` (with ``why``) and ``killed_by_hand`` (with ``test``) lists,
    each survivor once (by module, function and diff; a later verdict replaces an earlier one). ``left`` verdicts are
    counted, not stored (the survivor stays a survivor). Returns the counts added per verdict."""
    keys = ("module", "function", "diff")
    fields = {"equivalent": "why", "killed_by_hand": "test"}
    added = {"equivalent": 0, "killed_by_hand": 0, "left": 0}
    for v in verdicts:
        kind = v.get("verdict")
        if kind not in added or not all(isinstance(v.get(k), str) for k in keys):
            raise SystemExit(f"a verdict needs module, function, diff and verdict in {sorted(added)}: {v}")
        added[kind] += 1
        ident = tuple(v[k] for k in keys)
        for name in fields:  # one verdict per survivor: drop an earlier one of either kind
            record[name] = [e for e in record[name] if tuple(e[k] for k in keys) != ident]
        if kind in fields:
            if not isinstance(v.get(fields[kind]), str) or not v[fields[kind]]:
                raise SystemExit(f"a {kind} verdict needs its {fields[kind]!r}: {v}")
            if kind == "killed_by_hand" and not re.fullmatch(r"tests/test_\w+\.py::test\w*(\[.*\])?", v["test"]):
                raise SystemExit(f"a hand kill names its test as tests/<file>.py::<test>: {v}")
            record[kind].append({**dict(zip(keys, ident)), fields[kind]: v[fields[kind]]})
    return added


def table(record: dict) -> str:
    """The per-module scores as the Markdown table of docs/testing.md (between its ``mutation-table`` markers):
    ``checked`` = mutants - not checked; ``left`` = survivors and mutants no test ran, less equivalent and hand
    kills."""
    rows = [
        "| module | mutants | checked | killed + timeout | equivalent | killed by hand | left | mutmut score"
        " | with hand kills |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for module, entry in sorted(record["modules"].items()):
        t = entry["totals"]
        score = t["score"]
        with_hand = t.get("score_with_hand_kills", score)
        cells = [
            f"`{module.removeprefix('memos_ref/')}`",
            t["mutants"],
            t["mutants"] - t["not_checked"],
            t["killed"] + t["timeout"],
            t["equivalent"],
            t["killed_by_hand"],
            t["survived"] + t["no_tests"],
            "–" if score is None else f"{100 * score:.1f}%",
            "–" if with_hand is None else f"{100 * with_hand:.1f}%",
        ]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(rows)


def load_record() -> dict:
    record = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    for key, empty in (("equivalent", []), ("killed_by_hand", []), ("modules", {}), ("runs", [])):
        record.setdefault(key, empty)
    return record


@contextlib.contextmanager
def results_lock():
    """An exclusive lock on ``results/mutation.json``, so areas run as separate processes merge, not overwrite."""
    with open(Path(tempfile.gettempdir()) / "memos-mutation-results.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def record_area(record: dict, targets: dict[str, set[str]], tree: Path, head: str, run_summary: dict) -> None:
    """Merge one area's results (from mutmut's meta files under ``tree``) into ``record``."""
    for module, names in targets.items():
        got = collect(tree, module, names)
        entry = record["modules"].setdefault(module, {"functions": {}})
        present = set(mangled_functions(git("show", f"HEAD:{module}")))
        entry["functions"] = {n: v for n, v in entry["functions"].items() if n in present}  # gone: dropped
        entry["functions"].update(got)
        entry["totals"] = module_totals(entry["functions"], record["equivalent"], module, record["killed_by_hand"])
        entry["commit"] = head
        t = module_totals(got, record["equivalent"], module, record["killed_by_hand"])
        run_summary.setdefault("modules", {})[module] = {k: t[k] for k in ("mutants", "killed", "survived")}
        print(f"   {module}: {entry['totals']}")
    record["runs"].append(run_summary)


def save(record: dict, head: str) -> None:
    from importlib.metadata import version

    record["commit"] = head
    record["tool"] = f"mutmut {version('mutmut')}"
    RESULTS.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    sys.exit(main())
