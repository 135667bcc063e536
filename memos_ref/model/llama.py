"""A minimal Llama-family forward pass that takes any KV cache: the teaching vehicle of every notebook.

One readable file: RMSNorm, rotary position embeddings (RoPE), grouped-query attention, a SwiGLU MLP. It
loads the same ``config.json`` + ``model.safetensors`` as ``transformers`` (Llama, Mistral without a sliding
window, and Qwen2, whose q/k/v projections carry a bias) and its logits match transformers' to 1e-4 in fp32.

The cache is anything with the transformers cache protocol:
``cache.update(k, v, layer_idx) -> (K_all, V_all)`` with ``k, v: [B, H_kv, S_new, D]`` and
``cache.get_seq_length() -> int``. So the package's caches, transformers' ``DynamicCache`` and
``StaticCache`` all plug in here, and the package's caches plug into transformers too.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from memos_ref.errors import (
    ConfigError,
    CorruptCacheError,
    DTypeError,
    InvalidArgumentError,
    ModelUnavailableError,
    ShapeError,
    check_index,
    check_type,
)
from memos_ref.model.model_folder import read_small_json
from memos_ref.model.rope_config import read_rope_config
from memos_ref.spec import KVSpec, dtype_from_name

__all__ = ["LlamaConfig", "LlamaForward", "apply_rope", "rope_cos_sin"]

_SUPPORTED = ("llama", "mistral", "qwen2")
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_hidden_layers")


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a transformers config that this forward needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    dtype: str = "float32"
    #: Set for Mistral/Qwen2 configs with a sliding window; sequences longer than it are refused (full
    #: attention and sliding-window attention agree only while the sequence fits in the window).
    sliding_window: int | None = None

    @classmethod
    def from_hf_dict(cls, cfg: Mapping[str, Any]) -> LlamaConfig:
        """Read a transformers ``config.json`` dict (Llama, Mistral or Qwen2)."""
        check_type("cfg", cfg, Mapping)
        model_type = cfg.get("model_type", "llama")
        if model_type not in _SUPPORTED:
            raise ConfigError(f"model_type {model_type!r} is not supported: expected one of {_SUPPORTED}")
        declared = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
        kind = declared.get("rope_type", declared.get("type", "default")) if isinstance(declared, Mapping) else None
        if kind not in ("default", None):  # name the unsupported feature before checking its fields
            raise ConfigError(f"rope type {kind!r} is not supported by the teaching forward: expected 'default'")
        rope = read_rope_config(cfg)  # the one RoPE reader (also the Jetson exporter's): theta, both layouts
        if not rope.is_default:
            raise ConfigError(
                f"rope type {rope.rope_type!r} is not supported by the teaching forward: expected 'default'"
            )
        missing = [k for k in _REQUIRED if k not in cfg]
        if missing:
            raise ConfigError(f"config is missing {missing}: a Llama-family config.json needs {list(_REQUIRED)}")
        window = None
        if (model_type == "mistral" and cfg.get("sliding_window")) or (
            model_type == "qwen2" and cfg.get("use_sliding_window") and cfg.get("sliding_window")
        ):
            window = int(cfg["sliding_window"])
        heads = cfg["num_attention_heads"]
        spec = KVSpec.from_hf_config(cfg, dtype="float32")
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=spec.num_layers,
            num_heads=heads,
            num_kv_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope.theta,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if model_type == "qwen2" else bias,
            o_bias=bias if model_type == "llama" else False,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            model_type=model_type,
            dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "float32"),
            sliding_window=window,
        )

    def kv_spec(self, dtype: torch.dtype = torch.float32, block_size: int = 16) -> KVSpec:
        """The KV geometry of this model."""
        return KVSpec(self.num_layers, self.num_kv_heads, self.head_dim, dtype, block_size, self.num_heads)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[B, S, D]`` for integer ``positions [B, S]`` (the "default" RoPE)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D/2]
    angles = positions.float()[..., None] * inv_freq.to(positions.device)  # [B, S, D/2]
    angles = torch.cat([angles, angles], dim=-1)  # [B, S, D]
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [B, H, S, D]`` by its positions: pairs (i, i + D/2) turn by angle pos·θ_i."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)  # rotate_half
    return x * cos[:, None] + rotated * sin[:, None]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.cfg, self.layer_idx = cfg, layer_idx
        d, hq, hkv = cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
        self.q_proj = nn.Linear(cfg.hidden_size, hq * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, hkv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(hq * d, cfg.hidden_size, bias=cfg.o_bias)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, cache: Any, paged: bool
    ):
        b, s, _ = x.shape
        d, hq, hkv = self.cfg.head_dim, self.cfg.num_heads, self.cfg.num_kv_heads
        q = self.q_proj(x).view(b, s, hq, d).transpose(1, 2)  # [B, Hq, S, D]
        k = self.k_proj(x).view(b, s, hkv, d).transpose(1, 2)  # [B, Hkv, S, D]
        v = self.v_proj(x).view(b, s, hkv, d).transpose(1, 2)  # [B, Hkv, S, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if paged:
            # A paged cache attends over its own blocks (kernel-shaped call; see memos_ref.attention).
            out = cache.attend(q, k, v, self.layer_idx)  # [B, Hq, S, D]
            return self.o_proj(out.transpose(1, 2).reshape(b, s, hq * d))
        if cache is not None:
            # The cache stores this step's K/V and hands back everything seen so far.
            k, v = cache.update(k, v, self.layer_idx)  # [B, Hkv, past + S, D]
        group = hq // hkv  # query heads sharing one KV head (GQA)
        q = q.reshape(b, hkv, group * s, d)  # [B, Hkv, G·S, D]: group the query heads of each KV head
        scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(d)  # [B, Hkv, G·S, T], fp32
        scores = scores.view(b, hkv, group, s, -1) + mask[:, None, None]  # [B, Hkv, G, S, T]
        probs = scores.softmax(dim=-1).to(v.dtype)
        out = probs.view(b, hkv, group * s, -1) @ v  # [B, Hkv, G·S, D]
        out = out.view(b, hq, s, d).transpose(1, 2).reshape(b, s, hq * d)  # [B, S, Hq·D]
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, mask, cache, paged=False):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, mask, cache, paged)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


@contextlib.contextmanager
def _skip_random_init() -> Iterator[None]:
    """Build modules without drawing random initial weights: ``nn.Linear``/``nn.Embedding`` fill 134M parameters
    with random numbers (~5 s on one core) that loading a checkpoint replaces at once."""
    names = ("kaiming_uniform_", "uniform_", "normal_")
    saved = {name: getattr(nn.init, name) for name in names}
    try:
        for name in names:
            setattr(nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


class LlamaForward(nn.Module):
    """The package's own Llama-family causal LM; parameter names match transformers' safetensors."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = _Body(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype | str = torch.float32) -> LlamaForward:
        """Load ``config.json`` and ``model.safetensors`` from a folder (no pickle, no network). A folder without
        them is :class:`~memos_ref.errors.ModelUnavailableError`; a ``config.json`` that is not a bounded JSON
        object :class:`~memos_ref.errors.ConfigError`; weights safetensors cannot read
        :class:`~memos_ref.errors.CorruptCacheError`."""
        check_type("path", path, (str, os.PathLike))
        path = Path(path)
        absent = [name for name in ("config.json", "model.safetensors") if not (path / name).is_file()]
        if absent:
            raise ModelUnavailableError(
                f"{str(path)[:200]}: expected a model folder holding config.json and model.safetensors, but "
                f"{' and '.join(absent)} {'is' if len(absent) == 1 else 'are'} not there (or not a file)"
            )
        try:
            raw = read_small_json(path / "config.json", limit=1 << 20)
        except ValueError as exc:
            raise ConfigError(f"{path / 'config.json'}: expected a JSON object, {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path / 'config.json'}: expected a JSON object, got {type(raw).__name__}")
        cfg = LlamaConfig.from_hf_dict(raw)
        with _skip_random_init():  # every parameter is overwritten below (or the load is refused)
            model = cls(cfg)
        try:
            state = load_file(str(path / "model.safetensors"))
        except Exception as exc:  # safetensors' own error types, an OSError
            raise CorruptCacheError(
                f"{path / 'model.safetensors'}: not a readable safetensors file ({type(exc).__name__}: "
                f"{str(exc)[:200]})"
            ) from None
        if cfg.tie_word_embeddings and "model.embed_tokens.weight" in state:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.endswith("rotary_emb.inv_freq")]
        if missing or unexpected:
            raise ConfigError(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
        return model.to(dtype_from_name(dtype)).eval()

    def kv_spec(self, block_size: int = 16) -> KVSpec:
        """The KV geometry in this model's parameter dtype."""
        return self.config.kv_spec(self.lm_head.weight.dtype, block_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        cache: Any = None,
        *,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[B, S, V]`` for ``input_ids [B, S]``, appending their K/V to ``cache`` if one is given.

        ``attention_mask [B, past + S]`` (1 = real token, 0 = padding; left padding) is optional; without it
        every token is real. Positions continue from ``cache.get_seq_length()``.
        """
        self._check_ids(input_ids)
        check_type("attention_mask", attention_mask, (torch.Tensor, type(None)))
        check_type("position_ids", position_ids, (torch.Tensor, type(None)))
        b, s = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        total = past + s
        window = self.config.sliding_window
        if window is not None and total > window:
            raise ConfigError(
                f"sequence of {total} tokens exceeds the model's sliding window of {window}; the teaching forward "
                f"implements full attention only, which equals sliding-window attention up to the window"
            )
        if attention_mask is not None and tuple(attention_mask.shape) != (b, total):
            raise ShapeError(
                f"attention_mask must be [batch, past + seq] = {(b, total)}, got {tuple(attention_mask.shape)}"
            )
        if position_ids is None:
            if attention_mask is None:
                position_ids = torch.arange(past, total, device=input_ids.device).expand(b, s)
            else:  # left padding: real tokens count from 0
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:]
        x = self.model.embed_tokens(input_ids)  # [B, S, hidden]
        cos, sin = rope_cos_sin(position_ids, self.config.head_dim, self.config.rope_theta)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        mask = self._mask(b, s, past, attention_mask, x.device)  # [B, S, past + S], fp32
        # A cache with attend() (PagedCache) computes attention over its pages itself; padding masks need the
        # dense path, so left-padded batches keep using update().
        paged = attention_mask is None and callable(getattr(cache, "attend", None))
        prepare = getattr(cache, "prepare_step", None) if paged else None
        if prepare is not None:  # the step's slots, block tables and lengths, once for every layer (StepBatch)
            prepare(b, s)
        for layer in self.model.layers:
            x = layer(x, cos, sin, mask, cache, paged)
        return self.lm_head(self.model.norm(x))

    def _check_ids(self, input_ids: Any) -> None:
        """``input_ids``: an integer tensor ``[B, S]`` of ids in ``[0, vocab_size)``."""
        check_type("input_ids", input_ids, torch.Tensor)
        if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
            raise DTypeError(f"input_ids: expected an integer tensor (torch.long), got {input_ids.dtype}")
        if input_ids.ndim != 2:
            raise ShapeError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        if input_ids.numel():
            lo, hi = int(input_ids.min()), int(input_ids.max())
            if lo < 0 or hi >= self.config.vocab_size:
                raise InvalidArgumentError(
                    f"input_ids: expected token ids in [0, {self.config.vocab_size}), got ids from {lo} to {hi}"
                )

    @staticmethod
    def _mask(b, s, past, attention_mask, device) -> torch.Tensor:
        """Additive fp32 mask: query i (absolute past + i) sees key j iff j <= past + i and j is not padding.

        Masked entries get float32's most negative finite value, not -inf, and scores are added to it in
        fp32, so a fully masked row (a padding query) stays finite instead of turning into NaN and
        poisoning later layers through its cached K/V (in fp16 the sum would overflow to -inf).
        """
        q_pos = torch.arange(past, past + s, device=device)[:, None]  # [S, 1]
        k_pos = torch.arange(past + s, device=device)[None, :]  # [1, T]
        allowed = (k_pos <= q_pos)[None].expand(b, s, past + s)  # [B, S, T]
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, :]
        neg = torch.finfo(torch.float32).min
        return torch.zeros((b, s, past + s), dtype=torch.float32, device=device).masked_fill(~allowed, neg)

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        cache: Any = None,
        *,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
        pad_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy decoding. With ``cache`` the prompt is prefilled once and each step feeds one token; with
        ``cache=None`` every step recomputes the whole sequence (the no-cache baseline).

        A row that has produced ``eos_token_id`` is filled with ``pad_token_id`` (default: the EOS id) from
        then on; decoding stops when every row has finished. Returns prompt + new tokens ``[B, S + n]``.
        """
        self._check_ids(input_ids)
        check_index("max_new_tokens", max_new_tokens, lo=0)
        ids = input_ids
        mask = attention_mask
        step_input = ids
        finished = torch.zeros(ids.shape[0], 1, dtype=torch.bool, device=ids.device)
        filler = eos_token_id if pad_token_id is None else pad_token_id
        for _ in range(max_new_tokens):
            if cache is None:
                logits = self(ids, attention_mask=mask)
            else:
                logits = self(step_input, cache, attention_mask=mask)
            next_id = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
            if eos_token_id is not None:
                next_id = next_id.masked_fill(finished, filler)
                finished = finished | (next_id == eos_token_id)
            ids = torch.cat([ids, next_id], dim=1)
            step_input = next_id
            if mask is not None:
                mask = torch.cat([mask, torch.ones_like(next_id)], dim=1)
            if eos_token_id is not None and bool(finished.all()):
                break
        return ids
