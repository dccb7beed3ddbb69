// Op: SiLU-and-mul, the gated MLP activation.
//
//   x = [gate | up] (each I wide);  out = to_dtype(to_dtype(silu(gate)) * up),  silu(g) = g / (1 + exp(-g))
// Both roundings of the torch reference (F.silu(gate) * up on bf16/fp16 tensors) are reproduced.
//
// Layouts: x [T, 2 * I] contiguous, out [T, I] contiguous, bf16 (…_bf16) or fp16 (…_fp16).
// Launch contract (silu_and_mul_{bf16,fp16}):
//   grid (T, ceil(I / 8 / 256)), block (256), no dynamic shared memory; I % 8 == 0; x and out
//   16-byte aligned. Thread (t, j) handles the 8 elements [8 j, 8 j + 8) of row t.
#include "common.cuh"

template <class T>
__device__ __forceinline__ void silu_and_mul_impl(u16* __restrict__ out, const u16* __restrict__ x, int I) {
  const int t = blockIdx.x;
  const int j = blockIdx.y * blockDim.x + threadIdx.x;
  if (j >= (I >> 3)) return;
  const Vec16* row = reinterpret_cast<const Vec16*>(x + (i64)t * 2 * I);
  float g[8], u[8], o[8];
  unpack8<T>(row[j], g);
  unpack8<T>(row[(I >> 3) + j], u);
#pragma unroll
  for (int e = 0; e < 8; ++e) o[e] = round_to<T>(g[e] / (1.0f + expf(-g[e]))) * u[e];
  reinterpret_cast<Vec16*>(out + (i64)t * I)[j] = pack8<T>(o);
}

extern "C" __global__ void silu_and_mul_bf16(u16* out, const u16* x, int I) { silu_and_mul_impl<Bf16>(out, x, I); }
extern "C" __global__ void silu_and_mul_fp16(u16* out, const u16* x, int I) { silu_and_mul_impl<Fp16>(out, x, I); }
