"""The prefix cache: content-hashed KV blocks, reference counts, an LRU of evictable blocks, and a
reservation count (BlockPool). KV events go to engine/kv_events.py; one sequence's blocks are a
SequenceBlocks (engine/sequence_blocks.py), which follows the engine contract below.

Block hash recipe (version 1). A router computes the same values for a prompt with `block_hashes`
or by hand:

    tokens  = every token id of the block as 4 bytes, unsigned little-endian (ids in [0, 2**32))
    parent  = b"\\x00" for the first block of a sequence,
              b"\\x01" + the parent block's hash as 8 bytes, signed little-endian (two's complement)
    digest  = sha256(b"metrale-kv-block-v1\\x00" + len(extra) as 4 bytes unsigned little-endian
                     + extra + parent + tokens)
    hash    = the first 8 bytes of digest read as a signed big-endian integer (an int64)

`extra` names whatever else changes a block's contents for the same tokens: the worker's KV dtype
now, an adapter later (`extra_key`). Block i of a sequence holds tokens [i * block_size,
(i + 1) * block_size) and chains on block i - 1, so a hash stands for the whole prefix up to the
end of its block and only full blocks have one. int64 is the type of smg-grpc-proto's
KvBlock.block_hash and KvBlocksStored.parent_block_hash (common.proto), so events carry it as is.

The cache is keyed by these 64-bit values: two different prefixes that collide would share KV. For
N cached blocks one lookup collides with probability about N / 2**64 (1e6 blocks: 5e-14), and a
collision with a chosen victim prefix is a 64-bit second-preimage search.

Pool contract (the engine is the only caller; not thread-safe):
- Every usable block (1 .. num_blocks - 1; block 0 is the scratch block) is in exactly one state:
  free (not cached, not referenced), evictable (cached, reference count 0, in the LRU), or referenced
  (count >= 1, cached or not). free + evictable + referenced == num_usable_blocks.
- A referenced block is never handed out by allocate nor evicted.
- `reserved` counts blocks promised to sequences but not yet taken; free + evictable >= reserved
  always, so a reservation can always be taken later, evicting cached blocks if needed.
- Only registered (full, computed, hashed) blocks are ever shared, so a block written by a forward
  is referenced by its writer alone; the engine keeps that true by writing only positions at or
  past a sequence's computed length, which never lie in a registered block.

Engine contract (SequenceBlocks implements it; tests/unit/test_prefix_cache.py fuzzes it):
- AllocSequence reserves ceil(max_total_tokens / block_size) blocks and takes none.
- Prefill, while the sequence has computed nothing of its own (its first chunk): match the hashes of
  the full blocks of its known tokens, at most (known - 1) // block_size of them, so the last known
  token is always computed into a block of its own (an empty final chunk recomputes it there), and
  acquire them with reserved=True. Then take (allocate(reserved=True)) the blocks the chunk's tokens
  need, and when the prompt completes the rest of the reservation: decode and Verify never allocate.
- A forward writes only positions >= the sequence's computed length (num_cached). A block is
  registered once every position in it is final and its forward has completed on the device: below
  num_cached when the prompt is complete, below num_cached - 1 while it is not. So a shared or
  registered block is never written, and Verify's rejected positions (>= num_cached) lie in none.
- Release: release(block_ids) in sequence order, then unreserve what is left of the reservation.
- Not for models whose K/V at a position depend on more than the tokens up to it (dynamic NTK rope
  rescales by the current sequence length): caching must stay off for them.
"""
from __future__ import annotations

import array
import collections
import hashlib
import struct
import time
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from engine.errors import ConfigError, ResourceExhausted
from engine.kv_events import (KvBlock, KvBlocksStored, KvCacheCleared, KvCacheEvent, KvEventBatch, KvEventLog,
                              KvSnapshotChunk)
from engine.prefix_index import PrefixIndex

HASH_DOMAIN = b"metrale-kv-block-v1\x00"


def extra_key(**parts: str) -> bytes:
    """The `extra` bytes for a worker: "name=value" pairs sorted by name, joined by ";", UTF-8, e.g.
    extra_key(kv_dtype="bfloat16") == b"kv_dtype=bfloat16". No parts: b""."""
    return ";".join(f"{k}={v}" for k, v in sorted(parts.items())).encode()


def _pack_tokens(token_ids: Sequence[int]) -> bytes:
    try:
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    except struct.error as exc:
        raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None


def hash_block(parent_hash: int | None, token_ids: Sequence[int], extra: bytes = b"") -> int:
    """The hash of one block (recipe in the module docstring); parent_hash None: the first block."""
    h = hashlib.sha256(HASH_DOMAIN)
    h.update(struct.pack("<I", len(extra)))
    h.update(extra)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        try:
            h.update(b"\x01" + struct.pack("<q", parent_hash))
        except struct.error:
            raise ValueError(f"a parent hash is an int64, got {parent_hash}") from None
    h.update(_pack_tokens(token_ids))
    return int.from_bytes(h.digest()[:8], "big", signed=True)


def block_hashes(token_ids: Sequence[int], block_size: int, extra: bytes = b"",
                 parent_hash: int | None = None) -> list[int]:
    """The hashes of the full blocks of token_ids (a trailing partial block has none). parent_hash:
    the hash of the block before token_ids[0], to continue a chain (token_ids must then start on a
    block boundary of the sequence). The same values as hash_block block by block: the tokens are packed
    once (numpy) and each block costs one sha256 over prebuilt bytes (a 4096-token prompt is on the path of
    its first token)."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    num_blocks = len(token_ids) // block_size
    if not num_blocks:
        return []
    if num_blocks <= 2:  # a decode step's filled block: struct packs it faster than numpy's per-call costs
        packed = _pack_tokens(token_ids[:num_blocks * block_size])
    else:
        ids = np.asarray(token_ids[:num_blocks * block_size], dtype=np.int64)
        if ids.min() < 0 or ids.max() >= 1 << 32:
            raise ValueError("token ids must be integers in [0, 2**32)")
        packed = ids.astype("<u4").tobytes()
    head, step, out = _hash_head(extra), 4 * block_size, []
    for start in range(0, len(packed), step):
        parent_hash = _child_hash(head, parent_hash, packed[start:start + step])
        out.append(parent_hash)
    return out


def child_hashes(rows: np.ndarray, parents: Sequence[int | None], extra: bytes = b"") -> list[int]:
    """The hash of each block rows[i] (uint32 [n, block_size]) as the child of parents[i] (None: a first block):
    hash_block's values, one sha256 a block over one packing of every row (a decode step's filled blocks across
    sequences)."""
    packed = rows.astype("<u4", copy=False).tobytes()
    head, step = _hash_head(extra), 4 * rows.shape[1] if rows.ndim == 2 else 0
    return [_child_hash(head, parent, packed[i * step:(i + 1) * step]) for i, parent in enumerate(parents)]


_INT64 = struct.Struct("<q")


def _hash_head(extra: bytes):
    """sha256 over the recipe's part every block of a given extra key shares (copied per block)."""
    return hashlib.sha256(HASH_DOMAIN + struct.pack("<I", len(extra)) + extra)


def _child_hash(head, parent_hash: int | None, packed_tokens: bytes) -> int:
    """hash_block's value from _hash_head's state: the parent marker, the packed little-endian uint32 tokens."""
    h = head.copy()
    h.update(b"\x00" if parent_hash is None else b"\x01" + _INT64.pack(parent_hash))
    h.update(packed_tokens)
    return int.from_bytes(h.digest()[:8], "big", signed=True)


@dataclass
class CacheStats:
    """Counters since start. Queries and hits are counted per prompt by record_query."""
    queries: int = 0          # prompts looked up
    query_tokens: int = 0     # their tokens
    hit_tokens: int = 0       # of those, tokens whose KV came from the cache
    query_blocks: int = 0     # full blocks of those prompts
    hit_blocks: int = 0       # blocks taken from the cache
    stored_blocks: int = 0    # registrations (one stored event each)
    duplicate_blocks: int = 0  # registrations of a hash already cached under another block (refused)
    evicted_blocks: int = 0   # cached blocks dropped to make room for an allocation
    flushed_blocks: int = 0   # cached blocks dropped by flush

    @property
    def hit_rate(self) -> float:
        """Share of queried prompt tokens served from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


@dataclass(slots=True)
class _Cached:
    block_id: int
    parent_hash: int | None
    token_ids: array.array  # 'I': compact; a cached block may outlive its sequence for long


class BlockPool:
    """KV block ids with reference counts, a content-hash index of full blocks, and an LRU of cached
    blocks nobody references. A superset of the old BlockAllocator (can_allocate / allocate / free /
    num_free_blocks / num_usable_blocks / num_used_blocks keep their meaning, with evictable blocks
    counted as free)."""

    def __init__(self, num_blocks: int, block_size: int, events: KvEventLog | None = None):
        if num_blocks < 2:
            raise ConfigError(f"the KV cache needs at least 2 blocks (block 0 is scratch), got {num_blocks}; "
                              f"raise --num-kv-blocks or --kv-cache-memory")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.events = events if events is not None else KvEventLog()
        self.stats = CacheStats()
        self._free = list(range(num_blocks - 1, 0, -1))  # neither cached nor referenced; pop() gives low ids first
        self._refs = [0] * num_blocks
        self._lru: collections.OrderedDict[int, None] = collections.OrderedDict()  # evictable, least recent first
        self._cached: dict[int, _Cached] = {}  # hash -> its block, in registration order
        self._hash_of: dict[int, int] = {}     # block id -> hash, for cached blocks
        self._reserved = 0
        self.index = PrefixIndex(num_blocks, block_size)  # finds a prompt's cached blocks without sha256

    # Counts --------------------------------------------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks a new reservation or allocation can take: free ones and evictable cached ones, less
        those already reserved."""
        return len(self._free) + len(self._lru) - self._reserved

    @property
    def num_used_blocks(self) -> int:
        """Blocks referenced by sequences or reserved for them."""
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash, referenced or not."""
        return len(self._cached)

    @property
    def num_evictable_blocks(self) -> int:
        return len(self._lru)

    @property
    def num_referenced_blocks(self) -> int:
        return self.num_usable_blocks - len(self._free) - len(self._lru)

    @property
    def num_reserved_blocks(self) -> int:
        return self._reserved

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def block_hash(self, block_id: int) -> int | None:
        """The hash a block is cached under, or None."""
        return self._hash_of.get(block_id)

    # Reservations and allocation -------------------------------------------------------------------

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free_blocks

    def reserve(self, n: int) -> None:
        """Promises n blocks to a caller that takes them later (allocate or acquire with
        reserved=True) or gives them back (unreserve). Takes no block yet, so cached blocks stay
        matchable until their memory is really needed."""
        if not self.can_allocate(n):
            raise self._exhausted(n)
        self._reserved += n

    def unreserve(self, n: int) -> None:
        if not 0 <= n <= self._reserved:
            raise ValueError(f"unreserve({n}) with {self._reserved} blocks reserved")
        self._reserved -= n

    def allocate(self, n: int, reserved: bool = False) -> list[int]:
        """n blocks, each referenced once by the caller: free blocks first, then the least recently
        used cached ones (evicted: a removed event each). reserved: take them out of an earlier
        reserve()."""
        self._take(n, reserved, n)
        free, refs = self._free, self._refs
        start = len(free) - min(n, len(free))
        out = free[start:]
        del free[start:]
        out.reverse()  # the order pop() takes them in
        for _ in range(n - len(out)):
            block, _ = self._lru.popitem(last=False)
            self._uncache(block)
            self.stats.evicted_blocks += 1
            out.append(block)
        for block in out:
            refs[block] = 1
        return out

    def _take(self, n: int, reserved: bool, need: int) -> None:
        """Checks and books n blocks out of a reservation, or `need` of the unreserved free ones."""
        if n < 0:
            raise ValueError(f"cannot take {n} blocks")
        if reserved:
            if n > self._reserved:
                raise ValueError(f"taking {n} reserved blocks, {self._reserved} reserved")
            self._reserved -= n
        elif need > self.num_free_blocks:
            raise self._exhausted(need)

    def _exhausted(self, n: int) -> ResourceExhausted:
        return ResourceExhausted(f"need {n} KV blocks, {self.num_free_blocks} of {self.num_usable_blocks} free "
                                 f"(release live sequences, or start the worker with a larger --kv-cache-memory "
                                 f"or --num-kv-blocks)")

    # Sharing -------------------------------------------------------------------------------------

    def match(self, hashes: Iterable[int]) -> list[int]:
        """The blocks of the longest cached prefix of `hashes` (a chain, first block first). Takes no
        reference: acquire them before anything else allocates."""
        out = []
        for h in hashes:
            cached = self._cached.get(h)
            if cached is None:
                break
            out.append(cached.block_id)
        return out

    def match_prefix(self, ids: np.ndarray, keys: list[int], extra: bytes = b"") -> tuple[list[int], list[int]]:
        """match() of a sequence's first full blocks without their hashes (ids: prefix_index.blocks_of, keys: their
        index fingerprints): the blocks of the longest cached prefix and their hashes (engine/prefix_index.py).
        Finds the blocks registered with a key; takes no reference."""
        return self.index.match(ids, keys, extra)

    def acquire(self, block_ids: list[int], reserved: bool = False) -> None:
        """One more reference on each of block_ids, which must be cached (match's result); an
        evictable one leaves the LRU. reserved: each block stands for one reserved block, which the
        caller no longer needs fresh (a shared block gives that reservation back to the pool)."""
        distinct = set(block_ids)  # (set operations: a 4k-token prefix's 248 blocks are checked at C speed)
        if len(distinct) != len(block_ids):
            raise ValueError(f"acquire: duplicate block ids in {block_ids}")
        if not distinct <= self._hash_of.keys():
            raise ValueError(f"acquire: blocks {sorted(distinct - self._hash_of.keys())} are not cached")
        refs, lru = self._refs, self._lru
        # An unreserved take books the evictable blocks it makes referenced (a reserved one was booked by reserve()),
        # counted before anything changes.
        self._take(len(block_ids), reserved, 0 if reserved else sum(refs[b] == 0 for b in block_ids))
        for b in block_ids:
            if refs[b] == 0:  # evictable (cached, unreferenced): leaves the LRU
                del lru[b]
            refs[b] += 1

    def release(self, block_ids: list[int]) -> None:
        """One reference fewer on each block. A block left unreferenced becomes evictable if cached
        (block_ids in sequence order: the tail becomes the least recent, so a prefix outlives its
        extensions) and free otherwise."""
        for b in block_ids:
            if not 0 < b < self.num_blocks or self._refs[b] == 0:
                raise ValueError(f"release: block {b} is not referenced")
        if len(set(block_ids)) != len(block_ids):
            raise ValueError(f"release: duplicate block ids in {block_ids}")
        for b in reversed(block_ids):
            self._refs[b] -= 1
            if self._refs[b] == 0:
                if b in self._hash_of:
                    self._lru[b] = None
                else:
                    self._free.append(b)

    free = release  # the BlockAllocator name

    def register(self, block_id: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
                 key: int | None = None, extra: bytes = b"") -> int:
        """Caches a full block its caller references and has written (call only once the forward
        that wrote it has completed) under block_hash, and logs a stored event. Returns the block
        cached under that hash: block_id, or another block that already held it, in which case
        block_id stays uncached (the caller may switch to the returned block and release its own).
        key: the block's index fingerprint (PrefixIndex.keys, with the extra bytes its hash was made
        with), which makes match_prefix find it; None: found by match() alone."""
        return self.register_run([block_id], [block_hash], parent_hash, [token_ids],
                                 None if key is None else [key], extra)[0]

    def register_run(self, block_ids: Sequence[int], hashes: Sequence[int], parent_hash: int | None,
                     token_rows, keys: Sequence[int] | None = None, extra: bytes = b"") -> list[int]:
        """register for consecutive full blocks of one sequence: block_ids[i] holds token_rows[i] (uint32
        [n, block_size], or n sequences of block_size ids) under hashes[i], whose parent is hashes[i - 1] (the
        first's: parent_hash); keys: their fingerprints, or None. See register_blocks."""
        return self.register_blocks(block_ids, hashes, [parent_hash, *hashes[:-1]], token_rows, keys, extra)

    def register_blocks(self, block_ids: Sequence[int], hashes: Sequence[int], parents: Sequence[int | None],
                        token_rows, keys: Sequence[int] | None = None, extra: bytes = b"") -> list[int]:
        """register for several full blocks, each under hashes[i] with the parent hash parents[i] (a run of one
        sequence, or the blocks one decode step filled across sequences), in order: every block is checked before
        any is cached (ValueError: nothing changed). The index gets the new blocks in one write, the event log
        one stored event per stretch of new blocks each the child of the one before (a block found cached under
        another block ends a stretch), as register block by block would log them. Returns, per block, the block
        cached under its hash."""
        rows = np.asarray(token_rows, dtype=np.uint32)
        n = len(block_ids)
        if rows.ndim != 2 or rows.shape[1] != self.block_size:
            got = rows.shape[-1] if rows.ndim else 0
            raise ValueError(f"register: a block holds {self.block_size} tokens, got {got}")
        if rows.shape[0] != n or len(hashes) != n or len(parents) != n or (keys is not None and len(keys) != n):
            raise ValueError(f"register: {n} blocks need as many hashes, parents, token rows and keys")
        refs, hash_of = self._refs, self._hash_of
        for b, h in zip(block_ids, hashes):
            if not 0 < b < self.num_blocks or refs[b] == 0:
                raise ValueError(f"register: block {b} is not referenced")
            if hash_of.get(b, h) != h:
                raise ValueError(f"register: block {b} is already cached under {hash_of[b]}")
        if len(set(block_ids)) != n:
            raise ValueError(f"register: duplicate block ids in {list(block_ids)}")
        token_lists = rows.tolist()
        out, new = [], []  # new: positions of the blocks cached here
        stretch: list[KvBlock] = []
        stretch_parent = None
        for i, (b, h) in enumerate(zip(block_ids, hashes)):
            cached = self._cached.get(h)
            if cached is not None:
                if cached.block_id != b:
                    self.stats.duplicate_blocks += 1
                out.append(cached.block_id)
                if stretch:
                    self.events.stored_run(stretch_parent, stretch)
                    stretch = []
                continue
            parent = parents[i]
            if stretch and parent != stretch[-1].block_hash:
                self.events.stored_run(stretch_parent, stretch)
                stretch = []
            if not stretch:
                stretch_parent = parent
            tokens = token_lists[i]
            self._cached[h] = _Cached(b, parent, array.array("I", tokens))
            hash_of[b] = h
            stretch.append(KvBlock(h, tuple(tokens), self.block_size))
            new.append(i)
            out.append(b)
        if stretch:
            self.events.stored_run(stretch_parent, stretch)
        self.stats.stored_blocks += len(new)
        if keys is not None and new:
            self.index.add_run([block_ids[i] for i in new], [keys[i] for i in new], [hashes[i] for i in new],
                               [parents[i] for i in new], rows if len(new) == n else rows[new], extra)
        return out

    def _uncache(self, block_id: int) -> None:
        block_hash = self._hash_of.pop(block_id)
        del self._cached[block_hash]
        self.index.remove(block_id)
        self.events.removed(block_hash)

    def flush(self) -> int:
        """Drops every unreferenced cached block (referenced ones stay cached). Logs one cleared event
        when nothing stays cached, removed events otherwise. Returns how many were dropped."""
        dropped = list(self._lru)
        self._lru.clear()
        keep_events = len(self._cached) > len(dropped)
        for b in dropped:
            block_hash = self._hash_of.pop(b)
            del self._cached[block_hash]
            self.index.remove(b)
            if keep_events:
                self.events.removed(block_hash)
        self._free.extend(reversed(dropped))
        if not keep_events:
            self.events.cleared()
        self.stats.flushed_blocks += len(dropped)
        return len(dropped)

    def record_query(self, num_tokens: int, num_cached_tokens: int) -> None:
        """Counts one prompt of num_tokens tokens, num_cached_tokens of which came from the cache
        (once per prompt, when it completes)."""
        if not 0 <= num_cached_tokens <= num_tokens:
            raise ValueError(f"record_query: {num_cached_tokens} cached of {num_tokens} tokens")
        s = self.stats
        s.queries += 1
        s.query_tokens += num_tokens
        s.hit_tokens += num_cached_tokens
        s.query_blocks += num_tokens // self.block_size
        s.hit_blocks += num_cached_tokens // self.block_size

    def snapshot(self) -> KvEventBatch:
        """Every cached block as one batch for a subscriber that starts from the current state:
        publishes what is pending first, then returns (not logged) a batch numbered with the log's
        last sequence number holding a cleared event and one stored event per cached block, parents
        before children (event_id 0, as smg's KvSnapshotChunk asks). Live batches continue at the
        next number with no gap and no duplicate. Number 0: nothing was ever logged, the cache is
        empty and the batch need not be sent (0 is the proto's number for load-only batches)."""
        self.events.publish()
        events = [KvCacheEvent(0, KvCacheCleared())]
        done: set[int] = set()
        for h in self._cached:
            chain = []
            while h is not None and h in self._cached and h not in done:
                done.add(h)
                chain.append(h)
                h = self._cached[h].parent_hash
            for c in reversed(chain):
                cached = self._cached[c]
                block = KvBlock(c, tuple(cached.token_ids), self.block_size)
                events.append(KvCacheEvent(0, KvBlocksStored((block,), cached.parent_hash)))
        return KvEventBatch(self.events.last_sequence_number, time.time(), tuple(events),
                            KvSnapshotChunk(index=0, count=1, blocks=len(self._cached)))
