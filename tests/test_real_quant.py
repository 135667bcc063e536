"""KV quantization on the real model (SmolLM2-135M-Instruct): quantized paged generation against fp32, the key
channel outliers KIVI is built around, the held-out prose, and ``bench quant --model`` on a tiny setting.

The model comes from the session fixtures of ``conftest.py`` (skipped where it cannot be had, failed in CI).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from memos_ref.bench.accuracy import (
    capture_kv,
    channel_outlier_ratio,
    evaluate,
    heldout_prose,
    make_kv,
    prose_token_ids,
    teacher_forced_logits,
)
from memos_ref.errors import InvalidArgumentError, ShapeError
from memos_ref.hf import PagedCache
from memos_ref.quant import KIVI, PerTokenInt8

MODEL = "smollm2-135m-instruct"
QUESTION = "What is the capital of France? Answer in one sentence."


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(smollm2_path), local_files_only=True)


@pytest.fixture(scope="module")
def chat_ids(tokenizer) -> torch.Tensor:
    """The chat-templated question, ``[1, S]``."""
    messages = [{"role": "user", "content": QUESTION}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def _generate(model, ids: torch.Tensor, n: int, scheme=None) -> torch.Tensor:
    kv = make_kv(model, ids.shape[1] + n, scheme)
    cache = PagedCache(kv)
    try:
        return model.generate(ids, n, cache)[0, ids.shape[1] :]
    finally:
        cache.free()


def test_real_int8_token_paged_generation_matches_fp32_greedy(smollm2_forward, tokenizer, chat_ids):
    """Per-token int8 blocks in the paged pool: the chat answer is the fp32 cache's, token for token, and the
    answer is the real one."""
    want = _generate(smollm2_forward, chat_ids, 8)
    got = _generate(smollm2_forward, chat_ids, 8, PerTokenInt8())
    assert "Paris" in tokenizer.decode(want)
    assert got.tolist() == want.tolist(), (tokenizer.decode(want), tokenizer.decode(got))


def test_real_int8_token_kl_is_small_and_2bit_without_residual_is_not(smollm2_forward, tokenizer):
    """Teacher-forced over 96 tokens of held-out prose: per-token int8 stays within a KL bound measured with a
    wide margin (measured ~1e-3; bound 1e-2), and 2-bit KIVI with no residual window is an order of magnitude
    worse (measured ~3.5e-2), so the bound can tell a damaged cache from a good one."""
    ids, _ = prose_token_ids(tokenizer, 96)
    ref = teacher_forced_logits(smollm2_forward, ids, make_kv(smollm2_forward, 96, None)).log_softmax(-1)

    def kl(scheme, **kwargs) -> float:
        kv = make_kv(smollm2_forward, 96, scheme, **kwargs)
        logp = teacher_forced_logits(smollm2_forward, ids, kv).log_softmax(-1)
        kv.check()
        return float((ref.exp() * (ref - logp)).sum(-1).mean())

    int8, kivi2 = kl(PerTokenInt8()), kl(KIVI(2, 32), residual_tokens=0)
    assert 0 < int8 < 1e-2
    assert kivi2 > 5 * int8


def test_real_keys_have_channel_outliers_values_do_not(smollm2_forward, tokenizer):
    """KIVI's premise, on the real model: a few key channels are large for every token (post-RoPE keys as
    cached), values much less so; and so 4-bit keys quantized per channel beat per-token ones."""
    ids, _ = prose_token_ids(tokenizer, 64)
    layers = capture_kv(smollm2_forward, ids)
    assert len(layers) == 30 and layers[0][0].shape == (3, 64, 64)
    keys = torch.cat([channel_outlier_ratio(k) for k, _ in layers])  # [30 * 3]
    values = torch.cat([channel_outlier_ratio(v) for _, v in layers])
    assert keys.median() > 1.5 * values.median()  # measured ~3.9 against ~1.9
    kivi = KIVI(4, 32)
    k = layers[15][0][:, :32]

    def err(kind: str) -> float:
        return float((k - kivi.round_trip(k, kind)).norm() / k.norm())

    assert err("key") < err("value")  # per channel (the "key" layout) beats per token on keys


def test_channel_outlier_ratio_reads_channels_not_tokens():
    x = torch.ones(2, 16, 8)
    x[:, :, 3] = 10.0  # one outlier channel in every token
    assert channel_outlier_ratio(x).tolist() == [10.0, 10.0]
    y = torch.ones(2, 16, 8)
    y[:, 5, :] = 10.0  # one outlier token across every channel: no channel stands out
    assert channel_outlier_ratio(y).tolist() == [1.0, 1.0]
    with pytest.raises(ShapeError):
        channel_outlier_ratio(torch.ones(16, 8))


def test_heldout_prose_is_english_without_its_header(tokenizer):
    measured, calibration = heldout_prose()
    assert not any(line.startswith("# ") for line in (measured + calibration).splitlines())
    assert "Licence" not in measured and "* * *" not in measured + calibration
    assert measured.startswith("The ferry") and calibration.startswith("On my last evening")
    ids, calib = prose_token_ids(tokenizer, 1024)  # the bench's context fits
    assert ids.shape == (1, 1024) and calib.shape[1] > 128
    assert tokenizer.decode(ids[0, :4]) == "The ferry to the"
    assert calibration not in measured  # calibrated on other text than measured
    with pytest.raises(InvalidArgumentError, match="held-out prose has"):
        prose_token_ids(tokenizer, 100_000)


def test_bench_quant_model_quick_gives_the_summary_fields(smollm2_forward, smollm2_path, monkeypatch, capsys):
    """``python -m memos_ref.bench quant --model smollm2-135m-instruct --quick --json`` (64 tokens, two schemes),
    on the session's already loaded forward."""
    import memos_ref.model
    from memos_ref.bench import quant
    from memos_ref.bench.__main__ import main

    def loaded(path=None, dtype=torch.float32):
        assert str(path) == str(smollm2_path)
        return smollm2_forward

    monkeypatch.setattr(memos_ref.model, "load_model", loaded)
    assert main(["quant", "--model", MODEL, "--quick", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["model"].startswith(MODEL) and report["config"]["context_tokens"] == 64
    summary = report["summary"]
    assert summary["ppl_fp32"] > 1 and summary["fp16_bytes_per_token"] == 30 * 2 * 3 * 64 * 2
    for name in quant.PRETRAINED_QUICK_SCHEMES:
        fields = summary[name]
        assert set(fields) == {"ppl_delta_pct", "kl_mean", "greedy_agreement", "bytes_per_token_ratio"}
        assert all(math.isfinite(v) for v in fields.values())
        assert 0 <= fields["greedy_agreement"] <= 1 and fields["kl_mean"] > 0
    assert summary["int8_token"]["bytes_per_token_ratio"] == pytest.approx(0.5156, abs=1e-3)  # (64 + 2) / 128
    assert summary["kivi2_g32_no_residual"]["kl_mean"] > summary["int8_token"]["kl_mean"]
    assert "kivi4_g32_no_residual" in [n for n, _, _ in quant.pretrained_schemes(torch.ones(30, 2))]


def test_bench_model_option_is_refused_where_unsupported(capsys):
    from memos_ref.bench.__main__ import main

    with pytest.raises(SystemExit) as exc:
        main(["growth", "--model", MODEL, "--quick"])
    assert exc.value.code == 2 and "runs only on the shipped model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["quant", "--model", "no-such-model", "--quick"])
    assert exc.value.code == 2 and "expected one of" in capsys.readouterr().err


def test_evaluate_counts_the_residual_window_at_fp16():
    """Bytes per token are read while the measured sequence still holds its blocks: with a 256-token residual
    window over 512 tokens (blocks of 32), 8 blocks are staged at fp16 and 8 sealed to int8 (the shipped
    model: no download). Before the fix the cache was dropped first, its window released, and aging looked
    as small as int8 everywhere."""
    from memos_ref.model import load_model, shipped_model_dir

    model = load_model()
    corpus = (shipped_model_dir().parent / "data" / "heldout_stdlib.txt").read_bytes()
    ids = torch.tensor([list(corpus[:512])])
    fp16 = model.kv_spec().bytes_per_token / 2
    int8 = evaluate(model, ids, PerTokenInt8(), generate_tokens=0)
    aging = evaluate(model, ids, PerTokenInt8(), generate_tokens=0, residual_tokens=256)
    assert aging["pool_stats"]["staged_blocks"] == 8
    assert aging["bytes_per_token"] == pytest.approx((8 * int8["bytes_per_token"] + 8 * fp16) / 16)
    assert "greedy_agreement" not in aging and "logp" in aging  # generate_tokens=0: teacher-forced only
