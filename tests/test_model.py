"""The shipped model: small, offline, GQA, and it has clearly learned (held-out bits/byte, completions)."""

from __future__ import annotations

import json
import math

import torch

from memos_ref.model import load_model, model_fingerprint, shipped_model_dir, training_report
from memos_ref.model.corpus import HELDOUT_MODULES, TRAIN_MODULES, heldout_text, unigram_bits_per_byte
from memos_ref.model.evaluate import bits_per_byte
from memos_ref.model.tokenizer import ByteTokenizer


def test_weights_are_small_safetensors_in_transformers_format():
    folder = shipped_model_dir()
    assert (folder / "model.safetensors").stat().st_size <= 20 * 2**20
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_key_value_heads"] < config["num_attention_heads"]  # grouped-query attention
    assert config["vocab_size"] == ByteTokenizer().vocab_size
    assert not list(folder.glob("*.bin")) and not list(folder.glob("*.pt"))  # nothing pickled


def test_loads_offline_with_auto_model(shipped_pair):
    _, hf = shipped_pair
    assert type(hf).__name__ == "LlamaForCausalLM"
    assert len(model_fingerprint()) == 16


def test_heldout_bits_per_byte_beats_unigram_clearly(shipped_pair):
    ours, _ = shipped_pair
    # 8 KiB of the committed held-out text (modules never trained on), scored by the package's forward: 2.315 bits
    # per byte, as over 32 KiB (2.319) at a quarter of the time
    bpb = bits_per_byte(ours, heldout_text(), window=512, max_bytes=8 * 1024)
    report = training_report()
    assert bpb < 0.6 * report["unigram_bits_per_byte"], (bpb, report)
    assert abs(bpb - report["heldout_bits_per_byte"]) < 0.35  # a slice of the same text, the same model


def test_heldout_modules_are_never_trained_on():
    assert not set(HELDOUT_MODULES) & set(TRAIN_MODULES)
    text = heldout_text()
    for name in HELDOUT_MODULES:
        assert f"memos-ref held-out module: {name} " in text


def test_unigram_baseline_is_a_real_cross_entropy():
    # add-one smoothing: each of "a", "b" has probability (1 + 1) / (2 + 256) = 1/129 -> log2(129) bits
    assert abs(unigram_bits_per_byte(["ab"], "ab") - 7.0112) < 1e-3
    assert unigram_bits_per_byte(["a" * 10_000], "a" * 100) < 0.1


def test_bits_per_byte_scores_every_byte_once_from_its_past():
    # an oracle that knows the text puts all its mass on the right next byte: 0 bits; uniform: log2(V) bits
    text = "abcdefgh" * 64
    uniform = bits_per_byte(lambda ids: torch.zeros(*ids.shape, 264), text, window=64)
    assert abs(uniform - math.log2(264)) < 1e-5  # float32 cross-entropy
    cycle = {ord(a): ord(b) for a, b in zip("abcdefgh", "bcdefgha")} | {ByteTokenizer().bos_id: ord("a")}

    def knows_the_cycle(ids):
        logits = torch.full((*ids.shape, 264), -1e4)
        nxt = torch.tensor([[cycle[int(i)] for i in row] for row in ids])
        return logits.scatter(-1, nxt[..., None], 0.0)

    assert bits_per_byte(knows_the_cycle, text, window=64) < 1e-6


def test_completes_python_plausibly():
    model, tok = load_model(), ByteTokenizer()
    out = model.generate(tok("class Stack:\n    def __init__(self):\n"), 80)
    completion = tok.decode(out[0, 1:])
    # a model that learned Python indents, calls, and names things; a random one produces byte soup
    printable = sum(c.isprintable() or c in "\n\t" for c in completion) / len(completion)
    assert printable > 0.98
    new = completion[len("class Stack:\n    def __init__(self):\n") :]
    assert new.startswith("        "), completion  # indents the body of the method
    assert any(token in new for token in ("self.", "return", "(")), completion


def test_train_script_runs_end_to_end(tmp_path, monkeypatch):
    """Train two steps, score the held-out text, save, reload: the whole script on the shipped architecture. The
    held-out scoring runs on the first 4 windows of the text (the whole 240 KiB took most of this test's ~2 min;
    the scoring itself is checked against an oracle by the bits_per_byte tests above)."""
    import memos_ref.model.train as train_module

    full = heldout_text()
    short = full[: 4 * 512]  # 4 windows of bits_per_byte's default 512 bytes (ASCII: bytes == characters)
    monkeypatch.setattr(train_module, "heldout_text", lambda: short)
    report = train_module.train(out=tmp_path, steps=2, batch_size=2, seq_len=32, max_minutes=5)
    assert report["steps"] == 2 and report["tokens_seen"] == 2 * 2 * 32
    assert report["heldout_bytes"] == len(short.encode("utf-8")) == 4 * 512  # the evaluation saw the slice
    assert math.isfinite(report["heldout_bits_per_byte"]) and 0 < report["heldout_bits_per_byte"] < 16
    assert (tmp_path / "model.safetensors").exists() and (tmp_path / "training_report.json").exists()
    tiny = load_model(tmp_path)
    assert tiny(torch.tensor([[1, 2, 3]])).shape == (1, 3, ByteTokenizer().vocab_size)


def test_config_reads_rope_through_the_one_reader():
    """issue 16: the forward and the Jetson exporter share one RoPE reader (memos_ref.model.rope_config):
    ``rope_parameters`` (transformers >= 5) or the older top-level keys; a scaled RoPE is refused by name."""
    import pytest

    from memos_ref.errors import ConfigError
    from memos_ref.model.llama import LlamaConfig

    base = {
        "vocab_size": 32,
        "hidden_size": 16,
        "intermediate_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
    }
    nested = {**base, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}}
    assert LlamaConfig.from_hf_dict(nested).rope_theta == 500000.0
    assert LlamaConfig.from_hf_dict({**base, "rope_theta": 123.0}).rope_theta == 123.0
    assert LlamaConfig.from_hf_dict(base).rope_theta == 10000.0
    llama31 = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    with pytest.raises(ConfigError, match="llama3"):
        LlamaConfig.from_hf_dict({**base, "rope_parameters": llama31})
