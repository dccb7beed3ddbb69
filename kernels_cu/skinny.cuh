// Device code shared by the skinny linear kernels (skinny_linear.cu) and the fused decode layer
// (decode_layer.cu): the load helpers, the operand struct and the epilogues. The tensor-core mapping,
// row pairs and epilogue numerics are described at the top of skinny_linear.cu.
#pragma once
#include "common.cuh"

#define SK_CHUNK 32  // k elements per warp per step (two mmas)
#define SK_GROUP 4   // chunks per warp whose loads are in flight together (8 W loads per lane)

enum { EP_STORE = 0, EP_F32 = 1, EP_SILU = 2, EP_RESIDUAL = 3, EP_ROPE_KV = 4 };

// Every operand of every epilogue (unused ones null / zero).
struct SkinnyArgs {
  void* out;             // store / silu: T; f32: fp32; residual: the residual (in/out); rope_kv: q_out
  const u16* x;          // [M, K]
  const u16* w;          // [N, K]
  const u16* bias;       // [N] or null
  const u16* norm_w;     // [K] or null (no NORM prologue)
  const float* cos_sin;  // rope_kv
  const i64* rope_index;
  u16* k_cache;
  u16* v_cache;
  const i64* slot_mapping;
  int M, N, K, half;  // half = S / 2, the distance between the two rows of a pair
  int H, Hkv, D;      // rope_kv
  float eps;          // NORM
};

// 16-byte loads. W is streamed once (no L1 allocation, 256-byte L2 prefetch: the 8 warps of a block
// read 8 consecutive 64-byte pieces of each row); x and norm_w are re-read by every block (L1 / L2).
// Both are volatile so that a group's loads are all issued, in order, before its mmas.
__device__ __forceinline__ Vec16 ld_weight16(const u16* p) {
  Vec16 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}
__device__ __forceinline__ Vec16 ld_act16(const u16* p) {
  Vec16 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}
// An activation written earlier in the same launch (by other blocks): read through L2 only.
__device__ __forceinline__ Vec16 ld_cg16(const u16* p) {
  Vec16 v;
  asm volatile("ld.global.cg.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}
__device__ __forceinline__ Vec16 zero16() {
  Vec16 v = {{0u, 0u, 0u, 0u}};
  return v;
}
// Packed multiply of two T pairs, one rounding each (fma with -0: exact sign of zero products).
template <class T>
struct Mul2;
template <>
struct Mul2<Bf16> {
  static __device__ __forceinline__ u32 run(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
  }
};
template <>
struct Mul2<Fp16> {
  static __device__ __forceinline__ u32 run(u32 a, u32 b) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(0x80008000u));
    return d;
  }
};

// Sum of squares of the two T values of one register, added to s.
template <class T>
__device__ __forceinline__ float add_squares(float s, u32 x) {
  const float lo = lo_of<T>(x), hi = hi_of<T>(x);
  return fmaf(hi, hi, fmaf(lo, lo, s));
}

// What an epilogue reads from global memory (the bias, the residual's old values or RoPE's cos / sin, the
// cache slots), loaded by skinny_epilogue_operands before any store; the fused decode layer loads them at
// the start of a tile, so their latency hides behind the tile's weight stream.
template <int NT>
struct EpOperands {
  float b0, b1;
  float in0[NT][2], in1[NT][2];  // the residual's old values, or RoPE's cos and sin
  i64 slot[NT][2];
};

template <class T, int NT, int EP, bool CG = false>
__device__ __forceinline__ EpOperands<NT> skinny_epilogue_operands(const SkinnyArgs& a, int p, int r0, int r1, int t) {
  const int M = a.M, half = a.half;
  const int head = p / half, i = p % half;  // rope_kv
  EpOperands<NT> o;
  o.b0 = o.b1 = 0.f;
  if (EP != EP_SILU && EP != EP_RESIDUAL && a.bias) {
    o.b0 = T::to_float(a.bias[r0]);
    o.b1 = T::to_float(a.bias[r1]);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int m = 8 * j + 2 * t + s;
      o.in0[j][s] = o.in1[j][s] = 0.f;
      o.slot[j][s] = -1;
      if (m >= M) continue;
      if (EP == EP_RESIDUAL) {
        const u16* res = (const u16*)a.out + (i64)m * a.N;
        o.in0[j][s] = T::to_float(CG ? __ldcg(res + r0) : res[r0]);
        o.in1[j][s] = T::to_float(CG ? __ldcg(res + r1) : res[r1]);
      } else if (EP == EP_ROPE_KV) {
        if (head >= a.H) o.slot[j][s] = a.slot_mapping[m];
        if (head < a.H + a.Hkv) {
          const float* cs = a.cos_sin + a.rope_index[m] * (i64)a.D;
          o.in0[j][s] = cs[i];
          o.in1[j][s] = cs[half + i];
        }
      }
    }
  }
  return o;
}

template <class T, int NT, int EP, class InvRms>
__device__ __forceinline__ void skinny_epilogue_store(const SkinnyArgs& a, const float (&acc)[NT][4],
                                                      const EpOperands<NT>& o, int p, int r0, int r1, int t,
                                                      bool norm, InvRms inv_rms) {
  const int M = a.M, half = a.half;
  const int head = p / half, i = p % half;  // rope_kv
  const float b0 = o.b0, b1 = o.b1;
  float scale[NT][2];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int m = 8 * j + 2 * t + s;
      scale[j][s] = norm && m < M ? inv_rms(m) : 1.f;
    }
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int m = 8 * j + 2 * t + s;
      if (m >= M) continue;
      const float v0 = acc[j][s] * scale[j][s] + b0, v1 = acc[j][2 + s] * scale[j][s] + b1;
      if (EP == EP_STORE) {
        u16* out = (u16*)a.out + (i64)m * a.N;
        out[r0] = T::from_float(v0);
        out[r1] = T::from_float(v1);
      } else if (EP == EP_F32) {
        float* out = (float*)a.out + (i64)m * a.N;
        out[r0] = v0;
        out[r1] = v1;
      } else if (EP == EP_SILU) {
        const float gate = round_to<T>(v0), up = round_to<T>(v1);
        const float act = round_to<T>(gate / (1.0f + expf(-gate)));
        ((u16*)a.out)[(i64)m * half + p] = T::from_float(act * up);
      } else if (EP == EP_RESIDUAL) {
        u16* res = (u16*)a.out + (i64)m * a.N;
        res[r0] = T::from_float(o.in0[j][s] + v0);
        res[r1] = T::from_float(o.in1[j][s] + v1);
      } else {  // EP_ROPE_KV
        const float x0 = round_to<T>(v0), x1 = round_to<T>(v1);
        const int D = a.D;
        u16* dst;
        if (head < a.H) {
          dst = (u16*)a.out + ((i64)m * a.H + head) * D;
        } else {
          if (o.slot[j][s] < 0) continue;
          dst = head < a.H + a.Hkv ? a.k_cache + (o.slot[j][s] * a.Hkv + (head - a.H)) * (i64)D
                                   : a.v_cache + (o.slot[j][s] * a.Hkv + (head - a.H - a.Hkv)) * (i64)D;
        }
        if (head < a.H + a.Hkv) {
          const float c = o.in0[j][s], sn = o.in1[j][s];
          dst[i] = T::from_float(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn)));
          dst[half + i] = T::from_float(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, sn)));
        } else {
          dst[i] = T::from_float(x0);
          dst[half + i] = T::from_float(x1);
        }
      }
    }
  }
}

// The epilogue of one 16-row tile (pairs p = 8 tile + g of rows r0 / r1) held in fragment layout:
// acc[j][s] -> (row r0, token 8j + 2t + s); acc[j][2 + s] -> (row r1, the same token). inv_rms(m): the
// NORM prologue's scale of token m (called only when norm). Every load the stores depend on (the
// residual, RoPE's rope_index -> cos / sin, slot_mapping, the NORM scales) is issued before the first
// store: the compiler cannot move a load above a store it may alias, so interleaved they would cost one
// memory round trip per token.
// CG: the residual is read through L2 only (ld.global.cg): the fused decode layer reads a residual that
// other blocks of the same launch wrote.
// rope_kv: q -> q_out, k (heads H .. H + Hkv - 1) -> k_cache, v -> v_cache, all 8 pairs of a tile in one
// head (half % 8 == 0); v0 / v1 rounded to T first, RoPE with rope_cache_write.cu's numerics.
template <class T, int NT, int EP, bool CG = false, class InvRms>
__device__ __forceinline__ void skinny_epilogue(const SkinnyArgs& a, const float (&acc)[NT][4], int p, int r0, int r1,
                                                int t, bool norm, InvRms inv_rms) {
  const EpOperands<NT> o = skinny_epilogue_operands<T, NT, EP, CG>(a, p, r0, r1, t);
  skinny_epilogue_store<T, NT, EP>(a, acc, o, p, r0, r1, t, norm, inv_rms);
}
