"""Sessions and the engine with a real chat model (SmolLM2-135M-Instruct): segments rendered through its chat
template with exact token boundaries, sub-agents sharing the system prompt's blocks, and greedy generation equal
to transformers' ``generate`` with ``DynamicCache``, token for token."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from memos_ref.chat import TOOLS_HEADER, ChatCodec
from memos_ref.engine import Engine, Request
from memos_ref.errors import ArgumentTypeError, ConfigError
from memos_ref.paged import PagedKV
from memos_ref.session import SegmentKind, SessionManager, tool_set_key

SYSTEM = "You are a concise assistant. Answer in one sentence."
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {"name": "search", "description": "Search the web", "parameters": {"type": "object"}},
    },
]
QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "What color is the sky on a clear day?",
    "Name one planet of the solar system.",
]
MEMORY = "Known facts about the user: name Ada; pet a cat named Tom."
NEW_TOKENS = 12


def _hf_generate(hf, ids: list[int], n: int = NEW_TOKENS) -> list[int]:
    """transformers' greedy generation with a DynamicCache: the oracle (stops at the model's EOS)."""
    from transformers import DynamicCache

    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), cache=DynamicCache(), max_new_tokens=n, do_sample=False)
    return out[0, len(ids) :].tolist()


def _messages(*extra: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, *({"role": r, "content": c} for r, c in extra)]


@pytest.fixture(scope="module")
def codec(smollm2):
    return ChatCodec(smollm2[0])


@pytest.fixture
def manager(smollm2, smollm2_forward):
    mgr = SessionManager(smollm2_forward, num_blocks=48, tokenizer=smollm2[0], fingerprint="test-smollm2")
    mgr.register_system_prompt("agent", "v1", SYSTEM)
    return mgr


# ---------------------------------------------------------------------------------------------- segments
_PIECES = [*"abcXYZ 019.,:;!?'\"-_()[]{}\n\té日本🙂", " the", "ing", "  ", "\n\n", "Paris"]
_TEXT = st.lists(st.sampled_from(_PIECES), max_size=16).map("".join)
_MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "tool"]), "content": _TEXT})


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(messages=st.lists(_MESSAGE, min_size=1, max_size=6), with_tools=st.booleans())
def test_chat_segments_concatenate_to_the_tokens_of_the_rendered_conversation(codec, messages, with_tools):
    messages = codec.with_tools(messages, TOOLS if with_tools else None)
    segments = codec.segments(messages)
    whole = codec.encode(codec.render(messages))
    assert [t for _, ids in segments for t in ids] == whole
    prompt = codec.prompt_ids(messages, add_generation_prompt=True)
    assert prompt == whole + codec.reply_prefix_ids(messages)


def test_chat_codec_renders_tools_as_their_own_system_message_in_any_order(codec):
    assert not codec.tools_in_template  # SmolLM2's template ignores tools=: the codec renders them
    text = codec.render(codec.with_tools(_messages(), TOOLS))
    assert text == codec.render(codec.with_tools(_messages(), list(reversed(TOOLS))))
    assert text.count("<|im_start|>system\n") == 2 and TOOLS_HEADER in text and '"name": "get_weather"' in text


def test_chat_boundary_check_refuses_a_boundary_that_bpe_merges_across(codec):
    codec.check_boundary("<|im_start|>user\nhi<|im_end|>\n", "<|im_start|>assistant\n")  # special token: exact
    assert codec.encode("hello" + "world") != codec.encode("hello") + codec.encode("world")
    with pytest.raises(ConfigError, match="merge across"):
        codec.check_boundary("hello", "world")


def test_chat_manager_refuses_a_tokenizer_it_cannot_use(smollm2_forward):
    with pytest.raises(ArgumentTypeError, match="chat template"):
        SessionManager(smollm2_forward, num_blocks=4, tokenizer=object(), fingerprint="x")

    class Huge:  # a chat tokenizer with more ids than the model's vocabulary
        chat_template = "{{ messages }}"
        eos_token_id = 0
        all_special_tokens = ()

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": []}

        def __len__(self):
            return 10**6

        def apply_chat_template(self, messages, **kw):
            return ""

        def convert_tokens_to_ids(self, token):
            return 0

    with pytest.raises(ConfigError, match="vocabulary"):
        SessionManager(smollm2_forward, num_blocks=4, tokenizer=Huge(), fingerprint="x")


# ---------------------------------------------------------------------------------------------- generation
def test_real_chat_sessions_equal_transformers_generate_and_sub_agents_share_the_system_prompt(smollm2, manager, codec):
    _, hf = smollm2
    main = manager.new_session(system=("agent", "v1"), tools=TOOLS)
    assert [s["kind"] for s in main.segments()] == ["system", "tools"]
    assert main.segments()[1]["seg_id"] == tool_set_key(TOOLS)
    assert main.token_ids == codec.prompt_ids(_messages(), TOOLS, add_generation_prompt=False)

    main.append(SegmentKind.USER, "q0", QUESTIONS[0])
    reply = main.generate(NEW_TOKENS)
    prompt = codec.prompt_ids(_messages(("user", QUESTIONS[0])), TOOLS)
    expected = _hf_generate(hf, prompt)
    assert main.token_ids[: len(prompt)] == prompt  # the session holds exactly the rendered prompt
    assert main.token_ids[len(prompt) : len(prompt) + len(expected)] == expected  # token for token
    assert reply == codec.decode(expected) and "Paris" in reply
    assert main.last_reply["stopped"] == (expected[-1] in codec.stop_ids)
    # the session now holds the rendered assistant message, as the template writes it
    done = _messages(("user", QUESTIONS[0]), ("assistant", reply))
    assert main.token_ids == codec.prompt_ids(done, TOOLS, add_generation_prompt=False)

    # a sub-agent with the same system prompt and tools starts from the prefix cache
    sub = manager.new_session(system=("agent", "v1"), tools=TOOLS)
    t = manager.spec.block_size
    full = main.segments()[1]["stop"] // t
    assert sub.prefill_reused == full * t and sub.prefill_computed == len(sub.token_ids) - full * t
    main_table, sub_table = main.cache.sequences[0].block_table, sub.cache.sequences[0].block_table
    assert sub_table[:full] == main_table[:full] and sub.blocks_shared() == full
    assert all(manager.kv.allocator.refcount[b] == 2 for b in sub_table[:full])
    sub.append(SegmentKind.USER, "q1", QUESTIONS[1])
    sub_reply = sub.generate(NEW_TOKENS)
    sub_prompt = codec.prompt_ids(_messages(("user", QUESTIONS[1])), TOOLS)
    sub_expected = _hf_generate(hf, sub_prompt)
    assert sub.token_ids[len(sub_prompt) : len(sub_prompt) + len(sub_expected)] == sub_expected
    assert sub_reply == codec.decode(sub_expected)

    # a forked sub-agent continues the main agent's conversation, sharing all of it
    (fork,) = main.fork(1)
    fork.append(SegmentKind.USER, "q2", QUESTIONS[2])
    fork_reply = fork.generate(NEW_TOKENS)
    fork_prompt = codec.prompt_ids([*done, {"role": "user", "content": QUESTIONS[2]}], TOOLS)
    assert fork.token_ids[: len(fork_prompt)] == fork_prompt
    assert fork_reply == codec.decode(_hf_generate(hf, fork_prompt))
    manager.kv.check()
    for session in (main, sub, fork):
        session.close()
    assert manager.kv.allocator.num_active == 0


def test_real_chat_memory_injection_equals_the_memory_in_the_prompt(smollm2, manager, codec):
    _, hf = smollm2
    memory = manager.build_memory("ada", MEMORY, system=("agent", "v1"), tools=TOOLS)
    assert [s.kind for s in memory.segments] == ["system", "tools", "memory"]
    stored = [t.clone() for t in memory.cache.sequences[0].to_dense(0)]
    session = manager.new_session(memories=[memory])
    assert session.prefill_reused == len(memory.token_ids) and session.prefill_computed == 0
    session.append(SegmentKind.USER, "q", "What is the name of my cat?")
    reply = session.generate(NEW_TOKENS)
    prompt = codec.prompt_ids(_messages(("system", MEMORY), ("user", "What is the name of my cat?")), TOOLS)
    assert session.token_ids[: len(prompt)] == prompt
    assert reply == codec.decode(_hf_generate(hf, prompt))
    assert all(torch.equal(a, b) for a, b in zip(stored, memory.cache.sequences[0].to_dense(0)))
    # a session started without the memory still shares the system prompt's blocks with it
    plain = manager.new_session(system=("agent", "v1"), tools=TOOLS)
    assert plain.prefill_reused >= manager.spec.block_size and plain.blocks_shared() > 0
    manager.kv.check()


def test_real_chat_compaction_keeps_system_and_tools_and_renders_the_summary(manager, codec):
    session = manager.new_session(system=("agent", "v1"), tools=TOOLS)
    session.append(SegmentKind.USER, "q", QUESTIONS[2])
    session.generate(4)
    session.compact("Summary: the user asked for a planet.")
    assert [s["kind"] for s in session.segments()] == ["system", "tools", "summary"]
    expected = codec.prompt_ids(
        _messages(("system", "Summary: the user asked for a planet.")), TOOLS, add_generation_prompt=False
    )
    assert session.token_ids == expected
    manager.kv.check()


def test_real_chat_engine_equals_transformers_generate_and_reuses_the_shared_prefix(smollm2, smollm2_forward, codec):
    _, hf = smollm2
    kv = PagedKV(smollm2_forward.kv_spec(block_size=16), 48, fingerprint="test-smollm2-engine")
    engine = Engine(smollm2_forward, kv, max_batch=4)
    prompts = [codec.prompt_ids(_messages(("user", q)), TOOLS) for q in QUESTIONS[:2]]
    first = engine.submit(Request(prompts[0], NEW_TOKENS, stop_ids=codec.stop_ids))
    engine.run()  # the first request registers the shared system prompt + tools blocks
    second = engine.submit(Request(prompts[1], NEW_TOKENS, stop_ids=codec.stop_ids))
    engine.run()
    for request, prompt in zip((first, second), prompts):
        assert not request.failed and request.output == _hf_generate(hf, prompt)
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)  # system prompt, tools, "user\n..."
    assert common > len(codec.prompt_ids(_messages(), TOOLS, add_generation_prompt=False))
    assert second.stats.reused_tokens == common // 16 * 16  # every full block of the common prefix
    kv.check()


def test_real_chat_demo_agents_share_blocks_and_answer_as_transformers_does(smollm2, smollm2_forward):
    from memos_ref.demo import CHAT_AGENTS, run_chat_demo

    tok, hf = smollm2
    result = run_chat_demo(smollm2_forward, tok, new_tokens=4, fingerprint="test-smollm2-demo")
    rows = {row["agent"]: row for row in result["rows"]}
    assert list(rows) == [name for name, _, _ in CHAT_AGENTS]
    assert rows["main"]["reused tokens"] == 0  # the first agent computes the system prompt and tools
    for name, row in rows.items():
        session = result["sessions"][name]
        prompt = session.token_ids[: row["prompt tokens"]]
        expected = _hf_generate(hf, prompt, 4)
        assert session.token_ids[len(prompt) : len(prompt) + len(expected)] == expected
        assert row["answer"] == tok.decode(expected, skip_special_tokens=True)
        assert row["blocks shared"] > 0 and row["TTFT ms"] > 0
        if name != "main":
            assert row["reused tokens"] >= 16 * 5  # at least the system prompt's and tools' full blocks
    result["manager"].kv.check()
