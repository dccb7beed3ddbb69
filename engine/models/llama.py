"""The Llama family (Llama, Mistral, Qwen2 with q/k/v bias, Qwen3 with q/k norm) as a pure module
graph: weights in, logits out, every non-GEMM op through `ops`. No scheduling, RPC or graph logic."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.models.rope import RotaryTable


@dataclass
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: torch.Tensor  # [q_size + 2 * kv_size, hidden]
    qkv_bias: torch.Tensor | None  # [q_size + 2 * kv_size]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    o_proj: torch.Tensor  # [hidden, q_size]
    post_norm: torch.Tensor  # [hidden]
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor  # [hidden, intermediate]


@dataclass
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden] (the embedding itself when tied)


class LlamaModel:
    def __init__(self, cfg: ModelConfig, weights: ModelWeights, kv: KVCache, ops, max_positions: int):
        self.cfg = cfg
        self.w = weights
        self.kv = kv
        self.ops = ops
        self.rotary = RotaryTable(cfg, max_positions, weights.embed.device)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Returns fp32 logits [len(batch.logits_indices), vocab]."""
        cfg, ops = self.cfg, self.ops
        num_tokens = batch.num_tokens
        cos_sin, rope_index = self.rotary.rows(batch.positions, batch.rope_scale_lens)
        hidden = ops.embedding(batch.input_ids, self.w.embed)
        residual = None
        for i, layer in enumerate(self.w.layers):
            if residual is None:
                residual = hidden
                x = ops.rms_norm(hidden, layer.input_norm, cfg.rms_norm_eps)
            else:
                x, residual = ops.add_rms_norm(hidden, residual, layer.input_norm, cfg.rms_norm_eps)
            qkv = F.linear(x, layer.qkv, layer.qkv_bias)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(num_tokens, cfg.num_heads, cfg.head_dim)
            k = k.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            v = v.reshape(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = ops.rms_norm(q, layer.q_norm, cfg.rms_norm_eps)
                k = ops.rms_norm(k, layer.k_norm, cfg.rms_norm_eps)
            q = ops.rope_cache_write(q, k, v, cos_sin, rope_index, self.kv.k[i], self.kv.v[i],
                                     batch.slot_mapping)
            if batch.is_decode:
                attn = ops.decode_attention(q, self.kv.k[i], self.kv.v[i], batch.block_tables, batch.seq_lens,
                                            self.scale, cfg.sliding_window)
            else:
                attn = ops.prefill_attention(q, self.kv.k[i], self.kv.v[i], batch.block_tables,
                                             batch.query_start_loc, batch.seq_lens_host, self.scale,
                                             cfg.sliding_window)
            hidden = F.linear(attn.reshape(num_tokens, cfg.q_size), layer.o_proj)
            x, residual = ops.add_rms_norm(hidden, residual, layer.post_norm, cfg.rms_norm_eps)
            hidden = F.linear(ops.silu_and_mul(F.linear(x, layer.gate_up)), layer.down)
        idx = batch.logits_indices
        x, _ = ops.add_rms_norm(hidden[idx], residual[idx], self.w.norm, cfg.rms_norm_eps)
        return logits(x, self.w.lm_head)


def logits(x: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """fp32 logits [N, vocab]. On a GPU with 16-bit weights cuBLAS writes fp32 directly: bf16 logits
    (resolution 0.25 at 40) would tie far more often, and sampling reads them in fp32 anyway."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(x, lm_head.t(), out_dtype=torch.float32)
    return F.linear(x, lm_head).float()
