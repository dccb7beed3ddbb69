"""RoPE fused with the KV-cache write (kernels_cu/rope_cache_write.cu): q rotated into q_out, k rotated and v
written into the paged caches at slot_mapping (16-bit caches, or E4M3 ones: the _kvfp8 entries)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import dtype_suffix, expect_shape, kv_suffix, rope_operands, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


def launch(lib: KernelLibrary, q_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           cos_sin: torch.Tensor, rope_index: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    sfx = dtype_suffix(q.dtype, "rope q")
    T, H, D = q.shape
    Hkv = k.shape[1]
    for t, name, heads in ((q, "rope q", H), (k, "rope k", Hkv), (v, "rope v", Hkv)):
        if t.dim() != 3 or t.shape[0] != T or t.shape[1] != heads or t.shape[2] != D:
            raise KernelArgError(f"{name}: expected [{T}, {heads}, {D}], got {tuple(t.shape)}")
        if t.stride(2) != 1 or t.stride(1) != D or t.stride(0) % 8:
            raise KernelArgError(f"{name}: heads must be contiguous (strides [*, {D}, 1], token stride a "
                                 f"multiple of 8), got {t.stride()}")
    qp = tensor_arg(q, "rope q", q.dtype, contiguous=False)
    kp = tensor_arg(k, "rope k", q.dtype, contiguous=False)
    vp = tensor_arg(v, "rope v", q.dtype, contiguous=False)
    qo = tensor_arg(q_out, "rope q_out", q.dtype)
    expect_shape(q_out, "rope q_out", (T, H, D))
    cs, ri, sm, kc, vc = rope_operands(cos_sin, rope_index, slot_mapping, k_cache, v_cache, T, Hkv, D,
                                       q.dtype)
    if D % 8:
        raise KernelArgError(f"rope: head_dim {D} must be a multiple of 8")
    if T == 0:
        return
    vec = 8 if D % 16 == 0 else 4
    lib.kernels[f"rope_cache_write_{sfx}_v{vec}{kv_suffix(k_cache)}"]((T, 1, 1), (128, 1, 1), 0, lib.stream(),
                                                  qo, qp, kp, vp, cs, ri, kc, vc, sm,
                                                  q.stride(0), k.stride(0), v.stride(0), H, Hkv, D)
