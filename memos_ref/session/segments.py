"""Segments: the one session token layout (seed 000 §3.4) — what a session's tokens are, in what order.

A session's tokens are the codec's prefix (BOS), then :class:`Segment` s, each one a token range with a
:class:`SegmentKind`: the system prompt, the tool set (keyed by :func:`tool_set_key`), memories, then turns
(user, assistant, tool calls and results) and summaries. :class:`SessionLayout` turns a segment plan into token
ids through a codec (:mod:`memos_ref.chat`); :class:`~memos_ref.session.SessionManager` builds every session
with it, and the tiering simulator replays traces with it (:meth:`SessionLayout.trace_prompts`, registered as
:mod:`memos_ref.tiering.simulate`'s default layout), so a simulated session has the same tokens — hence the
same block hashes — as a real one.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from memos_ref.chat import ByteCodec, ChatCodec, tool_lines
from memos_ref.errors import InvalidArgumentError, check_index, check_type
from memos_ref.tiering import simulate as _simulate
from memos_ref.traces import SYSTEM_PROMPTS, TraceEvent

__all__ = [
    "PREFIX_KINDS",
    "SEGMENT_KIND_VALUES",
    "Segment",
    "SegmentKind",
    "SessionLayout",
    "block_kinds",
    "segment_kind",
    "tool_set_key",
]


class SegmentKind(StrEnum):
    SYSTEM = "system"
    TOOLS = "tools"
    MEMORY = "memory"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL_CALL = "tool_call"
    TOOL_RESULT = "tool_result"
    SUMMARY = "summary"


SEGMENT_KIND_VALUES = frozenset(kind.value for kind in SegmentKind)
#: Kinds that lead a session and survive compaction (everything after them is summarised).
PREFIX_KINDS = (SegmentKind.SYSTEM, SegmentKind.TOOLS, SegmentKind.MEMORY)
#: How a block is labelled for the ``priority`` eviction policy, by the kind of its segment (others: ``turn``).
_BLOCK_LABEL = {"system": "system", "tools": "tools", "memory": "memory"}

Plan = list[tuple[SegmentKind, str, list[int]]]  # (kind, seg_id, token ids) per segment, in order


@dataclass(frozen=True)
class Segment:
    """A token range ``[start, stop)`` of a session and what it is."""

    kind: SegmentKind
    seg_id: str
    start: int
    stop: int

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "seg_id": self.seg_id, "start": self.start, "stop": self.stop}


def tool_set_key(tools: list[Any]) -> str:
    """Order-independent id of a tool set (tool sets are shared across sessions by this key); a tool is a
    string or a JSON-schema dict (keyed by its sorted-key JSON)."""
    return hashlib.sha256("\x00".join(tool_lines(tools)).encode()).hexdigest()[:12]


def segment_kind(kind: Any) -> SegmentKind:
    """``kind`` as a :class:`SegmentKind` (its value as a string is accepted too)."""
    check_type("kind", kind, (SegmentKind, str))
    if kind not in SEGMENT_KIND_VALUES:
        raise InvalidArgumentError(f"kind: expected one of {[k.value for k in SegmentKind]}, got {kind!r:.80}")
    return SegmentKind(kind)


def block_kinds(segments: Sequence[Segment], num_blocks: int, block_size: int) -> list[str]:
    """The label of each of the first ``num_blocks`` blocks: the kind of the segment holding the block's last
    token (``system``, ``tools``, ``memory``), else ``turn`` — what the ``priority`` policy ranks by."""
    labels = []
    for i in range(num_blocks):
        end = (i + 1) * block_size - 1
        seg = next((s for s in segments if s.start <= end < s.stop), None)
        labels.append(_BLOCK_LABEL.get(str(seg.kind), "turn") if seg is not None else "turn")
    return labels


def place(plan: Plan, stop: int) -> list[Segment]:
    """The segments of ``plan`` when its last one ends at ``stop``."""
    pos = stop - sum(len(ids) for _, _, ids in plan)
    out = []
    for kind, seg_id, ids in plan:
        out.append(Segment(kind, seg_id, pos, pos + len(ids)))
        pos += len(ids)
    return out


class SessionLayout:
    """How a session's segments become token ids, through a codec (the byte codec by default).

    Every session starts with ``prefix_ids()`` then an :meth:`opening` (system prompt, then tool set); each
    appended segment is :meth:`segment_ids` after the chat history so far; a reply is ``reply_prefix_ids`` +
    generated tokens + ``reply_suffix_ids``; :meth:`compacted` keeps the leading system/tools/memory segments
    and appends a summary."""

    def __init__(self, codec: ByteCodec | ChatCodec | None = None) -> None:
        check_type("codec", codec, (ByteCodec, ChatCodec, type(None)))
        self.codec: ByteCodec | ChatCodec = codec if codec is not None else ByteCodec()

    def prefix_ids(self) -> list[int]:
        return self.codec.prefix_ids()

    def segment_ids(self, kind: SegmentKind | str, text: str, history: Sequence[dict[str, Any]] = ()) -> list[int]:
        """The tokens of a segment after ``history`` (the chat messages before it; the byte codec ignores it)."""
        return self.codec.segment_ids(str(kind), text, list(history))

    def message(self, kind: SegmentKind | str, text: str) -> dict[str, Any]:
        return self.codec.message(str(kind), text)

    def opening(
        self, system: tuple[str, str, str] | None, tools: list[Any] | None
    ) -> tuple[list[int], Plan, list[dict[str, Any]]]:
        """A new session's tokens (prefix included), segment plan and messages: ``system`` is
        ``(name, version, text)``, then the tool set as its own segment."""
        parts = []
        if system is not None:
            parts.append((SegmentKind.SYSTEM, f"{system[0]}@{system[1]}", system[2]))
        if tools:
            parts.append((SegmentKind.TOOLS, tool_set_key(tools), self.codec.tools_text(tools)))
        ids, plan, messages = self.prefix_ids(), [], []
        for kind, seg_id, text in parts:
            plan.append((kind, seg_id, self.segment_ids(kind, text, messages)))
            messages.append(self.message(kind, text))
        for _, _, seg_ids in plan:
            ids.extend(seg_ids)
        return ids, plan, messages

    def compacted(
        self,
        token_ids: Sequence[int],
        segments: Sequence[Segment],
        messages: Sequence[dict[str, Any]],
        summary: str,
    ) -> tuple[list[int], Plan, list[dict[str, Any]]]:
        """The tokens, plan and messages of a session compacted to ``summary``: its leading system prompt,
        tools and memories stay (from the prefix cache), everything after them becomes one summary segment."""
        keep = []
        for s in segments:
            if s.kind not in PREFIX_KINDS:
                break
            keep.append(s)
        stop = keep[-1].stop if keep else len(self.prefix_ids())
        kept_messages = list(messages[: len(keep)])
        summary_ids = self.segment_ids(SegmentKind.SUMMARY, summary, kept_messages)
        plan: Plan = [(s.kind, s.seg_id, list(token_ids[s.start : s.stop])) for s in keep]
        plan.append((SegmentKind.SUMMARY, "summary", summary_ids))
        ids = [*token_ids[:stop], *summary_ids]
        return ids, plan, [*kept_messages, self.message(SegmentKind.SUMMARY, summary)]

    # ------------------------------------------------------------------ traces (the tiering simulator's input)
    def trace_prompts(
        self, events: Sequence[TraceEvent], seed: int = 0, block_size: int = 16
    ) -> Iterator[tuple[float, str, list[int], list[str]]]:
        """For each model-running event of a trace (user turn, tool result, reply), ``(t, session, prompt, block
        labels)``: the session's tokens as a :class:`~memos_ref.session.SessionManager` would hold them when
        the model runs (a reply's prompt ends with its marker). Replies are pseudo-tokens seeded by ``seed``
        (the real ones depend on the model); everything else is exactly what a real session holds."""
        check_type("seed", seed, int)
        block_size = check_index("block_size", block_size, lo=1)
        rng = random.Random(seed)
        state: dict[str, tuple[list[int], list[Segment], list[dict[str, Any]]]] = {}
        for e in events:
            if e.kind == "open":
                name, version = e.system.split("@", 1)
                ids, plan, messages = self.opening((name, version, SYSTEM_PROMPTS[(name, version)]), list(e.tools))
                state[e.session] = (ids, place(plan, len(ids)), messages)
            elif e.kind == "fork":
                ids, segments, messages = state[e.parent]
                state[e.session] = (list(ids), list(segments), list(messages))
            elif e.kind in ("user", "tool_result"):
                ids, segments, messages = state[e.session]
                new = self.segment_ids(e.kind, e.text, messages)
                segments.append(Segment(SegmentKind(e.kind), f"{e.kind}@{e.t:.3f}", len(ids), len(ids) + len(new)))
                ids.extend(new)
                messages.append(self.message(e.kind, e.text))
                yield e.t, e.session, list(ids), block_kinds(segments, len(ids) // block_size, block_size)
            elif e.kind == "generate":
                ids, segments, messages = state[e.session]
                prompt = [*ids, *self.codec.reply_prefix_ids(messages)]
                yield e.t, e.session, prompt, block_kinds(segments, len(prompt) // block_size, block_size)
                reply = [rng.randrange(256) for _ in range(e.max_new_tokens)]
                content = self.codec.decode(reply)
                tail = [*prompt[len(ids) :], *reply, *self.codec.reply_suffix_ids(messages, content, False)]
                segments.append(Segment(SegmentKind.ASSISTANT, "reply", len(ids), len(ids) + len(tail)))
                ids.extend(tail)
                messages.append(self.message(SegmentKind.ASSISTANT, content))
            elif e.kind == "compact":
                ids, segments, messages = state[e.session]
                new_ids, plan, new_messages = self.compacted(ids, segments, messages, e.text)
                state[e.session] = (new_ids, place(plan, len(new_ids)), new_messages)
            elif e.kind == "close":
                state.pop(e.session, None)


_simulate.set_default_layout(SessionLayout())  # the simulator replays traces with the sessions' own layout
