"""GPU telemetry: real NVML where a GPU is (the lent machine), and on this CPU machine no reading and no failure."""

from __future__ import annotations

from types import SimpleNamespace

import inferscale_kv.device_telemetry as telemetry


def test_without_nvml_there_is_no_reading_and_nothing_fails(monkeypatch) -> None:
    monkeypatch.setattr(telemetry, "_nvml_ready", None)
    try:
        import pynvml

        pynvml.nvmlInit()
        has_gpu = True
    except Exception:  # this machine has no NVML
        has_gpu = False
    reading = telemetry.read_device()
    assert (reading is not None) == has_gpu
    if reading is not None:
        assert reading.memory_total_bytes >= reading.memory_used_bytes > 0


def test_a_reading_maps_nvmls_answers_for_the_first_visible_device(monkeypatch) -> None:
    calls = []
    fake = SimpleNamespace(
        nvmlDeviceGetHandleByIndex=lambda index: calls.append(index) or "handle",
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(total=80 << 30, used=20 << 30),
        nvmlDeviceGetName=lambda handle: b"NVIDIA H200",
        nvmlDeviceGetUtilizationRates=lambda handle: SimpleNamespace(gpu=37))
    monkeypatch.setattr(telemetry, "_nvml", lambda: fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert telemetry.read_device() == telemetry.DeviceReading("NVIDIA H200", 80 << 30, 20 << 30, 37)
    assert calls == [3]  # NVML's numbering, not CUDA's renumbered 0
