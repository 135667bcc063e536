"""Issue 16 item 1: the rules a TensorRT-LLM v0.12 build on a Jetson must obey, each a check in memos_edge, each
test citing where the rule comes from.

Sources (NVIDIA/TensorRT-LLM, the snapshot before v0.12 branched; quoted so the line can be found again):
* ``tensorrt_llm/builder.py`` ``build()``: ``if build_config.plugin_config.use_paged_context_fmha: ... if
  model.config.quant_mode.has_int8_kv_cache(): raise RuntimeError("Paged Context FMHA doesn't work with int8 kv
  cache currently.")``; and ``cpp/tensorrt_llm/plugins/gptAttentionCommon/gptAttentionCommon.cpp``:
  ``TLLM_CHECK_WITH_INFO(!(mKVCacheQuantMode.hasInt8KvCache() && enablePagedKVContextFMHA), ...)``.
* ``tensorrt_llm/quantization/quantize.py`` ``quantize_layers``: ``exclude_modules = quant_config.exclude_modules
  or ['*lm_head', '*router', '*vocab_embedding', ...]`` — weight-only keeps the head and the embedding in fp16.
* ``README4Jetson.md`` (v0.12.0-jetson): ``sudo nvpmodel -m 0`` / ``sudo jetson_clocks``; ``run.py ... --use_mmap``;
  memory tables (with mmap 48.9 GB GPU / 49.7 total, without 44.0 / 50.5 in inflight batching); decode
  35.9 tok/s for Llama-3-8B INT4 from ``gptSessionBenchmark --batch_size 1 --input_output_len 128,128
  --enable_cuda_graph``; the engine built with ``trtllm-build --checkpoint_dir ... --gemm_plugin float16`` only.
"""

from __future__ import annotations

import json

import pytest
import torch
from memos_edge.export_trtllm import convert, reference_forward, rope_settings
from safetensors.torch import load_file, save_file

from memos_ref.errors import ConfigError
from memos_ref.model.rope_config import RopeConfig, read_rope_config

IDS = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 10, 100, 101, 102, 7, 9, 33]) % 300
TINY = dict(
    vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=8,
    num_key_value_heads=2, max_position_embeddings=1024,
)  # fmt: skip
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 16}  # fmt: skip


def tiny_llama(folder, **extra):
    """A random tiny transformers Llama saved in ``folder`` (every parameter perturbed: no trivial term)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY, **extra)).float().eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(folder)
    with torch.no_grad():
        return model(input_ids=IDS[None]).logits[0].float()


# ---------------------------------------------------------------------- biases
def test_export_llama_biases_go_out_with_their_flags(tmp_path):
    # TensorRT-LLM's Llama: Attention(bias=config.attn_bias) for qkv and dense, GatedMLP(bias=config.mlp_bias)
    # (tensorrt_llm/models/llama/model.py); an unflagged bias is dropped with a warning. Before: qkv.bias went out
    # without attn_bias, dense and MLP biases not at all.
    ref = tiny_llama(tmp_path / "hf", attention_bias=True, mlp_bias=True)
    out = convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["attn_bias"] is True and cfg["mlp_bias"] is True
    names = load_file(str(out / "rank0.safetensors"))
    for n in ("attention.qkv.bias", "attention.dense.bias", "mlp.fc.bias", "mlp.gate.bias", "mlp.proj.bias"):
        assert f"transformer.layers.1.{n}" in names
    assert (reference_forward(out, IDS) - ref).abs().max() < 1e-4


def test_export_without_biases_says_so(tmp_path):
    tiny_llama(tmp_path / "hf")
    cfg = json.loads((convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32") / "config.json").read_text())
    assert cfg["attn_bias"] is False and cfg["mlp_bias"] is False


def test_export_refuses_biases_no_flag_describes(tmp_path):
    tiny_llama(tmp_path / "hf", attention_bias=True, mlp_bias=True)
    path = tmp_path / "hf" / "model.safetensors"
    full = load_file(str(path))
    for drop, match in [("self_attn.o_proj.bias", "one attn_bias flag"), ("mlp.up_proj.bias", "flags are per model")]:
        save_file({k: v for k, v in full.items() if not k.endswith(drop)}, str(path))
        with pytest.raises(ConfigError, match=match):
            convert(tmp_path / "hf", tmp_path / f"ckpt-{drop}", dtype="float32")
        assert not (tmp_path / f"ckpt-{drop}").exists()  # refused before anything is written


# ---------------------------------------------------------------------- RoPE: one reader
def test_export_reads_rope_parameters_at_theta_500000(tmp_path):
    # transformers >= 5 writes rope_theta under rope_parameters; a top-level-only reader exported 10000 here
    ref = tiny_llama(tmp_path / "hf", rope_parameters={"rope_type": "default", "rope_theta": 500000.0})
    assert "rope_theta" not in json.loads((tmp_path / "hf" / "config.json").read_text())  # only the new layout
    out = convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rotary_base"] == 500000.0 and cfg["rotary_scaling"] is None
    assert (reference_forward(out, IDS) - ref).abs().max() < 1e-4


def test_export_carries_llama31_rope_scaling(tmp_path):
    # Llama-3.1 scaling (rope_type llama3): TensorRT-LLM 0.12 reads rotary_scaling["type"]
    # (tensorrt_llm/models/llama/config.py); the oracle applies the same frequencies as transformers
    ref = tiny_llama(tmp_path / "hf", rope_parameters={"rope_theta": 500000.0, **LLAMA31})
    out = convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["rotary_base"] == 500000.0 and cfg["rotary_scaling"] == {**LLAMA31, "type": "llama3"}
    assert (reference_forward(out, IDS) - ref).abs().max() < 1e-4
    cfg["rotary_scaling"] = None  # the scaling matters at these frequencies: without it the logits move
    (out / "config.json").write_text(json.dumps(cfg))
    assert (reference_forward(out, IDS) - ref).abs().max() > 1e-3


def test_read_rope_config_both_layouts_and_the_llama3_frequencies():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert read_rope_config({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"}}) == RopeConfig(1e5)
    assert read_rope_config({"rope_theta": 5e5}) == RopeConfig(5e5)
    assert read_rope_config({}) == RopeConfig(10000.0)
    new = read_rope_config({"rope_parameters": {"rope_theta": 5e5, **LLAMA31}})
    old = read_rope_config({"rope_theta": 5e5, "rope_scaling": LLAMA31})
    assert new == old and new.rope_type == "llama3" and rope_settings({"rope_theta": 5e5, "rope_scaling": LLAMA31})[1]
    hf = LlamaConfig(**TINY, rope_parameters={"rope_theta": 5e5, **LLAMA31})
    inv, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    assert torch.allclose(new.inv_freq(8), inv.float(), rtol=1e-6)
    linear = read_rope_config({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert torch.allclose(linear.inv_freq(8), RopeConfig(1e4).inv_freq(8) / 2)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "yarn", "factor": 4.0}}, "not supported"),
        ({"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}, "missing"),
        ({"rope_parameters": {"rope_theta": 5e5, **LLAMA31, "factor": 0}}, "factor must be"),
        ({"rope_parameters": {"rope_theta": 5e5, **LLAMA31, "high_freq_factor": 0.5}}, "must exceed"),
        ({"rope_scaling": {"type": "linear"}}, "factor must be"),
        ({"rope_scaling": [2.0]}, "rope_scaling must be a mapping"),
        ({"rope_parameters": {"rope_theta": "5e5"}}, "rope_theta must be"),
    ],
)
def test_read_rope_config_refuses(cfg, match):
    with pytest.raises(ConfigError, match=match):
        read_rope_config(cfg)
