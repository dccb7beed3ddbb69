// Shared device helpers for every kernels_cu/*.cu file.
//
// No system or CUDA headers: NVRTC compiles these files at run time without a CUDA include path
// (engine/cuda/build.py hands it the *.cuh files as named headers), so dtype conversions are
// inline PTX and the vector types are our own.
//
// Activation dtypes: `Bf16` and `Fp16` are tag types with static conversion helpers. Storage is
// always u16 (raw 16-bit patterns); arithmetic is fp32.
#pragma once

typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

#define NEG_INF (__int_as_float(0xff800000))
#define FULL_MASK 0xffffffffu

// 16 bytes: 8 half-precision values, or 4 floats.
struct alignas(16) Vec16 {
  u32 w[4];
};
// 8 bytes: 4 half-precision values.
struct alignas(8) Vec8 {
  u32 w[2];
};

struct Bf16 {
  static __device__ __forceinline__ float to_float(u16 h) { return __uint_as_float(((u32)h) << 16); }
  static __device__ __forceinline__ u16 from_float(float f) {
    u16 r;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
  }
  // Two floats -> one register: lo in bits 0..15 (the lower address), hi in bits 16..31.
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

struct Fp16 {
  static __device__ __forceinline__ float to_float(u16 h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
  }
  static __device__ __forceinline__ u16 from_float(float f) {
    u16 r;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
    return r;
  }
  static __device__ __forceinline__ u32 pack(float lo, float hi) {
    u32 r;
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
  }
};

// Round a float to the activation dtype and back (what torch does between two eager ops).
template <class T>
__device__ __forceinline__ float round_to(float f) {
  return T::to_float(T::from_float(f));
}

template <class T>
__device__ __forceinline__ float lo_of(u32 w) { return T::to_float((u16)(w & 0xffffu)); }
template <class T>
__device__ __forceinline__ float hi_of(u32 w) { return T::to_float((u16)(w >> 16)); }

// 8 half-precision values <-> 8 floats.
template <class T>
__device__ __forceinline__ void unpack8(const Vec16& v, float (&f)[8]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = lo_of<T>(v.w[i]);
    f[2 * i + 1] = hi_of<T>(v.w[i]);
  }
}
template <class T>
__device__ __forceinline__ Vec16 pack8(const float (&f)[8]) {
  Vec16 v;
#pragma unroll
  for (int i = 0; i < 4; ++i) v.w[i] = T::pack(f[2 * i], f[2 * i + 1]);
  return v;
}

// ---------------------------------------------------------------------------------------------
// Reductions.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL_MASK, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
  return v;
}

// (value, index) argmax with torch.argmax's tie rule: the larger value wins, equal values keep the
// smaller index. idx < 0 marks "nothing yet".
struct ArgMax {
  float v;
  int i;
};
__device__ __forceinline__ ArgMax argmax_init() { return ArgMax{NEG_INF, -1}; }
__device__ __forceinline__ bool argmax_better(float v, int i, const ArgMax& a) {
  if (i < 0) return false;
  if (a.i < 0) return true;
  return v > a.v || (v == a.v && i < a.i);
}
__device__ __forceinline__ void argmax_merge(ArgMax& a, float v, int i) {
  if (argmax_better(v, i, a)) {
    a.v = v;
    a.i = i;
  }
}
__device__ __forceinline__ ArgMax warp_argmax(ArgMax a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    float v = __shfl_xor_sync(FULL_MASK, a.v, o);
    int i = __shfl_xor_sync(FULL_MASK, a.i, o);
    argmax_merge(a, v, i);
  }
  return a;
}

// Online softmax statistics (running max m, sum of exp(x - m)).
struct SoftmaxStat {
  float m;
  float s;
};
__device__ __forceinline__ SoftmaxStat softmax_merge(SoftmaxStat a, SoftmaxStat b) {
  float m = fmaxf(a.m, b.m);
  if (m == NEG_INF) return SoftmaxStat{NEG_INF, 0.f};
  float s = (a.m == NEG_INF ? 0.f : a.s * expf(a.m - m)) + (b.m == NEG_INF ? 0.f : b.s * expf(b.m - m));
  return SoftmaxStat{m, s};
}
__device__ __forceinline__ SoftmaxStat warp_softmax(SoftmaxStat a) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) {
    SoftmaxStat b{__shfl_xor_sync(FULL_MASK, a.m, o), __shfl_xor_sync(FULL_MASK, a.s, o)};
    a = softmax_merge(a, b);
  }
  return a;
}

// ---------------------------------------------------------------------------------------------
// The counter-based RNG of engine/sampling.py, in native uint32 arithmetic (bit-identical).

#define HASH_MUL 0x45D9F3Bu
#define GOLDEN32 0x9E3779B9u
#define STREAM_TOKEN 0u
#define STREAM_ACCEPT 1u

__device__ __forceinline__ u32 mix32(u32 x) {
  x = ((x >> 16) ^ x) * HASH_MUL;
  x = ((x >> 16) ^ x) * HASH_MUL;
  return (x >> 16) ^ x;
}

// seed: the uint64 bits of the int64 seed; position: int64 (only its low 32 bits enter the hash).
__device__ __forceinline__ u32 counter_hash(u64 seed, i64 position, u32 stream, u32 index) {
  u32 h = mix32(index + stream * GOLDEN32);
  h = mix32(h ^ (u32)((u64)position & 0xffffffffull));
  h = mix32(h ^ (u32)(seed & 0xffffffffull));
  return mix32(h ^ (u32)(seed >> 32));
}

// float32 uniform in (0, 1): ((h >> 9) + 0.5) / 2**23 (every step exact).
__device__ __forceinline__ float uniform01(u64 seed, i64 position, u32 stream, u32 index) {
  u32 h = counter_hash(seed, position, stream, index);
  return ((float)(h >> 9) + 0.5f) * (1.0f / 8388608.0f);
}

// -log(-log(u)) with the accurate logf (these files are built without --use_fast_math).
__device__ __forceinline__ float gumbel_noise(u64 seed, i64 position, u32 index) {
  float u = uniform01(seed, position, STREAM_TOKEN, index);
  return -logf(-logf(u));
}

// ---------------------------------------------------------------------------------------------
// FP8 E4M3: the --kv-cache-dtype fp8 cache (engine/quant.py fp8_kv: scale 1, saturated at +-448), one byte per
// value. Kernels that read or write it take it as `unsigned char*` (entry names with a `kvfp8` part).
//
// Reading, E4M3 -> T exactly on every architecture (no FP8 conversion instruction before sm_89, and the sm_80
// cubin also serves sm_86 / sm_89 devices), two values per step: prmt picks the two bytes, each followed by a byte
// of its sign bit (prmt's sign-replicating select), one shift and one mask move their sign, exponent and mantissa
// bits into T's fields, which gives |v| * 2^-120 as bf16 (exponent bias 127 vs 7) or |v| * 2^-8 as fp16 (bias 15
// vs 7) for every finite v, E4M3's subnormals included (they land on T's subnormals with the same 3 mantissa
// bits), and one fma.rn by the power of two (c = -0: the sign of zeros kept; no .ftz: subnormal inputs kept)
// fixes the bias exactly; |v| <= 448 fits both types. 4 instructions per 2 values. The NaN codes 0x7f / 0xff come
// out as +-480, not NaN: the writers below saturate, so only a NaN k or v puts one in the cache.
// Writing, fp32 -> E4M3 rounded to nearest even and saturated at +-448 (fp8_kv's clamp, then torch's cast):
// cvt.rn.satfinite.e4m3x2.f32 from sm_89 on; before, the same rounding in integer arithmetic
// (fp8_bits_from_float, c10's fp8e4m3fn_from_fp32_value after the clamp), which the sm_80 cubin carries.

__device__ __forceinline__ u32 prmt(u32 a, u32 b, u32 sel) {
  u32 d;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(sel));
  return d;
}
// The prmt selector of x = {byte lo, its sign x 8, byte hi, its sign x 8} (bits 0..31) from bytes lo and hi of
// {b, a} (0..3: a's bytes, 4..7: b's; byte 0 is the lowest address).
__host__ __device__ constexpr u32 fp8_sel(u32 lo, u32 hi) { return lo | (8u | lo) << 4 | hi << 8 | (8u | hi) << 12; }

// The integer half of the read: x as fp8_sel builds it -> the bit patterns of the T pair (byte lo's value in
// bits 0..15), each the E4M3 value / SCALE (a power of two).
template <class T>
struct Fp8Bits;
template <>
struct Fp8Bits<Bf16> {
  static constexpr u32 SCALE = 0x7B807B80u;  // 2^120, twice
  static __host__ __device__ __forceinline__ u32 pair(u32 x) { return (x << 4) & 0x87f087f0u; }
};
template <>
struct Fp8Bits<Fp16> {
  static constexpr u32 SCALE = 0x5C005C00u;  // 2^8, twice
  static __host__ __device__ __forceinline__ u32 pair(u32 x) { return (x << 7) & 0xbf80bf80u; }
};
template <class T>
struct FmaPair;
template <>
struct FmaPair<Bf16> {
  static __device__ __forceinline__ u32 run(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.bf16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
};
template <>
struct FmaPair<Fp16> {
  static __device__ __forceinline__ u32 run(u32 a, u32 b, u32 c) {
    u32 d;
    asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
  }
};
// E4M3 bytes lo and hi of {b, a} (SEL = fp8_sel(lo, hi)) -> one register of two T values (lo's in bits 0..15).
template <class T, u32 SEL>
__device__ __forceinline__ u32 fp8_pair(u32 a, u32 b) {
  return FmaPair<T>::run(Fp8Bits<T>::pair(prmt(a, b, SEL)), Fp8Bits<T>::SCALE, 0x80008000u);
}
// Four E4M3 bytes w (byte 0 at the lowest address) -> T pairs (b0, b1) and (b2, b3).
template <class T>
__device__ __forceinline__ void fp8x4_to_pairs(u32 w, u32& p01, u32& p23) {
  p01 = fp8_pair<T, fp8_sel(0, 1)>(w, 0u);
  p23 = fp8_pair<T, fp8_sel(2, 3)>(w, 0u);
}
// The same bytes -> T pairs (b0, b2) and (b1, b3) (fragments whose order is free).
template <class T>
__device__ __forceinline__ void fp8x4_to_pairs_02_13(u32 w, u32& p02, u32& p13) {
  p02 = fp8_pair<T, fp8_sel(0, 2)>(w, 0u);
  p13 = fp8_pair<T, fp8_sel(1, 3)>(w, 0u);
}

// fp32 -> E4M3 bits (0..255) in integer arithmetic: NaN -> 0x7f | sign; |f| >= 448 -> 0x7e | sign (saturated,
// inf included); below 2^-6 the subnormals, |f| + 2^14 rounding |f| to a multiple of 2^-9 in the fp32 add;
// else 3 mantissa bits rounded to nearest even (a carry moves into the exponent).
__host__ __device__ __forceinline__ u32 fp8_bits_from_float(float f) {
#ifdef __CUDA_ARCH__
  const u32 x = __float_as_uint(f);
#else
  u32 x;
  __builtin_memcpy(&x, &f, 4);
#endif
  const u32 sign = (x >> 24) & 0x80u;
  const u32 a = x & 0x7fffffffu;
  if (a > 0x7f800000u) return sign | 0x7fu;
  if (a >= 0x43e00000u) return sign | 0x7eu;
  if (a < 0x3c800000u) {
#ifdef __CUDA_ARCH__
    const u32 s = __float_as_uint(__fadd_rn(__uint_as_float(a), 16384.0f));
#else
    float af, s_f;
    __builtin_memcpy(&af, &a, 4);
    s_f = af + 16384.0f;
    u32 s;
    __builtin_memcpy(&s, &s_f, 4);
#endif
    return sign | (s - 0x46800000u);
  }
  return sign | (((a + 0xc407ffffu + ((a >> 20) & 1u)) >> 20) & 0xffu);
}
// Two floats -> two E4M3 bytes: lo in bits 0..7 (the lower address), hi in bits 8..15.
__device__ __forceinline__ u32 fp8x2_from_floats(float lo, float hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  u16 d;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(d) : "f"(hi), "f"(lo));
  return d;
#else
  return fp8_bits_from_float(lo) | (fp8_bits_from_float(hi) << 8);
#endif
}
// Four floats -> four E4M3 bytes (f[0] in bits 0..7).
__device__ __forceinline__ u32 fp8x4_from_floats(float f0, float f1, float f2, float f3) {
  return fp8x2_from_floats(f0, f1) | (fp8x2_from_floats(f2, f3) << 16);
}

// ---------------------------------------------------------------------------------------------
// Ampere+ data movement and tensor-core helpers (sm_80 and later).

__device__ __forceinline__ u32 smem_addr(const void* p) {
  u64 a;
  asm("cvta.to.shared.u64 %0, %1;" : "=l"(a) : "l"(p));
  return (u32)a;
}

// 16-byte global -> shared copy; src_bytes = 0 writes zeros (and reads nothing).
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem)), "l"(gmem),
               "r"(src_bytes));
}
// The paged-KV block-table entries of one tile of keys [base, end) (end - base <= 64), read once, one or two per
// lane (independent loads), and handed to the copying threads by shuffles: a table read per copy made every copy wait
// for an L1 round trip. A tile spans at most 64 entries (block_size 1; block_size 2 at an unaligned start: 33).
// Every lane of the warp constructs it and calls at() together (the shuffles), with the same block-uniform bs_log2.
struct TileTable {
  int first, e0, e1;
  __device__ __forceinline__ TileTable(const int* __restrict__ table, int base, int end, int bs_log2, int lane)
      : first(base >> bs_log2) {
    const int last = (end - 1) >> bs_log2;  // the tile's last entry with keys
    e0 = first + lane <= last ? table[first + lane] : 0;
    e1 = bs_log2 <= 1 && first + 32 + lane <= last ? table[first + 32 + lane] : 0;
  }
  __device__ __forceinline__ int at(int pos, int bs_log2) const {  // the entry of key pos of the tile
    const int idx = (pos >> bs_log2) - first;
    int ent = __shfl_sync(FULL_MASK, e0, idx & 31);
    if (bs_log2 <= 1) {
      const int ent1 = __shfl_sync(FULL_MASK, e1, idx & 31);
      if (idx >= 32) ent = ent1;
    }
    return ent;
  }
};

// Thread-block clusters (sm_90): a shared-memory address of this block mapped to the same variable in
// block `rank` of the cluster (distributed shared memory), loads from such an address, and a barrier of
// every thread of the cluster (release / acquire: shared-memory writes before it are visible after it).
#if __CUDA_ARCH__ >= 900
__device__ __forceinline__ u32 cluster_map(const void* smem, u32 rank) {
  u32 out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;\n" : "=r"(out) : "r"(smem_addr(smem)), "r"(rank));
  return out;
}
__device__ __forceinline__ float ld_cluster_f32(u32 addr) {
  float v;
  asm volatile("ld.shared::cluster.f32 %0, [%1];\n" : "=f"(v) : "r"(addr));
  return v;
}
__device__ __forceinline__ float4 ld_cluster_f32x4(u32 addr) {
  float4 v;
  asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];\n"
               : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
               : "r"(addr));
  return v;
}
__device__ __forceinline__ void cluster_sync() {
  asm volatile("barrier.cluster.arrive.release;\nbarrier.cluster.wait.acquire;\n" ::: "memory");
}
#endif
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

__device__ __forceinline__ void ldmatrix_x4(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}
// Two 8x8 matrices: lanes 0-7 address the rows of the first, lanes 8-15 those of the second.
__device__ __forceinline__ void ldmatrix_x2(u32 (&r)[2], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(p)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(u32 (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(p)));
}

// D[16x8] += A[16x16] * B[16x8], fp32 accumulators; A row-major fragments, B "col" fragments.
template <class T>
struct Mma;
template <>
struct Mma<Bf16> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};
template <>
struct Mma<Fp16> {
  static __device__ __forceinline__ void run(float (&d)[4], const u32 (&a)[4], u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, "
        "{%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Programmatic dependent launch (sm_90+; no-ops before, and when the kernel was launched without the
// attribute): a kernel launched with programmatic stream serialization may start while the kernel before
// it in the stream finishes. Before grid_dependency_wait() it must write nothing, and may read only what
// the kernel launched just before it does not write (weights, and what earlier kernels wrote); the wait
// returns once the previous grid has completed and its writes are visible. Every kernel of this kind
// calls allow_dependents() right after its wait (and at least one block of each launch waits), so the
// next one is launched only once this one's predecessor has completed: that is what makes the reads
// before the wait safe. Each kernel's launch contract names what it reads before its wait. Every thread
// of a block calls both.
__device__ __forceinline__ void grid_dependency_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void allow_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}
// Step timeline (bench/trace_step.py; built only with -DMETRALE_TRACE, never by default): thread 0 of each
// block that waits records, when the wait returns, one TraceRecord into the buffer the host points
// `metrale_trace` at (each module has its own copy of the pointer): the wait's begin and end by
// %globaltimer (ns, one clock for every SM) and by clock64 (this SM's cycles), its SM and its grid. The
// record's index comes from one atomic counter, so records are in the order the waits returned: a launch's
// blocks all return from their wait before the next launch starts (each allows its dependents only after
// its own wait). Kernels with a TraceScope (skinny, decode attention) also record when thread 0 leaves.
#ifdef METRALE_TRACE
struct TraceRecord {
  u64 g_wait, g_released, g_end;  // %globaltimer
  u64 c_wait, c_released, c_end;  // clock64
  u32 grid, threads, smid, block;
  u64 c_mark[4];  // clock64 at TRACE_MARK(i) points inside a kernel (0: not reached)
};
struct TraceBuffer {
  u32 count, capacity, pad[2];
  TraceRecord rec[1];
};
extern "C" {
__device__ TraceBuffer* metrale_trace = nullptr;
}
__device__ __forceinline__ u64 trace_gtime() {
  u64 t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ u32 trace_smid() {
  u32 s;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(s));
  return s;
}
__device__ __forceinline__ bool trace_thread0() { return threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0; }
__device__ __forceinline__ int& trace_slot() {
  __shared__ int slot;
  return slot;
}
// This block's record, for thread 0 of a block whose wait made one (null otherwise).
__device__ __forceinline__ TraceRecord* trace_record() {
  TraceBuffer* buf = metrale_trace;
  if (!trace_thread0() || !buf) return nullptr;
  const int slot = trace_slot();
  return slot >= 0 && slot < (int)buf->capacity ? &buf->rec[slot] : nullptr;
}
struct TraceScope {  // thread 0's exit time into this block's record (if it waited)
  __device__ __forceinline__ TraceScope() {
    if (trace_thread0()) trace_slot() = -1;
  }
  __device__ __forceinline__ ~TraceScope() {
    if (TraceRecord* r = trace_record()) {
      r->g_end = trace_gtime();
      r->c_end = clock64();
    }
  }
};
__device__ __forceinline__ void wait_then_allow_dependents() {
  const u64 g0 = trace_gtime(), c0 = clock64();
  grid_dependency_wait();
  TraceBuffer* buf = metrale_trace;
  if (trace_thread0() && buf) {
    const u64 g1 = trace_gtime(), c1 = clock64();
    const u32 slot = atomicAdd(&buf->count, 1u);
    trace_slot() = (int)slot;
    if (slot < buf->capacity) {
      TraceRecord& r = buf->rec[slot];
      r.g_wait = g0; r.g_released = g1; r.g_end = 0;
      r.c_wait = c0; r.c_released = c1; r.c_end = 0;
      r.c_mark[0] = r.c_mark[1] = r.c_mark[2] = r.c_mark[3] = 0;
      r.grid = gridDim.x * gridDim.y * gridDim.z;
      r.threads = blockDim.x * blockDim.y * blockDim.z;
      r.smid = trace_smid();
      r.block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    }
  }
  allow_dependents();
}
__device__ __forceinline__ void trace_mark(int i) {
  if (TraceRecord* r = trace_record()) r->c_mark[i] = clock64();
}
#define TRACE_SCOPE TraceScope trace_scope_
#define TRACE_MARK(i) trace_mark(i)
#else
__device__ __forceinline__ void wait_then_allow_dependents() {
  grid_dependency_wait();
  allow_dependents();
}
#define TRACE_SCOPE
#define TRACE_MARK(i)
#endif
