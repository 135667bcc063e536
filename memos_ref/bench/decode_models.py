"""``bench decode``'s models and contenders: the model geometries it runs on (the shipped model, a wide
random-init Llama, SmolLM2-135M's KV geometry or weights), the cache methods it compares, and their prompts."""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from memos_ref.caches import ConcatCache, ContiguousCache
from memos_ref.model import load_hf_model, load_model
from memos_ref.model.corpus import heldout_text
from memos_ref.model.tokenizer import ByteTokenizer

__all__ = [
    "CLASSIC_MODELS",
    "METHODS",
    "POOL_SCALE",
    "SMOLLM2",
    "SMOLLM2_GEOMETRY",
    "WIDE_CONFIG",
    "Method",
    "random_init",
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


def kv_bytes(cache: Any) -> int:
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


def load_models(quick: bool) -> tuple[dict[str, tuple[Any, Any]], dict[str, str]]:
    """name -> (package forward, transformers model), both on the same weights; and name -> their source."""
    tok = ByteTokenizer()
    models = {"shipped": (load_model(), load_hf_model()), "wide": random_init(WIDE_CONFIG, tok.vocab_size)}
    sources = {"shipped": "the shipped weights", "wide": "random init"}
    models[SMOLLM2], sources[SMOLLM2] = _smollm2(quick)
    return models, sources


def contexts(model: str, quick: bool) -> tuple[int, ...]:
    if quick:
        return (32,) if model == SMOLLM2 else (32, 128)
    return (256, 1024) if model == SMOLLM2 else (256, 1024, 4096)


def prompt_ids(name: str, length: int, vocab: int) -> torch.Tensor:
    if name == "shipped":
        tok = ByteTokenizer()
        ids = tok.encode(heldout_text()[: length * 2], add_bos=True)[:length]
    else:
        ids = torch.randint(0, min(vocab, 256), (length,), generator=torch.Generator().manual_seed(length)).tolist()
    return torch.tensor([ids], dtype=torch.long)  # [1, length]
