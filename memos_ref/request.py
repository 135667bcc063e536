"""A request to the engine: a prompt, how many tokens to generate and how (greedy or sampled), its output so far,
whether it finished or failed, and its statistics. Checked when made and again, against the model's vocabulary,
when submitted (:meth:`memos_ref.engine.Engine.submit`)."""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from memos_ref.errors import InvalidArgumentError, check_index, check_type

__all__ = ["GREEDY_TEMPERATURE", "Request", "RequestStats"]

_ids = itertools.count()


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float | None = None
    token_latencies_s: list[float] = field(default_factory=list)
    preemptions: int = 0


#: Temperatures below this are treated as greedy (0): dividing logits by a vanishing temperature is argmax in
#: the limit, and doing it literally overflows to inf/NaN.
GREEDY_TEMPERATURE = 1e-4


@dataclass
class Request:
    """A prompt to continue.

    ``temperature`` 0 (or anything below :data:`GREEDY_TEMPERATURE`) is greedy; otherwise sampling with
    ``seed``. Arguments are checked here and again, against the model's vocabulary, by :meth:`Engine.submit`
    (:class:`~memos_ref.errors.ArgumentTypeError` / :class:`~memos_ref.errors.InvalidArgumentError`).

    A request the engine could not serve — its prefill, decode step or sampling raised — ends with
    ``finished`` set and the exception in ``error`` (``failed`` is True); ``output`` holds what it generated
    before the failure. Its blocks are released and the other requests carry on.
    """

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    seed: int = 0
    stop_ids: tuple[int, ...] = ()
    request_id: int = field(default_factory=lambda: next(_ids))
    output: list[int] = field(default_factory=list)
    stats: RequestStats = field(default_factory=RequestStats)
    arrived: float = field(default_factory=time.perf_counter)
    finished: bool = False
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.validate()
        self.prompt = [int(t) for t in self.prompt]
        self.max_new_tokens = int(self.max_new_tokens)
        self.seed = int(self.seed)  # numpy ints pass validation; the generator wants a Python int
        self.stop_ids = tuple(int(t) for t in self.stop_ids)
        self.temperature = float(self.temperature)
        self._generator = torch.Generator().manual_seed(self.seed)

    @property
    def generator(self) -> torch.Generator:
        """The request's own CPU random generator (seeded with ``seed``): its sampled tokens do not depend on
        what else the engine serves."""
        return self._generator

    @property
    def failed(self) -> bool:
        """True when the request ended with an error (see ``error``)."""
        return self.error is not None

    def validate(self, vocab_size: int | None = None) -> None:
        """Check every field (token ids against ``[0, vocab_size)`` when it is given); raises
        :class:`ArgumentTypeError` or :class:`InvalidArgumentError` naming the field."""
        check_type("prompt", self.prompt, (list, tuple))
        if not self.prompt:
            raise InvalidArgumentError("prompt: expected at least one token id, got an empty prompt")
        hi = None if vocab_size is None else vocab_size - 1
        if not _ids_below(self.prompt, vocab_size):  # one pass; the per-token check only to name the bad one
            for i, token in enumerate(self.prompt):
                check_index(f"prompt[{i}]", token, lo=0, hi=hi)
        check_index("max_new_tokens", self.max_new_tokens, lo=1)
        check_type("temperature", self.temperature, (int, float))
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgumentError(
                f"temperature: expected a finite number >= 0 (0 = greedy), got {self.temperature!r}"
            )
        check_index("seed", self.seed, lo=0, hi=2**64 - 1)
        check_type("stop_ids", self.stop_ids, (list, tuple))
        if not _ids_below(self.stop_ids, vocab_size):
            for i, token in enumerate(self.stop_ids):
                check_index(f"stop_ids[{i}]", token, lo=0, hi=hi)


def _ids_below(ids: Any, vocab_size: int | None) -> bool:
    """Whether ``ids`` is a list or tuple of plain ints in ``[0, vocab_size)`` (no upper bound for ``None``):
    the token check of :meth:`Request.validate` in one pass over C-level builtins."""
    if type(ids) not in (list, tuple) or not all(type(t) is int for t in ids):
        return False
    return not ids or (min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size))
