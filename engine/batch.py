"""ForwardBatch: everything one forward pass needs, built once per step and passed down."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ForwardBatch:
    """A forward over B sequences and T tokens.

    Decode batches have one query token per sequence (is_decode, T == B); prefill and verify batches
    have query_lens[b] >= 1 tokens for sequence b, causal over its cached prefix."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: flat KV-cache index of each token
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [B] int32: KV length of each sequence after this forward
    logits_indices: torch.Tensor  # [N] int64: rows of the hidden state that need logits
    is_decode: bool
    query_start_loc: list[int]  # [B + 1] host: token offsets of the sequences
    seq_lens_host: list[int]  # [B] host copy of seq_lens
    rope_scale_lens: list[int] | None = None  # per token, its sequence's seq_len (dynamic NTK only)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def build_extend_batch(block_table: torch.Tensor, slots: list[int], starts: list[int],
                       tokens: list[list[int]], logits_rows: list[list[int]], block_size: int,
                       device: torch.device, need_scale_lens: bool, per_token: bool = False) -> ForwardBatch:
    """A prefill/verify forward: sequence b (in slot slots[b]) gets tokens[b] at positions
    starts[b] .. starts[b] + len(tokens[b]) - 1. logits_rows[b]: which of its tokens need logits
    (offsets into tokens[b]).

    per_token: attention runs as one decode query per token (each sees the keys up to its own
    position, through its sequence's block-table row). That is how Verify runs its few tokens per
    sequence: decode attention takes no host-side work list, so the forward is capturable."""
    ids, positions, qsl, seq_lens, logits_idx, scale = [], [], [0], [], [], []
    for start, toks, rows in zip(starts, tokens, logits_rows):
        logits_idx.extend(qsl[-1] + r for r in rows)
        ids.extend(toks)
        positions.extend(range(start, start + len(toks)))
        qsl.append(qsl[-1] + len(toks))
        seq_lens.append(start + len(toks))
        scale.extend([start + len(toks)] * len(toks))
    slots_t = torch.tensor(slots, dtype=torch.int64, device=device)
    tables = block_table[slots_t]
    pos_t = torch.tensor(positions, dtype=torch.int64, device=device)
    seq_index = torch.repeat_interleave(torch.arange(len(slots), device=device),
                                        torch.tensor([len(t) for t in tokens], device=device))
    block_ids = tables[seq_index, pos_t // block_size].long()
    if per_token:
        tables, qsl, seq_lens = tables[seq_index], list(range(len(ids) + 1)), [p + 1 for p in positions]
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=pos_t,
        slot_mapping=block_ids * block_size + pos_t % block_size,
        block_tables=tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        logits_indices=torch.tensor(logits_idx, dtype=torch.int64, device=device),
        is_decode=per_token,
        query_start_loc=qsl,
        seq_lens_host=seq_lens,
        rope_scale_lens=scale if need_scale_lens else None,
    )


def build_decode_batch(block_table: torch.Tensor, last_token: torch.Tensor, num_cached: torch.Tensor,
                       slots_t: torch.Tensor, block_size: int, seq_lens_host: list[int],
                       need_scale_lens: bool) -> ForwardBatch:
    """A decode forward read from the slot-resident state: each slot's input is its last sampled
    token at position num_cached[slot]. Only device ops on device tensors (capturable)."""
    positions = num_cached[slots_t].long()
    tables = block_table[slots_t]
    rows = torch.arange(slots_t.shape[0], device=slots_t.device)
    block_ids = tables[rows, positions // block_size].long()
    batch = len(seq_lens_host)
    return ForwardBatch(
        input_ids=last_token[slots_t],
        positions=positions,
        slot_mapping=block_ids * block_size + positions % block_size,
        block_tables=tables,
        seq_lens=(positions + 1).to(torch.int32),
        logits_indices=rows,
        is_decode=True,
        query_start_loc=list(range(batch + 1)),
        seq_lens_host=seq_lens_host,
        rope_scale_lens=seq_lens_host if need_scale_lens else None,
    )
