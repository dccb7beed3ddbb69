"""KV-cache events for routers: a bounded log of numbered batches of "stored", "removed" and
"cleared" events, and a way to follow it from asyncio.

The types mirror smg-grpc-proto's common.proto (KvEventBatch, KvCacheEvent with its `data` oneof
of KvBlocksStored / KvBlocksRemoved / KvCacheCleared, KvBlock, KvSnapshotChunk): same field names,
same meaning, so the RPC layer copies them field for field and a gateway relays them unchanged.
- A stored event lists blocks that chain: blocks[0]'s parent is parent_block_hash (None: the first
  block of a sequence), blocks[i]'s parent is blocks[i - 1]. Each block carries its token ids and the
  block size. One hash is cached at most once, so every stored hash has exactly one removal (or a
  cleared) later, and replaying every batch in order gives the set of cached hashes.
- Batch numbers start at 1 and have no gaps (0 is what a subscriber sends for "the current state";
  the proto also uses 0 for load-only batches). Event ids start at 1 and increase by one per event
  across batches; synthesized snapshot events carry 0.

Writers and readers: the pool (the engine's owner) adds events to a pending batch and the engine
calls publish() once per call it serves, so one batch holds one step's changes. Readers on any
thread call read(start); the log keeps the last `max_batches` batches (and at most about
`max_blocks` blocks and removed hashes among them), so a subscriber that never reads makes nothing
grow: it falls behind, and its next read raises OutOfRange. Waiting: listen(callback) runs callback
(new last number) on the publishing thread after each publish; follow() turns that into an async
iterator on any event loop, whichever thread the engine publishes from.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Union

from engine.errors import OutOfRange

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvBlock:
    block_hash: int                # int64 (engine/prefix_cache.py: the recipe)
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class KvBlocksStored:
    blocks: tuple[KvBlock, ...]
    parent_block_hash: int | None = None  # the parent of blocks[0]; None: a sequence's first block


@dataclass(frozen=True)
class KvBlocksRemoved:
    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class KvCacheCleared:
    """Every cached block is gone."""


@dataclass(frozen=True)
class KvCacheEvent:
    event_id: int
    data: Union[KvBlocksStored, KvBlocksRemoved, KvCacheCleared]

    @property
    def kind(self) -> str:
        """The name of the proto's `data` oneof field that is set: "stored", "removed" or "cleared"."""
        return _KIND[type(self.data)]


_KIND = {KvBlocksStored: "stored", KvBlocksRemoved: "removed", KvCacheCleared: "cleared"}


@dataclass(frozen=True)
class KvSnapshotChunk:
    """Marks a batch that restates the cache (a snapshot) instead of reporting changes."""
    index: int
    count: int
    blocks: int
    unknown_before: int = 0


@dataclass(frozen=True)
class KvEventBatch:
    sequence_number: int
    timestamp: float  # seconds since the epoch, at publish
    events: tuple[KvCacheEvent, ...]
    snapshot: KvSnapshotChunk | None = None

    @property
    def num_items(self) -> int:
        """Stored blocks plus removed hashes: what the log's size bound counts."""
        n = 0
        for e in self.events:
            d = e.data
            n += len(d.blocks) if isinstance(d, KvBlocksStored) else len(d.block_hashes) \
                if isinstance(d, KvBlocksRemoved) else 1
        return n


class KvEventLog:
    def __init__(self, max_batches: int = 4096, max_blocks: int = 1 << 18):
        if max_batches < 1 or max_blocks < 1:
            raise ValueError(f"max_batches and max_blocks must be >= 1, got {max_batches}, {max_blocks}")
        self.max_batches = max_batches
        self.max_blocks = max_blocks
        self._pending: list[list] = []  # ["stored", parent, [KvBlock]] | ["removed", [hash]] | ["cleared"]
        self._ring: collections.deque[KvEventBatch] = collections.deque()
        self._ring_items = 0
        self._next_number = 1
        self._next_event_id = 1
        self._lock = threading.Lock()  # guards the ring, the numbers and the listeners (not _pending)
        self._listeners: list[Callable[[int], None]] = []

    # Writer side (the engine's owner) ---------------------------------------------------------------

    def stored(self, block_hash: int, parent_hash: int | None, token_ids: tuple[int, ...], block_size: int) -> None:
        block = KvBlock(block_hash, token_ids, block_size)
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == "stored" and last[2][-1].block_hash == parent_hash \
                and last[2][-1].block_size == block_size:
            last[2].append(block)  # continues the chain of the last event
        else:
            self._pending.append(["stored", parent_hash, [block]])

    def stored_run(self, parent_hash: int | None, blocks: list[KvBlock]) -> None:
        """stored for a chain of blocks, each the child of the one before (the first: of parent_hash): one
        event, or the last event continued, as storing them one by one would."""
        last = self._pending[-1] if self._pending else None
        if last is not None and last[0] == "stored" and last[2][-1].block_hash == parent_hash \
                and last[2][-1].block_size == blocks[0].block_size:
            last[2].extend(blocks)
        else:
            self._pending.append(["stored", parent_hash, list(blocks)])

    def removed(self, block_hash: int) -> None:
        if self._pending and self._pending[-1][0] == "removed":
            self._pending[-1][1].append(block_hash)
        else:
            self._pending.append(["removed", [block_hash]])

    def cleared(self) -> None:
        self._pending.append(["cleared"])

    @property
    def num_pending_events(self) -> int:
        return len(self._pending)

    def publish(self) -> int | None:
        """Closes the pending events into the next numbered batch; returns its number (None when
        nothing was pending) after telling the listeners."""
        if not self._pending:
            return None
        pending, self._pending = self._pending, []
        with self._lock:
            events = []
            for p in pending:
                if p[0] == "stored":
                    data = KvBlocksStored(tuple(p[2]), p[1])
                elif p[0] == "removed":
                    data = KvBlocksRemoved(tuple(p[1]))
                else:
                    data = KvCacheCleared()
                events.append(KvCacheEvent(self._next_event_id, data))
                self._next_event_id += 1
            batch = KvEventBatch(self._next_number, time.time(), tuple(events))
            self._next_number += 1
            self._ring.append(batch)
            self._ring_items += batch.num_items
            while len(self._ring) > 1 and (len(self._ring) > self.max_batches or self._ring_items > self.max_blocks):
                self._ring_items -= self._ring.popleft().num_items
            listeners = list(self._listeners)
        for callback in listeners:
            try:
                callback(batch.sequence_number)
            except Exception:  # a broken subscriber must not break the engine's step
                log.exception("KV event listener failed")
        return batch.sequence_number

    # Reader side (any thread) ---------------------------------------------------------------------

    @property
    def last_sequence_number(self) -> int:
        """The number of the last published batch; 0 before the first."""
        with self._lock:
            return self._next_number - 1

    @property
    def first_sequence_number(self) -> int:
        """The oldest batch still kept (last + 1 when none is)."""
        with self._lock:
            return self._ring[0].sequence_number if self._ring else self._next_number

    def read(self, start: int, max_batches: int | None = None) -> list[KvEventBatch]:
        """The kept batches numbered start and on (at most max_batches); [] when start is the next
        number. OutOfRange when batch `start` is no longer kept (the subscriber fell behind) or
        lies beyond the next number (a cursor from another process)."""
        if start < 1:
            raise ValueError(f"KV event batches are numbered from 1, got {start}: start from a snapshot instead")
        with self._lock:
            first = self._ring[0].sequence_number if self._ring else self._next_number
            if start < first:
                raise OutOfRange(f"KV event batch {start} is no longer kept (the oldest kept is {first}); "
                                 "subscribe again from 0 and rebuild")
            if start > self._next_number:
                raise OutOfRange(f"KV event batch {start} is ahead of the last one ({self._next_number - 1}); "
                                 "a cursor from another worker process? subscribe again from 0")
            stop = None if max_batches is None else start - first + max_batches
            return list(itertools.islice(self._ring, start - first, stop))

    def listen(self, callback: Callable[[int], None]) -> Callable[[], None]:
        """Calls callback(last sequence number) after every publish, on the publishing thread, outside
        the log's lock; it must be quick and must not call back into the engine. Returns the function
        that stops it."""
        with self._lock:
            self._listeners.append(callback)

        def remove() -> None:
            with self._lock:
                if callback in self._listeners:
                    self._listeners.remove(callback)
        return remove


async def follow(events: KvEventLog, start: int, max_batches: int = 64) -> AsyncIterator[KvEventBatch]:
    """Every batch from number `start` (>= 1) on, as it is published, on the running event loop (the
    engine may publish from this loop or from another thread). Raises OutOfRange as read() does, at
    once or later when this reader falls behind the log. Never returns by itself: close or cancel it.
    A subscriber asking for 0 ("the current state") is sent BlockPool.snapshot() first (taken on the
    engine's owner) and follows from its sequence_number + 1."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def on_publish(_number: int) -> None:
        try:
            loop.call_soon_threadsafe(wake.set)
        except RuntimeError:  # the loop is closed: the reader is gone
            pass

    stop_listening = events.listen(on_publish)
    try:
        cursor = start
        while True:
            wake.clear()  # before the read: a publish after it sets the event again, so none is missed
            batches = events.read(cursor, max_batches)
            if not batches:
                await wake.wait()
                continue
            for batch in batches:
                yield batch
                cursor = batch.sequence_number + 1
    finally:
        stop_listening()
