"""Memory planner for a Jetson Orin: how much KV fits, in what blocks, and how fast decode can be at best.

``python -m memos_edge.plan --model llama-2-7b --device orin-nx-16gb --weights int4 --kv-dtype fp16 [--json]``
``python -m memos_edge.plan --model smollm2-135m-instruct --device orin-nano-8gb --weights fp16``

The accounting, all in bytes (GiB = 2³⁰):

* **weights**: parameters × bytes per parameter — fp16 2, int8 1 (+ an fp16 scale per output channel), int4
  0.5 + an fp16 scale per group of 128 (GPTQ/AWQ) — with the token embedding kept in fp16 (TensorRT-LLM's
  weight-only modes quantize the linear layers); a model with tied embeddings (SmolLM2) also carries an fp16
  ``lm_head`` copy of the embedding, as TensorRT-LLM's converter and this package's export write one;
* **free** = module memory − the OS and CUDA context (``os_reserve_gib``, default 2.0: Orin's memory is shared
  with the CPU) − weights − the runtime (``runtime_gib``, default 1.5: engine, activations, workspace);
* **KV budget** = ``kv_fraction`` × free (0.9: TensorRT-LLM's ``kv_cache_free_gpu_memory_fraction`` default);
* **tokens_per_block** T: seed 001 §6.2 wants ~1 MiB blocks for Orin's 2–4 MiB L2. Read as the per-layer K+V
  slab of one block, ``2·H·T·D·bytes``, contiguous in the pool layout ``[blocks, L, 2, H, T, D]``: T = 1 MiB /
  (2·H·D·bytes), rounded down to a power of two and clamped to the XQA kernel's 8–128. Llama-2-7B in fp16
  gives exactly 64; GQA models hit the 128 clamp and get smaller slabs — the granularity is reported;
* **blocks** = ⌊KV budget / (L × slab)⌋; the largest context × batch that fits follows;
* **decode bound**: one decode step reads every weight once and every cached K/V of every sequence once, so
  tokens/s ≤ batch × bandwidth / (weights + batch × context × KV bytes per token).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from typing import Any

from memos_edge.devices import MODELS, PROFILES, OrinProfile, get_profile, model_config

from memos_ref.errors import ConfigError
from memos_ref.spec import KVSpec

__all__ = ["Plan", "count_parameters", "main", "plan", "tokens_per_block_for"]

GIB = 2**30
MIB = 2**20
KV_BYTES = {"fp16": 2, "bf16": 2, "int8": 1, "fp8": 1}
WEIGHT_BYTES = {"fp16": 2.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5}


def count_parameters(cfg: dict[str, Any]) -> dict[str, int]:
    """Parameters of a Llama-family model by part (embedding, linear layers, norms, head)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    layers, q_heads = cfg["num_hidden_layers"], cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or q_heads
    d = cfg.get("head_dim") or h // q_heads
    vocab = cfg["vocab_size"]
    attn = h * q_heads * d + 2 * h * kv_heads * d + q_heads * d * h
    if cfg.get("model_type") == "qwen2":
        attn += q_heads * d + 2 * kv_heads * d  # q, k, v biases
    mlp = 3 * h * inter
    return {
        "embedding": vocab * h,
        "linear": layers * (attn + mlp),
        "norms": layers * 2 * h + h,
        "lm_head": 0 if cfg.get("tie_word_embeddings") else vocab * h,
    }


def weight_bytes(cfg: dict[str, Any], weights: str) -> int:
    if weights not in WEIGHT_BYTES:
        raise ConfigError(f"--weights must be one of {sorted(WEIGHT_BYTES)}, got {weights!r}")
    p = count_parameters(cfg)
    per = WEIGHT_BYTES[weights]
    if weights == "int4":
        per += 2 / 128  # an fp16 scale per group of 128
    elif weights == "int8":
        per += 2 / cfg["hidden_size"]  # an fp16 scale per output channel
    quantized = p["linear"] + p["lm_head"]
    # A tied head is still its own tensor in the engine: TensorRT-LLM's Llama converter writes lm_head.weight as
    # a copy of the embedding when tie_word_embeddings is set (tensorrt_llm/models/llama/convert.py, "lm_head.weight
    # has the same weights as embedding"), and so does memos_edge.export_trtllm; weight-only modes leave it fp16.
    tied_head = p["embedding"] if cfg.get("tie_word_embeddings") else 0
    return math.ceil(quantized * per + (p["embedding"] + p["norms"] + tied_head) * 2)


def tokens_per_block_for(spec: KVSpec, target_bytes: int = MIB) -> tuple[int, str]:
    """T for a per-layer K+V slab of about ``target_bytes``: a power of two in 8-128, and what it gives."""
    per_token_layer = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    raw = target_bytes / per_token_layer
    t = 1 << max(0, math.floor(math.log2(raw))) if raw >= 1 else 1
    clamped = min(128, max(8, t))
    slab = per_token_layer * clamped
    if clamped != t:
        why = f"clamped from {t} to the kernel range 8-128: per-layer slab {slab / MIB:.3f} MiB"
    else:
        why = f"per-layer K+V slab {slab / MIB:.3f} MiB"
    return clamped, why


@dataclass
class Plan:
    model: str
    device: str
    weights: str
    kv_dtype: str
    parameters: int
    weight_bytes: int
    os_reserve_bytes: int
    runtime_bytes: int
    free_bytes: int
    kv_budget_bytes: int
    tokens_per_block: int
    granularity: str
    kv_bytes_per_token: int  # all layers, K and V: L·2·H·D·bytes
    kernel_page_bytes: int  # one K (or V) page of one layer and head group: H·T·D·bytes
    layer_slab_bytes: int  # K+V of one layer: 2·H·T·D·bytes
    block_bytes: int  # all layers: L·slab
    blocks: int
    kv_tokens: int
    max_context_by_batch: dict[int, int]
    decode_tokens_per_s_bound: dict[str, float]
    l2_mib: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def plan(
    model: str | dict[str, Any],
    device: str | OrinProfile,
    *,
    kv_dtype: str = "fp16",
    weights: str = "int4",
    os_reserve_gib: float = 2.0,
    runtime_gib: float = 1.5,
    kv_fraction: float = 0.9,
    batches: tuple[int, ...] = (1, 2, 4, 8),
) -> Plan:
    """Plan one model on one Orin module (see the module docstring for the accounting)."""
    profile = device if isinstance(device, OrinProfile) else get_profile(device)
    cfg = model_config(model) if isinstance(model, str) else dict(model)
    name = model if isinstance(model, str) else cfg.get("_name_or_path", "model")
    if kv_dtype not in KV_BYTES:
        raise ConfigError(f"--kv-dtype must be one of {sorted(KV_BYTES)}, got {kv_dtype!r}")
    if kv_dtype == "fp8" and not profile.fp8:
        raise ConfigError(f"{profile.name} is {profile.sm}: FP8 KV needs sm_89 or newer; use int8 or fp16")
    if not 0 < kv_fraction <= 1:
        raise ConfigError(f"kv_fraction must be in (0, 1], got {kv_fraction}")
    torch_dtype = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8", "fp8": "float8_e4m3fn"}[kv_dtype]
    spec = KVSpec.from_hf_config(cfg, dtype=torch_dtype, block_size=8)
    t, why = tokens_per_block_for(spec)
    spec = spec.with_(block_size=t)
    w = weight_bytes(cfg, weights)
    os_bytes, runtime = round(os_reserve_gib * GIB), round(runtime_gib * GIB)
    free = round(profile.memory_gib * GIB) - os_bytes - w - runtime
    budget = max(0, math.floor(kv_fraction * free))
    slab = 2 * spec.num_kv_heads * t * spec.head_dim * spec.dtype.itemsize
    block = spec.num_layers * slab
    blocks = budget // block
    max_pos = cfg.get("max_position_embeddings", 1 << 30)
    by_batch = {b: min((blocks // b) * t, max_pos) for b in batches}
    kv_per_token = spec.bytes_per_token
    bound = {}
    for b in batches:
        for ctx in (1024, by_batch[b]):
            if ctx > 0:
                step_bytes = w + b * ctx * kv_per_token
                bound[f"batch{b}_ctx{ctx}"] = round(b * profile.bandwidth_gbs * 1e9 / step_bytes, 2)
    return Plan(
        model=str(name),
        device=profile.name,
        weights=weights,
        kv_dtype=kv_dtype,
        parameters=sum(count_parameters(cfg).values()),
        weight_bytes=w,
        os_reserve_bytes=os_bytes,
        runtime_bytes=runtime,
        free_bytes=free,
        kv_budget_bytes=budget,
        tokens_per_block=t,
        granularity=why,
        kv_bytes_per_token=kv_per_token,
        kernel_page_bytes=spec.num_kv_heads * t * spec.head_dim * spec.dtype.itemsize,
        layer_slab_bytes=slab,
        block_bytes=block,
        blocks=blocks,
        kv_tokens=blocks * t,
        max_context_by_batch=by_batch,
        decode_tokens_per_s_bound=bound,
        l2_mib=profile.l2_mib,
    )


def human(p: Plan) -> str:
    lines = [
        f"{p.model} on {p.device}: {p.parameters / 1e9:.2f} B parameters, weights {p.weights} "
        f"{p.weight_bytes / GIB:.2f} GiB, KV {p.kv_dtype}",
        f"free after OS {p.os_reserve_bytes / GIB:.1f} GiB, weights and runtime {p.runtime_bytes / GIB:.1f} GiB: "
        f"{p.free_bytes / GIB:.2f} GiB; KV budget {p.kv_budget_bytes / GIB:.2f} GiB",
        f"KV {p.kv_bytes_per_token:,} bytes per token; tokens_per_block {p.tokens_per_block} ({p.granularity}; "
        f"L2 is {p.l2_mib:g} MiB); whole block "
        f"{p.block_bytes / MIB:.2f} MiB; {p.blocks} blocks = {p.kv_tokens:,} tokens",
        "largest context by batch: " + ", ".join(f"{b}×{c:,}" for b, c in p.max_context_by_batch.items()),
        "decode bound (tokens/s): " + ", ".join(f"{k} {v}" for k, v in p.decode_tokens_per_s_bound.items()),
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memos_edge.plan", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model",
        required=True,
        help=f"a known name ({', '.join(sorted(MODELS))}), a model folder, or a config.json",
    )
    parser.add_argument("--device", required=True, choices=sorted(PROFILES))
    parser.add_argument("--kv-dtype", default="fp16", choices=sorted(KV_BYTES))
    parser.add_argument("--weights", default="int4", choices=sorted(WEIGHT_BYTES))
    parser.add_argument("--os-reserve-gib", type=float, default=2.0)
    parser.add_argument("--runtime-gib", type=float, default=1.5)
    parser.add_argument("--kv-fraction", type=float, default=0.9)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    p = plan(
        args.model,
        args.device,
        kv_dtype=args.kv_dtype,
        weights=args.weights,
        os_reserve_gib=args.os_reserve_gib,
        runtime_gib=args.runtime_gib,
        kv_fraction=args.kv_fraction,
    )
    print(json.dumps(p.to_dict()) if args.json else human(p))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
