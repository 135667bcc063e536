"""``make demo``: the main idea in a terminal — generate with each cache on the shipped model, compare.

Prints the completion once, then a table: per-token decode latency, KV memory held, bytes copied, and
whether the tokens are identical to the no-cache run (they must be).
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

PROMPT = 'def read_config(path):\n    """Read a JSON config file and return a dict."""\n'


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


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=160)
    parser.add_argument("--prompt", default=PROMPT)
    args = parser.parse_args(argv)
    from transformers import DynamicCache, StaticCache

    tok = ByteTokenizer()
    ours, hf = load_model(), load_hf_model()
    prompt = tok(args.prompt)
    package = lambda ids, cache: ours(ids, cache)  # noqa: E731
    transformers_fwd = lambda ids, cache: hf(input_ids=ids, cache=cache, use_cache=cache is not None).logits  # noqa: E731
    max_len = prompt.shape[1] + args.new_tokens
    runs = [
        ("no cache (recompute)", "package", package, lambda: None),
        ("ConcatCache", "package", package, ConcatCache),
        ("ContiguousCache", "package", package, lambda: ContiguousCache(capacity=max_len)),
        ("ContiguousCache", "transformers", transformers_fwd, lambda: ContiguousCache(capacity=max_len)),
        ("DynamicCache", "transformers", transformers_fwd, DynamicCache),
        ("StaticCache", "transformers", transformers_fwd, lambda: StaticCache(config=hf.config, max_cache_len=max_len)),
    ]
    reference, rows = None, []
    for name, forward, fn, make_cache in runs:
        cache = make_cache()
        ids, times = _generate(fn, prompt, cache, args.new_tokens)
        if reference is None:
            reference = ids
            print(f"prompt + completion ({args.new_tokens} new bytes, greedy):\n{tok.decode(ids[0])}\n")
        decode = times[1:] if cache is not None else times  # the first cached step is the prefill
        kv = (
            cache.nbytes_reserved()
            if hasattr(cache, "nbytes_reserved")
            else (sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers) if cache is not None else 0)
        )
        rows.append(
            {
                "cache": name,
                "forward": forward,
                "ms/token (median)": sorted(decode)[len(decode) // 2],
                "last step ms": times[-1],
                "KV KiB": kv / 1024,
                "bytes copied KiB": getattr(cache, "bytes_copied", 0) / 1024 if cache is not None else 0.0,
                "same tokens": bool(torch.equal(ids, reference)),
            }
        )
    print(format_table(rows, list(rows[0])))
    print(
        f"\nKV per token: {ours.kv_spec().bytes_per_token} bytes (fp32, {ours.config.num_layers} layers, "
        f"{ours.config.num_kv_heads} KV heads x {ours.config.head_dim})"
    )


if __name__ == "__main__":
    main()
