"""``bench decode``: per-token decode latency against context length, for each cache, side by side.

Three models: the shipped one (small; its KV is tiny, so the cache barely matters), a random-init Llama large
enough for the KV to matter (8 layers × 8 KV heads × 64 head dim) and SmolLM2-135M-Instruct's geometry (30
layers × 3 KV heads × 64 head dim, 23,040 bytes of fp16 KV per token): its real weights in a full run (when
the converted model is on this machine; contexts up to 1,024), a random-init model of the same KV geometry with
``--quick`` or without the weights (``config.models_source`` says which). For each context length every cache's
prompt is prefilled untimed, then single-token decode steps of the caches on one forward are timed *side by
side*: one step of each per round, rounds repeated, so a machine load that comes and goes hits all of them
alike. Each row has the median and min–max; each ratio is also given as the median and min–max of its per-round
ratios (``summary.ratios``).

Methods, each on a stated forward:
  package forward      — no cache (recompute the whole sequence each step), ConcatCache, ContiguousCache
                         in both layouts ([B, H, S, D] "HSD" and [B, S, H, D] "SHD": seed 003's layout claim),
                         PagedCache, PagedCache in a 16× larger pool, PagedCache(dense_mirror=True)
  transformers forward — ConcatCache, ContiguousCache, PagedCache (also in the 16× pool and with the dense
                         mirror), DynamicCache, StaticCache
PagedCache (block size 16) hands attention a gathered copy of each row every step (one indexed copy of its own
blocks: ``paged_pool_size_slowdown`` checks the cost does not follow the pool's size); with ``dense_mirror``
it keeps a dense copy grown by appends instead. ContiguousCache and StaticCache are preallocated to the final
length, as a serving system would size them.

``summary.engine`` is the engine's per-step cost on the shipped model, in µs per row per step: the whole
``Engine.step``, the model forward inside it (the cache's appends and the paged attention included), what lies
outside the forward (scheduling, sampling, bookkeeping), and the forward's excess over the same batch through
a ContiguousCache (the paged path's metadata, writes and gathers); ``overhead_us_per_row_step`` (median, min, max
over rounds) is the whole step's excess over that bare forward: the engine's per-step Python overhead.
"""

from __future__ import annotations

import statistics
from typing import Any

import torch
from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table, ratio_stats, time_interleaved_ms
from memos_ref.bench.decode_models import (
    CLASSIC_MODELS,
    METHODS,
    POOL_SCALE,
    SMOLLM2,
    SMOLLM2_GEOMETRY,
    WIDE_CONFIG,
    Method,
    contexts,
    kv_bytes,
    load_models,
    prompt_ids,
    random_init,
)
from memos_ref.bench.engine_overhead import engine_overhead

__all__ = [
    "METHODS",
    "POOL_SCALE",
    "SMOLLM2_GEOMETRY",
    "WIDE_CONFIG",
    "engine_overhead",
    "measure_group",
    "random_init",
    "result_at",
    "run",
]


class _Contender:
    """One method's prefilled cache and its decode step."""

    def __init__(self, method: Method, ours: Any, hf: Any, prompt: torch.Tensor, max_len: int, shared: dict) -> None:
        self.method, self.ours, self.hf = method, ours, hf
        self.cache = method.cache(hf.config, max_len, shared) if method.cache else None
        self.ids = prompt
        with torch.inference_mode():
            logits = self._forward(prompt) if self.cache is not None else None  # prefill, untimed
        self.next = logits[:, -1:].argmax(-1) if logits is not None else prompt[:, -1:]

    def _forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.method.forward == "package":
            return self.ours(ids, self.cache)
        return self.hf(input_ids=ids, cache=self.cache, use_cache=self.cache is not None).logits

    def step(self) -> None:
        with torch.inference_mode():
            if self.cache is None:  # recompute everything seen so far
                self.ids = torch.cat([self.ids, self.next], dim=1)
                out = self._forward(self.ids)
            else:
                out = self._forward(self.next)
        self.next = out[:, -1:].argmax(-1)

    def close(self) -> None:
        if hasattr(self.cache, "free"):
            self.cache.free()


def measure_group(
    model_name: str,
    ours: Any,
    hf: Any,
    ctx: int,
    forward: str,
    warmup: int,
    steps: int,
    nocache_steps: int,
    only: frozenset[str] | None = None,
) -> list[dict[str, Any]]:
    """Time every method of one forward (``only``: these method names) at one context side by side; one result
    row per method."""
    methods = [m for m in METHODS if m.forward == forward and (only is None or m.name in only)]
    if model_name == SMOLLM2:  # recomputing a 30-layer model's whole context per token says nothing new
        methods = [m for m in methods if m.cache is not None]
    prompt = prompt_ids(model_name, ctx, hf.config.vocab_size)
    max_len = ctx + warmup + steps + 1
    shared: dict[str, Any] = {}
    contenders = {m.name: _Contender(m, ours, hf, prompt, max_len, shared) for m in methods}
    counts = {name: nocache_steps if c.cache is None else steps for name, c in contenders.items()}
    samples = time_interleaved_ms({name: c.step for name, c in contenders.items()}, counts, warmup=warmup)
    rows = []
    for name, c in contenders.items():
        s = samples[name]
        row = {
            "method": name,
            "forward": forward,
            "context": ctx,
            "ms_per_token": statistics.median(s),
            "ms_min": min(s),
            "ms_max": max(s),
            "samples_ms": [round(x, 4) for x in s],
            "kv_bytes": kv_bytes(c.cache),
            "model": model_name,
        }
        if hasattr(c.cache, "kv"):
            row["pool_blocks"] = c.cache.kv.allocator.num_blocks
            row["dense_mirror"] = c.cache.dense_mirror
        rows.append(row)
        c.close()
    return rows


def result_at(results: list[dict[str, Any]], model: str, name: str, forward: str, ctx: int) -> dict[str, Any] | None:
    return next(
        (r for r in results if (r["model"], r["method"], r["forward"], r["context"]) == (model, name, forward, ctx)),
        None,
    )


#: summary key -> (numerator method, its forward, denominator method, its forward): the original fields.
RATIOS = {
    "concat_over_contiguous_ms_per_token_at_max_ctx": ("concat", "package", "contiguous", "package"),
    "dynamic_over_contiguous_ms_per_token_at_max_ctx": ("dynamic", "transformers", "contiguous", "transformers"),
    "nocache_over_contiguous_ms_per_token_at_max_ctx": ("no_cache", "package", "contiguous", "package"),
    "static_over_contiguous_ms_per_token_at_max_ctx": ("static", "transformers", "contiguous", "transformers"),
    "shd_over_hsd_layout_ms_per_token_at_max_ctx": ("contiguous_shd", "package", "contiguous", "package"),
    "paged_over_contiguous_ms_per_token_at_max_ctx": ("paged", "package", "contiguous", "package"),
    "paged_over_contiguous_ms_per_token_at_max_ctx_transformers": (
        "paged",
        "transformers",
        "contiguous",
        "transformers",
    ),
}
#: The new ratios (issue 15's targets among them).
NEW_RATIOS = {
    "paged_mirror_over_contiguous_package": ("paged_mirror", "package", "contiguous", "package"),
    "paged_over_dynamic_transformers": ("paged", "transformers", "dynamic", "transformers"),
    "paged_mirror_over_dynamic_transformers": ("paged_mirror", "transformers", "dynamic", "transformers"),
    "paged_pool_size_slowdown_package": ("paged_pool16x", "package", "paged", "package"),
    "paged_pool_size_slowdown_transformers": ("paged_pool16x", "transformers", "paged", "transformers"),
}
#: Issue 15's targets on the wide model at the largest context: ratio key -> bound.
TARGETS = {
    "paged_over_dynamic_transformers": 1.15,
    "paged_mirror_over_dynamic_transformers": 1.15,
    "paged_over_contiguous_ms_per_token_at_max_ctx": 1.3,
    "paged_mirror_over_contiguous_package": 1.3,
    "paged_pool_size_slowdown_package": 1.1,
    "paged_pool_size_slowdown_transformers": 1.1,
}


def _summary(results: list[dict[str, Any]], models: dict[str, tuple[Any, Any]], quick: bool) -> dict[str, Any]:
    top = {m: max(r["context"] for r in results if r["model"] == m) for m in models}
    summary: dict[str, Any] = {"max_context": top["wide"]}
    ratios: dict[str, dict[str, Any]] = {}
    for key, (num, num_fwd, den, den_fwd) in {**RATIOS, **NEW_RATIOS}.items():
        ratios[key] = {}
        for m in models:
            a, b = result_at(results, m, num, num_fwd, top[m]), result_at(results, m, den, den_fwd, top[m])
            if a is not None and b is not None:
                ratios[key][m] = ratio_stats(a["samples_ms"], b["samples_ms"])
    for key, (num, num_fwd, den, den_fwd) in RATIOS.items():  # the original fields: ratio of medians
        summary[key] = {
            m: round(
                result_at(results, m, num, num_fwd, top[m])["ms_per_token"]
                / result_at(results, m, den, den_fwd, top[m])["ms_per_token"],
                3,
            )
            for m in CLASSIC_MODELS
        }
    summary["kv_bytes_per_token"] = {m: models[m][0].kv_spec().bytes_per_token for m in CLASSIC_MODELS}
    summary["kv_bytes_per_token_all"] = {m: models[m][0].kv_spec().bytes_per_token for m in models}
    summary["kv_bytes_per_token_fp16"] = {
        m: models[m][0].kv_spec().bytes_per_token * 2 // models[m][0].kv_spec().dtype.itemsize for m in models
    }
    summary["ratios"] = ratios
    summary["paged_pool_size_slowdown"] = {
        m: {
            fwd: ratios[f"paged_pool_size_slowdown_{fwd}"][m]["median"]
            for fwd in ("package", "transformers")
            if m in ratios[f"paged_pool_size_slowdown_{fwd}"]
        }
        for m in models
    }
    summary["paged_pool_size_slowdown_max"] = max(
        v for per in summary["paged_pool_size_slowdown"].values() for v in per.values()
    )
    summary[SMOLLM2.split("-instruct")[0].replace("-", "_")] = {
        "max_context": top[SMOLLM2],
        **{key: ratios[key][SMOLLM2]["median"] for key in {**RATIOS, **NEW_RATIOS} if SMOLLM2 in ratios[key]},
    }
    summary["targets_wide_at_max_ctx"] = {
        key: {
            "value": ratios[key]["wide"]["median"],
            "min": ratios[key]["wide"]["min"],
            "max": ratios[key]["wide"]["max"],
            "target": bound,
            "met": ratios[key]["wide"]["median"] <= bound,
        }
        for key, bound in TARGETS.items()
    }
    if quick:
        summary["targets_note"] = "--quick: contexts of 128 tokens at most; the targets are stated at 4,096"
    return summary


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; return the JSON envelope."""
    warmup, steps, nocache_steps = (1, 3, 2) if quick else (2, 9, 3)
    models, sources = load_models(quick)
    results: list[dict[str, Any]] = []
    jobs = [(m, c, fwd) for m in models for c in contexts(m, quick) for fwd in ("package", "transformers")]
    for model_name, ctx, forward in tqdm(jobs, desc="bench decode", disable=not progress):
        ours, hf = models[model_name]
        results.extend(measure_group(model_name, ours, hf, ctx, forward, warmup, steps, nocache_steps))
    summary = _summary(results, models, quick)
    engine_rows, engine_ctx = (4, 32) if quick else (8, 256)
    summary["engine"] = engine_overhead(models["shipped"][0], engine_rows, engine_ctx, warmup, steps)
    config = {
        "contexts": list(contexts("wide", quick)),
        "contexts_by_model": {m: list(contexts(m, quick)) for m in models},
        "warmup_steps": warmup,
        "timed_steps": steps,
        "timed_steps_no_cache": nocache_steps,
        "batch_size": 1,
        "dtype": "float32",
        "models": {m: models[m][0].kv_spec().to_dict() for m in models},
        "models_source": sources,
        "wide_model_config": WIDE_CONFIG,
        "smollm2_geometry": SMOLLM2_GEOMETRY,
        "pool_scale": POOL_SCALE,
        "timing": "per model, context and forward, one decode step of every method per round (rotated order), "
        "after warm-up rounds; rows give the median and min-max, summary.ratios the median and min-max of "
        "per-round ratios",
        "ratio_forwards": "concat and no_cache vs contiguous on the package forward; dynamic and static vs "
        "contiguous on the transformers forward",
    }
    return envelope("decode", config, results, summary)


def human(report: dict[str, Any]) -> str:
    """The table printed without ``--json``."""
    rows = [
        {
            "model": r["model"],
            "forward": r["forward"],
            "cache": r["method"],
            "context": r["context"],
            "ms/token": r["ms_per_token"],
            "min": r.get("ms_min", r["ms_per_token"]),
            "max": r.get("ms_max", r["ms_per_token"]),
            "KV MiB": r["kv_bytes"] / 2**20,
        }
        for r in report["results"]
    ]
    lines = [format_table(rows, ["model", "forward", "cache", "context", "ms/token", "min", "max", "KV MiB"]), ""]
    for key, value in report["summary"].items():
        if key != "ratios":
            lines.append(f"{key}: {value}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Top: ms/token against context for every method (log-log, no-cache included). Bottom: the cached methods
    only, on a linear scale, where their differences are visible. One column per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in report["results"]})
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
        contexts = sorted({r["context"] for r in report["results"] if r["model"] == model})
        series: dict[str, list[tuple[int, float]]] = {}
        for r in report["results"]:
            if r["model"] == model:
                series.setdefault(f"{r['method']} ({r['forward']})", []).append((r["context"], r["ms_per_token"]))
        for row, cached_only in enumerate((False, True)):
            ax = axes[row][col]
            for i, (label, points) in enumerate(series.items()):
                if cached_only and label.startswith("no_cache"):
                    continue
                xs, ys = zip(*sorted(points))
                ax.plot(xs, ys, marker="o", label=label, color=f"C{i % 10}", linestyle="-" if i < 10 else "--")
            ax.set_xscale("log")
            ax.set_xticks(contexts, [str(c) for c in contexts])
            ax.minorticks_off()
            ax.set(
                yscale="linear" if cached_only else "log",
                xlabel="context (tokens)",
                ylabel="ms / token",
                title=f"{model}: {'cached methods' if cached_only else 'all methods'}",
            )
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
