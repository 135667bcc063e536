"""The byte tokenizer: exact round trips, specials, padding."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from memos_ref.errors import ConfigError
from memos_ref.model.tokenizer import SPECIAL_TOKENS, ByteTokenizer

tok = ByteTokenizer()


@given(st.text())
def test_round_trip_is_exact(text):
    ids = tok.encode(text, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id
    assert len(ids) == len(text.encode("utf-8")) + 2
    assert tok.decode(ids) == text


def test_vocab_and_specials():
    assert tok.vocab_size == 256 + len(SPECIAL_TOKENS)
    assert tok.encode("A") == [65]
    assert tok.decode([tok.special_to_id["<|user|>"], 104, 105], skip_special=False) == "<|user|>hi"
    with pytest.raises(ConfigError, match="outside the vocabulary"):
        tok.decode([tok.vocab_size])


def test_batch_encode_left_pads():
    ids, mask = tok.batch_encode(["ab", "abcd"])
    assert ids.shape == mask.shape == (2, 5)
    assert mask.tolist() == [[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert ids[0, :2].tolist() == [tok.pad_id] * 2
    assert torch.equal(tok("ab"), torch.tensor([[tok.bos_id, 97, 98]]))
