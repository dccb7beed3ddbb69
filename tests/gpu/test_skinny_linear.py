"""The skinny linear kernels (kernels_cu/skinny_linear.cu) against torch, on fresh random inputs at the
shapes of real models (Llama-3.2-1B, Llama-3.1-8B) and small ones, for every token count bucket and
both block widths (8 and 16 warps).

Oracle: F.linear in fp32 on the same bf16 / fp16 inputs (the NORM prologue's input through
TorchOps().rms_norm in the activation dtype, as the model computes it; the kernel applies the norm's
scale after the dot product, which differs only in roundings), followed by the fp32 torch form of each
epilogue (TorchOps().silu_and_mul, TorchOps().rope_cache_write, the residual add).
Relative error ||out - ref|| / ||ref|| <= 1e-2; outputs are NaN-filled before each launch, so an
unwritten element fails. The epilogues are also checked bit for bit against the unfused path built
from the same kernel's accumulators (skinny_store to fp32 / the activation dtype, then the existing
elementwise kernels or the same-dtype torch op).
"""
from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from engine.cuda.wrappers import silu_and_mul, skinny_linear
from engine.ops.torch_ops import TorchOps
from gpu.helpers import dev, nan, randn

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
TOKENS = [1, 3, 8, 9, 16, 17, 32]
TOL = 1e-2
EPS = 1e-5
TORCH = TorchOps()


@pytest.fixture(autouse=True, params=[8, 16], ids=["8warps", "16warps"])
def block_width(request, lib):
    """Every test runs with 8-warp and with 16-warp blocks (the wrapper picks 16 for grids of at most
    lib.skinny_wide_tiles tiles; here forced one way or the other)."""
    wide = lib.skinny_wide_tiles
    lib.skinny_wide_tiles = 1 << 30 if request.param == 16 else 0
    yield request.param
    lib.skinny_wide_tiles = wide


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float = TOL) -> float:
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), f"{name}: NaN in the output (an element left unwritten?)"
    err = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"
    return err


def weight(N: int, K: int, dtype) -> torch.Tensor:
    """[N, K] with unit-variance outputs for unit-variance inputs."""
    return randn(N, K, dtype=dtype, scale=K ** -0.5)


def norm_inputs(M: int, K: int, dtype):
    """(residual stream x [M, K], norm weight [K])."""
    return randn(M, K, dtype=dtype, scale=3.0), (1 + 0.1 * randn(K)).to(dtype)


def reference(x, w, bias=None, nw=None) -> torch.Tensor:
    """fp32 x @ w^T (+ bias) of the bf16/fp16 operands; with nw, x is normalised first (in its dtype)."""
    xin = TORCH.rms_norm(x, nw, EPS) if nw is not None else x
    return F.linear(xin.float(), w.float(), None if bias is None else bias.float())


def rope_table(P: int, D: int) -> torch.Tensor:
    freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev(), dtype=torch.float32) / D))
    angles = torch.arange(P, device=dev(), dtype=torch.float32)[:, None] * freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


# ---------------------------------------------------------------------------------------------
# store / f32

STORE_SHAPES = [(3072, 2048), (2048, 2048), (2048, 8192), (4096, 14336),
                (48, 64), (16, 32), (32, 2144)]  # K = 2144: 67 chunks, a partial last group


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("N,K", STORE_SHAPES)
def test_skinny_store(lib, gen, dtype, M, N, K):
    x, w = randn(M, K, dtype=dtype), weight(N, K, dtype)
    out = nan((M, N), dtype)
    skinny_linear.store(lib, out, x, w)
    check("skinny_store", out, reference(x, w))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 9, 32])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("with_norm", [False, True])
def test_skinny_store_norm_and_bias(lib, gen, dtype, M, with_bias, with_norm):
    N, K = 3072, 2048
    x, nw = norm_inputs(M, K, dtype)
    w = weight(N, K, dtype)
    bias = randn(N, dtype=dtype) if with_bias else None
    norm = {"norm_weight": nw, "eps": EPS} if with_norm else {}
    out = nan((M, N), dtype)
    skinny_linear.store(lib, out, x, w, bias=bias, **norm)
    check("skinny_store_norm_bias", out, reference(x, w, bias, nw if with_norm else None))
    # fp32 out: the same accumulators, unrounded; rounding them gives the bf16/fp16 output exactly.
    out32 = nan((M, N), torch.float32)
    skinny_linear.store(lib, out32, x, w, bias=bias, **norm)
    check("skinny_f32_norm_bias", out32, reference(x, w, bias, nw if with_norm else None))
    assert torch.equal(out32.to(dtype), out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N,K,M", [(1024, 256, m) for m in TOKENS]
                         + [(128256, 2048, 1), (128256, 2048, 17), (128256, 2048, 32)])
def test_skinny_f32_logits(lib, gen, dtype, N, K, M):
    """The final norm + lm_head: fp32 logits, no rounding of the accumulators."""
    x, nw = norm_inputs(M, K, dtype)
    w = weight(N, K, dtype)
    out = nan((M, N), torch.float32)
    skinny_linear.store(lib, out, x, w, norm_weight=nw, eps=EPS)
    check("skinny_f32", out, reference(x, w, nw=nw))
    # Against exactly what the kernel computes (T(norm_w * x) on the tensor cores, then the fp32 result
    # times rsqrt(mean(x^2) + eps)): only the fp32 summation order differs.
    inv = torch.rsqrt(x.float().pow(2).mean(-1) + EPS)
    xin = (nw.float() * x.float()).to(dtype)
    check("skinny_f32_tight", out, F.linear(xin.float(), w.float()) * inv[:, None], 1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_skinny_store_is_deterministic(lib, gen, dtype):
    M, N, K = 17, 2048, 8192
    x, nw = norm_inputs(M, K, dtype)
    w = weight(N, K, dtype)
    a, b = nan((M, N), dtype), nan((M, N), dtype)
    skinny_linear.store(lib, a, x, w, norm_weight=nw, eps=EPS)
    skinny_linear.store(lib, b, x, w, norm_weight=nw, eps=EPS)
    assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------------
# silu

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("I,K,with_norm", [(8192, 2048, True), (8192, 2048, False), (64, 64, True), (8, 96, False)])
def test_skinny_silu(lib, gen, dtype, M, I, K, with_norm):
    x, nw = norm_inputs(M, K, dtype)
    w = weight(2 * I, K, dtype)
    norm = {"norm_weight": nw, "eps": EPS} if with_norm else {}
    out = nan((M, I), dtype)
    skinny_linear.silu(lib, out, x, w, **norm)
    check("skinny_silu", out, TORCH.silu_and_mul(reference(x, w, nw=nw if with_norm else None)))
    # The unfused path from the same accumulators: skinny_store then silu_and_mul (same roundings).
    gate_up = nan((M, 2 * I), dtype)
    skinny_linear.store(lib, gate_up, x, w, **norm)
    unfused = nan((M, I), dtype)
    silu_and_mul.launch(lib, unfused, gate_up)
    assert torch.equal(out, unfused)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 32])
def test_skinny_silu_8b(lib, gen, dtype, M):
    I, K = 14336, 4096
    x, nw = norm_inputs(M, K, dtype)
    w = weight(2 * I, K, dtype)
    out = nan((M, I), dtype)
    skinny_linear.silu(lib, out, x, w, norm_weight=nw, eps=EPS)
    check("skinny_silu", out, TORCH.silu_and_mul(reference(x, w, nw=nw)))


# ---------------------------------------------------------------------------------------------
# residual

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("N,K", [(2048, 2048), (2048, 8192), (4096, 14336), (4096, 4096), (64, 64), (32, 2144)])
def test_skinny_residual(lib, gen, dtype, M, N, K):
    x, w = randn(M, K, dtype=dtype), weight(N, K, dtype)
    start = randn(M, N, dtype=dtype, scale=4.0)
    residual = start.clone()
    skinny_linear.residual(lib, residual, x, w)
    check("skinny_residual", residual, start.float() + reference(x, w))
    # One rounding of (residual + fp32 accumulators), the accumulators of the f32 kernel.
    acc = nan((M, N), torch.float32)
    skinny_linear.store(lib, acc, x, w)
    assert torch.equal(residual, (start.float() + acc).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 17, 32])
def test_skinny_residual_is_deterministic(lib, gen, dtype, M):
    N, K = 4096, 14336
    x, w = randn(M, K, dtype=dtype), weight(N, K, dtype)
    start = randn(M, N, dtype=dtype, scale=4.0)
    outs = []
    for _ in range(3):
        residual = start.clone()
        skinny_linear.residual(lib, residual, x, w)
        outs.append(residual)
    for residual in outs[1:]:
        assert torch.equal(residual, outs[0])


# ---------------------------------------------------------------------------------------------
# rope_kv (fused QKV projection + RoPE + KV-cache write)

ROPE_CONFIGS = [  # H, Hkv, D, K, bias, norm
    (32, 8, 64, 2048, False, True),    # Llama-3.2-1B
    (32, 8, 128, 4096, False, True),   # Llama-3.1-8B
    (4, 2, 64, 128, True, True),       # q/k/v bias (Qwen2)
    (4, 2, 16, 64, True, False),
    (2, 1, 16, 96, False, False),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", TOKENS)
@pytest.mark.parametrize("H,Hkv,D,K,with_bias,with_norm", ROPE_CONFIGS)
def test_skinny_rope_kv(lib, gen, dtype, M, H, Hkv, D, K, with_bias, with_norm):
    N, bs = (H + 2 * Hkv) * D, 16
    x, nw = norm_inputs(M, K, dtype)
    w = weight(N, K, dtype)
    bias = randn(N, dtype=dtype) if with_bias else None
    norm_args = (nw if with_norm else None,)
    cos_sin = rope_table(4096, D)
    rope_index = torch.randint(0, 4096, (M,), device=dev())
    num_blocks = -(-M // bs) + 3
    flat = num_blocks * bs
    slots = torch.randperm(flat, device=dev())[:M]
    if M >= 3:
        slots[1::3] = -1  # these tokens write no cache entry
    valid = slots >= 0
    k_cache, v_cache = nan((num_blocks, bs, Hkv, D), dtype), nan((num_blocks, bs, Hkv, D), dtype)
    q_out = nan((M, H, D), dtype)
    skinny_linear.rope_kv(lib, q_out, x, w, bias, *norm_args, cos_sin, rope_index, k_cache, v_cache, slots, H, Hkv, EPS)

    # fp32 oracle; the skipped tokens write to a scratch block of the reference caches instead.
    qkv = reference(x, w, bias, nw if with_norm else None)
    q, k, v = qkv[:, :H * D].view(M, H, D), qkv[:, H * D:(H + Hkv) * D].view(M, Hkv, D), qkv[:, (H + Hkv) * D:]
    ref_slots = torch.where(valid, slots, flat + torch.arange(M, device=dev()))
    ref_blocks = -(-(flat + M) // bs)
    k_ref = torch.zeros((ref_blocks, bs, Hkv, D), device=dev())
    v_ref = torch.zeros_like(k_ref)
    q_ref = TORCH.rope_cache_write(q, k, v.reshape(M, Hkv, D), cos_sin, rope_index, k_ref, v_ref, ref_slots)
    check("skinny_rope_q", q_out, q_ref)
    kc, vc = k_cache.view(flat, Hkv, D), v_cache.view(flat, Hkv, D)
    written = slots[valid]
    if written.numel():
        check("skinny_rope_k_cache", kc[written], k_ref.view(-1, Hkv, D)[written])
        check("skinny_rope_v_cache", vc[written], v_ref.view(-1, Hkv, D)[written])
    untouched = torch.ones(flat, dtype=torch.bool, device=dev())
    untouched[written] = False
    assert torch.isnan(kc[untouched]).all(), "a k write outside slot_mapping (or for a negative slot)"
    assert torch.isnan(vc[untouched]).all(), "a v write outside slot_mapping (or for a negative slot)"

    # Bit for bit: the same dot products through skinny_store (same k split and order; only the row's
    # place in the tensor-core tile differs), then the torch op on the rounded qkv (rope_cache_write.cu's
    # numerics equal torch's eager ops exactly).
    qkv_t = nan((M, N), dtype)
    skinny_linear.store(lib, qkv_t, x, w, bias, *norm_args, eps=EPS)
    qt, kt, vt = (qkv_t[:, :H * D].view(M, H, D), qkv_t[:, H * D:(H + Hkv) * D].view(M, Hkv, D),
                  qkv_t[:, (H + Hkv) * D:].view(M, Hkv, D))
    k_same = torch.zeros((ref_blocks, bs, Hkv, D), dtype=dtype, device=dev())
    v_same = torch.zeros_like(k_same)
    q_same = TORCH.rope_cache_write(qt, kt, vt, cos_sin, rope_index, k_same, v_same, ref_slots)
    assert torch.equal(q_out, q_same)
    if written.numel():
        assert torch.equal(kc[written], k_same.view(-1, Hkv, D)[written])
        assert torch.equal(vc[written], v_same.view(-1, Hkv, D)[written])


# ---------------------------------------------------------------------------------------------
# CUDA graphs

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [3, 32])
def test_residual_then_norm_store_replay_in_a_cuda_graph(lib, gen, dtype, M):
    """skinny_residual (o_proj: residual += a @ Wo^T) followed by skinny_store with the NORM prologue on
    the updated residual: captured once, replayed with fresh inputs; equals eager."""
    hidden, inter = 2048, 1024
    w_o, w_next = weight(hidden, hidden, dtype), weight(inter, hidden, dtype)
    nw = (1 + 0.1 * randn(hidden)).to(dtype)
    a = randn(M, hidden, dtype=dtype)
    start = randn(M, hidden, dtype=dtype, scale=4.0)
    residual = start.clone()
    out = nan((M, inter), dtype)

    def forward():
        residual.copy_(start)
        skinny_linear.residual(lib, residual, a, w_o)
        skinny_linear.store(lib, out, residual, w_next, norm_weight=nw, eps=EPS)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graph requires
        forward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for step in range(4):
        a.copy_(randn(M, hidden, dtype=dtype))
        start.copy_(randn(M, hidden, dtype=dtype, scale=4.0))
        forward()
        eager = (residual.clone(), out.clone())
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for name, e, g in zip(("residual", "out"), eager, (residual, out)):
            assert torch.equal(e, g), f"step {step}: graph {name} differs from eager"
    ref_res = start.float() + reference(a, w_o)
    check("graph_residual", residual, ref_res)
    check("graph_norm_store", out, reference(residual, w_next, nw=nw))


# ---------------------------------------------------------------------------------------------
# Argument checks

def test_skinny_wrappers_refuse_bad_arguments(lib):
    from engine.cuda.driver import KernelArgError
    bf, M, N, K = torch.bfloat16, 4, 64, 128
    x, w = randn(M, K, dtype=bf), randn(N, K, dtype=bf)
    out = nan((M, N), bf)
    with pytest.raises(KernelArgError, match="dtype"):
        skinny_linear.store(lib, out, x, w.half())
    with pytest.raises(KernelArgError, match="at most 32"):
        skinny_linear.store(lib, nan((33, N), bf), randn(33, K, dtype=bf), w)
    with pytest.raises(KernelArgError, match="multiple of 32"):
        skinny_linear.store(lib, out, randn(M, 48, dtype=bf), randn(N, 48, dtype=bf))
    with pytest.raises(KernelArgError, match="16-row tiles"):
        skinny_linear.store(lib, nan((M, 40), bf), x, randn(40, K, dtype=bf))
    with pytest.raises(KernelArgError, match="does not match"):
        skinny_linear.store(lib, out, x, randn(N, 2 * K, dtype=bf))
    with pytest.raises(KernelArgError, match="shape"):
        skinny_linear.store(lib, nan((M, N + 16), bf), x, w)
    with pytest.raises(KernelArgError, match="contiguous"):
        skinny_linear.store(lib, out, randn(K, M, dtype=bf).t(), w)
    with pytest.raises(KernelArgError, match="norm_weight"):
        skinny_linear.store(lib, out, x, w, norm_weight=randn(K + 8, dtype=bf))
    with pytest.raises(KernelArgError, match="overlap"):
        skinny_linear.store(lib, x, x, randn(K, K, dtype=bf))
    with pytest.raises(KernelArgError, match="dtype"):
        skinny_linear.silu(lib, nan((M, N // 2), torch.float32), x, w)
    with pytest.raises(KernelArgError, match="16-row tiles"):
        skinny_linear.silu(lib, nan((M, 12), bf), x, randn(24, K, dtype=bf))
    with pytest.raises(KernelArgError, match="shape"):
        skinny_linear.residual(lib, randn(M, N + 16, dtype=bf), x, w)
    with pytest.raises(KernelArgError, match="overlap"):
        skinny_linear.residual(lib, x, x, randn(K, K, dtype=bf))
    # rope_kv: head_dim 8 (not a multiple of 16), and a weight that is not (H + 2 Hkv) heads.
    H, Hkv, D = 2, 1, 8
    caches = nan((4, 16, Hkv, D), bf), nan((4, 16, Hkv, D), bf)
    idx = torch.zeros(M, dtype=torch.int64, device=dev())
    with pytest.raises(KernelArgError, match="16-row tiles"):
        skinny_linear.rope_kv(lib, nan((M, H, D), bf), x, randn((H + 2 * Hkv) * D, K, dtype=bf), None, None,
                              rope_table(16, D), idx, *caches, idx, H, Hkv)
    with pytest.raises(KernelArgError, match="not"):
        skinny_linear.rope_kv(lib, nan((M, H, 16), bf), x, randn(82, K, dtype=bf), None, None,
                              rope_table(16, 16), idx, *caches, idx, H, Hkv)
    # M == 0 launches nothing.
    skinny_linear.store(lib, nan((0, N), bf), randn(0, K, dtype=bf), w)
