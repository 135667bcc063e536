"""A small multi-session generation engine over the paged memory (continuous batching).

Each step: admit waiting requests while blocks allow (prefill each, reusing cached prefix blocks), then run
*one* batched decode step for every running request — sequences of different lengths in one forward, each
row attending over its own pages — then retire finished requests. Requests join and leave between steps.

When a decode step cannot get a block, the engine **preempts** the most recently admitted request (policy
``"recompute"``: its blocks are released and it is re-queued with everything it generated so far as its
prompt, to be prefilled again later — prefix-cached blocks usually make that cheap). Preemptions are counted.

Oracle (tests): every request's output equals generating it alone with transformers' ``DynamicCache``.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch

from memos_ref.attention import attend_sequences
from memos_ref.errors import ConfigError, OutOfBlocksError
from memos_ref.paged.sequence import SequenceCache
from memos_ref.paged.store import PagedKV

__all__ = ["Engine", "Request", "RequestStats"]

_ids = itertools.count()


@dataclass
class RequestStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0
    computed_tokens: int = 0
    ttft_s: float | None = None
    token_latencies_s: list[float] = field(default_factory=list)
    preemptions: int = 0


@dataclass
class Request:
    """A prompt to continue. ``temperature`` 0 is greedy; otherwise sampling with ``seed``."""

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

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ConfigError("a request needs at least one prompt token")
        if self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        self._generator = torch.Generator().manual_seed(self.seed)


class _Rows:
    """The cache the package's forward sees for one batched step: row i is sequence i (own length)."""

    def __init__(self, sequences: list[SequenceCache]) -> None:
        self.sequences = sequences

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return max(seq.layer_tokens[layer_idx] for seq in self.sequences)

    def attend(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, layer: int) -> torch.Tensor:
        for row, seq in enumerate(self.sequences):
            seq.append(layer, key[row], value[row])
        return attend_sequences(query, self.sequences, layer)


class Engine:
    """Serves many requests on one model (the package's forward) over one :class:`PagedKV`.

    Args:
        model: a :class:`~memos_ref.model.llama.LlamaForward`.
        kv: the paged memory (single-segment pool).
        max_batch: most requests decoded together.
    """

    def __init__(self, model: Any, kv: PagedKV, max_batch: int = 16) -> None:
        if len(kv.pool.segments) != 1:
            raise ConfigError("the engine needs a single-segment pool")
        self.model, self.kv, self.max_batch = model, kv, max_batch
        self.waiting: deque[Request] = deque()
        self.running: list[tuple[Request, SequenceCache]] = []
        self.finished: list[Request] = []
        self.preemptions = 0
        self.deferred_admissions = 0  # times a waiting request could not start for lack of blocks
        self.steps = 0

    def submit(self, request: Request) -> Request:
        self.waiting.append(request)
        return request

    # ------------------------------------------------------------------ scheduling
    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        if request.temperature <= 0:
            return int(logits.argmax())
        probs = torch.softmax(logits.float() / request.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=request._generator))

    def _emit(self, request: Request, seq: SequenceCache, token: int) -> None:
        now = time.perf_counter()
        if request.stats.ttft_s is None:
            request.stats.ttft_s = now - request.arrived
        request.output.append(token)
        if token in request.stop_ids or len(request.output) >= request.max_new_tokens:
            request.finished = True

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            ids = request.prompt + request.output  # after a preemption, recompute what was generated
            # the prompt's blocks, plus one more token for every running row (so admission cannot force the
            # next decode step to preempt what was just admitted)
            need = self.kv.spec.blocks_for(len(ids) + 1) + sum(seq.blocks_needed(1) for _, seq in self.running)
            if need > self.kv.allocator.num_available:
                self.deferred_admissions += 1
                return  # wait for blocks
            self.waiting.popleft()
            seq = self.kv.start_from_prefix(ids)
            reused = seq.num_tokens
            rest = torch.tensor([ids[reused:]])
            try:
                with torch.inference_mode():
                    logits = self.model(rest, _Rows([seq]), position_ids=torch.arange(reused, len(ids))[None])
            except Exception:
                seq.free()
                self.waiting.appendleft(request)
                raise
            seq.set_token_ids(ids)
            request.stats.prompt_tokens = len(request.prompt)
            request.stats.reused_tokens += reused
            request.stats.computed_tokens += len(ids) - reused
            self._emit(request, seq, self._sample(request, logits[0, -1]))
            self._retire_or_keep(request, seq)

    def _retire_or_keep(self, request: Request, seq: SequenceCache) -> None:
        if request.finished:
            seq.free()
            self.finished.append(request)
        else:
            self.running.append((request, seq))

    def _preempt(self) -> None:
        request, seq = self.running.pop()  # the most recently admitted
        seq.free()
        request.stats.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)

    def step(self) -> None:
        """Admit what fits, then one decode step for every running request."""
        tiering = self.kv.tier_manager  # attached to kv: evicted cached blocks go down, prefix lookups reload them
        if tiering is not None and (tiering._thread is None or not tiering._thread.is_alive()):
            tiering.step()  # its watermarks, once per engine step (unless its own thread drives it)
        self._admit()
        if not self.running:
            return
        # make sure every row can take one more token; preempt (recompute policy) until it can
        while self.running:
            needed = sum(seq.blocks_needed(1) for _, seq in self.running)
            if needed <= self.kv.allocator.num_available:
                break
            self._preempt()
        if not self.running:
            return
        batch = list(self.running)
        last = torch.tensor([[req.output[-1]] for req, _ in batch])  # [B, 1]
        positions = torch.tensor([[seq.num_tokens] for _, seq in batch])  # each row at its own position
        started = time.perf_counter()
        with torch.inference_mode():
            logits = self.model(last, _Rows([seq for _, seq in batch]), position_ids=positions)
        elapsed = time.perf_counter() - started
        self.running = []
        for row, (request, seq) in enumerate(batch):
            seq.set_token_ids([request.output[-1]], start=seq.num_tokens - 1)
            request.stats.token_latencies_s.append(elapsed)
            request.stats.computed_tokens += 1
            self._emit(request, seq, self._sample(request, logits[row, -1]))
            self._retire_or_keep(request, seq)
        self.steps += 1

    def run(self, max_steps: int = 100_000) -> list[Request]:
        """Step until every submitted request has finished; returns them in completion order."""
        for _ in range(max_steps):
            if not self.waiting and not self.running:
                return self.finished
            before = (len(self.waiting), len(self.running), len(self.finished))
            self.step()
            if not self.running and self.waiting and before == (len(self.waiting), 0, len(self.finished)):
                first = self.waiting[0]
                need = self.kv.spec.blocks_for(len(first.prompt) + len(first.output) + 1)
                raise OutOfBlocksError(needed=need, available=self.kv.allocator.num_available)
        raise ConfigError(f"requests still unfinished after {max_steps} steps")
