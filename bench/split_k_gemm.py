"""The linear layers of a decode step past the skinny kernels, GEMM alone: cuBLAS's addmm_ / F.linear against
the split-K form CudaOps.linear_add uses (one bmm over S slices of K into fp32 partials; the reduce that
follows, residual_norm, is not timed here), at the Llama-3.2-1B shapes. 16 layers of distinct weights are
replayed in one CUDA graph, so the weights come from DRAM as in the step; the figure is the median per call.

    python bench/split_k_gemm.py [--tokens 16 32 64] [--splits 2 4 8] [--all-shapes]

On the H200 at 32 tokens: o 6.40 us (addmm_) vs 5.50 (S = 4), down 14.24 vs 12.05; gate_up is slower split
(19.3 vs 21.0-25.1 us), so it keeps cuBLAS (bench/RESULTS.md, kernel benchmarks)."""
from __future__ import annotations

import argparse

import torch

LAYERS = 16
SHAPES_1B = {"o": (2048, 2048), "down": (2048, 8192), "gate_up": (16384, 2048), "qkv": (3072, 2048)}


def per_call_us(fn, reps: int = 50) -> float:
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000 / LAYERS)
    return sorted(times)[len(times) // 2]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[16, 32, 64])
    p.add_argument("--splits", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--all-shapes", action="store_true", help="also gate_up and qkv (default: o and down)")
    args = p.parse_args()
    torch.manual_seed(0)
    names = list(SHAPES_1B) if args.all_shapes else ["o", "down"]
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  us per call, median of 50 graph replays")
    for name in names:
        N, K = SHAPES_1B[name]
        weights = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(LAYERS)]
        for M in args.tokens:
            x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            h = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
            row = {"addmm_": per_call_us(lambda: [h.addmm_(x, w.t()) for w in weights]),
                   "linear": per_call_us(lambda: [torch.nn.functional.linear(x, w) for w in weights])}
            for S in args.splits:
                if K % (8 * S):
                    continue
                xs = x.view(M, S, K // S).transpose(0, 1)
                ws = [w.view(N, S, K // S).permute(1, 2, 0) for w in weights]
                parts = torch.bmm(xs, ws[0], out_dtype=torch.float32)
                err = (parts.sum(0) - x.float() @ weights[0].float().t()).abs().max().item()
                assert err < 1e-2, f"split-K partials of {name} at S = {S} differ by {err}"
                row[f"bmm S={S}"] = per_call_us(lambda: [torch.bmm(xs, w, out_dtype=torch.float32) for w in ws])
            print(f"{name:8s} [{N} x {K}] M={M:3d}  " + "  ".join(f"{k} {v:6.2f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
