"""Reference ops in PyTorch: the CPU backend, and the oracle every kernel in kernels_cu/ is tested
against. The CUDA backend (engine/cuda/ops.py) implements the same methods with the same
signatures; the model calls only these (GEMMs stay torch in both).

Layouts:
  hidden      [T, hidden] (T = tokens in the forward)
  q           [T, num_heads, head_dim];  k, v [T, num_kv_heads, head_dim]
  KV cache    per layer [num_blocks, block_size, num_kv_heads, head_dim]
  cos_sin     [P, head_dim]: cos of the head_dim/2 frequencies, then their sin (fp32)
  block table [B, max_blocks_per_seq] int32; slot_mapping [T] int64 (flat KV index)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine import sampling


class TorchOps:
    name = "torch"

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x), computed in fp32 and cast back (as transformers' LlamaRMSNorm)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """residual = x + residual; returns (rms_norm(residual), residual)."""
        residual = x + residual
        return self.rms_norm(residual, weight, eps), residual

    def rope_cache_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                         rope_index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotates q and k (rotate-half convention) with cos_sin[rope_index]; writes rotated k and v to
        the cache at slot_mapping. Returns the rotated q [T, num_heads, head_dim]."""
        cs = cos_sin[rope_index]  # [T, head_dim] fp32
        half = cs.shape[-1] // 2
        cos, sin = cs[:, None, :half], cs[:, None, half:]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            x1, x2 = xf[..., :half], xf[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        num_blocks, block_size = k_cache.shape[:2]
        k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping] = rotate(k)
        v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping] = v
        return rotate(q)

    def decode_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                         sliding_window: int = 0) -> torch.Tensor:
        """One query per sequence. q [B, H, D]; seq_lens [B] (keys 0..seq_len-1, the query is the
        last). Returns [B, H, D]."""
        batch, num_heads, head_dim = q.shape
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        max_len = int(seq_lens.max())
        num_blocks = -(-max_len // block_size)
        table = block_tables[:, :num_blocks].long()
        k = k_cache[table].reshape(batch, num_blocks * block_size, num_kv_heads, head_dim).float()
        v = v_cache[table].reshape(batch, num_blocks * block_size, num_kv_heads, head_dim).float()
        qg = q.float().view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        scores = torch.einsum("bkgd,bskd->bkgs", qg, k) * scale
        pos = torch.arange(num_blocks * block_size, device=q.device)[None, :]
        valid = pos < seq_lens[:, None]
        if sliding_window:
            valid &= pos > seq_lens[:, None] - 1 - sliding_window
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        out = torch.einsum("bkgs,bskd->bkgd", torch.softmax(scores, dim=-1), v)
        return out.reshape(batch, num_heads, head_dim).to(q.dtype)

    def prefill_attention(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, query_start_loc: list[int], seq_lens: list[int],
                          scale: float, sliding_window: int = 0) -> torch.Tensor:
        """Several query tokens per sequence, causal over the cached prefix and the new tokens.
        Sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]], at the last positions of
        its seq_lens[b] keys. Host lists: they size the work. Returns [T, H, D]."""
        out = torch.empty_like(q)
        num_heads, head_dim = q.shape[1:]
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        for b, kv_len in enumerate(seq_lens):
            start, end = query_start_loc[b], query_start_loc[b + 1]
            num_blocks = -(-kv_len // block_size)
            table = block_tables[b, :num_blocks].long()
            k = k_cache[table].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
            v = v_cache[table].reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
            qs = q[start:end].float().view(end - start, num_kv_heads, group, head_dim)
            scores = torch.einsum("qkgd,skd->kgqs", qs, k) * scale
            q_pos = torch.arange(kv_len - (end - start), kv_len, device=q.device)[:, None]
            k_pos = torch.arange(kv_len, device=q.device)[None, :]
            valid = k_pos <= q_pos
            if sliding_window:
                valid &= k_pos > q_pos - sliding_window
            scores = scores.masked_fill(~valid, float("-inf"))
            o = torch.einsum("kgqs,skd->qkgd", torch.softmax(scores, dim=-1), v)
            out[start:end] = o.reshape(end - start, num_heads, head_dim).to(q.dtype)
        return out

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, 2 * I] = [gate | up] -> silu(gate) * up [T, I]."""
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up

    def sample(self, logits: torch.Tensor, st: sampling.SamplingTensors,
               num_top: int = 0) -> sampling.SampleOutput:
        return sampling.sample(logits, st, num_top)

    def accept_drafts(self, target_logp: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                      seed: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched speculative acceptance: target_logp [B, K+1, V], draft_ids [B, K], draft_probs
        [B, K, V] or None, seed / position [B, K+1] -> (num_accepted [B], the token after them [B])."""
        out = [sampling.accept_drafts(target_logp[b], draft_ids[b], None if draft_probs is None else draft_probs[b],
                                      seed[b], position[b]) for b in range(draft_ids.shape[0])]
        device = target_logp.device
        return (torch.tensor([j for j, _ in out], dtype=torch.int64, device=device),
                torch.tensor([t for _, t in out], dtype=torch.int64, device=device))
