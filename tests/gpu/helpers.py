"""Helpers shared by the GPU kernel tests: fresh random inputs and NaN-poisoned outputs on the
current CUDA device."""
from __future__ import annotations

import torch


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def randn(*shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=dev()) * scale).to(dtype)


def nan(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=dev())
