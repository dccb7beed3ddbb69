"""PrefixIndex: finds the cached blocks that begin a prompt without hashing the prompt with sha256.

Matching a prompt by its block hashes (engine/prefix_cache.py's recipe) costs one sha256 and some Python a
block: ~0.7 ms for a 4,096-token prompt on the H200 host, on the path of its first token. The index instead
keys every cached block by a 64-bit fingerprint of its whole prefix, computed for all of a prompt's blocks at
once in numpy, and then checks each candidate exactly against what the cache holds: the block's tokens, its
extra key, and its parent hash equal to the hash of the block matched before it. By induction from the first
block (which has no parent), the blocks found are the ones the sha256 chain would find, with the same hashes
(read from the index, not recomputed). A fingerprint collision can only cost a hit (the index keeps one block
per fingerprint; a candidate that fails the check ends the match), never share a wrong block.

Fingerprint of block i of a sequence (uint64 arithmetic, wrapping):
    f_j   = sum over positions p of the block: (token[p] + 1) * R[p]   (R: random odd multipliers, one per position)
    key_i = seed(extra) + sum over j <= i of f_j * Q[j]            (Q: random odd multipliers, one per block index)
R and Q are drawn per process (fingerprints are never shared: the sha256 hashes are the public names).

Owns: per block id (tables grown to the largest id indexed), its tokens, hash, parent hash (and whether it has one), extra id and fingerprint, for the
blocks the pool caches under this index; the fingerprint -> block map. The pool adds a block when it caches it
and removes it when it uncaches it."""
from __future__ import annotations

import array
import hashlib
import sys
from typing import Sequence

import numpy as np

_NONE = -1  # block table entry of a block the index does not hold
_MASK64 = (1 << 64) - 1
# Runs of at most this many blocks (a decode step's newly filled block) take Python-int arithmetic and per-row table
# writes: numpy's per-call costs (~1 us an op) dominate there; longer runs (prompts) take the vectorized forms.
SMALL_RUN = 2


class PrefixIndex:
    def __init__(self, num_blocks: int, block_size: int, seed: int | None = None):
        """seed: fixes the multipliers (tests); None draws them from the OS."""
        self.block_size = block_size
        self._rng = np.random.default_rng(seed)
        self._r = self._odd(block_size)
        self._q = self._odd(64)  # grown on demand
        self._r_ints, self._q_ints = self._r.tolist(), self._q.tolist()  # the same, as Python ints (SMALL_RUN)
        self._r_sum = self._r.sum(dtype=np.uint64)  # sum of R (wrapping): the "+ 1" of every token of a block
        self.num_blocks = num_blocks
        self._size = 0  # rows of the tables below: grown (doubling) to the largest block id added
        self._tokens = np.zeros((0, block_size), dtype=np.uint32)
        self._hash = np.zeros(0, dtype=np.int64)
        self._parent = np.zeros(0, dtype=np.int64)
        self._has_parent = np.zeros(0, dtype=bool)
        self._extra = np.full(0, _NONE, dtype=np.int32)
        self._key = np.zeros(0, dtype=np.uint64)
        self._block_of: dict[int, int] = {}       # fingerprint -> block id
        self._extra_ids: dict[bytes, int] = {}
        self._seeds: dict[bytes, np.uint64] = {}

    def _odd(self, n: int) -> np.ndarray:
        return self._rng.integers(0, 1 << 63, size=n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)

    def _extra_id(self, extra: bytes) -> int:
        if extra not in self._extra_ids:
            self._extra_ids[extra] = len(self._extra_ids)
        return self._extra_ids[extra]

    def _seed(self, extra: bytes) -> np.uint64:
        seed = self._seeds.get(extra)
        if seed is None:
            digest = hashlib.sha256(b"prefix-index" + extra).digest()
            seed = self._seeds[extra] = np.uint64(int.from_bytes(digest[:8], "little"))
        return seed

    def _grow(self, block_id: int) -> None:
        size = min(self.num_blocks, max(1024, 2 * self._size, block_id + 1))
        pad = size - self._size

        def grown(t: np.ndarray, fill) -> np.ndarray:
            return np.concatenate([t, np.full((pad,) + t.shape[1:], fill, dtype=t.dtype)])
        self._tokens, self._hash, self._parent = grown(self._tokens, 0), grown(self._hash, 0), grown(self._parent, 0)
        self._has_parent, self._extra, self._key = grown(self._has_parent, False), grown(self._extra, _NONE), \
            grown(self._key, 0)
        self._size = size

    # Fingerprints --------------------------------------------------------------------------------

    def _grow_q(self, n: int) -> None:
        """At least n block multipliers Q (doubling), in both forms."""
        while len(self._q) < n:
            self._q = np.concatenate([self._q, self._odd(len(self._q))])
            self._q_ints = self._q.tolist()

    def keys(self, ids: np.ndarray, first_block: int, prev_key: int | None, extra: bytes) -> list[int]:
        """The fingerprints of blocks ids (blocks_of), which are blocks first_block, first_block + 1, .. of their
        sequence; prev_key: the fingerprint of the block before (None for block 0)."""
        n = ids.shape[0]
        if n == 0:
            return []
        end = first_block + n
        self._grow_q(end)
        if n <= SMALL_RUN:  # the same sums mod 2**64 in Python ints
            k = int(self._seed(extra)) if prev_key is None else prev_key
            out = []
            for i, row in enumerate(ids.tolist(), first_block):
                f = sum((t + 1) * r for t, r in zip(row, self._r_ints))
                k = (k + f * self._q_ints[i]) & _MASK64
                out.append(k)
            return out
        k = self._block_sums(ids)
        k *= self._q[first_block:end]
        np.add.accumulate(k, out=k)  # the running sum over j <= i
        k += self._seed(extra) if prev_key is None else np.uint64(prev_key)
        return k.tolist()

    def _block_sums(self, ids: np.ndarray) -> np.ndarray:
        """f_j of each row of ids (uint64 [n], wrapping): sum over p of token[p] * R[p], plus the sum of R for the
        + 1 of each token. Integer arrays wrap without a warning (a numpy scalar would warn): only arrays here."""
        f = ids.astype(np.uint64) @ self._r
        f += self._r_sum
        return f

    def child_keys(self, ids: np.ndarray, block_index: Sequence[int], prev_keys: Sequence[int | None],
                   extra: bytes) -> list[int]:
        """The fingerprint of each block ids[i] (uint32 [n, block_size]) as block block_index[i] of its own sequence,
        after a block of fingerprint prev_keys[i] (None: block 0): keys() of one block each, for blocks of many
        sequences in one pass (a decode step's filled blocks)."""
        n = ids.shape[0]
        if n == 0:
            return []
        self._grow_q(max(block_index) + 1)
        if n <= SMALL_RUN:
            return [self.keys(ids[i:i + 1], block_index[i], prev_keys[i], extra)[0] for i in range(n)]
        seed = int(self._seed(extra))
        k = self._block_sums(ids)
        k *= self._q[np.asarray(block_index, dtype=np.int64)]
        k += np.asarray([seed if p is None else p for p in prev_keys], dtype=np.uint64)
        return k.tolist()

    # The cached blocks ---------------------------------------------------------------------------

    def add(self, block_id: int, key: int, block_hash: int, parent_hash: int | None, token_ids: Sequence[int],
            extra: bytes) -> None:
        """Indexes a block the pool has just cached (unless another block holds its fingerprint)."""
        self.add_run([block_id], [key], [block_hash], [parent_hash], [token_ids], extra)

    def add_run(self, block_ids: Sequence[int], keys: Sequence[int], hashes: Sequence[int],
                parents: Sequence[int | None], token_rows, extra: bytes) -> None:
        """add for several blocks the pool has just cached, in order (a fingerprint already held, or held by an
        earlier block of the run, keeps its block): one write of the tables' rows."""
        taken = []
        for j, (b, k) in enumerate(zip(block_ids, keys)):
            if k not in self._block_of:
                self._block_of[k] = b
                taken.append(j)
        if not taken:
            return
        top = max(block_ids[j] for j in taken)
        if top >= self._size:
            self._grow(top)
        if len(taken) <= SMALL_RUN:  # row by row: the same writes without numpy's per-call costs
            extra_id = self._extra_id(extra)
            for j in taken:
                b, parent = block_ids[j], parents[j]
                self._tokens[b] = token_rows[j]
                self._hash[b] = hashes[j]
                self._has_parent[b] = parent is not None
                self._parent[b] = 0 if parent is None else parent
                self._extra[b] = extra_id
                self._key[b] = keys[j]
            return
        ids = np.asarray([block_ids[j] for j in taken], dtype=np.int64)
        par = [parents[j] for j in taken]
        self._tokens[ids] = np.asarray(token_rows, dtype=np.uint32)[taken]
        self._hash[ids] = [hashes[j] for j in taken]
        self._has_parent[ids] = [p is not None for p in par]
        self._parent[ids] = [0 if p is None else p for p in par]
        self._extra[ids] = self._extra_id(extra)
        self._key[ids] = np.asarray([keys[j] for j in taken], dtype=np.uint64)

    def remove(self, block_id: int) -> None:
        """Forgets a block the pool no longer caches (nothing if it was not indexed)."""
        if block_id >= self._size or self._extra[block_id] == _NONE:
            return
        key = int(self._key[block_id])
        if self._block_of.get(key) == block_id:
            del self._block_of[key]
        self._extra[block_id] = _NONE

    def match(self, ids: np.ndarray, keys: list[int], extra: bytes) -> tuple[list[int], list[int]]:
        """The cached blocks that begin a sequence whose first blocks are ids (blocks_of; keys: keys(ids, 0, None,
        extra)) and their hashes: the longest run of candidates that pass the exact check."""
        cand = list(map(self._block_of.get, keys))
        try:
            m = cand.index(None)
        except ValueError:
            m = len(cand)
        if not m:
            return [], []
        del cand[m:]
        c = np.fromiter(cand, dtype=np.int64, count=m)
        tokens, hashes = self._tokens.take(c, axis=0), self._hash.take(c)
        parents, has_parent, extras = self._parent.take(c), self._has_parent.take(c), self._extra.take(c)
        extra_id = self._extra_ids.get(extra, _NONE - 1)
        # Every candidate passes unless fingerprints collided: checked whole first, each table's values against
        # the expected ones as raw bytes (equal uint32, int64, bool and int32 values are equal bytes), row by row
        # only where that fails.
        if (tokens.tobytes() == ids[:m].tobytes() and parents[1:].tobytes() == hashes[:-1].tobytes()
                and has_parent.tobytes() == b"\0" + b"\1" * (m - 1)
                and extras.tobytes() == extra_id.to_bytes(4, sys.byteorder, signed=True) * m):
            return cand, hashes.tolist()
        ok = (tokens == ids[:m]).all(axis=1)
        ok &= extras == extra_id
        ok[0] &= not has_parent[0]
        ok[1:] &= has_parent[1:] & (parents[1:] == hashes[:-1])
        good = m if ok.all() else int(np.argmin(ok))
        return cand[:good], hashes[:good].tolist()


def blocks_of(token_ids: Sequence[int] | np.ndarray, block_size: int) -> np.ndarray:
    """The full blocks of token_ids (a uint32 array is taken as it is) as uint32 [n, block_size]; ValueError for
    ids outside [0, 2**32)."""
    n = len(token_ids) // block_size
    if isinstance(token_ids, np.ndarray) and token_ids.dtype == np.uint32:
        return token_ids[:n * block_size].reshape(n, block_size)
    try:
        packed = array.array("I", token_ids if len(token_ids) == n * block_size else token_ids[:n * block_size])
    except (OverflowError, TypeError):
        raise ValueError("token ids must be integers in [0, 2**32)") from None
    return np.frombuffer(packed, dtype=np.uint32).reshape(n, block_size)
