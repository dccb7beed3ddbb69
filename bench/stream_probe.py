"""How fast one H200 streams weight bytes into the SMs by each mechanism the skinny kernels could use: bulk
copies (cp.async.bulk, the TMA engine) into a ring of shared-memory stages, by copy size, stage size, ring
depth and blocks per SM, against plain 16-byte register loads. Each kernel reads a 1 GiB buffer once (each
block its contiguous share) and XORs what it read into a sink so nothing is optimised away.

    python bench/stream_probe.py            # needs nvcc (builds a cubin in a temp dir) and a GPU
"""
from __future__ import annotations

import ctypes
import pathlib
import statistics
import subprocess
import sys
import tempfile

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine.cuda.driver import check, cuda_driver  # noqa: E402

SOURCE = r"""
typedef unsigned long long u64;
typedef unsigned int u32;
__device__ __forceinline__ u32 sa(const void* p) {
  u64 a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (u32)a;
}
__device__ __forceinline__ void wait_parity(u64* bar, u32 parity) {
  asm volatile("{\n .reg .pred d;\nW_%=:\n mbarrier.try_wait.parity.shared::cta.b64 d, [%0], %1;\n @!d bra W_%=;\n}\n"
               ::"r"(sa(bar)), "r"(parity) : "memory");
}
// Ring: block b streams bytes [b per, (b+1) per) in stages of STAGE bytes, COPY bytes per bulk copy.
// ROW: bytes between the copies of one stage in global memory (COPY: one contiguous run; 4096: rows of a
// K = 2048 bf16 matrix, a unit = the next COPY bytes of 16 rows); DST: their stride in shared memory.
// SHARED: each unit also copies SHARED bytes (after its weight copies, a second arrival on the stage's barrier)
// from one small buffer every block reads (the activations x of a skinny kernel): sink + 64 bytes, 4 KB.
template <int COPY, int STAGE, int STAGES, int CONS, int READ, int ROW = COPY, int DST = COPY, int SHARED = 0>
__device__ void ring(const char* src, u64 per, u32* sink) {
  constexpr int SLICES = ROW / COPY, SMEM_STAGE = STAGE / COPY * DST + SHARED;
  constexpr int XSLOTS = SHARED > 0 && SHARED < 4096 ? 4096 / SHARED : 1;
  extern __shared__ __align__(128) char smem[];
  __shared__ __align__(8) u64 full[STAGES], empty[STAGES];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&full[s])), "r"(SHARED ? 2 : 1) : "memory");
      asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(sa(&empty[s])), "r"(CONS) : "memory");
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  }
  __syncthreads();
  const char* base = src + blockIdx.x * per;
  const int units = (int)(per / STAGE);
  if (warp == CONS) {
    u64 policy;
    asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(policy));
    for (int u = 0; u < units; ++u) {
      const int s = u % STAGES;
      if (u >= STAGES) wait_parity(&empty[s], ((u / STAGES) & 1) ^ 1);
      if (lane == 0) asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&full[s])), "r"(STAGE) : "memory");
      __syncwarp();
      for (int c = lane; c < STAGE / COPY; c += 32)
        asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint [%0], [%1], %2, [%3], %4;"
                     ::"r"(sa(smem + s * SMEM_STAGE + c * DST)),
                     "l"(base + (u64)(u / SLICES) * (STAGE / COPY) * ROW + (u % SLICES) * COPY + (u64)c * ROW), "r"(COPY),
                     "r"(sa(&full[s])), "l"(policy) : "memory");
      if (SHARED) {
        __syncwarp();
        if (lane == 0) {
          asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(sa(&full[s])), "r"(SHARED) : "memory");
          asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                       ::"r"(sa(smem + s * SMEM_STAGE + SMEM_STAGE - SHARED)),
                       "l"((const char*)sink + 64 + (u % XSLOTS) * SHARED), "r"(SHARED), "r"(sa(&full[s])) : "memory");
        }
      }
    }
    return;
  }
  u32 acc = 0;
  for (int u = 0; u < units; ++u) {
    const int s = u % STAGES;
    wait_parity(&full[s], (u / STAGES) & 1);
    if (READ) {
      for (int i = (warp * 32 + lane) * 16; i < STAGE; i += CONS * 32 * 16) {
        u32 a, b, c, d;
        asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(a), "=r"(b), "=r"(c), "=r"(d)
                     : "r"(sa(smem + s * SMEM_STAGE + i / COPY * DST + i % COPY)));
        acc ^= a ^ b ^ c ^ d;
      }
    }
    __syncwarp();
    if (lane == 0) asm volatile("{\n .reg .b64 st;\n mbarrier.arrive.shared::cta.b64 st, [%0];\n}" ::"r"(sa(&empty[s])) : "memory");
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
#define RING(NAME, ...) \
  extern "C" __global__ void __launch_bounds__(160) NAME(const char* src, u64 per, u32* sink) { \
    ring<__VA_ARGS__>(src, per, sink); }
RING(ring_c1k_s16k_x6_r, 1024, 16384, 6, 4, 1)
RING(ring_c1k_s16k_x6_n, 1024, 16384, 6, 4, 0)
RING(ring_c2k_s16k_x6_r, 2048, 16384, 6, 4, 1)
RING(ring_c4k_s16k_x6_r, 4096, 16384, 6, 4, 1)
RING(ring_c16k_s16k_x6_r, 16384, 16384, 6, 4, 1)
RING(ring_c1k_s16k_x12_r, 1024, 16384, 12, 4, 1)
RING(ring_c4k_s16k_x12_r, 4096, 16384, 12, 4, 1)
RING(ring_c16k_s32k_x6_r, 16384, 32768, 6, 4, 1)
RING(ring_c32k_s32k_x6_r, 32768, 32768, 6, 4, 1)
RING(ring_c1k_s8k_x12_r, 1024, 8192, 12, 4, 1)
RING(ring_c1k_s8k_x6_r, 1024, 8192, 6, 4, 1)
RING(ring_c1k_s16k_x6_pad, 1024, 16384, 6, 4, 1, 1024, 1088)
RING(ring_c1k_s16k_x6_rows, 1024, 16384, 6, 4, 1, 4096, 1024)
RING(ring_c1k_s16k_x6_rowspad, 1024, 16384, 6, 4, 1, 4096, 1088)
RING(ring_c1k_s16k_x5_rowspad, 1024, 16384, 5, 4, 1, 4096, 1088)
RING(ring_c1k_s16k_x5_rows, 1024, 16384, 5, 4, 1, 4096, 1024)
RING(ring_c2k_s32k_x3_rows, 2048, 32768, 3, 4, 1, 4096, 2048)
RING(ring_c1k_s16k_x5_rows_x1k, 1024, 16384, 5, 4, 1, 4096, 1024, 1024)
RING(ring_c1k_s16k_x5_rows_x8k, 1024, 16384, 5, 4, 1, 4096, 1024, 8192)
// Register loads: each thread U 16-byte loads in flight, grid-stride over 16-byte words.
template <int U>
__device__ void regs(const uint4* src, u64 n, u32* sink) {
  u32 acc = 0;
  const u64 stride = (u64)gridDim.x * blockDim.x;
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int k = 0; k < U; ++k) {
      const u64 j = i + k * stride;
      if (j < n) asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                              : "=r"(v[k].x), "=r"(v[k].y), "=r"(v[k].z), "=r"(v[k].w) : "l"(src + j));
      else v[k] = make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < U; ++k) acc ^= v[k].x ^ v[k].y ^ v[k].z ^ v[k].w;
  }
  if (acc == 0x9e3779b9u) sink[0] = acc;
}
extern "C" __global__ void __launch_bounds__(256) regs_u4(const uint4* s, u64 n, u32* sink) { regs<4>(s, n, sink); }
extern "C" __global__ void __launch_bounds__(256) regs_u8(const uint4* s, u64 n, u32* sink) { regs<8>(s, n, sink); }
"""

RINGS = {  # name -> (stage bytes, stages)
    "ring_c1k_s16k_x6_r": (16384, 6), "ring_c1k_s16k_x6_n": (16384, 6), "ring_c2k_s16k_x6_r": (16384, 6),
    "ring_c4k_s16k_x6_r": (16384, 6), "ring_c16k_s16k_x6_r": (16384, 6), "ring_c1k_s16k_x12_r": (16384, 12),
    "ring_c4k_s16k_x12_r": (16384, 12), "ring_c16k_s32k_x6_r": (32768, 6), "ring_c32k_s32k_x6_r": (32768, 6),
    "ring_c1k_s8k_x12_r": (8192, 12), "ring_c1k_s8k_x6_r": (8192, 6),
    "ring_c1k_s16k_x6_pad": (17408, 6), "ring_c1k_s16k_x6_rows": (16384, 6), "ring_c1k_s16k_x6_rowspad": (17408, 6),
    "ring_c1k_s16k_x5_rowspad": (17408, 5), "ring_c1k_s16k_x5_rows": (16384, 5), "ring_c2k_s32k_x3_rows": (32768, 3),
    "ring_c1k_s16k_x5_rows_x1k": (17408, 5), "ring_c1k_s16k_x5_rows_x8k": (24576, 5),
}
STREAM_BYTES = {"ring_c1k_s16k_x5_rows_x1k": 16384, "ring_c1k_s16k_x5_rows_x8k": 16384, "ring_c1k_s16k_x6_pad": 16384, "ring_c1k_s16k_x6_rowspad": 16384, "ring_c1k_s16k_x5_rowspad": 16384}


def load_probe_module(source: str):
    """Compiles a probe's CUDA source with nvcc (sm_90, in a temp dir) and loads it into the current context."""
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "probe.cu"
        src.write_text(source)
        cubin = pathlib.Path(tmp) / "probe.cubin"
        subprocess.run(["nvcc", "-cubin", "-O3", "-std=c++17", "-arch=sm_90", "-o", str(cubin), str(src)], check=True)
        return check("cuModuleLoadData", cuda_driver().cuModuleLoadData(cubin.read_bytes()))


def main() -> None:
    drv = cuda_driver()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    ctx = check("cuCtxGetCurrent", drv.cuCtxGetCurrent())
    assert ctx
    dev = torch.cuda.current_device()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    mod = load_probe_module(SOURCE)
    total = 1 << 30
    buf = torch.randint(0, 255, (total,), dtype=torch.uint8, device="cuda")
    sink = torch.zeros(16 + 8192 // 4, dtype=torch.int32, device="cuda")  # + the shared 4-8 KB
    smem_attr = drv.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES

    def timed(func, grid, block, smem, args):
        vals = [ctypes.c_uint64(a) for a in args]
        ptrs = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        stream = torch.cuda.current_stream().cuda_stream
        times = []
        for _ in range(8):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            check("cuLaunchKernel", drv.cuLaunchKernel(func, grid, 1, 1, block, 1, 1, smem, stream,
                                                       ctypes.addressof(ptrs), 0))
            e.record()
            e.synchronize()
            times.append(s.elapsed_time(e) * 1e-3)
        return total / statistics.median(times[2:]) / 1e12

    print(f"{torch.cuda.get_device_name(dev)}: {sms} SMs, 1 GiB read once per launch, median of 6 (TB/s)")
    for name, (stage, stages) in RINGS.items():
        func = check("cuModuleGetFunction", drv.cuModuleGetFunction(mod, name.encode()))
        smem = stage * stages
        check("cuFuncSetAttribute", drv.cuFuncSetAttribute(func, smem_attr, smem))
        for per_sm in (1, 2):
            if per_sm * (smem + 1024) > 228 * 1024:
                continue
            grid = sms * per_sm
            step = STREAM_BYTES.get(name, stage)  # global bytes a unit reads
            per = total // grid // (4 * step) * (4 * step)
            tbps = timed(func, grid, 160, smem, [buf.data_ptr(), per, sink.data_ptr()])
            tbps *= grid * per / total
            print(f"  {name:24s} ring {smem // 1024:4d} KB  {per_sm} block/SM  {tbps:6.2f}")
    for name in ("regs_u4", "regs_u8"):
        func = check("cuModuleGetFunction", drv.cuModuleGetFunction(mod, name.encode()))
        for per_sm in (2, 4, 8):
            tbps = timed(func, sms * per_sm, 256, 0, [buf.data_ptr(), total // 16, sink.data_ptr()])
            print(f"  {name:24s} {per_sm} x 256 threads/SM          {tbps:6.2f}")


if __name__ == "__main__":
    main()
