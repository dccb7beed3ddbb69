// Op: speculative acceptance for B sequences with K drafts each (reference: engine/sampling.py
// `accept_drafts`, one sequence at a time; this is its batched, sync-free form).
//
//   p_i = exp(target_logp[b, i]);  q_i = draft_probs[b, i] (or one-hot at the draft when absent)
//   draft i is accepted iff u_i * q_i(x_i) < p_i(x_i) and p_i(x_i) > 0,
//       u_i = uniform(seed[b, i], position[b, i], stream 1, index 0)
//   j = the first rejected draft (K when all are accepted) -> num_accepted[b] = j
//   j < K:  token = argmax_t log(r_t) + gumbel(seed[b, j], position[b, j], t),  r = max(p_j - q_j, 0)
//           (r = p_j when r sums to 0, exactly as the reference)
//   j == K: token = argmax_t target_logp[b, K, t] + gumbel(seed[b, K], position[b, K], t)   (bonus)
// The hash is engine/sampling.py's (bit-identical uniforms); logs and exps are the accurate ones.
//
// Layouts: target_logp [B, K + 1, V] fp32; draft_ids [B, K] i64; draft_probs [B, K, V] fp32 or null;
//   seed, position [B, K + 1] i64 (row i decides the token at position[b, i]); parts [B, S, 8] fp32
//   scratch; num_accepted [B] i64, tokens [B] i64. All contiguous.
// Launch contract: spec_accept_draw grid (S, B), block 256 (every block recomputes j, then draws over
//   its vocab split [s * ceil(V/S), ...)); then spec_accept_finish grid (B), block 32. K >= 1.
// Programmatic dependent launch (the launch attribute): both kernels wait at their top, as sampling.cu's.
// Built WITHOUT --use_fast_math.
#include "common.cuh"

#define PART_STRIDE 8

extern "C" __global__ void __launch_bounds__(256)
    spec_accept_draw(float* parts, const float* target_logp, const i64* draft_ids, const float* draft_probs,
                     const i64* seed, const i64* position, int K, int V, int num_splits) {
  wait_then_allow_dependents();
  __shared__ int j_s;
  __shared__ float sv[32];
  __shared__ int si[32];
  const int b = blockIdx.y, split = blockIdx.x;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const float* tl = target_logp + (i64)b * (K + 1) * V;
  const float* dp = draft_probs ? draft_probs + (i64)b * K * V : nullptr;

  if (warp == 0) {
    int j = K;
    for (int base = 0; base < K; base += 32) {
      const int i = base + lane;
      bool rejected = false;
      if (i < K) {
        const i64 x = draft_ids[(i64)b * K + i];
        float px = 0.f, qx = 1.f;
        if (x >= 0 && x < V) {
          px = expf(tl[(i64)i * V + x]);
          if (dp) qx = dp[(i64)i * V + x];
        }
        const i64 row = (i64)b * (K + 1) + i;
        const float u = uniform01((u64)seed[row], position[row], STREAM_ACCEPT, 0u);
        rejected = !(u * qx < px && px > 0.f);
      }
      const u32 ballot = __ballot_sync(FULL_MASK, rejected);
      if (ballot) {
        j = base + __ffs(ballot) - 1;
        break;
      }
    }
    if (lane == 0) j_s = j;
  }
  __syncthreads();
  const int j = j_s;
  const i64 row = (i64)b * (K + 1) + j;
  const u64 sd = (u64)seed[row];
  const i64 pos = position[row];
  const i64 draft_j = j < K ? draft_ids[(i64)b * K + j] : -1;
  const float* tj = tl + (i64)j * V;
  const float* qj = (dp && j < K) ? dp + (i64)j * V : nullptr;

  const int chunk = (V + num_splits - 1) / num_splits;
  const int start = split * chunk, end = min(V, start + chunk);
  ArgMax best_r = argmax_init(), best_p = argmax_init();
  int any_positive = 0;
  for (int base = start + threadIdx.x; base < end; base += 4 * blockDim.x) {
    float tv[4], qv[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {  // loads first: four in flight per thread
      const int t = base + u * blockDim.x;
      tv[u] = t < end ? tj[t] : 0.f;
      qv[u] = t < end ? (qj ? qj[t] : (t == draft_j ? 1.f : 0.f)) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int t = base + u * blockDim.x;
      if (t >= end) break;
      const float g = gumbel_noise(sd, pos, (u32)t);
      if (j < K) {
        const float pt = expf(tv[u]);
        float r = pt - qv[u];
        r = r > 0.f ? r : 0.f;
        any_positive |= r > 0.f;
        argmax_merge(best_r, logf(r) + g, t);
        argmax_merge(best_p, logf(pt) + g, t);
      } else {
        argmax_merge(best_r, tv[u] + g, t);
      }
    }
  }
  any_positive = __syncthreads_or(any_positive);

  best_r = warp_argmax(best_r);
  best_p = warp_argmax(best_p);
  __shared__ float sv2[32];
  __shared__ int si2[32];
  if (lane == 0) {
    sv[warp] = best_r.v;
    si[warp] = best_r.i;
    sv2[warp] = best_p.v;
    si2[warp] = best_p.i;
  }
  __syncthreads();
  if (warp == 0) {
    best_r = lane < nw ? ArgMax{sv[lane], si[lane]} : argmax_init();
    best_p = lane < nw ? ArgMax{sv2[lane], si2[lane]} : argmax_init();
    best_r = warp_argmax(best_r);
    best_p = warp_argmax(best_p);
    if (lane == 0) {
      float* out = parts + ((i64)b * num_splits + split) * PART_STRIDE;
      out[0] = best_r.v;
      out[1] = __int_as_float(best_r.i);
      out[2] = best_p.v;
      out[3] = __int_as_float(best_p.i);
      out[4] = __int_as_float(any_positive);
      out[5] = __int_as_float(j);
    }
  }
}

extern "C" __global__ void spec_accept_finish(i64* num_accepted, i64* tokens, const float* parts, int K,
                                              int num_splits) {
  wait_then_allow_dependents();
  const int b = blockIdx.x, lane = threadIdx.x;
  ArgMax best_r = argmax_init(), best_p = argmax_init();
  int any_positive = 0;
  for (int s = lane; s < num_splits; s += 32) {
    const float* p = parts + ((i64)b * num_splits + s) * PART_STRIDE;
    argmax_merge(best_r, p[0], __float_as_int(p[1]));
    argmax_merge(best_p, p[2], __float_as_int(p[3]));
    any_positive |= __float_as_int(p[4]);
  }
  best_r = warp_argmax(best_r);
  best_p = warp_argmax(best_p);
  any_positive = __any_sync(FULL_MASK, any_positive);
  if (lane == 0) {
    const int j = __float_as_int(parts[(i64)b * num_splits * PART_STRIDE + 5]);
    const ArgMax& best = (j < K && !any_positive) ? best_p : best_r;
    num_accepted[b] = j;
    tokens[b] = best.i < 0 ? 0 : best.i;
  }
}
