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
