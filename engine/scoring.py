"""Scorer: teacher-forced log-probabilities of a whole token sequence (what perplexity and top-1 agreement
against a reference model are measured with), like vLLM's prompt_logprobs.

One call prefills the tokens into a scratch slot and KV blocks of its own (no prefix cache: nothing is
shared or registered), with logits for every row, and gives the slot and blocks back before it returns.
It runs eagerly (no CUDA graphs), in forwards of at most max_prefill_tokens tokens, each continuing the
KV the previous one wrote; the caller has finished every decode step in flight."""
from __future__ import annotations

import torch

from engine.batch import build_extend_batch
from engine.errors import InvalidArgument, ResourceExhausted
from engine.prefix_cache import BlockPool
from engine.runtime import Runtime
from engine.sequence import SequenceTable, SlotTable
from engine.sequence_blocks import SequenceBlocks


class Scorer:
    def __init__(self, rt: Runtime, sequences: SequenceTable, slots: SlotTable, blocks: BlockPool):
        self.rt = rt
        self.sequences = sequences
        self.slots = slots
        self.blocks = blocks

    def score(self, token_ids: list[int]) -> torch.Tensor:
        """[len(token_ids), vocab] fp32 log-softmax rows on the CPU: row i is the model's distribution of the
        token after token_ids[:i + 1], so row i's entry at token_ids[i + 1] is that token's log-probability.
        Raises InvalidArgument (empty, too long, ids outside the vocabulary) or ResourceExhausted (no free
        slot or too few KV blocks) before anything changes."""
        rt = self.rt
        if not 1 <= len(token_ids) <= rt.max_seq_len:
            raise InvalidArgument(f"a scored sequence holds 1 to {rt.max_seq_len} tokens (--max-seq-len), "
                                  f"got {len(token_ids)}")
        self.sequences.check_tokens(token_ids, "token_ids")
        if not self.slots.can_allocate():
            raise ResourceExhausted(f"all {self.rt.config.max_slots} sequence slots are in use (--max-slots)")
        blocks = SequenceBlocks(self.blocks, -(-len(token_ids) // rt.block_size), caching=False)
        slot = self.slots.allocate()
        try:
            rt.state.set_blocks(slot, 0, blocks.grow_all())
            rows = []
            chunk = rt.config.max_prefill_tokens
            with rt.dispatch.on_device():
                for start in range(0, len(token_ids), chunk):
                    tokens = token_ids[start:start + chunk]
                    batch = build_extend_batch(rt.state.block_table, [slot], [start], [tokens],
                                               [list(range(len(tokens)))], rt.block_size, rt.device, rt.dynamic_rope)
                    rows.append(torch.log_softmax(rt.model.forward(batch).float(), dim=-1).cpu())
            return torch.cat(rows)
        finally:
            blocks.release()
            self.slots.free(slot)
