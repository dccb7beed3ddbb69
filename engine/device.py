"""Device and dtype selection: a GPU when cuda-python finds one (and torch can use it), else the CPU; and the
host-to-device upload that does not wait for the GPU."""
from __future__ import annotations

import logging

import numpy as np
import torch

from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError

log = logging.getLogger(__name__)


def gpu_count() -> int:
    """GPUs the CUDA driver reports through cuda-python; 0 when there is no driver or no device."""
    try:
        from cuda.bindings import driver
    except ImportError:
        log.info("cuda-python is not installed: no GPU, using the CPU backend")
        return 0
    try:
        err, = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            log.info("cuInit failed (%s): no GPU, using the CPU backend", err.name)
            return 0
        err, count = driver.cuDeviceGetCount()
        return count if err == driver.CUresult.CUDA_SUCCESS else 0
    except Exception as e:  # the driver library itself is missing on machines without a GPU
        log.info("no CUDA driver (%s): no GPU, using the CPU backend", e)
        return 0


def select_device(config: EngineConfig) -> torch.device:
    if config.device == "cpu":
        return torch.device("cpu")
    has_gpu = gpu_count() > 0 and torch.cuda.is_available()
    if config.device == "cuda" and not has_gpu:
        raise ConfigError("device=cuda but no GPU is usable (cuda-python found none, or torch has no CUDA)")
    return torch.device("cuda", torch.cuda.current_device()) if has_gpu else torch.device("cpu")


def select_dtype(config: EngineConfig, model: ModelConfig, device: torch.device) -> torch.dtype:
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cpu":
        return torch.float32
    return torch.float16 if model.torch_dtype == "float16" else torch.bfloat16


def upload(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """array on device, without waiting for the work queued there: torch's `.to(device)` from pageable memory
    synchronizes the stream (a prefill forward's plan made at its first layer left the GPU idle while the host
    launched the next kernels), so on a GPU the bytes go through a pinned buffer of torch's host allocator (reused
    only once the copy has run). On the CPU the array's own memory, as `torch.from_numpy`."""
    host = torch.from_numpy(array)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
