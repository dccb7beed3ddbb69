"""Sampling and speculative acceptance on the kernels of kernels_cu/sampling.cu and spec_accept.cu, for CudaOps:
sync-free and capturable (outputs sized from tensor shapes, no device value read on the host)."""
from __future__ import annotations

import torch

from engine import sampling
from engine.cuda.library import KernelLibrary
from engine.cuda.wrappers import sampling as sample_kernels
from engine.cuda.wrappers import spec_accept
from engine.cuda.wrappers.sampling import SAMPLE_PART_STRIDE, TOPK_CHUNK


def sample(lib: KernelLibrary, logits: torch.Tensor, st: sampling.SamplingTensors,
           num_top: int = 0) -> sampling.SampleOutput:
    """TorchOps.sample's contract: one token a row of logits [rows, vocab] under each row's sampling parameters (st),
    its log-prob, and the num_top best log-probs when asked (torch.topk where the top-k kernels do not take the
    vocabulary)."""
    logits = logits.float().contiguous()
    rows, vocab = logits.shape
    dev = logits.device
    args = (logits, st.seen.contiguous(), st.temperature.float(), st.top_k.long(), st.top_p.float(),
            st.seed.long(), st.repetition_penalty.float(), st.position.long())
    splits = sample_kernels.vocab_splits(lib, rows, vocab)
    parts = torch.empty((rows, splits, SAMPLE_PART_STRIDE), dtype=torch.float32, device=dev)
    thresholds = torch.empty(rows, dtype=torch.int32, device=dev)
    tokens = torch.empty(rows, dtype=torch.int64, device=dev)
    logprobs = torch.empty(rows, dtype=torch.float32, device=dev)
    if rows:
        sample_kernels.stats(lib, parts, *args)
        sample_kernels.select(lib, thresholds, parts, *args)
        sample_kernels.draw(lib, parts, thresholds, *args)
        sample_kernels.finish(lib, tokens, logprobs, parts, logits, args[2])
    if not num_top:
        return sampling.SampleOutput(tokens, logprobs, None, None)
    if not rows or not sample_kernels.topk_fits(lib, vocab, num_top):
        top = torch.topk(torch.log_softmax(logits, dim=-1), num_top, dim=-1)
        return sampling.SampleOutput(tokens, logprobs, top.indices, top.values)
    top_ids = torch.empty((rows, num_top), dtype=torch.int64, device=dev)
    top_logprobs = torch.empty((rows, num_top), dtype=torch.float32, device=dev)
    cand = torch.empty((rows, -(-vocab // TOPK_CHUNK), num_top), dtype=torch.int64, device=dev)
    sample_kernels.topk(lib, top_ids, top_logprobs, cand, parts, logits)  # (torch.topk is several times slower)
    return sampling.SampleOutput(tokens, logprobs, top_ids, top_logprobs)


def accept_drafts(lib: KernelLibrary, target_logp: torch.Tensor, draft_ids: torch.Tensor,
                  draft_probs: torch.Tensor | None, seed: torch.Tensor,
                  position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched engine.sampling.accept_drafts: target_logp [B, K+1, V] (target_logprobs rows), draft_ids [B, K],
    draft_probs [B, K, V] or None, seed / position [B, K+1]. Returns (num_accepted [B] int64, the token drawn after
    them [B] int64), on the device, with no host sync."""
    batch, k1, vocab = target_logp.shape
    dev = target_logp.device
    splits = sample_kernels.vocab_splits(lib, batch, vocab)
    parts = torch.empty((batch, splits, SAMPLE_PART_STRIDE), dtype=torch.float32, device=dev)
    num_accepted = torch.empty(batch, dtype=torch.int64, device=dev)
    tokens = torch.empty(batch, dtype=torch.int64, device=dev)
    if draft_probs is not None:
        draft_probs = draft_probs.float().contiguous()
    spec_accept.draw(lib, parts, target_logp.float().contiguous(), draft_ids.long().contiguous(), draft_probs,
                     seed.long().contiguous(), position.long().contiguous())
    spec_accept.finish(lib, num_accepted, tokens, parts, k1 - 1)
    return num_accepted, tokens
