"""Jetson Orin modules (all sm_87, unified LPDDR5 shared by CPU and GPU) and well-known model configs.

Figures are NVIDIA's published specifications (memory, SMs, L2, bandwidth). Orin supports INT8 KV caches;
FP8 needs sm_89 or newer (Ada/Hopper), so FP8 KV is refused for every Orin module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memos_ref.errors import ConfigError

__all__ = ["MODELS", "PROFILES", "OrinProfile", "get_profile", "model_config"]


@dataclass(frozen=True)
class OrinProfile:
    name: str
    memory_gib: float
    sms: int
    l2_mib: float
    bandwidth_gbs: float
    sm: str = "sm_87"
    fp8: bool = False


PROFILES: dict[str, OrinProfile] = {
    p.name: p
    for p in [
        OrinProfile("orin-agx-64gb", 64, 16, 4, 204.8),
        OrinProfile("orin-agx-32gb", 32, 14, 4, 204.8),
        OrinProfile("orin-nx-16gb", 16, 8, 2, 102.4),
        OrinProfile("orin-nx-8gb", 8, 8, 2, 102.4),
        OrinProfile("orin-nano-8gb", 8, 8, 2, 68.0),
        OrinProfile("orin-nano-8gb-super", 8, 8, 2, 102.0),
    ]
}


def get_profile(name: str) -> OrinProfile:
    if name not in PROFILES:
        raise ConfigError(f"unknown device {name!r}: expected one of {sorted(PROFILES)}")
    return PROFILES[name]


#: Public configs of models people deploy on Orin (the fields the planner and the exporter need).
MODELS: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="float16",
    ),
    "llama-3-8b": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
    # SmolLM2-135M-Instruct (Apache-2.0), the package's real model (memos_ref.model.load_pretrained): the fields
    # of its config.json (tests/test_real_edge.py checks them against the converted folder). Tied embeddings;
    # head_dim 64 = 576 / 9; 30 x 2 x 3 x 64 x 2 bytes = 23,040 bytes of fp16 KV per token.
    "smollm2-135m-instruct": dict(
        architectures=["LlamaForCausalLM"],
        model_type="llama",
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        vocab_size=49152,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        torch_dtype="bfloat16",
    ),
    "qwen2.5-7b": dict(
        architectures=["Qwen2ForCausalLM"],
        model_type="qwen2",
        hidden_size=3584,
        intermediate_size=18944,
        num_hidden_layers=28,
        num_attention_heads=28,
        num_key_value_heads=4,
        vocab_size=152064,
        max_position_embeddings=32768,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        torch_dtype="bfloat16",
    ),
}


def model_config(model: str) -> dict[str, Any]:
    """A config dict from a known name, a folder holding ``config.json``, or a ``config.json`` path."""
    import json
    from pathlib import Path

    if model in MODELS:
        return dict(MODELS[model])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ConfigError(f"--model {model!r}: expected one of {sorted(MODELS)}, a model folder or a config.json")
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None
