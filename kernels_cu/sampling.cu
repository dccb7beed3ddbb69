// Op: token sampling, one token per row of fp32 logits (reference: engine/sampling.py `sample`).
//
//   p = repetition-penalised logits (HF style: a seen token's logit is divided by the penalty if > 0,
//       multiplied otherwise; rows with penalty 1 are untouched)
//   greedy row (temperature == 0):  token = argmax(p)   (ties: the lowest index, as torch.argmax)
//   other rows:  x = p / temperature; keep = top-k then top-p (below); token = argmax over kept i of
//       x_i + gumbel(seed, position, i)   with the counter-based hash of engine/sampling.py (stream 0,
//       index = token id), bit-identical uniform draws.
//   logprob = log_softmax(raw logits)[token]
// Top-k / top-p without sorting: token i is kept iff
//   (top-k) the number of tokens with a larger x is < k, and
//   (top-p) the probability mass (softmax over the top-k set) of tokens with a larger x is < top_p,
// which equals the sorted formulation of `target_logprobs` (keep a sorted token iff the mass ranked
// before it is < top_p; the first is always kept) when values are distinct (tied values at the cutoff
// are all kept). Both cutoffs are found by a 3-level radix select (12 + 10 + 10 bits) over the
// order-preserving uint32 image of x, with histograms in shared memory; masses are fixed point
// (2^-40 units, integer atomics), so the result does not depend on the order of the atomics.
//
// Layouts: logits [N, V] fp32, seen [N, V] bool (1 byte; a row is read only where its penalty is not 1), temperature [N] f32, top_k [N] i64,
//   top_p [N] f32, seed [N] i64 (uint64 bits), penalty [N] f32, position [N] i64 — all contiguous.
//   parts [N, S, 8] fp32 scratch, 16-byte aligned (per row and vocab split: raw max, raw sum-exp, best p, its
//   index, best x+g, its index); thresholds [N] uint32 scratch; tokens [N] i64, logprobs [N] f32.
// Launch contract — four kernels, always all four, in this order on one stream (no host sync, no
// data-dependent shapes: rows decide on the device which stages apply to them):
//   sample_stats   grid (S, N), block 256: softmax stats, greedy argmax, and the Gumbel argmax of
//                  unfiltered rows, per vocab split [s * ceil(V/S), ...).
//   sample_select  grid (N), block 1024: the top-k / top-p threshold of filtered rows (0 otherwise).
//   sample_draw    grid (S, N), block 256: the Gumbel argmax of filtered rows over kept tokens.
//   sample_finish  grid (N), block 32: merge the splits; write tokens and logprobs.
// The top-logprob candidates (when a step asks for k of them, 1 <= k <= TOPK_MAX), after those four:
//   sample_topk_split  grid (ceil(V / TOPK_CHUNK), N), block 256: the k largest raw logits of each chunk
//                      of TOPK_CHUNK tokens, as sort keys in order, into cand [N, ceil(V / TOPK_CHUNK), k] u64.
//   sample_topk_merge  grid (N), block 32, dynamic shared memory ceil(V / TOPK_CHUNK) * (8 k + 4) bytes:
//                      the k largest of a row's candidates, in order, to
//                      top_ids [N, k] i64 and top_logprobs [N, k] f32 = logit - logsumexp(raw logits)
//                      (the softmax stats in parts, merged as sample_finish does: the same logprob
//                      sample_finish gives the token it picks).
//   Order: larger logit first, then the lower token id (ties), NaN first (as torch.topk). A sort key is
//   float_key(logit) << 32 | ~id, so one descending u64 order is all of it. A lane sorts its 4 keys; a warp
//   merges its lanes' sorted lists, k rounds of a warp maximum over the lists' heads (warp_merge_lists);
//   a split block merges its 8 warps' lists, and the merge block all the chunks' (a first version sorted
//   whole chunks bitonically in shared memory: several times slower).
//   Reference: torch.topk(torch.log_softmax(logits), k), what CudaOps.sample ran before these kernels
//   (several times slower on a 128k vocabulary).
// Programmatic dependent launch (the launch attribute; a no-op without it): each kernel waits at its top
// (common.cuh, grid_dependency_wait); its launch overlaps the end of the one before. sample_stats, _select,
// _draw and _finish read their row's parameters (temperature, top_k, top_p, seed, penalty, position) before
// the wait, so the kernel launched just before one of them must not write those (in a step they come from
// decode_prepare or the host, several launches earlier); everything else is read after it.
// Built WITHOUT --use_fast_math: divisions, expf and logf must be the accurate ones.
#include "common.cuh"

#define SELECT_THREADS 1024
#define PART_STRIDE 8

__device__ __forceinline__ float penalize(float l, unsigned char seen, float pen) {
  if (seen && pen != 1.f) return l > 0.f ? l / pen : l * pen;
  return l;
}

// Order-preserving image of a float in uint32 (larger float -> larger key).
__device__ __forceinline__ u32 float_key(float f) {
  const u32 u = __float_as_uint(f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// Elements per thread per loop trip: their loads are issued together, so the latency of a trip is
// paid once for ILP elements (the passes below are latency-bound, not bandwidth-bound).
#define ILP 4

struct RowParams {
  float temperature, penalty, top_p;
  i64 top_k;
  u64 seed;
  i64 position;
  bool filtered;  // temperature > 0 and (0 < top_k < V or top_p < 1)

  __device__ __forceinline__ RowParams(int row, int V, const float* temperature_, const i64* top_k_,
                                       const float* top_p_, const i64* seed_, const float* penalty_,
                                       const i64* position_) {
    temperature = temperature_[row];
    penalty = penalty_[row];
    top_p = top_p_[row];
    top_k = top_k_[row];
    seed = (u64)seed_[row];
    position = position_[row];
    filtered = temperature != 0.f && ((top_k > 0 && top_k < V) || top_p < 1.f);
  }
};

// Block-wide reductions for 256- or 1024-thread blocks (scratch: 32 entries).
__device__ __forceinline__ ArgMax block_argmax(ArgMax a, float* sv, int* si) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  a = warp_argmax(a);
  __syncthreads();
  if (lane == 0) {
    sv[warp] = a.v;
    si[warp] = a.i;
  }
  __syncthreads();
  if (warp == 0) {
    a = lane < nw ? ArgMax{sv[lane], si[lane]} : argmax_init();
    a = warp_argmax(a);
  }
  return a;  // valid in warp 0
}

#define PARTS_ARGS                                                                                       \
  const float *logits, const unsigned char *seen, const float *temperature, const i64 *top_k,              \
      const float *top_p, const i64 *seed, const float *penalty, const i64 *position, int V, int num_splits

extern "C" __global__ void __launch_bounds__(256) sample_stats(float* parts, PARTS_ARGS) {
  __shared__ float sv[32], sv2[32];
  __shared__ int si[32];
  const int row = blockIdx.y, split = blockIdx.x;
  const RowParams rp(row, V, temperature, top_k, top_p, seed, penalty, position);
  wait_then_allow_dependents();
  const bool draw_here = rp.temperature != 0.f && !rp.filtered;
  // V % 4 == 0 (every row 16-byte aligned, given an aligned base): 16-byte logit and 4-byte seen loads,
  // splits of a multiple of 4 tokens, so a block's share is one trip of ILP vectors a thread far more
  // often (32 rows of a 128k vocabulary: one trip instead of four).
  const bool vec = (V & 3) == 0 && (reinterpret_cast<unsigned long long>(logits) & 15) == 0 &&
                   (reinterpret_cast<unsigned long long>(seen) & 3) == 0;
  int chunk = (V + num_splits - 1) / num_splits;
  if (vec) chunk = (chunk + 3) & ~3;
  const int start = split * chunk, end = min(V, start + chunk);
  const float* lg = logits + (i64)row * V;
  const unsigned char* sn = seen + (i64)row * V;

  // Per thread: the softmax statistics of its values one loop trip (4 * ILP or ILP values) at a time (the
  // trip's max, one rescale of the running sum, then the exps: no data-dependent branch per value), and
  // the argmaxes of its values, whose indices only grow (so a strictly larger value is the only better
  // one). The kernel is instruction-bound at batch 32 (ncu: far from the DRAM bandwidth), so the work per
  // value is what its time is.
  SoftmaxStat st{NEG_INF, 0.f};
  ArgMax best_p = argmax_init(), best_g = argmax_init();
  const bool penalized = rp.penalty != 1.f;
  auto trip_softmax = [&](const float* x, int n) {  // x: n values, NEG_INF where past the split's end
    float tmax = x[0];
#pragma unroll
    for (int e = 1; e < n; ++e) tmax = fmaxf(tmax, x[e]);
    if (tmax > st.m) {
      st.s = st.m == NEG_INF ? 0.f : st.s * expf(st.m - tmax);
      st.m = tmax;
    }
    if (st.m == NEG_INF) return;
#pragma unroll
    for (int e = 0; e < n; ++e) st.s += expf(x[e] - st.m);
  };
  auto pick = [&](float l, unsigned char seen_i, int i) {  // i: ascending within the thread
    const float p = penalized ? penalize(l, seen_i, rp.penalty) : l;
    if (best_p.i < 0 || p > best_p.v) best_p = ArgMax{p, i};
    if (draw_here) {
      const float g = p / rp.temperature + gumbel_noise(rp.seed, rp.position, (u32)i);
      if (best_g.i < 0 || g > best_g.v) best_g = ArgMax{g, i};
    }
  };
  if (vec) {
    const float4* lg4 = reinterpret_cast<const float4*>(lg);
    const u32* sn4 = reinterpret_cast<const u32*>(sn);
    const int vend = end >> 2;  // start and end are multiples of 4
    for (int base = (start >> 2) + threadIdx.x; base < vend; base += ILP * blockDim.x) {
      float4 l[ILP];
      u32 seen_u[ILP];
#pragma unroll
      for (int u = 0; u < ILP; ++u) {
        const int j = base + u * blockDim.x;
        l[u] = j < vend ? lg4[j] : make_float4(NEG_INF, NEG_INF, NEG_INF, NEG_INF);
        seen_u[u] = penalized && j < vend ? sn4[j] : 0u;
      }
      trip_softmax(reinterpret_cast<const float*>(l), 4 * ILP);
#pragma unroll
      for (int u = 0; u < ILP; ++u) {
        const int j = base + u * blockDim.x;
        if (j >= vend) break;
        pick(l[u].x, seen_u[u] & 0xffu, 4 * j);
        pick(l[u].y, (seen_u[u] >> 8) & 0xffu, 4 * j + 1);
        pick(l[u].z, (seen_u[u] >> 16) & 0xffu, 4 * j + 2);
        pick(l[u].w, seen_u[u] >> 24, 4 * j + 3);
      }
    }
  } else {
    for (int base = start + threadIdx.x; base < end; base += ILP * blockDim.x) {
      float l[ILP];
      unsigned char seen_u[ILP];
#pragma unroll
      for (int u = 0; u < ILP; ++u) {
        const int i = base + u * blockDim.x;
        l[u] = i < end ? lg[i] : NEG_INF;
        seen_u[u] = penalized && i < end ? sn[i] : 0;
      }
      trip_softmax(l, ILP);
#pragma unroll
      for (int u = 0; u < ILP; ++u) {
        const int i = base + u * blockDim.x;
        if (i >= end) break;
        pick(l[u], seen_u[u], i);
      }
    }
  }

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  st = warp_softmax(st);
  if (lane == 0) {
    sv[warp] = st.m;
    sv2[warp] = st.s;
  }
  __syncthreads();
  if (warp == 0) {
    st = lane < nw ? SoftmaxStat{sv[lane], sv2[lane]} : SoftmaxStat{NEG_INF, 0.f};
    st = warp_softmax(st);
  }
  best_p = block_argmax(best_p, sv, si);
  const ArgMax bp = best_p;
  best_g = block_argmax(best_g, sv, si);
  if (threadIdx.x == 0) {
    float* out = parts + ((i64)row * num_splits + split) * PART_STRIDE;
    out[0] = st.m;
    out[1] = st.s;
    out[2] = bp.v;
    out[3] = __int_as_float(bp.i);
    out[4] = best_g.v;
    out[5] = __int_as_float(best_g.i);
  }
}

// Sum of x over the lanes of `peers` (lanes with the same histogram bin), valid at the lowest lane
// of the group. mask: the lanes taking part (all of them call this together).
__device__ __forceinline__ u64 reduce_peers(u32 mask, u32 peers, u64 x) {
  const int lane = threadIdx.x & 31;
  int rel = __popc(peers & ((1u << lane) - 1u));
  peers &= (0xfffffffeu << lane);
  while (__any_sync(mask, peers != 0)) {
    const int next = __ffs(peers);
    const u64 t = __shfl_sync(mask, x, next ? next - 1 : lane);
    if (next) x += t;
    peers &= ~__ballot_sync(mask, rel & 1);
    rel >>= 1;
  }
  return x;
}

// Radix select of the threshold key v* = min{v : W(key > v) < t}, where W sums per-token weights
// (1 per token for top-k; fixed-point exp(x - x_max) over keys >= min_key for top-p, in which case
// t = top_p * the total weight, found at level 0). Returns v*: keep token i iff key_i >= v*.
template <bool MASS>
__device__ u32 radix_select(u64* hist, u64* scratch, const float* lg, const unsigned char* sn, int V,
                            float pen, float temp, float x_max, u32 min_key, double t_arg) {
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, nw = blockDim.x >> 5;
  __shared__ u32 sel_bin;
  __shared__ u64 sel_above;
  __shared__ double sel_t;
  u32 prefix = 0;
  u64 above = 0;
  double t = t_arg;
#pragma unroll 1
  for (int level = 0; level < 3; ++level) {
    const int bits = level == 0 ? 12 : 10;
    const int shift = level == 0 ? 20 : (level == 1 ? 10 : 0);
    const int nb = 1 << bits;
    for (int i = tid; i < nb; i += blockDim.x) hist[i] = 0;
    if (tid == 0) {
      sel_bin = 0u;
      sel_above = above;
    }
    __syncthreads();
    for (int base = tid; base - tid < V; base += ILP * blockDim.x) {  // the same trip count in every thread
      float l[ILP];
      unsigned char seen_u[ILP];
#pragma unroll
      for (int u = 0; u < ILP; ++u) {
        const int i = base + u * blockDim.x;
        l[u] = i < V ? lg[i] : 0.f;
        seen_u[u] = pen != 1.f && i < V ? sn[i] : 0;
      }
#pragma unroll
      for (int u = 0; u < ILP; ++u) {
        const int i = base + u * blockDim.x;
        bool contrib = false;
        u32 bin = 0;
        u64 w = 1;
        if (i < V) {
          const float x = penalize(l[u], seen_u[u], pen) / temp;
          const u32 key = float_key(x);
          contrib = level == 0 || (key >> (shift + bits)) == prefix;
          if (MASS) {
            w = key >= min_key ? __double2ull_rn((double)expf(x - x_max) * 1099511627776.0) : 0ull;
            contrib = contrib && w != 0ull;
          }
          bin = (key >> shift) & (u32)(nb - 1);
        }
        const u32 mask = __ballot_sync(FULL_MASK, contrib);
        if (contrib) {
          const u32 peers = __match_any_sync(mask, bin);
          const u64 sum = MASS ? reduce_peers(mask, peers, w) : (u64)__popc(peers);
          if (lane == __ffs(peers) - 1) atomicAdd(&hist[bin], sum);
        }
      }
    }
    __syncthreads();

    // Suffix sums: each thread owns nb / blockDim consecutive bins.
    const int per = nb / blockDim.x;
    const int lo_bin = tid * per;
    u64 local = 0;
    for (int d = 0; d < per; ++d) local += hist[lo_bin + d];
    u64 incl = local;  // sum over lanes >= lane
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u64 v = __shfl_down_sync(FULL_MASK, incl, o);
      if (lane + o < 32) incl += v;
    }
    if (lane == 0) scratch[warp] = incl;
    __syncthreads();
    if (MASS && level == 0) {
      if (tid == 0) {
        u64 z = 0;
        for (int w2 = 0; w2 < nw; ++w2) z += scratch[w2];
        sel_t = t_arg * (double)z;
      }
      __syncthreads();
      t = sel_t;
    }
    u64 s = above + (incl - local);
    for (int w2 = warp + 1; w2 < nw; ++w2) s += scratch[w2];
    for (int d = lo_bin + per - 1; d >= lo_bin; --d) {
      const u64 h = hist[d];
      if ((double)s < t && ((double)(s + h) >= t || d == 0)) {
        sel_bin = (u32)d;
        sel_above = s;
      }
      s += h;
    }
    __syncthreads();
    prefix = (prefix << bits) | sel_bin;
    above = sel_above;
    __syncthreads();
  }
  return prefix;
}

extern "C" __global__ void __launch_bounds__(SELECT_THREADS)
    sample_select(u32* thresholds, const float* parts, PARTS_ARGS) {
  __shared__ u64 hist[4096];
  __shared__ u64 scratch[32];
  const int row = blockIdx.x;
  const RowParams rp(row, V, temperature, top_k, top_p, seed, penalty, position);
  wait_then_allow_dependents();
  if (!rp.filtered) {
    if (threadIdx.x == 0) thresholds[row] = 0u;
    return;
  }
  float p_max = NEG_INF;
  for (int s = 0; s < num_splits; ++s) p_max = fmaxf(p_max, parts[((i64)row * num_splits + s) * PART_STRIDE + 2]);
  const float x_max = p_max / rp.temperature;  // division by a positive number is monotone: max commutes
  const float* lg = logits + (i64)row * V;
  const unsigned char* sn = seen + (i64)row * V;
  u32 keep = 0u;
  if (rp.top_k > 0 && rp.top_k < V)
    keep = radix_select<false>(hist, scratch, lg, sn, V, rp.penalty, rp.temperature, x_max, 0u, (double)rp.top_k);
  if (rp.top_p < 1.f) {
    // top_p <= 0 (refused by SamplingParams.validate) keeps the top token only, as the reference.
    const double top_p = rp.top_p > 0.f ? (double)rp.top_p : 1e-30;
    const u32 kp = radix_select<true>(hist, scratch, lg, sn, V, rp.penalty, rp.temperature, x_max, keep, top_p);
    keep = max(keep, kp);
  }
  if (threadIdx.x == 0) thresholds[row] = keep;
}

extern "C" __global__ void __launch_bounds__(256)
    sample_draw(float* parts, const u32* thresholds, PARTS_ARGS) {
  __shared__ float sv[32];
  __shared__ int si[32];
  const int row = blockIdx.y, split = blockIdx.x;
  const RowParams rp(row, V, temperature, top_k, top_p, seed, penalty, position);
  wait_then_allow_dependents();
  if (!rp.filtered) return;
  const u32 keep = thresholds[row];
  const int chunk = (V + num_splits - 1) / num_splits;
  const int start = split * chunk, end = min(V, start + chunk);
  const float* lg = logits + (i64)row * V;
  const unsigned char* sn = seen + (i64)row * V;
  ArgMax best = argmax_init();
  for (int base = start + threadIdx.x; base < end; base += ILP * blockDim.x) {
    float l[ILP];
    unsigned char seen_u[ILP];
#pragma unroll
    for (int u = 0; u < ILP; ++u) {
      const int i = base + u * blockDim.x;
      l[u] = i < end ? lg[i] : 0.f;
      seen_u[u] = rp.penalty != 1.f && i < end ? sn[i] : 0;
    }
#pragma unroll
    for (int u = 0; u < ILP; ++u) {
      const int i = base + u * blockDim.x;
      if (i >= end) break;
      const float x = penalize(l[u], seen_u[u], rp.penalty) / rp.temperature;
      if (float_key(x) >= keep) argmax_merge(best, x + gumbel_noise(rp.seed, rp.position, (u32)i), i);
    }
  }
  best = block_argmax(best, sv, si);
  if (threadIdx.x == 0) {
    float* out = parts + ((i64)row * num_splits + split) * PART_STRIDE;
    out[4] = best.v;
    out[5] = __int_as_float(best.i);
  }
}

extern "C" __global__ void sample_finish(i64* tokens, float* logprobs, const float* parts, const float* logits,
                                         const float* temperature, int V, int num_splits) {
  const int row = blockIdx.x, lane = threadIdx.x;
  const float temp = temperature[row];
  wait_then_allow_dependents();
  SoftmaxStat st{NEG_INF, 0.f};
  ArgMax bp = argmax_init(), bg = argmax_init();
  // A lane merges splits lane, lane + 32, ... in that order; it loads FINISH_LOADS of them (two 16-byte loads
  // each: parts rows are 32 bytes) before merging any, so a row of <= 32 FINISH_LOADS splits costs one round
  // trip to L2 rather than one per 32 splits (126 splits at batch 1: 4 -> 1).
  constexpr int FINISH_LOADS = 8;
  for (int s0 = lane; s0 < num_splits; s0 += 32 * FINISH_LOADS) {
    float4 a[FINISH_LOADS], b[FINISH_LOADS];
#pragma unroll
    for (int u = 0; u < FINISH_LOADS; ++u) {
      const int s = s0 + 32 * u;
      if (s < num_splits) {
        const float4* p = reinterpret_cast<const float4*>(parts + ((i64)row * num_splits + s) * PART_STRIDE);
        a[u] = p[0];
        b[u] = p[1];
      }
    }
#pragma unroll
    for (int u = 0; u < FINISH_LOADS; ++u) {
      if (s0 + 32 * u >= num_splits) break;
      st = softmax_merge(st, SoftmaxStat{a[u].x, a[u].y});
      argmax_merge(bp, a[u].z, __float_as_int(a[u].w));
      argmax_merge(bg, b[u].x, __float_as_int(b[u].y));
    }
  }
  st = warp_softmax(st);
  bp = warp_argmax(bp);
  bg = warp_argmax(bg);
  if (lane == 0) {
    int tok = temp == 0.f ? bp.i : bg.i;
    if (tok < 0) tok = bp.i < 0 ? 0 : bp.i;  // no finite candidate (e.g. NaN logits)
    tokens[row] = tok;
    logprobs[row] = logits[(i64)row * V + tok] - st.m - logf(st.s);
  }
}

// ---------------------------------------------------------------------------------------------------
// Top-logprob candidates. Keys are unique (the token id is in the low bits), so a maximum is held by
// exactly one list.
#define TOPK_CHUNK 1024  // tokens of a sample_topk_split block: 8 warps x 32 lanes x 4
#define TOPK_MAX 32

__device__ __forceinline__ u64 topk_key(float v, int i) { return ((u64)float_key(v) << 32) | (u32)~(u32)i; }

__device__ __forceinline__ void swap_desc(u64& a, u64& b) {
  if (a < b) {
    const u64 t = a;
    a = b;
    b = t;
  }
}

// One warp: the k largest keys of `lists` lists sorted in descending order, `len` keys each, at
// keys[l * len + j]; out[r] (written by lane 0) = the r-th largest, r < k (0 where there are fewer).
// Each round the lanes' best list heads meet in a warp maximum and the winning list moves on.
// cur: `lists` ints of scratch (the lists' cursors).
__device__ __forceinline__ void warp_merge_lists(const u64* keys, int lists, int len, int k, u64* out, int* cur) {
  const int lane = threadIdx.x & 31;
  u64 best = 0ull;
  int best_l = -1;
  for (int l = lane; l < lists; l += 32) {
    cur[l] = 0;
    const u64 h = keys[l * len];
    if (h > best) {
      best = h;
      best_l = l;
    }
  }
  __syncwarp();
  for (int r = 0; r < k; ++r) {
    u64 m = best;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const u64 other = __shfl_xor_sync(FULL_MASK, m, o);
      m = other > m ? other : m;
    }
    if (lane == 0) out[r] = m;
    if (m != 0ull && best == m) {  // this lane's list held it: advance that list, find the lane's new best
      cur[best_l] += 1;
      best = 0ull;
      best_l = -1;
      for (int l = lane; l < lists; l += 32) {
        const int c = cur[l];
        const u64 h = c < len ? keys[l * len + c] : 0ull;
        if (h > best) {
          best = h;
          best_l = l;
        }
      }
    }
    __syncwarp();
  }
}

extern "C" __global__ void __launch_bounds__(256) sample_topk_split(u64* cand, const float* logits, int V, int k) {
  wait_then_allow_dependents();
  __shared__ u64 keys[TOPK_CHUNK];  // 32 sorted lists of 4 per warp
  __shared__ u64 warp_top[8 * TOPK_MAX];
  __shared__ int cur[256];
  const int chunk = blockIdx.x, row = blockIdx.y, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const float* x = logits + (i64)row * V;
  const int base = chunk * TOPK_CHUNK + warp * 128 + lane;
  u64 a[4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int i = base + 32 * j;  // coalesced; 0: below every real key (float_key(-inf) << 32 > 0)
    a[j] = i < V ? topk_key(x[i], i) : 0ull;
  }
  swap_desc(a[0], a[1]);
  swap_desc(a[2], a[3]);
  swap_desc(a[0], a[2]);
  swap_desc(a[1], a[3]);
  swap_desc(a[1], a[2]);
#pragma unroll
  for (int j = 0; j < 4; ++j) keys[threadIdx.x * 4 + j] = a[j];
  __syncwarp();
  warp_merge_lists(keys + warp * 128, 32, 4, k, warp_top + warp * k, cur + warp * 32);
  __syncthreads();
  if (warp == 0) {
    u64* out = cand + ((i64)row * gridDim.x + chunk) * k;
    warp_merge_lists(warp_top, 8, k, k, keys, cur);  // keys: free again
    __syncwarp();
    for (int j = lane; j < k; j += 32) out[j] = keys[j];
  }
}

// Dynamic shared memory: num_chunks * k * 8 bytes of candidates, then num_chunks ints of cursors.
extern "C" __global__ void __launch_bounds__(32) sample_topk_merge(i64* top_ids, float* top_logprobs,
                                                                   const u64* cand, const float* parts,
                                                                   const float* logits, int V, int num_splits,
                                                                   int num_chunks, int k) {
  wait_then_allow_dependents();
  extern __shared__ u64 smem_keys[];
  __shared__ u64 top[TOPK_MAX];
  int* cur = reinterpret_cast<int*>(smem_keys + (i64)num_chunks * k);
  const int row = blockIdx.x, lane = threadIdx.x;
  const u64* c = cand + (i64)row * num_chunks * k;
  for (int j = lane; j < num_chunks * k; j += 32) smem_keys[j] = c[j];
  SoftmaxStat st{NEG_INF, 0.f};  // the row's softmax stats, merged as sample_finish merges them
  for (int s = lane; s < num_splits; s += 32) {
    const float* p = parts + ((i64)row * num_splits + s) * PART_STRIDE;
    st = softmax_merge(st, SoftmaxStat{p[0], p[1]});
  }
  st = warp_softmax(st);
  __syncwarp();
  warp_merge_lists(smem_keys, num_chunks, k, k, top, cur);
  __syncwarp();
  const float* x = logits + (i64)row * V;
  for (int j = lane; j < k; j += 32) {
    const int i = (int)~(u32)top[j];
    top_ids[(i64)row * k + j] = i;
    top_logprobs[(i64)row * k + j] = x[i] - st.m - logf(st.s);
  }
}
