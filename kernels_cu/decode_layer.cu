// Op: the second half of a decode layer in one persistent launch, for forwards of M <= 8 tokens:
//
//   phase 0  h += attn @ Wo^T                                  (skinny residual epilogue)
//   phase 1  act = silu(g) * u of norm(h; post_norm) @ Wgu^T   (NORM prologue, silu epilogue)
//   phase 2  h += act @ Wdown^T                                (residual epilogue)
//   phase 3  (optional) the next projection of norm(h; next_norm): the next layer's q/k/v with RoPE and
//            the KV write (rope_kv epilogue), or the logits (f32 epilogue)
//
// with the numerics of skinny_linear.cu's kernels (its header: tensor-core mapping, row pairs, the NORM
// prologue and the epilogues), summed over 16 warps instead of 8. What the one launch buys over five:
//   * The weights do not depend on the activations, so every warp streams its weight chunks through a
//     private ring of DL_STAGES shared-memory stages with cp.async, DL_STAGES - 1 work items ahead of
//     the one it computes, across tile and phase boundaries: while a block waits for the others at a
//     phase boundary, its next phase's first weights are already arriving, and DRAM never idles
//     between the four projections (separately, each launch pays a ramp and a drain of ~2-3 us).
//   * Phases are separated by a grid barrier (every block resident at once: a cooperative launch of
//     one 16-warp block per SM): a monotonic 64-bit arrival counter, release (fence) before the
//     arrival, acquire loads while spinning. The counter is never reset: every launch on it has the same
//     grid, so a launch starts at a multiple of the grid and each barrier waits for the next multiple.
//   * Activations written in this launch (h, act) are read through L2 only (ld.global.cg).
// Work item = (phase, tile of 16 weight rows, group of SK_GROUP chunks of 32 k per warp): warp w takes the
// chunks w, w + 16, ..., group i the chunks w + 16 (4i + u), u < 4; a chunk past K is not loaded and
// its mmas are skipped (warp-uniform). Lane l of warp w keeps its 8 16-byte weight pieces of an item at
// stage + w * 4096 + (j * 32 + l) * 16 (j = 2u: row r0, 2u + 1: row r1): each lane reads back only what
// it copied, so cp.async.wait_group is the only synchronisation of the ring. Tiles of a phase go to
// blocks round robin (tile = blockIdx.x + k * gridDim.x). At the end of a tile the warps' fragments
// meet in shared memory (double-buffered, one __syncthreads a tile) and warp 0 runs the epilogue.
//
// Layouts: as skinny_linear.cu. h [M, hidden] (in/out), attn [M, q_size], Wo [hidden, q_size],
// post_norm [hidden], Wgu [2I, hidden] (gate rows, then up rows), act [M, I] (scratch), Wdown
// [hidden, I]; phase 3: w_next [N_next, hidden], bias_next [N_next] or null, norm_next [hidden];
// next_ep = 1: rope_kv (out_next = q_out [M, H, D], N_next = (H + 2 Hkv) D, cos_sin, rope_index,
// k_cache, v_cache, slot_mapping as skinny_rope_kv), 2: f32 (out_next = logits [M, N_next] fp32),
// 0: no phase 3.
// Launch contract (decode_layer_{bf16,fp16}): cooperative, grid (number of SMs), block (512), dynamic
// shared memory DL_STAGES * 65536 bytes; 1 <= M <= 8; hidden, q_size, I: multiples of 32; every N a
// multiple of 16 (the wrapper checks skinny_fits for each weight); barrier: a u64 used only by this
// kernel's launches, all with the same grid (zero at first).
// Built WITHOUT --use_fast_math (silu's expf and division, rsqrtf).
#include "skinny.cuh"

typedef unsigned char u8;

// 16 bytes global -> shared, cached in L2 only, with a 256-byte L2 prefetch (as ld_weight16).
__device__ __forceinline__ void cp_async16_l2_256(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;\n" ::"r"(smem_addr(smem)), "l"(gmem));
}

#define DL_WARPS 16
#define DL_THREADS (DL_WARPS * 32)
#ifndef DL_STAGES  // experiments build variants with -D (bench_kernels.py --layer --variant)
#define DL_STAGES 3
#endif
#define DL_WARP_STAGE (32 * 2 * SK_GROUP * 16)      // bytes of one warp's item: 4096
#define DL_STAGE_BYTES (DL_WARPS * DL_WARP_STAGE)  // 65536
#define DL_PHASES 4

enum { NEXT_NONE = 0, NEXT_ROPE_KV = 1, NEXT_F32 = 2 };

struct DlPhase {
  const u16* w;
  const u16* x;
  const u16* norm_w;  // null: no NORM prologue
  const u16* bias;
  void* out;
  int N, K, half, ep;
  int tiles, groups;  // N / 16; items per tile: ceil(K / 32 / (16 * SK_GROUP))
};

// The producer's position in this block's sequence of work items (phase, tile, group); phase ==
// nphases: past the end.
struct DlCursor {
  int phase, tile, group;
};

__device__ __forceinline__ void dl_settle(DlCursor& c, const DlPhase* ph, int nphases) {
  while (c.phase < nphases && c.tile >= ph[c.phase].tiles) {
    ++c.phase;
    c.tile = blockIdx.x;
  }
}

__device__ __forceinline__ void dl_advance(DlCursor& c, const DlPhase* ph, int nphases) {
  if (++c.group < ph[c.phase].groups) return;
  c.group = 0;
  c.tile += gridDim.x;
  dl_settle(c, ph, nphases);
}

// The weight rows of lane (g, t) in a tile: pair p = 8 tile + g, rows r0 and r0 + half.
__device__ __forceinline__ int dl_row0(int tile, int g, int half) {
  const int p = tile * 8 + g;
  return (p / half) * 2 * half + p % half;
}

// Issues the cp.async of one work item into `stage` (this warp's part) and commits the group (an empty
// group past the end, so that every item costs one group).
__device__ __forceinline__ void dl_produce(u8* stage, const DlCursor& c, const DlPhase* ph, int nphases, int warp,
                                           int lane) {
  if (c.phase < nphases) {
    const DlPhase& P = ph[c.phase];
    const int g = lane >> 2, t = lane & 3;
    const int r0 = dl_row0(c.tile, g, P.half);
    const u16* wa = P.w + (i64)r0 * P.K + 8 * t;
    const u16* wb = wa + (i64)P.half * P.K;
    const int C = P.K / SK_CHUNK;
    u8* dst = stage + warp * DL_WARP_STAGE + lane * 16;
#pragma unroll
    for (int u = 0; u < SK_GROUP; ++u) {
      const int ch = warp + DL_WARPS * (c.group * SK_GROUP + u);
      if (ch < C) {
        const i64 k = (i64)ch * SK_CHUNK;
        cp_async16_l2_256(dst + (2 * u) * 512, wa + k);
        cp_async16_l2_256(dst + (2 * u + 1) * 512, wb + k);
      }
    }
  }
  cp_async_commit();
}

// Every block arrives, then waits until all have: release before the arrival, acquire while waiting.
__device__ __forceinline__ void dl_grid_barrier(u64* counter) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    const u64 old = atomicAdd((unsigned long long*)counter, 1ull);
    const u64 goal = (old / gridDim.x + 1) * gridDim.x;
    u64 seen;
    do {
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];\n" : "=l"(seen) : "l"(counter) : "memory");
    } while (seen < goal);
  }
  __syncthreads();
}

template <class T>
__device__ __forceinline__ EpOperands<1> dl_operands(const SkinnyArgs& a, int ep, int p, int r0, int r1, int t) {
  switch (ep) {
    case EP_RESIDUAL: return skinny_epilogue_operands<T, 1, EP_RESIDUAL, true>(a, p, r0, r1, t);
    case EP_SILU: return skinny_epilogue_operands<T, 1, EP_SILU, true>(a, p, r0, r1, t);
    case EP_ROPE_KV: return skinny_epilogue_operands<T, 1, EP_ROPE_KV, true>(a, p, r0, r1, t);
    default: return skinny_epilogue_operands<T, 1, EP_F32, true>(a, p, r0, r1, t);
  }
}

template <class T, class InvRms>
__device__ __forceinline__ void dl_store(const SkinnyArgs& a, int ep, const float (&acc)[1][4], const EpOperands<1>& o,
                                         int p, int r0, int r1, int t, bool norm, InvRms inv_rms) {
  switch (ep) {
    case EP_RESIDUAL: skinny_epilogue_store<T, 1, EP_RESIDUAL>(a, acc, o, p, r0, r1, t, norm, inv_rms); break;
    case EP_SILU: skinny_epilogue_store<T, 1, EP_SILU>(a, acc, o, p, r0, r1, t, norm, inv_rms); break;
    case EP_ROPE_KV: skinny_epilogue_store<T, 1, EP_ROPE_KV>(a, acc, o, p, r0, r1, t, norm, inv_rms); break;
    default: skinny_epilogue_store<T, 1, EP_F32>(a, acc, o, p, r0, r1, t, norm, inv_rms); break;
  }
}

// x (token g's 16 bytes of each of the item's chunks) and norm_w of work item group gi.
__device__ __forceinline__ void dl_load_x(Vec16 (&xb)[SK_GROUP], Vec16 (&nw)[SK_GROUP], const u16* xrow,
                                          const u16* nwp, bool has_x, bool norm, int warp, int gi, int C) {
#pragma unroll
  for (int u = 0; u < SK_GROUP; ++u) {
    const int ch = warp + DL_WARPS * (gi * SK_GROUP + u);
    const i64 k = (i64)ch * SK_CHUNK;
    xb[u] = has_x && ch < C ? ld_cg16(xrow + k) : zero16();
    nw[u] = norm && ch < C ? ld_act16(nwp + k) : zero16();
  }
}

template <class T>
__device__ __forceinline__ void decode_layer_impl(
    u16* h, const u16* attn, const u16* w_o, const u16* post_norm, const u16* w_gu, u16* act, const u16* w_down,
    void* out_next, const u16* w_next, const u16* bias_next, const u16* norm_next, const float* cos_sin,
    const i64* rope_index, u16* k_cache, u16* v_cache, const i64* slot_mapping, u64* barrier, int M, int hidden,
    int q_size, int I, int N_next, int H, int Hkv, int D, int next_ep, float eps) {
  extern __shared__ __align__(16) u8 ring[];  // DL_STAGES stages of DL_STAGE_BYTES
  __shared__ float red[2][DL_WARPS - 1][4][32];
  __shared__ float sq_red[2][DL_WARPS][8];
  __shared__ DlPhase ph[DL_PHASES];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int nphases = next_ep == NEXT_NONE ? 3 : 4;
  if (threadIdx.x == 0) {
    ph[0] = DlPhase{w_o, attn, nullptr, nullptr, h, hidden, q_size, hidden / 2, EP_RESIDUAL, 0, 0};
    ph[1] = DlPhase{w_gu, h, post_norm, nullptr, act, 2 * I, hidden, I, EP_SILU, 0, 0};
    ph[2] = DlPhase{w_down, act, nullptr, nullptr, h, hidden, I, hidden / 2, EP_RESIDUAL, 0, 0};
    ph[3] = next_ep == NEXT_ROPE_KV ? DlPhase{w_next, h, norm_next, bias_next, out_next, N_next, hidden, D / 2,
                                              EP_ROPE_KV, 0, 0}
                                    : DlPhase{w_next, h, norm_next, bias_next, out_next, N_next, hidden, N_next / 2,
                                              EP_F32, 0, 0};
    for (int i = 0; i < DL_PHASES; ++i) {
      ph[i].tiles = ph[i].N / 16;
      ph[i].groups = (ph[i].K / SK_CHUNK + DL_WARPS * SK_GROUP - 1) / (DL_WARPS * SK_GROUP);
    }
  }
  __syncthreads();

  // Fill the ring: items 0 .. DL_STAGES - 2 in flight before the first is computed.
  DlCursor prod = {0, (int)blockIdx.x, 0};
  dl_settle(prod, ph, nphases);
  int item = 0;  // items this warp has computed (its stage: item % DL_STAGES)
#pragma unroll
  for (int s = 0; s < DL_STAGES - 1; ++s) {
    dl_produce(ring + s * DL_STAGE_BYTES, prod, ph, nphases, warp, lane);
    if (prod.phase < nphases) dl_advance(prod, ph, nphases);
  }

  int tiles_done = 0;  // tiles this block finished (the red / sq_red buffer: tiles_done & 1)
  for (int pi = 0; pi < nphases; ++pi) {
#ifndef DL_SKIP_BARRIER
    if (pi > 0) dl_grid_barrier(barrier);
#endif
    const DlPhase& P = ph[pi];
    const bool norm = P.norm_w != nullptr;
    const int K = P.K, C = K / SK_CHUNK, groups = P.groups;
    const u16* xrow = P.x + (i64)g * K + 8 * t;  // token g (read only when g < M)
    const u16* nwp = P.norm_w + 8 * t;
    SkinnyArgs a = {};
    a.out = P.out; a.x = P.x; a.w = P.w; a.bias = P.bias; a.norm_w = P.norm_w;
    a.cos_sin = cos_sin; a.rope_index = rope_index; a.k_cache = k_cache; a.v_cache = v_cache;
    a.slot_mapping = slot_mapping;
    a.M = M; a.N = P.N; a.K = K; a.half = P.half; a.H = H; a.Hkv = Hkv; a.D = D; a.eps = eps;
    // x and norm_w one item ahead (L2 latency behind the current item); the first after the barrier.
    Vec16 xn[SK_GROUP], nn[SK_GROUP];
    if ((int)blockIdx.x < P.tiles) dl_load_x(xn, nn, xrow, nwp, g < M, norm, warp, 0, C);
    for (int tile = blockIdx.x; tile < P.tiles; tile += gridDim.x) {
      const int p = tile * 8 + g;
      const int r0 = dl_row0(tile, g, P.half);
      EpOperands<1> eo;
      if (warp == 0) eo = dl_operands<T>(a, P.ep, p, r0, r0 + P.half, t);  // used at the end of the tile
      float chains[2][4] = {{0.f, 0.f, 0.f, 0.f}, {0.f, 0.f, 0.f, 0.f}};
      float ss = 0.f;
      for (int gi = 0; gi < groups; ++gi, ++item) {
        Vec16 xb[SK_GROUP], nw[SK_GROUP];
#pragma unroll
        for (int u = 0; u < SK_GROUP; ++u) {
          xb[u] = xn[u];
          nw[u] = nn[u];
        }
        const bool more = gi + 1 < groups || tile + (int)gridDim.x < P.tiles;  // another item in this phase
        if (more) dl_load_x(xn, nn, xrow, nwp, g < M, norm, warp, gi + 1 < groups ? gi + 1 : 0, C);
        // Keep DL_STAGES items in flight: the next item goes into the stage the previous one used.
        dl_produce(ring + ((item + DL_STAGES - 1) % DL_STAGES) * DL_STAGE_BYTES, prod, ph, nphases, warp, lane);
        if (prod.phase < nphases) dl_advance(prod, ph, nphases);
        cp_async_wait<DL_STAGES - 1>();  // this item's group has landed (for this lane)
        const u8* src = ring + (item % DL_STAGES) * DL_STAGE_BYTES + warp * DL_WARP_STAGE + lane * 16;
#pragma unroll
        for (int u = 0; u < SK_GROUP; ++u) {
          const int ch = warp + DL_WARPS * (gi * SK_GROUP + u);
          if (ch >= C) continue;
          const Vec16 wa = *reinterpret_cast<const Vec16*>(src + (2 * u) * 512);
          const Vec16 wb = *reinterpret_cast<const Vec16*>(src + (2 * u + 1) * 512);
          Vec16 xv = xb[u];
          if (norm) {  // tokens >= M: x = 0, so the operand and the sum stay 0
#pragma unroll
            for (int i = 0; i < 4; ++i) {
              ss = add_squares<T>(ss, xv.w[i]);
              xv.w[i] = Mul2<T>::run(xv.w[i], nw[u].w[i]);
            }
          }
          const u32 a_lo[4] = {wa.w[0], wb.w[0], wa.w[1], wb.w[1]};
          const u32 a_hi[4] = {wa.w[2], wb.w[2], wa.w[3], wb.w[3]};
          Mma<T>::run(chains[u % 2], a_lo, xv.w[0], xv.w[1]);
          Mma<T>::run(chains[u % 2], a_hi, xv.w[2], xv.w[3]);
        }
      }
#ifdef DL_SKIP_EPILOGUE
      if (chains[0][0] == 12345.f) ((float*)P.out)[0] = chains[1][0] + ss;
      continue;
#endif
      // The tile's fragments and sums of squares meet in shared memory; warp 0 runs the epilogue.
      const int buf = tiles_done++ & 1;
      float acc[1][4];
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[0][e] = chains[0][e] + chains[1][e];
      if (warp > 0) {
#pragma unroll
        for (int e = 0; e < 4; ++e) red[buf][warp - 1][e][lane] = acc[0][e];
      }
      if (norm) {
        float v = ss;
        v += __shfl_xor_sync(FULL_MASK, v, 1);
        v += __shfl_xor_sync(FULL_MASK, v, 2);
        if (t == 0) sq_red[buf][warp][g] = v;
      }
      __syncthreads();
      if (warp == 0) {
#pragma unroll
        for (int w = 0; w < DL_WARPS - 1; ++w) {
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[0][e] += red[buf][w][e][lane];
        }
        dl_store<T>(a, P.ep, acc, eo, p, r0, r0 + P.half, t, norm, [&](int m) {
          float sum = 0.f;
#pragma unroll
          for (int w = 0; w < DL_WARPS; ++w) sum += sq_red[buf][w][m];
          return rsqrtf(sum / (float)K + eps);
        });
      }
    }
  }
  cp_async_wait<0>();  // nothing is left in flight (the groups past the end are empty)
}

#define DECODE_LAYER_ENTRY(SUFFIX, T)                                                                               \
  extern "C" __global__ void __launch_bounds__(DL_THREADS, 1) decode_layer_##SUFFIX(                                 \
      u16* h, const u16* attn, const u16* w_o, const u16* post_norm, const u16* w_gu, u16* act, const u16* w_down, \
      void* out_next, const u16* w_next, const u16* bias_next, const u16* norm_next, const float* cos_sin,         \
      const i64* rope_index, u16* k_cache, u16* v_cache, const i64* slot_mapping, u64* barrier, int M, int hidden,  \
      int q_size, int I, int N_next, int H, int Hkv, int D, int next_ep, float eps) {                              \
    decode_layer_impl<T>(h, attn, w_o, post_norm, w_gu, act, w_down, out_next, w_next, bias_next, norm_next,       \
                         cos_sin, rope_index, k_cache, v_cache, slot_mapping, barrier, M, hidden, q_size, I, N_next, \
                         H, Hkv, D, next_ep, eps);                                                                  \
  }

DECODE_LAYER_ENTRY(bf16, Bf16)
DECODE_LAYER_ENTRY(fp16, Fp16)
