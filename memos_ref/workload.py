"""Seeded agent-workload traces shared by benchmarks, notebooks and tests.

Every trace comes from ``random.Random(seed).random()`` alone (whose stream Python keeps stable across
versions), so the same seed gives the same trace on every machine.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from memos_ref.errors import ConfigError

__all__ = ["ConversationTrace", "agent_conversation_lengths"]


@dataclass(frozen=True)
class ConversationTrace:
    """Final context lengths (tokens) of a set of agent sessions, and the cap they were drawn under."""

    lengths: tuple[int, ...]
    max_len: int
    seed: int

    @property
    def total_tokens(self) -> int:
        return sum(self.lengths)


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    # Box-Muller from two uniforms, so only rng.random() is used.
    u1, u2 = 1.0 - rng.random(), rng.random()
    z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
    return median * math.exp(sigma * z)


def agent_conversation_lengths(
    n_sessions: int,
    *,
    seed: int = 0,
    max_len: int = 4096,
    system_prompt: int = 400,
    median_dialogue: float = 500.0,
    sigma: float = 1.0,
) -> ConversationTrace:
    """Final lengths of ``n_sessions`` agent conversations: a fixed system prompt plus a log-normal dialogue.

    Agent conversations are heavy-tailed: most end after a few turns, a few run long (tool results, long
    plans). A log-normal with median ``median_dialogue`` tokens and shape ``sigma`` models that; lengths are
    capped at ``max_len`` (the context a system would reserve per session).
    """
    if n_sessions < 0 or max_len <= 0 or system_prompt < 0 or system_prompt >= max_len:
        raise ConfigError(
            f"need n_sessions >= 0 and 0 <= system_prompt < max_len; got n_sessions={n_sessions}, "
            f"system_prompt={system_prompt}, max_len={max_len}"
        )
    rng = random.Random(seed)
    lengths = tuple(
        min(max_len, system_prompt + max(1, round(_lognormal(rng, median_dialogue, sigma)))) for _ in range(n_sessions)
    )
    return ConversationTrace(lengths, max_len, seed)
