// Op: rotary position embedding of q and k (rotate-half convention), fused with the write of the
// rotated k and of v into the paged KV cache.
//
//   cs = cos_sin[rope_index[t]]            cos = cs[:D/2], sin = cs[D/2:]
//   rot(x) = [x1 * cos - x2 * sin, x2 * cos + x1 * sin]   with x1 = x[:D/2], x2 = x[D/2:]  (fp32)
//   q_out[t, h]                        = to_dtype(rot(q[t, h]))
//   k_cache[slot_mapping[t], kh]       = to_dtype(rot(k[t, kh]))
//   v_cache[slot_mapping[t], kh]       = v[t, kh]
// The products and sums are rounded one by one (no FMA contraction), as torch's eager ops do, so
// the result equals engine/ops/torch_ops.py bit for bit.
//
// Layouts:
//   q [T, H, D], k [T, Hkv, D], v [T, Hkv, D]: heads contiguous (head stride D, element stride 1),
//     token strides q_stride / k_stride / v_stride in elements (they may be views of the fused QKV).
//   q_out [T, H, D] contiguous.  cos_sin [P, D] fp32 contiguous.  rope_index [T] int64.
//   k_cache / v_cache [num_blocks * block_size, Hkv, D] (the per-layer [num_blocks, block_size, Hkv, D]
//   cache, flat over its first two dims).  slot_mapping [T] int64; a negative slot skips the cache
//   write for that token.
// FP8 KV cache (rope_cache_write_{bf16,fp16}_v{8,4}_kvfp8): k_cache / v_cache hold E4M3 bytes (same layout,
//   one byte per element) and receive fp8(to_dtype(rot(k))) and fp8(v): fp8 = round to nearest even, saturated
//   at +-448 (engine/quant.py fp8_kv, common.cuh), the same bits as TorchOps.rope_cache_write on an FP8 cache.
// Launch contract (rope_cache_write_{bf16,fp16}_v{8,4}[_kvfp8]):
//   grid (T), block (128), no dynamic shared memory. _v8 needs D % 16 == 0 (8-element vectors for each
//   half), _v4 needs D % 8 == 0. All pointers and token strides 16-byte aligned.
#include "common.cuh"

template <int VEC>
struct HalfVec;
template <>
struct HalfVec<8> {
  typedef Vec16 type;
};
template <>
struct HalfVec<4> {
  typedef Vec8 type;
};

template <class T, int VEC>
__device__ __forceinline__ void load_vec(const u16* p, float (&f)[VEC]) {
  typedef typename HalfVec<VEC>::type V;
  V v = *reinterpret_cast<const V*>(p);
#pragma unroll
  for (int i = 0; i < VEC / 2; ++i) {
    f[2 * i] = lo_of<T>(v.w[i]);
    f[2 * i + 1] = hi_of<T>(v.w[i]);
  }
}
template <class T, int VEC>
__device__ __forceinline__ void store_vec(u16* p, const float (&f)[VEC]) {
  typedef typename HalfVec<VEC>::type V;
  V v;
#pragma unroll
  for (int i = 0; i < VEC / 2; ++i) v.w[i] = T::pack(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<V*>(p) = v;
}

// f rounded to T, then to E4M3 (what TorchOps writes into an FP8 cache): VEC bytes at p.
template <class T, int VEC>
__device__ __forceinline__ void store_fp8_vec(unsigned char* p, const float (&f)[VEC]) {
  u32 w[VEC / 4];
#pragma unroll
  for (int i = 0; i < VEC / 4; ++i)
    w[i] = fp8x4_from_floats(round_to<T>(f[4 * i]), round_to<T>(f[4 * i + 1]), round_to<T>(f[4 * i + 2]),
                             round_to<T>(f[4 * i + 3]));
  if constexpr (VEC == 8) {
    const Vec8 v = {{w[0], w[1]}};
    *reinterpret_cast<Vec8*>(p) = v;
  } else {
    *reinterpret_cast<u32*>(p) = w[0];
  }
}

// KV8: the caches hold E4M3 bytes (the _kvfp8 entries), else T.
template <class T, int VEC, bool KV8>
__device__ __forceinline__ void rope_cache_write_impl(u16* __restrict__ q_out, const u16* __restrict__ q,
                                                      const u16* __restrict__ k, const u16* __restrict__ v,
                                                      const float* __restrict__ cos_sin,
                                                      const i64* __restrict__ rope_index,
                                                      void* __restrict__ k_cache, void* __restrict__ v_cache,
                                                      const i64* __restrict__ slot_mapping, i64 q_stride,
                                                      i64 k_stride, i64 v_stride, int H, int Hkv, int D) {
  const int t = blockIdx.x;
  const int half = D >> 1;
  const int chunks = half / VEC;  // vectors per half-head
  const i64 slot = slot_mapping[t];
  const float* cs = cos_sin + rope_index[t] * (i64)D;

  // Rotation of q heads [0, H) and k heads [H, H + Hkv).
  const int num_rot = (H + Hkv) * chunks;
  for (int w = threadIdx.x; w < num_rot; w += blockDim.x) {
    const int head = w / chunks;
    const int c = (w - head * chunks) * VEC;
    const bool is_q = head < H;
    if (!is_q && slot < 0) continue;
    const u16* src = is_q ? q + t * q_stride + (i64)head * D : k + t * k_stride + (i64)(head - H) * D;
    float x1[VEC], x2[VEC], o1[VEC], o2[VEC], cv[VEC], sv[VEC];
    load_vec<T, VEC>(src + c, x1);
    load_vec<T, VEC>(src + half + c, x2);
#pragma unroll
    for (int i = 0; i < VEC; i += 4) {
      const Vec16 cw = *reinterpret_cast<const Vec16*>(cs + c + i);
      const Vec16 sw = *reinterpret_cast<const Vec16*>(cs + half + c + i);
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        cv[i + e] = __uint_as_float(cw.w[e]);
        sv[i + e] = __uint_as_float(sw.w[e]);
      }
    }
#pragma unroll
    for (int i = 0; i < VEC; ++i) {
      o1[i] = __fsub_rn(__fmul_rn(x1[i], cv[i]), __fmul_rn(x2[i], sv[i]));
      o2[i] = __fadd_rn(__fmul_rn(x2[i], cv[i]), __fmul_rn(x1[i], sv[i]));
    }
    if constexpr (KV8) {
      if (!is_q) {
        unsigned char* dst = static_cast<unsigned char*>(k_cache) + (slot * Hkv + (head - H)) * (i64)D;
        store_fp8_vec<T, VEC>(dst + c, o1);
        store_fp8_vec<T, VEC>(dst + half + c, o2);
        continue;
      }
    }
    u16* dst = is_q ? q_out + ((i64)t * H + head) * D
                    : static_cast<u16*>(k_cache) + (slot * Hkv + (head - H)) * (i64)D;
    store_vec<T, VEC>(dst + c, o1);
    store_vec<T, VEC>(dst + half + c, o2);
  }

  // v: a plain 16-byte copy into the cache (KV8: 8 values -> 8 E4M3 bytes).
  if (slot < 0) return;
  const int vec_per_head = D >> 3;
  const int num_v = Hkv * vec_per_head;
  for (int w = threadIdx.x; w < num_v; w += blockDim.x) {
    const int head = w / vec_per_head;
    const int c = w - head * vec_per_head;
    const Vec16* src = reinterpret_cast<const Vec16*>(v + t * v_stride + (i64)head * D);
    if constexpr (KV8) {
      float f[8];
      unpack8<T>(src[c], f);
      Vec8 o;
      o.w[0] = fp8x4_from_floats(f[0], f[1], f[2], f[3]);
      o.w[1] = fp8x4_from_floats(f[4], f[5], f[6], f[7]);
      reinterpret_cast<Vec8*>(static_cast<unsigned char*>(v_cache) + (slot * Hkv + head) * (i64)D)[c] = o;
      continue;
    }
    Vec16* dst = reinterpret_cast<Vec16*>(static_cast<u16*>(v_cache) + (slot * Hkv + head) * (i64)D);
    dst[c] = src[c];
  }
}

#define ROPE_ENTRY1(NAME, T, VEC, KV, KV8)                                                                \
  extern "C" __global__ void NAME(                                                                        \
      u16* q_out, const u16* q, const u16* k, const u16* v, const float* cos_sin, const i64* rope_index,  \
      KV* k_cache, KV* v_cache, const i64* slot_mapping, i64 q_stride, i64 k_stride, i64 v_stride, int H,   \
      int Hkv, int D) {                                                                                   \
    rope_cache_write_impl<T, VEC, KV8>(q_out, q, k, v, cos_sin, rope_index, k_cache, v_cache, slot_mapping, \
                                       q_stride, k_stride, v_stride, H, Hkv, D);                          \
  }
#define ROPE_ENTRY(SUFFIX, T, VEC)                                                         \
  ROPE_ENTRY1(rope_cache_write_##SUFFIX##_v##VEC, T, VEC, u16, false)                      \
  ROPE_ENTRY1(rope_cache_write_##SUFFIX##_v##VEC##_kvfp8, T, VEC, unsigned char, true)

ROPE_ENTRY(bf16, Bf16, 8)
ROPE_ENTRY(bf16, Bf16, 4)
ROPE_ENTRY(fp16, Fp16, 8)
ROPE_ENTRY(fp16, Fp16, 4)
