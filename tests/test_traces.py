"""Workload traces: seeded, valid, with the features each is named for; they replay through sessions."""

from __future__ import annotations

import pytest

from memos_ref.errors import ConfigError
from memos_ref.session import SessionManager
from memos_ref.traces import TRACES, TraceEvent, load_trace, make_trace, replay, save_trace


@pytest.mark.parametrize("name", TRACES)
def test_seeded_and_round_trips_through_json_lines(name, tmp_path):
    a, b = make_trace(name, seed=3), make_trace(name, seed=3)
    assert a == b and a != make_trace(name, seed=4)
    path = save_trace(a, tmp_path / f"{name}.jsonl")
    assert load_trace(path) == a
    assert path.read_bytes() == save_trace(b, tmp_path / "again.jsonl").read_bytes()
    assert [e.t for e in a] == sorted(e.t for e in a)
    opened = {e.session for e in a if e.kind in ("open", "fork")}
    assert opened == {e.session for e in a if e.kind == "close"}  # every session is closed


def test_each_trace_has_its_features():
    chat = make_trace("chat")
    assert {e.system for e in chat if e.kind == "open"} == {"assistant@v1", "assistant@v2"}  # a version change
    assert any(e.kind == "compact" for e in chat)
    multi = make_trace("multi_agent")
    forks = [e for e in multi if e.kind == "fork"]
    mains = {e.parent for e in forks}
    assert all(3 <= sum(f.parent == m for f in forks) <= 8 for m in mains)
    tools = make_trace("tool_heavy")
    tool_sets = [e.tools for e in tools if e.kind == "open"]
    assert len(set(tool_sets)) == 2 and tool_sets[:6] == [tool_sets[0]] * 6  # changes every 6 sessions


def test_bad_events_and_lines_are_rejected(tmp_path):
    with pytest.raises(ConfigError, match="kind"):
        TraceEvent(0.0, "s", "explode")
    with pytest.raises(ConfigError, match="name@version"):
        TraceEvent(0.0, "s", "open", system="noversion")
    with pytest.raises(ConfigError, match="unknown trace"):
        make_trace("nope")
    path = tmp_path / "bad.jsonl"
    path.write_text('{"t": 0, "session": "a", "kind": "close"}\n{"t": -1, "session": "a", "kind": "close"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        load_trace(path)


@pytest.mark.parametrize("name", TRACES)
def test_replay_through_sessions_keeps_invariants(name, shipped_pair):
    ours, _ = shipped_pair
    manager = SessionManager(ours, num_blocks=1024)
    trace = make_trace(name, scale=0.34)
    result = replay(trace, manager)
    assert result["generated_tokens"] == sum(e.max_new_tokens for e in trace if e.kind == "generate")
    assert result["peak_blocks"] > 0
    assert manager.kv.allocator.num_active == 0  # every session released its blocks
    manager.kv.check()
    if name != "multi_agent":  # sessions opened later reuse the system prompt's cached blocks
        assert result["prefix_hit_tokens"] > 0


def test_simulated_session_block_hashes_equal_a_real_session_s(shipped_pair):
    """The tiering simulator lays a trace's sessions out as real sessions do (one layout,
    memos_ref.session.segments): same tokens, so the same block hashes as a SessionManager's prefix cache."""
    from memos_ref.tiering.simulate import requests_from_trace
    from memos_ref.traces import SYSTEM_PROMPTS

    ours, _ = shipped_pair
    manager = SessionManager(ours, num_blocks=256)
    for (name, version), text in SYSTEM_PROMPTS.items():
        manager.register_system_prompt(name, version, text)
    tools = ("read_file(path) -> str", "grep(path) -> str")
    events = [
        TraceEvent(0.0, "a", "open", system="tool_user@v1", tools=tools),
        TraceEvent(1.0, "a", "user", "Find the parser and list its tests.\n"),
        TraceEvent(2.0, "b", "fork", parent="a"),
        TraceEvent(3.0, "b", "tool_result", "tests/test_parse.py: 12 tests, all green.\n" * 2),
        TraceEvent(4.0, "a", "compact", "Summary: the parser has twelve tests.\n"),
        TraceEvent(5.0, "a", "user", "Now add one for empty input, please.\n"),
    ]
    requests = requests_from_trace(events, fingerprint=manager.fingerprint)
    sessions = {}
    for e in events:  # the same events through real sessions (traces.replay, without closing them)
        if e.kind == "open":
            name, version = e.system.split("@", 1)
            sessions[e.session] = manager.new_session(system=(name, version), tools=list(e.tools))
        elif e.kind == "fork":
            (sessions[e.session],) = sessions[e.parent].fork(1)
        elif e.kind in ("user", "tool_result"):
            sessions[e.session].append(e.kind, f"{e.kind}@{e.t:.3f}", e.text)
        elif e.kind == "compact":
            sessions[e.session].compact(e.text)
    t = manager.spec.block_size
    for key, session in sessions.items():
        last = [r for r in requests if r.session == key][-1]
        assert last.token_ids == session.token_ids
        table = session.cache.sequences[0].block_table
        real = [manager.kv.allocator.hash_of(b) for b in table[: len(session.token_ids) // t]]
        assert last.hashes == real and all(h is not None for h in real) and len(real) >= 4
        # and the labels the priority policy ranks by are the session's own
        labels = [x["kind"] for x in session.segments() if x["kind"] in ("system", "tools")]
        assert labels == ["system", "tools"] and last.kinds[0] == "system"
