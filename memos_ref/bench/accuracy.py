"""Accuracy of a quantized KV cache, measured against the unquantized one on the same model and text (a harness
above the quant layer: it runs models through :mod:`memos_ref.hf`, so it lives with the benchmarks).

* perplexity: teacher-forced, the text fed through a :class:`~memos_ref.hf.PagedCache` in chunks, so every
  query attends over K/V read back from the (quantized) pool — its own chunk's included, as in decode;
* KL divergence ``KL(p_full || p_quant)`` of the next-token distributions, averaged over positions;
* greedy agreement: along the full-precision greedy continuation, the share of steps where the quantized
  cache picks the same next token (teacher-forced, so one early difference does not decide every later one),
  how many of the differences were near-ties in the reference (top-2 logits within 0.1), and the length of
  the identical prefix when both generate freely;
* bytes per token held by the pool at the end (staged residual blocks counted at fp16, as deployed).

A real tokenizer's model (SmolLM2-135M-Instruct) is measured on English prose it cannot have seen:
:func:`heldout_prose` reads ``memos_ref/model/data/heldout_prose.txt`` (written for this project in 2026, after
the model was trained; Apache-2.0 or CC0) and :func:`prose_token_ids` tokenizes it.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from memos_ref.errors import InvalidArgumentError, ShapeError, check_index, check_type
from memos_ref.hf import PagedCache
from memos_ref.paged import PagedKV
from memos_ref.quant import KIVI, Quantizer

__all__ = [
    "calibrate_layer_scales",
    "capture_kv",
    "channel_outlier_ratio",
    "evaluate",
    "heldout_prose",
    "make_kv",
    "prose_token_ids",
    "teacher_forced_logits",
]

PROSE_FILE = "heldout_prose.txt"
_SECTION = "* * *"


def heldout_prose() -> tuple[str, str]:
    """``(measured, calibration)``: the held-out English prose shipped in ``memos_ref/model/data/``, its header
    (lines starting with ``"# "``: source and licence) removed; the last ``* * *`` section is kept apart for
    calibrating static scales, everything before it is measured."""
    from memos_ref.model import shipped_model_dir

    raw = (Path(shipped_model_dir()).parent / "data" / PROSE_FILE).read_text(encoding="utf-8")
    body = "\n".join(line for line in raw.splitlines() if not line.startswith("# ")).strip()
    sections = [s.strip() for s in body.split(_SECTION)]
    return "\n\n".join(sections[:-1]), sections[-1]


def prose_token_ids(tokenizer: Any, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids [1, context], calibration [1, C])``: :func:`heldout_prose` tokenized by a transformers
    ``tokenizer`` as plain text (no special tokens), the first ``context`` tokens measured."""
    check_type("context", context, int)
    measured, calibration = heldout_prose()
    ids = tokenizer(measured, add_special_tokens=False)["input_ids"]
    if not 2 <= context <= len(ids):
        raise InvalidArgumentError(
            f"context: the held-out prose has {len(ids)} tokens for this tokenizer; expected 2..{len(ids)}, "
            f"got {context}"
        )
    return torch.tensor([ids[:context]]), torch.tensor([tokenizer(calibration, add_special_tokens=False)["input_ids"]])


def make_kv(model: Any, num_tokens: int, scheme: Quantizer | None, **kwargs: Any) -> PagedKV:
    """A paged memory big enough for one sequence of ``num_tokens`` (KIVI: block size = its group size)."""
    block = scheme.group_size if isinstance(scheme, KIVI) else 32
    blocks = -(-num_tokens // block) + 2
    if scheme is not None and kwargs.get("residual_tokens", 128 if isinstance(scheme, KIVI) else 0):
        kwargs.setdefault("staging_blocks", blocks)
    return PagedKV(model.kv_spec(block_size=block), blocks, quant=scheme, prefix_caching=False, **kwargs)


@torch.no_grad()
def teacher_forced_logits(
    model: Any, ids: torch.Tensor, kv: PagedKV, chunk: int = 64, cache: PagedCache | None = None
) -> torch.Tensor:
    """Logits ``[S, V]`` for ``ids [1, S]`` fed through a PagedCache over ``kv`` in chunks (``cache``: one the
    caller keeps, to read the pool while the sequence still holds its blocks; a cache made here is dropped on
    return, which frees its blocks)."""
    cache = PagedCache(kv) if cache is None else cache
    out = [model(ids[:, i : i + chunk], cache)[0] for i in range(0, ids.shape[1], chunk)]
    return torch.cat(out).float()


@torch.no_grad()
def capture_kv(model: Any, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every layer's keys and values ``([H, S, D], [H, S, D])`` for ``ids [1, S]``, as the cache stores them
    (keys after RoPE), read back from a full-precision paged cache."""
    kv = make_kv(model, ids.shape[1], None)
    cache = PagedCache(kv)
    try:
        model(ids, cache)
        seq = cache.sequences[0]
        return [tuple(t.clone() for t in seq.to_dense(layer)) for layer in range(kv.spec.num_layers)]
    finally:
        cache.free()


@torch.no_grad()
def calibrate_layer_scales(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """Static per-tensor int8 scales ``[L, 2]`` (absmax / 127 of each layer's keys and values) on ``ids``."""
    layers = capture_kv(model, ids)
    scales = torch.empty(len(layers), 2)
    for layer, (k, v) in enumerate(layers):
        scales[layer, 0], scales[layer, 1] = k.abs().max() / 127, v.abs().max() / 127
    return scales


def channel_outlier_ratio(x: torch.Tensor) -> torch.Tensor:
    """Per head ``[H]``: the largest channel's absmax over tokens divided by the median channel's, for one
    layer's keys or values ``x [H, S, D]``. Well above 1 means a few channels are large for every token (keys in
    trained LLMs: the reason KIVI gives keys a scale per channel); near 1, channels look alike."""
    check_type("x", x, torch.Tensor)
    if x.ndim != 3:
        raise ShapeError(f"x: expected one layer's keys or values [heads, tokens, head_dim], got {tuple(x.shape)}")
    amax = x.abs().amax(1)  # [H, D]: each channel's largest |x| over the tokens
    return amax.amax(-1) / amax.median(-1).values.clamp(min=1e-12)


def _bytes_per_token(kv: PagedKV, num_tokens: int) -> float:
    """Bytes the pool holds for the sequence, staged (full-precision) blocks counted at fp16."""
    pool, spec = kv.pool, kv.spec
    fp16_block = spec.block_size * spec.num_layers * 2 * spec.num_kv_heads * spec.head_dim * 2
    if not pool.quantized:
        return fp16_block / spec.block_size
    used = -(-num_tokens // spec.block_size)
    staged = pool.staged_blocks
    extra = pool.layer_scales.nbytes if pool.layer_scales is not None else 0
    return ((used - staged) * pool.block_payload_bytes + staged * fp16_block + extra) / num_tokens


@torch.no_grad()
def evaluate(
    model: Any,
    ids: torch.Tensor,
    scheme: Quantizer | None,
    *,
    reference: dict[str, Any] | None = None,
    generate_tokens: int = 256,
    prompt_tokens: int = 256,
    chunk: int = 64,
    **pool_kwargs: Any,
) -> dict[str, Any]:
    """Accuracy of ``scheme`` (None: the full-precision reference) on ``ids [1, S]``.

    Pass the reference run's result as ``reference`` to get KL and greedy agreement against it (the reference
    must have been run with the same ``generate_tokens`` and ``prompt_tokens``). ``generate_tokens=0`` skips
    the greedy measures (perplexity, KL and bytes only: one teacher-forced pass per scheme)."""
    check_index("generate_tokens", generate_tokens, lo=0)
    n = ids.shape[1]
    kv = make_kv(model, n, scheme, **pool_kwargs)
    cache = PagedCache(kv)  # kept until the pool is read: its residual window is staged only while it lives
    logits = teacher_forced_logits(model, ids, kv, chunk, cache)  # [S, V]
    logp = logits.log_softmax(-1)
    nll = -logp[:-1].gather(1, ids[0, 1:, None]).mean().item()
    result: dict[str, Any] = {
        "scheme": scheme.name if scheme is not None else "fp32",
        "tokens": n,
        "ppl": math.exp(nll),
        "bits_per_byte": nll / math.log(2),  # per token of the model's tokenizer (bytes for the shipped model)
        "bytes_per_token": _bytes_per_token(kv, n),
        "pool_stats": kv.pool.stats() if hasattr(kv.pool, "stats") else {},
    }
    cache.free()
    if reference is not None:
        ref_logp = reference["logp"]
        result["kl_mean"] = (ref_logp.exp() * (ref_logp - logp)).sum(-1).mean().item()
        result["ppl_delta_pct"] = 100 * (result["ppl"] / reference["ppl"] - 1)
    else:
        result["logp"] = logp
    if generate_tokens == 0:
        return result
    # greedy: the reference continues the prompt; the quantized cache is teacher-forced along it
    prompt = ids[:, :prompt_tokens]
    if reference is None:
        gen_kv = make_kv(model, prompt_tokens + generate_tokens, None)
        continuation = model.generate(prompt, generate_tokens, PagedCache(gen_kv))
        forced_kv = make_kv(model, continuation.shape[1], None)
        forced = teacher_forced_logits(model, continuation[:, :-1], forced_kv, chunk)[prompt_tokens - 1 :]
        top2 = forced.topk(2, dim=-1).values
        result["continuation"] = continuation
        result["top2_gap"] = top2[:, 0] - top2[:, 1]  # [generated]: how close each greedy choice was
        return result
    continuation = reference["continuation"]
    gen_kv = make_kv(model, continuation.shape[1], scheme, **pool_kwargs)
    forced = teacher_forced_logits(model, continuation[:, :-1], gen_kv, chunk)[prompt_tokens - 1 :]
    want = continuation[0, prompt_tokens:]
    mismatch = forced.argmax(-1) != want
    result["greedy_agreement"] = 1 - mismatch.float().mean().item()
    # a flipped near-tie (top-2 logits within 0.1 of each other in the reference) is noise, not damage
    result["mismatches_near_tie"] = int((mismatch & (reference["top2_gap"] < 0.1)).sum())
    result["mismatches"] = int(mismatch.sum())
    free_kv = make_kv(model, continuation.shape[1], scheme, **pool_kwargs)
    free = model.generate(prompt, generate_tokens, PagedCache(free_kv))[0, prompt_tokens:]
    differs = (free != want).nonzero()
    result["identical_prefix_tokens"] = int(differs[0]) if differs.numel() else generate_tokens
    return result
