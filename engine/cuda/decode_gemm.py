"""DecodeGemm: the projections of decode and verify forwards on the Hopper GEMM (engine/cuda/wrappers/gemm_sm90.py)
where it takes them, for CudaOps when env.GEMM is "sm90" on a device that loaded it: QKV (store), o and down
(the residual add in place), gate_up (SiLU-and-mul fused: no [M, 2 I] intermediate) and the LM head (fp32
logits). Each method returns None where the kernels do not take the operands (bias, an Fp8Weight, fp16, more
than gemm_sm90.MAX_ROWS rows), and the caller takes its other path."""
from __future__ import annotations

import torch

from engine.cuda.library import KernelLibrary
from engine.cuda.wrappers import gemm_sm90


class DecodeGemm:
    def __init__(self, lib: KernelLibrary):
        self.lib = lib
        self.workspace = gemm_sm90.SplitKWorkspace(lib.device, lib.num_sms)

    @classmethod
    def create(cls, lib: KernelLibrary, setting: str) -> DecodeGemm | None:
        """setting: env.GEMM. None unless it is "sm90" and the library loaded the kernels (sm_90 devices)."""
        return cls(lib) if setting == "sm90" and lib.gemm_sm90 else None

    def _takes(self, x: torch.Tensor, weight) -> bool:
        return isinstance(weight, torch.Tensor) and gemm_sm90.takes(x, weight)

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None, add_to: torch.Tensor | None,
               out_dtype: torch.dtype | None) -> torch.Tensor | None:
        """TorchOps.linear's contract: x @ weight^T as out_dtype (bf16 or fp32), or added into add_to in place."""
        if bias is not None or not self._takes(x, weight):
            return None
        M, N = x.shape[0], weight.shape[0]
        if add_to is not None:
            if add_to.dtype != torch.bfloat16 or add_to.shape != (M, N) or not add_to.is_contiguous():
                return None
            return gemm_sm90.launch(self.lib, self.workspace, "residual", add_to, x, weight)
        if out_dtype not in (None, torch.bfloat16, torch.float32):
            return None
        f32 = out_dtype == torch.float32
        out = torch.empty((M, N), dtype=torch.float32 if f32 else torch.bfloat16, device=x.device)
        return gemm_sm90.launch(self.lib, self.workspace, "f32" if f32 else "store", out, x, weight)

    def silu_and_mul(self, x: torch.Tensor, gate_up) -> torch.Tensor | None:
        """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate | up]: [M, I]."""
        if not self._takes(x, gate_up) or gate_up.shape[0] % 2:
            return None
        out = torch.empty((x.shape[0], gate_up.shape[0] // 2), dtype=torch.bfloat16, device=x.device)
        return gemm_sm90.launch(self.lib, self.workspace, "silu", out, x, gate_up)
