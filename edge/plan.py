"""Memory planner for a Jetson Orin: how much KV fits, in what blocks, and how fast decode can be at best.

``python -m memos_edge.plan --model llama-2-7b --device orin-nx-16gb --weights int4 --kv-dtype fp16 [--json]``
``python -m memos_edge.plan --model smollm2-135m-instruct --device orin-nano-8gb --weights fp16``

The accounting, all in bytes (GiB = 2³⁰):

* **weights**: parameters × bytes per parameter — fp16 2, int8 1 (+ an fp16 scale per output channel), int4
  0.5 + an fp16 scale per group of 128 (GPTQ/AWQ) — with the token embedding kept in fp16 (TensorRT-LLM's
  weight-only modes quantize the linear layers); a model with tied embeddings (SmolLM2) also carries an fp16
  ``lm_head`` copy of the embedding, as TensorRT-LLM's converter and this package's export write one;
* **free** = ``MemTotal`` − the named terms of :mod:`memos_edge.memory` (OS and desktop, CUDA context, the
  engine's activations for its ``max_num_tokens`` and ``max_batch``, the weights, the engine file's page cache,
  and without mmap the host copy), each with its source; ``memory_model="nominal"`` is the naive
  accounting (nominal memory − 2 GiB OS − 1.5 GiB runtime − weights), kept for comparison;
* **KV budget** = ``kv_fraction`` × free (0.9: TensorRT-LLM's ``kv_cache_free_gpu_memory_fraction`` default).
  Calibrated against NVIDIA's Llama-3-8B INT4 run on AGX Orin 64GB: :func:`calibration_table`;
* **tokens_per_block** T: seed 001 §6.2 wants ~1 MiB blocks for Orin's 2–4 MiB L2. The quantity meant is the
  **per-layer K+V slab** of one block, ``2·H·T·D·bytes``: contiguous in the pool layout ``[blocks, L, 2, H, T,
  D]``, it is what one layer's attention reads of one block, the working set that has to sit in L2. The
  **all-layer block** (``L`` slabs, TensorRT-LLM's allocation unit) is reported beside it: it is L times larger
  and cannot be L2-sized for any real T. T is the largest power of two whose slab is ≤ 1 MiB, kept in XQA's
  16–128; Llama-2-7B in fp16 gives exactly 64 (1 MiB). GQA models would need 256 or more: 1 MiB is then not
  reachable under XQA's 128-token cap, and the plan says so (:func:`tokens_per_block_for`);
* **blocks** = ⌊KV budget / (L × slab)⌋; the largest context × batch that fits follows;
* **decode bound**: one decode step reads every weight once and every cached K/V of every sequence once, so
  tokens/s ≤ batch × bandwidth / (weights + batch × context × KV bytes per token).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from memos_edge.devices import MODELS, PROFILES, OrinProfile, get_profile, model_config
from memos_edge.memory import TRTLLM_BUILD_DEFAULTS, Term, memory_terms, memtotal_from_meminfo

from memos_ref.errors import ConfigError
from memos_ref.spec import KVSpec

__all__ = [
    "NVIDIA_AGX_LLAMA3_8B",
    "Plan",
    "calibration_table",
    "count_parameters",
    "main",
    "nvidia_implied_kv_tokens",
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
    """T for a per-layer K+V slab (``2·H·T·D·bytes``) of at most ``target_bytes``: the largest such power of two,
    kept in 16-128, and a sentence saying what it gives — the slab, the all-layer block, and whether the target
    is reached or why not (the 128-token cap, or the 16-token floor).

    TensorRT-LLM accepts any power of two as ``tokens_per_block``; its XQA decode kernels are JIT-compiled for
    16-128 tokens per block and precompiled for 64 and 128, so the planner stays in 16-128."""
    per_token_layer = 2 * spec.num_kv_heads * spec.head_dim * spec.dtype.itemsize
    raw = target_bytes / per_token_layer
    t = 1 << max(0, math.floor(math.log2(raw))) if raw >= 1 else 1
    clamped = min(128, max(16, t))
    slab = per_token_layer * clamped
    block = slab * spec.num_layers
    xqa = "precompiled XQA kernels" if clamped in (64, 128) else "XQA JIT-compiled (16-128)"
    sizes = f"per-layer slab {slab / MIB:.3f} MiB, all-layer block {block / MIB:.2f} MiB; {xqa}"
    if clamped < t:
        gqa = f"{spec.num_kv_heads} KV heads" + (" (GQA)" if spec.num_kv_heads < 32 else "")
        why = (
            f"1 MiB slab not reachable: it needs T = {t} (> XQA's 128-token cap; {gqa} make a token's slab "
            f"{per_token_layer} B); clamped to 128: {sizes}"
        )
    elif clamped > t:
        why = f"slab over 1 MiB: T = {t} is below XQA's 16-token floor; raised to 16: {sizes}"
    else:
        exact = "exactly 1 MiB" if slab == target_bytes else f"{slab / target_bytes:.2f} of 1 MiB"
        why = f"slab {exact} at T = {clamped}: {sizes}"
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
    runtime_bytes: int  # CUDA context + activations (or the given --runtime-gib)
    free_bytes: int
    kv_budget_bytes: int
    tokens_per_block: int
    granularity: str
    kv_bytes_per_token: int  # all layers, K and V: L·2·H·D·bytes
    kernel_page_bytes: int  # one K (or V) page of one layer and head group: H·T·D·bytes
    layer_slab_bytes: int  # K+V of one layer: 2·H·T·D·bytes — the quantity sized to ~1 MiB
    block_bytes: int  # all layers: L·slab — TensorRT-LLM's allocation unit
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
    memory_model: str = "calibrated"
    memtotal_bytes: int = 0
    memory_terms: list[dict[str, Any]] = field(default_factory=list)  # name, bytes, source (memos_edge.memory)
    slab_target_reached: bool = True  # the per-layer slab is within a factor 2 below 1 MiB
    max_batch: int = TRTLLM_BUILD_DEFAULTS["max_batch_size"]
    max_num_tokens: int = TRTLLM_BUILD_DEFAULTS["max_num_tokens"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


MEMORY_MODELS = ("calibrated", "nominal")


def plan(
    model: str | dict[str, Any],
    device: str | OrinProfile,
    *,
    kv_dtype: str = "fp16",
    weights: str = "int4",
    os_reserve_gib: float | None = None,
    runtime_gib: float | None = None,
    kv_fraction: float = 0.9,
    batches: tuple[int, ...] = (1, 2, 4, 8),
    use_mmap: bool = True,
    max_batch: int = TRTLLM_BUILD_DEFAULTS["max_batch_size"],
    max_num_tokens: int = TRTLLM_BUILD_DEFAULTS["max_num_tokens"],
    memory_model: str = "calibrated",
    memtotal_bytes: int | None = None,
) -> Plan:
    """Plan one model on one Orin module (see the module docstring for the accounting). ``max_batch`` and
    ``max_num_tokens`` are the engine's build shapes (they size the activations); ``memtotal_bytes`` is the
    device's own ``MemTotal`` when known (:func:`memos_edge.memory.memtotal_from_meminfo`)."""
    profile = device if isinstance(device, OrinProfile) else get_profile(device)
    cfg = model_config(model) if isinstance(model, str) else dict(model)
    name = model if isinstance(model, str) else cfg.get("_name_or_path", "model")
    if kv_dtype not in KV_BYTES:
        raise ConfigError(f"--kv-dtype must be one of {sorted(KV_BYTES)}, got {kv_dtype!r}")
    if kv_dtype == "fp8" and not profile.fp8:
        raise ConfigError(f"{profile.name} is {profile.sm}: FP8 KV needs sm_89 or newer; use int8 or fp16")
    if not 0 < kv_fraction <= 1:
        raise ConfigError(f"kv_fraction must be in (0, 1], got {kv_fraction}")
    if memory_model not in MEMORY_MODELS:
        raise ConfigError(f"memory_model must be one of {MEMORY_MODELS}, got {memory_model!r}")
    torch_dtype = {"fp16": "float16", "bf16": "bfloat16", "int8": "int8", "fp8": "float8_e4m3fn"}[kv_dtype]
    spec = KVSpec.from_hf_config(cfg, dtype=torch_dtype, block_size=8)
    t, why = tokens_per_block_for(spec)
    spec = spec.with_(block_size=t)
    w = weight_bytes(cfg, weights)
    host_copy = 0 if use_mmap else w  # README4Jetson: total memory 16.2 GB without mmap, 11.2 GB with
    nominal = round(profile.memory_gib * GIB)
    if memory_model == "nominal":  # the nominal accounting: nominal memory, 2 GiB OS, 1.5 GiB runtime
        os_bytes, runtime = (
            round((2.0 if os_reserve_gib is None else os_reserve_gib) * GIB),
            round((1.5 if runtime_gib is None else runtime_gib) * GIB),
        )
        terms = [
            Term("os_desktop", os_bytes, "nominal accounting: 2 GiB"),
            Term("runtime", runtime, "nominal accounting: 1.5 GiB"),
            Term("weights", w, "the engine's weights"),
            *([Term("host_copy", w, "without --use_mmap")] if host_copy else []),
        ]
        total = nominal
    else:
        terms = memory_terms(
            cfg,
            profile.name,
            nominal,
            w,
            use_mmap=use_mmap,
            max_num_tokens=max_num_tokens,
            max_batch=max_batch,
            os_bytes=None if os_reserve_gib is None else round(os_reserve_gib * GIB),
            runtime_bytes=None if runtime_gib is None else round(runtime_gib * GIB),
            memtotal_bytes=memtotal_bytes,
        )
        total = nominal  # the carve-outs are the first term
    by_name = {term.name: term.bytes for term in terms}
    os_bytes = by_name["os_desktop"]
    runtime = by_name.get("runtime", by_name.get("cuda_context", 0) + by_name.get("activations", 0))
    free = total - sum(by_name.values())
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
        memory_model=memory_model,
        memtotal_bytes=total - by_name.get("carve_outs", 0),
        memory_terms=[asdict(term) for term in terms],
        slab_target_reached=MIB // 2 < slab <= MIB,
        max_batch=max_batch,
        max_num_tokens=max_num_tokens,
    )


#: README4Jetson.md (TensorRT-LLM v0.12.0-jetson), Llama-3-8B INT4 on AGX Orin 64GB, MAX-N, JetPack 6.1. "Inflight
#: Batching" (90% of free memory to the paged KV cache): GPU memory 48.9 GB with mmap, 44.0 GB without. "Static
#: Batching" with CUDA_LAZY_LOADING (the default): 6.8 GB of GPU memory — the engine without the paged pool.
NVIDIA_AGX_LLAMA3_8B = {"gpu_mmap_gb": 48.9, "gpu_no_mmap_gb": 44.0, "static_gpu_gb": 6.8, "decode_tok_s": 35.9}


def nvidia_implied_kv_tokens(kv_bytes_per_token: int) -> dict[str, int]:
    """The KV tokens NVIDIA's run implies: (48.9 − 6.8) GB of paged pool over the bytes per token, read as GB
    (10⁹) and as GiB (the tools' "GB" is ambiguous); the planner must land within 10% of both."""
    kv = NVIDIA_AGX_LLAMA3_8B["gpu_mmap_gb"] - NVIDIA_AGX_LLAMA3_8B["static_gpu_gb"]
    return {"GB": round(kv * 1e9 / kv_bytes_per_token), "GiB": round(kv * GIB / kv_bytes_per_token)}


def calibration_table() -> list[dict[str, Any]]:
    """The calibrated plan beside NVIDIA's figures for Llama-3-8B INT4 on AGX Orin 64GB, built with trtllm-build's
    defaults as NVIDIA did: one row per quantity, with the nominal accounting for comparison."""
    kw: dict[str, Any] = {"weights": "int4", "kv_dtype": "fp16"}
    cal, off = plan("llama-3-8b", "orin-agx-64gb", **kw), plan("llama-3-8b", "orin-agx-64gb", use_mmap=False, **kw)
    old = plan("llama-3-8b", "orin-agx-64gb", memory_model="nominal", **kw)
    implied = nvidia_implied_kv_tokens(cal.kv_bytes_per_token)
    terms = {t["name"]: t["bytes"] for t in cal.memory_terms}
    non_kv = terms["weights"] + terms["cuda_context"] + terms["activations"]
    n = NVIDIA_AGX_LLAMA3_8B
    return [
        {"quantity": "KV tokens (mmap)", "nvidia": f"{implied['GB']:,}–{implied['GiB']:,}", "plan": cal.kv_tokens,
         "nominal": old.kv_tokens, "error": cal.kv_tokens / (sum(implied.values()) / 2) - 1},
        {"quantity": "non-KV GPU memory, GB", "nvidia": n["static_gpu_gb"], "plan": round(non_kv / 1e9, 2),
         "nominal": round((old.weight_bytes + old.runtime_bytes) / 1e9, 2),
         "error": non_kv / 1e9 / n["static_gpu_gb"] - 1},
        {"quantity": "GPU memory with mmap, GB", "nvidia": n["gpu_mmap_gb"],
         "plan": round((non_kv + cal.blocks * cal.block_bytes) / 1e9, 2),
         "nominal": round((old.weight_bytes + old.runtime_bytes + old.blocks * old.block_bytes) / 1e9, 2),
         "error": (non_kv + cal.blocks * cal.block_bytes) / 1e9 / n["gpu_mmap_gb"] - 1},
        {"quantity": "KV lost without mmap, GB", "nvidia": round(n["gpu_mmap_gb"] - n["gpu_no_mmap_gb"], 2),
         "plan": round((cal.blocks - off.blocks) * cal.block_bytes / 1e9, 2),
         "nominal": round((old.blocks - plan("llama-3-8b", "orin-agx-64gb", memory_model="nominal", use_mmap=False,
                                             **kw).blocks) * old.block_bytes / 1e9, 2),
         "error": (cal.blocks - off.blocks) * cal.block_bytes / 1e9 / (n["gpu_mmap_gb"] - n["gpu_no_mmap_gb"]) - 1},
    ]  # fmt: skip


def human(p: Plan) -> str:
    """The plan in a few lines (INFEASIBLE first, and no bounds, when it does not fit)."""
    terms = ", ".join(f"{t['name']} {t['bytes'] / GIB:.2f}" for t in p.memory_terms)
    lines = [
        f"{p.model} on {p.device}: {p.parameters / 1e9:.2f} B parameters, weights {p.weights} "
        f"{p.weight_bytes / GIB:.2f} GiB, KV {p.kv_dtype}",
        f"memory ({p.memory_model}, GiB): {terms}; free {p.free_bytes / GIB:.2f} GiB; "
        f"KV budget {p.kv_budget_bytes / GIB:.2f} GiB",
        f"KV {p.kv_bytes_per_token:,} bytes per token; tokens_per_block {p.tokens_per_block} ({p.granularity}; "
        f"L2 is {p.l2_mib:g} MiB); {p.blocks} blocks = {p.kv_tokens:,} tokens",
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
    parser.add_argument("--os-reserve-gib", type=float, help="replace the OS and desktop term (default 2847 MiB)")
    parser.add_argument("--runtime-gib", type=float, help="replace the CUDA context + activations terms")
    parser.add_argument("--kv-fraction", type=float, default=0.9)
    parser.add_argument("--batch", type=int, default=TRTLLM_BUILD_DEFAULTS["max_batch_size"], help="max_batch_size")
    parser.add_argument("--max-num-tokens", type=int, default=TRTLLM_BUILD_DEFAULTS["max_num_tokens"])
    parser.add_argument("--meminfo", help="a copy of the device's /proc/meminfo (deploy.sh records one): its MemTotal")
    parser.add_argument("--memory-model", default="calibrated", choices=MEMORY_MODELS)
    parser.add_argument("--no-mmap", action="store_true", help="plan for run.py without --use_mmap (host copy)")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    memtotal = None
    if args.meminfo:
        with open(args.meminfo, encoding="utf-8", errors="replace") as fh:
            memtotal = memtotal_from_meminfo(fh.read(64 * 1024 + 1))
    p = plan(
        args.model,
        args.device,
        kv_dtype=args.kv_dtype,
        weights=args.weights,
        os_reserve_gib=args.os_reserve_gib,
        runtime_gib=args.runtime_gib,
        kv_fraction=args.kv_fraction,
        use_mmap=not args.no_mmap,
        max_batch=args.batch,
        max_num_tokens=args.max_num_tokens,
        memory_model=args.memory_model,
        memtotal_bytes=memtotal,
    )
    print(json.dumps(p.to_dict()) if args.json else human(p))
    return 0 if p.feasible else 2


if __name__ == "__main__":
    raise SystemExit(main())
