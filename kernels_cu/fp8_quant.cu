// Op: per-row dynamic E4M3 quantization of activations, the A side of W8A8. Reference: engine.quant.quantize_activations.
//
//   amax[m] = max_k |x[m, k]| (fp32, exact);  scale[m] = max(amax[m], 1e-12) * fp32(1 / 448)  (one fp32 rounding)
//   out[m, k] = E4M3(x[m, k] / scale[m])  (the quotient in fp32 rounded to nearest, then to nearest-even E4M3)
// Each |x / scale| <= 448 (up to the quotient's rounding, which E4M3's nearest-even rounding takes back to 448),
// so the cast needs no saturation; cvt.rn.satfinite (fp8x2_from_floats) gives the reference's bytes. The
// division is IEEE (__fdiv_rn; the module is built without --use_fast_math): the bytes equal the reference's.
// In torch the same takes four passes and an fp32 copy of x (13 bytes of traffic per element); here one
// read of x for the maximum, one more (mostly from L2) for the conversion, and one byte written.
//
// Layouts: x [M, K] contiguous, bf16 (…_bf16) or fp16 (…_fp16); out [M, K] E4M3 bytes contiguous; scale [M] fp32.
// Launch contract (quantize_rows_fp8_{bf16,fp16}):
//   grid (M), block (256), no dynamic shared memory; K % 8 == 0; x 16-byte and out 8-byte aligned. Block m
//   handles row m, each thread 8 elements at a time.
#include "common.cuh"

constexpr float E4M3_MAX = 448.0f;
constexpr int QR_THREADS = 256;

template <class T>
__device__ __forceinline__ void quantize_rows_fp8_impl(unsigned char* __restrict__ out, float* __restrict__ scale,
                                                       const u16* __restrict__ x, int K) {
  const int m = blockIdx.x;
  const int n8 = K >> 3;
  const Vec16* row = reinterpret_cast<const Vec16*>(x + (i64)m * K);
  float amax = 0.0f;
  for (int j = threadIdx.x; j < n8; j += QR_THREADS) {
    float v[8];
    unpack8<T>(row[j], v);
#pragma unroll
    for (int e = 0; e < 8; ++e) amax = fmaxf(amax, fabsf(v[e]));
  }
  __shared__ float warp_amax[QR_THREADS / 32];
  amax = warp_max(amax);
  if ((threadIdx.x & 31) == 0) warp_amax[threadIdx.x >> 5] = amax;
  __syncthreads();
  amax = warp_amax[0];
#pragma unroll
  for (int w = 1; w < QR_THREADS / 32; ++w) amax = fmaxf(amax, warp_amax[w]);
  const float s = fmaxf(amax, 1e-12f) * (1.0f / E4M3_MAX);  // the reciprocal folds to fp32(1 / 448) at compile time
  if (threadIdx.x == 0) scale[m] = s;
  uint2* orow = reinterpret_cast<uint2*>(out + (i64)m * K);
  for (int j = threadIdx.x; j < n8; j += QR_THREADS) {
    float v[8];
    unpack8<T>(row[j], v);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = __fdiv_rn(v[e], s);
    orow[j] = make_uint2(fp8x4_from_floats(v[0], v[1], v[2], v[3]), fp8x4_from_floats(v[4], v[5], v[6], v[7]));
  }
}

extern "C" __global__ void __launch_bounds__(QR_THREADS) quantize_rows_fp8_bf16(unsigned char* out, float* scale,
                                                                                const u16* x, int K) {
  quantize_rows_fp8_impl<Bf16>(out, scale, x, K);
}
extern "C" __global__ void __launch_bounds__(QR_THREADS) quantize_rows_fp8_fp16(unsigned char* out, float* scale,
                                                                                const u16* x, int K) {
  quantize_rows_fp8_impl<Fp16>(out, scale, x, K);
}
