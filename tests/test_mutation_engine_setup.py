"""The engine's and the request's argument checks (issue 30's survivors): a bad argument raises the specific error
naming the argument and what was received, before anything is queued; the engine's defaults and its borrowed
row cache. Oracles: the argument names and values given here, and block arithmetic from the prompt lengths."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from memos_ref.engine import Engine, Request
from memos_ref.errors import ArgumentTypeError, ConfigError, InvalidArgumentError
from memos_ref.paged import PagedKV
from memos_ref.request import _ids_below
from memos_ref.spec import KVSpec

T = 8
V = 50
SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32, block_size=T)


class _Fake:
    """Writes every layer of each step and returns logits where token 7 wins (as in test_mutation_engine)."""

    def __init__(self) -> None:
        self.config = type("Config", (), {"vocab_size": V, "num_hidden_layers": SPEC.num_layers})()

    def __call__(self, input_ids, cache, *, position_ids):
        cache.prepare_step(*input_ids.shape).mark_written_by_kernel()
        out = torch.zeros(*input_ids.shape, V)
        out[..., 7] = 1.0
        return out


class _NoConfig:
    """Callable, but not the package's forward: it has no ``config.vocab_size``."""

    def __call__(self, *args, **kwargs):
        return None


def _kv(num_blocks: int = 64) -> PagedKV:
    return PagedKV(SPEC, num_blocks, device="meta", prefix_caching=False)


# ------------------------------------------------------------------ Engine.__init__


def test_the_default_batch_is_sixteen_rows():
    """``Engine(model, kv)`` decodes at most 16 requests together (the documented default): of 17 queued, one step
    admits 16 and the 17th waits."""
    engine = Engine(_Fake(), _kv())
    reqs = [engine.submit(Request([1, 2, 3], 10)) for _ in range(17)]
    engine.step()
    assert [r for r, _ in engine.running] == reqs[:16] and list(engine.waiting) == reqs[16:]


def test_a_callable_without_a_vocabulary_is_refused_naming_its_type():
    """A callable that is not the package's forward (no ``config.vocab_size``) is refused at construction with
    ArgumentTypeError naming ``model`` and the type received, not an AttributeError later."""
    with pytest.raises(ArgumentTypeError, match=r"^model: .*got _NoConfig$"):
        Engine(_NoConfig(), _kv())


def test_a_non_callable_model_error_names_the_type_received():
    """A model of the wrong kind: the error names the type actually passed (here ``int``)."""
    with pytest.raises(ArgumentTypeError, match=r"^model: .*got int$"):
        Engine(3, _kv())


def test_a_wrong_kv_is_refused_naming_kv():
    """``kv`` not a PagedKV: ArgumentTypeError whose message starts with the argument name ``kv``."""
    with pytest.raises(ArgumentTypeError, match=r"^kv: expected PagedKV, got dict"):
        Engine(_Fake(), {})


@pytest.mark.parametrize(("max_batch", "error"), [(0, InvalidArgumentError), (1.5, ArgumentTypeError)])
def test_a_bad_max_batch_is_refused_naming_max_batch(max_batch, error):
    """``max_batch`` below 1 or not an integer: the error starts with the argument name ``max_batch``."""
    with pytest.raises(error, match=r"^max_batch: expected"):
        Engine(_Fake(), _kv(), max_batch)


def test_a_non_string_publish_to_is_refused_naming_publish_to():
    """``publish_to`` must be a tier name (str) or None: an int raises ArgumentTypeError naming ``publish_to`` and
    the value received."""
    with pytest.raises(ArgumentTypeError, match=r"^publish_to: expected str or NoneType, got int \(3\)"):
        Engine(_Fake(), _kv(), publish_to=3)


def test_a_row_past_the_sliding_window_fails_even_behind_a_shorter_row():
    """The engine's rows have different lengths, and the forward sees the longest: with a sliding window of 12
    tokens the package forward refuses a step past it. R1 (4-token prompt, row 0) stays inside the window; R2
    (10-token prompt, row 1) passes it after 2 decode steps and fails with ConfigError, while R1 finishes all its
    tokens. (Were the longest row hidden behind row 0's length, R2 would silently decode past the window.)"""
    from memos_ref.model import load_model
    from memos_ref.model.llama import LlamaForward

    shipped = load_model()
    model = LlamaForward(dataclasses.replace(shipped.config, sliding_window=12))
    model.load_state_dict(shipped.state_dict())
    kv = PagedKV(model.kv_spec(block_size=T), 16, prefix_caching=False)
    engine = Engine(model, kv, max_batch=4)
    r1 = engine.submit(Request([1, 2, 3, 4], 6))
    r2 = engine.submit(Request(list(range(1, 11)), 6))
    engine.run()
    assert r1.finished and not r1.failed and len(r1.output) == 6, repr(r1.error)
    assert r2.failed and isinstance(r2.error, ConfigError), repr(r2.error)
    # prefill emits token 1 (10 cached), steps cache 11 and 12 tokens; the next (13 > 12) is refused
    assert len(r2.output) == 3
    assert kv.allocator.num_active == 0


# ------------------------------------------------------------------ Engine.submit


def test_submitting_a_non_request_names_request():
    """``submit`` of anything but a Request raises ArgumentTypeError naming ``request`` and queues nothing."""
    engine = Engine(_Fake(), _kv())
    with pytest.raises(ArgumentTypeError, match=r"^request: expected Request, got list"):
        engine.submit([1, 2, 3])
    assert not engine.waiting


# ------------------------------------------------------------------ Request.validate / _ids_below


def test_a_prompt_of_the_wrong_type_is_refused_naming_prompt():
    """A prompt that is not a list or tuple of ids raises ArgumentTypeError naming ``prompt``."""
    with pytest.raises(ArgumentTypeError, match=r"^prompt: expected list or tuple, got str"):
        Request("abc", 3)


def test_an_empty_prompt_is_refused_naming_prompt():
    """An empty prompt raises InvalidArgumentError naming ``prompt``."""
    with pytest.raises(InvalidArgumentError, match=r"^prompt: expected at least one token id"):
        Request([], 3)


@pytest.mark.parametrize("field", ["prompt", "stop_ids"])
def test_the_first_out_of_vocabulary_id_is_named_with_the_vocabulary_bound(field):
    """Token ids are checked against ``[0, vocab_size)``: the first and last ids of the vocabulary (0 and V-1) are
    valid, so in ``[0, V-1, V]`` the error names position 2, the range ``[0, V-1]`` and the bad value V."""
    engine = Engine(_Fake(), _kv())
    ids = [0, V - 1, V]
    kwargs = {"prompt": ids} if field == "prompt" else {"prompt": [1, 2], "stop_ids": ids}
    request = Request(max_new_tokens=3, **kwargs)
    with pytest.raises(InvalidArgumentError, match=rf"^{field}\[2\]: expected an integer in \[0, {V - 1}\], got {V}$"):
        engine.submit(request)
    assert not engine.waiting


@pytest.mark.parametrize(
    ("ids", "vocab_size", "expected"),
    [
        ([0, 1, 49], 50, True),
        ((0,), 50, True),
        ([], 50, True),
        ([0, 5], None, True),
        ([1, 50], 50, False),
        ([-1, 3], None, False),
        ([1, 2.0], 50, False),
        ([1, True], 50, False),
        ("ab", 50, False),
        (range(3), 50, False),
    ],
)
def test_ids_below_is_true_exactly_for_plain_int_ids_in_the_vocabulary(ids, vocab_size, expected):
    """The one-pass token check's contract (its docstring): a list or tuple of plain ints in ``[0, vocab_size)``
    (no upper bound for None); anything else (a float, a bool, another container, an id out of range) is False."""
    assert _ids_below(ids, vocab_size) is expected


def test_numpy_token_ids_down_to_zero_are_accepted():
    """Token ids may be numpy integers (checked one by one): id 0 is valid, and the prompt is stored as ints."""
    request = Request([np.int64(0), np.int64(5)], 1, stop_ids=(np.int32(0),))
    assert request.prompt == [0, 5] and request.stop_ids == (0,)


def test_a_bad_max_new_tokens_is_refused_naming_it():
    """``max_new_tokens`` below 1 raises InvalidArgumentError naming ``max_new_tokens``, the bound and the value."""
    with pytest.raises(InvalidArgumentError, match=r"^max_new_tokens: expected an integer in >= 1, got 0$"):
        Request([1], 0)


def test_a_non_numeric_temperature_is_refused_naming_it():
    """``temperature`` of the wrong type raises ArgumentTypeError naming ``temperature`` and the type received."""
    with pytest.raises(ArgumentTypeError, match=r"^temperature: expected int or float, got str"):
        Request([1], 1, temperature="hot")


@pytest.mark.parametrize("seed", [-1, 2**64])
def test_a_seed_outside_64_bits_is_refused_naming_seed_and_the_range(seed):
    """The seed must fit the generator's unsigned 64 bits: -1 and 2**64 raise InvalidArgumentError naming ``seed``,
    the range ``[0, 2**64 - 1]`` and the value (not a RuntimeError from torch later)."""
    with pytest.raises(InvalidArgumentError, match=rf"^seed: expected an integer in \[0, {2**64 - 1}\], got {seed}$"):
        Request([1], 1, seed=seed)


def test_the_largest_64_bit_seed_is_accepted():
    """``seed = 2**64 - 1`` is valid and seeds the request's generator."""
    assert Request([1], 1, seed=2**64 - 1).generator.initial_seed() == 2**64 - 1


def test_stop_ids_of_the_wrong_type_are_refused_naming_stop_ids():
    """``stop_ids`` must be a list or tuple of ids: an int raises ArgumentTypeError naming ``stop_ids``."""
    with pytest.raises(ArgumentTypeError, match=r"^stop_ids: expected list or tuple, got int"):
        Request([1], 1, stop_ids=3)
