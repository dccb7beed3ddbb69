"""Helpers shared by the GPU kernel tests: fresh random inputs and NaN-poisoned outputs on the
current CUDA device."""
from __future__ import annotations

import torch


def dev() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def randn(*shape, dtype=torch.float32, scale=1.0) -> torch.Tensor:
    return (torch.randn(*shape, device=dev()) * scale).to(dtype)


def nan(shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=dev())


def attention_layer(norm, qkv, bias=None):
    """The attention half of a LayerWeights (what the fused attention ops read of a layer)."""
    from engine.models.llama import LayerWeights

    return LayerWeights(input_norm=norm, qkv=qkv, qkv_bias=bias, q_norm=None, k_norm=None, o_proj=None,
                        post_norm=None, gate_up=None, down=None)


def attention_meta(H, Hkv, D, cos_sin, positions, slot_mapping, block_tables=None, seq_lens=None, window=0,
                   eps=1e-6, decode=True):
    """AttentionMeta of a forward whose tokens sit at `positions` (their rows of cos_sin) and write their k and v
    to slot_mapping; decode rows attend through block_tables / seq_lens."""
    from engine.ops.torch_ops import AttentionMeta, AttentionSpec

    spec = AttentionSpec(H, Hkv, D, D ** -0.5, eps, window)
    return AttentionMeta(spec, cos_sin, positions, slot_mapping, block_tables, seq_lens, decode, [], [])


def greedy_run(engine, ps: list[list[int]], n: int) -> list[list[int]]:
    """n greedy tokens of each prompt in ps, decoded together (one prefill, then n - 1 decode steps)."""
    from engine.api import PrefillItem
    from engine.sampling import SamplingParams, StoppingCriteria

    stop = StoppingCriteria(ignore_eos=True)
    ids = [engine.alloc_sequence(len(p) + n + 1, SamplingParams(), stop).seq_id for p in ps]
    out = {t.seq_id: [t.token_id] for t in engine.prefill([PrefillItem(i, p) for i, p in zip(ids, ps)]).tokens}
    for _ in range(n - 1):
        for t in engine.decode(ids).tokens:
            out[t.seq_id].append(t.token_id)
    engine.release(ids)
    return [out[i] for i in ids]
