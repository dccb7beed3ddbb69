"""The gateway's Generate streams: a handler that fell behind the steps sends the tokens already queued in one chunk."""
from __future__ import annotations

import asyncio


def test_a_lagging_gateway_stream_sends_what_is_queued_in_one_chunk():
    """worker.gateway_stream._with_queued: the items already waiting behind the one received, up to an ending one."""
    from worker.gateway_stream import ABORTED, _with_queued
    from worker.gateway_requests import Choice

    async def main():
        choice = Choice(index=0)
        choice.out = asyncio.Queue()
        for item in ("t2", "t3", None, "after the end"):
            choice.out.put_nowait(item)
        assert _with_queued(choice, "t1") == ["t1", "t2", "t3", None]  # stops at the end marker
        assert _with_queued(choice, "x") == ["x", "after the end"]
        assert _with_queued(choice, "y") == ["y"]  # nothing waiting: one token, one chunk
        assert _with_queued(choice, ABORTED) == [ABORTED]

    asyncio.run(main())


def _chunks(choices, interval, feed):
    """The (choice index, items) _choice_items yields while `feed` puts items on the queues, one await apart."""
    from worker.gateway_stream import _choice_items

    async def main():
        got = []

        async def producer():
            for index, item in feed:
                await asyncio.sleep(0)
                choices[index].out.put_nowait(item)

        task = asyncio.ensure_future(producer())
        async for choice, items in _choice_items(choices, interval):
            got.append((choice.index, list(items)))
        await task
        return got

    return asyncio.run(main())


def _choices(n):
    from worker.gateway_requests import Choice

    out = []
    for i in range(n):
        c = Choice(index=i)
        c.out = asyncio.Queue()
        out.append(c)
    return out


def _check_chunks(got, feed, interval):
    """Per choice: its items in the order fed, its last chunk the one with its end, and every chunk between its
    first and last at least `interval` tokens (more where they were waiting together)."""
    from worker.gateway_stream import _ended
    for index in {i for i, _ in feed}:
        chunks = [items for i, items in got if i == index]
        assert [x for c in chunks for x in c] == [x for i, x in feed if i == index]
        assert _ended(chunks[-1][-1]) and not any(_ended(x) for c in chunks[:-1] for x in c)
        assert all(len(c) >= interval for c in chunks[1:-1]), chunks
        if len(chunks) > 1:
            assert len(chunks[-1]) <= interval  # the remainder, with the end


def test_stream_interval_sends_the_first_token_at_once_then_chunks_of_interval():
    feed = [(0, f"t{i}") for i in range(1, 9)] + [(0, None)]
    got = _chunks(_choices(1), 3, feed)
    _check_chunks(got, feed, 3)
    assert got[0] == (0, ["t1"]) and len(got) <= 4
    _check_chunks(_chunks(_choices(1), 1, feed), feed, 1)


def test_stream_interval_keeps_each_choice_apart():
    from worker.gateway_stream import ABORTED
    feed = [(0, "a1"), (1, "b1"), (0, "a2"), (1, "b2"), (0, "a3"), (1, "b3"), (1, ABORTED), (0, "a4"), (0, "a5"),
            (0, "a6"), (0, None)]
    got = _chunks(_choices(2), 2, feed)
    _check_chunks(got, feed, 2)
    assert len([1 for i, _ in got if i == 0]) < 6 and len([1 for i, _ in got if i == 1]) < 4
