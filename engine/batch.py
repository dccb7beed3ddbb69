"""ForwardBatch: everything one forward pass needs, built once per step and passed down."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.device import upload


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
    logits_all_rows: bool = False  # logits_indices is every row in order (decode, verify)
    # Verify: each of a sequence's k + 1 query tokens is a decode row of its own (one sequence each), and
    # row i attends to the tokens rows 0 .. i - 1 write into the cache in this same forward.
    rows_per_seq: int = 1
    token_slots: torch.Tensor | None = None  # [real T] int64: the slot of each real token's sequence (prefill, verify)
    # [W, 4] int32 on the device: the paged prefill attention's work list (prefill_work), padded with
    # empty rows to a fixed length; given, attention reads it instead of the host lists (CUDA graphs).
    prefill_work: torch.Tensor | None = None
    max_kv_len: int = 0  # an upper bound of the keys any query row sees (prefill: sizes attention's key splits)
    # int32 [S + 1] on the device: the sequence starts of a graphed forward of fresh prompts whose attention runs
    # on its own rows (engine/cuda/prefill_varlen.py), padded sequence rows empty; None: the paged kernel's work list.
    cu_seqlens: torch.Tensor | None = None
    hidden_states: bool = False  # the forward returns the final-normed hidden rows (logits_indices), not logits

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]


def _extend_index(starts: list[int], tokens: list[list[int]], logits_rows: list[list[int]]) -> tuple:
    """The host-side index arithmetic of an extend forward, in numpy (a prompt can be thousands of
    tokens): (query start offsets [B + 1], the sequence of each token [T], each token's position [T],
    each sequence's length after the forward [B], the logits rows as a list)."""
    lens = np.fromiter(map(len, tokens), dtype=np.int64, count=len(tokens))
    qsl = np.zeros(len(tokens) + 1, dtype=np.int64)
    np.cumsum(lens, out=qsl[1:])
    seq_index = np.repeat(np.arange(len(tokens)), lens)
    starts_a = np.asarray(starts, dtype=np.int64)
    positions = starts_a[seq_index] + np.arange(int(qsl[-1])) - qsl[:-1][seq_index]
    logits_idx = [int(qsl[b]) + r for b, rows in enumerate(logits_rows) for r in rows]
    return qsl, seq_index, positions, starts_a + lens, logits_idx


def build_extend_batch(block_table: torch.Tensor, slots: list[int], starts: list[int],
                       tokens: list[list[int]], logits_rows: list[list[int]], block_size: int,
                       device: torch.device, need_scale_lens: bool, per_token: bool = False,
                       num_padded: int = 0) -> ForwardBatch:
    """A prefill/verify forward: sequence b (in slot slots[b]) gets tokens[b] at positions
    starts[b] .. starts[b] + len(tokens[b]) - 1. logits_rows[b]: which of its tokens need logits
    (offsets into tokens[b]).

    per_token: attention runs as one decode query per token (each sees the keys up to its own
    position, through its sequence's block-table row). That is how Verify runs its few tokens per
    sequence: decode attention takes no host-side work list, so the forward is capturable.

    num_padded: when larger than the token count, pad tokens are appended up to it (so GEMMs see a few
    bucketed shapes, see CudaOps.prefill_tokens): token 0 at position 0, in no sequence, with cache
    slot -1 (no cache write); no logits row, no attention work and token_slots cover real tokens only."""
    # Host-side index arithmetic in numpy (a prompt can be thousands of tokens), then one upload of everything.
    num_seqs = len(tokens)
    qsl_a, seq_index_a, positions_a, kv_lens, logits_idx = _extend_index(starts, tokens, logits_rows)
    num_tokens = int(qsl_a[-1])
    seq_lens_a = kv_lens
    pad = max(0, num_padded - num_tokens)
    qsl = qsl_a.tolist()
    num_logits = len(logits_idx)
    if per_token:
        qsl, seq_lens_a = list(range(num_tokens + 1)), positions_a + 1
    # One int64 buffer: ids, positions, sequence of each token [T each], logits rows [N], slots [B],
    # seq_lens [B, or T per_token].
    zeros = np.zeros(pad, dtype=np.int64)
    parts = [np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=num_tokens), zeros,
             positions_a, zeros, seq_index_a, zeros, np.asarray(logits_idx, dtype=np.int64),
             np.asarray(slots, dtype=np.int64), seq_lens_a]
    if pad and not num_seqs:
        raise ValueError("a padded forward needs a sequence")
    sizes = [len(a) for a in parts]
    ids, pos_t, seq_index, logits_t, slots_t, seq_lens_t = upload(np.concatenate(parts), device).split(
        [sizes[0] + sizes[1], sizes[2] + sizes[3], sizes[4] + sizes[5], *sizes[6:]])
    tables = block_table[slots_t]
    block_ids = tables[seq_index, pos_t // block_size].long()
    slot_mapping = block_ids * block_size + pos_t % block_size
    if pad:
        slot_mapping[num_tokens:] = -1
    if per_token:
        tables = tables[seq_index]
    return ForwardBatch(
        input_ids=ids,
        positions=pos_t,
        slot_mapping=slot_mapping,
        block_tables=tables,
        seq_lens=seq_lens_t.to(torch.int32),
        logits_indices=logits_t,
        is_decode=per_token,
        query_start_loc=qsl,
        seq_lens_host=seq_lens_a.tolist(),
        rope_scale_lens=kv_lens[seq_index_a].tolist() + [1] * pad if need_scale_lens else None,
        logits_all_rows=not pad and num_logits == num_tokens and logits_idx == list(range(num_tokens)),
        token_slots=slots_t[seq_index[:num_tokens]],
        max_kv_len=int(kv_lens.max()) if num_seqs else 0,
    )


def prefill_rows(head_dim: int) -> int:
    """Query rows per paged prefill attention work item at head_dim (kernels_cu/prefill_attention.cu ROWS(D)): 128
    up to head_dim 64 (two m16 tiles a warp), 64 above."""
    return 128 if head_dim <= 64 else 64


def prefill_work(query_start_loc: list[int], seq_lens: list[int],
                 head_dim: int) -> list[tuple[int, int, int, int]]:
    """The paged prefill attention's work list: one (sequence, first query token, rows, position of the
    first row) per prefill_rows(head_dim) query rows; the queries of sequence b are the last query_len of its
    seq_lens[b] keys. A row with 0 rows is empty work (a list padded to a fixed length)."""
    rows = prefill_rows(head_dim)
    work = []
    for b, kv_len in enumerate(seq_lens):
        start, end = query_start_loc[b], query_start_loc[b + 1]
        first_pos = kv_len - (end - start)
        for r in range(0, end - start, rows):
            work.append((b, start + r, min(rows, end - start - r), first_pos + r))
    return work


def prefill_work_rows(num_tokens: int, num_seqs: int, head_dim: int) -> int:
    """The most work items a forward of num_tokens tokens over num_seqs sequences can have at head_dim."""
    return -(-num_tokens // prefill_rows(head_dim)) + num_seqs


class PrefillStaging:
    """The static device inputs of prefill forwards that replay CUDA graphs (Engine._prefill_forward), for a
    model of head_dim (it sets the attention's work items: prefill_rows).

    A forward padded to T tokens over S sequence rows reads the first T (or S, or prefill_work_rows(T,
    S, head_dim)) entries of each region, so the addresses its graph captured never move. The host writes the
    pinned mirror and queues one copy per buffer; before writing again it waits for the copies it
    queued last time (a forward that samples nothing returns without a host sync)."""

    def __init__(self, max_tokens: int, max_seqs: int, head_dim: int, device: torch.device):
        self.max_tokens, self.max_seqs, self.head_dim = max_tokens, max_seqs, head_dim
        pinned = device.type == "cuda"
        # Regions: ids, positions, cache slots, token slots [max_tokens each]; logits rows, slots [max_seqs each].
        self.ints = torch.zeros(4 * max_tokens + 2 * max_seqs, dtype=torch.int64, device=device)
        self.host_ints = torch.zeros(self.ints.shape, dtype=torch.int64, pin_memory=pinned)
        self.work = torch.zeros((prefill_work_rows(max_tokens, max_seqs, head_dim), 4), dtype=torch.int32,
                                device=device)
        self.host_work = torch.zeros(self.work.shape, dtype=torch.int32, pin_memory=pinned)
        # The sequence starts of a fresh forward attended on its own rows (ForwardBatch.cu_seqlens) [max_seqs + 1].
        self.starts = torch.zeros(max_seqs + 1, dtype=torch.int32, device=device)
        self.host_starts = torch.zeros(self.starts.shape, dtype=torch.int32, pin_memory=pinned)
        # numpy views of the pinned mirrors, made once (the host writes them through numpy on every forward).
        self.host_ints_np, self.host_work_np = self.host_ints.numpy(), self.host_work.numpy()
        self.host_starts_np = self.host_starts.numpy()
        self._arange = np.arange(max_tokens, dtype=np.int64)
        self._copied = torch.cuda.Event() if pinned else None
        self._views: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}

    def _offset(self, index: int) -> int:
        return index * self.max_tokens if index < 4 else 4 * self.max_tokens + (index - 4) * self.max_seqs

    def region(self, index: int, n: int) -> torch.Tensor:
        """The first n entries of device region index."""
        start = self._offset(index)
        return self.ints[start:start + n]

    def views(self, num_tokens: int, num_seqs: int) -> tuple[torch.Tensor, ...]:
        """The device regions a forward of num_tokens tokens over num_seqs sequence rows reads: ids, positions,
        cache slots, token slots, logits rows, sequence slots, work, starts; made once per shape (padded shapes
        recur: a few dozen in all)."""
        key = (num_tokens, num_seqs)
        views = self._views.get(key)
        if views is None:
            views = self._views[key] = (
                *(self.region(i, num_tokens) for i in range(4)), self.region(4, num_seqs), self.region(5, num_seqs),
                self.work[:prefill_work_rows(num_tokens, num_seqs, self.head_dim)], self.starts[:num_seqs + 1])
        return views

    def arange(self, n: int) -> np.ndarray:
        """0 .. n - 1 as int64, a view of one array grown on demand (not to be written)."""
        if len(self._arange) < n:
            self._arange = np.arange(max(n, 2 * len(self._arange)), dtype=np.int64)
        return self._arange[:n]

    def host_region(self, index: int, n: int) -> np.ndarray:
        """The first n entries of region index's pinned mirror, as numpy."""
        start = self._offset(index)
        return self.host_ints_np[start:start + n]

    def upload(self, starts: bool = False) -> None:
        """starts: the sequence starts too (a varlen forward's)."""
        self.ints.copy_(self.host_ints, non_blocking=True)
        self.work.copy_(self.host_work, non_blocking=True)
        if starts:
            self.starts.copy_(self.host_starts, non_blocking=True)
        if self._copied is not None:
            self._copied.record()

    def wait_copied(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()


def build_staged_prefill_batch(staging: PrefillStaging, block_table: torch.Tensor, block_ids: list[list[int]],
                               slots: list[int], starts: list[int], tokens: list[list[int]],
                               logits_rows: list[list[int]], block_size: int, num_tokens: int,
                               num_seqs: int, max_kv_len: int = 0, varlen: bool = False
                               ) -> tuple[torch.Tensor, torch.Tensor, Callable[[], ForwardBatch]]:
    """build_extend_batch for a forward that may replay a CUDA graph: the inputs go to `staging`, padded
    to num_tokens tokens and num_seqs sequence rows (the graph's shape), with the work list padded by
    empty rows. Returns (the slot of each real token, the real tokens: both staged, for the eager ops
    before the forward; and a function that builds the batch from the staged buffers with device ops
    only, called inside the captured step). Cache slots are computed here from each sequence's block ids;
    pad tokens get slot -1 (no cache write), pad sequence rows the table row of slots[0] (no work). varlen (fresh
    prompts only: every start 0): the batch carries the sequence starts (cu_seqlens, pad rows empty) for an
    attention over the forward's own rows."""
    staging.wait_copied()
    num_real_seqs = len(tokens)
    ids_h, pos_h, cache_h, tslots_h = (staging.host_region(i, num_tokens) for i in range(4))
    rows_h, slots_h = staging.host_region(4, num_seqs), staging.host_region(5, num_seqs)
    # A sequence at a time (at most staging.max_seqs of them): a few numpy calls each, on the path of the forward's
    # launch (a 128-token chunk after a cached prefix: ~15 numpy calls here, against ~30 vectorized over its tokens).
    qsl, seq_lens, logits_idx, lo = [0], [], [], 0
    for blocks, slot, start, toks, rows in zip(block_ids, slots, starts, tokens, logits_rows):
        hi = lo + len(toks)
        np.add(staging.arange(len(toks)), start, out=pos_h[lo:hi])
        # The cache slots of positions start .. start + len - 1, from only the blocks they fall in.
        first, last = start // block_size, (start + len(toks) - 1) // block_size
        blk = np.asarray(blocks[first:last + 1], dtype=np.int64) * block_size
        offset = start - first * block_size
        cache_h[lo:hi] = (blk[:, None] + staging.arange(block_size)).ravel()[offset:offset + len(toks)]
        tslots_h[lo:hi] = slot
        logits_idx += [lo + r for r in rows]
        qsl.append(hi)
        seq_lens.append(start + len(toks))
        lo = hi
    n = lo
    ids_h[:n] = np.fromiter(itertools.chain.from_iterable(tokens), dtype=np.int64, count=n)
    ids_h[n:] = 0
    pos_h[n:] = 0
    cache_h[n:] = -1
    rows_h[:len(logits_idx)] = logits_idx
    rows_h[len(logits_idx):] = 0
    slots_h[:num_real_seqs] = slots
    slots_h[num_real_seqs:] = slots[0]
    work = prefill_work(qsl, seq_lens, staging.head_dim)
    work_rows = prefill_work_rows(num_tokens, num_seqs, staging.head_dim)
    work_h = staging.host_work_np
    work_h[:len(work)] = work
    work_h[len(work):work_rows] = 0
    if varlen:
        if any(starts):
            raise ValueError("a varlen forward attends fresh prompts only")
        starts_h = staging.host_starts_np
        starts_h[:num_real_seqs + 1] = qsl
        starts_h[num_real_seqs + 1:num_seqs + 1] = n
    staging.upload(starts=varlen)

    ids, pos, cache, tslots, rows, slots_t, work_t, starts_t = staging.views(num_tokens, num_seqs)
    starts_t = starts_t if varlen else None

    def make_batch() -> ForwardBatch:
        return ForwardBatch(input_ids=ids, positions=pos, slot_mapping=cache, block_tables=block_table[slots_t],
                            seq_lens=torch.empty(0, dtype=torch.int32, device=ids.device), logits_indices=rows,
                            is_decode=False, query_start_loc=[], seq_lens_host=[], prefill_work=work_t,
                            max_kv_len=max_kv_len, cu_seqlens=starts_t)

    return tslots[:n], ids[:n], make_batch


def build_decode_batch(block_table: torch.Tensor, last_token: torch.Tensor, num_cached: torch.Tensor,
                       slots_t: torch.Tensor, block_size: int, seq_lens_host: list[int],
                       need_scale_lens: bool) -> ForwardBatch:
    """A decode forward read from the slot-resident state: each slot's input is its last sampled
    token at position num_cached[slot]. Only device ops on device tensors (capturable)."""
    positions = num_cached[slots_t].long()
    tables = block_table[slots_t]
    rows = torch.arange(slots_t.shape[0], device=slots_t.device)
    block_ids = tables[rows, positions // block_size].long()
    return decode_batch(last_token[slots_t], positions, block_ids * block_size + positions % block_size, tables,
                        (positions + 1).to(torch.int32), seq_lens_host, need_scale_lens)


def decode_batch(input_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, seq_lens_host: list[int],
                 need_scale_lens: bool) -> ForwardBatch:
    """The ForwardBatch of a decode step from its gathered inputs (one query token per sequence)."""
    batch = len(seq_lens_host)
    return ForwardBatch(
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slot_mapping,
        block_tables=block_tables,
        seq_lens=seq_lens,
        logits_indices=torch.arange(batch, device=input_ids.device),
        is_decode=True,
        query_start_loc=list(range(batch + 1)),
        seq_lens_host=seq_lens_host,
        rope_scale_lens=seq_lens_host if need_scale_lens else None,
        logits_all_rows=True,
    )
