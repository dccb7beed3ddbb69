"""Prefill attention of fresh prompts through torch's fused scaled_dot_product_attention (CudaOps.prefill_attention
takes it for forwards of at least SDPA_MIN_TOKENS prompt tokens): the keys gathered from the paged cache, sequences of
similar length padded into one call (sdpa_plan), each call's output scattered back (attend)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn.attention import sdpa_kernel

from engine.ops.torch_ops import kv_rows

SDPA_MIN_TOKENS = 2048  # forwards of fewer prompt tokens use the paged kernel (bench/profile_step.py --only ttft)
SDPA_BUCKET = 128  # fresh prompts are padded to a multiple of this for the fused attention call


@dataclass
class SdpaGroup:
    """One scaled_dot_product_attention call: num_seqs sequences padded to `length` keys each."""

    num_seqs: int
    length: int
    kv_index: torch.Tensor  # [num_seqs * length] flat KV-cache row of each (padded) position
    q_index: torch.Tensor | None  # [num_seqs * length] query row of each position; None: q itself
    real: torch.Tensor | None  # positions that are real tokens (indices into num_seqs * length)
    out_rows: torch.Tensor | None  # their rows in the output; None: the call's output is the output


def sdpa_plan(query_start_loc: tuple, seq_lens: tuple, block_tables: torch.Tensor, block_size: int) -> list:
    """The SdpaGroups of a forward of fresh prompts (query_start_loc[b] .. +seq_lens[b] are sequence b's
    tokens, all of its keys): sequences grouped by their length rounded up to SDPA_BUCKET; a padded
    position repeats the sequence's last key and query row (its output is dropped). Index arithmetic in
    numpy, one upload per padded group, once per forward."""
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(seq_lens):
        groups.setdefault(-(-n // SDPA_BUCKET) * SDPA_BUCKET, []).append(b)
    device = block_tables.device
    whole = len(groups) == 1 and all(n == next(iter(groups)) for n in seq_lens)
    if whole:  # one call, no padding: the output is the call's output in order; no upload
        num_seqs, length = len(seq_lens), seq_lens[0]
        seq = torch.arange(num_seqs, device=device).repeat_interleave(length)
        pos = torch.arange(length, device=device).repeat(num_seqs)
        return [SdpaGroup(num_seqs, length, _kv_index(block_tables, seq, pos, block_size), None, None, None)]
    plan = []
    starts, lens = np.asarray(query_start_loc[:-1]), np.asarray(seq_lens)
    for length, seqs in groups.items():
        seq = np.repeat(np.asarray(seqs), length)
        pos_all = np.tile(np.arange(length), len(seqs))
        pos = np.minimum(pos_all, lens[seq] - 1)
        real = np.flatnonzero(pos_all < lens[seq])
        q_index = starts[seq] + pos
        parts = [seq, pos, q_index, real, q_index[real]]
        seq_t, pos_t, q_t, real_t, rows_t = torch.from_numpy(np.concatenate(parts).astype(np.int64)).to(
            device).split([len(a) for a in parts])
        plan.append(SdpaGroup(len(seqs), length, _kv_index(block_tables, seq_t, pos_t, block_size), q_t, real_t,
                              rows_t))
    return plan


def _kv_index(block_tables: torch.Tensor, seq: torch.Tensor, pos: torch.Tensor, block_size: int) -> torch.Tensor:
    return block_tables[seq, pos // block_size].long() * block_size + pos % block_size


def attend(plan: list, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
           backends: list | None) -> torch.Tensor:
    """Sequences whose lengths round up to the same multiple of SDPA_BUCKET go through one causal
    scaled_dot_product_attention call (GQA), padded to that length, so sequences of different
    lengths share a call. Padding sits after each sequence's last key, so causal masking keeps it
    out of real rows. Pad tokens of the forward (rows after the last sequence) are left unset. An E4M3 cache's
    keys are gathered as bytes and converted to q's dtype (exact) for the call. backends: sdpa_kernel's (None:
    torch's choice)."""
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    out = torch.empty_like(q)
    for group in plan:
        n, length = group.num_seqs, group.length
        qg = (q[:n * length] if group.q_index is None else q[group.q_index]).view(
            n, length, num_heads, head_dim).transpose(1, 2)
        kg, vg = (kv_rows(flat, group.kv_index).to(q.dtype).view(n, length, num_kv_heads, head_dim)
                  .transpose(1, 2) for flat in (k_flat, v_flat))
        with (sdpa_kernel(backends) if backends else contextlib.nullcontext()):
            og = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=True, scale=scale,
                                                                  enable_gqa=num_heads != num_kv_heads)
        og = og.transpose(1, 2).reshape(n * length, num_heads, head_dim)
        if group.out_rows is None:  # the output in order; pad tokens (rows after it) stay unset
            if og.shape[0] == q.shape[0]:
                out = og
            else:
                out[:og.shape[0]] = og
        else:
            out[group.out_rows] = og[group.real]
    return out
