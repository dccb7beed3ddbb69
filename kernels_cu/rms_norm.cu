// Op: RMSNorm (transformers' LlamaRMSNorm numerics).
//
//   rms_norm:      out = weight * to_dtype(x * rsqrt(mean(x^2) + eps))           (fp32 inside)
// Both roundings of the torch reference are reproduced (the normalised value is rounded to the
// activation dtype before the weight multiply), so results match engine/ops/torch_ops.py closely.
// (The residual add that precedes a norm is fused into the GEMM before it: TorchOps.linear_add.)
//
// Layouts:
//   rms_norm: x is read as rows of D contiguous elements, row r = (outer o, inner i) with
//     r = o * num_inner + i at element offset o * stride_outer + i * stride_inner. This covers
//     [T, hidden] (num_inner = 1) and Qwen3's per-head q/k norm on [T, heads, head_dim] views of the
//     fused QKV output (token stride = the QKV row). out is contiguous [num_rows, D].
//   weight [D]; every tensor bf16 (…_bf16) or fp16 (…_fp16).
// Launch contract:
//   block (TPR, RPB): TPR threads per row (a power of two, 1..1024), RPB rows per block,
//   TPR * RPB a multiple of 32 and RPB == 1 whenever TPR > 32; each thread holds at most 4 vectors
//   of 8 elements, so D / 8 <= 4 * TPR. grid (ceil(num_rows / RPB)). No dynamic shared memory.
//   D % 8 == 0; every pointer and row offset 16-byte aligned.
#include "common.cuh"

#define MAX_VEC 4

template <class T>
__device__ __forceinline__ void rms_norm_impl(u16* __restrict__ out, const u16* __restrict__ x,
                                              const u16* __restrict__ weight, int num_rows, int num_inner,
                                              i64 stride_outer, i64 stride_inner, int D, float eps) {
  __shared__ float red[32];
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
  float sumsq = 0.f;
#pragma unroll
  for (int j = 0; j < MAX_VEC; ++j) {
    const int idx = threadIdx.x + j * tpr;
    if (active && idx < num_vec) {
      Vec16 raw = reinterpret_cast<const Vec16*>(x + in_off)[idx];
      unpack8<T>(raw, v[j]);
#pragma unroll
      for (int e = 0; e < 8; ++e) sumsq += v[j][e] * v[j][e];
    }
  }

  if (tpr <= 32) {
    for (int o = tpr >> 1; o > 0; o >>= 1) sumsq += __shfl_xor_sync(FULL_MASK, sumsq, o);
  } else {  // one row per block
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    sumsq = warp_sum(sumsq);
    if (lane == 0) red[warp] = sumsq;
    __syncthreads();
    if (warp == 0) {
      float s = lane < (tpr >> 5) ? red[lane] : 0.f;
      s = warp_sum(s);
      if (lane == 0) red[0] = s;
    }
    __syncthreads();
    sumsq = red[0];
  }
  const float rstd = rsqrtf(sumsq / (float)D + eps);

#pragma unroll
  for (int j = 0; j < MAX_VEC; ++j) {
    const int idx = threadIdx.x + j * tpr;
    if (active && idx < num_vec) {
      float w[8], o[8];
      unpack8<T>(reinterpret_cast<const Vec16*>(weight)[idx], w);
#pragma unroll
      for (int e = 0; e < 8; ++e) o[e] = w[e] * round_to<T>(v[j][e] * rstd);
      reinterpret_cast<Vec16*>(out + out_off)[idx] = pack8<T>(o);
    }
  }
}

#define RMS_NORM_ENTRY(SUFFIX, T)                                                                      \
  extern "C" __global__ void rms_norm_##SUFFIX(u16* out, const u16* x, const u16* weight, int num_rows,  \
                                               int num_inner, i64 stride_outer, i64 stride_inner, int D, \
                                               float eps) {                                            \
    rms_norm_impl<T>(out, x, weight, num_rows, num_inner, stride_outer, stride_inner, D, eps);          \
  }

RMS_NORM_ENTRY(bf16, Bf16)
RMS_NORM_ENTRY(fp16, Fp16)
