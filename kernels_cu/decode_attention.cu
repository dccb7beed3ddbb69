// nvcc-flags: --use_fast_math
// Op: paged decode attention (one query token per sequence), GQA, split-K (flash-decoding), with an
// optional sliding window. Reference: TorchOps.decode_attention.
//
//   keys of sequence b: positions [start, seq_len), start = max(0, seq_len - window) if window else 0
//   (a key is masked when pos <= q_pos - window, q_pos = seq_len - 1)
//   out[b, h] = softmax(scale * q[b, h] . K[b, :, h / G]) @ V[b, :, h / G]          G = H / Hkv
//
// Layouts:
//   q [B, H, D] (heads contiguous, batch stride q_stride elements);  out [B, H, D] contiguous.
//   k_cache / v_cache [num_blocks, block_size, Hkv, D];  block_tables [B, bt_stride] int32;
//   seq_lens [B] int32 (read on the device only).
//   part_o [B, H, num_splits, D] fp32 and part_lse [B, H, num_splits] fp32 (log2 units): per-split
//   partial results, used when num_splits > 1.  counters [B * Hkv * head_chunks] int32, zero before
//   the launch and zero again after it.
//
// Merging the splits: when more than one split has keys, each such block writes its partial result,
// fences, and takes a ticket from its (b, head group)'s counter; the block that draws the last ticket
// merges the group's splits (out = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M) over the non-empty splits, the
// partials read through L2) and resets the counter. No second launch; the merge order is fixed
// (by split index), so results do not depend on which block finishes last.
// In clusters (sm_90, launched with clusters of `cluster` blocks along x): when every split with keys
// lies in the first cluster of its (b, head group) (used <= cluster), the splits merge there instead:
// each block leaves its partial in its own shared memory, the cluster synchronises, the leader (split
// 0) reads the others' partials through distributed shared memory and writes out (the same sum, in
// split order), and a second cluster barrier keeps the partials alive until it has read them. The
// partials' round trip through L2, the fence and the ticket go away (bench/RESULTS.md). A block of
// that cluster with no keys takes part in both barriers; longer sequences merge through global memory.
//
// Work split: block (split s, KV head hkv x head chunk c, batch b) handles the query heads
// [hkv * G + 16 c, +16) of the group (the 16 rows of one tensor-core tile; G > 16 takes several chunks)
// over the key range of split s. The range is computed ON THE DEVICE from seq_lens: the window's keys
// are cut into at most num_splits chunks of a multiple of 64 tokens; blocks of splits past the last
// chunk exit at once (chunks of >= 256 keys measured slower at batch 1). The grid depends only on host-known
// sizes,
// so the launch can be captured in a CUDA graph and replayed while seq_lens grow.
// Inside a block: 4 warps; 64-token tiles of K and V stream through shared memory with cp.async
// (STAGES deep); warp w scores tokens [16 w, 16 w + 16) of each tile with mma.m16n8k16 (fp32
// accumulation), keeps its own online softmax, and the 4 warps merge at the end.
//
//
// E4M3 tiles (FP8 KV cache): the tiles stream through shared memory as the cache holds them, one byte per
// value (16-byte cp.async: 16 values per copy, half the bytes of a 16-bit row), STAGES8 = 2 STAGES - 1 deep
// for the default entries' STAGES (3 at D >= 128, else 5: the bytes in flight per block of their 16-bit tiles), rows of LD8 bytes (D + 16 where D / 16 is even, else D:
// every fragment load below is free of bank conflicts). No 16-bit copy of a tile is made: each lane loads the
// bytes of its own mma fragments as 32-bit words and converts them to T in registers (common.cuh fp8_pair:
// exact), fp32 accumulation as before. The fragment orders (mma.m16n8k16 with groupID g = lane >> 2, t = lane & 3:
// B "col" b0b1 = (k rows 2t, 2t+1; col g), b2b3 = (k rows 2t+8, 2t+9; col g)) use permutations the results do
// not depend on (a dot product is the same sum in any order; the output columns are put back in the merge):
//   S = q K^T, per 16 head dims ks: lane (g, t) loads the word at byte 16 ks + 4t of key row g (and g + 8); its
//     bytes 0 / 2 are the k slots 2t, 2t + 1 (b0b1) and bytes 1 / 3 the slots 2t + 8, 2t + 9 (b2b3), so q's A
//     fragments take q[16 ks + 4t + {0, 2}] and q[16 ks + 4t + {1, 3}] (two byte permutes of a 64-bit load).
//   O += P V, per 32 head dims (n-tiles 4m .. 4m + 3): lane (g, t) loads the word at byte 32 m + 4g of key rows
//     2t, 2t + 1, 2t + 8, 2t + 9 (its P columns); byte i of those words is output column (n-tile 4m + i, col g), i.e.
//     head dim 32 m + 4 c + i is accumulated as (n-tile 4m + i, col c). D % 32 == 16 (D = 16, 80): the last 16 head
//     dims as 2 n-tiles from 16-bit words at byte D - 16 + 2g (head dim D - 16 + 2 c + i as (n-tile, col c)).
// The fused RoPE's new token: its unrotated k and its v (T) land in a staging row of shared memory instead of the
// tile, are rotated there, and converted into the tile row and the cache (head chunk 0) before that tile is read.
// The merge of the 4 warps, of the splits and of the cluster is the 16-bit kernel's (fp32 in shared memory).
//
// Launch contract (decode_attention_{,rope_}{bf16,fp16}_d{16,32,64,80,96,128}[_kvfp8],
// decode_attention_{bf16,fp16}_d{16,32,64,80,96}_s2):
//   grid (num_splits, Hkv * head_chunks, B), head_chunks = ceil(G / 16); block (128);
//   dynamic shared memory = (16 + 2 * STAGES * 64) * (D + 8) * 2 bytes (the q tile, STAGES K and V tiles),
//   plus D * 4 (one cos / sin row in fp32) for the fused-RoPE entries, STAGES = 2 if D >= 128 else 3 (the _s2
//   entries: 2);
//   _kvfp8: 16 * (D + 8) * 2 + 2 * STAGES8 * 64 * LD8 bytes, plus 2 * D * 2 + D * 4 (the new token's k and v
//   rows, and cos / sin) for the fused-RoPE entries
//   (engine/cuda/wrappers/decode_attention.py computes the same; the library raises the function's limit at
//   load). A deeper pipeline (6 stages at D = 64) was faster with the keys in L2 and slower from DRAM:
//   dropped.
//   block_size a power of two (bs_log2 = log2(block_size)); scale_log2 = scale * log2(e);
//   q, caches 16-byte aligned; a sequence whose keys fit one chunk is written to out directly (part_*
//   and counters untouched). cluster: the launch's cluster size along x (1: none; ignored below sm_90),
//   dividing num_splits.
//   Fused RoPE (the decode_attention_rope_* entries, cos_sin non-null; the others ignore k_new, v_new,
//   cos_sin, rope_index and slot_mapping, and need no cos / sin row of shared memory): q is unrotated;
//   k_new / v_new [B, Hkv, D] (contiguous heads, batch stride kv_stride) hold the new token's unrotated
//   k and its v; cos_sin [P, D] fp32, rope_index and slot_mapping [B] int64 as in rope_cache_write.cu.
//   Each block copies the position's cos / sin row to shared memory with its first tile and rotates its q
//   rows there; the block whose keys end at the new token (position seq_len - 1) copies the unrotated k and
//   the v into that tile row (cp.async, like the rest of the tile), rotates the k row in place when the
//   tile has landed, and its head chunk 0 writes both rows to the cache at slot_mapping[b] (negative: no
//   write, and the row is read from the cache as usual).
//   Results equal rope_cache_write followed by this kernel bit for bit.
//   FP8 KV cache (the _kvfp8 entries: k_cache / v_cache hold E4M3 bytes, engine/quant.py fp8_kv): see "E4M3
//   tiles" below; the fused RoPE writes fp8(rotated k) and fp8(v) (rope_cache_write_*_kvfp8's bits).
//   Programmatic dependent launch (the launch attribute; a no-op without it): fresh < 0 reads nothing
//   before griddepcontrol.wait. fresh >= 0 promises that the kernel just before wrote none of seq_lens,
//   block_tables, rope_index, slot_mapping and no cache row of a position < seq_len - fresh (a decode or
//   verify forward of M tokens after its QKV kernel: fresh = M); the block then reads those and starts its
//   first tiles' older rows before the wait, and q and the rest after it.
#include "common.cuh"

#define DA_THREADS 128
#define DA_TILE 64
#define DA_CLUSTER_MAX 8  // the largest cluster a launch uses (DECODE_CLUSTER in the wrapper)

// STAGES_: the 16-bit tiles' pipeline depth, 3 (2 at D >= 128) by default; the _s2 entries take 2 at D < 128 too,
// for grids of more than one wave: 64 fewer rows of K and V a block lets an SM hold more blocks (D = 64: 5 instead
// of 3), which shortens a grid of many short splits, while one wave of long splits runs faster 3 deep.
template <int D, int STAGES_ = (D >= 128 ? 2 : 3)>
struct DecodeCfg {
  static constexpr int STAGES = STAGES_;
  static constexpr int LD = D + 8;  // padded smem row (u16): conflict-free ldmatrix
  static constexpr int VPR = D / 8;  // 16-byte vectors per row
  // E4M3 tiles (the _kvfp8 entries): stages, bytes per smem row, 16-byte vectors per row.
  static constexpr int STAGES8 = D >= 128 ? 3 : 5;
  static constexpr int LD8 = D % 32 ? D : D + 16;
  static constexpr int VPR8 = D / 16;
};

// acc[0..7] += w * (lo, hi): one split's 8 partial outputs into a merge, in a fixed order.
__device__ __forceinline__ void add_weighted(float (&acc)[8], const float4& lo, const float4& hi, float w) {
  acc[0] += lo.x * w;
  acc[1] += lo.y * w;
  acc[2] += lo.z * w;
  acc[3] += lo.w * w;
  acc[4] += hi.x * w;
  acc[5] += hi.y * w;
  acc[6] += hi.z * w;
  acc[7] += hi.w * w;
}

// Merges the splits of one (b, h) row with one warp, with every load independent of the others (the merge of
// a long sequence's 32-48 splits was a chain of dependent L2 round trips): a pass takes 32 splits; lane i reads
// split i's lse and holds its weight 2^(lse - M); then the lanes form 32 / (D / 8) groups, group g summing splits
// g, g + groups, ... of the pass for its 8-element vectors, MERGE_UNROLL of them loaded before any is added, the
// weights taken from their lanes by shuffles; the groups are added with shuffles at the end. Partials are read
// with ld.global.cg (L2): other blocks wrote them during this launch.
#define MERGE_UNROLL 4
template <class T>
__device__ __forceinline__ void combine_row(u16* __restrict__ out, const float* __restrict__ part_o,
                                            const float* __restrict__ part_lse, i64 row, int num_splits, int used,
                                            int D, int lane) {
  const int vpr = D >> 3;  // <= 32 (D <= 256)
  const int groups = 32 / vpr;
  const int grp = lane / vpr, c = lane - grp * vpr;
  const float* lse = part_lse + row * num_splits;
  float M = NEG_INF;
  for (int s = lane; s < used; s += 32) M = fmaxf(M, __ldcg(lse + s));
  M = warp_max(M);
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  float L = 0.f;  // this lane's splits' weights (summed over the warp below)
  if (M != NEG_INF) {  // warp-uniform
    for (int base = 0; base < used; base += 32) {
      const float ls = base + lane < used ? __ldcg(lse + base + lane) : NEG_INF;
      const float w_lane = ls == NEG_INF ? 0.f : exp2f(ls - M);
      L += w_lane;
      const int n = min(32, used - base);
      for (int k0 = 0; k0 < n; k0 += groups * MERGE_UNROLL) {  // uniform trip count (the shuffles)
        float4 lo[MERGE_UNROLL], hi[MERGE_UNROLL];
        float w[MERGE_UNROLL];
#pragma unroll
        for (int u = 0; u < MERGE_UNROLL; ++u) {
          const int k = k0 + u * groups + grp;
          w[u] = __shfl_sync(FULL_MASK, w_lane, k & 31);
          if (grp < groups && k < n && w[u] != 0.f) {  // lanes past the last full group idle
            const float4* src = reinterpret_cast<const float4*>(part_o + (row * num_splits + base + k) * D + c * 8);
            lo[u] = __ldcg(src);
            hi[u] = __ldcg(src + 1);
          } else {
            w[u] = 0.f;
            lo[u] = hi[u] = make_float4(0.f, 0.f, 0.f, 0.f);
          }
        }
#pragma unroll
        for (int u = 0; u < MERGE_UNROLL; ++u) add_weighted(acc, lo[u], hi[u], w[u]);
      }
    }
  }
  L = warp_sum(L);
  for (int g = 1; g < groups; ++g) {  // group 0 gathers the other groups (uniform trip count)
    const int src_lane = (lane + g * vpr) & 31;
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float a2 = __shfl_sync(FULL_MASK, acc[e], src_lane);
      if (grp == 0) acc[e] += a2;
    }
  }
  if (grp != 0) return;
  const float inv = L > 0.f ? 1.f / L : 0.f;
#pragma unroll
  for (int e = 0; e < 8; ++e) acc[e] *= inv;
  reinterpret_cast<Vec16*>(out + row * D)[c] = pack8<T>(acc);
}

// After a split block wrote its partials: the last block of the (b, head group) to arrive merges the
// group's rows [h0, h0 + rows). Called by every thread of the block (block-uniform).
template <class T>
__device__ __forceinline__ void finish_split(u16* __restrict__ out, const float* __restrict__ part_o,
                                             const float* __restrict__ part_lse, int* __restrict__ counters,
                                             int group, i64 row0, int rows, int num_splits, int used, int D) {
  __shared__ int is_last;
  __threadfence();  // this thread's partials are visible device-wide before the ticket
  __syncthreads();
  if (threadIdx.x == 0) {
    const int ticket = atomicAdd(counters + group, 1);
    is_last = ticket == used - 1;
    if (is_last) counters[group] = 0;  // every other block has taken its ticket
  }
  __syncthreads();
  if (!is_last) return;
  __threadfence();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int r = warp; r < rows; r += DA_THREADS / 32)
    combine_row<T>(out, part_o, part_lse, row0 + r, num_splits, used, D, lane);
}

// Rotate-half RoPE of 8 pairs (x1[i], x2[i]) in shared memory, in place, with cos c[i] and sin s[i]:
// kernels_cu/rope_cache_write.cu's numerics (fp32, every product and sum rounded, no FMA), so a fused
// launch gives the same bits as rope_cache_write followed by this kernel.
template <class T>
__device__ __forceinline__ void rope_pair(u16* x1p, u16* x2p, const float* c, const float* s) {
  float x1[8], x2[8], o1[8], o2[8];
  unpack8<T>(*reinterpret_cast<const Vec16*>(x1p), x1);
  unpack8<T>(*reinterpret_cast<const Vec16*>(x2p), x2);
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    o1[i] = __fsub_rn(__fmul_rn(x1[i], c[i]), __fmul_rn(x2[i], s[i]));
    o2[i] = __fadd_rn(__fmul_rn(x2[i], c[i]), __fmul_rn(x1[i], s[i]));
  }
  *reinterpret_cast<Vec16*>(x1p) = pack8<T>(o1);
  *reinterpret_cast<Vec16*>(x2p) = pack8<T>(o2);
}

// S = q K^T of one 16-key piece (two n-tiles of 8 keys): kb the piece's 16 K rows in shared memory, LD elements apart,
// qa q's A fragments (16 rows, D / 16 k-steps); D = 32 m + 16 takes its last k-step alone.
template <class T, int D, int LD>
__device__ __forceinline__ void score_piece(float (&s)[2][4], const u16* kb, const u32 (&qa)[D / 16][4], int lane) {
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 32; ++kk) {
      u32 kf[4];
      ldmatrix_x4(kf, kb + (j * 8 + (lane & 7)) * LD + kk * 32 + (lane >> 3) * 8);
      Mma<T>::run(s[j], qa[2 * kk], kf[0], kf[1]);
      Mma<T>::run(s[j], qa[2 * kk + 1], kf[2], kf[3]);
    }
    if (D % 32) {
      u32 kf[2];
      ldmatrix_x2(kf, kb + (j * 8 + (lane & 7)) * LD + (D - 16) + ((lane >> 3) & 1) * 8);
      Mma<T>::run(s[j], qa[D / 16 - 1], kf[0], kf[1]);
    }
  }
}

// One 16-key piece of a warp's online softmax over its 16 query rows: s holds the piece's scores (mma accumulators:
// lane (g, t) has rows g and g + 8 of keys tok0 + 8 j + 2 t + {0, 1}), scaled here to log2 units, keys at or past t1
// masked; the rows' maxima m and sums l and the output o (D / 8 n-tiles) are rescaled to the new maxima, and the
// piece's probabilities come back as the A fragments pa of the P V mma (T).
template <class T, int D>
__device__ __forceinline__ void softmax_piece(float (&s)[2][4], int tok0, int t1, float scale_log2, int t4,
                                              float (&m)[2], float (&l)[2], float (&o)[D / 8][4], u32 (&pa)[4]) {
  float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int pos = tok0 + j * 8 + 2 * t4 + (e & 1);
      s[j][e] = pos < t1 ? s[j][e] * scale_log2 : NEG_INF;
      mx[e >> 1] = fmaxf(mx[e >> 1], s[j][e]);
    }
  }
  float alpha[2], mu[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 1));
    mx[r] = fmaxf(mx[r], __shfl_xor_sync(FULL_MASK, mx[r], 2));
    const float mn = fmaxf(m[r], mx[r]);
    mu[r] = mn == NEG_INF ? 0.f : mn;
    alpha[r] = exp2f(m[r] - mu[r]);
    m[r] = mn;
    l[r] *= alpha[r];
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      s[j][e] = exp2f(s[j][e] - mu[e >> 1]);
      l[e >> 1] += s[j][e];
    }
  }
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    o[n][0] *= alpha[0];
    o[n][1] *= alpha[0];
    o[n][2] *= alpha[1];
    o[n][3] *= alpha[1];
  }
  pa[0] = T::pack(s[0][0], s[0][1]);
  pa[1] = T::pack(s[0][2], s[0][3]);
  pa[2] = T::pack(s[1][0], s[1][1]);
  pa[3] = T::pack(s[1][2], s[1][3]);
}

// KV: the cache's element, u16 (T) or unsigned char (E4M3: the _kvfp8 entries).
template <class T, int D, bool ROPE, class KV, int STAGES_>
__device__ __forceinline__ void decode_attention_impl(
    u16* __restrict__ out, float* __restrict__ part_o, float* __restrict__ part_lse, int* __restrict__ counters,
    const u16* __restrict__ q, KV* __restrict__ k_cache, KV* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, i64 q_stride, int bt_stride, int H,
    int Hkv, int head_chunks, int bs_log2, int num_splits, int window, float scale_log2, int cluster,
    const u16* __restrict__ k_new,
    const u16* __restrict__ v_new, i64 kv_stride, const float* __restrict__ cos_sin,
    const i64* __restrict__ rope_index, const i64* __restrict__ slot_mapping, int fresh) {
  TRACE_SCOPE;
  typedef DecodeCfg<D, STAGES_> C;
  constexpr bool KV8 = sizeof(KV) == 1;
  constexpr int STAGES = C::STAGES, LD = C::LD, VPR = C::VPR;
  constexpr int LD8 = C::LD8, VPR8 = C::VPR8;
  constexpr int NS = KV8 ? C::STAGES8 : STAGES;  // pipeline depth
  extern __shared__ Vec16 smem_raw[];
  u16* q_s = reinterpret_cast<u16*>(smem_raw);  // [16][LD]
  u16* k_s = q_s + 16 * LD;                     // [STAGES][TILE][LD]
  u16* v_s = k_s + STAGES * DA_TILE * LD;       // [STAGES][TILE][LD]
  float* cs_s = reinterpret_cast<float*>(v_s + STAGES * DA_TILE * LD);  // [D]: cos then sin (fused RoPE)
  // E4M3 tiles: k8_s, v8_s [STAGES8][TILE][LD8] bytes from k_s on, then (fused RoPE) the new token's k and v rows
  // nk_s, nv_s [D] (T) and cos / sin.
  unsigned char* k8_s = reinterpret_cast<unsigned char*>(k_s);
  unsigned char* v8_s = k8_s + C::STAGES8 * DA_TILE * LD8;
  u16* nk_s = reinterpret_cast<u16*>(v8_s + C::STAGES8 * DA_TILE * LD8);
  u16* nv_s = nk_s + D;
  if (KV8) cs_s = reinterpret_cast<float*>(nv_s + D);
  // the merge below reuses the tiles' memory for 4 x 16 rows of D fp32, their statistics and the cluster's
  static_assert(!KV8 || 2 * C::STAGES8 * DA_TILE * LD8 >= (5 * 16 * D + 2 * 4 * 16 + 16) * 4,
                "decode attention: the E4M3 tiles are too small for the merge");

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int b = blockIdx.z;
  const int hkv = blockIdx.y / head_chunks;
  const int hc = blockIdx.y - hkv * head_chunks;
  const int split = blockIdx.x;
  const int G = H / Hkv;
  const int h0 = hkv * G + hc * 16;
  const int rows = min(16, G - hc * 16);

  // Programmatic dependent launch: the block may be scheduled while the kernel before it finishes.
  // fresh < 0: it reads nothing before that kernel has completed. fresh >= 0 (the caller's promise
  // that the kernel before wrote none of seq_lens, the block tables, rope_index, slot_mapping and the
  // cache rows of positions < seq_len - fresh): it reads those, and starts loading its first tiles'
  // older keys, before the wait.
  const bool early = fresh >= 0;
  if (!early) wait_then_allow_dependents();
  const int seq_len = seq_lens[b];
  const int start = window > 0 ? max(0, seq_len - window) : 0;
  const int total = seq_len - start;
  // Splits of a multiple of the tile: `used` of the num_splits blocks have keys; the others leave at
  // once. One used split writes out directly (no partials, no merge).
  int chunk = (total + num_splits - 1) / num_splits;
  chunk = max(DA_TILE, (chunk + DA_TILE - 1) / DA_TILE * DA_TILE);
  const int used = max(1, (total + chunk - 1) / chunk);
  const bool direct = used == 1;
#if __CUDA_ARCH__ >= 900
  // Merged inside the cluster: the used splits all lie in the first cluster of this (b, head group).
  const bool cmerge = !direct && used <= cluster;
#else
  const bool cmerge = false;
#endif
  if (split >= used) {
#if __CUDA_ARCH__ >= 900
    if (cmerge && split < cluster) {  // a block of the merging cluster with no keys: it takes part in its barriers
      cluster_sync();
      cluster_sync();
    }
#endif
    return;
  }
  const int t0 = start + split * chunk;
  const int t1 = min(t0 + chunk, seq_len);
  // Fused RoPE (cos_sin != null): q is unrotated, and the new token (position seq_len - 1, cache slot
  // slot_mapping[b]) has its unrotated k and v in k_new / v_new. The block whose keys end at the new
  // token puts its rotated k and its v into the tile in shared memory, and (head chunk 0) into the cache.
  const float* cs = nullptr;
  i64 new_slot = -1;
  if (ROPE) {
    cs = cos_sin + rope_index[b] * (i64)D;
    new_slot = t1 == seq_len ? slot_mapping[b] : -1;
  }

  if (t0 >= t1) {  // an empty sequence (split 0, direct): block-uniform exit
    if (early) wait_then_allow_dependents();
    const Vec16 zero = {{0u, 0u, 0u, 0u}};
    for (int i = tid; i < rows * VPR; i += DA_THREADS)
      reinterpret_cast<Vec16*>(out + ((i64)b * H + h0 + i / VPR) * D)[i % VPR] = zero;
    return;
  }

  const int* table = block_tables + (i64)b * bt_stride;
  const int bs_mask = (1 << bs_log2) - 1;
  // Rows of positions >= late are the kernel before's (or the fused RoPE's) and are loaded after the wait.
  const int late = min(early ? seq_len - fresh : 0, new_slot >= 0 ? seq_len - 1 : seq_len);
  // part 0: every row; 1: the rows before `late` only (before the wait); 2: the rows from `late` on.
  auto load_tile = [&](int tile, int stage, int part) {
    const int base = t0 + tile * DA_TILE;
    const TileTable entries(table, base, min(base + DA_TILE, t1), bs_log2, lane);
    if constexpr (KV8) {  // 16 E4M3 values per copy; the new token's k and v (T) to their staging rows
      for (int i = tid; i < DA_TILE * VPR8; i += DA_THREADS) {
        const int tok = i / VPR8, c = i - tok * VPR8;
        const int pos = base + tok;
        const i64 blk = entries.at(pos, bs_log2);
        if (part != 0 && (pos < late) != (part == 1)) continue;
        const bool valid = pos < t1;
        if (new_slot >= 0 && pos == seq_len - 1) {
          const i64 at = b * kv_stride + (i64)hkv * D + c * 16;
          cp_async16(nk_s + c * 16, k_new + at, 16);
          cp_async16(nk_s + c * 16 + 8, k_new + at + 8, 16);
          cp_async16(nv_s + c * 16, v_new + at, 16);
          cp_async16(nv_s + c * 16 + 8, v_new + at + 8, 16);
          continue;
        }
        const unsigned char* ksrc = k_cache;
        const unsigned char* vsrc = v_cache;
        if (valid) {
          const i64 row = ((blk << bs_log2) + (pos & bs_mask)) * Hkv + hkv;
          ksrc = k_cache + row * D + c * 16;
          vsrc = v_cache + row * D + c * 16;
        }
        const int off = (stage * DA_TILE + tok) * LD8 + c * 16;
        cp_async16(k8_s + off, ksrc, valid ? 16 : 0);
        cp_async16(v8_s + off, vsrc, valid ? 16 : 0);
      }
    } else {
    for (int i = tid; i < DA_TILE * VPR; i += DA_THREADS) {
      const int tok = i / VPR, c = i - tok * VPR;
      const int pos = base + tok;
      const i64 blk = entries.at(pos, bs_log2);
      if (part != 0 && (pos < late) != (part == 1)) continue;
      const bool valid = pos < t1;
      const KV* ksrc = k_cache;
      const KV* vsrc = v_cache;
      if (new_slot >= 0 && pos == seq_len - 1) {  // the new token's unrotated k (rotated in place later) and v
        ksrc = k_new + b * kv_stride + (i64)hkv * D + c * 8;
        vsrc = v_new + b * kv_stride + (i64)hkv * D + c * 8;
      } else if (valid) {
        const i64 row = ((blk << bs_log2) + (pos & bs_mask)) * Hkv + hkv;
        ksrc = k_cache + row * D + c * 8;
        vsrc = v_cache + row * D + c * 8;
      }
      const int off = (stage * DA_TILE + tok) * LD + c * 8;
      cp_async16(k_s + off, ksrc, valid ? 16 : 0);
      cp_async16(v_s + off, vsrc, valid ? 16 : 0);
    }
    }
  };

  const int num_tiles = (t1 - t0 + DA_TILE - 1) / DA_TILE;
  auto load_q = [&]() {  // q rows of this head chunk (rows >= `rows` are zero-filled)
    for (int i = tid; i < 16 * VPR; i += DA_THREADS) {
      const int r = i / VPR, c = i - r * VPR;
      const bool valid = r < rows;
      const u16* src = valid ? q + b * q_stride + (i64)(h0 + r) * D + c * 8 : q;
      cp_async16(q_s + r * LD + c * 8, src, valid ? 16 : 0);
    }
  };
  if (ROPE)  // the position's cos / sin row (a constant table): joins the first group
    for (int i = tid; i < D / 4; i += DA_THREADS) cp_async16(cs_s + i * 4, cs + i * 4, 16);
  // (Two copies of the prologue loop on purpose: one loop with `early ? 2 : 0` made ptxas spill in the
  // d32 entries.)
  if (early) {  // the first tiles' older rows, the wait, then q and the rest of those tiles: one group
#pragma unroll
    for (int s = 0; s < NS - 1; ++s)
      if (s < num_tiles) load_tile(s, s, 1);
    wait_then_allow_dependents();
    load_q();
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      if (s < num_tiles) load_tile(s, s, 2);
      cp_async_commit();
    }
  } else {
    load_q();
#pragma unroll
    for (int s = 0; s < NS - 1; ++s) {
      if (s < num_tiles) load_tile(s, s, 0);
      cp_async_commit();
    }
  }

  u32 qa[D / 16][4];
  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.f, 0.f};
  const int ld_row = (lane & 7) + ((lane >> 3) & 1) * 8;  // ldmatrix x4 addressing (A and trans-B)
  const int ld_col = (lane >> 4) * 8;
  const int t4 = lane & 3;
  const int fg = lane >> 2;  // the mma fragments' groupID (E4M3 tiles)

  for (int it = 0; it < num_tiles; ++it) {
    const int nxt = it + NS - 1;
    if (nxt < num_tiles) load_tile(nxt, nxt % NS, 0);
    cp_async_commit();
    cp_async_wait<NS - 1>();
    __syncthreads();
    if (it == 0) TRACE_MARK(0);  // the first tile (and q) landed
    const int stage = it % NS;
    // Fused RoPE (block-uniform): the q rows are rotated in place in the first tile's iteration, and the new
    // token's k row in the last tile's (then k and v go to the cache from shared memory).
    const bool new_row = new_slot >= 0 && it == num_tiles - 1;
    if (ROPE && (it == 0 || new_row)) {
      const int nq = it == 0 ? rows * (D / 16) : 0;
      // the new token's row in this stage (k_s and v_s alike)
      const int row_off = (stage * DA_TILE + ((seq_len - 1 - t0) & (DA_TILE - 1))) * LD;
      for (int i = tid; i < nq + (new_row ? D / 16 : 0); i += DA_THREADS) {
        const int r = i / (D / 16), c = i - r * (D / 16);
        u16* x = i < nq ? q_s + r * LD : KV8 ? nk_s : k_s + row_off;
        rope_pair<T>(x + c * 8, x + D / 2 + c * 8, cs_s + c * 8, cs_s + D / 2 + c * 8);
      }
      __syncthreads();
      if constexpr (KV8) {  // the new token's rotated k and its v -> E4M3, into the tile row and the cache
        if (new_row) {
          if (tid < 2 * VPR8) {  // threads [0, VPR8): k's 16-value vectors; [VPR8, 2 VPR8): v's
            const bool is_k = tid < VPR8;
            const int c = is_k ? tid : tid - VPR8;
            const Vec16* src = reinterpret_cast<const Vec16*>((is_k ? nk_s : nv_s) + c * 16);
            float f[2][8];
            unpack8<T>(src[0], f[0]);
            unpack8<T>(src[1], f[1]);
            Vec16 e;
#pragma unroll
            for (int w = 0; w < 4; ++w)
              e.w[w] = fp8x4_from_floats(f[w >> 1][4 * (w & 1)], f[w >> 1][4 * (w & 1) + 1],
                                         f[w >> 1][4 * (w & 1) + 2], f[w >> 1][4 * (w & 1) + 3]);
            const int row_off8 = (stage * DA_TILE + ((seq_len - 1 - t0) & (DA_TILE - 1))) * LD8;
            *reinterpret_cast<Vec16*>((is_k ? k8_s : v8_s) + row_off8 + c * 16) = e;
            if (hc == 0)
              *reinterpret_cast<Vec16*>((is_k ? k_cache : v_cache) + (new_slot * Hkv + hkv) * D + c * 16) = e;
          }
          __syncthreads();
        }
      } else {
        if (new_row && hc == 0 && tid < 2 * VPR) {  // threads [0, VPR): k's vectors; [VPR, 2 VPR): v's
          const bool is_k = tid < VPR;
          const int c = is_k ? tid : tid - VPR;
          u16* dst = (is_k ? k_cache : v_cache) + (new_slot * Hkv + hkv) * D;
          const u16* src = (is_k ? k_s : v_s) + row_off;
          reinterpret_cast<Vec16*>(dst)[c] = reinterpret_cast<const Vec16*>(src)[c];
        }
      }
    }
    if (it == 0) {
      if constexpr (KV8) {  // q in the E4M3 key fragments' order (header): rows fg and fg + 8
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const Vec8 w = *reinterpret_cast<const Vec8*>(q_s + (fg + 8 * r) * LD + ks * 16 + 4 * t4);
            qa[ks][r] = prmt(w.w[0], w.w[1], 0x5410u);      // k slots 2t, 2t + 1: head dims 4t, 4t + 2
            qa[ks][2 + r] = prmt(w.w[0], w.w[1], 0x7632u);  // k slots 2t + 8, 2t + 9: head dims 4t + 1, 4t + 3
          }
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) ldmatrix_x4(qa[ks], q_s + ld_row * LD + ks * 16 + ld_col);
      }
    }
    const int tok0 = t0 + it * DA_TILE + warp * 16;
    if (tok0 < t1) {
      const u16* kb = k_s + (stage * DA_TILE + warp * 16) * LD;
      const u16* vb = v_s + (stage * DA_TILE + warp * 16) * LD;
      float s[2][4];
      if constexpr (KV8) {  // key rows fg and fg + 8: one word per 16 head dims, converted in registers
        const unsigned char* kb8 = k8_s + (stage * DA_TILE + warp * 16) * LD8 + 4 * t4;
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
          const unsigned char* krow = kb8 + (j * 8 + fg) * LD8;
#pragma unroll
          for (int ks = 0; ks < D / 16; ++ks) {
            u32 b02, b13;
            fp8x4_to_pairs_02_13<T>(*reinterpret_cast<const u32*>(krow + ks * 16), b02, b13);
            Mma<T>::run(s[j], qa[ks], b02, b13);
          }
        }
      } else {
        score_piece<T, D, LD>(s, kb, qa, lane);
      }
      u32 pa[4];
      softmax_piece<T, D>(s, tok0, t1, scale_log2, t4, m, l, o, pa);
      if constexpr (KV8) {  // value rows 2t, 2t + 1, 2t + 8, 2t + 9 (this lane's P columns), head dims per header
        const unsigned char* r0 = v8_s + (stage * DA_TILE + warp * 16 + 2 * t4) * LD8;
        const unsigned char* r2 = r0 + 8 * LD8;
#pragma unroll
        for (int m = 0; m < D / 32; ++m) {
          const int at = 32 * m + 4 * fg;
          const u32 w0 = *reinterpret_cast<const u32*>(r0 + at), w1 = *reinterpret_cast<const u32*>(r0 + LD8 + at);
          const u32 w2 = *reinterpret_cast<const u32*>(r2 + at), w3 = *reinterpret_cast<const u32*>(r2 + LD8 + at);
          // n-tile 4m + i: b0b1 = byte i of rows 2t, 2t + 1; b2b3 = byte i of rows 2t + 8, 2t + 9
          Mma<T>::run(o[4 * m], pa, fp8_pair<T, fp8_sel(0, 4)>(w0, w1), fp8_pair<T, fp8_sel(0, 4)>(w2, w3));
          Mma<T>::run(o[4 * m + 1], pa, fp8_pair<T, fp8_sel(1, 5)>(w0, w1), fp8_pair<T, fp8_sel(1, 5)>(w2, w3));
          Mma<T>::run(o[4 * m + 2], pa, fp8_pair<T, fp8_sel(2, 6)>(w0, w1), fp8_pair<T, fp8_sel(2, 6)>(w2, w3));
          Mma<T>::run(o[4 * m + 3], pa, fp8_pair<T, fp8_sel(3, 7)>(w0, w1), fp8_pair<T, fp8_sel(3, 7)>(w2, w3));
        }
        if (D % 32) {  // head_dim = 32 m + 16: the last 2 n-tiles from 16-bit words
          const int at = D - 16 + 2 * fg;
          const u32 h0 = *reinterpret_cast<const unsigned short*>(r0 + at);
          const u32 h1 = *reinterpret_cast<const unsigned short*>(r0 + LD8 + at);
          const u32 h2 = *reinterpret_cast<const unsigned short*>(r2 + at);
          const u32 h3 = *reinterpret_cast<const unsigned short*>(r2 + LD8 + at);
          Mma<T>::run(o[D / 8 - 2], pa, fp8_pair<T, fp8_sel(0, 4)>(h0, h1), fp8_pair<T, fp8_sel(0, 4)>(h2, h3));
          Mma<T>::run(o[D / 8 - 1], pa, fp8_pair<T, fp8_sel(1, 5)>(h0, h1), fp8_pair<T, fp8_sel(1, 5)>(h2, h3));
        }
      } else {
#pragma unroll
      for (int nn = 0; nn < D / 16; ++nn) {
        u32 vf[4];
        ldmatrix_x4_trans(vf, vb + ld_row * LD + nn * 16 + ld_col);
        Mma<T>::run(o[2 * nn], pa, vf[0], vf[1]);
        Mma<T>::run(o[2 * nn + 1], pa, vf[2], vf[3]);
      }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();
  TRACE_MARK(1);  // every tile scored

  // Merge the 4 warps' partial softmax states through shared memory (reusing the K/V stages).
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
    l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
  }
  float* o_s = reinterpret_cast<float*>(k_s);  // [4][16][D]
  float* m_s = o_s + 4 * 16 * D;                // [4][16]
  float* l_s = m_s + 4 * 16;                    // [4][16]
  float* cm_o = l_s + 4 * 16;                   // [16][D]: this split's result, read by the cluster's leader
  float* cm_lse = cm_o + 16 * D;                // [16]
  const int g = lane >> 2;
  if constexpr (KV8) {  // accumulator (n-tile n, cols 2t, 2t + 1) back to its head dims (header)
#pragma unroll
    for (int n = 0; n < D / 8; ++n) {
      const bool full = n < D / 32 * 4;
      const int d0 = full ? 32 * (n >> 2) + 8 * t4 + (n & 3) : D - 16 + 4 * t4 + (n - D / 32 * 4);
      const int d1 = d0 + (full ? 4 : 2);
      float* base = o_s + (warp * 16 + g) * D;
      base[d0] = o[n][0];
      base[d1] = o[n][1];
      base[8 * D + d0] = o[n][2];
      base[8 * D + d1] = o[n][3];
    }
  } else {
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    float* base = o_s + (warp * 16 + g) * D + n * 8 + 2 * t4;
    base[0] = o[n][0];
    base[1] = o[n][1];
    base[8 * D] = o[n][2];
    base[8 * D + 1] = o[n][3];
  }
  }
  if (t4 == 0) {
    m_s[warp * 16 + g] = m[0];
    m_s[warp * 16 + g + 8] = m[1];
    l_s[warp * 16 + g] = l[0];
    l_s[warp * 16 + g + 8] = l[1];
  }
  __syncthreads();
  for (int i = tid; i < rows * VPR; i += DA_THREADS) {
    const int r = i / VPR, c = i - r * VPR;
    float M = NEG_INF;
#pragma unroll
    for (int w = 0; w < 4; ++w) M = fmaxf(M, m_s[w * 16 + r]);
    float L = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      const float mw = m_s[w * 16 + r];
      if (mw == NEG_INF) continue;
      const float wgt = exp2f(mw - M);
      L += l_s[w * 16 + r] * wgt;
      const float* src = o_s + (w * 16 + r) * D + c * 8;
#pragma unroll
      for (int e = 0; e < 8; ++e) acc[e] += src[e] * wgt;
    }
    const float inv = 1.f / L;
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] *= inv;
    const i64 bh = (i64)b * H + h0 + r;
    if (direct) {
      reinterpret_cast<Vec16*>(out + bh * D)[c] = pack8<T>(acc);
    } else if (cmerge) {
      float4* dst = reinterpret_cast<float4*>(cm_o + r * D + c * 8);
      dst[0] = make_float4(acc[0], acc[1], acc[2], acc[3]);
      dst[1] = make_float4(acc[4], acc[5], acc[6], acc[7]);
      if (c == 0) cm_lse[r] = M + log2f(L);
    } else {
      float* dst = part_o + (bh * num_splits + split) * D + c * 8;
      Vec16 lo, hi;
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        lo.w[e] = __float_as_uint(acc[e]);
        hi.w[e] = __float_as_uint(acc[4 + e]);
      }
      reinterpret_cast<Vec16*>(dst)[0] = lo;
      reinterpret_cast<Vec16*>(dst)[1] = hi;
      if (c == 0) part_lse[bh * num_splits + split] = M + log2f(L);
    }
  }
  TRACE_MARK(2);  // the block's own result (merged over its warps) written
#if __CUDA_ARCH__ >= 900
  if (cmerge) {  // the leader (split 0) merges the cluster's splits from their shared memory, in split order
    cluster_sync();
    TRACE_MARK(3);
    if (split == 0) {  // every split's lse, then its partial, loaded before any is used (at most 8 splits)
      for (int i = tid; i < rows * VPR; i += DA_THREADS) {
        const int r = i / VPR, c = i - r * VPR;
        float ls[DA_CLUSTER_MAX];
        float M = NEG_INF;
#pragma unroll
        for (int sp = 0; sp < DA_CLUSTER_MAX; ++sp) {
          ls[sp] = sp < used ? ld_cluster_f32(cluster_map(cm_lse + r, sp)) : NEG_INF;
          M = fmaxf(M, ls[sp]);
        }
        float L = 0.f, acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int s0 = 0; s0 < DA_CLUSTER_MAX; s0 += 4) {
          float4 lo[4], hi[4];
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            if (s0 + u < used) {
              const u32 src = cluster_map(cm_o + r * D + c * 8, s0 + u);
              lo[u] = ld_cluster_f32x4(src);
              hi[u] = ld_cluster_f32x4(src + 16);
            }
          }
#pragma unroll
          for (int u = 0; u < 4; ++u) {
            if (s0 + u < used) {
              const float wgt = exp2f(ls[s0 + u] - M);
              L += wgt;
              add_weighted(acc, lo[u], hi[u], wgt);
            }
          }
        }
        const float inv = 1.f / L;
#pragma unroll
        for (int e = 0; e < 8; ++e) acc[e] *= inv;
        reinterpret_cast<Vec16*>(out + ((i64)b * H + h0 + r) * D)[c] = pack8<T>(acc);
      }
    }
    cluster_sync();  // the other splits' shared memory stays until the leader has read it
    return;
  }
#endif
  if (!direct)
    finish_split<T>(out, part_o, part_lse, counters, b * gridDim.y + blockIdx.y, (i64)b * H + h0, rows, num_splits,
                    used, D);
}

#define DECODE_ENTRY1(NAME, T, D, ROPE, KV, STAGES)                                                         \
  extern "C" __global__ void __launch_bounds__(DA_THREADS) NAME(                                            \
      u16* out, float* part_o, float* part_lse, int* counters, const u16* q, KV* k_cache, KV* v_cache,      \
      const int* block_tables, const int* seq_lens, i64 q_stride, int bt_stride, int H, int Hkv,            \
      int head_chunks, int bs_log2, int num_splits, int window, float scale_log2, int cluster,               \
      const u16* k_new, const u16* v_new, i64 kv_stride, const float* cos_sin, const i64* rope_index,       \
      const i64* slot_mapping, int fresh) {                                                                 \
    decode_attention_impl<T, D, ROPE, KV, STAGES>(out, part_o, part_lse, counters, q, k_cache, v_cache, block_tables, \
                                      seq_lens, q_stride, bt_stride, H, Hkv, head_chunks, bs_log2,          \
                                      num_splits, window, scale_log2, cluster, k_new, v_new, kv_stride,     \
                                      cos_sin, rope_index, slot_mapping, fresh);                            \
  }
// decode_attention_*: q rotated, the new token's K/V in the cache; decode_attention_rope_*: the fused RoPE;
// *_kvfp8: the same over an E4M3 cache; decode_attention_*_s2 (D < 128): 2-deep 16-bit tiles (DecodeCfg).
#define DECODE_ENTRY(SUFFIX, T, D)                                                                          \
  DECODE_ENTRY1(decode_attention_##SUFFIX##_d##D, T, D, false, u16, (D >= 128 ? 2 : 3))                     \
  DECODE_ENTRY1(decode_attention_rope_##SUFFIX##_d##D, T, D, true, u16, (D >= 128 ? 2 : 3))                 \
  DECODE_ENTRY1(decode_attention_##SUFFIX##_d##D##_kvfp8, T, D, false, unsigned char, (D >= 128 ? 2 : 3))   \
  DECODE_ENTRY1(decode_attention_rope_##SUFFIX##_d##D##_kvfp8, T, D, true, unsigned char, (D >= 128 ? 2 : 3))
#define DECODE_ENTRY_S2(SUFFIX, T, D) DECODE_ENTRY1(decode_attention_##SUFFIX##_d##D##_s2, T, D, false, u16, 2)

DECODE_ENTRY(bf16, Bf16, 16)
DECODE_ENTRY(bf16, Bf16, 32)
DECODE_ENTRY(bf16, Bf16, 64)
DECODE_ENTRY(bf16, Bf16, 80)
DECODE_ENTRY(bf16, Bf16, 96)
DECODE_ENTRY(bf16, Bf16, 128)
DECODE_ENTRY(fp16, Fp16, 16)
DECODE_ENTRY(fp16, Fp16, 32)
DECODE_ENTRY(fp16, Fp16, 64)
DECODE_ENTRY(fp16, Fp16, 80)
DECODE_ENTRY(fp16, Fp16, 96)
DECODE_ENTRY(fp16, Fp16, 128)
DECODE_ENTRY_S2(bf16, Bf16, 16)
DECODE_ENTRY_S2(bf16, Bf16, 32)
DECODE_ENTRY_S2(bf16, Bf16, 64)
DECODE_ENTRY_S2(bf16, Bf16, 80)
DECODE_ENTRY_S2(bf16, Bf16, 96)
DECODE_ENTRY_S2(fp16, Fp16, 16)
DECODE_ENTRY_S2(fp16, Fp16, 32)
DECODE_ENTRY_S2(fp16, Fp16, 64)
DECODE_ENTRY_S2(fp16, Fp16, 80)
DECODE_ENTRY_S2(fp16, Fp16, 96)

// ---------------------------------------------------------------------------------------------
// Warp entries (decode_attention_{bf16,fp16}_d128_w): one warp per item (sequence b, KV head, head chunk), for
// launches of one split whose default grid needs more than one wave: many items (batch 64-256), where a block of the
// default entries (one 64-key tile in flight at D = 128, three blocks an SM) spends much of its life on fixed costs
// (its seq_len, table and first-tile round trips, the 4-warp merge) and the last wave runs part-empty. At D = 64 the
// same kernel (four blocks an SM) lost to the 2-deep _s2 block entries at some shapes (bench/RESULTS.md): not built.
// The grid is persistent: warp w of the launch (blockIdx.x * DW_WARPS + warp) takes items w, w + W, w + 2 W, ...
// (W = gridDim.x * DW_WARPS; item = (b * Hkv + hkv) * head_chunks + hc, so neighbouring warps read one block-table
// row). Each warp streams its items' 16-key tiles of K and V through its own WarpCfg::STAGES-deep ring of shared memory
// with cp.async (WarpCfg::STAGES deep); the ring runs on from one item into the next, so the next item's first tiles are in flight while
// this one's last are scored. The next item's seq_len and the next tile's block-table entries (one a lane, handed
// to the copies by shuffles) are read a step ahead. The warp scores a tile with mma.m16n8k16 (the head chunk's 16
// q rows as A, read from global memory at the item's start; rows past the chunk zero), keeps its rows' online
// softmax over the item's keys in order, and writes its rows of out after the last tile. No block barrier, no
// merge; an item without keys writes zeros.
// Launch contract (decode_attention_{bf16,fp16}_d128_w): out, q, k_cache, v_cache, block_tables, seq_lens,
// q_stride, bt_stride, H, Hkv, head_chunks, bs_log2, window and scale_log2 as for the other entries, then the batch
// B; 16-bit caches, no RoPE, one split; nothing is read before the PDL wait. Grid (blocks, 1, 1), any blocks >= 1;
// block (DW_WARPS * 32); dynamic shared memory DW_WARPS * 3 * 2 * 16 * (D + 8) * 2 bytes (3 stages; engine/cuda/
// wrappers/decode_attention.py warp_smem_bytes).
#define DW_WARPS 4
#define DW_KEYS 16
template <int D>
struct WarpCfg {
  static_assert(D % 32 == 0, "warp entries: head_dim a multiple of 32");
  static constexpr int STAGES = 3;  // two tiles of each warp in flight: 16 KB at D = 128, two blocks an SM
  static constexpr int LD = D + 8;                 // padded smem row (u16): conflict-free ldmatrix
  static constexpr int VPR = D / 8;                // 16-byte vectors per row
  static constexpr int STAGE = 2 * DW_KEYS * LD;   // u16 of a stage: K rows then V rows
};

template <class T, int D>
__device__ __forceinline__ void decode_attention_warp_impl(
    u16* __restrict__ out, const u16* __restrict__ q, const u16* __restrict__ k_cache, const u16* __restrict__ v_cache,
    const int* __restrict__ block_tables, const int* __restrict__ seq_lens, i64 q_stride, int bt_stride, int H,
    int Hkv, int head_chunks, int bs_log2, int window, float scale_log2, int B) {
  typedef WarpCfg<D> C;
  constexpr int NS = C::STAGES, LD = C::LD, VPR = C::VPR, STAGE = C::STAGE;
  extern __shared__ Vec16 smem_raw[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u16* ring = reinterpret_cast<u16*>(smem_raw) + warp * NS * STAGE;
  wait_then_allow_dependents();
  const int per_seq = Hkv * head_chunks, num_items = B * per_seq;
  const int W = gridDim.x * DW_WARPS, first = blockIdx.x * DW_WARPS + warp;
  const int G = H / Hkv, bs_mask = (1 << bs_log2) - 1;
  auto len_of = [&](int item) { return item < num_items ? seq_lens[item / per_seq] : 0; };
  auto start_of = [&](int len) { return window > 0 ? max(0, len - window) : 0; };

  // The copy side: the tile of keys [l_base, l_base + 16) of item l_item (keys below l_len), its table entries.
  int l_item = first, l_len = len_of(first), l_next_len = len_of(first + W), l_base = start_of(l_len);
  auto next_copy_item = [&]() {  // on to the next item with keys (or past the last)
    do {
      l_item += W;
      l_len = l_next_len;
      l_next_len = len_of(l_item + W);
      l_base = start_of(l_len);
    } while (l_item < num_items && l_base >= l_len);
  };
  if (l_item < num_items && l_base >= l_len) next_copy_item();
  auto table_entry = [&]() {  // lane j < 16: the block-table entry of key l_base + j
    const int pos = l_base + (lane & 15);
    return l_item < num_items && pos < l_len ? block_tables[(i64)(l_item / per_seq) * bt_stride + (pos >> bs_log2)]
                                             : 0;
  };
  int l_ent = table_entry();
  auto copy_tile = [&](int stage) {  // one commit group, empty past the last item
    if (l_item < num_items) {
      const int hkv = (l_item - l_item / per_seq * per_seq) / head_chunks;
      u16* ks = ring + stage * STAGE;
      u16* vs = ks + DW_KEYS * LD;
#pragma unroll
      for (int i = lane; i < DW_KEYS * VPR; i += 32) {
        const int tok = i / VPR, c = i - tok * VPR, pos = l_base + tok;
        const int ent = __shfl_sync(FULL_MASK, l_ent, tok);
        const bool valid = pos < l_len;
        const i64 row = (((i64)ent << bs_log2) + (pos & bs_mask)) * Hkv + hkv;
        cp_async16(ks + tok * LD + c * 8, valid ? k_cache + row * D + c * 8 : k_cache, valid ? 16 : 0);
        cp_async16(vs + tok * LD + c * 8, valid ? v_cache + row * D + c * 8 : v_cache, valid ? 16 : 0);
      }
      l_base += DW_KEYS;
      if (l_base >= l_len) next_copy_item();
      l_ent = table_entry();
    }
    cp_async_commit();
  };

  // The scoring side: item c_item (sequence c_b, query rows [c_h0, c_h0 + c_rows)), its tile at c_base.
  const int g = lane >> 2, t4 = lane & 3;
  int c_item = first, c_len = len_of(first), c_next_len = len_of(first + W), c_base = 0, c_b = 0, c_h0 = 0,
      c_rows = 0;
  u32 qa[D / 16][4];
  float o[D / 8][4], m[2], l[2];
  auto start_item = [&]() {  // from c_item / c_len: items without keys get zeros; q and the softmax state
    while (c_item < num_items) {
      c_b = c_item / per_seq;
      const int y = c_item - c_b * per_seq, hkv = y / head_chunks, hc = y - hkv * head_chunks;
      c_h0 = hkv * G + hc * 16;
      c_rows = min(16, G - hc * 16);
      c_base = start_of(c_len);
      if (c_base < c_len) break;
      const Vec16 zero = {{0u, 0u, 0u, 0u}};
      for (int i = lane; i < c_rows * VPR; i += 32)
        reinterpret_cast<Vec16*>(out + ((i64)c_b * H + c_h0 + i / VPR) * D)[i % VPR] = zero;
      c_item += W;
      c_len = c_next_len;
      c_next_len = len_of(c_item + W);
    }
    if (c_item >= num_items) return;
    const u16* q0 = q + (i64)c_b * q_stride + (i64)(c_h0 + g) * D + 2 * t4;
    const u16* q1 = q0 + 8 * D;
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      qa[ks][0] = g < c_rows ? *reinterpret_cast<const u32*>(q0 + ks * 16) : 0u;
      qa[ks][1] = g + 8 < c_rows ? *reinterpret_cast<const u32*>(q1 + ks * 16) : 0u;
      qa[ks][2] = g < c_rows ? *reinterpret_cast<const u32*>(q0 + ks * 16 + 8) : 0u;
      qa[ks][3] = g + 8 < c_rows ? *reinterpret_cast<const u32*>(q1 + ks * 16 + 8) : 0u;
    }
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
    m[0] = m[1] = NEG_INF;
    l[0] = l[1] = 0.f;
  };

#pragma unroll
  for (int s = 0; s < NS - 1; ++s) copy_tile(s);
  start_item();
  const int ld_row = (lane & 7) + ((lane >> 3) & 1) * 8;  // ldmatrix x4 trans addressing (V)
  const int ld_col = (lane >> 4) * 8;
  int stage = 0;
  while (c_item < num_items) {
    copy_tile(stage == 0 ? NS - 1 : stage - 1);  // into the stage the previous iteration scored
    cp_async_wait<NS - 1>();
    __syncwarp();  // every lane's copies of this tile landed
    const u16* kb = ring + stage * STAGE;
    const u16* vb = kb + DW_KEYS * LD;
    float s[2][4];
    score_piece<T, D, LD>(s, kb, qa, lane);
    u32 pa[4];
    softmax_piece<T, D>(s, c_base, c_len, scale_log2, t4, m, l, o, pa);
#pragma unroll
    for (int nn = 0; nn < D / 16; ++nn) {
      u32 vf[4];
      ldmatrix_x4_trans(vf, vb + ld_row * LD + nn * 16 + ld_col);
      Mma<T>::run(o[2 * nn], pa, vf[0], vf[1]);
      Mma<T>::run(o[2 * nn + 1], pa, vf[2], vf[3]);
    }
    __syncwarp();  // every lane's reads of this stage done before a copy refills it
    stage = stage + 1 == NS ? 0 : stage + 1;
    c_base += DW_KEYS;
    if (c_base >= c_len) {  // the item's last tile: its rows of out, then the next item
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 1);
        l[r] += __shfl_xor_sync(FULL_MASK, l[r], 2);
      }
      const float inv0 = 1.f / l[0], inv1 = 1.f / l[1];
      u16* o0 = out + ((i64)c_b * H + c_h0 + g) * D + 2 * t4;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) {
        if (g < c_rows) *reinterpret_cast<u32*>(o0 + 8 * n) = T::pack(o[n][0] * inv0, o[n][1] * inv0);
        if (g + 8 < c_rows) *reinterpret_cast<u32*>(o0 + 8 * D + 8 * n) = T::pack(o[n][2] * inv1, o[n][3] * inv1);
      }
      c_item += W;
      c_len = c_next_len;
      c_next_len = len_of(c_item + W);
      start_item();
    }
  }
  cp_async_wait<0>();
}

#define DECODE_WARP_ENTRY(SUFFIX, T, D)                                                                      \
  extern "C" __global__ void __launch_bounds__(DW_WARPS * 32) decode_attention_##SUFFIX##_d##D##_w(           \
      u16* out, const u16* q, const u16* k_cache, const u16* v_cache, const int* block_tables,                \
      const int* seq_lens, i64 q_stride, int bt_stride, int H, int Hkv, int head_chunks, int bs_log2,         \
      int window, float scale_log2, int B) {                                                                  \
    decode_attention_warp_impl<T, D>(out, q, k_cache, v_cache, block_tables, seq_lens, q_stride, bt_stride, H,   \
                                     Hkv, head_chunks, bs_log2, window, scale_log2, B);                        \
  }
DECODE_WARP_ENTRY(bf16, Bf16, 128)
DECODE_WARP_ENTRY(fp16, Fp16, 128)
