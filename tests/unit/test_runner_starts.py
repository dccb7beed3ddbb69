"""GenerateStreams.start (worker/generate_streams.py): Generate streams that start while their prefill call waits in the runner's queue
share one engine call and one Engine.prefill, a refused prompt fails alone, and nothing stays allocated."""
from __future__ import annotations

import asyncio
import threading

import pytest

from conftest import engine_config
from engine.api import PrefillItem
from engine.engine import Engine
from engine.errors import InvalidArgument
from engine.sampling import SamplingParams, StoppingCriteria
from worker.runner import EngineRunner


def alloc(total: int):
    return lambda e: e.alloc_sequence(total, SamplingParams(), StoppingCriteria(max_new_tokens=4, ignore_eos=True))


async def started(tiny_model, prompts: list[list[int]], **changes):
    """Starts one stream per prompt while the engine thread is held busy, then lets it go; returns (the
    prefill calls' item counts, each start's outcome, the runner)."""
    runner = await EngineRunner.start(lambda: Engine(engine_config(tiny_model, **changes)))
    calls, gate = [], threading.Event()
    prefill = runner.engine.prefill
    runner.engine.prefill = lambda items: calls.append(len(items)) or prefill(items)
    busy = asyncio.ensure_future(runner.call(lambda e: gate.wait(30)))  # the engine thread, busy
    await asyncio.sleep(0)
    starts = [asyncio.ensure_future(runner.streams.start(p, alloc(len(p) + 8))) for p in prompts]
    await asyncio.sleep(0.05)  # every start queued behind the busy call
    gate.set()
    await busy
    outcomes = await asyncio.gather(*starts, return_exceptions=True)
    return calls, outcomes, runner


async def drain(runner: EngineRunner, outcomes) -> list[list[int]]:
    tokens = []
    for o in outcomes:
        if isinstance(o, BaseException):
            continue
        seq_id, out = o
        got = []
        while (item := await out.get()) is not None:
            got.append(item.token_id)
        tokens.append(got)
    return tokens


@pytest.mark.timeout(120)
def test_streams_starting_together_share_one_prefill(tiny_model):
    async def main():
        prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9], [10, 11]]
        calls, outcomes, runner = await started(tiny_model, prompts)
        try:
            assert calls == [4], calls  # one Engine.prefill of the four prompts, not four
            tokens = await drain(runner, outcomes)
            assert [len(t) for t in tokens] == [4] * 4
            # the same greedy tokens as each prompt prefilled alone
            alone = Engine(engine_config(tiny_model))
            try:
                for p, got in zip(prompts, tokens):
                    sid = alloc(len(p) + 8)(alone).seq_id
                    first = alone.prefill([PrefillItem(sid, p)])
                    want = [first.tokens[0].token_id] + [alone.decode([sid]).tokens[0].token_id for _ in range(3)]
                    alone.release([sid])
                    assert got == want
            finally:
                alone.close()
            free, usable = await runner.run(lambda e: (e.blocks.num_free_blocks, e.blocks.num_usable_blocks))
            assert free == usable  # every finished stream's sequence released
        finally:
            await runner.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_refused_prompt_fails_alone_and_leaves_nothing_allocated(tiny_model):
    async def main():
        calls, outcomes, runner = await started(tiny_model, [[1, 2, 3], [10 ** 9], [4, 5]])
        try:
            assert isinstance(outcomes[1], InvalidArgument), outcomes[1]
            assert not isinstance(outcomes[0], BaseException) and not isinstance(outcomes[2], BaseException)
            assert calls[0] == 3  # tried together first, then one by one
            tokens = await drain(runner, outcomes)
            assert [len(t) for t in tokens] == [4, 4]
            free, usable = await runner.run(lambda e: (e.blocks.num_free_blocks, e.blocks.num_usable_blocks))
            assert free == usable  # every sequence released, the refused one too
        finally:
            await runner.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_more_starts_than_a_batch_holds_prefill_max_batch_size_at_a_time(tiny_model):
    async def main():
        calls, outcomes, runner = await started(tiny_model, [[i + 1, i + 2] for i in range(5)], max_batch_size=2)
        try:
            assert calls == [2, 2, 1], calls
            assert [len(t) for t in await drain(runner, outcomes)] == [4] * 5
        finally:
            await runner.shutdown()

    asyncio.run(main())
