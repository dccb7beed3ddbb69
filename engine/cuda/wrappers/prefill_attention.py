"""Paged prefill attention (kernels_cu/prefill_attention.cu): the queries of a forward's new tokens against
their sequences' cached keys, causal, from a work list of query tiles; split over the keys (then merged) when
the (work item, head) grid is too small for the GPU and the keys are many: a chunk that continues a long
cached prefix."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine.batch import prefill_rows
from engine.cuda.checks import attention_inputs, expect_shape, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


MAX_SPLITS = 16  # PA_MAX_SPLITS of the .cu file
MERGE_ROWS = 16  # query rows per merge block (PA_MERGE_ROWS)
MIN_SPLIT_TILES = 4  # a key split covers at least this many 64-key tiles


def key_splits(lib: KernelLibrary, num_work: int, num_heads: int, max_kv_len: int, head_dim: int,
               fp8_kv: bool = False) -> int:
    """Key splits of a forward of num_work work items (of a head each) whose rows see at most max_kv_len keys:
    as many as one wave of blocks holds (the kernel's occupancy times the SMs, over num_work x num_heads blocks),
    each split at least MIN_SPLIT_TILES key tiles; 1 when the keys are few or the grid fills the GPU already.
    A block walks its share of the key tiles one after another, latency-bound: the most splits that still run
    at once make the shortest chains, and a second wave would double them. A function of host-known sizes that
    the tile count enters only through the MIN_SPLIT_TILES cap, so a graphed forward (its max_kv_len rounded up)
    and the same forward run eagerly split alike for long keys (a replayed graph keeps its capture's splits).
    num_work: the real work items (at most: a staged list's empty rows do not count, they return at once), of
    prefill_rows(head_dim) rows each (engine.batch.prefill_work at the same head_dim): blocks are counted per item,
    and lib.prefill_blocks_per_sm is the occupancy of blocks of that many rows."""
    tiles = -(-max(0, max_kv_len) // 64)
    blocks = max(1, num_work) * num_heads
    one_wave = max(1, lib.prefill_blocks_per_sm[(head_dim, fp8_kv)]) * lib.num_sms // blocks
    return max(1, min(MAX_SPLITS, one_wave, tiles // MIN_SPLIT_TILES))


def smem_bytes(head_dim: int, fp8_kv: bool = False) -> int:
    """A q tile of a work item's prefill_rows(head_dim) rows and two stages of 64-row K and V tiles (rows padded by
    8 elements); an E4M3 cache (fp8_kv): one 16-bit K and V tile, and two stages of E4M3 ones (head_dim bytes a
    row)."""
    q_rows = prefill_rows(head_dim)
    if fp8_kv:
        return (q_rows + 2 * 64) * (head_dim + 8) * 2 + 2 * 2 * 64 * head_dim
    return (q_rows + 2 * 2 * 64) * (head_dim + 8) * 2


def launch(lib: KernelLibrary, out: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, work: torch.Tensor, scale: float, sliding_window: int, splits: int = 1) -> None:
    """work [n, 4] int32 rows (b, first query token, rows <= prefill_rows(head_dim), position of the first row:
    engine.batch.prefill_work at q's head_dim). splits > 1: each work item's keys in that many shares (fp32 partial
    outputs allocated here), then the merge kernel. The caches are q's dtype or E4M3 (an FP8 KV cache: the _kvfp8
    entry)."""
    sfx, H, D, Hkv, qp, kc, vc, kv = attention_inputs("prefill", q, k_cache, v_cache)
    T = q.shape[0]
    bt = tensor_arg(block_tables, "block_tables", torch.int32, 2, contiguous=False, align=False)
    if block_tables.stride(1) != 1:
        raise KernelArgError(f"block_tables: the column stride must be 1, got {block_tables.stride()}")
    wk = tensor_arg(work, "prefill work", torch.int32, 2)
    if work.shape[1] != 4:
        raise KernelArgError(f"prefill work: expected [n, 4], got {tuple(work.shape)}")
    o = tensor_arg(out, "prefill out", q.dtype)
    expect_shape(out, "prefill out", (T, H, D))
    if not 1 <= splits <= MAX_SPLITS:
        raise KernelArgError(f"prefill attention: splits must be in [1, {MAX_SPLITS}], got {splits}")
    if work.shape[0] == 0:
        return
    part_o = part_ml = None
    if splits > 1:
        part_o = torch.empty((splits, T, H, D), dtype=torch.float32, device=q.device)
        part_ml = torch.empty((splits, T, H, 2), dtype=torch.float32, device=q.device)
    bs_log2 = k_cache.shape[1].bit_length() - 1
    lib.kernels[f"prefill_attention_{sfx}_d{D}{kv}"](
        (work.shape[0], H, splits), (128, 1, 1), smem_bytes(D, fp8_kv=bool(kv)), lib.stream(),
        o, qp, kc, vc, bt, wk, q.stride(0), block_tables.stride(0), H, Hkv, bs_log2, int(sliding_window or 0),
        float(scale) * math.log2(math.e), part_o.data_ptr() if part_o is not None else 0,
        part_ml.data_ptr() if part_ml is not None else 0, T)
    if splits > 1:
        lib.kernels[f"prefill_attention_merge_{sfx}_d{D}"](
            (work.shape[0], H, prefill_rows(D) // MERGE_ROWS), (128, 1, 1), 0, lib.stream(), o, part_o.data_ptr(),
            part_ml.data_ptr(), wk, T, H, splits)
