"""The Llama family (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm) as a pure module
graph: weights in, logits out, every non-GEMM op through `ops`. No scheduling, RPC or graph logic.

Under tensor parallelism (engine/shard.py) the weights are this rank's shard: the attention runs over the
rank's heads, o_proj and down give partial sums that `collectives.all_reduce` adds up before the residual
add (so the backend's fused linear_add, which adds inside the GEMM, is not used), and the LM head gives the
rank's vocabulary columns, which `collectives.gather_vocab` joins into the full logits."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.models.rope import RotaryTable
from engine.ops.torch_ops import AttentionMeta, AttentionSpec
from engine.quant import Weight
from engine.shard import ShardPlan


@dataclass
class LayerWeights:
    """A layer's weights in the model dtype; the projections (qkv, o_proj, gate_up, down) may be Fp8Weight
    (--quantization fp8), which the ops' linear dispatches on."""

    input_norm: torch.Tensor  # [hidden]
    qkv: Weight  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    o_proj: Weight  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: Weight  # [2 * intermediate, hidden]
    down: Weight  # [hidden, intermediate]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: Weight  # [vocab, hidden] (the embedding itself when tied and not quantized)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, kv: KVCache, ops, max_positions: int,
                 shard: ShardPlan | None = None, collectives=None):
        """shard: what this rank holds (None: everything); collectives: engine.parallel.Collectives when the
        model is split over several ranks, else None."""
        shard = shard or ShardPlan(cfg)
        self.cfg = cfg
        self.q_size = shard.q_size
        self.collectives = collectives
        self.w = weights
        self.kv = kv
        self.ops = ops
        self.kv_layers = [kv.layer(i) for i in range(cfg.num_layers)]  # views: made once, not per forward
        self.rotary = RotaryTable(cfg, max_positions, weights.embed.device)
        self.attention = AttentionSpec(shard.num_heads, shard.num_kv_heads, cfg.head_dim, cfg.head_dim ** -0.5,
                                       cfg.rms_norm_eps, cfg.sliding_window)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns fp32 logits [len(batch.logits_indices), vocab]; with batch.hidden_states, those rows' hidden
        states after the final norm instead, fp32 [rows, hidden] (no LM head: embeddings)."""
        ops, eps = self.ops, self.cfg.rms_norm_eps
        cos_sin, rope_index = self.rotary.rows(batch.positions, batch.rope_scale_lens)
        meta = AttentionMeta(self.attention, cos_sin, rope_index, batch.slot_mapping, batch.block_tables,
                             batch.seq_lens, batch.is_decode, batch.query_start_loc, batch.seq_lens_host,
                             batch.prefill_work, batch.max_kv_len, batch.cu_seqlens)
        ops.begin_forward(batch.num_tokens, batch.is_decode, batch.rows_per_seq)
        h = ops.embedding(batch.input_ids, self.w.embed)  # the residual stream, updated in place
        rows = None if batch.logits_all_rows else batch.logits_indices
        # normed: rms_norm of h for the op after a linear_add, when linear_add made it with the residual add
        # (a backend's choice: None where the next op fuses the norm itself)
        normed = None
        layers = self.w.layers
        linear_add = ops.linear_add if self.collectives is None else self._reduce_add
        for i, layer in enumerate(layers):
            attn = ops.qkv_attention(h, layer, meta, self.kv_layers[i], normed)
            normed = linear_add(h, attn.reshape(batch.num_tokens, self.q_size), layer.o_proj, layer.post_norm, eps)
            # the next op's norm: the next layer's, or the final one when every row's logits are taken
            next_norm = layers[i + 1].input_norm if i + 1 < len(layers) else (self.w.norm if rows is None else None)
            normed = linear_add(h, ops.norm_gate_up(h, layer.post_norm, layer.gate_up, eps, normed), layer.down,
                                next_norm, eps)
        if batch.hidden_states:  # every rank holds the whole residual stream (row-parallel sums are all-reduced)
            return (normed if normed is not None else ops.rms_norm(h if rows is None else h[rows], self.w.norm,
                                                                   eps)).float()
        logits = ops.norm_logits(h, rows, self.w.norm, self.w.lm_head, eps, normed)
        return logits if self.collectives is None else self.collectives.gather_vocab(logits)

    def _reduce_add(self, h: torch.Tensor, x: torch.Tensor, weight, norm: torch.Tensor | None,
                    eps: float) -> torch.Tensor | None:
        """ops.linear_add for a row-parallel weight: h += all_reduce(x @ weight^T), then the next op's norm."""
        h.add_(self.collectives.all_reduce(self.ops.linear(x, weight)))
        return None if norm is None else self.ops.rms_norm(h, norm, eps)
