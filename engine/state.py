"""SlotState: per-slot sequence state that lives on the device, one row per slot.

A decode step reads its inputs from these rows and writes its outputs back, so a steady batch needs
no host-to-device copy between steps.
NOTE: the block table row of a slot never moves, and no tensor here is ever reallocated: CUDA graphs
bake their addresses."""
from __future__ import annotations

import torch

from engine.sampling import SamplingParams, SamplingTensors, seed_as_int64


class SlotState:
    def __init__(self, max_slots: int, max_blocks_per_seq: int, vocab_size: int, device: torch.device):
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

    def mark_seen(self, slots: torch.Tensor, token_ids: torch.Tensor) -> None:
        """seen[slots[i], token_ids[i]] = True, with device tensors only (capturable in a CUDA graph)."""
        self.seen.index_put_((slots, token_ids), self.true)

    def rebuild_seen(self, slot: int, token_ids: list[int]) -> None:
        """seen[slot] from scratch: exactly token_ids (after the history was rewritten or rolled back)."""
        self.seen[slot] = False
        self.seen[slot, torch.tensor(token_ids, device=self.seen.device)] = True

    def set_blocks(self, slot: int, start: int, block_ids: list[int]) -> None:
        """block_table[slot, start:start + len(block_ids)] = block_ids (a sequence's row grows as it takes its
        blocks; entries past them stay 0, the scratch block). No step in flight may read the row."""
        if block_ids:
            self.block_table[slot, start:start + len(block_ids)] = torch.tensor(block_ids, dtype=torch.int32)

    def assign(self, slot: int, block_ids: list[int], params: SamplingParams) -> None:
        self.block_table[slot].zero_()
        self.set_blocks(slot, 0, block_ids)
        self.last_token[slot] = 0
        self.num_cached[slot] = 0
        self.temperature[slot] = params.temperature
        self.top_k[slot] = params.top_k
        self.top_p[slot] = params.top_p
        self.seed[slot] = seed_as_int64(params.seed)
        self.repetition_penalty[slot] = params.repetition_penalty
        self.seen[slot] = False

    def sampling_rows(self, slots: torch.Tensor, position: torch.Tensor) -> SamplingTensors:
        """Sampling parameters of the given slots (one row each); position: the index of the token
        each row draws."""
        return SamplingTensors(self.temperature[slots], self.top_k[slots], self.top_p[slots], self.seed[slots],
                               self.repetition_penalty[slots], self.seen[slots], position)
