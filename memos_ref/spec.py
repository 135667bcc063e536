"""KVSpec: the KV geometry of a model, and the byte arithmetic every later layer of the cache relies on.

The size of one token's keys and values is ``2 · L · H · D · bytes_per_element`` (2 for K and V, L layers,
H key/value heads, D head dimension). For Llama-2-7B in fp16 that is exactly 524,288 bytes (512 KiB): seed
000's "about 0.5 MB per token". Grouped-query attention divides it by the ratio of query to KV heads.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memos_ref.errors import ConfigError

__all__ = ["ALLOWED_BLOCK_SIZES", "KVSpec", "dtype_from_name"]

ALLOWED_BLOCK_SIZES = (8, 16, 32, 64, 128)

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "fp8": torch.float8_e4m3fn,
    "int8": torch.int8,
    "uint8": torch.uint8,
}


def dtype_from_name(name: str | torch.dtype) -> torch.dtype:
    """Turn ``"float16"``, ``"bf16"``, ``"torch.float32"`` or a ``torch.dtype`` into a ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    key = str(name).removeprefix("torch.").lower()
    if key not in _DTYPES:
        raise ConfigError(f"unknown dtype {name!r}: expected one of {sorted(set(_DTYPES))}")
    return _DTYPES[key]


@dataclass(frozen=True)
class KVSpec:
    """The geometry of one model's KV cache.

    Attributes:
        num_layers: decoder layers that keep a KV cache (L).
        num_kv_heads: key/value heads per layer (H); fewer than query heads under GQA/MQA.
        head_dim: dimension of one head (D).
        dtype: element type of the stored K and V.
        block_size: tokens per block (T) for the paged cache; a power of two in 8..128.
        num_q_heads: query heads, when known (for the GQA ratio); 0 when unknown.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.float16
    block_size: int = 16
    num_q_heads: int = 0

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"KVSpec.{name} must be a positive int, got {value!r}")
        if not isinstance(self.dtype, torch.dtype):
            object.__setattr__(self, "dtype", dtype_from_name(self.dtype))
        if self.block_size not in ALLOWED_BLOCK_SIZES:
            raise ConfigError(
                f"KVSpec.block_size must be one of {ALLOWED_BLOCK_SIZES} (a power of two, as TensorRT-LLM's "
                f"tokens_per_block), got {self.block_size!r}"
            )
        if self.num_q_heads < 0 or (self.num_q_heads and self.num_q_heads % self.num_kv_heads):
            raise ConfigError(
                f"num_q_heads ({self.num_q_heads}) must be a positive multiple of num_kv_heads "
                f"({self.num_kv_heads}), or 0 when unknown"
            )

    # ---------------------------------------------------------------- sizes
    @property
    def bytes_per_element(self) -> int:
        """Bytes of one stored K or V element."""
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """``2 · L · H · D · bytes_per_element``: one token's K and V across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.bytes_per_element

    @property
    def bytes_per_token_per_layer(self) -> int:
        """One token's K and V in one layer."""
        return self.bytes_per_token // self.num_layers

    @property
    def bytes_per_block(self) -> int:
        """One block of the canonical pool ``[L, 2, H, T, D]``: ``block_size`` tokens, all layers."""
        return self.bytes_per_token * self.block_size

    @property
    def block_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of one block in the canonical pool layout: ``[L, 2, H, T, D]``."""
        return (self.num_layers, 2, self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def gqa_ratio(self) -> int:
        """Query heads per KV head (1 for multi-head attention); 0 when ``num_q_heads`` is unknown."""
        return self.num_q_heads // self.num_kv_heads if self.num_q_heads else 0

    def bytes_for(self, tokens: int, batch: int = 1) -> int:
        """KV bytes for ``batch`` sequences of ``tokens`` tokens each (dense, no padding to blocks)."""
        if tokens < 0 or batch < 0:
            raise ConfigError(f"tokens and batch must be >= 0, got tokens={tokens}, batch={batch}")
        return self.bytes_per_token * tokens * batch

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold ``tokens`` tokens (the last one possibly partly filled)."""
        if tokens < 0:
            raise ConfigError(f"tokens must be >= 0, got {tokens}")
        return -(-tokens // self.block_size)

    def with_(self, **changes: Any) -> KVSpec:
        """A copy with some fields changed (validated again)."""
        fields = {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": self.dtype,
            "block_size": self.block_size,
            "num_q_heads": self.num_q_heads,
        }
        unknown = set(changes) - set(fields)
        if unknown:
            raise ConfigError(f"unknown KVSpec fields {sorted(unknown)}: expected some of {sorted(fields)}")
        fields.update(changes)
        return KVSpec(**fields)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-safe description (used in manifests and benchmark configs)."""
        return {
            "num_layers": self.num_layers,
            "num_kv_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "dtype": str(self.dtype).removeprefix("torch."),
            "block_size": self.block_size,
            "num_q_heads": self.num_q_heads,
            "bytes_per_token": self.bytes_per_token,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KVSpec:
        """Inverse of :meth:`to_dict` (``bytes_per_token`` is checked, not trusted)."""
        try:
            spec = cls(
                num_layers=int(data["num_layers"]),
                num_kv_heads=int(data["num_kv_heads"]),
                head_dim=int(data["head_dim"]),
                dtype=dtype_from_name(data["dtype"]),
                block_size=int(data.get("block_size", 16)),
                num_q_heads=int(data.get("num_q_heads", 0)),
            )
        except KeyError as exc:
            raise ConfigError(f"KVSpec dict is missing field {exc.args[0]!r}") from None
        if "bytes_per_token" in data and int(data["bytes_per_token"]) != spec.bytes_per_token:
            raise ConfigError(
                f"KVSpec dict says bytes_per_token={data['bytes_per_token']}, its geometry gives {spec.bytes_per_token}"
            )
        return spec

    # ---------------------------------------------------------------- from configs
    @classmethod
    def from_hf_config(
        cls,
        config: Mapping[str, Any] | Any,
        *,
        dtype: str | torch.dtype | None = None,
        block_size: int = 16,
    ) -> KVSpec:
        """Read the KV geometry from a Hugging Face config (a dict or a ``PretrainedConfig``).

        Handles Llama, Mistral, Qwen2, Qwen3, Gemma and Phi-3 style configs (``num_hidden_layers``,
        ``num_attention_heads``, ``num_key_value_heads`` for GQA, optional explicit ``head_dim``) and GPT-2
        style ones (``n_layer``, ``n_head``, ``n_embd``). ``dtype`` defaults to the config's ``torch_dtype``
        (or ``dtype``), else float16. Sliding-window layers are counted as full layers (an upper bound).
        """
        cfg = config.to_dict() if hasattr(config, "to_dict") else dict(config)
        if "text_config" in cfg and "num_hidden_layers" not in cfg:  # multimodal wrappers
            cfg = dict(cfg["text_config"])

        def pick(*names: str) -> Any:
            for name in names:
                if cfg.get(name) is not None:
                    return cfg[name]
            return None

        layers = pick("num_hidden_layers", "n_layer", "num_layers")
        q_heads = pick("num_attention_heads", "n_head")
        hidden = pick("hidden_size", "n_embd", "d_model")
        kv_heads = pick("num_key_value_heads", "multi_query_group_num") or q_heads
        if cfg.get("multi_query") is True:  # GPT-BigCode style MQA
            kv_heads = 1
        head_dim = pick("head_dim")
        missing = [
            label
            for label, value in (
                ("num_hidden_layers (or n_layer)", layers),
                ("num_attention_heads (or n_head)", q_heads),
            )
            if value is None
        ]
        if head_dim is None and hidden is None:
            missing.append("hidden_size (or n_embd) or head_dim")
        if missing:
            raise ConfigError(
                f"config (model_type={cfg.get('model_type')!r}) is missing {', '.join(missing)}; "
                f"cannot derive the KV geometry"
            )
        for label, value in (("layers", layers), ("attention heads", q_heads), ("KV heads", kv_heads)):
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"config has {label} = {value!r}: expected a positive int")
        if q_heads % kv_heads:
            raise ConfigError(f"num_attention_heads ({q_heads}) is not a multiple of num_key_value_heads ({kv_heads})")
        if head_dim is None:
            if hidden % q_heads:
                raise ConfigError(
                    f"hidden_size ({hidden}) is not divisible by num_attention_heads ({q_heads}) and the "
                    f"config has no explicit head_dim"
                )
            head_dim = hidden // q_heads
        if dtype is None:
            dtype = pick("torch_dtype", "dtype") or "float16"
        return cls(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=int(head_dim),
            dtype=dtype_from_name(dtype),
            block_size=block_size,
            num_q_heads=q_heads,
        )
