"""Per-row dynamic E4M3 quantization of activations (kernels_cu/fp8_quant.cu), W8A8's A side: the bytes and
scales of engine.quant.quantize_activations in one kernel instead of four torch passes and an fp32 copy."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import dtype_suffix, tensor_arg
from engine.cuda.driver import KernelArgError
from engine.quant import FP8_DTYPE

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary

THREADS = 256


def takes(x: torch.Tensor) -> bool:
    """Whether quantize_rows serves x: 2-d bf16 / fp16 rows of a multiple of 8 values."""
    return x.dim() == 2 and x.dtype in (torch.bfloat16, torch.float16) and x.shape[1] % 8 == 0


def quantize_rows(lib: KernelLibrary, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (contiguous, K % 8 == 0) -> (E4M3 [M, K], fp32 scales [M, 1]) with x ~ data * scale, each row
    scaled by its amax * fp32(1 / 448): engine.quant.quantize_activations' result, byte for byte."""
    sfx = dtype_suffix(x.dtype, "quantize_rows x")
    xp = tensor_arg(x, "quantize_rows x", x.dtype, 2)
    M, K = x.shape
    if K % 8:
        raise KernelArgError(f"quantize_rows: the row length {K} must be a multiple of 8")
    out = torch.empty((M, K), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((M, 1), dtype=torch.float32, device=x.device)
    if M:
        lib.kernels[f"quantize_rows_fp8_{sfx}"]((M, 1, 1), (THREADS, 1, 1), 0, lib.stream(), out.data_ptr(),
                                                 scale.data_ptr(), xp, K)
    return out, scale
