"""``bench agent``: the three agent traces through the engine, with and without prefix/session reuse.

Each trace is replayed closed-loop: events are dispatched in trace order, a session's ``generate`` becomes an
engine request whose prompt is everything the session holds (system prompt, tools, turns, earlier replies),
and an event waits while its session has a request in flight; requests of different sessions are batched.
"With reuse" runs the engine over a prefix-caching pool (a later turn, a sub-agent, or a new session with the
same system prompt reuses cached blocks); "without" recomputes every prompt. Greedy outputs must be identical
both ways (checked). Reported: prefill tokens computed, peak blocks, time to first token, generated tokens
per second, preemptions.

Two KV geometries are reported side by side (``config["geometries"]``):

* ``shipped`` — the model that runs: the package's forward on the shipped weights drives every token, block
  count and timing (its pool holds fp32 K/V: 4 layers × 2 × 2 heads × 32 × 4 bytes = 2,048 bytes per token);
* ``smollm2-135m-instruct`` — **geometry only**, the real model's KV layout (30 layers × 2 × 3 KV heads × 64 ×
  2 bytes = 23,040 bytes of fp16 KV per token, 23 KiB). Its figures (peak KV bytes, KV bytes written and not
  recomputed by prefill) are the shipped run's block and token counts × that geometry: allocation, sharing and
  memory depend only on token counts, block size and the per-token size, not on the weights. No forward runs
  with its weights here (30 layers on 2 CPU cores would make even ``--quick`` take many minutes), and the
  token streams are the byte-level tokenizer's: SmolLM2's BPE tokenizer turns the same text into fewer tokens,
  so these are the real geometry applied to these traces, not a run of the real model.

The real weights run in one smaller case, ``summary["smollm2-135m-instruct_real_weights"]`` (without
``--quick``, or with ``--model smollm2-135m-instruct``): a main agent and three sub-agents over one system
prompt with tools, rendered by the model's chat template, through the engine with and without prefix caching
(:func:`real_weights_agents`; identical greedy outputs checked, replies decoded).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from tqdm.auto import tqdm

from memos_ref.bench.common import envelope, format_table
from memos_ref.engine import Engine, Request
from memos_ref.errors import ConfigError
from memos_ref.model.tokenizer import ByteTokenizer
from memos_ref.paged import PagedKV
from memos_ref.spec import KVSpec
from memos_ref.traces import SYSTEM_PROMPTS, TRACES, TraceEvent, make_trace

__all__ = [
    "REAL_GEOMETRY",
    "human",
    "plot",
    "real_geometry_figures",
    "real_weights_agents",
    "replay_through_engine",
    "run",
    "wants_real_weights",
]

BLOCK_SIZE = 16
#: SmolLM2-135M-Instruct's KV geometry (its config.json: 30 layers, 3 KV heads of 64 for 9 query heads), fp16.
REAL_GEOMETRY = KVSpec(
    num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.float16, block_size=BLOCK_SIZE, num_q_heads=9
)
REAL_NAME = "smollm2-135m-instruct"
MIB = 2**20

_MARK = {
    "system": "<|system|>",
    "tools": "<|tool|>",
    "user": "<|user|>",
    "tool_result": "<|tool|>",
    "assistant": "<|assistant|>",
}


def replay_through_engine(trace: list[TraceEvent], model: Any, kv: PagedKV, max_batch: int = 8) -> dict[str, Any]:
    """Run a trace through an :class:`Engine`; returns outputs and figures."""
    tok = ByteTokenizer()

    def seg(kind: str, text: str) -> list[int]:
        return [tok.special_to_id[_MARK[kind]], *tok.encode(text)]

    engine = Engine(model, kv, max_batch=max_batch)
    tokens: dict[str, list[int]] = {}
    prefix_len: dict[str, int] = {}
    busy: dict[str, Request] = {}
    requests: list[tuple[str, Request]] = []
    peak = 0
    pos = 0
    started = time.perf_counter()
    while pos < len(trace) or busy:
        while pos < len(trace):  # dispatch in order until an event's session is busy
            e = trace[pos]
            waits_on = e.parent if e.kind == "fork" else e.session
            if waits_on in busy:
                break
            if e.kind == "open":
                name, version = e.system.split("@", 1)
                ids = [tok.bos_id, *seg("system", SYSTEM_PROMPTS[(name, version)])]
                if e.tools:
                    ids += seg("tools", "\n".join(sorted(e.tools)))
                tokens[e.session], prefix_len[e.session] = ids, len(ids)
            elif e.kind == "fork":
                tokens[e.session], prefix_len[e.session] = list(tokens[e.parent]), prefix_len[e.parent]
            elif e.kind in ("user", "tool_result"):
                tokens[e.session] += seg(e.kind, e.text)
            elif e.kind == "compact":
                tokens[e.session] = tokens[e.session][: prefix_len[e.session]] + seg("system", e.text)
            elif e.kind == "close":
                tokens.pop(e.session)
            elif e.kind == "generate":
                tokens[e.session] += [tok.special_to_id[_MARK["assistant"]]]
                request = engine.submit(Request(list(tokens[e.session]), e.max_new_tokens))
                busy[e.session] = request
                requests.append((e.session, request))
            pos += 1
        if busy:
            engine.step()
            peak = max(peak, kv.allocator.num_active)
            for sid, request in list(busy.items()):
                if request.finished:
                    tokens[sid] += request.output
                    del busy[sid]
    elapsed = time.perf_counter() - started
    generated = sum(len(r.output) for _, r in requests)
    return {
        "outputs": [r.output for _, r in requests],
        "requests": len(requests),
        "prefill_computed": sum(r.stats.prompt_tokens - r.stats.reused_tokens for _, r in requests),
        "prefill_total": sum(r.stats.prompt_tokens for _, r in requests),
        "peak_blocks": peak,
        "ttft_median_s": statistics.median(r.stats.ttft_s for _, r in requests),
        "generated_tokens": generated,
        "tokens_per_s": generated / elapsed,
        "seconds": elapsed,
        "preemptions": engine.preemptions,
    }


def real_geometry_figures(row: dict[str, Any], spec: KVSpec = REAL_GEOMETRY) -> dict[str, int]:
    """A replay's block and token counts priced in ``spec``'s geometry (bytes; no forward involved)."""
    per_token = spec.bytes_per_token
    return {
        "peak_kv_bytes": row["peak_blocks"] * spec.block_size * per_token,
        "prefill_kv_bytes_written": row["prefill_computed"] * per_token,
        "prefill_kv_bytes_reused": (row["prefill_total"] - row["prefill_computed"]) * per_token,
    }


def _geometry(spec: KVSpec, drives: str) -> dict[str, Any]:
    return {
        "num_layers": spec.num_layers,
        "num_kv_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "dtype": str(spec.dtype).removeprefix("torch."),
        "block_size": spec.block_size,
        "kv_bytes_per_token": spec.bytes_per_token,
        "kv_bytes_per_block": spec.bytes_per_block,
        "uses": drives,
    }


#: The real-weights scenario: one system prompt with tools, a main agent and sub-agents with their own tasks.
REAL_SYSTEM = (
    "You are the lead engineer of a small team. You split work into clear tasks, give each helper one task, and "
    "check their answers. Tools: read_file(path), run_tests(name), search(query). Answer briefly."
)
REAL_TASKS = (
    "Plan the work: list the three steps to add a cache to our web server.",
    "Helper 1: explain in one sentence what a least-recently-used cache evicts.",
    "Helper 2: name one risk of caching user-specific pages.",
    "Helper 3: suggest a test that shows the cache returns fresh data after an update.",
)


def real_weights_agents(
    forward: Any, tokenizer: Any, *, agents: int = 4, max_new_tokens: int = 16, blocks: int = 128
) -> dict[str, Any]:
    """A main agent and sub-agents on the **real weights** (the package's forward on SmolLM2-135M-Instruct):
    each prompt is the chat template over the shared system prompt and the agent's own task, all submitted at
    once to an :class:`Engine`, with a prefix-caching pool and without. Greedy outputs must be identical both
    ways. Returns per-mode prompt and reused tokens, peak blocks, median TTFT and the replies' text."""
    if not 1 <= agents <= len(REAL_TASKS):
        raise ConfigError(f"agents must be in 1..{len(REAL_TASKS)}, got {agents}")
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": REAL_SYSTEM}, {"role": "user", "content": task}],
            add_generation_prompt=True,
            tokenize=False,
        )
        for task in REAL_TASKS[:agents]
    ]
    ids = [tokenizer(p)["input_ids"] for p in prompts]
    stop = tuple(t for t in (tokenizer.eos_token_id,) if t is not None)
    modes: dict[str, Any] = {}
    for reuse in (True, False):
        kv = PagedKV(forward.kv_spec(block_size=BLOCK_SIZE), blocks, prefix_caching=reuse)
        engine = Engine(forward, kv, max_batch=agents)
        # the main agent first (its prefill caches the system prompt), then the sub-agents together
        started = time.perf_counter()
        requests = [engine.submit(Request(list(ids[0]), max_new_tokens, stop_ids=stop))]
        engine.step()
        requests += [engine.submit(Request(list(p), max_new_tokens, stop_ids=stop)) for p in ids[1:]]
        peak = kv.allocator.num_active
        while not all(r.finished for r in requests):
            engine.step()
            peak = max(peak, kv.allocator.num_active)
        elapsed = time.perf_counter() - started
        if any(r.failed for r in requests):
            raise AssertionError(f"real-weights agents: a request failed: {[r.error for r in requests]}")
        modes["with_reuse" if reuse else "without"] = {
            "prompt_tokens": sum(r.stats.prompt_tokens for r in requests),
            "reused_tokens": sum(r.stats.reused_tokens for r in requests),
            "peak_blocks": peak,
            "ttft_median_s": statistics.median(r.stats.ttft_s for r in requests),
            "seconds": elapsed,
            "outputs": [r.output for r in requests],
        }
        kv.check()
    if modes["with_reuse"]["outputs"] != modes["without"]["outputs"]:
        raise AssertionError("real-weights agents: outputs differ with and without reuse")
    replies = [tokenizer.decode(o, skip_special_tokens=True) for o in modes["with_reuse"]["outputs"]]
    for m in modes.values():
        m.pop("outputs")
    return {
        "model": REAL_NAME,
        "weights": "real (package forward, fp32)",
        "agents": agents,
        "system_prompt_tokens": len(
            tokenizer(tokenizer.apply_chat_template([{"role": "system", "content": REAL_SYSTEM}], tokenize=False))[
                "input_ids"
            ]
        ),
        "max_new_tokens": max_new_tokens,
        **modes,
        "replies": replies,
    }


def _real_weights_case(quick: bool) -> dict[str, Any]:
    """The real-weights scenario, or why it did not run (``--quick``, or the model is not available)."""
    if quick:
        return {
            "ran": False,
            "why": "--quick without --model smollm2-135m-instruct: geometry only (its forward is slow on a CPU)",
        }
    from transformers import AutoTokenizer

    from memos_ref.errors import ModelUnavailableError
    from memos_ref.model import load_model, pretrained_path

    try:
        path = pretrained_path(REAL_NAME, download=False)
    except ModelUnavailableError as exc:
        return {"ran": False, "why": f"model unavailable: {exc}"}
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    forward = load_model(path)
    return {"ran": True, **real_weights_agents(forward, tokenizer)}


def wants_real_weights(quick: bool, model: str | None) -> bool:
    """Whether ``run`` includes the real-weights case: always without ``quick``; with it only when asked for."""
    return not quick or model == REAL_NAME


def run(quick: bool = False, progress: bool = True, model: str | None = None) -> dict[str, Any]:
    """Replay the three traces with and without reuse (see the module docstring). The traces always run on the
    shipped model, with both geometries reported. The real-weights agents case (:func:`real_weights_agents`)
    runs without ``quick``, or with it when ``model="smollm2-135m-instruct"`` asks for it
    (``python -m memos_ref.bench agent --quick --model smollm2-135m-instruct``)."""
    from memos_ref.model import load_model

    if model not in (None, "shipped", REAL_NAME):
        raise ConfigError(f"bench agent: model must be 'shipped' or {REAL_NAME!r}, got {model!r}")
    run_real = wants_real_weights(quick, model)
    forward = load_model()  # the shipped model drives the traces
    scale, blocks = (0.2, 2048) if quick else (1.0, 4096)
    results, summary = [], {}
    for name in tqdm(TRACES, desc="bench agent", disable=not progress):
        trace = make_trace(name, scale=scale)
        rows = {}
        for reuse in (True, False):
            kv = PagedKV(forward.kv_spec(block_size=BLOCK_SIZE), blocks, prefix_caching=reuse)
            rows[reuse] = replay_through_engine(trace, forward, kv)
            kv.check()
        if rows[True]["outputs"] != rows[False]["outputs"]:
            raise AssertionError(f"trace {name}: outputs differ with and without reuse")
        shipped = forward.kv_spec(block_size=BLOCK_SIZE)
        for reuse, row in rows.items():
            real = real_geometry_figures(row)
            results.append(
                {
                    "trace": name,
                    "reuse": reuse,
                    **{k: v for k, v in row.items() if k != "outputs"},
                    "peak_kv_bytes": row["peak_blocks"] * shipped.bytes_per_block,
                    **{f"real_geometry_{k}": v for k, v in real.items()},
                }
            )
        with_, without = rows[True], rows[False]
        real_with, real_without = real_geometry_figures(with_), real_geometry_figures(without)
        summary[name] = {
            "prefill_tokens_saved_fraction": 1 - with_["prefill_computed"] / without["prefill_computed"],
            "peak_blocks_ratio": with_["peak_blocks"] / without["peak_blocks"],
            "ttft_ratio_median": with_["ttft_median_s"] / without["ttft_median_s"],
            "throughput_tokens_per_s": {"with_reuse": with_["tokens_per_s"], "without": without["tokens_per_s"]},
            "preemptions": {"with_reuse": with_["preemptions"], "without": without["preemptions"]},
            "real_geometry_peak_kv_bytes": {
                "with_reuse": real_with["peak_kv_bytes"],
                "without": real_without["peak_kv_bytes"],
            },
            "real_geometry_prefill_kv_bytes_not_recomputed": real_with["prefill_kv_bytes_reused"],
        }
    real_case = _real_weights_case(quick=not run_real)
    summary[f"{REAL_NAME}_real_weights"] = real_case
    config = {
        "scale": scale,
        "pool_blocks": blocks,
        "block_size": BLOCK_SIZE,
        "max_batch": 8,
        "model": "shipped",
        "forward": "package",
        "closed_loop": True,
        "real_weights": real_case["ran"],  # only the summary's smollm2-135m-instruct_real_weights case
        "geometries": {
            "shipped": _geometry(forward.kv_spec(block_size=BLOCK_SIZE), "real forward: tokens, timings, blocks"),
            REAL_NAME: _geometry(
                REAL_GEOMETRY,
                "geometry only: the shipped run's block and token counts x this model's KV bytes per token; "
                "no forward with its weights, byte-level token counts",
            ),
        },
    }
    return envelope("agent", config, results, summary)


def human(report: dict[str, Any]) -> str:
    cols = [
        "trace",
        "reuse",
        "requests",
        "prefill_total",
        "prefill_computed",
        "peak_blocks",
        "ttft_median_s",
        "tokens_per_s",
        "preemptions",
    ]
    lines = [format_table(report["results"], cols), ""]
    traces = {n: f for n, f in report["summary"].items() if "prefill_tokens_saved_fraction" in f}
    for name, figures in traces.items():
        lines.append(
            f"{name}: "
            + ", ".join(
                f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                for k, v in figures.items()
                if not k.startswith("real_geometry")
            )
        )
    geometries = report["config"].get("geometries", {})
    if REAL_NAME in geometries:
        real = geometries[REAL_NAME]
        lines += [
            "",
            f"{REAL_NAME} geometry ({real['num_layers']} layers x 2 x {real['num_kv_heads']} KV heads x "
            f"{real['head_dim']} x fp16 = {real['kv_bytes_per_token']:,} bytes per token) — GEOMETRY ONLY: the "
            "block and token counts above (shipped model, byte tokens) priced at the real model's KV size; "
            "no forward with its weights",
        ]
        for name, figures in traces.items():
            peak = figures.get("real_geometry_peak_kv_bytes")
            if peak is None:
                continue
            saved = figures["real_geometry_prefill_kv_bytes_not_recomputed"]
            lines.append(
                f"{name}: peak KV {peak['with_reuse'] / MIB:.1f} MiB with reuse vs {peak['without'] / MIB:.1f} MiB "
                f"without; prefill KV not recomputed {saved / MIB:.1f} MiB"
            )
    real = report["summary"].get(f"{REAL_NAME}_real_weights")
    if real is not None:
        lines.append("")
        if not real.get("ran"):
            lines.append(f"{REAL_NAME} real weights: not run ({real.get('why')})")
        else:
            w, wo = real["with_reuse"], real["without"]
            lines.append(
                f"{REAL_NAME} REAL WEIGHTS, {real['agents']} agents over one {real['system_prompt_tokens']}-token "
                f"system prompt: prompt tokens {w['prompt_tokens']}, reused {w['reused_tokens']} with reuse vs "
                f"{wo['reused_tokens']} without; peak blocks {w['peak_blocks']} vs {wo['peak_blocks']}; "
                f"median TTFT {w['ttft_median_s']:.3f} s vs {wo['ttft_median_s']:.3f} s (identical outputs)"
            )
            lines += [f"  reply {i}: {text!r}" for i, text in enumerate(real["replies"])]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n, f in report["summary"].items() if "prefill_tokens_saved_fraction" in f]
    fig, ax = plt.subplots(figsize=(7, 4))
    width = 0.25
    for i, key in enumerate(("prefill_tokens_saved_fraction", "peak_blocks_ratio", "ttft_ratio_median")):
        ax.bar([j + i * width for j in range(len(names))], [report["summary"][n][key] for n in names], width, label=key)
    ax.set_xticks([j + width for j in range(len(names))], names)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.legend(fontsize=8)
    ax.set_title("agent traces: with reuse vs without")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
