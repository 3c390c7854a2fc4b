"""The CUDA backend: detects GPUs through the driver library (ctypes), never by importing torch."""

from __future__ import annotations

import ctypes

from moe_offload.backends import Availability, Backend, disk_tier, host_tier, node_name
from moe_offload.hooks import hookimpl
from rm_core import MemoryTier


def _driver():
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None


def device_count() -> tuple[int, str]:
    """(number of CUDA devices, reason when 0), from libcuda's cuInit/cuDeviceGetCount."""
    lib = _driver()
    if lib is None:
        return 0, "no CUDA driver (libcuda.so.1 not found)"
    rc = lib.cuInit(0)
    if rc != 0:
        return 0, f"no CUDA device (cuInit returned {rc})"
    n = ctypes.c_int(0)
    rc = lib.cuDeviceGetCount(ctypes.byref(n))
    if rc != 0 or n.value == 0:
        return 0, "no CUDA device (cuDeviceGetCount == 0)"
    return n.value, ""


class _NvmlMemory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _nvml():
    return ctypes.CDLL("libnvidia-ml.so.1")


def _pci_bus_id(lib, index: int) -> bytes:
    """The PCI bus id of CUDA device ``index`` (CUDA's numbering: after CUDA_VISIBLE_DEVICES)."""
    dev = ctypes.c_int(0)
    buf = ctypes.create_string_buffer(32)
    if lib.cuInit(0) != 0 or lib.cuDeviceGet(ctypes.byref(dev), index) != 0 or lib.cuDeviceGetPCIBusId(buf, 32, dev) != 0:
        raise OSError(f"no PCI bus id for CUDA device {index}")
    return buf.value


def device_memory(index: int) -> tuple[int, int, int]:
    """(free bytes, total bytes, NVML index) of CUDA device ``index``, from NVML (no CUDA context is created).

    NVML numbers every GPU of the machine and ignores CUDA_VISIBLE_DEVICES, so the device is found by its PCI
    bus id: NVML's index ``index`` may be another card (with CUDA_VISIBLE_DEVICES=1, CUDA's 0 is NVML's 1).
    """
    lib = _driver()
    if lib is None:
        raise OSError("no CUDA driver")
    bus = _pci_bus_id(lib, index)
    nvml = _nvml()
    if nvml.nvmlInit_v2() != 0:
        raise OSError("nvmlInit failed")
    handle = ctypes.c_void_p()
    if nvml.nvmlDeviceGetHandleByPciBusId_v2(ctypes.c_char_p(bus), ctypes.byref(handle)) != 0:
        raise OSError(f"no NVML handle for the GPU at PCI {bus.decode(errors='replace')}")
    mem = _NvmlMemory()
    if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(mem)) != 0:
        raise OSError(f"NVML could not read the memory of GPU {index}")
    physical = ctypes.c_uint(index)
    if nvml.nvmlDeviceGetIndex(handle, ctypes.byref(physical)) != 0:
        physical = ctypes.c_uint(index)
    return mem.free, mem.total, physical.value


class CudaBackend(Backend):
    name = "cuda"
    description = "NVIDIA GPUs: hot experts in VRAM, misses copied from pinned host memory or computed on the CPU"

    def availability(self):
        n, why = device_count()
        return Availability(n > 0, why)

    def tiers(self):
        n, _ = device_count()
        tiers = []
        for i in range(n):
            try:
                free, total, physical = device_memory(i)
            except OSError:
                continue
            tiers.append(
                MemoryTier(
                    name=f"cuda:{i}",  # the torch device the engine uses
                    kind="device-hbm",
                    capacity_bytes=total,
                    reserved_bytes=total - free,
                    accelerator=f"{node_name()}/nvidia:{physical}",  # the card, as nvidia-smi numbers it
                )
            )
        return tiers + [host_tier(), disk_tier()]

    def build_engine(self, model=None, placement=None, **options):
        self.require()
        from moe_offload.engines.offload.runtime.build import build_offload_engine

        return build_offload_engine(model, placement, device=options.pop("device", "cuda:0"), backend=self.name, **options)


@hookimpl
def moe_offload_register_backends(register):
    register(CudaBackend())
