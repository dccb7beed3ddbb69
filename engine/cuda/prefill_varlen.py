"""Prefill attention of graphed forwards of fresh prompts (every sequence starts at position 0) through cuDNN's
variable-length fused attention (`aten._cudnn_attention_forward` with cumulative sequence lengths: the entry torch's
nested tensors use; FlashAttention-3-class kernels on Hopper), in place of the paged kernel of
kernels_cu/prefill_attention.cu, which runs such forwards at 100-190 TFLOP/s (bench/RESULTS.md, "Kernel benchmarks").

Why it can replay from a CUDA graph: a fresh forward's keys are its own rows, so the call's shapes are the graph's
(the padded token count T as both bounds max_q and max_k, its padded sequence rows S): only the sequence starts
(cu_seqlens, int32 [S + 1] on the device, staged per forward: engine/batch.py PrefillStaging) change between
replays. Sequence rows past the real ones are empty (their starts repeat the last), and the forward's pad rows, after
the last sequence, are attended by none and left unset (row-wise ops after attention keep them apart). The keys and
values are read back from the cache rows the forward just wrote (slot_mapping; pad rows' -1 read row 0, unused) so that
the cache stays the one source of K/V, FP8 caches included (E4M3 converted to q's dtype: exact, scale 1). The causal
mask is aligned to the first key, which for a fresh prompt is its last key too. GQA as it is: the K/V keep their heads.

cuDNN plans each new shape once (~45 ms of host time, bench/RESULTS.md): the first, eager run of a graph's shape
(engine/cuda/dispatch.py run_shape captures at the second) pays it, in the warm-up for the bucketed shapes."""
from __future__ import annotations

import torch

from engine import env
from engine.ops.torch_ops import kv_rows

# Graphed fresh forwards of at least this many padded tokens take this route (shorter ones keep the paged kernel,
# whose single launch costs less than the gathers and the call where there is little attention to do).
MIN_TOKENS = 1024


def takes(num_tokens: int, sliding_window: int, head_dim: int) -> bool:
    """Whether a graphed forward of fresh prompts padded to num_tokens runs its attention here (env.PREFILL_GRAPH_ATTENTION
    "cudnn", read per call): no sliding window that would cut its keys, and a head_dim cuDNN's fused kernels take."""
    return (env.PREFILL_GRAPH_ATTENTION == "cudnn" and num_tokens >= MIN_TOKENS
            and (not sliding_window or num_tokens <= sliding_window) and head_dim in (64, 128))


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
           cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a fresh forward's rows q [T, H, D] (sequence b: rows cu_seqlens[b] .. cu_seqlens[b + 1])
    over their own keys, read from the cache rows slot_mapping [T] names; [T, H, D] like q, the rows after
    cu_seqlens[-1] unset. Device ops only (capturable)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    rows = slot_mapping.clamp(min=0)
    k, v = (kv_rows(cache.view(-1, num_kv_heads, head_dim), rows).to(q.dtype) for cache in (k_cache, v_cache))
    bound = q.shape[0]
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_seqlens, cu_seqlens, bound, bound, False, 0.0,
                                                   True, False, scale=scale)[0]
