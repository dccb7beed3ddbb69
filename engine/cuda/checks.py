"""Argument checks shared by the launch wrappers (engine/cuda/wrappers/): cheap (attribute reads only, never a
device read), each raising KernelArgError with a message that names the argument. The per-tensor ones return
the tensor's pointer, as the kernels take it."""
from __future__ import annotations

import torch

from engine.cuda.driver import KernelArgError
from engine.quant import FP8_DTYPE

DTYPE_SUFFIX = {torch.bfloat16: "bf16", torch.float16: "fp16"}
KV_FP8_SUFFIX = "_kvfp8"  # the entries that read / write an E4M3 KV cache (--kv-cache-dtype fp8)
ATTENTION_HEAD_DIMS = (16, 32, 64, 80, 96, 128)  # any multiple of 16 up to 128 could be added


def tensor_arg(t: torch.Tensor, what: str, dtype: torch.dtype | tuple, ndim: int | None = None,
               contiguous: bool = True, align: bool = True, host_mapped: bool = False) -> int:
    """The pointer of a kernel argument, after checking it. host_mapped: a pinned host tensor will do too
    (unified addressing maps pinned memory into the device's address space at the same address)."""
    if not isinstance(t, torch.Tensor):
        raise KernelArgError(f"{what}: expected a tensor, got {type(t).__name__}")
    if not (t.is_cuda or (host_mapped and t.is_pinned())):
        raise KernelArgError(f"{what}: expected a CUDA tensor" + (f" or a pinned host one, got one on {t.device}"
                             " (not pinned)" if host_mapped else f", got one on {t.device}"))
    ok = t.dtype == dtype if isinstance(dtype, torch.dtype) else t.dtype in dtype
    if not ok:
        raise KernelArgError(f"{what}: expected dtype {dtype}, got {t.dtype}")
    if ndim is not None and t.dim() != ndim:
        raise KernelArgError(f"{what}: expected {ndim} dims, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise KernelArgError(f"{what}: must be contiguous (shape {tuple(t.shape)}, strides {t.stride()})")
    ptr = t.data_ptr()
    if align and ptr & 15:
        raise KernelArgError(f"{what}: data must be 16-byte aligned (address {ptr:#x})")
    return ptr


def expect_shape(t: torch.Tensor, what: str, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise KernelArgError(f"{what}: expected shape {tuple(shape)}, got {tuple(t.shape)}")


def dtype_suffix(dtype: torch.dtype, what: str) -> str:
    try:
        return DTYPE_SUFFIX[dtype]
    except KeyError:
        raise KernelArgError(f"{what}: the CUDA kernels take bfloat16 or float16 activations, got {dtype} "
                             f"(use TorchOps for float32)") from None


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the memory of two contiguous tensors overlaps."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()


def cache_dtype(k_cache: torch.Tensor, dtype: torch.dtype) -> torch.dtype:
    """The dtype the paged K and V caches of a kernel with `dtype` activations must both have: `dtype`, or E4M3 (an
    FP8 KV cache, engine/quant.py fp8_kv) when k_cache holds E4M3."""
    return FP8_DTYPE if isinstance(k_cache, torch.Tensor) and k_cache.dtype == FP8_DTYPE else dtype


def kv_suffix(k_cache: torch.Tensor) -> str:
    """The entry-name suffix of the kernels for this cache: KV_FP8_SUFFIX for E4M3, "" for a 16-bit cache."""
    return KV_FP8_SUFFIX if k_cache.dtype == FP8_DTYPE else ""


def kv_cache_arg(cache: torch.Tensor, what: str, dtype: torch.dtype, num_kv_heads: int, head_dim: int) -> int:
    """A paged K or V cache [num_blocks, block_size (a power of two), num_kv_heads, head_dim] of `dtype`."""
    ptr = tensor_arg(cache, what, dtype, 4)
    if cache.shape[2] != num_kv_heads or cache.shape[3] != head_dim:
        raise KernelArgError(f"{what}: expected [num_blocks, block_size, {num_kv_heads}, {head_dim}], got "
                             f"{tuple(cache.shape)}")
    bs = cache.shape[1]
    if bs <= 0 or bs & (bs - 1):
        raise KernelArgError(f"{what}: block_size {bs} must be a power of two")
    return ptr


def rope_operands(cos_sin: torch.Tensor, rope_index: torch.Tensor, slot_mapping: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, T: int, Hkv: int, D: int,
                  dtype: torch.dtype) -> tuple[int, int, int, int, int]:
    """Checks what RoPE with a KV-cache write reads besides q/k/v (rope_cache_write, and the same fused into
    decode attention and the skinny QKV kernel): cos_sin [P, D] fp32, rope_index and slot_mapping [T] int64,
    the two caches (both `dtype`, or both E4M3). Returns their pointers."""
    cs = tensor_arg(cos_sin, "cos_sin", torch.float32, 2)
    if cos_sin.shape[1] != D:
        raise KernelArgError(f"cos_sin: expected [P, {D}], got {tuple(cos_sin.shape)}")
    ri = tensor_arg(rope_index, "rope_index", torch.int64, 1, align=False)
    sm = tensor_arg(slot_mapping, "slot_mapping", torch.int64, 1, align=False)
    if rope_index.shape[0] != T or slot_mapping.shape[0] != T:
        raise KernelArgError(f"rope_index / slot_mapping: expected [{T}], got {tuple(rope_index.shape)} / "
                             f"{tuple(slot_mapping.shape)}")
    kv_dtype = cache_dtype(k_cache, dtype)
    kc = kv_cache_arg(k_cache, "k_cache", kv_dtype, Hkv, D)
    vc = kv_cache_arg(v_cache, "v_cache", kv_dtype, Hkv, D)
    expect_shape(v_cache, "v_cache", k_cache.shape)
    return cs, ri, sm, kc, vc


def attention_inputs(what: str, q: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor) -> tuple[str, int, int, int, int, int, int, str]:
    """Checks q [*, H, D] (contiguous heads) and the paged caches of decode / prefill attention
    (what = "decode" / "prefill"), both q's dtype or both E4M3. Returns (dtype suffix, H, D, Hkv, q, k_cache,
    v_cache pointers, kv_suffix)."""
    sfx = dtype_suffix(q.dtype, f"{what} q")
    if q.dim() != 3 or q.stride(2) != 1 or q.stride(1) != q.shape[2] or q.stride(0) % 8:
        rows = "B" if what == "decode" else "T"
        raise KernelArgError(f"{what} q: expected [{rows}, H, D] with contiguous heads, got shape "
                             f"{tuple(q.shape)} strides {q.stride()}")
    H, D = q.shape[1:]
    if D not in ATTENTION_HEAD_DIMS:
        raise KernelArgError(f"{what} attention: head_dim {D} is not one of {ATTENTION_HEAD_DIMS}")
    Hkv = k_cache.shape[2] if k_cache.dim() == 4 else -1
    if Hkv <= 0 or H % Hkv:
        raise KernelArgError(f"{what} attention: {H} query heads and k_cache {tuple(k_cache.shape)}")
    qp = tensor_arg(q, f"{what} q", q.dtype, contiguous=False)
    kv_dtype = cache_dtype(k_cache, q.dtype)
    kc = kv_cache_arg(k_cache, "k_cache", kv_dtype, Hkv, D)
    vc = kv_cache_arg(v_cache, "v_cache", kv_dtype, Hkv, D)
    expect_shape(v_cache, "v_cache", k_cache.shape)
    return sfx, H, D, Hkv, qp, kc, vc, kv_suffix(k_cache)
