"""Token sampling (kernels_cu/sampling.cu): four kernels, always launched together (stats, select, draw,
finish), over a row's vocabulary split S ways (vocab_splits); and the top-logprob candidates (topk)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import expect_shape, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


SAMPLE_PART_STRIDE = 8  # floats per (row, vocabulary split) of the parts scratch [N, S, SAMPLE_PART_STRIDE]
TOPK_CHUNK = 1024  # tokens per block of sample_topk_split
TOPK_MAX = 32  # the most top-logprob candidates the kernels give (sample_topk_*)


def vocab_splits(lib: KernelLibrary, rows: int, vocab: int) -> int:
    """Vocabulary splits of the sampling kernels: about eight 256-thread blocks per SM (a full SM; with
    four, 32 rows of a 128k vocabulary were slower in sample_stats), at least 1024 tokens each."""
    return max(1, min(-(-vocab // 1024), -(-8 * lib.num_sms // max(rows, 1))))


def _rows(logits, seen, temperature, top_k, top_p, seed, penalty, position):
    lg = tensor_arg(logits, "logits", torch.float32, 2, align=False)
    N, V = logits.shape
    sn = tensor_arg(seen, "seen", torch.bool, 2, align=False)
    expect_shape(seen, "seen", (N, V))
    ptrs = [lg, sn]
    for t, name, dt in ((temperature, "temperature", torch.float32), (top_k, "top_k", torch.int64),
                        (top_p, "top_p", torch.float32), (seed, "seed", torch.int64),
                        (penalty, "repetition_penalty", torch.float32), (position, "position", torch.int64)):
        ptrs.append(tensor_arg(t, name, dt, 1, align=False))
        expect_shape(t, name, (N,))
    return N, V, ptrs


def stats(lib: KernelLibrary, parts, logits, seen, temperature, top_k, top_p, seed, penalty, position) -> None:
    N, V, ptrs = _rows(logits, seen, temperature, top_k, top_p, seed, penalty, position)
    pp = tensor_arg(parts, "sample parts", torch.float32, 3)
    S = parts.shape[1]
    expect_shape(parts, "sample parts", (N, S, SAMPLE_PART_STRIDE))
    lib.kernels["sample_stats"]((S, N, 1), (256, 1, 1), 0, lib.stream(), pp, *ptrs, V, S)


def select(lib: KernelLibrary, thresholds, parts, logits, seen, temperature, top_k, top_p, seed, penalty,
           position) -> None:
    N, V, ptrs = _rows(logits, seen, temperature, top_k, top_p, seed, penalty, position)
    th = tensor_arg(thresholds, "sample thresholds", torch.int32, 1, align=False)
    expect_shape(thresholds, "sample thresholds", (N,))
    pp = tensor_arg(parts, "sample parts", torch.float32, 3)
    S = parts.shape[1]
    lib.kernels["sample_select"]((N, 1, 1), (1024, 1, 1), 0, lib.stream(), th, pp, *ptrs, V, S)


def draw(lib: KernelLibrary, parts, thresholds, logits, seen, temperature, top_k, top_p, seed, penalty,
         position) -> None:
    N, V, ptrs = _rows(logits, seen, temperature, top_k, top_p, seed, penalty, position)
    pp = tensor_arg(parts, "sample parts", torch.float32, 3)
    th = tensor_arg(thresholds, "sample thresholds", torch.int32, 1, align=False)
    S = parts.shape[1]
    lib.kernels["sample_draw"]((S, N, 1), (256, 1, 1), 0, lib.stream(), pp, th, *ptrs, V, S)


def finish(lib: KernelLibrary, tokens, logprobs, parts, logits, temperature) -> None:
    lg = tensor_arg(logits, "logits", torch.float32, 2, align=False)
    N, V = logits.shape
    tk = tensor_arg(tokens, "tokens", torch.int64, 1, align=False)
    lp = tensor_arg(logprobs, "logprobs", torch.float32, 1, align=False)
    expect_shape(tokens, "tokens", (N,))
    expect_shape(logprobs, "logprobs", (N,))
    pp = tensor_arg(parts, "sample parts", torch.float32, 3)
    tp = tensor_arg(temperature, "temperature", torch.float32, 1, align=False)
    S = parts.shape[1]
    lib.kernels["sample_finish"]((N, 1, 1), (32, 1, 1), 0, lib.stream(), tk, lp, pp, lg, tp, V, S)


def topk(lib: KernelLibrary, top_ids, top_logprobs, cand, parts, logits) -> None:
    """The k = top_ids.shape[1] largest raw logits of each row, in order (ties: the lower id), and their
    log-softmax (the stats sample_stats left in parts): sample_topk_split then sample_topk_merge.
    cand: [N, ceil(V / TOPK_CHUNK), k] int64 scratch. topk_fits(lib, V, k) says whether it can."""
    lg = tensor_arg(logits, "logits", torch.float32, 2, align=False)
    N, V = logits.shape
    k = top_ids.shape[1] if top_ids.dim() == 2 else 0
    if not topk_fits(lib, V, k):
        raise KernelArgError(f"sample_topk: k = {k} of {V} tokens; the kernels give 1 to {TOPK_MAX} candidates, "
                             f"from at most {lib.topk_smem_limit // (8 * k + 4) * TOPK_CHUNK if k else 0} tokens")
    chunks = -(-V // TOPK_CHUNK)
    ti = tensor_arg(top_ids, "top_ids", torch.int64, 2, align=False)
    tl = tensor_arg(top_logprobs, "top_logprobs", torch.float32, 2, align=False)
    cp = tensor_arg(cand, "topk candidates", torch.int64, 3, align=False)
    expect_shape(top_ids, "top_ids", (N, k))
    expect_shape(top_logprobs, "top_logprobs", (N, k))
    expect_shape(cand, "topk candidates", (N, chunks, k))
    pp = tensor_arg(parts, "sample parts", torch.float32, 3)
    S = parts.shape[1]
    expect_shape(parts, "sample parts", (N, S, SAMPLE_PART_STRIDE))
    lib.kernels["sample_topk_split"]((chunks, N, 1), (256, 1, 1), 0, lib.stream(), cp, lg, V, k)
    lib.kernels["sample_topk_merge"]((N, 1, 1), (32, 1, 1), chunks * (8 * k + 4), lib.stream(), ti, tl, cp,
                                     pp, lg, V, S, chunks, k)


def topk_fits(lib: KernelLibrary, vocab: int, k: int) -> bool:
    """Whether sample_topk takes k candidates of a vocabulary of this size (its merge holds a row's in
    shared memory)."""
    return 1 <= k <= min(TOPK_MAX, vocab) and -(-vocab // TOPK_CHUNK) * (8 * k + 4) <= lib.topk_smem_limit
