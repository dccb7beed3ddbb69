"""The Hopper GEMM (kernels_cu/gemm_sm90.cu, sm_90a) against torch, at the projections of real models
(Llama-3.2-1B, Llama-3.1-8B, SmolLM2-135M) and odd sizes (rows past the last full tile, K not a multiple of 64),
for every row bucket of the MMA's N side, every epilogue and split counts from 1 to past one wave; then in the
engine (METRALE_GEMM=sm90) against the torch-ops engine and under CUDA-graph replay.

Oracle: x.float() @ W.float().T in fp32 on the same bf16 inputs, followed by the fp32 torch form of each epilogue
(the roundings of silu_and_mul.cu and of cuBLAS's addmm_). Outputs are NaN-filled before each launch and a guard
row after them is checked untouched, so an unwritten or a stray element fails."""
from __future__ import annotations

import pytest
import torch

from engine.cuda.wrappers import gemm_sm90
from engine.ops.torch_ops import TorchOps
from gpu.helpers import nan, randn

pytestmark = pytest.mark.gpu

TORCH = TorchOps()
ROWS = [1, 9, 16, 17, 32, 33, 64, 100, 128, 129, 200, 256]
SHAPES = {  # (N, K)
    "1b_qkv": (3072, 2048), "1b_o": (2048, 2048), "1b_gate_up": (16384, 2048), "1b_down": (2048, 8192),
    "8b_qkv": (6144, 4096), "8b_down": (4096, 14336), "smol_qkv": (960, 576), "odd": (200, 72),
    "odd_n": (203, 88),  # N % 4 != 0: the epilogue's element-by-element path
}


@pytest.fixture(scope="module")
def ws(lib):
    if not lib.gemm_sm90:
        pytest.skip(f"gemm_sm90 needs sm_90 (this device: sm_{lib.compute_capability[0]}{lib.compute_capability[1]})")
    return gemm_sm90.SplitKWorkspace(lib.device, lib.num_sms)


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    out64, ref64 = out.double(), ref.double()
    assert not torch.isnan(out64).any(), f"{name}: NaN in the output (an element left unwritten?)"
    err = ((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30)).item()
    assert err <= tol, f"{name}: relative error {err:.3e} > {tol:.0e}"


def guarded(rows: int, cols: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [rows, cols] NaN-filled, the NaN row after it in the same buffer)."""
    buf = nan((rows + 1, cols), dtype)
    return buf[:rows], buf[rows]


def operands(M: int, N: int, K: int):
    return randn(M, K, dtype=torch.bfloat16), randn(N, K, dtype=torch.bfloat16, scale=K ** -0.5)


def reference(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x.float() @ w.float().t()


def run(lib, ws, epilogue, out, x, w, num_splits=None):
    gemm_sm90.launch(lib, ws, epilogue, out, x, w, num_splits=num_splits)
    torch.cuda.synchronize()
    assert not ws.counters.any(), "a tile's arrival counter was left non-zero"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("M", ROWS)
def test_store_and_f32(lib, ws, gen, shape, M):
    N, K = SHAPES[shape]
    x, w = operands(M, N, K)
    ref = reference(x, w)
    out, guard = guarded(M, N, torch.float32)
    run(lib, ws, "f32", out, x, w)
    check(f"f32 {shape} M={M}", out, ref, 1e-5)
    assert torch.isnan(guard).all()
    out16, guard16 = guarded(M, N, torch.bfloat16)
    run(lib, ws, "store", out16, x, w)
    check(f"store {shape} M={M}", out16, ref.bfloat16(), 1e-2)
    assert torch.equal(out16, out.bfloat16()), "store is not the fp32 sums rounded once"
    assert torch.isnan(guard16).all()


@pytest.mark.parametrize("shape", ["1b_o", "1b_down", "8b_down", "smol_qkv", "odd", "odd_n"])
@pytest.mark.parametrize("M", [9, 33, 128, 256])
def test_residual_adds_in_place_with_one_rounding(lib, ws, gen, shape, M):
    N, K = SHAPES[shape]
    x, w = operands(M, N, K)
    h0 = randn(M, N, dtype=torch.bfloat16, scale=4.0)
    h = h0.clone()
    run(lib, ws, "residual", h, x, w)
    sums = torch.empty(M, N, dtype=torch.float32, device=x.device)
    run(lib, ws, "f32", sums, x, w)
    assert torch.equal(h, (h0.float() + sums).bfloat16())
    check(f"residual {shape} M={M}", h, (h0.float() + reference(x, w)).bfloat16(), 1e-2)


@pytest.mark.parametrize("IK", [(8192, 2048), (14336, 4096), (1536, 576), (100, 72), (101, 88)], ids=str)
@pytest.mark.parametrize("M", [9, 17, 64, 200, 256])
def test_silu_and_mul_fused(lib, ws, gen, IK, M):
    I, K = IK
    x, w = operands(M, 2 * I, K)
    out, guard = guarded(M, I, torch.bfloat16)
    run(lib, ws, "silu", out, x, w)
    assert torch.isnan(guard).all()
    sums = torch.empty(M, 2 * I, dtype=torch.float32, device=x.device)
    run(lib, ws, "f32", sums, x, w)
    g, u = sums.bfloat16().float().chunk(2, dim=1)
    exact = ((g / (1 + torch.exp(-g))).bfloat16().float() * u).bfloat16()
    check(f"silu I={I} K={K} M={M} against its own sums", out, exact, 2e-3)
    check(f"silu I={I} K={K} M={M}", out, TORCH.silu_and_mul(reference(x, w).bfloat16()), 1e-2)


@pytest.mark.parametrize("num_splits", [1, 2, 3, 7, 16])
def test_split_k_sums_in_split_order(lib, ws, gen, num_splits):
    """Any split count gives the reference, and the same split count the same bits whichever block ends last."""
    x, w = operands(48, 2048, 8192)
    ref = reference(x, w)
    outs = []
    for _ in range(3):
        out = nan((48, 2048), torch.float32)
        run(lib, ws, "f32", out, x, w, num_splits=num_splits)
        check(f"f32 split {num_splits}", out, ref, 1e-5)
        outs.append(out)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("epilogue", ["store", "f32", "silu", "residual"])
@pytest.mark.parametrize("shape", ["1b_o", "1b_gate_up", "8b_down"])
def test_a_row_is_the_same_bits_in_every_bucket_and_column_tile(lib, ws, gen, epilogue, shape, num_splits):
    """At a given split count, rows 0-8 and 120-136 computed in forwards of 9 to 256 rows (buckets 16 to 128, one
    or two column tiles) are the same bits: the bucket and the column tile change no row's arithmetic (only the
    split count, which splits() picks by the rows, does)."""
    N, K = SHAPES[shape]
    if gemm_sm90.tiles(N, epilogue == "silu") * 2 * num_splits > ws.max_blocks:  # 1b_gate_up: 256 blocks already
        num_splits = 1
    x, w = operands(256, N, K)
    cols = N // 2 if epilogue == "silu" else N
    dtype = torch.float32 if epilogue == "f32" else torch.bfloat16
    h0 = randn(256, cols, dtype=torch.bfloat16)
    outs = {}
    for M in (9, 40, 100, 137, 200, 256):
        out = h0[:M].clone() if epilogue == "residual" else nan((M, cols), dtype)
        run(lib, ws, epilogue, out, x[:M], w, num_splits=num_splits)
        outs[M] = out
    assert all(torch.equal(outs[9], o[:9]) for o in outs.values())
    assert all(torch.equal(outs[137][120:], o[120:137]) for M, o in outs.items() if M >= 137)


def test_graph_replay_reuses_the_split_counters(lib, ws, gen):
    """Captured once, replayed on new inputs: every replay's split tiles complete (their counters start at zero)."""
    M, N, K = 40, 2048, 8192
    assert gemm_sm90.splits(gemm_sm90.tiles(N, False), K, lib.num_sms, M) > 1
    x, w = operands(M, N, K)
    out = nan((M, N), torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        gemm_sm90.launch(lib, ws, "store", out, x, w)  # first launch outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        gemm_sm90.launch(lib, ws, "store", out, x, w)
    for _ in range(3):
        x.copy_(randn(M, K, dtype=torch.bfloat16))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check("graph replay", out, reference(x, w).bfloat16(), 1e-2)
    assert not ws.counters.any()


@pytest.mark.parametrize("shape", ["8b_qkv", "8b_down", "1b_o", "smol_qkv", "odd", "odd_n"])
@pytest.mark.parametrize("M", [9, 32, 100, 256])
def test_w8a8_against_the_reference_arithmetic(lib, ws, gen, shape, M):
    """E4M3 x (per row) and W (per channel) on the FP8 MMA: engine.quant.w8a8_linear's bf16 result, then its epilogue
    as the separate ops compute it (store; h + that; SiLU-and-mul of it)."""
    from engine.quant import quantize_activations, quantize_fp8, w8a8_linear
    N, K = SHAPES[shape]
    if K % 16:
        K += 16 - K % 16
    x = randn(M, K, dtype=torch.bfloat16)
    w8 = quantize_fp8(randn(N, K, scale=K ** -0.5))
    xq, x_scale = quantize_activations(x)
    ref = w8a8_linear(x, w8)
    out, guard = guarded(M, N, torch.bfloat16)
    gemm_sm90.launch_w8a8(lib, ws, "store", out, xq, x_scale.view(-1), w8.data, w8.row_scale)
    torch.cuda.synchronize()
    assert torch.isnan(guard).all() and not ws.counters.any()
    check(f"w8a8 store {shape} M={M}", out, ref, 5e-3)
    h0 = randn(M, N, dtype=torch.bfloat16, scale=4.0)
    h = h0.clone()
    gemm_sm90.launch_w8a8(lib, ws, "residual", h, xq, x_scale.view(-1), w8.data, w8.row_scale)
    assert torch.equal(h, (h0.float() + out.float()).bfloat16()), "residual is not h + the bf16 product, rounded"
    if N % 2 == 0:
        silu, guard = guarded(M, N // 2, torch.bfloat16)
        gemm_sm90.launch_w8a8(lib, ws, "silu", silu, xq, x_scale.view(-1), w8.data, w8.row_scale)
        torch.cuda.synchronize()
        assert torch.isnan(guard).all()
        check(f"w8a8 silu {shape} M={M} against its own product", silu, TORCH.silu_and_mul(out), 2e-3)
        check(f"w8a8 silu {shape} M={M}", silu, TORCH.silu_and_mul(ref), 1e-2)


# ---------------------------------------------------------------------------------------------
# In the engine (METRALE_GEMM=sm90-all: CudaOps runs every projection of forwards of 9-256 rows here; =sm90: the
# routes of engine/cuda/hopper_gemm.py)

@pytest.fixture(scope="module")
def ckpt_1b(tmp_path_factory):
    from engine.checkpoint import write_checkpoint
    return write_checkpoint(tmp_path_factory.mktemp("1b") / "m", arch="llama", shape="1b", seed=3, device="cuda")


@pytest.fixture(params=["sm90-all", "sm90"])
def sm90_gemm(monkeypatch, ws, request):
    """Every projection the kernels take on them ("sm90-all"), or the measured routes alone ("sm90")."""
    from engine import env
    monkeypatch.setattr(env, "GEMM", request.param)
    return request.param


def assert_divergences_are_near_ties(ref_engine, ps, got, ref, bar: float = 0.1) -> None:
    """Greedy tokens `got` equal the reference engine's `ref`, except where the reference's two candidates' log-probs
    are within bar (bf16 roundings flip such near-ties; a wrong kernel flips tokens that are not)."""
    from engine.api import PrefillItem
    from engine.sampling import SamplingParams, StoppingCriteria

    for p, a, b in zip(ps, got, ref):
        if a == b:
            continue
        j = next(i for i in range(len(a)) if a[i] != b[i])
        seq = ref_engine.alloc_sequence(len(p) + j + 2, SamplingParams(top_logprobs=5),
                                        StoppingCriteria(ignore_eos=True))
        lp = dict(ref_engine.prefill([PrefillItem(seq.seq_id, p + b[:j])]).tokens[0].top_logprobs)
        ref_engine.release([seq.seq_id])
        gap = lp[b[j]] - lp.get(a[j], float("-inf"))
        assert gap < bar, f"divergence after {j} tokens is not a near-tie: gap {gap} (bar {bar:.3f})"
    print(f"{sum(a == b for a, b in zip(got, ref))}/{len(ps)} sequences identical over {len(ref[0])} tokens")


@pytest.mark.parametrize("quantization", ["none", "fp8"])
@pytest.mark.parametrize("batch", [4, 12, 40])
def test_engine_on_the_gemm_matches_the_torch_ops_engine(ckpt_1b, sm90_gemm, quantization, batch):
    """32 greedy tokens of 4, 12 and 40 prompts (decode forwards of 12 and 40 rows on gemm_sm90, of 4 on the skinny
    kernels; prompts of up to 256 tokens too), against the torch-ops engine; with --quantization fp8 on its W8A8
    entries against the reference W8A8 (forwards of 9+ rows), where a flip's bar is the two engines' measured W8A8
    difference (tests/gpu/test_fp8_gpu.py: E4M3 activations move whole steps under bf16 differences upstream)."""
    from gpu.helpers import greedy_run
    from gpu.test_engine_gpu import gpu_engine, prompts

    ps = prompts([5, 31, 128, 200] * (batch // 4), 128256, seed=2)
    ref_engine = gpu_engine(ckpt_1b, kernels="torch", quantization=quantization, num_kv_blocks=1024)
    ref = greedy_run(ref_engine, ps, 32)
    fast = gpu_engine(ckpt_1b, quantization=quantization, num_kv_blocks=1024)
    assert fast.runtime.ops.gemm is not None
    got = greedy_run(fast, ps, 32)
    if quantization == "fp8":  # test_fp8_gpu's checks: the bar from a 60-token W8A8 prompt on this setting's routes
        # (sm90: <= 64 rows), each flip's gap from the reference's full log-probs (on this random model's near-uniform
        # logits a top-5 list misses the other candidate)
        from gpu.test_fp8_gpu import assert_closer_to_its_own_arithmetic, assert_greedy_flips_are_near_ties
        tokens = torch.randint(0, 128256, (60,), generator=torch.Generator().manual_seed(4)).tolist()
        bar = assert_closer_to_its_own_arithmetic(fast, ref_engine, tokens, "60 positions (W8A8 prompt)",
                                                  absolute=False)  # its bars: the tiny checkpoints'
        assert_greedy_flips_are_near_ties(ref_engine, ps, got, ref, f"batch {batch}", bar, w8a8_decode=True)
    else:
        assert_divergences_are_near_ties(ref_engine, ps, got, ref)


def test_prompts_prefilled_on_the_gemm_match_the_torch_ops_engine(ckpt_1b, sm90_gemm):
    """Prompts of 12-90 tokens prefilled alone (buckets 16 to 128) and all in one forward (142 rows: two column tiles),
    then 8 greedy tokens decoded together: the tokens of the torch-ops engine but for near-ties, and the first
    tokens' log-probs within bf16's reach of its."""
    from engine.api import PrefillItem
    from engine.sampling import SamplingParams, StoppingCriteria
    from gpu.test_engine_gpu import gpu_engine, prompts

    fast = gpu_engine(ckpt_1b, num_kv_blocks=1024, prefix_caching=False)  # every run computes every prompt
    ref_engine = gpu_engine(ckpt_1b, kernels="torch", num_kv_blocks=1024, prefix_caching=False)
    assert fast.runtime.ops.gemm is not None
    ps = prompts([12, 40, 90], 128256, seed=6)

    def run(engine, together: bool) -> tuple[list, list]:
        ids = [engine.alloc_sequence(len(p) + 9, SamplingParams(), StoppingCriteria(ignore_eos=True)).seq_id
               for p in ps]
        items = [PrefillItem(i, p) for i, p in zip(ids, ps)]
        firsts = engine.prefill(items).tokens if together else [engine.prefill([it]).tokens[0] for it in items]
        tokens = [[t.token_id] for t in firsts]
        for _ in range(7):
            for row, t in zip(tokens, engine.decode(ids).tokens):
                row.append(t.token_id)
        engine.release(ids)
        return tokens, [t.logprob for t in firsts]

    ref, ref_lp = run(ref_engine, True)
    for together in (False, True):
        got, lp = run(fast, together)
        assert_divergences_are_near_ties(ref_engine, ps, got, ref)
        assert all(abs(a - b) < 0.05 for a, b, x, y in zip(lp, ref_lp, got, ref) if x[0] == y[0]), (lp, ref_lp)


def test_engine_graph_replay_on_the_gemm_is_bit_identical_to_eager_under_churn(ckpt_1b, sm90_gemm):
    from gpu.test_engine_gpu import churn_workload, gpu_engine

    graphs = gpu_engine(ckpt_1b, num_kv_blocks=1024, capture_after=1, max_graphs=256)
    eager = gpu_engine(ckpt_1b, num_kv_blocks=1024, cuda_graphs=False)
    assert graphs.runtime.ops.gemm is not None
    assert churn_workload(graphs) == churn_workload(eager)
