"""Paged prefill attention (kernels_cu/prefill_attention.cu): the queries of a forward's new tokens against
their sequences' cached keys, causal, from a work list of query tiles."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import attention_inputs, expect_shape, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


def smem_bytes(head_dim: int) -> int:
    """A 64-row q tile and two stages of 64-row K and V tiles (rows padded by 8 elements)."""
    return (64 + 2 * 2 * 64) * (head_dim + 8) * 2


def launch(lib: KernelLibrary, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, work: torch.Tensor, scale: float, sliding_window: int) -> None:
    """work [n, 4] int32 rows (b, first query token, rows <= 64, position of the first row)."""
    sfx, H, D, Hkv, qp, kc, vc = attention_inputs("prefill", q, k_cache, v_cache)
    T = q.shape[0]
    bt = tensor_arg(block_tables, "block_tables", torch.int32, 2, contiguous=False, align=False)
    if block_tables.stride(1) != 1:
        raise KernelArgError(f"block_tables: the column stride must be 1, got {block_tables.stride()}")
    wk = tensor_arg(work, "prefill work", torch.int32, 2)
    if work.shape[1] != 4:
        raise KernelArgError(f"prefill work: expected [n, 4], got {tuple(work.shape)}")
    o = tensor_arg(out, "prefill out", q.dtype)
    expect_shape(out, "prefill out", (T, H, D))
    if work.shape[0] == 0:
        return
    bs_log2 = k_cache.shape[1].bit_length() - 1
    lib.kernels[f"prefill_attention_{sfx}_d{D}"](
        (work.shape[0], H, 1), (128, 1, 1), smem_bytes(D), lib.stream(),
        o, qp, kc, vc, bt, wk, q.stride(0), block_tables.stride(0), H, Hkv, bs_log2, int(sliding_window or 0),
        float(scale) * math.log2(math.e))
