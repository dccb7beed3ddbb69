"""asyncio helpers the services share."""
from __future__ import annotations

import asyncio
import contextlib
from typing import AsyncIterator, TypeVar

T = TypeVar("T")


async def until_set(stream: AsyncIterator[T], stop: asyncio.Event) -> AsyncIterator[T]:
    """stream's items until `stop` is set; then (or when the caller stops reading) stream is closed."""
    stopped = asyncio.ensure_future(stop.wait())
    item = None
    try:
        while True:
            item = asyncio.ensure_future(anext(stream))
            await asyncio.wait((item, stopped), return_when=asyncio.FIRST_COMPLETED)
            if not item.done():
                return
            try:
                value = item.result()
            except StopAsyncIteration:
                return
            item = None
            yield value
    finally:
        stopped.cancel()
        if item is not None and not item.done():
            item.cancel()  # the stream cannot be closed while a read of it runs
            with contextlib.suppress(asyncio.CancelledError):
                await item
        await stream.aclose()
