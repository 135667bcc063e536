"""Notebooks are committed without outputs, in order, set up by one shared helper, and each ends with assertions.

"Committed" means what git would commit, not the working copy: `make lab` opens notebooks/ in place and
JupyterLab saves outputs into the files, and the nbstripout clean filter (named in .gitattributes, configured by
`make setup`) strips them when git stages a notebook. So the staged (index) version must be clean, and the working
copy must be clean *after the filter* where the filter is configured, or clean as it is where it is not.
"""

from __future__ import annotations

import ast
import copy
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest
from nbstripout import strip_output

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# The clean filter the Makefile configures: `python -m nbstripout` plus these arguments.
FILTER_ARGS = ["--keep-id", "--extra-keys", "metadata.language_info"]
CLEAN = "clean"
CLEAN_AFTER_FILTER = "clean after filter"
HOW_TO_FIX = (
    "run `make setup` (it configures the nbstripout git filter, which strips outputs on `git add`), or clear the "
    "outputs (JupyterLab: Edit > Clear Outputs of All Cells) and save"
)


# ------------------------------------------------------------------ the check, as functions the tests exercise
def output_problems(nb: nbformat.NotebookNode) -> list[str]:
    """One line per code cell that carries outputs or an execution count."""
    problems = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            problems.append(f"cell {i} has {len(cell.outputs)} output(s)")
        if cell.get("execution_count") is not None:
            problems.append(f"cell {i} has execution count {cell.execution_count}")
    return problems


def strip(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """What the clean filter makes of ``nb`` (nbstripout's own function, with the filter's arguments)."""
    extra = FILTER_ARGS[FILTER_ARGS.index("--extra-keys") + 1].split()
    return strip_output(copy.deepcopy(nb), keep_output=False, keep_count=False, keep_id=True, extra_keys=extra)


def clean_status(nb: nbformat.NotebookNode, *, filter_active: bool) -> str:
    """``"clean"``; ``"clean after filter"`` (outputs the active git filter strips before they are committed);
    or a description of the outputs that git would commit."""
    problems = output_problems(nb)
    if not problems:
        return CLEAN
    if filter_active:
        left = output_problems(strip(nb))
        if not left:
            return CLEAN_AFTER_FILTER
        problems = left  # e.g. a cell tagged keep_output: the filter keeps it, so git would commit it
    more = f"; and {len(problems) - 4} more" if len(problems) > 4 else ""
    return "outputs git would commit: " + "; ".join(problems[:4]) + more


def git(*args: str, cwd: Path = ROOT, stdin: bytes | None = None) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, timeout=30, check=False)


def in_git_checkout(root: Path = ROOT) -> bool:
    if shutil.which("git") is None:
        return False
    done = git("rev-parse", "--show-prefix", cwd=root)
    return done.returncode == 0 and done.stdout.strip() == b""


def filter_active(path: Path, root: Path = ROOT) -> bool:
    """Whether ``git add path`` runs the nbstripout clean filter: the attribute names it, the clone configures it,
    and the configured program exists."""
    attr = git("check-attr", "filter", "--", str(path.relative_to(root)), cwd=root)
    if attr.returncode != 0 or not attr.stdout.strip().endswith(b": nbstripout"):
        return False
    command = git("config", "--get", "filter.nbstripout.clean", cwd=root).stdout.decode().strip()
    if "nbstripout" not in command:
        return False
    program = shlex.split(command)[0]
    return Path(program).is_file() or shutil.which(program) is not None


def staged_notebook(path: Path, root: Path = ROOT) -> nbformat.NotebookNode | None:
    """The index version of ``path`` (what the next commit holds), or None when git does not track it."""
    done = git("show", f":{path.relative_to(root).as_posix()}", cwd=root)
    if done.returncode != 0:
        return None
    return nbformat.reads(done.stdout.decode("utf-8"), as_version=4)


def with_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """A copy of ``nb`` as JupyterLab saves it after a run: outputs and execution counts in every code cell."""
    ran = copy.deepcopy(nb)
    ran.metadata["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"}
    for n, cell in enumerate(c for c in ran.cells if c.cell_type == "code"):
        cell.execution_count = n + 1
        cell.outputs = [
            nbformat.v4.new_output("stream", name="stdout", text=f"output of cell {n}\n"),
            nbformat.v4.new_output("display_data", data={"text/plain": "<Figure size 640x480 with 1 Axes>"}),
        ]
    return ran


# ------------------------------------------------------------------ the committed notebooks
def test_the_first_notebooks_exist():
    names = [p.name for p in NOTEBOOKS]
    for expected in ("00_why_kv_cache.ipynb", "01_naive_concat.ipynb", "02_preallocated.ipynb"):
        assert expected in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_staged_without_outputs(path):
    """What the next commit holds (the index) has no outputs: a committed notebook with outputs fails here."""
    if not in_git_checkout():
        pytest.skip("not a git checkout: there is no index to check (the working-copy test still runs)")
    staged = staged_notebook(path)
    if staged is None:
        pytest.skip(f"{path.name} is not tracked by git yet")
    assert clean_status(staged, filter_active=False) == CLEAN, f"{path.name} (staged): {output_problems(staged)}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_working_copy_clean_after_filter(path):
    """The working copy may hold outputs JupyterLab saved, as long as the configured filter strips them."""
    active = in_git_checkout() and filter_active(path)
    status = clean_status(nbformat.read(path, as_version=4), filter_active=active)
    assert status in (CLEAN, CLEAN_AFTER_FILTER), f"{path.name}: {status}; {HOW_TO_FIX}"


def test_committed_notebooks_are_fixed_points_of_the_filter(tmp_path):
    """The filter leaves every committed notebook as it is, byte for byte: configuring it changes no `git status`.

    Bytes: the filter writes nbformat's canonical JSON, so the committed file must be in it. Content: nbstripout
    itself (one run over copies of the staged blobs, with the filter's arguments) finds nothing to strip.
    """
    if not in_git_checkout():
        pytest.skip("needs the git index")
    copies = []
    for path in NOTEBOOKS:
        staged = git("show", f":{path.relative_to(ROOT).as_posix()}")
        if staged.returncode != 0:
            continue
        text = staged.stdout.decode("utf-8")
        canonical = nbformat.writes(nbformat.reads(text, as_version=nbformat.NO_CONVERT))
        assert text == canonical + "\n", f"{path.name}: not in nbformat's layout; the filter would rewrite it"
        copies.append(tmp_path / path.name)
        copies[-1].write_bytes(staged.stdout)
    dry = subprocess.run(
        [sys.executable, "-m", "nbstripout", *FILTER_ARGS, "--dry-run", *map(str, copies)],
        capture_output=True,
        timeout=120,
    )
    assert dry.returncode == 0, dry.stderr.decode()
    assert "would have stripped" not in dry.stdout.decode(), dry.stdout.decode()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_skeleton_and_final_assertions(path):
    nb = nbformat.read(path, as_version=4)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    for heading in ("What you'll build", "## Setup", "## Takeaways", "## Check yourself"):
        assert heading in markdown, f"{path.name} lacks {heading!r}"
    last = nb.cells[-1]
    assert last.cell_type == "code" and "assert " in last.source


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_setup_cell_uses_the_shared_helper(path):
    """Every notebook decides threads and seeds through memos_ref.notebook.setup, never on its own."""
    nb = nbformat.read(path, as_version=4)
    heading = next(i for i, c in enumerate(nb.cells) if c.cell_type == "markdown" and "## Setup" in c.source)
    setup_cell = next(c for c in nb.cells[heading:] if c.cell_type == "code").source
    assert "from memos_ref.notebook import setup" in setup_cell, f"{path.name}: the setup cell must use the helper"
    assert re.search(r"^env = setup\(seed=\d+\)", setup_cell, re.M), f"{path.name}: call `env = setup(seed=...)`"
    assert not re.search(r"\btorch\.manual_seed\(|\brandom\.seed\(", setup_cell), f"{path.name}: setup() seeds"
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code")
    for private in ("set_num_threads", "set_num_interop_threads"):
        assert private not in code, f"{path.name} calls {private} itself; memos_ref.notebook.setup decides it once"


# Names that hold a measured time (or something computed from one): asserting on them is asserting on noise.
TIMED = re.compile(r"(^|_)(s|ms|us|seconds|slope|speedup|ttft|elapsed|time|times)$|perf_counter|break_even", re.I)


def _timed_names(node: ast.AST) -> set[str]:
    found = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and TIMED.search(sub.id):
            found.add(sub.id)
        elif isinstance(sub, ast.Attribute) and TIMED.search(sub.attr):
            found.add(sub.attr)
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str) and TIMED.search(sub.value):
            found.add(repr(sub.value))
    return found


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_no_assertion_on_a_measured_time(path):
    """Notebooks assert mechanisms and exact counts; a timing comparison flips on a loaded laptop."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        for node in ast.walk(ast.parse(cell.source)):
            if isinstance(node, ast.Assert):
                timed = _timed_names(node.test)
                assert not timed, f"{path.name} cell {i} asserts on measured times {sorted(timed)}: {ast.unparse(node)}"


# ------------------------------------------------------------------ the check itself, on notebooks with outputs
def test_lab_outputs_are_clean_after_filter():
    """A notebook JupyterLab saved with outputs passes while the filter is active, and the filter's result has no
    outputs; without the filter the same file fails."""
    ran = with_outputs(nbformat.read(NOTEBOOKS[0], as_version=4))
    assert output_problems(ran)
    assert clean_status(ran, filter_active=True) == CLEAN_AFTER_FILTER
    assert output_problems(strip(ran)) == []
    assert strip(ran).cells == nbformat.read(NOTEBOOKS[0], as_version=4).cells  # only outputs and counts differ
    assert clean_status(ran, filter_active=False).startswith("outputs git would commit")


def test_keep_output_cells_are_not_clean_after_filter():
    """A cell tagged keep_output survives the filter, so the check still fails for it."""
    ran = with_outputs(nbformat.read(NOTEBOOKS[0], as_version=4))
    first_code = next(c for c in ran.cells if c.cell_type == "code")
    first_code.metadata["tags"] = ["keep_output"]
    assert clean_status(ran, filter_active=True).startswith("outputs git would commit")


@pytest.fixture
def scratch_repo(tmp_path):
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    assert git("init", "-q", cwd=repo).returncode == 0
    git("config", "user.email", "test@example.invalid", cwd=repo)
    git("config", "user.name", "test", cwd=repo)
    shutil.copy(ROOT / ".gitattributes", repo / ".gitattributes")
    return repo


def _configure_filter(repo: Path) -> None:
    command = " ".join(shlex.quote(a) for a in [sys.executable, "-m", "nbstripout", *FILTER_ARGS])
    assert git("config", "filter.nbstripout.clean", command, cwd=repo).returncode == 0
    assert git("config", "filter.nbstripout.smudge", "cat", cwd=repo).returncode == 0


def test_committed_outputs_fail_without_the_filter(scratch_repo):
    """In a clone without the filter, a notebook committed with outputs is caught by the staged check."""
    path = scratch_repo / "notebooks" / NOTEBOOKS[0].name
    nbformat.write(with_outputs(nbformat.read(NOTEBOOKS[0], as_version=4)), path)
    assert not filter_active(path, scratch_repo)
    assert git("add", ".", cwd=scratch_repo).returncode == 0
    assert git("commit", "-q", "-m", "outputs", cwd=scratch_repo).returncode == 0
    staged = staged_notebook(path, scratch_repo)
    assert staged is not None and clean_status(staged, filter_active=False).startswith("outputs git would commit")
    assert clean_status(nbformat.read(path, as_version=4), filter_active=False).startswith("outputs git would commit")


def test_filter_strips_lab_outputs_on_git_add(scratch_repo):
    """With the filter configured as the Makefile does, `git add` of a notebook run in Lab stages the committed
    notebook byte for byte, and both checks pass."""
    _configure_filter(scratch_repo)
    path = scratch_repo / "notebooks" / NOTEBOOKS[0].name
    nbformat.write(with_outputs(nbformat.read(NOTEBOOKS[0], as_version=4)), path)
    assert filter_active(path, scratch_repo)
    added = git("add", ".", cwd=scratch_repo)
    assert added.returncode == 0, added.stderr.decode()
    staged = git("show", f":notebooks/{path.name}", cwd=scratch_repo).stdout
    assert staged == NOTEBOOKS[0].read_bytes()
    assert clean_status(nbformat.reads(staged.decode(), as_version=4), filter_active=False) == CLEAN
    assert clean_status(nbformat.read(path, as_version=4), filter_active=True) == CLEAN_AFTER_FILTER


def test_makefile_configures_the_filter_the_tests_use():
    makefile = (ROOT / "Makefile").read_text()
    assert "-m nbstripout " + " ".join(FILTER_ARGS) in makefile
    assert "git config filter.nbstripout.clean" in makefile and "setup: $(STAMP) git-filter" in makefile
    attributes = (ROOT / ".gitattributes").read_text().splitlines()
    assert "*.ipynb filter=nbstripout" in attributes


# ------------------------------------------------------------------ exercises that teach, with hidden solutions
# chapters whose "change the code" exercise and 2-4 questions are checked: every chapter
EXERCISE_CHAPTERS = ("00", "01", "02", "03", "04", "05", "06", "07", "08", "09", "10", "11", "12")


def _tagged(nb: nbformat.NotebookNode, tag: str) -> list[nbformat.NotebookNode]:
    return [c for c in nb.cells if c.cell_type == "code" and tag in c.metadata.get("tags", [])]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_every_exercise_has_a_checker_that_its_solution_passes(path):
    """An exercise's stub reads "not answered yet" (the notebook still runs), its hidden reference solution passes
    the checker, and a wrong answer fails it with a hint — each run alone, in a fresh namespace."""
    nb = nbformat.read(path, as_version=4)
    exercises, checkers = _tagged(nb, "exercise"), _tagged(nb, "checker")
    if path.name[:2] in EXERCISE_CHAPTERS:
        assert exercises, f"{path.name}: no 'change the code' exercise (a code cell tagged exercise)"
    assert len(exercises) == len(checkers), f"{path.name}: every exercise needs one checker cell"
    for exercise, checker in zip(exercises, checkers, strict=True):
        index = nb.cells.index(checker)
        solution = nb.cells[index + 1]
        assert "solution" in solution.metadata.get("tags", []), f"{path.name}: the checker's solution follows it"
        check_code = checker.source.replace("print(check_exercise())", "")
        namespace: dict = {}
        exec(compile(exercise.source, f"{path.name}:exercise", "exec"), namespace)
        exec(compile(check_code, f"{path.name}:checker", "exec"), namespace)
        assert "not answered yet" in namespace["check_exercise"]()
        exec(
            compile(solution.source.replace("print(check_exercise())", ""), f"{path.name}:solution", "exec"), namespace
        )
        assert "correct" in namespace["check_exercise"](), f"{path.name}: the reference solution fails its checker"


HIDDEN_CHECKED = list(NOTEBOOKS)


@pytest.mark.parametrize("path", HIDDEN_CHECKED, ids=lambda p: p.name)
def test_solutions_are_hidden_in_lab(path):
    """Solution cells are collapsed in JupyterLab, source and output, and carry no stored output."""
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        hidden = cell.metadata.get("jupyter", {})
        if cell.cell_type == "code" and (hidden.get("source_hidden") or "solution" in cell.metadata.get("tags", [])):
            assert hidden.get("source_hidden") and hidden.get("outputs_hidden"), f"{path.name}: {cell.get('id')}"
            assert not cell.get("outputs"), f"{path.name}: a solution cell has stored output"


@pytest.mark.parametrize("path", [p for p in NOTEBOOKS if p.name[:2] in EXERCISE_CHAPTERS], ids=lambda p: p.name)
def test_check_yourself_asks_two_to_four_questions(path):
    nb = nbformat.read(path, as_version=4)
    markdown = "\n".join(c.source for c in nb.cells if c.cell_type == "markdown")
    section = markdown.split("## Check yourself", 1)[1]
    questions = re.findall(r"^\d+\. ", section.split("### Change the code", 1)[0], re.M)
    assert 2 <= len(questions) <= 4, f"{path.name}: {len(questions)} questions"
