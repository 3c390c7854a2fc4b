"""Fixtures for the offload executor tests (builders live in offload_helpers.py)."""

from __future__ import annotations

import pytest
import torch
from offload_helpers import build_checkpoint

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """family -> checkpoint dir, built lazily once per session."""
    root = tmp_path_factory.mktemp("moe")
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = build_checkpoint(family, root)
        return cache[family]

    return get


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param
