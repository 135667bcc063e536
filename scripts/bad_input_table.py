"""Render the bad-input table of ``tests/test_bad_input_table.py`` to ``docs/bad-input.md``.

Usage: ``python scripts/bad_input_table.py`` (write) or ``python scripts/bad_input_table.py --check`` (exit 1
when the page differs from the rendering). The table itself lives in the test module, which runs every row.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "tests" / "test_bad_input_table.py"
DOC = ROOT / "docs" / "bad-input.md"


def render() -> str:
    """The markdown of the table, as the test module renders it."""
    spec = importlib.util.spec_from_file_location("bad_input_table", TABLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module.render_markdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        same = DOC.is_file() and DOC.read_text(encoding="utf-8") == text
        print(f"{DOC}: {'up to date' if same else 'stale (run without --check)'}")
        return 0 if same else 1
    DOC.parent.mkdir(parents=True, exist_ok=True)
    DOC.write_text(text, encoding="utf-8")
    print(f"wrote {DOC} ({text.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
