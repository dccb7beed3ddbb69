// nvcc-flags: --use_fast_math
// Op: prefill (extend) attention over the paged KV cache with a causal mask and an optional sliding
// window. Reference: TorchOps.prefill_attention.
//
//   Sequence b has seq_len keys (its cached prefix plus the new tokens, already written to the cache
//   by rope_cache_write) and its queries are the LAST query_len of them, so a chunk that continues a
//   cached prefix works. A query at position p sees the keys k <= p with k > p - window (if window).
//   out[t, h] = softmax(scale * q[t, h] . K[:, h / G]) @ V[:, h / G]
//
// Layouts:
//   q [T, H, D] (heads contiguous, token stride q_stride elements); out [T, H, D] contiguous.
//   k_cache / v_cache [num_blocks, block_size, Hkv, D]; block_tables [B, bt_stride] int32.
//   work [num_work, 4] int32, one row per block: (b, first query token in q, rows <= ROWS(D), position of the
//   first row), built on the host (engine.batch.prefill_work). A row with 0 rows is empty work, so a
//   forward replayed from a CUDA graph pads its list to a fixed grid.
//   ROWS(D) = 64 * MT, MT = the m16 tiles a warp holds (pa_m_tiles): 128 rows an item up to head_dim 64, 64 above
//   (engine.batch.prefill_rows).
//
// Key splits: gridDim.z = splits. With splits > 1, block (w, h, z) scores only share z of its rows' key tiles
// and writes its unnormalised output and row statistics in fp32 to part_o [splits, num_q, H, D] and part_ml
// [splits, num_q, H, 2] (the row max in scaled log2 units, the row sum); prefill_attention_merge_* then
// combines the shares. A chunk that continues a long cached prefix has few work items and many key tiles:
// split, its blocks fill the GPU instead of each walking every tile of the prefix.
//
// Work split: block (work item w, query head h): ROWS(D) query rows of one head, 4 warps of 16 * MT consecutive
// rows, MT m16 tiles a warp. 64-token K/V tiles stream through shared memory with cp.async (2 stages) from the
// first key any row needs to the last; S = Q K^T and O += P V run on mma.m16n8k16 with fp32 accumulation and an
// online softmax per row (FlashAttention-2 structure). Each K or V fragment a warp loads from shared memory (ldmatrix)
// feeds the mmas of all its MT m-tiles: with MT = 2 a block loads each K/V tile from shared memory for 128 rows,
// not 64. Tiles entirely outside a warp's causal/window range are skipped by that warp (MT = 2: the range of its rows
// before nrows; a warp with none skips every tile).
//
// FP8 KV cache (the _kvfp8 entries: k_cache / v_cache hold E4M3 bytes, engine/quant.py fp8_kv): the tiles stream
// through shared memory as the cache holds them (16-byte cp.async, 16 values per copy: half the bytes of a 16-bit
// tile), 2 stages; after its wait each thread converts the 16-byte pieces it copied itself to T (common.cuh
// fp8x4_to_pairs: exact) into one 16-bit K and V tile, which the barrier before the mmas publishes, and from there
// everything is the 16-bit kernel's (the 4 warps share each converted tile: one conversion per value and block).
//
// Launch contract (prefill_attention_{bf16,fp16}_d{16,32,64,80,96,128}[_kvfp8]):
//   grid (num_work, H, splits), block (128); work rows of at most ROWS(D) rows (128 up to D = 64, 64 above);
//   dynamic shared memory = (ROWS(D) + 2 * 2 * 64) * (D + 8) * 2 bytes: a ROWS(D)-row q tile and two stages of
//   64-row K and V tiles (_kvfp8: (ROWS(D) + 2 * 64) * (D + 8) * 2 + 2 * 2 * 64 * D: one 16-bit K and V tile, two
//   stages of E4M3 ones); so at D = 16 / 32 / 64: 18432 / 30720 / 55296 bytes (_kvfp8 16384 / 28672 / 53248), at
//   80 / 96 / 128: 56320 / 66560 / 87040 (_kvfp8 54272 / 64512 / 84992). part_o / part_ml used (and needed) only
//   when splits > 1 (at most 16). Merge (prefill_attention_merge_{dt}_d{D}): grid (num_work, H, ROWS(D) / 16),
//   block (128), the same work list; it writes out.
//   (engine/cuda/wrappers/prefill_attention.py computes the same; the library raises the function's limit at load).
//   block_size a power of two (bs_log2); scale_log2 = scale * log2(e); q, out, caches 16-byte aligned.
#include "common.cuh"

#define PA_THREADS 128
#define PA_TILE 64
#define PA_STAGES 2
// m16 tiles a warp holds (16 query rows each; a block 4 warps, so 64 * m-tiles rows a work item): two up to head_dim
// 64, so that every K and V fragment a warp loads from shared memory feeds two mmas; one above (a second tile's
// output accumulators, D / 2 registers, would not fit beside the first's).
template <int D>
__host__ __device__ constexpr int pa_m_tiles() {
  return D <= 64 ? 2 : 1;
}
// The entries' launch bounds: a hint of 2 blocks an SM made ptxas schedule the 128-wide entries 12-14% faster
// (bench_kernels --prefill, H100). The others have none: up to 64 wide (two m-tiles) the q, S and O fragments alone
// take 3 * D / 2 + 64 registers a thread (160 at 64; ptxas takes ~250 there, 2 blocks an SM), so a hint of 3 (168)
// would spill.
#define PA_BOUNDS_D128 (PA_THREADS, 2)
#define PA_BOUNDS (PA_THREADS)

// KV: the cache's element, u16 (T) or unsigned char (E4M3: the _kvfp8 entries).
template <class T, int D, class KV>
__device__ __forceinline__ void prefill_attention_impl(
    u16* __restrict__ out, const u16* __restrict__ q, const KV* __restrict__ k_cache,
    const KV* __restrict__ v_cache, const int* __restrict__ block_tables, const int* __restrict__ work,
    i64 q_stride, int bt_stride, int H, int Hkv, int bs_log2, int window, float scale_log2, float* __restrict__ part_o,
    float* __restrict__ part_ml, int num_q) {
  constexpr bool KV8 = sizeof(KV) == 1;
  constexpr int MT = pa_m_tiles<D>(), ROWS = 64 * MT, WARP_ROWS = 16 * MT;
  constexpr int LD = D + 8, VPR = D / 8, VPR8 = D / 16;
  constexpr int KV_STAGES = KV8 ? 1 : PA_STAGES;  // 16-bit tiles (KV8: the converted one)
  extern __shared__ Vec16 smem_raw[];
  u16* q_s = reinterpret_cast<u16*>(smem_raw);  // [ROWS][LD]
  u16* k_s = q_s + ROWS * LD;                   // [KV_STAGES][TILE][LD]
  u16* v_s = k_s + KV_STAGES * PA_TILE * LD;    // [KV_STAGES][TILE][LD]
  unsigned char* k8_s = reinterpret_cast<unsigned char*>(v_s + KV_STAGES * PA_TILE * LD);  // KV8: [STAGES][TILE][D]
  unsigned char* v8_s = k8_s + PA_STAGES * PA_TILE * D;                                   // KV8: [STAGES][TILE][D]

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const Vec16 item = reinterpret_cast<const Vec16*>(work)[blockIdx.x];
  const int b = (int)item.w[0], q_tok = (int)item.w[1], nrows = (int)item.w[2], q_pos0 = (int)item.w[3];
  if (nrows <= 0) return;  // padding of a fixed-size work list (the whole block returns together)
  const int h = blockIdx.y;
  const int hkv = h / (H / Hkv);
  const int kv_hi = q_pos0 + nrows;  // keys [kv_lo, kv_hi)
  const int kv_lo = window > 0 ? max(0, q_pos0 - window + 1) : 0;
  const int split = blockIdx.z, splits = gridDim.z;
  const int all_tiles = (kv_hi - kv_lo + PA_TILE - 1) / PA_TILE;
  const int tile_begin = (int)((long long)all_tiles * split / splits);
  const int num_tiles = (int)((long long)all_tiles * (split + 1) / splits) - tile_begin;

  for (int i = tid; i < ROWS * VPR; i += PA_THREADS) {
    const int r = i / VPR, c = i - r * VPR;
    const bool valid = r < nrows;
    const u16* src = valid ? q + (i64)(q_tok + r) * q_stride + (i64)h * D + c * 8 : q;
    cp_async16(q_s + r * LD + c * 8, src, valid ? 16 : 0);
  }

  const int* table = block_tables + (i64)b * bt_stride;
  const int bs_mask = (1 << bs_log2) - 1;
  // The block-table entries of a tile (none read for a tile past the keys): read one iteration before the tile's
  // copies are issued, so that no iteration waits on a table read before it can issue them.
  auto tile_table = [&](int tile) {
    const int base = kv_lo + (tile_begin + tile) * PA_TILE;
    return TileTable(table, base, min(base + PA_TILE, kv_hi), bs_log2, lane);
  };
  auto load_tile = [&](int tile, int stage, const TileTable& entries) {
    const int base = kv_lo + (tile_begin + tile) * PA_TILE;
    if constexpr (KV8) {  // 16 E4M3 values per copy
      for (int i = tid; i < PA_TILE * VPR8; i += PA_THREADS) {
        const int tok = i / VPR8, c = i - tok * VPR8;
        const int pos = base + tok;
        const bool valid = pos < kv_hi;
        const i64 blk = entries.at(pos, bs_log2);
        const unsigned char* ksrc = k_cache;
        const unsigned char* vsrc = v_cache;
        if (valid) {
          const i64 row = ((blk << bs_log2) + (pos & bs_mask)) * Hkv + hkv;
          ksrc = k_cache + row * D + c * 16;
          vsrc = v_cache + row * D + c * 16;
        }
        const int off = (stage * PA_TILE + tok) * D + c * 16;
        cp_async16(k8_s + off, ksrc, valid ? 16 : 0);
        cp_async16(v8_s + off, vsrc, valid ? 16 : 0);
      }
    } else {
    for (int i = tid; i < PA_TILE * VPR; i += PA_THREADS) {
      const int tok = i / VPR, c = i - tok * VPR;
      const int pos = base + tok;
      const bool valid = pos < kv_hi;
      const i64 blk = entries.at(pos, bs_log2);
      const KV* ksrc = k_cache;
      const KV* vsrc = v_cache;
      if (valid) {
        const i64 row = ((blk << bs_log2) + (pos & bs_mask)) * Hkv + hkv;
        ksrc = k_cache + row * D + c * 8;
        vsrc = v_cache + row * D + c * 8;
      }
      const int off = (stage * PA_TILE + tok) * LD + c * 8;
      cp_async16(k_s + off, ksrc, valid ? 16 : 0);
      cp_async16(v_s + off, vsrc, valid ? 16 : 0);
    }
    }
  };
  // KV8: this thread's own 16-byte E4M3 pieces of stage `stage` (complete after its cp.async wait) -> T, into the
  // 16-bit tile (the same pieces load_tile gave it: no barrier needed before).
  auto convert_tile = [&](int stage) {
    for (int i = tid; i < PA_TILE * VPR8; i += PA_THREADS) {
      const int tok = i / VPR8, c = i - tok * VPR8;
      const int off8 = (stage * PA_TILE + tok) * D + c * 16;
#pragma unroll
      for (int kv = 0; kv < 2; ++kv) {
        const Vec16 w = *reinterpret_cast<const Vec16*>((kv ? v8_s : k8_s) + off8);
        Vec16 lo, hi;  // values 0..7 and 8..15
        fp8x4_to_pairs<T>(w.w[0], lo.w[0], lo.w[1]);
        fp8x4_to_pairs<T>(w.w[1], lo.w[2], lo.w[3]);
        fp8x4_to_pairs<T>(w.w[2], hi.w[0], hi.w[1]);
        fp8x4_to_pairs<T>(w.w[3], hi.w[2], hi.w[3]);
        Vec16* dst = reinterpret_cast<Vec16*>((kv ? v_s : k_s) + tok * LD + c * 16);
        dst[0] = lo;
        dst[1] = hi;
      }
    }
  };

  TileTable entries = tile_table(0);
  if (num_tiles > 0) load_tile(0, 0, entries);
  cp_async_commit();
  entries = tile_table(1);

  const int ld_row = (lane & 7) + ((lane >> 3) & 1) * 8;
  const int ld_col = (lane >> 4) * 8;
  const int g = lane >> 2, t4 = lane & 3;
  // Warp w holds rows [w * WARP_ROWS, (w + 1) * WARP_ROWS) of the item, m-tile i of them the 16 from
  // w * WARP_ROWS + 16 i; this thread the rows g and g + 8 of each m-tile (the mma accumulator layout), at positions
  // qp0 + 16 i and qp0 + 16 i + 8.
  const int wrow = warp * WARP_ROWS;
  const int qp0 = q_pos0 + wrow + g;
  // The positions [warp_qmin, warp_qmax] whose keys the warp walks. Two m-tiles: its real rows' only (rows past nrows
  // are computed from zero queries and never written; a warp with none has warp_qmax = -1, before every tile, and
  // skips them all: a short item leaves whole warps without rows). One m-tile: all 16 rows (with the clamp ptxas
  // allocates the 80-128-wide entries' registers anew, in one form of it spilling at 80 and 96).
  const int warp_qmin = q_pos0 + wrow;
  const int warp_qmax = MT == 1        ? warp_qmin + WARP_ROWS - 1
                        : wrow < nrows ? q_pos0 + min(wrow + WARP_ROWS, nrows) - 1
                                       : -1;

  u32 qa[MT][D / 16][4];
  float o[MT][D / 8][4];
  float m[MT][2], l[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[i][n][0] = o[i][n][1] = o[i][n][2] = o[i][n][3] = 0.f;
    m[i][0] = m[i][1] = NEG_INF;
    l[i][0] = l[i][1] = 0.f;
  }

  for (int it = 0; it < num_tiles; ++it) {
    if (it + 1 < num_tiles) load_tile(it + 1, (it + 1) & 1, entries);
    cp_async_commit();
    entries = tile_table(it + 2);  // the next iteration's copies
    cp_async_wait<1>();
    if constexpr (KV8) convert_tile(it & 1);  // (the previous iteration's last barrier: no warp reads the tile)
    __syncthreads();
    if (it == 0) {
#pragma unroll
      for (int i = 0; i < MT; ++i) {
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks)
          ldmatrix_x4(qa[i][ks], q_s + (wrow + 16 * i + ld_row) * LD + ks * 16 + ld_col);
      }
    }
    const int stage = it & 1;
    const int tile_start = kv_lo + (tile_begin + it) * PA_TILE;
    const bool in_future = tile_start > warp_qmax;
    const bool too_old = window > 0 && tile_start + PA_TILE - 1 <= warp_qmin - window;
    if (!in_future && !too_old) {
      const u16* kb = k_s + (KV8 ? 0 : stage) * PA_TILE * LD;
      const u16* vb = v_s + (KV8 ? 0 : stage) * PA_TILE * LD;
      // S = Q K^T: each K fragment feeds the mma of every m-tile before the next is loaded.
      float s[MT][PA_TILE / 8][4];
#pragma unroll
      for (int j = 0; j < PA_TILE / 8; ++j) {
#pragma unroll
        for (int i = 0; i < MT; ++i) s[i][j][0] = s[i][j][1] = s[i][j][2] = s[i][j][3] = 0.f;
#pragma unroll
        for (int kk = 0; kk < D / 32; ++kk) {
          u32 kf[4];
          ldmatrix_x4(kf, kb + (j * 8 + (lane & 7)) * LD + kk * 32 + (lane >> 3) * 8);
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            Mma<T>::run(s[i][j], qa[i][2 * kk], kf[0], kf[1]);
            Mma<T>::run(s[i][j], qa[i][2 * kk + 1], kf[2], kf[3]);
          }
        }
        if (D % 32) {  // head_dim = 32 m + 16: the last k-step alone
          u32 kf[2];
          ldmatrix_x2(kf, kb + (j * 8 + (lane & 7)) * LD + (D - 16) + ((lane >> 3) & 1) * 8);
#pragma unroll
          for (int i = 0; i < MT; ++i) Mma<T>::run(s[i][j], qa[i][D / 16 - 1], kf[0], kf[1]);
        }
      }
      float mx[MT][2];
#pragma unroll
      for (int i = 0; i < MT; ++i) mx[i][0] = mx[i][1] = NEG_INF;
      // Every key of the tile visible to every real row of the warp (past its rows, before kv_hi, inside the
      // window): no mask (warp-uniform).
      const bool unmasked = tile_start + PA_TILE - 1 <= warp_qmin && tile_start + PA_TILE <= kv_hi &&
                            (window <= 0 || tile_start > warp_qmax - window);
      // The scores stay unscaled here: scale_log2 > 0, so the row max of the raw scores, scaled once, is the max of
      // the scaled ones (rounding is monotonic), and each exponent is one fma (s * scale_log2 - mu) below.
      if (unmasked) {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
#pragma unroll
          for (int j = 0; j < PA_TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) mx[i][e >> 1] = fmaxf(mx[i][e >> 1], s[i][j][e]);
          }
        }
      } else {
#pragma unroll
        for (int i = 0; i < MT; ++i) {
#pragma unroll
          for (int j = 0; j < PA_TILE / 8; ++j) {
#pragma unroll
            for (int e = 0; e < 4; ++e) {
              const int kp = tile_start + j * 8 + 2 * t4 + (e & 1);
              const int p = qp0 + 16 * i + 8 * (e >> 1);
              const bool valid = kp <= p && kp < kv_hi && (window <= 0 || kp > p - window);
              s[i][j][e] = valid ? s[i][j][e] : NEG_INF;
              mx[i][e >> 1] = fmaxf(mx[i][e >> 1], s[i][j][e]);
            }
          }
        }
      }
#pragma unroll
      for (int i = 0; i < MT; ++i) {
        float alpha[2], mu[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          mx[i][r] = fmaxf(mx[i][r], __shfl_xor_sync(FULL_MASK, mx[i][r], 1));
          mx[i][r] = fmaxf(mx[i][r], __shfl_xor_sync(FULL_MASK, mx[i][r], 2));
          const float mn = fmaxf(m[i][r], mx[i][r] * scale_log2);  // (-inf * scale_log2 = -inf: a row with no key yet)
          mu[r] = mn == NEG_INF ? 0.f : mn;
          alpha[r] = exp2f(m[i][r] - mu[r]);
          m[i][r] = mn;
          l[i][r] *= alpha[r];
        }
#pragma unroll
        for (int j = 0; j < PA_TILE / 8; ++j) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[i][j][e] = exp2f(fmaf(s[i][j][e], scale_log2, -mu[e >> 1]));
            l[i][e >> 1] += s[i][j][e];
          }
        }
#pragma unroll
        for (int n = 0; n < D / 8; ++n) {
          o[i][n][0] *= alpha[0];
          o[i][n][1] *= alpha[0];
          o[i][n][2] *= alpha[1];
          o[i][n][3] *= alpha[1];
        }
      }
      // O += P V: each V fragment feeds the mmas of every m-tile before the next is loaded.
#pragma unroll
      for (int kt = 0; kt < PA_TILE / 16; ++kt) {
        u32 pa[MT][4];
#pragma unroll
        for (int i = 0; i < MT; ++i) {
          pa[i][0] = T::pack(s[i][2 * kt][0], s[i][2 * kt][1]);
          pa[i][1] = T::pack(s[i][2 * kt][2], s[i][2 * kt][3]);
          pa[i][2] = T::pack(s[i][2 * kt + 1][0], s[i][2 * kt + 1][1]);
          pa[i][3] = T::pack(s[i][2 * kt + 1][2], s[i][2 * kt + 1][3]);
        }
#pragma unroll
        for (int nn = 0; nn < D / 16; ++nn) {
          u32 vf[4];
          ldmatrix_x4_trans(vf, vb + (kt * 16 + ld_row) * LD + nn * 16 + ld_col);
#pragma unroll
          for (int i = 0; i < MT; ++i) {
            Mma<T>::run(o[i][2 * nn], pa[i], vf[0], vf[1]);
            Mma<T>::run(o[i][2 * nn + 1], pa[i], vf[2], vf[3]);
          }
        }
      }
    }
    __syncthreads();
  }
  cp_async_wait<0>();

#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      l[i][r] += __shfl_xor_sync(FULL_MASK, l[i][r], 1);
      l[i][r] += __shfl_xor_sync(FULL_MASK, l[i][r], 2);
    }
  }
  if (splits > 1) {  // this share's unnormalised output and row statistics, for the merge
#pragma unroll
    for (int i = 0; i < MT; ++i) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int row = wrow + 16 * i + g + 8 * r;
        if (row >= nrows) continue;
        const i64 at = ((i64)split * num_q + q_tok + row) * H + h;
        float* dst = part_o + at * D + 2 * t4;
#pragma unroll
        for (int n = 0; n < D / 8; ++n)
          *reinterpret_cast<float2*>(dst + n * 8) = make_float2(o[i][n][2 * r], o[i][n][2 * r + 1]);
        if (t4 == 0) *reinterpret_cast<float2*>(part_ml + at * 2) = make_float2(m[i][r], l[i][r]);
      }
    }
    return;
  }
  float inv[MT][2];
#pragma unroll
  for (int i = 0; i < MT; ++i) {
    inv[i][0] = l[i][0] > 0.f ? 1.f / l[i][0] : 0.f;
    inv[i][1] = l[i][1] > 0.f ? 1.f / l[i][1] : 0.f;
  }
#pragma unroll
  for (int i = 0; i < MT; ++i) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int row = wrow + 16 * i + g + 8 * r;
      if (row >= nrows) continue;
      u16* dst = out + ((i64)(q_tok + row) * H + h) * D + 2 * t4;
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        *reinterpret_cast<u32*>(dst + n * 8) = T::pack(o[i][n][2 * r] * inv[i][r], o[i][n][2 * r + 1] * inv[i][r]);
    }
  }
}

// The merge of key splits: out[t, h] = sum_z 2^(m_z - M) o_z / sum_z 2^(m_z - M) l_z, M = max_z m_z, for
// PA_MERGE_ROWS rows (blockIdx.z-th group) of work item blockIdx.x, head blockIdx.y: one thread a row first puts
// its shares' weights in shared memory, then every thread adds up column pairs (coalesced loads).
#define PA_MERGE_ROWS 16
#define PA_MAX_SPLITS 16
template <class T, int D>
__device__ __forceinline__ void prefill_attention_merge_impl(u16* __restrict__ out, const float* __restrict__ part_o,
                                                             const float* __restrict__ part_ml,
                                                             const int* __restrict__ work, int num_q, int H,
                                                             int splits) {
  __shared__ float weight[PA_MERGE_ROWS][PA_MAX_SPLITS];
  __shared__ float inv_sum[PA_MERGE_ROWS];
  const Vec16 item = reinterpret_cast<const Vec16*>(work)[blockIdx.x];
  const int q_tok = (int)item.w[1], nrows = (int)item.w[2];
  const int r0 = blockIdx.z * PA_MERGE_ROWS;
  if (r0 >= nrows) return;  // (the whole block returns together)
  const int rows = min(PA_MERGE_ROWS, nrows - r0);
  const int h = blockIdx.y;
  const i64 split_stride = (i64)num_q * H;
  if ((int)threadIdx.x < rows) {
    const i64 at = (i64)(q_tok + r0 + threadIdx.x) * H + h;
    float mx = NEG_INF;
    for (int z = 0; z < splits; ++z) mx = fmaxf(mx, part_ml[(z * split_stride + at) * 2]);
    float sum = 0.f;
    for (int z = 0; z < splits; ++z) {
      const float2 ml = *reinterpret_cast<const float2*>(part_ml + (z * split_stride + at) * 2);
      const float w = ml.x == NEG_INF ? 0.f : exp2f(ml.x - mx);  // a share with no key this row sees: 0
      weight[threadIdx.x][z] = w;
      sum += w * ml.y;
    }
    inv_sum[threadIdx.x] = sum > 0.f ? 1.f / sum : 0.f;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows * (D / 2); i += blockDim.x) {
    const int r = i / (D / 2), c = (i - r * (D / 2)) * 2;
    const i64 at = (i64)(q_tok + r0 + r) * H + h;
    float o0 = 0.f, o1 = 0.f;
#pragma unroll 4
    for (int z = 0; z < splits; ++z) {
      const float2 v = *reinterpret_cast<const float2*>(part_o + (z * split_stride + at) * D + c);
      o0 += weight[r][z] * v.x;
      o1 += weight[r][z] * v.y;
    }
    *reinterpret_cast<u32*>(out + at * D + c) = T::pack(o0 * inv_sum[r], o1 * inv_sum[r]);
  }
}

#define PREFILL_ENTRY1(NAME, T, D, KV, BOUNDS)                                                              \
  extern "C" __global__ void __launch_bounds__ BOUNDS NAME(                                                 \
      u16* out, const u16* q, const KV* k_cache, const KV* v_cache, const int* block_tables, const int* work, \
      i64 q_stride, int bt_stride, int H, int Hkv, int bs_log2, int window, float scale_log2, float* part_o,  \
      float* part_ml, int num_q) {                                                                          \
    prefill_attention_impl<T, D, KV>(out, q, k_cache, v_cache, block_tables, work, q_stride, bt_stride, H,   \
                                     Hkv, bs_log2, window, scale_log2, part_o, part_ml, num_q);             \
  }
// prefill_attention_*: a 16-bit cache; *_kvfp8: E4M3 (the merge does not read the cache: one per dtype and D).
#define PREFILL_ENTRY(SUFFIX, T, D, BOUNDS)                                                                 \
  PREFILL_ENTRY1(prefill_attention_##SUFFIX##_d##D, T, D, u16, BOUNDS)                                       \
  PREFILL_ENTRY1(prefill_attention_##SUFFIX##_d##D##_kvfp8, T, D, unsigned char, BOUNDS)                     \
  extern "C" __global__ void __launch_bounds__(PA_THREADS) prefill_attention_merge_##SUFFIX##_d##D(         \
      u16* out, const float* part_o, const float* part_ml, const int* work, int num_q, int H, int splits) {   \
    prefill_attention_merge_impl<T, D>(out, part_o, part_ml, work, num_q, H, splits);                       \
  }

#define PREFILL_ENTRIES(SUFFIX, T)            \
  PREFILL_ENTRY(SUFFIX, T, 16, PA_BOUNDS)      \
  PREFILL_ENTRY(SUFFIX, T, 32, PA_BOUNDS)      \
  PREFILL_ENTRY(SUFFIX, T, 64, PA_BOUNDS)      \
  PREFILL_ENTRY(SUFFIX, T, 80, PA_BOUNDS)      \
  PREFILL_ENTRY(SUFFIX, T, 96, PA_BOUNDS)      \
  PREFILL_ENTRY(SUFFIX, T, 128, PA_BOUNDS_D128)

PREFILL_ENTRIES(bf16, Bf16)
PREFILL_ENTRIES(fp16, Fp16)
