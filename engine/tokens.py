"""Sampled tokens -> the sequences that drew them, and the TokenResults the caller gets back."""
from __future__ import annotations

from engine import api
from engine.sampling import SampleOutput
from engine.sequence import FinishReason, Sequence

# Host copies of a step's sampled rows: (token ids, logprobs, top-n ids per row, top-n logprobs per row); the
# top-n lists are None when no row asked for alternatives.
HostRows = tuple[list[int], list[float], list | None, list | None]


def commit_tokens(seqs: list[Sequence], token_ids: list[int], logprobs: list[float], top_ids: list | None,
                  top_logprobs: list | None, eos: frozenset[int]) -> list[api.TokenResult]:
    """Appends one sampled token to each sequence (row i to seqs[i]); returns their results. (Run for every
    token of every step: one loop, locals.)"""
    TokenResult = api.TokenResult
    if top_ids is None:  # no top logprobs in this step (append runs before len: the new length)
        return [TokenResult(seq.seq_id, tok, lp, [], seq.append(tok, eos), len(seq.token_ids))
                for seq, tok, lp in zip(seqs, token_ids, logprobs)]
    results = []
    for row, (seq, tok) in enumerate(zip(seqs, token_ids)):
        reason = seq.append(tok, eos)
        n = seq.sampling.top_logprobs
        top = list(zip(top_ids[row][:n], top_logprobs[row][:n])) if n else []
        results.append(TokenResult(seq.seq_id, tok, logprobs[row], top, reason, len(seq.token_ids)))
    return results


def token_result(seq: Sequence, rows: HostRows, row: int, reason: FinishReason) -> api.TokenResult:
    """The result of seq's last token, whose logprob and alternatives are row `row` of `rows`."""
    _, logprobs, top_ids, top_lps = rows
    n = seq.sampling.top_logprobs
    top = list(zip(top_ids[row][:n], top_lps[row][:n])) if n else []
    return api.TokenResult(seq.seq_id, seq.token_ids[-1], logprobs[row], top, reason, seq.seq_len)


def host_rows(out: SampleOutput) -> HostRows:
    """Host copies of a sample's results (one device -> host sync)."""
    return (out.token_ids.tolist(), out.logprobs.tolist(),
            out.top_ids.tolist() if out.top_ids is not None else None,
            out.top_logprobs.tolist() if out.top_logprobs is not None else None)


def in_request_order(results: list, order: list[int]) -> list:
    """results[j] belongs to request position order[j] (a batch run in slot order): put back in request order."""
    by_request = [None] * len(results)
    for pos, i in enumerate(order):
        by_request[i] = results[pos]
    return by_request
