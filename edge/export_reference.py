"""The oracle of a TensorRT-LLM export: a forward computed only from the exported tensors and ``config.json``.

:func:`reference_forward` gives the logits of a checkpoint written by :func:`memos_edge.export_trtllm.convert`
from the exported *names* (``attention.qkv``, ``mlp.fc``/``mlp.gate``/``mlp.proj``, ...), so a test can compare
them with transformers' logits on the source model: a wrong qkv order or a swapped fc/gate cannot pass.
:func:`write_reference` writes ``reference.json`` beside the checkpoint — a prompt's greedy continuation from the
exported tensors, what ``deploy.sh`` compares the engine's output with on the device.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from memos_ref.errors import ConfigError
from memos_ref.model.rope_config import RopeConfig, read_rope_config

__all__ = [
    "add_reference_text",
    "checkpoint_forward",
    "load_checkpoint",
    "reference_forward",
    "reference_prompt_ids",
    "write_reference",
]


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    d = x.shape[-1]
    inv = rope.inv_freq(d)  # [D/2], scaled as the config says (Llama-3.1 included)
    ang = pos[:, None].float() * inv[None]  # [S, D/2]
    cos, sin = torch.cat([ang.cos()] * 2, -1).to(x.dtype), torch.cat([ang.sin()] * 2, -1).to(x.dtype)
    half = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1)
    return x * cos + half * sin


def load_checkpoint(ckpt_dir: str | Path, dtype: torch.dtype | None) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """``config.json`` and the tensors of an export, cast to ``dtype`` when given (fp16 matmuls are slow on CPU)."""
    ckpt_dir = Path(ckpt_dir)
    c = json.loads((ckpt_dir / "config.json").read_text())
    w = load_file(str(ckpt_dir / "rank0.safetensors"))
    if dtype is not None:
        w = {k: v.to(dtype) if v.is_floating_point() else v for k, v in w.items()}
    return c, w


@torch.no_grad()
def reference_forward(
    ckpt_dir: str | Path, input_ids: torch.Tensor, *, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Logits ``[S, V]`` for ``input_ids [S]`` computed only from the exported TensorRT-LLM tensors and config —
    the oracle that catches a wrong qkv order or a swapped fc/gate. ``dtype``: compute in it (default: the
    stored dtype)."""
    return checkpoint_forward(*load_checkpoint(ckpt_dir, dtype), input_ids)


def checkpoint_forward(c: dict[str, Any], w: dict[str, torch.Tensor], input_ids: torch.Tensor) -> torch.Tensor:
    """:func:`reference_forward` on a loaded checkpoint."""
    rope = read_rope_config({"rope_theta": c["rotary_base"], "rope_scaling": c.get("rotary_scaling")})
    qwen = c["architecture"] == "QWenForCausalLM"
    # what the engine loads: a bias whose flag is false is dropped by TensorRT-LLM, so the oracle drops it too
    attn_bias, mlp_bias = qwen or bool(c.get("attn_bias")), bool(c.get("mlp_bias"))

    def lin(x: torch.Tensor, name: str, bias: bool) -> torch.Tensor:
        y = x @ w[name + ".weight"].T
        return y + w[name + ".bias"] if bias and name + ".bias" in w else y

    nq, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_size"]
    s = input_ids.shape[0]
    pos = torch.arange(s)
    x = w["transformer.vocab_embedding.weight"][input_ids]  # [S, hidden]
    mask = torch.full((s, s), float("-inf")).triu(1)
    for i in range(c["num_hidden_layers"]):
        p = f"transformer.layers.{i}."
        y = _rms(x, w[p + "input_layernorm.weight"], c["norm_epsilon"])
        qkv = lin(y, p + "attention.qkv", attn_bias)
        q, k, v = qkv.split([nq * d, nkv * d, nkv * d], dim=-1)
        q = _rope(q.view(s, nq, d).transpose(0, 1), pos, rope)  # [Hq, S, D]
        k = _rope(k.view(s, nkv, d).transpose(0, 1), pos, rope)
        v = v.view(s, nkv, d).transpose(0, 1)
        k, v = k.repeat_interleave(nq // nkv, 0), v.repeat_interleave(nq // nkv, 0)
        att = ((q @ k.transpose(-1, -2)).float() / math.sqrt(d) + mask).softmax(-1).to(v.dtype) @ v
        x = x + lin(att.transpose(0, 1).reshape(s, nq * d), p + "attention.dense", attn_bias and not qwen)
        y = _rms(x, w[p + "post_layernorm.weight"], c["norm_epsilon"])
        inter = torch.nn.functional.silu(lin(y, p + "mlp.fc", mlp_bias)) * lin(y, p + "mlp.gate", mlp_bias)
        x = x + lin(inter, p + "mlp.proj", mlp_bias)
    x = _rms(x, w["transformer.ln_f.weight"], c["norm_epsilon"])
    return (x @ w["lm_head.weight"].T).float()


@torch.no_grad()
def write_reference(
    ckpt_dir: str | Path, prompt_ids: list[int], steps: int = 16, path: str | Path | None = None
) -> Path:
    """``reference.json`` beside the checkpoint: the prompt's ids and the greedy continuation computed by
    :func:`reference_forward` from the exported tensors (cast to fp32: the stored weights in exact arithmetic) —
    what ``deploy.sh`` compares the engine's greedy output with, token for token (``{"tokens": {"prompt": [...],
    "greedy": [...]}}``). Stops at ``steps`` tokens."""
    if not prompt_ids or steps < 1:
        raise ConfigError(f"a reference needs a non-empty prompt and steps >= 1, got {len(prompt_ids)} ids, {steps}")
    c, w = load_checkpoint(ckpt_dir, torch.float32)  # the stored weights, exactly, in fp32 arithmetic
    ids = list(prompt_ids)
    for _ in range(steps):
        ids.append(int(checkpoint_forward(c, w, torch.tensor(ids))[-1].argmax()))
    out = Path(path) if path is not None else Path(ckpt_dir) / "reference.json"
    doc = {"tokens": {"prompt": list(prompt_ids), "greedy": ids[len(prompt_ids) :]}, "checkpoint": str(ckpt_dir)}
    out.write_text(json.dumps(doc) + "\n")
    return out


def reference_prompt_ids(ckpt_dir: Path, text: str, *, chat: bool = False) -> tuple[list[int], Any]:
    """The prompt's ids and the tokenizer (or ``None``): with the export's Hugging Face tokenizer when it has one
    (``chat``: the text as one user message through its chat template, the way an instruct model is asked), else
    the bytes (shipped model)."""
    if (ckpt_dir / "tokenizer_config.json").exists():
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(ckpt_dir))
        if chat:
            if not tok.chat_template:
                raise ConfigError(f"--reference-chat needs a chat template; {ckpt_dir} has none: drop the flag")
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)  # fmt: skip
        return list(tok(text)["input_ids"]), tok
    if chat:
        raise ConfigError(f"--reference-chat needs a Hugging Face tokenizer; {ckpt_dir} has none: drop the flag")
    vocab = json.loads((ckpt_dir / "config.json").read_text())["vocab_size"]
    return [b % vocab for b in text.encode()], None


def add_reference_text(path: Path, tok: Any) -> None:
    """Add the decoded prompt and greedy continuation to ``reference.json`` (what a person reads on the device)."""
    doc = json.loads(path.read_text())
    doc["text"] = {key: tok.decode(ids) for key, ids in doc["tokens"].items()}
    path.write_text(json.dumps(doc) + "\n")
