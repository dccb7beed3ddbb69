"""GenerateStreams' backpressure (worker/generate_streams.py): a stream whose caller has begun reading but has not
taken MAX_UNSENT_TOKENS of its tokens sits out the steps while the others go on, resumes when its caller takes
them, and a runner whose every stream is held back waits instead of spinning or ending. A stream not read yet (a
choice of an n > 1 call while the later ones start) runs on."""
from __future__ import annotations

import asyncio

import pytest

from conftest import engine_config
from engine.engine import Engine
from engine.sampling import SamplingParams, StoppingCriteria
from worker.generate_streams import MAX_UNSENT_TOKENS
from worker.runner import EngineRunner

NEW_TOKENS = 24


def alloc(total: int):
    return lambda e: e.alloc_sequence(total, SamplingParams(), StoppingCriteria(max_new_tokens=NEW_TOKENS,
                                                                                ignore_eos=True))


async def take_all(out: asyncio.Queue) -> list[int]:
    got = []
    while (item := await out.get()) is not None:
        got.append(item.token_id)
    return got


@pytest.mark.timeout(120)
def test_a_stream_whose_caller_lags_is_held_back_and_resumes(tiny_model):
    async def main():
        runner = await EngineRunner.start(lambda: Engine(engine_config(tiny_model)))
        try:
            engine = runner.engine
            (slow_id, slow), (fast_id, fast) = [await runner.streams.start(p, alloc(len(p) + NEW_TOKENS + 1))
                                                for p in ([1, 2, 3], [4, 5, 6, 7])]
            first = (await slow.get()).token_id  # the slow caller takes its first token, then nothing for a while
            fast_tokens = await take_all(fast)  # the fast caller reads everything
            assert len(fast_tokens) == NEW_TOKENS
            held = engine.sequences[slow_id].num_generated
            assert slow.qsize() == held - 1 >= MAX_UNSENT_TOKENS  # stopped at the limit (plus the steps in flight)
            assert held - 1 < MAX_UNSENT_TOKENS + engine.config.max_steps_in_flight + 1
            await asyncio.sleep(0.05)
            assert engine.sequences[slow_id].num_generated == held  # held back: no step took it meanwhile
            assert len(runner.streams) == 1  # and the decode loop waits for it instead of ending
            slow_tokens = [first, *await take_all(slow)]  # taking resumes it, to its end
            assert len(slow_tokens) == NEW_TOKENS
            assert fast_id not in engine.sequences and slow_id not in engine.sequences
        finally:
            await runner.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_caller_that_never_reads_holds_its_stream_only_for_a_while(tiny_model, monkeypatch):
    """A caller that stops reading without going away: its stream is held back for MAX_HOLD_S, then runs to its
    end (tokens queued), so its sequence's slot and KV blocks are not held for good."""
    from worker import generate_streams

    monkeypatch.setattr(generate_streams, "MAX_HOLD_S", 0.3)

    async def main():
        runner = await EngineRunner.start(lambda: Engine(engine_config(tiny_model)))
        try:
            seq_id, out = await runner.streams.start([1, 2, 3], alloc(3 + NEW_TOKENS + 1))
            out.get_nowait()  # the caller takes the first token, then stops reading
            await asyncio.sleep(0.1)
            assert seq_id in runner.engine.sequences  # held back
            for _ in range(100):
                if seq_id not in runner.engine.sequences:
                    break
                await asyncio.sleep(0.05)
            assert seq_id not in runner.engine.sequences  # ran on and ended, released
            assert len(await take_all(out)) == NEW_TOKENS - 1
        finally:
            await runner.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(120)
def test_a_stream_not_read_yet_runs_on(tiny_model):
    """A stream whose caller has not begun reading (the started choices of an n > 1 call while the later ones
    start, read once all have) is not held back: it runs to its end well within MAX_HOLD_S and frees its slot."""
    from worker import generate_streams

    async def main():
        runner = await EngineRunner.start(lambda: Engine(engine_config(tiny_model)))
        try:
            seq_id, out = await runner.streams.start([1, 2, 3], alloc(3 + NEW_TOKENS + 1))
            loop = asyncio.get_running_loop()
            started = loop.time()
            while seq_id in runner.engine.sequences:
                assert loop.time() - started < generate_streams.MAX_HOLD_S / 2, "held back before it was read"
                await asyncio.sleep(0.01)
            assert out.qsize() == NEW_TOKENS + 1  # every token queued, then the end
            assert len(await take_all(out)) == NEW_TOKENS
        finally:
            await runner.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_a_stopped_streams_queue_ends(tiny_model):
    """GenerateStreams.stop: the tokens already queued, then None; the sequence released."""
    async def main():
        runner = await EngineRunner.start(lambda: Engine(engine_config(tiny_model)))
        try:
            seq_id, out = await runner.streams.start([1, 2, 3], alloc(3 + NEW_TOKENS + 1))
            await runner.streams.stop(seq_id)
            got = await asyncio.wait_for(take_all(out), 5)  # ends: no wait for tokens that cannot come
            assert 1 <= len(got) < NEW_TOKENS
            assert seq_id not in runner.engine.sequences and len(runner.streams) == 0
        finally:
            await runner.shutdown()

    asyncio.run(main())


@pytest.mark.timeout(60)
def test_polled_steps_give_the_same_tokens(tiny_model):
    """METRALE_STEP_WAIT=poll's path (forced on here: on CPU a step ends at launch, so it would be off): Decode
    steps and Generate streams through a runner whose loop polls the steps give the tokens of one that does not."""
    from engine.api import PrefillItem

    async def run(poll: bool) -> list:
        runner = await EngineRunner.start(lambda: Engine(engine_config(tiny_model)))
        runner._poll_steps = poll
        if poll:  # each step reads as still running for its first 3 queries (a CPU step has ended at launch)
            ready, polled = runner.engine.step_ready, [0]

            def slow_ready(step) -> bool:
                step.test_queries = getattr(step, "test_queries", 0) + 1
                polled[0] += step.test_queries <= 3
                return step.test_queries > 3 and ready(step)
            runner.engine.step_ready = slow_ready
        try:
            ids = [await runner.run(lambda e: e.alloc_sequence(40, SamplingParams(), StoppingCriteria(ignore_eos=True)).seq_id)
                   for _ in range(2)]
            await runner.call(lambda e: e.prefill([PrefillItem(i, [3 + i, 5, 7]) for i in ids]))
            steps = [runner.submit_step(lambda e: e.decode_launch(ids)) for _ in range(6)]
            tokens = [[t.token_id for t in (await s).tokens] for s in steps]
            _, out = await runner.streams.start([9, 8, 7], alloc(3 + NEW_TOKENS + 1))
            if poll:
                assert polled[0] >= 6 * 3  # the loop did poll (every Decode step was queried 4 times at least)
            return tokens + [await take_all(out)]
        finally:
            await runner.shutdown()

    assert asyncio.run(run(True)) == asyncio.run(run(False))


@pytest.mark.timeout(120)
def test_the_next_step_is_launched_before_a_finished_steps_tokens_go_out(tiny_model):
    """GenerateStreams keeps max_steps_in_flight steps launched: when one finishes, the next is launched before its
    tokens reach the stream's queue (the handlers' writes would otherwise run on the loop while the device drains
    the one step left). So before the k-th decoded token is queued, k + depth steps have been launched (the old
    order: k + depth - 1), while the sequence has steps left to launch."""
    async def main():
        runner = await EngineRunner.start(lambda: Engine(engine_config(tiny_model)))
        try:
            depth = runner.engine.config.max_steps_in_flight
            events: list[str] = []
            submit = runner.submit_step

            def recording_submit(*args, **kwargs):
                events.append("launch")
                return submit(*args, **kwargs)
            runner.submit_step = recording_submit
            # the decode loop starts only when start() returns: the queue is wrapped before any decoded token
            original_put = asyncio.Queue.put_nowait

            def put(queue, item):
                if item is not None and getattr(queue, "recorded", False):
                    events.append("token")
                return original_put(queue, item)
            asyncio.Queue.put_nowait = put
            try:
                seq_id, out = await runner.streams.start([1, 2, 3], alloc(3 + NEW_TOKENS + 1))
                out.recorded = True
                tokens = await take_all(out)
            finally:
                asyncio.Queue.put_nowait = original_put
            assert len(tokens) == NEW_TOKENS
            launches = [events[:i].count("launch") for i, e in enumerate(events) if e == "token"]
            steps = NEW_TOKENS - 1  # the first token came from the prefill
            assert events.count("launch") == steps and len(launches) == steps
            for k, before in enumerate(launches[:steps - depth - 1], start=1):  # (the last steps: fewer to launch)
                assert before >= k + depth, (k, launches)
        finally:
            await runner.shutdown()

    asyncio.run(main())
