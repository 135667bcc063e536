"""``bench quant``: accuracy and memory of every KV quantization scheme, and their codec throughput.

Accuracy (:mod:`memos_ref.bench.accuracy`) on the shipped model over the held-out corpus (stdlib code it never
saw) at a context of 1,024 tokens: perplexity, mean KL divergence of next-token distributions against the
fp32 cache, greedy agreement over 256 generated tokens, and bytes per token (against fp16). KL again on a
random-init wider Llama (8 layers, 8 KV heads × 64 dims), whose K/V have no trained structure. Throughput:
quantize and dequantize of one layer's keys ``[8, 4096, 128]`` fp32, GB/s of fp32 input, measured side by side.

``--model smollm2-135m-instruct``: the same accuracy figures on a real pretrained model over held-out English
prose (:func:`run_pretrained`), the summary's fields unchanged.
"""

from __future__ import annotations

from typing import Any

import torch
from tqdm.auto import tqdm

from memos_ref.bench.accuracy import PROSE_FILE, calibrate_layer_scales, evaluate, prose_token_ids
from memos_ref.bench.common import envelope, format_table, time_calls_ms
from memos_ref.errors import ConfigError
from memos_ref.quant import FP8E4M3, KIVI, Float16, PerTensorInt8, PerTokenInt8

__all__ = ["human", "plot", "pretrained_schemes", "run", "run_pretrained", "schemes"]


def schemes(layer_scales: torch.Tensor | None) -> list[tuple[str, Any, dict[str, Any]]]:
    """(name, quantizer, pool options) for every scheme compared."""
    return [
        ("fp16", Float16(), {}),
        ("int8_tensor_fixed0.1", PerTensorInt8(scale=0.1), {}),
        ("int8_tensor_calibrated", PerTensorInt8(), {"layer_scales": layer_scales}),
        ("int8_token", PerTokenInt8(), {}),
        ("fp8_e4m3", FP8E4M3(), {}),
        ("kivi4_g32", KIVI(4, 32), {"residual_tokens": 128}),
        ("kivi4_g128", KIVI(4, 128), {"residual_tokens": 128}),
        ("kivi2_g32", KIVI(2, 32), {"residual_tokens": 128}),
        ("kivi2_g32_no_residual", KIVI(2, 32), {"residual_tokens": 0}),
        ("kivi2_g128", KIVI(2, 128), {"residual_tokens": 128}),
        ("aging_int8_after256", PerTokenInt8(), {"residual_tokens": 256}),
        ("aging_kivi4_after256", KIVI(4, 32), {"residual_tokens": 256}),
    ]


def _corpus_ids(n: int, offset: int = 0) -> torch.Tensor:
    from memos_ref.model import shipped_model_dir

    text = (shipped_model_dir().parent / "data" / "heldout_stdlib.txt").read_bytes()
    return torch.tensor([list(text[offset : offset + n])])


def _wide_model():
    from transformers import LlamaConfig

    from memos_ref.model.llama import LlamaConfig as Cfg
    from memos_ref.model.llama import LlamaForward

    torch.manual_seed(0)
    hf = LlamaConfig(
        vocab_size=264,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=2048,
    )
    model = LlamaForward(Cfg.from_hf_dict(hf.to_dict()))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.ndim > 1 else p.fill_(1.0)
    return model.eval()


def _throughput(quick: bool) -> list[dict[str, Any]]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 512 if quick else 4096, 128, generator=g)  # [H, T, D] fp32
    gb = x.nbytes / 1e9
    rows = []
    for q in (Float16(), PerTensorInt8(), PerTokenInt8(), FP8E4M3(), KIVI(4, 32), KIVI(2, 32)):
        qt = q.quantize(x, "key")
        enc_ms, _ = time_calls_ms(lambda q=q: q.quantize(x, "key"), repeats=3 if quick else 7)
        dec_ms, _ = time_calls_ms(lambda q=q, qt=qt: q.dequantize(qt), repeats=3 if quick else 7)
        rows.append({"scheme": q.name, "quantize_gb_s": gb / (enc_ms / 1e3), "dequantize_gb_s": gb / (dec_ms / 1e3)})
    return rows


def pretrained_schemes(layer_scales: torch.Tensor | None) -> list[tuple[str, Any, dict[str, Any]]]:
    """The schemes compared on a real model: :func:`schemes` plus 4-bit KIVI without its residual window."""
    compared = schemes(layer_scales)
    at = [name for name, _, _ in compared].index("kivi2_g32")
    compared.insert(at, ("kivi4_g32_no_residual", KIVI(4, 32), {"residual_tokens": 0}))
    return compared


#: Sizes of ``bench quant --model``: context tokens measured, greedy prompt and generated tokens.
PRETRAINED_SIZES = {"full": (1024, 256, 64), "quick": (64, 32, 4)}
#: Schemes of ``--quick`` runs (both paths).
QUICK_SCHEMES = ("int8_token", "kivi4_g32", "kivi2_g32")
PRETRAINED_QUICK_SCHEMES = ("int8_token", "kivi2_g32_no_residual")


def _measure(
    model: Any, ids: torch.Tensor, compared: list, opts: dict[str, int], bar: Any
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The fp32 reference and one :func:`~memos_ref.bench.accuracy.evaluate` result per compared scheme."""
    reference = evaluate(model, ids, None, **opts)
    bar.update()
    results = []
    for name, scheme, kwargs in compared:
        bar.set_postfix_str(name)
        r = evaluate(model, ids, scheme, reference=reference, **opts, **kwargs)
        r["scheme"] = name
        results.append(r)
        bar.update()
    return reference, results


def _row(r: dict[str, Any], fp16_bytes: float, wide_kl: float | None) -> dict[str, Any]:
    row = {
        "scheme": r["scheme"],
        "ppl": r["ppl"],
        "ppl_delta_pct": r["ppl_delta_pct"],
        "kl_mean": r["kl_mean"],
        "kl_mean_wide_random": wide_kl,
        "greedy_agreement": r["greedy_agreement"],
        "mismatches": r["mismatches"],
        "mismatches_near_tie": r["mismatches_near_tie"],
        "identical_prefix_tokens": r["identical_prefix_tokens"],
        "bytes_per_token": r["bytes_per_token"],
        "bytes_per_token_ratio": r["bytes_per_token"] / fp16_bytes,
        "pool_stats": r["pool_stats"],
    }
    if wide_kl is None:
        del row["kl_mean_wide_random"]
    return row


def _summary(reference: dict[str, Any], rows: list[dict[str, Any]], fp16_bytes: float) -> dict[str, Any]:
    summary: dict[str, Any] = {"ppl_fp32": round(reference["ppl"], 4), "fp16_bytes_per_token": fp16_bytes}
    for row in rows:
        summary[row["scheme"]] = {
            k: float(f"{row[k]:.4g}") for k in ("ppl_delta_pct", "kl_mean", "greedy_agreement", "bytes_per_token_ratio")
        }
    return summary


def run(quick: bool = False, progress: bool = True, model: str | None = None) -> dict[str, Any]:
    """Accuracy and memory of every scheme on the shipped model (and codec throughput), or, with ``model``
    (a name of :data:`memos_ref.model.PRETRAINED`, e.g. ``"smollm2-135m-instruct"``), on that real model over
    held-out English prose at 1,024 tokens (:func:`run_pretrained`)."""
    if model is not None:
        return run_pretrained(model, quick=quick, progress=progress)
    from memos_ref.model import load_model

    context = 256 if quick else 1024
    generate = 32 if quick else 256
    prompt = 128 if quick else 256
    model = load_model()
    ids = _corpus_ids(context)
    scales = calibrate_layer_scales(model, _corpus_ids(1024, offset=200_000))  # calibrated on other text
    compared = schemes(scales)
    if quick:
        compared = [s for s in compared if s[0] in QUICK_SCHEMES]
    bar = tqdm(total=len(compared) + 3, desc="bench quant", disable=not progress)
    opts = dict(generate_tokens=generate, prompt_tokens=prompt)
    reference, results = _measure(model, ids, compared, opts, bar)
    fp16_bytes = model.kv_spec().bytes_per_token / 2  # the fp32 model's KV at fp16
    # KL on a random-init wider model (no trained structure in its K/V)
    wide = _wide_model()
    wide_ids = _corpus_ids(256 if quick else 512, offset=50_000)
    wide_ref = evaluate(wide, wide_ids, None, generate_tokens=8, prompt_tokens=64)
    wide_kl = {}
    for name, scheme, kwargs in compared:
        if "layer_scales" in kwargs:
            kwargs = {"layer_scales": calibrate_layer_scales(wide, _corpus_ids(512, offset=200_000))}
        wide_kl[name] = evaluate(
            wide, wide_ids, scheme, reference=wide_ref, generate_tokens=8, prompt_tokens=64, **kwargs
        )["kl_mean"]
    bar.update()
    throughput = _throughput(quick)
    bar.update()
    bar.close()
    rows = [_row(r, fp16_bytes, wide_kl[r["scheme"]]) for r in results]
    summary = _summary(reference, rows, fp16_bytes)
    for t in throughput:
        summary.setdefault("throughput_gb_s", {})[t["scheme"]] = {
            "quantize": round(t["quantize_gb_s"], 3),
            "dequantize": round(t["dequantize_gb_s"], 3),
        }
    config = {
        "model": "shipped (4 layers, 2 KV heads x 32, fp32)",
        "context_tokens": context,
        "generated_tokens": generate,
        "prompt_tokens": prompt,
        "chunk": 64,
        "corpus": "memos_ref/model/data/heldout_stdlib.txt (bytes 0..context); calibration at byte 200,000",
        "wide_model": "random-init Llama, 8 layers, 8 KV heads x 64, hidden 512; 512 tokens",
        "throughput_tensor": "[8, 4096, 128] fp32 keys" if not quick else "[8, 512, 128] fp32 keys",
    }
    report = envelope("quant", config, rows, summary)
    report["throughput"] = throughput
    return report


def run_pretrained(name: str, quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """``bench quant --model NAME``: every scheme of :func:`pretrained_schemes` on a real model (the package's
    forward on its converted weights, fp32) over held-out English prose.

    Full: 1,024 tokens teacher-forced in chunks of 64, greedy agreement along the fp32 model's 64-token
    continuation of the first 256; per-tensor int8 calibrated on the prose's last section. ``quick``: 64 tokens,
    4 generated, two schemes (for tests). No wide random model and no codec throughput here (they do not
    depend on the model): the default ``bench quant`` has them."""
    from transformers import AutoTokenizer

    from memos_ref.model import PRETRAINED, load_model, pretrained_path

    if name not in PRETRAINED:
        raise ConfigError(f"model: expected one of {sorted(PRETRAINED)}, got {name!r}")
    context, prompt, generate = PRETRAINED_SIZES["quick" if quick else "full"]
    path = pretrained_path(name)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    model = load_model(path)
    ids, calibration = prose_token_ids(tokenizer, context)
    if quick:  # no calibrated scheme among the quick ones: skip calibrating
        compared = [s for s in pretrained_schemes(None) if s[0] in PRETRAINED_QUICK_SCHEMES]
    else:
        compared = pretrained_schemes(calibrate_layer_scales(model, calibration))
    bar = tqdm(total=len(compared) + 1, desc=f"bench quant {name}", disable=not progress)
    reference, results = _measure(model, ids, compared, dict(generate_tokens=generate, prompt_tokens=prompt), bar)
    bar.close()
    fp16_bytes = model.kv_spec().bytes_per_token / 2  # the fp32 model's KV at fp16
    rows = [_row(r, fp16_bytes, None) for r in results]
    spec = model.kv_spec()
    config = {
        "model": f"{name} ({spec.num_layers} layers, {spec.num_kv_heads} KV heads x {spec.head_dim}, fp32; "
        "the package's forward)",
        "context_tokens": context,
        "generated_tokens": generate,
        "prompt_tokens": prompt,
        "chunk": 64,
        "corpus": f"memos_ref/model/data/{PROSE_FILE} (English prose written in 2026, after the model's training; "
        f"tokens 0..context of all but the last section); calibration on the last section ({calibration.shape[1]} "
        "tokens)",
        "schemes": [n for n, _, _ in compared],
    }
    return envelope("quant", config, rows, _summary(reference, rows, fp16_bytes))


def human(report: dict[str, Any]) -> str:
    cols = [
        "scheme",
        "ppl",
        "ppl_delta_pct",
        "kl_mean",
        "kl_mean_wide_random",
        "greedy_agreement",
        "mismatches_near_tie",
        "identical_prefix_tokens",
        "bytes_per_token",
        "bytes_per_token_ratio",
    ]
    results = report["results"]
    if not all("kl_mean_wide_random" in r for r in results):
        cols.remove("kl_mean_wide_random")
    rows = [{k: f"{v:.2e}" if k.startswith("kl_mean") and v is not None else v for k, v in r.items()} for r in results]
    lines = [
        f"model: {report['config']['model']}, {report['config']['context_tokens']} tokens",
        f"fp32 perplexity: {report['summary']['ppl_fp32']}",
        format_table(rows, cols),
    ]
    if "throughput" in report:
        lines += ["", format_table(report["throughput"], ["scheme", "quantize_gb_s", "dequantize_gb_s"])]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in report["results"]:
        ax.scatter(r["bytes_per_token_ratio"], r["ppl_delta_pct"], s=40)
        ax.annotate(r["scheme"], (r["bytes_per_token_ratio"], r["ppl_delta_pct"]), fontsize=7)
    ax.set_yscale("symlog", linthresh=0.01)
    ax.set_xlabel("KV bytes per token / fp16")
    ax.set_ylabel("perplexity increase, % (symlog)")
    model = report["config"]["model"].split(" (")[0]
    ax.set_title(f"memory against accuracy ({model} model, {report['config']['context_tokens']} tokens)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
