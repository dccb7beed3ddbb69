"""HopperGemm: the projections of forwards of at most 256 rows (decode, verify, short prompts) on the Hopper GEMM
(engine/cuda/wrappers/gemm_sm90.py) where it takes them, for CudaOps when env.GEMM is "sm90" on a device that loaded
it: QKV (store), o and down (the residual add in place), gate_up (SiLU-and-mul fused: no [M, 2 I] intermediate) and
the LM head (fp32 logits) of bf16 weights; W8A16 for 1-8 rows of a per-channel FP8 weight (the weight converted in
registers; CudaOps then takes such forwards off its skinny kernels: CudaOps._skinny_fits); and W8A8 (x quantized per
row by kernels_cu/fp8_quant.cu, then the FP8 MMA) for the per-channel FP8 weights that engine.quant.takes_w8a8 runs
W8A8 (the "dynamic" activation scheme, 9+ rows, bf16 out). Each method returns None where the kernels do not take
the operands (bias, fp16, a block-scaled FP8 weight, more than gemm_sm90.MAX_ROWS rows), and the caller takes its
other path."""
from __future__ import annotations

import torch

from engine.cuda.library import KernelLibrary
from engine.cuda.wrappers import fp8_quant, gemm_sm90
from engine.quant import Fp8Weight, takes_w8a8


class HopperGemm:
    def __init__(self, lib: KernelLibrary):
        self.lib = lib
        self.workspace = gemm_sm90.SplitKWorkspace(lib.device, lib.num_sms)

    @classmethod
    def create(cls, lib: KernelLibrary, setting: str) -> HopperGemm | None:
        """setting: env.GEMM. None unless it is "sm90" and the library loaded the kernels (sm_90 devices)."""
        return cls(lib) if setting == "sm90" and lib.gemm_sm90 else None

    @staticmethod
    def takes_w8a16(x: torch.Tensor, weight) -> bool:
        """Whether the W8A16 entries take x @ weight^T: a per-channel FP8 weight (contiguous, K % 16 == 0) and 1-8
        rows of contiguous bf16 x (the rows W8A16 serves for every activation scheme)."""
        return (isinstance(weight, Fp8Weight) and weight.per_channel and weight.data.is_contiguous()
                and x.dim() == 2 and 0 < x.shape[0] <= gemm_sm90.W8A16_MAX_ROWS and x.dtype == torch.bfloat16
                and x.shape[1] == weight.shape[1] and x.shape[1] % 16 == 0)

    def _run(self, epilogue: str, out: torch.Tensor, x: torch.Tensor, weight) -> torch.Tensor | None:
        """out <- the epilogue of x @ weight^T, or None (nothing launched) where the kernels do not take them."""
        if self.takes_w8a16(x, weight):
            return gemm_sm90.launch_w8a16(self.lib, self.workspace, epilogue, out, x.contiguous(), weight.data,
                                          weight.row_scale)
        if isinstance(weight, Fp8Weight):
            if not (takes_w8a8(x, weight, torch.bfloat16) and fp8_quant.takes(x) and weight.data.is_contiguous()
                    and 0 < x.shape[0] <= gemm_sm90.MAX_ROWS):
                return None
            xq, x_scale = fp8_quant.quantize_rows(self.lib, x.contiguous())
            return gemm_sm90.launch_w8a8(self.lib, self.workspace, epilogue, out, xq, x_scale.view(-1), weight.data,
                                         weight.row_scale)
        if not (isinstance(weight, torch.Tensor) and gemm_sm90.takes(x, weight)):
            return None
        return gemm_sm90.launch(self.lib, self.workspace, epilogue, out, x, weight)

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, add_to: torch.Tensor | None,
               out_dtype: torch.dtype | None) -> torch.Tensor | None:
        """TorchOps.linear's contract: x @ weight^T as out_dtype (bf16; fp32 for a bf16 weight), or added into add_to
        in place."""
        if bias is not None or x.dim() != 2:
            return None
        M, N = x.shape[0], weight.shape[0]
        if add_to is not None:
            if add_to.dtype != torch.bfloat16 or tuple(add_to.shape) != (M, N) or not add_to.is_contiguous():
                return None
            return self._run("residual", add_to, x, weight)
        f32 = out_dtype == torch.float32
        if out_dtype not in (None, torch.bfloat16, torch.float32) or (
                f32 and isinstance(weight, Fp8Weight) and not self.takes_w8a16(x, weight)):
            return None
        out = torch.empty((M, N), dtype=torch.float32 if f32 else torch.bfloat16, device=x.device)
        return self._run("f32" if f32 else "store", out, x, weight)

    def silu_and_mul(self, x: torch.Tensor, gate_up) -> torch.Tensor | None:
        """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate | up]: [M, I]."""
        if x.dim() != 2 or gate_up.shape[0] % 2:
            return None
        out = torch.empty((x.shape[0], gate_up.shape[0] // 2), dtype=torch.bfloat16, device=x.device)
        return self._run("silu", out, x, gate_up)
