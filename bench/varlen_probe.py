"""Whether cuDNN's variable-length fused attention (`aten._cudnn_attention_forward` with cumulative sequence
lengths, the entry torch's nested tensors use) can attend a graphed prefill forward's fresh prompts: GQA as it is,
causal, [T, H, D] rows packed one sequence after another, the sequence lengths in device tensors that change
between replays of one CUDA graph captured with fixed bounds (max_q = max_k = the forward's padded token count,
sequence rows padded with empty sequences), and how fast, beside FlashAttention's varlen entry on the same rows.

    python bench/varlen_probe.py [--reps 20]

Prints, per head_dim and case: the largest difference from torch's math attention per sequence (fp32), eager and
replayed, and device us a call (CUDA events, median)."""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

H, HKV = 32, 8


def reference(q, k, v, lens, scale):
    out, start = torch.zeros_like(q, dtype=torch.float32), 0
    for n in lens:
        if n:
            qs, ks, vs = (t[start:start + n].float().transpose(0, 1) for t in (q, k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
            out[start:start + n] = o.transpose(0, 1)
        start += n
    return out


def cu(lens, rows, device):
    lens = list(lens) + [0] * (rows - len(lens))
    return torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=device)


def cudnn(q, k, v, cu_q, bound, scale):
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu_q, cu_q, bound, bound, False, 0.0, True, False,
                                                    scale=scale)[0]


def flash(q, k, v, cu_q, bound, scale):
    return torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_q, bound, bound, 0.0, True, False,
                                                    scale=scale)[0]


def timed(fn, reps):
    times = []
    for _ in range(reps + 3):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return statistics.median(times[3:])


def err(out, ref, lens):
    n = sum(lens)
    return (out[:n].float() - ref[:n]).abs().max().item()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    cases = [("1 x 4096", [4096], 1, 4096), ("1 x 2048", [2048], 1, 2048), ("1 x 1024", [1024], 1, 1024),
             ("8 x 512", [512] * 8, 8, 4096), ("4 x 1024", [1024] * 4, 4, 4096),
             ("5 ragged in 8 rows", [700, 300, 1100, 64, 1500], 8, 4096), ("1 x 300 in 4096", [300], 1, 4096),
             ("1 x 512", [512], 1, 512), ("2 x 256", [256] * 2, 2, 512), ("8 x 512 again", [512] * 8, 8, 4096),
             ("1 x 2304 rows, bound 4096", [2304], 1, 4096, 2304), ("1 x 2560 rows, bound 4096", [2560], 1, 4096, 2560),
             ("3 x 800 in 2560 rows, 4 seqs, bound 4096", [800] * 3, 4, 4096, 2560)]
    for d in (64, 128):
        scale = d ** -0.5
        for name, lens, rows, bound, *total in cases:
            t = total[0] if total else bound  # q's rows (the bound may exceed them: one plan for several shapes?)
            q = torch.randn(t, H, d, device=dev, dtype=torch.bfloat16, generator=g)
            k = torch.randn(t, HKV, d, device=dev, dtype=torch.bfloat16, generator=g)
            v = torch.randn(t, HKV, d, device=dev, dtype=torch.bfloat16, generator=g)
            cu_q = cu(lens, rows, dev)
            ref = reference(q, k, v, lens, scale)
            line = f"d{d} {name:22s}"
            for label, fn in (("cudnn", cudnn), ("flash", flash)):
                try:
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    first = fn(q, k, v, cu_q, bound, scale)
                    torch.cuda.synchronize()
                    plan_ms = 1e3 * (time.perf_counter() - t0)
                    e = err(first, ref, lens)
                    us = timed(lambda: fn(q, k, v, cu_q, bound, scale), args.reps)
                    line += f" | {label} {us:8.1f} us err {e:.4f} first {plan_ms:.0f} ms"
                except Exception as ex:  # noqa: BLE001 - a probe: say what refused
                    line += f" | {label} refused: {str(ex).splitlines()[0][:120]}"
            print(line, flush=True)
        # A graph captured at 8 sequence rows of a 4096-token bound, replayed with other lengths.
        for label, fn in (("cudnn", cudnn), ("flash", flash)):
            try:
                q = torch.randn(4096, H, d, device=dev, dtype=torch.bfloat16, generator=g)
                k = torch.randn(4096, HKV, d, device=dev, dtype=torch.bfloat16, generator=g)
                v = torch.randn(4096, HKV, d, device=dev, dtype=torch.bfloat16, generator=g)
                cu_q = cu([512] * 8, 8, dev)
                fn(q, k, v, cu_q, 4096, scale)  # plans before the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = fn(q, k, v, cu_q, 4096, scale)
                errs = []
                for lens in ([512] * 8, [700, 300, 1100, 64, 1500], [4000], [1] * 8, [33, 2000, 17]):
                    cu_q.copy_(cu(lens, 8, dev))
                    graph.replay()
                    torch.cuda.synchronize()
                    errs.append(err(out, reference(q, k, v, lens, scale), lens))
                print(f"d{d} graph ({label}, 8 rows, bound 4096): replays with other lengths, max err "
                      + " ".join(f"{e:.4f}" for e in errs), flush=True)
            except Exception as ex:  # noqa: BLE001
                print(f"d{d} graph ({label}): refused: {str(ex).splitlines()[0][:160]}", flush=True)


if __name__ == "__main__":
    main()
