"""The fused decode layer (kernels_cu/decode_layer.cu, KernelLibrary.decode_layer) against the separate
skinny kernels it fuses, bit for bit, and against an fp32 torch oracle.

The fused kernel sums every tile's k split over 16 warps exactly as the 16-warp skinny kernels do (the
same chunks per warp, the same accumulator chains, the warps added in the same order), so o_proj +
residual, norm + gate_up + SiLU, down + residual and the next projection (norm + QKV + RoPE + KV write,
or norm + fp32 logits) run one after another through skinny_residual / skinny_silu / skinny_rope_kv /
skinny_store with 16-warp blocks must give the same bits. The oracle (fp32 torch, the model's
composition through TorchOps) bounds the relative error of the result. Outputs are NaN-filled, so an
element left unwritten fails; repeated launches check the grid barrier's counter across launches.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.ops.torch_ops import TorchOps
from gpu.helpers import dev, nan, randn

pytestmark = pytest.mark.gpu

EPS = 1e-5
TORCH = TorchOps()

# (hidden, q_size, I, H, Hkv, D): Llama-3.2-1B, Llama-3.1-8B, a small one, and one whose K is not a
# multiple of a full group of chunks (16 warps x 4 chunks x 32 = 2048: 2144 and 1056 leave partial groups).
SHAPES = {
    "1b": (2048, 2048, 8192, 32, 8, 64),
    "8b": (4096, 4096, 14336, 32, 8, 128),
    "small": (256, 256, 512, 4, 2, 64),
    "partial": (2144, 1024, 1056, 8, 4, 128),
}


@pytest.fixture
def wide(lib):
    """The separate skinny kernels with 16-warp blocks (the fused kernel's k split)."""
    saved = lib.skinny_wide_tiles
    lib.skinny_wide_tiles = 1 << 30
    yield
    lib.skinny_wide_tiles = saved


def layer_inputs(hidden, q_size, I, dtype):
    s = lambda k: k ** -0.5  # noqa: E731 - unit-variance outputs for unit-variance inputs
    return {
        "o_proj": randn(hidden, q_size, dtype=dtype, scale=s(q_size)),
        "post_norm": (1 + 0.1 * randn(hidden)).to(dtype),
        "gate_up": randn(2 * I, hidden, dtype=dtype, scale=s(hidden)),
        "down": randn(hidden, I, dtype=dtype, scale=s(I)),
    }


def separate(lib, h, attn, w, eps, nxt=None):
    """The unfused path: the skinny kernels one after another (h updated in place); returns the next
    projection's output or None."""
    lib.skinny_residual(h, attn, w["o_proj"])
    act = nan((h.shape[0], w["gate_up"].shape[0] // 2), h.dtype)
    lib.skinny_silu(act, h, w["gate_up"], w["post_norm"], eps)
    lib.skinny_residual(h, act, w["down"])
    if nxt is None:
        return None
    kind, weight, bias, norm, out, rope = nxt
    if kind == "rope_kv":
        cos_sin, rope_index, k_cache, v_cache, slots, H, Hkv = rope
        lib.skinny_rope_kv(out, h, weight, bias, norm, cos_sin, rope_index, k_cache, v_cache, slots, H, Hkv, eps)
    else:
        lib.skinny_store(out, h, weight, None, norm, eps)
    return out


def oracle(h, attn, w, eps):
    """fp32 torch of the layer tail on the same operands (the residual kept in fp32)."""
    hf = h.float() + F.linear(attn.float(), w["o_proj"].float())
    x = TORCH.rms_norm(hf, w["post_norm"].float(), eps)
    gu = F.linear(x, w["gate_up"].float())
    g, u = gu.chunk(2, dim=-1)
    return hf + F.linear(F.silu(g) * u, w["down"].float())


def rel_err(out, ref) -> float:
    out64, ref64 = out.double(), ref.double()
    return ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()


def rope_table(P: int, D: int) -> torch.Tensor:
    freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev(), dtype=torch.float32) / D))
    angles = torch.arange(P, device=dev(), dtype=torch.float32)[:, None] * freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M", [1, 3, 8])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("next_kind", [None, "rope_kv", "f32"])
def test_decode_layer_matches_the_separate_kernels(lib, gen, wide, dtype, M, shape, next_kind):
    if lib.decode_layer_grid is None:
        pytest.fail("the fused decode layer does not fit this GPU")
    hidden, q_size, I, H, Hkv, D = SHAPES[shape]
    w = layer_inputs(hidden, q_size, I, dtype)
    h0 = randn(M, hidden, dtype=dtype, scale=3.0)
    attn = randn(M, q_size, dtype=dtype)
    nxt_fused = nxt_sep = None
    if next_kind == "rope_kv":
        N, bs = (H + 2 * Hkv) * D, 16
        weight = randn(N, hidden, dtype=dtype, scale=hidden ** -0.5)
        bias = randn(N, dtype=dtype) if shape == "small" else None  # Qwen2's q/k/v bias
        norm = (1 + 0.1 * randn(hidden)).to(dtype)
        cos_sin = rope_table(4096, D)
        rope_index = torch.randint(0, 4096, (M,), device=dev())
        num_blocks = -(-M // bs) + 2
        slots = torch.randperm(num_blocks * bs, device=dev())[:M]
        if M >= 3:
            slots[1] = -1  # no cache write for this token
        caches = [nan((num_blocks, bs, Hkv, D), dtype) for _ in range(4)]
        nxt_fused = ("rope_kv", weight, bias, norm, nan((M, H, D), dtype),
                     (cos_sin, rope_index, caches[0], caches[1], slots, H, Hkv))
        nxt_sep = ("rope_kv", weight, bias, norm, nan((M, H, D), dtype),
                   (cos_sin, rope_index, caches[2], caches[3], slots, H, Hkv))
    elif next_kind == "f32":
        V = 4096 if shape != "1b" else 128256
        weight = randn(V, hidden, dtype=dtype, scale=hidden ** -0.5)
        norm = (1 + 0.1 * randn(hidden)).to(dtype)
        nxt_fused = ("f32", weight, None, norm, nan((M, V), torch.float32), None)
        nxt_sep = ("f32", weight, None, norm, nan((M, V), torch.float32), None)

    h_sep = h0.clone()
    out_sep = separate(lib, h_sep, attn, w, EPS, nxt_sep)
    for launch in range(3):  # the grid barrier's counter carries over from launch to launch
        h = h0.clone()
        kw = {}
        if nxt_fused is not None:
            kind, weight, bias, norm, out, rope = nxt_fused
            out.fill_(float("nan"))
            kw = dict(next_kind=kind, next_out=out, next_weight=weight, next_bias=bias, next_norm=norm, rope=rope)
        lib.decode_layer(h, attn, w["o_proj"], w["post_norm"], w["gate_up"], w["down"], EPS, **kw)
        torch.cuda.synchronize()
        assert torch.equal(h, h_sep), f"launch {launch}: the residual differs from the separate kernels"
        if nxt_fused is not None:
            out = nxt_fused[4]
            assert not torch.isnan(out).any(), "an element of the next projection left unwritten"
            assert torch.equal(out, out_sep), f"launch {launch}: the next projection differs"
        if next_kind == "rope_kv":
            written = nxt_fused[5][4] >= 0
            for fused, sep in ((nxt_fused[5][2], nxt_sep[5][2]), (nxt_fused[5][3], nxt_sep[5][3])):
                f, s = fused.view(-1, Hkv, D), sep.view(-1, Hkv, D)
                slots = nxt_fused[5][4]
                assert torch.equal(f[slots[written]], s[slots[written]]), "the KV write differs"
                untouched = torch.ones(f.shape[0], dtype=torch.bool, device=dev())
                untouched[slots[written]] = False
                assert torch.isnan(f[untouched]).all(), "a cache write outside slot_mapping"
    err = rel_err(h, oracle(h0, attn, w, EPS))
    assert err <= 1e-2, f"residual: relative error {err:.3e} against fp32 torch"


def test_decode_layer_rejects_bad_operands(lib, gen):
    hidden, q_size, I = 256, 256, 512
    w = layer_inputs(hidden, q_size, I, torch.bfloat16)
    h = randn(9, hidden, dtype=torch.bfloat16)
    attn = randn(9, q_size, dtype=torch.bfloat16)
    from engine.cuda.kernels import KernelArgError
    with pytest.raises(KernelArgError, match="at most 8"):
        lib.decode_layer(h, attn, w["o_proj"], w["post_norm"], w["gate_up"], w["down"], EPS)
    with pytest.raises(KernelArgError, match="next_kind"):
        lib.decode_layer(h[:2], attn[:2], w["o_proj"], w["post_norm"], w["gate_up"], w["down"], EPS,
                         next_kind="bogus")
    with pytest.raises(KernelArgError, match="rows"):
        lib.decode_layer(h[:2], attn[:2], w["o_proj"][:128], w["post_norm"], w["gate_up"], w["down"], EPS)
