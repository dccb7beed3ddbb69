"""The reads-before-the-wait contract of the CUDA kernels, checked on the launch order CudaOps produces.

Under programmatic dependent launch a kernel reads some operands before it waits for the kernel launched just
before it (kernels_cu/common.cuh): the skinny kernels their epilogue's operands, the sampling kernels their row
parameters, decode attention its tables. That is safe only if the launch just before does not write them,
which depends on the order in which engine/cuda/ops.py and the model issue the launches: a race that the GPU
tests would catch only by chance. Here CudaOps runs a decode step (decode_prepare, the forward, the sampling
chain, decode_commit) on the CPU with every launch wrapper of engine/cuda/wrappers/ replaced by a recorder of the
launch and its operands by name (bound to the real wrapper's signature), and every pair of consecutive launches
is checked against the kernels' launch contracts below.
"""
from __future__ import annotations

import inspect

import pytest
import torch

from engine.config import ModelConfig
from engine.cuda.checks import overlaps
from engine.cuda.ops import CudaOps
from engine.cuda.wrappers import (
    decode_attention,
    decode_step,
    embedding,
    prefill_attention,
    rms_norm,
    rope_cache_write,
    sampling,
    silu_and_mul,
    skinny_linear,
    spec_accept,
)
from engine.kv_cache import KVCache
from engine.loader import load_weights
from engine.models.llama import LlamaModel
from engine.outputs import StepOutputs
from engine.quant import FP8_DTYPE
from engine.slot_io import KernelSlotIO
from engine.state import SlotState

from conftest import TINY_CONFIGS

# What each kernel writes, and what it reads before its wait (the launch contracts in kernels_cu/*.cu), by
# "wrapper module.function" (engine/cuda/wrappers/) and the wrapper's parameter names.
WRITES = {
    "decode_step.prepare": {"input_ids", "positions", "slot_mapping", "seq_lens", "tables", "row_temperature",
                            "row_top_k", "row_top_p", "row_seed", "row_penalty", "row_position", "row_seen"},
    "embedding.launch": {"out"},
    "skinny_linear.rope_kv": {"q_out", "k_cache", "v_cache"},
    "rope_cache_write.launch": {"q_out", "k_cache", "v_cache"},
    "decode_attention.launch": {"out", "part_o", "part_lse", "counters"},
    "skinny_linear.residual": {"residual"},
    "skinny_linear.silu": {"out"},
    "skinny_linear.store": {"out"},
    "rms_norm.residual_norm": {"h", "out"},
    "rms_norm.launch": {"out"},
    "silu_and_mul.launch": {"out"},
    "sampling.stats": {"parts"},
    "sampling.select": {"thresholds"},
    "sampling.draw": {"parts"},
    "sampling.finish": {"tokens", "logprobs"},
    "decode_step.commit": {"num_cached", "last_token", "seen", "out_tokens", "out_logprobs"},
}
ROW_PARAMS = {"temperature", "top_k", "top_p", "seed", "penalty", "position"}
BEFORE_WAIT = {
    "skinny_linear.residual": {"residual"},
    "skinny_linear.rope_kv": {"bias", "cos_sin", "rope_index", "slot_mapping"},
    "skinny_linear.store": {"bias"},
    "sampling.stats": ROW_PARAMS,
    "sampling.select": ROW_PARAMS,
    "sampling.draw": ROW_PARAMS,
    "sampling.finish": {"temperature"},
    # with fresh >= 0 (its older cache rows: a row-level promise, fresh = the forward's tokens, not checked here)
    "decode_attention.launch": {"block_tables", "seq_lens"},
}
WRAPPERS = (decode_attention, decode_step, embedding, prefill_attention, rms_norm, rope_cache_write, sampling,
            silu_and_mul, skinny_linear, spec_accept)
# The wrappers' grid-sizing helpers (they take the library but launch nothing), answered as a GPU would.
SIZING = {
    (decode_attention, "key_splits"):
        lambda lib, batch, num_heads, num_kv_heads, head_dim, max_seq_len, fp8_kv=False: 4,
    (decode_attention, "fits_one_wave"): lambda lib, *args, **kwargs: True,
    (decode_attention, "cluster_size"): lambda lib, num_splits: min(num_splits, lib.decode_cluster),
    (sampling, "vocab_splits"): lambda lib, rows, vocab: 2,
    (sampling, "topk_fits"): lambda lib, vocab, k: True,
}


class RecordingLib:
    """Stands in for the KernelLibrary (the device numbers the wrappers read) and keeps the launches that
    record_launches records."""

    device = torch.device("cpu")
    decode_cluster = 8
    skinny_wide_tiles = 132
    skinny_fp8_warps, skinny_fp8_wave_tiles = 4, 264
    gemm_sm90 = False  # no Hopper GEMM here: CudaOps keeps its cuBLAS paths

    def __init__(self):
        self.launches: list[tuple[str, dict]] = []


def recorder(name: str, real):
    """A stand-in for the launch wrapper `real` that records (name, {operand name: tensor}) in lib.launches."""
    sig = inspect.signature(real)

    def launch(lib, *args, **kwargs):
        bound = sig.bind(lib, *args, **kwargs)
        tensors = {k: v for k, v in bound.arguments.items() if isinstance(v, torch.Tensor)}
        if name == "decode_attention.launch" and kwargs.get("rope"):
            k, v, cos_sin, rope_index, slot_mapping = kwargs["rope"]
            tensors.update(k_new=k, v_new=v, cos_sin=cos_sin, rope_index=rope_index, slot_mapping=slot_mapping)
        if name == "decode_attention.launch" and kwargs.get("fresh", -1) < 0:
            name_ = "decode_attention.launch (fresh < 0)"  # reads nothing before its wait
        else:
            name_ = name
        lib.launches.append((name_, tensors))
    return launch


def record_launches(monkeypatch) -> None:
    """Replaces every launch wrapper (a public function of WRAPPERS taking the library first, other than the
    SIZING helpers) with its recorder, and the SIZING helpers with their answers."""
    for (module, name), answer in SIZING.items():
        monkeypatch.setattr(module, name, answer)
    for module in WRAPPERS:
        prefix = module.__name__.rsplit(".", 1)[1]
        for name, fn in list(vars(module).items()):
            if (name.startswith("_") or not inspect.isfunction(fn) or fn.__module__ != module.__name__
                    or (module, name) in SIZING or next(iter(inspect.signature(fn).parameters), None) != "lib"):
                continue
            monkeypatch.setattr(module, name, recorder(f"{prefix}.{name}", fn))


def violations(launches: list[tuple[str, dict]]) -> list[str]:
    """Pairs of consecutive launches where the second reads before its wait what the first writes."""
    found = []
    for (a, ta), (b, tb) in zip(launches, launches[1:]):
        for r in BEFORE_WAIT.get(b, ()):
            for w in WRITES.get(a, ()):
                if r in tb and w in ta and overlaps(tb[r], ta[w]):
                    found.append(f"{b}.{r} is read before its wait and written by {a}.{w}, the launch just before")
    return found


def decode_launches(model_dir, batch_size: int, monkeypatch, kv_dtype: torch.dtype = torch.bfloat16,
                    quantization: str = "none", quantize_lm_head: bool = False,
                    fp8_activation_scheme: str = "dynamic") -> list[tuple[str, dict]]:
    """The launches of one decode step of batch_size sequences through CudaOps and KernelSlotIO, as
    DecodePipeline._step_into_outputs issues them: decode_prepare, the model's forward, the sampling chain,
    decode_commit. kv_dtype: the KV cache's (bf16, or E4M3: --kv-cache-dtype fp8). quantization "fp8":
    per-channel FP8 projections (the skinny kernels' _fp8 entries) of fp8_activation_scheme."""
    cfg = ModelConfig.from_dir(model_dir)
    dev, dt = torch.device("cpu"), torch.bfloat16
    weights = load_weights(model_dir, cfg, dt, dev, quantization=quantization, quantize_lm_head=quantize_lm_head,
                           fp8_activation_scheme=fp8_activation_scheme)
    block_size, blocks_per_seq = 16, 4
    B, S = batch_size, batch_size + 2
    kv = KVCache(cfg.num_layers, S * blocks_per_seq + 1, block_size, cfg.num_kv_heads, cfg.head_dim, kv_dtype, dev)
    record_launches(monkeypatch)
    lib = RecordingLib()
    ops = CudaOps(lib, max_seq_len=block_size * blocks_per_seq)
    model = LlamaModel(cfg, weights, kv, ops, block_size * blocks_per_seq + 1)
    state = SlotState(S, blocks_per_seq, cfg.vocab_size, dev)
    state.block_table.copy_(torch.arange(S * blocks_per_seq, dtype=torch.int32).view(S, blocks_per_seq) + 1)
    state.num_cached.fill_(19)
    slots = torch.arange(1, B + 1)
    slot_io = KernelSlotIO(state, block_size, lib)
    batch, rows = slot_io.decode_inputs(slots, [20] * B, False)
    out = ops.sample(model.forward(batch), rows)
    slot_io.decode_commit(slots, out, StepOutputs(B, 0, S, dev), 0)
    return lib.launches


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("batch_size", [1, 3, 8])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_decode_step_keeps_the_reads_before_the_wait_contract(checkpoints, name, batch_size, kv_dtype, monkeypatch):
    """The same launch chain and contract with an E4M3 KV cache (--kv-cache-dtype fp8): the wrappers pick the
    _kvfp8 entries (the same operands and launch contracts); no conversion launch enters the chain."""
    launches = decode_launches(checkpoints[name], batch_size, monkeypatch, kv_dtype)
    names = [n for n, _ in launches]
    if kv_dtype == FP8_DTYPE:
        assert names == [n for n, _ in decode_launches(checkpoints[name], batch_size, monkeypatch)]
        caches = [t for _, ts in launches for k, t in ts.items() if k in ("k_cache", "v_cache")]
        assert caches and all(t.dtype == FP8_DTYPE for t in caches)
    assert names[:2] == ["decode_step.prepare", "embedding.launch"]
    assert "sampling.finish" in names and names[-1] == "decode_step.commit"
    if batch_size <= 8 and "qwen3" not in name:  # the skinny forwards (q/k norm takes the composed QKV path)
        assert {"skinny_linear.rope_kv", "skinny_linear.residual", "skinny_linear.silu",
                "skinny_linear.store"} <= set(names)
    assert violations(launches) == []


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE])
@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("name", sorted(TINY_CONFIGS))
def test_fp8_decode_step_keeps_the_reads_before_the_wait_contract(checkpoints, name, batch_size, kv_dtype,
                                                                   monkeypatch):
    """Per-channel FP8 projections (and LM head) take the same skinny launches (their _fp8 entries read the
    weight's scale before the wait, like the weight: written once at load) in the same order, on a 16-bit or an
    E4M3 KV cache (FP8 weights and FP8 KV together: the skinny QKV kernel's rope_kvfp8 _fp8 entries)."""
    launches = decode_launches(checkpoints[name], batch_size, monkeypatch, kv_dtype, quantization="fp8",
                               quantize_lm_head=True)
    names = [n for n, _ in launches]
    assert {"skinny_linear.residual", "skinny_linear.silu", "skinny_linear.store"} <= set(names)
    assert violations(launches) == []
    if "qwen3" not in name:  # (Qwen3's composed QKV path runs its FP8 projection as one more skinny_store)
        assert "skinny_linear.rope_kv" in names
        assert names == [n for n, _ in decode_launches(checkpoints[name], batch_size, monkeypatch, kv_dtype)]
    if kv_dtype == FP8_DTYPE:
        caches = [t for _, ts in launches for k, t in ts.items() if k in ("k_cache", "v_cache")]
        assert caches and all(t.dtype == FP8_DTYPE for t in caches)


@pytest.mark.parametrize("batch_size", [16, 32])
@pytest.mark.parametrize("name", ["llama-gqa", "qwen2-bias-tied", "qwen3-qknorm"])
def test_weight_only_fp8_decode_past_8_rows_takes_the_skinny_w8a16_kernels(checkpoints, name, batch_size,
                                                                            monkeypatch):
    """Weight-only FP8 (--fp8-activation-scheme none) in decode forwards of 9-32 rows: every projection on the skinny
    kernels' W8A16 (_fp8) entries (store for the QKV projection and the LM head, residual for o_proj and down, silu
    for gate_up; no activation quantization), and the launch order keeps the contract (the residual kernels read h
    early: the rms_norm launched after each residual add reads it only)."""
    launches = decode_launches(checkpoints[name], batch_size, monkeypatch, quantization="fp8", quantize_lm_head=True,
                               fp8_activation_scheme="none")
    names = [n for n, _ in launches]
    num_layers = ModelConfig.from_dir(checkpoints[name]).num_layers
    assert names.count("skinny_linear.residual") == 2 * num_layers and names.count("skinny_linear.silu") == num_layers
    assert names.count("skinny_linear.store") == num_layers + 1  # each layer's QKV projection, then the LM head
    assert all(ts["x"].dtype == torch.bfloat16 and "x_scale" not in ts
               for n, ts in launches if n.startswith("skinny_linear."))
    assert violations(launches) == []


def test_the_check_finds_a_launch_that_writes_what_the_next_reads_early(checkpoints, monkeypatch):
    """A kernel that wrote the residual right before o_proj's skinny_residual (e.g. a norm launched between
    attention and o) must be flagged; so must one that rewrote the row parameters before sample_stats."""
    launches = decode_launches(checkpoints["llama-gqa"], 1, monkeypatch)
    i = next(k for k, (n, _) in enumerate(launches) if n == "skinny_linear.residual")
    h = launches[i][1]["residual"]
    bad = launches[:i] + [("rms_norm.launch", {"out": h})] + launches[i:]
    assert any("skinny_linear.residual.residual" in v for v in violations(bad))
    j = next(k for k, (n, _) in enumerate(launches) if n == "sampling.stats")
    bad = launches[:j] + [("decode_step.prepare", launches[0][1])] + launches[j:]
    assert any("sampling.stats.temperature" in v for v in violations(bad))
    # the first QKV right after decode_prepare (no embedding launch between them) reads its slot_mapping and
    # positions before its wait, which decode_prepare writes
    assert launches[1][0] == "embedding.launch" and launches[2][0] == "skinny_linear.rope_kv"
    bad = [launches[0]] + launches[2:]
    assert any("skinny_linear.rope_kv.slot_mapping" in v and "decode_step.prepare.slot_mapping" in v
               for v in violations(bad))


@pytest.mark.parametrize("epilogue,rows,pdl", [("residual", 4096, False), ("residual", 2048, True),
                                               ("silu", 28672, True), ("rope_kv", 6144, True)])
def test_only_8_warp_residual_grids_launch_without_pdl(epilogue, rows, pdl):
    """skinny_linear._launch's rule: the residual epilogue on 8-warp blocks (more tiles than SMs: the 8B's
    o_proj and down) launches serialised; 16-warp residual grids (the 1B's) and the other epilogues keep PDL."""
    from engine.cuda.wrappers import skinny_linear

    calls = []

    class Lib:  # the two attributes _launch reads
        skinny_wide_tiles = 132
        kernels = {}

    class Recorder(dict):
        def __missing__(self, name):
            return lambda grid, block, smem, stream, *args, **kw: calls.append((name, grid, block, kw))

    Lib.kernels = Recorder()
    Lib.stream = staticmethod(lambda: 0)
    skinny_linear._launch(Lib, epilogue, "bf16", 1, rows)
    (name, grid, block, kw), = calls
    assert grid == (rows // 16, 1, 1) and name.endswith("_w16") == (rows // 16 <= 132)
    assert kw["pdl"] is pdl
