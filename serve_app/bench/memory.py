"""Peak memory of the engines while a benchmark runs.

GPU: device memory in use (NVML, all visible GPUs). CPU: resident memory of the vLLM engine
processes on this host (named `VLLM::EngineCore` / `VLLM::Worker` by vLLM), whoever started them
(the bare engine in this process, or the app's replicas), so both targets are measured alike.
"""

from __future__ import annotations

import asyncio

import psutil

GIB = 1024**3
_ENGINE_PROCESS_PREFIXES = ("VLLM::", "EngineCore")


def gpu_used_bytes() -> int | None:
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        total = 0
        for i in range(pynvml.nvmlDeviceGetCount()):
            total += int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used)
        return total
    finally:
        pynvml.nvmlShutdown()


def engine_rss_bytes() -> int:
    total = 0
    for proc in psutil.process_iter(["name", "memory_info"]):
        name = proc.info.get("name") or ""
        if name.startswith(_ENGINE_PROCESS_PREFIXES) and proc.info.get("memory_info"):
            total += proc.info["memory_info"].rss
    return total


class MemoryProbe:
    def __init__(self, period_s: float = 0.5) -> None:
        self._period_s = period_s
        self.gpu = gpu_used_bytes() is not None
        self.peak_bytes = 0

    def sample(self) -> None:
        used = gpu_used_bytes() if self.gpu else engine_rss_bytes()
        self.peak_bytes = max(self.peak_bytes, used or 0)

    async def sample_forever(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self._period_s)

    @property
    def peak_gib(self) -> float | None:
        return self.peak_bytes / GIB if self.peak_bytes else None
