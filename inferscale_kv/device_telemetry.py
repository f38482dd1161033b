"""GPU telemetry through NVML (nvidia-ml-py): the device's memory and utilization, for the node's start-up budget
check and the workers' reports. Where NVML is absent (a CPU machine, a container without the driver), every reading
is None and nothing fails."""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass


@dataclass(frozen=True)
class DeviceReading:
    name: str
    memory_total_bytes: int
    memory_used_bytes: int
    utilization_percent: int


_init_lock = threading.Lock()
_nvml_ready: bool | None = None  # None: not tried yet


def _nvml():
    """The initialized pynvml module, or None without NVML."""
    global _nvml_ready
    with _init_lock:
        if _nvml_ready is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                _nvml_ready = True
            except Exception:  # no library, no driver, no device: no telemetry
                _nvml_ready = False
    if not _nvml_ready:
        return None
    import pynvml

    return pynvml


def visible_device_index() -> int:
    """NVML's index of the process's first CUDA device (CUDA_VISIBLE_DEVICES renumbers CUDA's, not NVML's)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(first) if first.isdigit() else 0


def read_device(index: int | None = None) -> DeviceReading | None:
    """The device's memory and utilization now; None where NVML cannot tell."""
    nvml = _nvml()
    if nvml is None:
        return None
    try:
        handle = nvml.nvmlDeviceGetHandleByIndex(visible_device_index() if index is None else index)
        memory = nvml.nvmlDeviceGetMemoryInfo(handle)
        name = nvml.nvmlDeviceGetName(handle)
        return DeviceReading(name.decode() if isinstance(name, bytes) else str(name), int(memory.total),
                             int(memory.used), int(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))
    except Exception:  # a device NVML cannot read is reported as no reading
        return None
