"""Fixtures for the offload executor tests (builders live in offload_helpers.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# The builders (offload_helpers, quant_helpers, families) sit here; the tests in runtime/, experts/, loading/ and
# kernels/ import them by name.
sys.path.insert(0, str(Path(__file__).parent))

from offload_helpers import build_checkpoint  # noqa: E402

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


@pytest.fixture(scope="session")
def quantized_checkpoints(tmp_path_factory):
    """"gpt_oss_mxfp4" | "deepseek_v3_fp8" -> a tiny checkpoint in that release layout (quant_helpers.py), built once."""
    from quant_helpers import build_deepseek_fp8, build_gpt_oss_mxfp4

    root = tmp_path_factory.mktemp("quantized")
    builders = {"gpt_oss_mxfp4": build_gpt_oss_mxfp4, "deepseek_v3_fp8": build_deepseek_fp8}
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = builders[name](root)
        return cache[name]

    return get


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(scope="session")
def family_checkpoints(tmp_path_factory):
    """family -> tiny checkpoint dir (families.py), or the exception that stopped its build; each built once."""
    from families import build

    root = tmp_path_factory.mktemp("families")
    built: dict = {}

    def get(family: str):
        if family not in built:
            try:
                built[family] = build(family, root)
            except Exception as e:  # noqa: BLE001 - the reason is what the family tests report
                built[family] = e
        return built[family]

    return get


@pytest.fixture
def one_thread():
    """Tiny matrices run fastest on one thread; a busy 2-core machine makes a second one cost milliseconds."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
