"""PagedCache across transformers model families, on tiny seeded random models built from configs (offline).

Each supported family generates the same tokens as ``DynamicCache`` on every path — dense K/V handed to the
model's own attention, ``direct=True`` pages read by the registered ``memos_paged`` attention, and that attention
falling back for a dense cache — with one prompt and with a left-padded batch of two prompts of different
lengths. The features that make these families differ (sliding windows: Mistral, Gemma 2/3, GPT-OSS; logit
softcapping: Gemma 2; attention sinks: GPT-OSS) are switched on at sizes where they change the tokens.
Unsupported families (MLA: DeepSeek-V2/V3; linear attention: Qwen3-Next) are refused with
:class:`UnsupportedModelError` before anything is written.
"""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
import transformers as tf
from transformers import DynamicCache

from memos_ref import spec as spec_module
from memos_ref.errors import UnsupportedModelError
from memos_ref.hf import PagedCache, register_paged_attention
from memos_ref.paged import PagedKV
from memos_ref.spec import KVSpec, SlidingWindowMemoryWarning

PAGED = register_paged_attention()
NEW = 8  # new tokens per generation
WINDOW = 6  # sliding window: shorter than every prompt, so it changes what attention sees
BASE = dict(
    vocab_size=100,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    max_position_embeddings=256,
    tie_word_embeddings=False,
)
TWO_LAYER_TYPES = ["sliding_attention", "full_attention"]
# family -> (config class, model class, config fields beyond BASE, weight scale)
FAMILIES = {
    "llama": (tf.LlamaConfig, tf.LlamaForCausalLM, {}, 0.3),
    "mistral": (tf.MistralConfig, tf.MistralForCausalLM, dict(sliding_window=WINDOW), 0.3),
    "gemma2": (
        tf.Gemma2Config,
        tf.Gemma2ForCausalLM,
        dict(
            sliding_window=WINDOW,
            attn_logit_softcapping=2.0,  # small enough that tanh bends the logits
            final_logit_softcapping=None,
            query_pre_attn_scalar=8,
            layer_types=TWO_LAYER_TYPES,
        ),
        0.3,
    ),
    "gemma3": (
        tf.Gemma3TextConfig,
        tf.Gemma3ForCausalLM,
        dict(sliding_window=WINDOW, query_pre_attn_scalar=8, layer_types=TWO_LAYER_TYPES),
        0.3,
    ),
    "gpt_oss": (
        tf.GptOssConfig,
        tf.GptOssForCausalLM,
        dict(
            sliding_window=WINDOW,
            num_local_experts=4,
            num_experts_per_tok=2,
            layer_types=TWO_LAYER_TYPES,
            max_position_embeddings=131072,  # = factor x original_max_position_embeddings of its YaRN default
        ),
        0.3,
    ),
}


def _config(family: str, **changes):
    config_class, _, extra, _ = FAMILIES[family]
    return config_class(**{**BASE, **extra, **changes})


@functools.cache
def _model(family: str, attn: str | None = None):
    """A tiny random model of ``family`` (every weight drawn from a seeded normal; GPT-OSS sinks included)."""
    _, model_class, _, scale = FAMILIES[family]
    config = _config(family)
    if attn is not None:
        config._attn_implementation = attn
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = model_class(config).eval()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * scale)
    return model


def _kv(model, num_blocks: int = 64) -> PagedKV:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlidingWindowMemoryWarning)
        return PagedKV(KVSpec.from_hf_config(model, block_size=8), num_blocks)


def _prompts(batch: bool):
    gen = torch.Generator().manual_seed(1)
    if not batch:
        return torch.randint(0, 100, (1, 12), generator=gen), None
    ids = torch.randint(1, 100, (2, 13), generator=gen)
    mask = torch.ones_like(ids)
    ids[1, :5], mask[1, :5] = 0, 0  # the second prompt is 8 tokens, left-padded to 13
    return ids, mask


def _greedy(model, ids, mask, cache):
    extra = {} if mask is None else dict(attention_mask=mask, pad_token_id=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SlidingWindowMemoryWarning)
        return model.generate(ids, cache=cache, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, **extra)


@pytest.mark.parametrize("batch", [False, True], ids=["one_prompt", "left_padded_batch"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_generates_the_tokens_of_dynamic_cache_on_every_path(family, batch):
    ids, mask = _prompts(batch)
    model, paged_model = _model(family), _model(family, PAGED)
    expected = _greedy(model, ids, mask, DynamicCache())
    kv = _kv(model)
    dense = PagedCache(kv)
    assert torch.equal(_greedy(model, ids, mask, dense), expected), "dense K/V to the model's own attention"
    direct = PagedCache(kv, direct=True)
    assert torch.equal(_greedy(paged_model, ids, mask, direct), expected), "pages read by memos_paged"
    assert torch.equal(_greedy(paged_model, ids, mask, DynamicCache()), expected), "memos_paged on dense K/V"
    assert direct.get_seq_length() == ids.shape[1] + NEW - 1  # every token kept, sliding layers included
    kv.check()
    dense.free()
    direct.free()
    assert kv.allocator.num_active == 0


@pytest.mark.parametrize("family", ["gemma2", "gpt_oss", "mistral"])
def test_the_features_change_the_tokens_so_the_family_test_can_fail(family):
    """Guard on the test above: without its sliding window (and softcap, sinks) each model answers otherwise."""
    ids, _ = _prompts(False)
    reference = _greedy(_model(family, PAGED), ids, None, PagedCache(_kv(_model(family)), direct=True))
    variants = [dict(sliding_window=10_000)]
    if family == "gemma2":
        variants.append(dict(attn_logit_softcapping=None))
    for changes in variants:
        model = FAMILIES[family][1](_config(family, **changes)).eval()
        model.load_state_dict(_model(family).state_dict())
        assert not torch.equal(_greedy(model, ids, None, DynamicCache()), reference), changes
    if family == "gpt_oss":  # sinks of -inf are no sinks
        model = copy.deepcopy(_model(family))
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.sinks.fill_(-1e9)
        assert not torch.equal(_greedy(model, ids, None, DynamicCache()), reference)


def test_direct_path_warns_once_about_sliding_window_memory(monkeypatch):
    monkeypatch.setattr(spec_module, "_warned_sliding", set())
    ids, _ = _prompts(False)
    kv = PagedKV(KVSpec.from_hf_config(_model("llama"), block_size=8), 64)  # geometry only: no sliding config
    with pytest.warns(SlidingWindowMemoryWarning, match="keeps every token") as record:
        _model("mistral", PAGED).generate(ids, cache=PagedCache(kv, direct=True), max_new_tokens=3)
    assert sum(issubclass(w.category, SlidingWindowMemoryWarning) for w in record) == 1


def test_sliding_layers_keep_every_token_where_transformers_keeps_the_window():
    """The memory note of the README: context / (window - 1) times transformers' sliding cache for those layers."""
    ids, _ = _prompts(False)
    model = _model("mistral")
    sliding, paged = DynamicCache(config=model.config), PagedCache(_kv(model))
    assert torch.equal(_greedy(model, ids, None, paged), _greedy(model, ids, None, sliding))
    held = ids.shape[1] + NEW - 1
    assert [layer.keys.shape[2] for layer in sliding.layers] == [WINDOW - 1] * 2
    assert [paged.layers[i].get_seq_length() for i in range(2)] == [held] * 2


# ---------------------------------------------------------------------------------------------- refused families
MLA = dict(
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_rope_head_dim=4,
    qk_nope_head_dim=8,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
    first_k_dense_replace=1,
)
QWEN3_NEXT = dict(
    layer_types=["linear_attention", "full_attention"],
    linear_num_value_heads=2,
    linear_num_key_heads=2,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=16,
)
REFUSED = {
    "deepseek_v2": (tf.DeepseekV2Config, MLA, "MLA is not supported"),
    "deepseek_v3": (tf.DeepseekV3Config, {**MLA, "head_dim": 4}, "MLA is not supported"),
    "qwen3_next": (tf.Qwen3NextConfig, QWEN3_NEXT, "linear attention is not supported"),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_unsupported_families_are_refused_by_the_spec_and_the_cache(family):
    config_class, extra, match = REFUSED[family]
    config = config_class(**{**BASE, **extra})
    with pytest.raises(UnsupportedModelError, match=match):
        KVSpec.from_hf_config(config)
    kv = PagedKV(KVSpec(2, 2, 8, torch.float32, 8, 4), 16)
    with pytest.raises(UnsupportedModelError, match=match):
        PagedCache(kv, config=config)
    assert kv.allocator.num_active == 0 and not kv.sequences


@pytest.mark.parametrize(
    "family, model_class, geometry",
    [
        ("deepseek_v2", tf.DeepseekV2ForCausalLM, (2, 4, 8)),  # K and V come out of different widths
        ("qwen3_next", tf.Qwen3NextForCausalLM, (2, 2, 8)),
    ],
)
def test_unsupported_models_fail_clearly_in_generate_without_a_config(family, model_class, geometry):
    """A cache built by hand (no config to check) still refuses at the first step, with the pool unchanged."""
    config_class, extra, match = REFUSED[family]
    torch.manual_seed(0)
    model = model_class(config_class(**{**BASE, **extra})).eval()
    kv = PagedKV(KVSpec(*geometry, torch.float32, 8, 4), 16)
    before = kv.allocator.stats()
    ids, _ = _prompts(False)
    with pytest.raises(UnsupportedModelError, match=match):
        model.generate(ids, cache=PagedCache(kv), max_new_tokens=2)
    assert kv.allocator.stats() == before and not kv.sequences


# ---------------------------------------------- refusals write nothing; padding and the prefix cache
def _refused_setups():
    """(name, model in the given state, forward kwargs) whose direct=True step the memos_paged attention refuses."""
    from torch.nn.attention.flex_attention import create_block_mask

    def dropout():
        torch.manual_seed(0)
        config = _config("llama", attention_dropout=0.5)
        config._attn_implementation = PAGED
        return tf.LlamaForCausalLM(config).train(), {}

    def non_causal():
        model = copy.deepcopy(_model("llama", PAGED))
        for layer in model.model.layers:
            layer.self_attn.is_causal = False
        return model, {}

    def block_mask():
        mask = create_block_mask(lambda b, h, q, k: q >= k, None, None, 12, 12, device="cpu")
        return _model("llama", PAGED), dict(attention_mask=mask)

    return {"train_dropout": dropout, "non_causal": non_causal, "block_mask": block_mask}


@pytest.mark.parametrize("setup", ["train_dropout", "non_causal", "block_mask"])
def test_a_refused_direct_step_writes_nothing(setup):
    """The refusal comes before the step's K/V are written: no layer holds a token, no block is held, and the
    cache still crops, forks and generates (it used to be left mid-step with layer 0 written)."""
    model, extra = _refused_setups()[setup]()
    kv = _kv(model, 32)
    cache = PagedCache(kv, direct=True)
    ids = torch.randint(1, 100, (1, 12), generator=torch.Generator().manual_seed(3))
    with pytest.raises(UnsupportedModelError):
        model(ids, cache=cache, use_cache=True, **extra)
    assert cache.get_seq_length() == 0
    assert [seq.layer_tokens for seq in cache.sequences] in ([], [[0, 0]])
    assert kv.allocator.num_active == 0
    kv.check()
    cache.crop(0)
    cache.fork().free()
    good = _model("llama", PAGED)
    assert torch.equal(_greedy(good, ids, None, cache), _greedy(good, ids, None, DynamicCache()))
    cache.free()
    assert kv.allocator.num_active == 0


def _padded_then_literal(direct: bool):
    """Generate a left-padded batch into a fresh pool; return (model, kv, cache, output, mask, row 1 as a prompt)."""
    model = _model("llama", PAGED if direct else None)
    kv = _kv(model)
    ids, mask = _prompts(batch=True)
    cache = PagedCache(kv, direct=direct)
    out = _greedy(model, ids, mask, cache)
    return model, kv, cache, out, mask, out[1:, :16]  # 5 pad zeros (a real token id) then the row's text


@pytest.mark.parametrize("direct", [False, True], ids=["update", "direct"])
def test_pad_positions_never_enter_the_prefix_cache(direct):
    """set_token_ids with the generation's mask records pads as unknown: an unpadded prompt of the very same ids
    gets no hit from the padded row (whose K/V were computed masked, at shifted positions) and generates
    DynamicCache's tokens."""
    model, kv, cache, out, mask, literal = _padded_then_literal(direct)
    full_mask = torch.cat([mask, torch.ones(2, out.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    cache.set_token_ids(out[:, :-1], attention_mask=full_mask[:, :-1])
    assert cache.sequences[1].token_ids[:5] == [-1] * 5  # UNKNOWN_TOKEN
    assert cache.sequences[1].num_registered == 0  # nothing after the first unknown position is registered
    assert cache.sequences[0].num_registered > 0  # the unpadded row is still cached
    cache.free()
    want = _greedy(model, literal, None, DynamicCache())
    hit = PagedCache.from_prefix(kv, literal)
    assert hit.get_seq_length() == 0
    hit.direct = direct
    assert torch.equal(_greedy(model, literal, None, hit), want)
    hit.free()
    kv.check()


def test_set_token_ids_without_the_mask_after_a_padded_direct_batch_is_refused():
    """direct=True sees the padding mask: omitting attention_mask afterwards raises, records nothing, and leaves
    the cache exactly as it was (an unpadded batch still needs no mask)."""
    from memos_ref.errors import InvalidArgumentError

    _, kv, cache, out, _, _ = _padded_then_literal(direct=True)
    before = [list(seq.token_ids) for seq in cache.sequences], kv.allocator.num_active
    with pytest.raises(InvalidArgumentError, match="attention_mask"):
        cache.set_token_ids(out[:, :-1])
    assert ([list(seq.token_ids) for seq in cache.sequences], kv.allocator.num_active) == before
    assert all(seq.num_registered == 0 for seq in cache.sequences)
    assert cache.fork()._saw_padding  # a fork of a padded cache knows it too
    cache.free()
    model = _model("llama", PAGED)
    ids, _ = _prompts(batch=False)
    plain = PagedCache(kv, direct=True)
    out = _greedy(model, ids, None, plain)
    plain.set_token_ids(out[:, :-1])  # no padding seen: no mask needed
    assert plain.sequences[0].num_registered > 0
    plain.free()
