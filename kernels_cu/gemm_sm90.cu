// nvcc-gencode: 90a
// Op: the linear layers of decode and verify forwards of 9-256 rows on Hopper's warpgroup MMA (wgmma), each with
// its projection's epilogue fused (sm_90a only: KernelLibrary loads this module on compute capability 9.0).
//
//   y[m, n] = sum_k x[m, k] W[n, k]            x [M, K], W [N, K], bf16, fp32 sums
//   store     out[m, n] = T(y)                  out [M, N] bf16
//   f32       out[m, n] = y                     out [M, N] fp32 (logits)
//   residual  out[m, n] = T(out[m, n] + y)      out [M, N] bf16, in place (one rounding, as cuBLAS's addmm_)
//   silu      out[m, p] = T(T(silu(T(g))) * T(u)), g = y[m, p], u = y[m, I + p], silu(g) = g / (1 + exp(-g));
//             W = [gate (I rows) | up (I rows)], N = 2 I, out [M, I] bf16 (silu_and_mul.cu's roundings)
// W8A8 (the _w8a8 entries): x and W E4M3 with per-row fp32 scales (x per token, engine/quant.py's dynamic scheme; W
// per output channel), multiplied on the FP8 MMA (k32) with no conversion: v = (y * x_scale[m]) * w_scale[n]
// (engine.quant.w8a8_linear's order), and the GEMM's bf16 output T(v) goes into the epilogue as the separate ops
// compute it: store T(v); residual T(out + T(v)); silu with g and u the T(v) of the gate and up rows (no f32 entry).
//
// Roles swapped: W is the MMA's A operand (64 rows a warpgroup) and x its B operand, so the forward's rows are
// the MMA's N side (NT = 16, 32, 64, 128 or 256 columns, M <= NT: the rest are zeros) and a block reads each of
// its weight rows once for every row of the forward. At these sizes a step reads the weights at about the MMA's
// ridge point: the bytes in flight, not the MMA, bound it.
//
// A block: 256 threads, two warpgroups, 128 weight rows (store / f32 / residual: rows [128 t, 128 t + 128);
// silu: gate rows [64 t, 64 t + 64) in warpgroup 0 and the up rows [I + 64 t, ...) in warpgroup 1, so each
// thread's gate sums meet the same thread position's up sums through shared memory) by every column, over the
// K range of its split: k-tiles [s KT / S, (s + 1) KT / S) of KT = ceil(K bytes / 128).
// Shared memory: STAGES stages, each the W tile (128 rows x 128 bytes: 64 k of bf16, 128 of E4M3) then the x tile (NT
// rows x 128 bytes), each row's 16-byte chunks XOR-swizzled by (row % 8): the 128-byte swizzle the MMA's shared-memory
// descriptors name (start address, stride of 8 rows = 1024 bytes, swizzle mode 1). Stages are filled by cp.async (every
// thread, 16 bytes a copy; rows past M or N and K past the end are zero-filled), made visible to the MMA's async proxy
// by fence.proxy.async and a barrier, and consumed by four MMAs a warpgroup (m64nNTk16 bf16 or m64nNTk32 E4M3: 32 bytes
// of each row, the descriptor's start advanced by 32 bytes each); a stage is refilled only after both warpgroups' MMAs
// on it completed (wgmma.wait_group 0 before the next barrier).
// Split K (S > 1): each block stores its fp32 sums to ws (its thread's registers in order, coalesced), and the last
// block of its tile to arrive (counters[t], reset by that block) adds every split's sums in split order, so the result
// does not depend on which block finishes last, and applies the epilogue.
//
// Launch contract (gemm_sm90_{store,f32,residual,silu}_bf16_n{16,32,64,128,256};
// gemm_sm90_{store,residual,silu}_w8a8_n{16,32,64,128,256} with x_scale [M] after x and w_scale [N] after w;
// gemm_sm90_{store,f32,residual,silu}_w8a16_n8: bf16 x, E4M3 w, w_scale [N] after w, dynamic shared memory
// gemm_w8a16_smem_bytes(), K % 16 == 0 and at most W16_XK / 128 k-tiles a split; below, W8A16 at gemm_w8a16_impl):
//   grid (tiles, S), block 256, dynamic shared memory gemm_smem_bytes(NT) (engine/cuda/wrappers/gemm_sm90.py);
//   tiles = ceil(N / 128) (silu: ceil(I / 64)); 1 <= S <= KT; M <= NT; K % 8 == 0 (E4M3: % 16); x, W 16-byte
//   aligned, x and out contiguous rows; ws holds tiles * S * NT * 128 floats when S > 1, and counters[0 .. tiles)
//   are zero (every launch leaves them so). Launches that share ws and counters must be ordered (one stream).
// Built WITHOUT --use_fast_math: silu's expf and division must be the accurate ones.
#include "common.cuh"

#define GEMM_THREADS 256
#define GEMM_ROWS 128  // weight rows a block
#define GEMM_ROW_BYTES 128  // of each operand row a stage: one 128-byte swizzle row (64 k of bf16, 128 of E4M3)

enum { GEP_STORE = 0, GEP_F32 = 1, GEP_RESIDUAL = 2, GEP_SILU = 3 };

// Bytes of one stage; stages in flight (at most 8, within 192 KiB); dynamic shared memory of a launch (+1 KiB:
// the stages start at the first 1024-byte boundary, the swizzle's period).
__host__ __device__ constexpr int gemm_stage_bytes(int nt) { return (GEMM_ROWS + nt) * GEMM_ROW_BYTES; }
__host__ __device__ constexpr int gemm_stages(int nt) {
  return 196608 / gemm_stage_bytes(nt) < 8 ? 196608 / gemm_stage_bytes(nt) : 8;
}
__host__ __device__ constexpr int gemm_smem_bytes(int nt) { return gemm_stages(nt) * gemm_stage_bytes(nt) + 1024; }

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GEMM_SM90 1

// D[64 x N] += A[64 x k] * B[k x N] (k = 16 bf16, or F8: 32 E4M3): A and B K-major in shared memory (descriptors),
// D fp32 in registers in the m16n8 accumulator layout, N / 8 times: d[4 j + 2 h + e] is row 16 warp + lane / 4 +
// 8 h, column 8 j + 2 (lane % 4) + e of the warpgroup's 64 x N.
template <int N, bool F8>
struct Wgmma;
// Spelled out per N: the accumulators' register and operand lists; scale-d 1 (the accumulators start at zero).
#define WGMMA_REGS_16 \
  "%0, %1, %2, %3, %4, %5, %6, %7"
#define WGMMA_OUTS_16 \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), \
  "+f"(d[6]), "+f"(d[7])
#define WGMMA_ARGS_16 "%8, %9, %10"  // a-desc, b-desc, scale-d
#define WGMMA_REGS_32 \
  WGMMA_REGS_16 ", " \
  "%8, %9, %10, %11, %12, %13, %14, %15"
#define WGMMA_OUTS_32 \
  WGMMA_OUTS_16, \
  "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), \
  "+f"(d[14]), "+f"(d[15])
#define WGMMA_ARGS_32 "%16, %17, %18"  // a-desc, b-desc, scale-d
#define WGMMA_REGS_64 \
  WGMMA_REGS_32 ", " \
  "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define WGMMA_OUTS_64 \
  WGMMA_OUTS_32, \
  "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), \
  "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), \
  "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
#define WGMMA_ARGS_64 "%32, %33, %34"  // a-desc, b-desc, scale-d
#define WGMMA_REGS_128 \
  WGMMA_REGS_64 ", " \
  "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
  "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WGMMA_OUTS_128 \
  WGMMA_OUTS_64, \
  "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), \
  "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), \
  "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), \
  "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), \
  "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), \
  "+f"(d[62]), "+f"(d[63])
#define WGMMA_ARGS_128 "%64, %65, %66"  // a-desc, b-desc, scale-d
#define WGMMA_REGS_256 \
  WGMMA_REGS_128 ", " \
  "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
  "%80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95, " \
  "%96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111, " \
  "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WGMMA_OUTS_256 \
  WGMMA_OUTS_128, \
  "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), \
  "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), \
  "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]), "+f"(d[80]), "+f"(d[81]), \
  "+f"(d[82]), "+f"(d[83]), "+f"(d[84]), "+f"(d[85]), "+f"(d[86]), "+f"(d[87]), \
  "+f"(d[88]), "+f"(d[89]), "+f"(d[90]), "+f"(d[91]), "+f"(d[92]), "+f"(d[93]), \
  "+f"(d[94]), "+f"(d[95]), "+f"(d[96]), "+f"(d[97]), "+f"(d[98]), "+f"(d[99]), \
  "+f"(d[100]), "+f"(d[101]), "+f"(d[102]), "+f"(d[103]), "+f"(d[104]), "+f"(d[105]), \
  "+f"(d[106]), "+f"(d[107]), "+f"(d[108]), "+f"(d[109]), "+f"(d[110]), "+f"(d[111]), \
  "+f"(d[112]), "+f"(d[113]), "+f"(d[114]), "+f"(d[115]), "+f"(d[116]), "+f"(d[117]), \
  "+f"(d[118]), "+f"(d[119]), "+f"(d[120]), "+f"(d[121]), "+f"(d[122]), "+f"(d[123]), \
  "+f"(d[124]), "+f"(d[125]), "+f"(d[126]), "+f"(d[127])
#define WGMMA_ARGS_256 "%128, %129, %130"  // a-desc, b-desc, scale-d
#define WGMMA_SPEC(N, F8, INSTR, IMMS)                                                                     \
  template <>                                                                                               \
  struct Wgmma<N, F8> {                                                                                     \
    static __device__ __forceinline__ void run(float (&d)[N / 2], u64 desc_a, u64 desc_b) {                 \
      asm volatile(INSTR " {" WGMMA_REGS_##N "}, " WGMMA_ARGS_##N ", " IMMS ";\n"                           \
                   : WGMMA_OUTS_##N                                                                         \
                   : "l"(desc_a), "l"(desc_b), "n"(1));                                                     \
    }                                                                                                       \
  };
WGMMA_SPEC(16, false, "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16", "1, 1, 0, 0")
WGMMA_SPEC(16, true, "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3", "1, 1")
WGMMA_SPEC(32, false, "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16", "1, 1, 0, 0")
WGMMA_SPEC(32, true, "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3", "1, 1")
WGMMA_SPEC(64, false, "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16", "1, 1, 0, 0")
WGMMA_SPEC(64, true, "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3", "1, 1")
WGMMA_SPEC(128, false, "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16", "1, 1, 0, 0")
WGMMA_SPEC(128, true, "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3", "1, 1")
WGMMA_SPEC(256, false, "wgmma.mma_async.sync.aligned.m64n256k16.f32.bf16.bf16", "1, 1, 0, 0")
WGMMA_SPEC(256, true, "wgmma.mma_async.sync.aligned.m64n256k32.f32.e4m3.e4m3", "1, 1")

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// cp.async's writes (generic proxy) -> the MMA's reads (async proxy).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory"); }
// Keeps the compiler from moving the accumulators' uses across the asynchronous MMAs.
template <int R>
__device__ __forceinline__ void fence_operands(float (&d)[R]) {
#pragma unroll
  for (int r = 0; r < R; ++r) asm volatile("" : "+f"(d[r])::"memory");
}

// The descriptor of a K-major tile of 128-byte rows, 128-byte swizzle, at shared address `addr` (a 1024-byte
// aligned tile plus the byte offset of the MMA's k-slice within the row: the MMA applies the swizzle to the address
// bits). Leading byte offset 1 (unused with this swizzle), stride byte offset 1024 (8 rows), swizzle mode 1.
__device__ __forceinline__ u64 sw128_desc(u32 addr) {
  return (u64)((addr >> 4) & 0x3FFFu) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}

__device__ __forceinline__ void cp_async16_to(u32 dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void st_cg(float* p, float v) {
  asm volatile("st.global.cg.f32 [%0], %1;\n" ::"l"(p), "f"(v));
}
__device__ __forceinline__ float ld_cg(const float* p) {
  float v;
  asm volatile("ld.global.cg.f32 %0, [%1];\n" : "=f"(v) : "l"(p));
  return v;
}

// One stage at shared address sa: W rows [base0, base0 + 64) (< lim0) then [base1, base1 + 64) (< lim1) into its W
// tile, and x rows [0, NT) (< M) into its x tile after it, bytes [b0, b0 + 128) of each row (< row_bytes, the rest
// zeros), swizzled.
__device__ __forceinline__ void gemm_load_w(u32 sa, const unsigned char* __restrict__ w, int base0, int base1,
                                            int lim0, int lim1, int row_bytes, int b0, int tid) {
#pragma unroll
  for (int i = 0; i < GEMM_ROWS * 8 / GEMM_THREADS; ++i) {
    const int q = tid + i * GEMM_THREADS, r = q >> 3, c = q & 7;
    const int row = (r < 64 ? base0 : base1) + (r & 63), b = b0 + c * 16;
    const bool ok = row < (r < 64 ? lim0 : lim1) && b < row_bytes;
    cp_async16_to(sa + r * 128 + ((c ^ (r & 7)) << 4), ok ? w + (i64)row * row_bytes + b : w, ok ? 16 : 0);
  }
}
template <int NT>
__device__ __forceinline__ void gemm_load_stage(u32 sa, const unsigned char* __restrict__ x,
                                                const unsigned char* __restrict__ w, int base0, int base1, int lim0,
                                                int lim1, int M, int row_bytes, int b0, int tid) {
  gemm_load_w(sa, w, base0, base1, lim0, lim1, row_bytes, b0, tid);
  const u32 sb = sa + GEMM_ROWS * GEMM_ROW_BYTES;
  constexpr int CHUNKS = NT * 8;
#pragma unroll
  for (int i = 0; i < (CHUNKS + GEMM_THREADS - 1) / GEMM_THREADS; ++i) {
    const int q = tid + i * GEMM_THREADS, r = q >> 3, c = q & 7;
    if (CHUNKS % GEMM_THREADS == 0 || q < CHUNKS) {
      const int b = b0 + c * 16;
      const bool ok = r < M && b < row_bytes;
      cp_async16_to(sb + r * 128 + ((c ^ (r & 7)) << 4), ok ? x + (i64)r * row_bytes + b : x, ok ? 16 : 0);
    }
  }
}
// The block's sums into the output: split K summed by the tile's last block (in split order), scaled (SCALE_W8A8:
// (y * x_scale[m]) * w_scale[n] rounded to bf16, the W8A8 GEMM's output; SCALE_W8A16: y * w_scale[n], W8A16's fp32
// value), then the epilogue. Every thread of the block calls it (barriers); xch: R x 128 floats of shared memory no
// copy or MMA still uses (the silu exchange).
enum { SCALE_NONE = 0, SCALE_W8A8 = 1, SCALE_W8A16 = 2 };
template <int NT, int EP, int SCALE>
__device__ __forceinline__ void gemm_finish(float (&acc)[NT / 2], void* out, const float* __restrict__ x_scale,
                                            const float* __restrict__ w_scale, float* __restrict__ ws,
                                            int* __restrict__ counters, float* xch, int M, int N, int splits) {
  constexpr int R = NT / 2;
  __shared__ int s_last;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int tile = blockIdx.x, split = blockIdx.y, I = N >> 1;
  const int base0 = EP == GEP_SILU ? tile * 64 : tile * GEMM_ROWS;
  const int base1 = EP == GEP_SILU ? I + tile * 64 : base0 + 64;
  if (splits > 1) {
    float* part = ws + (i64)(tile * splits + split) * R * GEMM_THREADS;
#pragma unroll
    for (int r = 0; r < R; ++r) st_cg(part + r * GEMM_THREADS + tid, acc[r]);
    __threadfence();
    __syncthreads();
    if (tid == 0) s_last = atomicAdd(counters + tile, 1) == splits - 1;
    __syncthreads();
    if (!s_last) return;
    __threadfence();
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    for (int o = 0; o < splits; ++o) {  // in split order, whichever block came last
      const float* p = ws + (i64)(tile * splits + o) * R * GEMM_THREADS;
#pragma unroll
      for (int r = 0; r < R; ++r) acc[r] += ld_cg(p + r * GEMM_THREADS + tid);
    }
    if (tid == 0) counters[tile] = 0;
  }

  const int row_in = warp * 16 + (lane >> 2), col_in = (lane & 3) * 2;
  if (SCALE != SCALE_NONE) {  // rows past M or N: never stored
    const int n0 = EP == GEP_SILU ? (wg ? base1 : base0) : base0 + wg * 64;
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int n = n0 + row_in + ((r >> 1) & 1) * 8, m = (r >> 2) * 8 + col_in + (r & 1);
      const float wsc = n < N ? w_scale[n] : 0.f;
      if (SCALE == SCALE_W8A8)
        acc[r] = round_to<Bf16>(acc[r] * (m < M ? x_scale[m] : 0.f) * wsc);
      else
        acc[r] = acc[r] * wsc;
    }
  }
  if (EP == GEP_SILU) {
    fence_proxy_async();  // (the MMAs' reads of these bytes completed at their wait; ordered before the stores anyway)
    __syncthreads();
    float* up = xch;
    if (wg == 1) {
#pragma unroll
      for (int r = 0; r < R; ++r) up[r * 128 + (tid & 127)] = acc[r];
    }
    __syncthreads();
    if (wg == 1) return;
    u16* o = reinterpret_cast<u16*>(out);
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const int p = tile * 64 + row_in + ((r >> 1) & 1) * 8, m = (r >> 2) * 8 + col_in + (r & 1);
      if (m < M && p < I) {
        const float g = round_to<Bf16>(acc[r]), u = round_to<Bf16>(up[r * 128 + tid]);
        o[(i64)m * I + p] = Bf16::from_float(round_to<Bf16>(g / (1.0f + expf(-g))) * u);
      }
    }
    return;
  }
  const int n0 = tile * GEMM_ROWS + wg * 64;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int n = n0 + row_in + ((r >> 1) & 1) * 8, m = (r >> 2) * 8 + col_in + (r & 1);
    if (m < M && n < N) {
      const i64 idx = (i64)m * N + n;
      if (EP == GEP_F32) {
        reinterpret_cast<float*>(out)[idx] = acc[r];
      } else if (EP == GEP_RESIDUAL) {
        u16* p = reinterpret_cast<u16*>(out) + idx;
        *p = Bf16::from_float(Bf16::to_float(*p) + acc[r]);
      } else {
        reinterpret_cast<u16*>(out)[idx] = Bf16::from_float(acc[r]);
      }
    }
  }
}

// D[64 x 8] += A[64 x 16] * B[16 x 8] with A in registers (bf16 pairs in the mma.sync m16n8k16 A layout a warp
// a 16-row slice: a0 rows g, k 2t, 2t + 1; a1 row g + 8; a2 row g, k 2t + 8, 2t + 9; a3 row g + 8), B K-major in
// shared memory (descriptor).
__device__ __forceinline__ void wgmma_m64n8k16_ra(float (&d)[4], const u32 (&a)[4], u64 desc_b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, {%4, %5, %6, %7}, %8, 1, 1, 1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc_b));
}
__device__ __forceinline__ u32 lds_u32(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];\n" : "=r"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ void sts_u32(u32 addr, u32 v) {
  asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(addr), "r"(v));
}

// W8A16 (the _w8a16_n8 entries): x [M <= 8, K] bf16 and W [N, K] E4M3 with w_scale [N]: v = (x @ T(W)^T) * w_scale[n]
// in fp32 (engine.quant.fp8_linear's W8A16 arithmetic up to the order of the sums), into the bf16 epilogues.
// The block's x (every row, its split's K range of at most W16_XK) stays in shared memory, stored as 64-k tiles of
// 8 rows x 128 bytes, 128-byte swizzled, with each 16-value group's pairs permuted: MMA slots (2t, 2t + 1) hold
// values (4t, 4t + 1) and slots (2t + 8, 2t + 9) values (4t + 2, 4t + 3). The weight's stages stream through
// cp.async as the other entries' do (128 bytes a row: 128 k). For each k16 step a lane then reads one 32-bit word of
// each of its two rows, bytes 4t .. 4t + 3 of the step's 16 (the swizzle makes the warp's reads conflict-free), and
// converts them exactly (fp8x4_to_pairs) into its A registers: under the same permutation they are its four slots.
#define W16_XK 4096
#define W16_STAGES 8
#define W16_X_BYTES (W16_XK / 64 * 1024)
__host__ __device__ constexpr int gemm_w8a16_smem_bytes() {
  return W16_X_BYTES + W16_STAGES * GEMM_ROWS * GEMM_ROW_BYTES + 1024;
}

template <int EP>
__device__ __forceinline__ void gemm_w8a16_impl(void* out, const u16* __restrict__ x,
                                                const unsigned char* __restrict__ w, const float* __restrict__ w_scale,
                                                float* __restrict__ ws, int* __restrict__ counters, int M, int N, int K,
                                                int splits) {
  constexpr int STAGES = W16_STAGES, SB = GEMM_ROWS * GEMM_ROW_BYTES;
  extern __shared__ unsigned char gemm_smem[];
  const u32 raw = smem_addr(gemm_smem), xs = (raw + 1023u) & ~1023u, wbase = xs + W16_X_BYTES;
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int I = N >> 1;
  const int base0 = EP == GEP_SILU ? tile * 64 : tile * GEMM_ROWS;
  const int base1 = EP == GEP_SILU ? I + tile * 64 : base0 + 64;
  const int lim0 = EP == GEP_SILU ? I : N;
  const int KT = (K + GEMM_ROW_BYTES - 1) / GEMM_ROW_BYTES;  // 128 k a tile
  const int kt0 = (int)((i64)split * KT / splits), nk = (int)((i64)(split + 1) * KT / splits) - kt0;

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) gemm_load_w(wbase + s * SB, w, base0, base1, lim0, N, K, (kt0 + s) * GEMM_ROW_BYTES, tid);
    cp_async_commit();
  }
  // x's K range [kt0 * 128, (kt0 + nk) * 128) into 2 nk tiles of 64 k (zeros past M and K).
  const int chunks_per_row = nk * 16;  // 16-byte chunks: 8 values
  for (int q = tid; q < 8 * chunks_per_row; q += GEMM_THREADS) {
    const int r = q / chunks_per_row, rem = q - r * chunks_per_row, sub = rem >> 3, c = rem & 7;
    const int k = kt0 * GEMM_ROW_BYTES + sub * 64 + c * 8;
    Vec16 v = {{0u, 0u, 0u, 0u}};
    if (r < M && k < K) v = ld_act16(x + (i64)r * K + k);
#pragma unroll
    for (int p = 0; p < 4; ++p) {  // pair j = (c & 1) * 4 + p of its 16-value group c >> 1
      const int j = (c & 1) * 4 + p, slot = (j & 1) ? 4 + (j >> 1) : (j >> 1);
      const int byte = (c >> 1) * 32 + slot * 4;
      sts_u32(xs + sub * 1024 + r * 128 + ((((byte >> 4) ^ (r & 7))) << 4) + (byte & 15), v.w[p]);
    }
  }

  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  const int row0 = wg * 64 + warp * 16 + (lane >> 2), t4 = (lane & 3) * 4, sw = row0 & 7;  // row0 + 8: same sw
  int stage = 0, refill = STAGES - 1;
  for (int i = 0; i < nk; ++i) {
    cp_async_wait<STAGES - 2>();
    fence_proxy_async();  // (the first time also x's stores)
    __syncthreads();
    if (i + STAGES - 1 < nk)
      gemm_load_w(wbase + refill * SB, w, base0, base1, lim0, N, K, (kt0 + i + STAGES - 1) * GEMM_ROW_BYTES, tid);
    cp_async_commit();
    const u32 sa = wbase + stage * SB;
    u32 a[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      const u32 w0 = lds_u32(sa + row0 * 128 + ((kk ^ sw) << 4) + t4);
      const u32 w1 = lds_u32(sa + (row0 + 8) * 128 + ((kk ^ sw) << 4) + t4);
      fp8x4_to_pairs<Bf16>(w0, a[kk][0], a[kk][2]);
      fp8x4_to_pairs<Bf16>(w1, a[kk][1], a[kk][3]);
    }
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 8; ++kk)  // k16 step kk: x tile 2 i + kk / 4, its 32-byte column kk % 4
      wgmma_m64n8k16_ra(acc, a[kk], sw128_desc(xs + (2 * i + (kk >> 2)) * 1024 + (kk & 3) * 32));
    wgmma_commit();
    wgmma_wait_all();
    fence_operands(acc);
    stage = stage + 1 == STAGES ? 0 : stage + 1;
    refill = refill + 1 == STAGES ? 0 : refill + 1;
  }
  if (EP == GEP_SILU) cp_async_wait<0>();
  gemm_finish<8, EP, SCALE_W8A16>(acc, out, nullptr, w_scale, ws, counters,
                                  reinterpret_cast<float*>(gemm_smem + (wbase - raw)), M, N, splits);
}

#endif  // GEMM_SM90

// F8: x and w are E4M3 bytes with their scales (W8A8); else bf16 (x_scale, w_scale unused).
template <int NT, int EP, bool F8>
__device__ __forceinline__ void gemm_impl(void* out, const unsigned char* __restrict__ x,
                                          const float* __restrict__ x_scale, const unsigned char* __restrict__ w,
                                          const float* __restrict__ w_scale, float* __restrict__ ws,
                                          int* __restrict__ counters, int M, int N, int K, int splits) {
#ifdef GEMM_SM90
  constexpr int STAGES = gemm_stages(NT), SB = gemm_stage_bytes(NT), R = NT / 2;
  extern __shared__ unsigned char gemm_smem[];
  const u32 raw = smem_addr(gemm_smem), base = (raw + 1023u) & ~1023u;
  const int tid = threadIdx.x, wg = tid >> 7;
  const int tile = blockIdx.x, split = blockIdx.y;
  const int I = N >> 1;
  const int base0 = EP == GEP_SILU ? tile * 64 : tile * GEMM_ROWS;
  const int base1 = EP == GEP_SILU ? I + tile * 64 : base0 + 64;
  const int lim0 = EP == GEP_SILU ? I : N;
  const int row_bytes = F8 ? K : 2 * K;
  const int KT = (row_bytes + GEMM_ROW_BYTES - 1) / GEMM_ROW_BYTES;
  const int kt0 = (int)((i64)split * KT / splits), nk = (int)((i64)(split + 1) * KT / splits) - kt0;

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;

  // k-tile kt of this split into stage st
  auto load = [&](int st, int kt) {
    gemm_load_stage<NT>(base + st * SB, x, w, base0, base1, lim0, N, M, row_bytes, (kt0 + kt) * GEMM_ROW_BYTES, tid);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nk) load(s, s);
    cp_async_commit();
  }
  int stage = 0, refill = STAGES - 1;  // the stage this iteration consumes, and the one it refills
  for (int i = 0; i < nk; ++i) {
    cp_async_wait<STAGES - 2>();  // this thread's copies of k-tile i landed
    fence_proxy_async();
    __syncthreads();  // everyone's did; and both warpgroups' MMAs of iteration i - 1 completed (waited below)
    if (i + STAGES - 1 < nk) load(refill, i + STAGES - 1);
    cp_async_commit();
    const u32 sa = base + stage * SB + wg * 64 * GEMM_ROW_BYTES, sb = base + stage * SB + GEMM_ROWS * GEMM_ROW_BYTES;
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < GEMM_ROW_BYTES / 32; ++kk)
      Wgmma<NT, F8>::run(acc, sw128_desc(sa + kk * 32), sw128_desc(sb + kk * 32));
    wgmma_commit();
    wgmma_wait_all();
    fence_operands(acc);
    stage = stage + 1 == STAGES ? 0 : stage + 1;
    refill = refill + 1 == STAGES ? 0 : refill + 1;
  }

  if (EP == GEP_SILU) cp_async_wait<0>();  // every stage idle: its first R x 128 floats become the silu exchange
  gemm_finish<NT, EP, F8 ? SCALE_W8A8 : SCALE_NONE>(acc, out, x_scale, w_scale, ws, counters,
                                                    reinterpret_cast<float*>(gemm_smem + (base - raw)), M, N, splits);
#else
  asm volatile("trap;");  // built for another architecture: never launched there (KernelLibrary)
#endif
}

#define GEMM_ENTRY(NAME, EP, NT)                                                                                \
  extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1)                                                 \
      gemm_sm90_##NAME##_bf16_n##NT(void* out, const u16* x, const u16* w, float* ws, int* counters, int M,    \
                                    int N, int K, int splits) {                                                \
    gemm_impl<NT, EP, false>(out, reinterpret_cast<const unsigned char*>(x), nullptr,                          \
                             reinterpret_cast<const unsigned char*>(w), nullptr, ws, counters, M, N, K, splits); \
  }
#define GEMM_ENTRY_W8A8(NAME, EP, NT)                                                                              \
  extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_sm90_##NAME##_w8a8_n##NT(                    \
      void* out, const unsigned char* x, const float* x_scale, const unsigned char* w, const float* w_scale,      \
      float* ws, int* counters, int M, int N, int K, int splits) {                                                \
    gemm_impl<NT, EP, true>(out, x, x_scale, w, w_scale, ws, counters, M, N, K, splits);                          \
  }
#ifdef GEMM_SM90
#define GEMM_W8A16_BODY(EP) gemm_w8a16_impl<EP>(out, x, w, w_scale, ws, counters, M, N, K, splits);
#else
#define GEMM_W8A16_BODY(EP) asm volatile("trap;");
#endif
#define GEMM_ENTRY_W8A16(NAME, EP)                                                                             \
  extern "C" __global__ void __launch_bounds__(GEMM_THREADS, 1) gemm_sm90_##NAME##_w8a16_n8(                   \
      void* out, const u16* x, const unsigned char* w, const float* w_scale, float* ws, int* counters, int M,  \
      int N, int K, int splits) {                                                                              \
    GEMM_W8A16_BODY(EP)                                                                                        \
  }
GEMM_ENTRY_W8A16(store, GEP_STORE)
GEMM_ENTRY_W8A16(f32, GEP_F32)
GEMM_ENTRY_W8A16(residual, GEP_RESIDUAL)
GEMM_ENTRY_W8A16(silu, GEP_SILU)

#define GEMM_ENTRIES(NT)                       \
  GEMM_ENTRY(store, GEP_STORE, NT)             \
  GEMM_ENTRY(f32, GEP_F32, NT)                 \
  GEMM_ENTRY(residual, GEP_RESIDUAL, NT)       \
  GEMM_ENTRY(silu, GEP_SILU, NT)               \
  GEMM_ENTRY_W8A8(store, GEP_STORE, NT)        \
  GEMM_ENTRY_W8A8(residual, GEP_RESIDUAL, NT)  \
  GEMM_ENTRY_W8A8(silu, GEP_SILU, NT)

GEMM_ENTRIES(16)
GEMM_ENTRIES(32)
GEMM_ENTRIES(64)
GEMM_ENTRIES(128)
GEMM_ENTRIES(256)
