"""The one setup call of every notebook: CPU threads, seeds, and what the notebook runs on.

The notebooks are sized for a 2-core laptop that is also doing other things. Two torch threads on two shared,
busy cores oversubscribe them (a 14 s notebook took 405 s under background load), so the notebooks use **one**
thread unless told otherwise. The count is decided once per process, here, instead of in each notebook::

    from memos_ref.notebook import setup
    env = setup(seed=0)   # threads, interop threads, seeds; returns device and versions
    print(env)

``MEMOS_REF_NOTEBOOK_THREADS=2`` (or ``setup(threads=2)``) asks for more; the request is capped at the CPUs
this process may run on (``os.sched_getaffinity``) and at :data:`MAX_THREADS`.

The notebooks' "claim vs measured" verdicts are chosen by code, never typed: :func:`verdict` picks
"reproduced", "not reproduced" or "opposite" from what was measured; a claim about *time* is decided by
:func:`spread_verdict` from :func:`interleaved_times` (every contender timed once per round, the order rotating,
so drift of a shared machine hits all alike), which answers "inconclusive" when the claimed boundary falls
inside the spread of the paired ratios; "not measured" marks a claim this machine cannot test (no GPU).
:class:`ClaimsTable` collects the rows into the table that ends a notebook (markdown in JupyterLab, aligned
text in a terminal)::

    claims = ClaimsTable()
    claims.add("seed 000", "concat re-copies the cache every step", f"{copied:,} B", verdict(copied == formula))
    claims                   # renders as a markdown table

When ``MEMOS_REF_CLAIMS_OUT`` names a file, every row added in the process is also written there as JSON
(rewritten atomically after each row): ``python -m memos_ref.bench.report record-notebooks`` runs every notebook
that way and the README's claims ledger is generated from what they measured.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import random
import statistics
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from memos_ref.errors import ConfigError, InvalidArgumentError, check_index, check_type

ENV_VAR = "MEMOS_REF_NOTEBOOK_THREADS"
CLAIMS_OUT_ENV = "MEMOS_REF_CLAIMS_OUT"
"""A file to write every claim row of this process to, as JSON (set by ``report record-notebooks``)."""
DEFAULT_THREADS = 1
# The shipped model's matrices are tiny: past two threads the synchronisation costs more than it saves.
MAX_THREADS = 2

_decided: int | None = None  # the thread count of this process, once decided


def available_cpus() -> int:
    """The number of CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no sched_getaffinity
        return max(1, os.cpu_count() or 1)


def _requested_from_env(environ: dict[str, str]) -> int | None:
    raw = environ.get(ENV_VAR, "").strip()
    if not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigError(f"{ENV_VAR}={raw!r}: expected a positive integer (e.g. 1 or 2); unset it for the default 1")
    return value


def choose_threads(
    requested: int | None = None, *, available: int | None = None, environ: dict[str, str] | None = None
) -> int:
    """The torch thread count for a notebook: ``requested`` (else ``$MEMOS_REF_NOTEBOOK_THREADS``, else 1),
    capped at ``available`` CPUs (default :func:`available_cpus`) and at :data:`MAX_THREADS`.

    Raises :class:`~memos_ref.errors.ArgumentTypeError` / :class:`~memos_ref.errors.InvalidArgumentError` for a
    bad ``requested`` and :class:`~memos_ref.errors.ConfigError` for a bad environment value.
    """
    if requested is not None:
        requested = check_index("threads", requested, lo=1)
    else:
        requested = _requested_from_env(dict(os.environ) if environ is None else environ)
    cpus = available_cpus() if available is None else check_index("available", available, lo=1)
    want = DEFAULT_THREADS if requested is None else requested
    return max(1, min(want, cpus, MAX_THREADS))


def seed_everything(seed: int) -> None:
    """Seed Python's ``random``, NumPy's global generator and torch (CPU and CUDA)."""
    seed = check_index("seed", seed, lo=0, hi=2**32 - 1)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover - numpy is a dependency
        pass
    torch.manual_seed(seed)


def _set_interop_threads(n: int) -> None:
    # torch accepts this once per process, and only before any inter-op parallel work; otherwise keep what is set.
    if torch.get_num_interop_threads() == n:
        return
    with contextlib.suppress(RuntimeError):
        torch.set_num_interop_threads(n)


@dataclass(frozen=True)
class NotebookEnv:
    """What :func:`setup` decided and found: printed at the top of every notebook."""

    device: str
    threads: int
    interop_threads: int
    available_cpus: int
    seed: int
    python: str
    torch: str
    transformers: str
    memos_ref: str

    def __str__(self) -> str:
        return (
            f"python {self.python}, torch {self.torch}, transformers {self.transformers}, memos_ref {self.memos_ref}"
            f" | device {self.device}, {self.threads} torch thread(s) of {self.available_cpus} CPU(s)"
            f" (interop {self.interop_threads}), seed {self.seed}"
        )


def setup(seed: int = 0, threads: int | None = None) -> NotebookEnv:
    """Set a notebook up: decide the thread count (once per process; see :func:`choose_threads`), apply it to
    torch (intra-op, and inter-op if torch still allows it) and to child processes (``OMP_NUM_THREADS`` unless
    already set), seed every generator, and return the device and versions.

    Calling it again (re-running a setup cell) keeps the first decision unless ``threads`` is given.
    """
    global _decided
    seed = check_index("seed", seed, lo=0, hi=2**32 - 1)
    if threads is not None or _decided is None:
        _decided = choose_threads(threads)
    n = _decided
    torch.set_num_threads(n)
    _set_interop_threads(n)
    os.environ.setdefault("OMP_NUM_THREADS", str(n))
    seed_everything(seed)

    import transformers

    import memos_ref

    return NotebookEnv(
        device="cuda" if torch.cuda.is_available() else "cpu",
        threads=torch.get_num_threads(),
        interop_threads=torch.get_num_interop_threads(),
        available_cpus=available_cpus(),
        seed=seed,
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        memos_ref=memos_ref.__version__,
    )


# ------------------------------------------------------------------------------------------ claims and verdicts
REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"
OPPOSITE = "opposite"
INCONCLUSIVE = "inconclusive"
"""The measurement cannot decide: the claimed boundary lies inside the spread of repeated measurements."""
NOT_MEASURED = "not measured"
"""This machine cannot test the claim (e.g. a GPU timing on a CPU-only machine); nothing is concluded."""
VERDICTS = (REPRODUCED, NOT_REPRODUCED, OPPOSITE, INCONCLUSIVE, NOT_MEASURED)
MIN_ROUNDS = 3
"""Fewer interleaved rounds than this have no spread worth the name: their verdict is inconclusive."""


def verdict(holds: bool, *, opposite: bool = False) -> str:
    """The verdict on a claim from what was measured: :data:`REPRODUCED` when ``holds``, :data:`OPPOSITE` when
    the measurement shows the reverse of the claim, else :data:`NOT_REPRODUCED`.

    Both flags true is a contradiction in the caller's test and raises
    :class:`~memos_ref.errors.InvalidArgumentError`.
    """
    holds, opposite = bool(holds), bool(opposite)
    if holds and opposite:
        raise InvalidArgumentError("a claim cannot be both reproduced and contradicted: check the two conditions")
    return REPRODUCED if holds else OPPOSITE if opposite else NOT_REPRODUCED


def ratio_verdict(measured: float, claimed: float, *, rel_tol: float) -> str:
    """The verdict on a claimed ratio (``claimed`` > 1: "x is ``claimed`` times y"): reproduced when
    ``measured`` is within ``rel_tol`` (relative) of ``claimed`` or beyond it, opposite when ``measured`` is
    below ``1 / (1 + rel_tol)`` (the effect reversed beyond the tolerance), else not reproduced."""
    for name, value in (("measured", measured), ("claimed", claimed), ("rel_tol", rel_tol)):
        check_type(name, value, (int, float))
    if not claimed > 1 or not rel_tol >= 0 or not measured > 0:
        raise InvalidArgumentError(
            f"expected claimed > 1, rel_tol >= 0 and measured > 0 (ratios); got claimed={claimed}, "
            f"rel_tol={rel_tol}, measured={measured}"
        )
    return verdict(measured >= claimed * (1 - rel_tol), opposite=measured < 1 / (1 + rel_tol))


# ------------------------------------------------------------------------------------ timing claims, decided
def interleaved_times(
    fns: Mapping[str, Callable[[], object]], *, rounds: int = 5, warmup: int = 1, max_seconds: float = 30.0
) -> dict[str, list[float]]:
    """Seconds per call of every function in ``fns``, one sample per round: each round calls every function
    once, in an order that rotates by one each round, so a machine that slows down (another job starts) slows
    all contenders alike and the *paired* ratios of one round stay comparable.

    ``warmup`` untimed rounds run first. The loop is bounded in count (``rounds``) and in time: once
    ``max_seconds`` have passed, no new round starts — except that ``min(rounds, MIN_ROUNDS)`` rounds always
    run, the fewest that have a spread. Feed the result to :func:`paired_ratios`.
    """
    check_type("fns", fns, Mapping)
    if not fns or not all(callable(f) for f in fns.values()):
        raise InvalidArgumentError(f"expected a non-empty mapping of name -> callable, got {list(fns)}")
    rounds = check_index("rounds", rounds, lo=1, hi=1000)
    warmup = check_index("warmup", warmup, lo=0, hi=100)
    check_type("max_seconds", max_seconds, (int, float))
    names = list(fns)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    start = time.perf_counter()
    for r in range(rounds):
        if r >= MIN_ROUNDS and time.perf_counter() - start > max_seconds:
            break
        for name in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - t0)
    return times


@dataclass(frozen=True)
class Spread:
    """Paired ratios ``numerator / denominator``, one per interleaved round, and their min–max spread."""

    numerator: str
    denominator: str
    ratios: tuple[float, ...]

    @property
    def lo(self) -> float:
        return min(self.ratios)

    @property
    def hi(self) -> float:
        return max(self.ratios)

    @property
    def median(self) -> float:
        return statistics.median(self.ratios)

    def __str__(self) -> str:
        return (
            f"{self.numerator}/{self.denominator} {self.median:.2f}x "
            f"[{self.lo:.2f}-{self.hi:.2f}] over {len(self.ratios)} interleaved rounds"
        )


def paired_ratios(times: Mapping[str, list[float]], numerator: str, denominator: str) -> Spread:
    """The per-round ratios ``times[numerator][i] / times[denominator][i]`` (from :func:`interleaved_times`)."""
    for name in (numerator, denominator):
        if name not in times:
            raise InvalidArgumentError(f"no timings named {name!r}; have {sorted(times)}")
    a, b = times[numerator], times[denominator]
    if len(a) != len(b) or not a:
        raise InvalidArgumentError(f"expected paired samples, got {len(a)} and {len(b)}")
    if not all(x > 0 for x in (*a, *b)):
        raise InvalidArgumentError("expected positive times")
    return Spread(numerator, denominator, tuple(x / y for x, y in zip(a, b, strict=True)))


def spread_verdict(
    spread: Spread, *, at_least: float, at_most: float = math.inf, opposite_below: float | None = 1.0
) -> str:
    """The verdict on a claimed ratio band ``[at_least, at_most]`` from the spread of paired ratios:

    - reproduced: the whole spread ``[lo, hi]`` lies inside the band;
    - opposite: the whole spread lies below ``opposite_below`` (the effect reversed; None: never);
    - not reproduced: the whole spread lies outside the band;
    - inconclusive: a boundary of the band falls inside the spread (the difference is within the noise), or
      fewer than :data:`MIN_ROUNDS` rounds were timed.
    """
    check_type("spread", spread, Spread)
    if not 0 < at_least <= at_most:
        raise InvalidArgumentError(f"expected 0 < at_least <= at_most, got {at_least}, {at_most}")
    if len(spread.ratios) < MIN_ROUNDS:
        return INCONCLUSIVE
    lo, hi = spread.lo, spread.hi
    if at_least <= lo and hi <= at_most:
        return REPRODUCED
    if opposite_below is not None and hi < opposite_below:
        return OPPOSITE
    if hi < at_least or lo > at_most:
        return NOT_REPRODUCED
    return INCONCLUSIVE


def combine_verdicts(*verdicts: str) -> str:
    """One verdict for a claim tested several times: opposite if any is, then not reproduced, then inconclusive,
    then not measured; reproduced only when every part is."""
    if not verdicts or any(v not in VERDICTS for v in verdicts):
        raise InvalidArgumentError(f"expected verdicts from {VERDICTS}, got {verdicts}")
    for v in (OPPOSITE, NOT_REPRODUCED, INCONCLUSIVE, NOT_MEASURED):
        if v in verdicts:
            return v
    return REPRODUCED


# ------------------------------------------------------------------------------------------------- exercises
class WrongAnswer(AssertionError):
    """An exercise's checker found a wrong answer; the message says what was expected and how to get there."""


NOT_ANSWERED = "not answered yet"


def check_answer(name: str, got: object, expected: object, *, hint: str, rel_tol: float = 0.0) -> str:
    """Check an exercise's answer: equal (numbers: within ``rel_tol``, relative) or raise :class:`WrongAnswer`
    naming the exercise, what was given, and ``hint``. Returns a one-line message to print: "correct", or — when
    ``got`` is ``None`` or ``...`` (the exercise's stub, not attempted) — "not answered yet" with the hint, so a
    notebook run top to bottom still passes before the reader has tried.
    """
    check_type("name", name, str)
    check_type("hint", hint, str)
    if got is None or got is Ellipsis:
        return f"{name}: {NOT_ANSWERED} (fill in the code above, then run this cell). Hint: {hint}"
    numbers = (int, float)
    if isinstance(got, numbers) and isinstance(expected, numbers) and not isinstance(got, bool):
        ok = math.isclose(got, expected, rel_tol=rel_tol, abs_tol=0.0) if rel_tol else got == expected
    else:
        ok = got == expected
    if not ok:
        raise WrongAnswer(f"{name}: got {got!r}, which is not right. Hint: {hint}")
    return f"{name}: correct ({got!r})"


@dataclass(frozen=True)
class ClaimRow:
    """One claim beside what was measured, and the verdict code chose."""

    source: str
    claim: str
    measured: str
    verdict: str

    def sentence(self) -> str:
        """The verdict as a sentence: ``source: "claim" -- measured ...: verdict.``"""
        return f"{self.source}: \u201c{self.claim}\u201d \u2014 measured here: {self.measured} \u2192 {self.verdict}."


_exported: list[dict[str, str]] = []  # every row added in this process, when CLAIMS_OUT_ENV is set


def _export(row: ClaimRow) -> None:
    """Append ``row`` to the process's rows and rewrite ``$MEMOS_REF_CLAIMS_OUT`` (tmp file + rename)."""
    target = os.environ.get(CLAIMS_OUT_ENV)
    if not target:
        return
    _exported.append({"source": row.source, "claim": row.claim, "measured": row.measured, "verdict": row.verdict})
    tmp = f"{target}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(_exported, fh, ensure_ascii=False, indent=1)
    os.replace(tmp, target)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


class ClaimsTable:
    """The claims a notebook tested, each with its measured value and a verdict chosen by code.

    Displays as a markdown table in JupyterLab (``_repr_markdown_``) and as aligned text with ``print``.
    """

    HEADER = ("source", "claim", "measured here", "verdict")

    def __init__(self) -> None:
        self.rows: list[ClaimRow] = []

    def add(self, source: str, claim: str, measured: str, verdict: str) -> ClaimRow:
        """Add a row (``verdict`` must be one of :data:`VERDICTS`, e.g. from :func:`verdict`); returns it."""
        for name, value in (("source", source), ("claim", claim), ("measured", measured), ("verdict", verdict)):
            check_type(name, value, str)
        if verdict not in VERDICTS:
            raise InvalidArgumentError(f"verdict must be one of {VERDICTS}, got {verdict!r}: use verdict(...)")
        row = ClaimRow(source, claim, measured, verdict)
        self.rows.append(row)
        _export(row)
        return row

    def verdicts(self) -> dict[str, str]:
        """``{claim: verdict}`` for the checks at the end of a notebook."""
        return {row.claim: row.verdict for row in self.rows}

    def markdown(self) -> str:
        """The table in markdown (pipes inside cells escaped)."""
        lines = ["| " + " | ".join(self.HEADER) + " |", "|" + "---|" * len(self.HEADER)]
        for row in self.rows:
            cells = (row.source, row.claim, row.measured, f"**{row.verdict}**")
            lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
        return "\n".join(lines)

    def _repr_markdown_(self) -> str:
        return self.markdown()

    def __str__(self) -> str:
        table = [self.HEADER, *((r.source, r.claim, r.measured, r.verdict) for r in self.rows)]
        widths = [max(len(line[i]) for line in table) for i in range(len(self.HEADER))]
        return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table)

    def __len__(self) -> int:
        return len(self.rows)
