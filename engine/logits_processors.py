"""Logits processors: min_tokens, logit_bias, the penalties and min_p, applied to a step's fp32 logits before the
sampling op (ops.sample), in the order of vLLM's sampler (vllm/v1/sample/sampler.py):

  0. (before all of them, as vLLM applies the structured-output bitmask to the logits its sampler takes) the
     token mask of a TOKEN_MASK row: -inf where it disallows the token; its logprobs are the masked logits'.
  1. min_tokens: while a row's sequence has fewer than min_tokens new tokens, its stop_token_ids and the model's
     EOS ids get -inf (vLLM masks the EOS ids whatever ignore_eos says; so does this).
  2. logit_bias: logit[t] += bias[t].
  3. penalties, on the biased logits: the repetition penalty (HF style, over the prompt and output tokens:
     `seen`), then logit[t] -= frequency_penalty * count[t], then -= presence_penalty * (count[t] > 0), where
     count[t] is the token's occurrences in the OUTPUT so far (vLLM's apply_penalties).
  4. min_p, which vLLM applies after temperature: token t is dropped when p[t] < min_p * max p with
     p = softmax(logits / T), i.e. when logit[t] < max logit + T * ln(min_p); greedy rows skip it (the most
     likely token always stays).
ops.sample then does temperature, top-k, top-p and the draw, with the repetition penalty of processed rows set
to 1 (step 3 applied it, where vLLM's order puts it).

Rows: a row is processed when its slot's sequence uses a processor (SlotState.processors != 0); every other row
leaves apply() bit for bit as it came in (one final select), so it samples exactly what it samples in a batch
without processors, on either backend.

Cost and graphs: a step calls this only when a row of its batch uses a processor. Which processors it computes
(flags: the OR over its sequences of flags_of) is part of the step's shape, so of its CUDA graph key (decode:
BatchPlan.decode_key; uniform verify: its run_slots shape): a batch without processors replays the graphs it
always did, and runs none of this. Device ops only, shapes from the batch and the flags: capturable.

Logprobs: vLLM's default (logprobs_mode "raw_logprobs") returns the log-softmax of the model's raw logits,
before any processor, penalty or temperature; so does this (the proto's Token.logprob says the same): processed
rows take theirs, and their top alternatives, from the raw logits."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from engine.sampling import (LOGIT_BIAS, MIN_P, MIN_TOKENS, PENALTIES, REPETITION, TOKEN_MASK, SampleOutput,
                             SamplingParams, SamplingTensors, StoppingCriteria, model_logprobs, penalized_logits)

if TYPE_CHECKING:
    from engine.state import SlotState

__all__ = ["LOGIT_BIAS", "MIN_P", "MIN_TOKENS", "PENALTIES", "REPETITION", "TOKEN_MASK", "ProcessorRows", "apply",
           "batch_flags", "flags_of", "graph_key", "sample"]


def flags_of(sampling: SamplingParams, stopping: StoppingCriteria) -> int:
    """The processors a sequence uses (0: none; it never enters this module). The flags are defined beside the
    parameters (engine/sampling.py): MIN_TOKENS, LOGIT_BIAS, PENALTIES (frequency/presence), MIN_P, and
    REPETITION, set only with another: a processed row's repetition penalty is applied here, in vLLM's place."""
    flags = sampling.processors | stopping.processors
    return flags if flags != REPETITION else 0


def graph_key(flags: int) -> tuple[int, ...]:
    """What the flags add to a step's graph key and shape: nothing without processors, so such a step keeps the
    key (and graph) it has without this module."""
    return (flags,) if flags else ()


def batch_flags(seqs) -> int:
    """The processors a step over these Sequences computes: those any of them uses (flags_of, inlined: a new
    decode batch reads it for each of up to max_batch_size sequences)."""
    flags = 0
    for seq in seqs:
        f = seq.sampling.processors | seq.stopping.processors
        if f != REPETITION:
            flags |= f
    return flags


@dataclass
class ProcessorRows:
    """Per-row processor parameters of a step's R rows (ProcessorRows.gather): what `flags` needs only."""

    flags: int
    used: torch.Tensor  # [R] bool: the row's sequence uses a processor
    min_p: torch.Tensor  # [R] float32
    frequency_penalty: torch.Tensor  # [R] float32
    presence_penalty: torch.Tensor  # [R] float32
    bias_ids: torch.Tensor | None  # [R, MAX_LOGIT_BIAS] int64 (LOGIT_BIAS)
    bias_values: torch.Tensor | None  # [R, MAX_LOGIT_BIAS] float32; unused entries add 0 to token 0
    stop_ids: torch.Tensor | None  # [R, MAX_MIN_TOKENS_STOP_IDS + E] int64: stop ids, then the EOS ids (MIN_TOKENS)
    stop_values: torch.Tensor | None  # [R, same] float32: -inf where masked now, else 0
    counts: torch.Tensor | None  # [R, V] float32: output-token counts before the row's token (PENALTIES; apply()
    # consumes them)
    token_mask: torch.Tensor | None = None  # [R, ceil(V / 32)] int32: the rows' token masks (TOKEN_MASK) ...
    masked: torch.Tensor | None = None  # [R] bool: ... of the rows whose sequence uses one
    mask_byte: torch.Tensor | None = None  # [V]: token t's byte in a mask read as bytes (SlotState.mask_byte) ...
    mask_bit: torch.Tensor | None = None  # [V]: ... and its bit there

    @classmethod
    def gather(cls, state: SlotState, slots: torch.Tensor, position: torch.Tensor, flags: int) -> ProcessorRows:
        """The rows of the given slots (one row each, a slot may repeat); position [R]: the index in its
        sequence of the token each row draws (its sequence has position - prompt_len new tokens before it)."""
        bias_ids = bias_values = stop_ids = stop_values = counts = None
        if flags & LOGIT_BIAS:
            bias_ids, bias_values = state.bias_ids[slots], state.bias_values[slots]
        if flags & MIN_TOKENS:
            rows = slots.shape[0]
            early = (position.long() - state.prompt_len[slots]) < state.min_tokens[slots]  # [R]
            masked = torch.cat([state.stop_valid[slots], early.new_ones(rows, state.eos_ids.shape[0])], dim=1)
            masked &= early[:, None]
            stop_ids = torch.cat([state.stop_ids[slots], state.eos_ids.expand(rows, -1)], dim=1)
            stop_values = torch.zeros(masked.shape, dtype=torch.float32, device=slots.device).masked_fill_(
                masked, float("-inf"))
        if flags & PENALTIES:
            counts = state.output_counts[slots].float()
        processors = state.processors[slots]
        token_mask = masked = None
        if flags & TOKEN_MASK:
            token_mask, masked = state.token_mask[slots], (processors & TOKEN_MASK) != 0
        return cls(flags, processors != 0, state.min_p[slots], state.frequency_penalty[slots],
                   state.presence_penalty[slots], bias_ids, bias_values, stop_ids, stop_values, counts, token_mask,
                   masked, state.mask_byte, state.mask_bit)

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """fp32 logits with -inf where a masked row's token mask disallows the token (other rows as they are)."""
        bits = (self.token_mask.view(torch.uint8)[:, self.mask_byte] >> self.mask_bit) & 1  # [R, V] uint8
        return logits.float().masked_fill((bits == 0) & self.masked[:, None], float("-inf"))

    def count_tokens(self, rows: torch.Tensor, token_ids: torch.Tensor) -> None:
        """Counts token_ids[i] as an output before row rows[i]'s token (a Verify row's drafts before it)."""
        if self.counts is not None and rows.numel():
            flat = rows.long() * self.counts.shape[1] + token_ids.long()
            self.counts.view(-1).index_add_(0, flat, torch.ones(flat.shape, dtype=self.counts.dtype,
                                                                device=flat.device))


def apply(logits: torch.Tensor, st: SamplingTensors, rows: ProcessorRows) -> tuple[torch.Tensor, SamplingTensors]:
    """(processed logits [R, V] float32, the sampling rows to draw them with). The input is not changed."""
    raw = logits.float()
    flags, used = rows.flags, rows.used
    # First: the sampling kernels read a row's parameters before their programmatic-dependent-launch wait, so
    # the kernel right before them must not write one (kernels_cu/sampling.cu).
    st_out = dataclasses.replace(st, repetition_penalty=torch.where(used, torch.ones_like(st.repetition_penalty),
                                                                    st.repetition_penalty))
    x = raw.clone()
    if flags & MIN_TOKENS:
        x.scatter_add_(1, rows.stop_ids, rows.stop_values)
    if flags & LOGIT_BIAS:
        x.scatter_add_(1, rows.bias_ids, rows.bias_values)
    if flags & REPETITION:
        x = penalized_logits(x, st)
    if flags & PENALTIES:  # in place, no [R, V] temporaries (x + (-1) * c * f is x - f * c to the bit)
        counts = rows.counts
        x.addcmul_(counts, rows.frequency_penalty[:, None], value=-1.0)
        x.addcmul_(counts.clamp_(max=1.0), rows.presence_penalty[:, None], value=-1.0)  # counts are >= 0
    if flags & MIN_P:
        temperature = st.temperature
        active = (rows.min_p > 0) & (temperature > 0)
        cut = x.amax(dim=-1) + temperature * torch.log(rows.min_p.clamp(min=1e-30))
        cut = torch.where(active, cut, torch.full_like(cut, float("-inf")))
        x.masked_fill_(x < cut[:, None], float("-inf"))
    return torch.where(used[:, None], x, raw), st_out


def sample(ops, logits: torch.Tensor, st: SamplingTensors, num_top: int, rows: ProcessorRows | None) -> SampleOutput:
    """ops.sample(logits, st, num_top) after the processors of `rows` (None: none, the plain sampling op). The
    logprobs (and top alternatives) of processed rows are the raw logits' (vLLM's default); other rows keep the
    sampling op's, which are the same quantity."""
    if rows is None:
        return ops.sample(logits, st, num_top)
    if rows.flags & TOKEN_MASK:
        logits = rows.mask(logits)
    x, st_x = apply(logits, st, rows)
    out = ops.sample(x, st_x, num_top)
    raw = model_logprobs(logits, out.token_ids, num_top)
    used = rows.used
    logprobs = torch.where(used, raw.logprobs, out.logprobs)
    if not num_top:
        return SampleOutput(out.token_ids, logprobs, None, None)
    return SampleOutput(out.token_ids, logprobs, torch.where(used[:, None], raw.top_ids, out.top_ids),
                        torch.where(used[:, None], raw.top_logprobs, out.top_logprobs))
