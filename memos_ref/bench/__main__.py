"""Command line: ``python -m memos_ref.bench NAME [--quick] [--json] [--plot FILE]``."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from memos_ref.bench import BENCHMARKS, get


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m memos_ref.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="small sizes, for tests and a first look")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--plot", metavar="FILE", help="also save a plot (PNG)")
    args = parser.parse_args(argv)
    module = get(args.name)
    # Whatever a library prints while measuring goes to stderr: stdout carries only the result.
    with contextlib.redirect_stdout(sys.stderr):
        report = module.run(quick=args.quick, progress=sys.stderr.isatty() or not args.json)
    if args.plot:
        Path(args.plot).parent.mkdir(parents=True, exist_ok=True)
        module.plot(report, args.plot)
    if args.json:
        print(json.dumps(report))
    else:
        print(module.human(report))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
