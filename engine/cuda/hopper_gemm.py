"""HopperGemm: the projections of forwards of at most 256 rows (decode, verify, short prompts) on the Hopper GEMM
(engine/cuda/wrappers/gemm_sm90.py), for CudaOps when env.GEMM is "sm90" or "sm90-all" on a device that loaded it:
QKV (store), o and down (the residual add in place), gate_up (SiLU-and-mul fused: no [M, 2 I] intermediate) and the
LM head (fp32 logits) of bf16 weights; and W8A8 (x quantized per row by kernels_cu/fp8_quant.cu, then the FP8 MMA)
for the per-channel FP8 weights that engine.quant.takes_w8a8 runs W8A8 (the "dynamic" activation scheme, 9+ rows,
bf16 out). "sm90" takes only ROUTES, the epilogues and row counts where the kernel measured faster than what CudaOps
runs without it (bench_kernels --gemm, bench/RESULTS.md); "sm90-all" every one the kernels take. Each method returns None where the kernels do not take the operands (bias, fp16, a block-scaled
FP8 weight, fp32 logits of an FP8 weight, more than gemm_sm90.MAX_ROWS rows), and the caller takes its other path."""
from __future__ import annotations

import torch

from engine import env
from engine.cuda.library import KernelLibrary
from engine.cuda.wrappers import fp8_quant, gemm_sm90
from engine.quant import Fp8Weight, takes_w8a8


# (epilogue, "bf16" | "w8a8") -> the most rows "sm90" runs on the GEMM. On an H100 (bench_kernels --gemm, PDL on,
# 1B / 8B decode projections, 16-256 rows) the kernel was faster than cuBLAS for gate_up (SiLU fused: 1B 10-15%, 8B
# 0.3-9% up to 128 rows) and the LM head (0.7-5.6% up to 128 rows); for qkv, o and down it ran from 5% faster (8B at
# 16 rows) to 2.2x slower (1B o at 128), slower past 32 rows throughout; at 256 rows everything was slower; its W8A8
# beat CudaOps' for gate_up at 32-64 rows only. In the engine (scale_bench decode at context 128, bench/RESULTS.md)
# those routes gained 0.5-1.8% a step at batch 16-32 and lost up to 0.9% at 64-128 (bf16): hence 32 rows for bf16.
# W8A8 gate_up gained 5.6% a step at 8B FP8 batch 32 and lost 0.8% at 64 (three rounds each): hence 32 rows too.
# METRALE_GEMM_SILU_ROWS (32) moves the bf16 gate_up bound.
ROUTES = {("silu", "bf16"): env.GEMM_SILU_ROWS, ("f32", "bf16"): 32, ("silu", "w8a8"): 32}


class HopperGemm:
    def __init__(self, lib: KernelLibrary, routes: dict | None = ROUTES):
        """routes: ROUTES, or None for every projection the kernels take."""
        self.lib = lib
        self.routes = routes
        self.workspace = gemm_sm90.SplitKWorkspace(lib.device, lib.num_sms)

    @classmethod
    def create(cls, lib: KernelLibrary, setting: str) -> HopperGemm | None:
        """setting: env.GEMM. None unless it is "sm90" (ROUTES) or "sm90-all" and the library loaded the kernels
        (sm_90 devices)."""
        if setting not in ("sm90", "sm90-all") or not lib.gemm_sm90:
            return None
        return cls(lib, ROUTES if setting == "sm90" else None)

    def _routed(self, epilogue: str, kind: str, rows: int) -> bool:
        return self.routes is None or rows <= self.routes.get((epilogue, kind), 0)

    def _routes(self, epilogue: str, weight, rows: int) -> bool:
        """Whether this setting runs the epilogue of `rows` rows of weight here (checked before out is allocated)."""
        return self._routed(epilogue, "w8a8" if isinstance(weight, Fp8Weight) else "bf16", rows)

    def _run(self, epilogue: str, out: torch.Tensor, x: torch.Tensor, weight) -> torch.Tensor | None:
        """out <- the epilogue of x @ weight^T (a routed one), or None (nothing launched) where the kernels do not
        take them."""
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
            if add_to.dtype != torch.bfloat16 or tuple(add_to.shape) != (M, N) or not add_to.is_contiguous() or \
                    not self._routes("residual", weight, M):
                return None
            return self._run("residual", add_to, x, weight)
        f32 = out_dtype == torch.float32
        if out_dtype not in (None, torch.bfloat16, torch.float32) or (f32 and isinstance(weight, Fp8Weight)) or \
                not self._routes("f32" if f32 else "store", weight, M):
            return None
        out = torch.empty((M, N), dtype=torch.float32 if f32 else torch.bfloat16, device=x.device)
        return self._run("f32" if f32 else "store", out, x, weight)

    def silu_and_mul(self, x: torch.Tensor, gate_up) -> torch.Tensor | None:
        """silu(x @ gate^T) * (x @ up^T) for gate_up = [gate | up]: [M, I]."""
        if x.dim() != 2 or gate_up.shape[0] % 2 or not self._routes("silu", gate_up, x.shape[0]):
            return None
        out = torch.empty((x.shape[0], gate_up.shape[0] // 2), dtype=torch.bfloat16, device=x.device)
        return self._run("silu", out, x, gate_up)
