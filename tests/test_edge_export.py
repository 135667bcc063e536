"""TensorRT-LLM checkpoint export: a forward run only from the exported tensors equals transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch
from memos_edge.export_trtllm import convert, main, reference_forward
from safetensors.torch import load_file, save_file

from memos_ref.errors import ConfigError

IDS = torch.tensor([1, 72, 101, 108, 108, 111, 44, 32, 119, 111, 114, 108, 100, 10, 100, 101, 102])


def hf_logits(model_dir, ids):
    from memos_ref.model import load_hf_model

    with torch.no_grad():
        return load_hf_model(model_dir)(input_ids=ids[None]).logits[0].float()


def test_shipped_model_export_matches_transformers(tmp_path):
    from memos_ref.model import shipped_model_dir

    out = convert(shipped_model_dir(), tmp_path / "ckpt", dtype="float32")
    got = reference_forward(out, IDS)
    assert (got - hf_logits(shipped_model_dir(), IDS)).abs().max() < 1e-4
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architecture"] == "LlamaForCausalLM" and cfg["mapping"] == {"world_size": 1, "tp_size": 1, "pp_size": 1}
    assert (
        cfg["num_key_value_heads"] == 2
        and cfg["head_size"] == 32
        and cfg["quantization"]["kv_cache_quant_algo"] is None
    )


def test_tiny_llama_and_qwen2_exports_match(tiny_model_dir, tmp_path):
    out = convert(tiny_model_dir, tmp_path / "ckpt", dtype="float32")
    ids = IDS % 300
    assert (reference_forward(out, ids) - hf_logits(tiny_model_dir, ids)).abs().max() < 1e-4
    names = load_file(str(out / "rank0.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    if cfg["architecture"] == "QWenForCausalLM":
        assert cfg["qwen_type"] == "qwen2" and "transformer.layers.0.attention.qkv.bias" in names
    assert names["transformer.layers.0.attention.qkv.weight"].shape == ((8 + 2 * 2) * 8, 64)


def test_the_oracle_catches_a_swapped_mlp(tmp_path):
    from memos_ref.model import shipped_model_dir

    out = convert(shipped_model_dir(), tmp_path / "ckpt", dtype="float32")
    w = load_file(str(out / "rank0.safetensors"))
    w["transformer.layers.0.mlp.fc.weight"], w["transformer.layers.0.mlp.gate.weight"] = (
        w["transformer.layers.0.mlp.gate.weight"],
        w["transformer.layers.0.mlp.fc.weight"],
    )  # what a converter that keeps transformers' names in order would write
    save_file(w, str(out / "rank0.safetensors"))
    assert (reference_forward(out, IDS) - hf_logits(shipped_model_dir(), IDS)).abs().max() > 1e-2


def test_fp16_and_int8_kv_checkpoints(tmp_path):
    from memos_ref.model import shipped_model_dir

    out = convert(shipped_model_dir(), tmp_path / "ckpt", dtype="float16", kv_int8=True)
    w = load_file(str(out / "rank0.safetensors"))
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == "float16" and cfg["quantization"]["kv_cache_quant_algo"] == "INT8"
    assert w["transformer.layers.0.attention.dense.weight"].dtype == torch.float16
    scales = [float(w[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]) for i in range(4)]
    assert all(0 < s < 1 for s in scales)  # the shipped model's |K|, |V| stay below 127
    assert main(["--out", str(tmp_path / "cli"), "--dtype", "bfloat16"]) == 0
    assert (tmp_path / "cli" / "rank0.safetensors").is_file()


def test_bad_inputs(tmp_path):
    with pytest.raises(ConfigError, match=r"no config\.json"):
        convert(tmp_path, tmp_path / "out")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    with pytest.raises(ConfigError, match=r"no \.safetensors"):
        convert(tmp_path, tmp_path / "out")
    from memos_ref.model import shipped_model_dir

    with pytest.raises(ConfigError, match="dtype must be"):
        convert(shipped_model_dir(), tmp_path / "out", dtype="int4")


# ---------------------------------------------------------------------- issue 28 item 6: INT8 KV calibration text
def test_int8_kv_calibration_uses_the_held_out_prose_through_the_tokenizer_and_trtllms_rule(tmp_path):
    # before: source-code bytes taken modulo the vocabulary (for SmolLM2 not its tokens). Now the held-out prose's
    # calibration section through the model's tokenizer (here the shipped byte model's), and TensorRT-LLM's own
    # rule (models/llama/convert.py: qkv_y.max() / 127 over the q, k, v projections' outputs) computed beside ours
    import math

    import torch
    from memos_edge.calibrate import calibration_ids, compare_kv_scales
    from memos_edge.export_trtllm import convert
    from safetensors.torch import load_file

    from memos_ref.bench.accuracy import heldout_prose
    from memos_ref.model import load_hf_model, shipped_model_dir
    from memos_ref.model.tokenizer import ByteTokenizer

    model_dir = shipped_model_dir()
    ids = calibration_ids(model_dir)
    assert ByteTokenizer().decode(ids[0]) == heldout_prose()[1]  # real text, every id a real token
    got = compare_kv_scales(model_dir, ids)
    # independent oracles, from transformers: the projections' outputs (TensorRT-LLM's act_range "y") and the
    # cache it stores (keys after RoPE, values)
    hf = load_hf_model(model_dir)
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True, use_cache=True)
    trt, ours = [], []
    for i, layer in enumerate(hf.model.layers):
        x = layer.input_layernorm(out.hidden_states[i])
        with torch.no_grad():
            qkv = [getattr(layer.self_attn, f"{p}_proj")(x).abs().max() for p in "qkv"]
        trt.append(float(max(qkv)) / 127)
        k, v = out.past_key_values.layers[i].keys, out.past_key_values.layers[i].values
        ours.append(float(max(k.abs().max(), v.abs().max())) / 127)
    assert torch.allclose(got["trtllm"], torch.tensor(trt), rtol=1e-5)
    assert torch.allclose(got["ours"], torch.tensor(ours), rtol=1e-3)
    # RoPE rotates (x, y) pairs: a stored key is at most sqrt(2) x the largest pre-RoPE output, and TensorRT-LLM's
    # maximum also covers q and v, so ours <= sqrt(2) x theirs
    assert bool((got["ratio"] <= math.sqrt(2) + 1e-6).all()) and got["tokens"] == ids.shape[1]
    ckpt = convert(model_dir, tmp_path / "kv8", dtype="float32", kv_int8=True)
    w = load_file(str(ckpt / "rank0.safetensors"))
    written = [float(w[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"]) for i in range(len(ours))]
    assert written == [float(s) for s in got["ours"]]  # the export writes ours, measured on the prose
