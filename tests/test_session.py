"""Sessions: shared system prompts and tool sets, fork, compaction, memory injection, save/load."""

from __future__ import annotations

import pytest
import torch

from memos_ref.caches import ContiguousCache
from memos_ref.errors import ConfigError, CorruptCacheError, ModelMismatchError, UseAfterFreeError
from memos_ref.session import SegmentKind, SessionManager, tool_set_key

SYSTEM = "You are a careful Python agent. Read files before editing them; keep functions small.\n" * 3
MEMORY_1 = "The user's project keeps its settings in config/settings.json.\n"
MEMORY_2 = "Tests run with `make test`; the CI machine has no GPU.\n"


@pytest.fixture
def manager(shipped_pair):
    ours, _ = shipped_pair
    mgr = SessionManager(ours, num_blocks=512)
    mgr.register_system_prompt("agent", "v1", SYSTEM)
    mgr.register_system_prompt("agent", "v2", SYSTEM.replace("careful", "fast"))
    return mgr


def _solo(manager, token_ids, n):
    """Greedy continuation of ``token_ids`` computed from scratch with a dense cache (the oracle)."""
    out = manager.model.generate(torch.tensor([token_ids]), n, ContiguousCache())
    return manager.tok.decode(out[0, len(token_ids) :])


def _reply(manager, session, n):
    marker = manager.encode_segment(SegmentKind.ASSISTANT, "")
    return _solo(manager, session.token_ids + marker, n)


def test_same_system_prompt_version_shares_blocks_new_version_does_not(manager):
    a = manager.new_session(system=("agent", "v1"))
    b = manager.new_session(system=("agent", "v1"))
    c = manager.new_session(system=("agent", "v2"))
    full = (len(a.token_ids) - 1) // 16
    table_a, table_b = a.cache.sequences[0].block_table, b.cache.sequences[0].block_table
    assert table_b[:full] == table_a[:full] and b.prefill_reused == full * 16
    assert not set(c.cache.sequences[0].block_table) & set(table_a)  # "fast" changes the first block
    manager.kv.check()
    a.close()
    b.close()
    assert all(manager.kv.allocator.refcount[blk] == 0 for blk in table_a[:full])  # released: cached, evictable
    assert manager.kv.allocator.num_cached >= full
    with pytest.raises(ConfigError, match="not registered"):
        manager.new_session(system=("agent", "v9"))
    with pytest.raises(ConfigError, match="already registered"):
        manager.register_system_prompt("agent", "v1", "different text")


def test_tool_sets_are_keyed_by_content_not_order(manager):
    tools = ["read_file(path) -> str", "write_file(path, text)", "run(cmd) -> int"]
    assert tool_set_key(tools) == tool_set_key(list(reversed(tools)))
    a = manager.new_session(system=("agent", "v1"), tools=tools)
    b = manager.new_session(system=("agent", "v1"), tools=list(reversed(tools)))
    assert a.token_ids == b.token_ids and b.prefill_computed < 16
    described = a.segments()
    assert [d["kind"] for d in described] == ["system", "tools"]
    assert described[1]["seg_id"] == tool_set_key(tools) and described[1]["blocks"]


def test_session_generation_equals_solo_generation_and_fork_shares(manager):
    session = manager.new_session(system=("agent", "v1"))
    session.append(SegmentKind.USER, "t1", "Write a function that reads a JSON file.\n")
    expected = _reply(manager, session, 24)
    active_before = manager.kv.allocator.num_active
    subs = session.fork(3)
    assert manager.kv.allocator.num_active == active_before  # nothing copied
    assert all(sub.generate(24) == expected for sub in subs)
    assert session.generate(24) == expected
    assert session.cache.get_seq_length() == len(session.token_ids)
    manager.kv.check()


def test_compaction_switches_atomically_then_releases(manager):
    session = manager.new_session(system=("agent", "v1"))
    for turn in range(3):
        session.append(SegmentKind.USER, f"u{turn}", "Please refactor the parser module and add tests. " * 4)
        session.generate(8, seg_id=f"a{turn}")
    long_tokens = len(session.token_ids)
    session.compact("Summary: the user wants the parser refactored with tests; work has started.\n")
    names = [name for name, _ in session.events]
    assert names == ["compact_built", "switched", "released"]
    built, released = session.events[0][1], session.events[2][1]
    assert built["blocks_active"] > built["blocks_before"]  # both sets exist only while building
    assert released["blocks_active"] < built["blocks_active"] and released["blocks"] > 0
    # "returned" counts what the pool got back; the shared system-prompt block stays with the new session
    assert released["returned"] == built["blocks_active"] - released["blocks_active"] > 0
    assert released["returned"] < released["blocks"]
    assert len(session.token_ids) < long_tokens
    assert [s.kind for s in session.segment_list] == [SegmentKind.SYSTEM, SegmentKind.SUMMARY]
    manager.kv.check()


def test_compacted_session_continues_like_a_fresh_one(manager):
    session = manager.new_session(system=("agent", "v1"))
    session.append(SegmentKind.USER, "u0", "Long discussion about files. " * 6)
    session.compact("Summary: discussed files.\n")
    expected = _reply(manager, session, 20)
    assert session.generate(20) == expected


def test_memory_injection_equals_memory_in_the_prompt_and_never_mutates_it(manager):
    memory = manager.build_memory("settings", MEMORY_1)
    stored = [tuple(t.clone() for t in memory.cache.sequences[0].to_dense(layer)) for layer in range(4)]
    session = manager.new_session(memories=[memory])
    assert session.prefill_reused == len(memory.token_ids) and session.prefill_computed == 0
    session.append(SegmentKind.USER, "q", "Where are the settings?\n")
    expected = _reply(manager, session, 24)  # the same tokens, computed from scratch with the text in the prompt
    assert session.generate(24) == expected
    for i in range(100):  # 100 generations from the memory; it must stay byte-identical
        other = manager.new_session(memories=[memory])
        other.append(SegmentKind.USER, f"q{i}", f"question {i}\n")
        other.generate(2)
        other.close()
    for layer in range(4):
        k, v = memory.cache.sequences[0].to_dense(layer)
        assert torch.equal(k, stored[layer][0]) and torch.equal(v, stored[layer][1])
    manager.kv.check()


def test_several_memories_injected_in_order(manager):
    m1 = manager.build_memory("settings", MEMORY_1)
    m2 = manager.build_memory("ci", MEMORY_2, after=m1)
    session = manager.new_session(memories=[m1, m2])
    assert [s.seg_id for s in session.segment_list] == ["settings", "ci"]
    session.append(SegmentKind.USER, "q", "How do I run the tests?\n")
    expected = _reply(manager, session, 16)
    assert session.generate(16) == expected
    with pytest.raises(ConfigError, match="in order"):
        manager.new_session(memories=[m2, m1])
    with pytest.raises(ConfigError, match="already exists"):
        manager.build_memory("ci", "again")


def test_save_load_round_trip_and_damaged_files(manager, shipped_pair, tmp_path):
    session = manager.new_session(system=("agent", "v1"))
    session.append(SegmentKind.USER, "u", "Summarise the repository layout.\n")
    path = session.save(tmp_path / "s1")
    restored = manager.load(path)
    assert restored.token_ids == session.token_ids and restored.segment_list == session.segment_list
    for layer in range(4):
        a, b = session.cache.sequences[0].to_dense(layer), restored.cache.sequences[0].to_dense(layer)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert restored.generate(16) == session.generate(16)
    # corrupt: flip one byte of the tensor file
    data = bytearray(path.with_suffix(".safetensors").read_bytes())
    data[-5] ^= 0xFF
    path.with_suffix(".safetensors").write_bytes(bytes(data))
    with pytest.raises(CorruptCacheError, match="checksum"):
        manager.load(path)
    # truncated
    path.with_suffix(".safetensors").write_bytes(bytes(data[:100]))
    with pytest.raises(CorruptCacheError):
        manager.load(path)
    # another model
    ours, _ = shipped_pair
    other = SessionManager(ours, num_blocks=64, fingerprint="someone-else")
    session.save(tmp_path / "s2")
    with pytest.raises(ModelMismatchError, match="someone-else"):
        other.load(tmp_path / "s2")
    path.with_suffix(".json").write_text("{not json")
    with pytest.raises(CorruptCacheError, match="manifest"):
        manager.load(path)


def test_failures_leave_the_session_as_it_was_and_closed_sessions_refuse(shipped_pair):
    from memos_ref.errors import OutOfBlocksError

    ours, _ = shipped_pair
    small = SessionManager(ours, num_blocks=6)
    small.register_system_prompt("agent", "v1", "short\n")
    session = small.new_session(system=("agent", "v1"))
    before = (list(session.token_ids), session.cache.get_seq_length())
    with pytest.raises(OutOfBlocksError):
        session.generate(200)  # needs more blocks than the pool has
    assert (session.token_ids, session.cache.get_seq_length()) == before
    with pytest.raises(OutOfBlocksError):
        session.append(SegmentKind.USER, "u", "x" * 200)
    assert (session.token_ids, session.cache.get_seq_length()) == before
    small.kv.check()
    reply = session.generate(8)  # still usable, and right
    assert reply == _solo(small, before[0] + small.encode_segment(SegmentKind.ASSISTANT, ""), 8)
    with pytest.raises(OutOfBlocksError):
        small.new_session(system=("agent", "v1")).compact("y" * 200)
    small.kv.check()
    session.close()
    with pytest.raises(UseAfterFreeError, match="closed"):
        session.append(SegmentKind.USER, "u", "hi")


def test_compaction_keeps_injected_memories(manager):
    memory = manager.build_memory("settings", MEMORY_1)
    session = manager.new_session(memories=[memory])
    session.append(SegmentKind.USER, "u", "Some long talk. " * 10)
    session.compact("Summary: talked.\n")
    assert [s.kind for s in session.segment_list] == [SegmentKind.MEMORY, SegmentKind.SUMMARY]
    assert session.token_ids[: len(memory.token_ids)] == list(memory.token_ids)


def test_loaded_kv_is_not_offered_to_other_sessions(manager, tmp_path):
    session = manager.new_session(system=("agent", "v1"))
    path = session.save(tmp_path / "s")
    session.close()
    for block in list(manager.kv.allocator.cached_blocks()):  # forget everything cached so far
        manager.kv.prefix_cache.forget(block)
    restored = manager.load(path)
    hits_before = manager.kv.prefix_cache.hit_tokens
    fresh = manager.new_session(system=("agent", "v1"))
    assert manager.kv.prefix_cache.hit_tokens == hits_before  # nothing of the file was reused
    assert not set(fresh.cache.sequences[0].block_table) & set(restored.cache.sequences[0].block_table)


def _state(manager):
    return manager.kv.allocator.num_active, manager.kv.allocator.num_cached, sorted(manager.memories)


def test_contradictory_session_and_memory_arguments_are_refused_and_change_nothing(manager):
    memory = manager.build_memory("notes", "The parser lives in src/parse.py.\n")
    before = _state(manager)
    refusals = [
        (lambda: manager.new_session(system=("agent", "v1"), memories=[memory]), "takes its prefix from them"),
        (lambda: manager.new_session(system=("agent", "v9")), "is not registered"),
        (lambda: manager.build_memory("more", "x", after=memory, system=("agent", "v1")), "takes its system prompt"),
        (lambda: manager.build_memory("other", "x", system=("nobody", "v1")), "is not registered"),
        (lambda: manager.build_memory("notes", "again"), "already exists"),
    ]
    for call, message in refusals:
        with pytest.raises(ConfigError, match=message):
            call()
        assert _state(manager) == before
    manager.kv.check()


def test_a_memory_whose_build_fails_closes_its_session_and_registers_nothing(manager, monkeypatch):
    from memos_ref.session.session import CacheSession

    before = _state(manager)

    def broken(self, *args, **kwargs):
        raise RuntimeError("tokenizer exploded")

    monkeypatch.setattr(CacheSession, "append", broken)
    with pytest.raises(RuntimeError, match="exploded"):
        manager.build_memory("docs", "text", system=("agent", "v1"))
    assert "docs" not in manager.memories
    active, _cached, names = _state(manager)
    assert (active, names) == (before[0], before[2])  # the system prompt's blocks went back (cached for reuse)
    manager.kv.check()


def test_manager_stats_are_its_pools(manager):
    session = manager.new_session(system=("agent", "v1"))
    session.append(SegmentKind.USER, "u0", "hello\n")
    assert manager.stats() == manager.kv.stats() and manager.stats()["blocks_active"] > 0


def test_prefetch_brings_up_the_predicted_next_session_only_when_it_is_suspended(shipped_pair):
    """After each call the manager learns which session follows which (seed 001 §3.1's Markov prefetch) and asks
    the tiers for the predicted next session's blocks — only when that session is suspended (a resident one has
    its blocks already)."""
    from memos_ref.tiering.backends import HostMemoryBackend
    from memos_ref.tiering.prefetch import MarkovPredictor
    from memos_ref.tiering.store import Tier, TierStore

    ours, _ = shipped_pair
    mgr = SessionManager(ours, num_blocks=256, fingerprint="prefetch-test000")
    mgr.register_system_prompt("agent", "v1", SYSTEM)
    tm = mgr.enable_tiering(
        TierStore([Tier(HostMemoryBackend(1 << 24))], spec=mgr.spec, fingerprint="prefetch-test000"),
        prefetch=MarkovPredictor(window=4, threshold=0.5),
        prefetch_max_blocks=3,
    )
    calls = []
    tm.prefetch = lambda ids, salt, n: calls.append((list(ids), n))
    a, b = mgr.new_session(system=("agent", "v1")), mgr.new_session(system=("agent", "v1"))
    for turn in range(3):  # a, b, a, b, ...: after a comes b
        a.append(SegmentKind.USER, f"a{turn}", "Check the logs.\n")
        b.append(SegmentKind.USER, f"b{turn}", "Write the tests.\n")
    assert calls == []  # b was resident every time
    b.suspend()
    a.append(SegmentKind.USER, "a3", "And the docs.\n")
    assert calls == [(b.token_ids, 3)]


def test_blocks_shared_counts_what_forks_hold_too(manager):
    session = manager.new_session(system=("agent", "v1"))
    session.append(SegmentKind.USER, "u", "Summarise the repository layout, file by file.\n" * 3)
    alone = session.blocks_shared()
    (child,) = session.fork(1)
    shared = session.blocks_shared()
    assert shared == len(set(session.cache.sequences[0].block_table)) > alone  # a fork holds every block
    assert child.blocks_shared() == shared
    child.close()
    assert session.blocks_shared() == alone
    session.suspend()
    assert session.blocks_shared() == 0  # a suspended session holds no device blocks


def test_loading_a_missing_session_file_is_a_corrupt_cache_error(manager, tmp_path):
    session = manager.new_session(system=("agent", "v1"))
    path = session.save(tmp_path / "s")
    path.with_suffix(".safetensors").unlink()
    before = manager.kv.allocator.num_active
    with pytest.raises(CorruptCacheError, match="cannot open"):
        manager.load(path)
    assert manager.kv.allocator.num_active == before
