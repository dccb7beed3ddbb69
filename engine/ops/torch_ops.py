"""Reference ops in PyTorch: the CPU backend, and the oracle every kernel in kernels_cu/ is tested
against. The CUDA backend (engine/cuda/ops.py) implements the same methods with the same
signatures; the model calls only these (GEMMs stay torch in both).

The model calls the fused ops (norm_qkv_rope, decode_qkv_attention, linear_add, norm_gate_up,
norm_logits), which compose the primitives below; a backend may override a fused op with a kernel
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
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from engine import sampling
from engine.batch import ForwardBatch, build_decode_batch

if TYPE_CHECKING:
    from engine.outputs import StepOutputs
    from engine.state import SlotState


@dataclass(frozen=True)
class AttentionShape:
    num_heads: int
    num_kv_heads: int
    head_dim: int


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

    def begin_forward(self, num_tokens: int, decode: bool, rows_per_seq: int = 1) -> None:
        """Called by the model before each forward: a backend may pick its kernels by the forward's shape
        (the same choice for every op of the forward, from host-known values only). rows_per_seq: a
        verify forward's decode rows per sequence (ForwardBatch.rows_per_seq)."""

    def norm_qkv_rope(self, h: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor, bias: torch.Tensor | None,
                      q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, shape: AttentionShape,
                      cos_sin: torch.Tensor, rope_index: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      slot_mapping: torch.Tensor, eps: float, normed: torch.Tensor | None = None) -> torch.Tensor:
        """Attention's input half: rms_norm, the fused QKV projection (+ bias), per-head q/k norm
        (Qwen3), RoPE on q and k, k and v written to the cache. Returns the rotated q [T, H, D].
        normed: rms_norm(h, norm, eps) where the op that wrote h made it (linear_add), else None."""
        T, H, Hkv, D = h.shape[0], shape.num_heads, shape.num_kv_heads, shape.head_dim
        out = F.linear(self.rms_norm(h, norm, eps) if normed is None else normed, qkv, bias)
        q, k, v = out.split([H * D, Hkv * D, Hkv * D], dim=-1)
        q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)
        if q_norm is not None:
            q, k = self.rms_norm(q, q_norm, eps), self.rms_norm(k, k_norm, eps)
        return self.rope_cache_write(q, k, v, cos_sin, rope_index, k_cache, v_cache, slot_mapping)

    def decode_qkv_attention(self, h: torch.Tensor, norm: torch.Tensor, qkv: torch.Tensor, bias: torch.Tensor | None,
                             q_norm: torch.Tensor | None, k_norm: torch.Tensor | None, shape: AttentionShape,
                             cos_sin: torch.Tensor, rope_index: torch.Tensor, k_cache: torch.Tensor,
                             v_cache: torch.Tensor, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                             seq_lens: torch.Tensor, scale: float, sliding_window: int, eps: float,
                             normed: torch.Tensor | None = None) -> torch.Tensor:
        """A decode layer's attention half: norm_qkv_rope, then decode_attention over the cache it wrote
        (one op, so that a backend can fuse the RoPE and the KV write into the attention kernel).
        Returns [B, H, D]."""
        q = self.norm_qkv_rope(h, norm, qkv, bias, q_norm, k_norm, shape, cos_sin, rope_index, k_cache, v_cache,
                               slot_mapping, eps, normed)
        return self.decode_attention(q, k_cache, v_cache, block_tables, seq_lens, scale, sliding_window)

    def linear_add(self, h: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, norm: torch.Tensor | None = None,
                   eps: float = 0.0) -> torch.Tensor | None:
        """The residual stream h += x @ weight^T, in place (one rounding: a GEMM with beta = 1). With norm
        (the next op's), returns rms_norm(h, norm, eps) too, for that op's `normed`, or None where the
        next op computes it itself (a backend may fuse the norm into either side: CudaOps does)."""
        h.addmm_(x, weight.t())
        return None if norm is None else self.rms_norm(h, norm, eps)

    def norm_gate_up(self, h: torch.Tensor, norm: torch.Tensor, gate_up: torch.Tensor, eps: float,
                     normed: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP's input half: silu(gate) * up of rms_norm(h) @ gate_up^T. Returns [T, I]."""
        return self.silu_and_mul(F.linear(self.rms_norm(h, norm, eps) if normed is None else normed, gate_up))

    def norm_logits(self, h: torch.Tensor, rows: torch.Tensor | None, norm: torch.Tensor, lm_head: torch.Tensor,
                    eps: float, normed: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the final rms_norm of h's rows `rows` (None: every row)."""
        if normed is not None:
            return logits(normed if rows is None else normed[rows], lm_head)
        x = h if rows is None else h[rows]
        return logits(self.rms_norm(x, norm, eps), lm_head)

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
        k_cache.view(num_blocks * block_size, *k_cache.shape[2:])[slot_mapping[keep]] = rotate(k)[keep]
        v_cache.view(num_blocks * block_size, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]
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
                          scale: float, sliding_window: int = 0, work: torch.Tensor | None = None) -> torch.Tensor:
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

    # ---------------------------------------------------------------------------------------------
    # The decode step's slot state (engine/state.py): inputs gathered from the rows of its slots before
    # the forward, results written back after sampling. Device ops only (captured into CUDA graphs).

    def decode_inputs(self, state: SlotState, slots: torch.Tensor, block_size: int, seq_lens_host: list[int],
                      need_scale_lens: bool) -> tuple[ForwardBatch, sampling.SamplingTensors]:
        """slots [B] int64 -> the step's ForwardBatch (each slot's last token at position
        num_cached[slot]) and the sampling rows (its parameters, drawing position num_cached + 1)."""
        batch = build_decode_batch(state.block_table, state.last_token, state.num_cached, slots, block_size,
                                   seq_lens_host, need_scale_lens)
        return batch, state.sampling_rows(slots, batch.positions + 1)

    def decode_commit(self, state: SlotState, slots: torch.Tensor, out: sampling.SampleOutput,
                      outputs: StepOutputs, num_top: int) -> None:
        """Each slot moves one token on (num_cached + 1, last token = the sampled one, marked seen); the
        token and its logprob go to the results kept per slot and position (outputs.slot_tokens /
        slot_logprobs [S, R] at [slot, num_cached % R], num_cached before the step), the top-logprob
        candidates to the step's static buffers."""
        ring = outputs.rings
        entries = (slots * ring + state.num_cached[slots] % ring).to(outputs.slot_tokens.device)
        outputs.slot_tokens.view(-1)[entries] = out.token_ids.to(outputs.slot_tokens.device)
        outputs.slot_logprobs.view(-1)[entries] = out.logprobs.to(outputs.slot_logprobs.device)
        state.num_cached[slots] += 1
        state.last_token[slots] = out.token_ids
        state.mark_seen(slots, out.token_ids)
        outputs.write_top(out, out.token_ids.shape[0], num_top)

    def verify_inputs(self, state: SlotState, slots: torch.Tensor, drafts: torch.Tensor,
                      block_size: int) -> tuple[ForwardBatch, sampling.SamplingTensors]:
        """A uniform Verify's forward and sampling rows: slots [B], drafts [B, k] -> row b (k + 1) + i is
        slot b's last token (i = 0) or draft i - 1, at position num_cached + i (attention per token, like
        decode); it draws the token at position num_cached + i + 1 with the slot's parameters and drafts
        0 .. i - 1 counted as seen (the repetition penalty decode would have applied there)."""
        B, k = drafts.shape
        n, dev = k + 1, slots.device
        start = state.num_cached[slots].long()
        offsets = torch.arange(n, device=dev)
        positions = (start[:, None] + offsets).reshape(-1)  # [B n]
        seq_index = torch.arange(B, device=dev).repeat_interleave(n)
        tables = state.block_table[slots][seq_index]
        rows = torch.arange(B * n, device=dev)
        block_ids = tables[rows, positions // block_size].long()
        batch = ForwardBatch(
            input_ids=torch.cat([state.last_token[slots][:, None], drafts], dim=1).reshape(-1), positions=positions,
            slot_mapping=block_ids * block_size + positions % block_size, block_tables=tables,
            seq_lens=(positions + 1).to(torch.int32), logits_indices=rows, is_decode=True,
            query_start_loc=[], seq_lens_host=[], logits_all_rows=True, rows_per_seq=n)
        st = state.sampling_rows(slots[seq_index], positions + 1)
        # Row (b, i) marks drafts j < i as seen: the pairs (i, j) below the diagonal, for every b.
        i, j = torch.tril_indices(n, k, -1, device=dev)
        st.seen.index_put_(((torch.arange(B, device=dev)[:, None] * n + i).reshape(-1), drafts[:, j].reshape(-1)),
                           state._true)
        return batch, st

    def verify_commit(self, state: SlotState, slots: torch.Tensor, drafts: torch.Tensor, out: sampling.SampleOutput,
                      outputs, num_top: int) -> None:
        """The drafts are accepted while they equal the tokens their rows drew; each slot moves past the
        accepted ones plus the token drawn after them (num_cached, last_token, seen), and the results go
        to the Verify step's static buffers (outputs: engine.outputs.VerifyOutputs)."""
        B, k = drafts.shape
        n = k + 1
        sampled = out.token_ids.view(B, n)
        accepted = (sampled[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)  # [B]: the matching prefix
        token = sampled.gather(1, accepted[:, None]).squeeze(1)
        offsets = torch.arange(n, device=slots.device)
        emitted = torch.where(offsets[None, :] <= accepted[:, None], sampled, token[:, None])  # then repeats
        state.last_token[slots] = token
        state.num_cached[slots] = (state.num_cached[slots].long() + 1 + accepted).to(torch.int32)
        state.mark_seen(slots.repeat_interleave(n), emitted.reshape(-1))
        outputs.accepted[:B].copy_(accepted)
        outputs.tokens[:B].copy_(token)
        outputs.logprobs[:B, :n].copy_(out.logprobs.view(B, n))
        outputs.write_top(out, B * n, num_top)

    def accept_drafts(self, target_logp: torch.Tensor, draft_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                      seed: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Batched speculative acceptance: target_logp [B, K+1, V], draft_ids [B, K], draft_probs
        [B, K, V] or None, seed / position [B, K+1] -> (num_accepted [B], the token after them [B])."""
        out = [sampling.accept_drafts(target_logp[b], draft_ids[b], None if draft_probs is None else draft_probs[b],
                                      seed[b], position[b]) for b in range(draft_ids.shape[0])]
        device = target_logp.device
        return (torch.tensor([j for j, _ in out], dtype=torch.int64, device=device),
                torch.tensor([t for _, t in out], dtype=torch.int64, device=device))


def logits(x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, vocab]. On a GPU with 16-bit weights cuBLAS writes fp32 directly: bf16 logits
    (resolution 0.25 at 40) would tie far more often, and sampling reads them in fp32 anyway."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, lm_head.t(), out_dtype=torch.float32)
    return F.linear(x, lm_head).float()
