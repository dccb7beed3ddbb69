"""Times each kernel of kernels_cu/ at typical decode shapes (Llama-3.2-1B: hidden 2048, 32 heads, 8 KV
heads, head_dim 64, intermediate 8192, vocab 128256). Run on a GPU: `python bench/bench_kernels.py`.

device us: median over 5 replays of a CUDA graph holding 20 back-to-back calls, per call (no launch
gaps). host us: wall time per eager call (Python wrapper + cuLaunchKernel), 200 calls, synchronised
at the end. Decode attention also shows the KV bytes it reads over its device time.

The skinny linear kernels (kernels_cu/skinny_linear.cu) are timed at the decode GEMM shapes of
Llama-3.2-1B and Llama-3.1-8B for 1, 5, 8, 16 and 32 tokens, next to torch's F.linear (cuBLAS) at the same
shape: the fused kernel of the layer (rope_kv / residual / silu / f32 logits with the NORM prologue)
and the plain skinny_store, and the fused kernel again at the block width the wrapper did not pick
(w8 / w16: 8- or 16-warp blocks). Note: weight bytes read / device time. Each timed graph cycles through
enough weight copies (>= 256 MiB) that no call finds its weight in L2. Then the FP8 rows (fp8_skinny_rows):
at the 8B shapes and up to 8 tokens, per-channel E4M3 weights through the skinny _fp8 kernels (fused and
store) next to the torch W8A16 fallback CudaOps used before them and the bf16 kernels on bf16 weights; at the qkv
shape also into an FP8 KV cache (skinny_rope_kvfp8: FP8 weights and FP8 KV together).
"""
from __future__ import annotations

import importlib.util
import inspect
import itertools
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from engine import env, sampling  # noqa: E402
from engine.cuda.library import KernelLibrary  # noqa: E402
from engine.cuda.ops import CudaOps  # noqa: E402
from engine.cuda.wrappers import decode_attention, rms_norm, skinny_linear  # noqa: E402
from engine.quant import Fp8Weight, finish_linear, quantize_fp8  # noqa: E402
from engine.cuda.wrappers import sampling as sample_kernels  # noqa: E402
from engine.quant import FP8_DTYPE  # noqa: E402

HIDDEN, H, HKV, D, INTER, VOCAB, BS = 2048, 32, 8, 64, 8192, 128256, 16


def device_us(fn, calls: int = 20, reps: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def host_us(fn, calls: int = 200) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e6 / calls


def sampling_rows(n: int, kind: str) -> sampling.SamplingTensors:
    dev = "cuda"
    temp = {"greedy": 0.0, "temperature": 0.8, "top_k_top_p": 0.8}[kind]
    return sampling.SamplingTensors(
        temperature=torch.full((n,), temp, device=dev), top_k=torch.full((n,), 50 if kind == "top_k_top_p" else 0,
                                                                          dtype=torch.int64, device=dev),
        top_p=torch.full((n,), 0.9 if kind == "top_k_top_p" else 1.0, device=dev),
        seed=torch.arange(n, dtype=torch.int64, device=dev) * 7919 + 1,
        repetition_penalty=torch.full((n,), 1.1, device=dev), seen=torch.rand(n, VOCAB, device=dev) < 0.001,
        position=torch.arange(n, dtype=torch.int64, device=dev) + 100)


# (label, N, K, fused epilogue); rope_kv shapes are 32 query heads and 8 KV heads.
SKINNY_SHAPES = [
    ("1B qkv", 3072, 2048, "rope_kv"), ("1B o", 2048, 2048, "residual"), ("1B gate_up", 16384, 2048, "silu"),
    ("1B down", 2048, 8192, "residual"), ("1B lm_head", 128256, 2048, "f32"),
    ("8B qkv", 6144, 4096, "rope_kv"), ("8B o", 4096, 4096, "residual"), ("8B gate_up", 28672, 4096, "silu"),
    ("8B down", 4096, 14336, "residual"), ("8B lm_head", 128256, 4096, "f32"),
]
SKINNY_HEADS, SKINNY_KV_HEADS = 32, 8
ROTATE_BYTES = 256 << 20  # weight bytes cycled through per timed graph: more than any L2


def rotating(fn, weights: list[torch.Tensor]):
    """A call of fn(weight) on the next weight copy each time (captured 20 times: 20 different weights)."""
    ring = itertools.cycle(weights)
    return lambda: fn(next(ring))


def w8a16_fallback(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """CudaOps.linear's torch W8A16 path for <= 8 rows before the FP8 skinny kernels (the weight converted to x's
    dtype on every call)."""
    acc = torch.mm(x, w.data.to(x.dtype).t(), out_dtype=torch.float32)
    return finish_linear(acc * w.row_scale, None, None, x.dtype)


def skinny_cases(lib, dev, dt, ep: str, M: int, N: int, K: int, weights: list) -> dict:
    """{name: fn} for one shape and token count: torch's F.linear (Fp8Weight: the torch W8A16 fallback),
    skinny_store, and the fused epilogue."""
    x = torch.randn(M, K, device=dev, dtype=dt)
    nw = torch.ones(K, device=dev, dtype=dt)
    out = torch.empty(M, N, device=dev, dtype=dt)
    fp8 = isinstance(weights[0], Fp8Weight)
    torch_case = ("torch W8A16", w8a16_fallback) if fp8 else ("F.linear", F.linear)
    if fp8:
        from engine.cuda.fp8_linear import fp8_scaled_mm
    if fp8 and M > 8:  # W8A8 as CudaOps runs prompts past 8 rows: the activations quantized, torch._scaled_mm
        torch_case = ("W8A8 _scaled_mm (CudaOps' prompts)", lambda x, w: fp8_scaled_mm(lib, x, w))
    kvfp8 = None
    cases = {torch_case[0]: rotating(lambda w: torch_case[1](x, w), weights),
             "skinny_store": rotating(lambda w: skinny_linear.store(lib, out, x, w), weights)}
    if fp8:  # W8A8 on the skinny W8A8 kernel, as CudaOps' decode forwards of 9-32 rows run it (x quantized first)
        cases["W8A8 skinny"] = rotating(lambda w: fp8_scaled_mm(lib, x, w, decode=True), weights)
    if ep == "f32":
        logits = torch.empty(M, N, device=dev)
        fused = rotating(lambda w: skinny_linear.store(lib, logits, x, w, norm_weight=nw), weights)
    elif ep == "silu":
        act = torch.empty(M, N // 2, device=dev, dtype=dt)
        fused = rotating(lambda w: skinny_linear.silu(lib, act, x, w, nw), weights)
    elif ep == "residual":
        res = torch.zeros(M, N, device=dev, dtype=dt)
        fused = rotating(lambda w: skinny_linear.residual(lib, res, x, w), weights)
    else:
        H, Hkv = SKINNY_HEADS, SKINNY_KV_HEADS
        D = N // (H + 2 * Hkv)
        q_out = torch.empty(M, H, D, device=dev, dtype=dt)
        kc = torch.zeros(M // BS + 1, BS, Hkv, D, device=dev, dtype=dt)
        vc = torch.zeros_like(kc)
        cs = torch.randn(8192, D, device=dev)
        pos = torch.arange(M, dtype=torch.int64, device=dev) + 100
        slots = torch.arange(M, dtype=torch.int64, device=dev)
        fused = rotating(lambda w: skinny_linear.rope_kv(lib, q_out, x, w, None, nw, cs, pos, kc, vc, slots, H, Hkv),
                         weights)
        if isinstance(weights[0], Fp8Weight):  # FP8 weights into an FP8 KV cache too (skinny_rope_kvfp8_*_fp8_m8)
            kc8, vc8 = kc.to(FP8_DTYPE), vc.to(FP8_DTYPE)
            kvfp8 = rotating(lambda w: skinny_linear.rope_kv(lib, q_out, x, w, None, nw, cs, pos, kc8, vc8, slots, H,
                                                             Hkv), weights)
    cases[f"skinny_{ep}"] = fused
    # the block width the wrapper picks, and the others forced: 16 warps, 8, and 4 (E4M3 weights up to 8 tokens)
    widths = {16: {"skinny_wide_tiles": 1 << 30}, 8: {"skinny_wide_tiles": 0, "skinny_fp8_warps": 8}}
    if fp8 and M <= 8:
        widths[4] = {"skinny_wide_tiles": 0, "skinny_fp8_warps": 4, "skinny_fp8_wave_tiles": 0}
    shipped = (16 if N // 16 <= lib.skinny_wide_tiles else
               lib.skinny_fp8_warps if fp8 and M <= 8 and N // 16 > lib.skinny_fp8_wave_tiles else 8)
    for warps, attrs in widths.items():
        if warps != shipped:
            cases[f"skinny_{ep} w{warps}"] = forced(lib, fused, **attrs)
    if kvfp8 is not None:
        cases["skinny_rope_kvfp8"] = kvfp8
    return cases


def forced(lib, fn, **attrs):
    """fn, run with those attributes of the kernel library set (e.g. skinny_wide_tiles = 0: no 16-warp blocks;
    huge: always 16) and restored after."""
    def run():
        shipped = {name: getattr(lib, name) for name in attrs}
        for name, value in attrs.items():
            setattr(lib, name, value)
        try:
            fn()
        finally:
            for name, value in shipped.items():
                setattr(lib, name, value)
    return run


def skinny_rows(lib, dev, dt, tokens=(1, 5, 8, 16, 32)) -> list[tuple]:  # 5: Verify of 4 drafts at batch 1
    rows = []
    for label, N, K, ep in SKINNY_SHAPES:
        nbytes = N * K * 2
        copies = max(1, min(20, -(-ROTATE_BYTES // nbytes)))
        weights = [torch.randn(N, K, device=dev, dtype=dt) for _ in range(copies)]
        for M in tokens:
            for name, fn in skinny_cases(lib, dev, dt, ep, M, N, K, weights).items():
                d_us = device_us(fn)
                rows.append((M, f"{name} {label}", d_us, host_us(fn), f"{nbytes / d_us / 1e3:8.0f} GB/s weights"))
        del weights
        torch.cuda.empty_cache()
    return rows


GEMM_EPILOGUE = {"rope_kv": "store", "residual": "residual", "silu": "silu", "f32": "f32"}


def rotated_weights(N: int, K: int, nbytes: int, make) -> list:
    """Enough copies of make() (a weight [N, K] of nbytes) that a timed graph cycling them reads no weight from L2."""
    return [make() for _ in range(max(1, min(20, -(-ROTATE_BYTES // nbytes))))]


def projection_operands(M: int, N: int, K: int, epilogue: str, dev, dt) -> tuple:
    """(x [M, K], a residual stream h [M, N], the epilogue's output: [M, N / 2] for silu, fp32 for f32)."""
    out = torch.empty(M, N // 2 if epilogue == "silu" else N, device=dev,
                      dtype=torch.float32 if epilogue == "f32" else dt)
    return torch.randn(M, K, device=dev, dtype=dt), torch.randn(M, N, device=dev, dtype=dt), out


def gemm_rows(lib, dev, dt, tokens=(16, 32, 64, 128, 256), split_sweep=False) -> list[tuple]:
    """The Hopper GEMM (kernels_cu/gemm_sm90.cu, METRALE_GEMM=sm90) beside what CudaOps runs without it, at the
    decode projections of SKINNY_SHAPES: each projection's fused entry (qkv: store; o, down: residual; gate_up:
    silu; lm_head: f32) against cuBLAS with its epilogue as CudaOps composes it (F.linear; addmm_; F.linear then
    silu_and_mul; torch.mm to fp32). split_sweep: the fused entry at forced K splits too (1, 2, 4, 8, 16), to check
    gemm_sm90.splits()."""
    from engine.cuda.wrappers import gemm_sm90, silu_and_mul
    if not lib.gemm_sm90:
        return [(0, "gemm_sm90 not loaded on this device", 0.0, 0.0, "")]
    ws = gemm_sm90.SplitKWorkspace(dev, lib.num_sms)
    rows = []
    for label, N, K, ep in SKINNY_SHAPES:
        nbytes = N * K * 2
        weights = rotated_weights(N, K, nbytes, lambda: torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5)
        gep = GEMM_EPILOGUE[ep]
        for M in tokens:
            x, h, out = projection_operands(M, N, K, gep, dev, dt)
            inter = torch.empty(M, N // 2, device=dev, dtype=dt)
            cublas = {
                "store": lambda w, x=x: F.linear(x, w),
                "residual": lambda w, x=x, h=h: h.addmm_(x, w.t()),
                "silu": lambda w, x=x, o=inter: silu_and_mul.launch(lib, o, F.linear(x, w)),
                "f32": lambda w, x=x: torch.mm(x, w.t(), out_dtype=torch.float32),
            }[gep]
            target = h if gep == "residual" else out
            cases = {f"cuBLAS {gep}": rotating(cublas, weights),
                     f"gemm_sm90 {gep}": rotating(lambda w, x=x, o=target: gemm_sm90.launch(lib, ws, gep, o, x, w),
                                                  weights)}
            if split_sweep:
                most = gemm_sm90.k_tiles(K)
                for s in (1, 2, 3, 4, 6, 8, 16):
                    blocks = gemm_sm90.tiles(N, gep == "silu") * gemm_sm90.column_tiles(M)
                    if s <= most and (s == 1 or (blocks * s <= ws.max_blocks and blocks <= ws.counters.numel())):
                        cases[f"gemm_sm90 {gep} S={s}"] = rotating(
                            lambda w, x=x, o=target, s=s: gemm_sm90.launch(lib, ws, gep, o, x, w, num_splits=s),
                            weights)
            flop = 2 * M * N * K
            for name, fn in cases.items():
                d_us = device_us(fn)
                rows.append((M, f"{name} {label}", d_us, 0.0,
                             f"{nbytes / d_us / 1e3:8.0f} GB/s weights {flop / d_us / 1e6:6.0f} TFLOP/s"))
        del weights
        torch.cuda.empty_cache()
    return rows


def gemm_w8a8_rows(lib, dev, dt, tokens=(16, 32, 64, 128, 256)) -> list[tuple]:
    """W8A8 at the 8B decode projections (per-channel E4M3 weights, x quantized per row by fp8_quant, both included):
    what CudaOps runs without the Hopper GEMM (fp8_scaled_mm in a decode forward: the skinny W8A8 kernel up to 32 rows,
    torch._scaled_mm above; the epilogue's separate op where the projection has one) beside gemm_sm90's fused W8A8
    entry."""
    from engine.cuda.fp8_linear import fp8_scaled_mm
    from engine.cuda.wrappers import fp8_quant, gemm_sm90, silu_and_mul
    if not lib.gemm_sm90:
        return [(0, "gemm_sm90 not loaded on this device", 0.0, 0.0, "")]
    ws = gemm_sm90.SplitKWorkspace(dev, lib.num_sms)
    rows = []
    for label, N, K, ep in SKINNY_SHAPES:
        if not label.startswith("8B") or ep == "f32":
            continue
        nbytes = N * K
        weights = rotated_weights(N, K, nbytes, lambda: quantize_fp8(torch.randn(N, K, device=dev) * K ** -0.5))
        gep = GEMM_EPILOGUE[ep]
        for M in tokens:
            x, h, out = projection_operands(M, N, K, gep, dev, dt)

            def now(w, x=x, h=h, out=out):
                y = fp8_scaled_mm(lib, x, w, decode=True)
                if gep == "residual":
                    h.add_(y)
                elif gep == "silu":
                    silu_and_mul.launch(lib, out, y)

            def fused(w, x=x, h=h, out=out):
                xq, xs = fp8_quant.quantize_rows(lib, x)
                gemm_sm90.launch_w8a8(lib, ws, gep, h if gep == "residual" else out, xq, xs.view(-1), w.data,
                                      w.row_scale)

            for name, fn in ((f"W8A8 now {gep}", now), (f"gemm_sm90 w8a8 {gep}", fused)):
                d_us = device_us(rotating(fn, weights))
                rows.append((M, f"{name} {label}", d_us, 0.0, f"{nbytes / d_us / 1e3:8.0f} GB/s weights"))
        del weights
        torch.cuda.empty_cache()
    return rows


def fp8_skinny_rows(lib, dev, dt, tokens=(1, 8, 16, 32)) -> list[tuple]:
    """The 8B shapes at 1 to 32 tokens: per-channel FP8 weights (rows "fp8 ...": the _fp8 skinny kernels, and the
    torch W8A16 fallback up to 8 tokens or CudaOps' W8A8 above) beside the bf16 kernels on bf16 weights (rows
    "bf16 ..."). GB/s: the weight's bytes (1 per element for FP8, 2 for bf16) over the device time; the floor is
    those bytes at HBM bandwidth. At 16 and 32 tokens the rows say whether the _fp8_m16 / _m32 entries should
    take FP8 decode batches of 9-32 rows from W8A8 (8B b32 with FP8 weights measured 7.66 ms, bf16 4.84)."""
    rows = []
    for label, N, K, ep in SKINNY_SHAPES:
        if not label.startswith("8B"):
            continue
        for kind in ("bf16", "fp8"):
            elem = 1 if kind == "fp8" else 2
            copies = max(1, min(20, -(-ROTATE_BYTES // (N * K * elem))))
            weights = [torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5 for _ in range(copies)]
            if kind == "fp8":
                weights = [quantize_fp8(w) for w in weights]
            for M in tokens:
                for name, fn in skinny_cases(lib, dev, dt, ep, M, N, K, weights).items():
                    d_us = device_us(fn)
                    rows.append((M, f"{kind} {name} {label}", d_us, host_us(fn),
                                 f"{N * K * elem / d_us / 1e3:8.0f} GB/s weights"))
            del weights
            torch.cuda.empty_cache()
    return rows



W8A8_SHAPES = (("8B qkv", 6144, 4096), ("8B o", 4096, 4096), ("8B gate_up", 28672, 4096), ("8B down", 4096, 14336))


def w8a8_rows(lib, dev, dt, tokens=(64, 512, 4096)) -> list[tuple]:
    """W8A8 at prompt sizes, the 8B projections (issue 43: prefill 8 x 512 at >= 1.4x bf16): the activations'
    per-row E4M3 quantization by the kernel (fp8_quant.quantize_rows) and by torch (quantize_activations), the
    FP8 GEMM (torch._scaled_mm, row-wise scales; and with use_fast_accum, which skips the promotions of the FP8
    MMA's partial sums to fp32 that the shipped call keeps), the whole W8A8 projection (CudaOps' fp8_scaled_mm), and bf16's
    F.linear on the same shape. us a call; TFLOP/s of the GEMMs; GB/s of the quantization (2 bytes read and 1
    written per element)."""
    from engine.cuda.fp8_linear import fp8_scaled_mm
    from engine.cuda.wrappers import fp8_quant
    from engine.quant import quantize_activations
    rows = []
    for label, N, K in W8A8_SHAPES:
        w16 = torch.randn(N, K, device=dev, dtype=dt) * K ** -0.5
        w8 = quantize_fp8(w16)
        for M in tokens:
            x = torch.randn(M, K, device=dev, dtype=dt)
            xq, a_scale = fp8_quant.quantize_rows(lib, x)
            flop = 2 * M * N * K
            cases = {
                "quantize x: kernel": (lambda: fp8_quant.quantize_rows(lib, x), 3 * M * K, "GB/s"),
                "quantize x: torch": (lambda: quantize_activations(x), 3 * M * K, "GB/s"),
                "FP8 GEMM (_scaled_mm)": (lambda: torch._scaled_mm(xq, w8.data.t(), scale_a=a_scale,
                                                                   scale_b=w8.row_scale[None, :],
                                                                   out_dtype=torch.bfloat16), flop, "TFLOP/s"),
                "FP8 GEMM, use_fast_accum": (lambda: torch._scaled_mm(xq, w8.data.t(), scale_a=a_scale,
                                                                      scale_b=w8.row_scale[None, :],
                                                                      out_dtype=torch.bfloat16, use_fast_accum=True),
                                             flop, "TFLOP/s"),
                "W8A8 projection": (lambda: fp8_scaled_mm(lib, x, w8), flop, "TFLOP/s"),
                "bf16 F.linear": (lambda: torch.nn.functional.linear(x, w16), flop, "TFLOP/s"),
            }
            for name, (fn, work, unit) in cases.items():
                d_us = device_us(fn)
                rate = work / d_us / (1e3 if unit == "GB/s" else 1e6)
                rows.append((M, f"{name} {label}", d_us, 0.0, f"{rate:8.1f} {unit}"))
        del w16, w8
        torch.cuda.empty_cache()
    return rows

def norm_layout_rows(lib, dev, dt) -> list[tuple]:
    """rms_norm at prompt-sized inputs under several (threads per row, rows per block) layouts: the
    shipped one (engine/cuda/wrappers/rms_norm.py, norm_layout) first."""
    rows = []
    shipped = rms_norm.norm_layout
    for tokens, hidden in ((4096, 4096), (4096, 2048), (2048, 4096), (32, 4096)):
        x = torch.randn(tokens, hidden, device=dev).to(dt)
        w = torch.ones(hidden, device=dev, dtype=dt)
        out = torch.empty_like(x)
        vecs = hidden // 8
        layouts = [shipped(hidden, tokens)] + [(t, 1) for t in (64, 128, 256, 512)
                                               if vecs <= 4 * t and (t, 1) != shipped(hidden, tokens)]
        for tpr, rpb in layouts:
            rms_norm.norm_layout = lambda D, rows, tpr=tpr, rpb=rpb: (tpr, rpb)
            d_us = device_us(lambda: rms_norm.launch(lib, out, x, w, 1e-5))
            rows.append((tokens, f"rms_norm {hidden} tpr={tpr} rpb={rpb}", d_us, 0.0,
                         f"{2 * x.numel() * 2 / d_us / 1e3:8.0f} GB/s"))
        rms_norm.norm_layout = shipped
    return rows


def decode_cache(batch: int, ctx: int, dev, dt) -> tuple:
    """Random K/V caches holding `ctx` keys of each of `batch` sequences (1B shape) and the decode operands
    for a new token at position ctx - 1: (k_cache, v_cache, block_tables, seq_lens, positions, slots)."""
    blocks = -(-(ctx + 1) // BS)
    num_blocks = batch * blocks + 1
    k_cache = torch.randn(num_blocks, BS, HKV, D, device=dev).to(dt)
    v_cache = torch.randn(num_blocks, BS, HKV, D, device=dev).to(dt)
    table = (torch.arange(batch * blocks, device=dev, dtype=torch.int32) + 1).view(batch, blocks)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    pos = torch.full((batch,), ctx - 1, dtype=torch.int64, device=dev)
    slots = table[:, (ctx - 1) // BS].long() * BS + (ctx - 1) % BS
    return k_cache, v_cache, table, seq_lens, pos, slots


def attention_split_rows(ops, dev, dt) -> list[tuple]:
    """Decode attention at the 1B shape for batches 32 and 64 and several contexts, with the launch's key
    splits forced to 1, 2, 4 and 8 (clusters of all of them: the DSMEM merge), unfused and with the fused
    RoPE + KV write. The shipped rule's choice (decode_num_splits at max_seq_len 2048) is marked *. The
    caches are the same on every call, so the keys come from L2: `--ncu` shows the kernel reading DRAM."""
    lib, rows = ops.lib, []
    cos_sin = torch.randn(8192, D, device=dev)
    for batch in (32, 64):
        shipped = decode_attention.key_splits(lib, batch, H, HKV, D, 2048)
        for ctx in (128, 256, 512):
            kc, vc, table, seq_lens, pos, slots = decode_cache(batch, ctx, dev, dt)
            qkv = torch.randn(batch, (H + 2 * HKV) * D, device=dev).to(dt)
            q = qkv[:, :H * D].view(batch, H, D)
            k = qkv[:, H * D:(H + HKV) * D].view(batch, HKV, D)
            v = qkv[:, (H + HKV) * D:].view(batch, HKV, D)
            out = torch.empty(batch, H, D, device=dev, dtype=dt)
            kv_bytes = batch * ctx * HKV * D * 2 * 2
            for splits in (1, 2, 4, 8):
                po = torch.empty(batch, H, splits, D, device=dev)
                pl = torch.empty(batch, H, splits, device=dev)
                for rope in (None, (k, v, cos_sin, pos, slots)):
                    fn = (lambda po=po, pl=pl, splits=splits, rope=rope: decode_attention.launch(
                        lib, out, po, pl, ops._split_counters, q, kc, vc, table, seq_lens, D ** -0.5, 0, splits,
                        rope=rope))
                    d_us = device_us(fn)
                    name = f"attention ctx{ctx} splits={splits}{'*' if splits == shipped else ''}" + (
                        " +rope" if rope else "")
                    rows.append((batch, name, d_us, 0.0, f"{kv_bytes / d_us / 1e3:8.0f} GB/s KV"))
    return rows


def long_context_rows(ops, dev, dt, kv_dtypes=("bf16", "fp8"), shapes=None, lib=None, split_counts=None,
                      head_dims=(64, 128)) -> list[tuple]:
    """Decode attention from DRAM at long contexts, 32 query heads over 8 KV heads at head_dim 64 (1B) and 128
    (8B): batches 1, 8, 32 by contexts 2k, 8k, 32k, with the shipped key splits (*, max_seq_len 32k + 64) and
    with half, twice and four times as many, and the shipped count again over blocks scattered at random
    through the cache (as a long-running server's free list hands them out). Each graph cycles through
    enough distinct caches (>= 512 MiB together in bf16) that no call finds its keys in L2, as the layers of a
    step do. Shows the KV bytes read over the device time.
    The same shapes over an E4M3 cache (--kv-cache-dtype fp8: the _kvfp8 entries, half the bytes; rows "fp8"),
    the same copies of the same values converted, with the E4M3 entries' own shipped splits (and half and twice
    as many): KV bytes read, GB/s, and the speed-up over the bf16 row of the same blocks and shipped splits (x).
    shapes: [(batch, context)] to run (default: all nine). lib: the kernel library to time (default ops.lib; a
    --variant's). Rows marked "wave" use as many splits as one wave of blocks holds (where the shipped count is
    fewer). split_counts: the 16-bit cache's rows at the shipped count and these (instead of half, twice, four
    times and one wave); head_dims: which of 64 and 128."""
    lib, rows = lib or ops.lib, []
    for d in head_dims:
        for batch, ctx in shapes or itertools.product((1, 8, 32), (2048, 8192, 32768)):
            blocks = -(-ctx // BS)
            kv_bytes = batch * ctx * HKV * d * 2 * 2
            copies = max(1, min(32, -(-(512 << 20) // kv_bytes)))
            num_blocks = copies * batch * blocks
            if 2 * num_blocks * BS * HKV * d * 2 > (48 << 30):
                continue
            kc = torch.empty(num_blocks, BS, HKV, d, device=dev, dtype=dt).normal_()
            vc = torch.empty_like(kc).normal_()
            q = torch.randn(batch, H, d, device=dev).to(dt)
            out = torch.empty(batch, H, d, device=dev, dtype=dt)
            seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
            ordered = torch.arange(num_blocks, device=dev, dtype=torch.int32).view(copies, batch, blocks)
            scattered = torch.randperm(num_blocks, device=dev).to(torch.int32).view(copies, batch, blocks)
            shipped = decode_attention.key_splits(lib, batch, H, HKV, d, 32768 + 64)
            bf16_us = {}  # "*" / "* scattered" -> the bf16 time at the shipped splits (the fp8 rows' speed-up)

            def usable(s):
                return 1 <= s <= lib.decode_max_splits and (s <= lib.decode_cluster or s % lib.decode_cluster == 0)

            for kv_name in kv_dtypes:
                fp8 = kv_name == "fp8"
                k8, v8 = (kc.to(FP8_DTYPE), vc.to(FP8_DTYPE)) if fp8 else (kc, vc)
                shipped = decode_attention.key_splits(lib, batch, H, HKV, d, 32768 + 64, fp8_kv=fp8)
                variants = [(shipped, ordered, "*"), (shipped, scattered, "* scattered")]
                if split_counts and not fp8:
                    variants = [(shipped, ordered, "*")] + [(s, ordered, "") for s in split_counts
                                                            if s != shipped and usable(s)]
                else:
                    variants += [(s, ordered, "") for s in ((shipped // 2, shipped * 2) if fp8 else
                                                            (shipped // 2, shipped * 2, shipped * 4)) if usable(s)]
                    wave = decode_attention.blocks_per_sm(lib, d, fp8) * lib.num_sms // (batch * HKV)
                    wave = decode_attention.cluster_splits(lib, wave)
                    if shipped < wave and wave not in (shipped * 2, shipped * 4) and usable(wave):
                        variants.append((wave, ordered, " wave"))
                nbytes = kv_bytes // 2 if fp8 else kv_bytes
                for splits, tables, tag in variants:
                    po = torch.empty(batch, H, splits, d, device=dev)
                    pl = torch.empty(batch, H, splits, device=dev)
                    calls = iter(itertools.cycle(range(copies)))

                    def fn(po=po, pl=pl, splits=splits, tables=tables, k8=k8, v8=v8):
                        decode_attention.launch(lib, out, po, pl, ops._split_counters, q, k8, v8, tables[next(calls)],
                                                seq_lens, d ** -0.5, 0, splits)
                    d_us = device_us(fn, calls=copies)
                    note = f"{nbytes / d_us / 1e3:8.0f} GB/s KV, {nbytes / 1e6:.0f} MB"
                    if not fp8 and tag:
                        bf16_us[tag] = d_us
                    if fp8 and (tag or "*") in bf16_us:  # other splits: against bf16's shipped ones
                        note += f", x{bf16_us[tag or '*'] / d_us:.2f} vs bf16 splits{tag or '*'}"
                    rows.append((batch, f"d{d} ctx{ctx}{' fp8' if fp8 else ''} splits={splits}{tag}", d_us, 0.0,
                                 note))
                k8 = v8 = None
            kc = vc = None  # the caches go before the next shape's are made
            torch.cuda.empty_cache()
    return rows


PREFILL_CASES = (("128 on 3968 cached", 3968, 128, 1), ("1 x 1024", 0, 1024, 1), ("8 x 512", 0, 512, 8))


def prefill_launch(lib, dev, dt, d: int, cached: int, new: int, seqs: int, work_list=None):
    """One paged prefill attention case at 32 query heads over 8 KV heads: seqs sequences of `new` query tokens after
    `cached` keys each, in a scattered cache; returns (its launch with the shipped key splits, the splits).
    work_list: the work list rule of lib's kernels (tree_prefill_work); None: this tree's engine.batch.prefill_work."""
    from engine.batch import prefill_work
    from engine.cuda.wrappers import prefill_attention
    work_list = work_list or prefill_work
    total = cached + new
    blocks = -(-total // BS)
    kc = torch.randn(seqs * blocks + 1, BS, HKV, d, device=dev).to(dt)
    vc = torch.randn_like(kc)
    table = (torch.arange(seqs * blocks, device=dev, dtype=torch.int32) + 1).view(seqs, blocks)
    q = torch.randn(seqs * new, H, d, device=dev).to(dt)
    out = torch.empty_like(q)
    work = torch.tensor(work_list([i * new for i in range(seqs + 1)], [total] * seqs, d), dtype=torch.int32,
                        device=dev)
    splits = prefill_attention.key_splits(lib, work.shape[0], H, total, d)
    return (lambda: prefill_attention.launch(lib, out, q, kc, vc, table, work, d ** -0.5, 0, splits)), splits


def prefill_rows(lib, dev, dt, work_list=None) -> list[tuple]:
    """The paged prefill attention kernel (and its merge, where split) at the 1B (head_dim 64) and 8B (128) heads,
    32 query heads over 8 KV heads: a 128-token chunk continuing a 3,968-token cached prefix (issue 40's TTFT), a
    fresh 1,024-token prompt and 8 fresh 512-token ones, with the shipped key splits; device us and TFLOP/s (causal
    FLOPs only). work_list: as prefill_launch's."""
    rows = []
    for d in (64, 128):
        for name, cached, new, seqs in PREFILL_CASES:
            launch, splits = prefill_launch(lib, dev, dt, d, cached, new, seqs, work_list)
            d_us = device_us(launch)
            flops = seqs * 4 * H * d * (new * cached + new * (new + 1) / 2)
            rows.append((seqs, f"prefill d{d} {name} splits={splits}", d_us, 0.0, f"{flops / d_us / 1e6:8.1f} TFLOP/s"))
    return rows


def ncu_prefill_targets(lib, dev, dt) -> None:
    """Eager launches for Nsight Compute (bench/gpu_session.sh stage ncuprefill): the paged prefill attention (and its
    merge, where split) at the 1B's heads (head_dim 64), 128 tokens on 3,968 cached (issue 40's TTFT) and 8 fresh
    512-token prompts (issue 42's 8 x 512), twice each: prefill_rows' cases without the timing loops."""
    for name, cached, new, seqs in PREFILL_CASES:
        if name != "1 x 1024":
            launch, _ = prefill_launch(lib, dev, dt, 64, cached, new, seqs)
            launch()
            launch()
    torch.cuda.synchronize()


def event_ms(fn, reps: int = 5) -> float:
    """Median wall time of one eager call between CUDA events (calls of milliseconds: launch gaps do not count)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def long_prefill_rows(lib, dev, dt) -> list[tuple]:
    """Prefill attention of long prompts at the 1B (head_dim 64) and 8B (128) heads, 32 query heads over 8 KV
    heads, by every route there is: the paged kernel (kernels_cu/prefill_attention.cu, shipped key splits);
    torch's FlashAttention (the varlen entry, causal aligned to the last key, GQA native) on K/V gathered from
    the cache; cuDNN's fused attention on the gathered K/V with their own 8 heads (causal aligned to the first key,
    so a chunk after a cached prefix is two calls, the prefix unmasked and the chunk causal, merged by their
    log-sum-exps), and the engine's cuDNN route (engine/cuda/prefill_cudnn.py: gathers, bucketed blocks, K/V heads
    repeated, merge); and the gather of the keys alone. Chunks: a fresh 8k and 32k prompt, 8k chunks after 8k / 24k
    cached tokens (a 32k prompt's later chunks at the default max_prefill_tokens), and 5000 tokens after 3000 (a
    prefix that is no multiple of the buckets). ms and causal TFLOP/s. Then cudnn_plan_rows: what cuDNN's planning
    of a new shape costs."""
    from engine.batch import prefill_work
    from engine.cuda import prefill_cudnn
    from engine.cuda.wrappers import prefill_attention
    aten = torch.ops.aten
    rows = []
    for d in (64, 128):
        for cached, new in ((0, 8192), (8192, 8192), (24576, 8192), (0, 32768), (3000, 5000)):
            total = cached + new
            blocks = -(-total // BS)
            kc = torch.randn(blocks + 1, BS, HKV, d, device=dev).to(dt)
            vc = torch.randn_like(kc)
            table = (torch.randperm(blocks, device=dev).to(torch.int32) + 1).view(1, blocks)
            q = torch.randn(new, H, d, device=dev).to(dt)
            out = torch.empty_like(q)
            flops = 4 * H * d * (new * cached + new * (new + 1) / 2)
            name = f"d{d} {new} on {cached} cached"
            work = torch.tensor(prefill_work([0, new], [total], d), dtype=torch.int32, device=dev)
            splits = prefill_attention.key_splits(lib, work.shape[0], H, total, d)
            routes = {"paged kernel": lambda: prefill_attention.launch(lib, out, q, kc, vc, table, work, d ** -0.5, 0,
                                                                       splits)}
            pos = torch.arange(total, device=dev)
            index = table[0, pos // BS].long() * BS + pos % BS
            kf, vf = kc.view(-1, HKV, d), vc.view(-1, HKV, d)
            routes["gather K and V"] = lambda: (kf[index], vf[index])
            cu_q = torch.tensor([0, new], dtype=torch.int32, device=dev)
            cu_k = torch.tensor([0, total], dtype=torch.int32, device=dev)

            def flash():
                return aten._flash_attention_forward(q, kf[index], vf[index], cu_q, cu_k, new, total, 0.0, True,
                                                     False, scale=d ** -0.5)[0]
            routes["flash varlen (gathered)"] = flash
            kg, vg = kf[index], vf[index]
            routes["flash varlen (K/V given)"] = lambda: aten._flash_attention_forward(
                q, kg, vg, cu_q, cu_k, new, total, 0.0, True, False, scale=d ** -0.5)[0]
            qb = q.unsqueeze(0).transpose(1, 2)
            kb, vb = kg.unsqueeze(0).transpose(1, 2), vg.unsqueeze(0).transpose(1, 2)

            def cudnn_native():  # K/V with their 8 heads: does the entry take GQA as it is?
                if not cached:
                    return prefill_cudnn.cudnn_attention(qb, kb, vb, True, False, d ** -0.5)[0]
                o1, l1 = prefill_cudnn.cudnn_attention(qb, kb[:, :, :cached], vb[:, :, :cached], False, True,
                                                       d ** -0.5)
                o2, l2 = prefill_cudnn.cudnn_attention(qb, kb[:, :, cached:], vb[:, :, cached:], True, True,
                                                       d ** -0.5)
                return prefill_cudnn.merge(o2, l2.view(o2.shape[:3]), o1, l1.view(o1.shape[:3]))
            routes["cuDNN, K/V heads as they are"] = cudnn_native
            plan = prefill_cudnn.plan((0, new), (total,), new, table, BS)
            routes["cuDNN route (engine: gather, blocks, merge)"] = lambda: prefill_cudnn.attend(
                plan, q, kc, vc, d ** -0.5)
            ref = None
            for route, fn in routes.items():
                try:
                    ms = event_ms(fn)
                except Exception as exc:  # a backend that refuses the shape: say so and go on
                    rows.append((1, f"{name}: {route}", float("nan"), 0.0, f"failed: {str(exc)[:80]}"))
                    continue
                err = ""
                if route not in ("gather K and V",):
                    o = fn()
                    o = out if o is None else o
                    o = o.transpose(1, 2)[0] if o.dim() == 4 else o
                    if ref is None:
                        ref = o.float()
                    else:
                        err = f"  max|diff| vs paged {(o.float() - ref).abs().max().item():.4f}"
                tflops = "" if route.startswith("gather") else f"{flops / ms / 1e9:7.1f} TFLOP/s"
                rows.append((1, f"{name}: {route}", ms * 1e3, 0.0, tflops + err))
            routes.clear()
            torch.cuda.empty_cache()
    return rows


def cudnn_plan_rows(dev, dt) -> list[tuple]:
    """cuDNN's fused attention plans every new shape (engine/cuda/prefill_cudnn.py buckets them): the wall time of
    the engine's cuDNN route at a new (side, prefix) shape, its first call against the next (32 query heads over 8,
    head_dim 64 and 128, one sequence; synchronised around each call)."""
    from engine.cuda import prefill_cudnn
    rows = []
    for d in (64, 128):
        for cached, new in ((0, 2048), (0, 2304), (0, 4096), (0, 8192), (8192, 8192), (16384, 8192), (1000, 3000)):
            total = cached + new
            blocks = -(-total // BS)
            kc = torch.randn(blocks + 1, BS, HKV, d, device=dev).to(dt)
            vc = torch.randn_like(kc)
            table = (torch.arange(blocks, device=dev, dtype=torch.int32) + 1).view(1, blocks)
            q = torch.randn(new, H, d, device=dev).to(dt)
            plan = prefill_cudnn.plan((0, new), (total,), new, table, BS)
            walls = []
            for _ in range(3):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                prefill_cudnn.attend(plan, q, kc, vc, d ** -0.5)
                torch.cuda.synchronize()
                walls.append((time.perf_counter() - t0) * 1e3)
            side = plan[0].side
            cut = 0 if plan[0].pre_index is None else plan[0].pre_index.shape[0]
            rows.append((1, f"d{d} {new} on {cached} (side {side}, prefix {cut}): first / second / third call",
                         walls[0] * 1e3, 0.0, f"{walls[1]:.2f} / {walls[2]:.2f} ms"))
    return rows

def sample_rows(lib, dev) -> list[tuple]:
    """sample_stats alone and the four sampling kernels (as CudaOps.sample runs them) at the 1B vocabulary."""
    rows = []
    for batch in (1, 8, 32):
        logits = torch.randn(batch, VOCAB, device=dev) * 3
        splits = sample_kernels.vocab_splits(lib, batch, VOCAB)
        parts = torch.empty((batch, splits, 8), dtype=torch.float32, device=dev)
        th = torch.empty(batch, dtype=torch.int32, device=dev)
        tokens = torch.empty(batch, dtype=torch.int64, device=dev)
        lps = torch.empty(batch, dtype=torch.float32, device=dev)
        for kind in ("greedy", "temperature"):
            st = sampling_rows(batch, kind)
            args = (logits, st.seen, st.temperature, st.top_k, st.top_p, st.seed, st.repetition_penalty, st.position)

            def four(args=args):
                sample_kernels.stats(lib, parts, *args)
                sample_kernels.select(lib, th, parts, *args)
                sample_kernels.draw(lib, parts, th, *args)
                sample_kernels.finish(lib, tokens, lps, parts, logits, args[2])

            stats_us = device_us(lambda args=args: sample_kernels.stats(lib, parts, *args))
            nbytes = batch * VOCAB * 5
            rows.append((batch, f"sample_stats {kind}", stats_us, f"{nbytes / stats_us / 1e3:8.0f} GB/s, {splits} splits"))
            rows.append((batch, f"sample (4 kernels) {kind}", device_us(four), ""))
    return rows


def ncu_targets(ops, dev, dt) -> None:
    """Eager launches for Nsight Compute (`ncu --kernel-name regex:...`; bench/gpu_session.sh stage ncu):
    sample_stats at batch 32 (greedy), decode attention at 1B batch 32, context 256, with the fused RoPE, at 1B
    batch 256, context 128 (the _s2 entry), and decode attention at the 8B's heads (head_dim 128), batch 8, context 8k over a bf16 and then an E4M3 cache (the
    FP8 KV entries read ~2 TB/s there against the bf16 ones' ~3.3: what stalls them), twice each (ncu flushes the
    caches before each: the keys come from DRAM, as in a decode step), and the 8B's FP8 gate_up + SiLU at 1 token."""
    lib = ops.lib
    logits = torch.randn(32, VOCAB, device=dev) * 3
    splits = sample_kernels.vocab_splits(lib, 32, VOCAB)
    parts = torch.empty((32, splits, 8), dtype=torch.float32, device=dev)
    st = sampling_rows(32, "greedy")
    kc, vc, table, seq_lens, pos, slots = decode_cache(32, 256, dev, dt)
    qkv = torch.randn(32, (H + 2 * HKV) * D, device=dev).to(dt)
    q = qkv[:, :H * D].view(32, H, D)
    k = qkv[:, H * D:(H + HKV) * D].view(32, HKV, D)
    v = qkv[:, (H + HKV) * D:].view(32, HKV, D)
    out = torch.empty(32, H, D, device=dev, dtype=dt)
    cos_sin = torch.randn(8192, D, device=dev)
    splits = decode_attention.key_splits(lib, 32, H, HKV, D, 2048)
    po, pl = torch.empty(32, H, splits, D, device=dev), torch.empty(32, H, splits, device=dev)
    for _ in range(2):
        sample_kernels.stats(lib, parts, logits, st.seen, st.temperature, st.top_k, st.top_p, st.seed,
                             st.repetition_penalty, st.position)
    for _ in range(2):
        decode_attention.launch(lib, out, po, pl, ops._split_counters, q, kc, vc, table, seq_lens, D ** -0.5, 0, splits,
                                rope=(k, v, cos_sin, pos, slots))
    # 1B at batch 256, context 128 (issue 42's lowest share): 2,048 blocks of two tiles each, the _s2 entry
    kc, vc, table, seq_lens, pos, slots = decode_cache(256, 128, dev, dt)
    q, out = torch.randn(256, H, D, device=dev).to(dt), torch.empty(256, H, D, device=dev, dtype=dt)
    splits = decode_attention.key_splits(lib, 256, H, HKV, D, 32768 + 64)
    po, pl = torch.empty(256, H, splits, D, device=dev), torch.empty(256, H, splits, device=dev)
    for _ in range(2):
        decode_attention.launch(lib, out, po, pl, ops._split_counters, q, kc, vc, table, seq_lens, D ** -0.5, 0, splits)
    batch, ctx, d = 8, 8192, 128
    kc = torch.empty(batch * -(-ctx // BS), BS, HKV, d, device=dev, dtype=dt).normal_()
    vc = torch.empty_like(kc).normal_()
    table = torch.arange(kc.shape[0], device=dev, dtype=torch.int32).view(batch, -1)
    q, out = torch.randn(batch, H, d, device=dev).to(dt), torch.empty(batch, H, d, device=dev, dtype=dt)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device=dev)
    for fp8, (kd, vd) in ((False, (kc, vc)), (True, (kc.to(FP8_DTYPE), vc.to(FP8_DTYPE)))):
        splits = decode_attention.key_splits(lib, batch, H, HKV, d, 32768 + 64, fp8_kv=fp8)
        po, pl = torch.empty(batch, H, splits, d, device=dev), torch.empty(batch, H, splits, device=dev)
        for _ in range(2):
            decode_attention.launch(lib, out, po, pl, ops._split_counters, q, kd, vd, table, lens, d ** -0.5, 0,
                                    splits)
    # The 8B's gate_up + SiLU on FP8 weights at 1 token (skinny_silu_bf16_fp8_m8): what bounds it below bf16's
    # bytes per second
    x, nw = torch.randn(1, 4096, device=dev).to(dt), torch.ones(4096, device=dev, dtype=dt)
    w8 = quantize_fp8(torch.randn(28672, 4096, device=dev, dtype=dt) * 4096 ** -0.5)
    act = torch.empty(1, 14336, device=dev, dtype=dt)
    for _ in range(2):
        skinny_linear.silu(lib, act, x, w8, nw)
    torch.cuda.synchronize()


def variant_args() -> list[tuple[pathlib.Path, pathlib.Path]]:
    """(SRC, BUILD) of every `--variant SRC BUILD` pair on the command line."""
    return [(pathlib.Path(sys.argv[i + 1]), pathlib.Path(sys.argv[i + 2]))
            for i, arg in enumerate(sys.argv) if arg == "--variant"]


def variant_libs(dev, **kw) -> list[tuple[str, KernelLibrary]]:
    """The kernel libraries of every `--variant SRC BUILD` pair on the command line, each tagged with the name of
    SRC's parent folder (the variant's) for its rows. They launch with programmatic dependent launch as CudaOps'
    library does (env.PDL) unless kw says otherwise: rows of a variant without it beside this tree's with it
    compared the launch mode, not the kernels."""
    kw.setdefault("pdl", env.PDL)
    return [(f"[{src.parent.name}] ", KernelLibrary(dev, build_dir=out, kernel_dir=src, **kw))
            for src, out in variant_args()]


def tree_prefill_work(src: pathlib.Path):
    """The paged prefill attention's work list rule of the tree whose kernels_cu is src, as (query starts, sequence
    lengths, head_dim) -> work list: the kernels built from a tree take work items of that tree's size (its
    engine/batch.py prefill_work; one without a head_dim argument makes 64-row items at every head dim)."""
    name = f"_variant_batch_{len(sys.modules)}"
    spec = importlib.util.spec_from_file_location(name, src.parent / "engine" / "batch.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # (its dataclasses look their module up)
    spec.loader.exec_module(module)
    if "head_dim" in inspect.signature(module.prefill_work).parameters:
        return module.prefill_work
    return lambda query_start_loc, seq_lens, head_dim: module.prefill_work(query_start_loc, seq_lens)


def main() -> int:
    """Flags: --skinny (only the skinny linear rows), --sample (only the sampling kernels), --norm (only
    rms_norm layouts at prompt sizes), --ncu (only the launches ncu_targets makes, for Nsight Compute), --ncu-prefill
    (only ncu_prefill_targets' prefill attention launches),
    --attention (only decode attention with forced key splits, attention_split_rows), --long (decode
    attention from DRAM at long contexts, bf16 and FP8 KV caches, long_context_rows; --kv fp8 or bf16: one of
    them; --shapes 8x8192,1x32768: only those batch x context points; --split-counts 1,2,4: the 16-bit rows at
    those key splits; --head-dim 64: only that one), --topk (only the
    top-logprob candidates, torch's log_softmax + topk and the sample_topk kernels, at k = 1, 2, 5, 8, 20), --w8a8
    (only W8A8 at prompt sizes: the activation quantization kernel vs torch, the FP8 GEMM, bf16, w8a8_rows);
    --tokens 1,8 with --skinny: only those token counts; --skinny prints the FP8 rows (fp8_skinny_rows) last,
    --skinny --fp8 only those;
    --prefill (only the paged prefill attention, prefill_rows);
    --gemm (only the Hopper GEMM beside cuBLAS at the decode projections, gemm_rows, then its W8A8 beside CudaOps'
    W8A8 at the 8B ones, gemm_w8a8_rows;
    --tokens 16,256: only those row counts; --splits: at forced K splits too; --fp8: the FP8 rows alone);
    --prefill-long (only long prompts' attention by every route: paged kernel, FlashAttention, cuDNN; long_prefill_rows);
    --variant SRC BUILD with --skinny, --sample, --long or --prefill (repeatable): also those rows of the kernels built from SRC
    into BUILD (`python -m engine.cuda.build --kernels SRC --out BUILD`), in the same run, tagged with SRC's parent
    folder's name."""
    dev = torch.device("cuda", torch.cuda.current_device())
    ops = CudaOps.create(dev, max_seq_len=8192)
    dt = torch.bfloat16
    print(f"device: {torch.cuda.get_device_name(dev)}, {ops.lib.num_sms} SMs; kernels: {ops.lib.origin}")
    if "--ncu-prefill" in sys.argv:
        ncu_prefill_targets(ops.lib, dev, dt)
        return 0
    if "--ncu" in sys.argv:
        ncu_targets(ops, dev, dt)
        return 0
    if "--long" in sys.argv:
        kv = (sys.argv[sys.argv.index("--kv") + 1],) if "--kv" in sys.argv else ("bf16", "fp8")
        shapes = None
        if "--shapes" in sys.argv:
            spec = sys.argv[sys.argv.index("--shapes") + 1]
            shapes = [tuple(int(x) for x in bc.split("x")) for bc in spec.split(",")]
        counts = ([int(x) for x in sys.argv[sys.argv.index("--split-counts") + 1].split(",")]
                  if "--split-counts" in sys.argv else None)
        dims = ((int(sys.argv[sys.argv.index("--head-dim") + 1]),) if "--head-dim" in sys.argv else (64, 128))
        for tag, lib in [("", ops.lib)] + variant_libs(dev):
            for batch, name, d_us, _, extra in long_context_rows(ops, dev, dt, kv, shapes, lib, counts, dims):
                print(f"{batch:>5}  {tag + name:<52} {d_us:>10.2f}  {extra}", flush=True)
        return 0
    if "--prefill-long" in sys.argv:
        for batch, name, d_us, _, extra in long_prefill_rows(ops.lib, dev, dt) + cudnn_plan_rows(dev, dt):
            print(f"{batch:>5}  {name:<60} {d_us:>10.1f}  {extra}", flush=True)
        return 0
    if "--prefill" in sys.argv:
        work_lists = [None] + [tree_prefill_work(src) for src, _ in variant_args()]
        for (tag, lib), work_list in zip([("", ops.lib)] + variant_libs(dev), work_lists):
            for batch, name, d_us, _, extra in prefill_rows(lib, dev, dt, work_list):
                print(f"{batch:>5}  {tag + name:<52} {d_us:>10.2f}  {extra}", flush=True)
        return 0
    if "--attention" in sys.argv:
        for batch, name, d_us, _, extra in attention_split_rows(ops, dev, dt):
            print(f"{batch:>5}  {name:<40} {d_us:>10.2f}  {extra}")
        return 0
    if "--topk" in sys.argv:  # the top-logprob candidates of a step (CudaOps.sample's num_top > 0 part)
        from engine.cuda.wrappers.sampling import SAMPLE_PART_STRIDE, TOPK_CHUNK
        for batch in (1, 8, 32, 128):
            logits = torch.randn(batch, VOCAB, device=dev) * 3
            st = sampling_rows(batch, "greedy")
            splits = sample_kernels.vocab_splits(ops.lib, batch, VOCAB)
            parts = torch.empty((batch, splits, SAMPLE_PART_STRIDE), device=dev)
            sample_kernels.stats(ops.lib, parts, logits, st.seen, st.temperature, st.top_k, st.top_p, st.seed,
                                 st.repetition_penalty, st.position)
            for k in (1, 2, 5, 8, 20):
                d_us = device_us(lambda k=k, x=logits: torch.topk(torch.log_softmax(x, dim=-1), k, dim=-1))
                ids = torch.empty((batch, k), dtype=torch.int64, device=dev)
                lps = torch.empty((batch, k), dtype=torch.float32, device=dev)
                cand = torch.empty((batch, -(-VOCAB // TOPK_CHUNK), k), dtype=torch.int64, device=dev)
                k_us = device_us(lambda i=ids, lp=lps, c=cand: sample_kernels.topk(ops.lib, i, lp, c, parts, logits))
                print(f"{batch:>5}  {'top-' + str(k) + ': torch log_softmax + topk':<40} {d_us:>10.2f}")
                print(f"{batch:>5}  {'top-' + str(k) + ': sample_topk_split + merge':<40} {k_us:>10.2f}")
        return 0
    if "--gemm" in sys.argv:
        only = {}
        if "--tokens" in sys.argv:
            only["tokens"] = tuple(int(m) for m in sys.argv[sys.argv.index("--tokens") + 1].split(","))
        rows = [] if "--fp8" in sys.argv else gemm_rows(ops.lib, dev, dt, split_sweep="--splits" in sys.argv, **only)
        rows += gemm_w8a8_rows(ops.lib, dev, dt, **only)
        for batch, name, d_us, _, extra in rows:
            print(f"{batch:>5}  {name:<40} {d_us:>10.2f}  {extra}", flush=True)
        return 0
    if "--w8a8" in sys.argv:
        for batch, name, d_us, _, extra in w8a8_rows(ops.lib, dev, dt):
            print(f"{batch:>5}  {name:<40} {d_us:>10.2f}  {extra}", flush=True)
        return 0
    if "--norm" in sys.argv:
        for batch, name, d_us, _, extra in norm_layout_rows(ops.lib, dev, dt):
            print(f"{batch:>5}  {name:<32} {d_us:>10.2f}  {extra}")
        return 0
    if "--sample" in sys.argv:  # the sampling kernels alone (sample_stats, then the four) at decode batches
        libs = [("", ops.lib)] + variant_libs(dev, pdl=True)
        for tag, lib in libs:
            for batch, name, d_us, extra in sample_rows(lib, dev):
                print(f"{batch:>5}  {tag + name:<40} {d_us:>10.2f}  {extra}")
        return 0
    if "--skinny" in sys.argv:
        only = {}
        if "--tokens" in sys.argv:
            only["tokens"] = tuple(int(m) for m in sys.argv[sys.argv.index("--tokens") + 1].split(","))
        libs = [("", ops.lib)] + variant_libs(dev)
        for tag, lib in libs:
            rows = [] if "--fp8" in sys.argv else skinny_rows(lib, dev, dt, **only)
            for batch, name, d_us, h_us, extra in rows + fp8_skinny_rows(lib, dev, dt, **only):
                print(f"{batch:>5}  {tag + name:<34} {d_us:>10.2f} {h_us:>9.1f}  {extra}")
        return 0
    rows = []
    embed = torch.randn(VOCAB, HIDDEN, device=dev).to(dt)
    w = torch.ones(HIDDEN, device=dev, dtype=dt)
    cos_sin = torch.randn(8192, D, device=dev)
    for batch in (1, 32):
        ids = torch.randint(0, VOCAB, (batch,), device=dev)
        x = torch.randn(batch, HIDDEN, device=dev).to(dt)
        qkv = torch.randn(batch, (H + 2 * HKV) * D, device=dev).to(dt)
        q = qkv[:, :H * D].view(batch, H, D)
        k = qkv[:, H * D:(H + HKV) * D].view(batch, HKV, D)
        v = qkv[:, (H + HKV) * D:].view(batch, HKV, D)
        gate_up = torch.randn(batch, 2 * INTER, device=dev).to(dt)
        logits = torch.randn(batch, VOCAB, device=dev) * 3
        cases = [
            ("embedding", lambda: ops.embedding(ids, embed), None),
            ("rms_norm", lambda: ops.rms_norm(x, w, 1e-5), None),
            ("silu_and_mul", lambda: ops.silu_and_mul(gate_up), None),
        ]
        for ctx in (128, 2048):
            k_cache, v_cache, table, seq_lens, pos, slots = decode_cache(batch, ctx, dev, dt)
            kv_bytes = batch * ctx * HKV * D * 2 * 2
            cases.append((f"rope_cache_write ctx{ctx}", lambda q=q, k=k, v=v, pos=pos, kc=k_cache, vc=v_cache, s=slots:
                          ops.rope_cache_write(q, k, v, cos_sin, pos, kc, vc, s), None))
            cases.append((f"decode_attention ctx{ctx}",
                          lambda q=q, kc=k_cache, vc=v_cache, t=table, sl=seq_lens:
                          ops.decode_attention(q, kc, vc, t, sl, D ** -0.5), kv_bytes))
        for kind in ("greedy", "temperature", "top_k_top_p"):
            st = sampling_rows(batch, kind)
            cases.append((f"sample {kind}", lambda st=st, lg=logits: ops.sample(lg, st), None))
        for name, fn, nbytes in cases:
            dev_us = device_us(fn)
            extra = f"{nbytes / dev_us / 1e3:8.0f} GB/s" if nbytes else ""
            rows.append((batch, name, dev_us, host_us(fn), extra))

    # Speculative acceptance (batch 1, 4 drafts) and a 2048-token prefill.
    target = torch.log_softmax(torch.randn(1, 5, VOCAB, device=dev) * 3, dim=-1)
    drafts = torch.randint(0, VOCAB, (1, 4), device=dev)
    seed = torch.full((1, 5), 3, dtype=torch.int64, device=dev)
    posn = torch.arange(5, dtype=torch.int64, device=dev)[None]
    fn = lambda: ops.accept_drafts(target, drafts, None, seed, posn)  # noqa: E731
    rows.append((1, "accept_drafts k=4", device_us(fn), host_us(fn), ""))
    T = 2048
    kc = torch.randn(T // BS + 1, BS, HKV, D, device=dev).to(dt)
    vc = torch.randn(T // BS + 1, BS, HKV, D, device=dev).to(dt)
    table = (torch.arange(T // BS, device=dev, dtype=torch.int32) + 1)[None]
    qp = torch.randn(T, H, D, device=dev).to(dt)
    fn = lambda: ops.prefill_attention(qp, kc, vc, table, [0, T], [T], D ** -0.5)  # noqa: E731
    t_us = host_us(fn, 20)
    flops = 4 * T * T / 2 * H * D
    rows.append((1, f"prefill_attention 1x{T}", t_us, t_us, f"{flops / t_us / 1e6:8.1f} TFLOP/s"))
    rows += skinny_rows(ops.lib, dev, dt)

    print(f"{'batch':>5}  {'kernel':<28} {'device us':>10} {'host us':>9}  note")
    for batch, name, d_us, h_us, extra in rows:
        print(f"{batch:>5}  {name:<28} {d_us:>10.2f} {h_us:>9.1f}  {extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
