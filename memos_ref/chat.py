"""Chat codecs: how a session turns segments (system prompt, tools, memories, turns) into token ids.

A :class:`~memos_ref.session.SessionManager` cuts a conversation into segments and shares their blocks across
sessions through the prefix cache. For that to work, the token ids of a segment must not depend on what comes
after it: tokenizing the rendered conversation as a whole must give exactly the concatenation of the segments'
token lists. Two codecs:

* :class:`ByteCodec` — the shipped byte-level model: each segment is a marker token (``<|system|>``,
  ``<|user|>``, ...) followed by the text's bytes; a session starts with BOS. Bytes never merge, so every
  boundary is exact.
* :class:`ChatCodec` — a real model's tokenizer and chat template (``tokenizer.apply_chat_template``). A
  segment is one rendered message: the text that rendering the history plus the message adds to rendering the
  history alone. Its boundary is exact when the segment starts or the previous one ends with a special token
  (``<|im_start|>`` / ``<|im_end|>`` for ChatML templates such as SmolLM2's): tokenizers split special tokens
  off before BPE, so no merge crosses them. Any other boundary is checked by tokenizing across it, and refused
  (:class:`~memos_ref.errors.ConfigError`) when a merge would cross it.

Tool definitions. A session's tool set is always its own segment — a second system message right after the
system prompt — so sessions with the same system prompt but other tools still share the system prompt's blocks,
and the same tool set renders to the same tokens under every template. (SmolLM2's template ignores
``apply_chat_template(..., tools=...)`` altogether; ``ChatCodec.tools_in_template`` says whether a template
uses them. A template's own tool format would fuse the tools into the system prompt's segment.) The message::

    <|im_start|>system
    You can call these tools. Each line is one tool's JSON definition:
    {"function": {"description": ..., "name": "get_weather", "parameters": {...}}, "type": "function"}
    ...<|im_end|>

One line per tool, ``json.dumps(tool, sort_keys=True)`` for a dict (a string is used as it is), lines sorted: the
same tool set in any order renders to the same tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from memos_ref.errors import ArgumentTypeError, ConfigError, check_type
from memos_ref.model.tokenizer import ByteTokenizer

__all__ = ["TOOLS_HEADER", "ByteCodec", "ChatCodec", "tool_lines"]

#: First line of the system message that lists a session's tools.
TOOLS_HEADER = "You can call these tools. Each line is one tool's JSON definition:"

#: The chat role each segment kind is rendered with (a ``tool_call`` is the assistant's message).
ROLE_OF_KIND = {
    "system": "system",
    "tools": "system",
    "memory": "system",
    "summary": "system",
    "user": "user",
    "assistant": "assistant",
    "tool_call": "assistant",
    "tool_result": "tool",
}

_BYTE_MARKER = {
    "system": "<|system|>",
    "tools": "<|tool|>",
    "memory": "<|memory|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "tool_call": "<|tool|>",
    "tool_result": "<|tool|>",
    "summary": "<|system|>",
}

Message = dict[str, Any]


def tool_lines(tools: Sequence[str | Mapping[str, Any]]) -> list[str]:
    """One canonical line per tool (a dict as sorted-key JSON, a string as it is), sorted."""
    check_type("tools", tools, (list, tuple))
    lines = []
    for i, tool in enumerate(tools):
        check_type(f"tools[{i}]", tool, (str, Mapping))
        lines.append(tool if isinstance(tool, str) else json.dumps(dict(tool), sort_keys=True, ensure_ascii=False))
    return sorted(lines)


class ByteCodec:
    """Segments for the shipped byte-level model: BOS, then per segment a marker token and the text's bytes."""

    stop_ids: tuple[int, ...] = ()  # the shipped model has no end-of-turn token: replies run to max_new_tokens
    tools_in_template = False

    def __init__(self) -> None:
        self.tok = ByteTokenizer()

    def prefix_ids(self) -> list[int]:
        """Tokens every session starts with (BOS)."""
        return [self.tok.bos_id]

    def segment_ids(self, kind: str, text: str, history: Sequence[Message] = ()) -> list[int]:
        """The tokens of one segment: its marker, then the text's bytes (``history`` is not needed)."""
        return [self.tok.special_to_id[_BYTE_MARKER[kind]], *self.tok.encode(text)]

    def tools_text(self, tools: Sequence[str | Mapping[str, Any]]) -> str:
        """The tool set as a segment's text: one canonical line per tool, sorted."""
        return "\n".join(tool_lines(tools))

    def message(self, kind: str, text: str) -> Message:
        """The history entry of a segment (the byte codec does not need the history; kept for symmetry)."""
        return {"role": ROLE_OF_KIND[kind], "content": text}

    def reply_prefix_ids(self, history: Sequence[Message] = ()) -> list[int]:
        """What precedes a generated reply (the assistant marker)."""
        return self.segment_ids("assistant", "")

    def reply_suffix_ids(self, history: Sequence[Message], content: str, stopped: bool) -> list[int]:
        """What closes a generated reply: nothing (the byte model has no end-of-turn)."""
        return []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))


class ChatCodec:
    """Segments rendered through a transformers tokenizer's chat template, with exact token boundaries.

    Args:
        tokenizer: a transformers tokenizer with a chat template (``load_pretrained(...)[0]``).

    ``stop_ids`` are the tokens that end an assistant turn (the tokenizer's EOS, and ``<|im_end|>`` for ChatML
    templates); a session's reply stops at the first of them, as ``model.generate`` does.
    """

    def __init__(self, tokenizer: Any) -> None:
        if not callable(getattr(tokenizer, "apply_chat_template", None)) or not callable(tokenizer):
            raise ArgumentTypeError(
                f"tokenizer: expected a transformers tokenizer with a chat template, got {type(tokenizer).__name__}"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("tokenizer has no chat template: use a chat (instruct) model's tokenizer")
        self.tok = tokenizer
        self.special = sorted(
            {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
            | {str(v) for v in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(v, "special", False)},
            key=len,
            reverse=True,
        )
        stops = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
        end = tokenizer.convert_tokens_to_ids("<|im_end|>") if "<|im_end|>" in self.special else None
        if end is not None:
            stops.add(end)
        self.stop_ids: tuple[int, ...] = tuple(sorted(int(t) for t in stops))
        probe = [{"role": "system", "content": "x"}]
        tool = {"type": "function", "function": {"name": "probe_tool", "description": "d", "parameters": {}}}
        self.tools_in_template: bool = self.render(probe, tools=[tool]) != self.render(probe)

    # ------------------------------------------------------------------ rendering
    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
    ) -> str:
        """The chat template's text for ``messages`` (``''`` for none)."""
        if not messages and not add_generation_prompt:
            return ""
        kwargs: dict[str, Any] = {"tokenize": False, "add_generation_prompt": add_generation_prompt}
        if tools:
            kwargs["tools"] = list(tools)
        return self.tok.apply_chat_template(list(messages), **kwargs)

    def encode(self, text: str) -> list[int]:
        """Token ids of rendered text (its special tokens as written; nothing added)."""
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Readable text of ids, special tokens dropped."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def message(self, kind: str, text: str) -> Message:
        """The chat message a segment of ``kind`` is rendered as."""
        return {"role": ROLE_OF_KIND[kind], "content": text}

    def tools_text(self, tools: Sequence[str | Mapping[str, Any]]) -> str:
        """The content of the system message that lists ``tools`` (see the module doc)."""
        return "\n".join([TOOLS_HEADER, *tool_lines(tools)])

    def added_text(self, history: Sequence[Message], message: Message, **render: Any) -> str:
        """What rendering ``history + [message]`` adds to rendering ``history``; refused when the template
        renders the history differently once the message follows it (no prefix to share)."""
        before = self.render(history)
        after = self.render([*history, message], **render)
        if not after.startswith(before):
            raise ConfigError(
                "the chat template renders the earlier messages differently once another one follows; their "
                "tokens cannot be shared as a prefix (use a template whose output only grows)"
            )
        return after[len(before) :]

    # ------------------------------------------------------------------ segments
    def prefix_ids(self) -> list[int]:
        """Tokens every session starts with: none (the template writes what it needs, BOS included)."""
        return []

    def segment_ids(self, kind: str, text: str, history: Sequence[Message] = ()) -> list[int]:
        """The tokens one segment adds after ``history`` (exact: see :meth:`check_boundary`)."""
        added = self.added_text(history, self.message(kind, text))
        ids = self.encode(added)
        self.check_boundary(self.render(history), added)
        return ids

    def reply_prefix_ids(self, history: Sequence[Message]) -> list[int]:
        """The generation prompt after ``history`` (``<|im_start|>assistant\\n`` for ChatML)."""
        before = self.render(history)
        after = self.render(history, add_generation_prompt=True)
        if not after.startswith(before):
            raise ConfigError("the chat template's generation prompt rewrites the history; cannot share it")
        self.check_boundary(before, after[len(before) :])
        return self.encode(after[len(before) :])

    def reply_suffix_ids(self, history: Sequence[Message], content: str, stopped: bool) -> list[int]:
        """What closes a generated reply so the session holds the rendered assistant message: the template's text
        after the content (``<|im_end|>\\n``), minus the stop token the model already wrote (``stopped``)."""
        prompt = self.render(history, add_generation_prompt=True)[len(self.render(history)) :]
        full = self.added_text(history, self.message("assistant", content))
        if not full.startswith(prompt + content):
            return []  # the template rewrites replies (strips, reformats): keep the tokens as generated
        suffix = full[len(prompt + content) :]
        if stopped:
            stop_text = next((s for s in self.special if suffix.startswith(s)), None)
            suffix = suffix[len(stop_text) :] if stop_text else suffix
        return self.encode(suffix) if suffix else []

    def segments(
        self, messages: Sequence[Message], *, kinds: Sequence[str] | None = None
    ) -> list[tuple[str, list[int]]]:
        """Each message's ``(kind, token ids)``; the concatenation equals ``encode(render(messages))``."""
        out, history = [], []
        for i, message in enumerate(messages):
            kind = kinds[i] if kinds is not None else _kind_of_role(message["role"])
            added = self.added_text(history, message)
            self.check_boundary(self.render(history), added)
            out.append((kind, self.encode(added)))
            history.append(message)
        return out

    def prompt_ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[str | Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The whole prompt as a session lays it out (tools after the first system message when the template
        ignores them): the ids to give ``model.generate`` or an engine :class:`~memos_ref.engine.Request`."""
        return self.encode(self.render(self.with_tools(messages, tools), add_generation_prompt=add_generation_prompt))

    def with_tools(self, messages: Sequence[Message], tools: Sequence[str | Mapping[str, Any]] | None) -> list[Message]:
        """``messages`` with the tool-list message inserted after a leading system message (or first)."""
        messages = list(messages)
        if not tools:
            return messages
        at = 1 if messages and messages[0].get("role") == "system" else 0
        return [*messages[:at], self.message("tools", self.tools_text(tools)), *messages[at:]]

    def check_boundary(self, before: str, after: str) -> None:
        """Refuse a boundary a BPE merge would cross: exact when either side is a special token, else checked
        by tokenizing across it."""
        if not before or not after:
            return
        if any(after.startswith(s) or before.endswith(s) for s in self.special):
            return
        tail = before[-64:]
        if self.encode(tail + after) != self.encode(tail) + self.encode(after):
            raise ConfigError(
                f"the chat template joins messages without a special token, and the tokens merge across the "
                f"boundary ({tail[-16:]!r} | {after[:16]!r}): segments would not be exact prefixes"
            )


def _kind_of_role(role: str) -> str:
    return {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool_result"}.get(role, "user")
