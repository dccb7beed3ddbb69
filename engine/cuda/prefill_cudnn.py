"""Prefill attention of long forwards through cuDNN's fused attention (`aten._scaled_dot_product_cudnn_attention`,
FlashAttention-3-class kernels on Hopper: 1.5-1.9x torch's FlashAttention 2 at long prompts, bench/RESULTS.md "Kernel
benchmarks"). prefill_fused takes it, where env.PREFILL_ATTENTION says so, for the long eager forwards with a
sequence of CUDNN_MIN_KEYS keys or more.

Two properties of cuDNN's entry shape this module. Its causal mask is aligned to the first key, and it plans every
new shape once (the plan then cached by torch). So sequence b's attention, n_q queries at the end of its n_k keys (a
cached prefix of P = n_k - n_q keys before them), is cut at P' = P rounded down to PREFIX_BUCKET:
  - a square causal block of S x S: the keys [P', P' + S), the P - P' prefix keys among them brought in by as many
    dummy queries before the real ones (query row P - P' + i is real query i, at position P + i, and so sees exactly
    keys up to P + i), S = P - P' + n_q rounded up to SQUARE_BUCKET (pad queries and keys after the real ones, which
    no real query sees);
  - while P' > 0, the same S queries against the keys [0, P') unmasked;
merged by their log-sum-exps. The shapes, (S, S) causal and (S, P') unmasked, come from bounded sets (S a multiple
of SQUARE_BUCKET up to max_prefill_tokens + PREFIX_BUCKET, P' a multiple of PREFIX_BUCKET), so the planning is paid
once per bucket pair, not per prompt length. K and V are gathered from the paged cache and keep their heads (the
entry takes GQA as it is)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from engine.device import upload
from engine.ops.torch_ops import kv_rows

SQUARE_BUCKET = 256  # the causal block's side is a multiple of this
PREFIX_BUCKET = 1024  # the unmasked prefix part's key count is a multiple of this


@dataclass
class CudnnGroup:
    """The sequences of one shape (side S, prefix cut P'), attended by one call per part with a batch of them:
    their block rows of q (q_index [B * S]: dummy and pad rows repeat a real one; None: the S rows of q from q0 on,
    one sequence), the cache rows of the square blocks' keys (sq_index [B * S]) and of the unmasked prefixes
    (pre_index [B * P'], None: P' = 0), and which block rows are real (real [n], into B * S) with their rows of q
    (out_rows [n]; None: the block is q0 .. q0 + n)."""

    num_seqs: int
    side: int
    q0: int
    q_index: torch.Tensor | None
    sq_index: torch.Tensor
    pre_index: torch.Tensor | None
    real: torch.Tensor | None
    out_rows: torch.Tensor | None


def plan(query_start_loc: tuple, seq_lens: tuple, num_rows: int, block_tables: torch.Tensor,
               block_size: int) -> list[CudnnGroup]:
    """The plan of a forward whose sequence b has queries query_start_loc[b] .. query_start_loc[b + 1] (the last of
    its seq_lens[b] keys) in a q of num_rows rows: its sequences grouped by shape. Index arithmetic in numpy, one
    upload per group."""
    shapes: dict[tuple[int, int], list[int]] = {}
    for b, n_k in enumerate(seq_lens):
        n_q = query_start_loc[b + 1] - query_start_loc[b]
        cut = (n_k - n_q) // PREFIX_BUCKET * PREFIX_BUCKET
        shapes.setdefault((-(-(n_k - n_q - cut + n_q) // SQUARE_BUCKET) * SQUARE_BUCKET, cut), []).append(b)
    plan = []
    for (side, cut), seqs in shapes.items():
        q_rows, key_pos, real, out_rows = [], [], [], []
        for i, b in enumerate(seqs):
            q0, n_k = query_start_loc[b], seq_lens[b]
            n_q = query_start_loc[b + 1] - q0
            extra = n_k - n_q - cut
            q_rows.append(np.clip(np.arange(side) - extra, 0, n_q - 1) + q0)
            key_pos.append(np.minimum(np.arange(cut, cut + side), n_k - 1))
            real.append(np.arange(extra, extra + n_q) + i * side)
            out_rows.append(np.arange(q0, q0 + n_q))
        q0 = query_start_loc[seqs[0]]
        whole = len(seqs) == 1 and len(real[0]) == side  # no dummy or pad rows: the block is q's rows from q0 on
        sq_pos = np.concatenate(key_pos)
        pre_pos = np.tile(np.arange(cut), len(seqs))
        seq_of = np.concatenate((np.repeat(np.asarray(seqs), side), np.repeat(np.asarray(seqs), cut)))
        parts = [seq_of, np.concatenate((sq_pos, pre_pos))]
        if not whole:
            parts += [np.concatenate(q_rows), np.concatenate(real), np.concatenate(out_rows)]
        uploaded = upload(np.concatenate(parts).astype(np.int64), block_tables.device).split(
            [len(x) for x in parts])
        seq_t, pos_t = uploaded[:2]
        rows = block_tables[seq_t, pos_t // block_size].long() * block_size + pos_t % block_size
        n_sq = len(seqs) * side
        plan.append(CudnnGroup(len(seqs), side, q0, None if whole else uploaded[2], rows[:n_sq],
                               rows[n_sq:] if cut else None, None if whole else uploaded[3],
                               None if whole else uploaded[4]))
    return plan


def _heads(kv: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[B * L, Hkv, D] gathered keys -> a [B, Hkv, L, D] view (the entry serves each KV head's group of query heads
    itself: GQA as it is)."""
    return kv.view(num_seqs, -1, *kv.shape[1:]).transpose(1, 2)


def cudnn_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, with_lse: bool,
                    scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cuDNN's fused attention of [B, H, Lq, D] queries over [B, Hkv, Lk, D] keys and values (views; causal: aligned to
    the first key): the output [B, H, Lq, D] and, with_lse, the natural-log log-sum-exps of the scaled scores ([B, H,
    Lq] elements)."""
    return torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, with_lse, 0.0, causal, False,
                                                              scale=scale)[:2]


def attend(plan: list[CudnnGroup], q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
           attention=cudnn_attention) -> torch.Tensor:
    """Causal attention of every sequence of the plan, [T, H, D] like q (rows after the last sequence's queries, the
    forward's pad rows, unset). An E4M3 cache's keys are gathered as bytes and converted to q's dtype (exact).
    attention: cudnn_attention's contract (a test passes torch math in its place)."""
    num_heads = q.shape[1]
    num_kv_heads, head_dim = k_cache.shape[2:]
    k_flat, v_flat = (cache.view(-1, num_kv_heads, head_dim) for cache in (k_cache, v_cache))
    out = torch.empty_like(q)
    for g in plan:
        qs = q[g.q0:g.q0 + g.side] if g.q_index is None else q[g.q_index]
        qb = qs.view(g.num_seqs, g.side, num_heads, head_dim).transpose(1, 2)
        k, v = (_heads(kv_rows(flat, g.sq_index).to(q.dtype), g.num_seqs) for flat in (k_flat, v_flat))
        o, lse = attention(qb, k, v, True, g.pre_index is not None, scale)
        if g.pre_index is not None:
            k, v = (_heads(kv_rows(flat, g.pre_index).to(q.dtype), g.num_seqs) for flat in (k_flat, v_flat))
            o_pre, lse_pre = attention(qb, k, v, False, True, scale)
            o = merge(o, lse.view(o.shape[:3]), o_pre, lse_pre.view(o.shape[:3]))
        o = o.transpose(1, 2).reshape(g.num_seqs * g.side, num_heads, head_dim)
        if g.out_rows is None:
            out[g.q0:g.q0 + g.side] = o
        else:
            out[g.out_rows] = o[g.real]
    return out


def merge(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor) -> torch.Tensor:
    """Two attentions of the same queries over disjoint keys ([B, H, S, D] outputs, [B, H, S] natural-log
    log-sum-exps) as the attention over both, in fp32: weights exp(lse_i - max), normalised."""
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top), torch.exp(lse2 - top)
    total = w1 + w2
    return (o1.float() * (w1 / total).unsqueeze(-1) + o2.float() * (w2 / total).unsqueeze(-1)).to(o1.dtype)


def warm_up(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
            chunk_tokens: int, max_seq_len: int) -> int:
    """Runs once each shape a long prompt's chunks of chunk_tokens take after a prefix of whole chunks (plan's
    blocks: the causal block with its log-sum-exps, and the unmasked prefix of each whole-chunk length below
    max_seq_len), on zeros, so that cuDNN plans them now. Returns the shapes run."""
    prefix = chunk_tokens // PREFIX_BUCKET * PREFIX_BUCKET
    if prefix != chunk_tokens:  # chunks then leave a remainder before the next one's cut: no fixed shapes to plan
        return 0
    side = -(-chunk_tokens // SQUARE_BUCKET) * SQUARE_BUCKET
    q = torch.zeros(side, num_heads, head_dim, dtype=dtype, device=device).view(1, side, num_heads, head_dim)
    q = q.transpose(1, 2)  # the layouts attend passes (strides are part of a plan's key)
    kv = torch.zeros(max(side, max_seq_len - chunk_tokens), num_kv_heads, head_dim, dtype=dtype, device=device)
    cudnn_attention(q, _heads(kv[:side], 1), _heads(kv[:side], 1), True, True, 1.0)
    shapes = 1
    for cut in range(chunk_tokens, max_seq_len - chunk_tokens + 1, chunk_tokens):
        cudnn_attention(q, _heads(kv[:cut], 1), _heads(kv[:cut], 1), False, True, 1.0)
        shapes += 1
    return shapes
