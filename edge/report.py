"""The planner's tables for ``edge/README.md`` and notebook 11, generated, so no figure there is typed by hand.

``python -m memos_edge.report`` prints every table; ``python -m memos_edge.report --write edge/README.md``
rewrites the generated blocks in place (each between ``<!-- generated: NAME -->`` and ``<!-- end: NAME -->``);
``tests/test_edge_readme.py`` requires the README's blocks to equal :func:`tables` now.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from memos_edge.plan import GIB, MIB, NVIDIA_AGX_LLAMA3_8B, calibration_table, nvidia_implied_kv_tokens, plan

from memos_ref.errors import ConfigError

__all__ = ["PLANS", "SMOL_BUILD", "fill", "tables"]

#: the README's planner rows: (model, device, weights)
PLANS = [
    ("llama-2-7b", "orin-nx-16gb", "int4"),
    ("llama-3-8b", "orin-agx-64gb", "int4"),
    ("llama-3-8b", "orin-nx-16gb", "int4"),
    ("qwen2.5-7b", "orin-nx-8gb", "int4"),
    ("qwen2.5-7b", "orin-nx-16gb", "int4"),
    ("smollm2-135m-instruct", "orin-nano-8gb", "fp16"),
    ("smollm2-135m-instruct", "orin-agx-64gb", "fp16"),
]
#: the shipped SmolLM2 scripts' engine shapes: batch 4, the safe variant's 2,048 + 4 tokens per step
SMOL_BUILD = {"max_batch": 4, "max_num_tokens": 2052}
#: the shipped Llama-3-8B script's shapes (jetson/deploy.sh): batch 4, 2,048 + 4
LLAMA_BUILD = {"max_batch": 4, "max_num_tokens": 2052}


def _plans() -> str:
    head = (
        "| model | module | `tokens_per_block` | KV tokens | largest context, batch 1 | decode bound, batch 1 at 1k |"
    )
    rows = [head, "| --- | --- | --- | --- | --- | --- |"]
    for model, device, weights in PLANS:
        p = plan(model, device, weights=weights)
        if not p.feasible:
            rows.append(f"| {model} {weights} | {device} | — | **does not fit**: {p.why_infeasible} | — | — |")
            continue
        bound = p.decode_tokens_per_s_bound["batch1_ctx1024"]
        rows.append(f"| {model} {weights} | {device} | {p.tokens_per_block} | {p.kv_tokens:,} | "
                    f"{p.max_context_by_batch[1]:,} | {bound:.1f} tok/s |")  # fmt: skip
    return "\n".join(rows)


def _terms() -> str:
    p = plan("llama-3-8b", "orin-agx-64gb", weights="int4")
    rows = ["| term | GiB | source |", "| --- | --- | --- |"]
    rows += [f"| `{t['name']}` | {t['bytes'] / GIB:.2f} | {t['source']} |" for t in p.memory_terms]
    rows.append(f"| free → KV budget (× 0.9) | {p.free_bytes / GIB:.2f} → {p.kv_budget_bytes / GIB:.2f} | "
                f"TensorRT-LLM's `kv_cache_free_gpu_memory_fraction` |")  # fmt: skip
    return "\n".join(rows)


def _calibration() -> str:
    head = "| Llama-3-8B INT4, AGX Orin 64GB | NVIDIA (README4Jetson) | plan (calibrated) | error | before (nominal) |"
    rows = [head, "| --- | --- | --- | --- | --- |"]
    for r in calibration_table():
        plan_cell = f"{r['plan']:,}" if isinstance(r["plan"], int) else f"{r['plan']:.2f}"
        old = f"{r['nominal']:,}" if isinstance(r["nominal"], int) else f"{r['nominal']:.2f}"
        rows.append(f"| {r['quantity']} | {r['nvidia']} | {plan_cell} | {r['error']:+.1%} | {old} |")
    implied = nvidia_implied_kv_tokens(131_072)
    n = NVIDIA_AGX_LLAMA3_8B
    rows.append("")
    rows.append(f"NVIDIA's KV: ({n['gpu_mmap_gb']} − {n['static_gpu_gb']}) GB of paged pool at 131,072 B per token = "
                f"{implied['GB']:,} tokens (GB = 10⁹) to {implied['GiB']:,} (GiB); the error is against their "
                f"midpoint.")  # fmt: skip
    return "\n".join(rows)


def _blocks() -> str:
    rows = ["| model, KV | per-layer slab (the ~1 MiB quantity) | all-layer block (allocation unit) | T | 1 MiB? |",
            "| --- | --- | --- | --- | --- |"]  # fmt: skip
    for model, kv in [("llama-2-7b", "fp16"), ("llama-2-7b", "int8"), ("llama-3-8b", "fp16"), ("qwen2.5-7b", "fp16"),
                      ("smollm2-135m-instruct", "fp16")]:  # fmt: skip
        p = plan(model, "orin-agx-64gb", weights="fp16" if model.startswith("smollm2") else "int4", kv_dtype=kv)
        need = 1 << (MIB // (p.layer_slab_bytes // p.tokens_per_block)).bit_length() - 1  # power-of-two T for 1 MiB
        reach = "yes" if p.slab_target_reached else f"no: it needs T = {need}, over XQA's 128-token cap"
        rows.append(f"| {model}, {kv} | {p.layer_slab_bytes / MIB:.3f} MiB | {p.block_bytes / MIB:.2f} MiB | "
                    f"{p.tokens_per_block} | {reach} |")  # fmt: skip
    return "\n".join(rows)


def _smollm2() -> str:
    nano = plan("smollm2-135m-instruct", "orin-nano-8gb", weights="fp16", **SMOL_BUILD)
    agx = plan("smollm2-135m-instruct", "orin-agx-64gb", weights="fp16", **SMOL_BUILD)
    nano8 = plan("smollm2-135m-instruct", "orin-nano-8gb", weights="fp16", kv_dtype="int8", **SMOL_BUILD)
    llama = plan("llama-3-8b", "orin-agx-64gb", weights="int4", **LLAMA_BUILD)

    def bound(p: object) -> str:
        return f"{p.decode_tokens_per_s_bound['batch1_ctx1024']:.0f} tok/s"  # type: ignore[attr-defined]

    rows = [
        "| plan for the shipped scripts (batch 4, 2,052 tokens per step) | Orin Nano 8GB | AGX Orin 64GB |",
        "| --- | --- | --- |",
        f"| weights in the engine (fp16, with the tied head's own copy) | {nano.weight_bytes:,} B "
        f"({nano.weight_bytes / GIB:.2f} GiB) | same |",
        f"| KV per token, fp16 / int8 | {nano.kv_bytes_per_token:,} B / {nano8.kv_bytes_per_token:,} B | same |",
        f"| `tokens_per_block`, per-layer slab, all-layer block | {nano.tokens_per_block}, "
        f"{nano.layer_slab_bytes // 1024} KiB, {nano.block_bytes / MIB:.2f} MiB | same |",
        f"| KV budget → blocks → tokens (`--max_tokens_in_paged_kv_cache`), fp16 KV | "
        f"{nano.kv_budget_bytes / GIB:.2f} GiB → {nano.blocks:,} → {nano.kv_tokens:,} | "
        f"{agx.kv_budget_bytes / GIB:.2f} GiB → {agx.blocks:,} → {agx.kv_tokens:,} |",
        f"| same, int8 KV | {nano8.blocks:,} blocks → {nano8.kv_tokens:,} tokens | — |",
        f"| largest context at batch 1 | {nano.max_context_by_batch[1]:,} (the model's limit) | "
        f"{agx.max_context_by_batch[1]:,} |",
        f"| decode bound, batch 1 at 1,024 tokens ({nano.weights_read_per_token / GIB:.2f} GiB read per token) | "
        f"{bound(nano)} | {bound(agx)} |",
        f"| Llama-3-8B INT4 (`jetson/deploy.sh`, AGX Orin 64GB) | — | {llama.kv_tokens:,} tokens, {bound(llama)} "
        f"(NVIDIA measured {NVIDIA_AGX_LLAMA3_8B['decode_tok_s']}) |",
    ]
    return "\n".join(rows)


def tables() -> dict[str, str]:
    """Every generated table, by the name its README block carries."""
    return {"plans": _plans(), "terms": _terms(), "calibration": _calibration(), "blocks": _blocks(),
            "smollm2": _smollm2()}  # fmt: skip


def fill(text: str) -> str:
    """``text`` with every generated block replaced by the table of that name (an unknown name is refused)."""
    made = tables()

    def block(m: re.Match) -> str:
        name = m[1]
        if name not in made:
            raise ConfigError(f"unknown generated block {name!r}: expected one of {sorted(made)}")
        return f"<!-- generated: {name} -->\n{made[name]}\n<!-- end: {name} -->"

    return re.sub(r"<!-- generated: (\w+) -->\n(?:.*?\n)?<!-- end: \1 -->", block, text, flags=re.S)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m memos_edge.report", description=__doc__.split("\n")[0])
    parser.add_argument("--write", metavar="README", help="rewrite the generated blocks of this file in place")
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(fill(path.read_text()))
    else:
        for name, table in tables().items():
            print(f"## {name}\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
