"""Tensor-parallel sharding arithmetic (engine/shard.py) and the sharded load (engine/loader.py)."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F

from engine.checkpoint import write_checkpoint
from engine.config import EngineConfig, ModelConfig
from engine.errors import ConfigError
from engine.loader import load_weights
from engine.shard import ShardPlan, split


def config(heads: int, kv_heads: int, **changes) -> ModelConfig:
    base = dict(architecture="llama", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=1,
                num_heads=heads, num_kv_heads=kv_heads, head_dim=8, rms_norm_eps=1e-6, max_position_embeddings=64,
                tie_word_embeddings=False, rope=None)
    base.update(changes)
    return ModelConfig(**base)


@pytest.mark.parametrize("heads, kv_heads, size, want", [
    (32, 8, 2, [(0, 1, 2, 3), (4, 5, 6, 7)]),  # the plain split
    (8, 1, 2, [(0,), (0,)]),  # fewer KV heads than ranks: replicated
    (6, 3, 2, [(0, 0, 1), (1, 2, 2)]),  # 3 KV heads over 2 ranks
    (24, 6, 4, [(0, 0, 1), (1, 2, 2), (3, 3, 4), (4, 5, 5)]),
    (9, 3, 3, [(0,), (1,), (2,)]),  # SmolLM2-135M at TP 3
    (4, 4, 2, [(0, 1), (2, 3)]),  # MHA
])
def test_kv_head_map(heads, kv_heads, size, want):
    assert [ShardPlan(config(heads, kv_heads), r, size).kv_heads for r in range(size)] == want


@pytest.mark.parametrize("heads, kv_heads, size", [
    (h, k, n) for h, k, n in itertools.product((4, 6, 8, 9, 12, 24, 32), (1, 2, 3, 4, 6, 8), (1, 2, 3, 4, 8))
    if h % k == 0 and h % n == 0])
def test_every_query_head_reads_its_own_kv_head_through_a_uniform_group(heads, kv_heads, size):
    group = heads // kv_heads
    held = []
    for rank in range(size):
        plan = ShardPlan(config(heads, kv_heads), rank, size)
        assert plan.num_heads % plan.num_kv_heads == 0
        for j in range(plan.num_heads):  # local query head j reads local KV head j // local_group
            assert plan.kv_heads[j // plan.local_group] == (plan.first_head + j) // group
        held += plan.kv_heads
    assert set(held) == set(range(kv_heads))
    if kv_heads % size == 0:  # a plain split holds each KV head once
        assert sorted(held) == list(range(kv_heads))


def test_splits_cover_the_dimension_once():
    for n, size in ((128, 2), (100, 3), (511, 3), (7, 7)):
        parts = [split(n, size, r) for r in range(size)]
        assert parts[0][0] == 0 and parts[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))
        assert max(b - a for a, b in parts) - min(b - a for a, b in parts) <= 1


def test_sizes_that_do_not_divide_the_heads_are_refused():
    with pytest.raises(ConfigError, match="--tensor-parallel-size 2 does not divide the model's 9 attention heads"):
        ShardPlan(config(9, 3), 0, 2)
    with pytest.raises(ConfigError, match="tensor_parallel_size must be > 0"):
        EngineConfig(tensor_parallel_size=0)


@pytest.mark.parametrize("arch, overrides, size", [
    ("qwen2", dict(num_attention_heads=6, num_key_value_heads=3, head_dim=16, tie_word_embeddings=True), 2),
    ("llama", dict(num_attention_heads=4, num_key_value_heads=2, intermediate_size=100, vocab_size=511), 2),
    ("qwen3", dict(num_attention_heads=6, num_key_value_heads=2, head_dim=16, vocab_size=511,
                   intermediate_size=100), 3),
])
def test_sharded_load_reads_each_ranks_slices(tmp_path, arch, overrides, size):
    """Each rank's weights are the right rows / columns of the whole ones, and the shards recombine: the q/k/v
    rows of its heads (KV heads by the map), o_proj's columns of the same heads, gate and up over one
    intermediate slice with down's matching columns (the row-parallel sum gives the whole MLP), the LM head's
    vocabulary rows (a view of a tied embedding)."""
    path = write_checkpoint(tmp_path / "m", arch=arch, shape="tiny", seed=3, **overrides)
    cfg = ModelConfig.from_dir(path)
    full = load_weights(path, cfg, torch.float32, torch.device("cpu"))
    d, q_size, kv_size, inter = cfg.head_dim, cfg.q_size, cfg.kv_size, cfg.intermediate_size
    wq, wk, wv = full.layers[0].qkv.split([q_size, kv_size, kv_size])
    x = torch.randn(3, cfg.hidden_size)
    mlp = torch.zeros(3, cfg.hidden_size)
    logits = []
    for rank in range(size):
        plan = ShardPlan(cfg, rank, size)
        part = load_weights(path, cfg, torch.float32, torch.device("cpu"), shard=plan)
        layer, whole = part.layers[0], full.layers[0]
        heads = range(plan.first_head, plan.first_head + plan.num_heads)
        rows = lambda w, hs: torch.cat([w[h * d:(h + 1) * d] for h in hs])  # noqa: E731
        want_qkv = torch.cat([rows(wq, heads), rows(wk, plan.kv_heads), rows(wv, plan.kv_heads)])
        assert torch.equal(layer.qkv, want_qkv)
        if cfg.qkv_bias:
            bq, bk, bv = whole.qkv_bias.split([q_size, kv_size, kv_size])
            assert torch.equal(layer.qkv_bias, torch.cat([rows(bq, heads), rows(bk, plan.kv_heads),
                                                          rows(bv, plan.kv_heads)]))
        assert torch.equal(layer.o_proj, whole.o_proj[:, plan.first_head * d:(plan.first_head + plan.num_heads) * d])
        lo, hi = plan.intermediate
        assert torch.equal(layer.gate_up, torch.cat([whole.gate_up[lo:hi], whole.gate_up[inter + lo:inter + hi]]))
        gate, up = F.linear(x, layer.gate_up).chunk(2, dim=-1)
        mlp += F.linear(F.silu(gate) * up, layer.down)
        assert torch.equal(part.embed, full.embed) and torch.equal(layer.input_norm, whole.input_norm)
        if cfg.qk_norm:
            assert torch.equal(layer.k_norm, whole.k_norm)
        v0, v1 = plan.vocab
        assert torch.equal(part.lm_head, full.lm_head[v0:v1])
        if cfg.tie_word_embeddings:
            assert part.lm_head.data_ptr() == part.embed[v0].data_ptr()  # a view, not a copy
        logits.append(F.linear(x, part.lm_head))
    gate, up = F.linear(x, full.layers[0].gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(mlp, F.linear(F.silu(gate) * up, full.layers[0].down))
    torch.testing.assert_close(torch.cat(logits, dim=1), F.linear(x, full.lm_head))
