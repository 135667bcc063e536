"""Command line: ``python -m memos_ref.bench NAME [--quick] [--json] [--plot FILE] [--model NAME]``.

``--model`` names a real pretrained model (``memos_ref.model.PRETRAINED``); it is parsed here for every
benchmark and passed to those whose ``run`` takes a ``model`` argument (``quant``, and any other that adds
one); the others refuse it.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
from pathlib import Path

from memos_ref.bench import BENCHMARKS, get


def takes_model(module: object) -> bool:
    """Whether a benchmark module's ``run`` accepts ``model=`` (a real pretrained model's name)."""
    return "model" in inspect.signature(module.run).parameters


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(prog="python -m memos_ref.bench", description=__doc__)
    parser.add_argument("name", choices=sorted(BENCHMARKS))
    parser.add_argument("--quick", action="store_true", help="small sizes, for tests and a first look")
    parser.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    parser.add_argument("--plot", metavar="FILE", help="also save a plot (PNG)")
    parser.add_argument(
        "--model",
        metavar="NAME",
        help="run on a real pretrained model (e.g. smollm2-135m-instruct), for benchmarks that support it",
    )
    args = parser.parse_args(argv)
    module = get(args.name)
    kwargs = {}
    if args.model is not None:
        from memos_ref.model import PRETRAINED

        if args.model not in PRETRAINED:
            parser.error(f"--model: expected one of {sorted(PRETRAINED)}, got {args.model!r}")
        if not takes_model(module):
            able = sorted(n for n in BENCHMARKS if takes_model(get(n)))
            parser.error(f"--model: benchmark {args.name!r} runs only on the shipped model; --model works with {able}")
        kwargs["model"] = args.model
    # Whatever a library prints while measuring goes to stderr: stdout carries only the result.
    with contextlib.redirect_stdout(sys.stderr):
        report = module.run(quick=args.quick, progress=sys.stderr.isatty() or not args.json, **kwargs)
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
