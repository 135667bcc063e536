"""``bench decode-targets``: only the contenders issue 15's decode targets name, at the context they name.

The full ``bench decode`` times every cache on three models at three contexts (over 40 minutes on a 2-core
machine, most of it recomputing 4,096 tokens without a cache). This runs the wide random-init model
(:data:`memos_ref.bench.decode.WIDE_CONFIG`, 32 KiB of KV per token) at 4,096 tokens with just the contenders
the targets compare — contiguous, paged, paged in a 16× larger pool and paged with a dense mirror, on the
package's forward and on transformers' (there beside ``DynamicCache``) — timed side by side in interleaved
rounds exactly as ``bench decode`` does (the same code), plus the engine's per-row overhead. ``--quick``: 128
tokens. The summary has the same ``ratios`` / ``targets_wide_at_max_ctx`` fields as ``bench decode``.
"""

from __future__ import annotations

from typing import Any

from tqdm.auto import tqdm

from memos_ref.bench import decode
from memos_ref.bench.common import envelope, format_table, ratio_stats
from memos_ref.model import load_model
from memos_ref.model.tokenizer import ByteTokenizer

__all__ = ["CONTENDERS", "run"]

#: forward -> the methods the targets compare on it.
CONTENDERS: dict[str, frozenset[str]] = {
    "package": frozenset({"contiguous", "paged", "paged_pool16x", "paged_mirror"}),
    "transformers": frozenset({"contiguous", "paged", "paged_pool16x", "paged_mirror", "dynamic"}),
}


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Time the target contenders on the wide model; return the JSON envelope."""
    ctx = 128 if quick else 4096
    warmup, steps = (1, 3) if quick else (2, 15)
    ours, hf = decode.random_init(decode.WIDE_CONFIG, ByteTokenizer().vocab_size)
    results: list[dict[str, Any]] = []
    for forward in tqdm(CONTENDERS, desc="bench decode-targets", disable=not progress):
        results += decode.measure_group("wide", ours, hf, ctx, forward, warmup, steps, 0, CONTENDERS[forward])
    ratios: dict[str, dict[str, Any]] = {}
    for key, (num, num_fwd, den, den_fwd) in {**decode.RATIOS, **decode.NEW_RATIOS}.items():
        a, b = (decode.result_at(results, "wide", n, f, ctx) for n, f in ((num, num_fwd), (den, den_fwd)))
        if a is not None and b is not None:
            ratios[key] = {"wide": ratio_stats(a["samples_ms"], b["samples_ms"])}
    summary: dict[str, Any] = {
        "max_context": ctx,
        "ratios": ratios,
        "targets_wide_at_max_ctx": {
            key: {
                **{k: ratios[key]["wide"][k] for k in ("min", "max")},
                "value": ratios[key]["wide"]["median"],
                "target": bound,
                "met": ratios[key]["wide"]["median"] <= bound,
            }
            for key, bound in decode.TARGETS.items()
        },
    }
    rows, ectx = (4, 32) if quick else (8, 256)
    summary["engine"] = decode.engine_overhead(load_model(), rows, ectx, warmup, steps)
    config = {
        "model": "wide random-init Llama (decode.WIDE_CONFIG), fp32, batch 1",
        "wide_model_config": decode.WIDE_CONFIG,
        "context": ctx,
        "contenders": {k: sorted(v) for k, v in CONTENDERS.items()},
        "warmup_steps": warmup,
        "timed_steps": steps,
        "pool_scale": decode.POOL_SCALE,
        "timing": "one decode step of every contender per round (rotated order); rows give the median and min-max, "
        "summary.ratios the median and min-max of per-round ratios",
    }
    return envelope("decode-targets", config, results, summary)


def human(report: dict[str, Any]) -> str:
    """The table printed without ``--json``."""
    cols = ["forward", "method", "context", "ms_per_token", "ms_min", "ms_max"]
    lines = [format_table(report["results"], cols), ""]
    for key, t in report["summary"]["targets_wide_at_max_ctx"].items():
        lines.append(f"{key}: {t['value']:.3f} [{t['min']:.3f}-{t['max']:.3f}] target <= {t['target']} met={t['met']}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Per-token time of each contender (median, with min-max bars)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = report["results"]
    labels = [f"{r['forward']}\n{r['method']}" for r in rows]
    med = [r["ms_per_token"] for r in rows]
    err = [[m - r["ms_min"] for m, r in zip(med, rows)], [r["ms_max"] - m for m, r in zip(med, rows)]]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(labels, med, yerr=err, capsize=3)
    ax.set_ylabel(f"ms per token at {report['config']['context']:,} tokens")
    ax.tick_params(axis="x", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
