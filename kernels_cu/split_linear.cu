// Op: decode linear layers for batches of 9..32 tokens (past the skinny kernels, which re-read x for every
// 16 weight rows): y = x @ W^T with the weight streamed through shared memory once, K split over the
// blocks of a thread-block cluster, and the neighbouring elementwise ops fused in (fp32 accumulation on
// the tensor cores). Reference: TorchOps.linear_add / TorchOps.norm_gate_up.
//
//   prologue NORM (norm_w != null): x is the raw residual stream; the tensor cores get T(norm_w[k] * x[m, k])
//     and the fp32 result is scaled by inv_rms[m] = rsqrt(mean_k(x[m, k]^2) + eps), the mean over all of K
//     (summed over the cluster): kernels_cu/skinny_linear.cu's numerics.
//   value[m, r] = acc[m, r] (* inv_rms[m])
//   epilogues:
//     residual  residual[m, r] = T(residual[m, r] + value[m, r])  (in place, one rounding, as addmm with beta = 1)
//     silu      W = [gate (I rows) | up (I rows)];  out[m, p] = T(T(silu(T(g))) * T(u)),  g = value[m, p],
//               u = value[m, I + p], silu(g) = g / (1 + exp(-g))
//
// Work split: block (rank s, tile i) holds SL_ROWS = 128 weight rows (residual: rows 128 i ..; silu: gate rows
// 64 i .. 64 i + 63 in its rows 0..63 and their up rows I + 64 i .. in rows 64..127) and the K range
// [s K / S, (s + 1) K / S) of its cluster of S blocks (grid x = S, the cluster along x). The 8 warps take 16
// rows each. K streams in steps of SL_BK = 64: each step's W tile [128 x 64] and x tile [32 x 64] (tokens >= M
// zero-filled) go through a ring of SL_STAGES shared-memory stages by cp.async; ldmatrix gives the mma
// fragments (A = 16 W rows, B = x^T, 8 tokens per n-tile, rows padded to 72 elements: conflict-free). After
// the loop each block leaves its partial sums [128 rows x 32 tokens] (fp32) in shared memory; the cluster
// synchronises; block s sums rows [s 128 / S, (s + 1) 128 / S) over the S blocks in rank order through
// distributed shared memory (deterministic), runs the epilogue, and a second cluster barrier keeps the
// partials alive until every block has read them. NORM: warp 0 sums the squares of the raw x it loads as
// mma fragments; the cluster adds the S blocks' sums in rank order.
// Why: at 32 tokens the skinny kernels re-read all of x for every 16 rows (134 MB of L2 reads for the 1B
// gate_up) and cuBLAS leaves the norm, the SiLU and its split-K reduction to separate launches.
//
// Layouts (contiguous; T = bf16 (_bf16) or fp16 (_fp16), storage u16): x [M, K] T; W [N, K] T; norm_w [K] T;
//   residual [M, N] T (in / out); silu: out [M, I] T, N = 2 I.
// Launch contract (split_{residual,silu}_{bf16,fp16}): grid (S, tiles), block (256), clusters of S blocks
//   along x (S = 1: none; S > 1 needs sm_90), dynamic shared memory SL_SMEM = SL_STAGES * 160 * 72 * 2 bytes;
//   residual: tiles = N / 128; silu: tiles = I / 64; 1 <= M <= 32; K % (64 S) == 0; S in {1, 2, 4, 8};
//   x, W, norm_w 16-byte aligned; the output must not overlap x or W.
//   Programmatic dependent launch (the launch attribute; a no-op without it): a block issues its first
//   SL_STAGES - 1 weight tiles, then waits for the kernel before (grid_dependency_wait), then reads x,
//   norm_w and the residual: nothing but W is read before the wait, and nothing written.
// Built WITHOUT --use_fast_math: expf, the division of silu and rsqrtf must be the accurate ones.
#include "common.cuh"

#define SL_ROWS 128
#define SL_TOKENS 32
#define SL_THREADS 256
#define SL_PLD 33  // partial sums row pitch (floats)

enum { SL_RESIDUAL = 0, SL_SILU = 1 };

// cp.async of 16 weight bytes, asking L2 for the whole 256-byte piece around them (the next steps' bytes of the
// same row), as skinny_linear.cu's weight loads do.
__device__ __forceinline__ void cp_async16_w(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}

// BK: K elements per step; STAGES: ring depth; ROT: tile i starts at step i % steps. The smem row is padded by 8
// elements (BK = 64: 144 bytes, 128: 272) so ldmatrix's 8 rows hit 8 distinct 16-byte bank groups.
template <class T, int EP, int SL_BK, int SL_STAGES, bool ROT>
__device__ __forceinline__ void split_linear_impl(u16* __restrict__ out, const u16* __restrict__ x,
                                                  const u16* __restrict__ w, const u16* __restrict__ norm_w, int M,
                                                  int N, int K, int I, float eps) {
  constexpr int SL_LD = SL_BK + 8, CPR = SL_BK / 8;  // padded row; 16-byte chunks per row
  constexpr int WCH = SL_ROWS * CPR / SL_THREADS, XCH = SL_TOKENS * CPR / SL_THREADS;  // chunks per thread
  extern __shared__ Vec16 smem_raw[];
  u16* w_s = reinterpret_cast<u16*>(smem_raw);           // [STAGES][128][LD]
  u16* x_s = w_s + SL_STAGES * SL_ROWS * SL_LD;           // [STAGES][32][LD]
  float* part = reinterpret_cast<float*>(smem_raw);       // [128][PLD], after the main loop (aliases the ring)
  __shared__ float sumsq[SL_TOKENS];
  __shared__ float inv_rms[SL_TOKENS];

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int rank = blockIdx.x, S = gridDim.x, tile = blockIdx.y;
  const int ks = K / S;                 // this block's K range [k_begin, k_begin + ks)
  const int k_begin = rank * ks;
  const int steps = ks / SL_BK;
  const bool norm = norm_w != nullptr;
  // Tile i walks its steps starting at step i % steps (and wraps): blocks that start together read different
  // columns, instead of every block reading the same 128 bytes of its rows (a power-of-two row pitch) at once.
  const int rot = ROT ? tile % steps : 0;
  auto kstep = [&](int step) { return step + rot < steps ? step + rot : step + rot - steps; };

  // This thread's cp.async work per stage: W chunks c = tid + 256 u (row c / CPR, 16-byte column c % CPR), and
  // x chunks the same way.
  const int col = (tid % CPR) << 3;
  const u16* w_src[WCH];
#pragma unroll
  for (int u = 0; u < WCH; ++u) {
    const int r = (tid + SL_THREADS * u) / CPR;
    const int grow = EP == SL_SILU ? (r < 64 ? 64 * tile + r : I + 64 * tile + (r - 64)) : SL_ROWS * tile + r;
    w_src[u] = w + (i64)grow * K + k_begin + col;
  }
  const u16* x_src[XCH];
  bool x_valid[XCH];
#pragma unroll
  for (int u = 0; u < XCH; ++u) {
    const int tok = (tid + SL_THREADS * u) / CPR;
    x_valid[u] = tok < M;
    x_src[u] = x + (i64)(x_valid[u] ? tok : 0) * K + k_begin + col;
  }
  auto load_w = [&](int step, int stage) {
#pragma unroll
    for (int u = 0; u < WCH; ++u) {
      const int r = (tid + SL_THREADS * u) / CPR;
      cp_async16_w(w_s + (stage * SL_ROWS + r) * SL_LD + col, w_src[u] + kstep(step) * SL_BK);
    }
  };
  auto load_x = [&](int step, int stage) {
#pragma unroll
    for (int u = 0; u < XCH; ++u) {
      const int tok = (tid + SL_THREADS * u) / CPR;
      cp_async16(x_s + (stage * SL_TOKENS + tok) * SL_LD + col, x_src[u] + kstep(step) * SL_BK, x_valid[u] ? 16 : 0);
    }
  };

  // Prologue: the first weight tiles before waiting for the kernel before (programmatic dependent launch),
  // then x. Group s holds stage s's x (and group 0 every early W tile), so waiting for group s is enough.
#pragma unroll
  for (int s = 0; s < SL_STAGES - 1; ++s)
    if (s < steps) load_w(s, s);
  wait_then_allow_dependents();
#pragma unroll
  for (int s = 0; s < SL_STAGES - 1; ++s) {
    if (s < steps) load_x(s, s);
    cp_async_commit();
  }

  float acc[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) acc[j][0] = acc[j][1] = acc[j][2] = acc[j][3] = 0.f;
  float ss[4] = {0.f, 0.f, 0.f, 0.f};  // warp 0, NORM: squares of token 8 j + g over this lane's k columns
  const int a_row = 16 * warp + (lane & 15), a_col = (lane >> 4) << 3;        // ldmatrix x4 of A (W rows)
  const int b_tok = (lane & 7) + ((lane >> 4) << 3), b_col = ((lane >> 3) & 1) << 3;  // of B (x rows)
  const u16* nw = norm_w + k_begin + 2 * t;

  for (int it = 0; it < steps; ++it) {
    cp_async_wait<SL_STAGES - 2>();
    __syncthreads();  // stage `it` has landed for every thread, and every warp is done with stage it - 1
    const int nxt = it + SL_STAGES - 1;
    if (nxt < steps) {
      load_w(nxt, nxt % SL_STAGES);
      load_x(nxt, nxt % SL_STAGES);
    }
    cp_async_commit();
    const int stage = it % SL_STAGES;
    const u16* ws = w_s + stage * SL_ROWS * SL_LD;
    const u16* xs = x_s + stage * SL_TOKENS * SL_LD;
#pragma unroll
    for (int kk = 0; kk < SL_BK / 16; ++kk) {
      u32 a[4];
      ldmatrix_x4(a, ws + a_row * SL_LD + kk * 16 + a_col);
      u32 g01 = 0u, g89 = 0u;
      if (norm) {  // norm_w at this lane's k columns 2t, 2t + 1 and 2t + 8, 2t + 9 of the step
        const u16* p = nw + kstep(it) * SL_BK + kk * 16;
        g01 = *reinterpret_cast<const u32*>(p);
        g89 = *reinterpret_cast<const u32*>(p + 8);
      }
#pragma unroll
      for (int jp = 0; jp < 2; ++jp) {
        u32 b[4];  // b[0], b[1]: n-tile 2 jp (tokens 16 jp + g); b[2], b[3]: n-tile 2 jp + 1 (tokens 16 jp + 8 + g)
        ldmatrix_x4(b, xs + (16 * jp + b_tok) * SL_LD + kk * 16 + b_col);
        if (norm) {
          if (warp == 0) {
#pragma unroll
            for (int e = 0; e < 2; ++e) {
              ss[2 * jp] = add_squares<T>(ss[2 * jp], b[e]);
              ss[2 * jp + 1] = add_squares<T>(ss[2 * jp + 1], b[2 + e]);
            }
          }
          b[0] = Mul2<T>::run(b[0], g01);
          b[1] = Mul2<T>::run(b[1], g89);
          b[2] = Mul2<T>::run(b[2], g01);
          b[3] = Mul2<T>::run(b[3], g89);
        }
        Mma<T>::run(acc[2 * jp], a, b[0], b[1]);
        Mma<T>::run(acc[2 * jp + 1], a, b[2], b[3]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();  // every warp is done with the ring: the partial sums take its place

  // Partial sums: acc[j][e] -> (row 16 warp + g (+ 8 for e >= 2), token 8 j + 2 t + (e & 1)).
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e)
      part[(16 * warp + g + (e >> 1) * 8) * SL_PLD + 8 * j + 2 * t + (e & 1)] = acc[j][e];
  }
  if (norm && warp == 0) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      float v = ss[j];
      v += __shfl_xor_sync(FULL_MASK, v, 1);
      v += __shfl_xor_sync(FULL_MASK, v, 2);
      if (t == 0) sumsq[8 * j + g] = v;
    }
  }
#if __CUDA_ARCH__ >= 900
  if (S > 1)
    cluster_sync();
  else
    __syncthreads();
#else
  __syncthreads();  // S == 1 below sm_90 (the launch contract)
#endif

  // The cluster's sums in rank order: local reads when S == 1, distributed shared memory otherwise.
  auto cluster_sum = [&](const float* local) {
#if __CUDA_ARCH__ >= 900
    if (S > 1) {  // the S loads issued together, then added in rank order
      float part_s[8];
#pragma unroll
      for (int s = 0; s < 8; ++s) part_s[s] = s < S ? ld_cluster_f32(cluster_map(local, s)) : 0.f;
      float v = part_s[0];
#pragma unroll
      for (int s = 1; s < 8; ++s) v += part_s[s];  // + 0.f past S: the same value
      return v;
    }
#endif
    return *local;
  };
  if (norm && tid < SL_TOKENS) inv_rms[tid] = rsqrtf(cluster_sum(sumsq + tid) / (float)K + eps);
  __syncthreads();

  // Epilogue over this block's share of the tile: residual rows [rank R, (rank + 1) R), R = 128 / S;
  // silu pairs [rank P, (rank + 1) P), P = 64 / S. Item i -> (token i / R, row i % R): consecutive threads
  // write consecutive columns. Every load an item's store depends on is issued before the stores.
  if (EP == SL_RESIDUAL) {
    const int R = SL_ROWS / S, items = R * M;
    for (int i0 = 0; i0 < items; i0 += 4 * SL_THREADS) {
      float v[4], old[4];
      i64 at[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) {
        const int i = i0 + u * SL_THREADS + tid;
        at[u] = -1;
        if (i >= items) continue;
        const int m = i / R, r = rank * R + i % R;
        v[u] = cluster_sum(part + r * SL_PLD + m);
        if (norm) v[u] *= inv_rms[m];
        at[u] = (i64)m * N + SL_ROWS * tile + r;
        old[u] = T::to_float(out[at[u]]);
      }
#pragma unroll
      for (int u = 0; u < 4; ++u)
        if (at[u] >= 0) out[at[u]] = T::from_float(old[u] + v[u]);
    }
  } else {
    const int P = 64 / S, items = P * M;
    for (int i = tid; i < items; i += SL_THREADS) {
      const int m = i / P, r = rank * P + i % P;
      float vg = cluster_sum(part + r * SL_PLD + m), vu = cluster_sum(part + (64 + r) * SL_PLD + m);
      if (norm) {
        vg *= inv_rms[m];
        vu *= inv_rms[m];
      }
      const float gate = round_to<T>(vg), up = round_to<T>(vu);
      const float act = round_to<T>(gate / (1.0f + expf(-gate)));
      out[(i64)m * I + 64 * tile + r] = T::from_float(act * up);
    }
  }
#if __CUDA_ARCH__ >= 900
  if (S > 1) cluster_sync();  // the other blocks may still read this block's partial sums
#endif
}

#define SPLIT_ENTRIES_V(SUFFIX, T, VSFX, BK, STAGES, ROT)                                                        \
  extern "C" __global__ void __launch_bounds__(SL_THREADS, 2) split_residual_##SUFFIX##VSFX(                       \
      u16* residual, const u16* x, const u16* w, int M, int N, int K) {                                           \
    split_linear_impl<T, SL_RESIDUAL, BK, STAGES, ROT>(residual, x, w, nullptr, M, N, K, 0, 0.f);                 \
  }                                                                                                               \
  extern "C" __global__ void __launch_bounds__(SL_THREADS, 2) split_silu_##SUFFIX##VSFX(                           \
      u16* out, const u16* x, const u16* w, const u16* norm_w, int M, int I, int K, float eps) {                  \
    split_linear_impl<T, SL_SILU, BK, STAGES, ROT>(out, x, w, norm_w, M, 2 * I, K, I, eps);                       \
  }
#define SPLIT_ENTRIES(SUFFIX, T)                      \
  SPLIT_ENTRIES_V(SUFFIX, T, , 64, 4, true)           \
  SPLIT_ENTRIES_V(SUFFIX, T, _x1, 64, 4, false)       \
  SPLIT_ENTRIES_V(SUFFIX, T, _x2, 128, 3, true)       \
  SPLIT_ENTRIES_V(SUFFIX, T, _x3, 64, 6, true)

SPLIT_ENTRIES(bf16, Bf16)
SPLIT_ENTRIES(fp16, Fp16)
