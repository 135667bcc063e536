"""``bench decode``: per-token decode latency against context length, for each cache, side by side.

Two models: the shipped one (small; its KV is tiny, so the cache barely matters) and a random-init Llama
large enough for the KV to matter (8 layers × 8 KV heads × 64 head dim). For each context length the prompt
is prefilled untimed, then single-token decode steps are timed one by one (median after warm-up).

Methods, each on a stated forward:
  package forward      — no cache (recompute the whole sequence each step), ConcatCache, ContiguousCache
                         in both layouts ([B, H, S, D] "HSD" and [B, S, H, D] "SHD": seed 003's layout claim)
  transformers forward — ConcatCache, ContiguousCache, PagedCache, DynamicCache, StaticCache
PagedCache (block size 16) hands attention a gathered copy of each sequence every step (the reference
path); its ratio to ContiguousCache is the cost of that gather, which the kernels remove.
ContiguousCache and StaticCache are preallocated to the final length, as a serving system would size them.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table, time_calls_ms
from memos_ref.caches import ConcatCache, ContiguousCache
from memos_ref.model import load_hf_model, load_model
from memos_ref.model.corpus import heldout_text
from memos_ref.model.tokenizer import ByteTokenizer

__all__ = ["METHODS", "WIDE_CONFIG", "run"]

#: The random-init model whose KV is large enough to matter: 32 KiB per token in fp32.
WIDE_CONFIG = dict(
    hidden_size=512,
    intermediate_size=1024,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
)


@dataclass(frozen=True)
class Method:
    name: str
    forward: str  # "package" or "transformers"
    cache: Callable[[Any, int], Any] | None  # (hf_config, max_len) -> cache; None = recompute


def _paged(cfg: Any, max_len: int) -> Any:
    from memos_ref.hf import PagedCache
    from memos_ref.paged import PagedKV
    from memos_ref.spec import KVSpec

    spec = KVSpec.from_hf_config(cfg, dtype="float32", block_size=16)
    return PagedCache(PagedKV(spec, spec.blocks_for(max_len) + 1))


def _static(cfg: Any, max_len: int) -> Any:
    from transformers import StaticCache

    return StaticCache(config=cfg, max_cache_len=max_len)


def _dynamic(cfg: Any, max_len: int) -> Any:
    from transformers import DynamicCache

    return DynamicCache(config=cfg)


METHODS: tuple[Method, ...] = (
    Method("no_cache", "package", None),
    Method("concat", "package", lambda cfg, n: ConcatCache()),
    Method("contiguous", "package", lambda cfg, n: ContiguousCache(capacity=n)),
    Method("contiguous_shd", "package", lambda cfg, n: ContiguousCache(capacity=n, layout="SHD")),
    Method("paged", "package", _paged),
    Method("concat", "transformers", lambda cfg, n: ConcatCache()),
    Method("contiguous", "transformers", lambda cfg, n: ContiguousCache(capacity=n)),
    Method("paged", "transformers", _paged),
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


def _models(quick: bool) -> dict[str, tuple[Any, Any]]:
    """name -> (package forward, transformers model), both on the same weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = ByteTokenizer()
    models = {"shipped": (load_model(), load_hf_model())}
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=tok.vocab_size, max_position_embeddings=8192, **WIDE_CONFIG)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(cfg).save_pretrained(folder)
        models["wide"] = (load_model(folder), load_hf_model(folder))
    return models


def _prompt(name: str, length: int) -> torch.Tensor:
    tok = ByteTokenizer()
    if name == "shipped":
        ids = tok.encode(heldout_text()[: length * 2], add_bos=True)[:length]
    else:
        ids = torch.randint(0, 256, (length,), generator=torch.Generator().manual_seed(length)).tolist()
    return torch.tensor([ids], dtype=torch.long)  # [1, length]


def _measure(method: Method, ours: Any, hf: Any, prompt: torch.Tensor, warmup: int, steps: int) -> dict[str, Any]:
    ctx = prompt.shape[1]
    max_len = ctx + warmup + steps + 1
    cache = method.cache(hf.config, max_len) if method.cache else None

    def forward(ids: torch.Tensor) -> torch.Tensor:
        if method.forward == "package":
            return ours(ids, cache)
        return hf(input_ids=ids, cache=cache, use_cache=cache is not None).logits

    state = {"ids": prompt}
    with torch.inference_mode():
        logits = forward(prompt) if cache is not None else None  # prefill, untimed
        state["next"] = logits[:, -1:].argmax(-1) if logits is not None else prompt[:, -1:]

        def step() -> None:
            if cache is None:  # recompute everything seen so far
                state["ids"] = torch.cat([state["ids"], state["next"]], dim=1)
                out = forward(state["ids"])
            else:
                out = forward(state["next"])
            state["next"] = out[:, -1:].argmax(-1)

        median, samples = time_calls_ms(step, repeats=steps, warmup=warmup)
    return {
        "method": method.name,
        "forward": method.forward,
        "context": ctx,
        "ms_per_token": median,
        "samples_ms": [round(s, 4) for s in samples],
        "kv_bytes": _kv_bytes(cache),
    }


def run(quick: bool = False, progress: bool = True) -> dict[str, Any]:
    """Run the benchmark; return the JSON envelope."""
    contexts = (32, 128) if quick else (256, 1024, 4096)
    warmup, steps, nocache_steps = (1, 3, 2) if quick else (2, 9, 3)
    models = _models(quick)
    results: list[dict[str, Any]] = []
    jobs = [(m, c, meth) for m in models for c in contexts for meth in METHODS]
    for model_name, ctx, method in tqdm(jobs, desc="bench decode", disable=not progress):
        ours, hf = models[model_name]
        n = nocache_steps if method.cache is None else steps
        row = _measure(method, ours, hf, _prompt(model_name, ctx), warmup, n)
        row["model"] = model_name
        results.append(row)

    def at(model: str, name: str, forward: str, ctx: int) -> float:
        return next(
            r["ms_per_token"]
            for r in results
            if (r["model"], r["method"], r["forward"], r["context"]) == (model, name, forward, ctx)
        )

    top = contexts[-1]
    summary: dict[str, Any] = {"max_context": top}
    for key, (num, num_fwd, den_fwd) in {
        "concat_over_contiguous_ms_per_token_at_max_ctx": ("concat", "package", "package"),
        "dynamic_over_contiguous_ms_per_token_at_max_ctx": ("dynamic", "transformers", "transformers"),
        "nocache_over_contiguous_ms_per_token_at_max_ctx": ("no_cache", "package", "package"),
        "static_over_contiguous_ms_per_token_at_max_ctx": ("static", "transformers", "transformers"),
        "shd_over_hsd_layout_ms_per_token_at_max_ctx": ("contiguous_shd", "package", "package"),
        "paged_over_contiguous_ms_per_token_at_max_ctx": ("paged", "package", "package"),
        "paged_over_contiguous_ms_per_token_at_max_ctx_transformers": ("paged", "transformers", "transformers"),
    }.items():
        summary[key] = {m: round(at(m, num, num_fwd, top) / at(m, "contiguous", den_fwd, top), 3) for m in models}
    summary["kv_bytes_per_token"] = {m: models[m][0].kv_spec().bytes_per_token for m in models}
    config = {
        "contexts": list(contexts),
        "warmup_steps": warmup,
        "timed_steps": steps,
        "timed_steps_no_cache": nocache_steps,
        "batch_size": 1,
        "dtype": "float32",
        "models": {m: models[m][0].kv_spec().to_dict() for m in models},
        "wide_model_config": WIDE_CONFIG,
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
            "KV MiB": r["kv_bytes"] / 2**20,
        }
        for r in report["results"]
    ]
    lines = [format_table(rows, ["model", "forward", "cache", "context", "ms/token", "KV MiB"]), ""]
    for key, value in report["summary"].items():
        lines.append(f"{key}: {value}")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    """Top: ms/token against context for every method (log-log, no-cache included). Bottom: the cached methods
    only, on a linear scale, where their differences are visible. One column per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in report["results"]})
    contexts = sorted({r["context"] for r in report["results"]})
    fig, axes = plt.subplots(2, len(models), figsize=(6.5 * len(models), 8), squeeze=False)
    for col, model in enumerate(models):
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
                ax.plot(xs, ys, marker="o", label=label, color=f"C{i % 10}")  # same colour in both rows
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
