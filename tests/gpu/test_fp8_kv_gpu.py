"""The FP8 KV cache (--kv-cache-dtype fp8) on the CUDA kernels: the _kvfp8 entries against the torch reference
(engine/ops/torch_ops.py on the same E4M3 cache), and the engine on them against the torch-ops engine.

- the cache writers (rope_cache_write, the skinny QKV kernel with 16-bit or FP8 weights, decode attention's fused
  RoPE) store exactly engine/quant.py fp8_kv's bytes: E4M3 of the value the 16-bit cache would hold, saturated at
  +-448;
- decode attention (split-K, clusters, GQA, head dims 16..128, scattered blocks, sliding windows) and prefill
  attention (fresh prompts, chunks continuing a cached prefix, key splits and their merge, the fused-SDPA path)
  read it: relative error <= 1e-2 against the reference on the upcast cache, as the 16-bit kernels; every E4M3
  code is read exactly (a one-key context returns its value row);
- the decode ops replay in a CUDA graph bit for bit; the fused RoPE equals rope_cache_write + attention bit for bit;
- the engine: greedy tokens of the kernels equal the torch-ops engine's on the FP8 cache (except near-ties, checked
  in the reference), graphs / Verify / prefix caching give what eager decoding gives.
Run on the H200: python -m pytest tests/gpu/test_fp8_kv_gpu.py -m gpu (bench/gpu_session.sh fp8kv)."""
from __future__ import annotations

import random

import pytest
import torch

from engine.api import PrefillItem, VerifyItem
from engine.checkpoint import write_checkpoint
from engine.cuda.wrappers import decode_attention, prefill_attention, rope_cache_write, skinny_linear
from engine.ops.torch_ops import LayerKV, TorchOps
from engine.quant import FP8_DTYPE, FP8_MIN_CAPABILITY, fp8_kv, quantize_fp8
from engine.sampling import SamplingParams, StoppingCriteria
from gpu.helpers import (PREFILL_PATHS, attention_layer, attention_meta, dev, greedy_run, nan, prefill_path, randn,
                         scattered_tables)
from gpu.test_engine_gpu import churn_workload, gpu_engine, prompts, verify_workload
from gpu.test_kernels import (
    BF16_TOL,
    DECODE_CASES,
    PREFILL_CASES,
    PREFILL_SPLIT_CASES,
    check,
    decode_layer_replays_as_eager,
    paged_cache,
    prefill_inputs,
    rope_table,
)

pytestmark = pytest.mark.gpu
needs_fp8 = pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY,
                               reason="the engine serves an FP8 KV cache on the kernels from sm_89 on")
DTYPES = [torch.bfloat16, torch.float16]
TORCH = TorchOps()
MAX_SEQ_LEN = 16384
GREEDY = StoppingCriteria(ignore_eos=True)


@pytest.fixture(scope="module")
def ops(lib):
    from engine.cuda.ops import CudaOps
    return CudaOps(lib, MAX_SEQ_LEN)


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    return cache.view(torch.uint8)


def fp8_cache(*shape, scale: float = 1.0) -> torch.Tensor:
    """Random E4M3 values (normal, std `scale`, saturated as fp8_kv does)."""
    return fp8_kv(randn(*shape, scale=scale))


def poisoned_fp8(*shape) -> torch.Tensor:
    """An E4M3 cache of 0x7f (NaN) bytes: a row the kernel should have written and did not reads as NaN."""
    return torch.full(shape, 0x7F, dtype=torch.uint8, device=dev()).view(FP8_DTYPE)


# ---------------------------------------------------------------------------------------------
# The cache writers


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("T,H,Hkv,D,bs", [(1, 32, 8, 64, 16), (37, 32, 8, 128, 16), (256, 16, 4, 128, 32),
                                          (200, 8, 1, 64, 16), (9, 4, 2, 72, 16), (5, 4, 2, 16, 16)])
def test_rope_cache_write_stores_fp8_kv_bytes(lib, gen, dtype, T, H, Hkv, D, bs):
    """k and v spread over E4M3's whole range (std 100: many beyond +-448, which saturate; some subnormal): the
    cache rows hold exactly the bytes TorchOps.rope_cache_write stores into an FP8 cache, q_out is the 16-bit
    kernel's, and no other row changes. Half the tokens sit at position 0 (cos 1, sin 0: k unrotated, so its
    saturating values reach the conversion as they are), _v4 at D = 72."""
    qkv = randn(T, (H + 2 * Hkv) * D, dtype=dtype, scale=100.0)
    qkv[:, -8:] = torch.tensor([448, -448, 464, 500, -1e4, 2 ** -8, -2 ** -10, 3 * 2 ** -10], dtype=dtype)
    q = qkv[:, :H * D].view(T, H, D)
    k = qkv[:, H * D:(H + Hkv) * D].view(T, Hkv, D)
    v = qkv[:, (H + Hkv) * D:].view(T, Hkv, D)
    cos_sin = rope_table(4096, D)
    rope_index = torch.randint(0, 4096, (T,), device=dev())
    rope_index[::2] = 0
    num_blocks = -(-T // bs) + 3
    slots = torch.randperm(num_blocks * bs, device=dev())[:T]
    if T > 1:
        slots[T // 2] = -1  # a padding token: no write
    k_cache, v_cache = poisoned_fp8(num_blocks, bs, Hkv, D), poisoned_fp8(num_blocks, bs, Hkv, D)
    q_out = nan((T, H, D), dtype)
    rope_cache_write.launch(lib, q_out, q, k, v, cos_sin, rope_index, k_cache, v_cache, slots)
    k_ref, v_ref = poisoned_fp8(num_blocks, bs, Hkv, D), poisoned_fp8(num_blocks, bs, Hkv, D)
    q_ref = TORCH.rope_cache_write(q, k, v, cos_sin, rope_index, k_ref, v_ref, slots)
    assert torch.equal(q_out, q_ref)
    assert torch.equal(as_bytes(k_cache), as_bytes(k_ref)), "k rows differ from fp8_kv's bytes"
    assert torch.equal(as_bytes(v_cache), as_bytes(v_ref)), "v rows differ from fp8_kv's bytes"
    written = as_bytes(v_cache).view(-1, Hkv, D)[slots[slots >= 0]]
    assert (written.view(-1) & 0x7F != 0x7F).all() and (written == 0x7E).any()  # no NaN; some saturated at 448
    # a 16-bit cache written by the same launch, converted, gives the same bytes (one rounding path for both)
    k16, v16 = nan((num_blocks, bs, Hkv, D), dtype), nan((num_blocks, bs, Hkv, D), dtype)
    rope_cache_write.launch(lib, nan((T, H, D), dtype), q, k, v, cos_sin, rope_index, k16, v16, slots)
    rows = slots[slots >= 0]
    assert torch.equal(as_bytes(fp8_kv(k16.view(-1, Hkv, D)[rows])), as_bytes(k_cache.view(-1, Hkv, D)[rows]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5, 8, 16, 32])
@pytest.mark.parametrize("H,Hkv,D,with_bias", [(32, 8, 64, False), (32, 8, 128, True), (4, 2, 16, False)])
def test_skinny_rope_kvfp8_stores_the_bytes_of_rope_kv(lib, gen, dtype, M, H, Hkv, D, with_bias):
    """The skinny QKV kernel into an E4M3 cache (rope_kvfp8): q_out equals rope_kv's, and the cache rows are
    fp8_kv of what rope_kv writes into a 16-bit cache, byte for byte; padding tokens (slot -1) write nothing."""
    K = 512
    x = randn(M, K, dtype=dtype)
    w = (randn((H + 2 * Hkv) * D, K) * 20.0).to(dtype)  # outputs of std ~450: k and v values past +-448 too
    bias = randn((H + 2 * Hkv) * D, dtype=dtype) if with_bias else None
    norm_w = (1 + 0.1 * randn(K)).to(dtype)
    cos_sin = rope_table(1024, D)
    rope_index = torch.randint(0, 1024, (M,), device=dev())
    num_blocks, bs = -(-M // 16) + 2, 16
    slots = torch.randperm(num_blocks * bs, device=dev())[:M]
    if M > 1:
        slots[M // 2] = -1
    q8, q16 = nan((M, H, D), dtype), nan((M, H, D), dtype)
    k8, v8 = poisoned_fp8(num_blocks, bs, Hkv, D), poisoned_fp8(num_blocks, bs, Hkv, D)
    k16, v16 = nan((num_blocks, bs, Hkv, D), dtype), nan((num_blocks, bs, Hkv, D), dtype)
    skinny_linear.rope_kv(lib, q8, x, w, bias, norm_w, cos_sin, rope_index, k8, v8, slots, H, Hkv)
    skinny_linear.rope_kv(lib, q16, x, w, bias, norm_w, cos_sin, rope_index, k16, v16, slots, H, Hkv)
    assert torch.equal(q8, q16)
    rows = slots[slots >= 0]
    for c8, c16 in ((k8, k16), (v8, v16)):
        assert torch.equal(as_bytes(c8.view(-1, Hkv, D)[rows]), as_bytes(fp8_kv(c16.view(-1, Hkv, D)[rows])))
        untouched = torch.ones(num_blocks * bs, dtype=torch.bool, device=dev())
        untouched[rows] = False
        assert (as_bytes(c8.view(-1, Hkv, D)[untouched]) == 0x7F).all(), "a write outside slot_mapping"


@pytest.mark.parametrize("wide", [False, True], ids=["8warps", "16warps"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M", [1, 5, 8])
@pytest.mark.parametrize("H,Hkv,D,with_bias", [(32, 8, 64, False), (32, 8, 128, True), (4, 2, 16, False)])
def test_skinny_rope_kvfp8_with_fp8_weights_stores_the_bytes_of_rope_kv(lib, gen, wide, dtype, M, H, Hkv, D,
                                                                        with_bias):
    """FP8 weights and an FP8 KV cache together (skinny_rope_kvfp8_<dt>_fp8_m8[_w16]): q_out equals that of the
    FP8-weight kernel into a 16-bit cache (skinny_rope_kv_<dt>_fp8_m8, tests/gpu/test_fp8_gpu.py holds it to the
    reference), and the cache rows are fp8_kv of what it writes, byte for byte; padding tokens write nothing."""
    K = 512
    x = randn(M, K, dtype=dtype)
    w = quantize_fp8(randn((H + 2 * Hkv) * D, K) * 20.0)  # outputs of std ~450: k and v values past +-448 too
    bias = randn((H + 2 * Hkv) * D, dtype=dtype) if with_bias else None
    norm_w = (1 + 0.1 * randn(K)).to(dtype)
    cos_sin = rope_table(1024, D)
    rope_index = torch.randint(0, 1024, (M,), device=dev())
    num_blocks, bs = -(-M // 16) + 2, 16
    slots = torch.randperm(num_blocks * bs, device=dev())[:M]
    if M > 1:
        slots[M // 2] = -1
    q8, q16 = nan((M, H, D), dtype), nan((M, H, D), dtype)
    k8, v8 = poisoned_fp8(num_blocks, bs, Hkv, D), poisoned_fp8(num_blocks, bs, Hkv, D)
    k16, v16 = nan((num_blocks, bs, Hkv, D), dtype), nan((num_blocks, bs, Hkv, D), dtype)
    saved = lib.skinny_wide_tiles  # grids of at most this many tiles take 16-warp blocks
    lib.skinny_wide_tiles = 1 << 30 if wide else 0
    try:
        skinny_linear.rope_kv(lib, q8, x, w, bias, norm_w, cos_sin, rope_index, k8, v8, slots, H, Hkv)
        skinny_linear.rope_kv(lib, q16, x, w, bias, norm_w, cos_sin, rope_index, k16, v16, slots, H, Hkv)
    finally:
        lib.skinny_wide_tiles = saved
    assert not torch.isnan(q16).any() and torch.equal(q8, q16)
    rows = slots[slots >= 0]
    for c8, c16 in ((k8, k16), (v8, v16)):
        assert torch.equal(as_bytes(c8.view(-1, Hkv, D)[rows]), as_bytes(fp8_kv(c16.view(-1, Hkv, D)[rows])))
        untouched = torch.ones(num_blocks * bs, dtype=torch.bool, device=dev())
        untouched[rows] = False
        assert (as_bytes(c8.view(-1, Hkv, D)[untouched]) == 0x7F).all(), "a write outside slot_mapping"


# ---------------------------------------------------------------------------------------------
# Decode attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,ctx,H,Hkv,D,bs,window", DECODE_CASES + [(8, 8192, 32, 8, 128, 16, 0),
                                                                    (8, 8192, 32, 8, 64, 16, 0)])
def test_decode_attention_on_an_fp8_cache(lib, gen, dtype, B, ctx, H, Hkv, D, bs, window):
    """Every case of the 16-bit kernel's test (contexts 1 .. 8k past several splits, GQA 1-32, head dims 16-128,
    batches up to 256, scattered blocks, windows) on an E4M3 cache, with the shipped key splits for the E4M3 entries
    and forced ones, with and without clusters: within 1e-2 of the reference on the upcast cache, the same bits on
    a rerun, the split tickets back at zero."""
    seq_lens = [ctx] + [random.Random(gen + b).randint(1, ctx) for b in range(1, B)]
    k_cache, v_cache, table = paged_cache(seq_lens, Hkv, D, bs, FP8_DTYPE)
    q = randn(B, H, D, dtype=dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev())
    scale = D ** -0.5
    ref = TORCH.decode_attention(q.float(), k_cache.float(), v_cache.float(), table, lens, scale, window)
    counters = torch.zeros(B * H, dtype=torch.int32, device=dev())
    shipped = decode_attention.key_splits(lib, B, H, Hkv, D, MAX_SEQ_LEN, fp8_kv=True)
    for splits in sorted({shipped, 1, 7, 16, 48}):
        for cluster in sorted({1, decode_attention.cluster_size(lib, splits)}):
            outs = []
            for _ in range(2):
                out = nan((B, H, D), dtype)
                part_o, part_lse = nan((B, H, splits, D), torch.float32), nan((B, H, splits), torch.float32)
                decode_attention.launch(lib, out, part_o, part_lse, counters, q, k_cache, v_cache, table, lens, scale,
                                        window, splits, cluster)
                check(f"decode_attention fp8 kv ({splits} splits, clusters of {cluster})", out, ref, BF16_TOL)
                outs.append(out)
            assert torch.equal(outs[0], outs[1]), "the merge of the splits must not depend on block timing"
            assert not counters.any(), "the split tickets must be back at zero after the launch"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [16, 64, 80, 128])
def test_decode_attention_reads_every_e4m3_code_exactly(lib, dtype, D):
    """One key per sequence: softmax weight 1, so the output is the value row converted to q's dtype, exactly.
    The value rows hold every finite E4M3 code (subnormals, +-0, +-448), each at some head dim, so every byte's
    conversion and the E4M3 tiles' head-dim order (undone in the merge) are checked bit for bit."""
    H, Hkv, bs = 8, 2, 16
    codes = torch.arange(256, device=dev())
    codes = codes[(codes & 0x7F) != 0x7F].to(torch.uint8)  # the 254 finite codes
    rows = -(-codes.numel() // D) + 1
    B = -(-rows // Hkv)
    v_bytes = codes.repeat(-(-B * Hkv * D // codes.numel()))[:B * Hkv * D].view(B, Hkv, D)
    k_cache = fp8_cache(B + 1, bs, Hkv, D)
    v_cache = torch.zeros(B + 1, bs, Hkv, D, dtype=torch.uint8, device=dev())
    v_cache[1:, 0] = v_bytes  # sequence b's only key: block b + 1, row 0
    v_cache = v_cache.view(FP8_DTYPE)
    table = (torch.arange(B, dtype=torch.int32, device=dev()) + 1)[:, None]
    lens = torch.ones(B, dtype=torch.int32, device=dev())
    q = randn(B, H, D, dtype=dtype)
    counters = torch.zeros(B * H, dtype=torch.int32, device=dev())
    out = nan((B, H, D), dtype)
    splits = decode_attention.key_splits(lib, B, H, Hkv, D, MAX_SEQ_LEN, fp8_kv=True)
    part_o, part_lse = nan((B, H, splits, D), torch.float32), nan((B, H, splits), torch.float32)
    decode_attention.launch(lib, out, part_o, part_lse, counters, q, k_cache, v_cache, table, lens, D ** -0.5, 0,
                            splits)
    want = v_bytes.view(FP8_DTYPE).to(dtype).repeat_interleave(H // Hkv, dim=1)
    assert torch.equal(out, want)  # (-0 comes out +0: the accumulators start at +0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,Hkv,D,window,bias", [(9, 16, 4, 64, 0, False), (32, 32, 8, 64, 0, True),
                                                   (40, 16, 4, 128, 0, False), (12, 32, 1, 128, 0, False),
                                                   (20, 8, 2, 80, 48, False), (16, 4, 2, 16, 0, False)])
def test_fused_rope_on_an_fp8_cache_equals_rope_cache_write_then_attention(ops, gen, dtype, B, H, Hkv, D, window,
                                                                           bias):
    """Past the skinny kernels, qkv_attention rotates the new k inside decode attention and writes the new k and v
    into the E4M3 cache there: the output and both caches equal norm_qkv_rope (rope_cache_write) followed by
    decode attention bit for bit; padding rows (slot -1) write nothing."""
    rng = random.Random(gen)
    hidden, bs = 512, 16
    seq_lens = [rng.choice([1, 2, 63, 64, 65, 300, 1500]) for _ in range(B)]
    k_cache, v_cache, table = paged_cache(seq_lens, Hkv, D, bs, FP8_DTYPE)
    positions = torch.tensor(seq_lens, device=dev()) - 1
    slots = table[torch.arange(B, device=dev()), positions // bs].long() * bs + positions % bs
    slots[B // 3] = -1
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=dev())
    cos_sin = rope_table(2048, D)
    h, norm = randn(B, hidden, dtype=dtype), (1 + 0.1 * randn(hidden)).to(dtype)
    w_qkv = (0.05 * randn((H + 2 * Hkv) * D, hidden)).to(dtype)
    b_qkv = (0.1 * randn((H + 2 * Hkv) * D)).to(dtype) if bias else None
    layer = attention_layer(norm, w_qkv, b_qkv)
    meta = attention_meta(H, Hkv, D, cos_sin, positions, slots, table, lens, window)
    assert decode_attention.fits_one_wave(ops.lib, B, H, Hkv, D, ops.max_seq_len, fp8_kv=True), \
        "this case must take the fused path"
    results = []
    for fused in (False, True):
        kc, vc = k_cache.clone(), v_cache.clone()
        ops.begin_forward(B, decode=True)
        if fused:
            out = ops.qkv_attention(h, layer, meta, LayerKV(kc, vc))
        else:
            q = ops.norm_qkv_rope(h, layer, meta, LayerKV(kc, vc))
            out = ops.decode_attention(q, kc, vc, table, lens, D ** -0.5, window)
        results.append((out, as_bytes(kc), as_bytes(vc)))
    for name, a, b in zip(("attention", "k_cache", "v_cache"), *results):
        assert torch.equal(a, b), f"fused RoPE: {name} differs from rope_cache_write + decode_attention"
    assert not results[1][0].isnan().any()
    # and against the reference (torch's rms_norm and GEMM: the same values up to bf16 rounding)
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    q_ref = TORCH.norm_qkv_rope(h, layer, meta, LayerKV(kc_ref, vc_ref))
    rows = slots[slots >= 0]
    k_rows = as_bytes(results[1][1]).view(-1, Hkv, D)[rows].view(FP8_DTYPE).float()
    check("fused rope fp8 kv: k written", k_rows, kc_ref.view(-1, Hkv, D)[rows].float(), 2 * BF16_TOL)
    ref = TORCH.decode_attention(q_ref.float(), kc_ref.float(), vc_ref.float(), table, lens, D ** -0.5, window)
    check("fused rope fp8 kv", results[1][0], ref, BF16_TOL)


@pytest.mark.parametrize("S,n", [(3, 4), (8, 5), (2, 9)])
def test_verify_rows_read_the_fp8_rows_their_sequence_wrote(ops, gen, S, n):
    """A verify forward (S sequences x n rows) on an E4M3 cache: row i attends to the rows 0 .. i - 1 of its
    sequence wrote in the same forward (rope_cache_write first), against the reference on a copy of the cache."""
    rng = random.Random(gen)
    H, Hkv, D, bs, hidden, dtype = 16, 4, 64, 16, 512, torch.bfloat16
    starts = [rng.choice([1, 17, 63, 200]) for _ in range(S)]
    k_cache, v_cache, table = paged_cache([s + n for s in starts], Hkv, D, bs, FP8_DTYPE)
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
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    ops.begin_forward(T, decode=True, rows_per_seq=n)
    out = ops.qkv_attention(h, attention_layer(norm, w_qkv), meta, LayerKV(k_cache, v_cache))
    ref = TORCH.qkv_attention(h, attention_layer(norm, w_qkv), meta, LayerKV(kc_ref, vc_ref))
    check("verify rows attention fp8 kv", out, ref.float(), BF16_TOL)
    written = (k_cache.view(-1, Hkv, D)[slots].float(), kc_ref.view(-1, Hkv, D)[slots].float())
    check("verify rows k written fp8 kv", *written, BF16_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [8, 40])
def test_fp8_decode_ops_replay_in_a_cuda_graph_with_growing_seq_lens(ops, gen, dtype, B):
    """A decoder layer's fused ops and sampling over an E4M3 cache, captured once and replayed while the sequences
    grow: each step equals the eager ops bit for bit (B = 8: the skinny rope_kvfp8; 40: the fused RoPE in attention)."""
    decode_layer_replays_as_eager(ops, dtype, B, fp8_cache)


# ---------------------------------------------------------------------------------------------
# Prefill attention


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs,H,Hkv,D,bs,window", PREFILL_CASES)
def test_prefill_attention_on_an_fp8_cache(lib, gen, dtype, seqs, H, Hkv, D, bs, window):
    """Fresh prompts and chunks continuing a cached prefix (the prefix cache's case), GQA, windows, head dims 16-128."""
    q, k_cache, v_cache, table, qsl, seq_lens, work = prefill_inputs(seqs, H, Hkv, D, bs, dtype)
    k_cache, v_cache = fp8_kv(k_cache), fp8_kv(v_cache)
    scale = D ** -0.5
    out = nan(tuple(q.shape), dtype)
    prefill_attention.launch(lib, out, q, k_cache, v_cache, table, work, scale, window)
    ref = TORCH.prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, qsl, seq_lens, scale, window)
    check("prefill_attention fp8 kv", out, ref, BF16_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seqs,H,Hkv,D,bs,window,splits", PREFILL_SPLIT_CASES)
def test_prefill_attention_split_over_keys_on_an_fp8_cache(lib, gen, dtype, seqs, H, Hkv, D, bs, window, splits):
    """Key splits (fp32 partials, then the merge kernel, which does not read the cache) against the reference and
    close to the unsplit kernel."""
    q, k_cache, v_cache, table, qsl, seq_lens, work = prefill_inputs(seqs, H, Hkv, D, bs, dtype)
    k_cache, v_cache = fp8_kv(k_cache), fp8_kv(v_cache)
    scale = D ** -0.5
    out, whole = nan(tuple(q.shape), dtype), nan(tuple(q.shape), dtype)
    prefill_attention.launch(lib, out, q, k_cache, v_cache, table, work, scale, window, splits)
    prefill_attention.launch(lib, whole, q, k_cache, v_cache, table, work, scale, window)
    ref = TORCH.prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, qsl, seq_lens, scale, window)
    check("prefill_attention fp8 kv split over keys", out, ref, BF16_TOL)
    check("fp8 kv split vs unsplit", out, whole.float(), BF16_TOL)


@pytest.mark.parametrize("lengths,H,Hkv,D", [([512] * 8, 32, 8, 64), ([5, 31, 128, 200, 31], 32, 8, 128),
                                             ([2048], 16, 16, 64), ([7, 7, 300], 8, 1, 96)])
@pytest.mark.parametrize("path", PREFILL_PATHS)
def test_fresh_prompts_through_cuda_ops_on_an_fp8_cache(ops, gen, lengths, H, Hkv, D, path):
    """CudaOps.prefill_attention's paths for fresh prompts over an E4M3 cache: a fused attention (cuDNN's or
    FlashAttention's) on the keys gathered (as bytes) and converted, or the paged kernel's _kvfp8 entry."""
    bs = 16
    table, num_blocks = scattered_tables(lengths, bs)
    k_cache, v_cache = fp8_cache(num_blocks, bs, Hkv, D), fp8_cache(num_blocks, bs, Hkv, D)
    qsl = [0]
    for n in lengths:
        qsl.append(qsl[-1] + n)
    q = randn(qsl[-1], H, D, dtype=torch.bfloat16)
    scale = D ** -0.5
    with prefill_path(ops, path):
        ops.begin_forward(qsl[-1], decode=False)
        out = ops.prefill_attention(q, k_cache, v_cache, table, qsl, lengths, scale, 0)
    ref = TORCH.prefill_attention(q.float(), k_cache.float(), v_cache.float(), table, qsl, lengths, scale, 0)
    check(f"prefill_attention fp8 kv ({path})", out, ref, BF16_TOL)


def test_bad_fp8_caches_are_refused_before_launch(lib):
    from engine.cuda.driver import KernelArgError
    k_cache, v_cache, table = paged_cache([5], 8, 64, 16, FP8_DTYPE)
    q, out = randn(1, 32, 64, dtype=torch.bfloat16), nan((1, 32, 64), torch.bfloat16)
    lens = torch.tensor([5], dtype=torch.int32, device=dev())
    counters = torch.zeros(32, dtype=torch.int32, device=dev())
    with pytest.raises(KernelArgError, match="v_cache: expected dtype torch.float8_e4m3fn"):
        decode_attention.launch(lib, out, None, None, counters, q, k_cache, v_cache.to(torch.bfloat16), table, lens,
                                0.125, 0, 1)
    with pytest.raises(KernelArgError, match="k_cache: expected dtype torch.bfloat16, got torch.float32"):
        decode_attention.launch(lib, out, None, None, counters, q, k_cache.float(), v_cache, table, lens, 0.125, 0, 1)


# ---------------------------------------------------------------------------------------------
# The engine


@pytest.fixture(scope="module")
def ckpt_1b(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("1b") / "m", arch="llama", shape="1b", seed=3, device="cuda")


@pytest.fixture(scope="module")
def ckpt_tiny(tmp_path_factory):
    """Llama (no q/k norm: decode takes the skinny QKV kernel), head_dim 16, bf16."""
    return write_checkpoint(tmp_path_factory.mktemp("tiny") / "m", arch="llama", shape="tiny", seed=5,
                            dtype="bfloat16", vocab_size=4096)


@needs_fp8
@pytest.mark.parametrize("batch", [4, 16])
def test_fp8_kv_engine_on_the_kernels_matches_the_torch_ops_engine_at_1b(ckpt_1b, batch):
    """64 greedy tokens of 4 prompts (the skinny rope_kvfp8, decode attention behind it) and of 16 (cuBLAS, decode
    attention with the fused RoPE) on an FP8 KV cache: the kernels equal the torch-ops engine on its FP8 cache except
    where bf16 rounding flips a near-tie (then the two candidates' log-probs in the reference are within 0.1). The
    agreement with the bf16-cache engine is printed (what FP8 KV costs, not asserted here: test_fp8_accuracy)."""
    ps = prompts([5, 31, 128, 200] * (batch // 4), 128256, seed=1)
    ref_engine = gpu_engine(ckpt_1b, kernels="torch", kv_cache_dtype="fp8", num_kv_blocks=1024)
    fast_engine = gpu_engine(ckpt_1b, kv_cache_dtype="fp8", num_kv_blocks=1024)
    assert fast_engine.runtime.ops.name == "cuda" and fast_engine.info().kv_cache_dtype == "float8_e4m3fn"
    assert fast_engine.runtime.kv.k.dtype == FP8_DTYPE
    ref, got = greedy_run(ref_engine, ps, 64), greedy_run(fast_engine, ps, 64)
    for p, a, b in zip(ps, got, ref):
        if a == b:
            continue
        j = next(i for i in range(len(a)) if a[i] != b[i])
        seq = ref_engine.alloc_sequence(len(p) + j + 2, SamplingParams(top_logprobs=5), GREEDY)
        lp = dict(ref_engine.prefill([PrefillItem(seq.seq_id, p + b[:j])]).tokens[0].top_logprobs)
        ref_engine.release([seq.seq_id])
        gap = lp[b[j]] - lp.get(a[j], float("-inf"))
        print(f"divergence after {j} tokens (prompt {len(p)}): kernels {a[j]} vs torch {b[j]}, gap {gap:.4f}")
        assert gap < 0.1, f"not a near-tie: gap {gap}"
    ref_engine.close()
    bf16 = gpu_engine(ckpt_1b, num_kv_blocks=1024)
    base = greedy_run(bf16, ps, 64)
    bf16.close()
    exact = sum(a == b for a, b in zip(got, ref))
    vs_bf16 = [next((i for i in range(64) if a[i] != b[i]), 64) for a, b in zip(got, base)]
    print(f"{exact}/{batch} sequences identical to the torch engine over 64 tokens; tokens before a divergence "
          f"from the bf16-cache engine: {vs_bf16}")
    fast_engine.close()


@needs_fp8
def test_fp8_kv_graphs_and_verify_are_bit_identical_to_eager_under_churn(ckpt_1b):
    """On an FP8 KV cache: decode steps replayed from CUDA graphs (captured after one sighting) and Verify steps
    give the tokens and log-probs of eager steps, under churn (sequences join, finish, slots are reused)."""
    graphs = gpu_engine(ckpt_1b, kv_cache_dtype="fp8", num_kv_blocks=1024, capture_after=1, max_graphs=256)
    eager = gpu_engine(ckpt_1b, kv_cache_dtype="fp8", num_kv_blocks=1024, cuda_graphs=False)
    assert churn_workload(graphs) == churn_workload(eager)
    s = graphs.runtime.dispatch.graphs.stats
    assert s.hits > 50 and s.captures > 5, s
    assert verify_workload(graphs) == verify_workload(eager)
    graphs.close()
    eager.close()


@needs_fp8
def test_verify_and_the_prefix_cache_on_an_fp8_cache(ckpt_tiny):
    """Verify of the greedy continuation accepts it all and emits decode's tokens (its rollback of a rejected
    draft leaves decoding as it was); a prompt whose full blocks come from the prefix cache (the paged prefill of
    the chunk after them) gives the tokens of a fresh prefill."""
    engine = gpu_engine(ckpt_tiny, kv_cache_dtype="fp8", capture_after=1)
    assert engine.runtime.ops.name == "cuda" and engine.runtime.kv.k.dtype == FP8_DTYPE
    p = [5, 6, 7, 8]
    ref = greedy_run(engine, [p], 12)[0]
    sid = engine.alloc_sequence(40, SamplingParams(), GREEDY).seq_id
    engine.prefill([PrefillItem(sid, p)])
    r = engine.verify([VerifyItem(sid, ref[1:5])]).results[0]
    assert r.num_accepted == 4 and [t.token_id for t in r.tokens] == ref[1:6]
    wrong = (ref[7] + 1) % 4096
    r = engine.verify([VerifyItem(sid, [ref[6], wrong, ref[8]])]).results[0]
    assert r.num_accepted == 1 and [t.token_id for t in r.tokens] == ref[6:8]  # rolled back after the miss
    rest = [engine.decode([sid]).tokens[0].token_id for _ in range(4)]
    assert rest == ref[8:12]
    engine.release([sid])

    # The second prefill computes only the 6 tokens after the 9 cached blocks (other GEMM shapes than the first's
    # 150: bf16 roundings may differ), so the bar is its log-probs' closeness and decoding until a near-tie.
    prompt = prompts([150], 4096, seed=7)[0]
    runs = []
    for _ in range(2):
        sid = engine.alloc_sequence(200, SamplingParams(top_logprobs=5), GREEDY).seq_id
        first = engine.prefill([PrefillItem(sid, prompt)]).tokens[0]
        steps = [first] + [engine.decode([sid]).tokens[0] for _ in range(10)]
        runs.append((first.cached_tokens, [(t.token_id, dict(t.top_logprobs)) for t in steps]))
        engine.release([sid])
    (cached0, fresh), (cached1, cached) = runs
    assert cached0 == 0 and cached1 == 144
    top_f, top_c = fresh[0][1], cached[0][1]
    for tok in set(top_f) & set(top_c):
        assert abs(top_f[tok] - top_c[tok]) < 0.05, (tok, top_f[tok], top_c[tok])
    for (a, lp_a), (b, _) in zip(fresh, cached):
        if a != b:  # a near-tie in the fresh run, then the two runs' contexts differ: stop comparing
            assert lp_a[a] - lp_a.get(b, float("-inf")) < 0.1
            break
    engine.close()
