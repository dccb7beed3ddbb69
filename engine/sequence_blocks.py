"""SequenceBlocks: one sequence's KV blocks in a BlockPool (engine/prefix_cache.py): its reservation,
the cached blocks it shares, the blocks it owns, and the hashes of its full blocks.

block_ids[i] holds positions [i * block_size, (i + 1) * block_size). The first num_shared blocks
came from the cache and are only read; every later block is the sequence's own until it is
registered. The life of a sequence (the engine contract of engine/prefix_cache.py):

    blocks = SequenceBlocks(pool, ceil(max_total_tokens / block_size), extra)   # AllocSequence
    num_cached = blocks.match(prompt_so_far)        # first Prefill chunk only: shared prefix tokens
    new = blocks.grow(len(prompt_so_far))            # or blocks.grow_all() once the prompt is complete
    ... block-table row entries [len(block_ids) - len(new):] = new; the forward writes positions
        >= num_cached ...
    blocks.register(token_ids, num_final)            # after the forward completed
    blocks.release()                                 # Release
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from engine.prefix_cache import BlockPool, block_hashes, child_hashes
from engine.prefix_index import blocks_of


class SequenceBlocks:
    def __init__(self, pool: BlockPool, num_blocks: int, extra: bytes = b"", caching: bool = True):
        """Reserves num_blocks blocks (ResourceExhausted when the pool cannot promise them) and takes
        none yet. caching False: never matches nor registers (a plain allocator)."""
        pool.reserve(num_blocks)
        self.pool = pool
        self.extra = extra
        self.caching = caching
        self.block_ids: list[int] = []
        self.num_reserved = num_blocks  # blocks promised, not taken yet
        self.hashes: list[int] = []     # of the leading full blocks whose tokens have been hashed
        self.keys: list[int] = []       # their prefix-index fingerprints, of as many full blocks or more
        self.num_shared = 0             # leading blocks taken from the cache
        self.num_registered = 0         # leading blocks registered, shared, or found cached elsewhere
        self.num_duplicates = 0         # own blocks whose hash was cached under another block

    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_capacity_blocks(self) -> int:
        return len(self.block_ids) + self.num_reserved

    def match(self, token_ids: Sequence[int] | np.ndarray) -> int:
        """Shares the cached blocks that begin token_ids (the prompt tokens known so far; a uint32 array is
        taken as it is) and returns how many tokens they hold: the sequence's computed length from now on.
        Matches only before the sequence took any block (its first Prefill chunk), and at most
        (len(token_ids) - 1) // block_size blocks, so that the last known token is computed into a block of the
        sequence's own (an empty final chunk recomputes it there)."""
        if not self.caching or self.block_ids or not len(token_ids):
            return 0
        bs = self.block_size
        ids = blocks_of(token_ids[:(len(token_ids) - 1) // bs * bs], bs)
        self.keys = self.pool.index.keys(ids, 0, None, self.extra)
        shared, self.hashes = self.pool.match_prefix(ids, self.keys, self.extra)
        self.pool.acquire(shared, reserved=True)  # each stands for a reserved block: the pool gets it back
        self.num_reserved -= len(shared)
        self.block_ids += shared
        self.num_shared = self.num_registered = len(shared)
        return len(shared) * bs

    def grow(self, num_tokens: int) -> list[int]:
        """Takes blocks from the reservation until every position < num_tokens has one; returns the new
        block ids (to be written into the sequence's block-table row after the old ones)."""
        need = -(-num_tokens // self.block_size) - len(self.block_ids)
        if need > self.num_reserved:
            raise ValueError(f"{num_tokens} tokens need {need} more blocks; {self.num_reserved} are reserved")
        return self._take(max(need, 0))

    def grow_all(self) -> list[int]:
        """Takes the rest of the reservation (when the prompt completes: decode and Verify never
        allocate); returns the new block ids."""
        return self._take(self.num_reserved)

    def _take(self, n: int) -> list[int]:
        new = self.pool.allocate(n, reserved=True)
        self.num_reserved -= n
        self.block_ids += new
        return new

    def register(self, token_ids: Sequence[int], num_final: int) -> int:
        """Registers the blocks wholly below position num_final: every position there holds its final
        K/V, and the forwards that wrote them have completed. num_final is the computed length once
        the prompt is complete, and one less while it is not (an empty final chunk recomputes the
        last prompt token). Positions at or past it may still be written (Verify's rejected drafts).
        A block whose hash is cached under another block stays the sequence's own, uncached copy.
        Returns how many blocks were newly registered."""
        if not self.caching:
            return 0
        bs = self.block_size
        full = min(max(num_final, 0) // bs, len(self.block_ids))
        if full <= self.num_registered:
            return 0
        if len(self.hashes) < full:
            start = len(self.hashes) * bs
            self.hashes += block_hashes(token_ids[start:full * bs], bs, self.extra,
                                        self.hashes[-1] if self.hashes else None)
        first = min(self.num_registered, len(self.keys))
        rows = blocks_of(token_ids[first * bs:full * bs], bs)  # blocks first .. full - 1
        if len(self.keys) < full:
            self.keys += self.pool.index.keys(rows[len(self.keys) - first:], len(self.keys),
                                              self.keys[-1] if self.keys else None, self.extra)
        start = self.num_registered
        ids = self.block_ids[start:full]
        cached = self.pool.register_run(ids, self.hashes[start:full], self.hashes[start - 1] if start else None,
                                        rows[start - first:], self.keys[start:full], self.extra)
        stored = sum(c == b for c, b in zip(cached, ids))
        self.num_duplicates += len(ids) - stored
        self.num_registered = full
        return stored

    @staticmethod
    def register_filled(items: Sequence[tuple[SequenceBlocks, Sequence[int], int]]) -> int:
        """register(token_ids, num_final) for each (blocks, token_ids, num_final) of items, in order, as a decode
        step does for the blocks its tokens filled: the same hashes, fingerprints, cache entries and events in the
        same order, with each stretch of consecutive sequences that register exactly one block (their hashes and
        keys known up to it, one pool and extra key) hashed from one packing, fingerprinted in one numpy pass and
        cached in one pool call. Returns how many blocks were newly registered."""
        stored, batch = 0, []
        for blocks, token_ids, num_final in items:
            if not blocks.caching:
                continue
            full = min(max(num_final, 0) // blocks.block_size, len(blocks.block_ids))
            if full <= blocks.num_registered:
                continue
            one = full == blocks.num_registered + 1 and len(blocks.hashes) == full - 1 <= len(blocks.keys)
            if batch and not (one and blocks.pool is batch[0][0].pool and blocks.extra == batch[0][0].extra):
                stored += SequenceBlocks._register_next(batch)
                batch = []
            if one:
                batch.append((blocks, token_ids))
            else:
                stored += blocks.register(token_ids, num_final)
        return stored + (SequenceBlocks._register_next(batch) if batch else 0)

    @staticmethod
    def _register_next(group: list[tuple[SequenceBlocks, Sequence[int]]]) -> int:
        """register_filled for sequences of one pool and extra key that each register their next block."""
        first = group[0][0]
        pool, extra, bs = first.pool, first.extra, first.block_size
        flat: list[int] = []
        for blocks, token_ids in group:
            start = blocks.num_registered * bs
            flat += token_ids[start:start + bs]
        rows = blocks_of(flat, bs)
        parents = [blocks.hashes[-1] if blocks.hashes else None for blocks, _ in group]
        hashes = child_hashes(rows, parents, extra)
        # The fingerprints a prompt's match did not compute already, in one pass.
        todo = [i for i, (blocks, _) in enumerate(group) if len(blocks.keys) == blocks.num_registered]
        computed = pool.index.child_keys(
            rows[todo], [group[i][0].num_registered for i in todo],
            [group[i][0].keys[-1] if group[i][0].keys else None for i in todo], extra) if todo else []
        for i, k in zip(todo, computed):
            group[i][0].keys.append(k)
        keys = [blocks.keys[blocks.num_registered] for blocks, _ in group]
        ids = [blocks.block_ids[blocks.num_registered] for blocks, _ in group]
        cached = pool.register_blocks(ids, hashes, parents, rows, keys, extra)
        stored = 0
        for (blocks, _), h, b, c in zip(group, hashes, ids, cached):
            blocks.hashes.append(h)
            blocks.num_registered += 1
            stored += c == b
            blocks.num_duplicates += c != b
        return stored

    def release(self) -> None:
        """Gives every block and the rest of the reservation back (once the sequence's last step has
        finished on the device). Cached blocks stay cached, evictable, the tail first."""
        self.pool.release(self.block_ids)
        self.pool.unreserve(self.num_reserved)
        self.block_ids = []
        self.num_reserved = 0
