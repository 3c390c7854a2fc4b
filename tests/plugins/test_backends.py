"""The backend plugin manager: built-ins, third-party plugins, the allow-list, availability reasons."""

import pytest

from moe_offload import backends
from moe_offload.backends import Availability, Backend
from moe_offload.errors import BackendUnavailable, ConfigError
from moe_offload.hooks import hookimpl
from moe_offload.plugins import cuda as cuda_plugin


@pytest.fixture(autouse=True)
def fresh_manager(monkeypatch):
    monkeypatch.delenv("MOE_OFFLOAD_PLUGINS", raising=False)
    backends.reset()
    yield
    backends.reset()


def test_builtins_register_like_plugins():
    pm = backends.plugin_manager()
    assert {"mock", "cpu", "cuda", "rngd"} <= {pm.get_name(p) for p in pm.get_plugins()}
    assert list(backends.backends()) == ["rngd", "cuda", "cpu", "mock"]  # pluggy calls last-registered first


def test_mock_and_cpu_available_and_report_tiers():
    for name in ("mock", "cpu"):
        b = backends.get_backend(name)
        assert b.availability().ok
        tiers = b.tiers()
        assert any(t.kind == "host-dram" and t.accelerator is None for t in tiers)
        assert all(t.capacity_bytes > 0 for t in tiers)


@pytest.mark.skipif(cuda_plugin.device_count()[0] > 0, reason="a CUDA device is present")
def test_cuda_unavailable_says_why():
    a = backends.get_backend("cuda").availability()
    assert not a.ok and "CUDA" in a.reason
    with pytest.raises(BackendUnavailable, match="not available"):
        backends.get_backend("cuda").build_engine("x")


def test_rngd_unavailable_says_why():
    a = backends.get_backend("rngd").availability()
    assert not a.ok and "RNGD" in a.reason


def test_allow_list_limits_plugins(monkeypatch):
    monkeypatch.setenv("MOE_OFFLOAD_PLUGINS", "mock")
    backends.reset()
    assert list(backends.backends()) == ["mock"]
    with pytest.raises(ConfigError, match="known: mock"):
        backends.get_backend("cpu")


class _Plugin:
    class Fake(Backend):
        name = "fake"
        description = "a third-party backend"

        def availability(self):
            return Availability(False, "no fake device")

    @hookimpl
    def moe_offload_register_backends(self, register):
        register(self.Fake())


def test_third_party_plugin_registers_and_loading_twice_is_harmless():
    pm = backends.plugin_manager()
    plugin = _Plugin()
    pm.register(plugin, name="fake")
    try:
        backends._backends.cache_clear()
        assert "fake" in backends.backends()
        assert str(backends.get_backend("fake").availability()) == "not available: no fake device"
        # Registering the same backend name again keeps the first one.
        pm.register(_Plugin(), name="fake2")
        backends._backends.cache_clear()
        assert list(backends.backends()).count("fake") == 1
    finally:
        for name in ("fake", "fake2"):
            if pm.get_plugin(name) is not None:
                pm.unregister(name=name)
        backends._backends.cache_clear()


def test_best_available_prefers_real_hardware_then_cpu():
    assert backends.best_available().name in ("rngd", "cuda", "cpu")


def test_every_hook_is_documented():
    from moe_offload import hooks

    specs = [n for n in dir(hooks) if n.startswith("moe_offload_")]
    assert specs
    for name in specs:
        assert (getattr(hooks, name).__doc__ or "").strip(), f"{name} has no docstring"


class _FakeCuda:
    """libcuda with CUDA_VISIBLE_DEVICES=1 on a two-GPU machine: CUDA's device 0 is the card at PCI 02."""

    def cuInit(self, flags):
        return 0

    def cuDeviceGetCount(self, count):
        count._obj.value = 1
        return 0

    def cuDeviceGet(self, dev, ordinal):
        dev._obj.value = ordinal
        return 0

    def cuDeviceGetPCIBusId(self, buf, length, dev):
        buf.value = {0: b"0000:02:00.0"}[dev.value]
        return 0


class _FakeNvml:
    """NVML sees both cards, by its own index: 0 at PCI 01 (8 GiB free), 1 at PCI 02 (70 GiB free)."""

    CARDS = {b"0000:01:00.0": (0, 8 * 2**30), b"0000:02:00.0": (1, 70 * 2**30)}

    def nvmlInit_v2(self):
        return 0

    def nvmlDeviceGetHandleByPciBusId_v2(self, bus, handle):
        handle._obj.value = self.CARDS[bus.value][0] + 100
        return 0

    def nvmlDeviceGetHandleByIndex_v2(self, index, handle):
        handle._obj.value = index + 100
        return 0

    def nvmlDeviceGetMemoryInfo(self, handle, mem):
        index = handle.value - 100
        free = next(f for i, f in self.CARDS.values() if i == index)
        mem._obj.total, mem._obj.free, mem._obj.used = 80 * 2**30, free, 80 * 2**30 - free
        return 0

    def nvmlDeviceGetIndex(self, handle, index):
        index._obj.value = handle.value - 100
        return 0


def test_cuda_tiers_read_the_card_cuda_means(monkeypatch):
    # NVML ignores CUDA_VISIBLE_DEVICES: asking it for index 0 read the memory of another card (8 GiB free
    # instead of 70) and the accelerator id named it.
    monkeypatch.setattr(cuda_plugin, "_driver", lambda: _FakeCuda())
    monkeypatch.setattr(cuda_plugin, "_nvml", lambda: _FakeNvml(), raising=False)
    monkeypatch.setattr(cuda_plugin.ctypes, "CDLL", lambda name: _FakeNvml())  # the code before _nvml() existed
    gpu = backends.get_backend("cuda").tiers()[0]
    assert gpu.name == "cuda:0" and gpu.capacity_bytes - gpu.reserved_bytes == 70 * 2**30
    assert gpu.accelerator.endswith("/nvidia:1")


def test_engine_options_per_backend():
    opts = backends.engine_options
    assert opts("mock", mock_ms=2.0, mock_hit=0.5, policy="lru") == {"ms_per_token": 2.0, "hit_rate": 0.5}
    assert opts("rngd", engine="/bin/npu-engine", data="/data", policy="lru") == {"engine": "/bin/npu-engine", "data": "/data"}
    assert opts("cpu", policy="lru", fraction=0.0, engine="/x") == {"policy": "lru", "fraction": 0.0}  # 0.0 is a value
    assert opts("cuda") == {}
