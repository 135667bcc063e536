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

import functools
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table, ratio_stats, time_interleaved_ms
from memos_ref.caches import ConcatCache, ContiguousCache
from memos_ref.model import load_hf_model, load_model
from memos_ref.model.corpus import heldout_text
from memos_ref.model.tokenizer import ByteTokenizer

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

#: The random-init model whose KV is large enough to matter: 32 KiB per token in fp32.
WIDE_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
)

#: SmolLM2-135M's attention geometry (its KV: 30 × 2 × 3 × 64 values per token, 23,040 bytes in fp16), for the
#: random-init stand-in; its MLP and vocabulary are shrunk (they do not touch the cache).
SMOLLM2_GEOMETRY = dict(
    hidden_size=576,
    intermediate_size=256,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    rope_theta=100000.0,
    tie_word_embeddings=True,
)
SMOLLM2 = "smollm2-135m-instruct"

#: The larger pool of the ``*_pool16x`` methods, in multiples of the blocks the run needs.
POOL_SCALE = 16

#: The two models whose ratios fill the summary's original per-model fields (the real-geometry model's are in
#: ``summary.ratios`` and ``summary.smollm2``).
CLASSIC_MODELS = ("shipped", "wide")


@dataclass(frozen=True)
class Method:
    name: str
    forward: str  # "package" or "transformers"
    cache: Callable[[Any, int, dict[str, Any]], Any] | None  # (hf_config, max_len, shared) -> cache; None: recompute


def _paged(cfg: Any, max_len: int, shared: dict[str, Any], *, scale: int = 1, dense_mirror: bool = False) -> Any:
    """A PagedCache in a pool of ``scale`` × the blocks ``max_len`` tokens need (the large pools of one model and
    context are one pool, shared by the forwards' caches)."""
    from memos_ref.hf import PagedCache
    from memos_ref.paged import PagedKV
    from memos_ref.spec import KVSpec

    spec = KVSpec.from_hf_config(cfg, dtype="float32", block_size=16)
    blocks = (spec.blocks_for(max_len) + 1) * scale
    if scale == 1:
        kv = PagedKV(spec, blocks)
    else:
        kv = shared.get("big_pool")
        if kv is None:
            kv = shared["big_pool"] = PagedKV(spec, blocks)
    return PagedCache(kv, dense_mirror=dense_mirror)


def _static(cfg: Any, max_len: int, shared: dict[str, Any]) -> Any:
    from transformers import StaticCache

    return StaticCache(config=cfg, max_cache_len=max_len)


def _dynamic(cfg: Any, max_len: int, shared: dict[str, Any]) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=cfg)


METHODS: tuple[Method, ...] = (
    Method("no_cache", "package", None),
    Method("concat", "package", lambda cfg, n, shared: ConcatCache()),
    Method("contiguous", "package", lambda cfg, n, shared: ContiguousCache(capacity=n)),
    Method("contiguous_shd", "package", lambda cfg, n, shared: ContiguousCache(capacity=n, layout="SHD")),
    Method("paged", "package", _paged),
    Method("paged_pool16x", "package", functools.partial(_paged, scale=POOL_SCALE)),
    Method("paged_mirror", "package", functools.partial(_paged, dense_mirror=True)),
    Method("concat", "transformers", lambda cfg, n, shared: ConcatCache()),
    Method("contiguous", "transformers", lambda cfg, n, shared: ContiguousCache(capacity=n)),
    Method("paged", "transformers", _paged),
    Method("paged_pool16x", "transformers", functools.partial(_paged, scale=POOL_SCALE)),
    Method("paged_mirror", "transformers", functools.partial(_paged, dense_mirror=True)),
    Method("dynamic", "transformers", _dynamic),
    Method("static", "transformers", _static),
)


def _kv_bytes(cache: Any) -> int:
    if cache is None:
        return 0
    if hasattr(cache, "nbytes_reserved"):
        return cache.nbytes_reserved()
    if hasattr(cache, "kv"):  # PagedCache: the blocks its rows hold
        return sum(seq.num_blocks for seq in cache.sequences) * cache.kv.spec.bytes_per_block
    return sum(
        layer.keys.nbytes + layer.values.nbytes for layer in cache.layers if getattr(layer, "keys", None) is not None
    )


def random_init(config: dict[str, Any], vocab_size: int) -> tuple[Any, Any]:
    """(package forward, transformers model) of a seeded random-init Llama, on the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab_size, max_position_embeddings=8192, **config)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(cfg).save_pretrained(folder)
        return load_model(folder), load_hf_model(folder)


def _smollm2(quick: bool) -> tuple[tuple[Any, Any], str]:
    """SmolLM2-135M-Instruct's weights when converted on this machine (full runs), else a random-init model of
    its KV geometry; returns the models and a sentence saying which."""
    if not quick:
        try:
            from memos_ref.model import load_pretrained, pretrained_path

            path = pretrained_path(SMOLLM2, download=False)
            _tok, hf = load_pretrained(SMOLLM2, download=False)
            return (load_model(path), hf), f"pretrained weights ({path})"
        except Exception as exc:  # any reason the weights are not here: fall back, and say why
            reason = f"{type(exc).__name__}: {str(exc)[:200]}"
            return random_init(SMOLLM2_GEOMETRY, 256), f"random init of SmolLM2-135M's KV geometry ({reason})"
    return random_init(SMOLLM2_GEOMETRY, 256), "random init of SmolLM2-135M's KV geometry (--quick)"


def _models(quick: bool) -> tuple[dict[str, tuple[Any, Any]], dict[str, str]]:
    """name -> (package forward, transformers model), both on the same weights; and name -> their source."""
    tok = ByteTokenizer()
    models = {"shipped": (load_model(), load_hf_model()), "wide": random_init(WIDE_CONFIG, tok.vocab_size)}
    sources = {"shipped": "the shipped weights", "wide": "random init"}
    models[SMOLLM2], sources[SMOLLM2] = _smollm2(quick)
    return models, sources


def _contexts(model: str, quick: bool) -> tuple[int, ...]:
    if quick:
        return (32,) if model == SMOLLM2 else (32, 128)
    return (256, 1024) if model == SMOLLM2 else (256, 1024, 4096)


def _prompt(name: str, length: int, vocab: int) -> torch.Tensor:
    if name == "shipped":
        tok = ByteTokenizer()
        ids = tok.encode(heldout_text()[: length * 2], add_bos=True)[:length]
    else:
        ids = torch.randint(0, min(vocab, 256), (length,), generator=torch.Generator().manual_seed(length)).tolist()
    return torch.tensor([ids], dtype=torch.long)  # [1, length]


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
    prompt = _prompt(model_name, ctx, hf.config.vocab_size)
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
            "kv_bytes": _kv_bytes(c.cache),
            "model": model_name,
        }
        if hasattr(c.cache, "kv"):
            row["pool_blocks"] = c.cache.kv.allocator.num_blocks
            row["dense_mirror"] = c.cache.dense_mirror
        rows.append(row)
        c.close()
    return rows


class _TimedModel:
    """The package forward, timing each call (the engine's forward inside its step)."""

    def __init__(self, model: Any) -> None:
        self.model, self.config, self.calls_ms = model, model.config, []

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        out = self.model(*args, **kwargs)
        self.calls_ms.append((time.perf_counter() - started) * 1e3)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def engine_overhead(model: Any, rows: int, context: int, warmup: int, steps: int) -> dict[str, Any]:
    """µs per row per step of ``Engine.step`` (decode only: every row admitted and prefilled first), of the
    forward inside it, of what lies outside that forward, and of the forward's excess over the same batch
    through a ContiguousCache — timed side by side."""
    from memos_ref.engine import Engine, Request
    from memos_ref.paged import PagedKV

    spec = model.kv_spec(block_size=16)
    length = context + warmup + steps + 2 * rows + 4
    kv = PagedKV(spec, rows * (spec.blocks_for(length) + 1))
    timed = _TimedModel(model)
    engine = Engine(timed, kv, max_batch=rows)
    gen = torch.Generator().manual_seed(rows)
    prompts = torch.randint(1, 256, (rows, context), generator=gen)
    for prompt in prompts.tolist():
        engine.submit(Request(prompt, max_new_tokens=warmup + steps + rows + 2))
    with torch.inference_mode():
        for _ in range(rows + 1):  # admission and prefill of every row (however many per step), untimed
            engine.step()
            if len(engine.running) == rows and not engine.waiting:
                break
    cache = ContiguousCache(capacity=length)
    with torch.inference_mode():
        model(prompts, cache)
    last = prompts[:, -1:]
    forward_ms: list[float] = []

    def engine_step() -> None:
        before = len(timed.calls_ms)
        engine.step()
        forward_ms.append(sum(timed.calls_ms[before:]))

    def contiguous_step() -> None:
        with torch.inference_mode():
            model(last, cache)

    samples = time_interleaved_ms({"engine": engine_step, "contiguous": contiguous_step}, steps, warmup=warmup)
    forward_ms = forward_ms[warmup:]
    per = 1e3 / rows  # ms per step -> µs per row

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs) * per, 1)

    outside = [a - b for a, b in zip(samples["engine"], forward_ms)]
    excess = [a - b for a, b in zip(forward_ms, samples["contiguous"])]
    overhead = [a - b for a, b in zip(samples["engine"], samples["contiguous"])]
    for _request, seq in list(engine.running):
        seq.free()
    return {
        "rows": rows,
        "context": context,
        "timed_steps": steps,
        "model": "shipped",
        "step_us_per_row_step": med(samples["engine"]),
        "forward_us_per_row_step": med(forward_ms),
        "outside_forward_us_per_row_step": med(outside),
        "contiguous_forward_us_per_row_step": med(samples["contiguous"]),
        "paged_forward_excess_us_per_row_step": med(excess),
        "overhead_us_per_row_step": med(overhead),
        "overhead_us_per_row_step_min": round(min(overhead) * per, 1),
        "overhead_us_per_row_step_max": round(max(overhead) * per, 1),
    }


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
    models, sources = _models(quick)
    results: list[dict[str, Any]] = []
    jobs = [(m, c, fwd) for m in models for c in _contexts(m, quick) for fwd in ("package", "transformers")]
    for model_name, ctx, forward in tqdm(jobs, desc="bench decode", disable=not progress):
        ours, hf = models[model_name]
        results.extend(measure_group(model_name, ours, hf, ctx, forward, warmup, steps, nocache_steps))
    summary = _summary(results, models, quick)
    engine_rows, engine_ctx = (4, 32) if quick else (8, 256)
    summary["engine"] = engine_overhead(models["shipped"][0], engine_rows, engine_ctx, warmup, steps)
    config = {
        "contexts": list(_contexts("wide", quick)),
        "contexts_by_model": {m: list(_contexts(m, quick)) for m in models},
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
