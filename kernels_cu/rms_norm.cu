// Op: RMSNorm (transformers' LlamaRMSNorm numerics), alone or after the residual add of a split-K GEMM.
//
//   rms_norm:      out = weight * to_dtype(x * rsqrt(mean(x^2) + eps))           (fp32 inside)
//   residual_norm: h = to_dtype(h + sum_s parts[s]); then, when weight is not null, out = rms_norm(h)
// Both roundings of the torch reference are reproduced (the normalised value is rounded to the
// activation dtype before the weight multiply), so results match engine/ops/torch_ops.py closely.
// residual_norm ends a linear layer h += x @ W^T whose GEMM ran as S partial products over slices of
// K (fp32, one bmm): the partials are summed in order s = 0..S-1, then h added, then one rounding
// (the GEMM-with-beta rounding of TorchOps.linear_add); the next op's rms_norm comes with it, so a
// decode layer has no separate norm launch (CudaOps.linear_add).
//
// Layouts:
//   rms_norm: x is read as rows of D contiguous elements, row r = (outer o, inner i) with
//     r = o * num_inner + i at element offset o * stride_outer + i * stride_inner. This covers
//     [T, hidden] (num_inner = 1) and Qwen3's per-head q/k norm on [T, heads, head_dim] views of the
//     fused QKV output (token stride = the QKV row). out is contiguous [num_rows, D].
//   weight [D]; every tensor bf16 (…_bf16) or fp16 (…_fp16).
//   residual_norm: h [num_rows, D] contiguous (read and written), parts [S, num_rows, D] fp32 contiguous,
//     out [num_rows, D] contiguous or null (with weight null). At most 512 threads per block.
// Launch contract (both):
//   block (TPR, RPB): TPR threads per row (a power of two, 1..1024), RPB rows per block,
//   TPR * RPB a multiple of 32 and RPB == 1 whenever TPR > 32; each thread holds at most 4 vectors
//   of 8 elements, so D / 8 <= 4 * TPR. grid (ceil(num_rows / RPB)). No dynamic shared memory.
//   D % 8 == 0; every pointer and row offset 16-byte aligned.
#include "common.cuh"

#define MAX_VEC 4

// The sum over a row's tpr threads (blockDim.x = tpr; one row per block when tpr > 32), in every thread.
__device__ __forceinline__ float row_sum(float v, int tpr) {
  __shared__ float red[32];
  if (tpr <= 32) {
    for (int o = tpr >> 1; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
    return v;
  }
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  v = warp_sum(v);
  if (lane == 0) red[warp] = v;
  __syncthreads();
  if (warp == 0) {
    float s = lane < (tpr >> 5) ? red[lane] : 0.f;
    s = warp_sum(s);
    if (lane == 0) red[0] = s;
  }
  __syncthreads();
  return red[0];
}

// out[idx] = weight * to_dtype(v * rstd) for the vectors idx = threadIdx.x + j * tpr of a row that this thread
// holds (v: the row's values in fp32, wv: the same vectors of the weight, loaded before the reduction so
// that the stores need no further memory round trip).
template <class T>
__device__ __forceinline__ void store_normed(u16* __restrict__ out_row, const float (&v)[MAX_VEC][8],
                                             const Vec16 (&wv)[MAX_VEC], float rstd, int tpr, int num_vec,
                                             bool active) {
#pragma unroll
  for (int j = 0; j < MAX_VEC; ++j) {
    const int idx = threadIdx.x + j * tpr;
    if (active && idx < num_vec) {
      float w[8], o[8];
      unpack8<T>(wv[j], w);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = w[e] * round_to<T>(v[j][e] * rstd);
      reinterpret_cast<Vec16*>(out_row)[idx] = pack8<T>(o);
    }
  }
}

template <class T>
__device__ __forceinline__ void rms_norm_impl(u16* __restrict__ out, const u16* __restrict__ x,
                                              const u16* __restrict__ weight, int num_rows, int num_inner,
                                              i64 stride_outer, i64 stride_inner, int D, float eps) {
  const int tpr = blockDim.x;
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool active = row < num_rows;
  const int num_vec = D >> 3;
  i64 in_off = 0;
  if (active) {
    const int o = row / num_inner;
    const int i = row - o * num_inner;
    in_off = (i64)o * stride_outer + (i64)i * stride_inner;
  }
  const i64 out_off = (i64)row * D;

  float v[MAX_VEC][8];
  Vec16 wv[MAX_VEC];
  float sumsq = 0.f;
#pragma unroll
  for (int j = 0; j < MAX_VEC; ++j) {
    const int idx = threadIdx.x + j * tpr;
    if (active && idx < num_vec) {
      wv[j] = reinterpret_cast<const Vec16*>(weight)[idx];
      Vec16 raw = reinterpret_cast<const Vec16*>(x + in_off)[idx];
      unpack8<T>(raw, v[j]);
#pragma unroll
      for (int e = 0; e < 8; ++e) sumsq += v[j][e] * v[j][e];
    }
  }

  const float rstd = rsqrtf(row_sum(sumsq, tpr) / (float)D + eps);
  store_normed<T>(out + out_off, v, wv, rstd, tpr, num_vec, active);
}

// One vector of 8 elements: its S partials (S a compile-time count, or 0: S_rt at run time) summed in order,
// then h added. Every load of the vector is issued before the first add (one memory round trip).
template <int S>
__device__ __forceinline__ void sum_parts(float (&acc)[8], const float* __restrict__ parts, i64 part_stride,
                                          int S_rt) {
  if constexpr (S > 0) {
    float4 a[S][2];
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const float4* p = reinterpret_cast<const float4*>(parts + s * part_stride);
      a[s][0] = p[0];
      a[s][1] = p[1];
    }
    acc[0] = a[0][0].x; acc[1] = a[0][0].y; acc[2] = a[0][0].z; acc[3] = a[0][0].w;
    acc[4] = a[0][1].x; acc[5] = a[0][1].y; acc[6] = a[0][1].z; acc[7] = a[0][1].w;
#pragma unroll
    for (int s = 1; s < S; ++s) {
      acc[0] += a[s][0].x; acc[1] += a[s][0].y; acc[2] += a[s][0].z; acc[3] += a[s][0].w;
      acc[4] += a[s][1].x; acc[5] += a[s][1].y; acc[6] += a[s][1].z; acc[7] += a[s][1].w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < 8; ++e) acc[e] = 0.f;
    for (int s = 0; s < S_rt; ++s) {
      const float4* p = reinterpret_cast<const float4*>(parts + s * part_stride);
      const float4 a = p[0], b = p[1];
      if (s == 0) {
        acc[0] = a.x; acc[1] = a.y; acc[2] = a.z; acc[3] = a.w;
        acc[4] = b.x; acc[5] = b.y; acc[6] = b.z; acc[7] = b.w;
      } else {
        acc[0] += a.x; acc[1] += a.y; acc[2] += a.z; acc[3] += a.w;
        acc[4] += b.x; acc[5] += b.y; acc[6] += b.z; acc[7] += b.w;
      }
    }
  }
}

template <class T, int S>
__device__ __forceinline__ void residual_norm_impl(u16* __restrict__ h, u16* __restrict__ out,
                                                   const float* __restrict__ parts, int S_rt,
                                                   const u16* __restrict__ weight, int num_rows, int D,
                                                   float eps) {
  const int tpr = blockDim.x;
  const int row = blockIdx.x * blockDim.y + threadIdx.y;
  const bool active = row < num_rows;
  const int num_vec = D >> 3;
  const i64 off = (i64)row * D;
  const i64 part_stride = (i64)num_rows * D;

  float v[MAX_VEC][8];
  Vec16 wv[MAX_VEC];  // the norm weight (store_normed)
  float sumsq = 0.f;
#pragma unroll
  for (int j = 0; j < MAX_VEC; ++j) {
    const int idx = threadIdx.x + j * tpr;
    if (active && idx < num_vec) {
      if (weight != nullptr) wv[j] = reinterpret_cast<const Vec16*>(weight)[idx];
      const Vec16 hv = reinterpret_cast<const Vec16*>(h + off)[idx];
      float acc[8], r[8];
      sum_parts<S>(acc, parts + off + 8 * idx, part_stride, S_rt);
      unpack8<T>(hv, r);
#pragma unroll
      for (int e = 0; e < 8; ++e) v[j][e] = round_to<T>(acc[e] + r[e]);
      reinterpret_cast<Vec16*>(h + off)[idx] = pack8<T>(v[j]);
#pragma unroll
      for (int e = 0; e < 8; ++e) sumsq += v[j][e] * v[j][e];
    }
  }
  if (weight == nullptr) return;  // uniform over the launch

  const float rstd = rsqrtf(row_sum(sumsq, tpr) / (float)D + eps);
  store_normed<T>(out + off, v, wv, rstd, tpr, num_vec, active);
}

#define RMS_NORM_ENTRY(SUFFIX, T)                                                                      \
  extern "C" __global__ void rms_norm_##SUFFIX(u16* out, const u16* x, const u16* weight, int num_rows,  \
                                               int num_inner, i64 stride_outer, i64 stride_inner, int D, \
                                               float eps) {                                            \
    rms_norm_impl<T>(out, x, weight, num_rows, num_inner, stride_outer, stride_inner, D, eps);          \
  }

#define RESIDUAL_NORM_ENTRY(SUFFIX, T)                                                                       \
  extern "C" __global__ void __launch_bounds__(512)                                                          \
      residual_norm_##SUFFIX(u16* h, u16* out, const float* parts, int S, const u16* weight, int num_rows,   \
                             int D, float eps) {                                                             \
    switch (S) { /* the split counts CudaOps uses, unrolled; any other at run time */                      \
      case 2: residual_norm_impl<T, 2>(h, out, parts, S, weight, num_rows, D, eps); break;                 \
      case 4: residual_norm_impl<T, 4>(h, out, parts, S, weight, num_rows, D, eps); break;                 \
      default: residual_norm_impl<T, 0>(h, out, parts, S, weight, num_rows, D, eps);                       \
    }                                                                                                        \
  }

RMS_NORM_ENTRY(bf16, Bf16)
RMS_NORM_ENTRY(fp16, Fp16)
RESIDUAL_NORM_ENTRY(bf16, Bf16)
RESIDUAL_NORM_ENTRY(fp16, Fp16)
