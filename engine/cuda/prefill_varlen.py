"""Prefill attention of graphed forwards of fresh prompts (every sequence starts at position 0) through FlashAttention's
variable-length entry (torch's vendored FlashAttention 2, `aten._flash_attention_forward` with cumulative sequence
lengths) on the forward's own rows, in place of the paged kernel of kernels_cu/prefill_attention.cu, when the forward's
longest prompt has MIN_SEQ_TOKENS or more (env.PREFILL_GRAPH_ATTENTION "flash", the default; "paged" turns it off).

Why it can replay from a CUDA graph: a fresh forward's keys are its own rows, so the call's shapes are the graph's
(the padded token count T as both bounds max_q and max_k, its padded sequence rows S): only the sequence starts
(cu_seqlens, int32 [S + 1] on the device, staged per forward: engine/batch.py PrefillStaging) change between
replays. Sequence rows past the real ones are empty (their starts repeat the last), and the forward's pad rows, after
the last sequence, are attended by none and left unset (row-wise ops after attention keep them apart); the entry's
blocks past a sequence's length exit at once (a 300-token sequence under a 4096 bound: 31 us, against 30 us under
its own bound; bench/varlen_probe.py). The keys and values are read back from the cache rows the forward just wrote
(slot_mapping; pad rows' -1 read row 0, unused) so that the cache stays the one source of K/V, FP8 caches included
(E4M3 converted to q's dtype: exact, scale 1). The causal mask is aligned to each sequence's last key, which for a
fresh prompt is its first query's diagonal. GQA as it is: the K/V keep their heads.

Measured and left out: cuDNN's variable-length entry (`aten._cudnn_attention_forward` with cum_seq_q / cum_seq_k,
torch 2.11 on an H100): right values, but ~40 ms of a call at every shape (8 x 512 to 1 x 4096, against 0.03-0.5 ms
for FlashAttention's), and its capture invalidates the graph (bench/RESULTS.md, "Kernel benchmarks")."""
from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from engine import env
from engine.ops.torch_ops import kv_rows

log = logging.getLogger(__name__)

# Graphed fresh forwards whose longest prompt has at least this many tokens take this route. The paged kernel's cost
# grows with the longest sequence (its work items near the end walk every key tile before them), the entry's
# less: in the engine (1B, H200, warm_up_cost) the entry made 1 x 2048 prompts 1.05x and 1 x 4096 1.15x faster, tied
# at 8 x 512 and lost 2.6% at 4 x 1024 (bench/RESULTS.md).
MIN_SEQ_TOKENS = 2048


def takes(longest: int, sliding_window: int, head_dim: int) -> bool:
    """Whether a graphed forward of fresh prompts whose longest has `longest` tokens runs its attention here
    (env.PREFILL_GRAPH_ATTENTION "flash", read per call): no sliding window that would cut its keys, and a head_dim
    the entry takes."""
    return (env.PREFILL_GRAPH_ATTENTION == "flash" and longest >= MIN_SEQ_TOKENS
            and (not sliding_window or longest <= sliding_window) and head_dim % 8 == 0 and head_dim <= 256)


def attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
           cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of a fresh forward's rows q [T, H, D] (sequence b: rows cu_seqlens[b] .. cu_seqlens[b + 1])
    over their own keys, read from the cache rows slot_mapping [T] names; [T, H, D] like q, the rows after
    cu_seqlens[-1] unset. Device ops only (capturable)."""
    num_kv_heads, head_dim = k_cache.shape[-2:]
    rows = slot_mapping.clamp(min=0)
    k, v = (kv_rows(cache.view(-1, num_kv_heads, head_dim), rows).to(q.dtype) for cache in (k_cache, v_cache))
    bound = q.shape[0]
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_seqlens, cu_seqlens, bound, bound, 0.0, True, False,
                                                   scale=scale)[0]


class VarlenPrefill:
    """CudaOps' side of the route: whether a forward takes it, and the call, which falls back to the paged kernel
    for good the first time the entry refuses a forward (a RuntimeError: a dtype or shape it does not take)."""

    def __init__(self):
        self.refused = False

    def takes(self, longest: int, sliding_window: int, head_dim: int) -> bool:
        return not self.refused and takes(longest, sliding_window, head_dim)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 cu_seqlens: torch.Tensor, scale: float, paged: Callable[[], torch.Tensor]) -> torch.Tensor:
        """attend(), or paged() (the paged kernel on the forward's staged work list) once the entry has refused."""
        if not self.refused:
            try:
                return attend(q, k_cache, v_cache, slot_mapping, cu_seqlens, scale)
            except RuntimeError as e:
                log.warning("FlashAttention's variable-length entry refused a prefill (%s); graphed prefills use the "
                            "paged kernel from now on", str(e).splitlines()[0][:200])
                self.refused = True
        return paged()
