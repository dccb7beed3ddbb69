"""Reference ops in PyTorch: the CPU backend, and the oracle every kernel in kernels_cu/ is tested
against. The CUDA backend (engine/cuda/ops.py) implements the same methods with the same
signatures; the model calls only these (GEMMs stay torch in both).

The model calls the fused ops (qkv_attention, linear_add, norm_gate_up, norm_logits), which compose the
primitives below; every projection in them goes through `linear`, the one place that dispatches on the
weight's type (a tensor, or an engine.quant.Fp8Weight under --quantization fp8); a backend may override a fused op with a kernel
that fuses it (CudaOps does for small batches, and moves decode's RoPE into the attention kernel for
larger ones), so the model has one forward for every backend and batch.

Layouts:
  hidden      [T, hidden] (T = tokens in the forward)
  q           [T, num_heads, head_dim];  k, v [T, num_kv_heads, head_dim]
  KV cache    per layer [num_blocks, block_size, num_kv_heads, head_dim]
  cos_sin     [P, head_dim]: cos of the head_dim/2 frequencies, then their sin (fp32)
  block table [B, max_blocks_per_seq] int32; slot_mapping [T] int64 (flat KV index)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from engine import sampling
from engine.quant import (FP8_DTYPE, Fp8Weight, Weight, finish_linear, fp8_kv, fp8_linear, takes_w8a8,
                          w8a8_linear)


@dataclass(frozen=True)
class AttentionSpec:
    """A model's attention, the same for every layer and forward."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale of q . k
    eps: float  # rms_norm epsilon of the norms fused into attention's input half (input norm, q/k norms)
    sliding_window: int = 0  # keys a query sees, its own included; 0: all


class LayerKV(NamedTuple):
    """One layer's paged KV cache: k and v [num_blocks, block_size, num_kv_heads, head_dim] each."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass
class AttentionMeta:
    """Where one forward's tokens sit, for attention: built once per forward (engine.models.llama) from its
    ForwardBatch, and the same for every layer."""

    spec: AttentionSpec
    cos_sin: torch.Tensor  # [P, head_dim] fp32: cos then sin of each position's frequencies
    rope_index: torch.Tensor  # [T] int64: each token's row of cos_sin
    slot_mapping: torch.Tensor  # [T] int64: flat KV-cache index each token's k and v go to (negative: none)
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [B] int32: KV length of each query row's sequence after this forward
    is_decode: bool  # one query row per sequence (decode, and verify's per-token rows): decode attention
    query_start_loc: list[int]  # [B + 1] host: token offsets of the sequences (prefill)
    seq_lens_host: list[int]  # [B] host copy of seq_lens (prefill)
    prefill_work: torch.Tensor | None = None  # staged prefill work list (a forward replayed from a graph)
    max_kv_len: int = 0  # an upper bound of the keys any query row sees (sizes key splits; 0: unknown)
    cu_seqlens: torch.Tensor | None = None  # a graphed fresh forward's sequence starts (ForwardBatch.cu_seqlens)


class TorchOps:
    name = "torch"

    # ---------------------------------------------------------------- fused ops (what the model calls)

    def prefill_tokens(self, num_tokens: int) -> int:
        """How many tokens a prefill forward of num_tokens real tokens runs (the rest are pads, see
        build_extend_batch): a backend whose per-shape costs matter rounds up to a few shapes."""
        return num_tokens

    def prefill_buckets(self, limit: int) -> list[int]:
        """The padded token counts prefill forwards of up to `limit` tokens run at, where that set is
        small enough to warm up (Engine.warm_up_prefill); none here: no per-shape costs to pay."""
        return []

    def varlen_prefill(self, longest: int, sliding_window: int, head_dim: int) -> bool:
        """Whether a graphed forward of fresh prompts whose longest has `longest` tokens attends on its own rows (the
        forward's batch then carries their starts, ForwardBatch.cu_seqlens) instead of the paged cache's work list;
        never here (no graphs)."""
        return False

    def warm_up_prefill_attention(self, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                                  chunk_tokens: int, max_seq_len: int) -> int:
        """Pays, before serving, the per-shape costs of long prompts' attention that warm_up_prefill's bucketed
        prefills do not reach (their chunks after a cached prefix); none here. Returns the shapes warmed."""
        return 0

    def begin_forward(self, num_tokens: int, decode: bool, rows_per_seq: int = 1) -> None:
        """Called by the model before each forward: a backend may pick its kernels by the forward's shape
        (the same choice for every op of the forward, from host-known values only). rows_per_seq: a
        verify forward's decode rows per sequence (ForwardBatch.rows_per_seq)."""

    def norm_qkv_rope(self, h: torch.Tensor, layer, meta: AttentionMeta, kv: LayerKV,
                      normed: torch.Tensor | None = None) -> torch.Tensor:
        """Attention's input half: rms_norm, the fused QKV projection (+ bias), per-head q/k norm (Qwen3), RoPE
        on q and k, k and v written to the cache. layer: the layer's LayerWeights (input_norm, qkv, qkv_bias,
        q_norm, k_norm). Returns the rotated q [T, H, D]. normed: rms_norm(h, input_norm) where the op that
        wrote h made it (linear_add), else None."""
        spec = meta.spec
        T, H, Hkv, D = h.shape[0], spec.num_heads, spec.num_kv_heads, spec.head_dim
        x = self.rms_norm(h, layer.input_norm, spec.eps) if normed is None else normed
        q, k, v = self.linear(x, layer.qkv, layer.qkv_bias).split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        if layer.q_norm is not None:
            q, k = self.rms_norm(q, layer.q_norm, spec.eps), self.rms_norm(k, layer.k_norm, spec.eps)
        return self.rope_cache_write(q, k, v, meta.cos_sin, meta.rope_index, kv.k, kv.v, meta.slot_mapping)

    def qkv_attention(self, h: torch.Tensor, layer, meta: AttentionMeta, kv: LayerKV,
                      normed: torch.Tensor | None = None) -> torch.Tensor:
        """A layer's attention half before o_proj: norm_qkv_rope, then attention over the cache it wrote (decode
        attention for decode rows, paged causal prefill attention otherwise). One op, so that a backend can
        fuse the RoPE and the KV write into the attention kernel. Returns [T, H, D]."""
        q = self.norm_qkv_rope(h, layer, meta, kv, normed)
        spec = meta.spec
        if meta.is_decode:
            return self.decode_attention(q, kv.k, kv.v, meta.block_tables, meta.seq_lens, spec.scale,
                                         spec.sliding_window)
        return self.prefill_attention(q, kv.k, kv.v, meta.block_tables, meta.query_start_loc, meta.seq_lens_host,
                                      spec.scale, spec.sliding_window, meta.prefill_work, meta.max_kv_len)

    def linear_add(self, h: torch.Tensor, x: torch.Tensor, weight: Weight, norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor | None:
        """The residual stream h += x @ weight^T, in place (one rounding: a GEMM with beta = 1). With norm
        (the next op's), returns rms_norm(h, norm, eps) too, for that op's `normed`, or None where the
        next op computes it itself (a backend may fuse the norm into either side: CudaOps does)."""
        self.linear(x, weight, add_to=h)
        return None if norm is None else self.rms_norm(h, norm, eps)

    def norm_gate_up(self, h: torch.Tensor, norm: torch.Tensor, gate_up: Weight, eps: float,
                     normed: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's input half: silu(gate) * up of rms_norm(h) @ gate_up^T. Returns [T, I]."""
        return self.silu_and_mul(self.linear(self.rms_norm(h, norm, eps) if normed is None else normed, gate_up))

    def norm_logits(self, h: torch.Tensor, rows: torch.Tensor | None, norm: torch.Tensor, lm_head: Weight,
                    eps: float, normed: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the final rms_norm of h's rows `rows` (None: every row)."""
        if normed is not None:
            return self.logits(normed if rows is None else normed[rows], lm_head)
        x = h if rows is None else h[rows]
        return self.logits(self.rms_norm(x, norm, eps), lm_head)

    # ---------------------------------------------------------------- projections

    def linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None,
               add_to: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [M, K] @ weight^T (+ bias) for a weight [N, K]: returned as out_dtype (default x's), or with add_to
        [M, N] added into it in place, rounded once (returns add_to). Every projection of the model runs
        through here: an Fp8Weight takes engine.quant's reference arithmetic, W8A8 where takes_w8a8 says (as
        CudaOps does on the tensor cores), W8A16 elsewhere (always for a weight-only weight, activation_scheme
        "none")."""
        if isinstance(weight, Fp8Weight):
            out = add_to.dtype if add_to is not None else out_dtype or x.dtype
            if takes_w8a8(x, weight, out):
                return finish_linear(w8a8_linear(x, weight), bias, add_to, out)
            return fp8_linear(x, weight, bias, add_to, out_dtype)
        if add_to is not None:
            return add_to.addmm_(x, weight.t()) if bias is None else add_to.add_(F.linear(x, weight, bias))
        if out_dtype == torch.float32 and bias is None:
            return logits(x, weight)  # fp32 straight from the GEMM (see logits)
        y = F.linear(x, weight, bias)
        return y if out_dtype is None else y.to(out_dtype)

    def logits(self, x: torch.Tensor, lm_head: Weight) -> torch.Tensor:
        """fp32 logits [N, vocab] of the final-normed rows x [N, hidden]."""
        return self.linear(x, lm_head, out_dtype=torch.float32)

    # ---------------------------------------------------------------- primitives

    def embedding(self, input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight * x / rms(x), computed in fp32 and cast back (as transformers' LlamaRMSNorm)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rope_cache_write(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos_sin: torch.Tensor,
                         rope_index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotates q and k (rotate-half convention) with cos_sin[rope_index]; writes rotated k and v to
        the cache at slot_mapping (a negative slot: no write). Returns the rotated q [T, num_heads, head_dim]."""
        cs = cos_sin[rope_index]  # [T, head_dim] fp32
        half = cs.shape[-1] // 2
        cos, sin = cs[:, None, :half], cs[:, None, half:]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            xf = x.float()
            x1, x2 = xf[..., :half], xf[..., half:]
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)

        num_blocks, block_size = k_cache.shape[:2]
        keep = slot_mapping >= 0  # a negative slot writes nothing (pad tokens)
        k_rows, v_rows = rotate(k)[keep], v[keep]
        if k_cache.dtype == FP8_DTYPE:  # --kv-cache-dtype fp8 (readers upcast with .float())
            k_rows, v_rows = fp8_kv(k_rows), fp8_kv(v_rows)
        for cache, rows in ((k_cache, k_rows), (v_cache, v_rows)):
            flat = cache.view(num_blocks * block_size, *cache.shape[2:])
            if cache.dtype == FP8_DTYPE:  # written as bytes: float8 index kernels are missing from some torch builds
                flat, rows = flat.view(torch.uint8), rows.view(torch.uint8)
            flat[slot_mapping[keep]] = rows
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
        k = kv_rows(k_cache, table).reshape(batch, num_blocks * block_size, num_kv_heads, head_dim).float()
        v = kv_rows(v_cache, table).reshape(batch, num_blocks * block_size, num_kv_heads, head_dim).float()
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
                          scale: float, sliding_window: int = 0, work: torch.Tensor | None = None,
                          max_kv_len: int = 0) -> torch.Tensor:
        """Several query tokens per sequence, causal over the cached prefix and the new tokens.
        Sequence b's queries are q[query_start_loc[b]:query_start_loc[b+1]], at the last positions of
        its seq_lens[b] keys. Host lists: they size the work. Or, given `work` (engine.batch.prefill_work
        rows on the device, empty rows ignored), each row's queries against the keys up to its last
        one. Returns [T, H, D]."""
        out = torch.empty_like(q)
        num_heads, head_dim = q.shape[1:]
        block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
        group = num_heads // num_kv_heads
        if work is not None:  # the same attention, by work row: (b, first query, rows, its position)
            items = [(b, q0, q0 + rows, pos0 + rows) for b, q0, rows, pos0 in work.tolist() if rows]
        else:
            items = [(b, query_start_loc[b], query_start_loc[b + 1], n) for b, n in enumerate(seq_lens)]
        for b, start, end, kv_len in items:
            num_blocks = -(-kv_len // block_size)
            table = block_tables[b, :num_blocks].long()
            k = kv_rows(k_cache, table).reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
            v = kv_rows(v_cache, table).reshape(-1, num_kv_heads, head_dim)[:kv_len].float()
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


def kv_rows(cache: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """cache[index] for a cache of any dtype: an E4M3 cache's rows are gathered as bytes (float8 index kernels are
    missing from some torch builds), the same bits."""
    if cache.dtype == FP8_DTYPE:
        return cache.view(torch.uint8)[index].view(FP8_DTYPE)
    return cache[index]


def logits(x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, vocab]. On a GPU with 16-bit weights cuBLAS writes fp32 directly: bf16 logits
    (resolution 0.25 at 40) would tie far more often, and sampling reads them in fp32 anyway."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, lm_head.t(), out_dtype=torch.float32)
    return F.linear(x, lm_head).float()
