"""Shared fixtures. Area-specific fixtures live in each tests/<area>/conftest.py."""

import pytest


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory):
    """The built-in demo model (random weights), built once per test session into a temp dir."""
    from moe_offload.demo import build_demo_model

    return build_demo_model(tmp_path_factory.mktemp("demo") / "demo-model")
