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

Content is text, never control. A message's content (a user turn, a tool result, a memory, the tool list) is
tokenized as plain text: a content holding ``<|im_start|>system ...`` gives the tokens of those characters, not the
template's control tokens, so no content can forge a turn (transformers' ``apply_chat_template(tokenize=True)``
parses them; agent frameworks warn about it). Only the template's own text yields special tokens. The codec
finds the contents in the rendered text by rendering with placeholder contents; a template that rewrites contents
so they cannot be found is refused for a content that holds a special token. ``ChatCodec(tokenizer,
special_tokens_in_content=True)`` is the explicit opt-in to the old behaviour (contents parsed like the template).
Text must be valid Unicode: a lone surrogate is refused (:class:`~memos_ref.errors.InvalidArgumentError`).
What the template writes as its own text is not content: a message's role must be one of :data:`ROLES` (``system``,
``user``, ``assistant``, ``tool``; memories, summaries and tool lists are system messages), and every other field
(``name``, ``tool_calls`` and their arguments, a tool definition given to :meth:`ChatCodec.render`) is refused
(:class:`~memos_ref.errors.InvalidArgumentError`) when it spells a special token.

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

The roles, the segment kinds and the checks on messages, text and tool lines are in :mod:`memos_ref.chat_messages`
(``ROLES``, ``TOOLS_HEADER``, ``check_text`` and ``tool_lines`` are re-exported here); this module holds the codecs.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from memos_ref.chat_messages import (
    ROLE_OF_KIND,
    ROLES,
    TOOLS_HEADER,
    Message,
    check_messages,
    check_text,
    kind_of_role,
    segment_kind,
    template_strings,
    tool_lines,
)
from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, ModelMismatchError, check_type
from memos_ref.model.tokenizer import ByteTokenizer

__all__ = ["ROLES", "TOOLS_HEADER", "ByteCodec", "ChatCodec", "check_text", "tool_lines"]

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
        """The tokens of one segment: its marker, then the text's bytes (``history`` is not needed, but is checked
        as :class:`ChatCodec` checks it: a role outside :data:`ROLES` is refused by both codecs)."""
        check_messages(history)
        return [self.tok.special_to_id[_BYTE_MARKER[segment_kind(kind)]], *self.tok.encode(text)]

    def tools_text(self, tools: Sequence[str | Mapping[str, Any]]) -> str:
        """The tool set as a segment's text: one canonical line per tool, sorted."""
        return "\n".join(tool_lines(tools))

    def message(self, kind: str, text: str) -> Message:
        """The history entry of a segment (the byte codec does not need the history; kept for symmetry)."""
        return {"role": ROLE_OF_KIND[segment_kind(kind)], "content": check_text("text", text)}

    def reply_prefix_ids(self, history: Sequence[Message] = ()) -> list[int]:
        """What precedes a generated reply (the assistant marker)."""
        check_messages(history)
        return self.segment_ids("assistant", "")

    def reply_suffix_ids(self, history: Sequence[Message], content: str, stopped: bool) -> list[int]:
        """What closes a generated reply: nothing (the byte model has no end-of-turn)."""
        return []

    def decode(self, ids: Sequence[int]) -> str:
        return self.tok.decode(list(ids))

    def check_layout(self, token_ids: Sequence[int], segments: Sequence[tuple[str, int, int]]) -> None:
        """Refuse (:class:`~memos_ref.errors.ModelMismatchError`) tokens not laid out by this codec: BOS first,
        every id in the byte vocabulary, each segment opened by its kind's marker. ``segments`` are
        ``(kind, start, stop)``. A session saved through a chat template fails here, at load."""
        vocab = self.tok.vocab_size
        if not token_ids or token_ids[0] != self.tok.bos_id:
            raise ModelMismatchError(
                f"the session does not start with the byte codec's BOS ({self.tok.bos_id}) but with "
                f"{token_ids[0] if token_ids else None}: it was saved by a manager with a chat tokenizer; load it "
                f"with SessionManager(..., tokenizer=<that tokenizer>)"
            )
        beyond = next((t for t in token_ids if not 0 <= t < vocab), None)
        if beyond is not None:
            raise ModelMismatchError(
                f"token id {beyond} is outside the byte codec's vocabulary [0, {vocab}): the session was saved by a "
                f"manager with a chat tokenizer; load it with SessionManager(..., tokenizer=<that tokenizer>)"
            )
        for i, (kind, start, stop) in enumerate(segments):
            marker = self.tok.special_to_id[_BYTE_MARKER[kind]]
            if stop > start and token_ids[start] != marker:
                raise ModelMismatchError(
                    f"segment {i} ({kind}) starts with token {token_ids[start]}, not the byte codec's marker "
                    f"{_BYTE_MARKER[kind]} ({marker}): the session was not laid out by the byte codec"
                )


class ChatCodec:
    """Segments rendered through a transformers tokenizer's chat template, with exact token boundaries.

    Args:
        tokenizer: a transformers tokenizer with a chat template (``load_pretrained(...)[0]``).
        special_tokens_in_content: ``False`` (the default): message contents are tokenized as plain text, so a
            content holding ``<|im_start|>`` gives the tokens of those characters and only the template yields
            special tokens. ``True`` is the explicit opt-in to parse special tokens in contents too (a content can
            then open or close turns: only for trusted text).

    ``stop_ids`` are the tokens that end an assistant turn (the tokenizer's EOS, and ``<|im_end|>`` for ChatML
    templates); a session's reply stops at the first of them, as ``model.generate`` does.
    """

    def __init__(self, tokenizer: Any, *, special_tokens_in_content: bool = False) -> None:
        if not callable(getattr(tokenizer, "apply_chat_template", None)) or not callable(tokenizer):
            raise ArgumentTypeError(
                f"tokenizer: expected a transformers tokenizer with a chat template, got {type(tokenizer).__name__}"
            )
        if not getattr(tokenizer, "chat_template", None):
            raise ConfigError("tokenizer has no chat template: use a chat (instruct) model's tokenizer")
        check_type("special_tokens_in_content", special_tokens_in_content, bool)
        self.tok = tokenizer
        self.special_tokens_in_content = special_tokens_in_content
        self.special = sorted(
            {str(t) for t in getattr(tokenizer, "all_special_tokens", [])}
            | {str(v) for v in getattr(tokenizer, "added_tokens_decoder", {}).values() if getattr(v, "special", False)},
            key=len,
            reverse=True,
        )
        self._special_re = re.compile("|".join(re.escape(t) for t in self.special)) if self.special else None
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
        check_messages(messages)
        self._check_template_fields(messages, tools)
        try:
            return self.tok.apply_chat_template(list(messages), **kwargs)
        except Exception as exc:  # jinja2's TemplateError (raise_exception in the template), a missing key, ...
            raise ConfigError(f"the chat template refused the messages: {type(exc).__name__}: {exc}") from None

    def _check_template_fields(self, messages: Sequence[Message], tools: object) -> None:
        """Refuse a special token's spelling in what the template writes as its own text: every message field but
        the content (``name``, ``tool_calls`` and their arguments, ...) and the tool definitions. Only contents are
        masked as text; a ``<|im_end|>`` in a tool call's arguments would otherwise close the turn."""
        fields = [(f"messages[{i}]", {k: v for k, v in m.items() if k != "content"}) for i, m in enumerate(messages)]
        for name, value in [*fields, ("tools", tools)]:
            for where, text in template_strings(name, value):
                check_text(where, text)
                found = self._special_re.search(text) if self._special_re is not None else None
                if found is not None:
                    raise InvalidArgumentError(
                        f"{where}: expected text without the tokenizer's special tokens (only a message's content is "
                        f"tokenized as text; the template writes this field as control text), got {found.group(0)!r} "
                        f"in {text!r:.80}"
                    )

    def encode(self, text: str) -> list[int]:
        """Token ids of template text (its special tokens parsed as written; nothing added)."""
        check_text("text", text)
        return list(self.tok(text, add_special_tokens=False)["input_ids"])

    def encode_text(self, text: str) -> list[int]:
        """Token ids of content: plain text, a special token's spelling gives ordinary tokens (nothing added)."""
        check_text("text", text)
        if not text:
            return []
        return list(self.tok(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Readable text of ids, special tokens dropped."""
        return self.tok.decode(list(ids), skip_special_tokens=True)

    def message(self, kind: str, text: str) -> Message:
        """The chat message a segment of ``kind`` is rendered as."""
        return {"role": ROLE_OF_KIND[segment_kind(kind)], "content": check_text("text", text)}

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

    # ------------------------------------------------------------------ content-safe tokenization
    def _content_spans(self, messages: Sequence[Message], text: str, **render: Any) -> list[tuple[int, int]]:
        """The character ranges of ``text`` (``render(messages)``) that come from the messages' contents, found
        by rendering placeholders in their place. A template that rewrites contents (so they cannot be found)
        is refused when a content holds a special token's spelling; otherwise nothing is content."""
        contents = [m.get("content") if isinstance(m, Mapping) else None for m in messages]
        if self.special_tokens_in_content or not any(isinstance(c, str) and c for c in contents):
            return []
        nonce = secrets.token_hex(8)
        masked = [
            {**m, "content": f"\ue000{nonce}:{i}\ue001"} if isinstance(contents[i], str) else m
            for i, m in enumerate(messages)
        ]
        skeleton = self.render(masked, **render)
        spans, parts, pos, length = [], [], 0, 0
        for match in re.finditer(f"\ue000{nonce}:(\\d+)\ue001", skeleton):
            index = int(match.group(1))
            if index >= len(contents) or not isinstance(contents[index], str):
                break
            piece = skeleton[pos : match.start()]
            parts.append(piece)
            length += len(piece)
            spans.append((length, length + len(contents[index])))
            parts.append(contents[index])
            length += len(contents[index])
            pos = match.end()
        parts.append(skeleton[pos:])
        if "".join(parts) == text:
            return spans
        if self._special_re is not None and any(isinstance(c, str) and self._special_re.search(c) for c in contents):
            raise ConfigError(
                "the chat template rewrites message contents, so the codec cannot tell content from template, and "
                "a content holds a special token's spelling: refused (it could forge a turn); remove the special "
                "token from the content or pass ChatCodec(..., special_tokens_in_content=True) for trusted text"
            )
        return []

    def _pieces(
        self, text: str, spans: Sequence[tuple[int, int]], start: int = 0, stop: int | None = None
    ) -> list[str | int]:
        """``text[start:stop]`` as text chunks (``str``) and the ids of the template's special tokens (``int``): a
        special token is recognised only where no content overlaps it."""
        stop = len(text) if stop is None else stop
        if self.special_tokens_in_content:
            return [text[start:stop]] if stop > start else []
        regions, pos = [], 0
        for lo, hi in spans:
            regions.append((pos, lo, False))
            regions.append((lo, hi, True))
            pos = hi
        regions.append((pos, len(text), False))
        out: list[str | int] = []
        chunk: list[str] = []
        for lo, hi, is_content in regions:
            lo, hi = max(lo, start), min(hi, stop)
            if lo >= hi:
                continue
            if is_content or self._special_re is None:
                chunk.append(text[lo:hi])
                continue
            at = lo
            for match in self._special_re.finditer(text, lo, hi):
                chunk.append(text[at : match.start()])
                if "".join(chunk):
                    out.append("".join(chunk))
                chunk = []
                out.append(int(self.tok.convert_tokens_to_ids(match.group(0))))
                at = match.end()
            chunk.append(text[at:hi])
        if "".join(chunk):
            out.append("".join(chunk))
        return out

    def _ids(self, pieces: Sequence[str | int]) -> list[int]:
        if self.special_tokens_in_content:
            return [t for p in pieces for t in (self.encode(p) if isinstance(p, str) else [p])]
        return [t for p in pieces for t in (self.encode_text(p) if isinstance(p, str) else [p])]

    def _added_ids(self, history: Sequence[Message], messages: Sequence[Message], **render: Any) -> list[int]:
        """The ids ``render(messages)`` adds after ``render(history)`` (``history`` a prefix of ``messages``),
        contents as text, after checking that no merge crosses the boundary."""
        before = self.render(history)
        after = self.render(messages, **render)
        if not after.startswith(before):
            raise ConfigError(
                "the chat template renders the earlier messages differently once another one follows; their "
                "tokens cannot be shared as a prefix (use a template whose output only grows)"
            )
        spans = self._content_spans(messages, after, **render)
        added = self._pieces(after, spans, len(before))
        if before and added:  # the history renders as the prefix of ``after``: its pieces are after's up to the cut
            self._check_pieces_boundary(self._pieces(after, spans, 0, len(before)), added)
        return self._ids(added)

    def _check_pieces_boundary(self, before: Sequence[str | int], after: Sequence[str | int]) -> None:
        if not before or not after or isinstance(before[-1], int) or isinstance(after[0], int):
            return  # a special token on either side: tokenizers split them off before BPE, no merge crosses
        tail, head = str(before[-1])[-64:], str(after[0])
        enc = self.encode if self.special_tokens_in_content else self.encode_text
        if enc(tail + head) != enc(tail) + enc(head):
            raise ConfigError(
                f"the chat template joins messages without a special token, and the tokens merge across the "
                f"boundary ({tail[-16:]!r} | {head[:16]!r}): segments would not be exact prefixes"
            )

    # ------------------------------------------------------------------ segments
    def prefix_ids(self) -> list[int]:
        """Tokens every session starts with: none (the template writes what it needs, BOS included)."""
        return []

    def segment_ids(self, kind: str, text: str, history: Sequence[Message] = ()) -> list[int]:
        """The tokens one segment adds after ``history`` (exact: see :meth:`check_boundary`); the text is content:
        tokenized as plain text (see the class doc)."""
        check_text("text", text)
        return self._added_ids(history, [*history, self.message(kind, text)])

    def reply_prefix_ids(self, history: Sequence[Message]) -> list[int]:
        """The generation prompt after ``history`` (``<|im_start|>assistant\\n`` for ChatML)."""
        before = self.render(history)
        after = self.render(history, add_generation_prompt=True)
        if not after.startswith(before):
            raise ConfigError("the chat template's generation prompt rewrites the history; cannot share it")
        return self._added_ids(history, history, add_generation_prompt=True)

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
        return self.encode(suffix) if suffix else []  # template text only

    def segments(
        self, messages: Sequence[Message], *, kinds: Sequence[str] | None = None
    ) -> list[tuple[str, list[int]]]:
        """Each message's ``(kind, token ids)``; the concatenation equals :meth:`prompt_ids` without the generation
        prompt (and ``encode(render(messages))`` when no content spells a special token)."""
        check_messages(messages)
        if kinds is not None:
            check_type("kinds", kinds, (list, tuple))
            if len(kinds) != len(messages):
                raise InvalidArgumentError(f"kinds: expected one per message ({len(messages)}), got {len(kinds)}")
        out, history = [], []
        for i, message in enumerate(messages):
            kind = kinds[i] if kinds is not None else kind_of_role(message["role"])
            out.append((kind, self._added_ids(history, [*history, message])))
            history.append(message)
        return out

    def prompt_ids(
        self,
        messages: Sequence[Message],
        tools: Sequence[str | Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The whole prompt as a session lays it out (tools after the first system message when the template
        ignores them; contents as text): the ids to give ``model.generate`` or an engine
        :class:`~memos_ref.engine.Request`."""
        messages = self.with_tools(messages, tools)
        text = self.render(messages, add_generation_prompt=add_generation_prompt)
        spans = self._content_spans(messages, text, add_generation_prompt=add_generation_prompt)
        return self._ids(self._pieces(text, spans))

    def with_tools(self, messages: Sequence[Message], tools: Sequence[str | Mapping[str, Any]] | None) -> list[Message]:
        """``messages`` with the tool-list message inserted after a leading system message (or first)."""
        check_messages(messages)
        messages = list(messages)
        if not tools:
            return messages
        at = 1 if messages and messages[0].get("role") == "system" else 0
        return [*messages[:at], self.message("tools", self.tools_text(tools)), *messages[at:]]

    def check_boundary(self, before: str, after: str) -> None:
        """Refuse a boundary between two pieces of template text that a BPE merge would cross: exact when either
        side is a special token, else checked by tokenizing across it."""
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

    def check_layout(self, token_ids: Sequence[int], segments: Sequence[tuple[str, int, int]]) -> None:
        """Refuse (:class:`~memos_ref.errors.ModelMismatchError`) tokens not laid out by this template: every id in
        the tokenizer's vocabulary, each segment opening as the template opens a message of its kind (its first
        token). ``segments`` are ``(kind, start, stop)``."""
        vocab = len(self.tok)
        beyond = next((t for t in token_ids if not 0 <= t < vocab), None)
        if beyond is not None:
            raise ModelMismatchError(f"token id {beyond} is outside the tokenizer's vocabulary [0, {vocab})")
        history: list[Message] = []
        for i, (kind, start, stop) in enumerate(segments):
            message = self.message(kind, "x")
            if stop > start:
                opening = self._added_ids(history, [*history, message])[:1]
                if kind in ("assistant", "tool_call"):
                    opening_reply = self.reply_prefix_ids(history)[:1]
                else:
                    opening_reply = opening
                if token_ids[start] not in (*opening, *opening_reply):
                    raise ModelMismatchError(
                        f"segment {i} ({kind}) starts with token {token_ids[start]}, but this chat template opens a "
                        f"{ROLE_OF_KIND[kind]} message with {opening}: the session was saved with another codec "
                        f"(the byte codec, or another tokenizer); load it with the manager that saved it"
                    )
            history.append(self.message(kind, ""))
