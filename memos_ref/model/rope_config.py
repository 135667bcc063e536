"""The one reader of a transformers config's RoPE settings, shared by the package's forward and the edge exporter.

Two layouts exist: transformers ≥ 5 writes ``rope_parameters`` (``rope_theta``, ``rope_type`` and the scaling
fields together); older configs keep ``rope_theta`` and ``rope_scaling`` at the top level. Reading only the top
level of a transformers-5 config silently gives θ = 10000 — a wrong model, not an error — so every reader of RoPE
in the project goes through :func:`read_rope_config`.

Kinds understood: ``default``, ``linear`` (positions divided by ``factor``) and ``llama3`` (Llama-3.1's
frequency-dependent scaling, validated field by field). Others are refused with :class:`ConfigError`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from memos_ref.errors import ConfigError

__all__ = ["ROPE_TYPES", "RopeConfig", "read_rope_config"]

ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_FIELDS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _positive(name: str, value: Any) -> float:
    """A finite number > 0 (bools are not numbers here)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class RopeConfig:
    """RoPE of one model: base ``theta``, ``rope_type`` and, when scaled, the scaling fields as the config gave them."""

    theta: float
    rope_type: str = "default"
    #: the scaling fields (``factor`` ...) as in the config, without ``rope_theta``; empty for ``default``
    scaling: dict[str, Any] = field(default_factory=dict)

    @property
    def is_default(self) -> bool:
        return self.rope_type == "default"

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """Inverse frequencies ``[head_dim / 2]`` (float32) after scaling — transformers' rope init functions."""
        inv = 1.0 / self.theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)  # [D/2]
        if self.rope_type == "linear":
            return inv / float(self.scaling["factor"])
        if self.rope_type == "llama3":
            return _llama3(inv, self.scaling)
        return inv


def _llama3(inv: torch.Tensor, s: Mapping[str, Any]) -> torch.Tensor:
    """Llama-3.1 scaling: long wavelengths divided by ``factor``, short kept, the band between interpolated."""
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv  # [D/2]
    scaled = torch.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)


def _check_scaling(kind: str, s: Mapping[str, Any]) -> None:
    if kind == "linear":
        _positive("rope scaling factor", s.get("factor"))
    elif kind == "llama3":
        missing = [k for k in _LLAMA3_FIELDS if k not in s]
        if missing:
            raise ConfigError(f"llama3 rope scaling needs {list(_LLAMA3_FIELDS)}; missing {missing}")
        for k in _LLAMA3_FIELDS:
            _positive(f"llama3 rope {k}", s[k])
        if float(s["high_freq_factor"]) <= float(s["low_freq_factor"]):
            raise ConfigError(
                f"llama3 rope high_freq_factor {s['high_freq_factor']} must exceed low_freq_factor "
                f"{s['low_freq_factor']}"
            )


def read_rope_config(cfg: Mapping[str, Any]) -> RopeConfig:
    """RoPE settings from a transformers ``config.json`` dict in either layout (see the module docstring).

    ``rope_parameters`` wins when present; ``rope_theta`` missing everywhere means transformers' default 10000."""
    if not isinstance(cfg, Mapping):
        raise ConfigError(f"config must be a mapping, got {type(cfg).__name__}")
    params = cfg.get("rope_parameters")
    if params is not None and not isinstance(params, Mapping):
        raise ConfigError(f"rope_parameters must be a mapping, got {type(params).__name__}")
    if params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        fields = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, Mapping):
            raise ConfigError(f"rope_scaling must be a mapping or null, got {type(scaling).__name__}")
        fields = {k: v for k, v in (scaling or {}).items() if k != "rope_theta"}
    theta = _positive("rope_theta", theta)
    kind = fields.get("rope_type", fields.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise ConfigError(f"rope type {kind!r} is not supported: expected one of {ROPE_TYPES}")
    if kind == "default":
        return RopeConfig(theta)
    _check_scaling(kind, fields)
    return RopeConfig(theta, kind, dict(fields))
