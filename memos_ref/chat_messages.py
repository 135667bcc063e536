"""Chat messages as the codecs take them: the segment kinds and the roles they render with, and the checks on
what a message may hold (:mod:`memos_ref.chat` turns them into token ids).

A message is a mapping with a ``role`` from :data:`ROLES` and a ``str`` ``content`` of valid Unicode. A role is
control text in a template (``<|im_start|>{role}``), so a role outside the set is refused, never rendered; every
other field the template writes as its own text is walked by :func:`template_strings` (bounded, cycle-safe) so the
codec can refuse a special token's spelling in it. A session's tool set is rendered as one canonical line per tool
(:func:`tool_lines`) under :data:`TOOLS_HEADER`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from memos_ref.errors import InvalidArgumentError, check_type

__all__ = [
    "ROLES",
    "ROLE_OF_KIND",
    "TOOLS_HEADER",
    "Message",
    "check_messages",
    "check_text",
    "kind_of_role",
    "segment_kind",
    "template_strings",
    "tool_lines",
]

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

Message = dict[str, Any]


def segment_kind(kind: object) -> str:
    """A segment kind's name, refused (:class:`~memos_ref.errors.InvalidArgumentError`) when unknown."""
    kind = str(kind) if isinstance(kind, str) else kind  # a SegmentKind is a str
    check_type("kind", kind, str)
    if kind not in ROLE_OF_KIND:
        raise InvalidArgumentError(f"kind: expected one of {sorted(ROLE_OF_KIND)}, got {kind!r:.80}")
    return str(kind)


#: The roles a message may have: those the segment kinds render with. Any other role is refused, never rendered:
#: the template writes a role as control text (``<|im_start|>{role}``), so a role is not free text.
ROLES = frozenset(ROLE_OF_KIND.values())


def check_messages(messages: object) -> None:
    """Chat messages: a list of mappings, each with a role from :data:`ROLES` and a ``str`` content of valid
    Unicode (a role outside the set is :class:`~memos_ref.errors.InvalidArgumentError`: it could forge a turn)."""
    check_type("messages", messages, (list, tuple))
    for i, message in enumerate(messages):  # type: ignore[arg-type]
        check_type(f"messages[{i}]", message, Mapping)
        role = message.get("role")
        check_type(f"messages[{i}]['role']", role, str)
        if role not in ROLES:
            raise InvalidArgumentError(f"messages[{i}]['role']: expected one of {sorted(ROLES)}, got {role!r:.80}")
        check_text(f"messages[{i}]['content']", message.get("content"))


def template_strings(name: str, value: object, limit: int = 100_000) -> Iterator[tuple[str, str]]:
    """Every ``str`` in ``value`` (keys included, through mappings, lists and tuples) with where it is; bounded
    (``limit`` items, each container visited once: a cycle ends)."""
    stack, seen, count = [(name, value)], set(), 0
    while stack:
        where, item = stack.pop()
        count += 1
        if count > limit:
            raise InvalidArgumentError(f"{name}: expected at most {limit} values, got more")
        if isinstance(item, str):
            yield where, item
        elif isinstance(item, (Mapping, list, tuple)):
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, Mapping):
                for key, sub in item.items():
                    stack.append((f"{where} key", key))
                    stack.append((f"{where}[{key!r:.40}]", sub))
            else:
                stack.extend((f"{where}[{j}]", sub) for j, sub in enumerate(item))


def check_text(name: str, value: object) -> str:
    """``value`` if it is a ``str`` of valid Unicode (every code point encodable as UTF-8); raises
    :class:`~memos_ref.errors.ArgumentTypeError` for another type and
    :class:`~memos_ref.errors.InvalidArgumentError` naming the first lone surrogate (tokenizers cannot encode one)."""
    check_type(name, value, str)
    assert isinstance(value, str)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidArgumentError(
            f"{name}: expected valid Unicode text, found a lone surrogate U+{ord(value[exc.start]):04X} at index "
            f"{exc.start} (decode bytes with errors='replace' or 'surrogatepass' before passing them)"
        ) from None
    return value


def tool_lines(tools: Sequence[str | Mapping[str, Any]]) -> list[str]:
    """One canonical line per tool (a dict as sorted-key JSON, a string as it is), sorted."""
    check_type("tools", tools, (list, tuple))
    lines = []
    for i, tool in enumerate(tools):
        check_type(f"tools[{i}]", tool, (str, Mapping))
        try:
            line = tool if isinstance(tool, str) else json.dumps(dict(tool), sort_keys=True, ensure_ascii=False)
        except (TypeError, ValueError, RecursionError) as exc:  # a value JSON cannot write, a cycle, too deep
            raise InvalidArgumentError(f"tools[{i}]: expected a JSON-serialisable tool definition ({exc})") from None
        lines.append(check_text(f"tools[{i}]", line))
    return sorted(lines)


def kind_of_role(role: str) -> str:
    """The segment kind a message of ``role`` is cut as (a role outside the known ones: ``user``)."""
    return {"system": "system", "user": "user", "assistant": "assistant", "tool": "tool_result"}.get(role, "user")
