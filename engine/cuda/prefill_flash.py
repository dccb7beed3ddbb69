"""Prefill attention of long forwards through FlashAttention's variable-length entry (torch's vendored
FlashAttention 2, `aten._flash_attention_forward`): prefill_fused takes it (where env.PREFILL_ATTENTION says so, or
cuDNN refused a shape) for eager forwards of at least FUSED_MIN_TOKENS prompt tokens, fresh prompts and chunks that
continue a cached prefix alike. Every
sequence's keys are gathered from the paged cache into one packed K and V (plan's index, made once per
forward), and one call attends every sequence: no padding, no output scatter.

Why this entry: its causal mask is aligned to each sequence's last key (query i of a sequence with n_q queries and
n_k keys sees keys up to n_k - n_q + i), which is exactly a chunk after a cached prefix; GQA is native (K/V keep
their heads); and it plans nothing per shape (cuDNN's fused attention plans every new shape and aligns its causal mask
to the first key: prefill_cudnn). Its block-table entry
wants pages of 256 tokens, so the keys are gathered rather than read in place."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.device import upload
from engine.ops.torch_ops import kv_rows

@dataclass
class FlashPlan:
    """One varlen call: sequence b's queries are rows cu_q[b]..cu_q[b+1] of q, its keys rows cu_k[b]..cu_k[b+1]
    of the gathered K/V, whose cache rows kv_index holds. The forward's pad rows (after the last sequence's
    queries) are one more sequence attending to as many copies of a real key, so the call's output covers
    every row of q and is the output."""

    cu_q: torch.Tensor  # int32 [B + 1 (+ 1 with pad rows)]
    cu_k: torch.Tensor  # int32, same length
    max_q: int
    max_k: int
    kv_index: torch.Tensor  # int64 [cu_k[-1]]: flat cache row of each gathered key


def plan(query_start_loc: tuple, seq_lens: tuple, num_rows: int, block_tables: torch.Tensor,
               block_size: int) -> FlashPlan:
    """The plan of a forward whose sequence b has queries query_start_loc[b]..query_start_loc[b+1] (the last of
    its seq_lens[b] keys) in a q of num_rows rows. Index arithmetic in numpy, one upload."""
    lens = np.asarray(seq_lens, dtype=np.int64)
    q_starts = np.asarray(query_start_loc, dtype=np.int64)
    k_starts = np.concatenate(([0], np.cumsum(lens)))
    seq = np.repeat(np.arange(len(lens)), lens)
    pos = np.arange(k_starts[-1]) - np.repeat(k_starts[:-1], lens)
    pad = num_rows - int(q_starts[-1])
    if pad > 0:  # the pad rows' sequence: keys that repeat sequence 0's first key
        q_starts = np.append(q_starts, num_rows)
        k_starts = np.append(k_starts, k_starts[-1] + pad)
        seq = np.concatenate((seq, np.zeros(pad, np.int64)))
        pos = np.concatenate((pos, np.zeros(pad, np.int64)))
    parts = [q_starts, k_starts, seq, pos]
    cu_q, cu_k, seq_t, pos_t = upload(np.concatenate(parts), block_tables.device).split(
        [len(a) for a in parts])
    kv_index = block_tables[seq_t, pos_t // block_size].long() * block_size + pos_t % block_size
    return FlashPlan(cu_q.to(torch.int32), cu_k.to(torch.int32), int(np.diff(q_starts).max(initial=0)),
                     int(np.diff(k_starts).max(initial=0)), kv_index)


def attend(plan: FlashPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Causal attention of every sequence of the plan, [T, H, D] like q. An E4M3 cache's keys are gathered as
    bytes and converted to q's dtype (exact) for the call."""
    num_kv_heads, head_dim = k_cache.shape[2:]
    k, v = (kv_rows(cache.view(-1, num_kv_heads, head_dim), plan.kv_index).to(q.dtype) for cache in (k_cache, v_cache))
    return torch.ops.aten._flash_attention_forward(q, k, v, plan.cu_q, plan.cu_k, plan.max_q, plan.max_k, 0.0, True,
                                                   False, scale=scale)[0]
