"""Scorer: teacher-forced log-probabilities of a whole token sequence: every row (score: what perplexity and top-1
agreement against a reference model are measured with), or each token's own and the top alternatives
(prompt_logprobs: vLLM's prompt_logprobs, from the raw logits, reduced on the device); and its embedding (embed:
the last token's final-normed hidden state, as vLLM embeds with a decoder model).

One call prefills the tokens into a scratch slot and KV blocks of its own (no prefix cache: nothing is
shared or registered), with logits for every row, and gives the slot and blocks back before it returns.
It runs eagerly (no CUDA graphs), in forwards of at most max_prefill_tokens tokens, each continuing the
KV the previous one wrote; the caller has finished every decode step in flight."""
from __future__ import annotations

import torch

from engine import api
from engine.batch import build_extend_batch
from engine.errors import InvalidArgument, ResourceExhausted
from engine.prefix_cache import BlockPool
from engine.runtime import Runtime
from engine.sequence import SequenceTable, SlotTable
from engine.sequence_blocks import SequenceBlocks


PROMPT_LOGPROBS_CHUNK = 1024  # tokens a forward of prompt_logprobs: its fp32 log-softmax block is chunk x vocab


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
        return torch.cat(self._rows(token_ids, self.rt.config.max_prefill_tokens,
                                    lambda lp, start: lp.cpu()))

    def prompt_logprobs(self, token_ids: list[int], num_top: int) -> api.PromptLogprobs:
        """Each token's log-probability after the ones before it (from the second on) and the num_top most
        likely tokens there, reduced on the device (forwards of at most PROMPT_LOGPROBS_CHUNK tokens: a
        [chunk, vocab] fp32 block at a time). Refuses as score() does."""
        nxt = torch.tensor(token_ids[1:] + [0], device=self.rt.device)

        def reduce(lp: torch.Tensor, start: int):
            chosen = lp.gather(1, nxt[start:start + lp.shape[0], None])[:, 0]
            top = lp.topk(num_top, dim=-1) if num_top else None
            return chosen.cpu(), top.indices.cpu() if top else None, top.values.cpu() if top else None

        parts = self._rows(token_ids, min(self.rt.config.max_prefill_tokens, PROMPT_LOGPROBS_CHUNK), reduce)
        last = len(token_ids) - 1  # the last row predicts a token that is not there
        values = torch.cat([c for c, _, _ in parts])[:last]
        if not num_top:
            return api.PromptLogprobs(values.tolist(), [[] for _ in range(last)], [[] for _ in range(last)])
        return api.PromptLogprobs(values.tolist(), torch.cat([i for _, i, _ in parts])[:last].tolist(),
                                  torch.cat([v for _, _, v in parts])[:last].tolist())

    def embed(self, token_ids: list[int]) -> torch.Tensor:
        """vLLM's embedding of a token sequence by a decoder model (pooling "LAST", normalized, as for
        Qwen3-Embedding or e5-mistral): the hidden state of its last token after the model's final norm, scaled to
        unit L2 norm, [hidden] fp32 on the CPU. Refuses as score() does."""
        outs = self._forwards(token_ids, self.rt.config.max_prefill_tokens, hidden=True,
                              rows_of=lambda n: [n - 1],  # each chunk's last row: the last chunk's is the one
                              take=lambda h, start: h)
        return torch.nn.functional.normalize(outs[-1][0].float(), dim=0).cpu()

    def _rows(self, token_ids: list[int], chunk: int, reduce) -> list:
        """reduce(fp32 log-softmax rows of a forward over token_ids[start:start + chunk], start) for each chunk,
        the forwards continuing one another's KV in a scratch slot (see score())."""
        return self._forwards(token_ids, chunk, rows_of=lambda n: list(range(n)),
                              take=lambda logits, start: reduce(torch.log_softmax(logits.float(), dim=-1), start))

    def _forwards(self, token_ids: list[int], chunk: int, rows_of, take, hidden: bool = False) -> list:
        """take(the forward's output rows rows_of(n), start) for each chunk of n tokens from token_ids[start], the
        forwards continuing one another's KV in a scratch slot (see score()); the output: fp32 logits, or with
        hidden the final-normed hidden states."""
        rt = self.rt
        if not 1 <= len(token_ids) <= rt.max_seq_len:
            raise InvalidArgument(f"a sequence scored or embedded holds 1 to {rt.max_seq_len} tokens (--max-seq-len), "
                                  f"got {len(token_ids)}")
        self.sequences.check_tokens(token_ids, "token_ids")
        if not self.slots.can_allocate():
            raise ResourceExhausted(f"all {self.rt.config.max_slots} sequence slots are in use (--max-slots)")
        blocks = SequenceBlocks(self.blocks, -(-len(token_ids) // rt.block_size), caching=False)
        slot = self.slots.allocate()
        try:
            out = []
            with rt.dispatch.on_device():
                # On the compute stream, as the forwards that read the row: a copy queued on another stream (torch's
                # default) need not have landed when they run (garbage attention when the copy engines are busy).
                rt.state.set_blocks(slot, 0, blocks.grow_all())
                for start in range(0, len(token_ids), chunk):
                    tokens = token_ids[start:start + chunk]
                    batch = build_extend_batch(rt.state.block_table, [slot], [start], [tokens],
                                               [rows_of(len(tokens))], rt.block_size, rt.device, rt.dynamic_rope)
                    batch.hidden_states = hidden
                    out.append(take(rt.model.forward(batch), start))
            return out
        finally:
            blocks.release()
            self.slots.free(slot)
