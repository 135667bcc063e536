"""Oracle: the package's teaching forward gives transformers' logits on the same weights (fp32, 1e-4)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from memos_ref.caches import ContiguousCache
from memos_ref.errors import ConfigError, ShapeError
from memos_ref.model.llama import LlamaConfig

TOL = 1e-4


def _ids(vocab: int, shape=(2, 37), seed=0) -> torch.Tensor:
    return torch.randint(0, min(vocab, 256), shape, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("which", ["shipped", "tiny"])
def test_logits_match_transformers_without_cache(which, shipped_pair, tiny_pair):
    ours, hf = shipped_pair if which == "shipped" else tiny_pair
    ids = _ids(ours.config.vocab_size)
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        got = ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


@pytest.mark.parametrize("cache_kind", ["contiguous", "dynamic"])
def test_logits_match_transformers_with_a_cache_in_chunks(cache_kind, tiny_pair):
    ours, hf = tiny_pair
    ids = _ids(ours.config.vocab_size, (2, 40), seed=3)
    cache = ContiguousCache(capacity=8) if cache_kind == "contiguous" else DynamicCache()
    with torch.no_grad():
        expected = hf(input_ids=ids).logits
        # prefill 17 tokens, then a chunk of 5, then single tokens: every path of the cache is used
        pieces = [ours(ids[:, :17], cache), ours(ids[:, 17:22], cache)]
        pieces += [ours(ids[:, i : i + 1], cache) for i in range(22, 40)]
    got = torch.cat(pieces, dim=1)
    assert cache.get_seq_length() == 40
    assert (got - expected).abs().max().item() <= TOL


def test_left_padded_batch_matches_transformers_on_real_tokens(shipped_pair):
    from memos_ref.model.tokenizer import ByteTokenizer

    ours, hf = shipped_pair
    ids, mask = ByteTokenizer().batch_encode(["def f(x):\n    return", "import os\nimport sys\nfrom typing import"])
    with torch.no_grad():
        expected = hf(input_ids=ids, attention_mask=mask).logits
        got = ours(ids, attention_mask=mask)
    real = mask.bool()
    assert (got[real] - expected[real]).abs().max().item() <= TOL
    assert torch.isfinite(got).all()  # padding rows stay finite (no -inf softmax)


def test_sliding_window_configs_are_refused_past_the_window(tmp_path):
    from transformers import MistralConfig, MistralForCausalLM

    from memos_ref.model import load_model

    cfg = MistralConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        sliding_window=8,
    )
    MistralForCausalLM(cfg).save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.config.sliding_window == 8
    model(torch.zeros((1, 8), dtype=torch.long))  # within the window: fine
    with pytest.raises(ConfigError, match="sliding window of 8"):
        model(torch.zeros((1, 9), dtype=torch.long))


def test_bad_inputs_are_rejected(tiny_pair):
    ours, _ = tiny_pair
    with pytest.raises(ShapeError, match=r"\[batch, seq\]"):
        ours(torch.zeros(5, dtype=torch.long))
    with pytest.raises(ShapeError, match="attention_mask"):
        ours(torch.zeros((1, 4), dtype=torch.long), attention_mask=torch.ones((1, 3)))
    with pytest.raises(ConfigError, match="model_type"):
        LlamaConfig.from_hf_dict({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="rope type"):
        LlamaConfig.from_hf_dict(
            dict(
                model_type="llama",
                vocab_size=10,
                hidden_size=8,
                intermediate_size=8,
                num_hidden_layers=1,
                num_attention_heads=2,
                rope_parameters={"rope_type": "llama3", "rope_theta": 5e5},
            )
        )
