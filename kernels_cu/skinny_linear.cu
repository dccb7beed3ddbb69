// Op: "skinny" linear layers for decode batches (M = 1..32 tokens): y = x @ W^T, read from HBM once,
// with the neighbouring elementwise ops fused in (fp32 accumulation on the tensor cores):
//
//   prologue NORM (norm_w != null): x is the raw residual stream; the block computes each token's
//     inv_rms[m] = rsqrt(mean_k(x[m, k]^2) + eps) from the x it loads anyway (all of K, spread over
//     its warps), feeds the tensor cores T(norm_w[k] * x[m, k]) and scales the fp32 result by
//     inv_rms[m]: RMSNorm applied after the dot product instead of before (the same value in exact
//     arithmetic; roundings differ from transformers' LlamaRMSNorm within bf16 resolution).
//   value[m, r] = acc[m, r] (* inv_rms[m]) + bias[r]   (bias optional; fp32)
//   E4M3 weights (entries …_fp8_m<MB>, per-output-channel scales): W holds E4M3 bytes, converted exactly to T in
//     registers (common.cuh's E4M3 read: fp8x4_to_pairs), so acc[m, r] = sum_k x'[m, k] * data[r, k] in fp32 on
//     the same tensor cores, and the epilogue first multiplies it by w_scale[r]:
//     value[m, r] = (acc[m, r] * w_scale[r]) (* inv_rms[m]) + bias[r].
//     Without NORM that is engine.quant.fp8_linear's arithmetic (fp32 accumulation of x * data, then * scale,
//     then + bias and the epilogue) up to the order of the fp32 sums; silu scales the gate row and the up row by
//     their own scales, rope_kv and rope_kvfp8 scale before rounding and rotating. NORM is as above
//     (x' = T(norm_w * x)). The two E4M3s are independent: skinny_rope_kvfp8_<dt>_fp8_m8 reads E4M3 weights and
//     writes an E4M3 KV cache.
//   epilogues:
//     store     out[m, r] = T(value)                                                   out [M, N] T
//     f32       out[m, r] = value                                                      out [M, N] fp32
//     silu      W = [gate (I rows) | up (I rows)];  out[m, p] = T(T(silu(T(g))) * T(u))  out [M, I] T
//               with g = value[m, p], u = value[m, I + p], silu(g) = g / (1 + exp(-g))
//     residual  residual[m, r] = T(residual[m, r] + value[m, r])  (in place, one rounding, as cuBLAS
//               addmm with beta = 1)
//     rope_kv   W = [q heads (H*D rows) | k heads (Hkv*D) | v heads (Hkv*D)]; v = T(value); q and k
//               heads rotate-half with cs = cos_sin[rope_index[m]] (rope_cache_write.cu's numerics:
//               products and sums rounded one by one, no FMA); q -> q_out[m, h], k and v ->
//               k_cache / v_cache at slot_mapping[m] (negative: no cache write for that token)
//     rope_kvfp8 rope_kv into an E4M3 cache (engine/quant.py fp8_kv): the cache rows get fp8(the values rope_kv
//               writes), rounded to nearest even and saturated at +-448 (rope_cache_write_*_kvfp8's bits)
//
// Tensor-core mapping (PTX ISA "Matrix Fragments for mma.m16n8k16 with floating point type",
// .bf16/.f16 A and B; groupID g = lane >> 2, threadID_in_group t = lane & 3):
//   A (16 x 16, row):  a0a1 = (row g, cols 2t, 2t+1)  a2a3 = (row g+8, cols 2t, 2t+1)
//                      a4a5 = (row g, cols 2t+8, 2t+9) a6a7 = (row g+8, cols 2t+8, 2t+9)
//   B (16 x 8, col):   b0b1 = (rows 2t, 2t+1, col g)  b2b3 = (rows 2t+8, 2t+9, col g)
//   C/D (16 x 8 fp32): c0c1 = (row g, cols 2t, 2t+1)   c2c3 = (row g+8, cols 2t, 2t+1)
// A = 16 rows of W, B = x^T (8 tokens per "n-tile"), C[row, token]. E4M3 weights: lane (g, t) loads 16 bytes
// (16 E4M3 values) of rows g / g + 8 at k0 + 16t .. k0 + 16t + 15 (a 64-element chunk a warp) and converts each
// half into the same 4 registers of T pairs (E4M3::operand): two 8-element pieces, each mapped as a 16-bit
// chunk's 8 elements are below (x loaded per piece), so everything below holds for both. A dot product does not depend
// on the order of k, so A and B use the same permutation of the 16 k slots of each mma: the k slot
// owned by thread t maps to a k that depends only on t. Lane (g, t) loads 16 bytes of W row g at
// k0 + 8t .. k0 + 8t + 7 (wa), the same of row g + 8 (wb), and per n-tile j the 16 bytes of token
// 8j + g (xb; zero for tokens >= M). Then, per n-tile, two mmas cover k0 .. k0 + 31:
//   mma 1: A = {wa.w0, wb.w0, wa.w1, wb.w1}, B = {xb.w0, xb.w1}: slots 2t,2t+1 -> k0+8t+{0,1},
//                                                                 slots 2t+8,2t+9 -> k0+8t+{2,3}
//   mma 2: A = {wa.w2, wb.w2, wa.w3, wb.w3}, B = {xb.w2, xb.w3}: the same with k0+8t+{4,5}, {6,7}
// (every register holds its lower-address element in bits 0..15, for A and B alike).
//
// Row pairs: tile i (block i) holds the 8 pairs p = 8i .. 8i+7; fragment row g is pair p's first row
// r0 and row g + 8 its partner r1 (half = S / 2 for a pair span S):
//   r0 = (p / half) * S + p % half,   r1 = r0 + half
// so a lane holds both rows of a pair for the same tokens, and the pairwise epilogues (RoPE
// rotate-half, SiLU gate/up) are register-local. S = N for store / f32 / residual, 2I for silu (pair
// = gate row p, up row I + p), D for rope_kv (pair = (i, i + D/2) of one head).
//
// Block = one tile (16 W rows), WARPS = 8 or 16 warps splitting K: warp w takes the chunks (32 elements of k
// for 16-bit W, 64 for E4M3 and E4M3A8: 16 bytes a lane either way) w, w + WARPS, ... in groups of SK_GROUP = 4
// chunks whose loads (8 16-byte W loads per lane, plus x and norm_w) are all issued before the group's mmas; a
// last, predicated group takes the remainder (E4M3 at 16 and 32 tokens and E4M3A8 at 32: groups of 2, whose x
// would not fit the registers at 4).
// Piece s of chunk u of a group accumulates into chain (u SUB + s) % CH (CH = 2 for NT <= 2, else 1: the NT n-tiles
// already give independent chains), so the mma dependency chain is short; the chains are added in a
// fixed order. W is read with ld.global.nc.L1::no_allocate (read once: it must not evict x, which
// every block re-reads from L1/L2). The warps' fragments (and NORM's sums of squares) are summed
// through shared memory in warp order (deterministic) and warp 0 runs the epilogue.
// 16-warp blocks (entry suffix _w16) are for grids with no more tiles than SMs (1B o and down: 128
// tiles on 132 SMs), where 8-warp blocks would leave each SM one block and half the loads in flight.
// Programmatic dependent launch (common.cuh; the engine launches these kernels with it): each warp
// issues its first group's W loads, then waits for the previous kernel, then loads x and norm_w. Warp 0
// of the _m8 entries also loads the epilogue's operands before the wait (bias; E4M3's w_scale; the residual's
// old values; RoPE's rope_index, cos / sin row and slot_mapping): the kernel launched just before must not write
// them (launch contract). Nothing is written before the wait (the batch-1 gains: bench/RESULTS.md).
// Measured and left out: prefetching a block's W rows into L2 before the wait (slower). A "staged" variant
// for 9..32 tokens (x staged once per block in shared memory, one 16-row tile per warp, K split over a
// thread-block cluster and reduced in distributed shared memory) was slower than cuBLAS at every 1B and 8B
// shape at 16 and 32 tokens, so batches past 8 keep cuBLAS.
// Occupancy: __launch_bounds__(256, 2) / (512, 1), i.e. <= 128 registers: two 8-warp blocks or one
// 16-warp block per SM.
//
// Layouts (all contiguous; T = bf16 (…_bf16) or fp16 (…_fp16), storage u16):
//   x [M, K] T; W [N, K] T, or E4M3 bytes (…_fp8) with w_scale [N] fp32; bias [N] T; norm_w [K] T.
//   rope_kv: N = (H + 2 Hkv) D; q_out [M, H, D] T; cos_sin [P, D] fp32 (cos of the D/2 frequencies,
//     then their sin); rope_index [M] int64; k_cache / v_cache [num_blocks * block_size, Hkv, D] T
//     (element offset slot * Hkv * D + kh * D + i; rope_kvfp8: E4M3 bytes); slot_mapping [M] int64.
//   residual: residual [M, N] T (in/out).
// Launch contract (skinny_{store,f32,silu,residual,rope_kv,rope_kvfp8}_{bf16,fp16}_m{8,16,32}[_w16] and
// skinny_{store,f32,silu,residual,rope_kv,rope_kvfp8}_{bf16,fp16}_fp8_m{8,16,32}[_w16], `w_scale` right after `w`):
//   grid (N / 16), block (256) (_w16: block (512)), no dynamic shared memory. The _m<8 NT> variant takes M <= 8 NT
//   (1 <= M; the wrapper picks the smallest). K % 32 == 0; N % 16 == 0; half % 8 == 0 (silu:
//   I % 8 == 0; rope_kv: D % 16 == 0); x, W, norm_w 16-byte aligned; out / residual must
//   not overlap x or W. Launched with programmatic dependent launch, the kernel just before it in the stream
//   must not write bias, w_scale, the residual (residual), rope_index, cos_sin or slot_mapping (rope_kv*): they
//   are read before the wait (w_scale, like W, is written once at load). (In a decode forward the residual's
//   last writer is two or more launches back: o after attention, down after gate_up; rope_index and
//   slot_mapping come from decode_prepare or earlier.)
// Built WITHOUT --use_fast_math: expf, the division of silu and rsqrtf must be the accurate ones.
#include "common.cuh"

#define SK_GROUP 4  // chunks per warp whose loads are in flight together (8 16-byte W loads per lane)

enum { EP_STORE = 0, EP_F32 = 1, EP_SILU = 2, EP_RESIDUAL = 3, EP_ROPE_KV = 4, EP_ROPE_KV8 = 5 };

// Every operand of every epilogue (unused ones null / zero).
struct SkinnyArgs {
  void* out;             // store / silu: T; f32: fp32; residual: the residual (in/out); rope_kv: q_out
  const void* x;         // [M, K] T, or E4M3 bytes (E4M3A8)
  const void* w;         // [N, K] T (W16) or E4M3 bytes (E4M3, E4M3A8)
  const float* wscale;   // [N] fp32, E4M3 and E4M3A8 only: per-row (output channel) scale
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
  unsigned char* k_cache8;  // rope_kvfp8: the E4M3 caches
  unsigned char* v_cache8;
  const float* xscale;  // [M] fp32, E4M3A8 only: per-row (token) scale
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
__device__ __forceinline__ Vec16 ld_act16(const void* p) {
  Vec16 v;
  asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.w[0]), "=r"(v.w[1]), "=r"(v.w[2]), "=r"(v.w[3])
               : "l"(p));
  return v;
}
__device__ __forceinline__ Vec16 zero16() {
  Vec16 v = {{0u, 0u, 0u, 0u}};
  return v;
}

// FP8 x FP8 -> fp32 (sm_89+: the W8A8 skinny entries), m16n8k32: A = 16 x 32 E4M3 (row), B = 32 x 8 (col), four
// bytes a register (lowest k in bits 0..7). a0 / a1 = rows g / g + 8 at k 4t .. 4t + 3, a2 / a3 the same at
// k 4t + 16 .. 4t + 19; b0 / b1 = col g at k 4t .. 4t + 3 / 4t + 16 .. 4t + 19; C / D as m16n8k16's. Before sm_89
// there is no such instruction: the entries that use it trap there (the wrappers send them only FP8-capable devices).
struct MmaE4M3 {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
#else
    __trap();
#endif
  }
};

// The weight storage of a kernel: W16 (W in the activation dtype T) or E4M3 (one byte per element, converted
// to T in registers; the per-row scale is applied to the fp32 accumulators in the epilogue). Either way a lane
// loads 16 bytes of a row per chunk: SUB 8-element pieces (SUB = 1 for W16, 2 for E4M3) at k0 + 8 SUB t, so a
// warp's chunk is CHUNK = 32 SUB elements of k and the bytes in flight per lane are the same for both (the
// E4M3 entries with 8-byte loads at the 16-bit mapping read the 8B's weights at 1.8-3.0 TB/s against bf16's
// 3.2-4.3: too few bytes in flight). operand<T>(raw, s) = piece s (elements k0 + 8 SUB t + 8s .. + 7) as the
// mma's four T pairs (register i: elements 2i, 2i + 1); x is loaded per piece to match.
// X8: x is E4M3 too (E4M3A8). GROUP: chunks per load group at NT n-tiles (E4M3's x pieces and E4M3A8's 16-byte x
// loads are more registers per chunk than the 16-bit kernels' at 16 and 32 tokens; 4 there would spill).
// mma: one k slice of the chunk's fragments into an accumulator chain.
struct W16 {
  typedef u16 Elem;
  typedef u16 XElem;
  static constexpr bool SCALED = false, X8 = false;
  static constexpr int SUB = 1, CHUNK = 32;
  static __host__ __device__ constexpr int group(int) { return SK_GROUP; }
  static __device__ __forceinline__ Vec16 load(const Elem* p) { return ld_weight16(p); }
  template <class T>
  static __device__ __forceinline__ Vec16 operand(const Vec16& r, int) { return r; }
  template <class T>
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    Mma<T>::run(d, a, b0, b1);
  }
};
// operand: common.cuh's exact E4M3 read (the KV cache's too), 4 instructions per T pair, no FP8 cvt (the sm_80
// cubin serves sm_86 / sm_89 too). The NaN codes 0x7f / 0xff would come out as +-480: engine.quant.quantize_fp8
// saturates, so a weight holds none.
struct E4M3 {
  typedef unsigned char Elem;
  typedef u16 XElem;
  static constexpr bool SCALED = true, X8 = false;
  static constexpr int SUB = 2, CHUNK = 64;
  static __host__ __device__ constexpr int group(int nt) { return nt > 1 ? SK_GROUP / 2 : SK_GROUP; }
  static __device__ __forceinline__ Vec16 load(const Elem* p) { return ld_weight16(reinterpret_cast<const u16*>(p)); }
  template <class T>
  static __device__ __forceinline__ Vec16 operand(const Vec16& r, int s) {
    Vec16 v;
    fp8x4_to_pairs<T>(r.w[2 * s], v.w[0], v.w[1]);      // elements 8s .. 8s + 3
    fp8x4_to_pairs<T>(r.w[2 * s + 1], v.w[2], v.w[3]);  // elements 8s + 4 .. 8s + 7
    return v;
  }
  template <class T>
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    Mma<T>::run(d, a, b0, b1);
  }
};
// W8A8 (the _w8a8 entries): E4M3 weights and E4M3 x, each row with its fp32 scale (x per token: engine.quant's
// quantize_activations, kernels_cu/fp8_quant.cu), multiplied on the FP8 tensor cores (m16n8k32, MmaE4M3) with
// no conversion: lane (g, t) loads 16 bytes of rows g / g + 8 and of token g at k0 + 16t .. k0 + 16t + 15, and the
// two k32 mmas take words {0, 1} and {2, 3} of each (the k-slot permutation of the 16-bit mapping: the slots
// of thread t map to its own 8 elements for A and B alike). The epilogue multiplies the fp32 accumulator by the
// row's weight scale and the token's x scale (engine.quant.w8a8_linear's arithmetic up to the order of the fp32
// sums). No NORM prologue (x arrives quantized, so normalized before). On sm_90 mma.sync has no FP8 tensor-core
// instruction (Hopper's FP8 MMA is wgmma's): ptxas lowers each m16n8k32 e4m3 mma to E4M3 -> f16 unpacks of both
// operands and two f16 HMMA.16816 (skinny_store_bf16_w8a8_m32's sm_90 SASS: 384 F2FP.F16.E4M3.UNPACK_B, 128 HMMA, no
// QMMA), so there x costs a conversion per element and tile, as W does.
struct E4M3A8 {
  typedef unsigned char Elem;
  typedef unsigned char XElem;
  static constexpr bool SCALED = true, X8 = true;
  static constexpr int SUB = 1, CHUNK = 64;
  static __host__ __device__ constexpr int group(int nt) { return nt > 2 ? SK_GROUP / 2 : SK_GROUP; }
  static __device__ __forceinline__ Vec16 load(const Elem* p) { return ld_weight16(reinterpret_cast<const u16*>(p)); }
  template <class T>
  static __device__ __forceinline__ Vec16 operand(const Vec16& r, int) { return r; }
  template <class T>
  static __device__ __forceinline__ void mma(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    MmaE4M3::run(d, a, b0, b1);
  }
};
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

// Per-lane operand pointers of the main loop.
template <class W, int NT>
struct LaneOperands {
  const typename W::Elem* wa;  // W row r0, + 8 SUB t
  const typename W::Elem* wb;  // W row r1, + 8 SUB t
  const typename W::XElem* x;  // token g, + 8 SUB t; token 8j + g is at x + j * xstride (read only where xv[j])
  i64 xstride;        // 8 K
  bool xv[NT];        // token 8j + g < M
  const u16* nw;      // norm_w + 8 SUB t
  int klim;           // K - CHUNK t / 4: this lane's 16 bytes at chunk offset k exist iff k < klim
};

// U chunks c, c + WARPS, ..., c + WARPS (U - 1) of this warp. FULL: all are whole chunks; else a lane skips
// the pieces past K (chunks >= C whole, and the lanes past K of a last chunk that K ends halfway through:
// E4M3's CHUNK is 64, K a multiple of 32). load_weight_group issues the group's W loads; mma_group then
// loads x (and norm_w) and runs the group's mmas.
template <class W, int NT, int U, bool FULL, int WARPS>
__device__ __forceinline__ void load_weight_group(Vec16 (&wa)[U], Vec16 (&wb)[U], const LaneOperands<W, NT>& L,
                                                  int c) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const i64 k = (i64)(c + WARPS * u) * W::CHUNK;
    const bool on = FULL || k < L.klim;
    wa[u] = on ? W::load(L.wa + k) : zero16();
    wb[u] = on ? W::load(L.wb + k) : zero16();
  }
}
template <class T, class W, int NT, int U, int CH, bool NORM, bool FULL, int WARPS>
__device__ __forceinline__ void mma_group(float (&acc)[CH][NT][4], float (&ss)[NT], const LaneOperands<W, NT>& L,
                                          const Vec16 (&wa_raw)[U], const Vec16 (&wb_raw)[U], int c, int C) {
  constexpr int S = W::SUB;
  Vec16 xb[U][S][NT], nw[U][S];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const i64 k = (i64)(c + WARPS * u) * W::CHUNK;
    const bool on = FULL || k < L.klim;
#pragma unroll
    for (int s = 0; s < S; ++s) {
#pragma unroll
      for (int j = 0; j < NT; ++j) xb[u][s][j] = on && L.xv[j] ? ld_act16(L.x + j * L.xstride + k + 8 * s) : zero16();
      if (NORM) nw[u][s] = on ? ld_act16(L.nw + k + 8 * s) : zero16();
    }
  }
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (!FULL && c + WARPS * u >= C) continue;  // warp-uniform (the mma is the warp's)
#pragma unroll
    for (int s = 0; s < S; ++s) {
      const Vec16 wa = W::template operand<T>(wa_raw[u], s), wb = W::template operand<T>(wb_raw[u], s);
#pragma unroll
      for (int j = 0; j < NT; ++j) {
        if (NORM) {  // tokens >= M and pieces past K: x = 0, so the operand and the sum stay 0
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            ss[j] = add_squares<T>(ss[j], xb[u][s][j].w[i]);
            xb[u][s][j].w[i] = Mul2<T>::run(xb[u][s][j].w[i], nw[u][s].w[i]);
          }
        }
        const u32 a_lo[4] = {wa.w[0], wb.w[0], wa.w[1], wb.w[1]};
        const u32 a_hi[4] = {wa.w[2], wb.w[2], wa.w[3], wb.w[3]};
        float (&chain)[4] = acc[(u * S + s) % CH][j];
        W::template mma<T>(chain, a_lo, xb[u][s][j].w[0], xb[u][s][j].w[1]);
        W::template mma<T>(chain, a_hi, xb[u][s][j].w[2], xb[u][s][j].w[3]);
      }
    }
  }
}

// The first group's W loads of this warp (chunks warp, warp + WARPS, ...): full0 = all U chunks exist.
template <class W, int NT, int U, int WARPS>
__device__ __forceinline__ void load_first_group(Vec16 (&wa)[U], Vec16 (&wb)[U], const LaneOperands<W, NT>& L,
                                                 int warp, bool full0) {
  if (full0)
    load_weight_group<W, NT, U, true, WARPS>(wa, wb, L, warp);
  else
    load_weight_group<W, NT, U, false, WARPS>(wa, wb, L, warp);
}

// One tile's main loop for this warp, its first group's W already loaded into wa0 / wb0 (load_first_group).
// C: chunks (the last may be half of one: E4M3, K % 64 == 32), Cw: whole chunks.
template <class T, class W, int NT, int U, int CH, bool NORM, int WARPS>
__device__ __forceinline__ void skinny_mainloop(float (&acc)[CH][NT][4], float (&ss)[NT],
                                                const LaneOperands<W, NT>& L, const Vec16 (&wa0)[U],
                                                const Vec16 (&wb0)[U], int warp, int C, int Cw, bool full0) {
  if (!full0) {  // the first group is this warp's only one (possibly empty: K < CHUNK WARPS)
    mma_group<T, W, NT, U, CH, NORM, false, WARPS>(acc, ss, L, wa0, wb0, warp, C);
    return;
  }
  mma_group<T, W, NT, U, CH, NORM, true, WARPS>(acc, ss, L, wa0, wb0, warp, C);
  int c = warp + WARPS * U;
  Vec16 wa[U], wb[U];
  for (; c + WARPS * (U - 1) < Cw; c += WARPS * U) {
    load_weight_group<W, NT, U, true, WARPS>(wa, wb, L, c);
    mma_group<T, W, NT, U, CH, NORM, true, WARPS>(acc, ss, L, wa, wb, c, C);
  }
  if (c < C) {
    load_weight_group<W, NT, U, false, WARPS>(wa, wb, L, c);
    mma_group<T, W, NT, U, CH, NORM, false, WARPS>(acc, ss, L, wa, wb, c, C);
  }
}

// The operands an epilogue loads for lane (g, t): the bias of rows r0 / r1, and per token m = 8j + 2t + s
// the residual's old values (in0 / in1 of rows r0 / r1), or RoPE's cos and sin (in0 / in1) and the cache slot.
// Loaded by warp 0 before the wait for the previous kernel (skinny_impl; the 8-token entries), so none of
// these round trips is on the critical path after it: the launch contract says the kernel launched just
// before this one writes none of them (under programmatic dependent launch every earlier kernel has
// completed when this one starts).
template <int NT>
struct EpilogueIn {
  float ws0, ws1;  // E4M3: the weight scales of rows r0 / r1
  float b0, b1;
  float in0[NT][2], in1[NT][2];
  i64 slot[NT][2];
};
template <class T, class W, int NT, int EP>
__device__ __forceinline__ void epilogue_inputs(EpilogueIn<NT>& e, const SkinnyArgs& a, int p, int r0, int r1, int t) {
  const int M = a.M, half = a.half;
  const int head = p / half, i = p % half;  // rope_kv
  e.ws0 = e.ws1 = 1.f;
  if (W::SCALED) {
    e.ws0 = a.wscale[r0];
    e.ws1 = a.wscale[r1];
  }
  e.b0 = e.b1 = 0.f;
  if (EP != EP_SILU && EP != EP_RESIDUAL && a.bias) {
    e.b0 = T::to_float(a.bias[r0]);
    e.b1 = T::to_float(a.bias[r1]);
  }
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int m = 8 * j + 2 * t + s;
      e.in0[j][s] = e.in1[j][s] = 0.f;
      e.slot[j][s] = -1;
      if (m >= M) continue;
      if (EP == EP_RESIDUAL) {
        const u16* res = (const u16*)a.out + (i64)m * a.N;
        e.in0[j][s] = T::to_float(res[r0]);
        e.in1[j][s] = T::to_float(res[r1]);
      } else if (EP == EP_ROPE_KV || EP == EP_ROPE_KV8) {
        if (head >= a.H) e.slot[j][s] = a.slot_mapping[m];
        if (head < a.H + a.Hkv) {
          const float* cs = a.cos_sin + a.rope_index[m] * (i64)a.D;
          e.in0[j][s] = cs[i];
          e.in1[j][s] = cs[half + i];
        }
      }
    }
  }
}

// The epilogue of one 16-row tile (pairs p = 8 tile + g of rows r0 / r1) held in fragment layout:
// acc[j][s] -> (row r0, token 8j + 2t + s); acc[j][2 + s] -> (row r1, the same token). E4M3: first
// acc *= the row's weight scale (e.ws0 / e.ws1), as engine.quant.fp8_linear scales its fp32 accumulators.
// scale[j][s]: the NORM prologue's inv_rms of that token (1 without NORM); e: epilogue_inputs' operands,
// loaded before the first store (the compiler cannot move a global load above a store it may alias, so
// loads between the stores would cost one memory round trip per token).
// rope_kv: q -> q_out, k (heads H .. H + Hkv - 1) -> k_cache, v -> v_cache, all 8 pairs of a tile in one
// head (half % 8 == 0); v0 / v1 rounded to T first, RoPE with rope_cache_write.cu's numerics.
template <class T, class W, int NT, int EP>
__device__ __forceinline__ void skinny_epilogue(const SkinnyArgs& a, const float (&acc)[NT][4], const EpilogueIn<NT>& e,
                                                int p, int r0, int r1, int t, const float (&scale)[NT][2]) {
  const int M = a.M, half = a.half;
  const int head = p / half, i = p % half;  // rope_kv
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int m = 8 * j + 2 * t + s;
      if (m >= M) continue;
      float c0 = acc[j][s], c1 = acc[j][2 + s];
      if (W::X8) {  // (acc * x scale) * w scale, w8a8_linear's order
        c0 *= scale[j][s];
        c1 *= scale[j][s];
      }
      if (W::SCALED) {
        c0 *= e.ws0;
        c1 *= e.ws1;
      }
      float v0, v1;
      if (W::X8) {  // the W8A8 GEMM's bf16 output, + bias in bf16, then the epilogue (as the separate ops compute it)
        v0 = round_to<T>(round_to<T>(c0) + e.b0);
        v1 = round_to<T>(round_to<T>(c1) + e.b1);
      } else {
        v0 = c0 * scale[j][s] + e.b0;
        v1 = c1 * scale[j][s] + e.b1;
      }
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
        res[r0] = T::from_float(e.in0[j][s] + v0);
        res[r1] = T::from_float(e.in1[j][s] + v1);
      } else if (EP == EP_ROPE_KV8) {  // rope_kv's values; the cache rows as E4M3 (rounded to T first)
        const float x0 = round_to<T>(v0), x1 = round_to<T>(v1);
        const int D = a.D;
        float y0 = x0, y1 = x1;
        if (head < a.H + a.Hkv) {
          const float c = e.in0[j][s], sn = e.in1[j][s];
          y0 = round_to<T>(__fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, sn)));
          y1 = round_to<T>(__fadd_rn(__fmul_rn(x1, c), __fmul_rn(x0, sn)));
        }
        if (head < a.H) {
          u16* dst = (u16*)a.out + ((i64)m * a.H + head) * D;
          dst[i] = T::from_float(y0);
          dst[half + i] = T::from_float(y1);
        } else {
          if (e.slot[j][s] < 0) continue;
          unsigned char* dst = head < a.H + a.Hkv ? a.k_cache8 + (e.slot[j][s] * a.Hkv + (head - a.H)) * (i64)D
                                                  : a.v_cache8 + (e.slot[j][s] * a.Hkv + (head - a.H - a.Hkv)) * (i64)D;
          const u32 pair = fp8x2_from_floats(y0, y1);
          dst[i] = (unsigned char)(pair & 0xffu);
          dst[half + i] = (unsigned char)(pair >> 8);
        }
      } else {  // EP_ROPE_KV
        const float x0 = round_to<T>(v0), x1 = round_to<T>(v1);
        const int D = a.D;
        u16* dst;
        if (head < a.H) {
          dst = (u16*)a.out + ((i64)m * a.H + head) * D;
        } else {
          if (e.slot[j][s] < 0) continue;
          dst = head < a.H + a.Hkv ? a.k_cache + (e.slot[j][s] * a.Hkv + (head - a.H)) * (i64)D
                                   : a.v_cache + (e.slot[j][s] * a.Hkv + (head - a.H - a.Hkv)) * (i64)D;
        }
        if (head < a.H + a.Hkv) {
          const float c = e.in0[j][s], sn = e.in1[j][s];
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

template <class T, class W, int NT, int EP, int WARPS>
__device__ __forceinline__ void skinny_impl(const SkinnyArgs& a) {
  TRACE_SCOPE;
  constexpr int U = W::group(NT);
  constexpr int CHUNK = W::CHUNK;
  constexpr int CH = NT == 4 ? 1 : 2;  // independent accumulator chains (chunk u -> chain u % CH)
  __shared__ float red[WARPS - 1][NT * 4][32];  // fragments of warps 1..WARPS-1
  __shared__ float sq_red[WARPS][NT * 8];       // NORM: per-warp sums of squares per token
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int g = lane >> 2, t = lane & 3;
  const int M = a.M, K = a.K, half = a.half;
  const bool norm = !W::X8 && a.norm_w != nullptr;  // E4M3A8 takes x normalized (and quantized) already
  const int C = (K + CHUNK - 1) / CHUNK, Cw = K / CHUNK;
  const bool full0 = warp + WARPS * (U - 1) < Cw;  // this warp's first group has all U chunks, whole

  // The pair of this lane's fragment rows g / g + 8.
  const int p = blockIdx.x * 8 + g;
  const int r0 = (p / half) * 2 * half + p % half;
  const int r1 = r0 + half;

  LaneOperands<W, NT> L;
  const typename W::Elem* w = (const typename W::Elem*)a.w;
  const int lane_k = CHUNK / 4 * t;
  L.wa = w + (i64)r0 * K + lane_k;
  L.wb = w + (i64)r1 * K + lane_k;
  L.nw = a.norm_w + lane_k;
  L.x = (const typename W::XElem*)a.x + (i64)g * K + lane_k;
  L.xstride = (i64)8 * K;
  L.klim = K - lane_k;
#pragma unroll
  for (int j = 0; j < NT; ++j) L.xv[j] = 8 * j + g < M;

  // The first group's W loads, then warp 0's epilogue operands at NT = 1 (up to 8 tokens: the engine's skinny
  // forwards), then the wait for the previous kernel; the 16- and 32-token entries load the epilogue's operands
  // after the reduction (held through the main loop they would spill there).
  Vec16 wa0[U], wb0[U];
  load_first_group<W, NT, U, WARPS>(wa0, wb0, L, warp, full0);
  constexpr bool EARLY_EPI = NT == 1;
  EpilogueIn<NT> epi;
  if (EARLY_EPI && warp == 0) epilogue_inputs<T, W, NT, EP>(epi, a, p, r0, r1, t);
  wait_then_allow_dependents();

  float chains[CH][NT][4];
  float ss[NT];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
    ss[j] = 0.f;
#pragma unroll
    for (int h = 0; h < CH; ++h) {
#pragma unroll
      for (int e = 0; e < 4; ++e) chains[h][j][e] = 0.f;
    }
  }
  if (norm)  // never for E4M3A8 (a constant false there)
    skinny_mainloop<T, W, NT, U, CH, true, WARPS>(chains, ss, L, wa0, wb0, warp, C, Cw, full0);
  else
    skinny_mainloop<T, W, NT, U, CH, false, WARPS>(chains, ss, L, wa0, wb0, warp, C, Cw, full0);
  TRACE_MARK(0);  // warp 0's share of W consumed
  float acc[NT][4];
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      acc[j][e] = chains[0][j][e];
#pragma unroll
      for (int h = 1; h < CH; ++h) acc[j][e] += chains[h][j][e];
    }
  }

  if (warp > 0) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) red[warp - 1][j * 4 + e][lane] = acc[j][e];
    }
  }
  if (norm) {
    // This warp's sum for token 8j + g: lanes of equal g (t = 0..3) hold its four 8-element columns.
#pragma unroll
    for (int j = 0; j < NT; ++j) {
      float v = ss[j];
      v += __shfl_xor_sync(FULL_MASK, v, 1);
      v += __shfl_xor_sync(FULL_MASK, v, 2);
      if (t == 0) sq_red[warp][8 * j + g] = v;
    }
  }
  __syncthreads();
  TRACE_MARK(1);  // every warp's fragments in shared memory
  if (warp != 0) return;

#pragma unroll
  for (int w = 0; w < WARPS - 1; ++w) {
#pragma unroll
    for (int j = 0; j < NT; ++j) {
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[j][e] += red[w][j * 4 + e][lane];
    }
  }
  float scale[NT][2];  // the NORM prologue's inv_rms of token 8j + 2t + s, or its x scale (E4M3A8), else 1
#pragma unroll
  for (int j = 0; j < NT; ++j) {
#pragma unroll
    for (int s = 0; s < 2; ++s) {
      const int m = 8 * j + 2 * t + s;
      scale[j][s] = 1.f;
      if (W::X8 && m < M) scale[j][s] = a.xscale[m];
      if (norm && m < M) {
        float sum = 0.f;
#pragma unroll
        for (int w = 0; w < WARPS; ++w) sum += sq_red[w][m];
        scale[j][s] = rsqrtf(sum / (float)K + a.eps);
      }
    }
  }
  if (!EARLY_EPI) epilogue_inputs<T, W, NT, EP>(epi, a, p, r0, r1, t);
  skinny_epilogue<T, W, NT, EP>(a, acc, epi, p, r0, r1, t, scale);
}

// ---------------------------------------------------------------------------------------------
// Entry points: skinny_<ep>_<dt>_m<MB> (8 warps, two blocks per SM) and ..._w16 (16 warps, one block
// per SM: twice the weight loads in flight per SM where the grid has no more tiles than SMs); E4M3 weights:
// skinny_<ep>_<dt>_fp8_m<MB>[_w16], the same with `w` E4M3 bytes and `w_scale` [N] fp32 right after it. Every
// epilogue exists for both weight storages, rope_kvfp8 (an E4M3 KV cache) included.
// SK_<W>_PARAMS / SK_<W>_SET: the weight's parameters and how they enter SkinnyArgs.
#define SK_W16_PARAMS const u16* x, const u16* w
#define SK_W16_SET a.x = x; a.w = w;
#define SK_E4M3_PARAMS const u16* x, const unsigned char* w, const float* w_scale
#define SK_E4M3_SET a.x = x; a.w = w; a.wscale = w_scale;
#define SK_E4M3A8_PARAMS const unsigned char* x, const float* x_scale, const unsigned char* w, const float* w_scale
#define SK_E4M3A8_SET a.x = x; a.xscale = x_scale; a.w = w; a.wscale = w_scale;

#define SKINNY_ENTRIES_W(SUFFIX, T, W, WPARAMS, WSET, MB, NT, WARPS, MINB, WSFX)                                    \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) skinny_store_##SUFFIX##_m##MB##WSFX(               \
      u16* out, WPARAMS, const u16* bias, const u16* norm_w, int M, int N, int K, float eps) {        \
    SkinnyArgs a = {};                                                                                              \
    a.out = out; WSET a.bias = bias; a.norm_w = norm_w;                                                    \
    a.M = M; a.N = N; a.K = K; a.half = N / 2; a.eps = eps;                                                         \
    skinny_impl<T, W, NT, EP_STORE, WARPS>(a);                                                                      \
  }                                                                                                                 \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) skinny_f32_##SUFFIX##_m##MB##WSFX(                 \
      float* out, WPARAMS, const u16* bias, const u16* norm_w, int M, int N, int K, float eps) {      \
    SkinnyArgs a = {};                                                                                              \
    a.out = out; WSET a.bias = bias; a.norm_w = norm_w;                                                    \
    a.M = M; a.N = N; a.K = K; a.half = N / 2; a.eps = eps;                                                         \
    skinny_impl<T, W, NT, EP_F32, WARPS>(a);                                                                        \
  }                                                                                                                 \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) skinny_silu_##SUFFIX##_m##MB##WSFX(                \
      u16* out, WPARAMS, const u16* norm_w, int M, int I, int K, float eps) {                         \
    SkinnyArgs a = {};                                                                                              \
    a.out = out; WSET a.norm_w = norm_w;                                                                   \
    a.M = M; a.N = 2 * I; a.K = K; a.half = I; a.eps = eps;                                                         \
    skinny_impl<T, W, NT, EP_SILU, WARPS>(a);                                                                       \
  }                                                                                                                 \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) skinny_residual_##SUFFIX##_m##MB##WSFX(            \
      u16* residual, WPARAMS, int M, int N, int K) {                                                  \
    SkinnyArgs a = {};                                                                                              \
    a.out = residual; WSET a.M = M; a.N = N; a.K = K; a.half = N / 2;                                      \
    skinny_impl<T, W, NT, EP_RESIDUAL, WARPS>(a);                                                                   \
  }                                                                                                                 \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) skinny_rope_kv_##SUFFIX##_m##MB##WSFX(             \
      u16* q_out, WPARAMS, const u16* bias, const u16* norm_w, const float* cos_sin,                  \
      const i64* rope_index, u16* k_cache, u16* v_cache, const i64* slot_mapping, int M, int H, int Hkv, int D,     \
      int K, float eps) {                                                                                           \
    SkinnyArgs a = {};                                                                                              \
    a.out = q_out; WSET a.bias = bias; a.norm_w = norm_w;                                                  \
    a.cos_sin = cos_sin; a.rope_index = rope_index; a.k_cache = k_cache; a.v_cache = v_cache;                       \
    a.slot_mapping = slot_mapping; a.M = M; a.N = (H + 2 * Hkv) * D; a.K = K; a.half = D / 2;                       \
    a.H = H; a.Hkv = Hkv; a.D = D; a.eps = eps;                                                                     \
    skinny_impl<T, W, NT, EP_ROPE_KV, WARPS>(a);                                                                    \
  }                                                                                                                 \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) skinny_rope_kvfp8_##SUFFIX##_m##MB##WSFX(          \
      u16* q_out, WPARAMS, const u16* bias, const u16* norm_w, const float* cos_sin,                  \
      const i64* rope_index, unsigned char* k_cache, unsigned char* v_cache, const i64* slot_mapping, int M, int H, \
      int Hkv, int D, int K, float eps) {                                                                           \
    SkinnyArgs a = {};                                                                                              \
    a.out = q_out; WSET a.bias = bias; a.norm_w = norm_w;                                                  \
    a.cos_sin = cos_sin; a.rope_index = rope_index; a.k_cache8 = k_cache; a.v_cache8 = v_cache;                     \
    a.slot_mapping = slot_mapping; a.M = M; a.N = (H + 2 * Hkv) * D; a.K = K; a.half = D / 2;                       \
    a.H = H; a.Hkv = Hkv; a.D = D; a.eps = eps;                                                                     \
    skinny_impl<T, W, NT, EP_ROPE_KV8, WARPS>(a);                                                                   \
  }
#define SKINNY_ENTRIES(SUFFIX, T, W, MB, NT)                                    \
  SKINNY_ENTRIES_W(SUFFIX, T, W, SK_##W##_PARAMS, SK_##W##_SET, MB, NT, 8, 2, ) \
  SKINNY_ENTRIES_W(SUFFIX, T, W, SK_##W##_PARAMS, SK_##W##_SET, MB, NT, 16, 1, _w16)

SKINNY_ENTRIES(bf16, Bf16, W16, 8, 1)
SKINNY_ENTRIES(bf16, Bf16, W16, 16, 2)
SKINNY_ENTRIES(bf16, Bf16, W16, 32, 4)
SKINNY_ENTRIES(fp16, Fp16, W16, 8, 1)
SKINNY_ENTRIES(fp16, Fp16, W16, 16, 2)
SKINNY_ENTRIES(fp16, Fp16, W16, 32, 4)
// E4M3 weights: CudaOps routes decode batches of up to 8 tokens here (CudaOps.SKINNY_TOKENS; more rows go to W8A8
// GEMMs); the m16 / m32 entries are there to be timed against W8A8 at those rows (bench_kernels --skinny --fp8).
SKINNY_ENTRIES(bf16_fp8, Bf16, E4M3, 8, 1)
SKINNY_ENTRIES(bf16_fp8, Bf16, E4M3, 16, 2)
SKINNY_ENTRIES(bf16_fp8, Bf16, E4M3, 32, 4)
SKINNY_ENTRIES(fp16_fp8, Fp16, E4M3, 8, 1)
// 4-warp blocks, four an SM (suffix _w4), for E4M3 weights up to 8 tokens: a 16-row tile's E4M3 bytes are half a
// 16-bit tile's, so over 4 warps each warp streams as many load groups as an 8-warp block's warps do for 16-bit
// weights, and an SM holds twice the tiles at once (the same 16 warps).
SKINNY_ENTRIES_W(bf16_fp8, Bf16, E4M3, SK_E4M3_PARAMS, SK_E4M3_SET, 8, 1, 4, 4, _w4)
SKINNY_ENTRIES_W(fp16_fp8, Fp16, E4M3, SK_E4M3_PARAMS, SK_E4M3_SET, 8, 1, 4, 4, _w4)
SKINNY_ENTRIES(fp16_fp8, Fp16, E4M3, 16, 2)
SKINNY_ENTRIES(fp16_fp8, Fp16, E4M3, 32, 4)

// W8A8 (E4M3A8, sm_89+: MmaE4M3): skinny_<ep>_bf16_w8a8_m<MB>[_w16], the bf16 entries' epilogues with x as E4M3 bytes
// and its x_scale [M] fp32 right after it, the weight as the _fp8 entries take it, and no NORM (norm_w must be null:
// x arrives normalized and quantized). The value is rounded to bf16 before the epilogue's own arithmetic, as the
// W8A8 GEMM's bf16 output followed by the separate op (engine.quant.w8a8_linear, then TorchOps): CudaOps' W8A8 of
// decode batches of 9-32 rows.
SKINNY_ENTRIES(bf16_w8a8, Bf16, E4M3A8, 8, 1)
SKINNY_ENTRIES(bf16_w8a8, Bf16, E4M3A8, 16, 2)
SKINNY_ENTRIES(bf16_w8a8, Bf16, E4M3A8, 32, 4)
