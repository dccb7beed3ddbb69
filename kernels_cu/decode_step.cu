// Op: decode step state, the slot-resident state a decode (or uniform Verify) step reads before its
// forward (decode_prepare) and writes back after sampling (decode_commit, verify_commit). Reference:
// engine/ops/torch_ops.py `TorchOps.decode_inputs` / `decode_commit` / `verify_inputs` / `verify_commit`
// (engine/batch.py `build_decode_batch`, engine/state.py `SlotState.sampling_rows`).
//
// decode_prepare, n = rows_per_slot rows per slot (1: decode; k + 1: Verify of k drafts), for each row
// r = b n + i with s = slots[b], p = num_cached[s] + i:
//   input_ids[r] = i == 0 ? last_token[s] : drafts[b, i - 1];  positions[r] = p;  seq_lens[r] = p + 1;
//   row_position[r] = p + 1
//   slot_mapping[r] = block_table[s, p / block_size] * block_size + p % block_size   (64-bit product)
//   tables[r, :] = block_table[s, :];  row_seen[r, :] = seen[s, :] | {drafts[b, j] : j < i}  where penalty[s] != 1
//     (the sampling kernels read a row's seen only when its penalty is not 1: the rows of the others are
//     left as they were, so a batch with no repetition penalty copies no 125 KiB rows at a 128k vocabulary)
//   row_{temperature, top_k, top_p, seed, penalty}[r] = {temperature, top_k, top_p, seed, penalty}[s]
// decode_commit, for each row b with s = slots[b], t = tokens[b], p = num_cached[s] (the slots of one call
// are distinct):
//   num_cached[s] = p + 1;  last_token[s] = t;  seen[s, t] = true;
//   out_tokens[s, p % R] = t;  out_logprobs[s, p % R] = logprobs[b]
//   (the results are kept per slot and position, in R entries a slot, so the host can read them straight
//   from mapped pinned memory while later steps of the same slots already write theirs: engine/outputs.py)
// verify_commit, for each slot row b (s = slots[b], sampled[b, :] the n = k + 1 tokens its rows drew):
//   a = the length of the prefix where sampled[b, j] == drafts[b, j];  t = sampled[b, a]
//   num_cached[s] += 1 + a;  last_token[s] = t;  seen[s, e_i] = true for e_i = i <= a ? sampled[b, i] : t
//   out_accepted[b] = a;  out_tokens[b] = t;  out_logprobs[b, i] = logprobs[b n + i] (i < n)
// Slot and token values are not checked on the host (that would need a sync). Two guards keep a bad
// value from writing outside its tensor: p / block_size outside [0, MB) gives slot_mapping -1 (no
// cache write, as in rope_cache_write), and a token outside [0, V) leaves seen unchanged.
//
// Layouts (contiguous unless a stride is given; S = max slots, MB = max blocks per sequence, V = vocab):
//   slots [B] i64;  num_cached [S] i32;  last_token [S] i64;  block_table [S, MB] i32;
//   temperature, top_p, penalty [S] fp32;  top_k, seed [S] i64;  seen [S, V] bool (1 byte);
//   drafts [B, n - 1] i64 with row stride draft_stride (null when n == 1).
//   decode_prepare outputs (R = B n rows): input_ids, positions, slot_mapping, row_position [R] i64;
//     seq_lens [R] i32;  tables [R, MB] i32;  row_temperature, row_top_p, row_penalty [R] fp32;
//     row_top_k, row_seed [R] i64;  row_seen [R, V] bool.
//   decode_commit: tokens [B] i64, logprobs [B] fp32;  out_tokens [S, R] i64, out_logprobs [S, R] fp32, R >= 1
//     (device memory, or pinned host memory: unified addressing maps it at the same address).
//   verify_commit: sampled [B n] i64, logprobs [B n] fp32;  out_accepted, out_tokens [>= B] i64;
//     out_logprobs [>= B, n] fp32 with row stride out_stride.
// Launch contract:
//   decode_prepare: grid (B n, P), block 256, no dynamic shared memory. Block (r, part) copies part
//     `part` of P equal pieces of row r's seen row (16-byte vectors where V % 16 == 0 and both seen
//     tensors are 16-byte aligned, single bytes otherwise): a vocabulary of 128k is 125 KiB a row, too
//     much for one block; then it marks the drafts before row r's that fall in its piece. Block (r, 0)
//     also copies the table row, and its thread 0 writes the scalars. block_size > 0; P >= 1.
//   decode_commit, verify_commit: grid (ceil(B / 128)), block 128; thread b handles row b.
//   B == 0: no launch.
//   Programmatic dependent launch (the launch attribute; a no-op without it): each kernel waits at its
//   top and reads nothing before (common.cuh, grid_dependency_wait).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(256)
    decode_prepare(i64* __restrict__ input_ids, i64* __restrict__ positions, i64* __restrict__ slot_mapping,
                   int* __restrict__ seq_lens, int* __restrict__ tables, float* __restrict__ row_temperature,
                   i64* __restrict__ row_top_k, float* __restrict__ row_top_p, i64* __restrict__ row_seed,
                   float* __restrict__ row_penalty, i64* __restrict__ row_position,
                   unsigned char* __restrict__ row_seen,
                   const i64* __restrict__ slots, const int* __restrict__ num_cached,
                   const i64* __restrict__ last_token, const int* __restrict__ block_table,
                   const float* __restrict__ temperature, const i64* __restrict__ top_k,
                   const float* __restrict__ top_p, const i64* __restrict__ seed, const float* __restrict__ penalty,
                   const unsigned char* __restrict__ seen, int max_blocks, i64 vocab, int block_size,
                   const i64* __restrict__ drafts, i64 draft_stride, int rows_per_slot) {
  wait_then_allow_dependents();
  const int r = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  const int b = r / rows_per_slot, i = r - b * rows_per_slot;  // row i of slot row b
  const i64 s = slots[b];
  const i64* row_drafts = drafts + b * draft_stride;

  const int* table_src = block_table + s * max_blocks;
  if (part == 0) {
    int* table_dst = tables + (i64)r * max_blocks;
    for (int i = threadIdx.x; i < max_blocks; i += blockDim.x) table_dst[i] = table_src[i];
  }

  if (part == 0 && threadIdx.x == 0) {
    const int p = num_cached[s] + i;
    const int block = p / block_size;
    input_ids[r] = i == 0 ? last_token[s] : row_drafts[i - 1];
    positions[r] = p;
    slot_mapping[r] = (p < 0 || block >= max_blocks)
                          ? -1
                          : (i64)table_src[block] * block_size + p % block_size;
    seq_lens[r] = p + 1;
    row_position[r] = (i64)p + 1;
    row_temperature[r] = temperature[s];
    row_top_k[r] = top_k[s];
    row_top_p[r] = top_p[s];
    row_seed[r] = seed[s];
    row_penalty[r] = penalty[s];
  }
  if (penalty[s] == 1.f) return;  // uniform over the block

  const unsigned char* seen_src = seen + s * vocab;
  unsigned char* seen_dst = row_seen + (i64)r * vocab;
  const bool aligned = ((vocab & 15) == 0) && (((u64)seen | (u64)row_seen) & 15) == 0;
  if (aligned) {
    const Vec16* src = reinterpret_cast<const Vec16*>(seen_src);
    Vec16* dst = reinterpret_cast<Vec16*>(seen_dst);
    const i64 num_vec = vocab >> 4;
    const i64 hi = num_vec * (part + 1) / parts;
    for (i64 v = num_vec * part / parts + threadIdx.x; v < hi; v += blockDim.x) dst[v] = src[v];
  } else {
    const i64 hi = vocab * (part + 1) / parts;
    for (i64 v = vocab * part / parts + threadIdx.x; v < hi; v += blockDim.x) seen_dst[v] = seen_src[v];
  }
  if (i > 0) {  // the drafts before this row count as seen; each piece marks its own range after copying it
    const i64 unit = aligned ? 16 : 1, units = vocab / unit;
    const i64 lo = units * part / parts * unit, hi = units * (part + 1) / parts * unit;
    __syncthreads();
    for (int j = threadIdx.x; j < i; j += blockDim.x) {
      const i64 t = row_drafts[j];
      if (t >= lo && t < hi) seen_dst[t] = 1;
    }
  }
}

extern "C" __global__ void __launch_bounds__(128)
    decode_commit(i64* __restrict__ out_tokens, float* __restrict__ out_logprobs, int ring,
                  int* __restrict__ num_cached, i64* __restrict__ last_token, unsigned char* __restrict__ seen,
                  const i64* __restrict__ slots, const i64* __restrict__ tokens, const float* __restrict__ logprobs,
                  int batch, i64 vocab) {
  wait_then_allow_dependents();
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const i64 s = slots[b];
  const i64 t = tokens[b];
  const float lp = logprobs[b];
  const int p = num_cached[s];
  num_cached[s] = p + 1;
  last_token[s] = t;
  if (t >= 0 && t < vocab) seen[s * vocab + t] = 1;
  const i64 entry = s * ring + (p >= 0 ? p % ring : 0);  // a negative count (never the engine's) stays in the row
  out_tokens[entry] = t;
  out_logprobs[entry] = lp;
}

// Thread b reads its rows of sampled / logprobs and drafts before any of its writes.
extern "C" __global__ void __launch_bounds__(128)
    verify_commit(i64* out_accepted, i64* out_tokens, float* out_logprobs, int* num_cached, i64* last_token,
                  unsigned char* seen, const i64* slots, const i64* drafts, const i64* sampled,
                  const float* logprobs, int batch, int k, i64 draft_stride, int out_stride, i64 vocab) {
  wait_then_allow_dependents();
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const int n = k + 1;
  const i64 s = slots[b];
  const i64* row = sampled + (i64)b * n;
  const i64* d = drafts + b * draft_stride;
  int a = 0;
  while (a < k && row[a] == d[a]) ++a;
  const i64 t = row[a];
  for (int i = 0; i < n; ++i) {
    const i64 e = i <= a ? row[i] : t;
    if (e >= 0 && e < vocab) seen[s * vocab + e] = 1;
    out_logprobs[(i64)b * out_stride + i] = logprobs[(i64)b * n + i];
  }
  num_cached[s] += 1 + a;
  last_token[s] = t;
  out_accepted[b] = a;
  out_tokens[b] = t;
}
