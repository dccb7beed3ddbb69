"""Speculative acceptance (kernels_cu/spec_accept.cu): B sequences with K drafts each, sync-free: draw over
vocabulary splits, then finish (the accepted count and the token after the accepted drafts)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import expect_shape, tensor_arg
from engine.cuda.driver import KernelArgError
from engine.cuda.wrappers.sampling import SAMPLE_PART_STRIDE

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


def draw(lib: KernelLibrary, parts, target_logp, draft_ids, draft_probs, seed, position) -> None:
    tl = tensor_arg(target_logp, "target_logp", torch.float32, 3, align=False)
    B, K1, V = target_logp.shape
    K = K1 - 1
    if K < 1:
        raise KernelArgError(f"spec accept: need at least one draft per sequence, target_logp "
                             f"{tuple(target_logp.shape)}")
    di = tensor_arg(draft_ids, "draft_ids", torch.int64, 2, align=False)
    expect_shape(draft_ids, "draft_ids", (B, K))
    dp = 0
    if draft_probs is not None:
        dp = tensor_arg(draft_probs, "draft_probs", torch.float32, 3, align=False)
        expect_shape(draft_probs, "draft_probs", (B, K, V))
    sd = tensor_arg(seed, "seed", torch.int64, 2, align=False)
    expect_shape(seed, "seed", (B, K1))
    ps = tensor_arg(position, "position", torch.int64, 2, align=False)
    expect_shape(position, "position", (B, K1))
    pp = tensor_arg(parts, "accept parts", torch.float32, 3)
    S = parts.shape[1]
    expect_shape(parts, "accept parts", (B, S, SAMPLE_PART_STRIDE))
    lib.kernels["spec_accept_draw"]((S, B, 1), (256, 1, 1), 0, lib.stream(), pp, tl, di, dp, sd, ps, K, V, S)


def finish(lib: KernelLibrary, num_accepted, tokens, parts, num_drafts: int) -> None:
    B, S = parts.shape[:2]
    na = tensor_arg(num_accepted, "num_accepted", torch.int64, 1, align=False)
    tk = tensor_arg(tokens, "tokens", torch.int64, 1, align=False)
    expect_shape(num_accepted, "num_accepted", (B,))
    expect_shape(tokens, "tokens", (B,))
    pp = tensor_arg(parts, "accept parts", torch.float32, 3)
    lib.kernels["spec_accept_finish"]((B, 1, 1), (32, 1, 1), 0, lib.stream(), na, tk, pp, num_drafts, S)
