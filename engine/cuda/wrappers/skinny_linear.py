"""Skinny linear layers for decode (kernels_cu/skinny_linear.cu): y = x @ weight^T for 1..32 tokens, reading
the weight once, with the neighbouring elementwise ops fused. With norm_weight (the NORM prologue), x is the
raw residual stream and the result is that of rms_norm(x, norm_weight, eps). One kernel per epilogue x dtype
x weight storage x token bucket x block width.

Every function takes the weight as a 16-bit tensor in x's dtype or as a per-channel engine.quant.Fp8Weight
(E4M3 data [N, K], one fp32 scale per row; at most FP8_MAX_M tokens): the _fp8 kernels convert the weight to x's
dtype in registers and scale each row's fp32 accumulator before the epilogue (engine.quant.fp8_linear's
arithmetic)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import dtype_suffix, expect_shape, kv_suffix, overlaps, rope_operands, tensor_arg
from engine.cuda.driver import KernelArgError
from engine.quant import FP8_DTYPE, Fp8Weight, Weight

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


SKINNY_MAX_M = 32
SKINNY_M_BUCKETS = (8, 16, 32)  # _m8 / _m16 / _m32: 1, 2 or 4 tensor-core n-tiles of 8 tokens
SKINNY_TILE = 16  # weight rows per block (one m16n8k16 A tile)
SKINNY_WARPS, SKINNY_WIDE_WARPS = 8, 16  # warps per block: two blocks per SM, or one (entry suffix _w16)
SKINNY_FP8_WARPS = 4  # E4M3 weights, up to 8 tokens, grids past one wave of 8-warp blocks: 4-warp blocks (_w4)
SKINNY_BLOCKS_PER_SM = 2  # 8-warp blocks an SM holds (__launch_bounds__(256, 2))
SKINNY_K_ALIGN = 32  # K elements per warp step
FP8_MAX_M = SKINNY_MAX_M  # the E4M3-weight kernels exist for every bucket (CudaOps: up to 8 tokens, 32 weight-only)
SKINNY_EPILOGUE_ARGS = {
    "store": "ppppp" + "iii" + "f",     # out, x, w, bias, norm_w, M, N, K, eps
    "f32": "ppppp" + "iii" + "f",       # the same, fp32 out
    "silu": "pppp" + "iii" + "f",       # out, x, w, norm_w, M, I, K, eps
    "residual": "ppp" + "iii",          # residual, x, w, M, N, K
    "rope_kv": "p" * 10 + "iiiii" + "f",  # q_out, x, w, bias, norm_w, cos_sin, rope_index, k_cache, v_cache,
                                          # slot_mapping, M, H, Hkv, D, K, eps
    "rope_kvfp8": "p" * 10 + "iiiii" + "f",  # the same into E4M3 caches (--kv-cache-dtype fp8)
}
# The E4M3-weight entries (skinny_<ep>_<dt>_fp8_m<bucket>[_w16]): the same with the weight's scale [N] fp32 after w.
SKINNY_FP8_EPILOGUE_ARGS = {ep: args[:3] + "p" + args[3:] for ep, args in SKINNY_EPILOGUE_ARGS.items()}
# W8A8 (skinny_<ep>_bf16_w8a8_m<bucket>[_w16], sm_89+): the same with x E4M3 and its scale [M] fp32 after x.
SKINNY_W8A8_EPILOGUE_ARGS = {ep: args[:2] + "p" + args[2:] for ep, args in SKINNY_FP8_EPILOGUE_ARGS.items()}


WIDTH_SUFFIX = {SKINNY_WIDE_WARPS: "_w16", SKINNY_WARPS: "", SKINNY_FP8_WARPS: "_w4"}  # entry suffix by warps


def m_bucket(num_tokens: int) -> int:
    """The token bucket (kernel suffix _m8 / _m16 / _m32) of a skinny launch: the smallest that holds M."""
    for bucket in SKINNY_M_BUCKETS:
        if num_tokens <= bucket:
            return bucket
    raise KernelArgError(f"skinny linear: {num_tokens} tokens; the kernels take at most {SKINNY_MAX_M}")


def _rows(weight: Weight) -> int:
    """N of a weight [N, K] (0 if it is not 2-D: _inputs reports it)."""
    return weight.shape[0] if len(weight.shape) == 2 else 0


def _weight(what: str, x: torch.Tensor, weight: Weight) -> tuple[str, tuple[int, ...], torch.Tensor]:
    """Checks a 16-bit weight (x's dtype) or a per-channel Fp8Weight. Returns (kernel suffix after the dtype:
    "" or "_fp8", the weight's kernel pointers: (w,) or (w, w_scale), the weight's data tensor)."""
    if not isinstance(weight, Fp8Weight):
        return "", (tensor_arg(weight, f"{what} weight", x.dtype, 2),), weight
    if not weight.per_channel:
        raise KernelArgError(f"{what}: the FP8 kernels take per-channel scales; this weight has "
                             f"{weight.block[0]}x{weight.block[1]} blocks")
    wp = tensor_arg(weight.data, f"{what} weight", FP8_DTYPE, 2)
    sp = tensor_arg(weight.scale, f"{what} weight scale", torch.float32, 2, align=False)
    if x.shape[0] > FP8_MAX_M:
        raise KernelArgError(f"{what}: {x.shape[0]} tokens; the FP8-weight kernels take at most {FP8_MAX_M}")
    return "_fp8", (wp, sp), weight.data


def _activations(what: str, x: torch.Tensor, x_scale: torch.Tensor | None, weight: Weight,
                 norm_weight: torch.Tensor | None) -> tuple[str, tuple[int, ...], torch.dtype]:
    """Checks x: 16-bit, or (W8A8: x_scale given) E4M3 rows with their fp32 scales [M, 1] and a per-channel
    Fp8Weight, no norm_weight. Returns (the kernel suffix's dtype part: "bf16" / "fp16" / "bf16" + "_w8a8" after
    the weight's part is dropped, the x pointers: (x,) or (x, x_scale), the dtype of the kernel's 16-bit values)."""
    if x_scale is None:
        return dtype_suffix(x.dtype, f"{what} x"), (tensor_arg(x, f"{what} x", x.dtype, 2),), x.dtype
    if not isinstance(weight, Fp8Weight) or not weight.per_channel:
        raise KernelArgError(f"{what}: W8A8 (an E4M3 x with x_scale) needs a per-channel Fp8Weight")
    if norm_weight is not None:
        raise KernelArgError(f"{what}: W8A8 takes x normalized before its quantization (no norm_weight)")
    xp = tensor_arg(x, f"{what} x", FP8_DTYPE, 2)
    xs = tensor_arg(x_scale, f"{what} x_scale", torch.float32, 2, align=False)
    expect_shape(x_scale, f"{what} x_scale", (x.shape[0], 1))
    return "bf16_w8a8", (xp, xs), torch.bfloat16


def _inputs(what: str, x: torch.Tensor, weight: Weight, norm_weight: torch.Tensor | None,
            pair_span: int, x_scale: torch.Tensor | None = None) -> tuple:
    """Checks x [M, K] (16-bit, or E4M3 with x_scale: W8A8), weight [N, K] (16-bit or a per-channel Fp8Weight) and
    norm_weight [K]; pair_span = the distance the epilogue pairs rows over times 2 (N, 2 I or head_dim):
    N % pair_span == 0 and pair_span % 16 == 0. Returns (suffix, M, N, K, (x pointers), (weight pointers),
    norm_weight, weight data, the dtype of the 16-bit values: outputs, bias, norm) with pointers (0 = absent)."""
    sfx, xp, dtype = _activations(what, x, x_scale, weight, norm_weight)
    wsfx, wp, wdata = _weight(what, x, weight)
    if x_scale is not None:
        wsfx = ""  # _w8a8 names both E4M3s
    M, K = x.shape
    N = weight.shape[0]
    if weight.shape[1] != K:
        raise KernelArgError(f"{what}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)} "
                             f"(expected [N, {K}])")
    if K == 0 or K % SKINNY_K_ALIGN:
        raise KernelArgError(f"{what}: K = {K} must be a positive multiple of {SKINNY_K_ALIGN}")
    if N == 0 or pair_span <= 0 or pair_span % SKINNY_TILE or N % pair_span:
        raise KernelArgError(f"{what}: N = {N} rows cannot be cut into 16-row tiles of row pairs {pair_span // 2} "
                             f"apart (need N % {pair_span} == 0 and {pair_span} % 16 == 0)")
    if M > SKINNY_MAX_M:
        raise KernelArgError(f"{what}: {M} tokens; the skinny kernels take at most {SKINNY_MAX_M} (use a GEMM)")
    nw = 0
    if norm_weight is not None:
        nw = tensor_arg(norm_weight, f"{what} norm_weight", dtype, 1)
        expect_shape(norm_weight, f"{what} norm_weight", (K,))
    return sfx + wsfx, M, N, K, xp, wp, nw, wdata, dtype


def _output(out: torch.Tensor, what: str, dtype, shape: tuple, x: torch.Tensor, weight: torch.Tensor) -> int:
    ptr = tensor_arg(out, what, dtype, len(shape), align=False)
    expect_shape(out, what, shape)
    if out.numel() and (overlaps(out, x) or overlaps(out, weight)):
        raise KernelArgError(f"{what}: must not overlap x or the weight (other blocks still read them)")
    return ptr


def _bias(bias: torch.Tensor | None, what: str, dtype: torch.dtype, N: int) -> int:
    if bias is None:
        return 0
    ptr = tensor_arg(bias, f"{what} bias", dtype, 1, align=False)
    expect_shape(bias, f"{what} bias", (N,))
    return ptr


def _launch(lib: KernelLibrary, ep: str, sfx: str, M: int, N: int, *args) -> None:
    """One block per 16-row tile. A grid of at most lib.skinny_wide_tiles tiles (default: one per SM) gets
    16-warp blocks, so each SM has as many weight loads in flight as two 8-warp blocks would give it. E4M3 weights
    up to 8 tokens on grids past one wave of 8-warp blocks (lib.skinny_fp8_wave_tiles: two an SM) get
    lib.skinny_fp8_warps (4: four 4-warp blocks an SM, each warp streaming as many load groups as an 8-warp block's
    do over a 16-bit tile twice the bytes, and one wave holding twice the tiles). On grids of one wave 4-warp blocks
    would halve the SMs' warps: 8B o and down (256 tiles) took 9.05 / 24.20 us on them against 8.21 / 22.15 on
    8-warp ones, qkv (384 tiles) 11.71 against 13.38 and the LM head 181.9 against 189.1 (H100, bench/RESULTS.md).

    The residual epilogue (o_proj after attention, down after gate_up) on 8-warp blocks launches without
    programmatic dependent launch: its blocks, started early, sat on the SMs the kernel before still needed,
    and an 8B step at batch 8 or at an 8k context took 25-30% longer with it (bench/RESULTS.md, PDL verdicts).
    On 16-warp blocks (the 1B's o_proj and down) early launch is a measured gain and stays."""
    tiles = N // SKINNY_TILE
    wide = tiles <= lib.skinny_wide_tiles
    warps = SKINNY_WIDE_WARPS if wide else SKINNY_WARPS
    if not wide and sfx.endswith("_fp8") and M <= 8 and tiles > lib.skinny_fp8_wave_tiles:
        warps = lib.skinny_fp8_warps
    lib.kernels[f"skinny_{ep}_{sfx}_m{m_bucket(M)}{WIDTH_SUFFIX[warps]}"](
        (tiles, 1, 1), (32 * warps, 1, 1), 0, lib.stream(), *args, pdl=wide or ep != "residual")


def store(lib: KernelLibrary, out: torch.Tensor, x: torch.Tensor, weight: Weight,
          bias: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
          x_scale: torch.Tensor | None = None) -> None:
    """out [M, N] = x' @ weight^T (+ bias), x' = rms_norm(x, norm_weight, eps) or x; out in x's dtype, or
    fp32 (logits: no rounding). W8A8 (x_scale [M, 1] given: x E4M3 rows, fp8_quant.quantize_rows'): out bf16 =
    bf16(bf16((acc * x_scale) * w_scale) + bias), engine.quant.w8a8_linear then the bias, as fp8_projection."""
    sfx, M, N, K, xp, wp, nw, wd, dt = _inputs("skinny_store", x, weight, norm_weight, _rows(weight), x_scale)
    ep = "f32" if out.dtype == torch.float32 else "store"
    o = _output(out, "skinny_store out", (dt, torch.float32), (M, N), x, wd)
    bp = _bias(bias, "skinny_store", dt, N)
    if M == 0:
        return
    _launch(lib, ep, sfx, M, N, o, *xp, *wp, bp, nw, M, N, K, float(eps))


def silu(lib: KernelLibrary, out: torch.Tensor, x: torch.Tensor, weight: Weight,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, x_scale: torch.Tensor | None = None) -> None:
    """The gated MLP's first half: weight = [gate | up] [2 I, K]; out [M, I] = silu(x' @ gate^T) * (x' @ up^T).
    W8A8 with x_scale (store's)."""
    sfx, M, N, K, xp, wp, nw, wd, dt = _inputs("skinny_silu", x, weight, norm_weight, _rows(weight), x_scale)
    I = N // 2
    o = _output(out, "skinny_silu out", dt, (M, I), x, wd)
    if M == 0:
        return
    _launch(lib, "silu", sfx, M, N, o, *xp, *wp, nw, M, I, K, float(eps))


def residual(lib: KernelLibrary, residual: torch.Tensor, x: torch.Tensor, weight: Weight,
             x_scale: torch.Tensor | None = None) -> None:
    """residual [M, N] += x @ weight^T in place (one rounding, as addmm with beta = 1). W8A8 with x_scale: the
    product rounded to bf16 first, then added (one more rounding: the W8A8 GEMM, then add_)."""
    sfx, M, N, K, xp, wp, _, wd, dt = _inputs("skinny_residual", x, weight, None, _rows(weight), x_scale)
    rp = _output(residual, "skinny_residual residual", dt, (M, N), x, wd)
    if M == 0:
        return
    _launch(lib, "residual", sfx, M, N, rp, *xp, *wp, M, N, K)


def rope_kv(lib: KernelLibrary, q_out: torch.Tensor, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None,
            norm_weight: torch.Tensor | None, cos_sin: torch.Tensor, rope_index: torch.Tensor,
            k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
            num_kv_heads: int, eps: float = 1e-6, x_scale: torch.Tensor | None = None) -> None:
    """The fused QKV projection: qkv = x' @ weight^T (+ bias) with weight = [q (H D rows) | k (Hkv D) | v (Hkv D)]
    and x' = rms_norm(x, norm_weight, eps) or x; q and k rotated (rotate-half) by cos_sin[rope_index];
    q -> q_out [M, H, D]; k and v -> the caches at slot_mapping (a negative slot skips the token's cache
    write). The caches are x's dtype or E4M3 (an FP8 KV cache: the rope_kvfp8 entries, which round each value to
    x's dtype and then to E4M3), whichever the weight (16-bit or FP8: skinny_rope_kvfp8_<dt>_fp8_m8 takes both
    E4M3s). W8A8 with x_scale (store's; bf16 values)."""
    H, Hkv = int(num_heads), int(num_kv_heads)
    N = _rows(weight)
    if H <= 0 or Hkv <= 0 or N % (H + 2 * Hkv):
        raise KernelArgError(f"skinny_rope_kv: weight {tuple(weight.shape)} is not [(H + 2 Hkv) D, K] for "
                             f"H = {H}, Hkv = {Hkv}")
    D = N // (H + 2 * Hkv)
    sfx, M, N, K, xp, wp, nw, wd, dt = _inputs("skinny_rope_kv", x, weight, norm_weight, D, x_scale)
    qo = _output(q_out, "skinny_rope_kv q_out", dt, (M, H, D), x, wd)
    bp = _bias(bias, "skinny_rope_kv", dt, N)
    cs, ri, sm, kc, vc = rope_operands(cos_sin, rope_index, slot_mapping, k_cache, v_cache, M, Hkv, D, dt)
    if M == 0:
        return
    ep = "rope_kvfp8" if kv_suffix(k_cache) else "rope_kv"
    _launch(lib, ep, sfx, M, N, qo, *xp, *wp, bp, nw, cs, ri, kc, vc, sm, M, H, Hkv, D, K, float(eps))
