"""The split linear kernels (kernels_cu/split_linear.cu: decode batches of 9..32 tokens) against torch, on
fresh random inputs at the shapes of real models (Llama-3.2-1B, Llama-3.1-8B) and small ones, for every K
split the launch allows (1, 2, 4, 8 blocks in a cluster).

Oracle: F.linear in fp32 on the same bf16 / fp16 inputs (the NORM prologue's input through
TorchOps().rms_norm in the activation dtype, as the model computes it; the kernel applies the norm's
scale after the dot product, which differs only in roundings), then the fp32 torch form of each epilogue
(TorchOps().silu_and_mul, the residual add). Relative error ||out - ref|| / ||ref|| <= 1e-2; silu's output
is NaN-filled before each launch, so an unwritten element fails; the residual's change is checked on its
own, so a row left unchanged fails too. The result of one launch shape is the same bits run after run.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cuda.kernels import SPLIT_VARIANTS
from engine.ops.torch_ops import TorchOps
from gpu.helpers import nan, randn

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
TOKENS = [1, 9, 16, 17, 32]
SPLITS = [1, 2, 4, 8]
TOL = 1e-2
EPS = 1e-5
TORCH = TorchOps()


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> float:
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), f"{name}: NaN in the output (an element left unwritten?)"
    err = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"
    return err


def weight(N: int, K: int, dtype) -> torch.Tensor:
    return randn(N, K, dtype=dtype, scale=K ** -0.5)


def reference(x, w, nw=None) -> torch.Tensor:
    xin = TORCH.rms_norm(x, nw, EPS) if nw is not None else x
    return F.linear(xin.float(), w.float())


def usable(lib, splits: int, K: int, bk: int = 64) -> bool:
    return splits <= lib.decode_cluster and K % (bk * splits) == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("variant", sorted(SPLIT_VARIANTS))
def test_split_variants(lib, gen, dtype, variant):
    """Every compiled variant (K per step, ring depth, start rotation) at 1B's shapes, 17 and 32 tokens."""
    bk = SPLIT_VARIANTS[variant][0]
    for M in (17, 32):
        for splits in (1, 8):
            if not usable(lib, splits, 2048, bk):
                continue
            x, w = randn(M, 2048, dtype=dtype), weight(2048, 2048, dtype)
            start = randn(M, 2048, dtype=dtype, scale=0.25)
            residual = start.clone()
            lib.split_residual(residual, x, w, splits=splits, variant=variant)
            check(f"split_residual{variant}", residual.float() - start.float(), reference(x, w), 2e-2)
            xn, nw, wg = randn(M, 2048, dtype=dtype, scale=3.0), (1 + 0.1 * randn(2048)).to(dtype), weight(4096, 2048, dtype)
            out = nan((M, 2048), dtype)
            lib.split_silu(out, xn, wg, norm_weight=nw, eps=EPS, splits=splits, variant=variant)
            check(f"split_silu{variant}", out, TORCH.silu_and_mul(reference(xn, wg, nw)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("N,K", [(2048, 2048), (2048, 8192), (4096, 14336), (128, 512), (256, 64)])
def test_split_residual(lib, gen, dtype, M, splits, N, K):
    if not usable(lib, splits, K):
        pytest.skip(f"{splits} K splits do not divide K = {K} into steps of 64 (or no clusters here)")
    x, w = randn(M, K, dtype=dtype), weight(N, K, dtype)
    start = randn(M, N, dtype=dtype, scale=0.25)
    residual = start.clone()
    lib.split_residual(residual, x, w, splits=splits)
    ref = reference(x, w)
    check("split_residual", residual, start.float() + ref)
    check("split_residual change", residual.float() - start.float(), ref, 2e-2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("splits", SPLITS)
@pytest.mark.parametrize("I,K,with_norm", [(8192, 2048, True), (8192, 2048, False), (14336, 4096, True),
                                           (64, 512, True), (128, 64, False)])
def test_split_silu(lib, gen, dtype, M, splits, I, K, with_norm):
    if not usable(lib, splits, K):
        pytest.skip(f"{splits} K splits do not divide K = {K} into steps of 64 (or no clusters here)")
    x = randn(M, K, dtype=dtype, scale=3.0)
    nw = (1 + 0.1 * randn(K)).to(dtype)
    w = weight(2 * I, K, dtype)
    out = nan((M, I), dtype)
    lib.split_silu(out, x, w, **({"norm_weight": nw, "eps": EPS} if with_norm else {}), splits=splits)
    check("split_silu", out, TORCH.silu_and_mul(reference(x, w, nw if with_norm else None)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_split_kernels_are_deterministic_and_agree_with_the_skinny_kernels(lib, gen, dtype):
    """The same launch gives the same bits every time (the cluster sums in rank order), and at 32 tokens the
    result is the skinny kernels' up to fp32 summation order."""
    M, N, K, I = 32, 2048, 8192, 1024
    x, w, wg = randn(M, K, dtype=dtype), weight(N, K, dtype), weight(2 * I, K, dtype)
    xn, nw = randn(M, K, dtype=dtype, scale=3.0), (1 + 0.1 * randn(K)).to(dtype)
    start = randn(M, N, dtype=dtype, scale=0.25)
    runs = []
    for _ in range(3):
        residual, act = start.clone(), nan((M, I), dtype)
        lib.split_residual(residual, x, w)
        lib.split_silu(act, xn, wg, norm_weight=nw, eps=EPS)
        runs.append((residual, act))
    for residual, act in runs[1:]:
        assert torch.equal(residual, runs[0][0]) and torch.equal(act, runs[0][1])
    skinny_res, skinny_act = start.clone(), nan((M, I), dtype)
    lib.skinny_residual(skinny_res, x, w)
    lib.skinny_silu(skinny_act, xn, wg, norm_weight=nw, eps=EPS)
    check("split vs skinny residual", runs[0][0], skinny_res, 5e-3)
    check("split vs skinny silu", runs[0][1], skinny_act, 5e-3)


def test_split_kernels_refuse_bad_shapes(lib):
    from engine.cuda.kernels import KernelArgError
    x = randn(16, 2048, dtype=torch.bfloat16)
    with pytest.raises(KernelArgError, match="multiple of 128"):
        lib.split_residual(randn(16, 2000, dtype=torch.bfloat16), x, weight(2000, 2048, torch.bfloat16))
    with pytest.raises(KernelArgError, match="multiple of 64"):
        lib.split_residual(randn(16, 128, dtype=torch.bfloat16), randn(16, 96, dtype=torch.bfloat16),
                           weight(128, 96, torch.bfloat16))
    with pytest.raises(KernelArgError, match="at most 32"):
        lib.split_residual(randn(33, 128, dtype=torch.bfloat16), randn(33, 2048, dtype=torch.bfloat16),
                           weight(128, 2048, torch.bfloat16))
    with pytest.raises(KernelArgError, match="K splits"):
        lib.split_residual(randn(16, 128, dtype=torch.bfloat16), x, weight(128, 2048, torch.bfloat16), splits=3)
