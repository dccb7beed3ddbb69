// Op: embedding gather (torch.nn.functional.embedding).
//
//   out[t, :] = weight[input_ids[t], :]
//
// Layouts:
//   input_ids [T] int64;  weight [vocab, hidden] (bf16 | fp16, contiguous);  out [T, hidden] contiguous.
//   An id outside [0, vocab) gives a row of zeros (the engine validates ids; this only keeps a bad id
//   from reading outside the table).
// Launch contract (embedding_{bf16,fp16}):
//   grid (T), block (min(256, hidden / 8)), no dynamic shared memory.
//   hidden % 8 == 0; out and weight 16-byte aligned (each thread moves 16-byte vectors).
//   Programmatic dependent launch (the launch attribute; a no-op without it): it waits at its top and
//   reads nothing before (common.cuh, grid_dependency_wait).
#include "common.cuh"

__device__ __forceinline__ void embedding_impl(u16* __restrict__ out, const u16* __restrict__ weight,
                                               const i64* __restrict__ input_ids, int hidden, i64 vocab) {
  wait_then_allow_dependents();
  const int t = blockIdx.x;
  const i64 id = input_ids[t];
  const int num_vec = hidden >> 3;
  Vec16* dst = reinterpret_cast<Vec16*>(out + (i64)t * hidden);
  if (id < 0 || id >= vocab) {
    const Vec16 zero = {{0u, 0u, 0u, 0u}};
    for (int i = threadIdx.x; i < num_vec; i += blockDim.x) dst[i] = zero;
    return;
  }
  const Vec16* src = reinterpret_cast<const Vec16*>(weight + id * hidden);
  for (int i = threadIdx.x; i < num_vec; i += blockDim.x) dst[i] = src[i];
}

// The gather moves raw 16-bit values, so both entry points share one body.
extern "C" __global__ void embedding_bf16(u16* out, const u16* weight, const i64* input_ids, int hidden,
                                          i64 vocab) {
  embedding_impl(out, weight, input_ids, hidden, vocab);
}
extern "C" __global__ void embedding_fp16(u16* out, const u16* weight, const i64* input_ids, int hidden,
                                          i64 vocab) {
  embedding_impl(out, weight, input_ids, hidden, vocab);
}
