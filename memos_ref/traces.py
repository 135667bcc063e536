"""Seeded agent-workload traces in one JSON-lines format, shared by benchmarks, notebooks and tests.

A trace is a list of :class:`TraceEvent` in arrival order. Each event acts on one session:

* ``open`` — start a session with a system prompt (``system`` = ``name@version``) and a tool set;
* ``fork`` — start ``session`` as a sub-agent of ``parent`` (sharing everything so far);
* ``user`` / ``tool_result`` — append text as that segment kind;
* ``generate`` — the agent replies with ``max_new_tokens`` tokens;
* ``compact`` — replace the conversation by ``text`` (a summary);
* ``close`` — release the session.

Three named traces ship (``TRACES``): ``chat`` (multi-turn dialogues with idle gaps; the system prompt gets a
new version halfway), ``multi_agent`` (main agents fork sub-agents over a long shared system prompt and a
task brief), ``tool_heavy`` (tool calls and results; tool sets change at a set rate). Everything derives from
``random.Random(seed)``, so a name and a seed give the same bytes on every machine.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memos_ref.errors import ConfigError

__all__ = ["KINDS", "SYSTEM_PROMPTS", "TRACES", "TraceEvent", "load_trace", "make_trace", "replay", "save_trace"]

KINDS = ("open", "fork", "user", "tool_result", "generate", "compact", "close")

#: System prompts the traces refer to, by (name, version).
SYSTEM_PROMPTS: dict[tuple[str, str], str] = {
    ("assistant", "v1"): "You are a helpful Python assistant. Answer with short, correct code.\n" * 4,
    ("assistant", "v2"): "You are a helpful Python assistant. Answer with short, tested code.\n" * 4,
    ("orchestrator", "v1"): (
        "You coordinate sub-agents. Split the task, give each sub-agent one file, merge the results, and check "
        "that every function has a test. Never delete files. Report progress after each step.\n"
    )
    * 6,
    ("tool_user", "v1"): "You call tools to inspect and change a repository. Think before each call.\n" * 3,
}

_WORDS = [
    "parse",
    "read",
    "write",
    "file",
    "config",
    "path",
    "test",
    "json",
    "list",
    "dict",
    "value",
    "key",
    "error",
    "retry",
    "cache",
    "session",
    "token",
    "block",
    "agent",
    "tool",
    "result",
    "summary",
    "module",
    "function",
    "class",
    "return",
    "import",
    "update",
    "check",
]
_TOOLS = (
    [f"{name}(path) -> str" for name in ("read_file", "list_dir", "grep", "stat")]
    + [f"{name}(path, text)" for name in ("write_file", "append_file", "patch")]
    + ["run(cmd) -> int", "search(query) -> list", "fetch(url) -> str", "git_diff() -> str"]
)


@dataclass(frozen=True)
class TraceEvent:
    t: float
    session: str
    kind: str
    text: str = ""
    system: str | None = None
    tools: tuple[str, ...] = field(default_factory=tuple)
    parent: str | None = None
    max_new_tokens: int = 0

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConfigError(f"event kind {self.kind!r} is not one of {KINDS}")
        if self.kind == "open" and (not self.system or "@" not in self.system):
            raise ConfigError(f"an open event needs system='name@version', got {self.system!r}")
        if self.kind == "fork" and not self.parent:
            raise ConfigError("a fork event needs a parent session")
        if self.kind == "generate" and self.max_new_tokens <= 0:
            raise ConfigError("a generate event needs max_new_tokens > 0")
        if not isinstance(self.t, (int, float)) or self.t < 0:
            raise ConfigError(f"event time must be a number >= 0, got {self.t!r}")

    def to_json(self) -> str:
        data = asdict(self)
        data["tools"] = list(self.tools)
        return json.dumps(data, sort_keys=True)


def _sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n)) + ".\n"


def _chat(rng: random.Random, scale: float) -> list[TraceEvent]:
    events, t = [], 0.0
    sessions = max(1, round(12 * scale))
    for s in range(sessions):
        sid, version = f"chat{s}", "v1" if s < sessions / 2 else "v2"
        t += rng.expovariate(1.0)
        events.append(TraceEvent(t, sid, "open", system=f"assistant@{version}"))
        turns = rng.randint(2, 5)
        for turn in range(turns):
            t += rng.expovariate(1 / 20)  # idle gap: the user reads and types
            events.append(TraceEvent(t, sid, "user", _sentence(rng, rng.randint(6, 20))))
            events.append(TraceEvent(t, sid, "generate", max_new_tokens=rng.randint(8, 24)))
            if turn == 3:
                events.append(TraceEvent(t, sid, "compact", "Summary: " + _sentence(rng, 10)))
        events.append(TraceEvent(t, sid, "close"))
    return events


def _multi_agent(rng: random.Random, scale: float) -> list[TraceEvent]:
    events, t = [], 0.0
    for m in range(max(1, round(3 * scale))):
        main = f"main{m}"
        t += rng.expovariate(0.5)
        events.append(TraceEvent(t, main, "open", system="orchestrator@v1", tools=tuple(_TOOLS[:4])))
        events.append(TraceEvent(t, main, "user", "Task brief: " + _sentence(rng, 30)))
        subs = [f"{main}.sub{i}" for i in range(rng.randint(3, 8))]
        for sub in subs:
            events.append(TraceEvent(t, sub, "fork", parent=main))
            events.append(TraceEvent(t, sub, "user", "Your part: " + _sentence(rng, 8)))
            events.append(TraceEvent(t, sub, "generate", max_new_tokens=rng.randint(12, 32)))
        for sub in subs:
            t += rng.expovariate(2.0)
            events.append(TraceEvent(t, main, "tool_result", f"{sub} done: " + _sentence(rng, 6)))
            events.append(TraceEvent(t, sub, "close"))
        events.append(TraceEvent(t, main, "generate", max_new_tokens=24))
        events.append(TraceEvent(t, main, "close"))
    return events


def _tool_heavy(rng: random.Random, scale: float, change_every: int = 6) -> list[TraceEvent]:
    """Tool sets drawn from a window over the tool list that moves every ``change_every`` sessions."""
    events, t = [], 0.0
    for s in range(max(1, round(10 * scale))):
        sid = f"tools{s}"
        window = (s // change_every) % 4
        tools = tuple(_TOOLS[window : window + 6])
        t += rng.expovariate(1.0)
        events.append(TraceEvent(t, sid, "open", system="tool_user@v1", tools=tools))
        events.append(TraceEvent(t, sid, "user", _sentence(rng, 12)))
        for _ in range(rng.randint(2, 6)):
            events.append(TraceEvent(t, sid, "generate", max_new_tokens=rng.randint(6, 16)))
            t += rng.expovariate(4.0)
            events.append(TraceEvent(t, sid, "tool_result", _sentence(rng, rng.randint(10, 40))))
        events.append(TraceEvent(t, sid, "generate", max_new_tokens=16))
        events.append(TraceEvent(t, sid, "close"))
    return events


_BUILDERS = {"chat": _chat, "multi_agent": _multi_agent, "tool_heavy": _tool_heavy}
TRACES = tuple(_BUILDERS)


def make_trace(name: str, *, seed: int = 0, scale: float = 1.0) -> list[TraceEvent]:
    """One of :data:`TRACES`, seeded; ``scale`` multiplies the number of sessions."""
    if name not in _BUILDERS:
        raise ConfigError(f"unknown trace {name!r}: expected one of {TRACES}")
    if scale <= 0:
        raise ConfigError(f"scale must be positive, got {scale}")
    events = _BUILDERS[name](random.Random(f"{name}:{seed}"), scale)
    return sorted(events, key=lambda e: e.t)  # stable: same-time events keep their order


def save_trace(events: Iterable[TraceEvent], path: str | Path) -> Path:
    """Write a trace as JSON lines (one event per line)."""
    path = Path(path)
    path.write_text("".join(e.to_json() + "\n" for e in events), encoding="utf-8")
    return path


def load_trace(path: str | Path) -> list[TraceEvent]:
    """Read and validate a JSON-lines trace; a bad line raises :class:`ConfigError` naming it."""
    events = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            data: dict[str, Any] = json.loads(line)
            data["tools"] = tuple(data.get("tools", ()))
            events.append(TraceEvent(**data))
        except (ValueError, TypeError, ConfigError) as exc:
            raise ConfigError(f"{path}:{number}: not a valid trace event ({exc})") from None
    return events


def replay(events: Iterable[TraceEvent], manager: Any) -> dict[str, Any]:
    """Run a trace through a :class:`~memos_ref.session.SessionManager`; returns counts for benchmarks.

    The manager is duck-typed (this module sits below the session layer and imports nothing from it): segment
    kinds are passed by their string values, which ``CacheSession.append`` accepts."""
    for (name, version), text in SYSTEM_PROMPTS.items():
        if (name, version) not in manager.system_prompts:
            manager.register_system_prompt(name, version, text)
    sessions: dict[str, Any] = {}
    peak_blocks, generated = 0, 0
    for event in events:
        if event.kind == "open":
            name, version = event.system.split("@", 1)
            sessions[event.session] = manager.new_session(system=(name, version), tools=list(event.tools) or None)
        elif event.kind == "fork":
            (sessions[event.session],) = sessions[event.parent].fork(1)
        elif event.kind in ("user", "tool_result"):
            sessions[event.session].append(event.kind, f"{event.kind}@{event.t:.3f}", event.text)
        elif event.kind == "generate":
            sessions[event.session].generate(event.max_new_tokens)
            generated += event.max_new_tokens
        elif event.kind == "compact":
            sessions[event.session].compact(event.text)
        elif event.kind == "close":
            sessions.pop(event.session).close()
        peak_blocks = max(peak_blocks, manager.kv.allocator.num_active)
    all_sessions = list(sessions.values())
    for session in all_sessions:
        session.close()
    stats = manager.kv.stats()
    return {"peak_blocks": peak_blocks, "generated_tokens": generated, **stats}
