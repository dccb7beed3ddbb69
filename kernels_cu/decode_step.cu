// Op: decode step state, the slot-resident state a decode step reads before its forward
// (decode_prepare) and writes back after sampling (decode_commit). Reference: engine/batch.py
// `build_decode_batch`, engine/state.py `SlotState.sampling_rows` and the state updates of
// engine/engine.py `_decode_into_outputs`.
//
// decode_prepare, for each row b with s = slots[b], p = num_cached[s]:
//   input_ids[b] = last_token[s];  positions[b] = p;  seq_lens[b] = p + 1;  row_position[b] = p + 1
//   slot_mapping[b] = block_table[s, p / block_size] * block_size + p % block_size   (64-bit product)
//   tables[b, :] = block_table[s, :];  row_seen[b, :] = seen[s, :]
//   row_{temperature, top_k, top_p, seed, penalty}[b] = {temperature, top_k, top_p, seed, penalty}[s]
// decode_commit, for each row b with s = slots[b], t = tokens[b] (the slots of one call are distinct):
//   num_cached[s] += 1;  last_token[s] = t;  seen[s, t] = true;  out_tokens[b] = t;  out_logprobs[b] = logprobs[b]
// Slot and token values are not checked on the host (that would need a sync). Two guards keep a bad
// value from writing outside its tensor: p / block_size outside [0, MB) gives slot_mapping -1 (no
// cache write, as in rope_cache_write), and a token outside [0, V) leaves seen unchanged.
//
// Layouts (all contiguous; S = max slots, MB = max blocks per sequence, V = vocab size):
//   slots [B] i64;  num_cached [S] i32;  last_token [S] i64;  block_table [S, MB] i32;
//   temperature, top_p, penalty [S] fp32;  top_k, seed [S] i64;  seen [S, V] bool (1 byte).
//   decode_prepare outputs: input_ids, positions, slot_mapping, row_position [B] i64;  seq_lens [B] i32;
//     tables [B, MB] i32;  row_temperature, row_top_p, row_penalty [B] fp32;  row_top_k, row_seed [B] i64;
//     row_seen [B, V] bool.
//   decode_commit: tokens [B] i64, logprobs [B] fp32;  out_tokens [>= B] i64, out_logprobs [>= B] fp32
//     (the first B entries are written).
// Launch contract:
//   decode_prepare: grid (B, P), block 256, no dynamic shared memory. Block (b, part) copies part
//     `part` of P equal pieces of row b's seen row (16-byte vectors where V % 16 == 0 and both seen
//     tensors are 16-byte aligned, single bytes otherwise): a vocabulary of 128k is 125 KiB a row, too
//     much for one block. Block (b, 0) also copies the table row, and its thread 0 writes the
//     scalars. block_size > 0; P >= 1.
//   decode_commit: grid (ceil(B / 128)), block 128; thread b handles row b.
//   B == 0: no launch.
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
                   const unsigned char* __restrict__ seen, int max_blocks, i64 vocab, int block_size) {
  const int b = blockIdx.x, part = blockIdx.y, parts = gridDim.y;
  const i64 s = slots[b];

  const int* table_src = block_table + s * max_blocks;
  if (part == 0) {
    int* table_dst = tables + (i64)b * max_blocks;
    for (int i = threadIdx.x; i < max_blocks; i += blockDim.x) table_dst[i] = table_src[i];
  }

  const unsigned char* seen_src = seen + s * vocab;
  unsigned char* seen_dst = row_seen + (i64)b * vocab;
  const bool aligned = ((vocab & 15) == 0) && (((u64)seen | (u64)row_seen) & 15) == 0;
  if (aligned) {
    const Vec16* src = reinterpret_cast<const Vec16*>(seen_src);
    Vec16* dst = reinterpret_cast<Vec16*>(seen_dst);
    const i64 num_vec = vocab >> 4;
    const i64 hi = num_vec * (part + 1) / parts;
    for (i64 i = num_vec * part / parts + threadIdx.x; i < hi; i += blockDim.x) dst[i] = src[i];
  } else {
    const i64 hi = vocab * (part + 1) / parts;
    for (i64 i = vocab * part / parts + threadIdx.x; i < hi; i += blockDim.x) seen_dst[i] = seen_src[i];
  }

  if (part == 0 && threadIdx.x == 0) {
    const int p = num_cached[s];
    const int block = p / block_size;
    input_ids[b] = last_token[s];
    positions[b] = p;
    slot_mapping[b] = (p < 0 || block >= max_blocks)
                          ? -1
                          : (i64)table_src[block] * block_size + p % block_size;
    seq_lens[b] = p + 1;
    row_position[b] = (i64)p + 1;
    row_temperature[b] = temperature[s];
    row_top_k[b] = top_k[s];
    row_top_p[b] = top_p[s];
    row_seed[b] = seed[s];
    row_penalty[b] = penalty[s];
  }
}

// No __restrict__: tokens / logprobs may be the caller's output buffers themselves (each thread reads
// its element before it writes it).
extern "C" __global__ void __launch_bounds__(128)
    decode_commit(i64* out_tokens, float* out_logprobs, int* num_cached, i64* last_token, unsigned char* seen,
                  const i64* slots, const i64* tokens, const float* logprobs, int batch, i64 vocab) {
  const int b = blockIdx.x * blockDim.x + threadIdx.x;
  if (b >= batch) return;
  const i64 s = slots[b];
  const i64 t = tokens[b];
  const float lp = logprobs[b];
  num_cached[s] += 1;
  last_token[s] = t;
  if (t >= 0 && t < vocab) seen[s * vocab + t] = 1;
  out_tokens[b] = t;
  out_logprobs[b] = lp;
}
