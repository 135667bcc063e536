"""One concept per module, and a module a stranger can read in one sitting: no Python file in the three packages
(memos_ref/, kernels/, edge/) is over 500 lines (issue 29). A module that outgrows it is split by concept, as
hf.py, the allocator, the sequence, the report and chat.py were."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 500
SOURCES = ("memos_ref", "kernels", "edge")


def _line_counts(roots: list[Path]) -> dict[str, int]:
    counts = {}
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            with path.open("rb") as handle:
                counts[str(path.relative_to(root.parent))] = sum(1 for _ in handle)
    return counts


def test_no_module_is_over_the_line_limit():
    counts = _line_counts([ROOT / name for name in SOURCES])
    assert len(counts) > 50, f"expected the package sources under {SOURCES}, found {len(counts)} files"
    over = {path: n for path, n in counts.items() if n > LIMIT}
    assert not over, f"modules over {LIMIT} lines (split them by concept): {over}"


def test_the_line_count_check_can_fail(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "small.py").write_text("x = 1\n" * LIMIT)
    (package / "big.py").write_text("x = 1\n" * (LIMIT + 1))
    counts = _line_counts([package])
    assert counts == {"pkg/small.py": LIMIT, "pkg/big.py": LIMIT + 1}
    with pytest.raises(AssertionError):
        assert not {p: n for p, n in counts.items() if n > LIMIT}
