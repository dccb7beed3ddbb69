"""Can the HBM idle time of a batch-1 decode layer's small kernels be spent fetching the next big kernel's weights
into L2? A stand-in layer, replayed as a CUDA graph with programmatic dependent launch like the engine's step:

    window (a decode-attention-sized grid: 256 blocks of 128 threads, 57 KB of shared memory each, that holds the
            SMs for SPIN us after its wait; before the wait its threads ask L2 for weight bytes of the next kernels)
    -> o + residual (the real skinny_residual, 2048 x 2048) -> norm + gate_up + SiLU (the real skinny_silu,
    16384 x 2048) -> down + residual (the real skinny_residual, 2048 x 8192)

16 layers with their own weights (1.7 GB, so no replay finds the last one's bytes in L2), batch 1, bf16.
The skinny kernels are launched with programmatic dependent launch (as the engine does; --no-pdl: without).
Each variant prints the median layer time of 40 replays and checks the hidden state equals the reference's
(an empty window; with 8-warp o blocks, the first such run: they sum K in another order).
Results: docs/decode-step-budget.md, "Measured and dropped" (L2 prefetch of the next kernels' weights).

Prefetch mechanisms: pf_last / pf_norm (prefetch.global.L2::evict_last / ::evict_normal, one per 128-byte line),
ld_last (a 16-byte ld.global.nc with an L2 evict_last cache policy and a 256-byte L2 fetch per 256 bytes, folded into a sink), bulk
(cp.async.bulk.prefetch.L2, 16 KB pieces). What is fetched: all of o's weight and / or the first rows of gate_up
(the same number of gate and up rows: the tiles the skinny kernel's first blocks read).

    python bench/l2_overlap_probe.py            # needs nvcc, the built kernels (python -m engine.cuda.build), a GPU
"""
from __future__ import annotations

import argparse
import pathlib
import statistics
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.stream_probe import load_probe_module  # noqa: E402
from engine.cuda.driver import Kernel, check, cuda_driver  # noqa: E402
from engine.cuda.library import KernelLibrary  # noqa: E402
from engine.cuda.wrappers import skinny_linear  # noqa: E402

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
__device__ __forceinline__ u64 gtime() { u64 t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t; }
// Unit u of the prefetch (UNIT bytes) -> its address: the first n0 bytes from r0, then n12 bytes from r1 and
// from r2 interleaved by unit (gate rows and up rows in the order the skinny blocks read them).
template <int UNIT>
__device__ __forceinline__ const char* unit_addr(u64 u, const char* r0, u64 n0, const char* r1, const char* r2) {
  const u64 u0 = n0 / UNIT;
  if (u < u0) return r0 + u * UNIT;
  u -= u0;
  return ((u & 1) ? r2 : r1) + (u >> 1) * UNIT;
}
extern "C" __global__ void __launch_bounds__(128) window(const char* r0, u64 n0, const char* r1, const char* r2,
                                                         u64 n12, int mode, u32 spin_ns, u32* sink) {
  extern __shared__ char smem[];
  const u64 tid = blockIdx.x * (u64)blockDim.x + threadIdx.x, nth = (u64)gridDim.x * blockDim.x;
  u32 acc = 0;
  if (mode == 1 || mode == 2) {
    const u64 units = (n0 + 2 * n12) / 128;
    for (u64 u = tid; u < units; u += nth) {
      const char* p = unit_addr<128>(u, r0, n0, r1, r2);
      if (mode == 1) asm volatile("prefetch.global.L2::evict_last [%0];" ::"l"(p));
      else asm volatile("prefetch.global.L2::evict_normal [%0];" ::"l"(p));
    }
  } else if (mode == 3) {
    const u64 units = (n0 + 2 * n12) / 256;
    u64 pol;
    asm volatile("createpolicy.fractional.L2::evict_last.b64 %0, 1.0;" : "=l"(pol));
    u64 u = tid;
    for (; u + 3 * nth < units; u += 4 * nth) {
      u32 v[16];
#pragma unroll
      for (int k = 0; k < 4; ++k)
        asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                     : "=r"(v[4 * k]), "=r"(v[4 * k + 1]), "=r"(v[4 * k + 2]), "=r"(v[4 * k + 3])
                     : "l"(unit_addr<256>(u + k * nth, r0, n0, r1, r2)), "l"(pol));
#pragma unroll
      for (int k = 0; k < 16; ++k) acc ^= v[k];
    }
    for (; u < units; u += nth) {
      u32 a, b, c, d;
      asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                   : "=r"(a), "=r"(b), "=r"(c), "=r"(d) : "l"(unit_addr<256>(u, r0, n0, r1, r2)), "l"(pol));
      acc ^= a ^ b ^ c ^ d;
    }
  } else if (mode == 4) {
    const u64 units = (n0 + 2 * n12) / 16384;
    for (u64 u = tid; u < units; u += nth)
      asm volatile("cp.async.bulk.prefetch.L2.global [%0], 16384;" ::"l"(unit_addr<16384>(u, r0, n0, r1, r2)) : "memory");
  }
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  if (threadIdx.x == 0) smem[0] = (char)acc;
  const u64 t0 = gtime();
  while (gtime() - t0 < spin_ns) {
  }
  __syncthreads();
  if (acc == 0x9e3779b9u + smem[1]) sink[0] = acc;
}
"""

MODES = {"none": 0, "pf_last": 1, "pf_norm": 2, "ld_last": 3, "bulk": 4}
MB = 1 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spin-us", type=float, nargs="+", default=[6.0])
    ap.add_argument("--replays", type=int, default=40)
    ap.add_argument("--no-pdl", action="store_true", help="the skinny kernels launched without programmatic "
                    "dependent launch (each starts when the one before has finished)")
    ap.add_argument("--prefetch", action="store_true", help="the L2 prefetch variants (else only the layouts)")
    ap.add_argument("--window-blocks", type=int, nargs="+", default=[256, 64, 8],
                    help="window grids (blocks of 128 threads and 57.6 KB of shared memory, 3 an SM at most)")
    args = ap.parse_args()
    drv = cuda_driver()
    lib = KernelLibrary(0, pdl=not args.no_pdl)
    mod = load_probe_module(SOURCE)
    func = check("cuModuleGetFunction", drv.cuModuleGetFunction(mod, b"window"))
    smem = 57600  # decode attention's at head_dim 64 (3 stages): 3 blocks an SM
    check("cuFuncSetAttribute", drv.cuFuncSetAttribute(
        func, drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem))
    window = Kernel("window", func, "plpplii" + "p", pdl=True)

    L, H, I = 16, 2048, 8192
    dev = torch.device("cuda", 0)
    gen = torch.Generator(device=dev).manual_seed(0)

    def w(n, k):
        return (torch.randn(n, k, device=dev, generator=gen) * 0.02).to(torch.bfloat16)

    layers = [(w(H, H), w(2 * I, H), w(H, I), (1 + 0.1 * torch.randn(H, device=dev, generator=gen)).to(torch.bfloat16))
              for _ in range(L)]
    h0 = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
    h = h0.clone()
    attn = torch.randn(1, H, device=dev, generator=gen).to(torch.bfloat16)
    act = torch.empty(1, I, device=dev, dtype=torch.bfloat16)
    sink = torch.zeros(4, dtype=torch.int32, device=dev)
    print(f"{torch.cuda.get_device_name(dev)}: {lib.num_sms} SMs; skinny kernels {'without' if args.no_pdl else 'with'} "
          f"programmatic dependent launch; {L} layers, "
          f"{sum(t.numel() * 2 for ly in layers for t in ly[:3]) / 1e9:.2f} GB of weights")

    def run(mode: str, o_bytes: int, g_bytes: int, spin_us: float, blocks: int = 256, o_warps: int = 16):
        """Median us per layer over the replays, and the hidden state after one replay."""
        stream = torch.cuda.Stream(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream):
            h.copy_(h0)  # torch's op once on the side stream outside the capture (as its graph docs ask)
            torch.cuda.synchronize()
            with torch.cuda.graph(graph, stream=stream):
                h.copy_(h0)
                for wo, wgu, wd, nw in layers:
                    up = wgu.data_ptr() + I * H * 2
                    window((blocks, 1, 1), (128, 1, 1), smem, lib.stream(), wo.data_ptr(), o_bytes,
                           wgu.data_ptr(), up, g_bytes // 2, MODES[mode], int(spin_us * 1000), sink.data_ptr())
                    lib.skinny_wide_tiles = lib.num_sms if o_warps == 16 else 0
                    skinny_linear.residual(lib, h, attn, wo)
                    lib.skinny_wide_tiles = lib.num_sms
                    skinny_linear.silu(lib, act, h, wgu, nw, 1e-5)
                    skinny_linear.residual(lib, h, act, wd)
        times = []
        with torch.cuda.stream(stream):  # replay() launches on the current stream
            for _ in range(args.replays):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                s.record(stream)
                graph.replay()
                e.record(stream)
                e.synchronize()
                times.append(s.elapsed_time(e) * 1000 / L)
        torch.cuda.synchronize()
        out = h.clone()
        del graph
        return statistics.median(times[3:]), out

    # The reference: an empty window. (Not o -> gate_up -> down alone: o would then read the residual that
    # down, the kernel just before it, writes, before its wait; the skinny kernels' launch contract forbids it.)
    _, ref = run("none", 0, 0, 0)
    ref8 = None
    for spin in args.spin_us:
        print(f"\nwindow of {spin} us, nothing fetched (o: 16-warp blocks, one an SM / 8-warp blocks, two an SM):")
        nothing = {}  # window blocks -> us a layer, 16-warp o
        for blocks in args.window_blocks:
            nothing[blocks], out16 = run("none", 0, 0, spin, blocks=blocks)
            t8, out8 = run("none", 0, 0, spin, blocks=blocks, o_warps=8)
            ref8 = out8 if ref8 is None else ref8  # 8 warps split K differently: their own sums
            assert torch.equal(out16, ref) and torch.equal(out8, ref8)
            print(f"  {blocks:4d} window blocks: {nothing[blocks]:7.2f} / {t8:7.2f} us a layer")
        if not args.prefetch:
            continue
        base = nothing[256] if 256 in nothing else run("none", 0, 0, spin)[0]
        print(f"window of {spin} us, 256 blocks, nothing fetched: {base:7.2f} us a layer")
        for mode in ("pf_last", "pf_norm", "ld_last", "bulk"):
            for o_bytes, g_mb in ((8 * MB, 0), (0, 8), (0, 16), (8 * MB, 8), (8 * MB, 16), (8 * MB, 24), (8 * MB, 32)):
                t, out = run(mode, o_bytes, g_mb * MB, spin)
                ok = "" if torch.equal(out, ref) else "  OUTPUT DIFFERS"
                print(f"  {mode:8s} o {o_bytes // MB:2d} MB + gate_up {g_mb:2d} MB: {t:7.2f} us a layer "
                      f"({t - base:+6.2f}){ok}")


if __name__ == "__main__":
    main()
