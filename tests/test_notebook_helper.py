"""memos_ref.notebook: the one setup call of every notebook (threads decided once, seeds, device and versions)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import memos_ref
from memos_ref import notebook
from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError


@pytest.fixture
def fresh(monkeypatch):
    """Undecided helper, no thread request in the environment; torch's thread count restored afterwards."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(notebook, "_decided", None)
    monkeypatch.delenv(notebook.ENV_VAR, raising=False)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    yield monkeypatch
    torch.set_num_threads(threads)


@given(available=st.integers(1, 256))
def test_one_thread_by_default_whatever_the_machine(available):
    assert notebook.choose_threads(available=available, environ={}) == 1


@given(requested=st.integers(1, 64), available=st.integers(1, 256))
def test_a_request_is_capped_by_the_affinity_and_the_maximum(requested, available):
    got = notebook.choose_threads(requested, available=available, environ={})
    assert got == min(requested, available, notebook.MAX_THREADS) and got >= 1


def test_the_environment_asks_and_the_argument_wins():
    env = {notebook.ENV_VAR: " 2 "}
    assert notebook.choose_threads(available=16, environ=env) == 2
    assert notebook.choose_threads(available=1, environ=env) == 1  # one CPU in the affinity mask: one thread
    assert notebook.choose_threads(1, available=16, environ=env) == 1
    assert notebook.choose_threads(available=16, environ={notebook.ENV_VAR: ""}) == 1


@pytest.mark.parametrize("raw", ["0", "-1", "two", "1.5"])
def test_a_bad_environment_value_is_a_config_error(raw):
    with pytest.raises(ConfigError, match=notebook.ENV_VAR):
        notebook.choose_threads(available=4, environ={notebook.ENV_VAR: raw})


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (0, InvalidArgumentError),
        (-2, InvalidArgumentError),
        (1.0, ArgumentTypeError),
        (True, ArgumentTypeError),
        ("2", ArgumentTypeError),
    ],
)
def test_a_bad_thread_argument_names_itself(value, error):
    with pytest.raises(error, match="threads"):
        notebook.choose_threads(value, available=4, environ={})


def test_available_cpus_follows_the_affinity_mask(monkeypatch):
    monkeypatch.setattr(notebook.os, "sched_getaffinity", lambda pid: {0, 3, 5}, raising=False)
    assert notebook.available_cpus() == 3


def test_setup_uses_one_thread_and_reports_it(fresh):
    torch.set_num_threads(4)  # what a notebook used to set by hand
    env = notebook.setup(seed=0)
    assert torch.get_num_threads() == 1 and env.threads == 1
    assert env.device == ("cuda" if torch.cuda.is_available() else "cpu")
    assert env.torch == torch.__version__ and env.memos_ref == memos_ref.__version__
    assert "1 torch thread(s)" in str(env) and f"torch {torch.__version__}" in str(env)


def test_setup_decides_once(fresh):
    fresh.setenv(notebook.ENV_VAR, "2")
    first = notebook.setup(seed=0)
    fresh.setenv(notebook.ENV_VAR, "1")  # changed after the decision: a re-run setup cell keeps the first one
    again = notebook.setup(seed=0)
    assert again.threads == first.threads == min(2, notebook.available_cpus())
    assert notebook.setup(seed=0, threads=1).threads == 1  # an explicit argument decides anew


def test_setup_seeds_every_generator(fresh):
    notebook.setup(seed=7)
    first = (random.random(), float(np.random.rand()), torch.rand(3))
    notebook.setup(seed=7)
    second = (random.random(), float(np.random.rand()), torch.rand(3))
    assert first[:2] == second[:2] and torch.equal(first[2], second[2])
    notebook.setup(seed=8)
    assert random.random() != first[0]


def test_setup_sets_child_threads_only_when_unset(fresh):
    fresh.delenv("OMP_NUM_THREADS")
    notebook.setup(seed=0)
    assert notebook.os.environ["OMP_NUM_THREADS"] == "1"
    fresh.setenv("OMP_NUM_THREADS", "3")
    notebook.setup(seed=0)
    assert notebook.os.environ["OMP_NUM_THREADS"] == "3"


@pytest.mark.parametrize("seed", [-1, 2**32, 0.5, "0"])
def test_a_bad_seed_changes_nothing(fresh, seed):
    torch.set_num_threads(3)
    with pytest.raises((ArgumentTypeError, InvalidArgumentError), match="seed"):
        notebook.setup(seed=seed)
    assert torch.get_num_threads() == 3 and notebook._decided is None


# ------------------------------------------------------------------------------ claims table and verdicts
def test_verdict_is_chosen_from_the_measurement():
    assert notebook.verdict(True) == notebook.REPRODUCED
    assert notebook.verdict(False) == notebook.NOT_REPRODUCED
    assert notebook.verdict(False, opposite=True) == notebook.OPPOSITE
    with pytest.raises(InvalidArgumentError):
        notebook.verdict(True, opposite=True)


@given(claimed=st.floats(1.01, 10), measured=st.floats(0.01, 20), tol=st.floats(0, 0.5))
def test_ratio_verdict_partitions_the_measurements(claimed, measured, tol):
    got = notebook.ratio_verdict(measured, claimed, rel_tol=tol)
    if measured >= claimed * (1 - tol):
        assert got == notebook.REPRODUCED
    elif measured < 1 / (1 + tol):
        assert got == notebook.OPPOSITE
    else:
        assert got == notebook.NOT_REPRODUCED


def test_ratio_verdict_refuses_what_is_not_a_ratio():
    for measured, claimed, tol in ((1.0, 1.0, 0.1), (0.0, 2.0, 0.1), (1.0, 2.0, -0.1)):
        with pytest.raises(InvalidArgumentError):
            notebook.ratio_verdict(measured, claimed, rel_tol=tol)
    with pytest.raises(ArgumentTypeError):
        notebook.ratio_verdict("2", 2.0, rel_tol=0.1)


def test_claims_table_renders_every_row_and_escapes_pipes():
    table = notebook.ClaimsTable()
    row = table.add("seed 000", "a | b grows", "3.2x", notebook.verdict(True))
    table.add("vLLM", "waste < 4%", "0.5%", notebook.verdict(False, opposite=True))
    md = table.markdown().splitlines()
    assert md[0] == "| source | claim | measured here | verdict |" and len(md) == 2 + len(table) == 4
    assert "a \\| b grows" in md[2] and "**reproduced**" in md[2] and "**opposite**" in md[3]
    assert table._repr_markdown_() == table.markdown()
    assert str(table).splitlines()[1].split() == ["seed", "000", "a", "|", "b", "grows", "3.2x", "reproduced"]
    assert table.verdicts() == {"a | b grows": "reproduced", "waste < 4%": "opposite"}
    assert "3.2x" in row.sentence() and row.sentence().endswith("reproduced.")


def test_claims_table_refuses_a_typed_verdict_and_stays_unchanged():
    table = notebook.ClaimsTable()
    table.add("s", "c", "m", notebook.REPRODUCED)
    with pytest.raises(InvalidArgumentError):
        table.add("s", "c2", "m", "holds")  # a verdict typed in advance, not one of the three
    with pytest.raises(ArgumentTypeError):
        table.add("s", "c3", 1.5, notebook.REPRODUCED)
    assert len(table) == 1


# ------------------------------------------------------------------ timing claims: interleaved, decided outside noise
def _spread(*ratios: float) -> notebook.Spread:
    return notebook.Spread("a", "b", tuple(ratios))


def test_spread_verdict_decides_only_outside_the_spread():
    band = {"at_least": 1.6, "at_most": 2.5}
    assert notebook.spread_verdict(_spread(1.7, 1.9, 2.4), **band) == notebook.REPRODUCED
    assert notebook.spread_verdict(_spread(1.1, 1.3, 1.5), **band) == notebook.NOT_REPRODUCED
    assert notebook.spread_verdict(_spread(0.5, 0.8, 0.9), **band) == notebook.OPPOSITE
    # 02's old run: 0.99x and 1.84x — the band's edge is inside the spread, so nothing is decided
    assert notebook.spread_verdict(_spread(0.99, 1.84, 1.2), **band) == notebook.INCONCLUSIVE
    assert notebook.spread_verdict(_spread(1.55, 1.9, 2.0), **band) == notebook.INCONCLUSIVE
    assert notebook.spread_verdict(_spread(1.9, 2.0), **band) == notebook.INCONCLUSIVE  # too few rounds
    assert notebook.spread_verdict(_spread(0.5, 0.6, 0.7), at_least=1.6, opposite_below=None) == notebook.NOT_REPRODUCED


@given(st.lists(st.floats(0.01, 100), min_size=3, max_size=9), st.floats(0.1, 10), st.floats(1, 3))
def test_spread_verdict_is_never_decided_when_a_boundary_is_inside(ratios, at_least, width):
    spread = _spread(*ratios)
    got = notebook.spread_verdict(spread, at_least=at_least, at_most=at_least * width)
    inside = spread.lo < at_least <= spread.hi or spread.lo <= at_least * width < spread.hi
    if inside:
        assert got in (notebook.INCONCLUSIVE, notebook.OPPOSITE) and (got != notebook.OPPOSITE or spread.hi < 1)
    else:
        assert got != notebook.INCONCLUSIVE


def test_interleaved_times_rotates_the_order_and_pairs_the_rounds():
    calls: list[str] = []
    fns = {name: (lambda n=name: calls.append(n)) for name in ("x", "y", "z")}
    times = notebook.interleaved_times(fns, rounds=4, warmup=1)
    assert calls[:3] == ["x", "y", "z"]  # the warm-up round
    assert calls[3:] == ["x", "y", "z", "y", "z", "x", "z", "x", "y", "x", "y", "z"]
    assert {k: len(v) for k, v in times.items()} == {"x": 4, "y": 4, "z": 4}
    spread = notebook.paired_ratios({"a": [2.0, 4.0, 3.0], "b": [1.0, 1.0, 2.0]}, "a", "b")
    assert spread.ratios == (2.0, 4.0, 1.5) and (spread.lo, spread.median, spread.hi) == (1.5, 2.0, 4.0)


def test_interleaved_times_stops_at_its_time_budget():
    calls: list[int] = []
    times = notebook.interleaved_times({"f": lambda: calls.append(1)}, rounds=50, warmup=0, max_seconds=0.0)
    # the fewest rounds with a spread always run; no new round starts past the budget
    assert len(times["f"]) == notebook.MIN_ROUNDS and len(calls) == notebook.MIN_ROUNDS


def test_timing_helpers_refuse_bad_input():
    with pytest.raises(InvalidArgumentError, match="callable"):
        notebook.interleaved_times({"f": 3})
    with pytest.raises(InvalidArgumentError, match="paired"):
        notebook.paired_ratios({"a": [1.0], "b": [1.0, 2.0]}, "a", "b")
    with pytest.raises(InvalidArgumentError, match="no timings named"):
        notebook.paired_ratios({"a": [1.0]}, "a", "b")
    with pytest.raises(InvalidArgumentError, match="at_least"):
        notebook.spread_verdict(_spread(1, 2, 3), at_least=2, at_most=1)


def test_combine_verdicts_needs_every_part():
    r, n, o, i, m = (
        notebook.REPRODUCED,
        notebook.NOT_REPRODUCED,
        notebook.OPPOSITE,
        notebook.INCONCLUSIVE,
        notebook.NOT_MEASURED,
    )
    assert notebook.combine_verdicts(r, r) == r
    assert notebook.combine_verdicts(r, i) == i and notebook.combine_verdicts(i, n) == n
    assert notebook.combine_verdicts(n, o) == o and notebook.combine_verdicts(r, m) == m
    with pytest.raises(InvalidArgumentError):
        notebook.combine_verdicts("fine")


def test_claims_table_accepts_inconclusive_and_not_measured():
    table = notebook.ClaimsTable()
    table.add("s", "timing", "1.0x [0.9-1.1]", notebook.INCONCLUSIVE)
    table.add("s", "gpu", "no CUDA device", notebook.NOT_MEASURED)
    assert table.verdicts() == {"timing": "inconclusive", "gpu": "not measured"}


def test_check_answer_explains_a_wrong_answer():
    assert notebook.check_answer("ex 1", 8, 8, hint="count the growths") == "ex 1: correct (8)"
    assert notebook.check_answer("ex 2", 0.7500001, 0.75, hint="h", rel_tol=1e-6).startswith("ex 2: correct")
    with pytest.raises(notebook.WrongAnswer, match=r"ex 1: got 7.*Hint: count the growths"):
        notebook.check_answer("ex 1", 7, 8, hint="count the growths")
    for stub in (..., None):  # the exercise's stub: the notebook still runs, and says what to do
        assert notebook.check_answer("ex 1", stub, 8, hint="h").startswith("ex 1: not answered yet")
    with pytest.raises(AssertionError):  # a failing checker fails its cell
        notebook.check_answer("ex 3", [1, 2], [2, 1], hint="order matters")
