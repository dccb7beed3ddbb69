"""CPU unit tests of the prefix cache (engine/prefix_cache.py) and its KV-event log (engine/kv_events.py):
the hash recipe against an independent hashlib implementation of the documented recipe, the pool's
reference counts, LRU eviction, reservations, registration and flush, the event log's numbering, bounds
and subscriptions, and a stateful fuzz of an engine-shaped client of the pool."""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import hashlib
import os
import random
import subprocess
import sys
import threading

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.errors import ConfigError, OutOfRange, ResourceExhausted
from engine.kv_cache import BlockAllocator
from engine.kv_events import KvBlocksRemoved, KvBlocksStored, KvCacheCleared, KvEventLog, follow
from engine.prefix_cache import BlockPool, block_hashes, extra_key, hash_block
from engine.prefix_index import PrefixIndex, blocks_of
from engine.sequence_blocks import SequenceBlocks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def ref_hash(parent: int | None, tokens: list[int], extra: bytes = b"") -> int:
    """The recipe of engine/prefix_cache.py's docstring, written out with hashlib alone."""
    data = b"metrale-kv-block-v1\x00" + len(extra).to_bytes(4, "little") + extra
    data += b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little", signed=True)
    data += b"".join(t.to_bytes(4, "little") for t in tokens)
    return int.from_bytes(hashlib.sha256(data).digest()[:8], "big", signed=True)


def cached_hashes(pool: BlockPool) -> set[int]:
    return {h for b in range(1, pool.num_blocks) if (h := pool.block_hash(b)) is not None}


def replay(batches, state: set[int] | None = None) -> set[int]:
    """The set of cached hashes the events describe; checks that each hash is stored once and removed
    only while stored."""
    state = set() if state is None else state
    for batch in batches:
        for ev in batch.events:
            if isinstance(ev.data, KvBlocksStored):
                for block in ev.data.blocks:
                    assert block.block_hash not in state, "a hash stored twice"
                    state.add(block.block_hash)
            elif isinstance(ev.data, KvBlocksRemoved):
                for h in ev.data.block_hashes:
                    assert h in state, "a removal of a hash not stored"
                    state.remove(h)
            else:
                state.clear()
    return state


def fill(pool: BlockPool, tokens: list[int], extra: bytes = b"") -> list[int]:
    """Allocates, 'computes' and registers the full blocks of tokens (the engine's flow, no forward)."""
    bs = pool.block_size
    hashes = block_hashes(tokens, bs, extra)
    blocks = pool.allocate(len(hashes))
    for i, (b, h) in enumerate(zip(blocks, hashes)):
        assert pool.register(b, h, hashes[i - 1] if i else None, tokens[i * bs:(i + 1) * bs]) == b
    return blocks


# Hashing -------------------------------------------------------------------------------------------

def test_block_hash_matches_the_documented_recipe():
    tokens = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    h = block_hashes(tokens, 4)
    assert h == [ref_hash(None, [1, 2, 3, 4]), ref_hash(ref_hash(None, [1, 2, 3, 4]), [5, 6, 7, 8])]
    # The same values, pinned, so that a change of the recipe cannot pass unnoticed (routers rely on it).
    assert h == [-1188170838500960873, 2174248303744984191]
    assert hash_block(None, [1, 2, 3, 4], b"kv_dtype=bfloat16") == ref_hash(None, [1, 2, 3, 4], b"kv_dtype=bfloat16") \
        == -4871791217420766404
    assert hash_block(None, [128000, 2**32 - 1, 0, 7]) == 5594172698933114611
    assert all(-2**63 <= x < 2**63 for x in h)


def test_block_hash_chains_on_the_prefix_and_the_extra_key():
    a = list(range(100, 116))
    b = a[:9] + [999] + a[10:]  # differs in block 2 of 4 (block size 4)
    ha, hb = block_hashes(a, 4), block_hashes(b, 4)
    assert ha[:2] == hb[:2] and all(x != y for x, y in zip(ha[2:], hb[2:]))
    assert block_hashes(a + [1, 2], 4) == ha  # a partial block has no hash
    assert block_hashes(a[8:], 4, parent_hash=ha[1]) == ha[2:]  # continuing a chain
    fp8 = block_hashes(a, 4, extra_key(kv_dtype="float8_e4m3fn"))
    assert len(set(fp8) | set(ha)) == 8  # the extra key changes every block
    assert extra_key(kv_dtype="bf16", adapter="x") == b"adapter=x;kv_dtype=bf16" and extra_key() == b""
    # The same first block at another depth has another hash (position is part of the content).
    assert block_hashes(a[4:8] * 2, 4)[1] != block_hashes(a[4:8], 4)[0]


def test_block_hash_is_stable_across_processes():
    # engine/__init__ imports torch; the hash needs none of it, so the package is stubbed for speed.
    code = ("import sys, types; pkg = types.ModuleType('engine'); pkg.__path__ = ['engine']; "
            "sys.modules['engine'] = pkg; from engine.prefix_cache import block_hashes; "
            "print(block_hashes(list(range(40)), 16, b'x'))")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                           env={**os.environ, "PYTHONPATH": ROOT, "PYTHONHASHSEED": seed}).stdout
            for seed in ("1", "2")}
    assert outs == {f"{block_hashes(list(range(40)), 16, b'x')}\n"}


def test_block_hash_rejects_what_it_cannot_encode():
    for bad in ([-1], [2**32], [1.5]):
        with pytest.raises(ValueError):
            hash_block(None, bad)
    with pytest.raises(ValueError):
        hash_block(2**63, [1])
    with pytest.raises(ValueError):
        block_hashes([1], 0)


# The pool ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", [BlockAllocator, lambda n: BlockPool(n, 4)], ids=["BlockAllocator", "BlockPool"])
def test_pool_keeps_the_block_allocator_contract(make):
    alloc = make(10)
    assert alloc.num_usable_blocks == 9 and alloc.num_free_blocks == 9
    a = alloc.allocate(4)
    b = alloc.allocate(5)
    assert 0 not in a + b and len(set(a + b)) == 9
    assert not alloc.can_allocate(1)
    with pytest.raises(ResourceExhausted):
        alloc.allocate(1)
    alloc.free(a)
    assert alloc.num_free_blocks == 4 and alloc.num_used_blocks == 5
    assert sorted(alloc.allocate(4)) == sorted(a)
    with pytest.raises(ConfigError):
        make(1)  # block 0 is scratch: one block holds nothing


def test_match_acquire_release_share_cached_blocks():
    pool = BlockPool(16, 4)
    tokens = list(range(1, 14))  # 3 full blocks and one token
    hashes = block_hashes(tokens, 4)
    mine = fill(pool, tokens)
    assert pool.num_cached_blocks == 3 and pool.num_evictable_blocks == 0
    assert pool.match(hashes) == mine
    assert pool.match(hashes[:2] + [12345]) == mine[:2]  # the longest cached prefix
    assert pool.match([12345] + hashes[1:]) == []  # a chain is matched from its first block only
    pool.acquire(mine[:2])  # a second sequence shares the first two blocks
    assert [pool.ref_count(b) for b in mine] == [2, 2, 1]
    pool.release(mine)  # the first sequence ends
    assert pool.num_evictable_blocks == 1 and pool.num_free_blocks == 15 - 2
    pool.release(mine[:2])
    assert pool.num_evictable_blocks == 3 and pool.num_free_blocks == 15 and pool.num_used_blocks == 0
    assert pool.match(hashes) == mine  # unreferenced blocks stay cached
    pool.acquire(mine)
    assert pool.num_evictable_blocks == 0 and all(pool.ref_count(b) == 1 for b in mine)


@pytest.mark.parametrize("length", [4, 13, 16, 17])
def test_a_sequence_matches_the_same_blocks_from_packed_ids_as_from_a_list(length):
    """SequenceBlocks.match takes the prompt as a list or as the uint32 array the token check packed
    (SequenceTable.check_tokens): the same blocks and cached length either way, and blocks_of of the array is
    blocks_of of the list."""
    from engine.sequence import SequenceTable

    tokens = [(5 * i + 3) % 97 for i in range(length)]
    packed = SequenceTable(97, 4).check_tokens(tokens + list(range(70)), "ids")[:length]  # long enough to pack
    assert packed.dtype == np.uint32 and packed.tolist() == tokens
    assert np.array_equal(blocks_of(packed, 4), blocks_of(tokens, 4))
    pool = BlockPool(32, 4)
    owner = SequenceBlocks(pool, 8)
    owner.grow(length)
    owner.register(tokens, length)
    matched = []
    for ids in (tokens, packed):
        seq = SequenceBlocks(pool, 8)
        matched.append((seq.match(ids), list(seq.block_ids), list(seq.hashes)))
        seq.release()
    assert matched[0] == matched[1]
    assert matched[0][0] == (length - 1) // 4 * 4 and matched[0][1] == owner.block_ids[:(length - 1) // 4]


def test_misuse_is_refused_and_changes_nothing():
    pool = BlockPool(8, 4)
    [b] = pool.allocate(1)
    with pytest.raises(ValueError):
        pool.acquire([b])  # not cached: only cached blocks are shared
    with pytest.raises(ValueError):
        pool.release([b, b])
    with pytest.raises(ValueError):
        pool.release([b + 1])
    with pytest.raises(ValueError):
        pool.register(b + 1, 7, None, [1, 2, 3, 4])  # not referenced by the caller
    with pytest.raises(ValueError):
        pool.register(b, 7, None, [1, 2, 3])  # not a full block
    assert pool.ref_count(b) == 1 and pool.num_free_blocks == 6 and pool.num_cached_blocks == 0
    pool.register(b, 7, None, [1, 2, 3, 4])
    with pytest.raises(ValueError):
        pool.register(b, 8, None, [1, 2, 3, 4])  # one hash per block


def test_a_registered_run_is_what_registering_block_by_block_makes():
    """register_run (SequenceBlocks' one call for a prompt's blocks) against pool.register block by block, on two
    pools fed the same history: a run that continues the last stored event, holds a block already cached under
    another block in its middle, and a fingerprint held already. Same returns, stats, events (stretches split at the
    duplicate), index matches; a run with one bad block changes nothing."""
    bs, tokens = 2, [5, 1, 5, 2, 7, 7, 5, 3, 8, 8, 9, 9]
    hashes = block_hashes(tokens, bs)
    rows = blocks_of(tokens, bs)
    pools = [BlockPool(32, bs), BlockPool(32, bs)]
    for pool in pools:  # history: blocks 0-1 registered, and another sequence's copy of block 3 cached
        first = pool.allocate(2)
        keys = pool.index.keys(rows, 0, None, b"")
        assert pool.register_run(first, hashes[:2], None, rows[:2], keys[:2]) == first
        [other] = pool.allocate(1)
        pool.register(other, hashes[3], hashes[2], tokens[6:8])
    results = []
    for pool, by_block in zip(pools, (False, True)):
        run = pool.allocate(4)  # blocks 2-5 of the sequence
        keys = pool.index.keys(rows, 0, None, b"")
        if by_block:
            got = [pool.register(b, hashes[2 + i], hashes[1 + i], tokens[(2 + i) * bs:(3 + i) * bs], keys[2 + i])
                   for i, b in enumerate(run)]
        else:
            got = pool.register_run(run, hashes[2:], hashes[1], rows[2:], keys[2:])
        pool.events.publish()
        events = [(ev.data.parent_block_hash, [blk.block_hash for blk in ev.data.blocks], [blk.token_ids
                   for blk in ev.data.blocks]) for batch in pool.events.read(1) for ev in batch.events]
        matched = pool.match_prefix(rows, keys)
        results.append((got, dataclasses.asdict(pool.stats), events, matched, [pool.block_hash(b) for b in run]))
        assert got[1] != run[1] and got[:1] + got[2:] == run[:1] + run[2:]  # block 3 is the other's
    assert results[0] == results[1]
    assert [e[1] for e in results[0][2]] == [hashes[:2], [hashes[3]], [hashes[2]], hashes[4:]]
    pool = pools[0]
    [a, b] = pool.allocate(2)
    with pytest.raises(ValueError):
        pool.register_run([a, b + 1], [11, 12], None, [[1, 2], [3, 4]])  # b + 1: not referenced
    with pytest.raises(ValueError):
        pool.register_run([a, b], [11, 12], None, [[1, 2], [3, 4, 5]])
    assert pool.block_hash(a) is None and pool.events.publish() is None  # no event pending


def test_eviction_is_lru_tail_first_and_never_touches_referenced_blocks():
    pool = BlockPool(11, 2)  # 10 usable
    old = fill(pool, list(range(8)))  # 4 blocks
    pool.release(old)
    live = fill(pool, [9, 9, 9, 9])  # 2 blocks, kept referenced
    new = fill(pool, [5, 5, 5, 5])
    pool.release(new)
    pool.events.publish()
    assert pool.num_free_blocks == 8 and pool.num_evictable_blocks == 6
    got = pool.allocate(6)  # 2 free blocks, then 4 evictions: old's tail first
    assert set(got[:2]).isdisjoint(old + new + live)
    assert got[2:] == [old[3], old[2], old[1], old[0]]
    assert pool.stats.evicted_blocks == 4
    assert pool.events.publish() == 2
    removed = [h for ev in pool.events.read(2)[0].events for h in ev.data.block_hashes]
    assert removed == block_hashes(list(range(8)), 2)[::-1]
    assert pool.match(block_hashes([9, 9, 9, 9], 2)) == live and pool.match(block_hashes([5, 5, 5, 5], 2)) == new
    assert pool.allocate(2) == [new[1], new[0]]
    with pytest.raises(ResourceExhausted):
        pool.allocate(1)  # what is left is referenced
    assert all(pool.ref_count(b) == 1 for b in live) and pool.match(block_hashes([9, 9, 9, 9], 2)) == live


def test_register_keeps_one_block_per_hash():
    pool = BlockPool(8, 4)
    tokens = [3, 1, 4, 1]
    [h] = block_hashes(tokens, 4)
    [a] = fill(pool, tokens)
    [b] = pool.allocate(1)  # a second sequence computed the same block itself
    assert pool.register(b, h, None, tokens) == a
    assert pool.block_hash(b) is None and pool.stats.duplicate_blocks == 1 and pool.stats.stored_blocks == 1
    assert pool.register(a, h, None, tokens) == a  # registering the cached block again is a no-op
    pool.events.publish()
    stored = [blk for ev in pool.events.read(1)[0].events for blk in ev.data.blocks]
    assert [blk.block_hash for blk in stored] == [h]
    pool.release([b])  # the duplicate is not cached: it goes back to the free list
    assert pool.num_evictable_blocks == 0 and pool.allocate(1) == [b]


def test_reservations_are_honest():
    pool = BlockPool(11, 4)  # 10 usable
    shared = fill(pool, list(range(12)))  # 3 cached blocks, referenced by a first sequence
    pool.reserve(5)
    assert pool.num_free_blocks == 2 and pool.can_allocate(2) and not pool.can_allocate(3)
    with pytest.raises(ResourceExhausted):
        pool.reserve(3)
    with pytest.raises(ResourceExhausted):
        pool.allocate(3)
    # The second sequence's prompt starts with the 3 cached blocks: it takes them for 3 of its 5.
    pool.acquire(pool.match(block_hashes(list(range(12)), 4)), reserved=True)
    assert pool.num_reserved_blocks == 2 and pool.num_free_blocks == 5
    own = pool.allocate(2, reserved=True)
    assert pool.num_reserved_blocks == 0 and set(own).isdisjoint(shared)
    with pytest.raises(ValueError):
        pool.allocate(1, reserved=True)
    with pytest.raises(ValueError):
        pool.unreserve(1)
    pool.release(shared)
    # Evictable blocks count as available for a reservation, and an acquire of one under a
    # reservation takes its place.
    pool.release(shared)
    assert pool.num_evictable_blocks == 3 and pool.num_free_blocks == 8
    pool.reserve(8)
    pool.acquire(shared[:1], reserved=True)
    assert pool.num_free_blocks == 0 and pool.num_reserved_blocks == 7
    got = pool.allocate(7, reserved=True)  # 5 free + 2 evicted
    assert set(got) >= set(shared[1:]) and pool.ref_count(shared[0]) == 1
    # Without a reservation, acquiring an evictable block needs an available one.
    pool.release(shared[:1])
    pool.release(got + own)
    pool.reserve(pool.num_free_blocks)
    [h0] = block_hashes(list(range(4)), 4)
    assert pool.match([h0]) == shared[:1] and pool.ref_count(shared[0]) == 0
    with pytest.raises(ResourceExhausted):
        pool.acquire(shared[:1])
    pool.unreserve(1)
    pool.acquire(shared[:1])
    assert pool.ref_count(shared[0]) == 1 and pool.num_free_blocks == 0


def test_flush_drops_unreferenced_blocks_with_the_right_events():
    pool = BlockPool(16, 4)
    kept = fill(pool, list(range(8)))
    gone = fill(pool, list(range(50, 58)))
    pool.release(gone)
    pool.events.publish()
    assert pool.flush() == 2 and pool.stats.flushed_blocks == 2
    assert pool.match(block_hashes(list(range(50, 58)), 4)) == []
    assert pool.match(block_hashes(list(range(8)), 4)) == kept
    pool.events.publish()
    [ev] = pool.events.read(2)[0].events
    assert sorted(ev.data.block_hashes) == sorted(block_hashes(list(range(50, 58)), 4))
    assert pool.num_free_blocks == 15 - 2
    pool.release(kept)
    assert pool.flush() == 2 and pool.num_cached_blocks == 0 and pool.num_free_blocks == 15
    pool.events.publish()
    [ev] = pool.events.read(3)[0].events
    assert isinstance(ev.data, KvCacheCleared) and ev.kind == "cleared"
    assert replay(pool.events.read(1)) == set()


def test_stats_count_queries_hits_and_the_hit_rate():
    pool = BlockPool(8, 4)
    pool.record_query(10, 8)
    pool.record_query(6, 0)
    s = pool.stats
    assert (s.queries, s.query_tokens, s.hit_tokens, s.query_blocks, s.hit_blocks) == (2, 16, 8, 3, 2)
    assert s.hit_rate == 0.5
    with pytest.raises(ValueError):
        pool.record_query(4, 5)


def test_stored_events_carry_chains_with_parents_tokens_and_block_size():
    pool = BlockPool(16, 4)
    tokens = list(range(20, 32))
    hashes = block_hashes(tokens, 4)
    blocks = fill(pool, tokens)
    other = fill(pool, [7] * 4)
    # A block continuing the first chain after another chain was stored: a new event, with its parent.
    [b] = pool.allocate(1)
    h = hash_block(hashes[-1], [1, 2, 3, 4])
    pool.register(b, h, hashes[-1], [1, 2, 3, 4])
    assert pool.events.publish() == 1
    [batch] = pool.events.read(1)
    assert [e.event_id for e in batch.events] == [1, 2, 3]
    first, second, third = (e.data for e in batch.events)
    assert first.parent_block_hash is None and [x.block_hash for x in first.blocks] == hashes
    assert [x.token_ids for x in first.blocks] == [tuple(tokens[i:i + 4]) for i in (0, 4, 8)]
    assert all(x.block_size == 4 for x in first.blocks)
    assert [x.block_hash for x in second.blocks] == block_hashes([7] * 4, 4)
    assert third.parent_block_hash == hashes[-1] and third.blocks[0].block_hash == h
    assert blocks and other


def test_snapshot_restates_the_cache_parents_first():
    pool = BlockPool(32, 2)
    a = fill(pool, list(range(8)))
    pool.release(a)
    fill(pool, [5, 5, 6, 6])
    pool.allocate(3)  # evicts the chain's tail first, then its parent-most blocks stay
    # A child whose parent block was evicted and then cached again comes after its parent in the snapshot.
    [b] = pool.allocate(1)
    pool.register(b, block_hashes(list(range(8)), 2)[0], None, [0, 1])
    snap = pool.snapshot()
    assert pool.events.num_pending_events == 0 and snap.sequence_number == pool.events.last_sequence_number == 1
    assert snap.snapshot is not None and snap.snapshot.blocks == pool.num_cached_blocks
    assert isinstance(snap.events[0].data, KvCacheCleared) and all(e.event_id == 0 for e in snap.events)
    seen: set[int] = set()
    for e in snap.events[1:]:
        parent = e.data.parent_block_hash
        assert parent is None or parent in seen or parent not in cached_hashes(pool)
        seen.add(e.data.blocks[0].block_hash)
    assert replay([snap]) == cached_hashes(pool)


# SequenceBlocks ------------------------------------------------------------------------------------

def test_sequence_blocks_share_a_prefix_but_always_compute_the_last_prompt_token():
    pool = BlockPool(20, 4)
    first = SequenceBlocks(pool, 4)
    prompt = list(range(100, 112))  # 3 full blocks
    assert first.match(prompt) == 0
    assert len(first.grow_all()) == 4 and first.num_reserved == 0
    assert first.register(prompt + [7], 12) == 3 and first.num_registered == 3
    # The same prompt again, exactly on a block boundary: 2 blocks shared, the third recomputed.
    again = SequenceBlocks(pool, 4)
    assert pool.num_free_blocks == 20 - 1 - 4 - 4
    assert again.match(prompt) == 8 and again.block_ids == first.block_ids[:2]
    assert pool.num_free_blocks == 20 - 1 - 4 - 2  # the shared blocks' reservation went back
    new = again.grow(12)
    assert len(new) == 1 and again.num_reserved == 1 and again.num_capacity_blocks == 4
    assert again.register(prompt + [7], 12) == 0 and again.num_duplicates == 1  # cached under first's block
    with pytest.raises(ValueError):
        again.grow(17)
    # A longer prompt with the same start shares all three blocks.
    longer = SequenceBlocks(pool, 5)
    assert longer.match(prompt + [1, 2]) == 12 and longer.match(prompt) == 0  # first chunk only
    for s in (first, again, longer):
        s.release()
    assert pool.num_free_blocks == 19 and pool.num_reserved_blocks == 0 and pool.num_evictable_blocks == 3


def test_the_prefix_index_fingerprints_a_sequence_in_pieces_as_in_one():
    pool = BlockPool(8, 4)
    tokens = list(range(100, 140))
    whole = pool.index.keys(blocks_of(tokens, 4), 0, None, b"x")
    assert len(whole) == 10 and len(set(whole)) == 10
    parts = pool.index.keys(blocks_of(tokens[:12], 4), 0, None, b"x")
    parts += pool.index.keys(blocks_of(tokens[12:], 4), 3, parts[-1], b"x")
    assert parts == whole
    assert pool.index.keys(blocks_of(tokens, 4), 0, None, b"y") != whole  # the extra key seeds the chain
    assert pool.index.keys(blocks_of(tokens[:7], 4), 0, None, b"x") == whole[:1]  # full blocks only
    zeros = pool.index.keys(blocks_of([0] * 8, 4), 0, None, b"x")
    assert zeros[0] != zeros[1]  # a block of token 0s moves the chain too
    with pytest.raises(ValueError):
        blocks_of([1, -2, 3, 4], 4)
    with pytest.raises(ValueError):
        blocks_of([1, 2 ** 32, 3, 4], 4)


def test_short_runs_fingerprint_hash_and_index_as_long_ones():
    """Runs of 1-2 blocks (a decode step's filled block) take Python-int and row-by-row forms of the vectorized
    ones (prefix_index.SMALL_RUN, block_hashes' struct packing): the same keys, hashes and index tables, with token
    ids up to 2**32 - 1 (the sums wrap mod 2**64)."""
    rng = random.Random(5)
    tokens = [rng.choice([0, 1, 2 ** 32 - 1, rng.randrange(2 ** 32)]) for _ in range(9 * 4)]
    whole, short = PrefixIndex(64, 4, seed=3), PrefixIndex(64, 4, seed=3)
    keys = whole.keys(blocks_of(tokens, 4), 0, None, b"x")
    pieces, start = [], 0
    for n in (1, 2, 1, 2, 2, 1):
        pieces += short.keys(blocks_of(tokens[4 * start:4 * (start + n)], 4), start, pieces[-1] if pieces else None,
                             b"x")
        start += n
    assert pieces == keys
    hashes = block_hashes(tokens, 4, b"x")
    chained, parent = [], None
    for n in (2, 1, 2, 2, 1, 1):
        chained += block_hashes(tokens[4 * len(chained):4 * (len(chained) + n)], 4, b"x", parent)
        parent = chained[-1]
    assert chained == hashes == [hash_block(None if i == 0 else hashes[i - 1], tokens[4 * i:4 * i + 4], b"x")
                                 for i in range(9)]
    with pytest.raises(ValueError):
        block_hashes([1, 2, 2 ** 32, 3], 4)
    ids = list(range(3, 12))
    rows = blocks_of(tokens, 4)
    whole.add_run(ids, keys, hashes, [None] + hashes[:-1], rows, b"x")
    for i in range(0, 9, 2):
        j = min(i + 2, 9)
        short.add_run(ids[i:j], keys[i:j], hashes[i:j], ([None] + hashes[:-1])[i:j], rows[i:j], b"x")
    for table in ("_tokens", "_hash", "_parent", "_has_parent", "_extra", "_key"):
        assert np.array_equal(getattr(whole, table), getattr(short, table)), table
    assert whole._block_of == short._block_of
    assert short.match(rows, keys, b"x") == (ids, hashes)


def test_a_steps_filled_blocks_register_as_sequence_by_sequence():
    """SequenceBlocks.register_filled (a decode step's one call) against register() sequence by sequence, on two
    pools fed the same history, 9 sequences: 0-2 register one block each, its fingerprint not known yet (1 a
    duplicate of 0's, 2 after a matched prefix: a stretch past SMALL_RUN, the numpy forms), 3 one of another extra
    key (a stretch of one), 4 has caching off, 5 registers two blocks (register() itself), 6 nothing, 7-8 one each (a
    stretch of two; 8's fingerprint computed by its prompt's match). Same returns, sequence state, pool stats, events
    in the same order, index tables and prefix matches."""
    bs, num_seqs = 4, 9
    rng = random.Random(9)
    prompts = [[rng.randrange(100) for _ in range(n)] for n in (4, 4, 7, 4, 4, 6, 3, 4, 6)]
    prompts[1] = list(prompts[0])  # block 0 equal: the second's registration is a duplicate
    outputs = [[rng.randrange(100) for _ in range(4 * 3)] for _ in range(num_seqs)]
    results = []
    for batched in (False, True):
        pool = BlockPool(256, bs)
        pool.index = PrefixIndex(256, bs, seed=11)  # the same fingerprint multipliers in both pools
        shared = SequenceBlocks(pool, 3)
        shared.match(prompts[2] + [0])
        shared.grow_all()
        shared.register(prompts[2][:4] + [0] * 8, 4)  # a cached first block for sequence 2 to match
        seqs = []
        for i, prompt in enumerate(prompts):
            blocks = SequenceBlocks(pool, 4, extra=b"x" if i == 3 else b"", caching=i != 4)
            blocks.match(prompt)
            blocks.grow_all()
            seqs.append(blocks)
        tokens = [p + o for p, o in zip(prompts, outputs)]
        # sequence 5 registers two blocks (final 8), sequence 6 none (final 3), the rest one (final 4, or 8 where
        # their first block was matched)
        finals = [8 if i == 5 or seqs[i].num_registered else 3 if i == 6 else 4 for i in range(num_seqs)]
        items = [(b, t, f) for b, t, f in zip(seqs, tokens, finals)]
        if batched:
            got = SequenceBlocks.register_filled(items)
        else:
            got = sum(b.register(t, f) for b, t, f in items)
        pool.events.publish()
        events = [(ev.data.parent_block_hash, [blk.block_hash for blk in ev.data.blocks])
                  for batch in pool.events.read(1) for ev in batch.events if hasattr(ev.data, "blocks")]
        state = [(b.hashes, b.keys, b.num_registered, b.num_duplicates) for b in seqs]
        tables = [getattr(pool.index, t).tolist() for t in ("_tokens", "_hash", "_parent", "_has_parent", "_extra",
                                                           "_key")]
        probe = blocks_of(tokens[0], bs)
        matched = pool.match_prefix(probe, pool.index.keys(probe, 0, None, b""))
        results.append((got, state, dataclasses.asdict(pool.stats), events, tables, pool.index._block_of, matched))
    assert results[0] == results[1]
    got, state = results[0][:2]
    assert [s[2] for s in state] == [1, 1, 2, 1, 0, 2, 0, 1, 1]  # blocks registered (2: one matched, one new)
    assert [s[3] for s in state] == [0, 1, 0, 0, 0, 0, 0, 0, 0]  # sequence 1's block was sequence 0's hash
    assert got == 9 - 1 - 1  # newly cached: every registered block but the matched one and the duplicate


def test_a_fingerprint_collision_costs_a_hit_but_never_shares_a_wrong_block(monkeypatch):
    """Every block fingerprinted alike: the index holds the first block registered under the fingerprint,
    and the exact check (tokens, extra key, parent hash) refuses it wherever it is not the prompt's block."""
    pool = BlockPool(64, 2)
    monkeypatch.setattr(pool.index, "keys", lambda ids, first, prev, extra: [7] * len(ids))
    a = SequenceBlocks(pool, 4)
    assert a.match([1, 2, 3, 4, 5]) == 0
    a.grow_all()
    assert a.register([1, 2, 3, 4, 5, 6], 6) == 3
    b = SequenceBlocks(pool, 4)
    assert b.match([1, 2, 9, 9, 5]) == 2 and b.block_ids == a.block_ids[:1]  # a's first block, not its second
    c = SequenceBlocks(pool, 4)
    assert c.match([9, 9, 3, 4, 5]) == 0 and c.block_ids == []  # a's first block's key, other tokens
    d = SequenceBlocks(pool, 4)
    assert d.match([1, 2, 1, 2, 5]) == 2  # a's first block again at block 1: its parent is not block 0's hash
    e = SequenceBlocks(pool, 4, extra=b"kv_dtype=fp8")
    assert e.match([1, 2, 3, 4, 5]) == 0  # same tokens, another extra key


def test_sequence_blocks_without_caching_are_a_plain_allocation():
    pool = BlockPool(10, 2)
    seq = SequenceBlocks(pool, 3)
    seq.grow_all()
    seq.register([1, 2, 3, 4, 5], 5)
    off = SequenceBlocks(pool, 3, caching=False)
    assert off.match([1, 2, 3, 4, 5]) == 0 and off.block_ids == []
    off.grow_all()
    assert off.register([1, 2, 3, 4, 5], 5) == 0 and all(pool.block_hash(b) is None for b in off.block_ids)
    with pytest.raises(ResourceExhausted):
        SequenceBlocks(pool, 4)
    off.release()
    seq.release()
    assert pool.num_free_blocks == 9 and pool.num_cached_blocks == 2


# The event log -------------------------------------------------------------------------------------

def publish_n(log: KvEventLog, n: int, start: int = 0) -> None:
    for i in range(n):
        log.removed(start + i)
        log.publish()


def test_event_log_numbers_batches_and_bounds_what_it_keeps():
    log = KvEventLog(max_batches=8)
    assert log.publish() is None and log.last_sequence_number == 0 and log.read(1) == []
    publish_n(log, 20)
    assert log.last_sequence_number == 20 and log.first_sequence_number == 13
    assert [b.sequence_number for b in log.read(13)] == list(range(13, 21))
    assert [b.events[0].event_id for b in log.read(18, max_batches=2)] == [18, 19]
    assert log.read(21) == []
    with pytest.raises(OutOfRange, match="no longer kept"):
        log.read(12)
    with pytest.raises(OutOfRange, match="ahead"):
        log.read(22)
    with pytest.raises(ValueError):
        log.read(0)


def test_event_log_bounds_blocks_too():
    log = KvEventLog(max_batches=100, max_blocks=10)
    for i in range(6):
        for j in range(4):
            log.removed(i * 4 + j)
        log.publish()
    assert log.first_sequence_number == 5  # two batches of 4 fit in 10
    for j in range(30):
        log.removed(j)
    log.publish()
    assert log.first_sequence_number == 7  # a batch above the bound is still kept, alone


def test_listeners_are_told_and_a_failing_one_breaks_nothing():
    log = KvEventLog()
    got = []

    def bad(_n):
        raise RuntimeError("subscriber bug")
    stop_bad = log.listen(bad)
    stop = log.listen(got.append)
    publish_n(log, 2)
    stop()
    stop_bad()
    publish_n(log, 1)
    assert got == [1, 2] and log.last_sequence_number == 3


def test_follow_streams_batches_published_from_another_thread():
    log = KvEventLog()
    publish_n(log, 3)

    async def main():
        got = []

        async def reader():
            async for batch in follow(log, 2):
                got.append(batch.sequence_number)
                if len(got) == 12:
                    return

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0.01)
        writer = threading.Thread(target=publish_n, args=(log, 10, 100))
        writer.start()
        await asyncio.wait_for(task, 5)
        writer.join()
        return got
    assert asyncio.run(main()) == list(range(2, 14))


def test_follow_with_the_engine_on_the_same_loop_and_a_reader_that_falls_behind():
    log = KvEventLog(max_batches=4)

    async def main():
        stream = follow(log, 1)
        publish_n(log, 2)
        assert [(await stream.__anext__()).sequence_number for _ in range(2)] == [1, 2]
        nxt = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.01)
        assert not nxt.done()  # waits for the next publish
        publish_n(log, 1)
        assert (await asyncio.wait_for(nxt, 5)).sequence_number == 3
        publish_n(log, 10)  # the reader does not read: the log stays bounded, the reader falls behind
        assert len(log.read(log.first_sequence_number)) == 4
        with pytest.raises(OutOfRange):
            await stream.__anext__()
        with pytest.raises(OutOfRange):
            await follow(log, 1).__anext__()
    asyncio.run(main())


def to_smg_pb(obj, cls):
    """A field-for-field copy into smg-grpc-proto's message class: every dataclass field by its own
    name (the `data` oneof by the event's kind), so a name that the proto lacks fails here."""
    from google.protobuf import message_factory
    kw = {}
    for f in dataclasses.fields(obj):
        value, name = getattr(obj, f.name), f.name
        if value is None:
            continue
        if name == "data":
            name = obj.kind
        field = cls.DESCRIPTOR.fields_by_name[name]
        if field.message_type is not None:
            sub = message_factory.GetMessageClass(field.message_type)
            value = [to_smg_pb(v, sub) for v in value] if isinstance(value, tuple) else to_smg_pb(value, sub)
        kw[name] = value
    return cls(**kw)


def test_events_copy_field_for_field_into_smg_common_proto():
    common_pb2 = pytest.importorskip("smg_grpc_proto.generated.common_pb2")
    pool = BlockPool(8, 2)
    blocks = fill(pool, [1, 2, 3, 4])
    pool.release(blocks)
    pool.allocate(7)  # evicts both
    pool.events.publish()
    pool.flush()
    pool.events.publish()
    batches = pool.events.read(1) + [pool.snapshot()]
    msgs = [to_smg_pb(b, common_pb2.KvEventBatch) for b in batches]
    stored, removed = msgs[0].events
    h = block_hashes([1, 2, 3, 4], 2)
    assert stored.WhichOneof("data") == "stored" and not stored.stored.HasField("parent_block_hash")
    assert [b.block_hash for b in stored.stored.blocks] == h and list(stored.stored.blocks[1].token_ids) == [3, 4]
    assert stored.stored.blocks[0].block_size == 2 and stored.event_id == 1
    assert removed.WhichOneof("data") == "removed" and list(removed.removed.block_hashes) == h[::-1]
    assert msgs[1].events[0].WhichOneof("data") == "cleared" and msgs[1].sequence_number == 2
    assert msgs[2].HasField("snapshot") and msgs[2].snapshot.count == 1 and msgs[2].sequence_number == 2


# The fuzz: an engine-shaped client of the pool ------------------------------------------------------

BS, NUM_BLOCKS = 2, 17
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]


class Seq:
    """The engine's side of a sequence; its blocks are a SequenceBlocks, the helper under test."""

    def __init__(self, blocks: SequenceBlocks):
        self.blocks = blocks
        self.capacity = blocks.num_reserved * BS  # tokens the reservation holds
        self.tokens: list[int] = []
        self.num_cached = 0              # tokens whose KV is written (positions < num_cached are final)
        self.prompt_done = False
        self.duplicates: set[int] = set()  # indices of registered blocks kept as uncached copies


class PrefixCacheMachine(RuleBasedStateMachine):
    """Drives a BlockPool through SequenceBlocks the way engine/prefix_cache.py's engine contract
    says: reserve at alloc; match the first chunk (capped so that the last known token is computed),
    take blocks as the prompt needs them and the rest of the reservation when it completes; write
    only at positions >= num_cached (Verify leaves rejected drafts' garbage there); register only
    final positions. A model of every block's written contents checks that no write lands in a
    shared or cached block, and that shared and registered blocks hold their tokens."""

    def __init__(self):
        super().__init__()
        self.pool = BlockPool(NUM_BLOCKS, BS, KvEventLog(max_batches=2))
        self.seqs: dict[int, Seq] = {}
        self.next_id = 0
        self.content: dict[int, list] = collections.defaultdict(lambda: [None] * BS)  # block -> token per row
        self.frozen: dict[int, tuple] = {}  # cached block -> its contents when registered
        self.replayed: set[int] = set()
        self.cursor = 1
        self.lag_state: set[int] = set()
        self.lag_cursor = 1
        self.num_steps = 0
        self.histories: list[tuple[int, ...]] = []  # token lists of released sequences

    # The engine's paths --------------------------------------------------------------------------

    def write(self, seq: Seq, pos: int, token: int) -> None:
        b = seq.blocks.block_ids[pos // BS]
        assert self.pool.ref_count(b) == 1 and self.pool.block_hash(b) is None, "a write into a shared block"
        self.content[b][pos % BS] = token

    def taken(self, refs: collections.Counter, new: list[int]) -> None:
        assert all(refs[b] == 0 and b != 0 for b in new), "a block handed out twice"

    def register(self, seq: Seq) -> None:
        # Final positions: every one below num_cached, except, while the prompt is incomplete, the last
        # known token (an empty final chunk recomputes it).
        blocks = seq.blocks
        num_final = seq.num_cached if seq.prompt_done else seq.num_cached - 1
        first, stop = blocks.num_registered, min(max(num_final, 0) // BS, len(blocks.block_ids))
        for i in range(first, stop):
            assert self.content[blocks.block_ids[i]] == seq.tokens[i * BS:(i + 1) * BS], \
                "a block registered before its contents were final"
        blocks.register(seq.tokens, num_final)
        assert blocks.num_registered == max(first, stop)
        for i in range(first, stop):
            b = blocks.block_ids[i]
            if self.pool.block_hash(b) is None:
                seq.duplicates.add(i)  # its hash was cached under another block: ours stays uncached
            else:
                assert self.pool.block_hash(b) == blocks.hashes[i]
                self.frozen[b] = tuple(seq.tokens[i * BS:(i + 1) * BS])

    def prefill(self, seq: Seq, chunk: list[int], partial: bool) -> None:
        blocks = seq.blocks
        seq.tokens += chunk
        known = len(seq.tokens)
        refs = self.refs()
        if not blocks.block_ids:  # the first chunk: share the cached prefix
            by_hash = self.pool.match(block_hashes(seq.tokens[:(known - 1) // BS * BS], BS, blocks.extra))
            seq.num_cached = blocks.match(seq.tokens)
            assert blocks.block_ids == by_hash, "the prefix index found other blocks than the sha256 chain"
            assert seq.num_cached == blocks.num_shared * BS < known
            for i, b in enumerate(blocks.block_ids):
                assert self.content[b] == seq.tokens[i * BS:(i + 1) * BS], "a match with other contents"
        if not partial and seq.num_cached == known:
            seq.num_cached -= 1  # an empty final chunk recomputes the last prompt token
        self.taken(refs, blocks.grow(known) if partial else blocks.grow_all())
        for pos in range(seq.num_cached, known):
            self.write(seq, pos, seq.tokens[pos])
        seq.num_cached = known
        if not partial:
            seq.prompt_done = True
            self.pool.record_query(known, blocks.num_shared * BS)
            seq.tokens.append(len(seq.tokens) % 5)  # the sampled token: the next step's input
        self.register(seq)

    def verify(self, seq: Seq, drafts: list[int], accepted: int, bonus: int) -> None:
        rows = [seq.tokens[-1]] + drafts
        for i, tok in enumerate(rows):
            self.write(seq, seq.num_cached + i, tok)
        # Tokens past the reservation are not kept (the sequence finishes by length); the KV of the
        # rejected rows is dead and is overwritten by later steps.
        seq.tokens += (drafts[:accepted] + [bonus])[:seq.capacity - len(seq.tokens)]
        seq.num_cached = len(seq.tokens) - 1
        self.register(seq)

    def refs(self) -> collections.Counter:
        return collections.Counter(b for s in self.seqs.values() for b in s.blocks.block_ids)

    # Rules ---------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.seqs) < 4 and sum(not s.prompt_done for s in self.seqs.values()) < 2)
    @rule(n=st.integers(1, 9))
    def alloc(self, n):
        if self.pool.can_allocate(n):
            self.seqs[self.next_id] = Seq(SequenceBlocks(self.pool, n))
            self.next_id += 1
        else:
            with pytest.raises(ResourceExhausted):
                SequenceBlocks(self.pool, n)
        self.publish()

    # Rules take plain arguments rather than st.data(): Hypothesis chose rules drawing from st.data()
    # about ten times less often than the others. `pick` chooses among the candidate sequences.
    @precondition(lambda self: any(not s.prompt_done for s in self.seqs.values()))
    @rule(pick=st.integers(0, 63), kind=st.sampled_from(["history", "prefix", "fresh"]), which=st.integers(0, 63),
          suffix=st.lists(st.integers(0, 1), max_size=12), partial=st.booleans())
    def prefill_chunk(self, pick, kind, which, suffix, partial):
        seq = self.pick([s for s in self.seqs.values() if not s.prompt_done], pick)
        room = seq.capacity - 1 - len(seq.tokens)  # the prompt leaves room for one new token
        # A first chunk often starts with a shared prefix, or resends an earlier sequence's whole
        # history (a multi-turn chat: prompt and generated tokens), so prompts end on and inside
        # cached blocks, and some are cached entirely.
        # A later chunk is often empty: how a router ends a prompt sent in partial chunks.
        prefix = []
        if not seq.tokens and kind == "history" and self.histories:
            prefix = list(self.pick(self.histories, which))
        elif not seq.tokens and kind == "prefix":
            prefix = self.pick(PREFIXES, which)
        elif seq.tokens and kind == "prefix":
            suffix = []
        chunk = (prefix + suffix)[:room]
        if not seq.tokens and not chunk:
            chunk = [1]
        if partial and len(seq.tokens) + len(chunk) >= seq.capacity - 1:
            partial = False
        self.prefill(seq, chunk, partial)
        self.publish()

    @precondition(lambda self: any(s.prompt_done and len(s.tokens) < s.capacity for s in self.seqs.values()))
    @rule(pick=st.integers(0, 63), drafts=st.lists(st.integers(0, 1), max_size=3), accepted=st.integers(0, 3),
          bonus=st.integers(0, 1))
    def decode_or_verify(self, pick, drafts, accepted, bonus):
        seq = self.pick([s for s in self.seqs.values() if s.prompt_done and len(s.tokens) < s.capacity], pick)
        drafts = drafts[:seq.capacity - len(seq.tokens)]  # no drafts: a decode step
        self.verify(seq, drafts, min(accepted, len(drafts)), bonus)
        self.publish()

    @precondition(lambda self: self.seqs)
    @rule(pick=st.integers(0, 63))
    def release(self, pick):
        sid = self.pick(sorted(self.seqs), pick)
        seq = self.seqs.pop(sid)
        if seq.prompt_done:
            self.histories.append(tuple(seq.tokens))
        seq.blocks.release()
        self.publish()

    @staticmethod
    def pick(items: list, index: int):
        return items[index % len(items)]

    # Hypothesis picks rules with few or no arguments far more often than the others: the next three
    # (and alloc, by the number of live sequences) are let in only on some steps, so that most steps
    # prefill, decode and release.
    @precondition(lambda self: self.num_steps % 8 == 7)
    @rule()
    def flush(self):
        self.pool.flush()
        self.publish()

    @precondition(lambda self: self.num_steps % 4 == 1)
    @rule(n=st.integers(1, 8))
    def allocate_under_pressure(self, n):
        """A transient unreserved allocation (evicts LRU blocks when the free list is short)."""
        if not self.pool.can_allocate(n):
            with pytest.raises(ResourceExhausted):
                self.pool.allocate(n)
            self.publish()
            return
        refs = self.refs()
        got = self.pool.allocate(n)
        assert all(refs[b] == 0 for b in got) and len(set(got)) == n
        for b in got:
            self.frozen.pop(b, None)
        self.pool.release(got)
        self.publish()

    @precondition(lambda self: self.num_steps % 4 == 3)
    @rule()
    def lagging_reader_catches_up(self):
        try:
            batches = self.pool.events.read(self.lag_cursor)
        except OutOfRange:  # fell behind the bounded log: resynchronise from a snapshot
            snap = self.pool.snapshot()
            self.lag_state = replay([snap])
            self.lag_cursor = snap.sequence_number + 1
            batches = self.pool.events.read(self.lag_cursor)
        replay(batches, self.lag_state)
        if batches:
            self.lag_cursor = batches[-1].sequence_number + 1
        assert self.lag_state == cached_hashes(self.pool)
        self.publish()  # nothing is pending: counts the step

    def publish(self):
        """Ends a step: the engine publishes its call's events; the main reader replays them."""
        self.num_steps += 1
        self.pool.events.publish()
        batches = self.pool.events.read(self.cursor)
        replay(batches, self.replayed)
        if batches:
            self.cursor = batches[-1].sequence_number + 1

    # Invariants ----------------------------------------------------------------------------------

    @invariant()
    def counts_balance(self):
        pool, refs = self.pool, self.refs()
        assert all(pool.ref_count(b) == refs[b] for b in range(NUM_BLOCKS)) and refs[0] == 0
        unreferenced = [b for b in range(1, NUM_BLOCKS) if refs[b] == 0]
        evictable = [b for b in unreferenced if pool.block_hash(b) is not None]
        assert pool.num_evictable_blocks == len(evictable)
        free = len(unreferenced) - len(evictable)
        assert free + len(evictable) + pool.num_referenced_blocks == NUM_BLOCKS - 1
        reserved = sum(s.blocks.num_reserved for s in self.seqs.values())
        assert pool.num_reserved_blocks == reserved and pool.num_free_blocks == len(unreferenced) - reserved >= 0

    @invariant()
    def cached_blocks_are_unchanged_and_referenced_ones_stay_cached(self):
        for b in range(1, NUM_BLOCKS):
            if self.pool.block_hash(b) is not None:
                assert tuple(self.content[b]) == self.frozen[b], "a cached block was written"
        for s in self.seqs.values():
            for i, b in enumerate(s.blocks.block_ids[:s.blocks.num_registered]):
                expect = None if i in s.duplicates else s.blocks.hashes[i]
                assert self.pool.block_hash(b) == expect, "a referenced block evicted"

    @invariant()
    def events_replay_to_the_cache(self):
        assert self.replayed == cached_hashes(self.pool)

    @invariant()
    def registered_blocks_hold_their_tokens(self):
        for s in self.seqs.values():
            hashes = s.blocks.hashes
            assert hashes == block_hashes(s.tokens[:len(hashes) * BS], BS)
            for i in range(s.blocks.num_registered):
                assert self.content[s.blocks.block_ids[i]] == s.tokens[i * BS:(i + 1) * BS]


PrefixCacheMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=100, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
test_prefix_cache_fuzz = PrefixCacheMachine.TestCase
