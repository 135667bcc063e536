"""The Orin memory planner: parameter counts against real models, the 1 MiB block rule, budgets, properties."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from memos_edge.devices import MODELS, PROFILES, OrinProfile
from memos_edge.plan import GIB, MIB, count_parameters, main, plan, tokens_per_block_for

from memos_ref.errors import ConfigError
from memos_ref.spec import KVSpec


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_parameter_count_matches_transformers(kind):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    cfg = dict(
        vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, tie_word_embeddings=False,
    )  # fmt: skip
    model = (LlamaForCausalLM(LlamaConfig(**cfg)) if kind == "llama" else Qwen2ForCausalLM(Qwen2Config(**cfg))).to(
        torch.float32
    )
    real = sum(p.numel() for p in model.parameters())
    assert sum(count_parameters({**cfg, "model_type": kind}).values()) == real


def test_known_models_and_the_1_mib_rule():
    p = plan("llama-2-7b", "orin-nx-16gb", weights="int4", kv_dtype="fp16")
    assert p.parameters == 6_738_415_616  # Llama-2-7B's published count
    assert p.tokens_per_block == 64 and p.layer_slab_bytes == MIB  # 2·32·64·128·2 bytes exactly
    assert p.block_bytes == 32 * MIB and p.kernel_page_bytes == MIB // 2
    # seed 001 §6.2: "16 GB Orin supports 8k context" for a 7B model with INT4 weights
    assert p.kv_tokens >= 8192
    assert plan("llama-2-7b", "orin-nx-16gb", weights="int4", kv_dtype="int8").tokens_per_block == 128
    l3 = plan("llama-3-8b", "orin-agx-64gb", weights="int4")
    assert l3.parameters == 8_030_261_248  # Llama-3-8B's published count
    assert l3.tokens_per_block == 128 and "clamped from 256" in l3.granularity
    # TensorRT-LLM's Jetson README measured ~35 tok/s decode for Llama-3-8B INT4 on AGX Orin 64GB: a real
    # measurement must sit below the bandwidth bound
    assert 35 < l3.decode_tokens_per_s_bound["batch1_ctx1024"] < 60


def test_impossible_requests_are_refused():
    with pytest.raises(ConfigError, match="FP8 KV needs sm_89"):
        plan("llama-3-8b", "orin-agx-64gb", kv_dtype="fp8")
    with pytest.raises(ConfigError, match="unknown device"):
        plan("llama-3-8b", "orin-tx2")
    with pytest.raises(ConfigError, match="expected one of"):
        plan("no-such-model", "orin-nx-16gb")
    p = plan("llama-3-8b", "orin-nano-8gb", weights="fp16")  # 16 GB of weights in 8 GB: no KV at all
    assert p.free_bytes < 0 and p.blocks == 0 and p.kv_budget_bytes == 0


@given(
    st.integers(1, 64), st.sampled_from([1, 2, 4, 8, 16, 32]), st.sampled_from([32, 64, 80, 128, 256]),
    st.sampled_from(["float16", "int8"]),
)  # fmt: skip
@settings(max_examples=60, deadline=None)
def test_tokens_per_block_is_a_power_of_two_in_range(layers, heads, head_dim, dtype):
    spec = KVSpec(num_layers=layers, num_kv_heads=heads, head_dim=head_dim, dtype=dtype)
    t, _ = tokens_per_block_for(spec)
    assert 8 <= t <= 128 and t & (t - 1) == 0
    slab = 2 * heads * head_dim * spec.dtype.itemsize * t
    assert slab <= MIB or t == 8  # at most 1 MiB unless the kernel's minimum forces more


@given(st.floats(4, 128), st.floats(4, 128), st.sampled_from(sorted(MODELS)), st.sampled_from(["fp16", "int8"]))
@settings(max_examples=60, deadline=None)
def test_monotone_in_memory_and_never_over_budget(m1, m2, model, kv):
    small, large = sorted((m1, m2))
    a = plan(model, OrinProfile("a", small, 8, 2, 100.0), kv_dtype=kv)
    b = plan(model, OrinProfile("b", large, 8, 2, 100.0), kv_dtype=kv)
    assert a.blocks <= b.blocks and a.kv_tokens <= b.kv_tokens
    for p in (a, b):
        assert p.blocks * p.block_bytes <= p.kv_budget_bytes
        assert p.kv_budget_bytes <= max(0, p.free_bytes)
        assert all(c <= p.kv_tokens for c in p.max_context_by_batch.values())


def test_cli_json(capsys):
    assert main(["--model", "qwen2.5-7b", "--device", "orin-nx-8gb", "--weights", "int4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["device"] == "orin-nx-8gb" and out["tokens_per_block"] == 128
    assert out["weight_bytes"] < 8 * GIB and set(PROFILES) >= {out["device"]}
