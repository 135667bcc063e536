"""``python -m memos_kernels.bench [--quick] [--json]``: the paged decode kernel against the memory system.

On a GPU: decode attention over paged caches around a base case (Llama-3-8B heads 32/8×128, fp16, batch 8,
8k context, 16-token blocks), one dimension varied at a time — batch 1-64, context 1k-32k, Qwen2.5-7B's heads
(28/4×128), bf16, int8 and fp8 KV, block sizes 16-128. For each: time, the bandwidth achieved (K/V bytes read
over time) and its fraction of the measured device-to-device copy bandwidth, beside
``scaled_dot_product_attention`` over a contiguous cache of the same size. One command, a few minutes.

Without a GPU, ``--quick`` runs one tiny case through Triton's interpreter: it checks the command end to end,
and its timings say nothing about performance.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import math
import os
import platform
import statistics
import sys
from typing import Any

import torch
from memos_kernels.timing import time_ms

__all__ = ["envelope", "format_table", "machine_info", "main", "measure", "run"]


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on."""
    import triton

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "platform": platform.platform(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def envelope(name: str, config: dict[str, Any], results: list[dict[str, Any]], summary: dict[str, Any]) -> dict:
    """The one JSON object the benchmark prints (the same keys as ``memos_ref.bench``'s reports)."""
    try:
        version = importlib.metadata.version("memos-ref")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a bare checkout
        version = "unknown"
    return {
        "bench": name,
        "version": version,
        "machine": machine_info(),
        "config": config,
        "results": results,
        "summary": summary,
    }


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain-text table of ``rows`` (missing cells blank; floats to three decimals below 100)."""

    def fmt(value: Any) -> str:
        if isinstance(value, float):
            return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
        return str(value)

    cells = [list(columns)] + [[fmt(row.get(c, "")) for c in columns] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(columns))]
    lines = ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _copy_bandwidth(device: str, nbytes: int, budget_ms: float) -> float:
    """Bytes moved per second (read + write) by a device-to-device copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, budget_ms=budget_ms).median_ms
    return 2 * nbytes / (ms / 1e3)


def _case(decode, device, *, batch, context, hq, hkv, d, dtype, block, budget_ms) -> dict[str, Any]:
    """One decode case: the paged kernel's time and bandwidth, and SDPA over a contiguous cache (float KV)."""
    import torch.nn.functional as F

    quant = {"int8": "int8", "fp8": "fp8"}.get(dtype, "none")
    elt = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1, "fp8": 1}[dtype]
    blocks_per_seq = math.ceil(context / block)
    n = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    fdtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype, torch.float16)
    tables = torch.randperm(n, device=device, generator=gen).view(batch, blocks_per_seq)
    lens = torch.full((batch,), context, device=device, dtype=torch.long)
    q = torch.randn(batch, hq, d, device=device, dtype=fdtype, generator=gen)
    kwargs: dict[str, Any] = {}
    if quant == "none":
        pool = torch.randn(n, 2, hkv, block, d, device=device, dtype=fdtype, generator=gen)
    elif quant == "int8":
        pool = torch.randint(-127, 128, (n, 2, hkv, block, d), device=device, dtype=torch.int8, generator=gen)
        sc = torch.rand(n, 2, hkv, block, device=device, generator=gen).to(torch.float16) * 0.01
        kwargs = dict(quant="int8", key_scale=sc[:, 0], value_scale=sc[:, 1])
    else:
        f8 = (torch.randn(n, 2, hkv, block, d, device=device, generator=gen)).to(torch.float8_e4m3fn)
        pool = f8.view(torch.uint8)
        sc = torch.rand(n, 2, hkv, device=device, generator=gen) * 0.01
        kwargs = dict(quant="fp8", key_scale=sc[:, 0], value_scale=sc[:, 1])
    paged = time_ms(lambda: decode(q, pool[:, 0], pool[:, 1], tables, lens, **kwargs), device, budget_ms=budget_ms)
    paged_ms = paged.median_ms
    kv_bytes = batch * context * hkv * d * 2 * elt
    row: dict[str, Any] = {
        "batch": batch, "context": context, "heads": f"{hq}/{hkv}x{d}", "kv_dtype": dtype, "block_size": block,
        **paged.as_dict("paged"), "kv_bytes": kv_bytes, "paged_gbps": kv_bytes / (paged_ms / 1e3) / 1e9,
    }  # fmt: skip
    if quant == "none":  # the contiguous baseline holds the same K/V densely
        k = torch.randn(batch, hkv, context, d, device=device, dtype=fdtype, generator=gen)
        v = torch.randn_like(k)
        q4 = q[:, :, None]
        sdpa = time_ms(lambda: F.scaled_dot_product_attention(q4, k, v, enable_gqa=True), device, budget_ms=budget_ms)
        row.update(sdpa.as_dict("sdpa_contiguous"))
        row["paged_over_sdpa_time"] = paged_ms / sdpa.median_ms
    return row


def measure(quick: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Run the cases: ``(config, results, summary)`` — what :func:`run` wraps in the JSON envelope (and what a
    caller with its own envelope can take instead)."""
    gpu = torch.cuda.is_available()
    if not gpu:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
    from memos_kernels.paged_decode import paged_decode_attention

    device = "cuda" if gpu else "cpu"
    budget_ms = 100.0 if gpu else 1.0  # on a CPU: one warm-up and one timed call through the interpreter
    if not gpu or quick:
        base = dict(batch=1, context=128 if not gpu else 1024, hq=4, hkv=2, d=32, dtype="float32", block=16)
        cases = [base] if not gpu else [base, {**base, "dtype": "float16"}, {**base, "dtype": "int8"}]
    else:
        base = dict(batch=8, context=8192, hq=32, hkv=8, d=128, dtype="float16", block=16)
        cases = [base]
        cases += [{**base, "batch": b} for b in (1, 32, 64)]
        cases += [{**base, "context": c} for c in (1024, 4096, 16384, 32768)]
        cases += [{**base, "hq": 28, "hkv": 4}]
        cases += [{**base, "dtype": t} for t in ("bfloat16", "int8", "fp8")]
        cases += [{**base, "block": b} for b in (32, 64, 128)]
    copy_bps = _copy_bandwidth(device, (1 << 30) if gpu else (64 << 20), budget_ms)
    results = []
    for c in cases:
        row = _case(paged_decode_attention, device, budget_ms=budget_ms, **c)
        row["fraction_of_copy_bw"] = row["paged_gbps"] * 1e9 / copy_bps
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
    longest = max(results, key=lambda r: (r["context"], r["kv_dtype"] in ("float16", "float32")))
    ratios = [r["paged_over_sdpa_time"] for r in results if "paged_over_sdpa_time" in r]
    summary = {
        "device": torch.cuda.get_device_name(0) if gpu else "CPU, Triton interpreter (timings are not performance)",
        "timer": "triton.testing.do_bench" if gpu else "torch.utils.benchmark.Timer",
        "copy_gbps": copy_bps / 1e9,
        "decode_bw_fraction_of_copy": longest["fraction_of_copy_bw"],
        "paged_over_contiguous_sdpa_time": statistics.median(ratios) if ratios else None,
    }
    config = {"quick": quick, "gpu": gpu, "budget_ms": budget_ms, "cases": len(cases)}
    return config, results, summary


def run(quick: bool = False) -> dict[str, Any]:
    """The benchmark's JSON report: :func:`measure` in the envelope."""
    return envelope("kernels", *measure(quick))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memos_kernels.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = run(args.quick)
    if args.json:
        print(json.dumps(report))
    else:
        cols = ["batch", "context", "heads", "kv_dtype", "block_size", "paged_ms", "paged_gbps",
                "fraction_of_copy_bw", "sdpa_contiguous_ms", "paged_over_sdpa_time"]  # fmt: skip
        print(format_table(report["results"], cols))
        print(json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
