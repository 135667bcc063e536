"""What a Jetson Orin's memory holds before the KV cache gets any: named terms, each with its source.

The planner (:mod:`memos_edge.plan`) gives the KV cache ``kv_fraction`` (0.9, TensorRT-LLM's
``kv_cache_free_gpu_memory_fraction``) of what is left after these terms, the way TensorRT-LLM sizes its pool
from the free memory it sees once the engine is loaded:

* ``carve_outs``: module nominal − ``MemTotal`` (firmware, GPU and media carve-outs Linux never sees);
* ``os_desktop``: Ubuntu with the desktop at idle, the memory a Jetson owner's OS already uses;
* ``cuda_context``: the CUDA context with the kernels TensorRT and TensorRT-LLM load lazily (CUDA_LAZY_LOADING,
  the default);
* ``activations``: TensorRT's activation memory for the engine's ``max_num_tokens`` and ``max_batch_size``;
* ``weights``: the engine's weights (:func:`memos_edge.plan.weight_parts`);
* ``engine_file_cache``: the engine file's pages in the page cache — mapped with ``--use_mmap``, read without
  it — which ``cudaMemGetInfo`` on Tegra does not count as free;
* ``host_copy``: without ``--use_mmap`` the runtime also keeps the engine in a host buffer.

Calibration against NVIDIA's one published run (Llama-3-8B INT4 on AGX Orin 64GB, ``README4Jetson.md`` of
TensorRT-LLM's ``v0.12.0-jetson`` branch) is shown by :func:`memos_edge.plan.calibration_table`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from memos_ref.errors import ConfigError

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "MEMTOTAL_KIB",
    "OS_DESKTOP_BYTES",
    "TRTLLM_BUILD_DEFAULTS",
    "Term",
    "activation_bytes",
    "memory_terms",
    "memtotal_from_meminfo",
]

MIB = 2**20
GIB = 2**30

#: ``MemTotal`` (kB) per module and where the figure comes from. Modules with no published figure reuse their
#: sibling's carve-out and say so; pass the device's own ``/proc/meminfo`` (``--meminfo``) to replace it.
MEMTOTAL_KIB: dict[str, tuple[int, str]] = {
    "orin-agx-64gb": (64_349_016, "an AGX Orin 64GB devkit's /proc/meminfo (L4T r36.4): MemTotal 64,349,016 kB"),
    "orin-agx-32gb": (
        32 * 2**20 - (64 * 2**20 - 64_349_016),
        "estimated: 32 GiB less the AGX Orin 64GB's carve-outs (no published MemTotal)",
    ),
    "orin-nano-8gb": (7772 * 1024, "a tegrastats sample on an 8 GB Orin at idle: 'RAM 2847/7772MB'"),
    "orin-nano-8gb-super": (7772 * 1024, "the Orin Nano 8GB's MemTotal (same module, higher clocks)"),
    "orin-nx-8gb": (7772 * 1024, "estimated: the Orin Nano 8GB's MemTotal (no published figure)"),
    "orin-nx-16gb": (
        16 * 2**20 - (8 * 2**20 - 7772 * 1024),
        "estimated: 16 GiB less the 8 GB modules' carve-outs (no published MemTotal)",
    ),
}

#: Ubuntu and the GNOME desktop at idle: the tegrastats sample above, 2,847 MB (MiB) used of 7,772.
OS_DESKTOP_BYTES = 2847 * MIB
#: The CUDA context with lazily loaded kernels. README4Jetson's static-batching table: eager loading costs 1.0 GB
#: more (7.8 vs 6.8 GB); what lazy loading keeps is estimated at 0.5 GiB — with the weights and the activations
#: below, NVIDIA's 6.8 GB non-KV figure is met within 10% (tests/test_edge_plan.py).
CUDA_CONTEXT_BYTES = 512 * MIB
#: trtllm-build 0.12's defaults for the shapes that size activations (NVIDIA built its engine with them).
TRTLLM_BUILD_DEFAULTS = {"max_batch_size": 256, "max_num_tokens": 8192}

_MAX_MEMINFO = 64 * 1024


@dataclass(frozen=True)
class Term:
    """One named use of the module's memory, in bytes, and where its size comes from."""

    name: str
    bytes: int
    source: str


def activation_bytes(cfg: dict[str, Any], max_num_tokens: int, max_batch: int) -> int:
    """TensorRT's activation peak, estimated from the shapes: per token in flight, the MLP's gate and up outputs
    and their SwiGLU product (3 × intermediate), the qkv projection and four hidden-size buffers (residual, norm,
    attention output, MLP output), fp16; plus the last-token logits of every row in fp32 (``max_batch`` ×
    vocab × 4). TensorRT reuses these buffers from layer to layer, so one layer's worth is the peak."""
    if max_num_tokens < 1 or max_batch < 1:
        raise ConfigError(f"max_num_tokens and max_batch must be >= 1, got {max_num_tokens} and {max_batch}")
    h, ff = cfg["hidden_size"], cfg["intermediate_size"]
    q, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    d = cfg.get("head_dim") or h // q
    per_token = 2 * (3 * ff + 4 * h + (q + 2 * kv) * d)
    return max_num_tokens * per_token + max_batch * cfg["vocab_size"] * 4


def memtotal_from_meminfo(text: str) -> int:
    """``MemTotal`` in bytes from the text of a ``/proc/meminfo`` (bounded; a missing field is refused)."""
    if len(text) > _MAX_MEMINFO:
        raise ConfigError(f"meminfo text is {len(text)} characters, over the {_MAX_MEMINFO} bound")
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "MemTotal":
            fields = rest.split()
            if len(fields) == 2 and fields[1] == "kB" and fields[0].isdigit():
                return int(fields[0]) * 1024
            raise ConfigError(f"MemTotal line not understood: {line!r} (expected 'MemTotal: N kB')")
    raise ConfigError("no MemTotal line in the meminfo text")


def memory_terms(
    cfg: dict[str, Any],
    device: str,
    nominal_bytes: int,
    weight_bytes: int,
    *,
    use_mmap: bool,
    max_num_tokens: int,
    max_batch: int,
    os_bytes: int | None = None,
    runtime_bytes: int | None = None,
    memtotal_bytes: int | None = None,
) -> list[Term]:
    """The terms, in the order they are taken. ``os_bytes`` replaces the OS-and-desktop term, ``runtime_bytes``
    the CUDA context and activations together, ``memtotal_bytes`` (from the device's ``/proc/meminfo``) the
    module's published ``MemTotal``."""
    if memtotal_bytes is None:
        kib, where = MEMTOTAL_KIB.get(device, (nominal_bytes // 1024, "nominal: no MemTotal known for this module"))
        memtotal_bytes = kib * 1024
    else:
        where = "the device's /proc/meminfo (--meminfo)"
    if memtotal_bytes > nominal_bytes:
        raise ConfigError(f"MemTotal {memtotal_bytes} B exceeds the module's nominal {nominal_bytes} B")
    terms = [Term("carve_outs", nominal_bytes - memtotal_bytes, f"nominal − MemTotal; MemTotal from {where}")]
    if os_bytes is None:
        terms.append(Term("os_desktop", OS_DESKTOP_BYTES, "Ubuntu + desktop at idle: tegrastats 'RAM 2847/7772MB'"))
    else:
        terms.append(Term("os_desktop", os_bytes, "given (--os-reserve-gib)"))
    if runtime_bytes is None:
        terms.append(Term("cuda_context", CUDA_CONTEXT_BYTES, "estimate with CUDA_LAZY_LOADING (README4Jetson)"))
        act = activation_bytes(cfg, max_num_tokens, max_batch)
        terms.append(Term("activations", act, f"max_num_tokens {max_num_tokens}, max_batch {max_batch}: shapes"))
    else:
        terms.append(Term("runtime", runtime_bytes, "given (--runtime-gib): CUDA context and activations"))
    terms.append(Term("weights", weight_bytes, "the engine's weights as TensorRT-LLM stores them"))
    terms.append(
        Term(
            "engine_file_cache",
            weight_bytes,
            "page cache of the engine file; cudaMemGetInfo on Tegra does not report it free",
        )
    )
    if not use_mmap:
        terms.append(Term("host_copy", weight_bytes, "run.py without --use_mmap keeps the engine in a host buffer"))
    return terms
