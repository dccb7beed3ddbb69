// nvcc-gencode: 90a
// Op: the linear layers of forwards of 9-256 rows (decode, verify, short prompts) on Hopper's warpgroup MMA (wgmma),
// each with its projection's epilogue fused (sm_90a only: KernelLibrary loads this module on compute capability 9.0).
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
// Roles swapped: W is the MMA's A operand (64 rows a warpgroup) and x its B operand, so the forward's rows are the
// MMA's N side. A block takes NT = 16, 32, 64 or 128 of them, its column tile z (rows [z NT, z NT + NT) of x, the
// rest zeros; Z = ceil(M / NT) column tiles), and reads each of its weight rows once for all of them. At these sizes
// a forward reads the weights near the MMA's ridge point: the bytes in flight, not the MMA, bound it.
//
// A block: 256 threads, two warpgroups, 128 weight rows (store / f32 / residual: rows [128 t, 128 t + 128); silu:
// gate rows [64 t, 64 t + 64) in warpgroup 0 and their up rows [I + 64 t, ...) in warpgroup 1) by its NT columns,
// over the K range of its split: k-tiles [s KT / S, (s + 1) KT / S) of KT = ceil(K bytes / 128). blockIdx.x = t Z + z
// (a weight tile's column tiles run side by side and share its reads in L2), blockIdx.y = s.
// Shared memory: STAGES stages, each the W tile (128 rows x 128 bytes: 64 k of bf16, 128 of E4M3) then the x tile (NT
// rows x 128 bytes), each row's 16-byte chunks XOR-swizzled by (row % 8): the 128-byte swizzle the MMA's shared-memory
// descriptors name (start address, stride of 8 rows = 1024 bytes, swizzle mode 1). Stages are filled by cp.async (every
// thread, 16 bytes a copy; rows past M or N and K past the end are zero-filled), made visible to the MMA's async proxy
// by fence.proxy.async and a barrier, and consumed by four MMAs a warpgroup (m64nNTk16 bf16 or m64nNTk32 E4M3: 32 bytes
// of each row, the descriptor's start advanced by 32 bytes each). Iteration i issues k-tile i's MMAs, then the copies
// of k-tile i + STAGES - 2 into the stage k-tile i - 2 used, then waits for its MMAs of iteration i - 1 (one group
// stays in flight): every warpgroup has waited for k-tile i - 2's MMAs before iteration i's barrier.
// The epilogue goes through shared memory (the idle stages): the sums, an [NT][128] fp32 tile, are read back four
// consecutive weight rows of one forward row a thread, so the output's loads and stores are 8- and 16-byte vectors
// that a warp's lanes issue side by side, all of a thread's loads before its stores.
// Split K (S > 1): each block stores its tile's rows below M to ws (coalesced), and the last block of its tile to
// arrive (counters[t Z + z], reset by that block) adds every split's sums in split order, so the result does not
// depend on which block finishes last, and applies the epilogue.
//
// Launch contract (gemm_sm90_{store,f32,residual,silu}_bf16_n{16,32,64,128};
// gemm_sm90_{store,residual,silu}_w8a8_n{16,32,64,128} with x_scale [M] after x and w_scale [N] after w):
//   grid (tiles Z, S), block 256, dynamic shared memory gemm_smem_bytes(NT) (engine/cuda/wrappers/gemm_sm90.py);
//   tiles = ceil(N / 128) (silu: ceil(I / 64)); Z = ceil(M / NT); 1 <= S <= KT; K % 8 == 0 (E4M3: % 16); x, W and
//   out 16-byte aligned, x and out contiguous rows; ws holds tiles Z S NT 128 floats when S > 1, and counters[0 ..
//   tiles Z) are zero (every launch leaves them so). Launches that share ws and counters must be ordered (one stream).
//   Programmatic dependent launch (engine/cuda/library.py PDL_PREFIXES): before its grid_dependency_wait a block reads
//   only W (its first STAGES - 2 k-tiles); x, x_scale, w_scale, out, ws and counters after it.
// Built WITHOUT --use_fast_math: silu's expf and division must be the accurate ones.
#include "common.cuh"

#define GEMM_THREADS 256
#define GEMM_ROWS 128  // weight rows a block
#define GEMM_ROW_BYTES 128  // of each operand row a stage: one 128-byte swizzle row (64 k of bf16, 128 of E4M3)
#define GEMM_LD 132  // floats a row of the epilogue's [NT][128] tile (padded: its column writes spread over the banks)

enum { GEP_STORE = 0, GEP_F32 = 1, GEP_RESIDUAL = 2, GEP_SILU = 3 };

// Bytes of one stage; stages (at most 8, within 192 KiB; at least 3: two filling while the MMAs read one); dynamic
// shared memory of a launch (+1 KiB: the stages start at the first 1024-byte boundary, the swizzle's period).
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

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory"); }
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
__device__ __forceinline__ void st_cg4(float* p, float4 v) {
  asm volatile("st.global.cg.v4.f32 [%0], {%1, %2, %3, %4};\n" ::"l"(p), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w));
}
__device__ __forceinline__ float4 operator+(float4 a, float4 b) {
  return make_float4(a.x + b.x, a.y + b.y, a.z + b.z, a.w + b.w);
}

// W rows [base0, base0 + 64) (< lim0) then [base1, base1 + 64) (< lim1) into the W tile of the stage at sa, bytes
// [b0, b0 + 128) of each row (< row_bytes, the rest zeros), swizzled.
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
// x rows [0, NT) (< M) into the x tile of the stage at sa, bytes [b0, b0 + 128) of each row (< row_bytes, the rest
// zeros), swizzled.
template <int NT>
__device__ __forceinline__ void gemm_load_x(u32 sa, const unsigned char* __restrict__ x, int M, int row_bytes, int b0,
                                            int tid) {
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
// One stage: its W tile, then its x tile.
template <int NT>
__device__ __forceinline__ void gemm_load_stage(u32 sa, const unsigned char* __restrict__ x,
                                                const unsigned char* __restrict__ w, int base0, int base1, int lim0,
                                                int lim1, int M, int row_bytes, int b0, int tid) {
  gemm_load_w(sa, w, base0, base1, lim0, lim1, row_bytes, b0, tid);
  gemm_load_x<NT>(sa, x, M, row_bytes, b0, tid);
}

// acc -> T, the block's [NT][128] fp32 tile in shared memory (its rows below Mz); with split K, each block's rows to
// ws and the tile's last block to arrive adds every split's (in split order) into T. Returns whether this block
// applies the epilogue (false: another split's block will). Every thread of the block calls it (barriers).
template <int NT>
__device__ __forceinline__ bool gemm_reduce(float (&acc)[NT / 2], float* T, float* __restrict__ ws,
                                            int* __restrict__ counters, int Mz, int splits) {
  constexpr int R = NT / 2, IT = NT / 8;  // IT: 4-float items a thread of the NT x 128 tile
  __shared__ int s_last;
  const int tid = threadIdx.x, lane = tid & 31;
  const int c0 = (tid >> 7) * 64 + ((tid >> 5) & 3) * 16 + (lane >> 2), m0 = (lane & 3) * 2;
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int c = c0 + ((r >> 1) & 1) * 8, m = (r >> 2) * 8 + m0 + (r & 1);
    if (m < Mz) T[m * GEMM_LD + c] = acc[r];
  }
  __syncthreads();
  if (splits == 1) return true;
  const int blk = blockIdx.x, split = blockIdx.y;
  auto at = [&](int q) { return reinterpret_cast<float4*>(T + (q >> 5) * GEMM_LD + (q & 31) * 4); };
  float* part = ws + (i64)(blk * splits + split) * NT * 128;
  for (int q = tid; q < Mz * 32; q += GEMM_THREADS) st_cg4(part + q * 4, *at(q));
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(counters + blk, 1) == splits - 1;
  __syncthreads();
  if (!s_last) return false;
  __threadfence();
  // In split order, whichever block came last. U splits' loads a round (U IT = 16 float4 a thread in flight): each
  // round costs one trip through L2, not each split.
  constexpr int U = IT >= 16 ? 1 : 16 / IT;
  float4 s[IT];
#pragma unroll
  for (int j = 0; j < IT; ++j) s[j] = make_float4(0.f, 0.f, 0.f, 0.f);
  for (int o0 = 0; o0 < splits; o0 += U) {
    float4 v[U][IT];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const float* p = ws + (i64)(blk * splits + o0 + u) * NT * 128;
#pragma unroll
      for (int j = 0; j < IT; ++j) {
        const int q = tid + j * GEMM_THREADS;
        v[u][j] = o0 + u >= splits || (q >> 5) >= Mz ? make_float4(0.f, 0.f, 0.f, 0.f)
                  : o0 + u == split                  ? *at(q)
                                                     : __ldcg(reinterpret_cast<const float4*>(p + q * 4));
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u)
      if (o0 + u < splits) {
#pragma unroll
        for (int j = 0; j < IT; ++j) s[j] = s[j] + v[u][j];
      }
  }
#pragma unroll
  for (int j = 0; j < IT; ++j) {  // each item back where only its own thread reads it (barrier below)
    const int q = tid + j * GEMM_THREADS;
    if ((q >> 5) < Mz) *at(q) = s[j];
  }
  if (tid == 0) counters[blk] = 0;
  __syncthreads();
  return true;
}

// The epilogue from T: a thread's items are four consecutive columns (weight rows) of one forward row (silu: four
// gate columns and their up columns), scaled (SCALE_W8A8: (y * x_scale[m]) * w_scale[n] rounded to bf16, the W8A8
// GEMM's output), every load of the output (residual) issued before any store. Rows row0 + m of out, m < Mz.
enum { SCALE_NONE = 0, SCALE_W8A8 = 1 };
template <int NT, int EP, int SCALE>
__device__ __forceinline__ void gemm_epilogue(const float* T, void* out, const float* __restrict__ x_scale,
                                              const float* __restrict__ w_scale, int Mz, int row0, int N, int tile) {
  const int tid = threadIdx.x;
  u16* o16 = reinterpret_cast<u16*>(out);
  if (EP == GEP_SILU) {
    constexpr int IS = NT / 16;  // items of the tile's 64 output columns
    const int I = N >> 1;
    const bool vec = (I & 3) == 0;  // then p < I puts all four columns below I, 8-byte aligned
#pragma unroll
    for (int j = 0; j < IS; ++j) {
      const int q = tid + j * GEMM_THREADS, m = q >> 4, c = (q & 15) * 4, p = tile * 64 + c;
      if (m >= Mz || p >= I) continue;
      const float4 g4 = *reinterpret_cast<const float4*>(T + m * GEMM_LD + c);
      const float4 u4 = *reinterpret_cast<const float4*>(T + m * GEMM_LD + 64 + c);
      const float gs[4] = {g4.x, g4.y, g4.z, g4.w}, us[4] = {u4.x, u4.y, u4.z, u4.w};
      float r[4];
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        float g = gs[e], u = us[e];
        if (SCALE == SCALE_W8A8 && p + e < I) {
          g = g * x_scale[m] * w_scale[p + e];
          u = u * x_scale[m] * w_scale[I + p + e];
        }
        g = round_to<Bf16>(g);
        u = round_to<Bf16>(u);
        r[e] = round_to<Bf16>(g / (1.0f + expf(-g))) * u;
      }
      const i64 idx = (i64)(row0 + m) * I + p;
      if (vec) {
        *reinterpret_cast<uint2*>(o16 + idx) = make_uint2(Bf16::pack(r[0], r[1]), Bf16::pack(r[2], r[3]));
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (p + e < I) o16[idx + e] = Bf16::from_float(r[e]);
      }
    }
    return;
  }
  constexpr int IT = NT / 8;
  const bool vec = (N & 3) == 0;  // then n < N puts all four columns below N, 8- (bf16) or 16-byte (fp32) aligned
  float h[IT][4];  // residual: the output's values, all loaded first
  if (EP == GEP_RESIDUAL) {
#pragma unroll
    for (int j = 0; j < IT; ++j) {
      const int q = tid + j * GEMM_THREADS, m = q >> 5, n = tile * GEMM_ROWS + (q & 31) * 4;
      const i64 idx = (i64)(row0 + m) * N + n;
      if (m < Mz && n < N && vec) {
        const uint2 v = *reinterpret_cast<const uint2*>(o16 + idx);
        h[j][0] = lo_of<Bf16>(v.x), h[j][1] = hi_of<Bf16>(v.x), h[j][2] = lo_of<Bf16>(v.y), h[j][3] = hi_of<Bf16>(v.y);
      } else if (m < Mz && n < N) {
#pragma unroll
        for (int e = 0; e < 4; ++e) h[j][e] = n + e < N ? Bf16::to_float(o16[idx + e]) : 0.f;
      }
    }
  }
#pragma unroll
  for (int j = 0; j < IT; ++j) {
    const int q = tid + j * GEMM_THREADS, m = q >> 5, c = (q & 31) * 4, n = tile * GEMM_ROWS + c;
    if (m >= Mz || n >= N) continue;
    const float4 y4 = *reinterpret_cast<const float4*>(T + m * GEMM_LD + c);
    float y[4] = {y4.x, y4.y, y4.z, y4.w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      if (SCALE == SCALE_W8A8) y[e] = round_to<Bf16>(y[e] * x_scale[m] * (n + e < N ? w_scale[n + e] : 0.f));
      if (EP == GEP_RESIDUAL) y[e] = h[j][e] + y[e];
    }
    const i64 idx = (i64)(row0 + m) * N + n;
    if (EP == GEP_F32) {
      float* of = reinterpret_cast<float*>(out) + idx;
      if (vec) {
        *reinterpret_cast<float4*>(of) = make_float4(y[0], y[1], y[2], y[3]);
      } else {
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (n + e < N) of[e] = y[e];
      }
    } else if (vec) {
      *reinterpret_cast<uint2*>(o16 + idx) = make_uint2(Bf16::pack(y[0], y[1]), Bf16::pack(y[2], y[3]));
    } else {
#pragma unroll
      for (int e = 0; e < 4; ++e)
        if (n + e < N) o16[idx + e] = Bf16::from_float(y[e]);
    }
  }
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
  static_assert(STAGES >= 3, "two stages filling while the MMAs read a third");
  static_assert(NT * GEMM_LD * 4 <= STAGES * SB, "the epilogue's tile fits in the stages");
  extern __shared__ unsigned char gemm_smem[];
  const u32 raw = smem_addr(gemm_smem), base = (raw + 1023u) & ~1023u;
  const int tid = threadIdx.x, wg = tid >> 7;
  const int Z = (M + NT - 1) / NT, tile = blockIdx.x / Z, z = blockIdx.x - tile * Z, split = blockIdx.y;
  const int row0 = z * NT, Mz = min(NT, M - row0);
  const int I = N >> 1;
  const int base0 = EP == GEP_SILU ? tile * 64 : tile * GEMM_ROWS;
  const int base1 = EP == GEP_SILU ? I + tile * 64 : base0 + 64;
  const int lim0 = EP == GEP_SILU ? I : N;
  const int row_bytes = F8 ? K : 2 * K;
  const unsigned char* xz = x + (i64)row0 * row_bytes;
  const int KT = (row_bytes + GEMM_ROW_BYTES - 1) / GEMM_ROW_BYTES;
  const int kt0 = (int)((i64)split * KT / splits), nk = (int)((i64)(split + 1) * KT / splits) - kt0;

  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;

  // k-tile kt of this split into stage st
  auto load = [&](int st, int kt) {
    gemm_load_stage<NT>(base + st * SB, xz, w, base0, base1, lim0, N, Mz, row_bytes, (kt0 + kt) * GEMM_ROW_BYTES, tid);
  };
  // Under programmatic dependent launch the prologue's weight copies start before the previous kernel ends; x, out,
  // ws and counters are touched only after the wait.
#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s)
    if (s < nk) gemm_load_w(base + s * SB, w, base0, base1, lim0, N, row_bytes, (kt0 + s) * GEMM_ROW_BYTES, tid);
  grid_dependency_wait();
  allow_dependents();
#pragma unroll
  for (int s = 0; s < STAGES - 2; ++s) {  // group s: k-tile s's x (group 0 also every prologue weight copy)
    if (s < nk) gemm_load_x<NT>(base + s * SB, xz, Mz, row_bytes, (kt0 + s) * GEMM_ROW_BYTES, tid);
    cp_async_commit();
  }
  int stage = 0, refill = STAGES - 2;  // the stage this iteration's MMAs read, and the one it refills
  for (int i = 0; i < nk; ++i) {
    cp_async_wait<STAGES - 3>();  // this thread's copies of k-tile i landed
    fence_proxy_async();
    __syncthreads();  // everyone's did; and every warpgroup waited for its MMAs of k-tile i - 2 (below)
    const u32 sa = base + stage * SB + wg * 64 * GEMM_ROW_BYTES, sb = base + stage * SB + GEMM_ROWS * GEMM_ROW_BYTES;
    fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < GEMM_ROW_BYTES / 32; ++kk)
      Wgmma<NT, F8>::run(acc, sw128_desc(sa + kk * 32), sw128_desc(sb + kk * 32));
    wgmma_commit();
    if (i + STAGES - 2 < nk) load(refill, i + STAGES - 2);  // into k-tile i - 2's stage
    cp_async_commit();
    wgmma_wait<1>();  // k-tile i - 1's MMAs done; k-tile i's stay in flight
    fence_operands(acc);
    stage = stage + 1 == STAGES ? 0 : stage + 1;
    refill = refill + 1 == STAGES ? 0 : refill + 1;
  }
  wgmma_wait<0>();
  fence_operands(acc);
  cp_async_wait<0>();
  fence_proxy_async();
  __syncthreads();  // every MMA and copy done: the stages become the epilogue's tile
  float* T = reinterpret_cast<float*>(gemm_smem + (base - raw));
  if (!gemm_reduce<NT>(acc, T, ws, counters, Mz, splits)) return;
  gemm_epilogue<NT, EP, F8 ? SCALE_W8A8 : SCALE_NONE>(T, out, F8 ? x_scale + row0 : nullptr, w_scale, Mz, row0, N,
                                                      tile);
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
