"""``python -m memos_kernels.bench [--quick] [--json] [--no-extras]``: the paged decode kernel on a GPU.

Decode attention over paged caches with Llama-3-8B's geometry (32/8 heads × 128): fp16 at batch 1/8/64 ×
context 1k/8k/32k × block 16/64, then bf16, int8 and fp8 at batch 8 (8k and 32k). Every figure is timed with
``triton.testing.do_bench`` (CUDA events, L2 flushed between repeats; median and min–max); the bytes are counted
exactly (K/V, scales, query/output, tables, split partials) and set against a device-to-device copy measured in
the same run (``decode_fraction_of_copy_bw``); SDPA over a contiguous cache of the same size runs beside it with
its backend recorded; each output is checked against the reference. The summary adds the quantized speedup over
fp16, ``prefill_tflops`` and the CUDA C++ teaching kernel against Triton.

Without a CUDA device nothing is measured: the JSON says ``"gpu": false`` and why (the interpreter's timings
say nothing about a GPU); ``--quick`` then runs one tiny case through Triton's interpreter to prove the command.
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

__all__ = [
    "bytes_read",
    "cases",
    "decode_case",
    "envelope",
    "format_table",
    "machine_info",
    "main",
    "measure",
    "run",
    "skipped",
]


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
    """Bytes moved per second (read + write) by a device-to-device copy, timed like the kernels (L2 flushed)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), device, budget_ms=budget_ms).median_ms
    return 2 * nbytes / (ms / 1e3)


def _sdpa(q4: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[Any, str]:
    """SDPA over a contiguous cache with the first backend that accepts the shapes (flash, cuDNN, efficient,
    math): the callable and the backend's name, so the JSON says which one was measured."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    for backend in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
                    SDPBackend.MATH):  # fmt: skip

        def call(backend: Any = backend) -> torch.Tensor:
            with sdpa_kernel([backend]):
                return F.scaled_dot_product_attention(q4, k, v, enable_gqa=True)

        try:
            call()
        except RuntimeError:
            continue
        return call, backend.name.lower()
    raise RuntimeError("no SDPA backend accepts these shapes")


def _make_case(device, *, batch, context, hq, hkv, d, dtype, block) -> tuple[Any, ...]:
    """Query, one layer's pool (shuffled tables), lengths and the dequantizing arguments of a case."""
    quant = {"int8": "int8", "fp8": "fp8"}.get(dtype, "none")
    blocks_per_seq = math.ceil(context / block)
    n = batch * blocks_per_seq
    gen = torch.Generator(device=device).manual_seed(0)
    fdtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype, torch.float16)
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
        pool = torch.randn(n, 2, hkv, block, d, device=device, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        sc = torch.rand(n, 2, hkv, device=device, generator=gen) * 0.01
        kwargs = dict(quant="fp8", key_scale=sc[:, 0], value_scale=sc[:, 1])
    return q, pool, tables, lens, kwargs


def bytes_read(batch: int, context: int, hq: int, hkv: int, d: int, dtype: str, splits: int) -> int:
    """Exactly what one decode call moves: K/V (codes), their scales (int8: fp16 per token and head; fp8: fp32 per
    block and head at 16-token blocks), the query and output, the tables and lengths, and the split partials
    written then read (fp32 acc, m, l per query head and split)."""
    elt = {"float16": 2, "bfloat16": 2, "float32": 4, "int8": 1, "fp8": 1}[dtype]
    q_elt = 4 if dtype == "float32" else 2
    kv = batch * context * hkv * d * 2 * elt
    scales = {"int8": batch * context * hkv * 2 * 2, "fp8": batch * math.ceil(context / 16) * hkv * 2 * 4}.get(dtype, 0)
    io = 2 * batch * hq * d * q_elt + batch * 8 * (1 + math.ceil(context / 16))
    partials = 2 * batch * hq * splits * (d + 2) * 4
    return kv + scales + io + partials


def decode_case(decode, device, *, budget_ms, **shape) -> dict[str, Any]:
    """One decode case: the paged kernel's time (median, min-max), exact bytes and bandwidth, its output checked
    against the reference on the first sequence, and SDPA over a contiguous cache (float KV) with its backend."""
    from memos_kernels.paged_decode import paged_decode_reference, plan_decode

    q, pool, tables, lens, kwargs = _make_case(device, **shape)
    batch, context, dtype = shape["batch"], shape["context"], shape["dtype"]
    out = torch.empty_like(q)
    call = lambda: decode(q, pool[:, 0], pool[:, 1], tables, lens, out=out, **kwargs)  # noqa: E731
    call()
    first = tables[0]  # check the first sequence on its own blocks (the reference dequantizes whatever it gets)
    sub = {k: v[first] if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    local = torch.arange(first.numel(), device=device)[None]
    want = paged_decode_reference(q[:1], pool[first, 0], pool[first, 1], local, lens[:1], **sub).float()
    err = float((out[:1].float() - want).abs().max())
    paged = time_ms(call, device, budget_ms=budget_ms)
    splits = plan_decode(q, shape["hkv"], shape["block"], tables.shape[1] * shape["block"]).num_splits
    nbytes = bytes_read(batch, context, shape["hq"], shape["hkv"], shape["d"], dtype, splits)
    row: dict[str, Any] = {
        "batch": batch, "context": context, "heads": f"{shape['hq']}/{shape['hkv']}x{shape['d']}", "kv_dtype": dtype,
        "block_size": shape["block"], "splits": splits, **paged.as_dict("paged"), "bytes": nbytes,
        "kv_bytes": batch * context * shape["hkv"] * shape["d"] * 2 * (1 if dtype in ("int8", "fp8") else 2),
        "paged_gbps": nbytes / (paged.median_ms / 1e3) / 1e9, "max_abs_err": err,
        "output_ok": err <= (2e-2 if dtype == "bfloat16" else 5e-3),
    }  # fmt: skip
    if "quant" not in kwargs and device == "cuda":  # the contiguous baseline holds the same K/V densely
        k = torch.randn(batch, shape["hkv"], context, shape["d"], device=device, dtype=q.dtype)
        v = torch.randn_like(k)
        sdpa_call, backend = _sdpa(q[:, :, None], k, v)
        sdpa = time_ms(sdpa_call, device, budget_ms=budget_ms)
        row.update(sdpa.as_dict("sdpa_contiguous"))
        row["sdpa_backend"] = backend
        row["paged_over_sdpa_time"] = paged.median_ms / sdpa.median_ms
        del k, v
    return row


LLAMA3_8B = dict(hq=32, hkv=8, d=128)


def cases(quick: bool) -> list[dict[str, Any]]:
    """The GPU cases: Llama-3-8B geometry (32/8 heads x 128), fp16, batch 1/8/64 x context 1k/8k/32k x block 16/64,
    then bf16, int8 and fp8 at batch 8 with 8k and 32k tokens (the quantized speedup). ``quick``: three cases."""
    if quick:
        base = dict(batch=8, context=8192, dtype="float16", block=16, **LLAMA3_8B)
        return [base, {**base, "dtype": "int8"}, {**base, "dtype": "bfloat16"}]
    out = [dict(batch=b, context=c, dtype="float16", block=t, **LLAMA3_8B)
           for t in (16, 64) for b in (1, 8, 64) for c in (1024, 8192, 32768)]  # fmt: skip
    out += [dict(batch=8, context=c, dtype=dt, block=16, **LLAMA3_8B)
            for dt in ("bfloat16", "int8", "fp8") for c in (8192, 32768)]  # fmt: skip
    return out


def _prefill_tflops(device: str, budget_ms: float) -> dict[str, float]:
    """Chunked prefill (256 queries over a 4,096-token prefix, Llama-3-8B heads, fp16): causal FLOPs over time."""
    from memos_kernels.paged_prefill import paged_prefill_attention

    _, pool, tables, lens, _ = _make_case(device, batch=1, context=4096, dtype="float16", block=16, **LLAMA3_8B)
    chunk = 256
    query = torch.randn(1, LLAMA3_8B["hq"], chunk, LLAMA3_8B["d"], device=device, dtype=torch.float16)
    qlens = torch.tensor([chunk], device=device)
    t = time_ms(lambda: paged_prefill_attention(query, pool[:, 0], pool[:, 1], tables, lens, qlens), device,
                budget_ms=budget_ms)  # fmt: skip
    flops = 4 * LLAMA3_8B["hq"] * LLAMA3_8B["d"] * chunk * (4096 - chunk / 2)
    return {"prefill_ms": t.median_ms, "prefill_tflops": flops / (t.median_ms / 1e3) / 1e12}


def _cuda_cpp_vs_triton(device: str, budget_ms: float) -> dict[str, Any]:
    """The CUDA C++ teaching kernel against the Triton kernel on the base case (fp16, batch 8, 8k, block 16)."""
    from memos_kernels.paged_decode import paged_decode_attention

    try:
        from memos_kernels.cuda import paged_decode as cpp_decode

        q, pool, tables, lens, _ = _make_case(device, batch=8, context=8192, dtype="float16", block=16, **LLAMA3_8B)
        cpp = time_ms(lambda: cpp_decode(q, pool[:, 0], pool[:, 1], tables, lens), device, budget_ms=budget_ms)
        tri = time_ms(lambda: paged_decode_attention(q, pool[:, 0], pool[:, 1], tables, lens), device,
                      budget_ms=budget_ms)  # fmt: skip
        return {
            "cuda_cpp_ms": cpp.median_ms,
            "triton_ms": tri.median_ms,
            "cuda_cpp_over_triton": cpp.median_ms / tri.median_ms,
        }
    except Exception as exc:  # the extension needs nvcc and a build: report, do not fail the run
        return {"cuda_cpp_error": f"{type(exc).__name__}: {exc}"[:300]}


def measure(quick: bool = False, extras: bool = True) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Run the GPU cases: ``(config, results, summary)`` — what :func:`run` wraps in the JSON envelope."""
    from memos_kernels.paged_decode import paged_decode_attention

    device, budget_ms = "cuda", 50.0 if quick else 100.0
    chosen = cases(quick)
    copy_bps = _copy_bandwidth(device, 1 << 30, budget_ms)
    results = []
    for c in chosen:
        row = decode_case(paged_decode_attention, device, budget_ms=budget_ms, **c)
        row["fraction_of_copy_bw"] = row["paged_gbps"] * 1e9 / copy_bps
        results.append(row)
        print(json.dumps(row), file=sys.stderr)
        torch.cuda.empty_cache()
    key = lambda r: f"b{r['batch']}_ctx{r['context']}_t{r['block_size']}_{r['kv_dtype']}"  # noqa: E731
    fp16 = {(r["batch"], r["context"]): r["paged_ms"] for r in results if r["kv_dtype"] == "float16"
            and r["block_size"] == 16}  # fmt: skip
    speedup = {f"{r['kv_dtype']}_ctx{r['context']}": fp16[(8, r["context"])] / r["paged_ms"]
               for r in results if r["kv_dtype"] in ("int8", "fp8") and (8, r["context"]) in fp16}  # fmt: skip
    ratios = [r["paged_over_sdpa_time"] for r in results if "paged_over_sdpa_time" in r]
    summary: dict[str, Any] = {
        "gpu": True,
        "device": torch.cuda.get_device_name(0),
        "timer": "triton.testing.do_bench (L2 flushed between repeats, CUDA events)",
        "copy_gbps": copy_bps / 1e9,
        "decode_fraction_of_copy_bw": {key(r): r["fraction_of_copy_bw"] for r in results},
        "quantized_speedup_over_fp16": speedup,
        "paged_over_contiguous_sdpa_time": statistics.median(ratios) if ratios else None,
        "sdpa_backends": sorted({r["sdpa_backend"] for r in results if "sdpa_backend" in r}),
        "outputs_ok": all(r["output_ok"] for r in results),
    }
    if extras:
        summary.update(_prefill_tflops(device, budget_ms))
        summary.update(_cuda_cpp_vs_triton(device, budget_ms))
    config = {"quick": quick, "gpu": True, "budget_ms": budget_ms, "cases": len(chosen)}
    return config, results, summary


def skipped(reason: str) -> dict[str, Any]:
    """The report without a GPU: nothing measured, and why (the interpreter's timings say nothing of a GPU)."""
    summary = {"gpu": False, "skipped": reason}
    return envelope("kernels", {"gpu": False}, [], summary)


def interpreter_smoke() -> dict[str, Any]:
    """Without a GPU, ``--quick``: one tiny case through Triton's interpreter, to prove the command end to end
    (output checked, bytes counted); its timings say nothing about performance and the summary says so."""
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
    from memos_kernels.paged_decode import paged_decode_attention

    shape = dict(batch=1, context=128, hq=4, hkv=2, d=32, dtype="float32", block=16)
    row = decode_case(paged_decode_attention, "cpu", budget_ms=1.0, **shape)
    copy_bps = _copy_bandwidth("cpu", 64 << 20, 1.0)
    row["fraction_of_copy_bw"] = row["paged_gbps"] * 1e9 / copy_bps
    summary = {"gpu": False, "device": "CPU, Triton interpreter (timings are not performance)",
               "timer": "torch.utils.benchmark.Timer", "copy_gbps": copy_bps / 1e9,
               "outputs_ok": row["output_ok"]}  # fmt: skip
    return envelope("kernels", {"quick": True, "gpu": False, "cases": 1}, [row], summary)


def run(quick: bool = False, extras: bool = True) -> dict[str, Any]:
    """The benchmark's JSON report: :func:`measure` in the envelope on a GPU; without one :func:`skipped`, or
    with ``quick`` the :func:`interpreter_smoke` case."""
    if not torch.cuda.is_available():
        if quick:
            return interpreter_smoke()
        return skipped("no CUDA device: the kernels' timings mean nothing in Triton's interpreter (run on a GPU)")
    return envelope("kernels", *measure(quick, extras))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memos_kernels.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--no-extras", action="store_true", help="skip prefill and the CUDA C++ comparison")
    args = parser.parse_args(argv)
    report = run(args.quick, not args.no_extras)
    if args.json:
        print(json.dumps(report))
    else:
        cols = ["batch", "context", "heads", "kv_dtype", "block_size", "splits", "paged_ms", "paged_gbps",
                "fraction_of_copy_bw", "sdpa_contiguous_ms", "sdpa_backend", "paged_over_sdpa_time",
                "output_ok"]  # fmt: skip
        print(format_table(report["results"], cols))
        print(json.dumps(report["summary"]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
