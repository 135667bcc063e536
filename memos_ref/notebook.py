"""The one setup call of every notebook: CPU threads, seeds, and what the notebook runs on.

The notebooks are sized for a 2-core laptop that is also doing other things. Two torch threads on two shared,
busy cores oversubscribe them (a 14 s notebook took 405 s under background load), so the notebooks use **one**
thread unless told otherwise. The count is decided once per process, here, instead of in each notebook::

    from memos_ref.notebook import setup
    env = setup(seed=0)   # threads, interop threads, seeds; returns device and versions
    print(env)

``MEMOS_REF_NOTEBOOK_THREADS=2`` (or ``setup(threads=2)``) asks for more; the request is capped at the CPUs
this process may run on (``os.sched_getaffinity``) and at :data:`MAX_THREADS`.
"""

from __future__ import annotations

import contextlib
import os
import platform
import random
from dataclasses import dataclass

import torch

from memos_ref.errors import ConfigError, check_index

ENV_VAR = "MEMOS_REF_NOTEBOOK_THREADS"
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
