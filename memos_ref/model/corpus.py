"""The training corpus of the shipped model: Python standard-library source every machine already has.

Training reads a fixed list of modules from the running interpreter's standard library plus
``pydoc_data/topics.py`` (English prose about Python). Evaluation uses other modules, never trained on,
whose text is committed (``data/heldout_stdlib.txt``) so that every machine and Python version measures on
the same bytes. The standard library is PSF-licensed.
"""

from __future__ import annotations

import math
import sysconfig
from collections import Counter
from importlib import resources
from pathlib import Path

from memos_ref.errors import ConfigError

__all__ = [
    "HELDOUT_MODULES",
    "TRAIN_MODULES",
    "build_heldout_text",
    "heldout_text",
    "stdlib_dir",
    "training_documents",
    "unigram_bits_per_byte",
]

#: Modules (paths under the stdlib directory, without ``.py``) the model is trained on.
TRAIN_MODULES: tuple[str, ...] = tuple(
    [
        "abc",
        "argparse",
        "ast",
        "base64",
        "bdb",
        "cmd",
        "code",
        "codecs",
        "codeop",
        "collections/__init__",
        "colorsys",
        "compileall",
        "configparser",
        "contextlib",
        "copy",
        "copyreg",
        "cProfile",
        "dataclasses",
        "datetime",
        "_pydecimal",
        "dis",
        "doctest",
        "email/message",
        "email/parser",
        "email/utils",
        "email/_header_value_parser",
        "enum",
        "filecmp",
        "fileinput",
        "fnmatch",
        "ftplib",
        "functools",
        "genericpath",
        "getopt",
        "gettext",
        "glob",
        "gzip",
        "hashlib",
        "hmac",
        "html/__init__",
        "html/parser",
        "http/client",
        "http/server",
        "http/cookies",
        "imaplib",
        "inspect",
        "io",
        "ipaddress",
        "json/__init__",
        "json/decoder",
        "json/encoder",
        "keyword",
        "linecache",
        "locale",
        "logging/__init__",
        "logging/handlers",
        "logging/config",
        "lzma",
        "mailbox",
        "mimetypes",
        "netrc",
        "ntpath",
        "numbers",
        "operator",
        "optparse",
        "os",
        "pathlib",
        "pdb",
        "pickle",
        "pkgutil",
        "platform",
        "plistlib",
        "poplib",
        "posixpath",
        "pprint",
        "profile",
        "pstats",
        "pydoc",
        "queue",
        "quopri",
        "random",
        "re/__init__",
        "re/_parser",
        "re/_compiler",
        "reprlib",
        "rlcompleter",
        "sched",
        "secrets",
        "selectors",
        "shelve",
        "shlex",
        "shutil",
        "signal",
        "site",
        "smtplib",
        "socket",
        "socketserver",
        "sre_parse",
        "ssl",
        "stat",
        "string",
        "struct",
        "subprocess",
        "symtable",
        "sysconfig",
        "tabnanny",
        "tarfile",
        "tempfile",
        "threading",
        "timeit",
        "token",
        "tokenize",
        "trace",
        "traceback",
        "tracemalloc",
        "turtle",
        "types",
        "typing",
        "urllib/parse",
        "urllib/request",
        "uuid",
        "warnings",
        "wave",
        "weakref",
        "webbrowser",
        "zipfile",
        "zipimport",
        "asyncio/base_events",
        "asyncio/events",
        "asyncio/futures",
        "asyncio/locks",
        "asyncio/queues",
        "asyncio/streams",
        "asyncio/tasks",
        "asyncio/transports",
        "unittest/case",
        "unittest/mock",
        "unittest/loader",
        "unittest/main",
        "unittest/result",
        "unittest/runner",
        "concurrent/futures/_base",
        "concurrent/futures/process",
        "concurrent/futures/thread",
        "importlib/__init__",
        "importlib/_bootstrap",
        "importlib/_bootstrap_external",
        "xml/dom/minidom",
        "xml/etree/ElementTree",
        "pydoc_data/topics",
    ]
)

#: Modules held out for evaluation: never in the training list; their text is committed.
HELDOUT_MODULES: tuple[str, ...] = (
    "difflib",
    "heapq",
    "fractions",
    "csv",
    "bisect",
    "calendar",
    "textwrap",
    "statistics",
)

assert not set(TRAIN_MODULES) & set(HELDOUT_MODULES), "a held-out module is in the training list"

_HELDOUT_SEPARATOR = "\n# ==== memos-ref held-out module: {name} ====\n"


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def _read_module(name: str) -> str:
    path = stdlib_dir() / f"{name}.py"
    if not path.is_file():
        raise ConfigError(f"standard-library module file {path} not found: this Python lacks module {name!r}")
    return path.read_text(encoding="utf-8")


def training_documents() -> list[str]:
    """The training texts, one per module, in :data:`TRAIN_MODULES` order."""
    return [_read_module(name) for name in TRAIN_MODULES]


def build_heldout_text() -> str:
    """Concatenate the held-out modules from this interpreter (used once, to write the committed file)."""
    return "".join(_HELDOUT_SEPARATOR.format(name=name) + _read_module(name) for name in HELDOUT_MODULES)


def heldout_text() -> str:
    """The committed held-out evaluation text (identical on every machine)."""
    return resources.files("memos_ref.model").joinpath("data/heldout_stdlib.txt").read_text(encoding="utf-8")


def unigram_bits_per_byte(train_docs: list[str], eval_text: str) -> float:
    """Cross-entropy of ``eval_text`` under a byte-unigram model of the training text (add-one smoothed).

    The baseline any learned model must beat: it knows byte frequencies and nothing about context.
    """
    counts: Counter[int] = Counter()
    for doc in train_docs:
        counts.update(doc.encode("utf-8"))
    total = sum(counts.values()) + 256
    data = eval_text.encode("utf-8")
    eval_counts = Counter(data)
    nll = -sum(n * math.log2((counts[b] + 1) / total) for b, n in eval_counts.items())
    return nll / len(data)
