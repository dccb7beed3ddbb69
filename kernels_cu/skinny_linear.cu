// Op: "skinny" linear layers for decode batches (M = 1..32 tokens): y = x @ W^T, read from HBM once,
// with the neighbouring elementwise ops fused in (fp32 accumulation on the tensor cores):
//
//   prologue NORM (norm_w != null): x is the raw residual stream and inv_rms[m] its RMS statistic;
//     the B operand is transformers' LlamaRMSNorm of x:  xb = T(norm_w[k] * T(x[m, k] * inv_rms[m]))
//   value[m, r] = acc[m, r] + bias[r]   (bias optional; fp32)
//   epilogues:
//     store     out[m, r] = T(value)                                                   out [M, N] T
//     f32       out[m, r] = value                                                      out [M, N] fp32
//     silu      W = [gate (I rows) | up (I rows)];  out[m, p] = T(T(silu(T(g))) * T(u))  out [M, I] T
//               with g = value[m, p], u = value[m, I + p], silu(g) = g / (1 + exp(-g))
//     residual  residual[m, r] = T(residual[m, r] + acc[m, r])  (in place, one rounding), and
//               inv_rms_out[m] = rsqrt(mean_r(residual[m, r]^2) + eps) for the next NORM prologue
//     rope_kv   W = [q heads (H*D rows) | k heads (Hkv*D) | v heads (Hkv*D)]; v = T(value); q and k
//               heads rotate-half with cs = cos_sin[rope_index[m]] (rope_cache_write.cu's numerics:
//               products and sums rounded one by one, no FMA); q -> q_out[m, h], k and v ->
//               k_cache / v_cache at slot_mapping[m] (negative: no cache write for that token)
//   rms_stats: inv_rms[m] = rsqrt(mean_k(x[m, k]^2) + eps) (the statistic of the first layer's norm)
// Roundings follow the torch reference (engine/ops/torch_ops.py; F.linear on bf16/fp16 tensors).
//
// Tensor-core mapping (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type",
// .bf16/.f16 A and B; groupID g = lane >> 2, threadID_in_group t = lane & 3):
//   A (16 x 16, row):  a0a1 = (row g, cols 2t, 2t+1)  a2a3 = (row g+8, cols 2t, 2t+1)
//                      a4a5 = (row g, cols 2t+8, 2t+9) a6a7 = (row g+8, cols 2t+8, 2t+9)
//   B (16 x 8, col):   b0b1 = (rows 2t, 2t+1, col g)  b2b3 = (rows 2t+8, 2t+9, col g)
//   C/D (16 x 8 fp32): c0c1 = (row g, cols 2t, 2t+1)   c2c3 = (row g+8, cols 2t, 2t+1)
// A = 16 rows of W, B = x^T (8 tokens per "n-tile"), C[row, token]. A dot product does not depend
// on the order of k, so A and B use the same permutation of the 16 k slots of each mma: the k slot
// owned by thread t maps to a k that depends only on t. Lane (g, t) loads 16 bytes of W row g at
// k0 + 8t .. k0 + 8t + 7 (wa), the same of row g + 8 (wb), and per n-tile j the 16 bytes of token
// 8j + g (xb; zero for tokens >= M). Then, per n-tile, two mmas cover k0 .. k0 + 31:
//   mma 1: A = {wa.w0, wb.w0, wa.w1, wb.w1}, B = {xb.w0, xb.w1}: slots 2t,2t+1 -> k0+8t+{0,1},
//                                                                 slots 2t+8,2t+9 -> k0+8t+{2,3}
//   mma 2: A = {wa.w2, wb.w2, wa.w3, wb.w3}, B = {xb.w2, xb.w3}: the same with k0+8t+{4,5}, {6,7}
// (every register holds its lower-address element in bits 0..15, for A and B alike).
//
// Row pairs: tile i (block i) holds the 8 pairs p = 8i .. 8i+7; fragment row g is pair p's first row
// r0 and row g + 8 its partner r1 (half = S / 2 for a pair span S):
//   r0 = (p / half) * S + p % half,   r1 = r0 + half
// so a lane holds both rows of a pair for the same tokens, and the pairwise epilogues (RoPE
// rotate-half, SiLU gate/up) are register-local. S = N for store / f32 / residual, 2I for silu (pair
// = gate row p, up row I + p), D for rope_kv (pair = (i, i + D/2) of one head).
//
// Block = one tile (16 W rows), 8 warps splitting K: warp w takes the 32-element chunks w, w + 8, ...
// in groups of SK_GROUP = 4 chunks whose loads (8 16-byte W loads per lane, plus x and norm_w) are
// all issued before the group's mmas; a last, predicated group takes the remainder. Chunk u of a
// group accumulates into chain u % CH (CH = 2 for NT <= 2, else 1: the NT n-tiles already give
// independent chains), so the mma dependency chain is short; the chains are added in a fixed order.
// W is read with ld.global.nc.L1::no_allocate (read once: it must not evict x, which every block
// re-reads from L1/L2). The 8 warps' fragments are summed through shared memory in warp order
// (deterministic) and warp 0 runs the epilogue. Output stores are scattered 2- or 4-byte stores.
// Occupancy: __launch_bounds__(256, 2), i.e. <= 128 registers, so two blocks share an SM (one block's
// reduction and epilogue overlap the other's loads; 2 x 32 KiB of W in flight per SM); ptxas spills
// a few bytes in the _m32 variants, mostly outside the main loop.
// The NORM transform uses one packed T multiply for T(w * T(x * inv)) (see norm2): bit-identical,
// and half the instructions of the fp32 form; it runs once per x element per block, so it costs
// NT times more per W element than the mma does (at _m32 it is the largest part of the main loop).
// Tuning knobs to measure (same code): SK_GROUP per NT, the launch bound, and the L2 prefetch size.
//
// residual statistics without float atomics: warp 0 of each block writes its per-token sums of
// squares over its 16 rows to partials[blockIdx.x * M + m], fences, and takes a ticket from
// *counter; the block that draws ticket gridDim.x - 1 fences again, sums the partials (8 warps: warp
// w takes tokens w, w + 8, ..; lane l blocks l, l + 32, .. in order, then a fixed shuffle tree: the
// result does not depend on which block finishes last), writes inv_rms_out and resets *counter to 0.
// Partials are read with ld.relaxed.gpu (L2, never a stale L1 line). The counter serves every launch
// that is ordered after the previous one (one stream, or graph replays of one stream).
//
// Layouts (all contiguous; T = bf16 (…_bf16) or fp16 (…_fp16), storage u16):
//   x [M, K] T; W [N, K] T; bias [N] T; norm_w [K] T; inv_rms [M] fp32.
//   rope_kv: N = (H + 2 Hkv) D; q_out [M, H, D] T; cos_sin [P, D] fp32 (cos of the D/2 frequencies,
//     then their sin); rope_index [M] int64; k_cache / v_cache [num_blocks * block_size, Hkv, D] T
//     (element offset slot * Hkv * D + kh * D + i); slot_mapping [M] int64.
//   residual: residual [M, N] T (in/out); inv_rms_out [M] fp32; partials >= (N / 16) * M fp32
//     scratch; counter: one int32, zero before the launch and zero again after it (caller-owned).
// Launch contract (skinny_{store,f32,silu,residual,rope_kv}_{bf16,fp16}_m{8,16,32}):
//   grid (N / 16), block (256), no dynamic shared memory. The _m<8 NT> variant takes M <= 8 NT
//   (1 <= M; the wrapper picks the smallest). K % 32 == 0; N % 16 == 0; half % 8 == 0 (silu:
//   I % 8 == 0; rope_kv: D % 16 == 0); x, W, norm_w 16-byte aligned; out / residual must not overlap
//   x or W. rms_stats_{bf16,fp16}: grid (M), block (256); K % 8 == 0; x 16-byte aligned.
// Built WITHOUT --use_fast_math: expf, the division of silu and rsqrtf must be the accurate ones.
#include "common.cuh"

#define SK_THREADS 256
#define SK_WARPS 8
#define SK_CHUNK 32  // k elements per warp per step (two mmas)
#define SK_GROUP 4   // chunks per warp whose loads are in flight together (8 W loads per lane)

enum { EP_STORE = 0, EP_F32 = 1, EP_SILU = 2, EP_RESIDUAL = 3, EP_ROPE_KV = 4 };

// Every operand of every epilogue (unused ones null / zero).
struct SkinnyArgs {
  void* out;             // store / silu: T; f32: fp32; residual: the residual (in/out); rope_kv: q_out
  const u16* x;          // [M, K]
  const u16* w;          // [N, K]
  const u16* bias;       // [N] or null
  const u16* norm_w;     // [K] or null (no NORM prologue)
  const float* inv_rms;  // [M] (with norm_w)
  float* inv_rms_out;    // residual: [M]
  float* partials;       // residual: [gridDim.x * M]
  int* counter;          // residual
  const float* cos_sin;  // rope_kv
  const i64* rope_index;
  u16* k_cache;
  u16* v_cache;
  const i64* slot_mapping;
  int M, N, K, half;  // half = S / 2, the distance between the two rows of a pair
  int H, Hkv, D;      // rope_kv
  float eps;          // residual
};

// 16-byte loads. W is streamed once (no L1 allocation, 256-byte L2 prefetch: the 8 warps of a block
// read 8 consecutive 64-byte pieces of each row); x and norm_w are re-read by every block (L1 / L2).
// Both are volatile so that a group's loads are all issued, in order, before its mmas.
__device__ __forceinline__ Vec16 ld_weight16(const u16* p) {
  Vec16 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}
__device__ __forceinline__ Vec16 ld_act16(const u16* p) {
  Vec16 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}
__device__ __forceinline__ Vec16 zero16() {
  Vec16 v = {{0u, 0u, 0u, 0u}};
  return v;
}
// Partials written by other blocks of this launch: a gpu-scope load, served by L2.
__device__ __forceinline__ float ld_relaxed_gpu(const float* p) {
  float v;
  asm volatile("ld.relaxed.gpu.global.f32 %0, [%1];\n" : "=f"(v) : "l"(p) : "memory");
  return v;
}

// Packed multiply of two T pairs, one rounding each (fma with -0: exact sign of zero products).
template <class T>
struct Mul2;
template <>
struct Mul2<Bf16> {
  static __device__ __forceinline__ u32 run(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
  }
};
template <>
struct Mul2<Fp16> {
  static __device__ __forceinline__ u32 run(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
  }
};

// NORM prologue on one register (two elements): T(w * T(x * inv)). The product of two T values is
// exact in fp32 (8- or 11-bit significands), so rounding it to T equals the packed T multiply: the
// same bits as the fp32 formulation at half the instructions (this transform runs once per x
// element per block, NT times per W element).
template <class T>
__device__ __forceinline__ u32 norm2(u32 x, u32 w, float inv) {
  return Mul2<T>::run(T::pack(lo_of<T>(x) * inv, hi_of<T>(x) * inv), w);
}

// Per-lane operand pointers of the main loop.
template <int NT>
struct LaneOperands {
  const u16* wa;      // W row r0, + 8t
  const u16* wb;      // W row r1, + 8t
  const u16* x;       // token g, + 8t; token 8j + g is at x + j * xstride (read only where xv[j])
  i64 xstride;        // 8 K
  bool xv[NT];        // token 8j + g < M
  float inv[NT];      // inv_rms of that token (0 where !xv[j])
  const u16* nw;      // norm_w + 8t
};

// U chunks c, c + 8, ..., c + 8 (U - 1) of this warp. FULL: all < C; else chunks >= C are skipped
// (warp-uniform: c depends on the warp only).
template <class T, int NT, int U, int CH, bool NORM, bool FULL>
__device__ __forceinline__ void skinny_group(float (&acc)[CH][NT][4], const LaneOperands<NT>& L, int c, int C) {
  Vec16 wa[U], wb[U], xb[U][NT], nw[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool on = FULL || c + SK_WARPS * u < C;
    const i64 k = (i64)(c + SK_WARPS * u) * SK_CHUNK;
    wa[u] = on ? ld_weight16(L.wa + k) : zero16();
    wb[u] = on ? ld_weight16(L.wb + k) : zero16();
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool on = FULL || c + SK_WARPS * u < C;
    const i64 k = (i64)(c + SK_WARPS * u) * SK_CHUNK;
#pragma unroll
    for (int j = 0; j < NT; ++j) xb[u][j] = on && L.xv[j] ? ld_act16(L.x + j * L.xstride + k) : zero16();
    if (NORM) nw[u] = on ? ld_act16(L.nw + k) : zero16();
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!FULL && c + SK_WARPS * u >= C) continue;
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      if (NORM) {
        // Tokens >= M: x = 0 and inv = 0, so the operand stays 0.
#pragma unroll
        for (int i = 0; i < 4; ++i) xb[u][j].w[i] = norm2<T>(xb[u][j].w[i], nw[u].w[i], L.inv[j]);
      }
      const u32 a_lo[4] = {wa[u].w[0], wb[u].w[0], wa[u].w[1], wb[u].w[1]};
      const u32 a_hi[4] = {wa[u].w[2], wb[u].w[2], wa[u].w[3], wb[u].w[3]};
      Mma<T>::run(acc[u % CH][j], a_lo, xb[u][j].w[0], xb[u][j].w[1]);
      Mma<T>::run(acc[u % CH][j], a_hi, xb[u][j].w[2], xb[u][j].w[3]);
    }
  }
}

template <class T, int NT, int U, int CH, bool NORM>
__device__ __forceinline__ void skinny_mainloop(float (&acc)[CH][NT][4], const LaneOperands<NT>& L, int warp, int C) {
  int c = warp;
  for (; c + SK_WARPS * (U - 1) < C; c += SK_WARPS * U) skinny_group<T, NT, U, CH, NORM, true>(acc, L, c, C);
  if (c < C) skinny_group<T, NT, U, CH, NORM, false>(acc, L, c, C);
}

// rope_kv epilogue for one token m: v0 / v1 = the rounded values of rows r0 / r1 (pair i of `head`).
template <class T>
__device__ __forceinline__ void rope_kv_store(const SkinnyArgs& a, int m, int head, int i, float v0, float v1) {
  const int D = a.D, half = a.half;
  if (head < a.H + a.Hkv) {
    u16* dst;
    if (head < a.H) {
      dst = (u16*)a.out + ((i64)m * a.H + head) * D;
    } else {
      const i64 slot = a.slot_mapping[m];
      if (slot < 0) return;
      dst = a.k_cache + (slot * a.Hkv + (head - a.H)) * (i64)D;
    }
    const float* cs = a.cos_sin + a.rope_index[m] * (i64)D;
    const float c = cs[i], s = cs[half + i];
    const float o0 = __fsub_rn(__fmul_rn(v0, c), __fmul_rn(v1, s));
    const float o1 = __fadd_rn(__fmul_rn(v1, c), __fmul_rn(v0, s));
    dst[i] = T::from_float(o0);
    dst[half + i] = T::from_float(o1);
  } else {
    const i64 slot = a.slot_mapping[m];
    if (slot < 0) return;
    u16* dst = a.v_cache + (slot * a.Hkv + (head - a.H - a.Hkv)) * (i64)D;
    dst[i] = T::from_float(v0);
    dst[half + i] = T::from_float(v1);
  }
}

template <class T, int NT, int EP>
__device__ __forceinline__ void skinny_impl(const SkinnyArgs& a) {
  constexpr int U = SK_GROUP;
  constexpr int CH = NT == 4 ? 1 : 2;  // independent accumulator chains (chunk u -> chain u % CH)
  __shared__ float red[SK_WARPS - 1][NT * 4][32];  // fragments of warps 1..7
  __shared__ int is_last;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int M = a.M, K = a.K, half = a.half;

  // The pair of this lane's fragment rows g / g + 8.
  const int p = blockIdx.x * 8 + g;
  const int r0 = (p / half) * 2 * half + p % half;
  const int r1 = r0 + half;

  LaneOperands<NT> L;
  L.wa = a.w + (i64)r0 * K + 8 * t;
  L.wb = a.w + (i64)r1 * K + 8 * t;
  L.nw = a.norm_w + 8 * t;
  L.x = a.x + (i64)g * K + 8 * t;
  L.xstride = (i64)8 * K;
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    const int tok = 8 * j + g;
    L.xv[j] = tok < M;
    L.inv[j] = a.norm_w && L.xv[j] ? a.inv_rms[tok] : 0.f;
  }

  float chains[CH][NT][4];
#pragma unroll
  for (int h = 0; h < CH; ++h) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) chains[h][j][e] = 0.f;
    }
  }
  const int C = K / SK_CHUNK;
  if (a.norm_w)
    skinny_mainloop<T, NT, U, CH, true>(chains, L, warp, C);
  else
    skinny_mainloop<T, NT, U, CH, false>(chains, L, warp, C);
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[j][e] = chains[0][j][e];
#pragma unroll
      for (int h = 1; h < CH; ++h) acc[j][e] += chains[h][j][e];
    }
  }

  if (warp > 0) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp - 1][j * 4 + e][lane] = acc[j][e];
    }
  }
  __syncthreads();

  if (warp == 0) {
#pragma unroll
    for (int w = 0; w < SK_WARPS - 1; ++w) {
#pragma unroll
      for (int j = 0; j < NT; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) acc[j][e] += red[w][j * 4 + e][lane];
      }
    }
    float b0 = 0.f, b1 = 0.f;
    if (EP != EP_SILU && EP != EP_RESIDUAL && a.bias) {
      b0 = T::to_float(a.bias[r0]);
      b1 = T::to_float(a.bias[r1]);
    }
    // acc[j][s] -> (row r0, token 8j + 2t + s); acc[j][2 + s] -> (row r1, the same token).
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      float sq[2] = {0.f, 0.f};  // residual: this lane's sums of squares for its two tokens
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const int m = 8 * j + 2 * t + s;
        if (m >= M) continue;
        const float v0 = acc[j][s] + b0, v1 = acc[j][2 + s] + b1;
        if (EP == EP_STORE) {
          u16* out = (u16*)a.out + (i64)m * a.N;
          out[r0] = T::from_float(v0);
          out[r1] = T::from_float(v1);
        } else if (EP == EP_F32) {
          float* out = (float*)a.out + (i64)m * a.N;
          out[r0] = v0;
          out[r1] = v1;
        } else if (EP == EP_SILU) {
          const float gate = round_to<T>(v0), up = round_to<T>(v1);
          const float act = round_to<T>(gate / (1.0f + expf(-gate)));
          ((u16*)a.out)[(i64)m * half + p] = T::from_float(act * up);
        } else if (EP == EP_RESIDUAL) {
          u16* res = (u16*)a.out + (i64)m * a.N;
          const float n0 = round_to<T>(T::to_float(res[r0]) + v0);
          const float n1 = round_to<T>(T::to_float(res[r1]) + v1);
          res[r0] = T::from_float(n0);
          res[r1] = T::from_float(n1);
          sq[s] = n0 * n0 + n1 * n1;
        } else {  // EP_ROPE_KV: all 8 pairs of a tile lie in one head (half % 8 == 0)
          rope_kv_store<T>(a, m, p / half, p % half, round_to<T>(v0), round_to<T>(v1));
        }
      }
      if (EP == EP_RESIDUAL) {
        // Sum over the 8 lanes of equal t (the tile's 16 rows), a fixed shuffle tree.
#pragma unroll
        for (int o = 4; o < 32; o <<= 1) {
          sq[0] += __shfl_xor_sync(FULL_MASK, sq[0], o);
          sq[1] += __shfl_xor_sync(FULL_MASK, sq[1], o);
        }
        const int m = 8 * j + 2 * t;
        if (g == 0 && m < M) a.partials[(i64)blockIdx.x * M + m] = sq[0];
        if (g == 0 && m + 1 < M) a.partials[(i64)blockIdx.x * M + m + 1] = sq[1];
      }
    }
    if (EP == EP_RESIDUAL) {
      __threadfence();  // this lane's partials are visible device-wide before the ticket
      __syncwarp();
      if (lane == 0) {
        __threadfence();
        const unsigned ticket = atomicAdd(a.counter, 1);
        __threadfence();  // acquire: the partials of every block that drew an earlier ticket
        is_last = ticket == gridDim.x - 1;
      }
    }
  }

  if (EP == EP_RESIDUAL) {
    __syncthreads();
    if (!is_last) return;
    __threadfence();
    const int nb = gridDim.x;
    for (int m = warp; m < M; m += SK_WARPS) {
      float s = 0.f;
      for (int b0 = 0; b0 < nb; b0 += 32 * 8) {
        float v[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
          const int b = b0 + 32 * i + lane;
          v[i] = b < nb ? ld_relaxed_gpu(a.partials + (i64)b * M + m) : 0.f;
        }
#pragma unroll
        for (int i = 0; i < 8; ++i) s += v[i];
      }
      s = warp_sum(s);
      if (lane == 0) a.inv_rms_out[m] = rsqrtf(s / (float)a.N + a.eps);
    }
    if (threadIdx.x == 0) *a.counter = 0;  // every block has drawn its ticket
  }
}

template <class T>
__device__ __forceinline__ void rms_stats_impl(float* __restrict__ inv_rms, const u16* __restrict__ x, int K,
                                               float eps) {
  __shared__ float red[SK_WARPS];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const Vec16* row = reinterpret_cast<const Vec16*>(x + (i64)blockIdx.x * K);
  float s = 0.f;
  for (int v = threadIdx.x; v < (K >> 3); v += SK_THREADS) {
    float f[8];
    unpack8<T>(row[v], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) s += f[e] * f[e];
  }
  s = warp_sum(s);
  if (lane == 0) red[warp] = s;
  __syncthreads();
  if (threadIdx.x == 0) {
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < SK_WARPS; ++w) total += red[w];
    inv_rms[blockIdx.x] = rsqrtf(total / (float)K + eps);
  }
}

// ---------------------------------------------------------------------------------------------
// Entry points.

#define SKINNY_ENTRIES(SUFFIX, T, MB, NT)                                                                   \
  extern "C" __global__ void __launch_bounds__(SK_THREADS, 2) skinny_store_##SUFFIX##_m##MB(                  \
      u16* out, const u16* x, const u16* w, const u16* bias, const u16* norm_w, const float* inv_rms, int M, \
      int N, int K) {                                                                                       \
    SkinnyArgs a = {};                                                                                      \
    a.out = out; a.x = x; a.w = w; a.bias = bias; a.norm_w = norm_w; a.inv_rms = inv_rms;                   \
    a.M = M; a.N = N; a.K = K; a.half = N / 2;                                                              \
    skinny_impl<T, NT, EP_STORE>(a);                                                                        \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(SK_THREADS, 2) skinny_f32_##SUFFIX##_m##MB(                    \
      float* out, const u16* x, const u16* w, const u16* bias, const u16* norm_w, const float* inv_rms,     \
      int M, int N, int K) {                                                                                \
    SkinnyArgs a = {};                                                                                      \
    a.out = out; a.x = x; a.w = w; a.bias = bias; a.norm_w = norm_w; a.inv_rms = inv_rms;                   \
    a.M = M; a.N = N; a.K = K; a.half = N / 2;                                                              \
    skinny_impl<T, NT, EP_F32>(a);                                                                          \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(SK_THREADS, 2) skinny_silu_##SUFFIX##_m##MB(                   \
      u16* out, const u16* x, const u16* w, const u16* norm_w, const float* inv_rms, int M, int I, int K) { \
    SkinnyArgs a = {};                                                                                      \
    a.out = out; a.x = x; a.w = w; a.norm_w = norm_w; a.inv_rms = inv_rms;                                  \
    a.M = M; a.N = 2 * I; a.K = K; a.half = I;                                                              \
    skinny_impl<T, NT, EP_SILU>(a);                                                                         \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(SK_THREADS, 2) skinny_residual_##SUFFIX##_m##MB(               \
      u16* residual, const u16* x, const u16* w, float* inv_rms_out, float* partials, int* counter, int M,  \
      int N, int K, float eps) {                                                                            \
    SkinnyArgs a = {};                                                                                      \
    a.out = residual; a.x = x; a.w = w; a.inv_rms_out = inv_rms_out; a.partials = partials;                 \
    a.counter = counter; a.M = M; a.N = N; a.K = K; a.half = N / 2; a.eps = eps;                            \
    skinny_impl<T, NT, EP_RESIDUAL>(a);                                                                     \
  }                                                                                                         \
  extern "C" __global__ void __launch_bounds__(SK_THREADS, 2) skinny_rope_kv_##SUFFIX##_m##MB(                \
      u16* q_out, const u16* x, const u16* w, const u16* bias, const u16* norm_w, const float* inv_rms,     \
      const float* cos_sin, const i64* rope_index, u16* k_cache, u16* v_cache, const i64* slot_mapping,     \
      int M, int H, int Hkv, int D, int K) {                                                                \
    SkinnyArgs a = {};                                                                                      \
    a.out = q_out; a.x = x; a.w = w; a.bias = bias; a.norm_w = norm_w; a.inv_rms = inv_rms;                 \
    a.cos_sin = cos_sin; a.rope_index = rope_index; a.k_cache = k_cache; a.v_cache = v_cache;               \
    a.slot_mapping = slot_mapping; a.M = M; a.N = (H + 2 * Hkv) * D; a.K = K; a.half = D / 2;              \
    a.H = H; a.Hkv = Hkv; a.D = D;                                                                          \
    skinny_impl<T, NT, EP_ROPE_KV>(a);                                                                      \
  }

SKINNY_ENTRIES(bf16, Bf16, 8, 1)
SKINNY_ENTRIES(bf16, Bf16, 16, 2)
SKINNY_ENTRIES(bf16, Bf16, 32, 4)
SKINNY_ENTRIES(fp16, Fp16, 8, 1)
SKINNY_ENTRIES(fp16, Fp16, 16, 2)
SKINNY_ENTRIES(fp16, Fp16, 32, 4)

extern "C" __global__ void __launch_bounds__(SK_THREADS) rms_stats_bf16(float* inv_rms, const u16* x, int K, float eps) {
  rms_stats_impl<Bf16>(inv_rms, x, K, eps);
}
extern "C" __global__ void __launch_bounds__(SK_THREADS) rms_stats_fp16(float* inv_rms, const u16* x, int K, float eps) {
  rms_stats_impl<Fp16>(inv_rms, x, K, eps);
}
