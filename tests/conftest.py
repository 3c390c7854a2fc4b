"""Shared fixtures. Area-specific fixtures live in each tests/<area>/conftest.py.

Tests write nothing outside their temporary directories: before collection, $MOE_OFFLOAD_CACHE_DIR (expert stores,
GGUF views, built kernels, the demo model) and $HF_HOME (datasets the evaluation harness caches) point at a folder of
this session, removed at its end. A developer who
sets $TORCH_EXTENSIONS_DIR keeps built kernels there between sessions (torch's own variable; CI sets none).
"""

import os
import shutil
import tempfile

import pytest

_CACHE: list[str] = []


def pytest_configure(config):
    if not _CACHE:
        _CACHE.append(tempfile.mkdtemp(prefix="moe-offload-tests-"))
        os.environ["MOE_OFFLOAD_CACHE_DIR"] = _CACHE[0]
        os.environ.pop("MOE_OFFLOAD_STORE_DIR", None)
        os.environ["HF_HOME"] = os.path.join(_CACHE[0], "huggingface")  # the evaluation harness's dataset cache


def pytest_unconfigure(config):
    while _CACHE:
        shutil.rmtree(_CACHE.pop(), ignore_errors=True)


@pytest.fixture(autouse=True)
def _default_logging():
    """Each test starts with the default log set-up: a CLI command for people run in-process (CliRunner) sets
    warnings-only logging for its process, which would hide the next test's events."""
    from moe_offload import log

    log.configure()
    yield


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The built-in demo model (random weights), built once per test session into a temp dir."""
    from moe_offload.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")
