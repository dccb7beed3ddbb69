"""SlotState: per-slot sequence state that lives on the device, one row per slot.

A decode step reads its inputs from these rows and writes its outputs back, so a steady batch needs
no host-to-device copy between steps.
NOTE: the block table row of a slot never moves, and no tensor here is ever reallocated: CUDA graphs
bake their addresses.

The logits processors' rows (engine/logits_processors.py) are read only by steps whose batch uses a
processor; a slot's rows are written when its sequence starts (assign) and hold neutral values (no bias,
no penalty) where its sequence does not use one. output_counts is kept only for sequences with a frequency
or presence penalty: elsewhere it is stale, and never read with a non-zero weight.

Memory of the processors' state, S slots and a vocabulary of V: output_counts S x V x 2 bytes where
max_seq_len <= 32768 (a count never exceeds the tokens a sequence holds), else 4 bytes: 64 MiB (int16) or
128 MiB (int32) at 256 slots x 128k; the bias and stop tables S x 64 x 20 bytes (320 KiB at 256 slots)."""
from __future__ import annotations

import numpy as np
import torch

from engine.logits_processors import PENALTIES, flags_of
from engine.sampling import (MAX_LOGIT_BIAS, MAX_MIN_TOKENS_STOP_IDS, SamplingParams, SamplingTensors, StoppingCriteria,
                             seed_as_int64)

COUNTS_INT16_MAX_SEQ_LEN = 1 << 15  # up to this many tokens a sequence, an int16 count cannot overflow


def put(t: torch.Tensor, slot: int, value) -> None:
    """t[slot] = value as a fill kernel with the value as its argument: `t[slot] = value` copies the value from
    pageable host memory, which waits for the device work queued before it."""
    t[slot:slot + 1].fill_(value)


class SlotState:
    def __init__(self, max_slots: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device,
                 eos_token_ids: tuple[int, ...] | frozenset[int] = (), max_seq_len: int = 0):
        """eos_token_ids: the model's, masked with a request's stop ids while min_tokens are not out; max_seq_len:
        the most tokens a sequence holds (0: unknown), which bounds output_counts' values."""
        def zeros(*shape, dtype):
            return torch.zeros(shape, dtype=dtype, device=device)

        self.block_table = zeros(max_slots, max_blocks_per_seq, dtype=torch.int32)  # 0 = scratch block
        self.last_token = zeros(max_slots, dtype=torch.int64)  # the next decode step's input
        self.num_cached = zeros(max_slots, dtype=torch.int32)  # tokens in the KV cache
        self.temperature = zeros(max_slots, dtype=torch.float32)
        self.top_k = zeros(max_slots, dtype=torch.int64)
        self.top_p = zeros(max_slots, dtype=torch.float32)
        self.seed = zeros(max_slots, dtype=torch.int64)
        self.repetition_penalty = zeros(max_slots, dtype=torch.float32)
        self.seen = zeros(max_slots, vocab_size, dtype=torch.bool)  # tokens in the sequence (penalty)
        self.true = torch.ones((), dtype=torch.bool, device=device)  # the value index_put_ writes into seen
        # The logits processors (engine/logits_processors.py).
        self.processors = zeros(max_slots, dtype=torch.int32)  # the processor flags of the slot's sequence; 0: none
        self.min_p = zeros(max_slots, dtype=torch.float32)
        self.frequency_penalty = zeros(max_slots, dtype=torch.float32)
        self.presence_penalty = zeros(max_slots, dtype=torch.float32)
        self.bias_ids = zeros(max_slots, MAX_LOGIT_BIAS, dtype=torch.int64)  # unused entries: token 0, bias 0
        self.bias_values = zeros(max_slots, MAX_LOGIT_BIAS, dtype=torch.float32)
        self.stop_ids = zeros(max_slots, MAX_MIN_TOKENS_STOP_IDS, dtype=torch.int64)  # masked with eos_ids ...
        self.stop_valid = zeros(max_slots, MAX_MIN_TOKENS_STOP_IDS, dtype=torch.bool)  # ... where valid
        self.min_tokens = zeros(max_slots, dtype=torch.int64)
        self.prompt_len = zeros(max_slots, dtype=torch.int64)  # set when the prompt completes (start_output)
        eos = sorted(t for t in eos_token_ids if 0 <= t < vocab_size)  # an id outside could never be sampled
        self.eos_ids = torch.tensor(eos, dtype=torch.int64, device=device)  # [E]
        small = 0 < max_seq_len <= COUNTS_INT16_MAX_SEQ_LEN
        self.output_counts = zeros(max_slots, vocab_size, dtype=torch.int16 if small else torch.int32)
        # Structured output (TOKEN_MASK): the allowed-token mask of each slot's next sampled token, bit t % 32 of
        # word t // 32 allowing token t (xgrammar's bitmask layout); read only for rows whose sequence uses one.
        words = -(-vocab_size // 32)
        self.token_mask = zeros(max_slots, words, dtype=torch.int32)
        self._mask_host = torch.zeros((max_slots, words), dtype=torch.int32, pin_memory=device.type == "cuda")
        # The block-table rows' host side (start_row): max_slots x max_blocks_per_seq x 4 bytes of pinned memory,
        # with each slot's (device row, pinned row) views and a numpy view of the pinned rows made once: right after
        # a forward the host's first tensor ops are slow (~20-50 us each), and a prompt's start waits for them.
        self._row_host = torch.zeros(self.block_table.shape, dtype=torch.int32, pin_memory=device.type == "cuda")
        self._row_np = self._row_host.numpy()
        self._row_pairs = list(zip(self.block_table.unbind(0), self._row_host.unbind(0)))
        # Token t's byte in a mask read as bytes (little-endian words: bit t % 8 of byte t // 8) and its bit there:
        # a step unpacks masks one byte per token, not four.
        vocab = torch.arange(vocab_size, device=device)
        self.mask_byte, self.mask_bit = vocab // 8, (vocab % 8).to(torch.uint8)

    def mark_seen(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """seen[slots[i], token_ids[i]] = True, with device tensors only (capturable in a CUDA graph)."""
        self.seen.index_put_((slots, token_ids), self.true)

    def count_outputs(self, slots: torch.Tensor, token_ids: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """output_counts[slots[i], token_ids[i]] += 1 (or weights[i], in output_counts' dtype); repeated pairs add
        up. Device tensors only (capturable: index_add_ is one atomic-add kernel, no host sync)."""
        counts = self.output_counts
        flat = slots.long() * counts.shape[1] + token_ids.long()
        if weights is None:
            weights = torch.ones(flat.shape, dtype=counts.dtype, device=counts.device)
        counts.view(-1).index_add_(0, flat, weights)

    def rebuild_seen(self, slot: int, token_ids: list[int], prompt_len: int = 0, counts: bool = False) -> None:
        """seen[slot] from scratch: exactly token_ids (after the history was rewritten or rolled back); with
        counts, output_counts[slot] too, from the output tokens token_ids[prompt_len:]."""
        dev = self.seen.device
        self.seen[slot] = False
        self.seen[slot, torch.tensor(token_ids, device=dev)] = True
        if counts:  # (index_add_, not bincount: bincount reads its maximum back to the host)
            out = torch.tensor(token_ids[prompt_len:], dtype=torch.int64, device=dev)
            row = self.output_counts[slot]
            row.zero_()
            row.index_add_(0, out, torch.ones(out.shape, dtype=row.dtype, device=dev))

    def set_token_mask(self, slot: int, words: np.ndarray) -> None:
        """The slot's token mask (int32 [ceil(V / 32)]), copied through a pinned row on the current stream
        without a host wait. The caller rewrites a slot's mask only once the step that read the last one has
        finished (so the pinned row's last copy has run)."""
        host = self._mask_host[slot]
        host.numpy()[:] = words
        self.token_mask[slot].copy_(host, non_blocking=True)

    def set_blocks(self, slot: int, start: int, block_ids: list[int]) -> None:
        """block_table[slot, start:start + len(block_ids)] = block_ids (a sequence's row grows as it takes its
        blocks; entries past them stay 0, the scratch block). No step in flight may read the row. Called on the
        stream of the forwards that read the row (the compute stream: dispatch.on_device), which the copy is
        queued on."""
        if block_ids:
            # From pageable memory without waiting for the device: the driver stages the bytes before it returns.
            row = torch.from_numpy(np.asarray(block_ids, dtype=np.int32))
            self.block_table[slot, start:start + len(block_ids)].copy_(row, non_blocking=True)

    def assign(self, slot: int, block_ids: list[int], params: SamplingParams,
               stopping: StoppingCriteria | None = None) -> None:
        """A sequence starts in the slot: its block-table row and its sampling rows."""
        self.start_row(slot, block_ids)
        self.assign_sampling(slot, params, stopping)

    def start_row(self, slot: int, block_ids: list[int]) -> None:
        """The slot's block-table row: block_ids, then 0 (the scratch block) to its end, in one copy through the
        slot's pinned row (an asynchronous DMA: a copy from pageable memory makes the driver stage the bytes
        first). No step in flight may read the row; called on the forwards' stream, as set_blocks. The pinned row
        is rewritten only when the next sequence starts in the slot: by then this copy has run, or, if the
        sequence was released before its forward ran, both copies write the same device row in stream order and
        the later one, with the new row, lands last."""
        host, n = self._row_np[slot], len(block_ids)
        host[:n] = block_ids
        host[n:] = 0
        device_row, pinned_row = self._row_pairs[slot]
        device_row.copy_(pinned_row, non_blocking=True)

    def assign_sampling(self, slot: int, params: SamplingParams, stopping: StoppingCriteria | None = None) -> None:
        """The slot's sampling and step rows (last token, cached count, parameters, seen tokens, processors). A
        prefill's forward reads none of them: the prefill queues these writes behind its forward's launch, so the
        device runs the forward while the host issues them."""
        put(self.last_token, slot, 0)
        put(self.num_cached, slot, 0)
        put(self.temperature, slot, params.temperature)
        put(self.top_k, slot, params.top_k)
        put(self.top_p, slot, params.top_p)
        put(self.seed, slot, seed_as_int64(params.seed))
        put(self.repetition_penalty, slot, params.repetition_penalty)
        self.seen[slot] = False
        self._assign_processors(slot, params, stopping or StoppingCriteria())

    def _assign_processors(self, slot: int, params: SamplingParams, stopping: StoppingCriteria) -> None:
        """The slot's processor rows: its flags always (a step reads a row's processors by them), the rest only
        for a sequence that uses one (a slot with flags 0 is never read)."""
        flags = flags_of(params, stopping)
        put(self.processors, slot, flags)
        if not flags:
            return
        put(self.min_p, slot, params.min_p)
        put(self.frequency_penalty, slot, params.frequency_penalty)
        put(self.presence_penalty, slot, params.presence_penalty)
        bias_ids = [t for t, _ in params.logit_bias] + [0] * (MAX_LOGIT_BIAS - len(params.logit_bias))
        bias_values = [b for _, b in params.logit_bias] + [0.0] * (MAX_LOGIT_BIAS - len(params.logit_bias))
        stops = sorted(stopping.stop_token_ids) if stopping.min_tokens else []
        stop_ids = stops + [0] * (MAX_MIN_TOKENS_STOP_IDS - len(stops))
        # One upload for the three tables (a pageable copy waits for the device work queued before it); float64
        # holds the token ids exactly.
        table = torch.tensor(bias_ids + stop_ids + bias_values, dtype=torch.float64).to(self.bias_ids.device)
        self.bias_ids[slot] = table[:MAX_LOGIT_BIAS].long()
        self.stop_ids[slot] = table[MAX_LOGIT_BIAS:MAX_LOGIT_BIAS + MAX_MIN_TOKENS_STOP_IDS].long()
        self.bias_values[slot] = table[MAX_LOGIT_BIAS + MAX_MIN_TOKENS_STOP_IDS:].float()
        self.stop_valid[slot] = False
        self.stop_valid[slot, :len(stops)] = True
        put(self.min_tokens, slot, stopping.min_tokens)
        if flags & PENALTIES:
            self.output_counts[slot].zero_()

    def start_output(self, slots: torch.Tensor, prompt_lens: torch.Tensor) -> None:
        """The prompts of these slots are complete (prompt_lens tokens each): min_tokens counts from here."""
        self.prompt_len[slots] = prompt_lens.long()

    def sampling_rows(self, slots: torch.Tensor, position: torch.Tensor) -> SamplingTensors:
        """Sampling parameters of the given slots (one row each); position: the index of the token
        each row draws."""
        return SamplingTensors(self.temperature[slots], self.top_k[slots], self.top_p[slots], self.seed[slots],
                               self.repetition_penalty[slots], self.seen[slots], position)
