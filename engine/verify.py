"""Speculative Verify: score each sequence's draft tokens in one forward, keep the longest accepted prefix
plus one token drawn by the target, and roll the KV of rejected positions back (by not counting them: the
slot state moves past the accepted tokens only, and a later step overwrites the dead rows).

Two paths. The uniform one (k drafts for every sequence, no draft distributions) is one device step,
replayed as a CUDA graph keyed by the slot vector and k like a decode step, with one read-back. The general
one (draft lengths differ, or draft distributions given) runs one forward over each sequence's last token and
its drafts, the same greedy match for drafts without distributions, rejection sampling batched per draft
length for drafts with them, then the host commit.

Owns: the uniform step's static buffers (VerifyOutputs). The caller has finished every decode step in flight
(its checks need every sequence's committed state)."""
from __future__ import annotations

from typing import Callable

import torch

from engine import api, logits_processors
from engine.batch import build_extend_batch
from engine.errors import InvalidArgument
from engine.outputs import VerifyOutputs
from engine.runtime import Runtime
from engine.sampling import model_logprobs, target_logprobs
from engine.sequence import FinishReason, Sequence, SequenceTable
from engine.slot_io import SlotIO
from engine.tokens import host_rows, in_request_order, token_result


class Verifier:
    def __init__(self, rt: Runtime, sequences: SequenceTable, num_top: Callable[[list[Sequence]], int]):
        """num_top(seqs): how many top-logprob candidates a step over seqs computes (DecodePipeline.num_top)."""
        self.rt = rt
        self.sequences = sequences
        self.num_top = num_top
        self.slot_io = SlotIO.for_ops(rt.ops, rt.state, rt.block_size)
        self.outputs = VerifyOutputs(rt.config.max_batch_size, rt.config.max_draft_tokens,
                                     rt.config.max_top_logprobs, rt.device)

    def check(self, seqs: list[Sequence], items: list[api.VerifyItem]) -> None:
        """Every item's drafts fit its sequence and the limits (nothing changes on a refusal)."""
        vocab, max_drafts = self.rt.vocab_size, self.rt.config.max_draft_tokens
        self.sequences.check_running(seqs)
        for seq, it in zip(seqs, items):
            if seq.sampling.token_mask:
                raise InvalidArgument(f"sequence {seq.seq_id} samples under a token mask (structured output), which "
                                      f"Verify does not take: decode it step by step")
            k = len(it.draft_token_ids)
            if k > max_drafts:
                raise InvalidArgument(f"sequence {seq.seq_id}: {k} draft tokens, at most {max_drafts} "
                                      f"(--max-draft-tokens)")
            self.sequences.check_tokens(it.draft_token_ids, f"sequence {seq.seq_id} draft_token_ids")
            if seq.seq_len + k > seq.capacity:
                raise InvalidArgument(f"sequence {seq.seq_id}: {k} drafts after {seq.seq_len} tokens exceed "
                                      f"max_total_tokens={seq.capacity}")
            if it.draft_probs:
                if len(it.draft_probs) != k * vocab:
                    raise InvalidArgument(f"sequence {seq.seq_id}: draft_probs has {len(it.draft_probs)} values; "
                                          f"expected {k} x {vocab} (one distribution per draft) or none")
                probs = torch.tensor(it.draft_probs, dtype=torch.float32)
                if not bool(torch.isfinite(probs).all()) or bool((probs < 0).any()):
                    raise InvalidArgument(f"sequence {seq.seq_id}: draft_probs must be finite and >= 0")

    def verify(self, seqs: list[Sequence], items: list[api.VerifyItem]) -> api.VerifyStepResult:
        self.check(seqs, items)
        k = len(items[0].draft_token_ids)
        uniform = k > 0 and all(len(it.draft_token_ids) == k and not it.draft_probs for it in items) \
            and not self.rt.dynamic_rope
        # The uniform step is driver calls (a replay, pinned copies) like a decode step: whatever in it runs
        # torch ops switches torch's stream itself. The general one runs torch ops throughout.
        with self.rt.dispatch.on_device(torch_stream=not uniform) as timer:
            results = self._uniform(seqs, items, k) if uniform else self._general(seqs, items)
        for seq in seqs:  # the forward has completed (its results were read back): the accepted tokens are final
            seq.blocks.register(seq.token_ids, seq.num_final)
        return api.VerifyStepResult(results, timer.elapsed_ns())

    # ------------------------------------------------------------------ uniform

    def _uniform(self, seqs: list[Sequence], items: list[api.VerifyItem], k: int) -> list[api.VerifyResult]:
        rt = self.rt
        order = sorted(range(len(seqs)), key=lambda i: seqs[i].slot)
        batch = [seqs[i] for i in order]
        drafts = [items[i].draft_token_ids for i in order]
        num_top, procs = self.num_top(seqs), logits_processors.batch_flags(seqs)
        self.outputs.write_drafts(drafts, k, rt.dispatch.streams)

        def make_step(slots_t: torch.Tensor) -> Callable[[], None]:
            return lambda: self._step_into_outputs(slots_t, k, num_top, procs)

        rt.dispatch.run_slots("verify", [s.slot for s in batch], (k, num_top, *logits_processors.graph_key(procs)),
                              make_step)
        accepted, tokens, logprobs, top_ids, top_lps = self.outputs.read(len(batch), k + 1, num_top,
                                                                         rt.dispatch.streams)
        results = []
        for b, seq in enumerate(batch):
            j = accepted[b]
            emitted = list(drafts[b][:j]) + [tokens[b]]
            rows = (None, logprobs[b], top_ids[b * (k + 1):] if num_top else None,
                    top_lps[b * (k + 1):] if num_top else None)
            results.append(api.VerifyResult(seq.seq_id, j, self._append(seq, emitted, rows, 0)))
        return in_request_order(results, order)

    def _step_into_outputs(self, slots: torch.Tensor, k: int, num_top: int, procs: int) -> None:
        """Device work of a uniform Verify: the last token and k drafts of each slot at their positions,
        attention per token, then every row samples the token decode would draw there (its slot's parameters,
        RNG keyed by seed and position, the drafts before it counted as seen). The drafts are accepted while
        they equal those tokens ("greedy match": exact for greedy rows, and for sampled rows the same target
        distribution as rejection sampling with one-hot drafts), so Verify emits exactly what decode would
        have. The slot state moves past the accepted tokens only. The logits processors (procs: their flags)
        see each row as decode would: the drafts before it count as output tokens. No host sync."""
        rt = self.rt
        drafts = self.outputs.drafts[:slots.shape[0], :k]
        batch, rows = self.slot_io.verify_inputs(slots, drafts)
        logits = rt.model.forward(batch)
        procs_rows = None
        if procs:
            n = k + 1
            procs_rows = logits_processors.ProcessorRows.gather(rt.state, slots.repeat_interleave(n), rows.position,
                                                                procs)
            i, j = torch.tril_indices(n, k, -1, device=slots.device)  # row (b, i) counts drafts j < i
            b = torch.arange(slots.shape[0], device=slots.device)[:, None]
            procs_rows.count_tokens((b * n + i).reshape(-1), drafts[:, j].reshape(-1))
        out = logits_processors.sample(rt.ops, logits, rows, num_top, procs_rows)
        self.slot_io.verify_commit(slots, drafts, out, self.outputs, num_top, procs)

    def _append(self, seq: Sequence, emitted: list[int], rows, first_row: int) -> list[api.TokenResult]:
        """Appends the emitted tokens (all cached but the last) to seq until one finishes it; row i of `rows`
        (from first_row) holds token i's logprob and alternatives."""
        tokens = []
        for i, tok in enumerate(emitted):
            seq.num_cached = seq.seq_len
            reason = seq.append(tok, self.rt.eos_token_ids)
            tokens.append(token_result(seq, rows, first_row + i, reason))
            if reason != FinishReason.NONE:
                break
        return tokens

    # ------------------------------------------------------------------ general

    def _general(self, seqs: list[Sequence], items: list[api.VerifyItem]) -> list[api.VerifyResult]:
        rt = self.rt
        dev, vocab = rt.device, rt.vocab_size
        ks = [len(it.draft_token_ids) for it in items]
        batch = build_extend_batch(
            rt.state.block_table, [s.slot for s in seqs], [s.num_cached for s in seqs],
            [[s.token_ids[-1]] + list(it.draft_token_ids) for s, it in zip(seqs, items)],
            [list(range(k + 1)) for k in ks], rt.block_size, dev, rt.dynamic_rope, per_token=True)
        logits = rt.model.forward(batch)  # [sum(k + 1), vocab]
        # Per row: its slot's parameters, the drafts before it counted as seen, the position it decides.
        offsets = [0]
        for k in ks:
            offsets.append(offsets[-1] + k + 1)
        row_slots = [s.slot for s, k in zip(seqs, ks) for _ in range(k + 1)]
        row_pos = [s.seq_len + i for s, k in zip(seqs, ks) for i in range(k + 1)]
        extra = [(offsets[b] + i, tok) for b, it in enumerate(items) for i in range(ks[b] + 1)
                 for tok in it.draft_token_ids[:i]]
        row_slots_t, row_pos_t = torch.tensor(row_slots, device=dev), torch.tensor(row_pos, device=dev)
        st = rt.state.sampling_rows(row_slots_t, row_pos_t)
        procs = logits_processors.batch_flags(seqs)
        extra_rows = extra_tokens = None
        if extra:
            extra_rows, extra_tokens = torch.tensor([r for r, _ in extra], device=dev), \
                torch.tensor([t for _, t in extra], device=dev)
            st.seen[extra_rows, extra_tokens] = True
        sample_logits = logits
        if procs:  # the drafts before a row count as its output tokens; sampled rows see the processed logits
            procs_rows = logits_processors.ProcessorRows.gather(rt.state, row_slots_t, row_pos_t, procs)
            if extra:
                procs_rows.count_tokens(extra_rows, extra_tokens)
            sample_logits, st = logits_processors.apply(logits, st, procs_rows)
        # Every row's own draw (what decode would emit there); drafts without distributions are accepted while
        # they equal it (greedy match), drafts with distributions by rejection sampling.
        sampled = rt.ops.sample(sample_logits, st).token_ids
        by_probs = [b for b, it in enumerate(items) if it.draft_probs]  # k >= 1: k distributions were given
        rejection: list[torch.Tensor] = []  # per item of by_probs: (num_accepted, token) on the device
        if by_probs:
            target = target_logprobs(sample_logits, st)
            for k in sorted({ks[b] for b in by_probs}):
                group = [b for b in by_probs if ks[b] == k]
                rows = torch.tensor([offsets[b] + i for b in group for i in range(k + 1)], device=dev)
                drafts = torch.tensor([items[b].draft_token_ids for b in group], dtype=torch.int64,
                                      device=dev).view(len(group), k)
                probs = torch.stack([torch.tensor(items[b].draft_probs, dtype=torch.float32).view(k, vocab)
                                     for b in group]).to(dev)
                shape = (len(group), k + 1)
                accepted, tokens = rt.ops.accept_drafts(target[rows].view(*shape, vocab), drafts, probs,
                                                        st.seed[rows].view(shape), st.position[rows].view(shape))
                rejection += [torch.stack([accepted[n], tokens[n]]) for n in range(len(group))]
        sampled_host = sampled.tolist()
        decided = dict(zip(sorted(by_probs, key=lambda b: (ks[b], b)),  # the order `rejection` was built in
                           torch.stack(rejection).tolist() if rejection else []))
        host = []
        for b, it in enumerate(items):
            if b in decided:
                host.append(tuple(decided[b]))
                continue
            row = sampled_host[offsets[b]:offsets[b + 1]]
            j = 0
            while j < ks[b] and row[j] == it.draft_token_ids[j]:
                j += 1
            host.append((j, row[j]))
        emitted = [list(it.draft_token_ids[:j]) + [tok] for it, (j, tok) in zip(items, host)]
        rows_e = [offsets[b] + i for b, e in enumerate(emitted) for i in range(len(e))]
        toks_e = [t for e in emitted for t in e]
        out = model_logprobs(logits[torch.tensor(rows_e, device=dev)], torch.tensor(toks_e, device=dev),
                             self.num_top(seqs))
        rows_host = host_rows(out)
        results, at = [], 0
        for seq, (num_accepted, _), toks in zip(seqs, host, emitted):
            results.append(api.VerifyResult(seq.seq_id, num_accepted, self._append(seq, toks, rows_host, at)))
            at += len(toks)
        # The slot state follows: last token, KV length (past the accepted tokens only), seen tokens.
        state = rt.state
        slots_t = torch.tensor([s.slot for s in seqs], device=dev)
        state.last_token[slots_t] = torch.tensor([s.token_ids[-1] for s in seqs], device=dev)
        state.num_cached[slots_t] = torch.tensor([s.num_cached for s in seqs], dtype=torch.int32, device=dev)
        kept = [(s.slot, t.token_id) for s, r in zip(seqs, results) for t in r.tokens]
        kept_slots, kept_tokens = torch.tensor([k[0] for k in kept], device=dev), \
            torch.tensor([k[1] for k in kept], device=dev)
        state.mark_seen(kept_slots, kept_tokens)
        if procs & logits_processors.PENALTIES:
            state.count_outputs(kept_slots, kept_tokens)
        return results
