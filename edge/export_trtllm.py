"""Export a transformers Llama-family model as a TensorRT-LLM v0.12 checkpoint: ``config.json`` +
``rank0.safetensors`` (single GPU: tp = pp = 1), ready for ``trtllm-build`` on a Jetson.

``python -m memos_edge.export_trtllm --model PATH|NAME --out DIR [--dtype float16|bfloat16|float32] [--kv-int8]
[--reference-prompt TEXT [--reference-chat] [--reference-steps N]]``

``--model`` is a transformers folder or a named model of the package (``smollm2-135m-instruct``: the converted
SmolLM2-135M-Instruct folder of :func:`memos_ref.model.pretrained_path`). When the folder has a Hugging Face
tokenizer, its files go into the export too (:func:`export_tokenizer`), so TensorRT-LLM's ``examples/run.py
--tokenizer_dir <export>`` loads it on the device.

Tensor names follow ``tensorrt_llm/models/llama/convert.py`` of v0.12 — with the two traps that break silent
exports: q, k and v are concatenated on dim 0 into ``attention.qkv``, and the gated MLP's names are swapped
relative to transformers (``mlp.fc`` ← ``gate_proj``, the one that goes through SiLU; ``mlp.gate`` ←
``up_proj``). :func:`reference_forward` (:mod:`memos_edge.export_reference`, re-exported here) runs a forward
*from the exported names* so a test can compare it with transformers' logits: a wrong mapping cannot pass.

``--kv-int8`` sets ``kv_cache_quant_algo = INT8`` and writes each layer's ``attention.kv_cache_scaling_factor``
(absmax of that layer's K and V / 127 over the held-out prose through the model's own tokenizer:
:mod:`memos_edge.calibrate`). INT8 or INT4 *weight-only* checkpoints need TensorRT-LLM's own kernel-specific
weight preprocessing; build them on the device with ``convert_checkpoint.py --use_weight_only`` (edge/README.md).

Tied embeddings (SmolLM2, ``tie_word_embeddings: true``): the checkpoint gets an explicit ``lm_head.weight`` (a
copy of the embedding) and ``share_embedding_table: false``, the layout every TensorRT-LLM version loads
without relying on its embedding-sharing options. RoPE is read from either config layout (transformers ≥ 5's
``rope_parameters`` or the older top-level ``rope_theta``/``rope_scaling``): SmolLM2's θ is 100000, and
reading only the top level would silently export TensorRT-LLM's default 10000.

Qwen2 folders export as ``QWenForCausalLM`` with ``qwen_type = qwen2`` and the qkv bias; only the Llama mapping
is checked against TensorRT-LLM's sources here, so verify a Qwen2 engine's output on the device.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from memos_edge.export_reference import add_reference_text, reference_forward, reference_prompt_ids, write_reference
from safetensors.torch import load_file, save_file

from memos_ref.errors import ConfigError
from memos_ref.model.rope_config import read_rope_config

__all__ = [
    "TOKENIZER_FILES",
    "bias_flags",
    "convert",
    "export_tokenizer",
    "main",
    "reference_forward",
    "resolve_model_dir",
    "rope_settings",
    "trtllm_config",
    "write_reference",
]

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}

#: Tokenizer files copied verbatim into the export when the model folder has them (``tokenizer_config.json`` is
#: rewritten, see :func:`export_tokenizer`; ``special_tokens_map.json`` is written from it when absent).
TOKENIZER_FILES = (
    "tokenizer.json",
    "chat_template.jinja",
    "generation_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)
_MAX_TOKENIZER_FILE = 64 * 2**20  # bytes: the largest tokenizer file read (foreign data is bounded)
_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
# transformers 5 names its tokenizers.json-backed class TokenizersBackend; transformers 4.x (what TensorRT-LLM
# 0.12 runs with) does not know that name, and PreTrainedTokenizerFast loads the same tokenizer.json in both.
_V5_ONLY_CLASSES = {"TokenizersBackend": "PreTrainedTokenizerFast"}
_V5_ONLY_KEYS = ("backend", "is_local", "local_files_only")


def resolve_model_dir(model: str | Path | None) -> Path:
    """A model folder from a path, a package model name (``smollm2-135m-instruct``) or ``None`` (the shipped
    model). A named model is converted on first use (:func:`memos_ref.model.pretrained_path`)."""
    from memos_ref.model import PRETRAINED, pretrained_path, shipped_model_dir

    if model is None:
        return shipped_model_dir()
    if str(model) in PRETRAINED:
        return pretrained_path(str(model))
    return Path(model)


def rope_settings(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rotary_base, rotary_scaling)`` for TensorRT-LLM from a transformers config in either layout, read by the
    package's one RoPE reader (:func:`memos_ref.model.rope_config.read_rope_config`: ``rope_parameters`` or the
    older top-level ``rope_theta`` / ``rope_scaling``; Llama-3.1 scaling validated). The scaling dict is ``None``
    for the default RoPE and otherwise carries both ``type`` and ``rope_type`` (TensorRT-LLM 0.12 reads ``type``:
    ``tensorrt_llm/models/llama/config.py``, ``RotaryScalingType.from_string(rotary_scaling["type"])``)."""
    rope = read_rope_config(cfg)
    if rope.is_default:
        return rope.theta, None
    scaling = dict(rope.scaling)
    scaling.setdefault("type", rope.rope_type)
    scaling.setdefault("rope_type", rope.rope_type)
    return rope.theta, scaling


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
    rotary_base, rotary_scaling = rope_settings(cfg)
    # Fields of TensorRT-LLM's PretrainedConfig (tensorrt_llm/models/modeling_utils.py) and LLaMAConfig
    # (tensorrt_llm/models/llama/config.py: rotary_base, rotary_scaling), the names its from_hugging_face writes.
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
        "rotary_base": rotary_base,
        "rotary_scaling": rotary_scaling,
        "use_parallel_embedding": False,
        "embedding_sharding_dim": 0,
        # lm_head.weight is always written (a copy of the embedding when the source ties them), so nothing
        # depends on TensorRT-LLM's embedding-sharing options: the checkpoint is untied as far as it can tell.
        "share_embedding_table": False,
        "tie_word_embeddings": False,
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


#: TensorRT-LLM's gated-MLP names for transformers' (``fc`` goes through SiLU: it is ``gate_proj``).
_MLP_NAMES = (("fc", "gate_proj"), ("gate", "up_proj"), ("proj", "down_proj"))


def bias_flags(config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> dict[str, bool]:
    """The checkpoint's bias flags from the biases the weights hold, or :class:`ConfigError` for a combination
    TensorRT-LLM 0.12 cannot express.

    Its Llama builds every attention linear (qkv and dense) with ``bias=config.attn_bias`` and the gated MLP with
    ``bias=config.mlp_bias`` (``tensorrt_llm/models/llama/model.py``); a bias tensor in the checkpoint whose flag is
    false is not loaded — the engine drops it with only a warning and computes a different model. So every bias
    goes out with its flag, and a model whose biases no flag describes (qkv without dense, part of the MLP) is
    refused. Qwen2 (``QWenForCausalLM``, ``qwen_type = qwen2``) has the qkv bias built in and nothing else."""
    layers = int(config["num_hidden_layers"])
    attn = [f"model.layers.{{}}.self_attn.{p}_proj.bias" for p in "qkvo"]
    mlp = [f"model.layers.{{}}.mlp.{hf}.bias" for _, hf in _MLP_NAMES]

    def present(names: list[str]) -> list[bool]:
        return [n.format(i) in state for i in range(layers) for n in names]

    qkv, dense, mlp_has = present(attn[:3]), present(attn[3:]), present(mlp)
    if len(set(qkv)) > 1 or len(set(mlp_has)) > 1:
        raise ConfigError("some layers or projections have biases and others not: TensorRT-LLM's flags are per model")
    has_qkv, has_dense, has_mlp = qkv[0], dense[0], mlp_has[0]
    if len(set(dense)) > 1:
        raise ConfigError("some layers have an o_proj bias and others not: TensorRT-LLM's attn_bias is per model")
    if config["architecture"] == "QWenForCausalLM":
        if has_dense or has_mlp:
            raise ConfigError("a Qwen2 model with o_proj or MLP biases cannot be expressed in TensorRT-LLM 0.12's QWen")
        return {}
    if has_qkv != has_dense:
        raise ConfigError(
            f"q/k/v biases {'present' if has_qkv else 'absent'} but o_proj bias {'present' if has_dense else 'absent'}:"
            " TensorRT-LLM's Llama has one attn_bias flag for qkv and dense; this model cannot be exported faithfully"
        )
    return {"attn_bias": has_qkv, "mlp_bias": has_mlp}


def convert(
    model_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "float16",
    kv_int8: bool = False,
    calibration_ids: torch.Tensor | None = None,
) -> Path:
    """Write ``config.json`` and ``rank0.safetensors`` for the model in ``model_dir`` (a folder or a package
    model name, see :func:`resolve_model_dir`), and its tokenizer files when it has a Hugging Face tokenizer
    (:func:`export_tokenizer`); returns ``out_dir``."""
    if dtype not in DTYPES:
        raise ConfigError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    model_dir, out_dir = resolve_model_dir(model_dir), Path(out_dir)
    cfg, state = _load_hf(model_dir)
    config = trtllm_config(cfg, dtype, kv_int8)
    t = DTYPES[dtype]
    w: dict[str, torch.Tensor] = {}

    def get(name: str) -> torch.Tensor:
        if name not in state:
            raise ConfigError(f"{model_dir}: weight {name!r} is missing")
        return state[name].to(t)

    config.update(bias_flags(config, state))
    w["transformer.vocab_embedding.weight"] = get("model.embed_tokens.weight")
    for i in range(config["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"transformer.layers.{i}."
        attn = src + "self_attn."
        w[dst + "attention.qkv.weight"] = torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"], dim=0)
        if attn + "q_proj.bias" in state:
            w[dst + "attention.qkv.bias"] = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"], dim=0)
        w[dst + "attention.dense.weight"] = get(attn + "o_proj.weight")
        if config.get("attn_bias") and config["architecture"] == "LlamaForCausalLM":
            w[dst + "attention.dense.bias"] = get(attn + "o_proj.bias")
        for trt, hf in _MLP_NAMES:
            w[dst + f"mlp.{trt}.weight"] = get(src + f"mlp.{hf}.weight")
            if config.get("mlp_bias"):
                w[dst + f"mlp.{trt}.bias"] = get(src + f"mlp.{hf}.bias")
        w[dst + "input_layernorm.weight"] = get(src + "input_layernorm.weight")
        w[dst + "post_layernorm.weight"] = get(src + "post_attention_layernorm.weight")
    w["transformer.ln_f.weight"] = get("model.norm.weight")
    # Tied (tie_word_embeddings, no lm_head.weight in the file): the head is the embedding, written as its own
    # tensor because the checkpoint says share_embedding_table = false. A copy: in float32 ``get`` returns the
    # stored tensor itself, and safetensors refuses two names over one storage.
    tied = "lm_head.weight" not in state
    w["lm_head.weight"] = get("model.embed_tokens.weight").clone() if tied else get("lm_head.weight")
    if kv_int8:
        for i, scale in enumerate(_kv_scales(model_dir, calibration_ids)):
            w[f"transformer.layers.{i}.attention.kv_cache_scaling_factor"] = torch.tensor([scale], dtype=torch.float32)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in w.items()}, str(out_dir / "rank0.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    export_tokenizer(model_dir, out_dir, max_length=config["max_position_embeddings"])
    return out_dir


def _read_bounded(path: Path) -> bytes:
    """A tokenizer file's bytes: a regular file no larger than the bound (foreign data)."""
    if path.is_symlink() or not path.is_file():
        raise ConfigError(f"{path} is not a regular file: tokenizer files are copied only from plain files")
    size = path.stat().st_size
    if size > _MAX_TOKENIZER_FILE:
        raise ConfigError(f"{path} has {size:,} bytes, over the {_MAX_TOKENIZER_FILE:,}-byte tokenizer file bound")
    return path.read_bytes()


def _token_text(value: Any) -> str | None:
    """A special token as a string (tokenizer_config.json stores a string or an AddedToken dict)."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _portable_tokenizer_config(cfg: dict[str, Any], chat_template: str | None, max_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` that transformers 4.x (TensorRT-LLM 0.12's) and 5.x load the same way."""
    out = {k: v for k, v in cfg.items() if k not in _V5_ONLY_KEYS}
    cls = out.get("tokenizer_class")
    out["tokenizer_class"] = _V5_ONLY_CLASSES.get(cls, cls) if cls else "PreTrainedTokenizerFast"
    # transformers 4.x defaults clean_up_tokenization_spaces to True, which rewrites " ." in decoded text
    out.setdefault("clean_up_tokenization_spaces", False)
    if chat_template is not None and "chat_template" not in out:
        out["chat_template"] = chat_template  # transformers < 4.43 reads the template only from here
    limit = out.get("model_max_length")
    if not isinstance(limit, int | float) or limit > 2**40:
        out["model_max_length"] = int(max_length)  # the model's positions, not transformers' "unset" 1e30
    return out


def _portable_tokenizer_json(data: bytes) -> bytes:
    """``tokenizer.json`` readable by tokenizers 0.19 (transformers 4.42, TensorRT-LLM 0.12's) as well as newer:
    tokenizers ≥ 0.20 writes BPE merges as pairs ``["a", "b"]``, which 0.19 rejects ("data did not match any
    variant of untagged enum ModelWrapper"); the older ``"a b"`` strings are read by every version. Kept as is
    when a merge piece holds a space (the string form cannot say it) or the model is not BPE."""
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise ConfigError(f"tokenizer.json is not valid JSON: {exc}") from None
    model = doc.get("model") if isinstance(doc, dict) else None
    merges = model.get("merges") if isinstance(model, dict) and model.get("type") == "BPE" else None
    pairs = isinstance(merges, list) and all(
        isinstance(m, list) and len(m) == 2 and all(isinstance(p, str) and " " not in p for p in m) for m in merges
    )
    if not merges or not pairs:
        return data
    model["merges"] = [f"{a} {b}" for a, b in merges]
    return json.dumps(doc, ensure_ascii=False, indent=2).encode()


def export_tokenizer(model_dir: str | Path, out_dir: str | Path, *, max_length: int) -> list[str]:
    """Copy a Hugging Face tokenizer from ``model_dir`` into ``out_dir`` so that
    ``AutoTokenizer.from_pretrained(out_dir)`` — what TensorRT-LLM's ``examples/run.py --tokenizer_dir`` calls
    (``examples/utils.py::load_tokenizer``) — gives the same tokens and chat template as the source folder, with
    transformers 4.x (what TensorRT-LLM 0.12 installs) as with 5.x. Returns the file names written; none when
    the folder has no ``tokenizer_config.json`` (the shipped byte-level model has no Hugging Face tokenizer).

    ``tokenizer_config.json`` is rewritten: a transformers-5-only class name becomes ``PreTrainedTokenizerFast``
    (it loads the same ``tokenizer.json``), the chat template is also stored inline, ``model_max_length`` is the
    model's context instead of "unset", and ``clean_up_tokenization_spaces`` is pinned to false.
    ``special_tokens_map.json`` is written from its special tokens when the source has none. ``tokenizer.json``
    gets its BPE merges in the string form tokenizers 0.19 reads (:func:`_portable_tokenizer_json`)."""
    model_dir, out_dir = Path(model_dir), Path(out_dir)
    src_cfg = model_dir / "tokenizer_config.json"
    if not src_cfg.exists():
        return []
    try:
        cfg = json.loads(_read_bounded(src_cfg))
    except ValueError as exc:
        raise ConfigError(f"{src_cfg} is not valid JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{src_cfg} must hold a JSON object, got {type(cfg).__name__}")
    payload = {name: _read_bounded(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).exists()}
    if "tokenizer.json" not in payload and "tokenizer.model" not in payload and "vocab.json" not in payload:
        raise ConfigError(f"{model_dir} has tokenizer_config.json but no tokenizer.json, tokenizer.model or vocab.json")
    template = payload["chat_template.jinja"].decode() if "chat_template.jinja" in payload else None
    if "tokenizer.json" in payload:
        payload["tokenizer.json"] = _portable_tokenizer_json(payload["tokenizer.json"])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, data in payload.items():
        (out_dir / name).write_bytes(data)
    portable = _portable_tokenizer_config(cfg, template, max_length)
    (out_dir / "tokenizer_config.json").write_text(json.dumps(portable, indent=2) + "\n")
    written = [*payload, "tokenizer_config.json"]
    if "special_tokens_map.json" not in payload:
        specials = {k: t for k in _SPECIAL_KEYS if (t := _token_text(cfg.get(k))) is not None}
        (out_dir / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")
        written.append("special_tokens_map.json")
    return sorted(written)


def _kv_scales(model_dir: Path, ids: torch.Tensor | None) -> list[float]:
    """Per-layer INT8 KV scale: max(|K|, |V|) / 127 over the held-out prose through the model's own tokenizer
    (:mod:`memos_edge.calibrate`, which also compares it with TensorRT-LLM's rule)."""
    from memos_edge.calibrate import calibration_ids, our_kv_scales

    scales = our_kv_scales(model_dir, calibration_ids(model_dir) if ids is None else ids)  # [L, 2]
    return [float(s.max()) for s in scales]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memos_edge.export_trtllm", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        default=None,
        help="a transformers model folder, or smollm2-135m-instruct (SmolLM2-135M-Instruct, converted once into "
        "the cache); default: the shipped model",
    )
    parser.add_argument("--out", required=True)
    parser.add_argument("--dtype", default="float16", choices=sorted(DTYPES))
    parser.add_argument("--kv-int8", action="store_true", help="INT8 KV cache with calibrated per-layer scales")
    parser.add_argument(
        "--reference-prompt",
        help="also write reference.json: this prompt's greedy continuation from the exported tensors (for deploy.sh)",
    )
    parser.add_argument("--reference-steps", type=int, default=16)
    parser.add_argument(
        "--reference-chat",
        action="store_true",
        help="render --reference-prompt as a user message through the model's chat template (instruct models)",
    )
    args = parser.parse_args(argv)
    out = convert(args.model, args.out, dtype=args.dtype, kv_int8=args.kv_int8)
    print(f"wrote {out / 'config.json'} and {out / 'rank0.safetensors'}")
    if args.reference_prompt is not None:
        ids, tok = reference_prompt_ids(out, args.reference_prompt, chat=args.reference_chat)
        ref = write_reference(out, ids, args.reference_steps)
        if tok is not None:
            add_reference_text(ref, tok)
        print(f"wrote {ref} ({len(ids)} prompt ids)")
    tokenizer = sorted(p.name for p in out.iterdir() if p.name in (*TOKENIZER_FILES, "tokenizer_config.json"))
    if tokenizer:
        print(f"tokenizer files: {', '.join(tokenizer)} (use --tokenizer_dir {out} with examples/run.py)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
