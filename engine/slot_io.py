"""The slot state a decode or verify step reads and writes on the device (engine/state.py SlotState).

Before the forward, a step gathers its inputs from the rows of its slots (last token, position, block table
row, sampling parameters); after sampling it writes each slot's new length, last token and seen tokens
back (and, in a step with the frequency/presence penalty, its output-token counts), and its results where the
host reads them. Device ops only: both run inside captured CUDA graphs, with no host read of a device value.

SlotIO does it with torch ops (the reference, and the CPU path); KernelSlotIO with one kernel each way
(kernels_cu/decode_step.cu: decode_prepare, decode_commit, verify_commit)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine import sampling
from engine.batch import ForwardBatch, build_decode_batch, decode_batch
from engine.cuda.wrappers import decode_step
from engine.logits_processors import PENALTIES
from engine.state import SlotState

if TYPE_CHECKING:
    from engine.outputs import StepOutputs, VerifyOutputs


class SlotIO:
    def __init__(self, state: SlotState, block_size: int):
        self.state = state
        self.block_size = block_size

    @staticmethod
    def for_ops(ops, state: SlotState, block_size: int) -> "SlotIO":
        """The kernels' SlotIO where the op backend has the kernel library (CudaOps), else the reference."""
        lib = getattr(ops, "lib", None)
        return KernelSlotIO(state, block_size, lib) if lib is not None else SlotIO(state, block_size)

    def decode_inputs(self, slots: torch.Tensor, seq_lens_host: list[int],
                      need_scale_lens: bool) -> tuple[ForwardBatch, sampling.SamplingTensors]:
        """slots [B] int64 -> the step's ForwardBatch (each slot's last token at position num_cached[slot])
        and the sampling rows (its parameters, drawing position num_cached + 1)."""
        state = self.state
        batch = build_decode_batch(state.block_table, state.last_token, state.num_cached, slots, self.block_size,
                                   seq_lens_host, need_scale_lens)
        return batch, state.sampling_rows(slots, batch.positions + 1)

    def decode_commit(self, slots: torch.Tensor, out: sampling.SampleOutput, outputs: StepOutputs,
                      num_top: int, processors: int = 0) -> None:
        """Each slot moves one token on (num_cached + 1, last token = the sampled one, marked seen, and counted
        as an output when the step's processors include the penalties); the token and its logprob go to the
        results kept per slot and position (outputs.slot_tokens / slot_logprobs [S, R] at [slot, num_cached %
        R], num_cached before the step), the top-logprob candidates to the step's static buffers."""
        state, ring = self.state, outputs.rings
        entries = (slots * ring + state.num_cached[slots] % ring).to(outputs.slot_tokens.device)
        outputs.slot_tokens.view(-1)[entries] = out.token_ids.to(outputs.slot_tokens.device)
        outputs.slot_logprobs.view(-1)[entries] = out.logprobs.to(outputs.slot_logprobs.device)
        state.num_cached[slots] += 1
        state.last_token[slots] = out.token_ids
        state.mark_seen(slots, out.token_ids)
        if processors & PENALTIES:
            state.count_outputs(slots, out.token_ids)
        outputs.write_top(out, out.token_ids.shape[0], num_top)

    def verify_inputs(self, slots: torch.Tensor,
                      drafts: torch.Tensor) -> tuple[ForwardBatch, sampling.SamplingTensors]:
        """A uniform Verify's forward and sampling rows: slots [B], drafts [B, k] -> row b (k + 1) + i is
        slot b's last token (i = 0) or draft i - 1, at position num_cached + i (attention per token, like
        decode); it draws the token at position num_cached + i + 1 with the slot's parameters and drafts
        0 .. i - 1 counted as seen (the repetition penalty decode would have applied there)."""
        state, block_size = self.state, self.block_size
        B, k = drafts.shape
        n, dev = k + 1, slots.device
        start = state.num_cached[slots].long()
        offsets = torch.arange(n, device=dev)
        positions = (start[:, None] + offsets).reshape(-1)  # [B n]
        seq_index = torch.arange(B, device=dev).repeat_interleave(n)
        tables = state.block_table[slots][seq_index]
        rows = torch.arange(B * n, device=dev)
        block_ids = tables[rows, positions // block_size].long()
        batch = ForwardBatch(
            input_ids=torch.cat([state.last_token[slots][:, None], drafts], dim=1).reshape(-1), positions=positions,
            slot_mapping=block_ids * block_size + positions % block_size, block_tables=tables,
            seq_lens=(positions + 1).to(torch.int32), logits_indices=rows, is_decode=True,
            query_start_loc=[], seq_lens_host=[], logits_all_rows=True, rows_per_seq=n)
        st = state.sampling_rows(slots[seq_index], positions + 1)
        # Row (b, i) marks drafts j < i as seen: the pairs (i, j) below the diagonal, for every b.
        i, j = torch.tril_indices(n, k, -1, device=dev)
        st.seen.index_put_(((torch.arange(B, device=dev)[:, None] * n + i).reshape(-1), drafts[:, j].reshape(-1)),
                           state.true)
        return batch, st

    def verify_commit(self, slots: torch.Tensor, drafts: torch.Tensor, out: sampling.SampleOutput,
                      outputs: VerifyOutputs, num_top: int, processors: int = 0) -> None:
        """The drafts are accepted while they equal the tokens their rows drew; each slot moves past the
        accepted ones plus the token drawn after them (num_cached, last_token, seen, and the output counts in a
        step with the penalties), and the results go to the Verify step's static buffers."""
        state = self.state
        B, k = drafts.shape
        n = k + 1
        sampled = out.token_ids.view(B, n)
        accepted = (sampled[:, :k] == drafts).long().cumprod(dim=1).sum(dim=1)  # [B]: the matching prefix
        token = sampled.gather(1, accepted[:, None]).squeeze(1)
        offsets = torch.arange(n, device=slots.device)
        emitted = torch.where(offsets[None, :] <= accepted[:, None], sampled, token[:, None])  # then repeats
        state.last_token[slots] = token
        state.num_cached[slots] = (state.num_cached[slots].long() + 1 + accepted).to(torch.int32)
        state.mark_seen(slots.repeat_interleave(n), emitted.reshape(-1))
        if processors & PENALTIES:
            self.count_verified(slots, sampled, accepted)
        outputs.accepted[:B].copy_(accepted)
        outputs.tokens[:B].copy_(token)
        outputs.logprobs[:B, :n].copy_(out.logprobs.view(B, n))
        outputs.write_top(out, B * n, num_top)

    def count_verified(self, slots: torch.Tensor, sampled: torch.Tensor, accepted: torch.Tensor) -> None:
        """Counts the tokens a uniform Verify emitted as outputs: slot b's sampled[b, :accepted[b] + 1] (the
        accepted drafts equal the tokens their rows drew, then the token drawn after them)."""
        counts = self.state.output_counts
        B, n = sampled.shape
        emitted = torch.arange(n, device=slots.device)[None, :] <= accepted[:, None]  # [B, n]
        self.state.count_outputs(slots.repeat_interleave(n), sampled.reshape(-1), emitted.reshape(-1).to(counts.dtype))


class KernelSlotIO(SlotIO):
    """The same through kernels_cu/decode_step.cu: one launch gathers what SlotIO gathers with ~20 ops."""

    def __init__(self, state: SlotState, block_size: int, lib):
        super().__init__(state, block_size)
        self.lib = lib

    def _prepare(self, slots: torch.Tensor, drafts: torch.Tensor | None = None
                 ) -> tuple[tuple[torch.Tensor, ...], sampling.SamplingTensors]:
        """decode_prepare into fresh tensors: one row per slot, or k + 1 per slot with drafts [B, k]. Returns
        ((input_ids, positions, slot_mapping, tables, seq_lens), rows)."""
        state = self.state
        R = slots.shape[0] * (1 if drafts is None else drafts.shape[1] + 1)
        dev = slots.device

        def empty(*shape, like: torch.Tensor) -> torch.Tensor:
            return torch.empty(shape, dtype=like.dtype, device=dev)

        input_ids, positions, slot_mapping = (torch.empty(R, dtype=torch.int64, device=dev) for _ in range(3))
        seq_lens = torch.empty(R, dtype=torch.int32, device=dev)
        tables = empty(R, state.block_table.shape[1], like=state.block_table)
        rows = sampling.SamplingTensors(
            empty(R, like=state.temperature), empty(R, like=state.top_k), empty(R, like=state.top_p),
            empty(R, like=state.seed), empty(R, like=state.repetition_penalty),
            empty(R, state.seen.shape[1], like=state.seen), torch.empty(R, dtype=torch.int64, device=dev))
        decode_step.prepare(self.lib, slots, state.num_cached, state.last_token, state.block_table,
                            state.temperature, state.top_k, state.top_p, state.seed, state.repetition_penalty,
                            state.seen, self.block_size, input_ids, positions, slot_mapping, seq_lens, tables,
                            rows.temperature, rows.top_k, rows.top_p, rows.seed, rows.repetition_penalty,
                            rows.position, rows.seen, drafts=drafts)
        return (input_ids, positions, slot_mapping, tables, seq_lens), rows

    def decode_inputs(self, slots: torch.Tensor, seq_lens_host: list[int],
                      need_scale_lens: bool) -> tuple[ForwardBatch, sampling.SamplingTensors]:
        inputs, rows = self._prepare(slots)
        return decode_batch(*inputs, seq_lens_host, need_scale_lens), rows

    def decode_commit(self, slots: torch.Tensor, out: sampling.SampleOutput, outputs: StepOutputs,
                      num_top: int, processors: int = 0) -> None:
        state = self.state
        decode_step.commit(self.lib, slots, out.token_ids, out.logprobs, state.num_cached, state.last_token,
                           state.seen, outputs.slot_tokens, outputs.slot_logprobs)
        if processors & PENALTIES:  # the kernel keeps no counts: torch ops after it, on the same stream
            state.count_outputs(slots, out.token_ids)
        if num_top:
            n = slots.shape[0]
            outputs.top_ids[:n, :num_top].copy_(out.top_ids)
            outputs.top_logprobs[:n, :num_top].copy_(out.top_logprobs)

    def verify_inputs(self, slots: torch.Tensor,
                      drafts: torch.Tensor) -> tuple[ForwardBatch, sampling.SamplingTensors]:
        (input_ids, positions, slot_mapping, tables, seq_lens), rows = self._prepare(slots, drafts)
        batch = ForwardBatch(input_ids=input_ids, positions=positions, slot_mapping=slot_mapping, block_tables=tables,
                             seq_lens=seq_lens, logits_indices=torch.arange(input_ids.shape[0], device=slots.device),
                             is_decode=True, query_start_loc=[], seq_lens_host=[], logits_all_rows=True,
                             rows_per_seq=drafts.shape[1] + 1)
        return batch, rows

    def verify_commit(self, slots: torch.Tensor, drafts: torch.Tensor, out: sampling.SampleOutput,
                      outputs: VerifyOutputs, num_top: int, processors: int = 0) -> None:
        state = self.state
        decode_step.verify_commit(self.lib, slots, drafts, out.token_ids, out.logprobs, state.num_cached,
                                  state.last_token, state.seen, outputs.accepted, outputs.tokens, outputs.logprobs)
        if processors & PENALTIES:  # from the accepted counts the kernel wrote
            B = slots.shape[0]
            self.count_verified(slots, out.token_ids.view(B, -1), outputs.accepted[:B])
        outputs.write_top(out, out.token_ids.shape[0], num_top)
