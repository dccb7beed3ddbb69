"""Every kernel of kernels_cu/ against its torch reference (engine/ops/torch_ops.py, engine/sampling.py)
on fresh random inputs over many shapes.

Numerical kernels: relative error ||out - ref|| / ||ref|| against an fp32 reference computed from the
same (bf16 / fp16) inputs: at most 1e-2 (fp32 paths: 1e-5); NaN never passes; outputs are NaN-filled
before each launch so an unwritten element fails. Sampling and speculative acceptance: identical
tokens. Last, the decode-path ops are captured in a CUDA graph and replayed with growing seq_lens.
Set METRALE_KERNEL_REPORT=path to get a summary of the errors measured.
"""
from __future__ import annotations

import os
import random

import pytest
import torch
import torch.nn.functional as F

from engine import sampling
from engine.cuda.wrappers import (
    decode_attention,
    decode_step,
    embedding,
    prefill_attention,
    rms_norm,
    rope_cache_write,
    silu_and_mul,
    spec_accept,
)
from engine.cuda.wrappers import sampling as sample_kernels
from engine.ops.torch_ops import LayerKV, TorchOps
from engine.slot_io import KernelSlotIO, SlotIO
from gpu.helpers import (PREFILL_PATHS, attention_layer, attention_meta, dev, nan, prefill_path, randn,
                         scattered_tables)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16]
BF16_TOL = 1e-2
FP32_TOL = 1e-5
TORCH = TorchOps()
MAX_SEQ_LEN = 16384  # the context bound CudaOps sizes decode attention's split grid with
_ERRORS: dict[str, float] = {}


@pytest.fixture(scope="module")
def ops(lib):
    from engine.cuda.ops import CudaOps
    return CudaOps(lib, MAX_SEQ_LEN)


@pytest.fixture(scope="module", autouse=True)
def _report():
    yield
    path = os.environ.get("METRALE_KERNEL_REPORT")
    if path and _ERRORS:
        groups: dict[str, float] = {}
        for key, err in _ERRORS.items():
            name = key.split("[")[0]
            groups[name] = max(groups.get(name, 0.0), err)
        with open(path, "a") as f:
            for name, err in sorted(groups.items()):
                f.write(f"max relative error {name}: {err:.3e}\n")


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> float:
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), f"{name}: NaN in the output (an element left unwritten?)"
    err = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    _ERRORS[name] = max(_ERRORS.get(name, 0.0), err)
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"
    return err


# ---------------------------------------------------------------------------------------------
# Library

def test_library_resolves_every_kernel(lib):
    from engine.cuda import build
    from engine.cuda.library import expected_symbols
    arch = lib.compute_capability[0] * 10 + lib.compute_capability[1]
    names = [n for module, names in expected_symbols().items()
             if build.serves((build.KERNEL_DIR / f"{module}.cu").read_text(), arch) for n in names]
    assert sorted(lib.kernels) == sorted(names)
    print("kernel origins:", lib.origin)


def test_bad_arguments_are_refused_before_launch(lib):
    from engine.cuda.driver import KernelArgError
    x = randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(KernelArgError, match="dtype"):
        rms_norm.launch(lib, nan((4, 64), torch.bfloat16), x, randn(64, dtype=torch.float16), 1e-6)
    with pytest.raises(KernelArgError, match="contiguous"):
        silu_and_mul.launch(lib, nan((64, 4), torch.bfloat16).t(), randn(4, 128, dtype=torch.bfloat16))
    with pytest.raises(KernelArgError, match="float32"):
        rms_norm.launch(lib, nan((4, 64), torch.float32), x.float(), randn(64), 1e-6)


def test_nvrtc_fallback_loads_every_kernel(lib, gen, tmp_path):
    """No fatbins: every module is compiled by NVRTC for the device, cached, and computes the same."""
    from engine.cuda.library import KernelLibrary
    nv = KernelLibrary(lib.device, build_dir=tmp_path / "no-fatbins", cache_dir=tmp_path / "cache")
    assert set(nv.origin.values()) == {"nvrtc"}, nv.origin
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == len(nv.origin)
    x, w = randn(5, 2048, dtype=torch.bfloat16), randn(2048, dtype=torch.bfloat16)
    a, b = nan((5, 2048), torch.bfloat16), nan((5, 2048), torch.bfloat16)
    rms_norm.launch(lib, a, x, w, 1e-6)
    rms_norm.launch(nv, b, x, w, 1e-6)
    assert torch.equal(a, b)
    again = KernelLibrary(lib.device, build_dir=tmp_path / "no-fatbins", cache_dir=tmp_path / "cache")
    assert set(again.origin.values()) == {"nvrtc-cache"}, again.origin


def test_engine_streams_stage_and_time(lib, gen):
    from engine.cuda.streams import EngineStreams
    streams = EngineStreams(lib.device)
    src = torch.arange(1 << 20, dtype=torch.float32).pin_memory()
    dst = torch.empty(1 << 20, device=lib.device)
    x = randn(64, 4096, dtype=torch.bfloat16)
    out = nan((64, 4096), torch.bfloat16)
    weight = torch.ones(4096, dtype=torch.bfloat16, device=lib.device)
    torch.cuda.synchronize()  # the inputs were written on the default stream; the compute stream must see them
    with streams.compute_context():
        streams.stage(dst, src)
        with streams.timed() as t:
            doubled = dst * 2  # ordered after the staged copy by the event
            rms_norm.launch(lib, out, x, weight, 1e-6)
    streams.wait_staged()
    assert t.elapsed_ns() > 0
    streams.synchronize()
    assert torch.equal(doubled.cpu(), src * 2)
    assert not torch.isnan(out.float()).any()
    del doubled  # allocated on the compute stream: released before the stream goes
    torch.cuda.synchronize()
    streams.close()


# ---------------------------------------------------------------------------------------------
# Elementwise and normalisation

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,vocab,hidden", [(1, 1000, 2048), (37, 5000, 4096), (256, 32000, 1024)])
def test_embedding(lib, gen, dtype, tokens, vocab, hidden):
    weight = randn(vocab, hidden, dtype=dtype)
    ids = torch.randint(0, vocab, (tokens,), device=dev())
    out = nan((tokens, hidden), dtype)
    embedding.launch(lib, out, ids, weight)
    assert torch.equal(out, F.embedding(ids, weight))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,D", [(1, 2048), (7, 4096), (256, 2048), (3, 8192), (100, 64), (33, 128),
                                    (5, 16384), (17, 512), (1024, 2048), (1500, 4096), (1030, 8192), (1024, 128)])
def test_rms_norm(lib, gen, dtype, rows, D):
    x, w = randn(rows, D, dtype=dtype, scale=3.0), (1 + 0.1 * randn(D)).to(dtype)
    out = nan((rows, D), dtype)
    rms_norm.launch(lib, out, x, w, 1e-5)
    check("rms_norm", out, TORCH.rms_norm(x.float(), w.float(), 1e-5), BF16_TOL)
    # Same roundings as the torch op on the same dtype: far closer than the dtype's resolution.
    check("rms_norm_vs_same_dtype", out, TORCH.rms_norm(x, w, 1e-5), 2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("S,rows,D", [(1, 9, 2048), (4, 32, 2048), (4, 64, 4096), (3, 17, 512), (4, 1, 8192),
                                      (2, 40, 128)])
def test_residual_norm(lib, gen, dtype, S, rows, D):
    """The end of a split-K linear layer: h = h + the partials summed in order (fp32, one rounding), bit for
    bit as the same sums in torch; the norm after it as rms_norm of the new h."""
    from engine.cuda.driver import KernelArgError
    h, parts = randn(rows, D, dtype=dtype, scale=2.0), randn(S, rows, D, scale=2.0)
    w = (1 + 0.1 * randn(D)).to(dtype)
    acc = parts[0].clone()
    for s in range(1, S):
        acc = acc + parts[s]
    h_ref = (acc + h.float()).to(dtype)
    out = nan((rows, D), dtype)
    h2 = h.clone()
    rms_norm.residual_norm(lib, h2, None, parts, None, 1e-5)  # the add alone
    assert torch.equal(h2, h_ref)
    rms_norm.residual_norm(lib, h, out, parts, w, 1e-5)
    assert torch.equal(h, h_ref)
    check("residual_norm's norm", out, TORCH.rms_norm(h_ref.float(), w.float(), 1e-5), BF16_TOL)
    check("residual_norm's norm vs same dtype", out, TORCH.rms_norm(h_ref, w, 1e-5), 2e-3)
    with pytest.raises(KernelArgError):
        rms_norm.residual_norm(lib, h, out, parts[:, :-1] if rows > 1 else parts[:, :, :-8], w, 1e-5)
    with pytest.raises(KernelArgError):
        rms_norm.residual_norm(lib, h, None, parts, w, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hkv,D", [(1, 32, 8, 128), (50, 16, 2, 64), (300, 8, 8, 128)])
def test_rms_norm_per_head_on_qkv_views(lib, gen, dtype, T, H, Hkv, D):
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype, scale=2.0)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    w = (1 + 0.1 * randn(D)).to(dtype)
    for x in (q, k):
        out = nan(tuple(x.shape), dtype)
        rms_norm.launch(lib, out, x, w, 1e-6)
        check("rms_norm_per_head", out, TORCH.rms_norm(x.float(), w.float(), 1e-6), BF16_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,I", [(1, 8192), (64, 5632), (300, 64), (8, 14336)])
def test_silu_and_mul(lib, gen, dtype, T, I):
    x = randn(T, 2 * I, dtype=dtype, scale=2.0)
    out = nan((T, I), dtype)
    silu_and_mul.launch(lib, out, x)
    check("silu_and_mul", out, F.silu(x[:, :I].float()) * x[:, I:].float(), BF16_TOL)


def rope_table(P: int, D: int) -> torch.Tensor:
    freq = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev(), dtype=torch.float32) / D))
    angles = torch.arange(P, device=dev(), dtype=torch.float32)[:, None] * freq[None, :]
    return torch.cat((angles.cos(), angles.sin()), dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hkv,D,bs", [(1, 32, 8, 64, 16), (37, 32, 8, 128, 16), (256, 16, 4, 128, 32),
                                          (200, 8, 1, 64, 16), (9, 4, 2, 72, 16),
                                          (5, 4, 2, 16, 16)])
def test_rope_cache_write(lib, gen, dtype, T, H, Hkv, D, bs):
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    cos_sin = rope_table(4096, D)
    rope_index = torch.randint(0, 4096, (T,), device=dev())
    num_blocks = -(-T // bs) + 3
    slots = torch.randperm(num_blocks * bs, device=dev())[:T]
    k_cache, v_cache = nan((num_blocks, bs, Hkv, D), dtype), nan((num_blocks, bs, Hkv, D), dtype)
    q_out = nan((T, H, D), dtype)
    rope_cache_write.launch(lib, q_out, q, k, v, cos_sin, rope_index, k_cache, v_cache, slots)

    k_ref = torch.zeros((num_blocks, bs, Hkv, D), device=dev())
    v_ref = torch.zeros_like(k_ref)
    q_ref = TORCH.rope_cache_write(q.float(), k.float(), v.float(), cos_sin, rope_index, k_ref, v_ref, slots)
    flat = num_blocks * bs
    check("rope_q", q_out, q_ref, BF16_TOL)
    check("rope_k_cache", k_cache.view(flat, Hkv, D)[slots], k_ref.view(flat, Hkv, D)[slots], BF16_TOL)
    assert torch.equal(v_cache.view(flat, Hkv, D)[slots], v)
    untouched = torch.ones(flat, dtype=torch.bool, device=dev())
    untouched[slots] = False
    assert torch.isnan(k_cache.view(flat, Hkv, D)[untouched]).all(), "a write outside slot_mapping"
    assert torch.isnan(v_cache.view(flat, Hkv, D)[untouched]).all(), "a write outside slot_mapping"
    # The products and sums are rounded one by one as torch's eager ops do: bit-identical.
    k_same, v_same = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    q_same = TORCH.rope_cache_write(q, k, v, cos_sin, rope_index, k_same, v_same, slots)
    assert torch.equal(q_out, q_same)
    assert torch.equal(k_cache.view(flat, Hkv, D)[slots], k_same.view(flat, Hkv, D)[slots])


# ---------------------------------------------------------------------------------------------
# Attention over the paged cache

def paged_cache(seq_lens: list[int], Hkv: int, D: int, bs: int, dtype, extra_blocks: int = 2):
    """Random K/V caches with each sequence's blocks scattered; block 0 is the scratch block (unused
    table entries point at it, as in the engine)."""
    per_seq = [-(-s // bs) for s in seq_lens]
    num_blocks = sum(per_seq) + 1
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    table = torch.zeros((len(seq_lens), max(per_seq) + extra_blocks), dtype=torch.int32)
    at = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    k_cache = randn(num_blocks, bs, Hkv, D, dtype=dtype)
    v_cache = randn(num_blocks, bs, Hkv, D, dtype=dtype)
    return k_cache, v_cache, table.to(dev())


DECODE_CASES = [
    # B, max context, H, Hkv, D, block_size, window
    (1, 1, 32, 8, 64, 16, 0),
    (1, 300, 32, 8, 64, 16, 0),  # the 1B decode benchmark's contexts: merged inside one cluster on sm_90
    (2, 512, 32, 8, 128, 16, 0),
    (1, 8229, 32, 8, 128, 16, 0),
    (3, 3000, 32, 8, 64, 32, 0),
    (256, 200, 32, 8, 64, 16, 0),
    (32, 2048, 32, 8, 64, 16, 0),
    (8, 1000, 8, 8, 128, 16, 0),
    (4, 1500, 32, 4, 128, 16, 0),
    (4, 700, 32, 1, 128, 16, 0),
    (5, 2000, 16, 4, 128, 16, 500),
    (2, 900, 12, 2, 96, 16, 0),
    (3, 500, 4, 2, 16, 16, 0),  # the tiny test models' head_dim
    (2, 700, 8, 2, 32, 16, 64),
    (2, 1200, 16, 2, 80, 32, 0),
    (3, 400, 32, 8, 64, 1, 0),  # block_size 1: a tile's 64 keys in 64 blocks (two table entries a lane)
    (2, 3500, 16, 4, 128, 2, 333),  # block_size 2 and a window: tiles start mid-block (33 entries)
    (2, 5000, 32, 8, 64, 128, 0),  # a block longer than a tile
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,ctx,H,Hkv,D,bs,window", DECODE_CASES)
def test_decode_attention(lib, gen, dtype, B, ctx, H, Hkv, D, bs, window):
    seq_lens = [ctx] + [random.Random(gen + b).randint(1, ctx) for b in range(1, B)]
    k_cache, v_cache, table = paged_cache(seq_lens, Hkv, D, bs, dtype)
    q = randn(B, H, D, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev())
    scale = D ** -0.5
    ref = TORCH.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, scale, window)
    counters = torch.zeros(B * H, dtype=torch.int32, device=dev())
    # 48: more splits than a warp's lanes (the global merge takes them in two passes)
    for splits in sorted({decode_attention.key_splits(lib, B, H, Hkv, D, MAX_SEQ_LEN), 1, 7, 16, 48}):
        # clusters (sm_90): the splits of a sequence whose keys fit in one cluster merge in shared memory
        for cluster in sorted({1, decode_attention.cluster_size(lib, splits)}):
            outs = []
            for _ in range(2):
                out = nan((B, H, D), dtype)
                part_o, part_lse = nan((B, H, splits, D), torch.float32), nan((B, H, splits), torch.float32)
                decode_attention.launch(lib, out, part_o, part_lse, counters, q, k_cache, v_cache, table, lens, scale,
                                        window, splits, cluster)
                check(f"decode_attention ({splits} splits, clusters of {cluster})", out, ref, BF16_TOL)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), "the merge of the splits must not depend on block timing"
            assert not counters.any(), "the split tickets must be back at zero after the launch"


def split_attention(lib, q, k_cache, v_cache, table, lens, splits, counters, ref, label) -> torch.Tensor:
    """decode_attention.launch over `splits` key splits (no window), checked against the reference ref."""
    B, H, D = q.shape
    out = nan((B, H, D), q.dtype)
    part_o, part_lse = nan((B, H, splits, D), torch.float32), nan((B, H, splits), torch.float32)
    decode_attention.launch(lib, out, part_o, part_lse, counters, q, k_cache, v_cache, table, lens, D ** -0.5, 0,
                            splits)
    check(f"decode_attention d{D} ({splits} splits, {label})", out, ref, BF16_TOL)
    return out


@pytest.mark.parametrize("D", [16, 32, 64, 80, 96])
def test_decode_attention_shallow_entries_match_the_default_ones(lib, gen, D):
    """Grids of more than one wave at head_dim < 128 run the 2-deep _s2 entries (shallow_entry): the same
    results as the default entries (lib.decode_shallow off) and the torch reference, bit for bit between the two
    for every split count (the pipeline depth changes when tiles arrive, not the arithmetic)."""
    B, H, Hkv, dtype = 96, 16, 4, torch.bfloat16
    seq_lens = [700] + [random.Random(gen + b).randint(1, 700) for b in range(1, B)]
    k_cache, v_cache, table = paged_cache(seq_lens, Hkv, D, 16, dtype)
    q = randn(B, H, D, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev())
    ref = TORCH.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, D ** -0.5, 0)
    counters = torch.zeros(B * H, dtype=torch.int32, device=dev())
    before = lib.decode_shallow
    try:
        for splits in (1, 4, 16):
            outs = []
            for shallow in (True, False):
                lib.decode_shallow = shallow
                assert decode_attention.shallow_entry(lib, splits * B * Hkv, D, rope=False, fp8_kv=False) == (
                    shallow and splits * B * Hkv > decode_attention.blocks_per_sm(lib, D) * lib.num_sms)
                outs.append(split_attention(lib, q, k_cache, v_cache, table, lens, splits, counters, ref,
                                            f"shallow={shallow}"))
            assert torch.equal(outs[0], outs[1])
        lib.decode_shallow = True
        assert decode_attention.shallow_entry(lib, 16 * B * Hkv, D, rope=False, fp8_kv=False)
    finally:
        lib.decode_shallow = before


WARP_CASES = [
    # B, max context, H, Hkv, D, block_size, window: one split over grids of more than one wave of the default entry
    (160, 700, 32, 8, 128, 16, 0),  # the 8B's heads, contexts 1-700 (one to 44 tiles of 16 keys)
    (300, 200, 32, 8, 128, 16, 0),  # 2,400 items over ~1,056 resident warps: three to a warp
    (700, 90, 24, 2, 128, 32, 0),  # 12 query heads a KV head: rows 8-11 of the chunk from the second row group
    (400, 300, 64, 2, 128, 1, 100),  # 32 a KV head (two head chunks), block_size 1 and a window (tiles mid-block)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,ctx,H,Hkv,D,bs,window", WARP_CASES)
def test_decode_attention_warp_entries(lib, gen, dtype, B, ctx, H, Hkv, D, bs, window):
    """One-split grids of more than one wave at head_dim 128 run the warp entries (warp_entry): persistent
    warps each streaming several items' tiles. Against the torch reference, and beside the block entries
    (lib.decode_warp off); a sequence without keys gets zeros, and a rerun gives the same bits."""
    rng = random.Random(gen)
    seq_lens = [ctx, 0] + [rng.randint(1, ctx) for _ in range(2, B)]
    k_cache, v_cache, table = paged_cache([max(n, 1) for n in seq_lens], Hkv, D, bs, dtype)
    q = randn(B, H, D, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev())
    keyed = lens > 0
    ref = TORCH.decode_attention(q[keyed].float(), k_cache.float(), v_cache.float(), table[keyed], lens[keyed],
                                 D ** -0.5, window)
    counters = torch.zeros(B * H, dtype=torch.int32, device=dev())
    head_chunks = -(-(H // Hkv) // 16)
    before = lib.decode_warp
    try:
        outs = []
        for warp in (True, True, False):
            lib.decode_warp = warp
            assert decode_attention.warp_entry(lib, B * Hkv * head_chunks, 1, D, rope=False, fp8_kv=False) == warp
            out = nan((B, H, D), dtype)
            decode_attention.launch(lib, out, None, None, counters, q, k_cache, v_cache, table, lens, D ** -0.5,
                                    window, 1)
            check(f"decode_attention d{D} warp={warp}", out[keyed], ref, BF16_TOL)
            assert not out[1].any(), "a sequence without keys gets zeros"
            outs.append(out)
        assert torch.equal(outs[0], outs[1])
        assert decode_attention.warp_grid(lib, B * Hkv * head_chunks, D) <= \
            lib.decode_warp_blocks_per_sm[D] * lib.num_sms
    finally:
        lib.decode_warp = before


def test_decode_attention_merges_short_contexts_inside_the_cluster(lib):
    """On sm_90 a sequence whose used splits all lie in its first cluster never touches the partials in
    global memory (the cluster's leader merges them from its peers' shared memory); without clusters,
    the same launch merges through them."""
    if lib.decode_cluster <= 1:
        pytest.skip("thread-block clusters need sm_90")
    B, H, Hkv, D, splits = 2, 32, 8, 64, 32
    seq_lens = [300, 64 * lib.decode_cluster]  # 5 and 8 used splits of 64 keys
    k_cache, v_cache, table = paged_cache(seq_lens, Hkv, D, 16, torch.bfloat16)
    q = randn(B, H, D, dtype=torch.bfloat16)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev())
    ref = TORCH.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, D ** -0.5, 0)
    counters = torch.zeros(B * Hkv, dtype=torch.int32, device=dev())
    for cluster, partials_written in ((lib.decode_cluster, False), (1, True)):
        out = nan((B, H, D), torch.bfloat16)
        part_o, part_lse = nan((B, H, splits, D), torch.float32), nan((B, H, splits), torch.float32)
        decode_attention.launch(lib, out, part_o, part_lse, counters, q, k_cache, v_cache, table, lens, D ** -0.5, 0,
                                splits, cluster)
        check(f"decode_attention (clusters of {cluster})", out, ref, BF16_TOL)
        assert bool((~part_lse.isnan()).any()) == partials_written
        assert not counters.any()


def test_decode_attention_refuses_clusters_that_do_not_divide_the_splits(lib):
    from engine.cuda.driver import KernelArgError
    if lib.decode_cluster <= 1:
        pytest.skip("thread-block clusters need sm_90")
    k_cache, v_cache, table = paged_cache([5], 8, 64, 16, torch.bfloat16)
    q, out = randn(1, 32, 64, dtype=torch.bfloat16), nan((1, 32, 64), torch.bfloat16)
    lens = torch.tensor([5], dtype=torch.int32, device=dev())
    counters = torch.zeros(32, dtype=torch.int32, device=dev())
    part_o, part_lse = nan((1, 32, 12, 64), torch.float32), nan((1, 32, 12), torch.float32)
    with pytest.raises(KernelArgError, match="clusters of 8 for 12 splits"):
        decode_attention.launch(lib, out, part_o, part_lse, counters, q, k_cache, v_cache, table, lens, 0.125, 0, 12, 8)


@pytest.mark.parametrize("B,H,Hkv,D", [(1, 32, 8, 64), (8, 32, 8, 64), (32, 32, 8, 64), (32, 32, 8, 128),
                                       (128, 32, 8, 64), (1, 8, 8, 128)])
def test_decode_splits_fit_in_one_wave(lib, B, H, Hkv, D):
    """Split blocks never spill into a second wave; a sequence gets at most one split per 64-key tile."""
    splits = decode_attention.key_splits(lib, B, H, Hkv, D, MAX_SEQ_LEN)
    blocks = B * Hkv * -(-(H // Hkv) // 16)
    per_sm = lib.decode_blocks_per_sm[D]
    assert per_sm >= 1
    assert 1 <= splits <= -(-MAX_SEQ_LEN // 64)
    if splits > 1:
        assert blocks * splits <= per_sm * lib.num_sms, (blocks, splits, per_sm)
    if blocks <= per_sm * lib.num_sms // 2:
        assert splits >= 2, "a batch that leaves half the GPU idle must split its keys"


PREFILL_CASES = [
    # [(cached tokens, new tokens) per sequence], H, Hkv, D, block_size, window
    ([(0, 1)], 32, 8, 64, 16, 0),
    ([(0, 200)], 32, 8, 128, 16, 0),
    ([(0, 64), (37, 64), (500, 300), (3, 1)], 32, 8, 64, 16, 0),
    ([(0, 1000)], 8, 8, 128, 32, 0),
    ([(100, 900), (0, 130)], 16, 2, 128, 16, 256),
    ([(0, 2048)], 32, 8, 64, 16, 0),
    ([(10, 77)], 12, 2, 96, 16, 0),
    ([(0, 100), (20, 30)], 4, 2, 16, 16, 0),
    ([(0, 150)], 8, 4, 32, 16, 40),
    ([(64, 200)], 16, 2, 80, 16, 0),
    # 128-row items up to head_dim 64 (4 warps of two m-tiles): items of 100 rows (warp 3's second m-tile empty), 1
    # (warps 1-3 without rows) and 33 (warp 1 one row); of 113 and 127 (warp 3's second m-tile partly filled) and 122
    # under a window shorter than a warp's 32 rows (its m-tiles see different keys), after cached prefixes
    ([(130, 100), (0, 257), (5, 33)], 8, 2, 64, 16, 0),
    ([(0, 113), (30, 127), (200, 250)], 16, 4, 64, 16, 24),
    ([(50, 140)], 8, 4, 32, 16, 7),
]


def prefill_inputs(seqs, H, Hkv, D, bs, dtype):
    """A prefill forward's attention inputs for [(cached tokens, new tokens)] per sequence: (q, k_cache, v_cache,
    block table, query start offsets, sequence lengths, work list)."""
    from engine.batch import prefill_work
    seq_lens = [c + n for c, n in seqs]
    qsl = [0]
    for _, n in seqs:
        qsl.append(qsl[-1] + n)
    k_cache, v_cache, table = paged_cache(seq_lens, Hkv, D, bs, dtype)
    q = randn(qsl[-1], H, D, dtype=dtype)
    work = torch.tensor(prefill_work(qsl, seq_lens, D), dtype=torch.int32, device=dev())
    return q, k_cache, v_cache, table, qsl, seq_lens, work


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs,H,Hkv,D,bs,window", PREFILL_CASES)
def test_prefill_attention(lib, gen, dtype, seqs, H, Hkv, D, bs, window):
    q, k_cache, v_cache, table, qsl, seq_lens, work = prefill_inputs(seqs, H, Hkv, D, bs, dtype)
    scale = D ** -0.5
    out = nan(tuple(q.shape), dtype)
    prefill_attention.launch(lib, out, q, k_cache, v_cache, table, work, scale, window)
    ref = TORCH.prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, qsl, seq_lens, scale, window)
    check("prefill_attention", out, ref, BF16_TOL)


PREFILL_SPLIT_CASES = [
    # [(cached tokens, new tokens) per sequence], H, Hkv, D, block_size, window, key splits
    ([(3968, 128)], 32, 8, 64, 16, 0, 6),  # a chunk continuing a long cached prefix (the prefix cache's case)
    ([(4000, 96)], 32, 8, 128, 16, 0, 3),
    ([(1000, 130), (0, 64)], 16, 2, 128, 16, 256, 4),  # a sliding window: early shares hold no key of late rows
    ([(500, 1)], 8, 8, 64, 16, 0, 16),  # more shares than some rows have tiles: empty shares
    ([(0, 200)], 32, 8, 64, 16, 0, 5),  # a fresh prompt: causal rows see no key of the later shares
    ([(77, 33)], 4, 2, 16, 16, 0, 2),
    ([(2000, 97)], 16, 4, 64, 16, 300, 5),  # a window over a long prefix, warp 3 of the item with one row
    ([(3000, 200), (0, 40)], 8, 8, 64, 16, 0, 7),  # items of 72 rows (warp 3 empty) and 40 (one key tile, 7 shares)
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs,H,Hkv,D,bs,window,splits", PREFILL_SPLIT_CASES)
def test_prefill_attention_split_over_keys(lib, gen, dtype, seqs, H, Hkv, D, bs, window, splits):
    """Key splits (partial outputs in fp32, then the merge kernel) against the torch reference, and close to the
    unsplit kernel."""
    q, k_cache, v_cache, table, qsl, seq_lens, work = prefill_inputs(seqs, H, Hkv, D, bs, dtype)
    scale = D ** -0.5
    out, whole = nan(tuple(q.shape), dtype), nan(tuple(q.shape), dtype)
    prefill_attention.launch(lib, out, q, k_cache, v_cache, table, work, scale, window, splits)
    prefill_attention.launch(lib, whole, q, k_cache, v_cache, table, work, scale, window)
    ref = TORCH.prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, qsl, seq_lens, scale, window)
    check("prefill_attention split over keys", out, ref, BF16_TOL)
    check("split vs unsplit", out, whole.float(), BF16_TOL)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_prefill_key_splits_fill_the_gpu_for_a_long_prefix_only(lib, head_dim):
    from engine.batch import prefill_rows
    sms = lib.num_sms
    items = 128 // prefill_rows(head_dim)  # 128 new tokens over a 4k prefix
    assert prefill_attention.key_splits(lib, items, 32, 4096, head_dim) >= 2
    assert lib.prefill_blocks_per_sm[(head_dim, False)] >= 1 and lib.prefill_blocks_per_sm[(head_dim, True)] >= 1
    assert prefill_attention.key_splits(lib, 2, 32, 128, head_dim) == 1  # a short fresh prompt: nothing to split
    assert prefill_attention.key_splits(lib, 4 * sms, 32, 32768, head_dim) == 1  # the grid fills the GPU already
    assert prefill_attention.key_splits(lib, 1, 1, 1 << 20, head_dim) == prefill_attention.MAX_SPLITS


# ---------------------------------------------------------------------------------------------
# Sampling and speculative acceptance

ROW_KINDS = {
    "greedy": dict(temperature=0.0),
    "greedy_penalty": dict(temperature=0.0, repetition_penalty=1.3),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.0, top_k=50),
    "top_k1": dict(temperature=0.7, top_k=1),
    "top_p": dict(temperature=0.9, top_p=0.8),
    "top_p_small": dict(temperature=1.0, top_p=0.05),
    "top_k_top_p": dict(temperature=0.7, top_k=1000, top_p=0.95),
    "penalty_temperature": dict(temperature=1.2, repetition_penalty=1.5),
    "penalty_top_p": dict(temperature=1.0, top_p=0.9, repetition_penalty=0.7),
}


def sampling_tensors(kinds: list[str], vocab: int, seen_fraction: float = 0.05) -> sampling.SamplingTensors:
    n = len(kinds)
    params = [ROW_KINDS[k] for k in kinds]

    def col(name, default, dtype):
        return torch.tensor([p.get(name, default) for p in params], dtype=dtype, device=dev())

    rng = random.Random(int(torch.randint(0, 2**31, ()).item()))
    seeds = torch.tensor([rng.getrandbits(64) - 2**63 for _ in range(n)], dtype=torch.int64, device=dev())
    positions = torch.randint(0, 2**34, (n,), dtype=torch.int64, device=dev())
    return sampling.SamplingTensors(
        temperature=col("temperature", 0.0, torch.float32), top_k=col("top_k", 0, torch.int64),
        top_p=col("top_p", 1.0, torch.float32), seed=seeds,
        repetition_penalty=col("repetition_penalty", 1.0, torch.float32),
        seen=torch.rand(n, vocab, device=dev()) < seen_fraction, position=positions)


def run_sample(lib, logits: torch.Tensor, st: sampling.SamplingTensors):
    """The four sampling kernels with poisoned outputs; returns (tokens, logprobs, thresholds)."""
    rows, vocab = logits.shape
    splits = sample_kernels.vocab_splits(lib, rows, vocab)
    parts = nan((rows, splits, 8), torch.float32)
    thresholds = torch.full((rows,), -1, dtype=torch.int32, device=dev())
    tokens = torch.full((rows,), -1, dtype=torch.int64, device=dev())
    logprobs = nan((rows,), torch.float32)
    args = (logits, st.seen, st.temperature, st.top_k, st.top_p, st.seed, st.repetition_penalty, st.position)
    sample_kernels.stats(lib, parts, *args)
    sample_kernels.select(lib, thresholds, parts, *args)
    sample_kernels.draw(lib, parts, thresholds, *args)
    sample_kernels.finish(lib, tokens, logprobs, parts, logits, st.temperature)
    return tokens, logprobs, thresholds


def float_keys(x: torch.Tensor) -> torch.Tensor:
    """The kernels' order-preserving uint32 image of fp32 values, in int64."""
    u = x.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    return torch.where(u >= 0x80000000, (~u) & 0xFFFFFFFF, u | 0x80000000)


SAMPLE_CASES = [
    # rows, vocab, logit scale, kinds (cycled over the rows)
    (1, 1000, 3.0, ["greedy"]),
    (8, 32000, 3.0, ["greedy", "greedy_penalty"]),
    (64, 32000, 2.0, list(ROW_KINDS)),
    (16, 128256, 4.0, list(ROW_KINDS)),
    (3, 151936, 1.0, ["top_p", "temperature", "top_k_top_p"]),
    (256, 4096, 5.0, list(ROW_KINDS)),
    (7, 50257, 3.0, list(ROW_KINDS)),  # V % 4 != 0: sample_stats' scalar loads
    (32, 128256, 3.0, ["greedy", "greedy_penalty", "temperature"]),  # the 1B decode batch: 16-byte loads
    (2, 300000, 3.0, ["greedy", "temperature"]),  # 293 splits: sample_finish's lanes load more than one batch
]


@pytest.mark.parametrize("rows,vocab,scale,kinds", SAMPLE_CASES)
def test_sample_matches_reference(lib, gen, rows, vocab, scale, kinds):
    logits = randn(rows, vocab, scale=scale)
    row_kinds = [kinds[i % len(kinds)] for i in range(rows)]
    st = sampling_tensors(row_kinds, vocab)
    tokens, logprobs, thresholds = run_sample(lib, logits, st)
    ref = sampling.sample(logits, st)
    mismatch = [(i, row_kinds[i]) for i in range(rows) if tokens[i] != ref.token_ids[i]]
    assert not mismatch, f"token mismatch in rows {mismatch[:10]}"
    check("sample_logprob", logprobs, ref.logprobs, FP32_TOL)

    # The kept set (key >= threshold) against the reference's finite target log-probabilities.
    filtered = [i for i, k in enumerate(row_kinds) if "top" in k]
    if filtered:
        idx = torch.tensor(filtered, device=dev())
        sub = sampling.SamplingTensors(*(getattr(st, f)[idx] for f in
                                         ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "seen",
                                          "position")))
        ref_keep = torch.isfinite(sampling.target_logprobs(logits[idx], sub))
        x = sampling.penalized_logits(logits[idx], sub) / sub.temperature[:, None]
        keep = float_keys(x) >= (thresholds[idx].to(torch.int64) & 0xFFFFFFFF)[:, None]
        diff = (keep != ref_keep).sum(dim=1)
        for j, i in enumerate(filtered):
            limit = 0 if row_kinds[i] in ("top_k", "top_k1") else 2  # fp32 cumsum rounding at the top-p edge
            assert int(diff[j]) <= limit, (f"row {i} ({row_kinds[i]}): kept sets differ in {int(diff[j])} tokens "
                                           f"({int(keep[j].sum())} kept, reference {int(ref_keep[j].sum())})")


def test_sample_through_cuda_ops_with_top_logprobs(ops, gen):
    logits = randn(12, 32000, scale=3.0)
    st = sampling_tensors([list(ROW_KINDS)[i % len(ROW_KINDS)] for i in range(12)], 32000)
    out = ops.sample(logits, st, num_top=5)
    ref = sampling.sample(logits, st, num_top=5)
    assert torch.equal(out.token_ids, ref.token_ids)
    check("sample_logprob", out.logprobs, ref.logprobs, FP32_TOL)
    assert torch.equal(out.top_ids, ref.top_ids)
    check("sample_top_logprobs", out.top_logprobs, ref.top_logprobs, FP32_TOL)


def topk_reference(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k largest logits per row, larger first and the lower id among equals (a stable sort of the
    negated logits), and their log-softmax."""
    ids = torch.sort(-logits, dim=-1, stable=True).indices[:, :k]
    return ids, torch.log_softmax(logits, dim=-1).gather(1, ids)


@pytest.mark.parametrize("rows,vocab,k", [(1, 128256, 20), (32, 128256, 20), (5, 32000, 1), (3, 50001, 32),
                                          (2, 4096, 7), (2, 262144, 32), (1, 1000, 32)])
def test_sample_topk_kernels_match_a_stable_sort(ops, gen, rows, vocab, k):
    """sample_topk_split + sample_topk_merge (through CudaOps.sample): the k largest logits in order and
    their log-softmax; vocabularies that are not a multiple of the chunk, one of a single chunk, and one
    (262144 x 32 candidates) whose merge takes several rounds."""
    logits = randn(rows, vocab, scale=3.0)
    st = sampling_tensors(["greedy"] * rows, vocab)
    out = ops.sample(logits, st, num_top=k)
    ids, lps = topk_reference(logits, k)
    assert torch.equal(out.top_ids, ids)
    check("sample_topk_logprobs", out.top_logprobs, lps, FP32_TOL)
    assert torch.equal(out.top_ids[:, 0], out.token_ids)  # greedy: the token is the first candidate...
    assert torch.equal(out.top_logprobs[:, 0], out.logprobs)  # ...with the very same logprob


def test_sample_topk_ties_infinities_and_nan(ops, gen):
    """Many equal logits (integers in a small range): the lower id first among equals; -inf logits are
    ranked last; a NaN ranks first (as torch.topk puts it)."""
    vocab, k = 70000, 32
    logits = torch.randint(-3, 4, (4, vocab), generator=torch.Generator().manual_seed(3)).float().to(dev())
    logits[1, : vocab - 10] = float("-inf")  # only 10 finite logits: the rest of the 32 are -inf, in id order
    logits[2, 12345] = float("nan")
    st = sampling_tensors(["greedy"] * 4, vocab, seen_fraction=0.0)
    out = ops.sample(logits, st, num_top=k)
    ids, _ = topk_reference(logits[[0, 1, 3]], k)
    assert torch.equal(out.top_ids[[0, 1, 3]], ids)
    assert int(out.top_ids[2, 0]) == 12345
    lp = torch.log_softmax(logits[0], dim=-1)[out.top_ids[0]]
    check("sample_topk_ties", out.top_logprobs[0], lp, FP32_TOL)
    assert torch.isinf(out.top_logprobs[1, 10:]).all() and torch.isfinite(out.top_logprobs[1, :10]).all()


SPEC_CASES = [
    # B, K, vocab, with draft probs, greedy target
    (1, 4, 1000, False, True),
    (8, 3, 32000, True, False),
    (16, 5, 5000, False, False),
    (4, 16, 128256, True, False),
    (32, 2, 2000, True, True),
    (64, 4, 8000, False, False),
]


@pytest.mark.parametrize("B,K,vocab,with_probs,greedy", SPEC_CASES)
def test_spec_accept_matches_reference(lib, gen, B, K, vocab, with_probs, greedy):
    rows = B * (K + 1)
    logits = randn(rows, vocab, scale=3.0)
    kinds = ["greedy"] if greedy else ["temperature", "top_k", "top_p", "top_k_top_p"]
    st = sampling_tensors([kinds[(r // (K + 1)) % len(kinds)] for r in range(rows)], vocab)
    st.seed = st.seed.view(B, K + 1)[:, :1].expand(B, K + 1).reshape(rows).contiguous()  # one seed per sequence
    st.position = (torch.randint(0, 2**31, (B, 1), device=dev()) + torch.arange(K + 1, device=dev())).reshape(rows)
    target = sampling.target_logprobs(logits, st).view(B, K + 1, vocab)
    draft_probs = None
    if with_probs:
        draft_probs = torch.softmax(logits.view(B, K + 1, vocab)[:, :K] + randn(B, K, vocab), dim=-1)
        draft_ids = torch.multinomial(draft_probs.view(B * K, vocab), 1).view(B, K)
    else:
        from_target = torch.multinomial(target[:, :K].exp().reshape(B * K, vocab), 1).view(B, K)
        noise = torch.randint(0, vocab, (B, K), device=dev())
        draft_ids = torch.where(torch.rand(B, K, device=dev()) < 0.8, from_target, noise)

    splits = sample_kernels.vocab_splits(lib, B, vocab)
    parts = nan((B, splits, 8), torch.float32)
    num_accepted = torch.full((B,), -1, dtype=torch.int64, device=dev())
    tokens = torch.full((B,), -1, dtype=torch.int64, device=dev())
    spec_accept.draw(lib, parts, target, draft_ids, draft_probs, st.seed.view(B, K + 1), st.position.view(B, K + 1))
    spec_accept.finish(lib, num_accepted, tokens, parts, K)

    for b in range(B):
        r = slice(b * (K + 1), (b + 1) * (K + 1))
        j, tok = sampling.accept_drafts(target[b], draft_ids[b], None if draft_probs is None else draft_probs[b],
                                        st.seed[r], st.position[r])
        assert (int(num_accepted[b]), int(tokens[b])) == (j, tok), f"sequence {b}"


def test_accept_drafts_through_cuda_ops(ops, gen):
    B, K, vocab = 6, 3, 4000
    logits = randn(B * (K + 1), vocab, scale=2.0)
    st = sampling_tensors(["temperature"] * (B * (K + 1)), vocab)
    target = sampling.target_logprobs(logits, st).view(B, K + 1, vocab)
    draft_ids = torch.multinomial(target[:, :K].exp().reshape(B * K, vocab), 1).view(B, K)
    num_accepted, tokens = ops.accept_drafts(target, draft_ids, None, st.seed.view(B, K + 1),
                                             st.position.view(B, K + 1))
    for b in range(B):
        r = slice(b * (K + 1), (b + 1) * (K + 1))
        assert (int(num_accepted[b]), int(tokens[b])) == sampling.accept_drafts(target[b], draft_ids[b], None,
                                                                                st.seed[r], st.position[r])


# ---------------------------------------------------------------------------------------------
# Decode step state (the slot state a decode step reads and writes back)

STEP_SLOTS, STEP_MAX_BLOCKS = 80, 40


def slot_state(S: int, MB: int, V: int, bs: int) -> dict[str, torch.Tensor]:
    """Random per-slot state as engine/state.py SlotState holds it; keys are decode_prepare's argument names."""
    return dict(
        num_cached=torch.randint(0, MB * bs, (S,), dtype=torch.int32, device=dev()),
        last_token=torch.randint(0, V, (S,), dtype=torch.int64, device=dev()),
        block_table=torch.randint(0, 10000, (S, MB), dtype=torch.int32, device=dev()),
        temperature=torch.rand(S, device=dev()) * 2,
        top_k=torch.randint(0, 1000, (S,), dtype=torch.int64, device=dev()),
        top_p=torch.rand(S, device=dev()),
        seed=torch.randint(-2**62, 2**62, (S,), dtype=torch.int64, device=dev()),
        penalty=torch.where(torch.arange(S, device=dev()) % 3 == 0, 1.0, torch.rand(S, device=dev()) + 0.5),
        seen=torch.rand(S, V, device=dev()) < 0.3,
    )  # every third slot has no repetition penalty: decode_prepare copies no seen row for it


def prepare_outputs(B: int, MB: int, V: int) -> dict[str, torch.Tensor]:
    """decode_prepare's outputs, poisoned (-7, NaN, True) so an unwritten element fails the comparison."""
    def poison(*shape, dtype):
        return torch.full(shape, -7, dtype=dtype, device=dev())

    return dict(
        input_ids=poison(B, dtype=torch.int64), positions=poison(B, dtype=torch.int64),
        slot_mapping=poison(B, dtype=torch.int64), seq_lens=poison(B, dtype=torch.int32),
        tables=poison(B, MB, dtype=torch.int32), row_temperature=nan((B,), torch.float32),
        row_top_k=poison(B, dtype=torch.int64), row_top_p=nan((B,), torch.float32),
        row_seed=poison(B, dtype=torch.int64), row_penalty=nan((B,), torch.float32),
        row_position=poison(B, dtype=torch.int64),
        row_seen=torch.ones(B, V, dtype=torch.bool, device=dev()),
    )


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("V", [4096, 17, 128256, 50001])
@pytest.mark.parametrize("B", [1, 7, 64])
def test_decode_prepare_matches_torch(lib, gen, B, V, bs):
    S, MB = STEP_SLOTS, STEP_MAX_BLOCKS
    st = slot_state(S, MB, V, bs)
    slots = torch.randperm(S, device=dev())[:B]
    out = prepare_outputs(B, MB, V)
    decode_step.prepare(lib, slots, **st, block_size=bs, **out)

    pos = st["num_cached"][slots].long()
    ref = dict(
        input_ids=st["last_token"][slots], positions=pos,
        slot_mapping=st["block_table"][slots, pos // bs].long() * bs + pos % bs,
        seq_lens=(pos + 1).to(torch.int32), tables=st["block_table"][slots],
        row_temperature=st["temperature"][slots], row_top_k=st["top_k"][slots], row_top_p=st["top_p"][slots],
        row_seed=st["seed"][slots], row_penalty=st["penalty"][slots], row_position=pos + 1,
    )
    for name, want in ref.items():
        got = out[name]
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), f"{name} differs from the torch reference"
    penalised = st["penalty"][slots] != 1  # seen rows are copied there only; the others stay as they were
    assert torch.equal(out["row_seen"][penalised], st["seen"][slots][penalised])
    assert out["row_seen"][~penalised].all()


@pytest.mark.parametrize("B, R, host", [(1, 1, False), (5, 3, False), (64, 2, False), (5, 2, True), (64, 4, True)])
def test_decode_commit_matches_torch(lib, gen, B, R, host):
    """The state moves on as TorchOps moves it, and each row's token and logprob land at [slot, num_cached % R]
    of the per-slot results (on the device, or in pinned host memory as the engine keeps them); nothing else
    of the results changes."""
    S, V = STEP_SLOTS, 151936
    num_cached = torch.randint(0, 5000, (S,), dtype=torch.int32, device=dev())
    last_token = torch.randint(0, V, (S,), dtype=torch.int64, device=dev())
    seen = torch.rand(S, V, device=dev()) < 0.3
    slots = torch.randperm(S, device=dev())[:B]
    tokens = torch.randint(0, V, (B,), dtype=torch.int64, device=dev())
    logprobs = -5 * torch.rand(B, device=dev())
    where = {"pin_memory": True} if host else {"device": dev()}
    out_tokens = torch.full((S, R), -7, dtype=torch.int64, **where)
    out_logprobs = torch.full((S, R), float("nan"), dtype=torch.float32, **where)

    ref_cached, ref_last, ref_seen = num_cached.clone(), last_token.clone(), seen.clone()
    ref_cached[slots] += 1
    ref_last[slots] = tokens
    ref_seen[slots, tokens] = True
    entry = (slots.cpu(), (num_cached[slots] % R).cpu())
    decode_step.commit(lib, slots, tokens, logprobs, num_cached, last_token, seen, out_tokens, out_logprobs)
    torch.cuda.synchronize()

    assert torch.equal(num_cached, ref_cached)
    assert torch.equal(last_token, ref_last)
    assert torch.equal(seen, ref_seen)
    got_tokens, got_logprobs = out_tokens.cpu(), out_logprobs.cpu()
    assert torch.equal(got_tokens[entry], tokens.cpu())
    assert torch.equal(got_logprobs[entry], logprobs.cpu())
    untouched = torch.ones(S, R, dtype=torch.bool)
    untouched[entry] = False
    assert (got_tokens[untouched] == -7).all(), "a result entry of another slot or position changed"
    assert torch.isnan(got_logprobs[untouched]).all(), "a result entry of another slot or position changed"


def verify_state(S: int, MB: int, V: int, bs: int):
    """A SlotState with random contents (slot_state's), for the Verify step's prepare and commit."""
    from engine.state import SlotState
    state = SlotState(S, MB, V, dev())
    st = slot_state(S, MB, V, bs)
    st["num_cached"] = torch.randint(0, (MB - 1) * bs, (S,), dtype=torch.int32, device=dev())  # room for k
    for name, value in st.items():
        getattr(state, "repetition_penalty" if name == "penalty" else name).copy_(value)
    return state


def clone_state(state):
    import copy
    other = copy.copy(state)
    for name, value in vars(state).items():
        if isinstance(value, torch.Tensor):
            setattr(other, name, value.clone())
    return other


@pytest.mark.parametrize("V", [4096, 17, 128256])
@pytest.mark.parametrize("B,k", [(1, 1), (1, 4), (3, 4), (8, 7)])
def test_verify_inputs_match_torch_ops(ops, gen, B, k, V):
    """KernelSlotIO.verify_inputs (decode_prepare with k + 1 rows per slot) against SlotIO.verify_inputs on the
    same state, every field bit for bit; drafts repeat tokens and hit the seen row's piece boundaries."""
    S, MB, bs = STEP_SLOTS, STEP_MAX_BLOCKS, 16
    state = verify_state(S, MB, V, bs)
    slots = torch.randperm(S, device=dev())[:B]
    buf = torch.randint(0, V, (B, k + 3), dtype=torch.int64, device=dev())  # strided rows, as VerifyOutputs
    drafts = buf[:, :k]
    if k >= 3:
        drafts[:, 2] = drafts[:, 0]  # a repeated draft token
        drafts[0, 1] = V - 1
    fb, rows = KernelSlotIO(state, bs, ops.lib).verify_inputs(slots, drafts)
    ref_fb, ref_rows = SlotIO(state, bs).verify_inputs(slots, drafts)
    for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "logits_indices"):
        got, want = getattr(fb, name), getattr(ref_fb, name)
        assert got.dtype == want.dtype and torch.equal(got, want), f"ForwardBatch.{name} differs"
    assert fb.logits_all_rows and fb.is_decode
    for name in ("temperature", "top_k", "top_p", "seed", "repetition_penalty", "position"):
        got, want = getattr(rows, name), getattr(ref_rows, name)
        assert got.dtype == want.dtype and torch.equal(got, want), f"SamplingTensors.{name} differs"
    penalised = ref_rows.repetition_penalty != 1  # seen rows are defined there only
    assert torch.equal(rows.seen[penalised], ref_rows.seen[penalised]), "SamplingTensors.seen differs"


@pytest.mark.parametrize("B,k", [(1, 1), (1, 4), (5, 4), (8, 7)])
def test_verify_commit_matches_torch_ops(ops, gen, B, k):
    """KernelSlotIO.verify_commit (one kernel) against SlotIO.verify_commit: accepted counts from all-accepted
    to none, the slot state and the step's output buffers."""
    from engine.outputs import VerifyOutputs
    S, MB, V, bs, n = STEP_SLOTS, STEP_MAX_BLOCKS, 1000, 16, k + 1
    state = verify_state(S, MB, V, bs)
    slots = torch.randperm(S, device=dev())[:B]
    drafts = torch.randint(0, V, (B, 8), dtype=torch.int64, device=dev())[:, :k]
    sampled = torch.randint(0, V, (B, n), dtype=torch.int64, device=dev())
    for b in range(B):  # slot b accepts min(b, k) drafts (then a mismatch, unless all matched)
        a = min(b, k)
        sampled[b, :a] = drafts[b, :a]
        if a < k:
            sampled[b, a] = (drafts[b, a] + 1) % V
    out = sampling.SampleOutput(sampled.reshape(-1), -5 * torch.rand(B * n, device=dev()), None, None)
    mine, ref = clone_state(state), clone_state(state)
    res_mine, res_ref = (VerifyOutputs(16, 8, 0, dev()) for _ in range(2))
    KernelSlotIO(mine, bs, ops.lib).verify_commit(slots, drafts, out, res_mine, 0)
    SlotIO(ref, bs).verify_commit(slots, drafts, out, res_ref, 0)
    for name in ("num_cached", "last_token", "seen"):
        assert torch.equal(getattr(mine, name), getattr(ref, name)), f"state.{name} differs"
    assert torch.equal(res_mine.accepted[:B], res_ref.accepted[:B])
    assert res_mine.accepted[:B].tolist() == [min(b, k) for b in range(B)]
    assert torch.equal(res_mine.tokens[:B], res_ref.tokens[:B])
    assert torch.equal(res_mine.logprobs[:B, :n], res_ref.logprobs[:B, :n])


def test_decode_step_bad_arguments_are_refused_before_launch(lib, gen):
    from engine.cuda.driver import KernelArgError
    S, MB, V, B, bs = 8, 4, 64, 3, 16
    st = slot_state(S, MB, V, bs)
    out = prepare_outputs(B, MB, V)
    slots = torch.arange(B, device=dev())
    decode_step.prepare(lib, slots, **st, block_size=bs, **out)  # the valid call launches
    with pytest.raises(KernelArgError, match="slots.*dtype"):
        decode_step.prepare(lib, slots.int(), **st, block_size=bs, **out)
    with pytest.raises(KernelArgError, match="input_ids"):
        decode_step.prepare(lib, slots[:2], **st, block_size=bs, **out)  # outputs sized for 3 rows
    with pytest.raises(KernelArgError, match="row_seen"):
        decode_step.prepare(lib, slots, **st, block_size=bs,
                            **{**out, "row_seen": out["row_seen"][:, :V - 1].contiguous()})
    with pytest.raises(KernelArgError, match="seen"):
        decode_step.prepare(lib, slots, **{**st, "seen": st["seen"][:S - 1]}, block_size=bs, **out)
    with pytest.raises(KernelArgError, match="block_table.*contiguous"):
        decode_step.prepare(lib, slots, **{**st, "block_table": st["block_table"].t().contiguous().t()}, block_size=bs,
                            **out)
    with pytest.raises(KernelArgError, match="block_size"):
        decode_step.prepare(lib, slots, **st, block_size=0, **out)

    tokens = torch.zeros(B, dtype=torch.int64, device=dev())
    logprobs = torch.zeros(B, dtype=torch.float32, device=dev())
    out_tokens = torch.zeros(S, 2, dtype=torch.int64, device=dev())
    out_logprobs = torch.zeros(S, 2, dtype=torch.float32, device=dev())
    commit = (st["num_cached"], st["last_token"], st["seen"])
    decode_step.commit(lib, slots, tokens, logprobs, *commit, out_tokens, out_logprobs)  # the valid call launches
    with pytest.raises(KernelArgError, match="slots.*dtype"):
        decode_step.commit(lib, slots.int(), tokens, logprobs, *commit, out_tokens, out_logprobs)
    with pytest.raises(KernelArgError, match="tokens"):
        decode_step.commit(lib, slots[:2], tokens, logprobs, *commit, out_tokens, out_logprobs)
    with pytest.raises(KernelArgError, match="seen.*dtype"):
        decode_step.commit(lib, slots, tokens, logprobs, st["num_cached"], st["last_token"], st["seen"].to(torch.uint8),
                           out_tokens, out_logprobs)
    with pytest.raises(KernelArgError, match="out_logprobs"):
        decode_step.commit(lib, slots, tokens, logprobs, *commit, out_tokens, out_logprobs[:S - 1])
    with pytest.raises(KernelArgError, match="out_logprobs"):
        decode_step.commit(lib, slots, tokens, logprobs, *commit, out_tokens, out_logprobs[:, :1].contiguous())
    with pytest.raises(KernelArgError, match="out_tokens.*not pinned"):
        decode_step.commit(lib, slots, tokens, logprobs, *commit, out_tokens.cpu(), out_logprobs)
    torch.cuda.synchronize()


# ---------------------------------------------------------------------------------------------
# CUDA graphs

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [8, 40])  # the skinny kernels (B <= SKINNY_TOKENS), and cuBLAS with the kernels
def test_decode_ops_replay_in_a_cuda_graph_with_growing_seq_lens(ops, gen, dtype, B):
    """One decoder layer through the fused ops (embedding -> qkv_attention -> linear_add ->
    norm_gate_up -> linear_add -> norm_logits) and sample, captured once and replayed while every
    sequence grows; each step equals the eager ops bit for bit."""
    decode_layer_replays_as_eager(ops, dtype, B, lambda *shape: randn(*shape, dtype=dtype))


def decode_layer_replays_as_eager(ops, dtype, B: int, make_cache) -> None:
    """The test above, its KV caches made by make_cache(*shape) (16-bit here, E4M3 in test_fp8_kv_gpu.py)."""
    H, Hkv, D, bs, vocab, inter = 16, 4, 128, 16, 1024, 1536
    hidden = H * D
    steps, start_len = 40, 60
    max_blocks = -(-(start_len + steps + 1) // bs)
    num_blocks = B * max_blocks + 1
    table = (torch.randperm(num_blocks - 1, device=dev()) + 1)[:B * max_blocks].view(B, max_blocks).to(torch.int32)
    k_cache, v_cache = make_cache(num_blocks, bs, Hkv, D), make_cache(num_blocks, bs, Hkv, D)
    embed = randn(vocab, hidden, dtype=dtype)
    norms = [(1 + 0.1 * randn(hidden)).to(dtype) for _ in range(3)]
    w_qkv, w_o = (0.02 * randn((H + 2 * Hkv) * D, hidden)).to(dtype), (0.02 * randn(hidden, H * D)).to(dtype)
    w_gate_up, w_down = (0.02 * randn(2 * inter, hidden)).to(dtype), (0.02 * randn(hidden, inter)).to(dtype)
    lm_head = (0.05 * randn(vocab, hidden)).to(dtype)
    cos_sin = rope_table(start_len + steps + 8, D)
    st = sampling_tensors([list(ROW_KINDS)[i % len(ROW_KINDS)] for i in range(B)], vocab)
    layer = attention_layer(norms[0], w_qkv)

    # Static inputs, updated in place before each replay.
    ids = torch.randint(0, vocab, (B,), device=dev())
    positions = torch.full((B,), start_len, dtype=torch.int64, device=dev())

    def forward():
        seq_lens = (positions + 1).to(torch.int32)
        slot_mapping = table[torch.arange(B, device=dev()), positions // bs].long() * bs + positions % bs
        ops.begin_forward(B, decode=True)
        h = ops.embedding(ids, embed)
        meta = attention_meta(H, Hkv, D, cos_sin, positions, slot_mapping, table, seq_lens)
        a = ops.qkv_attention(h, layer, meta, LayerKV(k_cache, v_cache))
        ops.linear_add(h, a.view(B, hidden), w_o)
        ops.linear_add(h, ops.norm_gate_up(h, norms[1], w_gate_up, 1e-6), w_down)
        logits = ops.norm_logits(h, None, norms[2], lm_head, 1e-6)
        st.position = positions + 1
        out = ops.sample(logits, st)
        return a, logits, out.token_ids, out.logprobs

    for _ in range(2):  # warm up on a side stream, as torch.cuda.graph requires
        forward()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = forward()
    for step in range(steps):
        positions.fill_(start_len + step)
        ids.copy_(torch.randint(0, vocab, (B,), device=dev()))
        eager = [t.clone() for t in forward()]  # writes the same K/V to the same slots as the replay
        graph.replay()
        torch.cuda.synchronize()
        for name, e, g in zip(("attention", "logits", "tokens", "logprobs"), eager, static_out):
            assert torch.equal(e, g), f"step {step}: graph {name} differs from eager"
    assert not torch.isnan(static_out[1]).any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hkv,D,window,bias", [(9, 16, 4, 64, 0, False), (32, 32, 8, 64, 0, True),
                                                   (40, 16, 4, 128, 0, False), (12, 32, 1, 128, 0, False),
                                                   (20, 8, 2, 80, 48, False), (16, 4, 2, 16, 0, False)])
def test_decode_attention_with_fused_rope_equals_rope_cache_write_then_attention(ops, gen, dtype, B, H, Hkv, D,
                                                                                  window, bias):
    """Past the skinny kernels, qkv_attention rotates q and the new k inside decode attention and
    writes the new k and v into the cache there: the attention output and both caches equal the
    unfused ops (norm_qkv_rope's rope_cache_write, then decode_attention) bit for bit. Covers split
    merges (long contexts), one split, head chunks (G > 16), a sliding window, a QKV bias and padding
    rows (slot -1: no cache write)."""
    rng = random.Random(gen)
    hidden, bs = 512, 16
    seq_lens = [rng.choice([1, 2, 63, 64, 65, 300, 1500]) for _ in range(B)]
    k_cache, v_cache, table = paged_cache(seq_lens, Hkv, D, bs, dtype)
    positions = torch.tensor(seq_lens, device=dev()) - 1
    slots = table[torch.arange(B, device=dev()), positions // bs].long() * bs + positions % bs
    slots[B // 3] = -1  # a padding row
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev())
    cos_sin = rope_table(2048, D)
    h, norm = randn(B, hidden, dtype=dtype), (1 + 0.1 * randn(hidden)).to(dtype)
    w_qkv = (0.05 * randn((H + 2 * Hkv) * D, hidden)).to(dtype)
    b_qkv = (0.1 * randn((H + 2 * Hkv) * D)).to(dtype) if bias else None
    layer = attention_layer(norm, w_qkv, b_qkv)
    meta = attention_meta(H, Hkv, D, cos_sin, positions, slots, table, lens, window)
    assert decode_attention.fits_one_wave(ops.lib, B, H, Hkv, D, ops.max_seq_len), "this case must take the fused path"
    results = []
    for fused in (False, True):
        kc, vc = k_cache.clone(), v_cache.clone()
        ops.begin_forward(B, decode=True)
        if fused:
            out = ops.qkv_attention(h, layer, meta, LayerKV(kc, vc))
        else:
            q = ops.norm_qkv_rope(h, layer, meta, LayerKV(kc, vc))
            out = ops.decode_attention(q, kc, vc, table, lens, D ** -0.5, window)
        results.append((out, kc, vc))
    for name, a, b in zip(("attention", "k_cache", "v_cache"), *results):
        assert torch.equal(a, b), f"fused RoPE: {name} differs from rope_cache_write + decode_attention"
    assert not results[1][0].isnan().any()


@pytest.mark.parametrize("S,n", [(3, 4), (8, 5), (2, 9)])
def test_verify_rows_past_the_skinny_kernels_see_the_rows_before_them(ops, gen, S, n):
    """A verify forward of more rows than the skinny kernels take (S sequences x n rows, each row a decode
    row of its own): row i of a sequence attends to the tokens its rows 0 .. i - 1 write into the cache in
    the same forward. qkv_attention (rope_cache_write first, not the RoPE fused into attention,
    which writes each row's own token only) against the torch reference on fp32 copies of the same inputs."""
    rng = random.Random(gen)
    H, Hkv, D, bs, hidden, dtype = 16, 4, 64, 16, 512, torch.bfloat16
    starts = [rng.choice([1, 17, 63, 200]) for _ in range(S)]
    k_cache, v_cache, table = paged_cache([s + n for s in starts], Hkv, D, bs, dtype)
    seq_index = torch.arange(S, device=dev()).repeat_interleave(n)
    positions = (torch.tensor(starts, device=dev())[:, None] + torch.arange(n, device=dev())).reshape(-1)
    tables = table[seq_index]
    T = S * n
    slots = tables[torch.arange(T, device=dev()), positions // bs].long() * bs + positions % bs
    lens = (positions + 1).to(torch.int32)
    cos_sin = rope_table(512, D)
    h, norm = randn(T, hidden, dtype=dtype), (1 + 0.1 * randn(hidden)).to(dtype)
    w_qkv = (0.05 * randn((H + 2 * Hkv) * D, hidden)).to(dtype)
    meta = attention_meta(H, Hkv, D, cos_sin, positions, slots, tables, lens)
    kc_ref, vc_ref = k_cache.float(), v_cache.float()
    ops.begin_forward(T, decode=True, rows_per_seq=n)
    out = ops.qkv_attention(h, attention_layer(norm, w_qkv), meta, LayerKV(k_cache, v_cache))
    ref = TORCH.qkv_attention(h.float(), attention_layer(norm.float(), w_qkv.float()), meta, LayerKV(kc_ref, vc_ref))
    check("verify rows attention", out, ref, BF16_TOL)
    check("verify rows k written", k_cache.view(-1, Hkv, D)[slots], kc_ref.view(-1, Hkv, D)[slots], BF16_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T", [1, 5, 8, 9, 32, 64, 65, 200])
def test_fused_ops_match_the_torch_reference(ops, gen, dtype, T):
    """A decoder layer's fused ops on the kernels (skinny for T <= SKINNY_TOKENS, cuBLAS + kernels above)
    against TorchOps' composition in fp32 from the same inputs: relative error <= 1e-2 on q, the cache
    rows written, the residual stream after each add, the MLP activation and the logits."""
    from engine.cuda.ops import SKINNY_TOKENS
    H, Hkv, D, bs, vocab, inter = 16, 4, 64, 16, 2048, 1408
    hidden, eps = 1024, 1e-5
    num_blocks = -(-T // bs) + 2
    k_cache, v_cache = nan((num_blocks, bs, Hkv, D), dtype), nan((num_blocks, bs, Hkv, D), dtype)
    k_ref = torch.zeros((num_blocks, bs, Hkv, D), device=dev())
    v_ref = torch.zeros((num_blocks, bs, Hkv, D), device=dev())
    slot_mapping = torch.randperm(num_blocks * bs, device=dev())[:T]
    positions = torch.randint(0, 500, (T,), device=dev())
    cos_sin = rope_table(512, D)
    norms = [(1 + 0.1 * randn(hidden)).to(dtype) for _ in range(3)]
    w_qkv, bias = (0.05 * randn((H + 2 * Hkv) * D, hidden)).to(dtype), (0.1 * randn((H + 2 * Hkv) * D)).to(dtype)
    w_o = (0.05 * randn(hidden, H * D)).to(dtype)
    w_gate_up, w_down = (0.05 * randn(2 * inter, hidden)).to(dtype), (0.05 * randn(hidden, inter)).to(dtype)
    lm_head = (0.05 * randn(vocab, hidden)).to(dtype)

    h = randn(T, hidden, dtype=dtype)
    r = h.float()
    ops.begin_forward(T, decode=True)
    f32 = [t.float() for t in (*norms, w_qkv, bias, w_o, w_gate_up, w_down, lm_head)]
    meta = attention_meta(H, Hkv, D, cos_sin, positions, slot_mapping, eps=eps)
    q = ops.norm_qkv_rope(h, attention_layer(norms[0], w_qkv, bias), meta, LayerKV(k_cache, v_cache))
    q_ref = TORCH.norm_qkv_rope(r, attention_layer(f32[0], f32[3], f32[4]), meta, LayerKV(k_ref, v_ref))
    check("fused qkv_rope q", q, q_ref, BF16_TOL)
    k_rows, v_rows = k_cache.view(-1, Hkv, D), v_cache.view(-1, Hkv, D)
    check("fused qkv_rope k", k_rows[slot_mapping], k_ref.view(-1, Hkv, D)[slot_mapping], BF16_TOL)
    check("fused qkv_rope v", v_rows[slot_mapping], v_ref.view(-1, Hkv, D)[slot_mapping], BF16_TOL)
    untouched = torch.ones(num_blocks * bs, dtype=torch.bool, device=dev())
    untouched[slot_mapping] = False
    assert torch.isnan(k_rows[untouched].float()).all(), "a cache row outside slot_mapping changed"
    a = randn(T, H * D, dtype=dtype)
    # linear_add with the next op's norm: the split-K path (SKINNY_TOKENS < T <= SPLIT_K_TOKENS) and addmm_
    # return it, the skinny path leaves it to the next op's kernel
    normed = ops.linear_add(h, a, w_o, norms[1], eps)
    TORCH.linear_add(r, a.float(), f32[5])
    check("fused linear_add", h, r, BF16_TOL)
    assert (normed is None) == (T <= SKINNY_TOKENS)
    if normed is not None:
        check("linear_add's norm", normed, TORCH.rms_norm(r, f32[1], eps), BF16_TOL)
    m = ops.norm_gate_up(h, norms[1], w_gate_up, eps, normed)
    m_ref = TORCH.norm_gate_up(r, f32[1], f32[6], eps)
    check("fused norm_gate_up", m, m_ref, BF16_TOL)
    rows = None if T < 3 else torch.tensor([0, T - 1], device=dev())
    normed = ops.linear_add(h, m, w_down, norms[2] if rows is None else None, eps)
    TORCH.linear_add(r, m.float(), f32[7])
    check("fused linear_add (down)", h, r, BF16_TOL)
    logits = ops.norm_logits(h, rows, norms[2], lm_head, eps, normed)
    assert logits.dtype == torch.float32
    check("fused norm_logits", logits, TORCH.norm_logits(r, rows, f32[2], f32[8], eps), BF16_TOL)


@pytest.mark.parametrize("lengths,H,Hkv,D", [([512] * 8, 32, 8, 64), ([5, 31, 128, 200, 31], 32, 8, 128),
                                             ([2048], 16, 16, 64), ([7, 7, 300], 8, 1, 96)])
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_attention_fresh_prompts_through_cuda_ops(ops, gen, lengths, H, Hkv, D, path):
    """Fresh prompts through a fused attention (cuDNN's or FlashAttention's) on keys gathered from the paged cache
    (forwards of at least fused_min_tokens tokens), or through the paged kernel (shorter ones)."""
    bs = 16
    table, num_blocks = scattered_tables(lengths, bs)
    k_cache = randn(num_blocks, bs, Hkv, D, dtype=torch.bfloat16)
    v_cache = randn(num_blocks, bs, Hkv, D, dtype=torch.bfloat16)
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    q = randn(qsl[-1], H, D, dtype=torch.bfloat16)
    scale = D ** -0.5
    with prefill_path(ops, path):
        ops.begin_forward(qsl[-1], decode=False)
        out = ops.prefill_attention(q, k_cache, v_cache, table, qsl, lengths, scale, 0)
    ref = TORCH.prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, qsl, lengths, scale, 0)
    check(f"prefill_attention ({path})", out, ref, BF16_TOL)


@pytest.mark.parametrize("cached,new,H,Hkv,D,pad", [([3000, 0, 2100], [1000, 700, 37], 32, 8, 64, 0),
                                                    ([8192], [2048], 32, 8, 128, 0),
                                                    ([129, 16], [1500, 900], 8, 1, 96, 77)])
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_prefill_attention_chunks_after_a_cached_prefix(ops, gen, cached, new, H, Hkv, D, pad, path):
    """Chunks that continue a cached prefix (a long prompt's later chunks, a prompt whose start the prefix cache
    held) beside a fresh prompt: each chunk's queries see the prefix and the chunk causally. FlashAttention's
    causal mask is aligned to each sequence's last key; cuDNN's to the first, so that route cuts each prefix into a
    bucketed unmasked part and a causal block (prefill_cudnn). The pad rows after the last chunk (a bucketed
    forward) must not disturb the real ones."""
    bs = 16
    lengths = [c + n for c, n in zip(cached, new)]
    table, num_blocks = scattered_tables(lengths, bs)
    k_cache = randn(num_blocks, bs, Hkv, D, dtype=torch.bfloat16)
    v_cache = randn(num_blocks, bs, Hkv, D, dtype=torch.bfloat16)
    qsl = [0]
    for n in new:
        qsl.append(qsl[-1] + n)
    q = randn(qsl[-1] + pad, H, D, dtype=torch.bfloat16)
    scale = D ** -0.5
    with prefill_path(ops, path):
        ops.begin_forward(q.shape[0], decode=False)
        out = ops.prefill_attention(q, k_cache, v_cache, table, qsl, lengths, scale, 0)
    assert out.shape == q.shape
    ref = TORCH.prefill_attention(q[:qsl[-1]].float(), k_cache.float(), v_cache.float(), table, qsl, lengths, scale,
                                  0)
    check(f"prefill_attention after a cached prefix ({path})", out[:qsl[-1]], ref, BF16_TOL)


@pytest.mark.parametrize("H,Hkv,D", [(32, 8, 64), (32, 8, 128), (16, 16, 64)])
def test_prefill_varlen_replays_other_sequence_lengths(gen, H, Hkv, D):
    """A graphed forward of fresh prompts attends its own rows through FlashAttention's variable-length entry
    (engine/cuda/prefill_varlen.py): captured once at 8 sequence rows of 2048 padded tokens, then replayed with other
    lengths and counts (empty rows after the real ones, pad tokens after the last, scattered cache rows), each
    replay equal to the torch reference on every real row."""
    from engine.cuda import prefill_varlen

    T, S, bs = 2048, 8, 16
    num_blocks = T // bs + 8
    k_cache = randn(num_blocks, bs, Hkv, D, dtype=torch.bfloat16)
    v_cache = randn(num_blocks, bs, Hkv, D, dtype=torch.bfloat16)
    q = randn(T, H, D, dtype=torch.bfloat16)
    slots = torch.full((T,), -1, dtype=torch.int64, device=dev())
    starts = torch.zeros(S + 1, dtype=torch.int32, device=dev())
    scale = D ** -0.5

    def stage(lengths):
        table, _ = scattered_tables(lengths, bs)  # distinct blocks per sequence, within num_blocks
        host = table.cpu().tolist()
        rows = [host[b][p // bs] * bs + p % bs for b, n in enumerate(lengths) for p in range(n)]
        slots.fill_(-1)
        slots[:len(rows)] = torch.tensor(rows, device=dev())
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        starts.copy_(torch.tensor(cu + [cu[-1]] * (S - len(lengths)), dtype=torch.int32))
        return table, cu

    stage([256] * 8)
    prefill_varlen.attend(q, k_cache, v_cache, slots, starts, scale)  # loads the kernels before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = prefill_varlen.attend(q, k_cache, v_cache, slots, starts, scale)
    for lengths in ([256] * 8, [700, 300, 900, 64], [2000], [1] * 8, [33, 1500, 17]):
        table, cu = stage(lengths)
        graph.replay()
        ref = TORCH.prefill_attention(q[:cu[-1]].float(), k_cache.float(), v_cache.float(), table, cu, lengths,
                                      scale, 0)
        check(f"prefill_varlen {lengths}", out[:cu[-1]], ref, BF16_TOL)
