"""Decode step state (kernels_cu/decode_step.cu): the slot-resident state a decode (or uniform Verify) step
reads before its forward (prepare) and writes back after sampling (commit, verify_commit). Slot and token
values are not checked here (no host sync)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engine.cuda.checks import expect_shape, tensor_arg
from engine.cuda.driver import KernelArgError

if TYPE_CHECKING:
    from engine.cuda.library import KernelLibrary


def _vectors(tensors, n: int) -> list[int]:
    """Checks 1-D tensors [(tensor, name, dtype)] of n entries each (per-slot state columns, or a
    step's per-row values); returns their pointers."""
    ptrs = []
    for t, name, dt in tensors:
        ptrs.append(tensor_arg(t, name, dt, 1, align=False))
        expect_shape(t, name, (n,))
    return ptrs


def prepare(lib: KernelLibrary, slots, num_cached, last_token, block_table, temperature, top_k, top_p, seed, penalty,
            seen, block_size, input_ids, positions, slot_mapping, seq_lens, tables, row_temperature,
            row_top_k, row_top_p, row_seed, row_penalty, row_position, row_seen,
            drafts: torch.Tensor | None = None) -> None:
    """The inputs of a decode forward and its sampling rows, read from the slot state (one row per
    slots[b]): input_ids, positions, slot_mapping, seq_lens, tables [B, MB], row_* (row_position =
    position + 1, the index of the token each row draws), row_seen [B, V]. With drafts [B, k] (a
    uniform Verify; rows may be strided), every slot has k + 1 rows, b (k + 1) + i: its last token (i = 0)
    or draft i - 1 at position num_cached + i, with drafts 0 .. i - 1 counted as seen; the outputs then
    have B (k + 1) rows."""
    sl = tensor_arg(slots, "slots", torch.int64, 1, align=False)
    n, dp, ds = 1, 0, 0
    if drafts is not None:
        dp = tensor_arg(drafts, "drafts", torch.int64, 2, contiguous=False, align=False)
        if drafts.shape[0] != slots.shape[0] or drafts.stride(1) != 1:
            raise KernelArgError(f"drafts: expected [{slots.shape[0]}, k] with contiguous rows, got shape "
                                 f"{tuple(drafts.shape)} strides {drafts.stride()}")
        n, ds = drafts.shape[1] + 1, drafts.stride(0)
    B = slots.shape[0] * n
    S = num_cached.shape[0] if isinstance(num_cached, torch.Tensor) and num_cached.dim() == 1 else -1
    nc, lt, tp, tk, pp, sd, pn = _vectors(
        ((num_cached, "num_cached", torch.int32), (last_token, "last_token", torch.int64),
         (temperature, "temperature", torch.float32), (top_k, "top_k", torch.int64),
         (top_p, "top_p", torch.float32), (seed, "seed", torch.int64),
         (penalty, "repetition_penalty", torch.float32)), S)
    bt = tensor_arg(block_table, "block_table", torch.int32, 2, align=False)
    if block_table.shape[0] != S:
        raise KernelArgError(f"block_table: expected [{S}, max_blocks] (one row per slot), got "
                             f"{tuple(block_table.shape)}")
    MB = block_table.shape[1]
    sn = tensor_arg(seen, "seen", torch.bool, 2, align=False)
    if seen.shape[0] != S:
        raise KernelArgError(f"seen: expected [{S}, vocab] (one row per slot), got {tuple(seen.shape)}")
    V = seen.shape[1]
    if not isinstance(block_size, int) or block_size <= 0:
        raise KernelArgError(f"block_size: expected a positive int, got {block_size!r}")
    outs = _vectors(
        ((input_ids, "input_ids", torch.int64), (positions, "positions", torch.int64),
         (slot_mapping, "slot_mapping", torch.int64), (seq_lens, "seq_lens", torch.int32)), B)
    tb = tensor_arg(tables, "tables", torch.int32, 2, align=False)
    expect_shape(tables, "tables", (B, MB))
    rows = _vectors(
        ((row_temperature, "row_temperature", torch.float32), (row_top_k, "row_top_k", torch.int64),
         (row_top_p, "row_top_p", torch.float32), (row_seed, "row_seed", torch.int64),
         (row_penalty, "row_penalty", torch.float32), (row_position, "row_position", torch.int64)), B)
    rs = tensor_arg(row_seen, "row_seen", torch.bool, 2, align=False)
    expect_shape(row_seen, "row_seen", (B, V))
    if B == 0:
        return
    parts = max(1, min(16, -(-V // (16 * 1024))))  # seen copied in pieces of <= 1024 16-byte vectors
    lib.kernels["decode_prepare"]((B, parts, 1), (256, 1, 1), 0, lib.stream(), *outs, tb, *rows, rs,
                                  sl, nc, lt, bt, tp, tk, pp, sd, pn, sn, MB, V, block_size, dp, ds, n)


def verify_commit(lib: KernelLibrary, slots, drafts, sampled, logprobs, num_cached, last_token, seen, out_accepted,
                  out_tokens, out_logprobs) -> None:
    """A uniform Verify's results back to the slot state: per slot row b, the accepted count a (the
    prefix where sampled [B, k + 1] equals drafts [B, k]), the token t = sampled[b, a] after them;
    num_cached[s] += 1 + a, last_token[s] = t, seen marked for every emitted token (sampled[b, :a + 1],
    then t); out_accepted / out_tokens [>= B], out_logprobs [>= B, k + 1] (strided rows) = logprobs."""
    sl = tensor_arg(slots, "slots", torch.int64, 1, align=False)
    B = slots.shape[0]
    dp = tensor_arg(drafts, "drafts", torch.int64, 2, contiguous=False, align=False)
    if drafts.shape[0] != B or drafts.stride(1) != 1:
        raise KernelArgError(f"drafts: expected [{B}, k] with contiguous rows, got shape {tuple(drafts.shape)} "
                             f"strides {drafts.stride()}")
    k = drafts.shape[1]
    sp = tensor_arg(sampled, "sampled", torch.int64, 1, align=False)
    lp = tensor_arg(logprobs, "logprobs", torch.float32, 1, align=False)
    for t, name in ((sampled, "sampled"), (logprobs, "logprobs")):
        expect_shape(t, name, (B * (k + 1),))
    S = num_cached.shape[0] if isinstance(num_cached, torch.Tensor) and num_cached.dim() == 1 else -1
    nc, lt = _vectors(((num_cached, "num_cached", torch.int32), (last_token, "last_token", torch.int64)), S)
    sn = tensor_arg(seen, "seen", torch.bool, 2, align=False)
    if seen.shape[0] != S:
        raise KernelArgError(f"seen: expected [{S}, vocab] (one row per slot), got {tuple(seen.shape)}")
    oa = tensor_arg(out_accepted, "out_accepted", torch.int64, 1, align=False)
    ot = tensor_arg(out_tokens, "out_tokens", torch.int64, 1, align=False)
    ol = tensor_arg(out_logprobs, "out_logprobs", torch.float32, 2, contiguous=False, align=False)
    if (out_accepted.shape[0] < B or out_tokens.shape[0] < B or out_logprobs.shape[0] < B
            or out_logprobs.shape[1] < k + 1 or out_logprobs.stride(1) != 1):
        raise KernelArgError(f"verify_commit: outputs for {B} slots of {k + 1} rows: out_accepted "
                             f"{tuple(out_accepted.shape)}, out_tokens {tuple(out_tokens.shape)}, out_logprobs "
                             f"{tuple(out_logprobs.shape)} strides {out_logprobs.stride()}")
    if B == 0:
        return
    lib.kernels["verify_commit"]((-(-B // 128), 1, 1), (128, 1, 1), 0, lib.stream(), oa, ot, ol, nc, lt, sn,
                                 sl, dp, sp, lp, B, k, drafts.stride(0), out_logprobs.stride(0), seen.shape[1])


def commit(lib: KernelLibrary, slots, tokens, logprobs, num_cached, last_token, seen, out_tokens, out_logprobs) -> None:
    """The sampled tokens back to the slot state (num_cached[s] += 1, last_token[s] = token,
    seen[s, token] = True for s = slots[b]; the slots must be distinct) and to the results kept per slot
    and position: out_tokens / out_logprobs [S, R] at [s, num_cached[s] % R] (num_cached before the
    step). The results may be pinned host tensors: the kernel writes them through unified addressing."""
    sl = tensor_arg(slots, "slots", torch.int64, 1, align=False)
    B = slots.shape[0]
    tk, lp = _vectors(((tokens, "tokens", torch.int64), (logprobs, "logprobs", torch.float32)), B)
    S = num_cached.shape[0] if isinstance(num_cached, torch.Tensor) and num_cached.dim() == 1 else -1
    nc, lt = _vectors(((num_cached, "num_cached", torch.int32), (last_token, "last_token", torch.int64)), S)
    sn = tensor_arg(seen, "seen", torch.bool, 2, align=False)
    if seen.shape[0] != S:
        raise KernelArgError(f"seen: expected [{S}, vocab] (one row per slot), got {tuple(seen.shape)}")
    V = seen.shape[1]
    ot = tensor_arg(out_tokens, "out_tokens", torch.int64, 2, align=False, host_mapped=True)
    ol = tensor_arg(out_logprobs, "out_logprobs", torch.float32, 2, align=False, host_mapped=True)
    R = out_tokens.shape[1]
    for t, name in ((out_tokens, "out_tokens"), (out_logprobs, "out_logprobs")):
        if t.shape[0] != S or t.shape[1] != R or R < 1:
            raise KernelArgError(f"{name}: expected [{S}, R >= 1] (a row per slot, the rows of both alike), "
                                 f"got {tuple(t.shape)}")
    if B == 0:
        return
    lib.kernels["decode_commit"]((-(-B // 128), 1, 1), (128, 1, 1), 0, lib.stream(),
                                 ot, ol, R, nc, lt, sn, sl, tk, lp, B, V)
