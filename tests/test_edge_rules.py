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


# ---------------------------------------------------------------------- build and run rules
def _cfg(**change):
    from memos_edge.build_config import BuildConfig

    base = dict(
        checkpoint_dir="c", engine_dir="e", dtype="float16", max_batch_size=1, max_input_len=1024, max_seq_len=2048,
        max_num_tokens=2048, tokens_per_block=64, context_chunk=None, kv_cache_free_gpu_memory_fraction=0.9,
        max_tokens_in_paged_kv_cache=10_000, kv_dtype="fp16",
    )  # fmt: skip
    return BuildConfig(**{**base, **change})


def test_int8_kv_cannot_have_paged_context_fmha_reuse_or_chunking():
    # tensorrt_llm/builder.py build(): with use_paged_context_fmha, has_int8_kv_cache() raises "Paged Context FMHA
    # doesn't work with int8 kv cache currently." (gptAttentionCommon.cpp asserts the same); block reuse and chunked
    # context need paged context FMHA. Before: build_command() always added --use_paged_context_fmha enable.
    from memos_edge.build_config import build_command, run_command, variants

    with pytest.raises(ConfigError, match="cannot use paged context FMHA"):
        _cfg(kv_dtype="int8").check()  # the default variant is "reuse"
    with pytest.raises(ConfigError, match="needs paged context FMHA"):
        _cfg(kv_dtype="int8", variant="safe", context_chunk=512, max_num_tokens=600).check()
    with pytest.raises(ConfigError, match="max_num_tokens 512 < max_input_len 1024"):
        _cfg(kv_dtype="int8", variant="safe", max_num_tokens=512).check()  # no chunking: a whole prompt per step
    safe = _cfg(kv_dtype="int8", variant="safe")
    safe.check()
    assert "--use_paged_context_fmha" not in build_command(safe)
    run = run_command(safe, "tok", "hi")
    assert "--kv_cache_enable_block_reuse" not in run and "--enable_chunked_context" not in run
    assert [v.variant for v in variants(_cfg(kv_dtype="int8", variant="safe"))] == ["safe"]
    assert [v.variant for v in variants(_cfg(context_chunk=512))] == ["reuse", "safe"]


def test_plugin_dtype_follows_the_checkpoint(tmp_path):
    # TensorRT-LLM builds the gemm and attention plugins in the dtype given (tensorrt_llm/plugin/plugin.py
    # PluginConfig); a bf16 checkpoint with float16 plugins is a different engine. "auto" follows the checkpoint.
    ckpt = {"dtype": "bfloat16", "quantization": {"kv_cache_quant_algo": None}}
    with pytest.raises(ConfigError, match="pass --dtype bfloat16"):
        _cfg(dtype="float16").check_checkpoint(ckpt)
    _cfg(dtype="bfloat16").check_checkpoint(ckpt)
    _cfg(dtype="auto").check_checkpoint(ckpt)
    with pytest.raises(ConfigError, match="plugin dtype"):
        _cfg(dtype="fp16").check()
    with pytest.raises(ConfigError, match="kv_cache_quant_algo is INT8"):
        _cfg(dtype="auto").check_checkpoint({"dtype": "float16", "quantization": {"kv_cache_quant_algo": "INT8"}})


def test_tokens_per_block_any_power_of_two():
    # TensorRT-LLM accepts any power of two; XQA is JIT for 16-128 and precompiled for 64/128 (the planner's range)
    for t in (1, 16, 256):
        _cfg(tokens_per_block=t).check()
    with pytest.raises(ConfigError, match="power of two"):
        _cfg(tokens_per_block=48).check()


def test_the_plan_reaches_the_run(tmp_path):
    # the KV budget is passed (examples/utils.py add_common_args: --max_tokens_in_paged_kv_cache) and the weights
    # are mmapped (README4Jetson: run.py ... --use_mmap); an infeasible plan gives no configuration
    from memos_edge.build_config import make_config, run_command
    from memos_edge.plan import plan

    p = plan("llama-3-8b", "orin-agx-64gb", weights="int4")
    run = run_command(make_config(p, "c", "e", batch=1, max_seq_len=4096, max_input_len=2048), "tok", "hi")
    assert run[run.index("--max_tokens_in_paged_kv_cache") + 1] == str(p.kv_tokens) and "--use_mmap" in run
    with pytest.raises(ConfigError, match="does not fit"):
        make_config(plan("qwen2.5-7b", "orin-nx-8gb", weights="int4"), "c", "e")


def test_write_reference_is_the_exported_tensors_greedy_continuation(tmp_path):
    # deploy.sh compares the engine's greedy tokens with this file, token for token
    from memos_edge.export_trtllm import write_reference
    from transformers import AutoModelForCausalLM

    tiny_llama(tmp_path / "hf")
    out = convert(tmp_path / "hf", tmp_path / "ckpt", dtype="float32")
    doc = json.loads(write_reference(out, IDS[:8].tolist(), steps=4).read_text())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").float().eval()
    with torch.no_grad():
        want = hf.generate(IDS[None, :8], max_new_tokens=4, do_sample=False)[0, 8:].tolist()
    assert doc["tokens"] == {"prompt": IDS[:8].tolist(), "greedy": want}
    with pytest.raises(ConfigError, match="non-empty prompt"):
        write_reference(out, [], steps=4)


def test_the_cli_checks_a_local_checkpoint(tmp_path):
    from memos_edge.build_config import main

    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16", "quantization": {}}))
    args = ["--model", "smollm2-135m-instruct", "--device", "orin-nano-8gb", "--weights", "fp16", "--checkpoint",
            str(tmp_path), "--engine", "e", "--max-seq-len", "4096", "--max-input-len", "2048"]  # fmt: skip
    with pytest.raises(ConfigError, match="pass --dtype bfloat16"):
        main(args)
    assert main([*args, "--dtype", "bfloat16"]) == 0
