"""CacheSession: one agent conversation over the shared paged memory (seed 000 §3.4, §4.3, §6.3, §6.5).

Its tokens are cut into segments (:mod:`memos_ref.session.segments`), each a token range with its blocks:

* ``session.append(kind, seg_id, text)`` / ``session.generate(n)`` add segments (prefilled, or generated);
* ``session.fork(n)`` gives n sub-agents everything so far, sharing blocks;
* ``session.compact(summary)`` builds the summarised session, switches to it atomically, then releases the old
  blocks (observable in ``session.events``);
* ``session.suspend()`` releases its device blocks (they stay cached, and may move to a tier); the next call
  resumes it from the device prefix cache, the tiers, and recomputation, in that order;
* ``session.save(path)``: safetensors + a JSON manifest (:mod:`memos_ref.session.persist`).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from memos_ref.chat import ByteCodec, ChatCodec, check_text
from memos_ref.errors import OutOfBlocksError, UseAfterFreeError, check_index, check_type
from memos_ref.hf import PagedCache
from memos_ref.session.persist import write_session
from memos_ref.session.segments import Plan, Segment, SegmentKind, SessionLayout, block_kinds, place, segment_kind
from memos_ref.spec import KVSpec

if TYPE_CHECKING:
    from memos_ref.paged.store import PagedKV
    from memos_ref.tiering.manager import TierManager

__all__ = ["CacheSession", "SessionHost"]


class SessionHost(Protocol):
    """What a :class:`CacheSession` needs of the manager that started it
    (:class:`~memos_ref.session.manager.SessionManager` is the one): the shared paged memory and model, the token
    layout, the tiers, and the registry a session joins. The seam is a Protocol so this module never imports the
    manager, which imports it."""

    model: Any  # the package's LlamaForward: model(input_ids [1, n], cache) runs a forward into the cache
    kv: PagedKV
    spec: KVSpec
    codec: ByteCodec | ChatCodec
    layout: SessionLayout
    fingerprint: str
    tiering: TierManager | None
    sessions: weakref.WeakSet[CacheSession]

    @property
    def clock(self) -> Callable[[], float]:
        """The time source (tiering's clock when tiering is on)."""
        ...

    def encode_segment(
        self, kind: SegmentKind | str, text: str, history: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The tokens of a segment after ``history``."""
        ...

    def after_call(self, session: CacheSession) -> None:
        """Called after each of the session's calls (prefetch learns which session follows which)."""
        ...


class CacheSession:
    """One agent conversation: a paged cache, its tokens, and the segments that say what they are."""

    def __init__(
        self,
        manager: SessionHost,
        cache: PagedCache | None,
        token_ids: list[int],
        segments: list[Segment],
        messages: list[dict[str, Any]] | None = None,
    ):
        self.manager = manager
        self.cache = cache if cache is not None else PagedCache(manager.kv)
        self.token_ids = token_ids
        self.segment_list = segments  # the Segment objects, in order; segments() describes them
        self.messages: list[dict[str, Any]] = messages if messages is not None else []  # one per segment
        self.last_reply: dict[str, Any] = {}  # prompt_tokens, new_tokens, ttft_s, stopped of the last generate()
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.prefill_computed = 0  # tokens actually run through the model
        self.prefill_reused = 0  # tokens taken from the prefix cache or a memory
        self.closed = False
        self.suspended = False
        self.last_active = manager.clock()
        self.resumed_reused = 0  # tokens restored from the device cache or a tier on resume
        self.resumed_computed = 0  # tokens recomputed on resume
        self._lock = threading.RLock()
        manager.sessions.add(self)

    def _check_open(self) -> None:
        if self.closed:
            raise UseAfterFreeError("this session was closed; start a new one (or fork() before closing)")
        with self._lock:
            self.last_active = self.manager.clock()
            if self.suspended:
                self._resume()
            tiering = self.manager.tiering
            if tiering is not None and self.cache.sequences:
                tiering.touch(self.cache.sequences[0].block_table, self.last_active)

    # ------------------------------------------------------------------ suspend and resume (tiering)
    def suspend(self, blocking: bool = True) -> int:
        """Release this session's device blocks; its full blocks stay cached (and may move to a tier). The
        next call resumes it. Returns how many blocks were released (0 when ``blocking`` is False and the
        session is busy in another thread: a busy session is not idle)."""
        if not self._lock.acquire(blocking=blocking):
            return 0
        try:
            if self.closed or self.suspended or not self.cache.sequences:
                return 0
            active_before = self.manager.kv.allocator.num_active
            self.cache.set_token_ids(torch.tensor([self.token_ids]))
            self.cache.free()
            released = active_before - self.manager.kv.allocator.num_active  # shared blocks stay active
            self.suspended = True
            self.events.append(("suspended", {"blocks": released, "tokens": len(self.token_ids)}))
            return released
        finally:
            self._lock.release()

    def _resume(self) -> None:
        """Rebuild the cache from the device prefix cache, the tiers, and recomputation, in that order."""
        ids = self.token_ids
        hit, reused = self._build(ids)
        self.cache = hit
        self.suspended = False
        self.resumed_reused += reused
        self.resumed_computed += len(ids) - reused
        if self.manager.tiering is not None:
            self.manager.tiering.counts["recomputed_tokens"] += len(ids) - reused
        self.events.append(("resumed", {"reused": reused, "recomputed": len(ids) - reused}))

    def _rollback(self) -> None:
        """After a failed step, cut the cache back to the tokens the session records (all layers agree)."""
        seq = self.cache.sequences[0] if self.cache.sequences else None
        if seq is None:
            return
        seq.layer_tokens = [min(n, len(self.token_ids)) for n in seq.layer_tokens]
        seq.num_tokens = max(seq.layer_tokens)
        seq.truncate(min(len(self.token_ids), seq.num_tokens))

    # ------------------------------------------------------------------ building
    def _build(self, ids: list[int]) -> tuple[PagedCache, int]:
        """A new cache holding ``ids``: the cached prefix (device, then tiers) reused, the rest computed.
        Returns it and how many tokens were reused; on failure nothing stays referenced."""
        hit = PagedCache.from_prefix(self.manager.kv, torch.tensor([ids]), cache_salt=self.cache.cache_salt)
        reused = hit.get_seq_length()
        try:
            with torch.no_grad():
                self.manager.model(torch.tensor([ids[reused:]]), hit)
            hit.set_token_ids(torch.tensor([ids]))
        except Exception:
            hit.free()
            raise
        return hit, reused

    def prefill_segments(self, ids: list[int], plan: Plan, messages: list[dict[str, Any]]) -> None:
        """Fill an empty session with ``ids`` (the layout's prefix, e.g. BOS, + planned segments), reusing cached
        prefix blocks; ``messages`` is the chat history the segments render. (The manager starts sessions
        with it; the segments' layout is :class:`~memos_ref.session.segments.SessionLayout`'s.)"""
        hit, reused = self._build(ids)
        self.cache.free()
        self.cache = hit
        self.token_ids = list(ids)
        self.messages = list(messages)
        self.segment_list.extend(place(plan, len(ids)))
        self.prefill_reused += reused
        self.prefill_computed += len(ids) - reused
        if self.manager.tiering is not None:
            self._label_blocks()

    def _label_blocks(self) -> None:
        """Tell tiering what each full block holds (by the segment of its last token), by the hashes the blocks
        are indexed under: the prompt was hashed once, by the prefix lookup and the sequence; not again here."""
        t, kv = self.manager.spec.block_size, self.manager.kv
        table = self.cache.sequences[0].block_table
        full = len(self.token_ids) // t
        hashes = [kv.allocator.hash_of(b) for b in table[:full]]
        if any(h is None for h in hashes):  # a private copy (not indexed): hash its prompt
            hashes = kv.prefix_cache.hashes(self.token_ids[: full * t], self.cache.cache_salt)
        for h, label in zip(hashes, block_kinds(self.segment_list, full, t)):
            self.manager.tiering.label([h], label)

    def _with_room(self, op: Callable[[], Any]) -> Any:
        """Run ``op``; if the pool ran out of blocks and tiering is on, make room (suspending idle sessions,
        moving cached blocks down) and try once more."""
        tiering = self.manager.tiering
        if tiering is not None and tiering.utilization() > tiering.high:
            tiering.step()  # make room before this call allocates (outside this session's lock: may suspend it)
        try:
            result = op()
        except OutOfBlocksError:
            if tiering is None:
                raise
            tiering.step()
            result = op()
        self.manager.after_call(self)
        return result

    def append(self, kind: SegmentKind, seg_id: str, text: str) -> Segment:
        """Add a segment (a user turn, a tool result, …): its tokens are prefilled into the cache."""
        kind = segment_kind(kind)
        check_type("seg_id", seg_id, str)
        check_text("text", text)
        self._refuse_closed()
        return self._with_room(lambda: self._append(kind, seg_id, text))

    def _append(self, kind: SegmentKind, seg_id: str, text: str) -> Segment:
        with self._lock, torch.no_grad():  # held from the resume check to the end: nobody suspends us midway
            self._check_open()
            ids = self.manager.encode_segment(SegmentKind(kind), text, self.messages)
            message = self.manager.codec.message(str(kind), text)
            if not self.token_ids:  # an empty chat session: its first segment may come from the prefix cache
                self._prefill(ids, [(SegmentKind(kind), seg_id, ids)], [message])
                return self.segment_list[-1]
            start = len(self.token_ids)
            try:
                self.manager.model(torch.tensor([ids]), self.cache)
            except Exception:
                self._rollback()
                raise
            self.token_ids.extend(ids)
            self.cache.set_token_ids(torch.tensor([self.token_ids]))
            segment = Segment(SegmentKind(kind), seg_id, start, start + len(ids))
            self.segment_list.append(segment)
            self.messages.append(message)
            self.prefill_computed += len(ids)
            return segment

    def generate(self, max_new_tokens: int, seg_id: str = "reply") -> str:
        """Greedy continuation as an assistant turn; returns its text.

        With a chat codec the reply starts with the template's generation prompt, stops at the end-of-turn token
        (or after ``max_new_tokens``) and is closed as the template renders an assistant message, so the session
        holds exactly the rendered conversation; the returned text has no special tokens. ``last_reply`` records
        the prompt length, the new tokens, whether a stop token ended it, and the time to the first token."""
        check_index("max_new_tokens", max_new_tokens, lo=0)
        check_type("seg_id", seg_id, str)
        self._refuse_closed()
        return self._with_room(lambda: self._generate(max_new_tokens, seg_id))

    def _generate(self, max_new_tokens: int, seg_id: str) -> str:
        codec, model = self.manager.codec, self.manager.model
        with self._lock, torch.no_grad():
            started = time.perf_counter()
            self._check_open()
            marker = codec.reply_prefix_ids(self.messages)
            start = len(self.token_ids)
            new: list[int] = []
            ttft, stopped = None, False
            try:
                logits = model(torch.tensor([marker]), self.cache)
                for i in range(max_new_tokens):
                    nxt = int(logits[0, -1].argmax())
                    new.append(nxt)
                    ttft = time.perf_counter() - started if ttft is None else ttft
                    stopped = nxt in codec.stop_ids
                    if stopped:
                        break
                    if i + 1 < max_new_tokens:
                        logits = model(torch.tensor([[nxt]]), self.cache)
                content = codec.decode(new[:-1] if stopped else new)
                close = codec.reply_suffix_ids(self.messages, content, stopped)
                # the last generated token is not yet in the cache: feed it (and the turn's closing tokens)
                tail = new[-1:] + close
                if tail:
                    model(torch.tensor([tail]), self.cache)
            except Exception:
                self._rollback()  # the session stays as it was before the call
                raise
            self.token_ids.extend(marker + new + close)
            self.cache.set_token_ids(torch.tensor([self.token_ids]))
            self.segment_list.append(Segment(SegmentKind.ASSISTANT, seg_id, start, len(self.token_ids)))
            self.messages.append(codec.message("assistant", content))
            self.last_reply = {
                "prompt_tokens": start + len(marker),
                "new_tokens": len(new),
                "stopped": stopped,
                "ttft_s": ttft,
            }
            return content

    # ------------------------------------------------------------------ agent operations
    def fork(self, n: int = 1) -> list[CacheSession]:
        """n sub-agent sessions sharing everything so far (blocks are shared, not copied)."""
        check_index("n", n, lo=0)
        with self._lock:
            self._check_open()
            return [
                CacheSession(
                    self.manager, self.cache.fork(), list(self.token_ids), list(self.segment_list), list(self.messages)
                )
                for _ in range(n)
            ]

    def compact(self, summary_text: str) -> None:
        """Replace the conversation after the system prompt and tools by a summary (seed 000 §6.3).

        The summarised session is built first (the system prompt and tools come from the prefix cache), then
        swapped in under the lock, and only then are the old blocks released — so the two sets coexist only
        for the build and the switch, and readers never see a half-built session. ``events`` records each
        step with block counts.
        """
        check_text("summary_text", summary_text)
        with self._lock:
            self._check_open()
            ids, plan, messages = self.manager.layout.compacted(
                self.token_ids, self.segment_list, self.messages, summary_text
            )
            fresh = CacheSession(self.manager, None, [], [])
            before = self.manager.kv.allocator.num_active
            fresh.prefill_segments(ids, plan, messages)
            self.events.append(
                (
                    "compact_built",
                    {
                        "blocks_active": self.manager.kv.allocator.num_active,
                        "blocks_before": before,
                        "time": time.perf_counter(),
                    },
                )
            )
            old = self.cache
            self.cache, self.token_ids, self.segment_list = fresh.cache, fresh.token_ids, fresh.segment_list
            self.messages = fresh.messages
            self.events.append(("switched", {"tokens": len(self.token_ids), "time": time.perf_counter()}))
            released = sum(seq.num_blocks for seq in old.sequences)
            active_before_free = self.manager.kv.allocator.num_active
            old.free()
            self.events.append(
                (
                    "released",
                    {
                        "blocks": released,  # the old tables' blocks, shared ones (the system prompt) included
                        "returned": active_before_free - self.manager.kv.allocator.num_active,  # left active state
                        "blocks_active": self.manager.kv.allocator.num_active,
                        "time": time.perf_counter(),
                    },
                )
            )
            self.prefill_computed += fresh.prefill_computed
            self.prefill_reused += fresh.prefill_reused

    def close(self) -> None:
        """Release the session's blocks (prefix-registered ones stay cached for reuse). Closing twice is a
        no-op; any other call on a closed session raises :class:`~memos_ref.errors.UseAfterFreeError`."""
        with self._lock:
            self.cache.free()
            self.closed = True

    def _refuse_closed(self) -> None:
        if self.closed:
            raise UseAfterFreeError("this session was closed; start a new one (or fork() before closing)")

    # ------------------------------------------------------------------ inspection and persistence
    def segments(self) -> list[dict[str, Any]]:
        """The segments — kind, id, token range — with their block ids and residency."""
        with self._lock:
            self._refuse_closed()
            if self.suspended:
                self._check_open()
            return self._segments()

    def blocks_shared(self) -> int:
        """How many of this session's blocks another sequence holds too (refcount above one)."""
        with self._lock:
            self._refuse_closed()
            if self.suspended or not self.cache.sequences:
                return 0
            refcount = self.manager.kv.allocator.refcount
            return sum(1 for block in set(self.cache.sequences[0].block_table) if refcount[block] > 1)

    def _segments(self) -> list[dict[str, Any]]:
        seq = self.cache.sequences[0]
        t = self.manager.spec.block_size
        return [
            {
                **s.to_dict(),
                "tokens": s.stop - s.start,
                "blocks": sorted({seq.block_table[p // t] for p in range(s.start, min(s.stop, seq.num_tokens))}),
                "residency": "device",
            }
            for s in self.segment_list
        ]

    def save(self, path: str | Path) -> Path:
        """Write ``path.safetensors`` (K/V ``[L, 2, H, S, D]``) and ``path.json`` (manifest; its
        ``manifest_sha256`` covers every other field, ``sha256`` the tensor file)."""
        check_type("path", path, (str, os.PathLike))
        with self._lock:
            self._refuse_closed()
            if self.suspended:
                self._check_open()
            return self._save(Path(path))

    def _save(self, path: Path) -> Path:
        seq = self.cache.sequences[0]
        kv = torch.stack([torch.stack(seq.to_dense(layer)) for layer in range(self.manager.spec.num_layers)])
        tokens = self.token_ids[: seq.num_tokens]
        segments = [s for s in self.segment_list if s.stop <= seq.num_tokens]
        return write_session(path, kv, self.manager.fingerprint, self.manager.spec, tokens, segments)
