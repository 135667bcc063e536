"""``make demo``: the main idea in a terminal — generate with each cache on a real chat model, compare.

By default on SmolLM2-135M-Instruct (prepared by ``make setup``): a question through the chat template, the
answer once, then a table — per-token decode latency, KV memory held, bytes the cache copied to grow, and
whether the tokens are identical to the no-cache run (they must be) — every column explained under it, and a
one-line takeaway computed from the run. ``--toy`` runs the same on the tiny shipped byte-level model (seconds,
no preparation; its text is Python-shaped noise).

``python -m memos_ref.demo --agents``: a short multi-agent exchange on the real chat model
instead — a system prompt and a tool list rendered through the model's chat template, a main agent, sub-agents
asked other questions (one of them starting from an injected memory), their answers, and per agent the prompt
tokens, the tokens reused from the prefix cache (or the memory), the blocks it shares with other sessions and
its time to first token. ``--check`` also compares every answer with transformers' ``generate`` (greedy,
``DynamicCache``), token for token.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from memos_ref.bench.common import format_table
from memos_ref.caches import ConcatCache, ContiguousCache
from memos_ref.model import load_hf_model, load_model
from memos_ref.model.tokenizer import ByteTokenizer
from memos_ref.session import SegmentKind, SessionManager

PROMPT = 'def read_config(path):\n    """Read a JSON config file and return a dict."""\n'
QUESTION = "Why do language models cache keys and values when they generate text? Answer in two sentences."
REAL_MODEL = "smollm2-135m-instruct"

COLUMNS = {
    "cache": "where the keys and values are kept (no cache: every step recomputes the whole sequence)",
    "forward": "whose forward pass ran: the package's teaching forward or transformers' model, same weights",
    "ms/token (median)": "median time of one decode step after the prompt (this machine, this run)",
    "last step ms": "the final step: with a cache it barely grows with the length; without one it does",
    "KV KiB": "memory the cache holds or has reserved at the end",
    "bytes copied KiB": "bytes the cache moved into its storage: concatenation re-copies every held token at each "
    "step; a preallocated buffer writes each token once ('—': transformers does not report it; DynamicCache grows "
    "by torch.cat, like ConcatCache)",
    "same tokens": "the generated tokens equal the no-cache run's, token for token",
}

#: The real-model demo's agents: (name, how it starts, question).
CHAT_SYSTEM = "You are a concise assistant. Answer in one sentence."
CHAT_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the web",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
        },
    },
]
CHAT_MEMORY = "Known facts about the user: name Ada; pet a cat named Tom."
CHAT_AGENTS = [
    ("main", "system+tools", "What is the capital of France? Answer in one sentence."),
    ("sub-1", "system+tools", "What color is the sky on a clear day?"),
    ("sub-2", "fork of main", "And what is the capital of Italy?"),
    ("sub-3", "memory", "What is the name of my cat?"),
]


def _generate(step_fn, prompt: torch.Tensor, cache: Any, new_tokens: int) -> tuple[torch.Tensor, list[float]]:
    """Greedy decoding with per-step timing; ``cache=None`` recomputes the whole sequence every step."""
    ids, times = prompt, []
    with torch.inference_mode():
        feed = prompt
        for _ in range(new_tokens):
            started = time.perf_counter()
            logits = step_fn(ids if cache is None else feed, cache)
            feed = logits[:, -1:].argmax(-1)
            times.append((time.perf_counter() - started) * 1e3)
            ids = torch.cat([ids, feed], dim=1)
    return ids, times


def _agent_session(manager: SessionManager, start: str, main: Any, memory: Any) -> Any:
    if start == "fork of main":
        return main.fork(1)[0]
    if start == "memory":
        return manager.new_session(memories=[memory])
    return manager.new_session(system=("assistant", "v1"), tools=CHAT_TOOLS)


def run_chat_demo(model: Any, tokenizer: Any, *, new_tokens: int = 24, fingerprint: str = "demo") -> dict[str, Any]:
    """The multi-agent exchange on ``model`` (the package's forward) with its chat ``tokenizer``.

    Returns ``{"rows": [...], "sessions": {...}, "manager": ...}``: one row per agent (agent, start, question,
    answer, prompt tokens, reused tokens, blocks shared, TTFT ms, new tokens); the sessions stay open so their
    blocks can be inspected (close them, or drop the manager, when done)."""
    manager = SessionManager(model, num_blocks=96, tokenizer=tokenizer, fingerprint=fingerprint)
    manager.register_system_prompt("assistant", "v1", CHAT_SYSTEM)
    sessions: dict[str, Any] = {}
    timings: dict[str, float] = {}
    memory = None
    for name, start, question in CHAT_AGENTS:
        if start == "memory" and memory is None:
            memory = manager.build_memory("user-profile", CHAT_MEMORY, system=("assistant", "v1"), tools=CHAT_TOOLS)
        started = time.perf_counter()
        session = _agent_session(manager, start, sessions["main"][0] if sessions else None, memory)
        reused = session.prefill_reused if start != "fork of main" else len(session.token_ids)
        session.append(SegmentKind.USER, "question", question)
        before_reply = time.perf_counter()
        session.generate(new_tokens)
        timings[name] = before_reply - started + (session.last_reply["ttft_s"] or 0.0)
        sessions[name] = (session, reused)
    rows = []
    for name, start, question in CHAT_AGENTS:
        session, reused = sessions[name]
        rows.append(
            {
                "agent": name,
                "starts from": start,
                "question": question,
                "answer": session.messages[-1]["content"],
                "prompt tokens": session.last_reply["prompt_tokens"],
                "reused tokens": reused,
                "blocks shared": session.blocks_shared(),
                "TTFT ms": timings[name] * 1e3,
                "new tokens": session.last_reply["new_tokens"],
            }
        )
    manager.kv.check()
    return {"rows": rows, "sessions": {k: v[0] for k, v in sessions.items()}, "manager": manager}


def chat_main(args: argparse.Namespace) -> None:
    """``--model NAME``: the real-model multi-agent demo."""
    from transformers import AutoTokenizer

    from memos_ref.model import pretrained_fingerprint, pretrained_path

    path = pretrained_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = load_model(path)
    new_tokens = args.new_tokens
    result = run_chat_demo(model, tokenizer, new_tokens=new_tokens, fingerprint=pretrained_fingerprint(args.model))
    tools = ", ".join(t["function"]["name"] for t in CHAT_TOOLS)
    print(f"{args.model}: system prompt {CHAT_SYSTEM!r}; tools: {tools}; memory: {CHAT_MEMORY!r}\n")
    for row in result["rows"]:
        print(f"[{row['agent']}, {row['starts from']}] {row['question']}\n    -> {row['answer']}")
    columns = ["agent", "starts from", "prompt tokens", "reused tokens", "blocks shared", "TTFT ms", "new tokens"]
    print("\n" + format_table(result["rows"], columns))
    manager = result["manager"]
    active = manager.kv.allocator.num_active
    held = sum(len(s.cache.sequences[0].block_table) for s in result["sessions"].values())
    print(
        f"\nblocks in use: {active} for {len(result['rows'])} agents and one memory (the agents' block tables list "
        f"{held}: the rest are shared); block = {manager.spec.block_size} tokens, "
        f"{manager.spec.bytes_per_block / 1024:.0f} KiB of fp32 K/V"
    )
    if args.check:
        _check_against_transformers(args.model, result)


def _check_against_transformers(name: str, result: dict[str, Any]) -> None:
    """Each agent's tokens against transformers' greedy ``generate`` with a ``DynamicCache``."""
    from transformers import DynamicCache

    from memos_ref.model import load_pretrained

    _, hf = load_pretrained(name)
    for agent, session in result["sessions"].items():
        reply = session.segment_list[-1]
        prompt = session.token_ids[: session.last_reply["prompt_tokens"]]
        n = session.last_reply["new_tokens"]
        with torch.inference_mode():
            out = hf.generate(torch.tensor([prompt]), cache=DynamicCache(), max_new_tokens=n, do_sample=False)
        same = out[0, len(prompt) :].tolist() == session.token_ids[len(prompt) : len(prompt) + n]
        print(f"{agent}: same tokens as transformers generate (DynamicCache): {same}  [{reply.start}, {reply.stop})")


def _kv_bytes(cache: Any) -> int:
    if cache is None:
        return 0
    if hasattr(cache, "nbytes_reserved"):
        return int(cache.nbytes_reserved())
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def compare_caches(ours: Any, hf: Any, prompt: torch.Tensor, new_tokens: int) -> tuple[list[dict], torch.Tensor]:
    """Greedy generation with every cache on both forwards; one row per run (the columns of :data:`COLUMNS`)
    and the no-cache run's ids (the reference every row is compared with)."""
    from transformers import DynamicCache, StaticCache

    def package(ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return ours(ids, cache)

    def transformers_fwd(ids: torch.Tensor, cache: Any) -> torch.Tensor:
        return hf(input_ids=ids, cache=cache, use_cache=cache is not None).logits

    max_len = prompt.shape[1] + new_tokens
    runs = [
        ("no cache (recompute)", "package", package, lambda: None),
        ("ConcatCache", "package", package, lambda: ConcatCache()),
        ("ContiguousCache", "package", package, lambda: ContiguousCache(capacity=max_len)),
        ("ContiguousCache", "transformers", transformers_fwd, lambda: ContiguousCache(capacity=max_len)),
        ("DynamicCache", "transformers", transformers_fwd, lambda: DynamicCache()),
        ("StaticCache", "transformers", transformers_fwd, lambda: StaticCache(config=hf.config, max_cache_len=max_len)),
    ]
    reference, rows = None, []
    for name, forward, fn, make_cache in runs:
        cache = make_cache()
        ids, times = _generate(fn, prompt, cache, new_tokens)
        reference = ids if reference is None else reference
        decode = times[1:] if cache is not None else times  # the first cached step is the prefill
        copied = getattr(cache, "bytes_copied", None) if cache is not None else 0
        rows.append(
            {
                "cache": name,
                "forward": forward,
                "ms/token (median)": sorted(decode)[len(decode) // 2],
                "last step ms": times[-1],
                "KV KiB": _kv_bytes(cache) / 1024,
                "bytes copied KiB": "—" if copied is None else f"{copied / 1024:,.0f}",
                "same tokens": bool(torch.equal(ids, reference)),
            }
        )
    return rows, reference


def takeaway(rows: list[dict]) -> str:
    """One line computed from the table: the cache's speed-up, whether every cache gave the same tokens, and
    what concatenation copied against a preallocated buffer."""
    recompute = rows[0]["ms/token (median)"]
    cached = [r for r in rows[1:] if r["forward"] == "package"]
    best = min(cached, key=lambda r: r["ms/token (median)"])
    same = all(r["same tokens"] for r in rows)
    concat = next(r for r in rows if r["cache"] == "ConcatCache")["bytes copied KiB"]
    contiguous = next(r for r in rows if r["cache"] == "ContiguousCache")["bytes copied KiB"]
    return (
        f"Takeaway: with a cache ({best['cache']}) a decode step took {best['ms/token (median)']:.1f} ms against "
        f"{recompute:.1f} ms recomputing ({recompute / best['ms/token (median)']:.1f}x faster), "
        f"{'with identical tokens from every cache' if same else 'BUT SOME TOKENS DIFFER'}; concatenation moved "
        f"{concat} KiB where a preallocated buffer wrote each token once, {contiguous} KiB (notebooks 00-02)."
    )


def _print_table(rows: list[dict]) -> None:
    print(format_table(rows, list(COLUMNS)))
    print("\ncolumns:")
    for name, meaning in COLUMNS.items():
        print(f"  {name:18s} {meaning}")
    print("\n" + takeaway(rows))


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens (default 40; 160 with --toy)")
    parser.add_argument("--toy", action="store_true", help="the tiny shipped byte-level model instead (seconds)")
    parser.add_argument("--prompt", default=None, help="the question (real model) or code prompt (--toy)")
    parser.add_argument("--model", default=REAL_MODEL, help=f"the real chat model (default {REAL_MODEL})")
    parser.add_argument("--agents", action="store_true", help="the multi-agent exchange on the real model")
    parser.add_argument("--check", action="store_true", help="with --agents: compare with transformers generate")
    args = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no weight-loading bars between the answer and the table
    if args.agents:
        args.new_tokens = args.new_tokens or 24
        chat_main(args)
        return
    if args.toy:
        tok = ByteTokenizer()
        ours, hf = load_model(), load_hf_model()
        prompt, new_tokens = tok(args.prompt or PROMPT), args.new_tokens or 160
        rows, ids = compare_caches(ours, hf, prompt, new_tokens)
        print(
            f"prompt + completion ({new_tokens} new bytes, greedy; a 3M-parameter toy model):\n{tok.decode(ids[0])}\n"
        )
    else:
        from memos_ref.model import load_pretrained, pretrained_path

        tokenizer, hf = load_pretrained(args.model)
        ours = load_model(pretrained_path(args.model))
        messages = [{"role": "system", "content": CHAT_SYSTEM}, {"role": "user", "content": args.prompt or QUESTION}]
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
        prompt = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
        new_tokens = args.new_tokens or 40
        rows, ids = compare_caches(ours, hf, prompt, new_tokens)
        answer = tokenizer.decode(ids[0, prompt.shape[1] :], skip_special_tokens=True).strip()
        print(f"{args.model}, greedy, {new_tokens} new tokens\nQ: {args.prompt or QUESTION}\nA: {answer}\n")
    _print_table(rows)
    spec = ours.kv_spec()
    print(
        f"KV per token: {spec.bytes_per_token:,} bytes ({spec.num_layers} layers, {spec.num_kv_heads} KV heads x "
        f"{spec.head_dim}, {str(spec.dtype).split('.')[-1]})"
    )


if __name__ == "__main__":
    main()
