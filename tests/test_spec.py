"""KVSpec: byte arithmetic on real model configs (written out as dicts; nothing downloaded)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from memos_ref.errors import ConfigError
from memos_ref.spec import KVSpec

# Abridged config.json files of real models; the expected bytes per token are worked out by hand:
# 2 (K and V) x layers x kv_heads x head_dim x bytes per element.
REAL_CONFIGS = {
    "llama-2-7b": (
        dict(model_type="llama", num_hidden_layers=32, num_attention_heads=32, hidden_size=4096, torch_dtype="float16"),
        2 * 32 * 32 * 128 * 2,  # 524,288 = 512 KiB: seed 000's "about 0.5 MB per token"
    ),
    "llama-3-8b": (
        dict(
            model_type="llama",
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            hidden_size=4096,
            torch_dtype="bfloat16",
        ),
        2 * 32 * 8 * 128 * 2,  # 131,072
    ),
    "mistral-7b": (
        dict(
            model_type="mistral",
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            hidden_size=4096,
            sliding_window=None,
            torch_dtype="bfloat16",
        ),
        131_072,
    ),
    "qwen2.5-7b": (
        dict(
            model_type="qwen2",
            num_hidden_layers=28,
            num_attention_heads=28,
            num_key_value_heads=4,
            hidden_size=3584,
            torch_dtype="bfloat16",
        ),
        2 * 28 * 4 * 128 * 2,  # 57,344
    ),
    "qwen3-8b": (
        dict(
            model_type="qwen3",
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            hidden_size=4096,
            head_dim=128,
            torch_dtype="bfloat16",
        ),
        2 * 36 * 8 * 128 * 2,  # 147,456
    ),
    "gemma-7b": (
        dict(
            model_type="gemma",
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=16,
            hidden_size=3072,
            head_dim=256,  # explicit: 3072 / 16 would give 192
            torch_dtype="bfloat16",
        ),
        2 * 28 * 16 * 256 * 2,  # 458,752
    ),
    "gemma-2b": (
        dict(
            model_type="gemma",
            num_hidden_layers=18,
            num_attention_heads=8,
            num_key_value_heads=1,
            hidden_size=2048,
            head_dim=256,
            torch_dtype="bfloat16",
        ),
        2 * 18 * 1 * 256 * 2,  # 18,432 (multi-query attention)
    ),
    "phi-3-mini": (
        dict(
            model_type="phi3",
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=32,
            hidden_size=3072,
            torch_dtype="bfloat16",
        ),
        2 * 32 * 32 * 96 * 2,  # 393,216
    ),
    "gpt2": (
        dict(model_type="gpt2", n_layer=12, n_head=12, n_embd=768, torch_dtype="float32"),
        2 * 12 * 12 * 64 * 4,  # 73,728
    ),
}


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_bytes_per_token_on_real_configs(name):
    config, expected = REAL_CONFIGS[name]
    assert KVSpec.from_hf_config(config).bytes_per_token == expected


def test_llama2_7b_is_exactly_512_kib_per_token_and_1000_tokens_is_500_mib():
    spec = KVSpec.from_hf_config(REAL_CONFIGS["llama-2-7b"][0])
    assert spec.bytes_per_token == 524_288
    assert spec.bytes_for(1000) == 524_288_000  # 500 MiB, 524 MB: the seed's "1000 tokens ≈ 500 MB"


def test_gqa_ratio_and_explicit_head_dim():
    spec = KVSpec.from_hf_config(REAL_CONFIGS["llama-3-8b"][0])
    assert (spec.num_kv_heads, spec.head_dim, spec.gqa_ratio) == (8, 128, 4)
    gemma = KVSpec.from_hf_config(REAL_CONFIGS["gemma-7b"][0])
    assert gemma.head_dim == 256


def test_dtype_override_and_block_bytes():
    spec = KVSpec.from_hf_config(REAL_CONFIGS["llama-3-8b"][0], dtype="float32", block_size=64)
    assert spec.dtype == torch.float32
    assert spec.bytes_per_token == 262_144
    assert spec.bytes_per_block == 64 * 262_144
    assert spec.block_shape == (32, 2, 8, 64, 128)


def test_reads_a_transformers_config_object():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64)
    spec = KVSpec.from_hf_config(cfg, dtype="float32")
    assert (spec.num_layers, spec.num_kv_heads, spec.head_dim) == (2, 2, 16)


@pytest.mark.parametrize(
    "config, match",
    [
        (dict(num_attention_heads=32, hidden_size=4096), "num_hidden_layers"),
        (dict(num_hidden_layers=32, hidden_size=4096), "num_attention_heads"),
        (dict(num_hidden_layers=32, num_attention_heads=32), "hidden_size"),
        (dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=5, hidden_size=4096), "multiple"),
        (dict(num_hidden_layers=32, num_attention_heads=30, hidden_size=4096), "divisible"),
        (dict(num_hidden_layers=0, num_attention_heads=32, hidden_size=4096), "positive"),
        (dict(num_hidden_layers=2, num_attention_heads=2, hidden_size=64, torch_dtype="float13"), "dtype"),
    ],
)
def test_bad_configs_are_rejected_with_a_clear_error(config, match):
    with pytest.raises(ConfigError, match=match):
        KVSpec.from_hf_config(config)


@pytest.mark.parametrize(
    "kwargs", [dict(block_size=12), dict(block_size=256), dict(num_layers=0), dict(head_dim=-1), dict(num_q_heads=3)]
)
def test_bad_spec_fields(kwargs):
    base = dict(num_layers=2, num_kv_heads=2, head_dim=8)
    base.update(kwargs)
    with pytest.raises(ConfigError):
        KVSpec(**base)


def test_dict_round_trip_and_tampered_size():
    spec = KVSpec(4, 2, 32, torch.bfloat16, 32, 8)
    assert KVSpec.from_dict(spec.to_dict()) == spec
    bad = spec.to_dict() | {"bytes_per_token": 1}
    with pytest.raises(ConfigError, match="bytes_per_token"):
        KVSpec.from_dict(bad)
    with pytest.raises(ConfigError, match="unknown KVSpec fields"):
        spec.with_(heads=3)


@given(
    layers=st.integers(1, 96),
    kv_heads=st.integers(1, 64),
    head_dim=st.sampled_from([32, 64, 80, 96, 128, 256]),
    dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.int8]),
    block=st.sampled_from([8, 16, 32, 64, 128]),
    tokens=st.integers(0, 100_000),
)
def test_size_identities(layers, kv_heads, head_dim, dtype, block, tokens):
    spec = KVSpec(layers, kv_heads, head_dim, dtype, block)
    element = torch.empty((), dtype=dtype).element_size()
    assert spec.bytes_per_token == 2 * layers * kv_heads * head_dim * element
    assert spec.bytes_per_block == block * spec.bytes_per_token
    blocks = spec.blocks_for(tokens)
    assert (blocks - 1) * block < tokens <= blocks * block or (tokens == 0 and blocks == 0)
    assert spec.bytes_per_token_per_layer == 2 * kv_heads * head_dim * element
