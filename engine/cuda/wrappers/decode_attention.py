"""Paged decode attention (kernels_cu/decode_attention.cu): one query token per sequence, GQA, split-K over
the keys, optionally with RoPE and the KV-cache write of the new token fused in; and the grid rules that size
its launch from host-known numbers only (so a captured launch replays while the contexts grow)."""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import attention_inputs, expect_shape, rope_operands, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


# Launch constants shared with kernels_cu/decode_attention.cu (its header comment states the same numbers).
DECODE_TILE = 64
DECODE_CLUSTER = 8  # the portable maximum cluster size
DECODE_THREADS = 128


def smem_bytes(head_dim: int, rope: bool = False, fp8_kv: bool = False, shallow: bool = False) -> int:
    """The q tile and 2-3 K and V tiles (rows padded by 8 elements; shallow, the _s2 entries: 2); the fused-RoPE
    entries (rope) also one cos / sin row (fp32). An E4M3 cache (fp8_kv, the _kvfp8 entries): 3-5 K and V tiles of
    E4M3 rows (head_dim bytes, + 16 where head_dim / 16 is even), and with rope the new token's k and v rows (16-bit)
    too."""
    stages = 2 if head_dim >= 128 or shallow else 3
    if fp8_kv:
        row = head_dim if head_dim % 32 else head_dim + 16
        extra = 2 * head_dim * 2 + head_dim * 4 if rope else 0
        return 16 * (head_dim + 8) * 2 + 2 * (2 * stages - 1) * DECODE_TILE * row + extra
    return (16 + 2 * stages * DECODE_TILE) * (head_dim + 8) * 2 + (head_dim * 4 if rope else 0)


def blocks_per_split(batch: int, num_heads: int, num_kv_heads: int) -> int:
    """Decode attention blocks per split: one per (sequence, KV head, chunk of 16 query heads)."""
    return batch * num_kv_heads * -(-(num_heads // num_kv_heads) // 16)


def blocks_per_sm(lib: KernelLibrary, head_dim: int, fp8_kv: bool = False) -> int:
    """Decode attention blocks one SM holds at once (the library's occupancy figure for the entry)."""
    return (lib.decode_blocks_per_sm_kvfp8 if fp8_kv else lib.decode_blocks_per_sm)[head_dim]


def key_splits(lib: KernelLibrary, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
               max_seq_len: int, fp8_kv: bool = False) -> int:
    """Key splits of decode attention: enough blocks for about two per SM, but no more than the GPU
    holds at once (a second wave would double the step's attention time: 1B at batch 32 has 256
    (sequence, KV head) blocks, and two splits of each would not fit the 396 an H200 holds), and at
    most one split per 64-token tile of max_seq_len. A pure function of host-known sizes (graph-safe).
    fp8_kv: for the E4M3-cache entries (their own occupancy)."""
    blocks = blocks_per_split(batch, num_heads, num_kv_heads)
    max_tiles = max(1, -(-max_seq_len // DECODE_TILE))
    one_wave = blocks_per_sm(lib, head_dim, fp8_kv) * lib.num_sms // blocks
    return cluster_splits(lib, max(1, min(-(-2 * lib.num_sms // blocks), one_wave, max_tiles, lib.decode_max_splits)))


def cluster_splits(lib: KernelLibrary, splits: int) -> int:
    """splits as a launch takes them: as they are up to one cluster, else rounded down to a multiple of it."""
    return splits if splits <= lib.decode_cluster else splits // lib.decode_cluster * lib.decode_cluster


def fits_one_wave(lib: KernelLibrary, batch: int, num_heads: int, num_kv_heads: int, head_dim: int,
                  max_seq_len: int, fp8_kv: bool = False) -> bool:
    """Whether every block of a decode attention launch (key_splits splits) is resident at once."""
    blocks = blocks_per_split(batch, num_heads, num_kv_heads)
    splits = key_splits(lib, batch, num_heads, num_kv_heads, head_dim, max_seq_len, fp8_kv)
    return blocks * splits <= blocks_per_sm(lib, head_dim, fp8_kv) * lib.num_sms


def shallow_entry(lib: KernelLibrary, grid_blocks: int, head_dim: int, rope: bool, fp8_kv: bool) -> bool:
    """Whether a launch of grid_blocks blocks takes the _s2 entry (2-deep 16-bit tiles, head_dim < 128, no fused
    RoPE): when the default entry's grid needs more than one wave. The shallower blocks take less shared memory, so
    an SM holds more of them (head_dim 64: 5 against 3), which shortens a grid of many short blocks (1B at batch 256
    and context 128: 2,048 blocks of one or two tiles); a grid of one wave keeps the deeper pipeline (1B at batch
    1 and a 32k context: 1.49 -> 1.71 ms a step with 2-deep tiles, H100, bench/RESULTS.md)."""
    return (lib.decode_shallow and head_dim < 128 and not rope and not fp8_kv
            and grid_blocks > blocks_per_sm(lib, head_dim) * lib.num_sms)


# The warp entries (decode_attention_*_d128_w): one warp per (sequence, KV head, head chunk), persistent, each warp
# streaming its items' 16-key tiles through its own ring of shared memory (kernels_cu/decode_attention.cu). Head_dim
# 128 only: the same kernel at 64 lost to the _s2 entries at batch 64 and 256 with 2k contexts (bench/RESULTS.md).
WARP_HEAD_DIMS = (128,)
WARP_WARPS = 4  # DW_WARPS
WARP_KEYS = 16  # DW_KEYS


WARP_STAGES = 3  # WarpCfg::STAGES: two tiles of each warp in flight


def warp_smem_bytes(head_dim: int) -> int:
    """Every warp's ring: stages of 16 K rows and 16 V rows, each padded by 8 elements (16-bit)."""
    return WARP_WARPS * WARP_STAGES * 2 * WARP_KEYS * (head_dim + 8) * 2


def warp_entry(lib: KernelLibrary, grid_blocks: int, num_splits: int, head_dim: int, rope: bool,
               fp8_kv: bool) -> bool:
    """Whether a launch takes the warp entry: one split, a 16-bit cache, no fused RoPE, head_dim 128 where the
    device holds the entry's block (not Ada's 99 KiB), and a default grid of more than one wave (batch 64-256 at the
    8B's heads: 3-9% a step on an H100)."""
    return (lib.decode_warp and num_splits == 1 and head_dim in WARP_HEAD_DIMS and not rope and not fp8_kv
            and lib.decode_warp_blocks_per_sm[head_dim] > 0
            and grid_blocks > blocks_per_sm(lib, head_dim) * lib.num_sms)


def warp_grid(lib: KernelLibrary, items: int, head_dim: int) -> int:
    """Blocks of a warp-entry launch over `items` items: as many items to each warp as the resident warps need, and
    no more warps than that takes (so no warp has a second item while another has none)."""
    resident = lib.decode_warp_blocks_per_sm[head_dim] * lib.num_sms * WARP_WARPS
    per_warp = -(-items // resident)
    warps = -(-items // per_warp)
    return max(1, -(-warps // WARP_WARPS))


def cluster_size(lib: KernelLibrary, num_splits: int) -> int:
    """The cluster size of a decode attention launch of num_splits splits (1: none): all the splits when
    they fit in one cluster, else lib.decode_cluster (key_splits makes them a multiple of it)."""
    if lib.decode_cluster <= 1 or num_splits <= 1:
        return 1
    return num_splits if num_splits <= lib.decode_cluster else lib.decode_cluster


def launch(lib: KernelLibrary, out: torch.Tensor, part_o: torch.Tensor | None, part_lse: torch.Tensor | None,
           counters: torch.Tensor, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float, sliding_window: int,
           num_splits: int, cluster: int | None = None,
           rope: tuple[torch.Tensor, ...] | None = None, pdl: bool = True,
           fresh: int = -1) -> None:
    """cluster: the launch's cluster size (None: cluster_size(lib, num_splits); 1: no clusters, the
    splits always merge through global memory). pdl=False: no programmatic dependent launch for this
    call even when the library's pdl is on. fresh >= 0 (with pdl): the caller promises that the launch
    right before wrote none of seq_lens, block_tables, rope's index and slots, and no cache row of a
    position < seq_len - fresh, so the kernel reads those before it waits for that launch
    (kernels_cu/decode_attention.cu); -1: nothing before the wait.
    rope = (k, v, cos_sin, rope_index, slot_mapping): q is unrotated and the new token's k and v
    ([B, Hkv, D] views with contiguous heads, one batch stride) are not in the cache yet: the kernel
    applies rope_cache_write itself (same bits), so that op's launch goes away.
    The caches are q's dtype or E4M3 (an FP8 KV cache: the _kvfp8 entries; num_splits from key_splits(...,
    fp8_kv=True) then)."""
    sfx, H, D, Hkv, qp, kc, vc, kv = attention_inputs("decode", q, k_cache, v_cache)
    B = q.shape[0]
    bt = tensor_arg(block_tables, "block_tables", torch.int32, 2, contiguous=False, align=False)
    if block_tables.stride(1) != 1 or block_tables.shape[0] != B:
        raise KernelArgError(f"block_tables: expected [{B}, max_blocks] with unit column stride, got shape "
                             f"{tuple(block_tables.shape)} strides {block_tables.stride()}")
    sl = tensor_arg(seq_lens, "seq_lens", torch.int32, 1, align=False)
    expect_shape(seq_lens, "seq_lens", (B,))
    o = tensor_arg(out, "decode out", q.dtype)
    expect_shape(out, "decode out", (B, H, D))
    head_chunks = -(-(H // Hkv) // 16)
    po = pl = ct = 0
    if num_splits > 1:
        po = tensor_arg(part_o, "decode part_o", torch.float32)
        pl = tensor_arg(part_lse, "decode part_lse", torch.float32, align=False)
        expect_shape(part_o, "decode part_o", (B, H, num_splits, D))
        expect_shape(part_lse, "decode part_lse", (B, H, num_splits))
        ct = tensor_arg(counters, "decode counters", torch.int32, 1, align=False)
        if counters.shape[0] < B * Hkv * head_chunks:
            raise KernelArgError(f"decode counters: {counters.shape[0]} tickets for {B * Hkv * head_chunks} "
                                 f"(batch x KV heads x head chunks)")
    if B == 0:
        return
    rp = (0, 0, 0, 0, 0, 0)
    if rope is not None:
        k_new, v_new, cos_sin, rope_index, slot_mapping = rope
        for t, name in ((k_new, "decode rope k"), (v_new, "decode rope v")):
            if t.dim() != 3 or tuple(t.shape) != (B, Hkv, D) or t.stride(2) != 1 or t.stride(1) != D:
                raise KernelArgError(f"{name}: expected [{B}, {Hkv}, {D}] with contiguous heads, got shape "
                                     f"{tuple(t.shape)} strides {t.stride()}")
        if k_new.stride(0) != v_new.stride(0) or k_new.stride(0) % 8:
            raise KernelArgError(f"decode rope k / v: one batch stride, a multiple of 8, got {k_new.stride(0)} "
                                 f"and {v_new.stride(0)}")
        cs, ri, sm, _, _ = rope_operands(cos_sin, rope_index, slot_mapping, k_cache, v_cache, B, Hkv, D,
                                         q.dtype)
        rp = (tensor_arg(k_new, "decode rope k", q.dtype, contiguous=False),
              tensor_arg(v_new, "decode rope v", q.dtype, contiguous=False), k_new.stride(0), cs, ri, sm)
    bs_log2 = k_cache.shape[1].bit_length() - 1
    cluster = cluster_size(lib, num_splits) if cluster is None else cluster
    if cluster > 1 and (num_splits % cluster or cluster > lib.decode_cluster):
        raise KernelArgError(f"decode attention: clusters of {cluster} for {num_splits} splits (at most "
                             f"{lib.decode_cluster} on this device, dividing the splits)")
    fused = rope is not None
    if warp_entry(lib, num_splits * Hkv * head_chunks * B, num_splits, D, fused, bool(kv)):
        lib.kernels[f"decode_attention_{sfx}_d{D}_w"](
            (warp_grid(lib, Hkv * head_chunks * B, D), 1, 1), (WARP_WARPS * 32, 1, 1), warp_smem_bytes(D),
            lib.stream(), o, qp, kc, vc, bt, sl, q.stride(0), block_tables.stride(0), H, Hkv, head_chunks, bs_log2,
            int(sliding_window or 0), float(scale) * math.log2(math.e), B, pdl=pdl)
        return
    shallow = shallow_entry(lib, num_splits * Hkv * head_chunks * B, D, fused, bool(kv))
    lib.kernels[f"decode_attention_{'rope_' if fused else ''}{sfx}_d{D}{kv}{'_s2' if shallow else ''}"](
        (num_splits, Hkv * head_chunks, B), (DECODE_THREADS, 1, 1), smem_bytes(D, fused, bool(kv), shallow),
        lib.stream(),
        o, po, pl, ct, qp, kc, vc, bt, sl, q.stride(0), block_tables.stride(0), H, Hkv, head_chunks, bs_log2,
        num_splits, int(sliding_window or 0), float(scale) * math.log2(math.e), cluster, *rp,
        int(fresh) if pdl and lib.pdl else -1, cluster=cluster, pdl=pdl)
