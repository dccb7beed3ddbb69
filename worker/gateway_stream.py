"""A gateway Generate call's responses: its choices' token queues read as they fill (several tokens a chunk where the
handler fell behind), stop strings applied, and the chunks and Completes of worker/gateway_convert.py built."""
from __future__ import annotations

import asyncio

from engine.tokenizer import Tokenizer
from worker import gateway_convert as convert
from worker.gateway_requests import ABORTED, Choice, LiveRequest, Requests
from worker.generate_streams import GenerateStreams
from worker.stop_strings import StopStringMatcher


async def responses(live: LiveRequest, spec: convert.GenerateSpec, stream: bool, prompt_lp, streams: GenerateStreams,
                    requests: Requests, text: Tokenizer | None, interval: int = 1):
    """The GenerateResponses of a started call, as its choices' tokens come (gateway_convert's shapes): chunks and a
    Complete per choice (stream), or one Complete per choice once all have ended; stop strings end a choice
    (_until_stop_string), prompt_lp (the prompt's logprobs, None if not asked) rides on each choice's first chunk
    and every Complete. interval: a streamed choice's chunks after its first hold this many tokens (its last may
    hold fewer); a non-streamed call reads its queues as they fill."""
    prompt_tokens, num_logprobs = len(spec.prompt), spec.num_logprobs
    tokens: list[list] = [[] for _ in live.choices]
    reasons: list[str] = [convert.ABORT] * len(live.choices)
    matchers = [StopStringMatcher(spec.stop, text, spec.skip_special_tokens, spec.stopping.min_tokens)
                if spec.stop else None for _ in live.choices]
    async for choice, items in _choice_items(live.choices, interval if stream else 1):
        i, end = choice.index, items[-1]
        new = items[:-1] if _ended(end) else items
        if matchers[i] is not None:
            new = await _until_stop_string(choice, matchers[i], new, _ended(end), streams)
        requests.count_tokens(len(new))
        tokens[i] += new
        if stream and new:
            first = len(tokens[i]) == len(new)  # the choice's first chunk carries the prompt's logprobs
            yield convert.chunk(new, prompt_tokens, num_logprobs, tokens[i][0].cached_tokens, i,
                                prompt_lp if first else None)
        if isinstance(end, BaseException):
            raise end
        if end is None or end is ABORTED:  # the choice has ended
            matched = matchers[i].matched if matchers[i] is not None else None
            done_grammar = choice.constraint is not None and choice.constraint.terminated
            reasons[i] = convert.STOP if matched is not None or done_grammar else \
                convert.ABORT if end is ABORTED else convert.finish_reason(tokens[i])
            if stream:
                last = tokens[i][-1:] if reasons[i] != convert.ABORT else []
                cached = tokens[i][0].cached_tokens if tokens[i] else 0
                yield convert.complete(last, prompt_tokens, num_logprobs, reasons[i], cached, i, matched, prompt_lp)
    if not stream:
        for i, reason in enumerate(reasons):
            cached = tokens[i][0].cached_tokens if tokens[i] else 0
            matched = matchers[i].matched if matchers[i] is not None else None
            yield convert.complete(tokens[i], prompt_tokens, num_logprobs, reason, cached, i, matched, prompt_lp)

async def _until_stop_string(choice: Choice, matcher: StopStringMatcher, new: list, ended: bool,
                         streams: GenerateStreams) -> list:
    """The choice's new tokens up to the one that completes a stop string; at that one its sequence is
    stopped and its queue ended (the tokens of steps launched behind it are dropped)."""
    if matcher.matched is not None:
        return []
    for k, item in enumerate(new):
        if matcher.feed(item.token_id):
            if not ended:  # a sequence that ended with this delta was released by the runner
                await streams.stop(choice.seq_id)  # (its queue ends there)
            return new[:k + 1]
    return new


def _ended(item) -> bool:
    """Whether a choice's queue item is its last: None (finished), ABORTED, or an exception."""
    return item is None or item is ABORTED or isinstance(item, BaseException)


def _with_queued(choice: Choice, item) -> list:
    """item and the items already waiting behind it on the choice's queue, up to and including an ending one: a
    handler that fell behind the steps sends what it has in one chunk (as vLLM merges a lagging stream's deltas)
    instead of one write per token, each costing the event loop that also launches the steps."""
    items = [item]
    while not _ended(items[-1]) and not choice.out.empty():
        items.append(choice.out.get_nowait())
    return items


async def _choice_items(choices: list[Choice], interval: int = 1):
    """(choice, items) as the choices' token queues deliver them (_with_queued: one item, or several that were
    waiting together), until every queue has ended (_ended: that item is the last of its list). A choice's first
    items go at once; after them its items gather until `interval` tokens (or its end) are there. One choice reads
    its queue directly; several wait on all their queues at once."""
    held: dict[int, list] = {}  # choice index -> items gathered towards its next chunk
    sent: set[int] = set()  # choices whose first items have gone

    def ready(choice: Choice, items: list) -> list | None:
        items = held.pop(choice.index, []) + items
        if choice.index in sent and len(items) < interval and not _ended(items[-1]):
            held[choice.index] = items
            return None
        sent.add(choice.index)
        return items

    if len(choices) == 1:
        choice = choices[0]
        while True:
            items = ready(choice, _with_queued(choice, await choice.out.get()))
            if items is None:
                continue
            yield choice, items
            if _ended(items[-1]):
                return
    pending = {asyncio.ensure_future(c.out.get()): c for c in choices}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for get in sorted(done, key=lambda f: pending[f].index):
                choice = pending.pop(get)
                items = ready(choice, _with_queued(choice, get.result()))
                if items is not None:
                    yield choice, items
                if items is None or not _ended(items[-1]):
                    pending[asyncio.ensure_future(choice.out.get())] = choice
    finally:
        for get in pending:
            get.cancel()
