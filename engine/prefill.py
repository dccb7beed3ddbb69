"""Prefill: appends prompt tokens to sequences and computes their KV in chunked, bucketed forwards.

A call's prompts (whole, or a chunk each with `partial`) run in forwards of at most max_prefill_tokens
tokens over several sequences each; each forward is padded to a bucketed token count (ops.prefill_tokens),
so GEMMs see a few shapes, and a small one (prefill_graph_tokens() tokens over PREFILL_GRAPH_SEQS sequence
rows at most) replays the CUDA graph of its padded shape from static staging buffers. Every sequence whose
prompt completes samples its first new token from its last prompt token's logits.

Owns: the staging buffers of graphed prefill forwards and the logits buffer they write. The caller has
finished every decode step in flight."""
from __future__ import annotations

import collections

import numpy as np
import torch

from engine import api, env, logits_processors
from engine.batch import PrefillStaging, build_extend_batch, build_staged_prefill_batch
from engine.errors import FailedPrecondition, InvalidArgument
from engine.runtime import Runtime
from engine.sequence import Sequence, SequenceTable
from engine.tokens import commit_tokens

# Prefill forwards of at most prefill_graph_tokens() (padded) tokens over at most PREFILL_GRAPH_SEQS sequences
# replay CUDA graphs: a forward's ~200-300 launches cost the host ~1.5 ms, which matters while the forward's device
# time is short. The reach grows while a forward's linear layers take at most PREFILL_GRAPH_FLOPS (~15 ms of an H100's
# MMA), between PREFILL_GRAPH_MIN_TOKENS and PREFILL_GRAPH_MAX_TOKENS (METRALE_PREFILL_GRAPH_TOKENS fixes it). H100,
# bench/warm_up_cost.py (bench/RESULTS.md): 1B 8 x 512 253.7k -> 277.2k tok/s with graphs up to 4096 tokens (warm-up
# 11.5 -> 13.4 s, graph pool 354 -> 1812 MiB); 8B unchanged (43.1k -> 42.9k) at a cost of 11.7 s and 2.6 GiB.
PREFILL_GRAPH_SEQS = 16
PREFILL_GRAPH_MIN_TOKENS, PREFILL_GRAPH_MAX_TOKENS = 1024, 4096
PREFILL_GRAPH_FLOPS = 12e12


def prefill_graph_tokens(mc, setting: int | None = None) -> int:
    """The most padded tokens of a graphed prefill forward for model config mc: setting (env.PREFILL_GRAPH_TOKENS)
    when > 0, else the largest power of two in [PREFILL_GRAPH_MIN_TOKENS, PREFILL_GRAPH_MAX_TOKENS] whose forward's
    linear layers (2 x their parameters x tokens) stay within PREFILL_GRAPH_FLOPS."""
    setting = env.PREFILL_GRAPH_TOKENS if setting is None else setting
    if setting > 0:
        return setting
    per_layer = mc.hidden_size * ((mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + 3 * mc.intermediate_size) + \
        mc.num_heads * mc.head_dim * mc.hidden_size
    tokens = PREFILL_GRAPH_MIN_TOKENS
    while tokens < PREFILL_GRAPH_MAX_TOKENS and 2 * mc.num_layers * per_layer * (2 * tokens) <= PREFILL_GRAPH_FLOPS:
        tokens *= 2
    return tokens


class Prefiller:
    def __init__(self, rt: Runtime, sequences: SequenceTable, num_top, counters: api.StepCounters | None = None):
        """num_top(seqs): how many top-logprob candidates a step over seqs computes (DecodePipeline.num_top);
        counters: where prefill calls, tokens and device time are counted."""
        self.rt = rt
        self.counters = counters if counters is not None else api.StepCounters()
        self.sequences = sequences
        self.num_top = num_top
        config = rt.config
        self.staging = PrefillStaging(min(prefill_graph_tokens(rt.model_config), config.max_prefill_tokens),
                                      min(PREFILL_GRAPH_SEQS, config.max_batch_size), rt.model_config.head_dim,
                                      rt.device)
        # The logits a replayed prefill forward writes (outside the graph pool), one row per sequence row.
        self._logits = torch.empty((self.staging.max_seqs, rt.vocab_size), dtype=torch.float32, device=rt.device)
        # The slots and positions of a forward's sampled rows, uploaded from pinned memory: rewritten only by the
        # next sampling forward, after this one's tokens were read back (so its copy has run).
        self._sample_host = torch.zeros((2, config.max_batch_size), dtype=torch.int64,
                                        pin_memory=rt.device.type == "cuda")
        # Prompts completed by earlier calls whose full blocks are not registered yet (register_prompts), each with
        # the positions its prompt made final: hashing and registering a 4k-token prompt's 256 blocks takes ~1.3 ms
        # of host time, which the call's reply need not wait for.
        self._unregistered: collections.deque[tuple[Sequence, int]] = collections.deque()
        # Sequences started by this call whose sampling rows are not yet written (_write_sampling_rows).
        self._unwritten_rows: list[Sequence] = []

    def check(self, seqs: list[Sequence], items: list[api.PrefillItem]) -> list[np.ndarray | None]:
        """Every item extends a sequence whose prompt is not complete, within its reservation. Returns each item's
        token ids as uint32 where the check packed them (SequenceTable.check_tokens), else None: prefill() takes
        them to match a first chunk against the prefix cache without packing the ids again."""
        packed = []
        for seq, it in zip(seqs, items):
            if seq.prompt_done:
                raise FailedPrecondition(f"sequence {seq.seq_id}: the prompt is already complete")
            packed.append(self.sequences.check_tokens(it.token_ids, f"sequence {seq.seq_id} token_ids"))
            total = seq.seq_len + len(it.token_ids)
            if total == 0:
                raise InvalidArgument(f"sequence {seq.seq_id}: the prompt is empty")
            if total >= seq.capacity:
                raise InvalidArgument(f"sequence {seq.seq_id}: a prompt of {total} tokens leaves no room for a new "
                                      f"token in max_total_tokens={seq.capacity}")
            if not it.partial:  # its first new token is sampled here
                self.sequences.check_masks([seq])
        return packed

    def prefill(self, seqs: list[Sequence], items: list[api.PrefillItem],
                packed: list[np.ndarray | None] | None = None) -> api.StepResult:
        """Runs checked items (check()); returns the first new token of each item whose prompt completes, in
        item order. Each sequence's first chunk starts from the longest prefix the cache holds; blocks are
        taken from its reservation as its tokens need them (all of the rest once its prompt completes), and
        a completed prompt's full blocks wait to be registered in the cache by register_prompts() (the forwards
        that wrote them have completed when this returns): first thing in the next call, or sooner by the caller.
        packed: what check() returned for these items."""
        self.register_prompts()  # the earlier prompts' blocks, before this call's prompts are matched against them
        with self.rt.dispatch.on_device() as timer:
            try:
                for seq, it, ids in zip(seqs, items, packed or [None] * len(items)):
                    self._extend(seq, it, ids)
                computed = sum(seq.seq_len - seq.num_cached for seq in seqs)
                sampled = self._run(seqs, items)
            finally:  # rows no forward wrote (every chunk cached, or a failure): none is left for a later call
                self._write_sampling_rows()
        tokens = [sampled[it.seq_id] for it in items if not it.partial]
        for seq in seqs:  # the forwards have completed: the sampled tokens were read back
            blocks = seq.blocks
            if seq.prompt_done and blocks.caching and blocks.num_registered * self.rt.block_size < seq.num_final:
                self._unregistered.append((seq, seq.num_final))
        result = api.StepResult(tokens, timer.elapsed_ns())
        self.counters.prefill_calls += 1
        self.counters.prefill_tokens += computed
        self.counters.prefill_device_ns += result.forward_ns
        return result

    @property
    def num_unregistered(self) -> int:
        """Completed prompts whose blocks wait for register_prompts()."""
        return len(self._unregistered)

    def register_prompts(self, max_blocks: int | None = None) -> int:
        """Registers the full blocks of the prompts completed since the last call, up to the positions each prompt
        made final (the decode steps launched since may be writing later ones), oldest prompt first; a sequence
        released meanwhile was registered by its release. max_blocks: registers about that many blocks at most
        and leaves the rest for a later call (a 32k-token prompt's 2,048 blocks take ~8 ms of host time, which the
        steps of every other sequence would otherwise wait behind). Returns how many blocks were newly cached."""
        stored, pending, bs = 0, self._unregistered, self.rt.block_size
        while pending and (max_blocks is None or max_blocks > 0):
            seq, final = pending[0]
            blocks, before = seq.blocks, seq.blocks.num_registered
            bound = final if max_blocks is None else min(final, (before + max_blocks) * bs)
            stored += blocks.register(seq.token_ids, bound)
            if max_blocks is not None:
                max_blocks -= blocks.num_registered - before
            if bound >= final // bs * bs or blocks.num_registered == before:  # its prompt is done, or was released
                pending.popleft()
        return stored

    def _extend(self, seq: Sequence, item: api.PrefillItem, packed: np.ndarray | None = None) -> None:
        """Appends the chunk's tokens; on the first chunk matches the cached prefix (its tokens count as
        computed, and as seen by the repetition penalty); takes the blocks the known tokens need (the whole
        reservation once the prompt completes) into the slot's block-table row. packed: the chunk's ids as
        uint32, or None."""
        state, blocks = self.rt.state, seq.blocks
        first = not seq.token_ids
        seq.token_ids.extend(item.token_ids)
        if first:  # the sequence's tokens are the chunk's
            seq.num_cached = seq.cached_prompt_tokens = blocks.match(seq.token_ids if packed is None else packed)
        if not item.partial and seq.num_cached == seq.seq_len:
            seq.num_cached -= 1  # an empty final chunk: recompute the last prompt token for its logits
        start = len(blocks.block_ids)
        new = blocks.grow(seq.seq_len) if item.partial else blocks.grow_all()
        if not first:
            state.set_blocks(seq.slot, start, new)
            return
        # The slot's block-table row starts here, its shared and new blocks in one write; its sampling rows wait
        # for the first forward's launch (_write_sampling_rows).
        state.start_row(seq.slot, blocks.block_ids)
        self._unwritten_rows.append(seq)

    def _write_sampling_rows(self) -> None:
        """The sampling rows of the sequences that started in this call (SlotState.assign_sampling), queued after the
        first forward's launch and before anything that reads them (the prompt's seen marks, the sampling)."""
        state = self.rt.state
        for seq in self._unwritten_rows:
            state.assign_sampling(seq.slot, seq.sampling, seq.stopping)
            if seq.cached_prompt_tokens and seq.sampling.repetition_penalty != 1.0:
                # The cached tokens skip the forward, where prompt tokens are marked seen (read only by the
                # repetition penalty).
                shared = torch.from_numpy(np.asarray(seq.token_ids[:seq.cached_prompt_tokens], dtype=np.int64))
                shared = shared.to(self.rt.device, non_blocking=True)
                state.mark_seen(torch.full_like(shared, seq.slot), shared)
        self._unwritten_rows.clear()

    def _run(self, seqs: list[Sequence], items: list[api.PrefillItem]) -> dict[int, api.TokenResult]:
        completes = {seq.seq_id: not it.partial for seq, it in zip(seqs, items)}
        config = self.rt.config
        sampled: dict[int, api.TokenResult] = {}
        while True:  # forwards of at most max_prefill_tokens tokens, several sequences each
            queue = [s for s in seqs if not s.prompt_done and s.seq_len > s.num_cached]
            if not queue:
                break
            budget, chunk = config.max_prefill_tokens, []
            for seq in queue[:config.max_batch_size]:
                n = min(seq.seq_len - seq.num_cached, budget)
                if n == 0:
                    break
                budget -= n
                chunk.append((seq, n, completes[seq.seq_id] and seq.num_cached + n == seq.seq_len))
            sampled.update(self._forward(chunk))
        return sampled

    def _forward(self, chunk: list[tuple[Sequence, int, bool]]) -> dict[int, api.TokenResult]:
        """One forward over chunk = [(sequence, tokens to compute, whether its prompt completes)]; samples the
        first new token of each completing sequence. The forward is padded to a bucketed token count
        (ops.prefill_tokens); a small one replays the CUDA graph of its padded shape."""
        rt = self.rt
        state, staging = rt.state, self.staging
        num_tokens = rt.ops.prefill_tokens(sum(n for _, n, _ in chunk))
        slots, starts = [s.slot for s, _, _ in chunk], [s.num_cached for s, _, _ in chunk]
        tokens = [s.token_ids[s.num_cached:s.num_cached + n] for s, n, _ in chunk]
        logits_rows = [[n - 1] if last else [] for _, n, last in chunk]
        graphed = rt.dispatch.graphs is not None and num_tokens <= staging.max_tokens and len(chunk) <= staging.max_seqs
        if graphed:
            num_seqs = 1 << (len(chunk) - 1).bit_length()  # sequence rows, padded to a power of two
            # The keys a row sees, bounded: the padded token count for fresh prompts, else (a chunk that continues
            # a cached prefix) the next power of two: attention's key splits are sized from it, so it keys the graph.
            max_kv = max(start + n for start, (_, n, _) in zip(starts, chunk))
            max_kv = num_tokens if max_kv <= num_tokens else 1 << (max_kv - 1).bit_length()
            # Fresh prompts only (no cached prefix, no earlier chunk): the backend may attend on the forward's own rows.
            mc = rt.model_config
            longest = max(n for _, n, _ in chunk)
            varlen = not any(starts) and rt.ops.varlen_prefill(longest, mc.sliding_window, mc.head_dim)
            token_slots, input_ids, make_batch = build_staged_prefill_batch(
                staging, state.block_table, [s.blocks.block_ids for s, _, _ in chunk], slots, starts, tokens, logits_rows,
                rt.block_size, num_tokens, num_seqs, max_kv, varlen)
        else:
            batch = build_extend_batch(state.block_table, slots, starts, tokens, logits_rows, rt.block_size,
                                       rt.device, rt.dynamic_rope, num_padded=num_tokens)
            token_slots, input_ids = batch.token_slots, batch.input_ids[:batch.token_slots.shape[0]]
        to_sample = [seq for seq, _, last in chunk if last]
        if graphed:
            logits_out = self._logits
            # Padded shapes recur (a few dozen in all): captured the second time one runs. The first run, eager,
            # loads the kernels and lets cuBLAS pick its own, which must not happen in a capture.
            rt.dispatch.run_shape(("prefill", num_tokens, num_seqs, max_kv, varlen),
                                  lambda: logits_out[:num_seqs].copy_(rt.model.forward(make_batch())), capture_after=2)
            logits = logits_out[:len(to_sample)]
        else:
            logits = rt.model.forward(batch)
        self._write_sampling_rows()
        # Queued behind the forward (the host reaches the GPU with it first): the prompt counts for repetition
        # penalty (real tokens only: pads come after them), and the sampled rows' slots and positions.
        state.mark_seen(token_slots, input_ids)
        if to_sample:
            host = self._sample_host[:, :len(to_sample)]
            host.numpy()[:] = [[s.slot for s in to_sample], [s.seq_len for s in to_sample]]
            sample_slots, positions = host.to(rt.device, non_blocking=True)
        for seq, n, _ in chunk:
            seq.num_cached += n
        if not to_sample:
            return {}
        num_top, procs = self.num_top(to_sample), logits_processors.batch_flags(to_sample)
        procs_rows = None
        if procs:  # each prompt is complete: its first new token is drawn at index seq_len
            state.start_output(sample_slots, positions)
            procs_rows = logits_processors.ProcessorRows.gather(state, sample_slots, positions, procs)
        out = logits_processors.sample(rt.ops, logits, state.sampling_rows(sample_slots, positions), num_top,
                                       procs_rows)
        for seq in to_sample:
            seq.prompt_len = seq.seq_len
            seq.mask_ready = False
            seq.blocks.pool.record_query(seq.prompt_len, seq.cached_prompt_tokens)
        state.num_cached[sample_slots] = positions.to(torch.int32)
        state.last_token[sample_slots] = out.token_ids
        state.mark_seen(sample_slots, out.token_ids)
        if procs & logits_processors.PENALTIES:
            state.count_outputs(sample_slots, out.token_ids)
        rt.outputs.write(out, num_top)
        host = rt.outputs.read(len(to_sample), num_top, rt.dispatch.streams)
        results = commit_tokens(to_sample, *host, rt.eos_token_ids)
        for seq, r in zip(to_sample, results):
            r.cached_tokens = seq.cached_prompt_tokens
        return {r.seq_id: r for r in results}

    def buckets(self, limit: int) -> list[tuple[int, list[int], bool]]:
        """The forwards warm-up runs for prompts of up to `limit` tokens: (padded size, sequence lengths,
        whether it replays a graph, so runs twice to be captured) for each padded token count the backend
        runs prompts at, and with CUDA graphs each padded sequence count (1, 2, 4 .. PREFILL_GRAPH_SEQS)."""
        staging, forwards = self.staging, []
        for size in self.rt.ops.prefill_buckets(limit):
            n = min(size, limit)
            graphed = self.rt.dispatch.graphs is not None and size <= staging.max_tokens
            rows = [1]
            while graphed and rows[-1] * 2 <= min(staging.max_seqs, n):
                rows.append(rows[-1] * 2)
            for num_seqs in rows:
                forwards.append((size, [n // num_seqs + (i < n % num_seqs) for i in range(num_seqs)], graphed))
        return forwards
