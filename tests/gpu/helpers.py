"""Helpers shared by the GPU kernel tests: fresh random inputs and NaN-poisoned outputs on the
current CUDA device."""
from __future__ import annotations

import contextlib

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


PREFILL_PATHS = ["cudnn", "flash", "paged"]


def scattered_tables(lengths: list[int], block_size: int) -> tuple[torch.Tensor, int]:
    """Block tables on the device for sequences of `lengths` tokens over randomly scattered blocks (block 0 unused),
    and the number of cache blocks they need (a few spare)."""
    blocks_per = [-(-n // block_size) for n in lengths]
    perm = torch.randperm(sum(blocks_per) + 3)[:sum(blocks_per)] + 1
    table = torch.zeros(len(lengths), max(blocks_per), dtype=torch.int32)
    at = 0
    for b, nb in enumerate(blocks_per):
        table[b, :nb] = perm[at:at + nb]
        at += nb
    return table.to(dev()), sum(blocks_per) + 4


@contextlib.contextmanager
def prefill_path(ops, path: str):
    """CudaOps.prefill_attention's eager forwards through one route whatever their size: cuDNN's or FlashAttention's
    fused attention (prefill_fused), or the paged kernel. A cuDNN route that fell back to FlashAttention fails the
    test (the fallback is for shapes cuDNN refuses, and the tests' shapes are ones it must take)."""
    from engine.cuda import prefill_cudnn
    from engine.cuda.prefill_fused import FusedPrefill
    default, fused = ops.fused_min_tokens, ops.fused_prefill
    ops.fused_min_tokens = 1 << 30 if path == "paged" else 0
    ops.fused_prefill = FusedPrefill(path)
    ops.fused_prefill.cudnn_min_keys = 0  # the tests' short prompts through cuDNN too
    try:
        yield
        if path == "cudnn":
            assert ops.fused_prefill.route is prefill_cudnn, "cuDNN refused the prefill (see the warning)"
    finally:
        ops.fused_min_tokens, ops.fused_prefill = default, fused

