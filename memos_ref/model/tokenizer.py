"""A byte-level tokenizer: every byte is a token, plus a few special tokens.

Why bytes: nothing to download, every string round-trips exactly, and one token is one byte, so "bits per
byte" and "tokens" mean the same thing in every measurement of this project.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError, check_type

__all__ = ["SPECIAL_TOKENS", "ByteTokenizer"]

#: Special tokens after the 256 byte values, in id order. The role markers are reserved for the session layer
#: (they mark segment boundaries); the shipped model never saw them in training.
SPECIAL_TOKENS: tuple[str, ...] = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|memory|>",
)


class ByteTokenizer:
    """Token ids 0..255 are the byte values; 256.. are :data:`SPECIAL_TOKENS`."""

    def __init__(self) -> None:
        self.special_to_id = {tok: 256 + i for i, tok in enumerate(SPECIAL_TOKENS)}
        self.id_to_special = {i: tok for tok, i in self.special_to_id.items()}
        self.vocab_size = 256 + len(SPECIAL_TOKENS)
        self.bos_id = self.special_to_id["<|bos|>"]
        self.eos_id = self.special_to_id["<|eos|>"]
        self.pad_id = self.special_to_id["<|pad|>"]

    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """UTF-8 bytes of ``text`` as ids, optionally framed by BOS/EOS. Text is bytes, never control: a
        special token's spelling in ``text`` gives its bytes. A lone surrogate (no UTF-8 form) raises
        :class:`~memos_ref.errors.InvalidArgumentError`."""
        check_type("text", text, str)
        try:
            ids = list(text.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidArgumentError(
                f"text: expected valid Unicode text, found a lone surrogate U+{ord(text[exc.start]):04X} at index "
                f"{exc.start}"
            ) from None
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def decode(self, ids: Iterable[int] | torch.Tensor, *, skip_special: bool = True) -> str:
        """Bytes back to text (invalid UTF-8 replaced); special tokens dropped or spelled out."""
        if isinstance(ids, torch.Tensor):
            ids = ids.flatten().tolist()
        out = bytearray()
        parts: list[str] = []
        for i in ids:
            if isinstance(i, bool) or not hasattr(i, "__index__"):
                raise ArgumentTypeError(f"ids: expected int token ids, got {type(i).__name__} ({i!r:.40})")
            i = i.__index__()
            if 0 <= i < 256:
                out.append(i)
            elif i in self.id_to_special:
                if not skip_special:
                    parts.append(out.decode("utf-8", errors="replace"))
                    out = bytearray()
                    parts.append(self.id_to_special[i])
            else:
                raise ConfigError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        parts.append(out.decode("utf-8", errors="replace"))
        return "".join(parts)

    def batch_encode(
        self, texts: Sequence[str], *, add_bos: bool = True, padding_side: str = "left"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Encode several texts into ``input_ids`` and ``attention_mask`` ``[B, S]``, padded with ``<|pad|>``."""
        if padding_side not in ("left", "right"):
            raise ConfigError(f"padding_side must be 'left' or 'right', got {padding_side!r}")
        encoded = [self.encode(t, add_bos=add_bos) for t in texts]
        width = max((len(e) for e in encoded), default=0)
        ids = torch.full((len(encoded), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, e in enumerate(encoded):
            span = slice(width - len(e), width) if padding_side == "left" else slice(0, len(e))
            ids[row, span] = torch.tensor(e, dtype=torch.long)
            mask[row, span] = 1
        return ids, mask

    def __call__(self, text: str, *, add_bos: bool = True) -> torch.Tensor:
        """``[1, S]`` ids for one text, BOS first (the form the models take)."""
        return torch.tensor([self.encode(text, add_bos=add_bos)], dtype=torch.long)
