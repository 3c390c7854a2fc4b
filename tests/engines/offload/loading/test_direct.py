"""Float experts read by offset into the host store (direct.py): the same bytes as transformers' own load."""

from __future__ import annotations

import os

import pytest
import torch
from offload_helpers import FAMILIES

from moe_offload.engines.offload.loading import direct, loader
from moe_offload.engines.offload.loading.loader import load_model
from moe_offload.errors import ModelError


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_direct_load_holds_what_from_pretrained_holds(checkpoints, family, dtype, monkeypatch):
    path = checkpoints(family)
    fast = load_model(path, None, dtype=dtype)
    monkeypatch.setattr(loader, "_direct", lambda config: False)  # through from_pretrained, the reference
    slow = load_model(path, None, dtype=dtype)
    for a, b in zip(fast.executor.layers, slow.executor.layers):
        for x, y in zip(a.store.tensors, b.store.tensors):
            assert (x is None) == (y is None)
            if x is not None:  # same dtype, shape and bits (a cast fp32 -> bf16 included)
                assert x.dtype == y.dtype and torch.equal(x, y), family
    sd_fast, sd_slow = fast.model.state_dict(), slow.model.state_dict()
    assert sd_fast.keys() == sd_slow.keys()
    for k in sd_fast:
        assert torch.equal(sd_fast[k], sd_slow[k]), k  # the dense weights too


def test_offsets_read_cast_and_truncated(checkpoints, tmp_path):
    import shutil

    src = checkpoints("qwen3_moe")
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), tmp_path / f)
    off = direct.Offsets(tmp_path)
    key = next(k for k in off.where if "experts.0.down_proj" in k)
    t32 = torch.empty(off.shape(key), dtype=torch.float32)
    off.read_into(key, t32)
    t16 = torch.empty(off.shape(key), dtype=torch.bfloat16)
    off.read_into(key, t16)
    assert torch.equal(t16, t32.to(torch.bfloat16))
    with pytest.raises(ModelError, match="values in the checkpoint"):
        off.read_into(key, torch.empty(3))
    off.close()
    f = tmp_path / "model.safetensors"
    os.truncate(f, f.stat().st_size // 2)
    off = direct.Offsets(tmp_path)
    last = max(off.where, key=lambda k: off.where[k][1])
    with pytest.raises(ModelError, match="truncated"):
        off.read_into(last, torch.empty(off.shape(last), dtype=off.where[last][2]))
    off.close()
