"""Export a transformers Llama-family model as a TensorRT-LLM v0.12 checkpoint: ``config.json`` +
``rank0.safetensors`` (single GPU: tp = pp = 1), ready for ``trtllm-build`` on a Jetson.

``python -m memos_edge.export_trtllm --model PATH --out DIR [--dtype float16|bfloat16|float32] [--kv-int8]``

Tensor names follow ``tensorrt_llm/models/llama/convert.py`` of v0.12 — with the two traps that break silent
exports: q, k and v are concatenated on dim 0 into ``attention.qkv``, and the gated MLP's names are swapped
relative to transformers (``mlp.fc`` ← ``gate_proj``, the one that goes through SiLU; ``mlp.gate`` ←
``up_proj``). :func:`reference_forward` runs a forward *from the exported names* so a test can compare it with
transformers' logits: a wrong mapping cannot pass.

``--kv-int8`` sets ``kv_cache_quant_algo = INT8`` and writes each layer's ``attention.kv_cache_scaling_factor``
(absmax of that layer's K and V over calibration text / 127, measured with the package's forward). INT8 or INT4
*weight-only* checkpoints need TensorRT-LLM's own kernel-specific weight preprocessing; build them on the
device with ``convert_checkpoint.py --use_weight_only`` (edge/README.md).

Qwen2 folders export as ``QWenForCausalLM`` with ``qwen_type = qwen2`` and the qkv bias; only the Llama mapping
is checked against TensorRT-LLM's sources here, so verify a Qwen2 engine's output on the device.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memos_ref.errors import ConfigError

__all__ = ["convert", "main", "reference_forward", "trtllm_config"]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def _load_hf(model_dir: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    cfg_path = model_dir / "config.json"
    if not cfg_path.is_file():
        raise ConfigError(f"{model_dir} has no config.json: expected a transformers model folder")
    cfg = json.loads(cfg_path.read_text())
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir} has no .safetensors weights (pickled .bin files are not loaded)")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return cfg, state


def trtllm_config(cfg: dict[str, Any], dtype: str, kv_int8: bool = False) -> dict[str, Any]:
    """The v0.12 checkpoint ``config.json`` for a transformers config."""
    arch = (cfg.get("architectures") or [""])[0]
    if arch not in ("LlamaForCausalLM", "Qwen2ForCausalLM") and cfg.get("model_type") not in ("llama", "qwen2"):
        raise ConfigError(f"only Llama and Qwen2 models are exported, got architectures={cfg.get('architectures')}")
    heads = cfg["num_attention_heads"]
    out: dict[str, Any] = {
        "architecture": "QWenForCausalLM" if cfg.get("model_type") == "qwen2" else "LlamaForCausalLM",
        "dtype": dtype,
        "logits_dtype": "float32",
        "vocab_size": cfg["vocab_size"],
        "max_position_embeddings": cfg.get("max_position_embeddings", 2048),
        "hidden_size": cfg["hidden_size"],
        "num_hidden_layers": cfg["num_hidden_layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": cfg.get("num_key_value_heads") or heads,
        "head_size": cfg.get("head_dim") or cfg["hidden_size"] // heads,
        "hidden_act": cfg.get("hidden_act", "silu"),
        "intermediate_size": cfg["intermediate_size"],
        "norm_epsilon": cfg.get("rms_norm_eps", 1e-6),
        "position_embedding_type": "rope_gpt_neox",
        "rotary_base": cfg.get("rope_theta", 10000.0),
        "rotary_scaling": cfg.get("rope_scaling"),
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        "share_embedding_table": False,
        "mapping": {"world_size": 1, "tp_size": 1, "pp_size": 1},
        "quantization": {
            "quant_algo": None,
            "kv_cache_quant_algo": "INT8" if kv_int8 else None,
            "group_size": 128,
        },
    }
    if out["architecture"] == "QWenForCausalLM":
        out["qwen_type"] = "qwen2"
    return out


def convert(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float16",
    kv_int8: bool = False,
    calibration_ids: torch.Tensor | None = None,
) -> Path:
    """Write ``config.json`` and ``rank0.safetensors`` for the model in ``model_dir``; returns ``out_dir``."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg, state = _load_hf(model_dir)
    config = trtllm_config(cfg, dtype, kv_int8)
    t = DTYPES[dtype]
    w: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"{model_dir}: weight {name!r} is missing")
        return state[name].to(t)

    w["transformer.vocab_embedding.weight"] = get("model.embed_tokens.weight")
    for i in range(config["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"transformer.layers.{i}."
        attn = src + "self_attn."
        w[dst + "attention.qkv.weight"] = torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"], dim=0)
        if attn + "q_proj.bias" in state:
            w[dst + "attention.qkv.bias"] = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"], dim=0)
        w[dst + "attention.dense.weight"] = get(attn + "o_proj.weight")
        w[dst + "mlp.fc.weight"] = get(src + "mlp.gate_proj.weight")  # fc goes through SiLU
        w[dst + "mlp.gate.weight"] = get(src + "mlp.up_proj.weight")
        w[dst + "mlp.proj.weight"] = get(src + "mlp.down_proj.weight")
        w[dst + "input_layernorm.weight"] = get(src + "input_layernorm.weight")
        w[dst + "post_layernorm.weight"] = get(src + "post_attention_layernorm.weight")
    w["transformer.ln_f.weight"] = get("model.norm.weight")
    w["lm_head.weight"] = get("lm_head.weight") if "lm_head.weight" in state else get("model.embed_tokens.weight")
    if kv_int8:
        for i, scale in enumerate(_kv_scales(model_dir, calibration_ids)):
            w[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] = torch.tensor([scale], dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out_dir / "rank0.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _kv_scales(model_dir: Path, ids: torch.Tensor | None) -> list[float]:
    """Per-layer INT8 KV scale: max(|K|, |V|) over calibration text / 127 (TensorRT-LLM's per-layer scale)."""
    from memos_ref.model import load_model, shipped_model_dir
    from memos_ref.quant.accuracy import calibrate_layer_scales

    model = load_model(model_dir)
    if ids is None:
        text = (shipped_model_dir().parent / "data" / "heldout_stdlib.txt").read_bytes()[:1024]
        ids = torch.tensor([[b % model.config.vocab_size for b in text]])
    scales = calibrate_layer_scales(model, ids)  # [L, 2]: absmax / 127 of K and of V
    return [float(s.max()) for s in scales]


# ---------------------------------------------------------------------- the oracle
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, base: float) -> torch.Tensor:
    d = x.shape[-1]
    inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos[:, None].float() * inv[None]  # [S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


@torch.no_grad()
def reference_forward(ckpt_dir: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[S, V]`` for ``input_ids [S]`` computed only from the exported TensorRT-LLM tensors and config —
    the oracle that catches a wrong qkv order or a swapped fc/gate."""
    ckpt_dir = Path(ckpt_dir)
    c = json.loads((ckpt_dir / "config.json").read_text())
    w = load_file(str(ckpt_dir / "rank0.safetensors"))
    nq, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_size"]
    s = input_ids.shape[0]
    pos = torch.arange(s)
    x = w["transformer.vocab_embedding.weight"][input_ids]  # [S, hidden]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for i in range(c["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        y = _rms(x, w[p + "input_layernorm.weight"], c["norm_epsilon"])
        qkv = y @ w[p + "attention.qkv.weight"].T
        if p + "attention.qkv.bias" in w:
            qkv = qkv + w[p + "attention.qkv.bias"]
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        q = _rope(q.view(s, nq, d).transpose(0, 1), pos, c["rotary_base"])  # [Hq, S, D]
        k = _rope(k.view(s, nkv, d).transpose(0, 1), pos, c["rotary_base"])
        v = v.view(s, nkv, d).transpose(0, 1)
        k, v = k.repeat_interleave(nq // nkv, 0), v.repeat_interleave(nq // nkv, 0)
        att = ((q @ k.transpose(-1, -2)).float() / math.sqrt(d) + mask).softmax(-1).to(v.dtype) @ v
        x = x + att.transpose(0, 1).reshape(s, nq * d) @ w[p + "attention.dense.weight"].T
        y = _rms(x, w[p + "post_layernorm.weight"], c["norm_epsilon"])
        inter = torch.nn.functional.silu(y @ w[p + "mlp.fc.weight"].T) * (y @ w[p + "mlp.gate.weight"].T)
        x = x + inter @ w[p + "mlp.proj.weight"].T
    x = _rms(x, w["transformer.ln_f.weight"], c["norm_epsilon"])
    return (x @ w["lm_head.weight"].T).float()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memos_edge.export_trtllm", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="a transformers model folder (default: the shipped model)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    parser.add_argument("--kv-int8", action="store_true", help="INT8 KV cache with calibrated per-layer scales")
    args = parser.parse_args(argv)
    from memos_ref.model import shipped_model_dir

    out = convert(args.model or shipped_model_dir(), args.out, dtype=args.dtype, kv_int8=args.kv_int8)
    print(f"wrote {out / 'config.json'} and {out / 'rank0.safetensors'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
