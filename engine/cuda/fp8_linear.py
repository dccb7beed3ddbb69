"""CudaOps' projections of FP8 weights (engine/quant.py Fp8Weight): the skinny FP8 kernels, W8A8 on the FP8 tensor
cores, or torch's W8A16 and fp32 references, by the weight's blocks, its activation scheme and the rows of x."""
from __future__ import annotations

import torch

from engine import env
from engine.cuda.library import KernelLibrary
from engine.cuda.wrappers import fp8_quant, skinny_linear
from engine.quant import (W8A16_MAX_ROWS, WEIGHT_ONLY, Fp8Weight, finish_linear, fp8_linear, quantize_activations,
                          takes_w8a8)


def fp8_projection(lib: KernelLibrary, x: torch.Tensor, weight: Fp8Weight, bias: torch.Tensor | None,
                   add_to: torch.Tensor | None, out_dtype: torch.dtype | None, skinny: bool,
                   decode: bool = False) -> torch.Tensor:
    """TorchOps.linear's contract for an Fp8Weight. skinny: the skinny W8A16 kernels take x and weight (CudaOps'
    skinny_fits up to skinny_rows(weight, decode) rows, and a bias of x's dtype if any). decode: a decode
    forward's (W8A8 may take the skinny W8A8 kernel, a weight-only weight the skinny W8A16 kernels up to 32 rows;
    a prompt's GEMM must not depend on how many rows share its forward). By the weight and x:
    - per-channel scales that the skinny kernels take (up to 8 rows; a weight-only weight's up to 32 in a decode
      forward): the skinny FP8 kernel (skinny_store / skinny_f32 with the weight converted in registers: the
      reference W8A16 arithmetic up to the order of the fp32 sums); with add_to, its fp32 result added in place
      (one rounding, as the reference). Not the residual kernel: it reads add_to before its wait, which only the
      fused ops' launch order makes safe;
    - where engine.quant.takes_w8a8 says (per-channel scales of the "dynamic" activation scheme, more than 8 rows
      of bf16 x into a bf16 output: prefill, large decode batches): W8A8 on the tensor cores, x quantized per row
      to E4M3 with a dynamic scale (fp8_scaled_mm), the arithmetic TorchOps runs in fp32
      (engine.quant.w8a8_linear);
    - other per-channel cases (a weight-only weight's prefill and decode batches past the skinny kernels, fp32
      logits of more rows, shapes neither kernel takes): W8A16 (w8a16_mm), the reference arithmetic with the
      weights converted to x's dtype on every call. Correct; it reads and writes a 16-bit copy of the weight per
      call, which a prompt's GEMM amortises over its rows;
    - any other block (--fp8-weight-block RxC): the fp32 reference itself (engine.quant.fp8_linear: the
      weight dequantized to fp32, one fp32 matmul). Correct and slow (an fp32 copy of the weight and an
      fp32 GEMM per call); a block-scaled FP8 kernel will replace it.
    All are sync-free and capturable."""
    out = add_to.dtype if add_to is not None else out_dtype or x.dtype
    if not weight.per_channel:
        return fp8_linear(x, weight, bias, add_to, out)
    if skinny:
        y = torch.empty((x.shape[0], weight.shape[0]), dtype=x.dtype if out == x.dtype and add_to is None
                        else torch.float32, device=x.device)
        skinny_linear.store(lib, y, x, weight, bias)
        return finish_linear(y, None, add_to, out)
    if takes_w8a8(x, weight, out):
        return finish_linear(fp8_scaled_mm(lib, x, weight, decode), bias, add_to, out)
    return finish_linear(w8a16_mm(x, weight), bias, add_to, out)


def w8a16_mm(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    """W8A16 for a per-channel weight in torch: [M, N] fp32 = (x @ data^T) * row_scale, engine.quant.fp8_linear's
    arithmetic before its epilogue. The E4M3 values convert exactly to x's dtype (bf16 or fp16: E4M3 is a subset
    of both), every product of two 16-bit values is exact in fp32, and out_dtype=float32 makes cuBLAS accumulate
    and return fp32 (no rounding of the sum to 16 bits), so only the order of the fp32 sums differs from the
    reference's fp32 matmul; the per-row scale multiplies the fp32 result, rounded once by the caller's epilogue.
    CUDA only: torch has no CPU kernel for mm's out_dtype (TorchOps computes the same in fp32: fp8_linear)."""
    acc = torch.mm(x, weight.data.to(x.dtype).t(), out_dtype=torch.float32)  # [M, N] fp32 accumulation
    return acc * weight.row_scale


def skinny_rows(weight: Fp8Weight, decode: bool) -> int:
    """The most rows of x CudaOps sends to the skinny W8A16 (_fp8) kernels for `weight`: a weight-only weight's
    decode forwards up to FP8_MAX_M (32) rows (the rows 9-32 that a "dynamic" weight runs W8A8 on the skinny W8A8
    kernels), else W8A16_MAX_ROWS (8)."""
    return skinny_linear.FP8_MAX_M if decode and weight.activation_scheme == WEIGHT_ONLY else W8A16_MAX_ROWS


def fp8_scaled_mm(lib: KernelLibrary, x: torch.Tensor, weight: Fp8Weight, decode: bool = False) -> torch.Tensor:
    """W8A8 for a per-channel weight: x [M, K] bf16 quantized per row (a_scale[m] = amax(|x[m]|) * fp32(1 / 448))
    to E4M3 by one kernel (kernels_cu/fp8_quant.cu; torch's quantize_activations where it does not take x), then one
    FP8 GEMM with both scales applied to the fp32 accumulators: [M, N] bf16 ~ x @ (data * row_scale[:, None])^T.
    The GEMM: in decode forwards of at most METRALE_W8A8_SKINNY_ROWS (32) rows the skinny W8A8 kernel
    (skinny_linear.store with x_scale: the weight read once), else torch._scaled_mm."""
    x = x.contiguous()
    x_fp8, a_scale = fp8_quant.quantize_rows(lib, x) if fp8_quant.takes(x) else quantize_activations(x)
    if decode and takes_skinny_w8a8(x, weight):
        out = torch.empty((x.shape[0], weight.shape[0]), dtype=torch.bfloat16, device=x.device)
        skinny_linear.store(lib, out, x_fp8, weight, x_scale=a_scale)
        return out
    # mat2 is column-major [K, N] (the transpose of the row-major data), as _scaled_mm requires.
    return torch._scaled_mm(x_fp8, weight.data.t(), scale_a=a_scale, scale_b=weight.row_scale[None, :],
                            out_dtype=torch.bfloat16)


def takes_skinny_w8a8(x: torch.Tensor, weight: Fp8Weight) -> bool:
    """Whether the skinny W8A8 kernels serve x [M, K] @ weight^T (W8A8 already chosen: engine.quant.takes_w8a8): at
    most METRALE_W8A8_SKINNY_ROWS (32) rows, and a weight of their K and N tile (contiguous, per-channel)."""
    n, k = weight.shape
    return (0 < x.shape[0] <= min(env.W8A8_SKINNY_ROWS, skinny_linear.SKINNY_MAX_M) and weight.per_channel
            and weight.data.is_contiguous() and k % skinny_linear.SKINNY_K_ALIGN == 0
            and n % skinny_linear.SKINNY_TILE == 0)


def _skinny_x(lib: KernelLibrary, x: torch.Tensor, weight: Fp8Weight, out_dtype: torch.dtype,
              w8a16: bool) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """The skinny kernels' x operands (x, x_scale) for a decode forward's x @ weight^T past the skinny forwards (9-32
    rows): w8a16 (CudaOps' skinny_fits up to skinny_rows: a weight-only weight) x itself, no scale (the W8A16
    kernels); else, where it runs W8A8 on the skinny kernels (takes_w8a8, takes_skinny_w8a8, and the quantization
    kernel takes x), x quantized per row (E4M3, its scales); None where neither kernel serves it."""
    if w8a16:
        return x.contiguous(), None
    if not (takes_w8a8(x, weight, out_dtype) and takes_skinny_w8a8(x, weight) and fp8_quant.takes(x)):
        return None
    return fp8_quant.quantize_rows(lib, x.contiguous())


def skinny_residual(lib: KernelLibrary, h: torch.Tensor, x: torch.Tensor, weight: Fp8Weight, w8a16: bool) -> bool:
    """A decode forward's h += x @ weight^T past the skinny forwards on one skinny residual kernel where one serves it
    (_skinny_x): W8A16, the fp32 sum added with one rounding (fp8_projection's result with add_to); W8A8, the GEMM's
    bf16 product, then added (the composition fp8_projection runs with add_to, in one launch). False, doing nothing,
    where neither does."""
    operands = _skinny_x(lib, x, weight, h.dtype, w8a16)
    if operands is None:
        return False
    skinny_linear.residual(lib, h, operands[0], weight, x_scale=operands[1])
    return True


def skinny_silu(lib: KernelLibrary, x: torch.Tensor, gate_up: Fp8Weight, w8a16: bool) -> torch.Tensor | None:
    """A decode forward's silu(gate) * up of x @ gate_up^T (x normalized) past the skinny forwards, on one skinny
    silu kernel where one serves it (_skinny_x), else None."""
    operands = _skinny_x(lib, x, gate_up, x.dtype, w8a16)
    if operands is None:
        return None
    out = torch.empty((x.shape[0], gate_up.shape[0] // 2), dtype=x.dtype, device=x.device)
    skinny_linear.silu(lib, out, operands[0], gate_up, x_scale=operands[1])
    return out
