"""KVSpec: the KV geometry of a model, and the byte arithmetic every later layer of the cache relies on.

The size of one token's keys and values is ``2 · L · H · D · bytes_per_element`` (2 for K and V, L layers,
H key/value heads, D head dimension). For Llama-2-7B in fp16 that is exactly 524,288 bytes (512 KiB): seed
000's "about 0.5 MB per token". Grouped-query attention divides it by the ratio of query to KV heads.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from memos_ref.errors import (
    ArgumentTypeError,
    ConfigError,
    SlidingWindowMemoryWarning,
    UnsupportedModelError,
    check_type,
)

__all__ = [
    "ALLOWED_BLOCK_SIZES",
    "KVSpec",
    "SlidingWindowMemoryWarning",
    "check_supported_config",
    "config_dict",
    "dtype_from_name",
    "sliding_window_layers",
]

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
    check_type("dtype", name, (str, torch.dtype))
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
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "num_q_heads"):
            check_type(f"KVSpec.{name}", getattr(self, name), int)
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if value <= 0:
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
        """Read the KV geometry from a Hugging Face config (a dict or a ``PretrainedConfig``) or a model.

        Handles Llama, Mistral, Qwen2, Qwen3, Gemma, Gemma 2/3, GPT-OSS and Phi-3 style configs
        (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads`` for GQA, optional explicit
        ``head_dim``) and GPT-2 style ones (``n_layer``, ``n_head``, ``n_embd``).

        ``dtype``: the ``dtype`` argument if given; else, for a model, the dtype of its parameters; else the
        config's ``dtype`` (or ``torch_dtype``); else ``torch.get_default_dtype()`` — what a model built from
        the config has (a config made in code has no dtype). Pass the model, or ``dtype=model.dtype``, to be sure.
        A dtype read from the config or model must be floating (the activations'); an explicit ``dtype`` is the
        storage the caller chose and is kept (``torch.int8`` sizes an INT8 KV cache, as the edge planner does).

        Raises :class:`UnsupportedModelError` for multi-head latent attention (DeepSeek-V2/V3: K and V widths
        differ) and for hybrid linear-attention / state-space models (Qwen3-Next, Jamba, ...), and
        :class:`ConfigError` for a config without a KV geometry. Sliding-window layers are counted as full
        layers — the paged cache keeps every token of them — and a :class:`SlidingWindowMemoryWarning` says so
        (once per model).
        """
        check_type("block_size", block_size, int)
        if dtype is not None:
            check_type("dtype", dtype, (str, torch.dtype))
        model_dtype = _module_dtype(config)
        cfg = config_dict(config)
        check_supported_config(cfg)

        def pick(*names: str) -> Any:
            for name in names:
                if cfg.get(name) is not None:
                    return cfg[name]
            return None

        layers = pick("num_hidden_layers", "n_layer", "num_layers")
        q_heads = pick("num_attention_heads", "n_head")
        hidden = pick("hidden_size", "n_embd", "d_model")
        kv_heads = pick("num_key_value_heads", "multi_query_group_num")
        if kv_heads is None:  # no GQA: one KV head per query head (0 is refused below, not taken for "none")
            kv_heads = q_heads
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
            _check_config_int(label, value)
        if head_dim is not None:
            _check_config_int("head_dim", head_dim)
        else:
            _check_config_int("hidden_size", hidden)
        warn_sliding_window(cfg)  # after the geometry is known to be sane
        if q_heads % kv_heads:
            raise ConfigError(f"num_attention_heads ({q_heads}) is not a multiple of num_key_value_heads ({kv_heads})")
        if head_dim is None:
            if hidden % q_heads:
                raise ConfigError(
                    f"hidden_size ({hidden}) is not divisible by num_attention_heads ({q_heads}) and the "
                    f"config has no explicit head_dim"
                )
            head_dim = hidden // q_heads
        explicit = dtype is not None  # the caller's storage choice (edge sizing of an INT8 KV cache): kept
        if dtype is None:
            dtype = model_dtype or pick("dtype", "torch_dtype") or torch.get_default_dtype()
            if not isinstance(dtype, (str, torch.dtype)):
                raise ConfigError(f"config has dtype = {dtype!r}: expected a dtype name or torch.dtype")
        kv_dtype = dtype_from_name(dtype)
        if not explicit and not kv_dtype.is_floating_point:
            raise ConfigError(
                f"KV dtype {kv_dtype} is not a floating dtype: K/V are the model's activations; pass "
                f"dtype='float32' / 'bfloat16' / 'float16' (quantize with a quantized pool instead)"
            )
        return cls(
            num_layers=layers,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=kv_dtype,
            block_size=block_size,
            num_q_heads=q_heads,
        )


# -------------------------------------------------------------------- what a model config asks of the cache
#: Layer kinds whose KV the paged cache holds correctly (with the full context kept for sliding layers).
_ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "attention"})
#: Families whose layers keep recurrent / convolution state instead of (or beside) a KV cache.
_STATE_SPACE_FAMILIES = frozenset(
    {
        "bamba",
        "falcon_h1",
        "falcon_mamba",
        "granitemoehybrid",
        "jamba",
        "lfm2",
        "lfm2_moe",
        "mamba",
        "mamba2",
        "minimax",
        "nemotron_h",
        "plamo2",
        "qwen3_next",
        "recurrent_gemma",
        "rwkv",
        "xlstm",
        "zamba",
        "zamba2",
    }
)
_warned_sliding: set[tuple[Any, ...]] = set()
_warned_lock = threading.Lock()


def _module_dtype(obj: Any) -> torch.dtype | None:
    """The dtype of a model's first floating-point parameter (``None`` for a config or a dict)."""
    if isinstance(obj, torch.nn.Module):
        for param in obj.parameters():
            if param.is_floating_point():
                return param.dtype
    return None


def config_dict(config: Any) -> dict[str, Any]:
    """A plain dict of a Hugging Face config: a ``PretrainedConfig``, a model (its ``.config``), or a mapping;
    the text part of a multimodal config."""
    if isinstance(config, torch.nn.Module):
        if not hasattr(config, "config"):
            raise ArgumentTypeError(
                f"config: expected a transformers model (with .config), a PretrainedConfig or a dict, got a "
                f"{type(config).__name__} without .config"
            )
        config = config.config
    if hasattr(config, "to_dict"):
        cfg = config.to_dict()
    elif isinstance(config, Mapping):
        cfg = dict(config)
    else:
        raise ArgumentTypeError(
            f"config: expected a PretrainedConfig, a transformers model or a dict, got {type(config).__name__}"
        )
    if isinstance(cfg.get("text_config"), Mapping) and "num_hidden_layers" not in cfg:  # multimodal wrappers
        cfg = dict(cfg["text_config"])
    return cfg


def check_supported_config(config: Any) -> None:
    """Raise :class:`UnsupportedModelError` when a model's attention cannot live in the paged cache.

    Refused: multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2, MiniCPM3 — keys and values of different
    widths, a compressed ``kv_lora_rank`` latent); hybrid linear-attention and state-space models (Qwen3-Next,
    Jamba, Mamba, ... — layers that keep recurrent state instead of K/V); layer kinds the cache was not tested
    with (e.g. Llama 4's ``chunked_attention``).
    """
    cfg = config_dict(config)
    model_type = str(cfg.get("model_type") or "")
    if cfg.get("kv_lora_rank") is not None or _kv_widths_differ(cfg):
        raise UnsupportedModelError(
            f"{model_type or 'this model'} uses multi-head latent attention (MLA: kv_lora_rank="
            f"{cfg.get('kv_lora_rank')!r}, qk_rope_head_dim={cfg.get('qk_rope_head_dim')!r}, "
            f"v_head_dim={cfg.get('v_head_dim')!r}): MLA is not supported — keys and values have different "
            f"widths, and the paged pool stores K and V of one head_dim. Use transformers' DynamicCache for it"
        )
    layer_types = list(cfg.get("layer_types") or []) + list(cfg.get("layers_block_type") or [])
    other = sorted({str(t) for t in layer_types} - _ATTENTION_LAYER_TYPES)
    if model_type in _STATE_SPACE_FAMILIES or any("linear" in t or "mamba" in t or "conv" in t for t in other):
        raise UnsupportedModelError(
            f"{model_type or 'this model'} is a hybrid linear-attention / state-space model (layer types "
            f"{other or 'recurrent'}): linear attention is not supported by the paged cache, which holds only "
            f"K/V of attention layers. Use the model's own cache (e.g. transformers' DynamicCache)"
        )
    if other:
        raise UnsupportedModelError(
            f"{model_type or 'this model'} has layer types {other}: the paged cache supports "
            f"{sorted(_ATTENTION_LAYER_TYPES)} only (full and sliding-window attention)"
        )


def _kv_widths_differ(cfg: Mapping[str, Any]) -> bool:
    v_dim = cfg.get("v_head_dim")
    if v_dim is None:
        return False
    qk = cfg.get("qk_head_dim")
    if qk is None and cfg.get("qk_nope_head_dim") is not None:
        qk = cfg["qk_nope_head_dim"] + (cfg.get("qk_rope_head_dim") or 0)
    if qk is None:
        qk = cfg.get("head_dim")
    return qk is not None and qk != v_dim


def _check_config_int(label: str, value: Any) -> int:
    """A config's geometry entry: a positive int (not a bool, float or string), else :class:`ConfigError`."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config has {label} = {value!r:.80}: expected a positive int")
    return value


def sliding_window_layers(config: Any) -> tuple[int | None, int]:
    """``(window, number of sliding-window layers)`` of a config; ``(None, 0)`` without sliding windows.
    A window that is not a positive int raises :class:`ConfigError`."""
    cfg = config_dict(config)
    window = cfg.get("sliding_window")
    if window is None or window is False or window == 0 or cfg.get("use_sliding_window") is False:
        return None, 0
    window = _check_config_int("sliding_window", window)
    layer_types = cfg.get("layer_types")
    if layer_types:
        return window, sum(1 for t in layer_types if t == "sliding_attention")
    layers = cfg.get("num_hidden_layers")
    return window, _check_config_int("num_hidden_layers", layers) if layers is not None else 0  # all slide


def warn_sliding_window(config: Any) -> bool:
    """Warn (once per model geometry and window, per process) that the paged cache keeps every token of
    sliding-window layers; returns whether the config has such layers."""
    cfg = config_dict(config)
    window, count = sliding_window_layers(cfg)
    if not count:
        return False
    key = (cfg.get("model_type"), window, count, cfg.get("num_hidden_layers"), cfg.get("hidden_size"))
    warn_sliding(window, count, cfg.get("num_hidden_layers"), cfg.get("model_type"), key=key)
    return True


def warn_sliding(
    window: int,
    count: int | None = None,
    layers: int | None = None,
    model_type: Any = None,
    *,
    key: Any = None,
) -> None:
    """Issue the :class:`SlidingWindowMemoryWarning` once per ``key`` (default: the window) in this process."""
    key = key if key is not None else ("window", window)
    with _warned_lock:
        if key in _warned_sliding:
            return
        _warned_sliding.add(key)
    where = f"{count} of {layers} layers" if count is not None and layers else "some layers"
    warnings.warn(
        f"{model_type or 'the model'} has sliding-window attention (window {window}, {where}): the paged cache "
        f"keeps every token of those layers, so their KV memory grows with the whole context instead of staying "
        f"at {window} tokens (outputs are unchanged: attention still sees only the window)",
        SlidingWindowMemoryWarning,
        stacklevel=3,
    )
