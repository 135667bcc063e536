"""results/mutation.json is what `make mutation` claims (issue 30): its totals follow from its per-function counts
and its verdict lists, every "killed by hand" names a test that exists, every equivalent mutant says why, and a
reviewer's verdicts merge into it once per survivor."""

from __future__ import annotations

import ast
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECORD = json.loads((ROOT / "results" / "mutation.json").read_text())


@pytest.fixture(scope="module")
def mutation():
    spec = importlib.util.spec_from_file_location("mutation_script", ROOT / "scripts" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_modules_totals_follow_from_its_functions_and_the_verdicts(mutation):
    """Recomputing each module's totals from the recorded functions, equivalents and hand kills gives the stored
    totals (a hand-edited score, or a verdict added without a rescore, fails here)."""
    assert RECORD["modules"], "no module recorded"
    for module, entry in RECORD["modules"].items():
        want = mutation.module_totals(entry["functions"], RECORD["equivalent"], module, RECORD["killed_by_hand"])
        assert entry["totals"] == want, module


def _test_names() -> set[str]:
    names = set()
    for path in (ROOT / "tests").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test"):
                names.add(f"tests/{path.name}::{node.name}")
    return names


def test_every_hand_kill_names_an_existing_test_and_every_equivalent_says_why():
    names = _test_names()
    for kill in RECORD["killed_by_hand"]:
        test = kill["test"].split("[")[0]
        assert test in names, kill
    for equivalent in RECORD["equivalent"]:
        assert len(equivalent["why"].split()) >= 4, equivalent  # a reason, not a word
    verdicts = [(e["module"], e["function"], e["diff"]) for e in RECORD["equivalent"] + RECORD["killed_by_hand"]]
    assert len(verdicts) == len(set(verdicts)), "a survivor has two verdicts"


def test_verdicts_merge_once_per_survivor_and_are_refused_when_incomplete(mutation):
    record = {"equivalent": [], "killed_by_hand": [], "modules": {}, "runs": []}
    one = {"module": "m.py", "function": "x_f", "diff": "-a | +b"}
    assert mutation.merge_verdicts(record, [{**one, "verdict": "equivalent", "why": "b equals a here"}]) == {
        "equivalent": 1, "killed_by_hand": 0, "left": 0}  # fmt: skip
    mutation.merge_verdicts(record, [{**one, "verdict": "killed_by_hand", "test": "tests/test_t.py::test_x"}])
    assert record["equivalent"] == [] and record["killed_by_hand"] == [{**one, "test": "tests/test_t.py::test_x"}]
    mutation.merge_verdicts(record, [{**one, "verdict": "left", "why": "not analysed"}])
    assert record["equivalent"] == [] and record["killed_by_hand"] == []  # left: the survivor stays a survivor
    bare = {**one, "verdict": "killed_by_hand", "test": "test_x"}  # a test named without its file
    for bad in ({**one, "verdict": "equivalent"}, {**one, "verdict": "killed"}, {"verdict": "left", "why": "x"}, bare):
        with pytest.raises(SystemExit):
            mutation.merge_verdicts(record, [bad])


def test_the_docs_table_is_the_one_the_record_gives(mutation):
    """docs/testing.md's per-module table is `python scripts/mutation.py --table` of the committed record."""
    text = (ROOT / "docs" / "testing.md").read_text()
    begin = "<!-- mutation-table: python scripts/mutation.py --table -->\n"
    assert begin in text and "<!-- /mutation-table -->" in text
    shown = text.split(begin, 1)[1].split("<!-- /mutation-table -->", 1)[0].strip()
    assert shown == mutation.table(RECORD), "run `python scripts/mutation.py --table` and paste it into docs/testing.md"


def test_a_mutated_default_argument_has_a_diff_of_its_own(mutation):
    """Two mutants of one function's defaults differ only on its ``def`` line: each gets its own one-line diff
    (a verdict is keyed by the diff, so an empty one would cover every such mutant at once), without mutmut's
    ``__mutmut_<n>`` suffix; the body's lines compare as before."""
    orig = 'def xǁPǁf__mutmut_orig(self, name: str = "n") -> int:\n    return len(name)\n'
    first = orig.replace("__mutmut_orig", "__mutmut_1").replace('"n"', '"XXnXX"')
    second = orig.replace("__mutmut_orig", "__mutmut_2").replace('"n"', '"N"')
    body = orig.replace("__mutmut_orig", "__mutmut_3").replace("len(name)", "len(None)")
    assert mutation.one_line_diff(orig, first) == (
        '-def xǁPǁf(self, name: str = "n") -> int: | +def xǁPǁf(self, name: str = "XXnXX") -> int:'
    )
    assert mutation.one_line_diff(orig, second) == (
        '-def xǁPǁf(self, name: str = "n") -> int: | +def xǁPǁf(self, name: str = "N") -> int:'
    )
    assert mutation.one_line_diff(orig, body) == "-return len(name) | +return len(None)"
    assert mutation.one_line_diff(orig, orig.replace("__mutmut_orig", "__mutmut_4")) == ""


def test_no_recorded_survivor_has_an_empty_diff():
    empty = [(m, s["mutant"]) for m, e in RECORD["modules"].items() for f in e["functions"].values()
             for s in f["survivors"] if not s["diff"]]  # fmt: skip
    assert not empty
