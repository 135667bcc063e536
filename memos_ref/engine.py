"""A small multi-session generation engine over the paged memory (continuous batching).

Each step: admit waiting requests while blocks allow (prefill each, reusing cached prefix blocks), then run
*one* batched decode step for every running request — sequences of different lengths in one forward, each
row attending over its own pages — then retire finished requests. Requests join and leave between steps.

With a tier manager attached to the pool (:class:`~memos_ref.tiering.manager.TierManager`), a prompt's blocks
found in a tier are reloaded instead of prefilled; tiers that can fetch many blocks in one round (the cluster tier's
``read_ahead``) are asked for the whole prompt first. ``publish_to`` names a tier every newly prefilled full
block is written to at once (write-through): another process sharing that tier (a Redis Cluster) then reloads
the prefix instead of computing it. Nothing a tier does raises into a request: failures are counted in
``tier_counts``.

When a decode step cannot get a block, the engine **preempts** the most recently admitted request (policy
``"recompute"``: its blocks are released and it is re-queued with everything it generated so far as its
prompt, to be prefilled again later — prefix-cached blocks usually make that cheap). Preemptions are counted.

Oracle (tests): every request's output equals generating it alone with transformers' ``DynamicCache``.
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from memos_ref.errors import (
    ArgumentTypeError,
    CapacityExceededError,
    ConfigError,
    OutOfBlocksError,
    StagingFullError,
    StateError,
    check_index,
    check_type,
)
from memos_ref.paged.sequence import SequenceCache
from memos_ref.paged.step import rollback as _rollback
from memos_ref.paged.store import PagedKV
from memos_ref.request import GREEDY_TEMPERATURE, Request, RequestStats

if TYPE_CHECKING:  # imported when an Engine is built: transformers' import is not paid by `import memos_ref.engine`
    from memos_ref.decode_graph import GraphedDecoder
    from memos_ref.hf import PagedCache

__all__ = ["GREEDY_TEMPERATURE", "Engine", "Request", "RequestStats"]


class Engine:
    """Serves many requests on one model (the package's forward) over one :class:`PagedKV`.

    A failure while serving one request (its admission, prefill, decode step or sampling raises) finishes
    that request with the exception in ``request.error``, releases its blocks, and keeps serving the others:
    a failed batched decode step is rolled back and retried row by row, so only the failing rows fail. Running
    out of blocks is not a failure: the request waits (admission) or is preempted (decode).

    Args:
        model: a :class:`~memos_ref.model.llama.LlamaForward`.
        kv: the paged memory (single-segment pool).
        max_batch: most requests decoded together.
        publish_to: the name of a tier of the attached tier manager's store to write each newly prefilled full
            block to (None: blocks reach the tiers only when evicted or swapped out).
        decode_graphs: a :class:`~memos_ref.decode_graph.GraphedDecoder` over ``model`` and ``kv``: decode steps it
            supports replay its CUDA graphs, the others run the eager forward (the same tokens either way).
    """

    def __init__(self, model: Any, kv: PagedKV, max_batch: int = 16, *, publish_to: str | None = None,
                 decode_graphs: GraphedDecoder | None = None) -> None:  # fmt: skip
        if not callable(model) or not isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int):
            raise ArgumentTypeError(
                f"model: expected the package's LlamaForward (memos_ref.model.load_model()), got {type(model).__name__}"
            )
        check_type("kv", kv, PagedKV)
        check_index("max_batch", max_batch, lo=1)
        check_type("publish_to", publish_to, (str, type(None)))
        self.model, self.kv, self.max_batch = model, kv, max_batch
        self.publish_to, self.decode_graphs = publish_to, decode_graphs
        if decode_graphs is not None:
            from memos_ref.decode_graph import check_serves

            check_serves(decode_graphs, model, kv)
        #: read_ahead_blocks / published_blocks / publish_dropped / tier_errors: what the engine asked of tiers
        self.tier_counts: Counter[str] = Counter()
        self.vocab_size: int = model.config.vocab_size
        self.waiting: deque[Request] = deque()
        self.running: list[tuple[Request, SequenceCache]] = []
        self.finished: list[Request] = []
        self.failures = 0  # requests finished with an error
        self.preemptions = 0
        self.deferred_admissions = 0  # times a waiting request could not start for lack of blocks
        self.steps = 0
        # the forward-facing cache of every step: the package forward's PagedCache over the engine's rows
        # (borrowed: rows of different lengths, freed by the engine), one StepBatch per forward
        from memos_ref.hf import PagedCache

        self._cache = PagedCache(kv, owns_rows=False)

    def _rows(self, sequences: list[SequenceCache]) -> PagedCache:
        """The cache the model sees for one forward: row i is ``sequences[i]`` (at its own length)."""
        self._cache.sequences = sequences
        return self._cache

    def submit(self, request: Request) -> Request:
        """Queue a request. It is checked first — token ids in the model's vocabulary, every field in its
        domain, not already submitted, a prompt the whole pool can hold (else
        :class:`~memos_ref.errors.OutOfBlocksError`) and, on a quantized pool, a prompt whose prefill fits the
        whole staging slab (else :class:`~memos_ref.errors.StagingFullError`) — and nothing is queued when a
        check fails."""
        check_type("request", request, Request)
        request.validate(self.vocab_size)
        if self.kv.spec.blocks_for(len(request.prompt) + 1) > self.kv.allocator.num_blocks:
            raise self._too_long(len(request.prompt))  # the whole pool could not hold its prompt
        if self.kv.spec.blocks_for(len(request.prompt)) > self._staging_capacity():
            raise self._staging_too_small(len(request.prompt))
        if request.finished or any(r is request for r in self.waiting) or any(r is request for r, _ in self.running):
            raise StateError(f"request {request.request_id} was already submitted; submit a new Request")
        self.waiting.append(request)
        return request

    # ------------------------------------------------------------------ scheduling
    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        if request.temperature < GREEDY_TEMPERATURE:
            return int(logits.argmax())
        scaled = (logits.float() - logits.float().max()) / request.temperature  # max 0: no overflow
        probs = torch.softmax(scaled, dim=-1).cpu()  # the request's generator is a CPU one, on every device
        return int(torch.multinomial(probs, 1, generator=request.generator))

    def _emit(self, request: Request, seq: SequenceCache, token: int) -> None:
        now = time.perf_counter()
        if request.stats.ttft_s is None:
            request.stats.ttft_s = now - request.arrived
        request.output.append(token)
        if token in request.stop_ids or len(request.output) >= request.max_new_tokens:
            request.finished = True

    def _too_long(self, tokens: int) -> OutOfBlocksError:
        return OutOfBlocksError(needed=self.kv.spec.blocks_for(tokens + 1), available=self.kv.allocator.num_blocks)

    def _staging_capacity(self) -> float:
        """Full-precision staging blocks of a quantized pool (its prefills write there); unbounded otherwise."""
        pool = self.kv.pool
        return int(pool.staging.shape[0]) if pool.tracks_windows else math.inf  # type: ignore[attr-defined]

    def _staging_too_small(self, tokens: int) -> StagingFullError:
        need, total = self.kv.spec.blocks_for(tokens), self._staging_capacity()
        return StagingFullError(
            f"a prefill of {tokens} tokens needs {need} full-precision staging blocks but the pool has {total} in "
            f"all: raise staging_blocks or lower residual_tokens, or shorten the prompt",
            needed=need,
            capacity=int(total),
        )

    def _fail(self, request: Request, seq: SequenceCache | None, error: BaseException) -> None:
        """Finish ``request`` with ``error``, releasing its blocks."""
        request.error, request.finished = error, True
        self.failures += 1
        self.finished.append(request)  # recorded before the release: an interrupt inside it loses nothing
        if seq is not None:
            seq.free()

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            ids = request.prompt + request.output  # after a preemption, recompute what was generated
            if self.kv.spec.blocks_for(len(ids) + 1) > self.kv.allocator.num_blocks:  # can never run: fail it
                self.waiting.popleft()
                self._fail(request, None, self._too_long(len(ids)))
                continue
            # the prompt's blocks, plus one more token for every running row (so admission cannot force the
            # next decode step to preempt what was just admitted)
            need = self.kv.spec.blocks_for(len(ids) + 1) + sum(seq.blocks_needed(1) for _, seq in self.running)
            if need > self.kv.allocator.num_available:
                self.deferred_admissions += 1
                return  # wait for blocks
            seq: SequenceCache | None = None
            try:
                self._read_ahead(ids)
                seq = self.kv.start_from_prefix(ids)
                logits, reused = self._prefill(seq, ids)
                token = self._sample(request, logits[0, -1])
                self._publish(seq, len(ids), reused)
            except CapacityExceededError as exc:  # not the request's fault: it waits at the head of the queue
                if seq is not None:
                    seq.free()
                if isinstance(exc, StagingFullError) and (exc.needed or 0) > self._staging_capacity():
                    self.waiting.popleft()  # the whole staging slab could never hold it: fail it, not wait
                    self._fail(request, None, exc)
                    continue
                self.deferred_admissions += 1
                return
            except Exception as exc:
                self.waiting.popleft()
                self._fail(request, seq, exc)
                continue
            except BaseException:  # an interrupt: the request stays queued, its blocks go back
                if seq is not None:
                    seq.free()
                raise
            self.waiting.popleft()
            request.stats.prompt_tokens = len(request.prompt)
            request.stats.reused_tokens += reused
            request.stats.computed_tokens += len(ids) - reused
            self._emit(request, seq, token)
            if self._retire_or_keep(request, seq):
                self.running.append((request, seq))

    def _prefill(self, seq: SequenceCache, ids: list[int]) -> tuple[torch.Tensor, int]:
        """Compute the tokens of ``ids`` past ``seq``'s cached prefix; returns the logits and the reused count."""
        reused = seq.num_tokens
        device = self.kv.pool.device  # the ids go where the pool (and the model with it) lives
        rest = torch.tensor([ids[reused:]], device=device)
        positions = torch.arange(reused, len(ids), device=device)[None]
        with torch.inference_mode():
            logits = self.model(rest, self._rows([seq]), position_ids=positions)
        seq.set_token_ids(ids[reused:], start=reused)  # the reused prefix's ids are already recorded
        return logits, reused

    def _tiers(self) -> list[Any]:
        store = getattr(self.kv.tier_manager, "store", None)
        return list(getattr(store, "tiers", []))

    def _read_ahead(self, ids: list[int]) -> None:
        """Ask tiers that fetch in bulk (``read_ahead``) for the prompt's full blocks not on the device: one round
        per node instead of one per block in the lookup that follows."""
        tiers = [t for t in self._tiers() if callable(getattr(t.backend, "read_ahead", None))]
        pc = self.kv.prefix_cache
        if not tiers or pc is None:
            return
        t = self.kv.spec.block_size
        try:
            hashes = pc.hashes(ids[: (len(ids) - 1) // t * t])
            keys = [h.hex() for h in hashes if self.kv.allocator.block_with_hash(h) is None]
            for tier in tiers:
                if keys:
                    self.tier_counts["read_ahead_found"] += tier.backend.read_ahead(keys)
                    self.tier_counts["read_ahead_blocks"] += len(keys)
        except Exception:  # a tier's failure is a miss, never the request's failure
            self.tier_counts["tier_errors"] += 1

    def _publish(self, seq: SequenceCache, n_ids: int, reused: int) -> None:
        """Write the full blocks this prefill computed (not the reused ones) to the ``publish_to`` tier."""
        tm = self.kv.tier_manager
        if self.publish_to is None or tm is None:
            return
        from memos_ref.tiering.blockfile import encode_block

        try:
            store = tm.store  # type: ignore[attr-defined]
            tier = store.tier(self.publish_to)
            t, items = self.kv.spec.block_size, {}
            for i in range(reused // t, n_ids // t):
                block = seq.block_table[i]
                h = self.kv.allocator.hash_of(block)
                if h is not None:
                    items[h.hex()] = encode_block(
                        self.kv.pool.block(block),
                        spec=store.spec,
                        fingerprint=store.fingerprint,
                        codec=tier.codec,
                        key=h.hex(),
                    )
            if items:
                stored = sum(tier.backend.put_many(items).values())
                self.tier_counts["published_blocks"] += stored
                self.tier_counts["publish_dropped"] += len(items) - stored
        except Exception:
            self.tier_counts["tier_errors"] += 1

    def _retire_or_keep(self, request: Request, seq: SequenceCache) -> bool:
        """Retire a finished request (its blocks freed); returns True when it keeps running."""
        if request.finished:
            self.finished.append(request)  # recorded before the release: an interrupt inside it loses nothing
            seq.free()
            return False
        return True

    def _preempt(self) -> None:
        request, seq = self.running.pop()  # the most recently admitted
        self._requeue(request, seq)

    def _requeue(self, request: Request, seq: SequenceCache) -> None:
        self.waiting.appendleft(request)  # queued before the release: an interrupt inside it loses nothing
        request.stats.preemptions += 1
        self.preemptions += 1
        seq.free()

    def step(self) -> None:
        """Admit what fits, then one decode step for every running request."""
        tiering = self.kv.tier_manager  # attached to kv: evicted cached blocks go down, prefix lookups reload them
        if tiering is not None and not tiering.driven_by_thread:
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
        held = [seq.num_tokens for _, seq in batch]  # before the step: what a rollback returns to
        try:
            logits, elapsed = self._decode(batch)
        except Exception:  # some row failed: undo the step, then decode row by row so only failing rows fail
            for (_, seq), n in zip(batch, held):
                _rollback(seq, n)
            self._per_row(batch, held, lambda row, request, seq: self._decode_one(request, seq))
        except BaseException:  # an interrupt: undo the step, keep every row running, let it through
            for (_, seq), n in zip(batch, held):
                _rollback(seq, n)
            raise
        else:
            self._per_row(
                batch, held, lambda row, request, seq: self._finish_row(request, seq, logits[row, -1], elapsed)
            )
        self.steps += 1

    def _per_row(
        self,
        batch: list[tuple[Request, SequenceCache]],
        held: list[int],
        handle: Callable[[int, Request, SequenceCache], bool],
    ) -> None:
        """Handle each row of a decoded ``batch`` (``handle`` returns True when the row keeps running) and make
        the kept rows the running list. An interrupt (a ``BaseException``) part-way loses nothing: the rows not
        yet handled — the interrupted one included — are cut back to their ``held`` tokens and stay running,
        in order, after the rows already handled, and the interrupt goes through. A row interrupted once its token
        was recorded keeps it; one finished, failed or queued again keeps that, and its blocks are released."""
        kept: list[tuple[Request, SequenceCache]] = []
        done, outputs = 0, [len(request.output) for request, _ in batch]  # before any row's token is recorded
        try:
            for row, (request, seq) in enumerate(batch):
                if handle(row, request, seq):
                    kept.append((request, seq))
                done = row + 1
        except BaseException:  # the rows not handled yet, the interrupted one first
            rest = batch[done:]
            gone = [r.finished or any(w is r for w in self.waiting) for r, _ in rest]  # retired, failed, requeued
            for (request, seq), n, m, out in zip(rest, held[done:], outputs[done:], gone):
                if not out and len(request.output) == m:  # its token not recorded yet: its step is undone
                    _rollback(seq, n)
            self.running = kept + [row for row, out in zip(rest, gone) if not out]
            for (_, seq), out in zip(rest, gone):
                if out:
                    seq.free()  # harmless when it was released already
            raise
        self.running = kept

    def _decode(self, batch: list[tuple[Request, SequenceCache]]) -> tuple[torch.Tensor, float]:
        """One batched decode step: every row gets its last token; returns the logits ``[B, 1, V]``."""
        device = self.kv.pool.device
        last = torch.tensor([[req.output[-1]] for req, _ in batch], device=device)  # [B, 1]
        positions = torch.tensor([[seq.num_tokens] for _, seq in batch], device=device)  # each at its own position
        started, graphs, seqs = time.perf_counter(), self.decode_graphs, [seq for _, seq in batch]
        with torch.inference_mode():
            if graphs is not None and graphs.supports(seqs):  # the step replayed from its bucket's CUDA graph
                logits = graphs.step(seqs, [req.output[-1] for req, _ in batch])[:, None]
            else:
                logits = self.model(last, self._rows(seqs), position_ids=positions)
        for _, seq in batch:
            if not seq.caught_up:  # a model that skipped a layer must not leave a half-written row behind
                raise StateError(f"sequence {seq.seq_id} was not written in every layer by the decode step")
        return logits, time.perf_counter() - started

    def _decode_one(self, request: Request, seq: SequenceCache) -> bool:
        """Decode one row alone (after a failed batched step): on failure the row's request fails, or waits
        again when the pool is out of room."""
        held = seq.num_tokens
        try:
            logits, elapsed = self._decode([(request, seq)])
        except CapacityExceededError:
            _rollback(seq, held)
            self._requeue(request, seq)
            return False
        except Exception as exc:
            self._fail(request, seq, exc)
            return False
        return self._finish_row(request, seq, logits[0, -1], elapsed)

    def _finish_row(self, request: Request, seq: SequenceCache, logits: torch.Tensor, elapsed: float) -> bool:
        """Record the decoded token of one row and sample the next; a failure here fails only this request.
        Returns True when the request keeps running."""
        try:
            seq.set_token_ids([request.output[-1]], start=seq.num_tokens - 1)
            token = self._sample(request, logits)
        except Exception as exc:
            self._fail(request, seq, exc)
            return False
        request.stats.token_latencies_s.append(elapsed)
        request.stats.computed_tokens += 1
        self._emit(request, seq, token)
        return self._retire_or_keep(request, seq)

    def run(self, max_steps: int = 100_000) -> list[Request]:
        """Step until every submitted request has finished; returns them in completion order (failed ones
        included: check ``request.failed``)."""
        check_index("max_steps", max_steps, lo=1)
        for _ in range(max_steps):
            if not self.waiting and not self.running:
                return self.finished
            before = (len(self.waiting), len(self.running), len(self.finished))
            self.step()
            if not self.running and self.waiting and before == (len(self.waiting), 0, len(self.finished)):
                first = self.waiting[0]
                need = self.kv.spec.blocks_for(len(first.prompt) + len(first.output) + 1)
                raise OutOfBlocksError(needed=need, available=self.kv.allocator.num_available)
        if self.waiting or self.running:  # the last allowed step may have finished them
            raise ConfigError(f"requests still unfinished after {max_steps} steps")
        return self.finished
