"""KVSpec: byte arithmetic on real model configs (written out as dicts; nothing downloaded)."""

from __future__ import annotations

import warnings

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


# ----------------------------------------------------------------------------- dtype, refused models (issue 13.7/8)
def test_a_config_without_dtype_gives_the_dtype_a_model_built_from_it_has():
    from transformers import LlamaConfig, LlamaForCausalLM

    from memos_ref.hf import PagedCache
    from memos_ref.paged import PagedKV

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    assert config.dtype is None
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    spec = KVSpec.from_hf_config(config)
    assert spec.dtype == torch.get_default_dtype() == next(model.parameters()).dtype  # not float16
    ids = torch.tensor([[1, 2, 3, 4]])
    out = model.generate(ids, cache=PagedCache(PagedKV(spec, 8)), max_new_tokens=3, do_sample=False)
    assert out.shape == (1, 7)
    assert KVSpec.from_hf_config(model.to(torch.bfloat16)).dtype == torch.bfloat16  # a model: its parameters
    assert KVSpec.from_hf_config(model, dtype="float16").dtype == torch.float16  # an explicit dtype wins


DEEPSEEK_V3 = dict(  # abridged config.json of deepseek-ai/DeepSeek-V3
    model_type="deepseek_v3",
    num_hidden_layers=61,
    num_attention_heads=128,
    num_key_value_heads=128,
    hidden_size=7168,
    kv_lora_rank=512,
    q_lora_rank=1536,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    torch_dtype="bfloat16",
)
QWEN3_NEXT = dict(  # abridged config.json of Qwen/Qwen3-Next-80B-A3B
    model_type="qwen3_next",
    num_hidden_layers=4,
    num_attention_heads=16,
    num_key_value_heads=2,
    hidden_size=2048,
    head_dim=256,
    layer_types=["linear_attention"] * 3 + ["full_attention"],
    torch_dtype="bfloat16",
)


@pytest.mark.parametrize(
    "config, match",
    [
        (DEEPSEEK_V3, "MLA is not supported"),
        ({**DEEPSEEK_V3, "model_type": "deepseek_v2", "q_lora_rank": None}, "MLA is not supported"),
        ({k: v for k, v in DEEPSEEK_V3.items() if k != "kv_lora_rank"}, "MLA is not supported"),  # K/V widths
        (QWEN3_NEXT, "linear attention is not supported"),
        ({**QWEN3_NEXT, "model_type": "jamba", "layer_types": None}, "linear attention is not supported"),
        ({**QWEN3_NEXT, "model_type": "llama4_text", "layer_types": ["chunked_attention"] * 4}, "chunked_attention"),
    ],
)
def test_unsupported_attention_is_refused_instead_of_a_wrong_geometry(config, match):
    from memos_ref.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match=match):
        KVSpec.from_hf_config(config)


def test_sliding_window_configs_warn_once(monkeypatch):
    from memos_ref import spec as spec_module
    from memos_ref.spec import SlidingWindowMemoryWarning, sliding_window_layers

    monkeypatch.setattr(spec_module, "_warned_sliding", set())
    mistral = dict(
        model_type="mistral",
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        hidden_size=4096,
        sliding_window=4096,
        torch_dtype="bfloat16",
    )
    with pytest.warns(SlidingWindowMemoryWarning, match=r"window 4096, 32 of 32 layers.*keeps every token"):
        KVSpec.from_hf_config(mistral)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        KVSpec.from_hf_config(mistral)  # once
        KVSpec.from_hf_config({**mistral, "model_type": "qwen2", "use_sliding_window": False})  # window unused
    gemma2 = {**mistral, "model_type": "gemma2", "layer_types": ["sliding_attention", "full_attention"] * 16}
    assert sliding_window_layers(gemma2) == (4096, 16)
    with pytest.warns(SlidingWindowMemoryWarning, match="16 of 32 layers"):
        KVSpec.from_hf_config(gemma2)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: KVSpec.from_hf_config(42), "config: expected a PretrainedConfig, a transformers model or a dict"),
        (lambda: KVSpec.from_hf_config(REAL_CONFIGS["gpt2"][0], block_size="16"), "block_size: expected int"),
        (lambda: KVSpec.from_hf_config(REAL_CONFIGS["gpt2"][0], dtype=16), "dtype: expected str or dtype"),
        (lambda: KVSpec("2", 2, 8), "KVSpec.num_layers: expected int, got str"),
        (lambda: KVSpec(2, 2.0, 8), "KVSpec.num_kv_heads: expected int, got float"),
        (lambda: KVSpec(2, 2, 8, block_size="16"), "KVSpec.block_size: expected int, got str"),
        (lambda: KVSpec(2, 2, 8, dtype=3), "dtype: expected str or dtype, got int"),
        (lambda: KVSpec(True, 2, 8), "KVSpec.num_layers: expected int, got bool"),
    ],
)
def test_wrong_argument_types_raise_argument_type_error(call, match):
    from memos_ref.errors import ArgumentTypeError

    with pytest.raises(ArgumentTypeError, match=match):
        call()


_GOOD = dict(num_hidden_layers=2, num_attention_heads=4, hidden_size=32)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(hidden_size="32"), "hidden_size"),
        (dict(hidden_size=32.5), "hidden_size"),
        (dict(head_dim="abc"), "head_dim"),
        (dict(head_dim=[8]), "head_dim"),
        (dict(head_dim=7.9), "head_dim"),
        (dict(head_dim=True), "head_dim"),
        (dict(head_dim=0), "head_dim"),
        (dict(num_key_value_heads=0), "KV heads"),
        (dict(num_key_value_heads=True), "KV heads"),
        (dict(num_hidden_layers=True), "layers"),
        (dict(sliding_window="big", use_sliding_window=True), "sliding_window"),
        (dict(sliding_window=2.5), "sliding_window"),
        (dict(sliding_window=-4), "sliding_window"),
        (dict(torch_dtype=torch.int8), "floating"),
        (dict(dtype="uint8"), "floating"),
        (dict(dtype=5), "dtype"),
    ],
)
def test_odd_config_values_raise_config_error(changes, match):
    """Geometry must be positive ints (no bool, float, string, list; 0 KV heads is not 'no GQA'), the window a
    positive int, the KV dtype floating: anything else is a ConfigError, not a raw error or a silent guess."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(ConfigError, match=match):
            KVSpec.from_hf_config({**_GOOD, **changes}, block_size=8)


def test_an_explicit_kv_dtype_is_kept_and_overrides_the_config():
    """A config's dtype is the model's activations (must be floating); an explicit ``dtype=`` is the caller's
    storage choice — the edge planner sizes TensorRT-LLM's INT8 KV cache with ``dtype=torch.int8``."""
    assert KVSpec.from_hf_config(_GOOD, dtype=torch.int8).dtype == torch.int8
    assert KVSpec.from_hf_config({**_GOOD, "torch_dtype": torch.int8}, dtype="bfloat16").dtype == torch.bfloat16
    assert KVSpec.from_hf_config({**_GOOD, "sliding_window": 0}).num_kv_heads == 4  # 0 = no window, no GQA
