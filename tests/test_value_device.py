"""A value on another device than the pool's is refused like a key there: a :class:`DeviceError` naming the value
and both devices, and nothing written — at each door K/V come in by (the pool's write, a step's write, the
transformers cache's update). Before, only the key's device was checked: a value elsewhere reached torch's copy
(a bare RuntimeError) or was named as the key."""

from __future__ import annotations

import pytest
import torch

from memos_ref.errors import DeviceError
from memos_ref.hf import PagedCache
from memos_ref.paged import PagedKV
from memos_ref.paged.step import StepBatch
from memos_ref.spec import KVSpec

SPEC = KVSpec(num_layers=2, num_kv_heads=2, head_dim=4, dtype=torch.float32, block_size=8)


def _blocks(kv: PagedKV) -> torch.Tensor:
    return torch.stack([kv.pool.layer_view(layer) for layer in range(SPEC.num_layers)]).clone()


@pytest.mark.parametrize("wrong", ["key", "value"])
def test_the_pools_write_names_the_tensor_on_another_device(wrong):
    kv = PagedKV(SPEC, 4, prefix_caching=False)
    k, v = torch.ones(3, 2, 4), torch.ones(3, 2, 4)
    k, v = (k.to("meta"), v) if wrong == "key" else (k, v.to("meta"))
    before = _blocks(kv)
    with pytest.raises(DeviceError, match=rf"^{wrong} device meta does not match the pool's cpu$"):
        kv.pool.write(0, torch.arange(3), k, v)
    assert torch.equal(_blocks(kv), before)


@pytest.mark.parametrize("wrong", ["key", "value"])
def test_a_steps_write_names_the_tensor_on_another_device(wrong):
    kv = PagedKV(SPEC, 4, prefix_caching=False)
    seq = kv.new_sequence()
    step = StepBatch.reserve([seq], 3)
    k, v = torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4)
    k, v = (k.to("meta"), v) if wrong == "key" else (k, v.to("meta"))
    before = _blocks(kv)
    with pytest.raises(DeviceError, match=rf"^{wrong} device meta does not match the pool's cpu$"):
        step.write(0, k, v)
    assert torch.equal(_blocks(kv), before) and seq.layer_tokens == [0, 0]


@pytest.mark.parametrize("wrong", ["key", "value"])
def test_the_transformers_caches_update_names_the_tensor_on_another_device(wrong):
    kv = PagedKV(SPEC, 4, prefix_caching=False)
    cache = PagedCache(kv)
    k, v = torch.ones(1, 2, 3, 4), torch.ones(1, 2, 3, 4)
    k, v = (k.to("meta"), v) if wrong == "key" else (k, v.to("meta"))
    with pytest.raises(DeviceError, match=rf"^{wrong} device meta does not match the pool's cpu$"):
        cache.update(k, v, 0)
    assert cache.get_seq_length() == 0 and kv.allocator.num_active == 0
