"""Held-out bits per byte: how well a model predicts text it never saw.

With a byte tokenizer, the mean negative log-likelihood in bits per token *is* bits per byte, comparable to
a compressor's output size (gzip on Python source is about 2 bits/byte; a byte-unigram model about 4.6).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from memos_ref.model.tokenizer import ByteTokenizer

__all__ = ["bits_per_byte"]


@torch.no_grad()
def bits_per_byte(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    text: str,
    *,
    window: int = 512,
    batch_size: int = 8,
    max_bytes: int | None = None,
) -> float:
    """Mean bits per byte of ``text`` under ``logits_fn(ids [B, S]) -> logits [B, S, V]``.

    The text is cut into non-overlapping windows of ``window`` bytes; each window is fed shifted by one
    (its input starts with the byte before it, or BOS for the very first window, the start of the text), so
    every byte is predicted exactly once from the bytes before it in its window. Keep ``window`` within the
    model's training length.
    """
    tok = ByteTokenizer()
    data = text.encode("utf-8")[: max_bytes or None]
    usable = (len(data) // window) * window
    if usable == 0:
        raise ValueError(f"text has {len(data)} bytes, fewer than one window of {window}")
    stream = torch.tensor([tok.bos_id, *data[:usable]], dtype=torch.long)  # [1 + usable]
    inputs_all = stream[:-1].view(-1, window)  # [N, window]: byte i-1 predicts byte i
    targets_all = stream[1:].view(-1, window)  # [N, window]
    total_nll = 0.0
    for start in range(0, targets_all.shape[0], batch_size):
        inputs = inputs_all[start : start + batch_size]
        targets = targets_all[start : start + batch_size]
        logits = logits_fn(inputs).float()  # [B, window, V]
        nll = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="sum"
        )
        total_nll += nll.item()
    return total_nll / usable / math.log(2)
