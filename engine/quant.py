"""FP8 E4M3 weights with one fp32 scale per output channel, and their reference arithmetic.

A quantized projection weight is an Fp8Weight (data [N, K] float8_e4m3fn, scale [N] fp32) in place of
the [N, K] tensor in LayerWeights / ModelWeights; the op backends dispatch on the type in one place
(TorchOps.linear, CudaOps.linear).

Quantization (per output row n): scale[n] = amax(|w[n, :]|) / 448 (1 for an all-zero row),
data[n, :] = clamp(w[n, :] / scale[n], -448, 448) cast to E4M3 (round to nearest even). 448 is E4M3's
largest finite value. The relative error of each element is at most 2^-4 (3 mantissa bits); elements
below scale * 2^-9 (E4M3's smallest subnormal) flush towards zero.

Reference arithmetic (W8A16, what a weight-only FP8 kernel computes): the weights are converted to the
activation dtype (exact: E4M3 is a subset of bf16, fp16 and fp32), multiplied with the activations
with fp32 accumulation, and the fp32 accumulators are scaled per output channel in the epilogue:
    y[m, n] = (sum_k x[m, k] * data[n, k]) * scale[n]   (+ bias[n]), rounded once to the output dtype.
Scaling after the accumulation, not the weights before it, is what a kernel that dequantizes in
registers does cheaply, and it keeps dequant(W) = data * scale from being rounded to bf16."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError

QUANTIZATIONS = ("none", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
# Compute capability FP8 tensor cores (and torch._scaled_mm) need: Ada (8.9) and Hopper (9.0) on.
FP8_MIN_CAPABILITY = (8, 9)


@dataclass(frozen=True)
class Fp8Weight:
    """A linear layer's weight [N, K] as E4M3 values and per-output-channel scales: w ~ data * scale[:, None]."""

    data: torch.Tensor  # [N, K] float8_e4m3fn, contiguous
    scale: torch.Tensor  # [N] float32

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scale.nbytes

    def tensors(self) -> list[torch.Tensor]:
        return [self.data, self.scale]


Weight = torch.Tensor | Fp8Weight


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """w [N, K] (any float dtype) -> Fp8Weight on w's device; the arithmetic in fp32."""
    if w.dim() != 2:
        raise ValueError(f"quantize_fp8 takes a 2-D weight [N, K], got shape {tuple(w.shape)}")
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    data = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).contiguous()
    return Fp8Weight(data, scale.contiguous())


def dequantize(w: Fp8Weight, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """data * scale[:, None] as `dtype` [N, K] (computed in fp32)."""
    return (w.data.float() * w.scale[:, None]).to(dtype)


def fp8_linear(x: torch.Tensor, w: Fp8Weight, bias: torch.Tensor | None = None, add_to: torch.Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The reference W8A16 projection (module docstring): x [M, K] @ w^T with fp32 accumulation, scaled
    per output channel, + bias. add_to [M, N]: add_to += that, in place, rounded once (returns add_to);
    else returns it as out_dtype (default x.dtype)."""
    acc = torch.mm(x.float(), w.data.float().t())  # every bf16/fp16/fp32 x and E4M3 w is exact in fp32
    return finish_linear(acc * w.scale, bias, add_to, out_dtype or x.dtype)


def finish_linear(y: torch.Tensor, bias: torch.Tensor | None, add_to: torch.Tensor | None,
                  out_dtype: torch.dtype) -> torch.Tensor:
    """The epilogue every FP8 projection shares: y (scaled, fp32 or the GEMM's output dtype) + bias, then
    added into add_to in place (computed in y's precision, one rounding to add_to's dtype) or cast."""
    if bias is not None:
        y = y + bias
    if add_to is not None:
        return add_to.add_(y)
    return y.to(out_dtype)


def check_device(quantization: str, device: torch.device) -> None:
    """FP8 weights on a GPU need FP8 support (sm_89 / sm_90 on); the CPU runs the reference path."""
    if quantization != "fp8" or device.type != "cuda":
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        raise ConfigError(f"--quantization fp8 needs a GPU with FP8 support (compute capability >= "
                          f"{FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]}: Ada or Hopper); {device} ({name}) has "
                          f"{capability[0]}.{capability[1]}: serve it with --quantization none")
