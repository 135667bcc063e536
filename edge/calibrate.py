"""INT8 KV calibration for the TensorRT-LLM export: real text through the model's own tokenizer, and the scales
compared with TensorRT-LLM's rule on the same text.

The text is the held-out English prose shipped with the package (``memos_ref/model/data/heldout_prose.txt``, its
calibration section: :func:`memos_ref.bench.accuracy.heldout_prose`), tokenized by the model's Hugging Face
tokenizer when the folder has one (SmolLM2), by the package's byte tokenizer for the shipped byte-level model.
Before issue 28 the export fed source-code bytes taken modulo the vocabulary, which for SmolLM2 are not its
tokens.

Two scales per layer:

* **ours** — ``max(|K|, |V|) / 127`` over what the cache stores (K after RoPE), measured with the package's
  forward: the smallest scale that does not clip the stored values; written into the checkpoint;
* **TensorRT-LLM's** — ``tensorrt_llm/models/llama/convert.py``: ``qkv_y = torch.cat([act_range[q_proj]["y"],
  act_range[k_proj]["y"], act_range[v_proj]["y"]])``; ``int8_kv_scales = qkv_y.max() / 127.``, where
  ``act_range[...]["y"]`` is the per-channel max of ``|output|`` of each projection (before RoPE), measured here
  with forward hooks on transformers' model. It includes the queries, which the cache never stores.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from memos_ref.errors import ConfigError

__all__ = ["calibration_ids", "compare_kv_scales", "our_kv_scales", "trtllm_kv_scales"]


def calibration_ids(model_dir: str | Path) -> torch.Tensor:
    """``[1, S]``: the held-out prose's calibration section through the model's own tokenizer."""
    from memos_ref.bench.accuracy import heldout_prose
    from memos_ref.model.tokenizer import ByteTokenizer

    model_dir = Path(model_dir)
    _, text = heldout_prose()
    if (model_dir / "tokenizer.json").is_file() or (model_dir / "tokenizer_config.json").is_file():
        from transformers import AutoTokenizer

        ids = AutoTokenizer.from_pretrained(str(model_dir))(text, add_special_tokens=False)["input_ids"]
    else:
        import json

        vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
        if vocab < 256:
            raise ConfigError(f"{model_dir} has no tokenizer and a vocabulary of {vocab} (< 256 bytes): pass ids")
        ids = ByteTokenizer().encode(text)
    if len(ids) < 16:
        raise ConfigError(f"the calibration text gives {len(ids)} tokens; expected at least 16")
    return torch.tensor([ids])


def our_kv_scales(model_dir: str | Path, ids: torch.Tensor) -> torch.Tensor:
    """``[L, 2]``: absmax / 127 of each layer's stored K (after RoPE) and V, with the package's forward."""
    from memos_ref.bench.accuracy import calibrate_layer_scales
    from memos_ref.model import load_model

    return calibrate_layer_scales(load_model(model_dir), ids)


@torch.no_grad()
def trtllm_kv_scales(model_dir: str | Path, ids: torch.Tensor) -> torch.Tensor:
    """``[L]``: TensorRT-LLM's ``qkv_y.max() / 127`` per layer, from hooks on transformers' q/k/v projections."""
    from memos_ref.model import load_hf_model

    model = load_hf_model(model_dir)
    layers = model.model.layers
    amax = torch.zeros(len(layers))
    hooks = []

    def hook(i: int) -> Any:
        def record(_module: Any, _inputs: Any, out: torch.Tensor) -> None:
            amax[i] = torch.maximum(amax[i], out.detach().abs().max().float())

        return record

    for i, layer in enumerate(layers):
        for proj in ("q_proj", "k_proj", "v_proj"):
            hooks.append(getattr(layer.self_attn, proj).register_forward_hook(hook(i)))
    try:
        model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return amax / 127.0


def compare_kv_scales(model_dir: str | Path, ids: torch.Tensor | None = None) -> dict[str, Any]:
    """Both scales on the same text: ``ours`` ``[L]`` (max of K and V), ``trtllm`` ``[L]``, their ratio, and
    the tokens used."""
    ids = calibration_ids(model_dir) if ids is None else ids
    ours = our_kv_scales(model_dir, ids).amax(-1)
    theirs = trtllm_kv_scales(model_dir, ids)
    return {"tokens": int(ids.shape[-1]), "ours": ours, "trtllm": theirs, "ratio": ours / theirs}
