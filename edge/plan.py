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

__all__ = [
    "Plan",
    "count_parameters",
    "main",
    "plan",
    "tokens_per_block_for",
    "weight_bytes",
    "weight_parts",
    "weights_read_per_token",
]

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


def _linear_shapes(cfg: dict[str, Any]) -> list[tuple[int, int]]:
    """``(out, in)`` of every linear layer of one decoder layer (qkv, o, fc, gate, proj)."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    q_heads = cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or q_heads
    d = cfg.get("head_dim") or h // q_heads
    return [((q_heads + 2 * kv_heads) * d, h), (h, q_heads * d), (inter, h), (inter, h), (h, inter)]


def weight_parts(cfg: dict[str, Any], weights: str) -> dict[str, int]:
    """Engine weight bytes by part, as TensorRT-LLM 0.12 stores them.

    Weight-only INT4/INT8 (``convert_checkpoint.py --use_weight_only --weight_only_precision int4|int8``, NVIDIA's
    Jetson default) quantizes the decoder's linear layers per output channel (one fp16 scale per output row) and
    leaves ``lm_head`` and ``vocab_embedding`` in fp16 (``tensorrt_llm/quantization/quantize.py``,
    ``quantize_layers``: ``exclude_modules ... or ['*lm_head', '*router', '*vocab_embedding', ...]``). A model with
    tied embeddings still gets its own fp16 ``lm_head`` copy (``tensorrt_llm/models/llama/convert.py``, and
    :mod:`memos_edge.export_trtllm`). Norms and biases stay fp16."""
    if weights not in WEIGHT_BYTES:
        raise ConfigError(f"--weights must be one of {sorted(WEIGHT_BYTES)}, got {weights!r}")
    p = count_parameters(cfg)
    shapes = _linear_shapes(cfg)
    matrix = sum(o * i for o, i in shapes) * cfg["num_hidden_layers"]
    out_rows = sum(o for o, _ in shapes) * cfg["num_hidden_layers"]
    biases = p["linear"] - matrix  # Qwen2's q/k/v biases: fp16
    per = WEIGHT_BYTES[weights]
    linear = math.ceil(matrix * per) + (2 * out_rows if weights in ("int4", "int8") else 0) + 2 * biases
    vocab_h = cfg["vocab_size"] * cfg["hidden_size"]
    return {"embedding": 2 * vocab_h, "lm_head": 2 * vocab_h, "linear": linear, "norms": 2 * p["norms"]}


def weight_bytes(cfg: dict[str, Any], weights: str) -> int:
    """All engine weight bytes (:func:`weight_parts`)."""
    return sum(weight_parts(cfg, weights).values())


def weights_read_per_token(cfg: dict[str, Any], weights: str) -> int:
    """Weight bytes one decode step reads: every linear layer, ``lm_head`` and the norms once, and one row of the
    embedding table (the token looked up), not the whole table."""
    parts = weight_parts(cfg, weights)
    return parts["linear"] + parts["lm_head"] + parts["norms"] + 2 * cfg["hidden_size"]


def tokens_per_block_for(spec: KVSpec, target_bytes: int = MIB) -> tuple[int, str]:
    """T for a per-layer K+V slab of about ``target_bytes``: a power of two kept in 16-128, and what it gives.

    TensorRT-LLM accepts any power of two as ``tokens_per_block``; its XQA decode kernels are JIT-compiled for
    16-128 tokens per block and precompiled for 64 and 128, so the planner stays in 16-128."""
    per_token_layer = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    raw = target_bytes / per_token_layer
    t = 1 << max(0, math.floor(math.log2(raw))) if raw >= 1 else 1
    clamped = min(128, max(16, t))
    slab = per_token_layer * clamped
    xqa = "precompiled XQA kernels" if clamped in (64, 128) else "XQA JIT-compiled (16-128)"
    if clamped != t:
        why = f"clamped from {t} to XQA's 16-128: per-layer slab {slab / MIB:.3f} MiB; {xqa}"
    else:
        why = f"per-layer K+V slab {slab / MIB:.3f} MiB; {xqa}"
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
    decode_tokens_per_s_bound: dict[str, float]  # empty when the plan is infeasible
    l2_mib: float
    use_mmap: bool = True
    host_copy_bytes: int = 0  # without --use_mmap the runtime holds a host copy of the weights too
    weights_read_per_token: int = 0  # linear layers + lm_head + norms + one embedding row
    feasible: bool = True
    why_infeasible: str = ""

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
    use_mmap: bool = True,
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
    host_copy = 0 if use_mmap else w  # README4Jetson: total memory 16.2 GB without mmap, 11.2 GB with
    os_bytes, runtime = round(os_reserve_gib * GIB), round(runtime_gib * GIB)
    free = round(profile.memory_gib * GIB) - os_bytes - w - host_copy - runtime
    budget = max(0, math.floor(kv_fraction * free))
    slab = 2 * spec.num_kv_heads * t * spec.head_dim * spec.dtype.itemsize
    block = spec.num_layers * slab
    blocks = budget // block
    max_pos = cfg.get("max_position_embeddings", 1 << 30)
    by_batch = {b: min((blocks // b) * t, max_pos) for b in batches}
    kv_per_token = spec.bytes_per_token
    read = weights_read_per_token(cfg, weights)
    why_not = ""
    if free <= 0:
        twice = ", held twice without mmap" if host_copy else ""
        why_not = f"the weights ({w / GIB:.2f} GiB{twice}) and the allowances leave {free / GIB:.2f} GiB"
    elif blocks == 0:
        why_not = f"the KV budget {budget / MIB:.1f} MiB holds no {block / MIB:.2f} MiB block"
    bound: dict[str, float] = {}
    for b in batches if not why_not else ():
        for ctx in sorted({min(1024, by_batch[b]), by_batch[b]}):
            if ctx > 0:
                step_bytes = read + b * ctx * kv_per_token  # weights once, every row's cached K/V once
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
        use_mmap=use_mmap,
        host_copy_bytes=host_copy,
        weights_read_per_token=read,
        feasible=not why_not,
        why_infeasible=why_not,
    )


def human(p: Plan) -> str:
    """The plan in a few lines (INFEASIBLE first, and no bounds, when it does not fit)."""
    twice = " (twice: no mmap)" if p.host_copy_bytes else ""
    lines = [
        f"{p.model} on {p.device}: {p.parameters / 1e9:.2f} B parameters, weights {p.weights} "
        f"{p.weight_bytes / GIB:.2f} GiB, KV {p.kv_dtype}",
        f"free after OS {p.os_reserve_bytes / GIB:.1f} GiB, weights{twice}, runtime {p.runtime_bytes / GIB:.1f} GiB: "
        f"{p.free_bytes / GIB:.2f} GiB; KV budget {p.kv_budget_bytes / GIB:.2f} GiB",
        f"KV {p.kv_bytes_per_token:,} bytes per token; tokens_per_block {p.tokens_per_block} ({p.granularity}; "
        f"L2 is {p.l2_mib:g} MiB); whole block "
        f"{p.block_bytes / MIB:.2f} MiB; {p.blocks} blocks = {p.kv_tokens:,} tokens",
    ]
    if not p.feasible:
        return "\n".join([f"INFEASIBLE: {p.why_infeasible}", *lines])
    lines += [
        "largest context by batch: " + ", ".join(f"{b}×{c:,}" for b, c in p.max_context_by_batch.items()),
        f"decode bound (tokens/s; {p.weights_read_per_token / GIB:.2f} GiB of weights read per token + KV): "
        + ", ".join(f"{k} {v}" for k, v in p.decode_tokens_per_s_bound.items()),
        f"run with --max_tokens_in_paged_kv_cache {p.kv_tokens}" + (" --use_mmap" if p.use_mmap else ""),
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
    parser.add_argument("--no-mmap", action="store_true", help="plan for run.py without --use_mmap (host copy)")
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
        use_mmap=not args.no_mmap,
    )
    print(json.dumps(p.to_dict()) if args.json else human(p))
    return 0 if p.feasible else 2


if __name__ == "__main__":
    raise SystemExit(main())
